# The controller image: one static binary, CA certificates and a non-root user; no shell.
#
#   docker build -t ghcr.io/targetlease/targetlease:0.2.0 --build-arg TARGETLEASE_BUILD_COMMIT="$(git rev-parse HEAD)" --build-arg SOURCE_DATE_EPOCH="$(git log -1 --format=%ct)" .
#
# The build context has no .git: the two build arguments give `targetlease --version` and the
# targetlease_build_info metric their commit and date (both `unknown` without them).
#
# Without Docker, `scripts/image.sh` builds the same image (same binary build, user, paths,
# entrypoint, command, port and labels: it reads them from this file's last stage) as an OCI
# tarball, and the node suite runs it on a real kubelet (docs/install.md, "The image").
# The binary links glibc statically (rustls with ring, no OpenSSL), so the "static" distroless
# base is enough: CA certificates for rediss:// and the API server, /etc/passwd, /tmp.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
# cargo-auditable embeds the dependency list (the version pinned in scripts/env.sh).
RUN cargo install --locked --version 0.7.7 cargo-auditable
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY lua ./lua
COPY crds ./crds
# A workspace member (the tests' support crate) and the test and bench targets Cargo.toml
# declares: cargo reads them, builds none of them.
COPY test-support ./test-support
COPY tests ./tests
COPY benches ./benches
# Read by build.rs (see the top of this file); empty when not given. Declared here, just before
# the build, so that a new commit leaves the layers above in the build cache.
ARG TARGETLEASE_BUILD_COMMIT=
ARG SOURCE_DATE_EPOCH
# The flags of scripts/env.sh's static_cargo (the registry path remapped for this image's).
RUN CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols --remap-path-prefix=/usr/local/cargo/registry/src=/cargo" \
    cargo auditable build --release --locked --target x86_64-unknown-linux-gnu --bin targetlease \
 && install -D -m 0555 target/x86_64-unknown-linux-gnu/release/targetlease /out/targetlease

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/targetlease /targetlease
# 65532 is distroless's "nonroot"; the chart runs the pod as this user with a read-only root
# file system and no capabilities.
USER 65532:65532
WORKDIR /
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.title="targetlease" \
      org.opencontainers.image.description="Kubernetes operator: fenced leases on Valkey" \
      org.opencontainers.image.version="0.2.0" \
      org.opencontainers.image.source="https://github.com/targetlease/targetlease" \
      org.opencontainers.image.licenses="Apache-2.0"
EXPOSE 8080
ENTRYPOINT ["/targetlease"]
CMD ["controller"]

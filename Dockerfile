# The controller image: one binary on a distroless base, running as a non-root user.
# Not built by the test suite (the development machines have no container runtime); see
# docs/install.md, "The image".
#
#   docker build -t ghcr.io/targetlease/targetlease:0.1.0 .
#
# The binary links glibc and libgcc only (rustls with ring, no OpenSSL), which the distroless
# "cc" base provides, with CA certificates for rediss:// and the API server.

FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY lua ./lua
COPY crds ./crds
# A workspace member (the tests' support crate): cargo reads its manifest, builds none of it.
COPY test-support ./test-support
RUN cargo build --release --locked \
 && install -D -m 0555 target/release/targetlease /out/targetlease

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/targetlease /targetlease
# 65532 is distroless's "nonroot"; the chart runs the pod as this user with a read-only root
# file system and no capabilities.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/targetlease"]
CMD ["controller"]

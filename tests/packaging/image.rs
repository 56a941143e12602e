//! The controller image, built without a daemon (`scripts/image.sh`): its configuration is the
//! Dockerfile's (read here by an independent parser), its blobs match their digests, its binary
//! is static and alone (no shell), the same binary gives the same image, and `runc` runs its root
//! file system the way the chart runs the pod (read-only root, user 65532, no capabilities, no
//! new privileges) against a real API server and Valkey: the controller becomes ready and a
//! TargetLease is Held. A missing runc, control plane or server fails the suite; it never skips.

use targetlease_test_support as support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion};
use serde_json::{Value, json};

use support::kube::{Cluster, http_get, lease_yaml, repo};
use support::oci::{Layout, build_controller_image, sh, unpack};
use support::server::{Server, ServerKind, free_port};

/// The image the suite checks, built once.
struct Image {
    /// The OCI tarball.
    tarball: PathBuf,
    /// `name@digest`, as scripts/image.sh wrote it beside the tarball.
    reference: String,
    /// The tarball unpacked.
    layout: Layout,
}

fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let (tarball, reference) = build_controller_image();
        let layout = unpack(&tarball);
        Image {
            tarball,
            reference,
            layout,
        }
    })
}

/// The instructions of the Dockerfile's last stage, continuation lines joined.
fn dockerfile_last_stage() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    let joined = text.replace("\\\n", " ");
    let mut stage = Vec::new();
    for line in joined.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        if word.eq_ignore_ascii_case("FROM") {
            stage.clear();
        } else {
            stage.push((word.to_ascii_uppercase(), rest.trim().to_owned()));
        }
    }
    stage
}

/// `k="v" k2="v 2"` as a map.
fn label_pairs(text: &str) -> BTreeMap<String, String> {
    let mut pairs = BTreeMap::new();
    let mut rest = text.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let after = after.strip_prefix('"').expect("LABEL values are quoted");
        let (value, tail) = after.split_once('"').expect("closing quote");
        pairs.insert(key.trim().to_owned(), value.to_owned());
        rest = tail.trim();
    }
    pairs
}

fn instruction<'a>(stage: &'a [(String, String)], word: &str) -> &'a str {
    stage
        .iter()
        .rev()
        .find(|(w, _)| w == word)
        .map(|(_, rest)| rest.as_str())
        .unwrap_or_else(|| panic!("the Dockerfile's last stage has no {word}"))
}

fn sha256_of(path: &Path) -> String {
    let out = sh("sha256sum", &[&path.display().to_string()]);
    format!("sha256:{}", out.split_whitespace().next().expect("digest"))
}

fn layer_entries() -> Vec<String> {
    sh(
        "tar",
        &["-tvzf", &image().layout.layer.display().to_string()],
    )
    .lines()
    .map(str::to_owned)
    .collect()
}

fn image_follows_the_dockerfile() {
    let stage = dockerfile_last_stage();
    let config = &image().layout.config["config"];
    let json_form = |word: &str| -> Value {
        serde_json::from_str(instruction(&stage, word)).expect("JSON form in the Dockerfile")
    };
    assert_eq!(config["User"], json!(instruction(&stage, "USER")));
    assert_eq!(config["WorkingDir"], json!(instruction(&stage, "WORKDIR")));
    let env = instruction(&stage, "ENV");
    assert!(
        config["Env"]
            .as_array()
            .is_some_and(|e| e.iter().any(|v| v == env)),
        "the image lacks ENV {env}: {}",
        config["Env"]
    );
    assert_eq!(config["Entrypoint"], json_form("ENTRYPOINT"));
    assert_eq!(config["Cmd"], json_form("CMD"));
    let port = format!("{}/tcp", instruction(&stage, "EXPOSE"));
    assert_eq!(config["ExposedPorts"], json!({ port: {} }));
    let labels = label_pairs(instruction(&stage, "LABEL"));
    assert_eq!(config["Labels"], json!(labels));
    assert_eq!(
        labels
            .get("org.opencontainers.image.version")
            .map(String::as_str),
        Some(env!("CARGO_PKG_VERSION")),
        "the image version label is the crate's"
    );
    // The binary sits where the Dockerfile copies it, and the entrypoint names it.
    let copy = instruction(&stage, "COPY");
    let dest = copy.split_whitespace().last().expect("COPY destination");
    assert_eq!(config["Entrypoint"][0], json!(dest));
    let entries = layer_entries();
    let binary = entries
        .iter()
        .find(|l| l.ends_with(&format!(" {}", dest.trim_start_matches('/'))))
        .unwrap_or_else(|| panic!("no {dest} in the layer: {entries:#?}"));
    assert!(binary.starts_with("-r-xr-xr-x 0/0"), "{binary}");
    assert!(
        image().reference.starts_with(&format!(
            "ghcr.io/targetlease/targetlease:{}@sha256:",
            env!("CARGO_PKG_VERSION")
        )),
        "{}",
        image().reference
    );
}

/// What `docker build` sends: the build stage's COPY sources, each let through by
/// .dockerignore, make a tree cargo accepts (Cargo.toml declares test and bench targets; a
/// context without their files fails before anything builds, as it did before tests/ and
/// benches/ were let through).
fn dockerfile_build_context_is_complete() {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    // [header comments, the build stage, the final stage]
    let build_stage = text.split("\nFROM ").nth(1).expect("a build stage");
    // The context has no .git: build.rs reads the commit and the date from these build
    // arguments (tests/packaging/release.rs runs it without a checkout).
    for arg in ["TARGETLEASE_BUILD_COMMIT", "SOURCE_DATE_EPOCH"] {
        assert!(
            build_stage
                .lines()
                .any(|l| l.strip_prefix("ARG ").is_some_and(|a| a.starts_with(arg))),
            "the build stage declares no ARG {arg} for build.rs"
        );
    }
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).expect(".dockerignore");
    let allowed: Vec<&str> = ignore
        .lines()
        .filter_map(|l| l.trim().strip_prefix('!'))
        .map(|l| l.trim_end_matches('/'))
        .collect();
    let context = tempfile::tempdir().expect("dir");
    let mut copied = 0;
    for line in build_stage.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line.split_whitespace().skip(1).collect();
        let (sources, dest) = words.split_at(words.len() - 1);
        for source in sources {
            assert!(
                allowed.contains(source),
                ".dockerignore keeps {source} out of the build context"
            );
            let to = if dest[0].ends_with('/') {
                context.path().join(source)
            } else {
                context.path().join(dest[0].trim_start_matches("./"))
            };
            sh(
                "cp",
                &[
                    "-r",
                    &repo().join(source).display().to_string(),
                    &to.display().to_string(),
                ],
            );
            copied += 1;
        }
    }
    assert!(copied >= 5, "the build stage copies {copied} sources");
    // `cargo fetch` accepts a manifest whose build script is missing; the build then fails.
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).expect("Cargo.toml");
    let script = manifest
        .lines()
        .find_map(|l| l.strip_prefix("build = \"")?.strip_suffix('"'))
        .expect("Cargo.toml names its build script");
    assert!(
        context.path().join(script).is_file(),
        "the build context lacks {script}, Cargo.toml's build script"
    );
    // `cargo fetch` loads the manifest as a build does (every declared target must exist;
    // `cargo metadata` does not check that) and resolves the locked dependencies offline.
    let out = Command::new("cargo")
        .args([
            "fetch",
            "--locked",
            "--offline",
            "--target",
            "x86_64-unknown-linux-gnu",
        ])
        .current_dir(context.path())
        .output()
        .expect("cargo fetch");
    assert!(
        out.status.success(),
        "cargo refuses the Docker build context:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn blobs_match_their_digests() {
    let img = image();
    let dir = img.layout.dir.path().join("blobs/sha256");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("blobs") {
        let path = entry.expect("blob").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        assert_eq!(sha256_of(&path), format!("sha256:{name}"));
        checked += 1;
    }
    assert_eq!(checked, 3, "one manifest, one config, one layer");
    // The config names the uncompressed layer (diff id), the manifest the compressed one.
    let plain = img.layout.dir.path().join("layer.tar");
    let out = Command::new("gzip")
        .args(["-dc"])
        .arg(&img.layout.layer)
        .output()
        .expect("gzip");
    std::fs::write(&plain, out.stdout).expect("write");
    assert_eq!(
        img.layout.config["rootfs"]["diff_ids"][0],
        json!(sha256_of(&plain))
    );
    let digest = img.reference.split('@').nth(1).expect("digest");
    let index = &img.layout.index;
    assert_eq!(index["manifests"][0]["digest"], json!(digest));
    assert_eq!(
        index["manifests"][0]["annotations"]["io.containerd.image.name"],
        json!(img.reference.split('@').next().expect("name"))
    );
    assert_eq!(
        img.layout.manifest["layers"].as_array().map(Vec::len),
        Some(1)
    );
}

fn binary_is_static_and_alone() {
    let entries = layer_entries();
    let names: Vec<&str> = entries
        .iter()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    for path in ["bin/sh", "bin/busybox", "usr/bin/env", "lib", "usr/lib"] {
        assert!(
            !names.iter().any(|n| n.trim_end_matches('/') == path),
            "the image holds {path}: {names:?}"
        );
    }
    for path in [
        "etc/ssl/certs/ca-certificates.crt",
        "etc/passwd",
        "etc/nsswitch.conf",
        "tmp/",
    ] {
        assert!(names.contains(&path), "the image lacks {path}: {names:?}");
    }
    let tmp = entries.iter().find(|l| l.ends_with(" tmp/")).expect("tmp");
    assert!(tmp.starts_with("drwxrwxrwt"), "{tmp}");
    // No program interpreter (PT_INTERP): the kernel runs it with nothing else in the image.
    let unpacked = tempfile::tempdir().expect("dir");
    sh(
        "tar",
        &[
            "-xzf",
            &image().layout.layer.display().to_string(),
            "-C",
            &unpacked.path().display().to_string(),
            "targetlease",
        ],
    );
    let elf = std::fs::read(unpacked.path().join("targetlease")).expect("binary");
    assert_eq!(&elf[..4], b"\x7fELF");
    // No path of the machine that built it: not the checkout (its sources are named relative to
    // it), not cargo's registry (remapped to /cargo). So the binary does not depend on where the
    // sources were, and neither do the release build's flags, nor its cache.
    let cargo_home = std::env::var("CARGO_HOME")
        .unwrap_or_else(|_| format!("{}/.cargo", std::env::var("HOME").unwrap_or_default()));
    for machine_path in [repo().display().to_string(), cargo_home] {
        assert!(
            !elf.windows(machine_path.len())
                .any(|w| w == machine_path.as_bytes()),
            "the binary holds the path {machine_path}"
        );
    }
    assert!(
        elf.windows(b"src/controller/".len())
            .any(|w| w == b"src/controller/"),
        "the binary names its own sources as src/...: the check above would pass on anything"
    );
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().expect("8 bytes")) as usize;
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    const PT_DYNAMIC: u32 = 2;
    const PT_INTERP: u32 = 3;
    const DT_NEEDED: usize = 1;
    for header in (0..phnum).map(|i| phoff + i * phentsize) {
        let kind = u32::from_le_bytes(elf[header..header + 4].try_into().expect("4 bytes"));
        assert_ne!(kind, PT_INTERP, "the binary needs a program interpreter");
        if kind == PT_DYNAMIC {
            // A static PIE relocates itself: it has a dynamic section, but needs no library.
            let (offset, size) = (u64_at(header + 8), u64_at(header + 32));
            for entry in (offset..offset + size).step_by(16) {
                assert_ne!(
                    u64_at(entry),
                    DT_NEEDED,
                    "the binary needs a shared library"
                );
            }
        }
    }
}

fn same_binary_same_image() {
    let first = image();
    let (tarball, reference) = build_controller_image();
    assert_eq!(tarball, first.tarball);
    assert_eq!(
        reference, first.reference,
        "a rebuild changed the image digest"
    );
}

/// The release build runs the pinned cargo-auditable (it shapes the binary, and so the image
/// digest), whatever another one found first on PATH: `cargo auditable` would run that one.
/// Asked for `build --help`, which runs the wrapper and cargo without building.
fn release_build_runs_the_pinned_cargo_auditable() {
    let fake = tempfile::tempdir().expect("temp dir");
    let script = fake.path().join("cargo-auditable");
    std::fs::write(
        &script,
        "#!/bin/sh\necho 'the other cargo-auditable ran' >&2\nexit 1\n",
    )
    .expect("write");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let path = format!(
        "{}:{}",
        fake.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |command: &str| {
        Command::new("bash")
            .args(["-c", &format!("source scripts/env.sh && {command}")])
            .current_dir(repo())
            .env("PATH", &path)
            .output()
            .expect("run bash")
    };
    // The fake is what cargo itself would run.
    let plain = run("cargo auditable build --help");
    assert!(
        String::from_utf8_lossy(&plain.stderr).contains("other cargo-auditable ran"),
        "the fake cargo-auditable is not first: the test proves nothing"
    );
    let out = run("static_cargo auditable build --help");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.contains("Usage: cargo build") && !said.contains("other"),
        "static_cargo auditable did not run the pinned cargo-auditable: {said}"
    );
}

/// Runs the image's root file system with runc as the chart runs the pod: read-only root, user
/// and group 65532, no capabilities, no new privileges, its own PID, IPC, UTS and mount
/// namespaces (the host's network, so it reaches the test's API server and Valkey on
/// loopback). The controller must become ready and hold a TargetLease; the process must have
/// exactly the credentials asked for.
fn runc_runs_the_controller_as_the_chart_would() {
    let runc = which("runc").expect("runc is not installed (scripts/install-test-deps.sh)");
    let cluster = Cluster::start();
    cluster.install_crd();
    let valkey = Server::start_with(ServerKind::Valkey91, &["--requirepass", "image-secret"]);
    let bundle = tempfile::tempdir().expect("bundle");
    let rootfs = bundle.path().join("rootfs");
    std::fs::create_dir(&rootfs).expect("rootfs");
    sh(
        "tar",
        &[
            "-xzf",
            &image().layout.layer.display().to_string(),
            "-C",
            &rootfs.display().to_string(),
        ],
    );
    // What the kubelet mounts: the API server's credentials and the Valkey password (here a
    // kubeconfig for loopback instead of the ServiceAccount token), /etc/hosts.
    let secrets = bundle.path().join("secrets");
    std::fs::create_dir(&secrets).expect("secrets");
    std::fs::write(secrets.join("password"), "image-secret").expect("password");
    std::fs::copy(cluster.kubeconfig(), secrets.join("kubeconfig")).expect("kubeconfig");
    // As the kubelet mounts a Secret for a pod with fsGroup 65532: group-readable, no more.
    for (path, mode) in [
        (secrets.clone(), 0o750),
        (secrets.join("password"), 0o440),
        (secrets.join("kubeconfig"), 0o440),
    ] {
        std::os::unix::fs::chown(&path, Some(0), Some(65532)).expect("chown");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .expect("chmod");
    }
    // The bundle's folders are temporary folders (0700): the container's user must pass them.
    std::fs::set_permissions(
        bundle.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .expect("chmod");
    let port = valkey.url().rsplit(':').next().expect("port").to_owned();
    let http = free_port();
    let config = runtime_spec(
        &rootfs,
        &secrets,
        &[
            "/targetlease",
            "controller",
            "--backend=valkey",
            &format!("--http-addr=127.0.0.1:{http}"),
        ],
        &[
            "KUBECONFIG=/etc/targetlease/secrets/kubeconfig".to_owned(),
            // A host name, not an address: glibc, linked statically, resolves it from /etc/hosts.
            format!("TARGETLEASE_VALKEY_URL=redis://localhost:{port}"),
            "TARGETLEASE_VALKEY_PASSWORD_FILE=/etc/targetlease/secrets/password".to_owned(),
            "POD_NAME=image-test".to_owned(),
            "POD_NAMESPACE=default".to_owned(),
        ],
    );
    std::fs::write(
        bundle.path().join("config.json"),
        serde_json::to_vec_pretty(&config).expect("json"),
    )
    .expect("config.json");
    let id = format!("targetlease-image-{}", std::process::id());
    let log = std::fs::File::create(bundle.path().join("controller.log")).expect("log");
    let pid_file = bundle.path().join("pid");
    let started = Instant::now();
    let status = Command::new(&runc)
        .args(["run", "--detach", "--pid-file"])
        .arg(&pid_file)
        .arg("--bundle")
        .arg(bundle.path())
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .status()
        .expect("runc run");
    let container = Container {
        runc: runc.clone(),
        id: id.clone(),
    };
    let logs = || std::fs::read_to_string(bundle.path().join("controller.log")).unwrap_or_default();
    assert!(status.success(), "runc run failed: {status}\n{}", logs());
    let pid = std::fs::read_to_string(&pid_file).expect("pid file");
    let pid = pid.trim();

    let status_of = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| -> String {
        status_of
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(field("Uid"), "65532 65532 65532 65532");
    assert_eq!(field("Gid"), "65532 65532 65532 65532");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(field(caps), "0000000000000000", "{caps}");
    }
    assert_eq!(field("NoNewPrivs"), "1");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .expect("the root mount");
    let options = root.split_whitespace().nth(5).expect("mount options");
    assert!(
        options.split(',').any(|o| o == "ro"),
        "root is not read-only: {root}"
    );

    let mut ready = false;
    while started.elapsed() < Duration::from_secs(60) {
        if matches!(
            http_get(&format!("127.0.0.1:{http}"), "/readyz"),
            Some((200, _))
        ) {
            ready = true;
            break;
        }
        if !Path::new(&format!("/proc/{pid}")).exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(ready, "the controller never became ready:\n{}", logs());
    eprintln!(
        "measured: image controller ready: {} ms",
        started.elapsed().as_millis()
    );

    cluster.apply(&lease_yaml(
        "default",
        "in-image",
        "image-target",
        "image-holder",
        "",
    ));
    let mut phase = String::new();
    while started.elapsed() < Duration::from_secs(90) {
        phase = cluster.kubectl_ok(&[
            "get",
            "targetlease",
            "in-image",
            "-n",
            "default",
            "-o",
            "jsonpath={.status.phase}",
        ]);
        if phase == "Held" {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(phase, "Held", "controller log:\n{}", logs());
    let held = valkey.raw(&["KEYS", "tl:{default/image-target}:*"]);
    assert!(held.contains(":fence"), "no fence in Valkey: {held}");
    drop(container);
    let secret_in_log = logs().contains("image-secret");
    assert!(!secret_in_log, "the password reached the log");
}

/// Deletes the container however the test ends.
struct Container {
    runc: PathBuf,
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new(&self.runc)
            .args(["delete", "--force", &self.id])
            .status();
    }
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}

/// An OCI runtime spec for the controller container: what the chart's securityContext asks the
/// kubelet for, written out.
fn runtime_spec(rootfs: &Path, secrets: &Path, args: &[&str], env: &[String]) -> Value {
    let mut env = env.to_vec();
    env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    let bind = |source: &Path, dest: &str| {
        json!({"destination": dest, "type": "bind", "source": source,
               "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]})
    };
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 65532, "gid": 65532, "additionalGids": [65532]},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": true},
        "hostname": "image-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            bind(Path::new("/etc/hosts"), "/etc/hosts"),
            bind(secrets, "/etc/targetlease/secrets")
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                            "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq",
                              "/proc/sys", "/proc/sysrq-trigger"]
        }
    })
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let test = support::suite::blocking_trial;
    let trials = vec![
        test("image_follows_the_dockerfile", image_follows_the_dockerfile),
        test("blobs_match_their_digests", blobs_match_their_digests),
        test(
            "dockerfile_build_context_is_complete",
            dockerfile_build_context_is_complete,
        ),
        test("binary_is_static_and_alone", binary_is_static_and_alone),
        test("same_binary_same_image", same_binary_same_image),
        test(
            "release_build_runs_the_pinned_cargo_auditable",
            release_build_runs_the_pinned_cargo_auditable,
        ),
        test(
            "runc_runs_the_controller_as_the_chart_would",
            runc_runs_the_controller_as_the_chart_would,
        ),
    ];
    support::suite::run(args, trials)
}

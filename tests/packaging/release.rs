//! The release kit (`scripts/release.sh`), built once into a temporary folder: SHA256SUMS verifies
//! it and catches a changed byte; the binary names the checkout's commit and is the image's; the
//! dependency list embedded in the binary (cargo-auditable's `.dep-v0` section, read here from
//! the ELF file) names exactly the crates of Cargo.lock linked into it, and so does the SBOM,
//! with no dev-dependency and no build-only crate; the packaged chart installs on a real control
//! plane with the image of its appVersion; RELEASE_NOTES.md is CHANGELOG.md's section; the
//! script refuses a dirty tree, a chart of another version and a version without release notes;
//! and build.rs names the commit and date with and without a checkout.

use targetlease_test_support as support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Instant;

use libtest_mimic::{Arguments, Conclusion};
use serde_json::Value;

use support::kube::{Cluster, repo, run_with_input};
use support::oci::{sh, unpack};

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The triple scripts/env.sh builds the static binary for.
const TRIPLE: &str = "x86_64-unknown-linux-gnu";

/// A (name, version) pair.
type Crate = (String, String);

/// The kit, built once.
pub(crate) struct Kit {
    dir: tempfile::TempDir,
}

impl Kit {
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn binary(&self) -> PathBuf {
        self.path(&format!("targetlease-{VERSION}-{TRIPLE}"))
    }
}

/// Runs `scripts/release.sh ARGS` in `checkout`, stopped (with everything it started) after
/// `limit` seconds.
fn release_sh(checkout: &Path, args: &[&str], limit: u32) -> Output {
    let mut command = Command::new("timeout");
    command
        .arg(format!("{limit}s"))
        .arg("bash")
        .arg(checkout.join("scripts/release.sh"))
        .args(args)
        .current_dir(checkout);
    run_with_input(command, None)
}

fn git(checkout: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(checkout)
        .args(args)
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The kit, built by `scripts/release.sh` once per run of the binary (the node suite installs
/// from it too).
pub(crate) fn kit() -> &'static Kit {
    static KIT: OnceLock<Kit> = OnceLock::new();
    KIT.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path().display().to_string();
        let mut args = vec!["--out", out.as_str()];
        // A development tree has uncommitted changes; a CI clone has none, and then the kit is
        // built exactly as a release is.
        if !git(&repo(), &["status", "--porcelain"]).is_empty() {
            eprintln!("the work tree is dirty: building the kit with --allow-dirty");
            args.push("--allow-dirty");
        }
        let started = Instant::now();
        // A cold cache builds the release binary: minutes on 2 cores.
        let output = release_sh(&repo(), &args, 3600);
        assert!(
            output.status.success(),
            "scripts/release.sh failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        support::suite::measured("scripts/release.sh", started.elapsed());
        Kit { dir }
    })
}

fn sha256sum_check(dir: &Path) -> Output {
    let mut command = Command::new("sha256sum");
    command.args(["-c", "SHA256SUMS"]).current_dir(dir);
    run_with_input(command, None)
}

fn sums_verify_the_kit_and_catch_a_changed_byte() {
    let kit = kit();
    let sums = std::fs::read_to_string(kit.path("SHA256SUMS")).expect("SHA256SUMS");
    let listed: BTreeSet<&str> = sums
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    let present: BTreeSet<String> = std::fs::read_dir(kit.dir.path())
        .expect("kit")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n != "SHA256SUMS")
        .collect();
    assert_eq!(
        listed,
        present.iter().map(String::as_str).collect(),
        "SHA256SUMS does not list every artifact"
    );
    for name in [
        format!("targetlease-{VERSION}-{TRIPLE}"),
        format!("targetlease-{VERSION}.oci.tar"),
        format!("targetlease-{VERSION}.cdx.json"),
        format!("targetlease-{VERSION}.tgz"),
        "RELEASE_NOTES.md".to_owned(),
        "LICENSE".to_owned(),
    ] {
        assert!(present.contains(&name), "the kit lacks {name}: {present:?}");
    }
    let out = sha256sum_check(kit.dir.path());
    assert!(
        out.status.success(),
        "sha256sum -c: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // One byte of the binary changed, in a copy of the kit.
    let copy = tempfile::tempdir().expect("temp dir");
    for name in &present {
        std::fs::copy(kit.path(name), copy.path().join(name)).expect("copy");
    }
    std::fs::copy(kit.path("SHA256SUMS"), copy.path().join("SHA256SUMS")).expect("copy");
    let binary = copy.path().join(format!("targetlease-{VERSION}-{TRIPLE}"));
    let mut bytes = std::fs::read(&binary).expect("binary");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&binary, bytes).expect("write");
    let out = sha256sum_check(copy.path());
    assert!(
        !out.status.success(),
        "sha256sum -c accepted a changed binary"
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(&format!("targetlease-{VERSION}-{TRIPLE}: FAILED")),
        "{report}"
    );
}

fn binary_names_the_commit_and_is_the_images() {
    let kit = kit();
    let commit = git(&repo(), &["rev-parse", "HEAD"]);
    let epoch = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(value) => value,
        Err(_) => git(&repo(), &["log", "-1", "--format=%ct", "HEAD"]),
    };
    let date = sh("date", &["-u", "-d", &format!("@{epoch}"), "+%F"]);
    let version = sh(&kit.binary().display().to_string(), &["--version"]);
    assert_eq!(
        version.trim(),
        format!(
            "targetlease {VERSION} (commit {}, built {})",
            &commit[..12],
            date.trim()
        )
    );
    // The image's binary is this binary, byte for byte.
    let layout = unpack(&kit.path(&format!("targetlease-{VERSION}.oci.tar")));
    let rootfs = tempfile::tempdir().expect("temp dir");
    sh(
        "tar",
        &[
            "-xzf",
            &layout.layer.display().to_string(),
            "-C",
            &rootfs.path().display().to_string(),
            "targetlease",
        ],
    );
    assert!(
        std::fs::read(rootfs.path().join("targetlease")).expect("the image's binary")
            == std::fs::read(kit.binary()).expect("the kit's binary"),
        "the image holds another binary than the kit"
    );
}

/// The bytes of the ELF64 (little-endian) section `name` of `elf`.
fn elf_section<'a>(elf: &'a [u8], name: &str) -> Option<&'a [u8]> {
    assert_eq!(&elf[..4], b"\x7fELF");
    assert_eq!((elf[4], elf[5]), (2, 1), "an ELF64 little-endian file");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().expect("4 bytes")) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().expect("8 bytes")) as usize;
    let (shoff, shentsize, shnum, shstrndx) =
        (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
    let header = |i: usize| shoff + i * shentsize;
    let names = u64_at(header(shstrndx) + 0x18);
    (0..shnum).find_map(|i| {
        let h = header(i);
        let start = names + u32_at(h);
        let end = start + elf[start..].iter().position(|&b| b == 0)?;
        (&elf[start..end] == name.as_bytes()).then(|| {
            let (offset, size) = (u64_at(h + 0x18), u64_at(h + 0x20));
            &elf[offset..offset + size]
        })
    })
}

/// zlib-decompressed `data` (Python's zlib: the tests carry no compression crate).
fn zlib_decompress(data: &[u8]) -> Vec<u8> {
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import sys, zlib; sys.stdout.buffer.write(zlib.decompress(sys.stdin.buffer.read()))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), data).expect("write");
    let out = child.wait_with_output().expect("python3");
    assert!(out.status.success(), "the section is no zlib stream");
    out.stdout
}

fn name_version(v: &Value) -> Crate {
    (
        v["name"].as_str().expect("name").to_owned(),
        v["version"].as_str().expect("version").to_owned(),
    )
}

/// Every package of Cargo.lock, with its checksum (None for the workspace's own).
fn cargo_lock() -> BTreeMap<Crate, Option<String>> {
    let text = std::fs::read_to_string(repo().join("Cargo.lock")).expect("Cargo.lock");
    let mut packages = BTreeMap::new();
    for block in text.split("[[package]]").skip(1) {
        let field = |key: &str| {
            block.lines().find_map(|l| {
                l.strip_prefix(&format!("{key} = \""))
                    .and_then(|v| v.strip_suffix('"'))
                    .map(str::to_owned)
            })
        };
        packages.insert(
            (
                field("name").expect("name"),
                field("version").expect("version"),
            ),
            field("checksum"),
        );
    }
    packages
}

fn embedded_list_and_sbom_are_the_crates_built_in() {
    let kit = kit();
    let elf = std::fs::read(kit.binary()).expect("binary");
    let section = elf_section(&elf, ".dep-v0").expect("the binary has no .dep-v0 section");
    let embedded: Value =
        serde_json::from_slice(&zlib_decompress(section)).expect("the list is JSON");
    let packages = embedded["packages"].as_array().expect("packages");
    let lock = cargo_lock();
    for package in packages {
        let c = name_version(package);
        assert!(lock.contains_key(&c), "{c:?} is not in Cargo.lock");
    }

    // Proc macros run in the compiler and build dependencies in build scripts: neither is
    // linked in. Cargo marks proc macros by their target kind; cargo-auditable records build
    // dependencies (and what only they need) as kind "build".
    let metadata: Value = serde_json::from_str(&sh(
        "cargo",
        &[
            "metadata",
            "--locked",
            "--format-version",
            "1",
            "--filter-platform",
            TRIPLE,
            "--manifest-path",
            &repo().join("Cargo.toml").display().to_string(),
        ],
    ))
    .expect("cargo metadata");
    let proc_macros: BTreeSet<Crate> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| {
            p["targets"]
                .as_array()
                .is_some_and(|ts| ts.iter().any(|t| t["kind"][0] == "proc-macro"))
        })
        .map(name_version)
        .collect();
    let licenses: BTreeMap<Crate, Option<String>> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (name_version(p), p["license"].as_str().map(str::to_owned)))
        .collect();
    let root = packages
        .iter()
        .position(|p| p["root"] == Value::Bool(true))
        .expect("a root package");
    assert_eq!(
        name_version(&packages[root]),
        ("targetlease".to_owned(), VERSION.to_owned())
    );
    // The linked crates: reached from the root through neither a proc macro nor a build kind.
    let mut linked = BTreeSet::from([root]);
    let mut queue = vec![root];
    while let Some(i) = queue.pop() {
        for dep in packages[i]["dependencies"].as_array().into_iter().flatten() {
            let j = dep.as_u64().expect("an index") as usize;
            let p = &packages[j];
            if linked.contains(&j) || p["kind"] == "build" || proc_macros.contains(&name_version(p))
            {
                continue;
            }
            linked.insert(j);
            queue.push(j);
        }
    }
    let linked: BTreeSet<Crate> = linked
        .into_iter()
        .filter(|&i| i != root)
        .map(|i| name_version(&packages[i]))
        .collect();
    let build_only: BTreeSet<Crate> = packages
        .iter()
        .filter(|p| p["kind"] == "build")
        .map(name_version)
        .collect();
    assert!(linked.len() > 100, "{} linked crates", linked.len());
    assert!(
        build_only.iter().any(|(n, _)| n == "cc" || n == "autocfg"),
        "no build dependency recorded: {build_only:?}"
    );

    let sbom: Value = serde_json::from_str(
        &std::fs::read_to_string(kit.path(&format!("targetlease-{VERSION}.cdx.json")))
            .expect("the SBOM"),
    )
    .expect("the SBOM is JSON");
    assert_eq!(sbom["bomFormat"], "CycloneDX");
    assert_eq!(sbom["specVersion"], "1.5");
    assert_eq!(
        name_version(&sbom["metadata"]["component"]),
        ("targetlease".to_owned(), VERSION.to_owned())
    );
    let components = sbom["components"].as_array().expect("components");
    let listed: BTreeSet<Crate> = components.iter().map(name_version).collect();
    assert_eq!(listed.len(), components.len(), "a crate listed twice");
    let missing: Vec<_> = linked.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&linked).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the SBOM is not the linked crates: missing {missing:?}, extra {extra:?}"
    );
    for component in components {
        let c = name_version(component);
        assert_eq!(
            component["purl"],
            format!("pkg:cargo/{}@{}", c.0, c.1),
            "{c:?}"
        );
        let checksum = lock[&c]
            .as_deref()
            .expect("a crates.io crate has a checksum");
        assert_eq!(component["hashes"][0]["alg"], "SHA-256");
        assert_eq!(component["hashes"][0]["content"], checksum, "{c:?}");
        if let Some(license) = &licenses[&c] {
            assert_eq!(
                component["licenses"][0]["expression"],
                // The old `A / B` form, spaces or none around the slash (fnv says
                // `Apache-2.0 / MIT`), is the SPDX `A OR B`.
                license
                    .split('/')
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join(" OR "),
                "{c:?}"
            );
        }
    }
    let embedded_crates: Vec<Crate> = packages.iter().map(name_version).collect();
    // Dev-dependencies of the crate (and normal ones of the tests' support crate) are in
    // Cargo.lock but neither linked nor listed.
    for dev in ["proptest", "tempfile", "libtest-mimic"] {
        assert!(
            lock.keys().any(|(n, _)| n == dev),
            "{dev} is not in Cargo.lock"
        );
        let recorded: Vec<&Crate> = embedded_crates
            .iter()
            .chain(&listed)
            .filter(|(n, _)| n == dev)
            .collect();
        assert!(recorded.is_empty(), "{dev} is recorded: {recorded:?}");
    }
    let both: Vec<_> = build_only.intersection(&listed).collect();
    assert!(both.is_empty(), "build-only crates in the SBOM: {both:?}");
}

fn chart_package_installs_with_its_app_version() {
    let kit = kit();
    let package = kit.path(&format!("targetlease-{VERSION}.tgz"));
    let package = package.display().to_string();
    let cluster = Cluster::start();
    let shown = cluster.helm(&["show", "chart", &package]);
    assert!(shown.status.success(), "helm show chart");
    let chart: Value = serde_yaml::from_slice(&shown.stdout).expect("Chart.yaml");
    assert_eq!(chart["version"], VERSION);
    assert_eq!(chart["appVersion"], VERSION);
    let install = cluster.helm(&[
        "install",
        "targetlease",
        &package,
        "-n",
        "targetlease-system",
        "--create-namespace",
    ]);
    assert!(
        install.status.success(),
        "helm install {package}: {}",
        String::from_utf8_lossy(&install.stderr)
    );
    let kind = cluster.kubectl_ok(&[
        "get",
        "crd",
        "targetleases.targetlease.dev",
        "-o",
        "jsonpath={.spec.names.kind}",
    ]);
    assert_eq!(kind, "TargetLease");
    let image = cluster.kubectl_ok(&[
        "get",
        "deployment",
        "targetlease",
        "-n",
        "targetlease-system",
        "-o",
        "jsonpath={.spec.template.spec.containers[0].image}",
    ]);
    assert_eq!(
        image,
        format!(
            "ghcr.io/targetlease/targetlease:{}",
            chart["appVersion"].as_str().expect("appVersion")
        )
    );
}

fn release_notes_are_the_changelog_section() {
    let notes = std::fs::read_to_string(kit().path("RELEASE_NOTES.md")).expect("notes");
    assert_eq!(
        notes.trim_end(),
        support::release::changelog_section(VERSION)
    );
}

/// A clone of the checkout's HEAD, in a temporary folder.
fn clone() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    sh(
        "git",
        &[
            "clone",
            "-q",
            &repo().display().to_string(),
            &dir.path().display().to_string(),
        ],
    );
    dir
}

/// The script fails before building anything, says why, and writes no kit.
fn refused(checkout: &Path, args: &[&str], because: &str) {
    let out_dir = checkout.join("kit");
    let mut args = args.to_vec();
    let out = out_dir.display().to_string();
    args.extend(["--out", out.as_str()]);
    // A refusal comes before any build: a script still running after 30 s is stopped.
    let output = release_sh(checkout, &args, 30);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "release.sh {args:?} succeeded");
    assert!(stderr.contains(because), "no '{because}' in:\n{stderr}");
    assert!(!out_dir.exists(), "a refused release wrote {out}");
}

fn refuses_dirty_trees_other_versions_and_no_notes() {
    let checkout = clone();
    let dir = checkout.path();
    std::fs::write(dir.join("stray.txt"), "not committed").expect("write");
    refused(dir, &[], "--allow-dirty");
    let chart = dir.join("charts/targetlease/Chart.yaml");
    let text = std::fs::read_to_string(&chart).expect("Chart.yaml");
    let other = text.replace(
        &format!("appVersion: \"{VERSION}\""),
        "appVersion: \"9.9.9\"",
    );
    assert_ne!(text, other, "Chart.yaml has no appVersion line");
    std::fs::write(&chart, other).expect("write");
    refused(dir, &["--allow-dirty"], "appVersion '9.9.9'");
    std::fs::write(&chart, text).expect("write");
    let changelog = dir.join("CHANGELOG.md");
    let text = std::fs::read_to_string(&changelog).expect("CHANGELOG.md");
    std::fs::write(
        &changelog,
        text.replace(&format!("## [{VERSION}]"), "## [Unreleased]"),
    )
    .expect("write");
    refused(
        dir,
        &["--allow-dirty"],
        &format!("no section '## [{VERSION}]'"),
    );
}

/// `build.rs`, compiled on its own and run as cargo runs it: in this checkout it names HEAD and
/// HEAD's date (a TARGETLEASE_BUILD_COMMIT left in the environment does not change that); in a
/// source tree without `.git` (a tarball, Docker's build context) the commit and date given by
/// TARGETLEASE_BUILD_COMMIT and SOURCE_DATE_EPOCH (the Dockerfile's build arguments), `unknown`
/// without them or when they are empty; a value that is no commit id or no number fails the
/// build, naming it.
fn build_script_names_the_commit_with_and_without_a_checkout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let script = dir.path().join("build-script");
    let out = Command::new("rustc")
        .args(["--edition", "2024", "--crate-name", "build_script"])
        .arg(repo().join("build.rs"))
        .arg("-o")
        .arg(&script)
        .output()
        .expect("rustc");
    assert!(
        out.status.success(),
        "rustc build.rs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = dir.path().join("source-tree");
    std::fs::create_dir(&tree).expect("source tree");
    let run = |manifest_dir: &Path, env: &[(&str, &str)]| {
        let out = Command::new(&script)
            .env_remove("TARGETLEASE_BUILD_COMMIT")
            .env_remove("SOURCE_DATE_EPOCH")
            .env("CARGO_MANIFEST_DIR", manifest_dir)
            .envs(env.iter().copied())
            .output()
            .expect("run the build script");
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        let value = |key: &str| {
            said.lines()
                .find_map(|l| l.strip_prefix(&format!("cargo:rustc-env={key}=")))
                .map(str::to_owned)
        };
        if out.status.success() {
            for watched in ["SOURCE_DATE_EPOCH", "TARGETLEASE_BUILD_COMMIT"] {
                assert!(
                    said.contains(&format!("cargo:rerun-if-env-changed={watched}\n")),
                    "{said}"
                );
            }
        }
        (
            out.status.success(),
            value("TARGETLEASE_COMMIT"),
            value("TARGETLEASE_BUILD_DATE"),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let known = |commit: &str, date: &str| (true, Some(commit.to_owned()), Some(date.to_owned()));
    let given = "0123456789ABCDEF0123456789abcdef01234567";

    let head = git(&repo(), &["rev-parse", "HEAD"]);
    // HEAD's date in UTC as git itself computes it, apart from build.rs's own calendar.
    let head_date = Command::new("git")
        .arg("-C")
        .arg(repo())
        .args([
            "log",
            "-1",
            "--format=%cd",
            "--date=format-local:%Y-%m-%d",
            "HEAD",
        ])
        .env("TZ", "UTC")
        .output()
        .expect("git log");
    let head_date = String::from_utf8_lossy(&head_date.stdout).trim().to_owned();
    let (ok, commit, date, stderr) = run(&repo(), &[("TARGETLEASE_BUILD_COMMIT", given)]);
    assert_eq!(
        (ok, commit, date),
        known(&head[..12], &head_date),
        "in the checkout: {stderr}"
    );
    let cases: [(&[(&str, &str)], _); 4] = [
        (&[], known("unknown", "unknown")),
        (
            &[
                ("TARGETLEASE_BUILD_COMMIT", given),
                ("SOURCE_DATE_EPOCH", "1764633600"),
            ],
            known("0123456789ab", "2025-12-02"),
        ),
        (
            &[
                ("TARGETLEASE_BUILD_COMMIT", " 0123456789ab\n"),
                ("SOURCE_DATE_EPOCH", "951782400"),
            ],
            known("0123456789ab", "2000-02-29"),
        ),
        (
            &[("TARGETLEASE_BUILD_COMMIT", ""), ("SOURCE_DATE_EPOCH", "")],
            known("unknown", "unknown"),
        ),
    ];
    for (env, want) in cases {
        let (ok, commit, date, stderr) = run(&tree, env);
        assert_eq!(
            (ok, commit, date),
            want,
            "without a checkout, {env:?}: {stderr}"
        );
    }
    for (key, value) in [
        ("TARGETLEASE_BUILD_COMMIT", "v0.2.0"),
        ("TARGETLEASE_BUILD_COMMIT", "0123456789a"),
        ("TARGETLEASE_BUILD_COMMIT", &"a".repeat(65)),
        ("SOURCE_DATE_EPOCH", "yesterday"),
    ] {
        let (ok, _, _, stderr) = run(&tree, &[(key, value)]);
        assert!(!ok, "{key}={value:?} was taken");
        assert!(
            stderr.contains(&format!("{key}={value:?}")),
            "{key}={value:?}: {stderr}"
        );
    }
}

/// The suite's trials.
pub fn suite(args: &Arguments) -> Conclusion {
    let test = support::suite::blocking_trial;
    let trials = vec![
        test(
            "sums_verify_the_kit_and_catch_a_changed_byte",
            sums_verify_the_kit_and_catch_a_changed_byte,
        ),
        test(
            "binary_names_the_commit_and_is_the_images",
            binary_names_the_commit_and_is_the_images,
        ),
        test(
            "embedded_list_and_sbom_are_the_crates_built_in",
            embedded_list_and_sbom_are_the_crates_built_in,
        ),
        test(
            "chart_package_installs_with_its_app_version",
            chart_package_installs_with_its_app_version,
        ),
        test(
            "release_notes_are_the_changelog_section",
            release_notes_are_the_changelog_section,
        ),
        test(
            "refuses_dirty_trees_other_versions_and_no_notes",
            refuses_dirty_trees_other_versions_and_no_notes,
        ),
        test(
            "build_script_names_the_commit_with_and_without_a_checkout",
            build_script_names_the_commit_with_and_without_a_checkout,
        ),
    ];
    support::suite::run(args, trials)
}

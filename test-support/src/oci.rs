//! The controller image in tests: building it with `scripts/image.sh`, unpacking the OCI
//! tarball it writes, and running the plain tools (tar, sha256sum, gzip) that does it.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::kube::repo;

/// Runs `program` with `args`; panics with its stderr unless it succeeds; returns stdout.
pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds the controller image (`scripts/image.sh`): its tarball, and `name@digest` as the
/// script wrote it beside the tarball.
pub fn build_controller_image() -> (PathBuf, String) {
    let script = repo().join("scripts/image.sh");
    let tarball = PathBuf::from(sh("bash", &[&script.display().to_string()]).trim());
    let reference = std::fs::read_to_string(format!("{}.ref", tarball.display()))
        .expect("scripts/image.sh writes TARBALL.ref");
    (tarball, reference.trim().to_owned())
}

/// An OCI image-layout tarball of one image with one layer, unpacked.
pub struct Layout {
    /// The unpacked tarball (removed on drop).
    pub dir: tempfile::TempDir,
    /// `index.json`.
    pub index: Value,
    /// The image manifest.
    pub manifest: Value,
    /// The image configuration.
    pub config: Value,
    /// The configuration's digest: the image id the kubelet reports.
    pub config_digest: String,
    /// The (gzipped) layer blob.
    pub layer: PathBuf,
}

/// Unpacks `tarball` and reads its index, manifest and configuration.
pub fn unpack(tarball: &Path) -> Layout {
    let dir = tempfile::tempdir().expect("temp dir");
    sh(
        "tar",
        &[
            "-xf",
            &tarball.display().to_string(),
            "-C",
            &dir.path().display().to_string(),
        ],
    );
    let blob = |digest: &Value| -> PathBuf {
        let digest = digest.as_str().expect("digest");
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        dir.path().join("blobs/sha256").join(hex)
    };
    let json_of = |path: PathBuf| -> Value {
        serde_json::from_slice(&std::fs::read(path).expect("read blob")).expect("json blob")
    };
    let index = json_of(dir.path().join("index.json"));
    let manifest = json_of(blob(&index["manifests"][0]["digest"]));
    let config = json_of(blob(&manifest["config"]["digest"]));
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .expect("digest")
        .to_owned();
    let layer = blob(&manifest["layers"][0]["digest"]);
    Layout {
        dir,
        index,
        manifest,
        config,
        config_digest,
        layer,
    }
}

impl Layout {
    /// Extracts the image's `targetlease` binary into `dir`; its path.
    pub fn binary(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).expect("binary dir");
        sh(
            "tar",
            &[
                "-xzf",
                &self.layer.display().to_string(),
                "-C",
                &dir.display().to_string(),
                "targetlease",
            ],
        );
        dir.join("targetlease")
    }
}

/// Builds an application image in `scratch`: busybox (static), `targetlease` (the binary at
/// `binary`) at /usr/local/bin, and `programs` (path under the root, script text), run as user
/// 10001; the tarball's path. The image `name` is what pods reference.
pub fn app_image(scratch: &Path, name: &str, binary: &Path, programs: &[(&str, &str)]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let slug: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let rootfs = scratch.join(format!("{slug}-rootfs"));
    for sub in ["bin", "usr/local/bin", "app", "tmp", "etc"] {
        std::fs::create_dir_all(rootfs.join(sub)).expect("dir");
    }
    std::fs::copy(binary, rootfs.join("usr/local/bin/targetlease")).expect("copy targetlease");
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static");
    for applet in ["sh", "sleep", "echo", "cat", "date", "env"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).expect("symlink");
    }
    for (path, text) in programs {
        std::fs::write(rootfs.join(path), text).expect("write");
        std::fs::set_permissions(rootfs.join(path), PermissionsExt::from_mode(0o555))
            .expect("chmod");
    }
    std::fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/root:/sbin/nologin\napp:x:10001:10001:app:/tmp:/sbin/nologin\n",
    )
    .expect("passwd");
    std::fs::set_permissions(rootfs.join("tmp"), PermissionsExt::from_mode(0o1777)).expect("chmod");
    let out = scratch.join(format!("{slug}.oci.tar"));
    let dir = |p: &Path| p.display().to_string();
    sh(
        "python3",
        &[
            &repo().join("scripts/oci_image.py").display().to_string(),
            "--rootfs",
            &dir(&rootfs),
            "--name",
            name,
            "--out",
            &dir(&out),
            "--env",
            "PATH=/usr/local/bin:/bin",
            "--user",
            "10001:10001",
        ],
    );
    out
}

//! Build facts for `targetlease --version` and the `targetlease_build_info` metric
//! (src/build_info.rs): the commit the crate is built from and the build date.
//!
//! The commit is the checkout's HEAD. Outside a git checkout (a source tarball, the Docker build
//! context) it is TARGETLEASE_BUILD_COMMIT when set (the Dockerfile's build argument), else
//! `unknown`. The date is SOURCE_DATE_EPOCH when set, else the checkout's commit date, never the
//! clock: the same commit must give the same binary (scripts/image.sh rebuilds to the same image
//! digest); `unknown` when neither is known.

use std::path::{Path, PathBuf};
use std::process::Command;

/// How many hex digits of the commit id the version shows.
const COMMIT_DIGITS: usize = 12;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!("cargo:rerun-if-env-changed=TARGETLEASE_BUILD_COMMIT");

    let checkout = Checkout::find(&manifest_dir);
    let commit = match &checkout {
        Some(checkout) => checkout.git(&["rev-parse", "--verify", "HEAD^{commit}"]),
        None => given_commit(),
    }
    .map_or_else(
        || "unknown".to_owned(),
        |id| id[..COMMIT_DIGITS.min(id.len())].to_owned(),
    );
    // An empty value counts as unset (a build argument declared but not given).
    let epoch = match std::env::var("SOURCE_DATE_EPOCH").map(|v| v.trim().to_owned()) {
        Ok(value) if !value.is_empty() => Some(value.parse::<i64>().unwrap_or_else(|_| {
            panic!("SOURCE_DATE_EPOCH={value:?} is not a number of seconds since 1970")
        })),
        _ => checkout
            .as_ref()
            .and_then(|c| c.git(&["log", "-1", "--format=%ct", "HEAD"]))
            .and_then(|s| s.parse().ok()),
    };
    let date = epoch.map_or_else(|| "unknown".to_owned(), civil_date);
    if let Some(checkout) = &checkout {
        checkout.watch_head();
    }
    println!("cargo:rustc-env=TARGETLEASE_COMMIT={commit}");
    println!("cargo:rustc-env=TARGETLEASE_BUILD_DATE={date}");
}

/// TARGETLEASE_BUILD_COMMIT, for a build without the checkout (`docker build --build-arg
/// TARGETLEASE_BUILD_COMMIT=$(git rev-parse HEAD)`): a commit id of at least as many hex digits
/// as the version shows, and at most a SHA-256 id's. Unset or empty is None; anything else fails
/// the build, naming the value, rather than printing it as a commit.
fn given_commit() -> Option<String> {
    let value = std::env::var("TARGETLEASE_BUILD_COMMIT").ok()?;
    let id = value.trim().to_ascii_lowercase();
    if id.is_empty() {
        return None;
    }
    let hex = id.bytes().all(|b| b.is_ascii_hexdigit());
    assert!(
        hex && (COMMIT_DIGITS..=64).contains(&id.len()),
        "TARGETLEASE_BUILD_COMMIT={value:?} is not a commit id ({COMMIT_DIGITS} to 64 hex digits)"
    );
    Some(id)
}

/// The git checkout whose top folder is the crate's folder.
struct Checkout {
    top: PathBuf,
}

impl Checkout {
    /// None when the crate is not the top of a git work tree (no `.git`, git missing, or the
    /// crate unpacked inside another project's checkout, whose commit is not this source's).
    fn find(manifest_dir: &Path) -> Option<Checkout> {
        let candidate = Checkout {
            top: manifest_dir.to_owned(),
        };
        let top = candidate.git(&["rev-parse", "--show-toplevel"])?;
        let same = std::fs::canonicalize(&top).ok()? == std::fs::canonicalize(manifest_dir).ok()?;
        same.then_some(candidate)
    }

    /// `git ARGS` in the checkout: its trimmed stdout, or None when it fails.
    fn git(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(&self.top)
            .args(args)
            .env_remove("GIT_DIR")
            .env_remove("GIT_WORK_TREE")
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
        (out.status.success() && !text.is_empty()).then_some(text)
    }

    /// A file of the git folder (a worktree's HEAD is in its own folder, refs in the common one).
    fn git_path(&self, name: &str) -> Option<PathBuf> {
        let path = PathBuf::from(self.git(&["rev-parse", "--git-path", name])?);
        Some(if path.is_absolute() {
            path
        } else {
            self.top.join(path)
        })
    }

    /// Rebuilds when HEAD moves: HEAD itself (a checkout of another branch or commit), the
    /// branch it names (a new commit) and packed-refs (where `git gc` moves that branch). Nothing
    /// else in the tree reruns this script.
    fn watch_head(&self) {
        let mut watched = Vec::new();
        watched.extend(self.git_path("HEAD"));
        if let Some(branch) = self.git(&["symbolic-ref", "-q", "HEAD"])
            && let Some(loose) = self.git_path(&branch)
        {
            // A packed branch has no file of its own until its next commit writes one: the
            // folder it will appear in is watched instead (a missing file would rerun every
            // build).
            if loose.exists() {
                watched.push(loose);
            } else if let Some(folder) = loose.parent() {
                watched.push(folder.to_owned());
            }
        }
        watched.extend(self.git_path("packed-refs").filter(|p| p.exists()));
        for path in watched {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// `YYYY-MM-DD` (UTC) of `epoch` seconds since 1970 (the proleptic Gregorian calendar).
fn civil_date(epoch: i64) -> String {
    let days = epoch.div_euclid(86_400);
    // Days since 0000-03-01, so that a leap day ends each 4-year cycle (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

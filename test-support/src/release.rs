//! The release's own documents as the tests read them: a version's section of CHANGELOG.md
//! (what scripts/release.sh writes as RELEASE_NOTES.md and Chart.yaml's
//! `artifacthub.io/changes` lists), read here by a parser of its own.

use crate::kube::repo;

/// The section `## [VERSION] ...` of CHANGELOG.md, from its heading to the line before the
/// next `## [`, without the blank lines at its end. Panics when there is none.
pub fn changelog_section(version: &str) -> String {
    let text = std::fs::read_to_string(repo().join("CHANGELOG.md")).expect("CHANGELOG.md");
    let heading = format!("## [{version}]");
    let start = text
        .lines()
        .position(|l| l.starts_with(&heading))
        .unwrap_or_else(|| panic!("CHANGELOG.md has no section {heading}"));
    let section: Vec<&str> = text
        .lines()
        .skip(start)
        .enumerate()
        .take_while(|(i, l)| *i == 0 || !l.starts_with("## ["))
        .map(|(_, l)| l)
        .collect();
    section.join("\n").trim_end().to_owned()
}

/// The entries of `section` as Artifact Hub's `artifacthub.io/changes` has them: (kind, text),
/// the kind being the `### ` heading above the entry in lower case (added, changed, fixed,
/// ...), the text the entry's lines joined by spaces.
pub fn changelog_changes(section: &str) -> Vec<(String, String)> {
    let mut kind = String::new();
    let mut changes: Vec<(String, String)> = Vec::new();
    for line in section.lines() {
        if let Some(heading) = line.strip_prefix("### ") {
            kind = heading.trim().to_lowercase();
        } else if let Some(entry) = line.strip_prefix("- ") {
            changes.push((kind.clone(), entry.trim().to_owned()));
        } else if line.starts_with("  ") && !line.trim().is_empty() {
            let last = changes
                .last_mut()
                .expect("a continued line follows an entry");
            last.1.push(' ');
            last.1.push_str(line.trim());
        }
    }
    changes
}

//! The generated pages of docs/reference/: every flag with its environment variable and default,
//! the exit statuses, the condition types and reasons, the metrics and the chart's values, each
//! rendered from what the code and the chart declare. `targetlease reference PAGE` prints one;
//! a unit test fails when a committed page differs from its rendering.

use std::fmt::Write as _;

use clap::{Arg, Command};

use super::exit;
use crate::api::{ConditionType, Reason};
use crate::controller::metrics::Metrics;

/// The chart's values file, whose `# --` comments describe each key (helm-docs' convention).
const VALUES_YAML: &str = include_str!("../../charts/targetlease/values.yaml");

/// A generated page of docs/reference/.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Page {
    /// The TargetLease API, from the CRD schema (api.md).
    Api,
    /// Every command and flag, with environment variables and defaults, and the exit statuses
    /// (cli.md).
    Cli,
    /// The condition types and reasons the controller writes (conditions.md).
    Conditions,
    /// The controller's metrics (metrics.md).
    Metrics,
    /// The Helm chart's values (values.md).
    Values,
}

impl Page {
    /// The page's file in docs/reference/.
    pub(crate) fn file(self) -> &'static str {
        match self {
            Page::Api => "api.md",
            Page::Cli => "cli.md",
            Page::Conditions => "conditions.md",
            Page::Metrics => "metrics.md",
            Page::Values => "values.md",
        }
    }

    /// The page as Markdown; `command` is the whole command line (`Cli::command()`), which only
    /// the cli page reads.
    pub(crate) fn render(self, command: &Command) -> String {
        match self {
            Page::Api => crate::api::reference::markdown(),
            Page::Cli => cli(command),
            Page::Conditions => conditions(),
            Page::Metrics => metrics(),
            Page::Values => values(),
        }
    }

    fn name(self) -> &'static str {
        self.file().trim_end_matches(".md")
    }
}

/// The title and the line that says how the page is made.
fn header(title: &str, page: Page, from: &str) -> String {
    format!(
        "# {title}\n\n<!-- Generated from {from} by `targetlease reference {} > docs/reference/{}`; \
         do not edit by hand. A unit test fails when this file is stale. -->\n\n",
        page.name(),
        page.file()
    )
}

/// Every visible command, its flags and arguments, then the exit statuses.
fn cli(root: &Command) -> String {
    let mut out = header(
        "Command-line reference",
        Page::Cli,
        "the command-line parser",
    );
    out.push_str(
        "Every flag that names an environment variable can be set through it instead; a flag on \
         the command line wins over the variable.\n\n",
    );
    out.push_str("## Every command\n\n");
    out.push_str(&arguments(root.get_arguments()));
    for command in root.get_subcommands().filter(|c| !c.is_hide_set()) {
        command_section(&mut out, root.get_name(), command);
    }
    out.push_str("## Exit statuses\n\n");
    out.push_str(
        "Of `targetlease run`, `wait` and `lease`. Usage errors (an unknown flag, a missing \
         argument) exit with 2.\n\n| Status | Meaning |\n|---|---|\n",
    );
    for (code, _, meaning) in exit::ALL {
        let _ = writeln!(out, "| {code} | {} |", one_line(meaning));
    }
    out.push_str(
        "| 128 + N | `run`, `wait`: interrupted by signal N (130 for SIGINT, 143 for SIGTERM), \
         as shells report it. |\n| any other | `run`: the command's own exit status, when it ran \
         to the end under its lease. |\n",
    );
    out
}

/// One command's section, then its subcommands'.
fn command_section(out: &mut String, parent: &str, command: &Command) {
    let path = format!("{parent} {}", command.get_name());
    let _ = writeln!(out, "## `{path}`\n");
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        let _ = writeln!(out, "{}\n", one_line(&about.to_string()));
    }
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        out.push_str(&arguments(command.get_arguments()));
    }
    for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
        command_section(out, &path, sub);
    }
}

/// A table of arguments: flag (or positional name), environment variable, default, meaning.
fn arguments<'a>(args: impl Iterator<Item = &'a Arg>) -> String {
    let mut out =
        String::from("| Flag | Environment | Default | Description |\n|---|---|---|---|\n");
    for arg in args.filter(|a| !a.is_hide_set()) {
        let flag = match (arg.get_long(), arg.get_short()) {
            (Some(long), Some(short)) => format!("`-{short}`, `--{long}`"),
            (Some(long), None) => format!("`--{long}`"),
            (None, Some(short)) => format!("`-{short}`"),
            (None, None) => {
                let name = arg
                    .get_value_names()
                    .and_then(|names| names.first())
                    .map_or_else(
                        || arg.get_id().to_string().to_uppercase(),
                        ToString::to_string,
                    );
                format!("`{name}` (argument)")
            }
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            String::new()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let mut description = arg
            .get_long_help()
            .or(arg.get_help())
            .map(ToString::to_string)
            .unwrap_or_default();
        let choices: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !choices.is_empty() && arg.get_action().takes_values() {
            description = format!(
                "{}. One of {}.",
                description.trim_end().trim_end_matches('.'),
                choices.join(", ")
            );
        }
        if arg.is_required_set() {
            description = format!("Required. {description}");
        }
        let _ = writeln!(
            out,
            "| {flag} | {env} | {default} | {} |",
            one_line(&description)
        );
    }
    out.push('\n');
    out
}

/// The condition types and the reasons, each with what it means.
fn conditions() -> String {
    let mut out = header(
        "Conditions reference",
        Page::Conditions,
        "the controller's code",
    );
    out.push_str(
        "The controller writes these conditions in `status.conditions` (kstatus-compatible: \
         `Ready`, `Reconciling` and `Stalled`) and Events with the same reasons. What to do about \
         each: [troubleshooting](../troubleshooting.md).\n\n## Condition types\n\n\
         | Type | Meaning |\n|---|---|\n",
    );
    for kind in ConditionType::ALL {
        let _ = writeln!(
            out,
            "| `{}` | {} |",
            kind.as_str(),
            one_line(kind.meaning())
        );
    }
    out.push_str("\n## Reasons\n\n| Reason | Meaning |\n|---|---|\n");
    for reason in Reason::ALL {
        let _ = writeln!(
            out,
            "| `{}` | {} |",
            reason.as_str(),
            one_line(reason.meaning())
        );
    }
    out
}

/// Every metric the controller registers, with its type, labels and help text.
fn metrics() -> String {
    let mut out = header(
        "Metrics reference",
        Page::Metrics,
        "the controller's metric registry",
    );
    out.push_str(
        "`targetlease controller` serves these at `/metrics` on its HTTP port (8080 in the chart), \
         in the Prometheus text format. Alerts and a dashboard built on them: \
         [operations](../operations.md#alerts-and-dashboard).\n\n| Metric | Type | Labels | Meaning |\n\
         |---|---|---|---|\n",
    );
    // name -> (type, help, label names), in the exposition's order.
    let mut described: Vec<(String, String, String, Vec<String>)> = Vec::new();
    for line in Metrics::example_exposition().lines() {
        if let Some((name, help)) = line.strip_prefix("# HELP ").and_then(|r| r.split_once(' ')) {
            described.push((name.to_owned(), String::new(), help.to_owned(), Vec::new()));
        } else if let Some((_, kind)) = line.strip_prefix("# TYPE ").and_then(|r| r.split_once(' '))
        {
            if let Some(last) = described.last_mut() {
                kind.clone_into(&mut last.1);
            }
        } else if let (Some(last), Some((_, labels))) = (described.last_mut(), line.split_once('{'))
        {
            for pair in labels.split(',') {
                let Some((label, _)) = pair.split_once('=') else {
                    continue;
                };
                // `le` is a histogram's bucket bound, not a label of the metric's own.
                if label != "le" && !last.3.iter().any(|l| l == label) {
                    last.3.push(label.to_owned());
                }
            }
        }
    }
    for (name, kind, help, labels) in described {
        // A counter's samples are named with `_total`, as Prometheus queries them.
        let sample = if kind == "counter" {
            format!("{name}_total")
        } else {
            name
        };
        let labels: Vec<String> = labels.iter().map(|l| format!("`{l}`")).collect();
        let _ = writeln!(
            out,
            "| `{sample}` | {kind} | {} | {} |",
            labels.join(", "),
            one_line(&help)
        );
    }
    out
}

/// One documented key of the chart's values: its path, its default, its description.
#[derive(Debug, PartialEq)]
struct ValueDoc {
    path: String,
    default: String,
    description: String,
}

/// Every key of the values file with a `# --` comment above it, in the file's order. A comment
/// runs from its `# --` line to the key; a comment without `# --` is left out (a group's
/// introduction), as helm-docs does.
fn documented_values(yaml: &str) -> Vec<ValueDoc> {
    let tree: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap_or(serde_yaml::Value::Null);
    let mut docs = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<String> = None;
    for line in yaml.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        if let Some(text) = trimmed.strip_prefix("# --") {
            pending = Some(text.trim().to_owned());
            continue;
        }
        if let Some(text) = trimmed.strip_prefix('#') {
            if let Some(doc) = pending.as_mut() {
                doc.push(' ');
                doc.push_str(text.trim());
            }
            continue;
        }
        // A list item (`- key: value` or `- value`): its keys are the list's `[]`, one level
        // below the list, at the item's indent plus two.
        let (indent, trimmed) = match trimmed.strip_prefix("- ") {
            Some(item) => {
                while path.last().is_some_and(|(depth, _)| *depth >= indent) {
                    path.pop();
                }
                path.push((indent, "[]".to_owned()));
                (indent + 2, item)
            }
            None => (indent, trimmed),
        };
        let Some((key, _)) = trimmed.split_once(':') else {
            pending = None;
            continue;
        };
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            // A continuation: not a key of the values' tree.
            pending = None;
            continue;
        }
        while path.last().is_some_and(|(depth, _)| *depth >= indent) {
            path.pop();
        }
        path.push((indent, key.to_owned()));
        if let Some(description) = pending.take() {
            let keys: Vec<&str> = path.iter().map(|(_, k)| k.as_str()).collect();
            // Inside a list there is no one default: the list's own is documented above it.
            let value = if keys.contains(&"[]") {
                None
            } else {
                keys.iter().try_fold(&tree, |node, key| node.get(*key))
            };
            docs.push(ValueDoc {
                path: keys.join(".").replace(".[]", "[]"),
                default: value.map_or_else(String::new, |v| {
                    serde_json::to_string(v).unwrap_or_default()
                }),
                description,
            });
        }
    }
    docs
}

/// The chart's values, helm-docs style.
fn values() -> String {
    let mut out = header(
        "Chart values reference",
        Page::Values,
        "the chart's values.yaml",
    );
    out.push_str(
        "Every value of the `targetlease` chart, with its default. `helm show values` prints the \
         file with its comments; the chart's schema refuses an unknown key or a wrong type. How \
         to choose them: [install](../install.md) and [operations](../operations.md).\n\n\
         | Key | Default | Description |\n|---|---|---|\n",
    );
    for doc in documented_values(VALUES_YAML) {
        let _ = writeln!(
            out,
            "| `{}` | `{}` | {} |",
            doc.path,
            doc.default.replace('|', "\\|"),
            one_line(&doc.description)
        );
    }
    out
}

/// Text on one table line: whitespace folded, `|` escaped (it ends a cell even in a code span),
/// and `<` and `>` outside code spans written as entities, so that a placeholder such as
/// `<release>` shows instead of being taken for an HTML tag.
fn one_line(text: &str) -> String {
    let folded = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = String::with_capacity(folded.len());
    let mut in_code = false;
    for c in folded.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '|' => out.push_str("\\|"),
            '<' if !in_code => out.push_str("&lt;"),
            '>' if !in_code => out.push_str("&gt;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_read_with_their_paths_defaults_and_whole_comments() {
        let yaml = "# A group's introduction, not a value's.\n\
                    # -- Replicas.\n\
                    # Two lines.\n\
                    replicaCount: 2\n\
                    image:\n  \
                      # -- The repository.\n  \
                      repository: ghcr.io/x/y\n  \
                      tag: \"\"\n\
                    list:\n  \
                      - name: a\n    \
                        # -- A key of the list's items.\n    \
                        inner: 1\n\
                    # -- After a list.\n\
                    after: {}\n";
        let docs = documented_values(yaml);
        let paths: Vec<&str> = docs.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(
            paths,
            ["replicaCount", "image.repository", "list[].inner", "after"]
        );
        assert_eq!(docs[0].description, "Replicas. Two lines.");
        assert_eq!(docs[0].default, "2");
        assert_eq!(docs[1].default, "\"ghcr.io/x/y\"");
        assert_eq!(docs[2].default, "");
        assert_eq!(docs[3].default, "{}");
        assert_eq!(one_line("a <b> `<c>` | d"), "a &lt;b&gt; `<c>` \\| d");
    }

    #[test]
    fn every_leaf_of_the_chart_values_is_documented() {
        // A key with nothing under it (a scalar, an empty list or map) must be documented, or
        // sit under a documented key: else the reference would leave a setting out.
        let tree: serde_yaml::Value = serde_yaml::from_str(VALUES_YAML).expect("values.yaml");
        let documented: Vec<String> = documented_values(VALUES_YAML)
            .into_iter()
            .map(|d| d.path)
            .collect();
        let mut leaves = Vec::new();
        collect_leaves(&tree, String::new(), &mut leaves);
        let undocumented: Vec<&String> = leaves
            .iter()
            .filter(|leaf| {
                !documented
                    .iter()
                    .any(|d| *leaf == d || leaf.starts_with(&format!("{d}.")))
            })
            .collect();
        assert!(
            undocumented.is_empty(),
            "values.yaml keys without a `# --` comment on them or above them: {undocumented:?}"
        );
    }

    fn collect_leaves(node: &serde_yaml::Value, path: String, out: &mut Vec<String>) {
        match node.as_mapping() {
            Some(map) if !map.is_empty() => {
                for (key, value) in map {
                    let key = key.as_str().unwrap_or_default();
                    let child = if path.is_empty() {
                        key.to_owned()
                    } else {
                        format!("{path}.{key}")
                    };
                    collect_leaves(value, child, out);
                }
            }
            _ => out.push(path),
        }
    }

    #[test]
    fn the_metrics_page_names_every_registered_metric() {
        let page = metrics();
        for name in [
            "targetlease_leading",
            "targetlease_reconciles_total",
            "targetlease_store_call_seconds",
        ] {
            assert!(
                page.contains(&format!("| `{name}` |")),
                "{name} missing:\n{page}"
            );
        }
    }

    #[test]
    fn the_cli_page_shows_flags_with_their_variables_and_defaults() {
        // A small command stands in for the real one (whose page the drift test compares).
        let command = Command::new("t")
            .arg(
                Arg::new("ttl")
                    .long("ttl")
                    .env("T_TTL")
                    .default_value("30s")
                    .help("How long | a lease lasts"),
            )
            .subcommand(Command::new("hidden").hide(true))
            .subcommand(Command::new("lease").about("Store calls.").subcommand(
                Command::new("acquire").arg(Arg::new("target").required(true).help("The target")),
            ));
        let page = cli(&command);
        assert!(page.contains("| `--ttl` | `T_TTL` | `30s` | How long \\| a lease lasts |"));
        assert!(page.contains("## `t lease acquire`"));
        assert!(page.contains("| `TARGET` (argument) |  |  | Required. The target |"));
        assert!(!page.contains("hidden"));
        assert!(page.contains("| 75 |"));
    }
}

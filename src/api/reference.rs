//! The API reference (`docs/reference/api.md`), rendered from the CRD schema so that it cannot
//! drift from it: `targetlease reference api` prints it, and a unit test fails when the
//! committed file differs.

use serde_json::Value;

use super::{StorageVersion, VERSION};

/// The API reference as Markdown, as `targetlease reference api` prints it.
pub fn markdown() -> String {
    let crd = serde_json::to_value(super::crd(StorageVersion::default()))
        .expect("the CRD serializes to JSON");
    render(&crd)
}

fn render(crd: &Value) -> String {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let group = text(&spec["group"]);
    let mut out = Vec::new();
    out.push(format!("# API reference: {}", text(&names["kind"])));
    out.push(String::new());
    out.push(
        "<!-- Generated from the CRD schema by \
         `targetlease reference api > docs/reference/api.md`; do not edit by hand. A unit test \
         fails when this file is stale. -->"
            .to_string(),
    );
    out.push(String::new());
    out.push(
        "What each field means in practice is in [concepts.md](../concepts.md); what each \
         condition reason means, and what to do about it, is in \
         [troubleshooting.md](../troubleshooting.md)."
            .to_string(),
    );
    out.push(String::new());
    out.push("| | |".to_string());
    out.push("|---|---|".to_string());
    out.push(format!("| group | `{group}` |"));
    let versions: Vec<&Value> = spec["versions"].as_array().into_iter().flatten().collect();
    let version_names: Vec<String> = versions
        .iter()
        .map(|v| format!("`{}`", text(&v["name"])))
        .collect();
    let stored: Vec<String> = versions
        .iter()
        .filter(|v| v["storage"] == Value::Bool(true))
        .map(|v| format!("`{}`", text(&v["name"])))
        .collect();
    out.push(format!(
        "| versions | {}, one schema (below); stored as {} unless the chart's \
         `crds.storageVersion` says otherwise ([install.md](../install.md#upgrading)) |",
        version_names.join(", "),
        stored.join(", ")
    ));
    out.push(format!("| kind | `{}` |", text(&names["kind"])));
    out.push(format!(
        "| plural, singular | `{}`, `{}` |",
        text(&names["plural"]),
        text(&names["singular"])
    ));
    out.push(format!(
        "| short names | {} |",
        code_list(&names["shortNames"])
    ));
    out.push(format!(
        "| categories | {} |",
        code_list(&names["categories"])
    ));
    out.push(format!("| scope | {} |", text(&spec["scope"])));
    let selectable: Vec<String> = versions
        .iter()
        .find(|v| text(&v["name"]) == VERSION)
        .and_then(|v| v["selectableFields"].as_array())
        .into_iter()
        .flatten()
        .map(|f| format!("`{}`", text(&f["jsonPath"])))
        .collect();
    out.push(format!(
        "| selectable fields | {} (`kubectl get tl --field-selector spec.target=NAME`) |",
        selectable.join(", ")
    ));
    // The versions share one schema: it is written out once, under the version this code speaks.
    for version in versions.into_iter().filter(|v| text(&v["name"]) == VERSION) {
        let name = text(&version["name"]);
        let subresources: Vec<String> = version["subresources"]
            .as_object()
            .into_iter()
            .flat_map(|m| m.keys().map(|k| format!("`{k}`")))
            .collect();
        out.push(format!(
            "| subresources ({name}) | {} |",
            subresources.join(", ")
        ));
        out.push(String::new());
        out.push(format!("## Printer columns ({group}/{name})"));
        out.push(String::new());
        out.push("What `kubectl get targetleases` shows.".to_string());
        out.push(String::new());
        out.push("| column | JSON path | type |".to_string());
        out.push("|---|---|---|".to_string());
        for column in version["additionalPrinterColumns"]
            .as_array()
            .into_iter()
            .flatten()
        {
            out.push(format!(
                "| {} | `{}` | {} |",
                text(&column["name"]),
                text(&column["jsonPath"]),
                text(&column["type"])
            ));
        }
        let root = &version["schema"]["openAPIV3Schema"];
        for section in ["spec", "status"] {
            let schema = &root["properties"][section];
            if schema.is_null() {
                continue;
            }
            out.push(String::new());
            out.push(format!("## `{section}` ({group}/{name})"));
            out.push(String::new());
            out.push(
                "| field | type | required | default | validation | description |".to_string(),
            );
            out.push("|---|---|---|---|---|---|".to_string());
            let required = is_required(root, section);
            fields(section, schema, required, &mut out);
        }
        let mut rules = Vec::new();
        collect_rules("", root, &mut rules);
        out.push(String::new());
        out.push(format!("## Validation rules (CEL, {group}/{name})"));
        out.push(String::new());
        out.push(
            "The API server evaluates these on every create and update and refuses the write with \
             the message."
                .to_string(),
        );
        out.push(String::new());
        out.push("| on | rule | message | reported at |".to_string());
        out.push("|---|---|---|---|".to_string());
        out.extend(rules);
    }
    out.push(String::new());
    out.join("\n")
}

/// One row per field, depth first, children after their parent.
fn fields(path: &str, schema: &Value, required: bool, out: &mut Vec<String>) {
    let mut validation = Vec::new();
    for (key, label) in [
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minimum", "≥"),
        ("maximum", "≤"),
    ] {
        if let Some(n) = schema.get(key) {
            validation.push(format!("{label} {}", number(n)));
        }
    }
    if let Some(pattern) = schema.get("pattern") {
        validation.push(format!("pattern `{}`", escape(&text(pattern))));
    }
    if let Some(values) = schema.get("enum") {
        validation.push(format!("one of {}", code_list(values)));
    }
    if let Some(kind) = schema.get("x-kubernetes-list-type") {
        let keys = code_list(&schema["x-kubernetes-list-map-keys"]);
        validation.push(format!("list type `{}` keyed by {keys}", text(kind)));
    }
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        validation.push(format!("CEL: {}", escape(&text(&rule["message"]))));
    }
    if schema.get("nullable").and_then(Value::as_bool) == Some(true) {
        validation.push("nullable".to_string());
    }
    let default = schema
        .get("default")
        .map(|d| format!("`{d}`"))
        .unwrap_or_default();
    out.push(format!(
        "| `{path}` | {} | {} | {default} | {} | {} |",
        type_of(schema),
        if required { "yes" } else { "no" },
        validation.join("; "),
        cell(&schema["description"]),
    ));
    let (object, prefix) = match schema["type"].as_str() {
        Some("array") => (&schema["items"], format!("{path}[]")),
        _ => (schema, path.to_string()),
    };
    if let Some(properties) = object["properties"].as_object() {
        for (name, child) in properties {
            let required = is_required(object, name);
            fields(&format!("{prefix}.{name}"), child, required, out);
        }
    }
}

fn collect_rules(path: &str, schema: &Value, out: &mut Vec<String>) {
    let on = if path.is_empty() { "(root)" } else { path };
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let at = rule
            .get("fieldPath")
            .map(|p| format!("`{}`", text(p)))
            .unwrap_or_default();
        out.push(format!(
            "| `{on}` | `{}` | {} | {at} |",
            escape(&text(&rule["rule"])),
            escape(&text(&rule["message"])),
        ));
    }
    let (object, prefix) = match schema["type"].as_str() {
        Some("array") => (&schema["items"], format!("{path}[]")),
        _ => (schema, path.to_string()),
    };
    if let Some(properties) = object["properties"].as_object() {
        for (name, child) in properties {
            let child_path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            collect_rules(&child_path, child, out);
        }
    }
}

fn is_required(parent: &Value, name: &str) -> bool {
    parent["required"]
        .as_array()
        .is_some_and(|r| r.iter().any(|n| n.as_str() == Some(name)))
}

fn type_of(schema: &Value) -> String {
    let base = text(&schema["type"]);
    let base = match schema.get("format") {
        Some(format) => format!("{base} ({})", text(format)),
        None => base,
    };
    if base == "array" {
        format!("array of {}", type_of(&schema["items"]))
    } else {
        base
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Integral numbers without the `.0` the schema carries.
fn number(value: &Value) -> String {
    match value.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => text(value),
    }
}

fn code_list(values: &Value) -> String {
    values
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| format!("`{}`", text(v)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A description on one table line.
fn cell(value: &Value) -> String {
    escape(&text(value).split_whitespace().collect::<Vec<_>>().join(" "))
}

/// `|` ends a table cell, even inside a code span, unless escaped.
fn escape(s: &str) -> String {
    s.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_covers_every_field_and_rule() {
        let reference = markdown();
        for needle in [
            "| `spec.target` | string | yes |",
            "| `spec.holderRef.kind` |",
            "| `spec.ttlSeconds` | integer (int32) | no | `30` | ≥ 1; ≤ 3600 |",
            "| `status.conditions[].reason` |",
            "`!has(self.maxHoldSeconds) \\|\\| self.maxHoldSeconds >= self.ttlSeconds`",
            "| Token | `.status.fencingToken` | integer |",
            "one of `Pending`, `Waiting`, `Held`, `Released`, `Lost`, `Failed`",
        ] {
            assert!(reference.contains(needle), "reference lacks {needle}");
        }
    }
}

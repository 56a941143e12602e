//! Reading `INFO` replies, in one place: the role of a server, its replicas in sync and its
//! eviction policy. A cluster answers per node, so a reply is read as the texts it holds.

use redis::Value;

/// Every text in a reply, however nested (a cluster answers INFO per node).
pub(super) fn texts(value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    collect(value, &mut out);
    out
}

fn collect(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => out.push(s.clone()),
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|item| collect(item, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| collect(v, out)),
        _ => {}
    }
}

/// The values of `field` (`field:value` lines) in every text.
pub(super) fn fields<'a>(texts: &'a [String], field: &str) -> Vec<&'a str> {
    let prefix = format!("{field}:");
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|line| line.trim().strip_prefix(prefix.as_str()))
        .collect()
}

/// The role one server's `INFO replication` text names (`master`, `slave`), if any.
pub(super) fn role(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|line| line.trim().strip_prefix("role:"))
}

/// How many replicas one server's `INFO replication` text shows in sync.
pub(super) fn online_replicas(text: &str) -> usize {
    text.lines().filter(|line| online_replica(line)).count()
}

/// Whether an `INFO replication` line is a replica in sync: `slave<N>:...,state=online,...`.
fn online_replica(line: &str) -> bool {
    let Some((name, fields)) = line.trim().split_once(':') else {
        return false;
    };
    name.strip_prefix("slave")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        && fields.split(',').any(|field| field == "state=online")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_roles_replicas_and_fields_from_nested_replies() {
        let node = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                    slave0:ip=127.0.0.1,port=1,state=online,offset=1,lag=0\r\n\
                    slave1:ip=127.0.0.1,port=2,state=wait_bgsave,offset=0,lag=0\r\n\
                    slaves:bogus,state=online\r\n";
        let reply = Value::Array(vec![
            Value::BulkString(node.as_bytes().to_vec()),
            Value::Map(vec![(
                Value::SimpleString("n2".into()),
                Value::VerbatimString {
                    format: redis::VerbatimFormat::Text,
                    text: "role:slave\r\nmaxmemory_policy:noeviction\r\n".into(),
                },
            )]),
        ]);
        let texts = texts(&reply);
        assert_eq!(texts.len(), 2);
        assert_eq!(role(&texts[0]), Some("master"));
        assert_eq!(role(&texts[1]), Some("slave"));
        assert_eq!(online_replicas(&texts[0]), 1);
        assert_eq!(fields(&texts, "maxmemory_policy"), ["noeviction"]);
        assert_eq!(role("no role here"), None);
    }

    #[test]
    fn counts_only_replicas_in_sync() {
        assert!(online_replica(
            "slave0:ip=127.0.0.1,port=6380,state=online,offset=42,lag=0"
        ));
        assert!(online_replica(
            "slave12:ip=10.0.0.7,port=6379,state=online,offset=1,lag=1\r"
        ));
        assert!(!online_replica(
            "slave0:ip=127.0.0.1,port=6380,state=wait_bgsave,offset=0,lag=0"
        ));
        assert!(!online_replica("slave_repl_offset:42"));
        assert!(!online_replica("connected_slaves:1"));
        assert!(!online_replica("slave:state=online"));
    }
}

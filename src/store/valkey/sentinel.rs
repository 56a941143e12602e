//! Finding the primary through Sentinel, at every connect.
//!
//! The sentinels are asked in turn, the one that answered last first, with
//! `SENTINEL GET-MASTER-ADDR-BY-NAME` (each question bounded by the connect timeout). The primary a
//! sentinel names is connected to with the data credentials, and its role is read with
//! `INFO replication` on that very connection, the one that will carry the calls: a sentinel
//! that does not know the name, names a replica (a failover in progress, or a sentinel on the
//! wrong side of a partition) or names a server that cannot be reached is passed over. When
//! every sentinel fails, the error names each one's cause.
//!
//! Why not redis-rs' own Sentinel client: it asks `SENTINEL MASTERS` (an ACL right that shows
//! every monitored primary, where one name needs `SENTINEL GET-MASTER-ADDR-BY-NAME`), checks
//! the role on a separate connection with its own fixed timeouts (the connection that carries
//! the calls is never the one checked), and has no hook for the TLS server name.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::Value;
use redis::aio::MultiplexedConnection;

use super::classify::{classify, millis};
use super::config::{HostPort, Sentinels, TlsMaterial};
use super::connect::{Connector, collect_text};
use crate::redact::Secret;
use crate::store::{ErrorKind, StoreError};

/// Which sentinel to ask first: the one that answered last. Shared by every connect of a store.
#[derive(Debug, Default)]
pub(super) struct Order {
    first: AtomicUsize,
}

impl Order {
    /// Indexes of `count` sentinels in the order to ask them.
    fn in_turn(&self, count: usize) -> impl Iterator<Item = usize> {
        let first = self.first.load(Ordering::Relaxed) % count.max(1);
        (0..count).map(move |i| (first + i) % count)
    }

    fn answered(&self, index: usize) {
        self.first.store(index, Ordering::Relaxed);
    }
}

/// Why one sentinel did not lead to a primary.
enum Cause {
    /// The sentinel could not be asked (or refused the question).
    Asking(StoreError),
    /// The question ran out of time.
    Slow(Duration),
    /// The sentinel does not monitor a primary of that name.
    Unknown,
    /// The named server could not be connected to, or refused the data credentials.
    Primary(HostPort, StoreError),
    /// The named server is not a primary.
    NotPrimary(HostPort, String),
    /// The named server has fewer replicas online than the durability needs.
    TooFewReplicas(HostPort, usize),
    /// The named server was already tried on this connect.
    Again(HostPort),
}

/// Connects to the primary the sentinels name; answers the connection and the primary's
/// address.
pub(super) async fn connect(
    connector: &Connector,
    sentinels: &Sentinels,
    limit: Duration,
    password: Option<&Secret>,
    material: Option<&TlsMaterial>,
) -> Result<(MultiplexedConnection, HostPort), StoreError> {
    let sentinel_password = sentinels.password.as_ref().map(|p| p.load()).transpose()?;
    let order = connector.sentinel_order();
    let mut failures: Vec<(&HostPort, Cause)> = Vec::new();
    let mut tried: Vec<HostPort> = Vec::new();
    for index in order.in_turn(sentinels.addrs.len()) {
        let sentinel = &sentinels.addrs[index];
        let asked = ask(
            connector,
            sentinel,
            sentinels,
            sentinel_password.as_ref(),
            material,
            limit,
        );
        let primary = match tokio::time::timeout(limit, asked).await {
            Err(_) => {
                failures.push((sentinel, Cause::Slow(limit)));
                continue;
            }
            Ok(Err(e)) => {
                failures.push((sentinel, Cause::Asking(e)));
                continue;
            }
            Ok(Ok(None)) => {
                failures.push((sentinel, Cause::Unknown));
                continue;
            }
            Ok(Ok(Some(primary))) => primary,
        };
        if tried.contains(&primary) {
            failures.push((sentinel, Cause::Again(primary)));
            continue;
        }
        tried.push(primary.clone());
        let opened = open_primary(connector, &primary, limit, password, material);
        let cause = match tokio::time::timeout(limit, opened).await {
            Ok(Ok(Role::Primary(conn))) => {
                order.answered(index);
                return Ok((conn, primary));
            }
            Ok(Ok(Role::Other(role))) => Cause::NotPrimary(primary, role),
            Ok(Ok(Role::Short(online))) => Cause::TooFewReplicas(primary, online),
            Ok(Err(e)) => Cause::Primary(primary, e),
            Err(_) => Cause::Primary(
                primary,
                StoreError::Unavailable {
                    endpoint: String::new(),
                    cause: format!("connect timed out after {} ms", millis(limit)),
                },
            ),
        };
        failures.push((sentinel, cause));
    }
    Err(no_primary(connector, sentinels, failures))
}

/// The primary the sentinels name now, without connecting to it: the first answer of the
/// sentinels asked in turn (each question bounded by `limit`); `None` when none answered with an
/// address. Polled while the pool is in use, so that a failover is followed even while the
/// pooled connections to the old primary still work (a demoted primary keeps taking writes until
/// the sentinels reconfigure it, which they do only seconds later).
pub(super) async fn named_primary(
    connector: &Connector,
    sentinels: &Sentinels,
    limit: Duration,
    material: Option<&TlsMaterial>,
) -> Option<HostPort> {
    let password = sentinels.password.as_ref().and_then(|p| p.load().ok());
    let order = connector.sentinel_order();
    for index in order.in_turn(sentinels.addrs.len()) {
        let sentinel = &sentinels.addrs[index];
        let asked = ask(
            connector,
            sentinel,
            sentinels,
            password.as_ref(),
            material,
            limit,
        );
        if let Ok(Ok(Some(primary))) = tokio::time::timeout(limit, asked).await {
            return Some(primary);
        }
    }
    None
}

/// Asks one sentinel for the primary's address; `None` when it does not know the name.
async fn ask(
    connector: &Connector,
    sentinel: &HostPort,
    sentinels: &Sentinels,
    password: Option<&Secret>,
    material: Option<&TlsMaterial>,
    limit: Duration,
) -> Result<Option<HostPort>, StoreError> {
    let endpoint = format!("sentinel {sentinel}");
    let fail = |e: redis::RedisError| classify(&endpoint, &e, limit, true);
    let info = connector.connection_info(
        &sentinel.url(),
        &endpoint,
        sentinels.username.as_deref(),
        password,
    )?;
    // The smallest ACL on a sentinel allows AUTH and this one question, not CLIENT SETINFO.
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let info = info.set_redis_settings(settings);
    let mut conn = connector
        .open_single(info, &sentinel.host, material)
        .await
        .map_err(fail)?;
    let reply: Value = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(&sentinels.master)
        .query_async(&mut conn)
        .await
        .map_err(fail)?;
    parse_address(&reply).map_err(|why| {
        StoreError::UnexpectedReply(format!(
            "{endpoint}: SENTINEL GET-MASTER-ADDR-BY-NAME answered {why}"
        ))
    })
}

/// `[host, port]`, or nil for a name the sentinel does not monitor.
fn parse_address(reply: &Value) -> Result<Option<HostPort>, String> {
    let items = match reply {
        Value::Nil => return Ok(None),
        Value::Array(items) if items.len() == 2 => items,
        _ => return Err("neither an address nor nil".into()),
    };
    let mut texts = Vec::new();
    items.iter().for_each(|item| collect_text(item, &mut texts));
    let [host, port] = texts.as_slice() else {
        return Err("an address that is not two strings".into());
    };
    let joined = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    joined.parse().map(Some)
}

/// What the named server turned out to be.
enum Role {
    /// A primary, on the connection that will carry the calls.
    Primary(MultiplexedConnection),
    /// Something else (`role:slave`, or no role line).
    Other(String),
    /// A primary with fewer replicas online than the durability needs.
    Short(usize),
}

/// Connects to `primary` with the data credentials and reads its role on that connection.
async fn open_primary(
    connector: &Connector,
    primary: &HostPort,
    limit: Duration,
    password: Option<&Secret>,
    material: Option<&TlsMaterial>,
) -> Result<Role, StoreError> {
    let endpoint = primary.to_string();
    let fail = |e: redis::RedisError| classify(&endpoint, &e, limit, true);
    let info =
        connector.connection_info(&primary.url(), &endpoint, connector.username(), password)?;
    let mut conn = connector
        .open_single(info, &primary.host, material)
        .await
        .map_err(fail)?;
    let reply: Value = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .map_err(fail)?;
    let mut texts = Vec::new();
    collect_text(&reply, &mut texts);
    let text = texts.concat();
    let role = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("role:"))
        .unwrap_or("unknown")
        .to_owned();
    if role != "master" {
        return Ok(Role::Other(role));
    }
    let wanted = usize::try_from(connector.durability().replicas).unwrap_or(usize::MAX);
    let online = text
        .lines()
        .filter(|line| super::online_replica(line))
        .count();
    if online < wanted {
        return Ok(Role::Short(online));
    }
    Ok(Role::Primary(conn))
}

/// The error of a connect on which no sentinel led to a primary: the kind of the refusals when
/// every refusal is of one kind (a wrong password is `access_denied`, a name no sentinel knows
/// is `invalid_config`), `unavailable` otherwise (sentinels down, a failover in progress); the
/// message names each sentinel's cause.
fn no_primary(
    connector: &Connector,
    sentinels: &Sentinels,
    failures: Vec<(&HostPort, Cause)>,
) -> StoreError {
    let endpoint = connector.endpoint().to_owned();
    let master = &sentinels.master;
    // The refusals among the answers (a sentinel down or slow, a replica named, a primary
    // already tried are not refusals): one consistent refusal (the same wrong password
    // everywhere) is the error even when other sentinels are down.
    let refusals: Vec<ErrorKind> = failures
        .iter()
        .filter_map(|(_, cause)| match cause {
            Cause::Asking(e) | Cause::Primary(_, e) => Some(e.kind()),
            Cause::Unknown => Some(ErrorKind::InvalidConfig),
            _ => None,
        })
        .filter(|kind| *kind != ErrorKind::Unavailable)
        .collect();
    let each: Vec<String> = failures
        .into_iter()
        .map(|(sentinel, cause)| {
            let why = match cause {
                Cause::Asking(e) => reason(&e),
                Cause::Slow(limit) => format!("no answer within {} ms", millis(limit)),
                Cause::Unknown => format!("monitors no primary named {master:?}"),
                Cause::Primary(primary, e) => {
                    format!("named {primary}, which failed: {}", reason(&e))
                }
                Cause::NotPrimary(primary, role) => {
                    format!("named {primary}, which answers role:{role} (a failover in progress?)")
                }
                Cause::TooFewReplicas(primary, online) => format!(
                    "named {primary}, which has {online} replica(s) online where the durability \
                     {} needs {}",
                    connector.durability(),
                    connector.durability().replicas
                ),
                Cause::Again(primary) => format!("named {primary} too, already tried"),
            };
            format!("sentinel {sentinel}: {why}")
        })
        .collect();
    let cause = format!("no sentinel led to the primary: {}", each.join("; "));
    let same = refusals
        .first()
        .copied()
        .filter(|first| refusals.iter().all(|k| k == first));
    match same {
        Some(ErrorKind::AccessDenied) => StoreError::AccessDenied { endpoint, cause },
        Some(ErrorKind::Tls) => StoreError::Tls { endpoint, cause },
        Some(ErrorKind::InvalidConfig) => StoreError::InvalidConfig(format!(
            "{endpoint}: {cause}; check --valkey-sentinel-master"
        )),
        _ => StoreError::Unavailable { endpoint, cause },
    }
}

/// The part of a store error that says why, without the endpoint it names.
fn reason(e: &StoreError) -> String {
    match e {
        StoreError::Unavailable { cause, .. }
        | StoreError::AccessDenied { cause, .. }
        | StoreError::Tls { cause, .. } => cause.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn addresses_parse_and_nil_is_unknown() {
        let v4 = Value::Array(vec![bulk("10.0.0.7"), bulk("6379")]);
        assert_eq!(
            parse_address(&v4).unwrap().unwrap().to_string(),
            "10.0.0.7:6379"
        );
        let v6 = Value::Array(vec![bulk("fd00::7"), bulk("6380")]);
        let v6 = parse_address(&v6).unwrap().unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("fd00::7", 6380));
        assert!(parse_address(&Value::Nil).unwrap().is_none());
        for bad in [
            Value::Array(vec![bulk("h")]),
            Value::Array(vec![bulk("h"), bulk("0")]),
            Value::Array(vec![bulk("h"), bulk("99999")]),
            Value::Array(vec![bulk("h h"), bulk("1")]),
            bulk("h:1"),
        ] {
            assert!(parse_address(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_sentinel_that_answered_last_is_asked_first() {
        let order = Order::default();
        assert_eq!(order.in_turn(3).collect::<Vec<_>>(), [0, 1, 2]);
        order.answered(2);
        assert_eq!(order.in_turn(3).collect::<Vec<_>>(), [2, 0, 1]);
    }
}

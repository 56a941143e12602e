//! Finding the primary through Sentinel, at every connect.
//!
//! The sentinels are asked in turn, the one that answered first last time first, with
//! `SENTINEL GET-MASTER-ADDR-BY-NAME`, until a majority of the configured sentinels name the same
//! server: a sentinel on the minority side of a partition, or one that has not heard of a
//! failover yet, is outvoted rather than followed. Each question gets a share of the connect
//! timeout (what is left, divided among the sentinels not yet asked and the primary), so a
//! sentinel that accepts connections and never answers leaves time for the others. The server
//! the majority names is connected to with the data credentials, and its role is read with
//! `INFO replication` on that very connection, the one that will carry the calls. When no
//! primary is found, the error names each sentinel's answer.
//!
//! Why not redis-rs' own Sentinel client: it asks `SENTINEL MASTERS` (an ACL right that shows
//! every monitored primary, where one name needs `SENTINEL GET-MASTER-ADDR-BY-NAME`), follows the
//! first sentinel that answers, checks the role on a separate connection with its own fixed
//! timeouts (the connection that carries the calls is never the one checked), and has no hook
//! for the TLS server name.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use redis::Value;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use super::classify::classify;
use super::config::{HostPort, Sentinels, TlsMaterial};
use super::connect::Connector;
use super::info;
use crate::redact::Secret;
use crate::store::{ErrorKind, StoreError};
use crate::time::millis;

/// In which order to ask the sentinels: from the first that answered last time, and the ones
/// that did not answer in time last time at the end (a majority is usually reached before
/// them). Shared by every connect of a store (both of its pools) and by its poll.
#[derive(Debug, Default)]
pub(super) struct Order {
    first: AtomicUsize,
    /// One bit per sentinel (at most 16 are configured): slow or silent at its last question.
    slow: AtomicU64,
}

impl Order {
    /// Indexes of `count` sentinels in the order to ask them.
    fn in_turn(&self, count: usize) -> Vec<usize> {
        let first = self.first.load(Ordering::Relaxed) % count.max(1);
        let rotated = (0..count).map(|i| (first + i) % count);
        let (answered, slow): (Vec<usize>, Vec<usize>) = rotated.partition(|&i| !self.is_slow(i));
        answered.into_iter().chain(slow).collect()
    }

    fn ask_first(&self, index: usize) {
        self.first.store(index, Ordering::Relaxed);
    }

    fn is_slow(&self, index: usize) -> bool {
        index < 64 && self.slow.load(Ordering::Relaxed) & (1 << index) != 0
    }

    fn set_slow(&self, index: usize, slow: bool) {
        if index >= 64 {
            return;
        }
        if slow {
            self.slow.fetch_or(1 << index, Ordering::Relaxed);
        } else {
            self.slow.fetch_and(!(1 << index), Ordering::Relaxed);
        }
    }
}

/// What one sentinel answered, when it did not help name a primary.
enum Cause {
    /// The sentinel could not be asked (or refused the question).
    Asking(StoreError),
    /// The question ran out of its share of the time.
    Slow(Duration),
    /// The sentinel does not monitor a primary of that name.
    Unknown,
    /// The sentinel named this server, which no majority named.
    Named(HostPort),
}

/// The answers of one round of questions.
struct Round<'a> {
    /// The server a majority named, if one did.
    primary: Option<HostPort>,
    /// What the sentinels that did not lead to it said.
    answers: Vec<(&'a HostPort, Cause)>,
}

/// How many of `count` sentinels make a majority.
fn quorum(count: usize) -> usize {
    count / 2 + 1
}

/// Asks the sentinels in turn until a majority of them name one server, by `until`.
async fn ask_majority<'a>(
    connector: &Connector,
    order: &Order,
    sentinels: &'a Sentinels,
    until: Instant,
    limit: Duration,
    material: Option<&TlsMaterial>,
) -> Result<Round<'a>, StoreError> {
    let password = sentinels.password.as_ref().map(|p| p.load()).transpose()?;
    let count = sentinels.addrs.len();
    let mut votes: Vec<(HostPort, usize)> = Vec::new();
    let mut answers = Vec::new();
    let mut first_answered = None;
    let turn = order.in_turn(count);
    for (asked, &index) in turn.iter().enumerate() {
        let sentinel = &sentinels.addrs[index];
        // What is left is shared by the answers still needed for a majority (or the sentinels
        // left, if fewer) and the primary.
        let most_votes = votes.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let needed = (quorum(count) - most_votes).min(count - asked);
        let sharers = u32::try_from(needed + 1).unwrap_or(u32::MAX);
        let share = limit.min(until.saturating_duration_since(Instant::now()) / sharers);
        // Marked slow until it answers: should this connect be abandoned during the question
        // (the call's deadline), the next one asks it last.
        order.set_slow(index, true);
        let question = ask(
            connector,
            sentinel,
            sentinels,
            password.as_ref(),
            material,
            share,
        );
        let answer = tokio::time::timeout(share, question).await;
        order.set_slow(index, answer.is_err());
        let primary = match answer {
            Err(_) => {
                answers.push((sentinel, Cause::Slow(share)));
                continue;
            }
            Ok(Err(e)) => {
                answers.push((sentinel, Cause::Asking(e)));
                continue;
            }
            Ok(Ok(None)) => {
                answers.push((sentinel, Cause::Unknown));
                continue;
            }
            Ok(Ok(Some(primary))) => primary,
        };
        if first_answered.is_none() {
            first_answered = Some(index);
            order.ask_first(index);
        }
        let votes_for = match votes.iter_mut().find(|(named, _)| *named == primary) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                votes.push((primary.clone(), 1));
                1
            }
        };
        if votes_for >= quorum(count) {
            answers.retain(|(_, cause)| !matches!(cause, Cause::Named(named) if *named == primary));
            return Ok(Round {
                primary: Some(primary),
                answers,
            });
        }
        answers.push((sentinel, Cause::Named(primary)));
    }
    Ok(Round {
        primary: None,
        answers,
    })
}

/// Connects to the primary a majority of the sentinels name; answers the connection and the
/// primary's address.
pub(super) async fn connect(
    connector: &Connector,
    order: &Order,
    sentinels: &Sentinels,
    limit: Duration,
    password: Option<&Secret>,
    material: Option<&TlsMaterial>,
) -> Result<(MultiplexedConnection, HostPort), StoreError> {
    let until = Instant::now() + limit;
    let round = ask_majority(connector, order, sentinels, until, limit, material).await?;
    let Some(primary) = round.primary else {
        return Err(no_majority(connector, sentinels, round.answers));
    };
    let endpoint = connector.endpoint();
    let named = format!("the sentinels' majority names {primary}");
    let left = until.saturating_duration_since(Instant::now());
    let opened = open_primary(connector, &primary, left, password, material);
    let failed = |cause: String| StoreError::Unavailable {
        endpoint: endpoint.to_owned(),
        cause,
    };
    match tokio::time::timeout(left, opened).await {
        Ok(Ok(Role::Primary(conn))) => Ok((conn, primary)),
        Ok(Ok(Role::Other(role))) => Err(failed(format!(
            "{named}, which answers role:{role} (a failover in progress?)"
        ))),
        Ok(Ok(Role::Short(online))) => Err(failed(format!(
            "{named}, which has {online} replica(s) online where the durability {} needs {}",
            connector.durability(),
            connector.replicas_needed()
        ))),
        Ok(Err(e)) => Err(match e {
            StoreError::AccessDenied { cause, .. } => StoreError::AccessDenied {
                endpoint: endpoint.to_owned(),
                cause: format!("{named}, which refused the data user: {cause}"),
            },
            StoreError::Tls { cause, .. } => StoreError::Tls {
                endpoint: endpoint.to_owned(),
                cause: format!("{named}: {cause}"),
            },
            other => failed(format!("{named}, which failed: {}", reason(&other))),
        }),
        Err(_) => Err(failed(format!(
            "{named}, which did not answer within {} ms",
            millis(left)
        ))),
    }
}

/// The primary a majority of the sentinels name now, without connecting to it; `None` when no
/// majority names one (or the sentinels cannot be asked). Polled while the pool is in use, so
/// that a failover is followed even while the pooled connections to the old primary still work
/// (a demoted primary keeps taking writes until the sentinels reconfigure it, seconds later).
pub(super) async fn named_primary(
    connector: &Connector,
    order: &Order,
    sentinels: &Sentinels,
    limit: Duration,
    material: Option<&TlsMaterial>,
) -> Result<Option<HostPort>, StoreError> {
    let until = Instant::now() + limit;
    let round = ask_majority(connector, order, sentinels, until, limit, material).await?;
    match round.primary {
        Some(primary) => Ok(Some(primary)),
        None => Err(no_majority(connector, sentinels, round.answers)),
    }
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
    let texts: Vec<String> = items.iter().flat_map(info::texts).collect();
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
    let text = info::texts(&reply).concat();
    let role = info::role(&text).unwrap_or("unknown").to_owned();
    if role != "master" {
        return Ok(Role::Other(role));
    }
    let wanted = usize::try_from(connector.replicas_needed()).unwrap_or(usize::MAX);
    let online = info::online_replicas(&text);
    if online < wanted {
        return Ok(Role::Short(online));
    }
    Ok(Role::Primary(conn))
}

/// The error of a round in which no majority of the sentinels named one primary. When a
/// majority refused the same way (a wrong password is `access_denied`, a name they do not
/// monitor `invalid_config`, a certificate they reject `tls`), that is the error: a minority
/// could be a sentinel restarting, a majority is the configuration. Otherwise `unavailable`
/// (sentinels down, a failover still spreading among them). The message names each answer.
fn no_majority(
    connector: &Connector,
    sentinels: &Sentinels,
    answers: Vec<(&HostPort, Cause)>,
) -> StoreError {
    let endpoint = connector.endpoint().to_owned();
    let master = &sentinels.master;
    let count = sentinels.addrs.len();
    // A server that does not understand SENTINEL (a data port listed as a sentinel) answers
    // an unexpected reply: like a wrong name, a configuration to fix.
    let refusals: Vec<ErrorKind> = answers
        .iter()
        .filter_map(|(_, cause)| match cause {
            Cause::Asking(e) => Some(e.kind()),
            Cause::Unknown => Some(ErrorKind::InvalidConfig),
            Cause::Slow(_) | Cause::Named(_) => None,
        })
        .filter(|kind| *kind != ErrorKind::Unavailable)
        .collect();
    let unknown = answers
        .iter()
        .filter(|(_, cause)| matches!(cause, Cause::Unknown))
        .count();
    let majority_kind = refusals
        .iter()
        .copied()
        .find(|kind| refusals.iter().filter(|k| *k == kind).count() >= quorum(count));
    let each: Vec<String> = answers
        .into_iter()
        .map(|(sentinel, cause)| {
            let why = match cause {
                Cause::Asking(e) => reason(&e),
                Cause::Slow(share) => format!("no answer within {} ms", millis(share)),
                Cause::Unknown => format!("monitors no primary named {master:?}"),
                Cause::Named(primary) => format!("named {primary}"),
            };
            format!("sentinel {sentinel}: {why}")
        })
        .collect();
    let cause = format!(
        "no majority of the {count} sentinel(s) ({} needed) names one primary: {}",
        quorum(count),
        each.join("; ")
    );
    match majority_kind {
        Some(ErrorKind::AccessDenied) => StoreError::AccessDenied { endpoint, cause },
        Some(ErrorKind::Tls) => StoreError::Tls { endpoint, cause },
        Some(ErrorKind::InvalidConfig) if unknown >= quorum(count) => StoreError::InvalidConfig(
            format!("{endpoint}: {cause}; check --valkey-sentinel-master"),
        ),
        Some(ErrorKind::UnexpectedReply) => StoreError::InvalidConfig(format!(
            "{endpoint}: {cause}; are these sentinels (--valkey-sentinels, usually port 26379)?"
        )),
        Some(ErrorKind::InvalidConfig) => StoreError::InvalidConfig(format!("{endpoint}: {cause}")),
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
    fn the_sentinel_that_answered_first_is_asked_first_and_a_majority_decides() {
        let order = Order::default();
        assert_eq!(order.in_turn(3), [0, 1, 2]);
        order.ask_first(2);
        assert_eq!(order.in_turn(3), [2, 0, 1]);
        order.set_slow(0, true);
        assert_eq!(
            order.in_turn(3),
            [2, 1, 0],
            "a silent sentinel is asked last"
        );
        order.set_slow(0, false);
        assert_eq!(order.in_turn(3), [2, 0, 1]);
        assert_eq!((quorum(1), quorum(2), quorum(3), quorum(4)), (1, 2, 2, 3));
    }
}

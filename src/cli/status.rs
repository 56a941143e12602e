//! `targetlease status TARGET`: who holds a target and who waits for it, in the order the
//! controller serves them, read from the API server alone (no store credentials needed: the
//! rights of the built-in `view` role suffice). Installed as kubectl's plugin
//! (`kubectl-targetlease` on the PATH, a link to this binary), it runs as
//! `kubectl targetlease status TARGET`.
//!
//! The order is the controller's own ([`in_order`]): priority, then creation, then the order the
//! controller saw the claims in; that last one lives in the controller only, so claims created
//! within the same second are listed by name here.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use serde::Serialize;

use super::client::lease_client;
use super::exit;
use crate::api::heartbeat::stopping;
use crate::api::{ConditionType, Phase, TargetLease};
use crate::controller::line::queue::{in_line, in_order, occupies};
use crate::store::TargetRef;

/// Flags of `targetlease status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The target (`spec.target`).
    target: String,
    /// Namespace of the TargetLeases (default: the kubeconfig's or the pod's namespace).
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t)]
    output: Output,
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    /// Tables for a person.
    #[default]
    Text,
    /// One JSON object for a program.
    Json,
}

/// What `status` shows of one target.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Report {
    namespace: String,
    target: String,
    /// The permits value in force: the holders' (none while nobody holds the target).
    permits: Option<u32>,
    holders: Vec<Holder>,
    /// In the order they will be served.
    waiting: Vec<Waiter>,
    /// Claims on the target that neither hold it nor wait for it (released, failed, deleted).
    others: Vec<Other>,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Holder {
    name: String,
    holder: String,
    slot: Option<u32>,
    token: Option<u64>,
    expires_at: Option<Timestamp>,
    /// The tenure ended and its holder has not confirmed yet that it stopped: the permit is
    /// passed on once it does.
    stopping: bool,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Waiter {
    position: usize,
    name: String,
    holder: String,
    priority: i32,
    permits: u32,
    created: Option<Timestamp>,
    /// The Ready condition's reason, as the controller wrote it.
    reason: Option<String>,
    /// Why it waits, in words.
    why: String,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Other {
    name: String,
    holder: String,
    phase: Option<Phase>,
    reason: Option<String>,
    being_deleted: bool,
}

impl StatusArgs {
    /// Prints the report; exit status 0, or 1 when the API server cannot be read.
    pub async fn run(self) -> ExitCode {
        match self.report().await {
            Ok(report) => {
                match self.output {
                    Output::Json => match serde_json::to_string_pretty(&report) {
                        Ok(json) => println!("{json}"),
                        Err(e) => {
                            eprintln!("targetlease status: {e}");
                            return ExitCode::from(exit::FAILURE);
                        }
                    },
                    Output::Text => print!("{}", text(&report, Timestamp::now())),
                }
                ExitCode::from(exit::OK)
            }
            Err(message) => {
                eprintln!("targetlease status: {message}");
                ExitCode::from(exit::FAILURE)
            }
        }
    }

    async fn report(&self) -> Result<Report, String> {
        let (client, namespace) = lease_client(self.namespace.clone()).await?;
        // A name the CRD would refuse (or a `,` or `=` that would change the field selector)
        // is refused here, with the rule.
        TargetRef::new(&namespace, &self.target).map_err(|e| e.to_string())?;
        let api: Api<TargetLease> = Api::namespaced(client, &namespace);
        // spec.target is a selectable field of the CRD: the API server filters.
        let listed = api
            .list(&ListParams::default().fields(&format!("spec.target={}", self.target)))
            .await
            .map_err(|e| format!("cannot list the TargetLeases on {}: {e}", self.target))?;
        Ok(report(&namespace, &self.target, &listed.items))
    }
}

fn ready_reason(lease: &TargetLease) -> Option<String> {
    lease.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == ConditionType::Ready.as_str())
            .map(|c| c.reason.clone())
    })
}

/// The permits value a claim holds (or held) its permit under: its status's, else its spec's.
fn granted_permits(lease: &TargetLease) -> u32 {
    lease
        .status
        .as_ref()
        .and_then(|s| s.permits)
        .unwrap_or(lease.spec.permits)
}

/// The report of the claims `leases` on `target`.
fn report(namespace: &str, target: &str, leases: &[TargetLease]) -> Report {
    let on_target: Vec<&TargetLease> = leases.iter().filter(|l| l.spec.target == target).collect();
    // A claim shown Held, or whose ended tenure's holder is not confirmed stopped: it occupies
    // its permit (and is listed once, here, even when it is in line again).
    let mut holding: Vec<&TargetLease> =
        on_target.iter().copied().filter(|l| occupies(l)).collect();
    holding.sort_by_key(|l| (l.status.as_ref().and_then(|s| s.slot), l.name_any()));
    let in_force = holding.first().map(|l| granted_permits(l));
    let line: Vec<&TargetLease> = in_order(on_target.iter().copied(), |_| 0)
        .into_iter()
        .filter(|l| !occupies(l))
        .collect();
    let asked: std::collections::BTreeSet<u32> = line.iter().map(|l| l.spec.permits).collect();
    let holder_names: Vec<String> = holding.iter().map(|l| l.name_any()).collect();
    // Per permits value, the claims of that value served before this one: each value has a line
    // of its own (the controller's), and only the value in force, if any, can be granted.
    let mut before: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    let waiting = line
        .iter()
        .enumerate()
        .map(|(i, lease)| {
            let permits = lease.spec.permits;
            let why = match in_force {
                Some(force) if force != permits => format!(
                    "asks permits {permits} while permits {force} are in force: waits until every \
                     permit granted under them is given up"
                ),
                _ => {
                    let free = usize::try_from(permits)
                        .unwrap_or(usize::MAX)
                        .saturating_sub(holding.len());
                    let ahead = before.entry(permits).or_default();
                    *ahead += 1;
                    let place = *ahead;
                    if place <= free && in_force.is_none() && asked.len() > 1 {
                        let others: Vec<String> = asked
                            .iter()
                            .filter(|p| **p != permits)
                            .map(ToString::to_string)
                            .collect();
                        format!(
                            "next: asks the store now, as do the claims asking permits {}: the \
                             first granted sets the value in force",
                            others.join(", ")
                        )
                    } else if place <= free {
                        "next: a permit is free, the controller is granting it".to_owned()
                    } else if place == 1 {
                        format!(
                            "next: gets the first permit given up by {}",
                            holder_names.join(", ")
                        )
                    } else {
                        format!("{} ahead of it in line", place - 1)
                    }
                }
            };
            Waiter {
                position: i + 1,
                name: lease.name_any(),
                holder: lease.spec.holder.clone(),
                priority: lease.spec.priority.unwrap_or(0),
                permits,
                created: lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
                reason: ready_reason(lease),
                why,
            }
        })
        .collect();
    let holders = holding
        .iter()
        .map(|lease| {
            let status = lease.status.as_ref();
            Holder {
                name: lease.name_any(),
                holder: lease.spec.holder.clone(),
                slot: status.and_then(|s| s.slot),
                token: status.and_then(|s| s.fencing_token),
                expires_at: status.and_then(|s| s.expires_at),
                stopping: stopping(lease),
            }
        })
        .collect();
    let others = on_target
        .iter()
        .filter(|l| !occupies(l) && !in_line(l))
        .map(|lease| Other {
            name: lease.name_any(),
            holder: lease.spec.holder.clone(),
            phase: lease.status.as_ref().map(|s| s.phase),
            reason: ready_reason(lease),
            being_deleted: lease.metadata.deletion_timestamp.is_some(),
        })
        .collect();
    Report {
        namespace: namespace.to_owned(),
        target: target.to_owned(),
        permits: in_force,
        holders,
        waiting,
        others,
    }
}

/// The report as tables, with expiries relative to `now`.
fn text(report: &Report, now: Timestamp) -> String {
    let mut out = format!(
        "Target {} in namespace {}: {} held, {} waiting{}\n",
        report.target,
        report.namespace,
        report.holders.len(),
        report.waiting.len(),
        report
            .permits
            .filter(|p| *p > 1)
            .map(|p| format!(" (permits {p})"))
            .unwrap_or_default()
    );
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    if !report.holders.is_empty() {
        let rows = report
            .holders
            .iter()
            .map(|h| {
                let expires = h.expires_at.map(|at| {
                    let left = at.as_second() - now.as_second();
                    format!(
                        "{at} ({})",
                        if left >= 0 {
                            format!("in {left}s")
                        } else {
                            format!("{}s ago", -left)
                        }
                    )
                });
                vec![
                    or_dash(h.slot.map(|s| s.to_string())),
                    or_dash(h.token.map(|t| t.to_string())),
                    h.name.clone(),
                    h.holder.clone(),
                    if h.stopping {
                        "stopping".to_owned()
                    } else {
                        or_dash(expires)
                    },
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&table(
            &["SLOT", "TOKEN", "TARGETLEASE", "HOLDER", "EXPIRES"],
            rows,
        ));
    }
    if !report.waiting.is_empty() {
        let rows = report
            .waiting
            .iter()
            .map(|w| {
                vec![
                    w.position.to_string(),
                    w.name.clone(),
                    w.holder.clone(),
                    w.priority.to_string(),
                    or_dash(w.reason.clone()),
                    w.why.clone(),
                ]
            })
            .collect();
        out.push_str("\nWaiting, in the order they will be served:\n");
        out.push_str(&table(
            &["#", "TARGETLEASE", "HOLDER", "PRIORITY", "REASON", "WHY"],
            rows,
        ));
    }
    if !report.others.is_empty() {
        let rows = report
            .others
            .iter()
            .map(|o| {
                vec![
                    o.name.clone(),
                    o.holder.clone(),
                    or_dash(o.phase.map(|p| format!("{p:?}"))),
                    or_dash(o.reason.clone()),
                    if o.being_deleted {
                        "being deleted".to_owned()
                    } else {
                        String::new()
                    },
                ]
            })
            .collect();
        out.push_str("\nNeither holding nor waiting:\n");
        out.push_str(&table(
            &["TARGETLEASE", "HOLDER", "PHASE", "REASON", ""],
            rows,
        ));
    }
    out
}

/// Columns padded to their widest cell, two spaces apart.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::api::{Condition, TargetLeaseSpec, TargetLeaseStatus, test_spec};

    fn claim(name: &str, created: i64, permits: u32, phase: Option<Phase>) -> TargetLease {
        let mut lease = TargetLease::new(
            name,
            TargetLeaseSpec {
                permits,
                ..test_spec("db", &format!("pod-{name}"))
            },
        );
        lease.metadata.namespace = Some("ns".into());
        lease.metadata.uid = Some(format!("uid-{name}"));
        lease.metadata.creation_timestamp = Some(Time(
            Timestamp::from_second(1_700_000_000 + created).expect("time"),
        ));
        lease.status = phase.map(|phase| TargetLeaseStatus {
            phase,
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: format!("{phase:?}"),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Timestamp::UNIX_EPOCH,
            }],
            ..TargetLeaseStatus::default()
        });
        lease
    }

    fn held(name: &str, created: i64, slot: u32, token: u64) -> TargetLease {
        let mut lease = claim(name, created, 2, Some(Phase::Held));
        if let Some(s) = lease.status.as_mut() {
            s.slot = Some(slot);
            s.fencing_token = Some(token);
            s.permits = Some(2);
        }
        lease
    }

    #[test]
    fn holders_by_slot_then_waiters_in_the_controllers_order() {
        let mut urgent = claim("urgent", 9, 2, Some(Phase::Waiting));
        urgent.spec.priority = Some(5);
        let leases = vec![
            claim("late", 8, 2, Some(Phase::Waiting)),
            held("b", 2, 0, 12),
            claim("early", 3, 2, Some(Phase::Waiting)),
            held("a", 1, 1, 11),
            urgent,
            claim("other-value", 4, 3, Some(Phase::Waiting)),
            claim("done", 0, 2, Some(Phase::Released)),
            claim("elsewhere", 0, 2, None).tap_target("cache"),
        ];
        let report = report("ns", "db", &leases);
        assert_eq!(report.permits, Some(2));
        let holders: Vec<(&str, Option<u32>, Option<u64>)> = report
            .holders
            .iter()
            .map(|h| (h.name.as_str(), h.slot, h.token))
            .collect();
        assert_eq!(
            holders,
            [("b", Some(0), Some(12)), ("a", Some(1), Some(11))]
        );
        let order: Vec<&str> = report.waiting.iter().map(|w| w.name.as_str()).collect();
        // Priority first, then creation; another permits value is in line but cannot be served.
        assert_eq!(order, ["urgent", "early", "other-value", "late"]);
        assert!(
            report.waiting[0]
                .why
                .starts_with("next: gets the first permit given up by b, a")
        );
        assert_eq!(report.waiting[1].why, "1 ahead of it in line");
        assert!(
            report.waiting[2]
                .why
                .contains("asks permits 3 while permits 2")
        );
        assert_eq!(report.waiting[3].why, "2 ahead of it in line");
        let others: Vec<&str> = report.others.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(others, ["done"]);
        let text = text(
            &report,
            Timestamp::from_second(1_700_000_000).expect("time"),
        );
        assert!(text.starts_with("Target db in namespace ns: 2 held, 4 waiting (permits 2)\n"));
        assert!(text.contains("Waiting, in the order they will be served:"));
    }

    #[test]
    fn without_holders_each_permits_value_has_its_line_and_a_stopping_holder_is_listed_once() {
        let leases = vec![
            claim("two", 1, 2, Some(Phase::Waiting)),
            claim("three", 2, 3, Some(Phase::Waiting)),
            claim("two-b", 3, 2, Some(Phase::Waiting)),
            claim("two-c", 4, 2, Some(Phase::Waiting)),
        ];
        let report = report("ns", "db", &leases);
        assert_eq!(report.permits, None);
        let why: Vec<(&str, &str)> = report
            .waiting
            .iter()
            .map(|w| (w.name.as_str(), w.why.as_str()))
            .collect();
        assert!(
            why[0]
                .1
                .starts_with("next: asks the store now, as do the claims asking permits 3")
        );
        assert!(
            why[1]
                .1
                .starts_with("next: asks the store now, as do the claims asking permits 2")
        );
        assert!(why[2].1.starts_with("next: asks the store now"), "{why:?}");
        assert_eq!(why[3], ("two-c", "2 ahead of it in line"));

        // A Lost claim whose holder has not confirmed it stopped occupies its permit: a holder,
        // not a waiter, although it is in line to take the target back.
        let mut ended = claim("ended", 0, 1, Some(Phase::Lost));
        if let Some(status) = ended.status.as_mut() {
            status.conditions.push(Condition {
                type_: "Held".into(),
                status: "False".into(),
                reason: "Stopping".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Timestamp::UNIX_EPOCH,
            });
        }
        let next = claim("next", 1, 1, Some(Phase::Waiting));
        let report = super::report("ns", "db", &[ended, next]);
        let holders: Vec<(&str, bool)> = report
            .holders
            .iter()
            .map(|h| (h.name.as_str(), h.stopping))
            .collect();
        assert_eq!(holders, [("ended", true)]);
        assert_eq!(report.waiting.len(), 1);
        assert_eq!(
            report.waiting[0].why,
            "next: gets the first permit given up by ended"
        );
    }

    #[test]
    fn a_free_permit_is_being_granted_and_an_empty_target_reports_nothing() {
        let leases = vec![held("a", 1, 0, 7), claim("next", 2, 2, None)];
        let report = report("ns", "db", &leases);
        assert_eq!(
            report.waiting[0].why,
            "next: a permit is free, the controller is granting it"
        );
        let empty = super::report("ns", "nothing", &leases);
        assert!(empty.holders.is_empty() && empty.waiting.is_empty() && empty.others.is_empty());
        assert_eq!(empty.permits, None);
    }

    trait TapTarget {
        fn tap_target(self, target: &str) -> Self;
    }

    impl TapTarget for TargetLease {
        fn tap_target(mut self, target: &str) -> Self {
            self.spec.target = target.to_owned();
            self
        }
    }
}

//! Prometheus metrics of the controller, served at `/metrics`.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kube::runtime::reflector::Store;

use crate::api::TargetLease;
use crate::build_info;

type Labels = Vec<(&'static str, String)>;

fn lateness_histogram() -> Histogram {
    // 1 ms .. ~33 s
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~4 s
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

/// Every metric the controller exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    reconciles: Family<Labels, Counter>,
    store_latency: Family<Labels, Histogram, fn() -> Histogram>,
    store_errors: Family<Labels, Counter>,
    transitions: Family<Labels, Counter>,
    handovers: Counter,
    status_writes: Counter,
    leases: Family<Labels, Gauge>,
    renewal_lateness: Histogram,
    kept: Gauge,
    shed: Family<Labels, Counter>,
    store_call_timeout: Gauge<f64, AtomicU64>,
    /// 1 while this replica may act (leads, or runs without leader election), 0 otherwise.
    pub leading: Gauge,
    cache: RwLock<Option<Store<TargetLease>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `targetlease_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("targetlease");
        let metrics = Self {
            registry: Mutex::new(Registry::default()),
            reconciles: Family::default(),
            store_latency: Family::new_with_constructor(latency_histogram),
            store_errors: Family::default(),
            transitions: Family::default(),
            handovers: Counter::default(),
            status_writes: Counter::default(),
            leases: Family::default(),
            renewal_lateness: lateness_histogram(),
            kept: Gauge::default(),
            shed: Family::default(),
            store_call_timeout: Gauge::default(),
            leading: Gauge::default(),
            cache: RwLock::new(None),
        };
        registry.register(
            "leading",
            "1 while this replica may act: it leads (or runs without leader election)",
            metrics.leading.clone(),
        );
        registry.register(
            "reconciles",
            "Reconciles by result (ok, or the error kind)",
            metrics.reconciles.clone(),
        );
        registry.register(
            "store_call_seconds",
            "Latency of lease-store calls by operation (acquire, renew, release, inspect)",
            metrics.store_latency.clone(),
        );
        registry.register(
            "store_errors",
            "Lease-store failures by operation and error kind",
            metrics.store_errors.clone(),
        );
        registry.register(
            "transitions",
            "Phase transitions written to TargetLease status, by new phase",
            metrics.transitions.clone(),
        );
        registry.register(
            "handovers",
            "Targets acquired by a TargetLease that was waiting for them",
            metrics.handovers.clone(),
        );
        registry.register(
            "status_writes",
            "Status writes made by the controller",
            metrics.status_writes.clone(),
        );
        registry.register(
            "leases",
            "TargetLeases known to the controller, by phase",
            metrics.leases.clone(),
        );
        registry.register(
            "renewal_lateness_seconds",
            "How long after it was due each renewal started (the renewal scheduler's backlog)",
            metrics.renewal_lateness.clone(),
        );
        registry.register(
            "renewed_leases",
            "Leases the renewal scheduler keeps renewing",
            metrics.kept.clone(),
        );
        registry.register(
            "writes_shed",
            "API writes the status budget held back, by kind (refresh: an expiresAt update put off; event: an Event not published)",
            metrics.shed.clone(),
        );
        registry.register(
            "store_call_timeout_seconds",
            "Deadline of one lease-store call (valkey.timeout); 0 with the in-memory store, which has none",
            metrics.store_call_timeout.clone(),
        );
        // Every phase's transition series exists from the start at 0: an alert on
        // `increase(...{phase="Lost"})` sees the first loss after a restart only if the series
        // was there before it.
        for phase in crate::api::Phase::ALL {
            drop(
                metrics
                    .transitions
                    .get_or_create(&vec![("phase", format!("{phase:?}"))]),
            );
        }
        let build_info: Family<Labels, Gauge> = Family::default();
        build_info
            .get_or_create(&vec![
                ("version", build_info::VERSION.to_owned()),
                ("commit", build_info::COMMIT.to_owned()),
                ("build_date", build_info::BUILD_DATE.to_owned()),
            ])
            .set(1);
        registry.register(
            "build_info",
            "Always 1; the labels name the version, commit and build date of the running binary",
            build_info,
        );
        *metrics.registry.lock().unwrap_or_else(|e| e.into_inner()) = registry;
        metrics
    }

    /// Counts one reconcile with its result label (`ok` or an error kind).
    pub fn reconciled(&self, result: &str) {
        self.reconciles
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    /// Records one store call.
    pub fn store_call(&self, op: &'static str, took: Duration, error: Option<&'static str>) {
        self.store_latency
            .get_or_create(&vec![("op", op.to_owned())])
            .observe(took.as_secs_f64());
        if let Some(kind) = error {
            self.store_errors
                .get_or_create(&vec![("op", op.to_owned()), ("kind", kind.to_owned())])
                .inc();
        }
    }

    /// Sets the deadline of one store call, which alerts compare the call latency with.
    pub fn store_call_timeout(&self, timeout: Duration) {
        self.store_call_timeout.set(timeout.as_secs_f64());
    }

    /// Records a status write and, when the phase changed, the transition.
    pub fn status_written(&self, new_phase: Option<&str>) {
        self.status_writes.inc();
        if let Some(phase) = new_phase {
            self.transitions
                .get_or_create(&vec![("phase", phase.to_owned())])
                .inc();
        }
    }

    /// Records how late a renewal started.
    pub fn renewal_started(&self, late: Duration) {
        self.renewal_lateness.observe(late.as_secs_f64());
    }

    /// Sets how many leases the renewal scheduler keeps.
    pub fn kept_leases(&self, n: usize) {
        self.kept.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a write the status budget held back (`refresh` or `event`).
    pub fn shed(&self, kind: &'static str) {
        self.shed
            .get_or_create(&vec![("kind", kind.to_owned())])
            .inc();
    }

    /// Counts a hand-over.
    pub fn handover(&self) {
        self.handovers.inc();
    }

    /// Renders every metric, after setting the per-phase lease gauge from `counts`.
    /// Counts `targetlease_leases{phase}` from `cache` from now on (the running controller's
    /// reflector), or from nothing (`None`: this replica does not lead).
    pub fn count_leases_in(&self, cache: Option<Store<TargetLease>>) {
        *self.cache.write().unwrap_or_else(|e| e.into_inner()) = cache;
    }

    /// The text exposition of every metric, with the leases counted by phase now.
    pub fn render(&self) -> String {
        let mut counts: BTreeMap<String, i64> = BTreeMap::new();
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner()).clone();
        for lease in cache.iter().flat_map(Store::state) {
            let phase = lease
                .status
                .as_ref()
                .map_or_else(|| "Pending".to_owned(), |s| format!("{:?}", s.phase));
            *counts.entry(phase).or_default() += 1;
        }
        self.leases.clear();
        for (phase, n) in counts {
            self.leases.get_or_create(&vec![("phase", phase)]).set(n);
        }
        self.encode()
    }

    /// The exposition with one series in every family, so that every metric prints its HELP
    /// and TYPE lines and its label names (a family without a series prints nothing): what the
    /// generated reference page is made of.
    pub(crate) fn example_exposition() -> String {
        let metrics = Metrics::new();
        metrics.reconciled("ok");
        metrics.store_call("acquire", Duration::ZERO, Some("timeout"));
        metrics.shed("refresh");
        metrics
            .leases
            .get_or_create(&vec![("phase", "Held".to_owned())])
            .set(0);
        metrics.encode()
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if encode(&mut out, &registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_exposition_describes_every_registered_metric() {
        // Counted in this file's text: a metric registered without an example series would be
        // missing from the generated reference.
        let registered = include_str!("metrics.rs")
            .split("#[cfg(test)]")
            .next()
            .unwrap_or_default()
            .matches("registry.register(")
            .count();
        let described = Metrics::example_exposition().matches("# HELP ").count();
        assert_eq!(described, registered);
    }

    #[test]
    fn store_call_timeout_is_exported_in_seconds() {
        let metrics = Metrics::new();
        let page = metrics.render();
        assert!(
            page.contains("# TYPE targetlease_store_call_timeout_seconds gauge\n"),
            "{page}"
        );
        assert!(
            page.contains("\ntargetlease_store_call_timeout_seconds 0.0\n"),
            "{page}"
        );
        metrics.store_call_timeout(Duration::from_millis(2500));
        let page = metrics.render();
        assert!(
            page.contains("\ntargetlease_store_call_timeout_seconds 2.5\n"),
            "{page}"
        );
    }

    #[test]
    fn every_transition_series_starts_at_zero() {
        let page = Metrics::new().render();
        for phase in crate::api::Phase::ALL {
            let series = format!("targetlease_transitions_total{{phase=\"{phase:?}\"}} 0\n");
            assert!(page.contains(&series), "no {series} in\n{page}");
        }
    }

    #[test]
    fn build_info_names_the_binary() {
        let page = Metrics::new().render();
        let series = format!(
            "targetlease_build_info{{version=\"{}\",commit=\"{}\",build_date=\"{}\"}} 1\n",
            build_info::VERSION,
            build_info::COMMIT,
            build_info::BUILD_DATE
        );
        assert!(page.contains(&series), "no {series} in\n{page}");
        assert!(
            page.contains("# TYPE targetlease_build_info gauge\n"),
            "{page}"
        );
    }
}

//! The etcd backend against etcd's own lock, on one three-member etcd 3.7 cluster on loopback.
//!
//! `cargo bench --bench etcd` (options after `--`, see `--help`; docs/internals/performance.md).
//!
//! Workloads, each run with 1, 16 and 64 concurrent tasks, one target (or mutex) per task:
//! - a: targetlease `acquire` then `release` through [`EtcdStore`] and the [`LeaseStore`] trait,
//!   a fresh request id per call, as the controller makes them.
//! - m: the baseline, etcd's `concurrency.Mutex` `Lock` then `Unlock`, from Go
//!   (`benches/etcd-mutex`, go.etcd.io/etcd/client/v3 at the etcd's version), every task's mutex
//!   on one session: what a Go service that takes etcd's lock does. No fencing token a store can
//!   check, no idempotent retry, no permits.
//! - d: targetlease `renew` of a held lease: the steady state's only call.
//!
//! The runs are interleaved (every round runs every workload at every level, in a rotated
//! order) and each figure is the median over the rounds, so machine noise hits all alike. Both
//! sides run on the same members, with the same number of concurrent tasks in one process.

use targetlease_test_support as support;

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use targetlease::redact::SecretUrl;
use targetlease::store::etcd::{EtcdConfig, EtcdStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, LeaseHandle, LeaseId, LeaseStore, Owner, Permits,
    ReleaseRequest, RenewOutcome, RenewRequest, RequestId, TargetRef, Token, Ttl,
};

use common::{CommonArgs, loadavg, machine, median, quantile};
use support::etcd::EtcdCluster;
use support::kube::go_build;

/// Options after `cargo bench --bench etcd --`.
#[derive(Debug, Parser)]
#[command(name = "cargo bench --bench etcd --")]
struct Options {
    /// Rounds; every figure is the median over them [default: 5; smoke: 1]
    #[arg(long)]
    rounds: Option<usize>,
    /// Measured seconds per run [default: 1; smoke: 0.2]
    #[arg(long)]
    seconds: Option<f64>,
    /// Unmeasured seconds before each run's measurement [default: 0.2; smoke: 0.05]
    #[arg(long)]
    warmup: Option<f64>,
    /// Concurrent tasks, comma-separated [default: 1,16,64; smoke: 1,4]
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Tokio worker threads of the client
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[command(flatten)]
    common: CommonArgs,
}

/// One measured run.
struct Run {
    workload: char,
    tasks: usize,
    cycles_per_sec: f64,
    p50_us: u64,
    p99_us: u64,
}

/// The Go baseline, built once into `dir`.
fn build_baseline(dir: &Path) -> PathBuf {
    let out = dir.join("etcd-mutex");
    go_build("benches/etcd-mutex", &out, "the baseline");
    out
}

/// Runs the Go baseline with `tasks` lockers.
fn run_mutex(
    bin: &Path,
    endpoints: &str,
    tasks: usize,
    warmup: Duration,
    measure: Duration,
    round: usize,
) -> Run {
    let output = Command::new(bin)
        .args(["-endpoints", endpoints, "-tasks", &tasks.to_string()])
        .args(["-seconds", &measure.as_secs_f64().to_string()])
        .args(["-warmup", &warmup.as_secs_f64().to_string()])
        .args(["-prefix", &format!("/mutex-bench/{round}-{tasks}")])
        .output()
        .expect("run the baseline");
    assert!(
        output.status.success(),
        "the baseline failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reply: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the baseline's JSON line");
    let number = |k: &str| reply[k].as_f64().unwrap_or(0.0);
    Run {
        workload: 'm',
        tasks,
        cycles_per_sec: number("cycles") / measure.as_secs_f64(),
        p50_us: number("p50_us") as u64,
        p99_us: number("p99_us") as u64,
    }
}

fn acquire_request(target: &TargetRef, task: usize) -> AcquireRequest {
    AcquireRequest {
        target: target.clone(),
        lease_id: LeaseId::new(format!("bench-{task}")).expect("lease id"),
        owner: Owner::new(format!("task-{task}")).expect("owner"),
        permits: Permits::new(1).expect("permits"),
        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
        min_token: 0,
        request_id: RequestId::random(),
    }
}

/// Runs workload `a` (acquire, release) or `d` (renew) of targetlease with `tasks` tasks.
async fn run_store(
    store: &Arc<EtcdStore>,
    workload: char,
    tasks: usize,
    round: usize,
    warmup: Duration,
    measure: Duration,
) -> Run {
    let start = Instant::now();
    let (from, until) = (start + warmup, start + warmup + measure);
    let mut handles = Vec::new();
    for task in 0..tasks {
        let store = store.clone();
        let target =
            TargetRef::new("bench", &format!("{workload}-{round}-{tasks}-{task}")).expect("target");
        handles.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            // The renewal workload renews one held lease.
            let held = if workload == 'd' {
                let request = acquire_request(&target, task);
                match store.acquire(&request).await {
                    Ok(AcquireOutcome::Acquired(g)) => Some(LeaseHandle {
                        target: target.clone(),
                        permits: request.permits,
                        slot: g.slot,
                        lease_id: request.lease_id.clone(),
                        owner: request.owner.clone(),
                        token: Token::new(g.token).expect("token"),
                    }),
                    other => panic!("acquire: {other:?}"),
                }
            } else {
                None
            };
            loop {
                let began = Instant::now();
                if began >= until {
                    break;
                }
                if let Some(lease) = &held {
                    let renew = RenewRequest {
                        lease: lease.clone(),
                        ttl: Ttl::new(Duration::from_secs(30)).expect("ttl"),
                        request_id: RequestId::random(),
                    };
                    match store.renew(&renew).await {
                        Ok(RenewOutcome::Renewed { .. }) => {}
                        other => panic!("renew: {other:?}"),
                    }
                } else {
                    let request = acquire_request(&target, task);
                    let granted = match store.acquire(&request).await {
                        Ok(AcquireOutcome::Acquired(g)) => g,
                        other => panic!("acquire: {other:?}"),
                    };
                    let release = ReleaseRequest {
                        lease: LeaseHandle {
                            target: target.clone(),
                            permits: request.permits,
                            slot: granted.slot,
                            lease_id: request.lease_id.clone(),
                            owner: request.owner.clone(),
                            token: Token::new(granted.token).expect("token"),
                        },
                        request_id: RequestId::random(),
                    };
                    store.release(&release).await.expect("release");
                }
                let done = Instant::now();
                if began >= from && done < until {
                    latencies.push(
                        u64::try_from(done.duration_since(began).as_micros()).unwrap_or(u64::MAX),
                    );
                }
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for handle in handles {
        all.extend(handle.await.expect("task"));
    }
    all.sort_unstable();
    Run {
        workload,
        tasks,
        cycles_per_sec: all.len() as f64 / measure.as_secs_f64(),
        p50_us: quantile(&all, 0.5),
        p99_us: quantile(&all, 0.99),
    }
}

fn main() {
    let Options {
        rounds,
        seconds,
        warmup,
        concurrency,
        threads,
        common,
    } = Options::parse();
    let rounds = common.pick(rounds, 5, 1);
    let measure = Duration::from_secs_f64(common.pick(seconds, 1.0, 0.2));
    let warmup = Duration::from_secs_f64(common.pick(warmup, 0.2, 0.05));
    let levels: Vec<usize> = if concurrency.is_empty() {
        common.pick(None, vec![1, 16, 64], vec![1, 4])
    } else {
        concurrency
    };
    let out = common.out_dir("etcd");
    let baseline = build_baseline(&out);
    let cluster = EtcdCluster::start();
    let endpoints = cluster.urls().join(",");
    let urls = cluster
        .urls()
        .iter()
        .map(|u| SecretUrl::parse(u).expect("URL"))
        .collect();
    let store = Arc::new(EtcdStore::new(EtcdConfig::new(urls)).expect("etcd store"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let header = format!(
        "machine: {}\netcd 3.7.3, three members on 127.0.0.1 (data on this machine's disk), \
         {threads} client worker threads; the baseline in Go (one process, one session)\n\
         rounds {rounds}, {:.1} s measured + {:.1} s warm-up per run, levels {levels:?}\n\
         load average at start: {}",
        machine(),
        measure.as_secs_f64(),
        warmup.as_secs_f64(),
        loadavg()
    );
    println!("{header}");
    let workloads = ['a', 'm', 'd'];
    let mut runs = Vec::new();
    for round in 0..rounds {
        for &tasks in &levels {
            for i in 0..workloads.len() {
                let workload = workloads[(i + round) % workloads.len()];
                let run = match workload {
                    'm' => run_mutex(&baseline, &endpoints, tasks, warmup, measure, round),
                    w => runtime.block_on(run_store(&store, w, tasks, round, warmup, measure)),
                };
                eprintln!(
                    "round {round} c={tasks:>3} {workload}: {:>8.0} cycles/s p50 {:>7} us p99 {:>7} us (load {})",
                    run.cycles_per_sec,
                    run.p50_us,
                    run.p99_us,
                    loadavg()
                );
                runs.push(run);
            }
        }
    }
    let figure = |w: char, tasks: usize, f: &dyn Fn(&Run) -> f64| {
        let values: Vec<f64> = runs
            .iter()
            .filter(|r| r.workload == w && r.tasks == tasks)
            .map(f)
            .collect();
        median(&values)
    };
    let mut report = format!("{header}\n\n");
    report.push_str(
        "| tasks | a: acquire+release cycles/s | m: Mutex lock+unlock cycles/s | a/m | a p50 / p99 us | m p50 / p99 us | d: renew calls/s | d p50 / p99 us |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for &tasks in &levels {
        let cycles = |w| figure(w, tasks, &|r| r.cycles_per_sec);
        let p = |w, q: fn(&Run) -> u64| figure(w, tasks, &|r| q(r) as f64);
        let _ = writeln!(
            report,
            "| {tasks} | {:.0} | {:.0} | {:.2} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} | {:.0} / {:.0} |",
            cycles('a'),
            cycles('m'),
            cycles('a') / cycles('m').max(f64::MIN_POSITIVE),
            p('a', |r| r.p50_us),
            p('a', |r| r.p99_us),
            p('m', |r| r.p50_us),
            p('m', |r| r.p99_us),
            cycles('d'),
            p('d', |r| r.p50_us),
            p('d', |r| r.p99_us),
        );
    }
    println!("{report}");
    let file = out.join("report.md");
    std::fs::write(&file, &report).expect("write the report");
    eprintln!("report: {}", file.display());
    drop(cluster);
    // The smoke mode checks that every run produced numbers; it never looks at speed. (A call
    // that fails panics its task, which fails the run before this.)
    let failed = runs
        .iter()
        .filter(|r| r.cycles_per_sec.is_nan() || r.cycles_per_sec <= 0.0 || r.p99_us == 0)
        .count();
    println!("bench: {} passed, {failed} failed", runs.len() - failed);
    if failed > 0 || runs.is_empty() {
        std::process::exit(1);
    }
}

//! Lease-store throughput against a Redlock-style baseline, on one Valkey 9.1 on loopback.
//!
//! `cargo bench --bench store` (options after `--`, see `--help` below and
//! docs/internals/performance.md).
//!
//! Workloads, each run with 1, 16, 64 and 256 concurrent tasks on one client:
//! - a: targetlease `acquire` then `release` through [`ValkeyStore`] and the [`LeaseStore`]
//!   trait, a fresh random request id per call as in production, one target per task.
//! - b: the Redlock-style single-instance lock with the same client: `SET key val NX PX`, then a
//!   Lua compare-and-delete; no fencing token, no reply cache.
//! - c: the ceiling: two `EVALSHA`s of a script that does nothing (the same two round trips).
//! - d: targetlease `renew` of a held lease.
//! - e: the Redlock-style extend (Lua compare-and-`PEXPIRE`), the baseline for d.
//! - f: the fenced lock users pick instead of targetlease (bsm/redislock's fenced obtain): `SET
//!   NX PX` plus an `INCR` of a fence counter in one script, released by compare-and-delete. It
//!   issues tokens, but without request ids, a data-loss rule or token bounds.
//! - g, h: targetlease `acquire` then `release` of one permit of a target with permits 10 (g)
//!   and 100 (h, the largest allowed), one target per task: every acquire reads every slot.
//!
//! The runs are interleaved: every round runs every workload at every concurrency level, the
//! workloads in a rotated order, and each figure is the median over the rounds, so machine noise
//! hits all of them alike. Every run starts on an empty database (`FLUSHALL SYNC`, not timed).

use targetlease_test_support as support;

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncConnectionConfig;
use redis::Script;
use redis::aio::MultiplexedConnection;
use targetlease::redact::SecretUrl;
use targetlease::store::valkey::{DEFAULT_POOL_SIZE, ValkeyConfig, ValkeyStore};
use targetlease::store::{
    AcquireOutcome, AcquireRequest, LeaseHandle, LeaseId, LeaseStore, Owner, Permits,
    ReleaseOutcome, ReleaseRequest, RenewOutcome, RenewRequest, RequestId, Slot, TargetRef, Token,
    Ttl,
};
use tokio::sync::Barrier;

use clap::Parser;
use common::{CommonArgs, loadavg, machine, median, quantile};
use support::server::{Server, ServerKind};

/// Options after `cargo bench --bench store --`.
#[derive(Debug, Parser)]
#[command(name = "cargo bench --bench store --")]
struct Options {
    /// Rounds; every figure is the median over them [default: 9; smoke: 1]
    #[arg(long)]
    rounds: Option<usize>,
    /// Measured seconds per run [default: 1; smoke: 0.2]
    #[arg(long)]
    seconds: Option<f64>,
    /// Unmeasured seconds before each run's measurement [default: 0.2; smoke: 0.05]
    #[arg(long)]
    warmup: Option<f64>,
    /// Concurrent tasks, comma-separated [default: 1,16,64,256; smoke: 1,4]
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Tokio worker threads of the client
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Connections of the store's pool and of the baseline (the store's default pool size)
    #[arg(long, default_value_t = DEFAULT_POOL_SIZE)]
    connections: usize,
    /// Which of a,b,c,d,e,f,g,h to run, comma-separated
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,e,f,g,h")]
    workloads: Vec<String>,
    /// The server: the contract suite's valkey-9.1, valkey-8.1 or redis-7.0
    #[arg(long, default_value = "valkey-9.1", value_parser = ["valkey-9.1", "valkey-8.1", "redis-7.0"])]
    server: String,
    /// Bound on the cycles of one run
    #[arg(long, default_value_t = 2_000_000)]
    max_cycles: u64,
    #[command(flatten)]
    common: CommonArgs,
}

const LEASE_TTL: Duration = Duration::from_secs(30);

/// [`LEASE_TTL`] as the protocol takes it.
fn lease_ttl() -> Ttl {
    Ttl::new(LEASE_TTL).expect("30 s is a valid TTL")
}

/// The Redlock compare-and-delete, as the Redlock libraries write it.
const UNLOCK: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
/// The Redlock compare-and-extend.
const EXTEND: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";
/// The ceiling: a script that does nothing.
const NOOP: &str = "return 0";
/// The fenced lock users pick today (bsm/redislock's fenced obtain): SET NX PX and, when it
/// took the lock, INCR of a fence counter for the token, in one script. Released by the
/// Redlock compare-and-delete. No request ids, no server-clock floor, no data-loss rule.
const FENCED_OBTAIN: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) else return 0 end";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Workload {
    Lease,
    Redlock,
    Noop,
    Renew,
    Extend,
    Fenced,
    Permits10,
    Permits100,
}

impl Workload {
    const ALL: [Workload; 8] = [
        Workload::Lease,
        Workload::Redlock,
        Workload::Noop,
        Workload::Renew,
        Workload::Extend,
        Workload::Fenced,
        Workload::Permits10,
        Workload::Permits100,
    ];

    fn letter(self) -> &'static str {
        match self {
            Workload::Lease => "a",
            Workload::Redlock => "b",
            Workload::Noop => "c",
            Workload::Renew => "d",
            Workload::Extend => "e",
            Workload::Fenced => "f",
            Workload::Permits10 => "g",
            Workload::Permits100 => "h",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Workload::Lease => "targetlease acquire+release",
            Workload::Redlock => "Redlock SET NX PX + Lua compare-and-delete",
            Workload::Noop => "2 x EVALSHA of an empty script (ceiling)",
            Workload::Renew => "targetlease renew",
            Workload::Permits10 => "targetlease acquire+release, permits 10",
            Workload::Permits100 => "targetlease acquire+release, permits 100",
            Workload::Extend => "Redlock Lua compare-and-PEXPIRE",
            Workload::Fenced => {
                "fenced lock: SET NX PX + INCR fence in one script, compare-and-delete"
            }
        }
    }

    /// Round trips per cycle.
    fn calls(self) -> u32 {
        match self {
            Workload::Lease
            | Workload::Redlock
            | Workload::Noop
            | Workload::Fenced
            | Workload::Permits10
            | Workload::Permits100 => 2,
            Workload::Renew | Workload::Extend => 1,
        }
    }
}

/// What every task shares: the store and, for the baselines, connections set up like the
/// store's pool: `connections` multiplexed connections, handed out round-robin, with no
/// response timeout of the client library's own.
struct Shared {
    store: ValkeyStore,
    baseline: Vec<MultiplexedConnection>,
    next: AtomicUsize,
    noop: Script,
    unlock: Script,
    extend: Script,
    obtain: Script,
}

impl Shared {
    /// The next baseline connection, round-robin like the store's pool.
    fn conn(&self) -> MultiplexedConnection {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.baseline.len();
        self.baseline[i].clone()
    }
}

/// One task's result.
#[derive(Default)]
struct TaskResult {
    /// Latencies of cycles completed inside the measured window, in ns.
    latencies: Vec<u64>,
    /// Every cycle, warm-up included (for per-cycle server figures).
    cycles: u64,
    errors: u64,
    first_error: Option<String>,
}

struct Window {
    measure_from: Instant,
    end: Instant,
}

/// Per-task state: what a cycle needs.
enum TaskState {
    Lease {
        target: TargetRef,
        lease_id: LeaseId,
        owner: Owner,
        permits: Permits,
    },
    Redlock {
        key: String,
    },
    Noop,
    Renew {
        handle: LeaseHandle,
    },
    Extend {
        key: String,
        value: String,
    },
    Fenced {
        key: String,
        fence: String,
    },
}

async fn setup(w: Workload, sh: &Shared, task: usize) -> Result<TaskState, String> {
    let target = TargetRef::new(&format!("bench-{}", w.letter()), &format!("t{task}"))
        .map_err(|e| e.to_string())?;
    let lease_id =
        LeaseId::new(format!("{:032x}", rand::random::<u128>())).map_err(|e| e.to_string())?;
    let owner = Owner::new(format!("worker-{task}")).map_err(|e| e.to_string())?;
    let permits = |n| Permits::new(n).map_err(|e| e.to_string());
    Ok(match w {
        Workload::Lease | Workload::Permits10 | Workload::Permits100 => TaskState::Lease {
            target,
            lease_id,
            owner,
            permits: match w {
                Workload::Permits10 => permits(10)?,
                Workload::Permits100 => permits(100)?,
                _ => Permits::ONE,
            },
        },
        Workload::Redlock => TaskState::Redlock {
            key: format!("rl:{{bench-b/t{task}}}:lock"),
        },
        Workload::Noop => TaskState::Noop,
        Workload::Fenced => TaskState::Fenced {
            key: format!("fl:{{bench-f/t{task}}}:lock"),
            fence: format!("fl:{{bench-f/t{task}}}:fence"),
        },
        Workload::Renew => {
            let request = AcquireRequest {
                target: target.clone(),
                lease_id: lease_id.clone(),
                owner: owner.clone(),
                permits: Permits::ONE,
                ttl: lease_ttl(),
                min_token: 0,
                request_id: RequestId::random(),
            };
            match sh.store.acquire(&request).await {
                Ok(AcquireOutcome::Acquired(grant)) => TaskState::Renew {
                    handle: LeaseHandle {
                        target,
                        permits: Permits::ONE,
                        slot: grant.slot,
                        lease_id,
                        owner,
                        token: Token::new(grant.token).map_err(|e| e.to_string())?,
                    },
                },
                other => return Err(format!("setup acquire: {other:?}")),
            }
        }
        Workload::Extend => {
            let key = format!("rl:{{bench-e/t{task}}}:lock");
            let value = format!("{:032x}", rand::random::<u128>());
            let mut conn = sh.conn();
            let ok: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(LEASE_TTL.as_millis() as u64)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            if ok.is_none() {
                return Err("setup SET NX found the key taken".into());
            }
            TaskState::Extend { key, value }
        }
    })
}

/// One cycle; `Err` names what went wrong (a refusal is an error here: nothing contends).
/// The Redlock compare-and-delete that ends both baseline locks (b and f).
async fn unlock(
    sh: &Shared,
    conn: &mut MultiplexedConnection,
    key: &str,
    value: &str,
) -> Result<(), String> {
    let deleted: i64 = sh
        .unlock
        .key(key)
        .arg(value)
        .invoke_async(conn)
        .await
        .map_err(|e| format!("unlock: {e}"))?;
    if deleted == 1 {
        Ok(())
    } else {
        Err("unlock: not the holder".into())
    }
}

async fn cycle(state: &mut TaskState, sh: &Shared) -> Result<(), String> {
    match state {
        TaskState::Lease {
            target,
            lease_id,
            owner,
            permits,
        } => {
            let acquire = AcquireRequest {
                target: target.clone(),
                lease_id: lease_id.clone(),
                owner: owner.clone(),
                permits: *permits,
                ttl: lease_ttl(),
                min_token: 0,
                request_id: RequestId::random(),
            };
            let (token, slot) = match sh.store.acquire(&acquire).await {
                Ok(AcquireOutcome::Acquired(grant)) => (
                    Token::new(grant.token).map_err(|e| e.to_string())?,
                    grant.slot,
                ),
                other => return Err(format!("acquire: {other:?}")),
            };
            let release = ReleaseRequest {
                lease: LeaseHandle {
                    target: target.clone(),
                    permits: *permits,
                    slot,
                    lease_id: lease_id.clone(),
                    owner: owner.clone(),
                    token,
                },
                request_id: RequestId::random(),
            };
            match sh.store.release(&release).await {
                Ok(ReleaseOutcome::Released) => Ok(()),
                other => Err(format!("release: {other:?}")),
            }
        }
        TaskState::Redlock { key } => {
            let value = format!("{:032x}", rand::random::<u128>());
            let mut conn = sh.conn();
            let ok: Option<String> = redis::cmd("SET")
                .arg(&*key)
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(LEASE_TTL.as_millis() as u64)
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("SET NX: {e}"))?;
            if ok.is_none() {
                return Err("SET NX: taken".into());
            }
            unlock(sh, &mut conn, key, &value).await
        }
        TaskState::Fenced { key, fence } => {
            let value = format!("{:032x}", rand::random::<u128>());
            let mut conn = sh.conn();
            let token: i64 = sh
                .obtain
                .key(&*key)
                .key(&*fence)
                .arg(&value)
                .arg(LEASE_TTL.as_millis() as u64)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| format!("fenced obtain: {e}"))?;
            if token <= 0 {
                return Err("fenced obtain: taken".into());
            }
            unlock(sh, &mut conn, key, &value).await
        }
        TaskState::Noop => {
            let mut conn = sh.conn();
            for _ in 0..2 {
                let _: i64 = sh
                    .noop
                    .prepare_invoke()
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| format!("noop: {e}"))?;
            }
            Ok(())
        }
        TaskState::Renew { handle } => {
            let request = RenewRequest {
                lease: handle.clone(),
                ttl: lease_ttl(),
                request_id: RequestId::random(),
            };
            match sh.store.renew(&request).await {
                Ok(RenewOutcome::Renewed { .. }) => Ok(()),
                other => Err(format!("renew: {other:?}")),
            }
        }
        TaskState::Extend { key, value } => {
            let mut conn = sh.conn();
            let extended: i64 = sh
                .extend
                .key(&*key)
                .arg(&*value)
                .arg(LEASE_TTL.as_millis() as u64)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| format!("extend: {e}"))?;
            if extended == 1 {
                Ok(())
            } else {
                Err("extend: not the holder".into())
            }
        }
    }
}

async fn task(
    w: Workload,
    sh: Arc<Shared>,
    id: usize,
    ready: Arc<Barrier>,
    go: Arc<Barrier>,
    window: Arc<Mutex<Option<Window>>>,
    max_cycles: u64,
) -> TaskResult {
    let mut result = TaskResult::default();
    let state = setup(w, &sh, id).await;
    ready.wait().await;
    go.wait().await;
    let mut state = match state {
        Ok(s) => s,
        Err(e) => {
            result.errors = 1;
            result.first_error = Some(e);
            return result;
        }
    };
    let (measure_from, end) = {
        let guard = window.lock().unwrap_or_else(|e| e.into_inner());
        let w = guard.as_ref().expect("window set before go");
        (w.measure_from, w.end)
    };
    while result.cycles < max_cycles {
        let start = Instant::now();
        if start >= end {
            break;
        }
        let outcome = cycle(&mut state, &sh).await;
        let done = Instant::now();
        result.cycles += 1;
        match outcome {
            Ok(()) if start >= measure_from && done <= end => {
                result.latencies.push((done - start).as_nanos() as u64)
            }
            Ok(()) => {}
            Err(e) => {
                result.errors += 1;
                result.first_error.get_or_insert(e);
            }
        }
    }
    result
}

/// Server-side counters read with INFO.
#[derive(Clone, Debug, Default)]
struct ServerStats {
    commands: u64,
    cpu_seconds: f64,
    per_command: BTreeMap<String, u64>,
}

async fn server_stats(conn: &mut redis::aio::MultiplexedConnection) -> ServerStats {
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(conn)
        .await
        .expect("INFO");
    let mut stats = ServerStats::default();
    for line in info.lines() {
        let Some((name, value)) = line.trim().split_once(':') else {
            continue;
        };
        match name {
            "total_commands_processed" => stats.commands = value.parse().unwrap_or(0),
            "used_cpu_sys" | "used_cpu_user" => {
                stats.cpu_seconds += value.parse::<f64>().unwrap_or(0.0)
            }
            _ => {
                if let Some(cmd) = name.strip_prefix("cmdstat_") {
                    let calls = value
                        .split(',')
                        .find_map(|kv| kv.strip_prefix("calls="))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    stats.per_command.insert(cmd.to_owned(), calls);
                }
            }
        }
    }
    stats
}

/// One run of one workload at one concurrency level.
#[derive(Clone, Debug)]
struct Run {
    workload: Workload,
    concurrency: usize,
    round: usize,
    cycles_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    /// Server CPU per cycle, µs.
    server_us_per_cycle: f64,
    /// Client (this process) CPU per cycle, µs.
    client_us_per_cycle: f64,
    /// Commands the server counted per cycle (scripts' inner commands included).
    commands_per_cycle: f64,
    /// Inner commands per cycle, by name (script calls included).
    per_command: BTreeMap<String, f64>,
    errors: u64,
    first_error: Option<String>,
    load: String,
}

#[allow(clippy::too_many_arguments)]
async fn run_once(
    sh: &Arc<Shared>,
    admin: &mut redis::aio::MultiplexedConnection,
    w: Workload,
    concurrency: usize,
    round: usize,
    warmup: Duration,
    measure: Duration,
    max_cycles: u64,
) -> Run {
    let _: () = redis::cmd("FLUSHALL")
        .arg("SYNC")
        .query_async(admin)
        .await
        .expect("FLUSHALL");
    let ready = Arc::new(Barrier::new(concurrency + 1));
    let go = Arc::new(Barrier::new(concurrency + 1));
    let window = Arc::new(Mutex::new(None));
    let per_task = max_cycles.div_ceil(concurrency as u64).max(1);
    let handles: Vec<_> = (0..concurrency)
        .map(|id| {
            tokio::spawn(task(
                w,
                sh.clone(),
                id,
                ready.clone(),
                go.clone(),
                window.clone(),
                per_task,
            ))
        })
        .collect();
    ready.wait().await;
    let before = server_stats(admin).await;
    let client_before = common::cpu_seconds(std::process::id());
    let start = Instant::now();
    *window.lock().unwrap_or_else(|e| e.into_inner()) = Some(Window {
        measure_from: start + warmup,
        end: start + warmup + measure,
    });
    go.wait().await;
    let mut latencies = Vec::new();
    let mut cycles = 0;
    let mut errors = 0;
    let mut first_error = None;
    for h in handles {
        let r = h.await.expect("task panicked");
        latencies.extend(r.latencies);
        cycles += r.cycles;
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
    }
    let client_after = common::cpu_seconds(std::process::id());
    let after = server_stats(admin).await;
    latencies.sort_unstable();
    let measured = latencies.len() as f64;
    let per_cycle = |x: f64| {
        if cycles == 0 {
            f64::NAN
        } else {
            x / cycles as f64
        }
    };
    // The INFO call itself is one command in the window.
    let commands = after.commands.saturating_sub(before.commands + 1) as f64;
    let per_command = after
        .per_command
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .filter_map(|(name, calls)| {
            let delta = calls.saturating_sub(*before.per_command.get(name).unwrap_or(&0));
            (delta > 0).then(|| (name.clone(), per_cycle(delta as f64)))
        })
        .collect();
    Run {
        workload: w,
        concurrency,
        round,
        cycles_per_sec: measured / measure.as_secs_f64(),
        p50_us: quantile(&latencies, 0.50) as f64 / 1000.0,
        p99_us: quantile(&latencies, 0.99) as f64 / 1000.0,
        server_us_per_cycle: per_cycle((after.cpu_seconds - before.cpu_seconds) * 1e6),
        client_us_per_cycle: per_cycle((client_after - client_before) * 1e6),
        commands_per_cycle: per_cycle(commands),
        per_command,
        errors,
        first_error,
        load: loadavg(),
    }
}

/// Medians over the rounds of one (workload, concurrency).
struct Summary {
    cycles_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    server_us: f64,
    client_us: f64,
    commands: f64,
    load: String,
}

fn summarize(runs: &[&Run]) -> Summary {
    let m = |f: fn(&Run) -> f64| median(&runs.iter().map(|r| f(r)).collect::<Vec<_>>());
    let loads: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.load.split_whitespace().next()?.parse().ok())
        .collect();
    let (lo, hi) = loads
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    Summary {
        cycles_per_sec: m(|r| r.cycles_per_sec),
        p50_us: m(|r| r.p50_us),
        p99_us: m(|r| r.p99_us),
        server_us: m(|r| r.server_us_per_cycle),
        client_us: m(|r| r.client_us_per_cycle),
        commands: m(|r| r.commands_per_cycle),
        load: if loads.is_empty() {
            "?".into()
        } else {
            format!("{lo:.2}-{hi:.2}")
        },
    }
}

/// The median over rounds of the ratio of two workloads' throughput in the same round.
fn ratio(runs: &[Run], c: usize, num: Workload, den: Workload) -> f64 {
    let rounds: Vec<usize> = runs.iter().map(|r| r.round).collect();
    let max_round = rounds.iter().copied().max().unwrap_or(0);
    let per_round: Vec<f64> = (0..=max_round)
        .filter_map(|round| {
            let find = |w: Workload| {
                runs.iter()
                    .find(|r| r.round == round && r.concurrency == c && r.workload == w)
            };
            Some(find(num)?.cycles_per_sec / find(den)?.cycles_per_sec)
        })
        .collect();
    median(&per_round)
}

fn main() {
    let Options {
        rounds,
        seconds,
        warmup,
        concurrency,
        threads,
        connections,
        workloads: letters,
        server,
        max_cycles,
        common,
    } = Options::parse();
    let smoke = common.smoke;
    let rounds = common.pick(rounds, 9, 1);
    let measure = Duration::from_secs_f64(common.pick(seconds, 1.0, 0.2));
    let warmup = Duration::from_secs_f64(common.pick(warmup, 0.2, 0.05));
    let levels: Vec<usize> = if concurrency.is_empty() {
        common.pick(None, vec![1, 16, 64, 256], vec![1, 4])
    } else {
        concurrency
    };
    let workloads: Vec<Workload> = Workload::ALL
        .into_iter()
        .filter(|w| letters.iter().any(|l| l == w.letter()))
        .collect();
    let out = common.out_dir("store");

    let kind = match server.as_str() {
        "valkey-8.1" => ServerKind::Valkey81,
        "redis-7.0" => ServerKind::Redis70,
        _ => ServerKind::Valkey91,
    };
    let server = Server::start(kind);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (runs, header, costs) = runtime.block_on(async {
        let url = SecretUrl::parse(&server.url()).expect("server URL");
        let mut config = ValkeyConfig::new(url);
        config.pool_size = connections;
        let store = ValkeyStore::connect(config)
            .await
            .expect("connect the store");
        let client = redis::Client::open(server.url()).expect("client");
        let options = AsyncConnectionConfig::new()
            .set_connection_timeout(None)
            .set_response_timeout(None);
        let mut baseline = Vec::new();
        for _ in 0..connections {
            baseline.push(
                client
                    .get_multiplexed_async_connection_with_config(&options)
                    .await
                    .expect("baseline connection"),
            );
        }
        // No response timeout either: a pipelined batch of permit calls keeps the server busy
        // for longer than the client library's default.
        let mut admin = client
            .get_multiplexed_async_connection_with_config(&options)
            .await
            .expect("admin connection");
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(&mut admin)
            .await
            .expect("INFO");
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
                .unwrap_or("?")
                .to_owned()
        };
        let version = match field("valkey_version").as_str() {
            "?" => format!("redis {}", field("redis_version")),
            v => format!("valkey {v}"),
        };
        let allocator = field("mem_allocator");
        eprintln!("valkey pid {}", field("process_id"));
        let sh = Arc::new(Shared {
            store,
            baseline,
            next: AtomicUsize::new(0),
            noop: Script::new(NOOP),
            unlock: Script::new(UNLOCK),
            extend: Script::new(EXTEND),
            obtain: Script::new(FENCED_OBTAIN),
        });
        let header = format!(
            "machine: {}\n{version} (allocator {allocator}) on 127.0.0.1:{} (no persistence), {connections} multiplexed connections per side, \
             {threads} client worker threads\nrounds {rounds}, {:.1} s measured + {:.1} s warm-up per run, levels {levels:?}\n\
             load average at start: {}",
            machine(),
            server.port,
            measure.as_secs_f64(),
            warmup.as_secs_f64(),
            loadavg()
        );
        println!("{header}");
        // Load every script once, untimed.
        for &w in &workloads {
            run_once(&sh, &mut admin, w, 1, 0, Duration::ZERO, Duration::from_millis(20), 1000).await;
        }
        let mut runs = Vec::new();
        let started = Instant::now();
        for round in 0..rounds {
            for &c in &levels {
                for i in 0..workloads.len() {
                    let w = workloads[(i + round) % workloads.len()];
                    let run = run_once(&sh, &mut admin, w, c, round, warmup, measure, max_cycles).await;
                    eprintln!(
                        "round {round} c={c:>3} {}: {:>9.0} cycles/s p50 {:>8.1} us p99 {:>8.1} us, server {:>5.1} us/cycle, {:.1} cmds/cycle, errors {} (load {})",
                        w.letter(),
                        run.cycles_per_sec,
                        run.p50_us,
                        run.p99_us,
                        run.server_us_per_cycle,
                        run.commands_per_cycle,
                        run.errors,
                        run.load
                    );
                    runs.push(run);
                }
            }
        }
        eprintln!("all runs took {:.0} s", started.elapsed().as_secs_f64());
        let mut costs = server_costs(&mut admin, if smoke { 200 } else { 20_000 }).await;
        let mut memory = memory_costs(&mut admin, if smoke { 200 } else { 20_000 }).await;
        memory.push_str(
            "\nServer memory per target with every permit held (one lease, fence and grant \
             record per slot, the value in force; reply entries expired):\n\n\
             | permits | bytes per target | bytes per permit |\n|---|---|---|\n",
        );
        for permits in [1u32, 10, 100] {
            // Calls of 100 permits read 100 slots: fewer targets keep the section short.
            let targets = if smoke { 20 } else { 200_000 / permits.max(10) as usize };
            let (permit_costs, bytes) = permit_costs(&mut admin, targets, permits).await;
            costs.extend(permit_costs);
            let _ = writeln!(
                memory,
                "| {permits} | {bytes:.0} | {:.0} |",
                bytes / f64::from(permits)
            );
        }
        (runs, header, (costs, memory))
    });
    let (costs, memory) = costs;
    drop(server);

    let mut report = report(&runs, &levels, &header);
    report.push_str(&costs_table(&costs));
    report.push_str(&memory);
    println!("\n{report}");
    std::fs::write(out.join("store.md"), &report).expect("write store.md");
    std::fs::write(out.join("store.json"), json(&runs).to_string()).expect("write store.json");
    println!("results: {}", out.display());

    // The smoke mode checks that every run produced numbers; it never looks at speed.
    let costs_ok = !costs.is_empty() && costs.iter().all(|c| c.error.is_none() && c.us > 0.0);
    if !costs_ok {
        eprintln!("server cost section failed: {costs:?}");
    }
    let failed: Vec<&Run> = runs
        .iter()
        // NaN (no cycle measured) counts as a failure too.
        .filter(|r| {
            r.errors > 0
                || r.cycles_per_sec.is_nan()
                || r.cycles_per_sec <= 0.0
                || r.p99_us.is_nan()
                || r.p99_us <= 0.0
        })
        .collect();
    for r in &failed {
        eprintln!(
            "run {} c={} round {} produced no numbers or failed: {:?}",
            r.workload.letter(),
            r.concurrency,
            r.round,
            r.first_error
        );
    }
    let failed_count = failed.len() + usize::from(!costs_ok);
    println!(
        "bench: {} passed, {failed_count} failed",
        runs.len() + 1 - failed_count
    );
    if failed_count > 0 || runs.is_empty() {
        std::process::exit(1);
    }
}

/// Server CPU for one kind of call, measured over a pipelined batch.
#[derive(Clone, Debug)]
struct Cost {
    what: &'static str,
    calls: usize,
    us: f64,
    error: Option<String>,
}

async fn server_cpu(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    server_stats(conn).await.cpu_seconds
}

/// Sends `cmds` in pipelined batches of 500 and returns the replies and the server CPU per call,
/// in µs (the INFO calls around the batch are a negligible part of it).
async fn pipelined(
    conn: &mut redis::aio::MultiplexedConnection,
    what: &'static str,
    cmds: Vec<redis::Cmd>,
) -> (Cost, Vec<redis::Value>) {
    let calls = cmds.len();
    let before = server_cpu(conn).await;
    let mut replies = Vec::with_capacity(calls);
    let mut error = None;
    for chunk in cmds.chunks(500) {
        let mut pipe = redis::pipe();
        for cmd in chunk {
            pipe.add_command(cmd.clone());
        }
        match pipe.query_async::<Vec<redis::Value>>(conn).await {
            Ok(values) => replies.extend(values),
            Err(e) => {
                error.get_or_insert(e.to_string());
            }
        }
    }
    let after = server_cpu(conn).await;
    let us = (after - before) * 1e6 / calls.max(1) as f64;
    (
        Cost {
            what,
            calls,
            us,
            error,
        },
        replies,
    )
}

fn evalsha(script: &Script, keys: &[String], args: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    cmd
}

/// The reply of a script call as text (every script answers one string).
fn reply_text(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    }
}

/// Server CPU per call of each script and of the baseline's commands, on an otherwise idle
/// server: what a call costs the single Valkey thread, independent of the client and of the
/// machine's load. Calls are built by `wire`, exactly as `ValkeyStore` builds them.
async fn server_costs(conn: &mut redis::aio::MultiplexedConnection, n: usize) -> Vec<Cost> {
    use targetlease::store::valkey::keys::TargetKeys;
    use targetlease::store::valkey::scripts::SCRIPTS;
    use targetlease::store::valkey::wire;

    let _: Result<(), _> = redis::cmd("FLUSHALL").arg("SYNC").query_async(conn).await;
    // Load every script (SCRIPT LOAD is idempotent).
    for source in [
        SCRIPTS.acquire.source,
        SCRIPTS.release.source,
        SCRIPTS.renew.source,
        NOOP,
        UNLOCK,
        EXTEND,
    ] {
        let _: Result<String, _> = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query_async(conn)
            .await;
    }
    let targets: Vec<TargetRef> = (0..n)
        .map(|i| TargetRef::new("costs", &format!("t{i}")).expect("target"))
        .collect();
    let keys: Vec<TargetKeys> = targets.iter().map(|t| TargetKeys::new("tl", t)).collect();
    let ttl = LEASE_TTL.as_millis().to_string();
    let reply_ttl = "60000";
    let claim = |i: usize, who: &str| {
        (
            LeaseId::new(format!("lease-{who}-{i}")).expect("lease id"),
            Owner::new(format!("{who}-{i}")).expect("owner"),
        )
    };
    let acquire_request = |i: usize, who: &str| {
        let (lease_id, owner) = claim(i, who);
        AcquireRequest {
            target: targets[i].clone(),
            lease_id,
            owner,
            permits: Permits::ONE,
            ttl: lease_ttl(),
            min_token: 0,
            request_id: RequestId::random(),
        }
    };
    let acquire = |i: usize, who: &str| {
        wire::acquire_call(&keys[i], &acquire_request(i, who), &ttl, reply_ttl)
            .evalsha()
            .clone()
    };
    let handle = |i: usize, who: &str, token: &str| {
        let (lease_id, owner) = claim(i, who);
        LeaseHandle {
            target: targets[i].clone(),
            permits: Permits::ONE,
            slot: Slot::ZERO,
            lease_id,
            owner,
            token: Token::new(token.parse().unwrap_or(1)).expect("token"),
        }
    };
    let release = |i: usize, who: &str, token: &str| {
        let req = ReleaseRequest {
            lease: handle(i, who, token),
            request_id: RequestId::random(),
        };
        wire::release_call(&keys[i], &req, reply_ttl)
            .evalsha()
            .clone()
    };
    let tokens_of = |replies: &[redis::Value]| -> Vec<String> {
        replies
            .iter()
            .map(|v| {
                let text = reply_text(v);
                text.split(' ').nth(1).unwrap_or("1").to_owned()
            })
            .collect()
    };
    let mut costs = Vec::new();
    let noop = Script::new(NOOP);
    let (c, _) = pipelined(
        conn,
        "EVALSHA of an empty script",
        (0..n).map(|_| evalsha(&noop, &[], &[])).collect(),
    )
    .await;
    costs.push(c);
    let (c, _) = pipelined(
        conn,
        "Redlock SET NX PX (free key)",
        (0..n)
            .map(|i| {
                let mut cmd = redis::cmd("SET");
                cmd.arg(format!("rl:{{costs/t{i}}}:lock"))
                    .arg(format!("v{i}"))
                    .arg("NX")
                    .arg("PX")
                    .arg(&ttl);
                cmd
            })
            .collect(),
    )
    .await;
    costs.push(c);
    let extend = Script::new(EXTEND);
    let (c, _) = pipelined(
        conn,
        "Redlock extend (Lua compare-and-PEXPIRE)",
        (0..n)
            .map(|i| {
                evalsha(
                    &extend,
                    &[format!("rl:{{costs/t{i}}}:lock")],
                    &[format!("v{i}"), ttl.clone()],
                )
            })
            .collect(),
    )
    .await;
    costs.push(c);
    let unlock = Script::new(UNLOCK);
    let (c, _) = pipelined(
        conn,
        "Redlock unlock (Lua compare-and-delete)",
        (0..n)
            .map(|i| {
                evalsha(
                    &unlock,
                    &[format!("rl:{{costs/t{i}}}:lock")],
                    &[format!("v{i}")],
                )
            })
            .collect(),
    )
    .await;
    costs.push(c);
    let obtain = Script::new(FENCED_OBTAIN);
    let _: Result<String, _> = obtain.prepare_invoke().load_async(conn).await;
    let (c, _) = pipelined(
        conn,
        "fenced obtain (SET NX PX + INCR, free key)",
        (0..n)
            .map(|i| {
                evalsha(
                    &obtain,
                    &[
                        format!("fl:{{costs/t{i}}}:lock"),
                        format!("fl:{{costs/t{i}}}:fence"),
                    ],
                    &[format!("v{i}"), ttl.clone()],
                )
            })
            .collect(),
    )
    .await;
    costs.push(c);
    let (c, replies) = pipelined(
        conn,
        "acquire.lua, target never used (no fence yet)",
        (0..n).map(|i| acquire(i, "a")).collect(),
    )
    .await;
    costs.push(c);
    let tokens = tokens_of(&replies);
    let (c, _) = pipelined(
        conn,
        "acquire.lua, held by another (answers held)",
        (0..n).map(|i| acquire(i, "b")).collect(),
    )
    .await;
    costs.push(c);
    let (c, _) = pipelined(
        conn,
        "renew.lua, holder",
        (0..n)
            .map(|i| {
                let req = RenewRequest {
                    lease: handle(i, "a", &tokens[i]),
                    ttl: lease_ttl(),
                    request_id: RequestId::random(),
                };
                wire::renew_call(&keys[i], &req, &ttl, reply_ttl)
                    .evalsha()
                    .clone()
            })
            .collect(),
    )
    .await;
    costs.push(c);
    let (c, _) = pipelined(
        conn,
        "release.lua, holder",
        (0..n).map(|i| release(i, "a", &tokens[i])).collect(),
    )
    .await;
    costs.push(c);
    let (c, replies) = pipelined(
        conn,
        "acquire.lua, free target (released before: the steady state)",
        (0..n).map(|i| acquire(i, "c")).collect(),
    )
    .await;
    costs.push(c);
    let tokens = tokens_of(&replies);
    let (c, _) = pipelined(
        conn,
        "release.lua, holder (second tenure)",
        (0..n).map(|i| release(i, "c", &tokens[i])).collect(),
    )
    .await;
    costs.push(c);

    // Ablation: acquire.lua with one step taken out at a time, on targets released before (the
    // steady state), against the unmodified script measured the same way. These variants are
    // not valid scripts (each drops a guarantee); they only attribute the cost.
    let ablations: [(&'static str, &[(&str, &str)]); 7] = [
        (
            "acquire.lua without the reply-cache read (GET)",
            &[(
                "local cached, err = cached_reply(KEYS[3], bound, 'acquire')",
                "local cached, err = nil, nil",
            )],
        ),
        (
            "acquire.lua without the reply-cache write (SET PX)",
            &[(
                "  return remember(KEYS[3], bound, reply, reply_ttl) .. ' 0'",
                "  return reply .. ' 0'",
            )],
        ),
        (
            "acquire.lua without the request-id binding (SHA-1 of the call)",
            &[(
                "local bound = binding('acquire', ARGV[1], ARGV[2], ARGV[4], shared and ARGV[7] or nil)",
                "local bound = string.rep('0', 40)",
            )],
        ),
        (
            "acquire.lua without the spent-grant record (GET and SET)",
            &[
                (
                    "  local last_request = redis.pcall('GET', grant_key(s))",
                    "  local last_request = nil",
                ),
                (
                    "issued_to(free_slot, token)\nredis.call('SET', grant_key(free_slot), ARGV[6])\n",
                    "issued_to(free_slot, token)\n",
                ),
            ],
        ),
        (
            "acquire.lua without TIME (fixed clock)",
            &[(
                "local now_us, now_ms = server_now()",
                "local now_us, now_ms = 1764000000000000, 1764000000000",
            )],
        ),
        (
            "acquire.lua without the fence (GET and SET)",
            &[
                (
                    "local fence0, top = read_fence(KEYS[2])\nif not fence0 then return top end\n",
                    "local fence0, top = 0, nil\n",
                ),
                (
                    "issued_to(free_slot, token)\nredis.call('SET', grant_key(free_slot)",
                    "redis.call('SET', grant_key(free_slot)",
                ),
            ],
        ),
        (
            "acquire.lua without the lease record (HSET and PEXPIRE)",
            &[(
                "redis.call('HSET', lease, unpack(fields))\nredis.call('PEXPIRE', lease, ttl)\n",
                "",
            )],
        ),
    ];
    // The release before permits: its acquire takes the exclusive lease's keys and arguments
    // only (the first four KEYS, the first six ARGV), which the current call starts with.
    let before_permits = Script::new(&format!(
        "{}\n{}",
        include_str!("../tests/fixtures/lua-v2/lib.lua"),
        include_str!("../tests/fixtures/lua-v2/acquire.lua")
    ));
    // The release before one path served every permits value: the exclusive lease had a path
    // of its own, and its grants named no slot.
    let two_paths = Script::new(&format!(
        "{}\n{}",
        include_str!("../lua/lib.lua"),
        include_str!("../tests/fixtures/lua-two-paths/acquire.lua")
    ));
    let mut variants: Vec<(&'static str, Option<Script>, (usize, usize))> = vec![
        (
            "acquire.lua, unmodified (reference for the rows below)",
            Some(SCRIPTS.acquire.script.clone()),
            (usize::MAX, usize::MAX),
        ),
        (
            "acquire.lua of the release before permits (exclusive only)",
            Some(before_permits),
            (4, 6),
        ),
        (
            "acquire.lua with an exclusive path of its own (before the single path)",
            Some(two_paths),
            (usize::MAX, usize::MAX),
        ),
    ];
    for (what, edits) in ablations {
        let mut source = SCRIPTS.acquire.source.to_owned();
        let mut applies = true;
        for (from, to) in edits {
            applies &= source.contains(from);
            source = source.replacen(from, to, 1);
        }
        // A step that is no longer written this way is reported, not measured wrongly.
        variants.push((
            what,
            applies.then(|| Script::new(&source)),
            (usize::MAX, usize::MAX),
        ));
    }
    // Every variant is measured in turn, several rounds over: each figure is the median of its
    // rounds, so a slow moment of the machine hits all variants alike.
    let rounds = if n >= 10_000 { 5 } else { 1 };
    let mut measured: Vec<Vec<Cost>> = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (v, (what, script, (key_count, arg_count))) in variants.iter().enumerate() {
            let Some(script) = script else {
                continue;
            };
            // Every target has a record and no lease: one tenure acquired and released, not
            // timed.
            let _: Result<(), _> = redis::cmd("FLUSHALL").arg("SYNC").query_async(conn).await;
            let (_, replies) =
                pipelined(conn, "setup", (0..n).map(|i| acquire(i, "a")).collect()).await;
            let tokens = tokens_of(&replies);
            let _ = pipelined(
                conn,
                "setup",
                (0..n).map(|i| release(i, "a", &tokens[i])).collect(),
            )
            .await;
            let _: Result<String, _> = script.prepare_invoke().load_async(conn).await;
            let (c, _) = pipelined(
                conn,
                what,
                (0..n)
                    .map(|i| {
                        let call =
                            wire::acquire_call(&keys[i], &acquire_request(i, "w"), &ttl, reply_ttl);
                        let (mut keys, mut args) = call.keys_and_args();
                        keys.truncate(*key_count);
                        args.truncate(*arg_count);
                        evalsha(script, &keys, &args)
                    })
                    .collect(),
            )
            .await;
            measured[v].push(c);
        }
    }
    for ((what, script, _), runs) in variants.iter().zip(measured) {
        if script.is_none() {
            costs.push(Cost {
                what,
                calls: 0,
                us: f64::NAN,
                error: Some("acquire.lua changed; this ablation no longer applies".into()),
            });
            continue;
        }
        let us: Vec<f64> = runs.iter().map(|c| c.us).collect();
        costs.push(Cost {
            what,
            calls: runs.iter().map(|c| c.calls).sum(),
            us: median(&us),
            error: runs.iter().find_map(|c| c.error.clone()),
        });
    }
    costs
}

/// Server CPU per call of one permit of `permits` on `n` targets: an acquire on a free target,
/// one that takes the last free slot (every other slot held), one refused (all held), and the
/// release of a permit; and the server memory per target with every permit held once the reply
/// entries expired. Calls are built by `wire`, exactly as `ValkeyStore` builds them.
async fn permit_costs(
    conn: &mut redis::aio::MultiplexedConnection,
    n: usize,
    permits: u32,
) -> (Vec<Cost>, f64) {
    use targetlease::store::valkey::keys::TargetKeys;
    use targetlease::store::valkey::wire;

    let _: Result<(), _> = redis::cmd("FLUSHALL").arg("SYNC").query_async(conn).await;
    let n_permits = Permits::new(permits).expect("permits");
    let targets: Vec<TargetRef> = (0..n)
        .map(|i| TargetRef::new("permits", &format!("team-{i}/gpu-queue")).expect("target"))
        .collect();
    let keys: Vec<TargetKeys> = targets.iter().map(|t| TargetKeys::new("tl", t)).collect();
    // Filling 100 permits of every target takes longer than the usual TTL: the permits of this
    // section live ten minutes, so none expires before it is measured.
    let long = Duration::from_secs(600);
    let ttl = long.as_millis().to_string();
    let reply_ttl = "60000";
    let claim = |i: usize, who: u32| AcquireRequest {
        target: targets[i].clone(),
        lease_id: LeaseId::new(format!("{i:08x}-7c4e-4f0a-9d1e-{who:012x}")).expect("lease id"),
        owner: Owner::new(format!("worker-7d9f8b6c4-{i:05}-{who}")).expect("owner"),
        permits: n_permits,
        ttl: Ttl::new(long).expect("ttl"),
        min_token: 0,
        request_id: RequestId::random(),
    };
    let acquire = |i: usize, who: u32| {
        wire::acquire_call(&keys[i], &claim(i, who), &ttl, reply_ttl)
            .evalsha()
            .clone()
    };
    // The permit's handle from the acquire's reply: `acquired <token> <ttl> <now> <acquired>
    // [<slot>]`.
    let release = |i: usize, who: u32, reply: &redis::Value| {
        let text = reply_text(reply);
        let fields: Vec<&str> = text.split(' ').collect();
        let token = fields.get(1).and_then(|t| t.parse().ok()).unwrap_or(1);
        let slot = fields.get(5).and_then(|s| s.parse().ok()).unwrap_or(0);
        let req = claim(i, who);
        let req = ReleaseRequest {
            lease: LeaseHandle {
                target: req.target,
                permits: n_permits,
                slot: Slot::new(slot).expect("slot"),
                lease_id: req.lease_id,
                owner: req.owner,
                token: Token::new(token).expect("token"),
            },
            request_id: RequestId::random(),
        };
        wire::release_call(&keys[i], &req, reply_ttl)
            .evalsha()
            .clone()
    };
    let mut costs = Vec::new();
    let label = |what: &str| -> &'static str {
        Box::leak(format!("permits {permits}: {what}").into_boxed_str())
    };
    let (c, first) = pipelined(
        conn,
        label("acquire.lua, target never used"),
        (0..n).map(|i| acquire(i, 0)).collect(),
    )
    .await;
    costs.push(c);
    // Every other slot taken, not timed.
    for who in 1..permits.saturating_sub(1) {
        let _ = pipelined(conn, "setup", (0..n).map(|i| acquire(i, who)).collect()).await;
    }
    let last = permits.saturating_sub(1).max(1);
    let (c, taken) = pipelined(
        conn,
        label("acquire.lua, takes the last free slot (every slot read)"),
        (0..n).map(|i| acquire(i, last)).collect(),
    )
    .await;
    if permits > 1 {
        costs.push(c);
    }
    let (c, _) = pipelined(
        conn,
        label("acquire.lua, every slot held (answers held)"),
        (0..n).map(|i| acquire(i, permits + 1)).collect(),
    )
    .await;
    costs.push(c);
    // What a target costs with every permit held, once the reply entries expired.
    let all_replies: Vec<String> = redis::cmd("KEYS")
        .arg("tl:{permits/*}:req:*")
        .query_async(conn)
        .await
        .unwrap_or_default();
    for chunk in all_replies.chunks(500) {
        let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query_async(conn).await;
    }
    let held = used_memory(conn).await;
    let _: Result<(), _> = redis::cmd("FLUSHALL").arg("SYNC").query_async(conn).await;
    let empty = used_memory(conn).await;
    let bytes = (held - empty) as f64 / n.max(1) as f64;
    // The release of a permit whose target has others held: measured on fresh grants.
    let (_, again) = pipelined(conn, "setup", (0..n).map(|i| acquire(i, 0)).collect()).await;
    let (_, second) = pipelined(conn, "setup", (0..n).map(|i| acquire(i, 1)).collect()).await;
    let (c, _) = pipelined(
        conn,
        label("release.lua, holder"),
        (0..n).map(|i| release(i, 0, &again[i])).collect(),
    )
    .await;
    costs.push(c);
    drop((first, taken, second));
    (costs, bytes)
}

/// `used_memory` from INFO memory, in bytes.
async fn used_memory(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// What a target costs in server memory: `MEMORY USAGE` of each key of one target, and the
/// growth of `used_memory` over `n` targets (allocator overhead included), held, released,
/// and with the reply cache entries of the calls gone (as after the reply TTL).
async fn memory_costs(conn: &mut redis::aio::MultiplexedConnection, n: usize) -> String {
    use targetlease::store::valkey::keys::TargetKeys;
    use targetlease::store::valkey::wire;

    let _: Result<(), _> = redis::cmd("FLUSHALL").arg("SYNC").query_async(conn).await;
    let ttl = LEASE_TTL.as_millis().to_string();
    let targets: Vec<TargetRef> = (0..n)
        .map(|i| TargetRef::new("memory", &format!("team-{i}/orders-db")).expect("target"))
        .collect();
    let keys: Vec<TargetKeys> = targets.iter().map(|t| TargetKeys::new("tl", t)).collect();
    // Lease ids and owners as the controller makes them: a UID and a pod-like name.
    let claim = |i: usize| {
        (
            LeaseId::new(format!("{:08x}-7c4e-4f0a-9d1e-{:012x}", i, i)).expect("lease id"),
            Owner::new(format!("reports-writer-7d9f8b6c4-{i:05}")).expect("owner"),
        )
    };
    let empty = used_memory(conn).await;
    let (_, replies) = pipelined(
        conn,
        "acquire",
        (0..n)
            .map(|i| {
                let (lease_id, owner) = claim(i);
                let req = AcquireRequest {
                    target: targets[i].clone(),
                    lease_id,
                    owner,
                    permits: Permits::ONE,
                    ttl: lease_ttl(),
                    min_token: 0,
                    request_id: RequestId::random(),
                };
                wire::acquire_call(&keys[i], &req, &ttl, "60000")
                    .evalsha()
                    .clone()
            })
            .collect(),
    )
    .await;
    let held = used_memory(conn).await;
    let usage = |key: String| {
        let mut cmd = redis::cmd("MEMORY");
        cmd.arg("USAGE").arg(key).arg("SAMPLES").arg(0);
        cmd
    };
    let mut per_key = Vec::new();
    for (what, key) in [
        ("lease hash (held)", keys[0].lease()),
        ("fence", keys[0].fence()),
        ("grant", keys[0].grant()),
    ] {
        let bytes: i64 = usage(key).query_async(conn).await.unwrap_or(-1);
        per_key.push((what, bytes));
    }
    let reply_keys: Vec<String> = redis::cmd("KEYS")
        .arg("tl:{memory/team-0/*}:req:*")
        .query_async(conn)
        .await
        .unwrap_or_default();
    if let Some(key) = reply_keys.first() {
        let bytes: i64 = usage(key.clone()).query_async(conn).await.unwrap_or(-1);
        per_key.push(("reply cache entry", bytes));
    }
    let _ = pipelined(
        conn,
        "release",
        (0..n)
            .map(|i| {
                let (lease_id, owner) = claim(i);
                let token = reply_text(&replies[i])
                    .split(' ')
                    .nth(1)
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(1);
                let req = ReleaseRequest {
                    lease: LeaseHandle {
                        target: targets[i].clone(),
                        permits: Permits::ONE,
                        slot: Slot::ZERO,
                        lease_id,
                        owner,
                        token: Token::new(token).expect("token"),
                    },
                    request_id: RequestId::random(),
                };
                wire::release_call(&keys[i], &req, "60000")
                    .evalsha()
                    .clone()
            })
            .collect(),
    )
    .await;
    let released = used_memory(conn).await;
    // The reply cache entries expire after the reply TTL; here they are dropped at once.
    let all_replies: Vec<String> = redis::cmd("KEYS")
        .arg("tl:{memory/*}:req:*")
        .query_async(conn)
        .await
        .unwrap_or_default();
    for chunk in all_replies.chunks(500) {
        let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query_async(conn).await;
    }
    let settled = used_memory(conn).await;
    let per = |bytes: i64| bytes as f64 / n.max(1) as f64;
    let mut out = format!(
        "\nServer memory per target ({n} targets; key names like `tl:{{memory/team-1/orders-db}}`, \
         a UID lease id, a pod-name owner):\n\n| what | bytes |\n|---|---|\n"
    );
    for (what, bytes) in per_key {
        let _ = writeln!(out, "| `MEMORY USAGE` of one {what} | {bytes} |");
    }
    let _ = writeln!(
        out,
        "| used_memory per target, held (lease, fence, grant, one reply entry) | {:.0} |",
        per(held - empty)
    );
    let _ = writeln!(
        out,
        "| used_memory per target, released (fence, grant, two reply entries still cached) | {:.0} |",
        per(released - empty)
    );
    let _ = writeln!(
        out,
        "| used_memory per target once the reply entries expired | {:.0} |",
        per(settled - empty)
    );
    out
}

fn costs_table(costs: &[Cost]) -> String {
    let mut out = String::from(
        "\nServer CPU per call (pipelined batches on an idle connection; what one call costs the single Valkey thread):\n\n\
         | call | calls | server CPU µs/call |\n|---|---|---|\n",
    );
    for c in costs {
        let _ = writeln!(
            out,
            "| {} | {} | {:.2}{} |",
            c.what,
            c.calls,
            c.us,
            c.error
                .as_deref()
                .map(|e| format!(" (error: {e})"))
                .unwrap_or_default()
        );
    }
    out
}

fn report(runs: &[Run], levels: &[usize], header: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "```\n{header}\n```\n");
    let _ = writeln!(
        out,
        "| tasks | workload | cycles/s | p50 µs | p99 µs | server CPU µs/cycle | client CPU µs/cycle | server cmds/cycle | load avg (1 min) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for &c in levels {
        for w in Workload::ALL {
            let mine: Vec<&Run> = runs
                .iter()
                .filter(|r| r.workload == w && r.concurrency == c)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let s = summarize(&mine);
            let _ = writeln!(
                out,
                "| {c} | {} {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                w.letter(),
                w.describe(),
                s.cycles_per_sec,
                s.p50_us,
                s.p99_us,
                s.server_us,
                s.client_us,
                s.commands,
                s.load
            );
        }
    }
    let _ = writeln!(
        out,
        "\nRatios (median over rounds of the per-round ratio of cycles/s):\n"
    );
    let _ = writeln!(
        out,
        "| tasks | a/b (vs Redlock) | a/f (vs a fenced lock) | a/c (vs ceiling) | d/e renew vs Redlock extend | g/a (permits 10 vs 1) | h/a (permits 100 vs 1) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for &c in levels {
        let _ = writeln!(
            out,
            "| {c} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            ratio(runs, c, Workload::Lease, Workload::Redlock),
            ratio(runs, c, Workload::Lease, Workload::Fenced),
            ratio(runs, c, Workload::Lease, Workload::Noop),
            ratio(runs, c, Workload::Renew, Workload::Extend),
            ratio(runs, c, Workload::Permits10, Workload::Lease),
            ratio(runs, c, Workload::Permits100, Workload::Lease)
        );
    }
    let _ = writeln!(
        out,
        "\nServer commands per cycle by name (scripts' inner calls included), median over rounds, at {} tasks:\n",
        levels.last().copied().unwrap_or(1)
    );
    let c = levels.last().copied().unwrap_or(1);
    for w in Workload::ALL {
        let mine: Vec<&Run> = runs
            .iter()
            .filter(|r| r.workload == w && r.concurrency == c)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let names: std::collections::BTreeSet<&String> =
            mine.iter().flat_map(|r| r.per_command.keys()).collect();
        let parts: Vec<String> = names
            .into_iter()
            .map(|n| {
                let v = median(
                    &mine
                        .iter()
                        .map(|r| r.per_command.get(n).copied().unwrap_or(0.0))
                        .collect::<Vec<_>>(),
                );
                format!("{n} {v:.2}")
            })
            .collect();
        let _ = writeln!(
            out,
            "- {} {}: {}",
            w.letter(),
            w.describe(),
            parts.join(", ")
        );
    }
    out
}

fn json(runs: &[Run]) -> serde_json::Value {
    serde_json::Value::Array(
        runs.iter()
            .map(|r| {
                serde_json::json!({
                    "workload": r.workload.letter(),
                    "describe": r.workload.describe(),
                    "callsPerCycle": r.workload.calls(),
                    "concurrency": r.concurrency,
                    "round": r.round,
                    "cyclesPerSec": r.cycles_per_sec,
                    "p50Us": r.p50_us,
                    "p99Us": r.p99_us,
                    "serverUsPerCycle": r.server_us_per_cycle,
                    "clientUsPerCycle": r.client_us_per_cycle,
                    "commandsPerCycle": r.commands_per_cycle,
                    "perCommand": r.per_command,
                    "errors": r.errors,
                    "load": r.load,
                })
            })
            .collect(),
    )
}

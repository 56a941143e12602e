//! The libtest-mimic plumbing every suite shares: one trial per async test body, each on its
//! own runtime under a time limit, and a closing `<suite>: N passed, N failed` line. A suite in
//! which no test ran fails: a missing server must never look like success.
//!
//! One test binary per layer ([`layer`]: the store, the controller, the packaging) runs its
//! suites one after the other, each with its own settings (how many trials at once, what it
//! starts first); a trial's name begins with its suite's (`contract::...`), so that
//! `cargo test --test store -- contract::` runs one suite.

use std::cell::RefCell;
use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion, Failed, Trial};

/// How long one test may take before it fails.
pub const TEST_LIMIT: Duration = Duration::from_secs(180);

thread_local! {
    /// The suite whose trials are being made on this thread: their names begin with it.
    static SUITE: RefCell<Option<&'static str>> = const { RefCell::new(None) };
}

/// A trial's full name: its suite's, then `name`.
fn named(name: impl Into<String>) -> String {
    let name = name.into();
    SUITE.with(|suite| match *suite.borrow() {
        Some(suite) => format!("{suite}::{name}"),
        None => name,
    })
}

/// One suite of a layer: its trials, run with the layer's arguments (its own settings on top).
pub type Suite = fn(&Arguments) -> Conclusion;

/// Runs each of `suites` in turn (a suite none of whose trials the arguments select starts
/// nothing), prints each suite's closing line and the layer's, and exits: non-zero on a failure
/// or when no test ran at all.
pub fn layer(layer: &str, suites: &[(&'static str, Suite)]) -> ! {
    let args = Arguments::from_args();
    let (mut passed, mut failed) = (0, 0);
    for (name, suite) in suites {
        SUITE.with(|s| *s.borrow_mut() = Some(name));
        let conclusion = suite(&args);
        SUITE.with(|s| *s.borrow_mut() = None);
        if conclusion.num_passed + conclusion.num_failed > 0 {
            println!(
                "{name}: {} passed, {} failed",
                conclusion.num_passed, conclusion.num_failed
            );
        }
        passed += conclusion.num_passed;
        failed += conclusion.num_failed;
    }
    println!("{layer}: {passed} passed, {failed} failed");
    if passed + failed == 0 {
        eprintln!("{layer}: no test ran; refusing to pass vacuously");
        std::process::exit(1);
    }
    std::process::exit(if failed > 0 { 101 } else { 0 })
}

/// Runs `trials` with `args`; a suite none of whose trials are selected prints nothing.
pub fn run(args: &Arguments, trials: Vec<Trial>) -> Conclusion {
    if !wanted(args, &trials) {
        return Conclusion {
            num_filtered_out: u64::try_from(trials.len()).unwrap_or(u64::MAX),
            num_passed: 0,
            num_failed: 0,
            num_ignored: 0,
            num_measured: 0,
        };
    }
    libtest_mimic::run(args, trials)
}

/// Whether `args` select any of `trials`: a suite starts what its trials share (a control
/// plane, a node) only then.
pub fn wanted(args: &Arguments, trials: &[Trial]) -> bool {
    trials.iter().any(|trial| !args.is_filtered_out(trial))
}

/// A trial that runs `body` on a fresh multi-threaded runtime (two workers, so a test's own
/// blocking calls cannot freeze the proxy or the client's background tasks).
pub fn trial<F, Fut>(name: impl Into<String>, body: F) -> Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    trial_with_limit(name, TEST_LIMIT, body)
}

/// A trial of a plain (blocking) test body, for suites that drive processes and clusters
/// rather than async clients: a panic is its failure, with the panic's message.
pub fn blocking_trial(name: &'static str, body: fn()) -> Trial {
    let name = named(name);
    let label = name.clone();
    Trial::test(name, move || {
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(body);
        took(&label, started.elapsed());
        outcome.map_err(|panic| Failed::from(panic_message(&*panic)))
    })
}

/// Prints how long a test took, as `took: <name>: <seconds> s`: scripts/test.sh lists the
/// slowest at the end, which is where the suite's time budget is won or lost.
fn took(name: &str, elapsed: Duration) {
    eprintln!("took: {name}: {:.1} s", elapsed.as_secs_f64());
}

/// [`trial`] with its own time limit, for long runs.
pub fn trial_with_limit<F, Fut>(name: impl Into<String>, limit: Duration, body: F) -> Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let name = named(name);
    let label = name.clone();
    Trial::test(name, move || {
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(async move {
                tokio::time::timeout(limit, body())
                    .await
                    .unwrap_or_else(|_| panic!("test timed out after {limit:?}"));
            });
        }));
        took(&label, started.elapsed());
        outcome.map_err(|panic| Failed::from(panic_message(&*panic)))
    })
}

/// The message of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "test panicked".into())
}

/// Prints a measured figure so that it shows in the test output (`--nocapture`) and in the
/// failure message context.
pub fn measured(what: &str, value: Duration) {
    eprintln!("measured: {what}: {} ms", value.as_millis());
}

/// Everything written by a tracing subscriber, for tests that check what is (not) logged.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// The logs so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        String::from_utf8(bytes).expect("utf-8 logs")
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Captures every log line of this thread (at every level) until the guard drops.
pub fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(captured.clone())
        .with_ansi(false)
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    // Whether a log line is wanted is cached per call site, for every thread at once: a trial
    // on another thread whose subscriber wants less (or none) can leave this thread's debug
    // lines cached as unwanted, and they would be missing here (seen once: a trial found none
    // of the store's lines). Asked again now, with this subscriber among the live ones.
    tracing::callsite::rebuild_interest_cache();
    (captured, guard)
}

//! The libtest-mimic plumbing every suite shares: one trial per async test body, each on its
//! own runtime under a time limit, and a closing `<suite>: N passed, N failed` line. A suite in
//! which no test ran fails: a missing server must never look like success.

use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Conclusion, Failed, Trial};

/// How long one test may take before it fails.
pub const TEST_LIMIT: Duration = Duration::from_secs(180);

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
    Trial::test(name, move || {
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(body);
        took(name, started.elapsed());
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
    let name = name.into();
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

/// Runs the trials, prints the closing line and exits (non-zero on failure or when nothing ran).
pub fn run(suite: &str, trials: Vec<Trial>) -> ! {
    let args = Arguments::from_args();
    finish(suite, libtest_mimic::run(&args, trials))
}

/// Prints the closing line of a suite that ran its trials itself, and exits (non-zero on failure
/// or when nothing ran).
pub fn finish(suite: &str, conclusion: Conclusion) -> ! {
    println!(
        "{suite}: {} passed, {} failed",
        conclusion.num_passed, conclusion.num_failed
    );
    if conclusion.num_passed + conclusion.num_failed == 0 {
        eprintln!("{suite}: no test ran; refusing to pass vacuously");
        std::process::exit(1);
    }
    conclusion.exit()
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
    (captured, tracing::subscriber::set_default(subscriber))
}

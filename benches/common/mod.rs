//! Helpers shared by the benchmarks: the options they share, statistics, the machine's description,
//! process accounting from /proc and a hand-written SVG histogram. No measurement here asserts on
//! speed: the benchmarks print numbers and ratios, they never pass or fail on them.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What every benchmark takes besides its own options: the output folder, the smoke switch and
/// what `cargo bench` passes along. Flatten it into a bench's clap options.
#[derive(Debug, clap::Args)]
pub struct CommonArgs {
    /// Where the report (Markdown, JSON, SVG) goes [default: a folder in Cargo's target tmp dir]
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Tiny run for scripts/test.sh: checks that numbers come out, not speed
    #[arg(long)]
    pub smoke: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
    /// A name filter from `cargo bench NAME`; ignored.
    #[arg(hide = true)]
    pub filter: Vec<String>,
}

impl CommonArgs {
    /// The output folder, created: `--out DIR`, or `<Cargo's target tmp dir>/<bench>`.
    pub fn out_dir(&self, bench: &str) -> PathBuf {
        let dir = self
            .out
            .clone()
            .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join(bench));
        std::fs::create_dir_all(&dir).expect("create the output folder");
        dir
    }

    /// `value` when given, else the smoke run's default or the full run's.
    pub fn pick<T>(&self, value: Option<T>, full: T, smoke: T) -> T {
        value.unwrap_or(if self.smoke { smoke } else { full })
    }
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` shows them.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into())
}

/// CPU model, cores, memory and kernel.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {cores} cores, {mem_gib:.0} GiB, Linux {}",
        kernel.trim()
    )
}

/// Linux reports /proc times in USER_HZ, which is 100 on every architecture this runs on.
const USER_HZ: f64 = 100.0;

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime is field 14, stime field 15 (1-based); `rest` starts at field 3.
    (ticks(11) + ticks(12)) / USER_HZ
}

/// A `/proc/PID/status` field in KiB (`VmHWM`, `VmRSS`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The value at quantile `q` (0..=1) of sorted samples (nearest rank).
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of some values (mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A duration in milliseconds with two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

/// Writes an SVG histogram of `samples_ms` (one bar per bucket) with p50, p99 and max marked.
pub fn svg_histogram(path: &Path, title: &str, samples_ms: &[f64]) -> std::io::Result<()> {
    let mut sorted: Vec<f64> = samples_ms
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .collect();
    sorted.sort_by(f64::total_cmp);
    let (w, h, left, right, top, bottom) = (720.0, 360.0, 60.0, 20.0, 40.0, 50.0);
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let max = sorted.last().copied().unwrap_or(1.0).max(1.0);
    // Bucket width: a round number of ms giving at most ~60 buckets.
    let step = [
        0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
    ]
    .into_iter()
    .find(|s| max / s <= 60.0)
    .unwrap_or(2000.0);
    let buckets = ((max / step).floor() as usize) + 1;
    let mut counts = vec![0usize; buckets];
    for v in &sorted {
        counts[((v / step).floor() as usize).min(buckets - 1)] += 1;
    }
    let peak = counts.iter().copied().max().unwrap_or(1).max(1) as f64;
    let x_of = |ms: f64| left + ms / (buckets as f64 * step) * plot_w;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{w}" height="{h}" fill="white"/><text x="{left}" y="22" font-size="14" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let bar_w = plot_w / buckets as f64;
    for (i, c) in counts.iter().enumerate() {
        if *c == 0 {
            continue;
        }
        let bh = *c as f64 / peak * plot_h;
        let _ = writeln!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}" fill="#4e79a7"><title>{:.1}-{:.1} ms: {c}</title></rect>"##,
            left + i as f64 * bar_w,
            top + plot_h - bh,
            (bar_w - 1.0).max(0.5),
            i as f64 * step,
            (i + 1) as f64 * step,
        );
    }
    // Axes and ticks.
    let _ = writeln!(
        svg,
        r#"<line x1="{left}" y1="{y}" x2="{x2}" y2="{y}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{y}" stroke="black"/>"#,
        y = top + plot_h,
        x2 = left + plot_w
    );
    // Round tick spacings: at most ~8 ticks on each axis.
    let nice = |span: f64| {
        [
            1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
        ]
        .into_iter()
        .find(|t| span / t <= 8.0)
        .unwrap_or(10_000.0)
    };
    let span = buckets as f64 * step;
    let x_tick = nice(span);
    let mut v = 0.0;
    while v <= span + 1e-9 {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{v:.0}</text>"#,
            x_of(v),
            top + plot_h + 16.0
        );
        v += x_tick;
    }
    let y_tick = nice(peak);
    let mut c = 0.0;
    while c <= peak + 1e-9 {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{c:.0}</text>"#,
            left - 6.0,
            top + plot_h - plot_h * c / peak + 4.0
        );
        c += y_tick;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">hand-over latency (ms), {} samples, bucket {step} ms</text>"#,
        left + plot_w / 2.0,
        h - 12.0,
        sorted.len()
    );
    let _ = writeln!(
        svg,
        r#"<text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">count</text>"#,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    let q = |p: f64| {
        if sorted.is_empty() {
            0.0
        } else {
            let rank = (p * sorted.len() as f64).ceil() as usize;
            sorted[rank.clamp(1, sorted.len()) - 1]
        }
    };
    for (label, v, color) in [
        ("p50", q(0.5), "#e15759"),
        ("p99", q(0.99), "#f28e2b"),
        ("max", max, "#76b7b2"),
    ] {
        let x = x_of(v);
        // Labels near the right edge go to the left of their line.
        let (tx, anchor) = if x > w - 140.0 {
            (x - 3.0, "end")
        } else {
            (x + 3.0, "start")
        };
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="{color}" stroke-dasharray="4 3"/><text x="{tx:.1}" y="{:.1}" fill="{color}" text-anchor="{anchor}">{label} {v:.1} ms</text>"#,
            top + plot_h,
            top + 12.0
                + if label == "p99" {
                    14.0
                } else if label == "max" {
                    28.0
                } else {
                    0.0
                }
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

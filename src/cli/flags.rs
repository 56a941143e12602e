//! Durations on the command line: `30s`, `500ms`, `2m`, read and shown the same way.

use std::time::Duration;

/// A duration as flags write it (`30s`, `500ms`, `2m`), parsed by [`parse_duration`] and shown
/// the same way, so a flag's default is written once, as the `Duration` constant the rest of the
/// code uses (`default_value_t = Span(CONSTANT)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span(pub Duration);

impl std::str::FromStr for Span {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        parse_duration(text).map(Span)
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}s", d.as_secs_f64())
        }
    }
}

/// Parses a duration: a plain number is seconds; otherwise a number with `ms`, `s`, `m` or `h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (try 30, 30s, 500ms, 2m)"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_back_what_they_show() {
        for d in [
            Duration::from_secs(2),
            Duration::from_millis(50),
            Duration::from_millis(1500),
            Duration::from_secs(60),
            Duration::from_micros(1500),
        ] {
            let shown = Span(d).to_string();
            assert_eq!(shown.parse::<Span>(), Ok(Span(d)), "{shown}");
        }
        assert_eq!(Span(Duration::from_millis(50)).to_string(), "50ms");
        assert_eq!(Span(Duration::from_secs(2)).to_string(), "2s");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}

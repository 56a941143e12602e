//! Conversions between durations, store times (milliseconds since the Unix epoch, as the store
//! answers them) and timestamps (as a status shows them), in one place and with one overflow
//! rule: every conversion saturates, none panics and none wraps. A time before the epoch reads
//! as the epoch.

use std::time::Duration;

use jiff::Timestamp;

/// A duration in whole milliseconds; `u64::MAX` for one too long to count.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The timestamp `ms` milliseconds after the epoch; the latest timestamp for one beyond it.
pub(crate) fn timestamp(ms: u64) -> Timestamp {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| Timestamp::from_millisecond(ms).ok())
        .unwrap_or(Timestamp::MAX)
}

/// Milliseconds since the epoch of `t`; 0 for a time before it.
pub(crate) fn ms_of(t: Timestamp) -> u64 {
    u64::try_from(t.as_millisecond()).unwrap_or(0)
}

/// This machine's wall clock in milliseconds since the epoch: for values written for people and
/// for the heartbeat annotation (never compared with another machine's clock).
pub(crate) fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_saturate() {
        assert_eq!(millis(Duration::from_secs(2)), 2_000);
        assert_eq!(millis(Duration::MAX), u64::MAX);
        assert_eq!(ms_of(timestamp(1_234)), 1_234);
        assert_eq!(timestamp(u64::MAX), Timestamp::MAX);
        assert_eq!(ms_of(Timestamp::MIN), 0);
        assert!(wall_ms() > 1_700_000_000_000);
    }
}

//! Log lines that a flood of the same event (connections past a limit, I/O failing while a
//! device is cut off) must not multiply: one line per interval, carrying the count of the
//! lines held back since the one before.

use std::time::Duration;

/// At most one log line per interval; the lines it held back are counted into the next one, so a
/// connection flood cannot flood the log.
pub(crate) struct LogLimiter {
    interval: Duration,
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl LogLimiter {
    pub(crate) const fn new(interval: Duration) -> LogLimiter {
        LogLimiter {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(lines suppressed since the last one)` when a line may be logged now.
    pub(crate) fn admit(&mut self, now: std::time::Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < self.interval)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

impl LogLimiter {
    /// A process-wide limiter of one line a second (a `static`'s initial value).
    const fn every_second() -> std::sync::Mutex<LogLimiter> {
        std::sync::Mutex::new(LogLimiter::new(Duration::from_secs(1)))
    }
}

/// [`LogLimiter::admit`] on a process-wide limiter, now.
fn admit(limit: &std::sync::Mutex<LogLimiter>) -> Option<u64> {
    limit
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .admit(std::time::Instant::now())
}

/// A failed device I/O: logged at most once a second across devices (a host retrying against
/// a fenced or unreachable device fails every few milliseconds); every failure is also in the
/// device's error metrics.
pub(crate) fn device_io_failed(
    lun: u64,
    op: &dyn std::fmt::Debug,
    offset: u64,
    len: u32,
    e: &std::io::Error,
) {
    static LIMIT: std::sync::Mutex<LogLimiter> = LogLimiter::every_second();
    let admitted = admit(&LIMIT);
    match admitted {
        Some(suppressed) => tracing::warn!(
            lun,
            suppressed,
            "device I/O failed: {op:?} at {offset}+{len}: {e}"
        ),
        // Each one held back is still there for whoever asks (RUST_LOG=engine::log_limit=debug).
        None => tracing::debug!(lun, "device I/O failed: {op:?} at {offset}+{len}: {e}"),
    }
}

/// A reset (LOGICAL UNIT RESET, TARGET RESET, CLEAR TASK SET) answered once its LUs' commands
/// in flight drained: a host's error recovery, which an admin reads beside the host's own log
/// (and a slow device shows in how long it waited). At most one line a second across
/// connections: a host may reset in a loop.
pub(crate) fn reset_answered(function: &dyn std::fmt::Debug, luns: usize, waited: Duration) {
    static LIMIT: std::sync::Mutex<LogLimiter> = LogLimiter::every_second();
    let admitted = admit(&LIMIT);
    let waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
    match admitted {
        Some(suppressed) => tracing::info!(
            luns,
            waited_ms,
            suppressed,
            "task management: {function:?} answered after {waited_ms} ms (its LUs' commands in flight drained first)"
        ),
        None => tracing::debug!(luns, waited_ms, "task management: {function:?} answered"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_limiter_counts_what_it_holds_back() {
        let mut l = LogLimiter::new(Duration::from_secs(1));
        let t0 = std::time::Instant::now();
        assert_eq!(l.admit(t0), Some(0));
        assert_eq!(l.admit(t0 + Duration::from_millis(10)), None);
        assert_eq!(l.admit(t0 + Duration::from_millis(500)), None);
        assert_eq!(l.admit(t0 + Duration::from_millis(1000)), Some(2));
        assert_eq!(l.admit(t0 + Duration::from_millis(1001)), None);
    }
}

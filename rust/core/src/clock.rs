//! The clock that leases, proofs of life and WRITE ages are measured on: `CLOCK_BOOTTIME`.
//!
//! `std::time::Instant` is `CLOCK_MONOTONIC`, which stops while the host is suspended: a P that
//! resumes would believe a proof of life taken before the suspend is as fresh as it was, and
//! post a WRITE into blocks D may have given up. `CLOCK_BOOTTIME` counts the suspend too. (A
//! paused virtual machine's guest clocks stop with it, whichever is read: that is why D does not
//! rely on P's clocks at all before handing blocks back; see `endpoint::awaited`.)
//!
//! The endpoint reads every clock through a `Clock`: the system's (`SystemClock`), or a
//! simulation's virtual one (`endpoint::sim`), which moves only when the simulation says so.

use std::fmt;
use std::time::{Duration, Instant};

/// A moment on the boot-time clock; only differences between two of them mean anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootInstant(Duration);

impl BootInstant {
    /// Now.
    pub fn now() -> Self {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        // Both fields are non-negative for this clock (it counts from boot).
        let secs = u64::try_from(now.tv_sec).unwrap_or(0);
        let nanos = u32::try_from(now.tv_nsec).unwrap_or(0);
        Self(Duration::new(secs, nanos))
    }

    /// Time from `earlier` to `self` (zero if `earlier` is later).
    pub fn saturating_duration_since(self, earlier: Self) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// Time since `self`.
    pub fn elapsed(self) -> Duration {
        Self::now().saturating_duration_since(self)
    }

    /// Milliseconds since boot: a clock value to carry in a message or an atomic.
    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }

    /// The moment `since_boot` after boot: a simulated clock's reading.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn since_boot(since_boot: Duration) -> Self {
        Self(since_boot)
    }
}

/// The clocks an endpoint reads: the monotonic one (deadlines, timelines), the boot-time one
/// (leases, proofs of life, WRITE ages) and the wall clock (signed frames' timestamps).
pub(crate) trait Clock: Send + Sync + fmt::Debug {
    /// Now on the monotonic clock.
    fn now(&self) -> Instant;
    /// Now on the boot-time clock.
    fn boot_now(&self) -> BootInstant;
    /// Now on the wall clock, in milliseconds since the Unix epoch.
    fn unix_millis(&self) -> u64;
}

/// The system's clocks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn boot_now(&self) -> BootInstant {
        BootInstant::now()
    }

    fn unix_millis(&self) -> u64 {
        crate::protocol::unix_millis()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_forward_with_the_monotonic_clock() {
        let (boot, mono) = (BootInstant::now(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (b, m) = (boot.elapsed(), mono.elapsed());
        assert!(b >= Duration::from_millis(20), "{b:?}");
        // Without a suspend in between, the two clocks agree to within scheduling noise.
        assert!(b.abs_diff(m) < Duration::from_millis(50), "{b:?} vs {m:?}");
        assert!(BootInstant::now() >= boot);
    }
}

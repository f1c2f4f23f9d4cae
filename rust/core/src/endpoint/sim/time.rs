//! Virtual time: one true time that the simulation advances, and each simulated host's clocks,
//! which read it (less what a suspend or a paused virtual machine kept them from counting).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{BootInstant, Clock};

/// The true time since the simulation started, in nanoseconds: only the simulation moves it.
#[derive(Debug, Default)]
pub(super) struct Truth(AtomicU64);

impl Truth {
    pub(super) fn get(&self) -> Duration {
        // Relaxed: one thread runs the whole simulation.
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    pub(super) fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(by, Ordering::Relaxed);
    }
}

/// A wall clock far from 0, the same in every run (signed frames carry it).
const UNIX_BASE_MS: u64 = 1_800_000_000_000;
/// How long the hosts have been up when the simulation starts, the same in every run (the
/// endpoint keeps boot-time readings as whole milliseconds).
const BOOTED: Duration = Duration::from_secs(3_600);

/// One host's clocks: the true time, less the time its monotonic (and boot-time) clock did not
/// count. Both lags only grow, so the clocks never go back.
#[derive(Debug)]
pub(super) struct HostClock {
    truth: Arc<Truth>,
    base: Instant,
    mono_lag: AtomicU64,
    boot_lag: AtomicU64,
}

impl HostClock {
    /// A host whose monotonic clock reads `base` at the start (only its differences mean
    /// anything).
    pub(super) fn new(truth: Arc<Truth>, base: Instant) -> Self {
        Self { truth, base, mono_lag: AtomicU64::new(0), boot_lag: AtomicU64::new(0) }
    }

    /// The host did not count `lost` on its monotonic clock (a suspend), and also not on its
    /// boot-time clock when `boot_too` (a paused virtual machine).
    pub(super) fn lose(&self, lost: Duration, boot_too: bool) {
        let lost = u64::try_from(lost.as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: one thread runs the whole simulation.
        self.mono_lag.fetch_add(lost, Ordering::Relaxed);
        if boot_too {
            self.boot_lag.fetch_add(lost, Ordering::Relaxed);
        }
    }

    fn counted(&self, lag: &AtomicU64) -> Duration {
        self.truth.get().saturating_sub(Duration::from_nanos(lag.load(Ordering::Relaxed)))
    }
}

impl Clock for HostClock {
    fn now(&self) -> Instant {
        self.base + self.counted(&self.mono_lag)
    }

    fn boot_now(&self) -> BootInstant {
        BootInstant::since_boot(BOOTED + self.counted(&self.boot_lag))
    }

    fn unix_millis(&self) -> u64 {
        // The wall clock keeps the true time (NTP puts a resumed host's right).
        UNIX_BASE_MS + u64::try_from(self.truth.get().as_millis()).unwrap_or(u64::MAX)
    }
}

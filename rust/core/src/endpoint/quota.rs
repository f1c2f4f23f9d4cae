//! What the peers of one host may hold in P's rendezvous table at once ([`Quota`]), and the
//! share of it each registration holds until it is dropped ([`Slot`]): no host, however many
//! connections or engine ids it opens, can fill the table or P's memory that every other D
//! shares.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What the peers of one host may hold in P's table at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Quota {
    /// Registrations (`max_registrations_per_host`).
    pub(crate) entries: usize,
    /// Their bytes, as `halves::registration_bytes` counts them (`max_registration_bytes_per_host`).
    pub(crate) bytes: usize,
}

/// What the registrations of one host hold in P's table now.
#[derive(Debug, Default)]
pub(super) struct Held {
    entries: AtomicUsize,
    bytes: AtomicUsize,
}

/// One registration's share of its host's [`Quota`]: one entry and its bytes, given back when
/// the registration that holds it is dropped (matched and written, superseded, cancelled,
/// expired or purged).
#[derive(Debug)]
pub(crate) struct Slot {
    held: Arc<Held>,
    bytes: usize,
}

/// Why a registration found no room in its host's quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OverQuota {
    /// The host holds `quota.entries` registrations already.
    Entries,
    /// The registration's bytes would take the host past `quota.bytes`; it held `held`.
    Bytes { held: usize },
}

impl Slot {
    /// One entry and `bytes` of `held`'s quota, if there is room for both.
    pub(super) fn take(held: &Arc<Held>, bytes: usize, quota: Quota) -> Result<Self, OverQuota> {
        // Relaxed: quota counters; the registration itself is published by the table's lock.
        // Each read-modify-write alone keeps its count exact; an arrival that overshoots backs
        // its share out again.
        if held.entries.fetch_add(1, Ordering::Relaxed) >= quota.entries {
            held.entries.fetch_sub(1, Ordering::Relaxed);
            return Err(OverQuota::Entries);
        }
        let before = held.bytes.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) > quota.bytes {
            held.bytes.fetch_sub(bytes, Ordering::Relaxed);
            held.entries.fetch_sub(1, Ordering::Relaxed);
            return Err(OverQuota::Bytes { held: before });
        }
        Ok(Self { held: Arc::clone(held), bytes })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Relaxed: see `take`.
        self.held.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
        self.held.entries.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_s_quota_counts_entries_and_bytes_and_each_slot_gives_its_share_back() {
        let held = Arc::new(Held::default());
        let quota = Quota { entries: 2, bytes: 10_000 };
        let first = Slot::take(&held, 6_000, quota).unwrap();
        assert_eq!(Slot::take(&held, 6_000, quota).unwrap_err(), OverQuota::Bytes { held: 6_000 });
        let second = Slot::take(&held, 4_000, quota).unwrap();
        assert_eq!(Slot::take(&held, 1, quota).unwrap_err(), OverQuota::Entries);
        drop(first);
        let third = Slot::take(&held, 6_000, quota).unwrap();
        drop((second, third));
        // Relaxed: no other thread touches these.
        assert_eq!(held.entries.load(Ordering::Relaxed), 0);
        assert_eq!(held.bytes.load(Ordering::Relaxed), 0);
    }
}

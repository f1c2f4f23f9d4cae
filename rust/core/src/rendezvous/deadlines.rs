//! A shard's lazy deadline heap: due times queued once per entry, with generations that mark
//! the items an entry no longer answers to.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use super::shard::Entry;

/// A shard's heap of due times, earliest first. Holds at most one current item per entry, plus
/// stale ones that are skipped when popped and dropped by
/// [`Shard::compact`](super::shard::Shard::compact).
#[derive(Default)]
pub(super) struct Deadlines {
    pub(super) heap: BinaryHeap<Reverse<Due>>,
    /// Source of heap-item generations; unique within the shard.
    next_generation: u64,
}

impl Deadlines {
    /// Queues the entry whose key hashes to `hash` at `at`; the entry is tracked by the result.
    pub(super) fn push(&mut self, at: Instant, hash: u64) -> Tracked {
        let generation = self.next_generation;
        self.next_generation += 1;
        self.heap.push(Reverse(Due { at, generation, hash }));
        Tracked { at, generation }
    }

    /// Pops the earliest item if it is due at `now`.
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<Due> {
        match self.heap.peek() {
            Some(Reverse(item)) if item.at <= now => self.heap.pop().map(|Reverse(item)| item),
            _ => None,
        }
    }
}

/// Which heap item is current for an entry, and the time it was pushed for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Tracked {
    pub(super) at: Instant,
    generation: u64,
}

/// A heap item: the entry whose key hashes to `hash` falls due at `at`, if that entry is still
/// tracked at `generation` (unique in the shard, so it names the entry without its key).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Due {
    at: Instant,
    generation: u64,
    pub(super) hash: u64,
}

impl Due {
    /// Whether this item is `entry`'s current one.
    pub(super) fn is_current<R, K>(&self, entry: &Entry<R, K>) -> bool {
        entry.tracked.is_some_and(|tracked| tracked.generation == self.generation)
    }
}

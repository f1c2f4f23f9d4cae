//! One shard of the table: each key's entry in its [`State`] (the states of one transfer's life),
//! and the shard's heap of due times ([`Deadlines`]).

use std::cmp::Reverse;
use std::time::Instant;

use hashbrown::HashTable;

use super::deadlines::{Deadlines, Tracked};
use super::{Epoch, FenceReason, Owner};
use crate::key::TransferKey;

/// Stale heap items a shard tolerates beyond its entry count before rebuilding its heap.
pub(super) const HEAP_SLACK: usize = 32;

/// One shard: each key's entry, and the heap of due times that `expire` pops.
pub(super) struct Shard<R, K> {
    /// Entries found by their key's hash, which each entry keeps so that neither a lookup nor a
    /// resize hashes a key again.
    pub(super) entries: HashTable<Entry<R, K>>,
    pub(super) deadlines: Deadlines,
}

impl<R, K> Default for Shard<R, K> {
    fn default() -> Self {
        Self { entries: HashTable::new(), deadlines: Deadlines::default() }
    }
}

impl<R, K> Shard<R, K> {
    /// Inserts `key` in `state`, pushing a heap item only when the state falls due before the
    /// item the entry is tracked by, and rebuilding the heap when stale items pile up.
    ///
    /// An entry whose due time moves later (a fence after a write, a later registration deadline)
    /// or goes away (in flight) keeps its item: when it pops, `expire` queues the entry again at
    /// its due time, or drops it. Most lifecycles thus push one item, not one per due time.
    pub(super) fn put(&mut self, key: StoredKey, was: Kind, state: State<R, K>) {
        let tracked = match was {
            Kind::Absent => None,
            Kind::Live(tracked) | Kind::Fence(tracked) => tracked,
        };
        let tracked = match (state.due(), tracked) {
            (Some(at), tracked) if tracked.is_none_or(|tracked| at < tracked.at) => {
                Some(self.deadlines.push(at, key.hash))
            }
            (_, tracked) => tracked,
        };
        let hash = key.hash;
        self.entries.insert_unique(hash, Entry { key, state, tracked }, |entry| entry.key.hash);
        // Rebuilding costs O(heap) but leaves at most one item per entry, so it runs at most
        // once per `entries.len() + HEAP_SLACK` pushes: O(1) amortised.
        if self.deadlines.heap.len() > 2 * self.entries.len() + HEAP_SLACK {
            self.compact();
        }
    }

    /// Drops heap items that are no longer their entry's current one.
    fn compact(&mut self) {
        let entries = &self.entries;
        self.deadlines.heap.retain(|Reverse(item)| {
            entries.find(item.hash, |entry| item.is_current(entry)).is_some()
        });
    }
}

/// A key as a shard keeps it: with its hash.
pub(super) struct StoredKey {
    pub(super) hash: u64,
    pub(super) key: TransferKey,
}

/// A key's entry: its state and the heap item that is current for it.
pub(super) struct Entry<R, K> {
    pub(super) key: StoredKey,
    pub(super) state: State<R, K>,
    /// The heap item queued for this entry, due at or before `state.due()`; `None` when none is
    /// (an entry in flight whose item has popped).
    pub(super) tracked: Option<Tracked>,
}

/// What an operation took out of a shard, to put back (changed or not) with [`Shard::put`].
pub(super) struct Taken<R, K> {
    pub(super) key: StoredKey,
    pub(super) state: State<R, K>,
    pub(super) kind: Kind,
}

/// What a key was before an operation, for keeping the counters in step.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    /// No entry (or a lapsed fence).
    Absent,
    /// A live entry and its heap item.
    Live(Option<Tracked>),
    /// A fence and its heap item.
    Fence(Option<Tracked>),
}

/// Removes `key`'s entry (hashed to `hash`) from `shard`, noting what kind of entry it was.
pub(super) fn take_entry<R, K>(
    shard: &mut Shard<R, K>,
    hash: u64,
    key: &TransferKey,
) -> Option<Taken<R, K>> {
    let found =
        shard.entries.find_entry(hash, |entry| entry.key.hash == hash && entry.key.key == *key);
    let (Entry { key, state, tracked }, _) = found.ok()?.remove();
    let kind = match state {
        State::Fenced { .. } => Kind::Fence(tracked),
        _ => Kind::Live(tracked),
    };
    Some(Taken { key, state, kind })
}

/// Where a key stands. Deadlines are kept per half so that a superseding registration replaces
/// its predecessor's deadline; an entry is due at the earliest deadline of the halves it holds.
pub(super) enum State<R, K> {
    /// D registered; P's KV is not ready yet.
    Registered { epoch: Epoch, owner: Owner, registration: R, deadline: Instant },
    /// P's KV is ready; D has not registered yet.
    Ready { ready: K, deadline: Instant },
    /// Both halves met at `epoch` and the match went out; the write has not begun.
    Matched {
        epoch: Epoch,
        owner: Owner,
        ready: K,
        ready_deadline: Instant,
        registration_deadline: Instant,
    },
    /// The write for `epoch` is under way; only `finish` ends it.
    InFlight {
        epoch: Epoch,
        /// The owner of the registration being written, and of any re-registration after it.
        owner: Owner,
        ready: K,
        ready_deadline: Instant,
        after: AfterWrite<R>,
        /// A cancel arrived during the write; it is acknowledged by `finish`.
        ack_owed: bool,
    },
    /// Layer-wise push: the writer took D's registration at `epoch` to write the layers of P's
    /// KV that are already final while P's prefill still runs, and some of those WRITEs are in
    /// flight; only `end_stream` ends this. Like a write in flight it never expires, a cancel is
    /// deferred to `end_stream` and a re-registration waits for it; P's whole KV, should it
    /// become ready meanwhile, is held and matched when the stream ends.
    Streaming {
        epoch: Epoch,
        /// The owner of the registration being written, and of any re-registration after it.
        owner: Owner,
        /// The registration's own deadline, which applies again once the stream ends.
        registration_deadline: Instant,
        /// P's whole KV and its deadline, when it became ready during the stream.
        ready: Option<(K, Instant)>,
        after: AfterWrite<R>,
        /// D's cancel arrived during the stream; it is acknowledged by `end_stream`.
        ack_owed: bool,
        /// P's abort arrived during the stream: `end_stream` ends P's send.
        aborted: bool,
    },
    /// The key ended; late arrivals are refused until `until`.
    Fenced { reason: FenceReason, until: Instant },
}

impl<R, K> State<R, K> {
    /// Who owns the registration this state holds or is writing; `None` before D registered.
    pub(super) fn owner(&self) -> Option<Owner> {
        match self {
            Self::Registered { owner, .. }
            | Self::Matched { owner, .. }
            | Self::InFlight { owner, .. }
            | Self::Streaming { owner, .. } => Some(*owner),
            Self::Ready { .. } | Self::Fenced { .. } => None,
        }
    }

    /// When `expire` should look at this entry; `None` when it never expires.
    pub(super) fn due(&self) -> Option<Instant> {
        match self {
            Self::Registered { deadline, .. } | Self::Ready { deadline, .. } => Some(*deadline),
            Self::Matched { ready_deadline, registration_deadline, .. } => {
                Some((*ready_deadline).min(*registration_deadline))
            }
            Self::InFlight { .. } | Self::Streaming { .. } => None,
            Self::Fenced { until, .. } => Some(*until),
        }
    }
}

/// What becomes of an in-flight (or streaming) entry when its write (or stream) ends.
pub(super) enum AfterWrite<R> {
    /// Nothing newer arrived: the key ends, fenced with the write's outcome.
    End,
    /// D re-registered at a higher epoch: match the kept ready payload to it.
    Rematch { epoch: Epoch, registration: R, deadline: Instant },
    /// D cancelled the whole transfer: the key ends, fenced as cancelled, and re-registrations
    /// are refused meanwhile.
    Cancelled,
}

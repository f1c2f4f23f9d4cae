//! The rendezvous table where D's registration (where to write) meets P's finished KV (what to
//! write).
//!
//! The table owns the life of one transfer key on P, from the first half to arrive until the key
//! is forgotten:
//!
//! ```text
//!  register ─► Registered ─┐                         ┌─► (finish, re-registered) Matched
//!                          ├─► Matched ─► InFlight ──┤
//!  ready ────► Ready ──────┘   begin_write   finish  └─► Fenced(delivered | failed | cancelled)
//!      cancel / expire of any state but InFlight ─────► Fenced(cancelled | expired)
//!                                      fence_ttl later ─► forgotten
//! ```
//!
//! Layer-wise push adds one loop on the registered side: the writer takes a waiting
//! registration to write the layers of P's KV that are already final while P still computes
//! the rest, and gives it back when those WRITEs are done:
//!
//! ```text
//!  Registered ─► Streaming ─► (end_stream) Registered, or Matched if P's whole KV came meanwhile,
//!   begin_stream                          or Fenced(cancelled) if D cancelled meanwhile
//! ```
//!
//! A streaming entry is held as a write in flight is: it never expires, a cancel waits for
//! `end_stream`, and a re-registration is matched (with all of P's KV) only after it.
//!
//! Whichever half arrives second gets the [`Match`], exactly once. Every registration carries an
//! [`Epoch`]: a re-registration (D preempted and retried) supersedes a lower epoch, and a stale
//! epoch is refused. A key that ended leaves a *fence* for [`TableConfig::fence_ttl`], so a half
//! that arrives late is refused at once ([`RendezvousError::Fenced`]) instead of waiting for a
//! partner that will never come.
//!
//! # Why sharded locks
//!
//! The engine thread (registrations, finished KV) and the writer thread (matches, completions)
//! both touch the table, and the engine thread must never wait behind a transfer. The table is
//! therefore *lock-light*: keys are spread over a power-of-two number of shards, each a mutex
//! around a hash map and a deadline heap; every critical section is O(1) amortised, and no I/O,
//! callback or wait ever happens under a lock. The payloads that come out ([`Match`],
//! [`Expired`], [`Cancelled::Removed`]) are acted on by the caller after the lock is released, so
//! the writer thread never holds a lock while it plans or posts a write. Two threads contend only
//! when their keys share a shard, and then only for a map operation. A lock-free map would save
//! little here and cost the simple argument that each key's state changes atomically.
//!
//! The write itself is gated by [`RendezvousTable::begin_write`]: only an entry that moved to
//! *in flight* may be written, and an in-flight entry is never expired or removed by a cancel
//! (the cancel is deferred until [`RendezvousTable::finish`]), so D never frees blocks that a
//! write may still land in.
//!
//! # Time and memory
//!
//! Callers pass time in (`now`, `deadline`); the table never reads a clock, so tests are
//! deterministic. [`RendezvousTable::expire`] pops each shard's deadline heap instead of scanning
//! its map. The heap is kept lazily: an entry whose due time moves later (a fence after a write)
//! keeps its item and is queued again when that item pops, and an item made stale (the due time
//! moved earlier, or the entry ended) carries a generation that no longer matches and is skipped.
//! A shard rebuilds its heap when stale items outnumber live ones, so memory stays proportional
//! to what the table holds: live entries are capped at [`TableConfig::max_entries`], and so are
//! fences.
//!
//! A fence lasts `fence_ttl` from when its key ended; an expired key ended at its deadline, so
//! `expire(far future)` empties the table in one call. When `max_entries` fences are held, a key
//! that ends is forgotten unfenced rather than evicting an older fence: a late half for it then
//! waits for its own deadline instead of failing fast (slower, still correct).
//!
//! # Where things are
//!
//! This file holds the values that cross the table's boundary. The operations, and the counters
//! and locking they share, are in `table.rs`; a key's states and the shard map that holds them in
//! `shard.rs`; the lazy deadline heap in `deadlines.rs`; refusals and fence reasons in
//! `errors.rs`.

mod deadlines;
mod errors;
mod shard;
mod table;
#[cfg(all(test, not(loom)))]
mod tests;

use std::time::{Duration, Instant};

use crate::key::TransferKey;

pub use errors::{FenceReason, RendezvousError};
pub use table::RendezvousTable;

/// A registration's generation: D bumps it when it re-registers a transfer (after preemption or
/// a retry), so the table can tell the current registration from a stale one.
pub type Epoch = u64;

/// Who made a registration: an authenticated peer's identity (on P, a hash of D's engine id and
/// its process-unique agent name). Only the owner may supersede or cancel its registration.
/// [`ANY_OWNER`] is the owner of every registration made through the owner-less calls.
pub type Owner = u64;

/// The owner of registrations made with [`RendezvousTable::register`]; a cancel with no owner
/// ([`RendezvousTable::cancel`]) may cancel any registration, as P's own abort does.
pub const ANY_OWNER: Owner = 0;

/// How a [`RendezvousTable`] is sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableConfig {
    /// Number of independently locked shards; rounded up to a power of two (at least 1).
    pub shards: usize,
    /// Most live (not yet ended) transfers held at once; an arrival that would create one more is
    /// refused with [`RendezvousError::TableFull`]. Fences are capped at the same number.
    pub max_entries: usize,
    /// How long an ended key keeps refusing late arrivals before it is forgotten. Zero (or a
    /// duration too large to add to an [`Instant`]) disables fences.
    pub fence_ttl: Duration,
}

impl Default for TableConfig {
    fn default() -> Self {
        Self { shards: 64, max_entries: 65_536, fence_ttl: Duration::from_secs(60) }
    }
}

/// Both halves of a transfer, handed out once: write `ready` into `registration`.
///
/// Before writing, call [`RendezvousTable::begin_write`] with `key` and `epoch`; if it refuses,
/// the match was superseded, cancelled or expired meanwhile and must be dropped unwritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match<R, K> {
    /// The transfer.
    pub key: TransferKey,
    /// The epoch of `registration`.
    pub epoch: Epoch,
    /// D's registration: where to write.
    pub registration: R,
    /// P's ready payload: what to write (a clone; the table keeps one for a re-registration).
    pub ready: K,
}

/// What an arrival ([`RendezvousTable::register`] or [`RendezvousTable::ready`]) led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival<R, K> {
    /// The arrival is held until its partner comes (or, for a re-registration during a write,
    /// until the write finishes).
    Waiting {
        /// The lower-epoch registration this one replaced before it was ever matched.
        superseded: Option<R>,
    },
    /// Both halves are present: this is the one match for this epoch.
    Matched(Match<R, K>),
}

/// What [`RendezvousTable::cancel`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled<R, K> {
    /// Nothing to cancel: the key is unknown, already ended, or the cancel's epoch is stale.
    /// No write to the cancelled registration can happen, so D may be acknowledged at once.
    NotFound,
    /// The entry was removed before any write began; the key is fenced as cancelled. Acknowledge
    /// D and free P's blocks now. A [`Match`] handed out earlier is refused by `begin_write`.
    Removed {
        /// D's registration, when it was still waiting for P (a matched one went out in the
        /// [`Match`]).
        registration: Option<R>,
        /// P's ready payload, when P had reported it.
        ready: Option<K>,
    },
    /// A write is in flight: D is acknowledged when [`RendezvousTable::finish`] reports
    /// [`Finished::cancel_acknowledged`], and not before.
    Deferred,
}

/// What [`RendezvousTable::take_ready`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeReady<K> {
    /// P's ready payload, waiting for a registration, and its deadline: the key is forgotten.
    Taken {
        /// The payload.
        ready: K,
        /// When it would have expired.
        deadline: Instant,
    },
    /// Nothing is held for the key.
    Absent,
    /// The key ended; late halves are refused for this reason.
    Fenced(FenceReason),
    /// A registration is waiting, matched or being written: left as it is.
    Busy,
}

/// How a write ended, as reported by the writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every byte landed and D was notified.
    Done,
    /// The write failed; the text says why.
    Failed(String),
}

/// What [`RendezvousTable::finish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished<R, K> {
    /// The outcome the writer reported, handed back for the caller's bookkeeping.
    pub outcome: Outcome,
    /// A cancel arrived during the write: acknowledge it to D now.
    pub cancel_acknowledged: bool,
    /// D re-registered at a higher epoch during the write: the entry is matched again and this is
    /// the new match (the write to the old blocks finished first, so no two writes race).
    pub rematch: Option<Match<R, K>>,
}

/// What [`RendezvousTable::begin_stream`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamStart<R> {
    /// D's registration at `epoch`, now held by the caller: write the final layers into it,
    /// then hand it back with [`RendezvousTable::end_stream`], once none of its WRITEs is in
    /// flight.
    Started {
        /// The registration's epoch.
        epoch: Epoch,
        /// D's registration: where to write.
        registration: R,
    },
    /// No registration waits for P's KV: none came yet, or P's whole KV met it already (its
    /// match writes every layer), or the key is streaming already.
    NotWaiting,
    /// The key ended for this reason.
    Fenced(FenceReason),
}

/// What [`RendezvousTable::end_stream`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEnded<R, K> {
    /// D's cancel arrived during the stream: acknowledge it to D now.
    pub cancel_acknowledged: bool,
    /// P's abort arrived during the stream: end P's send now (the key is cancelled).
    pub aborted: bool,
    /// What the key holds now.
    pub next: AfterStream<R, K>,
}

/// What a key holds once its stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterStream<R, K> {
    /// A registration waits for P's KV again: the streamed one (stream again as more layers
    /// become final), or a newer one that arrived during the stream (whose blocks hold none of
    /// the layers written, and which takes the streamed one's place; see `superseded`).
    Waiting {
        /// The streamed registration, when a newer one replaced it: drop it unwritten.
        superseded: Option<R>,
    },
    /// P's whole KV became ready during the stream: the match to write. Its registration is the
    /// streamed one, or a newer one (whose blocks hold none of the layers written).
    Matched {
        /// The match.
        matched: Match<R, K>,
        /// The streamed registration, when a newer one replaced it: drop it unwritten.
        superseded: Option<R>,
    },
    /// D cancelled the transfer during the stream; the key is fenced as cancelled. The streamed
    /// registration comes back, to be dropped unwritten, with P's KV if it became ready.
    Cancelled {
        /// The streamed registration.
        registration: R,
        /// P's ready payload, when P reported it during the stream: free those blocks.
        ready: Option<K>,
    },
}

/// An entry that [`RendezvousTable::expire`] removed because its deadline passed before any
/// write began. The key is fenced as expired, for `fence_ttl` from that deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired<R, K> {
    /// The transfer.
    pub key: TransferKey,
    /// D's registration, when it was still waiting for P: send it a failure.
    pub registration: Option<(Epoch, R)>,
    /// P's ready payload, when P had reported it: free those blocks.
    pub ready: Option<K>,
    /// The entry had been matched: the registration went out in a [`Match`], whose holder learns
    /// of the expiry from `begin_write` and reports it to D (or, from [`RendezvousTable::drain`],
    /// in a stream, whose holder reports it).
    pub was_matched: bool,
}

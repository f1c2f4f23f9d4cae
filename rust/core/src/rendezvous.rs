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

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use hashbrown::HashTable;

use crate::key::TransferKey;
use crate::sync::{lock, AtomicUsize, CachePadded, Mutex, MutexGuard, Ordering};

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
    /// of the expiry from `begin_write` and reports it to D.
    pub was_matched: bool,
}

/// Why a key is fenced (refusing late arrivals until the fence lapses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FenceReason {
    /// The KV was written.
    Delivered,
    /// The write failed.
    Failed,
    /// The transfer was cancelled.
    Cancelled,
    /// A deadline passed before the write began.
    Expired,
}

impl fmt::Display for FenceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Delivered => "already delivered",
            Self::Failed => "already failed",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired before it could be written",
        })
    }
}

/// Why the table refused an operation. Payloads passed to a refused call are dropped; keep what a
/// reply needs (the error carries the key and epochs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// A registration's epoch is not above the one the table holds.
    #[error(
        "registration for transfer {key} epoch {epoch} refused: epoch {current} is current; \
         re-register with a higher epoch"
    )]
    StaleEpoch {
        /// The transfer.
        key: TransferKey,
        /// The refused epoch.
        epoch: Epoch,
        /// The epoch the table holds.
        current: Epoch,
    },
    /// P reported its KV ready twice for one transfer.
    #[error(
        "ready KV for transfer {key} refused: P already reported this transfer ready; \
         report each transfer once"
    )]
    DuplicateReady {
        /// The transfer.
        key: TransferKey,
    },
    /// The key ended recently; late halves are refused so they fail now rather than time out.
    #[error("transfer {key} refused: it was {reason}; start a new transfer with a new id")]
    Fenced {
        /// The transfer.
        key: TransferKey,
        /// How it ended.
        reason: FenceReason,
    },
    /// The table holds `capacity` live transfers already.
    #[error(
        "transfer {key} refused: the rendezvous table is full ({capacity} transfers waiting); \
         retry later or raise max_entries"
    )]
    TableFull {
        /// The transfer.
        key: TransferKey,
        /// The configured `max_entries`.
        capacity: usize,
    },
    /// Another peer owns the registration for this key: only its owner may supersede it.
    #[error(
        "registration for transfer {key} refused: another peer registered this transfer; a \
         registration belongs to the peer that made it"
    )]
    Foreign {
        /// The transfer.
        key: TransferKey,
    },
    /// `begin_write` or `finish` named an epoch that is not the matched (or in-flight) one.
    #[error(
        "transfer {key} epoch {epoch} is not matched or in flight (superseded by a \
         re-registration, not yet matched, or already begun); drop this match without writing"
    )]
    NotMatched {
        /// The transfer.
        key: TransferKey,
        /// The epoch named.
        epoch: Epoch,
    },
}

impl RendezvousError {
    /// A stable snake_case name of the refusal, for metrics and logs.
    pub fn code(&self) -> &'static str {
        match self {
            Self::StaleEpoch { .. } => "stale_epoch",
            Self::DuplicateReady { .. } => "duplicate_ready",
            Self::Fenced { .. } => "fenced",
            Self::TableFull { .. } => "table_full",
            Self::NotMatched { .. } => "not_matched",
            Self::Foreign { .. } => "foreign",
        }
    }

    /// The transfer the refusal concerns.
    pub fn key(&self) -> &TransferKey {
        match self {
            Self::StaleEpoch { key, .. }
            | Self::DuplicateReady { key }
            | Self::Fenced { key, .. }
            | Self::TableFull { key, .. }
            | Self::NotMatched { key, .. }
            | Self::Foreign { key } => key,
        }
    }
}

/// How keys are hashed. Keys come from peers and, through request ids, from clients, so the
/// hash is SipHash with per-table random keys (std's `RandomState`): nobody can aim keys at one
/// shard or one bucket chain. Under loom the keys are fixed, because a model must replay the
/// same execution (and so pick the same shards) on every run.
#[cfg(not(loom))]
type KeyHasher = std::hash::RandomState;
#[cfg(loom)]
type KeyHasher = std::hash::BuildHasherDefault<std::hash::DefaultHasher>;

/// A shard behind its lock, alone on its cache line so that threads in different shards share no
/// line.
type LockedShard<R, K> = CachePadded<Mutex<Shard<R, K>>>;

/// Keys, their states and deadlines, sharded; see the module docs.
///
/// `R` is D's registration and `K` P's ready payload. `K` is cloned under a shard lock (once per
/// match), so make it cheap to clone, e.g. an `Arc<[u32]>` of block ids.
pub struct RendezvousTable<R, K> {
    shards: Box<[LockedShard<R, K>]>,
    /// Hashes keys for both the shard and the lookup in it; keyed (see [`KeyHasher`]).
    hasher: KeyHasher,
    /// `shards.len() - 1`; the length is a power of two.
    shard_mask: usize,
    max_entries: usize,
    fence_ttl: Duration,
    /// Live (non-fence) entries over all shards. Changed only under the lock of the shard that
    /// gains or loses the entry, so it never undercounts what the maps hold. Written by every
    /// thread, so kept off the line of the fields above, which every operation reads.
    live: CachePadded<AtomicUsize>,
    /// Fences over all shards, maintained like `live`.
    fences: CachePadded<AtomicUsize>,
}

impl<R, K> fmt::Debug for RendezvousTable<R, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RendezvousTable")
            .field("shards", &self.shards.len())
            .field("max_entries", &self.max_entries)
            .field("fence_ttl", &self.fence_ttl)
            // Relaxed: statistics, as in `len`.
            .field("live", &self.live.load(Ordering::Relaxed))
            .field("fences", &self.fences.load(Ordering::Relaxed))
            .finish()
    }
}

/// Most heap items `expire` pops per lock acquisition, so that a burst of expiries never holds
/// one shard's lock for long.
const EXPIRE_BATCH: usize = 64;

/// Stale heap items a shard tolerates beyond its entry count before rebuilding its heap.
const HEAP_SLACK: usize = 32;

impl<R: Send, K: Clone + Send> RendezvousTable<R, K> {
    /// An empty table. `config.shards` is rounded up to a power of two.
    pub fn new(config: TableConfig) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        Self {
            shards: (0..shards).map(|_| CachePadded(Mutex::new(Shard::default()))).collect(),
            hasher: KeyHasher::default(),
            shard_mask: shards - 1,
            max_entries: config.max_entries,
            fence_ttl: config.fence_ttl,
            live: CachePadded(AtomicUsize::new(0)),
            fences: CachePadded(AtomicUsize::new(0)),
        }
    }

    /// D's registration for `key` arrives: where to write, valid until `deadline`.
    ///
    /// Returns [`Arrival::Matched`] when P's KV is already ready (or when this re-registration
    /// supersedes a match not yet begun), else [`Arrival::Waiting`]. During a write, a higher
    /// epoch waits for [`finish`](Self::finish), which hands out its match.
    pub fn register(
        &self,
        key: TransferKey,
        epoch: Epoch,
        registration: R,
        deadline: Instant,
        now: Instant,
    ) -> Result<Arrival<R, K>, RendezvousError> {
        self.register_owned(key, epoch, ANY_OWNER, registration, deadline, now)
    }

    /// [`register`](Self::register) on behalf of `owner`: the registration belongs to it, and a
    /// registration of the same key by another owner is refused with
    /// [`RendezvousError::Foreign`] whatever its epoch (only P's ready half is shared).
    pub fn register_owned(
        &self,
        key: TransferKey,
        epoch: Epoch,
        owner: Owner,
        registration: R,
        deadline: Instant,
        now: Instant,
    ) -> Result<Arrival<R, K>, RendezvousError> {
        let (hash, mut shard) = self.shard(&key);
        let Some(taken) = self.take(&mut shard, hash, &key, now) else {
            let state = State::Registered { epoch, owner, registration, deadline };
            self.admit(&mut shard, hash, key, state)?;
            return Ok(Arrival::Waiting { superseded: None });
        };
        if taken.state.owner().is_some_and(|holder| holder != owner) {
            self.settle(&mut shard, taken.key, taken.kind, taken.state, now);
            return Err(RendezvousError::Foreign { key });
        }
        let stale = |current| Err(RendezvousError::StaleEpoch { key: key.clone(), epoch, current });
        let (state, result) = match taken.state {
            State::Registered {
                epoch: current,
                owner,
                registration: old,
                deadline: old_deadline,
            } => {
                if epoch > current {
                    let superseded = Some(old);
                    (
                        State::Registered { epoch, owner, registration, deadline },
                        Ok(Arrival::Waiting { superseded }),
                    )
                } else {
                    (
                        State::Registered {
                            epoch: current,
                            owner,
                            registration: old,
                            deadline: old_deadline,
                        },
                        stale(current),
                    )
                }
            }
            State::Ready { ready, deadline: ready_deadline } => {
                let matched = Match { key: key.clone(), epoch, registration, ready: ready.clone() };
                let state = State::Matched {
                    epoch,
                    owner,
                    ready,
                    ready_deadline,
                    registration_deadline: deadline,
                };
                (state, Ok(Arrival::Matched(matched)))
            }
            State::Matched {
                epoch: current,
                owner,
                ready,
                ready_deadline,
                registration_deadline,
            } => {
                if epoch > current {
                    // The old match's holder has not begun (the entry would be in flight), so
                    // re-matching now cannot race a write; its begin_write will be refused.
                    let matched =
                        Match { key: key.clone(), epoch, registration, ready: ready.clone() };
                    let state = State::Matched {
                        epoch,
                        owner,
                        ready,
                        ready_deadline,
                        registration_deadline: deadline,
                    };
                    (state, Ok(Arrival::Matched(matched)))
                } else {
                    let state = State::Matched {
                        epoch: current,
                        owner,
                        ready,
                        ready_deadline,
                        registration_deadline,
                    };
                    (state, stale(current))
                }
            }
            State::InFlight { epoch: writing, owner, ready, ready_deadline, after, ack_owed } => {
                let (after, result) = match after {
                    AfterWrite::Cancelled => {
                        let reason = FenceReason::Cancelled;
                        (
                            AfterWrite::Cancelled,
                            Err(RendezvousError::Fenced { key: key.clone(), reason }),
                        )
                    }
                    AfterWrite::End if epoch > writing => {
                        let after = AfterWrite::Rematch { epoch, registration, deadline };
                        (after, Ok(Arrival::Waiting { superseded: None }))
                    }
                    AfterWrite::End => (AfterWrite::End, stale(writing)),
                    AfterWrite::Rematch {
                        epoch: current,
                        registration: old,
                        deadline: old_deadline,
                    } => {
                        if epoch > current {
                            let after = AfterWrite::Rematch { epoch, registration, deadline };
                            (after, Ok(Arrival::Waiting { superseded: Some(old) }))
                        } else {
                            let after = AfterWrite::Rematch {
                                epoch: current,
                                registration: old,
                                deadline: old_deadline,
                            };
                            (after, stale(current))
                        }
                    }
                };
                let state = State::InFlight {
                    epoch: writing,
                    owner,
                    ready,
                    ready_deadline,
                    after,
                    ack_owed,
                };
                (state, result)
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        result
    }

    /// P's KV for `key` is ready: what to write, held until `deadline`.
    ///
    /// Returns [`Arrival::Matched`] when D has registered, else [`Arrival::Waiting`]. The table
    /// keeps a clone of `ready` until the key ends, to match a re-registration.
    pub fn ready(
        &self,
        key: TransferKey,
        ready: K,
        deadline: Instant,
        now: Instant,
    ) -> Result<Arrival<R, K>, RendezvousError> {
        let (hash, mut shard) = self.shard(&key);
        let Some(taken) = self.take(&mut shard, hash, &key, now) else {
            self.admit(&mut shard, hash, key, State::Ready { ready, deadline })?;
            return Ok(Arrival::Waiting { superseded: None });
        };
        let (state, result) = match taken.state {
            State::Registered { epoch, owner, registration, deadline: registration_deadline } => {
                let matched = Match { key: key.clone(), epoch, registration, ready: ready.clone() };
                let state = State::Matched {
                    epoch,
                    owner,
                    ready,
                    ready_deadline: deadline,
                    registration_deadline,
                };
                (state, Ok(Arrival::Matched(matched)))
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
            state @ (State::Ready { .. } | State::Matched { .. } | State::InFlight { .. }) => {
                (state, Err(RendezvousError::DuplicateReady { key: key.clone() }))
            }
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        result
    }

    /// Takes P's ready payload for `key` out of the table when nothing else holds the key yet
    /// (no registration came), so that the caller can place it under other keys: P's KV for a
    /// transfer that one P rank writes into several D ranks goes under each D rank's slot key.
    pub fn take_ready(&self, key: &TransferKey, now: Instant) -> TakeReady<K> {
        let (hash, mut shard) = self.shard(key);
        let Some(taken) = self.take(&mut shard, hash, key, now) else { return TakeReady::Absent };
        match taken.state {
            State::Ready { ready, deadline } => {
                // Relaxed: see `settle`. The entry's heap item, if any, is now stale.
                self.live.fetch_sub(1, Ordering::Relaxed);
                TakeReady::Taken { ready, deadline }
            }
            state => {
                let found = match &state {
                    State::Fenced { reason, .. } => TakeReady::Fenced(*reason),
                    _ => TakeReady::Busy,
                };
                self.settle(&mut shard, taken.key, taken.kind, state, now);
                found
            }
        }
    }

    /// The writer is about to write the match for `key` at `epoch`.
    ///
    /// On success the entry is in flight: it no longer expires, a cancel is deferred until
    /// [`finish`](Self::finish), and a re-registration waits for it. On error, drop the match
    /// without writing; [`RendezvousError::Fenced`] says how the transfer ended.
    pub fn begin_write(&self, key: &TransferKey, epoch: Epoch) -> Result<(), RendezvousError> {
        let (hash, mut shard) = self.shard(key);
        // Without `now`, a fence that has lapsed but not yet been collected still refuses, which
        // errs on the side of not writing.
        let Some(taken) = take_entry(&mut shard, hash, key) else {
            return Err(RendezvousError::NotMatched { key: key.clone(), epoch });
        };
        let (state, result) = match taken.state {
            State::Matched { epoch: matched, owner, ready, ready_deadline, .. }
                if matched == epoch =>
            {
                let after = AfterWrite::End;
                let state =
                    State::InFlight { epoch, owner, ready, ready_deadline, after, ack_owed: false };
                (state, Ok(()))
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
            state => (state, Err(RendezvousError::NotMatched { key: key.clone(), epoch })),
        };
        // Only live-to-live or fence-to-fence here, so no counter changes and no `now` needed.
        shard.put(taken.key, taken.kind, state);
        result
    }

    /// The write for `key` at `epoch` ended with `outcome`.
    ///
    /// The key ends (fenced as delivered, failed, or cancelled when a cancel covered the whole
    /// transfer) unless D re-registered during the write, in which case the entry is matched again
    /// and [`Finished::rematch`] carries the new match, whatever this write's outcome.
    pub fn finish(
        &self,
        key: &TransferKey,
        epoch: Epoch,
        outcome: Outcome,
        now: Instant,
    ) -> Result<Finished<R, K>, RendezvousError> {
        let (hash, mut shard) = self.shard(key);
        let Some(taken) = self.take(&mut shard, hash, key, now) else {
            return Err(RendezvousError::NotMatched { key: key.clone(), epoch });
        };
        let (state, result) = match taken.state {
            State::InFlight { epoch: writing, owner, ready, ready_deadline, after, ack_owed }
                if writing == epoch =>
            {
                let (state, rematch) = match after {
                    AfterWrite::Rematch { epoch, registration, deadline } => {
                        let rematch =
                            Match { key: key.clone(), epoch, registration, ready: ready.clone() };
                        // Deadlines that ran out during the write (which nothing expires) end
                        // the rematch at the next `expire`, and its fence then lasts from now,
                        // not from a deadline that may be older than `fence_ttl`.
                        let state = State::Matched {
                            epoch,
                            owner,
                            ready,
                            ready_deadline: ready_deadline.max(now),
                            registration_deadline: deadline.max(now),
                        };
                        (state, Some(rematch))
                    }
                    AfterWrite::End | AfterWrite::Cancelled => {
                        let reason = match (&after, &outcome) {
                            (AfterWrite::Cancelled, _) => FenceReason::Cancelled,
                            (_, Outcome::Done) => FenceReason::Delivered,
                            (_, Outcome::Failed(_)) => FenceReason::Failed,
                        };
                        (self.fence_from(reason, now), None)
                    }
                };
                (state, Ok(Finished { outcome, cancel_acknowledged: ack_owed, rematch }))
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
            state => (state, Err(RendezvousError::NotMatched { key: key.clone(), epoch })),
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        result
    }

    /// D cancels `key`: its registration at `epoch`, or whatever epoch with `None`.
    ///
    /// A cancel whose epoch is at least the table's registration epoch (or `None`) cancels the
    /// transfer. A lower epoch is stale and a no-op ([`Cancelled::NotFound`]) unless a write to
    /// exactly that epoch is in flight: then the answer is [`Cancelled::Deferred`] (D's blocks are
    /// still being written) and the newer registration is still matched when the write finishes.
    ///
    /// An unknown key is fenced as cancelled, so that a half arriving later (P aborted before D
    /// registered) is refused at once.
    pub fn cancel(&self, key: &TransferKey, epoch: Option<Epoch>, now: Instant) -> Cancelled<R, K> {
        self.cancel_owned(key, epoch, None, now)
    }

    /// [`cancel`](Self::cancel) on behalf of `owner` (`None`: P itself, which may cancel
    /// anything). An owner may cancel only its own registration: a key another owner registered,
    /// or that only P's ready half holds, is left alone and reported [`Cancelled::NotFound`];
    /// and an unknown key is not fenced, so that no peer can fence keys it never registered.
    pub fn cancel_owned(
        &self,
        key: &TransferKey,
        epoch: Option<Epoch>,
        owner: Option<Owner>,
        now: Instant,
    ) -> Cancelled<R, K> {
        let covers = |current: Epoch| epoch.is_none_or(|epoch| epoch >= current);
        let (hash, mut shard) = self.shard(key);
        let Some(taken) = self.take(&mut shard, hash, key, now) else {
            if owner.is_none() {
                let fence = self.fence_from(FenceReason::Cancelled, now);
                let stored = StoredKey { hash, key: key.clone() };
                self.settle(&mut shard, stored, Kind::Absent, fence, now);
            }
            return Cancelled::NotFound;
        };
        let foreign = owner.is_some_and(|owner| match taken.state.owner() {
            Some(holder) => holder != owner,
            // Only P's ready half (or a fence): nothing of the peer's to cancel.
            None => !matches!(taken.state, State::Fenced { .. }),
        });
        if foreign {
            self.settle(&mut shard, taken.key, taken.kind, taken.state, now);
            return Cancelled::NotFound;
        }
        let (state, result) = match taken.state {
            State::Registered { epoch, registration, .. } if covers(epoch) => {
                let removed = Cancelled::Removed { registration: Some(registration), ready: None };
                (self.fence_from(FenceReason::Cancelled, now), removed)
            }
            State::Ready { ready, .. } => {
                let removed = Cancelled::Removed { registration: None, ready: Some(ready) };
                (self.fence_from(FenceReason::Cancelled, now), removed)
            }
            State::Matched { epoch, ready, .. } if covers(epoch) => {
                let removed = Cancelled::Removed { registration: None, ready: Some(ready) };
                (self.fence_from(FenceReason::Cancelled, now), removed)
            }
            State::InFlight { epoch: writing, owner, ready, ready_deadline, after, ack_owed } => {
                let current = match &after {
                    AfterWrite::Rematch { epoch, .. } => *epoch,
                    AfterWrite::End | AfterWrite::Cancelled => writing,
                };
                let already_cancelled = matches!(after, AfterWrite::Cancelled);
                let (after, ack_owed, result) = if already_cancelled || covers(current) {
                    // The whole transfer ends; a waiting re-registration is covered by the one
                    // acknowledgement D gets at finish, so it is dropped.
                    (AfterWrite::Cancelled, true, Cancelled::Deferred)
                } else if epoch == Some(writing) {
                    (after, true, Cancelled::Deferred)
                } else {
                    (after, ack_owed, Cancelled::NotFound)
                };
                let state = State::InFlight {
                    epoch: writing,
                    owner,
                    ready,
                    ready_deadline,
                    after,
                    ack_owed,
                };
                (state, result)
            }
            // A stale cancel (its registration was superseded and never written) or a fence.
            state => (state, Cancelled::NotFound),
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        result
    }

    /// Ends every waiting or matched (not begun) entry whose deadline is at or before `now`, and
    /// forgets fences that have lapsed. Returns the ended entries, whose halves the caller fails
    /// (D) or frees (P). In-flight entries never expire here: the writer owns the write's timeout
    /// and must call [`finish`](Self::finish).
    ///
    /// Work is proportional to the heap items that fell due (never a scan of the map), popped a
    /// bounded batch per lock acquisition so that arrivals are not held up behind a long sweep.
    pub fn expire(&self, now: Instant) -> Vec<Expired<R, K>> {
        let mut expired = Vec::new();
        for shard in self.shards.iter() {
            while self.expire_batch(&mut lock(shard), now, &mut expired) {}
        }
        expired
    }

    /// Ends every registration for which `lost` holds (its peer is gone, so nothing may be
    /// written to it): a waiting one is removed and its key fenced as cancelled, and one waiting
    /// for a write in flight is dropped, so that write ends the key. Returns what was removed.
    ///
    /// A matched entry whose write has not begun is left to its holder, whose `begin_write`
    /// still succeeds: the writer checks the peer before it posts. Scans every shard, holding
    /// one shard's lock at a time; a peer's loss is rare and the table is bounded.
    pub fn purge(&self, lost: impl Fn(&R) -> bool, now: Instant) -> Vec<(TransferKey, Epoch, R)> {
        let mut purged = Vec::new();
        let select = |state: &State<R, K>| match state {
            State::Registered { registration, .. }
            | State::InFlight { after: AfterWrite::Rematch { registration, .. }, .. } => {
                lost(registration)
            }
            _ => false,
        };
        self.rewrite_where(now, select, |key, state| match state {
            State::Registered { epoch, registration, .. } => {
                purged.push((key.clone(), epoch, registration));
                self.fence_from(FenceReason::Cancelled, now)
            }
            State::InFlight {
                epoch: writing,
                owner,
                ready,
                ready_deadline,
                after: AfterWrite::Rematch { epoch, registration, .. },
                ack_owed,
            } => {
                purged.push((key.clone(), epoch, registration));
                let after = AfterWrite::End;
                State::InFlight { epoch: writing, owner, ready, ready_deadline, after, ack_owed }
            }
            state => state,
        });
        purged
    }

    /// Ends every live entry, writes in flight included (their writer is gone): for when the
    /// writer itself stopped. Each key is fenced as failed; returns what each entry held, as
    /// [`expire`](Self::expire) does, so that D can be told and P's blocks freed.
    pub fn drain(&self, now: Instant) -> Vec<Expired<R, K>> {
        let mut drained = Vec::new();
        let live = |state: &State<R, K>| !matches!(state, State::Fenced { .. });
        self.rewrite_where(now, live, |key, state| {
            let (registration, ready, was_matched) = match state {
                State::Registered { epoch, registration, .. } => {
                    (Some((epoch, registration)), None, false)
                }
                State::Ready { ready, .. } => (None, Some(ready), false),
                State::Matched { ready, .. } | State::InFlight { ready, .. } => {
                    (None, Some(ready), true)
                }
                fence @ State::Fenced { .. } => return fence,
            };
            drained.push(Expired { key: key.clone(), registration, ready, was_matched });
            self.fence_from(FenceReason::Failed, now)
        });
        drained
    }

    /// Takes out every entry, in every shard, whose state `select` picks, and puts back the
    /// state `rewrite` makes of it (one shard's lock at a time): the scans behind
    /// [`purge`](Self::purge) and [`drain`](Self::drain).
    fn rewrite_where(
        &self,
        now: Instant,
        select: impl Fn(&State<R, K>) -> bool,
        mut rewrite: impl FnMut(&TransferKey, State<R, K>) -> State<R, K>,
    ) {
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let chosen: Vec<(u64, TransferKey)> = shard
                .entries
                .iter()
                .filter(|entry| select(&entry.state))
                .map(|entry| (entry.key.hash, entry.key.key.clone()))
                .collect();
            for (hash, key) in chosen {
                let Some(taken) = take_entry(&mut shard, hash, &key) else { continue };
                let state = rewrite(&key, taken.state);
                self.settle(&mut shard, taken.key, taken.kind, state, now);
            }
        }
    }

    /// Whether `key` has a live entry (a half, a match or a write in flight; not a fence).
    pub fn is_live(&self, key: &TransferKey) -> bool {
        let (hash, shard) = self.shard(key);
        shard
            .entries
            .find(hash, |entry| entry.key.hash == hash && entry.key.key == *key)
            .is_some_and(|entry| !matches!(entry.state, State::Fenced { .. }))
    }

    /// Fences `key` as `reason` if the table holds nothing for it (a lapsed fence counts as
    /// nothing); true if it did. For a key whose halves went elsewhere: P's KV for a transfer
    /// written into several D ranks, whose every slot ended before the KV was ready.
    pub fn fence_vacant(&self, key: &TransferKey, reason: FenceReason, now: Instant) -> bool {
        let (hash, mut shard) = self.shard(key);
        if let Some(taken) = self.take(&mut shard, hash, key, now) {
            self.settle(&mut shard, taken.key, taken.kind, taken.state, now);
            return false;
        }
        let fence = self.fence_from(reason, now);
        let stored = StoredKey { hash, key: key.clone() };
        self.settle(&mut shard, stored, Kind::Absent, fence, now);
        true
    }

    /// Whether `owner`'s registration of `key` at `epoch` is live: waiting for P's KV, matched,
    /// being written, or waiting for the write in flight to finish. A registration that repeats
    /// it is a duplicate: it needs neither a place in the table nor a reply.
    pub fn holds(&self, key: &TransferKey, epoch: Epoch, owner: Owner) -> bool {
        let (hash, shard) = self.shard(key);
        let Some(entry) =
            shard.entries.find(hash, |entry| entry.key.hash == hash && entry.key.key == *key)
        else {
            return false;
        };
        match &entry.state {
            State::Registered { epoch: held, owner: holder, .. }
            | State::Matched { epoch: held, owner: holder, .. } => {
                *held == epoch && *holder == owner
            }
            State::InFlight { epoch: writing, owner: holder, after, .. } => {
                let waiting =
                    matches!(after, AfterWrite::Rematch { epoch: next, .. } if *next == epoch);
                *holder == owner && (*writing == epoch || waiting)
            }
            State::Ready { .. } | State::Fenced { .. } => false,
        }
    }

    /// Live (not ended) entries, fences excluded.
    pub fn len(&self) -> usize {
        // Relaxed: a statistic; it publishes nothing and nothing is read on the strength of it.
        self.live.load(Ordering::Relaxed)
    }

    /// Whether no live entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fences currently held (ended keys that still refuse late arrivals).
    pub fn fences(&self) -> usize {
        // Relaxed: a statistic, like `len`.
        self.fences.load(Ordering::Relaxed)
    }

    /// Deadline-heap items over all shards, stale ones included: shows that the lazily cleaned
    /// heaps stay bounded by what the table holds.
    pub fn tracked_deadlines(&self) -> usize {
        self.shards.iter().map(|shard| lock(shard).deadlines.heap.len()).sum()
    }

    /// Hashes `key` once, for both the shard and the lookup in it, and locks its shard.
    fn shard(&self, key: &TransferKey) -> (u64, MutexGuard<'_, Shard<R, K>>) {
        // The key's bytes alone: `str`'s `Hash` also writes a terminator, which only matters when
        // hashing several fields into one hash.
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key.as_str().as_bytes());
        let hash = hasher.finish();
        // The map inside a shard indexes buckets by the low bits and tags them with the top 7,
        // so the shard takes bits from the middle: keys of one shard still spread over its map.
        // Truncating is intended: only `shard_mask`'s bits are kept.
        let index = (hash >> SHARD_HASH_SHIFT) as usize & self.shard_mask;
        (hash, lock(&self.shards[index]))
    }

    /// Removes `key`'s entry for an operation that will [`settle`](Self::settle) it again; a
    /// fence that has lapsed by `now` is dropped and reported as absent.
    fn take(
        &self,
        shard: &mut Shard<R, K>,
        hash: u64,
        key: &TransferKey,
        now: Instant,
    ) -> Option<Taken<R, K>> {
        let taken = take_entry(shard, hash, key)?;
        match taken.state {
            State::Fenced { until, .. } if until <= now => {
                // Relaxed: a counter changed under the shard lock; see `settle`.
                self.fences.fetch_sub(1, Ordering::Relaxed);
                None
            }
            _ => Some(taken),
        }
    }

    /// Inserts a new live entry if `max_entries` allows it.
    fn admit(
        &self,
        shard: &mut Shard<R, K>,
        hash: u64,
        key: TransferKey,
        state: State<R, K>,
    ) -> Result<(), RendezvousError> {
        if !reserve(&self.live, self.max_entries) {
            return Err(RendezvousError::TableFull { key, capacity: self.max_entries });
        }
        shard.put(StoredKey { hash, key }, Kind::Live(None), state);
        Ok(())
    }

    /// A fence for a key ending at `at`.
    fn fence_from(&self, reason: FenceReason, at: Instant) -> State<R, K> {
        // `None` (overflow) leaves `until` at `at`, which `settle` treats as already lapsed.
        let until = at.checked_add(self.fence_ttl).unwrap_or(at);
        State::Fenced { reason, until }
    }

    /// Puts a taken entry back in its new `state`, keeping the live and fence counters in step
    /// with the maps. A live entry that becomes a fence gives up its live slot and takes a fence
    /// slot; when all `max_entries` fence slots are taken (or the fence has lapsed by `now`), the
    /// key is forgotten without a fence: a late half then waits for its deadline instead of
    /// failing fast, which is slower but still correct, and keeps fences bounded.
    fn settle(
        &self,
        shard: &mut Shard<R, K>,
        key: StoredKey,
        was: Kind,
        state: State<R, K>,
        now: Instant,
    ) {
        // Relaxed on both counters: each is only a quota and a statistic. The entries themselves
        // are published by the shard mutex, and the read-modify-write in `reserve` alone keeps
        // the quota exact, so there is no other memory for an ordering to pair with.
        if let State::Fenced { until, .. } = state {
            if let Kind::Live(_) = was {
                self.live.fetch_sub(1, Ordering::Relaxed);
            }
            let is_new_fence = !matches!(was, Kind::Fence(_));
            if is_new_fence && (until <= now || !reserve(&self.fences, self.max_entries)) {
                return;
            }
        }
        shard.put(key, was, state);
    }

    /// Pops up to [`EXPIRE_BATCH`] due heap items of one shard; whether more may be due.
    fn expire_batch(
        &self,
        shard: &mut Shard<R, K>,
        now: Instant,
        expired: &mut Vec<Expired<R, K>>,
    ) -> bool {
        for _ in 0..EXPIRE_BATCH {
            let Some(item) = shard.deadlines.pop_due(now) else { return false };
            let Ok(current) = shard.entries.find_entry(item.hash, |entry| item.is_current(entry))
            else {
                // A stale item: the entry's due time moved earlier (or it ended) since this item
                // was pushed.
                continue;
            };
            let ended = match current.get().state.due() {
                Some(at) if at <= now => at,
                due => {
                    // Due later than this item (its due time moved on without a push; see
                    // `Shard::put`), or in flight: queue it at its due time, or not at all.
                    current.into_mut().tracked = due.map(|at| shard.deadlines.push(at, item.hash));
                    continue;
                }
            };
            // The entry's item is the one just popped: what it becomes is tracked afresh.
            let (Entry { key, state, .. }, _) = current.remove();
            let (registration, ready, was_matched) = match state {
                State::Fenced { .. } => {
                    // Relaxed: a counter changed under the shard lock; see `settle`.
                    self.fences.fetch_sub(1, Ordering::Relaxed);
                    continue;
                }
                State::Registered { epoch, registration, .. } => {
                    (Some((epoch, registration)), None, false)
                }
                State::Ready { ready, .. } => (None, Some(ready), false),
                State::Matched { ready, .. } => (None, Some(ready), true),
                state @ State::InFlight { .. } => {
                    // Never due, so never here; put it back should that change rather than
                    // expire a write.
                    shard.put(key, Kind::Live(None), state);
                    continue;
                }
            };
            // The key ended at its deadline, not when this call noticed: the fence lapses
            // `fence_ttl` after it.
            let fence = self.fence_from(FenceReason::Expired, ended);
            let transfer = key.key.clone();
            self.settle(shard, key, Kind::Live(None), fence, now);
            expired.push(Expired { key: transfer, registration, ready, was_matched });
        }
        true
    }
}

/// Bits of a key's hash below the ones that choose its shard; see [`RendezvousTable::shard`].
const SHARD_HASH_SHIFT: u32 = 32;

/// Takes one slot of `counter` if it is below `capacity`.
fn reserve(counter: &AtomicUsize, capacity: usize) -> bool {
    // Relaxed: see `settle`; the update closure may rerun, but the final compare-exchange makes
    // the check and the increment one atomic step, so concurrent shards never exceed `capacity`.
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < capacity).then_some(n + 1))
        .is_ok()
}

/// Removes `key`'s entry (hashed to `hash`) from `shard`, noting what kind of entry it was.
fn take_entry<R, K>(shard: &mut Shard<R, K>, hash: u64, key: &TransferKey) -> Option<Taken<R, K>> {
    let found =
        shard.entries.find_entry(hash, |entry| entry.key.hash == hash && entry.key.key == *key);
    let (Entry { key, state, tracked }, _) = found.ok()?.remove();
    let kind = match state {
        State::Fenced { .. } => Kind::Fence(tracked),
        _ => Kind::Live(tracked),
    };
    Some(Taken { key, state, kind })
}

/// One shard: each key's entry, and the heap of due times that `expire` pops.
struct Shard<R, K> {
    /// Entries found by their key's hash, which each entry keeps so that neither a lookup nor a
    /// resize hashes a key again.
    entries: HashTable<Entry<R, K>>,
    deadlines: Deadlines,
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
    fn put(&mut self, key: StoredKey, was: Kind, state: State<R, K>) {
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

/// A shard's heap of due times, earliest first. Holds at most one current item per entry, plus
/// stale ones that are skipped when popped and dropped by [`Shard::compact`].
#[derive(Default)]
struct Deadlines {
    heap: BinaryHeap<Reverse<Due>>,
    /// Source of heap-item generations; unique within the shard.
    next_generation: u64,
}

impl Deadlines {
    /// Queues the entry whose key hashes to `hash` at `at`; the entry is tracked by the result.
    fn push(&mut self, at: Instant, hash: u64) -> Tracked {
        let generation = self.next_generation;
        self.next_generation += 1;
        self.heap.push(Reverse(Due { at, generation, hash }));
        Tracked { at, generation }
    }

    /// Pops the earliest item if it is due at `now`.
    fn pop_due(&mut self, now: Instant) -> Option<Due> {
        match self.heap.peek() {
            Some(Reverse(item)) if item.at <= now => self.heap.pop().map(|Reverse(item)| item),
            _ => None,
        }
    }
}

/// A key as a shard keeps it: with its hash.
struct StoredKey {
    hash: u64,
    key: TransferKey,
}

/// A key's entry: its state and the heap item that is current for it.
struct Entry<R, K> {
    key: StoredKey,
    state: State<R, K>,
    /// The heap item queued for this entry, due at or before `state.due()`; `None` when none is
    /// (an entry in flight whose item has popped).
    tracked: Option<Tracked>,
}

/// Which heap item is current for an entry, and the time it was pushed for.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Tracked {
    at: Instant,
    generation: u64,
}

/// A heap item: the entry whose key hashes to `hash` falls due at `at`, if that entry is still
/// tracked at `generation` (unique in the shard, so it names the entry without its key).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Due {
    at: Instant,
    generation: u64,
    hash: u64,
}

impl Due {
    /// Whether this item is `entry`'s current one.
    fn is_current<R, K>(&self, entry: &Entry<R, K>) -> bool {
        entry.tracked.is_some_and(|tracked| tracked.generation == self.generation)
    }
}

/// What an operation took out of a shard, to put back (changed or not) with [`Shard::put`].
struct Taken<R, K> {
    key: StoredKey,
    state: State<R, K>,
    kind: Kind,
}

/// What a key was before an operation, for keeping the counters in step.
#[derive(Clone, Copy)]
enum Kind {
    /// No entry (or a lapsed fence).
    Absent,
    /// A live entry and its heap item.
    Live(Option<Tracked>),
    /// A fence and its heap item.
    Fence(Option<Tracked>),
}

/// Where a key stands. Deadlines are kept per half so that a superseding registration replaces
/// its predecessor's deadline; an entry is due at the earliest deadline of the halves it holds.
enum State<R, K> {
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
    /// The key ended; late arrivals are refused until `until`.
    Fenced { reason: FenceReason, until: Instant },
}

impl<R, K> State<R, K> {
    /// Who owns the registration this state holds or is writing; `None` before D registered.
    fn owner(&self) -> Option<Owner> {
        match self {
            Self::Registered { owner, .. }
            | Self::Matched { owner, .. }
            | Self::InFlight { owner, .. } => Some(*owner),
            Self::Ready { .. } | Self::Fenced { .. } => None,
        }
    }

    /// When `expire` should look at this entry; `None` when it never expires.
    fn due(&self) -> Option<Instant> {
        match self {
            Self::Registered { deadline, .. } | Self::Ready { deadline, .. } => Some(*deadline),
            Self::Matched { ready_deadline, registration_deadline, .. } => {
                Some((*ready_deadline).min(*registration_deadline))
            }
            Self::InFlight { .. } => None,
            Self::Fenced { until, .. } => Some(*until),
        }
    }
}

/// What becomes of an in-flight entry when its write finishes.
enum AfterWrite<R> {
    /// Nothing newer arrived: the key ends, fenced with the write's outcome.
    End,
    /// D re-registered at a higher epoch: match the kept ready payload to it.
    Rematch { epoch: Epoch, registration: R, deadline: Instant },
    /// D cancelled the whole transfer: the key ends, fenced as cancelled, and re-registrations
    /// are refused meanwhile.
    Cancelled,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    type Table = RendezvousTable<&'static str, Vec<u32>>;

    /// A fixed origin and millisecond offsets from it: the table never reads the clock.
    struct Clock(Instant);

    impl Clock {
        fn new() -> Self {
            Self(Instant::now())
        }
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    const TTL_MS: u64 = 1_000;

    fn table() -> Table {
        table_with(4, 16)
    }

    fn table_with(shards: usize, max_entries: usize) -> Table {
        RendezvousTable::new(TableConfig {
            shards,
            max_entries,
            fence_ttl: Duration::from_millis(TTL_MS),
        })
    }

    fn key(name: &str) -> TransferKey {
        TransferKey::from_canonical(name)
    }

    fn matched<R, K>(arrival: Result<Arrival<R, K>, RendezvousError>) -> Match<R, K>
    where
        R: fmt::Debug,
        K: fmt::Debug,
    {
        match arrival {
            Ok(Arrival::Matched(m)) => m,
            other => panic!("expected a match, got {other:?}"),
        }
    }

    fn waiting<R, K>(arrival: Result<Arrival<R, K>, RendezvousError>) -> Option<R>
    where
        R: fmt::Debug,
        K: fmt::Debug,
    {
        match arrival {
            Ok(Arrival::Waiting { superseded }) => superseded,
            other => panic!("expected waiting, got {other:?}"),
        }
    }

    /// Everything lapses; nothing may be left behind.
    fn assert_drains(table: &Table, clock: &Clock) {
        table.expire(clock.at(1_000_000));
        assert_eq!(
            (table.len(), table.fences(), table.tracked_deadlines()),
            (0, 0, 0),
            "table not drained: {table:?}"
        );
    }

    #[test]
    fn only_a_vacant_key_is_fenced_and_only_live_entries_are_held() {
        let (table, c) = (table(), Clock::new());
        waiting(table.register(key("a"), 1, "reg", c.at(100), c.at(0)));
        assert!(table.is_live(&key("a")));
        assert!(!table.fence_vacant(&key("a"), FenceReason::Cancelled, c.at(1)));
        assert!(table.is_live(&key("a")), "a live registration is left alone");
        assert!(!table.is_live(&key("b")));
        assert!(table.fence_vacant(&key("b"), FenceReason::Expired, c.at(2)));
        assert!(!table.is_live(&key("b")), "a fence is not a live entry");
        assert_eq!(
            table.ready(key("b"), vec![1], c.at(100), c.at(3)),
            Err(RendezvousError::Fenced { key: key("b"), reason: FenceReason::Expired })
        );
        assert_drains(&table, &c);
    }

    #[test]
    fn only_the_owner_supersedes_or_cancels_its_registration() {
        let (table, c) = (table(), Clock::new());
        waiting(table.register_owned(key("a"), 1, 7, "owner", c.at(100), c.at(0)));
        assert_eq!(
            table.register_owned(key("a"), 9, 8, "thief", c.at(100), c.at(1)),
            Err(RendezvousError::Foreign { key: key("a") })
        );
        assert_eq!(table.cancel_owned(&key("a"), None, Some(8), c.at(2)), Cancelled::NotFound);
        // The owner's registration still stands, and still matches.
        let m = matched(table.ready(key("a"), vec![1], c.at(100), c.at(3)));
        assert_eq!((m.epoch, m.registration), (1, "owner"));
        // In flight too: the thief can neither queue a rematch nor cancel the write.
        table.begin_write(&key("a"), 1).unwrap();
        assert_eq!(
            table.register_owned(key("a"), 9, 8, "thief", c.at(100), c.at(4)),
            Err(RendezvousError::Foreign { key: key("a") })
        );
        assert_eq!(table.cancel_owned(&key("a"), Some(1), Some(8), c.at(5)), Cancelled::NotFound);
        assert_eq!(table.cancel_owned(&key("a"), Some(1), Some(7), c.at(5)), Cancelled::Deferred);
        // A peer's cancel of a key nobody registered fences nothing.
        assert_eq!(table.cancel_owned(&key("b"), None, Some(8), c.at(6)), Cancelled::NotFound);
        waiting(table.ready(key("b"), vec![2], c.at(100), c.at(7)));
        // Nor can a peer cancel P's ready half, which it never registered for.
        assert_eq!(table.cancel_owned(&key("b"), None, Some(8), c.at(8)), Cancelled::NotFound);
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn take_ready_moves_only_a_waiting_ready_half() {
        let (table, c) = (table(), Clock::new());
        assert_eq!(table.take_ready(&key("none"), c.at(0)), TakeReady::Absent);
        waiting(table.ready(key("a"), vec![1], c.at(100), c.at(0)));
        assert_eq!(
            table.take_ready(&key("a"), c.at(1)),
            TakeReady::Taken { ready: vec![1], deadline: c.at(100) }
        );
        assert_eq!((table.len(), table.fences()), (0, 0), "the key is forgotten, not fenced");
        // Its deadline left with it: nothing expires, and the key is free for a new arrival.
        assert!(table.expire(c.at(200)).is_empty());
        waiting(table.register(key("a"), 1, "d", c.at(300), c.at(201)));
        assert_eq!(table.take_ready(&key("a"), c.at(202)), TakeReady::Busy);
        assert_eq!(table.len(), 1, "a registration stays where it is");
        table.cancel(&key("b"), None, c.at(203));
        assert_eq!(
            table.take_ready(&key("b"), c.at(204)),
            TakeReady::Fenced(FenceReason::Cancelled)
        );
        assert_drains(&table, &c);
    }

    #[test]
    fn purge_drops_a_lost_peers_waiting_registrations_only() {
        let (table, c) = (table(), Clock::new());
        waiting(table.register(key("lost-1"), 1, "lost", c.at(100), c.at(0)));
        waiting(table.register(key("lost-2"), 1, "lost", c.at(100), c.at(0)));
        waiting(table.register(key("kept"), 1, "alive", c.at(100), c.at(0)));
        let mut purged: Vec<_> = table.purge(|r| *r == "lost", c.at(1));
        purged.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        assert_eq!(purged, vec![(key("lost-1"), 1, "lost"), (key("lost-2"), 1, "lost")]);
        assert_eq!(table.len(), 1);
        // A purged key is fenced: P's KV arriving later is refused at once (P frees it).
        assert!(matches!(
            table.ready(key("lost-1"), vec![1], c.at(100), c.at(2)),
            Err(RendezvousError::Fenced { reason: FenceReason::Cancelled, .. })
        ));
        assert_drains(&table, &c);
    }

    #[test]
    fn drain_ends_every_live_entry_writes_in_flight_included() {
        let (table, c) = (table(), Clock::new());
        waiting(table.register(key("reg"), 1, "d", c.at(100), c.at(0)));
        waiting(table.ready(key("ready"), vec![1], c.at(100), c.at(0)));
        waiting(table.register(key("flying"), 1, "d", c.at(100), c.at(0)));
        matched(table.ready(key("flying"), vec![2], c.at(100), c.at(0)));
        table.begin_write(&key("flying"), 1).unwrap();
        let drained = table.drain(c.at(1));
        assert_eq!(drained.len(), 3);
        assert_eq!(table.len(), 0);
        let flying = drained.iter().find(|e| e.key == key("flying")).unwrap();
        assert_eq!(flying.ready, Some(vec![2]));
        assert_drains(&table, &c);
    }

    #[test]
    fn register_then_ready_matches_once() {
        let (table, c) = (table(), Clock::new());
        assert_eq!(waiting(table.register(key("a"), 1, "d0", c.at(100), c.at(0))), None);
        let m = matched(table.ready(key("a"), vec![7, 8], c.at(100), c.at(1)));
        assert_eq!(m, Match { key: key("a"), epoch: 1, registration: "d0", ready: vec![7, 8] });
        assert_eq!(table.len(), 1);
        assert_eq!(
            table.ready(key("a"), vec![9], c.at(100), c.at(2)),
            Err(RendezvousError::DuplicateReady { key: key("a") })
        );
        assert_eq!(
            table.register(key("a"), 1, "d0", c.at(100), c.at(2)),
            Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 1, current: 1 })
        );
    }

    #[test]
    fn holds_names_the_owners_live_registration_at_its_epoch_only() {
        let (table, c) = (table(), Clock::new());
        let k = key("a");
        assert!(!table.holds(&k, 1, 7), "nothing registered");
        table.ready(k.clone(), vec![5], c.at(100), c.at(0)).unwrap();
        assert!(!table.holds(&k, 1, 7), "only P's half");
        matched(table.register_owned(k.clone(), 1, 7, "d1", c.at(100), c.at(1)));
        assert!(table.holds(&k, 1, 7), "matched");
        assert!(!table.holds(&k, 1, 8), "another owner's");
        assert!(!table.holds(&k, 2, 7), "another epoch");
        table.begin_write(&k, 1).unwrap();
        assert!(table.holds(&k, 1, 7), "being written");
        waiting(table.register_owned(k.clone(), 2, 7, "d2", c.at(100), c.at(2)));
        assert!(table.holds(&k, 1, 7) && table.holds(&k, 2, 7), "written, and waiting for it");
        let rematch = table.finish(&k, 1, Outcome::Done, c.at(3)).unwrap().rematch.unwrap();
        assert_eq!(rematch.epoch, 2);
        assert!(!table.holds(&k, 1, 7) && table.holds(&k, 2, 7));
        table.begin_write(&k, 2).unwrap();
        table.finish(&k, 2, Outcome::Done, c.at(4)).unwrap();
        assert!(!table.holds(&k, 2, 7), "fenced: the transfer ended");
    }

    #[test]
    fn ready_then_register_matches_once() {
        let (table, c) = (table(), Clock::new());
        assert_eq!(waiting(table.ready(key("a"), vec![1], c.at(100), c.at(0))), None);
        let m = matched(table.register(key("a"), 4, "d0", c.at(100), c.at(1)));
        assert_eq!((m.epoch, m.registration, m.ready), (4, "d0", vec![1]));
    }

    #[test]
    fn higher_epoch_supersedes_a_waiting_registration() {
        let (table, c) = (table(), Clock::new());
        waiting(table.register(key("a"), 2, "old", c.at(100), c.at(0)));
        assert_eq!(waiting(table.register(key("a"), 3, "new", c.at(100), c.at(1))), Some("old"));
        for stale in [1, 3] {
            assert_eq!(
                table.register(key("a"), stale, "x", c.at(100), c.at(2)),
                Err(RendezvousError::StaleEpoch { key: key("a"), epoch: stale, current: 3 })
            );
        }
        let m = matched(table.ready(key("a"), vec![5], c.at(100), c.at(3)));
        assert_eq!((m.epoch, m.registration), (3, "new"));
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn reregistering_a_match_not_begun_rematches_at_once() {
        let (table, c) = (table(), Clock::new());
        table.ready(key("a"), vec![5], c.at(100), c.at(0)).unwrap();
        let first = matched(table.register(key("a"), 1, "d1", c.at(100), c.at(1)));
        let second = matched(table.register(key("a"), 2, "d2", c.at(100), c.at(2)));
        assert_eq!((second.epoch, second.registration, &second.ready), (2, "d2", &first.ready));
        assert_eq!(
            table.register(key("a"), 2, "d3", c.at(100), c.at(3)),
            Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 2, current: 2 })
        );
        assert_eq!(
            table.begin_write(&key("a"), 1),
            Err(RendezvousError::NotMatched { key: key("a"), epoch: 1 })
        );
        table.begin_write(&key("a"), 2).unwrap();
        let done = table.finish(&key("a"), 2, Outcome::Done, c.at(4)).unwrap();
        assert_eq!(
            done,
            Finished { outcome: Outcome::Done, cancel_acknowledged: false, rematch: None }
        );
    }

    #[test]
    fn reregistering_during_a_write_rematches_when_it_finishes() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
        matched(table.ready(key("a"), vec![5], c.at(100), c.at(0)));
        table.begin_write(&key("a"), 1).unwrap();

        assert_eq!(waiting(table.register(key("a"), 2, "d2", c.at(100), c.at(1))), None);
        assert_eq!(waiting(table.register(key("a"), 3, "d3", c.at(100), c.at(1))), Some("d2"));
        assert_eq!(
            table.register(key("a"), 3, "d4", c.at(100), c.at(1)),
            Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 3, current: 3 })
        );
        // Nothing new may begin while the old write is in flight.
        assert!(table.begin_write(&key("a"), 3).is_err());

        let failed = Outcome::Failed("peer reset".into());
        let finished = table.finish(&key("a"), 1, failed.clone(), c.at(2)).unwrap();
        assert_eq!(finished.outcome, failed);
        assert!(!finished.cancel_acknowledged);
        let rematch = finished.rematch.expect("the waiting re-registration is matched");
        assert_eq!((rematch.epoch, rematch.registration, rematch.ready), (3, "d3", vec![5]));
        assert_eq!(table.fences(), 0, "a rematched key is still live");

        table.begin_write(&key("a"), 3).unwrap();
        assert_eq!(table.finish(&key("a"), 3, Outcome::Done, c.at(3)).unwrap().rematch, None);
        assert_eq!(
            table.register(key("a"), 4, "late", c.at(100), c.at(4)),
            Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Delivered })
        );
    }

    #[test]
    fn duplicate_ready_is_refused_in_every_live_state() {
        let (table, c) = (table(), Clock::new());
        let dup = |name| {
            table.ready(key(name), vec![0], c.at(100), c.at(1))
                == Err(RendezvousError::DuplicateReady { key: key(name) })
        };
        table.ready(key("ready"), vec![1], c.at(100), c.at(0)).unwrap();
        table.ready(key("matched"), vec![1], c.at(100), c.at(0)).unwrap();
        table.register(key("matched"), 1, "d", c.at(100), c.at(0)).unwrap();
        table.ready(key("flight"), vec![1], c.at(100), c.at(0)).unwrap();
        table.register(key("flight"), 1, "d", c.at(100), c.at(0)).unwrap();
        table.begin_write(&key("flight"), 1).unwrap();
        assert!(dup("ready") && dup("matched") && dup("flight"));
        assert_eq!(table.len(), 3);
    }

    #[test]
    fn expire_ends_waiting_and_matched_entries_at_the_earliest_deadline() {
        let (table, c) = (table(), Clock::new());
        table.register(key("reg"), 7, "d", c.at(50), c.at(0)).unwrap();
        table.ready(key("ready"), vec![1], c.at(60), c.at(0)).unwrap();
        // The matched entry is due at the earlier of its halves' deadlines (ready's, 40).
        table.ready(key("matched"), vec![2], c.at(40), c.at(0)).unwrap();
        table.register(key("matched"), 1, "d", c.at(500), c.at(0)).unwrap();
        assert!(table.expire(c.at(39)).is_empty());

        let mut expired = table.expire(c.at(60));
        expired.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(
            expired,
            vec![
                Expired {
                    key: key("matched"),
                    registration: None,
                    ready: Some(vec![2]),
                    was_matched: true
                },
                Expired {
                    key: key("ready"),
                    registration: None,
                    ready: Some(vec![1]),
                    was_matched: false
                },
                Expired {
                    key: key("reg"),
                    registration: Some((7, "d")),
                    ready: None,
                    was_matched: false
                },
            ]
        );
        assert_eq!((table.len(), table.fences()), (0, 3));
        assert_eq!(
            table.begin_write(&key("matched"), 1),
            Err(RendezvousError::Fenced { key: key("matched"), reason: FenceReason::Expired })
        );
        assert_eq!(
            table.ready(key("reg"), vec![3], c.at(900), c.at(61)),
            Err(RendezvousError::Fenced { key: key("reg"), reason: FenceReason::Expired })
        );
        assert!(table.expire(c.at(100)).is_empty(), "each entry expires once");
        assert_drains(&table, &c);
    }

    #[test]
    fn in_flight_entries_never_expire() {
        let (table, c) = (table(), Clock::new());
        table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
        table.register(key("a"), 1, "d", c.at(10), c.at(0)).unwrap();
        table.begin_write(&key("a"), 1).unwrap();
        assert!(table.expire(c.at(1_000_000)).is_empty());
        assert_eq!(table.len(), 1);
        assert_eq!(table.tracked_deadlines(), 0, "an in-flight entry has no current deadline");
        table.finish(&key("a"), 1, Outcome::Done, c.at(1_000_000)).unwrap();
        assert_eq!((table.len(), table.fences()), (0, 1));
        table.expire(c.at(1_000_000 + TTL_MS));
        assert_eq!((table.fences(), table.tracked_deadlines()), (0, 0));
    }

    #[test]
    fn a_superseding_registration_replaces_its_predecessors_deadline() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 1, "d1", c.at(10), c.at(0)).unwrap();
        table.register(key("a"), 2, "d2", c.at(100), c.at(5)).unwrap();
        assert!(table.expire(c.at(50)).is_empty());
        let expired = table.expire(c.at(100));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].registration, Some((2, "d2")));
    }

    #[test]
    fn an_entry_due_later_than_its_heap_item_waits_for_its_own_due_time() {
        let (table, c) = (table(), Clock::new());
        // Written and fenced before P's deadline: the fence outlives the ready deadline's item.
        table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
        table.register(key("a"), 1, "d", c.at(10), c.at(0)).unwrap();
        table.begin_write(&key("a"), 1).unwrap();
        table.finish(&key("a"), 1, Outcome::Done, c.at(5)).unwrap();
        assert!(table.expire(c.at(10)).is_empty());
        assert_eq!(table.fences(), 1, "the fence lasts from the finish, not the deadline");
        assert!(table.register(key("a"), 2, "d", c.at(5_000), c.at(5 + TTL_MS - 1)).is_err());
        assert!(table.expire(c.at(5 + TTL_MS)).is_empty());
        assert_eq!((table.fences(), table.tracked_deadlines()), (0, 0));

        // A later registration deadline: the entry expires at it, and is fenced from it.
        table.register(key("b"), 1, "d1", c.at(10), c.at(0)).unwrap();
        table.register(key("b"), 2, "d2", c.at(50), c.at(1)).unwrap();
        let expired = table.expire(c.at(60));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].registration, Some((2, "d2")));
        assert!(table.ready(key("b"), vec![1], c.at(5_000), c.at(50 + TTL_MS - 1)).is_err());
        assert_eq!(waiting(table.ready(key("b"), vec![1], c.at(5_000), c.at(50 + TTL_MS))), None);
        assert_drains(&table, &c);
    }

    #[test]
    fn rematch_keeps_the_ready_deadline() {
        let (table, c) = (table(), Clock::new());
        table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
        table.register(key("a"), 1, "d1", c.at(10), c.at(0)).unwrap();
        table.begin_write(&key("a"), 1).unwrap();
        table.register(key("a"), 2, "d2", c.at(500), c.at(1)).unwrap();
        let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(20)).unwrap();
        assert!(finished.rematch.is_some());
        // P's lease on its blocks (deadline 10) has passed: the rematch expires if not begun.
        let expired = table.expire(c.at(20));
        assert_eq!(expired.len(), 1);
        assert!(expired[0].was_matched);
        assert!(table.begin_write(&key("a"), 2).is_err());
    }

    #[test]
    fn fences_lapse_after_their_ttl() {
        let (table, c) = (table(), Clock::new());
        assert_eq!(table.cancel(&key("a"), None, c.at(0)), Cancelled::NotFound);
        assert_eq!(table.fences(), 1);
        assert!(table.register(key("a"), 1, "d", c.at(5_000), c.at(TTL_MS - 1)).is_err());
        // Lapsed but not yet collected: the arrival replaces the fence.
        assert_eq!(waiting(table.register(key("a"), 1, "d", c.at(5_000), c.at(TTL_MS))), None);
        assert_eq!((table.len(), table.fences()), (1, 0));
        assert!(table.expire(c.at(TTL_MS)).is_empty(), "the old fence's item is stale");

        table.cancel(&key("b"), None, c.at(0));
        assert!(table.expire(c.at(TTL_MS)).is_empty(), "fences lapse silently");
        assert_eq!(table.fences(), 0);
        assert_eq!(waiting(table.ready(key("b"), vec![], c.at(5_000), c.at(TTL_MS))), None);
    }

    #[test]
    fn zero_fence_ttl_keeps_no_fences() {
        let c = Clock::new();
        let table: Table = RendezvousTable::new(TableConfig {
            fence_ttl: Duration::ZERO,
            ..TableConfig::default()
        });
        table.cancel(&key("a"), None, c.at(0));
        assert_eq!(table.fences(), 0);
        assert!(table.register(key("a"), 1, "d", c.at(10), c.at(0)).is_ok());
    }

    #[test]
    fn begin_write_needs_the_current_match() {
        let (table, c) = (table(), Clock::new());
        let not_matched = |epoch| Err(RendezvousError::NotMatched { key: key("a"), epoch });
        assert_eq!(table.begin_write(&key("a"), 1), not_matched(1));
        table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
        assert_eq!(table.begin_write(&key("a"), 1), not_matched(1), "only half has arrived");
        table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
        assert_eq!(table.begin_write(&key("a"), 2), not_matched(2));
        assert_eq!(table.begin_write(&key("a"), 1), Ok(()));
        assert_eq!(table.begin_write(&key("a"), 1), not_matched(1), "a write begins once");
    }

    #[test]
    fn finish_needs_the_write_in_flight() {
        let (table, c) = (table(), Clock::new());
        let not_matched = |epoch| Err(RendezvousError::NotMatched { key: key("a"), epoch });
        assert_eq!(table.finish(&key("a"), 1, Outcome::Done, c.at(0)), not_matched(1));
        table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
        table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
        assert_eq!(table.finish(&key("a"), 1, Outcome::Done, c.at(0)), not_matched(1));
        table.begin_write(&key("a"), 1).unwrap();
        assert_eq!(table.finish(&key("a"), 2, Outcome::Done, c.at(0)), not_matched(2));
        let failed = Outcome::Failed("nixl: remote disconnected".into());
        assert!(table.finish(&key("a"), 1, failed, c.at(1)).is_ok());
        assert_eq!(
            table.finish(&key("a"), 1, Outcome::Done, c.at(2)),
            Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Failed })
        );
        assert_eq!((table.len(), table.fences()), (0, 1));
    }

    #[test]
    fn cancel_removes_entries_not_yet_written() {
        let (table, c) = (table(), Clock::new());
        table.register(key("reg"), 1, "d", c.at(100), c.at(0)).unwrap();
        table.ready(key("ready"), vec![1], c.at(100), c.at(0)).unwrap();
        table.ready(key("matched"), vec![2], c.at(100), c.at(0)).unwrap();
        table.register(key("matched"), 1, "d", c.at(100), c.at(0)).unwrap();

        assert_eq!(
            table.cancel(&key("reg"), Some(1), c.at(1)),
            Cancelled::Removed { registration: Some("d"), ready: None }
        );
        assert_eq!(
            table.cancel(&key("ready"), Some(9), c.at(1)),
            Cancelled::Removed { registration: None, ready: Some(vec![1]) }
        );
        assert_eq!(
            table.cancel(&key("matched"), None, c.at(1)),
            Cancelled::Removed { registration: None, ready: Some(vec![2]) }
        );
        assert_eq!((table.len(), table.fences()), (0, 3));
        let fenced =
            |name| RendezvousError::Fenced { key: key(name), reason: FenceReason::Cancelled };
        assert_eq!(table.begin_write(&key("matched"), 1), Err(fenced("matched")));
        assert_eq!(
            table.ready(key("reg"), vec![1], c.at(100), c.at(2)).unwrap_err(),
            fenced("reg")
        );
        assert_eq!(
            table.register(key("ready"), 2, "d", c.at(100), c.at(2)).unwrap_err(),
            fenced("ready")
        );
        assert_eq!(table.cancel(&key("ready"), None, c.at(2)), Cancelled::NotFound);
        assert_drains(&table, &c);
    }

    #[test]
    fn cancel_of_an_unknown_key_fails_a_late_half_fast() {
        let (table, c) = (table(), Clock::new());
        assert_eq!(table.cancel(&key("a"), None, c.at(0)), Cancelled::NotFound);
        let fenced = Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled });
        assert_eq!(table.register(key("a"), 1, "d", c.at(100), c.at(1)), fenced.clone());
        assert_eq!(table.ready(key("a"), vec![1], c.at(100), c.at(1)), fenced);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_stale_cancel_is_a_no_op() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 3, "d3", c.at(100), c.at(0)).unwrap();
        assert_eq!(table.cancel(&key("a"), Some(2), c.at(1)), Cancelled::NotFound);
        let m = matched(table.ready(key("a"), vec![1], c.at(100), c.at(2)));
        assert_eq!(m.epoch, 3);
        assert_eq!(table.cancel(&key("a"), Some(2), c.at(3)), Cancelled::NotFound);
        assert_eq!(
            table.begin_write(&key("a"), 3),
            Ok(()),
            "the stale cancel left the match alone"
        );
    }

    #[test]
    fn cancel_during_a_write_is_acknowledged_by_finish() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
        table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
        table.begin_write(&key("a"), 1).unwrap();
        table.register(key("a"), 2, "d2", c.at(100), c.at(1)).unwrap();

        assert_eq!(table.cancel(&key("a"), None, c.at(2)), Cancelled::Deferred);
        assert_eq!(table.len(), 1, "the entry stays until the write finishes");
        assert_eq!(table.cancel(&key("a"), None, c.at(2)), Cancelled::Deferred, "idempotent");
        assert_eq!(
            table.register(key("a"), 3, "d3", c.at(100), c.at(3)),
            Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled })
        );
        let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(4)).unwrap();
        assert!(finished.cancel_acknowledged);
        assert_eq!(finished.rematch, None, "the cancel covered the re-registration");
        assert_eq!((table.len(), table.fences()), (0, 1));
        assert_eq!(
            table.ready(key("a"), vec![1], c.at(100), c.at(5)),
            Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled })
        );
    }

    #[test]
    fn cancelling_the_epoch_being_written_keeps_a_newer_registration() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
        table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
        table.begin_write(&key("a"), 1).unwrap();
        table.register(key("a"), 2, "d2", c.at(100), c.at(1)).unwrap();
        // Epoch 1's blocks are being written: D must wait for the acknowledgement.
        assert_eq!(table.cancel(&key("a"), Some(1), c.at(2)), Cancelled::Deferred);
        assert_eq!(table.cancel(&key("a"), Some(0), c.at(2)), Cancelled::NotFound);
        let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(3)).unwrap();
        assert!(finished.cancel_acknowledged);
        assert_eq!(finished.rematch.map(|m| (m.epoch, m.registration)), Some((2, "d2")));
    }

    #[test]
    fn a_cancel_at_a_higher_epoch_cancels_the_transfer() {
        let (table, c) = (table(), Clock::new());
        table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
        assert_eq!(
            table.cancel(&key("a"), Some(2), c.at(1)),
            Cancelled::Removed { registration: Some("d1"), ready: None }
        );
    }

    #[test]
    fn new_entries_beyond_max_entries_are_refused() {
        let (table, c) = (table_with(2, 2), Clock::new());
        table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
        table.ready(key("b"), vec![1], c.at(100), c.at(0)).unwrap();
        assert_eq!(
            table.register(key("c"), 1, "d", c.at(100), c.at(0)),
            Err(RendezvousError::TableFull { key: key("c"), capacity: 2 })
        );
        // Completing an existing entry needs no new slot.
        matched(table.ready(key("a"), vec![1], c.at(100), c.at(0)));
        // Fences do not count against max_entries.
        table.cancel(&key("a"), None, c.at(1));
        assert_eq!((table.len(), table.fences()), (1, 1));
        assert!(table.ready(key("c"), vec![1], c.at(100), c.at(1)).is_ok());
    }

    #[test]
    fn fences_beyond_max_entries_are_not_kept() {
        let (table, c) = (table_with(1, 1), Clock::new());
        table.cancel(&key("a"), None, c.at(0));
        table.cancel(&key("b"), None, c.at(0));
        assert_eq!(table.fences(), 1);
        assert!(table.register(key("a"), 1, "d", c.at(100), c.at(1)).is_err());
        // Unfenced: a late half waits for its deadline instead of failing fast.
        assert!(table.register(key("b"), 1, "d", c.at(100), c.at(1)).is_ok());
        assert_drains(&table, &c);
    }

    #[test]
    fn deadline_heap_stays_bounded_under_churn() {
        let (table, c) = (table_with(1, 16), Clock::new());
        // Each superseding registration moves the deadline, leaving a stale heap item behind.
        for epoch in 1..10_000 {
            table.register(key("a"), epoch, "d", c.at(1_000_000 - epoch), c.at(0)).unwrap();
        }
        assert!(table.tracked_deadlines() <= 2 + HEAP_SLACK + 1, "{table:?}");
        assert_drains(&table, &c);
    }

    #[test]
    fn expire_takes_many_due_entries_in_one_call() {
        let (table, c) = (table_with(1, 1_000), Clock::new());
        for i in 0..(3 * EXPIRE_BATCH + 5) {
            table.ready(key(&format!("k{i}")), vec![], c.at(10), c.at(0)).unwrap();
        }
        assert_eq!(table.expire(c.at(10)).len(), 3 * EXPIRE_BATCH + 5);
        assert_eq!(table.len(), 0);
        assert_drains(&table, &c);
    }

    #[test]
    fn shards_round_up_to_a_power_of_two() {
        let table: Table =
            RendezvousTable::new(TableConfig { shards: 3, ..TableConfig::default() });
        assert_eq!(table.shards.len(), 4);
        let table: Table =
            RendezvousTable::new(TableConfig { shards: 0, ..TableConfig::default() });
        assert_eq!(table.shards.len(), 1);
    }

    #[test]
    fn errors_say_what_happened_and_what_to_do() {
        let stale = RendezvousError::StaleEpoch { key: key("x"), epoch: 3, current: 5 };
        assert_eq!(
            stale.to_string(),
            "registration for transfer x epoch 3 refused: epoch 5 is current; re-register with a \
             higher epoch"
        );
        let fenced = RendezvousError::Fenced { key: key("x"), reason: FenceReason::Cancelled };
        assert!(fenced.to_string().contains("transfer x refused: it was cancelled"), "{fenced}");
        let full = RendezvousError::TableFull { key: key("x"), capacity: 7 };
        assert!(full.to_string().contains("full (7 transfers"), "{full}");
        assert!(full.to_string().contains("raise max_entries"), "{full}");
        let nm = RendezvousError::NotMatched { key: key("x"), epoch: 2 };
        assert!(nm.to_string().contains("transfer x epoch 2"), "{nm}");
        assert!(nm.to_string().contains("drop this match"), "{nm}");
    }
}

//! [`RendezvousTable`]: its shards, counters and public operations. Each operation locks the
//! key's shard, takes the key's entry out, works out its next state, and settles it back (see
//! [`RendezvousTable::settle`]); the per-key state machine is in [`super::shard`].

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use super::shard::{take_entry, AfterWrite, Entry, Kind, Shard, State, StoredKey, Taken};
use super::{
    AfterStream, Arrival, Cancelled, Epoch, Expired, FenceReason, Finished, Match, Outcome, Owner,
    RendezvousError, StreamEnded, StreamStart, TableConfig, TakeReady, ANY_OWNER,
};
use crate::key::TransferKey;
use crate::sync::{lock, AtomicUsize, CachePadded, Mutex, MutexGuard, Ordering};

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
    pub(super) shards: Box<[LockedShard<R, K>]>,
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
pub(super) const EXPIRE_BATCH: usize = 64;

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
        let incoming = Incoming { key: &key, epoch, registration, deadline };
        let (state, result) = match taken.state {
            State::Registered { epoch: current, owner, registration, deadline } => {
                incoming.reregister_waiting(current, owner, registration, deadline)
            }
            State::Ready { ready, deadline } => incoming.match_ready(owner, ready, deadline),
            State::Matched {
                epoch: current,
                owner,
                ready,
                ready_deadline,
                registration_deadline,
            } => incoming.rematch(current, owner, ready, ready_deadline, registration_deadline),
            State::InFlight { epoch: writing, owner, ready, ready_deadline, after, ack_owed } => {
                let (after, result) = incoming.register_during_write(writing, after);
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
            State::Streaming {
                epoch: streaming,
                owner,
                registration_deadline,
                ready,
                after,
                ack_owed,
                aborted,
            } => {
                let (after, result) = incoming.register_during_write(streaming, after);
                let state = State::Streaming {
                    epoch: streaming,
                    owner,
                    registration_deadline,
                    ready,
                    after,
                    ack_owed,
                    aborted,
                };
                (state, result)
            }
            State::Fenced { reason, until } => {
                (State::Fenced { reason, until }, incoming.refuse_fenced(reason))
            }
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        drop(shard);
        result.map_err(|Refused { error, registration }| {
            // The caller's value (a Python object in the bindings): dropped now that the shard
            // is unlocked, never under its lock.
            drop(registration);
            error
        })
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
            // The stream's WRITEs must finish before the whole KV's: held for `end_stream`. Also
            // when D cancelled meanwhile: P's KV ends with the cancel only then, for those WRITEs
            // still read P's blocks (refused now, P's engine would free them under the WRITEs).
            State::Streaming {
                epoch,
                owner,
                registration_deadline,
                ready: None,
                after,
                ack_owed,
                aborted,
            } => {
                let state = State::Streaming {
                    epoch,
                    owner,
                    registration_deadline,
                    ready: Some((ready, deadline)),
                    after,
                    ack_owed,
                    aborted,
                };
                (state, Ok(Arrival::Waiting { superseded: None }))
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
            state @ (State::Ready { .. }
            | State::Matched { .. }
            | State::InFlight { .. }
            | State::Streaming { .. }) => {
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

    /// Layer-wise push: takes the registration waiting for P's KV under `key` (and within its
    /// deadline), to write the layers that are final before the whole KV is. On [`StreamStart::Started`] the entry is
    /// streaming: it no longer expires, a cancel is deferred and a re-registration waits, until
    /// [`end_stream`](Self::end_stream) hands the registration back. Call that once none of the
    /// stream's WRITEs is in flight.
    pub fn begin_stream(&self, key: &TransferKey, now: Instant) -> StreamStart<R> {
        let (hash, mut shard) = self.shard(key);
        let Some(taken) = self.take(&mut shard, hash, key, now) else {
            return StreamStart::NotWaiting;
        };
        let (state, result) = match taken.state {
            // One past its deadline is left for `expire`, which fails it.
            State::Registered { epoch, owner, registration, deadline } if deadline > now => {
                let state = State::Streaming {
                    epoch,
                    owner,
                    registration_deadline: deadline,
                    ready: None,
                    after: AfterWrite::End,
                    ack_owed: false,
                    aborted: false,
                };
                (state, StreamStart::Started { epoch, registration })
            }
            State::Fenced { reason, until } => {
                (State::Fenced { reason, until }, StreamStart::Fenced(reason))
            }
            state => (state, StreamStart::NotWaiting),
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        result
    }

    /// The stream of `key` at `epoch` ended: none of its WRITEs is in flight, and `registration`
    /// (the one [`begin_stream`](Self::begin_stream) handed out) comes back. The key waits again,
    /// is matched (P's whole KV became ready during the stream) or ends (D cancelled it); see
    /// [`AfterStream`]. Deadlines that ran out during the stream end the key at the next
    /// `expire`.
    pub fn end_stream(
        &self,
        key: &TransferKey,
        epoch: Epoch,
        registration: R,
        now: Instant,
    ) -> Result<StreamEnded<R, K>, RendezvousError> {
        let (hash, mut shard) = self.shard(key);
        let Some(taken) = self.take(&mut shard, hash, key, now) else {
            drop(shard);
            drop(registration);
            return Err(RendezvousError::NotMatched { key: key.clone(), epoch });
        };
        let (state, result) = match taken.state {
            State::Streaming {
                epoch: streaming,
                owner,
                registration_deadline,
                ready,
                after,
                ack_owed,
                aborted,
            } if streaming == epoch => {
                let (state, next) = match after {
                    AfterWrite::Cancelled => {
                        let ready = ready.map(|(ready, _)| ready);
                        let next = AfterStream::Cancelled { registration, ready };
                        (self.fence_from(FenceReason::Cancelled, now), next)
                    }
                    AfterWrite::End => {
                        let waiting = (epoch, registration, registration_deadline);
                        Self::after_stream(key, owner, waiting, ready, None, now)
                    }
                    AfterWrite::Rematch { epoch, registration: newer, deadline } => {
                        let waiting = (epoch, newer, deadline);
                        Self::after_stream(key, owner, waiting, ready, Some(registration), now)
                    }
                };
                (state, Ok(StreamEnded { cancel_acknowledged: ack_owed, aborted, next }))
            }
            State::Fenced { reason, until } => (
                State::Fenced { reason, until },
                Err(RendezvousError::Fenced { key: key.clone(), reason }),
            ),
            state => (state, Err(RendezvousError::NotMatched { key: key.clone(), epoch })),
        };
        self.settle(&mut shard, taken.key, taken.kind, state, now);
        drop(shard);
        result
    }

    /// A stream ended with `waiting` (epoch, registration, deadline) the registration to keep:
    /// matched to P's whole KV if it is ready, else waiting for it.
    fn after_stream(
        key: &TransferKey,
        owner: Owner,
        (epoch, registration, deadline): (Epoch, R, Instant),
        ready: Option<(K, Instant)>,
        superseded: Option<R>,
        now: Instant,
    ) -> (State<R, K>, AfterStream<R, K>) {
        // As after a write: deadlines that ran out meanwhile end the key at the next `expire`,
        // with a fence that lasts from now.
        let registration_deadline = deadline.max(now);
        match ready {
            Some((ready, ready_deadline)) => {
                let matched = Match { key: key.clone(), epoch, registration, ready: ready.clone() };
                let state = State::Matched {
                    epoch,
                    owner,
                    ready,
                    ready_deadline: ready_deadline.max(now),
                    registration_deadline,
                };
                (state, AfterStream::Matched { matched, superseded })
            }
            None => {
                let state = State::Registered {
                    epoch,
                    owner,
                    registration,
                    deadline: registration_deadline,
                };
                (state, AfterStream::Waiting { superseded })
            }
        }
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
        let covers = |current| cancel_covers(epoch, current);
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
                let (after, ack_owed, result) =
                    cancel_during_write(epoch, writing, after, ack_owed);
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
            State::Streaming {
                epoch: streaming,
                owner,
                registration_deadline,
                ready,
                after,
                ack_owed,
                aborted,
            } => {
                let (after, owed, result) = cancel_during_write(epoch, streaming, after, ack_owed);
                // P's own abort (no epoch) owes D no acknowledgement (D did not ask; it hears a
                // FAIL unless it cancelled too), and ends P's send once the stream's WRITEs are
                // done.
                let p_abort = epoch.is_none() && matches!(result, Cancelled::Deferred);
                let (ack_owed, aborted) =
                    if epoch.is_some() { (owed, aborted) } else { (ack_owed, aborted || p_abort) };
                let state = State::Streaming {
                    epoch: streaming,
                    owner,
                    registration_deadline,
                    ready,
                    after,
                    ack_owed,
                    aborted,
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
            | State::InFlight { after: AfterWrite::Rematch { registration, .. }, .. }
            | State::Streaming { after: AfterWrite::Rematch { registration, .. }, .. } => {
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
            State::Streaming {
                epoch: streaming,
                owner,
                registration_deadline,
                ready,
                after: AfterWrite::Rematch { epoch, registration, .. },
                ack_owed,
                aborted,
            } => {
                purged.push((key.clone(), epoch, registration));
                let after = AfterWrite::End;
                State::Streaming {
                    epoch: streaming,
                    owner,
                    registration_deadline,
                    ready,
                    after,
                    ack_owed,
                    aborted,
                }
            }
            state => state,
        });
        purged
    }

    /// Ends every live entry, writes and streams in flight included (their writer is gone): for
    /// when the writer itself stopped. Each key is fenced as failed; returns what each entry held, as
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
                // The registration is the stream's holder's, which the drain stops too.
                State::Streaming { ready, .. } => (None, ready.map(|(ready, _)| ready), true),
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
        self.state_of(key, |state| !matches!(state, State::Fenced { .. }))
    }

    /// Whether the stream of `key` at `epoch` should go on writing layers: nobody cancelled it
    /// (neither D nor P's abort) and D did not register again meanwhile. A stream that does not
    /// stand posts nothing more and ends once its WRITEs in flight are done.
    pub fn stream_stands(&self, key: &TransferKey, epoch: Epoch) -> bool {
        self.state_of(key, |state| {
            matches!(
                state,
                State::Streaming {
                    epoch: streaming,
                    after: AfterWrite::End,
                    ack_owed: false,
                    aborted: false,
                    ..
                } if *streaming == epoch
            )
        })
    }

    /// Whether `key` is streaming with P's abort waiting for it (see `cancel`): the abort
    /// answered `InFlight`, so the stream's end owes P's engine the send's event.
    pub fn stream_aborted(&self, key: &TransferKey) -> bool {
        self.state_of(key, |state| matches!(state, State::Streaming { aborted: true, .. }))
    }

    /// Whether `key` holds P's KV: waiting for D, matched, being written, or held for a stream.
    pub fn has_ready(&self, key: &TransferKey) -> bool {
        self.state_of(key, |state| match state {
            State::Ready { .. } | State::Matched { .. } | State::InFlight { .. } => true,
            State::Streaming { ready, .. } => ready.is_some(),
            State::Registered { .. } | State::Fenced { .. } => false,
        })
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
    /// being written or streamed, or waiting for the write or stream in flight to finish. A registration that repeats
    /// it is a duplicate: it needs neither a place in the table nor a reply.
    pub fn holds(&self, key: &TransferKey, epoch: Epoch, owner: Owner) -> bool {
        self.state_of(key, |state| match state {
            State::Registered { epoch: held, owner: holder, .. }
            | State::Matched { epoch: held, owner: holder, .. } => {
                *held == epoch && *holder == owner
            }
            State::InFlight { epoch: writing, owner: holder, after, .. }
            | State::Streaming { epoch: writing, owner: holder, after, .. } => {
                let waiting =
                    matches!(after, AfterWrite::Rematch { epoch: next, .. } if *next == epoch);
                *holder == owner && (*writing == epoch || waiting)
            }
            State::Ready { .. } | State::Fenced { .. } => false,
        })
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

    /// Whether `key` has an entry whose state `test` accepts (under its shard's lock).
    fn state_of(&self, key: &TransferKey, test: impl FnOnce(&State<R, K>) -> bool) -> bool {
        let (hash, shard) = self.shard(key);
        shard
            .entries
            .find(hash, |entry| entry.key.hash == hash && entry.key.key == *key)
            .is_some_and(|entry| test(&entry.state))
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
                state @ (State::InFlight { .. } | State::Streaming { .. }) => {
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

/// A registration arriving for a key the table holds. What becomes of it depends on what the key
/// holds: one method for each state, each returning the key's next state and the answer.
struct Incoming<'k, R> {
    key: &'k TransferKey,
    epoch: Epoch,
    registration: R,
    deadline: Instant,
}

/// A registration the table refused, handed back with the reason so that it is dropped after the
/// shard's lock is released, not under it.
struct Refused<R> {
    error: RendezvousError,
    registration: R,
}

/// The answer to an [`Incoming`] registration; a refusal carries the registration back.
type Answer<R, K> = Result<Arrival<R, K>, Refused<R>>;

impl<R> Incoming<'_, R> {
    /// The key holds an unmatched registration at `current`: a higher epoch supersedes it.
    fn reregister_waiting<K>(
        self,
        current: Epoch,
        owner: Owner,
        waiting: R,
        waiting_deadline: Instant,
    ) -> (State<R, K>, Answer<R, K>) {
        if self.epoch > current {
            let Self { epoch, registration, deadline, .. } = self;
            let state = State::Registered { epoch, owner, registration, deadline };
            (state, Ok(Arrival::Waiting { superseded: Some(waiting) }))
        } else {
            let state = State::Registered {
                epoch: current,
                owner,
                registration: waiting,
                deadline: waiting_deadline,
            };
            (state, self.refuse_stale(current))
        }
    }

    /// The key holds P's ready KV: this registration is its match.
    fn match_ready<K: Clone>(
        self,
        owner: Owner,
        ready: K,
        ready_deadline: Instant,
    ) -> (State<R, K>, Answer<R, K>) {
        let Self { key, epoch, registration, deadline } = self;
        let matched = Match { key: key.clone(), epoch, registration, ready: ready.clone() };
        let state =
            State::Matched { epoch, owner, ready, ready_deadline, registration_deadline: deadline };
        (state, Ok(Arrival::Matched(matched)))
    }

    /// The key was matched at `current` and the write has not begun: a higher epoch is matched
    /// in its place.
    fn rematch<K: Clone>(
        self,
        current: Epoch,
        owner: Owner,
        ready: K,
        ready_deadline: Instant,
        registration_deadline: Instant,
    ) -> (State<R, K>, Answer<R, K>) {
        if self.epoch > current {
            // The old match's holder has not begun (the entry would be in flight), so re-matching
            // now cannot race a write; its begin_write will be refused.
            self.match_ready(owner, ready, ready_deadline)
        } else {
            let state = State::Matched {
                epoch: current,
                owner,
                ready,
                ready_deadline,
                registration_deadline,
            };
            (state, self.refuse_stale(current))
        }
    }

    /// The key is being written at `writing`, to be followed by `after`: a higher epoch than the
    /// newest the key holds waits for the write to finish, which matches it. The write itself is
    /// untouched, so only what follows it changes.
    fn register_during_write<K>(
        self,
        writing: Epoch,
        after: AfterWrite<R>,
    ) -> (AfterWrite<R>, Answer<R, K>) {
        match after {
            AfterWrite::Cancelled => {
                (AfterWrite::Cancelled, self.refuse_fenced(FenceReason::Cancelled))
            }
            AfterWrite::End if self.epoch > writing => {
                let Self { epoch, registration, deadline, .. } = self;
                let after = AfterWrite::Rematch { epoch, registration, deadline };
                (after, Ok(Arrival::Waiting { superseded: None }))
            }
            AfterWrite::End => (AfterWrite::End, self.refuse_stale(writing)),
            AfterWrite::Rematch {
                epoch: current,
                registration: waiting,
                deadline: waiting_deadline,
            } => {
                if self.epoch > current {
                    let Self { epoch, registration, deadline, .. } = self;
                    let after = AfterWrite::Rematch { epoch, registration, deadline };
                    (after, Ok(Arrival::Waiting { superseded: Some(waiting) }))
                } else {
                    let after = AfterWrite::Rematch {
                        epoch: current,
                        registration: waiting,
                        deadline: waiting_deadline,
                    };
                    (after, self.refuse_stale(current))
                }
            }
        }
    }

    /// Refuses this registration: the key holds `current`, which is not below its epoch.
    fn refuse_stale<K>(self, current: Epoch) -> Answer<R, K> {
        let error =
            RendezvousError::StaleEpoch { key: self.key.clone(), epoch: self.epoch, current };
        Err(Refused { error, registration: self.registration })
    }

    /// Refuses this registration: the key ended (or is ending) for `reason`.
    fn refuse_fenced<K>(self, reason: FenceReason) -> Answer<R, K> {
        let error = RendezvousError::Fenced { key: self.key.clone(), reason };
        Err(Refused { error, registration: self.registration })
    }
}

/// Whether a cancel at `cancel` (`None`: whatever epoch) cancels a transfer whose newest
/// registration is at `current`.
fn cancel_covers(cancel: Option<Epoch>, current: Epoch) -> bool {
    cancel.is_none_or(|cancel| cancel >= current)
}

/// A cancel at `cancel` of a key being written at `writing`, to be followed by `after`: what
/// follows the write instead, whether `finish` owes D an acknowledgement, and the answer now.
/// The write itself is never stopped, so a cancel that covers it is deferred to `finish`.
fn cancel_during_write<R, K>(
    cancel: Option<Epoch>,
    writing: Epoch,
    after: AfterWrite<R>,
    ack_owed: bool,
) -> (AfterWrite<R>, bool, Cancelled<R, K>) {
    let current = match &after {
        AfterWrite::Rematch { epoch, .. } => *epoch,
        AfterWrite::End | AfterWrite::Cancelled => writing,
    };
    let already_cancelled = matches!(after, AfterWrite::Cancelled);
    if already_cancelled || cancel_covers(cancel, current) {
        // The whole transfer ends; a waiting re-registration is covered by the one
        // acknowledgement D gets at finish, so it is dropped.
        (AfterWrite::Cancelled, true, Cancelled::Deferred)
    } else if cancel == Some(writing) {
        (after, true, Cancelled::Deferred)
    } else {
        (after, ack_owed, Cancelled::NotFound)
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

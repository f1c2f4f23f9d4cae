//! P: one transfer written into several D ranks.
//!
//! When D runs a larger tensor parallel size than P, each P rank holds the heads of several D
//! ranks (and MLA's latent, the same on every rank, is needed by several D ranks). Each of those
//! D ranks registers under its own *slot* of the transfer's key ([`TransferKey::slot`]), saying
//! how many slots there are. P's ready KV is then placed in the rendezvous table once per slot,
//! so each slot meets its own registration and is planned, fenced and written on its own; the
//! slots share one source (the same [`Ready`]), which P frees once every slot ended. The
//! request's send is reported once, after its last slot, with the slots' bytes summed and the
//! worst of their outcomes (quarantined, then failed, then cancelled, then done).
//!
//! The first slot's registration creates the group. P's KV may be ready already (it is then
//! taken off the transfer's plain key and placed under every slot) or not yet (`Endpoint::ready`
//! places it when it comes). Both happen under the groups' lock, and so does P's abort, so none
//! of them can miss another.
//!
//! A group whose KV P never places (P aborted nothing and reported nothing: the request never
//! finished its prefill, or its ready went elsewhere) is removed once none of its slots holds a
//! registration any more: each slot registration that leaves the table unwritten (expired,
//! purged with its peer, cancelled by D, refused) calls [`release`]. The transfer's plain key is
//! then fenced, so that P's KV arriving later is refused at once, as the slots' own fences would
//! have refused it under the group.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::key::TransferKey;
use crate::rendezvous::{Arrival, FenceReason, Match};
use crate::sync::lock;

use super::events::{Outcome, Reason};
use super::halves::{Ready, Registration};
use super::Shared;

/// The groups of an endpoint, by transfer key (without slot).
pub(crate) type FanOuts = HashMap<TransferKey, FanOut>;

/// One transfer's slots on P.
#[derive(Debug)]
pub(crate) struct FanOut {
    /// How many D ranks the transfer is written into.
    pub(crate) slots: u32,
    /// P's KV, once it is placed under every slot.
    ready: Option<Arc<Ready>>,
    /// Slots not ended yet (counted from the placement).
    open: u32,
    outcome: Option<Outcome>,
    bytes: u64,
    runs: u32,
    /// Of `bytes`, those streamed layer by layer (see `Endpoint::layers_ready`).
    streamed_bytes: u64,
    /// Of `bytes`, those written again (see `Event::rewritten_bytes`).
    rewritten_bytes: u64,
    /// A slot's WRITE was reported quarantined: the request's notice, given once.
    noticed: bool,
    /// P aborted the transfer before placing its KV, while layers were being written into some
    /// slots, and answered `InFlight`: the send's event is owed once the last of those streams
    /// ended (see [`release`]).
    owes_abort: bool,
}

impl FanOut {
    pub(crate) fn new(slots: u32) -> Self {
        Self {
            slots,
            ready: None,
            open: slots,
            outcome: None,
            bytes: 0,
            runs: 0,
            streamed_bytes: 0,
            rewritten_bytes: 0,
            noticed: false,
            owes_abort: false,
        }
    }

    /// Whether P's KV was placed under the slots.
    pub(crate) fn is_placed(&self) -> bool {
        self.ready.is_some()
    }

    /// P's KV, once placed.
    pub(crate) fn ready(&self) -> Option<&Arc<Ready>> {
        self.ready.as_ref()
    }

    /// P aborted the transfer with a stream's WRITE in flight, before its KV was placed: the
    /// send ends when the group goes.
    pub(crate) fn abort_in_flight(&mut self) {
        self.owes_abort = !self.is_placed();
    }

    /// Whether the send's event is the group's to report as it goes (see [`abort_in_flight`]).
    ///
    /// [`abort_in_flight`]: Self::abort_in_flight
    pub(crate) fn owes_abort(&self) -> bool {
        self.owes_abort
    }

    /// Whether every slot ended.
    pub(crate) fn is_over(&self) -> bool {
        self.is_placed() && self.open == 0
    }

    /// One slot ended with `outcome`, having written `bytes` in `runs`; true for the last one.
    pub(crate) fn conclude(&mut self, outcome: Outcome, bytes: u64, runs: u32) -> bool {
        self.open = self.open.saturating_sub(1);
        self.bytes += bytes;
        self.runs = self.runs.saturating_add(runs);
        if self.outcome.as_ref().is_none_or(|worst| severity(&outcome) > severity(worst)) {
            self.outcome = Some(outcome);
        }
        self.open == 0
    }

    /// A slot streamed `streamed` of its bytes layer by layer, and wrote `rewritten` of them
    /// again.
    pub(crate) fn add_streamed(&mut self, streamed: u64, rewritten: u64) {
        self.streamed_bytes = self.streamed_bytes.saturating_add(streamed);
        self.rewritten_bytes = self.rewritten_bytes.saturating_add(rewritten);
    }

    /// Whether the transfer still owes its quarantine notice (then it no longer does): one
    /// per request, for the first of its slots' WRITEs past the write timeout.
    pub(crate) fn take_notice(&mut self) -> bool {
        !std::mem::replace(&mut self.noticed, true)
    }

    /// Bytes streamed layer by layer, and bytes written again, over every slot.
    pub(crate) fn streamed_and_rewritten(&self) -> (u64, u64) {
        (self.streamed_bytes, self.rewritten_bytes)
    }

    /// The send's outcome, bytes and runs, over every slot.
    pub(crate) fn result(&self) -> (Outcome, u64, u32) {
        (self.outcome.clone().unwrap_or(Outcome::Done), self.bytes, self.runs)
    }
}

/// How much an outcome matters to whoever holds P's blocks: a quarantined slot keeps them for
/// good, whatever the others did.
fn severity(outcome: &Outcome) -> u8 {
    match outcome {
        Outcome::Done => 0,
        Outcome::Cancelled(_) => 1,
        Outcome::Failed(_) => 2,
        Outcome::Quarantined(_) => 3,
    }
}

/// Places P's KV under every slot of `base` (held until `deadline`). Returns the slots whose
/// registration was waiting: they are to be written. A slot already fenced (its D rank
/// cancelled, or P aborted) ends at once, as cancelled.
pub(crate) fn place(
    shared: &Shared,
    base: &TransferKey,
    group: &mut FanOut,
    ready: &Arc<Ready>,
    deadline: Instant,
    now: Instant,
) -> Vec<Match<Registration, Arc<Ready>>> {
    group.ready = Some(Arc::clone(ready));
    group.open = group.slots;
    let mut matches = Vec::new();
    for slot in 0..group.slots {
        match shared.table.ready(base.slot(slot), Arc::clone(ready), deadline, now) {
            Ok(Arrival::Matched(m)) => matches.push(m),
            Ok(Arrival::Waiting { .. }) => {}
            Err(error) => {
                group.conclude(Outcome::cancelled(Reason::Cancelled, error.to_string()), 0, 0);
            }
        }
    }
    matches
}

/// A slot registration of `base` left the table without being written. If P's KV was never
/// placed and no slot holds a registration now, the group goes (returned: the caller reports
/// the send if it [owes](FanOut::owes_abort) it), and `base` is fenced as `fence` (when given,
/// and when the table holds nothing for it). Takes the groups' lock, then the table's: never
/// call it with a table shard locked.
pub(crate) fn release(
    shared: &Shared,
    base: &TransferKey,
    fence: Option<FenceReason>,
    now: Instant,
) -> Option<FanOut> {
    let mut groups = lock(&shared.fanouts);
    let group = groups.get(base)?;
    if group.is_placed() || (0..group.slots).any(|slot| shared.table.is_live(&base.slot(slot))) {
        return None;
    }
    let group = groups.remove(base);
    if let Some(reason) = fence {
        shared.table.fence_vacant(base, reason, now);
    }
    group
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_send_ends_after_its_last_slot_with_the_worst_outcome() {
        let mut group = FanOut::new(3);
        assert!(!group.is_placed());
        group.open = 3;
        group.ready = None;
        assert!(!group.conclude(Outcome::Done, 10, 1));
        assert!(!group.conclude(Outcome::failed(Reason::WriteError, "broke"), 0, 0));
        assert!(group.conclude(Outcome::cancelled(Reason::Cancelled, "by D"), 5, 2));
        assert_eq!(group.result(), (Outcome::failed(Reason::WriteError, "broke"), 15, 3));
        let mut group = FanOut::new(2);
        group.conclude(Outcome::quarantined("stuck"), 0, 0);
        group.conclude(Outcome::failed(Reason::WriteError, "later"), 0, 0);
        assert_eq!(group.result().0, Outcome::quarantined("stuck"));
    }
}

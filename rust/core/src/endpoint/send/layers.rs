//! P's layer-wise push: the layers of a request's KV that are final go into D's blocks while P
//! still computes the others, so that the request's last WRITE carries only what remains.
//!
//! `Endpoint::layers_ready` hands the writer a range of regions (a layer's K and V, or its
//! latent, in layout order) whose KV is final for the whole prompt. Where D's registration
//! waits in the table, the writer takes it (`begin_stream`: from then on the table holds the
//! key as it holds a write in flight, never expired, a cancel deferred, a re-registration
//! waiting) and posts a WRITE of those regions that notifies nobody. When none of the stream's
//! WRITEs is in flight, the registration goes back (`end_stream`); the table then hands out the
//! match with P's whole KV if it became ready meanwhile, or ends the key if D cancelled, and
//! every cancel deferred meanwhile is acknowledged.
//!
//! Layers that queued up while the writer was busy arrive merged (`command::coalesce_layers`):
//! one WRITE for all of them, so a writer that falls behind posts fewer WRITEs, not more.
//!
//! Regions are streamed in order, from the first: a range that does not continue what was
//! streamed (a layer reported twice or out of order) is left to the last WRITE. The request's
//! WRITE (`Sends::write`) then starts at the first region not streamed, provided it writes into
//! the registration streamed into (same epoch) from the same KV (same blocks, same tokens), and
//! its DONE counts the streamed bytes: D hears one DONE, after every byte. Otherwise it writes
//! every region.
//!
//! A prompt computed in chunks streams chunk by chunk: a chunk's KV is the prompt's tokens so
//! far, and its WRITEs write the tokens D needs of it (`Planner::narrow_destination`). Once a
//! chunk went whole (every region), the next one's first layer starts a new round from D's
//! block holding the chunk's last token (P may have had only part of that block). The request's
//! WRITE goes on from the last chunk streamed: its regions not streamed, or every region from
//! the last chunk streamed whole. A chunk D needs nothing of (inside its prefix hit) counts as
//! written; KV in other blocks (a prefill computed again) starts over.
//!
//! A streamed WRITE that fails, or cannot be posted (D's lease lapsed, its connection is gone),
//! fails the transfer once the stream's other WRITEs are done: D hears a FAIL, and P's KV is
//! refused when it comes (or its send fails, when it came already). A stream's WRITEs get the
//! same lease check as any other; one past `write_timeout` is held, as any WRITE is, until the
//! transport finished with it.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::clock::BootInstant;
use crate::key::TransferKey;
use crate::protocol::{BlockGroup, FailReason, Message};
use crate::rendezvous::{AfterStream, Cancelled, FenceReason, StreamStart};
use crate::side_channel::PeerId;
use crate::sync::lock;
use crate::transport::{Transport, WriteId};

use super::super::context::Context;
use super::super::events::{Event, Outcome, Reason, Role, Timeline};
use super::super::fanout::FanOut;
use super::super::halves::{Ready, Registration};
use super::super::Counters;
use super::{finished, notice_key, release_slot, report_send, Refusal, Sends, Span};

/// What was streamed into one registration of a transfer.
#[derive(Debug)]
pub(in crate::endpoint) struct Stream {
    epoch: u64,
    /// D's registration, held while a WRITE of the stream is in flight (the table holds it the
    /// rest of the time).
    registration: Option<Registration>,
    /// The registration's connection and request, for the replies once it is back in the table.
    peer: PeerId,
    request_id: String,
    /// The KV streamed from: the prompt's, or the part of it computed so far (a chunked prompt
    /// streams chunk by chunk).
    kv: Arc<Ready>,
    /// Every region of the tokens before this one is in D (earlier chunks of the prompt).
    written: u64,
    /// P's tokens per block.
    block_tokens: u64,
    /// Regions `0..streamed` of `kv`'s tokens from `written` on are written or being written.
    streamed: usize,
    in_flight: usize,
    /// What the stream's finished WRITEs moved, and of those bytes the ones written again.
    bytes: u64,
    runs: u32,
    rewritten: u64,
    /// When the stream's first WRITE was posted; `None` before any.
    first_posted: Option<Instant>,
    /// Why the transfer fails: a WRITE of the stream failed or was refused.
    failed: Option<Refusal>,
    /// A WRITE of the stream was reported quarantined: the request's notice, given once.
    noticed: bool,
}

impl Stream {
    fn new(epoch: u64, registration: &Registration, kv: &Arc<Ready>, block_tokens: u64) -> Self {
        Self {
            epoch,
            registration: None,
            peer: registration.peer,
            request_id: registration.register.request_id.clone(),
            kv: Arc::clone(kv),
            written: 0,
            block_tokens,
            streamed: 0,
            in_flight: 0,
            bytes: 0,
            runs: 0,
            rewritten: 0,
            first_posted: None,
            failed: None,
            noticed: false,
        }
    }

    /// Whether `kv` is the KV this stream wrote from: the same tokens, each in the same block.
    /// A group of `kv` may start later, without the blocks before its start (a sliding window
    /// drops those once the prefill ran): the tokens it holds are where they were.
    fn same_kv(&self, kv: &Ready) -> bool {
        let (old, new) = (&self.kv.kv, &kv.kv);
        std::ptr::eq(&*self.kv, kv)
            || (old.num_tokens == new.num_tokens
                && old.groups.len() == new.groups.len()
                && old.groups.iter().zip(&new.groups).all(|(old, new)| {
                    let Some(later) = new.first_token.checked_sub(old.first_token) else {
                        return false;
                    };
                    let skip = usize::try_from(later / self.block_tokens).unwrap_or(usize::MAX);
                    later % self.block_tokens == 0
                        && old.block_ids.get(skip..) == Some(&new.block_ids[..])
                }))
    }

    /// Whether `kv` continues the KV this stream wrote from: more tokens of the same prompt,
    /// in the same blocks and more (a later chunk of it).
    fn extended_by(&self, kv: &Ready) -> bool {
        let (old, new) = (&self.kv.kv, &kv.kv);
        new.num_tokens > old.num_tokens
            && old.groups.len() == new.groups.len()
            && old.groups.iter().zip(&new.groups).all(|(old, new)| {
                old.first_token == new.first_token && new.block_ids.starts_with(&old.block_ids)
            })
    }

    /// Where the next WRITE into this registration starts, if `kv` is the KV it writes: the
    /// first region not streamed of the tokens from `written`, every region of the tokens from
    /// the end of a chunk streamed whole, or (another KV) everything.
    fn resume(&self, kv: &Ready, regions: usize) -> (usize, u64) {
        if self.same_kv(kv) {
            (self.streamed, self.written)
        } else if self.extended_by(kv) && self.streamed >= regions {
            (0, self.kv.kv.num_tokens)
        } else if self.extended_by(kv) {
            (0, self.written)
        } else {
            (0, 0)
        }
    }
}

/// Where the request's WRITE starts, and what its DONE counts besides its own runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(in crate::endpoint) struct Streamed {
    /// The first region the request's WRITE writes.
    pub(super) from: usize,
    /// The tokens before this one are in D, every region of them (earlier chunks): the
    /// request's WRITE starts at the block holding the one before.
    pub(super) written: u64,
    /// Bytes the stream wrote.
    pub(super) bytes: u64,
    /// Runs the stream wrote.
    pub(super) runs: u32,
    /// Of `bytes`, those the stream wrote again (see `Event::rewritten_bytes`).
    pub(super) rewritten: u64,
    /// When the stream's first WRITE was posted.
    pub(super) first_posted: Option<Instant>,
    /// The request's quarantine notice was given for a WRITE of the stream.
    pub(super) noticed: bool,
}

/// A posted WRITE of a stream.
#[derive(Debug)]
pub(in crate::endpoint) struct Partial {
    write: WriteId,
    key: TransferKey,
    /// The transport agent written to (the write holds one use of it).
    agent: String,
    bytes: u64,
    runs: u32,
    rewritten: u64,
    /// When it was posted (boot clock: it counts a stalled VM's time too).
    posted_boot: BootInstant,
    /// Past its write timeout, and reported quarantined (see `notice_overdue_partials`).
    overdue: bool,
}

impl Sends {
    /// P's KV of the regions `regions` is final for the transfer `key` (see the module docs);
    /// every slot of a transfer written into several D ranks is streamed.
    pub(in crate::endpoint) fn stream_layers<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: TransferKey,
        kv: &Arc<Ready>,
        regions: Range<usize>,
    ) {
        let slots = lock(&cx.shared.fanouts).get(&key).map(|group| group.slots);
        match slots {
            Some(slots) => {
                for slot in 0..slots {
                    self.stream(cx, key.slot(slot), kv, regions.clone());
                }
            }
            None => self.stream(cx, key, kv, regions),
        }
    }

    fn stream<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: TransferKey,
        kv: &Arc<Ready>,
        regions: Range<usize>,
    ) {
        // This worker's regions are the planner's on both sides: a range past them is cut.
        let count = cx.layout.regions.len();
        let regions = regions.start.min(count)..regions.end.min(count);
        if regions.is_empty() {
            return;
        }
        let streaming = self.streams.get(&key).is_some_and(|s| s.registration.is_some());
        if !streaming {
            let now = cx.shared.now();
            let StreamStart::Started { epoch, registration } =
                cx.shared.table.begin_stream(&key, now)
            else {
                // No registration waits (the request's WRITE will write every region), or
                // the transfer ended.
                return;
            };
            let stream = match self.streams.remove(&key) {
                Some(s) if s.epoch == epoch && (s.same_kv(kv) || s.extended_by(kv)) => s,
                _ => Stream::new(epoch, &registration, kv, cx.layout.block_tokens.into()),
            };
            let stream = self.streams.entry(key.clone()).or_insert(stream);
            stream.registration = Some(registration);
        }
        if let Some(stream) = self.streams.get_mut(&key) {
            // The first layer of a later chunk, the earlier one streamed whole: go on from it.
            if regions.start == 0 && stream.streamed >= count && stream.extended_by(kv) {
                stream.written = stream.kv.kv.num_tokens;
                stream.kv = Arc::clone(kv);
                stream.streamed = 0;
            }
            let continues = regions.start == stream.streamed && stream.same_kv(kv);
            // D needs tokens of this KV in some group (in none: a chunk inside D's prefix hit,
            // or before a sliding window, counts as written). The groups it needs nothing of
            // yet are written by a later chunk, from their own first token.
            let needed = stream.registration.as_ref().map(|registration| {
                let needs = |g: &BlockGroup| g.first_token < kv.kv.num_tokens;
                registration.register.groups.iter().any(needs)
            });
            // A stream cancelled meanwhile (by D, or by P's abort) writes nothing more: its end
            // waits only for what is in flight.
            let stands = || cx.shared.table.stream_stands(&key, stream.epoch);
            if continues && stream.failed.is_none() && stands() {
                match needed {
                    Some(true) => {
                        if let Some(registration) = stream.registration.take() {
                            self.post_layers(cx, &key, registration, kv, regions);
                        }
                    }
                    Some(false) => stream.streamed = regions.end,
                    None => {}
                }
            }
        }
        self.end_stream_if_idle(cx, &key);
    }

    /// Posts the WRITE of `regions` into the stream's `registration`, and puts it back.
    fn post_layers<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: &TransferKey,
        registration: Registration,
        kv: &Arc<Ready>,
        regions: Range<usize>,
    ) {
        let end = regions.end;
        let written = self.streams.get(key).map_or(0, |stream| stream.written);
        let posted = self.post(cx, key, &registration, kv, Span { regions, written }, None);
        let Some(stream) = self.streams.get_mut(key) else { return };
        stream.registration = Some(registration);
        match posted {
            Ok(posted) => {
                stream.streamed = end;
                stream.in_flight += 1;
                stream.first_posted.get_or_insert_with(|| cx.shared.now());
                Counters::add(&cx.shared.counters.streamed_writes);
                self.partials.push(Partial {
                    write: posted.write,
                    key: key.clone(),
                    agent: posted.agent,
                    bytes: posted.bytes,
                    runs: posted.runs,
                    rewritten: posted.rewritten,
                    posted_boot: cx.shared.boot_now(),
                    overdue: false,
                });
            }
            Err(refusal) => stream.failed = Some(refusal),
        }
    }

    /// Reports a stream's WRITEs past the write timeout (each counted) as its send's quarantine
    /// notice, once per request: as for a request's WRITE, P keeps the source blocks and D its
    /// destination blocks (the table holds the stream's registration, D's cancel waits) until
    /// the transport finished.
    pub(super) fn notice_overdue_partials<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        now: BootInstant,
    ) {
        let timeout = self.write_timeout;
        for partial in &mut self.partials {
            if partial.overdue || now.saturating_duration_since(partial.posted_boot) <= timeout {
                continue;
            }
            partial.overdue = true;
            let Some(stream) = self.streams.get_mut(&partial.key) else { continue };
            Counters::add(&cx.shared.counters.quarantined_writes);
            if std::mem::replace(&mut stream.noticed, true) {
                continue;
            }
            let Some(key) = notice_key(cx, &partial.key) else { continue };
            let detail = format!(
                "transfer {key}: a layer's WRITE is not done after {timeout:?} (a stalled process \
                 or link, or a slow peer); P keeps its source blocks, and D its destination \
                 blocks, until the transport has finished with it"
            );
            cx.emit(Event {
                role: Role::Send,
                request_id: stream.kv.kv.request_id.clone(),
                key,
                outcome: Outcome::quarantined(detail),
                bytes: partial.bytes,
                runs: partial.runs,
                streamed_bytes: stream.bytes,
                rewritten_bytes: partial.rewritten,
                timeline: Timeline {
                    ready: None,
                    streamed: stream.first_posted.map(|at| cx.seconds(at)),
                    ..Timeline::default()
                },
            });
        }
    }

    /// Polls the streams' WRITEs; a stream with none left in flight ends.
    pub(super) fn poll_partials<T: Transport>(&mut self, cx: &mut Context<T>) {
        for (partial, result) in finished(&mut cx.transport, &mut self.partials, |p| p.write) {
            self.release_agent(cx, &partial.agent);
            if let Some(stream) = self.streams.get_mut(&partial.key) {
                stream.in_flight = stream.in_flight.saturating_sub(1);
                match result {
                    Ok(()) => {
                        stream.bytes = stream.bytes.saturating_add(partial.bytes);
                        stream.runs = stream.runs.saturating_add(partial.runs);
                        stream.rewritten = stream.rewritten.saturating_add(partial.rewritten);
                    }
                    Err(e) => {
                        let detail =
                            format!("transfer {}: a layer's WRITE failed: {e}", partial.key);
                        let refusal = (FailReason::WriteError, Reason::WriteError, detail);
                        stream.failed.get_or_insert(refusal);
                    }
                }
            }
            self.end_stream_if_idle(cx, &partial.key);
        }
    }

    /// Gives a stream's registration back to the table once none of its WRITEs is in flight,
    /// and acts on what the key holds then (see the module docs).
    fn end_stream_if_idle<T: Transport>(&mut self, cx: &mut Context<T>, key: &TransferKey) {
        let Some(stream) = self.streams.get_mut(key) else { return };
        if stream.in_flight > 0 {
            return;
        }
        let Some(registration) = stream.registration.take() else { return };
        let (epoch, peer, wrote) = (stream.epoch, stream.peer, stream.first_posted.is_some());
        let request_id = stream.request_id.clone();
        let now = cx.shared.now();
        let Ok(ended) = cx.shared.table.end_stream(key, epoch, registration, now) else {
            // Unreachable: only `end_stream` ends a stream.
            self.streams.remove(key);
            return;
        };
        let owed = ended.cancel_acknowledged.then_some(peer);
        // Not delivered: the request's DONE was not sent.
        self.acknowledge_cancels(cx, key, epoch, &request_id, owed, (wrote, false));
        match ended.next {
            AfterStream::Cancelled { registration, ready } => {
                let streamed = self.streams.remove(key);
                // P's abort: now that no WRITE of the stream can land, D hears it unless it
                // cancelled too (acknowledged above; otherwise it would wait for the KV until
                // its TTL), and P's send ends, as the abort's `InFlight` promised: a transfer
                // written into several D ranks ends with its group, once no slot streams.
                let aborted = ended.aborted;
                if aborted && owed.is_none() {
                    let fail = registration.aborted(&format!("P aborted request {request_id}"));
                    cx.send(registration.peer, Message::Fail(fail));
                }
                let abort_ended = || {
                    let detail = format!("P aborted request {request_id}");
                    Outcome::cancelled(Reason::Aborted, detail)
                };
                match (ready, streamed) {
                    (Some(ready), _) => {
                        let detail = format!("D cancelled transfer {key}");
                        let outcome = Outcome::cancelled(Reason::Cancelled, detail);
                        report_send(cx, &ready, key.as_str(), outcome, None);
                    }
                    (None, Some(stream)) if aborted && key.split_slot().is_none() => {
                        report_send(cx, &stream.kv, key.as_str(), abort_ended(), None);
                    }
                    (None, streamed) => {
                        let group = release_slot(&cx.shared, key, FenceReason::Cancelled, now);
                        if let (Some(stream), Some((base, _))) = (streamed, key.split_slot()) {
                            if group.is_some_and(|group| group.owes_abort()) {
                                report_send(cx, &stream.kv, base.as_str(), abort_ended(), None);
                            }
                        }
                    }
                }
            }
            AfterStream::Waiting { superseded } => {
                let failed = self.streams.get_mut(key).and_then(|s| s.failed.take());
                if superseded.is_some() {
                    // A newer registration, whose blocks hold nothing of the stream.
                    self.streams.remove(key);
                } else if let Some(refusal) = failed {
                    self.fail_stream(cx, key, refusal);
                }
            }
            AfterStream::Matched { matched, superseded } => {
                if superseded.is_some() {
                    self.streams.remove(key);
                }
                // The request's WRITE takes what was streamed from `streams`, or its failure.
                self.write(cx, matched);
            }
        }
    }

    /// A stream failed before P's KV was ready: the transfer ends, D hears why, and P's KV is
    /// refused when it comes.
    fn fail_stream<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: &TransferKey,
        (reason, _, detail): Refusal,
    ) {
        self.streams.remove(key);
        let now = cx.shared.now();
        if let Cancelled::Removed { registration: Some(registration), ready } =
            cx.shared.table.cancel(key, None, now)
        {
            cx.send(registration.peer, Message::Fail(registration.fail(reason, detail.clone())));
            match ready {
                Some(ready) => {
                    let outcome = Outcome::failed(Reason::WriteError, detail);
                    report_send(cx, &ready, key.as_str(), outcome, None);
                }
                None => {
                    release_slot(&cx.shared, key, FenceReason::Cancelled, now);
                }
            }
        }
        // Anything else: D cancelled, or the key ended, meanwhile; D heard of it already.
    }

    /// What the request's WRITE into (`key`, `epoch`) of `ready` skips, having been streamed;
    /// or why it must not be posted (a WRITE of the stream failed).
    pub(super) fn streamed(
        &mut self,
        key: &TransferKey,
        epoch: u64,
        ready: &Ready,
        regions: usize,
    ) -> Result<Streamed, Refusal> {
        let current = self.streams.get(key).is_some_and(|s| s.registration.is_none());
        let Some(stream) = current.then(|| self.streams.remove(key)).flatten() else {
            return Ok(Streamed::default());
        };
        if stream.epoch != epoch {
            return Ok(Streamed::default());
        }
        if let Some(refusal) = stream.failed {
            return Err(refusal);
        }
        let (from, written) = stream.resume(ready, regions);
        Ok(Streamed {
            from,
            written,
            bytes: stream.bytes,
            runs: stream.runs,
            rewritten: stream.rewritten,
            first_posted: stream.first_posted,
            noticed: stream.noticed,
        })
    }

    /// Whether a WRITE of a stream into (`key`, `epoch`) is in flight.
    pub(super) fn streaming(&self, key: &TransferKey, epoch: u64) -> bool {
        self.streams.get(key).is_some_and(|s| s.registration.is_some() && s.epoch == epoch)
    }

    /// Forgets the streams of transfers that ended without their request's WRITE (D cancelled
    /// or expired between two streams): their records would otherwise stay.
    pub(in crate::endpoint) fn prune_streams<T: Transport>(&mut self, cx: &Context<T>) {
        let table = &cx.shared.table;
        self.streams.retain(|key, s| s.registration.is_some() || table.is_live(key));
    }

    /// The writer stops: the streams' WRITEs are abandoned (D is not told, as for any WRITE the
    /// transport will not finish) and their records dropped. P's engine still waits for the
    /// sends of prefills it aborted mid-stream (the abort answered `InFlight`): they end now,
    /// as `outcome` says, once per transfer (a transfer written into several D ranks once for
    /// all of them). Call it before the table is drained.
    pub(super) fn cut_partials<T: Transport>(&mut self, cx: &Context<T>, outcome: &Outcome) {
        self.partials.clear();
        // In key order: the endpoint's events come in an order a seed replays (see `sim`).
        let mut streams: Vec<(TransferKey, Stream)> = self.streams.drain().collect();
        streams.sort_by(|(a, _), (b, _)| a.as_str().cmp(b.as_str()));
        for (key, stream) in streams {
            let table = &cx.shared.table;
            if stream.registration.is_none() || !table.stream_aborted(&key) {
                continue;
            }
            // Where the table holds P's KV (offered before the abort), its drain ends the send.
            let send = match key.split_slot() {
                None if !table.has_ready(&key) => key,
                None => continue,
                Some((base, _)) => {
                    let mut groups = lock(&cx.shared.fanouts);
                    if !groups.get(&base).is_some_and(FanOut::owes_abort) {
                        continue;
                    }
                    groups.remove(&base);
                    base
                }
            };
            report_send(cx, &stream.kv, send.as_str(), outcome.clone(), None);
        }
    }
}

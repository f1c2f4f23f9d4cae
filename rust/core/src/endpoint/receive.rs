//! D's receive path: from `Endpoint::expect` to the request's `Receive` event.
//!
//! For each P rank an expectation names (a *leg*, see [`awaited`](super::awaited)), the writer
//! connects to that P if it has no connection yet (through the link, without waiting), checks
//! that the P rank holds the heads this rank expects from it, and sends the REGISTER that puts
//! D's blocks in P's table. It then counts the DONE notifications the
//! transport delivers (each only from the agent the leg registered with, for the current epoch)
//! and acts on P's FAILs and CANCEL_ACKs. A cancel, a TTL that passed or a leg's failure sends
//! CANCELs to the legs that may still be written; a P that does not acknowledge within its
//! write horizon is disconnected. A lost P's legs end only on evidence that none of its bytes
//! can land any more (the fence: see `awaited` and `writer`): the writer reconnects to that P
//! and asks again (a CANCEL, which P acknowledges once its transport finished with the
//! transfer), or finds its endpoint gone. Until then the receive holds its blocks, and once P's
//! horizon passed without evidence it is reported *quarantined* (a notice, once). The receive
//! is reported once, when its last leg is over.
//!
//! `awaited` holds the per-request state and its rules; this module does the I/O they call for.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::protocol::{Cancel, Decoder, Done, FailReason, Limits, Message, Register, Secret};
use crate::side_channel::{PeerId, PeerInfo};
use crate::transport::{Notification, Transport};

use super::awaited::{Awaited, LegState, Stop};
use super::events::{Event, Outcome, Reason, Role, Timeline};
use super::writer::{ConnectFailure, Writer, MAX_HORIZON};
use super::{Counters, Expectation, Share};

/// A side channel connection to a P, by its address.
#[derive(Debug)]
enum Source {
    Connecting,
    Connected(PeerId),
}

/// The receive path's state in the writer.
pub(super) struct Receives {
    /// The receives awaited, by D's request id (in order: the writer's I/O for them is then
    /// the same from run to run, which the simulation's replays rely on).
    awaited: BTreeMap<String, Awaited>,
    /// Some awaited receive is not fenced (its DONEs may come any moment): poll busily.
    /// Set by every new expectation, recomputed at each deadline check, so that the poll period
    /// does not scan `awaited` on every turn of the loop.
    awaits_kv: bool,
    sources: HashMap<String, Source>,
    /// Checks the DONEs P's WRITEs deliver.
    decoder: Decoder,
    /// Notifications taken from the transport (reused between turns).
    received: Vec<Notification>,
    /// P addresses D must ask again (some lost leg of theirs waits for evidence), with when the
    /// next attempt to connect is due and the wait after it.
    retries: HashMap<String, Retry>,
}

/// When D tries again to reach a lost P.
#[derive(Debug, Clone, Copy)]
struct Retry {
    next: Instant,
    backoff: Duration,
}

/// The first wait between attempts to reach a lost P, and the longest.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

impl std::fmt::Debug for Receives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receives")
            .field("awaited", &self.awaited.len())
            .field("sources", &self.sources.len())
            .finish_non_exhaustive()
    }
}

impl Receives {
    pub(super) fn new(secret: Option<Secret>, limits: Limits) -> Self {
        Self {
            awaited: BTreeMap::new(),
            awaits_kv: false,
            sources: HashMap::new(),
            decoder: Decoder::new(secret, limits),
            received: Vec::new(),
            retries: HashMap::new(),
        }
    }

    /// Whether a DONE may come any moment (the writer then polls busily).
    pub(super) fn awaits_kv(&self) -> bool {
        self.awaits_kv
    }

    /// The earliest moment a lost P's horizon passes, while a receive waits for one.
    pub(super) fn next_fence(&self) -> Option<Instant> {
        self.awaited.values().filter_map(Awaited::next_fence).min()
    }
}

impl<T: Transport> Writer<T> {
    pub(super) fn expect(&mut self, expectation: Expectation, at: Instant) {
        let mut key =
            TransferKey::for_request(expectation.transfer_id.as_deref(), &expectation.request_id);
        if let Some(share) = expectation.share.filter(|share| share.of > 1) {
            // P writes this transfer into several D ranks, each under its own slot.
            key = key.slot(share.slot);
        }
        let request_id = expectation.request_id.clone();
        let sources = expectation.sources.clone();
        // A re-registration (higher epoch) replaces the old wait; P supersedes the old one.
        self.receives.awaited.insert(request_id.clone(), Awaited::new(expectation, key, at));
        self.receives.awaits_kv = true;
        for (leg, source) in sources.into_iter().enumerate() {
            match self.receives.sources.get(&source) {
                Some(Source::Connected(peer)) => {
                    let peer = *peer;
                    self.register_with(peer, &request_id, leg);
                }
                Some(Source::Connecting) => {}
                None => {
                    self.receives.sources.insert(source.clone(), Source::Connecting);
                    self.request_connect(source);
                }
            }
        }
        self.settle(&request_id);
    }

    /// Starts connecting to P at `source`; the result comes as `Command::Connected`.
    fn request_connect(&mut self, source: String) {
        if let Err(failure) = self.side_channel.request_connect(&source) {
            self.connected(source, Err(failure));
        }
    }

    pub(super) fn connected(&mut self, source: String, result: Result<PeerInfo, ConnectFailure>) {
        let waiting: Vec<(String, usize)> = self
            .receives
            .awaited
            .iter()
            .flat_map(|(id, a)| {
                a.legs
                    .iter()
                    .enumerate()
                    .filter(|(_, leg)| {
                        matches!(leg.state, LegState::Connecting) && leg.source == source
                    })
                    .map(move |(leg, _)| (id.clone(), leg))
            })
            .collect();
        match result {
            Ok(info) => {
                self.receives.sources.insert(source.clone(), Source::Connected(info.id));
                for (request_id, leg) in waiting {
                    self.register_with(info.id, &request_id, leg);
                }
                self.ask_again(&source, info.id);
            }
            Err(failure) => {
                self.receives.sources.remove(&source);
                for (request_id, leg) in waiting {
                    let Some(awaited) = self.receives.awaited.get(&request_id) else { continue };
                    let detail = format!("cannot reach {}: {}", awaited.label(leg), failure.reason);
                    self.end_leg(
                        &request_id,
                        leg,
                        Some(Outcome::failed(Reason::Unreachable, detail)),
                    );
                }
                if failure.refused {
                    // Nothing listens where that P was: its endpoint closed (dropping its
                    // transport first) or its process exited. A host that refuses for a
                    // firewall while P lives would look the same, so the legs still wait out
                    // P's whole horizon, which a running P keeps.
                    let now = self.shared.now();
                    let evidence = format!(
                        "nothing listens at {source} any more: its endpoint is gone, and D waited \
                         out its write horizon"
                    );
                    self.settle_source(&source, |leg| Some(now + leg.horizon), &evidence);
                }
            }
        }
    }

    /// Asks the P behind the new connection `peer` at `source` about the legs D lost with it:
    /// the same endpoint answers a CANCEL once nothing of the transfer can land; another
    /// endpoint at that address means the one D lost is gone, so only the bytes its host had
    /// already accepted may still land (for its delivery bound).
    fn ask_again(&mut self, source: &str, peer: PeerId) {
        let Some(agent) = self.peers.get(&peer).map(|p| p.name.clone()) else { return };
        let now = self.shared.now();
        let mut asks = Vec::new();
        for (request_id, awaited) in &mut self.receives.awaited {
            for leg in awaited.unsettled(source) {
                if awaited.legs[leg].agent.as_deref() == Some(agent.as_str()) {
                    awaited.ask(leg, peer);
                    asks.push(Cancel {
                        transfer_key: awaited.key.as_str().to_owned(),
                        request_id: request_id.clone(),
                        epoch: awaited.expectation.epoch,
                    });
                } else {
                    let bound = awaited.legs[leg].delivery_bound;
                    let evidence = format!(
                        "another endpoint ({agent}) answers at {source}: the one D lost is gone, \
                         and its host's accepted bytes had {bound:.1?} more to land"
                    );
                    awaited.gone(leg, now + bound, &evidence);
                }
            }
        }
        for cancel in asks {
            self.send(peer, Message::Cancel(cancel));
        }
        self.receives.retries.remove(source);
    }

    /// Every lost leg of P at `source` that waits for evidence learns that P's endpoint is gone;
    /// `settled` says when its accepted bytes stop landing.
    fn settle_source(
        &mut self,
        source: &str,
        settled: impl Fn(&super::awaited::Leg) -> Option<Instant>,
        evidence: &str,
    ) {
        for awaited in self.receives.awaited.values_mut() {
            for leg in awaited.unsettled(source) {
                if let Some(at) = settled(&awaited.legs[leg]) {
                    awaited.gone(leg, at, evidence);
                }
            }
        }
        self.receives.retries.remove(source);
    }

    /// Reconnects to every lost P that some leg still waits for evidence from, with a growing
    /// pause between attempts, or asks it on a connection already up again.
    fn settle_lost(&mut self, now: Instant) {
        let mut sources: Vec<String> = self
            .receives
            .awaited
            .values()
            .filter(|a| a.needs_settling())
            .flat_map(|a| a.legs.iter().map(|leg| leg.source.clone()))
            .collect();
        sources.sort();
        sources.dedup();
        for source in sources {
            if !self.receives.awaited.values().any(|a| !a.unsettled(&source).is_empty()) {
                continue;
            }
            match self.receives.sources.get(&source) {
                Some(Source::Connecting) => {}
                Some(Source::Connected(peer)) => {
                    let peer = *peer;
                    self.ask_again(&source, peer);
                }
                None => {
                    let retry = self
                        .receives
                        .retries
                        .entry(source.clone())
                        .or_insert(Retry { next: now, backoff: RETRY_FIRST });
                    if retry.next > now {
                        continue;
                    }
                    retry.next = now + retry.backoff;
                    retry.backoff = (retry.backoff * 2).min(RETRY_MAX);
                    self.receives.sources.insert(source.clone(), Source::Connecting);
                    self.request_connect(source);
                }
            }
        }
    }

    fn register_with(&mut self, peer: PeerId, request_id: &str, leg: usize) {
        let agent = self.peers.get(&peer).map(|p| p.name.clone());
        let horizon = self.horizon(peer);
        let delivery_bound = self.peers.get(&peer).map_or(horizon, |p| p.delivery_bound);
        let mismatch =
            self.receives.awaited.get(request_id).and_then(|a| self.source_mismatch(peer, a, leg));
        let Some(awaited) = self.receives.awaited.get_mut(request_id) else { return };
        if !matches!(awaited.legs[leg].state, LegState::Connecting) {
            // Cancelled (or failed) while connecting: nothing to register.
            return;
        }
        if let Some(detail) = mismatch {
            self.end_leg(request_id, leg, Some(Outcome::failed(Reason::Incompatible, detail)));
            return;
        }
        awaited.legs[leg].peer = Some(peer);
        awaited.legs[leg].agent = agent;
        awaited.legs[leg].horizon = horizon;
        awaited.legs[leg].delivery_bound = delivery_bound;
        awaited.legs[leg].state = LegState::Registered;
        let e = &awaited.expectation;
        let ttl_ms = u64::try_from(
            awaited.deadline.saturating_duration_since(self.shared.now()).as_millis(),
        )
        .unwrap_or(u64::MAX);
        let register = Register {
            transfer_key: awaited.key.as_str().to_owned(),
            request_id: e.request_id.clone(),
            epoch: e.epoch,
            engine_id: self.engine_id.clone(),
            address: self.side_channel.local_addr().to_string(),
            tp_rank: self.layout.tp_rank,
            tp_size: self.layout.tp_size,
            groups: e.groups.clone(),
            num_tokens: e.num_tokens,
            ttl_ms,
            fanout: e.share.map_or(1, |share| share.of),
        };
        if let Err(error) = self.side_channel.send(peer, &Message::Register(register)) {
            // The frame did not go out whole, so P refuses it: nothing can be written.
            let detail = format!("cannot register with {}: {error}", awaited.label(leg));
            self.end_leg(request_id, leg, Some(Outcome::failed(Reason::Unreachable, detail)));
        }
    }

    /// Why the P rank behind `peer` cannot be leg `leg` of `awaited`: it holds none of this
    /// rank's heads, or this rank's heads come from a different number of P ranks than the
    /// expectation names (a router that left out P's tensor parallel size would otherwise get
    /// half the heads reported done).
    fn source_mismatch(&self, peer: PeerId, awaited: &Awaited, leg: usize) -> Option<String> {
        let p = self.peers.get(&peer)?;
        let mine = self.layout.global_heads();
        let label = awaited.label(leg);
        if p.heads.end <= mine.start || mine.end <= p.heads.start {
            return Some(format!(
                "{label} holds KV heads {:?} of tp={}, none of this D rank's {mine:?}",
                p.heads, p.tp_size
            ));
        }
        let (theirs, ours) = (p.heads.end - p.heads.start, mine.end - mine.start);
        if theirs > ours {
            // One P rank holds the heads of several D ranks: this one must be its share.
            let share = awaited.expectation.share.unwrap_or(Share { slot: 0, of: 1 });
            let expected = Share {
                slot: u32::try_from((mine.start - p.heads.start) / ours).unwrap_or(u32::MAX),
                of: u32::try_from(theirs / ours).unwrap_or(u32::MAX),
            };
            return (share != expected).then(|| {
                format!(
                    "{label} holds KV heads {:?}, the heads of {} D ranks; this rank (heads \
                     {mine:?}) is share {} of {}, but the request says {} of {}",
                    p.heads, expected.of, expected.slot, expected.of, share.slot, share.of
                )
            });
        }
        let per_rank = theirs.max(1);
        let needed = (mine.end - 1) / per_rank - mine.start / per_rank + 1;
        let named = awaited.legs.len() as u64;
        (needed != named).then(|| {
            format!(
                "this D rank's KV heads {mine:?} come from {needed} rank(s) of P (tp={}), but the \
                 request names {named}: the router must pass P's tp_size in kv_transfer_params",
                p.tp_size
            )
        })
    }

    /// The horizon of the P behind `peer` (the longest one when it is unknown).
    fn horizon(&self, peer: PeerId) -> Duration {
        self.peers.get(&peer).map_or(MAX_HORIZON, |p| p.horizon)
    }

    /// The horizon of the P whose agent is `agent`: how long after posting its WRITE's DONE
    /// may still arrive. Zero for an agent no connection names (its DONEs are strays anyway).
    fn horizon_of_agent(&self, agent: &str) -> Duration {
        self.peers.values().filter(|p| p.name == agent).map(|p| p.horizon).max().unwrap_or_default()
    }

    /// Leg `leg` of `request_id` is over (with `failure`, the receive fails and its other legs
    /// are cancelled); the receive is reported once its last leg is over.
    fn end_leg(&mut self, request_id: &str, leg: usize, failure: Option<Outcome>) {
        let Some(awaited) = self.receives.awaited.get_mut(request_id) else { return };
        let stops = awaited.end_leg(leg, failure);
        self.stop_legs(request_id, &stops);
        self.settle(request_id);
    }

    /// The receive ends with `outcome` once no leg can still write: registered legs are
    /// cancelled, fenced ones wait out their horizons.
    fn cancel_receive(&mut self, request_id: &str, outcome: Outcome) {
        let Some(awaited) = self.receives.awaited.get_mut(request_id) else { return };
        let stops = awaited.cancel(outcome);
        self.stop_legs(request_id, &stops);
        self.settle(request_id);
    }

    /// Sends the CANCELs `stops` calls for; each P must acknowledge within its horizon.
    fn stop_legs(&mut self, request_id: &str, stops: &[Stop]) {
        for &Stop::Cancel(peer) in stops {
            let deadline = self.shared.now() + self.horizon(peer);
            let Some(awaited) = self.receives.awaited.get_mut(request_id) else { return };
            if let Some(leg) = awaited.leg_on(peer) {
                awaited.legs[leg].state = LegState::Cancelling { deadline: Some(deadline) };
            }
            let cancel = Cancel {
                transfer_key: awaited.key.as_str().to_owned(),
                request_id: request_id.to_owned(),
                epoch: awaited.expectation.epoch,
            };
            self.send(peer, Message::Cancel(cancel));
        }
    }

    pub(super) fn cancel_expectation(&mut self, request_id: &str) {
        let outcome =
            Outcome::cancelled(Reason::Cancelled, format!("request {request_id} cancelled by D"));
        self.cancel_receive(request_id, outcome);
    }

    /// Reports `request_id`'s receive if its last leg is over.
    fn settle(&mut self, request_id: &str) {
        let Some(awaited) = self.receives.awaited.get_mut(request_id) else { return };
        if !awaited.is_over() {
            return;
        }
        let outcome = awaited.outcome();
        self.end_receive(request_id, outcome);
    }

    fn end_receive(&mut self, request_id: &str, outcome: Outcome) {
        let Some(awaited) = self.receives.awaited.remove(request_id) else { return };
        let completed = self.shared.now();
        self.emit(Event {
            role: Role::Receive,
            request_id: request_id.to_owned(),
            key: awaited.key,
            outcome,
            bytes: awaited.bytes,
            runs: awaited.runs,
            timeline: Timeline {
                registered: Some(self.seconds(awaited.registered)),
                completed: Some(self.seconds(completed)),
                ..Timeline::default()
            },
        });
    }

    /// Takes the transport's notifications (a transport without its own progress thread is
    /// progressed by this call) and counts the DONEs among them.
    pub(super) fn take_notifications(&mut self) {
        if self.transport.take_notifications(&mut self.receives.received).is_err() {
            Counters::add(&self.shared.counters.transport_errors);
            return;
        }
        let received = std::mem::take(&mut self.receives.received);
        for notification in &received {
            // DONEs arrive in completion order, not posting order, and as late as their WRITE
            // took: up to the sending P's write horizon (see `decode_unordered`).
            let in_flight = self.horizon_of_agent(&notification.from);
            match self.receives.decoder.decode_unordered(
                &notification.payload,
                self.shared.unix_millis(),
                in_flight,
            ) {
                Ok(envelope) => {
                    if let Message::Done(done) = envelope.message {
                        self.done(&notification.from, done);
                    }
                }
                Err(_) => Counters::add(&self.shared.counters.refused_frames),
            }
        }
        self.receives.received = received;
        self.receives.received.clear();
    }

    fn done(&mut self, from: &str, done: Done) {
        // Only the P agent a leg registered with may end it: a DONE from anyone else, for an
        // ended receive, or for an older epoch (blocks D has since re-registered) is stray.
        let leg = self
            .receives
            .awaited
            .get(&done.request_id)
            .filter(|a| a.key.as_str() == done.transfer_key && a.expectation.epoch == done.epoch)
            .and_then(|a| a.leg_of_agent(from));
        let (Some(leg), Some(awaited)) = (leg, self.receives.awaited.get_mut(&done.request_id))
        else {
            Counters::add(&self.shared.counters.stray_notifications);
            return;
        };
        awaited.bytes += done.bytes;
        awaited.runs = awaited.runs.saturating_add(done.runs);
        // Whatever D wanted since (a cancel, another rank's failure), this leg's KV is here.
        self.end_leg(&done.request_id, leg, None);
    }

    /// A control message from P for D's receives: a FAIL or a CANCEL_ACK ends its leg.
    pub(super) fn peer_message(&mut self, peer: PeerId, message: Message) {
        match message {
            Message::Fail(fail) => {
                let Some(awaited) = self
                    .receives
                    .awaited
                    .get(&fail.request_id)
                    .filter(|a| a.expectation.epoch == fail.epoch)
                else {
                    return;
                };
                let Some(leg) = awaited
                    .leg_on(peer)
                    .filter(|&leg| !matches!(awaited.legs[leg].state, LegState::Over))
                else {
                    return;
                };
                let detail =
                    format!("{}: {} ({})", awaited.label(leg), fail.detail, fail.reason.as_str());
                let outcome = match fail.reason {
                    // P's WRITE may still be landing: whatever D wanted, the blocks stay held.
                    FailReason::Quarantined => Outcome::quarantined(detail),
                    reason => Outcome::failed(Reason::of_fail(&reason), detail),
                };
                self.end_leg(&fail.request_id, leg, Some(outcome));
            }
            Message::CancelAck(ack) => {
                let Some(awaited) = self
                    .receives
                    .awaited
                    .get_mut(&ack.request_id)
                    .filter(|a| a.expectation.epoch == ack.epoch)
                else {
                    return;
                };
                let cancelled = awaited
                    .leg_on(peer)
                    .filter(|&leg| matches!(awaited.legs[leg].state, LegState::Cancelling { .. }));
                if let Some(leg) = cancelled {
                    self.end_leg(&ack.request_id, leg, None);
                } else if let Some(leg) = awaited.leg_asked_on(peer) {
                    // A lost P's word, asked on a new connection: nothing more of it can land.
                    let evidence = format!(
                        "{} confirmed, once its transport had finished with the transfer, that \
                         nothing more of it can land",
                        awaited.label(leg)
                    );
                    let stops = awaited.settle_leg(leg, &evidence);
                    self.stop_legs(&ack.request_id, &stops);
                    self.settle(&ack.request_id);
                }
            }
            // Error replies, stray DONEs on the side channel: nothing is waiting on them.
            _ => {}
        }
    }

    /// The connection `peer` to a P closed at `at`. A lost connection is not proof that P
    /// stopped, nor is P's horizon passing (a stopped process keeps no horizon): its legs end
    /// only on evidence (see `awaited`), which the deadline checks go and get.
    pub(super) fn fence_receives(&mut self, peer: PeerId, reason: &str, at: Instant) {
        self.receives
            .sources
            .retain(|_, source| !matches!(source, Source::Connected(p) if *p == peer));
        for (request_id, awaited) in &mut self.receives.awaited {
            let Some(leg) = awaited.leg_on(peer).or_else(|| awaited.leg_asked_on(peer)) else {
                continue;
            };
            let outcome = Outcome::failed(
                Reason::PeerLost,
                format!("lost {} for request {request_id}: {reason}", awaited.label(leg)),
            );
            awaited.fence(peer, at, &outcome);
        }
    }

    /// D's deadlines: receives whose TTL passed are cancelled, fenced legs whose horizon passed
    /// end, and a P that left a CANCEL unacknowledged past its horizon is disconnected.
    pub(super) fn check_receives(&mut self, now: Instant) {
        self.receives.awaits_kv = self.receives.awaited.values().any(Awaited::expects_writes);
        if self.receives.awaited.is_empty() {
            return;
        }
        let mut unacknowledged = Vec::new();
        let mut due = Vec::new();
        for (request_id, awaited) in &mut self.receives.awaited {
            let stops = awaited.fences_passed(now);
            unacknowledged.extend(awaited.unacknowledged(now));
            let late = !awaited.is_ending() && awaited.deadline <= now;
            if !stops.is_empty() || late || awaited.is_over() {
                due.push((request_id.clone(), stops, late));
            }
        }
        let mut notices = Vec::new();
        for (request_id, awaited) in &mut self.receives.awaited {
            if awaited.quarantine_due(now) {
                notices.push(request_id.clone());
            }
        }
        for request_id in notices {
            self.quarantine_notice(&request_id);
        }
        for (request_id, stops, late) in due {
            self.stop_legs(&request_id, &stops);
            if late {
                let Some(awaited) = self.receives.awaited.get(&request_id) else { continue };
                let detail =
                    format!("no KV for request {request_id} within {:?}", awaited.expectation.ttl);
                // Free nothing until every P confirmed no write can land (or its horizon passed).
                self.cancel_receive(&request_id, Outcome::failed(Reason::Expired, detail));
            }
            self.settle(&request_id);
        }
        // P did not answer a CANCEL within its horizon: stop proving we are alive to it, so that
        // its lease runs out; the leg is then fenced (see `fence_receives`).
        for peer in unacknowledged {
            self.side_channel.disconnect(peer);
        }
        self.settle_lost(now);
    }

    /// Reports, once, that `request_id`'s receive holds its blocks without evidence that a lost
    /// P's bytes can no longer land: its horizon passed, and it neither answered nor was found
    /// gone. The receive's own event still comes once it settles (or never, if it never does).
    fn quarantine_notice(&mut self, request_id: &str) {
        let Some(awaited) = self.receives.awaited.get(request_id) else { return };
        Counters::add(&self.shared.counters.quarantined_receives);
        let detail = format!(
            "request {request_id}: lost {} and its write horizon passed without P confirming \
             that nothing more of it can land (a paused or partitioned P looks the same as a dead \
             one); the KV blocks stay held until P answers or is found gone",
            awaited.unsettled_labels()
        );
        let event = Event {
            role: Role::Receive,
            request_id: request_id.to_owned(),
            key: awaited.key.clone(),
            outcome: Outcome::quarantined(detail),
            bytes: awaited.bytes,
            runs: awaited.runs,
            timeline: Timeline {
                registered: Some(self.seconds(awaited.registered)),
                ..Timeline::default()
            },
        };
        self.emit(event);
    }

    /// The writer died at `at` (see `Writer::die`), its peers disconnected: every receive fails,
    /// once each of its registered P ranks' horizons passed (unregistered legs are over now).
    pub(super) fn fail_receives(&mut self, reason: &str, at: Instant) {
        let ids: Vec<String> = self.receives.awaited.keys().cloned().collect();
        for request_id in ids {
            let Some(awaited) = self.receives.awaited.get(&request_id) else { continue };
            let peers: Vec<PeerId> = awaited.legs.iter().filter_map(|leg| leg.peer).collect();
            let Some(awaited) = self.receives.awaited.get_mut(&request_id) else { continue };
            let outcome = Outcome::failed(Reason::WriterDied, reason.to_owned());
            // Unregistered legs are over; registered ones may be written: with nobody left to
            // ask P, they are held, and reported quarantined once P's horizon passed.
            let _ = awaited.cancel(outcome.clone());
            for peer in peers {
                awaited.fence(peer, at, &outcome);
            }
            self.settle(&request_id);
        }
    }

    /// A dead writer's answer to a new expectation: it fails at once (nothing was registered).
    pub(super) fn refuse_expectation(&mut self, expectation: Expectation, reason: &str) {
        let detail = format!("request {}: {reason}", expectation.request_id);
        self.receives.awaited.remove(&expectation.request_id);
        self.emit(Event {
            role: Role::Receive,
            key: TransferKey::for_request(
                expectation.transfer_id.as_deref(),
                &expectation.request_id,
            ),
            request_id: expectation.request_id,
            outcome: Outcome::failed(Reason::WriterDied, detail),
            bytes: 0,
            runs: 0,
            timeline: Timeline::default(),
        });
    }

    /// A dead writer's receives whose P's horizon passed by `now` are reported quarantined and
    /// forgotten (their blocks stay held: nobody can ask P any more). No CANCEL goes out: the
    /// peers were disconnected.
    pub(super) fn pass_fences(&mut self, now: Instant) {
        let ids: Vec<String> = self.receives.awaited.keys().cloned().collect();
        for request_id in ids {
            let Some(awaited) = self.receives.awaited.get_mut(&request_id) else { continue };
            if awaited.quarantine_due(now) {
                self.quarantine_notice(&request_id);
                self.receives.awaited.remove(&request_id);
                continue;
            }
            self.settle(&request_id);
        }
    }

    /// The endpoint closes: every receive still awaited fails (the link, closed after the
    /// writer, ends its connection attempts).
    pub(super) fn close_receives(&mut self) {
        let awaited: Vec<String> = self.receives.awaited.keys().cloned().collect();
        for request_id in awaited {
            self.end_receive(&request_id, Outcome::failed(Reason::Closed, "the endpoint closed"));
        }
    }
}

//! D's receive path: from `Endpoint::expect` to the request's `Receive` event.
//!
//! For each P rank an expectation names (a *leg*, see [`awaited`](super::awaited)), the writer
//! connects to that P if it has no connection yet (through the link, without waiting: see
//! `link` and `connector`), checks that the P rank holds the heads this rank
//! expects from it, and sends the REGISTER that puts D's blocks in P's table, with a fresh
//! random nonce. It then counts the DONE notifications the transport delivers and acts on P's
//! FAILs and CANCEL_ACKs. A cancel, a TTL that passed or a leg's failure sends CANCELs to the
//! legs that may still be written; a P that does not acknowledge within its write horizon is
//! disconnected. A lost P's legs end only on evidence that none of its bytes can land any more
//! (the fence: see `awaited` and `writer`): the writer reconnects to that P and asks again (a
//! CANCEL, which P acknowledges once its transport finished with the transfer), or finds its
//! endpoint gone. Until then the receive holds its blocks, and once P's horizon passed without
//! evidence it is reported *quarantined* (a notice, once). The receive is reported once, when
//! its last leg is over.
//!
//! A DONE ends a leg only when the agent the transport says sent it, the sender its envelope is
//! signed as and the agent the leg registered with are one and the same, and it names the leg's
//! key and epoch and echoes the nonce of the leg's registration: anything else is counted as a
//! stray and changes nothing.
//!
//! A P that turns D away for want of a slot (`too_many_connections`) is tried again, with a
//! backoff spread by agent name, for as long as the legs waiting on it last; one that does not
//! answer within `connect_timeout` is tried again a few times ([`TIMEOUT_RETRIES`]). Nothing is
//! registered before P answers, so a P that restarted under a thousand reconnecting D peers
//! loses none of their receives; a host that is down still fails its legs in seconds.
//!
//! Without a secret, D connects out only to loopback addresses unless the operator opted out
//! (`allow_insecure`): the side channel refuses, and the leg fails at once naming the host (a D
//! hands the P it connects to its agent metadata, which is write access to its whole KV cache).
//!
//! # A re-expect
//!
//! An expectation for a request id that is still awaited, at a higher epoch (D re-registers
//! after a preemption or a retry), supersedes the awaited receive. The new receive's REGISTERs
//! go out first, so that a P it shares with the old one supersedes the old registration in its
//! table; then the old receive is cancelled like any other: its registered legs get a CANCEL
//! for the old epoch, and the old receive waits, under its own key (the request id and its
//! epoch), until each of them is acknowledged or otherwise over (its DONE, its FAIL, its horizon
//! after a lost connection), since P may still be writing the old blocks. The old receive ends
//! in one event (`Cancelled`, unless a leg was quarantined), and the new receive's event is held
//! until the old one's went out: the engine sees the two in the order it asked for them. The
//! same expectation again (a retried call) is a duplicate: ignored, and the awaited receive's
//! event answers both, as P ignores a duplicate registration. Any other re-expect at an epoch
//! not above the awaited one's is refused with its own event (`Refused`) and leaves the awaited
//! receive as it is: P would keep writing the blocks of the registration it holds for that
//! epoch.
//!
//! `awaited` holds the per-request state and its rules; this module does the I/O they call for.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::protocol::{
    fresh_session, Cancel, Decoder, Done, FailReason, Limits, Message, Register, Secret,
};
use crate::rendezvous::Epoch;
use crate::side_channel::{PeerId, PeerInfo};
use crate::topology;
use crate::transport::{Notification, Transport};

use super::awaited::{Awaited, LegState, Stop};
use super::command::ConnectFailure;
use super::context::{Context, MAX_HORIZON};
use super::events::{Event, Outcome, Reason, Role, Timeline};
use super::{Counters, Expectation, Share};

/// A side channel connection to a P, by its address.
#[derive(Debug)]
enum Source {
    Connecting,
    Connected(PeerId),
}

/// The receive path's state in the writer.
pub(super) struct Receives {
    /// The receives awaited, by D's request id; a receive a re-expect superseded, under
    /// [`superseded_key`] until its legs are over. In order: the writer's I/O for them is then
    /// the same from run to run, which the simulation's replays rely on.
    awaited: BTreeMap<String, Awaited>,
    /// Superseded receives not yet reported, by request id: the request's current receive is
    /// reported only after them.
    superseded: HashMap<String, usize>,
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
    /// P addresses that turned D away for want of a slot, or did not answer in time, while legs
    /// waited to register there, with when to connect again.
    busy: HashMap<String, Retry>,
}

/// When D tries again to reach a lost (or full, or slow) P.
#[derive(Debug, Clone, Copy)]
struct Retry {
    next: Instant,
    backoff: Duration,
    /// Attempts in a row that timed out (see [`TIMEOUT_RETRIES`]).
    timeouts: u32,
}

/// The first wait between attempts to reach a lost (or full) P, and the longest.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// How many times in a row D tries again to reach a P that did not answer within
/// `connect_timeout` before its waiting legs fail `unreachable`. A P that restarted under a
/// thousand reconnecting D peers answers late rather than never, and nothing is registered
/// until it answers, so trying again is safe; but a host that is down looks the same, and its
/// legs should fail in a few connect timeouts, not at their TTL.
const TIMEOUT_RETRIES: u32 = 2;

/// `backoff` plus up to half of it again, by this endpoint's agent `name`: the D peers a full P
/// turned away come back spread out rather than all at once. Deterministic, for the
/// simulation's replays.
fn spread(backoff: Duration, name: &str) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    // Truncating is intended: 0..512 of the hash.
    let share = (hasher.finish() % 512) as u32;
    backoff + backoff * share / 1024
}

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
            superseded: HashMap::new(),
            awaits_kv: false,
            sources: HashMap::new(),
            decoder: Decoder::new(secret, limits),
            received: Vec::new(),
            retries: HashMap::new(),
            busy: HashMap::new(),
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

/// The key a receive superseded by a re-expect waits under (see the module docs): no request id
/// holds a NUL (`Endpoint::expect` refuses one), so it is never a request's own key.
fn superseded_key(request_id: &str, epoch: Epoch) -> String {
    format!("{request_id}\0{epoch}")
}

impl Receives {
    pub(super) fn expect<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        expectation: Expectation,
        at: Instant,
    ) {
        let mut key =
            TransferKey::for_request(expectation.transfer_id.as_deref(), &expectation.request_id);
        if let Some(share) = expectation.share.filter(|share| share.of > 1) {
            // P writes this transfer into several D ranks, each under its own slot.
            key = key.slot(share.slot);
        }
        let request_id = expectation.request_id.clone();
        let sources = expectation.sources.clone();
        let epoch = expectation.epoch;
        let awaited = self.awaited.get(&request_id);
        if awaited.is_some_and(|a| a.expectation == expectation) {
            // The same call again (a retry): the awaited receive's event answers both.
            return;
        }
        let awaited_at = awaited.map(|a| a.expectation.epoch);
        if let Some(held) = awaited_at.filter(|&held| held >= epoch) {
            let detail = format!(
                "request {request_id} is awaited at epoch {held}; a re-expect must carry a \
                 higher epoch than that, not {epoch} (the awaited receive goes on)"
            );
            cx.emit(Event {
                role: Role::Receive,
                request_id,
                key,
                outcome: Outcome::failed(Reason::Refused, detail),
                bytes: 0,
                runs: 0,
                streamed_bytes: 0,
                rewritten_bytes: 0,
                timeline: Timeline { registered: Some(cx.seconds(at)), ..Timeline::default() },
            });
            return;
        }
        let previous = self.awaited.remove(&request_id);
        self.awaited.insert(request_id.clone(), Awaited::new(expectation, key, at));
        self.awaits_kv = true;
        for (leg, source) in sources.into_iter().enumerate() {
            match self.sources.get(&source) {
                Some(Source::Connected(peer)) => {
                    let peer = *peer;
                    self.register_with(cx, peer, &request_id, leg);
                }
                Some(Source::Connecting) => {}
                None => {
                    self.sources.insert(source.clone(), Source::Connecting);
                    self.request_connect(cx, source);
                }
            }
        }
        // After the new REGISTERs: on a P both name, the new one supersedes the old one first,
        // and the CANCEL of the old epoch then only waits for a WRITE of it in flight.
        if let Some(previous) = previous {
            self.supersede(cx, previous, epoch);
        }
        self.settle(cx, &request_id);
    }

    /// A re-expect at `epoch` replaced `previous`: it is cancelled, and reported under its own
    /// key once none of its legs can still be written (see the module docs).
    fn supersede<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        mut previous: Awaited,
        epoch: Epoch,
    ) {
        let request_id = previous.expectation.request_id.clone();
        let old = previous.expectation.epoch;
        let detail = format!(
            "request {request_id}: the receive at epoch {old} was superseded by a re-expect at \
             epoch {epoch}"
        );
        let stops = previous.cancel(Outcome::cancelled(Reason::Cancelled, detail));
        let key = superseded_key(&request_id, old);
        self.awaited.insert(key.clone(), previous);
        *self.superseded.entry(request_id).or_default() += 1;
        self.stop_legs(cx, &key, &stops);
        self.settle(cx, &key);
    }

    /// The key of `request_id`'s receive at `epoch`: the request's current receive, or one a
    /// re-expect superseded.
    fn receive_at(&self, request_id: &str, epoch: Epoch) -> Option<String> {
        match self.awaited.get(request_id) {
            Some(current) if current.expectation.epoch == epoch => Some(request_id.to_owned()),
            _ => {
                let key = superseded_key(request_id, epoch);
                self.awaited.contains_key(&key).then_some(key)
            }
        }
    }

    /// Starts connecting to P at `source`; the result comes as `Command::Connected`.
    fn request_connect<T: Transport>(&mut self, cx: &mut Context<T>, source: String) {
        if let Err(failure) = cx.side_channel.request_connect(&source) {
            self.connected(cx, source, Err(failure));
        }
    }

    pub(super) fn connected<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        source: String,
        result: Result<PeerInfo, ConnectFailure>,
    ) {
        cx.side_channel.connect_finished(&source);
        let result = match result {
            // The connection was lost before its result came here (its `PeerLost` was handled
            // first): it is not a source to register with, now or later.
            Ok(info) if !cx.peers.contains_key(&info.id) => Err(ConnectFailure::other(
                "the connection closed right after its handshake".to_owned(),
            )),
            result => result,
        };
        let waiting: Vec<(String, usize)> = self
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
        let timeouts = self.busy.get(&source).map_or(0, |retry| retry.timeouts);
        match result {
            Err(failure)
                if (failure.busy || failure.timed_out && timeouts < TIMEOUT_RETRIES)
                    && !waiting.is_empty() =>
            {
                // P is full for now, or too slow to answer (a restarted P that all its D peers
                // reconnect to at once): nothing was registered, so the legs keep waiting,
                // still connecting, and D tries again for as long as they do (their TTL ends
                // them), or a few times for a P that does not answer at all.
                self.sources.remove(&source);
                let now = cx.shared.now();
                let retry = self.busy.entry(source).or_insert(Retry {
                    next: now,
                    backoff: RETRY_FIRST,
                    timeouts: 0,
                });
                retry.next = now + spread(retry.backoff, cx.transport.name());
                retry.backoff = (retry.backoff * 2).min(RETRY_MAX);
                retry.timeouts = if failure.timed_out { timeouts + 1 } else { 0 };
            }
            Ok(info) => {
                self.busy.remove(&source);
                self.sources.insert(source.clone(), Source::Connected(info.id));
                for (request_id, leg) in waiting {
                    self.register_with(cx, info.id, &request_id, leg);
                }
                self.ask_again(cx, &source, info.id);
            }
            Err(failure) => {
                self.sources.remove(&source);
                self.busy.remove(&source);
                let tries = if failure.timed_out && timeouts > 0 {
                    format!(" ({} attempts in a row timed out)", timeouts + 1)
                } else {
                    String::new()
                };
                for (request_id, leg) in waiting {
                    let Some(awaited) = self.awaited.get(&request_id) else { continue };
                    let detail =
                        format!("cannot reach {}: {}{tries}", awaited.label(leg), failure.reason);
                    self.end_leg(
                        cx,
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
                    let now = cx.shared.now();
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
    fn ask_again<T: Transport>(&mut self, cx: &mut Context<T>, source: &str, peer: PeerId) {
        let Some(agent) = cx.peers.get(&peer).map(|p| p.name.clone()) else { return };
        let now = cx.shared.now();
        let mut asks = Vec::new();
        for awaited in self.awaited.values_mut() {
            for leg in awaited.unsettled(source) {
                if awaited.legs[leg].agent.as_deref() == Some(agent.as_str()) {
                    awaited.ask(leg, peer);
                    asks.push(Cancel {
                        transfer_key: awaited.key.as_str().to_owned(),
                        request_id: awaited.expectation.request_id.clone(),
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
            cx.send(peer, Message::Cancel(cancel));
        }
        self.retries.remove(source);
    }

    /// Every lost leg of P at `source` that waits for evidence learns that P's endpoint is gone;
    /// `settled` says when its accepted bytes stop landing.
    fn settle_source(
        &mut self,
        source: &str,
        settled: impl Fn(&super::awaited::Leg) -> Option<Instant>,
        evidence: &str,
    ) {
        for awaited in self.awaited.values_mut() {
            for leg in awaited.unsettled(source) {
                if let Some(at) = settled(&awaited.legs[leg]) {
                    awaited.gone(leg, at, evidence);
                }
            }
        }
        self.retries.remove(source);
    }

    /// Reconnects to every lost P that some leg still waits for evidence from, with a growing
    /// pause between attempts, or asks it on a connection already up again.
    fn settle_lost<T: Transport>(&mut self, cx: &mut Context<T>, now: Instant) {
        let mut sources: Vec<String> = self
            .awaited
            .values()
            .filter(|a| a.needs_settling())
            .flat_map(|a| a.legs.iter().map(|leg| leg.source.clone()))
            .collect();
        sources.sort();
        sources.dedup();
        for source in sources {
            if !self.awaited.values().any(|a| !a.unsettled(&source).is_empty()) {
                continue;
            }
            match self.sources.get(&source) {
                Some(Source::Connecting) => {}
                Some(Source::Connected(peer)) => {
                    let peer = *peer;
                    self.ask_again(cx, &source, peer);
                }
                None => {
                    let retry = self.retries.entry(source.clone()).or_insert(Retry {
                        next: now,
                        backoff: RETRY_FIRST,
                        timeouts: 0,
                    });
                    if retry.next > now {
                        continue;
                    }
                    retry.next = now + retry.backoff;
                    retry.backoff = (retry.backoff * 2).min(RETRY_MAX);
                    self.sources.insert(source.clone(), Source::Connecting);
                    self.request_connect(cx, source);
                }
            }
        }
    }

    fn register_with<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        peer: PeerId,
        request_id: &str,
        leg: usize,
    ) {
        let agent = cx.peers.get(&peer).map(|p| p.name.clone());
        let horizon = horizon(cx, peer);
        let delivery_bound = cx.peers.get(&peer).map_or(horizon, |p| p.delivery_bound);
        let mismatch = self.awaited.get(request_id).and_then(|a| source_mismatch(cx, peer, a, leg));
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        if !matches!(awaited.legs[leg].state, LegState::Connecting) {
            // Cancelled (or failed) while connecting: nothing to register.
            return;
        }
        if let Some(detail) = mismatch {
            self.end_leg(cx, request_id, leg, Some(Outcome::failed(Reason::Incompatible, detail)));
            return;
        }
        // Ties the DONE of this registration, and no other, to this leg.
        let nonce = fresh_session().max(1);
        awaited.legs[leg].peer = Some(peer);
        awaited.legs[leg].agent = agent;
        awaited.legs[leg].horizon = horizon;
        awaited.legs[leg].delivery_bound = delivery_bound;
        awaited.legs[leg].nonce = nonce;
        awaited.legs[leg].state = LegState::Registered;
        let e = &awaited.expectation;
        let ttl_ms =
            u64::try_from(awaited.deadline.saturating_duration_since(cx.shared.now()).as_millis())
                .unwrap_or(u64::MAX);
        let register = Register {
            transfer_key: awaited.key.as_str().to_owned(),
            request_id: e.request_id.clone(),
            epoch: e.epoch,
            engine_id: cx.engine_id.clone(),
            address: cx.side_channel.local_addr().to_string(),
            tp_rank: cx.layout.tp_rank,
            tp_size: cx.layout.tp_size,
            groups: e.groups.clone(),
            num_tokens: e.num_tokens,
            ttl_ms,
            fanout: e.share.map_or(1, |share| share.of),
            nonce,
        };
        if let Err(error) = cx.side_channel.send(peer, &Message::Register(register)) {
            // The frame did not go out whole, so P refuses it: nothing can be written.
            let detail = format!("cannot register with {}: {error}", awaited.label(leg));
            self.end_leg(cx, request_id, leg, Some(Outcome::failed(Reason::Unreachable, detail)));
        }
    }

    /// Leg `leg` of `request_id` is over (with `failure`, the receive fails and its other legs
    /// are cancelled); the receive is reported once its last leg is over.
    fn end_leg<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        request_id: &str,
        leg: usize,
        failure: Option<Outcome>,
    ) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        let stops = awaited.end_leg(leg, failure);
        self.stop_legs(cx, request_id, &stops);
        self.settle(cx, request_id);
    }

    /// The receive ends with `outcome` once no leg can still write: registered legs are
    /// cancelled, fenced ones wait out their horizons.
    fn cancel_receive<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        request_id: &str,
        outcome: Outcome,
    ) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        let stops = awaited.cancel(outcome);
        self.stop_legs(cx, request_id, &stops);
        self.settle(cx, request_id);
    }

    /// Sends the CANCELs `stops` calls for; each P must acknowledge within its horizon.
    fn stop_legs<T: Transport>(&mut self, cx: &mut Context<T>, request_id: &str, stops: &[Stop]) {
        for &Stop::Cancel(peer) in stops {
            let deadline = cx.shared.now() + horizon(cx, peer);
            let Some(awaited) = self.awaited.get_mut(request_id) else { return };
            if let Some(leg) = awaited.leg_on(peer) {
                awaited.legs[leg].state = LegState::Cancelling { deadline: Some(deadline) };
            }
            let cancel = Cancel {
                transfer_key: awaited.key.as_str().to_owned(),
                request_id: awaited.expectation.request_id.clone(),
                epoch: awaited.expectation.epoch,
            };
            cx.send(peer, Message::Cancel(cancel));
        }
    }

    pub(super) fn cancel_expectation<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        request_id: &str,
    ) {
        let outcome =
            Outcome::cancelled(Reason::Cancelled, format!("request {request_id} cancelled by D"));
        self.cancel_receive(cx, request_id, outcome);
    }

    /// Reports the receive under `key` if its last leg is over (and, for a request's current
    /// receive, once the receives a re-expect superseded were reported).
    fn settle<T: Transport>(&mut self, cx: &mut Context<T>, key: &str) {
        if self.superseded.contains_key(key) {
            return;
        }
        let Some(awaited) = self.awaited.get_mut(key) else { return };
        if !awaited.is_over() {
            return;
        }
        let outcome = awaited.outcome();
        self.end_receive(cx, key, outcome);
    }

    fn end_receive<T: Transport>(&mut self, cx: &mut Context<T>, key: &str, outcome: Outcome) {
        let Some(awaited) = self.awaited.remove(key) else { return };
        let request_id = awaited.expectation.request_id.clone();
        let completed = cx.shared.now();
        cx.emit(Event {
            role: Role::Receive,
            request_id: request_id.clone(),
            key: awaited.key,
            outcome,
            bytes: awaited.bytes,
            runs: awaited.runs,
            streamed_bytes: 0,
            rewritten_bytes: 0,
            timeline: Timeline {
                registered: Some(cx.seconds(awaited.registered)),
                completed: Some(cx.seconds(completed)),
                ..Timeline::default()
            },
        });
        if key != request_id {
            // A superseded receive: the request's current one may have been waiting for it.
            let left = self.superseded.get_mut(&request_id).map(|left| {
                *left -= 1;
                *left
            });
            if left == Some(0) {
                self.superseded.remove(&request_id);
                self.settle(cx, &request_id);
            }
        }
    }

    /// Takes the transport's notifications (a transport without its own progress thread is
    /// progressed by this call) and counts the DONEs among them.
    pub(super) fn take_notifications<T: Transport>(&mut self, cx: &mut Context<T>) {
        if cx.transport.take_notifications(&mut self.received).is_err() {
            Counters::add(&cx.shared.counters.transport_errors);
            return;
        }
        let received = std::mem::take(&mut self.received);
        for notification in &received {
            // DONEs arrive in completion order, not posting order, and as late as their WRITE
            // took: up to the sending P's write horizon (see `decode_unordered`).
            let in_flight = horizon_of_agent(cx, &notification.from);
            match self.decoder.decode_unordered(
                &notification.payload,
                cx.shared.unix_millis(),
                in_flight,
            ) {
                Ok(envelope) => {
                    if let Message::Done(done) = envelope.message {
                        self.done(cx, &notification.from, &envelope.sender, done);
                    }
                }
                Err(_) => Counters::add(&cx.shared.counters.refused_frames),
            }
        }
        self.received = received;
        self.received.clear();
    }

    /// A DONE that the transport says agent `from` sent, signed as `sender`.
    fn done<T: Transport>(&mut self, cx: &mut Context<T>, from: &str, sender: &str, done: Done) {
        // Only the P agent a leg registered with may end it, for that registration: the
        // transport's sender, the signed sender and the leg's agent agree, and the DONE echoes
        // the registration's nonce. Anything else (another agent, a name that does not match its
        // signature, an ended receive, an epoch or registration D has since replaced) is stray.
        let key = (from == sender).then(|| self.receive_at(&done.request_id, done.epoch));
        let leg = key.flatten().and_then(|key| {
            let awaited = self.awaited.get(&key)?;
            let leg = awaited.leg_of_agent(from)?;
            let echoed = awaited.legs[leg].nonce == done.nonce;
            (echoed && awaited.key.as_str() == done.transfer_key).then_some((key, leg))
        });
        let Some((key, leg)) = leg else {
            Counters::add(&cx.shared.counters.stray_notifications);
            return;
        };
        if let Some(awaited) = self.awaited.get_mut(&key) {
            awaited.bytes += done.bytes;
            awaited.runs = awaited.runs.saturating_add(done.runs);
        }
        // Whatever D wanted since (a cancel, another rank's failure), this leg's KV is here.
        self.end_leg(cx, &key, leg, None);
    }

    /// A control message from P for D's receives: a FAIL or a CANCEL_ACK ends its leg.
    pub(super) fn peer_message<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        peer: PeerId,
        message: Message,
    ) {
        match message {
            Message::Fail(fail) => {
                let Some(key) = self.receive_at(&fail.request_id, fail.epoch) else { return };
                let Some(awaited) = self.awaited.get(&key) else { return };
                let Some(leg) = awaited
                    .leg_on(peer)
                    .filter(|&leg| !matches!(awaited.legs[leg].state, LegState::Over))
                else {
                    return;
                };
                let detail =
                    format!("{}: {} ({})", awaited.label(leg), fail.detail, fail.reason.as_str());
                let failed_write = matches!(fail.reason, FailReason::WriteError);
                let outcome = match fail.reason {
                    // P's WRITE may still be landing: whatever D wanted, the blocks stay held.
                    FailReason::Quarantined => Outcome::quarantined(detail),
                    reason => Outcome::failed(Reason::of_fail(&reason), detail),
                };
                let bound = awaited.legs[leg].delivery_bound;
                if failed_write && !bound.is_zero() {
                    // A WRITE that failed may have left bytes in P's host (TCP's retransmission
                    // queue): they may land for P's delivery bound yet.
                    let until = cx.shared.now() + bound;
                    let Some(awaited) = self.awaited.get_mut(&key) else { return };
                    let stops = awaited.end_leg_at(leg, until, outcome, true);
                    self.stop_legs(cx, &key, &stops);
                    self.settle(cx, &key);
                } else {
                    self.end_leg(cx, &key, leg, Some(outcome));
                }
            }
            Message::CancelAck(ack) => {
                let Some(key) = self.receive_at(&ack.request_id, ack.epoch) else { return };
                let Some(awaited) = self.awaited.get_mut(&key) else { return };
                let cancelled = awaited
                    .leg_on(peer)
                    .filter(|&leg| matches!(awaited.legs[leg].state, LegState::Cancelling { .. }));
                let now = cx.shared.now();
                if let Some(leg) = cancelled {
                    let bound = awaited.legs[leg].delivery_bound;
                    if ack.wrote && !ack.delivered && !bound.is_zero() {
                        // The WRITE failed: bytes it left in P's host may land for P's delivery
                        // bound yet (the receive already ends cancelled).
                        let outcome = Outcome::cancelled(
                            Reason::Cancelled,
                            format!("{} acknowledged the cancel", awaited.label(leg)),
                        );
                        awaited.end_leg_at(leg, now + bound, outcome, false);
                    } else {
                        self.end_leg(cx, &key, leg, None);
                    }
                } else if let Some(leg) = awaited.leg_asked_on(peer).filter(|_| ack.delivered) {
                    // A lost P's word, asked on a new connection: its WRITE completed, every
                    // byte is here (the DONE that says so may still come, or not at all).
                    self.end_leg(cx, &key, leg, None);
                } else if let Some(leg) = awaited
                    .leg_asked_on(peer)
                    .filter(|&leg| !awaited.legs[leg].delivery_bound.is_zero())
                {
                    // A lost P's word that its WRITE will not go on, but not that it delivered:
                    // a WRITE that failed, on the connection D lost (its FAIL lost with it), may
                    // have left bytes in P's host for its delivery bound.
                    let bound = awaited.legs[leg].delivery_bound;
                    let evidence = format!(
                        "{} confirmed that its transport had finished with the transfer, and \
                         its host's accepted bytes had {bound:.1?} more to land",
                        awaited.label(leg)
                    );
                    awaited.gone(leg, now + bound, &evidence);
                } else if let Some(leg) = awaited.leg_asked_on(peer) {
                    // A lost P's word, asked on a new connection: nothing more of it can land.
                    let evidence = format!(
                        "{} confirmed, once its transport had finished with the transfer, that \
                         nothing more of it can land",
                        awaited.label(leg)
                    );
                    let stops = awaited.settle_leg(leg, &evidence);
                    self.stop_legs(cx, &key, &stops);
                    self.settle(cx, &key);
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
        self.sources.retain(|_, source| !matches!(source, Source::Connected(p) if *p == peer));
        for awaited in self.awaited.values_mut() {
            let Some(leg) = awaited.leg_on(peer).or_else(|| awaited.leg_asked_on(peer)) else {
                continue;
            };
            let request_id = &awaited.expectation.request_id;
            let outcome = Outcome::failed(
                Reason::PeerLost,
                format!("lost {} for request {request_id}: {reason}", awaited.label(leg)),
            );
            awaited.fence(peer, at, &outcome);
        }
    }

    /// D's deadlines: receives whose TTL passed are cancelled, fenced legs whose horizon passed
    /// end, and a P that left a CANCEL unacknowledged past its horizon is disconnected.
    pub(super) fn check_receives<T: Transport>(&mut self, cx: &mut Context<T>, now: Instant) {
        self.awaits_kv = self.awaited.values().any(Awaited::expects_writes);
        if self.awaited.is_empty() {
            return;
        }
        let mut unacknowledged = Vec::new();
        let mut due = Vec::new();
        for (request_id, awaited) in &mut self.awaited {
            let stops = awaited.fences_passed(now);
            unacknowledged.extend(awaited.unacknowledged(now));
            let late = !awaited.is_ending() && awaited.deadline <= now;
            if !stops.is_empty() || late || awaited.is_over() {
                due.push((request_id.clone(), stops, late));
            }
        }
        let mut notices = Vec::new();
        for (request_id, awaited) in &mut self.awaited {
            if awaited.quarantine_due(now) {
                notices.push(request_id.clone());
            }
        }
        for request_id in notices {
            self.quarantine_notice(cx, &request_id);
        }
        for (request_id, stops, late) in due {
            self.stop_legs(cx, &request_id, &stops);
            if late {
                let Some(awaited) = self.awaited.get(&request_id) else { continue };
                let detail =
                    format!("no KV for request {request_id} within {:?}", awaited.expectation.ttl);
                // Free nothing until every P confirmed no write can land (or its horizon passed).
                self.cancel_receive(cx, &request_id, Outcome::failed(Reason::Expired, detail));
            }
            self.settle(cx, &request_id);
        }
        // P did not answer a CANCEL within its horizon: stop proving we are alive to it, so that
        // its lease runs out; the leg is then fenced (see `fence_receives`).
        for peer in unacknowledged {
            cx.side_channel.disconnect(peer);
        }
        self.settle_lost(cx, now);
        self.retry_busy(cx, now);
    }

    /// Connects again to each P that was full when legs waited to register there, once its
    /// pause is over and while some leg still waits; forgets the others.
    fn retry_busy<T: Transport>(&mut self, cx: &mut Context<T>, now: Instant) {
        if self.busy.is_empty() {
            return;
        }
        let awaited = &self.awaited;
        let waits = |source: &str| {
            awaited.values().any(|a| {
                a.legs
                    .iter()
                    .any(|leg| matches!(leg.state, LegState::Connecting) && leg.source == source)
            })
        };
        self.busy.retain(|source, _| waits(source));
        let mut due: Vec<String> = self
            .busy
            .iter()
            .filter(|(source, retry)| retry.next <= now && !self.sources.contains_key(*source))
            .map(|(source, _)| source.clone())
            .collect();
        due.sort();
        for source in due {
            self.sources.insert(source.clone(), Source::Connecting);
            self.request_connect(cx, source);
        }
    }

    /// Reports, once, that `request_id`'s receive holds its blocks without evidence that a lost
    /// P's bytes can no longer land: its horizon passed, and it neither answered nor was found
    /// gone. The receive's own event still comes once it settles (or never, if it never does).
    fn quarantine_notice<T: Transport>(&mut self, cx: &mut Context<T>, key: &str) {
        let Some(awaited) = self.awaited.get(key) else { return };
        let request_id = &awaited.expectation.request_id;
        Counters::add(&cx.shared.counters.quarantined_receives);
        let detail = format!(
            "request {request_id}: lost {} and its write horizon passed without P confirming \
             that nothing more of it can land (a paused or partitioned P looks the same as a dead \
             one); the KV blocks stay held until P answers or is found gone",
            awaited.unsettled_labels()
        );
        let event = Event {
            role: Role::Receive,
            request_id: request_id.clone(),
            key: awaited.key.clone(),
            outcome: Outcome::quarantined(detail),
            bytes: awaited.bytes,
            runs: awaited.runs,
            streamed_bytes: 0,
            rewritten_bytes: 0,
            timeline: Timeline {
                registered: Some(cx.seconds(awaited.registered)),
                ..Timeline::default()
            },
        };
        cx.emit(event);
    }

    /// The writer died at `at` (see `Writer::die`), its peers disconnected: every receive fails,
    /// once each of its registered P ranks' horizons passed (unregistered legs are over now).
    pub(super) fn fail_receives<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        reason: &str,
        at: Instant,
    ) {
        let ids: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in ids {
            let Some(awaited) = self.awaited.get(&request_id) else { continue };
            let peers: Vec<PeerId> = awaited.legs.iter().filter_map(|leg| leg.peer).collect();
            let Some(awaited) = self.awaited.get_mut(&request_id) else { continue };
            let outcome = Outcome::failed(Reason::WriterDied, reason.to_owned());
            // Unregistered legs are over; registered ones may be written: with nobody left to
            // ask P, they are held, and reported quarantined once P's horizon passed.
            let _ = awaited.cancel(outcome.clone());
            for peer in peers {
                awaited.fence(peer, at, &outcome);
            }
            self.settle(cx, &request_id);
        }
    }

    /// A dead writer's receives whose P's horizon passed by `now` are reported quarantined and
    /// forgotten (their blocks stay held: nobody can ask P any more). No CANCEL goes out: the
    /// peers were disconnected.
    pub(super) fn pass_fences<T: Transport>(&mut self, cx: &mut Context<T>, now: Instant) {
        let ids: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in ids {
            let Some(awaited) = self.awaited.get_mut(&request_id) else { continue };
            if awaited.quarantine_due(now) {
                self.quarantine_notice(cx, &request_id);
                self.awaited.remove(&request_id);
                continue;
            }
            self.settle(cx, &request_id);
        }
    }

    /// The endpoint closes: every receive still awaited fails (the link, closed after the
    /// writer, ends its connection attempts).
    pub(super) fn close_receives<T: Transport>(&mut self, cx: &mut Context<T>) {
        let awaited: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in awaited {
            self.end_receive(
                cx,
                &request_id,
                Outcome::failed(Reason::Closed, "the endpoint closed"),
            );
        }
    }
}

/// Why the P rank behind `peer` cannot be leg `leg` of `awaited`: it holds none of this
/// rank's heads, or this rank's heads come from a different number of P ranks than the
/// expectation names (a router that left out P's tensor parallel size would otherwise get
/// half the heads reported done).
fn source_mismatch<T: Transport>(
    cx: &Context<T>,
    peer: PeerId,
    awaited: &Awaited,
    leg: usize,
) -> Option<String> {
    let p = cx.peers.get(&peer)?;
    let mine = cx.layout.global_heads();
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
        let expected = topology::share_of(&mine, &p.heads);
        return (share != expected).then(|| {
            format!(
                "{label} holds KV heads {:?}, the heads of {} D ranks; this rank (heads \
                 {mine:?}) is share {} of {}, but the request says {} of {}",
                p.heads, expected.of, expected.slot, expected.of, share.slot, share.of
            )
        });
    }
    let holding = topology::p_ranks_holding(&mine, theirs);
    let needed = holding.end - holding.start;
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
fn horizon<T: Transport>(cx: &Context<T>, peer: PeerId) -> Duration {
    cx.peers.get(&peer).map_or(MAX_HORIZON, |p| p.horizon)
}

/// The horizon of the P whose agent is `agent`: how long after posting its WRITE's DONE
/// may still arrive. Zero for an agent no connection names (its DONEs are strays anyway).
fn horizon_of_agent<T: Transport>(cx: &Context<T>, agent: &str) -> Duration {
    cx.peers.values().filter(|p| p.name == agent).map(|p| p.horizon).max().unwrap_or_default()
}

/// A dead writer's answer to a new expectation: it fails at once (nothing was registered).
/// An expectation never registered (the writer died, or closed with it still queued) fails
/// at once with `code`. A receive already awaited under that request id is left to end in
/// its own event: its legs may be written.
pub(super) fn refuse_expectation<T: Transport>(
    cx: &mut Context<T>,
    expectation: Expectation,
    code: Reason,
    reason: &str,
) {
    let detail = format!("request {}: {reason}", expectation.request_id);
    cx.emit(Event {
        role: Role::Receive,
        key: TransferKey::for_request(expectation.transfer_id.as_deref(), &expectation.request_id),
        request_id: expectation.request_id,
        outcome: Outcome::failed(code, detail),
        bytes: 0,
        runs: 0,
        streamed_bytes: 0,
        rewritten_bytes: 0,
        timeline: Timeline::default(),
    });
}

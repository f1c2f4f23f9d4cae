//! The writer thread: the only thread that touches the transport.
//!
//! It drains its inbox (matches, expectations, peer changes, replies to send), posts and polls
//! WRITEs, counts DONE notifications, and enforces deadlines, then reports each request's end as
//! one [`Event`]. It polls every `BUSY_POLL` while anything is in flight or awaited, sleeps on
//! its inbox for up to `IDLE_POLL` while the table holds a half or a command came recently, and
//! for up to `QUIET_POLL` once nothing has happened for `SETTLE`: an idle endpoint costs next to
//! no CPU (a few wake-ups a second), while a new command still wakes it at once.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::layout::KvLayout;
use crate::planner::{BlockList, PlanRequest, Planner};
use crate::protocol::{
    unix_millis, Cancel, CancelAck, Decoder, Done, Encoder, Fail, FailReason, Limits, Message,
    Register, Secret,
};
use crate::rendezvous::{Match, Outcome as TableOutcome, RendezvousError};
use crate::side_channel::{PeerId, PeerInfo, SideChannel};
use crate::transport::{MemorySpace, Notification, Transport, WriteId, WriteState};

use super::events::{Event, Outcome, Role, Timeline};
use super::{Counters, EndpointConfig, Expectation, ReadyKv, Shared};

/// Poll period while writes are in flight or DONEs awaited.
const BUSY_POLL: Duration = Duration::from_micros(200);
/// Longest sleep when nothing is pending: bounds how late a peer's connection setup is
/// progressed by a transport without its own progress thread.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// How long after its last command the writer keeps to `IDLE_POLL` (a new peer's connection
/// setup is progressed in the meantime).
const SETTLE: Duration = Duration::from_secs(1);
/// Longest sleep once quiet: nothing in flight, awaited or in the table, and no command for
/// `SETTLE`. Nothing is due then; the wake-up only bounds how late a stray notification (a DONE
/// for a cancelled receive) is drained.
const QUIET_POLL: Duration = Duration::from_millis(500);
/// How often the rendezvous table and D's deadlines are checked.
const DEADLINE_CHECK: Duration = Duration::from_millis(10);
/// How long a closing writer lets in-flight writes finish before abandoning them.
const DRAIN_ON_CLOSE: Duration = Duration::from_secs(2);

/// D's registration as P's table holds it.
#[derive(Debug)]
pub(crate) struct Registration {
    /// The side channel connection it came on (replies go back on it).
    pub(crate) peer: PeerId,
    /// The message itself.
    pub(crate) register: Register,
    /// When it arrived.
    pub(crate) at: Instant,
}

impl Registration {
    /// A FAIL for this registration.
    pub(crate) fn fail(&self, reason: FailReason, detail: String) -> Fail {
        Fail {
            transfer_key: self.register.transfer_key.clone(),
            request_id: self.register.request_id.clone(),
            epoch: self.register.epoch,
            reason,
            detail,
        }
    }
}

/// P's ready KV as the table holds it.
#[derive(Debug)]
pub(crate) struct Ready {
    pub(crate) kv: ReadyKv,
    pub(crate) at: Instant,
}

/// What the writer is asked to do.
#[derive(Debug)]
pub(crate) enum Command {
    /// P: both halves met: write.
    Write(Match<Registration, Arc<Ready>>),
    /// P: tell D its transfer will not happen.
    Fail { peer: PeerId, fail: Fail },
    /// P: D's cancel was applied; acknowledge it and report P's released KV, if any.
    AcknowledgeCancel { peer: PeerId, cancel: Cancel, released: Option<Arc<Ready>> },
    /// D: register blocks with P and await the KV.
    Expect(Expectation, Instant),
    /// D: stop awaiting a request.
    CancelExpectation(String),
    /// D: a side channel connection to P was set up (or not).
    Connected { source: String, result: Result<PeerInfo, String> },
    /// A peer finished its handshake.
    PeerJoined(PeerInfo),
    /// A peer is gone.
    PeerLost(PeerId, String),
    /// A control message for the writer (FAIL, CANCEL_ACK, ERROR on D).
    FromPeer(PeerId, Message),
    /// Close: finish or abandon what is in flight, fail what is pending, exit.
    Stop,
}

/// A peer as the writer knows it.
#[derive(Debug)]
struct Peer {
    /// The transport's name for the peer, once its metadata loaded.
    agent: Result<String, String>,
    /// P: how to write into this peer (D), or why it cannot be written to.
    planner: Result<Planner, String>,
    /// Where the peer's KV cache lives.
    memory: MemorySpace,
}

/// P: a posted WRITE.
#[derive(Debug)]
struct InFlight {
    write: WriteId,
    key: TransferKey,
    epoch: u64,
    registration: Registration,
    ready: Arc<Ready>,
    matched: Instant,
    posted: Instant,
    bytes: u64,
    runs: u32,
}

/// D: a request awaiting its KV.
#[derive(Debug)]
struct Awaited {
    expectation: Expectation,
    key: TransferKey,
    /// The P connection the registration went to (None while connecting).
    peer: Option<PeerId>,
    /// P agents whose DONE arrived.
    done_from: HashSet<String>,
    bytes: u64,
    runs: u32,
    deadline: Instant,
    registered: Instant,
    /// A CANCEL was sent (with the outcome to report once P acknowledges).
    cancelling: Option<Outcome>,
}

/// D: a side channel connection to a P, by its address.
#[derive(Debug)]
enum Source {
    Connecting,
    Connected(PeerId),
}

/// The writer thread's state; see the module docs.
pub(crate) struct Writer<T: Transport> {
    transport: T,
    layout: KvLayout,
    memory: MemorySpace,
    engine_id: String,
    write_timeout: Duration,
    shared: Arc<Shared>,
    side_channel: Arc<SideChannel>,
    commands: Receiver<Command>,
    events: Sender<Event>,
    peers: HashMap<PeerId, Peer>,
    in_flight: Vec<InFlight>,
    awaited: HashMap<String, Awaited>,
    sources: HashMap<String, Source>,
    connect_requests: Option<Sender<String>>,
    connector: Option<JoinHandle<()>>,
    notifications: Encoder,
    decoder: Decoder,
    received: Vec<Notification>,
    last_deadline_check: Instant,
    last_command: Instant,
}

impl<T: Transport> std::fmt::Debug for Writer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("engine_id", &self.engine_id)
            .field("peers", &self.peers.len())
            .field("in_flight", &self.in_flight.len())
            .field("awaited", &self.awaited.len())
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Writer<T> {
    pub(crate) fn new(
        config: &EndpointConfig,
        transport: T,
        secret: Option<Secret>,
        shared: Arc<Shared>,
        side_channel: Arc<SideChannel>,
        commands: Receiver<Command>,
        events: Sender<Event>,
    ) -> Self {
        let notifications = Encoder::new(transport.name().to_owned(), secret.clone());
        Self {
            layout: config.layout.clone(),
            memory: config.memory,
            engine_id: config.engine_id.clone(),
            write_timeout: config.write_timeout,
            transport,
            shared,
            side_channel,
            commands,
            events,
            peers: HashMap::new(),
            in_flight: Vec::new(),
            awaited: HashMap::new(),
            sources: HashMap::new(),
            connect_requests: None,
            connector: None,
            notifications,
            decoder: Decoder::new(secret, Limits::default()),
            received: Vec::new(),
            last_deadline_check: Instant::now(),
            last_command: Instant::now(),
        }
    }

    /// The thread body: runs until `Stop` (or every sender is gone), then cleans up.
    pub(crate) fn run(mut self) {
        loop {
            let mut stop = match self.commands.recv_timeout(self.poll_period()) {
                Ok(command) => {
                    self.last_command = Instant::now();
                    self.handle(command)
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => true,
            };
            while !stop {
                match self.commands.try_recv() {
                    Ok(command) => stop = self.handle(command),
                    Err(_) => break,
                }
            }
            if stop {
                break;
            }
            self.poll_writes();
            self.take_notifications();
            if self.last_deadline_check.elapsed() >= DEADLINE_CHECK {
                self.last_deadline_check = Instant::now();
                self.check_deadlines();
            }
        }
        self.shut_down();
    }

    /// How long the next wait on the inbox may last (see the module docs).
    fn poll_period(&self) -> Duration {
        if !self.in_flight.is_empty() || !self.awaited.is_empty() {
            BUSY_POLL
        } else if !self.shared.table.is_empty() || self.last_command.elapsed() < SETTLE {
            IDLE_POLL
        } else {
            QUIET_POLL
        }
    }

    /// Acts on one command; true when the writer must stop.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Write(m) => self.write(m),
            Command::Fail { peer, fail } => self.send(peer, Message::Fail(fail)),
            Command::AcknowledgeCancel { peer, cancel, released } => {
                if let Some(ready) = released {
                    let reason = format!("D cancelled transfer {}", cancel.transfer_key);
                    self.report_send(
                        &ready,
                        &cancel.transfer_key,
                        Outcome::Cancelled(reason),
                        None,
                    );
                }
                let ack = CancelAck {
                    transfer_key: cancel.transfer_key,
                    request_id: cancel.request_id,
                    epoch: cancel.epoch,
                    wrote: false,
                };
                self.send(peer, Message::CancelAck(ack));
            }
            Command::Expect(expectation, at) => self.expect(expectation, at),
            Command::CancelExpectation(request_id) => self.cancel_expectation(&request_id),
            Command::Connected { source, result } => self.connected(source, result),
            Command::PeerJoined(info) => self.peer_joined(info),
            Command::PeerLost(peer, reason) => self.peer_lost(peer, &reason),
            Command::FromPeer(peer, message) => self.peer_message(peer, message),
            Command::Stop => return true,
        }
        false
    }

    fn seconds(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.shared.origin).as_secs_f64()
    }

    fn send(&self, peer: PeerId, message: Message) {
        // A peer that vanished cannot be told anything; its loss is reported separately.
        let _ = self.side_channel.send(peer, &message);
    }

    fn emit(&self, event: Event) {
        // The receiver lives as long as the endpoint; after close nobody is listening.
        let _ = self.events.send(event);
    }

    // ---- P: writing -----------------------------------------------------------------------

    fn peer_joined(&mut self, info: PeerInfo) {
        let agent = self.transport.add_peer(&info.hello.agent_metadata).map_err(|e| e.to_string());
        let planner = Planner::new(self.layout.clone(), info.hello.layout.clone())
            .map_err(|e| format!("cannot write into {}: {e}", info.hello.engine_id));
        let memory = info.hello.memory;
        self.peers.insert(info.id, Peer { agent, planner, memory });
    }

    fn report_send(
        &self,
        ready: &Ready,
        key: &str,
        outcome: Outcome,
        write: Option<(&InFlight, Instant)>,
    ) {
        let mut timeline = Timeline { ready: Some(self.seconds(ready.at)), ..Timeline::default() };
        let (mut bytes, mut runs) = (0, 0);
        if let Some((w, completed)) = write {
            timeline.registered = Some(self.seconds(w.registration.at));
            timeline.matched = Some(self.seconds(w.matched));
            timeline.posted = Some(self.seconds(w.posted));
            timeline.completed = Some(self.seconds(completed));
            bytes = w.bytes;
            runs = w.runs;
        }
        self.emit(Event {
            role: Role::Send,
            request_id: ready.kv.request_id.clone(),
            key: TransferKey::from_canonical(key),
            outcome,
            bytes,
            runs,
            timeline,
        });
    }

    fn write(&mut self, m: Match<Registration, Arc<Ready>>) {
        let matched = Instant::now();
        let Match { key, epoch, registration, ready } = m;
        if let Err(error) = self.shared.table.begin_write(&key, epoch) {
            // Superseded: the newer match is already queued. Fenced: whoever ended the transfer
            // got P's KV back and reports it; D only needs to hear that nothing is coming.
            if let RendezvousError::Fenced { reason, .. } = error {
                let fail = registration.fail(
                    FailReason::Cancelled,
                    format!("transfer {key} ended before its write began ({reason})"),
                );
                self.send(registration.peer, Message::Fail(fail));
            }
            return;
        }
        match self.post(&key, &registration, &ready) {
            Ok((write, bytes, runs)) => self.in_flight.push(InFlight {
                write,
                key,
                epoch,
                registration,
                ready,
                matched,
                posted: Instant::now(),
                bytes,
                runs,
            }),
            Err((reason, detail)) => {
                let outcome = TableOutcome::Failed(detail.clone());
                let _ = self.shared.table.finish(&key, epoch, outcome, Instant::now());
                self.send(
                    registration.peer,
                    Message::Fail(registration.fail(reason, detail.clone())),
                );
                self.report_send(&ready, key.as_str(), Outcome::Failed(detail), None);
            }
        }
    }

    /// Plans and posts one write; the error says why not, for D and for P's event.
    fn post(
        &mut self,
        key: &TransferKey,
        registration: &Registration,
        ready: &Ready,
    ) -> Result<(WriteId, u64, u32), (FailReason, String)> {
        let peer = self.peers.get(&registration.peer).ok_or_else(|| {
            (FailReason::Refused, format!("D's connection for transfer {key} is gone"))
        })?;
        let planner = peer.planner.as_ref().map_err(|e| (FailReason::Incompatible, e.clone()))?;
        let agent = peer.agent.as_ref().map_err(|e| (FailReason::WriteError, e.clone()))?;
        let register = &registration.register;
        if register.num_tokens > ready.kv.num_tokens {
            return Err((
                FailReason::Refused,
                format!(
                    "transfer {key}: D asks for {} tokens but P computed {}",
                    register.num_tokens, ready.kv.num_tokens
                ),
            ));
        }
        let src: Vec<BlockList<'_>> = ready
            .kv
            .groups
            .iter()
            .map(|g| BlockList { first_token: g.first_token, ids: &g.block_ids })
            .collect();
        let dst: Vec<BlockList<'_>> = register
            .groups
            .iter()
            .map(|g| BlockList { first_token: g.first_token, ids: &g.block_ids })
            .collect();
        let request = PlanRequest {
            request: &register.request_id,
            num_tokens: register.num_tokens,
            src: &src,
            dst: &dst,
        };
        let plan = planner.plan(&request).map_err(|e| (FailReason::Refused, e.to_string()))?;
        let runs = u32::try_from(plan.runs.len()).unwrap_or(u32::MAX);
        let done = Message::Done(Done {
            transfer_key: key.as_str().to_owned(),
            request_id: register.request_id.clone(),
            epoch: register.epoch,
            tp_rank: self.layout.tp_rank,
            tp_size: self.layout.tp_size,
            bytes: plan.stats.bytes,
            runs,
        });
        let notification = self.notifications.encode(&done, unix_millis());
        let remote = peer.memory;
        let write = self
            .transport
            .post_write(agent, &plan.runs, self.memory, remote, &notification)
            .map_err(|e| (FailReason::WriteError, format!("transfer {key}: {e}")))?;
        Ok((write, plan.stats.bytes, runs))
    }

    fn poll_writes(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            let state = self.transport.poll_write(self.in_flight[i].write);
            let timed_out = self.in_flight[i].posted.elapsed() > self.write_timeout;
            let result = match state {
                Ok(WriteState::InProgress) if !timed_out => {
                    i += 1;
                    continue;
                }
                Ok(WriteState::InProgress) => {
                    self.transport.abandon_write(self.in_flight[i].write);
                    Err(format!("write not done after {:?}; abandoned", self.write_timeout))
                }
                Ok(WriteState::Done) => Ok(()),
                Err(e) => Err(e.to_string()),
            };
            let w = self.in_flight.swap_remove(i);
            self.finish(w, result);
        }
    }

    fn finish(&mut self, w: InFlight, result: Result<(), String>) {
        let now = Instant::now();
        let outcome = match &result {
            Ok(()) => TableOutcome::Done,
            Err(e) => TableOutcome::Failed(e.clone()),
        };
        let finished = self.shared.table.finish(&w.key, w.epoch, outcome, now);
        let event_outcome = match result {
            Ok(()) => Outcome::Done,
            Err(detail) => {
                let fail = w.registration.fail(FailReason::WriteError, detail.clone());
                self.send(w.registration.peer, Message::Fail(fail));
                Outcome::Failed(detail)
            }
        };
        let rematch = match finished {
            Ok(finished) => {
                if finished.cancel_acknowledged {
                    let ack = CancelAck {
                        transfer_key: w.key.as_str().to_owned(),
                        request_id: w.registration.register.request_id.clone(),
                        epoch: w.epoch,
                        wrote: true,
                    };
                    self.send(w.registration.peer, Message::CancelAck(ack));
                }
                finished.rematch
            }
            Err(_) => None,
        };
        match rematch {
            // D re-registered during the write: P's KV is still needed for the new blocks,
            // so this request's send is not over yet.
            Some(m) => self.write(m),
            None => self.report_send(&w.ready, w.key.as_str(), event_outcome, Some((&w, now))),
        }
    }

    // ---- D: receiving ---------------------------------------------------------------------

    fn expect(&mut self, expectation: Expectation, at: Instant) {
        let key =
            TransferKey::for_request(expectation.transfer_id.as_deref(), &expectation.request_id);
        let source = expectation.source.clone();
        let request_id = expectation.request_id.clone();
        let awaited = Awaited {
            deadline: at + expectation.ttl,
            expectation,
            key,
            peer: None,
            done_from: HashSet::new(),
            bytes: 0,
            runs: 0,
            registered: at,
            cancelling: None,
        };
        // A re-registration (higher epoch) replaces the old wait; P supersedes the old one.
        self.awaited.insert(request_id.clone(), awaited);
        match self.sources.get(&source) {
            Some(Source::Connected(peer)) => {
                let peer = *peer;
                self.register_with(peer, &request_id);
            }
            Some(Source::Connecting) => {}
            None => {
                self.sources.insert(source.clone(), Source::Connecting);
                self.request_connect(source);
            }
        }
    }

    fn request_connect(&mut self, source: String) {
        if self.connect_requests.is_none() {
            let (requests, queue) = mpsc::channel::<String>();
            let side_channel = Arc::clone(&self.side_channel);
            let shared = Arc::clone(&self.shared);
            let spawned = thread::Builder::new()
                .name(format!("kvpush-connect-{}", self.engine_id))
                .spawn(move || {
                    // Connecting blocks (bounded by the connect timeout), so it runs here
                    // rather than on the writer, which must keep polling.
                    for source in queue {
                        let result =
                            side_channel.connect(&source).map_err(|error| error.to_string());
                        if !shared.send(Command::Connected { source, result }) {
                            break;
                        }
                    }
                });
            match spawned {
                Ok(handle) => {
                    self.connector = Some(handle);
                    self.connect_requests = Some(requests);
                }
                Err(e) => {
                    self.connected(source, Err(format!("cannot start a connector thread: {e}")));
                    return;
                }
            }
        }
        if let Some(requests) = &self.connect_requests {
            let _ = requests.send(source);
        }
    }

    fn connected(&mut self, source: String, result: Result<PeerInfo, String>) {
        let waiting: Vec<String> = self
            .awaited
            .iter()
            .filter(|(_, a)| a.peer.is_none() && a.expectation.source == source)
            .map(|(id, _)| id.clone())
            .collect();
        match result {
            Ok(info) => {
                self.sources.insert(source, Source::Connected(info.id));
                for request_id in waiting {
                    self.register_with(info.id, &request_id);
                }
            }
            Err(reason) => {
                self.sources.remove(&source);
                for request_id in waiting {
                    let detail = format!("cannot reach P at {source}: {reason}");
                    self.end_receive(&request_id, Outcome::Failed(detail));
                }
            }
        }
    }

    fn register_with(&mut self, peer: PeerId, request_id: &str) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        awaited.peer = Some(peer);
        let e = &awaited.expectation;
        let ttl_ms =
            u64::try_from(awaited.deadline.saturating_duration_since(Instant::now()).as_millis())
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
        };
        if let Err(error) = self.side_channel.send(peer, &Message::Register(register)) {
            let detail = format!("cannot register with P: {error}");
            self.end_receive(request_id, Outcome::Failed(detail));
        }
    }

    fn cancel_expectation(&mut self, request_id: &str) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        let outcome = Outcome::Cancelled(format!("request {request_id} cancelled by D"));
        match awaited.peer {
            // Nothing was registered yet, so nothing can be written.
            None => self.end_receive(request_id, outcome),
            Some(peer) => {
                awaited.cancelling = Some(outcome);
                let cancel = Cancel {
                    transfer_key: awaited.key.as_str().to_owned(),
                    request_id: request_id.to_owned(),
                    epoch: awaited.expectation.epoch,
                };
                self.send(peer, Message::Cancel(cancel));
            }
        }
    }

    fn end_receive(&mut self, request_id: &str, outcome: Outcome) {
        let Some(awaited) = self.awaited.remove(request_id) else { return };
        let completed = Instant::now();
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

    fn take_notifications(&mut self) {
        if self.transport.take_notifications(&mut self.received).is_err() {
            Counters::add(&self.shared.counters.transport_errors);
            return;
        }
        let received = std::mem::take(&mut self.received);
        for notification in &received {
            match self.decoder.decode(&notification.payload, unix_millis()) {
                Ok(envelope) => {
                    if let Message::Done(done) = envelope.message {
                        self.done(&notification.from, done);
                    }
                }
                Err(_) => Counters::add(&self.shared.counters.refused_frames),
            }
        }
        self.received = received;
        self.received.clear();
    }

    fn done(&mut self, from: &str, done: Done) {
        let awaited = self
            .awaited
            .get_mut(&done.request_id)
            .filter(|a| a.key.as_str() == done.transfer_key && a.expectation.epoch == done.epoch);
        let Some(awaited) = awaited else {
            // Ended already, or an older epoch's write into blocks D has since re-registered.
            Counters::add(&self.shared.counters.stray_notifications);
            return;
        };
        if awaited.done_from.insert(from.to_owned()) {
            awaited.bytes += done.bytes;
            awaited.runs = awaited.runs.saturating_add(done.runs);
        }
        let complete = awaited.done_from.len() >= awaited.expectation.sources as usize;
        if complete {
            let outcome = match awaited.cancelling.take() {
                // The write beat the cancel: the KV is here, but D no longer wants it.
                Some(cancelled) => cancelled,
                None => Outcome::Done,
            };
            let request_id = done.request_id;
            self.end_receive(&request_id, outcome);
        }
    }

    fn peer_message(&mut self, peer: PeerId, message: Message) {
        match message {
            Message::Fail(fail) => {
                let ours = self
                    .awaited
                    .get(&fail.request_id)
                    .is_some_and(|a| a.peer == Some(peer) && a.expectation.epoch == fail.epoch);
                if ours {
                    let detail = format!("P: {} ({})", fail.detail, fail.reason.as_str());
                    let outcome = match self
                        .awaited
                        .get_mut(&fail.request_id)
                        .and_then(|a| a.cancelling.take())
                    {
                        Some(cancelled) => cancelled,
                        None => Outcome::Failed(detail),
                    };
                    self.end_receive(&fail.request_id, outcome);
                }
            }
            Message::CancelAck(ack) => {
                let cancelled = self
                    .awaited
                    .get_mut(&ack.request_id)
                    .filter(|a| a.peer == Some(peer) && a.expectation.epoch == ack.epoch)
                    .and_then(|a| a.cancelling.take());
                if let Some(outcome) = cancelled {
                    self.end_receive(&ack.request_id, outcome);
                }
            }
            // Error replies, stray DONEs on the side channel: nothing is waiting on them.
            _ => {}
        }
    }

    fn peer_lost(&mut self, peer: PeerId, reason: &str) {
        if let Some(lost) = self.peers.remove(&peer) {
            if let Ok(agent) = &lost.agent {
                let _ = self.transport.remove_peer(agent);
            }
        }
        self.sources.retain(|_, source| !matches!(source, Source::Connected(p) if *p == peer));
        let orphans: Vec<String> = self
            .awaited
            .iter()
            .filter(|(_, a)| a.peer == Some(peer))
            .map(|(id, _)| id.clone())
            .collect();
        for request_id in orphans {
            let outcome = match self.awaited.get_mut(&request_id).and_then(|a| a.cancelling.take())
            {
                Some(cancelled) => cancelled,
                None => Outcome::Failed(format!("lost P: {reason}")),
            };
            self.end_receive(&request_id, outcome);
        }
    }

    // ---- both: deadlines and shutdown -----------------------------------------------------

    fn check_deadlines(&mut self) {
        let now = Instant::now();
        for expired in self.shared.table.expire(now) {
            if let Some((_, registration)) = expired.registration {
                let fail = registration.fail(
                    FailReason::Expired,
                    format!("P's KV for transfer {} was not ready in time", expired.key),
                );
                self.send(registration.peer, Message::Fail(fail));
            }
            if let Some(ready) = expired.ready {
                let reason = format!("no registration from D for transfer {} in time", expired.key);
                self.report_send(&ready, expired.key.as_str(), Outcome::Cancelled(reason), None);
            }
        }
        let late: Vec<String> = self
            .awaited
            .iter()
            .filter(|(_, a)| a.deadline <= now && a.cancelling.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        for request_id in late {
            let Some(awaited) = self.awaited.get_mut(&request_id) else { continue };
            let detail =
                format!("no KV for request {request_id} within {:?}", awaited.expectation.ttl);
            match awaited.peer {
                None => self.end_receive(&request_id, Outcome::Failed(detail)),
                Some(peer) => {
                    // Free nothing until P confirms no write can land (or is gone).
                    awaited.cancelling = Some(Outcome::Failed(detail));
                    let cancel = Cancel {
                        transfer_key: awaited.key.as_str().to_owned(),
                        request_id: request_id.clone(),
                        epoch: awaited.expectation.epoch,
                    };
                    self.send(peer, Message::Cancel(cancel));
                }
            }
        }
    }

    fn shut_down(mut self) {
        let deadline = Instant::now() + DRAIN_ON_CLOSE;
        while !self.in_flight.is_empty() && Instant::now() < deadline {
            self.poll_writes();
            thread::sleep(BUSY_POLL);
        }
        for w in std::mem::take(&mut self.in_flight) {
            self.transport.abandon_write(w.write);
            self.finish(w, Err("the endpoint closed during the write".to_owned()));
        }
        let awaited: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in awaited {
            self.end_receive(&request_id, Outcome::Failed("the endpoint closed".to_owned()));
        }
        // Closing the request queue ends the connector thread after its current attempt.
        self.connect_requests = None;
        if let Some(connector) = self.connector.take() {
            let _ = connector.join();
        }
    }
}

//! The writer thread: the only thread that touches the transport.
//!
//! It drains its inbox (matches, expectations, peer changes, replies to send), posts and polls
//! WRITEs, counts DONE notifications, and enforces deadlines, then reports each request's end as
//! one [`Event`]. It polls every `BUSY_POLL` while anything is in flight or awaited, sleeps on
//! its inbox for up to `IDLE_POLL` while the table holds a half or a command came recently, and
//! for up to `QUIET_POLL` once nothing has happened for `SETTLE`: an idle endpoint costs next to
//! no CPU (a few wake-ups a second), while a new command still wakes it at once.
//!
//! # The fence
//!
//! No byte may land in D's blocks once D reported their receive failed (vLLM then frees or
//! reuses them). The writer keeps that on both sides:
//!
//! - P posts a WRITE only while D's latest proof of life (the side channel's
//!   [`SideChannel::proof_age`]: D echoed a heartbeat P sent that recently) is younger than the
//!   lease (`peer_timeout`), and abandons a WRITE not done within `write_timeout`. A WRITE the
//!   transport cannot release is *quarantined*: P keeps its source blocks for good and tells D,
//!   which keeps its blocks too (both counted, reported as `Quarantined`).
//! - D ends a receive without P's word (FAIL, CANCEL_ACK, DONE) only once P's advertised write
//!   horizon (lease + write timeout + the transport's delivery bound + margin) has passed since D
//!   stopped proving it is alive, i.e. since its connection to P closed. A lost connection is not
//!   proof that P stopped.
//! - P drops a lost peer's registrations at once, and refuses to post for a peer it no longer
//!   has; a reconnect never tears down the NIXL agent the new connection uses (agents are
//!   reference-counted by name, and names are unique per process).

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::layout::KvLayout;
use crate::planner::{BlockList, PlanRequest, Planner};
use crate::protocol::{
    unix_millis, Cancel, CancelAck, Decoder, Done, Encoder, Fail, FailReason, Hello, Limits,
    Message, Register, Secret,
};
use crate::rendezvous::{Match, Outcome as TableOutcome, RendezvousError};
use crate::side_channel::{PeerId, PeerInfo, SideChannel};
use crate::sync::lock;
use crate::transport::{MemorySpace, Notification, Transport, WriteId, WriteState};

use super::control::Slot;
use super::events::{Event, Outcome, Reason, Role, Timeline};
use super::receive::{Awaited, LegState, Stop};
use super::{Counters, EndpointConfig, Expectation, ReadyKv, Share, Shared, HORIZON_MARGIN};

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
/// The horizon D assumes for a P whose Hello advertised none (0), and the most it believes: a
/// P cannot make D hold blocks for longer than this after losing it.
const MAX_HORIZON: Duration = Duration::from_secs(3_600);

/// D's registration as P's table holds it.
#[derive(Debug)]
pub(crate) struct Registration {
    /// The side channel connection it came on (replies go back on it).
    pub(crate) peer: PeerId,
    /// The message itself.
    pub(crate) register: Register,
    /// When it arrived.
    pub(crate) at: Instant,
    /// The peer's quota slot it holds until dropped.
    pub(crate) _slot: Slot,
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
    /// A peer is gone: its connection closed at `at`.
    PeerLost { peer: PeerId, reason: String, at: Instant },
    /// A control message for the writer (FAIL, CANCEL_ACK, ERROR on D).
    FromPeer(PeerId, Message),
    /// P: every slot of this transfer's group ended (see `fanout`): report its send.
    ReportFanOut(TransferKey),
    /// Close: finish or abandon what is in flight, fail what is pending, exit.
    Stop,
}

/// A peer as the writer knows it.
#[derive(Debug)]
struct Peer {
    /// The peer's agent name, from its Hello (what its notifications are sent as).
    name: String,
    /// P: the transport's name for the peer once its metadata loaded (a use of `agents`).
    agent: Result<String, String>,
    /// P: how to write into this peer (D), or why it cannot be written to.
    planner: Result<Planner, String>,
    /// Where the peer's KV cache lives.
    memory: MemorySpace,
    /// D: how long after losing this P it may still be writing (its advertised horizon).
    horizon: Duration,
    /// The model's KV heads the peer holds, and how many ranks its engine splits them over.
    heads: std::ops::Range<u64>,
    tp_size: u32,
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
    /// The transport agent written to (the write holds one use of it).
    agent: String,
}

/// P: a posted WRITE's id, bytes, runs and the agent written to (see `Writer::post`).
type Posted = (WriteId, u64, u32, String);

/// P: why a WRITE was not posted: the FAIL reason for D, the code and detail for P's event.
type Refusal = (FailReason, Reason, String);

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
    /// P posts only while D's proof of life is younger than this (`peer_timeout`).
    lease: Duration,
    shared: Arc<Shared>,
    side_channel: Arc<SideChannel>,
    commands: Receiver<Command>,
    events: Sender<Event>,
    peers: HashMap<PeerId, Peer>,
    /// P: transport agents by name, with how many peers and writes use each: a reconnected D's
    /// new connection shares its agent with the old one until the old one's uses end.
    agents: HashMap<String, usize>,
    in_flight: Vec<InFlight>,
    /// P: writes abandoned that the transport could not release: their blocks stay held.
    quarantined: Vec<InFlight>,
    awaited: HashMap<String, Awaited>,
    /// D: some awaited receive is not fenced (its DONEs may come any moment): poll busily.
    /// Set by every new expectation, recomputed at each deadline check, so that the poll period
    /// does not scan `awaited` on every turn of the loop.
    awaits_kv: bool,
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
            lease: config.peer_timeout,
            transport,
            shared,
            side_channel,
            commands,
            events,
            peers: HashMap::new(),
            agents: HashMap::new(),
            in_flight: Vec::new(),
            quarantined: Vec::new(),
            awaited: HashMap::new(),
            awaits_kv: false,
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

    /// The thread body: runs until `Stop` (or every sender is gone). The caller then calls
    /// [`shut_down`](Self::shut_down) (or [`die`](Self::die) if this panicked).
    pub(crate) fn run(&mut self) {
        loop {
            self.beat();
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
    }

    /// Tells the watchdog (`Shared::health`) the writer is still coming round its loop.
    fn beat(&self) {
        // Relaxed: a timestamp read on its own.
        self.shared
            .writer_beat_ms
            .store(self.shared.millis(), std::sync::atomic::Ordering::Relaxed);
    }

    /// How long the next wait on the inbox may last (see the module docs).
    fn poll_period(&self) -> Duration {
        if !self.in_flight.is_empty() || self.awaits_kv {
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
                        Outcome::cancelled(Reason::Cancelled, reason),
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
            Command::PeerLost { peer, reason, at } => self.peer_lost(peer, &reason, at),
            Command::FromPeer(peer, message) => self.peer_message(peer, message),
            Command::ReportFanOut(base) => self.report_fanout(base),
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
        let hello = &info.hello;
        // Both sides load the peer's agent (P writes into D; D never writes, but NIXL keeps
        // peers symmetric).
        let agent = if hello.agent_metadata.is_empty() {
            Err(format!("peer {} sent no agent metadata: it cannot be written to", hello.engine_id))
        } else {
            self.use_agent(hello)
        };
        let planner = Planner::new(self.layout.clone(), hello.layout.clone())
            .map_err(|e| format!("cannot write into {}: {e}", hello.engine_id));
        let horizon = match hello.write_horizon_ms {
            0 => MAX_HORIZON,
            ms => Duration::from_millis(ms).min(MAX_HORIZON),
        };
        let peer = Peer {
            name: hello.agent_name.clone(),
            agent,
            planner,
            memory: hello.memory,
            horizon,
            heads: hello.layout.global_heads(),
            tp_size: hello.layout.tp_size,
        };
        self.peers.insert(info.id, peer);
    }

    /// One more use of the peer's transport agent, loading it on first use.
    fn use_agent(&mut self, hello: &Hello) -> Result<String, String> {
        if let Some(uses) = self.agents.get_mut(&hello.agent_name) {
            *uses += 1;
            return Ok(hello.agent_name.clone());
        }
        let name = self.transport.add_peer(&hello.agent_metadata).map_err(|e| e.to_string())?;
        if name != hello.agent_name {
            if !self.agents.contains_key(&name) {
                let _ = self.transport.remove_peer(&name);
            }
            return Err(format!(
                "peer {}'s agent metadata names agent {name:?} but its hello says {:?}",
                hello.engine_id, hello.agent_name
            ));
        }
        self.agents.insert(name.clone(), 1);
        Ok(name)
    }

    /// One use of `agent` ended; the last one forgets it.
    fn release_agent(&mut self, agent: &str) {
        let Some(uses) = self.agents.get_mut(agent) else { return };
        *uses -= 1;
        if *uses == 0 {
            self.agents.remove(agent);
            let _ = self.transport.remove_peer(agent);
        }
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
        let mut key = TransferKey::from_canonical(key);
        let mut outcome = outcome;
        if let Some((base, _)) = key.split_slot() {
            // One slot of a transfer written into several D ranks: the send ends with its last.
            let mut groups = lock(&self.shared.fanouts);
            if let Some(group) = groups.get_mut(&base) {
                if !group.conclude(outcome, bytes, runs) {
                    return;
                }
                (outcome, bytes, runs) = group.result();
                groups.remove(&base);
                key = base;
            }
        }
        self.emit(Event {
            role: Role::Send,
            request_id: ready.kv.request_id.clone(),
            key,
            outcome,
            bytes,
            runs,
            timeline,
        });
    }

    /// Reports the send of a transfer whose every slot ended before any was written.
    fn report_fanout(&self, base: TransferKey) {
        let Some(group) = lock(&self.shared.fanouts).remove(&base) else { return };
        let Some(ready) = group.ready() else { return };
        let (outcome, bytes, runs) = group.result();
        self.emit(Event {
            role: Role::Send,
            request_id: ready.kv.request_id.clone(),
            key: base,
            outcome,
            bytes,
            runs,
            timeline: Timeline { ready: Some(self.seconds(ready.at)), ..Timeline::default() },
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
            Ok((write, bytes, runs, agent)) => self.in_flight.push(InFlight {
                write,
                key,
                epoch,
                registration,
                ready,
                matched,
                posted: Instant::now(),
                bytes,
                runs,
                agent,
            }),
            Err((reason, why, detail)) => {
                let outcome = TableOutcome::Failed(detail.clone());
                let _ = self.shared.table.finish(&key, epoch, outcome, Instant::now());
                self.send(
                    registration.peer,
                    Message::Fail(registration.fail(reason, detail.clone())),
                );
                self.report_send(&ready, key.as_str(), Outcome::failed(why, detail), None);
            }
        }
    }

    /// Plans and posts one write; the error says why not, for D (the FAIL's reason) and for P's
    /// event (its reason code and detail).
    fn post(
        &mut self,
        key: &TransferKey,
        registration: &Registration,
        ready: &Ready,
    ) -> Result<Posted, Refusal> {
        if let Some(reason) = self.shared.dead.get() {
            let detail = format!("transfer {key}: {reason}");
            return Err((FailReason::ShuttingDown, Reason::WriterDied, detail));
        }
        let peer = self.peers.get(&registration.peer).ok_or_else(|| {
            let detail = format!("D's connection for transfer {key} is gone");
            (FailReason::Refused, Reason::PeerLost, detail)
        })?;
        let planner = peer
            .planner
            .as_ref()
            .map_err(|e| (FailReason::Incompatible, Reason::Incompatible, e.clone()))?;
        let agent = peer
            .agent
            .as_ref()
            .map_err(|e| (FailReason::WriteError, Reason::WriteError, e.clone()))?;
        let register = &registration.register;
        if register.num_tokens > ready.kv.num_tokens {
            return Err((
                FailReason::Refused,
                Reason::Refused,
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
        let plan = planner
            .plan(&request)
            .map_err(|e| (FailReason::Refused, Reason::Refused, e.to_string()))?;
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
        // The lease, checked last, right before the post: D may have given these blocks up
        // once its proof of life is older than the lease (it then waits out our horizon).
        match self.side_channel.proof_age(registration.peer) {
            Some(age) if age < self.lease => {}
            age => {
                Counters::add(&self.shared.counters.lapsed_leases);
                let age = age.map_or_else(|| "none".to_owned(), |age| format!("{age:.1?} old"));
                return Err((
                    FailReason::Refused,
                    Reason::LeaseLapsed,
                    format!(
                        "transfer {key}: D's last proof of life is {age}, past P's lease of \
                         {:?}; not writing into blocks D may have given up (is the link between \
                         P and D partitioned?)",
                        self.lease
                    ),
                ));
            }
        }
        let checked = Instant::now();
        let write = self
            .transport
            .post_write(agent, &plan.runs, self.memory, remote, &notification)
            .map_err(|e| {
                (FailReason::WriteError, Reason::WriteError, format!("transfer {key}: {e}"))
            })?;
        // The horizon's margin covers the moments between the check and the post; a process
        // stopped right there for longer (SIGSTOP, a VM pause) posted outside it. Nothing can
        // recall a posted WRITE: count it, so that an operator sees the fence was at risk.
        if checked.elapsed() > HORIZON_MARGIN {
            Counters::add(&self.shared.counters.late_posts);
        }
        let agent = agent.clone();
        *self.agents.entry(agent.clone()).or_insert(0) += 1;
        Ok((write, plan.stats.bytes, runs, agent))
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
                    let w = self.in_flight.swap_remove(i);
                    let reason = format!("write not done after {:?}", self.write_timeout);
                    self.abandon(w, &reason);
                    continue;
                }
                Ok(WriteState::Done) => Ok(()),
                Err(e) => Err(e.to_string()),
            };
            let w = self.in_flight.swap_remove(i);
            self.finish(w, result);
        }
    }

    /// Gives up on a write: failed once the transport released it, quarantined if it could not.
    /// Bytes the transport had already handed to the network may still arrive later, within its
    /// delivery bound, which the advertised horizon includes (`EndpointConfig::delivery_bound`).
    fn abandon(&mut self, w: InFlight, reason: &str) {
        if self.transport.abandon_write(w.write) {
            self.finish(w, Err(format!("{reason}; abandoned")));
        } else {
            self.quarantine(w, reason);
        }
    }

    /// A write the transport could not stop may still be moving bytes: neither side's blocks may
    /// be reused, ever. P's event says so (the engine keeps its source blocks), and so does D's
    /// FAIL (D keeps its destination blocks). The write's agent use is never given back.
    fn quarantine(&mut self, w: InFlight, reason: &str) {
        Counters::add(&self.shared.counters.quarantined_writes);
        let detail = format!(
            "transfer {}: {reason}, and the transport could not release the WRITE, which may \
             still be landing: P keeps its source blocks and D must keep its destination \
             blocks (quarantined)",
            w.key
        );
        self.send(
            w.registration.peer,
            Message::Fail(w.registration.fail(FailReason::Quarantined, detail.clone())),
        );
        let now = Instant::now();
        let finished =
            self.shared.table.finish(&w.key, w.epoch, TableOutcome::Failed(detail.clone()), now);
        self.report_send(&w.ready, w.key.as_str(), Outcome::quarantined(detail), Some((&w, now)));
        // A re-registration during the write is into other blocks: serve it.
        if let Some(m) = finished.ok().and_then(|finished| finished.rematch) {
            self.write(m);
        }
        self.quarantined.push(w);
    }

    fn finish(&mut self, w: InFlight, result: Result<(), String>) {
        let now = Instant::now();
        self.release_agent(&w.agent.clone());
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
                Outcome::failed(Reason::WriteError, detail)
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
        let mut key =
            TransferKey::for_request(expectation.transfer_id.as_deref(), &expectation.request_id);
        if let Some(share) = expectation.share.filter(|share| share.of > 1) {
            // P writes this transfer into several D ranks, each under its own slot.
            key = key.slot(share.slot);
        }
        let request_id = expectation.request_id.clone();
        let sources = expectation.sources.clone();
        // A re-registration (higher epoch) replaces the old wait; P supersedes the old one.
        self.awaited.insert(request_id.clone(), Awaited::new(expectation, key, at));
        self.awaits_kv = true;
        for (leg, source) in sources.into_iter().enumerate() {
            match self.sources.get(&source) {
                Some(Source::Connected(peer)) => {
                    let peer = *peer;
                    self.register_with(peer, &request_id, leg);
                }
                Some(Source::Connecting) => {}
                None => {
                    self.sources.insert(source.clone(), Source::Connecting);
                    self.request_connect(source);
                }
            }
        }
        self.settle(&request_id);
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
        match result {
            Ok(info) => {
                self.sources.insert(source, Source::Connected(info.id));
                for (request_id, leg) in waiting {
                    self.register_with(info.id, &request_id, leg);
                }
            }
            Err(reason) => {
                self.sources.remove(&source);
                for (request_id, leg) in waiting {
                    let Some(awaited) = self.awaited.get(&request_id) else { continue };
                    let detail = format!("cannot reach {}: {reason}", awaited.label(leg));
                    self.end_leg(
                        &request_id,
                        leg,
                        Some(Outcome::failed(Reason::Unreachable, detail)),
                    );
                }
            }
        }
    }

    fn register_with(&mut self, peer: PeerId, request_id: &str, leg: usize) {
        let agent = self.peers.get(&peer).map(|p| p.name.clone());
        let mismatch =
            self.awaited.get(request_id).and_then(|a| self.source_mismatch(peer, a, leg));
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
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
        awaited.legs[leg].state = LegState::Registered;
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

    /// Leg `leg` of `request_id` is over (with `failure`, the receive fails and its other legs
    /// are cancelled); the receive is reported once its last leg is over.
    fn end_leg(&mut self, request_id: &str, leg: usize, failure: Option<Outcome>) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        let stops = awaited.end_leg(leg, failure);
        self.stop_legs(request_id, &stops);
        self.settle(request_id);
    }

    /// The receive ends with `outcome` once no leg can still write: registered legs are
    /// cancelled, fenced ones wait out their horizons.
    fn cancel_receive(&mut self, request_id: &str, outcome: Outcome) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        let stops = awaited.cancel(outcome);
        self.stop_legs(request_id, &stops);
        self.settle(request_id);
    }

    /// Sends the CANCELs `stops` calls for; each P must acknowledge within its horizon.
    fn stop_legs(&mut self, request_id: &str, stops: &[Stop]) {
        for &Stop::Cancel(peer) in stops {
            let deadline = Instant::now() + self.horizon(peer);
            let Some(awaited) = self.awaited.get_mut(request_id) else { return };
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

    fn cancel_expectation(&mut self, request_id: &str) {
        let outcome =
            Outcome::cancelled(Reason::Cancelled, format!("request {request_id} cancelled by D"));
        self.cancel_receive(request_id, outcome);
    }

    /// Reports `request_id`'s receive if its last leg is over.
    fn settle(&mut self, request_id: &str) {
        let Some(awaited) = self.awaited.get_mut(request_id) else { return };
        if !awaited.is_over() {
            return;
        }
        let outcome = awaited.outcome();
        self.end_receive(request_id, outcome);
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
            // DONEs arrive in completion order, not posting order: see `decode_unordered`.
            match self.decoder.decode_unordered(&notification.payload, unix_millis()) {
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
        // Only the P agent a leg registered with may end it: a DONE from anyone else, for an
        // ended receive, or for an older epoch (blocks D has since re-registered) is stray.
        let leg = self
            .awaited
            .get(&done.request_id)
            .filter(|a| a.key.as_str() == done.transfer_key && a.expectation.epoch == done.epoch)
            .and_then(|a| a.leg_of_agent(from));
        let (Some(leg), Some(awaited)) = (leg, self.awaited.get_mut(&done.request_id)) else {
            Counters::add(&self.shared.counters.stray_notifications);
            return;
        };
        awaited.bytes += done.bytes;
        awaited.runs = awaited.runs.saturating_add(done.runs);
        // Whatever D wanted since (a cancel, another rank's failure), this leg's KV is here.
        self.end_leg(&done.request_id, leg, None);
    }

    fn peer_message(&mut self, peer: PeerId, message: Message) {
        match message {
            Message::Fail(fail) => {
                let Some(awaited) = self
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
                let leg = self
                    .awaited
                    .get(&ack.request_id)
                    .filter(|a| a.expectation.epoch == ack.epoch)
                    .and_then(|a| a.leg_on(peer))
                    .filter(|&leg| {
                        matches!(
                            self.awaited[&ack.request_id].legs[leg].state,
                            LegState::Cancelling { .. }
                        )
                    });
                if let Some(leg) = leg {
                    self.end_leg(&ack.request_id, leg, None);
                }
            }
            // Error replies, stray DONEs on the side channel: nothing is waiting on them.
            _ => {}
        }
    }

    fn peer_lost(&mut self, peer: PeerId, reason: &str, at: Instant) {
        let lost = self.peers.remove(&peer);
        let horizon = lost.as_ref().map_or(MAX_HORIZON, |p| p.horizon);
        if let Some(Ok(agent)) = lost.map(|p| p.agent) {
            self.release_agent(&agent);
        }
        // P: nothing may be written to a lost peer; its waiting registrations go now.
        let purged = self.shared.table.purge(|r: &Registration| r.peer == peer, Instant::now());
        for _ in &purged {
            Counters::add(&self.shared.counters.purged_registrations);
        }
        self.sources.retain(|_, source| !matches!(source, Source::Connected(p) if *p == peer));
        // D: a lost connection is not proof that P stopped. P writes only while our proof of
        // life is fresh, and we stopped giving it when the connection closed, at `at`.
        for (request_id, awaited) in &mut self.awaited {
            let Some(leg) = awaited.leg_on(peer) else { continue };
            let outcome = Outcome::failed(
                Reason::PeerLost,
                format!(
                    "lost {} for request {request_id}: {reason}; reported once P's write horizon \
                     ({horizon:.1?}) had passed, so no write of P's can still land",
                    awaited.label(leg)
                ),
            );
            awaited.fence(peer, at + horizon, &outcome);
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
                let outcome = Outcome::cancelled(Reason::Expired, reason);
                self.report_send(&ready, expired.key.as_str(), outcome, None);
            }
        }
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
        for (request_id, stops, late) in due {
            self.stop_legs(&request_id, &stops);
            if late {
                let Some(awaited) = self.awaited.get(&request_id) else { continue };
                let detail =
                    format!("no KV for request {request_id} within {:?}", awaited.expectation.ttl);
                // Free nothing until every P confirmed no write can land (or its horizon passed).
                self.cancel_receive(&request_id, Outcome::failed(Reason::Expired, detail));
            }
            self.settle(&request_id);
        }
        // P did not answer a CANCEL within its horizon: stop proving we are alive to it, so that
        // its lease runs out; the horizon then runs from the disconnect (see `peer_lost`).
        for peer in unacknowledged {
            self.side_channel.disconnect(peer);
        }
    }

    /// The writer stopped for good: marks the endpoint unhealthy (new work is refused).
    pub(crate) fn mark_dead(&self, reason: String) {
        let _ = self.shared.dead.set(reason);
    }

    /// The writer's loop panicked: fail everything at once, as far as the fence allows. P's
    /// writes are abandoned (or quarantined) and its table emptied; D's receives end as their
    /// P's horizon passes after the disconnect. Peers are disconnected so they stop waiting.
    pub(crate) fn die(&mut self, reason: String) {
        self.mark_dead(reason.clone());
        let at = Instant::now();
        for peer in self.side_channel.peers() {
            self.side_channel.disconnect(peer.id);
        }
        for w in std::mem::take(&mut self.in_flight) {
            self.abandon(w, &reason);
        }
        // Everything left in the table ends, writes in flight that the panic orphaned too.
        for expired in self.shared.table.drain(at) {
            if let Some((_, registration)) = expired.registration {
                let fail = registration.fail(FailReason::ShuttingDown, reason.clone());
                self.send(registration.peer, Message::Fail(fail));
            }
            if let Some(ready) = expired.ready {
                self.report_send(
                    &ready,
                    expired.key.as_str(),
                    Outcome::failed(Reason::WriterDied, reason.clone()),
                    None,
                );
            }
        }
        let ids: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in ids {
            let Some(awaited) = self.awaited.get(&request_id) else { continue };
            let horizons: Vec<(PeerId, Instant)> = awaited
                .legs
                .iter()
                .filter_map(|leg| leg.peer)
                .map(|peer| (peer, at + self.horizon(peer)))
                .collect();
            let Some(awaited) = self.awaited.get_mut(&request_id) else { continue };
            let outcome = Outcome::failed(
                Reason::WriterDied,
                format!("{reason}; reported after P's write horizon"),
            );
            // Unregistered legs are over; registered ones may be written until the horizon.
            let _ = awaited.cancel(outcome.clone());
            for (peer, until) in horizons {
                awaited.fence(peer, until, &outcome);
            }
            self.settle(&request_id);
        }
        // Wait out the horizons (or a close), reporting each receive as its last horizon passes.
        while let Some(next) = self.awaited.values().filter_map(Awaited::next_fence).min() {
            let wait = next.saturating_duration_since(Instant::now()).min(QUIET_POLL);
            match self.commands.recv_timeout(wait) {
                Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(Command::Expect(expectation, _)) => {
                    let detail = format!("request {}: {reason}", expectation.request_id);
                    self.awaited.remove(&expectation.request_id);
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
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
            }
            let now = Instant::now();
            let ids: Vec<String> = self.awaited.keys().cloned().collect();
            for request_id in ids {
                if let Some(awaited) = self.awaited.get_mut(&request_id) {
                    // No CANCEL goes out: the peers were disconnected above.
                    let _ = awaited.fences_passed(now);
                }
                self.settle(&request_id);
            }
        }
        self.shut_down();
    }

    pub(crate) fn shut_down(&mut self) {
        let deadline = Instant::now() + DRAIN_ON_CLOSE;
        while !self.in_flight.is_empty() && Instant::now() < deadline {
            self.poll_writes();
            thread::sleep(BUSY_POLL);
        }
        for w in std::mem::take(&mut self.in_flight) {
            self.abandon(w, "the endpoint closed during the write");
        }
        let awaited: Vec<String> = self.awaited.keys().cloned().collect();
        for request_id in awaited {
            self.end_receive(&request_id, Outcome::failed(Reason::Closed, "the endpoint closed"));
        }
        // Closing the request queue ends the connector thread after its current attempt.
        self.connect_requests = None;
        if let Some(connector) = self.connector.take() {
            let _ = connector.join();
        }
    }
}

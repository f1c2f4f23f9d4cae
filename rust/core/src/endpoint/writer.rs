//! The writer thread: the only thread that touches the transport, and the loop that drives both
//! of a worker's roles.
//!
//! It drains its inbox ([`Command`]s: matches, expectations, peer changes, replies to send) and
//! hands each to P's send path ([`send`](super::send): plan, fence, post and poll WRITEs) or D's
//! receive path ([`receive`](super::receive): register with P, count DONEs, cancel); every turn
//! it polls the writes in flight and takes the transport's notifications, and every
//! `DEADLINE_CHECK` it lets both paths enforce their deadlines. Each request's end is reported as
//! one [`Event`]. This module owns the loop and its pacing, the peers joining and leaving, and the
//! writer's end (a clean close, or failing everything after a panic); what the two paths share
//! (the transport, the peers the writer knows) is the [`Context`] it lends each of their calls.
//!
//! It polls every `busy_poll` (`EndpointConfig::busy_poll`, 200 µs by default) while anything
//! is in flight or awaited, sleeps on its inbox for up to `IDLE_POLL` while the table holds a
//! half or a command came recently, and for up to `QUIET_POLL` once nothing has happened for
//! `SETTLE`: an idle endpoint costs next to no CPU (a few wake-ups a second), while a new command
//! still wakes it at once.
//!
//! # The fence
//!
//! No byte may land in D's blocks once D reported their receive failed (vLLM then frees or
//! reuses them). A lost connection is not proof that P stopped, and neither is time (a stopped
//! process keeps no deadline), so the writer keeps it by evidence:
//!
//! - P posts a WRITE only while D's latest proof of life (the side channel's
//!   [`proof_age`](crate::side_channel::SideChannel::proof_age): D echoed a heartbeat P sent
//!   that recently) is younger than the lease (`peer_timeout`). It looks at every WRITE's
//!   deadline before anything drives the transport in a turn; a WRITE past `write_timeout` is
//!   reported quarantined and held, never released (NIXL's release of an unfinished WRITE does
//!   not stop UCX), until the transport finishes it. P's FAIL and CANCEL_ACK for a WRITE go out
//!   only once the transport finished with it, to every connection of D's that asked.
//! - D ends a leg without its DONE only on evidence (see `awaited`): P's word (FAIL, or
//!   CANCEL_ACK, asked again on a new connection when D lost the old one), followed by P's
//!   delivery bound when the WRITE did not deliver; or P's endpoint found gone. P's horizon
//!   passing without evidence brings a quarantine notice, and the blocks stay held. D acts on
//!   P's word only after draining its transport of what had already reached it (`step`).
//! - P drops a lost peer's registrations at once, a registration arriving on a connection its D
//!   has since replaced, and refuses to post for a peer it no longer has; a reconnect never
//!   tears down the NIXL agent the new connection uses (agents are reference-counted by name,
//!   and names are unique per process).

use std::collections::HashMap;
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::planner::Planner;
use crate::protocol::{Message, Secret};
use crate::side_channel::{PeerId, PeerInfo};
use crate::transport::Transport;

use super::agents::UnusableAgent;
use super::command::{self, Command};
use super::context::{Context, Peer, Unplannable, MAX_HORIZON};
use super::events::{Event, Reason};
use super::inbox::Commands;
use super::link::Link;
use super::receive::{self, Receives};
use super::send::{self, Sends};
use super::{EndpointConfig, Shared};

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
/// The writer thread's state; see the module docs. Each path keeps its own state (`sends`,
/// `receives`); the rest is what both use.
pub(crate) struct Writer<T: Transport> {
    /// What both paths use (the transport, the peers, ...), lent to each call of theirs.
    pub(super) cx: Context<T>,
    commands: Commands,
    /// P: writes in flight and the agents they use.
    pub(super) sends: Sends,
    /// D: receives awaited and the connections to their P ranks.
    pub(super) receives: Receives,
    last_deadline_check: Instant,
    last_command: Instant,
    /// Poll period while writes are in flight or DONEs awaited.
    busy_poll: Duration,
}

impl<T: Transport> std::fmt::Debug for Writer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("cx", &self.cx)
            .field("sends", &self.sends)
            .field("receives", &self.receives)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Writer<T> {
    pub(crate) fn new(
        config: &EndpointConfig,
        transport: T,
        secret: Option<Secret>,
        shared: Arc<Shared>,
        side_channel: Arc<dyn Link>,
        commands: Commands,
        events: Sender<Event>,
    ) -> Self {
        let sends = Sends::new(config, transport.name(), secret.clone());
        let now = shared.now();
        Self {
            cx: Context {
                layout: config.layout.clone(),
                engine_id: config.engine_id.clone(),
                transport,
                shared,
                side_channel,
                events,
                peers: HashMap::new(),
            },
            commands,
            sends,
            receives: Receives::new(secret, config.limits),
            last_deadline_check: now,
            last_command: now,
            busy_poll: config.busy_poll,
        }
    }

    /// The thread body: runs until `Stop` (or every sender is gone). The caller then calls
    /// [`shut_down`](Self::shut_down) (or [`die`](Self::die) if this panicked).
    pub(crate) fn run(&mut self) {
        loop {
            self.beat();
            let first = match self.commands.recv_timeout(self.poll_period()) {
                Ok(command) => {
                    self.last_command = self.cx.shared.now();
                    Some(command)
                }
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            if self.step(first) {
                break;
            }
        }
    }

    /// One turn of the loop, without waiting: `first` (the command a wait returned) and the
    /// others in the inbox, then the writes and notifications, and the deadlines when due. True
    /// when the writer must stop. [`run`] calls it after each wait; the simulation (`sim`) calls
    /// it itself.
    ///
    /// The commands are taken before the transport is drained and acted on after: P's word
    /// about a WRITE (a FAIL, a CANCEL_ACK) then ends a leg only once D unpacked every byte of
    /// that WRITE that had reached it before the word did (over TCP, D's own progress lands
    /// them; NIXL drains all that arrived on each call).
    ///
    /// [`run`]: Self::run
    pub(crate) fn step(&mut self, first: Option<Command>) -> bool {
        let mut commands: Vec<Command> = first.into_iter().collect();
        // Up to a stop (once stopping, the inbox answers nothing else).
        while !matches!(commands.last(), Some(Command::Stop)) {
            let Ok(command) = self.commands.try_recv() else { break };
            commands.push(command);
        }
        // Deadlines first: nothing below may drive the transport for a write before its
        // deadline was looked at (a stalled process resumes here).
        // Layers that queued up while the writer was busy go as one WRITE each.
        let commands = command::coalesce_layers(commands);
        let now = self.cx.shared.boot_now();
        self.sends.notice_overdue_writes(&mut self.cx, now);
        self.sends.poll_writes(&mut self.cx);
        self.receives.take_notifications(&mut self.cx);
        for command in commands {
            if self.handle(command) {
                return true;
            }
        }
        let now = self.cx.shared.now();
        if now.saturating_duration_since(self.last_deadline_check) >= DEADLINE_CHECK {
            self.last_deadline_check = now;
            self.check_deadlines();
        }
        false
    }

    /// Tells the watchdog (`Shared::health`) the writer is still coming round its loop.
    pub(crate) fn beat(&self) {
        // Relaxed: a timestamp read on its own.
        self.cx
            .shared
            .writer_beat_ms
            .store(self.cx.shared.millis(), std::sync::atomic::Ordering::Relaxed);
    }

    /// How long the next wait on the inbox may last (see the module docs).
    fn poll_period(&self) -> Duration {
        if self.sends.writing() || self.receives.awaits_kv() {
            self.busy_poll
        } else if !self.cx.shared.table.is_empty()
            || self.cx.shared.now().saturating_duration_since(self.last_command) < SETTLE
        {
            IDLE_POLL
        } else {
            QUIET_POLL
        }
    }

    /// Acts on one command; true when the writer must stop.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Write(m) => self.sends.write(&mut self.cx, m),
            Command::Layers { key, ready, regions } => {
                self.sends.stream_layers(&mut self.cx, key, &ready, regions);
            }
            // `step` unpacked these (`coalesce_layers`); one that did not pass there still goes.
            Command::LayersOf { streams, regions } => {
                for layers in streams.commands(&regions) {
                    self.handle(layers);
                }
            }
            Command::Fail { peer, fail } => self.cx.send(peer, Message::Fail(fail)),
            Command::AcknowledgeCancel { peer, cancel, released } => {
                send::acknowledge_cancel(&mut self.cx, peer, cancel, released);
            }
            Command::AcknowledgeWhenWritten { peer, cancel } => {
                self.sends.acknowledge_when_written(&mut self.cx, peer, cancel);
            }
            Command::Expect(expectation, at) => self.receives.expect(&mut self.cx, expectation, at),
            Command::CancelExpectation(request_id) => {
                self.receives.cancel_expectation(&mut self.cx, &request_id)
            }
            Command::Connected { source, result } => {
                self.receives.connected(&mut self.cx, source, result)
            }
            Command::PeerJoined(info) => self.peer_joined(info),
            Command::PeerLost { peer, reason, at } => self.peer_lost(peer, &reason, at),
            Command::FromPeer(peer, message) => {
                self.receives.peer_message(&mut self.cx, peer, message)
            }
            Command::ReportFanOut(base) => send::report_fanout(&self.cx, base),
            Command::Stop => return true,
        }
        false
    }

    // ---- peers ----------------------------------------------------------------------------

    fn peer_joined(&mut self, info: PeerInfo) {
        let hello = &info.hello;
        // Both sides load the peer's agent (P writes into D; D never writes, but NIXL keeps
        // peers symmetric).
        let agent = if hello.agent_metadata.is_empty() {
            Err(UnusableAgent::NoMetadata { engine_id: hello.engine_id.clone() })
        } else {
            self.sends.use_agent(&mut self.cx, hello)
        };
        let planner = Planner::new(self.cx.layout.clone(), hello.layout.clone())
            .map_err(|source| Unplannable { engine_id: hello.engine_id.clone(), source });
        let horizon = match hello.write_horizon_ms {
            0 => MAX_HORIZON,
            ms => Duration::from_millis(ms).min(MAX_HORIZON),
        };
        let delivery_bound = match hello.delivery_bound_ms {
            0 => horizon,
            ms => Duration::from_millis(ms).min(horizon),
        };
        let peer = Peer {
            name: hello.agent_name.clone(),
            agent,
            planner,
            memory: hello.memory,
            horizon,
            delivery_bound,
            heads: hello.layout.global_heads(),
            tp_size: hello.layout.tp_size,
        };
        self.cx.peers.insert(info.id, peer);
    }

    fn peer_lost(&mut self, peer: PeerId, reason: &str, at: Instant) {
        if let Some(Ok(agent)) = self.cx.peers.remove(&peer).map(|p| p.agent) {
            self.sends.release_agent(&mut self.cx, &agent);
        }
        send::purge_registrations(&mut self.cx, peer);
        self.receives.fence_receives(peer, reason, at);
    }

    // ---- both: deadlines and the writer's end ---------------------------------------------

    fn check_deadlines(&mut self) {
        let now = self.cx.shared.now();
        send::expire_sends(&mut self.cx, now);
        self.sends.prune_streams(&self.cx);
        self.receives.check_receives(&mut self.cx, now);
    }

    /// The writer stopped for good: marks the endpoint unhealthy (new work is refused).
    pub(crate) fn mark_dead(&self, reason: String) {
        let _ = self.cx.shared.dead.set(reason);
    }

    /// The writer's loop panicked: fail everything at once, as far as the fence allows. P's
    /// writes in flight are cut (nothing drives the transport for them again, and D is not
    /// told) and its table emptied; D's receives end as their
    /// P's horizon passes after the disconnect. Peers are disconnected so they stop waiting.
    pub(crate) fn die(&mut self, reason: String) {
        self.mark_dead(reason.clone());
        let at = self.cx.shared.now();
        for peer in self.cx.side_channel.peers() {
            self.cx.side_channel.disconnect(peer.id);
        }
        self.sends.fail_sends(&mut self.cx, &reason, at);
        self.receives.fail_receives(&mut self.cx, &reason, at);
        // Wait out the horizons (or a close), reporting each receive as its last horizon passes.
        while let Some(next) = self.receives.next_fence() {
            let wait = next.saturating_duration_since(self.cx.shared.now()).min(QUIET_POLL);
            match self.commands.recv_timeout(wait) {
                Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(Command::Expect(expectation, _)) => receive::refuse_expectation(
                    &mut self.cx,
                    expectation,
                    Reason::WriterDied,
                    &reason,
                ),
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
            }
            let now = self.cx.shared.now();
            self.receives.pass_fences(&mut self.cx, now);
        }
        self.shut_down();
    }

    pub(crate) fn shut_down(&mut self) {
        self.end_backlog();
        self.sends.drain_writes(&mut self.cx, self.busy_poll);
        self.receives.close_receives(&mut self.cx);
    }

    /// The commands still queued when the writer was stopped (a stop goes ahead of them): each
    /// request among them ends in its event, and what P owes a D (a FAIL, a CANCEL_ACK) is
    /// still said; nothing new is started.
    fn end_backlog(&mut self) {
        for command in self.commands.backlog() {
            match command {
                Command::Expect(expectation, _) => receive::refuse_expectation(
                    &mut self.cx,
                    expectation,
                    Reason::Closed,
                    "the endpoint closed before registering it",
                ),
                Command::Write(m) => send::refuse_match(&mut self.cx, m, "the endpoint closed"),
                // Nothing streamed: the request's WRITE is refused as it comes.
                Command::Layers { .. } | Command::LayersOf { .. } => {}
                Command::Fail { peer, fail } => self.cx.send(peer, Message::Fail(fail)),
                Command::AcknowledgeCancel { peer, cancel, released } => {
                    send::acknowledge_cancel(&mut self.cx, peer, cancel, released);
                }
                Command::AcknowledgeWhenWritten { peer, cancel } => {
                    self.sends.acknowledge_when_written(&mut self.cx, peer, cancel);
                }
                Command::ReportFanOut(base) => send::report_fanout(&self.cx, base),
                Command::PeerLost { peer, reason, at } => self.peer_lost(peer, &reason, at),
                // Ended with every other receive, or without a request to end.
                Command::CancelExpectation(_)
                | Command::Connected { .. }
                | Command::PeerJoined(_)
                | Command::FromPeer(..)
                | Command::Stop => {}
            }
        }
    }
}

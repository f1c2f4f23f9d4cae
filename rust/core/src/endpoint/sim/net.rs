//! The simulated side channel: connections between P's and D's handlers, with what the real one
//! (`side_channel`) does that the fence depends on.
//!
//! - Frames go in order per direction and arrive after a delay; a partition holds a direction's
//!   frames (nothing is lost: TCP retransmits once it heals, after a backoff).
//! - Each end is served by its own connection thread, which runs only while its process runs
//!   and is not stuck (a slow reader): it delivers frames to the handler (`Control`) one at a
//!   time, sends a heartbeat every interval (carrying its clock and echoing the peer's, unless
//!   its handler answers unhealthy: then it closes), and closes the connection after
//!   `peer_timeout` of silence. A closed end reports `peer_lost` once, from its thread.
//! - A close sends the peer a FIN behind what was already sent; a reset closes both ends at
//!   once and loses what was on the way.
//! - P's proof of D's life (`proof_age`) is the send time of P's latest heartbeat D echoed, on
//!   P's boot-time clock; the handshake proves each side too.
//! - D connects on its connector thread, one attempt at a time, bounded by `connect_timeout`:
//!   refused when nothing listens at P's address (P was killed; the host answers with a reset),
//!   timed out when a partition or a stopped P keeps the handshake from completing, refused by
//!   P's handler (an unhealthy P), or joined on both sides (P's handler first, then D's).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::endpoint::command::{Command, ConnectFailure};
use crate::endpoint::link::Link;
use crate::protocol::{Hello, Limits, Message, ProtocolError};
use crate::side_channel::{ControlHandler, PeerId, PeerInfo, SideChannelError};
use crate::sync::lock;

use super::plan::Side;
use super::Lab;

/// The side channel's timing, as both endpoints are configured.
#[derive(Debug, Clone, Copy)]
pub(super) struct NetSettings {
    pub(super) heartbeat: Duration,
    pub(super) peer_timeout: Duration,
    pub(super) connect_timeout: Duration,
}

#[derive(Debug)]
enum Body {
    Heartbeat { clock_ms: u64, echo_ms: u64 },
    Message(Box<Message>),
    Fin,
}

#[derive(Debug)]
struct Frame {
    arrive: Duration,
    body: Body,
}

/// One side's end of a joined connection.
#[derive(Debug)]
struct End {
    /// Its id on this side.
    peer: PeerId,
    /// The other side, as this side knows it.
    info: PeerInfo,
    /// Why this side closed it (its thread then forgets it and reports the peer lost).
    closed: Option<String>,
    forgotten: bool,
    /// On this host's monotonic clock.
    last_frame: Instant,
    next_heartbeat: Instant,
    heartbeats: u64,
    /// On this side's channel clock (ms, from 1).
    proven_ms: u64,
    peer_clock_ms: u64,
}

/// A connection: its two ends (D's is absent until D completed its handshake) and the frames
/// on their way in each direction.
#[derive(Debug, Default)]
struct Conn {
    ends: [Option<End>; 2],
    wire: [VecDeque<Frame>; 2],
    /// When each direction gets through again after a partition healed.
    resume: [Duration; 2],
}

#[derive(Debug)]
enum Stage {
    /// D's first packet is on its way to P's host.
    Syn { arrive: Duration },
    /// P's host answered with a reset: nothing listens.
    Refused { arrive: Duration },
    /// P's handler refused D.
    Rejected { arrive: Duration, detail: String },
    /// P joined D on connection `conn`; its welcome is on its way.
    Welcome { conn: usize, arrive: Duration, hello: Box<Hello> },
}

/// D's connection attempt in progress.
#[derive(Debug)]
struct Attempt {
    source: String,
    /// When D's Hello went out, on D's channel clock.
    sent_ms: u64,
    /// On D's monotonic clock.
    deadline: Instant,
    stage: Stage,
}

/// The network's state; see the module docs.
#[derive(Debug)]
pub(super) struct Net {
    conns: Vec<Conn>,
    /// The connection of each joined end, by (side, incarnation, peer id).
    index: BTreeMap<(usize, u32, PeerId), usize>,
    /// Partitions holding each side's outgoing frames (counted: they may overlap).
    pub(super) blocked: [u32; 2],
    /// When a new connection's packets get through again after a partition healed.
    reopened: [Duration; 2],
    /// D's connector: the addresses asked for, and the attempt in progress.
    queue: VecDeque<String>,
    attempt: Option<Attempt>,
    /// Whether anything listens at P's address (P's process is alive).
    pub(super) listening: bool,
    next_port: u16,
    settings: NetSettings,
}

impl Net {
    pub(super) fn new(settings: NetSettings) -> Self {
        Self {
            conns: Vec::new(),
            index: BTreeMap::new(),
            blocked: [0, 0],
            reopened: [Duration::ZERO; 2],
            queue: VecDeque::new(),
            attempt: None,
            listening: false,
            next_port: 40_000,
            settings,
        }
    }
}

impl Lab {
    /// `side`'s channel clock: ms since its (current) process started, from 1.
    fn channel_ms(&self, side: Side) -> u64 {
        let proc = &self.procs[side.index()];
        let since = proc.clock.boot_now().saturating_duration_since(proc.channel_origin);
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    fn mono(&self, side: Side) -> Instant {
        self.procs[side.index()].clock.now()
    }

    fn push(&mut self, conn: usize, from: Side, body: Body) {
        let arrive = self.now() + self.latency();
        let wire = &mut self.net.conns[conn].wire[from.index()];
        let arrive = wire.back().map_or(arrive, |last| last.arrive.max(arrive));
        wire.push_back(Frame { arrive, body });
    }

    /// Whether a frame from `from` on `conn` that arrived by `arrive` gets through now.
    fn through(&self, conn: usize, from: Side, arrive: Duration) -> bool {
        let now = self.now();
        arrive <= now
            && self.net.blocked[from.index()] == 0
            && now >= self.net.conns[conn].resume[from.index()]
    }

    /// A new connection's packet from `from` that left at `arrive` minus its delay gets
    /// through now.
    fn reaches(&self, from: Side, arrive: Duration) -> bool {
        let now = self.now();
        arrive <= now
            && self.net.blocked[from.index()] == 0
            && now >= self.net.reopened[from.index()]
    }

    fn close_end(&mut self, conn: usize, side: Side, reason: String) {
        let Some(end) = self.net.conns[conn].ends[side.index()].as_mut() else { return };
        if end.closed.is_some() {
            return;
        }
        let peer = end.peer;
        end.closed = Some(reason.clone());
        self.log(format!("{side:?} closes peer {peer}: {reason}"));
        self.push(conn, side, Body::Fin);
    }

    /// A turn of `side`'s side-channel threads: P's accepts a handshake that arrived, and each
    /// connection thread (unless stuck) goes round its loop a few times.
    pub(super) fn net_turn(&mut self, side: Side) {
        if side == Side::P {
            self.accept();
        }
        let proc = &self.procs[side.index()];
        if proc.slow_reader > 0 {
            return;
        }
        let incarnation = proc.incarnation;
        let mut conns: Vec<usize> = self
            .net
            .index
            .range((side.index(), incarnation, 0)..=(side.index(), incarnation, PeerId::MAX))
            .map(|(_, &conn)| conn)
            .collect();
        self.rng.shuffle(&mut conns);
        for conn in conns {
            for _ in 0..self.rng.between(1, 3) {
                if !self.serve_once(conn, side) {
                    break;
                }
            }
        }
    }

    /// One go round a connection thread's loop (see `side_channel::connection::serve`); false
    /// when it had nothing to do.
    fn serve_once(&mut self, conn: usize, side: Side) -> bool {
        let (s, other) = (side.index(), side.other());
        let now = self.mono(side);
        let channel_ms = self.channel_ms(side);
        let control = self.procs[s].control.clone();
        let (closed, next_heartbeat, last_frame, peer, echo_ms) =
            match self.net.conns[conn].ends[s].as_ref() {
                Some(end) if !end.forgotten => (
                    end.closed.clone(),
                    end.next_heartbeat,
                    end.last_frame,
                    end.peer,
                    end.peer_clock_ms,
                ),
                _ => return false,
            };
        if let Some(reason) = closed {
            if let Some(end) = self.net.conns[conn].ends[s].as_mut() {
                end.forgotten = true;
            }
            if let Some(control) = control {
                control.peer_lost(peer, &reason);
            }
            return false;
        }
        if now >= next_heartbeat {
            // A worker that cannot act any more must not look alive.
            if let Some(Err(reason)) = control.as_ref().map(|c| c.healthy()) {
                self.close_end(conn, side, format!("this worker is unhealthy: {reason}"));
                return true;
            }
            if let Some(end) = self.net.conns[conn].ends[s].as_mut() {
                end.heartbeats += 1;
                end.next_heartbeat = now + self.net.settings.heartbeat;
            }
            self.push(conn, side, Body::Heartbeat { clock_ms: channel_ms, echo_ms });
            return true;
        }
        let arrived = self.net.conns[conn].wire[other.index()]
            .front()
            .is_some_and(|frame| self.through(conn, other, frame.arrive));
        if arrived {
            let Some(frame) = self.net.conns[conn].wire[other.index()].pop_front() else {
                return false;
            };
            let Some(end) = self.net.conns[conn].ends[s].as_mut() else { return false };
            end.last_frame = now;
            match frame.body {
                Body::Heartbeat { clock_ms, echo_ms } => {
                    end.peer_clock_ms = end.peer_clock_ms.max(clock_ms);
                    // A peer can only echo what it received: proof it was alive after then.
                    if echo_ms > 0 && echo_ms <= channel_ms {
                        end.proven_ms = end.proven_ms.max(echo_ms);
                    }
                }
                Body::Message(message) => {
                    self.log(format!("{side:?} gets {} on peer {peer}", describe(&message)));
                    if let Some(control) = control {
                        control.message(peer, *message);
                    }
                }
                Body::Fin => {
                    self.close_end(conn, side, "the peer closed the connection".to_owned());
                }
            }
            return true;
        }
        let silent = now.saturating_duration_since(last_frame);
        if silent > self.net.settings.peer_timeout {
            self.close_end(conn, side, format!("no heartbeat for {silent:?}"));
            return true;
        }
        false
    }

    /// P's side of D's handshake, once D's packets reached it: P's handler says yes (P's end
    /// joins) or no.
    fn accept(&mut self) {
        let Some(Attempt { stage: Stage::Syn { arrive }, .. }) = &self.net.attempt else { return };
        if !self.net.listening || !self.reaches(Side::D, *arrive) {
            return;
        }
        let (p, d) = (Side::P.index(), Side::D.index());
        let (Some(control), Some(p_hello), Some(d_hello)) = (
            self.procs[p].control.clone(),
            self.procs[p].hello.clone(),
            self.procs[d].hello.clone(),
        ) else {
            return;
        };
        let peer = self.procs[p].next_peer;
        self.procs[p].next_peer += 1;
        self.net.next_port += 1;
        let addr = SocketAddr::new(self.procs[d].addr.ip(), self.net.next_port);
        let info = PeerInfo { id: peer, addr, hello: d_hello, inbound: true };
        let arrive = self.now() + self.latency();
        let stage = match control.peer_joined(&info) {
            Err(refusal) => {
                let detail = refusal.to_string();
                self.log(format!("P refuses D's connection: {detail}"));
                Stage::Rejected { arrive, detail }
            }
            Ok(()) => {
                let now = self.mono(Side::P);
                let incarnation = self.procs[p].incarnation;
                let end = End {
                    peer,
                    info,
                    closed: None,
                    forgotten: false,
                    last_frame: now,
                    next_heartbeat: now + self.net.settings.heartbeat,
                    heartbeats: 0,
                    proven_ms: self.channel_ms(Side::P),
                    peer_clock_ms: 0,
                };
                let conn = self.net.conns.len();
                let mut new = Conn { resume: [self.now(); 2], ..Conn::default() };
                new.ends[p] = Some(end);
                self.net.conns.push(new);
                self.net.index.insert((p, incarnation, peer), conn);
                self.log(format!("P (p{incarnation}) joins D as peer {peer} (connection {conn})"));
                Stage::Welcome { conn, arrive, hello: Box::new(p_hello) }
            }
        };
        if let Some(attempt) = self.net.attempt.as_mut() {
            attempt.stage = stage;
        }
    }

    /// A turn of D's connector thread: starts the next attempt, or moves the current one on.
    pub(super) fn connector_turn(&mut self) {
        let d = Side::D.index();
        if self.net.attempt.is_none() {
            let Some(source) = self.net.queue.pop_front() else { return };
            let arrive = self.now() + self.latency();
            self.net.attempt = Some(Attempt {
                source,
                sent_ms: self.channel_ms(Side::D),
                deadline: self.mono(Side::D) + self.net.settings.connect_timeout,
                stage: Stage::Syn { arrive },
            });
        }
        let Some(attempt) = self.net.attempt.take() else { return };
        let refused_at = self.now() + self.latency();
        let (result, stage) = match attempt.stage {
            Stage::Syn { arrive } if !self.net.listening && self.reaches(Side::D, arrive) => {
                (None, Stage::Refused { arrive: refused_at })
            }
            Stage::Refused { arrive } if self.reaches(Side::P, arrive) => {
                let source = io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused");
                let error = SideChannelError::Connect { addr: attempt.source.clone(), source };
                (Some(Err(ConnectFailure::of(&error))), Stage::Refused { arrive })
            }
            Stage::Rejected { arrive, detail } if self.reaches(Side::P, arrive) => {
                let error = SideChannelError::Refused {
                    addr: attempt.source.clone(),
                    code: "incompatible".to_owned(),
                    detail: detail.clone(),
                };
                (Some(Err(ConnectFailure::of(&error))), Stage::Rejected { arrive, detail })
            }
            Stage::Welcome { conn, arrive, hello } if self.through(conn, Side::P, arrive) => (
                Some(self.join(conn, &hello, attempt.sent_ms, &attempt.source)),
                Stage::Syn { arrive },
            ),
            stage => (None, stage),
        };
        let attempt = Attempt { stage, ..attempt };
        let result = result.or_else(|| {
            (self.mono(Side::D) >= attempt.deadline).then(|| {
                if let Stage::Welcome { conn, .. } = attempt.stage {
                    // D gives up on a connection P already joined: its socket closes.
                    self.push(conn, Side::D, Body::Fin);
                }
                let error = match attempt.stage {
                    Stage::Syn { .. } => SideChannelError::Connect {
                        addr: attempt.source.clone(),
                        source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
                    },
                    _ => SideChannelError::Handshake {
                        addr: attempt.source.clone(),
                        reason: "no hello within connect_timeout".to_owned(),
                        timed_out: true,
                    },
                };
                Err(ConnectFailure::of(&error))
            })
        });
        match result {
            None => self.net.attempt = Some(attempt),
            Some(result) => {
                let source = attempt.source;
                match &result {
                    Ok(info) => self.log(format!("D connected to {source}: peer {}", info.id)),
                    Err(failure) => self.log(format!(
                        "D's connect to {source} failed (refused: {}): {}",
                        failure.refused, failure.reason
                    )),
                }
                if let Some(endpoint) = self.procs[d].endpoint.as_ref() {
                    endpoint.shared.send(Command::Connected { source, result });
                }
            }
        }
    }

    /// D completes its handshake on `conn` with the P that sent `hello`: D's handler says yes
    /// (D's end joins) or no (D closes the connection).
    fn join(
        &mut self,
        conn: usize,
        hello: &Hello,
        sent_ms: u64,
        source: &str,
    ) -> Result<PeerInfo, ConnectFailure> {
        let (p, d) = (Side::P.index(), Side::D.index());
        let peer = self.procs[d].next_peer;
        self.procs[d].next_peer += 1;
        let info =
            PeerInfo { id: peer, addr: self.procs[p].addr, hello: hello.clone(), inbound: false };
        let refused = self.procs[d].control.clone().map(|control| control.peer_joined(&info));
        if let Some(Err(reason)) = refused {
            self.push(conn, Side::D, Body::Fin);
            let error = SideChannelError::Handshake {
                addr: source.to_owned(),
                reason: format!("this side's handler refused the peer: {reason}"),
                timed_out: false,
            };
            return Err(ConnectFailure::of(&error));
        }
        let now = self.mono(Side::D);
        let incarnation = self.procs[d].incarnation;
        self.net.conns[conn].ends[d] = Some(End {
            peer,
            info: info.clone(),
            closed: None,
            forgotten: false,
            last_frame: now,
            next_heartbeat: now + self.net.settings.heartbeat,
            heartbeats: 0,
            proven_ms: sent_ms,
            peer_clock_ms: 0,
        });
        self.net.index.insert((d, incarnation, peer), conn);
        Ok(info)
    }

    /// A partition of `from`'s outgoing packets starts (`on`) or heals.
    pub(super) fn cut(&mut self, from: Side, on: bool) {
        let f = from.index();
        if on {
            self.net.blocked[f] += 1;
            return;
        }
        self.net.blocked[f] = self.net.blocked[f].saturating_sub(1);
        if self.net.blocked[f] > 0 {
            return;
        }
        // TCP retransmits after its backoff: each connection gets through again on its own.
        let now = self.now();
        for conn in 0..self.net.conns.len() {
            let backoff = self.rng.millis(0.0, 1_500.0);
            self.net.conns[conn].resume[f] = now + backoff;
        }
        self.net.reopened[f] = now + self.rng.millis(0.0, 1_000.0);
        if from == Side::P {
            let backoff = self.rng.millis(0.0, 1_500.0);
            self.data_path_healed(backoff);
        }
    }

    /// Every connection is reset: both ends close at once, and what was on the way is lost.
    pub(super) fn reset_connections(&mut self) {
        for conn in &mut self.net.conns {
            conn.wire = [VecDeque::new(), VecDeque::new()];
            for end in conn.ends.iter_mut().flatten() {
                if end.closed.is_none() {
                    end.closed = Some("the connection failed: connection reset by peer".to_owned());
                }
            }
        }
        self.log("every side-channel connection is reset".to_owned());
    }

    /// P's process is gone: its host closes its sockets (FINs to D) and refuses connections;
    /// nobody is left to report its peers lost.
    pub(super) fn p_connections_killed(&mut self) {
        let p = Side::P.index();
        self.net.listening = false;
        let incarnation = self.procs[p].incarnation;
        let conns: Vec<usize> = self
            .net
            .index
            .range((p, incarnation, 0)..=(p, incarnation, PeerId::MAX))
            .map(|(_, &conn)| conn)
            .collect();
        for conn in conns {
            if let Some(end) = self.net.conns[conn].ends[p].as_mut() {
                end.forgotten = true;
                if end.closed.replace("the process exited".to_owned()).is_none() {
                    self.push(conn, Side::P, Body::Fin);
                }
            }
        }
    }

    fn end_of(&self, side: Side, incarnation: u32, peer: PeerId) -> Option<&End> {
        let conn = *self.net.index.get(&(side.index(), incarnation, peer))?;
        self.net.conns[conn].ends[side.index()].as_ref().filter(|end| !end.forgotten)
    }
}

/// A control message, for the trace.
fn describe(message: &Message) -> String {
    match message {
        Message::Register(r) => format!("register {} (blocks {:?})", r.request_id, r.groups),
        Message::Cancel(c) => format!("cancel {}", c.request_id),
        Message::CancelAck(a) => format!("cancel_ack {} (wrote: {})", a.request_id, a.wrote),
        Message::Fail(fail) => format!("fail {} ({})", fail.request_id, fail.reason.as_str()),
        other => other.kind().to_owned(),
    }
}

/// A simulated process's side channel, as its writer sees it (see [`Link`]).
pub(super) struct SimLink {
    pub(super) lab: Arc<Mutex<Lab>>,
    pub(super) side: Side,
    pub(super) incarnation: u32,
    pub(super) addr: SocketAddr,
}

impl fmt::Debug for SimLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimLink")
            .field("side", &self.side)
            .field("incarnation", &self.incarnation)
            .finish_non_exhaustive()
    }
}

impl Link for SimLink {
    fn send(&self, peer: PeerId, message: &Message) -> Result<(), SideChannelError> {
        let mut lab = lock(&self.lab);
        let Some(end) = lab.end_of(self.side, self.incarnation, peer) else {
            return Err(SideChannelError::UnknownPeer(peer));
        };
        if matches!(message, Message::Hello(_) | Message::Attach(_) | Message::Done(_)) {
            let reason = format!("`{}` does not travel on the side channel", message.kind());
            let source = ProtocolError::Invalid { field: "kind", reason };
            return Err(SideChannelError::Invalid { peer, source });
        }
        message
            .validate(&Limits::default())
            .map_err(|source| SideChannelError::Invalid { peer, source })?;
        if let Some(reason) = &end.closed {
            let source = io::Error::new(io::ErrorKind::NotConnected, reason.clone());
            return Err(SideChannelError::Io { peer, addr: end.info.addr, source });
        }
        let Some(&conn) = lab.net.index.get(&(self.side.index(), self.incarnation, peer)) else {
            return Err(SideChannelError::UnknownPeer(peer));
        };
        lab.push(conn, self.side, Body::Message(Box::new(message.clone())));
        Ok(())
    }

    fn proof_age(&self, peer: PeerId) -> Option<Duration> {
        let lab = lock(&self.lab);
        let proven = lab.end_of(self.side, self.incarnation, peer)?.proven_ms;
        let now = lab.channel_ms(self.side);
        (proven > 0).then(|| Duration::from_millis(now.saturating_sub(proven)))
    }

    fn disconnect(&self, peer: PeerId) {
        let mut lab = lock(&self.lab);
        if let Some(&conn) = lab.net.index.get(&(self.side.index(), self.incarnation, peer)) {
            lab.close_end(conn, self.side, "disconnected by this side".to_owned());
        }
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn peers(&self) -> Vec<PeerInfo> {
        let lab = lock(&self.lab);
        let s = self.side.index();
        lab.net
            .index
            .range((s, self.incarnation, 0)..=(s, self.incarnation, PeerId::MAX))
            .filter_map(|(_, &conn)| lab.net.conns[conn].ends[s].as_ref())
            .filter(|end| !end.forgotten)
            .map(|end| end.info.clone())
            .collect()
    }

    fn request_connect(&self, source: &str) -> Result<(), ConnectFailure> {
        lock(&self.lab).net.queue.push_back(source.to_owned());
        Ok(())
    }

    fn close(&self) {
        // The simulation closes a process's connections itself (see `p_connections_killed`).
    }
}

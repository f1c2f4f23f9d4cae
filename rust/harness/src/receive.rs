//! D's receive state machine, driven through the public API against scripted fake Ps.
//!
//! A run starts a real D [`Endpoint`] (a loopback transport, a signed side channel) and three
//! fake P ranks at fixed addresses: P0 holds every KV head D needs, P1 and P2 half of them each
//! (P runs twice D's tensor parallel size), so an expectation names one leg (P0) or two (P1 and
//! P2), or any other mix, or an address where nothing listens. A fake P is what D sees of a P
//! worker: a [`SideChannel`] of its own (its handler hears D's REGISTERs and CANCELs) and a
//! loopback agent that sends D the DONE notifications a P's WRITE would carry; it writes no
//! bytes. The [`Script`] has D expect and cancel requests, and the fake Ps send DONEs (signed
//! with the secret, another one or none; from the right agent, another rank's or a stranger's;
//! for the right or a wrong key, request or epoch; stamped now, in the future or long ago;
//! duplicated, early, late), FAILs with every reason, CANCEL_ACKs for the right or a wrong epoch,
//! error replies and garbage notifications, serve REGISTERs and answer CANCELs or not, drop D's
//! connections, stall (a paused process: its connection goes silent past D's peer timeout),
//! close (the endpoint is gone: its address refuses) and start again at the same address as
//! another endpoint.
//!
//! At the end every fake P closes and the run waits (boundedly) for D to end its receives. Each
//! thing a fake P does that tells D nothing more of a registration can land (a valid DONE, a
//! FAIL other than quarantined, a CANCEL_ACK for its epoch, the endpoint closing) takes a tick,
//! and so does each poll of D's events, so that the oracle knows what D could have known when it
//! reported. What must hold, whatever the script did:
//!
//! * D's writer stays healthy and no thread panics.
//! * A receive reports done only once every leg's P sent a valid DONE for its current epoch.
//! * A receive reports failed or cancelled only once no fake P that heard its REGISTER may
//!   still write: each has sent a valid DONE, a FAIL or a CANCEL_ACK for that epoch, or is gone
//!   and its advertised delivery bound (the horizon, when it advertised none) has passed since
//!   (D can only learn it after the close, and bytes its host accepted may land until then).
//! * Each receive ends in exactly one final event, after at most one quarantined notice (a
//!   P's FAIL `quarantined` may leave it held for good, without a final event); no event reports
//!   a request D did not expect, and every event that is not done carries a detail.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use kvpush_core::endpoint::{Endpoint, EndpointConfig, Expectation, Outcome, Role};
use kvpush_core::layout::KvLayout;
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::{
    unix_millis, BlockGroup, CancelAck, Done, Encoder, ErrorReply, Fail, FailReason, Hello, Limits,
    Message, PROTOCOL_VERSION,
};
use kvpush_core::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
};
use kvpush_core::transport::{MemorySpace, Transport};

use crate::cache::{Cache, Shape};
use crate::{
    panics, pick, secret, tally, unique, Clock, Few, Report, CONNECT_TIMEOUT, HEARTBEAT,
    PEER_TIMEOUT, SECRET, WRITE_TIMEOUT, WRONG_SECRET,
};

/// Most actions of a script.
pub const MAX_ACTIONS: usize = 40;
/// All of a script's waits together.
const WAIT_BUDGET: Duration = Duration::from_millis(250);
/// The fake P ranks.
const RANKS: usize = 3;
/// The write horizon every fake P advertises: how long D waits after losing it.
const HORIZON: Duration = Duration::from_millis(120);
/// How long a stalled fake P's connection stays silent: past D's peer timeout.
const STALL: Duration = Duration::from_millis(550);
/// The delivery bound a fake P advertises when it advertises one.
const BOUND: Duration = Duration::from_millis(30);
/// How long the fake Ps stay up after a lingering script: D asks a silent P twice, a horizon
/// apart, before it reports the receive quarantined.
const LINGER: Duration = Duration::from_millis(600);
/// How long the end of a run waits for D's receives to end once every fake P is gone: a
/// horizon, D's reconnect attempt and a handshake, with room for a busy machine.
const SETTLE: Duration = Duration::from_secs(4);
/// How far off a DONE's stamp is when the script says future or stale: far beyond D's clock
/// skew (below) and any horizon.
const FAR: u64 = 120_000;
const CLOCK_SKEW: Duration = Duration::from_secs(2);
/// What every endpoint of this harness serves: the other harness's endpoints (a test running
/// beside this one may get a port one of these let go of) refuse them at the handshake.
const COMPATIBILITY: &str = "harness-receive-model/bf16";

// ------------------------------------------------------------------------------------------
// The script.

/// What one run does: how each fake P answers, and the actions.
#[derive(Arbitrary, Debug, Clone)]
pub struct Script {
    /// P0, P1, P2.
    pub ranks: [RankSpec; RANKS],
    /// After the actions, the fake Ps stay up for a few horizons before they close: long
    /// enough for D to give up on a P that does not answer, and report it quarantined.
    pub linger: bool,
    /// What happens, in order.
    pub actions: Few<Action, MAX_ACTIONS>,
}

/// How a fake P behaves unless an action says otherwise.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct RankSpec {
    /// What it does with D's REGISTERs.
    pub serves: Serves,
    /// What it does with D's CANCELs.
    pub answers: Answers,
    /// Its Hello's delivery bound: 0 (unknown: D assumes the horizon) or 30 ms.
    pub bounded: bool,
}

/// What a fake P does with a REGISTER, as soon as it hears it.
#[derive(Debug, Clone, Copy)]
pub enum Serves {
    /// Nothing (the script's actions may).
    Hold,
    /// A valid DONE: the KV is written.
    Deliver,
    /// A FAIL (`refused`).
    Refuse,
}

/// What a fake P does with a CANCEL.
#[derive(Debug, Clone, Copy)]
pub enum Answers {
    /// A CANCEL_ACK for its epoch (it wrote nothing).
    Ack,
    /// Nothing: a hung or partitioned P.
    Ignore,
    /// A CANCEL_ACK for another epoch.
    AckOtherEpoch,
}

/// One step of a script.
#[derive(Debug, Clone)]
pub enum Action {
    /// D expects a new request from these P ranks.
    Expect { legs: Legs, ttl: ExpectTtl },
    /// D cancels one of its requests.
    Cancel { request: u8 },
    /// A fake P sends D a DONE for one of its requests (`copies` more times), once it heard
    /// the request's REGISTER (waiting a little for it) unless `early`.
    Done { rank: u8, request: u8, forgery: Forgery, copies: u8, early: bool },
    /// A fake P sends a FAIL.
    Fail { rank: u8, request: u8, reason: u8, other_epoch: bool },
    /// A fake P sends a CANCEL_ACK, asked for or not.
    Ack { rank: u8, request: u8, other_epoch: bool, wrote: bool },
    /// A fake P sends an error reply.
    Error { rank: u8 },
    /// A fake P's agent sends bytes that are no frame.
    Noise { rank: u8, bytes: Few<u8, 48> },
    /// A fake P drops its connections to D (and goes on listening).
    Disconnect { rank: u8 },
    /// A fake P stalls (a paused process) once D next sends it something: that connection
    /// goes silent, no heartbeats either, past D's peer timeout.
    Stall { rank: u8 },
    /// A fake P's endpoint is gone: its side channel and agent close, its address refuses.
    Close { rank: u8 },
    /// Another endpoint (a new agent) listens at a closed fake P's address.
    Restart { rank: u8 },
    /// A fake P answers CANCELs differently from now on.
    Answer { rank: u8, answers: Answers },
    /// A fake P serves REGISTERs differently from now on.
    Serve { rank: u8, serves: Serves },
    /// Time passes (at most 31 ms, within the script's budget).
    Wait { ms: u8 },
}

/// The P ranks an expectation names.
#[derive(Debug, Clone, Copy)]
pub enum Legs {
    /// P0, which holds every head.
    Whole,
    /// P1 and P2, which hold half each (in either order).
    Split { reversed: bool },
    /// Any ranks, in order (an empty mask names P0 and P1): D refuses a set that does not
    /// cover its heads exactly.
    Ranks(u8),
    /// An address where nothing listens.
    Nowhere,
}

/// How long D waits for the KV.
#[derive(Debug, Clone, Copy)]
pub enum ExpectTtl {
    /// Beyond the run.
    Long,
    /// Up to 200 ms: D cancels by itself.
    Short(u8),
}

/// What is wrong with a DONE.
#[derive(Debug, Clone, Copy)]
pub enum Forgery {
    /// Nothing: the DONE a P's WRITE carries.
    Genuine,
    WrongSecret,
    Unsigned,
    /// Sent by another fake P's agent (right for that rank's leg, if it is one).
    OtherRank(u8),
    /// Sent by an agent no fake P has.
    Stranger,
    WrongKey,
    WrongRequest,
    WrongEpoch,
    /// Stamped far in the future.
    Future,
    /// Stamped long before any horizon.
    Stale,
}

// Weighted draws (see `pick`): the first choice of each is the common, well-formed one.

impl<'a> Arbitrary<'a> for Serves {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok([Self::Hold, Self::Deliver, Self::Refuse][pick(u, &[5, 4, 1])?])
    }
}

impl<'a> Arbitrary<'a> for Answers {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok([Self::Ack, Self::Ignore, Self::AckOtherEpoch][pick(u, &[6, 3, 1])?])
    }
}

impl<'a> Arbitrary<'a> for Action {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[14, 5, 22, 7, 5, 2, 2, 5, 4, 4, 3, 3, 12, 3])? {
            0 => Self::Expect { legs: u.arbitrary()?, ttl: u.arbitrary()? },
            1 => Self::Cancel { request: u.arbitrary()? },
            2 => Self::Done {
                rank: u.arbitrary()?,
                request: u.arbitrary()?,
                forgery: u.arbitrary()?,
                copies: u.arbitrary()?,
                early: pick(u, &[4, 1])? == 1,
            },
            3 => Self::Fail {
                rank: u.arbitrary()?,
                request: u.arbitrary()?,
                reason: u.arbitrary()?,
                other_epoch: pick(u, &[5, 1])? == 1,
            },
            4 => Self::Ack {
                rank: u.arbitrary()?,
                request: u.arbitrary()?,
                other_epoch: pick(u, &[5, 1])? == 1,
                wrote: u.arbitrary()?,
            },
            5 => Self::Error { rank: u.arbitrary()? },
            6 => Self::Noise { rank: u.arbitrary()?, bytes: u.arbitrary()? },
            7 => Self::Disconnect { rank: u.arbitrary()? },
            8 => Self::Close { rank: u.arbitrary()? },
            9 => Self::Restart { rank: u.arbitrary()? },
            10 => Self::Answer { rank: u.arbitrary()?, answers: u.arbitrary()? },
            11 => Self::Serve { rank: u.arbitrary()?, serves: u.arbitrary()? },
            12 => Self::Wait { ms: u.arbitrary()? },
            _ => Self::Stall { rank: u.arbitrary()? },
        })
    }
}

impl<'a> Arbitrary<'a> for Legs {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[4, 4, 1, 1])? {
            0 => Self::Whole,
            1 => Self::Split { reversed: u.arbitrary()? },
            2 => Self::Ranks(u.arbitrary()?),
            _ => Self::Nowhere,
        })
    }
}

impl<'a> Arbitrary<'a> for ExpectTtl {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[3, 1])? {
            0 => Self::Long,
            _ => Self::Short(u.arbitrary()?),
        })
    }
}

impl<'a> Arbitrary<'a> for Forgery {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[12, 1, 1, 2, 1, 1, 1, 1, 1, 1])? {
            0 => Self::Genuine,
            1 => Self::WrongSecret,
            2 => Self::Unsigned,
            3 => Self::OtherRank(u.arbitrary()?),
            4 => Self::Stranger,
            5 => Self::WrongKey,
            6 => Self::WrongRequest,
            7 => Self::WrongEpoch,
            8 => Self::Future,
            _ => Self::Stale,
        })
    }
}

// ------------------------------------------------------------------------------------------
// Fake Ps.

/// What the fake Ps heard from D and did, in order: the oracle's evidence.
#[derive(Default)]
struct Journal {
    /// (tick, instance, request id, epoch) of every REGISTER an instance heard.
    registers: Vec<(u64, usize, String, u64)>,
    /// The nonce of each REGISTER an instance heard, by (instance, request id, epoch): a DONE
    /// counts only when it echoes it.
    nonces: std::collections::HashMap<(usize, String, u64), u64>,
    /// What was heard and waits for the harness thread to answer: (instance, connection,
    /// message), REGISTERs and CANCELs.
    unanswered: Vec<(usize, PeerId, Message)>,
}

/// A fake P's side-channel handler: records what D sends, keeps its live connections.
struct Ear {
    instance: usize,
    clock: Arc<Clock>,
    journal: Arc<Mutex<Journal>>,
    connections: Mutex<Vec<PeerId>>,
    /// The next message D sends stalls its connection this long (see [`Action::Stall`]).
    stall: Mutex<Option<Duration>>,
}

impl ControlHandler for Ear {
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner).push(peer.id);
        Ok(())
    }
    fn message(&self, peer: PeerId, message: Message) {
        let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        if let Message::Register(r) = &message {
            let seq = self.clock.tick();
            journal.registers.push((seq, self.instance, r.request_id.clone(), r.epoch));
            journal.nonces.insert((self.instance, r.request_id.clone(), r.epoch), r.nonce);
        }
        if matches!(message, Message::Register(_) | Message::Cancel(_)) {
            journal.unanswered.push((self.instance, peer, message));
        }
        drop(journal);
        // While a callback runs, its connection neither reads nor sends heartbeats.
        if let Some(stall) = self.stall.lock().unwrap_or_else(PoisonError::into_inner).take() {
            thread::sleep(stall);
        }
    }
    fn peer_lost(&self, peer: PeerId, _reason: &str) {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner).retain(|&p| p != peer);
    }
}

/// One endpoint at a fake P's address. Drops its channel before its agent.
struct Instance {
    channel: SideChannel,
    ear: Arc<Ear>,
    agent: LoopbackTransport,
    right: Encoder,
    wrong: Encoder,
    unsigned: Encoder,
}

/// A fake P rank: a fixed address and the endpoint there now, if any.
struct Rank {
    address: SocketAddr,
    tp_rank: u32,
    tp_size: u32,
    bounded: bool,
    serves: Serves,
    answers: Answers,
    now: Option<(usize, Instance)>,
}

/// A P rank's KV layout as its Hello shows it (D never writes, so no memory backs it).
fn layout(tp_rank: u32, tp_size: u32) -> KvLayout {
    let heads = Shape::WHOLE.heads / tp_size;
    let shape = Shape { heads, tp_rank, tp_size, ..Shape::WHOLE };
    Cache::new(shape, |_| 0).layout()
}

impl Rank {
    /// Starts an endpoint at this rank's address: instance `instance`, with a fresh agent.
    fn start(
        &mut self,
        instance: usize,
        d_agent: &str,
        clock: &Arc<Clock>,
        journal: &Arc<Mutex<Journal>>,
    ) -> Result<(), String> {
        let mut agent = LoopbackTransport::new(unique(&format!("harness-p{}-agent", self.tp_rank)))
            .map_err(|e| e.to_string())?;
        agent.add_peer(d_agent.as_bytes()).map_err(|e| e.to_string())?;
        let engine = unique("harness-p");
        let hello = Hello {
            engine_id: engine.clone(),
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            pp_rank: 0,
            pp_size: 1,
            agent_name: agent.name().to_owned(),
            agent_metadata: agent.name().as_bytes().to_vec(),
            layout: layout(self.tp_rank, self.tp_size),
            compatibility: COMPATIBILITY.into(),
            versions: vec![PROTOCOL_VERSION],
            memory: MemorySpace::DRAM,
            nonce: 0,
            echo: 0,
            write_horizon_ms: HORIZON.as_millis() as u64,
            delivery_bound_ms: if self.bounded { BOUND.as_millis() as u64 } else { 0 },
        };
        let mut config = SideChannelConfig::new(self.address, &engine);
        config.secret = Some(secret(SECRET));
        config.heartbeat_interval = HEARTBEAT;
        config.peer_timeout = PEER_TIMEOUT;
        config.connect_timeout = CONNECT_TIMEOUT;
        config.write_timeout = WRITE_TIMEOUT;
        let ear = Arc::new(Ear {
            instance,
            clock: Arc::clone(clock),
            journal: Arc::clone(journal),
            connections: Mutex::default(),
            stall: Mutex::default(),
        });
        let channel = SideChannel::start(config, hello, Arc::clone(&ear) as _)
            .map_err(|e| format!("cannot listen at {}: {e}", self.address))?;
        let name = agent.name().to_owned();
        self.now = Some((
            instance,
            Instance {
                channel,
                ear,
                agent,
                right: Encoder::new(&name, Some(secret(SECRET))),
                wrong: Encoder::new(&name, Some(secret(WRONG_SECRET))),
                unsigned: Encoder::new(&name, None),
            },
        ));
        Ok(())
    }

    /// The connection D joined last, if any is up.
    fn connection(&self) -> Option<(usize, &Instance, PeerId)> {
        let (id, instance) = self.now.as_ref()?;
        let peer =
            *instance.ear.connections.lock().unwrap_or_else(PoisonError::into_inner).last()?;
        Some((*id, instance, peer))
    }
}

// ------------------------------------------------------------------------------------------
// A run.

/// Something a fake P did that tells D nothing more of a registration of it can land.
#[derive(Debug, Clone)]
struct Release {
    seq: u64,
    instance: usize,
    request_id: String,
    epoch: u64,
}

/// A DONE some agent sent D.
#[derive(Debug, Clone)]
struct DoneSent {
    seq: u64,
    /// The fake P instance whose agent sent it; `None` for a stranger.
    instance: Option<usize>,
    request_id: String,
    /// Right secret, key, request, epoch and stamp: a valid DONE from that instance.
    valid: bool,
}

/// One expectation and what D reported of it.
struct Request {
    id: String,
    epoch: u64,
    /// The ranks it names (`None`: the address where nothing listens).
    legs: Vec<Option<usize>>,
    /// (tick of the poll that saw it, when, outcome).
    events: Vec<(u64, Instant, Outcome)>,
    /// A fake P sent FAIL quarantined for it: D may hold it for good.
    held: bool,
}

/// One run's state. `d` drops first, then the fake Ps (their agents), then D's memory.
struct Run {
    d: Endpoint,
    ranks: Vec<Rank>,
    stranger: LoopbackTransport,
    stranger_encoder: Encoder,
    _d_memory: Cache,
    d_agent: String,
    /// A port nothing listens at.
    nowhere: SocketAddr,
    clock: Arc<Clock>,
    journal: Arc<Mutex<Journal>>,
    /// Every instance ever started: its rank, and the tick and time it closed at.
    instances: Vec<(usize, Option<(u64, Instant)>)>,
    requests: Vec<Request>,
    releases: Vec<Release>,
    dones: Vec<DoneSent>,
    budget: Duration,
    violations: Vec<String>,
    panics_before: usize,
}

/// Runs `script` against a fresh D endpoint and reports what broke.
pub fn run(script: &Script) -> Report {
    let mut run = match Run::start(script) {
        Ok(run) => run,
        Err(error) => {
            return Report {
                violations: vec![format!("the run could not start: {error}")],
                ..Report::default()
            }
        }
    };
    for action in script.actions.iter() {
        // Before anything a fake P does: D's reports so far were made without it.
        run.pump();
        run.act(action);
        run.check_health("after an action");
    }
    run.finish(script.linger)
}

/// A free port on 127.0.0.1 (bound, then let go).
fn free_port() -> std::io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

impl Run {
    fn start(script: &Script) -> Result<Self, String> {
        let panics_before = panics().len();
        let clock = Arc::new(Clock::default());
        let journal = Arc::new(Mutex::new(Journal::default()));
        let d_memory = Cache::new(Shape::WHOLE, |_| 0);
        let d_agent = unique("harness-d-agent");
        let mut transport = LoopbackTransport::new(&d_agent).map_err(|e| e.to_string())?;
        // SAFETY: `d_memory` outlives the endpoint that owns the transport (see `Run`).
        unsafe { transport.register_memory(&[d_memory.region()]) }.map_err(|e| e.to_string())?;
        let mut config = EndpointConfig::new(unique("harness-d"), d_memory.layout());
        config.compatibility = COMPATIBILITY.into();
        config.secret = Some(SECRET.to_vec());
        config.heartbeat_interval = HEARTBEAT;
        config.peer_timeout = PEER_TIMEOUT;
        config.write_timeout = WRITE_TIMEOUT;
        config.connect_timeout = CONNECT_TIMEOUT;
        config.limits = Limits { max_clock_skew: CLOCK_SKEW, ..Limits::default() };
        let d = Endpoint::start(config, transport).map_err(|e| e.to_string())?;
        let mut stranger =
            LoopbackTransport::new(unique("harness-stranger")).map_err(|e| e.to_string())?;
        stranger.add_peer(d_agent.as_bytes()).map_err(|e| e.to_string())?;
        let stranger_encoder = Encoder::new(stranger.name(), Some(secret(SECRET)));
        let mut run = Self {
            d,
            ranks: Vec::new(),
            stranger,
            stranger_encoder,
            _d_memory: d_memory,
            d_agent,
            nowhere: free_port().map_err(|e| e.to_string())?,
            clock,
            journal,
            instances: Vec::new(),
            requests: Vec::new(),
            releases: Vec::new(),
            dones: Vec::new(),
            budget: WAIT_BUDGET,
            violations: Vec::new(),
            panics_before,
        };
        for (i, spec) in script.ranks.iter().enumerate() {
            let (tp_rank, tp_size) = [(0, 1), (0, 2), (1, 2)][i];
            run.ranks.push(Rank {
                address: free_port().map_err(|e| e.to_string())?,
                tp_rank,
                tp_size,
                bounded: spec.bounded,
                serves: spec.serves,
                answers: spec.answers,
                now: None,
            });
            run.restart(i);
            if run.ranks[i].now.is_none() {
                return Err(format!("fake P{i} could not start"));
            }
        }
        Ok(run)
    }

    /// A new endpoint at rank `i`'s address, if none is there.
    fn restart(&mut self, i: usize) {
        if self.ranks[i].now.is_some() {
            return;
        }
        let instance = self.instances.len();
        let (clock, journal, d_agent) = (&self.clock, &self.journal, &self.d_agent);
        if self.ranks[i].start(instance, d_agent, clock, journal).is_ok() {
            self.instances.push((i, None));
        }
    }

    fn rank(&self, rank: u8) -> usize {
        usize::from(rank) % RANKS
    }

    /// The request an action names, among those D expects.
    fn request(&self, request: u8) -> Option<usize> {
        (!self.requests.is_empty()).then(|| usize::from(request) % self.requests.len())
    }

    /// Takes D's events, and answers what the fake Ps heard (REGISTERs and CANCELs) as each one
    /// serves and answers.
    fn pump(&mut self) {
        let events = self.d.poll();
        let seq = self.clock.tick();
        let seen = Instant::now();
        for event in events {
            if let Some(cause) = event.outcome.cause() {
                if cause.detail.is_empty() {
                    self.violations.push(format!("{event:?} carries no detail"));
                }
            }
            match self.requests.iter_mut().find(|r| r.id == event.request_id) {
                Some(request) if event.role == Role::Receive => {
                    request.events.push((seq, seen, event.outcome));
                }
                _ => self.violations.push(format!("D reported what it never expected: {event:?}")),
            }
        }
        let heard = std::mem::take(
            &mut self.journal.lock().unwrap_or_else(PoisonError::into_inner).unanswered,
        );
        for (instance, peer, message) in heard {
            let Some(i) = self.live(instance) else { continue };
            match message {
                Message::Register(register) => match self.ranks[i].serves {
                    Serves::Hold => {}
                    Serves::Deliver => {
                        let key = (register.transfer_key, register.request_id, register.epoch);
                        self.send_done(i, &key, Forgery::Genuine);
                    }
                    Serves::Refuse => {
                        let fail = Fail {
                            transfer_key: register.transfer_key,
                            request_id: register.request_id,
                            epoch: register.epoch,
                            reason: FailReason::Refused,
                            detail: "the fake P refuses the registration".into(),
                        };
                        self.say(i, instance, peer, Message::Fail(fail));
                    }
                },
                Message::Cancel(cancel) => {
                    let epoch = match self.ranks[i].answers {
                        Answers::Ignore => continue,
                        Answers::Ack => cancel.epoch,
                        Answers::AckOtherEpoch => cancel.epoch.wrapping_add(1),
                    };
                    let ack = CancelAck {
                        transfer_key: cancel.transfer_key,
                        request_id: cancel.request_id,
                        epoch,
                        wrote: false,
                        delivered: false,
                    };
                    self.say(i, instance, peer, Message::CancelAck(ack));
                }
                _ => {}
            }
        }
    }

    /// The rank whose endpoint is instance `instance`, while it is up.
    fn live(&self, instance: usize) -> Option<usize> {
        self.ranks.iter().position(|r| r.now.as_ref().is_some_and(|(id, _)| *id == instance))
    }

    /// Fake P `i` (instance `instance`) sends `message` on connection `peer`; a FAIL or a
    /// CANCEL_ACK is recorded as a release first (D may act on it the moment it is written),
    /// and forgotten if it was not sent.
    fn say(&mut self, i: usize, instance: usize, peer: PeerId, message: Message) {
        let release = match &message {
            Message::Fail(f) if f.reason != FailReason::Quarantined => {
                Some((f.request_id.clone(), f.epoch))
            }
            Message::CancelAck(a) => Some((a.request_id.clone(), a.epoch)),
            _ => None,
        };
        let at = self.releases.len();
        if let Some((request_id, epoch)) = release {
            let seq = self.clock.tick();
            self.releases.push(Release { seq, instance, request_id, epoch });
        }
        let Some((_, now)) = &self.ranks[i].now else { return };
        if now.channel.send(peer, &message).is_err() {
            self.releases.truncate(at);
        } else if let Message::Fail(f) = &message {
            if f.reason == FailReason::Quarantined {
                if let Some(r) =
                    self.requests.iter_mut().find(|r| r.id == f.request_id && r.epoch == f.epoch)
                {
                    r.held = true;
                }
            }
        }
    }

    fn act(&mut self, action: &Action) {
        match *action {
            Action::Expect { legs, ttl } => self.expect(legs, ttl),
            Action::Cancel { request } => {
                if let Some(r) = self.request(request) {
                    let _ = self.d.cancel(&self.requests[r].id);
                }
            }
            Action::Done { rank, request, forgery, copies, early } => {
                let i = self.rank(rank);
                let Some(r) = self.request(request) else { return };
                if !early {
                    self.hear(i, r);
                }
                let key = (
                    self.requests[r].id.clone(),
                    self.requests[r].id.clone(),
                    self.requests[r].epoch,
                );
                for _ in 0..=copies % 3 {
                    self.send_done(i, &key, forgery);
                }
            }
            Action::Fail { rank, request, reason, other_epoch } => {
                let i = self.rank(rank);
                let (Some(r), Some((instance, _, peer))) =
                    (self.request(request), self.ranks[i].connection())
                else {
                    return;
                };
                let reasons = FailReason::KNOWN.len();
                let reason = match usize::from(reason) % (reasons + 1) {
                    n if n < reasons => FailReason::KNOWN[n].clone(),
                    _ => FailReason::Unknown("from-a-newer-peer".into()),
                };
                let request = &self.requests[r];
                let fail = Fail {
                    transfer_key: request.id.clone(),
                    request_id: request.id.clone(),
                    epoch: request.epoch + u64::from(other_epoch),
                    reason,
                    detail: "the fake P will not deliver".into(),
                };
                self.say(i, instance, peer, Message::Fail(fail));
            }
            Action::Ack { rank, request, other_epoch, wrote } => {
                let i = self.rank(rank);
                let (Some(r), Some((instance, _, peer))) =
                    (self.request(request), self.ranks[i].connection())
                else {
                    return;
                };
                let request = &self.requests[r];
                let ack = CancelAck {
                    transfer_key: request.id.clone(),
                    request_id: request.id.clone(),
                    epoch: request.epoch + u64::from(other_epoch),
                    wrote,
                    delivered: false,
                };
                self.say(i, instance, peer, Message::CancelAck(ack));
            }
            Action::Error { rank } => {
                let i = self.rank(rank);
                if let Some((instance, _, peer)) = self.ranks[i].connection() {
                    let error =
                        ErrorReply { code: "invalid".into(), detail: "the fake P refuses".into() };
                    self.say(i, instance, peer, Message::Error(error));
                }
            }
            Action::Noise { rank, ref bytes } => {
                let i = self.rank(rank);
                if let Some((_, now)) = &mut self.ranks[i].now {
                    let _ = now.agent.send_notification(&self.d_agent, bytes);
                }
            }
            Action::Disconnect { rank } => {
                let i = self.rank(rank);
                if let Some((_, now)) = &self.ranks[i].now {
                    let peers =
                        now.ear.connections.lock().unwrap_or_else(PoisonError::into_inner).clone();
                    for peer in peers {
                        now.channel.disconnect(peer);
                    }
                }
            }
            Action::Stall { rank } => {
                if let Some((_, now)) = &self.ranks[self.rank(rank)].now {
                    *now.ear.stall.lock().unwrap_or_else(PoisonError::into_inner) = Some(STALL);
                }
            }
            Action::Close { rank } => self.close(self.rank(rank)),
            Action::Restart { rank } => self.restart(self.rank(rank)),
            Action::Answer { rank, answers } => {
                let i = self.rank(rank);
                self.ranks[i].answers = answers;
            }
            Action::Serve { rank, serves } => {
                let i = self.rank(rank);
                self.ranks[i].serves = serves;
            }
            Action::Wait { ms } => {
                let nap = Duration::from_millis(u64::from(ms % 32)).min(self.budget);
                self.budget -= nap;
                thread::sleep(nap);
            }
        }
    }

    fn expect(&mut self, legs: Legs, ttl: ExpectTtl) {
        let ranks: Vec<Option<usize>> = match legs {
            Legs::Whole => vec![Some(0)],
            Legs::Split { reversed: false } => vec![Some(1), Some(2)],
            Legs::Split { reversed: true } => vec![Some(2), Some(1)],
            Legs::Ranks(mask) => {
                let named: Vec<Option<usize>> =
                    (0..RANKS).filter(|i| mask & (1 << i) != 0).map(Some).collect();
                if named.is_empty() {
                    vec![Some(0), Some(1)]
                } else {
                    named
                }
            }
            Legs::Nowhere => vec![None],
        };
        let id = format!("rq-{}", self.requests.len());
        let sources = ranks
            .iter()
            .map(|leg| leg.map_or(self.nowhere, |i| self.ranks[i].address).to_string())
            .collect();
        let expectation = Expectation {
            request_id: id.clone(),
            transfer_id: None,
            sources,
            groups: (0..2).map(|g| BlockGroup { first_token: 0, block_ids: vec![g] }).collect(),
            num_tokens: u64::from(Shape::WHOLE.block_tokens),
            epoch: 1,
            ttl: match ttl {
                ExpectTtl::Long => Duration::from_secs(30),
                ExpectTtl::Short(ms) => Duration::from_millis(u64::from(ms % 200)),
            },
            share: None,
        };
        match self.d.expect(expectation) {
            Ok(()) => self.requests.push(Request {
                id,
                epoch: 1,
                legs: ranks,
                events: Vec::new(),
                held: false,
            }),
            Err(error) => self.violations.push(format!("D refused to expect {id}: {error}")),
        }
    }

    /// Waits (within the script's budget) until rank `i`'s endpoint heard request `r`'s
    /// REGISTER, as a P's WRITE would.
    fn hear(&mut self, i: usize, r: usize) {
        let Some((instance, _)) = &self.ranks[i].now else { return };
        let instance = *instance;
        let (id, epoch) = (&self.requests[r].id, self.requests[r].epoch);
        let start = Instant::now();
        loop {
            let heard = self
                .journal
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .registers
                .iter()
                .any(|(_, x, request, e)| *x == instance && request == id && *e == epoch);
            if heard || self.budget.is_zero() {
                return;
            }
            let nap = Duration::from_millis(1).min(self.budget);
            self.budget -= nap;
            thread::sleep(nap);
            if start.elapsed() > Duration::from_millis(100) {
                return;
            }
        }
    }

    /// Fake P `i` (or whoever the forgery says) sends D a DONE for `key` (transfer key, request
    /// id, epoch).
    fn send_done(&mut self, i: usize, key: &(String, String, u64), forgery: Forgery) {
        let (transfer_key, id, epoch) = key.clone();
        let sender = match forgery {
            Forgery::OtherRank(other) => usize::from(other) % RANKS,
            _ => i,
        };
        // The nonce of the REGISTER the sending instance heard: without one D counts no DONE.
        let heard = self.ranks[sender].now.as_ref().and_then(|(x, _)| {
            let journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
            journal.nonces.get(&(*x, id.clone(), epoch)).copied()
        });
        let mut done = Done {
            transfer_key,
            request_id: id.clone(),
            epoch,
            tp_rank: self.ranks[sender].tp_rank,
            tp_size: self.ranks[sender].tp_size,
            bytes: 64,
            runs: 1,
            nonce: heard.unwrap_or(0),
        };
        match forgery {
            Forgery::WrongKey => done.transfer_key = "rq-elsewhere".into(),
            Forgery::WrongRequest => done.request_id = "rq-elsewhere".into(),
            Forgery::WrongEpoch => done.epoch += 1,
            _ => {}
        }
        let now = unix_millis();
        let stamp = match forgery {
            Forgery::Future => now + FAR,
            Forgery::Stale => now.saturating_sub(FAR),
            _ => now,
        };
        // Valid for the sender's leg, if it is one of the request's.
        let valid = matches!(forgery, Forgery::Genuine | Forgery::OtherRank(_))
            && heard.is_some()
            && self.requests.iter().any(|r| r.id == id && r.epoch == epoch);
        let message = Message::Done(done);
        let seq;
        let instance;
        if matches!(forgery, Forgery::Stranger) {
            let frame = self.stranger_encoder.encode(&message, stamp);
            seq = self.clock.tick();
            instance = None;
            let _ = self.stranger.send_notification(&self.d_agent, &frame);
        } else {
            let Some((x, now)) = &mut self.ranks[sender].now else { return };
            let encoder = match forgery {
                Forgery::WrongSecret => &now.wrong,
                Forgery::Unsigned => &now.unsigned,
                _ => &now.right,
            };
            let frame = encoder.encode(&message, stamp);
            instance = Some(*x);
            seq = self.clock.tick();
            if now.agent.send_notification(&self.d_agent, &frame).is_err() {
                return;
            }
        }
        self.dones.push(DoneSent { seq, instance, request_id: id.clone(), valid });
        if let (true, Some(instance)) = (valid, instance) {
            self.releases.push(Release { seq, instance, request_id: id, epoch });
        }
    }

    /// Fake P `i`'s endpoint goes: its side channel closes (its address refuses) and its agent
    /// is dropped, so nothing of it can land any more.
    fn close(&mut self, i: usize) {
        let Some((instance, now)) = self.ranks[i].now.take() else { return };
        self.instances[instance].1 = Some((self.clock.tick(), Instant::now()));
        now.channel.close();
        drop(now);
    }

    fn check_health(&mut self, when: &str) {
        if let Err(reason) = self.d.health() {
            let line = format!("D is unhealthy {when}: {reason}");
            if !self.violations.contains(&line) {
                self.violations.push(line);
            }
        }
    }

    /// Whether `request` has its end: a final event, or a quarantine a P's FAIL made for good.
    fn ended(request: &Request) -> bool {
        request.events.iter().any(|(_, _, o)| !matches!(o, Outcome::Quarantined(_)))
            || (request.held && !request.events.is_empty())
    }

    fn finish(mut self, linger: bool) -> Report {
        if linger {
            let until = Instant::now() + LINGER;
            while Instant::now() < until {
                self.pump();
                thread::sleep(Duration::from_millis(2));
            }
        }
        for i in 0..RANKS {
            self.pump();
            self.close(i);
        }
        let deadline = Instant::now() + SETTLE;
        while !self.requests.iter().all(Self::ended) && Instant::now() < deadline {
            self.pump();
            thread::sleep(Duration::from_millis(2));
        }
        self.pump();
        self.check_health("at the end");
        for request in &self.requests {
            if !Self::ended(request) {
                self.violations.push(format!(
                    "request {} ({:?}) has no final event {SETTLE:?} after every P was gone: {:?}",
                    request.id, request.legs, request.events
                ));
            }
        }
        if let Err(stuck) = self.d.close() {
            self.violations.push(format!("D's endpoint did not close: {stuck}"));
        }
        self.check();
        let events = tally(self.requests.iter().flat_map(|r| r.events.iter().map(|(_, _, o)| o)));
        Report {
            summary: format!(
                "{} requests, {} P endpoints, {} DONEs, {} releases; events: {events}",
                self.requests.len(),
                self.instances.len(),
                self.dones.len(),
                self.releases.len()
            ),
            violations: self.violations,
            ..Report::default()
        }
    }

    // ---- the checks ------------------------------------------------------------------------

    fn check(&mut self) {
        for panic in panics().iter().skip(self.panics_before) {
            self.violations.push(format!("a thread panicked: {panic}"));
        }
        let registers =
            self.journal.lock().unwrap_or_else(PoisonError::into_inner).registers.clone();
        let mut violations = Vec::new();
        for request in &self.requests {
            let id = &request.id;
            let notices: Vec<u64> = request
                .events
                .iter()
                .filter(|(_, _, o)| matches!(o, Outcome::Quarantined(_)))
                .map(|(s, _, _)| *s)
                .collect();
            let finals: Vec<&(u64, Instant, Outcome)> = request
                .events
                .iter()
                .filter(|(_, _, o)| !matches!(o, Outcome::Quarantined(_)))
                .collect();
            if notices.len() > 1 {
                violations.push(format!(
                    "receive {id}: {} quarantined notices: {:?}",
                    notices.len(),
                    request.events
                ));
            }
            if finals.len() > 1 {
                violations.push(format!(
                    "receive {id}: {} final events: {:?}",
                    finals.len(),
                    request.events
                ));
            }
            if let (Some(&notice), Some((end, _, _))) = (notices.first(), finals.first()) {
                if notice > *end {
                    violations.push(format!(
                        "receive {id}: quarantined after its final event: {:?}",
                        request.events
                    ));
                }
            }
            let Some(&&(seen, seen_at, ref outcome)) = finals.first() else { continue };
            match outcome {
                Outcome::Done => {
                    for leg in &request.legs {
                        let delivered = leg.is_some_and(|rank| {
                            self.dones.iter().any(|d| {
                                d.valid
                                    && d.request_id == *id
                                    && d.seq < seen
                                    && d.instance.is_some_and(|x| self.instances[x].0 == rank)
                            })
                        });
                        if !delivered {
                            violations.push(format!(
                                "receive {id} reported done without a valid DONE from its leg \
                                 {leg:?} (legs {:?})",
                                request.legs
                            ));
                        }
                    }
                }
                Outcome::Failed(_) | Outcome::Cancelled(_) => {
                    for &(_, instance, ref request_id, epoch) in &registers {
                        if request_id != id || epoch != request.epoch {
                            continue;
                        }
                        // Gone counts once its accepted bytes stopped landing: D learns it only
                        // after the close, and must then wait out the P's delivery bound.
                        let (rank, closed) = self.instances[instance];
                        let bound = if self.ranks[rank].bounded { BOUND } else { HORIZON };
                        let gone =
                            closed.is_some_and(|(tick, at)| tick < seen && seen_at >= at + bound);
                        let released = self.releases.iter().any(|r| {
                            r.instance == instance
                                && r.request_id == *id
                                && r.epoch == epoch
                                && r.seq < seen
                        });
                        if !gone && !released {
                            violations.push(format!(
                                "receive {id} reported {outcome:?} while P{} (endpoint {instance}), \
                                 which heard its REGISTER, could still write: it had neither \
                                 delivered, failed, acknowledged a cancel nor gone (its delivery \
                                 bound passed since)",
                                self.instances[instance].0
                            ));
                        }
                    }
                }
                Outcome::Quarantined(_) => {}
            }
        }
        self.violations.extend(violations);
    }
}

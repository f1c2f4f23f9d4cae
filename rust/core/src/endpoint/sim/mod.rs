//! A deterministic simulation of a P and D endpoint pair: the real endpoint code (the writer's
//! send and receive paths, `Control`, the rendezvous table, `awaited`) driven a turn at a time on
//! one thread, over a virtual clock, a simulated side channel (`net`) and a simulated data
//! path (`fabric`), through schedules of stalls, pauses, partitions, slow readers, stuck and
//! failing WRITEs, killed and restarted Ps and reset connections, each drawn from a seed.
//!
//! Every schedule is checked against the fence's properties:
//!
//! - **the canary**: no byte lands in D's memory in blocks D has handed back (D's engine hands
//!   a request's blocks back, and may give them to another request, at its final event), and
//!   no byte is read from P's blocks after P's engine was told it could free them;
//! - each request ends in at most one final event per side, after at most one quarantine
//!   notice, and a request reported done has all its bytes;
//! - **liveness**: once every fault healed (P alive, or killed for good: its address then
//!   refuses), every request reaches its final event within [`LIVENESS_BOUND`] of virtual time.
//!
//! A schedule is a [`Plan`]: both engines' requests and the faults, with when each strikes.
//! The simulation is a loop of rounds: each round runs, in a random order (some skipped), a turn
//! of each simulated thread that may run (P's and D's writer, side-channel threads and engine,
//! D's connector), then moves the clock on by a random step. Faults start and heal at their
//! times; at `heal_at` everything heals, and the schedule runs until every request ended. Turn
//! order, skips, steps and delays all come from the seed, and the endpoint code iterates its
//! state in a fixed order, so a seed replays its schedule exactly; a violation prints the seed,
//! the plan and the end of the trace.
//!
//! # What it found
//!
//! Two ways in which bytes landed in blocks D had handed back, both fixed (`tests` keeps a seed
//! of each, which fails without its fix):
//!
//! - Over TCP, a WRITE that fails may leave bytes on their way, and P's FAIL (or its answer to
//!   D's renewed cancel, on the connection D asked again on) may reach D before them: D now
//!   hands the blocks back only once P's delivery bound passed after P's word, and acts on
//!   P's word only after draining its own transport of what had already reached it.
//! - A REGISTER held up on a connection D then lost reached P's table after D had asked again
//!   on a new connection and P had answered that it held nothing: P now drops a registration
//!   from a connection its D has since replaced.
//!
//! It also found one bug of its own model (a WRITE sent after TCP had given up on a partition
//! waited out that partition's backoff, landing past the delivery bound the model promises);
//! `tests` keeps that seed too.
//!
//! Modelling what NIXL does rather than what it might: a WRITE over TCP is done once its bytes
//! landed (NIXL flushes the endpoint after the data), and D's `take_notifications` unpacks
//! everything that arrived (NIXL's `getNotifs` progresses UCX until nothing is left to do).
//!
//! Layer-wise push ([`Model::layerwise`]): P's engine hands some requests' layers over while it
//! computes them (WRITEs that notify nobody), then offers the KV, or aborts the request
//! mid-stream. What it found there, all fixed (`tests` keeps a seed of each):
//!
//! - A ready that found D's cancel deferred during the stream was refused at once, so P's engine
//!   freed the blocks the stream's WRITE was still reading: P's KV is now held until the stream
//!   ends, and its send then ends cancelled.
//! - P's abort mid-stream, answered `InFlight` (a layer's WRITE in flight), was never followed by
//!   the send's event, and D was not told: P's engine held the blocks for good, and D waited for
//!   the KV until its TTL. Once the stream's WRITEs are done, D now gets a FAIL and P the event;
//!   also where D had cancelled first (the table records P's abort apart from D's cancel).
//! - A stuck layer's WRITE and then the request's own stuck WRITE each gave the request a
//!   quarantine notice: one per request now (every quarantined WRITE is still counted).
//! - P's KV refused by an unhealthy endpoint (its writer stalled), whose blocks P's engine then
//!   freed, while a layer of it waited in the writer's inbox: once the writer ran again, it
//!   streamed that layer from the freed blocks. A refused KV now ends the transfer as an abort
//!   does (its layers find the key fenced; `a_kv_refused_while_its_layer_waits_in_the_writer_s_
//!   inbox_is_never_read` in `tests/endpoint.rs`, found by a long run, seed 642443334264 as
//!   drawn before mid-stream aborts).
//!
//! What it does not model: interleavings inside one turn (a writer turn runs whole while the
//! handlers wait; the rendezvous table's own concurrency is loom's to check); several P or D
//! ranks (tensor-parallel fan-in and fan-out), re-registrations (epochs above 1) and D's
//! process dying; a host whose firewall refuses connections while P lives; the residual the
//! docs name (bytes P's host kernel accepted before its whole machine paused, landing after D
//! found P gone: a paused P's host here still delivers what it had sent); the side channel's
//! bytes (messages travel whole and unsigned; DONEs are signed and checked), its send queue's
//! limits, and RSTs for frames sent to a closed socket (a close sends a FIN, which a partition
//! holds like any frame); a `cma` data path is never partitioned (it stays on one host).

mod fabric;
mod net;
mod plan;
mod rng;
#[cfg(test)]
mod tests;
mod time;
mod world;

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use plan::{Fault, FaultKind, Model, PauseClocks, Plan, Progress, RequestPlan, Side};
pub use world::Ending;

use crate::clock::{BootInstant, Clock};
use crate::layout::{KvLayout, Region, TokenOrder};
use crate::protocol::{BlockGroup, Hello};
use crate::rendezvous::TableConfig;
use crate::side_channel::PeerId;
use crate::sync::lock;

use super::control::Control;
use super::link::Link;
use super::writer::Writer;
use super::{AbortOutcome, Endpoint, EndpointConfig, Expectation, Outcome, ReadyKv};

use fabric::{Fabric, SimAgent, BLOCK_BYTES, REGIONS};
use net::{Net, NetSettings, SimLink};
use rng::Rng;
use time::{HostClock, Truth};
use world::{DState, PState, World, POOL};

/// Once everything healed, every request must have ended within this much virtual time.
pub const LIVENESS_BOUND: Duration = Duration::from_secs(120);

/// Both endpoints sign their frames and DONEs with it.
const SECRET: &[u8] = b"kvpush-simulation-shared-secret!";
const HEARTBEAT: Duration = Duration::from_millis(250);
const PEER_TIMEOUT: Duration = Duration::from_millis(1_000);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1_000);
/// Over `tcp`: how long P's bytes may take to land once they left it (its advertised bound).
const TCP_DELIVERY_BOUND: Duration = Duration::from_millis(1_000);
const TOKENS_PER_BLOCK: u64 = 4;
/// Trace lines a report keeps (the last ones).
const TRACE_LINES: usize = 300;

/// A simulated process (P's current incarnation, or D).
struct Proc {
    clock: Arc<HostClock>,
    alive: bool,
    /// P: 1 for the first process, one more for each restart.
    incarnation: u32,
    endpoint: Option<Arc<Endpoint>>,
    control: Option<Arc<Control>>,
    hello: Option<Hello>,
    addr: SocketAddr,
    /// When its side channel started, on its boot-time clock.
    channel_origin: BootInstant,
    next_peer: PeerId,
    /// Active faults: the whole process stopped; its writer stuck; its connection threads
    /// stuck (counted: they may overlap).
    paused: u32,
    stalled: u32,
    slow_reader: u32,
    /// A pause that stops its clocks is in progress.
    clock_stopped: bool,
}

/// Everything the simulated processes share, behind one lock: the clock, the network, the data
/// path and the engines. The simulation never holds it across a writer's turn (the writer's
/// link and transport take it).
struct Lab {
    truth: Arc<Truth>,
    /// Delays and other draws made by the network and the data path.
    rng: Rng,
    latency: (Duration, Duration),
    procs: [Proc; 2],
    net: Net,
    fabric: Fabric,
    world: World,
    trace: VecDeque<String>,
    /// FNV-1a over every trace line: two runs of a seed agree on it.
    digest: u64,
}

impl Lab {
    fn now(&self) -> Duration {
        self.truth.get()
    }

    /// A frame's (or WRITE chunk's) delay between the hosts.
    fn latency(&mut self) -> Duration {
        let (lo, hi) = self.latency;
        let spread = u64::try_from((hi - lo).as_nanos()).unwrap_or(0);
        lo + Duration::from_nanos(self.rng.below(spread))
    }

    fn log(&mut self, line: String) {
        let line = format!("[{:>10.4}s] {line}", self.now().as_secs_f64());
        for byte in line.bytes() {
            self.digest = (self.digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3);
        }
        if self.trace.len() == TRACE_LINES {
            self.trace.pop_front();
        }
        self.trace.push_back(line);
    }

    /// Takes both endpoints' events, as their engines would, and checks each.
    fn drain_events(&mut self) {
        for side in [Side::P, Side::D] {
            let proc = &self.procs[side.index()];
            let Some(endpoint) = proc.endpoint.clone() else { continue };
            let incarnation = proc.incarnation;
            for event in endpoint.poll() {
                let kind = match &event.outcome {
                    Outcome::Done => "done",
                    Outcome::Failed(_) => "failed",
                    Outcome::Cancelled(_) => "cancelled",
                    Outcome::Quarantined(_) => "quarantined",
                };
                let cause = event.outcome.cause().map_or_else(String::new, |cause| {
                    format!(" ({}): {}", cause.reason.code(), cause.detail)
                });
                self.log(format!("{side:?} event: {} {kind}{cause}", event.request_id));
                let now = self.now();
                self.world.on_event(now, side, incarnation, &event);
            }
        }
    }

    /// A turn of `side`'s engine: the requests whose time came are expected (D) or readied
    /// (P), cancelled (D) or aborted (P).
    fn engine_turn(&mut self, side: Side, plan: &Plan) {
        self.drain_events();
        let Some(endpoint) = self.procs[side.index()].endpoint.clone() else { return };
        let now = self.now();
        for (i, r) in plan.requests.iter().enumerate() {
            match side {
                Side::D => self.d_engine(&endpoint, now, i, r),
                Side::P => self.p_engine(&endpoint, now, i, r),
            }
        }
    }

    fn d_engine(&mut self, endpoint: &Endpoint, now: Duration, i: usize, r: &RequestPlan) {
        match &mut self.world.d[i] {
            DState::Waiting if now >= r.expect_at => {
                let count = r.tokens.div_ceil(TOKENS_PER_BLOCK) as usize;
                let rng = &mut self.rng;
                let Some(blocks) =
                    self.world.allocate(Side::D, 0, i, count, |n| rng.below(n as u64) as usize)
                else {
                    return;
                };
                let expectation = Expectation {
                    request_id: r.id.clone(),
                    transfer_id: None,
                    sources: vec![self.procs[Side::P.index()].addr.to_string()],
                    groups: vec![BlockGroup { first_token: 0, block_ids: blocks.clone() }],
                    num_tokens: r.tokens,
                    epoch: 1,
                    ttl: r.receive_ttl,
                    share: None,
                };
                match endpoint.expect(expectation) {
                    Ok(()) => {
                        self.log(format!("D expects {} into blocks {blocks:?}", r.id));
                        self.world.d[i] =
                            DState::Awaiting { blocks, cancel_sent: false, notice: false };
                    }
                    Err(error) => {
                        self.log(format!("D's expect of {} refused: {error}", r.id));
                        self.world.release(Side::D, 0, &blocks);
                        self.world.d[i] = DState::Ended(Ending::Refused);
                    }
                }
            }
            DState::Awaiting { cancel_sent, .. }
                if !*cancel_sent && r.cancel_at.is_some_and(|at| now >= at) =>
            {
                *cancel_sent = true;
                let _ = endpoint.cancel(&r.id);
                self.log(format!("D cancels {}", r.id));
            }
            _ => {}
        }
    }

    fn p_engine(&mut self, endpoint: &Endpoint, now: Duration, i: usize, r: &RequestPlan) {
        let incarnation = self.procs[Side::P.index()].incarnation;
        let kv = |blocks: &[u32]| ReadyKv {
            request_id: r.id.clone(),
            transfer_id: None,
            groups: vec![BlockGroup { first_token: 0, block_ids: blocks.to_vec() }],
            num_tokens: r.tokens,
            ttl: r.ready_ttl,
        };
        match &mut self.world.p[i] {
            PState::Waiting if now >= r.ready_at || r.stream_from.is_some_and(|at| now >= at) => {
                let count = r.tokens.div_ceil(TOKENS_PER_BLOCK) as usize;
                let rng = &mut self.rng;
                let Some(blocks) = self
                    .world
                    .allocate(Side::P, incarnation, i, count, |n| rng.below(n as u64) as usize)
                else {
                    return;
                };
                self.log(format!(
                    "P (p{incarnation}) computes {} into blocks {blocks:?}{}",
                    r.id,
                    if r.stream_from.is_some() { ", streaming its layers" } else { "" }
                ));
                self.world.p[i] = PState::Readied {
                    incarnation,
                    blocks,
                    offered: false,
                    streamed: 0,
                    abort_sent: false,
                    notice: false,
                };
                self.p_engine(endpoint, now, i, r);
            }
            // Aborted once offered, or mid-stream.
            PState::Readied { abort_sent, offered, .. }
                if !*abort_sent
                    && (*offered || r.stream_from.is_some())
                    && r.abort_at.is_some_and(|at| now >= at) =>
            {
                *abort_sent = true;
                let offered = *offered;
                let outcome = endpoint.abort(&r.id, None);
                self.log(format!("P aborts {}: {outcome:?}", r.id));
                // Mid-stream, `Unknown` is a stream that never started or ended: nothing of it
                // is in flight. `InFlight`: the blocks wait for the send's event.
                let unknown = !offered && matches!(outcome, Ok(AbortOutcome::Unknown));
                if unknown || matches!(outcome, Ok(AbortOutcome::Released)) {
                    if let PState::Readied { blocks, .. } = &self.world.p[i] {
                        let blocks = blocks.clone();
                        self.world.release(Side::P, incarnation, &blocks);
                    }
                    self.world.p[i] = PState::Ended(Ending::Released);
                }
            }
            PState::Readied { offered: false, abort_sent: false, blocks, .. }
                if now >= r.ready_at =>
            {
                let blocks = blocks.clone();
                match endpoint.ready(kv(&blocks)) {
                    Ok(()) => {
                        self.log(format!("P (p{incarnation}) ready {}", r.id));
                        if let PState::Readied { offered, .. } = &mut self.world.p[i] {
                            *offered = true;
                        }
                    }
                    Err(error) => {
                        self.log(format!("P's ready of {} refused: {error}", r.id));
                        self.world.release(Side::P, incarnation, &blocks);
                        self.world.p[i] = PState::Ended(Ending::Refused);
                    }
                }
            }
            // Layer-wise push: one more layer (region) final; the last goes with the KV.
            PState::Readied { offered: false, abort_sent: false, blocks, streamed, .. }
                if r.stream_from.is_some() && *streamed + 1 < REGIONS =>
            {
                let region = *streamed;
                *streamed += 1;
                let blocks = blocks.clone();
                let result =
                    endpoint.layers_ready(kv(&blocks), region as usize..region as usize + 1);
                self.log(format!("P streams region {region} of {}: {result:?}", r.id));
            }
            _ => {}
        }
    }
}

/// A simulated thread's turn.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Net(Side),
    Writer(Side),
    Engine(Side),
    Connector,
}

#[derive(Debug, Default, Clone, Copy)]
struct FaultRun {
    started: bool,
    ended: bool,
    /// A pause that stopped the host's clocks, from then.
    clock_from: Option<Duration>,
    /// A kill that killed P (it was alive).
    killed: bool,
}

/// One schedule being run.
struct Sim {
    plan: Plan,
    truth: Arc<Truth>,
    clocks: [Arc<HostClock>; 2],
    lab: Arc<Mutex<Lab>>,
    writers: [Option<Writer<SimAgent>>; 2],
    /// Turn order, skips and steps (the network and data path draw from the lab's own).
    rng: Rng,
    faults: Vec<FaultRun>,
    healed: bool,
    rounds: u64,
}

/// What one schedule came to.
#[derive(Debug)]
pub struct Report {
    /// The schedule.
    pub plan: Plan,
    /// What went wrong; empty when the schedule kept every property.
    pub violations: Vec<String>,
    /// The last lines of the schedule's trace.
    pub trace: Vec<String>,
    /// Over every trace line: two runs of one seed give the same.
    pub digest: u64,
    /// Virtual time from healing to the last request's end (none if it never came).
    pub settled: Option<Duration>,
    /// Virtual time the schedule ran.
    pub virtual_time: Duration,
    /// How the requests ended, on P and on D.
    pub endings: [BTreeMap<Ending, u64>; 2],
    /// Quarantine notices, on P and on D.
    pub notices: [u64; 2],
    /// Rounds run.
    pub rounds: u64,
}

impl Report {
    /// Whether the schedule kept every property.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// What kind of violation the schedule found (its first, with the numbers taken out), and
    /// under which data path: schedules with the same one most likely found the same bug.
    pub fn signature(&self) -> String {
        let first = self.violations.first().map_or("", String::as_str);
        let text = first.split_once("VIOLATION: ").map_or(first, |(_, text)| text);
        let text = text.split(';').next().unwrap_or(text);
        let words: String = text.chars().filter(|c| !c.is_ascii_digit()).collect();
        format!("{words} [{:?}]", self.plan.progress)
    }

    /// How the schedule ended, in a word.
    pub fn outcome(&self) -> &'static str {
        let d = &self.endings[Side::D.index()];
        let requests = self.plan.requests.len() as u64;
        if !self.passed() {
            "violated"
        } else if self.notices.iter().sum::<u64>() > 0 {
            "quarantined, then settled"
        } else if d.get(&Ending::Done).copied().unwrap_or(0) == requests {
            "every request done"
        } else {
            "settled with failures or cancels"
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedule {} ({}):", self.plan.seed, self.outcome())?;
        write!(f, "{}", self.plan)?;
        for violation in &self.violations {
            writeln!(f, "{violation}")?;
        }
        writeln!(f, "trace (last {} lines):", self.trace.len())?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        write!(
            f,
            "replay: KVPUSH_SIM_SEED={} cargo run --release -p kvpush-core --features sim \
             --example sim",
            self.plan.seed
        )
    }
}

/// Runs the schedule of `seed` under `model`; see the module docs.
pub fn run(seed: u64, model: Model) -> Report {
    Sim::new(Plan::generate(seed, model)).run()
}

fn layout(side: Side, incarnation: u32) -> KvLayout {
    KvLayout {
        regions: (0..REGIONS)
            .map(|region| Region {
                base: fabric::region_base(side, incarnation, region),
                block_stride: BLOCK_BYTES,
                num_blocks: POOL,
                group: 0,
            })
            .collect(),
        block_tokens: TOKENS_PER_BLOCK as u32,
        kernel_block_tokens: TOKENS_PER_BLOCK as u32,
        heads: 1,
        head_bytes: (BLOCK_BYTES / TOKENS_PER_BLOCK) as u32,
        token_order: TokenOrder::Nhd,
        tp_rank: 0,
        tp_size: 1,
    }
}

impl Sim {
    fn new(plan: Plan) -> Self {
        let truth = Arc::new(Truth::default());
        let base = Instant::now();
        let clocks = [
            Arc::new(HostClock::new(Arc::clone(&truth), base)),
            Arc::new(HostClock::new(Arc::clone(&truth), base)),
        ];
        let boot_base = clocks[0].boot_now();
        let proc = |clock: &Arc<HostClock>, addr: [u8; 4]| Proc {
            clock: Arc::clone(clock),
            alive: false,
            incarnation: 0,
            endpoint: None,
            control: None,
            hello: None,
            addr: SocketAddr::from((addr, 7_000)),
            channel_origin: boot_base,
            next_peer: 1,
            paused: 0,
            stalled: 0,
            slow_reader: 0,
            clock_stopped: false,
        };
        let delivery_bound = match plan.progress {
            Progress::Cma => Duration::ZERO,
            Progress::Tcp { .. } => TCP_DELIVERY_BOUND,
        };
        let secret = crate::protocol::Secret::from_bytes(SECRET).ok();
        let ids: Vec<String> = plan.requests.iter().map(|r| r.id.clone()).collect();
        let lab = Lab {
            truth: Arc::clone(&truth),
            rng: Rng::new(plan.seed ^ 0x5eed_1ab5),
            latency: plan.latency,
            procs: [proc(&clocks[0], [10, 0, 0, 1]), proc(&clocks[1], [10, 0, 0, 2])],
            net: Net::new(NetSettings {
                heartbeat: HEARTBEAT,
                peer_timeout: PEER_TIMEOUT,
                connect_timeout: CONNECT_TIMEOUT,
            }),
            fabric: Fabric::new(plan.progress, delivery_bound, secret),
            world: World::new(&ids),
            trace: VecDeque::new(),
            digest: 0xcbf2_9ce4_8422_2325,
        };
        let mut sim = Self {
            faults: vec![FaultRun::default(); plan.faults.len()],
            rng: Rng::new(plan.seed),
            plan,
            truth,
            clocks,
            lab: Arc::new(Mutex::new(lab)),
            writers: [None, None],
            healed: false,
            rounds: 0,
        };
        sim.start(Side::D);
        sim.start(Side::P);
        sim
    }

    /// Starts `side`'s process (P's next incarnation).
    fn start(&mut self, side: Side) {
        let s = side.index();
        let (incarnation, addr) = {
            let lab = lock(&self.lab);
            (lab.procs[s].incarnation + 1, lab.procs[s].addr)
        };
        let name = match side {
            Side::P => format!("p{incarnation}"),
            Side::D => format!("d{incarnation}"),
        };
        let mut config = EndpointConfig::new(name.clone(), layout(side, incarnation));
        config.bind = addr;
        config.secret = Some(SECRET.to_vec());
        config.heartbeat_interval = HEARTBEAT;
        config.peer_timeout = PEER_TIMEOUT;
        config.connect_timeout = CONNECT_TIMEOUT;
        config.write_timeout = self.plan.write_timeout;
        config.delivery_bound = match self.plan.progress {
            Progress::Cma => Duration::ZERO,
            Progress::Tcp { .. } => TCP_DELIVERY_BOUND,
        };
        // One shard: the table's order of expiries is then the same from run to run.
        config.table = TableConfig { shards: 1, ..TableConfig::default() };
        let agent = SimAgent::new(Arc::clone(&self.lab), name, side, incarnation);
        let clock: Arc<dyn Clock> = Arc::clone(&self.clocks[s]) as Arc<dyn Clock>;
        let link_lab = Arc::clone(&self.lab);
        let mut hello_seen = None;
        let parts =
            Endpoint::assemble(&config, agent, clock, |hello, _control, _shared, _secret| {
                hello_seen = Some(hello);
                let link = SimLink { lab: link_lab, side, incarnation, addr };
                Ok(Arc::new(link) as Arc<dyn Link>)
            })
            .expect("a simulated endpoint assembles");
        let mut lab = lock(&self.lab);
        let proc = &mut lab.procs[s];
        proc.alive = true;
        proc.incarnation = incarnation;
        proc.endpoint = Some(Arc::new(parts.endpoint));
        proc.control = Some(parts.control);
        proc.hello = hello_seen;
        proc.channel_origin = self.clocks[s].boot_now();
        if side == Side::P {
            lab.net.listening = true;
        }
        lab.log(format!("{side:?} starts (incarnation {incarnation})"));
        drop(lab);
        self.writers[s] = Some(parts.writer);
    }

    /// Kills P's process: everything it held goes, except what its host already sent.
    fn kill_p(&mut self) {
        let writer = self.writers[Side::P.index()].take();
        let endpoint = {
            let mut lab = lock(&self.lab);
            lab.drain_events();
            let incarnation = lab.procs[Side::P.index()].incarnation;
            lab.p_connections_killed();
            lab.p_transport_killed(incarnation);
            lab.world.p_killed(incarnation);
            let proc = &mut lab.procs[Side::P.index()];
            proc.alive = false;
            proc.control = None;
            let endpoint = proc.endpoint.take();
            lab.log(format!("P (p{incarnation}) is killed"));
            endpoint
        };
        drop(writer);
        drop(endpoint);
    }

    fn run(mut self) -> Report {
        let mut settled = None;
        loop {
            let now = self.truth.get();
            if !self.healed && now >= self.plan.heal_at {
                self.healed = true;
                lock(&self.lab).log("everything heals".to_owned());
            }
            self.apply_faults(now);
            {
                let mut lab = lock(&self.lab);
                lab.drain_events();
                if !lab.world.violations.is_empty() {
                    break;
                }
                if !lab.procs[Side::P.index()].alive {
                    skip_dead_p(&mut lab, &self.plan, now);
                }
                if self.healed {
                    if lab.world.all_ended() {
                        settled = Some(now - self.plan.heal_at);
                        break;
                    }
                    if now > self.plan.heal_at + LIVENESS_BOUND {
                        let open = lab.world.open();
                        let line = format!(
                            "[{:>10.4}s] VIOLATION: liveness: {LIVENESS_BOUND:?} after healing, \
                             requests have not ended: {}",
                            now.as_secs_f64(),
                            open.join("; ")
                        );
                        lab.world.violations.push(line);
                        break;
                    }
                }
            }
            self.round();
            let step = match self.rng.weighted(&[6, 3, 1]) {
                0 => self.rng.millis(0.05, 3.0),
                1 => self.rng.millis(3.0, 40.0),
                _ => self.rng.millis(40.0, 200.0),
            };
            self.truth.advance(step);
        }
        self.report(settled)
    }

    fn report(self, settled: Option<Duration>) -> Report {
        let lab = lock(&self.lab);
        let mut endings: [BTreeMap<Ending, u64>; 2] = [BTreeMap::new(), BTreeMap::new()];
        for state in &lab.world.p {
            if let PState::Ended(ending) = state {
                *endings[Side::P.index()].entry(*ending).or_default() += 1;
            }
        }
        for state in &lab.world.d {
            if let DState::Ended(ending) = state {
                *endings[Side::D.index()].entry(*ending).or_default() += 1;
            }
        }
        Report {
            plan: self.plan.clone(),
            violations: lab.world.violations.clone(),
            trace: lab.trace.iter().cloned().collect(),
            digest: lab.digest,
            settled,
            virtual_time: self.truth.get(),
            endings,
            notices: lab.world.notices,
            rounds: self.rounds,
        }
    }

    /// One round: a turn of each thread that may run, in a random order, some skipped.
    fn round(&mut self) {
        self.rounds += 1;
        let mut slots = [
            Slot::Net(Side::P),
            Slot::Net(Side::D),
            Slot::Writer(Side::P),
            Slot::Writer(Side::D),
            Slot::Engine(Side::P),
            Slot::Engine(Side::D),
            Slot::Connector,
        ];
        self.rng.shuffle(&mut slots);
        for slot in slots {
            if self.rng.percent(self.plan.skip_percent) {
                continue;
            }
            for _ in 0..self.rng.between(1, 2) {
                self.turn(slot);
            }
        }
    }

    fn turn(&mut self, slot: Slot) {
        let side = match slot {
            Slot::Net(side) | Slot::Writer(side) | Slot::Engine(side) => side,
            Slot::Connector => Side::D,
        };
        let s = side.index();
        let mut lab = lock(&self.lab);
        let proc = &lab.procs[s];
        if !proc.alive || proc.paused > 0 {
            return;
        }
        match slot {
            Slot::Net(side) => lab.net_turn(side),
            Slot::Engine(side) => lab.engine_turn(side, &self.plan),
            Slot::Connector => lab.connector_turn(),
            Slot::Writer(_) => {
                if proc.stalled > 0 {
                    return;
                }
                drop(lab);
                if let Some(writer) = self.writers[s].as_mut() {
                    writer.beat();
                    let stop = writer.step(None);
                    debug_assert!(!stop, "nothing stops a simulated writer");
                }
                lock(&self.lab).drain_events();
            }
        }
    }

    fn apply_faults(&mut self, now: Duration) {
        for i in 0..self.plan.faults.len() {
            let fault = self.plan.faults[i];
            if !self.faults[i].started && !self.healed && now >= fault.at {
                self.faults[i].started = true;
                self.start_fault(i, now);
            }
            let over = self.healed || now >= fault.at + fault.lasts;
            if self.faults[i].started && !self.faults[i].ended && over {
                self.faults[i].ended = true;
                self.end_fault(i, now);
            }
        }
    }

    fn start_fault(&mut self, i: usize, now: Duration) {
        let kind = self.plan.faults[i].kind;
        if let FaultKind::KillP { .. } = kind {
            if lock(&self.lab).procs[Side::P.index()].alive {
                self.faults[i].killed = true;
                self.kill_p();
            }
            return;
        }
        let mut lab = lock(&self.lab);
        lab.log(format!("fault starts: {kind:?}"));
        match kind {
            FaultKind::Pause { side, clocks } => {
                let proc = &mut lab.procs[side.index()];
                proc.paused += 1;
                if clocks != PauseClocks::Run && !proc.clock_stopped {
                    proc.clock_stopped = true;
                    self.faults[i].clock_from = Some(now);
                }
            }
            FaultKind::StallWriter { side } => lab.procs[side.index()].stalled += 1,
            FaultKind::Partition { from_p, from_d } => {
                if from_p {
                    lab.cut(Side::P, true);
                }
                if from_d {
                    lab.cut(Side::D, true);
                }
            }
            FaultKind::SlowReader { side } => lab.procs[side.index()].slow_reader += 1,
            FaultKind::StuckWrites => lab.fabric.stuck += 1,
            FaultKind::FailingWrites => lab.fabric.failing += 1,
            FaultKind::SlowNotifications => lab.fabric.slow_notifications += 1,
            FaultKind::ResetConnections => lab.reset_connections(),
            FaultKind::KillP { .. } => {}
        }
    }

    fn end_fault(&mut self, i: usize, now: Duration) {
        let kind = self.plan.faults[i].kind;
        if let FaultKind::KillP { restart: true } = kind {
            let dead = !lock(&self.lab).procs[Side::P.index()].alive;
            if self.faults[i].killed && dead {
                self.start(Side::P);
            }
            return;
        }
        let mut lab = lock(&self.lab);
        lab.log(format!("fault heals: {kind:?}"));
        match kind {
            FaultKind::Pause { side, clocks } => {
                let proc = &mut lab.procs[side.index()];
                proc.paused -= 1;
                if let Some(from) = self.faults[i].clock_from {
                    proc.clock_stopped = false;
                    proc.clock.lose(now - from, clocks == PauseClocks::BothStop);
                }
            }
            FaultKind::StallWriter { side } => lab.procs[side.index()].stalled -= 1,
            FaultKind::Partition { from_p, from_d } => {
                if from_p {
                    lab.cut(Side::P, false);
                }
                if from_d {
                    lab.cut(Side::D, false);
                }
            }
            FaultKind::SlowReader { side } => lab.procs[side.index()].slow_reader -= 1,
            FaultKind::StuckWrites => lab.fabric.stuck -= 1,
            FaultKind::FailingWrites => lab.fabric.failing -= 1,
            FaultKind::SlowNotifications => lab.fabric.slow_notifications -= 1,
            FaultKind::ResetConnections | FaultKind::KillP { .. } => {}
        }
    }
}

impl Drop for Sim {
    /// Breaks the cycle between the lab and the endpoints it holds (whose links hold the lab),
    /// so that a schedule's memory goes with it.
    fn drop(&mut self) {
        let endpoints: Vec<Arc<Endpoint>> = {
            let mut lab = lock(&self.lab);
            lab.procs
                .iter_mut()
                .filter_map(|proc| {
                    proc.control = None;
                    proc.endpoint.take()
                })
                .collect()
        };
        drop(endpoints);
    }
}

/// A dead P computes nothing: its requests whose KV would have been ready by now never are.
fn skip_dead_p(lab: &mut Lab, plan: &Plan, now: Duration) {
    for (i, r) in plan.requests.iter().enumerate() {
        if matches!(lab.world.p[i], PState::Waiting) && now >= r.ready_at {
            lab.world.p[i] = PState::Ended(Ending::Skipped);
        }
    }
}

/// What a run of many schedules came to.
#[derive(Debug, Default)]
pub struct Summary {
    /// Schedules run.
    pub schedules: u64,
    /// Schedules by outcome ([`Report::outcome`]).
    pub outcomes: BTreeMap<&'static str, u64>,
    /// The schedules that violated a property: the first report of each kind of violation
    /// (see [`Report::signature`]), and how many schedules had it.
    pub failures: Vec<(Report, u64)>,
    /// Requests by how they ended, on P and on D.
    pub endings: [BTreeMap<Ending, u64>; 2],
    /// Quarantine notices, on P and on D.
    pub notices: [u64; 2],
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// The longest time from healing to a schedule's last request's end.
    pub longest_settle: Duration,
    /// Virtual time simulated, and wall-clock time taken.
    pub virtual_time: Duration,
    /// See `virtual_time`.
    pub wall_time: Duration,
}

impl Summary {
    /// Adds one schedule's report.
    pub fn add(&mut self, report: Report) {
        self.schedules += 1;
        *self.outcomes.entry(report.outcome()).or_default() += 1;
        for side in 0..2 {
            for (ending, count) in &report.endings[side] {
                *self.endings[side].entry(*ending).or_default() += count;
            }
            self.notices[side] += report.notices[side];
        }
        for fault in &report.plan.faults {
            let kind = format!("{:?}", fault.kind);
            let kind = kind.split([' ', '{']).next().unwrap_or_default().to_owned();
            *self.faults.entry(kind).or_default() += 1;
        }
        self.longest_settle = self.longest_settle.max(report.settled.unwrap_or_default());
        self.virtual_time += report.virtual_time;
        if !report.passed() {
            let signature = report.signature();
            match self.failures.iter_mut().find(|(first, _)| first.signature() == signature) {
                Some((_, count)) => *count += 1,
                None => self.failures.push((report, 1)),
            }
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation: {} schedules ({} violated) in {:.1}s ({:.0}s of virtual time)",
            self.schedules,
            self.failures.iter().map(|(_, count)| count).sum::<u64>(),
            self.wall_time.as_secs_f64(),
            self.virtual_time.as_secs_f64()
        )?;
        for (outcome, count) in &self.outcomes {
            writeln!(f, "  {count:>7} {outcome}")?;
        }
        writeln!(
            f,
            "  requests on D: {:?}; quarantine notices {}",
            self.endings[1], self.notices[1]
        )?;
        writeln!(
            f,
            "  requests on P: {:?}; quarantine notices {}",
            self.endings[0], self.notices[0]
        )?;
        writeln!(f, "  faults: {:?}", self.faults)?;
        write!(f, "  longest settle after healing: {:.1}s", self.longest_settle.as_secs_f64())?;
        for (report, count) in &self.failures {
            write!(
                f,
                "\n  {count:>7} x {} (first: seed {})",
                report.signature(),
                report.plan.seed
            )?;
        }
        Ok(())
    }
}

/// Runs schedules under `model` from seed `first` on: `count` of them, or as many as fit in
/// `budget` of wall time (whichever ends first; at least one).
pub fn run_schedules(
    model: Model,
    first: u64,
    count: Option<u64>,
    budget: Option<Duration>,
) -> Summary {
    let started = Instant::now();
    let mut summary = Summary::default();
    for seed in first.. {
        if count.is_some_and(|count| summary.schedules >= count)
            || budget.is_some_and(|budget| summary.schedules > 0 && started.elapsed() >= budget)
        {
            break;
        }
        summary.add(run(seed, model));
    }
    summary.wall_time = started.elapsed();
    summary
}

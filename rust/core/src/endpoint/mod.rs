//! One worker's end of push transfers: the rendezvous table, the side channel and the writer
//! thread, behind the few calls an engine makes.
//!
//! A prefill worker (P) calls [`Endpoint::ready`] when a request's KV is computed; a decode
//! worker (D) calls [`Endpoint::expect`] once it has allocated the request's blocks, which
//! registers them with P over the side channel. Whichever half reaches P's table second makes the
//! match, on the thread that delivered it (the engine thread or the side channel's reader: neither
//! ever waits for the writer), and the match goes to the writer thread's inbox. The writer plans,
//! posts the WRITE whose notification is the DONE message, polls it, and reports the outcome.
//! Both sides drain outcomes with [`Endpoint::poll`], which never blocks.
//!
//! ```text
//!  engine thread ── ready ──► table ◄── REG ── side channel reader
//!                               │ match (second arrival)
//!                               ▼
//!  writer thread: inbox ─► plan ─► post WRITE(+DONE) ─► poll ─► events ─► Endpoint::poll
//! ```
//!
//! Every path ends in exactly one event per request: a transfer never just goes quiet. P-side
//! refusals, aborts and expiries send D a FAIL; D-side deadlines send P a CANCEL and D reports the
//! request only once P acknowledged it (or is gone), so D never frees blocks a write may still
//! land in.
//!
//! # Modules
//!
//! - `control`: the side channel's handler: D's registrations and cancels meet the table on the
//!   reader thread that received them.
//! - `halves`: the two halves the table pairs (D's registration, P's ready KV); `quota`: what
//!   one host's registrations may hold in the table, and each one's share of it.
//! - `command`: what the writer thread is asked to do, by the engine, the readers and the
//!   connector.
//! - `writer`: the writer thread's loop, which drives both paths below, and its end; `context`:
//!   what it lends both paths (the transport, the peers it knows, where messages and events go).
//! - `send`: P's send path: a match is planned, fenced by D's lease, posted, polled and
//!   finished, and reported as one `Send` event.
//! - `receive`: D's receive path: registration with each P rank, DONEs, FAILs, cancels and
//!   lost connections, reported as one `Receive` event; `connector` makes its connections.
//! - `inbox`: the writer's inbox, bounded by admission: new work is refused
//!   ([`EndpointError::Busy`]) rather than queued without bound behind a writer that is behind.
//! - `fanout` (P) and `awaited` (D): one request's state when P and D run different tensor
//!   parallel sizes (one P rank written into several D ranks; one D rank fed by several P ranks).
//! - `agents`: which agent a peer's agent name stands for (name and metadata digest), so that
//!   a second process reusing a name is refused instead of written into the first one's memory.
//! - `events`: what the endpoint reports.
//! - `link`: what the writer needs of the side channel; `sim` (tests, and the `sim` feature): a
//!   deterministic simulation of a P and D pair that drives all of the above on a virtual clock.

mod agents;
mod awaited;
mod command;
mod connector;
mod context;
mod control;
mod events;
mod fanout;
mod halves;
mod inbox;
mod link;
mod quota;
mod receive;
mod send;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
#[cfg(test)]
mod tests;
mod writer;

use std::net::SocketAddr;
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

pub use events::{Cause, Event, Outcome, Reason, Role, Timeline};

use crate::clock::{BootInstant, Clock, SystemClock};
use crate::key::TransferKey;
use crate::layout::KvLayout;
use crate::loopback::LoopbackTransport;
use crate::protocol::{BlockGroup, Hello, Limits, Secret, PROTOCOL_VERSION};
use crate::rendezvous::{
    Arrival, Cancelled, Epoch, FenceReason, RendezvousError, RendezvousTable, TableConfig,
};
use crate::side_channel::{SideChannel, SideChannelConfig};
use crate::sync::lock;
use crate::transport::{MemoryKind, MemorySpace, Transport, TransportError};

use command::Command;
use control::Control;
use link::{ChannelLink, Link};
use writer::Writer;

/// How an [`Endpoint`] is set up.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// This worker's engine id (the router names P by it).
    pub engine_id: String,
    /// This worker's KV cache layout (addresses are in its registered memory).
    pub layout: KvLayout,
    /// This worker's pipeline-parallel stage and its engine's number of stages (Hello).
    pub pp_rank: u32,
    /// See `pp_rank`.
    pub pp_size: u32,
    /// Where the KV cache lives.
    pub memory: MemorySpace,
    /// Hash of what must match between P and D (model, dtypes, ...); peers must agree.
    pub compatibility: String,
    /// Side channel address to listen on (`127.0.0.1:0` picks a free port).
    pub bind: SocketAddr,
    /// Shared secret for signing control messages; `None` trusts the network.
    pub secret: Option<Vec<u8>>,
    /// Rendezvous table sizing.
    pub table: TableConfig,
    /// A posted write that is not done after this long is reported quarantined: its blocks stay
    /// held on both sides until the transport has finished with it (a posted WRITE cannot be
    /// recalled). Default 10 s. Part of the write horizon this worker advertises.
    pub write_timeout: Duration,
    /// Side channel heartbeat period; a peer silent for `peer_timeout` is lost.
    pub heartbeat_interval: Duration,
    /// See `heartbeat_interval`. Also P's lease: P posts a WRITE only while D's latest proof of
    /// life (its echo of one of P's heartbeats) is younger than this.
    pub peer_timeout: Duration,
    /// Longest wait for a side channel connection and handshake.
    pub connect_timeout: Duration,
    /// How often the writer polls the transport while a WRITE is in flight or a receive awaits
    /// its DONEs. Default 200 µs. Longer costs less CPU and adds up to that much to noticing a
    /// completion (a D that waits on a P's prefill, many D endpoints in one process).
    pub busy_poll: Duration,
    /// How long bytes the transport accepted for a WRITE can still land after the write
    /// completed (or P's endpoint went away): over UCX's TCP transport, a WRITE "completes" once the
    /// kernel has the bytes, and a cut link that comes back delivers them until TCP gives up
    /// retransmitting (`net.ipv4.tcp_retries2`); over RDMA, the queue pair's retry budget; over
    /// a loopback device, nothing. Part of the write horizon. Default: the loopback transport's
    /// ([`LoopbackTransport::DELIVERY_BOUND`], 0); an endpoint on NIXL sets
    /// `kvpush_nixl::delivery_bound()`, which reads UCX's environment (as Python's `Endpoint`
    /// does).
    pub delivery_bound: Duration,
    /// Listen beyond loopback, and connect to P workers beyond it, without a secret (see
    /// `SideChannelConfig::allow_insecure`). Without it and without a secret, an expectation
    /// naming a P that is not on loopback fails at once, naming the host.
    pub allow_insecure: bool,
    /// Most registrations the D peers of one host may hold in P's table at once (a quarter of
    /// the table by default: 16,384).
    pub max_registrations_per_host: usize,
    /// Most bytes the registrations of one host's D peers may hold in P's table at once, each
    /// counted at about its decoded size (its block ids at 4 bytes, its strings, a fixed
    /// overhead). Default 64 MiB: thousands of long prompts' registrations, where the entry cap
    /// alone would let one host hold 16,384 registrations of up to 16 MiB each.
    pub max_registration_bytes_per_host: usize,
    /// Most commands the writer thread's inbox holds before new work is refused: the engine's
    /// `ready`/`expect` get [`EndpointError::Busy`], a peer's registration a `fail(refused)`
    /// (after a wait of up to 100 ms). Cancels and aborts are taken up to twice this. Default
    /// 16,384 (a writer that far behind is stuck, not busy).
    pub inbox_capacity: usize,
    /// Most side-channel connections held at once, handshakes included (a P holds one per D
    /// rank that receives from it). Default 256; see `SideChannelConfig::max_connections`.
    pub max_connections: usize,
    /// Most side-channel connections from one IP address at once. Default 32.
    pub max_connections_per_host: usize,
    /// Most side-channel connections still in their handshake at once. Default 16. A D turned
    /// away for want of a slot (all of them reconnecting to a restarted P) tries again, with a
    /// growing pause, for as long as its receives wait.
    pub max_handshakes: usize,
    /// What control frames and notifications may be: sizes, and the clock skew signed frames
    /// may show (`Limits::default()`).
    pub limits: Limits,
}

impl EndpointConfig {
    /// Defaults for everything but identity and layout.
    pub fn new(engine_id: impl Into<String>, layout: KvLayout) -> Self {
        Self {
            engine_id: engine_id.into(),
            layout,
            pp_rank: 0,
            pp_size: 1,
            memory: MemorySpace::DRAM,
            compatibility: String::new(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            secret: None,
            table: TableConfig::default(),
            write_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            busy_poll: Duration::from_micros(200),
            delivery_bound: LoopbackTransport::DELIVERY_BOUND,
            allow_insecure: false,
            max_registrations_per_host: 16_384,
            max_registration_bytes_per_host: 64 << 20,
            inbox_capacity: 16_384,
            max_connections: 256,
            max_connections_per_host: 32,
            max_handshakes: 16,
            limits: Limits::default(),
        }
    }

    /// How long after D's last proof of life bytes of this worker's may still land in D: no
    /// WRITE is posted later than `peer_timeout` (the lease) after the proof, none runs longer
    /// than `write_timeout`, what the transport accepted lands within `delivery_bound`, plus a
    /// margin for scheduling. Advertised in the Hello; D waits this long after losing P before
    /// it hands P's destination blocks back.
    pub fn write_horizon(&self) -> Duration {
        self.peer_timeout
            .saturating_add(self.write_timeout)
            .saturating_add(self.delivery_bound)
            .saturating_add(HORIZON_MARGIN)
    }
}

/// Slack in the write horizon for the time between P's lease check and its post, and for clock
/// rates that differ between hosts.
pub(crate) const HORIZON_MARGIN: Duration = Duration::from_secs(1);

/// Longest TTL a request may be given (P's hold on its KV, D's wait for it).
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3_600);

/// How much longer than the writer's own drain (`send::DRAIN_ON_CLOSE`) [`Endpoint::close`]
/// waits for it to exit: time to fail what is pending and end the receives. A writer still
/// running after that is stuck in a transport call and is left to it.
const CLOSE_MARGIN: Duration = Duration::from_secs(3);

/// A writer that has not come round its loop for this long (and at least `peer_timeout`) is
/// reported stalled: the endpoint answers unhealthy and its connections close.
const WRITER_STALL: Duration = Duration::from_secs(10);

/// P's KV for one request is computed and may be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyKv {
    /// P's request id (vLLM's internal id, with its engine suffix).
    pub request_id: String,
    /// The router's transfer id, when it sent one.
    pub transfer_id: Option<String>,
    /// P's logical block ids per KV cache group, covering the whole prompt.
    pub groups: Vec<BlockGroup>,
    /// Tokens computed.
    pub num_tokens: u64,
    /// How long P keeps the blocks for D to register.
    pub ttl: Duration,
}

/// P, layer-wise push: the requests whose KV a forward pass computes, each as
/// [`Endpoint::layers_ready`] takes it, prepared once per forward so that each layer hands them
/// all to the writer in one call ([`Endpoint::streams_ready`]). Cloning shares them.
#[derive(Debug, Clone, Default)]
pub struct LayerStreams(Arc<[(TransferKey, Arc<halves::Ready>)]>);

impl LayerStreams {
    /// The streams of `kvs` (their `ttl` is not used).
    pub fn new(kvs: Vec<ReadyKv>) -> Self {
        let at = Instant::now();
        Self(
            kvs.into_iter()
                .map(|kv| {
                    let key = TransferKey::for_request(kv.transfer_id.as_deref(), &kv.request_id);
                    (key, Arc::new(halves::Ready { kv, at }))
                })
                .collect(),
        )
    }

    /// How many requests stream.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none does.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each request's KV, in order.
    pub fn iter(&self) -> impl Iterator<Item = &ReadyKv> {
        self.0.iter().map(|(_, ready)| &ready.kv)
    }

    /// These streams but those of the requests `drop` names.
    pub fn without(&self, drop: impl Fn(&str) -> bool) -> Self {
        Self(self.0.iter().filter(|(_, ready)| !drop(&ready.kv.request_id)).cloned().collect())
    }

    /// One [`Command::Layers`] per stream, for the writer.
    fn commands(&self, regions: &Range<usize>) -> impl Iterator<Item = Command> + '_ {
        let regions = regions.clone();
        self.0.iter().map(move |(key, ready)| Command::Layers {
            key: key.clone(),
            ready: Arc::clone(ready),
            regions: regions.clone(),
        })
    }
}

/// D expects one request's KV from P.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectation {
    /// D's request id.
    pub request_id: String,
    /// The router's transfer id, when it sent one.
    pub transfer_id: Option<String>,
    /// The side channel address, `host:port`, of every P rank that writes into this D rank:
    /// one when P and D run the same tensor parallel size, several when P runs a larger one
    /// (each holds some of D's heads). The receive is done once each of them sent its DONE.
    pub sources: Vec<String>,
    /// D's destination blocks per KV cache group (the uncached suffix).
    pub groups: Vec<BlockGroup>,
    /// Tokens in the prompt.
    pub num_tokens: u64,
    /// Registration epoch: 1, bumped when D re-registers after a preemption.
    pub epoch: Epoch,
    /// How long D waits for the KV before cancelling.
    pub ttl: Duration,
    /// This D rank's share when its one P rank writes the transfer into several D ranks (D
    /// runs the larger tensor parallel size); `None`: P writes it into this rank alone.
    pub share: Option<Share>,
}

pub use crate::topology::Share;

/// What [`Endpoint::abort`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// No write will happen; P's blocks are free now (D was told if it had registered).
    Released,
    /// A write is in flight (or, aborted mid-stream, a layer's): keep the blocks until its
    /// event arrives.
    InFlight,
    /// The endpoint knew nothing of the request (already ended, or never reported ready).
    Unknown,
}

/// Why the endpoint takes no new work: its writer thread is gone or stuck (see
/// [`Endpoint::health`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    /// The writer thread stopped for good (a transport error it could not survive, or a panic).
    #[error("{reason}")]
    WriterDied {
        /// What stopped it.
        reason: String,
    },
    /// The writer thread has not run for a while although the rest of the process did.
    #[error(
        "the writer thread has not run for {:.1}s while the rest of the process did (stuck in a \
         transport call?)",
        .silent.as_secs_f64()
    )]
    WriterStalled {
        /// How long it has been silent.
        silent: Duration,
    },
}

/// Why an endpoint call was refused.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The rendezvous table refused the arrival.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The transport failed while the endpoint was being set up.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The side channel could not be started.
    #[error("cannot listen for peers on {addr}: {source}; pick a free port or address")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why not.
        source: std::io::Error,
    },
    /// The shared secret is unusable.
    #[error("the shared secret is unusable: {0}")]
    Secret(String),
    /// An argument is out of range; the text names it and the range.
    #[error("{0}")]
    Invalid(String),
    /// The writer thread stopped or stalled: nothing new is taken on.
    #[error(
        "the kvpush endpoint is unhealthy ({0}); pending transfers were failed; restart the \
         worker"
    )]
    Unhealthy(Unhealthy),
    /// The endpoint was closed.
    #[error("the kvpush endpoint is closed; create a new one")]
    Closed,
    /// The writer thread is behind: its inbox is full, and nothing was done.
    #[error(
        "the kvpush endpoint is overloaded: {queued} commands wait for its writer thread \
         (capacity {capacity}); nothing was done: retry later, or fail the request over \
         (recompute it)"
    )]
    Busy {
        /// Commands waiting.
        queued: usize,
        /// What new work is admitted against ([`EndpointConfig::inbox_capacity`]).
        capacity: usize,
    },
    /// [`Endpoint::close`] gave up waiting for the writer thread (stuck in a transport call).
    #[error(
        "the kvpush writer thread did not stop within {waited:?} of close (stuck in a transport \
         call?) and was left running, with {left}; its transport still holds the registered KV \
         memory: do not free it, exit the process"
    )]
    StuckOnClose {
        /// How long close waited.
        waited: Duration,
        /// What the endpoint still held: transfers in the table, commands in the inbox.
        left: String,
    },
}

impl From<inbox::Full> for EndpointError {
    fn from(full: inbox::Full) -> Self {
        Self::Busy { queued: full.queued, capacity: full.capacity }
    }
}

/// Counters of things that went wrong without ending a request, for metrics and logs.
#[derive(Debug, Default)]
pub struct Counters {
    /// Control frames or notifications refused (malformed, unauthenticated, replayed, ...).
    pub refused_frames: AtomicU64,
    /// Transport calls that failed outside any one write (e.g. receiving notifications).
    pub transport_errors: AtomicU64,
    /// DONEs for requests D no longer awaits (cancelled, failed or re-registered), from an agent
    /// D did not register with, signed as another sender than the agent that sent them, or not
    /// echoing their registration's nonce.
    pub stray_notifications: AtomicU64,
    /// Registrations refused: another peer's key, over the peer's quota, or a duplicate.
    pub refused_registrations: AtomicU64,
    /// Registrations dropped because their peer was lost before P's KV was ready.
    pub purged_registrations: AtomicU64,
    /// Writes not done within the write timeout, reported quarantined (P keeps its source
    /// blocks until the transport has finished with them).
    pub quarantined_writes: AtomicU64,
    /// Receives reported quarantined: a lost P's horizon passed without evidence that its
    /// bytes can no longer land, so D keeps the blocks until P answers or is found gone.
    pub quarantined_receives: AtomicU64,
    /// Writes not posted because D's proof of life had lapsed (its lease ran out).
    pub lapsed_leases: AtomicU64,
    /// Writes posted more than the horizon's margin after their lease check (the process was
    /// stopped in between): they may have landed after D's horizon. Alert on any.
    pub late_posts: AtomicU64,
    /// Work refused, or a peer's message dropped, because the writer's inbox was full (see
    /// [`EndpointConfig::inbox_capacity`]). Any means the writer is behind: alert on the rate.
    pub overloaded: AtomicU64,
    /// Layer-wise push: WRITEs of layers posted before their request's KV was ready.
    pub streamed_writes: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64) {
        // Relaxed: a statistic, read independently of any other memory.
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of an endpoint's [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// See [`Counters::refused_frames`].
    pub refused_frames: u64,
    /// See [`Counters::transport_errors`].
    pub transport_errors: u64,
    /// See [`Counters::stray_notifications`].
    pub stray_notifications: u64,
    /// See [`Counters::refused_registrations`].
    pub refused_registrations: u64,
    /// See [`Counters::purged_registrations`].
    pub purged_registrations: u64,
    /// See [`Counters::quarantined_writes`].
    pub quarantined_writes: u64,
    /// See [`Counters::quarantined_receives`].
    pub quarantined_receives: u64,
    /// See [`Counters::lapsed_leases`].
    pub lapsed_leases: u64,
    /// See [`Counters::late_posts`].
    pub late_posts: u64,
    /// See [`Counters::overloaded`].
    pub overloaded: u64,
    /// See [`Counters::streamed_writes`].
    pub streamed_writes: u64,
}

/// State shared by the engine-facing calls, the side channel's handler and the writer.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    pub(crate) table: RendezvousTable<halves::Registration, Arc<halves::Ready>>,
    /// P: transfers written into several D ranks (see `fanout`). Taken around table operations
    /// on such keys only, never while a table shard is locked.
    pub(crate) fanouts: Mutex<fanout::FanOuts>,
    /// The writer's inbox, bounded by admission (see `inbox`).
    pub(crate) inbox: inbox::Inbox,
    /// Every clock the endpoint reads (the system's, or a simulation's).
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) origin: Instant,
    /// Why the writer stopped for good (it panicked); set once.
    pub(crate) dead: OnceLock<String>,
    /// When the writer last came round its loop, on the boot-time clock (ms).
    pub(crate) writer_beat_ms: AtomicU64,
    /// When a thread other than the writer (the side channel's, the engine's) last asked for
    /// the endpoint's health, on the boot-time clock (ms): what tells a writer stuck while the
    /// rest of the process runs from a process that was stopped as a whole.
    pub(crate) others_beat_ms: AtomicU64,
    /// See [`WRITER_STALL`]: the stall threshold of this endpoint.
    pub(crate) stall_after: Duration,
    /// The peer agent names in use and the metadata each stands for (see `agents`).
    pub(crate) agents: agents::Agents,
}

impl Shared {
    /// The state of a new endpoint whose writer reads the other end of `inbox`.
    pub(crate) fn new(config: &EndpointConfig, inbox: inbox::Inbox, clock: Arc<dyn Clock>) -> Self {
        let now = clock.boot_now().as_millis();
        Self {
            table: RendezvousTable::new(config.table.clone()),
            fanouts: Mutex::new(fanout::FanOuts::new()),
            inbox,
            origin: clock.now(),
            counters: Counters::default(),
            dead: OnceLock::new(),
            writer_beat_ms: AtomicU64::new(now),
            others_beat_ms: AtomicU64::new(now),
            stall_after: WRITER_STALL.max(config.peer_timeout),
            agents: agents::Agents::default(),
            clock,
        }
    }

    /// Hands `command` to the writer; false once the writer has stopped. New and ending work
    /// is admitted first ([`inbox::Inbox::admit`]).
    pub(crate) fn send(&self, command: Command) -> bool {
        self.inbox.send(command)
    }

    /// Room for new work in the writer's inbox; counts a refusal.
    pub(crate) fn admit(&self) -> Result<(), EndpointError> {
        self.check_open()?;
        self.inbox.admit().map_err(|full| self.overloaded(full))
    }

    /// Room for work that ends requests; counts a refusal.
    pub(crate) fn admit_ending(&self) -> Result<(), EndpointError> {
        self.check_open()?;
        self.inbox.admit_ending().map_err(|full| self.overloaded(full))
    }

    /// `Closed` once `close` began: nothing taken then would ever end in an event.
    fn check_open(&self) -> Result<(), EndpointError> {
        if self.inbox.is_stopping() {
            return Err(EndpointError::Closed);
        }
        Ok(())
    }

    fn overloaded(&self, full: inbox::Full) -> EndpointError {
        Counters::add(&self.counters.overloaded);
        full.into()
    }

    /// Now on the boot-time clock, in ms (see `clock`).
    pub(crate) fn millis(&self) -> u64 {
        self.boot_now().as_millis()
    }

    /// Now on the monotonic clock.
    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Now on the boot-time clock.
    pub(crate) fn boot_now(&self) -> BootInstant {
        self.clock.boot_now()
    }

    /// Now on the wall clock (ms since the Unix epoch): signed frames' timestamps.
    pub(crate) fn unix_millis(&self) -> u64 {
        self.clock.unix_millis()
    }

    /// `Err` once the writer died or stalled.
    pub(crate) fn health(&self) -> Result<(), Unhealthy> {
        if let Some(reason) = self.dead.get() {
            return Err(Unhealthy::WriterDied { reason: reason.clone() });
        }
        // Relaxed: timestamps read on their own; a stale one only delays the verdict by a call.
        let now = self.millis();
        let beat = self.writer_beat_ms.load(Ordering::Relaxed);
        // Every caller is a thread other than the writer: it proves the process runs now.
        let others = self.others_beat_ms.swap(now, Ordering::Relaxed);
        match writer_stall(now, beat, others, self.stall_after) {
            Some(silent) => Err(Unhealthy::WriterStalled { silent }),
            None => Ok(()),
        }
    }
}

/// How long the writer has been stuck, if it is: silent for more than `stall_after` at `now`
/// (ms) since its last beat, while another thread was seen running (at `others`, the previous
/// health check) more than `stall_after` after that beat. A process stopped as a whole (SIGSTOP,
/// a VM pause, a suspend) stopped every thread: on resume the writer looks silent, but so did
/// everyone else, and it is not judged before it had a chance to run again.
fn writer_stall(now: u64, beat: u64, others: u64, stall_after: Duration) -> Option<Duration> {
    let silent = Duration::from_millis(now.saturating_sub(beat));
    let seen_running_without_it = Duration::from_millis(others.saturating_sub(beat));
    (silent > stall_after && seen_running_without_it > stall_after).then_some(silent)
}

/// An endpoint and what runs it, before it runs: see [`Endpoint::assemble`].
pub(crate) struct Parts<T: Transport> {
    pub(crate) endpoint: Endpoint,
    /// The side channel's handler (the link calls it): the simulation's network calls it.
    #[cfg_attr(not(any(test, feature = "sim")), allow(dead_code))]
    pub(crate) control: Arc<Control>,
    pub(crate) writer: Writer<T>,
}

/// One worker's push endpoint; see the module docs.
#[derive(Debug)]
pub struct Endpoint {
    shared: Arc<Shared>,
    events: Mutex<Receiver<Event>>,
    side_channel: Arc<dyn Link>,
    writer: Mutex<WriterThread>,
    write_horizon: Duration,
    memory: MemorySpace,
}

impl Endpoint {
    /// Starts the side channel and the writer thread, which takes `transport` (with this
    /// worker's KV memory already registered).
    pub fn start<T: Transport + 'static>(
        config: EndpointConfig,
        transport: T,
    ) -> Result<Self, EndpointError> {
        let clock = Arc::new(SystemClock);
        let parts = Self::assemble(&config, transport, clock, |hello, control, shared, secret| {
            let mut side_config = SideChannelConfig::new(
                config.bind,
                format!("{}/{}", config.engine_id, hello.agent_name),
            );
            side_config.secret = secret;
            side_config.heartbeat_interval = config.heartbeat_interval;
            side_config.peer_timeout = config.peer_timeout;
            side_config.connect_timeout = config.connect_timeout;
            side_config.allow_insecure = config.allow_insecure;
            side_config.max_connections = config.max_connections;
            side_config.max_connections_per_host = config.max_connections_per_host;
            side_config.max_handshakes = config.max_handshakes;
            side_config.limits = config.limits;
            let side_channel =
                Arc::new(SideChannel::start(side_config, hello, control).map_err(|source| {
                    match source.kind() {
                        // Refused by policy (no secret beyond loopback): the message says what
                        // to do.
                        std::io::ErrorKind::PermissionDenied => {
                            EndpointError::Invalid(source.to_string())
                        }
                        _ => EndpointError::Listen { addr: config.bind, source },
                    }
                })?);
            let engine_id = config.engine_id.clone();
            Ok(Arc::new(ChannelLink::new(side_channel, Arc::clone(shared), engine_id)))
        })?;
        let Parts { endpoint, writer, .. } = parts;
        let handle = thread::Builder::new()
            .name(format!("kvpush-writer-{}", config.engine_id))
            .spawn(move || watch(writer))
            .map_err(|e| EndpointError::Transport(TransportError::new("spawn writer", e)))?;
        lock(&endpoint.writer).handle = Some(handle);
        Ok(endpoint)
    }

    /// An endpoint's parts, before anything runs them: its shared state, Hello and side-channel
    /// handler, the link `link` makes of them (the side channel, started), and the writer, which
    /// takes `transport`. [`start`](Self::start) runs the writer on its thread; the simulation
    /// (`sim`) drives it a turn at a time, on its virtual `clock`.
    pub(crate) fn assemble<T: Transport>(
        config: &EndpointConfig,
        mut transport: T,
        clock: Arc<dyn Clock>,
        link: impl FnOnce(
            Hello,
            Arc<Control>,
            &Arc<Shared>,
            Option<Secret>,
        ) -> Result<Arc<dyn Link>, EndpointError>,
    ) -> Result<Parts<T>, EndpointError> {
        let secret = config
            .secret
            .as_deref()
            .map(Secret::from_bytes)
            .transpose()
            .map_err(|e| EndpointError::Secret(e.to_string()))?;
        let hello = Hello {
            engine_id: config.engine_id.clone(),
            tp_rank: config.layout.tp_rank,
            tp_size: config.layout.tp_size,
            pp_rank: config.pp_rank,
            pp_size: config.pp_size,
            agent_name: transport.name().to_owned(),
            agent_metadata: transport.metadata()?,
            layout: config.layout.clone(),
            compatibility: config.compatibility.clone(),
            versions: vec![PROTOCOL_VERSION],
            memory: config.memory,
            nonce: 0,
            echo: 0,
            write_horizon_ms: u64::try_from(config.write_horizon().as_millis()).unwrap_or(u64::MAX),
            // At least 1 ms: 0 on the wire means "unknown" (the peer then assumes the horizon).
            delivery_bound_ms: u64::try_from(config.delivery_bound.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        };
        for (name, value) in [
            ("inbox_capacity", config.inbox_capacity),
            ("max_registrations_per_host", config.max_registrations_per_host),
            ("max_registration_bytes_per_host", config.max_registration_bytes_per_host),
        ] {
            if value == 0 {
                return Err(EndpointError::Invalid(format!(
                    "{name} must be at least 1 (0 would refuse every request)"
                )));
            }
        }
        let (inbox, commands) = inbox::inbox(config.inbox_capacity);
        let (event_sink, events) = mpsc::channel();
        let shared = Arc::new(Shared::new(config, inbox, clock));
        let vram_refusal =
            transport.can_write_into(MemorySpace { kind: MemoryKind::Vram, device: 0 }).err();
        let control = Arc::new(Control::new(
            Arc::clone(&shared),
            config.compatibility.clone(),
            quota::Quota {
                entries: config.max_registrations_per_host,
                bytes: config.max_registration_bytes_per_host,
            },
            config.memory,
            vram_refusal,
        ));
        let side_channel = link(hello, Arc::clone(&control), &shared, secret.clone())?;
        let writer = Writer::new(
            config,
            transport,
            secret,
            Arc::clone(&shared),
            Arc::clone(&side_channel),
            commands,
            event_sink,
        );
        let endpoint = Self {
            shared,
            events: Mutex::new(events),
            side_channel,
            writer: Mutex::new(WriterThread { handle: None, waited: false }),
            write_horizon: config.write_horizon(),
            memory: config.memory,
        };
        Ok(Parts { endpoint, control, writer })
    }

    /// The side channel address peers (D workers) connect to.
    pub fn address(&self) -> SocketAddr {
        self.side_channel.local_addr()
    }

    /// P: the request's KV is computed. The write starts at once if D already registered.
    ///
    /// An error means no write will happen (e.g. D cancelled first, or [`EndpointError::Busy`]:
    /// the writer is behind): free the blocks now. Otherwise its event comes.
    pub fn ready(&self, ready: ReadyKv) -> Result<(), EndpointError> {
        let key = TransferKey::for_request(ready.transfer_id.as_deref(), &ready.request_id);
        if let Err(refused) = self.admit_ready(&ready) {
            return self.end_refused(&key, &ready, refused);
        }
        let now = self.shared.now();
        let deadline = now + ready.ttl;
        let ready = Arc::new(halves::Ready { kv: ready, at: now });
        let matches = {
            // Under the groups' lock: a D rank's first slot registration may be creating this
            // transfer's group right now (see `fanout`).
            let mut groups = lock(&self.shared.fanouts);
            match groups.get_mut(&key) {
                Some(group) if group.is_placed() => {
                    return Err(RendezvousError::DuplicateReady { key }.into());
                }
                Some(group) => {
                    let matches = fanout::place(&self.shared, &key, group, &ready, deadline, now);
                    if group.is_over() {
                        // Every D rank cancelled before the KV was ready: nothing is written.
                        groups.remove(&key);
                        let reason = FenceReason::Cancelled;
                        return Err(RendezvousError::Fenced { key, reason }.into());
                    }
                    matches
                }
                None => match self.shared.table.ready(key, ready, deadline, now)? {
                    Arrival::Matched(m) => vec![m],
                    Arrival::Waiting { .. } => Vec::new(),
                },
            }
        };
        for m in matches {
            if !self.shared.send(Command::Write(m)) {
                return Err(EndpointError::Closed);
            }
        }
        Ok(())
    }

    /// `ready` was refused before the table. Layers of it may have streamed, or wait in the
    /// writer's inbox to: nothing may read its blocks once they are freed, so its transfer ends
    /// as an abort ends it (D is told), or is fenced if nothing is there yet. Where a layer's
    /// WRITE is in flight, the KV is taken after all: its send ends, cancelled, once that WRITE
    /// is done. A key that holds another KV (a duplicate ready) is left alone.
    fn end_refused(
        &self,
        key: &TransferKey,
        ready: &ReadyKv,
        refused: EndpointError,
    ) -> Result<(), EndpointError> {
        let group = lock(&self.shared.fanouts).get(key).map(fanout::FanOut::is_placed);
        if group == Some(true) || self.shared.table.has_ready(key) {
            return Err(refused);
        }
        let now = self.shared.now();
        if group.is_none() && self.shared.table.fence_vacant(key, FenceReason::Cancelled, now) {
            return Err(refused);
        }
        let (request_id, transfer_id) = (&ready.request_id, ready.transfer_id.as_deref());
        let why = format!("P could not send request {request_id} ({refused})");
        match self.abort_admitted(request_id, transfer_id, &why) {
            AbortOutcome::InFlight => Ok(()),
            AbortOutcome::Released | AbortOutcome::Unknown => Err(refused),
        }
    }

    /// Whether the writer takes `ready` (before the table: a match once made must reach it).
    fn admit_ready(&self, ready: &ReadyKv) -> Result<(), EndpointError> {
        self.shared.health().map_err(EndpointError::Unhealthy)?;
        check_ttl(&ready.request_id, ready.ttl)?;
        self.shared.admit()
    }

    /// P, layer-wise push: the KV of the regions `regions` (layout order: a layer's K and V, or
    /// its latent) is final for all of `ready.num_tokens`, while the request's other layers are
    /// still being computed. Where D registered already, the writer writes those regions into
    /// D's blocks now, notifying nobody, and the request's WRITE at [`ready`](Self::ready) then
    /// carries only the regions left, with the DONE. Where D did not register yet, nothing
    /// happens: `ready` writes every region.
    ///
    /// Regions go in order from the first; a range that does not continue the ones streamed is
    /// left to `ready`'s WRITE. A prompt computed in chunks streams chunk by chunk: `ready` is
    /// then its KV so far (its first `num_tokens` tokens, in the blocks holding them), and a
    /// chunk's regions go once the previous chunk's all went. `ready.ttl` is not used. An error means nothing was streamed;
    /// the request's `ready` is unaffected. Never waits for the transfer.
    pub fn layers_ready(&self, ready: ReadyKv, regions: Range<usize>) -> Result<(), EndpointError> {
        self.shared.health().map_err(EndpointError::Unhealthy)?;
        self.shared.admit()?;
        let key = TransferKey::for_request(ready.transfer_id.as_deref(), &ready.request_id);
        let ready = Arc::new(halves::Ready { kv: ready, at: self.shared.now() });
        if !self.shared.send(Command::Layers { key, ready, regions }) {
            return Err(EndpointError::Closed);
        }
        Ok(())
    }

    /// P, layer-wise push, every request of a forward pass at once: [`layers_ready`] for each of
    /// `streams` (made once per forward with [`LayerStreams::new`]), in one call and one command
    /// to the writer, however many requests stream. An error means nothing was streamed.
    ///
    /// [`layers_ready`]: Self::layers_ready
    pub fn streams_ready(
        &self,
        streams: &LayerStreams,
        regions: Range<usize>,
    ) -> Result<(), EndpointError> {
        if streams.is_empty() {
            return Ok(());
        }
        self.shared.health().map_err(EndpointError::Unhealthy)?;
        self.shared.admit()?;
        if !self.shared.send(Command::LayersOf { streams: streams.clone(), regions }) {
            return Err(EndpointError::Closed);
        }
        Ok(())
    }

    /// P: the request was aborted (or finished without KV to send). D is told if it had
    /// registered; see [`AbortOutcome`] for what to do with the blocks.
    ///
    /// [`EndpointError::Busy`] when even ending work finds the writer's inbox full: nothing was
    /// done (a write may still happen); keep the blocks and abort again later.
    pub fn abort(
        &self,
        request_id: &str,
        transfer_id: Option<&str>,
    ) -> Result<AbortOutcome, EndpointError> {
        self.shared.admit_ending()?;
        Ok(self.abort_admitted(request_id, transfer_id, &format!("P aborted request {request_id}")))
    }

    /// [`abort`](Self::abort) once admitted; `why` is what D is told.
    fn abort_admitted(
        &self,
        request_id: &str,
        transfer_id: Option<&str>,
        why: &str,
    ) -> AbortOutcome {
        let key = TransferKey::for_request(transfer_id, request_id);
        let now = self.shared.now();
        {
            let mut groups = lock(&self.shared.fanouts);
            if let Some(group) = groups.get_mut(&key) {
                let outcome = self.abort_slots(&key, group, request_id, why, now);
                if outcome != AbortOutcome::InFlight {
                    groups.remove(&key);
                }
                // Fenced, so that a D rank's late slot registration starts no new group.
                let _ = self.shared.table.cancel(&key, None, now);
                return outcome;
            }
        }
        match self.shared.table.cancel(&key, None, now) {
            Cancelled::NotFound => AbortOutcome::Unknown,
            Cancelled::Deferred => AbortOutcome::InFlight,
            Cancelled::Removed { registration, .. } => {
                if let Some(registration) = registration {
                    let fail = registration.aborted(why);
                    self.shared.send(Command::Fail { peer: registration.peer, fail });
                }
                AbortOutcome::Released
            }
        }
    }

    /// [`abort`](Self::abort) of a transfer written into several D ranks: every slot is
    /// cancelled (and its D rank told); a slot being written is left to finish, and the send's
    /// event then comes after the last of them.
    fn abort_slots(
        &self,
        key: &TransferKey,
        group: &mut fanout::FanOut,
        request_id: &str,
        why: &str,
        now: Instant,
    ) -> AbortOutcome {
        let mut in_flight = false;
        for slot in 0..group.slots {
            match self.shared.table.cancel(&key.slot(slot), None, now) {
                Cancelled::NotFound => {}
                Cancelled::Deferred => in_flight = true,
                Cancelled::Removed { registration, ready } => {
                    if let Some(registration) = registration {
                        let fail = registration.aborted(why);
                        self.shared.send(Command::Fail { peer: registration.peer, fail });
                    }
                    if ready.is_some() {
                        let detail = format!("P aborted request {request_id}");
                        group.conclude(Outcome::cancelled(Reason::Aborted, detail), 0, 0);
                    }
                }
            }
        }
        if in_flight {
            // A stream's WRITE, before P's KV was placed: the group owes the send's event.
            group.abort_in_flight();
            AbortOutcome::InFlight
        } else {
            AbortOutcome::Released
        }
    }

    /// D: register `expectation`'s blocks with P (connecting to it first if needed) and wait
    /// for the KV. Ends in a `Received`, `Failed` or `Cancelled` event; an error means nothing
    /// was registered ([`EndpointError::Busy`]: the writer is behind; recompute the request).
    pub fn expect(&self, expectation: Expectation) -> Result<(), EndpointError> {
        self.shared.health().map_err(EndpointError::Unhealthy)?;
        check_ttl(&expectation.request_id, expectation.ttl)?;
        check_sources(&expectation)?;
        self.shared.admit()?;
        if self.shared.send(Command::Expect(expectation, self.shared.now())) {
            Ok(())
        } else {
            Err(EndpointError::Closed)
        }
    }

    /// D: stop waiting for `request_id` (aborted or preempted). P is asked to cancel; the
    /// `Cancelled` event comes once P confirmed no write can still land (or P is gone).
    /// [`EndpointError::Busy`]: nothing was done (the writer is far behind); cancel again later.
    pub fn cancel(&self, request_id: &str) -> Result<(), EndpointError> {
        self.shared.admit_ending()?;
        if self.shared.send(Command::CancelExpectation(request_id.to_owned())) {
            Ok(())
        } else {
            Err(EndpointError::Closed)
        }
    }

    /// Every event since the last call; never blocks, not even behind a [`wait`](Self::wait)
    /// in another thread (which takes what arrives meanwhile: each event goes to one caller).
    pub fn poll(&self) -> Vec<Event> {
        // A caller may hold Python's GIL, and a `wait` holds the receiver, GIL released, for
        // up to its timeout: a poll that waited for it would stall every Python thread.
        let events = match self.events.try_lock() {
            Ok(events) => events,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Vec::new(),
        };
        events.try_iter().collect()
    }

    /// Waits up to `timeout` for at least one event, then returns all that are ready. Holds the
    /// events while it waits: a concurrent `poll` returns nothing, a concurrent `wait` waits
    /// its turn.
    pub fn wait(&self, timeout: Duration) -> Vec<Event> {
        let events = lock(&self.events);
        match events.recv_timeout(timeout) {
            Ok(first) => std::iter::once(first).chain(events.try_iter()).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Transfers waiting in the rendezvous table (P side).
    pub fn pending(&self) -> usize {
        self.shared.table.len()
    }

    /// P: transfers held for several D ranks (D runs a larger tensor parallel size), whether or
    /// not P's KV came yet. Each ends with its slots' registrations or its send.
    pub fn fanouts(&self) -> usize {
        lock(&self.shared.fanouts).len()
    }

    /// What went wrong without ending a request.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        // Relaxed: independent statistics (see `Counters::add`).
        Stats {
            refused_frames: c.refused_frames.load(Ordering::Relaxed),
            transport_errors: c.transport_errors.load(Ordering::Relaxed),
            stray_notifications: c.stray_notifications.load(Ordering::Relaxed),
            refused_registrations: c.refused_registrations.load(Ordering::Relaxed),
            purged_registrations: c.purged_registrations.load(Ordering::Relaxed),
            quarantined_writes: c.quarantined_writes.load(Ordering::Relaxed),
            quarantined_receives: c.quarantined_receives.load(Ordering::Relaxed),
            lapsed_leases: c.lapsed_leases.load(Ordering::Relaxed),
            late_posts: c.late_posts.load(Ordering::Relaxed),
            overloaded: c.overloaded.load(Ordering::Relaxed),
            streamed_writes: c.streamed_writes.load(Ordering::Relaxed),
        }
    }

    /// `Err` once the writer thread died or stalled: its transfers were failed (D's once their
    /// write horizons passed), its peers were disconnected, and new work is refused.
    pub fn health(&self) -> Result<(), Unhealthy> {
        self.shared.health()
    }

    /// Where this worker's KV cache lives, as registered with the transport and advertised in
    /// its Hello.
    pub fn memory(&self) -> MemorySpace {
        self.memory
    }

    /// How long a D waits after losing this worker before handing its blocks back
    /// ([`EndpointConfig::write_horizon`]), as advertised to peers.
    pub fn write_horizon(&self) -> Duration {
        self.write_horizon
    }

    /// Seconds since the endpoint started: the clock event timelines use.
    pub fn clock(&self) -> f64 {
        self.shared.now().saturating_duration_since(self.shared.origin).as_secs_f64()
    }

    /// Stops the writer (failing what is still pending) and the side channel. Idempotent.
    ///
    /// Bounded: the writer gets `DRAIN_ON_CLOSE` for its writes in flight and `CLOSE_MARGIN` (3 s)
    /// more to exit. One stuck in a transport call is left running, and close answers
    /// [`EndpointError::StuckOnClose`] with what it held (a later close answers it again, at
    /// once, while the writer still runs); its transport, which holds the registered KV memory,
    /// is then never dropped, so that memory must stay allocated (exit the process).
    pub fn close(&self) -> Result<(), EndpointError> {
        self.shared.inbox.stop();
        let result = lock(&self.writer).stop(send::DRAIN_ON_CLOSE + CLOSE_MARGIN, || {
            format!(
                "transfers pending in the rendezvous table: {}, commands in its inbox: {}",
                self.shared.table.len(),
                self.shared.inbox.queued()
            )
        });
        // Closed whatever the writer does: D peers stop proving life to us, so that their
        // fences run out.
        self.side_channel.close();
        result
    }
}

/// The writer thread's handle, for a close bounded in time.
#[derive(Debug)]
struct WriterThread {
    /// `None` once joined.
    handle: Option<JoinHandle<()>>,
    /// A close already waited its bound for this thread: later ones do not wait again.
    waited: bool,
}

/// How often [`WriterThread::stop`] looks whether the writer exited.
const JOIN_POLL: Duration = Duration::from_millis(2);

impl WriterThread {
    /// Joins the writer if it exits within `bound` (no wait if a close already waited);
    /// otherwise leaves it running and says what `left` describes.
    fn stop(
        &mut self,
        bound: Duration,
        left: impl FnOnce() -> String,
    ) -> Result<(), EndpointError> {
        let Some(handle) = &self.handle else { return Ok(()) };
        let deadline = Instant::now() + if self.waited { Duration::ZERO } else { bound };
        while !handle.is_finished() && Instant::now() < deadline {
            thread::sleep(JOIN_POLL);
        }
        self.waited = true;
        if !handle.is_finished() {
            return Err(EndpointError::StuckOnClose { waited: bound, left: left() });
        }
        if let Some(handle) = self.handle.take() {
            // A panic in the writer has already been reported by the panic hook and handled
            // by `watch`; there is nothing left to clean up here.
            let _ = handle.join();
        }
        Ok(())
    }
}

/// Refuses a TTL the clock cannot add (or that no serving setup needs).
fn check_ttl(request_id: &str, ttl: Duration) -> Result<(), EndpointError> {
    if ttl > MAX_TTL {
        return Err(EndpointError::Invalid(format!(
            "request {request_id}: ttl {:.0}s exceeds the maximum of {}s; configure a shorter \
             lease",
            ttl.as_secs_f64(),
            MAX_TTL.as_secs()
        )));
    }
    Ok(())
}

/// An expectation names at least one P rank, each once (a rank's DONE counts once), for a
/// request id without a NUL (the receive path keys a superseded receive with one).
fn check_sources(expectation: &Expectation) -> Result<(), EndpointError> {
    let request_id = &expectation.request_id;
    if request_id.contains('\0') {
        return Err(EndpointError::Invalid(format!(
            "request id {request_id:?} holds a NUL character; request ids are text"
        )));
    }
    if expectation.sources.is_empty() {
        return Err(EndpointError::Invalid(format!(
            "request {request_id}: no P address to receive from"
        )));
    }
    if let Some(Share { slot, of }) = expectation.share {
        if of == 0 || of > crate::protocol::MAX_FANOUT || slot >= of {
            return Err(EndpointError::Invalid(format!(
                "request {request_id}: share {slot} of {of} is not a slot of 1 to {} D ranks",
                crate::protocol::MAX_FANOUT
            )));
        }
        if of > 1 && expectation.sources.len() > 1 {
            return Err(EndpointError::Invalid(format!(
                "request {request_id}: a share of a P rank's transfer comes from that one rank, \
                 not from {}",
                expectation.sources.len()
            )));
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = expectation.sources.iter().find(|s| !seen.insert(s.as_str())) {
        return Err(EndpointError::Invalid(format!(
            "request {request_id}: P address {twice} named twice; name each P rank once"
        )));
    }
    Ok(())
}

/// The writer thread's body: runs the writer, and if it panics, fails everything it held, so
/// that no request hangs on a thread that is gone.
fn watch<T: Transport>(mut writer: Writer<T>) {
    let run = panic::catch_unwind(AssertUnwindSafe(|| writer.run()));
    let reason = match run {
        Ok(()) => None,
        Err(panic) => Some(format!("the writer thread panicked: {}", panic_text(&*panic))),
    };
    // A panic while failing (state left half-updated) must not go unnoticed either: the health
    // reason is set first, so the endpoint is unhealthy whatever happens next.
    let ending = panic::catch_unwind(AssertUnwindSafe(|| match reason {
        None => writer.shut_down(),
        Some(reason) => writer.die(reason),
    }));
    if let Err(panic) = ending {
        writer.mark_dead(format!(
            "the writer thread panicked while stopping: {}",
            panic_text(&*panic)
        ));
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // A stuck writer cannot be helped here: `close`'s error is for a caller who can act.
        let _ = self.close();
    }
}

#[cfg(test)]
mod watchdog_tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(10);

    #[test]
    fn a_writer_stuck_while_others_run_is_stalled() {
        // The writer beat at 1 s; the side channel checked every second since; at 12.5 s:
        assert_eq!(writer_stall(12_500, 1_000, 11_500, STALL), Some(Duration::from_millis(11_500)));
        assert_eq!(writer_stall(10_500, 1_000, 9_500, STALL), None, "not silent long enough");
    }

    #[test]
    fn a_process_paused_as_a_whole_is_not_a_stalled_writer() {
        // Everyone stopped at 1 s (the last check was at 1.2 s); the first check after a 10.5 s
        // pause sees the writer silent, but nobody else ran meanwhile either.
        assert_eq!(writer_stall(11_700, 1_000, 1_200, STALL), None);
        // Had the writer still not run by the next check, a second later, it would be judged.
        assert_eq!(writer_stall(24_000, 1_000, 12_700, STALL), Some(Duration::from_millis(23_000)));
    }
}

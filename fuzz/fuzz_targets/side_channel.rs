//! Drives a live side-channel server over TCP with scripted, hostile peers: the handshake, the
//! frame state machine after it, and the connection lifecycle, not only the decoder (which
//! `decode_frame` fuzzes on its own).
//!
//! One process holds two servers on 127.0.0.1 (one signed, one in trusted-network mode), started
//! on the first input with short timeouts. Each input is a [`Script`] of actions over a few TCP
//! connections to one of them: raw bytes, length prefixes, frames built from fuzz data (hello,
//! attach, register, cancel, heartbeat, ...; signed with the right secret, a wrong one or none;
//! with a right or wrong echo; stamped now or skewed), a whole handshake, replays and tampered
//! copies of earlier frames, split writes, half-closes, resets, short waits, reads, and calls on
//! the server's own API (`send`, `disconnect`, `peers`, `proof_age`). A connection can be
//! taken already accepted from a small pool, so that an input does not wait out the accept poll.
//!
//! After each input it checks what must hold whatever a peer sends:
//! * every frame the server writes decodes (signed, for the signed server); its Hello carries no
//!   agent metadata and, signed, answers a challenge we posed; no welcome without a valid attach;
//! * the handler's contract: `peer_joined`, then `message`s, then exactly one `peer_lost` per
//!   peer; never a hello, done, attach or heartbeat; signed, nothing forged and nothing twice;
//! * no thread panicked; the process RSS stays under `FUZZ_RSS_LIMIT_MB` (default 512);
//! * once our sockets are gone, the server's connections return to the baseline within
//!   [`DRAIN_BOUND`]; every [`LEGIT_EVERY`] inputs, with nothing else open, its connections drop
//!   to zero, `peers()` is empty, and a legitimate `SideChannel::connect` joins and delivers.
//!
//! Run: `scripts/fuzz side_channel 600` (or `cd fuzz && cargo +nightly fuzz run side_channel`).

#![no_main]

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::protocol::{
    frame_len, unix_millis, Attach, BlockGroup, Cancel, CancelAck, Decoder, Done, Encoder,
    ErrorReply, Fail, FailReason, Heartbeat, Hello, Limits, Message, ProtocolError, Register,
    Secret,
};
use kvpush_core::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
};
use kvpush_core::transport::{MemoryKind, MemorySpace};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use serde::Serialize;

const HEARTBEAT: Duration = Duration::from_millis(50);
const PEER_TIMEOUT: Duration = Duration::from_millis(400);
const CONNECT_TIMEOUT: Duration = Duration::from_millis(300);
const WRITE_TIMEOUT: Duration = Duration::from_millis(200);

/// Most actions and connections one input drives.
const MAX_ACTIONS: usize = 48;
const MAX_CONNECTIONS: usize = 8;
/// All waits and reads of one input together: keeps an input near the 50 ms target.
const WAIT_BUDGET: Duration = Duration::from_millis(30);
/// How long the server may take to let go of connections whose sockets we closed. Above every
/// server timeout, so only a connection it never lets go of trips it.
const DRAIN_BOUND: Duration = Duration::from_millis(1500);
/// Inputs between full checks (drain to zero, then a legitimate connect).
const LEGIT_EVERY: u64 = 64;
/// Pooled connections per server, and the age after which one is too close to the server's
/// handshake timeout to be worth using.
const POOL: usize = 2;
const POOL_MAX_AGE: Duration = Duration::from_millis(150);

const COMPATIBILITY: &str = "fuzz-model/bf16/flash";
/// Strings the harness builds for frames the signed server must refuse start with this; seeing
/// one in a handler callback means a forged frame got through.
const FORGED: &str = "forged-";
/// Over the servers' `max_string_bytes`.
const LONG: usize = 4097;

fn limits() -> Limits {
    // Small enough that the fuzzer reaches every bound with the inputs it builds.
    Limits {
        max_frame_bytes: 256 << 10,
        max_block_ids: 4096,
        max_string_bytes: 4096,
        // The channel keeps one replay window per sender session (each connection's encoder is
        // one) until its frames are older than the skew: a short skew keeps the table well
        // below `max_sessions` at a hundred connections a second.
        max_clock_skew: Duration::from_secs(2),
        max_sessions: 4096,
    }
}

fn secret(byte: u8) -> Secret {
    Secret::from_bytes(&[byte; 32]).expect("32 bytes is a valid secret")
}

fn server_hello(engine_id: &str) -> Hello {
    Hello {
        engine_id: engine_id.into(),
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        agent_name: format!("{engine_id}-agent"),
        agent_metadata: vec![9; 64],
        layout: KvLayout {
            regions: vec![Region { base: 0x1000, block_stride: 4096, num_blocks: 64, group: 0 }],
            block_tokens: 16,
            kernel_block_tokens: 16,
            heads: 4,
            head_bytes: 64,
            token_order: TokenOrder::Nhd,
            tp_rank: 0,
            tp_size: 1,
        },
        compatibility: COMPATIBILITY.into(),
        versions: vec![1],
        memory: MemorySpace::DRAM,
        nonce: 0,
        echo: 0,
        write_horizon_ms: 5_000,
        delivery_bound_ms: 0,
    }
}

// ------------------------------------------------------------------------------------------
// The recording handler and its contract checks.

/// What one channel's handler saw; checked and reset by the harness between inputs.
#[derive(Default)]
struct Record {
    /// Joined peers not yet lost, with their address.
    live: HashMap<PeerId, SocketAddr>,
    /// Addresses joined during this input.
    joined_addrs: Vec<SocketAddr>,
    /// The unique id of every message delivered this input: the signed server must not deliver
    /// one twice, on one connection or across them (its replay windows are per channel).
    delivered: HashSet<String>,
    /// Request ids of the legitimate check's messages.
    legit: HashSet<String>,
    violations: Vec<String>,
    refused: HashMap<&'static str, u64>,
    /// Totals over the run, for the progress line: how deep the inputs get.
    joins: u64,
    messages: u64,
}

/// A [`ControlHandler`] that records every callback and checks the trait's contract.
struct Recorder {
    signed: bool,
    record: Mutex<Record>,
    refuse_joins: AtomicBool,
    unhealthy: AtomicBool,
}

impl Recorder {
    fn new(signed: bool) -> Self {
        Self {
            signed,
            record: Mutex::default(),
            refuse_joins: AtomicBool::new(false),
            unhealthy: AtomicBool::new(false),
        }
    }

    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Back to a handler that accepts joins and is healthy.
    fn reset_flags(&self) {
        // Relaxed: the flags are read by connection threads as hints; nothing is published.
        self.refuse_joins.store(false, Ordering::Relaxed);
        self.unhealthy.store(false, Ordering::Relaxed);
    }

    /// Forgets what concerned only the input that ended.
    fn reset_input(&self) {
        let mut record = self.record();
        record.joined_addrs.clear();
        record.delivered.clear();
    }
}

/// The unique id and the strings of a message, for the forgery and replay checks.
fn identity(message: &Message) -> (Option<String>, Vec<&str>) {
    match message {
        Message::Register(m) => {
            (Some(m.request_id.clone()), vec![&m.transfer_key, &m.request_id, &m.engine_id])
        }
        Message::Cancel(m) => (Some(m.request_id.clone()), vec![&m.transfer_key, &m.request_id]),
        Message::CancelAck(m) => (Some(m.request_id.clone()), vec![&m.transfer_key, &m.request_id]),
        Message::Fail(m) => (Some(m.request_id.clone()), vec![&m.transfer_key, &m.detail]),
        Message::Error(m) => (Some(m.detail.clone()), vec![&m.code, &m.detail]),
        Message::Done(m) => (Some(m.request_id.clone()), vec![&m.transfer_key]),
        Message::Hello(m) => (None, vec![&m.engine_id]),
        Message::Heartbeat(m) => (None, vec![&m.engine_id]),
        Message::Attach(_) => (None, Vec::new()),
    }
}

impl ControlHandler for Recorder {
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
        let mut record = self.record();
        if record.live.insert(peer.id, peer.addr).is_some() {
            record.violations.push(format!("peer_joined twice for peer {}", peer.id));
        }
        // Relaxed: see `reset_input`.
        if self.refuse_joins.load(Ordering::Relaxed) {
            record.live.remove(&peer.id);
            return Err("the fuzz script refuses joins".into());
        }
        record.joined_addrs.push(peer.addr);
        record.joins += 1;
        Ok(())
    }

    fn message(&self, peer: PeerId, message: Message) {
        let mut record = self.record();
        if !record.live.contains_key(&peer) {
            record.violations.push(format!("message for peer {peer}, which is not joined"));
        }
        if matches!(
            message,
            Message::Hello(_) | Message::Done(_) | Message::Attach(_) | Message::Heartbeat(_)
        ) {
            record.violations.push(format!("a `{}` reached the handler", message.kind()));
        }
        record.messages += 1;
        let (id, strings) = identity(&message);
        if let Some(legit) = id.as_ref().filter(|id| id.starts_with("legit-")) {
            record.legit.insert(legit.clone());
        }
        if self.signed {
            if strings.iter().any(|s| s.starts_with(FORGED)) {
                record.violations.push(format!("a forged frame was delivered: {message:?}"));
            }
            if let Some(id) = id {
                if !record.delivered.insert(id.clone()) {
                    record.violations.push(format!("delivered twice to peer {peer}: {id}"));
                }
            }
        }
    }

    fn peer_lost(&self, peer: PeerId, reason: &str) {
        let mut record = self.record();
        if record.live.remove(&peer).is_none() {
            record
                .violations
                .push(format!("peer_lost for peer {peer}, which is not joined ({reason})"));
        }
    }

    fn refused(&self, _: Option<PeerId>, error: &ProtocolError) {
        *self.record().refused.entry(error.code()).or_default() += 1;
    }

    fn healthy(&self) -> Result<(), Refusal> {
        // Relaxed: see `reset_input`.
        if self.unhealthy.load(Ordering::Relaxed) {
            return Err("the fuzz script made this side unhealthy".into());
        }
        Ok(())
    }

    fn pending(&self, peer: PeerId) -> u32 {
        u32::try_from(peer % 7).unwrap_or(0)
    }
}

// ------------------------------------------------------------------------------------------
// The process-wide harness: servers, legitimate clients, pools, panic record.

struct Server {
    channel: SideChannel,
    recorder: Arc<Recorder>,
    /// A second channel whose `connect` is the legitimate peer.
    client: SideChannel,
    client_recorder: Arc<Recorder>,
    secret: Option<Secret>,
    started: Instant,
    /// Connected sockets the server has (most likely) accepted already.
    pool: Vec<(TcpStream, Instant)>,
}

struct Harness {
    servers: [Server; 2],
    inputs: u64,
    /// Makes every message's id unique, for the replay check.
    next_uid: u64,
    rss_limit_kb: u64,
    max_drain: Duration,
}

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HARNESS: OnceLock<Mutex<Harness>> = OnceLock::new();

fn start_server(signed: bool) -> Server {
    let secret = signed.then(|| secret(0x5a));
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let name = if signed { "fuzz-p-signed" } else { "fuzz-p-trusted" };
    let mut config = SideChannelConfig::new(loopback, name);
    config.secret = secret.clone();
    config.limits = limits();
    config.heartbeat_interval = HEARTBEAT;
    config.peer_timeout = PEER_TIMEOUT;
    config.connect_timeout = CONNECT_TIMEOUT;
    config.write_timeout = WRITE_TIMEOUT;
    config.max_connections = 16;
    config.max_connections_per_host = 12;
    // Reachable with the connections one input opens.
    config.max_handshakes = 6;
    config.handshake_frame_bytes = 16 << 10;
    let recorder = Arc::new(Recorder::new(signed));
    let channel = SideChannel::start(config, server_hello(name), recorder.clone())
        .expect("the fuzzed side channel starts on 127.0.0.1:0");

    let client_name = if signed { "fuzz-d-signed" } else { "fuzz-d-trusted" };
    let mut client_config = SideChannelConfig::new(loopback, client_name);
    client_config.secret = secret.clone();
    client_config.heartbeat_interval = HEARTBEAT;
    client_config.peer_timeout = PEER_TIMEOUT;
    // Generous: the legitimate check must not fail because a shared machine is busy.
    client_config.connect_timeout = Duration::from_secs(2);
    let client_recorder = Arc::new(Recorder::new(signed));
    let client =
        SideChannel::start(client_config, server_hello(client_name), client_recorder.clone())
            .expect("the legitimate client starts on 127.0.0.1:0");
    Server {
        channel,
        recorder,
        client,
        client_recorder,
        secret,
        started: Instant::now(),
        pool: Vec::new(),
    }
}

fn harness() -> MutexGuard<'static, Harness> {
    let harness = HARNESS.get_or_init(|| {
        kvpush_fuzz::ignore_sigpipe();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = thread::current().name().unwrap_or("<unnamed>").to_owned();
            if let Ok(mut panics) = PANICS.lock() {
                panics.push(format!("thread {thread}: {info}"));
            }
            eprintln!("side_channel fuzz: panic in thread {thread}: {info}");
            // libFuzzer's hook: aborts, so the input is saved with the panicking thread's stack.
            previous(info);
        }));
        let rss_limit_mb = std::env::var("FUZZ_RSS_LIMIT_MB")
            .ok()
            .and_then(|mb| mb.parse::<u64>().ok())
            .unwrap_or(512);
        Mutex::new(Harness {
            servers: [start_server(true), start_server(false)],
            inputs: 0,
            next_uid: 0,
            rss_limit_kb: rss_limit_mb * 1024,
            max_drain: Duration::ZERO,
        })
    });
    harness.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Connections the server holds, handshakes included. Only its `Debug` says; parsed here.
fn live_connections(channel: &SideChannel) -> usize {
    let debug = format!("{channel:?}");
    debug
        .split("connections: ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no connection count in the channel's Debug: {debug}"))
}

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Waits up to `bound` for `done`; returns how long it took, or `None`.
fn wait_until(bound: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if done() {
            return Some(start.elapsed());
        }
        if start.elapsed() >= bound {
            return None;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Closes with a reset rather than a FIN: what a crashed peer looks like.
fn reset(socket: &TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: `linger` outlives the call and its size is passed; the descriptor is open.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

impl Server {
    fn connect(&mut self, fresh: bool) -> Option<TcpStream> {
        if !fresh {
            while let Some((socket, born)) = self.pool.pop() {
                if born.elapsed() < POOL_MAX_AGE {
                    return Some(socket);
                }
            }
        }
        TcpStream::connect(self.channel.local_addr()).ok()
    }

    fn refill_pool(&mut self) {
        self.pool.retain(|(_, born)| born.elapsed() < POOL_MAX_AGE);
        while self.pool.len() < POOL {
            let Ok(socket) = TcpStream::connect(self.channel.local_addr()) else { break };
            self.pool.push((socket, Instant::now()));
        }
    }

    /// Drops every connection, waits for the server to hold none, then connects the
    /// legitimate client, sends one message and disconnects.
    fn legit_check(&mut self, uid: u64, violations: &mut Vec<String>) {
        self.pool.clear();
        let channel = &self.channel;
        if wait_until(DRAIN_BOUND * 2, || {
            live_connections(channel) == 0 && channel.peers().is_empty()
        })
        .is_none()
        {
            violations.push(format!(
                "with no socket of ours open, the server still holds {} connections and peers \
                 {:?}",
                live_connections(channel),
                channel.peers()
            ));
            return;
        }
        let addr = channel.local_addr().to_string();
        // A busy shared machine can make one handshake miss the server's 300 ms; three in a
        // row cannot be load.
        let mut last_error = None;
        let mut joined = None;
        for _ in 0..3 {
            match self.client.connect(&addr) {
                Ok(peer) => {
                    joined = Some(peer);
                    break;
                }
                Err(error) => last_error = Some(error.to_string()),
            }
        }
        let Some(peer) = joined else {
            violations.push(format!("a legitimate connect failed three times: {last_error:?}"));
            return;
        };
        if !peer.hello.engine_id.starts_with("fuzz-p-") || peer.hello.compatibility != COMPATIBILITY
        {
            violations.push(format!("the legitimate connect joined the wrong hello: {peer:?}"));
        }
        let request_id = format!("legit-{uid}");
        let cancel = Message::Cancel(Cancel {
            transfer_key: "legit-xfer".into(),
            request_id: request_id.clone(),
            epoch: 1,
        });
        if let Err(error) = self.client.send(peer.id, &cancel) {
            violations.push(format!("the legitimate client could not send: {error}"));
        }
        let recorder = &self.recorder;
        if wait_until(DRAIN_BOUND, || recorder.record().legit.remove(&request_id)).is_none() {
            violations.push("the legitimate client's cancel never reached the handler".into());
        }
        self.client.disconnect(peer.id);
        let client = &self.client;
        if wait_until(DRAIN_BOUND, || {
            live_connections(channel) == 0
                && channel.peers().is_empty()
                && client.peers().is_empty()
        })
        .is_none()
        {
            violations.push(format!(
                "after the legitimate client disconnected the server still holds {} \
                 connections, peers {:?}",
                live_connections(channel),
                channel.peers()
            ));
        }
    }
}

// ------------------------------------------------------------------------------------------
// The script.

#[derive(Arbitrary, Debug)]
struct Script {
    signed: bool,
    /// Connections that do a whole, valid handshake before the actions (0 to 2), so that short
    /// inputs start past it.
    joined: u8,
    actions: Vec<Action>,
}

#[derive(Arbitrary, Debug)]
enum Action {
    /// Another connection: from the pool (already accepted), or a fresh one.
    Open {
        fresh: bool,
    },
    /// A whole connector handshake: a valid Hello, then an Attach with `echo` once the server's
    /// Hello arrived, reading the welcome.
    Join {
        conn: u8,
        nonce: u64,
        echo: Echo,
        metadata_len: u16,
    },
    /// One frame built from fuzz data.
    Send {
        conn: u8,
        body: Body,
        signing: Signing,
        stamp: Stamp,
        split: Option<(u16, u8)>,
    },
    /// An envelope put together by hand: any version, kind and body.
    Envelope {
        conn: u8,
        envelope: RawEnvelope,
    },
    Raw {
        conn: u8,
        bytes: Vec<u8>,
    },
    /// A length prefix and `filler` bytes of the announced body.
    Prefix {
        conn: u8,
        len: u32,
        filler: u16,
    },
    /// An earlier frame of this input, again, on any connection.
    Replay {
        conn: u8,
        frame: u8,
    },
    /// An earlier frame with one byte changed.
    Tamper {
        conn: u8,
        frame: u8,
        at: u16,
        xor: u8,
    },
    /// A new encoder (session) for the connection's right-secret frames.
    NewSession {
        conn: u8,
        sender: u8,
    },
    Read {
        conn: u8,
        ms: u8,
    },
    Wait {
        ms: u8,
    },
    HalfClose {
        conn: u8,
    },
    Close {
        conn: u8,
        reset: bool,
    },
    /// The server sends to the peer joined on `conn`.
    ServerSend {
        conn: u8,
        body: Body,
    },
    ServerDisconnect {
        conn: u8,
    },
    /// The server's handler refuses joins / reports unhealthy, for the rest of the input.
    RefuseJoins,
    Unhealthy,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Signing {
    Right,
    Wrong,
    Unsigned,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Stamp {
    Now,
    /// Milliseconds.
    Behind(u16),
    Ahead(u16),
    Raw(u64),
}

impl Stamp {
    fn ms(self) -> u64 {
        let now = unix_millis();
        match self {
            Self::Now => now,
            Self::Behind(ms) => now.saturating_sub(u64::from(ms)),
            Self::Ahead(ms) => now.saturating_add(u64::from(ms)),
            Self::Raw(ms) => ms,
        }
    }
}

/// A challenge answer: the server's nonce on this connection, on another one, or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Echo {
    Right,
    OtherConnection(u8),
    Value(u64),
}

/// A heartbeat's `echo_ms`: the server clock we saw last, or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum ClockEcho {
    Seen,
    Value(u64),
}

// In the enums below the first variant is the valid, common case: `arbitrary` picks it when the
// input runs out, so short inputs still get their frames past the checks.

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Text {
    Short(u8),
    Empty,
    Long,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Compat {
    Ours,
    Other,
    Long,
}

#[derive(Arbitrary, Debug, Clone)]
enum Versions {
    Ours,
    Others(Vec<u16>),
    Empty,
    Many,
}

#[derive(Arbitrary, Debug, Clone)]
struct HelloSpec {
    engine: Text,
    agent: Text,
    compat: Compat,
    versions: Versions,
    tp: (u8, u8),
    pp: (u8, u8),
    nonce: u64,
    echo: u64,
    metadata_len: u8,
    regions: u8,
    hnd: bool,
    vram: Option<u8>,
    horizon_ms: u64,
}

#[derive(Arbitrary, Debug, Clone)]
struct GroupSpec {
    first_token: u16,
    start: u32,
    count: u16,
}

#[derive(Arbitrary, Debug, Clone)]
enum Body {
    Cancel {
        key: Text,
        epoch: u64,
    },
    Register {
        key: Text,
        epoch: u64,
        engine: Text,
        address: Text,
        tp: (u8, u8),
        groups: Vec<GroupSpec>,
        num_tokens: u64,
        ttl_ms: u64,
        nonce: u64,
    },
    CancelAck {
        key: Text,
        epoch: u64,
        wrote: bool,
    },
    Fail {
        key: Text,
        epoch: u64,
        reason: u8,
        detail: Text,
    },
    Done {
        key: Text,
        epoch: u64,
        tp: (u8, u8),
        bytes: u64,
        runs: u32,
        nonce: u64,
    },
    Heartbeat {
        engine: Text,
        seq: u64,
        pending: u32,
        clock_ms: u64,
        echo: ClockEcho,
    },
    Error {
        code: Text,
        detail: Text,
    },
    Hello(HelloSpec),
    Attach {
        echo: Echo,
        metadata_len: u16,
    },
}

#[derive(Arbitrary, Debug, Clone)]
enum RawKind {
    Known(u8),
    Other(String),
}

#[derive(Arbitrary, Debug, Clone)]
struct RawEnvelope {
    version: u8,
    kind: RawKind,
    sender: Text,
    session: u64,
    seq: u64,
    stamp: Stamp,
    /// A body built from `Body` (kept whole or cut at `cut`), or these bytes.
    body: Result<(Body, Option<u16>), Vec<u8>>,
    mac: Option<Vec<u8>>,
}

/// The envelope as docs/protocol.md lays it out (a named msgpack map), for hand-built frames.
#[derive(Serialize)]
struct WireEnvelope<'a> {
    version: u16,
    kind: &'a str,
    sender: &'a str,
    session: u64,
    seq: u64,
    ts_ms: u64,
    #[serde(with = "serde_bytes")]
    body: &'a [u8],
    #[serde(with = "serde_bytes", skip_serializing_if = "Option::is_none")]
    mac: Option<&'a [u8]>,
}

// ------------------------------------------------------------------------------------------
// Running a script.

/// One scripted TCP connection and what we learnt from the server on it.
struct Conn {
    socket: TcpStream,
    local: Option<SocketAddr>,
    right: Encoder,
    wrong: Encoder,
    unsigned: Encoder,
    /// Checks the server's frames: signed with its secret, when it has one.
    checker: Decoder,
    rx: Vec<u8>,
    server_nonce: Option<u64>,
    server_clock: u64,
    /// We sent a right-signed Attach that echoes `server_nonce`.
    valid_attach: bool,
    /// The server's welcome (its first Attach or heartbeat) arrived.
    welcomed: bool,
    read_closed: bool,
}

struct Run<'a> {
    server: &'a mut Server,
    conns: Vec<Conn>,
    /// Nonces of every Hello we sent signed with the right secret (signed server).
    hello_nonces: HashSet<u64>,
    frames: Vec<Vec<u8>>,
    budget: Duration,
    next_uid: &'a mut u64,
    violations: Vec<String>,
}

fn text(spec: Text, base: &str) -> String {
    match spec {
        Text::Empty => String::new(),
        Text::Short(n) => format!("{base}-{n}"),
        Text::Long => format!("{base}-{}", "x".repeat(LONG)),
    }
}

fn known_kind(n: u8) -> &'static str {
    Message::KINDS[usize::from(n) % Message::KINDS.len()]
}

impl Run<'_> {
    fn uid(&mut self) -> u64 {
        *self.next_uid += 1;
        *self.next_uid
    }

    /// Sleeps for at most `ms`, within what is left of the input's wait budget.
    fn nap(&mut self, ms: u64) {
        let nap = Duration::from_millis(ms).min(self.budget);
        self.budget -= nap;
        if !nap.is_zero() {
            thread::sleep(nap);
        }
    }

    fn open(&mut self, fresh: bool) -> bool {
        if self.conns.len() >= MAX_CONNECTIONS {
            return false;
        }
        let Some(socket) = self.server.connect(fresh) else {
            return false;
        };
        let _ = socket.set_nodelay(true);
        let _ = socket.set_write_timeout(Some(Duration::from_millis(20)));
        let secret = self.server.secret.clone();
        let sender = "fuzz-peer";
        self.conns.push(Conn {
            local: socket.local_addr().ok(),
            socket,
            right: Encoder::new(sender, secret.clone()),
            wrong: Encoder::new(sender, Some(self::secret(0xa5))),
            unsigned: Encoder::new(sender, None),
            checker: Decoder::new(secret, Limits::default()),
            rx: Vec::new(),
            server_nonce: None,
            server_clock: 0,
            valid_attach: false,
            welcomed: false,
            read_closed: false,
        });
        true
    }

    /// The connection `conn` names, opening one if none is open.
    fn conn(&mut self, conn: u8) -> Option<usize> {
        if self.conns.is_empty() && !self.open(false) {
            return None;
        }
        Some(usize::from(conn) % self.conns.len())
    }

    fn write(&mut self, index: usize, bytes: &[u8]) {
        // The server may have closed the connection: a failed write is part of the game.
        let _ = (&self.conns[index].socket).write_all(bytes);
    }

    fn remember(&mut self, frame: &[u8]) {
        if self.frames.len() < 64 && frame.len() <= 64 << 10 {
            self.frames.push(frame.to_vec());
        }
    }

    fn echo(&self, index: usize, echo: Echo) -> u64 {
        match echo {
            Echo::Right => self.conns[index].server_nonce.unwrap_or(0),
            Echo::OtherConnection(other) => {
                let other = usize::from(other) % self.conns.len();
                self.conns[other].server_nonce.unwrap_or(0)
            }
            Echo::Value(value) => value,
        }
    }

    fn hello(&self, spec: &HelloSpec) -> Hello {
        let versions = match &spec.versions {
            Versions::Ours => vec![1],
            Versions::Others(versions) => versions.iter().take(80).copied().collect(),
            Versions::Empty => Vec::new(),
            Versions::Many => (1..=65).collect(),
        };
        let (tp_rank, tp_size) = (u32::from(spec.tp.0), u32::from(spec.tp.1));
        Hello {
            engine_id: text(spec.engine, "fuzz-d"),
            tp_rank,
            tp_size,
            pp_rank: u32::from(spec.pp.0),
            pp_size: u32::from(spec.pp.1),
            agent_name: text(spec.agent, "fuzz-d-agent"),
            agent_metadata: vec![7; usize::from(spec.metadata_len)],
            layout: KvLayout {
                regions: (0..u64::from(spec.regions % 9))
                    .map(|i| Region {
                        base: 0x1000 * (i + 1),
                        block_stride: 4096,
                        num_blocks: 64,
                        group: 0,
                    })
                    .collect(),
                block_tokens: 16,
                kernel_block_tokens: 16,
                heads: 4,
                head_bytes: 64,
                token_order: if spec.hnd { TokenOrder::Hnd } else { TokenOrder::Nhd },
                tp_rank,
                tp_size,
            },
            compatibility: match spec.compat {
                Compat::Ours => COMPATIBILITY.into(),
                Compat::Other => "other-model/fp8".into(),
                Compat::Long => "c".repeat(LONG),
            },
            versions,
            memory: match spec.vram {
                None => MemorySpace::DRAM,
                Some(device) => MemorySpace { kind: MemoryKind::Vram, device: device.into() },
            },
            nonce: spec.nonce,
            echo: spec.echo,
            write_horizon_ms: spec.horizon_ms,
            delivery_bound_ms: 0,
        }
    }

    /// The message `body` describes. `marker` starts every string the forgery check looks at
    /// (empty for frames the server may accept).
    fn message(&mut self, index: usize, body: &Body, marker: &str) -> Message {
        let uid = self.uid();
        let key = |spec: Text| match spec {
            Text::Empty => String::new(),
            spec => format!("{marker}{}", text(spec, "xfer")),
        };
        // Unique per frame, so that a delivery twice is a replay, not a repeat.
        let request_id = format!("{marker}req-{uid}");
        match body {
            Body::Register {
                key: k,
                epoch,
                engine,
                address,
                tp,
                groups,
                num_tokens,
                ttl_ms,
                nonce,
            } => Message::Register(Register {
                transfer_key: key(*k),
                request_id,
                epoch: *epoch,
                engine_id: format!("{marker}{}", text(*engine, "fuzz-d")),
                address: text(*address, "127.0.0.1:5600"),
                tp_rank: u32::from(tp.0),
                tp_size: u32::from(tp.1),
                groups: groups
                    .iter()
                    .take(4)
                    .map(|g| BlockGroup {
                        first_token: u64::from(g.first_token),
                        block_ids: (0..u32::from(g.count % 8192))
                            .map(|i| g.start.wrapping_add(i))
                            .collect(),
                    })
                    .collect(),
                num_tokens: *num_tokens,
                ttl_ms: *ttl_ms,
                fanout: 1,
                nonce: *nonce,
            }),
            Body::Cancel { key: k, epoch } => {
                Message::Cancel(Cancel { transfer_key: key(*k), request_id, epoch: *epoch })
            }
            Body::CancelAck { key: k, epoch, wrote } => Message::CancelAck(CancelAck {
                transfer_key: key(*k),
                request_id,
                epoch: *epoch,
                wrote: *wrote,
                delivered: false,
            }),
            Body::Fail { key: k, epoch, reason, detail } => Message::Fail(Fail {
                transfer_key: key(*k),
                request_id: request_id.clone(),
                epoch: *epoch,
                reason: FailReason::KNOWN
                    .get(usize::from(*reason))
                    .cloned()
                    .unwrap_or_else(|| FailReason::Unknown(format!("reason-{reason}"))),
                detail: format!("{request_id}{}", text(*detail, "")),
            }),
            Body::Done { key: k, epoch, tp, bytes, runs, nonce } => Message::Done(Done {
                transfer_key: key(*k),
                request_id,
                epoch: *epoch,
                tp_rank: u32::from(tp.0),
                tp_size: u32::from(tp.1),
                bytes: *bytes,
                runs: *runs,
                nonce: *nonce,
            }),
            Body::Heartbeat { engine, seq, pending, clock_ms, echo } => {
                Message::Heartbeat(Heartbeat {
                    engine_id: text(*engine, "fuzz-d"),
                    seq: *seq,
                    pending: *pending,
                    clock_ms: *clock_ms,
                    echo_ms: match echo {
                        ClockEcho::Seen => self.conns[index].server_clock,
                        ClockEcho::Value(value) => *value,
                    },
                })
            }
            Body::Error { code, detail } => Message::Error(ErrorReply {
                code: format!("{marker}{}", text(*code, "code")),
                detail: format!("{request_id}{}", text(*detail, "")),
            }),
            Body::Hello(spec) => Message::Hello(self.hello(spec)),
            Body::Attach { echo, metadata_len } => Message::Attach(Attach {
                echo: self.echo(index, *echo),
                agent_metadata: vec![7; usize::from(*metadata_len)],
            }),
        }
    }

    /// Encodes and sends `message`, noting what the handshake checks need to know.
    fn send_message(&mut self, index: usize, message: &Message, signing: Signing, ts_ms: u64) {
        let frame = self.frame(index, message, signing, ts_ms);
        self.write(index, &frame);
    }

    fn frame(&mut self, index: usize, message: &Message, signing: Signing, ts_ms: u64) -> Vec<u8> {
        let signed = self.server.secret.is_some();
        let conn = &mut self.conns[index];
        let encoder = match signing {
            Signing::Right => &conn.right,
            Signing::Wrong => &conn.wrong,
            Signing::Unsigned => &conn.unsigned,
        };
        let frame = encoder.encode(message, ts_ms);
        let authentic = matches!(signing, Signing::Right) || !signed;
        if authentic {
            match message {
                Message::Hello(hello) => {
                    self.hello_nonces.insert(hello.nonce);
                }
                Message::Attach(attach) if Some(attach.echo) == conn.server_nonce => {
                    conn.valid_attach = true;
                }
                _ => {}
            }
        }
        self.remember(&frame);
        frame
    }

    /// Reads what the server sent within `wait` (or the budget), checking every whole frame;
    /// stops early once `until` holds for a frame.
    fn read(&mut self, index: usize, wait: Duration, until: impl Fn(&Message) -> bool) -> bool {
        let wait = wait.min(self.budget);
        let start = Instant::now();
        let mut buf = [0_u8; 16 << 10];
        let mut found = false;
        loop {
            let conn = &mut self.conns[index];
            if conn.read_closed {
                break;
            }
            let left = wait.saturating_sub(start.elapsed());
            let _ = conn.socket.set_read_timeout(Some(left.max(Duration::from_micros(200))));
            match (&conn.socket).read(&mut buf) {
                Ok(0) => conn.read_closed = true,
                Ok(n) => conn.rx.extend_from_slice(&buf[..n]),
                Err(error)
                    if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(_) => conn.read_closed = true,
            }
            found |= self.check_frames(index, &until);
            if found || start.elapsed() >= wait {
                break;
            }
        }
        self.budget = self.budget.saturating_sub(start.elapsed());
        found
    }

    /// Takes every whole frame out of the connection's receive buffer and checks it.
    fn check_frames(&mut self, index: usize, until: &impl Fn(&Message) -> bool) -> bool {
        let signed = self.server.secret.is_some();
        let mut found = false;
        loop {
            let conn = &mut self.conns[index];
            let len = match frame_len(&conn.rx, &Limits::default()) {
                Ok(Some(len)) if conn.rx.len() >= len => len,
                Ok(_) => return found,
                Err(error) => {
                    self.violations.push(format!("the server sent a bad length prefix: {error}"));
                    conn.rx.clear();
                    return found;
                }
            };
            let frame: Vec<u8> = conn.rx.drain(..len).collect();
            let message = match conn.checker.decode(&frame, unix_millis()) {
                Ok(envelope) => envelope.message,
                Err(error) => {
                    self.violations
                        .push(format!("the server sent a frame that does not decode: {error}"));
                    continue;
                }
            };
            match &message {
                Message::Hello(hello) => {
                    if !hello.agent_metadata.is_empty() {
                        self.violations.push("the server's hello carries agent metadata".into());
                    }
                    if signed && !self.hello_nonces.contains(&hello.echo) {
                        self.violations.push(format!(
                            "the server's hello echoes {}, a challenge we never posed",
                            hello.echo
                        ));
                    }
                    conn.server_nonce = Some(hello.nonce);
                }
                // The welcome (an Attach with the server's agent metadata, or a heartbeat from
                // builds that welcome with one) and every heartbeat come only after a join.
                Message::Attach(_) | Message::Heartbeat(_) => {
                    if signed && !conn.valid_attach {
                        self.violations.push(format!(
                            "the server sent a `{}` without a valid attach from us",
                            message.kind()
                        ));
                    }
                    // Only the welcome answers our Hello; a later Attach is the server's
                    // application calling `send` with one (which `send` lets through).
                    if let (Message::Attach(attach), false) = (&message, conn.welcomed) {
                        if signed && !self.hello_nonces.contains(&attach.echo) {
                            self.violations.push(format!(
                                "the server's attach echoes {}, a challenge we never posed",
                                attach.echo
                            ));
                        }
                    }
                    if let Message::Heartbeat(heartbeat) = &message {
                        conn.server_clock = conn.server_clock.max(heartbeat.clock_ms);
                    }
                    conn.welcomed = true;
                }
                _ => {}
            }
            found |= until(&message);
        }
    }

    fn server_peer(&self, index: usize) -> Option<PeerInfo> {
        let local = self.conns[index].local?;
        self.server.channel.peers().into_iter().find(|peer| peer.addr == local)
    }

    /// A connector's handshake on connection `index`: our Hello, the server's, our Attach
    /// answering it with `echo`, and the server's welcome.
    fn join(&mut self, index: usize, nonce: u64, echo: Echo, metadata_len: u16) {
        let hello = Hello { nonce, ..server_hello("fuzz-d") };
        self.send_message(index, &Message::Hello(hello), Signing::Right, unix_millis());
        let answered = |m: &Message| matches!(m, Message::Hello(_) | Message::Error(_));
        // Bounded by the budget: this wait may include the server's accept poll.
        if !self.read(index, Duration::from_millis(60), answered) {
            return;
        }
        let attach = Message::Attach(Attach {
            echo: self.echo(index, echo),
            agent_metadata: vec![7; usize::from(metadata_len)],
        });
        self.send_message(index, &attach, Signing::Right, unix_millis());
        let welcomed = |m: &Message| {
            matches!(m, Message::Attach(_) | Message::Heartbeat(_) | Message::Error(_))
        };
        self.read(index, Duration::from_millis(15), welcomed);
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::Open { fresh } => {
                self.open(*fresh);
            }
            Action::Join { conn, nonce, echo, metadata_len } => {
                let Some(i) = self.conn(*conn) else { return };
                self.join(i, *nonce, *echo, *metadata_len);
            }
            Action::Send { conn, body, signing, stamp, split } => {
                let Some(i) = self.conn(*conn) else { return };
                let forged = self.server.secret.is_some() && !matches!(signing, Signing::Right);
                let message = self.message(i, body, if forged { FORGED } else { "" });
                let frame = self.frame(i, &message, *signing, stamp.ms());
                match split {
                    Some((at, pause_ms)) if !frame.is_empty() => {
                        let at = usize::from(*at) % frame.len();
                        self.write(i, &frame[..at]);
                        self.nap(u64::from(*pause_ms % 20));
                        self.write(i, &frame[at..]);
                    }
                    _ => self.write(i, &frame),
                }
            }
            Action::Envelope { conn, envelope } => {
                let Some(i) = self.conn(*conn) else { return };
                // Hand-built frames carry no valid MAC: for the signed server they are forged.
                let marker = if self.server.secret.is_some() { FORGED } else { "" };
                let (kind, body) = match &envelope.body {
                    Ok((body, cut)) => {
                        let message = self.message(i, body, marker);
                        let mut bytes = body_bytes(&message).unwrap_or_default();
                        if let Some(cut) = cut {
                            bytes.truncate(usize::from(*cut));
                        }
                        (message.kind().to_owned(), bytes)
                    }
                    Err(bytes) => (String::new(), bytes.clone()),
                };
                let kind = match &envelope.kind {
                    RawKind::Known(_) if !kind.is_empty() => kind,
                    RawKind::Known(n) => known_kind(*n).to_owned(),
                    RawKind::Other(other) => other.clone(),
                };
                let wire = WireEnvelope {
                    version: u16::from(envelope.version),
                    kind: &kind,
                    sender: &text(envelope.sender, "fuzz-peer"),
                    session: envelope.session,
                    seq: envelope.seq,
                    ts_ms: envelope.stamp.ms(),
                    body: &body,
                    mac: envelope.mac.as_deref(),
                };
                let mut frame = vec![0; 4];
                if rmp_serde::encode::write_named(&mut frame, &wire).is_ok() {
                    let len = u32::try_from(frame.len() - 4).unwrap_or(u32::MAX);
                    frame[..4].copy_from_slice(&len.to_be_bytes());
                    self.remember(&frame);
                    self.write(i, &frame);
                }
            }
            Action::Raw { conn, bytes } => {
                let Some(i) = self.conn(*conn) else { return };
                self.write(i, bytes);
            }
            Action::Prefix { conn, len, filler } => {
                let Some(i) = self.conn(*conn) else { return };
                let mut bytes = len.to_be_bytes().to_vec();
                bytes.resize(4 + usize::from(*filler), 0xc1);
                self.write(i, &bytes);
            }
            Action::Replay { conn, frame } => {
                let Some(i) = self.conn(*conn) else { return };
                if let Some(frame) = self.frames.get(usize::from(*frame) % self.frames.len().max(1))
                {
                    let frame = frame.clone();
                    self.write(i, &frame);
                }
            }
            Action::Tamper { conn, frame, at, xor } => {
                let Some(i) = self.conn(*conn) else { return };
                if let Some(frame) = self.frames.get(usize::from(*frame) % self.frames.len().max(1))
                {
                    let mut frame = frame.clone();
                    let at = usize::from(*at) % frame.len().max(1);
                    if let Some(byte) = frame.get_mut(at) {
                        *byte ^= (*xor).max(1);
                    }
                    self.write(i, &frame);
                }
            }
            Action::NewSession { conn, sender } => {
                let Some(i) = self.conn(*conn) else { return };
                let secret = self.server.secret.clone();
                self.conns[i].right = Encoder::new(format!("fuzz-peer-{}", sender % 4), secret);
            }
            Action::Read { conn, ms } => {
                let Some(i) = self.conn(*conn) else { return };
                self.read(i, Duration::from_millis(u64::from(ms % 16)), |_| false);
            }
            Action::Wait { ms } => self.nap(u64::from(ms % 16)),
            Action::HalfClose { conn } => {
                let Some(i) = self.conn(*conn) else { return };
                let _ = self.conns[i].socket.shutdown(Shutdown::Write);
            }
            Action::Close { conn, reset: hard } => {
                let Some(i) = self.conn(*conn) else { return };
                let conn = self.conns.swap_remove(i);
                if *hard {
                    reset(&conn.socket);
                }
            }
            Action::ServerSend { conn, body } => {
                let Some(i) = self.conn(*conn) else { return };
                let Some(peer) = self.server_peer(i) else { return };
                let message = self.message(i, body, "");
                let sent = self.server.channel.send(peer.id, &message);
                if sent.is_ok() && matches!(message, Message::Hello(_) | Message::Done(_)) {
                    self.violations.push(format!("the server sent a `{}`", message.kind()));
                }
            }
            Action::ServerDisconnect { conn } => {
                let Some(i) = self.conn(*conn) else { return };
                if let Some(peer) = self.server_peer(i) {
                    self.server.channel.disconnect(peer.id);
                }
            }
            Action::RefuseJoins => self.server.recorder.refuse_joins.store(true, Ordering::Relaxed),
            Action::Unhealthy => self.server.recorder.unhealthy.store(true, Ordering::Relaxed),
        }
    }

    /// What holds of the server's API after the script, before the sockets close.
    fn check_api(&mut self) {
        let uptime = self.server.started.elapsed();
        for peer in self.server.channel.peers() {
            if let Some(age) = self.server.channel.proof_age(peer.id) {
                if age > uptime + Duration::from_millis(5) {
                    self.violations.push(format!(
                        "peer {} proven {age:?} ago, before the server started {uptime:?} ago",
                        peer.id
                    ));
                }
            }
        }
    }
}

/// The envelope body of `message`: its struct alone as a named msgpack map.
fn body_bytes(message: &Message) -> Option<Vec<u8>> {
    match message {
        Message::Hello(m) => rmp_serde::to_vec_named(m),
        Message::Register(m) => rmp_serde::to_vec_named(m),
        Message::Done(m) => rmp_serde::to_vec_named(m),
        Message::Fail(m) => rmp_serde::to_vec_named(m),
        Message::Cancel(m) => rmp_serde::to_vec_named(m),
        Message::CancelAck(m) => rmp_serde::to_vec_named(m),
        Message::Heartbeat(m) => rmp_serde::to_vec_named(m),
        Message::Error(m) => rmp_serde::to_vec_named(m),
        Message::Attach(m) => rmp_serde::to_vec_named(m),
    }
    .ok()
}

fuzz_target!(|script: Script| {
    let mut harness = harness();
    let harness = &mut *harness;
    harness.inputs += 1;
    let this = usize::from(!script.signed);
    let (mut violations, our_sockets) = {
        let mut run = Run {
            server: &mut harness.servers[this],
            conns: Vec::new(),
            hello_nonces: HashSet::new(),
            frames: Vec::new(),
            budget: WAIT_BUDGET,
            next_uid: &mut harness.next_uid,
            violations: Vec::new(),
        };
        for _ in 0..script.joined % 3 {
            if run.open(false) {
                // Its own budget: a connection the pool could not supply waits out the server's
                // accept poll first.
                run.budget = Duration::from_millis(100);
                let nonce = run.uid();
                run.join(run.conns.len() - 1, nonce, Echo::Right, 16);
            }
        }
        run.budget = WAIT_BUDGET;
        for action in script.actions.iter().take(MAX_ACTIONS) {
            run.act(action);
        }
        run.check_api();
        let ours: Vec<(SocketAddr, bool)> =
            run.conns.iter().filter_map(|c| c.local.map(|local| (local, c.valid_attach))).collect();
        // Every socket of the script goes (FIN, or RST where data was left unread).
        run.conns.clear();
        (std::mem::take(&mut run.violations), ours)
    };

    // The server must let go of each of them.
    let server = &mut harness.servers[this];
    let baseline = server.pool.len();
    let channel = &server.channel;
    match wait_until(DRAIN_BOUND, || live_connections(channel) <= baseline) {
        Some(took) => harness.max_drain = harness.max_drain.max(took),
        None => violations.push(format!(
            "{} connections still held {DRAIN_BOUND:?} after our sockets closed (baseline \
             {baseline})",
            live_connections(channel)
        )),
    }
    if server.recorder.signed {
        for addr in &server.recorder.record().joined_addrs {
            if our_sockets.iter().any(|(local, valid)| local == addr && !valid) {
                violations.push(format!("peer at {addr} joined without a valid attach"));
            }
        }
    }

    harness.servers[this].recorder.reset_flags();
    if harness.inputs % LEGIT_EVERY == 1 {
        harness.next_uid += 1;
        for server in &mut harness.servers {
            server.legit_check(harness.next_uid, &mut violations);
            server.refill_pool();
        }
        let [signed, trusted] = [&harness.servers[0], &harness.servers[1]].map(|server| {
            let record = server.recorder.record();
            format!(
                "{} joins, {} messages, refused {:?}",
                record.joins, record.messages, record.refused
            )
        });
        eprintln!(
            "side_channel fuzz: {} inputs, rss {} MiB, slowest drain {:?}; signed: {signed}; \
             trusted: {trusted}",
            harness.inputs,
            rss_kb() / 1024,
            harness.max_drain,
        );
    }
    for server in &harness.servers {
        for recorder in [&server.recorder, &server.client_recorder] {
            violations.append(&mut recorder.record().violations);
            recorder.reset_input();
        }
    }
    for server in &mut harness.servers {
        server.refill_pool();
    }

    let panics = PANICS.lock().map(|p| p.clone()).unwrap_or_default();
    assert!(panics.is_empty(), "threads panicked: {panics:#?}");
    let rss = rss_kb();
    assert!(
        rss <= harness.rss_limit_kb,
        "RSS {} MiB exceeds the {} MiB bound: something grows without limit",
        rss / 1024,
        harness.rss_limit_kb / 1024
    );
    assert!(violations.is_empty(), "side-channel invariants broken: {violations:#?}");
});

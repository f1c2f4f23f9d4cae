//! The side channel: each worker's TCP endpoint for kvpush/1 control messages.
//!
//! D connects to P (it learns P's `host:port` from the router) and the two exchange `hello`s;
//! from then on the connection is symmetric: D sends `register`, `cancel` and heartbeats, P sends
//! `fail`, `cancel_ack`, heartbeats and `error` replies. `done` never travels here: it is the
//! NIXL notification of the WRITE. `docs/protocol.md` (§1, §5 and "Side-channel connections")
//! is the normative description.
//!
//! This module owns the listening socket, the handshake (Hellos both ways, the version and
//! compatibility check, the handler's say), framing on the stream, heartbeats and silence
//! detection, error replies to refused frames, and the lifetime of every connection and thread.
//! What the messages mean is the [`ControlHandler`]'s business.
//!
//! Threads: `kvpush-side-accept` accepts connections; one thread per connection
//! (`kvpush-in-<peer id>` for an accepted one, `kvpush-out-<peer id>` for one this side made, so
//! that `top -H` tells P's connections from D's) does the accepting side's handshake, reads and
//! dispatches frames, sends heartbeats and notices silence. The handler is called from these
//! threads (and from the caller's thread in [`SideChannel::connect`]), never with a lock held.
//! Every blocking call has a timeout, and [`SideChannel::close`] stops and joins every thread.
//!
//! ```
//! use std::sync::Arc;
//! use kvpush_core::layout::{KvLayout, TokenOrder};
//! use kvpush_core::protocol::{Cancel, Hello, Message};
//! use kvpush_core::side_channel::{
//!     ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
//! };
//! use kvpush_core::transport::MemorySpace;
//!
//! struct Log;
//! impl ControlHandler for Log {
//!     fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
//!         println!("{} joined from {}", peer.hello.engine_id, peer.addr);
//!         Ok(())
//!     }
//!     fn message(&self, peer: PeerId, message: Message) {
//!         println!("peer {peer}: {message:?}");
//!     }
//!     fn peer_lost(&self, peer: PeerId, reason: &str) {
//!         println!("peer {peer} lost: {reason}");
//!     }
//! }
//!
//! let hello = |engine_id: &str| Hello {
//!     engine_id: engine_id.into(),
//!     tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 1,
//!     agent_name: format!("{engine_id}-agent"),
//!     agent_metadata: Vec::new(),
//!     layout: KvLayout {
//!         regions: Vec::new(), block_tokens: 16, kernel_block_tokens: 16, heads: 8,
//!         head_bytes: 256, token_order: TokenOrder::Nhd, tp_rank: 0, tp_size: 1,
//!     },
//!     compatibility: "model-x/bf16".into(),
//!     versions: vec![1],
//!     memory: MemorySpace::DRAM,
//!     nonce: 0, echo: 0, write_horizon_ms: 0, delivery_bound_ms: 0,
//! };
//! let local = "127.0.0.1:0".parse()?;
//! let prefill = SideChannel::start(SideChannelConfig::new(local, "prefill-0"), hello("prefill-0"), Arc::new(Log))?;
//! let decode = SideChannel::start(SideChannelConfig::new(local, "decode-0"), hello("decode-0"), Arc::new(Log))?;
//!
//! let p = decode.connect(&prefill.local_addr().to_string())?;
//! assert_eq!(p.hello.engine_id, "prefill-0");
//! decode.send(p.id, &Message::Cancel(Cancel {
//!     transfer_key: "xfer-1".into(),
//!     request_id: "cmpl-xfer-1-0".into(),
//!     epoch: 1,
//! }))?;
//! decode.close();
//! prefill.close();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod connection;
mod frames;

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
// Plain std primitives, not `crate::sync`: these guard sockets and threads, which loom cannot
// model; the loom-checked concurrency of the core is the rendezvous table.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::protocol::{Attach, Decoder, Encoder, Hello, Limits, Message, ProtocolError, Secret};
use connection::{Connection, HandshakeError, Inbound, Start};

/// Identifies one side-channel connection for its whole life; never reused within a channel.
pub type PeerId = u64;

/// How often the accept thread looks for new connections and for `close`.
///
/// std cannot interrupt a blocking `accept`, and waking one by connecting to ourselves fails
/// when the bind address is a wildcard or filtered; a poll costs one syscall per interval (20 a
/// second: under 0.1% of a core) and delays a new connection (one per engine pair, made once)
/// by at most this much.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

/// Bounds of a socket's read timeout, the tick at which a connection thread wakes with nothing
/// to read to send a due heartbeat, judge silence and notice `close`.
const MIN_TICK: Duration = Duration::from_millis(5);
const MAX_TICK: Duration = Duration::from_millis(250);

/// How long [`SideChannel::close`] waits for its threads. They wake at once when their sockets
/// are shut down; the time is for a handler callback that is still running.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How often `close` looks whether a thread it waits for has finished.
const JOIN_POLL: Duration = Duration::from_millis(2);

/// Most name lookups running at once for [`SideChannel::connect`], each on a thread of its own.
/// A lookup that outlives its connect's timeout is left to finish (the resolver cannot be
/// interrupted) and still counts: past this many, a connect to a name fails at once instead of
/// starting another thread behind a resolver that hangs.
const MAX_LOOKUPS: usize = 16;

/// The `error` code of a side channel that turns a connection away for want of a slot
/// ([`SideChannelConfig::max_connections`], `max_connections_per_host`, `max_handshakes`): the
/// peer may try again later.
pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";

/// How a [`SideChannel`] listens, identifies itself, authenticates and judges liveness.
#[derive(Debug, Clone)]
pub struct SideChannelConfig {
    /// Where to listen; port 0 picks a free port ([`SideChannel::local_addr`] says which).
    pub bind: SocketAddr,
    /// The envelope `sender` of every frame this side writes: the engine id.
    pub sender: String,
    /// With a secret every frame is signed and every received frame must be (docs/protocol.md
    /// §6); the same secret on every P and D worker. `None` is trusted-network mode.
    pub secret: Option<Secret>,
    /// What received frames must stay within.
    pub limits: Limits,
    /// How often each connection sends a heartbeat. Default 1 s.
    pub heartbeat_interval: Duration,
    /// A peer from which no frame arrives for this long is lost. Default 5 s; must exceed
    /// `heartbeat_interval` (three intervals or more tolerates a delayed heartbeat or two).
    pub peer_timeout: Duration,
    /// Bound on [`SideChannel::connect`] (name lookup, TCP connect and both Hellos), and on how
    /// long an accepted connection may take to send its Hello. Default 3 s.
    pub connect_timeout: Duration,
    /// A write the peer does not take within this is a lost peer (a frame may be half written,
    /// so the connection is closed). Bounds how long [`SideChannel::send`] can block. Default 2 s.
    pub write_timeout: Duration,
    /// Most connections held at once, handshakes included; more are refused with an `error`
    /// (`too_many_connections`). Bounds memory: each connection holds at most one frame
    /// (`limits.max_frame_bytes`) and one thread. Default 256.
    pub max_connections: usize,
    /// Most connections from one IP address at once. Default 32: a D engine needs one per P
    /// rank it reads from, so a host of several engines stays well inside it.
    pub max_connections_per_host: usize,
    /// Most connections still in their handshake at once (not yet proven to hold the secret).
    /// Default 16. With `handshake_frame_bytes` and `connect_timeout`, bounds what unproven
    /// peers can cost.
    pub max_handshakes: usize,
    /// Largest frame read before the peer proved it holds the secret (its Hello). Default 64 KiB.
    pub handshake_frame_bytes: usize,
    /// Listen beyond loopback, and connect to peers beyond it, without a secret. Off by default:
    /// a side channel bound to a routable address without a secret refuses to start, since anyone
    /// who reaches the port could then register for (and receive) another engine's KV; and
    /// [`SideChannel::connect`] refuses an address that is not loopback, since the connecting
    /// side hands the peer its agent metadata (write access to its registered memory) and takes
    /// its unauthenticated replies.
    pub allow_insecure: bool,
}

impl SideChannelConfig {
    /// A configuration listening on `bind` for engine `sender`, unsigned, with default limits and
    /// timeouts.
    pub fn new(bind: SocketAddr, sender: impl Into<String>) -> Self {
        Self {
            bind,
            sender: sender.into(),
            secret: None,
            limits: Limits::default(),
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            write_timeout: Duration::from_secs(2),
            max_connections: 256,
            max_connections_per_host: 32,
            max_handshakes: 16,
            handshake_frame_bytes: 64 << 10,
            allow_insecure: false,
        }
    }

    fn validate(&self) -> io::Result<()> {
        let invalid = |what: String| Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("connect_timeout", self.connect_timeout),
            ("write_timeout", self.write_timeout),
        ] {
            if value.is_zero() {
                return invalid(format!("side channel: {name} must be positive"));
            }
        }
        if self.peer_timeout <= self.heartbeat_interval {
            return invalid(format!(
                "side channel: peer_timeout ({:?}) must exceed heartbeat_interval ({:?}), or \
                 every peer is lost between two heartbeats; use three intervals or more",
                self.peer_timeout, self.heartbeat_interval
            ));
        }
        for (name, value) in [
            ("max_connections", self.max_connections),
            ("max_connections_per_host", self.max_connections_per_host),
            ("max_handshakes", self.max_handshakes),
        ] {
            if value == 0 {
                return invalid(format!("side channel: {name} must be at least 1"));
            }
        }
        if self.secret.is_none() && !self.bind.ip().is_loopback() && !self.allow_insecure {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "side channel: refusing to listen on {} without a shared secret: any host \
                     that reaches this port could register for another engine's KV or cancel \
                     its transfers. Set the same secret on every prefill and decode worker \
                     (KVPUSH_SECRET=<32+ random bytes>, or kv_connector_extra_config \
                     {{\"secret\": ...}}), bind to 127.0.0.1, or accept the risk explicitly \
                     (KVPUSH_INSECURE=1 / {{\"insecure\": true}})",
                    self.bind
                ),
            ));
        }
        Ok(())
    }

    /// How many connections the kernel may hold for the accept thread: every connection and
    /// handshake the caps allow at once. A restarted P is reconnected to by all its D peers at
    /// once; with std's 128, the rest of the storm overflows the queue, and the kernel drops
    /// their SYNs or final ACKs until its retransmissions (1 s, 3 s, ...) outlast D's
    /// `connect_timeout`. The kernel still caps it (`net.core.somaxconn`).
    fn backlog(&self) -> i32 {
        let wanted = self.max_connections.saturating_add(self.max_handshakes);
        i32::try_from(wanted).unwrap_or(i32::MAX).max(128)
    }

    /// The read timeout of every socket; see [`MIN_TICK`].
    fn tick(&self) -> Duration {
        (self.heartbeat_interval.min(self.peer_timeout) / 4).clamp(MIN_TICK, MAX_TICK)
    }
}

/// A peer that completed the handshake.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerInfo {
    /// This connection's id, for [`SideChannel::send`] and the handler's callbacks.
    pub id: PeerId,
    /// The peer's socket address.
    pub addr: SocketAddr,
    /// The Hello the peer sent: who it is, its NIXL agent and its KV layout.
    pub hello: Hello,
    /// Whether the peer connected to us (D connects to P: on P every peer is inbound).
    pub inbound: bool,
}

/// Why a [`ControlHandler`] refuses a peer or cannot serve: the handler's own error (the
/// channel needs only its text, for the peer's `error` reply and the log).
pub type Refusal = Box<dyn std::error::Error + Send + Sync>;

/// What the side channel tells its owner (the rendezvous and writer on P, the request tracker
/// on D).
///
/// Called from the channel's connection threads, one thread per peer, so the calls for one peer
/// are sequential and in wire order: `peer_joined`, then `message`s, then `peer_lost`. Calls for
/// different peers run concurrently. A callback should be quick (hand work to a queue): while it
/// runs, its connection neither reads nor sends heartbeats, and a callback that takes longer than
/// the peer's `peer_timeout` gets this side declared lost by the peer.
pub trait ControlHandler: Send + Sync + 'static {
    /// A peer finished the handshake: its Hello arrived, speaks a common version and has our
    /// compatibility hash. Return `Err` to refuse it (e.g. a layout the planner cannot serve);
    /// the channel answers `error` (`incompatible`, with the refusal's text) and closes.
    ///
    /// The peer is listed by [`SideChannel::peers`] and usable with [`SideChannel::send`] right
    /// after this returns `Ok` (on the accepting side, as our Hello answers it); a send from
    /// inside this callback gets [`SideChannelError::UnknownPeer`].
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal>;

    /// A verified message from a joined peer. Never a `hello` or `done` (refused on the side
    /// channel) and never a `heartbeat` (the channel consumes those); `error` replies from the
    /// peer do arrive here.
    fn message(&self, peer: PeerId, message: Message);

    /// The peer is gone: connection closed or reset, no frame for `peer_timeout`, a protocol
    /// violation that lost stream sync, a failed write, [`SideChannel::disconnect`] or
    /// [`SideChannel::close`]. Called exactly once for each peer `peer_joined` accepted, after
    /// its last `message`; the reason says which and is meant for logs.
    fn peer_lost(&self, peer: PeerId, reason: &str);

    /// A frame was refused (malformed, unauthenticated, replayed, ...), for counting by
    /// [`ProtocolError::code`]. `peer` is `None` during a handshake. The channel has already
    /// answered with an `error` where the peer can read one, and closes the connection where the
    /// stream lost sync (`oversized`, `truncated`, `malformed`) or the peer keeps sending frames
    /// it refuses.
    fn refused(&self, peer: Option<PeerId>, error: &ProtocolError) {
        let _ = (peer, error);
    }

    /// Whether this side can still act on what peers send. While it answers `Err`, each
    /// connection closes instead of sending its next heartbeat (giving the error's text), so
    /// that peers stop waiting on a worker that cannot serve them. `Ok` unless overridden.
    fn healthy(&self) -> Result<(), Refusal> {
        Ok(())
    }

    /// The `pending` field of the heartbeats sent to `peer`: how many transfers this side waits
    /// on from it. Informational (logs, debugging); 0 unless overridden.
    fn pending(&self, peer: PeerId) -> u32 {
        let _ = peer;
        0
    }
}

/// Why a side-channel call failed.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// No TCP connection could be made to the address (refused, unreachable, timed out, or the
    /// address did not resolve).
    #[error(
        "cannot connect to the side channel at {addr}: {source}; check that the worker is up and \
         its side-channel port is reachable from here"
    )]
    Connect {
        /// The address as given.
        addr: String,
        /// What the connect or address lookup said.
        source: io::Error,
    },
    /// Without a secret (and without `allow_insecure`), the address is not loopback: nothing was
    /// sent to it.
    #[error(
        "refusing to connect to the side channel at {addr} ({ip}) without a shared secret: this \
         worker would hand that host its NIXL agent metadata, i.e. write access to its whole KV \
         cache, and take its replies unauthenticated. Set the same secret on every prefill and \
         decode worker (KVPUSH_SECRET=<32+ random bytes>, or kv_connector_extra_config \
         {{\"secret\": ...}}), or accept the risk explicitly (KVPUSH_INSECURE=1 / \
         {{\"insecure\": true}})"
    )]
    Insecure {
        /// The address as given.
        addr: String,
        /// The first address it resolved to that is not loopback.
        ip: std::net::IpAddr,
    },
    /// The TCP connection was made but the handshake failed; the reason says how and what to do.
    #[error("side-channel handshake with {addr} failed: {reason}")]
    Handshake {
        /// The address as given.
        addr: String,
        /// What went wrong: a timeout, a refused frame (e.g. secrets differ), an incompatible
        /// Hello, or this side's handler refusing the peer.
        reason: String,
        /// The peer did not answer within `connect_timeout`: an overloaded peer (one that
        /// restarted under many reconnecting peers) looks like this, and may answer later.
        timed_out: bool,
    },
    /// The peer answered our Hello with an `error` message.
    #[error("the side channel at {addr} refused us ({code}): {detail}")]
    Refused {
        /// The address as given.
        addr: String,
        /// The peer's error code: `incompatible`, `unsupported_version`,
        /// `too_many_connections`, or a [`ProtocolError::code`].
        code: String,
        /// The peer's explanation.
        detail: String,
    },
    /// No joined peer has this id: it was lost or disconnected (its `peer_lost` has been or is
    /// about to be called), or it never joined.
    #[error(
        "no side-channel peer {0}: it disconnected or never joined; fail its transfers and \
         reconnect"
    )]
    UnknownPeer(PeerId),
    /// Writing to the peer failed (the connection is then closed and `peer_lost` follows), or
    /// the connection's thread could not be started.
    #[error("side-channel connection to peer {peer} at {addr} failed: {source}")]
    Io {
        /// The peer.
        peer: PeerId,
        /// Its address.
        addr: SocketAddr,
        /// The write error.
        source: io::Error,
    },
    /// The message was not sent because the peer would refuse it: it breaks the limits, or
    /// its kind does not travel on the side channel (`hello`, `done`).
    #[error("message for side-channel peer {peer} not sent: {source}")]
    Invalid {
        /// The peer.
        peer: PeerId,
        /// What is wrong with the message.
        source: ProtocolError,
    },
    /// This side already holds `max` connections.
    #[error(
        "side channel already holds {max} connections ({cap}): disconnect idle peers or raise \
         {cap}"
    )]
    TooManyConnections {
        /// The cap: [`SideChannelConfig::max_connections`], `max_connections_per_host` or
        /// `max_handshakes` (connections still in their handshake).
        cap: &'static str,
        /// Its value.
        max: usize,
    },
    /// The side channel was closed.
    #[error("the side channel is closed")]
    Closed,
}

/// A worker's side channel: a listener plus the connections it accepted or made.
///
/// Dropping it closes it (see [`close`](Self::close)).
pub struct SideChannel {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
}

/// What the channel's threads share.
struct Shared {
    config: SideChannelConfig,
    hello: Hello,
    handler: Arc<dyn ControlHandler>,
    /// The channel's one encoder: one session for every frame it writes. Each connection's frames
    /// are numbered under its write lock, so a peer sees increasing seqs (with gaps, which the
    /// replay window accepts).
    encoder: Encoder,
    next_id: AtomicU64,
    registry: Mutex<Registry>,
    /// The channel clock's origin: heartbeats carry `clock_ms` from it, and peers' echoes of it
    /// prove on this side's own clock when they were last alive.
    origin: crate::clock::BootInstant,
    /// Checks every frame this side receives, on any connection: one set of replay windows per
    /// receiver. Held for one decode (microseconds) at a time.
    decoder: Mutex<Decoder>,
    /// Name lookups running (see [`MAX_LOOKUPS`]); shared with their threads, which may
    /// outlive the channel.
    lookups: Arc<AtomicUsize>,
}

/// The connections and threads alive, under one lock so that `close` sees every connection and
/// thread that will ever exist: nothing is added once `closing` is set.
#[derive(Default)]
struct Registry {
    closing: bool,
    connections: HashMap<PeerId, Arc<Connection>>,
    threads: Vec<JoinHandle<()>>,
}

impl SideChannel {
    /// Binds `config.bind` and starts accepting connections on the `kvpush-side-accept` thread.
    ///
    /// `hello` is what this worker tells every peer, in both directions.
    ///
    /// # Errors
    ///
    /// `InvalidInput` for an inconsistent configuration (zero timeouts, `peer_timeout` not above
    /// `heartbeat_interval`) or a `hello` that breaks `config.limits`; the bind or thread-spawn
    /// error otherwise.
    pub fn start(
        config: SideChannelConfig,
        hello: Hello,
        handler: Arc<dyn ControlHandler>,
    ) -> io::Result<Self> {
        config.validate()?;
        Message::Hello(hello.clone()).validate(&config.limits).map_err(|error| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("side channel: our own hello would be refused by peers: {error}"),
            )
        })?;
        let listener = listen(config.bind, config.backlog()).map_err(|error| {
            io::Error::new(
                error.kind(),
                format!("side channel: cannot listen on {}: {error}", config.bind),
            )
        })?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            encoder: Encoder::new(config.sender.clone(), config.secret.clone()),
            decoder: Mutex::new(Decoder::new(config.secret.clone(), config.limits)),
            config,
            hello,
            handler,
            next_id: AtomicU64::new(1),
            registry: Mutex::new(Registry::default()),
            origin: crate::clock::BootInstant::now(),
            lookups: Arc::new(AtomicUsize::new(0)),
        });
        let accept = thread::Builder::new().name("kvpush-side-accept".to_owned()).spawn({
            let shared = Arc::clone(&shared);
            move || accept_loop(&shared, &listener)
        })?;
        Ok(Self { shared, local_addr, accept: Mutex::new(Some(accept)) })
    }

    /// The address the channel listens on (with the real port when `bind` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Connects to the side channel at `addr` (`host:port`), exchanges Hellos and returns the
    /// peer; blocks for at most `connect_timeout`, name resolution included (a host name is
    /// looked up on a thread of its own, so that a resolver that hangs fails this connect only).
    ///
    /// Our Hello goes first; the peer's must answer it, be compatible (common version, same
    /// compatibility hash) and be accepted by [`ControlHandler::peer_joined`]. Then the
    /// connection's thread starts, and the peer is usable with [`send`](Self::send).
    ///
    /// # Errors
    ///
    /// [`Insecure`](SideChannelError::Insecure) for an address beyond loopback without a secret
    /// (unless `allow_insecure`); [`Connect`](SideChannelError::Connect) when no TCP connection
    /// could be made;
    /// [`Refused`](SideChannelError::Refused) when the peer answered with an `error` (it refused
    /// us: incompatible, unsigned, too many connections, ...);
    /// [`Handshake`](SideChannelError::Handshake) for everything else (timeout, a Hello we
    /// refuse, our handler's refusal); [`TooManyConnections`](SideChannelError::TooManyConnections);
    /// [`Closed`](SideChannelError::Closed).
    pub fn connect(&self, addr: &str) -> Result<PeerInfo, SideChannelError> {
        let shared = &self.shared;
        shared.check_room()?;
        let deadline = Instant::now() + shared.config.connect_timeout;
        let connect_error = |source| SideChannelError::Connect { addr: addr.to_owned(), source };
        let handshake_error = |reason: String| SideChannelError::Handshake {
            addr: addr.to_owned(),
            reason,
            timed_out: false,
        };

        let candidates = resolve_within(addr, deadline, &shared.lookups).map_err(connect_error)?;
        if shared.config.secret.is_none() && !shared.config.allow_insecure {
            if let Some(beyond) = candidates.iter().find(|c| !c.ip().is_loopback()) {
                return Err(SideChannelError::Insecure { addr: addr.to_owned(), ip: beyond.ip() });
            }
        }
        let socket = connect_within(&candidates, deadline).map_err(connect_error)?;
        let peer_addr = socket.peer_addr().map_err(connect_error)?;
        shared.configure(&socket).map_err(connect_error)?;
        let conn = Arc::new(Connection::new(shared.next_id(), peer_addr, socket));
        let nonce = crate::protocol::fresh_session();
        let sent_ms = shared.clock_ms();
        let ours = Message::Hello(shared.wire_hello(nonce, 0));
        conn.send(&shared.encoder, &ours)
            .map_err(|error| handshake_error(format!("sending our hello failed: {error}")))?;
        let refused = |conn: &Connection, error: HandshakeError| match error {
            HandshakeError::Reply(reply) => {
                conn.close("the peer refused us");
                SideChannelError::Refused {
                    addr: addr.to_owned(),
                    code: reply.code,
                    detail: reply.detail,
                }
            }
            error => {
                conn.close(error.to_string());
                SideChannelError::Handshake {
                    addr: addr.to_owned(),
                    reason: error.to_string(),
                    timed_out: matches!(error, HandshakeError::TimedOut(_)),
                }
            }
        };

        let mut inbound = Inbound::new(&shared.config);
        let hello = connection::read_hello(shared, &conn, &mut inbound, deadline)
            .map_err(|error| refused(&conn, error))?;
        if hello.echo != nonce {
            connection::wrong_echo(shared, &conn, "hello");
            return Err(handshake_error(HandshakeError::WrongEcho { what: "hello" }.to_string()));
        }
        if let Err(reply) = connection::check_hello(&shared.hello, &hello) {
            let reason = format!("refused the peer's hello ({}): {}", reply.code, reply.detail);
            conn.reply_and_close(&shared.encoder, &Message::Error(reply), reason.clone());
            return Err(handshake_error(reason));
        }
        conn.prove(sent_ms, shared.clock_ms());
        // Only now, with the peer proven, does our agent metadata leave this process.
        let attach = Message::Attach(Attach {
            echo: hello.nonce,
            agent_metadata: shared.hello.agent_metadata.clone(),
        });
        conn.send(&shared.encoder, &attach)
            .map_err(|error| handshake_error(format!("sending our attach failed: {error}")))?;
        let welcome = connection::read_attach(shared, &conn, &mut inbound, deadline)
            .map_err(|error| refused(&conn, error))?;
        if welcome.echo != nonce {
            connection::wrong_echo(shared, &conn, "attach");
            return Err(handshake_error(HandshakeError::WrongEcho { what: "attach" }.to_string()));
        }
        let mut hello = hello;
        hello.agent_metadata = welcome.agent_metadata;
        let info = PeerInfo { id: conn.id, addr: peer_addr, hello, inbound: false };
        if let Err(reason) = shared.handler.peer_joined(&info) {
            let reason = format!("this side's handler refused the peer: {reason}");
            let reply = Message::Error(connection::error_reply("incompatible", &reason));
            conn.reply_and_close(&shared.encoder, &reply, reason.clone());
            return Err(handshake_error(reason));
        }
        // peer_joined accepted it: from here on the peer is owed exactly one peer_lost.
        conn.set_joined(info.clone());
        if let Err(error) = shared.adopt(&conn, Start::Joined(Box::new(inbound))) {
            let reason = format!("the connection could not be kept: {error}");
            conn.close(reason.clone());
            shared.handler.peer_lost(conn.id, &reason);
            return Err(error);
        }
        Ok(info)
    }

    /// Sends `message` to `peer`: framed, signed when a secret is configured, and handed to the
    /// socket without waiting (the caller, the writer thread among them, is never held by a
    /// slow reader): what the socket does not take at once is queued, and the connection's own
    /// thread finishes it. A frame not written whole within `write_timeout` of being queued, or
    /// 16 MiB queued, closes the connection. Messages to one peer arrive in the order they
    /// were sent.
    ///
    /// # Errors
    ///
    /// [`UnknownPeer`](SideChannelError::UnknownPeer) for a peer that is gone or never joined;
    /// [`Invalid`](SideChannelError::Invalid) for a `hello`, an `attach`, a `done` or a message that breaks
    /// the limits; [`Io`](SideChannelError::Io) when the connection is closed or the write
    /// failed (the connection is then closed and `peer_lost` follows);
    /// [`Closed`](SideChannelError::Closed).
    pub fn send(&self, peer: PeerId, message: &Message) -> Result<(), SideChannelError> {
        let conn = self.shared.joined(peer)?;
        let invalid = |source| SideChannelError::Invalid { peer, source };
        if matches!(message, Message::Hello(_) | Message::Attach(_) | Message::Done(_)) {
            return Err(invalid(ProtocolError::Invalid {
                field: "kind",
                reason: format!(
                    "`{}` does not travel on the side channel after the handshake",
                    message.kind()
                ),
            }));
        }
        message.validate(&self.shared.config.limits).map_err(invalid)?;
        conn.post(&self.shared.encoder, message).map_err(|source| SideChannelError::Io {
            peer,
            addr: conn.addr,
            source,
        })
    }

    /// Closes the connection to `peer`; its `peer_lost` follows promptly on the connection's
    /// thread. Does nothing for an unknown peer.
    pub fn disconnect(&self, peer: PeerId) {
        if let Some(conn) = lock(&self.shared.registry).connections.get(&peer).cloned() {
            conn.close("disconnected by this side");
        }
    }

    /// The peers currently joined.
    pub fn peers(&self) -> Vec<PeerInfo> {
        let registry = lock(&self.shared.registry);
        let mut peers: Vec<PeerInfo> =
            registry.connections.values().filter_map(|conn| conn.info().cloned()).collect();
        peers.sort_by_key(|peer| peer.id);
        peers
    }

    /// How long ago `peer` was last proven alive, on this side's clock: the time since we sent
    /// the frame whose echo it answered most recently. `None` for a peer that is gone or never
    /// joined. A peer can only echo what it received, so it was alive after that moment
    /// whatever delayed its frames on the way back.
    pub fn proof_age(&self, peer: PeerId) -> Option<Duration> {
        let conn = self.shared.joined(peer).ok()?;
        let proven = conn.proven_ms();
        (proven > 0).then(|| Duration::from_millis(self.shared.clock_ms().saturating_sub(proven)))
    }

    /// Stops accepting, closes every connection (each joined peer gets its `peer_lost`, with
    /// the reason "closed by this side") and joins every thread.
    ///
    /// Idempotent: later calls (and `Drop`) return at once. Waits at most about
    /// `CLOSE_GRACE` (2 s) for handler callbacks still running; a thread stuck in one past
    /// that is left to finish on its own. Safe to call from a handler callback (that thread is
    /// not waited for).
    pub fn close(&self) {
        let (connections, threads) = {
            let mut registry = lock(&self.shared.registry);
            if registry.closing {
                return;
            }
            registry.closing = true;
            let connections: Vec<_> = registry.connections.values().cloned().collect();
            (connections, std::mem::take(&mut registry.threads))
        };
        for conn in &connections {
            conn.close("the side channel was closed by this side");
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        if let Some(accept) = lock(&self.accept).take() {
            join_by(accept, deadline);
        }
        for thread in threads {
            join_by(thread, deadline);
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for SideChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let registry = lock(&self.shared.registry);
        f.debug_struct("SideChannel")
            .field("local_addr", &self.local_addr)
            .field("engine_id", &self.shared.hello.engine_id)
            .field("signed", &self.shared.config.secret.is_some())
            .field("connections", &registry.connections.len())
            .field("closing", &registry.closing)
            .finish()
    }
}

impl Shared {
    /// This channel's clock: milliseconds since it started, from 1 (0 means "never" on the wire).
    fn clock_ms(&self) -> u64 {
        // Boot time, so that a proof of life ages while the host is suspended (see `clock`).
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Our Hello as it goes on the wire: with this connection's challenge, without agent
    /// metadata (each side's goes in its `Attach`, once the other side proved itself).
    fn wire_hello(&self, nonce: u64, echo: u64) -> Hello {
        Hello { agent_metadata: Vec::new(), nonce, echo, ..self.hello.clone() }
    }

    /// The frame limit before a peer has proven anything.
    fn handshake_frame_bytes(&self) -> usize {
        self.config.handshake_frame_bytes.min(self.config.limits.max_frame_bytes)
    }

    fn next_id(&self) -> PeerId {
        // Relaxed: only the uniqueness of each id matters.
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn is_closing(&self) -> bool {
        lock(&self.registry).closing
    }

    /// Fails early (before any network traffic) when a new connection could not be kept.
    fn check_room(&self) -> Result<(), SideChannelError> {
        let registry = lock(&self.registry);
        if registry.closing {
            return Err(SideChannelError::Closed);
        }
        if registry.connections.len() >= self.config.max_connections {
            return Err(SideChannelError::TooManyConnections {
                cap: "max_connections",
                max: self.config.max_connections,
            });
        }
        Ok(())
    }

    /// The joined connection `peer`.
    fn joined(&self, peer: PeerId) -> Result<Arc<Connection>, SideChannelError> {
        let registry = lock(&self.registry);
        if registry.closing {
            return Err(SideChannelError::Closed);
        }
        match registry.connections.get(&peer) {
            Some(conn) if conn.info().is_some() => Ok(Arc::clone(conn)),
            _ => Err(SideChannelError::UnknownPeer(peer)),
        }
    }

    /// Timeouts and options every side-channel socket gets.
    fn configure(&self, socket: &TcpStream) -> io::Result<()> {
        // Some platforms hand out accepted sockets with the listener's non-blocking flag.
        socket.set_nonblocking(false)?;
        // Control frames are small and latency-bound: a Register must not wait for Nagle.
        socket.set_nodelay(true)?;
        socket.set_read_timeout(Some(self.config.tick()))?;
        socket.set_write_timeout(Some(self.config.write_timeout))
    }

    /// Registers `conn` and starts its thread, unless the channel is closing or full.
    fn adopt(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        start: Start,
    ) -> Result<(), SideChannelError> {
        let mut registry = lock(&self.registry);
        if registry.closing {
            return Err(SideChannelError::Closed);
        }
        if registry.connections.len() >= self.config.max_connections {
            return Err(SideChannelError::TooManyConnections {
                cap: "max_connections",
                max: self.config.max_connections,
            });
        }
        if matches!(start, Start::Accepted) {
            let from_host =
                registry.connections.values().filter(|c| c.addr.ip() == conn.addr.ip()).count();
            if from_host >= self.config.max_connections_per_host {
                return Err(SideChannelError::TooManyConnections {
                    cap: "max_connections_per_host",
                    max: self.config.max_connections_per_host,
                });
            }
            let handshaking = registry.connections.values().filter(|c| c.info().is_none()).count();
            if handshaking >= self.config.max_handshakes {
                return Err(SideChannelError::TooManyConnections {
                    cap: "max_handshakes",
                    max: self.config.max_handshakes,
                });
            }
        }
        // Finished threads have nothing left to join; dropping their handles keeps the list as
        // short as the live connections.
        registry.threads.retain(|thread| !thread.is_finished());
        // Spawned under the lock so that `close`, which takes it to set `closing`, sees the
        // connection and its thread together or neither.
        let direction = if matches!(start, Start::Accepted) { "in" } else { "out" };
        let name = format!("kvpush-{direction}-{}", conn.id);
        let thread = thread::Builder::new().name(name).spawn({
            let shared = Arc::clone(self);
            let conn = Arc::clone(conn);
            move || connection::run(shared, conn, start)
        });
        match thread {
            Ok(thread) => {
                registry.connections.insert(conn.id, Arc::clone(conn));
                registry.threads.push(thread);
                Ok(())
            }
            Err(source) => Err(SideChannelError::Io { peer: conn.id, addr: conn.addr, source }),
        }
    }

    /// Drops a connection whose thread is ending.
    fn forget(&self, peer: PeerId) {
        lock(&self.registry).connections.remove(&peer);
    }

    /// Takes in one accepted socket: starts its thread, or turns it away.
    fn admit(self: &Arc<Self>, socket: TcpStream, addr: SocketAddr) {
        if self.configure(&socket).is_err() {
            return; // The peer is already gone.
        }
        let conn = Arc::new(Connection::new(self.next_id(), addr, socket));
        match self.adopt(&conn, Start::Accepted) {
            Ok(()) => {}
            Err(SideChannelError::TooManyConnections { cap, max }) => {
                let detail = format!(
                    "this side channel already holds {max} connections ({cap}); retry later, or \
                     raise {cap} on this worker"
                );
                let reply = Message::Error(connection::error_reply(TOO_MANY_CONNECTIONS, &detail));
                conn.reply_and_close(&self.encoder, &reply, detail);
            }
            Err(error) => conn.close(error.to_string()),
        }
    }
}

/// A listening socket on `addr` (reusing a port in `TIME_WAIT`, as std's bind does, so that a
/// restarted worker gets its port back) whose accept queue holds `backlog` connections.
fn listen(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = if addr.is_ipv4() { AddressFamily::INET } else { AddressFamily::INET6 };
    let socket = rustix::net::socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_reuseaddr(&socket, true)?;
    rustix::net::bind(&socket, &addr)?;
    rustix::net::listen(&socket, backlog)?;
    Ok(TcpListener::from(socket))
}

/// The `kvpush-side-accept` thread: admits connections until the channel closes.
fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.is_closing() {
        match listener.accept() {
            Ok((socket, addr)) => shared.admit(socket, addr),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            // WouldBlock: nothing pending. Anything else (out of file descriptors, a connection
            // aborted before it was accepted) concerns one connection or passes with time:
            // back off rather than spin, and keep serving the connections already open.
            Err(_) => thread::sleep(ACCEPT_POLL),
        }
    }
}

/// A TCP connection to the first of `candidates` (what an address resolved to) that accepts one
/// before `deadline`.
fn connect_within(candidates: &[SocketAddr], deadline: Instant) -> io::Result<TcpStream> {
    let mut last_error = None;
    for &candidate in candidates {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&candidate, left) {
            Ok(socket) => return Ok(socket),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::TimedOut, "no address answered within connect_timeout")
    }))
}

/// The socket addresses of `addr` (`host:port`), looked up by `deadline`: a literal address at
/// once, a name on a thread of its own (std's lookup blocks, for as long as the resolver takes).
/// `lookups` counts the lookup threads running, at most [`MAX_LOOKUPS`].
fn resolve_within(
    addr: &str,
    deadline: Instant,
    lookups: &Arc<AtomicUsize>,
) -> io::Result<Vec<SocketAddr>> {
    if let Ok(literal) = addr.parse::<SocketAddr>() {
        return Ok(vec![literal]);
    }
    // Relaxed: a count of threads, read only to bound them; the result travels by channel.
    if lookups.fetch_add(1, Ordering::Relaxed) >= MAX_LOOKUPS {
        lookups.fetch_sub(1, Ordering::Relaxed);
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{MAX_LOOKUPS} name lookups are still running (the resolver is slow or hangs); \
                 retry later, or give P's address as an IP"
            ),
        ));
    }
    let (sender, receiver) = mpsc::channel();
    let spawned = thread::Builder::new().name("kvpush-resolve".to_owned()).spawn({
        let (addr, lookups) = (addr.to_owned(), Arc::clone(lookups));
        move || {
            let resolved = addr.to_socket_addrs().map(Iterator::collect::<Vec<_>>);
            lookups.fetch_sub(1, Ordering::Relaxed);
            // The connect may have given up on this lookup already.
            let _ = sender.send(resolved);
        }
    });
    if let Err(error) = spawned {
        lookups.fetch_sub(1, Ordering::Relaxed);
        return Err(error);
    }
    match receiver.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(resolved) => resolved,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the name {addr:?} did not resolve within connect_timeout"),
        )),
    }
}

/// Joins `thread` if it finishes by `deadline`; leaves it running otherwise.
fn join_by(thread: JoinHandle<()>, deadline: Instant) {
    if thread.thread().id() == thread::current().id() {
        return; // `close` called from a handler callback on this very thread.
    }
    while !thread.is_finished() {
        if Instant::now() >= deadline {
            return;
        }
        thread::sleep(JOIN_POLL);
    }
    // A thread that panicked has already cleaned up after itself (see `connection::run`).
    let _ = thread.join();
}

/// Locks `mutex`, recovering the guard if a thread panicked while holding it: every critical
/// section here is a map or vector operation that leaves its data consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_literal_address_needs_no_lookup_and_a_name_beyond_the_lookups_running_fails_at_once() {
        let lookups = Arc::new(AtomicUsize::new(MAX_LOOKUPS));
        let far = Instant::now() + Duration::from_secs(60);
        let literal = resolve_within("127.0.0.1:5600", far, &lookups).unwrap();
        assert_eq!(literal, vec![SocketAddr::from(([127, 0, 0, 1], 5600))]);
        // Every lookup thread is taken (a resolver that hangs): no wait, no new thread.
        let error = resolve_within("localhost:5600", far, &lookups).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::WouldBlock);
        assert!(error.to_string().contains("give P's address as an IP"), "{error}");
        assert_eq!(lookups.load(Ordering::Relaxed), MAX_LOOKUPS);
        // With one free, the name resolves and its thread is counted out again.
        lookups.store(MAX_LOOKUPS - 1, Ordering::Relaxed);
        let resolved = resolve_within("localhost:5600", far, &lookups).unwrap();
        assert!(resolved.iter().all(|addr| addr.port() == 5600 && addr.ip().is_loopback()));
        assert!(!resolved.is_empty());
    }
}

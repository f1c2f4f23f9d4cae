//! One side-channel connection: its socket, the handshake, and the thread that reads it.

use std::fmt;
use std::io::{self, ErrorKind, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::frames::{FrameError, FrameReader};
use super::{lock, PeerId, PeerInfo, Shared, SideChannelConfig};
use crate::protocol::{
    unix_millis, Attach, Encoder, ErrorReply, Heartbeat, Hello, Message, ProtocolError,
    MAX_REPLY_DETAIL_BYTES,
};

/// Refused frames in a row after which a connection is closed even though the stream is in sync.
///
/// Two peers that refuse each other's frames (clocks drifted apart, say) would otherwise answer
/// each other's error replies with error replies for ever; and a peer that sends nothing valid has
/// nothing to say.
const MAX_REFUSALS_IN_A_ROW: u32 = 16;

/// One TCP connection to a peer, shared by its reader thread and every sender.
pub(super) struct Connection {
    pub(super) id: PeerId,
    pub(super) addr: SocketAddr,
    /// Read by the connection's thread, written by any thread (`&TcpStream` is both `Read` and
    /// `Write`), shut down by whoever closes it: one descriptor for all three.
    socket: TcpStream,
    /// Held while a frame is encoded and written or queued, so that frames are never
    /// interleaved and, because the channel's one encoder numbers them under it, reach the peer
    /// in seq order. Holds the frames the socket did not take at once (see [`Outbox`]).
    write_lock: Mutex<Outbox>,
    /// The peer's identity, set once its Hello is accepted and ours is on the wire; until then
    /// the connection is invisible to `send` and `peers`.
    info: OnceLock<PeerInfo>,
    /// Why this side closed the connection; the first reason wins. The reader then reports this
    /// cause to `peer_lost` rather than the end of stream it sees as a consequence.
    close_reason: OnceLock<String>,
    /// The latest moment, on this channel's clock (ms, see `Shared::clock_ms`), after which the
    /// peer is proven to have been alive: the send time of our frame its latest echo answered.
    /// 0 until the handshake proves anything. Only grows.
    proven_ms: AtomicU64,
    /// The latest `clock_ms` the peer sent, echoed in our heartbeats. Only grows.
    peer_clock_ms: AtomicU64,
}

/// Frames written but not yet taken by the socket, oldest first: the sender never waits for a
/// slow reader (`Connection::post` writes what the socket takes without blocking and queues the
/// rest), and the connection's own thread finishes them (`Connection::flush`). A frame not
/// written whole within the write timeout of being queued, or a queue over
/// [`MAX_QUEUED_BYTES`], closes the connection: the peer is not reading.
#[derive(Debug, Default)]
pub(super) struct Outbox {
    frames: std::collections::VecDeque<Queued>,
    bytes: usize,
}

#[derive(Debug)]
struct Queued {
    frame: Vec<u8>,
    /// Bytes of `frame` already written.
    written: usize,
    /// When it was queued: its deadline is this plus the write timeout.
    at: crate::clock::BootInstant,
}

/// Most bytes one connection may have queued for a peer that is not reading.
pub(super) const MAX_QUEUED_BYTES: usize = 16 << 20;

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("addr", &self.addr)
            .field("joined", &self.info.get().is_some())
            .field("close_reason", &self.close_reason.get())
            .finish()
    }
}

impl Connection {
    pub(super) fn new(id: PeerId, addr: SocketAddr, socket: TcpStream) -> Self {
        Self {
            id,
            addr,
            socket,
            write_lock: Mutex::new(Outbox::default()),
            info: OnceLock::new(),
            close_reason: OnceLock::new(),
            proven_ms: AtomicU64::new(0),
            peer_clock_ms: AtomicU64::new(0),
        }
    }

    /// See `proven_ms`.
    pub(super) fn proven_ms(&self) -> u64 {
        // Relaxed: a monotonic value read on its own; nothing else is published through it.
        self.proven_ms.load(Ordering::Relaxed)
    }

    /// The peer proved it was alive after `at_ms` (our clock); `now_ms` bounds what a peer can
    /// claim, so that a bogus echo from the future cannot stretch the proof.
    pub(super) fn prove(&self, at_ms: u64, now_ms: u64) {
        if at_ms > 0 && at_ms <= now_ms {
            // Relaxed: see `proven_ms`.
            self.proven_ms.fetch_max(at_ms, Ordering::Relaxed);
        }
    }

    /// The peer's identity, once the handshake is complete.
    pub(super) fn info(&self) -> Option<&PeerInfo> {
        self.info.get()
    }

    /// Completes the handshake on the connecting side, where our Hello went out first.
    pub(super) fn set_joined(&self, info: PeerInfo) {
        // Set once per connection, by the one thread doing its handshake.
        let _ = self.info.set(info);
    }

    /// Frames `message` and writes it whole, within the socket's write timeout: for the
    /// handshake, before the connection's thread runs (afterwards, [`post`](Self::post)).
    ///
    /// A failed write may have left part of a frame on the wire, so it closes the connection:
    /// the reader then reports the peer lost.
    pub(super) fn send(&self, encoder: &Encoder, message: &Message) -> io::Result<()> {
        let _frame_order = lock(&self.write_lock);
        self.write_locked(encoder, message)
    }

    /// Frames `message` and hands it to the socket without waiting: what the socket does not
    /// take at once is queued behind earlier frames, for the connection's thread to finish
    /// (see [`Outbox`]). Errs only when the connection is closed or its queue is full (which
    /// closes it).
    pub(super) fn post(&self, encoder: &Encoder, message: &Message) -> io::Result<()> {
        let mut outbox = lock(&self.write_lock);
        if let Some(reason) = self.close_reason.get() {
            return Err(io::Error::new(ErrorKind::NotConnected, reason.clone()));
        }
        let frame = encoder.encode(message, unix_millis());
        let written = if outbox.frames.is_empty() { self.write_now(&frame)? } else { 0 };
        if written < frame.len() {
            if outbox.bytes + frame.len() > MAX_QUEUED_BYTES {
                let reason = format!(
                    "{} bytes queued for the peer and it is not reading: closed",
                    outbox.bytes
                );
                self.close(reason.clone());
                return Err(io::Error::new(ErrorKind::WouldBlock, reason));
            }
            outbox.bytes += frame.len() - written;
            outbox.frames.push_back(Queued {
                frame,
                written,
                at: crate::clock::BootInstant::now(),
            });
        }
        Ok(())
    }

    /// Writes what the socket takes of the queued frames, without waiting; closes the
    /// connection if the oldest one has waited longer than `write_timeout`. Called by the
    /// connection's thread on every turn.
    pub(super) fn flush(&self, write_timeout: std::time::Duration) {
        let mut outbox = lock(&self.write_lock);
        while let Some(head) = outbox.frames.front_mut() {
            if self.close_reason.get().is_some() {
                return;
            }
            let Ok(written) = self.write_now(&head.frame[head.written..]) else { return };
            head.written += written;
            if head.written < head.frame.len() {
                let waited = head.at.elapsed();
                outbox.bytes -= written;
                if waited > write_timeout {
                    self.close(format!(
                        "the peer took no whole frame within the write timeout ({:.1}s, a frame \
                         queued {:.1}s ago): it is not reading",
                        write_timeout.as_secs_f64(),
                        waited.as_secs_f64()
                    ));
                }
                return;
            }
            outbox.bytes -= written;
            outbox.frames.pop_front();
        }
    }

    /// Writes as much of `bytes` as the socket takes right now; an error closes the connection.
    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        use rustix::net::{send, SendFlags};
        let mut written = 0;
        while written < bytes.len() {
            match send(&self.socket, &bytes[written..], SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(0) => break,
                Ok(n) => written += n,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    let reason = format!("writing to the peer failed: {e}");
                    self.close(reason.clone());
                    return Err(io::Error::new(ErrorKind::BrokenPipe, reason));
                }
            }
        }
        Ok(written)
    }

    /// Completes the handshake on the accepting side: the peer becomes visible and the welcome
    /// (our Attach) goes out under one hold of the write lock, so that a `send` that finds the
    /// peer waits for the welcome to be written first, and a peer that has read it is already
    /// listed.
    fn join_and_welcome(
        &self,
        encoder: &Encoder,
        welcome: &Message,
        info: PeerInfo,
    ) -> io::Result<()> {
        let _frame_order = lock(&self.write_lock);
        let _ = self.info.set(info);
        self.write_locked(encoder, welcome)
    }

    fn write_locked(&self, encoder: &Encoder, message: &Message) -> io::Result<()> {
        if let Some(reason) = self.close_reason.get() {
            return Err(io::Error::new(ErrorKind::NotConnected, reason.clone()));
        }
        let frame = encoder.encode(message, unix_millis());
        (&self.socket).write_all(&frame).map_err(|e| {
            let reason = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                format!(
                    "the peer accepted no data within the write timeout ({e}): it is not reading"
                )
            } else {
                format!("writing to the peer failed: {e}")
            };
            self.close(reason.clone());
            io::Error::new(e.kind(), reason)
        })
    }

    /// Closes the connection for `reason` (kept if it is the first); wakes the reader, which
    /// then reports the peer lost. Never blocks.
    pub(super) fn close(&self, reason: impl Into<String>) {
        let _ = self.close_reason.set(reason.into());
        // NotConnected when the peer already went: nothing left to shut down.
        let _ = self.socket.shutdown(Shutdown::Both);
    }

    /// Sends `reply` if the socket still takes it, then closes for `reason`.
    pub(super) fn reply_and_close(&self, encoder: &Encoder, reply: &Message, reason: String) {
        // Best effort: the peer is being turned away either way; the reply only tells it why.
        // Without waiting (another thread may be the one closing), and only behind frames
        // already queued, so that it never interleaves with one.
        let _ = self.post(encoder, reply);
        self.close(reason);
    }

    fn closed(&self) -> Option<&String> {
        self.close_reason.get()
    }
}

/// The receiving half of a connection: frames off the socket. They are checked by the
/// channel's one decoder (`Shared::decoder`), so that replay windows are per receiver: a frame
/// accepted on one connection is refused on every other, a later one included.
#[derive(Debug)]
pub(super) struct Inbound {
    frames: FrameReader,
}

impl Inbound {
    pub(super) fn new(config: &SideChannelConfig) -> Self {
        Self { frames: FrameReader::new(config.limits) }
    }
}

/// What a connection thread does first.
#[derive(Debug)]
pub(super) enum Start {
    /// An accepted socket: read the connector's Hello, answer it, then serve.
    Accepted,
    /// A connection whose handshake `SideChannel::connect` completed: serve.
    Joined(Box<Inbound>),
}

/// Why a handshake did not produce the peer's Hello.
#[derive(Debug)]
pub(super) enum HandshakeError {
    /// Nothing arrived within `connect_timeout`.
    TimedOut(std::time::Duration),
    /// The connection ended first.
    Closed(String),
    /// The peer's first frame was refused by our decoder (already counted and answered).
    Refused(ProtocolError),
    /// The peer answered with an `error` message instead of a Hello.
    Reply(ErrorReply),
    /// The peer's frame was a valid message of another kind than the handshake needs next.
    Unexpected {
        /// The kind the handshake needs.
        want: &'static str,
        /// The kind that came.
        got: &'static str,
    },
    /// The peer's frame does not answer this connection's challenge: a replay of another
    /// connection's handshake, or a peer that does not hold the secret.
    WrongEcho {
        /// What the frame was.
        what: &'static str,
    },
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut(timeout) => write!(
                f,
                "no hello within connect_timeout ({timeout:?}): the address is not a kvpush side \
                 channel, or the peer is overloaded"
            ),
            Self::Closed(reason) => write!(f, "connection ended before the hello: {reason}"),
            Self::Refused(error) => write!(f, "the peer's hello was refused: {error}"),
            Self::Reply(reply) => {
                write!(f, "the peer refused us ({}): {}", reply.code, reply.detail)
            }
            Self::Unexpected { want, got } => {
                write!(f, "the peer sent `{got}`, but the handshake needs `{want}` next")
            }
            Self::WrongEcho { what } => write!(
                f,
                "the peer's {what} does not answer this connection's challenge: a replayed \
                 handshake, or a peer without the shared secret"
            ),
        }
    }
}

/// Reads the peer's next handshake frame, which must be a `want` message, by `deadline`.
///
/// A frame the decoder refuses is counted with `refused(None, ..)` and answered with an error
/// reply; an `error` from the peer is [`HandshakeError::Reply`]; the caller closes the
/// connection on any error.
fn read_handshake(
    shared: &Shared,
    conn: &Connection,
    inbound: &mut Inbound,
    deadline: Instant,
    want: &'static str,
) -> Result<Message, HandshakeError> {
    loop {
        if let Some(reason) = conn.closed() {
            return Err(HandshakeError::Closed(reason.clone()));
        }
        if Instant::now() >= deadline {
            return Err(HandshakeError::TimedOut(shared.config.connect_timeout));
        }
        match inbound.frames.poll(&conn.socket) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(FrameError::Protocol(error)) => {
                shared.handler.refused(None, &error);
                conn.reply_and_close(&shared.encoder, &error.to_reply(), error.to_string());
                return Err(HandshakeError::Refused(error));
            }
            Err(other) => return Err(HandshakeError::Closed(describe_end(&other))),
        }
        let decoded = lock(&shared.decoder).decode(inbound.frames.frame(), unix_millis());
        inbound.frames.consume();
        return match decoded {
            Ok(envelope) => match envelope.message {
                Message::Error(reply) => Err(HandshakeError::Reply(reply)),
                message if message.kind() == want => Ok(message),
                other => {
                    let error = HandshakeError::Unexpected { want, got: other.kind() };
                    let reply = Message::Error(error_reply("invalid", &error.to_string()));
                    conn.reply_and_close(&shared.encoder, &reply, error.to_string());
                    Err(error)
                }
            },
            Err(error) => {
                shared.handler.refused(None, &error);
                conn.reply_and_close(&shared.encoder, &error.to_reply(), error.to_string());
                Err(HandshakeError::Refused(error))
            }
        };
    }
}

/// Reads the peer's Hello (its first frame) by `deadline`, with the small pre-authentication
/// frame limit.
pub(super) fn read_hello(
    shared: &Shared,
    conn: &Connection,
    inbound: &mut Inbound,
    deadline: Instant,
) -> Result<Hello, HandshakeError> {
    inbound.frames.set_max_frame_bytes(shared.handshake_frame_bytes());
    match read_handshake(shared, conn, inbound, deadline, "hello")? {
        Message::Hello(hello) => Ok(hello),
        _ => unreachable!("read_handshake returns only the kind asked for"),
    }
}

/// Reads the peer's Attach by `deadline`: the acceptor reads the connector's (its proof and
/// agent metadata), the connector the acceptor's welcome (likewise). The metadata may be large,
/// but the buffer grows only with the bytes that arrive, and the whole handshake is bounded in
/// time; from here on frames may be as large as the limits allow.
pub(super) fn read_attach(
    shared: &Shared,
    conn: &Connection,
    inbound: &mut Inbound,
    deadline: Instant,
) -> Result<Attach, HandshakeError> {
    inbound.frames.set_max_frame_bytes(shared.config.limits.max_frame_bytes);
    match read_handshake(shared, conn, inbound, deadline, "attach")? {
        Message::Attach(attach) => Ok(attach),
        _ => unreachable!("read_handshake returns only the kind asked for"),
    }
}

/// The heartbeat a connection sends: our clock, and the peer's latest clock as its proof.
pub(super) fn heartbeat(shared: &Shared, conn: &Connection, seq: u64) -> Message {
    Message::Heartbeat(Heartbeat {
        engine_id: shared.hello.engine_id.clone(),
        seq,
        pending: shared.handler.pending(conn.id),
        clock_ms: shared.clock_ms(),
        // Relaxed: see `Connection::proven_ms`.
        echo_ms: conn.peer_clock_ms.load(Ordering::Relaxed),
    })
}

/// A heartbeat from the peer: remember its clock to echo, and take its echo of ours as proof.
pub(super) fn heard(shared: &Shared, conn: &Connection, heartbeat: &Heartbeat) {
    // Relaxed: see `Connection::proven_ms`.
    conn.peer_clock_ms.fetch_max(heartbeat.clock_ms, Ordering::Relaxed);
    conn.prove(heartbeat.echo_ms, shared.clock_ms());
}

/// The protocol's own conditions for two peers to talk (docs/protocol.md, `hello`): a side-channel
/// version both speak, and equal compatibility hashes. The error is the reply to send.
pub(super) fn check_hello(ours: &Hello, theirs: &Hello) -> Result<(), ErrorReply> {
    if !theirs.versions.iter().any(|version| ours.versions.contains(version)) {
        return Err(error_reply(
            "unsupported_version",
            &format!(
                "engine {:?} speaks side-channel versions {:?}, engine {:?} speaks {:?}: run \
                 matching kvpush versions",
                theirs.engine_id, theirs.versions, ours.engine_id, ours.versions
            ),
        ));
    }
    if theirs.compatibility != ours.compatibility {
        return Err(error_reply(
            "incompatible",
            &format!(
                "engine {:?} has compatibility hash {:?}, engine {:?} has {:?}: prefill and \
                 decode must run the same model, dtypes and attention backend (and the same \
                 block size where blocks move whole, as with vLLM's CPU attention)",
                theirs.engine_id, theirs.compatibility, ours.engine_id, ours.compatibility
            ),
        ));
    }
    Ok(())
}

/// An `error` reply whose detail fits [`MAX_REPLY_DETAIL_BYTES`].
pub(super) fn error_reply(code: &str, detail: &str) -> ErrorReply {
    let mut cut = detail.len().min(MAX_REPLY_DETAIL_BYTES);
    while !detail.is_char_boundary(cut) {
        cut -= 1;
    }
    ErrorReply { code: code.to_owned(), detail: detail[..cut].to_owned() }
}

/// The body of every connection thread: handshake (accepting side), then serve until the
/// connection ends; then forget the connection and, if the peer had joined, report it lost.
///
/// `peer_lost` is called here and only here for a connection that has a thread, so it is called
/// exactly once per joined peer whatever ended the connection, a handler panic included.
pub(super) fn run(shared: Arc<Shared>, conn: Arc<Connection>, start: Start) {
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| match start {
        Start::Accepted => serve_accepted(&shared, &conn),
        Start::Joined(inbound) => Some(serve(&shared, &conn, *inbound)),
    }));
    let reason = match outcome {
        Ok(reason) => reason,
        Err(panic) => conn.info().map(|_| {
            let what = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("a non-string payload");
            format!("the connection's thread panicked (in a handler callback?): {what}")
        }),
    };
    conn.close(reason.clone().unwrap_or_else(|| "handshake did not complete".to_owned()));
    shared.forget(conn.id);
    if let Some(reason) = reason {
        shared.handler.peer_lost(conn.id, &reason);
    }
}

/// The accepting side's handshake, then [`serve`]. `None` when the peer never joined.
///
/// Hello in, our Hello out (answering the connector's challenge and posing ours), Attach in
/// (answering ours, with the connector's agent metadata), then the handler's say, then the
/// welcome (our own Attach). Nothing the connector sent reaches the handler (nor NIXL) before the
/// Attach proved it holds the secret and is not a replay.
fn serve_accepted(shared: &Shared, conn: &Connection) -> Option<String> {
    let deadline = Instant::now() + shared.config.connect_timeout;
    let mut inbound = Inbound::new(&shared.config);
    let refuse = |error: HandshakeError| {
        conn.close(error.to_string());
        None
    };
    let mut hello = match read_hello(shared, conn, &mut inbound, deadline) {
        Ok(hello) => hello,
        Err(error) => return refuse(error),
    };
    if let Err(reply) = check_hello(&shared.hello, &hello) {
        let reason = format!("refused the peer's hello: {}", reply.detail);
        conn.reply_and_close(&shared.encoder, &Message::Error(reply), reason);
        return None;
    }
    let nonce = crate::protocol::fresh_session();
    let sent_ms = shared.clock_ms();
    let ours = Message::Hello(shared.wire_hello(nonce, hello.nonce));
    if let Err(error) = conn.send(&shared.encoder, &ours) {
        return refuse(HandshakeError::Closed(format!("sending our hello failed: {error}")));
    }
    let attach = match read_attach(shared, conn, &mut inbound, deadline) {
        Ok(attach) => attach,
        Err(error) => return refuse(error),
    };
    if attach.echo != nonce {
        wrong_echo(shared, conn, "attach");
        return None;
    }
    conn.prove(sent_ms, shared.clock_ms());
    hello.agent_metadata = attach.agent_metadata;
    let info = PeerInfo { id: conn.id, addr: conn.addr, hello, inbound: true };
    if let Err(reason) = shared.handler.peer_joined(&info) {
        let reply = Message::Error(error_reply("incompatible", &reason.to_string()));
        conn.reply_and_close(
            &shared.encoder,
            &reply,
            format!("handler refused the peer: {reason}"),
        );
        return None;
    }
    // peer_joined accepted it: from here on the peer is owed a peer_lost, whatever happens.
    // The welcome is our own Attach: our agent metadata, for a peer that proved itself.
    let welcome = Message::Attach(Attach {
        echo: info.hello.nonce,
        agent_metadata: shared.hello.agent_metadata.clone(),
    });
    if let Err(error) = conn.join_and_welcome(&shared.encoder, &welcome, info) {
        return Some(format!("sending our welcome failed: {error}"));
    }
    Some(serve(shared, conn, inbound))
}

/// Refuses a handshake frame that does not echo this connection's challenge: counted, answered
/// and closed.
pub(super) fn wrong_echo(shared: &Shared, conn: &Connection, what: &'static str) {
    let error = HandshakeError::WrongEcho { what };
    let refusal = ProtocolError::Invalid { field: "echo", reason: error.to_string() };
    shared.handler.refused(None, &refusal);
    let reply = Message::Error(error_reply("unauthenticated", &error.to_string()));
    conn.reply_and_close(&shared.encoder, &reply, error.to_string());
}

/// Reads and dispatches frames, sends heartbeats, and watches for silence until the connection
/// ends; returns why it ended.
fn serve(shared: &Shared, conn: &Connection, mut inbound: Inbound) -> String {
    let config = &shared.config;
    let mut last_frame = Instant::now();
    let mut next_heartbeat = last_frame + config.heartbeat_interval;
    let mut heartbeats_sent = 0_u64;
    let mut refusals_in_a_row = 0_u32;
    loop {
        if let Some(reason) = conn.closed() {
            return reason.clone();
        }
        conn.flush(config.write_timeout);
        let now = Instant::now();
        if now >= next_heartbeat {
            // A worker that cannot act any more (its writer stopped) must not look alive:
            // peers then fence and fail its transfers instead of waiting on it.
            if let Err(reason) = shared.handler.healthy() {
                conn.close(format!("this worker is unhealthy: {reason}"));
                continue;
            }
            heartbeats_sent += 1;
            let heartbeat = heartbeat(shared, conn, heartbeats_sent);
            // A failed write closes the connection; the check at the top of the loop reports it.
            let _ = conn.post(&shared.encoder, &heartbeat);
            next_heartbeat = now + config.heartbeat_interval;
            continue;
        }
        match inbound.frames.poll(&conn.socket) {
            Ok(true) => {}
            Ok(false) => {
                // Only judged when nothing is waiting to be read: a slow handler delays reading,
                // and frames queued behind it mean the peer is alive.
                let silent = last_frame.elapsed();
                if silent > config.peer_timeout {
                    conn.close(format!(
                        "no heartbeat for {:.1}s (peer_timeout {:.1}s): the peer is hung, \
                         overloaded or unreachable",
                        silent.as_secs_f64(),
                        config.peer_timeout.as_secs_f64()
                    ));
                }
                continue;
            }
            Err(FrameError::Protocol(error)) => {
                shared.handler.refused(Some(conn.id), &error);
                let reason = format!("{error}; closed: the stream is out of sync");
                conn.reply_and_close(&shared.encoder, &error.to_reply(), reason);
                continue;
            }
            Err(end) => {
                let reason = describe_end(&end);
                conn.close(reason);
                continue;
            }
        }
        last_frame = Instant::now();
        let decoded = lock(&shared.decoder).decode(inbound.frames.frame(), unix_millis());
        inbound.frames.consume();
        let refusal = match decoded {
            Ok(envelope) => match envelope.message {
                Message::Heartbeat(heartbeat) => {
                    heard(shared, conn, &heartbeat);
                    None
                }
                Message::Hello(_) | Message::Attach(_) => Some(ProtocolError::Invalid {
                    field: "kind",
                    reason: "a handshake frame sent again after the handshake".to_owned(),
                }),
                Message::Done(_) => Some(ProtocolError::Invalid {
                    field: "done",
                    reason: "travels only as the NIXL notification of a WRITE, never on the side \
                             channel"
                        .to_owned(),
                }),
                message => {
                    shared.handler.message(conn.id, message);
                    None
                }
            },
            Err(error) => Some(error),
        };
        let Some(error) = refusal else {
            refusals_in_a_row = 0;
            continue;
        };
        shared.handler.refused(Some(conn.id), &error);
        refusals_in_a_row += 1;
        if loses_sync(&error) {
            let reason = format!("{error}; closed: the stream is out of sync");
            conn.reply_and_close(&shared.encoder, &error.to_reply(), reason);
        } else if refusals_in_a_row >= MAX_REFUSALS_IN_A_ROW {
            let reason = format!(
                "the peer sent {refusals_in_a_row} refused frames in a row, the last one: {error}"
            );
            conn.reply_and_close(&shared.encoder, &error.to_reply(), reason);
        } else {
            let _ = conn.post(&shared.encoder, &error.to_reply());
        }
    }
}

/// Refusals after which the connection is closed (docs/protocol.md §2.3): the bytes were not a
/// kvpush/1 frame, so the next frame boundary cannot be trusted either.
fn loses_sync(error: &ProtocolError) -> bool {
    matches!(
        error,
        ProtocolError::Oversized { .. }
            | ProtocolError::Truncated { .. }
            | ProtocolError::Malformed { .. }
    )
}

fn describe_end(end: &FrameError) -> String {
    match end {
        FrameError::Closed { mid_frame: false } => "the peer closed the connection".to_owned(),
        FrameError::Closed { mid_frame: true } => {
            "the peer closed the connection in the middle of a frame".to_owned()
        }
        FrameError::Io(error) => format!("the connection failed: {error}"),
        FrameError::Protocol(error) => error.to_string(),
    }
}

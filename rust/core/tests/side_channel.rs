//! The side channel over real TCP on 127.0.0.1: handshakes both ways, messages both ways and in
//! order, authentication, liveness (silence, drops), hostile bytes, and shutdown.
//!
//! Heartbeats and timeouts are set short so the whole file runs in a few seconds; waits are
//! bounded generously and assert what happened, not how fast.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::protocol::{
    frame_len, unix_millis, Attach, BlockGroup, Cancel, CancelAck, Decoder, Done, Encoder,
    ErrorReply, Fail, FailReason, Heartbeat, Hello, Limits, Message, ProtocolError, Register,
    Secret,
};
use kvpush_core::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig, SideChannelError,
};

/// Long enough for anything that should happen "promptly" on a loaded 2-core CI machine.
const WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Joined(PeerInfo),
    Message(PeerId, Message),
    Lost(PeerId, String),
    Refused(Option<PeerId>, String),
}

/// Records every callback; refuses peers whose engine id is in `refuse`.
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<Event>>,
    changed: Condvar,
    refuse: Mutex<Option<String>>,
}

impl Recorder {
    fn push(&self, event: Event) {
        self.events.lock().expect("recorder lock").push(event);
        self.changed.notify_all();
    }

    /// Waits up to [`WAIT`] for `done` to hold; returns whether it did. `done` may call the
    /// recorder's accessors (the lock is not held while it runs) and look at other state (it is
    /// re-evaluated at least every 20 ms).
    fn wait_for(&self, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + WAIT;
        loop {
            let seen = self.events.lock().expect("recorder lock").len();
            if done() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let events = self.events.lock().expect("recorder lock");
            if events.len() == seen {
                let nap = left.min(Duration::from_millis(20));
                drop(self.changed.wait_timeout(events, nap).expect("recorder lock"));
            }
        }
    }

    fn has(&self, wanted: impl Fn(&Event) -> bool) -> bool {
        self.events().iter().any(wanted)
    }

    fn events(&self) -> Vec<Event> {
        self.events.lock().expect("recorder lock").clone()
    }

    fn joined(&self) -> Vec<PeerInfo> {
        self.events()
            .into_iter()
            .filter_map(|e| if let Event::Joined(info) = e { Some(info) } else { None })
            .collect()
    }

    fn messages(&self, peer: PeerId) -> Vec<Message> {
        self.events()
            .into_iter()
            .filter_map(|e| match e {
                Event::Message(from, m) if from == peer => Some(m),
                _ => None,
            })
            .collect()
    }

    fn losses(&self, peer: PeerId) -> Vec<String> {
        self.events()
            .into_iter()
            .filter_map(|e| match e {
                Event::Lost(who, reason) if who == peer => Some(reason),
                _ => None,
            })
            .collect()
    }

    fn refusals(&self) -> Vec<String> {
        self.events()
            .into_iter()
            .filter_map(|e| if let Event::Refused(_, code) = e { Some(code) } else { None })
            .collect()
    }
}

impl ControlHandler for Recorder {
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
        if let Some(reason) = self.refuse.lock().expect("recorder lock").clone() {
            return Err(reason.into());
        }
        self.push(Event::Joined(peer.clone()));
        Ok(())
    }

    fn message(&self, peer: PeerId, message: Message) {
        self.push(Event::Message(peer, message));
    }

    fn peer_lost(&self, peer: PeerId, reason: &str) {
        self.push(Event::Lost(peer, reason.to_owned()));
    }

    fn refused(&self, peer: Option<PeerId>, error: &ProtocolError) {
        self.push(Event::Refused(peer, error.code().to_owned()));
    }
}

fn hello(engine_id: &str) -> Hello {
    Hello {
        engine_id: engine_id.into(),
        tp_rank: 0,
        tp_size: 2,
        pp_rank: 0,
        pp_size: 1,
        agent_name: format!("{engine_id}-agent"),
        agent_metadata: vec![7; 300],
        layout: KvLayout {
            regions: vec![Region { base: 0x1000, block_stride: 4096, num_blocks: 64, group: 0 }],
            block_tokens: 16,
            kernel_block_tokens: 16,
            heads: 4,
            head_bytes: 64,
            token_order: TokenOrder::Nhd,
            tp_rank: 0,
            tp_size: 2,
        },
        compatibility: "qwen3-0.6b/bf16/flash".into(),
        versions: vec![1],
        memory: kvpush_core::transport::MemorySpace::DRAM,
        nonce: 0,
        echo: 0,
        write_horizon_ms: 0,
        delivery_bound_ms: 0,
    }
}

/// `hello` as it reaches the other side: no agent metadata on the wire (the connector's comes in
/// its Attach), and this connection's challenge.
fn on_the_wire(hello: &Hello, seen: &Hello) -> Hello {
    Hello {
        agent_metadata: seen.agent_metadata.clone(),
        nonce: seen.nonce,
        echo: seen.echo,
        ..hello.clone()
    }
}

fn secret(byte: u8) -> Secret {
    Secret::from_bytes(&[byte; 32]).expect("32 bytes is long enough")
}

/// A test configuration: ephemeral port, short heartbeats.
fn config(engine_id: &str) -> SideChannelConfig {
    let mut config = SideChannelConfig::new(loopback(), engine_id);
    config.heartbeat_interval = Duration::from_millis(50);
    config.peer_timeout = Duration::from_millis(400);
    config.connect_timeout = Duration::from_secs(2);
    config
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn start(config: SideChannelConfig) -> (SideChannel, Arc<Recorder>) {
    let recorder = Arc::new(Recorder::default());
    let engine_id = config.sender.clone();
    let channel = SideChannel::start(config, hello(&engine_id), recorder.clone())
        .expect("side channel starts on 127.0.0.1:0");
    (channel, recorder)
}

fn register(n: u64) -> Message {
    Message::Register(Register {
        transfer_key: format!("xfer-{n}"),
        request_id: format!("cmpl-xfer-{n}-0-1a2b3c4d"),
        epoch: 1,
        engine_id: "decode-0".into(),
        address: "127.0.0.1:5600".into(),
        tp_rank: 0,
        tp_size: 1,
        groups: vec![BlockGroup { first_token: 0, block_ids: vec![1, 2, 3] }],
        num_tokens: 48,
        ttl_ms: 30_000,
        fanout: 1,
        nonce: 0,
    })
}

fn fail(n: u64) -> Message {
    Message::Fail(Fail {
        transfer_key: format!("xfer-{n}"),
        request_id: format!("cmpl-xfer-{n}-0-1a2b3c4d"),
        epoch: 1,
        reason: FailReason::Expired,
        detail: "lease ran out".into(),
    })
}

/// A raw client speaking kvpush/1 by hand, to play a broken or hostile peer.
struct RawPeer {
    socket: TcpStream,
    encoder: Encoder,
    decoder: Decoder,
}

impl RawPeer {
    fn connect(addr: SocketAddr, secret: Option<Secret>) -> Self {
        let socket = TcpStream::connect(addr).expect("raw connect");
        socket.set_read_timeout(Some(WAIT)).expect("read timeout");
        Self {
            socket,
            encoder: Encoder::new("raw-peer", secret.clone()),
            decoder: Decoder::new(secret, Limits::default()),
        }
    }

    fn send(&mut self, message: &Message) {
        let frame = self.encoder.encode(message, unix_millis());
        self.socket.write_all(&frame).expect("raw write");
    }

    /// Does a connector's handshake (Hello with a challenge, the channel's Hello answering it,
    /// our Attach answering the channel's, its welcome) and returns the channel's Hello.
    fn handshake(&mut self) -> Hello {
        self.send(&Message::Hello(Hello { nonce: 41, ..hello("raw-peer") }));
        let theirs = match self.receive() {
            Some(Message::Hello(hello)) => hello,
            other => panic!("expected the channel's hello, got {other:?}"),
        };
        assert_eq!(theirs.echo, 41, "the channel's hello answers our challenge");
        assert!(theirs.agent_metadata.is_empty(), "no agent metadata before we proved anything");
        self.send(&Message::Attach(Attach { echo: theirs.nonce, agent_metadata: vec![7; 300] }));
        match self.receive() {
            Some(Message::Attach(welcome)) if welcome.echo == 41 => theirs,
            other => panic!("expected the channel's welcome attach, got {other:?}"),
        }
    }

    /// The next message, or `None` once the channel closed the connection.
    fn receive(&mut self) -> Option<Message> {
        let mut prefix = [0; 4];
        if let Err(error) = self.socket.read_exact(&mut prefix) {
            assert!(
                matches!(error.kind(), ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset),
                "expected the channel to close the connection, got {error}"
            );
            return None;
        }
        let len = frame_len(&prefix, &Limits::default()).expect("sane prefix").expect("4 bytes");
        let mut frame = prefix.to_vec();
        frame.resize(len, 0);
        self.socket.read_exact(&mut frame[4..]).expect("whole frame");
        Some(self.decoder.decode(&frame, unix_millis()).expect("valid frame").message)
    }

    /// The next message that is not a heartbeat.
    fn receive_skipping_heartbeats(&mut self) -> Option<Message> {
        loop {
            match self.receive() {
                Some(Message::Heartbeat(_)) => continue,
                other => return other,
            }
        }
    }

    /// Whether the channel closes the connection (after any number of frames).
    fn closed_by_channel(&mut self) -> bool {
        let mut sink = [0; 4096];
        loop {
            match self.socket.read(&mut sink) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(error) if error.kind() == ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

fn only_peer(channel: &SideChannel) -> PeerInfo {
    let peers = channel.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    peers[0].clone()
}

#[test]
fn handshake_delivers_each_sides_hello_to_the_other() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, d_events) = start(config("decode-0"));

    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    // P's metadata reached D (in P's welcome Attach, after D proved itself).
    assert_eq!(p.hello.agent_metadata, hello("prefill-0").agent_metadata);
    assert_eq!(p.hello, on_the_wire(&hello("prefill-0"), &p.hello));
    assert_eq!(p.addr, prefill.local_addr());
    assert_eq!(d_events.joined(), vec![p.clone()]);
    assert_eq!(decode.peers(), vec![p.clone()]);

    assert!(p_events.wait_for(|| prefill.peers().len() == 1));
    let d = only_peer(&prefill);
    // D's metadata reached P (in its Attach), and each side's challenge was answered.
    assert_eq!(d.hello.agent_metadata, hello("decode-0").agent_metadata);
    assert_eq!(d.hello, on_the_wire(&hello("decode-0"), &d.hello));
    assert_eq!(p.hello.echo, d.hello.nonce);
    assert_ne!(d.hello.nonce, 0);
    assert_eq!(p_events.joined(), vec![d]);
    assert!(p_events.refusals().is_empty() && d_events.refusals().is_empty());
}

#[test]
fn messages_flow_both_ways_in_order() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, d_events) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    assert!(p_events.wait_for(|| prefill.peers().len() == 1));
    let d = only_peer(&prefill);

    let to_p: Vec<Message> = (0..200)
        .map(|n| {
            if n % 3 == 2 {
                Message::Cancel(Cancel {
                    transfer_key: format!("xfer-{n}"),
                    request_id: format!("r-{n}"),
                    epoch: n,
                })
            } else {
                register(n)
            }
        })
        .collect();
    let to_d: Vec<Message> = (0..200)
        .map(|n| {
            if n % 2 == 1 {
                Message::CancelAck(CancelAck {
                    transfer_key: format!("xfer-{n}"),
                    request_id: format!("r-{n}"),
                    epoch: n,
                    wrote: n % 4 == 1,
                    delivered: false,
                })
            } else {
                fail(n)
            }
        })
        .collect();
    std::thread::scope(|scope| {
        scope.spawn(|| to_p.iter().for_each(|m| decode.send(p.id, m).expect("send to P")));
        scope.spawn(|| to_d.iter().for_each(|m| prefill.send(d.id, m).expect("send to D")));
    });

    assert!(p_events.wait_for(|| p_events.messages(d.id).len() == to_p.len()));
    assert!(d_events.wait_for(|| d_events.messages(p.id).len() == to_d.len()));
    assert_eq!(p_events.messages(d.id), to_p);
    assert_eq!(d_events.messages(p.id), to_d);
}

#[test]
fn concurrent_senders_to_one_peer_never_interleave_frames() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, _d_events) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    std::thread::scope(|scope| {
        for t in 0..4_u64 {
            let decode = &decode;
            scope.spawn(move || {
                for n in 0..50 {
                    decode.send(p.id, &register(t * 1000 + n)).expect("send");
                }
            });
        }
    });
    assert!(p_events.wait_for(|| {
        p_events.events().iter().filter(|e| matches!(e, Event::Message(..))).count() == 200
    }));
    assert!(p_events.refusals().is_empty(), "{:?}", p_events.refusals());
    // Each sender's own messages keep their order.
    let keys: Vec<u64> = p_events
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Message(_, Message::Register(r)) => r.transfer_key[5..].parse().ok(),
            _ => None,
        })
        .collect();
    for t in 0..4 {
        let mine: Vec<u64> = keys.iter().copied().filter(|k| k / 1000 == t).collect();
        assert!(mine.windows(2).all(|w| w[0] < w[1]), "sender {t}: {mine:?}");
    }
}

#[test]
fn signed_channels_talk_and_a_different_secret_is_refused_and_counted() {
    let signed = |engine_id: &str, byte: u8| {
        let mut config = config(engine_id);
        config.secret = Some(secret(byte));
        config
    };
    let (prefill, p_events) = start(signed("prefill-0", 1));
    let (decode, d_events) = start(signed("decode-0", 1));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("same secret");
    decode.send(p.id, &register(1)).expect("signed send");
    assert!(p_events.wait_for(|| p_events.has(|e| matches!(e, Event::Message(..)))));

    let (intruder, i_events) = start(signed("decode-1", 2));
    let err = intruder.connect(&prefill.local_addr().to_string()).unwrap_err();
    let SideChannelError::Handshake { reason, .. } = &err else { panic!("{err:?}") };
    assert!(reason.contains("signature does not verify"), "{err}");
    assert!(p_events.wait_for(|| p_events.refusals() == ["bad_signature"]));
    // The intruder could not verify P's (signed) error reply either.
    assert_eq!(i_events.refusals(), ["bad_signature"]);
    assert!(i_events.joined().is_empty());
    assert_eq!(p_events.joined().len(), 1);
    assert_eq!(prefill.peers().len(), 1);

    // An unsigned peer is refused too, and can read why: unsigned frames are ignored-MAC ones.
    let (unsigned, _) = start(config("decode-2"));
    let err = unsigned.connect(&prefill.local_addr().to_string()).unwrap_err();
    let SideChannelError::Refused { code, .. } = &err else { panic!("{err:?}") };
    assert_eq!(code, "unauthenticated", "{err}");
    assert!(p_events.wait_for(|| p_events.refusals().len() == 2));
    drop(d_events);
}

#[test]
fn a_silent_peer_is_lost_after_peer_timeout() {
    let (prefill, p_events) = start(config("prefill-0"));
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    let theirs = raw.handshake();
    assert_eq!(theirs, on_the_wire(&hello("prefill-0"), &theirs));
    let d = only_peer(&prefill);
    // The channel keeps sending us heartbeats while we say nothing.
    assert!(matches!(raw.receive(), Some(Message::Heartbeat(Heartbeat { seq: 1, .. }))));

    assert!(p_events.wait_for(|| !p_events.losses(d.id).is_empty()));
    let losses = p_events.losses(d.id);
    assert_eq!(losses.len(), 1);
    assert!(losses[0].contains("no heartbeat for"), "{losses:?}");
    assert!(raw.closed_by_channel());
    assert!(prefill.peers().is_empty());
}

#[test]
fn a_peer_that_does_not_read_is_lost_by_its_frames_deadline_and_never_blocks_the_sender() {
    let mut slow = config("prefill-0");
    slow.write_timeout = Duration::from_millis(300);
    // Not silent, only not reading: silence must not be what ends it.
    slow.peer_timeout = Duration::from_secs(30);
    let (prefill, p_events) = start(slow);
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.handshake();
    let d = only_peer(&prefill);
    // ~250 KiB frames: the socket buffers fill after a few, and the rest queue.
    let big = match register(1) {
        Message::Register(mut r) => {
            r.groups[0].block_ids = (0..60_000).collect();
            Message::Register(r)
        }
        _ => unreachable!(),
    };
    let mut accepted = 0;
    while prefill.send(d.id, &big).is_ok() {
        accepted += 1;
        assert!(accepted < 10_000, "a peer that reads nothing was never given up on");
    }
    assert!(accepted > 1, "sends past a full socket buffer are queued, not refused");
    assert!(p_events.wait_for(|| !p_events.losses(d.id).is_empty()));
    let losses = p_events.losses(d.id);
    assert!(
        losses[0].contains("not reading") && losses[0].contains("queued"),
        "lost for its frame's deadline or the queue's bound: {losses:?}"
    );
    drop(raw);
}

#[test]
fn a_peer_that_heartbeats_stays_joined() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, d_events) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    // Three peer timeouts of idleness: only heartbeats travel.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(decode.peers().len(), 1);
    assert_eq!(prefill.peers().len(), 1);
    assert!(d_events.losses(p.id).is_empty());
    assert!(p_events.events().iter().all(|e| matches!(e, Event::Joined(_))));
}

#[test]
fn a_dropped_connection_is_lost_quickly_and_exactly_once() {
    let mut patient = config("prefill-0");
    // Long enough that only the drop itself can explain a loss within WAIT.
    patient.peer_timeout = Duration::from_secs(30);
    let (prefill, p_events) = start(patient);
    let (decode, d_events) = start(config("decode-0"));

    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    assert!(p_events.wait_for(|| prefill.peers().len() == 1));
    let d = only_peer(&prefill);
    decode.disconnect(p.id);
    assert!(d_events.wait_for(|| !d_events.losses(p.id).is_empty()));
    assert!(p_events.wait_for(|| !p_events.losses(d.id).is_empty()));
    assert_eq!(d_events.losses(p.id), ["disconnected by this side"]);
    assert_eq!(p_events.losses(d.id), ["the peer closed the connection"]);
    assert!(
        matches!(decode.send(p.id, &register(1)), Err(SideChannelError::UnknownPeer(id)) if id == p.id)
    );

    // A raw peer that vanishes.
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.handshake();
    let r = prefill.peers().into_iter().find(|peer| peer.id != d.id).expect("raw peer joined");
    drop(raw);
    assert!(p_events.wait_for(|| !p_events.losses(r.id).is_empty()));

    // Nothing more is reported later.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(p_events.losses(d.id).len(), 1);
    assert_eq!(p_events.losses(r.id).len(), 1);
    assert_eq!(d_events.losses(p.id).len(), 1);
}

#[test]
fn oversized_and_garbage_frames_are_refused_counted_and_survived() {
    let mut small = config("prefill-0");
    small.limits.max_frame_bytes = 64 << 10;
    let (prefill, p_events) = start(small);

    // Before the handshake: an oversized prefix. Refused without reading on, answered, closed.
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.socket.write_all(&u32::MAX.to_be_bytes()).expect("write");
    let reply = raw.receive();
    assert!(
        matches!(&reply, Some(Message::Error(ErrorReply { code, .. })) if code == "oversized"),
        "{reply:?}"
    );
    assert!(raw.closed_by_channel());

    // Garbage of a plausible length: malformed, the stream cannot be trusted, closed.
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.handshake();
    let mut garbage = 40_u32.to_be_bytes().to_vec();
    garbage.extend((0..40).map(|i: u8| i.wrapping_mul(37)));
    raw.socket.write_all(&garbage).expect("write");
    let reply = raw.receive_skipping_heartbeats();
    assert!(
        matches!(&reply, Some(Message::Error(ErrorReply { code, .. })) if code == "malformed"),
        "{reply:?}"
    );
    assert!(raw.closed_by_channel());

    // In-sync refusals (a field over the limits, a `done`, a second hello) are answered and the
    // connection stays up.
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.handshake();
    let r = prefill.peers().into_iter().last().expect("raw peer joined");
    raw.send(&Message::Cancel(Cancel {
        transfer_key: String::new(),
        request_id: "r".into(),
        epoch: 1,
    }));
    raw.send(&Message::Done(Done {
        transfer_key: "k".into(),
        request_id: "r".into(),
        epoch: 1,
        tp_rank: 0,
        tp_size: 1,
        bytes: 1,
        runs: 1,
        nonce: 0,
    }));
    raw.send(&Message::Hello(hello("raw-peer")));
    for _ in 0..3 {
        let reply = raw.receive_skipping_heartbeats();
        assert!(
            matches!(&reply, Some(Message::Error(ErrorReply { code, .. })) if code == "invalid"),
            "{reply:?}"
        );
    }
    raw.send(&register(9));
    assert!(p_events.wait_for(|| p_events.messages(r.id) == [register(9)]));
    assert_eq!(
        p_events.refusals(),
        ["oversized", "malformed", "invalid", "invalid", "invalid"],
        "{:?}",
        p_events.events()
    );

    // A peer that sends nothing but refused frames is cut off.
    for _ in 0..20 {
        raw.send(&Message::Hello(hello("raw-peer")));
    }
    assert!(raw.closed_by_channel());
    assert!(p_events.wait_for(|| p_events.losses(r.id).len() == 1));

    // The channel still serves.
    let (decode, _) = start(config("decode-0"));
    decode.connect(&prefill.local_addr().to_string()).expect("channel survived");
}

#[test]
fn a_first_frame_other_than_hello_is_refused() {
    let (prefill, p_events) = start(config("prefill-0"));
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.send(&register(1));
    let reply = raw.receive();
    assert!(
        matches!(&reply, Some(Message::Error(ErrorReply { code, detail })) if code == "invalid" && detail.contains("hello")),
        "{reply:?}"
    );
    assert!(raw.closed_by_channel());
    assert!(p_events.joined().is_empty());
}

#[test]
fn handler_refusal_reaches_the_connecting_side_with_its_reason() {
    let (prefill, p_events) = start(config("prefill-0"));
    *p_events.refuse.lock().expect("lock") = Some("layout has 3 regions, planner needs 2".into());
    let (decode, d_events) = start(config("decode-0"));
    let err = decode.connect(&prefill.local_addr().to_string()).unwrap_err();
    let SideChannelError::Refused { code, detail, .. } = &err else { panic!("{err:?}") };
    assert_eq!(code, "incompatible");
    assert!(detail.contains("planner needs 2"), "{err}");
    assert!(prefill.peers().is_empty() && decode.peers().is_empty());
    assert!(d_events.events().is_empty(), "no join, so no loss either");

    // And the connecting side's handler may refuse the accepting side.
    *p_events.refuse.lock().expect("lock") = None;
    *d_events.refuse.lock().expect("lock") = Some("prefill runs TP 2, we need TP 1".into());
    let err = decode.connect(&prefill.local_addr().to_string()).unwrap_err();
    let SideChannelError::Handshake { reason, .. } = &err else { panic!("{err:?}") };
    assert!(reason.contains("we need TP 1"), "{err}");
    // P had accepted D, then learns of the refusal: its peer is lost once.
    assert!(p_events.wait_for(|| p_events.has(|e| matches!(e, Event::Lost(..)))));
    assert!(p_events.wait_for(|| prefill.peers().is_empty()));
}

#[test]
fn incompatible_hellos_are_refused_by_the_channel() {
    let (prefill, _) = start(config("prefill-0"));
    let recorder = Arc::new(Recorder::default());
    let mut other_model = hello("decode-0");
    other_model.compatibility = "llama-70b/fp8".into();
    let decode =
        SideChannel::start(config("decode-0"), other_model, recorder.clone()).expect("starts");
    let err = decode.connect(&prefill.local_addr().to_string()).unwrap_err();
    let SideChannelError::Refused { code, detail, .. } = &err else { panic!("{err:?}") };
    assert_eq!(code, "incompatible");
    assert!(detail.contains("llama-70b/fp8"), "{err}");

    let mut newer = hello("decode-1");
    newer.versions = vec![2, 3];
    let decode = SideChannel::start(config("decode-1"), newer, recorder.clone()).expect("starts");
    let err = decode.connect(&prefill.local_addr().to_string()).unwrap_err();
    assert!(
        matches!(&err, SideChannelError::Refused { code, .. } if code == "unsupported_version"),
        "{err}"
    );
    assert!(recorder.events().is_empty());
}

#[test]
fn connections_beyond_the_cap_are_refused() {
    let mut capped = config("prefill-0");
    capped.max_connections = 1;
    let (prefill, _) = start(capped);
    let (first, _) = start(config("decode-0"));
    first.connect(&prefill.local_addr().to_string()).expect("first fits");
    let (second, _) = start(config("decode-1"));
    let err = second.connect(&prefill.local_addr().to_string()).unwrap_err();
    assert!(
        matches!(&err, SideChannelError::Refused { code, .. } if code == "too_many_connections"),
        "{err}"
    );
}

#[test]
fn close_is_idempotent_reports_every_peer_and_joins_every_thread() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, d_events) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.handshake();
    let peers = prefill.peers();
    assert_eq!(peers.len(), 2);

    prefill.close();
    prefill.close();
    // close() returned after joining: every peer_lost has already been delivered.
    for peer in &peers {
        assert_eq!(p_events.losses(peer.id), ["the side channel was closed by this side"]);
    }
    assert!(prefill.peers().is_empty());
    assert!(matches!(prefill.send(peers[0].id, &register(1)), Err(SideChannelError::Closed)));
    assert!(matches!(
        prefill.connect(&decode.local_addr().to_string()),
        Err(SideChannelError::Closed)
    ));
    assert!(raw.closed_by_channel());
    assert!(d_events.wait_for(|| d_events.losses(p.id).len() == 1));
    // Nothing connects any more.
    assert!(TcpStream::connect(prefill.local_addr()).is_err());

    // Every thread has exited: none holds the handler any more.
    drop(prefill);
    assert_eq!(Arc::strong_count(&p_events), 1);
    drop(decode);
    assert_eq!(Arc::strong_count(&d_events), 1);
}

#[test]
fn closing_from_inside_a_callback_does_not_deadlock() {
    struct CloseOnMessage(Mutex<Option<Arc<SideChannel>>>, Recorder);
    impl ControlHandler for CloseOnMessage {
        fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
            self.1.peer_joined(peer)
        }
        fn message(&self, _: PeerId, _: Message) {
            let channel = self.0.lock().expect("lock").take();
            if let Some(channel) = channel {
                channel.close();
            }
        }
        fn peer_lost(&self, peer: PeerId, reason: &str) {
            self.1.peer_lost(peer, reason);
        }
    }
    let handler = Arc::new(CloseOnMessage(Mutex::new(None), Recorder::default()));
    let prefill = Arc::new(
        SideChannel::start(config("prefill-0"), hello("prefill-0"), handler.clone())
            .expect("starts"),
    );
    *handler.0.lock().expect("lock") = Some(Arc::clone(&prefill));
    let (decode, _) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    decode.send(p.id, &register(1)).expect("send");
    assert!(handler.1.wait_for(|| handler.1.has(|e| matches!(e, Event::Lost(..)))));
    assert!(prefill.peers().is_empty());
}

#[test]
fn connecting_to_a_closed_port_fails_with_a_connect_error() {
    let port = {
        let listener = TcpListener::bind(loopback()).expect("bind");
        listener.local_addr().expect("addr")
    };
    let (decode, events) = start(config("decode-0"));
    let err = decode.connect(&port.to_string()).unwrap_err();
    assert!(
        matches!(&err, SideChannelError::Connect { addr, .. } if *addr == port.to_string()),
        "{err}"
    );
    let err = decode.connect("not an address").unwrap_err();
    assert!(matches!(err, SideChannelError::Connect { .. }), "{err}");
    assert!(events.events().is_empty());
}

#[test]
fn a_listener_that_never_answers_times_out_the_handshake() {
    let mute = TcpListener::bind(loopback()).expect("bind");
    let mut quick = config("decode-0");
    quick.connect_timeout = Duration::from_millis(200);
    let (decode, _) = start(quick);
    let err = decode.connect(&mute.local_addr().expect("addr").to_string()).unwrap_err();
    let SideChannelError::Handshake { reason, .. } = &err else { panic!("{err:?}") };
    assert!(reason.contains("no hello within connect_timeout"), "{err}");
}

#[test]
fn messages_that_do_not_travel_here_or_break_limits_are_not_sent() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, _) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    let err = decode.send(p.id, &Message::Hello(hello("decode-0"))).unwrap_err();
    assert!(matches!(err, SideChannelError::Invalid { .. }), "{err}");
    let attach = Message::Attach(Attach { echo: 1, agent_metadata: vec![1] });
    let err = decode.send(p.id, &attach).unwrap_err();
    assert!(matches!(err, SideChannelError::Invalid { .. }), "{err}");
    let empty_key =
        Message::Cancel(Cancel { transfer_key: String::new(), request_id: "r".into(), epoch: 1 });
    let err = decode.send(p.id, &empty_key).unwrap_err();
    assert!(matches!(err, SideChannelError::Invalid { .. }), "{err}");
    assert!(matches!(decode.send(999, &register(1)), Err(SideChannelError::UnknownPeer(999))));
    decode.send(p.id, &register(1)).expect("the connection is unaffected");
    assert!(p_events.wait_for(|| p_events.has(|e| matches!(e, Event::Message(..)))));
    assert!(p_events.refusals().is_empty());
}

#[test]
fn inconsistent_configurations_are_refused_at_start() {
    let mut bad = config("prefill-0");
    bad.peer_timeout = bad.heartbeat_interval;
    let err =
        SideChannel::start(bad, hello("prefill-0"), Arc::new(Recorder::default())).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("peer_timeout"), "{err}");
}

/// Captures the bytes a connector writes when it connects to a fake listener: its first frame.
fn captured_hello_frame(secret: Option<Secret>) -> Vec<u8> {
    let listener = TcpListener::bind(loopback()).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut decode_config = config("decode-0");
    decode_config.secret = secret;
    decode_config.connect_timeout = Duration::from_millis(300);
    let (decode, _) = start(decode_config);
    let connector = std::thread::spawn(move || {
        let _ = decode.connect(&addr.to_string());
    });
    let (mut socket, _) = listener.accept().expect("accept");
    socket.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut prefix = [0; 4];
    socket.read_exact(&mut prefix).expect("prefix");
    let len = frame_len(&prefix, &Limits::default()).expect("sane").expect("4 bytes");
    let mut frame = prefix.to_vec();
    frame.resize(len, 0);
    socket.read_exact(&mut frame[4..]).expect("frame");
    connector.join().expect("connector");
    frame
}

#[test]
fn a_connectors_hello_carries_no_agent_metadata_and_a_fresh_challenge() {
    let frame = captured_hello_frame(Some(secret(1)));
    let mut decoder = Decoder::new(Some(secret(1)), Limits::default());
    let Message::Hello(sent) = decoder.decode(&frame, unix_millis()).expect("signed hello").message
    else {
        panic!("the first frame is a hello");
    };
    assert!(sent.agent_metadata.is_empty(), "metadata left before the peer proved anything");
    assert_ne!(sent.nonce, 0);
    let again = captured_hello_frame(Some(secret(1)));
    let Message::Hello(second) = decoder.decode(&again, unix_millis()).expect("hello").message
    else {
        panic!("hello");
    };
    assert_ne!(second.nonce, sent.nonce, "every connection poses a new challenge");
}

#[test]
fn a_replayed_hello_gets_no_further_than_the_challenge() {
    let mut prefill_config = config("prefill-0");
    prefill_config.secret = Some(secret(1));
    let (prefill, p_events) = start(prefill_config);
    // A genuine D's Hello, captured on the wire, replayed by someone without the secret.
    let frame = captured_hello_frame(Some(secret(1)));
    // It signs with a key of its own; it reads with the real one only so the test can see.
    let mut raw = RawPeer::connect(prefill.local_addr(), Some(secret(1)));
    raw.encoder = Encoder::new("replayer", Some(secret(2)));
    raw.socket.write_all(&frame).expect("replay");
    // The channel answers with its Hello (it cannot tell a replay yet) ...
    let Some(Message::Hello(_)) = raw.receive() else { panic!("expected the channel's hello") };
    // ... but the replayer cannot sign an Attach that answers its challenge.
    raw.send(&Message::Attach(Attach { echo: 1, agent_metadata: vec![1; 16] }));
    assert!(raw.closed_by_channel());
    assert!(p_events.joined().is_empty(), "a replayed handshake joined: {:?}", p_events.events());
    assert!(p_events.wait_for(|| !p_events.refusals().is_empty()));
}

#[test]
fn an_attach_that_does_not_answer_the_challenge_is_refused() {
    let (prefill, p_events) = start(config("prefill-0"));
    let mut raw = RawPeer::connect(prefill.local_addr(), None);
    raw.send(&Message::Hello(Hello { nonce: 5, ..hello("raw-peer") }));
    let Some(Message::Hello(theirs)) = raw.receive() else { panic!("expected a hello") };
    raw.send(&Message::Attach(Attach {
        echo: theirs.nonce.wrapping_add(1),
        agent_metadata: vec![1; 16],
    }));
    let Some(Message::Error(reply)) = raw.receive() else { panic!("expected an error reply") };
    assert_eq!(reply.code, "unauthenticated");
    assert!(raw.closed_by_channel());
    assert!(p_events.joined().is_empty());
}

#[test]
fn a_large_frame_before_the_handshake_is_refused_without_being_read() {
    let (prefill, p_events) = start(config("prefill-0"));
    let mut socket = TcpStream::connect(prefill.local_addr()).expect("connect");
    socket.set_read_timeout(Some(WAIT)).expect("timeout");
    // Announces 1 MiB: allowed after the handshake, not before it.
    socket.write_all(&(1_u32 << 20).to_be_bytes()).expect("prefix");
    let mut sink = Vec::new();
    let _ = socket.read_to_end(&mut sink);
    assert!(p_events.wait_for(|| p_events.refusals().contains(&"oversized".to_owned())));
}

#[test]
fn connections_from_one_host_and_handshakes_are_capped() {
    let mut prefill_config = config("prefill-0");
    prefill_config.max_handshakes = 4;
    let (prefill, _) = start(prefill_config);
    // Silent connections hold handshake slots until connect_timeout; the fifth is turned away.
    let silent: Vec<TcpStream> =
        (0..4).map(|_| TcpStream::connect(prefill.local_addr()).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut fifth = RawPeer::connect(prefill.local_addr(), None);
    let Some(Message::Error(reply)) = fifth.receive() else { panic!("expected a refusal") };
    assert_eq!(reply.code, "too_many_connections");
    drop(silent);
}

#[test]
fn a_routable_address_without_a_secret_refuses_to_start_unless_allowed() {
    let mut open = config("prefill-0");
    open.bind = "0.0.0.0:0".parse().expect("addr");
    let Err(error) =
        SideChannel::start(open.clone(), hello("prefill-0"), Arc::new(Recorder::default()))
    else {
        panic!("started without a secret on 0.0.0.0");
    };
    assert_eq!(error.kind(), ErrorKind::PermissionDenied);
    assert!(error.to_string().contains("KVPUSH_SECRET"), "{error}");
    let mut signed = open.clone();
    signed.secret = Some(secret(1));
    assert!(SideChannel::start(signed, hello("prefill-0"), Arc::new(Recorder::default())).is_ok());
    open.allow_insecure = true;
    assert!(SideChannel::start(open, hello("prefill-0"), Arc::new(Recorder::default())).is_ok());
}

#[test]
fn without_a_secret_a_channel_connects_only_to_loopback_unless_allowed() {
    let mut open = config("decode-0");
    open.connect_timeout = Duration::from_millis(300);
    let (decode, _) = start(open.clone());
    // TEST-NET-1: documentation addresses, never loopback.
    let refused = decode.connect("192.0.2.1:5600").expect_err("connected without a secret");
    assert!(
        matches!(&refused, SideChannelError::Insecure { addr, ip }
            if addr == "192.0.2.1:5600" && ip.to_string() == "192.0.2.1"),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("KVPUSH_INSECURE"), "{refused}");
    // Loopback needs no secret.
    let (prefill, _) = start(config("prefill-0"));
    decode.connect(&prefill.local_addr().to_string()).expect("a loopback peer");
    // With a secret, or the operator's opt-out, the channel tries the address itself.
    let mut signed = open.clone();
    signed.secret = Some(secret(1));
    open.allow_insecure = true;
    for config in [signed, open] {
        let (channel, _) = start(config);
        let tried = channel.connect("192.0.2.1:5600").expect_err("nothing listens there");
        assert!(matches!(tried, SideChannelError::Connect { .. }), "{tried:?}");
    }
}

#[test]
fn heartbeats_echo_each_others_clock_and_prove_liveness() {
    let (prefill, p_events) = start(config("prefill-0"));
    let (decode, _) = start(config("decode-0"));
    let p = decode.connect(&prefill.local_addr().to_string()).expect("handshake");
    assert!(p_events.wait_for(|| prefill.peers().len() == 1));
    let d = only_peer(&prefill);
    // The handshake itself proves each side alive (the answer to our challenge).
    let first = prefill.proof_age(d.id).expect("proof from the handshake");
    assert!(decode.proof_age(p.id).is_some());
    // Heartbeats (100 ms here) keep renewing it: it never grows past a few intervals.
    std::thread::sleep(Duration::from_millis(600));
    let later = prefill.proof_age(d.id).expect("proof");
    assert!(later < Duration::from_millis(600) + first, "proof stopped renewing: {later:?}");
    // A peer that is gone has no proof.
    decode.close();
    assert!(p_events.wait_for(|| prefill.proof_age(d.id).is_none()));
}

#[test]
fn a_frame_replayed_on_another_connection_is_refused() {
    let mut prefill_config = config("prefill-0");
    prefill_config.secret = Some(secret(1));
    let (prefill, p_events) = start(prefill_config);
    let mut first = RawPeer::connect(prefill.local_addr(), Some(secret(1)));
    first.handshake();
    let cancel = Message::Cancel(Cancel {
        transfer_key: "xfer-9".into(),
        request_id: "req-9".into(),
        epoch: 1,
    });
    let frame = first.encoder.encode(&cancel, unix_millis());
    first.socket.write_all(&frame).expect("write");
    assert!(
        p_events.wait_for(|| p_events.has(|e| matches!(e, Event::Message(_, m) if *m == cancel)))
    );
    // The same bytes on a second (authenticated) connection: the receiver has seen them.
    let mut second = RawPeer::connect(prefill.local_addr(), Some(secret(1)));
    second.handshake();
    second.socket.write_all(&frame).expect("write");
    assert!(p_events.wait_for(|| p_events.refusals().contains(&"replayed".to_owned())));
    let delivered = p_events
        .events()
        .iter()
        .filter(|e| matches!(e, Event::Message(_, m) if *m == cancel))
        .count();
    assert_eq!(delivered, 1, "a replayed frame was delivered twice");
}

//! Two endpoints in one process over the loopback transport and a real TCP side channel: the
//! whole push path (registration, match, plan, WRITE, DONE) and its failure paths.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is the test failing

mod support;

use support::{Fault, Faulty, Gate, Posted};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpush_core::endpoint::{
    AbortOutcome, Endpoint, EndpointConfig, EndpointError, Event, Expectation, LayerStreams,
    Outcome, ReadyKv, Reason, Role,
};
use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::{
    unix_millis, BlockGroup, Cancel, Done, Encoder, Hello, Message, Register, Secret,
    PROTOCOL_VERSION,
};
use kvpush_core::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
};
use kvpush_core::transport::{MemoryRegion, MemorySpace, Transport};

const TOKEN_BYTES: u64 = 16; // 2 heads x 8 bytes
const SECRET: &[u8] = b"endpoint-test-shared-secret";
const REGIONS: u64 = 4;
const BLOCKS: u32 = 32;

/// A worker's KV memory: `REGIONS` regions of `BLOCKS` blocks of `block_tokens` tokens.
struct Cache {
    memory: Vec<u8>,
    block_tokens: u32,
    /// KV cache groups: region `r` belongs to group `r % groups`.
    groups: u32,
    /// Every WRITE the endpoints made from this cache posted, in order.
    posts: Arc<Mutex<Vec<Posted>>>,
}

impl Cache {
    fn new(block_tokens: u32, fill: impl Fn(usize) -> u8) -> Self {
        Self::grouped(block_tokens, 1, fill)
    }

    fn grouped(block_tokens: u32, groups: u32, fill: impl Fn(usize) -> u8) -> Self {
        let len = (REGIONS * u64::from(BLOCKS) * u64::from(block_tokens) * TOKEN_BYTES) as usize;
        let posts = Arc::default();
        Self { memory: (0..len).map(fill).collect(), block_tokens, groups, posts }
    }

    fn posts(&self) -> Vec<Posted> {
        self.posts.lock().unwrap().clone()
    }

    fn region_bytes(&self) -> u64 {
        u64::from(BLOCKS) * u64::from(self.block_tokens) * TOKEN_BYTES
    }

    fn layout(&self) -> KvLayout {
        let base = self.memory.as_ptr() as u64;
        KvLayout {
            regions: (0..REGIONS)
                .map(|r| Region {
                    base: base + r * self.region_bytes(),
                    block_stride: u64::from(self.block_tokens) * TOKEN_BYTES,
                    num_blocks: BLOCKS,
                    group: r as u32 % self.groups,
                })
                .collect(),
            block_tokens: self.block_tokens,
            kernel_block_tokens: self.block_tokens,
            heads: 2,
            head_bytes: 8,
            token_order: TokenOrder::Nhd,
            tp_rank: 0,
            tp_size: 1,
        }
    }

    /// Byte offset of `token` in `region`, for a request whose blocks start at `first`.
    fn offset(&self, region: u64, blocks: &[u32], first: u64, token: u64) -> usize {
        let bt = u64::from(self.block_tokens);
        let block = u64::from(blocks[((token - first) / bt) as usize]);
        (region * self.region_bytes() + (block * bt + token % bt) * TOKEN_BYTES) as usize
    }

    fn endpoint(&self, name: &str) -> Endpoint {
        self.endpoint_with(name, Fault::None, |_| {})
    }

    /// An endpoint whose transport misbehaves as `fault` says, configured by `tune`.
    fn endpoint_with(
        &self,
        name: &str,
        fault: Fault,
        tune: impl FnOnce(&mut EndpointConfig),
    ) -> Endpoint {
        self.endpoint_gated(name, None, fault, None, tune)
    }

    /// An endpoint whose writer sticks in the transport (taking notifications, which it does
    /// every turn of its loop) until `gate` opens.
    fn endpoint_stalled(
        &self,
        name: &str,
        gate: &Gate,
        tune: impl FnOnce(&mut EndpointConfig),
    ) -> Endpoint {
        self.endpoint_gated(name, None, Fault::None, Some(gate.clone()), tune)
    }

    /// An endpoint whose transport agent (named `name`, as its engine) calls itself `claimed`
    /// when given: the name its Hello declares and its DONEs are signed as, while its metadata
    /// stays its own (a second process reusing another's agent name).
    fn endpoint_as(
        &self,
        name: &str,
        claimed: Option<&str>,
        fault: Fault,
        tune: impl FnOnce(&mut EndpointConfig),
    ) -> Endpoint {
        self.endpoint_gated(name, claimed, fault, None, tune)
    }

    fn endpoint_gated(
        &self,
        name: &str,
        claimed: Option<&str>,
        fault: Fault,
        gate: Option<Gate>,
        tune: impl FnOnce(&mut EndpointConfig),
    ) -> Endpoint {
        let inner = LoopbackTransport::new(name).unwrap().with_polls_until_done(2);
        let claimed = claimed.map(str::to_owned);
        let posts = Arc::clone(&self.posts);
        let mut transport = Faulty::new(inner, fault, gate, claimed, posts);
        let region = MemoryRegion {
            addr: self.memory.as_ptr() as u64,
            len: self.memory.len() as u64,
            space: MemorySpace::DRAM,
        };
        // SAFETY: each test drops its endpoints before its caches.
        unsafe { transport.register_memory(&[region]).unwrap() };
        let mut config = EndpointConfig::new(name, self.layout());
        config.secret = Some(SECRET.to_vec());
        config.heartbeat_interval = Duration::from_millis(100);
        config.peer_timeout = Duration::from_millis(1_000);
        tune(&mut config);
        Endpoint::start(config, transport).unwrap()
    }
}

/// Waits up to 10 s for `done`; whether it came.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// An address nothing listens on.
fn closed_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn wait_for_registration(p: &Endpoint) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.pending() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.pending(), 1, "D's registration did not reach P");
}

fn group(first_token: u64, block_ids: &[u32]) -> Vec<BlockGroup> {
    vec![BlockGroup { first_token, block_ids: block_ids.to_vec() }]
}

fn ready(request_id: &str, blocks: &[u32], num_tokens: u64) -> ReadyKv {
    ReadyKv {
        request_id: request_id.into(),
        transfer_id: None,
        groups: group(0, blocks),
        num_tokens,
        ttl: Duration::from_secs(30),
    }
}

fn expectation(
    source: &Endpoint,
    request_id: &str,
    blocks: &[u32],
    first: u64,
    tokens: u64,
) -> Expectation {
    Expectation {
        request_id: request_id.into(),
        transfer_id: None,
        sources: vec![source.address().to_string()],
        groups: group(first, blocks),
        num_tokens: tokens,
        epoch: 1,
        ttl: Duration::from_secs(30),
        share: None,
    }
}

/// The event's reason code, `None` for a transfer that was done.
fn reason_of(event: &Event) -> Option<Reason> {
    event.outcome.cause().map(|cause| cause.reason)
}

fn events(endpoint: &Endpoint, count: usize) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < count && Instant::now() < deadline {
        out.extend(endpoint.wait(Duration::from_millis(50)));
    }
    out
}

#[test]
fn a_write_slower_than_the_clock_skew_still_ends_the_receive_done() {
    // A DONE is signed when its WRITE is posted and arrives when the WRITE completes. Here the
    // WRITE takes 2.5 s against a 1 s clock skew, within P's 10 s write timeout: D must take
    // the DONE (it used to refuse it as stale and wait out the receive's TTL).
    let skew = |config: &mut EndpointConfig| config.limits.max_clock_skew = Duration::from_secs(1);
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p =
        p_cache.endpoint_with("ep-p-slow", Fault::SlowWrites(Duration::from_millis(2_500)), skew);
    let d = d_cache.endpoint_with("ep-d-slow", Fault::None, skew);
    d.expect(expectation(&p, "cmpl-slow-0-11111111", &[4, 5], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.ready(ready("cmpl-slow-0-22222222", &[1, 2], 20)).unwrap();

    let received = events(&d, 1);
    assert_eq!(received.len(), 1, "D's receive did not end: {received:?}");
    assert_eq!(received[0].outcome, Outcome::Done, "{received:?}");
    let sent = events(&p, 1);
    assert!(sent.iter().all(|e| e.outcome == Outcome::Done), "{sent:?}");
    drop((p, d));
    for region in 0..REGIONS {
        for token in 0..20 {
            let src = p_cache.offset(region, &[1, 2], 0, token);
            let dst = d_cache.offset(region, &[4, 5], 0, token);
            let n = TOKEN_BYTES as usize;
            assert_eq!(d_cache.memory[dst..dst + n], p_cache.memory[src..src + n]);
        }
    }
}

#[test]
fn both_arrival_orders_write_every_token_where_d_expects_it() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(32, |_| 0);
    let p = p_cache.endpoint("ep-p1");
    let d = d_cache.endpoint("ep-d1");

    // Registration first: D's blocks reach P's table before the KV is ready.
    d.expect(expectation(&p, "cmpl-a-0-11111111", &[5, 9], 0, 50)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.pending() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    p.ready(ready("cmpl-a-0-22222222", &[3, 7, 1, 30], 50)).unwrap();
    // KV first, with a prefix hit on D: D lists only blocks from token 32 on.
    p.ready(ready("cmpl-b-0-33333333", &[2, 4, 6, 8], 60)).unwrap();
    d.expect(expectation(&p, "cmpl-b-0-44444444", &[20], 32, 60)).unwrap();

    let received = events(&d, 2);
    let sent = events(&p, 2);
    assert_eq!(received.len(), 2, "{received:?}");
    assert!(received.iter().all(|e| e.role == Role::Receive && e.outcome == Outcome::Done));
    assert!(sent.iter().all(|e| e.role == Role::Send && e.outcome == Outcome::Done), "{sent:?}");
    let total: u64 = sent.iter().map(|e| e.bytes).sum();
    assert_eq!(total, REGIONS * (50 + 28) * TOKEN_BYTES);

    let mut expected = vec![0u8; d_cache.memory.len()];
    for (p_blocks, d_blocks, first, tokens) in
        [(&[3u32, 7, 1, 30][..], &[5u32, 9][..], 0, 50), (&[2, 4, 6, 8], &[20], 32, 60)]
    {
        for region in 0..REGIONS {
            for token in first..tokens {
                let src = p_cache.offset(region, p_blocks, 0, token);
                let dst = d_cache.offset(region, d_blocks, first, token);
                let n = TOKEN_BYTES as usize;
                expected[dst..dst + n].copy_from_slice(&p_cache.memory[src..src + n]);
            }
        }
    }
    drop((p, d));
    assert!(d_cache.memory == expected, "D's memory differs from the per-token copy");
}

#[test]
fn p_abort_after_registration_fails_d_without_waiting_for_a_deadline() {
    let p_cache = Cache::new(16, |_| 7);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-p2");
    let d = d_cache.endpoint("ep-d2");
    d.expect(expectation(&p, "req-abort", &[1, 2], 0, 20)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.pending() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.abort("req-abort", None).unwrap(), AbortOutcome::Released);
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("aborted")),
        "{received:?}"
    );
    assert!(p.ready(ready("req-abort", &[1, 2], 20)).is_err(), "a late ready is refused");
    drop((p, d));
    assert!(d_cache.memory.iter().all(|&b| b == 0), "nothing was written");
}

#[test]
fn unreachable_p_fails_the_expectation_with_the_address() {
    let d_cache = Cache::new(16, |_| 0);
    let d = d_cache.endpoint("ep-d3");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = listener.local_addr().unwrap();
    drop(listener);
    let mut e = expectation(&d, "req-nowhere", &[1], 0, 10);
    e.sources = vec![closed.to_string()];
    d.expect(e).unwrap();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains(&closed.to_string())),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::Unreachable));
}

/// P whose WRITEs never finish, and D, with short timeouts; D expects `request` (into blocks 1
/// and 2, for 500 ms) and its registration reached P.
fn stuck_pair(p_cache: &Cache, d_cache: &Cache, names: [&str; 2], request: &str) -> [Endpoint; 2] {
    let fast = |c: &mut EndpointConfig| {
        c.write_timeout = Duration::from_millis(300);
        c.peer_timeout = Duration::from_millis(500);
        c.heartbeat_interval = Duration::from_millis(100);
    };
    let p = p_cache.endpoint_with(names[0], Fault::StuckWrites, fast);
    let d = d_cache.endpoint_with(names[1], Fault::None, fast);
    let mut e = expectation(&p, request, &[1, 2], 0, 20);
    e.ttl = Duration::from_millis(500);
    d.expect(e).unwrap();
    wait_for_registration(&p);
    [p, d]
}

#[test]
fn a_write_the_transport_never_finishes_holds_both_sides_blocks() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let [p, d] = stuck_pair(&p_cache, &d_cache, ["ep-p4", "ep-d4"], "req-stuck");
    p.ready(ready("req-stuck", &[3, 4], 20)).unwrap();
    // P: the WRITE is overdue, so its send is quarantined: the source blocks stay held.
    let sent = events(&p, 1);
    assert!(
        matches!(&sent[..], [Event { outcome: Outcome::Quarantined(reason), .. }] if reason.contains("not done after")),
        "{sent:?}"
    );
    // D: its TTL passed, P never acknowledged the cancel (the WRITE never finished), D dropped
    // the connection, asked again on a new one and got no answer either: the receive is
    // quarantined, never failed, since P's bytes may still land.
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Quarantined(reason), .. }] if reason.contains("stay held")),
        "{received:?}"
    );
    assert_eq!(reason_of(&sent[0]), Some(Reason::Quarantined));
    assert_eq!(reason_of(&received[0]), Some(Reason::Quarantined));
    assert_eq!(p.stats().quarantined_writes, 1);
    assert_eq!(d.stats().quarantined_receives, 1);
    assert_eq!(p.pending(), 1, "the write is still in flight in P's table");
    assert!(d.poll().is_empty() && p.poll().is_empty(), "no final event while the WRITE may land");
}

#[test]
fn a_panicking_writer_fails_everything_and_refuses_new_work() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint_with("ep-p5", Fault::PanicOnPost, |c| {
        c.write_timeout = Duration::from_millis(500);
    });
    let d = d_cache.endpoint("ep-d5");
    // A second request whose KV is ready but never registered: it must fail too.
    p.ready(ready("req-orphan", &[9], 10)).unwrap();
    d.expect(expectation(&p, "req-panic", &[1, 2], 0, 20)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.pending() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    p.ready(ready("req-panic", &[3, 4], 20)).unwrap();
    let sent = events(&p, 2);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent
        .iter()
        .all(|e| matches!(&e.outcome, Outcome::Failed(r) if r.contains("panicked"))));
    let health = p.health().unwrap_err().to_string();
    assert!(health.contains("panicked"), "{health}");
    assert!(p.ready(ready("req-late", &[5], 10)).is_err(), "an unhealthy P takes new work");
    assert_eq!(p.pending(), 0);
    // D hears of it through the disconnect. The unhealthy P refuses D's new connection, so it
    // cannot confirm anything: once P's horizon passed, D reports the receive quarantined.
    let lost_at = Instant::now();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Quarantined(reason), .. }] if reason.contains("lost P")),
        "{received:?}"
    );
    // P's horizon: peer_timeout 1 s + write_timeout 0.5 s + 1 s margin, from the disconnect.
    assert!(lost_at.elapsed() >= Duration::from_millis(2_000), "D gave up inside P's horizon");
    // Once P's endpoint is gone (nothing listens at its address), D fails the receive, after
    // the horizon once more (a host refusing connections is not proof its process stopped).
    drop(p);
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("lost P")),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::PeerLost));
    drop(d);
    assert!(d_cache.memory.iter().all(|&b| b == 0), "nothing was written");
}

#[test]
fn a_duplicate_registration_is_ignored_even_over_the_hosts_quota() {
    // D's host may hold one registration on P, and holds it. The same registration arrives again
    // (a retransmission, here over a second connection of the same D process): it must be
    // counted and ignored, not refused: a FAIL for its epoch would end the transfer on D while
    // P still writes it.
    let p_cache = Cache::new(16, |i| (i % 13) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint_with("ep-p6", Fault::None, |c| c.max_registrations_per_host = 1);
    let d = d_cache.endpoint("ep-d6");
    let mut e = expectation(&p, "req-dup", &[1, 2], 0, 20);
    e.transfer_id = Some("xfer-dup".into());
    d.expect(e).unwrap();
    wait_for_registration(&p);

    let replies = Arc::new(Recorder::default());
    let twin = raw_peer(raw_hello("ep-d6", "ep-d6", d_cache.layout(), 0), replies.clone());
    let peer = twin.connect(&p.address().to_string()).unwrap();
    let again = Register {
        transfer_key: "xfer-dup".into(),
        request_id: "req-dup".into(),
        epoch: 1,
        engine_id: "ep-d6".into(),
        address: twin.local_addr().to_string(),
        tp_rank: 0,
        tp_size: 1,
        groups: group(0, &[1, 2]),
        num_tokens: 20,
        ttl_ms: 30_000,
        fanout: 1,
        nonce: 7,
    };
    twin.send(peer.id, &Message::Register(again)).unwrap();
    // P acknowledges a cancel of a transfer it does not know on the same connection, after any
    // reply to the registration.
    let unknown =
        Cancel { transfer_key: "xfer-none".into(), request_id: "req-none".into(), epoch: 1 };
    twin.send(peer.id, &Message::Cancel(unknown)).unwrap();
    let replies = replies.wait_for(|m| matches!(m, Message::CancelAck(_)));
    assert!(!replies.iter().any(|m| matches!(m, Message::Fail(_))), "{replies:?}");
    assert_eq!(p.stats().refused_registrations, 1, "the duplicate is counted");

    let mut kv = ready("req-p", &[3, 4], 20);
    kv.transfer_id = Some("xfer-dup".into());
    p.ready(kv).unwrap();
    let received = events(&d, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    twin.close();
}

#[test]
fn another_peer_cannot_take_over_or_cancel_a_registration() {
    let p_cache = Cache::new(16, |i| (i % 7) as u8 + 1);
    let owner_cache = Cache::new(16, |_| 0);
    let thief_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-p7");
    let owner = owner_cache.endpoint("ep-owner");
    let thief = thief_cache.endpoint("ep-thief");
    let mut mine = expectation(&p, "req-owner", &[1, 2], 0, 20);
    mine.transfer_id = Some("xfer-shared".into());
    owner.expect(mine).unwrap();
    wait_for_registration(&p);
    // Another D (with the secret) registers the same transfer at a higher epoch, then cancels.
    let mut theirs = expectation(&p, "req-thief", &[5, 6], 0, 20);
    theirs.transfer_id = Some("xfer-shared".into());
    theirs.epoch = 9;
    thief.expect(theirs).unwrap();
    let refused = events(&thief, 1);
    assert!(
        matches!(&refused[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("another peer")),
        "{refused:?}"
    );
    assert_eq!(reason_of(&refused[0]), Some(Reason::Refused));
    let mut ready_kv = ready("req-p", &[3, 4], 20);
    ready_kv.transfer_id = Some("xfer-shared".into());
    p.ready(ready_kv).unwrap();
    let received = events(&owner, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    drop((p, owner, thief));
    assert!(thief_cache.memory.iter().all(|&b| b == 0), "the thief received KV");
}

/// A P that completes the handshake and then never answers anything (a hung or hostile P).
struct SilentP;

impl kvpush_core::side_channel::ControlHandler for SilentP {
    fn peer_joined(
        &self,
        _peer: &kvpush_core::side_channel::PeerInfo,
    ) -> Result<(), kvpush_core::side_channel::Refusal> {
        Ok(())
    }
    fn message(&self, _peer: kvpush_core::side_channel::PeerId, _message: Message) {}
    fn peer_lost(&self, _peer: kvpush_core::side_channel::PeerId, _reason: &str) {}
}

#[test]
fn a_cancel_p_never_acknowledges_ends_after_the_disconnect_and_the_horizon() {
    use kvpush_core::side_channel::{SideChannel, SideChannelConfig};
    let d_cache = Cache::new(16, |_| 0);
    let d = d_cache.endpoint("ep-d8");
    let horizon = Duration::from_millis(700);
    let mut config = SideChannelConfig::new("127.0.0.1:0".parse().unwrap(), "silent-p");
    config.secret =
        Some(kvpush_core::protocol::Secret::from_bytes(b"endpoint-test-shared-secret").unwrap());
    config.heartbeat_interval = Duration::from_millis(100);
    config.peer_timeout = Duration::from_millis(1_000);
    let hello = kvpush_core::protocol::Hello {
        engine_id: "silent-p".into(),
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        agent_name: "silent-p-agent".into(),
        agent_metadata: b"not a loadable agent".to_vec(),
        layout: d_cache.layout(),
        compatibility: String::new(),
        versions: vec![kvpush_core::protocol::PROTOCOL_VERSION],
        memory: MemorySpace::DRAM,
        nonce: 0,
        echo: 0,
        write_horizon_ms: horizon.as_millis() as u64,
        delivery_bound_ms: 0,
    };
    let p = SideChannel::start(config, hello, std::sync::Arc::new(SilentP)).unwrap();
    let mut e = expectation(&d, "req-unacked", &[1, 2], 0, 20);
    e.sources = vec![p.local_addr().to_string()];
    d.expect(e).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.peers().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100)); // the registration is on its way
    let cancelled_at = Instant::now();
    d.cancel("req-unacked").unwrap();
    let received = events(&d, 1);
    // No ack within P's horizon: D drops the connection (so P's lease runs out), asks again on a
    // new one, gets no answer either, and once the horizon passed again holds the blocks.
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Quarantined(_), .. }]),
        "{received:?}"
    );
    assert!(cancelled_at.elapsed() >= 2 * horizon, "D gave up inside P's horizon");
    // P's endpoint gone: the cancel ends, a horizon after nothing listened at P's address.
    p.close();
    let gone_at = Instant::now();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Cancelled(_), .. }]),
        "{received:?}"
    );
    assert!(gone_at.elapsed() >= horizon, "D ended the cancel inside P's horizon");
}

#[test]
fn a_host_s_registrations_are_capped_in_bytes_and_the_budget_is_given_back() {
    let p_cache = Cache::new(16, |_| 3);
    let d_cache = Cache::new(16, |_| 0);
    // Room for one registration of 400 block ids (1,600 bytes of ids), not for two.
    let p = p_cache.endpoint_with("ep-p-bytes", Fault::None, |c| {
        c.max_registration_bytes_per_host = 3_000;
    });
    let d = d_cache.endpoint("ep-d-bytes");
    let many: Vec<u32> = (0..400).collect();
    d.expect(expectation(&p, "req-big-1", &many, 0, 400 * 16)).unwrap();
    wait_for_registration(&p);
    d.expect(expectation(&p, "req-big-2", &many, 0, 400 * 16)).unwrap();
    let refused = events(&d, 1);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].request_id, "req-big-2");
    assert_eq!(reason_of(&refused[0]), Some(Reason::Refused));
    let detail = &refused[0].outcome.cause().unwrap().detail;
    assert!(detail.contains("budget of 3000 bytes"), "{detail}");
    assert!(detail.contains("max_registration_bytes_per_host"), "{detail}");
    assert_eq!(p.stats().refused_registrations, 1);
    assert_eq!(p.pending(), 1, "the first registration stands");

    // Cancelled, the first one gives its bytes back: a registration of its size fits again.
    d.cancel("req-big-1").unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Cancelled(_), .. }]));
    d.expect(expectation(&p, "req-big-3", &many, 0, 400 * 16)).unwrap();
    wait_for_registration(&p);
    assert_eq!(p.stats().refused_registrations, 1);
}

#[test]
fn a_writer_that_is_behind_refuses_new_work_instead_of_queueing_it() {
    let d_cache = Cache::new(16, |_| 0);
    let gate = Gate::closed();
    let d = d_cache.endpoint_stalled("ep-d-busy", &gate, |c| c.inbox_capacity = 3);
    gate.wait_holding();
    let nowhere = closed_port();
    let expect = |request_id: &str| {
        let mut e = expectation(&d, request_id, &[1], 0, 10);
        e.sources = vec![nowhere.clone()];
        e
    };
    for i in 0..3 {
        d.expect(expect(&format!("req-{i}"))).unwrap();
    }
    let refused = d.expect(expect("req-3")).unwrap_err();
    assert!(matches!(refused, EndpointError::Busy { queued: 3, capacity: 3 }), "{refused}");
    assert!(refused.to_string().contains("nothing was done"), "{refused}");
    // Ending work still fits, up to twice the capacity.
    for i in 0..3 {
        d.cancel(&format!("req-{i}")).unwrap();
    }
    assert!(matches!(d.cancel("req-0"), Err(EndpointError::Busy { queued: 6, .. })));
    assert_eq!(d.stats().overloaded, 2);

    // Once the writer catches up, what was queued ends and new work is taken again.
    gate.open();
    let ended = events(&d, 3);
    assert_eq!(ended.len(), 3, "{ended:?}");
    assert!(ended.iter().all(|e| e.outcome != Outcome::Done), "{ended:?}");
    assert!(eventually(|| d.expect(expect("req-4")).is_ok()), "the writer never caught up");
}

#[test]
fn an_overloaded_p_refuses_registrations_and_new_kv_until_its_writer_catches_up() {
    let p_cache = Cache::new(16, |_| 5);
    let d_cache = Cache::new(16, |_| 0);
    let gate = Gate::closed();
    let p = p_cache.endpoint_stalled("ep-p-busy", &gate, |c| c.inbox_capacity = 1);
    let d = d_cache.endpoint("ep-d-busy-p");
    gate.wait_holding();
    // D's handshake fills P's inbox (P's writer must load D's agent); its registration then
    // finds no room, and is refused after a short wait.
    d.expect(expectation(&p, "req-over", &[1, 2], 0, 20)).unwrap();
    assert!(eventually(|| p.stats().overloaded >= 1), "the registration was not refused");
    assert_eq!(p.pending(), 0, "a refused registration is not held");
    let busy = p.ready(ready("req-other", &[3], 10)).unwrap_err();
    assert!(matches!(busy, EndpointError::Busy { capacity: 1, .. }), "{busy}");

    gate.open();
    let received = events(&d, 1);
    assert_eq!(reason_of(&received[0]), Some(Reason::Refused), "{received:?}");
    let detail = &received[0].outcome.cause().unwrap().detail;
    assert!(detail.contains("P is overloaded"), "{detail}");
    assert!(eventually(|| p.ready(ready("req-later", &[3], 10)).is_ok()));
}

#[test]
fn close_does_not_wait_for_a_writer_stuck_in_the_transport() {
    let p_cache = Cache::new(16, |_| 5);
    let gate = Gate::closed();
    let p = p_cache.endpoint_stalled("ep-p-stuck", &gate, |_| {});
    gate.wait_holding();
    p.ready(ready("req-left", &[1], 10)).unwrap();
    let stuck = p.close().unwrap_err();
    match &stuck {
        EndpointError::StuckOnClose { left, .. } => {
            assert!(left.contains("rendezvous table: 1"), "{left}");
        }
        other => panic!("{other}"),
    }
    assert!(stuck.to_string().contains("do not free it"), "{stuck}");
    // A later close (the endpoint's drop, say) does not wait again.
    assert!(matches!(p.close(), Err(EndpointError::StuckOnClose { .. })));
    // Once the transport lets go, the writer takes the stop ahead of anything queued, and exits.
    gate.open();
    assert!(eventually(|| p.close().is_ok()), "the writer did not exit");
}

#[test]
fn a_p_slow_to_connect_to_does_not_hold_up_the_connects_behind_it() {
    let p_cache = Cache::new(16, |i| (i % 11) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-p-fast");
    let d = d_cache.endpoint_with("ep-d-two", Fault::None, |c| {
        c.connect_timeout = Duration::from_secs(1);
    });
    // Accepts TCP connections (the kernel does) but never answers a Hello: a connect to it
    // takes the whole connect timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut slow = expectation(&p, "req-slow", &[1, 2], 0, 20);
    slow.sources = vec![silent.local_addr().unwrap().to_string()];
    d.expect(slow).unwrap();
    d.expect(expectation(&p, "req-fast", &[3, 4], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.ready(ready("req-fast", &[5, 6], 20)).unwrap();
    let first = events(&d, 1);
    assert_eq!(first[0].request_id, "req-fast", "{first:?}");
    assert_eq!(first[0].outcome, Outcome::Done, "{first:?}");
    // Tried again a few times (a P that answers late is not a P that is gone), then given up:
    // well before the receive's TTL.
    let second = events(&d, 1);
    assert_eq!(second[0].request_id, "req-slow", "{second:?}");
    assert_eq!(reason_of(&second[0]), Some(Reason::Unreachable), "{second:?}");
    assert!(
        matches!(&second[0].outcome, Outcome::Failed(reason)
            if reason.contains("no hello within connect_timeout")
                && reason.contains("3 attempts in a row timed out")),
        "{second:?}"
    );
}

#[test]
fn a_p_that_answers_late_still_gets_the_registration_and_writes_the_kv() {
    // A P restarting under many D peers accepts their connections (the kernel does) before its
    // side channel can answer them. Nothing is registered until it answers, so D's receive must
    // not fail: it connects again, and the P that then answers at that address writes the KV.
    let p_cache = Cache::new(16, |i| (i % 13) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let d = d_cache.endpoint_with("ep-d-patient", Fault::None, |c| {
        c.connect_timeout = Duration::from_millis(500);
    });
    // Takes D's connections and never answers them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    silent.set_nonblocking(true).unwrap();
    let addr = silent.local_addr().unwrap();
    let mut e = expectation(&d, "req-late", &[1, 2], 0, 20);
    e.sources = vec![addr.to_string()];
    d.expect(e).unwrap();
    // D's first connect times out, and it connects again. The accepted sockets stay open (D
    // waits out its timeout on each); the real P takes the address while D waits on its second
    // attempt, which leaves it the second timeout and the backoff after it to start.
    let mut held = Vec::new();
    assert!(
        eventually(|| {
            held.extend(silent.accept().ok());
            held.len() == 2
        }),
        "D did not connect again after its first attempt timed out"
    );
    assert_eq!(d.poll(), vec![], "D gave up on a P that did not answer once");
    drop(silent);
    let p = p_cache.endpoint_with("ep-p-late", Fault::None, |c| c.bind = addr);
    wait_for_registration(&p);
    p.ready(ready("req-late", &[3, 4], 20)).unwrap();
    let received = events(&d, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    drop((p, d, held));
    assert_only_written(&d_cache, &p_cache, &[(&[1, 2], &[3, 4])], 20);
}

#[test]
fn poll_does_not_wait_behind_another_threads_wait() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let p_cache = Cache::new(16, |_| 5);
    let p = p_cache.endpoint("ep-p-poll");
    let returned = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let events = p.wait(Duration::from_secs(5));
            returned.store(true, Ordering::SeqCst);
            events
        });
        // Polls before and while the waiter holds the events: none waits for it.
        for _ in 0..50 {
            assert!(p.poll().is_empty());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!returned.load(Ordering::SeqCst), "a poll waited for the other thread's wait");
        // P's KV, never registered, expires at once: its event goes to the waiter.
        let mut orphan = ready("req-poll", &[1], 10);
        orphan.ttl = Duration::from_millis(50);
        p.ready(orphan).unwrap();
        let waited = waiter.join().unwrap();
        assert_eq!(waited.len(), 1, "{waited:?}");
        assert_eq!(reason_of(&waited[0]), Some(Reason::Expired));
    });
}

/// A side-channel peer played by hand: it records every message it is sent.
#[derive(Default)]
struct Recorder {
    messages: Mutex<Vec<Message>>,
}

impl Recorder {
    /// Every message so far, once one for which `found` holds arrived (bounded wait).
    fn wait_for(&self, found: impl Fn(&Message) -> bool) -> Vec<Message> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let messages = self.messages.lock().unwrap().clone();
            if messages.iter().any(&found) || Instant::now() > deadline {
                return messages;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl ControlHandler for Recorder {
    fn peer_joined(&self, _peer: &PeerInfo) -> Result<(), Refusal> {
        Ok(())
    }
    fn message(&self, _peer: PeerId, message: Message) {
        self.messages.lock().unwrap().push(message);
    }
    fn peer_lost(&self, _peer: PeerId, _reason: &str) {}
}

/// The Hello of a peer played by hand whose loopback agent is `agent` (a loopback agent's
/// metadata is its name).
fn raw_hello(engine_id: &str, agent: &str, layout: KvLayout, write_horizon_ms: u64) -> Hello {
    Hello {
        engine_id: engine_id.into(),
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        agent_name: agent.into(),
        agent_metadata: agent.as_bytes().to_vec(),
        layout,
        compatibility: String::new(),
        versions: vec![PROTOCOL_VERSION],
        memory: MemorySpace::DRAM,
        nonce: 0,
        echo: 0,
        write_horizon_ms,
        delivery_bound_ms: 0,
    }
}

fn raw_peer(hello: Hello, handler: Arc<Recorder>) -> SideChannel {
    let mut config =
        SideChannelConfig::new("127.0.0.1:0".parse().unwrap(), hello.engine_id.clone());
    config.secret = Some(Secret::from_bytes(SECRET).unwrap());
    config.heartbeat_interval = Duration::from_millis(100);
    config.peer_timeout = Duration::from_millis(1_000);
    SideChannel::start(config, hello, handler).unwrap()
}

/// D's whole cache is untouched but for `written` (every region's blocks of D, from P's blocks),
/// which hold P's KV token by token.
fn assert_only_written(d: &Cache, p: &Cache, written: &[(&[u32], &[u32])], tokens: u64) {
    let mut expected = vec![0u8; d.memory.len()];
    for (d_blocks, p_blocks) in written {
        for region in 0..REGIONS {
            for token in 0..tokens {
                let src = p.offset(region, p_blocks, 0, token);
                let dst = d.offset(region, d_blocks, 0, token);
                let n = TOKEN_BYTES as usize;
                expected[dst..dst + n].copy_from_slice(&p.memory[src..src + n]);
            }
        }
    }
    let wrong = d.memory.iter().zip(&expected).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "{wrong} bytes of D differ from P's KV in the blocks written alone");
}

#[test]
fn an_agent_name_another_process_holds_is_refused_at_the_handshake() {
    // A second D process declares the agent name of the first one (its metadata is its own).
    // P must refuse it at the handshake, naming the collision: sharing the first D's agent by
    // name would write the second D's transfers into the first D's memory.
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let victim_cache = Cache::new(16, |_| 0);
    let impostor_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-p12");
    let victim = victim_cache.endpoint("ep-victim");
    let impostor =
        impostor_cache.endpoint_as("ep-impostor", Some("ep-victim"), Fault::None, |_| {});
    victim.expect(expectation(&p, "req-victim", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&p);
    let mut theirs = expectation(&p, "req-impostor", &[3, 4], 0, 20);
    theirs.transfer_id = Some("xfer-impostor".into());
    impostor.expect(theirs).unwrap();
    let refused = events(&impostor, 1);
    assert!(
        matches!(&refused[..], [Event { outcome: Outcome::Failed(reason), .. }]
            if reason.contains("\"ep-victim\"") && reason.contains("another agent")),
        "{refused:?}"
    );
    assert_eq!(reason_of(&refused[0]), Some(Reason::Unreachable));

    p.ready(ready("req-victim", &[5, 6], 20)).unwrap();
    let mut kv = ready("req-p-impostor", &[7, 8], 20);
    kv.transfer_id = Some("xfer-impostor".into());
    p.ready(kv).unwrap();
    let received = events(&victim, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    drop((p, victim, impostor));
    assert_only_written(&victim_cache, &p_cache, &[(&[1, 2], &[5, 6])], 20);
    assert!(impostor_cache.memory.iter().all(|&b| b == 0), "the impostor received KV");
}

#[test]
fn a_done_counts_only_from_its_registrations_agent_signed_as_it_with_its_nonce() {
    let d_cache = Cache::new(16, |_| 0);
    let d = d_cache.endpoint("ep-d13");
    // P played by hand: a side channel, and a loopback agent that sends DONEs as notifications.
    let mut agent = LoopbackTransport::new("fake-p-agent").unwrap();
    let mut other = LoopbackTransport::new("fake-other-agent").unwrap();
    let messages = Arc::new(Recorder::default());
    let fake =
        raw_peer(raw_hello("fake-p", "fake-p-agent", d_cache.layout(), 1_000), messages.clone());
    let mut e = expectation(&d, "req-forged", &[1, 2], 0, 20);
    e.sources = vec![fake.local_addr().to_string()];
    d.expect(e).unwrap();
    let registered = messages.wait_for(|m| matches!(m, Message::Register(_)));
    let Some(Message::Register(register)) = registered.into_iter().next() else {
        panic!("D did not register with P")
    };
    assert_ne!(register.nonce, 0, "D picks a nonce for each registration");
    agent.add_peer(b"ep-d13").unwrap();
    other.add_peer(b"ep-d13").unwrap();
    let done = |nonce| {
        Message::Done(Done {
            transfer_key: register.transfer_key.clone(),
            request_id: register.request_id.clone(),
            epoch: register.epoch,
            tp_rank: 0,
            tp_size: 1,
            bytes: 1,
            runs: 1,
            nonce,
        })
    };
    let signed_as = |sender: &str, message: &Message| {
        let secret = Secret::from_bytes(SECRET).unwrap();
        Encoder::new(sender, Some(secret)).encode(message, unix_millis())
    };
    // From P's agent but signed as another sender; from P's agent without the registration's
    // nonce; from another agent (signed as itself).
    agent.send_notification("ep-d13", &signed_as("someone-else", &done(register.nonce))).unwrap();
    agent
        .send_notification("ep-d13", &signed_as("fake-p-agent", &done(register.nonce ^ 1)))
        .unwrap();
    other
        .send_notification("ep-d13", &signed_as("fake-other-agent", &done(register.nonce)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.stats().stray_notifications < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(d.stats().stray_notifications, 3, "every forged DONE is a stray");
    assert!(d.poll().is_empty(), "a forged DONE ended the receive");

    agent.send_notification("ep-d13", &signed_as("fake-p-agent", &done(register.nonce))).unwrap();
    let received = events(&d, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    assert_eq!(d.stats().stray_notifications, 3);
    fake.close();
}

#[test]
fn without_a_secret_d_connects_only_to_loopback_unless_the_operator_opts_out() {
    let p_cache = Cache::new(16, |i| (i % 7) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let open = |c: &mut EndpointConfig| {
        c.secret = None;
        c.connect_timeout = Duration::from_millis(300);
    };
    let d = d_cache.endpoint_with("ep-d14", Fault::None, open);
    let mut far = expectation(&d, "req-far", &[1], 0, 10);
    far.sources = vec!["192.0.2.1:5600".into()]; // TEST-NET-1: never a loopback address
    d.expect(far.clone()).unwrap();
    let refused = events(&d, 1);
    assert!(
        matches!(&refused[..], [Event { outcome: Outcome::Failed(reason), .. }]
            if reason.contains("192.0.2.1") && reason.contains("without a shared secret")
                && reason.contains("KVPUSH_SECRET") && reason.contains("KVPUSH_INSECURE")),
        "{refused:?}"
    );
    assert_eq!(reason_of(&refused[0]), Some(Reason::Unreachable));

    // The operator's opt-out lets D try (and here fail to reach it, for what the network says).
    let opted = d_cache.endpoint_with("ep-d15", Fault::None, |c| {
        open(c);
        c.allow_insecure = true;
    });
    opted.expect(far).unwrap();
    let tried = events(&opted, 1);
    assert!(
        matches!(&tried[..], [Event { outcome: Outcome::Failed(reason), .. }]
            if reason.contains("cannot connect") && !reason.contains("without a shared secret")),
        "{tried:?}"
    );

    // Loopback needs no secret.
    let p = p_cache.endpoint_with("ep-p14", Fault::None, open);
    d.expect(expectation(&p, "req-near", &[2, 3], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.ready(ready("req-near", &[4, 5], 20)).unwrap();
    let received = events(&d, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
}

#[test]
fn a_re_expect_cancels_the_old_registration_and_reports_it_before_the_new_receive() {
    // D re-expects a request at a higher epoch, from another P. The old P must hear a CANCEL:
    // D hands the old blocks back with the old receive's event, and a registration the old P
    // kept would let its KV land in them later.
    let old_cache = Cache::new(16, |_| 0xAA);
    let new_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let old_p = old_cache.endpoint("ep-p-old");
    let new_p = new_cache.endpoint("ep-p-new");
    let d = d_cache.endpoint("ep-d16");
    d.expect(expectation(&old_p, "req-again", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&old_p);
    let mut again = expectation(&new_p, "req-again", &[5, 6], 0, 20);
    again.epoch = 2;
    d.expect(again).unwrap();
    wait_for_registration(&new_p);

    let old = events(&d, 1);
    assert!(
        matches!(&old[..], [Event { outcome: Outcome::Cancelled(reason), request_id, .. }]
            if reason.contains("superseded") && request_id == "req-again"),
        "{old:?}"
    );
    assert_eq!(reason_of(&old[0]), Some(Reason::Cancelled));
    assert_eq!(old_p.pending(), 0, "the old P still holds the old registration");
    assert!(old_p.ready(ready("req-again", &[1, 2], 20)).is_err(), "the old P may still write");

    new_p.ready(ready("req-again", &[3, 4], 20)).unwrap();
    let new = events(&d, 1);
    assert!(matches!(&new[..], [Event { outcome: Outcome::Done, .. }]), "{new:?}");
    assert!(d.wait(Duration::from_millis(200)).is_empty(), "one event per receive");
    drop((old_p, new_p, d));
    assert_only_written(&d_cache, &new_cache, &[(&[5, 6], &[3, 4])], 20);
}

#[test]
fn a_re_expect_on_the_same_p_reports_the_old_receive_once_its_write_is_over() {
    // The old epoch's WRITE is in flight when D re-expects on the same P: P holds the new
    // registration until that WRITE is over, acknowledges the old epoch's CANCEL then, and
    // writes the new blocks. D reports the old receive, then the new one.
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint_with("ep-p17", Fault::SlowWrites(Duration::from_secs(2)), |_| {});
    let d = d_cache.endpoint("ep-d17");
    d.expect(expectation(&p, "req-retry", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.ready(ready("req-retry", &[3, 4], 20)).unwrap();
    std::thread::sleep(Duration::from_millis(100)); // the old epoch's WRITE is posted
    let mut again = expectation(&p, "req-retry", &[5, 6], 0, 20);
    again.epoch = 2;
    d.expect(again).unwrap();

    let received = events(&d, 2);
    assert!(
        matches!(&received[..], [
            Event { outcome: Outcome::Cancelled(reason), .. },
            Event { outcome: Outcome::Done, .. },
        ] if reason.contains("superseded")),
        "{received:?}"
    );
    let sent = events(&p, 1);
    assert!(matches!(&sent[..], [Event { outcome: Outcome::Done, .. }]), "{sent:?}");
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[1, 2], &[3, 4]), (&[5, 6], &[3, 4])], 20);
}

#[test]
fn a_re_expect_at_the_same_epoch_is_refused_unless_it_repeats_the_call() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-p18");
    let d = d_cache.endpoint("ep-d18");
    d.expect(expectation(&p, "req-twice", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&p);
    // The same call again is a duplicate: no event of its own, the receive goes on.
    d.expect(expectation(&p, "req-twice", &[1, 2], 0, 20)).unwrap();
    // Other blocks at the same epoch: refused, with its own event.
    d.expect(expectation(&p, "req-twice", &[7, 8], 0, 20)).unwrap();
    let refused = events(&d, 1);
    assert!(
        matches!(&refused[..], [Event { outcome: Outcome::Failed(reason), .. }]
            if reason.contains("higher epoch")),
        "{refused:?}"
    );
    assert_eq!(reason_of(&refused[0]), Some(Reason::Refused));
    p.ready(ready("req-twice", &[3, 4], 20)).unwrap();
    let received = events(&d, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    assert!(d.wait(Duration::from_millis(200)).is_empty(), "one event per receive");
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[1, 2], &[3, 4])], 20);
}

#[test]
fn a_re_expects_receive_is_reported_after_the_one_it_superseded() {
    // The old P's WRITE is in flight, so its CANCEL is acknowledged only when that WRITE is
    // over; the new P delivers first. D still reports the old receive first: the engine sees
    // the two receives end in the order it asked for them.
    let old_cache = Cache::new(16, |_| 0xAA);
    let new_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let slow = Fault::SlowWrites(Duration::from_secs(2));
    let old_p = old_cache.endpoint_with("ep-p-slow-old", slow, |_| {});
    let new_p = new_cache.endpoint("ep-p-fast-new");
    let d = d_cache.endpoint("ep-d19");
    d.expect(expectation(&old_p, "req-order", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&old_p);
    old_p.ready(ready("req-order", &[3, 4], 20)).unwrap();
    std::thread::sleep(Duration::from_millis(100)); // the old epoch's WRITE is posted
    let mut again = expectation(&new_p, "req-order", &[5, 6], 0, 20);
    again.epoch = 2;
    d.expect(again).unwrap();
    wait_for_registration(&new_p);
    new_p.ready(ready("req-order", &[7, 8], 20)).unwrap();
    let delivered = events(&new_p, 1);
    assert!(matches!(&delivered[..], [Event { outcome: Outcome::Done, .. }]), "{delivered:?}");

    let received = events(&d, 2);
    assert!(
        matches!(&received[..], [
            Event { outcome: Outcome::Cancelled(reason), .. },
            Event { outcome: Outcome::Done, .. },
        ] if reason.contains("superseded")),
        "{received:?}"
    );
    drop((old_p, new_p, d));
    for (d_blocks, p_cache, p_blocks) in
        [(&[1u32, 2][..], &old_cache, &[3u32, 4][..]), (&[5, 6], &new_cache, &[7, 8])]
    {
        for region in 0..REGIONS {
            for token in 0..20 {
                let src = p_cache.offset(region, p_blocks, 0, token);
                let dst = d_cache.offset(region, d_blocks, 0, token);
                let n = TOKEN_BYTES as usize;
                assert_eq!(d_cache.memory[dst..dst + n], p_cache.memory[src..src + n]);
            }
        }
    }
}

#[test]
fn a_closed_endpoint_takes_no_work_that_could_never_end_in_an_event() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-closed-p");
    let d = d_cache.endpoint("ep-closed-d");
    let e = expectation(&p, "req-after-close", &[1], 0, 10);
    p.close().unwrap();
    d.close().unwrap();
    // No D registered yet, so `ready` would have left P's KV waiting in a table nobody serves.
    assert!(matches!(p.ready(ready("req-after-close", &[3], 10)), Err(EndpointError::Closed)));
    assert!(matches!(d.expect(e), Err(EndpointError::Closed)));
    assert!(matches!(d.cancel("req-after-close"), Err(EndpointError::Closed)));
    assert_eq!(p.pending(), 0);
}

#[test]
fn a_close_ends_the_requests_still_queued_for_the_writer_each_in_its_event() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-backlog-p");
    let gate = Gate::closed();
    let d = d_cache.endpoint_stalled("ep-backlog-d", &gate, |_| {});
    gate.wait_holding();
    // Queued behind the held writer; the close's stop then goes ahead of it.
    d.expect(expectation(&p, "req-queued", &[1, 2], 0, 20)).unwrap();
    let closing = std::thread::spawn({
        let gate = gate.clone();
        move || {
            std::thread::sleep(Duration::from_millis(100));
            gate.open();
        }
    });
    d.close().unwrap();
    closing.join().unwrap();
    let received = d.poll();
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), request_id, .. }]
            if request_id == "req-queued" && reason.contains("closed before registering")),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::Closed));
    assert_eq!(p.pending(), 0, "nothing was registered with P");
}

#[test]
fn a_d_that_a_full_p_turns_away_keeps_waiting_and_registers_once_a_slot_frees() {
    // P holds one side-channel connection at most: the first D takes it, the second is turned
    // away ("too_many_connections"). Nothing of the second's is registered, so its receive must
    // not fail: it tries again until the first D's connection is gone, then gets its KV.
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let (d1_cache, d2_cache) = (Cache::new(16, |_| 0), Cache::new(16, |_| 0));
    let p = p_cache.endpoint_with("ep-p-full", Fault::None, |c| c.max_connections = 1);
    let d1 = d1_cache.endpoint("ep-d-first");
    let d2 = d2_cache.endpoint("ep-d-second");
    d1.expect(expectation(&p, "req-first", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.ready(ready("req-first", &[3, 4], 20)).unwrap();
    assert!(events(&d1, 1).iter().all(|e| e.outcome == Outcome::Done));
    assert!(events(&p, 1).iter().all(|e| e.outcome == Outcome::Done));

    d2.expect(expectation(&p, "req-second", &[5, 6], 0, 20)).unwrap();
    p.ready(ready("req-second", &[7, 8], 20)).unwrap();
    // Turned away at once, and again on each retry: the receive goes on all the same.
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(d2.poll(), vec![], "D's receive ended while P was full");

    drop(d1); // its connection, and P's slot, go with it
    let received = events(&d2, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Done, .. }]),
        "D did not get its KV once P had a slot again: {received:?}"
    );
    assert!(events(&p, 1).iter().all(|e| e.outcome == Outcome::Done));
    drop((p, d2));
    for region in 0..REGIONS {
        for token in 0..20 {
            let src = p_cache.offset(region, &[7, 8], 0, token);
            let dst = d2_cache.offset(region, &[5, 6], 0, token);
            let n = TOKEN_BYTES as usize;
            assert_eq!(d2_cache.memory[dst..dst + n], p_cache.memory[src..src + n]);
        }
    }
}

#[test]
fn a_d_that_a_full_p_turns_away_gives_up_when_its_receive_expires() {
    let p_cache = Cache::new(16, |_| 7);
    let (d1_cache, d2_cache) = (Cache::new(16, |_| 0), Cache::new(16, |_| 0));
    let p = p_cache.endpoint_with("ep-p-full2", Fault::None, |c| c.max_connections = 1);
    let d1 = d1_cache.endpoint("ep-d-holds");
    let d2 = d2_cache.endpoint("ep-d-expires");
    d1.expect(expectation(&p, "req-holds", &[1], 0, 10)).unwrap();
    wait_for_registration(&p);
    let mut e = expectation(&p, "req-expires", &[2], 0, 10);
    e.ttl = Duration::from_millis(800);
    d2.expect(e).unwrap();
    let received = events(&d2, 1);
    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(reason_of(&received[0]), Some(Reason::Expired), "{received:?}");
    drop((p, d1, d2));
    assert!(d2_cache.memory.iter().all(|&b| b == 0), "nothing was written");
}

/// Bytes of `tokens` tokens in `regions` regions.
fn region_bytes(regions: u64, tokens: u64) -> u64 {
    regions * tokens * TOKEN_BYTES
}

#[test]
fn layers_streamed_before_p_is_ready_land_first_and_the_done_follows_every_byte() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-p1");
    let d = d_cache.endpoint("ep-lw-d1");
    d.expect(expectation(&p, "req-lw", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);

    // Layers 0 and 1 (a region each here) are final while P still computes 2 and 3.
    let kv = ready("req-lw", &[3, 4], 20);
    p.layers_ready(kv.clone(), 0..1).unwrap();
    p.layers_ready(kv.clone(), 1..2).unwrap();
    // Out of order: left to the request's WRITE.
    p.layers_ready(kv.clone(), 3..4).unwrap();
    // Two layers (one WRITE each, or one for both when the writer found them queued together).
    let layer = region_bytes(1, 20);
    let streamed = |posts: &[Posted]| -> u64 {
        posts.iter().filter(|(_, notified)| !notified).map(|(bytes, _)| bytes).sum()
    };
    assert!(eventually(|| streamed(&p_cache.posts()) == 2 * layer), "{:?}", p_cache.posts());
    assert_eq!(p.pending(), 1, "the registration stays in P's table");
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.poll().is_empty(), "D heard of nothing before P's KV was ready");

    p.ready(kv).unwrap();
    let received = events(&d, 1);
    let sent = events(&p, 1);
    assert!(matches!(&received[..], [Event { outcome: Outcome::Done, .. }]), "{received:?}");
    assert!(matches!(&sent[..], [Event { outcome: Outcome::Done, .. }]), "{sent:?}");
    let posts = p_cache.posts();
    assert!(
        posts == [(layer, false), (layer, false), (2 * layer, true)]
            || posts == [(2 * layer, false), (2 * layer, true)],
        "{posts:?}"
    );
    assert_eq!(sent[0].bytes, REGIONS * layer, "P's send counts every byte");
    assert_eq!(sent[0].streamed_bytes, 2 * layer, "of which two layers went before P's ready");
    let (streamed, ready) = (sent[0].timeline.streamed, sent[0].timeline.ready);
    assert!(streamed.zip(ready).is_some_and(|(s, r)| s < r), "{:?}", sent[0].timeline);
    assert_eq!(received[0].bytes, REGIONS * layer, "and so does the DONE D got");
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9], &[3, 4])], 20);
}

#[test]
fn layers_queued_while_the_writer_is_busy_go_as_one_write() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let gate = Gate::closed();
    let p = p_cache.endpoint_stalled("ep-lw-busy-p", &gate, |_| {});
    let d = d_cache.endpoint("ep-lw-busy-d");
    d.expect(expectation(&p, "req-busy", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);
    gate.wait_holding();
    // The writer is held in a transport call while the forward pass runs three layers.
    let kv = ready("req-busy", &[3, 4], 20);
    for layer in 0..3 {
        p.layers_ready(kv.clone(), layer..layer + 1).unwrap();
    }
    gate.open();
    let layer = region_bytes(1, 20);
    assert!(eventually(|| p_cache.posts() == [(3 * layer, false)]), "{:?}", p_cache.posts());
    p.ready(kv).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    let sent = events(&p, 1);
    assert_eq!((sent[0].bytes, sent[0].streamed_bytes), (REGIONS * layer, 3 * layer));
    assert_eq!(p_cache.posts(), [(3 * layer, false), (layer, true)]);
    assert_eq!(p.stats().streamed_writes, 1);
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9], &[3, 4])], 20);
}

#[test]
fn a_kv_refused_while_its_layer_waits_in_the_writer_s_inbox_is_never_read() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let gate = Gate::closed();
    let p = p_cache.endpoint_stalled("ep-lw-refused-p", &gate, |c| c.inbox_capacity = 2);
    let d = d_cache.endpoint("ep-lw-refused-d");
    d.expect(expectation(&p, "req-refused", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);
    gate.wait_holding();
    // The writer is held in a transport call: the layer waits in its inbox behind D's
    // handshake, which is then full, so P's KV is refused and P's engine frees its blocks.
    let kv = ready("req-refused", &[3, 4], 20);
    p.layers_ready(kv.clone(), 0..1).unwrap();
    let busy = p.ready(kv).unwrap_err();
    assert!(matches!(busy, EndpointError::Busy { .. }), "{busy}");
    gate.open();
    // The layer never reads those blocks, and D hears that P will not send.
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("could not send")),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::Aborted));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(p_cache.posts(), [], "a WRITE read blocks P's engine freed");
    drop((p, d));
    assert!(d_cache.memory.iter().all(|&b| b == 0), "nothing was written");
}

#[test]
fn a_forward_s_streams_reach_the_writer_in_one_call_per_layer_and_merge_per_request() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let gate = Gate::closed();
    let p = p_cache.endpoint_stalled("ep-lw-many-p", &gate, |_| {});
    let d = d_cache.endpoint("ep-lw-many-d");
    d.expect(expectation(&p, "req-a", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);
    d.expect(expectation(&p, "req-b", &[10, 11], 0, 20)).unwrap();
    assert!(eventually(|| p.pending() == 2), "D's second registration did not reach P");
    gate.wait_holding();
    // One forward pass computes both prompts; its layers go while the writer is held.
    let (a, b) = (ready("req-a", &[3, 4], 20), ready("req-b", &[6, 7], 20));
    let streams = LayerStreams::new(vec![a.clone(), b.clone()]);
    assert_eq!(
        streams.iter().map(|kv| kv.request_id.as_str()).collect::<Vec<_>>(),
        ["req-a", "req-b"]
    );
    for layer in 0..3 {
        p.streams_ready(&streams, layer..layer + 1).unwrap();
    }
    // req-b was offered whole before its last layer's KV was final: that layer is its WRITE's.
    p.streams_ready(&streams.without(|id| id == "req-b"), 3..4).unwrap();
    gate.open();
    let layer = region_bytes(1, 20);
    let expected = [(4 * layer, false), (3 * layer, false)];
    assert!(eventually(|| p_cache.posts() == expected), "{:?}", p_cache.posts());
    p.ready(a).unwrap();
    p.ready(b).unwrap();
    assert_eq!(events(&d, 2).iter().filter(|e| e.outcome == Outcome::Done).count(), 2);
    let mut sent = events(&p, 2);
    sent.sort_by(|x, y| x.request_id.cmp(&y.request_id));
    let counted: Vec<_> = sent.iter().map(|e| (e.bytes, e.streamed_bytes)).collect();
    assert_eq!(counted, [(4 * layer, 4 * layer), (4 * layer, 3 * layer)]);
    assert!(p.streams_ready(&LayerStreams::default(), 0..1).is_ok(), "no stream: nothing to do");
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9], &[3, 4]), (&[10, 11], &[6, 7])], 20);
}

/// Bytes of the WRITEs posted so far that notified nobody (layers of streams).
fn streamed_posts(cache: &Cache) -> u64 {
    cache.posts().iter().filter(|(_, notified)| !notified).map(|(bytes, _)| bytes).sum()
}

#[test]
fn a_chunked_prompt_streams_chunk_by_chunk_and_the_done_carries_what_is_left() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-chunks-p");
    let d = d_cache.endpoint("ep-lw-chunks-d");
    d.expect(expectation(&p, "req-chunks", &[5, 9, 11], 0, 40)).unwrap();
    wait_for_registration(&p);
    // First chunk: tokens 0..20 in P's blocks 3 and 4, every layer.
    let first = ready("req-chunks", &[3, 4], 20);
    for layer in 0..REGIONS as usize {
        p.layers_ready(first.clone(), layer..layer + 1).unwrap();
    }
    let chunk = region_bytes(REGIONS, 20);
    assert!(eventually(|| streamed_posts(&p_cache) == chunk), "{:?}", p_cache.posts());
    // Second chunk: tokens up to 40 (block 6 added); two of its layers ran. It writes from D's
    // block holding token 19 (tokens 16..40): that block's tail was not P's KV yet.
    let second = ready("req-chunks", &[3, 4, 6], 40);
    p.layers_ready(second.clone(), 0..1).unwrap();
    p.layers_ready(second.clone(), 1..2).unwrap();
    let more = region_bytes(2, 24);
    assert!(eventually(|| streamed_posts(&p_cache) == chunk + more), "{:?}", p_cache.posts());
    assert!(d.poll().is_empty(), "D heard of nothing before P's KV was ready");
    // The prompt's end: the request's WRITE carries the two layers left of tokens 16..40.
    p.ready(second).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    let sent = events(&p, 1);
    assert_eq!(p_cache.posts().last(), Some(&(region_bytes(2, 24), true)));
    assert_eq!(sent[0].streamed_bytes, chunk + more);
    assert_eq!(sent[0].bytes, chunk + more + region_bytes(2, 24));
    // Tokens 16..20 of every region went twice: with the first chunk and again with the second.
    assert_eq!(sent[0].rewritten_bytes, region_bytes(REGIONS, 4));
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9, 11], &[3, 4, 6])], 40);
}

/// Where blocks move whole (CPU attention keeps K transposed inside a block), the connector
/// rounds a chunk's end up to whole blocks: the stream's first chunk "ends" at token 32 while P
/// computed only 0..20, so its WRITE carries P's scratch for 20..32. The next chunk must write
/// that block again, although the first chunk's end falls on a block boundary.
#[test]
fn a_chunk_rounded_up_to_whole_blocks_has_its_last_block_written_again() {
    let mut p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let computed = |cache: &Cache, token: u64| -> Vec<usize> {
        (0..REGIONS).map(|region| cache.offset(region, &[3, 4], 0, token)).collect()
    };
    let scramble = |cache: &mut Cache| {
        for token in 20..32 {
            for at in computed(cache, token) {
                for byte in &mut cache.memory[at..at + TOKEN_BYTES as usize] {
                    *byte = !*byte;
                }
            }
        }
    };
    scramble(&mut p_cache);
    let p = p_cache.endpoint("ep-lw-round-p");
    let d = d_cache.endpoint("ep-lw-round-d");
    d.expect(expectation(&p, "req-round", &[5, 9, 11], 0, 40)).unwrap();
    wait_for_registration(&p);
    p.layers_ready(ready("req-round", &[3, 4], 32), 0..REGIONS as usize).unwrap();
    let chunk = region_bytes(REGIONS, 32);
    assert!(eventually(|| streamed_posts(&p_cache) == chunk), "{:?}", p_cache.posts());
    // The next step computes tokens 20..40 (the loopback copied the first chunk at its post).
    scramble(&mut p_cache);
    let last = ready("req-round", &[3, 4, 6], 40);
    p.layers_ready(last.clone(), 0..REGIONS as usize).unwrap();
    p.ready(last).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    // The block of tokens 16..32 went twice, in every region.
    assert_eq!(events(&p, 1)[0].rewritten_bytes, region_bytes(REGIONS, 16));
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9, 11], &[3, 4, 6])], 40);
}

#[test]
fn a_chunk_inside_d_s_prefix_hit_is_not_written() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-hit-p");
    let d = d_cache.endpoint("ep-lw-hit-d");
    // D holds tokens 0..16 already; it needs 16..40, into blocks 9 and 11.
    d.expect(expectation(&p, "req-hit", &[9, 11], 16, 40)).unwrap();
    wait_for_registration(&p);
    let first = ready("req-hit", &[3], 16);
    p.layers_ready(first, 0..REGIONS as usize).unwrap();
    let second = ready("req-hit", &[3, 4, 6], 40);
    p.layers_ready(second.clone(), 0..REGIONS as usize).unwrap();
    let needed = region_bytes(REGIONS, 24);
    assert!(eventually(|| streamed_posts(&p_cache) == needed), "{:?}", p_cache.posts());
    p.ready(second).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    assert_eq!(p_cache.posts(), [(needed, false), (0, true)], "only the tokens D needs");
}

/// A model with a full-attention group (regions 0 and 2) and a sliding-window group (regions 1
/// and 3), its 40-token prompt computed in two chunks. D keeps the window's last block only
/// (tokens 32..40); P lists its window group from there too (the blocks it may free before the
/// prompt's end are never listed), empty while a chunk ends before it. The first chunk writes
/// the full-attention group alone; the second writes both, the window group from its start.
#[test]
fn a_chunk_that_ends_before_a_sliding_window_writes_the_other_groups() {
    let p_cache = Cache::grouped(16, 2, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::grouped(16, 2, |_| 0);
    let p = p_cache.endpoint("ep-lw-swa-p");
    let d = d_cache.endpoint("ep-lw-swa-d");
    let groups = |full: &[u32], window: &[u32]| {
        vec![
            BlockGroup { first_token: 0, block_ids: full.to_vec() },
            BlockGroup { first_token: 32, block_ids: window.to_vec() },
        ]
    };
    let kv = |full: &[u32], window: &[u32], num_tokens| ReadyKv {
        groups: groups(full, window),
        ..ready("req-swa", &[], num_tokens)
    };
    let expected = Expectation {
        groups: groups(&[5, 9, 11], &[12]),
        ..expectation(&p, "req-swa", &[], 0, 40)
    };
    d.expect(expected).unwrap();
    wait_for_registration(&p);
    p.layers_ready(kv(&[3, 4], &[], 20), 0..REGIONS as usize).unwrap();
    let first = 2 * 20 * TOKEN_BYTES;
    assert!(eventually(|| streamed_posts(&p_cache) == first), "{:?}", p_cache.posts());
    // The second chunk: the full group from D's block holding token 19 (16..40), the window's.
    let last = kv(&[3, 4, 6], &[7], 40);
    p.layers_ready(last.clone(), 0..REGIONS as usize).unwrap();
    let second = 2 * 24 * TOKEN_BYTES + 2 * 8 * TOKEN_BYTES;
    assert!(eventually(|| streamed_posts(&p_cache) == first + second), "{:?}", p_cache.posts());
    p.ready(last).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    let sent = events(&p, 1);
    assert_eq!(sent[0].streamed_bytes, first + second);
    // Tokens 16..20 of the full group went twice; the window's tokens once.
    assert_eq!(sent[0].rewritten_bytes, 2 * 4 * TOKEN_BYTES);
    drop((p, d));
    let mut wanted = vec![0u8; d_cache.memory.len()];
    for region in 0..REGIONS {
        let (d_blocks, p_blocks, from): (&[u32], &[u32], u64) =
            if region % 2 == 0 { (&[5, 9, 11], &[3, 4, 6], 0) } else { (&[12], &[7], 32) };
        for token in from..40 {
            let src = p_cache.offset(region, p_blocks, from, token);
            let dst = d_cache.offset(region, d_blocks, from, token);
            let n = TOKEN_BYTES as usize;
            wanted[dst..dst + n].copy_from_slice(&p_cache.memory[src..src + n]);
        }
    }
    let wrong = d_cache.memory.iter().zip(&wanted).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "{wrong} bytes of D differ from P's KV in the blocks written alone");
}

#[test]
fn a_window_that_dropped_blocks_before_the_offer_keeps_what_streamed() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-window-p");
    let d = d_cache.endpoint("ep-lw-window-d");
    // D keeps a window: it needs tokens 16..40 only.
    d.expect(expectation(&p, "req-window", &[9, 11], 16, 40)).unwrap();
    wait_for_registration(&p);
    // P's forward streams its KV as the step began, every block listed...
    let streamed = ready("req-window", &[3, 4, 6], 40);
    p.layers_ready(streamed, 0..REGIONS as usize).unwrap();
    let needed = region_bytes(REGIONS, 24);
    assert!(eventually(|| streamed_posts(&p_cache) == needed), "{:?}", p_cache.posts());
    // ... and offers it after its sliding window dropped block 3: the same tokens, in the
    // same blocks. Nothing is written again.
    let offered = ReadyKv { groups: group(16, &[4, 6]), ..ready("req-window", &[], 40) };
    p.ready(offered).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    assert_eq!(p_cache.posts(), [(needed, false), (0, true)], "{:?}", p_cache.posts());
}

#[test]
fn layers_with_no_registration_or_other_kv_leave_the_whole_write_to_ready() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-p2");
    let d = d_cache.endpoint("ep-lw-d2");
    // Before D registered: nothing to stream into.
    p.layers_ready(ready("req-early", &[3, 4], 20), 0..2).unwrap();
    d.expect(expectation(&p, "req-early", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);
    // A first chunk in other blocks than the KV P offers (a preempted prefill, computed
    // again elsewhere): it streams, and the request's WRITE writes everything again.
    p.layers_ready(ready("req-early", &[7], 16), 0..2).unwrap();
    assert!(eventually(|| p_cache.posts() == [(region_bytes(2, 16), false)]));
    p.ready(ready("req-early", &[3, 4], 20)).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    let sent = events(&p, 1);
    assert_eq!(sent[0].streamed_bytes, region_bytes(2, 16));
    assert_eq!(
        p_cache.posts(),
        [(region_bytes(2, 16), false), (region_bytes(REGIONS, 20), true)],
        "the request's WRITE writes every region of every token"
    );
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9], &[3, 4])], 20);
}

#[test]
fn a_cancel_during_a_stream_waits_for_the_layer_s_write() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let [p, d] = stuck_pair(&p_cache, &d_cache, ["ep-lw-p3", "ep-lw-d3"], "req-lw-stuck");
    p.layers_ready(ready("req-lw-stuck", &[3, 4], 20), 0..1).unwrap();
    // D's TTL passes and it cancels; P must not acknowledge while the layer's WRITE may still
    // land, so D's receive ends quarantined, its blocks held, never failed.
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Quarantined(reason), .. }] if reason.contains("stay held")),
        "{received:?}"
    );
    assert_eq!(p.pending(), 1, "the stream still holds the registration in P's table");
    // P: the layer's WRITE is overdue, so its send is quarantined (a notice, not its end).
    let sent = events(&p, 1);
    assert!(
        matches!(&sent[..], [Event { outcome: Outcome::Quarantined(reason), request_id, .. }]
            if reason.contains("a layer's WRITE is not done") && request_id == "req-lw-stuck"),
        "{sent:?}"
    );
    assert_eq!(p.stats().quarantined_writes, 1);
    // P's KV is held, not refused: the layer's WRITE still reads P's blocks, which P's engine
    // frees on a refusal. Its send ends (cancelled) only once that WRITE is done.
    p.ready(ready("req-lw-stuck", &[3, 4], 20)).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(p.poll().is_empty(), "one notice, and no end while the WRITE is stuck");
}

#[test]
fn a_prefill_aborted_mid_stream_fails_d_s_receive_once_the_layer_s_write_is_done() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let p =
        p_cache.endpoint_with("ep-lw-p6", Fault::SlowWrites(Duration::from_millis(300)), |_| {});
    let d = d_cache.endpoint("ep-lw-d6");
    // D waits far longer than the test: only P's word can end its receive in time.
    let mut e = expectation(&p, "req-lw-abort", &[1, 2], 0, 20);
    e.ttl = Duration::from_secs(60);
    d.expect(e).unwrap();
    wait_for_registration(&p);
    p.layers_ready(ready("req-lw-abort", &[3, 4], 20), 0..1).unwrap();
    assert!(eventually(|| p.stats().streamed_writes == 1));
    // The layer's WRITE still reads P's blocks: the abort waits for it.
    assert_eq!(p.abort("req-lw-abort", None).unwrap(), AbortOutcome::InFlight);
    // The forward pass goes on meanwhile; its next layer must not go.
    p.layers_ready(ready("req-lw-abort", &[3, 4], 20), 1..2).unwrap();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("aborted")),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::Aborted));
    // P: the send's event, as the abort's `InFlight` promised: only now may P free the blocks.
    let sent = events(&p, 1);
    assert!(
        matches!(&sent[..], [Event { outcome: Outcome::Cancelled(_), request_id, .. }] if request_id == "req-lw-abort"),
        "{sent:?}"
    );
    assert_eq!(reason_of(&sent[0]), Some(Reason::Aborted));
    assert_eq!(p_cache.posts().len(), 1, "nothing written after the layer");
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.poll().is_empty() && p.poll().is_empty(), "one end per side");
}

#[test]
fn a_writer_dying_under_a_prefill_aborted_mid_stream_still_ends_its_send_once() {
    // P's KV offered before the abort (held in the table during the stream) or not yet.
    for offered in [false, true] {
        let p_cache = Cache::new(16, |_| 9);
        let d_cache = Cache::new(16, |_| 0);
        let fault = Fault::StuckWritesThenPanic(1);
        let p = p_cache.endpoint_with(&format!("ep-lw-died-p-{offered}"), fault, |_| {});
        let d = d_cache.endpoint(&format!("ep-lw-died-d-{offered}"));
        d.expect(expectation(&p, "req-aborted", &[1, 2], 0, 20)).unwrap();
        wait_for_registration(&p);
        p.layers_ready(ready("req-aborted", &[3, 4], 20), 0..1).unwrap();
        assert!(eventually(|| p.stats().streamed_writes == 1));
        if offered {
            p.ready(ready("req-aborted", &[3, 4], 20)).unwrap();
        }
        // P's engine holds the blocks until the send's event: the layer's WRITE reads them.
        assert_eq!(p.abort("req-aborted", None).unwrap(), AbortOutcome::InFlight);
        // Another request's WRITE kills the writer: nothing drives that layer's WRITE any more.
        d.expect(expectation(&p, "req-next", &[5, 6], 0, 20)).unwrap();
        assert!(eventually(|| p.pending() == 2), "D's second registration did not reach P");
        p.ready(ready("req-next", &[7, 8], 20)).unwrap();
        let mut sent = events(&p, 2);
        sent.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        let ends: Vec<(&str, Option<Reason>)> =
            sent.iter().map(|e| (e.request_id.as_str(), reason_of(e))).collect();
        assert_eq!(
            ends,
            [("req-aborted", Some(Reason::WriterDied)), ("req-next", Some(Reason::WriterDied))],
            "offered {offered}: {sent:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(p.poll().is_empty(), "offered {offered}: one end per send");
    }
}

#[test]
fn a_layer_s_write_that_fails_fails_the_transfer_once_and_p_s_kv_is_refused() {
    let p_cache = Cache::new(16, |_| 9);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint_with("ep-lw-p4", Fault::FailingSilentWrites, |_| {});
    let d = d_cache.endpoint("ep-lw-d4");
    d.expect(expectation(&p, "req-lw-fail", &[1, 2], 0, 20)).unwrap();
    wait_for_registration(&p);
    p.layers_ready(ready("req-lw-fail", &[3, 4], 20), 0..1).unwrap();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains("layer's WRITE failed")),
        "{received:?}"
    );
    assert_eq!(reason_of(&received[0]), Some(Reason::WriteError));
    assert!(p.ready(ready("req-lw-fail", &[3, 4], 20)).is_err(), "P's KV is refused");
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.poll().is_empty(), "one failure, no second event");
    assert_eq!(p_cache.posts(), [(region_bytes(1, 20), false)], "no WRITE after the failure");
}

#[test]
fn a_stream_of_every_region_leaves_the_done_alone_in_the_last_write() {
    let p_cache = Cache::new(16, |i| (i % 251) as u8 + 1);
    let d_cache = Cache::new(16, |_| 0);
    let p = p_cache.endpoint("ep-lw-p5");
    let d = d_cache.endpoint("ep-lw-d5");
    d.expect(expectation(&p, "req-lw-all", &[5, 9], 0, 20)).unwrap();
    wait_for_registration(&p);
    let kv = ready("req-lw-all", &[3, 4], 20);
    // Past the layout's regions: cut to them.
    p.layers_ready(kv.clone(), 0..100).unwrap();
    assert!(eventually(|| p.stats().streamed_writes == 1));
    p.ready(kv).unwrap();
    assert!(matches!(&events(&d, 1)[..], [Event { outcome: Outcome::Done, .. }]));
    let sent = events(&p, 1);
    let all = region_bytes(REGIONS, 20);
    assert_eq!((sent[0].bytes, sent[0].streamed_bytes), (all, all));
    assert_eq!(p_cache.posts(), [(all, false), (0, true)], "the DONE in a WRITE of nothing");
    drop((p, d));
    assert_only_written(&d_cache, &p_cache, &[(&[5, 9], &[3, 4])], 20);
}

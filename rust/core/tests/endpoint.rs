//! Two endpoints in one process over the loopback transport and a real TCP side channel: the
//! whole push path (registration, match, plan, WRITE, DONE) and its failure paths.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is the test failing

use std::time::{Duration, Instant};

use kvpush_core::endpoint::{
    AbortOutcome, Endpoint, EndpointConfig, Event, Expectation, Outcome, ReadyKv, Role,
};
use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::BlockGroup;
use kvpush_core::transport::{MemoryRegion, MemorySpace, Transport};

const TOKEN_BYTES: u64 = 16; // 2 heads x 8 bytes
const REGIONS: u64 = 4;
const BLOCKS: u32 = 32;

/// A worker's KV memory: `REGIONS` regions of `BLOCKS` blocks of `block_tokens` tokens.
struct Cache {
    memory: Vec<u8>,
    block_tokens: u32,
}

impl Cache {
    fn new(block_tokens: u32, fill: impl Fn(usize) -> u8) -> Self {
        let len = (REGIONS * u64::from(BLOCKS) * u64::from(block_tokens) * TOKEN_BYTES) as usize;
        Self { memory: (0..len).map(fill).collect(), block_tokens }
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
                    group: 0,
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
        let mut transport = LoopbackTransport::new(name).unwrap().with_polls_until_done(2);
        let region = MemoryRegion {
            addr: self.memory.as_ptr() as u64,
            len: self.memory.len() as u64,
            space: MemorySpace::DRAM,
        };
        // SAFETY: each test drops its endpoints before its caches.
        unsafe { transport.register_memory(&[region]).unwrap() };
        let mut config = EndpointConfig::new(name, self.layout());
        config.secret = Some(b"endpoint-test-shared-secret".to_vec());
        config.heartbeat_interval = Duration::from_millis(100);
        config.peer_timeout = Duration::from_millis(1_000);
        Endpoint::start(config, transport).unwrap()
    }
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
        source: source.address().to_string(),
        groups: group(first, blocks),
        num_tokens: tokens,
        epoch: 1,
        ttl: Duration::from_secs(30),
        sources: 1,
    }
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
    assert_eq!(p.abort("req-abort", None), AbortOutcome::Released);
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
    e.source = closed.to_string();
    d.expect(e).unwrap();
    let received = events(&d, 1);
    assert!(
        matches!(&received[..], [Event { outcome: Outcome::Failed(reason), .. }] if reason.contains(&closed.to_string())),
        "{received:?}"
    );
}

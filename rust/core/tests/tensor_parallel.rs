//! P and D of different tensor parallel sizes, every rank an endpoint of its own over the
//! loopback transport and a real TCP side channel: a D rank receives from each P rank that holds
//! some of its heads, is done once each of them delivered, and fails once, naming the rank,
//! when any of them fails (only after the others can no longer write).
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is the test failing

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush_core::endpoint::{
    AbortOutcome, Endpoint, EndpointConfig, Event, Expectation, Outcome, ReadyKv, Reason, Role,
    Share,
};
use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::BlockGroup;
use kvpush_core::transport::{MemoryRegion, MemorySpace, Transport};
use support::{Fault, Faulty, Gate};

/// KV heads of the whole model.
const MODEL_HEADS: u32 = 4;
const HEAD_BYTES: u64 = 8;
const BLOCK_TOKENS: u32 = 4;
const BLOCKS: u32 = 16;
const REGIONS: u64 = 2;

/// One rank's KV memory in the HND layout: `REGIONS` regions of `BLOCKS` blocks, each block
/// `[heads][BLOCK_TOKENS][HEAD_BYTES]`, holding the model's heads `[tp_rank * heads, ...)`.
struct Rank {
    memory: Vec<u8>,
    tp_rank: u32,
    tp_size: u32,
}

impl Rank {
    fn new(tp_rank: u32, tp_size: u32, fill: u8) -> Self {
        let heads = u64::from(MODEL_HEADS / tp_size);
        let len = REGIONS * u64::from(BLOCKS) * heads * u64::from(BLOCK_TOKENS) * HEAD_BYTES;
        Self { memory: vec![fill; len as usize], tp_rank, tp_size }
    }

    fn heads(&self) -> u32 {
        MODEL_HEADS / self.tp_size
    }

    fn block_bytes(&self) -> u64 {
        u64::from(self.heads()) * u64::from(BLOCK_TOKENS) * HEAD_BYTES
    }

    fn layout(&self) -> KvLayout {
        let base = self.memory.as_ptr() as u64;
        let region_bytes = u64::from(BLOCKS) * self.block_bytes();
        KvLayout {
            regions: (0..REGIONS)
                .map(|r| Region {
                    base: base + r * region_bytes,
                    block_stride: self.block_bytes(),
                    num_blocks: BLOCKS,
                    group: 0,
                })
                .collect(),
            block_tokens: BLOCK_TOKENS,
            kernel_block_tokens: BLOCK_TOKENS,
            heads: self.heads(),
            head_bytes: HEAD_BYTES as u32,
            token_order: TokenOrder::Hnd,
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
        }
    }

    /// Where `token`'s bytes of the model's head `head` sit, in a request holding `blocks`.
    fn offset(&self, region: u64, blocks: &[u32], head: u32, token: u64) -> usize {
        let local = u64::from(head - self.tp_rank * self.heads());
        let block = u64::from(blocks[(token / u64::from(BLOCK_TOKENS)) as usize]);
        let in_block = token % u64::from(BLOCK_TOKENS);
        let region_bytes = u64::from(BLOCKS) * self.block_bytes();
        let at = region * region_bytes
            + block * self.block_bytes()
            + (local * u64::from(BLOCK_TOKENS) + in_block) * HEAD_BYTES;
        at as usize
    }

    fn model_heads(&self) -> std::ops::Range<u32> {
        self.tp_rank * self.heads()..(self.tp_rank + 1) * self.heads()
    }

    /// Writes the reference KV of `tokens` into `blocks`: each byte names its region, model
    /// head, token and position, so a byte in the wrong place cannot look right.
    fn compute(&mut self, blocks: &[u32], tokens: u64) {
        for region in 0..REGIONS {
            for head in self.model_heads() {
                for token in 0..tokens {
                    let at = self.offset(region, blocks, head, token);
                    for b in 0..HEAD_BYTES {
                        self.memory[at + b as usize] = reference(region, head, token, b);
                    }
                }
            }
        }
    }

    /// Every byte of `tokens` in `blocks`, for each of this rank's heads, is the reference.
    fn check(&self, blocks: &[u32], tokens: u64) {
        for region in 0..REGIONS {
            for head in self.model_heads() {
                for token in 0..tokens {
                    let at = self.offset(region, blocks, head, token);
                    let got = &self.memory[at..at + HEAD_BYTES as usize];
                    let want: Vec<u8> =
                        (0..HEAD_BYTES).map(|b| reference(region, head, token, b)).collect();
                    assert_eq!(got, &want[..], "region {region}, head {head}, token {token}");
                }
            }
        }
    }

    fn endpoint(&self, name: &str) -> Endpoint {
        self.endpoint_with(name, Fault::None, None, |_| {})
    }

    /// An endpoint whose transport misbehaves as `fault` says and whose writer is held at
    /// `gate` while it is closed, configured by `tune`.
    fn endpoint_with(
        &self,
        name: &str,
        fault: Fault,
        gate: Option<&Gate>,
        tune: impl FnOnce(&mut EndpointConfig),
    ) -> Endpoint {
        let inner = LoopbackTransport::new(name).unwrap().with_polls_until_done(2);
        let mut transport = Faulty::new(inner, fault, gate.cloned(), None, Arc::default());
        let region = MemoryRegion {
            addr: self.memory.as_ptr() as u64,
            len: self.memory.len() as u64,
            space: MemorySpace::DRAM,
        };
        // SAFETY: each test drops its endpoints before the ranks' memory.
        unsafe { transport.register_memory(&[region]).unwrap() };
        let mut config = EndpointConfig::new(name, self.layout());
        config.secret = Some(b"tensor-parallel-test-secret".to_vec());
        config.heartbeat_interval = Duration::from_millis(100);
        config.peer_timeout = Duration::from_millis(1_000);
        tune(&mut config);
        Endpoint::start(config, transport).unwrap()
    }
}

fn reference(region: u64, head: u32, token: u64, byte: u64) -> u8 {
    (region * 97 + u64::from(head) * 31 + token * 7 + byte + 1) as u8
}

fn group(blocks: &[u32]) -> Vec<BlockGroup> {
    vec![BlockGroup { first_token: 0, block_ids: blocks.to_vec() }]
}

fn ready(request_id: &str, blocks: &[u32], tokens: u64) -> ReadyKv {
    ReadyKv {
        request_id: request_id.into(),
        transfer_id: Some("xfer-tp".into()),
        groups: group(blocks),
        num_tokens: tokens,
        ttl: Duration::from_secs(30),
    }
}

fn expectation(sources: &[&Endpoint], blocks: &[u32], tokens: u64) -> Expectation {
    Expectation {
        request_id: "d-request".into(),
        transfer_id: Some("xfer-tp".into()),
        sources: sources.iter().map(|p| p.address().to_string()).collect(),
        groups: group(blocks),
        num_tokens: tokens,
        epoch: 1,
        ttl: Duration::from_secs(30),
        share: None,
    }
}

/// What D rank `rank` of `d_tp` expects from the P ranks `p`: every P rank holding some of its
/// heads, or its share of the one P rank that holds them all.
fn expectation_of_rank(
    p: &[Endpoint],
    rank: u32,
    d_tp: u32,
    blocks: &[u32],
    tokens: u64,
) -> Expectation {
    let p_tp = p.len() as u32;
    if p_tp >= d_tp {
        let per_d = (p_tp / d_tp) as usize;
        let sources: Vec<&Endpoint> = p[rank as usize * per_d..][..per_d].iter().collect();
        return expectation(&sources, blocks, tokens);
    }
    let of = d_tp / p_tp;
    let mut e = expectation(&[&p[(rank / of) as usize]], blocks, tokens);
    e.share = Some(Share { slot: rank % of, of });
    e
}

fn events(endpoint: &Endpoint, count: usize) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < count && Instant::now() < deadline {
        out.extend(endpoint.wait(Duration::from_millis(50)));
    }
    out
}

/// No further event arrives within `quiet`.
fn no_more_events(endpoint: &Endpoint, quiet: Duration) {
    let extra = endpoint.wait(quiet);
    assert!(extra.is_empty(), "unexpected events: {extra:?}");
}

/// P of `p_tp` ranks writes one request into D of `d_tp` ranks; each D rank expects the P ranks
/// that hold its heads. Returns the bytes each D rank reported.
fn transfer(p_tp: u32, d_tp: u32) -> Vec<u64> {
    transfer_streaming(p_tp, d_tp, false)
}

/// [`transfer`]; with `layerwise`, each P rank streams its first region (layer-wise push) into
/// every D rank it feeds once all registered, before its KV is ready.
fn transfer_streaming(p_tp: u32, d_tp: u32, layerwise: bool) -> Vec<u64> {
    const TOKENS: u64 = 10;
    let p_blocks = [3u32, 7, 1];
    let d_blocks = [9u32, 2, 12];
    let mut p_ranks: Vec<Rank> = (0..p_tp).map(|r| Rank::new(r, p_tp, 0xee)).collect();
    for rank in &mut p_ranks {
        rank.compute(&p_blocks, TOKENS);
    }
    let d_ranks: Vec<Rank> = (0..d_tp).map(|r| Rank::new(r, d_tp, 0)).collect();
    let p: Vec<Endpoint> =
        p_ranks.iter().map(|r| r.endpoint(&format!("p{}-of-{p_tp}", r.tp_rank))).collect();
    let d: Vec<Endpoint> =
        d_ranks.iter().map(|r| r.endpoint(&format!("d{}-of-{d_tp}", r.tp_rank))).collect();
    for (rank, endpoint) in d.iter().enumerate() {
        endpoint.expect(expectation_of_rank(&p, rank as u32, d_tp, &d_blocks, TOKENS)).unwrap();
    }
    if layerwise {
        // Every D rank's registration with every P rank that feeds it.
        let registrations = p_tp.max(d_tp) as usize;
        let registered = || p.iter().map(Endpoint::pending).sum::<usize>() >= registrations;
        assert!(eventually(registered), "the registrations never reached P");
        for endpoint in &p {
            endpoint.layers_ready(ready("p-request", &p_blocks, TOKENS), 0..1).unwrap();
        }
        // The KV is ready a forward pass later: after the writer took the layers.
        let slots = u64::from((d_tp / p_tp).max(1));
        let streamed = || p.iter().all(|e| e.stats().streamed_writes == slots);
        assert!(eventually(streamed), "the layers never streamed");
    }
    for endpoint in &p {
        endpoint.ready(ready("p-request", &p_blocks, TOKENS)).unwrap();
    }
    let mut bytes = Vec::new();
    for endpoint in &d {
        let received = events(endpoint, 1);
        assert_eq!(received.len(), 1, "{received:?}");
        assert_eq!((received[0].role, &received[0].outcome), (Role::Receive, &Outcome::Done));
        bytes.push(received[0].bytes);
    }
    for endpoint in &p {
        let sent = events(endpoint, 1);
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].outcome, Outcome::Done, "{sent:?}");
        if layerwise {
            // One of the two regions went first, into every D rank this P rank feeds.
            assert_eq!(2 * sent[0].streamed_bytes, sent[0].bytes, "{sent:?}");
        }
    }
    for endpoint in &d {
        no_more_events(endpoint, Duration::from_millis(100));
    }
    drop((p, d));
    for rank in &d_ranks {
        rank.check(&d_blocks, TOKENS);
    }
    bytes
}

#[test]
fn p_tp2_writes_each_half_of_d_tp1s_heads() {
    let bytes = transfer(2, 1);
    assert_eq!(bytes, vec![REGIONS * 10 * u64::from(MODEL_HEADS) * HEAD_BYTES]);
}

#[test]
fn p_tp4_writes_into_d_tp2_two_ranks_each() {
    let bytes = transfer(4, 2);
    assert_eq!(bytes, vec![REGIONS * 10 * 2 * HEAD_BYTES; 2]);
}

#[test]
fn p_tp1_writes_each_of_d_tp2s_ranks_its_half() {
    let bytes = transfer(1, 2);
    assert_eq!(bytes, vec![REGIONS * 10 * 2 * HEAD_BYTES; 2]);
}

#[test]
fn p_tp2_writes_into_d_tp4_two_ranks_each() {
    let bytes = transfer(2, 4);
    assert_eq!(bytes, vec![REGIONS * 10 * HEAD_BYTES; 4]);
}

#[test]
fn layer_wise_push_streams_each_p_ranks_heads_into_d_tp1() {
    let bytes = transfer_streaming(2, 1, true);
    assert_eq!(bytes, vec![REGIONS * 10 * u64::from(MODEL_HEADS) * HEAD_BYTES]);
}

#[test]
fn layer_wise_push_streams_into_every_d_rank_a_p_rank_feeds() {
    let bytes = transfer_streaming(1, 2, true);
    assert_eq!(bytes, vec![REGIONS * 10 * 2 * HEAD_BYTES; 2]);
}

/// P tp1 and D tp2, with the KV ready before either D rank registered, and D rank 1 late.
#[test]
fn a_p_rank_writes_each_d_rank_as_its_registration_arrives_and_reports_once() {
    let mut p_rank = Rank::new(0, 1, 0xee);
    p_rank.compute(&[1, 2, 3], 10);
    let d_ranks: Vec<Rank> = (0..2).map(|r| Rank::new(r, 2, 0)).collect();
    let p = vec![p_rank.endpoint("late-p")];
    let d: Vec<Endpoint> =
        d_ranks.iter().map(|r| r.endpoint(&format!("late-d{}", r.tp_rank))).collect();
    p[0].ready(ready("p-request", &[1, 2, 3], 10)).unwrap();
    d[0].expect(expectation_of_rank(&p, 0, 2, &[4, 5, 6], 10)).unwrap();
    let first = events(&d[0], 1);
    assert_eq!(first[0].outcome, Outcome::Done, "{first:?}");
    no_more_events(&p[0], Duration::from_millis(200));
    d[1].expect(expectation_of_rank(&p, 1, 2, &[7, 8, 9], 10)).unwrap();
    let second = events(&d[1], 1);
    assert_eq!(second[0].outcome, Outcome::Done, "{second:?}");
    let sent = events(&p[0], 1);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!((sent[0].outcome.clone(), sent[0].key.as_str()), (Outcome::Done, "xfer-tp"));
    assert_eq!(sent[0].bytes, REGIONS * 10 * u64::from(MODEL_HEADS) * HEAD_BYTES);
    assert_eq!(p[0].pending(), 0);
    drop((p, d));
    d_ranks[0].check(&[4, 5, 6], 10);
    d_ranks[1].check(&[7, 8, 9], 10);
}

#[test]
fn p_aborting_a_transfer_for_several_d_ranks_fails_each_of_them() {
    let p_rank = Rank::new(0, 1, 0xee);
    let d_ranks: Vec<Rank> = (0..2).map(|r| Rank::new(r, 2, 0)).collect();
    let p = vec![p_rank.endpoint("abort-p")];
    let d: Vec<Endpoint> =
        d_ranks.iter().map(|r| r.endpoint(&format!("abort-d{}", r.tp_rank))).collect();
    for (rank, endpoint) in d.iter().enumerate() {
        endpoint.expect(expectation_of_rank(&p, rank as u32, 2, &[1, 2], 8)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while p[0].pending() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        p[0].abort("p-request", Some("xfer-tp")).unwrap(),
        kvpush_core::endpoint::AbortOutcome::Released
    );
    for endpoint in &d {
        let received = events(endpoint, 1);
        assert_eq!(received.len(), 1, "{received:?}");
        assert_eq!(received[0].outcome.cause().map(|c| c.reason), Some(Reason::Aborted));
    }
    // The KV coming after all is refused, and nothing is written.
    assert!(p[0].ready(ready("p-request", &[1, 2], 8)).is_err());
    no_more_events(&p[0], Duration::from_millis(200));
    drop((p, d));
    assert!(d_ranks.iter().all(|r| r.memory.iter().all(|&b| b == 0)));
}

#[test]
fn one_d_rank_cancelling_ends_only_its_slot() {
    let mut p_rank = Rank::new(0, 1, 0xee);
    p_rank.compute(&[1, 2, 3], 10);
    let d_ranks: Vec<Rank> = (0..2).map(|r| Rank::new(r, 2, 0)).collect();
    let p = vec![p_rank.endpoint("cancel-p")];
    let d: Vec<Endpoint> =
        d_ranks.iter().map(|r| r.endpoint(&format!("cancel-d{}", r.tp_rank))).collect();
    for (rank, endpoint) in d.iter().enumerate() {
        endpoint.expect(expectation_of_rank(&p, rank as u32, 2, &[4, 5, 6], 10)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while p[0].pending() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    d[1].cancel("d-request").unwrap();
    let cancelled = events(&d[1], 1);
    assert!(matches!(cancelled[0].outcome, Outcome::Cancelled(_)), "{cancelled:?}");
    p[0].ready(ready("p-request", &[1, 2, 3], 10)).unwrap();
    let received = events(&d[0], 1);
    assert_eq!(received[0].outcome, Outcome::Done, "{received:?}");
    let sent = events(&p[0], 1);
    assert_eq!(sent.len(), 1, "one send event for both slots: {sent:?}");
    assert!(matches!(sent[0].outcome, Outcome::Cancelled(_)), "the worst slot: {sent:?}");
    assert_eq!(sent[0].bytes, REGIONS * 10 * 2 * HEAD_BYTES, "rank 0's half only");
    drop((p, d));
    d_ranks[0].check(&[4, 5, 6], 10);
    assert!(d_ranks[1].memory.iter().all(|&b| b == 0), "nothing landed in the cancelled rank");
}

#[test]
fn a_d_rank_claiming_the_wrong_share_fails_before_anything_is_written() {
    let mut p_rank = Rank::new(0, 1, 0xee);
    p_rank.compute(&[1, 2, 3], 10);
    let d_rank = Rank::new(1, 2, 0);
    let p = vec![p_rank.endpoint("share-p")];
    let d = d_rank.endpoint("share-d1");
    // D rank 1 claims slot 0 (a connector that numbered its ranks wrongly).
    let mut e = expectation_of_rank(&p, 1, 2, &[4, 5, 6], 10);
    e.share = Some(Share { slot: 0, of: 2 });
    d.expect(e).unwrap();
    let received = events(&d, 1);
    let cause = received[0].outcome.cause().expect("refused");
    assert_eq!(cause.reason, Reason::Incompatible, "{cause:?}");
    assert!(cause.detail.contains("is share 1 of 2"), "{cause:?}");
    drop((p, d));
    assert!(d_rank.memory.iter().all(|&b| b == 0));
}

#[test]
fn one_p_rank_failing_fails_d_once_naming_it_after_the_other_rank_stopped() {
    let p_ranks: Vec<Rank> = (0..2).map(|r| Rank::new(r, 2, 0xee)).collect();
    let d_rank = Rank::new(0, 1, 0);
    let p: Vec<Endpoint> =
        p_ranks.iter().map(|r| r.endpoint(&format!("fail-p{}", r.tp_rank))).collect();
    let d = d_rank.endpoint("fail-d");
    d.expect(expectation(&[&p[0], &p[1]], &[1, 2, 3], 10)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while (p[0].pending() == 0 || p[1].pending() == 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Rank 1's request is aborted before its prefill finished; rank 0 has not finished its
    // either. D must cancel rank 0's registration and hear it confirmed before it reports.
    p[1].abort("p-request", Some("xfer-tp")).unwrap();
    let received = events(&d, 1);
    assert_eq!(received.len(), 1, "{received:?}");
    let cause = received[0].outcome.cause().expect("the receive failed");
    assert!(matches!(received[0].outcome, Outcome::Failed(_)), "{received:?}");
    assert_eq!(cause.reason, Reason::Aborted, "{cause:?}");
    assert!(cause.detail.contains("P rank 1 of 2"), "the failed rank is named: {cause:?}");
    assert_eq!(p[0].pending(), 0, "D's cancel removed rank 0's registration before D reported");
    // Rank 0 finishing later writes nothing: its registration is gone.
    p[0].ready(ready("p-request", &[4, 5, 6], 10)).ok();
    no_more_events(&d, Duration::from_millis(300));
    drop((p, d));
    assert!(d_rank.memory.iter().all(|&b| b == 0), "no byte landed in D's blocks");
}

#[test]
fn an_expectation_must_name_each_p_rank_once() {
    let p_rank = Rank::new(0, 1, 0);
    let d_rank = Rank::new(0, 1, 0);
    let p = p_rank.endpoint("twice-p");
    let d = d_rank.endpoint("twice-d");
    let error = d.expect(expectation(&[&p, &p], &[1], 4)).unwrap_err();
    assert!(error.to_string().contains("named twice"), "{error}");
    let error = d.expect(expectation(&[], &[1], 4)).unwrap_err();
    assert!(error.to_string().contains("no P address"), "{error}");
}

#[test]
fn an_expectation_naming_too_few_p_ranks_fails_before_anything_is_written() {
    // A router that left out P's tp_size: D asks only P's rank 0, which holds half its heads.
    let mut p_rank = Rank::new(0, 2, 0xee);
    p_rank.compute(&[1, 2, 3], 10);
    let d_rank = Rank::new(0, 1, 0);
    let p = p_rank.endpoint("few-p0");
    let d = d_rank.endpoint("few-d");
    d.expect(expectation(&[&p], &[4, 5, 6], 10)).unwrap();
    p.ready(ready("p-request", &[1, 2, 3], 10)).unwrap();
    let received = events(&d, 1);
    assert_eq!(received.len(), 1, "{received:?}");
    let cause = received[0].outcome.cause().expect("the receive failed");
    assert_eq!(cause.reason, Reason::Incompatible, "{cause:?}");
    assert!(cause.detail.contains("come from 2 rank(s) of P (tp=2)"), "{cause:?}");
    drop((p, d));
    assert!(d_rank.memory.iter().all(|&b| b == 0), "no byte landed in D's blocks");
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

/// Both D ranks' shares of transfer `transfer`, registered with P's one rank.
fn expect_shares(p: &[Endpoint], d: &[Endpoint], transfer: &str, ttl: Duration) {
    for (rank, endpoint) in d.iter().enumerate() {
        let mut e = expectation_of_rank(p, rank as u32, 2, &[1, 2], 8);
        e.request_id = format!("d-{transfer}");
        e.transfer_id = Some(transfer.to_owned());
        e.ttl = ttl;
        endpoint.expect(e).unwrap();
    }
}

/// P's group for a transfer its D ranks registered goes with their registrations when P's KV
/// never comes: whether they expire, D cancels them, or D's connections are lost.
#[test]
fn a_transfer_for_several_d_ranks_is_forgotten_when_its_kv_never_comes() {
    let p_rank = Rank::new(0, 1, 0xee);
    let d_ranks: Vec<Rank> = (0..2).map(|r| Rank::new(r, 2, 0)).collect();
    let p = vec![p_rank.endpoint("gone-p")];
    let d: Vec<Endpoint> =
        d_ranks.iter().map(|r| r.endpoint(&format!("gone-d{}", r.tp_rank))).collect();
    let registered =
        |transfers: usize| eventually(|| p[0].pending() == 2 && p[0].fanouts() == transfers);

    // Expired: D's lease on them runs out.
    expect_shares(&p, &d, "xfer-expiring", Duration::from_millis(300));
    assert!(registered(1), "both slots registered under one group");
    for endpoint in &d {
        let ended = events(endpoint, 1);
        assert_eq!(ended.len(), 1, "{ended:?}");
        assert!(matches!(ended[0].outcome, Outcome::Failed(_) | Outcome::Cancelled(_)));
    }
    assert!(eventually(|| p[0].fanouts() == 0), "the expired transfer's group stayed");
    // P's KV coming after all is refused at once, as it was while the group stood.
    let mut late = ready("p-late", &[1, 2], 8);
    late.transfer_id = Some("xfer-expiring".into());
    assert!(p[0].ready(late).is_err());

    // Cancelled by both D ranks.
    expect_shares(&p, &d, "xfer-cancelled", Duration::from_secs(30));
    assert!(registered(1));
    for endpoint in &d {
        endpoint.cancel("d-xfer-cancelled").unwrap();
        assert!(matches!(events(endpoint, 1)[..], [Event { outcome: Outcome::Cancelled(_), .. }]));
    }
    assert!(eventually(|| p[0].fanouts() == 0), "the cancelled transfer's group stayed");

    // Purged: D's connections are lost.
    expect_shares(&p, &d, "xfer-orphaned", Duration::from_secs(30));
    assert!(registered(1));
    drop(d);
    assert!(eventually(|| p[0].fanouts() == 0), "the lost D ranks' group stayed");
    assert_eq!(p[0].pending(), 0);
    assert_eq!(p[0].stats().purged_registrations, 2);
}

/// P tp1 and D tp2 for the layer-wise cases: P's rank (its KV computed in blocks 1-3), D's two
/// ranks (receiving into blocks 4-6 and 7-9), and P's endpoint made by `p_endpoint`.
struct FanOut {
    p_rank: Rank,
    d_ranks: Vec<Rank>,
}

const FAN_TOKENS: u64 = 10;
const FAN_P_BLOCKS: [u32; 3] = [1, 2, 3];
const FAN_D_BLOCKS: [[u32; 3]; 2] = [[4, 5, 6], [7, 8, 9]];

impl FanOut {
    fn new() -> Self {
        let mut p_rank = Rank::new(0, 1, 0xee);
        p_rank.compute(&FAN_P_BLOCKS, FAN_TOKENS);
        Self { p_rank, d_ranks: (0..2).map(|r| Rank::new(r, 2, 0)).collect() }
    }

    fn d_endpoints(&self, name: &str) -> Vec<Endpoint> {
        self.d_ranks.iter().map(|r| r.endpoint(&format!("{name}-d{}", r.tp_rank))).collect()
    }

    /// D rank `rank` registers with P and waits until P's table holds `pending` registrations.
    fn register(&self, p: &[Endpoint], d: &[Endpoint], rank: u32, pending: usize) {
        let blocks = &FAN_D_BLOCKS[rank as usize];
        d[rank as usize].expect(expectation_of_rank(p, rank, 2, blocks, FAN_TOKENS)).unwrap();
        assert!(eventually(|| p[0].pending() == pending), "D rank {rank} never reached P");
    }

    /// Nothing landed in D's second region (the layer P did not stream) of any rank.
    fn second_region_untouched(&self) -> bool {
        self.d_ranks.iter().all(|r| r.memory[r.memory.len() / 2..].iter().all(|&b| b == 0))
    }
}

fn p_request() -> ReadyKv {
    ready("p-request", &FAN_P_BLOCKS, FAN_TOKENS)
}

/// D rank 1 registers only after P streamed its first layer into rank 0: rank 0 receives the
/// rest in its request's WRITE, rank 1 every layer in its own, and each gets exactly its heads.
#[test]
fn a_d_rank_registering_after_a_layer_streamed_receives_every_layer_in_its_write() {
    let fan = FanOut::new();
    let p = vec![fan.p_rank.endpoint("late-lw-p")];
    let d = fan.d_endpoints("late-lw");
    fan.register(&p, &d, 0, 1);
    p[0].layers_ready(p_request(), 0..1).unwrap();
    assert!(eventually(|| p[0].stats().streamed_writes == 1), "the first layer never streamed");
    fan.register(&p, &d, 1, 2);
    // Rank 0's stream goes on; rank 1's would not continue what it holds (nothing), so its
    // request's WRITE carries both layers.
    p[0].layers_ready(p_request(), 1..2).unwrap();
    assert!(eventually(|| p[0].stats().streamed_writes == 2), "the second layer never streamed");
    p[0].ready(p_request()).unwrap();
    let half = REGIONS * FAN_TOKENS * 2 * HEAD_BYTES;
    for endpoint in &d {
        let received = events(endpoint, 1);
        assert_eq!(received.len(), 1, "{received:?}");
        assert_eq!((&received[0].outcome, received[0].bytes), (&Outcome::Done, half));
    }
    let sent = events(&p[0], 1);
    assert_eq!(sent.len(), 1, "one send event for both slots: {sent:?}");
    assert_eq!(sent[0].outcome, Outcome::Done, "{sent:?}");
    assert_eq!((sent[0].bytes, sent[0].streamed_bytes), (2 * half, half), "{sent:?}");
    no_more_events(&p[0], Duration::from_millis(100));
    drop((p, d));
    for (rank, blocks) in fan.d_ranks.iter().zip(FAN_D_BLOCKS) {
        rank.check(&blocks, FAN_TOKENS);
    }
}

/// P's KV is refused (its TTL is past the maximum) while a layer of it waits in the stuck writer's
/// inbox and D rank 1's registration arrived meanwhile: P's engine frees the blocks, so the
/// layer must never be written into either rank, and each D rank hears that P will not send.
#[test]
fn a_kv_refused_with_a_layer_queued_before_a_d_rank_s_late_registration_is_never_read() {
    let fan = FanOut::new();
    let gate = Gate::closed();
    let p = vec![fan.p_rank.endpoint_with("refused-lw-p", Fault::None, Some(&gate), |_| {})];
    let d = fan.d_endpoints("refused-lw");
    // D rank 1 connects first (another transfer), so that its registration below reaches P's
    // table while P's writer is stuck.
    let mut warm_up = expectation_of_rank(&p, 1, 2, &[10, 11], 4);
    warm_up.request_id = "warm-up".into();
    warm_up.transfer_id = Some("xfer-warm-up".into());
    d[1].expect(warm_up).unwrap();
    assert!(eventually(|| p[0].pending() == 1), "D rank 1 never reached P");
    fan.register(&p, &d, 0, 2);
    gate.wait_holding();
    p[0].layers_ready(p_request(), 0..1).unwrap();
    fan.register(&p, &d, 1, 3);
    let too_long = Duration::from_secs(u64::from(u32::MAX));
    let refused = p[0].ready(ReadyKv { ttl: too_long, ..p_request() });
    assert!(refused.is_err(), "P's KV with a TTL of a century was taken: {refused:?}");
    gate.open();
    for endpoint in &d {
        let received: Vec<Event> =
            events(endpoint, 1).into_iter().filter(|e| e.request_id == "d-request").collect();
        assert_eq!(received.len(), 1, "{received:?}");
        let cause = received[0].outcome.cause().expect("failed");
        assert_eq!(cause.reason, Reason::Aborted, "{cause:?}");
        assert!(cause.detail.contains("could not send"), "{cause:?}");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(p[0].stats().streamed_writes, 0, "a layer read blocks P's engine freed");
    no_more_events(&d[0], Duration::from_millis(50));
    drop((p, d));
    assert!(fan.d_ranks.iter().all(|r| r.memory.iter().all(|&b| b == 0)), "nothing landed");
}

/// P aborts the prefill while its first layer's WRITEs into both D ranks are in flight: the
/// abort waits for them, then each D rank fails once and P's send ends once (cancelled), and
/// nothing of the second layer is written.
#[test]
fn a_prefill_aborted_mid_stream_fails_every_d_rank_once_the_layer_s_writes_are_done() {
    let fan = FanOut::new();
    let slow = Fault::SlowWrites(Duration::from_millis(300));
    let p = vec![fan.p_rank.endpoint_with("abort-lw-p", slow, None, |_| {})];
    let d = fan.d_endpoints("abort-lw");
    fan.register(&p, &d, 0, 1);
    fan.register(&p, &d, 1, 2);
    p[0].layers_ready(p_request(), 0..1).unwrap();
    assert!(eventually(|| p[0].stats().streamed_writes == 2), "the layer never streamed");
    let outcome = p[0].abort("p-request", Some("xfer-tp")).unwrap();
    assert_eq!(outcome, AbortOutcome::InFlight, "the layer's WRITEs still read P's blocks");
    // The forward pass goes on meanwhile; its next layer must not go.
    p[0].layers_ready(p_request(), 1..2).unwrap();
    for endpoint in &d {
        let received = events(endpoint, 1);
        assert_eq!(received.len(), 1, "{received:?}");
        assert_eq!(received[0].outcome.cause().map(|c| c.reason), Some(Reason::Aborted));
    }
    let sent = events(&p[0], 1);
    assert_eq!(sent.len(), 1, "one send event for both slots: {sent:?}");
    assert!(matches!(sent[0].outcome, Outcome::Cancelled(_)), "{sent:?}");
    assert_eq!(sent[0].outcome.cause().map(|c| c.reason), Some(Reason::Aborted));
    no_more_events(&p[0], Duration::from_millis(100));
    for endpoint in &d {
        no_more_events(endpoint, Duration::from_millis(50));
    }
    assert_eq!(p[0].stats().streamed_writes, 2, "a WRITE after the abort");
    drop((p, d));
    assert!(fan.second_region_untouched(), "the second layer landed after the abort");
}

/// P's writer dies while its abort waits for a layer's WRITEs into both D ranks (nothing will
/// drive them again): the send still ends, once, so that P's engine frees the blocks.
#[test]
fn a_writer_dying_under_a_prefill_aborted_mid_stream_ends_its_send_once_for_every_rank() {
    let fan = FanOut::new();
    let fault = Fault::StuckWritesThenPanic(2);
    let p = vec![fan.p_rank.endpoint_with("died-lw-p", fault, None, |_| {})];
    let d = fan.d_endpoints("died-lw");
    fan.register(&p, &d, 0, 1);
    fan.register(&p, &d, 1, 2);
    p[0].layers_ready(p_request(), 0..1).unwrap();
    assert!(eventually(|| p[0].stats().streamed_writes == 2), "the layer never streamed");
    assert_eq!(p[0].abort("p-request", Some("xfer-tp")).unwrap(), AbortOutcome::InFlight);
    // Another transfer's WRITE into D rank 0 kills the writer.
    let mut next = expectation_of_rank(&p, 0, 2, &[10], 4);
    (next.request_id, next.transfer_id) = ("d-next".into(), Some("xfer-next".into()));
    d[0].expect(next).unwrap();
    assert!(eventually(|| p[0].pending() == 3), "D rank 0's second registration never came");
    let kv = ReadyKv {
        request_id: "p-next".into(),
        transfer_id: Some("xfer-next".into()),
        ..ready("", &[12], 4)
    };
    p[0].ready(kv).unwrap();
    let mut sent = events(&p[0], 2);
    sent.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    let ends: Vec<(&str, Option<Reason>)> =
        sent.iter().map(|e| (e.request_id.as_str(), e.outcome.cause().map(|c| c.reason))).collect();
    assert_eq!(
        ends,
        [("p-next", Some(Reason::WriterDied)), ("p-request", Some(Reason::WriterDied))],
        "{sent:?}"
    );
    no_more_events(&p[0], Duration::from_millis(100));
}

/// P's WRITEs into both D ranks never finish (a stalled link): the request gets one quarantine
/// notice, under the transfer's key, for the first slot's WRITE past the write timeout, and every
/// quarantined WRITE is counted. So for a layer's WRITEs (`layer`) and for the request's.
fn one_quarantine_notice_for_every_d_rank(name: &str, layer: bool) {
    let fan = FanOut::new();
    let fast = |c: &mut EndpointConfig| c.write_timeout = Duration::from_millis(200);
    let p = vec![fan.p_rank.endpoint_with(name, Fault::StuckWrites, None, fast)];
    let d = fan.d_endpoints(name);
    fan.register(&p, &d, 0, 1);
    fan.register(&p, &d, 1, 2);
    if layer {
        p[0].layers_ready(p_request(), 0..1).unwrap();
    } else {
        p[0].ready(p_request()).unwrap();
    }
    let sent = events(&p[0], 1);
    assert!(matches!(&sent[..], [Event { outcome: Outcome::Quarantined(_), .. }]), "{sent:?}");
    assert_eq!(sent[0].key.as_str(), "xfer-tp", "the transfer's key, not a slot's");
    assert!(eventually(|| p[0].stats().quarantined_writes == 2), "{:?}", p[0].stats());
    no_more_events(&p[0], Duration::from_millis(600));
}

#[test]
fn a_request_s_writes_stuck_into_every_d_rank_give_one_quarantine_notice() {
    one_quarantine_notice_for_every_d_rank("stuck-tp", false);
}

#[test]
fn a_layer_s_writes_stuck_into_every_d_rank_give_one_quarantine_notice() {
    one_quarantine_notice_for_every_d_rank("stuck-lw-tp", true);
}

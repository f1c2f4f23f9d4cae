//! "Runs given -> WRITE posted" on a real NIXL agent (DRAM over UCX, two agents in one process):
//! fresh descriptor lists (`post_write`: one local and one remote descriptor per run, then
//! `create_xfer_req`) against lists prepared once (`post_block_write`: `make_xfer_req` on block
//! indices), for 64 layers (K and V regions) x 1,000 blocks, fragmented and contiguous, as the
//! planner gives them. Only the post is timed; each WRITE is then driven to completion, untimed.
//!
//! Then the writer's control work per request, planning included, whole against layer-wise
//! push: one WRITE of every region (plan, block indices, post) against one WRITE per layer (its
//! two regions planned and posted with no notification, 64 times) and the last WRITE carrying
//! only the DONE, for each way of posting. Only the writer's work is timed (the sum over the
//! request's posts); each WRITE is driven to completion, untimed, before the next.
//!
//! Needs `KVPUSH_NIXL_CAPI` (prints SKIP without it); run with `UCX_NET_DEVICES=lo`:
//! `cargo bench -p kvpush-nixl --bench post_write`. Prints a table with the ratio, then
//! criterion's figures.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvpush_benches::block_ids;
use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::planner::{BlockIndices, BlockList, DescriptorRun, PlanRequest, Planner};
use kvpush_core::transport::{
    BlockWrite, MemoryRegion, MemorySpace, Notification, Transport, WriteId, WriteState,
};
use kvpush_nixl::{AgentConfig, Library, NixlTransport};

const LAYERS: usize = 64;
const BLOCKS: u32 = 1_000;
/// Blocks per region: the fragmented case lists every other one.
const CAPACITY: u32 = 2 * BLOCKS;
const BLOCK_TOKENS: u32 = 16;
/// One 2-byte head: 32-byte blocks keep each side's memory at 8 MiB (only posting is timed).
const HEAD_BYTES: u32 = 2;
const SAMPLES: usize = 30;

fn layout(memory: &[u8]) -> KvLayout {
    let block_bytes = u64::from(BLOCK_TOKENS * HEAD_BYTES);
    let region_bytes = block_bytes * u64::from(CAPACITY);
    KvLayout {
        regions: (0..2 * LAYERS as u64)
            .map(|i| Region {
                base: memory.as_ptr() as u64 + i * region_bytes,
                block_stride: block_bytes,
                num_blocks: CAPACITY,
                group: 0,
            })
            .collect(),
        block_tokens: BLOCK_TOKENS,
        kernel_block_tokens: BLOCK_TOKENS,
        heads: 1,
        head_bytes: HEAD_BYTES,
        token_order: TokenOrder::Nhd,
        tp_rank: 0,
        tp_size: 1,
    }
}

fn memory_bytes() -> usize {
    2 * LAYERS * (CAPACITY * BLOCK_TOKENS * HEAD_BYTES) as usize
}

/// One request as the writer has it: runs, and the block form.
struct Case {
    label: &'static str,
    runs: Vec<DescriptorRun>,
    blocks: BlockIndices,
}

struct Bench {
    a: NixlTransport,
    b: NixlTransport,
    planner: Planner,
    peer: String,
    notes: Vec<Notification>,
    // Last: the agents above are dropped before the memory they registered.
    _memory: (Vec<u8>, Vec<u8>),
}

impl Bench {
    fn new(library: &Library) -> Self {
        let (a_mem, b_mem) = (vec![1u8; memory_bytes()], vec![2u8; memory_bytes()]);
        let config = AgentConfig::default();
        let mut a = NixlTransport::new(library, "bench-post-A", &config).expect("agent A");
        let mut b = NixlTransport::new(library, "bench-post-B", &config).expect("agent B");
        let region = |m: &[u8]| MemoryRegion {
            addr: m.as_ptr() as u64,
            len: m.len() as u64,
            space: MemorySpace::DRAM,
        };
        // SAFETY: the memory outlives both agents (`Bench`'s fields drop in order).
        unsafe {
            a.register_memory(&[region(&a_mem)]).expect("register A");
            b.register_memory(&[region(&b_mem)]).expect("register B");
        }
        let peer = a.add_peer(&b.metadata().expect("metadata")).expect("add_peer");
        b.add_peer(&a.metadata().expect("metadata")).expect("add_peer");
        let planner = Planner::new(layout(&a_mem), layout(&b_mem)).expect("compatible");
        Self { a, b, planner, peer, notes: Vec::new(), _memory: (a_mem, b_mem) }
    }

    fn case(&self, contiguous: bool) -> Case {
        let ids = || block_ids(BLOCKS, CAPACITY, contiguous);
        let (p, d) = (ids(), ids());
        let num_tokens = u64::from(BLOCKS * BLOCK_TOKENS);
        let src = [BlockList { first_token: 0, ids: &p }];
        let dst = [BlockList { first_token: 0, ids: &d }];
        let req = PlanRequest { request: "bench", num_tokens, src: &src, dst: &dst };
        let plan = self.planner.plan(&req).expect("valid request");
        let mut blocks = BlockIndices::default();
        assert!(self.planner.block_indices_into(&req, &mut blocks), "whole blocks");
        let label = if contiguous { "contiguous" } else { "fragmented" };
        Case { label, runs: plan.runs, blocks }
    }

    /// Posts `case` one way; returns the time the post took, after driving the WRITE to its
    /// end (untimed).
    fn post(&mut self, case: &Case, prepared: bool) -> Duration {
        let start = Instant::now();
        let write = self.post_runs(&case.runs, prepared.then_some(&case.blocks), true);
        let took = start.elapsed();
        self.finish(write, true);
        took
    }

    /// Posts `runs` to B, as block indices into the prepared lists when `blocks` are given,
    /// with the DONE notification when `notify`.
    fn post_runs(
        &mut self,
        runs: &[DescriptorRun],
        blocks: Option<&BlockIndices>,
        notify: bool,
    ) -> WriteId {
        let dram = MemorySpace::DRAM;
        let notification = notify.then_some(&b"done"[..]);
        match blocks {
            Some(blocks) => {
                let tables = self.planner.block_tables().expect("tables");
                let write = BlockWrite {
                    runs,
                    src_blocks: tables.0,
                    dst_blocks: tables.1,
                    src: blocks.src(),
                    dst: blocks.dst(),
                };
                self.a.post_block_write(&self.peer, black_box(&write), dram, dram, notification)
            }
            None => self.a.post_write(&self.peer, black_box(runs), dram, dram, notification),
        }
        .expect("posted")
    }

    /// The writer's work for one request, planned from its block lists as the writer plans
    /// it: one WRITE of every region, or (`layer_wise`) one WRITE of each layer's K and V
    /// regions with no notification and a last one carrying only the DONE. Returns the summed
    /// time of planning and posting.
    fn request(
        &mut self,
        blocks: u32,
        contiguous: bool,
        prepared: bool,
        layer_wise: bool,
    ) -> Duration {
        let ids = || block_ids(blocks, CAPACITY, contiguous);
        let (p, d) = (ids(), ids());
        let num_tokens = u64::from(blocks * BLOCK_TOKENS);
        let src = [BlockList { first_token: 0, ids: &p }];
        let dst = [BlockList { first_token: 0, ids: &d }];
        let req = PlanRequest { request: "bench", num_tokens, src: &src, dst: &dst };
        let regions = self.planner.region_count();
        let steps: Vec<(std::ops::Range<usize>, bool)> = if layer_wise {
            (0..regions)
                .step_by(2)
                .map(|first| (first..first + 2, false))
                .chain(std::iter::once((regions..regions, true)))
                .collect()
        } else {
            vec![(0..regions, true)]
        };
        let mut indices = BlockIndices::default();
        let mut took = Duration::ZERO;
        for (range, notify) in steps {
            let start = Instant::now();
            let write = self.post_regions(&req, range, notify, prepared, &mut indices);
            took += start.elapsed();
            self.finish(write, notify);
        }
        took
    }

    fn post_regions(
        &mut self,
        req: &PlanRequest<'_>,
        regions: std::ops::Range<usize>,
        notify: bool,
        prepared: bool,
        blocks: &mut BlockIndices,
    ) -> WriteId {
        let plan = self.planner.plan_regions(req, regions.clone()).expect("valid request");
        let given = prepared && self.planner.block_indices_of_regions_into(req, regions, blocks);
        self.post_runs(&plan.runs, given.then_some(&*blocks), notify)
    }

    /// Drives a WRITE to its end and, when it `notified`, to B's notification (B's agent is
    /// progressed throughout: UCX over loopback may need both sides to move).
    fn finish(&mut self, write: WriteId, notified: bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut done = false;
        loop {
            if !done {
                done = self.a.poll_write(write).expect("poll_write") == WriteState::Done;
            }
            self.b.take_notifications(&mut self.notes).expect("take_notifications");
            if done && (!notified || !self.notes.is_empty()) {
                assert!(
                    notified || self.notes.is_empty(),
                    "a WRITE without a notification notified"
                );
                self.notes.clear();
                return;
            }
            assert!(Instant::now() < deadline, "the WRITE did not finish");
        }
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn bench_post_write(c: &mut Criterion) {
    let library = match Library::discover() {
        Ok(library) => library,
        Err(e) => {
            eprintln!("SKIP: {e}");
            return;
        }
    };
    let mut bench = Bench::new(&library);
    let cases = [bench.case(false), bench.case(true)];
    println!("post_write, {LAYERS} layers (K and V) x {BLOCKS} blocks, median of {SAMPLES} posts:");
    println!(
        "{:<11} {:>8} {:>8} {:>12} {:>12} {:>7}",
        "case", "runs", "blocks", "fresh", "prepared", "ratio"
    );
    for case in &cases {
        // The first prepared post prepares both lists: not a sample.
        bench.post(case, true);
        let before = bench.a.prepared_writes();
        let fresh = median((0..SAMPLES).map(|_| bench.post(case, false)).collect());
        let prepared = median((0..SAMPLES).map(|_| bench.post(case, true)).collect());
        // `post_block_write` takes the fresh lists itself when the runs are far fewer.
        let path =
            if bench.a.prepared_writes() > before { "" } else { " (block form posted fresh)" };
        println!(
            "{:<11} {:>8} {:>8} {:>12.1?} {:>12.1?} {:>6.1}x{path}",
            case.label,
            case.runs.len(),
            case.blocks.src().len(),
            fresh,
            prepared,
            fresh.as_secs_f64() / prepared.as_secs_f64()
        );
    }
    println!();
    println!(
        "the writer's work per request ({LAYERS} layers, plan + post summed), median of \
         {SAMPLES}: one WRITE, or one per layer and a last one with the DONE"
    );
    println!(
        "{:<8} {:<11} {:<9} {:>12} {:>14} {:>7}",
        "blocks", "case", "lists", "one WRITE", "per layer", "ratio"
    );
    for blocks in [64, BLOCKS] {
        for contiguous in [false, true] {
            for prepared in [false, true] {
                let mut request = |layer_wise| {
                    let samples = (0..SAMPLES)
                        .map(|_| bench.request(blocks, contiguous, prepared, layer_wise))
                        .collect();
                    median(samples)
                };
                request(true); // warm-up: lists prepared
                let (whole, layers) = (request(false), request(true));
                println!(
                    "{:<8} {:<11} {:<9} {:>12.1?} {:>14.1?} {:>6.2}x",
                    blocks,
                    if contiguous { "contiguous" } else { "fragmented" },
                    if prepared { "prepared" } else { "fresh" },
                    whole,
                    layers,
                    layers.as_secs_f64() / whole.as_secs_f64()
                );
            }
        }
    }
    let mut group = c.benchmark_group("nixl post_write/64 layers x 1000 blocks");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for case in &cases {
        for (way, prepared) in [("fresh lists", false), ("prepared lists", true)] {
            group.bench_function(BenchmarkId::new(way, case.label), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| bench.post(case, prepared)).sum())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_post_write);
criterion_main!(benches);

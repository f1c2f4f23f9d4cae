//! The planner on the shapes that matter: 64 layers x 1,000 blocks, contiguous and fragmented,
//! equal block sizes, P 16 -> D 32 tokens, and HND head slicing (P tp 2 -> D tp 1).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpush_benches::{block_ids, layout};
use kvpush_core::layout::TokenOrder;
use kvpush_core::planner::{BlockList, PlanRequest, Planner};

const LAYERS: usize = 64;
const BLOCKS: u32 = 1_000;
const CAPACITY: u32 = 4 * BLOCKS;

fn bench_planner(c: &mut Criterion) {
    let mut group = c.benchmark_group("planner/64 layers x 1000 blocks");
    let cases = [
        ("NHD P16->D16", (16, 16), TokenOrder::Nhd, (0, 1), (0, 1), 8),
        ("NHD P16->D32", (16, 32), TokenOrder::Nhd, (0, 1), (0, 1), 8),
        ("HND tp2->tp1", (16, 16), TokenOrder::Hnd, (1, 2), (0, 1), 8),
    ];
    for (name, (p_tokens, d_tokens), order, p_tp, d_tp, total_heads) in cases {
        let src = layout(LAYERS, CAPACITY, p_tokens, total_heads / p_tp.1, order, p_tp);
        let dst = layout(LAYERS, CAPACITY, d_tokens, total_heads / d_tp.1, order, d_tp);
        let planner = Planner::new(src, dst).expect("bench layouts are compatible");
        let num_tokens = u64::from(BLOCKS) * u64::from(p_tokens);
        for contiguous in [true, false] {
            let p_ids = block_ids(BLOCKS, CAPACITY, contiguous);
            let d_count = (num_tokens / u64::from(d_tokens)) as u32;
            let d_ids = block_ids(d_count, CAPACITY, contiguous);
            let src = [BlockList { first_token: 0, ids: &p_ids }];
            let dst = [BlockList { first_token: 0, ids: &d_ids }];
            let req = PlanRequest { request: "bench", num_tokens, src: &src, dst: &dst };
            let mut runs = Vec::new();
            let stats = planner.plan_into(&req, &mut runs).expect("bench request is valid");
            group.throughput(Throughput::Elements(stats.unmerged_runs as u64));
            let label = if contiguous { "contiguous" } else { "fragmented" };
            println!(
                "{name} {label}: {} runs ({} before merging)",
                stats.runs, stats.unmerged_runs
            );
            group.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter(|| {
                    runs.clear();
                    black_box(planner.plan_into(black_box(&req), &mut runs).expect("valid"))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_planner);
criterion_main!(benches);

//! The rendezvous table against a single `Mutex<HashMap>` in the same groups:
//! one thread doing whole lifecycles, two threads racing the two halves of every transfer, and
//! the cost of a match with 10,000 unmatched entries pending.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpush_benches::MutexTable;
use kvpush_core::rendezvous::{Arrival, Outcome, RendezvousTable, TableConfig};
use kvpush_core::TransferKey;

type Table = RendezvousTable<u64, Arc<[u32]>>;

fn table() -> Table {
    RendezvousTable::new(TableConfig { max_entries: 1 << 20, ..TableConfig::default() })
}

fn keys(n: usize, prefix: &str) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:08}")).collect()
}

/// One transfer's whole life on P: ready, registration (match), begin, finish.
fn lifecycle(table: &Table, key: &str, blocks: &Arc<[u32]>, now: Instant) {
    let deadline = now + Duration::from_secs(30);
    let key = TransferKey::from_canonical(key);
    table.ready(key.clone(), Arc::clone(blocks), deadline, now).expect("fresh key");
    let Ok(Arrival::Matched(m)) = table.register(key, 1, 7, deadline, now) else {
        panic!("a registration after ready must match");
    };
    table.begin_write(&m.key, m.epoch).expect("fresh match");
    black_box(table.finish(&m.key, m.epoch, Outcome::Done, now).expect("in flight"));
}

/// The next of `names`' lifecycles. Finished keys stay fenced for the fence TTL, so after each
/// pass over `names` the fences are expired (an hour on) before the names are used again.
fn next_lifecycle(
    table: &Table,
    names: &[String],
    i: &mut usize,
    blocks: &Arc<[u32]>,
    now: Instant,
) {
    lifecycle(table, &names[*i % names.len()], blocks, now);
    *i += 1;
    if *i % names.len() == 0 {
        table.expire(now + Duration::from_secs(3_600));
    }
}

fn single_thread(c: &mut Criterion) {
    let mut group = c.benchmark_group("rendezvous/one thread, per transfer");
    let blocks: Arc<[u32]> = (0..64).collect();
    let names = keys(100_000, "req");
    group.throughput(Throughput::Elements(1));
    group.bench_function("kvpush table (match + write + finish)", |b| {
        let table = table();
        let now = Instant::now();
        let mut i = 0;
        b.iter(|| next_lifecycle(&table, &names, &mut i, &blocks, now))
    });
    group.bench_function("Mutex<HashMap> (match only)", |b| {
        let baseline = MutexTable::default();
        let mut i = 0;
        b.iter(|| {
            let key = &names[i % names.len()];
            let _ = baseline.ready(key, Arc::clone(&blocks));
            black_box(baseline.register(key, 7u64));
            i += 1;
        })
    });
    group.finish();
}

/// Two threads, one delivering registrations and one ready KV, for the same `n` keys.
fn two_threads(c: &mut Criterion) {
    const N: usize = 20_000;
    let mut group = c.benchmark_group("rendezvous/two threads racing halves");
    group.throughput(Throughput::Elements(N as u64));
    group.sample_size(20);
    let blocks: Arc<[u32]> = (0..64).collect();
    let names = Arc::new(keys(N, "race"));

    group.bench_function(BenchmarkId::new("kvpush table", N), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let table = Arc::new(table());
                let barrier = Arc::new(Barrier::new(2));
                let now = Instant::now();
                let deadline = now + Duration::from_secs(30);
                let (t, n, bar) = (Arc::clone(&table), Arc::clone(&names), Arc::clone(&barrier));
                let d_side = thread::spawn(move || {
                    bar.wait();
                    n.iter()
                        .filter(|k| {
                            let key = TransferKey::from_canonical(k);
                            matches!(t.register(key, 1, 7, deadline, now), Ok(Arrival::Matched(_)))
                        })
                        .count()
                });
                barrier.wait();
                let start = Instant::now();
                let p_matches = names
                    .iter()
                    .filter(|k| {
                        let key = TransferKey::from_canonical(k);
                        let ready = table.ready(key, Arc::clone(&blocks), deadline, now);
                        matches!(ready, Ok(Arrival::Matched(_)))
                    })
                    .count();
                let d_matches = d_side.join().expect("D thread");
                total += start.elapsed();
                assert_eq!(p_matches + d_matches, N, "every key matches exactly once");
            }
            total
        })
    });
    group.bench_function(BenchmarkId::new("Mutex<HashMap>", N), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let baseline = Arc::new(MutexTable::default());
                let barrier = Arc::new(Barrier::new(2));
                let (t, n, bar) = (Arc::clone(&baseline), Arc::clone(&names), Arc::clone(&barrier));
                let d_side = thread::spawn(move || {
                    bar.wait();
                    n.iter().filter(|k| t.register(k, 7u64).is_some()).count()
                });
                barrier.wait();
                let start = Instant::now();
                let p_matches = names
                    .iter()
                    .filter(|k| baseline.ready(k, Arc::clone(&blocks)).is_some())
                    .count();
                let d_matches = d_side.join().expect("D thread");
                total += start.elapsed();
                assert_eq!(p_matches + d_matches, N, "every key matches exactly once");
            }
            total
        })
    });
    group.finish();
}

/// The cost of one match when 10,000 unmatched entries wait on each side.
fn under_load(c: &mut Criterion) {
    let mut group = c.benchmark_group("rendezvous/match with pending entries");
    let blocks: Arc<[u32]> = (0..64).collect();
    for pending in [0usize, 10_000] {
        let table = table();
        let now = Instant::now();
        // Far enough out that `next_lifecycle`'s fence clean-up never expires them.
        let deadline = now + Duration::from_secs(10 * 86_400);
        for k in keys(pending, "waiting-d") {
            let _ = table.register(TransferKey::from_canonical(&k), 1, 7, deadline, now);
        }
        for k in keys(pending, "waiting-p") {
            let _ =
                table.ready(TransferKey::from_canonical(&k), Arc::clone(&blocks), deadline, now);
        }
        let names = keys(100_000, "hot");
        let mut i = 0;
        group.bench_function(BenchmarkId::new("kvpush table", pending), |b| {
            b.iter(|| next_lifecycle(&table, &names, &mut i, &blocks, now))
        });
    }
    group.finish();
}

criterion_group!(benches, single_thread, two_threads, under_load);
criterion_main!(benches);

//! Runs whole transfer lifecycles through the rendezvous table (and, with `baseline`, the bare
//! `Mutex<HashMap>`) for counting instructions under callgrind, which are stable on a noisy
//! machine where wall-clock time is not:
//!
//! ```text
//! cargo build --release -p kvpush-benches --example rendezvous_lifecycles
//! valgrind --tool=callgrind --callgrind-out-file=cg.table \
//!     target/release/examples/rendezvous_lifecycles table 100000
//! valgrind --tool=callgrind --callgrind-out-file=cg.warmup \
//!     target/release/examples/rendezvous_lifecycles table 0
//! ```
//!
//! Instructions per lifecycle are `(Ir(n) - Ir(0)) / n`: the zero run pays the same set-up (key
//! names, table, process start), so the difference is the lifecycles alone. The lifecycle is the
//! one `benches/rendezvous.rs` times: key built from a name, ready, register (match), begin,
//! finish, with the fences expired after each pass over the names. `baseline` does the bare
//! `Mutex<HashMap>`'s two operations per transfer instead, and `race` the two-thread bench's
//! halves of `n` transfers.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush_benches::MutexTable;
use kvpush_core::rendezvous::{Arrival, Outcome, RendezvousTable, TableConfig};
use kvpush_core::TransferKey;

type Table = RendezvousTable<u64, Arc<[u32]>>;

/// Distinct names per pass; fences are expired after each pass, as in the criterion bench.
/// `race` takes its keys from the same names, so its `n` is at most this.
const NAMES: usize = 100_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "table".into());
    let n: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let names: Vec<String> = (0..NAMES).map(|i| format!("req-{i:08}")).collect();
    let blocks: Arc<[u32]> = (0..64).collect();
    let now = Instant::now();
    let deadline = now + Duration::from_secs(30);
    match which.as_str() {
        "table" => {
            let table: Table = RendezvousTable::new(TableConfig {
                max_entries: 1 << 20,
                ..TableConfig::default()
            });
            for i in 0..n {
                let key = TransferKey::from_canonical(&names[i % NAMES]);
                table.ready(key.clone(), Arc::clone(&blocks), deadline, now).expect("fresh key");
                let Ok(Arrival::Matched(m)) = table.register(key, 1, 7, deadline, now) else {
                    panic!("a registration after ready must match");
                };
                table.begin_write(&m.key, m.epoch).expect("fresh match");
                black_box(table.finish(&m.key, m.epoch, Outcome::Done, now).expect("in flight"));
                if (i + 1) % NAMES == 0 {
                    black_box(table.expire(now + Duration::from_secs(3_600)));
                }
            }
        }
        "baseline" => {
            let baseline = MutexTable::default();
            for i in 0..n {
                let key = &names[i % NAMES];
                let _ = baseline.ready(key, Arc::clone(&blocks));
                black_box(baseline.register(key, 7u64));
            }
        }
        "race" => {
            // Two threads racing the halves of `n` transfers, as in the criterion bench; callgrind
            // runs threads one at a time, so this counts the work, not the contention.
            let table: Arc<Table> = Arc::new(RendezvousTable::new(TableConfig {
                max_entries: 1 << 20,
                ..TableConfig::default()
            }));
            assert!(n <= NAMES, "race needs n distinct names");
            let keys = Arc::new(names);
            let (t, k) = (Arc::clone(&table), Arc::clone(&keys));
            let d_side = std::thread::spawn(move || {
                k[..n]
                    .iter()
                    .filter(|k| {
                        let key = TransferKey::from_canonical(k);
                        matches!(t.register(key, 1, 7, deadline, now), Ok(Arrival::Matched(_)))
                    })
                    .count()
            });
            let p_matches = keys[..n]
                .iter()
                .filter(|k| {
                    let key = TransferKey::from_canonical(k);
                    let ready = table.ready(key, Arc::clone(&blocks), deadline, now);
                    matches!(ready, Ok(Arrival::Matched(_)))
                })
                .count();
            let d_matches = d_side.join().expect("D thread");
            assert_eq!(p_matches + d_matches, n, "every key matches exactly once");
        }
        other => panic!("unknown run {other:?}: use table, baseline or race"),
    }
}

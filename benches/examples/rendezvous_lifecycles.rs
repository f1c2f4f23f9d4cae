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
//! halves of `n` transfers (`race-baseline` the same through the `Mutex<HashMap>`).
//!
//! Each run also prints the time its threads spent on a CPU per transfer (from
//! `/proc/thread-self/schedstat`), which, unlike wall-clock time, leaves out the time spent
//! waiting for a CPU that other jobs hold; take the least of a few runs.

use std::hint::black_box;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvpush_benches::MutexTable;
use kvpush_core::rendezvous::{Arrival, Outcome, RendezvousTable, TableConfig};
use kvpush_core::TransferKey;

type Table = RendezvousTable<u64, Arc<[u32]>>;

/// Distinct names per pass; fences are expired after each pass, as in the criterion bench.
/// The races take their keys from the same names, so their `n` is at most this.
const NAMES: usize = 100_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "table".into());
    let n: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let names: Arc<Vec<String>> = Arc::new((0..NAMES).map(|i| format!("req-{i:08}")).collect());
    let blocks: Arc<[u32]> = (0..64).collect();
    let now = Instant::now();
    let deadline = now + Duration::from_secs(30);
    let table = || -> Table {
        RendezvousTable::new(TableConfig { max_entries: 1 << 20, ..TableConfig::default() })
    };
    let lifecycles = |table: &Table, n: usize| {
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
    };
    // Like criterion's warm-up, one untimed pass grows the maps and heaps first, so the timed
    // lifecycles are the steady state (and the zero run under callgrind pays for the pass too).
    let warm = table();
    if which == "table" {
        lifecycles(&warm, NAMES);
    }
    let start = Instant::now();
    let on_cpu = match which.as_str() {
        "table" => on_cpu(|| lifecycles(&warm, n)),
        "baseline" => on_cpu(|| {
            let baseline = MutexTable::default();
            for i in 0..n {
                let key = &names[i % NAMES];
                let _ = baseline.ready(key, Arc::clone(&blocks));
                black_box(baseline.register(key, 7u64));
            }
        }),
        // Callgrind runs threads one at a time, so under it the races count the work, not the
        // contention.
        "race" => {
            let table = Arc::new(table());
            let t = Arc::clone(&table);
            race(
                n,
                &names,
                move |key| {
                    let key = TransferKey::from_canonical(key);
                    matches!(t.register(key, 1, 7, deadline, now), Ok(Arrival::Matched(_)))
                },
                move |key| {
                    let key = TransferKey::from_canonical(key);
                    let ready = table.ready(key, Arc::clone(&blocks), deadline, now);
                    matches!(ready, Ok(Arrival::Matched(_)))
                },
            )
        }
        "race-baseline" => {
            let baseline = Arc::new(MutexTable::default());
            let b = Arc::clone(&baseline);
            race(
                n,
                &names,
                move |key| b.register(key, 7u64).is_some(),
                move |key| baseline.ready(key, Arc::clone(&blocks)).is_some(),
            )
        }
        other => panic!("unknown run {other:?}: use table, baseline, race or race-baseline"),
    };
    let per = |d: Duration| d.as_nanos() as f64 / n.max(1) as f64;
    println!(
        "{which} {n}: {:.0} ns per transfer on CPU, {:.0} ns wall",
        per(on_cpu),
        per(start.elapsed())
    );
}

/// Two threads, D registering and P readying the first `n` names; every key must match once.
/// Returns both threads' time on a CPU.
fn race(
    n: usize,
    names: &Arc<Vec<String>>,
    register: impl Fn(&str) -> bool + Send + 'static,
    ready: impl Fn(&str) -> bool,
) -> Duration {
    assert!(n <= NAMES, "a race needs n distinct names");
    let d_names = Arc::clone(names);
    let d_side = thread::spawn(move || {
        let mut matches = 0;
        let cpu = on_cpu(|| matches = d_names[..n].iter().filter(|k| register(k)).count());
        (matches, cpu)
    });
    let mut p_matches = 0;
    let p_cpu = on_cpu(|| p_matches = names[..n].iter().filter(|k| ready(k)).count());
    let (d_matches, d_cpu) = d_side.join().expect("D thread");
    assert_eq!(p_matches + d_matches, n, "every key matches exactly once");
    p_cpu + d_cpu
}

/// The time this thread spends on a CPU running `f`.
fn on_cpu(f: impl FnOnce()) -> Duration {
    let before = thread_cpu_time();
    f();
    thread_cpu_time().saturating_sub(before)
}

/// This thread's time on a CPU so far (zero where `/proc` does not say).
fn thread_cpu_time() -> Duration {
    let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = schedstat.split_whitespace().next().and_then(|ns| ns.parse().ok()).unwrap_or(0);
    Duration::from_nanos(ns)
}

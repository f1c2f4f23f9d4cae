//! Loom models of the real rendezvous table: every interleaving of a few racing operations, with
//! the table's locks and counters replaced by loom's (see `src/sync.rs`).
//!
//! Each model names the outcome of every interleaving it explores and checks that it saw each
//! legitimate outcome, so a model that stopped exploring (say, a lock no longer from loom) fails
//! instead of passing vacuously.
//!
//! Run with `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//! cargo test -p kvpush-core --test loom_rendezvous --release`.
#![cfg(loom)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvpush_core::rendezvous::{
    Arrival, Cancelled, FenceReason, Outcome, RendezvousError, RendezvousTable, TableConfig,
};
use kvpush_core::TransferKey;
use loom::sync::Arc;
use loom::thread;

type Table = RendezvousTable<&'static str, u32>;
type Answer = Result<Arrival<&'static str, u32>, RendezvousError>;

/// Explores every interleaving of `f` (the models are small enough to need no preemption bound;
/// `LOOM_MAX_PREEMPTIONS` still applies) and checks that the outcomes `f` named are exactly
/// `expected`.
fn model(expected: &[&'static str], f: impl Fn() -> &'static str + Sync + Send + 'static) {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let record = seen.clone();
    loom::model::Builder::new().check(move || {
        let outcome = f();
        record.lock().expect("a model run panicked").insert(outcome);
    });
    let seen = seen.lock().expect("a model run panicked").clone();
    assert_eq!(seen, expected.iter().copied().collect::<BTreeSet<_>>());
}

fn table(shards: usize) -> Arc<Table> {
    Arc::new(RendezvousTable::new(TableConfig {
        shards,
        max_entries: 8,
        fence_ttl: Duration::from_secs(60),
    }))
}

fn key(name: &str) -> TransferKey {
    TransferKey::from_canonical(name)
}

fn is_match(answer: &Answer) -> bool {
    matches!(answer, Ok(Arrival::Matched(_)))
}

fn fenced(name: &str, reason: FenceReason) -> RendezvousError {
    RendezvousError::Fenced { key: key(name), reason }
}

#[test]
fn register_and_ready_match_exactly_once() {
    model(&["D matched", "P matched"], || {
        let (table, now) = (table(2), Instant::now());
        let deadline = now + Duration::from_secs(1);
        let d = {
            let table = table.clone();
            thread::spawn(move || table.register(key("a"), 1, "d", deadline, now))
        };
        let p = table.ready(key("a"), 7, deadline, now);
        let d = d.join().unwrap();

        let (m, outcome) = match (d, p) {
            (Ok(Arrival::Matched(m)), Ok(Arrival::Waiting { superseded: None })) => {
                (m, "D matched")
            }
            (Ok(Arrival::Waiting { superseded: None }), Ok(Arrival::Matched(m))) => {
                (m, "P matched")
            }
            other => panic!("not exactly one match: {other:?}"),
        };
        assert_eq!((m.epoch, m.registration, m.ready), (1, "d", 7));
        assert_eq!(table.len(), 1);
        assert_eq!(table.begin_write(&key("a"), 1), Ok(()));
        outcome
    });
}

#[test]
fn cancel_racing_both_halves_never_matches_after_removal() {
    let outcomes = ["cancel first", "D only", "P only", "matched, then cancelled"];
    model(&outcomes, || {
        let (table, now) = (table(1), Instant::now());
        let deadline = now + Duration::from_secs(1);
        let d = {
            let table = table.clone();
            thread::spawn(move || table.register(key("a"), 1, "d", deadline, now))
        };
        let p = {
            let table = table.clone();
            thread::spawn(move || table.ready(key("a"), 7, deadline, now))
        };
        let cancelled = table.cancel(&key("a"), None, now);
        let (d, p) = (d.join().unwrap(), p.join().unwrap());

        let refused = || Err(fenced("a", FenceReason::Cancelled));
        let outcome = match cancelled {
            Cancelled::NotFound => {
                assert_eq!((&d, &p), (&refused(), &refused()));
                "cancel first"
            }
            Cancelled::Removed { registration: Some("d"), ready: None } => {
                assert_eq!((&d, &p), (&Ok(Arrival::Waiting { superseded: None }), &refused()));
                "D only"
            }
            Cancelled::Removed { registration: None, ready: Some(7) }
                if is_match(&d) || is_match(&p) =>
            {
                // Both arrived before the cancel: the match went out first, and the cancel
                // returns P's kept copy; the match's holder is refused below.
                "matched, then cancelled"
            }
            Cancelled::Removed { registration: None, ready: Some(7) } => {
                assert_eq!((&d, &p), (&refused(), &Ok(Arrival::Waiting { superseded: None })));
                "P only"
            }
            other => panic!("no write began, so the cancel cannot be {other:?} ({d:?}, {p:?})"),
        };
        assert!(!(is_match(&d) && is_match(&p)));
        // Whatever happened, no write may begin, and the key refuses late halves.
        assert_eq!(table.begin_write(&key("a"), 1), Err(fenced("a", FenceReason::Cancelled)));
        assert_eq!((table.len(), table.fences()), (0, 1));
        outcome
    });
}

#[test]
fn two_keys_on_one_shard_each_match_once() {
    let outcomes = ["a here, b here", "a here, b there", "a there, b here", "a there, b there"];
    model(&outcomes, || {
        let (table, now) = (table(1), Instant::now());
        let deadline = now + Duration::from_secs(1);
        let t = {
            let table = table.clone();
            thread::spawn(move || {
                let a = table.register(key("a"), 1, "da", deadline, now);
                let b = table.ready(key("b"), 2, deadline, now);
                (a, b)
            })
        };
        let a = table.ready(key("a"), 1, deadline, now);
        let b = table.register(key("b"), 1, "db", deadline, now);
        let (there_a, there_b) = t.join().unwrap();

        assert_ne!(is_match(&a), is_match(&there_a), "key a: {a:?} / {there_a:?}");
        assert_ne!(is_match(&b), is_match(&there_b), "key b: {b:?} / {there_b:?}");
        assert_eq!(table.len(), 2);
        match (is_match(&a), is_match(&b)) {
            (true, true) => "a here, b here",
            (true, false) => "a here, b there",
            (false, true) => "a there, b here",
            (false, false) => "a there, b there",
        }
    });
}

#[test]
fn register_racing_expire_ends_the_entry_exactly_once() {
    model(&["matched, then expired", "expired, then refused"], || {
        let (table, now) = (table(1), Instant::now());
        let p_deadline = now + Duration::from_millis(10);
        assert!(table.ready(key("a"), 7, p_deadline, now).is_ok());
        let d = {
            let table = table.clone();
            let d_deadline = now + Duration::from_secs(5);
            thread::spawn(move || table.register(key("a"), 1, "d", d_deadline, now))
        };
        let expired = table.expire(now + Duration::from_millis(20));
        let d = d.join().unwrap();

        // P's lease ran out either way: exactly one expiry, handing back P's blocks.
        assert_eq!(expired.len(), 1, "{expired:?}");
        assert_eq!((expired[0].registration, expired[0].ready), (None, Some(7)));
        let outcome = if expired[0].was_matched {
            assert!(is_match(&d), "{d:?}");
            "matched, then expired"
        } else {
            assert_eq!(d, Err(fenced("a", FenceReason::Expired)));
            "expired, then refused"
        };
        // The match (if it went out) can no longer be written.
        assert_eq!(table.begin_write(&key("a"), 1), Err(fenced("a", FenceReason::Expired)));
        assert_eq!((table.len(), table.fences()), (0, 1));
        outcome
    });
}

#[test]
fn cancel_is_acknowledged_only_when_no_write_can_land() {
    model(&["removed before the write", "deferred during the write", "after the write"], || {
        let (table, now) = (table(1), Instant::now());
        let deadline = now + Duration::from_secs(1);
        assert!(table.register(key("a"), 1, "d", deadline, now).is_ok());
        assert!(is_match(&table.ready(key("a"), 7, deadline, now)));
        let writer = {
            let table = table.clone();
            thread::spawn(move || {
                let began = table.begin_write(&key("a"), 1);
                let finished =
                    began.is_ok().then(|| table.finish(&key("a"), 1, Outcome::Done, now));
                (began, finished)
            })
        };
        let cancelled = table.cancel(&key("a"), None, now);
        let (began, finished) = writer.join().unwrap();

        let outcome = match cancelled {
            // Removed before the write began: the writer must not write.
            Cancelled::Removed { registration: None, ready: Some(7) } => {
                assert_eq!(began, Err(fenced("a", FenceReason::Cancelled)));
                "removed before the write"
            }
            // The write was under way: only finish may acknowledge.
            Cancelled::Deferred => {
                assert!(finished.unwrap().unwrap().cancel_acknowledged);
                "deferred during the write"
            }
            // The write had already finished: nothing is left to land.
            Cancelled::NotFound => {
                assert!(!finished.unwrap().unwrap().cancel_acknowledged);
                "after the write"
            }
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!((table.len(), table.fences()), (0, 1));
        outcome
    });
}

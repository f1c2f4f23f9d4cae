//! The table's unit tests: each lifecycle, refusal and bound, on a fixed clock.

use std::fmt;

use super::shard::HEAP_SLACK;
use super::table::EXPIRE_BATCH;
use super::*;

type Table = RendezvousTable<&'static str, Vec<u32>>;

/// A fixed origin and millisecond offsets from it: the table never reads the clock.
struct Clock(Instant);

impl Clock {
    fn new() -> Self {
        Self(Instant::now())
    }
    fn at(&self, ms: u64) -> Instant {
        self.0 + Duration::from_millis(ms)
    }
}

const TTL_MS: u64 = 1_000;

fn table() -> Table {
    table_with(4, 16)
}

fn table_with(shards: usize, max_entries: usize) -> Table {
    RendezvousTable::new(TableConfig {
        shards,
        max_entries,
        fence_ttl: Duration::from_millis(TTL_MS),
    })
}

fn key(name: &str) -> TransferKey {
    TransferKey::from_canonical(name)
}

fn matched<R, K>(arrival: Result<Arrival<R, K>, RendezvousError>) -> Match<R, K>
where
    R: fmt::Debug,
    K: fmt::Debug,
{
    match arrival {
        Ok(Arrival::Matched(m)) => m,
        other => panic!("expected a match, got {other:?}"),
    }
}

fn waiting<R, K>(arrival: Result<Arrival<R, K>, RendezvousError>) -> Option<R>
where
    R: fmt::Debug,
    K: fmt::Debug,
{
    match arrival {
        Ok(Arrival::Waiting { superseded }) => superseded,
        other => panic!("expected waiting, got {other:?}"),
    }
}

/// Everything lapses; nothing may be left behind.
fn assert_drains(table: &Table, clock: &Clock) {
    table.expire(clock.at(1_000_000));
    assert_eq!(
        (table.len(), table.fences(), table.tracked_deadlines()),
        (0, 0, 0),
        "table not drained: {table:?}"
    );
}

#[test]
fn only_a_vacant_key_is_fenced_and_only_live_entries_are_held() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "reg", c.at(100), c.at(0)));
    assert!(table.is_live(&key("a")));
    assert!(!table.fence_vacant(&key("a"), FenceReason::Cancelled, c.at(1)));
    assert!(table.is_live(&key("a")), "a live registration is left alone");
    assert!(!table.is_live(&key("b")));
    assert!(table.fence_vacant(&key("b"), FenceReason::Expired, c.at(2)));
    assert!(!table.is_live(&key("b")), "a fence is not a live entry");
    assert_eq!(
        table.ready(key("b"), vec![1], c.at(100), c.at(3)),
        Err(RendezvousError::Fenced { key: key("b"), reason: FenceReason::Expired })
    );
    assert_drains(&table, &c);
}

#[test]
fn only_the_owner_supersedes_or_cancels_its_registration() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register_owned(key("a"), 1, 7, "owner", c.at(100), c.at(0)));
    assert_eq!(
        table.register_owned(key("a"), 9, 8, "thief", c.at(100), c.at(1)),
        Err(RendezvousError::Foreign { key: key("a") })
    );
    assert_eq!(table.cancel_owned(&key("a"), None, Some(8), c.at(2)), Cancelled::NotFound);
    // The owner's registration still stands, and still matches.
    let m = matched(table.ready(key("a"), vec![1], c.at(100), c.at(3)));
    assert_eq!((m.epoch, m.registration), (1, "owner"));
    // In flight too: the thief can neither queue a rematch nor cancel the write.
    table.begin_write(&key("a"), 1).unwrap();
    assert_eq!(
        table.register_owned(key("a"), 9, 8, "thief", c.at(100), c.at(4)),
        Err(RendezvousError::Foreign { key: key("a") })
    );
    assert_eq!(table.cancel_owned(&key("a"), Some(1), Some(8), c.at(5)), Cancelled::NotFound);
    assert_eq!(table.cancel_owned(&key("a"), Some(1), Some(7), c.at(5)), Cancelled::Deferred);
    // A peer's cancel of a key nobody registered fences nothing.
    assert_eq!(table.cancel_owned(&key("b"), None, Some(8), c.at(6)), Cancelled::NotFound);
    waiting(table.ready(key("b"), vec![2], c.at(100), c.at(7)));
    // Nor can a peer cancel P's ready half, which it never registered for.
    assert_eq!(table.cancel_owned(&key("b"), None, Some(8), c.at(8)), Cancelled::NotFound);
    assert_eq!(table.len(), 2);
}

#[test]
fn take_ready_moves_only_a_waiting_ready_half() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(table.take_ready(&key("none"), c.at(0)), TakeReady::Absent);
    waiting(table.ready(key("a"), vec![1], c.at(100), c.at(0)));
    assert_eq!(
        table.take_ready(&key("a"), c.at(1)),
        TakeReady::Taken { ready: vec![1], deadline: c.at(100) }
    );
    assert_eq!((table.len(), table.fences()), (0, 0), "the key is forgotten, not fenced");
    // Its deadline left with it: nothing expires, and the key is free for a new arrival.
    assert!(table.expire(c.at(200)).is_empty());
    waiting(table.register(key("a"), 1, "d", c.at(300), c.at(201)));
    assert_eq!(table.take_ready(&key("a"), c.at(202)), TakeReady::Busy);
    assert_eq!(table.len(), 1, "a registration stays where it is");
    table.cancel(&key("b"), None, c.at(203));
    assert_eq!(table.take_ready(&key("b"), c.at(204)), TakeReady::Fenced(FenceReason::Cancelled));
    assert_drains(&table, &c);
}

#[test]
fn purge_drops_a_lost_peers_waiting_registrations_only() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("lost-1"), 1, "lost", c.at(100), c.at(0)));
    waiting(table.register(key("lost-2"), 1, "lost", c.at(100), c.at(0)));
    waiting(table.register(key("kept"), 1, "alive", c.at(100), c.at(0)));
    let mut purged: Vec<_> = table.purge(|r| *r == "lost", c.at(1));
    purged.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    assert_eq!(purged, vec![(key("lost-1"), 1, "lost"), (key("lost-2"), 1, "lost")]);
    assert_eq!(table.len(), 1);
    // A purged key is fenced: P's KV arriving later is refused at once (P frees it).
    assert!(matches!(
        table.ready(key("lost-1"), vec![1], c.at(100), c.at(2)),
        Err(RendezvousError::Fenced { reason: FenceReason::Cancelled, .. })
    ));
    assert_drains(&table, &c);
}

#[test]
fn drain_ends_every_live_entry_writes_in_flight_included() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("reg"), 1, "d", c.at(100), c.at(0)));
    waiting(table.ready(key("ready"), vec![1], c.at(100), c.at(0)));
    waiting(table.register(key("flying"), 1, "d", c.at(100), c.at(0)));
    matched(table.ready(key("flying"), vec![2], c.at(100), c.at(0)));
    table.begin_write(&key("flying"), 1).unwrap();
    let drained = table.drain(c.at(1));
    assert_eq!(drained.len(), 3);
    assert_eq!(table.len(), 0);
    let flying = drained.iter().find(|e| e.key == key("flying")).unwrap();
    assert_eq!(flying.ready, Some(vec![2]));
    assert_drains(&table, &c);
}

#[test]
fn register_then_ready_matches_once() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(waiting(table.register(key("a"), 1, "d0", c.at(100), c.at(0))), None);
    let m = matched(table.ready(key("a"), vec![7, 8], c.at(100), c.at(1)));
    assert_eq!(m, Match { key: key("a"), epoch: 1, registration: "d0", ready: vec![7, 8] });
    assert_eq!(table.len(), 1);
    assert_eq!(
        table.ready(key("a"), vec![9], c.at(100), c.at(2)),
        Err(RendezvousError::DuplicateReady { key: key("a") })
    );
    assert_eq!(
        table.register(key("a"), 1, "d0", c.at(100), c.at(2)),
        Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 1, current: 1 })
    );
}

#[test]
fn holds_names_the_owners_live_registration_at_its_epoch_only() {
    let (table, c) = (table(), Clock::new());
    let k = key("a");
    assert!(!table.holds(&k, 1, 7), "nothing registered");
    table.ready(k.clone(), vec![5], c.at(100), c.at(0)).unwrap();
    assert!(!table.holds(&k, 1, 7), "only P's half");
    matched(table.register_owned(k.clone(), 1, 7, "d1", c.at(100), c.at(1)));
    assert!(table.holds(&k, 1, 7), "matched");
    assert!(!table.holds(&k, 1, 8), "another owner's");
    assert!(!table.holds(&k, 2, 7), "another epoch");
    table.begin_write(&k, 1).unwrap();
    assert!(table.holds(&k, 1, 7), "being written");
    waiting(table.register_owned(k.clone(), 2, 7, "d2", c.at(100), c.at(2)));
    assert!(table.holds(&k, 1, 7) && table.holds(&k, 2, 7), "written, and waiting for it");
    let rematch = table.finish(&k, 1, Outcome::Done, c.at(3)).unwrap().rematch.unwrap();
    assert_eq!(rematch.epoch, 2);
    assert!(!table.holds(&k, 1, 7) && table.holds(&k, 2, 7));
    table.begin_write(&k, 2).unwrap();
    table.finish(&k, 2, Outcome::Done, c.at(4)).unwrap();
    assert!(!table.holds(&k, 2, 7), "fenced: the transfer ended");
}

#[test]
fn ready_then_register_matches_once() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(waiting(table.ready(key("a"), vec![1], c.at(100), c.at(0))), None);
    let m = matched(table.register(key("a"), 4, "d0", c.at(100), c.at(1)));
    assert_eq!((m.epoch, m.registration, m.ready), (4, "d0", vec![1]));
}

#[test]
fn higher_epoch_supersedes_a_waiting_registration() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 2, "old", c.at(100), c.at(0)));
    assert_eq!(waiting(table.register(key("a"), 3, "new", c.at(100), c.at(1))), Some("old"));
    for stale in [1, 3] {
        assert_eq!(
            table.register(key("a"), stale, "x", c.at(100), c.at(2)),
            Err(RendezvousError::StaleEpoch { key: key("a"), epoch: stale, current: 3 })
        );
    }
    let m = matched(table.ready(key("a"), vec![5], c.at(100), c.at(3)));
    assert_eq!((m.epoch, m.registration), (3, "new"));
    assert_eq!(table.len(), 1);
}

#[test]
fn reregistering_a_match_not_begun_rematches_at_once() {
    let (table, c) = (table(), Clock::new());
    table.ready(key("a"), vec![5], c.at(100), c.at(0)).unwrap();
    let first = matched(table.register(key("a"), 1, "d1", c.at(100), c.at(1)));
    let second = matched(table.register(key("a"), 2, "d2", c.at(100), c.at(2)));
    assert_eq!((second.epoch, second.registration, &second.ready), (2, "d2", &first.ready));
    assert_eq!(
        table.register(key("a"), 2, "d3", c.at(100), c.at(3)),
        Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 2, current: 2 })
    );
    assert_eq!(
        table.begin_write(&key("a"), 1),
        Err(RendezvousError::NotMatched { key: key("a"), epoch: 1 })
    );
    table.begin_write(&key("a"), 2).unwrap();
    let done = table.finish(&key("a"), 2, Outcome::Done, c.at(4)).unwrap();
    assert_eq!(
        done,
        Finished { outcome: Outcome::Done, cancel_acknowledged: false, rematch: None }
    );
}

#[test]
fn reregistering_during_a_write_rematches_when_it_finishes() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
    matched(table.ready(key("a"), vec![5], c.at(100), c.at(0)));
    table.begin_write(&key("a"), 1).unwrap();

    assert_eq!(waiting(table.register(key("a"), 2, "d2", c.at(100), c.at(1))), None);
    assert_eq!(waiting(table.register(key("a"), 3, "d3", c.at(100), c.at(1))), Some("d2"));
    assert_eq!(
        table.register(key("a"), 3, "d4", c.at(100), c.at(1)),
        Err(RendezvousError::StaleEpoch { key: key("a"), epoch: 3, current: 3 })
    );
    // Nothing new may begin while the old write is in flight.
    assert!(table.begin_write(&key("a"), 3).is_err());

    let failed = Outcome::Failed("peer reset".into());
    let finished = table.finish(&key("a"), 1, failed.clone(), c.at(2)).unwrap();
    assert_eq!(finished.outcome, failed);
    assert!(!finished.cancel_acknowledged);
    let rematch = finished.rematch.expect("the waiting re-registration is matched");
    assert_eq!((rematch.epoch, rematch.registration, rematch.ready), (3, "d3", vec![5]));
    assert_eq!(table.fences(), 0, "a rematched key is still live");

    table.begin_write(&key("a"), 3).unwrap();
    assert_eq!(table.finish(&key("a"), 3, Outcome::Done, c.at(3)).unwrap().rematch, None);
    assert_eq!(
        table.register(key("a"), 4, "late", c.at(100), c.at(4)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Delivered })
    );
}

#[test]
fn duplicate_ready_is_refused_in_every_live_state() {
    let (table, c) = (table(), Clock::new());
    let dup = |name| {
        table.ready(key(name), vec![0], c.at(100), c.at(1))
            == Err(RendezvousError::DuplicateReady { key: key(name) })
    };
    table.ready(key("ready"), vec![1], c.at(100), c.at(0)).unwrap();
    table.ready(key("matched"), vec![1], c.at(100), c.at(0)).unwrap();
    table.register(key("matched"), 1, "d", c.at(100), c.at(0)).unwrap();
    table.ready(key("flight"), vec![1], c.at(100), c.at(0)).unwrap();
    table.register(key("flight"), 1, "d", c.at(100), c.at(0)).unwrap();
    table.begin_write(&key("flight"), 1).unwrap();
    assert!(dup("ready") && dup("matched") && dup("flight"));
    assert_eq!(table.len(), 3);
}

#[test]
fn expire_ends_waiting_and_matched_entries_at_the_earliest_deadline() {
    let (table, c) = (table(), Clock::new());
    table.register(key("reg"), 7, "d", c.at(50), c.at(0)).unwrap();
    table.ready(key("ready"), vec![1], c.at(60), c.at(0)).unwrap();
    // The matched entry is due at the earlier of its halves' deadlines (ready's, 40).
    table.ready(key("matched"), vec![2], c.at(40), c.at(0)).unwrap();
    table.register(key("matched"), 1, "d", c.at(500), c.at(0)).unwrap();
    assert!(table.expire(c.at(39)).is_empty());

    let mut expired = table.expire(c.at(60));
    expired.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(
        expired,
        vec![
            Expired {
                key: key("matched"),
                registration: None,
                ready: Some(vec![2]),
                was_matched: true
            },
            Expired {
                key: key("ready"),
                registration: None,
                ready: Some(vec![1]),
                was_matched: false
            },
            Expired {
                key: key("reg"),
                registration: Some((7, "d")),
                ready: None,
                was_matched: false
            },
        ]
    );
    assert_eq!((table.len(), table.fences()), (0, 3));
    assert_eq!(
        table.begin_write(&key("matched"), 1),
        Err(RendezvousError::Fenced { key: key("matched"), reason: FenceReason::Expired })
    );
    assert_eq!(
        table.ready(key("reg"), vec![3], c.at(900), c.at(61)),
        Err(RendezvousError::Fenced { key: key("reg"), reason: FenceReason::Expired })
    );
    assert!(table.expire(c.at(100)).is_empty(), "each entry expires once");
    assert_drains(&table, &c);
}

#[test]
fn in_flight_entries_never_expire() {
    let (table, c) = (table(), Clock::new());
    table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
    table.register(key("a"), 1, "d", c.at(10), c.at(0)).unwrap();
    table.begin_write(&key("a"), 1).unwrap();
    assert!(table.expire(c.at(1_000_000)).is_empty());
    assert_eq!(table.len(), 1);
    assert_eq!(table.tracked_deadlines(), 0, "an in-flight entry has no current deadline");
    table.finish(&key("a"), 1, Outcome::Done, c.at(1_000_000)).unwrap();
    assert_eq!((table.len(), table.fences()), (0, 1));
    table.expire(c.at(1_000_000 + TTL_MS));
    assert_eq!((table.fences(), table.tracked_deadlines()), (0, 0));
}

#[test]
fn a_superseding_registration_replaces_its_predecessors_deadline() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 1, "d1", c.at(10), c.at(0)).unwrap();
    table.register(key("a"), 2, "d2", c.at(100), c.at(5)).unwrap();
    assert!(table.expire(c.at(50)).is_empty());
    let expired = table.expire(c.at(100));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].registration, Some((2, "d2")));
}

#[test]
fn an_entry_due_later_than_its_heap_item_waits_for_its_own_due_time() {
    let (table, c) = (table(), Clock::new());
    // Written and fenced before P's deadline: the fence outlives the ready deadline's item.
    table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
    table.register(key("a"), 1, "d", c.at(10), c.at(0)).unwrap();
    table.begin_write(&key("a"), 1).unwrap();
    table.finish(&key("a"), 1, Outcome::Done, c.at(5)).unwrap();
    assert!(table.expire(c.at(10)).is_empty());
    assert_eq!(table.fences(), 1, "the fence lasts from the finish, not the deadline");
    assert!(table.register(key("a"), 2, "d", c.at(5_000), c.at(5 + TTL_MS - 1)).is_err());
    assert!(table.expire(c.at(5 + TTL_MS)).is_empty());
    assert_eq!((table.fences(), table.tracked_deadlines()), (0, 0));

    // A later registration deadline: the entry expires at it, and is fenced from it.
    table.register(key("b"), 1, "d1", c.at(10), c.at(0)).unwrap();
    table.register(key("b"), 2, "d2", c.at(50), c.at(1)).unwrap();
    let expired = table.expire(c.at(60));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].registration, Some((2, "d2")));
    assert!(table.ready(key("b"), vec![1], c.at(5_000), c.at(50 + TTL_MS - 1)).is_err());
    assert_eq!(waiting(table.ready(key("b"), vec![1], c.at(5_000), c.at(50 + TTL_MS))), None);
    assert_drains(&table, &c);
}

#[test]
fn rematch_keeps_the_ready_deadline() {
    let (table, c) = (table(), Clock::new());
    table.ready(key("a"), vec![1], c.at(10), c.at(0)).unwrap();
    table.register(key("a"), 1, "d1", c.at(10), c.at(0)).unwrap();
    table.begin_write(&key("a"), 1).unwrap();
    table.register(key("a"), 2, "d2", c.at(500), c.at(1)).unwrap();
    let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(20)).unwrap();
    assert!(finished.rematch.is_some());
    // P's lease on its blocks (deadline 10) has passed: the rematch expires if not begun.
    let expired = table.expire(c.at(20));
    assert_eq!(expired.len(), 1);
    assert!(expired[0].was_matched);
    assert!(table.begin_write(&key("a"), 2).is_err());
}

#[test]
fn fences_lapse_after_their_ttl() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(table.cancel(&key("a"), None, c.at(0)), Cancelled::NotFound);
    assert_eq!(table.fences(), 1);
    assert!(table.register(key("a"), 1, "d", c.at(5_000), c.at(TTL_MS - 1)).is_err());
    // Lapsed but not yet collected: the arrival replaces the fence.
    assert_eq!(waiting(table.register(key("a"), 1, "d", c.at(5_000), c.at(TTL_MS))), None);
    assert_eq!((table.len(), table.fences()), (1, 0));
    assert!(table.expire(c.at(TTL_MS)).is_empty(), "the old fence's item is stale");

    table.cancel(&key("b"), None, c.at(0));
    assert!(table.expire(c.at(TTL_MS)).is_empty(), "fences lapse silently");
    assert_eq!(table.fences(), 0);
    assert_eq!(waiting(table.ready(key("b"), vec![], c.at(5_000), c.at(TTL_MS))), None);
}

#[test]
fn zero_fence_ttl_keeps_no_fences() {
    let c = Clock::new();
    let table: Table =
        RendezvousTable::new(TableConfig { fence_ttl: Duration::ZERO, ..TableConfig::default() });
    table.cancel(&key("a"), None, c.at(0));
    assert_eq!(table.fences(), 0);
    assert!(table.register(key("a"), 1, "d", c.at(10), c.at(0)).is_ok());
}

#[test]
fn begin_write_needs_the_current_match() {
    let (table, c) = (table(), Clock::new());
    let not_matched = |epoch| Err(RendezvousError::NotMatched { key: key("a"), epoch });
    assert_eq!(table.begin_write(&key("a"), 1), not_matched(1));
    table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
    assert_eq!(table.begin_write(&key("a"), 1), not_matched(1), "only half has arrived");
    table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
    assert_eq!(table.begin_write(&key("a"), 2), not_matched(2));
    assert_eq!(table.begin_write(&key("a"), 1), Ok(()));
    assert_eq!(table.begin_write(&key("a"), 1), not_matched(1), "a write begins once");
}

#[test]
fn finish_needs_the_write_in_flight() {
    let (table, c) = (table(), Clock::new());
    let not_matched = |epoch| Err(RendezvousError::NotMatched { key: key("a"), epoch });
    assert_eq!(table.finish(&key("a"), 1, Outcome::Done, c.at(0)), not_matched(1));
    table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
    table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
    assert_eq!(table.finish(&key("a"), 1, Outcome::Done, c.at(0)), not_matched(1));
    table.begin_write(&key("a"), 1).unwrap();
    assert_eq!(table.finish(&key("a"), 2, Outcome::Done, c.at(0)), not_matched(2));
    let failed = Outcome::Failed("nixl: remote disconnected".into());
    assert!(table.finish(&key("a"), 1, failed, c.at(1)).is_ok());
    assert_eq!(
        table.finish(&key("a"), 1, Outcome::Done, c.at(2)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Failed })
    );
    assert_eq!((table.len(), table.fences()), (0, 1));
}

#[test]
fn cancel_removes_entries_not_yet_written() {
    let (table, c) = (table(), Clock::new());
    table.register(key("reg"), 1, "d", c.at(100), c.at(0)).unwrap();
    table.ready(key("ready"), vec![1], c.at(100), c.at(0)).unwrap();
    table.ready(key("matched"), vec![2], c.at(100), c.at(0)).unwrap();
    table.register(key("matched"), 1, "d", c.at(100), c.at(0)).unwrap();

    assert_eq!(
        table.cancel(&key("reg"), Some(1), c.at(1)),
        Cancelled::Removed { registration: Some("d"), ready: None }
    );
    assert_eq!(
        table.cancel(&key("ready"), Some(9), c.at(1)),
        Cancelled::Removed { registration: None, ready: Some(vec![1]) }
    );
    assert_eq!(
        table.cancel(&key("matched"), None, c.at(1)),
        Cancelled::Removed { registration: None, ready: Some(vec![2]) }
    );
    assert_eq!((table.len(), table.fences()), (0, 3));
    let fenced = |name| RendezvousError::Fenced { key: key(name), reason: FenceReason::Cancelled };
    assert_eq!(table.begin_write(&key("matched"), 1), Err(fenced("matched")));
    assert_eq!(table.ready(key("reg"), vec![1], c.at(100), c.at(2)).unwrap_err(), fenced("reg"));
    assert_eq!(
        table.register(key("ready"), 2, "d", c.at(100), c.at(2)).unwrap_err(),
        fenced("ready")
    );
    assert_eq!(table.cancel(&key("ready"), None, c.at(2)), Cancelled::NotFound);
    assert_drains(&table, &c);
}

#[test]
fn cancel_of_an_unknown_key_fails_a_late_half_fast() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(table.cancel(&key("a"), None, c.at(0)), Cancelled::NotFound);
    let fenced = Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled });
    assert_eq!(table.register(key("a"), 1, "d", c.at(100), c.at(1)), fenced.clone());
    assert_eq!(table.ready(key("a"), vec![1], c.at(100), c.at(1)), fenced);
    assert_eq!(table.len(), 0);
}

#[test]
fn a_stale_cancel_is_a_no_op() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 3, "d3", c.at(100), c.at(0)).unwrap();
    assert_eq!(table.cancel(&key("a"), Some(2), c.at(1)), Cancelled::NotFound);
    let m = matched(table.ready(key("a"), vec![1], c.at(100), c.at(2)));
    assert_eq!(m.epoch, 3);
    assert_eq!(table.cancel(&key("a"), Some(2), c.at(3)), Cancelled::NotFound);
    assert_eq!(table.begin_write(&key("a"), 3), Ok(()), "the stale cancel left the match alone");
}

#[test]
fn cancel_during_a_write_is_acknowledged_by_finish() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
    table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
    table.begin_write(&key("a"), 1).unwrap();
    table.register(key("a"), 2, "d2", c.at(100), c.at(1)).unwrap();

    assert_eq!(table.cancel(&key("a"), None, c.at(2)), Cancelled::Deferred);
    assert_eq!(table.len(), 1, "the entry stays until the write finishes");
    assert_eq!(table.cancel(&key("a"), None, c.at(2)), Cancelled::Deferred, "idempotent");
    assert_eq!(
        table.register(key("a"), 3, "d3", c.at(100), c.at(3)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled })
    );
    let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(4)).unwrap();
    assert!(finished.cancel_acknowledged);
    assert_eq!(finished.rematch, None, "the cancel covered the re-registration");
    assert_eq!((table.len(), table.fences()), (0, 1));
    assert_eq!(
        table.ready(key("a"), vec![1], c.at(100), c.at(5)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled })
    );
}

#[test]
fn cancelling_the_epoch_being_written_keeps_a_newer_registration() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
    table.ready(key("a"), vec![1], c.at(100), c.at(0)).unwrap();
    table.begin_write(&key("a"), 1).unwrap();
    table.register(key("a"), 2, "d2", c.at(100), c.at(1)).unwrap();
    // Epoch 1's blocks are being written: D must wait for the acknowledgement.
    assert_eq!(table.cancel(&key("a"), Some(1), c.at(2)), Cancelled::Deferred);
    assert_eq!(table.cancel(&key("a"), Some(0), c.at(2)), Cancelled::NotFound);
    let finished = table.finish(&key("a"), 1, Outcome::Done, c.at(3)).unwrap();
    assert!(finished.cancel_acknowledged);
    assert_eq!(finished.rematch.map(|m| (m.epoch, m.registration)), Some((2, "d2")));
}

#[test]
fn a_cancel_at_a_higher_epoch_cancels_the_transfer() {
    let (table, c) = (table(), Clock::new());
    table.register(key("a"), 1, "d1", c.at(100), c.at(0)).unwrap();
    assert_eq!(
        table.cancel(&key("a"), Some(2), c.at(1)),
        Cancelled::Removed { registration: Some("d1"), ready: None }
    );
}

#[test]
fn new_entries_beyond_max_entries_are_refused() {
    let (table, c) = (table_with(2, 2), Clock::new());
    table.register(key("a"), 1, "d", c.at(100), c.at(0)).unwrap();
    table.ready(key("b"), vec![1], c.at(100), c.at(0)).unwrap();
    assert_eq!(
        table.register(key("c"), 1, "d", c.at(100), c.at(0)),
        Err(RendezvousError::TableFull { key: key("c"), capacity: 2 })
    );
    // Completing an existing entry needs no new slot.
    matched(table.ready(key("a"), vec![1], c.at(100), c.at(0)));
    // Fences do not count against max_entries.
    table.cancel(&key("a"), None, c.at(1));
    assert_eq!((table.len(), table.fences()), (1, 1));
    assert!(table.ready(key("c"), vec![1], c.at(100), c.at(1)).is_ok());
}

#[test]
fn fences_beyond_max_entries_are_not_kept() {
    let (table, c) = (table_with(1, 1), Clock::new());
    table.cancel(&key("a"), None, c.at(0));
    table.cancel(&key("b"), None, c.at(0));
    assert_eq!(table.fences(), 1);
    assert!(table.register(key("a"), 1, "d", c.at(100), c.at(1)).is_err());
    // Unfenced: a late half waits for its deadline instead of failing fast.
    assert!(table.register(key("b"), 1, "d", c.at(100), c.at(1)).is_ok());
    assert_drains(&table, &c);
}

#[test]
fn deadline_heap_stays_bounded_under_churn() {
    let (table, c) = (table_with(1, 16), Clock::new());
    // Each superseding registration moves the deadline, leaving a stale heap item behind.
    for epoch in 1..10_000 {
        table.register(key("a"), epoch, "d", c.at(1_000_000 - epoch), c.at(0)).unwrap();
    }
    assert!(table.tracked_deadlines() <= 2 + HEAP_SLACK + 1, "{table:?}");
    assert_drains(&table, &c);
}

#[test]
fn expire_takes_many_due_entries_in_one_call() {
    let (table, c) = (table_with(1, 1_000), Clock::new());
    for i in 0..(3 * EXPIRE_BATCH + 5) {
        table.ready(key(&format!("k{i}")), vec![], c.at(10), c.at(0)).unwrap();
    }
    assert_eq!(table.expire(c.at(10)).len(), 3 * EXPIRE_BATCH + 5);
    assert_eq!(table.len(), 0);
    assert_drains(&table, &c);
}

#[test]
fn shards_round_up_to_a_power_of_two() {
    let table: Table = RendezvousTable::new(TableConfig { shards: 3, ..TableConfig::default() });
    assert_eq!(table.shards.len(), 4);
    let table: Table = RendezvousTable::new(TableConfig { shards: 0, ..TableConfig::default() });
    assert_eq!(table.shards.len(), 1);
}

#[test]
fn errors_say_what_happened_and_what_to_do() {
    let stale = RendezvousError::StaleEpoch { key: key("x"), epoch: 3, current: 5 };
    assert_eq!(
        stale.to_string(),
        "registration for transfer x epoch 3 refused: epoch 5 is current; re-register with a \
         higher epoch"
    );
    let fenced = RendezvousError::Fenced { key: key("x"), reason: FenceReason::Cancelled };
    assert!(fenced.to_string().contains("transfer x refused: it was cancelled"), "{fenced}");
    let full = RendezvousError::TableFull { key: key("x"), capacity: 7 };
    assert!(full.to_string().contains("full (7 transfers"), "{full}");
    assert!(full.to_string().contains("raise max_entries"), "{full}");
    let nm = RendezvousError::NotMatched { key: key("x"), epoch: 2 };
    assert!(nm.to_string().contains("transfer x epoch 2"), "{nm}");
    assert!(nm.to_string().contains("drop this match"), "{nm}");
}

/// The registration a stream took.
fn started<R: fmt::Debug>(start: StreamStart<R>) -> (Epoch, R) {
    match start {
        StreamStart::Started { epoch, registration } => (epoch, registration),
        other => panic!("expected a stream, got {other:?}"),
    }
}

#[test]
fn a_stream_holds_the_registration_until_it_ends_then_it_waits_again() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "d", c.at(100), c.at(0)));
    assert_eq!(started(table.begin_stream(&key("a"), c.at(1))), (1, "d"));
    assert_eq!(table.begin_stream(&key("a"), c.at(2)), StreamStart::NotWaiting, "one at a time");
    assert!(table.holds(&key("a"), 1, ANY_OWNER), "a repeated registration is a duplicate");
    assert!(table.expire(c.at(50_000)).is_empty(), "a stream never expires");
    assert_eq!(table.tracked_deadlines(), 0);

    let ended = table.end_stream(&key("a"), 1, "d", c.at(3)).unwrap();
    assert_eq!(
        ended,
        StreamEnded {
            cancel_acknowledged: false,
            aborted: false,
            next: AfterStream::Waiting { superseded: None }
        }
    );
    // Streamed again as more layers become final, then matched to P's whole KV.
    assert_eq!(started(table.begin_stream(&key("a"), c.at(4))), (1, "d"));
    table.end_stream(&key("a"), 1, "d", c.at(5)).unwrap();
    let m = matched(table.ready(key("a"), vec![7], c.at(100), c.at(6)));
    assert_eq!((m.epoch, m.registration, m.ready), (1, "d", vec![7]));
    table.begin_write(&key("a"), 1).unwrap();
    assert_eq!(table.begin_stream(&key("a"), c.at(7)), StreamStart::NotWaiting);
    table.finish(&key("a"), 1, Outcome::Done, c.at(8)).unwrap();
    assert_eq!(table.begin_stream(&key("a"), c.at(9)), StreamStart::Fenced(FenceReason::Delivered));
    assert_drains(&table, &c);
}

#[test]
fn only_a_waiting_registration_within_its_deadline_streams() {
    let (table, c) = (table(), Clock::new());
    assert_eq!(table.begin_stream(&key("absent"), c.at(0)), StreamStart::NotWaiting);
    waiting(table.ready(key("ready"), vec![1], c.at(100), c.at(0)));
    assert_eq!(table.begin_stream(&key("ready"), c.at(0)), StreamStart::NotWaiting);
    waiting(table.register(key("matched"), 1, "d", c.at(100), c.at(0)));
    matched(table.ready(key("matched"), vec![1], c.at(100), c.at(0)));
    assert_eq!(table.begin_stream(&key("matched"), c.at(0)), StreamStart::NotWaiting);
    waiting(table.register(key("late"), 1, "d", c.at(10), c.at(0)));
    assert_eq!(table.begin_stream(&key("late"), c.at(10)), StreamStart::NotWaiting);
    assert_eq!(table.expire(c.at(10)).len(), 1, "left for expire, which fails it");
    table.cancel(&key("cancelled"), None, c.at(0));
    assert_eq!(
        table.begin_stream(&key("cancelled"), c.at(1)),
        StreamStart::Fenced(FenceReason::Cancelled)
    );
    assert_drains(&table, &c);
}

#[test]
fn p_ready_during_a_stream_is_matched_when_the_stream_ends() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "d", c.at(100), c.at(0)));
    started(table.begin_stream(&key("a"), c.at(0)));
    assert_eq!(waiting(table.ready(key("a"), vec![3], c.at(100), c.at(1))), None);
    assert_eq!(
        table.ready(key("a"), vec![3], c.at(100), c.at(2)),
        Err(RendezvousError::DuplicateReady { key: key("a") })
    );
    assert!(
        matches!(table.begin_write(&key("a"), 1), Err(RendezvousError::NotMatched { .. })),
        "the whole KV waits for the stream's WRITEs"
    );
    let ended = table.end_stream(&key("a"), 1, "d", c.at(3)).unwrap();
    let AfterStream::Matched { matched: m, superseded: None } = ended.next else {
        panic!("expected a match, got {:?}", ended.next);
    };
    assert_eq!((m.epoch, m.registration, m.ready), (1, "d", vec![3]));
    table.begin_write(&key("a"), 1).unwrap();
    table.finish(&key("a"), 1, Outcome::Done, c.at(4)).unwrap();
    assert_drains(&table, &c);
}

#[test]
fn a_cancel_during_a_stream_is_acknowledged_when_it_ends() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "d", c.at(100), c.at(0)));
    started(table.begin_stream(&key("a"), c.at(0)));
    waiting(table.ready(key("a"), vec![4], c.at(100), c.at(1)));
    assert_eq!(table.cancel(&key("a"), Some(1), c.at(2)), Cancelled::Deferred);
    waiting(table.register(key("b"), 1, "d", c.at(100), c.at(0)));
    started(table.begin_stream(&key("b"), c.at(0)));
    assert_eq!(table.cancel(&key("b"), Some(1), c.at(2)), Cancelled::Deferred);
    // Held, not refused: the stream's WRITEs still read P's blocks, which P's engine would free
    // once its KV is refused.
    waiting(table.ready(key("b"), vec![5], c.at(100), c.at(3)));
    assert_eq!(
        table.end_stream(&key("b"), 1, "d", c.at(4)).unwrap(),
        StreamEnded {
            cancel_acknowledged: true,
            aborted: false,
            next: AfterStream::Cancelled { registration: "d", ready: Some(vec![5]) },
        },
        "P's KV ends with the cancel once the stream's WRITEs are done"
    );
    assert_eq!(table.len(), 1, "held until the stream's WRITEs are done");
    assert_eq!(
        table.register(key("a"), 2, "d2", c.at(100), c.at(3)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Cancelled })
    );
    let ended = table.end_stream(&key("a"), 1, "d", c.at(4)).unwrap();
    assert_eq!(
        ended,
        StreamEnded {
            cancel_acknowledged: true,
            aborted: false,
            next: AfterStream::Cancelled { registration: "d", ready: Some(vec![4]) },
        }
    );
    assert_eq!((table.len(), table.fences()), (0, 2), "both keys fenced");
    assert_eq!(table.begin_stream(&key("a"), c.at(5)), StreamStart::Fenced(FenceReason::Cancelled));
    // P's own abort (no epoch) during a stream: deferred too, and ends P's send when the
    // stream ends; D did not ask, so no acknowledgement is owed (the writer sends a FAIL).
    waiting(table.register(key("c"), 1, "d", c.at(100), c.at(5)));
    started(table.begin_stream(&key("c"), c.at(5)));
    assert_eq!(table.cancel(&key("c"), None, c.at(6)), Cancelled::Deferred);
    assert_eq!(
        table.end_stream(&key("c"), 1, "d", c.at(7)).unwrap(),
        StreamEnded {
            cancel_acknowledged: false,
            aborted: true,
            next: AfterStream::Cancelled { registration: "d", ready: None },
        }
    );
    // Both: D's cancel is acknowledged, and P's send still ends.
    waiting(table.register(key("e"), 1, "d", c.at(100), c.at(7)));
    started(table.begin_stream(&key("e"), c.at(7)));
    assert_eq!(table.cancel(&key("e"), Some(1), c.at(8)), Cancelled::Deferred);
    assert_eq!(table.cancel(&key("e"), None, c.at(8)), Cancelled::Deferred);
    assert_eq!(
        table.end_stream(&key("e"), 1, "d", c.at(9)).unwrap(),
        StreamEnded {
            cancel_acknowledged: true,
            aborted: true,
            next: AfterStream::Cancelled { registration: "d", ready: None },
        }
    );
    assert_drains(&table, &c);
}

#[test]
fn a_stream_stands_until_d_cancels_p_aborts_or_d_registers_again() {
    let (table, c) = (table(), Clock::new());
    for (name, stop) in [("d-cancel", 0), ("p-abort", 1), ("re-register", 2)] {
        waiting(table.register(key(name), 1, "d", c.at(100), c.at(0)));
        assert!(!table.stream_stands(&key(name), 1), "{name}: no stream yet");
        started(table.begin_stream(&key(name), c.at(0)));
        assert!(table.stream_stands(&key(name), 1), "{name}");
        assert!(!table.stream_stands(&key(name), 2), "{name}: another epoch's stream");
        // P's KV coming meanwhile leaves the stream standing.
        waiting(table.ready(key(name), vec![1], c.at(100), c.at(1)));
        assert!(table.stream_stands(&key(name), 1), "{name}: with P's KV held");
        match stop {
            0 => assert_eq!(table.cancel(&key(name), Some(1), c.at(2)), Cancelled::Deferred),
            1 => assert_eq!(table.cancel(&key(name), None, c.at(2)), Cancelled::Deferred),
            _ => assert_eq!(waiting(table.register(key(name), 2, "d2", c.at(100), c.at(2))), None),
        }
        assert!(!table.stream_stands(&key(name), 1), "{name}: writes nothing more");
        table.end_stream(&key(name), 1, "d", c.at(3)).unwrap();
        assert!(!table.stream_stands(&key(name), 1), "{name}: ended");
    }
}

#[test]
fn a_reregistration_during_a_stream_replaces_the_streamed_one_when_it_ends() {
    let (table, c) = (table(), Clock::new());
    // Without P's KV: the newer registration waits, and is what streams next.
    waiting(table.register(key("a"), 1, "d1", c.at(100), c.at(0)));
    started(table.begin_stream(&key("a"), c.at(0)));
    assert_eq!(waiting(table.register(key("a"), 2, "d2", c.at(100), c.at(1))), None);
    assert!(matches!(
        table.register(key("a"), 2, "d2", c.at(100), c.at(1)),
        Err(RendezvousError::StaleEpoch { current: 2, .. })
    ));
    assert!(table.holds(&key("a"), 2, ANY_OWNER));
    let ended = table.end_stream(&key("a"), 1, "d1", c.at(2)).unwrap();
    assert_eq!(ended.next, AfterStream::Waiting { superseded: Some("d1") });
    assert_eq!(started(table.begin_stream(&key("a"), c.at(3))), (2, "d2"));

    // With P's KV: matched to the newer registration, whose blocks hold none of the layers.
    assert_eq!(waiting(table.register(key("a"), 3, "d3", c.at(100), c.at(4))), None);
    waiting(table.ready(key("a"), vec![5], c.at(100), c.at(5)));
    assert!(
        matches!(
            table.end_stream(&key("a"), 3, "d2", c.at(6)),
            Err(RendezvousError::NotMatched { epoch: 3, .. })
        ),
        "the stream is at epoch 2"
    );
    let ended = table.end_stream(&key("a"), 2, "d2", c.at(6)).unwrap();
    let AfterStream::Matched { matched: m, superseded } = ended.next else {
        panic!("expected a match, got {:?}", ended.next);
    };
    assert_eq!((m.epoch, m.registration, m.ready, superseded), (3, "d3", vec![5], Some("d2")));
    assert_eq!(
        table.end_stream(&key("gone"), 1, "d", c.at(7)),
        Err(RendezvousError::NotMatched { key: key("gone"), epoch: 1 })
    );
    assert_drains(&table, &c);
}

#[test]
fn deadlines_that_ran_out_during_a_stream_end_the_key_after_it() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "d", c.at(10), c.at(0)));
    started(table.begin_stream(&key("a"), c.at(1)));
    assert!(table.expire(c.at(500)).is_empty());
    table.end_stream(&key("a"), 1, "d", c.at(600)).unwrap();
    let expired = table.expire(c.at(600));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].registration, Some((1, "d")), "D is failed, P never wrote it all");
    assert_eq!(
        table.ready(key("a"), vec![1], c.at(2_000), c.at(600 + TTL_MS - 1)),
        Err(RendezvousError::Fenced { key: key("a"), reason: FenceReason::Expired })
    );
    assert_drains(&table, &c);
}

#[test]
fn purge_and_drain_reach_streaming_entries() {
    let (table, c) = (table(), Clock::new());
    waiting(table.register(key("a"), 1, "alive", c.at(100), c.at(0)));
    started(table.begin_stream(&key("a"), c.at(0)));
    waiting(table.register(key("a"), 2, "lost", c.at(100), c.at(1)));
    assert_eq!(table.purge(|r| *r == "lost", c.at(2)), vec![(key("a"), 2, "lost")]);
    let ended = table.end_stream(&key("a"), 1, "alive", c.at(3)).unwrap();
    assert_eq!(ended.next, AfterStream::Waiting { superseded: None }, "the lost one is gone");

    started(table.begin_stream(&key("a"), c.at(4)));
    waiting(table.ready(key("a"), vec![9], c.at(100), c.at(5)));
    let drained = table.drain(c.at(6));
    assert_eq!(drained.len(), 1);
    assert_eq!(
        (drained[0].registration, drained[0].ready.clone(), drained[0].was_matched),
        (None, Some(vec![9]), true),
        "the stream's holder has the registration"
    );
    assert_drains(&table, &c);
}

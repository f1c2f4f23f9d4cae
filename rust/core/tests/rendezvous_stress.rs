//! Stress tests of the rendezvous table: real threads racing the two halves of thousands of
//! transfers, and a hundred thousand randomized transfer lifecycles checked against a reference
//! model of the rules. Sized down under miri.
#![cfg(not(loom))]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use kvpush_core::rendezvous::{
    AfterStream, Arrival, Cancelled, Epoch, FenceReason, Finished, Match, Outcome, RendezvousError,
    RendezvousTable, StreamEnded, StreamStart, TableConfig,
};
use kvpush_core::TransferKey;

/// xorshift64*: a tiny deterministic generator, so a failure replays from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform enough in `0..n` for a test.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

#[derive(Clone, Copy)]
enum Half {
    Register(usize),
    Ready(usize),
}

#[test]
fn racing_halves_match_exactly_once_per_key() {
    const THREADS: usize = 4;
    let keys: usize = if cfg!(miri) { 64 } else { 4_000 };
    let table = Arc::new(RendezvousTable::<usize, usize>::new(TableConfig {
        shards: 8,
        max_entries: keys,
        fence_ttl: Duration::from_secs(60),
    }));
    let names: Arc<Vec<TransferKey>> =
        Arc::new((0..keys).map(|k| TransferKey::from_canonical(&format!("req-{k}"))).collect());

    // Each key's two halves go to two different threads, and each thread runs its share in a
    // random order, so every key sees both arrival orders across the run.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut plans = vec![Vec::new(); THREADS];
    for k in 0..keys {
        let d = rng.below(THREADS as u64) as usize;
        let p = (d + 1 + rng.below(THREADS as u64 - 1) as usize) % THREADS;
        plans[d].push(Half::Register(k));
        plans[p].push(Half::Ready(k));
    }
    for plan in &mut plans {
        rng.shuffle(plan);
    }

    let now = Instant::now();
    let deadline = now + Duration::from_secs(3_600);
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = plans
        .into_iter()
        .map(|plan| {
            let (table, names, start) = (table.clone(), names.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let mut matches = Vec::new();
                for half in plan {
                    let arrival = match half {
                        Half::Register(k) => table.register(names[k].clone(), 1, k, deadline, now),
                        Half::Ready(k) => table.ready(names[k].clone(), 10 * k, deadline, now),
                    };
                    match arrival {
                        Ok(Arrival::Matched(m)) => matches.push(m),
                        Ok(Arrival::Waiting { superseded: None }) => {}
                        other => panic!("unexpected {other:?}"),
                    }
                }
                matches
            })
        })
        .collect();

    let mut matched = HashSet::new();
    for worker in workers {
        for m in worker.join().expect("worker panicked") {
            assert_eq!((m.epoch, m.ready), (1, 10 * m.registration), "halves of different keys");
            assert_eq!(m.key, names[m.registration]);
            assert!(matched.insert(m.registration), "{:?} matched twice", m.key);
        }
    }
    assert_eq!(matched.len(), keys, "every key matched");
    assert_eq!(table.len(), keys);

    for (k, name) in names.iter().enumerate() {
        table.begin_write(name, 1).unwrap();
        let finished = table.finish(name, 1, Outcome::Done, now).unwrap();
        assert_eq!(finished.rematch, None, "key {k}");
    }
    assert_eq!((table.len(), table.fences()), (0, keys));
    table.expire(now + Duration::from_secs(7_200));
    assert_eq!((table.len(), table.fences(), table.tracked_deadlines()), (0, 0, 0));
}

/// How a transfer ended, as the caller of the table learns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Delivered,
    Failed,
    Cancelled,
    Expired,
}

impl End {
    fn fence(self) -> FenceReason {
        match self {
            Self::Delivered => FenceReason::Delivered,
            Self::Failed => FenceReason::Failed,
            Self::Cancelled => FenceReason::Cancelled,
            Self::Expired => FenceReason::Expired,
        }
    }
}

/// The reference model of one transfer: what the table should hold for it.
#[derive(Debug)]
struct Life {
    key: TransferKey,
    /// Highest registration epoch accepted; 0 before D registered (the driver starts at 1).
    epoch: Epoch,
    /// D's registration is waiting (for P, or for the write or stream to finish).
    registration: Option<(Epoch, u64)>,
    /// When the waiting registration is due: its deadline, or later if it ran out during a
    /// stream.
    registration_due: u64,
    /// The registration a stream took (layer-wise push), until the stream ends.
    streaming: Option<(Epoch, u64)>,
    /// P's ready payload, once accepted (the payload is its deadline at arrival).
    ready: Option<u64>,
    /// When P's half is due: its deadline, or later if it ran out during a write.
    ready_due: u64,
    /// The match handed out and not yet begun.
    matched: Option<Epoch>,
    /// Deadline of the registration that the current match (or write) was made with.
    matched_deadline: u64,
    writing: Option<Epoch>,
    /// A cancel arrived during the write.
    ack_owed: bool,
    /// That cancel covered the whole transfer.
    cancelled: bool,
    /// P's abort (a cancel without an epoch) arrived during a stream.
    aborted: bool,
}

impl Life {
    fn new(id: usize) -> Self {
        Self {
            key: TransferKey::from_canonical(&format!("life-{id}")),
            epoch: 0,
            registration: None,
            registration_due: 0,
            streaming: None,
            ready: None,
            ready_due: 0,
            matched: None,
            matched_deadline: 0,
            writing: None,
            ack_owed: false,
            cancelled: false,
            aborted: false,
        }
    }

    /// When the table should expire this transfer (never while writing or streaming, or before
    /// any arrival).
    fn due(&self) -> Option<u64> {
        if self.writing.is_some() || self.streaming.is_some() {
            return None;
        }
        match (self.matched, self.registration, self.ready) {
            (Some(_), _, Some(_)) => Some(self.ready_due.min(self.matched_deadline)),
            (None, Some(_), None) => Some(self.registration_due),
            (None, None, Some(_)) => Some(self.ready_due),
            _ => None,
        }
    }
}

/// Drives lifecycles through the real table and the model side by side, on a simulated clock.
struct Sim {
    table: RendezvousTable<u64, u64>,
    rng: Rng,
    origin: Instant,
    /// Simulated milliseconds since `origin`.
    clock: u64,
    live: Vec<(usize, Life)>,
    slots: HashMap<TransferKey, usize>,
    ends: Vec<Option<End>>,
    /// Every (key, epoch) matched so far, to catch a second match.
    matches: HashSet<(TransferKey, Epoch)>,
    /// How often each rare path was taken, to show the run exercised it.
    paths: HashMap<&'static str, usize>,
}

const SHARDS: usize = 4;
const FENCE_TTL_MS: u64 = 500;

impl Sim {
    fn new(lifecycles: usize, seed: u64) -> Self {
        Self {
            table: RendezvousTable::new(TableConfig {
                shards: SHARDS,
                max_entries: 1 << 20,
                fence_ttl: Duration::from_millis(FENCE_TTL_MS),
            }),
            rng: Rng(seed),
            origin: Instant::now(),
            clock: 0,
            live: Vec::new(),
            slots: HashMap::new(),
            ends: vec![None; lifecycles],
            matches: HashSet::new(),
            paths: HashMap::new(),
        }
    }

    fn took(&mut self, path: &'static str) {
        *self.paths.entry(path).or_default() += 1;
    }

    fn at(&self, ms: u64) -> Instant {
        self.origin + Duration::from_millis(ms)
    }

    fn now(&self) -> Instant {
        self.at(self.clock)
    }

    fn deadline(&mut self) -> u64 {
        self.clock + 1 + self.rng.below(400)
    }

    fn start(&mut self, id: usize) {
        let life = Life::new(id);
        self.slots.insert(life.key.clone(), self.live.len());
        self.live.push((id, life));
    }

    /// Records `id`'s one terminal result and retires it from the window.
    fn end(&mut self, slot: usize, end: End) {
        let (id, life) = self.live.swap_remove(slot);
        self.slots.remove(&life.key);
        if let Some((_, moved)) = self.live.get(slot) {
            self.slots.insert(moved.key.clone(), slot);
        }
        assert_eq!(self.ends[id], None, "{:?} ended twice", life.key);
        self.ends[id] = Some(end);
        // Now and then a half arrives late: the fence must refuse it at once.
        if self.rng.chance(30) {
            let now = self.now();
            let deadline = self.at(self.clock + 100);
            let late = if self.rng.chance(50) {
                self.table.register(life.key.clone(), life.epoch + 1, 0, deadline, now)
            } else {
                self.table.ready(life.key.clone(), 0, deadline, now)
            };
            let reason = end.fence();
            assert_eq!(late, Err(RendezvousError::Fenced { key: life.key, reason }));
        }
    }

    fn matched(&mut self, slot: usize, m: &Match<u64, u64>) {
        let life = &mut self.live[slot].1;
        assert_eq!(m.key, life.key);
        assert!(self.matches.insert((m.key.clone(), m.epoch)), "{:?} matched twice", m);
        let (epoch, deadline) = life.registration.take().expect("matched without a registration");
        assert_eq!((m.epoch, m.registration), (epoch, deadline), "match carries the registration");
        assert_eq!(Some(m.ready), life.ready, "match carries P's payload");
        life.matched = Some(epoch);
        life.matched_deadline = life.registration_due;
    }

    /// One random step on the transfer in `slot`.
    fn step(&mut self, slot: usize) {
        let now = self.now();
        let life = &self.live[slot].1;
        let key = life.key.clone();
        let mut choices = vec!["register", "register", "register", "ready", "ready", "cancel"];
        if life.matched.is_some() {
            choices.extend(["begin", "begin", "begin"]);
        }
        if life.writing.is_some() {
            choices.extend(["finish", "finish", "finish"]);
        }
        if life.streaming.is_some() {
            choices.extend(["end stream", "end stream", "end stream"]);
        } else {
            choices.push("stream");
        }
        match choices[self.rng.below(choices.len() as u64) as usize] {
            "register" => {
                // Mostly the next epoch; sometimes a stale one.
                let stale = life.epoch > 0 && self.rng.chance(15);
                let epoch = if stale { life.epoch } else { life.epoch + 1 };
                let deadline = self.deadline();
                // The registration's payload is its deadline, so the model can check matches.
                let answer =
                    self.table.register(key.clone(), epoch, deadline, self.at(deadline), now);
                self.on_register(slot, epoch, deadline, answer);
            }
            "ready" => {
                let deadline = self.deadline();
                let answer = self.table.ready(key, deadline, self.at(deadline), now);
                self.on_ready(slot, deadline, answer);
            }
            "begin" => {
                let life = &self.live[slot].1;
                let current = life.matched.expect("begin offered only when matched");
                // Sometimes a holder of an older, superseded match tries its luck.
                let epoch = if current > 1 && self.rng.chance(20) { current - 1 } else { current };
                let answer = self.table.begin_write(&key, epoch);
                if epoch == current {
                    assert_eq!(answer, Ok(()));
                    let life = &mut self.live[slot].1;
                    life.matched = None;
                    life.writing = Some(epoch);
                } else {
                    assert_eq!(answer, Err(RendezvousError::NotMatched { key, epoch }));
                }
            }
            "finish" => {
                let epoch = self.live[slot].1.writing.expect("finish offered only when writing");
                let outcome =
                    if self.rng.chance(80) { Outcome::Done } else { Outcome::Failed("x".into()) };
                let answer = self.table.finish(&key, epoch, outcome.clone(), now);
                self.on_finish(slot, outcome, answer);
            }
            "stream" => {
                let answer = self.table.begin_stream(&key, now);
                self.on_stream(slot, answer);
            }
            "end stream" => {
                let (epoch, payload) = life.streaming.expect("offered only when streaming");
                let answer = self.table.end_stream(&key, epoch, payload, now);
                self.on_end_stream(slot, answer);
            }
            "cancel" => {
                let epoch = match self.rng.below(4) {
                    0 | 1 => None,
                    2 => Some(life.epoch),
                    _ => Some(life.epoch.saturating_sub(1)),
                };
                let answer = self.table.cancel(&key, epoch, now);
                self.on_cancel(slot, epoch, answer);
            }
            _ => unreachable!(),
        }
    }

    fn on_register(
        &mut self,
        slot: usize,
        epoch: Epoch,
        deadline: u64,
        answer: Result<Arrival<u64, u64>, RendezvousError>,
    ) {
        let life = &mut self.live[slot].1;
        let key = life.key.clone();
        if life.cancelled {
            assert_eq!(
                answer,
                Err(RendezvousError::Fenced { key, reason: FenceReason::Cancelled })
            );
            return;
        }
        if epoch <= life.epoch {
            let current = life.epoch;
            assert_eq!(answer, Err(RendezvousError::StaleEpoch { key, epoch, current }));
            return;
        }
        life.epoch = epoch;
        life.registration_due = deadline;
        let superseded = life.registration.replace((epoch, deadline)).map(|(_, payload)| payload);
        if life.writing.is_some() || life.streaming.is_some() || life.ready.is_none() {
            assert_eq!(answer, Ok(Arrival::Waiting { superseded }));
            return;
        }
        if life.matched.is_some() {
            self.took("rematch before the write");
        }
        assert_eq!(superseded, None, "a registration never waits beside P's payload");
        match answer {
            Ok(Arrival::Matched(m)) => self.matched(slot, &m),
            other => panic!("{key:?}: expected a match at epoch {epoch}, got {other:?}"),
        }
    }

    fn on_ready(
        &mut self,
        slot: usize,
        deadline: u64,
        answer: Result<Arrival<u64, u64>, RendezvousError>,
    ) {
        let life = &mut self.live[slot].1;
        let key = life.key.clone();
        if life.ready.is_some() {
            assert_eq!(answer, Err(RendezvousError::DuplicateReady { key }));
            return;
        }
        life.ready = Some(deadline);
        life.ready_due = deadline;
        if life.streaming.is_some() {
            // Held until the stream's WRITEs are done, which still read P's blocks: also after
            // a cancel the stream deferred (P's KV then ends with it).
            assert_eq!(answer, Ok(Arrival::Waiting { superseded: None }));
            let cancelled = life.cancelled;
            self.took(if cancelled {
                "ready held after a cancel during a stream"
            } else {
                "ready during a stream"
            });
            return;
        }
        if life.registration.is_none() {
            assert_eq!(answer, Ok(Arrival::Waiting { superseded: None }));
            return;
        }
        match answer {
            Ok(Arrival::Matched(m)) => self.matched(slot, &m),
            other => panic!("{key:?}: expected a match, got {other:?}"),
        }
    }

    fn on_finish(
        &mut self,
        slot: usize,
        outcome: Outcome,
        answer: Result<Finished<u64, u64>, RendezvousError>,
    ) {
        let finished = answer.expect("finish of the write in flight");
        let life = &mut self.live[slot].1;
        assert_eq!(finished.outcome, outcome);
        assert_eq!(finished.cancel_acknowledged, life.ack_owed);
        life.writing = None;
        life.ack_owed = false;
        match finished.rematch {
            Some(m) => {
                assert!(!life.cancelled, "a cancelled transfer was rematched");
                self.matched(slot, &m);
                self.took("rematch after the write");
                // Deadlines that ran out during the write count from now.
                let (life, clock) = (&mut self.live[slot].1, self.clock);
                life.ready_due = life.ready_due.max(clock);
                life.matched_deadline = life.matched_deadline.max(clock);
            }
            None => {
                assert!(life.registration.is_none() || life.cancelled, "re-registration lost");
                let end = match outcome {
                    _ if life.cancelled => End::Cancelled,
                    Outcome::Done => End::Delivered,
                    Outcome::Failed(_) => End::Failed,
                };
                self.end(slot, end);
            }
        }
    }

    /// A stream starts only from a registration waiting, alone, within its deadline.
    fn on_stream(&mut self, slot: usize, answer: StreamStart<u64>) {
        let clock = self.clock;
        let life = &mut self.live[slot].1;
        let alone = life.ready.is_none() && life.matched.is_none() && life.writing.is_none();
        match life.registration {
            Some((epoch, payload)) if alone && life.registration_due > clock => {
                assert_eq!(answer, StreamStart::Started { epoch, registration: payload });
                life.streaming = life.registration.take();
                self.took("stream");
            }
            _ => assert_eq!(answer, StreamStart::NotWaiting),
        }
    }

    fn on_end_stream(
        &mut self,
        slot: usize,
        answer: Result<StreamEnded<u64, u64>, RendezvousError>,
    ) {
        let ended = answer.expect("end of the stream in flight");
        let clock = self.clock;
        let life = &mut self.live[slot].1;
        assert_eq!(ended.cancel_acknowledged, life.ack_owed);
        assert_eq!(ended.aborted, life.aborted);
        life.ack_owed = false;
        let (_, streamed) = life.streaming.take().expect("streaming");
        if life.cancelled {
            let expected = AfterStream::Cancelled { registration: streamed, ready: life.ready };
            assert_eq!(ended.next, expected);
            self.took("cancel during a stream");
            self.end(slot, End::Cancelled);
            return;
        }
        // A newer registration that arrived during the stream takes the streamed one's place.
        let superseded = match life.registration {
            Some(_) => Some(streamed),
            None => {
                life.registration = Some((life.epoch, streamed));
                None
            }
        };
        life.registration_due = life.registration_due.max(clock);
        if superseded.is_some() {
            self.took("re-registered during a stream");
        }
        let life = &mut self.live[slot].1;
        match ended.next {
            AfterStream::Matched { matched, superseded: got } if life.ready.is_some() => {
                assert_eq!(got, superseded);
                life.ready_due = life.ready_due.max(clock);
                self.matched(slot, &matched);
            }
            AfterStream::Waiting { superseded: got } if life.ready.is_none() => {
                assert_eq!(got, superseded);
            }
            other => panic!("{:?}: unexpected end of a stream: {other:?}", life.key),
        }
    }

    fn on_cancel(&mut self, slot: usize, epoch: Option<Epoch>, answer: Cancelled<u64, u64>) {
        let life = &mut self.live[slot].1;
        // The epoch D's current registration has (0 when D has not registered).
        let covers = epoch.is_none_or(|epoch| epoch >= life.epoch);
        // A stream holds its registration as a write does: a cancel waits for its end.
        if let Some(writing) = life.writing.or(life.streaming.map(|(epoch, _)| epoch)) {
            if life.cancelled || covers || epoch == Some(writing) {
                assert_eq!(answer, Cancelled::Deferred);
                // P's own abort (no epoch) during a stream owes D no acknowledgement: D did not
                // ask (the writer sends it a FAIL instead); it ends P's send with the stream.
                life.ack_owed |= epoch.is_some() || life.writing.is_some();
                life.aborted |= epoch.is_none() && life.streaming.is_some();
                if covers {
                    life.cancelled = true;
                    life.registration = None;
                }
                self.took(if covers { "cancel deferred" } else { "old epoch's cancel deferred" });
            } else {
                assert_eq!(answer, Cancelled::NotFound);
            }
            return;
        }
        let has_registration = life.registration.is_some() || life.matched.is_some();
        if !covers && has_registration {
            assert_eq!(answer, Cancelled::NotFound, "a stale cancel is a no-op");
            return;
        }
        if life.ready.is_none() && life.registration.is_none() {
            assert_eq!(answer, Cancelled::NotFound, "nothing arrived yet");
        } else {
            let registration = life.registration.map(|(_, payload)| payload);
            let expected = Cancelled::Removed { registration, ready: life.ready };
            assert_eq!(answer, expected);
        }
        self.end(slot, End::Cancelled);
    }

    /// Advances the clock and checks that exactly the transfers due have expired.
    fn tick(&mut self) {
        self.clock += 1 + self.rng.below(20);
        let due: HashSet<TransferKey> = self
            .live
            .iter()
            .filter(|(_, life)| life.due().is_some_and(|due| due <= self.clock))
            .map(|(_, life)| life.key.clone())
            .collect();
        let expired = self.table.expire(self.now());
        assert_eq!(expired.len(), due.len(), "expired {expired:?}, due {due:?}");
        for e in expired {
            assert!(due.contains(&e.key), "{:?} expired early", e.key);
            let slot = self.slots[&e.key];
            let life = &self.live[slot].1;
            assert_eq!(e.was_matched, life.matched.is_some());
            let registration = if life.matched.is_some() { None } else { life.registration };
            assert_eq!(e.registration, registration);
            assert_eq!(e.ready, life.ready);
            self.end(slot, End::Expired);
        }
        let (live, fences, heap) =
            (self.table.len(), self.table.fences(), self.table.tracked_deadlines());
        assert_eq!(
            live,
            self.live
                .iter()
                .filter(|(_, l)| l.due().is_some() || l.writing.is_some() || l.streaming.is_some())
                .count()
        );
        // Lazily deleted heap items stay within a constant factor of what the table holds.
        assert!(heap <= 2 * (live + fences) + SHARDS * 33, "{heap} items for {live} + {fences}");
    }
}

#[test]
fn random_lifecycles_each_end_exactly_once_and_leave_nothing_behind() {
    let lifecycles: usize = if cfg!(miri) { 1_000 } else { 100_000 };
    const WINDOW: usize = 64;
    let mut sim = Sim::new(lifecycles, 0xD1B5_4A32_D192_ED03);
    let mut started = 0;
    while started < lifecycles || !sim.live.is_empty() {
        while sim.live.len() < WINDOW && started < lifecycles {
            sim.start(started);
            started += 1;
        }
        if sim.rng.chance(3) {
            sim.tick();
        } else if !sim.live.is_empty() {
            let slot = sim.rng.below(sim.live.len() as u64) as usize;
            sim.step(slot);
        }
    }

    let ends: Vec<End> = sim.ends.iter().map(|end| end.expect("every lifecycle ended")).collect();
    let count = |kind| ends.iter().filter(|&&end| end == kind).count();
    let counts = [End::Delivered, End::Failed, End::Cancelled, End::Expired].map(count);
    assert!(
        counts.iter().all(|&n| n > lifecycles / 100),
        "every way of ending is exercised: {counts:?}"
    );
    for path in [
        "cancel deferred",
        "old epoch's cancel deferred",
        "rematch before the write",
        "rematch after the write",
        "stream",
        "ready during a stream",
        "cancel during a stream",
        "re-registered during a stream",
        "ready held after a cancel during a stream",
    ] {
        assert!(sim.paths.get(path).is_some_and(|&n| n > 0), "{path} never taken: {:?}", sim.paths);
    }
    eprintln!("ends (delivered, failed, cancelled, expired): {counts:?}; paths: {:?}", sim.paths);

    sim.table.expire(sim.at(sim.clock + 10 * FENCE_TTL_MS));
    let table = &sim.table;
    assert_eq!((table.len(), table.fences(), table.tracked_deadlines()), (0, 0, 0));
}

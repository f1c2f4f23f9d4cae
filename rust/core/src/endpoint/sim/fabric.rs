//! The simulated data path: a [`Transport`] whose WRITEs move their bytes into D's simulated
//! memory a chunk at a time, only when progressed (by P's polls over `cma`; by D's
//! `take_notifications` over `tcp`), and deliver their DONE after the last chunk. WRITEs can
//! stall and fail as the schedule says; over `tcp`, bytes held up by a partition past the
//! delivery bound are lost (TCP gave up). Every chunk is checked as it is read from P's memory
//! and as it lands in D's ([`World::read`], [`World::land`](super::world::World::land)).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;
use crate::planner::DescriptorRun;
use crate::protocol::{Decoder, Limits, Message, Secret};
use crate::sync::lock;
use crate::transport::{
    MemoryRegion, MemorySpace, Notification, Transport, TransportError, WriteId, WriteState,
};

use super::plan::{Progress, Side};
use super::world::POOL;
use super::Lab;

/// Bytes per block (4 tokens of one 8-byte head) and KV regions (K and V) per engine.
pub(super) const BLOCK_BYTES: u64 = 32;
pub(super) const REGIONS: u64 = 2;
const REGION_SPAN: u64 = 1 << 20;
const D_BASE: u64 = 0x100_0000_0000;

/// Where `side`'s KV regions start (each P incarnation has its own memory).
pub(super) fn region_base(side: Side, incarnation: u32, region: u64) -> u64 {
    let base = match side {
        Side::D => D_BASE,
        Side::P => 0x1_0000_0000 * (u64::from(incarnation) + 1),
    };
    base + region * REGION_SPAN
}

/// The block `addr` lies in, and how many bytes of it follow `addr`.
fn block_at(side: Side, incarnation: u32, addr: u64) -> Option<(u32, u64)> {
    (0..REGIONS).find_map(|region| {
        let base = region_base(side, incarnation, region);
        let offset = addr.checked_sub(base)?;
        let block = offset / BLOCK_BYTES;
        (block < u64::from(POOL))
            .then(|| (u32::try_from(block).unwrap_or(u32::MAX), BLOCK_BYTES - offset % BLOCK_BYTES))
    })
}

/// One chunk of a WRITE: a source block's bytes for one destination block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    src: u32,
    dst: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Status {
    Moving,
    Done,
    Failed(String),
}

/// A posted WRITE.
#[derive(Debug)]
struct SimWrite {
    /// The request it writes (by index), from its DONE; a WRITE without one (a layer streamed
    /// while P computes the rest) writes the request that holds its first source block.
    request: usize,
    /// The P agent that posted it.
    from: String,
    chunks: Vec<Chunk>,
    /// Chunks read from P's memory: landed (`cma`) or handed to the network (`tcp`).
    moved: usize,
    /// Chunks landed in D's memory.
    landed: usize,
    /// The chunk at which it fails (it is posted while writes fail).
    fail_at: Option<usize>,
    notification: Option<Vec<u8>>,
    status: Status,
}

/// Over `tcp`: something on its way from a P host to D's.
#[derive(Debug)]
enum Wired {
    Chunk { write: u64, request: usize, dst: u32 },
    Done { from: String, payload: Vec<u8> },
}

#[derive(Debug)]
struct InFlight {
    sent: std::time::Duration,
    arrive: std::time::Duration,
    what: Wired,
}

/// The data path's state; see the module docs.
#[derive(Debug)]
pub(super) struct Fabric {
    pub(super) progress: Progress,
    /// Over `tcp`: how long bytes may still land after they left P (P's advertised bound).
    pub(super) delivery_bound: Duration,
    /// By (P incarnation, write id).
    writes: BTreeMap<(u32, u64), SimWrite>,
    next_write: u64,
    /// Over `tcp`: each P incarnation's bytes and DONEs on their way, in order.
    wire: BTreeMap<u32, VecDeque<InFlight>>,
    /// Over `tcp`: when the data connection's bytes get through again after a partition.
    resume: Duration,
    /// DONEs (over `cma`) for D, with when each may be taken.
    mailbox: VecDeque<(Duration, Notification)>,
    /// Active faults: no WRITE moves; new WRITEs fail part way; DONEs are slow.
    pub(super) stuck: u32,
    pub(super) failing: u32,
    pub(super) slow_notifications: u32,
    decoder_secret: Option<Secret>,
}

impl Fabric {
    pub(super) fn new(
        progress: Progress,
        delivery_bound: Duration,
        secret: Option<Secret>,
    ) -> Self {
        Self {
            progress,
            delivery_bound,
            writes: BTreeMap::new(),
            next_write: 1,
            wire: BTreeMap::new(),
            resume: Duration::ZERO,
            mailbox: VecDeque::new(),
            stuck: 0,
            failing: 0,
            slow_notifications: 0,
            decoder_secret: secret,
        }
    }
}

impl Lab {
    /// P's data path to D was cut and heals now: held bytes get through after TCP's backoff,
    /// unless they were held past the delivery bound: then TCP gave up, and they are lost with
    /// everything behind them. With nothing held (nothing was, or TCP gave up on all of it: new
    /// bytes go on a new connection), TCP has nothing to back off for: what is sent from now on
    /// goes at once. (Bytes sent after the heal are then never held past the bound: they wait
    /// at most for the backoff of bytes that themselves arrive within theirs.)
    pub(super) fn data_path_healed(&mut self, backoff: Duration) {
        let now = self.now();
        let retransmit = now + backoff;
        let bound = self.fabric.delivery_bound;
        let mut lost = Vec::new();
        for (&incarnation, wire) in &mut self.fabric.wire {
            if wire.iter().any(|item| item.sent + bound < retransmit.max(item.arrive)) {
                lost.push((incarnation, wire.len()));
                wire.clear();
            }
        }
        let held = self.fabric.wire.values().any(|wire| !wire.is_empty());
        self.fabric.resume = if held { retransmit } else { now };
        for (incarnation, items) in lost {
            for (&(i, _), w) in &mut self.fabric.writes {
                if i == incarnation && w.landed < w.chunks.len() && w.status != Status::Done {
                    w.status = Status::Failed("the data connection gave up".to_owned());
                }
            }
            self.log(format!("data path of p{incarnation} gave up: {items} items lost"));
        }
    }

    /// P incarnation `incarnation` was killed: what its process had not yet handed to the
    /// network goes with it (over `tcp`, what it had may still land).
    pub(super) fn p_transport_killed(&mut self, incarnation: u32) {
        self.fabric.writes.retain(|(i, _), _| *i != incarnation);
    }

    fn post(
        &mut self,
        incarnation: u32,
        from: &str,
        runs: &[DescriptorRun],
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        let mut chunks: Vec<Chunk> = Vec::new();
        for run in runs {
            let mut done = 0;
            while done < run.len {
                let (Some((src, src_left)), Some((dst, dst_left))) = (
                    block_at(Side::P, incarnation, run.src + done),
                    block_at(Side::D, 0, run.dst + done),
                ) else {
                    return Err(TransportError::new(
                        "post_write",
                        format!("run {run:?} strays outside registered memory"),
                    ));
                };
                if chunks.last() != Some(&Chunk { src, dst }) {
                    chunks.push(Chunk { src, dst });
                }
                done += src_left.min(dst_left).min(run.len - done);
            }
        }
        let request = match notification {
            Some(notification) => self.done_of(notification),
            None => chunks.first().and_then(|chunk| self.world.p_holder(incarnation, chunk.src)),
        };
        let Some(request) = request else {
            let now = self.now();
            self.world.violations.push(format!(
                "[{now:?}] a WRITE is neither notified by a DONE for a known request nor reads \
                 a block P holds for one"
            ));
            return Err(TransportError::new("post_write", "bad notification"));
        };
        let fail_at =
            (self.fabric.failing > 0).then(|| self.rng.below(chunks.len() as u64 + 1) as usize);
        let id = self.fabric.next_write;
        self.fabric.next_write += 1;
        self.log(format!(
            "p{incarnation} posts WRITE {id} of {} ({} chunks{}{})",
            self.world.id(request),
            chunks.len(),
            if notification.is_some() { "" } else { ", no DONE" },
            fail_at.map(|at| format!(", fails at {at}")).unwrap_or_default()
        ));
        self.fabric.writes.insert(
            (incarnation, id),
            SimWrite {
                request,
                from: from.to_owned(),
                chunks,
                moved: 0,
                landed: 0,
                fail_at,
                notification: notification.map(<[u8]>::to_vec),
                status: Status::Moving,
            },
        );
        Ok(WriteId(id))
    }

    /// The request (by index) a WRITE's notification is the DONE of.
    fn done_of(&self, notification: &[u8]) -> Option<usize> {
        let now_ms = self.procs[Side::P.index()].clock.unix_millis();
        let decoded = Decoder::new(self.fabric.decoder_secret.clone(), Limits::default())
            .decode_unordered(notification, now_ms, Duration::from_secs(3_600));
        match decoded.map(|envelope| envelope.message) {
            Ok(Message::Done(done)) => self.world.ids.get(&done.request_id).copied(),
            _ => None,
        }
    }

    /// Moves up to `steps` chunks of write `key` (a progress call of P's).
    fn progress(&mut self, key: (u32, u64), steps: u64) {
        if self.fabric.stuck > 0 {
            return;
        }
        for _ in 0..steps {
            let Some(w) = self.fabric.writes.get(&key) else { return };
            if w.status != Status::Moving || w.moved == w.chunks.len() {
                return;
            }
            if w.fail_at == Some(w.moved) {
                self.fail(key, "the peer's connection was reset");
                return;
            }
            let (request, chunk, moved, total) =
                (w.request, w.chunks[w.moved], w.moved, w.chunks.len());
            self.drain_events();
            let now = self.now();
            self.world.read(now, key.0, request, chunk.src);
            match self.fabric.progress {
                Progress::Cma => {
                    self.world.land(now, request, chunk.dst);
                    if let Some(w) = self.fabric.writes.get_mut(&key) {
                        w.moved += 1;
                        w.landed += 1;
                    }
                    if moved + 1 == total {
                        self.complete_cma(key);
                    }
                }
                Progress::Tcp { .. } => {
                    let arrive = now + self.latency();
                    self.wire_push(
                        key.0,
                        now,
                        arrive,
                        Wired::Chunk { write: key.1, request, dst: chunk.dst },
                    );
                    let Some(w) = self.fabric.writes.get_mut(&key) else { return };
                    w.moved += 1;
                    if w.moved == total {
                        if let Some(payload) = w.notification.clone() {
                            let from = w.from.clone();
                            let arrive = now + self.latency();
                            self.wire_push(key.0, now, arrive, Wired::Done { from, payload });
                        }
                    }
                }
            }
        }
    }

    fn wire_push(&mut self, incarnation: u32, sent: Duration, arrive: Duration, what: Wired) {
        let wire = self.fabric.wire.entry(incarnation).or_default();
        let arrive = wire.back().map_or(arrive, |last| last.arrive.max(arrive));
        wire.push_back(InFlight { sent, arrive, what });
    }

    fn complete_cma(&mut self, key: (u32, u64)) {
        let Some(w) = self.fabric.writes.get_mut(&key) else { return };
        w.status = Status::Done;
        let Some(payload) = w.notification.clone() else { return };
        let notification = Notification { from: w.from.clone(), payload };
        let delay = if self.fabric.slow_notifications > 0 {
            self.rng.millis(0.0, 5_000.0)
        } else {
            self.rng.millis(0.0, 2.0)
        };
        let at = self.now() + delay;
        self.fabric.mailbox.push_back((at, notification));
    }

    fn fail(&mut self, key: (u32, u64), why: &str) {
        if let Some(w) = self.fabric.writes.get_mut(&key) {
            w.status = Status::Failed(why.to_owned());
        }
        // The connection's reset loses what had not landed yet, unless the failure was UCX's
        // own on a connection that still carries what was sent.
        if matches!(self.fabric.progress, Progress::Tcp { failures_leave_bytes: true }) {
            return;
        }
        if let Some(wire) = self.fabric.wire.get_mut(&key.0) {
            wire.retain(|item| !matches!(item.what, Wired::Chunk { write, .. } if write == key.1));
        }
    }

    fn poll(&mut self, incarnation: u32, write: WriteId) -> Result<WriteState, TransportError> {
        let key = (incarnation, write.0);
        if !self.fabric.writes.contains_key(&key) {
            return Err(TransportError::new("poll_write", format!("unknown write {write:?}")));
        }
        let steps = self.rng.between(0, 2);
        self.progress(key, steps);
        let status = self.fabric.writes.get(&key).map(|w| w.status.clone());
        match status {
            Some(Status::Done) => {
                self.fabric.writes.remove(&key);
                self.log(format!("p{incarnation} WRITE {} done", write.0));
                Ok(WriteState::Done)
            }
            Some(Status::Failed(why)) => {
                self.fabric.writes.remove(&key);
                self.log(format!("p{incarnation} WRITE {} failed: {why}", write.0));
                Err(TransportError::new("poll_write", why))
            }
            _ => Ok(WriteState::InProgress),
        }
    }

    /// P's progress call: every WRITE of its moves a little.
    fn progress_all(&mut self, incarnation: u32) {
        let keys: Vec<(u32, u64)> =
            self.fabric.writes.keys().copied().filter(|(i, _)| *i == incarnation).collect();
        for key in keys {
            let steps = self.rng.between(0, 1);
            self.progress(key, steps);
        }
    }

    /// D's progress call: over `tcp`, unpacks everything that arrived (landing bytes, taking
    /// DONEs), as NIXL's `getNotifs` does (it progresses UCX until nothing more is to be done);
    /// over `cma`, takes the DONEs due.
    fn take(&mut self, out: &mut Vec<Notification>) {
        let now = self.now();
        let open = self.net.blocked[Side::P.index()] == 0 && now >= self.fabric.resume;
        let incarnations: Vec<u32> = self.fabric.wire.keys().copied().collect();
        for incarnation in incarnations {
            loop {
                let due = self
                    .fabric
                    .wire
                    .get(&incarnation)
                    .and_then(VecDeque::front)
                    .is_some_and(|item| open && item.arrive <= now);
                if !due {
                    break;
                }
                let Some(item) =
                    self.fabric.wire.get_mut(&incarnation).and_then(VecDeque::pop_front)
                else {
                    break;
                };
                match item.what {
                    Wired::Chunk { write, request, dst } => {
                        self.drain_events();
                        self.world.land(now, request, dst);
                        if let Some(w) = self.fabric.writes.get_mut(&(incarnation, write)) {
                            w.landed += 1;
                            if w.landed == w.chunks.len() && w.status == Status::Moving {
                                w.status = Status::Done;
                            }
                        }
                    }
                    Wired::Done { from, payload } => out.push(Notification { from, payload }),
                }
            }
        }
        while self.fabric.mailbox.front().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, notification)) = self.fabric.mailbox.pop_front() {
                out.push(notification);
            }
        }
    }
}

/// One simulated process's transport agent (see the module docs).
pub(super) struct SimAgent {
    lab: Arc<Mutex<Lab>>,
    name: String,
    side: Side,
    incarnation: u32,
    peers: BTreeSet<String>,
}

impl SimAgent {
    pub(super) fn new(lab: Arc<Mutex<Lab>>, name: String, side: Side, incarnation: u32) -> Self {
        Self { lab, name, side, incarnation, peers: BTreeSet::new() }
    }
}

impl Transport for SimAgent {
    fn name(&self) -> &str {
        &self.name
    }

    unsafe fn register_memory(&mut self, _regions: &[MemoryRegion]) -> Result<(), TransportError> {
        Ok(())
    }

    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        Ok(self.name.as_bytes().to_vec())
    }

    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError> {
        let name = String::from_utf8_lossy(metadata).into_owned();
        self.peers.insert(name.clone());
        Ok(name)
    }

    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError> {
        self.peers.remove(peer);
        Ok(())
    }

    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        _local: MemorySpace,
        _remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        if self.side != Side::P || !self.peers.contains(peer) {
            return Err(TransportError::new("post_write", format!("unknown peer {peer:?}")));
        }
        lock(&self.lab).post(self.incarnation, &self.name, runs, notification)
    }

    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError> {
        lock(&self.lab).poll(self.incarnation, write)
    }

    fn send_notification(&mut self, peer: &str, _payload: &[u8]) -> Result<(), TransportError> {
        Err(TransportError::new("send_notification", format!("not simulated (to {peer})")))
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError> {
        let mut lab = lock(&self.lab);
        match self.side {
            Side::P => lab.progress_all(self.incarnation),
            Side::D => lab.take(out),
        }
        Ok(())
    }
}

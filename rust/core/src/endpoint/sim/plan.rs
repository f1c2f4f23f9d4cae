//! A schedule: the workload both engines run and the faults that strike, all drawn from one
//! seed. Printed whole with a violation: with the seed it is what replays it.

use std::fmt;
use std::time::Duration;

use super::rng::Rng;

/// What schedules may be drawn ([`Model::FULL`]: everything). Leaving something out draws the
/// same numbers, so a seed's schedule changes only where it had drawn that: a way to find
/// whether a violation needs what was left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Model {
    /// Over TCP, a WRITE that fails may leave bytes on their way (a failure of UCX's own, on a
    /// TCP connection that still carries them); otherwise its connection's reset loses them.
    pub tcp_failures_leave_bytes: bool,
    /// A paused P may be a paused virtual machine, whose clocks stop with it; otherwise a
    /// pause stops at most the monotonic clock (a suspend).
    pub stopped_clocks: bool,
    /// P's engine may hand a request's layers over while it computes the rest (layer-wise
    /// push: WRITEs that notify nobody, then the request's WRITE with the DONE).
    pub layerwise: bool,
}

impl Model {
    /// Every schedule the simulation can draw.
    pub const FULL: Self =
        Self { tcp_failures_leave_bytes: true, stopped_clocks: true, layerwise: true };
    /// Every schedule but layer-wise push: the schedules drawn before it existed, which the
    /// seeds kept for the fence bugs found then replay exactly.
    pub const WHOLE_REQUESTS: Self = Self { layerwise: false, ..Self::FULL };
}

/// One of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    /// The prefill worker: writes.
    P,
    /// The decode worker: receives.
    D,
}

impl Side {
    pub(super) fn index(self) -> usize {
        match self {
            Self::P => 0,
            Self::D => 1,
        }
    }

    pub(super) fn other(self) -> Self {
        match self {
            Self::P => Self::D,
            Self::D => Self::P,
        }
    }
}

/// Who moves a WRITE's bytes into D's memory (what UCX does underneath NIXL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// UCX's `cma`: P's own progress calls copy the bytes (`process_vm_writev`); the WRITE is
    /// done once the last byte landed. Nothing is in flight between the hosts.
    Cma,
    /// UCX's `tcp`: P's progress hands the bytes to the network and D's progress
    /// (`take_notifications`) unpacks them into its memory. P's WRITE is done once the last byte
    /// landed in D (NIXL flushes the endpoint after the data, and UCX's software RMA counts a
    /// byte flushed once D unpacked it). With `failures_leave_bytes`, a WRITE that fails leaves
    /// the bytes already sent on their way. Bytes held up longer than the delivery bound are
    /// lost (TCP gave up).
    Tcp {
        /// See above.
        failures_leave_bytes: bool,
    },
}

/// How a process's clocks behave while it is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseClocks {
    /// SIGSTOP, a long GC or swap stall: the clocks run on.
    Run,
    /// A host suspend: the monotonic clock stops, the boot-time clock runs on.
    MonotonicStops,
    /// A paused virtual machine: both clocks stop.
    BothStop,
}

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The whole process stops: writer, side-channel threads, engine.
    Pause {
        /// Which process.
        side: Side,
        /// What its clocks do meanwhile.
        clocks: PauseClocks,
    },
    /// The writer thread alone stops (stuck in a transport call); the rest of the process runs.
    StallWriter {
        /// Whose.
        side: Side,
    },
    /// The network drops nothing but delivers nothing in the cut directions (TCP retransmits
    /// once it heals, after a backoff).
    Partition {
        /// P's frames (and WRITE bytes, over TCP) are held.
        from_p: bool,
        /// D's frames are held.
        from_d: bool,
    },
    /// Every side-channel connection thread of one side is stuck (in a handler callback): it
    /// neither reads, nor sends heartbeats, nor judges silence.
    SlowReader {
        /// Whose.
        side: Side,
    },
    /// No WRITE moves a byte while this lasts (a stalled link or transport).
    StuckWrites,
    /// WRITEs posted while this lasts fail part way (the data connection is reset: what was
    /// not yet landed is lost).
    FailingWrites,
    /// DONE notifications take up to seconds to arrive (over `cma`).
    SlowNotifications,
    /// P's process is killed: its connections close, its address refuses, and what it had
    /// handed to the network may still land. With `restart`, a new P (another agent) takes the
    /// address once the fault ends.
    KillP {
        /// See above.
        restart: bool,
    },
    /// Every side-channel connection is reset at once.
    ResetConnections,
}

/// A fault and when it strikes; it heals `lasts` later (or when the schedule heals everything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// From the start of the schedule.
    pub at: Duration,
    /// How long it lasts.
    pub lasts: Duration,
    /// What it is.
    pub kind: FaultKind,
}

/// One request as both engines see it (one id on both sides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPlan {
    /// The request id (and transfer key).
    pub id: String,
    /// Prompt tokens (4 per block).
    pub tokens: u64,
    /// When D's engine has allocated its blocks and expects the KV.
    pub expect_at: Duration,
    /// D's wait for the KV.
    pub receive_ttl: Duration,
    /// When D's engine cancels the request (abort, preemption), if it does.
    pub cancel_at: Option<Duration>,
    /// When P's engine has computed the KV.
    pub ready_at: Duration,
    /// P's hold on its KV.
    pub ready_ttl: Duration,
    /// When P's engine aborts the request, if it does.
    pub abort_at: Option<Duration>,
    /// Layer-wise push: when P's forward starts on the request (its blocks held from then),
    /// handing its layers but the last over one by one, each once final, until `ready_at`.
    pub stream_from: Option<Duration>,
}

/// One schedule: see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// What everything else was drawn from.
    pub seed: u64,
    /// What could be drawn.
    pub model: Model,
    /// Who moves the WRITEs' bytes.
    pub progress: Progress,
    /// How long a frame or a WRITE's bytes take between the hosts, at least and at most.
    pub latency: (Duration, Duration),
    /// P's write timeout (part of its horizon).
    pub write_timeout: Duration,
    /// The requests.
    pub requests: Vec<RequestPlan>,
    /// The faults.
    pub faults: Vec<Fault>,
    /// When everything heals; the schedule then runs until every request ended.
    pub heal_at: Duration,
    /// How often (percent) a thread that could run a turn of a round does not (a busy core).
    pub skip_percent: u64,
}

fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

impl Plan {
    /// The schedule of `seed` under `model`.
    pub fn generate(seed: u64, model: Model) -> Self {
        let mut rng = Rng::new(seed);
        let progress = match rng.weighted(&[2, 1, 1]) {
            0 => Progress::Cma,
            1 => Progress::Tcp { failures_leave_bytes: model.tcp_failures_leave_bytes },
            _ => Progress::Tcp { failures_leave_bytes: false },
        };
        let latency = match rng.weighted(&[3, 3, 1]) {
            0 => (Duration::from_micros(50), Duration::from_micros(500)),
            1 => (ms(1), ms(5)),
            _ => (ms(2), ms(60)),
        };
        let write_timeout = ms(rng.between(800, 2_500));
        let heal_at = ms(rng.between(5_000, 20_000));
        let span = heal_at.as_millis() as u64;
        let requests = (0..rng.between(1, 8))
            .map(|i| {
                let expect_at = ms(rng.below(span * 4 / 5));
                let offset = rng.between(0, 5_000);
                let ready_at = (expect_at + ms(offset)).saturating_sub(ms(2_000));
                RequestPlan {
                    id: format!("r{i}"),
                    tokens: rng.between(1, 12),
                    expect_at,
                    receive_ttl: ms(rng.between(800, 10_000)),
                    cancel_at: rng.percent(15).then(|| expect_at + ms(rng.below(4_000))),
                    ready_at,
                    ready_ttl: ms(rng.between(800, 10_000)),
                    abort_at: rng.percent(10).then(|| ready_at + ms(rng.below(3_000))),
                    stream_from: None,
                }
            })
            .collect::<Vec<_>>();
        let requests = streamed(seed, model, requests);
        let count = [0, 1, 1, 2, 2, 3, 4][usize::try_from(rng.below(7)).unwrap_or(0)];
        let faults = (0..count)
            .map(|_| {
                let at = ms(rng.below(span));
                let (kind, lasts) = fault(&mut rng, model);
                Fault { at, lasts, kind }
            })
            .collect();
        Self {
            seed,
            model,
            progress,
            latency,
            write_timeout,
            requests,
            faults,
            heal_at,
            skip_percent: [0, 10, 30][usize::try_from(rng.below(3)).unwrap_or(0)],
        }
    }
}

/// Layer-wise push for about half the requests, drawn apart from the rest of the plan (a model
/// without it draws the schedule it drew before layer-wise push existed). A streamed request's
/// abort, if it has one, comes as long after its forward's start as it would after its KV's:
/// often mid-stream.
fn streamed(seed: u64, model: Model, mut requests: Vec<RequestPlan>) -> Vec<RequestPlan> {
    let mut rng = Rng::new(seed ^ 0x4C41_5945_5257_4953);
    for r in &mut requests {
        let computing = ms(rng.between(0, 3_000));
        if rng.percent(50) && model.layerwise {
            let from = r.ready_at.saturating_sub(computing);
            r.abort_at = r.abort_at.map(|at| from + (at - r.ready_at));
            r.stream_from = Some(from);
        }
    }
    requests
}

fn side(rng: &mut Rng) -> Side {
    if rng.percent(50) {
        Side::P
    } else {
        Side::D
    }
}

/// A fault and how long it lasts.
fn fault(rng: &mut Rng, model: Model) -> (FaultKind, Duration) {
    match rng.weighted(&[3, 2, 3, 2, 2, 1, 1, 2, 1]) {
        0 => {
            let clocks = match rng.weighted(&[2, 1, 1]) {
                0 => PauseClocks::Run,
                1 => PauseClocks::MonotonicStops,
                _ if model.stopped_clocks => PauseClocks::BothStop,
                _ => PauseClocks::MonotonicStops,
            };
            (FaultKind::Pause { side: side(rng), clocks }, ms(rng.between(50, 8_000)))
        }
        1 => (FaultKind::StallWriter { side: side(rng) }, ms(rng.between(50, 14_000))),
        2 => {
            let (from_p, from_d) = match rng.below(3) {
                0 => (true, false),
                1 => (false, true),
                _ => (true, true),
            };
            (FaultKind::Partition { from_p, from_d }, ms(rng.between(50, 8_000)))
        }
        3 => (FaultKind::SlowReader { side: side(rng) }, ms(rng.between(50, 5_000))),
        4 => (FaultKind::StuckWrites, ms(rng.between(100, 12_000))),
        5 => (FaultKind::FailingWrites, ms(rng.between(500, 5_000))),
        6 => (FaultKind::SlowNotifications, ms(rng.between(500, 5_000))),
        7 => (FaultKind::KillP { restart: rng.percent(60) }, ms(rng.between(0, 4_000))),
        _ => (FaultKind::ResetConnections, Duration::ZERO),
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {} ({:?}, latency {:?}..{:?}, write timeout {:?}, heal at {:?}, {}% skipped \
             turns)",
            self.seed,
            self.progress,
            self.latency.0,
            self.latency.1,
            self.write_timeout,
            self.heal_at,
            self.skip_percent
        )?;
        for r in &self.requests {
            writeln!(
                f,
                "  {}: {} tokens; D expects at {:?} (ttl {:?}{}); P ready at {:?} (ttl {:?}{}{})",
                r.id,
                r.tokens,
                r.expect_at,
                r.receive_ttl,
                r.cancel_at.map(|at| format!(", cancels at {at:?}")).unwrap_or_default(),
                r.ready_at,
                r.ready_ttl,
                r.abort_at.map(|at| format!(", aborts at {at:?}")).unwrap_or_default(),
                r.stream_from
                    .map(|at| format!(", layers streamed from {at:?}"))
                    .unwrap_or_default(),
            )?;
        }
        for fault in &self.faults {
            writeln!(f, "  fault at {:?} for {:?}: {:?}", fault.at, fault.lasts, fault.kind)?;
        }
        Ok(())
    }
}

//! Scripted hostile peers that drive a live kvpush [`Endpoint`](kvpush_core::endpoint::Endpoint)
//! through its public API, and check what must hold whatever the peers send and however their
//! messages interleave with the engine's calls.
//!
//! * [`registration`]: a real P endpoint and scripted D peers joined over its side channel:
//!   registrations, cancels, heartbeats and stray replies, interleaved with P's `ready` and
//!   `abort`. P's registration handling (the side channel's handler, the rendezvous table, the
//!   fan-out groups) and the writer's send path.
//! * [`receive`]: a real D endpoint and scripted fake Ps (side channels of their own plus loopback
//!   agents that send DONE notifications): DONEs right and wrong, FAILs, CANCEL_ACKs, errors,
//!   P's disconnects, closes and restarts, interleaved with D's `expect` and `cancel`. D's receive
//!   state machine and its fence.
//!
//! A script is built with `arbitrary` from bytes: libFuzzer's input in the cargo-fuzz targets
//! (`fuzz/fuzz_targets/{registration,receive}.rs`), a seeded generator's in the CI test
//! (`tests/scripts.rs`), so both run the same harness. Each run starts its endpoints afresh on
//! 127.0.0.1 with short timeouts ([`HEARTBEAT`], [`PEER_TIMEOUT`], [`WRITE_TIMEOUT`]), bounds
//! every wait, and returns a [`Report`]: the properties the run found broken, none when it is
//! clean.
//!
//! A property broken the way a bug already found in the core breaks it is reported apart, as a
//! [`Known`] bug (`tests/known_bugs.rs` reproduces each with a short script, ignored until the
//! core is fixed), so that the fuzzer and the CI test go on looking for new ones;
//! `KVPUSH_HARNESS_STRICT=1` makes them failures again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, PoisonError};
use std::thread;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use kvpush_core::protocol::Secret;

mod cache;
pub mod receive;
pub mod registration;

/// Side-channel heartbeat period of every endpoint and peer.
pub const HEARTBEAT: Duration = Duration::from_millis(50);
/// Silence after which a peer is lost; also P's lease on D's proof of life.
pub const PEER_TIMEOUT: Duration = Duration::from_millis(400);
/// A P WRITE not done after this is reported quarantined.
pub const WRITE_TIMEOUT: Duration = Duration::from_millis(300);
/// The accepting side's bound on a handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(300);
/// A connecting peer's bound on its handshake: generous, so that a busy shared machine does not
/// fail a legitimate join.
const JOIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The secret every endpoint and legitimate peer shares.
const SECRET: &[u8] = b"kvpush-harness-shared-secret-0001";
/// A secret nobody else holds: what a forger signs with.
const WRONG_SECRET: &[u8] = b"kvpush-harness-forgers-secret-002";

fn secret(bytes: &[u8]) -> Secret {
    Secret::from_bytes(bytes).expect("the harness's secrets are long enough")
}

/// Up to `N` values of a script. Its length is drawn first and bounded, so that a list never
/// takes the bytes the rest of the script is drawn from (`Vec`'s own length may).
#[derive(Debug, Clone)]
pub struct Few<T, const N: usize>(pub Vec<T>);

impl<'a, T: Arbitrary<'a>, const N: usize> Arbitrary<'a> for Few<T, N> {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let len = usize::from(u8::arbitrary(u)?) % (N + 1);
        (0..len).map(|_| T::arbitrary(u)).collect::<arbitrary::Result<_>>().map(Self)
    }
}

impl<T, const N: usize> std::ops::Deref for Few<T, N> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.0
    }
}

/// Which of several choices, drawn with `weights`: scripts draw the well-formed choice of a value
/// more often than its hostile ones, so that short inputs and a seeded generator's random bytes
/// still reach deep states (a uniform draw mostly picks a malformed registration). Out of
/// bytes, the first choice.
fn pick(u: &mut Unstructured<'_>, weights: &[u32]) -> arbitrary::Result<usize> {
    let total: u32 = weights.iter().sum();
    let mut draw = u.int_in_range(0..=total.saturating_sub(1))?;
    for (choice, &weight) in weights.iter().enumerate() {
        if draw < weight {
            return Ok(choice);
        }
        draw -= weight;
    }
    Ok(weights.len().saturating_sub(1))
}

/// What one run found broken: empty when every property held.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per property broken, saying what and for which request or peer.
    pub violations: Vec<String>,
    /// Properties broken the way a bug already known in the core breaks them: reported, but
    /// no failure, so that the fuzzer and the CI test go on looking for new ones.
    /// `KVPUSH_HARNESS_STRICT=1` counts them as violations.
    pub known: Vec<Known>,
    /// How far the run got (joins, events, writes), for a fuzzer's progress line.
    pub summary: String,
}

impl Report {
    /// Whether every property held, but for known bugs unless `KVPUSH_HARNESS_STRICT=1`.
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty() && (self.known.is_empty() || !strict())
    }
}

/// A property broken the way a known bug breaks it.
#[derive(Debug, Clone)]
pub struct Known {
    /// Which bug (`tests/known_bugs.rs` reproduces each).
    pub bug: &'static str,
    /// What happened in this run.
    pub detail: String,
}

/// Whether known bugs count as violations (`KVPUSH_HARNESS_STRICT=1`).
pub fn strict() -> bool {
    std::env::var_os("KVPUSH_HARNESS_STRICT").is_some_and(|v| v == "1")
}

/// The order of what happened in one run: every send a scripted peer makes, every message it
/// receives, every WRITE P posts or finishes and every poll of an endpoint's events takes a tick,
/// so that "before" and "after" can be compared across threads.
#[derive(Debug, Default)]
struct Clock(AtomicU64);

impl Clock {
    fn tick(&self) -> u64 {
        // SeqCst: ticks taken on different threads must order the actions around them as they
        // happened (a FAIL received before a WRITE was posted gets the smaller tick).
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// "done 3, failed 1": how many of `outcomes` ended each way, for a run's summary.
fn tally<'a>(outcomes: impl Iterator<Item = &'a kvpush_core::endpoint::Outcome>) -> String {
    use kvpush_core::endpoint::Outcome;
    let mut counts = [0usize; 4];
    for outcome in outcomes {
        counts[match outcome {
            Outcome::Done => 0,
            Outcome::Failed(_) => 1,
            Outcome::Cancelled(_) => 2,
            Outcome::Quarantined(_) => 3,
        }] += 1;
    }
    ["done", "failed", "cancelled", "quarantined"]
        .iter()
        .zip(counts)
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A name no other agent or engine of this process has (loopback agents must be unique).
fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // Relaxed: only the uniqueness of each value matters.
    format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records every panic on an endpoint's own threads (all named `kvpush-…`) from now on; the
/// previous hook still runs (under libFuzzer it aborts, so the input is saved). Such a panic
/// does not fail the test that caused it by itself, so each run looks at [`panics`]; a panic on
/// the harness's own threads fails its test directly.
pub fn record_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = thread::current().name().unwrap_or("<unnamed>").to_owned();
            if thread.starts_with("kvpush-") {
                let line = format!("{thread}: {info}");
                PANICS.lock().unwrap_or_else(PoisonError::into_inner).push(line);
            }
            previous(info);
        }));
    });
}

/// Panics recorded since [`record_panics`], in order.
pub fn panics() -> Vec<String> {
    PANICS.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

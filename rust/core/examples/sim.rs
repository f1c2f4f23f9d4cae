//! The long run of kvpush's deterministic simulation (`kvpush_core::endpoint::sim`): schedules
//! of faults against a simulated P and D pair, checked against the fence's properties.
//!
//! ```text
//! KVPUSH_SIM_SECONDS=600 cargo run --release -p kvpush-core --features sim --example sim
//! KVPUSH_SIM_SCHEDULES=5000 cargo run --release -p kvpush-core --features sim --example sim
//! KVPUSH_SIM_SEED=1234 cargo run --release -p kvpush-core --features sim --example sim  # replay
//! ```
//!
//! `KVPUSH_SIM_SECONDS` (default 60) bounds the wall time, `KVPUSH_SIM_SCHEDULES` the count;
//! `KVPUSH_SIM_FIRST_SEED` (default: a fresh one, printed) is where the seeds start. With
//! `KVPUSH_SIM_SEED` it replays that one schedule and prints its report. Exits 1 on a violation,
//! after printing the first schedule of each kind of violation. `KVPUSH_SIM_WHOLE_REQUESTS=1`
//! draws the schedules without layer-wise push, as seeds found before it replay them.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvpush_core::endpoint::sim::{self, Model};

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    match value.trim().parse() {
        Ok(number) => Some(number),
        Err(_) => {
            eprintln!("sim: {name}={value:?} is not a whole number; ignored");
            None
        }
    }
}

fn main() -> ExitCode {
    let model = match std::env::var("KVPUSH_SIM_WHOLE_REQUESTS").as_deref() {
        Ok("1") => Model::WHOLE_REQUESTS,
        _ => Model::FULL,
    };
    if let Some(seed) = env_u64("KVPUSH_SIM_SEED") {
        let report = sim::run(seed, model);
        println!("{report}");
        return if report.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    let first = env_u64("KVPUSH_SIM_FIRST_SEED").unwrap_or_else(|| {
        // A different stretch of seeds each run; printed, so that any of them replays.
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        (now.as_secs() % 1_000_000) * 1_000_000
    });
    let count = env_u64("KVPUSH_SIM_SCHEDULES");
    let budget = Duration::from_secs(env_u64("KVPUSH_SIM_SECONDS").unwrap_or(60));
    let or_count = count.map(|count| format!(" or {count} schedules")).unwrap_or_default();
    println!("sim: schedules from seed {first}, for up to {budget:?}{or_count} ({model:?})");
    let summary = sim::run_schedules(model, first, count, Some(budget));
    println!("{summary}");
    for (failure, _) in &summary.failures {
        println!("\n{failure}");
    }
    if summary.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

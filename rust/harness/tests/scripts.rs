//! The harness's scripts as ordinary tests on the stable toolchain: a seeded generator stands
//! in for libFuzzer, so each run draws the same cases (`KVPUSH_HARNESS_SEED` and
//! `KVPUSH_HARNESS_CASES` change them). A failing case prints its seed and script.

use std::io::Write;
use std::time::Instant;

use arbitrary::{Arbitrary, Unstructured};
use kvpush_harness::{receive, record_panics, registration, Report};

/// Bytes one script is drawn from: enough for the longest script that runs.
const SCRIPT_BYTES: usize = 1_024;

/// SplitMix64: a seeded source of bytes, the same on every machine.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len.div_ceil(8)).flat_map(|_| self.next().to_le_bytes()).take(len).collect()
    }
}

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs `cases` scripts drawn from `seed` through `run`; fails with every broken case.
fn run_cases<S: for<'a> Arbitrary<'a> + std::fmt::Debug>(
    name: &str,
    default_cases: u64,
    run: impl Fn(&S) -> Report,
) {
    record_panics();
    let seed = setting("KVPUSH_HARNESS_SEED", 0x6b76_7075_7368);
    let cases = setting("KVPUSH_HARNESS_CASES", default_cases);
    let verbose = setting("KVPUSH_HARNESS_VERBOSE", 0) != 0;
    let mut source = SplitMix(seed ^ name.len() as u64);
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut known = std::collections::BTreeMap::<&str, usize>::new();
    for case in 0..cases {
        let bytes = source.bytes(SCRIPT_BYTES);
        // As libFuzzer's targets draw theirs: the last field (the actions) takes the rest.
        let Ok(script) = S::arbitrary_take_rest(Unstructured::new(&bytes)) else { continue };
        let report = run(&script);
        if verbose {
            let _ = writeln!(std::io::stderr(), "{name} case {case}: {}", report.summary);
        }
        for hit in &report.known {
            *known.entry(hit.bug).or_default() += 1;
        }
        if !report.is_clean() {
            failures.push(format!(
                "case {case} (seed {seed:#x}): {:#?}\nknown: {:#?}\nscript: {script:#?}",
                report.violations, report.known
            ));
        }
    }
    // Straight to stderr, past the test harness's capture: CI logs show how much ran.
    let _ = writeln!(
        std::io::stderr(),
        "{name}: {cases} cases in {:.1}s (seed {seed:#x}), {} broken",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    for (bug, count) in &known {
        let _ = writeln!(std::io::stderr(), "{name}: {count} cases hit a known bug: {bug}");
    }
    assert!(failures.is_empty(), "{name}: {}", failures.join("\n\n"));
}

#[test]
fn registrations_from_scripted_d_peers_keep_ps_promises() {
    run_cases::<registration::Script>("registration", 80, registration::run);
}

#[test]
fn receives_from_scripted_fake_ps_end_only_on_evidence() {
    run_cases::<receive::Script>("receive", 30, receive::run);
}

//! What the fuzz targets that drive live endpoints share: the process setup libFuzzer's main
//! leaves out, and the verdict on a [`Report`] of the harness (`kvpush-harness`).

use std::collections::BTreeMap;
use std::sync::{Mutex, Once};

use kvpush_harness::Report;

/// Ignores SIGPIPE: libFuzzer's own main never runs Rust's runtime setup, which does, and
/// without it a write to a socket the peer closed kills the process.
pub fn ignore_sigpipe() {
    // SAFETY: setting a signal disposition to SIG_IGN; no handler code runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// Prepares the process once for a target that drives live endpoints: [`ignore_sigpipe`], and
/// records panics on the endpoints' threads (`kvpush_harness::record_panics`).
pub fn prepare() {
    static PREPARE: Once = Once::new();
    PREPARE.call_once(|| {
        ignore_sigpipe();
        kvpush_harness::record_panics();
    });
}

/// One target's inputs run, and the known bugs they hit (by name), for the progress line.
type Tally = (u64, BTreeMap<&'static str, u64>);

/// Each target's [`Tally`].
static TALLY: Mutex<BTreeMap<&str, Tally>> = Mutex::new(BTreeMap::new());

/// Inputs between two progress lines.
const PROGRESS_EVERY: u64 = 32;

/// The verdict on one input of `target`: a progress line every [`PROGRESS_EVERY`] inputs (how
/// deep the last input got, and the known bugs hit so far), and a panic (libFuzzer saves the
/// input) when the report broke a property that no known bug explains.
pub fn judge(target: &'static str, report: &Report) {
    {
        let mut tally = TALLY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (inputs, known) = tally.entry(target).or_default();
        *inputs += 1;
        for hit in &report.known {
            *known.entry(hit.bug).or_default() += 1;
        }
        if *inputs % PROGRESS_EVERY == 1 {
            eprintln!(
                "{target} fuzz: {inputs} inputs; last: {}; known bugs hit: {known:?}",
                report.summary
            );
        }
    }
    assert!(report.is_clean(), "{target}: properties broken: {report:#?}");
}

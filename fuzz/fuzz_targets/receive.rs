//! Drives D's receive state machine (`expect`, `cancel`, its legs and its fence) against
//! scripted fake Ps: side channels of their own and loopback agents that send DONEs right and
//! wrong, FAILs, CANCEL_ACKs and errors, drop D, close and come back as other endpoints. Every
//! input checks that D reports done only on every leg's valid DONE, fails or cancels only once
//! no P that heard the registration may still write, and ends each receive once. The harness
//! and its properties: `kvpush_harness::receive`.
//!
//! Run: `scripts/fuzz receive 600` (or `cd fuzz && cargo +nightly fuzz run receive`).

#![no_main]

use kvpush_harness::receive::{run, Script};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|script: Script| {
    kvpush_fuzz::prepare();
    kvpush_fuzz::judge("receive", &run(&script));
});

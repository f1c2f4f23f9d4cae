//! Drives P's registration handling (the side channel's handler, the rendezvous table, the
//! fan-out groups, the writer's send path) with scripted D peers joined over a live P
//! endpoint's side channel, interleaved with P's `ready` and `abort`; every input checks that P
//! stays healthy, writes only into blocks a live registration of the owning peer named, ends
//! each accepted `ready` once, lets go of everything once the peers are gone, and gives a reason
//! for every refusal. The harness and its properties: `kvpush_harness::registration`.
//!
//! Run: `scripts/fuzz registration 600` (or `cd fuzz && cargo +nightly fuzz run registration`).

#![no_main]

use kvpush_harness::registration::{run, Script};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|script: Script| {
    kvpush_fuzz::prepare();
    kvpush_fuzz::judge("registration", &run(&script));
});

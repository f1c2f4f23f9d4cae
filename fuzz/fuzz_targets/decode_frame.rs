//! Feeds arbitrary bytes to the kvpush/1 decoder, signed and trusted, whole and split into
//! frames: it must return (Ok or Err), never panic, overflow the stack or allocate without bound.
//!
//! Run: `cd fuzz && cargo +nightly fuzz run decode_frame -- -max_total_time=60`
//! (or `RUSTC_BOOTSTRAP=1 cargo fuzz run decode_frame` on stable).

#![no_main]

use kvpush_core::protocol::{frame_len, Decoder, Limits, Secret};
use libfuzzer_sys::fuzz_target;

const NOW_MS: u64 = 1_700_000_000_000;

fuzz_target!(|data: &[u8]| {
    // Small limits so that length checks are reached by inputs the fuzzer can build.
    let limits = Limits { max_frame_bytes: 1 << 16, max_block_ids: 1024, ..Limits::default() };
    let Ok(secret) = Secret::from_bytes(b"fuzzing shared secret, 32 bytes!") else {
        return;
    };
    let mut signed = Decoder::new(Some(secret), limits);
    let mut trusted = Decoder::new(None, limits);

    let _ = signed.decode(data, NOW_MS);
    let _ = trusted.decode(data, NOW_MS);

    // The same bytes as a stream: cut into frames the way a side-channel reader would.
    let mut rest = data;
    while let Ok(Some(len)) = frame_len(rest, &limits) {
        let Some((frame, tail)) = rest.split_at_checked(len) else {
            break;
        };
        let _ = signed.decode(frame, NOW_MS);
        if let Ok(envelope) = trusted.decode(frame, NOW_MS) {
            // Whatever decodes must pass its own validation again.
            assert!(envelope.message.validate(&limits).is_ok());
        }
        rest = tail;
    }
});

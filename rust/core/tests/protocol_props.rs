//! Property tests of the kvpush/1 codec: every message survives the wire, and no byte string,
//! however broken, forged or replayed, gets through or crashes the decoder.

use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::protocol::{
    frame_len, BlockGroup, Cancel, CancelAck, Decoder, Done, Encoder, ErrorReply, Fail, FailReason,
    Heartbeat, Hello, Limits, Message, ProtocolError, Register, Secret,
};
use proptest::prelude::*;

const NOW: u64 = 1_700_000_000_000;

fn secret() -> Secret {
    Secret::from_bytes(b"property-test shared secret 0123").expect("32 bytes is long enough")
}

fn text() -> impl Strategy<Value = String> {
    ".{0,24}"
}

fn id() -> impl Strategy<Value = String> {
    ".{1,40}"
}

/// A (rank, size) pair with rank < size.
fn rank() -> impl Strategy<Value = (u32, u32)> {
    (1u32..=64).prop_flat_map(|size| (0..size, Just(size)))
}

fn fail_reason() -> impl Strategy<Value = FailReason> {
    prop_oneof![
        proptest::sample::select(FailReason::KNOWN.to_vec()),
        "[a-z_]{1,16}".prop_map(|s| FailReason::from_wire(&s)),
    ]
}

fn layout() -> impl Strategy<Value = KvLayout> {
    let region = (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
        |(base, block_stride, num_blocks, group)| Region { base, block_stride, num_blocks, group },
    );
    (
        proptest::collection::vec(region, 0..4),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        prop_oneof![Just(TokenOrder::Nhd), Just(TokenOrder::Hnd)],
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(regions, block_tokens, kernel_block_tokens, heads, head_bytes, token_order, r, s)| {
                KvLayout {
                    regions,
                    block_tokens,
                    kernel_block_tokens,
                    heads,
                    head_bytes,
                    token_order,
                    tp_rank: r,
                    tp_size: s,
                }
            },
        )
}

fn message() -> impl Strategy<Value = Message> {
    let hello = (
        (id(), rank(), rank(), id()),
        proptest::collection::vec(any::<u8>(), 0..64),
        layout(),
        text(),
        proptest::collection::vec(any::<u16>(), 1..4),
    )
        .prop_map(
            |(
                (engine_id, (tp_rank, tp_size), (pp_rank, pp_size), agent_name),
                agent_metadata,
                layout,
                compatibility,
                versions,
            )| {
                Message::Hello(Hello {
                    engine_id,
                    tp_rank,
                    tp_size,
                    pp_rank,
                    pp_size,
                    agent_name,
                    agent_metadata,
                    layout,
                    compatibility,
                    versions,
                    memory: kvpush_core::transport::MemorySpace::DRAM,
                    nonce: 0,
                    echo: 0,
                    write_horizon_ms: 0,
                    delivery_bound_ms: 0,
                })
            },
        );
    let group = (any::<u64>(), proptest::collection::vec(any::<u32>(), 0..32))
        .prop_map(|(first_token, block_ids)| BlockGroup { first_token, block_ids });
    let register = (
        (id(), id(), any::<u64>(), text(), text()),
        rank(),
        proptest::collection::vec(group, 0..4),
        any::<u64>(),
        (any::<u64>(), any::<u64>()),
    )
        .prop_map(
            |(
                (transfer_key, request_id, epoch, engine_id, address),
                (tp_rank, tp_size),
                groups,
                num_tokens,
                (ttl_ms, nonce),
            )| {
                Message::Register(Register {
                    transfer_key,
                    request_id,
                    epoch,
                    engine_id,
                    address,
                    tp_rank,
                    tp_size,
                    groups,
                    num_tokens,
                    ttl_ms,
                    fanout: 1,
                    nonce,
                })
            },
        );
    let done = (id(), id(), any::<u64>(), rank(), (any::<u64>(), any::<u64>()), any::<u32>())
        .prop_map(|(transfer_key, request_id, epoch, (tp_rank, tp_size), (bytes, nonce), runs)| {
            Message::Done(Done {
                transfer_key,
                request_id,
                epoch,
                tp_rank,
                tp_size,
                bytes,
                runs,
                nonce,
            })
        });
    let fail = (id(), id(), any::<u64>(), fail_reason(), text()).prop_map(
        |(transfer_key, request_id, epoch, reason, detail)| {
            Message::Fail(Fail { transfer_key, request_id, epoch, reason, detail })
        },
    );
    let cancel = (id(), id(), any::<u64>()).prop_map(|(transfer_key, request_id, epoch)| {
        Message::Cancel(Cancel { transfer_key, request_id, epoch })
    });
    let cancel_ack = (id(), id(), any::<u64>(), any::<bool>(), any::<bool>()).prop_map(
        |(transfer_key, request_id, epoch, wrote, delivered)| {
            Message::CancelAck(CancelAck { transfer_key, request_id, epoch, wrote, delivered })
        },
    );
    let heartbeat = (text(), any::<u64>(), any::<u32>()).prop_map(|(engine_id, seq, pending)| {
        Message::Heartbeat(Heartbeat { engine_id, seq, pending, clock_ms: seq, echo_ms: seq / 2 })
    });
    let error =
        (text(), text()).prop_map(|(code, detail)| Message::Error(ErrorReply { code, detail }));
    prop_oneof![hello, register, done, fail, cancel, cancel_ack, heartbeat, error]
}

/// An arbitrary message and its signed frame, stamped [`NOW`].
fn signed_frame() -> impl Strategy<Value = (Message, Vec<u8>)> {
    message().prop_map(|message| {
        let frame = Encoder::new("p-agent-0", Some(secret())).encode(&message, NOW);
        (message, frame)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_message_round_trips(message in message(), signed in any::<bool>(), sender in id()) {
        let secret = signed.then(secret);
        let encoder = Encoder::new(sender.clone(), secret.clone());
        let mut decoder = Decoder::new(secret, Limits::default());
        let frame = encoder.encode(&message, NOW);
        prop_assert_eq!(frame_len(&frame, &Limits::default()), Ok(Some(frame.len())));
        let envelope = decoder.decode(&frame, NOW).unwrap();
        prop_assert_eq!(envelope.message, message);
        prop_assert_eq!(envelope.sender, sender);
        let stamp = (envelope.session, envelope.seq, envelope.ts_ms);
        prop_assert_eq!(stamp, (encoder.session(), 1, NOW));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut signed = Decoder::new(Some(secret()), Limits::default());
        let mut trusted = Decoder::new(None, Limits::default());
        let _ = signed.decode(&bytes, NOW);
        let _ = trusted.decode(&bytes, NOW);
        // Behind a correct prefix, so the bytes reach the msgpack decoder.
        let mut framed = u32::try_from(bytes.len()).unwrap().to_be_bytes().to_vec();
        framed.extend_from_slice(&bytes);
        let _ = signed.decode(&framed, NOW);
        let _ = trusted.decode(&framed, NOW);
    }

    #[test]
    fn mutated_frames_never_panic(
        (_, frame) in signed_frame(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut frame = frame;
        for (at, byte) in edits {
            let at = at.index(frame.len());
            frame[at] = byte;
        }
        let _ = Decoder::new(Some(secret()), Limits::default()).decode(&frame, NOW);
        let _ = Decoder::new(None, Limits::default()).decode(&frame, NOW);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// No single changed byte yields a different accepted message. A change may leave the
    /// authenticated content intact (msgpack can spell one value several ways, e.g. an int16
    /// marker for a uint16 value, and the MAC covers values, not spellings); such a frame is
    /// then the same frame again, and a receiver that saw the original refuses it as a replay.
    #[test]
    fn flipping_any_byte_of_a_signed_frame_is_refused(
        (message, frame) in signed_frame(),
        mask in 1u8..,
    ) {
        let mut seen = Decoder::new(Some(secret()), Limits::default());
        let original = seen.decode(&frame, NOW).unwrap();
        prop_assert_eq!(&original.message, &message);
        for at in 0..frame.len() {
            let mut flipped = frame.clone();
            flipped[at] ^= mask;
            let accepted = seen.decode(&flipped, NOW).is_ok();
            prop_assert!(!accepted, "byte {} ^ {:#04x} accepted", at, mask);
            let mut fresh = Decoder::new(Some(secret()), Limits::default());
            if let Ok(envelope) = fresh.decode(&flipped, NOW) {
                let changed = format!("byte {at} ^ {mask:#04x} changed the content");
                prop_assert_eq!(&envelope, &original, "{}", changed);
            }
        }
    }

    #[test]
    fn truncation_anywhere_is_refused((_, frame) in signed_frame()) {
        for secret in [None, Some(secret())] {
            let mut decoder = Decoder::new(secret, Limits::default());
            for len in 0..frame.len() {
                let err = decoder.decode(&frame[..len], NOW).unwrap_err();
                prop_assert_eq!(err.code(), "truncated");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_replayed_frame_is_refused((_, frame) in signed_frame(), later in 0u64..30_000) {
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        prop_assert!(decoder.decode(&frame, NOW).is_ok());
        let err = decoder.decode(&frame, NOW + later).unwrap_err();
        prop_assert!(matches!(err, ProtocolError::Replayed { seq: 1, .. }), "{}", err);
    }

    /// Two encoders with the same sender name interleave arbitrarily (and reorder within the
    /// replay window); each frame is accepted exactly once, whatever the other session did.
    #[test]
    fn sessions_are_independent(
        message in message(),
        order in proptest::collection::vec(any::<bool>(), 1..40),
        swap in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let a = Encoder::new("p-agent-0", Some(secret()));
        let b = Encoder::new("p-agent-0", Some(secret()));
        let mut frames: Vec<(u64, Vec<u8>)> = order
            .iter()
            .map(|&from_a| {
                let encoder = if from_a { &a } else { &b };
                (encoder.session(), encoder.encode(&message, NOW))
            })
            .collect();
        for pair in swap.chunks(2) {
            if let [i, j] = pair {
                let (i, j) = (i.index(frames.len()), j.index(frames.len()));
                frames.swap(i, j);
            }
        }
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        for (session, frame) in &frames {
            let envelope = decoder.decode(frame, NOW).unwrap();
            prop_assert_eq!(envelope.session, *session);
        }
        for (_, frame) in &frames {
            prop_assert_eq!(decoder.decode(frame, NOW).unwrap_err().code(), "replayed");
        }
        let sessions = usize::from(order.contains(&true)) + usize::from(order.contains(&false));
        prop_assert_eq!(decoder.tracked_sessions(), sessions);
    }

    #[test]
    fn oversized_prefixes_are_refused_before_reading_on(
        max in 0usize..(1 << 20),
        excess in 1usize..(1 << 20),
    ) {
        let limits = Limits { max_frame_bytes: max, ..Limits::default() };
        let len = u32::try_from(max + excess).unwrap();
        let prefix = len.to_be_bytes();
        let oversized = ProtocolError::Oversized { len: max + excess, max };
        prop_assert_eq!(frame_len(&prefix, &limits), Err(oversized.clone()));
        // Only the prefix is present: refused for its size, not reported as truncated.
        prop_assert_eq!(Decoder::new(None, limits).decode(&prefix, NOW), Err(oversized));
    }
}

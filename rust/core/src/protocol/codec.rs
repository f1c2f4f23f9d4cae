//! Frames: the length prefix, the msgpack envelope, and the checks a frame passes before its body
//! is decoded.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};
// Plain std atomics, not `crate::sync`: these are counters whose only requirement is that every
// fetch_add returns a distinct value, which holds under any ordering; there is no interleaving
// with other memory for loom to explore.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::auth::{MacFields, Secret};
use super::error::ProtocolError;
use super::messages::{from_msgpack, Message};
use super::replay::ReplayGuard;
use super::{Limits, PROTOCOL_VERSION};

/// Bytes in the length prefix of a frame.
pub const PREFIX_LEN: usize = 4;

/// Envelope bytes besides the body and the sender name (keys, integers, the MAC), rounded up, so
/// that `encode` allocates once.
const ENVELOPE_OVERHEAD: usize = 128;

/// The envelope as written: field names and order are the wire format (docs/protocol.md).
#[derive(Serialize)]
struct EnvelopeOut<'a> {
    version: u16,
    kind: &'a str,
    sender: &'a str,
    session: u64,
    seq: u64,
    ts_ms: u64,
    #[serde(with = "serde_bytes")]
    body: &'a [u8],
    #[serde(with = "serde_bytes", skip_serializing_if = "Option::is_none")]
    mac: Option<&'a [u8]>,
}

/// The envelope as read. `version` is read wider than it is written so that any version number
/// a peer sends is reported as unsupported rather than malformed.
#[derive(Deserialize)]
struct EnvelopeIn {
    version: u64,
    kind: String,
    sender: String,
    session: u64,
    seq: u64,
    ts_ms: u64,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
    #[serde(default, with = "serde_bytes")]
    mac: Option<Vec<u8>>,
}

/// Just the version of an envelope that failed to decode: a newer peer may have changed the
/// rest, and "unsupported version" tells the operator more than "malformed".
#[derive(Deserialize)]
struct VersionProbe {
    version: u64,
}

/// A decoded, verified frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The sender's engine id or NIXL agent name, as the sender's [`Encoder`] was created with.
    pub sender: String,
    /// The sender [`Encoder`]'s session nonce.
    pub session: u64,
    /// The frame's sequence number within its session.
    pub seq: u64,
    /// The sender's clock when it encoded the frame, unix milliseconds.
    pub ts_ms: u64,
    /// The message.
    pub message: Message,
}

/// The current time in unix milliseconds, the clock `now_ms` arguments are read from.
///
/// A clock before 1970 reads as 0 (and then fails the skew check against any real peer).
pub fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// How many bytes the frame that starts with `prefix` needs in total, prefix included, so that a
/// stream reader knows how much to read before calling [`Decoder::decode`].
///
/// `Ok(None)` while fewer than [`PREFIX_LEN`] bytes are available.
///
/// # Errors
///
/// [`ProtocolError::Oversized`] when the announced length exceeds
/// [`Limits::max_frame_bytes`], before anything is allocated for it; the stream is then not a
/// kvpush/1 stream (or a hostile one) and should be closed.
pub fn frame_len(prefix: &[u8], limits: &Limits) -> Result<Option<usize>, ProtocolError> {
    let Some(len_bytes) = prefix.first_chunk::<PREFIX_LEN>() else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(*len_bytes);
    // u32 always fits usize on the 64-bit targets kvpush runs on; saturating keeps a 16-bit
    // target from wrapping rather than supporting it.
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > limits.max_frame_bytes {
        return Err(ProtocolError::Oversized { len, max: limits.max_frame_bytes });
    }
    Ok(Some(PREFIX_LEN + len))
}

/// Writes one sender's frames: numbers them, timestamps them and signs them.
///
/// One encoder is one *session*: a random 64-bit nonce plus a sequence number that starts at 1
/// and increases with every frame. Receivers refuse a (sender, session, seq) they have seen, so
/// create one encoder per sender and channel and keep it (not one per message), and do not share
/// one between channels whose frames can be reordered against each other by more than 64
/// frames (e.g. the TCP side channel and NIXL notifications).
///
/// `encode` takes `&self`, so one encoder may be shared between threads.
pub struct Encoder {
    sender: String,
    session: u64,
    next_seq: AtomicU64,
    secret: Option<Secret>,
}

impl Encoder {
    /// An encoder for `sender` (the engine id on the side channel, the NIXL agent name for
    /// notifications); frames are signed when `secret` is given.
    pub fn new(sender: impl Into<String>, secret: Option<Secret>) -> Self {
        Self {
            sender: sender.into(),
            session: fresh_session(),
            next_seq: AtomicU64::new(1),
            secret,
        }
    }

    /// The sender name frames carry.
    pub fn sender(&self) -> &str {
        &self.sender
    }

    /// This encoder's session nonce.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The whole frame for `msg`, length prefix included, stamped with `now_ms` (unix millis,
    /// normally [`unix_millis`]).
    ///
    /// Does not check `msg` against the receiver's limits; [`Message::validate`] does.
    pub fn encode(&self, msg: &Message, now_ms: u64) -> Vec<u8> {
        // Relaxed: only the uniqueness of each returned value matters (see the import).
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let body = msg.to_body();
        let kind = msg.kind();
        let mac = self.secret.as_ref().map(|secret| {
            secret.sign(&MacFields {
                version: PROTOCOL_VERSION,
                kind,
                sender: &self.sender,
                session: self.session,
                seq,
                ts_ms: now_ms,
                body: &body,
            })
        });
        let envelope = EnvelopeOut {
            version: PROTOCOL_VERSION,
            kind,
            sender: &self.sender,
            session: self.session,
            seq,
            ts_ms: now_ms,
            body: &body,
            mac: mac.as_ref().map(|mac| mac.as_slice()),
        };
        let mut frame =
            Vec::with_capacity(PREFIX_LEN + ENVELOPE_OVERHEAD + body.len() + self.sender.len());
        frame.extend_from_slice(&[0; PREFIX_LEN]);
        // As in `Message::to_body`: a Vec writer and plain fields cannot fail to serialize.
        rmp_serde::encode::write_named(&mut frame, &envelope)
            .expect("a kvpush envelope always serializes into a Vec");
        // An envelope over 4 GiB cannot be framed; a saturated prefix makes the receiver refuse
        // it (oversized, or trailing bytes) instead of misreading the stream.
        let len = u32::try_from(frame.len() - PREFIX_LEN).unwrap_or(u32::MAX);
        frame[..PREFIX_LEN].copy_from_slice(&len.to_be_bytes());
        frame
    }
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("sender", &self.sender)
            .field("session", &format_args!("{:#018x}", self.session))
            .field("next_seq", &self.next_seq.load(Ordering::Relaxed))
            .field("signed", &self.secret.is_some())
            .finish()
    }
}

/// A session nonce no other encoder in any process is likely to pick.
///
/// Needs uniqueness, not secrecy (the MAC, not the nonce, stops forgeries): std's `RandomState`
/// is seeded from the OS's randomness once per thread, and the counter, clock, process and
/// thread make each call's input distinct even where the seed repeats.
pub(crate) fn fresh_session() -> u64 {
    static CREATED: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    CREATED.fetch_add(1, Ordering::Relaxed).hash(&mut hasher);
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().hash(&mut hasher);
    std::process::id().hash(&mut hasher);
    std::thread::current().id().hash(&mut hasher);
    hasher.finish()
}

/// Reads frames: bounds, authenticates, refuses replays, then decodes the body.
///
/// With a secret, a frame is accepted only if it is signed with that secret, its timestamp is
/// within [`Limits::max_clock_skew`] of the receiver's clock, and its (sender, session, seq) was
/// not accepted before. Without one (trusted network mode) MACs are ignored and neither replays
/// nor clocks are checked: anyone who can reach the port can then send anything.
///
/// Holds per-session replay state, so one decoder should read all frames that arrive at one
/// receiver (or one decoder per channel whose senders are disjoint).
pub struct Decoder {
    secret: Option<Secret>,
    limits: Limits,
    replay: ReplayGuard,
}

impl Decoder {
    /// A decoder that requires frames signed with `secret` (or accepts any, without one).
    pub fn new(secret: Option<Secret>, limits: Limits) -> Self {
        let max_skew_ms = duration_millis(limits.max_clock_skew);
        Self { secret, replay: ReplayGuard::new(limits.max_sessions, max_skew_ms), limits }
    }

    /// The limits this decoder enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Number of sender sessions whose replay windows are held (0 without a secret).
    pub fn tracked_sessions(&self) -> usize {
        self.replay.tracked()
    }

    /// Decodes one whole frame (length prefix included, nothing after it), received at `now_ms`
    /// (unix millis, normally [`unix_millis`]).
    ///
    /// Never panics, and allocates at most a small multiple of the frame's size. A refused frame
    /// leaves the replay state unchanged, so its seq stays usable by a genuine frame.
    ///
    /// # Errors
    ///
    /// Checked in this order: [`Truncated`](ProtocolError::Truncated) /
    /// [`Oversized`](ProtocolError::Oversized) / [`Malformed`](ProtocolError::Malformed)
    /// framing; [`UnsupportedVersion`](ProtocolError::UnsupportedVersion); with a secret,
    /// [`Unauthenticated`](ProtocolError::Unauthenticated),
    /// [`BadSignature`](ProtocolError::BadSignature),
    /// [`ClockSkew`](ProtocolError::ClockSkew), [`Replayed`](ProtocolError::Replayed) or
    /// [`TooManySessions`](ProtocolError::TooManySessions); then
    /// [`UnknownKind`](ProtocolError::UnknownKind), [`Malformed`](ProtocolError::Malformed)
    /// body, [`Invalid`](ProtocolError::Invalid) fields.
    pub fn decode(&mut self, frame: &[u8], now_ms: u64) -> Result<Envelope, ProtocolError> {
        self.decode_checked(frame, now_ms, None)
    }

    /// [`decode`](Self::decode) without the replay window: the MAC and the clock are checked,
    /// the (sender, session, seq) is not. For NIXL notifications: each DONE is encoded when its
    /// WRITE is posted but arrives when the WRITE completes, so DONEs of many concurrent WRITEs
    /// arrive in any order (more than a window apart), and each names one transfer and epoch,
    /// which the receiver counts at most once: a replayed DONE can only be a stray.
    ///
    /// For the same reason a DONE is as old as its WRITE took: it may arrive up to `in_flight`
    /// (the sender's write horizon: how long after posting it may still deliver) plus
    /// [`Limits::max_clock_skew`] after its timestamp. Bounding it by the clock skew alone
    /// dropped the DONE of every WRITE slower than the skew (a paused host, a large KV over a
    /// slow link), and its receive then waited out its whole TTL and failed.
    pub fn decode_unordered(
        &mut self,
        frame: &[u8],
        now_ms: u64,
        in_flight: Duration,
    ) -> Result<Envelope, ProtocolError> {
        self.decode_checked(frame, now_ms, Some(duration_millis(in_flight)))
    }

    /// `in_flight`: None for an in-order frame (replay window, clock within the skew); for a
    /// notification, how much older than the skew it may be (see `decode_unordered`).
    fn decode_checked(
        &mut self,
        frame: &[u8],
        now_ms: u64,
        in_flight: Option<u64>,
    ) -> Result<Envelope, ProtocolError> {
        let in_order = in_flight.is_none();
        let Some(needed) = frame_len(frame, &self.limits)? else {
            return Err(ProtocolError::Truncated { needed: PREFIX_LEN, got: frame.len() });
        };
        if frame.len() < needed {
            return Err(ProtocolError::Truncated { needed, got: frame.len() });
        }
        if frame.len() > needed {
            return Err(ProtocolError::malformed(format_args!(
                "{} bytes after the {needed}-byte frame; pass one frame per call",
                frame.len() - needed
            )));
        }
        let envelope = parse_envelope(&frame[PREFIX_LEN..])?;
        for (field, value) in
            [("envelope.kind", &envelope.kind), ("envelope.sender", &envelope.sender)]
        {
            if value.len() > self.limits.max_string_bytes {
                return Err(ProtocolError::Invalid {
                    field,
                    reason: format!(
                        "{} bytes exceed max_string_bytes = {}",
                        value.len(),
                        self.limits.max_string_bytes
                    ),
                });
            }
        }

        if let Some(secret) = &self.secret {
            let Some(mac) = &envelope.mac else {
                return Err(ProtocolError::Unauthenticated);
            };
            let fields = MacFields {
                version: PROTOCOL_VERSION,
                kind: &envelope.kind,
                sender: &envelope.sender,
                session: envelope.session,
                seq: envelope.seq,
                ts_ms: envelope.ts_ms,
                body: &envelope.body,
            };
            secret.verify(&fields, mac)?;
            self.check_clock(envelope.ts_ms, now_ms, in_flight.unwrap_or(0))?;
            if in_order {
                self.replay.check(&envelope.sender, envelope.session, envelope.seq, now_ms)?;
            }
        }

        let message = Message::from_body(&envelope.kind, &envelope.body)?;
        message.validate(&self.limits)?;

        if self.secret.is_some() && in_order {
            self.replay.accept(&envelope.sender, envelope.session, envelope.seq, envelope.ts_ms);
        }
        Ok(Envelope {
            sender: envelope.sender,
            session: envelope.session,
            seq: envelope.seq,
            ts_ms: envelope.ts_ms,
            message,
        })
    }

    /// A timestamp at most the skew ahead of `now_ms`, and at most the skew plus `older_ms`
    /// behind it.
    fn check_clock(&self, ts_ms: u64, now_ms: u64, older_ms: u64) -> Result<(), ProtocolError> {
        let max_ms = duration_millis(self.limits.max_clock_skew);
        let skew = i128::from(ts_ms) - i128::from(now_ms);
        let bound = if skew < 0 { max_ms.saturating_add(older_ms) } else { max_ms };
        if skew.unsigned_abs() > u128::from(bound) {
            let skew_ms = i64::try_from(skew).unwrap_or(if skew < 0 { i64::MIN } else { i64::MAX });
            return Err(ProtocolError::ClockSkew { skew_ms, max_ms });
        }
        Ok(())
    }
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("authenticated", &self.secret.is_some())
            .field("limits", &self.limits)
            .field("tracked_sessions", &self.replay.tracked())
            .finish()
    }
}

/// The envelope map, with the version checked.
fn parse_envelope(bytes: &[u8]) -> Result<EnvelopeIn, ProtocolError> {
    let envelope = match from_msgpack::<EnvelopeIn>(bytes) {
        Ok(envelope) => envelope,
        Err(malformed) => {
            return Err(match from_msgpack::<VersionProbe>(bytes) {
                Ok(probe) if probe.version != u64::from(PROTOCOL_VERSION) => {
                    unsupported(probe.version)
                }
                _ => malformed,
            })
        }
    };
    if envelope.version != u64::from(PROTOCOL_VERSION) {
        return Err(unsupported(envelope.version));
    }
    Ok(envelope)
}

fn unsupported(got: u64) -> ProtocolError {
    ProtocolError::UnsupportedVersion { got, supported: PROTOCOL_VERSION }
}

fn duration_millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvLayout, Region, TokenOrder};
    use crate::protocol::messages::{
        Attach, BlockGroup, Cancel, CancelAck, Done, ErrorReply, Fail, FailReason, Heartbeat,
        Hello, Register,
    };
    use crate::protocol::MAX_REPLY_DETAIL_BYTES;

    const NOW: u64 = 1_700_000_000_000;

    fn secret() -> Secret {
        Secret::from_bytes(b"a shared secret of 32 bytes ....").unwrap()
    }

    fn signed_pair() -> (Encoder, Decoder) {
        (Encoder::new("p-agent-0", Some(secret())), Decoder::new(Some(secret()), Limits::default()))
    }

    fn register(block_ids: Vec<u32>) -> Register {
        Register {
            transfer_key: "xfer-1".into(),
            request_id: "cmpl-xfer-1-0-1a2b3c4d".into(),
            epoch: 1,
            engine_id: "decode-0".into(),
            address: "10.0.0.2:5600".into(),
            tp_rank: 0,
            tp_size: 2,
            groups: vec![BlockGroup { first_token: 32, block_ids }],
            num_tokens: 100,
            ttl_ms: 30_000,
            fanout: 1,
            nonce: 0x1234_5678_9abc_def0,
        }
    }

    fn done() -> Done {
        Done {
            transfer_key: "0b9e7a52-8c1f-4f7e-9a43-5d1c2e3f4a5b".into(),
            request_id: "chatcmpl-0b9e7a52-8c1f-4f7e-9a43-5d1c2e3f4a5b-1a2b3c4d".into(),
            epoch: 3,
            tp_rank: 7,
            tp_size: 8,
            bytes: 1 << 33,
            runs: 4096,
            nonce: 0xfedc_ba98_7654_3210,
        }
    }

    fn samples() -> Vec<Message> {
        let layout = KvLayout {
            regions: vec![Region {
                base: 0x7f00_0000_0000,
                block_stride: 65536,
                num_blocks: 1000,
                group: 0,
            }],
            block_tokens: 16,
            kernel_block_tokens: 16,
            heads: 8,
            head_bytes: 256,
            token_order: TokenOrder::Hnd,
            tp_rank: 1,
            tp_size: 2,
        };
        vec![
            Message::Hello(Hello {
                engine_id: "prefill-0".into(),
                tp_rank: 1,
                tp_size: 2,
                pp_rank: 0,
                pp_size: 1,
                agent_name: "prefill-0-tp1".into(),
                agent_metadata: vec![0, 1, 2, 255],
                layout,
                compatibility: "sha256:abcd".into(),
                versions: vec![1],
                memory: crate::transport::MemorySpace::DRAM,
                nonce: 7,
                echo: 8,
                write_horizon_ms: 16_000,
                delivery_bound_ms: 0,
            }),
            Message::Register(register(vec![3, 1, 4, 1 << 31])),
            Message::Done(done()),
            Message::Fail(Fail {
                transfer_key: "xfer-1".into(),
                request_id: "r".into(),
                epoch: 2,
                reason: FailReason::WriteError,
                detail: "NIXL_ERR_BACKEND".into(),
            }),
            Message::Cancel(Cancel {
                transfer_key: "xfer-1".into(),
                request_id: "r".into(),
                epoch: 2,
            }),
            Message::CancelAck(CancelAck {
                transfer_key: "xfer-1".into(),
                request_id: "r".into(),
                epoch: 2,
                wrote: true,
                delivered: true,
            }),
            Message::Heartbeat(Heartbeat {
                engine_id: "decode-0".into(),
                seq: 9,
                pending: 3,
                clock_ms: 1_234,
                echo_ms: 1_200,
            }),
            Message::Error(ErrorReply { code: "replayed".into(), detail: "again".into() }),
            Message::Attach(Attach { echo: 8, agent_metadata: vec![9; 40] }),
        ]
    }

    /// A frame with arbitrary envelope fields, signed with `secret` if given.
    fn custom_frame(
        version: u16,
        kind: &str,
        body: &[u8],
        ts_ms: u64,
        secret: Option<&Secret>,
    ) -> Vec<u8> {
        let fields = MacFields { version, kind, sender: "forger", session: 5, seq: 1, ts_ms, body };
        let mac = secret.map(|secret| secret.sign(&fields));
        let envelope = EnvelopeOut {
            version,
            kind,
            sender: "forger",
            session: 5,
            seq: 1,
            ts_ms,
            body,
            mac: mac.as_ref().map(|mac| mac.as_slice()),
        };
        prefixed(rmp_serde::to_vec_named(&envelope).unwrap())
    }

    fn prefixed(envelope: Vec<u8>) -> Vec<u8> {
        let mut frame = u32::try_from(envelope.len()).unwrap().to_be_bytes().to_vec();
        frame.extend(envelope);
        frame
    }

    #[test]
    fn every_kind_round_trips_signed_and_unsigned() {
        for secret in [None, Some(secret())] {
            let encoder = Encoder::new("p-agent-0", secret.clone());
            let mut decoder = Decoder::new(secret, Limits::default());
            for message in samples() {
                let frame = encoder.encode(&message, NOW);
                let envelope = decoder.decode(&frame, NOW).unwrap();
                assert_eq!(envelope.message, message);
                assert_eq!(envelope.sender, "p-agent-0");
                assert_eq!(envelope.session, encoder.session());
                assert_eq!(envelope.ts_ms, NOW);
            }
        }
        let kinds: Vec<_> = samples().iter().map(Message::kind).collect();
        assert_eq!(kinds, Message::KINDS);
    }

    #[test]
    fn notifications_decode_in_any_order_but_stay_authenticated() {
        let (encoder, mut decoder) = signed_pair();
        let frames: Vec<Vec<u8>> =
            (0..200).map(|_| encoder.encode(&Message::Done(done()), NOW)).collect();
        // The newest first, then ones far below any replay window: all accepted unordered.
        for frame in frames.iter().rev() {
            assert!(decoder.decode_unordered(frame, NOW, Duration::ZERO).is_ok());
        }
        // In order, the same reordering is refused as replays.
        let (encoder, mut ordered) = signed_pair();
        let frames: Vec<Vec<u8>> =
            (0..100).map(|_| encoder.encode(&Message::Done(done()), NOW)).collect();
        ordered.decode(&frames[99], NOW).unwrap();
        assert!(matches!(ordered.decode(&frames[0], NOW), Err(ProtocolError::Replayed { .. })));
        // Forged or stale notifications are still refused.
        let forged = Encoder::new("p-agent-0", Some(Secret::from_bytes(&[9; 32]).unwrap()));
        let frame = forged.encode(&Message::Done(done()), NOW);
        assert!(matches!(
            decoder.decode_unordered(&frame, NOW, Duration::ZERO),
            Err(ProtocolError::BadSignature)
        ));
        let stale = encoder.encode(&Message::Done(done()), NOW - 3_600_000);
        assert!(matches!(
            decoder.decode_unordered(&stale, NOW, Duration::from_secs(120)),
            Err(ProtocolError::ClockSkew { .. })
        ));
    }

    #[test]
    fn a_done_may_be_as_old_as_its_write_took_but_never_from_the_future() {
        // Encoded when the WRITE was posted, decoded when it completed 100 s later: past the
        // 30 s skew, within the sender's 120 s write horizon plus the skew.
        let (encoder, mut decoder) = signed_pair();
        let late = encoder.encode(&Message::Done(done()), NOW - 100_000);
        assert!(matches!(
            decoder.decode_unordered(&late, NOW, Duration::ZERO),
            Err(ProtocolError::ClockSkew { .. })
        ));
        assert!(decoder.decode_unordered(&late, NOW, Duration::from_secs(120)).is_ok());
        let too_late = encoder.encode(&Message::Done(done()), NOW - 151_000);
        assert!(matches!(
            decoder.decode_unordered(&too_late, NOW, Duration::from_secs(120)),
            Err(ProtocolError::ClockSkew { .. })
        ));
        // The horizon widens only the past: a frame from 31 s ahead is refused as before.
        let ahead = encoder.encode(&Message::Done(done()), NOW + 31_000);
        assert!(matches!(
            decoder.decode_unordered(&ahead, NOW, Duration::from_secs(120)),
            Err(ProtocolError::ClockSkew { .. })
        ));
        // In-order frames (control messages on the side channel) keep the plain skew.
        let (encoder, mut ordered) = signed_pair();
        let old = encoder.encode(&Message::Done(done()), NOW - 31_000);
        assert!(matches!(ordered.decode(&old, NOW), Err(ProtocolError::ClockSkew { .. })));
    }

    #[test]
    fn seqs_start_at_one_and_increase() {
        let (encoder, mut decoder) = signed_pair();
        let message = Message::Done(done());
        let seqs: Vec<_> = (0..3)
            .map(|_| decoder.decode(&encoder.encode(&message, NOW), NOW).unwrap().seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
    }

    #[test]
    fn seqs_are_unique_across_threads() {
        let encoder = Encoder::new("p", None);
        let mut decoder = Decoder::new(None, Limits::default());
        let message = Message::Done(done());
        let frames: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        (0..50).map(|_| encoder.encode(&message, NOW)).collect::<Vec<_>>()
                    })
                })
                .collect();
            workers.into_iter().flat_map(|worker| worker.join().unwrap()).collect()
        });
        let mut seqs: Vec<u64> =
            frames.iter().map(|f| decoder.decode(f, NOW).unwrap().seq).collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=200).collect::<Vec<_>>());
    }

    #[test]
    fn encoders_pick_distinct_sessions() {
        let sessions: std::collections::HashSet<u64> =
            (0..1000).map(|_| Encoder::new("p", None).session()).collect();
        assert_eq!(sessions.len(), 1000);
    }

    #[test]
    fn done_stays_small_enough_for_a_nixl_notification() {
        let (encoder, _) = signed_pair();
        let frame = encoder.encode(&Message::Done(done()), NOW);
        assert!(frame.len() < 320, "signed DONE with uuid-sized ids is {} bytes", frame.len());
    }

    #[test]
    fn unsigned_frames_are_refused_when_a_secret_is_set() {
        let frame = Encoder::new("p", None).encode(&Message::Done(done()), NOW);
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        assert_eq!(decoder.decode(&frame, NOW), Err(ProtocolError::Unauthenticated));
    }

    #[test]
    fn another_secret_is_a_bad_signature() {
        let other = Secret::from_bytes(b"a different secret, 32 bytes ...").unwrap();
        let frame = Encoder::new("p", Some(other)).encode(&Message::Done(done()), NOW);
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        assert_eq!(decoder.decode(&frame, NOW), Err(ProtocolError::BadSignature));
    }

    #[test]
    fn a_forged_body_is_a_bad_signature() {
        let (encoder, mut decoder) = signed_pair();
        let mut frame = encoder.encode(&Message::Done(done()), NOW);
        // Splice in a well-formed body of the same length that claims another run count.
        let original = Message::Done(done()).to_body();
        let forged = Message::Done(Done { runs: 4097, ..done() }).to_body();
        assert_eq!(forged.len(), original.len());
        let at = frame.windows(original.len()).position(|w| w == original.as_slice()).unwrap();
        frame[at..at + forged.len()].copy_from_slice(&forged);
        assert_eq!(decoder.decode(&frame, NOW), Err(ProtocolError::BadSignature));
    }

    #[test]
    fn a_replayed_frame_is_refused_but_a_fresh_one_is_not() {
        let (encoder, mut decoder) = signed_pair();
        let message =
            Message::Cancel(Cancel { transfer_key: "k".into(), request_id: "r".into(), epoch: 1 });
        let frame = encoder.encode(&message, NOW);
        assert!(decoder.decode(&frame, NOW).is_ok());
        let err = decoder.decode(&frame, NOW + 1).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Replayed {
                sender: "p-agent-0".into(),
                session: encoder.session(),
                seq: 1
            }
        );
        assert_eq!(err.code(), "replayed");
        assert!(decoder.decode(&encoder.encode(&message, NOW), NOW).is_ok());
    }

    #[test]
    fn a_refused_body_does_not_burn_its_seq() {
        let (encoder, mut decoder) = signed_pair();
        let strict = Limits { max_block_ids: 2, ..Limits::default() };
        let mut strict_decoder = Decoder::new(Some(secret()), strict);
        let frame = encoder.encode(&Message::Register(register(vec![1, 2, 3])), NOW);
        assert_eq!(strict_decoder.decode(&frame, NOW).unwrap_err().code(), "invalid");
        assert_eq!(strict_decoder.tracked_sessions(), 0);
        assert!(decoder.decode(&frame, NOW).is_ok());
    }

    #[test]
    fn clock_skew_is_bounded_both_ways() {
        let (encoder, mut decoder) = signed_pair();
        let message = Message::Done(done());
        let skew = 30_000;
        assert!(decoder.decode(&encoder.encode(&message, NOW - skew), NOW).is_ok(), "boundary");
        assert!(decoder.decode(&encoder.encode(&message, NOW + skew), NOW).is_ok(), "boundary");
        assert_eq!(
            decoder.decode(&encoder.encode(&message, NOW - skew - 1), NOW),
            Err(ProtocolError::ClockSkew { skew_ms: -30_001, max_ms: 30_000 })
        );
        assert_eq!(
            decoder.decode(&encoder.encode(&message, NOW + skew + 1), NOW),
            Err(ProtocolError::ClockSkew { skew_ms: 30_001, max_ms: 30_000 })
        );
        let err = decoder.decode(&encoder.encode(&message, u64::MAX), 0).unwrap_err();
        assert_eq!(err, ProtocolError::ClockSkew { skew_ms: i64::MAX, max_ms: 30_000 });
    }

    #[test]
    fn trusted_mode_checks_neither_mac_nor_replay_nor_clock() {
        let (encoder, _) = signed_pair();
        let mut decoder = Decoder::new(None, Limits::default());
        let frame = encoder.encode(&Message::Done(done()), 0);
        assert!(decoder.decode(&frame, NOW).is_ok(), "signed frame, ancient timestamp");
        assert!(decoder.decode(&frame, NOW).is_ok(), "same frame again");
        assert_eq!(decoder.tracked_sessions(), 0);
    }

    #[test]
    fn session_table_is_bounded_and_forgotten_sessions_stay_dead() {
        let limits = Limits { max_sessions: 2, ..Limits::default() };
        let mut decoder = Decoder::new(Some(secret()), limits);
        let message = Message::Done(done());
        let old = Encoder::new("p0", Some(secret()));
        let old_frame = old.encode(&message, NOW);
        assert!(decoder.decode(&old_frame, NOW).is_ok());
        assert!(decoder
            .decode(&Encoder::new("p1", Some(secret())).encode(&message, NOW), NOW)
            .is_ok());

        let third = Encoder::new("p2", Some(secret()));
        let err = decoder.decode(&third.encode(&message, NOW + 1), NOW + 1).unwrap_err();
        assert_eq!(err, ProtocolError::TooManySessions { max: 2 });

        // Once both sessions' newest frames are older than the skew, they make room...
        let later = NOW + 30_001;
        assert!(decoder.decode(&third.encode(&message, later), later).is_ok());
        assert_eq!(decoder.tracked_sessions(), 1);
        // ...and a frame of a forgotten session is stopped by the clock check instead.
        assert_eq!(decoder.decode(&old_frame, later).unwrap_err().code(), "clock_skew");
    }

    #[test]
    fn frame_len_streams_and_refuses_oversize_early() {
        let limits = Limits::default();
        assert_eq!(frame_len(&[], &limits), Ok(None));
        assert_eq!(frame_len(&[0, 0, 1], &limits), Ok(None));
        assert_eq!(frame_len(&[0, 0, 1, 0, 0xff], &limits), Ok(Some(4 + 256)));
        assert_eq!(
            frame_len(&[0xff; 4], &limits),
            Err(ProtocolError::Oversized { len: u32::MAX as usize, max: 16 << 20 })
        );
        let mut decoder = Decoder::new(None, limits);
        assert_eq!(decoder.decode(&[0xff; 4], NOW).unwrap_err().code(), "oversized");
    }

    #[test]
    fn truncated_and_overlong_frames_are_refused() {
        let frame = Encoder::new("p", None).encode(&Message::Done(done()), NOW);
        let mut decoder = Decoder::new(None, Limits::default());
        assert_eq!(
            decoder.decode(&frame[..2], NOW),
            Err(ProtocolError::Truncated { needed: 4, got: 2 })
        );
        assert_eq!(
            decoder.decode(&frame[..frame.len() - 1], NOW),
            Err(ProtocolError::Truncated { needed: frame.len(), got: frame.len() - 1 })
        );
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        assert_eq!(decoder.decode(&two, NOW).unwrap_err().code(), "malformed");
    }

    #[test]
    fn garbage_inside_a_frame_is_malformed() {
        let mut decoder = Decoder::new(None, Limits::default());
        for envelope in [vec![], vec![0xc1], vec![0x80], b"\x93\x01\x02\x03".to_vec()] {
            let err = decoder.decode(&prefixed(envelope.clone()), NOW).unwrap_err();
            assert_eq!(err.code(), "malformed", "{envelope:?}: {err}");
        }
        // A valid envelope followed by junk inside the announced length.
        let mut frame = Encoder::new("p", None).encode(&Message::Done(done()), NOW);
        frame.push(0xc0);
        let len = u32::try_from(frame.len() - 4).unwrap();
        frame[..4].copy_from_slice(&len.to_be_bytes());
        assert_eq!(decoder.decode(&frame, NOW).unwrap_err().code(), "malformed");
    }

    #[test]
    fn duplicate_envelope_keys_are_malformed() {
        // Append a second "seq" to a valid envelope map: which one would count is ambiguous.
        let frame = Encoder::new("p", None).encode(&Message::Done(done()), NOW);
        let mut envelope = frame[PREFIX_LEN..].to_vec();
        assert_eq!(envelope[0], 0x87, "a 7-entry fixmap (no mac)");
        envelope[0] = 0x88;
        envelope.extend_from_slice(&[0xa3, b's', b'e', b'q', 0x05]);
        let mut decoder = Decoder::new(None, Limits::default());
        let err = decoder.decode(&prefixed(envelope), NOW).unwrap_err();
        assert_eq!(err.code(), "malformed", "{err}");
    }

    #[test]
    fn other_versions_are_unsupported_even_if_their_shape_changed() {
        let body = Message::Done(done()).to_body();
        let mut decoder = Decoder::new(None, Limits::default());
        let frame = custom_frame(2, "done", &body, NOW, None);
        assert_eq!(
            decoder.decode(&frame, NOW),
            Err(ProtocolError::UnsupportedVersion { got: 2, supported: 1 })
        );
        #[derive(Serialize)]
        struct FutureEnvelope {
            version: u64,
            payload: Vec<u8>,
        }
        let future =
            rmp_serde::to_vec_named(&FutureEnvelope { version: 70_000, payload: vec![1] }).unwrap();
        assert_eq!(
            decoder.decode(&prefixed(future), NOW),
            Err(ProtocolError::UnsupportedVersion { got: 70_000, supported: 1 })
        );
    }

    #[test]
    fn unknown_kinds_are_refused_after_authentication() {
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        let frame = custom_frame(1, "teleport", b"\x80", NOW, Some(&secret()));
        assert_eq!(
            decoder.decode(&frame, NOW),
            Err(ProtocolError::UnknownKind { kind: "teleport".into() })
        );
        let unsigned = custom_frame(1, "teleport", b"\x80", NOW, None);
        assert_eq!(decoder.decode(&unsigned, NOW), Err(ProtocolError::Unauthenticated));
    }

    #[test]
    fn unknown_fields_are_ignored_and_field_order_is_free() {
        // What a newer (or Python) peer might send: extra fields, another field order.
        #[derive(Serialize)]
        struct NewerDone<'a> {
            runs: u32,
            priority: &'a str,
            bytes: u64,
            tp_size: u32,
            tp_rank: u32,
            epoch: u64,
            request_id: &'a str,
            nonce: u64,
            transfer_key: &'a str,
        }
        let d = done();
        let body = rmp_serde::to_vec_named(&NewerDone {
            nonce: d.nonce,
            runs: d.runs,
            priority: "high",
            bytes: d.bytes,
            tp_size: d.tp_size,
            tp_rank: d.tp_rank,
            epoch: d.epoch,
            request_id: &d.request_id,
            transfer_key: &d.transfer_key,
        })
        .unwrap();
        #[derive(Serialize)]
        struct NewerEnvelope<'a> {
            #[serde(with = "serde_bytes")]
            mac: &'a [u8],
            trace_id: u64,
            #[serde(with = "serde_bytes")]
            body: &'a [u8],
            ts_ms: u64,
            seq: u64,
            session: u64,
            sender: &'a str,
            kind: &'a str,
            version: u16,
        }
        let fields = MacFields {
            version: 1,
            kind: "done",
            sender: "py",
            session: 9,
            seq: 4,
            ts_ms: NOW,
            body: &body,
        };
        let mac = secret().sign(&fields);
        let envelope = NewerEnvelope {
            mac: &mac,
            trace_id: 77,
            body: &body,
            ts_ms: NOW,
            seq: 4,
            session: 9,
            sender: "py",
            kind: "done",
            version: 1,
        };
        let frame = prefixed(rmp_serde::to_vec_named(&envelope).unwrap());
        let mut decoder = Decoder::new(Some(secret()), Limits::default());
        let envelope = decoder.decode(&frame, NOW).unwrap();
        assert_eq!(envelope.message, Message::Done(d));
        assert_eq!((envelope.sender.as_str(), envelope.session, envelope.seq), ("py", 9, 4));
    }

    #[test]
    fn a_register_or_done_without_a_nonce_decodes_with_none() {
        // What a peer from before the nonce sends: the same maps without the field.
        #[derive(Serialize)]
        struct OldDone<'a> {
            transfer_key: &'a str,
            request_id: &'a str,
            epoch: u64,
            tp_rank: u32,
            tp_size: u32,
            bytes: u64,
            runs: u32,
        }
        #[derive(Serialize)]
        struct OldRegister<'a> {
            transfer_key: &'a str,
            request_id: &'a str,
            epoch: u64,
            engine_id: &'a str,
            address: &'a str,
            tp_rank: u32,
            tp_size: u32,
            groups: &'a [BlockGroup],
            num_tokens: u64,
            ttl_ms: u64,
        }
        let d = done();
        let done_body = rmp_serde::to_vec_named(&OldDone {
            transfer_key: &d.transfer_key,
            request_id: &d.request_id,
            epoch: d.epoch,
            tp_rank: d.tp_rank,
            tp_size: d.tp_size,
            bytes: d.bytes,
            runs: d.runs,
        })
        .unwrap();
        let r = register(vec![1, 2]);
        let register_body = rmp_serde::to_vec_named(&OldRegister {
            transfer_key: &r.transfer_key,
            request_id: &r.request_id,
            epoch: r.epoch,
            engine_id: &r.engine_id,
            address: &r.address,
            tp_rank: r.tp_rank,
            tp_size: r.tp_size,
            groups: &r.groups,
            num_tokens: r.num_tokens,
            ttl_ms: r.ttl_ms,
        })
        .unwrap();
        let mut decoder = Decoder::new(None, Limits::default());
        let decoded = decoder.decode(&custom_frame(1, "done", &done_body, NOW, None), NOW);
        assert_eq!(decoded.unwrap().message, Message::Done(Done { nonce: 0, ..d }));
        let decoded = decoder.decode(&custom_frame(1, "register", &register_body, NOW, None), NOW);
        assert_eq!(decoded.unwrap().message, Message::Register(Register { nonce: 0, ..r }));
    }

    #[test]
    fn unknown_fail_reasons_still_fail_the_transfer() {
        #[derive(Serialize)]
        struct WireFail<'a> {
            transfer_key: &'a str,
            request_id: &'a str,
            epoch: u64,
            reason: &'a str,
            detail: &'a str,
        }
        let body = rmp_serde::to_vec_named(&WireFail {
            transfer_key: "k",
            request_id: "r",
            epoch: 1,
            reason: "gpu_on_fire",
            detail: "",
        })
        .unwrap();
        let mut decoder = Decoder::new(None, Limits::default());
        let envelope = decoder.decode(&custom_frame(1, "fail", &body, NOW, None), NOW).unwrap();
        let Message::Fail(fail) = envelope.message else { panic!("{envelope:?}") };
        assert_eq!(fail.reason, FailReason::Unknown("gpu_on_fire".into()));
        for known in FailReason::KNOWN {
            assert_eq!(FailReason::from_wire(known.as_str()), known);
        }
        assert_eq!(FailReason::ShuttingDown.as_str(), "shutting_down");
    }

    #[test]
    fn limits_are_enforced_after_decoding() {
        let encoder = Encoder::new("p", None);
        let limits = Limits { max_block_ids: 4, max_string_bytes: 16, ..Limits::default() };
        let mut decoder = Decoder::new(None, limits);
        let mut decode = |message: Message| decoder.decode(&encoder.encode(&message, NOW), NOW);

        let short = |mut r: Register| {
            r.transfer_key = "k".into();
            r.request_id = "r".into();
            r.address = "h:1".into();
            r.engine_id = "d".into();
            r
        };
        assert!(decode(Message::Register(short(register(vec![1, 2, 3])))).is_ok());
        let err = decode(Message::Register(short(register(vec![1, 2, 3, 4])))).unwrap_err();
        assert!(matches!(err, ProtocolError::Invalid { field: "register.groups", .. }), "{err}");
        let err = decode(Message::Register(register(vec![1]))).unwrap_err();
        assert!(
            matches!(err, ProtocolError::Invalid { field: "register.request_id", .. }),
            "{err}"
        );
        let err = decode(Message::Register(Register { tp_rank: 2, ..short(register(vec![])) }))
            .unwrap_err();
        assert!(matches!(err, ProtocolError::Invalid { field: "register.tp_rank", .. }), "{err}");
        let err = decode(Message::Cancel(Cancel {
            transfer_key: String::new(),
            request_id: "r".into(),
            epoch: 0,
        }))
        .unwrap_err();
        assert!(
            matches!(err, ProtocolError::Invalid { field: "cancel.transfer_key", .. }),
            "{err}"
        );
        let err = decode(Message::Done(Done { tp_size: 0, tp_rank: 0, ..done() })).unwrap_err();
        assert!(matches!(err, ProtocolError::Invalid { .. }), "{err}");

        let mut decoder = Decoder::new(None, limits);
        let long_sender = Encoder::new("a sender name longer than sixteen bytes", None);
        let frame = long_sender.encode(
            &Message::Heartbeat(Heartbeat {
                engine_id: "d".into(),
                seq: 0,
                pending: 0,
                clock_ms: 0,
                echo_ms: 0,
            }),
            NOW,
        );
        let err = decoder.decode(&frame, NOW).unwrap_err();
        assert!(matches!(err, ProtocolError::Invalid { field: "envelope.sender", .. }), "{err}");
    }

    #[test]
    fn deeply_nested_unknown_fields_are_refused_not_recursed() {
        // {"transfer_key": .., "junk": [[[[...]]]]} nested 100_000 deep: without a depth cap the
        // ignored field would recurse once per level.
        let mut body = vec![0x82, 0xa4];
        body.extend_from_slice(b"junk");
        body.extend(std::iter::repeat_n(0x91, 100_000));
        body.push(0xc0);
        body.push(0xa1);
        body.push(b'x');
        body.push(0x01);
        let mut decoder = Decoder::new(None, Limits::default());
        let err = decoder.decode(&custom_frame(1, "done", &body, NOW, None), NOW).unwrap_err();
        assert_eq!(err.code(), "malformed", "{err}");
    }

    #[test]
    fn refusals_become_valid_error_replies() {
        let long = ProtocolError::UnknownKind { kind: "é".repeat(4096) };
        let Message::Error(reply) = long.to_reply() else { panic!() };
        assert_eq!(reply.code, "unknown_kind");
        assert!(reply.detail.len() <= MAX_REPLY_DETAIL_BYTES);
        let encoder = Encoder::new("p", None);
        let mut decoder = Decoder::new(None, Limits::default());
        let envelope =
            decoder.decode(&encoder.encode(&Message::Error(reply.clone()), NOW), NOW).unwrap();
        assert_eq!(envelope.message, Message::Error(reply));
    }

    #[test]
    fn error_codes_are_distinct_snake_case() {
        let errors = [
            ProtocolError::Oversized { len: 1, max: 0 },
            ProtocolError::Truncated { needed: 1, got: 0 },
            ProtocolError::malformed("x"),
            ProtocolError::UnsupportedVersion { got: 2, supported: 1 },
            ProtocolError::UnknownKind { kind: "x".into() },
            ProtocolError::Unauthenticated,
            ProtocolError::BadSignature,
            ProtocolError::Replayed { sender: "p".into(), session: 1, seq: 1 },
            ProtocolError::ClockSkew { skew_ms: 1, max_ms: 0 },
            ProtocolError::Invalid { field: "f", reason: "r".into() },
            ProtocolError::WeakSecret { len: 1, min: 16 },
            ProtocolError::TooManySessions { max: 1 },
        ];
        let codes: std::collections::HashSet<_> = errors.iter().map(ProtocolError::code).collect();
        assert_eq!(codes.len(), errors.len());
        assert!(codes.iter().all(|c| c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let (encoder, decoder) = signed_pair();
        let shown = format!("{encoder:?} {decoder:?}");
        assert!(!shown.contains("shared secret"), "{shown}");
        assert!(shown.contains("p-agent-0"));
    }
}

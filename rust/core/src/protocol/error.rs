//! Why a frame was refused.

use super::messages::{ErrorReply, Message};

/// Longest `detail` [`ProtocolError::to_reply`] puts in a reply; well under the smallest sane
/// [`Limits::max_string_bytes`](super::Limits::max_string_bytes).
pub const MAX_REPLY_DETAIL_BYTES: usize = 1024;

/// Why a kvpush/1 frame could not be decoded or was refused.
///
/// Every variant has a stable snake_case [`code`](ProtocolError::code): receivers count refusals
/// by code and send it back in an [`ErrorReply`] (see [`ProtocolError::to_reply`]). The
/// `Display` text is for logs: it says what went wrong and what the operator can do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The length prefix announces more bytes than this receiver accepts.
    #[error(
        "frame of {len} bytes exceeds the limit of {max} bytes: the peer is not speaking kvpush/1 \
         on this port, or raise Limits::max_frame_bytes on the receiver"
    )]
    Oversized {
        /// Envelope length announced by the prefix.
        len: usize,
        /// [`Limits::max_frame_bytes`](super::Limits::max_frame_bytes).
        max: usize,
    },
    /// Fewer bytes than the length prefix announces (or than the prefix itself).
    #[error(
        "frame truncated: {needed} bytes needed, {got} present; pass whole frames \
         (frame_len says how many bytes the next one needs)"
    )]
    Truncated {
        /// Bytes the whole frame needs, prefix included.
        needed: usize,
        /// Bytes passed in.
        got: usize,
    },
    /// The bytes are not a well-formed kvpush/1 envelope or message body.
    #[error(
        "malformed frame: {reason}; the peer's encoder is broken or this is not kvpush traffic"
    )]
    Malformed {
        /// What was wrong, as the msgpack decoder or the framing check saw it.
        reason: String,
    },
    /// The envelope carries a protocol version this build does not speak.
    #[error(
        "peer speaks kvpush protocol version {got}, this build supports only {supported}: \
         run the same kvpush version on prefill and decode workers"
    )]
    UnsupportedVersion {
        /// Version in the envelope.
        got: u64,
        /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
        supported: u16,
    },
    /// The envelope names a message kind this build does not know (a newer peer).
    #[error(
        "unknown message kind {kind:?}: the peer runs a newer kvpush; upgrade this side or \
         disable the feature on the peer"
    )]
    UnknownKind {
        /// The kind string from the envelope.
        kind: String,
    },
    /// A secret is configured here but the frame carries no MAC.
    #[error(
        "unsigned frame refused: this receiver requires HMAC authentication; configure the same \
         shared secret on every prefill and decode worker"
    )]
    Unauthenticated,
    /// The frame's MAC does not verify under this receiver's secret.
    #[error(
        "frame signature does not verify: the sender uses a different shared secret, or the \
         frame was altered in transit"
    )]
    BadSignature,
    /// The (sender, session, seq) triple was already accepted, or is too old to tell.
    #[error(
        "frame from {sender:?} (session {session:#018x}, seq {seq}) refused as a replay: it was \
         already accepted or is more than 64 frames older than the newest one seen"
    )]
    Replayed {
        /// The envelope's sender.
        sender: String,
        /// The envelope's session nonce.
        session: u64,
        /// The envelope's sequence number.
        seq: u64,
    },
    /// The frame's timestamp is too far from the receiver's clock.
    #[error(
        "frame timestamp is {skew_ms} ms away from this receiver's clock (allowed: {max_ms} ms): \
         synchronise the hosts' clocks (NTP) or raise Limits::max_clock_skew"
    )]
    ClockSkew {
        /// Sender's timestamp minus the receiver's clock; positive when the sender is ahead.
        skew_ms: i64,
        /// [`Limits::max_clock_skew`](super::Limits::max_clock_skew) in milliseconds.
        max_ms: u64,
    },
    /// A decoded field breaks a limit or an invariant (too many block ids, rank >= size, ...).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The message and field, e.g. `register.groups`.
        field: &'static str,
        /// What is wrong with it and, where it is a limit, the limit.
        reason: String,
    },
    /// A shared secret shorter than [`Secret::MIN_LEN`](super::Secret::MIN_LEN) bytes.
    #[error(
        "shared secret is {len} bytes, at least {min} are required: generate one with \
         `openssl rand -hex 32`"
    )]
    WeakSecret {
        /// Length of the rejected secret.
        len: usize,
        /// [`Secret::MIN_LEN`](super::Secret::MIN_LEN).
        min: usize,
    },
    /// A new (sender, session) arrived while every tracked session is still inside the
    /// clock-skew window, so none can be forgotten without opening a replay hole.
    #[error(
        "refusing a new session: {max} sender sessions are already tracked and all were active \
         within the clock-skew window; raise Limits::max_sessions (a peer creating an encoder \
         per message is a bug)"
    )]
    TooManySessions {
        /// [`Limits::max_sessions`](super::Limits::max_sessions).
        max: usize,
    },
}

impl ProtocolError {
    /// A stable snake_case name for this kind of refusal, for metrics and [`ErrorReply::code`].
    pub fn code(&self) -> &'static str {
        match self {
            Self::Oversized { .. } => "oversized",
            Self::Truncated { .. } => "truncated",
            Self::Malformed { .. } => "malformed",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::UnknownKind { .. } => "unknown_kind",
            Self::Unauthenticated => "unauthenticated",
            Self::BadSignature => "bad_signature",
            Self::Replayed { .. } => "replayed",
            Self::ClockSkew { .. } => "clock_skew",
            Self::Invalid { .. } => "invalid",
            Self::WeakSecret { .. } => "weak_secret",
            Self::TooManySessions { .. } => "too_many_sessions",
        }
    }

    /// The [`Message::Error`] a receiver sends back when it refuses a frame for this reason.
    ///
    /// The detail is cut to [`MAX_REPLY_DETAIL_BYTES`] so the reply itself passes the peer's
    /// string limit even when it quotes a long field back.
    pub fn to_reply(&self) -> Message {
        let mut detail = self.to_string();
        if detail.len() > MAX_REPLY_DETAIL_BYTES {
            let mut cut = MAX_REPLY_DETAIL_BYTES;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
        }
        Message::Error(ErrorReply { code: self.code().to_owned(), detail })
    }

    pub(crate) fn malformed(reason: impl std::fmt::Display) -> Self {
        Self::Malformed { reason: reason.to_string() }
    }
}

//! kvpush/1 control messages, their codec and authentication.
//!
//! * [`messages`]: what P and D tell each other ([`Message`] and one struct per kind) and the
//!   limits a decoded message must meet;
//! * [`codec`]: frames (`u32` big-endian length + msgpack envelope), [`Encoder`], [`Decoder`];
//! * [`auth`]: the shared [`Secret`] and the envelope MAC;
//! * `replay`: which (sender, session, seq) triples a decoder has already accepted.
//!
//! The wire format is specified byte for byte in `docs/protocol.md`, so that a Python peer can be
//! written from it; this module is its reference implementation.
//!
//! ```
//! use kvpush_core::protocol::{Cancel, Decoder, Encoder, Limits, Message, Secret};
//!
//! let secret = Secret::from_bytes(b"0123456789abcdef0123456789abcdef")?;
//! let encoder = Encoder::new("decode-engine-0", Some(secret.clone()));
//! let mut decoder = Decoder::new(Some(secret), Limits::default());
//!
//! let cancel = Message::Cancel(Cancel {
//!     transfer_key: "xfer-1".into(),
//!     request_id: "cmpl-xfer-1-0-1a2b3c4d".into(),
//!     epoch: 1,
//! });
//! let frame = encoder.encode(&cancel, 1_700_000_000_000);
//! let envelope = decoder.decode(&frame, 1_700_000_000_050)?;
//! assert_eq!(envelope.message, cancel);
//! // The same frame again is a replay.
//! assert_eq!(decoder.decode(&frame, 1_700_000_000_060).unwrap_err().code(), "replayed");
//! # Ok::<(), kvpush_core::protocol::ProtocolError>(())
//! ```

use std::time::Duration;

pub mod auth;
pub mod codec;
mod error;
pub mod messages;
mod replay;

pub use auth::Secret;
// Used by the side channel and the endpoint, which the loom build leaves out.
#[cfg(not(loom))]
pub(crate) use codec::fresh_session;
pub use codec::{frame_len, unix_millis, Decoder, Encoder, Envelope, PREFIX_LEN};
pub use error::{ProtocolError, MAX_REPLY_DETAIL_BYTES};
pub use messages::{
    Attach, BlockGroup, Cancel, CancelAck, Done, ErrorReply, Fail, FailReason, Heartbeat, Hello,
    Message, Register, MAX_FANOUT,
};
pub use replay::REPLAY_WINDOW;

/// The envelope version this build writes and the only one it reads.
pub const PROTOCOL_VERSION: u16 = 1;

/// Bounds a [`Decoder`] enforces, so that no peer can make a receiver allocate or track without
/// limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest envelope (the bytes the length prefix counts). Default 16 MiB: a `Register` for a
    /// 1M-token prompt at 16 tokens per block is ~300 KiB; a `Hello` carries NIXL agent metadata,
    /// typically a few KiB.
    pub max_frame_bytes: usize,
    /// Most block ids a `Register` may carry over all its groups (groups count too); also caps
    /// the regions of a `Hello` layout. Default `1 << 22`.
    pub max_block_ids: usize,
    /// Longest string field (ids, keys, addresses, details), in bytes. Default 4096.
    pub max_string_bytes: usize,
    /// Largest accepted difference between a signed frame's timestamp and the receiver's clock.
    /// Default 30 s. Bounds how long a captured frame stays replayable once its replay window
    /// is forgotten (see `docs/protocol.md`, "Replay protection").
    pub max_clock_skew: Duration,
    /// Most sender sessions (encoders) whose replay windows are held at once. Default 4096; a
    /// session is about 100 bytes. Only windows older than `max_clock_skew` are forgotten to
    /// make room, so a receiver refuses new sessions rather than reopen live ones to replay.
    pub max_sessions: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 16 << 20,
            max_block_ids: 1 << 22,
            max_string_bytes: 4096,
            max_clock_skew: Duration::from_secs(30),
            max_sessions: 4096,
        }
    }
}

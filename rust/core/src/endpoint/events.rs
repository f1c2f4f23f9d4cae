//! What an endpoint reports: one [`Event`] per request when its transfer ends.

use crate::key::TransferKey;

/// Which side of the transfer an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// P: the KV was (or was not) sent. Every outcome frees P's blocks.
    Send,
    /// D: the KV was (or was not) received.
    Receive,
}

/// How a transfer ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// P: every byte was written and DONE sent. D: every expected DONE arrived.
    Done,
    /// It cannot happen; the cause says why and what to do. D: no write is in flight (P said
    /// so, or P is gone), so the blocks may be freed or recomputed into.
    Failed(Cause),
    /// P: nothing was written because D cancelled or the registration expired first.
    /// D: the cancel was confirmed by P (or P is gone).
    Cancelled(Cause),
    /// A notice, not an end: a WRITE may still be landing (P: not done within its write
    /// timeout; D: a lost P has neither confirmed nor been found gone past its horizon), so the
    /// blocks on this side (P's source, D's destination) must not be reused. The request's final
    /// event follows once that is settled, or never.
    Quarantined(Cause),
}

impl Outcome {
    /// A failure for `reason`, described by `detail`.
    pub fn failed(reason: Reason, detail: impl Into<String>) -> Self {
        Self::Failed(Cause { reason, detail: detail.into() })
    }

    /// A cancellation for `reason`, described by `detail`.
    pub fn cancelled(reason: Reason, detail: impl Into<String>) -> Self {
        Self::Cancelled(Cause { reason, detail: detail.into() })
    }

    /// A quarantine, described by `detail`.
    pub fn quarantined(detail: impl Into<String>) -> Self {
        Self::Quarantined(Cause { reason: Reason::Quarantined, detail: detail.into() })
    }

    /// The same outcome, its detail extended by what settled it (`evidence`).
    pub fn because(self, evidence: &str) -> Self {
        match self {
            Self::Done => Self::Done,
            Self::Failed(cause) => Self::Failed(cause.because(evidence)),
            Self::Cancelled(cause) => Self::Cancelled(cause.because(evidence)),
            Self::Quarantined(cause) => Self::Quarantined(cause.because(evidence)),
        }
    }

    /// Why, unless the transfer was done.
    pub fn cause(&self) -> Option<&Cause> {
        match self {
            Self::Done => None,
            Self::Failed(cause) | Self::Cancelled(cause) | Self::Quarantined(cause) => Some(cause),
        }
    }
}

/// Why a transfer did not end done: a [`Reason`] that programs and metrics branch on, and a
/// detail for people (which may be reworded at will). Reads as its detail (`Deref<str>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// What happened, as a stable code.
    pub reason: Reason,
    /// What happened, for people: the request, the peer, what to do.
    pub detail: String,
}

impl Cause {
    fn because(self, evidence: &str) -> Self {
        Self { reason: self.reason, detail: format!("{}; {evidence}", self.detail) }
    }
}

impl std::ops::Deref for Cause {
    type Target = str;

    fn deref(&self) -> &str {
        &self.detail
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// Why a transfer ended without its KV: the codes of [`Cause`] (snake_case on the Python side,
/// `kvpush.Reason`, and in metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// P's request was aborted or finished without KV (D: P said so).
    Aborted,
    /// D cancelled (aborted or preempted the request).
    Cancelled,
    /// A deadline passed first: P's KV lease with no registration, D's wait for the KV, a
    /// registration's TTL.
    Expired,
    /// P refused the registration: invalid or stale blocks, another peer's transfer, a quota.
    Refused,
    /// P's lease on D had lapsed (no fresh proof that D is alive): P did not write.
    LeaseLapsed,
    /// P and D cannot exchange KV (compatibility, layout, memory).
    Incompatible,
    /// The WRITE failed or timed out (and was released).
    WriteError,
    /// The peer was lost: D reports it once P's write horizon has passed; P, when D's
    /// connection is gone before the write.
    PeerLost,
    /// D could not reach P (connect or handshake failed, or the registration could not be
    /// sent): nothing was registered.
    Unreachable,
    /// The WRITE could not be released: the blocks stay held for good.
    Quarantined,
    /// The endpoint (or the peer's) shut down.
    Closed,
    /// The writer thread died: the endpoint is unhealthy.
    WriterDied,
}

impl Reason {
    /// Every reason, in declaration order.
    pub const ALL: [Reason; 12] = [
        Self::Aborted,
        Self::Cancelled,
        Self::Expired,
        Self::Refused,
        Self::LeaseLapsed,
        Self::Incompatible,
        Self::WriteError,
        Self::PeerLost,
        Self::Unreachable,
        Self::Quarantined,
        Self::Closed,
        Self::WriterDied,
    ];

    /// The stable snake_case code.
    pub fn code(self) -> &'static str {
        match self {
            Self::Aborted => "aborted",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
            Self::Refused => "refused",
            Self::LeaseLapsed => "lease_lapsed",
            Self::Incompatible => "incompatible",
            Self::WriteError => "write_error",
            Self::PeerLost => "peer_lost",
            Self::Unreachable => "unreachable",
            Self::Quarantined => "quarantined",
            Self::Closed => "closed",
            Self::WriterDied => "writer_died",
        }
    }

    /// The reason behind a FAIL P sent.
    pub fn of_fail(reason: &crate::protocol::FailReason) -> Self {
        use crate::protocol::FailReason as F;
        match reason {
            F::Aborted => Self::Aborted,
            F::Expired => Self::Expired,
            F::Refused | F::Unknown(_) => Self::Refused,
            F::WriteError => Self::WriteError,
            F::Cancelled => Self::Cancelled,
            F::ShuttingDown => Self::Closed,
            F::Incompatible => Self::Incompatible,
            F::Quarantined => Self::Quarantined,
        }
    }
}

/// When things happened to one request, in seconds on the reporting endpoint's clock
/// ([`super::Endpoint::clock`]); `None` when the step did not happen on this side.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timeline {
    /// P: D's registration arrived. D: the registration was handed to the endpoint.
    pub registered: Option<f64>,
    /// P, layer-wise push: the first WRITE of a layer was posted, before the KV was reported
    /// ready.
    pub streamed: Option<f64>,
    /// P: the KV was reported ready.
    pub ready: Option<f64>,
    /// P: the second half arrived (the match).
    pub matched: Option<f64>,
    /// P: the WRITE was posted (planning done).
    pub posted: Option<f64>,
    /// P: the WRITE completed. D: the last expected DONE arrived.
    pub completed: Option<f64>,
}

/// The end of one request's transfer on one side.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Send (P) or receive (D).
    pub role: Role,
    /// The local request id (P's for `Send`, D's for `Receive`).
    pub request_id: String,
    /// The transfer key both sides matched on.
    pub key: TransferKey,
    /// How it ended.
    pub outcome: Outcome,
    /// Bytes written (P) or announced by the DONEs (D).
    pub bytes: u64,
    /// Descriptor runs in the WRITE (P), or announced by the DONEs (D).
    pub runs: u32,
    /// P, layer-wise push: of `bytes`, those written layer by layer before the request's KV
    /// was reported ready (see `Endpoint::layers_ready`).
    pub streamed_bytes: u64,
    /// P, layer-wise push of a prompt computed in chunks: of `bytes`, those written again (D's
    /// block holding an earlier chunk's last token; see `Planner::narrow_destination`).
    pub rewritten_bytes: u64,
    /// When each step happened.
    pub timeline: Timeline,
}

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
    /// It cannot happen; the text says why and what to do. D: no write is in flight (P said
    /// so, or P is gone), so the blocks may be freed or recomputed into.
    Failed(String),
    /// P: nothing was written because D cancelled or the registration expired first.
    /// D: the cancel was confirmed by P (or P is gone).
    Cancelled(String),
    /// A WRITE was abandoned but the transport could not release it, so it may still be
    /// landing: the blocks on this side (P's source, D's destination) must never be reused.
    Quarantined(String),
}

/// When things happened to one request, in seconds on the reporting endpoint's clock
/// ([`super::Endpoint::clock`]); `None` when the step did not happen on this side.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timeline {
    /// P: D's registration arrived. D: the registration was handed to the endpoint.
    pub registered: Option<f64>,
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
    /// When each step happened.
    pub timeline: Timeline,
}

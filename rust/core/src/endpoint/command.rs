//! What the writer thread is asked to do ([`Command`]), by the engine's calls, the side
//! channel's readers and D's connector, through its inbox.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::key::TransferKey;
use crate::protocol::{Cancel, Fail, Message};
use crate::rendezvous::Match;
use crate::side_channel::{PeerId, PeerInfo, SideChannelError, TOO_MANY_CONNECTIONS};

use super::halves::{Ready, Registration};
use super::Expectation;

/// What the writer is asked to do.
#[derive(Debug)]
pub(crate) enum Command {
    /// P: both halves met: write.
    Write(Match<Registration, Arc<Ready>>),
    /// P, layer-wise push: the KV of these regions is final; stream them where D registered.
    Layers { key: TransferKey, ready: Arc<Ready>, regions: Range<usize> },
    /// P: tell D its transfer will not happen.
    Fail { peer: PeerId, fail: Fail },
    /// P: D's cancel was applied; acknowledge it and report P's released KV, if any.
    AcknowledgeCancel { peer: PeerId, cancel: Cancel, released: Option<Arc<Ready>> },
    /// P: D's cancel found the WRITE in flight: acknowledge it on `peer` once the transport
    /// finished with the WRITE.
    AcknowledgeWhenWritten { peer: PeerId, cancel: Cancel },
    /// D: register blocks with P and await the KV.
    Expect(Expectation, Instant),
    /// D: stop awaiting a request.
    CancelExpectation(String),
    /// D: a side channel connection to P was set up (or not).
    Connected { source: String, result: Result<PeerInfo, ConnectFailure> },
    /// A peer finished its handshake.
    PeerJoined(PeerInfo),
    /// A peer is gone: its connection closed at `at`.
    PeerLost { peer: PeerId, reason: String, at: Instant },
    /// A control message for the writer (FAIL, CANCEL_ACK, ERROR on D).
    FromPeer(PeerId, Message),
    /// P: every slot of this transfer's group ended (see `fanout`): report its send.
    ReportFanOut(TransferKey),
    /// Close: finish or abandon what is in flight, fail what is pending, exit.
    Stop,
}

/// Why D could not connect to a P, as far as the fence cares.
#[derive(Debug, Clone)]
pub(crate) struct ConnectFailure {
    /// What went wrong, for the request's event.
    pub(crate) reason: String,
    /// Nothing listens at the address (its host refused the connection): an endpoint D lost
    /// there is gone.
    pub(crate) refused: bool,
    /// P turned D away for want of a connection or handshake slot: try again later.
    pub(crate) busy: bool,
    /// P did not answer within `connect_timeout` (no TCP connection, or no Hello): an
    /// overloaded P looks like this, and so does a host that is down. D tries again, a few times.
    pub(crate) timed_out: bool,
}

impl ConnectFailure {
    pub(crate) fn of(error: &SideChannelError) -> Self {
        let refused = matches!(
            error,
            SideChannelError::Connect { source, .. }
                if source.kind() == std::io::ErrorKind::ConnectionRefused
        );
        let busy = matches!(
            error,
            SideChannelError::Refused { code, .. } if code == TOO_MANY_CONNECTIONS
        );
        let timed_out = match error {
            SideChannelError::Connect { source, .. } => {
                source.kind() == std::io::ErrorKind::TimedOut
            }
            SideChannelError::Handshake { timed_out, .. } => *timed_out,
            _ => false,
        };
        Self { reason: error.to_string(), refused, busy, timed_out }
    }

    /// A failure that is neither of the above: D gives up on the source's waiting legs.
    pub(crate) fn other(reason: String) -> Self {
        Self { reason, refused: false, busy: false, timed_out: false }
    }
}

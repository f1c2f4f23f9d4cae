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
use super::{Expectation, LayerStreams};

/// What the writer is asked to do.
#[derive(Debug)]
pub(crate) enum Command {
    /// P: both halves met: write.
    Write(Match<Registration, Arc<Ready>>),
    /// P, layer-wise push: the KV of these regions is final; stream them where D registered.
    Layers { key: TransferKey, ready: Arc<Ready>, regions: Range<usize> },
    /// P, layer-wise push: [`Command::Layers`] for each of these streams.
    LayersOf { streams: LayerStreams, regions: Range<usize> },
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

/// Merges the layers a busy writer found queued together: within each stretch of consecutive
/// [`Command::Layers`], a command that continues an earlier one of the same transfer (from the
/// same KV, its regions starting where that one's end) is folded into it, so those layers go
/// as one WRITE rather than one each. Any other command ends the stretch: nothing is merged
/// across it, and the commands keep their order otherwise. A [`Command::LayersOf`] counts as
/// its streams' [`Command::Layers`], in order.
pub(crate) fn coalesce_layers(commands: Vec<Command>) -> Vec<Command> {
    let mut merged = Coalesced { out: Vec::with_capacity(commands.len()), stretch: 0 };
    for command in commands {
        match command {
            Command::LayersOf { streams, regions } => {
                streams.commands(&regions).for_each(|layers| merged.push(layers));
            }
            other => merged.push(other),
        }
    }
    merged.out
}

/// The commands [`coalesce_layers`] keeps, as it goes.
struct Coalesced {
    out: Vec<Command>,
    /// Where the current stretch of layer commands starts in `out`.
    stretch: usize,
}

impl Coalesced {
    fn push(&mut self, command: Command) {
        let Command::Layers { key, ready, regions } = &command else {
            self.out.push(command);
            self.stretch = self.out.len();
            return;
        };
        let earlier = self.out[self.stretch..].iter_mut().rev().find_map(|kept| match kept {
            Command::Layers { key: k, ready: r, regions: kept } if k == key => Some((r, kept)),
            _ => None,
        });
        if let Some((kept_ready, kept)) = earlier {
            let same_kv = kept_ready.kv.num_tokens == ready.kv.num_tokens
                && kept_ready.kv.groups == ready.kv.groups;
            if same_kv && kept.end == regions.start {
                kept.end = regions.end;
                return;
            }
        }
        self.out.push(command);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::ReadyKv;
    use crate::protocol::BlockGroup;

    fn kv(request: &str, tokens: u64) -> ReadyKv {
        ReadyKv {
            request_id: request.to_owned(),
            transfer_id: None,
            groups: vec![BlockGroup { first_token: 0, block_ids: vec![1, 2] }],
            num_tokens: tokens,
            ttl: std::time::Duration::from_secs(1),
        }
    }

    fn layers(request: &str, tokens: u64, regions: Range<usize>) -> Command {
        let key = TransferKey::for_request(None, request);
        let ready = Arc::new(Ready { kv: kv(request, tokens), at: Instant::now() });
        Command::Layers { key, ready, regions }
    }

    fn shape(commands: &[Command]) -> Vec<String> {
        commands
            .iter()
            .map(|c| match c {
                Command::Layers { ready, regions, .. } => {
                    format!("{}:{}..{}", ready.kv.request_id, regions.start, regions.end)
                }
                other => format!("{other:?}").split_whitespace().next().unwrap_or("").to_owned(),
            })
            .collect()
    }

    #[test]
    fn queued_layers_of_one_transfer_merge_into_one_range_per_stretch() {
        let commands = vec![
            layers("a", 32, 0..2),
            layers("b", 32, 0..2),
            layers("a", 32, 2..4),
            layers("b", 32, 2..4),
            layers("a", 32, 4..6),
            Command::Stop,
            layers("a", 32, 6..8),
        ];
        assert_eq!(shape(&coalesce_layers(commands)), ["a:0..6", "b:0..4", "Stop", "a:6..8"]);
    }

    #[test]
    fn layers_that_do_not_continue_or_come_from_another_kv_stay_apart() {
        let commands = vec![
            layers("a", 32, 0..2),
            layers("a", 32, 0..2), // reported twice
            layers("a", 32, 4..6), // a gap
            layers("a", 48, 6..8), // another KV (a longer prompt)
        ];
        assert_eq!(shape(&coalesce_layers(commands)), ["a:0..2", "a:0..2", "a:4..6", "a:6..8"]);
    }

    #[test]
    fn a_forward_s_streams_count_as_one_layer_command_each_in_order() {
        let streams = LayerStreams::new(vec![kv("a", 32), kv("b", 32)]);
        let commands = vec![
            Command::LayersOf { streams: streams.clone(), regions: 0..2 },
            Command::LayersOf { streams: streams.without(|id| id == "b"), regions: 2..4 },
            layers("b", 32, 2..4),
            Command::LayersOf { streams: LayerStreams::default(), regions: 4..6 },
            Command::Stop,
            Command::LayersOf { streams, regions: 4..6 },
        ];
        let merged = coalesce_layers(commands);
        assert_eq!(shape(&merged), ["a:0..4", "b:0..4", "Stop", "a:4..6", "b:4..6"]);
    }
}

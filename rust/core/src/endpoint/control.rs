//! The side channel's handler: control messages from peers, acted on by the reader thread that
//! received them.
//!
//! A registration goes straight into the rendezvous table here, on the network thread, so it
//! never queues behind the writer; only a match (or a reply to send) is handed to the writer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::protocol::{Fail, FailReason, Message, ProtocolError, Register, PROTOCOL_VERSION};
use crate::rendezvous::{Arrival, Cancelled, FenceReason, RendezvousError};
use crate::side_channel::{ControlHandler, PeerId, PeerInfo};

use super::writer::{Command, Registration};
use super::{Counters, Shared};

/// Longest TTL a peer may ask the table to hold a registration for.
const MAX_REGISTRATION_TTL: Duration = Duration::from_secs(3_600);

#[derive(Debug)]
pub(crate) struct Control {
    shared: Arc<Shared>,
    compatibility: String,
}

impl Control {
    pub(crate) fn new(shared: Arc<Shared>, compatibility: String) -> Self {
        Self { shared, compatibility }
    }

    fn register(&self, peer: PeerId, register: Register) {
        let now = Instant::now();
        let key = TransferKey::from_canonical(&register.transfer_key);
        let ttl = Duration::from_millis(register.ttl_ms).min(MAX_REGISTRATION_TTL);
        let epoch = register.epoch;
        // A refused registration is dropped by the table; keep what the reply needs.
        let request_id = register.request_id.clone();
        let registration = Registration { peer, register, at: now };
        match self.shared.table.register(key, epoch, registration, now + ttl, now) {
            Ok(Arrival::Matched(m)) => {
                self.shared.send(Command::Write(m));
            }
            // A superseded registration needs no reply: D replaced it itself.
            Ok(Arrival::Waiting { .. }) => {}
            Err(error) => {
                let reason = match &error {
                    RendezvousError::Fenced { reason: FenceReason::Cancelled, .. } => {
                        FailReason::Aborted
                    }
                    RendezvousError::Fenced { reason: FenceReason::Expired, .. } => {
                        FailReason::Expired
                    }
                    _ => FailReason::Refused,
                };
                self.shared.send(Command::Fail {
                    peer,
                    fail: Fail {
                        transfer_key: error.key().as_str().to_owned(),
                        request_id,
                        epoch,
                        reason,
                        detail: error.to_string(),
                    },
                });
            }
        }
    }

    fn cancel(&self, peer: PeerId, cancel: crate::protocol::Cancel) {
        let key = TransferKey::from_canonical(&cancel.transfer_key);
        let outcome = self.shared.table.cancel(&key, Some(cancel.epoch), Instant::now());
        let released = match outcome {
            // The in-flight write's `finish` acknowledges it.
            Cancelled::Deferred => return,
            Cancelled::NotFound => None,
            Cancelled::Removed { ready, .. } => ready,
        };
        self.shared.send(Command::AcknowledgeCancel { peer, cancel, released });
    }
}

impl ControlHandler for Control {
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), String> {
        let hello = &peer.hello;
        if !hello.versions.contains(&PROTOCOL_VERSION) {
            return Err(format!(
                "peer {} speaks kvpush protocol versions {:?}, this worker speaks {PROTOCOL_VERSION}",
                hello.engine_id, hello.versions
            ));
        }
        if hello.compatibility != self.compatibility {
            return Err(format!(
                "peer {} serves a different model configuration (compatibility {:?}, this worker \
                 {:?}); pair prefill and decode engines of the same model, dtype and KV layout",
                hello.engine_id, hello.compatibility, self.compatibility
            ));
        }
        if self.shared.send(Command::PeerJoined(peer.clone())) {
            Ok(())
        } else {
            Err("this worker is shutting down".to_owned())
        }
    }

    fn message(&self, peer: PeerId, message: Message) {
        match message {
            Message::Register(register) => self.register(peer, register),
            Message::Cancel(cancel) => self.cancel(peer, cancel),
            other => {
                self.shared.send(Command::FromPeer(peer, other));
            }
        }
    }

    fn peer_lost(&self, peer: PeerId, reason: &str) {
        self.shared.send(Command::PeerLost(peer, reason.to_owned()));
    }

    fn refused(&self, _peer: Option<PeerId>, _error: &ProtocolError) {
        Counters::add(&self.shared.counters.refused_frames);
    }
}

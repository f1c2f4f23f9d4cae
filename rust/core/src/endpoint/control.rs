//! The side channel's handler: control messages from peers, acted on by the reader thread that
//! received them.
//!
//! A registration goes straight into the rendezvous table here, on the network thread, so it
//! never queues behind the writer; only a match (or a reply to send) is handed to the writer.
//!
//! Every registration belongs to the authenticated peer that made it (its [`Owner`]: D's engine
//! id and process-unique agent name): no other peer can supersede or cancel it. The peers of one
//! host hold at most `quota` registrations at once between them, counted by the [`Slot`] each
//! registration carries, so that no host (however many connections or engine ids it opens) can
//! fill the table that every other D shares.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::protocol::{
    Fail, FailReason, Hello, Message, ProtocolError, Register, PROTOCOL_VERSION,
};
use crate::rendezvous::{Arrival, Cancelled, FenceReason, Owner, RendezvousError, TakeReady};
use crate::side_channel::{ControlHandler, PeerId, PeerInfo};
use crate::sync::lock;
use crate::transport::{MemoryKind, MemorySpace};

use super::fanout::{self, FanOut};
use super::send::Registration;
use super::writer::Command;
use super::{Counters, Shared};

/// Longest TTL a peer may ask the table to hold a registration for.
const MAX_REGISTRATION_TTL: Duration = Duration::from_secs(3_600);

/// One of a peer connection's registration slots, given back when the registration that holds
/// it is dropped (matched and written, superseded, cancelled, expired or purged).
#[derive(Debug)]
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        // Relaxed: a quota counter; the registration itself is published by the table's lock.
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What P knows of a joined D connection.
#[derive(Debug, Clone)]
struct PeerEntry {
    owner: Owner,
    /// Registrations held now by every peer of this one's host.
    held: Arc<AtomicUsize>,
}

#[derive(Debug)]
pub(crate) struct Control {
    shared: Arc<Shared>,
    compatibility: String,
    quota: usize,
    /// Where this worker's KV lives, and why its transport cannot write into a peer's VRAM
    /// (`None`: it can): a D whose cache the transport cannot reach is refused at the handshake.
    memory: MemorySpace,
    vram_refusal: Option<String>,
    peers: Mutex<HashMap<PeerId, PeerEntry>>,
    /// Each host's registration count, shared by its peers' entries. One small entry per host
    /// that ever authenticated.
    hosts: Mutex<HashMap<IpAddr, Arc<AtomicUsize>>>,
}

/// The owner of every registration a peer with this Hello makes.
pub(crate) fn owner_of(hello: &Hello) -> Owner {
    let mut hasher = DefaultHasher::new();
    hello.engine_id.hash(&mut hasher);
    hello.agent_name.hash(&mut hasher);
    // 0 is the table's ANY_OWNER, which no peer may be.
    hasher.finish().max(1)
}

impl Control {
    pub(crate) fn new(
        shared: Arc<Shared>,
        compatibility: String,
        quota: usize,
        memory: MemorySpace,
        vram_refusal: Option<String>,
    ) -> Self {
        Self {
            shared,
            compatibility,
            quota,
            memory,
            vram_refusal,
            peers: Mutex::new(HashMap::new()),
            hosts: Mutex::new(HashMap::new()),
        }
    }

    fn refuse(&self, peer: PeerId, register: &Register, reason: FailReason, detail: String) {
        Counters::add(&self.shared.counters.refused_registrations);
        self.shared.send(Command::Fail {
            peer,
            fail: Fail {
                transfer_key: register.transfer_key.clone(),
                request_id: register.request_id.clone(),
                epoch: register.epoch,
                reason,
                detail,
            },
        });
    }

    fn register(&self, peer: PeerId, register: Register) {
        // Messages come only from joined peers, so the entry is there unless the peer was lost
        // meanwhile; then its registration has nobody to be written to.
        let Some(entry) = lock(&self.peers).get(&peer).cloned() else { return };
        // Relaxed: see `Slot`.
        if entry.held.fetch_add(1, Ordering::Relaxed) >= self.quota {
            entry.held.fetch_sub(1, Ordering::Relaxed);
            let detail = format!(
                "transfer {}: D's host already holds {} registrations on P; finish or cancel \
                 some, or raise max_registrations_per_host",
                register.transfer_key, self.quota
            );
            self.refuse(peer, &register, FailReason::Refused, detail);
            return;
        }
        let slot = Slot(Arc::clone(&entry.held));
        let now = self.shared.now();
        let key = TransferKey::from_canonical(&register.transfer_key);
        if register.fanout > 1 {
            if let Err((reason, detail)) = self.join_fanout(&key, register.fanout, now) {
                self.refuse(peer, &register, reason, detail);
                return;
            }
        }
        let ttl = Duration::from_millis(register.ttl_ms).min(MAX_REGISTRATION_TTL);
        let epoch = register.epoch;
        // A refused registration is dropped by the table; keep what the reply needs.
        let reply_to = Register { groups: Vec::new(), ..register.clone() };
        let registration = Registration { peer, register, at: now, _slot: slot };
        let arrival =
            self.shared.table.register_owned(key, epoch, entry.owner, registration, now + ttl, now);
        match arrival {
            Ok(Arrival::Matched(m)) => {
                self.shared.send(Command::Write(m));
            }
            // A superseded registration needs no reply: D replaced it itself.
            Ok(Arrival::Waiting { .. }) => {}
            // The same registration again (a retransmission, or a confused D): the one the table
            // holds stands, and a FAIL for this epoch would end it on D.
            Err(RendezvousError::StaleEpoch { current, .. }) if current == epoch => {
                Counters::add(&self.shared.counters.refused_registrations);
            }
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
                self.refuse(peer, &reply_to, reason, error.to_string());
            }
        }
    }

    /// A D rank registers slot `key` of a transfer P writes into `slots` D ranks: the first
    /// slot creates the transfer's group and, if P's KV is ready, places it under every slot
    /// (see `fanout`).
    fn join_fanout(
        &self,
        key: &TransferKey,
        slots: u32,
        now: Instant,
    ) -> Result<(), (FailReason, String)> {
        // The decoder checked that a registration with a fan-out names a slot.
        let Some((base, _)) = key.split_slot() else {
            return Err((FailReason::Refused, format!("transfer {key} names no slot")));
        };
        let mut groups = lock(&self.shared.fanouts);
        if let Some(group) = groups.get(&base) {
            if group.slots != slots {
                let detail = format!(
                    "transfer {base}: D ranks registered {} slots and this one {slots}; every D \
                     rank of one engine must run the same tensor parallel size",
                    group.slots
                );
                return Err((FailReason::Incompatible, detail));
            }
            return Ok(());
        }
        let mut group = FanOut::new(slots);
        match self.shared.table.take_ready(&base, now) {
            TakeReady::Absent => {}
            TakeReady::Taken { ready, deadline } => {
                for m in fanout::place(&self.shared, &base, &mut group, &ready, deadline, now) {
                    self.shared.send(Command::Write(m));
                }
            }
            TakeReady::Fenced(reason) => {
                let fail = match reason {
                    FenceReason::Expired => FailReason::Expired,
                    FenceReason::Cancelled => FailReason::Aborted,
                    FenceReason::Delivered | FenceReason::Failed => FailReason::Refused,
                };
                return Err((fail, format!("transfer {base} ended: {reason}")));
            }
            TakeReady::Busy => {
                let detail = format!(
                    "transfer {base} is already being written to a D rank that registered it \
                     alone; every D rank of one engine must register the same way"
                );
                return Err((FailReason::Incompatible, detail));
            }
        }
        if group.is_over() {
            // Every slot was fenced already: the send ends now, reported by the writer.
            groups.insert(base.clone(), group);
            self.shared.send(Command::ReportFanOut(base));
        } else {
            groups.insert(base, group);
        }
        Ok(())
    }

    fn cancel(&self, peer: PeerId, cancel: crate::protocol::Cancel) {
        let Some(owner) = lock(&self.peers).get(&peer).map(|entry| entry.owner) else { return };
        let key = TransferKey::from_canonical(&cancel.transfer_key);
        let now = self.shared.now();
        let outcome = self.shared.table.cancel_owned(&key, Some(cancel.epoch), Some(owner), now);
        let released = match outcome {
            // The in-flight write's `finish` acknowledges it, on this connection too (a D that
            // lost P asks again on a new one).
            Cancelled::Deferred => {
                self.shared.send(Command::AcknowledgeWhenWritten { peer, cancel });
                return;
            }
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
        // P writes into every D that connects to it: refuse one whose KV cache our transport
        // cannot reach now, rather than fail each of its requests later.
        if let (true, MemoryKind::Vram, Some(reason)) =
            (peer.inbound, hello.memory.kind, &self.vram_refusal)
        {
            return Err(format!(
                "this worker's KV cache is in {} and peer {}'s is in {}, which this worker's \
                 transport cannot write into: {reason}",
                self.memory, hello.engine_id, hello.memory
            ));
        }
        self.shared.health()?;
        let held = Arc::clone(lock(&self.hosts).entry(peer.addr.ip()).or_default());
        let entry = PeerEntry { owner: owner_of(hello), held };
        lock(&self.peers).insert(peer.id, entry);
        if self.shared.send(Command::PeerJoined(peer.clone())) {
            Ok(())
        } else {
            lock(&self.peers).remove(&peer.id);
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
        let at = self.shared.now();
        lock(&self.peers).remove(&peer);
        self.shared.send(Command::PeerLost { peer, reason: reason.to_owned(), at });
    }

    fn refused(&self, _peer: Option<PeerId>, _error: &ProtocolError) {
        Counters::add(&self.shared.counters.refused_frames);
    }

    fn healthy(&self) -> Result<(), String> {
        self.shared.health()
    }
}

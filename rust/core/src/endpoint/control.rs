//! The side channel's handler: control messages from peers, acted on by the reader thread that
//! received them.
//!
//! A registration goes straight into the rendezvous table here, on the network thread, so it
//! never queues behind the writer; only a match (or a reply to send) is handed to the writer.
//!
//! Every registration belongs to the authenticated peer that made it (its [`Owner`]: D's engine
//! id and process-unique agent name): no other peer can supersede or cancel it. A peer whose
//! agent name already stands for another agent here (other metadata: another process) is
//! refused at the handshake (see `agents`), so that no two processes share an owner or an agent.
//! The peers of one host hold at most a [`Quota`] of registrations at once between them, in
//! entries and in bytes, counted by the [`Slot`] each registration carries, so that no host
//! (however many connections or engine ids it opens) can fill the table, or P's memory, that
//! every other D shares. A registration the table already holds for its owner (same key and
//! epoch) is a duplicate: counted and ignored before the quota, the overload or any other
//! refusal, since a FAIL for that epoch would end it on D while P may write it.
//!
//! A registration that arrives on a connection its D has since replaced by a newer one is
//! dropped (see `register`): D asks again about what it registered on a lost connection, and
//! P's answer must not be overtaken by a registration still on its way on the old one.
//!
//! A reader thread waits at most `ROOM_WAIT` for room in the writer's inbox (see `inbox`); a
//! registration that finds none is refused (`fail(refused)`, P is overloaded), and a peer's
//! cancel or reply that finds none even for ending work is dropped and counted: D's deadlines
//! cover it (an unacknowledged cancel ends in a disconnect and P's horizon).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::protocol::{
    Fail, FailReason, Hello, Message, ProtocolError, Register, PROTOCOL_VERSION,
};
use crate::rendezvous::{Arrival, Cancelled, FenceReason, Owner, RendezvousError, TakeReady};
use crate::side_channel::{ControlHandler, PeerId, PeerInfo, Refusal};
use crate::sync::lock;
use crate::transport::{MemoryKind, MemorySpace, Unreachable};

use super::agents::{self, AgentCollision};
use super::command::Command;
use super::fanout::{self, FanOut};
use super::halves::{registration_bytes, Registration};
use super::quota::{Held, OverQuota, Quota, Slot};
use super::{Counters, Shared, Unhealthy};

/// Longest TTL a peer may ask the table to hold a registration for.
const MAX_REGISTRATION_TTL: Duration = Duration::from_secs(3_600);

/// How long a reader thread waits for room in the writer's inbox before it refuses a
/// registration (or a handshake): long enough to ride out a burst, short next to the peer's
/// heartbeat timeout.
const ROOM_WAIT: Duration = Duration::from_millis(100);

/// Why P does not take a registration on (the detail of D's FAIL).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Unadmitted {
    /// The writer's inbox stayed full for `ROOM_WAIT`.
    #[error(
        "transfer {key}: P is overloaded: {queued} commands wait for its writer thread \
         (capacity {capacity}); retry later, or send the request to another prefill worker"
    )]
    Overloaded { key: String, queued: usize, capacity: usize },
    /// D's host holds `max_registrations_per_host` registrations already.
    #[error(
        "transfer {key}: D's host {host} already holds {entries} registrations on P; finish or \
         cancel some, or raise max_registrations_per_host"
    )]
    TooManyRegistrations { key: String, host: IpAddr, entries: usize },
    /// This registration alone holds more than a host's budget.
    #[error(
        "transfer {key}: this registration holds {bytes} bytes, more than the {budget} bytes a \
         host's registrations may hold on P; raise max_registration_bytes_per_host"
    )]
    TooLarge { key: String, bytes: usize, budget: usize },
    /// This registration would take its host past its budget.
    #[error(
        "transfer {key}: D's host {host} already holds {held} bytes of registrations on P, and \
         this one ({bytes} bytes) would pass the host's budget of {budget} bytes; finish or \
         cancel some, or raise max_registration_bytes_per_host"
    )]
    OverBudget { key: String, host: IpAddr, held: usize, bytes: usize, budget: usize },
}

/// Why a peer that finished its handshake is refused (the text of its `incompatible` error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Unjoined {
    /// No protocol version in common.
    #[error(
        "peer {engine_id} speaks kvpush protocol versions {versions:?}, this worker speaks \
         {PROTOCOL_VERSION}"
    )]
    Versions { engine_id: String, versions: Vec<u16> },
    /// Another model configuration.
    #[error(
        "peer {engine_id} serves a different model configuration (compatibility {theirs:?}, \
         this worker {ours:?}); pair prefill and decode engines of the same model, dtype and KV \
         layout"
    )]
    Compatibility { engine_id: String, theirs: String, ours: String },
    /// P's transport cannot write into the peer's memory.
    #[error(
        "this worker's KV cache is in {ours} and peer {engine_id}'s is in {theirs}, which this \
         worker's transport cannot write into: {source}"
    )]
    Unreachable { ours: MemorySpace, engine_id: String, theirs: MemorySpace, source: Unreachable },
    /// This worker's writer died or stalled.
    #[error(transparent)]
    Unhealthy(#[from] Unhealthy),
    /// The writer's inbox stayed full for `ROOM_WAIT`.
    #[error(
        "this worker is overloaded: {queued} commands wait for its writer thread (capacity \
         {capacity}); retry later"
    )]
    Overloaded { queued: usize, capacity: usize },
    /// The peer's agent name stands for another agent here.
    #[error(transparent)]
    Agent(#[from] AgentCollision),
    /// The endpoint is closing.
    #[error("this worker is shutting down")]
    ShuttingDown,
}

/// What P knows of a joined D connection.
#[derive(Debug, Clone)]
struct PeerEntry {
    owner: Owner,
    /// The peer's host, whose quota its registrations count against.
    host: IpAddr,
    /// Registrations held now by every peer of this one's host.
    held: Arc<Held>,
    /// The agent name this connection claimed (see `agents`), released when it is lost.
    agent: String,
}

#[derive(Debug)]
pub(crate) struct Control {
    shared: Arc<Shared>,
    compatibility: String,
    quota: Quota,
    /// Where this worker's KV lives, and why its transport cannot write into a peer's VRAM
    /// (`None`: it can): a D whose cache the transport cannot reach is refused at the handshake.
    memory: MemorySpace,
    vram_refusal: Option<Unreachable>,
    peers: Mutex<HashMap<PeerId, PeerEntry>>,
    /// What each host's registrations hold, shared by its peers' entries. One small entry per
    /// host that ever authenticated.
    hosts: Mutex<HashMap<IpAddr, Arc<Held>>>,
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
        quota: Quota,
        memory: MemorySpace,
        vram_refusal: Option<Unreachable>,
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
        if self.shared.admit_ending().is_err() {
            // Not even a FAIL fits: D's expectation ends at its own deadline.
            return;
        }
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
        let key = TransferKey::from_canonical(&register.transfer_key);
        // The same registration again (a retransmission, or a confused D) while the table holds
        // it: it stands, and is counted. Checked before any refusal below, since a FAIL for this
        // epoch would end it on D while P may still write it.
        if self.shared.table.holds(&key, register.epoch, entry.owner) {
            Counters::add(&self.shared.counters.refused_registrations);
            return;
        }
        let slot = match self.admit(&entry, &register) {
            Ok(slot) => slot,
            Err(unadmitted) => {
                self.refuse(peer, &register, FailReason::Refused, unadmitted.to_string());
                return;
            }
        };
        let now = self.shared.now();
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
        let arrival = {
            // A registration that arrives on a connection its D has since replaced (a newer
            // connection of the same owner joined) is dropped: D lost this one, asked again on
            // the new one, and may have been answered that P holds nothing for the transfer
            // already. Checked and inserted under the peers' lock, which the new connection's
            // join takes before D can send anything on it: either this registration is in the
            // table before D's question, which then finds it, or it is dropped.
            let peers = lock(&self.peers);
            let replaced = peers.iter().any(|(&id, other)| id > peer && other.owner == entry.owner);
            if replaced {
                Counters::add(&self.shared.counters.refused_registrations);
                return;
            }
            self.shared.table.register_owned(key, epoch, entry.owner, registration, now + ttl, now)
        };
        match arrival {
            Ok(Arrival::Matched(m)) => {
                self.shared.send(Command::Write(m));
            }
            // A superseded registration needs no reply: D replaced it itself.
            Ok(Arrival::Waiting { .. }) => {}
            // The same registration again, arrived while the check above was passed by its
            // twin: the one the table holds stands, and a FAIL for this epoch would end it on D.
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
                self.release_fanout(&reply_to, None, now);
            }
        }
    }

    /// Whether P takes `register` on: room in the writer's inbox (waiting up to `ROOM_WAIT`)
    /// and in its host's quota. The quota slot it holds, or why not, for D.
    fn admit(&self, entry: &PeerEntry, register: &Register) -> Result<Slot, Unadmitted> {
        let key = &register.transfer_key;
        if let Err(full) = self.shared.inbox.wait_for_room(ROOM_WAIT) {
            Counters::add(&self.shared.counters.overloaded);
            return Err(Unadmitted::Overloaded {
                key: key.clone(),
                queued: full.queued,
                capacity: full.capacity,
            });
        }
        let bytes = registration_bytes(register);
        let host = entry.host;
        let budget = self.quota.bytes;
        Slot::take(&entry.held, bytes, self.quota).map_err(|over| match over {
            OverQuota::Entries => Unadmitted::TooManyRegistrations {
                key: key.clone(),
                host,
                entries: self.quota.entries,
            },
            OverQuota::Bytes { .. } if bytes > budget => {
                Unadmitted::TooLarge { key: key.clone(), bytes, budget }
            }
            OverQuota::Bytes { held } => {
                Unadmitted::OverBudget { key: key.clone(), host, held, bytes, budget }
            }
        })
    }

    /// A slot registration of a transfer written into several D ranks left the table unwritten
    /// (refused, or cancelled by D): its group goes if no slot holds a registration any more
    /// (see `fanout::release`).
    fn release_fanout(&self, register: &Register, fence: Option<FenceReason>, now: Instant) {
        if register.fanout <= 1 {
            return;
        }
        let key = TransferKey::from_canonical(&register.transfer_key);
        if let Some((base, _)) = key.split_slot() {
            fanout::release(&self.shared, &base, fence, now);
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
            Cancelled::Removed { registration, ready } => {
                if let (Some(registration), None) = (&registration, &ready) {
                    let fence = Some(FenceReason::Cancelled);
                    self.release_fanout(&registration.register, fence, now);
                }
                ready
            }
        };
        self.shared.send(Command::AcknowledgeCancel { peer, cancel, released });
    }
}

impl Control {
    /// Whether P (or D) takes on a peer that finished its handshake; see `peer_joined`.
    fn join(&self, peer: &PeerInfo) -> Result<(), Unjoined> {
        let hello = &peer.hello;
        if !hello.versions.contains(&PROTOCOL_VERSION) {
            return Err(Unjoined::Versions {
                engine_id: hello.engine_id.clone(),
                versions: hello.versions.clone(),
            });
        }
        if hello.compatibility != self.compatibility {
            return Err(Unjoined::Compatibility {
                engine_id: hello.engine_id.clone(),
                theirs: hello.compatibility.clone(),
                ours: self.compatibility.clone(),
            });
        }
        // P writes into every D that connects to it: refuse one whose KV cache our transport
        // cannot reach now, rather than fail each of its requests later.
        if let (true, MemoryKind::Vram, Some(unreachable)) =
            (peer.inbound, hello.memory.kind, &self.vram_refusal)
        {
            return Err(Unjoined::Unreachable {
                ours: self.memory,
                engine_id: hello.engine_id.clone(),
                theirs: hello.memory,
                source: unreachable.clone(),
            });
        }
        self.shared.health()?;
        if let Err(full) = self.shared.inbox.wait_for_room(ROOM_WAIT) {
            Counters::add(&self.shared.counters.overloaded);
            return Err(Unjoined::Overloaded { queued: full.queued, capacity: full.capacity });
        }
        // Last: a claim is released only by this peer's loss, which follows an `Ok` alone.
        let digest = agents::digest(&hello.agent_metadata);
        self.shared.agents.claim(&hello.engine_id, &hello.agent_name, digest)?;
        let host = peer.addr.ip();
        let held = Arc::clone(lock(&self.hosts).entry(host).or_default());
        let agent = hello.agent_name.clone();
        let entry = PeerEntry { owner: owner_of(hello), host, held, agent };
        lock(&self.peers).insert(peer.id, entry);
        if self.shared.send(Command::PeerJoined(peer.clone())) {
            Ok(())
        } else {
            lock(&self.peers).remove(&peer.id);
            self.shared.agents.release(&hello.agent_name);
            Err(Unjoined::ShuttingDown)
        }
    }
}

impl ControlHandler for Control {
    fn peer_joined(&self, peer: &PeerInfo) -> Result<(), Refusal> {
        Ok(self.join(peer)?)
    }

    fn message(&self, peer: PeerId, message: Message) {
        match message {
            Message::Register(register) => self.register(peer, register),
            // Dropped when not even ending work fits (counted): see the module docs.
            Message::Cancel(cancel) => {
                if self.shared.admit_ending().is_ok() {
                    self.cancel(peer, cancel);
                }
            }
            other => {
                if self.shared.admit_ending().is_ok() {
                    self.shared.send(Command::FromPeer(peer, other));
                }
            }
        }
    }

    fn peer_lost(&self, peer: PeerId, reason: &str) {
        let at = self.shared.now();
        if let Some(entry) = lock(&self.peers).remove(&peer) {
            self.shared.agents.release(&entry.agent);
        }
        self.shared.send(Command::PeerLost { peer, reason: reason.to_owned(), at });
    }

    fn refused(&self, _peer: Option<PeerId>, _error: &ProtocolError) {
        Counters::add(&self.shared.counters.refused_frames);
    }

    fn healthy(&self) -> Result<(), Refusal> {
        Ok(self.shared.health()?)
    }
}

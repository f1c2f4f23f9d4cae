//! P's send path: from a match of ready KV with D's registration to the request's `Send` event.
//!
//! The table's halves are defined here ([`Registration`], [`Ready`]); whichever arrives second
//! makes the match (`Endpoint::ready` on the engine thread, or `control` on the side channel's
//! reader), and the writer gets it as `Command::Write`. The writer then
//!
//! 1. begins the write in the table, which refuses a match that a cancel, an abort or a newer
//!    registration overtook;
//! 2. plans it against D's layout, checks D's lease (the fence: see `writer`) and posts the
//!    WRITE whose notification is the DONE;
//! 3. polls it every turn of its loop until the transport reports it done or failed, or it runs
//!    past `write_timeout` and is abandoned (quarantined when the transport cannot release it);
//! 4. finishes it in the table (which may hand back a re-registration that arrived meanwhile, to
//!    be written next, or a cancel that waited for the write, to acknowledge), tells D of a
//!    failure, and reports the send: one event per request, after the last slot of a transfer
//!    written into several D ranks (`fanout`).
//!
//! Halves that expire in the table, cancels D sent before a write began, and the writer's end
//! (close or panic) also end here. P's uses of each peer's transport agent are counted, so that a
//! reconnected D's agent is forgotten only once no connection or write uses it.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::planner::{BlockList, PlanRequest};
use crate::protocol::{
    unix_millis, Cancel, CancelAck, Done, Encoder, Fail, FailReason, Hello, Message, Register,
    Secret,
};
use crate::rendezvous::{Match, Outcome as TableOutcome, RendezvousError};
use crate::side_channel::PeerId;
use crate::sync::lock;
use crate::transport::{MemorySpace, Transport, WriteId, WriteState};

use super::agents;
use super::control::Slot;
use super::events::{Event, Outcome, Reason, Role, Timeline};
use super::writer::{Writer, BUSY_POLL};
use super::{Counters, EndpointConfig, ReadyKv, HORIZON_MARGIN};

/// How long a closing writer lets in-flight writes finish before abandoning them.
const DRAIN_ON_CLOSE: Duration = Duration::from_secs(2);

/// D's registration as P's table holds it.
#[derive(Debug)]
pub(crate) struct Registration {
    /// The side channel connection it came on (replies go back on it).
    pub(crate) peer: PeerId,
    /// The message itself.
    pub(crate) register: Register,
    /// When it arrived.
    pub(crate) at: Instant,
    /// The peer's quota slot it holds until dropped.
    pub(crate) _slot: Slot,
}

impl Registration {
    /// A FAIL for this registration.
    pub(crate) fn fail(&self, reason: FailReason, detail: String) -> Fail {
        Fail {
            transfer_key: self.register.transfer_key.clone(),
            request_id: self.register.request_id.clone(),
            epoch: self.register.epoch,
            reason,
            detail,
        }
    }
}

/// P's ready KV as the table holds it.
#[derive(Debug)]
pub(crate) struct Ready {
    pub(crate) kv: ReadyKv,
    pub(crate) at: Instant,
}

/// P: a posted WRITE.
#[derive(Debug)]
struct InFlight {
    write: WriteId,
    key: TransferKey,
    epoch: u64,
    registration: Registration,
    ready: Arc<Ready>,
    matched: Instant,
    posted: Instant,
    bytes: u64,
    runs: u32,
    /// The transport agent written to (the write holds one use of it).
    agent: String,
}

/// P: a posted WRITE's id, bytes, runs and the agent written to (see `Writer::post`).
type Posted = (WriteId, u64, u32, String);

/// P: why a WRITE was not posted: the FAIL reason for D, the code and detail for P's event.
type Refusal = (FailReason, Reason, String);

/// The send path's state in the writer.
pub(super) struct Sends {
    /// Where this worker's KV cache lives (the WRITEs' source).
    memory: MemorySpace,
    write_timeout: Duration,
    /// P posts only while D's proof of life is younger than this (`peer_timeout`).
    lease: Duration,
    /// Transport agents by name, with how many peers and writes use each: a reconnected D's new
    /// connection shares its agent with the old one until the old one's uses end.
    agents: HashMap<String, usize>,
    in_flight: Vec<InFlight>,
    /// Writes abandoned that the transport could not release: their blocks stay held.
    quarantined: Vec<InFlight>,
    /// Signs the DONEs that ride on the WRITEs.
    notifications: Encoder,
}

impl std::fmt::Debug for Sends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sends")
            .field("agents", &self.agents.len())
            .field("in_flight", &self.in_flight.len())
            .field("quarantined", &self.quarantined.len())
            .finish_non_exhaustive()
    }
}

impl Sends {
    /// `agent` is this worker's transport agent name, which its DONEs are signed as.
    pub(super) fn new(config: &EndpointConfig, agent: &str, secret: Option<Secret>) -> Self {
        Self {
            memory: config.memory,
            write_timeout: config.write_timeout,
            lease: config.peer_timeout,
            agents: HashMap::new(),
            in_flight: Vec::new(),
            quarantined: Vec::new(),
            notifications: Encoder::new(agent.to_owned(), secret),
        }
    }

    /// Whether a WRITE is in flight (the writer then polls busily).
    pub(super) fn writing(&self) -> bool {
        !self.in_flight.is_empty()
    }
}

impl<T: Transport> Writer<T> {
    /// One more use of the peer's transport agent, loading it on first use. An agent already
    /// loaded is shared only with a peer whose metadata is the same (a reconnect of the same
    /// process): a name is not an identity (see `agents`).
    pub(super) fn use_agent(&mut self, hello: &Hello) -> Result<String, String> {
        let digest = agents::digest(&hello.agent_metadata);
        if let Some(uses) = self.sends.agents.get_mut(&hello.agent_name) {
            self.shared.agents.load(&hello.engine_id, &hello.agent_name, digest)?;
            *uses += 1;
            return Ok(hello.agent_name.clone());
        }
        // Before the transport learns the peer: a metadata that another agent's name already
        // stands for must not replace (or join) that agent.
        self.shared.agents.load(&hello.engine_id, &hello.agent_name, digest)?;
        let name = match self.transport.add_peer(&hello.agent_metadata) {
            Ok(name) if name == hello.agent_name => name,
            loaded => {
                self.shared.agents.unload(&hello.agent_name);
                let name = loaded.map_err(|e| e.to_string())?;
                if !self.sends.agents.contains_key(&name) {
                    let _ = self.transport.remove_peer(&name);
                }
                return Err(format!(
                    "peer {}'s agent metadata names agent {name:?} but its hello says {:?}",
                    hello.engine_id, hello.agent_name
                ));
            }
        };
        self.sends.agents.insert(name.clone(), 1);
        Ok(name)
    }

    /// One use of `agent` ended; the last one forgets it.
    pub(super) fn release_agent(&mut self, agent: &str) {
        let Some(uses) = self.sends.agents.get_mut(agent) else { return };
        *uses -= 1;
        if *uses == 0 {
            self.sends.agents.remove(agent);
            let _ = self.transport.remove_peer(agent);
            self.shared.agents.unload(agent);
        }
    }

    /// A lost peer: nothing may be written to it; its waiting registrations go now.
    pub(super) fn purge_registrations(&mut self, peer: PeerId) {
        let purged = self.shared.table.purge(|r: &Registration| r.peer == peer, Instant::now());
        for _ in &purged {
            Counters::add(&self.shared.counters.purged_registrations);
        }
    }

    /// D's cancel was applied to the table before any write began: acknowledge it, and report
    /// the send of P's KV it released, if any.
    pub(super) fn acknowledge_cancel(
        &mut self,
        peer: PeerId,
        cancel: Cancel,
        released: Option<Arc<Ready>>,
    ) {
        if let Some(ready) = released {
            let reason = format!("D cancelled transfer {}", cancel.transfer_key);
            self.report_send(
                &ready,
                &cancel.transfer_key,
                Outcome::cancelled(Reason::Cancelled, reason),
                None,
            );
        }
        let ack = CancelAck {
            transfer_key: cancel.transfer_key,
            request_id: cancel.request_id,
            epoch: cancel.epoch,
            wrote: false,
        };
        self.send(peer, Message::CancelAck(ack));
    }

    fn report_send(
        &self,
        ready: &Ready,
        key: &str,
        outcome: Outcome,
        write: Option<(&InFlight, Instant)>,
    ) {
        let mut timeline = Timeline { ready: Some(self.seconds(ready.at)), ..Timeline::default() };
        let (mut bytes, mut runs) = (0, 0);
        if let Some((w, completed)) = write {
            timeline.registered = Some(self.seconds(w.registration.at));
            timeline.matched = Some(self.seconds(w.matched));
            timeline.posted = Some(self.seconds(w.posted));
            timeline.completed = Some(self.seconds(completed));
            bytes = w.bytes;
            runs = w.runs;
        }
        let mut key = TransferKey::from_canonical(key);
        let mut outcome = outcome;
        if let Some((base, _)) = key.split_slot() {
            // One slot of a transfer written into several D ranks: the send ends with its last.
            let mut groups = lock(&self.shared.fanouts);
            if let Some(group) = groups.get_mut(&base) {
                if !group.conclude(outcome, bytes, runs) {
                    return;
                }
                (outcome, bytes, runs) = group.result();
                groups.remove(&base);
                key = base;
            }
        }
        self.emit(Event {
            role: Role::Send,
            request_id: ready.kv.request_id.clone(),
            key,
            outcome,
            bytes,
            runs,
            timeline,
        });
    }

    /// Reports the send of a transfer whose every slot ended before any was written.
    pub(super) fn report_fanout(&self, base: TransferKey) {
        let Some(group) = lock(&self.shared.fanouts).remove(&base) else { return };
        let Some(ready) = group.ready() else { return };
        let (outcome, bytes, runs) = group.result();
        self.emit(Event {
            role: Role::Send,
            request_id: ready.kv.request_id.clone(),
            key: base,
            outcome,
            bytes,
            runs,
            timeline: Timeline { ready: Some(self.seconds(ready.at)), ..Timeline::default() },
        });
    }

    pub(super) fn write(&mut self, m: Match<Registration, Arc<Ready>>) {
        let matched = Instant::now();
        let Match { key, epoch, registration, ready } = m;
        if let Err(error) = self.shared.table.begin_write(&key, epoch) {
            // Superseded: the newer match is already queued. Fenced: whoever ended the transfer
            // got P's KV back and reports it; D only needs to hear that nothing is coming.
            if let RendezvousError::Fenced { reason, .. } = error {
                let fail = registration.fail(
                    FailReason::Cancelled,
                    format!("transfer {key} ended before its write began ({reason})"),
                );
                self.send(registration.peer, Message::Fail(fail));
            }
            return;
        }
        match self.post(&key, &registration, &ready) {
            Ok((write, bytes, runs, agent)) => self.sends.in_flight.push(InFlight {
                write,
                key,
                epoch,
                registration,
                ready,
                matched,
                posted: Instant::now(),
                bytes,
                runs,
                agent,
            }),
            Err((reason, why, detail)) => {
                let outcome = TableOutcome::Failed(detail.clone());
                let _ = self.shared.table.finish(&key, epoch, outcome, Instant::now());
                self.send(
                    registration.peer,
                    Message::Fail(registration.fail(reason, detail.clone())),
                );
                self.report_send(&ready, key.as_str(), Outcome::failed(why, detail), None);
            }
        }
    }

    /// Plans and posts one write; the error says why not, for D (the FAIL's reason) and for P's
    /// event (its reason code and detail).
    fn post(
        &mut self,
        key: &TransferKey,
        registration: &Registration,
        ready: &Ready,
    ) -> Result<Posted, Refusal> {
        if let Some(reason) = self.shared.dead.get() {
            let detail = format!("transfer {key}: {reason}");
            return Err((FailReason::ShuttingDown, Reason::WriterDied, detail));
        }
        let peer = self.peers.get(&registration.peer).ok_or_else(|| {
            let detail = format!("D's connection for transfer {key} is gone");
            (FailReason::Refused, Reason::PeerLost, detail)
        })?;
        let planner = peer
            .planner
            .as_ref()
            .map_err(|e| (FailReason::Incompatible, Reason::Incompatible, e.clone()))?;
        let agent = peer
            .agent
            .as_ref()
            .map_err(|e| (FailReason::WriteError, Reason::WriteError, e.clone()))?;
        let register = &registration.register;
        if register.num_tokens > ready.kv.num_tokens {
            return Err((
                FailReason::Refused,
                Reason::Refused,
                format!(
                    "transfer {key}: D asks for {} tokens but P computed {}",
                    register.num_tokens, ready.kv.num_tokens
                ),
            ));
        }
        let src: Vec<BlockList<'_>> = ready
            .kv
            .groups
            .iter()
            .map(|g| BlockList { first_token: g.first_token, ids: &g.block_ids })
            .collect();
        let dst: Vec<BlockList<'_>> = register
            .groups
            .iter()
            .map(|g| BlockList { first_token: g.first_token, ids: &g.block_ids })
            .collect();
        let request = PlanRequest {
            request: &register.request_id,
            num_tokens: register.num_tokens,
            src: &src,
            dst: &dst,
        };
        let plan = planner
            .plan(&request)
            .map_err(|e| (FailReason::Refused, Reason::Refused, e.to_string()))?;
        let runs = u32::try_from(plan.runs.len()).unwrap_or(u32::MAX);
        let done = Message::Done(Done {
            transfer_key: key.as_str().to_owned(),
            request_id: register.request_id.clone(),
            epoch: register.epoch,
            tp_rank: self.layout.tp_rank,
            tp_size: self.layout.tp_size,
            bytes: plan.stats.bytes,
            runs,
            nonce: register.nonce,
        });
        let notification = self.sends.notifications.encode(&done, unix_millis());
        let remote = peer.memory;
        // The lease, checked last, right before the post: D may have given these blocks up
        // once its proof of life is older than the lease (it then waits out our horizon).
        match self.side_channel.proof_age(registration.peer) {
            Some(age) if age < self.sends.lease => {}
            age => {
                Counters::add(&self.shared.counters.lapsed_leases);
                let age = age.map_or_else(|| "none".to_owned(), |age| format!("{age:.1?} old"));
                return Err((
                    FailReason::Refused,
                    Reason::LeaseLapsed,
                    format!(
                        "transfer {key}: D's last proof of life is {age}, past P's lease of \
                         {:?}; not writing into blocks D may have given up (is the link between \
                         P and D partitioned?)",
                        self.sends.lease
                    ),
                ));
            }
        }
        let checked = Instant::now();
        let write = self
            .transport
            .post_write(agent, &plan.runs, self.sends.memory, remote, &notification)
            .map_err(|e| {
                (FailReason::WriteError, Reason::WriteError, format!("transfer {key}: {e}"))
            })?;
        // The horizon's margin covers the moments between the check and the post; a process
        // stopped right there for longer (SIGSTOP, a VM pause) posted outside it. Nothing can
        // recall a posted WRITE: count it, so that an operator sees the fence was at risk.
        if checked.elapsed() > HORIZON_MARGIN {
            Counters::add(&self.shared.counters.late_posts);
        }
        let agent = agent.clone();
        *self.sends.agents.entry(agent.clone()).or_insert(0) += 1;
        Ok((write, plan.stats.bytes, runs, agent))
    }

    pub(super) fn poll_writes(&mut self) {
        let mut i = 0;
        while i < self.sends.in_flight.len() {
            let state = self.transport.poll_write(self.sends.in_flight[i].write);
            let timed_out = self.sends.in_flight[i].posted.elapsed() > self.sends.write_timeout;
            let result = match state {
                Ok(WriteState::InProgress) if !timed_out => {
                    i += 1;
                    continue;
                }
                Ok(WriteState::InProgress) => {
                    let w = self.sends.in_flight.swap_remove(i);
                    let reason = format!("write not done after {:?}", self.sends.write_timeout);
                    self.abandon(w, &reason);
                    continue;
                }
                Ok(WriteState::Done) => Ok(()),
                Err(e) => Err(e.to_string()),
            };
            let w = self.sends.in_flight.swap_remove(i);
            self.finish(w, result);
        }
    }

    /// Gives up on a write: failed once the transport released it, quarantined if it could not.
    /// Bytes the transport had already handed to the network may still arrive later, within its
    /// delivery bound, which the advertised horizon includes (`EndpointConfig::delivery_bound`).
    fn abandon(&mut self, w: InFlight, reason: &str) {
        if self.transport.abandon_write(w.write) {
            self.finish(w, Err(format!("{reason}; abandoned")));
        } else {
            self.quarantine(w, reason);
        }
    }

    /// A write the transport could not stop may still be moving bytes: neither side's blocks may
    /// be reused, ever. P's event says so (the engine keeps its source blocks), and so does D's
    /// FAIL (D keeps its destination blocks). The write's agent use is never given back.
    fn quarantine(&mut self, w: InFlight, reason: &str) {
        Counters::add(&self.shared.counters.quarantined_writes);
        let detail = format!(
            "transfer {}: {reason}, and the transport could not release the WRITE, which may \
             still be landing: P keeps its source blocks and D must keep its destination \
             blocks (quarantined)",
            w.key
        );
        self.send(
            w.registration.peer,
            Message::Fail(w.registration.fail(FailReason::Quarantined, detail.clone())),
        );
        let now = Instant::now();
        let finished =
            self.shared.table.finish(&w.key, w.epoch, TableOutcome::Failed(detail.clone()), now);
        self.report_send(&w.ready, w.key.as_str(), Outcome::quarantined(detail), Some((&w, now)));
        // A re-registration during the write is into other blocks: serve it.
        if let Some(m) = finished.ok().and_then(|finished| finished.rematch) {
            self.write(m);
        }
        self.sends.quarantined.push(w);
    }

    fn finish(&mut self, w: InFlight, result: Result<(), String>) {
        let now = Instant::now();
        self.release_agent(&w.agent.clone());
        let outcome = match &result {
            Ok(()) => TableOutcome::Done,
            Err(e) => TableOutcome::Failed(e.clone()),
        };
        let finished = self.shared.table.finish(&w.key, w.epoch, outcome, now);
        let event_outcome = match result {
            Ok(()) => Outcome::Done,
            Err(detail) => {
                let fail = w.registration.fail(FailReason::WriteError, detail.clone());
                self.send(w.registration.peer, Message::Fail(fail));
                Outcome::failed(Reason::WriteError, detail)
            }
        };
        let rematch = match finished {
            Ok(finished) => {
                if finished.cancel_acknowledged {
                    let ack = CancelAck {
                        transfer_key: w.key.as_str().to_owned(),
                        request_id: w.registration.register.request_id.clone(),
                        epoch: w.epoch,
                        wrote: true,
                    };
                    self.send(w.registration.peer, Message::CancelAck(ack));
                }
                finished.rematch
            }
            Err(_) => None,
        };
        match rematch {
            // D re-registered during the write: P's KV is still needed for the new blocks,
            // so this request's send is not over yet.
            Some(m) => self.write(m),
            None => self.report_send(&w.ready, w.key.as_str(), event_outcome, Some((&w, now))),
        }
    }

    /// Ends the table's halves whose TTL passed: D hears that P's KV was not ready in time, P's
    /// engine that no registration came.
    pub(super) fn expire_sends(&mut self, now: Instant) {
        for expired in self.shared.table.expire(now) {
            if let Some((_, registration)) = expired.registration {
                let fail = registration.fail(
                    FailReason::Expired,
                    format!("P's KV for transfer {} was not ready in time", expired.key),
                );
                self.send(registration.peer, Message::Fail(fail));
            }
            if let Some(ready) = expired.ready {
                let reason = format!("no registration from D for transfer {} in time", expired.key);
                let outcome = Outcome::cancelled(Reason::Expired, reason);
                self.report_send(&ready, expired.key.as_str(), outcome, None);
            }
        }
    }

    /// The writer died (see `Writer::die`): writes in flight are abandoned (or quarantined), and
    /// everything left in the table ends, writes in flight that the panic orphaned too.
    pub(super) fn fail_sends(&mut self, reason: &str, at: Instant) {
        for w in std::mem::take(&mut self.sends.in_flight) {
            self.abandon(w, reason);
        }
        for expired in self.shared.table.drain(at) {
            if let Some((_, registration)) = expired.registration {
                let fail = registration.fail(FailReason::ShuttingDown, reason.to_owned());
                self.send(registration.peer, Message::Fail(fail));
            }
            if let Some(ready) = expired.ready {
                self.report_send(
                    &ready,
                    expired.key.as_str(),
                    Outcome::failed(Reason::WriterDied, reason.to_owned()),
                    None,
                );
            }
        }
    }

    /// The endpoint closes: writes in flight get `DRAIN_ON_CLOSE` to finish, then are abandoned.
    pub(super) fn drain_writes(&mut self) {
        let deadline = Instant::now() + DRAIN_ON_CLOSE;
        while self.sends.writing() && Instant::now() < deadline {
            self.poll_writes();
            thread::sleep(BUSY_POLL);
        }
        for w in std::mem::take(&mut self.sends.in_flight) {
            self.abandon(w, "the endpoint closed during the write");
        }
    }
}

//! P's send path: from a match of ready KV with D's registration to the request's `Send` event.
//!
//! The table's halves ([`Registration`], [`Ready`]: see `halves`) meet in the table; whichever
//! arrives second makes the match (`Endpoint::ready` on the engine thread, or `control` on the side channel's
//! reader), and the writer gets it as `Command::Write`. The writer then
//!
//! 1. begins the write in the table, which refuses a match that a cancel, an abort or a newer
//!    registration overtook;
//! 2. plans it against D's layout, checks D's lease (the fence: see `writer`) and posts the
//!    WRITE whose notification is the DONE;
//! 3. polls it every turn of its loop until the transport reports it done or failed (one past
//!    `write_timeout` is reported quarantined, and held, before that turn drives the transport:
//!    a posted WRITE cannot be recalled, so it is never abandoned);
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

use crate::clock::BootInstant;
use std::ops::Range;

use crate::key::TransferKey;
use crate::planner::{BlockIndices, BlockList, PlanRequest};
use crate::protocol::{Cancel, CancelAck, Done, Encoder, FailReason, Hello, Message, Secret};
use crate::rendezvous::{FenceReason, Match, Outcome as TableOutcome, RendezvousError};
use crate::side_channel::PeerId;
use crate::sync::lock;
use crate::transport::{BlockWrite, MemorySpace, Transport, TransportError, WriteId, WriteState};

use super::agents::{self, UnusableAgent};
use super::context::Context;
use super::events::{Event, Outcome, Reason, Role, Timeline};
use super::fanout;
use super::halves::{Ready, Registration};
use super::{Counters, EndpointConfig, Shared, HORIZON_MARGIN};

mod layers;

use layers::{Partial, Stream, Streamed};

/// How long a closing writer lets in-flight writes finish before abandoning them.
pub(super) const DRAIN_ON_CLOSE: Duration = Duration::from_secs(2);

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
    /// `posted` on the boot-time clock: a WRITE's age counts a suspend too (see `clock`).
    posted_boot: BootInstant,
    bytes: u64,
    runs: u32,
    /// Of `bytes`, those written again (see `Event::rewritten_bytes`).
    rewritten: u64,
    /// The transport agent written to (the write holds one use of it).
    agent: String,
    /// Past its write timeout, and reported quarantined (see `notice_overdue_writes`).
    overdue: bool,
    /// What layer-wise push wrote before this WRITE (counted in `bytes` and `runs`).
    streamed: Streamed,
}

/// P: a posted WRITE (see `Sends::post`).
struct Posted {
    write: WriteId,
    bytes: u64,
    runs: u32,
    /// Of `bytes`, those of tokens an earlier chunk's WRITE wrote (`Planner::bytes_before`).
    rewritten: u64,
    /// The transport agent written to.
    agent: String,
}

/// What one WRITE of a transfer writes (see `Sends::post`): the regions `regions` (layout
/// order) of the tokens from `written` on.
#[derive(Debug, Clone)]
struct Span {
    regions: Range<usize>,
    /// Every region of the tokens before this one is in D already (0: none).
    written: u64,
}

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
    /// D connections other than the registration's own that asked to cancel a transfer whose
    /// WRITE is in flight (a D that lost P asks again on a new connection): each gets the
    /// CANCEL_ACK once the transport finished with the WRITE.
    ack_waiters: HashMap<(TransferKey, u64), Vec<PeerId>>,
    /// Signs the DONEs that ride on the WRITEs.
    notifications: Encoder,
    /// The block form of the WRITE being posted, reused from one request to the next.
    block_indices: BlockIndices,
    /// Layer-wise push: what was streamed into each registration before P's whole KV was
    /// ready (see `layers`), until the request's last WRITE.
    streams: HashMap<TransferKey, Stream>,
    /// Layer-wise push: posted WRITEs of some regions, which notify nobody.
    partials: Vec<Partial>,
}

impl std::fmt::Debug for Sends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sends")
            .field("agents", &self.agents.len())
            .field("in_flight", &self.in_flight.len())
            .field("ack_waiters", &self.ack_waiters.len())
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
            ack_waiters: HashMap::new(),
            notifications: Encoder::new(agent.to_owned(), secret),
            block_indices: BlockIndices::default(),
            streams: HashMap::new(),
            partials: Vec::new(),
        }
    }

    /// Whether a WRITE is in flight (the writer then polls busily).
    pub(super) fn writing(&self) -> bool {
        !self.in_flight.is_empty() || !self.partials.is_empty()
    }

    /// One more use of the peer's transport agent, loading it on first use. An agent already
    /// loaded is shared only with a peer whose metadata is the same (a reconnect of the same
    /// process): a name is not an identity (see `agents`).
    pub(super) fn use_agent<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        hello: &Hello,
    ) -> Result<String, UnusableAgent> {
        let digest = agents::digest(&hello.agent_metadata);
        if let Some(uses) = self.agents.get_mut(&hello.agent_name) {
            cx.shared.agents.load(&hello.engine_id, &hello.agent_name, digest)?;
            *uses += 1;
            return Ok(hello.agent_name.clone());
        }
        // Before the transport learns the peer: a metadata that another agent's name already
        // stands for must not replace (or join) that agent.
        cx.shared.agents.load(&hello.engine_id, &hello.agent_name, digest)?;
        let name = match cx.transport.add_peer(&hello.agent_metadata) {
            Ok(name) if name == hello.agent_name => name,
            loaded => {
                cx.shared.agents.unload(&hello.agent_name);
                let name = loaded?;
                if !self.agents.contains_key(&name) {
                    let _ = cx.transport.remove_peer(&name);
                }
                return Err(UnusableAgent::Misnamed {
                    engine_id: hello.engine_id.clone(),
                    loaded: name,
                    declared: hello.agent_name.clone(),
                });
            }
        };
        self.agents.insert(name.clone(), 1);
        Ok(name)
    }

    /// One use of `agent` ended; the last one forgets it.
    pub(super) fn release_agent<T: Transport>(&mut self, cx: &mut Context<T>, agent: &str) {
        let Some(uses) = self.agents.get_mut(agent) else { return };
        *uses -= 1;
        if *uses == 0 {
            self.agents.remove(agent);
            let _ = cx.transport.remove_peer(agent);
            cx.shared.agents.unload(agent);
        }
    }

    pub(super) fn write<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        m: Match<Registration, Arc<Ready>>,
    ) {
        let matched = cx.shared.now();
        let Match { key, epoch, registration, ready } = m;
        if let Err(error) = cx.shared.table.begin_write(&key, epoch) {
            // Superseded: the newer match is already queued. Fenced: whoever ended the transfer
            // got P's KV back and reports it; D only needs to hear that nothing is coming.
            if let RendezvousError::Fenced { reason, .. } = error {
                let fail = registration.fail(
                    FailReason::Cancelled,
                    format!("transfer {key} ended before its write began ({reason})"),
                );
                cx.send(registration.peer, Message::Fail(fail));
            }
            return;
        }
        let streamed = self.streamed(&key, epoch, &ready, cx.layout.regions.len());
        let posted = streamed.and_then(|streamed| {
            let span = Span { regions: streamed.from..usize::MAX, written: streamed.written };
            let posted = self.post(cx, &key, &registration, &ready, span, Some(streamed));
            posted.map(|posted| (posted, streamed))
        });
        match posted {
            Ok((posted, streamed)) => self.in_flight.push(InFlight {
                write: posted.write,
                key,
                epoch,
                registration,
                ready,
                matched,
                posted: cx.shared.now(),
                posted_boot: cx.shared.boot_now(),
                bytes: posted.bytes.saturating_add(streamed.bytes),
                runs: posted.runs.saturating_add(streamed.runs),
                rewritten: posted.rewritten.saturating_add(streamed.rewritten),
                agent: posted.agent,
                overdue: false,
                streamed,
            }),
            Err((reason, why, detail)) => {
                let outcome = TableOutcome::Failed(detail.clone());
                let finished = cx.shared.table.finish(&key, epoch, outcome, cx.shared.now());
                cx.send(
                    registration.peer,
                    Message::Fail(registration.fail(reason, detail.clone())),
                );
                let rematch = match finished {
                    Ok(finished) => {
                        let owed = finished.cancel_acknowledged.then_some(registration.peer);
                        let request_id = &registration.register.request_id;
                        self.acknowledge_cancels(cx, &key, epoch, request_id, owed, (false, false));
                        finished.rematch
                    }
                    Err(_) => None,
                };
                match rematch {
                    // D re-registered meanwhile: P's KV is still needed for the new blocks.
                    Some(m) => self.write(cx, m),
                    None => {
                        report_send(cx, &ready, key.as_str(), Outcome::failed(why, detail), None);
                    }
                }
            }
        }
    }

    /// Plans and posts a WRITE of `span`: its regions (the end clamped to the layouts') of the
    /// tokens from its `written` on (from D's block holding the one before; 0: all).
    /// With `done`, the WRITE carries the request's DONE, whose bytes and runs count those
    /// streamed before it (see `layers`); with `None` it notifies nobody (one layer of a
    /// stream, of the tokens `ready` holds: a chunk of the prompt, maybe). The error says why
    /// not, for D (the FAIL's reason) and for P's event (its reason code and detail).
    fn post<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: &TransferKey,
        registration: &Registration,
        ready: &Ready,
        Span { regions, written }: Span,
        done: Option<Streamed>,
    ) -> Result<Posted, Refusal> {
        if let Some(reason) = cx.shared.dead.get() {
            let detail = format!("transfer {key}: {reason}");
            return Err((FailReason::ShuttingDown, Reason::WriterDied, detail));
        }
        let peer = cx.peers.get(&registration.peer).ok_or_else(|| {
            let detail = format!("D's connection for transfer {key} is gone");
            (FailReason::Refused, Reason::PeerLost, detail)
        })?;
        let planner = peer
            .planner
            .as_ref()
            .map_err(|e| (FailReason::Incompatible, Reason::Incompatible, e.to_string()))?;
        let agent = peer
            .agent
            .as_ref()
            .map_err(|e| (FailReason::WriteError, Reason::WriteError, e.to_string()))?;
        let register = &registration.register;
        if done.is_some() && register.num_tokens > ready.kv.num_tokens {
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
        // A stream's chunk of the prompt writes its own tokens; what earlier chunks wrote is
        // not written again, but for D's block holding the last of them.
        let num_tokens = register.num_tokens.min(ready.kv.num_tokens);
        let dst = if written > 0 || num_tokens < register.num_tokens {
            planner.narrow_destination(&dst, written, num_tokens)
        } else {
            dst
        };
        let request =
            PlanRequest { request: &register.request_id, num_tokens, src: &src, dst: &dst };
        // Clamped to the layouts': a stream that took every region leaves an empty last WRITE.
        let end = regions.end.min(planner.region_count());
        let regions = regions.start.min(end)..end;
        let plan = planner
            .plan_regions(&request, regions.clone())
            .map_err(|e| (FailReason::Refused, Reason::Refused, e.to_string()))?;
        let rewritten = planner.bytes_before(&dst, written.min(num_tokens), regions.clone());
        // Whole blocks of layouts that match block for block also go as block indices, which a
        // transport with prepared descriptor lists posts without building descriptors. Worked
        // out here, before the lease check, to keep the check close to the post.
        let blocks = planner.block_tables().filter(|_| {
            planner.block_indices_of_regions_into(&request, regions, &mut self.block_indices)
        });
        let runs = u32::try_from(plan.runs.len()).unwrap_or(u32::MAX);
        let notification = done.map(|earlier| {
            let done = Message::Done(Done {
                transfer_key: key.as_str().to_owned(),
                request_id: register.request_id.clone(),
                epoch: register.epoch,
                tp_rank: cx.layout.tp_rank,
                tp_size: cx.layout.tp_size,
                bytes: plan.stats.bytes.saturating_add(earlier.bytes),
                runs: runs.saturating_add(earlier.runs),
                nonce: register.nonce,
            });
            self.notifications.encode(&done, cx.shared.unix_millis())
        });
        let remote = peer.memory;
        // The lease, checked last, right before the post: D may have given these blocks up
        // once its proof of life is older than the lease (it then waits out our horizon).
        match cx.side_channel.proof_age(registration.peer) {
            Some(age) if age < self.lease => {}
            age => {
                Counters::add(&cx.shared.counters.lapsed_leases);
                let age = age.map_or_else(|| "none".to_owned(), |age| format!("{age:.1?} old"));
                return Err((
                    FailReason::Refused,
                    Reason::LeaseLapsed,
                    format!(
                        "transfer {key}: D's last proof of life is {age}, past P's lease of \
                         {:?}; not writing into blocks D may have given up (is the link between \
                         P and D partitioned?)",
                        self.lease
                    ),
                ));
            }
        }
        let checked = cx.shared.now();
        let posted = match blocks {
            Some((src_blocks, dst_blocks)) => {
                let write = BlockWrite {
                    runs: &plan.runs,
                    src_blocks,
                    dst_blocks,
                    src: self.block_indices.src(),
                    dst: self.block_indices.dst(),
                };
                let notification = notification.as_deref();
                cx.transport.post_block_write(agent, &write, self.memory, remote, notification)
            }
            None => {
                let notification = notification.as_deref();
                cx.transport.post_write(agent, &plan.runs, self.memory, remote, notification)
            }
        };
        let write = posted.map_err(|e| {
            (FailReason::WriteError, Reason::WriteError, format!("transfer {key}: {e}"))
        })?;
        // The horizon's margin covers the moments between the check and the post; a process
        // stopped right there for longer (SIGSTOP, a VM pause) posted outside it. Nothing can
        // recall a posted WRITE: count it, so that an operator sees the fence was at risk.
        if cx.shared.now().saturating_duration_since(checked) > HORIZON_MARGIN {
            Counters::add(&cx.shared.counters.late_posts);
        }
        let agent = agent.clone();
        *self.agents.entry(agent.clone()).or_insert(0) += 1;
        Ok(Posted { write, bytes: plan.stats.bytes, runs, rewritten, agent })
    }

    /// Writes past their write timeout, before anything drives the transport this turn: each
    /// is counted and reported quarantined once (not again where a WRITE of the request's
    /// stream was: one notice per request), and stays held, its source blocks and its table
    /// entry, until the transport reports it finished. A WRITE cannot be recalled: releasing an
    /// unfinished one tells NIXL to forget it, not UCX to stop moving its bytes, so P says
    /// nothing to D (no FAIL, no CANCEL_ACK) before the transport is done with it, and D holds
    /// its blocks until then.
    pub(super) fn notice_overdue_writes<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        now: BootInstant,
    ) {
        let timeout = self.write_timeout;
        let overdue: Vec<usize> = (0..self.in_flight.len())
            .filter(|&i| {
                let w = &self.in_flight[i];
                !w.overdue && now.saturating_duration_since(w.posted_boot) > timeout
            })
            .collect();
        for i in overdue {
            self.in_flight[i].overdue = true;
            Counters::add(&cx.shared.counters.quarantined_writes);
            let w = &self.in_flight[i];
            if w.streamed.noticed {
                continue;
            }
            let Some(key) = notice_key(cx, &w.key) else { continue };
            let detail = format!(
                "transfer {key}: the WRITE is not done after {timeout:?} (a stalled process or link, \
                 or a slow peer); P keeps its source blocks, and D its destination blocks, until \
                 the transport has finished with it"
            );
            let event = Event {
                role: Role::Send,
                request_id: w.ready.kv.request_id.clone(),
                key,
                outcome: Outcome::quarantined(detail),
                bytes: w.bytes,
                runs: w.runs,
                streamed_bytes: w.streamed.bytes,
                rewritten_bytes: w.rewritten,
                timeline: Timeline {
                    ready: Some(cx.seconds(w.ready.at)),
                    posted: Some(cx.seconds(w.posted)),
                    ..Timeline::default()
                },
            };
            cx.emit(event);
        }
        self.notice_overdue_partials(cx, now);
    }

    /// Polls the requests' WRITEs and the streams' (see `poll_partials`); each finished one
    /// ends.
    pub(super) fn poll_writes<T: Transport>(&mut self, cx: &mut Context<T>) {
        for (w, result) in finished(&mut cx.transport, &mut self.in_flight, |w| w.write) {
            self.finish(cx, w, result);
        }
        self.poll_partials(cx);
    }

    fn finish<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        w: InFlight,
        result: Result<(), TransportError>,
    ) {
        let delivered = result.is_ok();
        let now = cx.shared.now();
        self.release_agent(cx, &w.agent.clone());
        // The table and the events keep the failure's text.
        let result = result.map_err(|e| e.to_string());
        let outcome = match &result {
            Ok(()) => TableOutcome::Done,
            Err(e) => TableOutcome::Failed(e.clone()),
        };
        let finished = cx.shared.table.finish(&w.key, w.epoch, outcome, now);
        let event_outcome = match result {
            Ok(()) => Outcome::Done,
            Err(detail) => {
                let fail = w.registration.fail(FailReason::WriteError, detail.clone());
                cx.send(w.registration.peer, Message::Fail(fail));
                Outcome::failed(Reason::WriteError, detail)
            }
        };
        let rematch = match finished {
            Ok(finished) => {
                let owed = finished.cancel_acknowledged.then_some(w.registration.peer);
                let request_id = &w.registration.register.request_id;
                self.acknowledge_cancels(cx, &w.key, w.epoch, request_id, owed, (true, delivered));
                finished.rematch
            }
            Err(_) => None,
        };
        match rematch {
            // D re-registered during the write: P's KV is still needed for the new blocks,
            // so this request's send is not over yet.
            Some(m) => self.write(cx, m),
            None => report_send(cx, &w.ready, w.key.as_str(), event_outcome, Some((&w, now))),
        }
    }

    /// The writer died (see `Writer::die`): nothing will drive the transport again, so the
    /// writes in flight move no more of P's bytes and their sends fail (P's blocks are free).
    /// D is told nothing of them: its word would claim the transport finished, and it did not;
    /// D holds their blocks until it finds this endpoint gone. Everything left in the table
    /// ends, and D hears of registrations that were never written.
    pub(super) fn fail_sends<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        reason: &str,
        at: Instant,
    ) {
        for w in std::mem::take(&mut self.in_flight) {
            self.cut(cx, w, reason, at);
        }
        self.cut_partials(cx, &Outcome::failed(Reason::WriterDied, reason.to_owned()));
        for expired in cx.shared.table.drain(at) {
            if let Some((_, registration)) = expired.registration {
                let fail = registration.fail(FailReason::ShuttingDown, reason.to_owned());
                cx.send(registration.peer, Message::Fail(fail));
            }
            if let Some(ready) = expired.ready {
                report_send(
                    cx,
                    &ready,
                    expired.key.as_str(),
                    Outcome::failed(Reason::WriterDied, reason.to_owned()),
                    None,
                );
            }
        }
    }

    /// A write the transport will never be driven for again (the writer died or closes):
    /// its send fails; D is not told (see `fail_sends`).
    fn cut<T: Transport>(&mut self, cx: &mut Context<T>, w: InFlight, reason: &str, at: Instant) {
        let detail = format!("transfer {}: {reason}; the WRITE was not finished", w.key);
        let _ = cx.shared.table.finish(&w.key, w.epoch, TableOutcome::Failed(detail.clone()), at);
        self.ack_waiters.remove(&(w.key.clone(), w.epoch));
        let outcome = Outcome::failed(Reason::WriterDied, detail);
        report_send(cx, &w.ready, w.key.as_str(), outcome, Some((&w, at)));
    }

    /// The endpoint closes: writes in flight get `DRAIN_ON_CLOSE` to finish, polled every
    /// `poll`; the rest are cut (the transport is dropped with the writer, and D finds the
    /// endpoint gone).
    pub(super) fn drain_writes<T: Transport>(&mut self, cx: &mut Context<T>, poll: Duration) {
        let deadline = cx.shared.now() + DRAIN_ON_CLOSE;
        while self.writing() && cx.shared.now() < deadline {
            self.poll_writes(cx);
            thread::sleep(poll);
        }
        let at = cx.shared.now();
        let reason = "the endpoint closed during the write";
        for w in std::mem::take(&mut self.in_flight) {
            self.cut(cx, w, reason, at);
        }
        self.cut_partials(cx, &Outcome::failed(Reason::WriterDied, reason.to_owned()));
    }

    /// The transport is done with (`key`, `epoch`)'s WRITE (it `wrote`, or never posted it; it
    /// `delivered` every byte, or not): every D connection that asked to cancel it meanwhile gets
    /// its CANCEL_ACK now, `owed` (the registration's own, when the table recorded its cancel)
    /// included.
    fn acknowledge_cancels<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        key: &TransferKey,
        epoch: u64,
        request_id: &str,
        owed: Option<PeerId>,
        (wrote, delivered): (bool, bool),
    ) {
        let mut asked = self.ack_waiters.remove(&(key.clone(), epoch)).unwrap_or_default();
        asked.extend(owed);
        asked.sort_unstable();
        asked.dedup();
        for peer in asked {
            let ack = CancelAck {
                transfer_key: key.as_str().to_owned(),
                request_id: request_id.to_owned(),
                epoch,
                wrote,
                delivered,
            };
            cx.send(peer, Message::CancelAck(ack));
        }
    }

    /// D asked, on connection `peer`, to cancel a transfer whose WRITE is in flight: it gets
    /// the CANCEL_ACK when the transport finished with the WRITE (see `finish`).
    pub(super) fn acknowledge_when_written<T: Transport>(
        &mut self,
        cx: &mut Context<T>,
        peer: PeerId,
        cancel: Cancel,
    ) {
        let key = TransferKey::from_canonical(&cancel.transfer_key);
        let writing = self.in_flight.iter().any(|w| w.key == key && w.epoch == cancel.epoch)
            || self.streaming(&key, cancel.epoch);
        if writing {
            self.ack_waiters.entry((key, cancel.epoch)).or_default().push(peer);
        } else {
            // It finished between the table's answer and this command: acknowledge now.
            let ack = CancelAck {
                transfer_key: cancel.transfer_key,
                request_id: cancel.request_id,
                epoch: cancel.epoch,
                wrote: true,
                // Whether it completed is not known here: D does not count it delivered.
                delivered: false,
            };
            cx.send(peer, Message::CancelAck(ack));
        }
    }
}

/// A lost peer: nothing may be written to it; its waiting registrations go now.
pub(super) fn purge_registrations<T: Transport>(cx: &mut Context<T>, peer: PeerId) {
    let now = cx.shared.now();
    let purged = cx.shared.table.purge(|r: &Registration| r.peer == peer, now);
    for (key, _, _) in &purged {
        Counters::add(&cx.shared.counters.purged_registrations);
        release_slot(&cx.shared, key, FenceReason::Cancelled, now);
    }
}

/// D's cancel was applied to the table before any write began: acknowledge it, and report
/// the send of P's KV it released, if any.
pub(super) fn acknowledge_cancel<T: Transport>(
    cx: &mut Context<T>,
    peer: PeerId,
    cancel: Cancel,
    released: Option<Arc<Ready>>,
) {
    if let Some(ready) = released {
        let reason = format!("D cancelled transfer {}", cancel.transfer_key);
        report_send(
            cx,
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
        delivered: false,
    };
    cx.send(peer, Message::CancelAck(ack));
}

fn report_send<T: Transport>(
    cx: &Context<T>,
    ready: &Ready,
    key: &str,
    outcome: Outcome,
    write: Option<(&InFlight, Instant)>,
) {
    let mut timeline = Timeline { ready: Some(cx.seconds(ready.at)), ..Timeline::default() };
    let (mut bytes, mut runs, mut streamed_bytes, mut rewritten_bytes) = (0, 0, 0, 0);
    if let Some((w, completed)) = write {
        timeline.registered = Some(cx.seconds(w.registration.at));
        timeline.streamed = w.streamed.first_posted.map(|at| cx.seconds(at));
        streamed_bytes = w.streamed.bytes;
        timeline.matched = Some(cx.seconds(w.matched));
        timeline.posted = Some(cx.seconds(w.posted));
        timeline.completed = Some(cx.seconds(completed));
        bytes = w.bytes;
        runs = w.runs;
        rewritten_bytes = w.rewritten;
    }
    let mut key = TransferKey::from_canonical(key);
    let mut outcome = outcome;
    if let Some((base, _)) = key.split_slot() {
        // One slot of a transfer written into several D ranks: the send ends with its last.
        let mut groups = lock(&cx.shared.fanouts);
        let Some(group) = groups.get_mut(&base) else {
            // An abort removed the group as this slot's WRITE ended (it found the slot gone
            // from the table, released the others and answered `Released`): the send's end
            // was that answer, and the engine has freed the blocks. No second end.
            return;
        };
        group.add_streamed(streamed_bytes, rewritten_bytes);
        if !group.conclude(outcome, bytes, runs) {
            return;
        }
        (outcome, bytes, runs) = group.result();
        (streamed_bytes, rewritten_bytes) = group.streamed_and_rewritten();
        groups.remove(&base);
        key = base;
    }
    cx.emit(Event {
        role: Role::Send,
        request_id: ready.kv.request_id.clone(),
        key,
        outcome,
        bytes,
        runs,
        streamed_bytes,
        rewritten_bytes,
        timeline,
    });
}

/// The key a quarantine notice of `key`'s overdue WRITE goes under, if the request still owes
/// one: a transfer written into several D ranks gives one, under its own key, for the first of
/// its slots' WRITEs to be overdue (and none once its group ended: the send was reported).
fn notice_key<T: Transport>(cx: &Context<T>, key: &TransferKey) -> Option<TransferKey> {
    let Some((base, _)) = key.split_slot() else { return Some(key.clone()) };
    let mut groups = lock(&cx.shared.fanouts);
    groups.get_mut(&base)?.take_notice().then_some(base)
}

/// Reports the send of a transfer whose every slot ended before any was written.
pub(super) fn report_fanout<T: Transport>(cx: &Context<T>, base: TransferKey) {
    let Some(group) = lock(&cx.shared.fanouts).remove(&base) else { return };
    let Some(ready) = group.ready() else { return };
    let (outcome, bytes, runs) = group.result();
    cx.emit(Event {
        role: Role::Send,
        request_id: ready.kv.request_id.clone(),
        key: base,
        outcome,
        bytes,
        runs,
        streamed_bytes: 0,
        rewritten_bytes: 0,
        timeline: Timeline { ready: Some(cx.seconds(ready.at)), ..Timeline::default() },
    });
}

/// A match that will not be written (the endpoint closes): D hears that nothing was posted,
/// and P's engine gets its blocks back. A match the table no longer holds is whoever
/// overtook it's to report (as in `write`).
pub(super) fn refuse_match<T: Transport>(
    cx: &mut Context<T>,
    m: Match<Registration, Arc<Ready>>,
    why: &str,
) {
    let Match { key, epoch, registration, ready } = m;
    let detail = format!("transfer {key}: {why} before its WRITE was posted");
    match cx.shared.table.begin_write(&key, epoch) {
        Ok(()) => {
            let outcome = TableOutcome::Failed(detail.clone());
            let _ = cx.shared.table.finish(&key, epoch, outcome, cx.shared.now());
            let fail = registration.fail(FailReason::ShuttingDown, detail.clone());
            cx.send(registration.peer, Message::Fail(fail));
            report_send(cx, &ready, key.as_str(), Outcome::failed(Reason::Closed, detail), None);
        }
        Err(RendezvousError::Fenced { .. }) => {
            let fail = registration.fail(FailReason::Cancelled, detail);
            cx.send(registration.peer, Message::Fail(fail));
        }
        Err(_) => {}
    }
}

/// Ends the table's halves whose TTL passed: D hears that P's KV was not ready in time, P's
/// engine that no registration came.
pub(super) fn expire_sends<T: Transport>(cx: &mut Context<T>, now: Instant) {
    // (The writer then forgets the streams of transfers that ended: `Sends::prune_streams`.)
    for expired in cx.shared.table.expire(now) {
        if let Some((_, registration)) = expired.registration {
            let fail = registration.fail(
                FailReason::Expired,
                format!("P's KV for transfer {} was not ready in time", expired.key),
            );
            cx.send(registration.peer, Message::Fail(fail));
            release_slot(&cx.shared, &expired.key, FenceReason::Expired, now);
        }
        if let Some(ready) = expired.ready {
            let reason = format!("no registration from D for transfer {} in time", expired.key);
            let outcome = Outcome::cancelled(Reason::Expired, reason);
            report_send(cx, &ready, expired.key.as_str(), outcome, None);
        }
    }
}

/// Polls each of `writes` once and takes out those the transport finished, each with its
/// result, in no particular order. Allocates only when some finished.
fn finished<T: Transport + ?Sized, W>(
    transport: &mut T,
    writes: &mut Vec<W>,
    id: impl Fn(&W) -> WriteId,
) -> Vec<(W, Result<(), TransportError>)> {
    let mut done = Vec::new();
    let mut i = 0;
    while i < writes.len() {
        let result = match transport.poll_write(id(&writes[i])) {
            Ok(WriteState::InProgress) => {
                i += 1;
                continue;
            }
            Ok(WriteState::Done) => Ok(()),
            Err(e) => Err(e),
        };
        done.push((writes.swap_remove(i), result));
    }
    done
}

/// A registration under `key` left the table unwritten: if `key` is a slot of a transfer
/// written into several D ranks, its group may go with it (returned; see `fanout::release`).
fn release_slot(
    shared: &Shared,
    key: &TransferKey,
    fence: FenceReason,
    now: Instant,
) -> Option<fanout::FanOut> {
    let (base, _) = key.split_slot()?;
    fanout::release(shared, &base, Some(fence), now)
}

//! The two engines' memory and requests, and the properties checked against them: every byte
//! that lands in D's memory is checked when it lands (the canary), every event when it is
//! reported, and every request's end once the schedule healed.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::endpoint::events::{Event, Outcome, Role};

use super::plan::Side;

/// Blocks in each engine's pool (per KV region): small, so that D reuses blocks often.
pub(super) const POOL: u32 = 16;

/// How a request ended on one side, as the engines count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ending {
    /// Its final event said done.
    Done,
    /// Its final event said failed.
    Failed,
    /// Its final event said cancelled.
    Cancelled,
    /// The endpoint refused the call (`expect` or `ready` returned an error): no event comes.
    Refused,
    /// P: `abort` released it (no event comes).
    Released,
    /// P: its process was killed with it.
    Lost,
    /// P: its process was dead when the KV would have been ready.
    Skipped,
}

/// D's view of one request.
#[derive(Debug)]
pub(super) enum DState {
    /// Not expected yet (its time has not come, or no blocks were free).
    Waiting,
    /// `expect` was called: D's engine holds `blocks` for it until its final event.
    Awaiting {
        blocks: Vec<u32>,
        cancel_sent: bool,
        notice: bool,
    },
    Ended(Ending),
}

/// P's view of one request.
#[derive(Debug)]
pub(super) enum PState {
    Waiting,
    /// P incarnation `incarnation` computes the request (layer-wise push: `streamed` of its
    /// regions handed over so far) or called `ready` (`offered`); its engine holds `blocks`
    /// (the source) until the request's final event (or `abort` released it).
    Readied {
        incarnation: u32,
        blocks: Vec<u32>,
        offered: bool,
        streamed: u64,
        abort_sent: bool,
        notice: bool,
    },
    Ended(Ending),
}

/// The engines' state; see the module docs.
#[derive(Debug)]
pub(super) struct World {
    pub(super) ids: BTreeMap<String, usize>,
    pub(super) d: Vec<DState>,
    pub(super) p: Vec<PState>,
    /// D's final event of each request, as `outcome (reason)`, once reported.
    d_final: Vec<Option<String>>,
    /// D's blocks: which request holds each (by index), and whose bytes it holds.
    d_owner: Vec<Option<usize>>,
    d_bytes: Vec<Option<usize>>,
    /// Each P incarnation's blocks: which request holds each.
    p_owner: BTreeMap<u32, Vec<Option<usize>>>,
    /// Safety violations, as found.
    pub(super) violations: Vec<String>,
    /// Quarantine notices reported, P's and D's.
    pub(super) notices: [u64; 2],
}

impl World {
    pub(super) fn new(ids: &[String]) -> Self {
        Self {
            ids: ids.iter().enumerate().map(|(i, id)| (id.clone(), i)).collect(),
            d: ids.iter().map(|_| DState::Waiting).collect(),
            p: ids.iter().map(|_| PState::Waiting).collect(),
            d_final: ids.iter().map(|_| None).collect(),
            d_owner: vec![None; POOL as usize],
            d_bytes: vec![None; POOL as usize],
            p_owner: BTreeMap::new(),
            violations: Vec::new(),
            notices: [0, 0],
        }
    }

    /// `count` free blocks of `side`'s pool (P's: of `incarnation`), chosen with `pick`, or
    /// none if too few are free. They are held for request `request` from now on.
    pub(super) fn allocate(
        &mut self,
        side: Side,
        incarnation: u32,
        request: usize,
        count: usize,
        mut pick: impl FnMut(usize) -> usize,
    ) -> Option<Vec<u32>> {
        let owners = match side {
            Side::D => &mut self.d_owner,
            Side::P => self.p_owner.entry(incarnation).or_insert_with(|| vec![None; POOL as usize]),
        };
        let mut free: Vec<u32> = (0..POOL).filter(|&b| owners[b as usize].is_none()).collect();
        if free.len() < count {
            return None;
        }
        let mut blocks = Vec::with_capacity(count);
        for _ in 0..count {
            let block = free.swap_remove(pick(free.len()));
            owners[block as usize] = Some(request);
            blocks.push(block);
        }
        if side == Side::D {
            for &block in &blocks {
                self.d_bytes[block as usize] = None;
            }
        }
        Some(blocks)
    }

    /// Gives `blocks` back to `side`'s pool.
    pub(super) fn release(&mut self, side: Side, incarnation: u32, blocks: &[u32]) {
        let owners = match side {
            Side::D => &mut self.d_owner,
            Side::P => match self.p_owner.get_mut(&incarnation) {
                Some(owners) => owners,
                None => return,
            },
        };
        for &block in blocks {
            owners[block as usize] = None;
        }
    }

    fn violation(&mut self, at: std::time::Duration, text: String) {
        let mut line = String::new();
        let _ = write!(line, "[{:>10.4}s] VIOLATION: {text}", at.as_secs_f64());
        self.violations.push(line);
    }

    /// The canary: bytes of request `request`'s WRITE land in D's block `block`. D must still
    /// await that request (no final event reported yet) and hold that block for it.
    pub(super) fn land(&mut self, at: std::time::Duration, request: usize, block: u32) {
        let id = self.id(request);
        let awaiting = match &self.d[request] {
            DState::Awaiting { blocks, .. } => Some(blocks.contains(&block)),
            _ => None,
        };
        match awaiting {
            Some(true) if self.d_owner[block as usize] == Some(request) => {
                self.d_bytes[block as usize] = Some(request);
            }
            Some(_) => self.violation(
                at,
                format!("bytes of {id} landed in D block {block}, which D does not hold for it"),
            ),
            None => {
                let handed_back = self.d_final[request].clone().unwrap_or_else(|| "none".into());
                let holder = self.d_owner[block as usize].map(|r| self.id(r));
                self.violation(
                    at,
                    format!(
                        "bytes of {id} landed in D block {block} after D's final event for {id} \
                         [{handed_back}] handed its blocks back; the block is now held by \
                         {holder:?}"
                    ),
                );
            }
        }
    }

    /// P's transport reads source block `block` of incarnation `incarnation` for request
    /// `request`'s WRITE: P's engine must still hold it for that request.
    pub(super) fn read(
        &mut self,
        at: std::time::Duration,
        incarnation: u32,
        request: usize,
        block: u32,
    ) {
        let held = match &self.p[request] {
            PState::Readied { incarnation: i, blocks, .. } => {
                *i == incarnation && blocks.contains(&block)
            }
            _ => false,
        };
        let owner = self.p_owner.get(&incarnation).and_then(|o| o[block as usize]);
        if !held || owner != Some(request) {
            let id = self.id(request);
            let state = format!("{:?}", self.p[request]);
            self.violation(
                at,
                format!(
                    "P's WRITE of {id} read source block {block} after P's engine was told it \
                     could free it (P: {state})"
                ),
            );
        }
    }

    /// The request P incarnation `incarnation`'s engine holds `block` for.
    pub(super) fn p_holder(&self, incarnation: u32, block: u32) -> Option<usize> {
        self.p_owner.get(&incarnation).and_then(|owners| owners.get(block as usize).copied()?)
    }

    pub(super) fn id(&self, request: usize) -> String {
        self.ids.iter().find(|(_, &i)| i == request).map_or_else(String::new, |(id, _)| id.clone())
    }

    /// An event `side`'s endpoint (P's: incarnation `incarnation`) reported at `at`.
    pub(super) fn on_event(
        &mut self,
        at: std::time::Duration,
        side: Side,
        incarnation: u32,
        event: &Event,
    ) {
        let Some(&request) = self.ids.get(&event.request_id) else {
            self.violation(
                at,
                format!("{side:?} reported an event for an unknown request: {event:?}"),
            );
            return;
        };
        let expected = match side {
            Side::P => Role::Send,
            Side::D => Role::Receive,
        };
        if event.role != expected {
            self.violation(at, format!("{side:?} reported a {:?} event: {event:?}", event.role));
            return;
        }
        let ending = match &event.outcome {
            Outcome::Quarantined(_) => None,
            Outcome::Done => Some(Ending::Done),
            Outcome::Failed(_) => Some(Ending::Failed),
            Outcome::Cancelled(_) => Some(Ending::Cancelled),
        };
        match side {
            Side::D => self.on_receive(at, request, ending, event),
            Side::P => self.on_send(at, incarnation, request, ending, event),
        }
    }

    fn on_receive(
        &mut self,
        at: std::time::Duration,
        request: usize,
        ending: Option<Ending>,
        event: &Event,
    ) {
        let DState::Awaiting { blocks, notice, .. } = &mut self.d[request] else {
            let state = format!("{:?}", self.d[request]);
            self.violation(at, format!("D reported {event:?} for a request in state {state}"));
            return;
        };
        let Some(ending) = ending else {
            if std::mem::replace(notice, true) {
                self.violation(at, format!("D reported a second quarantine notice: {event:?}"));
            }
            self.notices[Side::D.index()] += 1;
            return;
        };
        let blocks = std::mem::take(blocks);
        self.d_final[request] = Some(match event.outcome.cause() {
            Some(cause) => format!("{ending:?}, {}", cause.reason.code()),
            None => format!("{ending:?}"),
        });
        if ending == Ending::Done {
            let missing: Vec<u32> = blocks
                .iter()
                .copied()
                .filter(|&b| self.d_bytes[b as usize] != Some(request))
                .collect();
            if !missing.is_empty() {
                let id = self.id(request);
                self.violation(
                    at,
                    format!("D reported {id} done without its bytes in blocks {missing:?}"),
                );
            }
        }
        // D's final event: its engine hands the blocks back (vLLM frees or reuses them now).
        self.release(Side::D, 0, &blocks);
        self.d[request] = DState::Ended(ending);
    }

    fn on_send(
        &mut self,
        at: std::time::Duration,
        incarnation: u32,
        request: usize,
        ending: Option<Ending>,
        event: &Event,
    ) {
        let PState::Readied {
            incarnation: readied_by, blocks, notice, offered, abort_sent, ..
        } = &mut self.p[request]
        else {
            let state = format!("{:?}", self.p[request]);
            self.violation(at, format!("P reported {event:?} for a request in state {state}"));
            return;
        };
        if *readied_by != incarnation {
            self.violation(
                at,
                format!("P incarnation {incarnation} reported another's request: {event:?}"),
            );
            return;
        }
        if ending.is_some() && !*offered && !*abort_sent {
            // A stream's failure fails the send once its KV is offered, not before.
            self.violation(at, format!("P reported {event:?} before its KV was offered"));
            return;
        }
        let Some(ending) = ending else {
            if std::mem::replace(notice, true) {
                self.violation(at, format!("P reported a second quarantine notice: {event:?}"));
            }
            self.notices[Side::P.index()] += 1;
            return;
        };
        let blocks = std::mem::take(blocks);
        self.release(Side::P, incarnation, &blocks);
        self.p[request] = PState::Ended(ending);
    }

    /// P incarnation `incarnation` was killed: its requests end with it.
    pub(super) fn p_killed(&mut self, incarnation: u32) {
        for state in &mut self.p {
            if matches!(state, PState::Readied { incarnation: i, .. } if *i == incarnation) {
                *state = PState::Ended(Ending::Lost);
            }
        }
        self.p_owner.remove(&incarnation);
    }

    /// Whether every request ended on both sides.
    pub(super) fn all_ended(&self) -> bool {
        self.d.iter().all(|state| matches!(state, DState::Ended(_)))
            && self.p.iter().all(|state| matches!(state, PState::Ended(_)))
    }

    /// The requests that have not ended on some side.
    pub(super) fn open(&self) -> Vec<String> {
        let mut open = Vec::new();
        for (request, state) in self.d.iter().enumerate() {
            if !matches!(state, DState::Ended(_)) {
                open.push(format!("{} on D ({state:?})", self.id(request)));
            }
        }
        for (request, state) in self.p.iter().enumerate() {
            if !matches!(state, PState::Ended(_)) {
                open.push(format!("{} on P ({state:?})", self.id(request)));
            }
        }
        open
    }
}

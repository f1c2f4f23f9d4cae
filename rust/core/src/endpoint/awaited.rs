//! D: one request awaiting its KV, from one P rank or from several.
//!
//! When P runs a larger tensor parallel size than D, each of D's ranks holds heads that several
//! of P's ranks computed, so its KV comes from each of them. Every such P rank is a *leg* of the
//! receive: D registers with it, and the leg ends with its DONE, its FAIL, its acknowledgement of
//! a CANCEL, or, once D lost the connection to it, when its write horizon passed (before that a
//! lost P may still be writing). The receive ends exactly once, after its last leg:
//!
//! - *done* when every leg delivered;
//! - otherwise with the first reason recorded (a leg's failure names the P rank), or
//!   *quarantined* when any leg's WRITE could not be released, whatever else happened.
//!
//! A leg that fails makes D cancel the others, and the receive is reported only once none of
//! them can still write: nothing lands after "failed", whichever rank failed first.
//!
//! A leg whose connection was lost is *fenced*: P may be partitioned, paused or starved rather
//! than dead, with a WRITE still in flight, so D hands its blocks back only on evidence that no
//! byte of that P can land any more ([`Proof`]): P's own word, asked again over a new
//! connection and given once its transport finished with the transfer; or proof that P's
//! endpoint is gone (nothing listens at its address, or another endpoint does), after the time
//! bytes already accepted by its host may still take to arrive. P's write horizon passing
//! without either is not evidence (a stopped process keeps no horizon): the receive is then
//! *quarantined* (reported once as a notice; the blocks stay held) until evidence comes.
//!
//! This module holds the state and its rules; D's receive path (`receive`, on the writer thread)
//! does the I/O they call for (registering, sending CANCELs, dropping connections) and reports
//! the event.

use std::time::{Duration, Instant};

use crate::key::TransferKey;
use crate::side_channel::PeerId;

use super::events::Outcome;
use super::Expectation;

/// Where a leg stands.
#[derive(Debug)]
pub(super) enum LegState {
    /// Waiting for the connection to P: nothing is registered, so nothing can be written.
    Connecting,
    /// Registered: P may write.
    Registered,
    /// D sent a CANCEL. P must acknowledge it by `deadline` (then D drops the connection so
    /// that P's lease runs out; `None` once that was done).
    Cancelling { deadline: Option<Instant> },
    /// D lost the connection: P may still be writing. `outcome` is the leg's end unless a DONE
    /// comes first; what ends it is the evidence `proof`, and `until` is when: the horizon (for
    /// [`Proof::Unknown`] and [`Proof::Asking`], only the quarantine notice is due then) or the
    /// moment accepted bytes stopped landing ([`Proof::Gone`]: the leg ends then).
    Fenced { until: Instant, outcome: Outcome, proof: Proof },
    /// Over: no write of this leg can land any more.
    Over,
}

/// What D knows of a lost P's writes: the evidence a fenced leg waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proof {
    /// Nothing since the connection was lost: D reconnects to ask.
    Unknown,
    /// D reconnected to the same P endpoint and sent it a CANCEL on connection `peer`: P's
    /// CANCEL_ACK, which it sends only once its transport finished with the transfer (done,
    /// failed, or never posted), ends the leg.
    Asking(PeerId),
    /// P's endpoint is gone (another endpoint answers at its address, or nothing listens
    /// there): no byte can be sent any more, and those already accepted stopped landing at
    /// `until`.
    Gone,
}

/// One P rank a receive awaits.
#[derive(Debug)]
pub(super) struct Leg {
    /// P's side channel address, `host:port`.
    pub(super) source: String,
    /// The connection the registration went on (None while connecting).
    pub(super) peer: Option<PeerId>,
    /// The agent name of that P: a DONE from any other agent is not this leg's.
    pub(super) agent: Option<String>,
    /// How long that P's bytes may still land after its endpoint is gone (its delivery bound),
    /// and after its last proof of life (its write horizon), from its Hello.
    pub(super) delivery_bound: Duration,
    pub(super) horizon: Duration,
    /// The nonce of the registration: a DONE that does not echo it is not this leg's.
    pub(super) nonce: u64,
    pub(super) state: LegState,
}

impl Leg {
    /// Whether P may still write (or register) for this leg without a fence around it.
    fn is_live(&self) -> bool {
        matches!(
            self.state,
            LegState::Connecting | LegState::Registered | LegState::Cancelling { .. }
        )
    }
}

/// What the writer must do for a leg that is to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// Send P a CANCEL on this connection.
    Cancel(PeerId),
}

/// D: a request awaiting its KV.
#[derive(Debug)]
pub(super) struct Awaited {
    pub(super) expectation: Expectation,
    pub(super) key: TransferKey,
    pub(super) legs: Vec<Leg>,
    pub(super) bytes: u64,
    pub(super) runs: u32,
    pub(super) deadline: Instant,
    pub(super) registered: Instant,
    /// The receive's end once its last leg is over; None: done, if every leg delivered.
    ending: Option<Outcome>,
    /// The quarantine notice was reported (see the module docs).
    quarantined: bool,
}

impl Awaited {
    pub(super) fn new(expectation: Expectation, key: TransferKey, at: Instant) -> Self {
        let legs = expectation
            .sources
            .iter()
            .map(|source| Leg {
                source: source.clone(),
                peer: None,
                agent: None,
                delivery_bound: Duration::ZERO,
                horizon: Duration::ZERO,
                nonce: 0,
                state: LegState::Connecting,
            })
            .collect();
        Self {
            deadline: at + expectation.ttl,
            expectation,
            key,
            legs,
            bytes: 0,
            runs: 0,
            registered: at,
            ending: None,
            quarantined: false,
        }
    }

    /// How the details name leg `leg`: its address, and its rank when there are several.
    pub(super) fn label(&self, leg: usize) -> String {
        let source = &self.legs[leg].source;
        if self.legs.len() == 1 {
            format!("P at {source}")
        } else {
            format!("P rank {leg} of {} at {source}", self.legs.len())
        }
    }

    /// Whether the receive has ended (every leg over).
    pub(super) fn is_over(&self) -> bool {
        self.legs.iter().all(|leg| matches!(leg.state, LegState::Over))
    }

    /// Whether the receive's end is decided (it is only waiting for legs to be over).
    pub(super) fn is_ending(&self) -> bool {
        self.ending.is_some()
    }

    /// The receive's outcome, once it is over.
    pub(super) fn outcome(&mut self) -> Outcome {
        self.ending.take().unwrap_or(Outcome::Done)
    }

    /// Whether a DONE may come any moment (some leg is neither fenced nor over).
    pub(super) fn expects_writes(&self) -> bool {
        self.legs.iter().any(Leg::is_live)
    }

    /// The earliest moment a fenced leg's horizon passes.
    pub(super) fn next_fence(&self) -> Option<Instant> {
        self.legs
            .iter()
            .filter_map(|leg| match leg.state {
                LegState::Fenced { until, .. } => Some(until),
                _ => None,
            })
            .min()
    }

    /// The leg registered on connection `peer`.
    pub(super) fn leg_on(&self, peer: PeerId) -> Option<usize> {
        self.legs.iter().position(|leg| leg.peer == Some(peer))
    }

    /// The leg whose P is agent `agent`, while a write of it may still land.
    pub(super) fn leg_of_agent(&self, agent: &str) -> Option<usize> {
        self.legs.iter().position(|leg| {
            leg.agent.as_deref() == Some(agent) && !matches!(leg.state, LegState::Over)
        })
    }

    /// Records what the receive ends with: the first reason wins, except that a quarantine
    /// (a WRITE that may still land) overrides everything.
    pub(super) fn record(&mut self, outcome: Outcome) {
        match (&self.ending, &outcome) {
            (_, Outcome::Quarantined(_)) | (None, _) => self.ending = Some(outcome),
            _ => {}
        }
    }

    /// Leg `leg` is over; with `failure`, the receive fails (first reason wins) and every other
    /// live leg must stop: the CANCELs to send are returned.
    pub(super) fn end_leg(&mut self, leg: usize, failure: Option<Outcome>) -> Vec<Stop> {
        self.legs[leg].state = LegState::Over;
        match failure {
            Some(outcome) => {
                self.record(outcome);
                self.stop_all()
            }
            None => Vec::new(),
        }
    }

    /// The receive ends with `outcome` (unless it already ends otherwise): every live leg
    /// stops. Legs not registered yet are over at once; registered ones are cancelled; fenced
    /// ones wait out their horizons.
    pub(super) fn cancel(&mut self, outcome: Outcome) -> Vec<Stop> {
        self.record(outcome);
        self.stop_all()
    }

    fn stop_all(&mut self) -> Vec<Stop> {
        let mut stops = Vec::new();
        for leg in &mut self.legs {
            match (&leg.state, leg.peer) {
                (LegState::Connecting, _) => leg.state = LegState::Over,
                (LegState::Registered, Some(peer)) => {
                    // The deadline is set by the writer, which knows P's horizon.
                    leg.state = LegState::Cancelling { deadline: None };
                    stops.push(Stop::Cancel(peer));
                }
                (LegState::Registered, None) => leg.state = LegState::Over,
                _ => {}
            }
        }
        stops
    }

    /// The connection `peer` closed at `at`: its legs are fenced, ending with `outcome` unless a
    /// DONE comes first, once there is evidence that nothing more of theirs can land; the
    /// quarantine notice is due at `at` plus each leg's horizon.
    pub(super) fn fence(&mut self, peer: PeerId, at: Instant, outcome: &Outcome) {
        for leg in &mut self.legs {
            let live = match &leg.state {
                LegState::Registered | LegState::Cancelling { .. } => leg.peer == Some(peer),
                // A second connection D opened to ask a lost P was lost too: ask again.
                LegState::Fenced { proof: Proof::Asking(asked), .. } => *asked == peer,
                _ => false,
            };
            if live {
                let until = match &leg.state {
                    LegState::Fenced { until, .. } => *until,
                    _ => at + leg.horizon,
                };
                let outcome = match &leg.state {
                    LegState::Fenced { outcome, .. } => outcome.clone(),
                    _ => outcome.clone(),
                };
                leg.state = LegState::Fenced { until, outcome, proof: Proof::Unknown };
            }
        }
    }

    /// The fenced legs of P at `source` that wait for evidence (D should ask P again).
    pub(super) fn unsettled(&self, source: &str) -> Vec<usize> {
        (0..self.legs.len())
            .filter(|&leg| {
                self.legs[leg].source == source
                    && matches!(
                        self.legs[leg].state,
                        LegState::Fenced { proof: Proof::Unknown, .. }
                    )
            })
            .collect()
    }

    /// Whether some fenced leg waits for evidence (D must ask its P again).
    pub(super) fn needs_settling(&self) -> bool {
        self.legs
            .iter()
            .any(|leg| matches!(leg.state, LegState::Fenced { proof: Proof::Unknown, .. }))
    }

    /// Fenced leg `leg` is being asked on connection `peer` (see [`Proof::Asking`]).
    pub(super) fn ask(&mut self, leg: usize, peer: PeerId) {
        if let LegState::Fenced { proof, .. } = &mut self.legs[leg].state {
            *proof = Proof::Asking(peer);
        }
    }

    /// Fenced leg `leg`'s P endpoint is gone: the leg ends once `settled` (bytes it had handed
    /// to its host may land until then).
    pub(super) fn gone(&mut self, leg: usize, settled: Instant, evidence: &str) {
        if let LegState::Fenced { until, proof, outcome } = &mut self.legs[leg].state {
            *until = settled;
            *proof = Proof::Gone;
            *outcome = outcome.clone().because(evidence);
        }
    }

    /// Leg `leg`'s P said its WRITE will not go on, without it having delivered (it failed, or
    /// was never posted, or P no longer knows it): bytes its host had already accepted may still
    /// land until `until` (its delivery bound), when the leg ends with `outcome`. With `fails`,
    /// the receive fails with it now and its other legs stop (the CANCELs returned).
    pub(super) fn end_leg_at(
        &mut self,
        leg: usize,
        until: Instant,
        outcome: Outcome,
        fails: bool,
    ) -> Vec<Stop> {
        self.legs[leg].state =
            LegState::Fenced { until, outcome: outcome.clone(), proof: Proof::Gone };
        if fails {
            self.record(outcome);
            self.stop_all()
        } else {
            Vec::new()
        }
    }

    /// The fenced leg asked on connection `peer` (its P's answer ends it).
    pub(super) fn leg_asked_on(&self, peer: PeerId) -> Option<usize> {
        self.legs.iter().position(|leg| {
            matches!(leg.state, LegState::Fenced { proof: Proof::Asking(asked), .. } if asked == peer)
        })
    }

    /// A fenced leg's P answered (its word, given once nothing of the transfer can land): the
    /// leg ends with its fenced outcome. Returns the CANCELs this calls for.
    pub(super) fn settle_leg(&mut self, leg: usize, evidence: &str) -> Vec<Stop> {
        match &self.legs[leg].state {
            LegState::Fenced { outcome, .. } => {
                let outcome = outcome.clone().because(evidence);
                self.end_leg(leg, Some(outcome))
            }
            _ => Vec::new(),
        }
    }

    /// Ends the legs whose P is gone and whose last bytes stopped landing by `now`; returns the
    /// CANCELs this calls for.
    pub(super) fn fences_passed(&mut self, now: Instant) -> Vec<Stop> {
        let mut stops = Vec::new();
        for leg in 0..self.legs.len() {
            let passed = match &self.legs[leg].state {
                LegState::Fenced { until, outcome, proof: Proof::Gone } if *until <= now => {
                    Some(outcome.clone())
                }
                _ => None,
            };
            if let Some(outcome) = passed {
                stops.extend(self.end_leg(leg, Some(outcome)));
            }
        }
        stops
    }

    /// Whether the quarantine notice is due by `now`: some lost P's horizon passed without
    /// evidence that its bytes can no longer land. True once.
    pub(super) fn quarantine_due(&mut self, now: Instant) -> bool {
        if self.quarantined {
            return false;
        }
        let due = self.legs.iter().any(|leg| {
            matches!(
                leg.state,
                LegState::Fenced { until, proof: Proof::Unknown | Proof::Asking(_), .. }
                    if until <= now
            )
        });
        self.quarantined = due;
        due
    }

    /// Why the receive is held: the lost P ranks that have not settled.
    pub(super) fn unsettled_labels(&self) -> String {
        let labels: Vec<String> = (0..self.legs.len())
            .filter(|&leg| {
                matches!(
                    self.legs[leg].state,
                    LegState::Fenced { proof: Proof::Unknown | Proof::Asking(_), .. }
                )
            })
            .map(|leg| self.label(leg))
            .collect();
        labels.join(", ")
    }

    /// The connections whose CANCEL went unacknowledged past its deadline (each reported once).
    pub(super) fn unacknowledged(&mut self, now: Instant) -> Vec<PeerId> {
        let mut peers = Vec::new();
        for leg in &mut self.legs {
            if let LegState::Cancelling { deadline } = &mut leg.state {
                if deadline.is_some_and(|d| d <= now) {
                    *deadline = None;
                    peers.extend(leg.peer);
                }
            }
        }
        peers
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::endpoint::events::Reason;

    fn awaited(sources: &[&str]) -> Awaited {
        let expectation = Expectation {
            request_id: "r".into(),
            transfer_id: None,
            sources: sources.iter().map(|s| (*s).to_owned()).collect(),
            groups: Vec::new(),
            num_tokens: 1,
            epoch: 1,
            ttl: Duration::from_secs(1),
            share: None,
        };
        Awaited::new(expectation, TransferKey::from_canonical("r"), Instant::now())
    }

    fn register(a: &mut Awaited, leg: usize, peer: PeerId) {
        a.legs[leg].peer = Some(peer);
        a.legs[leg].agent = Some(format!("p{leg}"));
        a.legs[leg].horizon = Duration::from_secs(5);
        a.legs[leg].state = LegState::Registered;
    }

    fn failed(detail: &str) -> Outcome {
        Outcome::failed(Reason::WriteError, detail)
    }

    #[test]
    fn done_only_after_every_leg_delivered() {
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        assert!(a.end_leg(0, None).is_empty());
        assert!(!a.is_over());
        assert!(a.expects_writes());
        a.end_leg(1, None);
        assert!(a.is_over());
        assert_eq!(a.outcome(), Outcome::Done);
    }

    #[test]
    fn a_failed_leg_cancels_the_others_and_ends_the_receive_after_them() {
        let mut a = awaited(&["p0:1", "p1:2", "p2:3"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        register(&mut a, 2, 3);
        a.end_leg(2, None);
        let stops = a.end_leg(0, Some(failed("rank 0 broke")));
        assert_eq!(stops, vec![Stop::Cancel(2)], "only the leg that may still write");
        assert!(!a.is_over(), "rank 1 may still be writing");
        // Rank 1's DONE beat the cancel: the receive still failed, with rank 0's reason.
        let leg = a.leg_of_agent("p1").expect("rank 1 is awaited");
        a.end_leg(leg, None);
        assert!(a.is_over());
        assert_eq!(a.outcome(), failed("rank 0 broke"));
    }

    #[test]
    fn quarantine_overrides_an_earlier_failure() {
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        a.end_leg(0, Some(failed("first")));
        a.end_leg(1, Some(Outcome::quarantined("stuck")));
        assert_eq!(a.outcome(), Outcome::quarantined("stuck"));
    }

    #[test]
    fn a_lost_legs_done_still_completes_it() {
        let now = Instant::now();
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        a.fence(1, now, &failed("lost"));
        assert_eq!(a.next_fence(), Some(now + Duration::from_secs(5)));
        a.end_leg(1, None);
        a.end_leg(a.leg_of_agent("p0").expect("fenced legs accept their DONE"), None);
        assert_eq!(a.outcome(), Outcome::Done);
    }

    #[test]
    fn a_horizon_alone_quarantines_and_ends_nothing() {
        let now = Instant::now();
        let mut a = awaited(&["p0:1"]);
        register(&mut a, 0, 1);
        a.fence(1, now, &failed("lost"));
        let later = now + Duration::from_secs(60);
        assert!(!a.quarantine_due(now), "inside the horizon");
        assert!(a.fences_passed(later).is_empty(), "a stopped P keeps no horizon");
        assert!(!a.is_over());
        assert!(a.quarantine_due(later), "the notice, once");
        assert!(!a.quarantine_due(later));
        assert_eq!(a.unsettled("p0:1"), vec![0]);
        assert!(a.needs_settling());
    }

    #[test]
    fn a_lost_leg_ends_on_ps_word_or_once_ps_endpoint_is_gone() {
        let now = Instant::now();
        let lost = failed("lost");
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        a.fence(1, now, &lost);
        // Asked again on a new connection 9: P's answer ends the leg, and rank 1 is cancelled.
        a.ask(0, 9);
        assert!(!a.needs_settling());
        assert_eq!(a.leg_asked_on(9), Some(0));
        assert_eq!(a.settle_leg(0, "P said so"), vec![Stop::Cancel(2)]);
        a.end_leg(1, None);
        assert_eq!(a.outcome(), lost.clone().because("P said so"));

        let mut b = awaited(&["p0:1"]);
        register(&mut b, 0, 1);
        b.fence(1, now, &lost);
        let settled = now + Duration::from_secs(2);
        b.gone(0, settled, "P is gone");
        assert!(b.fences_passed(now).is_empty(), "bytes its host accepted may still land");
        assert!(b.fences_passed(settled).is_empty());
        assert!(b.is_over());
        assert!(!b.quarantine_due(now + Duration::from_secs(60)), "gone is evidence");
        assert_eq!(b.outcome(), lost.because("P is gone"));
    }

    #[test]
    fn losing_the_connection_a_lost_leg_was_asked_on_asks_again() {
        let now = Instant::now();
        let mut a = awaited(&["p0:1"]);
        register(&mut a, 0, 1);
        a.fence(1, now, &failed("lost"));
        a.ask(0, 9);
        a.fence(9, now + Duration::from_secs(1), &failed("lost again"));
        assert_eq!(a.unsettled("p0:1"), vec![0]);
        assert_eq!(a.next_fence(), Some(now + Duration::from_secs(5)), "the first loss counts");
    }

    #[test]
    fn a_cancel_ends_unregistered_legs_at_once_and_cancels_registered_ones() {
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 1, 2);
        let cancelled = Outcome::cancelled(Reason::Cancelled, "by D");
        assert_eq!(a.cancel(cancelled.clone()), vec![Stop::Cancel(2)]);
        assert!(matches!(a.legs[0].state, LegState::Over));
        // A failure after the cancel does not change what the receive ends with.
        a.end_leg(1, Some(failed("late")));
        assert_eq!(a.outcome(), cancelled);
    }

    #[test]
    fn unacknowledged_cancels_are_reported_once() {
        let now = Instant::now();
        let mut a = awaited(&["p0:1"]);
        register(&mut a, 0, 7);
        a.cancel(Outcome::cancelled(Reason::Cancelled, "by D"));
        a.legs[0].state = LegState::Cancelling { deadline: Some(now) };
        assert_eq!(a.unacknowledged(now), vec![7]);
        assert!(a.unacknowledged(now).is_empty());
    }
}

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
//! This module holds the state and its rules; D's receive path (`receive`, on the writer thread)
//! does the I/O they call for (registering, sending CANCELs, dropping connections) and reports
//! the event.

use std::time::Instant;

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
    /// D lost the connection: P may be writing until `until`; `outcome` is the leg's end if
    /// no DONE arrives before then.
    Fenced { until: Instant, outcome: Outcome },
    /// Over: no write of this leg can land any more.
    Over,
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

    /// The connection `peer` closed at `at`: its legs are fenced until `until`, ending with
    /// `outcome` unless a DONE comes first.
    pub(super) fn fence(&mut self, peer: PeerId, until: Instant, outcome: &Outcome) {
        for leg in &mut self.legs {
            if leg.peer == Some(peer)
                && matches!(leg.state, LegState::Registered | LegState::Cancelling { .. })
            {
                leg.state = LegState::Fenced { until, outcome: outcome.clone() };
            }
        }
    }

    /// Ends the legs whose horizon passed by `now`; returns the CANCELs this calls for.
    pub(super) fn fences_passed(&mut self, now: Instant) -> Vec<Stop> {
        let mut stops = Vec::new();
        for leg in 0..self.legs.len() {
            let passed = match &self.legs[leg].state {
                LegState::Fenced { until, outcome } if *until <= now => Some(outcome.clone()),
                _ => None,
            };
            if let Some(outcome) = passed {
                stops.extend(self.end_leg(leg, Some(outcome)));
            }
        }
        stops
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
    fn a_lost_leg_ends_at_its_horizon_unless_its_done_comes_first() {
        let now = Instant::now();
        let lost = failed("lost");
        let mut a = awaited(&["p0:1", "p1:2"]);
        register(&mut a, 0, 1);
        register(&mut a, 1, 2);
        a.fence(1, now + Duration::from_secs(5), &lost);
        assert_eq!(a.next_fence(), Some(now + Duration::from_secs(5)));
        assert!(a.fences_passed(now).is_empty(), "inside the horizon");
        a.end_leg(1, None);
        // The lost rank's DONE still completes its leg inside the horizon.
        a.end_leg(a.leg_of_agent("p0").expect("fenced legs accept their DONE"), None);
        assert_eq!(a.outcome(), Outcome::Done);

        let mut b = awaited(&["p0:1", "p1:2"]);
        register(&mut b, 0, 1);
        register(&mut b, 1, 2);
        b.fence(1, now, &lost);
        assert_eq!(b.fences_passed(now), vec![Stop::Cancel(2)]);
        b.end_leg(1, None);
        assert_eq!(b.outcome(), lost);
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

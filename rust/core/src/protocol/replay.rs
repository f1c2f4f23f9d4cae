//! Replay protection: which (sender, session, seq) triples a decoder has already accepted.
//!
//! Each sender session gets a sliding window: the highest seq accepted plus a 64-bit bitmap of
//! the 64 seqs at and below it. A seq above the window is new; one inside it is new iff its bit
//! is clear; one below it cannot be told apart from a replay and is refused. Encoders number
//! frames strictly increasingly, so only frames overtaken by more than 64 others are lost that
//! way.
//!
//! Memory stays bounded by forgetting sessions, and forgetting one must not reopen it to
//! replays. A window remembers the newest timestamp it accepted (`max_ts_ms`); once
//! `now - max_ts_ms > max_clock_skew`, every frame that session ever had accepted is outside the
//! clock-skew window and the skew check refuses it, so the window is no longer needed. Only such
//! windows are dropped; if the table is full of live ones a new session is refused
//! ([`ProtocolError::TooManySessions`]) rather than dropping a window that still guards something.

use std::collections::HashMap;

use super::error::ProtocolError;

/// How many seqs below the highest one a window still tracks.
pub const REPLAY_WINDOW: u64 = 64;

/// One sender session's accepted seqs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    /// Highest seq accepted.
    highest: u64,
    /// Bit `i` set: seq `highest - i` was accepted (bit 0 is `highest` itself).
    seen: u64,
    /// Newest envelope timestamp accepted, for deciding when the window may be forgotten.
    max_ts_ms: u64,
}

impl Window {
    fn new(seq: u64, ts_ms: u64) -> Self {
        Self { highest: seq, seen: 1, max_ts_ms: ts_ms }
    }

    fn is_fresh(&self, seq: u64) -> bool {
        if seq > self.highest {
            return true;
        }
        let age = self.highest - seq;
        age < REPLAY_WINDOW && self.seen & (1 << age) == 0
    }

    /// Marks `seq` accepted; the caller has checked [`Window::is_fresh`].
    fn accept(&mut self, seq: u64, ts_ms: u64) {
        if seq > self.highest {
            let shift = seq - self.highest;
            self.seen = if shift >= REPLAY_WINDOW { 0 } else { self.seen << shift };
            self.seen |= 1;
            self.highest = seq;
        } else {
            self.seen |= 1 << (self.highest - seq);
        }
        self.max_ts_ms = self.max_ts_ms.max(ts_ms);
    }

    /// Whether every frame this window accepted is now refused by the clock-skew check anyway.
    fn is_expired(&self, now_ms: u64, max_skew_ms: u64) -> bool {
        now_ms.saturating_sub(self.max_ts_ms) > max_skew_ms
    }
}

/// The replay windows of every sender session a decoder has heard from.
#[derive(Debug)]
pub(crate) struct ReplayGuard {
    windows: HashMap<String, HashMap<u64, Window>>,
    tracked: usize,
    max_sessions: usize,
    max_skew_ms: u64,
}

impl ReplayGuard {
    pub(crate) fn new(max_sessions: usize, max_skew_ms: u64) -> Self {
        Self { windows: HashMap::new(), tracked: 0, max_sessions, max_skew_ms }
    }

    /// Refuses a replayed or too-old `seq`, or a new session the table has no room for.
    /// Changes nothing: a frame is only [`accept`](Self::accept)ed once it has fully decoded.
    pub(crate) fn check(
        &mut self,
        sender: &str,
        session: u64,
        seq: u64,
        now_ms: u64,
    ) -> Result<(), ProtocolError> {
        match self.windows.get(sender).and_then(|sessions| sessions.get(&session)) {
            Some(window) if window.is_fresh(seq) => Ok(()),
            Some(_) => Err(ProtocolError::Replayed { sender: sender.to_owned(), session, seq }),
            None if self.tracked < self.max_sessions => Ok(()),
            None => {
                self.forget_expired(now_ms);
                if self.tracked < self.max_sessions {
                    Ok(())
                } else {
                    Err(ProtocolError::TooManySessions { max: self.max_sessions })
                }
            }
        }
    }

    /// Records `seq` as accepted; [`check`](Self::check) must have passed just before.
    pub(crate) fn accept(&mut self, sender: &str, session: u64, seq: u64, ts_ms: u64) {
        if let Some(window) =
            self.windows.get_mut(sender).and_then(|sessions| sessions.get_mut(&session))
        {
            window.accept(seq, ts_ms);
            return;
        }
        self.windows.entry(sender.to_owned()).or_default().insert(session, Window::new(seq, ts_ms));
        self.tracked += 1;
    }

    /// Number of sender sessions currently tracked.
    pub(crate) fn tracked(&self) -> usize {
        self.tracked
    }

    /// Drops every window whose frames the clock-skew check now refuses on its own.
    ///
    /// O(tracked), and only run when the table is full, i.e. at most once per new session.
    fn forget_expired(&mut self, now_ms: u64) {
        let max_skew_ms = self.max_skew_ms;
        let mut tracked = 0;
        self.windows.retain(|_, sessions| {
            sessions.retain(|_, window| !window.is_expired(now_ms, max_skew_ms));
            tracked += sessions.len();
            !sessions.is_empty()
        });
        self.tracked = tracked;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SKEW_MS: u64 = 30_000;

    fn admit(guard: &mut ReplayGuard, sender: &str, session: u64, seq: u64, now_ms: u64) -> bool {
        match guard.check(sender, session, seq, now_ms) {
            Ok(()) => {
                guard.accept(sender, session, seq, now_ms);
                true
            }
            Err(_) => false,
        }
    }

    #[test]
    fn each_seq_is_accepted_once() {
        let mut guard = ReplayGuard::new(16, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 1, 0));
        assert!(!admit(&mut guard, "p0", 1, 1, 0));
        assert!(admit(&mut guard, "p0", 1, 2, 0));
        assert!(!admit(&mut guard, "p0", 1, 1, 0));
        assert!(!admit(&mut guard, "p0", 1, 2, 0));
    }

    #[test]
    fn reordering_within_the_window_is_accepted_once() {
        let mut guard = ReplayGuard::new(16, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 100, 0));
        // 63 below the highest is the oldest seq the window still tracks.
        for seq in (37..100).rev() {
            assert!(admit(&mut guard, "p0", 1, seq, 0), "seq {seq}");
        }
        for seq in 37..=100 {
            assert!(!admit(&mut guard, "p0", 1, seq, 0), "seq {seq} replayed");
        }
        assert!(!admit(&mut guard, "p0", 1, 36, 0), "below the window: cannot tell, refused");
    }

    #[test]
    fn a_jump_past_the_window_clears_it() {
        let mut guard = ReplayGuard::new(16, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 5, 0));
        assert!(admit(&mut guard, "p0", 1, 5 + 64, 0));
        assert!(!admit(&mut guard, "p0", 1, 5, 0));
        assert!(admit(&mut guard, "p0", 1, 6, 0), "63 below the highest, never seen");
        assert!(admit(&mut guard, "p0", 1, u64::MAX, 0));
        assert!(!admit(&mut guard, "p0", 1, u64::MAX, 0));
    }

    #[test]
    fn sessions_and_senders_are_independent() {
        let mut guard = ReplayGuard::new(16, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 1, 0));
        assert!(admit(&mut guard, "p0", 2, 1, 0));
        assert!(admit(&mut guard, "p1", 1, 1, 0));
        assert!(!admit(&mut guard, "p1", 1, 1, 0));
        assert_eq!(guard.tracked(), 3);
    }

    #[test]
    fn a_refused_frame_leaves_no_trace() {
        let mut guard = ReplayGuard::new(16, SKEW_MS);
        assert!(guard.check("p0", 1, 1, 0).is_ok());
        // Not accepted (say the body failed to decode): the same seq is still fresh.
        assert!(admit(&mut guard, "p0", 1, 1, 0));
        assert_eq!(guard.tracked(), 1);
    }

    #[test]
    fn live_sessions_are_never_forgotten_to_make_room() {
        let mut guard = ReplayGuard::new(2, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 1, 1_000));
        assert!(admit(&mut guard, "p0", 2, 1, 1_000));
        let err = guard.check("p0", 3, 1, 1_000 + SKEW_MS).unwrap_err();
        assert_eq!(err, ProtocolError::TooManySessions { max: 2 });
        assert!(!admit(&mut guard, "p0", 1, 1, 1_000 + SKEW_MS), "session 1 still guarded");
    }

    #[test]
    fn expired_sessions_make_room() {
        let mut guard = ReplayGuard::new(2, SKEW_MS);
        assert!(admit(&mut guard, "p0", 1, 1, 1_000));
        assert!(admit(&mut guard, "p1", 2, 1, 5_000));
        // Session 1's newest frame is now more than the skew old; session 2's is not.
        let now = 1_000 + SKEW_MS + 1;
        assert!(admit(&mut guard, "p2", 3, 1, now));
        assert_eq!(guard.tracked(), 2);
        assert!(!admit(&mut guard, "p1", 2, 1, now), "session 2 was kept");
    }

    #[test]
    fn window_expiry_follows_the_newest_timestamp() {
        let mut window = Window::new(1, 10_000);
        window.accept(2, 4_000);
        assert_eq!(window.max_ts_ms, 10_000, "an older timestamp does not shorten the life");
        assert!(!window.is_expired(10_000 + SKEW_MS, SKEW_MS));
        assert!(window.is_expired(10_001 + SKEW_MS, SKEW_MS));
        assert!(!window.is_expired(0, SKEW_MS), "a clock that went back does not expire it");
    }
}

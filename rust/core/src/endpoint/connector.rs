//! D's connections to P ranks being made: each connect on its own short-lived thread, at most
//! [`MAX_CONNECTS`] at once, so that one slow name or unreachable host delays only the requests
//! that need it, not every connect queued behind it.
//!
//! A connect is bounded by the side channel's `connect_timeout`, name resolution included
//! ([`SideChannel::connect`]); its thread hands the result to the writer as
//! `Command::Connected` and ends. The writer asks for at most one connect per P address at a
//! time (see `receive`); addresses beyond `MAX_CONNECTS` wait their turn here, up to
//! [`MAX_WAITING`], and past that fail at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::side_channel::SideChannel;

use super::command::{Command, ConnectFailure};
use super::Shared;

/// Most connects running at once.
pub(super) const MAX_CONNECTS: usize = 8;

/// Most P addresses waiting for a connect thread.
pub(super) const MAX_WAITING: usize = 1_024;

/// How long a closing writer waits for connects still running (each ends within the connect
/// timeout; one still running is left to end on its own).
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// How often `close` looks whether the connects it waits for ended.
const JOIN_POLL: Duration = Duration::from_millis(2);

/// The connects of one writer.
pub(super) struct Connector {
    engine_id: String,
    side_channel: Arc<SideChannel>,
    shared: Arc<Shared>,
    /// Connects running, by P address.
    running: HashMap<String, JoinHandle<()>>,
    /// P addresses waiting for a thread, oldest first.
    waiting: VecDeque<String>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish_non_exhaustive()
    }
}

impl Connector {
    pub(super) fn new(
        engine_id: &str,
        side_channel: Arc<SideChannel>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            engine_id: engine_id.to_owned(),
            side_channel,
            shared,
            running: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Connects to `source` (once a thread is free). Its result always comes back as
    /// `Command::Connected`, a refusal too (too many addresses waiting, no thread).
    pub(super) fn request(&mut self, source: String) {
        if self.running.len() < MAX_CONNECTS {
            self.start(source);
        } else if self.waiting.len() < MAX_WAITING {
            self.waiting.push_back(source);
        } else {
            let reason = format!(
                "{MAX_WAITING} P addresses already wait for a connect ({MAX_CONNECTS} run at \
                 once): is P's address right, and does it resolve quickly?"
            );
            let result = Err(ConnectFailure::other(reason));
            self.shared.send(Command::Connected { source, result });
        }
    }

    /// `source`'s connect ended (its result reached the writer): the next waiting one starts.
    pub(super) fn finished(&mut self, source: &str) {
        if let Some(handle) = self.running.remove(source) {
            // The thread's last act was sending the result; a panic in it (a bug) would have
            // been reported by the panic hook, and its source already failed by the writer.
            let _ = handle.join();
        }
        while self.running.len() < MAX_CONNECTS {
            let Some(next) = self.waiting.pop_front() else { break };
            self.start(next);
        }
    }

    /// The writer closes: waiting connects are dropped, running ones waited for (briefly).
    pub(super) fn close(self) {
        let deadline = Instant::now() + CLOSE_WAIT;
        for (_, handle) in self.running {
            while !handle.is_finished() && Instant::now() < deadline {
                thread::sleep(JOIN_POLL);
            }
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
    }

    fn start(&mut self, source: String) {
        let side_channel = Arc::clone(&self.side_channel);
        let shared = Arc::clone(&self.shared);
        let target = source.clone();
        let spawned = thread::Builder::new()
            .name(format!("kvpush-connect-{}", self.engine_id))
            .spawn(move || {
                let result =
                    side_channel.connect(&target).map_err(|error| ConnectFailure::of(&error));
                shared.send(Command::Connected { source: target, result });
            });
        match spawned {
            Ok(handle) => {
                self.running.insert(source, handle);
            }
            Err(error) => {
                let reason = format!("cannot start a connect thread: {error}");
                let result = Err(ConnectFailure::other(reason));
                self.shared.send(Command::Connected { source, result });
            }
        }
    }
}

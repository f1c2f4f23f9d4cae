//! The writer's inbox: bounded by admission, with a stop that jumps the queue.
//!
//! Every thread hands the writer work through one channel. A writer that falls behind (or
//! sticks in a transport call) must not let that channel grow without bound, and must not make
//! the engine thread wait either. So the inbox counts what it holds, and new work is *admitted*
//! against that count before anything else happens:
//!
//! - new work (an engine's `ready` or `expect`, a peer's registration or handshake) only while
//!   fewer than `capacity` commands wait;
//! - ending work (an engine's `cancel` or `abort`, a peer's cancel or reply, a refusal's FAIL)
//!   while fewer than twice that wait, so that requests can still be ended when no new one is
//!   taken on;
//! - what follows from admitted work (a match the table made, a peer's loss, a connect's
//!   result) is never refused: dropping it would strand a transfer that was already accepted.
//!   It is bounded by the work admitted, the side channel's connection limits and the connects
//!   in flight.
//!
//! The engine's calls answer `Busy` at once when there is no room; a side channel thread may
//! wait briefly ([`Inbox::wait_for_room`]). A `sync_channel` would bound the channel itself, but
//! a full one must then either block the sender (the engine thread, or a reader holding a match
//! the table already made) or drop the command; admission refuses before any state changed.
//!
//! `Stop` is a flag as well as a command: the writer sees it on its next receive, ahead of
//! whatever is still queued, so a backlog never delays a close.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::command::Command;

/// How often [`Inbox::wait_for_room`] looks again.
const ROOM_POLL: Duration = Duration::from_millis(1);

/// What the inbox's two ends share.
#[derive(Debug)]
struct Depth {
    /// Commands sent and not yet taken by the writer.
    queued: AtomicUsize,
    /// Set by [`Inbox::stop`]; the writer takes it as `Stop` on its next receive.
    stopping: AtomicBool,
}

/// The senders' end; see the module docs. `Sender` is `Sync`: every thread sends without a lock.
#[derive(Debug)]
pub(crate) struct Inbox {
    sender: Sender<Command>,
    depth: Arc<Depth>,
    capacity: usize,
}

/// The writer's end.
#[derive(Debug)]
pub(crate) struct Commands {
    receiver: Receiver<Command>,
    depth: Arc<Depth>,
    /// A command taken from the channel as the stop arrived: answered as `Stop`, it heads the
    /// backlog, so that it still ends in its event (dropped, its request would never end).
    held: RefCell<Option<Command>>,
}

/// No room: this many commands wait, against this capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    pub(crate) queued: usize,
    pub(crate) capacity: usize,
}

/// An inbox that admits new work while fewer than `capacity` commands wait.
pub(crate) fn inbox(capacity: usize) -> (Inbox, Commands) {
    let (sender, receiver) = mpsc::channel();
    let depth = Arc::new(Depth { queued: AtomicUsize::new(0), stopping: AtomicBool::new(false) });
    (
        Inbox { sender, depth: Arc::clone(&depth), capacity },
        Commands { receiver, depth, held: RefCell::new(None) },
    )
}

impl Inbox {
    /// Hands `command` to the writer (counted); false once the writer has stopped. Admission,
    /// where the command is new or ending work, comes first: see [`admit`](Self::admit).
    pub(crate) fn send(&self, command: Command) -> bool {
        // Relaxed: a depth counter, read only to admit work; the command itself is published by
        // the channel. Counted before the send so that the writer's decrement never comes first.
        self.depth.queued.fetch_add(1, Ordering::Relaxed);
        if self.sender.send(command).is_ok() {
            return true;
        }
        self.depth.queued.fetch_sub(1, Ordering::Relaxed);
        false
    }

    /// Room for new work: `Err` once `capacity` commands wait.
    pub(crate) fn admit(&self) -> Result<(), Full> {
        self.room(self.capacity)
    }

    /// Room for work that ends requests (cancels, aborts, refusals): up to twice `capacity`.
    pub(crate) fn admit_ending(&self) -> Result<(), Full> {
        self.room(self.capacity.saturating_mul(2))
    }

    /// Waits up to `wait` for room for new work; for threads that may block briefly (a side
    /// channel's reader), never the engine's.
    pub(crate) fn wait_for_room(&self, wait: Duration) -> Result<(), Full> {
        let deadline = Instant::now() + wait;
        loop {
            match self.admit() {
                Err(_) if Instant::now() < deadline && !self.is_stopping() => {
                    thread::sleep(ROOM_POLL);
                }
                result => return result,
            }
        }
    }

    /// Asks the writer to stop ahead of anything still queued. Always gets through.
    pub(crate) fn stop(&self) {
        // Release: pairs with the writer's Acquire load in `Commands`; nothing else is published
        // by it, but a stop should not be seen before what the closing thread did first.
        self.depth.stopping.store(true, Ordering::Release);
        // Wakes a writer asleep on the channel; it then reads the flag.
        let _ = self.sender.send(Command::Stop);
    }

    /// Commands waiting now.
    pub(crate) fn queued(&self) -> usize {
        // Relaxed: see `send`.
        self.depth.queued.load(Ordering::Relaxed)
    }

    pub(crate) fn is_stopping(&self) -> bool {
        // Acquire: see `stop`.
        self.depth.stopping.load(Ordering::Acquire)
    }

    fn room(&self, limit: usize) -> Result<(), Full> {
        let queued = self.queued();
        if queued < limit {
            Ok(())
        } else {
            Err(Full { queued, capacity: self.capacity })
        }
    }
}

impl Commands {
    /// The next command, waiting up to `timeout`; `Stop` once the inbox was stopped.
    pub(crate) fn recv_timeout(&self, timeout: Duration) -> Result<Command, RecvTimeoutError> {
        if self.stopping() {
            return Ok(Command::Stop);
        }
        let command = self.receiver.recv_timeout(timeout)?;
        self.took();
        Ok(self.unless_stopping(command))
    }

    /// `command`, just taken, or `Stop` if the inbox was stopped while it was taken: then it is
    /// held for the [`backlog`](Self::backlog), which ends it.
    fn unless_stopping(&self, command: Command) -> Command {
        if self.stopping() {
            *self.held.borrow_mut() = Some(command);
            return Command::Stop;
        }
        command
    }

    /// The next command if one waits; `Stop` once the inbox was stopped.
    pub(crate) fn try_recv(&self) -> Result<Command, TryRecvError> {
        if self.stopping() {
            return Ok(Command::Stop);
        }
        let command = self.receiver.try_recv()?;
        self.took();
        Ok(command)
    }

    /// The commands still queued, taken without waiting, whether or not the inbox was stopped:
    /// for the writer's end, which must still end each request among them (see
    /// `Writer::end_backlog`).
    pub(crate) fn backlog(&self) -> Vec<Command> {
        let taken: Vec<Command> = self.receiver.try_iter().collect();
        for _ in &taken {
            self.took();
        }
        self.held.take().into_iter().chain(taken).collect()
    }

    fn took(&self) {
        // Relaxed: see `Inbox::send`.
        self.depth.queued.fetch_sub(1, Ordering::Relaxed);
    }

    fn stopping(&self) -> bool {
        // Acquire: see `Inbox::stop`.
        self.depth.stopping.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(command: &Command) -> bool {
        matches!(command, Command::Stop)
    }

    /// A command that does nothing but take a place in the inbox.
    fn filler(name: &str) -> Command {
        Command::ReportFanOut(crate::key::TransferKey::from_canonical(name))
    }

    #[test]
    fn new_work_is_refused_at_capacity_and_ending_work_at_twice_it() {
        let (inbox, commands) = inbox(2);
        assert!(inbox.admit().is_ok());
        assert!(inbox.send(filler("a")));
        assert!(inbox.send(filler("b")));
        assert_eq!(inbox.admit(), Err(Full { queued: 2, capacity: 2 }));
        assert!(inbox.admit_ending().is_ok(), "ending work still has room");
        assert!(inbox.send(filler("c")));
        assert!(inbox.send(filler("d")));
        assert!(inbox.admit_ending().is_err());
        assert!(inbox.wait_for_room(Duration::from_millis(5)).is_err());
        // The writer taking commands makes room again.
        commands.try_recv().unwrap();
        commands.recv_timeout(Duration::ZERO).unwrap();
        commands.try_recv().unwrap();
        assert_eq!(inbox.queued(), 1);
        assert!(inbox.admit().is_ok());
    }

    #[test]
    fn a_stop_jumps_the_queue() {
        let (inbox, commands) = inbox(4);
        for key in ["a", "b", "c"] {
            assert!(inbox.send(filler(key)));
        }
        inbox.stop();
        assert!(stops(&commands.try_recv().unwrap()));
        assert!(stops(&commands.recv_timeout(Duration::ZERO).unwrap()));
    }

    #[test]
    fn a_command_taken_as_the_stop_arrives_heads_the_backlog() {
        let (inbox, commands) = inbox(4);
        assert!(inbox.send(filler("a")));
        assert!(inbox.send(filler("b")));
        // The writer's receive took "a" just before the stop was set.
        let taken = commands.receiver.recv().unwrap();
        inbox.stop();
        assert!(stops(&commands.unless_stopping(taken)));
        let backlog = commands.backlog();
        let names: Vec<&str> = backlog
            .iter()
            .map(|command| match command {
                Command::ReportFanOut(key) => key.as_str(),
                Command::Stop => "stop",
                _ => "other",
            })
            .collect();
        assert_eq!(names, ["a", "b", "stop"]);
    }

    #[test]
    fn a_send_after_the_writer_is_gone_fails_and_is_not_counted() {
        let (inbox, commands) = inbox(4);
        drop(commands);
        assert!(!inbox.send(Command::Stop));
        assert_eq!(inbox.queued(), 0);
    }
}

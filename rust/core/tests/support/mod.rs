//! What the endpoint tests share: a loopback transport with faults injected, and a gate that
//! holds a writer in a transport call.
#![allow(dead_code)] // each test crate uses what it needs
#![allow(clippy::unwrap_used)] // test support: a failure is the test failing

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::planner::DescriptorRun;
use kvpush_core::transport::{
    MemoryRegion, MemorySpace, Notification, Transport, TransportError, WriteId, WriteState,
};

/// A WRITE an endpoint's transport posted: its bytes, and whether it carried a notification.
pub type Posted = (u64, bool);

/// How a [`Faulty`] transport misbehaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    None,
    /// Every WRITE stays in progress, and the transport cannot release it.
    StuckWrites,
    /// Posting a WRITE panics (a bug in the writer's thread).
    PanicOnPost,
    /// Every WRITE stays in progress for this long after its post (a slow link, a paused
    /// host), then completes.
    SlowWrites(Duration),
    /// Every WRITE that notifies nobody (a layer of a stream) fails when polled.
    FailingSilentWrites,
    /// The first this many WRITEs stay in progress; posting the next one panics (the writer
    /// dies with WRITEs in flight).
    StuckWritesThenPanic(usize),
}

/// The loopback transport with a fault injected.
pub struct Faulty {
    inner: LoopbackTransport,
    fault: Fault,
    stuck: Vec<WriteId>,
    /// `SlowWrites`: when each posted WRITE may complete.
    slow: Vec<(WriteId, Instant)>,
    /// Holds every `take_notifications` until it opens: a writer stuck in a transport call.
    gate: Option<Gate>,
    /// The agent name the transport gives instead of its own (its metadata stays its own).
    claimed: Option<String>,
    /// Where every WRITE posted is logged (the test's to read).
    posts: Arc<Mutex<Vec<Posted>>>,
    /// `FailingSilentWrites`: the writes that fail.
    failing: Vec<WriteId>,
}

impl Faulty {
    /// `inner` misbehaving as `fault` says, held at `gate` while it is closed, naming itself
    /// `claimed` when given, and logging every WRITE it posts in `posts`.
    pub fn new(
        inner: LoopbackTransport,
        fault: Fault,
        gate: Option<Gate>,
        claimed: Option<String>,
        posts: Arc<Mutex<Vec<Posted>>>,
    ) -> Self {
        Self {
            inner,
            fault,
            stuck: Vec::new(),
            slow: Vec::new(),
            gate,
            claimed,
            posts,
            failing: Vec::new(),
        }
    }
}

/// A transport call held until the test opens it.
#[derive(Clone)]
pub struct Gate(Arc<(Mutex<GateState>, Condvar)>);

#[derive(Default)]
struct GateState {
    open: bool,
    /// A caller is held at the gate now.
    holding: bool,
}

impl Gate {
    pub fn closed() -> Self {
        Self(Arc::new((Mutex::new(GateState::default()), Condvar::new())))
    }

    /// Waits here until the gate opens.
    pub fn pass(&self) {
        let (state, changed) = &*self.0;
        let mut state = state.lock().unwrap();
        state.holding = !state.open;
        changed.notify_all();
        while !state.open {
            state = changed.wait(state).unwrap();
        }
        state.holding = false;
    }

    pub fn open(&self) {
        let (state, changed) = &*self.0;
        state.lock().unwrap().open = true;
        changed.notify_all();
    }

    /// Waits until a caller (the writer) is held at the gate.
    pub fn wait_holding(&self) {
        let (state, changed) = &*self.0;
        let state = state.lock().unwrap();
        let (state, _) =
            changed.wait_timeout_while(state, Duration::from_secs(5), |s| !s.holding).unwrap();
        assert!(state.holding, "the writer never reached the transport");
    }
}

impl Transport for Faulty {
    fn name(&self) -> &str {
        self.claimed.as_deref().unwrap_or_else(|| self.inner.name())
    }
    unsafe fn register_memory(&mut self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        // SAFETY: forwarded; the caller's promise covers the inner transport too.
        unsafe { self.inner.register_memory(regions) }
    }
    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        self.inner.metadata()
    }
    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError> {
        self.inner.add_peer(metadata)
    }
    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError> {
        self.inner.remove_peer(peer)
    }
    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        let stuck_then_panic =
            matches!(self.fault, Fault::StuckWritesThenPanic(n) if self.stuck.len() >= n);
        let panics = self.fault == Fault::PanicOnPost || stuck_then_panic;
        assert!(!panics, "injected: the writer thread panics");
        let write = self.inner.post_write(peer, runs, local, remote, notification)?;
        let bytes = runs.iter().map(|run| run.len).sum();
        self.posts.lock().unwrap().push((bytes, notification.is_some()));
        match self.fault {
            Fault::StuckWrites | Fault::StuckWritesThenPanic(_) => self.stuck.push(write),
            Fault::SlowWrites(delay) => self.slow.push((write, Instant::now() + delay)),
            Fault::FailingSilentWrites if notification.is_none() => self.failing.push(write),
            Fault::None | Fault::PanicOnPost | Fault::FailingSilentWrites => {}
        }
        Ok(write)
    }
    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError> {
        if let Some(i) = self.failing.iter().position(|&w| w == write) {
            self.failing.swap_remove(i);
            let _ = self.inner.poll_write(write);
            return Err(TransportError::new("poll_write", "injected: the WRITE failed"));
        }
        let slow = self.slow.iter().any(|&(w, at)| w == write && Instant::now() < at);
        if slow || self.stuck.contains(&write) {
            return Ok(WriteState::InProgress);
        }
        self.inner.poll_write(write)
    }
    fn send_notification(&mut self, peer: &str, payload: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, payload)
    }
    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError> {
        if let Some(gate) = &self.gate {
            gate.pass();
        }
        self.inner.take_notifications(out)
    }
}

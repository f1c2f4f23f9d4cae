//! An in-process [`Transport`]: WRITEs are `memmove`s between memory registered by agents of one
//! process, and notifications are queued in the receiving agent's mailbox.
//!
//! It is the writer engine's test double and the baseline that isolates control overhead in
//! benches; it is never the data path between processes. Agents find each other through a
//! process-wide directory, by name: an agent's "metadata" is just its name.
//!
//! Every copy is checked against both agents' registered regions first, so a plan that strays
//! outside registered memory is an error here, as it would be in NIXL, never a stray write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::planner::DescriptorRun;
use crate::sync::lock;
use crate::transport::{
    MemoryKind, MemoryRegion, MemorySpace, Notification, Transport, TransportError, Unreachable,
    WriteId, WriteState,
};

/// What peers can see of an agent: its memory and its mailbox.
#[derive(Debug, Default)]
struct Shared {
    regions: Mutex<Vec<MemoryRegion>>,
    mailbox: Mutex<Vec<Notification>>,
}

impl Shared {
    fn covers(&self, addr: u64, len: u64, space: MemorySpace) -> bool {
        let end = match addr.checked_add(len) {
            Some(end) => end,
            None => return false,
        };
        lock(&self.regions).iter().any(|r| {
            r.space == space
                && r.addr <= addr
                && r.addr.checked_add(r.len).is_some_and(|e| end <= e)
        })
    }
}

/// A posted write whose completion (and notification) is still to be reported.
#[derive(Debug)]
struct PendingWrite {
    polls_left: u32,
    target: Arc<Shared>,
    notification: Option<Vec<u8>>,
}

/// The process-wide directory agents are found in.
fn directory() -> &'static Mutex<HashMap<String, Weak<Shared>>> {
    static DIRECTORY: OnceLock<Mutex<HashMap<String, Weak<Shared>>>> = OnceLock::new();
    DIRECTORY.get_or_init(Mutex::default)
}

/// An in-process transport agent; see the module docs.
#[derive(Debug)]
pub struct LoopbackTransport {
    name: String,
    shared: Arc<Shared>,
    peers: HashMap<String, Arc<Shared>>,
    writes: HashMap<WriteId, PendingWrite>,
    next_write: u64,
    polls_until_done: u32,
}

impl LoopbackTransport {
    /// How long a WRITE's bytes may land after it ended (`EndpointConfig::delivery_bound`):
    /// never, since the copy is done inside the call that reports the write done.
    pub const DELIVERY_BOUND: Duration = Duration::ZERO;

    /// A new agent called `name`, which must be unique in the process while it lives.
    pub fn new(name: impl Into<String>) -> Result<Self, TransportError> {
        let name = name.into();
        let shared = Arc::new(Shared::default());
        let mut directory = lock(directory());
        directory.retain(|_, agent| agent.strong_count() > 0);
        if directory.contains_key(&name) {
            return Err(TransportError::new("create agent", format!("agent {name:?} exists")));
        }
        directory.insert(name.clone(), Arc::downgrade(&shared));
        Ok(Self {
            name,
            shared,
            peers: HashMap::new(),
            writes: HashMap::new(),
            next_write: 1,
            polls_until_done: 0,
        })
    }

    /// Makes each write report [`WriteState::InProgress`] for `polls` polls before `Done`, like
    /// an asynchronous transport, so callers' polling paths are exercised. The bytes move at
    /// post time; the notification is delivered when a poll reports the write done (so with 0,
    /// the first poll delivers it).
    pub fn with_polls_until_done(mut self, polls: u32) -> Self {
        self.polls_until_done = polls;
        self
    }

    fn peer(&self, peer: &str, operation: &'static str) -> Result<&Arc<Shared>, TransportError> {
        self.peers
            .get(peer)
            .ok_or_else(|| TransportError::new(operation, format!("unknown peer {peer:?}")))
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        lock(directory()).remove(&self.name);
    }
}

impl Transport for LoopbackTransport {
    fn name(&self) -> &str {
        &self.name
    }

    unsafe fn register_memory(&mut self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        lock(&self.shared.regions).extend_from_slice(regions);
        Ok(())
    }

    /// A memcpy reaches host memory only.
    fn can_write_into(&self, remote: MemorySpace) -> Result<(), Unreachable> {
        match remote.kind {
            MemoryKind::Dram => Ok(()),
            MemoryKind::Vram => Err(Unreachable::HostMemoryOnly { transport: "loopback" }),
        }
    }

    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        Ok(self.name.as_bytes().to_vec())
    }

    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError> {
        let name = std::str::from_utf8(metadata)
            .map_err(|_| TransportError::new("add_peer", "metadata is not a loopback agent name"))?
            .to_owned();
        let shared = lock(directory()).get(&name).and_then(Weak::upgrade).ok_or_else(|| {
            TransportError::new("add_peer", format!("no loopback agent {name:?} in this process"))
        })?;
        self.peers.insert(name.clone(), shared);
        Ok(name)
    }

    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError> {
        self.peers.remove(peer);
        Ok(())
    }

    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        let target = Arc::clone(self.peer(peer, "post_write")?);
        for run in runs {
            if !self.shared.covers(run.src, run.len, local) {
                return Err(TransportError::new(
                    "post_write",
                    format!("source {:#x}+{} is not registered memory", run.src, run.len),
                ));
            }
            if !target.covers(run.dst, run.len, remote) {
                return Err(TransportError::new(
                    "post_write",
                    format!(
                        "destination {:#x}+{} is not {peer}'s registered memory",
                        run.dst, run.len
                    ),
                ));
            }
        }
        for run in runs {
            // SAFETY: both ranges lie inside memory registered with `register_memory`, whose
            // contract keeps it valid for reads and writes while the agents live; this agent and
            // `target` are alive here. `copy` (memmove) tolerates overlap, in case one buffer
            // was registered by both agents.
            unsafe {
                std::ptr::copy(run.src as *const u8, run.dst as *mut u8, run.len as usize);
            }
        }
        let id = WriteId(self.next_write);
        self.next_write += 1;
        let pending = PendingWrite {
            polls_left: self.polls_until_done,
            target,
            notification: notification.map(<[u8]>::to_vec),
        };
        self.writes.insert(id, pending);
        Ok(id)
    }

    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError> {
        let pending = self
            .writes
            .get_mut(&write)
            .ok_or_else(|| TransportError::new("poll_write", format!("unknown write {write:?}")))?;
        if pending.polls_left > 0 {
            pending.polls_left -= 1;
            return Ok(WriteState::InProgress);
        }
        if let Some(done) = self.writes.remove(&write) {
            // As with NIXL, the notification goes out only once the write is complete.
            if let Some(notification) = &done.notification {
                deliver(&done.target, &self.name, notification);
            }
        }
        Ok(WriteState::Done)
    }

    fn send_notification(&mut self, peer: &str, payload: &[u8]) -> Result<(), TransportError> {
        let target = Arc::clone(self.peer(peer, "send_notification")?);
        deliver(&target, &self.name, payload);
        Ok(())
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError> {
        out.append(&mut lock(&self.shared.mailbox));
        Ok(())
    }
}

fn deliver(target: &Shared, from: &str, payload: &[u8]) {
    lock(&target.mailbox).push(Notification { from: from.to_owned(), payload: payload.to_vec() });
}

#[cfg(all(test, not(loom)))]
#[allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is the test failing
mod tests {
    use super::*;

    fn region(buf: &[u8]) -> MemoryRegion {
        MemoryRegion { addr: buf.as_ptr() as u64, len: buf.len() as u64, space: MemorySpace::DRAM }
    }

    fn pair(a: &str, b: &str, src: &[u8], dst: &[u8]) -> (LoopbackTransport, LoopbackTransport) {
        let mut p = LoopbackTransport::new(a).unwrap().with_polls_until_done(1);
        let mut d = LoopbackTransport::new(b).unwrap();
        // SAFETY: the test's buffers outlive both agents (dropped at the end of each test).
        unsafe {
            p.register_memory(&[region(src)]).unwrap();
            d.register_memory(&[region(dst)]).unwrap();
        }
        let d_meta = d.metadata().unwrap();
        assert_eq!(p.add_peer(&d_meta).unwrap(), b);
        (p, d)
    }

    #[test]
    fn writes_land_and_the_notification_follows_completion() {
        let src: Vec<u8> = (0..64).collect();
        let dst = vec![0u8; 64];
        let (mut p, mut d) = pair("lb-p1", "lb-d1", &src, &dst);
        let runs = [
            DescriptorRun { src: src.as_ptr() as u64 + 8, dst: dst.as_ptr() as u64, len: 4 },
            DescriptorRun { src: src.as_ptr() as u64, dst: dst.as_ptr() as u64 + 60, len: 4 },
        ];
        let id = p
            .post_write("lb-d1", &runs, MemorySpace::DRAM, MemorySpace::DRAM, Some(b"done"))
            .unwrap();
        let mut notes = Vec::new();
        d.take_notifications(&mut notes).unwrap();
        assert!(notes.is_empty(), "no notification before the write is reported done");
        assert_eq!(p.poll_write(id).unwrap(), WriteState::InProgress);
        assert_eq!(p.poll_write(id).unwrap(), WriteState::Done);
        d.take_notifications(&mut notes).unwrap();
        assert_eq!(notes, [Notification { from: "lb-p1".into(), payload: b"done".to_vec() }]);
        assert_eq!(&dst[..4], &[8, 9, 10, 11]);
        assert_eq!(&dst[60..], &[0, 1, 2, 3]);
        assert!(dst[4..60].iter().all(|&b| b == 0), "nothing else changed");
    }

    #[test]
    fn a_write_without_a_notification_lands_and_tells_nothing() {
        let src: Vec<u8> = (0..8).collect();
        let dst = vec![0u8; 8];
        let (mut p, mut d) = pair("lb-p3", "lb-d3", &src, &dst);
        let run = DescriptorRun { src: src.as_ptr() as u64, dst: dst.as_ptr() as u64, len: 8 };
        let id = p.post_write("lb-d3", &[run], MemorySpace::DRAM, MemorySpace::DRAM, None).unwrap();
        while p.poll_write(id).unwrap() == WriteState::InProgress {}
        let mut notes = Vec::new();
        d.take_notifications(&mut notes).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(dst, src);
    }

    #[test]
    fn writes_outside_registered_memory_are_refused() {
        let src = vec![1u8; 16];
        let dst = vec![0u8; 16];
        let (mut p, _d) = pair("lb-p2", "lb-d2", &src, &dst);
        let past_end =
            [DescriptorRun { src: src.as_ptr() as u64, dst: dst.as_ptr() as u64 + 8, len: 9 }];
        let err = p
            .post_write("lb-d2", &past_end, MemorySpace::DRAM, MemorySpace::DRAM, None)
            .unwrap_err();
        assert!(err.detail.contains("lb-d2's registered memory"), "{err}");
        assert!(dst.iter().all(|&b| b == 0));
        let err =
            p.post_write("nobody", &[], MemorySpace::DRAM, MemorySpace::DRAM, None).unwrap_err();
        assert!(err.detail.contains("unknown peer"), "{err}");
    }

    #[test]
    fn names_are_unique_while_alive() {
        let first = LoopbackTransport::new("lb-unique").unwrap();
        assert!(LoopbackTransport::new("lb-unique").is_err());
        drop(first);
        assert!(LoopbackTransport::new("lb-unique").is_ok());
    }
}

//! [`NixlTransport`]: the core's [`Transport`] on a NIXL agent with a UCX backend.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use kvpush_core::planner::DescriptorRun;
use kvpush_core::transport::{
    BlockArray, BlockWrite, MemoryRegion, MemorySpace, Notification, Transport, TransportError,
    WriteId, WriteState,
};

use crate::api::{self, Api, Library, THREAD_SYNC_NONE};
use crate::error::NixlError;
use crate::handles::{
    AgentCore, NotifMap, OptArgs, PreparedList, Registration, XferDescList, XferRequest,
};

/// The shortest progress-thread poll interval accepted, in µs. NIXL's UCX thread waits in
/// `poll()` for `ceil(interval / 1 ms)` milliseconds, so 0 (NIXL's default) busy-loops on a core.
pub const MIN_PROGRESS_INTERVAL_US: u64 = 1_000;

/// Who drives the agent's UCX progress (connection wire-up, incoming notifications, and, with
/// `cma`, the copies themselves). Default: [`Progress::Caller`]; see the crate docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// NIXL's progress thread, which sleeps in `poll()` for up to `interval_us` between rounds
    /// (raised to [`MIN_PROGRESS_INTERVAL_US`] if lower). UCX keeps moving while the owner of
    /// the transport is parked.
    Thread {
        /// Poll interval in µs.
        interval_us: u64,
    },
    /// No thread: only this transport's own calls (`take_notifications`, `poll_write`,
    /// `post_write`, `send_notification`) progress UCX, so the owner must keep calling
    /// `take_notifications` while it waits for anything, handshakes included. kvpush's writer
    /// thread does: every 200 µs while anything is in flight or awaited.
    Caller,
}

impl Progress {
    /// NIXL's progress thread at the shortest interval accepted.
    pub const THREAD: Self = Self::Thread { interval_us: MIN_PROGRESS_INTERVAL_US };
}

/// How to create the agent. The default is what kvpush's endpoints run, from Rust and from
/// Python alike: no progress thread (the owner drives progress) and UCX's own parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Who drives progress; default: the owner ([`Progress::Caller`]).
    pub progress: Progress,
    /// UCX backend parameters that replace or add to the plugin's defaults, e.g.
    /// `("engine_config", "TLS=tcp")` or `("ucx_devices", "mlx5_0:1")`. Empty: UCX's defaults.
    pub ucx_params: Vec<(String, String)>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self { progress: Progress::Caller, ucx_params: Vec::new() }
    }
}

impl AgentConfig {
    /// The default agent, with NIXL's progress thread ([`Progress::THREAD`]) as well.
    pub fn with_progress_thread() -> Self {
        Self { progress: Progress::THREAD, ..Self::default() }
    }

    fn to_c(&self) -> api::AgentConfig {
        let (thread, delay) = match self.progress {
            Progress::Thread { interval_us } => (true, interval_us.max(MIN_PROGRESS_INTERVAL_US)),
            Progress::Caller => (false, MIN_PROGRESS_INTERVAL_US),
        };
        api::AgentConfig {
            enable_prog_thread: thread,
            enable_listen_thread: false,
            listen_port: 0,
            // One thread (the writer) makes every call on this agent, so NIXL's agent lock is
            // not needed; UCX's own progress thread synchronises with the worker itself.
            thread_sync: THREAD_SYNC_NONE,
            num_workers: 1,
            pthr_delay_us: delay,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        }
    }
}

/// A peer whose metadata is loaded.
#[derive(Debug)]
struct Peer {
    name: Rc<str>,
    c_name: CString,
}

/// Tables kept prepared per side (and per peer) at most: a pair's tables change only when a
/// layout does, and the oldest goes first.
const PREPARED_TABLES: usize = 4;

/// One block table, prepared as a descriptor list with one descriptor per block, in table order.
#[derive(Debug)]
struct PreparedTable {
    space: MemorySpace,
    table: Vec<BlockArray>,
    /// `None`: NIXL could not prepare it (a block outside registered memory, or a table too
    /// large for C `int` indices); writes of this table take the fresh-list path.
    list: Option<PreparedList>,
    /// The length every block of the table shares, if one (a WRITE's bytes, for errors).
    block_len: Option<u64>,
}

/// Finds `table` in `tables`, preparing it (with `prepare`) when it is not there.
fn find_or_prepare(
    tables: &mut Vec<PreparedTable>,
    space: MemorySpace,
    table: &[BlockArray],
    prepare: impl FnOnce() -> Option<PreparedList>,
) -> usize {
    if let Some(i) = tables.iter().position(|t| t.space == space && t.table == table) {
        return i;
    }
    if tables.len() >= PREPARED_TABLES {
        tables.remove(0);
    }
    let block_len = table.first().map(|a| a.len).filter(|&len| table.iter().all(|a| a.len == len));
    tables.push(PreparedTable { space, table: table.to_vec(), list: prepare(), block_len });
    tables.len() - 1
}

/// `table` as a descriptor list (reusing `list`) prepared by `agent` for `peer` (`None`: for
/// itself); `None` when NIXL refuses it or its indices would not fit a C `int`.
fn prepare_table(
    agent: &Rc<AgentCore>,
    api: &Arc<Api>,
    list: &mut XferDescList,
    peer: Option<&CStr>,
    space: MemorySpace,
    table: &[BlockArray],
) -> Option<PreparedList> {
    let blocks: u64 = table.iter().map(|a| u64::from(a.count)).sum();
    if blocks > i32::MAX as u64 {
        return None;
    }
    let list = scratch_list(list, api, space).ok()?;
    for array in table {
        for k in 0..u64::from(array.count) {
            list.push(array.base + k * array.stride, array.len, space.device).ok()?;
        }
    }
    agent.prepare(peer, list).ok()
}

/// A posted write that has not been reported done or failed yet.
#[derive(Debug)]
enum Pending {
    Write {
        request: XferRequest,
        peer: Rc<str>,
        runs: usize,
        bytes: u64,
    },
    /// A write of no bytes: its notification, if any, goes out when it is polled, like the
    /// loopback's.
    NotifyOnly {
        peer: Rc<str>,
        payload: Option<Vec<u8>>,
    },
    /// A write that failed (its post, or a poll) and whose request the backend would not let
    /// go: some of its operations may still be moving bytes. It stays in progress for the
    /// writer, which therefore says nothing to D and keeps the blocks, until the backend
    /// releases it; then the poll reports `error`.
    Failing {
        request: XferRequest,
        error: NixlError,
    },
}

/// A NIXL agent with a UCX backend, as the writer engine's [`Transport`].
///
/// Create it on any thread, then hand it to the one thread that makes every call (the writer):
/// it is `Send`, not `Sync`. Dropping it releases in-flight writes, deregisters memory and
/// destroys the agent.
pub struct NixlTransport {
    // Field order is drop order: requests go before registrations, the agent last (its `Rc`
    // keeps it alive for whichever handle is dropped last anyway).
    writes: HashMap<WriteId, Pending>,
    /// Released writes the backend could not let go of yet (cancelled while in flight); retried
    /// on every poll and notification call.
    stuck: Vec<XferRequest>,
    /// Block tables prepared against each peer's metadata, by peer; released before the peer's
    /// metadata is invalidated or reloaded, and, when dropped, before the registrations.
    remote_tables: HashMap<String, Vec<PreparedTable>>,
    /// Block tables of this agent's memory, prepared.
    local_tables: Vec<PreparedTable>,
    /// Writes built from prepared lists (for tests and benchmarks).
    prepared_writes: u64,
    registrations: Vec<Registration>,
    peers: HashMap<String, Peer>,
    /// Descriptor lists reused by every write (`create_xfer_req` copies them).
    local_list: XferDescList,
    remote_list: XferDescList,
    opts: OptArgs,
    notifs: NotifMap,
    next_write: u64,
    agent: Rc<AgentCore>,
    library: Library,
}

// SAFETY: `NixlTransport` is `!Send` only because of its `Rc`s (the agent's, in `agent`,
// `registrations`, `writes` and `stuck`; peer names, in `peers` and `writes`) and the raw handle
// pointers inside its fields. Every clone of each `Rc` lives inside this value (none is ever
// handed out), so moving the transport moves all of them together and no two threads can touch
// a count. NIXL's objects
// are not tied to the thread that created them; what they need is that calls are not
// concurrent, which `&mut self` on every NIXL-calling method guarantees (the type is not `Sync`).
unsafe impl Send for NixlTransport {}

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlTransport")
            .field("name", &self.agent.name())
            .field("library", &self.library.path())
            .field("registrations", &self.registrations.len())
            .field("peers", &self.peers.keys().collect::<Vec<_>>())
            .field("writes_in_flight", &self.writes.len())
            .field("stuck", &self.stuck.len())
            .finish()
    }
}

impl NixlTransport {
    /// Creates agent `name` (unique among the agents that will talk to it) with a UCX backend.
    pub fn new(library: &Library, name: &str, config: &AgentConfig) -> Result<Self, NixlError> {
        let api: &Arc<Api> = library.api();
        let agent = AgentCore::create(api, name, &config.to_c(), &config.ucx_params)?;
        Ok(Self {
            writes: HashMap::new(),
            stuck: Vec::new(),
            remote_tables: HashMap::new(),
            local_tables: Vec::new(),
            prepared_writes: 0,
            registrations: Vec::new(),
            peers: HashMap::new(),
            local_list: XferDescList::new(api, MemorySpace::DRAM)?,
            remote_list: XferDescList::new(api, MemorySpace::DRAM)?,
            opts: OptArgs::new(api)?,
            notifs: NotifMap::new(api)?,
            next_write: 1,
            agent,
            library: library.clone(),
        })
    }

    /// The library this agent runs on.
    pub fn library(&self) -> &Library {
        &self.library
    }

    /// Writes posted and not yet reported done, failed or abandoned.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    /// Writes posted from prepared descriptor lists ([`Transport::post_block_write`]) so far.
    pub fn prepared_writes(&self) -> u64 {
        self.prepared_writes
    }

    /// Prepared descriptor lists held: of this agent's memory, and of peers' (all peers).
    pub fn prepared_lists(&self) -> (usize, usize) {
        let live = |tables: &[PreparedTable]| tables.iter().filter(|t| t.list.is_some()).count();
        (live(&self.local_tables), self.remote_tables.values().map(|t| live(t)).sum())
    }

    /// Posts the WRITE of `request` (`runs` runs of `bytes` bytes) as write `id`: see
    /// `post_write`.
    fn post_request(
        &mut self,
        id: WriteId,
        mut request: XferRequest,
        peer: (&str, Rc<str>),
        runs: usize,
        bytes: u64,
    ) -> Result<WriteId, TransportError> {
        const OP: &str = "post_write";
        let (peer, peer_name) = peer;
        if let Err(mut e) = request.post() {
            e.detail = format!("WRITE {id:?} of {runs} runs ({bytes} B) to peer {peer:?}");
            // Part of it may have been posted: a write in flight until NIXL lets it go.
            self.fail_once_released(OP, id, request, e)?;
            self.next_write += 1;
            return Ok(id);
        }
        self.next_write += 1;
        self.writes.insert(id, Pending::Write { request, peer: peer_name, runs, bytes });
        Ok(id)
    }

    /// Tries again to release requests the backend held on to.
    fn retry_stuck(&mut self) {
        if self.stuck.is_empty() {
            return;
        }
        for request in std::mem::take(&mut self.stuck) {
            if let Err((request, _)) = request.release() {
                self.stuck.push(request);
            }
        }
    }

    /// `request` (write `write`) failed with `error`: `error` once the backend let go of the
    /// request; until then the write stays in flight, as `Pending::Failing` (some of its
    /// operations may still move bytes), and a later poll tries the release again.
    fn fail_once_released(
        &mut self,
        operation: &'static str,
        write: WriteId,
        request: XferRequest,
        error: NixlError,
    ) -> Result<WriteState, TransportError> {
        match request.release() {
            Ok(()) => Err(err(operation, error)),
            Err((request, _)) => {
                self.writes.insert(write, Pending::Failing { request, error });
                Ok(WriteState::InProgress)
            }
        }
    }

    /// Releases `request`; `false` when the backend could not let it go (kept, and retried, in
    /// `stuck`).
    fn release(&mut self, request: XferRequest) -> bool {
        match request.release() {
            Ok(()) => true,
            Err((request, _)) => {
                self.stuck.push(request);
                false
            }
        }
    }

    fn peer(&self, peer: &str, operation: &'static str) -> Result<&Peer, TransportError> {
        self.peers.get(peer).ok_or_else(|| unknown_peer(operation, peer))
    }
}

fn unknown_peer(operation: &'static str, peer: &str) -> TransportError {
    TransportError::new(
        operation,
        format!("unknown peer {peer:?}: call add_peer with its metadata first"),
    )
}

/// `list`, emptied, for `space`'s memory type (replaced when it was for another type).
fn scratch_list<'a>(
    list: &'a mut XferDescList,
    api: &Arc<Api>,
    space: MemorySpace,
) -> Result<&'a mut XferDescList, NixlError> {
    if list.is_for(space) {
        list.clear()?;
    } else {
        *list = XferDescList::new(api, space)?;
    }
    Ok(list)
}

fn err(operation: &'static str, e: NixlError) -> TransportError {
    TransportError::new(operation, e)
}

impl Transport for NixlTransport {
    fn name(&self) -> &str {
        self.agent.name()
    }

    unsafe fn register_memory(&mut self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        self.registrations.reserve(regions.len());
        for region in regions {
            // SAFETY: the caller keeps every region valid until the transport is dropped, and the
            // registration is dropped with the transport.
            let registration =
                unsafe { self.agent.register(region.addr, region.len, region.space) }
                    .map_err(|e| err("register_memory", e))?;
            self.registrations.push(registration);
        }
        Ok(())
    }

    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        self.agent.local_metadata().map_err(|e| err("metadata", e))
    }

    /// A peer added again (new metadata under a known name) loses its prepared lists.
    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError> {
        let name = self.agent.load_remote_metadata(metadata).map_err(|e| err("add_peer", e))?;
        // Prepared against the metadata just replaced (if any): prepared again on next use.
        self.remote_tables.remove(&name);
        let c_name = CString::new(name.as_str()).map_err(|_| {
            TransportError::new("add_peer", format!("peer name {name:?} contains a NUL"))
        })?;
        self.peers.insert(name.clone(), Peer { name: Rc::from(name.as_str()), c_name });
        Ok(name)
    }

    /// Idempotent: forgetting an unknown peer succeeds. Writes still in flight to the peer fail
    /// at their next poll.
    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError> {
        // Released before the metadata they were prepared against is invalidated.
        self.remote_tables.remove(peer);
        match self.peers.remove(peer) {
            Some(known) => {
                self.agent.invalidate_remote(&known.c_name).map_err(|e| err("remove_peer", e))
            }
            None => Ok(()),
        }
    }

    /// Builds one local and one remote descriptor per run (reusing the lists: O(runs) calls of
    /// ~tens of ns), creates the WRITE with the notification, and posts it. NIXL's
    /// `create_xfer_req` does not merge descriptors: pass runs the planner already merged.
    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        const OP: &str = "post_write";
        let id = WriteId(self.next_write);
        // Borrow only the `peers` field: the lists below are borrowed mutably meanwhile.
        let target = self.peers.get(peer).ok_or_else(|| unknown_peer(OP, peer))?;
        let peer_name = Rc::clone(&target.name);
        if runs.is_empty() {
            self.next_write += 1;
            let payload = notification.map(<[u8]>::to_vec);
            self.writes.insert(id, Pending::NotifyOnly { peer: peer_name, payload });
            return Ok(id);
        }
        let api = self.library.api();
        let local_list = scratch_list(&mut self.local_list, api, local).map_err(|e| err(OP, e))?;
        let remote_list =
            scratch_list(&mut self.remote_list, api, remote).map_err(|e| err(OP, e))?;
        let mut bytes = 0u64;
        for run in runs {
            local_list.push(run.src, run.len, local.device).map_err(|e| err(OP, e))?;
            remote_list.push(run.dst, run.len, remote.device).map_err(|e| err(OP, e))?;
            bytes = bytes.saturating_add(run.len);
        }
        self.opts.set_notification(notification).map_err(|e| err(OP, e))?;
        let request = self
            .agent
            .create_write(local_list, remote_list, &target.c_name, &self.opts)
            .map_err(|e| err(OP, e))?;
        self.post_request(id, request, (peer, peer_name), runs.len(), bytes)
    }

    /// From descriptor lists prepared once per local block table and once per (peer, remote
    /// block table), with one descriptor per block: the request is `make_xfer_req` on the
    /// indices (NIXL merges neighbours contiguous on both sides), with no descriptor built. A
    /// table NIXL will not prepare, a write of no blocks, and a write whose runs are fewer than
    /// half its blocks (mostly contiguous: its runs are cheaper to pass than its indices, see
    /// `benches/post_write.rs`) go the `post_write` way.
    fn post_block_write(
        &mut self,
        peer: &str,
        write: &BlockWrite<'_>,
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        const OP: &str = "post_write";
        if write.src.is_empty()
            || write.src.len() != write.dst.len()
            || write.runs.len().saturating_mul(2) <= write.src.len()
        {
            return self.post_write(peer, write.runs, local, remote, notification);
        }
        let id = WriteId(self.next_write);
        let target = self.peers.get(peer).ok_or_else(|| unknown_peer(OP, peer))?;
        let peer_name = Rc::clone(&target.name);
        let api = self.library.api();
        let (agent, list) = (&self.agent, &mut self.local_list);
        let local_at = find_or_prepare(&mut self.local_tables, local, write.src_blocks, || {
            prepare_table(agent, api, list, None, local, write.src_blocks)
        });
        let remote_tables = match self.remote_tables.get_mut(peer) {
            Some(tables) => tables,
            None => self.remote_tables.entry(peer.to_owned()).or_default(),
        };
        let list = &mut self.remote_list;
        let remote_at = find_or_prepare(remote_tables, remote, write.dst_blocks, || {
            prepare_table(agent, api, list, Some(&target.c_name), remote, write.dst_blocks)
        });
        let local_table = self.local_tables.get(local_at);
        let (Some(local_list), Some(remote_list)) = (
            local_table.and_then(|t| t.list.as_ref()),
            remote_tables.get(remote_at).and_then(|t| t.list.as_ref()),
        ) else {
            return self.post_write(peer, write.runs, local, remote, notification);
        };
        let bytes = match local_table.and_then(|t| t.block_len) {
            Some(len) => len.saturating_mul(write.src.len() as u64),
            None => write.runs.iter().map(|run| run.len).sum(),
        };
        self.opts.set_notification(notification).map_err(|e| err(OP, e))?;
        let request = self
            .agent
            .make_write(local_list, write.src, remote_list, write.dst, &self.opts)
            .map_err(|e| err(OP, e))?;
        self.prepared_writes += 1;
        self.post_request(id, request, (peer, peer_name), write.runs.len(), bytes)
    }

    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError> {
        const OP: &str = "poll_write";
        self.retry_stuck();
        let polled = match self.writes.get_mut(&write) {
            None => {
                return Err(TransportError::new(
                    OP,
                    format!("unknown write {write:?} (already done, failed or abandoned?)"),
                ))
            }
            Some(Pending::Write { request, .. }) => request.poll(),
            Some(Pending::NotifyOnly { .. }) => Ok(true),
            // Failed already: only its release is left to try.
            Some(Pending::Failing { .. }) => Ok(true),
        };
        if let Ok(false) = polled {
            return Ok(WriteState::InProgress);
        }
        let Some(pending) = self.writes.remove(&write) else {
            return Err(TransportError::new(OP, format!("write {write:?} vanished")));
        };
        match (pending, polled) {
            (Pending::NotifyOnly { peer, payload }, _) => {
                if let Some(payload) = payload {
                    let target = self.peer(&peer, OP)?;
                    let sent = self.agent.send_notification(&target.c_name, &payload);
                    sent.map_err(|e| err(OP, e))?;
                }
                Ok(WriteState::Done)
            }
            (Pending::Write { request, .. }, Ok(_)) => {
                self.release(request);
                Ok(WriteState::Done)
            }
            (Pending::Write { request, peer, runs, bytes }, Err(mut e)) => {
                e.detail = format!("WRITE {write:?} of {runs} runs ({bytes} B) to peer {peer:?}");
                self.fail_once_released(OP, write, request, e)
            }
            (Pending::Failing { request, error }, _) => {
                self.fail_once_released(OP, write, request, error)
            }
        }
    }

    fn send_notification(&mut self, peer: &str, payload: &[u8]) -> Result<(), TransportError> {
        const OP: &str = "send_notification";
        let target = self.peer(peer, OP)?;
        self.agent.send_notification(&target.c_name, payload).map_err(|e| err(OP, e))
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError> {
        self.retry_stuck();
        self.agent
            .take_notifications(&mut self.notifs, out)
            .map_err(|e| err("take_notifications", e))
    }
}

#[cfg(test)]
mod tests {
    //! A failed WRITE whose request the backend will not release stays in flight: the writer
    //! must say nothing to D while some of it may still move. On the wheel's library (these
    //! tests skip without `KVPUSH_NIXL_CAPI`, and fail under `KVPUSH_REQUIRE_NIXL`), with the
    //! failures injected (`handles::faults`).

    use super::*;
    use crate::api::CAPI_PATH_ENV;
    use crate::handles::faults::{self, FAILED_POLLS, FAILED_POSTS, REFUSED_RELEASES};

    const LEN: usize = 1 << 20;

    /// One pair of agents at a time (two cores; each test's agents are progressed by it).
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn library() -> Option<Library> {
        match Library::discover() {
            Ok(library) => Some(library),
            Err(error)
                if std::env::var_os("KVPUSH_REQUIRE_NIXL").is_some_and(|v| !v.is_empty()) =>
            {
                panic!("KVPUSH_REQUIRE_NIXL is set and NIXL did not load: {error}")
            }
            Err(error) => {
                eprintln!("SKIP: {CAPI_PATH_ENV}: {error}");
                None
            }
        }
    }

    fn region(buf: &[u8]) -> MemoryRegion {
        MemoryRegion { addr: buf.as_ptr() as u64, len: buf.len() as u64, space: MemorySpace::DRAM }
    }

    /// A posts one WRITE of `src` into `dst` to B; returns A, B and the write.
    fn post(
        library: &Library,
        tag: &str,
        src: &[u8],
        dst: &[u8],
    ) -> (NixlTransport, NixlTransport, Result<WriteId, TransportError>) {
        let config = AgentConfig::default();
        let mut a = NixlTransport::new(library, &format!("{tag}-A"), &config).unwrap();
        let mut b = NixlTransport::new(library, &format!("{tag}-B"), &config).unwrap();
        // SAFETY: both buffers outlive both agents (the callers drop the agents first).
        unsafe {
            a.register_memory(&[region(src)]).unwrap();
            b.register_memory(&[region(dst)]).unwrap();
        }
        let b_md = b.metadata().unwrap();
        let peer = a.add_peer(&b_md).unwrap();
        let run =
            DescriptorRun { src: src.as_ptr() as u64, dst: dst.as_ptr() as u64, len: LEN as u64 };
        let posted =
            a.post_write(&peer, &[run], MemorySpace::DRAM, MemorySpace::DRAM, Some(b"done"));
        (a, b, posted)
    }

    #[test]
    fn a_failed_write_the_backend_holds_on_to_is_in_flight_until_it_lets_go() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(library) = library() else { return };
        let (src, dst) = (vec![7u8; LEN], vec![0u8; LEN]);
        let (mut a, b, posted) = post(&library, "failing-poll", &src, &dst);
        let write = posted.unwrap();
        faults::inject(&FAILED_POLLS, 1);
        faults::inject(&REFUSED_RELEASES, 2);
        // Failed, and held: in progress while the backend keeps the request.
        assert_eq!(a.poll_write(write).unwrap(), WriteState::InProgress);
        assert_eq!(a.poll_write(write).unwrap(), WriteState::InProgress);
        assert_eq!(a.writes_in_flight(), 1);
        // Let go of: now its failure, once.
        let error = a.poll_write(write).unwrap_err();
        assert!(error.to_string().contains("get_xfer_status returned"), "{error}");
        assert_eq!(a.writes_in_flight(), 0);
        assert!(a.poll_write(write).is_err(), "a finished write is unknown");
        drop((a, b));
    }

    #[test]
    fn a_failed_post_the_backend_holds_on_to_is_a_write_in_flight() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(library) = library() else { return };
        let (src, dst) = (vec![7u8; LEN], vec![0u8; LEN]);
        faults::inject(&FAILED_POSTS, 1);
        faults::inject(&REFUSED_RELEASES, 1);
        let (mut a, b, posted) = post(&library, "failing-post", &src, &dst);
        let write = posted.expect("a post the backend held is reported as a write in flight");
        assert_eq!(a.writes_in_flight(), 1);
        let error = a.poll_write(write).unwrap_err();
        assert!(error.to_string().contains("post_xfer_req returned"), "{error}");
        assert_eq!(a.writes_in_flight(), 0);
        // Released at once: the post's failure itself.
        faults::inject(&FAILED_POSTS, 1);
        let run = DescriptorRun { src: src.as_ptr() as u64, dst: dst.as_ptr() as u64, len: 8 };
        let peer = b.name().to_owned();
        let refused = a.post_write(&peer, &[run], MemorySpace::DRAM, MemorySpace::DRAM, Some(b"x"));
        assert!(refused.is_err());
        assert_eq!(a.writes_in_flight(), 0);
        drop((a, b));
    }
}

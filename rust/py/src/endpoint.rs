//! `Endpoint` and `TransferEvent`: a worker's push endpoint as Python sees it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use kvpush_core::endpoint::{
    self as core, AbortOutcome, EndpointConfig, Event, Expectation, Outcome, ReadyKv, Role, Share,
};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::BlockGroup;
use kvpush_core::transport::{MemoryRegion, MemorySpace, Transport};
use kvpush_nixl::{AgentConfig, Library, NixlTransport};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::Error;
use crate::native::{detached, native};
use crate::planner::KvLayout;

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, not {value}"
        ))
    })
}

/// Block lists as Python gives them: one list per KV group, or one flat list for one group,
/// with each group's first token (0 unless given).
fn groups(
    blocks: crate::planner::Groups,
    first_tokens: Option<Vec<u64>>,
) -> PyResult<Vec<BlockGroup>> {
    let lists = blocks.into_lists();
    let firsts = first_tokens.unwrap_or_else(|| vec![0; lists.len()]);
    if firsts.len() != lists.len() {
        return Err(PyValueError::new_err(format!(
            "first_tokens has {} entries but blocks has {} groups",
            firsts.len(),
            lists.len()
        )));
    }
    Ok(lists
        .into_iter()
        .zip(firsts)
        .map(|(block_ids, first_token)| BlockGroup { first_token, block_ids })
        .collect())
}

/// How one request's transfer ended on this side.
#[pyclass(module = "kvpush", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct TransferEvent {
    /// "send" (P) or "receive" (D).
    role: &'static str,
    /// The local request id.
    request_id: String,
    /// The transfer key both sides matched on.
    key: String,
    /// "done", "failed", "cancelled" or "quarantined" (the blocks must never be reused).
    outcome: &'static str,
    /// Why, when not done: the detail, for people.
    reason: Option<String>,
    /// Why, when not done: a `kvpush.outcomes.Reason` (programs and metrics branch on it).
    code: Option<Py<PyAny>>,
    /// Bytes written (P) or announced by the DONEs (D).
    bytes: u64,
    /// Descriptor runs in the WRITE (P).
    runs: u32,
    /// Seconds on the endpoint's clock: registered, ready, matched, posted, completed.
    timeline: Py<PyDict>,
}

impl TransferEvent {
    fn new(py: Python<'_>, event: Event) -> PyResult<Self> {
        let code = match event.outcome.cause() {
            Some(cause) => Some(
                py.import("kvpush.outcomes")?
                    .getattr("Reason")?
                    .call1((cause.reason.code(),))?
                    .unbind(),
            ),
            None => None,
        };
        let (outcome, reason) = match event.outcome {
            Outcome::Done => ("done", None),
            Outcome::Failed(cause) => ("failed", Some(cause.detail)),
            Outcome::Cancelled(cause) => ("cancelled", Some(cause.detail)),
            Outcome::Quarantined(cause) => ("quarantined", Some(cause.detail)),
        };
        let t = event.timeline;
        let timeline = PyDict::new(py);
        for (name, at) in [
            ("registered", t.registered),
            ("ready", t.ready),
            ("matched", t.matched),
            ("posted", t.posted),
            ("completed", t.completed),
        ] {
            if let Some(at) = at {
                timeline.set_item(name, at)?;
            }
        }
        Ok(Self {
            role: match event.role {
                Role::Send => "send",
                Role::Receive => "receive",
            },
            request_id: event.request_id,
            key: event.key.as_str().to_owned(),
            outcome,
            reason,
            code,
            bytes: event.bytes,
            runs: event.runs,
            timeline: timeline.unbind(),
        })
    }
}

#[pymethods]
impl TransferEvent {
    fn __repr__(&self) -> String {
        match &self.reason {
            None => format!(
                "TransferEvent({} {:?} {}: {} bytes, {} runs)",
                self.role, self.request_id, self.outcome, self.bytes, self.runs
            ),
            Some(reason) => {
                format!(
                    "TransferEvent({} {:?} {}: {reason})",
                    self.role, self.request_id, self.outcome
                )
            }
        }
    }
}

/// 32 bits no other endpoint of this process, nor likely of any other, picks.
fn unique_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    static CREATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    // Relaxed: only the uniqueness of each value matters.
    hasher.write_u64(CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    // Truncating is intended: 32 bits of a 64-bit hash.
    hasher.finish() as u32
}

fn events(py: Python<'_>, events: Vec<Event>) -> PyResult<Vec<TransferEvent>> {
    events.into_iter().map(|e| TransferEvent::new(py, e)).collect()
}

/// A worker's push endpoint: side channel, rendezvous table and native writer thread.
#[pyclass(module = "kvpush", frozen)]
#[derive(Debug)]
pub(crate) struct Endpoint(core::Endpoint);

fn start<T: Transport + 'static>(
    mut transport: T,
    memory: &[(u64, u64)],
    space: MemorySpace,
    config: EndpointConfig,
) -> Result<core::Endpoint, Error> {
    let regions: Vec<MemoryRegion> =
        memory.iter().map(|&(addr, len)| MemoryRegion { addr, len, space }).collect();
    // SAFETY: the Python caller promises (see `Endpoint`'s docs) that the memory stays
    // allocated until the endpoint is closed; the endpoint's transport is dropped by `close`,
    // or, if its writer thread is stuck in a transport call, never: `close` then says so, and
    // the memory must stay allocated (the process exits).
    unsafe { transport.register_memory(&regions) }.map_err(Error::from)?;
    core::Endpoint::start(config, transport).map_err(Error::from)
}

#[pymethods]
impl Endpoint {
    /// Starts an endpoint. `memory` lists `(address, length)` of the KV cache buffers, which
    /// must stay allocated until `close()`.
    #[new]
    #[pyo3(signature = (
        engine_id, layout, *, memory, transport = "nixl", agent_name = None, nixl_library = None,
        nixl_progress_thread = false, device = None, bind = "127.0.0.1:0", secret = None,
        compatibility = "",
        write_timeout = 10.0, heartbeat_interval = 1.0, peer_timeout = 5.0, connect_timeout = 3.0,
        insecure = false, max_registrations_per_host = 16_384,
        max_registration_bytes_per_host = 64 << 20, inbox_capacity = 16_384, delivery_bound = None,
        pp_rank = 0, pp_size = 1
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine_id: String,
        layout: &KvLayout,
        memory: Vec<(u64, u64)>,
        transport: &str,
        agent_name: Option<String>,
        nixl_library: Option<String>,
        nixl_progress_thread: bool,
        device: Option<u32>,
        bind: &str,
        secret: Option<Vec<u8>>,
        compatibility: &str,
        write_timeout: f64,
        heartbeat_interval: f64,
        peer_timeout: f64,
        connect_timeout: f64,
        insecure: bool,
        max_registrations_per_host: usize,
        max_registration_bytes_per_host: usize,
        inbox_capacity: usize,
        delivery_bound: Option<f64>,
        pp_rank: u32,
        pp_size: u32,
    ) -> PyResult<Self> {
        if pp_rank >= pp_size {
            return Err(PyValueError::new_err(format!(
                "pp_rank {pp_rank} must be below pp_size {pp_size}"
            )));
        }
        // A host name (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST defaults to "localhost") is resolved
        // here, once; the first address it resolves to is the one listened on.
        let bind: SocketAddr =
            bind.to_socket_addrs().ok().and_then(|mut addrs| addrs.next()).ok_or_else(|| {
                PyValueError::new_err(format!("bind must be a resolvable host:port, not {bind:?}"))
            })?;
        let space = match device {
            None => MemorySpace::DRAM,
            Some(device) => MemorySpace { kind: kvpush_core::transport::MemoryKind::Vram, device },
        };
        let mut config = EndpointConfig::new(engine_id.clone(), layout.0.clone());
        config.memory = space;
        config.bind = bind;
        config.secret = secret;
        config.compatibility = compatibility.to_owned();
        config.write_timeout = seconds(write_timeout, "write_timeout")?;
        config.heartbeat_interval = seconds(heartbeat_interval, "heartbeat_interval")?;
        config.peer_timeout = seconds(peer_timeout, "peer_timeout")?;
        config.connect_timeout = seconds(connect_timeout, "connect_timeout")?;
        config.allow_insecure = insecure;
        config.pp_rank = pp_rank;
        config.pp_size = pp_size;
        config.max_registrations_per_host = max_registrations_per_host;
        config.max_registration_bytes_per_host = max_registration_bytes_per_host;
        config.inbox_capacity = inbox_capacity;
        config.delivery_bound = match (delivery_bound, transport) {
            (Some(seconds_given), _) => seconds(seconds_given, "delivery_bound")?,
            (None, "nixl") => {
                kvpush_nixl::delivery_bound().map_err(|e| PyValueError::new_err(e.to_string()))?
            }
            (None, _) => LoopbackTransport::DELIVERY_BOUND,
        };
        // Unique per process and per endpoint: P counts its peers' agents by name, so two D
        // replicas with one engine id, or a restarted D, must never share one.
        let name = agent_name.unwrap_or_else(|| {
            format!(
                "{engine_id}-pp{pp_rank}-tp{}-{}-{:08x}",
                layout.0.tp_rank,
                std::process::id(),
                unique_suffix()
            )
        });
        let endpoint = match transport {
            "loopback" => native(py, || {
                let transport = LoopbackTransport::new(name).map_err(Error::from)?;
                start(transport, &memory, space, config)
            })?,
            "nixl" => {
                let path = match nixl_library {
                    Some(path) => path,
                    None => py.import("kvpush.nixl")?.call_method0("library_path")?.extract()?,
                };
                // The policy (the writer drives progress unless asked) is the NIXL crate's.
                let agent = if nixl_progress_thread {
                    AgentConfig::with_progress_thread()
                } else {
                    AgentConfig::default()
                };
                native(py, || {
                    let library = Library::load(&path).map_err(Error::from)?;
                    let transport =
                        NixlTransport::new(&library, &name, &agent).map_err(Error::from)?;
                    start(transport, &memory, space, config)
                })?
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "transport must be 'nixl' or 'loopback', not {other:?}"
                )))
            }
        };
        Ok(Self(endpoint))
    }

    /// The side channel address D workers connect to (`host:port`).
    #[getter]
    fn address(&self) -> String {
        self.0.address().to_string()
    }

    /// P: the request's KV is computed; `blocks` are P's logical block ids (per KV group).
    #[pyo3(signature = (request_id, blocks, num_tokens, *, transfer_id = None, first_tokens = None, ttl = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn ready(
        &self,
        py: Python<'_>,
        request_id: String,
        blocks: crate::planner::Groups,
        num_tokens: u64,
        transfer_id: Option<String>,
        first_tokens: Option<Vec<u64>>,
        ttl: f64,
    ) -> PyResult<()> {
        let ready = ReadyKv {
            request_id,
            transfer_id,
            groups: groups(blocks, first_tokens)?,
            num_tokens,
            ttl: seconds(ttl, "ttl")?,
        };
        native(py, || self.0.ready(ready).map_err(Error::from))
    }

    /// P: the request was aborted. Returns "released" (free the blocks), "in_flight" (wait for
    /// its event) or "unknown"; raises `BusyError` when the writer is far behind (nothing was
    /// done: keep the blocks and abort again later).
    #[pyo3(signature = (request_id, transfer_id = None))]
    fn abort(
        &self,
        py: Python<'_>,
        request_id: &str,
        transfer_id: Option<&str>,
    ) -> PyResult<&'static str> {
        let outcome = native(py, || self.0.abort(request_id, transfer_id).map_err(Error::from))?;
        Ok(match outcome {
            AbortOutcome::Released => "released",
            AbortOutcome::InFlight => "in_flight",
            AbortOutcome::Unknown => "unknown",
        })
    }

    /// D: register `blocks` with the P at `source` (a `host:port`, or a list of them: every P
    /// rank that holds some of this rank's heads) and await the KV: one DONE from each.
    /// `share = (slot, of)`: P's one rank writes this transfer into `of` D ranks, this being
    /// slot `slot` of them (D runs the larger tensor parallel size). A request id still awaited
    /// may be expected again only at a higher `epoch`: the awaited receive is cancelled with P
    /// and its own ("cancelled") event comes before the new one's. The same call again is
    /// ignored (the awaited receive's event answers both); another expectation at the same or a
    /// lower epoch is refused with its own ("refused") event.
    #[pyo3(signature = (
        request_id, source, blocks, num_tokens, *, transfer_id = None, first_tokens = None,
        epoch = 1, ttl = 30.0, share = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn expect(
        &self,
        py: Python<'_>,
        request_id: String,
        source: Sources,
        blocks: crate::planner::Groups,
        num_tokens: u64,
        transfer_id: Option<String>,
        first_tokens: Option<Vec<u64>>,
        epoch: u64,
        ttl: f64,
        share: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let expectation = Expectation {
            request_id,
            transfer_id,
            sources: source.into_vec(),
            groups: groups(blocks, first_tokens)?,
            num_tokens,
            epoch,
            ttl: seconds(ttl, "ttl")?,
            share: share.map(|(slot, of)| Share { slot, of }),
        };
        native(py, || self.0.expect(expectation).map_err(Error::from))
    }

    /// D: stop awaiting `request_id`; a "cancelled" event follows once P confirmed.
    fn cancel(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        native(py, || self.0.cancel(request_id).map_err(Error::from))
    }

    /// Every event since the last call; never blocks, not even while another thread is in
    /// `wait` (which then takes what arrives), so the GIL is never held waiting for it.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<TransferEvent>> {
        let polled = self.0.poll();
        events(py, polled)
    }

    /// Waits up to `timeout` seconds for at least one event (GIL released).
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<TransferEvent>> {
        let timeout = seconds(timeout, "timeout")?;
        let waited = detached(py, || self.0.wait(timeout))?;
        events(py, waited)
    }

    /// Transfers waiting in the rendezvous table (P).
    #[getter]
    fn pending(&self) -> usize {
        self.0.pending()
    }

    /// Seconds since the endpoint started: the clock of event timelines.
    fn clock(&self) -> f64 {
        self.0.clock()
    }

    /// Counters of refused frames, transport errors and stray notifications.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.0.stats();
        let out = PyDict::new(py);
        out.set_item("refused_frames", stats.refused_frames)?;
        out.set_item("transport_errors", stats.transport_errors)?;
        out.set_item("stray_notifications", stats.stray_notifications)?;
        out.set_item("refused_registrations", stats.refused_registrations)?;
        out.set_item("purged_registrations", stats.purged_registrations)?;
        out.set_item("quarantined_writes", stats.quarantined_writes)?;
        out.set_item("quarantined_receives", stats.quarantined_receives)?;
        out.set_item("lapsed_leases", stats.lapsed_leases)?;
        out.set_item("late_posts", stats.late_posts)?;
        out.set_item("overloaded", stats.overloaded)?;
        Ok(out)
    }

    /// None while healthy; else why the writer stopped or stalled (new work is refused).
    fn health(&self) -> Option<String> {
        self.0.health().err().map(|unhealthy| unhealthy.to_string())
    }

    /// Where the KV cache was registered: ("dram", 0) or ("vram", device).
    #[getter]
    fn memory_space(&self) -> (&'static str, u32) {
        let space = self.0.memory();
        match space.kind {
            kvpush_core::transport::MemoryKind::Dram => ("dram", space.device),
            kvpush_core::transport::MemoryKind::Vram => ("vram", space.device),
        }
    }

    /// Seconds a D waits after losing this worker before it hands P's blocks back.
    #[getter]
    fn write_horizon(&self) -> f64 {
        self.0.write_horizon().as_secs_f64()
    }

    /// Stops the writer and the side channel; pending transfers end with "failed". Idempotent.
    /// Returns None, or, when the writer thread was stuck in a transport call and left running
    /// after a bounded wait, what it still held: the KV memory must then stay allocated.
    fn close(&self, py: Python<'_>) -> PyResult<Option<String>> {
        detached(py, || self.0.close().err().map(|error| error.to_string()))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        if let Some(stuck) = self.close(py)? {
            py.import("logging")?
                .call_method1("getLogger", ("kvpush",))?
                .call_method1("warning", ("kvpush: closing the endpoint: %s", stuck))?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Endpoint(address={:?}, pending={})",
            self.0.address().to_string(),
            self.0.pending()
        )
    }
}

/// Where D receives from: one P address, or several (one per P rank).
#[derive(FromPyObject)]
enum Sources {
    One(String),
    Many(Vec<String>),
}

impl Sources {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(source) => vec![source],
            Self::Many(sources) => sources,
        }
    }
}

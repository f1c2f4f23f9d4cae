//! `Endpoint`: a worker's push endpoint as Python sees it (`kvpush.Endpoint` adds what needs
//! Python: finding NIXL's library, logging at `__exit__`).

use std::time::Duration;

use kvpush_core::endpoint::{self as core, EndpointConfig, Event, Expectation, ReadyKv, Share};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::protocol::BlockGroup;
use kvpush_core::transport::{MemoryKind, MemoryRegion, MemorySpace, Transport};
use kvpush_nixl::{AgentConfig, Library, NixlTransport};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::blocks::Groups;
use crate::errors::Error;
use crate::event::{AbortOutcome, TransferEvent};
use crate::native::{detached, held, native};
use crate::options::{seconds, EndpointOptions, TransportKind};
use crate::planner::KvLayout;

/// Block lists as Python gives them: one list per KV group, or one flat list for one group,
/// with each group's first token (0 unless given).
fn groups(blocks: Groups, first_tokens: Option<Vec<u64>>) -> PyResult<Vec<BlockGroup>> {
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

/// P's KV of one request as Python gives it (`ttl` counts for `ready` only).
fn ready_kv(
    request_id: String,
    transfer_id: Option<String>,
    blocks: Groups,
    first_tokens: Option<Vec<u64>>,
    num_tokens: u64,
    ttl: Duration,
) -> PyResult<ReadyKv> {
    Ok(ReadyKv { request_id, transfer_id, groups: groups(blocks, first_tokens)?, num_tokens, ttl })
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

fn events(events: Vec<Event>) -> Vec<TransferEvent> {
    events.into_iter().map(TransferEvent::from).collect()
}

/// A worker's push endpoint: side channel, rendezvous table and native writer thread.
#[pyclass(module = "kvpush", frozen, subclass)]
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
    /// must stay allocated until `close()`. With the NIXL transport, `options.nixl_library`
    /// must name NIXL's library (`kvpush.Endpoint` finds it).
    #[new]
    #[pyo3(signature = (engine_id, layout, *, memory, options))]
    fn new(
        py: Python<'_>,
        engine_id: String,
        layout: &KvLayout,
        memory: Vec<(u64, u64)>,
        options: &EndpointOptions,
    ) -> PyResult<Self> {
        let config = options.config(engine_id.clone(), layout.0.clone())?;
        let space = options.memory_space();
        // Unique per process and per endpoint: P counts its peers' agents by name, so two D
        // replicas with one engine id, or a restarted D, must never share one.
        let name = options.agent_name.clone().unwrap_or_else(|| {
            format!(
                "{engine_id}-pp{}-tp{}-{}-{:08x}",
                config.pp_rank,
                layout.0.tp_rank,
                std::process::id(),
                unique_suffix()
            )
        });
        let endpoint = match options.transport {
            TransportKind::Loopback => native(py, || {
                let transport = LoopbackTransport::new(name).map_err(Error::from)?;
                start(transport, &memory, space, config)
            })?,
            TransportKind::Nixl => {
                let path = options.nixl_library.clone().ok_or_else(|| {
                    PyValueError::new_err(
                        "the NIXL transport needs options.nixl_library: NIXL's C API library \
                         (kvpush.Endpoint finds it with kvpush.nixl.library_path())",
                    )
                })?;
                // The policy (the writer drives progress unless asked) is the NIXL crate's.
                let agent = if options.nixl_progress_thread {
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
        request_id: String,
        blocks: Groups,
        num_tokens: u64,
        transfer_id: Option<String>,
        first_tokens: Option<Vec<u64>>,
        ttl: f64,
    ) -> PyResult<()> {
        let ttl = seconds(ttl, "ttl")?;
        let ready = ready_kv(request_id, transfer_id, blocks, first_tokens, num_tokens, ttl)?;
        held(|| self.0.ready(ready).map_err(Error::from))
    }

    /// P, layer-wise push: the KV of regions `start..end` (layout order: a layer's K and V, or
    /// its latent) is final for all `num_tokens` tokens while the request's other layers are
    /// still computed. Where D registered already, those regions are written now, notifying
    /// nobody, and `ready`'s WRITE then carries the rest with the DONE; otherwise nothing
    /// happens. Regions go in order from 0: a range that does not continue the ones streamed
    /// is left to `ready`. An error means nothing was streamed; `ready` is unaffected.
    #[pyo3(signature = (request_id, blocks, num_tokens, start, end, *, transfer_id = None, first_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn layers_ready(
        &self,
        request_id: String,
        blocks: Groups,
        num_tokens: u64,
        start: usize,
        end: usize,
        transfer_id: Option<String>,
        first_tokens: Option<Vec<u64>>,
    ) -> PyResult<()> {
        let ready =
            ready_kv(request_id, transfer_id, blocks, first_tokens, num_tokens, Duration::ZERO)?;
        held(|| self.0.layers_ready(ready, start..end).map_err(Error::from))
    }

    /// P, layer-wise push: `layers_ready` for every request of `streams` at once (one call per
    /// layer of a forward pass, however many requests it computes). An error means nothing was
    /// streamed.
    fn streams_ready(&self, streams: &LayerStreams, start: usize, end: usize) -> PyResult<()> {
        held(|| self.0.streams_ready(&streams.0, start..end).map_err(Error::from))
    }

    /// P: the request was aborted. Returns `AbortOutcome.RELEASED` (free the blocks),
    /// `IN_FLIGHT` (wait for its event) or `UNKNOWN`; raises `BusyError` when the writer is far
    /// behind (nothing was done: keep the blocks and abort again later).
    #[pyo3(signature = (request_id, transfer_id = None))]
    fn abort<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        transfer_id: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let outcome = held(|| self.0.abort(request_id, transfer_id).map_err(Error::from))?;
        AbortOutcome::from(outcome).member(py)
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
        request_id: String,
        source: Sources,
        blocks: Groups,
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
        held(|| self.0.expect(expectation).map_err(Error::from))
    }

    /// D: stop awaiting `request_id`; a "cancelled" event follows once P confirmed.
    fn cancel(&self, request_id: &str) -> PyResult<()> {
        held(|| self.0.cancel(request_id).map_err(Error::from))
    }

    /// Every event since the last call; never blocks, not even while another thread is in
    /// `wait` (which then takes what arrives), so the GIL is never held waiting for it.
    fn poll(&self) -> Vec<TransferEvent> {
        events(self.0.poll())
    }

    /// Waits up to `timeout` seconds for at least one event (GIL released).
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<TransferEvent>> {
        let timeout = seconds(timeout, "timeout")?;
        Ok(events(detached(py, || self.0.wait(timeout))?))
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
        out.set_item("streamed_writes", stats.streamed_writes)?;
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
            MemoryKind::Dram => ("dram", space.device),
            MemoryKind::Vram => ("vram", space.device),
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

    fn __repr__(&self) -> String {
        format!(
            "Endpoint(address={:?}, pending={})",
            self.0.address().to_string(),
            self.0.pending()
        )
    }
}

/// P, layer-wise push: the requests whose prefill one forward pass computes, each as
/// `Endpoint.layers_ready` takes it, read once (each layer's `Endpoint.streams_ready` then
/// converts nothing).
#[pyclass(module = "kvpush", frozen)]
#[derive(Debug)]
pub(crate) struct LayerStreams(core::LayerStreams);

/// One request of a [`LayerStreams`], read from any object with these attributes.
#[derive(FromPyObject)]
struct StreamArg {
    #[pyo3(attribute)]
    request_id: String,
    #[pyo3(attribute)]
    blocks: Groups,
    #[pyo3(attribute)]
    num_tokens: u64,
    #[pyo3(attribute)]
    transfer_id: Option<String>,
    #[pyo3(attribute)]
    first_tokens: Option<Vec<u64>>,
}

#[pymethods]
impl LayerStreams {
    /// From objects with the attributes `request_id`, `blocks`, `num_tokens`, `transfer_id`
    /// and `first_tokens`, as `Endpoint.layers_ready` takes them.
    #[new]
    #[pyo3(signature = (streams = Vec::new()))]
    fn new(streams: Vec<StreamArg>) -> PyResult<Self> {
        let kvs = streams
            .into_iter()
            .map(|s| {
                let ttl = Duration::ZERO;
                ready_kv(s.request_id, s.transfer_id, s.blocks, s.first_tokens, s.num_tokens, ttl)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self(core::LayerStreams::new(kvs)))
    }

    /// The requests' ids, in order.
    #[getter]
    fn request_ids(&self) -> Vec<String> {
        self.0.iter().map(|kv| kv.request_id.clone()).collect()
    }

    /// Each request's block ids per KV group, in order.
    fn blocks(&self) -> Vec<Vec<Vec<u32>>> {
        self.0.iter().map(|kv| kv.groups.iter().map(|g| g.block_ids.clone()).collect()).collect()
    }

    /// These streams but those of `request_ids`.
    fn without(&self, request_ids: std::collections::HashSet<String>) -> Self {
        Self(self.0.without(|id| request_ids.contains(id)))
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __repr__(&self) -> String {
        format!("LayerStreams({:?})", self.request_ids())
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

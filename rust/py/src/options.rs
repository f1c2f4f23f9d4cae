//! `EndpointOptions`: how an endpoint runs, checked once when the options are made.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use kvpush_core::endpoint::EndpointConfig;
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::transport::{MemoryKind, MemorySpace};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

/// `value` seconds, or a `ValueError` naming `what`.
pub(crate) fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, not {value}"
        ))
    })
}

/// The shortest and longest `busy_poll` (seconds): 10 µs, 100 ms.
const MIN_BUSY_POLL: f64 = 1e-5;
const MAX_BUSY_POLL: f64 = 0.1;

/// Which transport moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransportKind {
    Nixl,
    Loopback,
}

impl TransportKind {
    fn parse(name: &str) -> PyResult<Self> {
        match name {
            "nixl" => Ok(Self::Nixl),
            "loopback" => Ok(Self::Loopback),
            other => Err(PyValueError::new_err(format!(
                "transport must be 'nixl' or 'loopback', not {other:?}"
            ))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Nixl => "nixl",
            Self::Loopback => "loopback",
        }
    }
}

/// How an endpoint runs: every setting but its identity (engine id, layout) and its memory.
/// Each is checked when the options are made; `replace(**changes)` gives a copy with some
/// changed. The secret is never shown (`has_secret` says whether there is one).
#[pyclass(module = "kvpush", frozen)]
#[derive(Debug, Clone)]
pub(crate) struct EndpointOptions {
    pub(crate) transport: TransportKind,
    /// The NIXL agent's name; None: unique per process and endpoint.
    #[pyo3(get)]
    pub(crate) agent_name: Option<String>,
    /// NIXL's C API library (`kvpush.Endpoint` fills it in from `kvpush.nixl.library_path()`).
    #[pyo3(get)]
    pub(crate) nixl_library: Option<String>,
    /// Run NIXL's own progress thread instead of the writer driving progress.
    #[pyo3(get)]
    pub(crate) nixl_progress_thread: bool,
    /// The GPU the KV cache lives on; None: host memory.
    #[pyo3(get)]
    device: Option<u32>,
    /// Where the side channel listens (`host:port`), resolved once.
    bind: SocketAddr,
    bind_given: String,
    secret: Option<Vec<u8>>,
    /// Must be equal on P and D (model, dtype, ...): checked in the handshake.
    #[pyo3(get)]
    compatibility: String,
    #[pyo3(get)]
    write_timeout: f64,
    #[pyo3(get)]
    heartbeat_interval: f64,
    #[pyo3(get)]
    peer_timeout: f64,
    #[pyo3(get)]
    connect_timeout: f64,
    /// Seconds between the writer's polls while a WRITE is in flight or a receive awaited.
    #[pyo3(get)]
    busy_poll: f64,
    /// Allow connections beyond loopback without a secret.
    #[pyo3(get)]
    insecure: bool,
    #[pyo3(get)]
    max_registrations_per_host: usize,
    #[pyo3(get)]
    max_registration_bytes_per_host: usize,
    #[pyo3(get)]
    inbox_capacity: usize,
    /// Side-channel caps: connections held, from one host, and in their handshake at once.
    #[pyo3(get)]
    max_connections: usize,
    #[pyo3(get)]
    max_connections_per_host: usize,
    #[pyo3(get)]
    max_handshakes: usize,
    /// Seconds within which a byte NIXL accepted lands or never will; None: the transport's.
    #[pyo3(get)]
    delivery_bound: Option<f64>,
    #[pyo3(get)]
    pp_rank: u32,
    #[pyo3(get)]
    pp_size: u32,
}

impl EndpointOptions {
    /// The core's configuration for engine `engine_id` with `layout`.
    pub(crate) fn config(
        &self,
        engine_id: String,
        layout: kvpush_core::layout::KvLayout,
    ) -> PyResult<EndpointConfig> {
        let mut config = EndpointConfig::new(engine_id, layout);
        config.memory = self.memory_space();
        config.bind = self.bind;
        config.secret.clone_from(&self.secret);
        config.compatibility.clone_from(&self.compatibility);
        config.write_timeout = seconds(self.write_timeout, "write_timeout")?;
        config.heartbeat_interval = seconds(self.heartbeat_interval, "heartbeat_interval")?;
        config.peer_timeout = seconds(self.peer_timeout, "peer_timeout")?;
        config.connect_timeout = seconds(self.connect_timeout, "connect_timeout")?;
        config.busy_poll = seconds(self.busy_poll, "busy_poll")?;
        config.allow_insecure = self.insecure;
        config.pp_rank = self.pp_rank;
        config.pp_size = self.pp_size;
        config.max_registrations_per_host = self.max_registrations_per_host;
        config.max_registration_bytes_per_host = self.max_registration_bytes_per_host;
        config.inbox_capacity = self.inbox_capacity;
        config.max_connections = self.max_connections;
        config.max_connections_per_host = self.max_connections_per_host;
        config.max_handshakes = self.max_handshakes;
        config.delivery_bound = match (self.delivery_bound, self.transport) {
            (Some(given), _) => seconds(given, "delivery_bound")?,
            (None, TransportKind::Nixl) => kvpush_nixl::delivery_bound()
                .map_err(|error| PyValueError::new_err(error.to_string()))?,
            (None, TransportKind::Loopback) => LoopbackTransport::DELIVERY_BOUND,
        };
        Ok(config)
    }

    pub(crate) fn memory_space(&self) -> MemorySpace {
        match self.device {
            None => MemorySpace::DRAM,
            Some(device) => MemorySpace { kind: MemoryKind::Vram, device },
        }
    }

    /// Every option as the keyword `__new__` takes it.
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let fields = PyDict::new(py);
        fields.set_item("transport", self.transport.name())?;
        fields.set_item("agent_name", &self.agent_name)?;
        fields.set_item("nixl_library", &self.nixl_library)?;
        fields.set_item("nixl_progress_thread", self.nixl_progress_thread)?;
        fields.set_item("device", self.device)?;
        fields.set_item("bind", &self.bind_given)?;
        fields
            .set_item("secret", self.secret.as_deref().map(|s| pyo3::types::PyBytes::new(py, s)))?;
        fields.set_item("compatibility", &self.compatibility)?;
        fields.set_item("write_timeout", self.write_timeout)?;
        fields.set_item("heartbeat_interval", self.heartbeat_interval)?;
        fields.set_item("peer_timeout", self.peer_timeout)?;
        fields.set_item("connect_timeout", self.connect_timeout)?;
        fields.set_item("busy_poll", self.busy_poll)?;
        fields.set_item("insecure", self.insecure)?;
        fields.set_item("max_registrations_per_host", self.max_registrations_per_host)?;
        fields.set_item("max_registration_bytes_per_host", self.max_registration_bytes_per_host)?;
        fields.set_item("inbox_capacity", self.inbox_capacity)?;
        fields.set_item("max_connections", self.max_connections)?;
        fields.set_item("max_connections_per_host", self.max_connections_per_host)?;
        fields.set_item("max_handshakes", self.max_handshakes)?;
        fields.set_item("delivery_bound", self.delivery_bound)?;
        fields.set_item("pp_rank", self.pp_rank)?;
        fields.set_item("pp_size", self.pp_size)?;
        Ok(fields)
    }
}

#[pymethods]
impl EndpointOptions {
    #[new]
    #[pyo3(signature = (
        *, transport = "nixl", agent_name = None, nixl_library = None,
        nixl_progress_thread = false, device = None, bind = "127.0.0.1:0", secret = None,
        compatibility = "", write_timeout = 10.0, heartbeat_interval = 1.0,
        peer_timeout = 5.0, connect_timeout = 3.0, busy_poll = 0.000_2, insecure = false,
        max_registrations_per_host = 16_384, max_registration_bytes_per_host = 64 << 20,
        inbox_capacity = 16_384, max_connections = 256, max_connections_per_host = 32,
        max_handshakes = 16, delivery_bound = None, pp_rank = 0, pp_size = 1
    ))]
    // An options object is where the many settings go, each a keyword with its default.
    #[allow(clippy::too_many_arguments)]
    fn new(
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
        busy_poll: f64,
        insecure: bool,
        max_registrations_per_host: usize,
        max_registration_bytes_per_host: usize,
        inbox_capacity: usize,
        max_connections: usize,
        max_connections_per_host: usize,
        max_handshakes: usize,
        delivery_bound: Option<f64>,
        pp_rank: u32,
        pp_size: u32,
    ) -> PyResult<Self> {
        if pp_rank >= pp_size {
            return Err(PyValueError::new_err(format!(
                "pp_rank {pp_rank} must be below pp_size {pp_size}"
            )));
        }
        for (value, what) in [
            (write_timeout, "write_timeout"),
            (heartbeat_interval, "heartbeat_interval"),
            (peer_timeout, "peer_timeout"),
            (connect_timeout, "connect_timeout"),
        ] {
            seconds(value, what)?;
        }
        // A WRITE's completion is noticed at most this late; zero would spin the writer.
        if !(MIN_BUSY_POLL..=MAX_BUSY_POLL).contains(&busy_poll) {
            return Err(PyValueError::new_err(format!(
                "busy_poll must be between {MIN_BUSY_POLL} and {MAX_BUSY_POLL} seconds, not \
                 {busy_poll}"
            )));
        }
        if let Some(bound) = delivery_bound {
            seconds(bound, "delivery_bound")?;
        }
        for (value, what) in [
            (max_connections, "max_connections"),
            (max_connections_per_host, "max_connections_per_host"),
            (max_handshakes, "max_handshakes"),
        ] {
            if value == 0 {
                return Err(PyValueError::new_err(format!("{what} must be at least 1")));
            }
        }
        // A host name (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST defaults to "localhost") is resolved
        // here, once; the first address it resolves to is the one listened on.
        let resolved =
            bind.to_socket_addrs().ok().and_then(|mut addrs| addrs.next()).ok_or_else(|| {
                PyValueError::new_err(format!("bind must be a resolvable host:port, not {bind:?}"))
            })?;
        Ok(Self {
            transport: TransportKind::parse(transport)?,
            agent_name,
            nixl_library,
            nixl_progress_thread,
            device,
            bind: resolved,
            bind_given: bind.to_owned(),
            secret,
            compatibility: compatibility.to_owned(),
            write_timeout,
            heartbeat_interval,
            peer_timeout,
            connect_timeout,
            busy_poll,
            insecure,
            max_registrations_per_host,
            max_registration_bytes_per_host,
            inbox_capacity,
            max_connections,
            max_connections_per_host,
            max_handshakes,
            delivery_bound,
            pp_rank,
            pp_size,
        })
    }

    /// "nixl" or "loopback".
    #[getter]
    fn transport(&self) -> &'static str {
        self.transport.name()
    }

    /// The side channel's address as given.
    #[getter]
    fn bind(&self) -> &str {
        &self.bind_given
    }

    /// Whether side-channel messages are signed with a secret.
    #[getter]
    fn has_secret(&self) -> bool {
        self.secret.is_some()
    }

    /// A copy with `changes` (keywords of the constructor) applied, checked again.
    #[pyo3(signature = (**changes))]
    fn replace<'py>(
        slf: &Bound<'py, Self>,
        changes: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let fields = slf.get().fields(py)?;
        if let Some(changes) = changes {
            fields.update(changes.as_mapping())?;
        }
        let cls: Bound<'py, PyType> = slf.get_type();
        cls.call((), Some(&fields))
    }

    fn __repr__(&self) -> String {
        format!(
            "EndpointOptions(transport={:?}, bind={:?}, secret={}, device={:?}, pp={}/{}, \
             write_timeout={}, peer_timeout={})",
            self.transport.name(),
            self.bind_given,
            if self.secret.is_some() { "set" } else { "none" },
            self.device,
            self.pp_rank,
            self.pp_size,
            self.write_timeout,
            self.peer_timeout,
        )
    }
}

//! kvpush's NIXL binding: the only code that calls NIXL. It implements the core's
//! [`Transport`](kvpush_core::transport::Transport) on a NIXL agent with a UCX backend.
//!
//! # Loading
//!
//! Nothing NIXL-related is needed to build this crate: no headers, no bindgen, no build script.
//! At run time [`Library::load`] `dlopen`s the C API that the pip wheel ships,
//! `<site-packages>/.nixl_cu12.mesonpy.libs/libnixl_capi.so` (or `nixl_cu13`), by absolute path,
//! resolves every function it uses up front ([`SYMBOLS`], declared once in `api.rs`), and refuses
//! NIXL's stub library. Python finds the path from the installed `nixl_cuXX` package and passes
//! it in; Rust tests and tools use [`Library::discover`], which reads `KVPUSH_NIXL_CAPI`. The
//! library's RPATH finds `libnixl.so`, the bundled UCX and the plugins: no `LD_LIBRARY_PATH`.
//! The C API has no version call; the NIXL version is the wheel's (its dist-info, from Python).
//!
//! # Threading
//!
//! One thread owns the agent and makes every call: the writer thread. [`NixlTransport`] is
//! `Send` (create it anywhere, move it to the writer) and not `Sync`; every NIXL call takes
//! `&mut self`. So the agent runs with `thread_sync = NONE` (no agent lock).
//!
//! # Progress
//!
//! By default ([`AgentConfig::default`], [`Progress::Caller`]) the agent runs no progress
//! thread: only this transport's calls progress UCX, so the owner must keep calling
//! `take_notifications` while it waits for anything, or handshakes and notifications stall.
//! kvpush's writer thread does (every 200 µs while anything is in flight or awaited, at least
//! every 500 ms when idle), and Python's `Endpoint` uses the same default. NIXL's progress
//! thread would contend with it: the thread puts the UCX worker in multi-threaded mode behind a
//! spinlock, and with `cma` the copies run inside worker progress, so P's writer spent most of a
//! large WRITE waiting on that lock (docs/benchmarks.md).
//!
//! [`Progress::Thread`] (e.g. [`AgentConfig::with_progress_thread`]) runs NIXL's UCX progress
//! thread as well, for owners that park between calls: UCX keeps wiring up connections and
//! receiving notifications meanwhile, and the thread sleeps in `poll()` between rounds. NIXL's
//! own default interval is 0, which busy-loops a whole core (two agents took both cores of a
//! 2-core box); intervals below [`MIN_PROGRESS_INTERVAL_US`] are raised to it.
//!
//! Either way the initiator must keep polling a posted write: when the post returned "in
//! progress" (TCP, RDMA), NIXL sends the write's notification from the poll that sees the data
//! complete (`get_xfer_status`), never before. The notification therefore never overtakes the
//! data.
//!
//! # UCX environment
//!
//! On a CPU-only machine set `UCX_NET_DEVICES=lo` (otherwise UCX's TCP also uses the host's
//! external interface). With default `UCX_TLS`, UCX writes with `cma` (`process_vm_writev`,
//! which UCX's shared-memory copy layer runs from worker progress, i.e. inside this transport's
//! polls) and sends notifications over `tcp` (`UCX_PROTO_INFO=y` prints the choice);
//! `UCX_TLS=tcp` writes over sockets instead, acknowledged by the receiver's progress, like a
//! network. Either way a WRITE completes only as fast as the thread polling it is scheduled.
//! Never leave `tcp` out of `UCX_TLS`
//! (`sm`/`posix` alone cannot carry NIXL's notifications and backend creation fails). The same
//! choice can be made per agent with [`AgentConfig::ucx_params`], e.g.
//! `("engine_config", "TLS=tcp")`.
//!
//! The same environment says how long a WRITE's bytes may still land after it ended (over TCP,
//! until the kernel gives up retransmitting): [`delivery_bound`] reads it, for the endpoint's
//! `delivery_bound` (see the `delivery` module, [`Carrier`] and [`tls_allows_tcp`]).

mod api;
mod delivery;
mod error;
mod handles;
mod transport;

pub use api::{Library, CAPI_PATH_ENV, SYMBOLS};
pub use delivery::{
    delivery_bound, tcp_retransmission_span, tls_allows_tcp, BadDeliveryBound, Carrier,
    DELIVERY_BOUND_ENV, RDMA_DELIVERY_BOUND,
};
pub use error::{LoadError, NixlError, Status};
pub use transport::{AgentConfig, NixlTransport, Progress, MIN_PROGRESS_INTERVAL_US};

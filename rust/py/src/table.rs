//! `RendezvousTable` as Python sees it: payloads are any Python objects.
//!
//! Times cross as seconds on the table's own monotonic clock (`now()`, zero at creation), so a
//! caller can drive the table deterministically by passing `now=` and otherwise never thinks
//! about clocks. Every operation runs with the GIL released: a shard lock is never waited on
//! while holding the GIL, and payloads dropped inside the core never run Python code under a lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush_core::rendezvous::{
    self as core, Arrival as CoreArrival, Cancelled, Epoch, Match, Outcome, TableConfig,
};
use kvpush_core::TransferKey;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::native::{detached, native};

/// D's registration as Python gave it.
type Registration = Py<PyAny>;
/// P's ready payload; shared so the core can keep a copy for a re-registration to match again.
type Ready = Arc<Py<PyAny>>;

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, not {value}"
        ))
    })
}

fn ready_object(py: Python<'_>, ready: &Ready) -> Py<PyAny> {
    ready.as_ref().clone_ref(py)
}

/// What inserting one half of a transfer did.
#[pyclass(module = "kvpush._native.lab", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Arrival {
    /// Both halves are present: write now.
    matched: bool,
    /// The transfer key both halves met under.
    key: String,
    /// The registration epoch (None for a waiting "ready").
    epoch: Option<Epoch>,
    /// D's registration payload, when matched.
    registration: Option<Py<PyAny>>,
    /// P's ready payload, when matched.
    ready: Option<Py<PyAny>>,
    /// The lower-epoch registration this one replaced, if any.
    superseded: Option<Py<PyAny>>,
}

impl Arrival {
    fn matched(py: Python<'_>, m: Match<Registration, Ready>) -> Self {
        Self {
            matched: true,
            key: m.key.as_str().to_owned(),
            epoch: Some(m.epoch),
            ready: Some(ready_object(py, &m.ready)),
            registration: Some(m.registration),
            superseded: None,
        }
    }

    fn from_core(
        py: Python<'_>,
        key: &TransferKey,
        epoch: Option<Epoch>,
        arrival: CoreArrival<Registration, Ready>,
    ) -> Self {
        match arrival {
            CoreArrival::Matched(m) => Self::matched(py, m),
            CoreArrival::Waiting { superseded } => Self {
                matched: false,
                key: key.as_str().to_owned(),
                epoch,
                registration: None,
                ready: None,
                superseded,
            },
        }
    }
}

#[pymethods]
impl Arrival {
    fn __repr__(&self) -> String {
        format!("Arrival(matched={}, key={:?}, epoch={:?})", self.matched, self.key, self.epoch)
    }
}

/// What `finish` did.
#[pyclass(module = "kvpush._native.lab", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Finished {
    /// "done" or "failed", as reported.
    outcome: &'static str,
    /// A cancel arrived during the write: acknowledge it to D now.
    cancel_acknowledged: bool,
    /// D re-registered during the write: the new match, to write next.
    rematch: Option<Py<Arrival>>,
}

/// What `cancel` did.
#[pyclass(module = "kvpush._native.lab", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Cancellation {
    /// "not_found", "removed" or "deferred" (a write is in flight; acknowledge at `finish`).
    status: &'static str,
    /// D's waiting registration, when removed.
    registration: Option<Py<PyAny>>,
    /// P's ready payload, when removed: free those blocks.
    ready: Option<Py<PyAny>>,
}

/// An entry whose deadline passed before any write began.
#[pyclass(module = "kvpush._native.lab", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Expired {
    key: String,
    epoch: Option<Epoch>,
    registration: Option<Py<PyAny>>,
    ready: Option<Py<PyAny>>,
    was_matched: bool,
}

/// Where D's registration meets P's finished KV. Thread-safe.
#[pyclass(module = "kvpush._native.lab", frozen)]
#[derive(Debug)]
pub(crate) struct RendezvousTable {
    table: core::RendezvousTable<Registration, Ready>,
    origin: Instant,
}

impl RendezvousTable {
    fn instant(&self, now: Option<f64>) -> PyResult<Instant> {
        match now {
            None => Ok(Instant::now()),
            Some(now) => Ok(self.origin + seconds(now, "now")?),
        }
    }

    /// An arrival's key, its time and its deadline, from the Python arguments.
    fn arrival(
        &self,
        request_id: &str,
        transfer_id: Option<&str>,
        ttl: f64,
        now: Option<f64>,
    ) -> PyResult<(TransferKey, Instant, Instant)> {
        let now = self.instant(now)?;
        let deadline = now + seconds(ttl, "ttl")?;
        Ok((TransferKey::for_request(transfer_id, request_id), now, deadline))
    }
}

#[pymethods]
impl RendezvousTable {
    #[new]
    #[pyo3(signature = (*, shards = 64, max_entries = 65_536, fence_ttl = 60.0))]
    fn new(shards: usize, max_entries: usize, fence_ttl: f64) -> PyResult<Self> {
        if !shards.is_power_of_two() {
            return Err(PyValueError::new_err(format!(
                "shards must be a power of two, not {shards}"
            )));
        }
        let config =
            TableConfig { shards, max_entries, fence_ttl: seconds(fence_ttl, "fence_ttl")? };
        Ok(Self { table: core::RendezvousTable::new(config), origin: Instant::now() })
    }

    /// Seconds on the table's clock: the time `now=` arguments are measured in.
    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    /// D's registration for `request_id` (or `transfer_id`) at `epoch`.
    #[pyo3(signature = (request_id, epoch, payload, *, ttl, transfer_id = None, now = None))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        request_id: &str,
        epoch: Epoch,
        payload: Py<PyAny>,
        ttl: f64,
        transfer_id: Option<&str>,
        now: Option<f64>,
    ) -> PyResult<Arrival> {
        let (key, now, deadline) = self.arrival(request_id, transfer_id, ttl, now)?;
        let arrival =
            native(py, || self.table.register(key.clone(), epoch, payload, deadline, now))?;
        Ok(Arrival::from_core(py, &key, Some(epoch), arrival))
    }

    /// P's KV for `request_id` (or `transfer_id`) is computed; `payload` says where it is.
    #[pyo3(signature = (request_id, payload, *, ttl, transfer_id = None, now = None))]
    fn ready(
        &self,
        py: Python<'_>,
        request_id: &str,
        payload: Py<PyAny>,
        ttl: f64,
        transfer_id: Option<&str>,
        now: Option<f64>,
    ) -> PyResult<Arrival> {
        let (key, now, deadline) = self.arrival(request_id, transfer_id, ttl, now)?;
        let ready = Arc::new(payload);
        let arrival = native(py, || self.table.ready(key.clone(), ready, deadline, now))?;
        Ok(Arrival::from_core(py, &key, None, arrival))
    }

    /// The writer starts writing the match at `epoch`; refused if it was superseded or cancelled.
    fn begin_write(&self, py: Python<'_>, key: &str, epoch: Epoch) -> PyResult<()> {
        let key = TransferKey::from_canonical(key);
        native(py, || self.table.begin_write(&key, epoch))
    }

    /// The write at `epoch` ended (`error` None: delivered).
    #[pyo3(signature = (key, epoch, *, error = None, now = None))]
    fn finish(
        &self,
        py: Python<'_>,
        key: &str,
        epoch: Epoch,
        error: Option<String>,
        now: Option<f64>,
    ) -> PyResult<Finished> {
        let key = TransferKey::from_canonical(key);
        let now = self.instant(now)?;
        let outcome = error.map_or(Outcome::Done, Outcome::Failed);
        let finished = native(py, || self.table.finish(&key, epoch, outcome, now))?;
        let rematch = finished.rematch.map(|m| Py::new(py, Arrival::matched(py, m))).transpose()?;
        Ok(Finished {
            outcome: match finished.outcome {
                Outcome::Done => "done",
                Outcome::Failed(_) => "failed",
            },
            cancel_acknowledged: finished.cancel_acknowledged,
            rematch,
        })
    }

    /// Cancels the transfer (only `epoch`'s registration when given) and fences the key.
    #[pyo3(signature = (key, epoch = None, *, now = None))]
    fn cancel(
        &self,
        py: Python<'_>,
        key: &str,
        epoch: Option<Epoch>,
        now: Option<f64>,
    ) -> PyResult<Cancellation> {
        let key = TransferKey::from_canonical(key);
        let now = self.instant(now)?;
        let cancelled = detached(py, || self.table.cancel(&key, epoch, now))?;
        Ok(match cancelled {
            Cancelled::NotFound => {
                Cancellation { status: "not_found", registration: None, ready: None }
            }
            Cancelled::Deferred => {
                Cancellation { status: "deferred", registration: None, ready: None }
            }
            Cancelled::Removed { registration, ready } => Cancellation {
                status: "removed",
                registration,
                ready: ready.map(|r| ready_object(py, &r)),
            },
        })
    }

    /// Removes and returns every entry whose deadline passed before a write began.
    #[pyo3(signature = (*, now = None))]
    fn expire(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Vec<Expired>> {
        let now = self.instant(now)?;
        let expired = detached(py, || self.table.expire(now))?;
        Ok(expired
            .into_iter()
            .map(|e| {
                let (epoch, registration) =
                    e.registration.map_or((None, None), |(ep, r)| (Some(ep), Some(r)));
                Expired {
                    key: e.key.as_str().to_owned(),
                    epoch,
                    registration,
                    ready: e.ready.map(|r| ready_object(py, &r)),
                    was_matched: e.was_matched,
                }
            })
            .collect())
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    /// Keys that ended recently and still refuse late arrivals.
    #[getter]
    fn fences(&self) -> usize {
        self.table.fences()
    }

    fn __repr__(&self) -> String {
        format!("RendezvousTable({} pending, {} fenced)", self.table.len(), self.table.fences())
    }
}

//! How a transfer ended, typed: `TransferEvent`, its `Timeline`, and the enums `Role`,
//! `Outcome`, `Reason` and `AbortOutcome`.
//!
//! Each enum member carries a stable snake_case code (`value`), the one metric labels, JSON
//! timelines and logs use. A member compares equal to its code and hashes like it, so code that
//! branches on `event.outcome == "done"` or keys a dict by the code keeps working; `str()` gives
//! the code. Events hand out the class's own members, so `event.outcome is Outcome.DONE` holds.

use kvpush_core::endpoint::{self as core, Event};
use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

/// The methods every code enum has; `$ty` lists its variants with their codes.
macro_rules! code_enum {
    ($(#[$doc:meta])* $ty:ident { $($(#[$vdoc:meta])* $variant:ident = $code:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[pyclass(module = "kvpush", frozen, rename_all = "SCREAMING_SNAKE_CASE")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum $ty {
            $($(#[$vdoc])* $variant),+
        }

        impl $ty {
            const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The stable code.
            pub(crate) fn code(self) -> &'static str {
                match self {
                    $(Self::$variant => $code),+
                }
            }

            /// The member's attribute name on the class: its code in upper case.
            fn attribute(self) -> String {
                self.code().to_ascii_uppercase()
            }

            /// The member whose code is `code`; `ValueError` naming the codes for none.
            fn parse(code: &str) -> PyResult<Self> {
                Self::ALL.iter().copied().find(|member| member.code() == code).ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "{code:?} is not a {} code (one of {:?})",
                        stringify!($ty),
                        Self::ALL.iter().map(|member| member.code()).collect::<Vec<_>>()
                    ))
                })
            }

            /// The class's own member for `self` (so that `is` holds against it). Looked up
            /// once per class: events hand members out on the engine's thread.
            pub(crate) fn member(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
                static MEMBERS: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();
                let members = MEMBERS.get_or_try_init(py, || {
                    let class = py.get_type::<Self>();
                    Self::ALL
                        .iter()
                        .map(|member| class.getattr(member.attribute()).map(Bound::unbind))
                        .collect::<PyResult<Vec<_>>>()
                })?;
                // Variants without fields number from 0 in declaration order, as `ALL` lists
                // them.
                Ok(members[self as usize].bind(py).clone())
            }
        }

        #[pymethods]
        impl $ty {
            /// The member whose code is `code` (as Python's enums look one up by value); equal
            /// to, though not the same object as, the class's own (`from_code` gives that).
            #[new]
            fn new(code: &str) -> PyResult<Self> {
                Self::parse(code)
            }

            /// Every member, in declaration order.
            #[classmethod]
            fn members<'py>(cls: &Bound<'py, PyType>) -> PyResult<Vec<Bound<'py, PyAny>>> {
                Self::ALL.iter().map(|member| cls.getattr(member.attribute())).collect()
            }

            /// The member whose code is `code`; `ValueError` for none.
            #[classmethod]
            fn from_code<'py>(cls: &Bound<'py, PyType>, code: &str) -> PyResult<Bound<'py, PyAny>> {
                cls.getattr(Self::parse(code)?.attribute())
            }

            /// The stable code (metric labels, JSON, logs).
            #[getter]
            fn value(&self) -> &'static str {
                self.code()
            }

            #[getter]
            fn name(&self) -> String {
                self.attribute()
            }

            fn __str__(&self) -> &'static str {
                self.code()
            }

            fn __repr__(&self) -> String {
                format!("{}.{}", stringify!($ty), self.attribute())
            }

            /// Equal to the same member, or to its code.
            fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
                let py = other.py();
                let equal = if let Ok(other) = other.cast::<Self>() {
                    *other.get() == *self
                } else if let Ok(other) = other.cast::<PyString>() {
                    other.to_str().is_ok_and(|other| other == self.code())
                } else {
                    return Ok(py.NotImplemented());
                };
                let answer = match op {
                    CompareOp::Eq => equal,
                    CompareOp::Ne => !equal,
                    _ => return Ok(py.NotImplemented()),
                };
                Ok(answer.into_pyobject(py)?.to_owned().into_any().unbind())
            }

            /// Pickled as its code: unpickled, it is the class's own member again.
            fn __reduce__<'py>(
                &self,
                py: Python<'py>,
            ) -> PyResult<(Bound<'py, PyAny>, (&'static str,))> {
                Ok((py.get_type::<Self>().getattr("from_code")?, (self.code(),)))
            }

            /// The code's hash, as equality with the code requires.
            fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
                PyString::new(py, self.code()).hash()
            }
        }
    };
}

code_enum! {
    /// Which side of a transfer an event is from.
    Role {
        /// P: this worker wrote the KV.
        Send = "send",
        /// D: this worker received the KV.
        Receive = "receive",
    }
}

code_enum! {
    /// How a transfer ended on this side.
    Outcome {
        /// The KV landed (D: every expected DONE arrived).
        Done = "done",
        /// It ended without the KV; the blocks may be reused (see `code`).
        Failed = "failed",
        /// D cancelled it, and P confirmed; the blocks may be reused.
        Cancelled = "cancelled",
        /// Not the end: no proof yet that no byte can land, so the blocks must stay held
        /// (a final event follows, if the proof ever comes).
        Quarantined = "quarantined",
    }
}

code_enum! {
    /// Why a transfer ended without its KV: stable codes (metric labels and programs branch on
    /// them; `TransferEvent.reason` is the detail for people, and may be reworded).
    Reason {
        /// P's request was aborted or finished without KV (D: P said so).
        Aborted = "aborted",
        /// D cancelled (aborted or preempted the request).
        Cancelled = "cancelled",
        /// A deadline passed first: P's lease with no registration, D's wait for the KV.
        Expired = "expired",
        /// P refused the registration: invalid or stale blocks, another peer's transfer, a quota.
        Refused = "refused",
        /// P's lease on D had lapsed (no fresh proof that D is alive): P did not write.
        LeaseLapsed = "lease_lapsed",
        /// P and D cannot exchange KV (compatibility, layout, memory).
        Incompatible = "incompatible",
        /// The WRITE failed or timed out, and NIXL let go of it.
        WriteError = "write_error",
        /// The peer was lost (D: reported once P's write horizon passed).
        PeerLost = "peer_lost",
        /// D could not reach P: nothing was registered.
        Unreachable = "unreachable",
        /// No proof that the WRITE can no longer land: the blocks stay held.
        Quarantined = "quarantined",
        /// The endpoint, or its peer, shut down.
        Closed = "closed",
        /// The writer thread died: the endpoint is unhealthy.
        WriterDied = "writer_died",
    }
}

code_enum! {
    /// What `Endpoint.abort` did.
    AbortOutcome {
        /// Nothing was or will be written: free the blocks.
        Released = "released",
        /// A WRITE is in flight: keep the blocks until the request's event.
        InFlight = "in_flight",
        /// The endpoint knows no such request (already ended, or never ready).
        Unknown = "unknown",
    }
}

impl From<core::Role> for Role {
    fn from(role: core::Role) -> Self {
        match role {
            core::Role::Send => Self::Send,
            core::Role::Receive => Self::Receive,
        }
    }
}

impl From<core::Reason> for Reason {
    fn from(reason: core::Reason) -> Self {
        match reason {
            core::Reason::Aborted => Self::Aborted,
            core::Reason::Cancelled => Self::Cancelled,
            core::Reason::Expired => Self::Expired,
            core::Reason::Refused => Self::Refused,
            core::Reason::LeaseLapsed => Self::LeaseLapsed,
            core::Reason::Incompatible => Self::Incompatible,
            core::Reason::WriteError => Self::WriteError,
            core::Reason::PeerLost => Self::PeerLost,
            core::Reason::Unreachable => Self::Unreachable,
            core::Reason::Quarantined => Self::Quarantined,
            core::Reason::Closed => Self::Closed,
            core::Reason::WriterDied => Self::WriterDied,
        }
    }
}

impl From<core::AbortOutcome> for AbortOutcome {
    fn from(outcome: core::AbortOutcome) -> Self {
        match outcome {
            core::AbortOutcome::Released => Self::Released,
            core::AbortOutcome::InFlight => Self::InFlight,
            core::AbortOutcome::Unknown => Self::Unknown,
        }
    }
}

/// When each step of a transfer happened, in seconds on the endpoint's clock
/// (`Endpoint.clock()`); None for a step this transfer never took. Also a read-only mapping of
/// the steps it took (`timeline["posted"]`, `"posted" in timeline`, `items()`). Equal when
/// every step is.
#[pyclass(module = "kvpush", frozen, get_all, eq)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Timeline {
    /// P: D's registration arrived. D: the registration was handed to the endpoint.
    registered: Option<f64>,
    /// P, layer-wise push: the first layer's WRITE was posted, before the KV was reported ready.
    streamed: Option<f64>,
    /// P: the KV was reported ready.
    ready: Option<f64>,
    /// P: the second half arrived (the match).
    matched: Option<f64>,
    /// P: the WRITE was posted.
    posted: Option<f64>,
    /// P: the WRITE completed. D: the last expected DONE arrived.
    completed: Option<f64>,
}

impl From<core::Timeline> for Timeline {
    fn from(t: core::Timeline) -> Self {
        Self {
            registered: t.registered,
            streamed: t.streamed,
            ready: t.ready,
            matched: t.matched,
            posted: t.posted,
            completed: t.completed,
        }
    }
}

impl Timeline {
    fn steps(&self) -> [(&'static str, Option<f64>); 6] {
        [
            ("registered", self.registered),
            ("streamed", self.streamed),
            ("ready", self.ready),
            ("matched", self.matched),
            ("posted", self.posted),
            ("completed", self.completed),
        ]
    }
}

#[pymethods]
impl Timeline {
    /// A timeline with the steps given (the endpoint makes them; test doubles of events too).
    #[new]
    #[pyo3(signature = (*, registered = None, streamed = None, ready = None, matched = None, posted = None, completed = None))]
    fn new(
        registered: Option<f64>,
        streamed: Option<f64>,
        ready: Option<f64>,
        matched: Option<f64>,
        posted: Option<f64>,
        completed: Option<f64>,
    ) -> Self {
        Self { registered, streamed, ready, matched, posted, completed }
    }

    /// `(step, seconds)` for each step taken, in order.
    fn items(&self) -> Vec<(&'static str, f64)> {
        self.steps().into_iter().filter_map(|(step, at)| Some((step, at?))).collect()
    }

    /// The steps taken.
    fn keys(&self) -> Vec<&'static str> {
        self.items().into_iter().map(|(step, _)| step).collect()
    }

    /// `step`'s time, or `default` when it was not taken.
    #[pyo3(signature = (step, default = None))]
    fn get(&self, step: &str, default: Option<f64>) -> Option<f64> {
        self.steps().into_iter().find(|(name, _)| *name == step).and_then(|(_, at)| at).or(default)
    }

    fn __getitem__(&self, step: &str) -> PyResult<f64> {
        self.get(step, None).ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(step.to_owned()))
    }

    fn __contains__(&self, step: &str) -> bool {
        self.get(step, None).is_some()
    }

    fn __len__(&self) -> usize {
        self.items().len()
    }

    fn __iter__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(self.keys().into_pyobject(py)?.try_iter()?.into_any().unbind())
    }

    fn __repr__(&self) -> String {
        let steps: Vec<String> =
            self.items().iter().map(|(step, at)| format!("{step}={at:.6}")).collect();
        format!("Timeline({})", steps.join(", "))
    }
}

/// How one request's transfer ended on this side.
#[pyclass(module = "kvpush", frozen)]
#[derive(Debug)]
pub(crate) struct TransferEvent {
    role: Role,
    /// The local request id.
    #[pyo3(get)]
    request_id: String,
    /// The transfer key both sides matched on.
    #[pyo3(get)]
    key: String,
    outcome: Outcome,
    /// Why, when not done: the detail, for people (may be reworded).
    #[pyo3(get)]
    reason: Option<String>,
    code: Option<Reason>,
    /// Bytes written (P) or announced by the DONEs (D).
    #[pyo3(get)]
    bytes: u64,
    /// Descriptor runs in the WRITE (P).
    #[pyo3(get)]
    runs: u32,
    /// P, layer-wise push: of `bytes`, those written layer by layer before the KV was ready.
    #[pyo3(get)]
    streamed_bytes: u64,
    /// P, layer-wise push of a prompt computed in chunks: of `bytes`, those written again (D's
    /// block holding an earlier chunk's last token).
    #[pyo3(get)]
    rewritten_bytes: u64,
    /// When each step happened.
    #[pyo3(get)]
    timeline: Timeline,
}

impl From<Event> for TransferEvent {
    fn from(event: Event) -> Self {
        let code = event.outcome.cause().map(|cause| Reason::from(cause.reason));
        let (outcome, reason) = match event.outcome {
            core::Outcome::Done => (Outcome::Done, None),
            core::Outcome::Failed(cause) => (Outcome::Failed, Some(cause.detail)),
            core::Outcome::Cancelled(cause) => (Outcome::Cancelled, Some(cause.detail)),
            core::Outcome::Quarantined(cause) => (Outcome::Quarantined, Some(cause.detail)),
        };
        Self {
            role: event.role.into(),
            request_id: event.request_id,
            key: event.key.as_str().to_owned(),
            outcome,
            reason,
            code,
            bytes: event.bytes,
            runs: event.runs,
            streamed_bytes: event.streamed_bytes,
            rewritten_bytes: event.rewritten_bytes,
            timeline: event.timeline.into(),
        }
    }
}

#[pymethods]
impl TransferEvent {
    /// `Role.SEND` (P) or `Role.RECEIVE` (D).
    #[getter]
    fn role<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.role.member(py)
    }

    /// How it ended (`Outcome.QUARANTINED` is a notice: the final event follows).
    #[getter]
    fn outcome<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.outcome.member(py)
    }

    /// Why, when not done: the `Reason` programs and metrics branch on.
    #[getter]
    fn code<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.code.map(|code| code.member(py)).transpose()
    }

    fn __repr__(&self) -> String {
        let (role, outcome) = (self.role.code(), self.outcome.code());
        match &self.reason {
            None => format!(
                "TransferEvent({role} {:?} {outcome}: {} bytes, {} runs)",
                self.request_id, self.bytes, self.runs
            ),
            Some(reason) => {
                format!("TransferEvent({role} {:?} {outcome}: {reason})", self.request_id)
            }
        }
    }
}

//! The kvpush exception hierarchy and the one mapping from core errors onto it.
//!
//! The classes are declared under their public path (`kvpush.exceptions`) so tracebacks and
//! `repr` name what user code imports. Every raised instance carries a stable `code` attribute
//! (snake_case) for metrics, and `key` or `request` where the error concerns one transfer.

use kvpush_core::{planner, protocol, rendezvous};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyType;

create_exception!(kvpush.exceptions, KvPushError, PyException, "Base class of every kvpush error.");
create_exception!(
    kvpush.exceptions,
    LayoutError,
    KvPushError,
    "A KV layout is inconsistent, or two layouts cannot be paired."
);
create_exception!(
    kvpush.exceptions,
    PlanError,
    KvPushError,
    "A transfer cannot be planned from the block lists given."
);
create_exception!(
    kvpush.exceptions,
    InvalidBlocksError,
    PlanError,
    "A peer sent out-of-range, duplicate or miscounted block ids."
);
create_exception!(
    kvpush.exceptions,
    RendezvousError,
    KvPushError,
    "The rendezvous table refused an arrival or a transition."
);
create_exception!(
    kvpush.exceptions,
    StaleEpochError,
    RendezvousError,
    "A registration older than the current one."
);
create_exception!(
    kvpush.exceptions,
    FencedError,
    RendezvousError,
    "The transfer already ended: delivered, failed, cancelled or expired."
);
create_exception!(
    kvpush.exceptions,
    DuplicateReadyError,
    RendezvousError,
    "The KV of a request was reported ready twice."
);
create_exception!(
    kvpush.exceptions,
    NotMatchedError,
    RendezvousError,
    "A write began or finished for an epoch that is not the matched one."
);
create_exception!(
    kvpush.exceptions,
    TableFullError,
    RendezvousError,
    "Too many transfers pending: back off and retry."
);
create_exception!(kvpush.exceptions, ProtocolError, KvPushError, "A kvpush/1 message was refused.");
create_exception!(
    kvpush.exceptions,
    TransportError,
    KvPushError,
    "The data path (NIXL or loopback) or the side channel failed."
);
create_exception!(
    kvpush.exceptions,
    NixlUnavailableError,
    TransportError,
    "NIXL's C API library could not be loaded."
);
create_exception!(
    kvpush.exceptions,
    MessageTooLargeError,
    ProtocolError,
    "A frame over the size limit."
);
create_exception!(
    kvpush.exceptions,
    MalformedMessageError,
    ProtocolError,
    "Not a valid kvpush/1 frame."
);
create_exception!(
    kvpush.exceptions,
    AuthenticationError,
    ProtocolError,
    "Unsigned, forged, replayed or too old, with a secret configured."
);

create_exception!(
    kvpush.exceptions,
    ConfigError,
    KvPushError,
    "A setting is out of range or unsafe (such as listening beyond loopback without a secret)."
);
create_exception!(
    kvpush.exceptions,
    UnhealthyError,
    KvPushError,
    "The endpoint's writer thread stopped or stalled: it takes on no new work."
);
create_exception!(
    kvpush.exceptions,
    BusyError,
    KvPushError,
    "The endpoint's writer thread is behind (its inbox is full): nothing was done; retry later."
);

/// Adds every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvPushError", py.get_type::<KvPushError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("InvalidBlocksError", py.get_type::<InvalidBlocksError>())?;
    m.add("RendezvousError", py.get_type::<RendezvousError>())?;
    m.add("StaleEpochError", py.get_type::<StaleEpochError>())?;
    m.add("FencedError", py.get_type::<FencedError>())?;
    m.add("DuplicateReadyError", py.get_type::<DuplicateReadyError>())?;
    m.add("NotMatchedError", py.get_type::<NotMatchedError>())?;
    m.add("TableFullError", py.get_type::<TableFullError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("MessageTooLargeError", py.get_type::<MessageTooLargeError>())?;
    m.add("MalformedMessageError", py.get_type::<MalformedMessageError>())?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("NixlUnavailableError", py.get_type::<NixlUnavailableError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("UnhealthyError", py.get_type::<UnhealthyError>())?;
    m.add("BusyError", py.get_type::<BusyError>())?;
    Ok(())
}

/// A core error on its way to Python: the one place that decides which exception each becomes.
#[derive(Debug)]
pub(crate) enum Error {
    Plan(planner::PlanError),
    Protocol(protocol::ProtocolError),
    Rendezvous(rendezvous::RendezvousError),
    /// A data-path or endpoint failure, with its stable code.
    Transport {
        code: &'static str,
        message: String,
    },
    /// NIXL's library could not be loaded.
    NixlUnavailable(String),
    /// A setting or argument is out of range or unsafe.
    Config(String),
    /// The endpoint stopped taking work.
    Unhealthy(String),
    /// The endpoint's writer is behind: nothing was done.
    Busy(String),
}

impl From<kvpush_core::transport::TransportError> for Error {
    fn from(error: kvpush_core::transport::TransportError) -> Self {
        Self::Transport { code: "transport", message: error.to_string() }
    }
}

impl From<kvpush_nixl::NixlError> for Error {
    fn from(error: kvpush_nixl::NixlError) -> Self {
        Self::Transport { code: "nixl", message: error.to_string() }
    }
}

impl From<kvpush_nixl::LoadError> for Error {
    fn from(error: kvpush_nixl::LoadError) -> Self {
        Self::NixlUnavailable(error.to_string())
    }
}

impl From<kvpush_core::endpoint::EndpointError> for Error {
    fn from(error: kvpush_core::endpoint::EndpointError) -> Self {
        use kvpush_core::endpoint::EndpointError as E;
        match error {
            E::Rendezvous(error) => Self::Rendezvous(error),
            E::Transport(error) => error.into(),
            E::Listen { .. } => Self::Transport { code: "listen", message: error.to_string() },
            E::Secret(_) => Self::Transport { code: "weak_secret", message: error.to_string() },
            E::Closed => Self::Transport { code: "closed", message: error.to_string() },
            E::Invalid(_) => Self::Config(error.to_string()),
            E::Unhealthy(_) => Self::Unhealthy(error.to_string()),
            E::Busy { .. } => Self::Busy(error.to_string()),
            E::StuckOnClose { .. } => Self::Transport { code: "stuck", message: error.to_string() },
        }
    }
}

impl From<rendezvous::RendezvousError> for Error {
    fn from(error: rendezvous::RendezvousError) -> Self {
        Self::Rendezvous(error)
    }
}

impl From<protocol::ProtocolError> for Error {
    fn from(error: protocol::ProtocolError) -> Self {
        Self::Protocol(error)
    }
}

impl From<planner::PlanError> for Error {
    fn from(error: planner::PlanError) -> Self {
        Self::Plan(error)
    }
}

impl From<Error> for PyErr {
    fn from(error: Error) -> Self {
        match error {
            Error::Plan(error) => {
                let class = match error {
                    planner::PlanError::Incompatible { .. } | planner::PlanError::Layout { .. } => {
                        Python::attach(|py| py.get_type::<LayoutError>().unbind())
                    }
                    _ => Python::attach(|py| py.get_type::<InvalidBlocksError>().unbind()),
                };
                raise(class, &error, error.code(), &[("request", error.request())])
            }
            Error::Protocol(error) => {
                use protocol::ProtocolError as E;
                let class = Python::attach(|py| {
                    match error {
                        E::Oversized { .. } => py.get_type::<MessageTooLargeError>(),
                        E::Truncated { .. }
                        | E::Malformed { .. }
                        | E::UnsupportedVersion { .. }
                        | E::UnknownKind { .. }
                        | E::Invalid { .. } => py.get_type::<MalformedMessageError>(),
                        E::Unauthenticated
                        | E::BadSignature
                        | E::Replayed { .. }
                        | E::ClockSkew { .. }
                        | E::TooManySessions { .. } => py.get_type::<AuthenticationError>(),
                        E::WeakSecret { .. } => py.get_type::<ProtocolError>(),
                    }
                    .unbind()
                });
                raise(class, &error, error.code(), &[])
            }
            Error::Rendezvous(error) => {
                use rendezvous::RendezvousError as E;
                let class = Python::attach(|py| {
                    match error {
                        E::StaleEpoch { .. } => py.get_type::<StaleEpochError>(),
                        E::DuplicateReady { .. } => py.get_type::<DuplicateReadyError>(),
                        E::Fenced { .. } => py.get_type::<FencedError>(),
                        E::TableFull { .. } => py.get_type::<TableFullError>(),
                        E::NotMatched { .. } => py.get_type::<NotMatchedError>(),
                        E::Foreign { .. } => py.get_type::<RendezvousError>(),
                    }
                    .unbind()
                });
                raise(class, &error, error.code(), &[("key", Some(error.key().as_str()))])
            }
            Error::Transport { code, message } => {
                let class = Python::attach(|py| py.get_type::<TransportError>().unbind());
                raise(class, &message, code, &[])
            }
            Error::NixlUnavailable(message) => {
                let class = Python::attach(|py| py.get_type::<NixlUnavailableError>().unbind());
                raise(class, &message, "nixl_unavailable", &[])
            }
            Error::Config(message) => {
                let class = Python::attach(|py| py.get_type::<ConfigError>().unbind());
                raise(class, &message, "config", &[])
            }
            Error::Unhealthy(message) => {
                let class = Python::attach(|py| py.get_type::<UnhealthyError>().unbind());
                raise(class, &message, "unhealthy", &[])
            }
            Error::Busy(message) => {
                let class = Python::attach(|py| py.get_type::<BusyError>().unbind());
                raise(class, &message, "busy", &[])
            }
        }
    }
}

/// A `LayoutError` for tensor parallel sizes that cannot exchange KV.
pub(crate) fn topology_error(error: kvpush_core::topology::TopologyError) -> PyErr {
    Python::attach(|py| raise(py.get_type::<LayoutError>().unbind(), &error, "tp_mismatch", &[]))
}

/// A `LayoutError` for a layout that failed validation before any planner saw it.
pub(crate) fn layout_error(error: kvpush_core::layout::LayoutError) -> PyErr {
    Python::attach(|py| raise(py.get_type::<LayoutError>().unbind(), &error, "invalid_layout", &[]))
}

/// Builds an exception of `class` with `error`'s message, its `code` and the given attributes
/// (`None` values are set too, so `getattr(e, "request")` is always safe on these classes).
fn raise(
    class: Py<PyType>,
    error: &dyn std::fmt::Display,
    code: &'static str,
    attributes: &[(&str, Option<&str>)],
) -> PyErr {
    Python::attach(|py| {
        let err = PyErr::from_type(class.into_bound(py), error.to_string());
        let value = err.value(py);
        // Setting an attribute on a fresh exception instance cannot fail short of memory
        // exhaustion; the exception is still worth raising without it.
        let _ = value.setattr("code", code);
        for (name, attribute) in attributes {
            let _ = value.setattr(*name, *attribute);
        }
        err
    })
}

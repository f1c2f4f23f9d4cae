//! What can go wrong: loading the library ([`LoadError`]) and NIXL calls ([`NixlError`], whose
//! [`Status`] names the C API's status code).

use std::ffi::c_int;
use std::fmt;
use std::path::PathBuf;

use crate::api::{status, CAPI_PATH_ENV};

/// A `nixl_capi_status_t` other than success, by name.
///
/// The C API folds most of NIXL's own statuses into [`Status::Backend`] (and
/// `nixl_capi_create_xfer_req` reports every failure as `Backend`), so the operation and detail
/// of a [`NixlError`] say more than the status does; NIXL's log (`NIXL_LOG_LEVEL=DEBUG`) says why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// `NIXL_CAPI_IN_PROG`, where the operation had to be complete.
    InProgress,
    /// `NIXL_CAPI_ERROR_INVALID_PARAM`.
    InvalidParam,
    /// `NIXL_CAPI_ERROR_BACKEND`.
    Backend,
    /// `NIXL_CAPI_ERROR_INVALID_STATE`.
    InvalidState,
    /// `NIXL_CAPI_ERROR_EXCEPTION`.
    Exception,
    /// `NIXL_CAPI_ERROR_NO_TELEMETRY`.
    NoTelemetry,
    /// `NIXL_CAPI_ERROR_NOT_FOUND`: agent metadata not loaded, or no backend serves the request.
    NotFound,
    /// A code this crate does not know (a newer NIXL).
    Other(i32),
}

impl Status {
    /// The status for a raw code; `None` for success.
    pub(crate) fn from_code(code: c_int) -> Option<Self> {
        Some(match code {
            status::SUCCESS => return None,
            status::IN_PROG => Self::InProgress,
            status::INVALID_PARAM => Self::InvalidParam,
            status::BACKEND => Self::Backend,
            status::INVALID_STATE => Self::InvalidState,
            status::EXCEPTION => Self::Exception,
            status::NO_TELEMETRY => Self::NoTelemetry,
            status::NOT_FOUND => Self::NotFound,
            other => Self::Other(other),
        })
    }

    /// The C API's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "NIXL_CAPI_IN_PROG",
            Self::InvalidParam => "NIXL_CAPI_ERROR_INVALID_PARAM",
            Self::Backend => "NIXL_CAPI_ERROR_BACKEND",
            Self::InvalidState => "NIXL_CAPI_ERROR_INVALID_STATE",
            Self::Exception => "NIXL_CAPI_ERROR_EXCEPTION",
            Self::NoTelemetry => "NIXL_CAPI_ERROR_NO_TELEMETRY",
            Self::NotFound => "NIXL_CAPI_ERROR_NOT_FOUND",
            Self::Other(_) => "an unknown NIXL status",
        }
    }

    fn advice(self) -> &'static str {
        match self {
            Self::InProgress => "the operation is still running: poll it again",
            Self::InvalidParam => {
                "NIXL refused the arguments named above; if kvpush chose them, report a bug"
            }
            Self::Backend => {
                "NIXL or its UCX backend failed (the C API reports most failures this way): check \
                 the peer is alive and the memory registered; NIXL_LOG_LEVEL=DEBUG and \
                 UCX_LOG_LEVEL=info show the cause"
            }
            Self::InvalidState => "the handle was used in the wrong state: a kvpush bug; report it",
            Self::Exception => "NIXL threw: rerun with NIXL_LOG_LEVEL=DEBUG for the cause",
            Self::NoTelemetry => "enable telemetry in the agent config",
            Self::NotFound => {
                "the peer's metadata is not loaded (add the peer first) or no backend serves \
                 this memory"
            }
            Self::Other(_) => "this NIXL is newer than kvpush-nixl knows: pin the tested wheel",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Other(code) => write!(f, "NIXL status {code}"),
            known => f.write_str(known.name()),
        }
    }
}

/// A NIXL call that failed: which call, the status it returned, and what it concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlError {
    /// The C API call (`create_xfer_req`, `load_remote_md`, ...).
    pub op: &'static str,
    /// What it returned.
    pub status: Status,
    /// The agent, peer, write or memory it concerned.
    pub detail: String,
}

impl NixlError {
    pub(crate) fn new(op: &'static str, status: Status, detail: impl Into<String>) -> Self {
        Self { op, status, detail: detail.into() }
    }
}

impl fmt::Display for NixlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nixl_capi_{} returned {} ({}): {}",
            self.op,
            self.status,
            self.detail,
            self.status.advice()
        )
    }
}

impl std::error::Error for NixlError {}

/// Checks a status code: `Ok` on success, else the error `detail()` describes.
pub(crate) fn check(
    op: &'static str,
    code: c_int,
    detail: impl FnOnce() -> String,
) -> Result<(), NixlError> {
    match Status::from_code(code) {
        None => Ok(()),
        Some(status) => Err(NixlError::new(op, status, detail())),
    }
}

/// Why `libnixl_capi.so` could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// No path was given and `KVPUSH_NIXL_CAPI` is unset.
    #[error(
        "no NIXL C API library configured: set {CAPI_PATH_ENV} to the absolute path of \
         <site-packages>/.nixl_cu12.mesonpy.libs/libnixl_capi.so (pip install nixl-cu12==1.5.1)"
    )]
    NotConfigured,
    /// The path is relative; a bare name would find whatever the loader's search path holds.
    #[error("{path:?} is not an absolute path: pass the wheel's libnixl_capi.so by absolute path")]
    NotAbsolute {
        /// The path given.
        path: PathBuf,
    },
    /// `dlopen` failed.
    #[error(
        "cannot load {path:?}: {reason} (is nixl-cu12/nixl-cu13 installed in this environment?)"
    )]
    Open {
        /// The path given.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The library lacks functions kvpush calls: not NIXL's C API, or an incompatible version.
    #[error(
        "{path:?} lacks {} NIXL C API function(s) kvpush needs: {}; install the tested wheel \
         (nixl-cu12==1.5.1)",
        missing.len(),
        missing.join(", ")
    )]
    MissingSymbols {
        /// The path given.
        path: PathBuf,
        /// Every missing symbol.
        missing: Vec<String>,
    },
    /// The library is NIXL's stub build, which aborts on first use.
    #[error("{path:?} is NIXL's stub C API (nixl_capi_is_stub): load the wheel's real library")]
    Stub {
        /// The path given.
        path: PathBuf,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_map_to_names() {
        assert_eq!(Status::from_code(0), None);
        assert_eq!(Status::from_code(-2), Some(Status::Backend));
        assert_eq!(Status::from_code(-6), Some(Status::NotFound));
        assert_eq!(Status::from_code(1), Some(Status::InProgress));
        assert_eq!(Status::from_code(-42), Some(Status::Other(-42)));
        assert_eq!(Status::Backend.to_string(), "NIXL_CAPI_ERROR_BACKEND");
        assert_eq!(Status::Other(-42).to_string(), "NIXL status -42");
    }

    #[test]
    fn errors_say_what_failed_and_what_to_do() {
        let err = check("get_xfer_status", -6, || "write 7 to peer \"d0\"".into()).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("nixl_capi_get_xfer_status returned NIXL_CAPI_ERROR_NOT_FOUND"));
        assert!(text.contains("write 7 to peer \"d0\""), "{text}");
        assert!(text.contains("add the peer first"), "{text}");
        assert!(check("x", 0, || unreachable!()).is_ok());
    }

    #[test]
    fn missing_symbols_are_all_named() {
        let err = LoadError::MissingSymbols {
            path: "/x/libc.so.6".into(),
            missing: vec!["nixl_capi_a".into(), "nixl_capi_b".into()],
        };
        let text = err.to_string();
        assert!(text.contains("2 NIXL C API function(s)"), "{text}");
        assert!(text.contains("nixl_capi_a, nixl_capi_b"), "{text}");
    }
}

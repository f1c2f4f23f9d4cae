//! The paths every native call takes from Python into the core: a long one releases the GIL
//! ([`native`]), a short one that never waits keeps it ([`held`]).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;

use crate::errors::{Error, KvPushError};

/// Runs `work` with the GIL released, turning a panic into a `KvPushError` and the core's error
/// into the Python exception [`Error`] maps it to.
///
/// The closure gets only owned Rust values (`Send`, which is what PyO3's `Ungil` means off nightly), so no Python object is touched while other
/// Python threads run. A panic is a kvpush bug; surfacing it as `KvPushError` (an `Exception`)
/// rather than PyO3's `PanicException` (a `BaseException`) lets a serving engine's usual
/// `except Exception` keep the engine alive and fail just the request.
pub(crate) fn native<T, E>(
    py: Python<'_>,
    work: impl FnOnce() -> Result<T, E> + Send,
) -> PyResult<T>
where
    T: Send,
    E: Into<Error> + Send,
{
    answer(py.detach(|| catch_unwind(AssertUnwindSafe(work))))
}

/// [`native`] for a short call that never waits (it sends the writer a command, taking at most
/// locks that no thread holds across a wait or a transport call): it keeps the GIL. Released
/// for a few microseconds, the GIL goes to any other Python thread that wants it (vLLM's input
/// and output threads, under load), and the engine thread then waits up to the interpreter's
/// switch interval (5 ms) to get it back.
pub(crate) fn held<T, E>(work: impl FnOnce() -> Result<T, E>) -> PyResult<T>
where
    E: Into<Error>,
{
    answer(catch_unwind(AssertUnwindSafe(work)))
}

/// A native call's result as Python sees it: the core's error mapped by [`Error`], a panic a
/// `KvPushError`.
fn answer<T, E: Into<Error>>(
    result: Result<Result<T, E>, Box<dyn std::any::Any + Send>>,
) -> PyResult<T> {
    match result {
        Ok(result) => result.map_err(|error| PyErr::from(error.into())),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(KvPushError::new_err(format!(
                "internal error in kvpush's native core (please report it): {what}"
            )))
        }
    }
}

/// [`native`] for work that cannot fail (waits, closes, table operations): only a panic is
/// turned into an error.
pub(crate) fn detached<T: Send>(py: Python<'_>, work: impl FnOnce() -> T + Send) -> PyResult<T> {
    native(py, || Ok::<T, Error>(work()))
}

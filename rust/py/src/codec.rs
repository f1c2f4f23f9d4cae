//! `Encoder`, `Decoder` and `frame_length`: the kvpush/1 codec as Python sees it.
//!
//! Messages cross as flat dicts, `{"kind": "register", "transfer_key": ..., ...}`: the core's
//! `{"kind", "body"}` tagging is an encoding detail Python callers should not have to spell.

use std::sync::Mutex;
use std::time::Duration;

use kvpush_core::protocol::{self, unix_millis, Limits, Message, Secret};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::Error;
use crate::native::native;

const KIND: &str = "kind";
const BODY: &str = "body";

fn secret(bytes: Option<&[u8]>) -> PyResult<Option<Secret>> {
    bytes.map(|b| Secret::from_bytes(b).map_err(|e| Error::from(e).into())).transpose()
}

/// `{"kind": k, **fields}` → the core's message.
fn message_from_dict(message: &Bound<'_, PyDict>) -> PyResult<Message> {
    let py = message.py();
    let body = message.copy()?;
    let kind = body
        .get_item(KIND)?
        .ok_or_else(|| PyValueError::new_err("a kvpush message needs a 'kind' key"))?;
    body.del_item(KIND)?;
    let tagged = PyDict::new(py);
    tagged.set_item(KIND, kind)?;
    tagged.set_item(BODY, body)?;
    pythonize::depythonize(tagged.as_any())
        .map_err(|e| PyValueError::new_err(format!("not a valid kvpush/1 message: {e}")))
}

/// The core's message → `{"kind": k, **fields}`.
fn message_to_dict<'py>(py: Python<'py>, message: &Message) -> PyResult<Bound<'py, PyDict>> {
    let tagged = pythonize::pythonize(py, message)?.cast_into::<PyDict>()?;
    let flat = match tagged.get_item(BODY)? {
        Some(body) => body.cast_into::<PyDict>()?,
        None => PyDict::new(py),
    };
    flat.set_item(KIND, message.kind())?;
    Ok(flat)
}

/// Signs (with a secret) and frames messages. One per sender; safe to share across threads.
#[pyclass(module = "kvpush._native.lab", frozen)]
#[derive(Debug)]
pub(crate) struct Encoder(protocol::Encoder);

#[pymethods]
impl Encoder {
    #[new]
    #[pyo3(signature = (sender, secret = None))]
    fn new(sender: String, secret: Option<&[u8]>) -> PyResult<Self> {
        Ok(Self(protocol::Encoder::new(sender, self::secret(secret)?)))
    }

    /// One whole frame (length prefix included) carrying `message`.
    #[pyo3(signature = (message, *, now_ms = None))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        message: &Bound<'py, PyDict>,
        now_ms: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let message = message_from_dict(message)?;
        let frame = self.0.encode(&message, now_ms.unwrap_or_else(unix_millis));
        Ok(PyBytes::new(py, &frame))
    }

    #[getter]
    fn sender(&self) -> &str {
        self.0.sender()
    }

    #[getter]
    fn session(&self) -> u64 {
        self.0.session()
    }
}

/// Verifies and decodes frames, keeping its peers' replay windows.
#[pyclass(module = "kvpush._native.lab", frozen)]
#[derive(Debug)]
pub(crate) struct Decoder(Mutex<protocol::Decoder>);

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (secret = None, *, max_frame_bytes = None, max_block_ids = None, max_clock_skew = None))]
    fn new(
        secret: Option<&[u8]>,
        max_frame_bytes: Option<usize>,
        max_block_ids: Option<usize>,
        max_clock_skew: Option<f64>,
    ) -> PyResult<Self> {
        let mut limits = Limits::default();
        if let Some(max) = max_frame_bytes {
            limits.max_frame_bytes = max;
        }
        if let Some(max) = max_block_ids {
            limits.max_block_ids = max;
        }
        if let Some(skew) = max_clock_skew {
            limits.max_clock_skew = Duration::try_from_secs_f64(skew).map_err(|_| {
                PyValueError::new_err(format!("max_clock_skew must be >= 0 seconds, not {skew}"))
            })?;
        }
        Ok(Self(Mutex::new(protocol::Decoder::new(self::secret(secret)?, limits))))
    }

    /// `{"sender", "session", "seq", "ts_ms", "message": {"kind": ..., **fields}}`.
    #[pyo3(signature = (frame, *, now_ms = None))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        frame: Vec<u8>,
        now_ms: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now_ms = now_ms.unwrap_or_else(unix_millis);
        let envelope = native(py, || {
            // Decoding never panics on any input (property-tested and fuzzed); should it ever,
            // the panic is reported by `native` and the decoder stays usable.
            let mut decoder = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            decoder.decode(&frame, now_ms).map_err(Error::from)
        })?;
        let out = PyDict::new(py);
        out.set_item("sender", envelope.sender)?;
        out.set_item("session", envelope.session)?;
        out.set_item("seq", envelope.seq)?;
        out.set_item("ts_ms", envelope.ts_ms)?;
        out.set_item("message", message_to_dict(py, &envelope.message)?)?;
        Ok(out)
    }
}

/// Total bytes of the frame `prefix` starts, or None while fewer than 4 bytes are known.
#[pyfunction]
#[pyo3(signature = (prefix, max_frame_bytes = None))]
pub(crate) fn frame_length(
    prefix: &[u8],
    max_frame_bytes: Option<usize>,
) -> PyResult<Option<usize>> {
    let mut limits = Limits::default();
    if let Some(max) = max_frame_bytes {
        limits.max_frame_bytes = max;
    }
    protocol::frame_len(prefix, &limits).map_err(|e| Error::from(e).into())
}

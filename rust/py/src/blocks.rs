//! Block ids as Python gives them: a sequence of ints, or any one-dimensional buffer of
//! integers (`array.array`, a numpy array, a `memoryview`), copied in one piece.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PyString, PyTuple};

/// One KV group's block ids.
#[derive(Debug)]
pub(crate) struct BlockIds(pub(crate) Vec<u32>);

/// A buffer's element type, from its `struct` format (native order and size only: what
/// `array.array` and numpy's native arrays give).
fn element(format: &str, itemsize: usize) -> Option<(bool, usize)> {
    let code = format.strip_prefix(['@', '=']).unwrap_or(format);
    let code = if cfg!(target_endian = "little") {
        code.strip_prefix('<').unwrap_or(code)
    } else {
        code.strip_prefix(['>', '!']).unwrap_or(code)
    };
    let signed = match code {
        "b" | "h" | "i" | "l" | "q" | "n" => true,
        "B" | "H" | "I" | "L" | "Q" | "N" => false,
        _ => return None,
    };
    matches!(itemsize, 1 | 2 | 4 | 8).then_some((signed, itemsize))
}

fn from_buffer(view: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let ndim: usize = view.getattr("ndim")?.extract()?;
    let format: String = view.getattr("format")?.extract()?;
    let itemsize: usize = view.getattr("itemsize")?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "block ids must be a one-dimensional buffer, not {ndim}-dimensional"
        )));
    }
    let (signed, size) = element(&format, itemsize).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "block ids must be integers; the buffer's items are {format:?} ({itemsize} bytes)"
        ))
    })?;
    // `tobytes` copies any strides into one C-ordered piece.
    let bytes = view.call_method0("tobytes")?;
    let raw = bytes.cast::<PyBytes>()?.as_bytes();
    raw.chunks_exact(size)
        .map(|item| {
            let value = integer(item, signed);
            u32::try_from(value).map_err(|_| {
                PyValueError::new_err(format!("block id {value} is out of range (0..2**32)"))
            })
        })
        .collect()
}

/// One native-endian integer of 1, 2, 4 or 8 bytes.
fn integer(item: &[u8], signed: bool) -> i128 {
    fn bytes<const N: usize>(item: &[u8]) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(item);
        out
    }
    match (item.len(), signed) {
        (1, true) => i8::from_ne_bytes(bytes(item)).into(),
        (1, false) => u8::from_ne_bytes(bytes(item)).into(),
        (2, true) => i16::from_ne_bytes(bytes(item)).into(),
        (2, false) => u16::from_ne_bytes(bytes(item)).into(),
        (4, true) => i32::from_ne_bytes(bytes(item)).into(),
        (4, false) => u32::from_ne_bytes(bytes(item)).into(),
        (_, true) => i64::from_ne_bytes(bytes(item)).into(),
        (_, false) => u64::from_ne_bytes(bytes(item)).into(),
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIds {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // A list or tuple is read item by item; anything else with the buffer protocol in one
        // copy; other sequences (a `range`) item by item.
        if ob.is_instance_of::<PyList>() || ob.is_instance_of::<PyTuple>() {
            return ob.extract::<Vec<u32>>().map(Self);
        }
        if ob.is_instance_of::<PyString>() || ob.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err("block ids must be integers, not a string"));
        }
        match PyMemoryView::from(&ob) {
            Ok(view) => from_buffer(view.as_any()).map(Self),
            Err(_) => ob.extract::<Vec<u32>>().map(Self),
        }
    }
}

/// Block lists as Python gives them: one per KV group (a list of lists or buffers, or a
/// two-dimensional array), or one flat list or buffer for a single group. An empty list is no
/// group at all.
#[derive(Debug)]
pub(crate) enum Groups {
    Single(BlockIds),
    PerGroup(Vec<BlockIds>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Groups {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let per_group = if ob.is_instance_of::<PyList>() || ob.is_instance_of::<PyTuple>() {
            // Groups when the first item has a length (a list, an array); ids when it is a number.
            match ob.len()? {
                0 => return Ok(Self::PerGroup(Vec::new())),
                _ => ob.get_item(0)?.len().is_ok(),
            }
        } else {
            PyMemoryView::from(&ob)
                .and_then(|view| view.getattr("ndim")?.extract::<usize>())
                .is_ok_and(|ndim| ndim == 2)
        };
        if per_group {
            let groups: PyResult<Vec<BlockIds>> =
                ob.try_iter()?.map(|group| group?.extract::<BlockIds>()).collect();
            groups.map(Self::PerGroup)
        } else {
            ob.extract::<BlockIds>().map(Self::Single)
        }
    }
}

impl Groups {
    pub(crate) fn into_lists(self) -> Vec<Vec<u32>> {
        match self {
            Self::PerGroup(lists) => lists.into_iter().map(|ids| ids.0).collect(),
            Self::Single(ids) => vec![ids.0],
        }
    }
}

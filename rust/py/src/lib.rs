//! `kvpush._native`: the PyO3 binding of kvpush-core.
//!
//! Thin by design: each wrapper converts Python arguments into owned Rust values, runs the core
//! (releasing the GIL for anything longer than a map operation, see [`native`]) and maps core
//! errors onto the `kvpush.exceptions` hierarchy in one place ([`errors`]). No logic lives here
//! that a Rust caller of kvpush-core would not also get.

use pyo3::prelude::*;

mod blocks;
mod codec;
mod endpoint;
mod errors;
mod event;
mod native;
mod options;
mod planner;
mod table;
mod topology;

/// The transfer key P and D both derive for a request: `transfer_id` when given, else the
/// request id without vLLM's per-engine suffix and front-end prefix.
#[pyfunction]
#[pyo3(signature = (request_id, transfer_id = None))]
fn transfer_key(request_id: &str, transfer_id: Option<&str>) -> String {
    kvpush_core::TransferKey::for_request(transfer_id, request_id).as_str().to_owned()
}

/// The part of a vLLM request id that P and D share (see `transfer_key`).
#[pyfunction]
fn canonical_request_id(request_id: &str) -> &str {
    kvpush_core::canonical_request_id(request_id)
}

/// `kvpush._native`: the product's bindings. The lab's and the tests' (the rendezvous table,
/// the planner, the protocol's codec) are in its submodule `lab`, which the product never uses.
#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", kvpush_core::protocol::PROTOCOL_VERSION)?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(transfer_key, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_request_id, m)?)?;
    m.add_function(wrap_pyfunction!(topology::tp_sources, m)?)?;
    m.add_class::<planner::Region>()?;
    m.add_class::<planner::KvLayout>()?;
    m.add_class::<options::EndpointOptions>()?;
    m.add_class::<endpoint::Endpoint>()?;
    m.add_class::<endpoint::LayerStreams>()?;
    m.add_class::<event::TransferEvent>()?;
    m.add_class::<event::Timeline>()?;
    m.add_class::<event::Role>()?;
    m.add_class::<event::Outcome>()?;
    m.add_class::<event::Reason>()?;
    m.add_class::<event::AbortOutcome>()?;

    let lab = PyModule::new(m.py(), "lab")?;
    lab.add_class::<planner::Planner>()?;
    lab.add_class::<planner::Plan>()?;
    lab.add_class::<table::RendezvousTable>()?;
    lab.add_class::<table::Arrival>()?;
    lab.add_class::<table::Finished>()?;
    lab.add_class::<table::Cancellation>()?;
    lab.add_class::<table::Expired>()?;
    lab.add_class::<codec::Encoder>()?;
    lab.add_class::<codec::Decoder>()?;
    lab.add_function(wrap_pyfunction!(codec::frame_length, &lab)?)?;
    m.add_submodule(&lab)?;
    Ok(())
}

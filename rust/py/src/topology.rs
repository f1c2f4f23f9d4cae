//! `tp_sources`: which of P's tensor parallel ranks a D rank receives from (the core's
//! `topology`), for the connector.

use kvpush_core::topology::{self, Attention, Rank};
use pyo3::prelude::*;

use crate::errors::topology_error;

/// P's ranks, and D's `(slot, of)` share of the one P rank's transfer.
type Sources = (Vec<u32>, Option<(u32, u32)>);

/// Which of P's `p_tp_size` ranks hold the KV heads of D rank `tp_rank` of `tp_size` (with
/// `kv_heads` heads on the rank), as `(p_ranks, share)`: `share` is `(slot, of)` when one P
/// rank writes the request into `of` D ranks, this being slot `slot`. Raises `LayoutError` when
/// the two sizes cannot exchange KV, saying why.
#[pyfunction]
#[pyo3(signature = (
    tp_rank, tp_size, kv_heads, p_tp_size, *, total_kv_heads = None, mla = false,
    slices_heads = true
))]
pub(crate) fn tp_sources(
    tp_rank: u32,
    tp_size: u32,
    kv_heads: u32,
    p_tp_size: i64,
    total_kv_heads: Option<u64>,
    mla: bool,
    slices_heads: bool,
) -> PyResult<Sources> {
    // A negative size from a peer's parameters is refused like zero, not as an overflow.
    let p_tp = u64::try_from(p_tp_size).unwrap_or(0);
    let attention =
        if mla { Attention::Latent } else { Attention::Heads { total_kv_heads, slices_heads } };
    let sources = topology::sources(Rank { tp_rank, tp_size, kv_heads }, p_tp, attention)
        .map_err(topology_error)?;
    Ok((sources.ranks.collect(), sources.share.map(|share| (share.slot, share.of))))
}

//! `Region`, `KvLayout`, `Planner` and `Plan`: the planner as Python sees it.

use kvpush_core::layout::{KvLayout as CoreLayout, Region as CoreRegion, TokenOrder};
use kvpush_core::planner::{
    BlockList, CompactPlan, DescriptorRun, PlanRequest, Planner as CorePlanner,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::blocks::Groups;
use crate::errors::{layout_error, Error};
use crate::native::native;

/// One array of kernel blocks: block `k` starts at `base + k * block_stride`.
#[pyclass(module = "kvpush", frozen, eq)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region(pub(crate) CoreRegion);

#[pymethods]
impl Region {
    #[new]
    #[pyo3(signature = (base, block_stride, num_blocks, group = 0))]
    fn new(base: u64, block_stride: u64, num_blocks: u32, group: u32) -> Self {
        Self(CoreRegion { base, block_stride, num_blocks, group })
    }

    #[getter]
    fn base(&self) -> u64 {
        self.0.base
    }

    #[getter]
    fn block_stride(&self) -> u64 {
        self.0.block_stride
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.0.num_blocks
    }

    #[getter]
    fn group(&self) -> u32 {
        self.0.group
    }

    fn __repr__(&self) -> String {
        let CoreRegion { base, block_stride, num_blocks, group } = self.0;
        format!("Region(base={base:#x}, block_stride={block_stride}, num_blocks={num_blocks}, group={group})")
    }
}

/// One worker's KV cache layout, validated on creation.
#[pyclass(module = "kvpush", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvLayout(pub(crate) CoreLayout);

impl KvLayout {
    fn validated(layout: CoreLayout) -> PyResult<Self> {
        layout.validate().map_err(layout_error)?;
        Ok(Self(layout))
    }
}

fn parse_token_order(order: &str) -> PyResult<TokenOrder> {
    match order.to_ascii_uppercase().as_str() {
        "NHD" => Ok(TokenOrder::Nhd),
        "HND" => Ok(TokenOrder::Hnd),
        _ => {
            Err(PyValueError::new_err(format!("token_order must be 'NHD' or 'HND', not {order:?}")))
        }
    }
}

#[pymethods]
impl KvLayout {
    #[new]
    #[pyo3(signature = (
        regions, *, block_tokens, heads, head_bytes, kernel_block_tokens = None,
        token_order = "NHD", tp_rank = 0, tp_size = 1
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        regions: Vec<Region>,
        block_tokens: u32,
        heads: u32,
        head_bytes: u32,
        kernel_block_tokens: Option<u32>,
        token_order: &str,
        tp_rank: u32,
        tp_size: u32,
    ) -> PyResult<Self> {
        Self::validated(CoreLayout {
            regions: regions.into_iter().map(|r| r.0).collect(),
            block_tokens,
            kernel_block_tokens: kernel_block_tokens.unwrap_or(block_tokens),
            heads,
            head_bytes,
            token_order: parse_token_order(token_order)?,
            tp_rank,
            tp_size,
        })
    }

    #[getter]
    fn regions(&self) -> Vec<Region> {
        self.0.regions.iter().copied().map(Region).collect()
    }

    #[getter]
    fn block_tokens(&self) -> u32 {
        self.0.block_tokens
    }

    #[getter]
    fn kernel_block_tokens(&self) -> u32 {
        self.0.kernel_block_tokens
    }

    #[getter]
    fn heads(&self) -> u32 {
        self.0.heads
    }

    #[getter]
    fn head_bytes(&self) -> u32 {
        self.0.head_bytes
    }

    #[getter]
    fn token_order(&self) -> &'static str {
        self.0.token_order.as_str()
    }

    #[getter]
    fn tp_rank(&self) -> u32 {
        self.0.tp_rank
    }

    #[getter]
    fn tp_size(&self) -> u32 {
        self.0.tp_size
    }

    /// The layout as plain Python values, in the shape the kvpush/1 handshake carries it.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.0)?)
    }

    /// A layout from `to_dict`'s shape (or a peer's handshake), validated.
    #[staticmethod]
    fn from_dict(layout: &Bound<'_, PyDict>) -> PyResult<Self> {
        Self::validated(pythonize::depythonize(layout.as_any())?)
    }

    fn __repr__(&self) -> String {
        let l = &self.0;
        format!(
            "KvLayout({} regions, block_tokens={}, kernel_block_tokens={}, heads={}, head_bytes={}, \
             token_order={:?}, tp_rank={}, tp_size={})",
            l.regions.len(),
            l.block_tokens,
            l.kernel_block_tokens,
            l.heads,
            l.head_bytes,
            l.token_order.as_str(),
            l.tp_rank,
            l.tp_size
        )
    }
}

/// The runs to write for one request: planned and counted, written out as runs only when asked
/// (`runs`, `to_bytes`).
#[pyclass(module = "kvpush._native.lab", frozen)]
#[derive(Debug)]
pub(crate) struct Plan(CompactPlan);

impl Plan {
    fn expanded(&self) -> Vec<DescriptorRun> {
        let mut runs = Vec::new();
        self.0.expand_into(&mut runs);
        runs
    }
}

#[pymethods]
impl Plan {
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.stats().bytes
    }

    #[getter]
    fn unmerged_runs(&self) -> usize {
        self.0.stats().unmerged_runs
    }

    fn __len__(&self) -> usize {
        self.0.stats().runs
    }

    /// `(src_addr, dst_addr, length)` triples.
    fn runs(&self) -> Vec<(u64, u64, u64)> {
        self.expanded().iter().map(|r| (r.src, r.dst, r.len)).collect()
    }

    /// The runs as native-endian `u64` triples, for `memoryview(...).cast("Q")` or numpy.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let runs = self.expanded();
        PyBytes::new_with(py, runs.len() * 24, |raw| {
            for (run, out) in runs.iter().zip(raw.chunks_exact_mut(24)) {
                out[..8].copy_from_slice(&run.src.to_ne_bytes());
                out[8..16].copy_from_slice(&run.dst.to_ne_bytes());
                out[16..].copy_from_slice(&run.len.to_ne_bytes());
            }
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        let stats = self.0.stats();
        format!(
            "Plan({} runs, {} before merging, {} bytes)",
            stats.runs, stats.unmerged_runs, stats.bytes
        )
    }
}

fn block_lists<'a>(
    ids: &'a [Vec<u32>],
    first_tokens: Option<&[u64]>,
    side: &str,
) -> PyResult<Vec<BlockList<'a>>> {
    if let Some(firsts) = first_tokens {
        if firsts.len() != ids.len() {
            return Err(PyValueError::new_err(format!(
                "{side}_first_tokens has {} entries but {side}_blocks has {} groups",
                firsts.len(),
                ids.len()
            )));
        }
    }
    Ok(ids
        .iter()
        .enumerate()
        .map(|(g, ids)| BlockList { first_token: first_tokens.map_or(0, |f| f[g]), ids })
        .collect())
}

/// Plans writes from one P rank's layout (source) into one D rank's layout (destination).
#[pyclass(module = "kvpush._native.lab", frozen)]
#[derive(Debug)]
pub(crate) struct Planner(CorePlanner);

#[pymethods]
impl Planner {
    #[new]
    fn new(src: &KvLayout, dst: &KvLayout) -> PyResult<Self> {
        Ok(Self(CorePlanner::new(src.0.clone(), dst.0.clone()).map_err(Error::from)?))
    }

    #[getter]
    fn writes_anything(&self) -> bool {
        self.0.writes_anything()
    }

    #[pyo3(signature = (request, num_tokens, src_blocks, dst_blocks, *, src_first_tokens = None, dst_first_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        py: Python<'_>,
        request: String,
        num_tokens: u64,
        src_blocks: Groups,
        dst_blocks: Groups,
        src_first_tokens: Option<Vec<u64>>,
        dst_first_tokens: Option<Vec<u64>>,
    ) -> PyResult<Plan> {
        let src_ids = src_blocks.into_lists();
        let dst_ids = dst_blocks.into_lists();
        let src = block_lists(&src_ids, src_first_tokens.as_deref(), "src")?;
        let dst = block_lists(&dst_ids, dst_first_tokens.as_deref(), "dst")?;
        let req = PlanRequest { request: &request, num_tokens, src: &src, dst: &dst };
        Ok(Plan(native(py, || self.0.plan_compact(&req))?))
    }

    fn __repr__(&self) -> String {
        format!(
            "Planner(src tp {}/{}, dst tp {}/{}, writes_anything={})",
            self.0.src().tp_rank,
            self.0.src().tp_size,
            self.0.dst().tp_rank,
            self.0.dst().tp_size,
            self.0.writes_anything()
        )
    }
}

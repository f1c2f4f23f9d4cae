//! The transfer planner: from two layouts and two block lists to the (src, dst, len) runs to write.
//!
//! P (the source, local) writes one request's KV into D's (the destination, remote) blocks. A
//! [`Planner`] is built once per (P rank, D rank) pair: it checks both layouts, checks that they
//! describe the same model, and works out which KV heads the two ranks share. [`Planner::plan`]
//! then turns one request's block lists into [`DescriptorRun`]s in four steps:
//!
//! 1. **Validation.** Block ids come from a peer. Every list is checked for its start, its length,
//!    ids in range and duplicates before any address is computed; a bad list is refused with the
//!    request, side, group and value, and nothing of the request is planned.
//! 2. **Token-level translation.** The tokens D needs, `[dst.first_token, num_tokens)`, are walked
//!    in *segments* that stay inside one kernel block on both sides, so any pair of block sizes
//!    works (P 16 / D 32, P 32 / D 16, kernel blocks smaller than logical ones) and a partial last
//!    block writes only its valid tokens. P's leading blocks, which D already holds as a prefix
//!    cache hit, are skipped.
//! 3. **Head slicing.** Only the KV heads both ranks hold are written. With HND each head's tokens
//!    are contiguous, so a head slice is one run per head; with NHD the ranks must hold the same
//!    heads ([`Planner::new`] refuses anything else), and a token's heads are one run.
//! 4. **Merging.** Each run is merged into the previous one when it continues it on both sides, so
//!    consecutive blocks of a region, and the heads of a whole block, become one descriptor.
//!
//! Which kernel block and which byte a token's head lives at is [`crate::layout`]'s arithmetic;
//! this module only chains it.

use std::fmt;
use std::ops::Range;

use thiserror::Error;

use crate::layout::{KvLayout, LayoutError, TokenOrder};
use crate::transport::BlockArray;

/// Which of the two workers a value describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// P: the prefill worker, which holds the KV and writes it.
    Source,
    /// D: the decode worker, whose blocks receive it.
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "P (source)",
            Side::Destination => "D (destination)",
        })
    }
}

/// One KV cache group's logical block ids on one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockList<'a> {
    /// The first token of the first block; a multiple of the side's `block_tokens`.
    pub first_token: u64,
    /// Logical block ids: `ids[i]` holds tokens `[first_token + i * block_tokens, ...)`.
    pub ids: &'a [u32],
}

/// One request's blocks on both sides.
///
/// P lists its whole prompt (`first_token` 0, usually); D lists only the blocks it did not find
/// in its prefix cache, starting at its first uncached token. The tokens written are
/// `[dst[g].first_token, num_tokens)` of each group `g`; none where an empty list starts at or
/// past `num_tokens` (a group that holds none of the request's tokens).
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    /// The request's name, for errors.
    pub request: &'a str,
    /// Tokens in the request's prompt: everything P has computed KV for.
    pub num_tokens: u64,
    /// P's block lists, indexed by KV cache group ([`crate::layout::Region::group`]).
    pub src: &'a [BlockList<'a>],
    /// D's block lists, indexed by KV cache group.
    pub dst: &'a [BlockList<'a>],
}

/// One contiguous copy: `len` bytes from P's address `src` to D's address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorRun {
    /// Address in P's memory.
    pub src: u64,
    /// Address in D's memory.
    pub dst: u64,
    /// Bytes to copy; never 0.
    pub len: u64,
}

/// What one plan amounts to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Runs emitted, after merging.
    pub runs: usize,
    /// Runs a planner without merging would emit: one per region, segment and (HND) head.
    pub unmerged_runs: usize,
    /// Bytes written: the sum of the runs' lengths.
    pub bytes: u64,
}

/// The runs that write one request, and their statistics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The runs, in region order, then token order.
    pub runs: Vec<DescriptorRun>,
    /// Counts for metrics and logs.
    pub stats: PlanStats,
}

/// One request's runs before they are written out: each KV group's merged runs relative to a
/// region's bases (a *pattern*), and the regions that repeat them, in layout order.
///
/// Built by [`Planner::plan_compact`]; its statistics already count the runs after merging,
/// including a region's last run merging into the next region's first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactPlan {
    /// Every pattern's runs, relative to a region's (P, D) bases; patterns are ranges of it.
    relative: Vec<DescriptorRun>,
    /// The regions that write anything, in layout order.
    regions: Vec<PlacedPattern>,
    /// The statistics of the expanded plan.
    stats: PlanStats,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PlacedPattern {
    src_base: u64,
    dst_base: u64,
    pattern: Range<usize>,
}

impl CompactPlan {
    /// What the expanded plan amounts to.
    pub fn stats(&self) -> PlanStats {
        self.stats
    }

    /// Appends the runs, in region order and then token order, merged across region boundaries
    /// too; never merged with runs already in `out`. Appends exactly `stats().runs` runs.
    pub fn expand_into(&self, out: &mut Vec<DescriptorRun>) {
        out.reserve(self.stats.runs);
        let start = out.len();
        for placed in &self.regions {
            let Some(pattern) = self.relative.get(placed.pattern.clone()) else {
                continue; // unreachable: the range was taken from `relative`
            };
            let (src_base, dst_base) = (placed.src_base, placed.dst_base);
            let mut runs = pattern.iter().map(|run| DescriptorRun {
                // No overflow: every run lies inside a validated region (see `Planner`).
                src: src_base + run.src,
                dst: dst_base + run.dst,
                len: run.len,
            });
            // Runs inside a pattern are maximal already: only its first can continue the run
            // before it, the last of the previous region.
            if let Some(first) = runs.next() {
                let fresh = out.len() > start;
                match out.last_mut() {
                    Some(open)
                        if fresh
                            && open.src + open.len == first.src
                            && open.dst + open.len == first.dst =>
                    {
                        open.len += first.len;
                    }
                    _ => out.push(first),
                }
            }
            out.extend(runs);
        }
    }
}

/// How P's and D's layouts, each valid, differ so that one cannot be written into the other;
/// the text says how to make them agree.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Incompatibility {
    /// Different numbers of KV cache regions.
    #[error(
        "P has {p} KV cache regions and D has {d}; both must serve the same model (one region \
         per layer and K/V)"
    )]
    RegionCount {
        /// P's regions.
        p: usize,
        /// D's regions.
        d: usize,
    },
    /// A region belongs to different KV cache groups.
    #[error(
        "region {region} belongs to KV cache group {p} on P but {d} on D; both must serve the \
         same model with the same KV cache groups"
    )]
    RegionGroup {
        /// The first region that differs.
        region: usize,
        /// Its group on P.
        p: u32,
        /// Its group on D.
        d: u32,
    },
    /// Different bytes per KV head (head size or dtype).
    #[error(
        "a KV head is {p} bytes on P but {d} bytes on D; the head size and KV cache dtype must \
         match"
    )]
    HeadBytes {
        /// P's bytes per head.
        p: u32,
        /// D's bytes per head.
        d: u32,
    },
    /// Different models: the engines hold different numbers of KV heads in all.
    #[error(
        "P holds {p_heads} KV heads x tp={p_tp} and D {d_heads} x tp={d_tp}, which are different \
         models"
    )]
    Heads {
        /// KV heads per P rank.
        p_heads: u32,
        /// P's tensor parallel size.
        p_tp: u32,
        /// KV heads per D rank.
        d_heads: u32,
        /// D's tensor parallel size.
        d_tp: u32,
    },
    /// Different token orders (`VLLM_KV_CACHE_LAYOUT`).
    #[error("P uses the {p} layout and D {d}; set the same VLLM_KV_CACHE_LAYOUT on both")]
    TokenOrder {
        /// P's.
        p: TokenOrder,
        /// D's.
        d: TokenOrder,
    },
    /// Different tensor parallel sizes, which only the HND layout can serve.
    #[error(
        "P tp={p_tp} and D tp={d_tp} split heads differently; that needs the HND layout on both \
         sides (VLLM_KV_CACHE_LAYOUT=HND)"
    )]
    SplitNeedsHnd {
        /// P's tensor parallel size.
        p_tp: u32,
        /// D's tensor parallel size.
        d_tp: u32,
    },
}

/// Why a pair of layouts or a request cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// The two layouts are each valid but do not fit together.
    #[error("P and D cannot exchange KV: {reason}")]
    Incompatible {
        /// What differs, and how to make it agree.
        reason: Incompatibility,
    },
    /// One side's layout is invalid.
    #[error("the {side} KV cache layout is invalid: {source}")]
    Layout {
        /// Whose layout.
        side: Side,
        /// What is wrong with it.
        source: LayoutError,
    },
    /// A side sent block lists for the wrong number of KV cache groups.
    #[error(
        "request {request}: {side} sent block ids for {got} KV cache groups, but the model has \
         {expected}"
    )]
    GroupCount {
        /// The request.
        request: String,
        /// Whose lists.
        side: Side,
        /// Groups in the layouts.
        expected: usize,
        /// Lists sent.
        got: usize,
    },
    /// A list does not start on a block boundary.
    #[error(
        "request {request}: {side} group {group} starts at token {first_token}, which is not a \
         multiple of its block size {block_tokens}"
    )]
    UnalignedStart {
        /// The request.
        request: String,
        /// Whose list.
        side: Side,
        /// The KV cache group.
        group: usize,
        /// The list's first token.
        first_token: u64,
        /// The side's tokens per logical block.
        block_tokens: u32,
    },
    /// A list with blocks starts after the request's last token.
    #[error(
        "request {request}: {side} group {group} starts at token {first_token}, past the \
         request's {num_tokens} tokens"
    )]
    StartBeyondEnd {
        /// The request.
        request: String,
        /// Whose list.
        side: Side,
        /// The KV cache group.
        group: usize,
        /// The list's first token.
        first_token: u64,
        /// The request's token count.
        num_tokens: u64,
    },
    /// P's blocks start after the first token D needs.
    #[error(
        "request {request}: group {group}: P's blocks start at token {src_first_token} but D \
         needs tokens from {dst_first_token}; P must list its blocks from the prompt's start"
    )]
    SourceMissesTokens {
        /// The request.
        request: String,
        /// The KV cache group.
        group: usize,
        /// P's first token.
        src_first_token: u64,
        /// D's first token.
        dst_first_token: u64,
    },
    /// A list's length does not match the tokens it must hold.
    #[error(
        "request {request}: {side} group {group} lists {got} blocks, but its tokens need exactly \
         {expected}"
    )]
    BlockCountMismatch {
        /// The request.
        request: String,
        /// Whose list.
        side: Side,
        /// The KV cache group.
        group: usize,
        /// `ceil((num_tokens - first_token) / block_tokens)`.
        expected: u64,
        /// Ids in the list.
        got: usize,
    },
    /// A block id beyond the group's regions.
    #[error(
        "request {request}: {side} group {group} names block {block}, but the group's regions \
         hold only {limit} blocks"
    )]
    BlockOutOfRange {
        /// The request.
        request: String,
        /// Whose list.
        side: Side,
        /// The KV cache group.
        group: usize,
        /// The bad id.
        block: u32,
        /// Ids must be below this.
        limit: u32,
    },
    /// A block id listed twice: two token ranges would share (and overwrite) one block.
    #[error("request {request}: {side} group {group} names block {block} more than once")]
    DuplicateBlock {
        /// The request.
        request: String,
        /// Whose list.
        side: Side,
        /// The KV cache group.
        group: usize,
        /// The repeated id.
        block: u32,
    },
    /// A write of some regions (layer-wise push) names regions the layouts do not have.
    #[error(
        "request {request}: regions {start}..{end} asked for, but the layouts have {count} \
         regions"
    )]
    RegionsOutOfRange {
        /// The request.
        request: String,
        /// The first region asked for.
        start: usize,
        /// One past the last region asked for.
        end: usize,
        /// Regions in the layouts.
        count: usize,
    },
}

impl PlanError {
    /// A stable snake_case name of the error, for metrics and logs.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Incompatible { .. } => "incompatible_layouts",
            Self::Layout { .. } => "invalid_layout",
            Self::GroupCount { .. } => "group_count",
            Self::UnalignedStart { .. } => "unaligned_start",
            Self::StartBeyondEnd { .. } => "start_beyond_end",
            Self::SourceMissesTokens { .. } => "source_misses_tokens",
            Self::BlockCountMismatch { .. } => "block_count_mismatch",
            Self::BlockOutOfRange { .. } => "block_out_of_range",
            Self::DuplicateBlock { .. } => "duplicate_block",
            Self::RegionsOutOfRange { .. } => "regions_out_of_range",
        }
    }

    /// The request the error concerns; `None` for errors about the layouts themselves.
    pub fn request(&self) -> Option<&str> {
        match self {
            Self::Incompatible { .. } | Self::Layout { .. } => None,
            Self::GroupCount { request, .. }
            | Self::UnalignedStart { request, .. }
            | Self::StartBeyondEnd { request, .. }
            | Self::SourceMissesTokens { request, .. }
            | Self::BlockCountMismatch { request, .. }
            | Self::BlockOutOfRange { request, .. }
            | Self::DuplicateBlock { request, .. }
            | Self::RegionsOutOfRange { request, .. } => Some(request),
        }
    }
}

/// Plans the writes from one P rank to one D rank.
///
/// Invariant: both layouts passed [`KvLayout::validate`] and every id in a validated request is
/// below its group's block limits, so every address the planner computes lies inside a region
/// that `validate` proved addressable; the hot loops use plain arithmetic on that promise.
#[derive(Debug, Clone)]
pub struct Planner {
    src: KvLayout,
    dst: KvLayout,
    /// Per region, in layout order: the constants the inner loop needs from both sides.
    regions: Vec<RegionPair>,
    /// Per group: ids must be below these on each side (the smallest region of the group).
    limits: Vec<GroupLimits>,
    /// The model's KV heads both ranks hold.
    shared_heads: Range<u64>,
    /// Index of the first shared head among P's local heads.
    src_first_head: u64,
    /// Index of the first shared head among D's local heads.
    dst_first_head: u64,
    /// Both sides' kernel blocks as block tables, when the layouts match block for block.
    blocks: Option<BlockTables>,
}

/// P's and D's kernel blocks as [`BlockArray`] tables, one array per region, in layout order.
#[derive(Debug, Clone)]
struct BlockTables {
    src: Vec<BlockArray>,
    dst: Vec<BlockArray>,
    /// Per region: the table index of its kernel block 0, on P and on D.
    first: Vec<(u32, u32)>,
}

impl BlockTables {
    /// The tables, when every kernel block P writes is one whole kernel block of D's: same kernel
    /// block size, and both ranks hold exactly the heads they share (no head slicing). `None`
    /// otherwise, or when a table would hold more than `u32::MAX` blocks.
    fn new(src: &KvLayout, dst: &KvLayout, shared_heads: &Range<u64>) -> Option<Self> {
        let shared = shared_heads.end - shared_heads.start;
        let block_for_block = shared > 0
            && src.kernel_block_tokens == dst.kernel_block_tokens
            && shared == u64::from(src.heads)
            && shared == u64::from(dst.heads);
        if !block_for_block {
            return None;
        }
        let table = |layout: &KvLayout| -> Vec<BlockArray> {
            let len = layout.kernel_block_bytes();
            layout
                .regions
                .iter()
                .map(|r| BlockArray {
                    base: r.base,
                    stride: r.block_stride,
                    len,
                    count: r.num_blocks,
                })
                .collect()
        };
        let (src, dst) = (table(src), table(dst));
        let mut first = Vec::with_capacity(src.len());
        let (mut s, mut d) = (0u32, 0u32);
        for (src_array, dst_array) in src.iter().zip(&dst) {
            first.push((s, d));
            s = s.checked_add(src_array.count)?;
            d = d.checked_add(dst_array.count)?;
        }
        Some(Self { src, dst, first })
    }
}

/// One request's WRITE as block indices into the planner's [`Planner::block_tables`], filled by
/// [`Planner::block_indices_into`]; reused across requests so that filling it does not allocate
/// once it has grown.
#[derive(Debug, Clone, Default)]
pub struct BlockIndices {
    src: Vec<u32>,
    dst: Vec<u32>,
    /// Per group, the (P, D) kernel block pairs written, in token order.
    pairs: Vec<(u32, u32)>,
    /// Per group, its range of `pairs`.
    groups: Vec<Range<usize>>,
}

impl BlockIndices {
    /// Indices into P's table, one per block written, regions outside and tokens inside.
    pub fn src(&self) -> &[u32] {
        &self.src
    }

    /// Indices into D's table, pairwise with [`BlockIndices::src`].
    pub fn dst(&self) -> &[u32] {
        &self.dst
    }

    fn clear(&mut self) {
        self.src.clear();
        self.dst.clear();
        self.pairs.clear();
        self.groups.clear();
    }
}

#[derive(Debug, Clone, Copy)]
struct RegionPair {
    group: usize,
    src_base: u64,
    src_stride: u64,
    dst_base: u64,
    dst_stride: u64,
}

#[derive(Debug, Clone, Copy)]
struct GroupLimits {
    src: u32,
    dst: u32,
}

/// A stretch of tokens that lies inside one kernel block on both sides; the same for every region
/// of a group, so it is computed once per group and replayed per region.
#[derive(Debug, Clone, Copy)]
struct Segment {
    src_kernel: u64,
    /// Offset inside P's kernel block of the first shared head of the first token.
    src_offset: u64,
    dst_kernel: u64,
    dst_offset: u64,
    /// Runs to emit: one per shared head, or one when the heads are contiguous on both sides.
    pieces: u64,
    piece_len: u64,
}

/// One group's segments and what they add per region.
#[derive(Debug, Clone)]
struct GroupSegments {
    segments: Range<usize>,
    unmerged_per_region: usize,
    bytes_per_region: u64,
}

impl Planner {
    /// Checks both layouts and that P's KV can be written into D's, and precomputes the shared
    /// head slice and the per-region constants.
    ///
    /// Block sizes may differ freely between P and D. Tensor-parallel sizes may differ only when
    /// both sides use HND, where a head slice is contiguous.
    pub fn new(src: KvLayout, dst: KvLayout) -> Result<Self, PlanError> {
        src.validate().map_err(|source| PlanError::Layout { side: Side::Source, source })?;
        dst.validate().map_err(|source| PlanError::Layout { side: Side::Destination, source })?;
        check_compatible(&src, &dst).map_err(|reason| PlanError::Incompatible { reason })?;

        let (src_heads, dst_heads) = (src.global_heads(), dst.global_heads());
        let first = src_heads.start.max(dst_heads.start);
        let end = src_heads.end.min(dst_heads.end).max(first);
        let regions = src
            .regions
            .iter()
            .zip(&dst.regions)
            .map(|(s, d)| RegionPair {
                // validate() bounds group ids by the region count, so they fit in usize.
                group: usize::try_from(s.group).unwrap_or(usize::MAX),
                src_base: s.base,
                src_stride: s.block_stride,
                dst_base: d.base,
                dst_stride: d.block_stride,
            })
            .collect();
        let mut limits = vec![GroupLimits { src: u32::MAX, dst: u32::MAX }; src.num_groups()];
        for (s, d) in src.regions.iter().zip(&dst.regions) {
            if let Some(limit) = usize::try_from(s.group).ok().and_then(|g| limits.get_mut(g)) {
                limit.src = limit.src.min(src.logical_blocks(s));
                limit.dst = limit.dst.min(dst.logical_blocks(d));
            }
        }
        let shared_heads = first..end;
        Ok(Self {
            blocks: BlockTables::new(&src, &dst, &shared_heads),
            src_first_head: first - src_heads.start,
            dst_first_head: first - dst_heads.start,
            shared_heads,
            src,
            dst,
            regions,
            limits,
        })
    }

    /// Whether the two ranks share any KV head; when not, every plan is empty.
    pub fn writes_anything(&self) -> bool {
        !self.shared_heads.is_empty()
    }

    /// The model's KV heads (global indices) that this pair writes.
    pub fn shared_heads(&self) -> Range<u64> {
        self.shared_heads.clone()
    }

    /// P's layout.
    pub fn src(&self) -> &KvLayout {
        &self.src
    }

    /// D's layout.
    pub fn dst(&self) -> &KvLayout {
        &self.dst
    }

    /// P's and D's kernel blocks as block tables (one [`BlockArray`] per region, in layout
    /// order), when the layouts match block for block: the same kernel block size, and both
    /// ranks hold exactly the heads they share. Requests whose tokens end on a kernel block
    /// boundary then write whole blocks (see [`Planner::block_indices_into`]).
    pub fn block_tables(&self) -> Option<(&[BlockArray], &[BlockArray])> {
        self.blocks.as_ref().map(|t| (t.src.as_slice(), t.dst.as_slice()))
    }

    /// Fills `out` with `req`'s WRITE as pairs of indices into [`Planner::block_tables`] and
    /// returns `true`, when the layouts match block for block and `req`'s tokens end on a kernel
    /// block boundary; else empties `out` and returns `false` (a partial last block is written
    /// token by token, so only its runs describe it).
    ///
    /// The blocks the pairs name, copied in order, are exactly the bytes of `req`'s runs. Call it
    /// only for a request [`Planner::plan`] accepted: it relies on that validation.
    pub fn block_indices_into(&self, req: &PlanRequest<'_>, out: &mut BlockIndices) -> bool {
        self.block_indices_of_regions_into(req, 0..self.regions.len(), out)
    }

    /// [`block_indices_into`](Self::block_indices_into) for the regions `regions` only (as
    /// [`plan_regions`](Self::plan_regions) plans them); `false` also when the range is not
    /// inside the layouts'.
    pub fn block_indices_of_regions_into(
        &self,
        req: &PlanRequest<'_>,
        regions: Range<usize>,
        out: &mut BlockIndices,
    ) -> bool {
        out.clear();
        if self.fill_block_indices(req, regions, out).is_none() {
            out.clear();
            return false;
        }
        true
    }

    fn fill_block_indices(
        &self,
        req: &PlanRequest<'_>,
        regions: Range<usize>,
        out: &mut BlockIndices,
    ) -> Option<()> {
        let tables = self.blocks.as_ref()?;
        let chosen = self.regions.get(regions.clone())?;
        let firsts = tables.first.get(regions)?;
        let kernel = u64::from(self.src.kernel_block_tokens);
        if req.num_tokens % kernel != 0 || req.src.len() != self.limits.len() {
            return None;
        }
        for (src, dst) in req.src.iter().zip(req.dst) {
            let start = out.pairs.len();
            // D's first token starts one of its logical blocks, hence a kernel block on both
            // sides (the kernel block sizes are equal).
            let mut token = dst.first_token;
            while token < req.num_tokens {
                let (src_kernel, 0) = locate(&self.src, src, token)? else { return None };
                let (dst_kernel, 0) = locate(&self.dst, dst, token)? else { return None };
                out.pairs.push((u32::try_from(src_kernel).ok()?, u32::try_from(dst_kernel).ok()?));
                token += kernel;
            }
            out.groups.push(start..out.pairs.len());
        }
        let per_region = |r: &RegionPair| out.groups.get(r.group).map_or(0, |g| g.len());
        let total: usize = chosen.iter().map(per_region).sum();
        out.src.reserve(total);
        out.dst.reserve(total);
        for (region, &(src_first, dst_first)) in chosen.iter().zip(firsts) {
            let pairs = out.groups.get(region.group).and_then(|g| out.pairs.get(g.clone()))?;
            // No overflow: validated ids address kernel blocks inside the region, and the
            // table's size fits in u32 (`BlockTables::new`).
            out.src.extend(pairs.iter().map(|&(s, _)| src_first + s));
            out.dst.extend(pairs.iter().map(|&(_, d)| dst_first + d));
        }
        Some(())
    }

    /// Validates `req` and returns its runs.
    pub fn plan(&self, req: &PlanRequest<'_>) -> Result<Plan, PlanError> {
        self.plan_regions(req, 0..self.regions.len())
    }

    /// Validates `req` and returns the runs of the regions `regions` (layout order) alone: the
    /// runs [`plan`](Self::plan) writes into those regions, merged among themselves. Layer-wise
    /// push writes a layer's regions as soon as its KV is final; the plans of ranges that
    /// partition the layouts' regions write exactly what `plan` writes.
    pub fn plan_regions(
        &self,
        req: &PlanRequest<'_>,
        regions: Range<usize>,
    ) -> Result<Plan, PlanError> {
        let compact = self.plan_compact_regions(req, regions)?;
        let mut runs = Vec::new();
        compact.expand_into(&mut runs);
        Ok(Plan { runs, stats: compact.stats })
    }

    /// The number of regions in the layouts (the same on both sides).
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Of a plan of `regions` into D's lists `dst` (as [`Planner::plan_regions`] writes it),
    /// the bytes of the tokens before `token`: what a chunk's WRITE of lists narrowed by
    /// [`Planner::narrow_destination`] writes again of the chunks before it (`token` is
    /// `written`, at most the request's tokens).
    pub fn bytes_before(&self, dst: &[BlockList<'_>], token: u64, regions: Range<usize>) -> u64 {
        let token_bytes = (self.shared_heads.end - self.shared_heads.start)
            .saturating_mul(u64::from(self.src.head_bytes));
        let chosen = self.regions.get(regions).unwrap_or_default();
        chosen
            .iter()
            .map(|region| {
                let first = dst.get(region.group).map_or(token, |list| list.first_token);
                token.saturating_sub(first).saturating_mul(token_bytes)
            })
            .fold(0, u64::saturating_add)
    }

    /// D's lists `dst` narrowed to what a WRITE of P's KV of the tokens before `num_tokens`
    /// still owes once every token before `written` is in D: from the start of D's block that
    /// holds token `written - 1` (written again: P may have had only part of that block, and a
    /// block that moves whole carried P's scratch past it; even at a block boundary, since a
    /// connector whose blocks only move whole rounds a chunk's end up to its block's), or a
    /// list's own first token when that is later, up to `num_tokens`. Layer-wise push writes a
    /// prompt computed in chunks this way, chunk by chunk. A list that starts at or past
    /// `num_tokens` (a sliding window's blocks, after a chunk ending before the window) comes
    /// back empty: D needs none of this chunk's tokens in that group, and a plan writes none.
    pub fn narrow_destination<'a>(
        &self,
        dst: &[BlockList<'a>],
        written: u64,
        num_tokens: u64,
    ) -> Vec<BlockList<'a>> {
        // block_tokens is at least 1: the layout was validated.
        let block = u64::from(self.dst.block_tokens);
        let from = written.saturating_sub(1) / block * block;
        dst.iter()
            .map(|list| {
                if list.first_token >= num_tokens {
                    return BlockList { first_token: list.first_token, ids: &[] };
                }
                let first = from.max(list.first_token);
                let skip =
                    usize::try_from((first - list.first_token) / block).unwrap_or(usize::MAX);
                let keep =
                    usize::try_from((num_tokens - first).div_ceil(block)).unwrap_or(usize::MAX);
                let ids = list.ids.get(skip..).unwrap_or_default();
                BlockList { first_token: first, ids: &ids[..keep.min(ids.len())] }
            })
            .collect()
    }

    /// Validates `req` and appends its runs to `out`, so a caller can reuse one buffer.
    ///
    /// On error `out` is left as it was. Runs are never merged with runs already in `out`.
    pub fn plan_into(
        &self,
        req: &PlanRequest<'_>,
        out: &mut Vec<DescriptorRun>,
    ) -> Result<PlanStats, PlanError> {
        let compact = self.plan_compact(req)?;
        compact.expand_into(out);
        Ok(compact.stats)
    }

    /// Validates `req` and plans it without writing out every run: each group's runs are merged
    /// once, relative to a region's bases, and the regions that repeat them are listed. Its
    /// statistics are final; [`CompactPlan::expand_into`] writes the runs [`Planner::plan_into`]
    /// would.
    ///
    /// A request's runs are the same block pattern repeated in every region of its group (only
    /// the bases differ), so this costs O(blocks + regions) where the runs are O(blocks x
    /// regions).
    pub fn plan_compact(&self, req: &PlanRequest<'_>) -> Result<CompactPlan, PlanError> {
        self.plan_compact_regions(req, 0..self.regions.len())
    }

    fn plan_compact_regions(
        &self,
        req: &PlanRequest<'_>,
        regions: Range<usize>,
    ) -> Result<CompactPlan, PlanError> {
        self.validate(req)?;
        let Some(chosen) = self.regions.get(regions.clone()) else {
            return Err(PlanError::RegionsOutOfRange {
                request: req.request.to_owned(),
                start: regions.start,
                end: regions.end,
                count: self.regions.len(),
            });
        };
        let mut plan = CompactPlan::default();
        if !self.writes_anything() {
            return Ok(plan);
        }

        let mut segments = Vec::new();
        let groups: Vec<GroupSegments> = req
            .src
            .iter()
            .zip(req.dst)
            .map(|(src, dst)| self.push_segments(src, dst, req.num_tokens, &mut segments))
            .collect();

        // Patterns already built, by (group, P's block stride, D's block stride): merging depends
        // only on those, so regions that share them share one pattern.
        let mut built: Vec<((usize, u64, u64), Range<usize>)> = Vec::new();
        let mut last_end: Option<(u64, u64)> = None;
        // Regions outside, tokens inside: a region's consecutive blocks then follow each other in
        // the output and merge, and the last run of a region can merge with the next region's.
        for region in chosen {
            let Some(group) = groups.get(region.group) else {
                continue; // unreachable: validate() checked one list per group
            };
            plan.stats.unmerged_runs =
                plan.stats.unmerged_runs.saturating_add(group.unmerged_per_region);
            plan.stats.bytes = plan.stats.bytes.saturating_add(group.bytes_per_region);
            let key = (region.group, region.src_stride, region.dst_stride);
            let pattern = match built.iter().find(|(k, _)| *k == key) {
                Some((_, pattern)) => pattern.clone(),
                None => {
                    let group_segments = segments.get(group.segments.clone()).unwrap_or(&[]);
                    let pattern = self.push_pattern(region, group_segments, &mut plan.relative);
                    built.push((key, pattern.clone()));
                    pattern
                }
            };
            let (Some(first), Some(last)) = (
                plan.relative.get(pattern.start),
                pattern.end.checked_sub(1).and_then(|i| plan.relative.get(i)),
            ) else {
                continue; // nothing to write in this region
            };
            // No overflow: every run lies inside a validated region (see `Planner`).
            let continues =
                last_end == Some((region.src_base + first.src, region.dst_base + first.dst));
            plan.stats.runs += pattern.len() - usize::from(continues);
            last_end = Some((
                region.src_base + last.src + last.len,
                region.dst_base + last.dst + last.len,
            ));
            plan.regions.push(PlacedPattern {
                src_base: region.src_base,
                dst_base: region.dst_base,
                pattern,
            });
        }
        Ok(plan)
    }

    /// Checks every list of `req` against the layouts; nothing is planned unless all pass.
    fn validate(&self, req: &PlanRequest<'_>) -> Result<(), PlanError> {
        for (side, lists) in [(Side::Source, req.src), (Side::Destination, req.dst)] {
            if lists.len() != self.limits.len() {
                return Err(PlanError::GroupCount {
                    request: req.request.to_owned(),
                    side,
                    expected: self.limits.len(),
                    got: lists.len(),
                });
            }
        }
        // One bitset for every list's duplicate check.
        let mut seen = Vec::new();
        for (group, ((src, dst), limits)) in
            req.src.iter().zip(req.dst).zip(&self.limits).enumerate()
        {
            self.check_list(req, Side::Destination, group, dst, limits.dst, &mut seen)?;
            self.check_list(req, Side::Source, group, src, limits.src, &mut seen)?;
            // D needs tokens of the group only where its list starts before the request's end.
            if src.first_token > dst.first_token && dst.first_token < req.num_tokens {
                return Err(PlanError::SourceMissesTokens {
                    request: req.request.to_owned(),
                    group,
                    src_first_token: src.first_token,
                    dst_first_token: dst.first_token,
                });
            }
        }
        Ok(())
    }

    fn check_list(
        &self,
        req: &PlanRequest<'_>,
        side: Side,
        group: usize,
        list: &BlockList<'_>,
        limit: u32,
        seen: &mut Vec<u64>,
    ) -> Result<(), PlanError> {
        let request = || req.request.to_owned();
        let block_tokens = self.layout(side).block_tokens;
        // block_tokens is at least 1: the layout was validated.
        if list.first_token % u64::from(block_tokens) != 0 {
            return Err(PlanError::UnalignedStart {
                request: request(),
                side,
                group,
                first_token: list.first_token,
                block_tokens,
            });
        }
        let Some(tokens) = req.num_tokens.checked_sub(list.first_token) else {
            // An empty list past the end holds none of the request's tokens: a group whose
            // blocks all lie past a chunk's end (a sliding window's, layer-wise push).
            if list.ids.is_empty() {
                return Ok(());
            }
            return Err(PlanError::StartBeyondEnd {
                request: request(),
                side,
                group,
                first_token: list.first_token,
                num_tokens: req.num_tokens,
            });
        };
        let expected = tokens.div_ceil(u64::from(block_tokens));
        if u64::try_from(list.ids.len()) != Ok(expected) {
            return Err(PlanError::BlockCountMismatch {
                request: request(),
                side,
                group,
                expected,
                got: list.ids.len(),
            });
        }
        match find_bad_id(list.ids, limit, seen) {
            None => Ok(()),
            Some(BadId::OutOfRange(block)) => {
                Err(PlanError::BlockOutOfRange { request: request(), side, group, block, limit })
            }
            Some(BadId::Duplicate(block)) => {
                Err(PlanError::DuplicateBlock { request: request(), side, group, block })
            }
        }
    }

    fn layout(&self, side: Side) -> &KvLayout {
        match side {
            Side::Source => &self.src,
            Side::Destination => &self.dst,
        }
    }

    /// Appends the merged runs of `segments` in a region with `region`'s block strides, relative
    /// to its bases, to `out`; returns where they are.
    fn push_pattern(
        &self,
        region: &RegionPair,
        segments: &[Segment],
        out: &mut Vec<DescriptorRun>,
    ) -> Range<usize> {
        let start = out.len();
        let (src_head_stride, dst_head_stride) = (self.src.head_stride(), self.dst.head_stride());
        let mut runs = RunMerger::new(out);
        for segment in segments {
            // No overflow: the kernel index is below the region's block count (ids were checked
            // against it) and every piece stays inside one kernel block, all of which
            // `KvLayout::validate` proved addressable.
            let src = segment.src_kernel * region.src_stride + segment.src_offset;
            let dst = segment.dst_kernel * region.dst_stride + segment.dst_offset;
            for piece in 0..segment.pieces {
                runs.push(DescriptorRun {
                    src: src + piece * src_head_stride,
                    dst: dst + piece * dst_head_stride,
                    len: segment.piece_len,
                });
            }
        }
        runs.finish();
        start..out.len()
    }

    /// Appends the segments of one group's tokens `[dst.first_token, num_tokens)` to `out`.
    fn push_segments(
        &self,
        src: &BlockList<'_>,
        dst: &BlockList<'_>,
        num_tokens: u64,
        out: &mut Vec<Segment>,
    ) -> GroupSegments {
        let first_segment = out.len();
        let src_kernel_tokens = u64::from(self.src.kernel_block_tokens);
        let dst_kernel_tokens = u64::from(self.dst.kernel_block_tokens);
        let shared_heads = self.shared_heads.end - self.shared_heads.start;
        let head_bytes = u64::from(self.src.head_bytes);
        let hnd = self.src.token_order == TokenOrder::Hnd;

        let mut token = dst.first_token;
        while token < num_tokens {
            let (Some((src_kernel, src_token)), Some((dst_kernel, dst_token))) =
                (locate(&self.src, src, token), locate(&self.dst, dst, token))
            else {
                break; // unreachable: validate() checked that both lists cover these tokens
            };
            let tokens = (src_kernel_tokens - src_token)
                .min(dst_kernel_tokens - dst_token)
                .min(num_tokens - token);
            let whole_kernel_blocks = src_token == 0
                && dst_token == 0
                && tokens == src_kernel_tokens
                && tokens == dst_kernel_tokens;
            // NHD: the ranks hold the same heads (new() checks), so a token's heads are one run.
            // HND: each head's tokens are a run, and over whole kernel blocks on both sides the
            // shared heads' runs follow each other on both sides, so they are one run too.
            let (pieces, piece_len) = if hnd && !whole_kernel_blocks {
                (shared_heads, tokens * head_bytes)
            } else {
                (1, tokens * shared_heads * head_bytes)
            };
            out.push(Segment {
                src_kernel,
                src_offset: self.src.byte_offset(src_token, self.src_first_head),
                dst_kernel,
                dst_offset: self.dst.byte_offset(dst_token, self.dst_first_head),
                pieces,
                piece_len,
            });
            token += tokens;
        }

        let segments = out.len() - first_segment;
        let unmerged_per_segment = if hnd { shared_heads } else { 1 };
        let tokens = num_tokens.saturating_sub(dst.first_token);
        GroupSegments {
            segments: first_segment..out.len(),
            unmerged_per_region: segments
                .saturating_mul(usize::try_from(unmerged_per_segment).unwrap_or(usize::MAX)),
            bytes_per_region: tokens.saturating_mul(shared_heads).saturating_mul(head_bytes),
        }
    }
}

/// Why `dst` cannot receive `src`'s KV (see [`PlanError::Incompatible`]).
fn check_compatible(src: &KvLayout, dst: &KvLayout) -> Result<(), Incompatibility> {
    if src.regions.len() != dst.regions.len() {
        return Err(Incompatibility::RegionCount { p: src.regions.len(), d: dst.regions.len() });
    }
    if let Some((region, (s, d))) =
        src.regions.iter().zip(&dst.regions).enumerate().find(|(_, (s, d))| s.group != d.group)
    {
        return Err(Incompatibility::RegionGroup { region, p: s.group, d: d.group });
    }
    if src.head_bytes != dst.head_bytes {
        return Err(Incompatibility::HeadBytes { p: src.head_bytes, d: dst.head_bytes });
    }
    if src.total_heads() != dst.total_heads() {
        return Err(Incompatibility::Heads {
            p_heads: src.heads,
            p_tp: src.tp_size,
            d_heads: dst.heads,
            d_tp: dst.tp_size,
        });
    }
    if src.token_order != dst.token_order {
        return Err(Incompatibility::TokenOrder { p: src.token_order, d: dst.token_order });
    }
    if src.tp_size != dst.tp_size && src.token_order != TokenOrder::Hnd {
        return Err(Incompatibility::SplitNeedsHnd { p_tp: src.tp_size, d_tp: dst.tp_size });
    }
    Ok(())
}

/// Where `token` lives in `list`: its kernel block and its index inside that kernel block, or
/// `None` when the list does not hold it.
fn locate(layout: &KvLayout, list: &BlockList<'_>, token: u64) -> Option<(u64, u64)> {
    let block_tokens = u64::from(layout.block_tokens);
    let relative = token.checked_sub(list.first_token)?;
    let index = usize::try_from(relative.checked_div(block_tokens)?).ok()?;
    let block_id = *list.ids.get(index)?;
    Some(layout.kernel_slot(block_id, relative % block_tokens))
}

/// Appends maximal runs to a buffer: the run being built is held here (not re-read from the
/// buffer) and extended while the next run continues it on both sides.
struct RunMerger<'a> {
    out: &'a mut Vec<DescriptorRun>,
    open: Option<DescriptorRun>,
}

impl<'a> RunMerger<'a> {
    /// Starts a fresh run: nothing already in `out` is ever extended.
    fn new(out: &'a mut Vec<DescriptorRun>) -> Self {
        Self { out, open: None }
    }

    #[inline]
    fn push(&mut self, run: DescriptorRun) {
        if let Some(open) = &mut self.open {
            // No overflow: both ends lie inside validated regions (see `Planner`).
            if open.src + open.len == run.src && open.dst + open.len == run.dst {
                open.len += run.len;
                return;
            }
            self.out.push(*open);
        }
        self.open = Some(run);
    }

    /// Appends the run still being built.
    fn finish(self) {
        if let Some(open) = self.open {
            self.out.push(open);
        }
    }
}

enum BadId {
    OutOfRange(u32),
    Duplicate(u32),
}

/// Above this many bitset words per id, duplicates are found by sorting a copy instead: a peer
/// could name one huge id and make a bitset as large as its range.
const BITSET_WORDS_PER_ID: usize = 16;
/// Bitsets up to this many words (64 Ki block ids) are always fine.
const BITSET_WORDS_ALWAYS: usize = 1024;

/// The first id not below `limit`; else a repeated id (the first repeat in list order, or the
/// smallest repeated id when the ids are too sparse for a bitset). O(n) with the bitset.
fn find_bad_id(ids: &[u32], limit: u32, seen: &mut Vec<u64>) -> Option<BadId> {
    let mut max = 0;
    for &id in ids {
        if id >= limit {
            return Some(BadId::OutOfRange(id));
        }
        max = max.max(id);
    }
    if ids.len() < 2 {
        return None;
    }
    // u32 → usize is lossless on every target kvpush builds for (64-bit).
    let words = (max / 64) as usize + 1;
    if words > ids.len().saturating_mul(BITSET_WORDS_PER_ID).saturating_add(BITSET_WORDS_ALWAYS) {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        return sorted
            .windows(2)
            .find(|pair| pair[0] == pair[1])
            .map(|pair| BadId::Duplicate(pair[0]));
    }
    seen.clear();
    seen.resize(words, 0);
    for &id in ids {
        let bit = 1u64 << (id % 64);
        if let Some(word) = seen.get_mut((id / 64) as usize) {
            if *word & bit != 0 {
                return Some(BadId::Duplicate(id));
            }
            *word |= bit;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad_id(ids: &[u32], limit: u32) -> Option<(bool, u32)> {
        find_bad_id(ids, limit, &mut Vec::new()).map(|bad| match bad {
            BadId::OutOfRange(id) => (false, id),
            BadId::Duplicate(id) => (true, id),
        })
    }

    #[test]
    fn ids_are_checked_for_range_then_duplicates() {
        assert_eq!(bad_id(&[], 0), None);
        assert_eq!(bad_id(&[3, 1, 2], 4), None);
        assert_eq!(bad_id(&[3, 1, 4], 4), Some((false, 4)));
        assert_eq!(bad_id(&[3, 1, 1, 4], 4), Some((false, 4)));
        assert_eq!(bad_id(&[0, 7, 3, 7, 3], 8), Some((true, 7)));
        assert_eq!(bad_id(&[63, 64, 63], 65), Some((true, 63)));
    }

    #[test]
    fn sparse_ids_are_checked_without_a_huge_bitset() {
        let limit = u32::MAX;
        assert_eq!(bad_id(&[5, limit - 1, 9], limit), None);
        assert_eq!(bad_id(&[limit - 1, 5, limit - 1], limit), Some((true, limit - 1)));
    }

    #[test]
    fn side_names_the_role() {
        assert_eq!(Side::Source.to_string(), "P (source)");
        assert_eq!(Side::Destination.to_string(), "D (destination)");
    }

    #[test]
    fn runs_merge_only_when_continued_on_both_sides() {
        let run = |src, dst, len| DescriptorRun { src, dst, len };
        let mut out = vec![run(0, 100, 8)];
        let mut merger = RunMerger::new(&mut out);
        merger.push(run(8, 108, 8)); // continues what `out` held: not merged
        merger.push(run(16, 116, 4));
        merger.push(run(20, 200, 4)); // continues on P only
        merger.push(run(0, 204, 4)); // continues on D only
        merger.finish();
        assert_eq!(out, [run(0, 100, 8), run(8, 108, 12), run(20, 200, 4), run(0, 204, 4)]);
    }
}

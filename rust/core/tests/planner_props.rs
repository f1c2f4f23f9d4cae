//! The transfer planner against a naive copy.
//!
//! Every plan is applied as `memcpy`s between two byte buffers that stand for P's and D's memory
//! (addresses are offsets into them), and D's buffer must come out exactly as an independent
//! per-token, per-head copy written from the layout formulas leaves it: every byte that should
//! arrive arrives, and nothing else in D's memory is touched.

use std::time::Instant;

use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::planner::{
    BlockIndices, BlockList, DescriptorRun, Plan, PlanError, PlanRequest, Planner, Side,
};
use kvpush_core::transport::BlockArray;
use proptest::prelude::*;

/// D's bytes that no run should write.
const SENTINEL: u8 = 0xEE;

/// One side's block list, owned.
#[derive(Debug, Clone)]
struct List {
    first_token: u64,
    ids: Vec<u32>,
}

/// Two layouts and one request over them.
#[derive(Debug, Clone)]
struct Case {
    src: KvLayout,
    dst: KvLayout,
    num_tokens: u64,
    src_lists: Vec<List>,
    dst_lists: Vec<List>,
}

impl Case {
    fn planner(&self) -> Planner {
        Planner::new(self.src.clone(), self.dst.clone()).expect("generated layouts are compatible")
    }

    /// Runs `f` on the borrowed request.
    fn with_request<R>(&self, f: impl FnOnce(&PlanRequest<'_>) -> R) -> R {
        let (src, dst) = (borrowed(&self.src_lists), borrowed(&self.dst_lists));
        f(&PlanRequest { request: "req-7", num_tokens: self.num_tokens, src: &src, dst: &dst })
    }

    fn plan(&self) -> Result<Plan, PlanError> {
        let planner = self.planner();
        self.with_request(|req| planner.plan(req))
    }

    /// The heads both ranks hold, as global indices.
    fn shared_heads(&self) -> std::ops::Range<u64> {
        let (p, d) = (global_heads(&self.src), global_heads(&self.dst));
        p.start.max(d.start)..p.end.min(d.end).max(p.start.max(d.start))
    }

    /// P's memory with a distinct-looking byte everywhere, and D's memory all sentinel.
    fn buffers(&self) -> (Vec<u8>, Vec<u8>) {
        let src = (0..memory_size(&self.src)).map(pattern).collect();
        (src, vec![SENTINEL; memory_size(&self.dst)])
    }

    /// The naive copy: token by token, shared head by shared head, region by region.
    fn reference_copy(&self, src_mem: &[u8], dst_mem: &mut [u8]) {
        let head_bytes = self.src.head_bytes as usize;
        let (p_first, d_first) = (global_heads(&self.src).start, global_heads(&self.dst).start);
        for (p_region, d_region) in self.src.regions.iter().zip(&self.dst.regions) {
            let group = p_region.group as usize;
            let (p_list, d_list) = (&self.src_lists[group], &self.dst_lists[group]);
            for token in d_list.first_token..self.num_tokens {
                for head in self.shared_heads() {
                    let from = naive_address(&self.src, p_region, p_list, token, head - p_first);
                    let to = naive_address(&self.dst, d_region, d_list, token, head - d_first);
                    dst_mem[to..to + head_bytes].copy_from_slice(&src_mem[from..from + head_bytes]);
                }
            }
        }
    }

    /// P's memory while only the tokens before `cut` are computed: every slot of a token from
    /// `cut` on, to the end of P's last listed block, holds scratch (each byte inverted).
    fn scratch_from(&self, cut: u64, final_mem: &[u8]) -> Vec<u8> {
        let mut mem = final_mem.to_vec();
        let head_bytes = self.src.head_bytes as usize;
        let block_tokens = u64::from(self.src.block_tokens);
        for region in &self.src.regions {
            let list = &self.src_lists[region.group as usize];
            let end = list.first_token + list.ids.len() as u64 * block_tokens;
            for token in cut.max(list.first_token)..end {
                for head in 0..u64::from(self.src.heads) {
                    let at = naive_address(&self.src, region, list, token, head);
                    for byte in &mut mem[at..at + head_bytes] {
                        *byte = !*byte;
                    }
                }
            }
        }
        mem
    }

    /// Bytes a plan must write: tokens x shared heads x head bytes, per region.
    fn expected_bytes(&self) -> u64 {
        let shared = self.shared_heads().end - self.shared_heads().start;
        self.src
            .regions
            .iter()
            .map(|region| {
                let list = &self.dst_lists[region.group as usize];
                (self.num_tokens - list.first_token) * shared * u64::from(self.src.head_bytes)
            })
            .sum()
    }
}

fn borrowed(lists: &[List]) -> Vec<BlockList<'_>> {
    lists.iter().map(|list| BlockList { first_token: list.first_token, ids: &list.ids }).collect()
}

/// `[tp_rank * heads, (tp_rank + 1) * heads)`, written out here rather than borrowed from the
/// layout module, so the reference shares no code with the planner.
fn global_heads(layout: &KvLayout) -> std::ops::Range<u64> {
    let first = u64::from(layout.tp_rank) * u64::from(layout.heads);
    first..first + u64::from(layout.heads)
}

/// The address of one head of one token, straight from the layout's definition.
fn naive_address(layout: &KvLayout, region: &Region, list: &List, token: u64, head: u64) -> usize {
    let block_tokens = u64::from(layout.block_tokens);
    let kernel_tokens = u64::from(layout.kernel_block_tokens);
    let relative = token - list.first_token;
    let block = u64::from(list.ids[(relative / block_tokens) as usize]);
    let in_block = relative % block_tokens;
    let kernel = block * (block_tokens / kernel_tokens) + in_block / kernel_tokens;
    let in_kernel = in_block % kernel_tokens;
    let slot = match layout.token_order {
        TokenOrder::Nhd => in_kernel * u64::from(layout.heads) + head,
        TokenOrder::Hnd => head * kernel_tokens + in_kernel,
    };
    (region.base + kernel * region.block_stride + slot * u64::from(layout.head_bytes)) as usize
}

fn memory_size(layout: &KvLayout) -> usize {
    layout
        .regions
        .iter()
        .map(|r| (r.base + u64::from(r.num_blocks) * r.block_stride) as usize)
        .max()
        .unwrap_or(0)
}

/// A byte that differs from its neighbours' and rarely equals the sentinel, so a misplaced or
/// missing copy shows.
fn pattern(index: usize) -> u8 {
    let mut x = index as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (x ^ (x >> 31)) as u8
}

fn apply(runs: &[DescriptorRun], src_mem: &[u8], dst_mem: &mut [u8]) {
    for run in runs {
        let (src, dst, len) = (run.src as usize, run.dst as usize, run.len as usize);
        dst_mem[dst..dst + len].copy_from_slice(&src_mem[src..src + len]);
    }
}

/// The block pairs of a block form, as runs: block `k` of array `a` is `a`'s `k`-th block.
fn block_runs(tables: (&[BlockArray], &[BlockArray]), blocks: &BlockIndices) -> Vec<DescriptorRun> {
    let at = |table: &[BlockArray], mut index: u32| -> (u64, u64) {
        for array in table {
            if index < array.count {
                return (array.base + u64::from(index) * array.stride, array.len);
            }
            index -= array.count;
        }
        panic!("index past the table's end");
    };
    assert_eq!(blocks.src().len(), blocks.dst().len());
    blocks
        .src()
        .iter()
        .zip(blocks.dst())
        .map(|(&s, &d)| {
            let ((src, src_len), (dst, dst_len)) = (at(tables.0, s), at(tables.1, d));
            assert_eq!(src_len, dst_len, "a block pair of unequal lengths");
            DescriptorRun { src, dst, len: src_len }
        })
        .collect()
}

/// Whether `case`'s layouts match block for block and its tokens end on a kernel block boundary:
/// written out here, apart from the planner.
fn whole_blocks(case: &Case) -> bool {
    let shared = case.shared_heads().end - case.shared_heads().start;
    shared > 0
        && case.src.kernel_block_tokens == case.dst.kernel_block_tokens
        && shared == u64::from(case.src.heads)
        && shared == u64::from(case.dst.heads)
        && case.num_tokens % u64::from(case.src.kernel_block_tokens) == 0
}

/// Index of the first byte where two buffers differ.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

// ---------------------------------------------------------------------------------------------
// Generated cases
// ---------------------------------------------------------------------------------------------

/// The choices every other choice depends on.
#[derive(Debug, Clone, Copy)]
struct Shape {
    token_order: TokenOrder,
    head_bytes: u32,
    total_heads: u32,
    regions: usize,
    groups: usize,
    num_tokens: u64,
    p: SideShape,
    d: SideShape,
}

#[derive(Debug, Clone, Copy)]
struct SideShape {
    tp_size: u32,
    tp_rank: u32,
    block_tokens: u32,
    kernel_block_tokens: u32,
}

impl SideShape {
    /// Logical blocks a list of this side can need (a list from token 0).
    fn max_blocks(&self, num_tokens: u64) -> u64 {
        num_tokens.div_ceil(u64::from(self.block_tokens))
    }
}

/// Block size 1..32, a kernel size dividing it, a rank of `tp_size`.
fn side_shape(tp_size: u32) -> impl Strategy<Value = SideShape> {
    (0u32..=5, 0u32..=5, 0..tp_size).prop_map(move |(block_exp, kernel_shift, tp_rank)| {
        let block_tokens = 1 << block_exp;
        SideShape {
            tp_size,
            tp_rank,
            block_tokens,
            kernel_block_tokens: block_tokens >> (kernel_shift % (block_exp + 1)),
        }
    })
}

fn shape() -> impl Strategy<Value = Shape> {
    let tp = prop::sample::select(vec![1u32, 2, 4]);
    (tp.clone(), tp, any::<bool>(), 1u32..=4, 2u32..=8, 1usize..=6, 1usize..=3, 0u64..=80)
        .prop_flat_map(|(p_tp, d_tp, hnd, heads_unit, head_bytes, regions, groups, num_tokens)| {
            // NHD cannot slice heads, so NHD cases keep P's tensor-parallel size on D.
            let (token_order, d_tp) =
                if hnd { (TokenOrder::Hnd, d_tp) } else { (TokenOrder::Nhd, p_tp) };
            let total_heads = p_tp.max(d_tp) * heads_unit;
            (side_shape(p_tp), side_shape(d_tp)).prop_map(move |(p, d)| Shape {
                token_order,
                head_bytes,
                total_heads,
                regions,
                groups: groups.min(regions),
                num_tokens,
                p,
                d,
            })
        })
}

/// One side's memory choices: per group a shuffled pool of block ids, per region extra blocks,
/// stride padding, the gap before it, and the order regions are placed in memory.
#[derive(Debug, Clone)]
struct SideMemory {
    id_pools: Vec<Vec<u32>>,
    extra_blocks: Vec<u32>,
    padding: Vec<u64>,
    gaps: Vec<u64>,
    placement: Vec<usize>,
}

fn side_memory(shape: &Shape, side: SideShape) -> impl Strategy<Value = SideMemory> {
    // Three spare ids, so lists need not start at 0 or be dense.
    let pool_len = side.max_blocks(shape.num_tokens) as u32 + 3;
    let pool = Just((0..pool_len).collect::<Vec<u32>>()).prop_shuffle();
    // Often 0, so blocks and regions are sometimes back to back and runs can merge across them.
    let small = || prop_oneof![Just(0u64), 1u64..8];
    (
        prop::collection::vec(pool, shape.groups),
        prop::collection::vec(0u32..=2, shape.regions),
        prop::collection::vec(small(), shape.regions),
        prop::collection::vec(small(), shape.regions),
        Just((0..shape.regions).collect::<Vec<usize>>()).prop_shuffle(),
    )
        .prop_map(|(id_pools, extra_blocks, padding, gaps, placement)| SideMemory {
            id_pools,
            extra_blocks,
            padding,
            gaps,
            placement,
        })
}

fn layout(shape: &Shape, side: SideShape, memory: &SideMemory, groups: &[u32]) -> KvLayout {
    let heads = shape.total_heads / side.tp_size;
    let kernel_bytes = u64::from(side.kernel_block_tokens * heads * shape.head_bytes);
    let kernels_per_block = side.block_tokens / side.kernel_block_tokens;
    let logical = memory.id_pools[0].len() as u32;
    let mut regions: Vec<Region> = (0..shape.regions)
        .map(|i| Region {
            base: 0,
            block_stride: kernel_bytes + memory.padding[i],
            num_blocks: (logical + memory.extra_blocks[i]) * kernels_per_block,
            group: groups[i],
        })
        .collect();
    let mut next = 0;
    for &i in &memory.placement {
        regions[i].base = next + memory.gaps[i];
        next = regions[i].base + u64::from(regions[i].num_blocks) * regions[i].block_stride;
    }
    KvLayout {
        regions,
        block_tokens: side.block_tokens,
        kernel_block_tokens: side.kernel_block_tokens,
        heads,
        head_bytes: shape.head_bytes,
        token_order: shape.token_order,
        tp_rank: side.tp_rank,
        tp_size: side.tp_size,
    }
}

fn case() -> impl Strategy<Value = Case> {
    shape().prop_flat_map(|shape| {
        // Every group gets at least one region; the rest are spread at random.
        let groups =
            Just((0..shape.regions).map(|i| (i % shape.groups) as u32).collect::<Vec<u32>>())
                .prop_shuffle();
        let starts = prop::collection::vec((any::<u32>(), any::<u32>()), shape.groups);
        (groups, side_memory(&shape, shape.p), side_memory(&shape, shape.d), starts).prop_map(
            move |(groups, p_memory, d_memory, starts)| {
                let num_tokens = shape.num_tokens;
                let (p_tokens, d_tokens) =
                    (u64::from(shape.p.block_tokens), u64::from(shape.d.block_tokens));
                let mut src_lists = Vec::new();
                let mut dst_lists = Vec::new();
                for (group, (d_raw, p_raw)) in starts.into_iter().enumerate() {
                    // D's prefix hit is whole D blocks; P starts on a P block at or before it.
                    let dst_first = u64::from(d_raw) % (num_tokens / d_tokens + 1) * d_tokens;
                    let src_first = u64::from(p_raw) % (dst_first / p_tokens + 1) * p_tokens;
                    let list = |first: u64, block_tokens: u64, pool: &[u32]| List {
                        first_token: first,
                        ids: pool[..(num_tokens - first).div_ceil(block_tokens) as usize].to_vec(),
                    };
                    src_lists.push(list(src_first, p_tokens, &p_memory.id_pools[group]));
                    dst_lists.push(list(dst_first, d_tokens, &d_memory.id_pools[group]));
                }
                Case {
                    src: layout(&shape, shape.p, &p_memory, &groups),
                    dst: layout(&shape, shape.d, &d_memory, &groups),
                    num_tokens,
                    src_lists,
                    dst_lists,
                }
            },
        )
    })
}

/// Ways to spoil a valid request.
#[derive(Debug, Clone, Copy)]
enum Spoil {
    OutOfRange,
    Duplicate,
    OneBlockShort,
    OneBlockLong,
    MisalignedStart,
    MissingGroup,
}

/// The smallest logical block count among a group's regions: ids must be below it.
fn group_limit(layout: &KvLayout, group: usize) -> u32 {
    let per_block = layout.block_tokens / layout.kernel_block_tokens;
    layout
        .regions
        .iter()
        .filter(|r| r.group as usize == group)
        .map(|r| r.num_blocks / per_block)
        .min()
        .expect("every group has a region")
}

/// Spoils `case` on one side and group; returns the side and group an error must name, or
/// `None` when the spoilt request is refused before any one group is looked at.
fn spoil(case: &mut Case, how: Spoil, side: Side, group_raw: usize, at: usize) -> Option<usize> {
    let group = group_raw % case.src_lists.len();
    let (layout, lists) = match side {
        Side::Source => (&case.src, &mut case.src_lists),
        Side::Destination => (&case.dst, &mut case.dst_lists),
    };
    let limit = group_limit(layout, group);
    let block_tokens = u64::from(layout.block_tokens);
    let list = &mut lists[group];
    let len = list.ids.len();
    match how {
        Spoil::MissingGroup => {
            lists.pop();
            return None;
        }
        Spoil::OutOfRange if len > 0 => list.ids[at % len] = limit + (at as u32 % 3),
        Spoil::Duplicate if len > 1 => {
            let from = at % len;
            let to = (from + 1 + at / len % (len - 1)) % len;
            list.ids[to] = list.ids[from];
        }
        Spoil::OneBlockShort if len > 0 => {
            list.ids.pop();
        }
        Spoil::MisalignedStart if block_tokens > 1 => {
            list.first_token += 1 + at as u64 % (block_tokens - 1)
        }
        // Too few ids to spoil otherwise: one too many is always wrong.
        _ => list.ids.push(0),
    }
    Some(group)
}

/// The side and group an error names, if it names one.
fn site(error: &PlanError) -> Option<(Side, usize)> {
    match error {
        PlanError::UnalignedStart { side, group, .. }
        | PlanError::StartBeyondEnd { side, group, .. }
        | PlanError::BlockCountMismatch { side, group, .. }
        | PlanError::BlockOutOfRange { side, group, .. }
        | PlanError::DuplicateBlock { side, group, .. } => Some((*side, *group)),
        PlanError::SourceMissesTokens { group, .. } => Some((Side::Source, *group)),
        _ => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The plan writes exactly the bytes the naive copy writes, and nothing else.
    #[test]
    fn applied_plan_equals_naive_copy(case in case()) {
        let plan = case.plan().expect("a valid request plans");
        let (src_mem, dst_init) = case.buffers();
        let mut planned = dst_init.clone();
        apply(&plan.runs, &src_mem, &mut planned);
        let mut naive = dst_init;
        case.reference_copy(&src_mem, &mut naive);
        prop_assert_eq!(first_difference(&planned, &naive), None);
    }

    /// A request the planner gives as block indices is exactly the one that writes whole blocks
    /// of block-for-block layouts, and its blocks, copied, write exactly the plan's bytes.
    #[test]
    fn block_indices_write_the_plan_s_bytes(case in case()) {
        let planner = case.planner();
        let plan = case.plan().expect("a valid request plans");
        let mut blocks = BlockIndices::default();
        let given = case.with_request(|req| planner.block_indices_into(req, &mut blocks));
        prop_assert_eq!(given, whole_blocks(&case));
        if given {
            let tables = planner.block_tables().expect("tables come with indices");
            let (src_mem, dst_init) = case.buffers();
            let mut planned = dst_init.clone();
            apply(&plan.runs, &src_mem, &mut planned);
            let mut by_block = dst_init;
            apply(&block_runs(tables, &blocks), &src_mem, &mut by_block);
            prop_assert_eq!(first_difference(&planned, &by_block), None);
        } else {
            prop_assert!(blocks.src().is_empty() && blocks.dst().is_empty());
        }
    }

    /// Layer-wise push: the regions split anywhere, the two parts' plans (runs and block
    /// indices) write exactly what the whole plan writes, and the byte counts add up.
    #[test]
    fn plans_of_split_regions_write_the_whole_plan(case in case(), cut in any::<prop::sample::Index>()) {
        let planner = case.planner();
        let count = planner.region_count();
        let cut = cut.index(count + 1);
        let whole = case.plan().expect("a valid request plans");
        let (head, tail) = case.with_request(|req| {
            (planner.plan_regions(req, 0..cut), planner.plan_regions(req, cut..count))
        });
        let (head, tail) = (head.expect("plans"), tail.expect("plans"));
        prop_assert_eq!(head.stats.bytes + tail.stats.bytes, whole.stats.bytes);
        let (src_mem, dst_init) = case.buffers();
        let mut expected = dst_init.clone();
        apply(&whole.runs, &src_mem, &mut expected);
        let mut parts = dst_init.clone();
        apply(&head.runs, &src_mem, &mut parts);
        apply(&tail.runs, &src_mem, &mut parts);
        prop_assert_eq!(first_difference(&parts, &expected), None);

        let mut blocks = BlockIndices::default();
        if case.with_request(|req| planner.block_indices_into(req, &mut blocks)) {
            let tables = planner.block_tables().expect("tables come with indices");
            let mut by_block = dst_init;
            for range in [0..cut, cut..count] {
                let given = case.with_request(|req| {
                    planner.block_indices_of_regions_into(req, range, &mut blocks)
                });
                prop_assert!(given);
                apply(&block_runs(tables, &blocks), &src_mem, &mut by_block);
            }
            prop_assert_eq!(first_difference(&by_block, &expected), None);
        }
        let beyond = case.with_request(|req| planner.plan_regions(req, cut..count + 1));
        prop_assert!(
            matches!(beyond, Err(PlanError::RegionsOutOfRange { .. })),
            "a range past the layouts' regions is refused"
        );
    }

    /// Layer-wise push over a prompt computed in two chunks: the first chunk's plan (P's lists
    /// cut at its end, D's narrowed to it), written while P's KV past the cut is still scratch,
    /// then the rest's (D's lists narrowed past what the chunk wrote), leave D exactly as the
    /// whole plan does: whatever scratch the first wrote (a partial block, a block moved whole)
    /// the second writes over, and neither writes outside the whole plan's bytes. A cut before
    /// the tokens D needs of a group (a sliding window's) writes nothing of that group; P's list
    /// of it is then empty where the cut falls before P's first block too.
    #[test]
    fn plans_of_a_chunked_prompt_write_the_whole_plan(
        case in case(),
        cut in any::<prop::sample::Index>(),
    ) {
        prop_assume!(case.num_tokens > 1);
        let cut = 1 + cut.index((case.num_tokens - 1) as usize) as u64;
        let planner = case.planner();
        let block_tokens = u64::from(case.src.block_tokens);
        let chunk_lists: Vec<List> = case
            .src_lists
            .iter()
            .map(|l| List {
                first_token: l.first_token,
                ids: l.ids[..cut.saturating_sub(l.first_token).div_ceil(block_tokens) as usize]
                    .to_vec(),
            })
            .collect();
        let (src_chunk, src_all) = (borrowed(&chunk_lists), borrowed(&case.src_lists));
        let dst = borrowed(&case.dst_lists);
        let dst_chunk = planner.narrow_destination(&dst, 0, cut);
        let dst_rest = planner.narrow_destination(&dst, cut, case.num_tokens);
        let chunk = PlanRequest { request: "req-7", num_tokens: cut, src: &src_chunk, dst: &dst_chunk };
        let rest = PlanRequest {
            request: "req-7",
            num_tokens: case.num_tokens,
            src: &src_all,
            dst: &dst_rest,
        };
        let chunk = planner.plan(&chunk).expect("the chunk plans");
        let rest = planner.plan(&rest).expect("the rest plans");
        let whole = case.plan().expect("a valid request plans");
        // What the rest writes again is exactly what the two write past the whole plan.
        let again = planner.bytes_before(&dst_rest, cut, 0..planner.region_count());
        prop_assert_eq!(chunk.stats.bytes + rest.stats.bytes - again, whole.stats.bytes);
        let (src_final, dst_init) = case.buffers();
        let src_early = case.scratch_from(cut, &src_final);
        let mut expected = dst_init.clone();
        apply(&whole.runs, &src_final, &mut expected);
        let mut chunked = dst_init;
        apply(&chunk.runs, &src_early, &mut chunked);
        apply(&rest.runs, &src_final, &mut chunked);
        prop_assert_eq!(first_difference(&chunked, &expected), None);
    }

    /// Runs are disjoint on D, maximal (no two neighbours continue each other on both sides),
    /// and add up to exactly the request's tokens x shared heads x head bytes x regions.
    #[test]
    fn runs_are_disjoint_maximal_and_counted(case in case()) {
        let plan = case.plan().expect("a valid request plans");
        let total: u64 = plan.runs.iter().map(|run| run.len).sum();
        prop_assert!(plan.runs.iter().all(|run| run.len > 0));
        prop_assert_eq!(plan.stats.runs, plan.runs.len());
        prop_assert!(plan.stats.unmerged_runs >= plan.stats.runs);
        prop_assert_eq!(plan.stats.bytes, total);
        prop_assert_eq!(total, case.expected_bytes());
        for pair in plan.runs.windows(2) {
            let continues = pair[0].src + pair[0].len == pair[1].src
                && pair[0].dst + pair[0].len == pair[1].dst;
            prop_assert!(!continues, "unmerged neighbours {:?}", pair);
        }
        let mut by_dst = plan.runs.clone();
        by_dst.sort_by_key(|run| run.dst);
        for pair in by_dst.windows(2) {
            prop_assert!(pair[0].dst + pair[0].len <= pair[1].dst, "overlap on D {:?}", pair);
        }
    }

    /// A spoilt request is refused, names the request, side and group, and plans nothing.
    #[test]
    fn spoilt_requests_are_refused(
        case in case(),
        how in prop::sample::select(vec![
            Spoil::OutOfRange, Spoil::Duplicate, Spoil::OneBlockShort,
            Spoil::OneBlockLong, Spoil::MisalignedStart, Spoil::MissingGroup,
        ]),
        source in any::<bool>(),
        group in any::<usize>(),
        at in any::<usize>(),
    ) {
        let mut case = case;
        let side = if source { Side::Source } else { Side::Destination };
        let expected_group = spoil(&mut case, how, side, group, at);
        let planner = case.planner();
        let before = vec![DescriptorRun { src: 1, dst: 2, len: 3 }];
        let mut out = before.clone();
        let error = case
            .with_request(|req| planner.plan_into(req, &mut out))
            .expect_err("a spoilt request is refused");
        prop_assert_eq!(&out, &before);
        prop_assert!(error.to_string().contains("req-7"), "{}", error);
        match expected_group {
            Some(group) => {
                prop_assert_eq!(site(&error), Some((side, group)), "{}", error);
            }
            None => prop_assert!(matches!(error, PlanError::GroupCount { .. }), "{}", error),
        }
    }

    /// `plan_into` appends after what the buffer holds, never merging into it, and plans the
    /// same runs as `plan`.
    #[test]
    fn plan_into_appends(case in case()) {
        let planner = case.planner();
        let plan = case.with_request(|req| planner.plan(req)).expect("a valid request plans");
        // A run that the first planned run continues on both sides: it would be extended, were
        // merging across calls allowed.
        let mut out: Vec<DescriptorRun> = plan
            .runs
            .first()
            .filter(|run| run.src > 0 && run.dst > 0)
            .map(|run| DescriptorRun { src: run.src - 1, dst: run.dst - 1, len: 1 })
            .into_iter()
            .collect();
        let kept = out.clone();
        let stats = case
            .with_request(|req| planner.plan_into(req, &mut out))
            .expect("a valid request plans");
        prop_assert_eq!(stats, plan.stats);
        prop_assert_eq!(&out[..kept.len()], &kept[..]);
        prop_assert_eq!(&out[kept.len()..], &plan.runs[..]);
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-written cases
// ---------------------------------------------------------------------------------------------

/// A layout with one region per (base, stride, num_blocks), all in group 0.
fn simple_layout(
    regions: &[(u64, u64, u32)],
    block_tokens: u32,
    kernel_block_tokens: u32,
    heads: u32,
    head_bytes: u32,
    token_order: TokenOrder,
    (tp_rank, tp_size): (u32, u32),
) -> KvLayout {
    KvLayout {
        regions: regions
            .iter()
            .map(|&(base, block_stride, num_blocks)| Region {
                base,
                block_stride,
                num_blocks,
                group: 0,
            })
            .collect(),
        block_tokens,
        kernel_block_tokens,
        heads,
        head_bytes,
        token_order,
        tp_rank,
        tp_size,
    }
}

fn one_group(
    src: KvLayout,
    dst: KvLayout,
    num_tokens: u64,
    p: (u64, &[u32]),
    d: (u64, &[u32]),
) -> Case {
    let list = |(first_token, ids): (u64, &[u32])| List { first_token, ids: ids.to_vec() };
    Case { src, dst, num_tokens, src_lists: vec![list(p)], dst_lists: vec![list(d)] }
}

/// Plans `case`, checks it against the naive copy, and returns the runs as (src, dst, len).
fn checked_runs(case: &Case) -> Vec<(u64, u64, u64)> {
    let plan = case.plan().expect("a valid request plans");
    let (src_mem, dst_init) = case.buffers();
    let mut planned = dst_init.clone();
    apply(&plan.runs, &src_mem, &mut planned);
    let mut naive = dst_init;
    case.reference_copy(&src_mem, &mut naive);
    assert_eq!(first_difference(&planned, &naive), None, "plan differs from the naive copy");
    plan.runs.iter().map(|r| (r.src, r.dst, r.len)).collect()
}

const NHD: TokenOrder = TokenOrder::Nhd;
const HND: TokenOrder = TokenOrder::Hnd;

#[test]
fn p16_to_d32_fills_each_d_block_from_two_p_blocks() {
    // One head of one byte: addresses count tokens.
    let p = simple_layout(&[(0, 16, 3)], 16, 16, 1, 1, NHD, (0, 1));
    let d = simple_layout(&[(1000, 32, 2)], 32, 32, 1, 1, NHD, (0, 1));
    let case = one_group(p, d, 40, (0, &[1, 0, 2]), (0, &[1, 0]));
    // Tokens 0..16 from P block 1 and 16..32 from P block 0 into D block 1; the last 8 tokens,
    // a partial block, from P block 2 into D block 0.
    assert_eq!(checked_runs(&case), [(16, 1032, 16), (0, 1048, 16), (32, 1000, 8)]);
}

#[test]
fn p32_to_d16_splits_and_merges_back_when_d_blocks_are_consecutive() {
    let p = simple_layout(&[(0, 32, 2)], 32, 32, 1, 1, NHD, (0, 1));
    let d = simple_layout(&[(1000, 16, 4)], 16, 16, 1, 1, NHD, (0, 1));
    let scattered = one_group(p.clone(), d.clone(), 32, (0, &[1]), (0, &[3, 0]));
    assert_eq!(checked_runs(&scattered), [(32, 1048, 16), (48, 1000, 16)]);
    let consecutive = one_group(p, d, 32, (0, &[1]), (0, &[1, 2]));
    assert_eq!(checked_runs(&consecutive), [(32, 1016, 32)]);
}

#[test]
fn kernel_blocks_inside_a_logical_block_follow_the_stride() {
    let p = simple_layout(&[(0, 32, 2)], 32, 32, 1, 1, NHD, (0, 1));
    // D: logical blocks of 32 tokens are two kernel blocks of 16, padded to 20 bytes.
    let padded = simple_layout(&[(1000, 20, 4)], 32, 16, 1, 1, NHD, (0, 1));
    let case = one_group(p.clone(), padded, 32, (0, &[0]), (0, &[1]));
    assert_eq!(checked_runs(&case), [(0, 1040, 16), (16, 1060, 16)]);
    // Unpadded, the two kernel blocks are one run.
    let packed = simple_layout(&[(1000, 16, 4)], 32, 16, 1, 1, NHD, (0, 1));
    let case = one_group(p, packed, 32, (0, &[0]), (0, &[1]));
    assert_eq!(checked_runs(&case), [(0, 1032, 32)]);
}

#[test]
fn consecutive_blocks_and_regions_merge_into_one_run() {
    // K and V regions back to back on both sides, blocks consecutive: one run for everything.
    let p = simple_layout(&[(0, 8, 4), (32, 8, 4)], 4, 4, 2, 1, NHD, (0, 1));
    let d = simple_layout(&[(100, 8, 4), (132, 8, 4)], 4, 4, 2, 1, NHD, (0, 1));
    let case = one_group(p, d, 16, (0, &[0, 1, 2, 3]), (0, &[0, 1, 2, 3]));
    assert_eq!(checked_runs(&case), [(0, 100, 64)]);
}

#[test]
fn whole_blocks_of_matching_layouts_are_given_as_block_indices() {
    // Two regions of 4 blocks (2 tokens of 2 one-byte heads); D's blocks padded to 6 bytes.
    let p = simple_layout(&[(0, 4, 4), (16, 4, 4)], 2, 2, 2, 1, NHD, (0, 1));
    let d = simple_layout(&[(100, 6, 4), (124, 6, 4)], 2, 2, 2, 1, NHD, (0, 1));
    let case = one_group(p.clone(), d.clone(), 6, (0, &[3, 0, 2]), (2, &[1, 3]));
    let planner = case.planner();
    let (src, dst) = planner.block_tables().expect("the layouts match block for block");
    assert_eq!(src[1], BlockArray { base: 16, stride: 4, len: 4, count: 4 });
    assert_eq!(dst[1], BlockArray { base: 124, stride: 6, len: 4, count: 4 });
    let mut blocks = BlockIndices::default();
    assert!(case.with_request(|req| planner.block_indices_into(req, &mut blocks)));
    // D's tokens 2..6: P blocks 0 and 2 into D blocks 1 and 3, region by region.
    assert_eq!(blocks.src(), [0, 2, 4, 6]);
    assert_eq!(blocks.dst(), [1, 3, 5, 7]);
    checked_runs(&case);
    // A partial last block is written token by token: runs only.
    let partial = one_group(p.clone(), d, 5, (0, &[3, 0, 2]), (2, &[1, 3]));
    assert!(!partial.with_request(|req| planner.block_indices_into(req, &mut blocks)));
    assert!(blocks.src().is_empty());
    // Different kernel block sizes: no tables at all.
    let d16 = simple_layout(&[(100, 8, 4), (132, 8, 4)], 4, 4, 2, 1, NHD, (0, 1));
    assert!(Planner::new(p, d16).expect("compatible").block_tables().is_none());
}

#[test]
fn tail_trim_skips_the_blocks_d_already_has() {
    let p = simple_layout(&[(0, 16, 4)], 16, 16, 1, 1, NHD, (0, 1));
    let d = simple_layout(&[(1000, 16, 4)], 16, 16, 1, 1, NHD, (0, 1));
    // D has tokens 0..32 cached and registers only token 32 on: P's third block, 10 tokens.
    let case = one_group(p, d, 42, (0, &[3, 1, 2]), (32, &[0]));
    assert_eq!(checked_runs(&case), [(32, 1000, 10)]);
}

#[test]
fn full_prefix_hit_plans_nothing() {
    let p = simple_layout(&[(0, 16, 4)], 16, 16, 1, 1, NHD, (0, 1));
    let d = simple_layout(&[(1000, 16, 4)], 16, 16, 1, 1, NHD, (0, 1));
    let case = one_group(p, d, 32, (0, &[3, 1]), (32, &[]));
    let plan = case.plan().expect("a full hit is valid");
    assert!(plan.runs.is_empty());
    assert_eq!(plan.stats.bytes, 0);
}

#[test]
fn tp2_to_tp1_hnd_writes_each_p_rank_into_its_head_slice() {
    // Two heads of 1 byte per P rank, four on D; kernel blocks of 4 tokens: 8 bytes on P, 16 on D.
    let d = simple_layout(&[(1000, 16, 2)], 4, 4, 4, 1, HND, (0, 1));
    for rank in 0..2u32 {
        let p = simple_layout(&[(0, 8, 2)], 4, 4, 2, 1, HND, (rank, 2));
        // A whole block: P's two heads land as one run on D heads 2*rank, 2*rank+1.
        let case = one_group(p.clone(), d.clone(), 4, (0, &[1]), (0, &[0]));
        assert_eq!(checked_runs(&case), [(8, 1000 + 8 * u64::from(rank), 8)]);
        // Three tokens: one run per head.
        let case = one_group(p, d.clone(), 3, (0, &[1]), (0, &[0]));
        let head = 1000 + 8 * u64::from(rank);
        assert_eq!(checked_runs(&case), [(8, head, 3), (12, head + 4, 3)]);
    }
}

#[test]
fn tp1_to_tp2_hnd_sends_each_d_rank_its_heads() {
    let p = simple_layout(&[(0, 16, 2)], 4, 4, 4, 1, HND, (0, 1));
    for rank in 0..2u32 {
        let d = simple_layout(&[(1000, 8, 2)], 4, 4, 2, 1, HND, (rank, 2));
        let planner = Planner::new(p.clone(), d.clone()).expect("HND slices heads");
        assert_eq!(planner.shared_heads(), u64::from(2 * rank)..u64::from(2 * rank + 2));
        let case = one_group(p.clone(), d, 4, (0, &[0]), (0, &[1]));
        assert_eq!(checked_runs(&case), [(8 * u64::from(rank), 1008, 8)]);
    }
}

#[test]
fn ranks_without_common_heads_write_nothing_but_still_validate() {
    let p = simple_layout(&[(0, 8, 2)], 4, 4, 2, 1, HND, (0, 2));
    let d = simple_layout(&[(1000, 8, 2)], 4, 4, 2, 1, HND, (1, 2));
    let case = one_group(p, d, 4, (0, &[0]), (0, &[1]));
    assert!(!case.planner().writes_anything());
    assert!(case.plan().expect("valid").runs.is_empty());
    let mut bad = case.clone();
    bad.dst_lists[0].ids = vec![9];
    assert!(matches!(bad.plan(), Err(PlanError::BlockOutOfRange { block: 9, .. })));
}

#[test]
fn nhd_with_different_tp_sizes_is_refused_with_the_fix() {
    let p = simple_layout(&[(0, 8, 2)], 4, 4, 2, 1, NHD, (0, 2));
    let d = simple_layout(&[(1000, 16, 2)], 4, 4, 4, 1, NHD, (0, 1));
    let error = Planner::new(p, d).expect_err("NHD cannot slice heads");
    assert!(matches!(error, PlanError::Incompatible { .. }));
    let message = error.to_string();
    assert!(message.contains("P tp=2 and D tp=1"), "{message}");
    assert!(message.contains("VLLM_KV_CACHE_LAYOUT=HND"), "{message}");
}

#[test]
fn mismatched_models_are_refused() {
    let p = simple_layout(&[(0, 16, 2)], 4, 4, 4, 1, HND, (0, 1));
    let mut other = p.clone();
    other.head_bytes = 2;
    other.regions[0].block_stride = 32;
    let mut more_regions = p.clone();
    more_regions.regions.push(more_regions.regions[0]);
    let mut nhd = p.clone();
    nhd.token_order = NHD;
    for (d, needle) in [(other, "bytes"), (more_regions, "regions"), (nhd, "VLLM_KV_CACHE_LAYOUT")]
    {
        let error = Planner::new(p.clone(), d).expect_err("different models");
        assert!(error.to_string().contains(needle), "{error}");
    }
    let mut broken = p.clone();
    broken.kernel_block_tokens = 3;
    let error = Planner::new(p, broken).expect_err("invalid layout");
    assert!(matches!(error, PlanError::Layout { side: Side::Destination, .. }));
    assert!(error.to_string().contains("D (destination)"), "{error}");
}

#[test]
fn validation_errors_name_the_request_side_and_value() {
    let p = simple_layout(&[(0, 16, 8)], 16, 16, 1, 1, NHD, (0, 1));
    let d = simple_layout(&[(1000, 32, 4)], 32, 32, 1, 1, NHD, (0, 1));
    let good = one_group(p, d, 64, (0, &[0, 1, 2, 3]), (0, &[0, 1]));
    assert!(good.plan().is_ok());
    let check = |edit: &dyn Fn(&mut Case), needles: &[&str]| {
        let mut case = good.clone();
        edit(&mut case);
        let message = case.plan().expect_err("spoilt").to_string();
        for needle in ["req-7"].iter().chain(needles) {
            assert!(message.contains(needle), "{needle:?} missing from: {message}");
        }
    };
    check(&|c| c.dst_lists[0].ids[1] = 4, &["D (destination)", "group 0", "block 4", "only 4"]);
    check(&|c| c.src_lists[0].ids[3] = 1, &["P (source)", "block 1 more than once"]);
    check(
        &|c| {
            c.src_lists[0].ids.pop();
        },
        &["P (source)", "lists 3", "exactly 4"],
    );
    check(&|c| c.dst_lists[0].first_token = 16, &["D (destination)", "token 16", "block size 32"]);
    check(&|c| c.num_tokens = 70, &["D (destination)", "lists 2", "exactly 3"]);
    check(&|c| c.dst_lists.clear(), &["D (destination)", "0 KV cache groups", "has 1"]);
    check(
        &|c| {
            c.num_tokens = 32;
            c.dst_lists[0] = List { first_token: 64, ids: vec![1] };
        },
        &["D (destination)", "token 64", "32 tokens"],
    );
    // Empty, a list past the end holds none of the request's tokens: nothing is written.
    let mut before_window = good.clone();
    before_window.num_tokens = 32;
    before_window.src_lists[0] = List { first_token: 48, ids: vec![] };
    before_window.dst_lists[0] = List { first_token: 64, ids: vec![] };
    let plan = before_window.plan().expect("a group with nothing to write plans");
    assert_eq!((plan.runs.len(), plan.stats.bytes), (0, 0));
    check(
        &|c| {
            c.src_lists[0] = List { first_token: 48, ids: vec![3] };
            c.dst_lists[0] = List { first_token: 32, ids: vec![1] };
        },
        &["P's blocks start at token 48", "from 32"],
    );
}

/// Not a test of speed (tests never assert on time): prints how long planning one long,
/// fragmented request takes. `cargo test --release --test planner_props -- --ignored --nocapture`
#[test]
#[ignore = "timing printout; run in release with --ignored --nocapture"]
fn print_plan_timing() {
    const LAYERS: u64 = 64;
    const BLOCKS: u32 = 1000;
    let regions = |base: u64, stride: u64| -> Vec<(u64, u64, u32)> {
        (0..2 * LAYERS).map(|i| (base + i * stride * 4096, stride, 4096)).collect()
    };
    // Even blocks in a scrambled order (7919 and 2000 are coprime): no two blocks are adjacent,
    // so nothing merges across blocks.
    let ids =
        |offset: u32| -> Vec<u32> { (0..BLOCKS).map(|i| (i * 7919 + offset) % 2000 * 2).collect() };
    let (p_ids, d_ids) = (ids(0), ids(999));
    let tokens = |ids: &[u32], block: u64| ids.len() as u64 * block;
    let scenarios = [
        ("NHD, P16/D16, 8 heads x 256 B", NHD, (16, 16, 8, 1), (16, 16, 8, 1)),
        ("NHD, P16/D32", NHD, (16, 16, 8, 1), (32, 32, 8, 1)),
        ("HND, P tp2 -> D tp1, P16/D16", HND, (16, 16, 4, 2), (16, 16, 8, 1)),
    ];
    for (name, order, (pb, pk, ph, ptp), (db, dk, dh, dtp)) in scenarios {
        let p =
            simple_layout(&regions(0, u64::from(pk * ph * 256)), pb, pk, ph, 256, order, (0, ptp));
        let d = simple_layout(
            &regions(1 << 40, u64::from(dk * dh * 256)),
            db,
            dk,
            dh,
            256,
            order,
            (0, dtp),
        );
        let num_tokens = tokens(&p_ids, u64::from(pb)).min(tokens(&d_ids, u64::from(db)));
        let take = |ids: &[u32], block: u64| ids[..num_tokens.div_ceil(block) as usize].to_vec();
        let case = Case {
            src_lists: vec![List { first_token: 0, ids: take(&p_ids, u64::from(pb)) }],
            dst_lists: vec![List { first_token: 0, ids: take(&d_ids, u64::from(db)) }],
            num_tokens,
            src: p,
            dst: d,
        };
        let planner = case.planner();
        let mut out = Vec::new();
        let mut plan_once = || {
            out.clear();
            case.with_request(|req| planner.plan_into(req, &mut out)).expect("valid")
        };
        let stats = plan_once(); // warms up, and grows `out` to size once
                                 // The best of several batches: the machine may be busy with other work.
        let per_plan = (0..5)
            .map(|_| {
                let started = Instant::now();
                for _ in 0..20 {
                    plan_once();
                }
                started.elapsed() / 20
            })
            .min()
            .unwrap_or_default();
        println!("{name}: {num_tokens} tokens, {per_plan:?} per plan, {stats:?}");
    }
}

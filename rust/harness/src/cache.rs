//! A worker's KV memory for the harness: real bytes a loopback agent registers, laid out as
//! [`REGIONS`] regions (two KV cache groups) of HND kernel blocks, each region framed by guard
//! bytes that no layout names, so that a stray write shows wherever it lands.

use std::collections::HashSet;
use std::ops::Range;

use kvpush_core::layout::{KvLayout, Region, TokenOrder};
use kvpush_core::transport::{MemoryRegion, MemorySpace};

/// The KV cache group of each region: layers of two groups, as a hybrid model has.
const REGION_GROUPS: [u32; 4] = [0, 0, 1, 1];
pub(crate) const REGIONS: usize = REGION_GROUPS.len();
/// Guard bytes before each region and after the last.
const GUARD: usize = 64;

/// How a worker's KV cache is shaped (the parts the planner compares).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) heads: u32,
    pub(crate) head_bytes: u32,
    pub(crate) block_tokens: u32,
    pub(crate) num_blocks: u32,
    pub(crate) tp_rank: u32,
    pub(crate) tp_size: u32,
}

impl Shape {
    /// P's shape, and a D rank of the same engine size: two heads on one rank.
    pub(crate) const WHOLE: Self =
        Self { heads: 2, head_bytes: 8, block_tokens: 4, num_blocks: 16, tp_rank: 0, tp_size: 1 };

    fn block_bytes(&self) -> usize {
        (self.heads * self.head_bytes * self.block_tokens) as usize
    }
}

/// KV memory; see the module docs. Its address never changes; the agents that registered it
/// must be dropped before it is.
pub(crate) struct Cache {
    memory: Box<[u8]>,
    base: u64,
    shape: Shape,
    /// Offset of each region's first block.
    starts: Vec<usize>,
}

impl Cache {
    pub(crate) fn new(shape: Shape, fill: impl Fn(usize) -> u8) -> Self {
        let region = shape.block_bytes() * shape.num_blocks as usize;
        let starts: Vec<usize> = (0..REGIONS).map(|r| GUARD + r * (region + GUARD)).collect();
        let len = GUARD + REGIONS * (region + GUARD);
        let mut memory: Box<[u8]> = (0..len).map(fill).collect();
        // The agents write through this address; nothing reads `memory` until they are gone.
        let base = memory.as_mut_ptr() as u64;
        Self { memory, base, shape, starts }
    }

    pub(crate) fn shape(&self) -> Shape {
        self.shape
    }

    /// What a transport registers: the whole buffer, guards included, so that a WRITE into a
    /// guard is not refused by the transport but seen by [`Cache::strays`].
    pub(crate) fn region(&self) -> MemoryRegion {
        MemoryRegion { addr: self.base, len: self.memory.len() as u64, space: MemorySpace::DRAM }
    }

    pub(crate) fn layout(&self) -> KvLayout {
        let s = self.shape;
        KvLayout {
            regions: self
                .starts
                .iter()
                .zip(REGION_GROUPS)
                .map(|(&start, group)| Region {
                    base: self.base + start as u64,
                    block_stride: s.block_bytes() as u64,
                    num_blocks: s.num_blocks,
                    group,
                })
                .collect(),
            block_tokens: s.block_tokens,
            kernel_block_tokens: s.block_tokens,
            heads: s.heads,
            head_bytes: s.head_bytes,
            token_order: TokenOrder::Hnd,
            tp_rank: s.tp_rank,
            tp_size: s.tp_size,
        }
    }

    /// The absolute addresses of block `block` in every region of `group`.
    pub(crate) fn block_addresses(&self, group: u32, block: u32) -> Vec<Range<u64>> {
        if block >= self.shape.num_blocks {
            return Vec::new();
        }
        let size = self.shape.block_bytes();
        self.starts
            .iter()
            .zip(REGION_GROUPS)
            .filter(|&(_, g)| g == group)
            .map(|(&start, _)| {
                let at = self.base + (start + block as usize * size) as u64;
                at..at + size as u64
            })
            .collect()
    }

    /// Where the bytes that differ from `canary` outside the blocks in `allowed` ((group,
    /// block) pairs) are: each as "region r block b" or "guard", at most a few. Read only once
    /// every agent that could write here is gone.
    pub(crate) fn strays(&self, canary: u8, allowed: &HashSet<(u32, u32)>) -> Vec<String> {
        let size = self.shape.block_bytes();
        let mut inside = vec![false; self.memory.len()];
        for (&start, group) in self.starts.iter().zip(REGION_GROUPS) {
            for block in 0..self.shape.num_blocks {
                if allowed.contains(&(group, block)) {
                    let at = start + block as usize * size;
                    inside[at..at + size].iter_mut().for_each(|b| *b = true);
                }
            }
        }
        let mut found: Vec<String> = Vec::new();
        for (offset, (&byte, &allowed)) in self.memory.iter().zip(&inside).enumerate() {
            if allowed || byte == canary {
                continue;
            }
            let place = self.place(offset);
            if !found.contains(&place) {
                found.push(place);
                if found.len() == 4 {
                    break;
                }
            }
        }
        found
    }

    fn place(&self, offset: usize) -> String {
        let size = self.shape.block_bytes();
        let region_len = size * self.shape.num_blocks as usize;
        for (r, &start) in self.starts.iter().enumerate() {
            if (start..start + region_len).contains(&offset) {
                return format!(
                    "region {r} (group {}) block {}",
                    REGION_GROUPS[r],
                    (offset - start) / size
                );
            }
        }
        format!("a guard (byte {offset})")
    }
}

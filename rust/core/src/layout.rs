//! KV cache layouts: where each token's K and V bytes live in one worker's memory.
//!
//! A worker's KV cache is a list of [`Region`]s, one per layer and K/V half (or one per layer page
//! when K and V share a page, as with MLA). Each region is an array of *kernel* blocks:
//! kernel block `k` starts at `base + k * block_stride` and holds `kernel_block_tokens` tokens of
//! `heads` KV heads, `head_bytes` bytes each, ordered as [`TokenOrder`] says.
//!
//! The scheduler hands out *logical* blocks of `block_tokens` tokens; logical block `b` is the
//! kernel blocks `b * r .. (b + 1) * r` with `r = block_tokens / kernel_block_tokens`.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// How the bytes of one kernel block are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TokenOrder {
    /// `[tokens][heads][head_bytes]`: a token's heads are adjacent (vLLM's default `NHD`).
    Nhd,
    /// `[heads][tokens][head_bytes]`: a head's tokens are adjacent (`HND`); needed when P and D
    /// split heads differently (tensor parallel sizes differ), so a head slice is contiguous.
    Hnd,
}

/// One contiguous array of kernel blocks (one layer's K, V, or shared page).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Address of kernel block 0.
    pub base: u64,
    /// Bytes from one kernel block to the next; at least the block's own size (more when blocks
    /// are padded or K and V of one block are interleaved).
    pub block_stride: u64,
    /// Number of kernel blocks in the region.
    pub num_blocks: u32,
    /// The KV cache group (hybrid models) whose block ids address this region.
    pub group: u32,
}

/// Everything a planner needs to know about one worker's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// The regions, in the same order (layer by layer, K before V) on every worker of a model.
    pub regions: Vec<Region>,
    /// Tokens per logical block: the block size the scheduler allocates in.
    pub block_tokens: u32,
    /// Tokens per kernel block: the attention backend's block size; divides `block_tokens`.
    pub kernel_block_tokens: u32,
    /// KV heads held by this worker (its tensor-parallel share).
    pub heads: u32,
    /// Bytes of one head of one token: `head_dim * element size`.
    pub head_bytes: u32,
    /// Byte order inside a kernel block.
    pub token_order: TokenOrder,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// The engine's tensor-parallel size.
    pub tp_size: u32,
}

impl TokenOrder {
    /// The name vLLM uses for this order (`VLLM_KV_CACHE_LAYOUT`).
    pub fn as_str(self) -> &'static str {
        match self {
            TokenOrder::Nhd => "NHD",
            TokenOrder::Hnd => "HND",
        }
    }
}

impl fmt::Display for TokenOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a [`KvLayout`] cannot be planned against.
///
/// Layouts come from peers, so every one is checked once ([`KvLayout::validate`]) before any
/// address is computed from it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A size that must be positive is 0.
    #[error("{field} is 0; it must be at least 1")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A logical block is not a whole number of kernel blocks.
    #[error(
        "kernel_block_tokens {kernel_block_tokens} does not divide block_tokens {block_tokens}"
    )]
    KernelBlockDoesNotDivide {
        /// Tokens per logical block.
        block_tokens: u32,
        /// Tokens per kernel block.
        kernel_block_tokens: u32,
    },
    /// The rank is not one of the engine's ranks.
    #[error("tp_rank {tp_rank} is not below tp_size {tp_size}")]
    TpRankOutOfRange {
        /// The worker's rank.
        tp_rank: u32,
        /// The engine's tensor-parallel size.
        tp_size: u32,
    },
    /// `kernel_block_tokens * heads * head_bytes` does not fit in 64 bits.
    #[error(
        "a kernel block of {kernel_block_tokens} tokens x {heads} heads x {head_bytes} bytes \
         does not fit in 64 bits"
    )]
    KernelBlockTooLarge {
        /// Tokens per kernel block.
        kernel_block_tokens: u32,
        /// Heads per token.
        heads: u32,
        /// Bytes per head.
        head_bytes: u32,
    },
    /// The layout lists no region at all.
    #[error("the layout has no regions")]
    NoRegions,
    /// Consecutive kernel blocks of a region would overlap.
    #[error(
        "region {region}: block_stride {block_stride} is smaller than a kernel block \
         ({kernel_block_bytes} bytes)"
    )]
    StrideTooSmall {
        /// Index of the region in [`KvLayout::regions`].
        region: usize,
        /// The region's stride.
        block_stride: u64,
        /// The bytes one kernel block needs.
        kernel_block_bytes: u64,
    },
    /// The region ends in the middle of a logical block.
    #[error(
        "region {region}: {num_blocks} kernel blocks are not a whole number of logical blocks \
         of {kernels_per_block} kernel blocks"
    )]
    PartialLogicalBlock {
        /// Index of the region in [`KvLayout::regions`].
        region: usize,
        /// The region's kernel block count.
        num_blocks: u32,
        /// Kernel blocks per logical block.
        kernels_per_block: u32,
    },
    /// The region's last byte would lie beyond the 64-bit address space.
    #[error(
        "region {region}: {num_blocks} blocks of {block_stride} bytes from {base:#x} run past \
         the end of the 64-bit address space"
    )]
    AddressOverflow {
        /// Index of the region in [`KvLayout::regions`].
        region: usize,
        /// The region's base address.
        base: u64,
        /// The region's stride.
        block_stride: u64,
        /// The region's kernel block count.
        num_blocks: u32,
    },
    /// A group id too large for groups numbered `0..n` without gaps.
    #[error(
        "region {region} belongs to KV cache group {group}, but with {regions} regions the \
         groups can only be 0..{regions}"
    )]
    GroupOutOfRange {
        /// Index of the region in [`KvLayout::regions`].
        region: usize,
        /// The region's group.
        group: u32,
        /// How many regions the layout has.
        regions: usize,
    },
    /// Groups are not numbered `0..n` without gaps.
    #[error(
        "no region belongs to KV cache group {group}, but a higher group has regions; groups \
         must be numbered 0, 1, ... without gaps"
    )]
    MissingGroup {
        /// The group without regions.
        group: u32,
    },
}

impl KvLayout {
    /// Checks everything the planner's arithmetic relies on.
    ///
    /// On a valid layout, for every region and every kernel block `k < num_blocks`, every byte
    /// address `base + k * block_stride + o` with `o < kernel_block_bytes()` fits in a `u64`:
    /// the planner's inner loop does plain arithmetic on that promise.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (field, value) in [
            ("block_tokens", self.block_tokens),
            ("kernel_block_tokens", self.kernel_block_tokens),
            ("heads", self.heads),
            ("head_bytes", self.head_bytes),
            ("tp_size", self.tp_size),
        ] {
            if value == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        if self.block_tokens % self.kernel_block_tokens != 0 {
            return Err(LayoutError::KernelBlockDoesNotDivide {
                block_tokens: self.block_tokens,
                kernel_block_tokens: self.kernel_block_tokens,
            });
        }
        if self.tp_rank >= self.tp_size {
            return Err(LayoutError::TpRankOutOfRange {
                tp_rank: self.tp_rank,
                tp_size: self.tp_size,
            });
        }
        let kernel_block_bytes = u64::from(self.kernel_block_tokens)
            .checked_mul(self.token_bytes())
            .ok_or(LayoutError::KernelBlockTooLarge {
                kernel_block_tokens: self.kernel_block_tokens,
                heads: self.heads,
                head_bytes: self.head_bytes,
            })?;
        if self.regions.is_empty() {
            return Err(LayoutError::NoRegions);
        }
        let kernels_per_block = self.kernels_per_block();
        // Group ids index per-group tables, so they must be dense; a group id below the region
        // count also keeps this table (and the planner's) no larger than the region list.
        let mut group_has_region = vec![false; self.regions.len()];
        for (index, region) in self.regions.iter().enumerate() {
            if region.block_stride < kernel_block_bytes {
                return Err(LayoutError::StrideTooSmall {
                    region: index,
                    block_stride: region.block_stride,
                    kernel_block_bytes,
                });
            }
            if region.num_blocks % kernels_per_block != 0 {
                return Err(LayoutError::PartialLogicalBlock {
                    region: index,
                    num_blocks: region.num_blocks,
                    kernels_per_block,
                });
            }
            // The end of the last block (at most `num_blocks * block_stride` from the base,
            // since the stride covers a block) must be addressable.
            u64::from(region.num_blocks)
                .checked_mul(region.block_stride)
                .and_then(|span| region.base.checked_add(span))
                .ok_or(LayoutError::AddressOverflow {
                    region: index,
                    base: region.base,
                    block_stride: region.block_stride,
                    num_blocks: region.num_blocks,
                })?;
            let seen = usize::try_from(region.group)
                .ok()
                .and_then(|group| group_has_region.get_mut(group))
                .ok_or(LayoutError::GroupOutOfRange {
                    region: index,
                    group: region.group,
                    regions: self.regions.len(),
                })?;
            *seen = true;
        }
        let groups = self.num_groups();
        if let Some(group) = group_has_region.iter().take(groups).position(|seen| !seen) {
            return Err(LayoutError::MissingGroup {
                group: u32::try_from(group).unwrap_or(u32::MAX),
            });
        }
        Ok(())
    }

    /// Kernel blocks per logical block (`block_tokens / kernel_block_tokens`); 0 when
    /// `kernel_block_tokens` is 0 (an invalid layout).
    pub fn kernels_per_block(&self) -> u32 {
        self.block_tokens.checked_div(self.kernel_block_tokens).unwrap_or(0)
    }

    /// Bytes of one token's heads on this worker (`heads * head_bytes`).
    pub fn token_bytes(&self) -> u64 {
        u64::from(self.heads) * u64::from(self.head_bytes)
    }

    /// Bytes one kernel block occupies (`kernel_block_tokens * heads * head_bytes`); saturates
    /// on a layout that [`validate`](Self::validate) refuses.
    pub fn kernel_block_bytes(&self) -> u64 {
        u64::from(self.kernel_block_tokens).saturating_mul(self.token_bytes())
    }

    /// Logical blocks in `region`: block ids for its group must be below this.
    pub fn logical_blocks(&self, region: &Region) -> u32 {
        region.num_blocks.checked_div(self.kernels_per_block()).unwrap_or(0)
    }

    /// Number of KV cache groups: one more than the highest group id (0 without regions).
    pub fn num_groups(&self) -> usize {
        self.regions
            .iter()
            .map(|region| region.group)
            .max()
            .map_or(0, |group| usize::try_from(u64::from(group) + 1).unwrap_or(usize::MAX))
    }

    /// KV heads of the whole model (`heads * tp_size`), the same on every rank of both engines.
    pub fn total_heads(&self) -> u64 {
        u64::from(self.heads) * u64::from(self.tp_size)
    }

    /// The model's KV heads this rank holds: `[tp_rank * heads, (tp_rank + 1) * heads)`.
    pub fn global_heads(&self) -> Range<u64> {
        let first = u64::from(self.tp_rank) * u64::from(self.heads);
        first..first + u64::from(self.heads)
    }

    /// Where token `token_in_block` of logical block `block_id` lives: the kernel block's index
    /// in every region of the block's group, and the token's index inside that kernel block.
    pub fn kernel_slot(&self, block_id: u32, token_in_block: u64) -> (u64, u64) {
        let kernel_tokens = u64::from(self.kernel_block_tokens);
        let kernel = u64::from(block_id)
            .saturating_mul(u64::from(self.kernels_per_block()))
            .saturating_add(token_in_block.checked_div(kernel_tokens).unwrap_or(0));
        (kernel, token_in_block.checked_rem(kernel_tokens).unwrap_or(0))
    }

    /// Offset inside a kernel block of this worker's local head `head` of token `token` (the
    /// token's index inside the kernel block). Saturates on an invalid layout.
    pub fn byte_offset(&self, token: u64, head: u64) -> u64 {
        let head_bytes = u64::from(self.head_bytes);
        let slot = match self.token_order {
            TokenOrder::Nhd => token.saturating_mul(u64::from(self.heads)).saturating_add(head),
            TokenOrder::Hnd => {
                head.saturating_mul(u64::from(self.kernel_block_tokens)).saturating_add(token)
            }
        };
        slot.saturating_mul(head_bytes)
    }

    /// Bytes from one head of a token to the next head of the same token inside a kernel block.
    pub fn head_stride(&self) -> u64 {
        match self.token_order {
            TokenOrder::Nhd => u64::from(self.head_bytes),
            TokenOrder::Hnd => {
                u64::from(self.kernel_block_tokens).saturating_mul(u64::from(self.head_bytes))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two regions of 8 kernel blocks (4 logical blocks of 2 kernel blocks), group 0.
    fn layout(token_order: TokenOrder) -> KvLayout {
        KvLayout {
            regions: vec![
                Region { base: 0x1000, block_stride: 64, num_blocks: 8, group: 0 },
                Region { base: 0x2000, block_stride: 80, num_blocks: 8, group: 0 },
            ],
            block_tokens: 8,
            kernel_block_tokens: 4,
            heads: 2,
            head_bytes: 8,
            token_order,
            tp_rank: 1,
            tp_size: 2,
        }
    }

    fn error_of(edit: impl FnOnce(&mut KvLayout)) -> LayoutError {
        let mut layout = layout(TokenOrder::Hnd);
        edit(&mut layout);
        layout.validate().expect_err("the edit makes the layout invalid")
    }

    #[test]
    fn derived_sizes() {
        let layout = layout(TokenOrder::Nhd);
        assert_eq!(layout.validate(), Ok(()));
        assert_eq!(layout.kernels_per_block(), 2);
        assert_eq!(layout.token_bytes(), 16);
        assert_eq!(layout.kernel_block_bytes(), 64);
        assert_eq!(layout.logical_blocks(&layout.regions[0]), 4);
        assert_eq!(layout.num_groups(), 1);
        assert_eq!(layout.total_heads(), 4);
        assert_eq!(layout.global_heads(), 2..4);
    }

    #[test]
    fn token_and_head_offsets_follow_the_order() {
        // Token 5 of logical block 3: kernel block 3 * 2 + 1, token 1 inside it.
        assert_eq!(layout(TokenOrder::Nhd).kernel_slot(3, 5), (7, 1));
        // NHD: [tokens][heads][bytes]; HND: [heads][tokens][bytes].
        assert_eq!(layout(TokenOrder::Nhd).byte_offset(3, 1), (3 * 2 + 1) * 8);
        assert_eq!(layout(TokenOrder::Hnd).byte_offset(3, 1), (4 + 3) * 8);
        assert_eq!(layout(TokenOrder::Nhd).head_stride(), 8);
        assert_eq!(layout(TokenOrder::Hnd).head_stride(), 32);
    }

    #[test]
    fn zero_sizes_are_refused_by_name() {
        assert_eq!(error_of(|l| l.head_bytes = 0), LayoutError::Zero { field: "head_bytes" });
        assert_eq!(
            error_of(|l| l.kernel_block_tokens = 0).to_string(),
            "kernel_block_tokens is 0; it must be at least 1"
        );
    }

    #[test]
    fn invalid_geometry_is_refused() {
        assert!(matches!(
            error_of(|l| l.kernel_block_tokens = 3),
            LayoutError::KernelBlockDoesNotDivide { .. }
        ));
        assert!(matches!(
            error_of(|l| l.tp_rank = 2),
            LayoutError::TpRankOutOfRange { tp_rank: 2, tp_size: 2 }
        ));
        assert!(matches!(
            error_of(|l| {
                l.block_tokens = u32::MAX;
                l.kernel_block_tokens = u32::MAX;
                l.heads = u32::MAX;
                l.head_bytes = 2;
            }),
            LayoutError::KernelBlockTooLarge { .. }
        ));
        assert_eq!(error_of(|l| l.regions.clear()), LayoutError::NoRegions);
    }

    #[test]
    fn invalid_regions_are_refused_with_their_index() {
        assert_eq!(
            error_of(|l| l.regions[1].block_stride = 63),
            LayoutError::StrideTooSmall { region: 1, block_stride: 63, kernel_block_bytes: 64 }
        );
        assert!(matches!(
            error_of(|l| l.regions[0].num_blocks = 7),
            LayoutError::PartialLogicalBlock { region: 0, .. }
        ));
        assert!(matches!(
            error_of(|l| l.regions[1].base = u64::MAX - 8 * 80 + 1),
            LayoutError::AddressOverflow { region: 1, .. }
        ));
        // Ending exactly at the top of the address space is fine.
        let mut top = layout(TokenOrder::Hnd);
        top.regions[1].base = u64::MAX - 8 * 80;
        assert_eq!(top.validate(), Ok(()));
    }

    #[test]
    fn groups_must_be_numbered_without_gaps() {
        assert_eq!(
            error_of(|l| l.regions[1].group = 2),
            LayoutError::GroupOutOfRange { region: 1, group: 2, regions: 2 }
        );
        assert_eq!(
            error_of(|l| {
                l.regions[0].group = 1;
                l.regions[1].group = 1;
            }),
            LayoutError::MissingGroup { group: 0 }
        );
        let mut two = layout(TokenOrder::Hnd);
        two.regions[1].group = 1;
        assert_eq!(two.validate(), Ok(()));
        assert_eq!(two.num_groups(), 2);
    }
}

//! KV cache layouts: where each token's K and V bytes live in one worker's memory.
//!
//! A worker's KV cache is a list of [`Region`]s, one per layer and K/V half (or one per layer page
//! when K and V share a page, as with MLA). Each region is an array of *kernel* blocks:
//! kernel block `k` starts at `base + k * block_stride` and holds `kernel_block_tokens` tokens of
//! `heads` KV heads, `head_bytes` bytes each, ordered as [`TokenOrder`] says.
//!
//! The scheduler hands out *logical* blocks of `block_tokens` tokens; logical block `b` is the
//! kernel blocks `b * r .. (b + 1) * r` with `r = block_tokens / kernel_block_tokens`.

use serde::{Deserialize, Serialize};

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

//! Fixtures shared by the criterion benches: KV layouts and block lists shaped like real
//! requests, and the baseline the rendezvous table is measured against.

use std::collections::HashMap;
use std::sync::Mutex;

use kvpush_core::layout::{KvLayout, Region, TokenOrder};

/// A layout of `layers` layers (K and V regions each) of `num_blocks` blocks, bf16 heads of 128.
pub fn layout(
    layers: usize,
    num_blocks: u32,
    block_tokens: u32,
    heads: u32,
    order: TokenOrder,
    tp: (u32, u32),
) -> KvLayout {
    let head_bytes = 128 * 2;
    let block_bytes = u64::from(block_tokens) * u64::from(heads) * u64::from(head_bytes);
    let region_bytes = block_bytes * u64::from(num_blocks);
    KvLayout {
        regions: (0..2 * layers as u64)
            .map(|i| Region {
                base: 0x1000_0000 + i * region_bytes,
                block_stride: block_bytes,
                num_blocks,
                group: 0,
            })
            .collect(),
        block_tokens,
        kernel_block_tokens: block_tokens,
        heads,
        head_bytes,
        token_order: order,
        tp_rank: tp.0,
        tp_size: tp.1,
    }
}

/// `count` block ids out of `0..capacity`: consecutive (`contiguous`), or every other block in a
/// scrambled order, so no two neighbours in the list are neighbours in memory (a long-running
/// engine's free list).
pub fn block_ids(count: u32, capacity: u32, contiguous: bool) -> Vec<u32> {
    assert!(2 * count <= capacity, "fixture needs twice as many blocks as it lists");
    if contiguous {
        return (0..count).collect();
    }
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut ids: Vec<u32> = (0..count).map(|i| 2 * i).collect();
    for i in (1..ids.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = (state % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids
}

/// The simplest correct rendezvous: one `Mutex<HashMap>` holding whichever half came first.
/// Single-epoch, no deadlines or fences: a lower bound on what any table must do.
#[derive(Debug, Default)]
pub struct MutexTable<R, K> {
    pending: Mutex<HashMap<String, Half<R, K>>>,
}

#[derive(Debug)]
enum Half<R, K> {
    Registration(R),
    Ready(K),
}

impl<R, K> MutexTable<R, K> {
    /// D's half; returns both halves when P's was waiting.
    pub fn register(&self, key: &str, registration: R) -> Option<(R, K)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        match pending.remove(key) {
            Some(Half::Ready(ready)) => Some((registration, ready)),
            Some(other) => {
                pending.insert(key.to_owned(), other);
                None
            }
            None => {
                pending.insert(key.to_owned(), Half::Registration(registration));
                None
            }
        }
    }

    /// P's half; returns both halves when D's was waiting.
    pub fn ready(&self, key: &str, ready: K) -> Option<(R, K)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        match pending.remove(key) {
            Some(Half::Registration(registration)) => Some((registration, ready)),
            Some(other) => {
                pending.insert(key.to_owned(), other);
                None
            }
            None => {
                pending.insert(key.to_owned(), Half::Ready(ready));
                None
            }
        }
    }
}

//! Tensor parallel topology: which of P's ranks hold a D rank's KV heads.
//!
//! P and D may run different tensor parallel sizes. Rank `r` of `tp` holds the KV heads
//! `r * h .. (r + 1) * h`, `h` being the model's KV heads over `tp`. So:
//!
//! - equal sizes pair rank with rank;
//! - P larger: every P rank holding some of D's heads writes them (one DONE each);
//! - D larger: the one P rank holding D's heads writes them into each of its D ranks, and each
//!   D rank names its [`Share`] of that P rank's transfer;
//! - MLA keeps one latent on every rank: one P rank per D rank.
//!
//! The arithmetic lives here once. D's connector asks [`sources`] which P ranks to register
//! with; D's receive path checks each P it hears from (by the head range P advertises) against
//! [`p_ranks_holding`] and [`share_of`].

use std::ops::Range;

/// Which of the D ranks that one P rank writes a transfer into this one is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// This rank's slot, below `of`.
    pub slot: u32,
    /// How many D ranks the P rank writes into.
    pub of: u32,
}

/// One D rank, as the arithmetic needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    /// This rank's index, below `tp_size`.
    pub tp_rank: u32,
    /// The tensor parallel size.
    pub tp_size: u32,
    /// KV heads on this rank.
    pub kv_heads: u32,
}

/// What a rank's KV cache holds of the model's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// KV heads split between the ranks.
    Heads {
        /// The model's KV heads over all ranks (`None`: `kv_heads` times the tensor parallel
        /// size).
        total_kv_heads: Option<u64>,
        /// Whether the cache layout keeps a block's heads apart, so that a rank can write or
        /// receive a slice of them.
        slices_heads: bool,
    },
    /// MLA: one latent, the same on every rank.
    Latent,
}

/// The P ranks one D rank receives a request's KV from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    /// P's tensor parallel ranks, each writing its part of this rank's heads.
    pub ranks: Range<u32>,
    /// Set when the one P rank writes the request into several D ranks (D runs the larger
    /// size): which of them this one is.
    pub share: Option<Share>,
}

/// Why two tensor parallel sizes cannot exchange KV.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// P's size is 0.
    #[error("P's tensor parallel size {p_tp} must be at least 1")]
    NoRanks {
        /// P's size.
        p_tp: u64,
    },
    /// MLA, D's size not a multiple of P's: a D rank's latent would come from no single rank.
    #[error(
        "P runs tensor parallel size {p_tp} and D {d_tp}: with MLA, D's size must be a multiple \
         of P's"
    )]
    LatentNotShared {
        /// P's size.
        p_tp: u64,
        /// D's size.
        d_tp: u32,
    },
    /// The layout keeps a block's heads together, so they cannot be sliced between ranks.
    #[error(
        "P runs tensor parallel size {p_tp} and D {d_tp}, but this KV cache layout does not keep \
         a block's heads apart, so they cannot be split between ranks; run P and D with the same \
         --tensor-parallel-size (or an HND layout: VLLM_KV_CACHE_LAYOUT=LBHNC)"
    )]
    HeadsNotSliced {
        /// P's size.
        p_tp: u64,
        /// D's size.
        d_tp: u32,
    },
    /// D larger, but not a multiple of P: a D rank's heads would come partly from two P ranks,
    /// each writing into more D ranks than it holds whole.
    #[error(
        "P runs tensor parallel size {p_tp} and D {d_tp}: a D rank's KV heads would be split \
         between two P ranks; with D the larger, its size must be a multiple of P's"
    )]
    UnevenShare {
        /// P's size.
        p_tp: u64,
        /// D's size.
        d_tp: u32,
    },
    /// One side replicates heads across ranks (more ranks than KV heads, or a total that does
    /// not divide).
    #[error(
        "P runs tensor parallel size {p_tp} and D {d_tp} over {total} KV heads: one of them \
         replicates heads across ranks, which kvpush pairs only at equal sizes"
    )]
    ReplicatedHeads {
        /// P's size.
        p_tp: u64,
        /// D's size.
        d_tp: u32,
        /// The model's KV heads.
        total: u64,
    },
}

/// The P ranks (of `p_tp`) that hold D rank `d`'s KV heads, and D's share when one P rank
/// writes into several D ranks.
pub fn sources(d: Rank, p_tp: u64, attention: Attention) -> Result<Sources, TopologyError> {
    let d_tp = d.tp_size;
    if p_tp == 0 {
        return Err(TopologyError::NoRanks { p_tp });
    }
    if p_tp == u64::from(d_tp) {
        return Ok(Sources { ranks: d.tp_rank..d.tp_rank + 1, share: None });
    }
    let (total_kv_heads, slices_heads) = match attention {
        Attention::Latent => return latent_sources(d, p_tp),
        Attention::Heads { total_kv_heads, slices_heads } => (total_kv_heads, slices_heads),
    };
    if !slices_heads {
        return Err(TopologyError::HeadsNotSliced { p_tp, d_tp });
    }
    let kv_heads = u64::from(d.kv_heads);
    let split = kv_heads * u64::from(d_tp);
    let total = total_kv_heads.unwrap_or(split);
    if total != split || total % p_tp != 0 {
        return Err(TopologyError::ReplicatedHeads { p_tp, d_tp, total });
    }
    let per_p = total / p_tp;
    let mine = u64::from(d.tp_rank) * kv_heads..(u64::from(d.tp_rank) + 1) * kv_heads;
    if p_tp > u64::from(d_tp) {
        let ranks = p_ranks_holding(&mine, per_p);
        return Ok(Sources { ranks: rank(ranks.start)..rank(ranks.end), share: None });
    }
    if u64::from(d_tp) % p_tp != 0 {
        return Err(TopologyError::UnevenShare { p_tp, d_tp });
    }
    let p_rank = mine.start / per_p;
    let share = share_of(&mine, &(p_rank * per_p..(p_rank + 1) * per_p));
    Ok(Sources { ranks: rank(p_rank)..rank(p_rank + 1), share: Some(share) })
}

/// MLA: P larger, D rank `r` takes P rank `r`'s copy; D larger, each P rank's latent goes to
/// the D ranks `r`, `r + p_tp`, ... (one P rank per D rank either way).
fn latent_sources(d: Rank, p_tp: u64) -> Result<Sources, TopologyError> {
    let d_tp = u64::from(d.tp_size);
    if p_tp > d_tp {
        return Ok(Sources { ranks: d.tp_rank..d.tp_rank + 1, share: None });
    }
    if d_tp % p_tp != 0 {
        return Err(TopologyError::LatentNotShared { p_tp, d_tp: d.tp_size });
    }
    let d_rank = u64::from(d.tp_rank);
    let p_rank = rank(d_rank % p_tp);
    let share = Share { slot: rank(d_rank / p_tp), of: rank(d_tp / p_tp) };
    Ok(Sources { ranks: p_rank..p_rank + 1, share: Some(share) })
}

/// The ranks whose heads overlap `heads` when each rank holds `per_rank` consecutive heads
/// (from head 0).
pub fn p_ranks_holding(heads: &Range<u64>, per_rank: u64) -> Range<u64> {
    let per_rank = per_rank.max(1);
    if heads.is_empty() {
        return 0..0;
    }
    heads.start / per_rank..(heads.end - 1) / per_rank + 1
}

/// `mine`, a D rank's heads inside `theirs`, the larger range one P rank holds: which of the D
/// ranks `theirs` spans this one is.
pub fn share_of(mine: &Range<u64>, theirs: &Range<u64>) -> Share {
    let ours = (mine.end - mine.start).max(1);
    Share {
        slot: rank(mine.start.saturating_sub(theirs.start) / ours),
        of: rank((theirs.end - theirs.start) / ours),
    }
}

/// A rank or count the callers' sizes bound to `u32`; saturates rather than wraps.
fn rank(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADS: Attention = Attention::Heads { total_kv_heads: None, slices_heads: true };

    fn d(tp_rank: u32, tp_size: u32, kv_heads: u32) -> Rank {
        Rank { tp_rank, tp_size, kv_heads }
    }

    fn ranks(r: Range<u32>) -> Sources {
        Sources { ranks: r, share: None }
    }

    fn shared(p_rank: u32, slot: u32, of: u32) -> Sources {
        Sources { ranks: p_rank..p_rank + 1, share: Some(Share { slot, of }) }
    }

    #[test]
    fn equal_sizes_pair_rank_with_rank() {
        assert_eq!(sources(d(1, 2, 4), 2, HEADS), Ok(ranks(1..2)));
        // Whatever the layout or attention: nothing is sliced.
        let whole = Attention::Heads { total_kv_heads: Some(3), slices_heads: false };
        assert_eq!(sources(d(0, 1, 8), 1, whole), Ok(ranks(0..1)));
        assert_eq!(sources(d(3, 4, 1), 4, Attention::Latent), Ok(ranks(3..4)));
    }

    #[test]
    fn a_larger_p_writes_from_every_rank_holding_some_of_ds_heads() {
        // 8 heads: D tp1 holds all of them; P tp2 holds 4 each.
        assert_eq!(sources(d(0, 1, 8), 2, HEADS), Ok(ranks(0..2)));
        // D tp2 rank 1 holds heads 4..8; P tp4 holds 2 each: ranks 2 and 3.
        assert_eq!(sources(d(1, 2, 4), 4, HEADS), Ok(ranks(2..4)));
    }

    #[test]
    fn a_larger_d_takes_its_share_of_one_p_ranks_heads() {
        // 4 heads: P tp1 holds all of them; D tp2 rank 1 holds 2..4, the second half.
        assert_eq!(sources(d(1, 2, 2), 1, HEADS), Ok(shared(0, 1, 2)));
        // 8 heads: P tp2 holds 4 each; D tp4 ranks 2 and 3 share P rank 1.
        assert_eq!(sources(d(2, 4, 2), 2, HEADS), Ok(shared(1, 0, 2)));
        assert_eq!(sources(d(3, 4, 2), 2, HEADS), Ok(shared(1, 1, 2)));
    }

    #[test]
    fn mla_takes_one_p_ranks_latent_per_d_rank() {
        assert_eq!(sources(d(1, 2, 1), 4, Attention::Latent), Ok(ranks(1..2)));
        assert_eq!(sources(d(3, 4, 1), 2, Attention::Latent), Ok(shared(1, 1, 2)));
        assert_eq!(
            sources(d(0, 3, 1), 2, Attention::Latent),
            Err(TopologyError::LatentNotShared { p_tp: 2, d_tp: 3 })
        );
    }

    #[test]
    fn sizes_that_cannot_exchange_kv_are_refused_with_the_reason() {
        assert_eq!(sources(d(0, 1, 8), 0, HEADS), Err(TopologyError::NoRanks { p_tp: 0 }));
        let whole = Attention::Heads { total_kv_heads: None, slices_heads: false };
        assert_eq!(
            sources(d(0, 1, 8), 2, whole),
            Err(TopologyError::HeadsNotSliced { p_tp: 2, d_tp: 1 })
        );
        // D replicates: 2 heads over tp2 ranks of 2 heads each.
        let replicated = Attention::Heads { total_kv_heads: Some(2), slices_heads: true };
        assert_eq!(
            sources(d(0, 2, 2), 1, replicated),
            Err(TopologyError::ReplicatedHeads { p_tp: 1, d_tp: 2, total: 2 })
        );
        // P would replicate: 4 heads over tp8.
        assert_eq!(
            sources(d(0, 2, 2), 8, HEADS),
            Err(TopologyError::ReplicatedHeads { p_tp: 8, d_tp: 2, total: 4 })
        );
        // 6 heads, P tp2 (3 each), D tp3 (2 each): D rank 1's heads 2..4 straddle P's ranks.
        let straddling = Attention::Heads { total_kv_heads: Some(6), slices_heads: true };
        assert_eq!(
            sources(d(1, 3, 2), 2, straddling),
            Err(TopologyError::UnevenShare { p_tp: 2, d_tp: 3 })
        );
        let message = TopologyError::HeadsNotSliced { p_tp: 2, d_tp: 1 }.to_string();
        assert!(message.contains("cannot be split between ranks"), "{message}");
    }

    #[test]
    fn the_receive_paths_checks_agree_with_the_choice_of_sources() {
        // For every pairing of sizes up to 8 over 8 heads: the ranks `sources` picks are the
        // ones `p_ranks_holding` finds from P's advertised ranges, and the share is `share_of`.
        for d_tp in [1u32, 2, 4, 8] {
            for p_tp in [1u64, 2, 4, 8] {
                for d_rank in 0..d_tp {
                    let kv_heads = 8 / d_tp;
                    let got = sources(d(d_rank, d_tp, kv_heads), p_tp, HEADS).unwrap();
                    let per_p = 8 / p_tp;
                    let mine = u64::from(d_rank * kv_heads)..u64::from((d_rank + 1) * kv_heads);
                    let holding = p_ranks_holding(&mine, per_p);
                    assert_eq!(
                        u64::from(got.ranks.start)..u64::from(got.ranks.end),
                        holding,
                        "d {d_rank}/{d_tp} p {p_tp}"
                    );
                    if per_p > u64::from(kv_heads) {
                        let p = holding.start;
                        assert_eq!(got.share, Some(share_of(&mine, &(p * per_p..(p + 1) * per_p))));
                    } else {
                        assert_eq!(got.share, None);
                    }
                }
            }
        }
    }
}

//! The simulation's one source of randomness: SplitMix64, seeded per schedule, so that a seed
//! replays its schedule exactly.

use std::time::Duration;

/// A seeded pseudo-random sequence (SplitMix64: tiny, fast, and good enough to pick schedules).
#[derive(Debug, Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: unbiased enough for schedules, and never divides.
        u64::try_from((u128::from(self.next_u64()) * u128::from(n)) >> 64).unwrap_or(0)
    }

    /// Uniform in `lo..=hi`.
    pub(super) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// True with probability `percent` / 100.
    pub(super) fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Uniform in `lo..=hi` milliseconds, at microsecond grain.
    pub(super) fn millis(&mut self, lo: f64, hi: f64) -> Duration {
        let (lo, hi) = ((lo * 1_000.0) as u64, (hi * 1_000.0) as u64);
        Duration::from_micros(self.between(lo, hi))
    }

    /// An index into a slice of `len` items, weighted by `weights`.
    pub(super) fn weighted(&mut self, weights: &[u64]) -> usize {
        let mut pick = self.below(weights.iter().sum());
        for (index, &weight) in weights.iter().enumerate() {
            if pick < weight {
                return index;
            }
            pick -= weight;
        }
        weights.len().saturating_sub(1)
    }

    pub(super) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).unwrap_or(0);
            items.swap(i, j);
        }
    }
}

//! The two halves P's rendezvous table pairs: D's [`Registration`] (from `control`, on the side
//! channel's reader) and P's [`Ready`] KV (from `Endpoint::ready`). Whichever arrives second makes
//! the match, which the writer's send path writes.

use std::mem::size_of;
use std::time::Instant;

use crate::protocol::{BlockGroup, Fail, FailReason, Register};
use crate::side_channel::PeerId;

use super::quota::Slot;
use super::ReadyKv;

/// D's registration as P's table holds it.
#[derive(Debug)]
pub(crate) struct Registration {
    /// The side channel connection it came on (replies go back on it).
    pub(crate) peer: PeerId,
    /// The message itself.
    pub(crate) register: Register,
    /// When it arrived.
    pub(crate) at: Instant,
    /// The peer's quota slot it holds until dropped.
    pub(crate) _slot: Slot,
}

impl Registration {
    /// A FAIL for this registration.
    pub(crate) fn fail(&self, reason: FailReason, detail: String) -> Fail {
        Fail {
            transfer_key: self.register.transfer_key.clone(),
            request_id: self.register.request_id.clone(),
            epoch: self.register.epoch,
            reason,
            detail,
        }
    }

    /// The FAIL that tells D P will not send (`why`): it recomputes the request itself.
    pub(crate) fn aborted(&self, why: &str) -> Fail {
        self.fail(FailReason::Aborted, format!("{why}; recompute it locally"))
    }
}

/// P's ready KV as the table holds it.
#[derive(Debug)]
pub(crate) struct Ready {
    pub(crate) kv: ReadyKv,
    pub(crate) at: Instant,
}

/// About what a registration holds in P's memory once decoded: its block ids (4 bytes each), its
/// strings, each group's list, and the table entry around it. Computed once, when it arrives.
pub(crate) fn registration_bytes(register: &Register) -> usize {
    /// The table's entry and hashing around a registration, beyond the value itself.
    const ENTRY: usize = 64;
    let strings =
        [&register.transfer_key, &register.request_id, &register.engine_id, &register.address]
            .iter()
            .map(|s| s.len())
            .sum::<usize>();
    let groups = register
        .groups
        .iter()
        .map(|g| size_of::<BlockGroup>().saturating_add(g.block_ids.len().saturating_mul(4)))
        .fold(0usize, usize::saturating_add);
    (size_of::<Registration>() + ENTRY).saturating_add(strings).saturating_add(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(block_ids: u32) -> Register {
        Register {
            transfer_key: "xfer-1".into(),
            request_id: "cmpl-xfer-1-0".into(),
            epoch: 1,
            engine_id: "decode-0".into(),
            address: "10.0.0.7:5600".into(),
            tp_rank: 0,
            tp_size: 1,
            groups: vec![BlockGroup { first_token: 0, block_ids: (0..block_ids).collect() }],
            num_tokens: 16,
            ttl_ms: 1_000,
            fanout: 1,
            nonce: 0,
        }
    }

    #[test]
    fn a_registration_costs_four_bytes_a_block_id_over_a_fixed_overhead() {
        let empty = registration_bytes(&register(0));
        assert!(empty >= size_of::<Registration>(), "{empty}");
        assert_eq!(registration_bytes(&register(1_000)) - empty, 4_000);
    }
}

//! Why the table refuses an operation ([`RendezvousError`]), and why an ended key is fenced
//! ([`FenceReason`]).

use std::fmt;

use super::Epoch;
use crate::key::TransferKey;

/// Why a key is fenced (refusing late arrivals until the fence lapses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FenceReason {
    /// The KV was written.
    Delivered,
    /// The write failed.
    Failed,
    /// The transfer was cancelled.
    Cancelled,
    /// A deadline passed before the write began.
    Expired,
}

impl fmt::Display for FenceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Delivered => "already delivered",
            Self::Failed => "already failed",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired before it could be written",
        })
    }
}

/// Why the table refused an operation. Payloads passed to a refused call are dropped; keep what a
/// reply needs (the error carries the key and epochs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// A registration's epoch is not above the one the table holds.
    #[error(
        "registration for transfer {key} epoch {epoch} refused: epoch {current} is current; \
         re-register with a higher epoch"
    )]
    StaleEpoch {
        /// The transfer.
        key: TransferKey,
        /// The refused epoch.
        epoch: Epoch,
        /// The epoch the table holds.
        current: Epoch,
    },
    /// P reported its KV ready twice for one transfer.
    #[error(
        "ready KV for transfer {key} refused: P already reported this transfer ready; \
         report each transfer once"
    )]
    DuplicateReady {
        /// The transfer.
        key: TransferKey,
    },
    /// The key ended recently; late halves are refused so they fail now rather than time out.
    #[error("transfer {key} refused: it was {reason}; start a new transfer with a new id")]
    Fenced {
        /// The transfer.
        key: TransferKey,
        /// How it ended.
        reason: FenceReason,
    },
    /// The table holds `capacity` live transfers already.
    #[error(
        "transfer {key} refused: the rendezvous table is full ({capacity} transfers waiting); \
         retry later or raise max_entries"
    )]
    TableFull {
        /// The transfer.
        key: TransferKey,
        /// The configured `max_entries`.
        capacity: usize,
    },
    /// Another peer owns the registration for this key: only its owner may supersede it.
    #[error(
        "registration for transfer {key} refused: another peer registered this transfer; a \
         registration belongs to the peer that made it"
    )]
    Foreign {
        /// The transfer.
        key: TransferKey,
    },
    /// `begin_write` or `finish` named an epoch that is not the matched (or in-flight) one.
    #[error(
        "transfer {key} epoch {epoch} is not matched or in flight (superseded by a \
         re-registration, not yet matched, or already begun); drop this match without writing"
    )]
    NotMatched {
        /// The transfer.
        key: TransferKey,
        /// The epoch named.
        epoch: Epoch,
    },
}

impl RendezvousError {
    /// A stable snake_case name of the refusal, for metrics and logs.
    pub fn code(&self) -> &'static str {
        match self {
            Self::StaleEpoch { .. } => "stale_epoch",
            Self::DuplicateReady { .. } => "duplicate_ready",
            Self::Fenced { .. } => "fenced",
            Self::TableFull { .. } => "table_full",
            Self::NotMatched { .. } => "not_matched",
            Self::Foreign { .. } => "foreign",
        }
    }

    /// The transfer the refusal concerns.
    pub fn key(&self) -> &TransferKey {
        match self {
            Self::StaleEpoch { key, .. }
            | Self::DuplicateReady { key }
            | Self::Fenced { key, .. }
            | Self::TableFull { key, .. }
            | Self::NotMatched { key, .. }
            | Self::Foreign { key } => key,
        }
    }
}

//! What the writer lends its send path (`send`) and receive path (`receive`): the transport,
//! the peers it knows, and where messages and events go. The writer owns one [`Context`] and
//! passes it to each path's calls, so that neither path is part of the writer, nor the writer of
//! them.

use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::layout::KvLayout;
use crate::planner::{PlanError, Planner};
use crate::protocol::Message;
use crate::side_channel::PeerId;
use crate::transport::{MemorySpace, Transport};

use super::agents::UnusableAgent;
use super::events::Event;
use super::link::Link;
use super::Shared;

/// The horizon D assumes for a P whose Hello advertised none (0), and the most it believes: a
/// P cannot make D hold blocks for longer than this after losing it.
pub(super) const MAX_HORIZON: Duration = Duration::from_secs(3_600);

/// Why P cannot plan writes into a peer: their layouts do not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot write into {engine_id}: {source}")]
pub(super) struct Unplannable {
    /// The peer.
    pub(super) engine_id: String,
    /// How the layouts differ.
    pub(super) source: PlanError,
}

/// A peer as the writer knows it.
#[derive(Debug)]
pub(super) struct Peer {
    /// The peer's agent name, from its Hello (what its notifications are sent as).
    pub(super) name: String,
    /// P: the transport's name for the peer once its metadata loaded (a use of P's agents).
    pub(super) agent: Result<String, UnusableAgent>,
    /// P: how to write into this peer (D), or why it cannot be written to.
    pub(super) planner: Result<Planner, Unplannable>,
    /// Where the peer's KV cache lives.
    pub(super) memory: MemorySpace,
    /// D: how long after losing this P it may still be writing (its advertised horizon).
    pub(super) horizon: Duration,
    /// D: how long this P's accepted bytes may still land once its endpoint is gone (its
    /// advertised delivery bound; the horizon when it advertised none).
    pub(super) delivery_bound: Duration,
    /// The model's KV heads the peer holds, and how many ranks its engine splits them over.
    pub(super) heads: std::ops::Range<u64>,
    pub(super) tp_size: u32,
}

/// What both paths use; see the module docs.
pub(super) struct Context<T: Transport> {
    pub(super) transport: T,
    pub(super) layout: KvLayout,
    pub(super) engine_id: String,
    pub(super) shared: Arc<Shared>,
    pub(super) side_channel: Arc<dyn Link>,
    pub(super) events: Sender<Event>,
    pub(super) peers: HashMap<PeerId, Peer>,
}

impl<T: Transport> std::fmt::Debug for Context<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("engine_id", &self.engine_id)
            .field("peers", &self.peers.len())
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Context<T> {
    /// Seconds from the endpoint's start to `at`: the clock of event timelines.
    pub(super) fn seconds(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.shared.origin).as_secs_f64()
    }

    pub(super) fn send(&self, peer: PeerId, message: Message) {
        // A peer that vanished cannot be told anything; its loss is reported separately.
        let _ = self.side_channel.send(peer, &message);
    }

    pub(super) fn emit(&self, event: Event) {
        // The receiver lives as long as the endpoint; after close nobody is listening.
        let _ = self.events.send(event);
    }
}

//! kvpush core: everything about push KV transfer that needs neither Python nor NIXL.
//!
//! * [`key`]: transfer keys, the canonical form of vLLM request ids;
//! * [`rendezvous`]: the table where D's registration meets P's finished KV;
//! * [`layout`] and [`planner`]: KV cache layouts and the (src, dst, len) runs to write;
//! * [`protocol`]: the kvpush/1 control messages, their codec and authentication;
//! * [`topology`]: which P ranks hold a D rank's KV heads (different tensor parallel sizes);
//! * [`transport`]: the data path the writer drives (NIXL in `kvpush-nixl`, or [`loopback`]);
//! * [`side_channel`]: each worker's TCP endpoint for kvpush/1 frames;
//! * [`endpoint`]: one worker's push endpoint: the table, the side channel and the writer thread.

// The modules that own threads, sockets and memory are not loom-modelled (loom models the
// rendezvous table they build on), so they are left out of `--cfg loom` builds.
#[cfg(not(loom))]
pub mod clock;
#[cfg(not(loom))]
pub mod endpoint;
pub mod key;
pub mod layout;
#[cfg(not(loom))]
pub mod loopback;
pub mod planner;
pub mod protocol;
pub mod rendezvous;
#[cfg(not(loom))]
pub mod side_channel;
mod sync;
pub mod topology;
pub mod transport;

pub use key::{canonical_request_id, TransferKey};
pub use layout::{KvLayout, LayoutError, Region, TokenOrder};
pub use planner::{
    BlockList, DescriptorRun, Incompatibility, Plan, PlanError, PlanRequest, PlanStats, Planner,
};
pub use rendezvous::{RendezvousError, RendezvousTable, TableConfig};

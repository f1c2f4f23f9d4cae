//! kvpush core: everything about push KV transfer that needs neither Python nor NIXL.
//!
//! * [`key`]: transfer keys, the canonical form of vLLM request ids;
//! * [`rendezvous`]: the table where D's registration meets P's finished KV;
//! * [`layout`] and [`planner`]: KV cache layouts and the (src, dst, len) runs to write;
//! * [`protocol`]: the kvpush/1 control messages, their codec and authentication;
//! * [`transport`]: the data path the writer drives (NIXL in `kvpush-nixl`, or in-process).

pub mod endpoint;
pub mod key;
pub mod layout;
pub mod loopback;
pub mod planner;
pub mod protocol;
pub mod rendezvous;
pub mod side_channel;
mod sync;
pub mod transport;

pub use key::{canonical_request_id, TransferKey};
pub use layout::{KvLayout, LayoutError, Region, TokenOrder};
pub use planner::{BlockList, DescriptorRun, Plan, PlanError, PlanRequest, PlanStats, Planner};
pub use rendezvous::{RendezvousError, RendezvousTable, TableConfig};

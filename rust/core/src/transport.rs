//! The data path as the writer engine sees it: register memory, learn peers, post WRITEs that
//! carry a notification, poll them, and receive notifications.
//!
//! Two implementations: the NIXL agent (`kvpush-nixl`, the real one: UCX over loopback here,
//! RDMA on GPU nodes) and [`crate::loopback::LoopbackTransport`] (in-process memcpy, for tests and
//! for benches that isolate control overhead). The writer engine is generic over this trait and
//! is the only caller: every method runs on the writer's one thread, so implementations need no
//! internal locking (`Send`, not `Sync`).

use std::fmt;

use crate::planner::DescriptorRun;

/// Which kind of memory an address lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
}

impl fmt::Display for MemorySpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            MemoryKind::Dram => f.write_str("host memory (DRAM)"),
            MemoryKind::Vram => write!(f, "GPU memory (VRAM) of device {}", self.device),
        }
    }
}

/// A memory space: the kind of memory and the device it is on (0 for DRAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MemorySpace {
    /// DRAM or VRAM.
    pub kind: MemoryKind,
    /// The device index (GPU ordinal for VRAM; 0 for DRAM).
    pub device: u32,
}

impl MemorySpace {
    /// Host memory.
    pub const DRAM: Self = Self { kind: MemoryKind::Dram, device: 0 };
}

/// One registered range of local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Where it lives.
    pub space: MemorySpace,
}

/// One region's kernel blocks as a transport may describe them once and for all: `count`
/// blocks, block `k` being the `len` bytes at `base + k * stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockArray {
    /// Address of block 0.
    pub base: u64,
    /// Bytes from one block to the next (at least `len`).
    pub stride: u64,
    /// Bytes of one block.
    pub len: u64,
    /// Blocks in the array.
    pub count: u32,
}

/// A WRITE whose runs are whole blocks, also given as block indices (see
/// [`Transport::post_block_write`]).
///
/// Each side's arrays form one table whose blocks are numbered array by array: block `k` of
/// array `a` is index `count(arrays before a) + k`. `src[i]` and `dst[i]` are the `i`-th block
/// pair written, and the blocks the pairs name, copied in order, are exactly the bytes of `runs`.
/// The tables are fixed for the life of a (P layout, D layout) pair, so a transport can prepare
/// them once and afterwards pass only indices.
#[derive(Debug, Clone, Copy)]
pub struct BlockWrite<'a> {
    /// The same WRITE as runs, for transports that do not use the indices.
    pub runs: &'a [DescriptorRun],
    /// The local (P) block table.
    pub src_blocks: &'a [BlockArray],
    /// The remote (D) block table.
    pub dst_blocks: &'a [BlockArray],
    /// Indices into the local table, one per block written.
    pub src: &'a [u32],
    /// Indices into the remote table, as many as `src`; every pair has equal block lengths.
    pub dst: &'a [u32],
}

/// A posted write, as its transport names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriteId(pub u64);

/// Where a posted write stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteState {
    /// Still moving bytes: poll again (the transport may send the notification from a poll).
    InProgress,
    /// Every byte landed and the notification was sent; the write's resources are released.
    Done,
}

/// A notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub from: String,
    /// The payload, as the sender passed it.
    pub payload: Vec<u8>,
}

/// Why a transport cannot WRITE into a peer's memory (see [`Transport::can_write_into`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// The transport copies with the CPU, which reaches host memory only.
    #[error(
        "the {transport} transport copies with memcpy and reaches host memory only; use \
         transport=\"nixl\" (a CUDA-enabled NIXL/UCX) for GPU KV caches"
    )]
    HostMemoryOnly {
        /// The transport's kind, as `EndpointConfig` names it.
        transport: &'static str,
    },
}

/// Why a transport call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{operation} failed: {detail}")]
pub struct TransportError {
    /// The call that failed (`post_write`, `add_peer`, ...).
    pub operation: &'static str,
    /// What the transport reported, with the status or peer it concerns.
    pub detail: String,
}

impl TransportError {
    /// An error from `operation`, described by `detail`.
    pub fn new(operation: &'static str, detail: impl fmt::Display) -> Self {
        Self { operation, detail: detail.to_string() }
    }
}

/// A data path the writer engine can drive. See the module docs.
pub trait Transport: Send {
    /// The name peers know this agent by (a NIXL agent name).
    fn name(&self) -> &str;

    /// Registers local memory, so that writes may read from it (P) or land in it (D).
    ///
    /// # Safety
    ///
    /// Every region must stay valid for reads and writes, and must not be freed or unmapped, until
    /// the transport is dropped: a peer may write into it at any time after its address was
    /// advertised, and a local write reads it asynchronously.
    unsafe fn register_memory(&mut self, regions: &[MemoryRegion]) -> Result<(), TransportError>;

    /// Whether this transport can WRITE from its registered memory into a peer's memory in
    /// `remote`; the error says why not. Asked at the handshake, so that a pair the transport
    /// cannot serve is refused there, naming both sides, instead of failing every request.
    fn can_write_into(&self, remote: MemorySpace) -> Result<(), Unreachable> {
        let _ = remote;
        Ok(())
    }

    /// This agent's metadata: the bytes a peer passes to its own [`Transport::add_peer`].
    fn metadata(&mut self) -> Result<Vec<u8>, TransportError>;

    /// Learns a peer from its metadata; returns the peer's name.
    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError>;

    /// Forgets a peer (its process ended, or it is being replaced).
    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError>;

    /// Posts a WRITE of `runs` from local memory in `local` into `peer`'s memory in `remote`.
    ///
    /// `notification` reaches the peer only after every byte of the write has landed; the peer
    /// learns of the write through it and nothing else. `None` posts a WRITE the peer is not
    /// told of (a layer written early by layer-wise push: the request's last WRITE carries its
    /// DONE, and is posted only once the earlier ones are done). Poll the write until it is
    /// done.
    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError>;

    /// Posts `write`, a WRITE of whole blocks, exactly as [`Transport::post_write`] posts its
    /// runs: same bytes, same notification, same errors.
    ///
    /// A transport that can describe each side's block table once (NIXL's prepared descriptor
    /// lists) builds the request from the indices; the default posts the runs.
    fn post_block_write(
        &mut self,
        peer: &str,
        write: &BlockWrite<'_>,
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        self.post_write(peer, write.runs, local, remote, notification)
    }

    /// Where `write` stands. After `Done` or an error the write is released and its id is void.
    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError>;

    /// Sends a notification that is not tied to a write.
    fn send_notification(&mut self, peer: &str, payload: &[u8]) -> Result<(), TransportError>;

    /// Appends every notification received since the last call to `out`, driving the
    /// transport's progress as it does so.
    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError>;
}

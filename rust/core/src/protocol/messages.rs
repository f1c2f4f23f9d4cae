//! The kvpush/1 control messages: what each one says, and the limits a decoded one must meet.
//!
//! Each message is its own struct, encoded as a msgpack map with named fields (the envelope's
//! `body`), so a Python peer reads it with plain `msgpack.unpackb` and a later version can add
//! fields: unknown fields are ignored on decode. Which struct a body holds is the envelope's
//! `kind` ([`Message::kind`]). `docs/protocol.md` is the normative description.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::ProtocolError;
use super::Limits;
use crate::layout::KvLayout;
use crate::transport::MemorySpace;

/// Deepest msgpack nesting a body may have. The deepest v1 message (`hello.layout.regions[i]`)
/// needs 4 levels; the cap keeps a hostile body of nested arrays inside an ignored field from
/// recursing the decoder off the end of a thread's stack.
const MAX_BODY_DEPTH: usize = 16;

/// Most protocol versions a [`Hello`] may list.
const MAX_HELLO_VERSIONS: usize = 64;

/// Side-channel handshake: who a worker is, how its KV is laid out, and its half of the
/// challenge that proves both sides hold the shared secret.
///
/// Each side sends its own `Hello` as the first frame on a side-channel connection (the
/// connecting side first, with a fresh `nonce`; the accepting side answers with its own `nonce`
/// and `echo`, the connector's). Neither Hello carries NIXL agent metadata: the connector sends
/// its metadata in an [`Attach`] only once the acceptor's Hello has proven the acceptor holds
/// the secret, and the acceptor loads it only once the `Attach` has proven the connector does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's vLLM engine id.
    pub engine_id: String,
    /// The sender's tensor-parallel rank.
    pub tp_rank: u32,
    /// The sender engine's tensor-parallel size.
    pub tp_size: u32,
    /// The sender's pipeline-parallel rank.
    pub pp_rank: u32,
    /// The sender engine's pipeline-parallel size.
    pub pp_size: u32,
    /// The sender's NIXL agent name (what NIXL notifications name as their source).
    pub agent_name: String,
    /// The sender's NIXL agent metadata (`get_agent_metadata()`), for `add_remote_agent`.
    /// Empty on the wire (it travels in [`Attach`]); the side channel fills it in for the
    /// [`crate::side_channel::PeerInfo`] of a connector.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// A fresh random challenge for this connection, which the peer's next frame must echo.
    #[serde(default)]
    pub nonce: u64,
    /// The accepting side's copy of the connector's `nonce` (0 in the connector's Hello).
    #[serde(default)]
    pub echo: u64,
    /// How long after its last proof that the peer is alive this worker may still be writing
    /// into the peer: its lease (no WRITE is posted later than `lease` after that proof) plus
    /// its write timeout (no posted WRITE runs longer, unless it is quarantined and the peer
    /// told). D hands a lost P's blocks back only after this much time. Milliseconds.
    #[serde(default)]
    pub write_horizon_ms: u64,
    /// How long bytes the sender's transport had accepted may still land in the peer once the
    /// sender's endpoint is gone (its process exited, or the endpoint closed and dropped its
    /// transport): TCP's retransmission span, RDMA's retry budget, 0 on a loopback device.
    /// Milliseconds. 0 or absent: unknown, and the peer assumes the whole `write_horizon_ms`.
    #[serde(default)]
    pub delivery_bound_ms: u64,
    /// The sender's KV cache layout.
    pub layout: KvLayout,
    /// Hash of everything that must match for KV to be interchangeable (model, dtype, KV
    /// dtype, head size, layer count, attention backend, ...). Peers with different hashes
    /// refuse each other with [`FailReason::Incompatible`].
    pub compatibility: String,
    /// Side-channel protocol versions the sender speaks; the connection uses the highest one
    /// both list.
    pub versions: Vec<u16>,
    /// Where the sender's KV cache lives (DRAM, or VRAM of which GPU): the memory space P's
    /// WRITE targets. Absent from older peers' Hellos, which then mean DRAM.
    #[serde(default = "dram")]
    pub memory: MemorySpace,
}

fn dram() -> MemorySpace {
    MemorySpace::DRAM
}

/// One KV cache group's destination blocks in a [`Register`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockGroup {
    /// Index of the first token these blocks hold (D's prefix-cache hit length, block aligned):
    /// P writes only tokens from here on.
    pub first_token: u64,
    /// D's logical block ids for the uncached suffix, in token order.
    pub block_ids: Vec<u32>,
}

/// D → P over the side channel: "write request `transfer_key` into these blocks".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    /// The rendezvous key (router `transfer_id`, else the canonical request id).
    pub transfer_key: String,
    /// D's own request id; echoed back in every reply about this transfer.
    pub request_id: String,
    /// Registration generation: a re-registration (after preemption or retry) carries a higher
    /// epoch and supersedes the old one; P refuses a lower one.
    pub epoch: u64,
    /// D's engine id.
    pub engine_id: String,
    /// D's side-channel address, `host:port`, where P fetches D's [`Hello`].
    pub address: String,
    /// The registering D worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// D's tensor-parallel size.
    pub tp_size: u32,
    /// Destination blocks, one entry per KV cache group, in group order.
    pub groups: Vec<BlockGroup>,
    /// Number of prompt tokens whose KV P must deliver (the whole prompt, cached prefix included).
    pub num_tokens: u64,
    /// How long P may hold the registration, in ms from receipt; relative so that no clock
    /// synchronisation is needed. P answers [`FailReason::Expired`] when it runs out.
    pub ttl_ms: u64,
    /// How many D ranks this P rank writes the transfer into (D runs a larger tensor parallel
    /// size): each registers under its own slot of the key (`transfer_key` is then a
    /// [`crate::key::TransferKey::slot`] key), and P writes each of them once its KV is ready.
    /// 1 (the default, and what older peers send): one D rank.
    #[serde(default = "one")]
    pub fanout: u32,
    /// A fresh random number D picks for this registration (this leg, this epoch); P echoes it
    /// in the [`Done`] of the WRITE into these blocks, and D counts only a DONE that does, so
    /// that a DONE is tied to one registration and not just to its key and epoch. 0 (the
    /// default, and what older peers send): none picked.
    #[serde(default)]
    pub nonce: u64,
}

fn one() -> u32 {
    1
}

/// Most D ranks one P rank may write a transfer into (the ratio of tensor parallel sizes).
pub const MAX_FANOUT: u32 = 64;

/// A registration's fan-out is 1 to [`MAX_FANOUT`], and above 1 its key names a slot below it.
fn check_fanout(m: &Register) -> Result<(), ProtocolError> {
    if m.fanout == 0 || m.fanout > MAX_FANOUT {
        return Err(invalid(
            "register.fanout",
            format!("{} D ranks per P rank, expected 1 to {MAX_FANOUT}", m.fanout),
        ));
    }
    if m.fanout > 1 {
        let key = crate::key::TransferKey::from_canonical(&m.transfer_key);
        match key.split_slot() {
            Some((_, slot)) if slot < m.fanout => {}
            _ => {
                return Err(invalid(
                    "register.transfer_key",
                    format!("names no slot below the registration's fan-out of {}", m.fanout),
                ))
            }
        }
    }
    Ok(())
}

/// P → D as the NIXL notification of the WRITE itself: "this rank's share of the KV is in your
/// blocks". NIXL delivers it only after the WRITE's data, so receiving it means the data landed.
///
/// Kept small: it travels in a NIXL notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// The rendezvous key.
    pub transfer_key: String,
    /// D's request id, from the [`Register`].
    pub request_id: String,
    /// The epoch of the registration that was written.
    pub epoch: u64,
    /// The writing P worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// P's tensor-parallel size: D counts one DONE per P rank that writes to it.
    pub tp_size: u32,
    /// Bytes written by this rank.
    pub bytes: u64,
    /// Descriptor runs (contiguous regions) those bytes were written as.
    pub runs: u32,
    /// The `nonce` of the [`Register`] that was written (0 when it had none, and from older
    /// peers).
    #[serde(default)]
    pub nonce: u64,
}

/// Why P could not deliver a transfer.
///
/// On the wire a snake_case string. A reason this build does not know (from a newer peer)
/// decodes to [`FailReason::Unknown`] rather than refusing the whole message: whatever the
/// reason, the transfer failed, and D must learn that now instead of waiting for its deadline.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// P's request was aborted or finished without producing KV.
    Aborted,
    /// The registration's `ttl_ms` ran out, or P's KV lease expired, before the WRITE.
    Expired,
    /// P refused the registration (stale epoch, invalid block ids, unknown request, ...).
    Refused,
    /// The NIXL WRITE failed.
    WriteError,
    /// The transfer was cancelled by D.
    Cancelled,
    /// P is shutting down.
    ShuttingDown,
    /// P and D are not compatible (compatibility hash, layout, version).
    Incompatible,
    /// P gave up on a WRITE that may still be landing (kvpush itself no longer sends it: it
    /// holds such a WRITE until NIXL finishes it). A notice, not an end: D keeps the
    /// destination blocks (never reuses them) until P's word or P's endpoint is gone.
    Quarantined,
    /// A reason this build does not know; carries the wire string.
    Unknown(String),
}

impl FailReason {
    /// Every reason this build knows, in wire order.
    pub const KNOWN: [FailReason; 8] = [
        Self::Aborted,
        Self::Expired,
        Self::Refused,
        Self::WriteError,
        Self::Cancelled,
        Self::ShuttingDown,
        Self::Incompatible,
        Self::Quarantined,
    ];

    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Aborted => "aborted",
            Self::Expired => "expired",
            Self::Refused => "refused",
            Self::WriteError => "write_error",
            Self::Cancelled => "cancelled",
            Self::ShuttingDown => "shutting_down",
            Self::Incompatible => "incompatible",
            Self::Quarantined => "quarantined",
            Self::Unknown(reason) => reason,
        }
    }

    /// The reason a wire string names; unknown strings become [`FailReason::Unknown`].
    pub fn from_wire(reason: &str) -> Self {
        Self::KNOWN
            .into_iter()
            .find(|known| known.as_str() == reason)
            .unwrap_or_else(|| Self::Unknown(reason.to_owned()))
    }
}

impl Serialize for FailReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for FailReason {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let reason = String::deserialize(deserializer)?;
        Ok(Self::from_wire(&reason))
    }
}

/// P → D over the side channel: P will not deliver this transfer. Sent whenever P knows it
/// cannot, so D never waits for a deadline while P is alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fail {
    /// The rendezvous key.
    pub transfer_key: String,
    /// D's request id, from the [`Register`].
    pub request_id: String,
    /// The epoch of the registration that failed.
    pub epoch: u64,
    /// Why.
    pub reason: FailReason,
    /// Human-readable detail for logs.
    pub detail: String,
}

/// D → P over the side channel: D aborted or preempted the request; do not write.
///
/// D keeps the blocks until the [`CancelAck`] arrives (or P is known dead): a WRITE must never
/// land in a block that was handed to another request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    /// The rendezvous key.
    pub transfer_key: String,
    /// D's request id, from the [`Register`].
    pub request_id: String,
    /// The epoch of the registration being cancelled.
    pub epoch: u64,
}

/// P → D over the side channel: the cancelled transfer will not touch D's blocks any more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelAck {
    /// The rendezvous key.
    pub transfer_key: String,
    /// D's request id, from the [`Cancel`].
    pub request_id: String,
    /// The epoch from the [`Cancel`].
    pub epoch: u64,
    /// Whether a WRITE had already been posted; if so it has completed (or failed) by now.
    pub wrote: bool,
    /// The WRITE completed: every byte of it is in D's blocks (its DONE may not have arrived
    /// yet, or at all). Absent from older peers: false.
    #[serde(default)]
    pub delivered: bool,
}

/// Liveness, either direction over the side channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The sender's engine id.
    pub engine_id: String,
    /// Heartbeat counter of the sender (independent of the envelope's `seq`).
    pub seq: u64,
    /// Transfers the sender is waiting on from the receiver.
    pub pending: u32,
    /// The sender's side-channel clock (milliseconds since its channel started, from 1).
    #[serde(default)]
    pub clock_ms: u64,
    /// The latest `clock_ms` the sender received from the receiver (0: none yet): proof, on the
    /// receiver's own clock, that the sender was alive after that moment.
    #[serde(default)]
    pub echo_ms: u64,
}

/// The connector's answer to the acceptor's [`Hello`]: proof that it holds the secret (a signed
/// frame that echoes this connection's challenge), and its NIXL agent metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attach {
    /// The acceptor's Hello `nonce`.
    pub echo: u64,
    /// The connector's NIXL agent metadata (`get_agent_metadata()`), for `add_remote_agent`.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
}

/// The reply to a frame that was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Stable snake_case code, [`ProtocolError::code`] for codec refusals.
    pub code: String,
    /// Human-readable detail for logs.
    pub detail: String,
}

/// Any kvpush/1 control message.
///
/// The codec sends the variant's struct as the envelope `body` under the envelope `kind`
/// [`Message::kind`]; the serde derive (adjacently tagged, `{"kind", "body"}`) is for tools that
/// want one self-describing value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "body", rename_all = "snake_case")]
pub enum Message {
    /// Side-channel handshake.
    Hello(Hello),
    /// D registers its destination blocks with P.
    Register(Register),
    /// P's WRITE landed (travels as its NIXL notification).
    Done(Done),
    /// P will not deliver.
    Fail(Fail),
    /// D withdraws a registration.
    Cancel(Cancel),
    /// P confirms a cancel.
    CancelAck(CancelAck),
    /// Liveness.
    Heartbeat(Heartbeat),
    /// A frame was refused.
    Error(ErrorReply),
    /// The connector's proof and agent metadata, after the Hellos.
    Attach(Attach),
}

impl Message {
    /// Every envelope `kind` this build knows.
    pub const KINDS: [&'static str; 9] = [
        "hello",
        "register",
        "done",
        "fail",
        "cancel",
        "cancel_ack",
        "heartbeat",
        "error",
        "attach",
    ];

    /// The envelope `kind` of this message.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hello(_) => "hello",
            Self::Register(_) => "register",
            Self::Done(_) => "done",
            Self::Fail(_) => "fail",
            Self::Cancel(_) => "cancel",
            Self::CancelAck(_) => "cancel_ack",
            Self::Heartbeat(_) => "heartbeat",
            Self::Error(_) => "error",
            Self::Attach(_) => "attach",
        }
    }

    /// The message's own named msgpack map: the envelope `body`.
    pub(crate) fn to_body(&self) -> Vec<u8> {
        let encoded = match self {
            Self::Hello(m) => rmp_serde::to_vec_named(m),
            Self::Register(m) => rmp_serde::to_vec_named(m),
            Self::Done(m) => rmp_serde::to_vec_named(m),
            Self::Fail(m) => rmp_serde::to_vec_named(m),
            Self::Cancel(m) => rmp_serde::to_vec_named(m),
            Self::CancelAck(m) => rmp_serde::to_vec_named(m),
            Self::Heartbeat(m) => rmp_serde::to_vec_named(m),
            Self::Error(m) => rmp_serde::to_vec_named(m),
            Self::Attach(m) => rmp_serde::to_vec_named(m),
        };
        // Serializing into a Vec can only fail for a writer error (a Vec has none), a sequence of
        // unknown length (derived impls always know it) or a custom error (no impl here raises
        // one), so this is unreachable rather than a peer-triggerable panic.
        encoded.expect("kvpush messages are plain data and always serialize into a Vec")
    }

    /// Decodes the body of an envelope of kind `kind`.
    pub(crate) fn from_body(kind: &str, body: &[u8]) -> Result<Self, ProtocolError> {
        Ok(match kind {
            "hello" => Self::Hello(from_msgpack(body)?),
            "register" => Self::Register(from_msgpack(body)?),
            "done" => Self::Done(from_msgpack(body)?),
            "fail" => Self::Fail(from_msgpack(body)?),
            "cancel" => Self::Cancel(from_msgpack(body)?),
            "cancel_ack" => Self::CancelAck(from_msgpack(body)?),
            "heartbeat" => Self::Heartbeat(from_msgpack(body)?),
            "error" => Self::Error(from_msgpack(body)?),
            "attach" => Self::Attach(from_msgpack(body)?),
            other => return Err(ProtocolError::UnknownKind { kind: other.to_owned() }),
        })
    }

    /// Checks what msgpack decoding cannot: string lengths and block-id counts against
    /// `limits`, ranks below their sizes, non-empty keys.
    ///
    /// The decoder runs it on every message it returns; senders may run it to refuse locally what
    /// the peer would refuse anyway.
    pub fn validate(&self, limits: &Limits) -> Result<(), ProtocolError> {
        let text = |field, value: &str| check_str(field, value, limits);
        match self {
            Self::Hello(m) => {
                text("hello.engine_id", &m.engine_id)?;
                text("hello.agent_name", &m.agent_name)?;
                text("hello.compatibility", &m.compatibility)?;
                check_rank("hello.tp_rank", m.tp_rank, m.tp_size)?;
                check_rank("hello.pp_rank", m.pp_rank, m.pp_size)?;
                if m.versions.is_empty() || m.versions.len() > MAX_HELLO_VERSIONS {
                    return Err(invalid(
                        "hello.versions",
                        format!(
                            "lists {} versions, expected 1 to {MAX_HELLO_VERSIONS}",
                            m.versions.len()
                        ),
                    ));
                }
                if m.layout.regions.len() > limits.max_block_ids {
                    return Err(invalid(
                        "hello.layout.regions",
                        format!(
                            "{} regions exceed max_block_ids = {}",
                            m.layout.regions.len(),
                            limits.max_block_ids
                        ),
                    ));
                }
            }
            Self::Register(m) => {
                check_key(
                    ["register.transfer_key", "register.request_id"],
                    &m.transfer_key,
                    &m.request_id,
                    limits,
                )?;
                text("register.engine_id", &m.engine_id)?;
                text("register.address", &m.address)?;
                check_rank("register.tp_rank", m.tp_rank, m.tp_size)?;
                check_fanout(m)?;
                // Count groups as well as ids so that a flood of empty groups is bounded too.
                let total = m
                    .groups
                    .iter()
                    .fold(m.groups.len(), |sum, group| sum.saturating_add(group.block_ids.len()));
                if total > limits.max_block_ids {
                    return Err(invalid(
                        "register.groups",
                        format!(
                            "{} groups + block ids exceed max_block_ids = {}",
                            total, limits.max_block_ids
                        ),
                    ));
                }
            }
            Self::Done(m) => {
                check_key(
                    ["done.transfer_key", "done.request_id"],
                    &m.transfer_key,
                    &m.request_id,
                    limits,
                )?;
                check_rank("done.tp_rank", m.tp_rank, m.tp_size)?;
            }
            Self::Fail(m) => {
                check_key(
                    ["fail.transfer_key", "fail.request_id"],
                    &m.transfer_key,
                    &m.request_id,
                    limits,
                )?;
                text("fail.reason", m.reason.as_str())?;
                text("fail.detail", &m.detail)?;
            }
            Self::Cancel(m) => check_key(
                ["cancel.transfer_key", "cancel.request_id"],
                &m.transfer_key,
                &m.request_id,
                limits,
            )?,
            Self::CancelAck(m) => check_key(
                ["cancel_ack.transfer_key", "cancel_ack.request_id"],
                &m.transfer_key,
                &m.request_id,
                limits,
            )?,
            Self::Heartbeat(m) => text("heartbeat.engine_id", &m.engine_id)?,
            Self::Error(m) => {
                text("error.code", &m.code)?;
                text("error.detail", &m.detail)?;
            }
            // The metadata is bounded by the frame limit; NIXL parses it only after the frame
            // proved its sender holds the secret.
            Self::Attach(_) => {}
        }
        Ok(())
    }
}

/// Decodes one msgpack value that must fill `bytes` exactly, with nesting capped.
///
/// Reads through `&[u8]`'s `Read` impl rather than `from_slice` because that exposes what is
/// left over afterwards; string and byte lengths are still checked against the bytes actually
/// present before anything is allocated, and sequence preallocation is capped by serde.
pub(crate) fn from_msgpack<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, ProtocolError> {
    let mut rest = bytes;
    let mut deserializer = rmp_serde::Deserializer::new(&mut rest);
    deserializer.set_max_depth(MAX_BODY_DEPTH);
    let value = T::deserialize(&mut deserializer).map_err(ProtocolError::malformed)?;
    drop(deserializer);
    if !rest.is_empty() {
        return Err(ProtocolError::malformed(format_args!(
            "{} bytes left over after the msgpack value",
            rest.len()
        )));
    }
    Ok(value)
}

fn invalid(field: &'static str, reason: String) -> ProtocolError {
    ProtocolError::Invalid { field, reason }
}

fn check_str(field: &'static str, value: &str, limits: &Limits) -> Result<(), ProtocolError> {
    if value.len() > limits.max_string_bytes {
        return Err(invalid(
            field,
            format!("{} bytes exceed max_string_bytes = {}", value.len(), limits.max_string_bytes),
        ));
    }
    Ok(())
}

/// The transfer key and request id every per-transfer message carries: bounded and non-empty
/// (an empty key would make every such message collide in the rendezvous table).
fn check_key(
    [key_field, id_field]: [&'static str; 2],
    transfer_key: &str,
    request_id: &str,
    limits: &Limits,
) -> Result<(), ProtocolError> {
    for (field, value) in [(key_field, transfer_key), (id_field, request_id)] {
        if value.is_empty() {
            return Err(invalid(field, "is empty".to_owned()));
        }
        check_str(field, value, limits)?;
    }
    Ok(())
}

fn check_rank(field: &'static str, rank: u32, size: u32) -> Result<(), ProtocolError> {
    if rank >= size {
        return Err(invalid(field, format!("rank {rank} is not below its group size {size}")));
    }
    Ok(())
}

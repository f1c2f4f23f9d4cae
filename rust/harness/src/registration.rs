//! P's registration handling, driven through the public API by scripted D peers.
//!
//! A run starts a real P [`Endpoint`] (a loopback transport, a signed side channel, a small table
//! and host quota so that scripts reach their bounds) and up to [`MAX_PEERS`] D peers. A D peer
//! is what a D worker is to P: a [`SideChannel`] that joined P's (the handshake, heartbeats and
//! proofs of life are the real ones) and a loopback agent whose registered memory is its KV
//! cache, filled with [`CANARY`] and framed by guard bytes. The [`Script`] then has the peers
//! send registrations, cancels, heartbeats and replies built by hand (epochs up and down, each
//! other's keys, slot keys with any fan-out, empty, huge and out-of-range block lists, any TTL),
//! strangers write bytes to P's port, peers leave and come back, and P's engine calls `ready`
//! and `abort`, in any interleaving. P's transport is watched: every WRITE is seen as it is
//! posted and as it finishes, and the script can make WRITEs overdue or fail.
//!
//! At the end every peer leaves, P aborts what it still holds with a long TTL, and the run waits
//! (boundedly) for P to settle. What must hold, whatever the script did:
//!
//! * P's writer stays healthy and no thread panics; every legitimate D joins.
//! * Every WRITE goes to a D peer's agent, and its DONE names a registration that peer sent
//!   before; its bytes land only in the blocks that registration named; it is not posted after
//!   P told that peer (a FAIL, a CANCEL_ACK) that the registration will not be written, and P
//!   says so only once the WRITE is finished. The memory of each D peer outside the blocks it
//!   ever registered keeps its canary.
//! * Each `ready` P accepted ends in exactly one final send event, after at most one quarantined
//!   notice, unless an abort released it (then none); no other send is reported.
//! * Once the peers are gone and the TTLs passed, P's table holds nothing and no fan-out group
//!   is left.
//! * Every refusal carries a reason: a FAIL a known reason and a detail, an error reply a code,
//!   an event that is not done a detail.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use kvpush_core::endpoint::{
    AbortOutcome, Endpoint, EndpointConfig, Event, Outcome, ReadyKv, Role,
};
use kvpush_core::loopback::LoopbackTransport;
use kvpush_core::planner::DescriptorRun;
use kvpush_core::protocol::{
    unix_millis, BlockGroup, Cancel, CancelAck, Decoder, ErrorReply, Fail, FailReason, Heartbeat,
    Hello, Limits, Message, Register, PROTOCOL_VERSION,
};
use kvpush_core::rendezvous::TableConfig;
use kvpush_core::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
};
use kvpush_core::transport::{
    MemoryRegion, MemorySpace, Notification, Transport, TransportError, Unreachable, WriteId,
    WriteState,
};

use crate::cache::{Cache, Shape};
use crate::{
    panics, pick, secret, tally, unique, Clock, Few, Known, Report, CONNECT_TIMEOUT, HEARTBEAT,
    JOIN_TIMEOUT, PEER_TIMEOUT, SECRET, WRITE_TIMEOUT,
};

/// Most D peers one run starts.
pub const MAX_PEERS: usize = 3;
/// Most actions of a script.
pub const MAX_ACTIONS: usize = 40;
/// All of a script's waits together.
const WAIT_BUDGET: Duration = Duration::from_millis(80);
/// Transfer keys `k0`..: few, so that peers and P's engine collide on them.
const KEYS: u8 = 3;
/// Slots of a key, and request ids per peer.
const SLOTS: u8 = 3;
const REQUESTS: u8 = 3;
/// P's limits on its host's registrations, its table's live entries (and fences), and the
/// block ids of one registration: small enough for scripts to reach.
const QUOTA: usize = 6;
const TABLE_ENTRIES: usize = 12;
const MAX_BLOCK_IDS: usize = 256;
/// A block list over P's `MAX_BLOCK_IDS` (which the peers' own limits let through).
const HUGE: u32 = 300;
/// Block ids scripts pick from: some past a cache's 16 (or 8) blocks.
const BLOCK_IDS: u8 = 20;
/// How long the end of a run waits for P to settle.
const SETTLE: Duration = Duration::from_secs(3);
/// What a D peer's KV memory holds where nothing was written.
pub const CANARY: u8 = 0xee;
/// How long a post the transport refuses takes.
const UNPOSTED: Duration = Duration::from_millis(15);
/// How long an overdue WRITE stays in progress: past P's write timeout.
const OVERDUE: Duration = Duration::from_millis(400);
/// What every endpoint and peer of this harness serves: the other harness's endpoints (a test
/// running beside this one may get a port one of these let go of) refuse them at the handshake.
const COMPATIBILITY: &str = "harness-registration-model/bf16";

// ------------------------------------------------------------------------------------------
// The script.

/// What one run does: the D peers, how P's transport treats WRITEs, and the actions.
#[derive(Arbitrary, Debug, Clone)]
pub struct Script {
    /// The D peers (at least one, at most [`MAX_PEERS`]).
    pub peers: Few<PeerSpec, MAX_PEERS>,
    /// How P's WRITEs end.
    pub writes: WriteFate,
    /// How long an ended key keeps refusing late halves in P's table.
    pub fences: Fences,
    /// Each transfer key's prompt, in four-token blocks (1 to 4): what P computes and D
    /// registers for, unless an action says otherwise.
    pub prompts: [u8; KEYS as usize],
    /// What happens, in order.
    pub actions: Few<Action, MAX_ACTIONS>,
}

/// One D peer.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct PeerSpec {
    /// Its KV cache.
    pub shape: PeerShape,
    /// The agent metadata its handshake hands P.
    pub metadata: Metadata,
}

/// A D peer's KV cache, against P's (two heads on one rank, four-token blocks).
#[derive(Debug, Clone, Copy)]
pub enum PeerShape {
    /// The same as P's.
    Whole,
    /// One of two D ranks of one head each (P writes a slice of its heads).
    Half {
        /// Rank 1 rather than 0.
        second: bool,
    },
    /// Eight-token blocks.
    Coarse,
    /// Heads of another size: P cannot plan a WRITE into it.
    Foreign,
}

/// The agent metadata a peer's handshake carries.
#[derive(Debug, Clone, Copy)]
pub enum Metadata {
    /// Its own agent's.
    Own,
    /// None: P cannot load an agent for it.
    Missing,
    /// An agent that does not exist.
    Unknown,
}

/// How P's transport ends the WRITEs posted to it.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum WriteFate {
    /// Done after two polls.
    Prompt,
    /// In progress past P's write timeout, then done.
    Overdue,
    /// Failed (the bytes may have landed).
    Failing,
    /// Refused by the transport when posted, after a while (a slow, then failing, post).
    Unposted,
    /// Each of the four in turn.
    Mixed,
}

/// How long P's table fences an ended key.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Fences {
    /// A minute: every late half in a run is refused.
    Long,
    /// 20 ms: keys come back within a run.
    Short,
}

/// One step of a script.
#[derive(Debug, Clone)]
pub enum Action {
    /// A D peer registers blocks.
    Register {
        peer: u8,
        key: KeySpec,
        request: u8,
        epoch: EpochSpec,
        groups: Groups,
        tokens: Tokens,
        ttl: Ttl,
        fanout: Fanout,
    },
    /// A D peer sends one of its registrations again: the same (a retransmission), at the next
    /// epoch (a re-registration after a preemption) or at the one before.
    Again { peer: u8, nth: u8, epoch: Shift },
    /// A D peer cancels one of its registrations, or anything.
    Cancel { peer: u8, target: Target },
    /// P's engine reports KV ready for transfer `k{key}`.
    Ready { key: u8, groups: Groups, tokens: Tokens, ttl: ReadyTtl },
    /// P's engine aborts transfer `k{key}`.
    Abort { key: u8 },
    /// A D peer sends a heartbeat of its own making.
    Heartbeat { peer: u8, clock_ms: u64, echo_ms: u64 },
    /// A D peer sends what only P sends.
    Reply { peer: u8, reply: Reply },
    /// Someone without the handshake writes bytes to P's port and goes.
    Stranger { bytes: Few<u8, 64> },
    /// A D peer's connection closes.
    Leave { peer: u8 },
    /// A D peer that left joins again.
    Return { peer: u8 },
    /// Time passes (at most 15 ms, within the script's budget).
    Wait { ms: u8 },
}

/// A transfer key: `k{base}`, or one of its slots.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub base: u8,
    /// Mostly none.
    pub slot: Option<u8>,
}

/// What a CANCEL names.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// The `n`th registration the peer sent (any, if it sent none).
    Sent(u8),
    Any {
        key: KeySpec,
        request: u8,
        epoch: EpochSpec,
    },
}

/// A registration's epoch, sent again.
#[derive(Debug, Clone, Copy)]
pub enum Shift {
    Same,
    Up,
    Down,
}

#[derive(Debug, Clone, Copy)]
pub enum EpochSpec {
    Small(u8),
    Max,
}

/// Block lists, one per KV cache group (mostly two, as many as the caches have), all of one
/// kind: a registration is mostly well-formed or hostile as a whole.
#[derive(Debug, Clone)]
pub struct Groups {
    pub count: u8,
    /// Where D's blocks start in the prompt (its cached prefix); P's always start at 0.
    pub first: FirstToken,
    pub blocks: Blocks,
    /// Each group's first block id, for a run.
    pub starts: [u8; 3],
}

#[derive(Debug, Clone, Copy)]
pub enum FirstToken {
    Zero,
    /// A whole number of blocks in.
    Blocks(u8),
    /// Not on a block boundary.
    Odd(u8),
}

#[derive(Debug, Clone)]
pub enum Blocks {
    /// Consecutive ids, as many as the prompt needs.
    Run,
    /// Any ids, repeats included.
    Ids(Few<u8, 8>),
    Empty,
    /// More ids than P's limits allow.
    Huge,
    /// `u32::MAX`.
    Far,
}

/// `num_tokens`: the key's prompt, fewer, any number, or `u64::MAX`.
#[derive(Debug, Clone, Copy)]
pub enum Tokens {
    Fit,
    Short(u8),
    Exactly(u16),
    Max,
}

/// A registration's `ttl_ms`.
#[derive(Debug, Clone, Copy)]
pub enum Ttl {
    /// Up to 200 ms.
    Short(u8),
    Zero,
    /// Ten seconds (beyond the run).
    Long,
    Max,
}

/// A ready request's TTL.
#[derive(Debug, Clone, Copy)]
pub enum ReadyTtl {
    /// Up to 150 ms.
    Short(u8),
    /// Thirty seconds (the end of the run aborts it).
    Long,
    /// Beyond `MAX_TTL`: refused.
    TooLong,
}

/// A registration's fan-out: 1, or 0 to 3 D ranks.
#[derive(Debug, Clone, Copy)]
pub enum Fanout {
    One,
    Of(u8),
}

/// What a D peer sends that only P should.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Reply {
    Fail { key: KeySpec, request: u8, reason: u8 },
    CancelAck { key: KeySpec, request: u8 },
    Error,
}

// Weighted draws (see `pick`): the first choice of each is the well-formed one.

impl<'a> Arbitrary<'a> for PeerShape {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[5, 3, 1, 1])? {
            0 => Self::Whole,
            1 => Self::Half { second: u.arbitrary()? },
            2 => Self::Coarse,
            _ => Self::Foreign,
        })
    }
}

impl<'a> Arbitrary<'a> for Metadata {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok([Self::Own, Self::Missing, Self::Unknown][pick(u, &[18, 1, 1])?])
    }
}

impl<'a> Arbitrary<'a> for Action {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[26, 7, 22, 4, 2, 2, 2, 3, 5, 12, 6])? {
            0 => Self::Register {
                peer: u.arbitrary()?,
                key: u.arbitrary()?,
                request: u.arbitrary()?,
                epoch: u.arbitrary()?,
                groups: u.arbitrary()?,
                tokens: u.arbitrary()?,
                ttl: u.arbitrary()?,
                fanout: u.arbitrary()?,
            },
            1 => Self::Cancel { peer: u.arbitrary()?, target: u.arbitrary()? },
            2 => Self::Ready {
                key: u.arbitrary()?,
                groups: u.arbitrary()?,
                tokens: u.arbitrary()?,
                ttl: u.arbitrary()?,
            },
            3 => Self::Abort { key: u.arbitrary()? },
            4 => Self::Heartbeat {
                peer: u.arbitrary()?,
                clock_ms: u.arbitrary()?,
                echo_ms: u.arbitrary()?,
            },
            5 => Self::Reply { peer: u.arbitrary()?, reply: u.arbitrary()? },
            6 => Self::Stranger { bytes: u.arbitrary()? },
            7 => Self::Leave { peer: u.arbitrary()? },
            8 => Self::Return { peer: u.arbitrary()? },
            9 => Self::Wait { ms: u.arbitrary()? },
            _ => Self::Again { peer: u.arbitrary()?, nth: u.arbitrary()?, epoch: u.arbitrary()? },
        })
    }
}

impl<'a> Arbitrary<'a> for Target {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[3, 1])? {
            0 => Self::Sent(u.arbitrary()?),
            _ => Self::Any { key: u.arbitrary()?, request: u.arbitrary()?, epoch: u.arbitrary()? },
        })
    }
}

impl<'a> Arbitrary<'a> for Shift {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok([Self::Same, Self::Up, Self::Down][pick(u, &[2, 2, 1])?])
    }
}

impl<'a> Arbitrary<'a> for KeySpec {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let base = u.arbitrary()?;
        let slot = match pick(u, &[3, 1])? {
            0 => None,
            _ => Some(u.arbitrary()?),
        };
        Ok(Self { base, slot })
    }
}

impl<'a> Arbitrary<'a> for EpochSpec {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[9, 1])? {
            0 => Self::Small(u.arbitrary()?),
            _ => Self::Max,
        })
    }
}

impl<'a> Arbitrary<'a> for Groups {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Self {
            count: [2, 1, 0, 3][pick(u, &[17, 1, 1, 1])?],
            first: u.arbitrary()?,
            blocks: u.arbitrary()?,
            starts: u.arbitrary()?,
        })
    }
}

impl<'a> Arbitrary<'a> for FirstToken {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[12, 5, 1])? {
            0 => Self::Zero,
            1 => Self::Blocks(u.arbitrary()?),
            _ => Self::Odd(u.arbitrary()?),
        })
    }
}

impl<'a> Arbitrary<'a> for Blocks {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[16, 1, 1, 1, 1])? {
            0 => Self::Run,
            1 => Self::Ids(u.arbitrary()?),
            2 => Self::Empty,
            3 => Self::Huge,
            _ => Self::Far,
        })
    }
}

impl<'a> Arbitrary<'a> for Tokens {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[17, 1, 1, 1])? {
            0 => Self::Fit,
            1 => Self::Short(u.arbitrary()?),
            2 => Self::Exactly(u.arbitrary()?),
            _ => Self::Max,
        })
    }
}

impl<'a> Arbitrary<'a> for Ttl {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[6, 3, 1, 1])? {
            0 => Self::Long,
            1 => Self::Short(u.arbitrary()?),
            2 => Self::Zero,
            _ => Self::Max,
        })
    }
}

impl<'a> Arbitrary<'a> for ReadyTtl {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[6, 3, 1])? {
            0 => Self::Long,
            1 => Self::Short(u.arbitrary()?),
            _ => Self::TooLong,
        })
    }
}

impl<'a> Arbitrary<'a> for Fanout {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match pick(u, &[4, 1])? {
            0 => Self::One,
            _ => Self::Of(u.arbitrary()?),
        })
    }
}

impl KeySpec {
    fn text(self) -> String {
        let base = format!("k{}", self.base % KEYS);
        match self.slot {
            None => base,
            Some(slot) => format!("{base}\u{1f}{}", slot % SLOTS),
        }
    }
}

impl EpochSpec {
    fn value(self) -> u64 {
        match self {
            Self::Small(n) => u64::from(n % 4),
            Self::Max => u64::MAX,
        }
    }
}

impl Blocks {
    /// The ids, `needed` of them from `start` for a run.
    fn ids(&self, start: u8, needed: u32) -> Vec<u32> {
        match self {
            // Inside a 16-block cache (some past an 8-block one).
            Self::Run => {
                let start = u32::from(start % 12);
                (start..start + needed).collect()
            }
            Self::Ids(ids) => ids.iter().map(|id| u32::from(id % BLOCK_IDS)).collect(),
            Self::Empty => Vec::new(),
            Self::Huge => (0..HUGE).map(|id| id % 16).collect(),
            Self::Far => vec![u32::MAX],
        }
    }
}

/// Block groups and a token count for a prompt of `prompt` tokens, on a worker whose blocks
/// hold `block_tokens` tokens. P's (`whole`) cover the prompt; D's may leave out a cached
/// prefix.
fn groups(
    spec: &Groups,
    tokens: Tokens,
    prompt: u64,
    block_tokens: u32,
    whole: bool,
) -> (Vec<BlockGroup>, u64) {
    let bt = u64::from(block_tokens);
    let first_token = match spec.first {
        _ if whole => 0,
        FirstToken::Zero => 0,
        FirstToken::Blocks(n) => (u64::from(n) % prompt.div_ceil(bt)) * bt,
        FirstToken::Odd(n) => u64::from(n % 13) + 1,
    };
    let needed = u32::try_from(prompt.saturating_sub(first_token).div_ceil(bt)).unwrap_or(0);
    let groups: Vec<BlockGroup> = spec.starts[..usize::from(spec.count)]
        .iter()
        .map(|&start| BlockGroup { first_token, block_ids: spec.blocks.ids(start, needed) })
        .collect();
    let tokens = match tokens {
        Tokens::Fit => prompt,
        Tokens::Short(n) => prompt.saturating_sub(u64::from(n % 5) + 1),
        Tokens::Exactly(n) => u64::from(n),
        Tokens::Max => u64::MAX,
    };
    (groups, tokens)
}

// ------------------------------------------------------------------------------------------
// P's transport, watched.

/// A WRITE P posted, as its transport saw it.
#[derive(Debug, Clone)]
struct Post {
    /// Tick before the post (the bytes move inside it) and once it finished.
    seq: u64,
    finished: Option<u64>,
    agent: String,
    runs: Vec<DescriptorRun>,
    notification: Option<Vec<u8>>,
}

/// P's loopback transport, recording every WRITE and ending each as the script's
/// [`WriteFate`] says.
struct Watched {
    inner: LoopbackTransport,
    fate: WriteFate,
    clock: Arc<Clock>,
    posts: Arc<Mutex<Vec<Post>>>,
    /// Each posted WRITE's record, and when it may complete (overdue) or that it fails.
    writes: HashMap<WriteId, (usize, Option<Instant>, bool)>,
    posted: u64,
}

impl Watched {
    fn finished(&mut self, post: usize) {
        let seq = self.clock.tick();
        if let Some(post) = self.posts.lock().unwrap_or_else(PoisonError::into_inner).get_mut(post)
        {
            post.finished = Some(seq);
        }
    }
}

impl Transport for Watched {
    fn name(&self) -> &str {
        self.inner.name()
    }
    unsafe fn register_memory(&mut self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        // SAFETY: forwarded; the caller's promise covers the inner transport.
        unsafe { self.inner.register_memory(regions) }
    }
    fn can_write_into(&self, remote: MemorySpace) -> Result<(), Unreachable> {
        self.inner.can_write_into(remote)
    }
    fn metadata(&mut self) -> Result<Vec<u8>, TransportError> {
        self.inner.metadata()
    }
    fn add_peer(&mut self, metadata: &[u8]) -> Result<String, TransportError> {
        self.inner.add_peer(metadata)
    }
    fn remove_peer(&mut self, peer: &str) -> Result<(), TransportError> {
        self.inner.remove_peer(peer)
    }
    fn post_write(
        &mut self,
        peer: &str,
        runs: &[DescriptorRun],
        local: MemorySpace,
        remote: MemorySpace,
        notification: Option<&[u8]>,
    ) -> Result<WriteId, TransportError> {
        let fate = match self.fate {
            WriteFate::Mixed => {
                [WriteFate::Prompt, WriteFate::Overdue, WriteFate::Failing, WriteFate::Unposted]
                    [(self.posted % 4) as usize]
            }
            fate => fate,
        };
        self.posted += 1;
        if matches!(fate, WriteFate::Unposted) {
            thread::sleep(UNPOSTED);
            return Err(TransportError::new("post_write", "injected: the transport refuses it"));
        }
        let seq = self.clock.tick();
        let write = self.inner.post_write(peer, runs, local, remote, notification)?;
        let mut posts = self.posts.lock().unwrap_or_else(PoisonError::into_inner);
        posts.push(Post {
            seq,
            finished: None,
            agent: peer.to_owned(),
            runs: runs.to_vec(),
            notification: notification.map(<[u8]>::to_vec),
        });
        let until = matches!(fate, WriteFate::Overdue).then(|| Instant::now() + OVERDUE);
        self.writes.insert(write, (posts.len() - 1, until, matches!(fate, WriteFate::Failing)));
        Ok(write)
    }
    fn poll_write(&mut self, write: WriteId) -> Result<WriteState, TransportError> {
        let Some(&(post, until, fails)) = self.writes.get(&write) else {
            return self.inner.poll_write(write);
        };
        if until.is_some_and(|until| Instant::now() < until) {
            return Ok(WriteState::InProgress);
        }
        if fails {
            self.writes.remove(&write);
            self.finished(post);
            return Err(TransportError::new("poll_write", "injected: the WRITE failed"));
        }
        let state = self.inner.poll_write(write)?;
        if state == WriteState::Done {
            self.writes.remove(&write);
            self.finished(post);
        }
        Ok(state)
    }
    fn send_notification(&mut self, peer: &str, payload: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, payload)
    }
    fn take_notifications(&mut self, out: &mut Vec<Notification>) -> Result<(), TransportError> {
        self.inner.take_notifications(out)
    }
}

// ------------------------------------------------------------------------------------------
// D peers.

/// What P told a D peer, on any of its connections, in order.
struct Inbox {
    clock: Arc<Clock>,
    messages: Mutex<Vec<(u64, Message)>>,
}

impl ControlHandler for Inbox {
    fn peer_joined(&self, _peer: &PeerInfo) -> Result<(), Refusal> {
        Ok(())
    }
    fn message(&self, _peer: PeerId, message: Message) {
        let seq = self.clock.tick();
        self.messages.lock().unwrap_or_else(PoisonError::into_inner).push((seq, message));
    }
    fn peer_lost(&self, _peer: PeerId, _reason: &str) {}
}

/// One scripted D peer; its fields drop in order (the channel before the agent before the
/// memory they use).
struct Peer {
    channel: SideChannel,
    inbox: Arc<Inbox>,
    agent: LoopbackTransport,
    cache: Cache,
    engine: String,
    /// Its connection to P while joined.
    joined: Option<PeerId>,
}

impl Peer {
    fn start(index: usize, spec: PeerSpec, clock: &Arc<Clock>) -> std::io::Result<Self> {
        let shape = match spec.shape {
            PeerShape::Whole => Shape::WHOLE,
            PeerShape::Half { second } => {
                Shape { heads: 1, tp_rank: u32::from(second), tp_size: 2, ..Shape::WHOLE }
            }
            PeerShape::Coarse => Shape { block_tokens: 8, num_blocks: 8, ..Shape::WHOLE },
            PeerShape::Foreign => Shape { head_bytes: 16, ..Shape::WHOLE },
        };
        let cache = Cache::new(shape, |_| CANARY);
        let engine = unique(&format!("harness-d{index}"));
        let mut agent = LoopbackTransport::new(unique(&format!("harness-d{index}-agent")))
            .map_err(std::io::Error::other)?;
        // SAFETY: `cache` outlives `agent` (the fields drop in order), and P's transport, which
        // may write into it too, is closed before any peer drops (see `Run::finish`).
        unsafe { agent.register_memory(&[cache.region()]) }.map_err(std::io::Error::other)?;
        let layout = cache.layout();
        let hello = Hello {
            engine_id: engine.clone(),
            tp_rank: shape.tp_rank,
            tp_size: shape.tp_size,
            pp_rank: 0,
            pp_size: 1,
            agent_name: agent.name().to_owned(),
            agent_metadata: match spec.metadata {
                Metadata::Own => agent.name().as_bytes().to_vec(),
                Metadata::Missing => Vec::new(),
                Metadata::Unknown => b"harness-nobody".to_vec(),
            },
            layout,
            compatibility: COMPATIBILITY.into(),
            versions: vec![PROTOCOL_VERSION],
            memory: MemorySpace::DRAM,
            nonce: 0,
            echo: 0,
            write_horizon_ms: 1_000,
            delivery_bound_ms: 1,
        };
        let mut config = SideChannelConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), &engine);
        config.secret = Some(secret(SECRET));
        // Generous: the peer sends what P's own limits refuse.
        config.limits = Limits { max_block_ids: 1 << 16, ..Limits::default() };
        config.heartbeat_interval = HEARTBEAT;
        config.peer_timeout = PEER_TIMEOUT;
        config.connect_timeout = JOIN_TIMEOUT;
        config.write_timeout = Duration::from_millis(300);
        let inbox = Arc::new(Inbox { clock: Arc::clone(clock), messages: Mutex::default() });
        let channel = SideChannel::start(config, hello, Arc::clone(&inbox) as _)?;
        Ok(Self { channel, inbox, agent, cache, engine, joined: None })
    }

    /// Joins P at `address` (three tries: one handshake on a busy machine may time out).
    fn join(&self, address: &str) -> Result<PeerId, String> {
        let mut last = String::new();
        for _ in 0..3 {
            match self.channel.connect(address) {
                Ok(peer) => return Ok(peer.id),
                Err(error) => last = error.to_string(),
            }
        }
        Err(last)
    }
}

/// Joins every peer in `join` at once (each handshake waits out P's accept poll).
fn join_all(peers: &mut [Peer], join: &[usize], address: &str) -> Vec<String> {
    let results: Vec<(usize, Result<PeerId, String>)> = thread::scope(|scope| {
        let handles: Vec<_> = join
            .iter()
            .map(|&i| {
                let peer = &peers[i];
                (i, scope.spawn(move || peer.join(address)))
            })
            .collect();
        handles
            .into_iter()
            .map(|(i, handle)| {
                (i, handle.join().unwrap_or_else(|_| Err("the join thread panicked".into())))
            })
            .collect()
    });
    let mut failures = Vec::new();
    for (i, result) in results {
        match result {
            Ok(id) => peers[i].joined = Some(id),
            Err(error) => failures.push(format!("D peer {i} could not join P: {error}")),
        }
    }
    failures
}

// ------------------------------------------------------------------------------------------
// A run.

/// A registration's (transfer key, request id, epoch): what P's replies and DONEs name.
type Triple = (String, String, u64);

fn describe(triple: &Triple) -> String {
    format!("transfer {:?} request {} epoch {}", triple.0, triple.1, triple.2)
}

/// A registration a peer sent.
struct Sent {
    seq: u64,
    peer: usize,
    register: Register,
}

impl Sent {
    fn triple(&self) -> Triple {
        let r = &self.register;
        (r.transfer_key.clone(), r.request_id.clone(), r.epoch)
    }
}

/// A `ready` call, and what became of it.
struct ReadyCall {
    request_id: String,
    key: String,
    accepted: bool,
    long: bool,
    /// An abort released its KV: no event follows.
    released: bool,
    /// Its send events.
    events: Vec<SendEvent>,
}

/// A send event, as the run saw it.
#[derive(Debug)]
struct SendEvent {
    /// The tick of the poll that saw it (it happened before).
    seq: u64,
    outcome: Outcome,
}

impl SendEvent {
    fn is_final(&self) -> bool {
        !matches!(self.outcome, Outcome::Quarantined(_))
    }
}

/// One run's state. `p` is declared first: it is dropped (and its transport with it) before
/// the memory of P and of the peers it may write into.
struct Run {
    p: Endpoint,
    peers: Vec<Peer>,
    /// P's KV memory, which its transport reads from until `p` is closed.
    _p_memory: Cache,
    clock: Arc<Clock>,
    posts: Arc<Mutex<Vec<Post>>>,
    sent: Vec<Sent>,
    /// The CANCELs peers sent: (tick, peer, what they cancel).
    cancels: Vec<(u64, usize, Triple)>,
    readies: Vec<ReadyCall>,
    /// Events for no `ready` call.
    strays: Vec<Event>,
    prompts: [u8; KEYS as usize],
    budget: Duration,
    violations: Vec<String>,
    known: Vec<Known>,
    panics_before: usize,
}

/// Runs `script` against a fresh P endpoint and reports what broke.
pub fn run(script: &Script) -> Report {
    let mut run = match Run::start(script) {
        Ok(run) => run,
        Err(error) => {
            return Report {
                violations: vec![format!("the run could not start: {error}")],
                ..Report::default()
            }
        }
    };
    for action in script.actions.iter() {
        run.act(action);
        run.poll();
        run.check_health("after an action");
    }
    run.finish()
}

impl Run {
    fn start(script: &Script) -> Result<Self, String> {
        let panics_before = panics().len();
        let clock = Arc::new(Clock::default());
        let p_cache = Cache::new(Shape::WHOLE, |i| (i % 127) as u8 + 1);
        let posts = Arc::new(Mutex::new(Vec::new()));
        let inner = LoopbackTransport::new(unique("harness-p-agent"))
            .map_err(|e| e.to_string())?
            .with_polls_until_done(2);
        let mut transport = Watched {
            inner,
            fate: script.writes,
            clock: Arc::clone(&clock),
            posts: Arc::clone(&posts),
            writes: HashMap::new(),
            posted: 0,
        };
        // SAFETY: `p_cache` outlives the endpoint that owns the transport (see `Run`).
        unsafe { transport.register_memory(&[p_cache.region()]) }.map_err(|e| e.to_string())?;
        let mut config = EndpointConfig::new(unique("harness-p"), p_cache.layout());
        config.compatibility = COMPATIBILITY.into();
        config.secret = Some(SECRET.to_vec());
        config.heartbeat_interval = HEARTBEAT;
        config.peer_timeout = PEER_TIMEOUT;
        config.write_timeout = WRITE_TIMEOUT;
        config.connect_timeout = CONNECT_TIMEOUT;
        config.max_registrations_per_host = QUOTA;
        config.table = TableConfig {
            shards: 4,
            max_entries: TABLE_ENTRIES,
            fence_ttl: match script.fences {
                Fences::Long => Duration::from_secs(60),
                Fences::Short => Duration::from_millis(20),
            },
        };
        config.limits = Limits { max_block_ids: MAX_BLOCK_IDS, ..Limits::default() };
        let p = Endpoint::start(config, transport).map_err(|e| e.to_string())?;
        let specs = if script.peers.is_empty() {
            vec![PeerSpec { shape: PeerShape::Whole, metadata: Metadata::Own }]
        } else {
            script.peers.iter().take(MAX_PEERS).copied().collect()
        };
        let mut peers = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            peers.push(Peer::start(i, spec, &clock).map_err(|e| e.to_string())?);
        }
        let all: Vec<usize> = (0..peers.len()).collect();
        let violations = join_all(&mut peers, &all, &p.address().to_string());
        Ok(Self {
            p,
            peers,
            _p_memory: p_cache,
            clock,
            posts,
            sent: Vec::new(),
            cancels: Vec::new(),
            readies: Vec::new(),
            strays: Vec::new(),
            prompts: script.prompts,
            budget: WAIT_BUDGET,
            violations,
            known: Vec::new(),
            panics_before,
        })
    }

    /// The `nth` registration peer `i` sent (counting round), if it sent any.
    fn nth_sent(&self, i: usize, nth: u8) -> Option<Register> {
        let mine: Vec<&Sent> = self.sent.iter().filter(|s| s.peer == i).collect();
        (!mine.is_empty()).then(|| mine[usize::from(nth) % mine.len()].register.clone())
    }

    /// Transfer `k{key}`'s prompt, in tokens.
    fn prompt(&self, key: u8) -> u64 {
        (1 + u64::from(self.prompts[usize::from(key % KEYS)] % 4))
            * u64::from(Shape::WHOLE.block_tokens)
    }

    fn peer(&self, peer: u8) -> usize {
        usize::from(peer) % self.peers.len()
    }

    /// The peer's connection to P, and a tick taken before anything is sent on it.
    fn send(&self, peer: usize, message: &Message) -> Option<u64> {
        let id = self.peers[peer].joined?;
        let seq = self.clock.tick();
        // A refused send (P's connection gone, a message the peer's own limits refuse) sent
        // nothing P could act on.
        self.peers[peer].channel.send(id, message).ok().map(|()| seq)
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::Register { peer, key, request, epoch, groups: specs, tokens, ttl, fanout } => {
                let i = self.peer(*peer);
                let shape = self.peers[i].cache.shape();
                let prompt = self.prompt(key.base);
                let (groups, num_tokens) =
                    groups(specs, *tokens, prompt, shape.block_tokens, false);
                let register = Register {
                    transfer_key: key.text(),
                    request_id: format!("d{i}-r{}", request % REQUESTS),
                    epoch: epoch.value(),
                    engine_id: self.peers[i].engine.clone(),
                    address: self.peers[i].channel.local_addr().to_string(),
                    tp_rank: shape.tp_rank,
                    tp_size: shape.tp_size,
                    groups,
                    num_tokens,
                    ttl_ms: match ttl {
                        Ttl::Short(ms) => u64::from(ms % 200) + 1,
                        Ttl::Zero => 0,
                        Ttl::Long => 10_000,
                        Ttl::Max => u64::MAX,
                    },
                    fanout: match fanout {
                        Fanout::One => 1,
                        Fanout::Of(n) => u32::from(n % 4),
                    },
                    // As a real D picks one per registration; P echoes it in the DONE.
                    nonce: (i as u64 + 1)
                        .wrapping_mul(1_000_003)
                        .wrapping_add(u64::from(*request).wrapping_mul(7_919))
                        .wrapping_add(epoch.value()),
                };
                if let Some(seq) = self.send(i, &Message::Register(register.clone())) {
                    self.sent.push(Sent { seq, peer: i, register });
                }
            }
            Action::Again { peer, nth, epoch } => {
                let i = self.peer(*peer);
                let Some(mut register) = self.nth_sent(i, *nth) else { return };
                register.epoch = match epoch {
                    Shift::Same => register.epoch,
                    Shift::Up => register.epoch.wrapping_add(1),
                    Shift::Down => register.epoch.wrapping_sub(1),
                };
                if let Some(seq) = self.send(i, &Message::Register(register.clone())) {
                    self.sent.push(Sent { seq, peer: i, register });
                }
            }
            Action::Cancel { peer, target } => {
                let i = self.peer(*peer);
                let cancel = match *target {
                    Target::Sent(nth) => self.nth_sent(i, nth).map(|r| Cancel {
                        transfer_key: r.transfer_key,
                        request_id: r.request_id,
                        epoch: r.epoch,
                    }),
                    Target::Any { .. } => None,
                };
                let cancel = cancel.unwrap_or_else(|| {
                    let (key, request, epoch) = match *target {
                        Target::Any { key, request, epoch } => (key, request, epoch),
                        Target::Sent(n) => {
                            (KeySpec { base: n, slot: None }, n, EpochSpec::Small(n))
                        }
                    };
                    Cancel {
                        transfer_key: key.text(),
                        request_id: format!("d{i}-r{}", request % REQUESTS),
                        epoch: epoch.value(),
                    }
                });
                let triple = (cancel.transfer_key.clone(), cancel.request_id.clone(), cancel.epoch);
                if let Some(seq) = self.send(i, &Message::Cancel(cancel)) {
                    self.cancels.push((seq, i, triple));
                }
            }
            Action::Ready { key, groups: specs, tokens, ttl } => {
                let prompt = self.prompt(*key);
                let (groups, num_tokens) =
                    groups(specs, *tokens, prompt, Shape::WHOLE.block_tokens, true);
                let key = format!("k{}", key % KEYS);
                let request_id = format!("p-{}", self.readies.len());
                let ready = ReadyKv {
                    request_id: request_id.clone(),
                    transfer_id: Some(key.clone()),
                    groups,
                    num_tokens,
                    ttl: match ttl {
                        ReadyTtl::Short(ms) => Duration::from_millis(u64::from(ms % 150)),
                        ReadyTtl::Long => Duration::from_secs(30),
                        ReadyTtl::TooLong => {
                            kvpush_core::endpoint::MAX_TTL + Duration::from_secs(1)
                        }
                    },
                };
                let result = self.p.ready(ready);
                if let Err(error) = &result {
                    if error.to_string().is_empty() {
                        self.violations
                            .push(format!("ready {request_id} refused without a reason"));
                    }
                }
                self.readies.push(ReadyCall {
                    request_id,
                    key,
                    accepted: result.is_ok(),
                    long: matches!(ttl, ReadyTtl::Long),
                    released: false,
                    events: Vec::new(),
                });
            }
            Action::Abort { key } => {
                let key = format!("k{}", key % KEYS);
                self.abort(&key);
            }
            Action::Heartbeat { peer, clock_ms, echo_ms } => {
                let i = self.peer(*peer);
                let heartbeat = Heartbeat {
                    engine_id: self.peers[i].engine.clone(),
                    seq: 1,
                    pending: 0,
                    clock_ms: *clock_ms,
                    echo_ms: *echo_ms,
                };
                self.send(i, &Message::Heartbeat(heartbeat));
            }
            Action::Reply { peer, reply } => {
                let i = self.peer(*peer);
                let message = match *reply {
                    Reply::Fail { key, request, reason } => Message::Fail(Fail {
                        transfer_key: key.text(),
                        request_id: format!("d{i}-r{}", request % REQUESTS),
                        epoch: 1,
                        reason: FailReason::KNOWN[usize::from(reason) % FailReason::KNOWN.len()]
                            .clone(),
                        detail: "a D peer sends a FAIL".into(),
                    }),
                    Reply::CancelAck { key, request } => Message::CancelAck(CancelAck {
                        transfer_key: key.text(),
                        request_id: format!("d{i}-r{}", request % REQUESTS),
                        epoch: 1,
                        wrote: true,
                        delivered: true,
                    }),
                    Reply::Error => Message::Error(ErrorReply {
                        code: "invalid".into(),
                        detail: "a D peer sends an error".into(),
                    }),
                };
                self.send(i, &message);
            }
            Action::Stranger { bytes } => {
                let address = self.p.address();
                if let Ok(socket) = TcpStream::connect_timeout(&address, Duration::from_millis(50))
                {
                    let _ = socket.set_write_timeout(Some(Duration::from_millis(20)));
                    let _ = (&socket).write_all(bytes);
                }
            }
            Action::Leave { peer } => {
                let i = self.peer(*peer);
                if let Some(id) = self.peers[i].joined.take() {
                    self.peers[i].channel.disconnect(id);
                }
            }
            Action::Return { peer } => {
                let i = self.peer(*peer);
                if self.peers[i].joined.is_none() {
                    let address = self.p.address().to_string();
                    let failures = join_all(&mut self.peers, &[i], &address);
                    self.violations.extend(failures);
                }
            }
            Action::Wait { ms } => {
                let nap = Duration::from_millis(u64::from(ms % 16)).min(self.budget);
                self.budget -= nap;
                thread::sleep(nap);
            }
        }
    }

    /// P's engine aborts `key`. `Released` ends the latest `ready` of that key (no event
    /// follows) if it had not ended yet; it may also have released only a D registration.
    fn abort(&mut self, key: &str) {
        // Events first: a ready whose end was already reported is not what the abort released.
        self.poll();
        let current = self.readies.iter().rposition(|r| r.accepted && r.key == key);
        let request_id =
            current.map_or("p-none".to_owned(), |i| self.readies[i].request_id.clone());
        let outcome = self.p.abort(&request_id, Some(key));
        if let (Some(i), Ok(AbortOutcome::Released)) = (current, outcome) {
            if !Self::ended(&self.readies[i]) {
                self.readies[i].released = true;
            }
        }
    }

    /// Takes P's events, each stamped with a tick taken once the poll returned (it happened
    /// before then).
    fn poll(&mut self) {
        let events = self.p.poll();
        let seq = self.clock.tick();
        for event in events {
            match self.readies.iter_mut().find(|r| r.accepted && r.request_id == event.request_id) {
                Some(ready) if event.role == Role::Send => {
                    ready.events.push(SendEvent { seq, outcome: event.outcome.clone() });
                }
                _ => self.strays.push(event.clone()),
            }
            if let Some(cause) = event.outcome.cause() {
                if cause.detail.is_empty() {
                    self.violations.push(format!("{event:?} carries no detail"));
                }
            }
        }
    }

    fn check_health(&mut self, when: &str) {
        if let Err(reason) = self.p.health() {
            let line = format!("P is unhealthy {when}: {reason}");
            if !self.violations.contains(&line) {
                self.violations.push(line);
            }
        }
    }

    /// Whether `ready` has its end: a final event, or an abort that released it.
    fn ended(ready: &ReadyCall) -> bool {
        !ready.accepted || ready.released || ready.events.iter().any(SendEvent::is_final)
    }

    /// Fan-out groups P still holds. Only the endpoint's `Debug` shows them.
    /// Fan-out groups P still holds: those P's KV was placed in, and those still waiting for
    /// it. Only the endpoint's `Debug` shows them.
    fn fanout_groups(&self) -> (usize, usize) {
        let debug = format!("{:?}", self.p);
        let groups = debug.matches("FanOut {").count();
        // Each piece holds one group's fields (and what follows it, up to the next group).
        let placed =
            debug.split("FanOut {").skip(1).filter(|group| !group.contains("ready: None")).count();
        (placed, groups - placed)
    }

    fn finish(mut self) -> Report {
        // Every peer leaves; P's engine aborts what it keeps beyond the run.
        for peer in &mut self.peers {
            if let Some(id) = peer.joined.take() {
                peer.channel.disconnect(id);
            }
        }
        let long: Vec<String> = self
            .readies
            .iter()
            .filter(|r| r.long && !Self::ended(r))
            .map(|r| r.key.clone())
            .collect();
        for key in long {
            self.abort(&key);
        }
        let deadline = Instant::now() + SETTLE;
        let settled = loop {
            self.poll();
            if self.p.pending() == 0
                && self.fanout_groups().0 == 0
                && self.readies.iter().all(Self::ended)
            {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            thread::sleep(Duration::from_millis(2));
        };
        self.check_health("at the end");
        let (placed, waiting) = self.fanout_groups();
        if !settled && (self.p.pending() != 0 || placed != 0) {
            self.violations.push(format!(
                "{SETTLE:?} after every peer left and every TTL passed, P still holds {} \
                 transfers and {placed} fan-out groups with its KV",
                self.p.pending()
            ));
        }
        if waiting != 0 {
            self.violations.push(format!(
                "after every peer left and every TTL passed, P still holds {waiting} fan-out \
                 groups that P's KV never came for"
            ));
        }
        if let Err(stuck) = self.p.close() {
            self.violations.push(format!("P's endpoint did not close: {stuck}"));
        }
        self.poll();
        self.check();
        let posts = self.posts.lock().unwrap_or_else(PoisonError::into_inner).len();
        let events = tally(self.readies.iter().flat_map(|r| r.events.iter().map(|e| &e.outcome)));
        Report {
            summary: format!(
                "{} peers, {} registrations, {} readies, {posts} writes; events: {events}",
                self.peers.len(),
                self.sent.len(),
                self.readies.len()
            ),
            violations: self.violations,
            known: self.known,
        }
    }

    // ---- the checks, once P is closed ------------------------------------------------------

    fn check(&mut self) {
        let panics = panics();
        for panic in panics.iter().skip(self.panics_before) {
            self.violations.push(format!("a thread panicked: {panic}"));
        }
        self.check_sends();
        self.check_replies();
        self.check_writes();
        self.check_memory();
    }

    fn check_sends(&mut self) {
        for event in &self.strays {
            self.violations
                .push(format!("P reported a send no accepted ready asked for: {event:?}"));
        }
        for ready in &self.readies {
            let id = &ready.request_id;
            let quarantined: Vec<&SendEvent> =
                ready.events.iter().filter(|e| !e.is_final()).collect();
            let finals: Vec<&SendEvent> = ready.events.iter().filter(|e| e.is_final()).collect();
            if quarantined.len() > 1 {
                self.violations
                    .push(format!("send {id}: {} quarantined notices", quarantined.len()));
            }
            if let (Some(q), Some(f)) = (quarantined.first(), finals.first()) {
                if q.seq > f.seq {
                    self.violations.push(format!("send {id}: quarantined after its final event"));
                }
            }
            let ends = finals.len() + usize::from(ready.released);
            if !ready.accepted || ends == 1 {
                continue;
            }
            let line = format!(
                "send {id} (transfer {}): {} final events{}, expected exactly one end: {:?}",
                ready.key,
                finals.len(),
                if ready.released { " after an abort released it" } else { "" },
                ready.events
            );
            self.violations.push(line);
        }
    }

    /// Every FAIL names a reason this build knows and a detail; every error reply a code.
    fn check_replies(&mut self) {
        for (i, peer) in self.peers.iter().enumerate() {
            let messages = peer.inbox.messages.lock().unwrap_or_else(PoisonError::into_inner);
            for (_, message) in messages.iter() {
                let reasonless = match message {
                    Message::Fail(fail) => {
                        matches!(fail.reason, FailReason::Unknown(_)) || fail.detail.is_empty()
                    }
                    Message::Error(error) => error.code.is_empty(),
                    _ => false,
                };
                if reasonless {
                    self.violations
                        .push(format!("P told D peer {i} without a reason: {message:?}"));
                }
            }
        }
    }

    /// Every WRITE P posted, against what the peer it wrote into registered and was told.
    fn check_writes(&mut self) {
        let posts = self.posts.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let mut decoder = Decoder::new(Some(secret(SECRET)), Limits::default());
        for post in &posts {
            let Some(notification) = &post.notification else {
                self.violations.push("P posted a WRITE with no notification".to_owned());
                continue;
            };
            let decoded =
                decoder.decode_unordered(notification, unix_millis(), Duration::from_secs(3_600));
            let done = match decoded.map(|envelope| envelope.message) {
                Ok(Message::Done(done)) => done,
                other => {
                    self.violations.push(format!("P's WRITE carries no DONE: {other:?}"));
                    continue;
                }
            };
            let triple: Triple = (done.transfer_key, done.request_id, done.epoch);
            let what = format!("P's WRITE of {}", describe(&triple));
            let Some(i) = self.peers.iter().position(|peer| peer.agent.name() == post.agent) else {
                self.violations.push(format!("{what} went to agent {}, no D peer's", post.agent));
                continue;
            };
            let registered: Vec<&Sent> = self
                .sent
                .iter()
                .filter(|s| s.peer == i && s.triple() == triple && s.seq < post.seq)
                .collect();
            if registered.is_empty() {
                self.violations
                    .push(format!("{what} into D peer {i}, which had not registered it"));
                continue;
            }
            let allowed = self.allowed(i, &registered);
            if let Some(run) =
                post.runs.iter().find(|run| !covered(&allowed, run.dst..run.dst + run.len))
            {
                self.violations.push(format!(
                    "{what} into D peer {i} lands outside the blocks it registered: {run:?}"
                ));
            }
            for (seq, word, trigger) in self.words(i, &triple) {
                // A registration sent after what P answered can be written whatever P said.
                let revived = self.sent.iter().any(|s| {
                    s.peer == i && s.triple() == triple && trigger < s.seq && s.seq < post.seq
                });
                if revived {
                    continue;
                }
                let line = if seq < post.seq {
                    format!(
                        "{what} into D peer {i} was posted after P told the peer it would not be \
                         written: {word:?}"
                    )
                } else if post.finished.is_none_or(|finished| seq < finished) {
                    format!(
                        "P told D peer {i} {word:?} while its WRITE of that registration was \
                         still in flight: the peer would free blocks the WRITE lands in"
                    )
                } else {
                    continue;
                };
                // A FAIL that answers the peer's second registration of the triple, refused
                // before it reached the table (host quota, fan-out), while the first stands.
                self.violations.push(line);
            }
        }
    }

    /// What P told peer `i` that ends `triple` on a D (a FAIL other than quarantined, a
    /// CANCEL_ACK): each with the tick it arrived at, and the tick of what it answers at the
    /// earliest. A FAIL ends every registration of the triple D had sent when it arrives; a
    /// CANCEL_ACK answers a CANCEL, the earliest one sent since the previous acknowledgement.
    fn words(&self, i: usize, triple: &Triple) -> Vec<(u64, Message, u64)> {
        let messages = self.peers[i].inbox.messages.lock().unwrap_or_else(PoisonError::into_inner);
        let mut words = Vec::new();
        let mut previous_ack = 0;
        for (seq, message) in messages.iter() {
            match message {
                Message::Fail(f)
                    if f.reason != FailReason::Quarantined
                        && (&f.transfer_key, &f.request_id, f.epoch)
                            == (&triple.0, &triple.1, triple.2) =>
                {
                    words.push((*seq, message.clone(), *seq));
                }
                Message::CancelAck(a)
                    if (&a.transfer_key, &a.request_id, a.epoch)
                        == (&triple.0, &triple.1, triple.2) =>
                {
                    let asked = self
                        .cancels
                        .iter()
                        .filter(|(sent, peer, t)| {
                            *peer == i && t == triple && previous_ack < *sent && sent < seq
                        })
                        .map(|(sent, ..)| *sent)
                        .min()
                        .unwrap_or(*seq);
                    previous_ack = *seq;
                    words.push((*seq, message.clone(), asked));
                }
                _ => {}
            }
        }
        words
    }

    /// The address ranges of every block the registrations `sent` by peer `i` name.
    fn allowed(&self, i: usize, sent: &[&Sent]) -> Vec<Range<u64>> {
        let cache = &self.peers[i].cache;
        let mut ranges: Vec<Range<u64>> = Vec::new();
        for s in sent {
            for (g, group) in s.register.groups.iter().enumerate() {
                for &block in &group.block_ids {
                    ranges.extend(cache.block_addresses(g as u32, block));
                }
            }
        }
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::new();
        for range in ranges {
            match merged.last_mut() {
                Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
                _ => merged.push(range),
            }
        }
        merged
    }

    /// Each peer's memory outside every block it ever registered holds its canary.
    fn check_memory(&mut self) {
        for (i, peer) in self.peers.iter().enumerate() {
            let allowed: HashSet<(u32, u32)> =
                self.sent
                    .iter()
                    .filter(|s| s.peer == i)
                    .flat_map(|s| {
                        s.register.groups.iter().enumerate().flat_map(|(g, group)| {
                            group.block_ids.iter().map(move |&b| (g as u32, b))
                        })
                    })
                    .collect();
            let strays = peer.cache.strays(CANARY, &allowed);
            if !strays.is_empty() {
                self.violations.push(format!(
                    "D peer {i}'s memory changed outside every block it registered: {}",
                    strays.join(", ")
                ));
            }
        }
    }
}

/// Whether `range` lies inside one of `merged` (sorted, disjoint).
fn covered(merged: &[Range<u64>], range: Range<u64>) -> bool {
    merged.iter().any(|m| m.start <= range.start && range.end <= m.end)
}

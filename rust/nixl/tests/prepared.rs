//! WRITEs from prepared descriptor lists (`post_block_write`) against the fresh-list path
//! (`post_write`) on two NIXL agents in one process: the same block pairs, sent both ways into
//! the same starting memory, leave B's memory byte for byte the same, and as a plain copy of the
//! blocks would. Fragmented and contiguous blocks, padded and dense strides, a peer removed and
//! added again, and prepared and fresh writes in flight together.
//!
//! Needs `KVPUSH_NIXL_CAPI`; prints SKIP and passes without it (fails under
//! `KVPUSH_REQUIRE_NIXL`). Run with `UCX_NET_DEVICES=lo`.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvpush_core::planner::DescriptorRun;
use kvpush_core::transport::{
    BlockArray, BlockWrite, MemoryRegion, MemorySpace, Notification, Transport, WriteId, WriteState,
};
use kvpush_nixl::{AgentConfig, Library, NixlTransport};

const REGIONS: u32 = 4;
const BLOCKS: u32 = 64;
const BLOCK: u64 = 2048;
/// B's blocks are padded in odd regions (so nothing merges there) and dense in even ones.
const PADDED: u64 = 2560;
const DEADLINE: Duration = Duration::from_secs(10);

/// NIXL tests run one at a time: two cores, and each test's agents are progressed by its thread.
static SERIAL: Mutex<()> = Mutex::new(());

fn library() -> Option<Library> {
    let path = common::capi_path()?;
    Some(Library::load(&path).unwrap_or_else(|e| panic!("{e}")))
}

/// Memory NIXL writes into behind the compiler's back: read and reset only through its pointer,
/// and only while no write into it is in flight.
struct Memory {
    ptr: *mut u8,
    len: usize,
    _owner: Vec<u8>,
}

impl Memory {
    fn new(len: usize, seed: u8) -> Self {
        let mut owner: Vec<u8> =
            (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        Self { ptr: owner.as_mut_ptr(), len, _owner: owner }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn region(&self) -> MemoryRegion {
        MemoryRegion { addr: self.addr(), len: self.len as u64, space: MemorySpace::DRAM }
    }

    fn snapshot(&self) -> Vec<u8> {
        // SAFETY: `ptr` is valid for `len` bytes (owned by `_owner`), and no write is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }

    fn restore(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len);
        // SAFETY: as in `snapshot`; `bytes` is another allocation.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr, self.len) };
    }
}

/// One side's block table: `REGIONS` arrays of `BLOCKS` blocks, `stride(region)` apart.
fn table(memory: &Memory, stride: impl Fn(u32) -> u64) -> Vec<BlockArray> {
    let mut base = memory.addr();
    (0..REGIONS)
        .map(|r| {
            let array = BlockArray { base, stride: stride(r), len: BLOCK, count: BLOCKS };
            base += stride(r) * u64::from(BLOCKS);
            array
        })
        .collect()
}

fn table_bytes(table: &[BlockArray]) -> usize {
    table.iter().map(|a| (a.stride * u64::from(a.count)) as usize).sum()
}

/// A request: (P block, D block) pairs in token order, as indices (every region writes the same
/// blocks) and as runs, merged where contiguous on both sides.
struct Request {
    src: Vec<u32>,
    dst: Vec<u32>,
    runs: Vec<DescriptorRun>,
}

impl Request {
    fn new(pairs: &[(u32, u32)], src_table: &[BlockArray], dst_table: &[BlockArray]) -> Self {
        let (mut src, mut dst, mut runs) = (Vec::new(), Vec::new(), Vec::<DescriptorRun>::new());
        for (r, (s_array, d_array)) in src_table.iter().zip(dst_table).enumerate() {
            let r = r as u32;
            for &(s, d) in pairs {
                src.push(r * BLOCKS + s);
                dst.push(r * BLOCKS + d);
                let run = DescriptorRun {
                    src: s_array.base + u64::from(s) * s_array.stride,
                    dst: d_array.base + u64::from(d) * d_array.stride,
                    len: BLOCK,
                };
                match runs.last_mut() {
                    Some(open)
                        if open.src + open.len == run.src && open.dst + open.len == run.dst =>
                    {
                        open.len += run.len;
                    }
                    _ => runs.push(run),
                }
            }
        }
        Self { src, dst, runs }
    }

    fn block_write<'a>(&'a self, src: &'a [BlockArray], dst: &'a [BlockArray]) -> BlockWrite<'a> {
        BlockWrite {
            runs: &self.runs,
            src_blocks: src,
            dst_blocks: dst,
            src: &self.src,
            dst: &self.dst,
        }
    }

    /// `b` after a plain copy of the request's runs from `a`.
    fn expected(&self, a: &Memory, a_bytes: &[u8], b: &Memory, b_bytes: &[u8]) -> Vec<u8> {
        let mut out = b_bytes.to_vec();
        for run in &self.runs {
            let (s, d, n) =
                ((run.src - a.addr()) as usize, (run.dst - b.addr()) as usize, run.len as usize);
            out[d..d + n].copy_from_slice(&a_bytes[s..s + n]);
        }
        out
    }
}

/// `count` distinct blocks out of `BLOCKS`, shuffled by a fixed generator (so a failure
/// reproduces), paired with another such list.
fn fragmented(count: usize, seed: u64) -> Vec<(u32, u32)> {
    let mut x = seed;
    let mut shuffled = |n: u32| {
        let mut ids: Vec<u32> = (0..n).collect();
        for i in (1..ids.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ids.swap(i, (x % (i as u64 + 1)) as usize);
        }
        ids
    };
    let (src, dst) = (shuffled(BLOCKS), shuffled(BLOCKS));
    src.into_iter().zip(dst).take(count).collect()
}

struct Pair {
    a: NixlTransport,
    b: NixlTransport,
    a_mem: Memory,
    b_mem: Memory,
    src_table: Vec<BlockArray>,
    dst_table: Vec<BlockArray>,
    b_notes: Vec<Notification>,
}

impl Pair {
    fn new(library: &Library, tag: &str) -> Self {
        let config = AgentConfig::default();
        let a_mem = Memory::new((u64::from(REGIONS * BLOCKS) * BLOCK) as usize, 1);
        let b_mem = Memory::new((u64::from(REGIONS * BLOCKS) * PADDED) as usize, 2);
        let src_table = table(&a_mem, |_| BLOCK);
        let dst_table = table(&b_mem, |r| if r % 2 == 1 { PADDED } else { BLOCK });
        assert!(table_bytes(&src_table) <= a_mem.len && table_bytes(&dst_table) <= b_mem.len);
        let mut a = NixlTransport::new(library, &format!("{tag}-A"), &config).expect("agent A");
        let mut b = NixlTransport::new(library, &format!("{tag}-B"), &config).expect("agent B");
        // SAFETY: both memories outlive both agents (fields drop in declaration order).
        unsafe {
            a.register_memory(&[a_mem.region()]).expect("register A");
            b.register_memory(&[b_mem.region()]).expect("register B");
        }
        let b_md = b.metadata().expect("metadata");
        assert_eq!(a.add_peer(&b_md).expect("add_peer"), b.name());
        let a_md = a.metadata().expect("metadata");
        b.add_peer(&a_md).expect("add_peer");
        Self { a, b, a_mem, b_mem, src_table, dst_table, b_notes: Vec::new() }
    }

    fn peer(&self) -> String {
        self.b.name().to_owned()
    }

    fn post(&mut self, request: &Request, prepared: bool, note: &[u8]) -> WriteId {
        let peer = self.peer();
        let (dram, a) = (MemorySpace::DRAM, &mut self.a);
        let posted = if prepared {
            let write = request.block_write(&self.src_table, &self.dst_table);
            a.post_block_write(&peer, &write, dram, dram, Some(note))
        } else {
            a.post_write(&peer, &request.runs, dram, dram, Some(note))
        };
        posted.unwrap_or_else(|e| panic!("post (prepared: {prepared}): {e}"))
    }

    /// Progresses both agents until every write in `writes` is done and B holds `notes`
    /// notifications in all.
    fn finish(&mut self, writes: &[WriteId], notes: usize) {
        let start = Instant::now();
        let mut pending = writes.to_vec();
        let mut a_notes = Vec::new();
        loop {
            self.a.take_notifications(&mut a_notes).expect("take_notifications");
            self.b.take_notifications(&mut self.b_notes).expect("take_notifications");
            pending
                .retain(|&w| self.a.poll_write(w).expect("poll_write") == WriteState::InProgress);
            if pending.is_empty() && self.b_notes.len() >= notes {
                return;
            }
            assert!(start.elapsed() < DEADLINE, "timed out: {pending:?} in flight");
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Writes `request` the prepared way and the fresh way into the same starting memory; both
    /// results must equal the plain copy.
    fn compare(&mut self, request: &Request, what: &str) {
        let (a_bytes, b_start) = (self.a_mem.snapshot(), self.b_mem.snapshot());
        let expected = request.expected(&self.a_mem, &a_bytes, &self.b_mem, &b_start);
        assert!(expected != b_start, "{what}: the request changes nothing");
        let mut results = Vec::new();
        for prepared in [true, false] {
            self.b_mem.restore(&b_start);
            let before = self.a.prepared_writes();
            self.b_notes.clear();
            let write = self.post(request, prepared, what.as_bytes());
            assert_eq!(self.a.prepared_writes() - before, u64::from(prepared), "{what}");
            self.finish(&[write], 1);
            assert_eq!(self.b_notes[0].payload, what.as_bytes());
            results.push(self.b_mem.snapshot());
        }
        assert!(results[0] == expected, "{what}: the prepared WRITE differs from the copy");
        assert!(results[1] == expected, "{what}: the fresh WRITE differs from the copy");
    }
}

#[test]
fn prepared_writes_equal_fresh_ones_byte_for_byte() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let mut pair = Pair::new(&library, "prep-eq");
    let (src, dst) = (pair.src_table.clone(), pair.dst_table.clone());
    let scattered = Request::new(&fragmented(40, 0x9E37_79B9_7F4A_7C15), &src, &dst);
    pair.compare(&scattered, "fragmented");
    assert_eq!(pair.a.prepared_lists(), (1, 1), "one list per side, prepared once");
    let contiguous: Vec<(u32, u32)> = (0..48).map(|i| (i + 3, i + 10)).collect();
    let contiguous = Request::new(&contiguous, &src, &dst);
    assert!(contiguous.runs.len() < contiguous.src.len(), "dense regions merge");
    pair.compare(&contiguous, "contiguous");
    assert_eq!(pair.a.prepared_lists(), (1, 1), "the same tables reuse their lists");
}

#[test]
fn a_peer_removed_and_added_again_is_prepared_again() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let mut pair = Pair::new(&library, "prep-readd");
    let (src, dst) = (pair.src_table.clone(), pair.dst_table.clone());
    let request = Request::new(&fragmented(24, 7), &src, &dst);
    pair.compare(&request, "before");
    let peer = pair.peer();
    pair.a.remove_peer(&peer).expect("remove_peer");
    assert_eq!(pair.a.prepared_lists(), (1, 0), "the peer's lists went with it");
    let refused = pair.a.post_block_write(
        &peer,
        &request.block_write(&src, &dst),
        MemorySpace::DRAM,
        MemorySpace::DRAM,
        Some(b"x"),
    );
    assert!(refused.unwrap_err().detail.contains("unknown peer"));
    let b_md = pair.b.metadata().expect("metadata");
    pair.a.add_peer(&b_md).expect("add_peer");
    let other = Request::new(&fragmented(24, 11), &src, &dst);
    pair.compare(&other, "after");
    assert_eq!(pair.a.prepared_lists(), (1, 1));
    // Added again while known: its lists are prepared again against the metadata just loaded.
    pair.a.add_peer(&b_md).expect("add_peer");
    assert_eq!(pair.a.prepared_lists(), (1, 0));
    let third = Request::new(&fragmented(24, 13), &src, &dst);
    pair.compare(&third, "re-added");
}

#[test]
fn prepared_and_fresh_writes_in_flight_together() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let mut pair = Pair::new(&library, "prep-mix");
    let (src, dst) = (pair.src_table.clone(), pair.dst_table.clone());
    // Disjoint D blocks: three requests that land side by side.
    let all = fragmented(60, 3);
    let requests: Vec<Request> =
        all.chunks(20).map(|pairs| Request::new(pairs, &src, &dst)).collect();
    let (a_bytes, mut expected) = (pair.a_mem.snapshot(), pair.b_mem.snapshot());
    for request in &requests {
        expected = request.expected(&pair.a_mem, &a_bytes, &pair.b_mem, &expected);
    }
    let writes: Vec<WriteId> = requests
        .iter()
        .enumerate()
        .map(|(i, request)| pair.post(request, i != 1, format!("write {i}").as_bytes()))
        .collect();
    assert_eq!(pair.a.writes_in_flight(), 3);
    assert_eq!(pair.a.prepared_writes(), 2);
    pair.finish(&writes, 3);
    let mut notes: Vec<Vec<u8>> = pair.b_notes.iter().map(|n| n.payload.clone()).collect();
    notes.sort();
    assert_eq!(notes, [b"write 0".to_vec(), b"write 1".to_vec(), b"write 2".to_vec()]);
    assert!(pair.b_mem.snapshot() == expected, "B's memory differs from the three copies");
}

#[test]
fn a_table_nixl_will_not_prepare_goes_the_fresh_way() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let mut pair = Pair::new(&library, "prep-refused");
    let (src, mut dst) = (pair.src_table.clone(), pair.dst_table.clone());
    let request = Request::new(&fragmented(8, 5), &src, &dst);
    // A last array past B's registered memory: NIXL cannot prepare the table, though the
    // request's own runs lie inside it.
    dst.push(BlockArray {
        base: pair.b_mem.addr() + pair.b_mem.len as u64 + (1 << 20),
        stride: BLOCK,
        len: BLOCK,
        count: 4,
    });
    let peer = pair.peer();
    let before = pair.b_mem.snapshot();
    let expected = request.expected(&pair.a_mem, &pair.a_mem.snapshot(), &pair.b_mem, &before);
    let write = pair
        .a
        .post_block_write(
            &peer,
            &request.block_write(&src, &dst),
            MemorySpace::DRAM,
            MemorySpace::DRAM,
            Some(b"fresh"),
        )
        .expect("posted the fresh way");
    assert_eq!(pair.a.prepared_writes(), 0);
    assert_eq!(pair.a.prepared_lists(), (1, 0));
    pair.finish(&[write], 1);
    assert!(pair.b_mem.snapshot() == expected);
}

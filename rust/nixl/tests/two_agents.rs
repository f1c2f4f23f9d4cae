//! Two NIXL agents in one process: A WRITEs a scattered set of runs into B's memory with a
//! notification; B receives it, and exactly the written bytes changed. Plus the errors a caller
//! can cause.
//!
//! Needs `KVPUSH_NIXL_CAPI`; prints SKIP and passes without it (fails under
//! `KVPUSH_REQUIRE_NIXL`, as in CI). Run with `UCX_NET_DEVICES=lo`
//! (see the crate README). Both agents are progressed by whoever waits: every wait calls
//! `take_notifications` on both, and every wait is bounded.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvpush_core::planner::DescriptorRun;
use kvpush_core::transport::{MemoryRegion, MemorySpace, Notification, Transport, WriteState};
use kvpush_nixl::{AgentConfig, Library, NixlTransport, Progress};

const BUF: usize = 8 << 20;
const DEADLINE: Duration = Duration::from_secs(10);

/// `unwrap` that shows the error's `Display` (which says what to do), for helpers.
trait OrPanic<T> {
    fn or_panic(self, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrPanic<T> for Result<T, E> {
    fn or_panic(self, what: &str) -> T {
        self.unwrap_or_else(|e| panic!("{what}: {e}"))
    }
}

/// NIXL tests run one at a time: two cores, and each test's agents are progressed by its thread.
static SERIAL: Mutex<()> = Mutex::new(());

fn library() -> Option<Library> {
    let path = common::capi_path()?;
    Some(Library::load(&path).unwrap_or_else(|e| panic!("{e}")))
}

/// A buffer whose pages are all touched (first-touch faults would otherwise land in the WRITE).
fn buffer(seed: u8) -> Vec<u8> {
    (0..BUF).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn region(buf: &[u8]) -> MemoryRegion {
    MemoryRegion { addr: buf.as_ptr() as u64, len: buf.len() as u64, space: MemorySpace::DRAM }
}

/// A small deterministic generator, so a failure reproduces.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// `(src offset, dst offset, len)`: destinations in distinct 64 KiB slots of B, unaligned, in
/// shuffled order; sources anywhere in A.
fn scattered_runs(count: usize) -> Vec<(usize, usize, usize)> {
    const SLOT: usize = 64 << 10;
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut slots: Vec<usize> = (0..BUF / SLOT).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i + 1));
    }
    slots[..count]
        .iter()
        .map(|&slot| {
            let len = 1 + rng.below(48 << 10);
            let dst = slot * SLOT + rng.below(SLOT - len);
            let src = rng.below(BUF - len);
            (src, dst, len)
        })
        .collect()
}

/// Calls `take_notifications` on both agents until `until` (given A, to poll its writes, and
/// both agents' notifications) holds, or panics at the deadline.
fn pump(
    a: &mut NixlTransport,
    b: &mut NixlTransport,
    a_notes: &mut Vec<Notification>,
    b_notes: &mut Vec<Notification>,
    what: &str,
    mut until: impl FnMut(&mut NixlTransport, &[Notification], &[Notification]) -> bool,
) {
    let start = Instant::now();
    loop {
        a.take_notifications(a_notes).or_panic("take_notifications");
        b.take_notifications(b_notes).or_panic("take_notifications");
        if until(a, a_notes, b_notes) {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Creates A and B, registers a buffer each, and exchanges metadata both ways.
fn pair(
    library: &Library,
    tag: &str,
    config: &AgentConfig,
    a_buf: &[u8],
    b_buf: &[u8],
) -> (NixlTransport, NixlTransport) {
    let mut a = NixlTransport::new(library, &format!("{tag}-A"), config).or_panic("create A");
    let mut b = NixlTransport::new(library, &format!("{tag}-B"), config).or_panic("create B");
    // SAFETY: both buffers outlive both agents (the callers drop the agents first).
    unsafe {
        a.register_memory(&[region(a_buf)]).or_panic("register_memory");
        b.register_memory(&[region(b_buf)]).or_panic("register_memory");
    }
    let a_md = a.metadata().or_panic("metadata");
    let b_md = b.metadata().or_panic("metadata");
    assert!(!a_md.is_empty() && !b_md.is_empty());
    assert_eq!(a.add_peer(&b_md).or_panic("add_peer"), b.name());
    assert_eq!(b.add_peer(&a_md).or_panic("add_peer"), a.name());
    (a, b)
}

/// The whole exchange: notifications both ways, then a scattered WRITE with a notification.
fn scattered_write(tag: &str, config: AgentConfig) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let a_buf = buffer(1);
    let b_buf = buffer(2);
    let (mut a, mut b) = pair(&library, tag, &config, &a_buf, &b_buf);
    let (a_name, b_name) = (a.name().to_owned(), b.name().to_owned());
    let (mut a_notes, mut b_notes) = (Vec::new(), Vec::new());

    // A registration travels D -> P as a notification in kvpush/1; check both directions.
    b.send_notification(&a_name, b"hello from B").or_panic("send_notification");
    a.send_notification(&b_name, b"hello from A").or_panic("send_notification");
    pump(&mut a, &mut b, &mut a_notes, &mut b_notes, "hello notifications", |_, a_n, b_n| {
        !a_n.is_empty() && !b_n.is_empty()
    });
    assert_eq!(a_notes, [Notification { from: b_name.clone(), payload: b"hello from B".to_vec() }]);
    assert_eq!(b_notes, [Notification { from: a_name.clone(), payload: b"hello from A".to_vec() }]);
    a_notes.clear();
    b_notes.clear();

    let layout = scattered_runs(48);
    let runs: Vec<DescriptorRun> = layout
        .iter()
        .map(|&(src, dst, len)| DescriptorRun {
            src: a_buf.as_ptr() as u64 + src as u64,
            dst: b_buf.as_ptr() as u64 + dst as u64,
            len: len as u64,
        })
        .collect();
    let mut expected = b_buf.clone();
    for &(src, dst, len) in &layout {
        expected[dst..dst + len].copy_from_slice(&a_buf[src..src + len]);
    }
    let bytes: usize = layout.iter().map(|r| r.2).sum();

    // The first half as a WRITE nobody is told of (a layer of layer-wise push), the rest with
    // the notification: B hears of the second alone, and holds the bytes of both.
    let (silent_runs, runs) = runs.split_at(runs.len() / 2);
    let silent = a
        .post_write(&b_name, silent_runs, MemorySpace::DRAM, MemorySpace::DRAM, None)
        .or_panic("post_write");
    let mut silent_done = false;
    pump(&mut a, &mut b, &mut a_notes, &mut b_notes, "the silent WRITE", |a, _, _| {
        silent_done =
            silent_done || a.poll_write(silent).or_panic("poll_write") == WriteState::Done;
        silent_done
    });
    let done = b"DONE:req-1".to_vec();
    let write = a
        .post_write(&b_name, runs, MemorySpace::DRAM, MemorySpace::DRAM, Some(&done))
        .or_panic("post_write");
    assert_eq!(a.writes_in_flight(), 1);
    let (mut polls, mut in_progress, mut finished) = (0u32, 0u32, false);
    pump(
        &mut a,
        &mut b,
        &mut a_notes,
        &mut b_notes,
        "the WRITE and its notification",
        |a, _, b_n| {
            if !finished {
                polls += 1;
                match a.poll_write(write).or_panic("poll_write") {
                    WriteState::Done => finished = true,
                    WriteState::InProgress => in_progress += 1,
                }
            }
            finished && !b_n.is_empty()
        },
    );
    eprintln!(
        "{tag}: {} runs, {bytes} B; done after {polls} poll(s), {in_progress} in progress",
        runs.len()
    );
    assert_eq!(a.writes_in_flight(), 0);
    assert_eq!(
        b_notes,
        [Notification { from: a_name.clone(), payload: done }],
        "the silent WRITE notified nothing"
    );
    assert!(a_notes.is_empty(), "B sent nothing: {a_notes:?}");
    assert!(b_buf == expected, "B's buffer differs from the expected bytes");
    assert!(a.poll_write(write).is_err(), "a finished write's id is void");

    // A write of no runs only notifies, once polled.
    let empty = a
        .post_write(&b_name, &[], MemorySpace::DRAM, MemorySpace::DRAM, Some(b"no-op"))
        .or_panic("post_write");
    assert_eq!(a.poll_write(empty).or_panic("poll_write"), WriteState::Done);
    pump(&mut a, &mut b, &mut a_notes, &mut b_notes, "the no-op notification", |_, _, b_n| {
        b_n.len() == 2
    });
    assert_eq!(b_notes[1].payload, b"no-op");

    drop(a);
    drop(b);
}

#[test]
fn scattered_write_with_progress_thread() {
    scattered_write("prog", AgentConfig::with_progress_thread());
}

#[test]
fn scattered_write_progressed_by_the_caller() {
    assert_eq!(AgentConfig::default().progress, Progress::Caller, "the default kvpush runs");
    scattered_write("caller", AgentConfig::default());
}

/// UCX over TCP only: writes complete asynchronously, and the notification is sent by a poll.
#[test]
fn scattered_write_over_tcp_completes_through_polling() {
    let config = AgentConfig {
        ucx_params: vec![("engine_config".into(), "TLS=tcp".into())],
        ..AgentConfig::default()
    };
    scattered_write("tcp", config);
}

#[test]
fn caller_errors_name_what_they_concern() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let a_buf = buffer(3);
    let b_buf = buffer(4);
    let config = AgentConfig::with_progress_thread();
    let (mut a, mut b) = pair(&library, "errs", &config, &a_buf, &b_buf);
    let b_name = b.name().to_owned();
    let one = |dst: u64| [DescriptorRun { src: a_buf.as_ptr() as u64, dst, len: 4096 }];

    let err = a
        .post_write(
            "nobody",
            &one(b_buf.as_ptr() as u64),
            MemorySpace::DRAM,
            MemorySpace::DRAM,
            Some(b"x"),
        )
        .unwrap_err();
    assert_eq!(err.operation, "post_write");
    assert!(err.detail.contains("\"nobody\""), "{err}");
    assert!(a.send_notification("nobody", b"x").unwrap_err().detail.contains("\"nobody\""));

    for garbage in [&b"definitely not NIXL metadata"[..], &[0u8; 512][..], &[]] {
        let err = a.add_peer(garbage).unwrap_err();
        eprintln!("{err}");
        assert_eq!(err.operation, "add_peer");
        assert!(err.detail.contains("load_remote_md"), "{err}");
    }

    // Outside B's registered memory: refused before any byte moves.
    let outside = b_buf.as_ptr() as u64 + BUF as u64 + (1 << 20);
    let err = a
        .post_write(&b_name, &one(outside), MemorySpace::DRAM, MemorySpace::DRAM, Some(b"x"))
        .unwrap_err();
    eprintln!("{err}");
    assert!(err.detail.contains("create_xfer_req"), "{err}");
    assert!(err.detail.contains(&b_name), "{err}");
    assert_eq!(a.writes_in_flight(), 0);

    let err = a.poll_write(kvpush_core::transport::WriteId(999)).unwrap_err();
    assert!(err.detail.contains("unknown write"), "{err}");

    // Forgetting a peer makes it unknown; forgetting twice is fine.
    a.remove_peer(&b_name).or_panic("remove_peer");
    a.remove_peer(&b_name).or_panic("remove_peer");
    let err = a.send_notification(&b_name, b"x").unwrap_err();
    assert!(err.detail.contains("unknown peer"), "{err}");
    let mut notes = Vec::new();
    b.take_notifications(&mut notes).or_panic("take_notifications");
    drop(a);
    drop(b);
}

/// Not an assertion (tests do not measure time): how much CPU two idle agents with progress
/// threads burn, so a spinning progress thread shows up in the test log.
#[test]
fn idle_agents_cpu_report() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(library) = library() else { return };
    let a_buf = buffer(5);
    let b_buf = buffer(6);
    let config = AgentConfig::with_progress_thread();
    let (a, b) = pair(&library, "idle", &config, &a_buf, &b_buf);
    let cpu = || {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let after_comm = stat.rsplit(')').next().unwrap_or_default();
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat: 11 and 12 counting from the state
        // field, the first after the comm's ')'.
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        field(11) + field(12)
    };
    let before = cpu();
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("two idle agents used {} clock ticks of CPU in 500 ms", cpu() - before);
    drop(a);
    drop(b);
}

//! Whole frames from a socket whose reads time out.

use std::io::{self, ErrorKind, Read};

use crate::protocol::{frame_len, Limits, ProtocolError, PREFIX_LEN};

/// Receive-buffer capacity kept between frames. A larger buffer (left by a big `Hello` or
/// `Register`) is freed once its frame is consumed, so that an idle connection holds little.
const RETAINED_CAPACITY: usize = 64 << 10;

/// Most bytes the buffer grows by ahead of what has arrived.
const GROWTH_STEP: usize = 64 << 10;

/// Assembles one frame at a time from a stream with a read timeout.
///
/// `read_exact` will not do: when a read times out part way through a frame it does not say how
/// much it consumed, and the stream loses sync. This keeps the partial frame across timeouts, so
/// the caller can wake every tick (heartbeats, silence, close) without losing bytes. It reads
/// exactly one frame and never into the next, so a handshake can hand the stream to the reader
/// loop with nothing buffered, and it checks the length prefix against the limits before it
/// allocates for the body.
#[derive(Debug)]
pub(super) struct FrameReader {
    buf: Vec<u8>,
    filled: usize,
    limits: Limits,
}

/// Why no frame could be read.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The peer closed its end (read returned 0); `mid_frame` when part of a frame had arrived.
    Closed {
        /// Whether a partial frame was buffered.
        mid_frame: bool,
    },
    /// The socket failed (reset, shut down locally, ...).
    Io(io::Error),
    /// The length prefix is over the limit: the stream is not kvpush/1, or not in sync.
    Protocol(ProtocolError),
}

impl FrameReader {
    pub(super) fn new(limits: Limits) -> Self {
        Self { buf: Vec::new(), filled: 0, limits }
    }

    /// Reads until a whole frame is buffered (`Ok(true)`; see [`frame`](Self::frame) and
    /// [`consume`](Self::consume)) or a read times out (`Ok(false)`; the partial frame is kept
    /// for the next call).
    pub(super) fn poll(&mut self, mut source: impl Read) -> Result<bool, FrameError> {
        loop {
            let needed = match frame_len(&self.buf[..self.filled], &self.limits) {
                Ok(Some(needed)) => needed,
                Ok(None) => PREFIX_LEN,
                Err(oversized) => return Err(FrameError::Protocol(oversized)),
            };
            if self.filled == needed {
                return Ok(true);
            }
            // Grow with the bytes that arrive, not to the announced length: a prefix alone
            // (a silent or slow peer) costs at most one step, never the whole frame.
            let target = needed.min(self.filled + GROWTH_STEP);
            if self.buf.len() < target {
                self.buf.resize(target, 0);
            }
            match source.read(&mut self.buf[self.filled..target]) {
                Ok(0) => return Err(FrameError::Closed { mid_frame: self.filled > 0 }),
                Ok(read) => self.filled += read,
                // A socket read timeout reads as WouldBlock on Unix and TimedOut on Windows.
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Ok(false)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
    }

    /// Sets the largest frame accepted from now on (the handshake reads with a small one).
    pub(super) fn set_max_frame_bytes(&mut self, max: usize) {
        self.limits.max_frame_bytes = max;
    }

    /// The buffered frame, prefix included; whole only after `poll` returned `Ok(true)`.
    pub(super) fn frame(&self) -> &[u8] {
        &self.buf[..self.filled]
    }

    /// Drops the buffered frame so that the next `poll` starts a new one.
    pub(super) fn consume(&mut self) {
        self.filled = 0;
        if self.buf.capacity() > RETAINED_CAPACITY {
            self.buf = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A stream that returns scripted chunks, with a timeout between some of them.
    struct Script(VecDeque<Option<Vec<u8>>>);

    impl Read for Script {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            match self.0.pop_front() {
                None => Ok(0),
                Some(None) => Err(ErrorKind::WouldBlock.into()),
                Some(Some(mut chunk)) => {
                    let n = chunk.len().min(out.len());
                    out[..n].copy_from_slice(&chunk[..n]);
                    if n < chunk.len() {
                        self.0.push_front(Some(chunk.split_off(n)));
                    }
                    Ok(n)
                }
            }
        }
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut frame = u32::try_from(body.len()).unwrap().to_be_bytes().to_vec();
        frame.extend_from_slice(body);
        frame
    }

    #[test]
    fn partial_frames_survive_timeouts_and_frames_do_not_run_together() {
        let (a, b) = (frame(b"first"), frame(b"second frame"));
        let mut both = a.clone();
        both.extend_from_slice(&b);
        // Split inside the prefix, inside the body and across the frame boundary.
        let mut script = Script(VecDeque::from([
            Some(both[..2].to_vec()),
            None,
            Some(both[2..7].to_vec()),
            None,
            Some(both[7..12].to_vec()),
            Some(both[12..].to_vec()),
        ]));
        let mut reader = FrameReader::new(Limits::default());
        assert!(!reader.poll(&mut script).unwrap());
        assert!(!reader.poll(&mut script).unwrap());
        assert!(reader.poll(&mut script).unwrap());
        assert_eq!(reader.frame(), a.as_slice());
        reader.consume();
        assert!(reader.poll(&mut script).unwrap());
        assert_eq!(reader.frame(), b.as_slice());
        reader.consume();
        assert!(matches!(reader.poll(&mut script), Err(FrameError::Closed { mid_frame: false })));
    }

    #[test]
    fn oversized_prefixes_are_refused_before_allocating() {
        let limits = Limits { max_frame_bytes: 8, ..Limits::default() };
        let mut reader = FrameReader::new(limits);
        let mut script = Script(VecDeque::from([Some(frame(b"nine byte"))]));
        let err = reader.poll(&mut script).unwrap_err();
        assert!(matches!(err, FrameError::Protocol(ProtocolError::Oversized { len: 9, max: 8 })));
        assert!(reader.buf.len() <= PREFIX_LEN);
    }

    #[test]
    fn a_large_announced_frame_allocates_only_what_arrived() {
        let mut announced = u32::try_from(16 << 20).unwrap().to_be_bytes().to_vec();
        announced.extend_from_slice(b"a few bytes");
        let mut reader = FrameReader::new(Limits::default());
        let mut script = Script(VecDeque::from([Some(announced), None]));
        assert!(!reader.poll(&mut script).unwrap());
        assert!(reader.buf.len() <= reader.filled + GROWTH_STEP, "{} bytes held", reader.buf.len());
    }

    #[test]
    fn eof_inside_a_frame_is_reported_as_such() {
        let mut reader = FrameReader::new(Limits::default());
        let mut script = Script(VecDeque::from([Some(frame(b"cut short")[..6].to_vec())]));
        assert!(matches!(reader.poll(&mut script), Err(FrameError::Closed { mid_frame: true })));
    }
}

//! The two primitives of the shared-memory transport ([`super::shm`]) that work on the
//! segment's words: waiting for a word another member advances (spin, then a futex sleep
//! that checks the member is alive), and the single-producer single-consumer byte ring that
//! carries one direction of send/recv between two members.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rustix::thread::futex;

use super::{MAX_FRAME_BYTES, TcpComm};

/// Busy-wait iterations (`pause` each, ~20 ns on current x86) before sleeping on a futex,
/// when every rank of the host has a core of its own: a waiting member then takes no core
/// from the one it waits for. Where ranks outnumber cores it sleeps at once (spinning made
/// TP 3 on a 2-core EPYC decode 30% slower: 17.1–17.7 ms a token against 13.4–13.7).
pub(super) const SPIN_ITERATIONS: u32 = 2000;

/// How often a sleeping member wakes to check that the peer it waits for is still alive.
const LIVENESS_POLL: Duration = Duration::from_millis(100);

/// Bytes a ring's writer copies before publishing them, so that the reader copies one piece
/// out while the writer copies the next one in (64 KiB: an L2-sized piece, and a publication
/// costs one store and one load).
const PUBLISH_BYTES: u32 = 64 << 10;

/// A word in the segment that one member advances and others wait on, with the count of
/// members sleeping on it (so the writer calls `futex_wake` only when someone sleeps).
#[derive(Clone, Copy)]
pub(super) struct Word<'a> {
    pub(super) value: &'a AtomicU32,
    pub(super) sleepers: &'a AtomicU32,
}

impl Word<'_> {
    /// Stores `value` and wakes the members sleeping on the word.
    pub(super) fn publish(&self, value: u32) {
        self.value.store(value, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _ = futex::wake(self.value, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Blocks until `reached(word)` holds, and returns the value that satisfied it: spins
    /// `spin` times, then sleeps on the futex, waking every [`LIVENESS_POLL`] to check that
    /// `member` (who advances the word) is still alive.
    ///
    /// Errors: the member's process exited, or the group's timeout passed; both name the
    /// operation, the group and the member's global rank.
    pub(super) fn wait_until(
        &self,
        tcp: &TcpComm,
        (operation, verb): (&'static str, &'static str),
        member: usize,
        spin: u32,
        reached: impl Fn(u32) -> bool,
    ) -> Result<u32> {
        for _ in 0..spin {
            let seen = self.value.load(Ordering::Acquire);
            if reached(seen) {
                return Ok(seen);
            }
            std::hint::spin_loop();
        }
        let _wait = tcp.waiting(operation, verb, member, None);
        let deadline = Instant::now() + tcp.timeout();
        let poll = futex::Timespec {
            tv_sec: 0,
            tv_nsec: LIVENESS_POLL.as_nanos() as _,
        };
        loop {
            // Dekker with `publish`: either it sees our sleeper count, or we see its value.
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = self.value.load(Ordering::SeqCst);
            if !reached(seen) {
                // EAGAIN (the word moved), EINTR and ETIMEDOUT all mean: look again.
                let _ = futex::wait(self.value, futex::Flags::empty(), seen, Some(&poll));
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            let seen = self.value.load(Ordering::Acquire);
            if reached(seen) {
                return Ok(seen);
            }
            if tcp.peer_closed(member) {
                bail!("{}: the peer exited", tcp.context(operation, verb, member));
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: timed out after {:?}",
                    tcp.context(operation, verb, member),
                    tcp.timeout()
                );
            }
        }
    }
}

/// One direction between two members: `capacity` bytes (a power of two) of ring, and the
/// counts of bytes ever written and read (wrapping `u32`s, so `written − read` is what the
/// ring holds). Only the writer advances `written` and only the reader `read`.
pub(super) struct Ring<'a> {
    pub(super) written: Word<'a>,
    pub(super) read: Word<'a>,
    pub(super) data: *mut u8,
    pub(super) capacity: u32,
    /// Spin iterations before a wait sleeps.
    pub(super) spin: u32,
}

impl Ring<'_> {
    /// Sends one message to `reader` (a member position): its length (8 bytes, little
    /// endian), then its bytes, in pieces as the ring frees up.
    ///
    /// Errors: the reader exited or stopped reading for the group's timeout.
    pub(super) fn send(&self, tcp: &TcpComm, reader: usize, bytes: &[u8]) -> Result<()> {
        self.write(tcp, reader, &(bytes.len() as u64).to_le_bytes())?;
        self.write(tcp, reader, bytes)
    }

    /// Receives one message from `writer` (a member position), as [`Ring::send`] framed it.
    ///
    /// Errors: the writer exited or sent nothing for the group's timeout; a length over the
    /// TCP frames' limit, or one this process cannot allocate.
    pub(super) fn recv(&self, tcp: &TcpComm, writer: usize) -> Result<Vec<u8>> {
        let mut length = [0u8; 8];
        self.read_into(tcp, writer, &mut length)?;
        let length = u64::from_le_bytes(length);
        if length > MAX_FRAME_BYTES {
            bail!(
                "{}: the peer announced a message of {length} bytes, over the {MAX_FRAME_BYTES}-byte limit",
                tcp.context(RECV, "receiving from", writer)
            );
        }
        let mut bytes = Vec::new();
        if bytes.try_reserve_exact(length as usize).is_err() {
            bail!(
                "{}: cannot allocate a message of {length} bytes",
                tcp.context(RECV, "receiving from", writer)
            );
        }
        bytes.resize(length as usize, 0);
        self.read_into(tcp, writer, &mut bytes)?;
        Ok(bytes)
    }

    /// Receives one message from `writer` into `buffer`, which must be as long.
    ///
    /// Errors: as [`Ring::recv`], and a message of another length (the ring is then out of
    /// step: the group is unusable).
    pub(super) fn recv_into(&self, tcp: &TcpComm, writer: usize, buffer: &mut [u8]) -> Result<()> {
        let mut length = [0u8; 8];
        self.read_into(tcp, writer, &mut length)?;
        let length = u64::from_le_bytes(length);
        if length != buffer.len() as u64 {
            bail!(
                "{}: expected {} bytes, the peer sent {length} (members called the collective with different sizes?)",
                tcp.context(RECV, "receiving from", writer),
                buffer.len()
            );
        }
        self.read_into(tcp, writer, buffer)
    }

    fn write(&self, tcp: &TcpComm, reader: usize, mut bytes: &[u8]) -> Result<()> {
        let capacity = self.capacity;
        // Only this member advances `written`.
        let mut written = self.written.value.load(Ordering::Relaxed);
        while !bytes.is_empty() {
            let read =
                self.read
                    .wait_until(tcp, (SEND, "sending to"), reader, self.spin, |read| {
                        written.wrapping_sub(read) < capacity
                    })?;
            let free = capacity - written.wrapping_sub(read);
            let offset = written & (capacity - 1);
            let piece = (bytes.len().min(u32::MAX as usize) as u32)
                .min(free)
                .min(capacity - offset)
                .min(PUBLISH_BYTES) as usize;
            // SAFETY: `offset + piece ≤ capacity`, inside this ring; the reader does not read
            // these bytes before `written` says so, and has read what they overwrite
            // (`written − read + piece ≤ capacity`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    self.data.add(offset as usize),
                    piece,
                );
            }
            written = written.wrapping_add(piece as u32);
            self.written.publish(written);
            bytes = &bytes[piece..];
        }
        Ok(())
    }

    fn read_into(&self, tcp: &TcpComm, writer: usize, out: &mut [u8]) -> Result<()> {
        let capacity = self.capacity;
        // Only this member advances `read`.
        let mut read = self.read.value.load(Ordering::Relaxed);
        let mut filled = 0;
        while filled < out.len() {
            let written = self.written.wait_until(
                tcp,
                (RECV, "receiving from"),
                writer,
                self.spin,
                |written| written != read,
            )?;
            let held = written.wrapping_sub(read);
            let offset = read & (capacity - 1);
            let piece = ((out.len() - filled).min(u32::MAX as usize) as u32)
                .min(held)
                .min(capacity - offset) as usize;
            // SAFETY: the writer published these bytes (`written` was loaded with acquire
            // ordering) and does not overwrite them before we advance `read`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data.add(offset as usize),
                    out[filled..].as_mut_ptr(),
                    piece,
                );
            }
            read = read.wrapping_add(piece as u32);
            self.read.publish(read);
            filled += piece;
        }
        Ok(())
    }
}

/// The operation names a ring's waits and errors give.
const SEND: &str = "send (shared memory)";
const RECV: &str = "recv (shared memory)";

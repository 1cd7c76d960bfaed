//! Shared-memory transport for a group whose members share one host, like NCCL's SHM
//! transport: NCCL never sends intra-node traffic through loopback TCP, and neither do we.
//!
//! [`ShmComm`] maps one shared segment per group and moves all-reduce, send/recv and
//! broadcast through it; the group's TCP connections ([`TcpComm`]) carry the rest (all-gather,
//! all-to-all, barrier) and tell a sleeping member that a peer died.
//!
//! - **All-reduce**: every member publishes its data into its own slot, reduces its `1/n`
//!   chunk straight out of the other slots (summing in member order, so every member ends
//!   with the same bits), and copies the other reduced chunks back.
//! - **Send/recv**: a byte ring per ordered pair of members (`shm_ring`), which the writer
//!   fills while the reader empties it; broadcast is the root's send to each member. CPU
//!   tensor parallelism's exact-order chain passes every layer's running dot products this
//!   way (36 bytes per output and token).
//!
//! That moves each byte through memory a few times instead of through the kernel's socket
//! buffers twice per hop, which is what bounds TCP when ranks outnumber cores.
//!
//! The segment is made when the group is ([`ShmComm::new`], a collective call, so the
//! members agree on it over TCP): member 0 creates a file in `/dev/shm`, every member maps
//! it, and the file is unlinked as soon as all have, so nothing is left behind even if a
//! rank is killed later. When the segment cannot be made, the group uses TCP for good, and
//! says why ([`ShmComm::transport`]); [`ShmComm::tcp_only`] never tries (the launcher
//! forwards `INFER_SHM_DISABLE=1`, NCCL's `NCCL_SHM_DISABLE`, for that).
//!
//! Waiting spins briefly, then sleeps on a futex on the peer's word; every 100 ms a
//! sleeping member checks the peer's TCP connection, so a peer that exits or is killed is
//! named within that time instead of at the timeout.

use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};
use memmap2::MmapMut;

use super::shm_ring::{Ring, SPIN_ITERATIONS, Word};
use crate::runtime::collectives::{Comm, TcpComm, chunk};

/// Bytes of one member's slot: an all-reduce moves through the segment in pieces of this
/// size, double-buffered. 1 MiB keeps a piece in a Zen 4 / Sapphire Rapids L2 while
/// making a 16 MiB all-reduce 16 rounds of three synchronisations.
const SLOT_BYTES: usize = 1 << 20;

/// Cache-line pair that each sequence word lives alone in (adjacent-line prefetch pulls
/// lines in pairs on x86).
const LINE_BYTES: usize = 128;

/// Bytes of the rings of one group's segment together: each of the `n · (n − 1)` rings gets
/// the largest power of two that fits, between [`MIN_RING_BYTES`] and [`MAX_RING_BYTES`]
/// (1 MiB each up to 4 members; 256 KiB at 8). Docker's default `/dev/shm` is 64 MiB.
const RING_BUDGET_BYTES: usize = 16 << 20;
/// Largest ring: holds a 256-token prefill's hidden states of a 1024-wide model whole.
const MAX_RING_BYTES: usize = 1 << 20;
/// Smallest ring: 4 of the writer's publications.
const MIN_RING_BYTES: usize = 64 << 10;

/// The three phases of one piece, each a per-member sequence word in the segment header.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// The member's slot holds its data for the piece.
    Published = 0,
    /// The member's reduced chunk is in the shared output slot.
    Reduced = 1,
    /// The member has copied every reduced chunk out: both its slots may be reused.
    Done = 2,
}

/// A group of processes on one host: all-reduce, send/recv and broadcast through shared
/// memory once the members have mapped a common segment, TCP for the rest.
pub struct ShmComm {
    tcp: TcpComm,
    state: State,
}

enum State {
    /// A group of one member: nothing to carry.
    Alone,
    Ready(Segment),
    /// Shared memory is off for this group, for the reason given.
    Tcp(String),
}

impl ShmComm {
    /// Wraps a connected TCP group whose members all run on this host and makes its shared
    /// segment: a collective call, which every member makes right after joining the group
    /// (a one-member group needs no segment). When the segment cannot be made or mapped,
    /// the group uses TCP ([`ShmComm::transport`] says why).
    ///
    /// Errors: only a failed TCP collective while the members agree on the segment.
    pub fn new(tcp: TcpComm) -> Result<ShmComm> {
        let mut comm = ShmComm {
            tcp,
            state: State::Alone,
        };
        if comm.tcp.size() > 1 {
            comm.set_up()?;
        }
        Ok(comm)
    }

    /// Wraps a TCP group that must not use shared memory, for the reason given (members
    /// on several hosts, or `INFER_SHM_DISABLE=1`).
    pub fn tcp_only(tcp: TcpComm, why: &str) -> ShmComm {
        ShmComm {
            tcp,
            state: State::Tcp(why.to_string()),
        }
    }

    /// The TCP group underneath (the same members and connections).
    pub fn tcp_mut(&mut self) -> &mut TcpComm {
        &mut self.tcp
    }

    /// Tells the group how many ranks run on this host in all (its members and the other
    /// groups' ranks): a wait spins before it sleeps only when every one has a core
    /// ([`SPIN_ITERATIONS`]). Until told, the group assumes its own members are all.
    pub fn set_ranks_on_host(&mut self, ranks: usize) {
        if let State::Ready(segment) = &mut self.state {
            segment.spin = spin_iterations(ranks);
        }
    }

    /// Whether all-reduce, send/recv and broadcast go through the shared segment.
    pub fn uses_shared_memory(&self) -> bool {
        matches!(self.state, State::Ready(_))
    }

    /// What carries all-reduce, send/recv and broadcast: `"shared memory (/dev/shm)"`,
    /// `"TCP: <why>"`, or `"none (one member)"`.
    pub fn transport(&self) -> String {
        match &self.state {
            State::Alone => "none (one member)".into(),
            State::Ready(segment) => format!("shared memory ({})", segment.directory.display()),
            State::Tcp(why) => format!("TCP: {why}"),
        }
    }

    /// Makes (member 0) or maps (the others) the segment; every member learns whether all
    /// succeeded, so they switch transports together. Errors: only a failed TCP collective.
    fn set_up(&mut self) -> Result<()> {
        let (n, position) = (self.tcp.size(), self.tcp.rank());
        let bytes = Segment::bytes(n);
        let mut announced = Vec::new();
        let mut created: Option<PathBuf> = None;
        let mut why = String::new();
        if position == 0 {
            match create_segment_file("infer-shm", bytes) {
                Ok(path) => {
                    announced = path.to_string_lossy().into_owned().into_bytes();
                    created = Some(path);
                }
                Err(e) => why = format!("cannot create the shared segment: {e:#}"),
            }
        }
        self.tcp.broadcast(&mut announced, 0)?;
        let mapped = if announced.is_empty() {
            None
        } else {
            let path = PathBuf::from(String::from_utf8_lossy(&announced).into_owned());
            // Member 0's announcement is input: only a segment of ours, in the segment
            // directory, is ever mapped.
            let ours = path.parent() == Some(segment_directory().as_path())
                && path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("infer-shm-") && !n.contains('/'));
            let mapped = if ours {
                Segment::map(&path, n, position)
            } else {
                Err(anyhow::anyhow!("not a shared segment of this group"))
            };
            match mapped {
                Ok(segment) => Some(segment),
                Err(e) => {
                    why = format!("cannot map {}: {e:#}", path.display());
                    None
                }
            }
        };
        // Also the barrier after which nobody opens the file any more.
        let mut failures = [if mapped.is_some() { 0f32 } else { 1f32 }];
        self.tcp.all_reduce_sum(&mut failures)?;
        if let Some(path) = created {
            let _ = std::fs::remove_file(path);
        }
        self.state = match mapped {
            Some(segment) if failures[0] == 0.0 => State::Ready(segment),
            _ if why.is_empty() => State::Tcp(format!(
                "{} member(s) could not map the shared segment",
                failures[0]
            )),
            _ => State::Tcp(why),
        };
        Ok(())
    }
}

/// How long a wait spins when `ranks` processes share this host's cores: not at all when
/// they outnumber the cores this process may run on.
fn spin_iterations(ranks: usize) -> u32 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks <= cores { SPIN_ITERATIONS } else { 0 }
}

/// Where shared segments live: `/dev/shm` (tmpfs), or the temporary directory when there
/// is none.
pub(crate) fn segment_directory() -> PathBuf {
    let directory = PathBuf::from("/dev/shm");
    if directory.is_dir() {
        directory
    } else {
        std::env::temp_dir()
    }
}

/// Creates a zero-filled file of `bytes` in [`segment_directory`], readable and writable
/// by this user only, named `<prefix>-<pid>-<random>`; returns its path.
///
/// Errors: the file cannot be created or its pages reserved (a full `/dev/shm`).
pub(crate) fn create_segment_file(prefix: &str, bytes: usize) -> Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = segment_directory().join(format!(
        "{prefix}-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    // Reserve the pages now (as NCCL does for its `/dev/shm` segments): a merely truncated
    // tmpfs file maps fine and then raises SIGBUS on first touch when the filesystem is full.
    // Here a full `/dev/shm` is an error, and the group falls back to TCP.
    // (Mode 0 also sets the file's size.)
    let reserved =
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes as u64);
    if let Err(e) = reserved {
        let _ = std::fs::remove_file(&path);
        return Err(std::io::Error::from(e))
            .with_context(|| format!("cannot reserve {bytes} bytes for {}", path.display()));
    }
    Ok(path)
}

/// One member's view of the mapped segment.
///
/// Layout: a header of `3 · n` lines (one per member and [`Phase`], each holding the
/// sequence word, a sleeper count and the piece length) and `2 · n · (n − 1)` lines (the
/// written and read counts of each ring, with their sleeper counts); then `2 · n` input
/// slots (member `m`, buffer `b` at `m · 2 + b`) and 2 output slots, each [`SLOT_BYTES`];
/// then the `n · (n − 1)` rings, each [`Segment::ring_bytes`].
struct Segment {
    _map: MmapMut,
    base: *mut u8,
    directory: PathBuf,
    n: usize,
    position: usize,
    /// Sequence number of the next piece (wrapping; compared by signed difference).
    piece: u32,
    /// Spin iterations before a wait sleeps ([`ShmComm::set_ranks_on_host`]).
    spin: u32,
}

// SAFETY: `base` points into `_map`, which the segment owns and which stays mapped at the
// same address until the segment is dropped; the segment is used by one thread at a time.
unsafe impl Send for Segment {}

impl Segment {
    const SLOT_FLOATS: usize = SLOT_BYTES / 4;

    fn header_bytes(n: usize) -> usize {
        ((3 * n + 2 * Self::rings(n)) * LINE_BYTES).next_multiple_of(4096)
    }

    /// Number of rings: one per ordered pair of members.
    fn rings(n: usize) -> usize {
        n * n.saturating_sub(1)
    }

    /// Bytes of each ring for `n` members (a power of two; see [`RING_BUDGET_BYTES`]).
    fn ring_bytes(n: usize) -> usize {
        let share = RING_BUDGET_BYTES / Self::rings(n).max(1);
        (1usize << share.ilog2()).clamp(MIN_RING_BYTES, MAX_RING_BYTES)
    }

    /// Total segment size for `n` members.
    fn bytes(n: usize) -> usize {
        Self::header_bytes(n) + (2 * n + 2) * SLOT_BYTES + Self::rings(n) * Self::ring_bytes(n)
    }

    fn map(path: &std::path::Path, n: usize, position: usize) -> Result<Segment> {
        let file: File = OpenOptions::new().read(true).write(true).open(path)?;
        let length = file.metadata()?.len();
        if length != Self::bytes(n) as u64 {
            bail!("{length} bytes, expected {}", Self::bytes(n));
        }
        // SAFETY: the file is private to this group (random name, created exclusively) and
        // only accessed through the protocol below.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        let base = map.as_mut_ptr();
        Ok(Segment {
            _map: map,
            base,
            directory: path.parent().map(PathBuf::from).unwrap_or_default(),
            n,
            position,
            piece: 0,
            spin: spin_iterations(n),
        })
    }

    fn line(&self, member: usize, phase: Phase) -> *mut u8 {
        let offset = (member * 3 + phase as usize) * LINE_BYTES;
        // SAFETY: within the header for `member < n`.
        unsafe { self.base.add(offset) }
    }

    /// Word `word` (0: sequence, 1: sleepers, 2: piece length) of a header line.
    fn word(&self, member: usize, phase: Phase, word: usize) -> &AtomicU32 {
        // SAFETY: 4-byte aligned (lines are 128-byte aligned in a page-aligned mapping),
        // inside the mapping, and only ever accessed atomically.
        unsafe { &*(self.line(member, phase).add(4 * word) as *const AtomicU32) }
    }

    fn input(&self, member: usize, buffer: usize) -> *mut f32 {
        let offset = Self::header_bytes(self.n) + (member * 2 + buffer) * SLOT_BYTES;
        // SAFETY: within the mapping; 4096-aligned.
        unsafe { self.base.add(offset) as *mut f32 }
    }

    fn output(&self, buffer: usize) -> *mut f32 {
        let offset = Self::header_bytes(self.n) + (2 * self.n + buffer) * SLOT_BYTES;
        // SAFETY: as `input`.
        unsafe { self.base.add(offset) as *mut f32 }
    }

    /// The sequence word of `member`'s `phase`, with its sleeper count.
    fn phase_word(&self, member: usize, phase: Phase) -> Word<'_> {
        Word {
            value: self.word(member, phase, 0),
            sleepers: self.word(member, phase, 1),
        }
    }

    /// Publishes this member's `phase` as `value` and wakes members sleeping on it.
    fn signal(&self, phase: Phase, value: u32) {
        self.phase_word(self.position, phase).publish(value);
    }

    /// Blocks until every other member's `phase` has reached `target`. Errors: a member
    /// whose process exited, or the group's timeout (both name the global rank).
    fn wait_for(&self, tcp: &TcpComm, phase: Phase, target: u32) -> Result<()> {
        let reached = |seen: u32| seen.wrapping_sub(target) as i32 >= 0;
        for member in (0..self.n).filter(|&m| m != self.position) {
            self.phase_word(member, phase).wait_until(
                tcp,
                ("all-reduce (shared memory)", "waiting for"),
                member,
                self.spin,
                reached,
            )?;
        }
        Ok(())
    }

    /// The ring from member `from` to member `to` (`from ≠ to`, both `< n`).
    fn ring(&self, from: usize, to: usize) -> Ring<'_> {
        let index = from * (self.n - 1) + to - usize::from(to > from);
        let line = |k: usize| -> Word<'_> {
            let offset = (3 * self.n + 2 * index + k) * LINE_BYTES;
            // SAFETY: inside the header; 4-byte aligned (lines are 128-byte aligned in a
            // page-aligned mapping); only ever accessed atomically.
            unsafe {
                Word {
                    value: &*(self.base.add(offset) as *const AtomicU32),
                    sleepers: &*(self.base.add(offset + 4) as *const AtomicU32),
                }
            }
        };
        let ring_bytes = Self::ring_bytes(self.n);
        let offset =
            Self::header_bytes(self.n) + (2 * self.n + 2) * SLOT_BYTES + index * ring_bytes;
        Ring {
            written: line(0),
            read: line(1),
            // SAFETY: the ring lies inside the mapping (`Segment::bytes`).
            data: unsafe { self.base.add(offset) },
            capacity: ring_bytes as u32,
            spin: self.spin,
        }
    }

    /// Sends `data` to member `peer` through this member's ring to it.
    ///
    /// Errors: `peer` is this member or not in the group; the peer exited or stopped
    /// receiving for the group's timeout.
    fn send(&self, tcp: &TcpComm, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer("send", peer)?;
        self.ring(self.position, peer).send(tcp, peer, data)
    }

    /// Receives what member `peer` sent to this one.
    ///
    /// Errors: as [`Segment::send`], and a message over the frame limit.
    fn recv(&self, tcp: &TcpComm, peer: usize) -> Result<Vec<u8>> {
        self.check_peer("recv", peer)?;
        self.ring(peer, self.position).recv(tcp, peer)
    }

    /// Receives what member `peer` sent to this one into `buffer`, which must be as long.
    ///
    /// Errors: as [`Segment::send`], and a message of another length.
    fn recv_into(&self, tcp: &TcpComm, peer: usize, buffer: &mut [u8]) -> Result<()> {
        self.check_peer("recv", peer)?;
        self.ring(peer, self.position).recv_into(tcp, peer, buffer)
    }

    /// Errors when `peer` is this member or not in the group.
    fn check_peer(&self, operation: &str, peer: usize) -> Result<()> {
        if peer == self.position || peer >= self.n {
            bail!(
                "{operation} in a group of {}: member {peer} is this one or not a member",
                self.n
            );
        }
        Ok(())
    }

    /// Sums `data` over the group, piece by piece (see the module docs). Every member
    /// reduces its chunk as `((x₀ + x₁) + x₂) + …` in member order, so all end with the
    /// same bits. Errors: a dead or late peer, or members passing different lengths.
    fn all_reduce(&mut self, tcp: &TcpComm, data: &mut [f32]) -> Result<()> {
        let (n, me) = (self.n, self.position);
        for piece in data.chunks_mut(Self::SLOT_FLOATS) {
            let sequence = self.piece;
            self.piece = sequence.wrapping_add(1);
            let buffer = (sequence & 1) as usize;
            let len = piece.len();
            let mine = chunk(me, n, len);
            // This buffer last carried piece `sequence − 2`: everyone must be done with it.
            self.wait_for(tcp, Phase::Done, sequence.wrapping_sub(1))?;
            let slot = self.input(me, buffer);
            // SAFETY: our own input slot (`len ≤ SLOT_FLOATS`), which no member reads until
            // we signal `Published`; `piece` is private memory.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), slot, mine.start);
                std::ptr::copy_nonoverlapping(
                    piece.as_ptr().add(mine.end),
                    slot.add(mine.end),
                    len - mine.end,
                );
            }
            self.word(me, Phase::Published, 2)
                .store(len as u32, Ordering::Relaxed);
            self.signal(Phase::Published, sequence.wrapping_add(1));
            self.wait_for(tcp, Phase::Published, sequence.wrapping_add(1))?;
            for member in (0..n).filter(|&m| m != me) {
                let theirs = self
                    .word(member, Phase::Published, 2)
                    .load(Ordering::Relaxed);
                if theirs as usize != len {
                    bail!(
                        "{}: it passed a piece of {theirs} floats, this rank {len} (members called all-reduce with different sizes?)",
                        tcp.context("all-reduce (shared memory)", "reducing with", member)
                    );
                }
            }
            self.reduce_chunk(piece, mine.clone(), buffer);
            self.signal(Phase::Reduced, sequence.wrapping_add(1));
            self.wait_for(tcp, Phase::Reduced, sequence.wrapping_add(1))?;
            let output = self.output(buffer);
            // SAFETY: every member's reduced chunk is final (they signalled `Reduced`) and
            // stays so until we signal `Done`.
            unsafe {
                std::ptr::copy_nonoverlapping(output, piece.as_mut_ptr(), mine.start);
                std::ptr::copy_nonoverlapping(
                    output.add(mine.end),
                    piece.as_mut_ptr().add(mine.end),
                    len - mine.end,
                );
            }
            self.signal(Phase::Done, sequence.wrapping_add(1));
        }
        Ok(())
    }

    /// `piece[mine] = Σₘ xₘ[mine]` in member order (our own values from `piece`, the others'
    /// from their slots), also written to the output slot for the others.
    fn reduce_chunk(&self, piece: &mut [f32], mine: std::ops::Range<usize>, buffer: usize) {
        const BLOCK: usize = 1024;
        let mut sum = [0f32; BLOCK];
        let mut start = mine.start;
        while start < mine.end {
            let end = (start + BLOCK).min(mine.end);
            let width = end - start;
            for member in 0..self.n {
                let source: &[f32] = if member == self.position {
                    &piece[start..end]
                } else {
                    // SAFETY: the member published this slot (`Published`) and will not
                    // write it again before we signal `Reduced`.
                    unsafe {
                        std::slice::from_raw_parts(self.input(member, buffer).add(start), width)
                    }
                };
                if member == 0 {
                    sum[..width].copy_from_slice(source);
                } else {
                    for (total, value) in sum[..width].iter_mut().zip(source) {
                        *total += value;
                    }
                }
            }
            piece[start..end].copy_from_slice(&sum[..width]);
            // SAFETY: our chunk of the output slot, which nobody reads before `Reduced`.
            unsafe {
                std::ptr::copy_nonoverlapping(sum.as_ptr(), self.output(buffer).add(start), width);
            }
            start = end;
        }
    }
}

impl Comm for ShmComm {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn size(&self) -> usize {
        self.tcp.size()
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        if self.tcp.size() == 1 {
            return Ok(());
        }
        match &mut self.state {
            State::Ready(segment) => segment.all_reduce(&self.tcp, data),
            _ => self.tcp.all_reduce_sum(data),
        }
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.tcp.all_gather(send, recv)
    }

    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        let State::Ready(segment) = &self.state else {
            return self.tcp.broadcast(data, root);
        };
        if self.tcp.rank() == root {
            for peer in (0..segment.n).filter(|&p| p != root) {
                segment.send(&self.tcp, peer, data)?;
            }
        } else {
            *data = segment.recv(&self.tcp, root)?;
        }
        Ok(())
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        match &self.state {
            State::Ready(segment) => segment.send(&self.tcp, peer, data),
            _ => self.tcp.send(peer, data),
        }
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>> {
        match &self.state {
            State::Ready(segment) => segment.recv(&self.tcp, peer),
            _ => self.tcp.recv(peer),
        }
    }

    fn recv_into(&mut self, peer: usize, buffer: &mut [u8]) -> Result<()> {
        match &self.state {
            State::Ready(segment) => segment.recv_into(&self.tcp, peer, buffer),
            _ => self.tcp.recv_into(peer, buffer),
        }
    }

    fn all_to_all_v(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        self.tcp.all_to_all_v(send)
    }

    fn barrier(&mut self) -> Result<()> {
        self.tcp.barrier()
    }
}

//! Collectives over a process group: the [`Comm`] trait (what NCCL also provides) and its TCP
//! implementation. A rank belongs to several groups at once (its TP, PP, DP and EP groups),
//! each a separate [`TcpComm`] with its own sockets.
//!
//! Every member of a group must call the same collectives in the same order with the same
//! sizes (like NCCL). Calls block; each socket operation has a timeout, and every error names
//! the operation, the group and the peer rank.

pub mod bench;
pub mod nccl;
pub mod shm;
mod shm_ring;
pub mod waits;

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use crate::rendezvous::StoreClient;
use std::sync::Arc;

/// Collective operations over one process group. Positions are 0-based within the group.
pub trait Comm: Send {
    /// This process's position in the group.
    fn rank(&self) -> usize;
    /// Number of processes in the group.
    fn size(&self) -> usize;
    /// Sums `data` (same length on every member) across the group; every member ends with
    /// the identical (bitwise) result.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()>;
    /// `recv = concat(send of member 0, …, member n−1)`; `send` has the same length everywhere
    /// and `recv` is `size × send.len()`.
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// Replaces `data` on every member with `root`'s bytes (any length).
    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()>;
    /// Sends bytes to `peer`, which must call [`Comm::recv`] for this process.
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()>;
    /// Receives the bytes `peer` sent.
    fn recv(&mut self, peer: usize) -> Result<Vec<u8>>;
    /// Receives the bytes `peer` sent straight into `buffer`, whose length must be the
    /// message's (no allocation where the transport allows it).
    ///
    /// Errors: as [`Comm::recv`], and a message of another length (the stream is then out
    /// of step: the group is unusable).
    fn recv_into(&mut self, peer: usize, buffer: &mut [u8]) -> Result<()> {
        let bytes = self.recv(peer)?;
        if bytes.len() != buffer.len() {
            bail!(
                "recv from member {peer}: expected {} bytes, the peer sent {}",
                buffer.len(),
                bytes.len()
            );
        }
        buffer.copy_from_slice(&bytes);
        Ok(())
    }
    /// Personalised exchange: `send[j]` goes to member `j` (lengths may differ); returns what
    /// each member sent to this one, indexed by sender.
    fn all_to_all_v(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>>;
    /// Blocks until every member has called it.
    fn barrier(&mut self) -> Result<()>;
}

/// A group over TCP: one connection to every other member.
pub struct TcpComm {
    /// Shared with the wait records of its calls ([`waits`]), which then allocate nothing.
    group: std::sync::Arc<str>,
    position: usize,
    size: usize,
    /// Global rank of each member, for error messages.
    members: Vec<u64>,
    readers: Vec<Option<TcpStream>>,
    writers: Vec<Option<TcpStream>>,
    timeout: Duration,
}

impl TcpComm {
    /// Joins group `group` whose members are the global ranks `members` (this process is
    /// `my_rank`), exchanging endpoints through the store. `bind_host` is the address peers
    /// reach this process on. Errors: a peer that never shows up within `timeout` (named).
    pub fn connect(
        store: &mut StoreClient,
        group: &str,
        members: &[u64],
        my_rank: u64,
        bind_host: &str,
        timeout: Duration,
    ) -> Result<TcpComm> {
        let size = members.len();
        let position = members
            .iter()
            .position(|&m| m == my_rank)
            .with_context(|| {
                format!("rank {my_rank} is not a member of group `{group}` {members:?}")
            })?;
        let mut readers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let mut writers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let members_owned = members.to_vec();
        if size > 1 {
            // What each connection of this group proves in its handshake.
            let channel = format!("comm/{group}");
            let listener = TcpListener::bind((bind_host, 0))
                .with_context(|| format!("group `{group}`: cannot listen on `{bind_host}`"))?;
            let address = listener.local_addr()?;
            // Published under this rank's own key: only its host may write it.
            store.set(
                &crate::rendezvous::rank_key(my_rank, &channel),
                address.to_string().as_bytes(),
            )?;
            let keys = store.keys().clone();
            let source = keys.own_address();
            // The key of the connection with the member at `peer` (the pair key of this host
            // and the host that member is placed on) and that host's address.
            let member = move |peer: usize| member_of(&keys, *members_owned.get(peer)?);
            // Lower positions connect to higher ones; a connection is queued by the kernel
            // even before the peer accepts, so connecting first cannot deadlock.
            for peer in position + 1..size {
                let peer_address = store
                    .get(
                        &crate::rendezvous::rank_key(members[peer], &channel),
                        timeout,
                    )
                    .with_context(|| {
                        format!(
                            "group `{group}`: rank {} never published its endpoint",
                            members[peer]
                        )
                    })?;
                let peer_address: std::net::SocketAddr =
                    String::from_utf8(peer_address)?
                        .parse()
                        .with_context(|| format!("group `{group}`: a malformed endpoint"))?;
                let (key, _) = member(peer).with_context(|| {
                    format!("group `{group}`: no key for rank {}'s host", members[peer])
                })?;
                let (stream, _) = crate::handshake::connect(
                    peer_address,
                    source,
                    &key,
                    crate::handshake::Claim {
                        channel: &channel,
                        client: position as u64,
                        server: peer as u64,
                    },
                    timeout,
                )
                .with_context(|| {
                    format!(
                        "group `{group}`: cannot connect to rank {} at {peer_address} and authenticate",
                        members[peer]
                    )
                })?;
                let (reader, writer) = (stream.try_clone()?, stream);
                readers[peer] = Some(reader);
                writers[peer] = Some(writer);
            }
            let lower = accept_members(&listener, Arc::new(member), &channel, position, timeout)
                .with_context(|| {
                    format!(
                        "group `{group}`: lower-ranked peers did not connect within {timeout:?}"
                    )
                })?;
            for (peer, stream) in lower {
                let (reader, writer) = (stream.try_clone()?, stream);
                readers[peer] = Some(reader);
                writers[peer] = Some(writer);
            }
            for stream in readers.iter().chain(writers.iter()).flatten() {
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(timeout))?;
                stream.set_write_timeout(Some(timeout))?;
            }
        }
        Ok(TcpComm {
            group: group.into(),
            position,
            size,
            members: members.to_vec(),
            readers,
            writers,
            timeout,
        })
    }

    /// `"{operation} in group `g` (rank R of n): {verb} rank P failed"`, naming global ranks.
    pub(crate) fn context(&self, operation: &str, verb: &str, peer: usize) -> String {
        format!(
            "{operation} in group `{}` (rank {} of {}): {verb} rank {} failed",
            self.group, self.members[self.position], self.size, self.members[peer]
        )
    }

    /// Records that this member blocks in `operation`, `verb` member `peer` (expecting
    /// `bytes` when known), until the guard drops: the stall diagnosis reads it
    /// ([`waits`]).
    pub(crate) fn waiting(
        &self,
        operation: &'static str,
        verb: &'static str,
        peer: usize,
        bytes: Option<usize>,
    ) -> waits::WaitGuard {
        waits::waiting(
            std::sync::Arc::clone(&self.group),
            operation,
            verb,
            self.members[peer],
            bytes.map(|b| b as u64),
        )
    }

    /// The timeout every blocking call of this group runs under.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// True when the connection from `peer` reached end-of-file or failed: the peer process
    /// exited (its sockets are closed by the kernel even when it is killed). Pending data
    /// from a live peer is left unread.
    pub(crate) fn peer_closed(&self, peer: usize) -> bool {
        let Some(stream) = self.readers.get(peer).and_then(Option::as_ref) else {
            return false;
        };
        if stream.set_nonblocking(true).is_err() {
            return false;
        }
        let result = stream.peek(&mut [0u8; 1]);
        let restored = stream.set_nonblocking(false);
        match result {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock || restored.is_err(),
        }
    }

    fn write_to(&mut self, operation: &'static str, peer: usize, bytes: &[u8]) -> Result<()> {
        let context = self.context(operation, "sending to", peer);
        let _wait = self.waiting(operation, "sending to", peer, None);
        let timeout = self.timeout;
        let stream = self.writers[peer].as_mut().context("no connection")?;
        write_frame(stream, bytes)
            .map_err(|e| explain(e, timeout))
            .context(context)
    }

    fn read_from(&mut self, operation: &'static str, peer: usize) -> Result<Vec<u8>> {
        let context = self.context(operation, "receiving from", peer);
        let _wait = self.waiting(operation, "receiving from", peer, None);
        let timeout = self.timeout;
        let stream = self.readers[peer].as_mut().context("no connection")?;
        read_frame(stream)
            .map_err(|e| explain(e, timeout))
            .context(context)
    }

    /// Sends `outgoing` to `to` while receiving from `from`, so neither side can block the
    /// other on full socket buffers.
    fn exchange(
        &mut self,
        operation: &'static str,
        to: usize,
        outgoing: &[u8],
        from: usize,
    ) -> Result<Vec<u8>> {
        self.exchange_with(operation, to, outgoing, from, None, read_frame)
    }
}

impl TcpComm {
    /// Like `exchange`, but receives straight into `incoming`, whose length must equal the
    /// frame the peer sends (no allocation, no copy).
    fn exchange_into(
        &mut self,
        operation: &'static str,
        to: usize,
        outgoing: &[u8],
        from: usize,
        incoming: &mut [u8],
    ) -> Result<()> {
        let expected = Some(incoming.len());
        self.exchange_with(operation, to, outgoing, from, expected, |reader| {
            read_frame_into(reader, incoming)
        })
    }

    /// Writes `outgoing` to `to` on a scoped thread while `receive` reads from `from`
    /// (`expected` bytes, when known); errors name the operation, the direction and the
    /// peer.
    fn exchange_with<T>(
        &mut self,
        operation: &'static str,
        to: usize,
        outgoing: &[u8],
        from: usize,
        expected: Option<usize>,
        receive: impl FnOnce(&mut TcpStream) -> std::io::Result<T>,
    ) -> Result<T> {
        let _wait = self.waiting(operation, "receiving from", from, expected);
        let send_context = self.context(operation, "sending to", to);
        let receive_context = self.context(operation, "receiving from", from);
        let timeout = self.timeout;
        let writer = self.writers[to].as_mut().context("no connection")?;
        let reader = self.readers[from].as_mut().context("no connection")?;
        if outgoing.len() <= INLINE_SEND_BYTES {
            // A small frame fits in the peer's socket receive buffer, so writing it before
            // reading cannot block on the peer; no sender thread (spawning one costs more
            // than the transfer itself at decode sizes).
            write_frame(writer, outgoing)
                .map_err(|e| explain(e, timeout))
                .context(send_context)?;
            return receive(reader)
                .map_err(|e| explain(e, timeout))
                .context(receive_context);
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| write_frame(writer, outgoing));
            let received = receive(reader)
                .map_err(|e| explain(e, timeout))
                .context(receive_context);
            let sent = sender
                .join()
                .map_err(|_| anyhow!("sender thread panicked"))?
                .map_err(|e| explain(e, timeout))
                .context(send_context);
            sent?;
            received
        })
    }
}

/// Reads one frame into `buffer`; the frame must be exactly `buffer.len()` bytes.
fn read_frame_into(stream: &mut TcpStream, buffer: &mut [u8]) -> std::io::Result<()> {
    let mut length = [0u8; 8];
    stream.read_exact(&mut length)?;
    let length = u64::from_le_bytes(length) as usize;
    if length != buffer.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "expected {} bytes, the peer sent {length} (members called the collective with different sizes?)",
                buffer.len()
            ),
        ));
    }
    stream.read_exact(buffer)
}

/// Handshakes a listener runs at once; more connections are closed at once (each stranger
/// is dropped after [`crate::handshake::HELLO_TIMEOUT`]).
const MAX_PENDING_HANDSHAKES: usize = 64;

/// What [`accept_members`] knows of the member at a position: the key of the connection
/// with it, and the data address of its host where the run knows it.
type MemberOf = Arc<dyn Fn(usize) -> Option<(crate::keyring::Key, Option<IpAddr>)> + Send + Sync>;

/// The key of the connection with `rank` (the pair key of this host and that rank's) and
/// the address that rank's host connects from, as `keys` hold them.
fn member_of(
    keys: &crate::keyring::Keyring,
    rank: u64,
) -> Option<(crate::keyring::Key, Option<IpAddr>)> {
    Some((keys.pair_key_with_rank(rank)?, keys.address_of_rank(rank)))
}

/// Accepts on `listener` until every position below `position` has connected and proved
/// itself on `channel` with the key `member_of` gives for that position, from its host's
/// address (each handshake on a thread of its own, so garbage or an idle stranger holds no
/// slot and delays no member), within `timeout`. Returns each position with its
/// connection.
///
/// Errors: a position missing at `timeout`; the listener fails.
fn accept_members(
    listener: &TcpListener,
    member_of: MemberOf,
    channel: &str,
    position: usize,
    timeout: Duration,
) -> Result<Vec<(usize, TcpStream)>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    listener.set_nonblocking(true)?;
    let deadline = std::time::Instant::now() + timeout;
    let (proved, arrivals) = std::sync::mpsc::channel::<(usize, TcpStream)>();
    let pending = Arc::new(AtomicUsize::new(0));
    let mut members: Vec<Option<TcpStream>> = (0..position).map(|_| None).collect();
    let mut missing = position;
    while missing > 0 {
        while let Ok((peer, stream)) = arrivals.try_recv() {
            if members[peer].is_none() {
                members[peer] = Some(stream);
                missing -= 1;
            }
        }
        if missing == 0 {
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                    pending.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                let (member_of, channel, proved, counter) = (
                    Arc::clone(&member_of),
                    channel.to_string(),
                    proved.clone(),
                    Arc::clone(&pending),
                );
                let spawned = std::thread::Builder::new()
                    .name("comm-handshake".into())
                    .spawn(move || {
                        let mut stream = stream;
                        let member = |peer: u64| {
                            let peer = usize::try_from(peer).ok()?;
                            if peer < position {
                                member_of(peer)
                            } else {
                                None
                            }
                        };
                        let proved_as = stream
                            .set_nonblocking(false)
                            .ok()
                            .and_then(|()| {
                                crate::handshake::server(
                                    &mut stream,
                                    &channel,
                                    position as u64,
                                    &|peer| member(peer).map(|(key, _)| key),
                                )
                                .ok()
                            })
                            .map(|(peer, _)| peer)
                            .filter(|&peer| {
                                let expected = member(peer).and_then(|(_, address)| address);
                                crate::handshake::check_source(&stream, expected).is_ok()
                            });
                        let accepted = proved_as
                            .is_some_and(|peer| proved.send((peer as usize, stream)).is_ok());
                        counter.fetch_sub(1, Ordering::SeqCst);
                        accepted
                    });
                if spawned.is_err() {
                    pending.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let missing: Vec<usize> = (0..position).filter(|p| members[*p].is_none()).collect();
                bail!("positions {missing:?} never connected and proved themselves");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(members
        .into_iter()
        .enumerate()
        .filter_map(|(peer, stream)| Some((peer, stream?)))
        .collect())
}

fn explain(error: std::io::Error, timeout: Duration) -> anyhow::Error {
    match error.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            anyhow!("timed out after {timeout:?}")
        }
        std::io::ErrorKind::UnexpectedEof => {
            anyhow!("the peer closed the connection (it exited or failed)")
        }
        _ => anyhow!(error),
    }
}

/// Frames up to this size are sent without a helper thread in a simultaneous exchange: well
/// under Linux's default TCP receive buffer (`net.ipv4.tcp_rmem` default 131072 bytes), so
/// the write completes before the peer reads.
const INLINE_SEND_BYTES: usize = 32 << 10;

/// Writes the 8-byte little-endian length, then the bytes; small frames go out in one
/// segment (with `TCP_NODELAY`, two writes would be two packets and two wake-ups).
fn write_frame(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let length = (bytes.len() as u64).to_le_bytes();
    if bytes.len() <= INLINE_SEND_BYTES {
        let mut frame = Vec::with_capacity(8 + bytes.len());
        frame.extend_from_slice(&length);
        frame.extend_from_slice(bytes);
        return stream.write_all(&frame);
    }
    stream.write_all(&length)?;
    stream.write_all(bytes)
}

/// The largest frame a peer may announce (16 GiB: more than any activation, KV block or
/// broadcast of ours); a larger length is a broken peer, refused before any allocation.
const MAX_FRAME_BYTES: u64 = 1 << 34;

fn read_frame(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut length = [0u8; 8];
    stream.read_exact(&mut length)?;
    let length = u64::from_le_bytes(length);
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    if length > MAX_FRAME_BYTES {
        return Err(invalid(format!(
            "the peer announced a frame of {length} bytes, over the {MAX_FRAME_BYTES}-byte limit"
        )));
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(length as usize)
        .map_err(|_| invalid(format!("cannot allocate a frame of {length} bytes")))?;
    bytes.resize(length as usize, 0);
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// `data[a]` to read and `data[b]` to write, for disjoint ranges (the ring's send and
/// receive chunks are never the same when the group has more than one member).
fn disjoint(
    data: &mut [f32],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[f32], &mut [f32]) {
    if a.is_empty() {
        return (&[], &mut data[b]);
    }
    if b.is_empty() {
        return (&data[a], &mut []);
    }
    if a.start < b.start {
        let (left, right) = data.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = data.split_at_mut(a.start);
        (&right[..a.end - a.start], &mut left[b])
    }
}

/// Chunk `i` of `n` over `len` elements: `[i·len/n, (i+1)·len/n)`, sizes differing by ≤ 1.
pub(crate) fn chunk(i: usize, n: usize, len: usize) -> std::ops::Range<usize> {
    i * len / n..(i + 1) * len / n
}

fn as_f32(bytes: &[u8], expected: usize, what: &str) -> Result<Vec<f32>> {
    if bytes.len() != expected * 4 {
        bail!(
            "{what}: expected {expected} floats, got {} bytes (members called the collective with different sizes?)",
            bytes.len()
        );
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.position
    }

    fn size(&self) -> usize {
        self.size
    }

    /// Ring all-reduce (Patarasuk & Yuan 2009): `n−1` reduce-scatter steps, then `n−1`
    /// all-gather steps, each moving `len/n` elements to the right neighbour — bandwidth
    /// optimal, `2(n−1)/n · len` elements sent per rank.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        let (n, position, len) = (self.size, self.position, data.len());
        if n == 1 {
            return Ok(());
        }
        let (right, left) = ((position + 1) % n, (position + n - 1) % n);
        let mut scratch = vec![0f32; len.div_ceil(n)];
        for step in 0..n - 1 {
            let send = chunk((position + n - step) % n, n, len);
            let receive = chunk((position + 2 * n - step - 1) % n, n, len);
            let incoming = &mut scratch[..receive.len()];
            self.exchange_into(
                "all-reduce",
                right,
                bytemuck::cast_slice(&data[send]),
                left,
                bytemuck::cast_slice_mut(incoming),
            )?;
            for (value, add) in data[receive].iter_mut().zip(incoming.iter()) {
                *value += add;
            }
        }
        for step in 0..n - 1 {
            let send = chunk((position + 1 + n - step) % n, n, len);
            let receive = chunk((position + n - step) % n, n, len);
            let (outgoing, incoming) = disjoint(data, send, receive);
            self.exchange_into(
                "all-reduce",
                right,
                bytemuck::cast_slice(outgoing),
                left,
                bytemuck::cast_slice_mut(incoming),
            )?;
        }
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let (n, position, m) = (self.size, self.position, send.len());
        if recv.len() != n * m {
            bail!(
                "all-gather in group `{}`: receive buffer holds {} floats, expected {}",
                self.group,
                recv.len(),
                n * m
            );
        }
        recv[position * m..(position + 1) * m].copy_from_slice(send);
        let (right, left) = ((position + 1) % n, (position + n - 1) % n);
        for step in 0..n.saturating_sub(1) {
            let out = (position + n - step) % n;
            let into = (position + 2 * n - step - 1) % n;
            let bytes = self.exchange(
                "all-gather",
                right,
                bytemuck::cast_slice(&recv[out * m..(out + 1) * m]),
                left,
            )?;
            let incoming = as_f32(&bytes, m, "all-gather")?;
            recv[into * m..(into + 1) * m].copy_from_slice(&incoming);
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        if self.position == root {
            for peer in (0..self.size).filter(|&p| p != root) {
                let bytes = data.clone();
                self.write_to("broadcast", peer, &bytes)?;
            }
        } else {
            *data = self.read_from("broadcast", root)?;
        }
        Ok(())
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.write_to("send", peer, data)
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>> {
        self.read_from("recv", peer)
    }

    fn recv_into(&mut self, peer: usize, buffer: &mut [u8]) -> Result<()> {
        let context = self.context("recv", "receiving from", peer);
        let _wait = self.waiting("recv", "receiving from", peer, Some(buffer.len()));
        let timeout = self.timeout;
        let stream = self.readers[peer].as_mut().context("no connection")?;
        read_frame_into(stream, buffer)
            .map_err(|e| explain(e, timeout))
            .context(context)
    }

    fn all_to_all_v(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        let (n, position) = (self.size, self.position);
        if send.len() != n {
            bail!(
                "all-to-all in group `{}`: {} send buffers for {n} members",
                self.group,
                send.len()
            );
        }
        let mut received: Vec<Vec<f32>> = vec![Vec::new(); n];
        received[position] = send[position].clone();
        for offset in 1..n {
            let (to, from) = ((position + offset) % n, (position + n - offset) % n);
            let bytes = self.exchange("all-to-all", to, bytemuck::cast_slice(&send[to]), from)?;
            received[from] = as_f32(&bytes, bytes.len() / 4, "all-to-all")?;
        }
        Ok(received)
    }

    fn barrier(&mut self) -> Result<()> {
        let mut token = [1f32];
        self.all_reduce_sum(&mut token)?;
        if token[0] as usize != self.size {
            bail!(
                "barrier in group `{}`: {} of {} members arrived",
                self.group,
                token[0],
                self.size
            );
        }
        Ok(())
    }
}

/// One size of an all-reduce benchmark: message bytes and the mean time of one call.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AllreduceRow {
    pub bytes: usize,
    pub time_secs: f64,
}

impl AllreduceRow {
    /// Algorithm bandwidth: message bytes over the time of one call, bytes/s.
    pub fn algbw_bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.time_secs
    }

    /// Bus bandwidth over `world` ranks, bytes/s: `algbw · 2(n−1)/n`, what each link
    /// carries in a ring all-reduce, comparable with the link rate (the nccl-tests
    /// repository's `doc/PERFORMANCE.md`).
    pub fn busbw_bytes_per_sec(&self, world: usize) -> f64 {
        let n = world as f64;
        self.algbw_bytes_per_sec() * 2.0 * (n - 1.0) / n
    }
}

/// `rows` over `world` ranks as `all_reduce_perf` of nccl-tests prints them: two header
/// lines, then size (bytes), count (float32 elements), type, time (µs), algbw and busbw
/// (GB/s, 10⁹ bytes/s).
pub fn nccl_tests_table(rows: &[AllreduceRow], world: usize) -> String {
    let mut table = format!(
        "#{:>11} {:>12} {:>6} {:>10} {:>8} {:>8}\n#{:>11} {:>12} {:>6} {:>10} {:>8} {:>8}\n",
        "size",
        "count",
        "type",
        "time",
        "algbw",
        "busbw",
        "(B)",
        "(elements)",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)"
    );
    for row in rows {
        table.push_str(&format!(
            " {:>11} {:>12} {:>6} {:>10.1} {:>8.3} {:>8.3}\n",
            row.bytes,
            row.bytes / 4,
            "float",
            row.time_secs * 1e6,
            row.algbw_bytes_per_sec() / 1e9,
            row.busbw_bytes_per_sec(world) / 1e9
        ));
    }
    table
}

/// Bytes one plain TCP stream carries, rank `sender` → rank 0, measured with 256 MiB in
/// 1 MiB writes: the baseline an all-reduce's bus bandwidth is compared to (what one
/// `iperf3` stream would show). Rank 0 listens on `bind_addr` and publishes its address in
/// the store; the other ranks return 0 at once. Every rank's return value but rank 0's is
/// 0.
///
/// Errors: the listener, the connection, a read or a write fails; the address does not
/// arrive within `timeout`.
pub fn tcp_stream_bytes_per_sec(
    store: &mut StoreClient,
    rank: u64,
    sender: u64,
    bind_addr: &str,
    timeout: Duration,
) -> Result<f64> {
    const TOTAL_BYTES: usize = 256 << 20;
    const CHUNK_BYTES: usize = 1 << 20;
    if rank == 0 {
        let listener = TcpListener::bind((bind_addr, 0))?;
        store.set(
            &crate::rendezvous::rank_key(0, "bench/stream"),
            listener.local_addr()?.to_string().as_bytes(),
        )?;
        let keys = store.keys().clone();
        let member = move |_: usize| member_of(&keys, sender);
        let mut socket = accept_members(&listener, Arc::new(member), "bench/stream", 1, timeout)?
            .pop()
            .map(|(_, socket)| socket)
            .context("the sender never connected")?;
        let mut buffer = vec![0u8; CHUNK_BYTES];
        let (mut received, start) = (0, std::time::Instant::now());
        while received < TOTAL_BYTES {
            match socket.read(&mut buffer)? {
                0 => break,
                n => received += n,
            }
        }
        return Ok(received as f64 / start.elapsed().as_secs_f64());
    }
    if rank == sender {
        let address = String::from_utf8(
            store.get(&crate::rendezvous::rank_key(0, "bench/stream"), timeout)?,
        )?
        .parse()
        .context("a malformed stream endpoint")?;
        let keys = store.keys();
        let key = keys
            .pair_key_with_rank(0)
            .context("no key for rank 0's host")?;
        let (mut socket, _) = crate::handshake::connect(
            address,
            keys.own_address(),
            &key,
            crate::handshake::Claim {
                channel: "bench/stream",
                client: 0,
                server: 1,
            },
            timeout,
        )?;
        let chunk = vec![7u8; CHUNK_BYTES];
        for _ in 0..TOTAL_BYTES / CHUNK_BYTES {
            socket.write_all(&chunk)?;
        }
    }
    Ok(0.0)
}

/// Times `comm.all_reduce_sum` for every power-of-two size from 8 bytes to `max_bytes`
/// (one timed warm-up call, a barrier, then enough repetitions for ~0.2 s by rank 0's
/// warm-up, 3 to 200, the count broadcast so every member runs the same), as nccl-tests'
/// `all_reduce_perf` sweeps sizes. On a slow link a large size costs ~0.2 s plus 4 calls,
/// not a fixed byte volume. Every member must call it with the same `max_bytes`; it blocks
/// until the sweep is done.
///
/// Errors: a collective fails (a lost peer, a timeout).
pub fn time_all_reduce(comm: &mut dyn Comm, max_bytes: usize) -> Result<Vec<AllreduceRow>> {
    const TARGET_SECS: f64 = 0.2;
    let mut rows = Vec::new();
    let mut bytes = 8;
    while bytes <= max_bytes {
        let mut data = vec![1f32; bytes / 4];
        let warm_up = std::time::Instant::now();
        comm.all_reduce_sum(&mut data)?;
        let warm_up_secs = warm_up.elapsed().as_secs_f64();
        let mut count = ((TARGET_SECS / warm_up_secs.max(1e-6)) as u32)
            .clamp(3, 200)
            .to_le_bytes()
            .to_vec();
        comm.broadcast(&mut count, 0)?;
        let iterations = u32::from_le_bytes(
            count
                .as_slice()
                .try_into()
                .map_err(|_| anyhow!("malformed repetition count from rank 0"))?,
        );
        comm.barrier()?;
        let start = std::time::Instant::now();
        for _ in 0..iterations {
            comm.all_reduce_sum(&mut data)?;
        }
        rows.push(AllreduceRow {
            bytes,
            time_secs: start.elapsed().as_secs_f64() / iterations as f64,
        });
        bytes *= 2;
    }
    Ok(rows)
}

//! KV hand-off between replicas, the transport of prefill/decode disaggregation: every rank
//! of a decode replica runs an [`Inbox`] (a TCP listener on its data-network address), and
//! the rank at the same (tp, pp) position of a prefill replica sends it a sequence's
//! [`KvTransfer`]s through an [`Outbox`] — shard to shard, so no rank ever holds another
//! rank's keys and values, and several transfers of one sequence (layer ranges, as a
//! prefill produces them) may arrive in any order.
//!
//! Wire format: a connection opens with the run's handshake ([`crate::handshake`], channel
//! `kv`: both sides prove the run secret, which never crosses the wire) and the name of a
//! shared segment the sender offers (`u32` LE length, bytes; empty: none); then frames of a
//! transfer id (`u64` LE), a JSON header (`u32` LE length: tokens, prompt length, layers,
//! geometry), a kind byte and the f16 bits — binary, since the bits are nearly all of the
//! bytes. A connection that does not prove the secret is closed before anything else of it
//! is read.
//!
//! On one host the bits go through shared memory, as NCCL's SHM transport moves intra-node
//! traffic (never loopback TCP): a prefill rank whose decode peer runs on the same host
//! (the launcher's placement says so) creates a ring segment in `/dev/shm` and offers its
//! name; the inbox maps it, unlinks it (so nothing is left behind if either side dies) and
//! answers one byte (1: mapped, 0: not, and the connection carries the bits inline). A
//! shared frame then carries the bits' offset in the ring, their count and how far the
//! ring advanced; the inbox copies them out and answers the total advance so far, which
//! frees that room for the sender. The TCP connection stays the doorbell and the framing:
//! one copy in, one copy out, instead of the socket's copies through the kernel.
//!
//! Frame kinds: `0` inline (`u64` LE count of values, then `u16` LE values); `1` shared
//! (`u64` LE offset in bytes, count of values, advance in bytes).

use std::collections::HashMap;
use std::collections::HashSet;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use memmap2::{Mmap, MmapMut};

use crate::keyring::{Key, Keyring};
use crate::runtime::collectives::shm::{create_segment_file, segment_directory};
use crate::runtime::exec::executor::KvSent;
use crate::runtime::model::kv::KvTransfer;

/// Transfers nobody claims within this long are dropped (a prefill whose first token ended
/// the request still sends its KV; the decode side never asks for it).
const STALE_AFTER: Duration = Duration::from_secs(120);
/// How long a send may take to connect, and to hand each write to the kernel, before it
/// fails (a decode host that went away or a link that drops everything): the prefill
/// replica fails that request and goes on.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest header accepted, bytes.
const MAX_HEADER_BYTES: usize = 64 << 20;
/// The inbox's channel in the handshake.
const CHANNEL: &str = "kv";
/// Connections an inbox runs its handshake on at once; more are closed at once.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Largest segment name accepted, bytes.
const MAX_NAME_BYTES: usize = 255;
/// Name prefix of the ring segments in `/dev/shm` (followed by the sender's pid and a
/// random number).
const SEGMENT_PREFIX: &str = "infer-kv";
/// Bytes of a ring segment, one per (prefill rank, decode rank) pair on one host. 16 MiB
/// holds a 2,048-token chunk's KV of 8 SmolLM2 layers (6 KiB a token) and fits Docker's
/// default 64 MiB `/dev/shm` with room to spare; a part larger than a quarter of the ring
/// is split ([`KvTransfer::split`]) so several are in flight.
pub(crate) const RING_BYTES: usize = 16 << 20;
/// Every part starts on a cache line of the ring.
const RING_ALIGN: u64 = 64;
/// The sender reads the inbox's answers when this many are unread, so they never fill the
/// socket's buffers (8 bytes each) while the sender still has room in the ring.
const MAX_UNREAD_ACKS: usize = 1024;
/// Frame kinds.
const INLINE: u8 = 0;
const SHARED: u8 = 1;

/// What a frame's header says; the values follow it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    tokens: Vec<u32>,
    first_position: usize,
    prompt_tokens: usize,
    layers: std::ops::Range<usize>,
    n_kv_heads: usize,
    head_dim: usize,
}

#[derive(Default)]
struct InboxState {
    /// Transfers by id, with when the first part arrived.
    arrived: HashMap<u64, (Instant, Vec<KvTransfer>)>,
    /// Bytes of the values in `arrived`.
    bytes: usize,
}

/// The most KV bytes an inbox keeps for transfers not yet taken (1 GiB, more than a decode
/// rank's pool holds of the prompts in flight here); past it the oldest transfers go, and
/// their requests recompute (as after a lost transfer).
const MAX_INBOX_BYTES: usize = 1 << 30;

impl InboxState {
    /// Drops transfers older than [`STALE_AFTER`], then the oldest while over
    /// [`MAX_INBOX_BYTES`].
    fn prune(&mut self) {
        let stale: Vec<u64> = self
            .arrived
            .iter()
            .filter(|(_, (since, _))| since.elapsed() >= STALE_AFTER)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.remove(id);
        }
        while self.bytes > MAX_INBOX_BYTES {
            let Some(oldest) = self
                .arrived
                .iter()
                .min_by_key(|(_, (since, _))| *since)
                .map(|(id, _)| *id)
            else {
                break;
            };
            self.remove(oldest);
        }
    }

    /// Takes transfer `id`'s parts out, keeping the byte count.
    fn remove(&mut self, id: u64) -> Option<Vec<KvTransfer>> {
        let (_, parts) = self.arrived.remove(&id)?;
        self.bytes -= parts.iter().map(|p| p.values.len() * 2).sum::<usize>();
        Some(parts)
    }
}

type Shared = Arc<(Mutex<InboxState>, Condvar)>;

/// A decode rank's receiving end: accepts prefill ranks' connections and keeps what they
/// send until [`Inbox::take`] claims it. Dropping it stops accepting.
pub struct Inbox {
    address: SocketAddr,
    state: Shared,
    stop: Arc<AtomicBool>,
}

impl Inbox {
    /// Listens on `host` (a free port) as rank `rank`, admitting connections only from
    /// `senders` (the prefill ranks that hand this one KV), each proving the pair key of its
    /// host and this one's (`keys`).
    ///
    /// Errors: the address cannot be bound.
    pub fn bind(host: &str, keys: &Keyring, rank: u64, senders: &[u64]) -> Result<Inbox> {
        let listener = TcpListener::bind((host, 0))
            .with_context(|| format!("cannot listen for KV transfers on `{host}`"))?;
        let address = listener.local_addr()?;
        let state: Shared = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (accept_state, accept_stop, keys) = (
            Arc::clone(&state),
            Arc::clone(&stop),
            Arc::new(keys.clone()),
        );
        let senders: Arc<[u64]> = senders.into();
        std::thread::Builder::new()
            .name("kv-inbox".into())
            .spawn(move || {
                let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                for stream in listener.incoming() {
                    if accept_stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                        // Strangers piling up: close at once.
                        pending.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    let (state, keys, senders, counter) = (
                        Arc::clone(&accept_state),
                        Arc::clone(&keys),
                        Arc::clone(&senders),
                        Arc::clone(&pending),
                    );
                    let spawned = std::thread::Builder::new()
                        .name("kv-inbox-peer".into())
                        .spawn(move || {
                            let _ = stream.set_nodelay(true);
                            // Nothing of a peer is read before it proves its host's key.
                            let key_for = |client: u64| {
                                if !senders.contains(&client) {
                                    return None;
                                }
                                keys.pair_key_with_rank(client)
                            };
                            // ... and comes from its host's address.
                            let proved =
                                crate::handshake::server(&mut stream, CHANNEL, rank, &key_for)
                                    .and_then(|(client, _)| {
                                        let expected = keys.address_of_rank(client);
                                        crate::handshake::check_source(&stream, expected)
                                    });
                            counter.fetch_sub(1, Ordering::SeqCst);
                            // A peer that breaks the protocol or goes away only loses its
                            // connection; what it delivered stays.
                            if proved.is_ok() {
                                let _ = receive(stream, &state);
                            }
                        });
                    if spawned.is_err() {
                        pending.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .context("cannot start the KV inbox thread")?;
        // Transfers nobody takes (their request ended, or went elsewhere) go after
        // STALE_AFTER even when nothing else arrives.
        let (prune_state, prune_stop) = (Arc::clone(&state), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("kv-inbox-prune".into())
            .spawn(move || {
                while !prune_stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_secs(1));
                    let (lock, _) = &*prune_state;
                    lock.lock().unwrap_or_else(|e| e.into_inner()).prune();
                }
            })
            .context("cannot start the KV inbox's pruning thread")?;
        Ok(Inbox {
            address,
            state,
            stop,
        })
    }

    /// Where prefill ranks connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Waits up to `timeout` until the parts of transfer `id` cover layers `0..n_layers` at
    /// every prompt position, and takes them (in arrival order; parts may repeat).
    ///
    /// Errors: the parts do not arrive in time (the prefill replica or its link failed).
    pub fn take(&self, id: u64, n_layers: usize, timeout: Duration) -> Result<Vec<KvTransfer>> {
        let (lock, arrived) = &*self.state;
        let deadline = Instant::now() + timeout;
        let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let (covered, total) = state
                .arrived
                .get(&id)
                .map_or((0, 0), |(_, parts)| coverage(parts, n_layers));
            if total > 0 && covered == total {
                return state
                    .remove(id)
                    .context("a KV transfer vanished while it was taken");
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "KV transfer {id}: {covered} of {} layer positions arrived within {:.0} s (the prefill replica or the link to it failed)",
                    if total > 0 {
                        total.to_string()
                    } else {
                        "its".to_string()
                    },
                    timeout.as_secs_f64()
                );
            }
            state = arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How many of the `n_layers × prompt_tokens` (layer, position) pairs `parts` cover, and
/// that total (0 without parts).
fn coverage(parts: &[KvTransfer], n_layers: usize) -> (usize, usize) {
    let Some(prompt) = parts.first().map(|p| p.prompt_tokens) else {
        return (0, 0);
    };
    let mut seen = vec![false; n_layers * prompt];
    for part in parts {
        for layer in part.layers.clone().filter(|&l| l < n_layers) {
            let start = (part.first_position).min(prompt);
            let end = (part.first_position + part.tokens.len()).min(prompt);
            seen[layer * prompt + start..layer * prompt + end].fill(true);
        }
    }
    (seen.iter().filter(|&&s| s).count(), seen.len())
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.address, Duration::from_millis(200));
    }
}

/// Reads one authenticated peer's frames into the inbox until it closes. Errors: a
/// malformed frame, a lost connection.
fn receive(stream: TcpStream, state: &Shared) -> Result<()> {
    let mut answers = stream.try_clone()?;
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let offered = read_bytes(&mut reader, MAX_NAME_BYTES)?;
    let ring = if offered.is_empty() {
        None
    } else {
        // A segment that cannot be mapped here (another mount namespace, another host
        // after all) leaves the bits inline.
        let mapped = map_offered_segment(&offered);
        answers.write_all(&[u8::from(mapped.is_ok())])?;
        mapped.ok()
    };
    // Bytes of the ring released so far (what the sender may reuse).
    let mut released = 0u64;
    loop {
        let mut id = [0u8; 8];
        if reader.read_exact(&mut id).is_err() {
            return Ok(());
        }
        let id = u64::from_le_bytes(id);
        let header: Header = serde_json::from_slice(&read_bytes(&mut reader, MAX_HEADER_BYTES)?)
            .context("a malformed KV transfer header")?;
        let expected = [header.n_kv_heads, header.tokens.len(), header.head_dim]
            .into_iter()
            .try_fold(header.layers.len() * 2, usize::checked_mul)
            .context("a KV transfer header whose shape overflows")?;
        let mut kind = [0u8; 1];
        reader.read_exact(&mut kind)?;
        let values = match kind[0] {
            INLINE => {
                let count = read_u64(&mut reader)? as usize;
                if count != expected {
                    bail!("a KV transfer announces {count} values for a shape of {expected}");
                }
                let mut bytes = vec![0u8; count * 2];
                reader.read_exact(&mut bytes)?;
                bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect()
            }
            SHARED => {
                let Some(ring) = &ring else {
                    bail!("a KV part in shared memory on a connection without a segment");
                };
                let offset = read_u64(&mut reader)? as usize;
                let count = read_u64(&mut reader)? as usize;
                let advance = read_u64(&mut reader)?;
                if count != expected {
                    bail!("a KV transfer announces {count} values for a shape of {expected}");
                }
                let end = offset.saturating_add(count.saturating_mul(2));
                if !offset.is_multiple_of(2) || end > ring.len() {
                    bail!(
                        "a KV part at bytes {offset}..{end} of a {}-byte segment",
                        ring.len()
                    );
                }
                // The sender wrote the bits before the frame that names them (the socket's
                // system calls order the two).
                fence(Ordering::Acquire);
                let mut values = vec![0u16; count];
                bytemuck::cast_slice_mut::<u16, u8>(&mut values)
                    .copy_from_slice(&ring[offset..end]);
                released += advance;
                answers.write_all(&released.to_le_bytes())?;
                values
            }
            other => bail!("a KV frame of unknown kind {other}"),
        };
        let transfer = KvTransfer {
            tokens: header.tokens,
            first_position: header.first_position,
            prompt_tokens: header.prompt_tokens,
            layers: header.layers,
            n_kv_heads: header.n_kv_heads,
            head_dim: header.head_dim,
            values,
        };
        let (lock, arrived) = &**state;
        let mut inbox = lock.lock().unwrap_or_else(|e| e.into_inner());
        inbox.bytes += transfer.values.len() * 2;
        inbox
            .arrived
            .entry(id)
            .or_insert_with(|| (Instant::now(), Vec::new()))
            .1
            .push(transfer);
        inbox.prune();
        arrived.notify_all();
    }
}

/// Maps the ring segment a sender offers, by name in [`segment_directory`], and unlinks it:
/// both ends hold it now, and it goes when both have unmapped it, however they end.
///
/// Errors: a name that is not a KV segment's, a file that is not there or cannot be mapped.
fn map_offered_segment(name: &[u8]) -> Result<Mmap> {
    let name = std::str::from_utf8(name).context("a segment name that is not UTF-8")?;
    let valid = name
        .strip_prefix(SEGMENT_PREFIX)
        .is_some_and(|rest| rest.chars().all(|c| c == '-' || c.is_ascii_hexdigit()));
    ensure!(valid, "`{name}` is not a KV segment's name");
    let path = segment_directory().join(name);
    let file =
        std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the segment is private to this connection (created exclusively, mode 0600, by
    // a peer that presented the run token) and read only where the protocol says the
    // sender is done writing.
    let map =
        unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
    let _ = std::fs::remove_file(&path);
    Ok(map)
}

fn read_u64(reader: &mut impl Read) -> Result<u64> {
    let mut bytes = [0u8; 8];
    reader.read_exact(&mut bytes)?;
    Ok(u64::from_le_bytes(bytes))
}

fn read_bytes(reader: &mut impl Read, limit: usize) -> Result<Vec<u8>> {
    let mut length = [0u8; 4];
    reader.read_exact(&mut length)?;
    let length = u32::from_le_bytes(length) as usize;
    if length > limit {
        bail!("a frame of {length} bytes is over the limit of {limit}");
    }
    let mut bytes = vec![0u8; length];
    reader.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// What an [`Outbox`]'s sending thread reports.
#[derive(Default)]
struct SendState {
    /// Parts queued and not yet sent (or failed), by transfer id.
    pending: HashMap<u64, usize>,
    /// The first failure of each transfer.
    failed: HashMap<u64, String>,
    sent: KvSent,
}

type SendShared = Arc<(Mutex<SendState>, Condvar)>;

/// One part to send.
struct Job {
    address: String,
    /// Whether the inbox runs on this host (offer it a shared segment).
    local: bool,
    id: u64,
    transfer: KvTransfer,
    /// How to prove this rank to that inbox's (`None`: no rank known at `address`).
    peer: Option<PeerKey>,
}

/// How this rank proves itself to an inbox.
struct PeerKey {
    /// The key of the connection: the pair key of this host and the inbox's.
    key: Key,
    /// This rank.
    client: u64,
    /// The inbox's rank.
    server: u64,
    /// This host's data address, where the run knows it: the connection leaves from it.
    source: Option<std::net::IpAddr>,
}

/// Checks that `parts` (an [`Inbox::take`]'s) carry the KV of `prompt`: each part's tokens
/// are the prompt's at its positions, and its prompt is as long. A transfer forged or mixed
/// up for another request is refused instead of decoded from.
///
/// Errors: the first part that does not match, naming its positions.
pub fn check_prompt(parts: &[KvTransfer], prompt: &[u32]) -> Result<()> {
    for part in parts {
        let positions = part.first_position..part.first_position + part.tokens.len();
        ensure!(
            part.prompt_tokens == prompt.len()
                && prompt.get(positions.clone()) == Some(&part.tokens[..]),
            "KV for positions {positions:?} of another prompt ({} tokens; this request's has {}): not this request's transfer",
            part.prompt_tokens,
            prompt.len()
        );
    }
    Ok(())
}

/// A prefill rank's sending end: a thread that sends the queued parts in order, over one
/// connection per decode rank (opened on first use and kept; through a shared ring when the
/// decode rank runs on this host), while the rank computes the rest of the prefill; counts
/// what it sends. Dropping it lets the thread finish the queue.
pub struct Outbox {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    state: SendShared,
    /// Inbox addresses on this host.
    local: HashSet<String>,
    ring_bytes: usize,
    /// This rank's keys, and its rank (its identity to every inbox).
    keys: Arc<Keyring>,
    rank: u64,
    /// The rank behind each inbox address ([`Outbox::add_inbox`]).
    inboxes: HashMap<String, u64>,
}

impl Outbox {
    /// The outbox of rank `rank`, proving itself to every inbox with `keys`, with rings
    /// of [`RING_BYTES`].
    ///
    /// Errors: the sending thread cannot start.
    pub fn new(keys: &Keyring, rank: u64) -> Result<Outbox> {
        Outbox::with_ring_bytes(keys, rank, RING_BYTES)
    }

    /// An outbox whose shared rings hold `ring_bytes` each (at least 4 KiB).
    ///
    /// Errors: the sending thread cannot start.
    pub(crate) fn with_ring_bytes(keys: &Keyring, rank: u64, ring_bytes: usize) -> Result<Outbox> {
        let ring_bytes = ring_bytes.max(4096);
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let state: SendShared = Arc::default();
        let shared = Arc::clone(&state);
        std::thread::Builder::new()
            .name("kv-outbox".into())
            .spawn(move || {
                let mut peers: HashMap<String, Peer> = HashMap::new();
                for job in queue {
                    let (lock, done) = &*shared;
                    let skip = lock
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .failed
                        .contains_key(&job.id);
                    let started = Instant::now();
                    // A transfer that already failed sends nothing more.
                    let result = if skip {
                        Ok(false)
                    } else {
                        send_part(&mut peers, ring_bytes, &job)
                    };
                    if result.is_err() {
                        peers.remove(&job.address);
                    }
                    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
                    match result {
                        Ok(shared) if !skip => {
                            let bytes = job.transfer.kv_bytes() as u64;
                            state.sent.bytes += bytes;
                            if shared {
                                state.sent.shm_bytes += bytes;
                            }
                            state.sent.parts += 1;
                            state.sent.secs += started.elapsed().as_secs_f64();
                        }
                        Ok(_) => {}
                        Err(error) => {
                            state.failed.entry(job.id).or_insert_with(|| {
                                format!(
                                    "cannot send KV transfer {} to {}: {error:#}",
                                    job.id, job.address
                                )
                            });
                        }
                    }
                    if let Some(left) = state.pending.get_mut(&job.id) {
                        *left -= 1;
                        if *left == 0 {
                            state.pending.remove(&job.id);
                        }
                    }
                    done.notify_all();
                }
            })
            .context("cannot start the KV outbox thread")?;
        Ok(Outbox {
            jobs: Some(jobs),
            state,
            local: HashSet::new(),
            ring_bytes,
            keys: Arc::new(keys.clone()),
            rank,
            inboxes: HashMap::new(),
        })
    }

    /// Says that the inbox at `address` is rank `rank`'s: the connection to it proves the
    /// pair key of this host and that rank's, and checks that rank answers.
    pub fn add_inbox(&mut self, address: &str, rank: u64) {
        self.inboxes.insert(address.to_string(), rank);
    }

    /// Says that the inbox at `address` runs on this host: the connection to it offers a
    /// shared ring (the bits go inline if the inbox cannot map it).
    pub fn on_this_host(&mut self, address: &str) {
        self.local.insert(address.to_string());
    }

    /// Queues `transfer` as part of transfer `id` for the inbox at `address`; it is sent
    /// while the caller goes on (in parts of a quarter ring at most, through shared
    /// memory). [`Outbox::finish`] says whether every part went.
    pub fn send(&mut self, address: &str, id: u64, transfer: KvTransfer) {
        let local = self.local.contains(address);
        let parts = if local {
            transfer.split(self.ring_bytes / 4)
        } else {
            vec![transfer]
        };
        let (lock, _) = &*self.state;
        *lock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .entry(id)
            .or_default() += parts.len();
        let mut sent = true;
        for transfer in parts {
            let job = Job {
                address: address.to_string(),
                local,
                id,
                transfer,
                peer: self.inboxes.get(address).and_then(|&server| {
                    Some(PeerKey {
                        key: self.keys.pair_key_with_rank(server)?,
                        client: self.rank,
                        server,
                        source: self.keys.own_address(),
                    })
                }),
            };
            sent &= self
                .jobs
                .as_ref()
                .is_some_and(|jobs| jobs.send(job).is_ok());
        }
        if !sent {
            let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
            state.pending.remove(&id);
            state
                .failed
                .insert(id, "the KV outbox thread has stopped".to_string());
        }
    }

    /// Waits until every part of transfer `id` queued so far has been sent (each send is
    /// bounded by [`SEND_TIMEOUT`]) and forgets the transfer.
    ///
    /// Errors: a part could not be sent (the inbox unreachable, the connection broken).
    pub fn finish(&mut self, id: u64) -> Result<()> {
        let (lock, done) = &*self.state;
        let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
        while state.pending.contains_key(&id) {
            state = done.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        match state.failed.remove(&id) {
            Some(error) => Err(anyhow::anyhow!(error)),
            None => Ok(()),
        }
    }

    /// What was sent so far.
    pub fn sent(&self) -> KvSent {
        self.state.0.lock().unwrap_or_else(|e| e.into_inner()).sent
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has sent what was queued.
        self.jobs.take();
    }
}

/// A sender's connection to one inbox.
struct Peer {
    writer: BufWriter<TcpStream>,
    /// The shared ring, when the inbox mapped one.
    ring: Option<Ring>,
}

/// The sender's side of a shared ring: bytes are written at `written` (modulo the size) and
/// reused once the inbox's answers say they were `released`.
struct Ring {
    map: MmapMut,
    /// The connection's reading side, where the inbox's answers arrive.
    answers: TcpStream,
    written: u64,
    released: u64,
    /// Answers on their way and not read yet (one per shared frame).
    unread: usize,
}

impl Ring {
    /// Copies `values` into the ring, first waiting (each answer within [`SEND_TIMEOUT`])
    /// until the inbox has released room; returns the offset of the bits and how far the
    /// ring advanced (the bits, rounded up to [`RING_ALIGN`], after any skip to the start).
    ///
    /// Errors: the part is larger than the ring, the inbox does not answer in time.
    fn put(&mut self, values: &[u16]) -> Result<(u64, u64)> {
        let size = self.map.len() as u64;
        let bytes = bytemuck::cast_slice::<u16, u8>(values);
        let rounded = (bytes.len() as u64).next_multiple_of(RING_ALIGN);
        ensure!(
            rounded <= size,
            "a KV part of {} bytes is larger than the {size}-byte ring",
            bytes.len()
        );
        let at = self.written % size;
        // A part never wraps: it skips the ring's tail instead.
        let skip = if at + rounded > size { size - at } else { 0 };
        let advance = skip + rounded;
        while size - (self.written - self.released) < advance || self.unread >= MAX_UNREAD_ACKS {
            ensure!(self.unread > 0, "the KV ring's accounting is inconsistent");
            let released = read_u64(&mut self.answers)
                .context("waiting for the decode rank to free room in the shared KV ring")?;
            self.unread -= 1;
            self.released = self.released.max(released);
        }
        let offset = (at + skip) % size;
        self.map[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
        fence(Ordering::Release);
        self.written += advance;
        self.unread += 1;
        Ok((offset, advance))
    }
}

/// Maps the ring segment this sender just created at `path`.
///
/// Errors: the file cannot be opened or mapped.
fn map_own_segment(path: &std::path::Path) -> Result<MmapMut> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    // SAFETY: the segment was created exclusively for this connection; the inbox reads
    // only the parts the frames name, after they are written.
    Ok(unsafe { MmapMut::map_mut(&file)? })
}

/// Opens a connection to the inbox at `address`, offering a ring of `ring_bytes` when
/// `local`; a ring that cannot be made or mapped leaves the connection inline.
///
/// Errors: the address is not one, the inbox cannot be reached or does not answer.
fn connect(address: &str, peer: &PeerKey, local: bool, ring_bytes: usize) -> Result<Peer> {
    let socket: SocketAddr = address
        .parse()
        .with_context(|| format!("`{address}` is not an inbox address"))?;
    let (stream, _) = crate::handshake::connect(
        socket,
        peer.source,
        &peer.key,
        crate::handshake::Claim {
            channel: CHANNEL,
            client: peer.client,
            server: peer.server,
        },
        SEND_TIMEOUT,
    )
    .with_context(|| format!("cannot reach the KV inbox at {address} and authenticate"))?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(SEND_TIMEOUT))?;
    stream.set_read_timeout(Some(SEND_TIMEOUT))?;
    let mut answers = stream.try_clone()?;
    let mut writer = BufWriter::with_capacity(1 << 20, stream);
    // Made and mapped here before the inbox hears its name: the inbox unlinks it as soon
    // as it has mapped it. A ring that cannot be made (a full `/dev/shm`) leaves the bits
    // inline.
    let segment = if local {
        create_segment_file(SEGMENT_PREFIX, ring_bytes)
            .ok()
            .and_then(|path| match map_own_segment(&path) {
                Ok(map) => Some((path, map)),
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                    None
                }
            })
    } else {
        None
    };
    let name = segment
        .as_ref()
        .and_then(|(path, _)| path.file_name())
        .map_or(String::new(), |name| name.to_string_lossy().into_owned());
    writer.write_all(&(name.len() as u32).to_le_bytes())?;
    writer.write_all(name.as_bytes())?;
    writer.flush()?;
    let Some((path, map)) = segment else {
        return Ok(Peer { writer, ring: None });
    };
    let mut answer = [0u8; 1];
    let answered = answers
        .read_exact(&mut answer)
        .context("the inbox did not answer the offer of a shared ring");
    // The inbox unlinked it once mapped; when it did not, nobody else will.
    let _ = std::fs::remove_file(&path);
    answered?;
    let ring = (answer[0] == 1).then_some(Ring {
        map,
        answers,
        written: 0,
        released: 0,
        unread: 0,
    });
    Ok(Peer { writer, ring })
}

/// Sends one part over `peers`' connection to its inbox, opening it first if needed;
/// returns whether the bits went through shared memory.
fn send_part(peers: &mut HashMap<String, Peer>, ring_bytes: usize, job: &Job) -> Result<bool> {
    let (address, transfer) = (&job.address, &job.transfer);
    if !peers.contains_key(address) {
        let key = job
            .peer
            .as_ref()
            .with_context(|| format!("no rank of this run is known at {address}"))?;
        let peer = connect(address, key, job.local, ring_bytes)?;
        peers.insert(address.to_string(), peer);
    }
    let peer = peers.get_mut(address).expect("inserted above");
    // Into the ring first: waiting for room there must not hold a half-written frame.
    let shared = match &mut peer.ring {
        Some(ring)
            if (transfer.kv_bytes() as u64).next_multiple_of(RING_ALIGN)
                <= ring.map.len() as u64 =>
        {
            Some(ring.put(&transfer.values)?)
        }
        _ => None,
    };
    let writer = &mut peer.writer;
    let header = serde_json::to_vec(&Header {
        tokens: transfer.tokens.clone(),
        first_position: transfer.first_position,
        prompt_tokens: transfer.prompt_tokens,
        layers: transfer.layers.clone(),
        n_kv_heads: transfer.n_kv_heads,
        head_dim: transfer.head_dim,
    })?;
    writer.write_all(&job.id.to_le_bytes())?;
    writer.write_all(&(header.len() as u32).to_le_bytes())?;
    writer.write_all(&header)?;
    if let Some((offset, advance)) = shared {
        writer.write_all(&[SHARED])?;
        writer.write_all(&offset.to_le_bytes())?;
        writer.write_all(&(transfer.values.len() as u64).to_le_bytes())?;
        writer.write_all(&advance.to_le_bytes())?;
    } else {
        writer.write_all(&[INLINE])?;
        writer.write_all(&(transfer.values.len() as u64).to_le_bytes())?;
        let bytes: Vec<u8> = transfer
            .values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        writer.write_all(&bytes)?;
    }
    writer.flush()?;
    Ok(shared.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host `host`'s keys in a run of three ranks: 0 (prefill) on host 0, 1 (decode) and 2
    /// on host 1.
    fn keys(secret: &str, host: u32) -> Keyring {
        Keyring::master(secret, crate::keyring::LAUNCHER_HOST, vec![0, 1, 1])
            .for_host(host)
            .expect("host keys")
    }

    /// Rank 1's inbox, taking KV from rank 0.
    fn inbox() -> Inbox {
        Inbox::bind("127.0.0.1", &keys("secret", 1), 1, &[0]).expect("bind")
    }

    /// Rank 0's outbox to the inboxes at `addresses` (rank 1's), with `ring_bytes` rings.
    fn outbox(addresses: &[&str], ring_bytes: usize) -> Outbox {
        let mut outbox =
            Outbox::with_ring_bytes(&keys("secret", 0), 0, ring_bytes).expect("outbox");
        for address in addresses {
            outbox.add_inbox(address, 1);
        }
        outbox
    }

    /// Layers `layers` at positions `positions` of a 6-token prompt.
    fn part(layers: std::ops::Range<usize>, positions: std::ops::Range<usize>) -> KvTransfer {
        let (heads, dim) = (2, 4);
        let tokens: Vec<u32> = positions.clone().map(|p| 100 + p as u32).collect();
        let n = layers.len() * 2 * heads * tokens.len() * dim;
        KvTransfer {
            values: (0..n as u16)
                .map(|v| v.wrapping_mul(7) + layers.start as u16 + 13 * positions.start as u16)
                .collect(),
            tokens,
            first_position: positions.start,
            prompt_tokens: 6,
            layers,
            n_kv_heads: heads,
            head_dim: dim,
        }
    }

    #[test]
    fn parts_arrive_in_any_order_and_are_taken_when_they_cover_every_layer_and_position() {
        let inbox = inbox();
        let address = inbox.address().to_string();
        let mut outbox = outbox(&[&address], RING_BYTES);
        // The first chunk of the prompt (every layer), then the rest layer range by layer
        // range, one part repeated (a recomputed chunk), and a hole until the last part.
        let parts = [
            part(0..5, 0..4),
            part(2..5, 4..6),
            part(0..5, 0..4),
            part(0..2, 4..6),
        ];
        for p in &parts[..3] {
            outbox.send(&address, 7, p.clone());
        }
        outbox.finish(7).expect("sent");
        let error = inbox
            .take(7, 5, Duration::from_millis(200))
            .expect_err("positions 4..6 of layers 0..2 are missing");
        assert!(
            error.to_string().contains("26 of 30 layer positions"),
            "{error}"
        );
        outbox.send(&address, 7, parts[3].clone());
        outbox.finish(7).expect("sent");
        let taken = inbox.take(7, 5, Duration::from_secs(5)).expect("complete");
        assert_eq!(taken, parts.to_vec());
        assert_eq!(
            (outbox.sent().bytes, outbox.sent().shm_bytes),
            (parts.iter().map(|p| p.kv_bytes() as u64).sum::<u64>(), 0),
            "an inbox not said to be on this host gets every bit over TCP"
        );
        // Taken once: a second take waits and fails.
        let error = inbox
            .take(7, 5, Duration::from_millis(100))
            .expect_err("already taken");
        assert!(error.to_string().contains("within"), "{error}");
    }

    /// Files of this process's rings left in the segment directory.
    fn rings_left() -> usize {
        let prefix = format!("{SEGMENT_PREFIX}-{}-", std::process::id());
        std::fs::read_dir(segment_directory())
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .count()
            })
            .unwrap_or(0)
    }

    #[test]
    fn a_decode_rank_on_this_host_gets_the_bits_through_a_shared_ring() {
        let inbox = inbox();
        let address = inbox.address().to_string();
        // An 8 KiB ring: parts of at most 2 KiB, and 96 KB of KV go round it many times,
        // so the sender waits for the inbox to free room.
        let mut outbox = outbox(&[&address], 8192);
        outbox.on_this_host(&address);
        let prompt = 300;
        let whole = |seed: u16| KvTransfer {
            tokens: (0..prompt as u32).collect(),
            first_position: 0,
            prompt_tokens: prompt,
            layers: 0..5,
            n_kv_heads: 2,
            head_dim: 4,
            values: (0..5 * 2 * 2 * prompt as u16 * 4)
                .map(|v| v.wrapping_mul(31).wrapping_add(seed))
                .collect(),
        };
        // Two transfers interleaved, then a small one that needs no split.
        outbox.send(&address, 1, whole(1));
        outbox.send(&address, 2, whole(2));
        outbox.send(&address, 3, part(0..5, 0..6));
        for id in 1..=3 {
            outbox.finish(id).expect("sent");
        }
        let sent = outbox.sent();
        let total = (2 * whole(0).kv_bytes() + part(0..5, 0..6).kv_bytes()) as u64;
        assert_eq!((sent.bytes, sent.shm_bytes), (total, total));
        // 2 KiB parts of 64 positions × one layer: 5 × 5 for each long transfer.
        assert_eq!(sent.parts, 2 * 25 + 1);
        for id in 1..=2 {
            let taken = inbox.take(id, 5, Duration::from_secs(5)).expect("complete");
            assert_eq!(taken, whole(id as u16).split(2048), "transfer {id}");
        }
        assert_eq!(
            inbox.take(3, 5, Duration::from_secs(5)).expect("complete"),
            vec![part(0..5, 0..6)]
        );
        assert_eq!(
            rings_left(),
            0,
            "the ring is unlinked once both ends map it"
        );
    }

    /// The inbox maps and unlinks the offered ring as soon as it reads its name, so the
    /// sender must have mapped it before offering it (a race that failed one connection in
    /// a few): every one of many fresh connections gets its ring.
    #[test]
    fn every_fresh_connection_on_this_host_gets_its_ring() {
        for attempt in 0..40 {
            let inbox = inbox();
            let address = inbox.address().to_string();
            let mut outbox = outbox(&[&address], 8192);
            outbox.on_this_host(&address);
            outbox.send(&address, 1, part(0..5, 0..6));
            outbox
                .finish(1)
                .unwrap_or_else(|e| panic!("attempt {attempt}: {e:#}"));
            let sent = outbox.sent();
            assert_eq!(sent.shm_bytes, sent.bytes, "attempt {attempt}");
            inbox.take(1, 5, Duration::from_secs(5)).expect("complete");
        }
        assert_eq!(rings_left(), 0);
    }

    #[test]
    fn a_send_to_an_inbox_that_is_gone_fails_its_transfer_only() {
        let inbox = inbox();
        let address = inbox.address().to_string();
        let gone = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("address").to_string()
        };
        let mut outbox = outbox(&[&gone, &address], RING_BYTES);
        outbox.send(&gone, 1, part(0..5, 0..6));
        outbox.send(&address, 2, part(0..5, 0..6));
        let error = outbox.finish(1).expect_err("nobody listens there");
        assert!(
            error.to_string().contains("cannot send KV transfer 1"),
            "{error}"
        );
        outbox.finish(2).expect("the other transfer went");
        inbox.take(2, 5, Duration::from_secs(5)).expect("complete");
    }

    #[test]
    fn another_run_or_another_hosts_claim_delivers_nothing() {
        let inbox = inbox();
        let address = inbox.address().to_string();
        // Another run's keys.
        let mut intruder = Outbox::new(&keys("guess", 0), 0).expect("outbox");
        intruder.add_inbox(&address, 1);
        intruder.send(&address, 1, part(0..1, 0..6));
        let _ = intruder.finish(1);
        assert!(inbox.take(1, 1, Duration::from_millis(300)).is_err());
        // Host 1's own keys claiming rank 0 (on host 0): its key for host 1 is P(1, 1), not
        // P(0, 1), so the inbox refuses it.
        let mut impostor = Outbox::new(&keys("secret", 1), 0).expect("outbox");
        impostor.add_inbox(&address, 1);
        impostor.send(&address, 2, part(0..1, 0..6));
        assert!(impostor.finish(2).is_err());
        assert!(inbox.take(2, 1, Duration::from_millis(300)).is_err());
        // Rank 2 proves its own host's key, but it is not a sender of this inbox.
        let mut other_rank = Outbox::new(&keys("secret", 1), 2).expect("outbox");
        other_rank.add_inbox(&address, 1);
        other_rank.send(&address, 4, part(0..1, 0..6));
        assert!(other_rank.finish(4).is_err());
        assert!(inbox.take(4, 1, Duration::from_millis(300)).is_err());
        // An address no rank was registered for gets nothing sent.
        let mut unknown = Outbox::new(&keys("secret", 0), 0).expect("outbox");
        // The write may succeed before the inbox closes the connection; nothing arrives.
        unknown.send(&address, 3, part(0..1, 0..6));
        let error = unknown.finish(3).expect_err("no rank there");
        assert!(
            format!("{error:#}").contains("no rank of this run"),
            "{error:#}"
        );
    }

    #[test]
    fn an_import_is_checked_against_the_requests_prompt() {
        let parts = [part(0..5, 0..4), part(0..5, 4..6)];
        let prompt: Vec<u32> = (0..6).map(|p| 100 + p).collect();
        check_prompt(&parts, &prompt).expect("this request's KV");
        let mut other = prompt.clone();
        other[5] = 7;
        let error = check_prompt(&parts, &other).expect_err("another prompt");
        assert!(format!("{error:#}").contains("positions 4..6"), "{error:#}");
        assert!(
            check_prompt(&parts, &prompt[..5]).is_err(),
            "a shorter prompt"
        );
    }
}

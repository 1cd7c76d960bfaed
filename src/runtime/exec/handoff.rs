//! KV hand-off between replicas, the transport of prefill/decode disaggregation: every rank
//! of a decode replica runs an [`Inbox`] (a TCP listener on its data-network address), and
//! the rank at the same (tp, pp) position of a prefill replica sends it a sequence's
//! [`KvTransfer`]s through an [`Outbox`] — shard to shard, so no rank ever holds another
//! rank's keys and values, and several transfers of one sequence (layer ranges, as a
//! prefill produces them) may arrive in any order.
//!
//! Wire format: a connection opens with the run token (`u32` LE length, bytes); then
//! frames of a transfer id (`u64` LE), a JSON header (`u32` LE length: tokens, prompt
//! length, layers, geometry) and the f16 bits (`u64` LE count of `u16` LE values) — binary,
//! since the bits are nearly all of the bytes. A connection that presents another token is
//! closed before anything of it is read.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::runtime::exec::executor::KvSent;
use crate::runtime::exec::kv::KvTransfer;

/// Transfers nobody claims within this long are dropped (a prefill whose first token ended
/// the request still sends its KV; the decode side never asks for it).
const STALE_AFTER: Duration = Duration::from_secs(120);
/// How long a send may take to connect, and to hand each write to the kernel, before it
/// fails (a decode host that went away or a link that drops everything): the prefill
/// replica fails that request and goes on.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest header accepted, bytes.
const MAX_HEADER_BYTES: usize = 64 << 20;
/// Largest token accepted, bytes.
const MAX_TOKEN_BYTES: usize = 4096;

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
    /// Listens on `host` (a free port), admitting connections that present `token`.
    ///
    /// Errors: the address cannot be bound.
    pub fn bind(host: &str, token: &str) -> Result<Inbox> {
        let listener = TcpListener::bind((host, 0))
            .with_context(|| format!("cannot listen for KV transfers on `{host}`"))?;
        let address = listener.local_addr()?;
        let state: Shared = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (accept_state, accept_stop, token) =
            (Arc::clone(&state), Arc::clone(&stop), token.to_string());
        std::thread::Builder::new()
            .name("kv-inbox".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if accept_stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let (state, token) = (Arc::clone(&accept_state), token.clone());
                    let _ = std::thread::Builder::new()
                        .name("kv-inbox-peer".into())
                        .spawn(move || {
                            // A peer that breaks the protocol or goes away only loses its
                            // connection; what it delivered stays.
                            let _ = receive(stream, &token, &state);
                        });
                }
            })
            .context("cannot start the KV inbox thread")?;
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
                let (_, parts) = state.arrived.remove(&id).expect("checked above");
                return Ok(parts);
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

/// Reads one peer's frames into the inbox until it closes. Errors: a wrong token, a
/// malformed frame, a lost connection.
fn receive(stream: TcpStream, token: &str, state: &Shared) -> Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let presented = read_bytes(&mut reader, MAX_TOKEN_BYTES)?;
    if presented != token.as_bytes() {
        bail!("a peer presented another run token");
    }
    loop {
        let mut id = [0u8; 8];
        if reader.read_exact(&mut id).is_err() {
            return Ok(());
        }
        let id = u64::from_le_bytes(id);
        let header: Header = serde_json::from_slice(&read_bytes(&mut reader, MAX_HEADER_BYTES)?)
            .context("a malformed KV transfer header")?;
        let mut count = [0u8; 8];
        reader.read_exact(&mut count)?;
        let count = u64::from_le_bytes(count) as usize;
        let expected =
            header.layers.len() * 2 * header.n_kv_heads * header.tokens.len() * header.head_dim;
        if count != expected {
            bail!("a KV transfer announces {count} values for a shape of {expected}");
        }
        let mut bytes = vec![0u8; count * 2];
        reader.read_exact(&mut bytes)?;
        let transfer = KvTransfer {
            tokens: header.tokens,
            first_position: header.first_position,
            prompt_tokens: header.prompt_tokens,
            layers: header.layers,
            n_kv_heads: header.n_kv_heads,
            head_dim: header.head_dim,
            values: bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        };
        let (lock, arrived) = &**state;
        let mut inbox = lock.lock().unwrap_or_else(|e| e.into_inner());
        inbox
            .arrived
            .retain(|_, (since, _)| since.elapsed() < STALE_AFTER);
        inbox
            .arrived
            .entry(id)
            .or_insert_with(|| (Instant::now(), Vec::new()))
            .1
            .push(transfer);
        arrived.notify_all();
    }
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
    id: u64,
    transfer: KvTransfer,
}

/// A prefill rank's sending end: a thread that sends the queued parts in order, over one
/// connection per decode rank (opened on first use and kept), while the rank computes the
/// rest of the prefill; counts what it sends. Dropping it lets the thread finish the queue.
pub struct Outbox {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    state: SendShared,
}

impl Outbox {
    /// An outbox presenting `token` to every inbox.
    ///
    /// Errors: the sending thread cannot start.
    pub fn new(token: &str) -> Result<Outbox> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let state: SendShared = Arc::default();
        let (shared, token) = (Arc::clone(&state), token.to_string());
        std::thread::Builder::new()
            .name("kv-outbox".into())
            .spawn(move || {
                let mut peers: HashMap<String, BufWriter<TcpStream>> = HashMap::new();
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
                        Ok(())
                    } else {
                        send_part(&mut peers, &token, &job)
                    };
                    if result.is_err() {
                        peers.remove(&job.address);
                    }
                    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
                    match result {
                        Ok(()) if !skip => {
                            state.sent.bytes += job.transfer.kv_bytes() as u64;
                            state.sent.parts += 1;
                            state.sent.secs += started.elapsed().as_secs_f64();
                        }
                        Ok(()) => {}
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
        })
    }

    /// Queues `transfer` as part of transfer `id` for the inbox at `address`; it is sent
    /// while the caller goes on. [`Outbox::finish`] says whether every part went.
    pub fn send(&mut self, address: &str, id: u64, transfer: KvTransfer) {
        let (lock, _) = &*self.state;
        *lock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .entry(id)
            .or_default() += 1;
        let job = Job {
            address: address.to_string(),
            id,
            transfer,
        };
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
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

/// Sends one part over `peers`' connection to its inbox, opening it first if needed.
fn send_part(
    peers: &mut HashMap<String, BufWriter<TcpStream>>,
    token: &str,
    job: &Job,
) -> Result<()> {
    let (address, transfer) = (&job.address, &job.transfer);
    if !peers.contains_key(address) {
        let peer: SocketAddr = address
            .parse()
            .with_context(|| format!("`{address}` is not an inbox address"))?;
        let stream = TcpStream::connect_timeout(&peer, SEND_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(SEND_TIMEOUT))?;
        let mut writer = BufWriter::with_capacity(1 << 20, stream);
        writer.write_all(&(token.len() as u32).to_le_bytes())?;
        writer.write_all(token.as_bytes())?;
        peers.insert(address.to_string(), writer);
    }
    let writer = peers.get_mut(address).expect("inserted above");
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
    writer.write_all(&(transfer.values.len() as u64).to_le_bytes())?;
    let bytes: Vec<u8> = transfer
        .values
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    writer.write_all(&bytes)?;
    writer.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let inbox = Inbox::bind("127.0.0.1", "secret").expect("bind");
        let address = inbox.address().to_string();
        let mut outbox = Outbox::new("secret").expect("outbox");
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
            outbox.sent().bytes,
            parts.iter().map(|p| p.kv_bytes() as u64).sum::<u64>()
        );
        // Taken once: a second take waits and fails.
        let error = inbox
            .take(7, 5, Duration::from_millis(100))
            .expect_err("already taken");
        assert!(error.to_string().contains("within"), "{error}");
    }

    #[test]
    fn a_send_to_an_inbox_that_is_gone_fails_its_transfer_only() {
        let inbox = Inbox::bind("127.0.0.1", "secret").expect("bind");
        let address = inbox.address().to_string();
        let gone = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("address").to_string()
        };
        let mut outbox = Outbox::new("secret").expect("outbox");
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
    fn another_run_token_delivers_nothing() {
        let inbox = Inbox::bind("127.0.0.1", "secret").expect("bind");
        let mut intruder = Outbox::new("guess").expect("outbox");
        // The write may succeed before the inbox closes the connection; nothing arrives.
        intruder.send(&inbox.address().to_string(), 1, part(0..1, 0..6));
        let _ = intruder.finish(1);
        assert!(inbox.take(1, 1, Duration::from_millis(300)).is_err());
    }
}

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

    /// Waits up to `timeout` until the parts of transfer `id` cover layers `0..n_layers`,
    /// and takes them (sorted by first layer).
    ///
    /// Errors: the parts do not arrive in time (the prefill rank or its link failed).
    pub fn take(&self, id: u64, n_layers: usize, timeout: Duration) -> Result<Vec<KvTransfer>> {
        let (lock, arrived) = &*self.state;
        let deadline = Instant::now() + timeout;
        let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let complete = state.arrived.get(&id).is_some_and(|(_, parts)| {
                parts.iter().map(|p| p.layers.len()).sum::<usize>() >= n_layers
            });
            if complete {
                let (_, mut parts) = state.arrived.remove(&id).expect("checked above");
                parts.sort_by_key(|p| p.layers.start);
                return Ok(parts);
            }
            let now = Instant::now();
            if now >= deadline {
                let layers: usize = state
                    .arrived
                    .get(&id)
                    .map_or(0, |(_, parts)| parts.iter().map(|p| p.layers.len()).sum());
                bail!(
                    "KV transfer {id}: {layers} of {n_layers} layers arrived within {:.0} s (the prefill replica or the link to it failed)",
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

/// A prefill rank's sending end: one connection per decode rank it has sent to, opened on
/// first use and kept; counts what it sends.
pub struct Outbox {
    token: String,
    peers: HashMap<String, BufWriter<TcpStream>>,
    /// Bytes of keys and values sent so far.
    pub kv_bytes_sent: u64,
    /// Seconds spent sending them.
    pub send_secs: f64,
}

impl Outbox {
    /// An outbox presenting `token` to every inbox.
    pub fn new(token: &str) -> Outbox {
        Outbox {
            token: token.to_string(),
            peers: HashMap::new(),
            kv_bytes_sent: 0,
            send_secs: 0.0,
        }
    }

    /// Sends `transfer` as (part of) transfer `id` to the inbox at `address`.
    ///
    /// Errors: the inbox cannot be reached or the connection breaks (the connection is
    /// dropped; the next send reconnects).
    pub fn send(&mut self, address: &str, id: u64, transfer: &KvTransfer) -> Result<()> {
        let started = Instant::now();
        let result = self.try_send(address, id, transfer);
        if result.is_err() {
            self.peers.remove(address);
        } else {
            self.kv_bytes_sent += transfer.kv_bytes() as u64;
            self.send_secs += started.elapsed().as_secs_f64();
        }
        result.with_context(|| format!("cannot send KV transfer {id} to {address}"))
    }

    fn try_send(&mut self, address: &str, id: u64, transfer: &KvTransfer) -> Result<()> {
        if !self.peers.contains_key(address) {
            let peer: SocketAddr = address
                .parse()
                .with_context(|| format!("`{address}` is not an inbox address"))?;
            let stream = TcpStream::connect_timeout(&peer, SEND_TIMEOUT)?;
            stream.set_nodelay(true)?;
            stream.set_write_timeout(Some(SEND_TIMEOUT))?;
            let mut writer = BufWriter::with_capacity(1 << 20, stream);
            writer.write_all(&(self.token.len() as u32).to_le_bytes())?;
            writer.write_all(self.token.as_bytes())?;
            self.peers.insert(address.to_string(), writer);
        }
        let writer = self.peers.get_mut(address).expect("inserted above");
        let header = serde_json::to_vec(&Header {
            tokens: transfer.tokens.clone(),
            prompt_tokens: transfer.prompt_tokens,
            layers: transfer.layers.clone(),
            n_kv_heads: transfer.n_kv_heads,
            head_dim: transfer.head_dim,
        })?;
        writer.write_all(&id.to_le_bytes())?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(layers: std::ops::Range<usize>) -> KvTransfer {
        let (tokens, heads, dim) = (vec![1, 2, 3], 2, 4);
        let n = layers.len() * 2 * heads * tokens.len() * dim;
        KvTransfer {
            values: (0..n as u16)
                .map(|v| v.wrapping_mul(7) + layers.start as u16)
                .collect(),
            tokens,
            prompt_tokens: 3,
            layers,
            n_kv_heads: heads,
            head_dim: dim,
        }
    }

    #[test]
    fn layer_ranges_arrive_in_any_order_and_are_taken_whole() {
        let inbox = Inbox::bind("127.0.0.1", "secret").expect("bind");
        let address = inbox.address().to_string();
        let mut outbox = Outbox::new("secret");
        let (second, first) = (part(2..5), part(0..2));
        outbox.send(&address, 7, &second).expect("send");
        outbox.send(&address, 7, &first).expect("send");
        let parts = inbox.take(7, 5, Duration::from_secs(5)).expect("complete");
        assert_eq!(parts, vec![first.clone(), second.clone()]);
        assert_eq!(
            outbox.kv_bytes_sent,
            (first.kv_bytes() + second.kv_bytes()) as u64
        );
        // Taken once: a second take waits and fails, naming what is missing.
        let error = inbox
            .take(7, 5, Duration::from_millis(100))
            .expect_err("already taken");
        assert!(error.to_string().contains("0 of 5 layers"), "{error}");
    }

    #[test]
    fn another_run_token_delivers_nothing() {
        let inbox = Inbox::bind("127.0.0.1", "secret").expect("bind");
        let mut intruder = Outbox::new("guess");
        // The write may succeed before the inbox closes the connection; nothing arrives.
        let _ = intruder.send(&inbox.address().to_string(), 1, &part(0..1));
        assert!(inbox.take(1, 1, Duration::from_millis(300)).is_err());
    }
}

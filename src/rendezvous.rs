//! The rendezvous store: a TCP key-value store (set, blocking get with timeout, add,
//! barrier) like torch's `TCPStore`, served by the launching process at
//! `MASTER_ADDR:MASTER_PORT` and protected by a random per-run token. Ranks register, publish
//! their collective endpoints, wait for peers and send heartbeats; the server knows when
//! each rank last beat.
//!
//! Wire format: each message is a little-endian `u32` length and a JSON body.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// Largest message accepted, bytes (guards against garbage on the port).
const MAX_MESSAGE_BYTES: u32 = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    Heartbeat {
        rank: u64,
    },
    /// Milliseconds since each rank's last heartbeat (for a launcher whose store runs on
    /// another host).
    HeartbeatAges,
}

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Ok,
    Value(Vec<u8>),
    Count(i64),
    Ages(Vec<(u64, u64)>),
    Error(String),
}

fn write_message<T: Serialize>(stream: &mut TcpStream, message: &T) -> Result<()> {
    let body = serde_json::to_vec(message)?;
    let length = u32::try_from(body.len()).context("message too large")?;
    stream.write_all(&length.to_le_bytes())?;
    stream.write_all(&body)?;
    Ok(())
}

fn read_message<T: for<'de> Deserialize<'de>>(stream: &mut TcpStream) -> Result<T> {
    let mut length = [0u8; 4];
    stream.read_exact(&mut length)?;
    let length = u32::from_le_bytes(length);
    if length > MAX_MESSAGE_BYTES {
        bail!("message of {length} bytes exceeds the limit");
    }
    let mut body = vec![0u8; length as usize];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body).context("malformed store message")
}

/// The longest a `get` waits, ms (a day): a longer timeout is this one.
const MAX_WAIT_MS: u64 = 24 * 3600 * 1000;
/// The longest key, bytes.
const MAX_KEY_BYTES: usize = 4096;
/// All keys and values together, bytes: what a run's ranks publish is kilobytes each.
const MAX_STORE_BYTES: usize = 1 << 30;

#[derive(Default)]
struct State {
    /// Bytes of every key and value stored.
    bytes: usize,
    values: HashMap<String, Vec<u8>>,
    heartbeats: HashMap<u64, Instant>,
}

impl State {
    /// Stores `value` under `key` within the store's limits.
    ///
    /// Errors: a key over [`MAX_KEY_BYTES`], or the store would pass [`MAX_STORE_BYTES`].
    fn put(&mut self, key: String, value: Vec<u8>) -> std::result::Result<(), String> {
        if key.len() > MAX_KEY_BYTES {
            return Err(format!(
                "a key of {} bytes (at most {MAX_KEY_BYTES})",
                key.len()
            ));
        }
        let old = self.values.get(&key).map_or(0, |v| key.len() + v.len());
        let bytes = self.bytes - old + key.len() + value.len();
        if bytes > MAX_STORE_BYTES {
            return Err(format!(
                "the store is full: {bytes} bytes would pass its {MAX_STORE_BYTES}-byte limit"
            ));
        }
        self.bytes = bytes;
        self.values.insert(key, value);
        Ok(())
    }
}

/// The server side, run by the launcher. Dropping it stops accepting connections.
pub struct StoreServer {
    address: SocketAddr,
    state: Arc<(Mutex<State>, Condvar)>,
    stopping: Arc<AtomicBool>,
}

impl StoreServer {
    /// Listens on `bind` (`127.0.0.1:0` picks a free port) and serves clients that present
    /// `token`. Errors: the address cannot be bound (with the reason, e.g. in use).
    pub fn start(bind: &str, token: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(bind)
            .with_context(|| format!("the rendezvous store cannot listen on `{bind}`"))?;
        let address = listener.local_addr()?;
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let stopping = Arc::new(AtomicBool::new(false));
        let (accept_state, accept_stopping, token) =
            (Arc::clone(&state), Arc::clone(&stopping), token.to_string());
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if accept_stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                        pending.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    let (state, token, stopping, counter) = (
                        Arc::clone(&accept_state),
                        token.clone(),
                        Arc::clone(&accept_stopping),
                        Arc::clone(&pending),
                    );
                    let spawned = std::thread::Builder::new()
                        .name("store-client".into())
                        .spawn(move || serve(stream, &state, &token, &stopping, &counter));
                    if spawned.is_err() {
                        // The thread never ran: its handshake is not pending.
                        pending.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })?;
        Ok(StoreServer {
            address,
            state,
            stopping,
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Seconds since each rank's last heartbeat.
    pub fn heartbeat_ages(&self) -> HashMap<u64, Duration> {
        let state = self.state.0.lock().expect("store state lock");
        state
            .heartbeats
            .iter()
            .map(|(rank, at)| (*rank, at.elapsed()))
            .collect()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.address, Duration::from_millis(200));
        self.state.1.notify_all();
    }
}

/// The store's channel in the handshake ([`crate::handshake`]); the store is identity 0.
const CHANNEL: &str = "store";

/// Connections the store runs its handshake on at once; more are closed at once, so idle
/// strangers cannot pile up threads (each is dropped after [`crate::handshake::HELLO_TIMEOUT`]).
const MAX_PENDING_HANDSHAKES: usize = 128;

fn serve(
    mut stream: TcpStream,
    state: &(Mutex<State>, Condvar),
    token: &str,
    stopping: &AtomicBool,
    pending: &std::sync::atomic::AtomicUsize,
) {
    let _ = stream.set_nodelay(true);
    // Nothing is read into a buffer of the peer's choosing before it proves the run's secret.
    let proved = crate::handshake::server(&mut stream, token, CHANNEL, 0, &|_| true);
    pending.fetch_sub(1, Ordering::SeqCst);
    if proved.is_err() {
        return;
    }
    while let Ok(request) = read_message::<Request>(&mut stream) {
        let response = match request {
            Request::Set { key, value } => {
                let mut guard = state.0.lock().expect("store state lock");
                let stored = guard.put(key, value);
                state.1.notify_all();
                match stored {
                    Ok(()) => Response::Ok,
                    Err(why) => Response::Error(why),
                }
            }
            Request::Add { key, delta } => {
                let mut guard = state.0.lock().expect("store state lock");
                let current = guard
                    .values
                    .get(&key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let next = current.saturating_add(delta);
                let stored = guard.put(key, next.to_string().into_bytes());
                state.1.notify_all();
                match stored {
                    Ok(()) => Response::Count(next),
                    Err(why) => Response::Error(why),
                }
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(MAX_WAIT_MS));
                let mut guard = state.0.lock().expect("store state lock");
                loop {
                    if let Some(value) = guard.values.get(&key) {
                        break Response::Value(value.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline || stopping.load(Ordering::SeqCst) {
                        break Response::Error(format!(
                            "timed out after {timeout_ms} ms waiting for key `{key}`"
                        ));
                    }
                    guard = state
                        .1
                        .wait_timeout(guard, deadline - now)
                        .expect("store state lock")
                        .0;
                }
            }
            Request::Heartbeat { rank } => {
                state
                    .0
                    .lock()
                    .expect("store state lock")
                    .heartbeats
                    .insert(rank, Instant::now());
                Response::Ok
            }
            Request::HeartbeatAges => {
                let guard = state.0.lock().expect("store state lock");
                Response::Ages(
                    guard
                        .heartbeats
                        .iter()
                        .map(|(rank, at)| (*rank, at.elapsed().as_millis() as u64))
                        .collect(),
                )
            }
        };
        if write_message(&mut stream, &response).is_err() {
            break;
        }
    }
}

/// A connection to the store, used by ranks (and the launcher).
pub struct StoreClient {
    stream: TcpStream,
    address: SocketAddr,
    token: String,
    rank: Option<u64>,
}

impl StoreClient {
    /// Connects and authenticates, retrying until `timeout` while the server is not up yet.
    /// Errors: the server never answered, or refused the token.
    pub fn connect(
        address: &str,
        token: &str,
        rank: Option<u64>,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let address: SocketAddr = address
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve the rendezvous address `{address}`"))?
            .next()
            .with_context(|| format!("`{address}` resolves to no address"))?;
        // Retried until `timeout`: the store may not be up yet, or busy with strangers.
        let stream = crate::handshake::connect(
            address,
            token,
            crate::handshake::Claim {
                channel: CHANNEL,
                client: rank.unwrap_or(crate::handshake::LAUNCHER),
                server: 0,
            },
            timeout,
        )
        .with_context(|| {
            format!(
                "cannot join the rendezvous store at {address} within {timeout:?} (not up, or it refused this run's token)"
            )
        })?;
        stream.set_nodelay(true)?;
        Ok(StoreClient {
            stream,
            address,
            token: token.to_string(),
            rank,
        })
    }

    /// The run's secret this client proved (the collectives and links key their handshakes
    /// with it).
    pub(crate) fn secret(&self) -> &str {
        &self.token
    }

    fn request(&mut self, request: &Request) -> Result<Response> {
        write_message(&mut self.stream, request)
            .with_context(|| format!("lost the rendezvous store at {}", self.address))?;
        read_message(&mut self.stream)
            .with_context(|| format!("lost the rendezvous store at {}", self.address))
    }

    /// Stores `value` under `key`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        match self.request(&Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        })? {
            Response::Ok => Ok(()),
            Response::Error(message) => bail!("rendezvous: {message}"),
            other => bail!("store set `{key}` failed: {other:?}"),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it to be set. Errors name the key.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.request(&Request::Get {
            key: key.to_string(),
            timeout_ms: timeout.as_millis() as u64,
        })? {
            Response::Value(value) => Ok(value),
            Response::Error(message) => bail!("rendezvous: {message}"),
            other => bail!("store get `{key}` failed: {other:?}"),
        }
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        match self.request(&Request::Add {
            key: key.to_string(),
            delta,
        })? {
            Response::Count(value) => Ok(value),
            other => bail!("store add `{key}` failed: {other:?}"),
        }
    }

    /// Time since each rank's last heartbeat, as [`StoreServer::heartbeat_ages`] sees it,
    /// for a launcher whose store runs on another host. Errors: the store is lost.
    pub fn heartbeat_ages(&mut self) -> Result<HashMap<u64, Duration>> {
        match self.request(&Request::HeartbeatAges)? {
            Response::Ages(ages) => Ok(ages
                .into_iter()
                .map(|(rank, ms)| (rank, Duration::from_millis(ms)))
                .collect()),
            other => bail!("store heartbeat ages failed: {other:?}"),
        }
    }

    /// Blocks until `world` processes have entered barrier `name`. Errors: timeout, naming
    /// how many arrived.
    pub fn barrier(&mut self, name: &str, world: u64, timeout: Duration) -> Result<()> {
        let arrived = self.add(&format!("barrier/{name}/count"), 1)?;
        if arrived as u64 == world {
            self.set(&format!("barrier/{name}/done"), b"1")?;
        }
        self.get(&format!("barrier/{name}/done"), timeout)
            .map(|_| ())
            .map_err(|error| {
                let count = self.add(&format!("barrier/{name}/count"), 0).unwrap_or(-1);
                error.context(format!(
                    "barrier `{name}`: {count} of {world} processes arrived"
                ))
            })
    }

    /// Starts a thread that beats for this rank every `interval` on its own connection,
    /// until the returned guard is dropped.
    pub fn start_heartbeat(&self, interval: Duration) -> Result<HeartbeatGuard> {
        let rank = self.rank.context("only a rank can send heartbeats")?;
        let mut client = StoreClient::connect(
            &self.address.to_string(),
            &self.token,
            Some(rank),
            Duration::from_secs(10),
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                while !thread_stop.load(Ordering::SeqCst) {
                    if client.request(&Request::Heartbeat { rank }).is_err() {
                        break;
                    }
                    std::thread::sleep(interval);
                }
            })?;
        Ok(HeartbeatGuard { stop })
    }
}

/// Stops a heartbeat thread when dropped.
pub struct HeartbeatGuard {
    stop: Arc<AtomicBool>,
}

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A random per-run token (128 bits, hex).
pub fn random_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_barrier_and_heartbeats() {
        let token = random_token();
        let server = StoreServer::start("127.0.0.1:0", &token).expect("server");
        let address = server.address().to_string();
        let handles: Vec<_> = (0..4u64)
            .map(|rank| {
                let (address, token) = (address.clone(), token.clone());
                std::thread::spawn(move || {
                    let mut client =
                        StoreClient::connect(&address, &token, Some(rank), Duration::from_secs(5))
                            .expect("connect");
                    let _heartbeat = client
                        .start_heartbeat(Duration::from_millis(20))
                        .expect("heartbeat");
                    client
                        .set(&format!("addr/{rank}"), format!("host:{rank}").as_bytes())
                        .expect("set");
                    client
                        .barrier("ready", 4, Duration::from_secs(5))
                        .expect("barrier");
                    let peer = (rank + 1) % 4;
                    let value = client
                        .get(&format!("addr/{peer}"), Duration::from_secs(1))
                        .expect("get");
                    assert_eq!(value, format!("host:{peer}").as_bytes());
                    client.add("counter", 5).expect("add");
                    std::thread::sleep(Duration::from_millis(60));
                })
            })
            .collect();
        for handle in handles {
            handle.join().expect("rank thread");
        }
        let mut client =
            StoreClient::connect(&address, &token, None, Duration::from_secs(5)).expect("connect");
        assert_eq!(client.add("counter", 0).expect("add"), 20);
        assert_eq!(server.heartbeat_ages().len(), 4);
        let remote = client.heartbeat_ages().expect("ages over the wire");
        assert_eq!(remote.len(), 4);
        assert!(remote.values().all(|age| *age < Duration::from_secs(5)));
    }

    /// Threads of this process now.
    fn threads() -> usize {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Threads:"))
                    .and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// 200 idle strangers and four that announce 2 GiB messages: the store runs at most
    /// [`MAX_PENDING_HANDSHAKES`] threads for them, reads nothing they announce, and a
    /// member of the run still gets in and is served at once.
    #[test]
    fn strangers_get_bounded_threads_no_buffers_and_hold_no_member_up() {
        let token = random_token();
        let server = StoreServer::start("127.0.0.1:0", &token).expect("server");
        let address = server.address();
        let before = threads();
        let mut strangers: Vec<TcpStream> = (0..200)
            .map(|_| TcpStream::connect(address).expect("connect"))
            .collect();
        for _ in 0..4 {
            let mut stream = TcpStream::connect(address).expect("connect");
            stream.write_all(&u32::MAX.to_le_bytes()).expect("length");
            strangers.push(stream);
        }
        std::thread::sleep(Duration::from_millis(300));
        let during = threads();
        assert!(
            during <= before + MAX_PENDING_HANDSHAKES + 2,
            "{before} threads before, {during} with 204 strangers"
        );
        let started = Instant::now();
        let mut client = StoreClient::connect(
            &address.to_string(),
            &token,
            Some(0),
            Duration::from_secs(10),
        )
        .expect("a member gets in");
        client.set("key", b"value").expect("set");
        assert_eq!(
            client.get("key", Duration::from_secs(1)).expect("get"),
            b"value"
        );
        drop(strangers);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// Input a member sends is bounded too: a key too long, counters at the edge and a
    /// timeout of "forever" get answers, and the store keeps serving.
    #[test]
    fn oversized_keys_overflowing_counters_and_endless_timeouts_are_answered() {
        let token = random_token();
        let server = StoreServer::start("127.0.0.1:0", &token).expect("server");
        let mut client = StoreClient::connect(
            &server.address().to_string(),
            &token,
            Some(0),
            Duration::from_secs(5),
        )
        .expect("connect");
        let error = client
            .set(&"k".repeat(MAX_KEY_BYTES + 1), b"v")
            .expect_err("too long");
        assert!(
            format!("{error:#}").contains("a key of 4097 bytes"),
            "{error:#}"
        );
        assert_eq!(client.add("c", i64::MAX).expect("add"), i64::MAX);
        assert_eq!(client.add("c", 1).expect("add"), i64::MAX);
        client.set("k", b"v").expect("set");
        assert_eq!(client.get("k", Duration::MAX).expect("get"), b"v");
    }

    #[test]
    fn wrong_token_is_refused_and_gets_time_out() {
        let server = StoreServer::start("127.0.0.1:0", "right").expect("server");
        let address = server.address().to_string();
        let error = StoreClient::connect(&address, "wrong", Some(0), Duration::from_secs(2))
            .err()
            .expect("refused");
        assert!(
            format!("{error:#}").contains("refused") || format!("{error:#}").contains("closed"),
            "{error:#}"
        );
        let mut client = StoreClient::connect(&address, "right", Some(0), Duration::from_secs(2))
            .expect("connect");
        let error = client
            .get("never", Duration::from_millis(100))
            .expect_err("timeout");
        assert!(
            error.to_string().contains("timed out") && error.to_string().contains("`never`"),
            "{error}"
        );
        let error = client
            .barrier("alone", 2, Duration::from_millis(100))
            .expect_err("timeout");
        assert!(
            format!("{error:#}").contains("1 of 2 processes arrived"),
            "{error:#}"
        );
    }
}

//! The rendezvous store: a TCP key-value store (set, blocking get with timeout, add,
//! barrier) like torch's `TCPStore`, served by the launching process at
//! `MASTER_ADDR:MASTER_PORT`. Ranks register, publish their collective endpoints, wait for
//! peers and send heartbeats; the server knows when each rank last beat.
//!
//! Each connection opens with [`crate::handshake`] keyed by the store key of the client's
//! host ([`crate::keyring`]), so the store knows which member speaks, and may write only
//! what that member owns ([`may_write`]): a rank its own `rank/{rank}/…` keys and the
//! barriers' counters, an agent its `agents/…` keys, the launcher anything; a rank beats only
//! for itself. Anyone of the run reads any key.
//!
//! Wire format: each message is a little-endian `u32` length, a JSON body and the body's
//! 32-byte MAC under the connection's session ([`crate::handshake::Sealer`]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::handshake::{Opener, Sealer, TAG_BYTES};
use crate::keyring::{Keyring, LAUNCHER_HOST};

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

fn write_message<T: Serialize>(
    stream: &mut TcpStream,
    sealer: &mut Sealer,
    message: &T,
) -> Result<()> {
    let body = serde_json::to_vec(message)?;
    let length = u32::try_from(body.len()).context("message too large")?;
    let tag = sealer.seal(&body);
    let mut frame = Vec::with_capacity(4 + body.len() + TAG_BYTES);
    frame.extend_from_slice(&length.to_le_bytes());
    frame.extend_from_slice(&body);
    frame.extend_from_slice(&tag);
    stream.write_all(&frame)?;
    Ok(())
}

fn read_message<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
    opener: &mut Opener,
) -> Result<T> {
    let mut length = [0u8; 4];
    stream.read_exact(&mut length)?;
    let length = u32::from_le_bytes(length);
    if length > MAX_MESSAGE_BYTES {
        bail!("message of {length} bytes exceeds the limit");
    }
    let mut body = vec![0u8; length as usize + TAG_BYTES];
    stream.read_exact(&mut body)?;
    let (body, tag) = body.split_at(length as usize);
    opener.open(body, tag)?;
    serde_json::from_slice(body).context("malformed store message")
}

/// Who is on the other end of a store connection, from the identity it proved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Member {
    Launcher,
    /// The agent of a host (it watches the store).
    Agent(u32),
    Rank(u64),
}

/// The handshake identity of host `host`'s agent (below the launcher's, above any rank).
pub(crate) fn agent_identity(host: u32) -> u64 {
    crate::handshake::LAUNCHER - 1 - u64::from(host)
}

impl Member {
    fn of(identity: u64, world_size: usize) -> Option<Member> {
        if identity == crate::handshake::LAUNCHER {
            Some(Member::Launcher)
        } else if identity < world_size as u64 {
            Some(Member::Rank(identity))
        } else {
            u32::try_from(crate::handshake::LAUNCHER - 1 - identity)
                .ok()
                .map(Member::Agent)
        }
    }
}

/// Whether `member` may set or add to `key`: the launcher anything; a rank its own
/// `rank/{rank}/…` keys and the barriers' counters (`barrier/…`); an agent its own
/// `agents/{host}/…` keys.
fn may_write(member: Member, key: &str) -> bool {
    match member {
        Member::Launcher => true,
        Member::Rank(rank) => {
            key.starts_with("barrier/")
                || key
                    .strip_prefix("rank/")
                    .and_then(|rest| rest.strip_prefix(&rank.to_string()))
                    .is_some_and(|rest| rest.starts_with('/'))
        }
        Member::Agent(host) => key
            .strip_prefix("agents/")
            .and_then(|rest| rest.strip_prefix(&host.to_string()))
            .is_some_and(|rest| rest.starts_with('/')),
    }
}

/// Where rank 0 publishes a job's result (a generation, a benchmark's report).
pub const RESULT_KEY: &str = "rank/0/result";
/// Where a serving rank 0 publishes its HTTP address once it serves.
pub const READY_KEY: &str = "rank/0/ready";

/// The key under which `rank` publishes `what` (e.g. `rank/3/comm/dp0/tp`): only that rank
/// may write it.
pub fn rank_key(rank: u64, what: &str) -> String {
    format!("rank/{rank}/{what}")
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
    /// Every client connection still open, by a number of its own: a stopped store closes
    /// them, so that no client goes on talking to a store that is gone.
    connections: Connections,
}

/// The store's open client connections (see [`StoreServer`]).
type Connections = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl StoreServer {
    /// Listens on `bind` (`127.0.0.1:0` picks a free port) and serves the members of the
    /// run whose store keys `keys` holds (the run's secret, or [`Keyring::for_store`]'s).
    /// Errors: the address cannot be bound (with the reason, e.g. in use).
    pub fn start(bind: &str, keys: &Keyring) -> Result<StoreServer> {
        let listener = TcpListener::bind(bind)
            .with_context(|| format!("the rendezvous store cannot listen on `{bind}`"))?;
        let address = listener.local_addr()?;
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let stopping = Arc::new(AtomicBool::new(false));
        let (accept_state, accept_stopping, keys) = (
            Arc::clone(&state),
            Arc::clone(&stopping),
            Arc::new(keys.clone()),
        );
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let connections: Connections = Arc::default();
        let open = Arc::clone(&connections);
        std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || {
                for (number, stream) in (0u64..).zip(listener.incoming()) {
                    if accept_stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                        pending.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    if let Ok(clone) = stream.try_clone() {
                        open.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(number, clone);
                    }
                    let (state, keys, stopping, counter, open) = (
                        Arc::clone(&accept_state),
                        Arc::clone(&keys),
                        Arc::clone(&accept_stopping),
                        Arc::clone(&pending),
                        Arc::clone(&open),
                    );
                    let spawned = std::thread::Builder::new()
                        .name("store-client".into())
                        .spawn(move || {
                            serve(stream, &state, &keys, &stopping, &counter);
                            open.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&number);
                        });
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
            connections,
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
        for stream in self
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
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
    keys: &Keyring,
    stopping: &AtomicBool,
    pending: &std::sync::atomic::AtomicUsize,
) {
    let _ = stream.set_nodelay(true);
    // Nothing is read into a buffer of the peer's choosing before it proves its host's key.
    let key_for = |identity: u64| match Member::of(identity, keys.world_size())? {
        Member::Launcher => keys.store_key_of(LAUNCHER_HOST),
        Member::Agent(host) => keys.store_key_of(host),
        Member::Rank(rank) => keys.store_key_of(keys.host_of_rank(rank)?),
    };
    let proved = crate::handshake::server(&mut stream, CHANNEL, 0, &key_for);
    pending.fetch_sub(1, Ordering::SeqCst);
    let Ok((identity, session)) = proved else {
        return;
    };
    let Some(member) = Member::of(identity, keys.world_size()) else {
        return;
    };
    let (mut sealer, mut opener) = session.split();
    while let Ok(request) = read_message::<Request>(&mut stream, &mut opener) {
        let refused = match &request {
            Request::Set { key, .. } | Request::Add { key, .. } if !may_write(member, key) => {
                Some(format!(
                    "{member:?} may not write `{}` (a rank writes only its own `rank/<rank>/…` keys)",
                    key.chars().take(80).collect::<String>()
                ))
            }
            Request::Heartbeat { rank }
                if member != Member::Launcher && member != Member::Rank(*rank) =>
            {
                Some(format!("{member:?} may not beat for rank {rank}"))
            }
            _ => None,
        };
        if let Some(why) = refused {
            if write_message(&mut stream, &mut sealer, &Response::Error(why)).is_err() {
                break;
            }
            continue;
        }
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
        if write_message(&mut stream, &mut sealer, &response).is_err() {
            break;
        }
    }
}

/// A connection to the store, used by ranks, agents and the launcher.
pub struct StoreClient {
    stream: TcpStream,
    sealer: Sealer,
    opener: Opener,
    address: SocketAddr,
    keys: Keyring,
    rank: Option<u64>,
}

impl StoreClient {
    /// Connects as `rank` (`None`: the launcher, or the agent of `keys`' host) with the
    /// store key of `keys`' host, retrying until `timeout` while the server is not up yet.
    /// Errors: the server never answered, or refused the key; `keys` holds no store key.
    pub fn connect(
        address: &str,
        keys: &Keyring,
        rank: Option<u64>,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let address: SocketAddr = address
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve the rendezvous address `{address}`"))?
            .next()
            .with_context(|| format!("`{address}` resolves to no address"))?;
        let key = keys
            .store_key()
            .context("these run keys hold no store key (a store's own keys)")?;
        let identity = match rank {
            Some(rank) => rank,
            None if keys.host() == LAUNCHER_HOST => crate::handshake::LAUNCHER,
            None => agent_identity(keys.host()),
        };
        // Retried until `timeout`: the store may not be up yet, or busy with strangers.
        // The store may be reached over the management network: routing picks the source.
        let (stream, session) = crate::handshake::connect(
            address,
            None,
            &key,
            crate::handshake::Claim {
                channel: CHANNEL,
                client: identity,
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
        let (sealer, opener) = session.split();
        Ok(StoreClient {
            stream,
            sealer,
            opener,
            address,
            keys: keys.clone(),
            rank,
        })
    }

    /// The keys this client proved its host with (the collectives and links key their
    /// handshakes with them).
    pub(crate) fn keys(&self) -> &Keyring {
        &self.keys
    }

    fn request(&mut self, request: &Request) -> Result<Response> {
        write_message(&mut self.stream, &mut self.sealer, request)
            .with_context(|| format!("lost the rendezvous store at {}", self.address))?;
        read_message(&mut self.stream, &mut self.opener)
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
            Response::Error(message) => bail!("rendezvous: {message}"),
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
            &self.keys,
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

    /// Held by every test here: the thread count of one is not disturbed by another's.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A run of four ranks on hosts 0, 0, 1, 1, as its launcher holds it.
    fn run() -> Keyring {
        Keyring::master(&random_token(), LAUNCHER_HOST, vec![0, 0, 1, 1])
    }

    /// A store of a [`run`], and rank 0 connected to it.
    fn store_and_rank_0() -> (StoreServer, StoreClient, Keyring) {
        let run = run();
        let server = StoreServer::start("127.0.0.1:0", &run).expect("server");
        let client = StoreClient::connect(
            &server.address().to_string(),
            &rank_keys(&run, 0),
            Some(0),
            Duration::from_secs(5),
        )
        .expect("connect");
        (server, client, run)
    }

    /// What rank `rank`'s process holds: its host's keys.
    fn rank_keys(run: &Keyring, rank: u64) -> Keyring {
        run.for_host(run.host_of_rank(rank).expect("rank"))
            .expect("host keys")
    }

    #[test]
    fn set_get_add_barrier_and_heartbeats() {
        let _serial = serial();
        let run = run();
        let server = StoreServer::start("127.0.0.1:0", &run).expect("server");
        let address = server.address().to_string();
        let handles: Vec<_> = (0..4u64)
            .map(|rank| {
                let (address, keys) = (address.clone(), rank_keys(&run, rank));
                std::thread::spawn(move || {
                    let mut client =
                        StoreClient::connect(&address, &keys, Some(rank), Duration::from_secs(5))
                            .expect("connect");
                    let _heartbeat = client
                        .start_heartbeat(Duration::from_millis(20))
                        .expect("heartbeat");
                    client
                        .set(&rank_key(rank, "addr"), format!("host:{rank}").as_bytes())
                        .expect("set");
                    client
                        .barrier("ready", 4, Duration::from_secs(5))
                        .expect("barrier");
                    let peer = (rank + 1) % 4;
                    let value = client
                        .get(&rank_key(peer, "addr"), Duration::from_secs(1))
                        .expect("get");
                    assert_eq!(value, format!("host:{peer}").as_bytes());
                    client.add("barrier/counter", 5).expect("add");
                    std::thread::sleep(Duration::from_millis(60));
                })
            })
            .collect();
        for handle in handles {
            handle.join().expect("rank thread");
        }
        let mut client =
            StoreClient::connect(&address, &run, None, Duration::from_secs(5)).expect("connect");
        assert_eq!(client.add("barrier/counter", 0).expect("add"), 20);
        assert_eq!(server.heartbeat_ages().len(), 4);
        let remote = client.heartbeat_ages().expect("ages over the wire");
        assert_eq!(remote.len(), 4);
        assert!(remote.values().all(|age| *age < Duration::from_secs(5)));
    }

    /// Threads of this process now that serve a store connection (named `store-client`;
    /// tests of other modules running meanwhile start threads of other names).
    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                    .filter(|name| name.trim() == "store-client")
                    .count()
            })
            .unwrap_or(0)
    }

    /// 200 idle strangers and four that announce 2 GiB messages: the store runs at most
    /// [`MAX_PENDING_HANDSHAKES`] threads for them, reads nothing they announce, and a
    /// member of the run still gets in and is served at once.
    #[test]
    fn strangers_get_bounded_threads_no_buffers_and_hold_no_member_up() {
        let _serial = serial();
        let run = run();
        let server = StoreServer::start("127.0.0.1:0", &run).expect("server");
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
            &rank_keys(&run, 0),
            Some(0),
            Duration::from_secs(10),
        )
        .expect("a member gets in");
        client.set("rank/0/key", b"value").expect("set");
        assert_eq!(
            client
                .get("rank/0/key", Duration::from_secs(1))
                .expect("get"),
            b"value"
        );
        drop(strangers);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// Input a member sends is bounded too: a key too long, counters at the edge and a
    /// timeout of "forever" get answers, and the store keeps serving.
    #[test]
    fn oversized_keys_overflowing_counters_and_endless_timeouts_are_answered() {
        let _serial = serial();
        let (_server, mut client, _) = store_and_rank_0();
        let error = client
            .set(&format!("rank/0/{}", "k".repeat(MAX_KEY_BYTES - 6)), b"v")
            .expect_err("too long");
        assert!(
            format!("{error:#}").contains("a key of 4097 bytes"),
            "{error:#}"
        );
        assert_eq!(client.add("barrier/c", i64::MAX).expect("add"), i64::MAX);
        assert_eq!(client.add("barrier/c", 1).expect("add"), i64::MAX);
        client.set("rank/0/k", b"v").expect("set");
        assert_eq!(client.get("rank/0/k", Duration::MAX).expect("get"), b"v");
    }

    #[test]
    fn another_runs_key_is_refused_and_gets_time_out() {
        let _serial = serial();
        let run = run();
        let server = StoreServer::start("127.0.0.1:0", &run).expect("server");
        let address = server.address().to_string();
        let error = StoreClient::connect(
            &address,
            &rank_keys(&self::run(), 0),
            Some(0),
            Duration::from_secs(2),
        )
        .err()
        .expect("refused");
        assert!(
            format!("{error:#}").contains("refused") || format!("{error:#}").contains("closed"),
            "{error:#}"
        );
        let mut client = StoreClient::connect(
            &address,
            &rank_keys(&run, 0),
            Some(0),
            Duration::from_secs(2),
        )
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

    /// A host proves only its own ranks, and a rank writes only its own keys: rank 2 (host 1)
    /// cannot connect as rank 0, nor set rank 0's keys or the launcher's `job`, nor beat for
    /// rank 3; an agent writes only under its own host; the launcher writes anything.
    #[test]
    fn a_host_acts_only_as_itself() {
        let _serial = serial();
        let run = run();
        let server = StoreServer::start("127.0.0.1:0", &run).expect("server");
        let address = server.address().to_string();
        let host1 = rank_keys(&run, 2);
        let refused = StoreClient::connect(&address, &host1, Some(0), Duration::from_millis(1500));
        assert!(refused.is_err(), "host 1 cannot prove rank 0");
        let mut rank2 =
            StoreClient::connect(&address, &host1, Some(2), Duration::from_secs(2)).expect("own");
        for key in ["rank/0/comm/dp0/tp", "rank/20/x", "rank/2", "job", "ready"] {
            let error = rank2.set(key, b"forged").expect_err(key);
            assert!(format!("{error:#}").contains("may not write"), "{error:#}");
        }
        assert!(rank2.add("rank/3/count", 1).is_err());
        rank2
            .set("rank/2/comm/dp0/tp", b"mine")
            .expect("its own key");
        rank2.add("barrier/loaded/count", 1).expect("a barrier");
        match rank2
            .request(&Request::Heartbeat { rank: 3 })
            .expect("answer")
        {
            Response::Error(why) => assert!(why.contains("may not beat"), "{why}"),
            other => panic!("a heartbeat for another rank was taken: {other:?}"),
        }
        assert!(server.heartbeat_ages().is_empty());
        let mut agent =
            StoreClient::connect(&address, &host1, None, Duration::from_secs(2)).expect("agent");
        agent.add("agents/1/watch", 0).expect("its own key");
        assert!(agent.add("agents/0/watch", 0).is_err());
        assert!(agent.set("rank/2/x", b"y").is_err());
        let mut launcher =
            StoreClient::connect(&address, &run, None, Duration::from_secs(2)).expect("launcher");
        launcher
            .set("job", b"{}")
            .expect("the launcher writes the job");
        assert_eq!(
            launcher
                .get("rank/2/comm/dp0/tp", Duration::ZERO)
                .expect("read"),
            b"mine"
        );
        // A store served on another host holds only the store keys.
        let remote = StoreServer::start("127.0.0.1:0", &run.for_store().expect("store keys"))
            .expect("server");
        StoreClient::connect(
            &remote.address().to_string(),
            &host1,
            Some(3),
            Duration::from_secs(2),
        )
        .expect("a rank joins a store served elsewhere");
    }

    /// A frame altered on the wire (its MAC no longer matches) ends the connection.
    #[test]
    fn an_altered_frame_is_refused() {
        let _serial = serial();
        let (server, mut client, run) = store_and_rank_0();
        client.set("rank/0/a", b"1").expect("set");
        let body = serde_json::to_vec(&Request::Set {
            key: "rank/0/a".into(),
            value: b"2".to_vec(),
        })
        .expect("json");
        let mut tag = client.sealer.seal(&body);
        tag[0] ^= 1;
        client
            .stream
            .write_all(&(body.len() as u32).to_le_bytes())
            .expect("length");
        client.stream.write_all(&body).expect("body");
        client.stream.write_all(&tag).expect("tag");
        let mut rest = Vec::new();
        let _ = client.stream.read_to_end(&mut rest);
        assert!(rest.is_empty(), "the store answered a forged frame");
        let mut other = StoreClient::connect(
            &server.address().to_string(),
            &run,
            None,
            Duration::from_secs(2),
        )
        .expect("connect");
        assert_eq!(other.get("rank/0/a", Duration::ZERO).expect("get"), b"1");
    }
}

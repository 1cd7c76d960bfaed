//! Data parallelism behind one HTTP endpoint: rank 0's [`Router`] spreads requests over the
//! DP replicas by load (requests in flight on each), preferring the replica that served the
//! same prompt prefix (its KV cache and CPU caches are warm) unless that replica is busier.
//! Replica 0 is the scheduler in this process; every other replica's driver runs its own
//! scheduler and talks to the router over one TCP connection ([`serve_remote`]), in
//! length-prefixed JSON frames, after proving it knows the run's token.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::watch;

use super::scheduler::{Event, Metrics, MetricsSnapshot, Request, Scheduler};
use crate::runtime::model::sampling::SamplingParams;

/// Prompt tokens hashed for prefix affinity.
const AFFINITY_PREFIX_TOKENS: usize = 32;
/// How many more requests in flight the affine replica may have than the least loaded one
/// and still be chosen.
const AFFINITY_SLACK: u64 = 2;
/// Largest frame accepted, bytes.
const MAX_FRAME_BYTES: usize = 64 << 20;

/// Router → replica.
#[derive(Serialize, Deserialize)]
enum ToReplica {
    Hello {
        token: String,
    },
    Submit {
        id: u64,
        prompt_tokens: Vec<u32>,
        params: SamplingParams,
    },
    Cancel {
        id: u64,
    },
    /// Report the metrics now (a `/metrics` scrape), answered with `MetricsNow`.
    Metrics {
        id: u64,
    },
}

/// Replica → router.
#[derive(Serialize, Deserialize)]
enum FromReplica {
    /// An event of request `id`.
    Event { id: u64, event: Event },
    /// The replica's metrics, sent twice a second.
    Metrics(MetricsSnapshot),
    /// The replica's metrics as asked by `ToReplica::Metrics { id }`.
    MetricsNow { id: u64, snapshot: MetricsSnapshot },
}

/// How long a scrape waits for a remote replica's current metrics before using its last
/// report.
const METRICS_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Scrapes waiting for a remote replica's metrics, by request id.
type MetricsWaiters = Arc<Mutex<HashMap<u64, tokio::sync::oneshot::Sender<MetricsSnapshot>>>>;

/// How often a remote replica reports its metrics.
const METRICS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// The requests of one remote replica still waiting for events.
type Pending = Arc<Mutex<HashMap<u64, UnboundedSender<Event>>>>;

/// A replica whose driver is another rank process.
struct Remote {
    frames: UnboundedSender<ToReplica>,
    pending: Pending,
    /// Its last reported metrics.
    metrics: Arc<Mutex<MetricsSnapshot>>,
    /// Scrapes waiting for its current metrics.
    waiters: MetricsWaiters,
}

/// Where requests go: the local scheduler (replica 0) and the remote replicas.
pub struct Router {
    local: Scheduler,
    remotes: Vec<Remote>,
    /// Requests in flight per replica (index 0: local).
    in_flight: Vec<Arc<AtomicU64>>,
    /// Requests routed so far per replica, for `/metrics`.
    routed: Vec<AtomicU64>,
    next_id: AtomicU64,
    /// The local scheduler's metrics (its engine, its KV cache).
    pub metrics: Arc<Metrics>,
    /// Becomes `Some(error)` when a remote replica fails for good.
    remote_failure: watch::Receiver<Option<String>>,
    fail: Arc<watch::Sender<Option<String>>>,
}

impl Router {
    /// A router over `local` alone (no data parallelism until [`Router::connect_remotes`]).
    pub fn local(local: Scheduler) -> Router {
        let (fail, remote_failure) = watch::channel(None);
        Router {
            metrics: Arc::clone(&local.metrics),
            local,
            remotes: Vec::new(),
            in_flight: vec![Arc::new(AtomicU64::new(0))],
            routed: vec![AtomicU64::new(0)],
            next_id: AtomicU64::new(0),
            remote_failure,
            fail: Arc::new(fail),
        }
    }

    /// The first failure of the local executor or of a remote replica, if any.
    pub fn failure(&self) -> Option<String> {
        let local = self.local.failure.borrow().clone();
        local.or_else(|| self.remote_failure.borrow().clone())
    }

    /// Waits until the local executor or a remote replica fails, and returns the error.
    pub async fn failed(&self) -> String {
        let (mut local, mut remote) = (self.local.failure.clone(), self.remote_failure.clone());
        loop {
            if let Some(error) = local.borrow_and_update().clone() {
                return error;
            }
            if let Some(error) = remote.borrow_and_update().clone() {
                return error;
            }
            tokio::select! {
                changed = local.changed() => if changed.is_err() {
                    return "the scheduler stopped".to_string();
                },
                // The sender lives in `self`: this never closes while the router exists.
                _ = remote.changed() => {}
            }
        }
    }

    /// Connects to the remote replicas' drivers at `addresses` (replicas 1, 2, …), proving
    /// the run `token`. Must run inside the HTTP runtime.
    ///
    /// Errors: a replica that cannot be reached.
    pub async fn connect_remotes(&mut self, addresses: &[String], token: &str) -> Result<()> {
        for (offset, address) in addresses.iter().enumerate() {
            let replica = offset + 1;
            let stream = TcpStream::connect(address)
                .await
                .with_context(|| format!("cannot reach DP replica {replica} at {address}"))?;
            stream.set_nodelay(true)?;
            let (mut reader, mut writer) = stream.into_split();
            let (frames, mut outgoing) = unbounded_channel::<ToReplica>();
            frames
                .send(ToReplica::Hello {
                    token: token.to_string(),
                })
                .map_err(|_| anyhow!("replica {replica}: writer stopped"))?;
            tokio::spawn(async move {
                while let Some(frame) = outgoing.recv().await {
                    if write_frame(&mut writer, &frame).await.is_err() {
                        break;
                    }
                }
            });
            let pending: Pending = Arc::default();
            let metrics: Arc<Mutex<MetricsSnapshot>> = Arc::default();
            let waiters: MetricsWaiters = Arc::default();
            let (reader_pending, reader_metrics, reader_waiters, fail, cancel) = (
                Arc::clone(&pending),
                Arc::clone(&metrics),
                Arc::clone(&waiters),
                Arc::clone(&self.fail),
                frames.clone(),
            );
            tokio::spawn(async move {
                let error = loop {
                    let (id, event) = match read_frame(&mut reader).await {
                        Ok(FromReplica::Event { id, event }) => (id, event),
                        Ok(FromReplica::Metrics(snapshot)) => {
                            *reader_metrics.lock().unwrap_or_else(|e| e.into_inner()) = snapshot;
                            continue;
                        }
                        Ok(FromReplica::MetricsNow { id, snapshot }) => {
                            *reader_metrics.lock().unwrap_or_else(|e| e.into_inner()) =
                                snapshot.clone();
                            let waiter = reader_waiters
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&id);
                            if let Some(waiter) = waiter {
                                let _ = waiter.send(snapshot);
                            }
                            continue;
                        }
                        Err(error) => break error,
                    };
                    let done = matches!(event, Event::Done { .. } | Event::Error(_));
                    let mut pending = reader_pending.lock().unwrap_or_else(|e| e.into_inner());
                    let delivered = pending
                        .get(&id)
                        .is_some_and(|events| events.send(event).is_ok());
                    if done || !delivered {
                        pending.remove(&id);
                    }
                    if !delivered && !done {
                        let _ = cancel.send(ToReplica::Cancel { id });
                    }
                };
                let error = format!("DP replica {replica} disconnected: {error:#}");
                for (_, events) in reader_pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .drain()
                {
                    let _ = events.send(Event::Error(error.clone()));
                }
                let _ = fail.send(Some(error));
            });
            self.remotes.push(Remote {
                frames,
                pending,
                metrics,
                waiters,
            });
            self.in_flight.push(Arc::new(AtomicU64::new(0)));
            self.routed.push(AtomicU64::new(0));
        }
        Ok(())
    }

    /// Every replica's metrics added up: the local scheduler's now, the remote ones as last
    /// reported.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut total = self.metrics.snapshot();
        for remote in &self.remotes {
            total.add(&remote.metrics.lock().unwrap_or_else(|e| e.into_inner()));
        }
        total
    }

    /// Every replica's metrics added up, the remote ones asked for now (a `/metrics`
    /// scrape sees the state after the requests it just saw finish); a replica that does
    /// not answer within `METRICS_WAIT` (1 s) counts with its last report.
    pub async fn metrics_now(&self) -> MetricsSnapshot {
        let mut answers = Vec::with_capacity(self.remotes.len());
        for remote in &self.remotes {
            let id = self.next_id.fetch_add(1, Ordering::SeqCst);
            let (sender, receiver) = tokio::sync::oneshot::channel();
            remote
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, sender);
            let _ = remote.frames.send(ToReplica::Metrics { id });
            answers.push((id, receiver));
        }
        let mut total = self.metrics.snapshot();
        for (remote, (id, receiver)) in self.remotes.iter().zip(answers) {
            match tokio::time::timeout(METRICS_WAIT, receiver).await {
                Ok(Ok(snapshot)) => total.add(&snapshot),
                _ => {
                    remote
                        .waiters
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                    total.add(&remote.metrics.lock().unwrap_or_else(|e| e.into_inner()));
                }
            }
        }
        total
    }

    /// Data-parallel replicas behind this router.
    pub fn replicas(&self) -> usize {
        self.in_flight.len()
    }

    /// Requests routed to each replica so far.
    pub fn routed(&self) -> Vec<u64> {
        self.routed
            .iter()
            .map(|r| r.load(Ordering::SeqCst))
            .collect()
    }

    /// The replica for a prompt: the least loaded, unless the prompt's prefix replica has
    /// at most [`AFFINITY_SLACK`] more requests in flight.
    fn choose(&self, prompt_tokens: &[u32]) -> usize {
        let loads: Vec<u64> = self
            .in_flight
            .iter()
            .map(|l| l.load(Ordering::SeqCst))
            .collect();
        let least = (0..loads.len()).min_by_key(|&i| loads[i]).unwrap_or(0);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        prompt_tokens[..prompt_tokens.len().min(AFFINITY_PREFIX_TOKENS)].hash(&mut hasher);
        let affine = (hasher.finish() % loads.len() as u64) as usize;
        if loads[affine] <= loads[least] + AFFINITY_SLACK {
            affine
        } else {
            least
        }
    }

    /// Routes a request. Must run inside the HTTP runtime (it spawns the task that counts
    /// the request out when it ends).
    ///
    /// Errors: the chosen replica has stopped or failed.
    pub fn submit(&self, request: Request) -> Result<(), String> {
        if let Some(error) = self.failure() {
            return Err(format!("the engine has failed: {error}"));
        }
        let replica = self.choose(&request.prompt_tokens);
        let in_flight = Arc::clone(&self.in_flight[replica]);
        in_flight.fetch_add(1, Ordering::SeqCst);
        self.routed[replica].fetch_add(1, Ordering::SeqCst);
        // Relay events to the client, counting the request out when it ends.
        let client = request.events;
        let (events, mut relay) = unbounded_channel::<Event>();
        tokio::spawn(async move {
            while let Some(event) = relay.recv().await {
                let done = matches!(event, Event::Done { .. } | Event::Error(_));
                if client.send(event).is_err() || done {
                    break;
                }
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
        if replica == 0 {
            return self.local.submit(Request {
                prompt_tokens: request.prompt_tokens,
                params: request.params,
                events,
                received_at: request.received_at,
            });
        }
        let remote = &self.remotes[replica - 1];
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        remote
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, events);
        remote
            .frames
            .send(ToReplica::Submit {
                id,
                prompt_tokens: request.prompt_tokens,
                params: request.params,
            })
            .map_err(|_| format!("DP replica {replica} has stopped"))
    }
}

/// A remote replica's side: accepts the router's connection on `listener`, checks the run
/// `token`, submits every request to `scheduler` and streams its events back, until the
/// router goes away (an error: rank 0 is gone) or the scheduler fails.
///
/// Errors: a wrong token, a lost connection, a failed scheduler.
pub async fn serve_remote(
    listener: tokio::net::TcpListener,
    token: &str,
    scheduler: Scheduler,
) -> Result<()> {
    let (stream, peer) = listener
        .accept()
        .await
        .context("no connection from the router")?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    match read_frame::<ToReplica>(&mut reader).await? {
        ToReplica::Hello { token: got } if got == token => {}
        _ => bail!("{peer} did not present the run token; refused"),
    }
    let (frames, mut outgoing) = unbounded_channel::<FromReplica>();
    tokio::spawn(async move {
        while let Some(frame) = outgoing.recv().await {
            if write_frame(&mut writer, &frame).await.is_err() {
                break;
            }
        }
    });
    let mut relays: HashMap<u64, tokio::task::AbortHandle> = HashMap::new();
    let mut failure = scheduler.failure.clone();
    let mut report = tokio::time::interval(METRICS_INTERVAL);
    loop {
        tokio::select! {
            _ = report.tick() => {
                let _ = frames.send(FromReplica::Metrics(scheduler.metrics.snapshot()));
            }
            frame = read_frame::<ToReplica>(&mut reader) => match frame? {
                ToReplica::Submit { id, prompt_tokens, params } => {
                    let (events, mut receiver) = unbounded_channel::<Event>();
                    let relay_frames = frames.clone();
                    let relay = tokio::spawn(async move {
                        while let Some(event) = receiver.recv().await {
                            let done = matches!(event, Event::Done { .. } | Event::Error(_));
                            if relay_frames.send(FromReplica::Event { id, event }).is_err() || done {
                                break;
                            }
                        }
                    });
                    relays.retain(|_, handle| !handle.is_finished());
                    relays.insert(id, relay.abort_handle());
                    if let Err(error) = scheduler.submit(Request {
                        prompt_tokens,
                        params,
                        events,
                        received_at: Instant::now(),
                    }) {
                        let _ = frames.send(FromReplica::Event { id, event: Event::Error(error) });
                    }
                }
                // Dropping the relay drops the receiver: the scheduler stops the sequence.
                ToReplica::Cancel { id } => {
                    if let Some(handle) = relays.remove(&id) {
                        handle.abort();
                    }
                }
                ToReplica::Metrics { id } => {
                    let _ = frames.send(FromReplica::MetricsNow { id, snapshot: scheduler.metrics.snapshot() });
                }
                ToReplica::Hello { .. } => bail!("unexpected second hello from the router"),
            },
            changed = failure.changed() => {
                let error = failure.borrow().clone();
                match (changed, error) {
                    (_, Some(error)) => bail!("the replica failed: {error}"),
                    (Err(_), None) => bail!("the scheduler stopped"),
                    (Ok(()), None) => {}
                }
            }
        }
    }
}

async fn write_frame<T: Serialize>(
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
    value: &T,
) -> Result<()> {
    let bytes = serde_json::to_vec(value)?;
    writer
        .write_all(&(bytes.len() as u32).to_le_bytes())
        .await?;
    writer.write_all(&bytes).await?;
    Ok(())
}

async fn read_frame<T: for<'de> Deserialize<'de>>(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
) -> Result<T> {
    let mut length = [0u8; 4];
    reader
        .read_exact(&mut length)
        .await
        .context("the connection closed")?;
    let length = u32::from_le_bytes(length) as usize;
    if length > MAX_FRAME_BYTES {
        bail!("a frame of {length} bytes is larger than {MAX_FRAME_BYTES}");
    }
    let mut bytes = vec![0u8; length];
    reader
        .read_exact(&mut bytes)
        .await
        .context("the connection closed mid-frame")?;
    serde_json::from_slice(&bytes).context("malformed frame")
}

//! Data parallelism behind one HTTP endpoint: rank 0's [`Router`] spreads requests over the
//! DP replicas with SGLang's cache-aware policy: it keeps an approximate radix tree of the
//! prompts it sent to each replica (the chained keys of their 16-token blocks, what a
//! replica's prefix cache can reuse) and, while the load is balanced, sends a request to
//! the replica whose tree matches the longest prefix of its prompt when that covers at
//! least [`CACHE_THRESHOLD`] of it, else to the least loaded replica; once the load is
//! imbalanced ([`BALANCE_ABS_THRESHOLD`], [`BALANCE_REL_THRESHOLD`]) every request goes to
//! the least loaded one. Replica 0 is the scheduler in this process; every other replica's
//! driver runs its own scheduler and talks to the router over one TCP connection
//! ([`serve_remote`]), in length-prefixed JSON frames, after the run's handshake
//! ([`crate::handshake`], channel `router`: rank 0 proves itself as the router, the replica
//! as replica `r`; the secret never crosses the wire).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::watch;

use super::health::{DEFAULT_STALL_TIMEOUT, ReplicaState, Verdict, judge};
use super::links::{Links, Rejoin, Remote};
use super::scheduler::{Event, Metrics, MetricsSnapshot, PdStage, Request, Scheduler};
use crate::runtime::model::sampling::SamplingParams;

/// The share of a prompt's tokens a replica's tree must match for the prompt to go there
/// while the load is balanced (SGLang router's `--cache-threshold`, default 0.5).
pub(crate) const CACHE_THRESHOLD: f64 = 0.5;
/// The load (requests in flight) is imbalanced when the busiest replica has more than this
/// many more requests than the least busy one… (SGLang's `--balance-abs-threshold` is 32 for
/// GPU replicas running hundreds of sequences; ours run 16 by default.)
pub(crate) const BALANCE_ABS_THRESHOLD: u64 = 4;
/// …and more than this many times as many (SGLang's `--balance-rel-threshold`).
pub(crate) const BALANCE_REL_THRESHOLD: f64 = 1.5;
/// Blocks each replica's tree remembers; the least recently used go first beyond it.
const TREE_MAX_BLOCKS: usize = 1 << 16;
/// Tokens per tree node: the KV block size, the unit a replica's prefix cache reuses.
const TREE_BLOCK_TOKENS: usize = crate::runtime::model::kv::BLOCK_TOKENS;

/// Why the router sent a request where it did (`infer_router_decisions_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RouteReason {
    /// Balanced load, and the replica's tree matched at least [`CACHE_THRESHOLD`].
    PrefixMatch,
    /// Balanced load, no replica matched enough: the least loaded (the smallest tree on a tie).
    LeastLoaded,
    /// Imbalanced load: the least loaded, whatever it has cached.
    Imbalanced,
}

impl RouteReason {
    /// Every reason, in the order of [`RouteReason::name`]'s labels.
    pub(crate) const ALL: [RouteReason; 3] = [
        RouteReason::PrefixMatch,
        RouteReason::LeastLoaded,
        RouteReason::Imbalanced,
    ];

    /// The `reason` label.
    pub(crate) fn name(self) -> &'static str {
        match self {
            RouteReason::PrefixMatch => "prefix_match",
            RouteReason::LeastLoaded => "least_loaded",
            RouteReason::Imbalanced => "imbalanced",
        }
    }
}

/// What the policy knows of one replica for one request.
#[derive(Clone, Copy, Debug)]
struct ReplicaView {
    in_flight: u64,
    /// Prompt tokens its tree matches from the start.
    matched_tokens: usize,
    /// Blocks its tree holds.
    tree_blocks: usize,
}

/// The cache-aware policy: with an imbalanced load the least loaded replica; else the
/// longest match if it covers [`CACHE_THRESHOLD`] of the `prompt_tokens`; else the least
/// loaded (ties: the smallest tree, the most room for new prefixes; then the lowest index).
fn decide(replicas: &[ReplicaView], prompt_tokens: usize) -> (usize, RouteReason) {
    let (min, max) = (
        replicas.iter().map(|r| r.in_flight).min().unwrap_or(0),
        replicas.iter().map(|r| r.in_flight).max().unwrap_or(0),
    );
    let least = (0..replicas.len())
        .min_by_key(|&i| (replicas[i].in_flight, replicas[i].tree_blocks))
        .unwrap_or(0);
    if max - min > BALANCE_ABS_THRESHOLD && max as f64 > min as f64 * BALANCE_REL_THRESHOLD {
        return (least, RouteReason::Imbalanced);
    }
    let best = (0..replicas.len())
        .max_by_key(|&i| {
            (
                replicas[i].matched_tokens,
                std::cmp::Reverse(replicas[i].in_flight),
                std::cmp::Reverse(i),
            )
        })
        .unwrap_or(0);
    let matched = replicas.get(best).map_or(0, |r| r.matched_tokens);
    if matched > 0 && matched as f64 >= CACHE_THRESHOLD * prompt_tokens as f64 {
        (best, RouteReason::PrefixMatch)
    } else {
        (least, RouteReason::LeastLoaded)
    }
}

/// The router's approximate radix trees, one per replica: the chained key of every
/// 16-token block of the prompts sent there (a path of the tree), with when it was last
/// sent. Approximate: a replica may have evicted blocks its tree still shows.
#[derive(Default)]
struct PrefixTrees {
    trees: Vec<HashMap<u64, u64>>,
    clock: u64,
}

/// The chained keys of the whole 16-token blocks of `tokens` (FNV-1a, 64-bit).
fn block_path(tokens: &[u32]) -> Vec<u64> {
    let mut parent = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .chunks_exact(TREE_BLOCK_TOKENS)
        .map(|block| {
            let mut hash = parent;
            for byte in block.iter().flat_map(|t| t.to_le_bytes()) {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
            parent = hash;
            hash
        })
        .collect()
}

impl PrefixTrees {
    /// Tokens of `path`'s prompt that replica `replica`'s tree matches from the start.
    fn matched_tokens(&self, replica: usize, path: &[u64]) -> usize {
        let tree = &self.trees[replica];
        path.iter().take_while(|key| tree.contains_key(key)).count() * TREE_BLOCK_TOKENS
    }

    /// Records `path` as sent to `replica`, forgetting its oldest blocks past
    /// [`TREE_MAX_BLOCKS`].
    fn insert(&mut self, replica: usize, path: &[u64]) {
        self.clock += 1;
        let clock = self.clock;
        let tree = &mut self.trees[replica];
        for &key in path {
            tree.insert(key, clock);
        }
        if tree.len() > TREE_MAX_BLOCKS {
            let mut ages: Vec<u64> = tree.values().copied().collect();
            ages.sort_unstable();
            let cutoff = ages[ages.len() - TREE_MAX_BLOCKS * 3 / 4];
            tree.retain(|_, age| *age >= cutoff);
        }
    }
}
/// Largest frame accepted, bytes.
const MAX_FRAME_BYTES: usize = 64 << 20;

/// Router → replica.
#[derive(Serialize, Deserialize)]
pub(super) enum ToReplica {
    Submit {
        id: u64,
        prompt_tokens: Vec<u32>,
        params: Box<SamplingParams>,
        #[serde(default)]
        pd: Option<PdStage>,
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
pub(super) enum FromReplica {
    /// An event of request `id`.
    Event { id: u64, event: Event },
    /// The replica's metrics, sent twice a second.
    Metrics(MetricsSnapshot),
    /// The replica's metrics as asked by `ToReplica::Metrics { id }`.
    MetricsNow { id: u64, snapshot: MetricsSnapshot },
    /// The replica stops serving, and why (its scheduler failed, a malformed frame): the
    /// last frame before it closes the connection.
    Stopped { reason: String },
}

/// How long a scrape waits for a remote replica's current metrics before using its last
/// report: half of Prometheus' default `scrape_timeout` (10 s), so a replica busy with a
/// long step on a loaded host still answers with its current figures (1 s was not enough
/// on a 2-core machine running the test suite: a stale "running 3" after every answer).
const METRICS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Scrapes waiting for a remote replica's metrics, by request id.
pub(super) type MetricsWaiters =
    Arc<Mutex<HashMap<u64, tokio::sync::oneshot::Sender<MetricsSnapshot>>>>;

/// How often a remote replica reports its metrics.
const METRICS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// The requests of one remote replica still waiting for events.
pub(super) type Pending = Arc<Mutex<HashMap<u64, UnboundedSender<Event>>>>;

/// Where requests go: the local scheduler (replica 0) and the remote replicas.
pub struct Router {
    local: Scheduler,
    remotes: Vec<Arc<Remote>>,
    /// Requests in flight per replica (index 0: local).
    in_flight: Vec<Arc<AtomicU64>>,
    /// Requests routed so far per replica, for `/metrics`.
    routed: Vec<AtomicU64>,
    /// Requests routed so far per replica and [`RouteReason`] (in `RouteReason::ALL` order).
    decisions: Vec<[AtomicU64; 3]>,
    trees: Mutex<PrefixTrees>,
    next_id: Arc<AtomicU64>,
    /// Prefill/decode disaggregation: replicas `0..n` prefill, the others decode.
    prefill_replicas: Option<usize>,
    /// The local scheduler's metrics (its engine, its KV cache).
    pub metrics: Arc<Metrics>,
    /// Becomes `Some(error)` when a remote replica fails for good.
    remote_failure: watch::Receiver<Option<String>>,
    fail: Arc<watch::Sender<Option<String>>>,
    /// `--stall-timeout`: a replica with work and no progress for longer is stalled.
    stall_timeout: std::time::Duration,
    /// (running per replica, waiting in all) that may be in flight; `None`: no bound.
    queue_limit: Option<(usize, usize)>,
    /// Where restarted replicas are found (`None`: a lost replica fails the server).
    rejoin: Option<Rejoin>,
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
            decisions: vec![Default::default()],
            trees: Mutex::new(PrefixTrees {
                trees: vec![HashMap::new()],
                clock: 0,
            }),
            next_id: Arc::new(AtomicU64::new(0)),
            prefill_replicas: None,
            remote_failure,
            fail: Arc::new(fail),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            queue_limit: None,
            rejoin: None,
        }
    }

    /// A lost remote replica is restarting rather than failed: the router sends it
    /// nothing, fails its requests in flight with the cause, and links to its next start
    /// when its driver publishes one in the store at `rejoin` ([`super::links`]).
    pub(crate) fn with_replica_restarts(mut self, rejoin: Rejoin) -> Router {
        self.rejoin = Some(rejoin);
        self
    }

    /// Judges replicas stalled after `stall_timeout` without progress (`--stall-timeout`).
    pub fn with_stall_timeout(mut self, stall_timeout: std::time::Duration) -> Router {
        self.stall_timeout = stall_timeout;
        self
    }

    /// Bounds the requests in flight: at most `max_running` running on each replica (its
    /// `--max-num-seqs`) plus `max_queued` waiting in all (`--max-queued-requests`; `None`:
    /// no bound). [`Router::admit`] says whether more may come.
    pub fn with_queue_limit(mut self, max_running: usize, max_queued: Option<usize>) -> Router {
        self.queue_limit = max_queued.map(|queued| (max_running, queued));
        self
    }

    /// Whether `n` more requests fit under the queue limit ([`Router::with_queue_limit`]),
    /// counting those in flight on the replicas that take new requests.
    ///
    /// Errors: they do not fit: what is in flight and the limit.
    pub fn admit(&self, n: usize) -> Result<(), String> {
        let Some((max_running, max_queued)) = self.queue_limit else {
            return Ok(());
        };
        let entry = 0..self.prefill_replicas.unwrap_or(self.in_flight.len());
        let in_flight: u64 = entry
            .clone()
            .map(|i| self.in_flight[i].load(Ordering::SeqCst))
            .sum();
        let capacity = (max_running * entry.len() + max_queued) as u64;
        if in_flight + n as u64 > capacity {
            return Err(format!(
                "the server is at capacity: {in_flight} requests in flight, at most {} running and {max_queued} waiting (--max-queued-requests); retry shortly",
                max_running * entry.len()
            ));
        }
        Ok(())
    }

    /// Disaggregates prefill and decode: replicas `0..prefill` (the local one among them)
    /// run prompts and hand each request to one of the others, which decode.
    pub fn disaggregated(mut self, prefill: usize) -> Router {
        self.prefill_replicas = Some(prefill);
        self
    }

    /// A clonable way to submit to `replica`.
    fn target(&self, replica: usize) -> Target {
        match replica {
            0 => Target::Local(self.local.clone()),
            r => Target::Remote {
                remote: Arc::clone(&self.remotes[r - 1]),
                next_id: Arc::clone(&self.next_id),
            },
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

    /// Connects to the remote replicas' drivers (replicas 1, 2, …: each one's start and
    /// address, and its driver rank), proving this host's pair key with each one's
    /// (`keys`). Must run inside the HTTP runtime.
    ///
    /// Errors: a replica that cannot be reached, or whose host has no key.
    pub async fn connect_remotes(
        &mut self,
        remotes: &[((usize, String), u64)],
        keys: &crate::keyring::Keyring,
    ) -> Result<()> {
        let links = Arc::new(Links {
            fail: Arc::clone(&self.fail),
            rejoin: self.rejoin.clone(),
            keys: keys.clone(),
        });
        for (offset, (start, driver)) in remotes.iter().enumerate() {
            let remote = super::links::connect(offset + 1, *driver, start.clone(), &links).await?;
            self.remotes.push(remote);
            self.in_flight.push(Arc::new(AtomicU64::new(0)));
            self.routed.push(AtomicU64::new(0));
            self.decisions.push(Default::default());
            self.trees
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .trees
                .push(HashMap::new());
        }
        Ok(())
    }

    /// Every replica's metrics added up: the local scheduler's now, the remote ones as last
    /// reported.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut total = self.metrics.snapshot();
        for remote in &self.remotes {
            total.add(&remote.last_report());
        }
        total
    }

    /// Every replica's health under the stall timeout (what `/health` answers): the local
    /// one now, the remote ones from their last reports, aged since.
    pub fn health(&self) -> Verdict {
        let local_failure = self.local.failure.borrow().clone();
        let remote_failure = self.remote_failure.borrow().clone();
        let state = |snapshot: MetricsSnapshot, failure: Option<String>| ReplicaState {
            running: snapshot.running,
            waiting: snapshot.waiting,
            progress: snapshot.progress,
            failure,
            restarting: None,
        };
        let mut replicas = vec![state(self.metrics.snapshot(), local_failure)];
        for (index, remote) in self.remotes.iter().enumerate() {
            // A remote replica's failure names it ("DP replica 2 …"): it is its own.
            let failure = remote_failure
                .clone()
                .filter(|f| f.starts_with(&format!("DP replica {} ", index + 1)));
            replicas.push(ReplicaState {
                restarting: remote
                    .down()
                    .map(|why| (why, remote.down_secs().unwrap_or(0.0))),
                ..state(remote.last_report(), failure)
            });
        }
        judge(&replicas, self.stall_timeout, self.prefill_replicas)
    }

    /// Whether each replica is stalled or down now (index = replica).
    fn stalled(&self) -> Vec<bool> {
        let timeout = self.stall_timeout;
        std::iter::once(self.metrics.progress_now().stalled(timeout))
            .chain(
                self.remotes
                    .iter()
                    .map(|r| r.down().is_some() || r.last_report().progress.stalled(timeout)),
            )
            .collect()
    }

    /// Every replica's metrics, by replica, the remote ones asked for now (a `/metrics`
    /// scrape sees the state after the requests it just saw finish); a replica that does
    /// not answer within `METRICS_WAIT` (1 s) counts with its last report.
    pub async fn replica_metrics_now(&self) -> Vec<MetricsSnapshot> {
        let mut answers = Vec::with_capacity(self.remotes.len());
        for remote in &self.remotes {
            // A replica that is down has nothing to report.
            let asked = remote.link().map(|link| {
                let id = self.next_id.fetch_add(1, Ordering::SeqCst);
                let (sender, receiver) = tokio::sync::oneshot::channel();
                link.waiters
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, sender);
                let _ = link.frames.send(ToReplica::Metrics { id });
                (link, id, receiver)
            });
            answers.push(asked);
        }
        let mut all = vec![self.metrics.snapshot()];
        for (remote, asked) in self.remotes.iter().zip(answers) {
            let Some((link, id, receiver)) = asked else {
                all.push(remote.last_report());
                continue;
            };
            all.push(match tokio::time::timeout(METRICS_WAIT, receiver).await {
                Ok(Ok(snapshot)) => snapshot,
                _ => {
                    link.waiters
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                    remote.last_report()
                }
            });
        }
        all
    }

    /// With prefill/decode disaggregation, how many of the replicas (the first ones)
    /// prefill.
    pub fn prefill_replicas(&self) -> Option<usize> {
        self.prefill_replicas
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

    /// Requests routed to each replica so far, per [`RouteReason`] (`RouteReason::ALL` order).
    pub fn decisions(&self) -> Vec<[u64; 3]> {
        self.decisions
            .iter()
            .map(|d| std::array::from_fn(|i| d[i].load(Ordering::SeqCst)))
            .collect()
    }

    /// The replica among `candidates` for a prompt, and why (SGLang's cache-aware policy,
    /// see the module docs); the prompt's blocks join that replica's tree.
    fn choose(
        &self,
        prompt_tokens: &[u32],
        candidates: std::ops::Range<usize>,
    ) -> (usize, RouteReason) {
        let candidates = self.serving(candidates);
        let mut trees = self.trees.lock().unwrap_or_else(|e| e.into_inner());
        let path = block_path(prompt_tokens);
        let replicas: Vec<ReplicaView> = candidates
            .iter()
            .map(|&i| ReplicaView {
                in_flight: self.in_flight[i].load(Ordering::SeqCst),
                matched_tokens: trees.matched_tokens(i, &path),
                tree_blocks: trees.trees[i].len(),
            })
            .collect();
        let (offset, reason) = decide(&replicas, prompt_tokens.len());
        let replica = candidates[offset];
        trees.insert(replica, &path);
        (replica, reason)
    }

    /// The replicas among `candidates` that are not stalled, or all of them when every one
    /// is (a request then waits for a stalled replica rather than failing at once).
    fn serving(&self, candidates: std::ops::Range<usize>) -> Vec<usize> {
        if self.remotes.is_empty() {
            return candidates.collect();
        }
        let stalled = self.stalled();
        let serving: Vec<usize> = candidates.clone().filter(|&i| !stalled[i]).collect();
        if serving.is_empty() {
            candidates.collect()
        } else {
            serving
        }
    }

    /// The least loaded decode replica that is not stalled (the lowest index on a tie).
    fn choose_decode(&self, prefill: usize) -> usize {
        self.serving(prefill..self.in_flight.len())
            .into_iter()
            .min_by_key(|&i| self.in_flight[i].load(Ordering::SeqCst))
            .unwrap_or(prefill)
    }

    /// Counts a request into `replica`'s routing metrics for `reason`.
    fn count(&self, replica: usize, reason: RouteReason) {
        self.routed[replica].fetch_add(1, Ordering::SeqCst);
        let reason_index = RouteReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(0);
        self.decisions[replica][reason_index].fetch_add(1, Ordering::SeqCst);
    }

    /// Routes a request. Must run inside the HTTP runtime (it spawns the task that counts
    /// the request out when it ends).
    ///
    /// Errors: the chosen replica has stopped or failed.
    pub fn submit(&self, request: Request) -> Result<(), String> {
        if let Some(error) = self.failure() {
            return Err(format!("the engine has failed: {error}"));
        }
        let replicas = self.in_flight.len();
        let (replica, reason) = match self.prefill_replicas {
            Some(prefill) => self.choose(&request.prompt_tokens, 0..prefill),
            None => self.choose(&request.prompt_tokens, 0..replicas),
        };
        let in_flight = Arc::clone(&self.in_flight[replica]);
        in_flight.fetch_add(1, Ordering::SeqCst);
        self.count(replica, reason);
        // With disaggregation: where the request goes after its first token.
        let decode = self.prefill_replicas.map(|prefill| {
            let decode = self.choose_decode(prefill);
            // Random, so that nobody can name another request's transfer in advance.
            let transfer = rand::random::<u64>();
            (decode, transfer)
        });
        let pd = decode.map(|(replica, transfer)| PdStage::Prefill { replica, transfer });
        // Relay events to the client, counting the request out when it ends; a hand-off
        // moves the request (and its count) to the decode replica.
        let client = request.events;
        let (events, mut relay) = unbounded_channel::<Event>();
        // The decode replica counts the request from now, so concurrent requests spread
        // over the decode replicas before their prompts are done.
        let handoff = decode.map(|(replica, _)| {
            self.in_flight[replica].fetch_add(1, Ordering::SeqCst);
            self.count(replica, RouteReason::LeastLoaded);
            (
                self.target(replica),
                Arc::clone(&self.in_flight[replica]),
                request.prompt_tokens.clone(),
                request.params.clone(),
            )
        });
        let received_at = request.received_at;
        tokio::spawn(async move {
            // The counts this request still holds: its prefill replica's until the
            // hand-off, its decode replica's until the end.
            let mut held: Vec<Arc<AtomicU64>> = vec![in_flight];
            held.extend(handoff.as_ref().map(|h| Arc::clone(&h.1)));
            loop {
                // A client that went away (its receiver dropped) ends the relay at once:
                // dropping `relay` takes the request out of its scheduler, waiting or not.
                let event = tokio::select! {
                    event = relay.recv() => match event {
                        Some(event) => event,
                        None => break,
                    },
                    () = client.closed() => break,
                };
                if let (
                    Event::HandedOff {
                        first_token,
                        cached_tokens,
                    },
                    Some((target, _, prompt_tokens, params)),
                    Some((_, transfer)),
                ) = (&event, &handoff, decode)
                {
                    held.remove(0).fetch_sub(1, Ordering::SeqCst);
                    let (events, next) = unbounded_channel::<Event>();
                    relay = next;
                    let submitted = target.submit(Request {
                        prompt_tokens: prompt_tokens.clone(),
                        params: params.clone(),
                        events,
                        received_at,
                        pd: Some(PdStage::Decode {
                            transfer,
                            first_token: *first_token,
                            cached_tokens: *cached_tokens,
                        }),
                    });
                    if let Err(error) = submitted {
                        let _ = client.send(Event::Error(error));
                        break;
                    }
                    continue;
                }
                let done = matches!(event, Event::Done { .. } | Event::Error(_));
                if client.send(event).is_err() || done {
                    break;
                }
            }
            for count in held {
                count.fetch_sub(1, Ordering::SeqCst);
            }
        });
        self.target(replica).submit(Request {
            prompt_tokens: request.prompt_tokens,
            params: request.params,
            events,
            received_at,
            pd,
        })
    }
}

/// Where a request can be submitted: the local scheduler or a remote replica's driver.
#[derive(Clone)]
enum Target {
    Local(Scheduler),
    Remote {
        remote: Arc<Remote>,
        next_id: Arc<AtomicU64>,
    },
}

impl Target {
    /// Submits `request`. Errors: the replica has stopped.
    fn submit(&self, request: Request) -> Result<(), String> {
        match self {
            Target::Local(scheduler) => scheduler.submit(request),
            Target::Remote { remote, next_id } => {
                let link = super::links::up(remote)?;
                let (replica, frames, pending) = (remote.replica, &link.frames, &link.pending);
                let id = next_id.fetch_add(1, Ordering::SeqCst);
                let watched = request.events.clone();
                pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, request.events);
                frames
                    .send(ToReplica::Submit {
                        id,
                        prompt_tokens: request.prompt_tokens,
                        params: Box::new(request.params),
                        pd: request.pd,
                    })
                    .map_err(|_| format!("DP replica {replica} has stopped"))?;
                // When the requester goes away before the request ends (no event need come
                // first: it may still wait for a slot), the replica is told to cancel it.
                let (pending, frames) = (Arc::clone(pending), frames.clone());
                tokio::spawn(async move {
                    watched.closed().await;
                    let ongoing = pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id)
                        .is_some();
                    if ongoing {
                        let _ = frames.send(ToReplica::Cancel { id });
                    }
                });
                Ok(())
            }
        }
    }
}

/// The router link's channel in the handshake.
pub(super) const CHANNEL: &str = "router";

/// Connections a replica runs its handshake on at once; more are closed at once.
const MAX_PENDING_HANDSHAKES: usize = 16;

/// Accepts on `listener` until rank 0 proves itself as the router of replica `replica`
/// (each handshake on a blocking thread of its own: garbage or an idle stranger is closed
/// after [`crate::handshake::HELLO_TIMEOUT`] and holds up nothing), and returns its
/// connection.
///
/// Errors: the listener fails.
async fn accept_router(
    listener: &tokio::net::TcpListener,
    keys: &crate::keyring::Keyring,
    replica: usize,
) -> Result<(TcpStream, crate::handshake::Session)> {
    let (proved, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The router is rank 0: its host's pair key with this one.
    let key = keys
        .pair_key_with_rank(0)
        .context("no key for rank 0's host")?;
    // ... connecting from its host's address.
    let router_address = keys.address_of_rank(0);
    loop {
        tokio::select! {
            Some((stream, session)) = arrivals.recv() => {
                let stream: std::net::TcpStream = stream;
                stream.set_nonblocking(true)?;
                return Ok((TcpStream::from_std(stream)?, session));
            }
            accepted = listener.accept() => {
                let (stream, _) = accepted.context("no connection from the router")?;
                if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_HANDSHAKES {
                    pending.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                let mut stream = stream.into_std()?;
                let (key, proved, counter) = (key.clone(), proved.clone(), Arc::clone(&pending));
                tokio::task::spawn_blocking(move || {
                    let accepted = match stream.set_nonblocking(false) {
                        Ok(()) => crate::handshake::server(&mut stream, CHANNEL, replica as u64, &|router| (router == 0).then(|| key.clone()))
                            .and_then(|proved| crate::handshake::check_source(&stream, router_address).map(|()| proved))
                            .ok(),
                        Err(_) => None,
                    };
                    counter.fetch_sub(1, Ordering::SeqCst);
                    if let Some((_, session)) = accepted {
                        let _ = proved.send((stream, session));
                    }
                });
            }
        }
    }
}

/// A remote replica's side (replica `replica`): accepts the router's connection on
/// `listener` once it proves the run's secret, submits every request to `scheduler` and
/// streams its events back, until the router goes away (an error: rank 0 is gone) or the
/// scheduler fails; its last frame then says why, so that the router's error names the
/// cause.
///
/// Errors: a lost connection, a failed scheduler.
pub(crate) async fn serve_remote(
    listener: tokio::net::TcpListener,
    keys: &crate::keyring::Keyring,
    replica: usize,
    scheduler: Scheduler,
) -> Result<()> {
    let (stream, session) = accept_router(&listener, keys, replica).await?;
    // The router has proved itself: nobody else is let in, nor left waiting in the backlog.
    drop(listener);
    stream.set_nodelay(true)?;
    let (reader, mut writer) = stream.into_split();
    let (mut sealer, opener) = session.split();
    let mut incoming = spawn_frame_reader::<ToReplica>(reader, opener);
    let (frames, mut outgoing) = unbounded_channel::<FromReplica>();
    let writer_task = tokio::spawn(async move {
        while let Some(frame) = outgoing.recv().await {
            if write_frame(&mut writer, &mut sealer, &frame).await.is_err() {
                break;
            }
        }
    });
    let result = relay_requests(&mut incoming, &frames, &scheduler).await;
    // Tell the router why, so that its error names the cause rather than a closed
    // connection; the writer sends what is queued, then stops with the channel.
    if let Err(error) = &result {
        let _ = frames.send(FromReplica::Stopped {
            reason: format!("{error:#}"),
        });
    }
    drop(frames);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), writer_task).await;
    result
}

/// [`serve_remote`]'s loop: runs the router's frames from `incoming` against `scheduler`,
/// sending events and metrics into `frames`, until the router goes away or the scheduler
/// fails (both errors).
async fn relay_requests(
    incoming: &mut tokio::sync::mpsc::UnboundedReceiver<Result<ToReplica>>,
    frames: &UnboundedSender<FromReplica>,
    scheduler: &Scheduler,
) -> Result<()> {
    let mut relays = Relays::default();
    let relays = &mut relays.0;
    let mut failure = scheduler.failure.clone();
    let mut report = tokio::time::interval(METRICS_INTERVAL);
    loop {
        tokio::select! {
            _ = report.tick() => {
                let _ = frames.send(FromReplica::Metrics(scheduler.metrics.snapshot()));
            }
            // A channel receive is cancel-safe: a frame half read when the tick wins stays
            // with the reader task (reading in this `select!` would drop its bytes and
            // misread the rest of the stream).
            frame = incoming.recv() => match frame.context("the frame reader stopped")?? {
                ToReplica::Submit { id, prompt_tokens, params, pd } => {
                    let (events, mut receiver) = unbounded_channel::<Event>();
                    let relay_frames = frames.clone();
                    let relay = tokio::spawn(async move {
                        while let Some(event) = receiver.recv().await {
                            let done = matches!(
                                event,
                                Event::Done { .. } | Event::Error(_) | Event::HandedOff { .. }
                            );
                            if relay_frames.send(FromReplica::Event { id, event }).is_err() || done {
                                break;
                            }
                        }
                    });
                    relays.retain(|_, handle| !handle.is_finished());
                    relays.insert(id, relay.abort_handle());
                    if let Err(error) = scheduler.submit(Request {
                        prompt_tokens,
                        params: *params,
                        events,
                        received_at: Instant::now(),
                        pd,
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

/// The tasks relaying each request's events to the router, by request id; dropping it
/// aborts them, so that nothing follows `FromReplica::Stopped`.
#[derive(Default)]
struct Relays(HashMap<u64, tokio::task::AbortHandle>);

impl Drop for Relays {
    fn drop(&mut self) {
        for handle in self.0.values() {
            handle.abort();
        }
    }
}

/// Reads frames from `reader` in a task of its own and passes them on, the error that ends
/// the stream (a closed connection, a malformed frame) last. Receiving from the channel is
/// cancel-safe where [`read_frame`] is not: a `select!` that drops a half-done
/// `read_frame` loses the bytes it read.
fn spawn_frame_reader<T: for<'de> Deserialize<'de> + Send + 'static>(
    mut reader: tokio::net::tcp::OwnedReadHalf,
    mut opener: crate::handshake::Opener,
) -> tokio::sync::mpsc::UnboundedReceiver<Result<T>> {
    let (frames, incoming) = unbounded_channel();
    tokio::spawn(async move {
        loop {
            let frame = read_frame::<T>(&mut reader, &mut opener).await;
            let failed = frame.is_err();
            if frames.send(frame).is_err() || failed {
                break;
            }
        }
    });
    incoming
}

/// Writes one frame: a little-endian `u32` length, the JSON body, and the body's MAC under
/// the link's session.
pub(super) async fn write_frame<T: Serialize>(
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
    sealer: &mut crate::handshake::Sealer,
    value: &T,
) -> Result<()> {
    // One buffer, one write: the length, the body and the MAC leave together.
    let mut bytes = vec![0u8; 4];
    serde_json::to_writer(&mut bytes, value)?;
    let length = u32::try_from(bytes.len() - 4).context("a frame larger than 4 GiB")?;
    bytes[..4].copy_from_slice(&length.to_le_bytes());
    let tag = sealer.seal(&bytes[4..]);
    bytes.extend_from_slice(&tag);
    writer.write_all(&bytes).await?;
    Ok(())
}

/// Reads one frame of [`write_frame`]'s and checks its MAC.
///
/// Errors: the connection closed, a frame too long, a wrong MAC, malformed JSON.
pub(super) async fn read_frame<T: for<'de> Deserialize<'de>>(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    opener: &mut crate::handshake::Opener,
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
    let mut bytes = vec![0u8; length + crate::handshake::TAG_BYTES];
    reader
        .read_exact(&mut bytes)
        .await
        .context("the connection closed mid-frame")?;
    let (body, tag) = bytes.split_at(length);
    opener.open(body, tag)?;
    serde_json::from_slice(body).context("malformed frame")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::exec::executor::{Executor, Sampled, StepEntry};
    use crate::runtime::model::kv::KvPool;
    use crate::runtime::model::tokenizer::Tokenizer;
    use crate::serve::scheduler::Limits;

    /// An executor whose every step fails for good, as a replica that lost a rank does.
    struct LostRank {
        tokenizer: Tokenizer,
        pool: Arc<KvPool>,
    }

    impl Executor for LostRank {
        fn step(&mut self, _: &[StepEntry], _: &[u64]) -> Result<Vec<Option<Sampled>>> {
            bail!("rank 3 closed its connection")
        }
        fn errors_are_fatal(&self) -> bool {
            true
        }
        fn tokenizer(&self) -> &Tokenizer {
            &self.tokenizer
        }
        fn max_context_tokens(&self) -> usize {
            64
        }
        fn kv_pool(&self) -> &Arc<KvPool> {
            &self.pool
        }
    }

    /// Reads frames until one that `wanted` picks, within 10 s.
    async fn next_frame<T>(
        reader: &mut tokio::net::tcp::OwnedReadHalf,
        opener: &mut crate::handshake::Opener,
        mut wanted: impl FnMut(FromReplica) -> Option<T>,
    ) -> Result<T> {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                if let Some(found) = wanted(read_frame::<FromReplica>(reader, opener).await?) {
                    return Ok(found);
                }
            }
        })
        .await
        .context("no such frame within 10 s")?
    }

    /// A frame whose length prefix arrives over a second before its body (a loaded host,
    /// two TCP segments) is read whole although the metrics tick fires in between twice; a
    /// replica whose scheduler fails tells the router why before it closes the connection.
    #[test]
    fn a_remote_replica_reads_frames_split_across_ticks_and_says_why_it_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("tokenizer.json"),
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
                "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
                "model":{"type":"WordLevel","vocab":{"a":0,"b":1},"unk_token":"a"}}"#,
        )
        .expect("write tokenizer.json");
        let executor = LostRank {
            tokenizer: Tokenizer::from_dir(dir.path()).expect("tokenizer"),
            pool: KvPool::new(1, 1, 8, None),
        };
        let scheduler = Scheduler::start_with(
            Box::new(executor),
            Limits {
                max_batch: 4,
                max_batched_tokens: 16,
            },
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let address = listener.local_addr().expect("address");
            // Rank 0 (the router) on host 0, replica 1's driver (rank 1) on host 1.
            let run = crate::keyring::Keyring::master(
                "run-token",
                crate::keyring::LAUNCHER_HOST,
                vec![0, 1],
            );
            let replica_keys = run.for_host(1).expect("host 1");
            let router_key = run.for_host(0).expect("host 0").pair_key(1).expect("key");
            let replica =
                tokio::spawn(
                    async move { serve_remote(listener, &replica_keys, 1, scheduler).await },
                );
            // A stranger's garbage and an idle connection take no slot.
            let mut garbage = TcpStream::connect(address).await.expect("connect");
            garbage.write_all(&[0xff; 16]).await.expect("garbage");
            let _idle = TcpStream::connect(address).await.expect("connect");
            let (stream, session) = tokio::task::spawn_blocking(move || {
                let mut stream = std::net::TcpStream::connect(address).expect("connect");
                let session = crate::handshake::client(
                    &mut stream,
                    &router_key,
                    crate::handshake::Claim {
                        channel: CHANNEL,
                        client: 0,
                        server: 1,
                    },
                )
                .expect("the replica accepts the router");
                stream.set_nonblocking(true).expect("nonblocking");
                (stream, session)
            })
            .await
            .expect("join");
            let stream = TcpStream::from_std(stream).expect("tokio stream");
            let (mut reader, mut writer) = stream.into_split();
            let (mut sealer, mut opener) = session.split();

            let body = serde_json::to_vec(&ToReplica::Metrics { id: 7 }).expect("json");
            let length = (body.len() as u32).to_le_bytes();
            let tag = sealer.seal(&body);
            writer.write_all(&length).await.expect("length");
            writer.flush().await.expect("flush");
            tokio::time::sleep(METRICS_INTERVAL * 5 / 2).await;
            writer.write_all(&body).await.expect("body");
            writer.write_all(&tag).await.expect("tag");
            let answered = next_frame(&mut reader, &mut opener, |frame| match frame {
                FromReplica::MetricsNow { id, .. } => Some(id),
                _ => None,
            })
            .await
            .expect("the split request is answered");
            assert_eq!(answered, 7);

            let submit = ToReplica::Submit {
                id: 1,
                prompt_tokens: vec![0, 1, 0],
                params: Box::new(SamplingParams::default()),
                pd: None,
            };
            write_frame(&mut writer, &mut sealer, &submit)
                .await
                .expect("submit");
            let reason = next_frame(&mut reader, &mut opener, |frame| match frame {
                FromReplica::Stopped { reason } => Some(reason),
                _ => None,
            })
            .await
            .expect("the replica says why it stops");
            assert!(reason.contains("rank 3 closed its connection"), "{reason}");
            let closed = next_frame(&mut reader, &mut opener, |_| None::<()>).await;
            assert!(
                format!("{:#}", closed.expect_err("no frame is wanted")).contains("closed"),
                "the connection closes after `Stopped`"
            );
            let result = replica.await.expect("join");
            let error = format!("{:#}", result.expect_err("serve_remote fails"));
            assert!(error.contains("rank 3 closed its connection"), "{error}");
        });
    }

    fn view(in_flight: u64, matched_tokens: usize, tree_blocks: usize) -> ReplicaView {
        ReplicaView {
            in_flight,
            matched_tokens,
            tree_blocks,
        }
    }

    #[test]
    fn balanced_load_follows_the_longest_match_above_the_threshold() {
        let replicas = [view(1, 0, 10), view(2, 64, 10)];
        assert_eq!(decide(&replicas, 100), (1, RouteReason::PrefixMatch));
        // 32 of 100 tokens is under half: the least loaded.
        let replicas = [view(1, 0, 10), view(2, 32, 10)];
        assert_eq!(decide(&replicas, 100), (0, RouteReason::LeastLoaded));
        // Equal loads and no match: the smaller tree.
        let replicas = [view(0, 0, 10), view(0, 0, 3)];
        assert_eq!(decide(&replicas, 20), (1, RouteReason::LeastLoaded));
    }

    #[test]
    fn an_imbalanced_load_goes_to_the_least_loaded_whatever_it_caches() {
        let replicas = [view(5, 96, 10), view(0, 0, 10)];
        assert_eq!(decide(&replicas, 100), (1, RouteReason::Imbalanced));
        // 4 more is within the absolute threshold; 10 against 5 exceeds both thresholds,
        // 20 against 15 only the absolute one.
        let replicas = [view(4, 96, 10), view(0, 0, 10)];
        assert_eq!(decide(&replicas, 100), (0, RouteReason::PrefixMatch));
        let replicas = [view(10, 96, 10), view(5, 0, 10)];
        assert_eq!(decide(&replicas, 100), (1, RouteReason::Imbalanced));
        let replicas = [view(20, 96, 10), view(15, 0, 10)];
        assert_eq!(decide(&replicas, 100), (0, RouteReason::PrefixMatch));
    }

    #[test]
    fn trees_match_whole_blocks_from_the_start_and_forget_the_oldest() {
        let mut trees = PrefixTrees {
            trees: vec![HashMap::new(), HashMap::new()],
            clock: 0,
        };
        let prompt: Vec<u32> = (0..40).collect();
        trees.insert(1, &block_path(&prompt));
        assert_eq!(trees.matched_tokens(1, &block_path(&prompt)), 32);
        assert_eq!(trees.matched_tokens(0, &block_path(&prompt)), 0);
        let mut other = prompt.clone();
        other[20] = 999;
        assert_eq!(trees.matched_tokens(1, &block_path(&other)), 16);
        other[0] = 999;
        assert_eq!(
            trees.matched_tokens(1, &block_path(&other)),
            0,
            "a path, not a set"
        );
        for i in 0..TREE_MAX_BLOCKS as u32 {
            let prompt: Vec<u32> = (0..16).map(|t| t + 1000 * (i + 1)).collect();
            trees.insert(1, &block_path(&prompt));
        }
        assert!(trees.trees[1].len() <= TREE_MAX_BLOCKS);
        assert_eq!(
            trees.matched_tokens(1, &block_path(&prompt)),
            0,
            "the oldest went"
        );
    }
}

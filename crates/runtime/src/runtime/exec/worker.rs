//! One rank of a replica: loads its shard, joins its TP, PP and replica groups through the
//! rendezvous store, and runs steps. Only the driver (rank 0: tp 0, pp 0) decides what
//! runs: each step it broadcasts the batch (sequence ids, new tokens, sampling parameters
//! of new sequences, sequences to release) to the replica; every rank runs its stage with
//! its own KV caches (PP stages pass hidden states with send/recv, TP ranks all-reduce);
//! the last stage's tp rank 0 samples and sends the tokens to the driver. The driver is an
//! [`Executor`], so `infer generate` and the serving scheduler drive a replica exactly as
//! they drive a local engine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};

use crate::degrees::Degrees;
use crate::rendezvous::StoreClient;
use crate::runtime::collectives::bench::{AllreduceSweep, bench_all_reduce};
use crate::runtime::collectives::shm::ShmComm;
use crate::runtime::collectives::{Comm, TcpComm};
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::executor::{
    Executor, Handoff, KvSent, Sampled, StepEntry, first_step_cache, generate, sample,
};
use crate::runtime::exec::handoff::{Inbox, Outbox};
use crate::runtime::exec::kernel_executor::KernelDevice;
use crate::runtime::formats::gguf::GgufFile;
use crate::runtime::model::kv::KvCache;
use crate::runtime::model::kv::{KvPool, KvTransfer};
use crate::runtime::model::llama::{Llama, SequenceInput, StageOutput};
use crate::runtime::model::sampling::{Sampler, SamplingParams};
use crate::runtime::model::tokenizer::Tokenizer;

/// What a rank is told by its environment (set explicitly by the launcher).
#[derive(Clone, Debug)]
pub struct RankConfig {
    pub rank: u64,
    pub world_size: u64,
    /// The layout: `world_size = dp × pp × tp`, ranks ordered DP, PP, TP (TP fastest), as
    /// vLLM orders them; `ep` is 1, or `tp` (each replica's MoE experts sharded over its TP
    /// group, tokens exchanged with all-to-all).
    pub degrees: Degrees,
    /// `MASTER_ADDR:MASTER_PORT`.
    pub store_address: String,
    /// This rank's host's keys ([`crate::keyring`]).
    pub keys: crate::keyring::Keyring,
    /// The weights (`INFER_MODEL`, or random ones: `INFER_DUMMY_MODEL`); `None`: this rank
    /// runs collectives only ([`Job::AllReduce`]).
    pub model: Option<crate::runtime::model::source::ModelSource>,
    pub threads: usize,
    /// Timeout of every collective and store wait.
    pub timeout: Duration,
    /// Positions the rank's KV pool holds (`None`: no limit).
    pub kv_cache_tokens: Option<usize>,
    /// Whether the KV pool caches full blocks for prefix reuse (`INFER_PREFIX_CACHE`; only
    /// a bounded pool does). The same on every rank of a replica: the driver's steps adopt
    /// cached prefixes that every rank's pool must hold.
    pub prefix_cache: bool,
    /// Whether groups on this host all-reduce through shared memory (`INFER_SHM_DISABLE=1`
    /// turns it off, as `NCCL_SHM_DISABLE` does for NCCL).
    pub shm: bool,
    /// How the matrix products round (`INFER_NUMERICS`); the same on every rank.
    pub numerics: Numerics,
    /// Where this rank's collectives listen: its host's data-network address
    /// (`INFER_BIND_ADDR`; `127.0.0.1` when every rank is on one host).
    pub bind_addr: String,
    /// Prefill/decode disaggregation (`INFER_PD_PREFILL`): the first this many DP replicas
    /// prefill, the others decode; `None`: every replica does both.
    pub pd_prefill_replicas: Option<usize>,
    /// The global ranks on this rank's host: `RANK - LOCAL_RANK` and the next
    /// `LOCAL_WORLD_SIZE - 1` (the launcher places a host's ranks consecutively). Only
    /// groups inside it may use shared memory.
    pub host_ranks: std::ops::Range<u64>,
    /// Where the forward pass runs: `None`, the CPU engine; a [`KernelDevice`] for
    /// `--device cuda` ranks (TP, PP, EP, DP and prefill/decode disaggregation).
    pub device: Option<KernelDevice>,
    /// The rank's `CUDA_VISIBLE_DEVICES` as its launcher set it (said in its first line).
    pub cuda_visible_devices: Option<String>,
    /// The tests' injected stall ([`crate::runtime::exec::rank_env::TestFault`]): this rank
    /// stops making progress at this step (counted from 1).
    pub stall_at_step: Option<u64>,
    /// Which start of its DP replica this rank is (0: the first): its groups are named
    /// for it, so that a replica restarted alone never reads its predecessor's addresses.
    pub incarnation: usize,
}

/// A device rank's KV cache when the launcher gives none (`infer generate`): the model's
/// context, at most this many positions.
pub(crate) const DEVICE_DEFAULT_KV_TOKENS: usize = 32_768;

/// The job the launcher publishes under `job`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Job {
    /// Generate once from `prompt_tokens`; the driver stores the [`Generation`](crate::runtime::exec::engine::Generation) under `result`.
    Generate {
        prompt_tokens: Vec<u32>,
        params: SamplingParams,
    },
    /// Serve until stopped: the driver hands itself to the serving callback of [`run_rank`].
    Serve,
    /// Time all-reduce over the replica's ranks for every size up to `max_bytes`, then one
    /// plain TCP stream from the last rank to rank 0 (256 MiB); rank 0 stores an
    /// [`AllreduceBench`](crate::runtime::collectives::bench::AllreduceBench) under `result`.
    AllReduce { max_bytes: usize },
}

/// What the driver broadcasts to its replica. The driver serializes borrowed slices; the
/// followers deserialize owned ones.
#[derive(Serialize, Deserialize)]
enum Message<'a> {
    /// Run these entries (after dropping the released sequences).
    Step {
        entries: std::borrow::Cow<'a, [StepEntry]>,
        release: std::borrow::Cow<'a, [u64]>,
    },
    /// Nothing to run; the driver is alive.
    Idle,
    /// The job is over; exit.
    Done,
}

/// The first layer and layer count of pipeline stage `stage` of `pp` over `n_layers`: an
/// even split, the first `n_layers % pp` stages one layer longer (as `infer plan` reports).
pub fn stage_layers(n_layers: usize, pp: usize, stage: usize) -> (usize, usize) {
    let (base, extra) = (n_layers / pp, n_layers % pp);
    let first = stage * base + stage.min(extra);
    (first, base + usize::from(stage < extra))
}

/// Runs one rank until its job is over. Rank 0 (the driver) runs a [`Job::Generate`] itself
/// and stores the [`Generation`](crate::runtime::exec::engine::Generation) as JSON under `result`; for [`Job::Serve`] it calls `serve`
/// with its [`ReplicaDriver`] and the store, and the job lasts as long as `serve` does. The
/// other ranks follow the driver's steps.
///
/// Errors: a shard that cannot be built, a peer that disappears or times out (named by the
/// collectives), a store that cannot be reached, an error of `serve`.
pub fn run_rank(
    config: &RankConfig,
    log: &mut dyn FnMut(&str),
    serve: &mut dyn FnMut(ReplicaDriver, &mut StoreClient) -> Result<()>,
) -> Result<()> {
    let started = std::time::Instant::now();
    let mut store = StoreClient::connect(
        &config.store_address,
        &config.keys,
        Some(config.rank),
        config.timeout,
    )?;
    let _heartbeat = store.start_heartbeat(Duration::from_millis(500))?;
    // What this rank's collectives wait for, published for the stall diagnosis.
    let _waits = crate::runtime::collectives::waits::start_reporter(
        &config.store_address,
        &config.keys,
        config.rank,
        config.timeout,
    )?;
    let Some(model) = &config.model else {
        return run_collectives_only(config, &mut store, started, log);
    };
    let (mut member, tokenizer) = Member::join(config, model, &mut store)?;
    let info = member.shard.shard;
    for line in std::mem::take(&mut member.device_lines) {
        log(&line);
    }
    log(&format!(
        "dp rank {}/{}, tp rank {}/{}, pp rank {}/{}: layers {}..{}, {:.1} MiB of weights, loaded and connected in {:.2} s{}",
        member.dp_rank,
        config.degrees.dp,
        info.tp_rank,
        info.tp,
        member.pp_rank,
        member.pp,
        info.first_layer,
        info.first_layer + member.shard.layers.len(),
        member.shard.weight_bytes() as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64(),
        match &member.pd {
            PdLink::None => String::new(),
            PdLink::Decode(inbox) => format!("; decode replica, KV inbox on {}", inbox.address()),
            PdLink::Prefill { peers, local, .. } => format!(
                "; prefill replica, KV to decode replicas {}",
                describe_kv_routes(peers, local)
            ),
        }
    ));
    store.barrier("loaded", config.world_size, config.timeout)?;
    let job: Job =
        serde_json::from_slice(&store.get("job", config.timeout)?).context("malformed job")?;
    if let Job::AllReduce { max_bytes } = job {
        return all_reduce_job(&mut member.replica, config, &mut store, max_bytes);
    }
    if member.rank != 0 {
        return member.follow();
    }
    let mut driver = ReplicaDriver { member, tokenizer };
    match job {
        Job::Generate {
            prompt_tokens,
            params,
        } => {
            let generation = generate(&mut driver, &prompt_tokens, &params, &mut |_| {})?;
            driver.finish()?;
            store.set(
                crate::rendezvous::RESULT_KEY,
                &serde_json::to_vec(&generation)?,
            )?;
            Ok(())
        }
        Job::Serve => serve(driver, &mut store),
        Job::AllReduce { .. } => unreachable!("every rank took the benchmark above"),
    }
}

/// How a prefill rank's KV reaches each decode replica: "1 through shared memory, 2 over
/// TCP to 10.0.0.2:4711".
fn describe_kv_routes(peers: &HashMap<usize, String>, local: &[usize]) -> String {
    let mut replicas: Vec<_> = peers.iter().collect();
    replicas.sort();
    replicas
        .into_iter()
        .map(|(decode, address)| {
            if local.contains(decode) {
                format!("{decode} through shared memory")
            } else {
                format!("{decode} over TCP to {address}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Connects this rank to `group` of `members` (global ranks). Groups inside this host
/// all-reduce, send and receive through shared memory; groups spanning hosts use TCP over
/// the data network (as NCCL uses SHM inside a node, NET across).
///
/// Errors: a member that does not join within the timeout, a store that cannot be reached,
/// the members failing to agree on the shared segment.
fn connect_group(
    config: &RankConfig,
    store: &mut StoreClient,
    group: &str,
    members: &[u64],
) -> Result<ShmComm> {
    let on_this_host = members.iter().all(|m| config.host_ranks.contains(m));
    let tcp = TcpComm::connect(
        store,
        group,
        members,
        config.rank,
        &config.bind_addr,
        config.timeout,
    )?;
    Ok(match (config.shm, on_this_host) {
        (true, true) => {
            let mut comm = ShmComm::new(tcp)?;
            comm.set_ranks_on_host((config.host_ranks.end - config.host_ranks.start) as usize);
            comm
        }
        (false, _) => ShmComm::tcp_only(tcp, &format!("{}=1", crate::envvars::SHM_DISABLE)),
        (true, false) => ShmComm::tcp_only(tcp, "the group spans hosts"),
    })
}

/// A rank with no model: joins one group of every rank, then runs the launcher's
/// [`Job::AllReduce`] over it (rank 0 stores the
/// [`AllreduceBench`](crate::runtime::collectives::bench::AllreduceBench) under `result`).
///
/// Errors: any other job (it needs weights), the group or the store failing.
fn run_collectives_only(
    config: &RankConfig,
    store: &mut StoreClient,
    started: std::time::Instant,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let members: Vec<u64> = (0..config.world_size).collect();
    let mut group = connect_group(config, store, "collectives", &members)?;
    log(&format!(
        "rank {}/{}: no model, collectives only ({}), connected in {:.2} s",
        config.rank,
        config.world_size,
        group.transport(),
        started.elapsed().as_secs_f64()
    ));
    store.barrier("loaded", config.world_size, config.timeout)?;
    let job: Job =
        serde_json::from_slice(&store.get("job", config.timeout)?).context("malformed job")?;
    let Job::AllReduce { max_bytes } = job else {
        bail!(
            "this rank was started without a model (`{}` unset): it can only run collectives",
            crate::envvars::MODEL
        );
    };
    all_reduce_job(&mut group, config, store, max_bytes)
}

/// Runs [`bench_all_reduce`] over `group`, the stream from the last rank to rank 0; rank 0
/// stores its [`AllreduceBench`](crate::runtime::collectives::bench::AllreduceBench) under `result`.
///
/// Errors: a collective, the stream or the store failing.
fn all_reduce_job(
    group: &mut ShmComm,
    config: &RankConfig,
    store: &mut StoreClient,
    max_bytes: usize,
) -> Result<()> {
    let sweep = AllreduceSweep {
        max_bytes,
        tcp_first: false,
        stream_from: config.world_size - 1,
        bind_addr: &config.bind_addr,
        timeout: config.timeout,
    };
    if let Some(report) = bench_all_reduce(group, store, config.rank, &sweep)? {
        store.set(crate::rendezvous::RESULT_KEY, &serde_json::to_vec(&report)?)?;
    }
    Ok(())
}

/// How long a decode rank waits for a sequence's KV. Its prefill ranks handed it to their
/// kernels in the step that sampled the first token, before the router submitted the
/// sequence here, so it is in flight (milliseconds, even for long prompts across hosts) or
/// lost. The wait holds up the replica's step, so it is short.
const IMPORT_WAIT: Duration = Duration::from_secs(5);

/// Layers a prefill rank sends together while its forward pass goes on: each group's KV
/// leaves as soon as its last layer stored it. `infer bench serve --prefill 1 --decode 1`
/// on 2 cores (SmolLM2's 30 layers, chat, 16 streams, runs of this session): the whole
/// shard sent after the step 257–259 tokens/s, one part per layer 236–249, groups of 8
/// 250–252 — fewer headers, copies and wake-ups, while all but the last group still
/// overlap. (On 2 cores the sending thread takes cycles from the forward pass, so the
/// overlap cannot pay here; it is for hosts whose forward pass runs elsewhere, a GPU.)
const LAYERS_PER_PART: usize = 8;

/// A rank's end of prefill/decode disaggregation.
enum PdLink {
    /// Colocated serving: every replica prefills and decodes.
    None,
    /// A prefill replica's rank: sends its shard's KV to the same rank of each decode
    /// replica (their inbox addresses by DP rank).
    Prefill {
        outbox: Outbox,
        peers: HashMap<usize, String>,
        /// The decode replicas (DP ranks) whose peer rank runs on this host.
        local: Vec<usize>,
    },
    /// A decode replica's rank: receives its shard's KV.
    Decode(Inbox),
}

/// One rank's part of a replica: its shard, its groups, and the per-sequence state it keeps
/// between steps (KV caches; samplers on the sampling rank).
pub struct Member {
    /// Position in the replica (0: the driver).
    rank: usize,
    global_rank: usize,
    /// Which data-parallel replica this rank belongs to.
    dp_rank: usize,
    tp: usize,
    pp_rank: usize,
    pp: usize,
    shard: Llama,
    /// The TP group (`None` once a device executor took it).
    tp_comm: Option<ShmComm>,
    /// `--device cuda`: the shard on its device, running every step (the CPU shard above then
    /// only describes it).
    device: Option<Box<dyn Executor>>,
    /// What a device rank says first (its device and `CUDA_VISIBLE_DEVICES`, then how its
    /// all-reduces travel: a line starting "warning: " is a warning), taken by [`run_rank`].
    device_lines: Vec<String>,
    /// The pipeline (`None` once a device executor took it).
    pp_comm: Option<ShmComm>,
    /// Every rank of the replica; the driver is its rank 0.
    replica: ShmComm,
    /// The TP group again, for the CPU engine's MoE all-to-all, when experts are sharded
    /// (device ranks sum their experts' outputs over the TP group instead).
    ep_comm: Option<ShmComm>,
    caches: HashMap<u64, KvCache>,
    /// This rank's end of the KV hand-off between prefill and decode replicas.
    pd: PdLink,
    /// Only on the sampling rank (last stage, tp rank 0).
    samplers: HashMap<u64, Sampler>,
    /// Prefill replicas: prompt positions of each sequence already queued for its decode
    /// replica.
    handed: HashMap<u64, usize>,
    /// Sequences of the last step whose KV transfer failed on some rank of the replica, with
    /// why (the same set on every rank; the driver reports it).
    transfer_failures: Vec<(u64, String)>,
    /// Steps run so far, and the step at which the tests' injected fault stalls this rank.
    steps: u64,
    stall_at_step: Option<u64>,
    pool: rayon::ThreadPool,
    /// The forward pass's parallel loops ([`crate::runtime::cpu::team`]), as many threads as `pool`.
    team: crate::runtime::cpu::team::Team,
    timeout: Duration,
}

/// Loads the whole model (`model`: a GGUF file, or dummy weights every rank draws alike)
/// and keeps this rank's shard: its pipeline stage's layers, its TP slice, its experts under
/// expert parallelism, the rank's numerics, and (CPU ranks) packed weights.
///
/// Errors: the file, a shard the model cannot be cut into, an `ep` other than 1 or `tp`.
fn load_shard(
    config: &RankConfig,
    model: &crate::runtime::model::source::ModelSource,
    at: &Position,
    pool: &rayon::ThreadPool,
) -> Result<(Llama, Tokenizer)> {
    let (tp, pp, global_rank) = (config.degrees.tp, config.degrees.pp, at.global_rank);
    let (whole, tokenizer) = match model {
        crate::runtime::model::source::ModelSource::File(path) => {
            let file = Arc::new(GgufFile::open(path)?);
            (
                Llama::from_gguf(&file)?,
                Tokenizer::from_gguf(&file.header)?,
            )
        }
        // Every rank draws the same whole model, then keeps its shard.
        dummy => pool.install(|| dummy.load())?,
    };
    let (first_layer, n_layers) = stage_layers(whole.layers.len(), pp, at.pp_rank);
    let mut shard = whole
        .shard(at.tp_rank, tp, first_layer, n_layers)
        .with_context(|| format!("rank {global_rank}: building its shard"))?;
    shard.set_kv_capacity(config.kv_cache_tokens);
    shard.kv_pool().set_prefix_cache(config.prefix_cache);
    match config.degrees.ep {
        1 => {}
        ep if ep == tp => shard
            .shard_experts(at.tp_rank, tp)
            .with_context(|| format!("rank {global_rank}: sharding experts"))?,
        ep => {
            bail!("ep {ep} must be 1 or equal tp ({tp}): experts are sharded over the TP group")
        }
    }
    drop(whole);
    shard.set_numerics(config.numerics);
    if config.device.is_none() {
        pool.install(|| shard.pack_weights());
    }
    Ok((shard, tokenizer))
}

/// Connects the rank's TP, PP and replica groups (and the CPU engine's EP group). Groups
/// inside this host all-reduce through shared memory; groups spanning hosts use TCP over the
/// data network (as NCCL uses SHM inside a node, NET across).
///
/// Errors: a peer that does not join within the timeout, the store.
fn connect_groups(config: &RankConfig, store: &mut StoreClient, at: &Position) -> Result<Groups> {
    let (tp, pp, base, dp_rank) = (config.degrees.tp, config.degrees.pp, at.base, at.dp_rank);
    let tp_members: Vec<u64> = (0..tp)
        .map(|t| base + (at.pp_rank * tp + t) as u64)
        .collect();
    let pp_members: Vec<u64> = (0..pp)
        .map(|s| base + (s * tp + at.tp_rank) as u64)
        .collect();
    let all: Vec<u64> = (0..(tp * pp) as u64).map(|r| base + r).collect();
    // `dp1`, or `dp1.3` for the replica's start 3 (restarted alone, the others serving).
    let replica = match config.incarnation {
        0 => format!("dp{dp_rank}"),
        k => format!("dp{dp_rank}.{k}"),
    };
    let mut connect = |group: &str, members: &[u64]| connect_group(config, store, group, members);
    Ok(Groups {
        tp: connect(&format!("{replica}/tp/{}", at.pp_rank), &tp_members)?,
        pp: connect(&format!("{replica}/pp/{}", at.tp_rank), &pp_members)?,
        replica: connect(&format!("{replica}/replica"), &all)?,
        // The CPU engine's MoE all-to-all; device ranks sum over the TP group instead.
        ep: if config.degrees.ep > 1 && config.device.is_none() {
            Some(connect(
                &format!("{replica}/ep/{}", at.pp_rank),
                &tp_members,
            )?)
        } else {
            None
        },
    })
}

/// A `--device cuda` rank's executor: its shard on `kernels` with its TP and PP groups
/// (taken from `comms` when they have more than one member), and the lines the rank says
/// first (its device, how its collectives travel, the experts it holds).
///
/// Errors: the device's (no driver, no NVRTC, memory), naming the rank.
fn device_executor(
    config: &RankConfig,
    kernels: &KernelDevice,
    shard: &Llama,
    tokenizer: &Tokenizer,
    comms: (&mut Option<ShmComm>, &mut Option<ShmComm>),
    global_rank: usize,
) -> Result<(Box<dyn Executor>, Vec<String>)> {
    let (tp, pp) = (config.degrees.tp, config.degrees.pp);
    let groups = crate::runtime::exec::kernel_executor::Groups {
        tp: comms
            .0
            .take_if(|_| tp > 1)
            .map(|c| Box::new(c) as Box<dyn Comm>),
        pp: comms
            .1
            .take_if(|_| pp > 1)
            .map(|c| Box::new(c) as Box<dyn Comm>),
        host_key: config.host_ranks.start,
    };
    let loaded = crate::runtime::exec::kernel_executor::load_executor(
        kernels,
        shard,
        config
            .kv_cache_tokens
            .unwrap_or(DEVICE_DEFAULT_KV_TOKENS)
            .min(shard.config.max_context_tokens.max(1) + 16),
        tokenizer.clone(),
        groups,
    )
    .with_context(|| format!("rank {global_rank}: putting its shard on the device"))?;
    loaded
        .executor
        .kv_pool()
        .set_prefix_cache(config.prefix_cache);
    let mut lines = vec![format!(
        "rank {global_rank} on {}, CUDA_VISIBLE_DEVICES={}",
        loaded.device,
        config.cuda_visible_devices.as_deref().unwrap_or("unset"),
    )];
    lines.extend(loaded.notes);
    if let Some(moe) = shard.layers.iter().find_map(|l| l.moe.as_ref())
        && config.degrees.ep > 1
    {
        let held: Vec<usize> = (0..moe.experts.len())
            .filter(|&e| moe.experts[e].is_some())
            .collect();
        lines.push(format!(
            "experts {}-{} of {} on this rank (expert parallelism): the TP group sums their outputs",
            held.first().copied().unwrap_or(0),
            held.last().copied().unwrap_or(0),
            moe.experts.len()
        ));
    }
    Ok((loaded.executor, lines))
}

/// The rank's end of prefill/decode disaggregation: a decode replica's rank binds its
/// inbox and publishes it; a prefill replica's rank reads its peers' (the same position in
/// every decode replica) and marks those on this host for the shared ring.
///
/// Errors: the inbox cannot bind; a peer that does not publish within the timeout.
fn pd_link(config: &RankConfig, store: &mut StoreClient, at: &Position) -> Result<PdLink> {
    let (tp, pp, rank, dp_rank) = (config.degrees.tp, config.degrees.pp, at.rank, at.dp_rank);
    // Decode ranks publish their inbox before prefill ranks wait for them.
    Ok(match config.pd_prefill_replicas {
        None => PdLink::None,
        Some(prefill) if dp_rank >= prefill => {
            // The same position of every prefill replica sends this rank its KV.
            let senders: Vec<u64> = (0..prefill).map(|p| (p * tp * pp + rank) as u64).collect();
            let inbox = Inbox::bind(&config.bind_addr, &config.keys, config.rank, &senders)?;
            store.set(
                &crate::rendezvous::rank_key(config.rank, &format!("pd/{dp_rank}")),
                inbox.address().to_string().as_bytes(),
            )?;
            PdLink::Decode(inbox)
        }
        Some(prefill) => {
            let mut peers = HashMap::new();
            let mut outbox = Outbox::new(&config.keys, config.rank)?;
            let mut local = Vec::new();
            for decode in prefill..config.degrees.dp {
                let decode_rank = (decode * tp * pp + rank) as u64;
                let address = store.get(
                    &crate::rendezvous::rank_key(decode_rank, &format!("pd/{decode}")),
                    config.timeout,
                )?;
                let address = String::from_utf8_lossy(&address).into_owned();
                outbox.add_inbox(&address, decode_rank);
                // The launcher's placement says which decode ranks share this host: their
                // KV goes through a shared ring, as the groups inside a host all-reduce
                // through shared memory.
                if config.shm && config.host_ranks.contains(&decode_rank) {
                    outbox.on_this_host(&address);
                    local.push(decode);
                }
                peers.insert(decode, address);
            }
            PdLink::Prefill {
                outbox,
                peers,
                local,
            }
        }
    })
}

/// Where a rank sits: its replica, and its place inside it (vLLM's order: DP, PP, TP).
struct Position {
    global_rank: usize,
    /// Position in the replica (0: the driver).
    rank: usize,
    dp_rank: usize,
    tp_rank: usize,
    pp_rank: usize,
    /// The replica's first global rank.
    base: u64,
}

impl Position {
    /// `config`'s rank placed in its replica.
    ///
    /// Errors: `WORLD_SIZE` is not `dp × pp × tp`.
    fn of(config: &RankConfig) -> Result<Position> {
        let (tp, pp, dp) = (config.degrees.tp, config.degrees.pp, config.degrees.dp);
        let global_rank = config.rank as usize;
        if dp * tp * pp != config.world_size as usize {
            bail!(
                "WORLD_SIZE={} but dp×pp×tp = {}",
                config.world_size,
                dp * tp * pp
            );
        }
        let (rank, dp_rank) = (global_rank % (tp * pp), global_rank / (tp * pp));
        Ok(Position {
            global_rank,
            rank,
            dp_rank,
            tp_rank: rank % tp,
            pp_rank: rank / tp,
            base: (dp_rank * tp * pp) as u64,
        })
    }
}

/// A rank's groups, connected through the store.
struct Groups {
    tp: ShmComm,
    pp: ShmComm,
    replica: ShmComm,
    /// The CPU engine's MoE all-to-all (the TP group again), when experts are sharded.
    ep: Option<ShmComm>,
}

impl Member {
    /// Loads this rank's shard and connects its TP, PP and replica groups.
    fn join(
        config: &RankConfig,
        model: &crate::runtime::model::source::ModelSource,
        store: &mut StoreClient,
    ) -> Result<(Member, Tokenizer)> {
        let at = Position::of(config)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads)
            .build()
            .map_err(|e| anyhow!("thread pool: {e}"))?;
        let (shard, tokenizer) = load_shard(config, model, &at, &pool)?;
        let groups = connect_groups(config, store, &at)?;
        let (mut tp_comm, mut pp_comm) = (Some(groups.tp), Some(groups.pp));
        let (device, device_lines) = match &config.device {
            None => (None, Vec::new()),
            Some(kernels) => {
                let (executor, lines) = device_executor(
                    config,
                    kernels,
                    &shard,
                    &tokenizer,
                    (&mut tp_comm, &mut pp_comm),
                    at.global_rank,
                )?;
                (Some(executor), lines)
            }
        };
        let pd = pd_link(config, store, &at)?;
        Ok((
            Member {
                rank: at.rank,
                global_rank: at.global_rank,
                dp_rank: at.dp_rank,
                tp: config.degrees.tp,
                pp_rank: at.pp_rank,
                pp: config.degrees.pp,
                shard,
                tp_comm,
                device,
                device_lines,
                pp_comm,
                replica: groups.replica,
                ep_comm: groups.ep,
                caches: HashMap::new(),
                pd,
                samplers: HashMap::new(),
                handed: HashMap::new(),
                transfer_failures: Vec::new(),
                steps: 0,
                stall_at_step: config.stall_at_step,
                team: crate::runtime::cpu::team::Team::new(pool.current_num_threads())
                    .map_err(|e| anyhow!("thread team: {e}"))?,
                pool,
                timeout: config.timeout,
            },
            tokenizer,
        ))
    }

    /// The pipeline group of a CPU rank. Errors: a device executor holds it.
    fn pipeline(&mut self) -> Result<&mut ShmComm> {
        self.pp_comm
            .as_mut()
            .context("the pipeline group belongs to the device executor")
    }

    /// The rank that samples: the last stage's tp rank 0.
    fn sampler_rank(&self) -> usize {
        (self.pp - 1) * self.tp
    }

    /// Runs this rank's stage of one step; the sampling rank returns the sampled tokens.
    fn run_step(&mut self, entries: &[StepEntry], release: &[u64]) -> Result<Vec<Option<Sampled>>> {
        self.steps += 1;
        if self.stall_at_step == Some(self.steps) {
            // The tests' injected stall: no progress from here, the process (and its
            // heartbeats) alive, until the launcher stops the gang.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        for seq in release {
            self.caches.remove(seq);
            self.samplers.remove(seq);
            // (Recomputed after a preemption, its prompt is sent again from position 0.)
            self.handed.remove(seq);
        }
        let is_sampler = self.rank == self.sampler_rank();
        self.transfer_failures.clear();
        // Imports whose KV did not arrive here, with why.
        let mut missing: HashMap<u64, String> = HashMap::new();
        for entry in entries {
            if self.device.is_some() {
                // The device executor keeps its sequences; an import's KV goes into its
                // cache before the step.
                if let (Some(_), Some(transfer)) = (&entry.params, entry.import)
                    && let Err(error) = self.import_to_device(entry, transfer)
                {
                    missing.insert(entry.seq, format!("{error:#}"));
                }
                continue;
            }
            if let Some(params) = &entry.params {
                let cache = match entry.import {
                    Some(transfer) => match self.import(transfer, &entry.import_prompt) {
                        Ok(cache) => cache,
                        Err(error) => {
                            missing.insert(entry.seq, format!("{error:#}"));
                            continue;
                        }
                    },
                    None => first_step_cache(self.shard.kv_pool(), entry)
                        .with_context(|| format!("rank {}", self.global_rank))?,
                };
                self.caches.insert(entry.seq, cache);
                if is_sampler {
                    let sampler = entry.new_sampler(params);
                    self.samplers.insert(entry.seq, sampler);
                }
            } else if !self.caches.contains_key(&entry.seq) {
                bail!(
                    "rank {}: sequence {} is unknown",
                    self.global_rank,
                    entry.seq
                );
            }
        }
        // Every rank drops the imports that failed on any rank of the replica: the forward
        // pass's collectives need the same batch everywhere.
        let imports: Vec<u64> = entries
            .iter()
            .filter(|e| e.params.is_some() && e.import.is_some())
            .map(|e| e.seq)
            .collect();
        let failed = self.agree_on_failures(&imports, &missing)?;
        for seq in &failed {
            self.caches.remove(seq);
            self.samplers.remove(seq);
        }
        let all = entries;
        let live: Vec<StepEntry>;
        let entries: &[StepEntry] = if failed.is_empty() {
            all
        } else {
            live = all
                .iter()
                .filter(|e| !failed.contains(&e.seq))
                .cloned()
                .collect();
            &live
        };
        let mut sampled = if self.device.is_some() {
            self.run_on_device(entries, release, &failed)?
        } else {
            self.run_live(entries)?
        };
        // Hand-offs after the stage's own work (its hidden state already went on), so no
        // stage waits on them; a failed send fails its sequence, not the replica.
        // The step's KV went out layer by layer during the forward pass; the step that
        // samples the first token waits until all of its sequence's parts went.
        let (mut finals, mut unsent) = (Vec::new(), HashMap::new());
        for entry in entries {
            let Some(handoff) = entry.handoff else {
                continue;
            };
            if entry.sample {
                finals.push(entry.seq);
                if let Err(error) = self.finish_handoff(entry.seq, handoff) {
                    unsent.insert(entry.seq, format!("{error:#}"));
                }
            }
        }
        self.agree_on_failures(&finals, &unsent)?;
        if failed.is_empty() || !is_sampler {
            return Ok(sampled);
        }
        // The sampling rank answers for every entry of the driver's step (even when none
        // ran): back in its order, `None` for the entries that did not run.
        let mut out = Vec::with_capacity(all.len());
        let mut ran = sampled.drain(..);
        for entry in all {
            out.push(if failed.contains(&entry.seq) {
                None
            } else {
                ran.next().flatten()
            });
        }
        Ok(out)
    }

    /// Which of `seqs` failed on any rank of the replica (`local`: those that failed here,
    /// with why), agreed through the replica group; they are added to the step's transfer
    /// failures with a reason. Nothing is exchanged when `seqs` is empty (every rank knows
    /// that from the step). Errors: a lost peer.
    fn agree_on_failures(
        &mut self,
        seqs: &[u64],
        local: &HashMap<u64, String>,
    ) -> Result<Vec<u64>> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut flags: Vec<f32> = seqs
            .iter()
            .map(|s| if local.contains_key(s) { 1.0 } else { 0.0 })
            .collect();
        self.replica.all_reduce_sum(&mut flags)?;
        let size = self.replica.size();
        let mut failed = Vec::new();
        for (seq, ranks) in seqs.iter().zip(flags) {
            if ranks == 0.0 {
                continue;
            }
            let why = match local.get(seq) {
                Some(own) => own.clone(),
                None => "(on another rank of the replica)".to_string(),
            };
            self.transfer_failures.push((
                *seq,
                format!(
                    "the KV transfer between the prefill and decode replicas failed on {ranks} of the replica's {size} ranks: {why}"
                ),
            ));
            failed.push(*seq);
        }
        Ok(failed)
    }

    /// Runs `entries` on the device executor, which first drops `release` and `failed`
    /// (imports that failed on some rank), then queues the KV each hand-off's step stored
    /// for its decode replica: after the step, every layer at once (the device's forward pass
    /// runs ahead of the host, so its KV does not stream out layer by layer as a CPU
    /// rank's does).
    ///
    /// Errors: the step's, an export's, a hand-off to a replica that does not decode.
    fn run_on_device(
        &mut self,
        entries: &[StepEntry],
        release: &[u64],
        failed: &[u64],
    ) -> Result<Vec<Option<Sampled>>> {
        let global_rank = self.global_rank;
        let mut streams = Vec::new();
        for entry in entries {
            if let Some(handoff) = entry.handoff {
                streams.push((entry.seq, self.inbox_address(handoff)?, handoff.transfer));
            }
        }
        let dropped: Vec<u64> = release.iter().chain(failed).copied().collect();
        let device = self
            .device
            .as_mut()
            .context("a device step on a rank without a device")?;
        // Every rank runs the step on its shard; the ledger, prefix cache and samplers
        // evolve identically on each, and the driver's answer is the replica's.
        let sampled = device
            .step(entries, &dropped)
            .with_context(|| format!("rank {global_rank}"))?;
        if let PdLink::Prefill { outbox, .. } = &mut self.pd {
            for (seq, address, transfer) in streams {
                let from = self.handed.get(&seq).copied().unwrap_or(0);
                let part = device
                    .export_kv(seq, from)
                    .with_context(|| format!("rank {global_rank}"))?;
                if let Some(part) = part {
                    self.handed
                        .insert(seq, part.first_position + part.tokens.len());
                    outbox.send(&address, transfer, part);
                }
            }
        }
        Ok(sampled)
    }

    /// Runs the forward pass of `entries` (every one known to this rank) and samples.
    fn run_live(&mut self, entries: &[StepEntry]) -> Result<Vec<Option<Sampled>>> {
        let is_sampler = self.rank == self.sampler_rank();
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let streams = self.open_streams(entries)?;
        let pp_rank = self.pp_rank;
        let hidden_in = if pp_rank > 0 {
            Some(bytes_to_f32(&self.pipeline()?.recv(pp_rank - 1)?))
        } else {
            None
        };
        let mut caches: Vec<KvCache> = entries
            .iter()
            .map(|e| self.caches.remove(&e.seq).expect("checked above"))
            .collect();
        let output = self.forward_sending_kv(entries, &mut caches, hidden_in.as_deref(), &streams);
        for (entry, cache) in entries.iter().zip(caches) {
            if entry.handoff.is_some() {
                self.handed.insert(entry.seq, cache.n_tokens);
            }
            self.caches.insert(entry.seq, cache);
        }
        match output? {
            StageOutput::Hidden(hidden) => {
                self.pipeline()?
                    .send(pp_rank + 1, bytemuck::cast_slice(&hidden))?;
                Ok(Vec::new())
            }
            StageOutput::Logits(logits) if is_sampler => entries
                .iter()
                .zip(&logits)
                .map(|(entry, logits)| {
                    if !entry.sample {
                        return Ok(None);
                    }
                    let sampler = self.samplers.get_mut(&entry.seq).ok_or_else(|| {
                        anyhow!(
                            "rank {}: no sampler for sequence {}",
                            self.global_rank,
                            entry.seq
                        )
                    })?;
                    Ok(Some(sample(sampler, logits)))
                })
                .collect(),
            StageOutput::Logits(_) => Ok(Vec::new()),
        }
    }

    /// Prefill replicas: for each entry handed to a decode replica, its peer's inbox address
    /// and transfer id, after sending what is stored but not yet sent (a prefix the prefix
    /// cache supplied); `None` for the other entries.
    ///
    /// Errors: an unknown decode replica; a failed send.
    fn open_streams(&mut self, entries: &[StepEntry]) -> Result<Vec<Option<(String, u64)>>> {
        let mut streams = Vec::with_capacity(entries.len());
        for entry in entries {
            streams.push(match entry.handoff {
                Some(handoff) => {
                    let address = self.inbox_address(handoff)?;
                    self.send_unsent(entry.seq, &address, handoff.transfer)?;
                    Some((address, handoff.transfer))
                }
                None => None,
            });
        }
        Ok(streams)
    }

    /// This shard's forward pass over `entries` (their `caches` in the same order), on the
    /// rank's pool and team; on a prefill replica each group of [`LAYERS_PER_PART`] layers'
    /// new KV goes to its decode peer (`streams`) as soon as the pass has stored it, while
    /// the next layers compute.
    ///
    /// Errors: the forward pass's; a part that cannot be exported.
    fn forward_sending_kv(
        &mut self,
        entries: &[StepEntry],
        caches: &mut [KvCache],
        hidden_in: Option<&[f32]>,
        streams: &[Option<(String, u64)>],
    ) -> Result<StageOutput> {
        let mut batch: Vec<SequenceInput<'_>> = entries
            .iter()
            .zip(caches.iter_mut())
            .map(|(entry, cache)| SequenceInput {
                tokens: &entry.tokens,
                cache,
                all_logits: false,
            })
            .collect();
        let tp = self.tp;
        let comm: Option<&mut dyn Comm> = self
            .tp_comm
            .as_mut()
            .filter(|_| tp > 1)
            .map(|c| c as &mut dyn Comm);
        let ep: Option<&mut dyn Comm> = self.ep_comm.as_mut().map(|c| c as &mut dyn Comm);
        let mut outbox = match &mut self.pd {
            PdLink::Prefill { outbox, .. } => Some(outbox),
            _ => None,
        };
        let mut export_error = None;
        let (n_layers, mut first_unsent) = (self.shard.layers.len(), 0);
        let mut stored = |layer: usize, batch: &[SequenceInput<'_>]| {
            let Some(outbox) = outbox.as_mut() else {
                return;
            };
            if !(layer + 1).is_multiple_of(LAYERS_PER_PART) && layer + 1 != n_layers {
                return;
            }
            let layers = first_unsent..layer + 1;
            first_unsent = layer + 1;
            for (stream, sequence) in streams.iter().zip(batch) {
                let Some((address, transfer)) = stream else {
                    continue;
                };
                match sequence
                    .cache
                    .export_pending(layers.clone(), sequence.tokens)
                {
                    Ok(part) => outbox.send(address, *transfer, part),
                    Err(error) => {
                        export_error.get_or_insert(error);
                    }
                }
            }
        };
        let shard = &self.shard;
        let team = &self.team;
        let output = self.pool.install(|| {
            team.enter(|| {
                shard.forward_stage_observed(hidden_in, &mut batch, comm, ep, &mut stored)
            })
        });
        match export_error {
            Some(error) => Err(error),
            None => output,
        }
    }

    /// The KV cache of a sequence prefilled elsewhere: this shard's part of transfer
    /// `transfer`, from the inbox. Errors: not a decode replica, the parts do not arrive
    /// within the timeout, a transfer of another shape.
    fn import(&mut self, transfer: u64, prompt: &[u32]) -> Result<KvCache> {
        let parts = self.take_parts(transfer, prompt)?;
        let mut cache = self.shard.new_cache();
        for part in &parts {
            cache.import(part)?;
        }
        cache.finish_import();
        Ok(cache)
    }

    /// This shard's parts of transfer `transfer`, from the inbox, once they cover every layer
    /// and position, checked to be `prompt`'s. Errors: not a decode replica, the parts do
    /// not arrive within the timeout, parts of another prompt.
    fn take_parts(&self, transfer: u64, prompt: &[u32]) -> Result<Vec<KvTransfer>> {
        let PdLink::Decode(inbox) = &self.pd else {
            bail!(
                "rank {}: a KV import on a replica that is not a decode replica",
                self.global_rank
            );
        };
        inbox
            .take(
                transfer,
                self.shard.layers.len(),
                self.timeout.min(IMPORT_WAIT),
            )
            .and_then(|parts| {
                crate::runtime::exec::handoff::check_prompt(&parts, prompt)?;
                Ok(parts)
            })
            .with_context(|| format!("rank {}", self.global_rank))
    }

    /// Starts sequence `entry.seq` on the device executor from this shard's parts of
    /// transfer `transfer`. Errors: those of [`Member::take_parts`], the device's import.
    fn import_to_device(&mut self, entry: &StepEntry, transfer: u64) -> Result<()> {
        let parts = self.take_parts(transfer, &entry.import_prompt)?;
        let global_rank = self.global_rank;
        self.device
            .as_mut()
            .context("a device import on a rank without a device")?
            .import_kv(entry, &parts)
            .with_context(|| format!("rank {global_rank}"))
    }

    /// Queues this shard's KV of sequence `seq` at the stored positions not sent yet
    /// (every layer) for the inbox at `address`, as part of transfer `transfer`.
    ///
    /// Errors: not a prefill replica, an unknown sequence.
    fn send_unsent(&mut self, seq: u64, address: &str, transfer: u64) -> Result<()> {
        let PdLink::Prefill { outbox, .. } = &mut self.pd else {
            bail!("rank {}: not a prefill replica", self.global_rank);
        };
        let cache = self
            .caches
            .get(&seq)
            .with_context(|| format!("rank {}: sequence {seq} is unknown", self.global_rank))?;
        let from = self.handed.get(&seq).copied().unwrap_or(0);
        if cache.n_tokens > from {
            let part = cache.export(0..self.shard.layers.len(), from..cache.n_tokens)?;
            outbox.send(address, transfer, part);
            self.handed.insert(seq, cache.n_tokens);
        }
        Ok(())
    }

    /// The inbox of this rank's peer in the hand-off's decode replica. Errors: not a prefill
    /// replica, a replica that is not a decode replica.
    fn inbox_address(&self, handoff: Handoff) -> Result<String> {
        let PdLink::Prefill { peers, .. } = &self.pd else {
            bail!("rank {}: not a prefill replica", self.global_rank);
        };
        peers
            .get(&handoff.replica)
            .cloned()
            .with_context(|| not_a_decode_replica(self.global_rank, handoff.replica))
    }

    /// Waits until every part of `seq`'s hand-off went. Errors: a part could not be sent.
    fn finish_handoff(&mut self, seq: u64, handoff: Handoff) -> Result<()> {
        self.handed.remove(&seq);
        let PdLink::Prefill { outbox, .. } = &mut self.pd else {
            bail!("rank {}: not a prefill replica", self.global_rank);
        };
        outbox
            .finish(handoff.transfer)
            .with_context(|| format!("rank {}", self.global_rank))
    }

    /// A follower's loop: receive the driver's messages and run them until `Done`.
    fn follow(&mut self) -> Result<()> {
        let sampler_rank = self.sampler_rank();
        loop {
            let mut bytes = Vec::new();
            self.replica.broadcast(&mut bytes, 0)?;
            match serde_json::from_slice(&bytes).context("malformed message from the driver")? {
                Message::Step { entries, release } => {
                    let sampled = self.run_step(&entries, &release)?;
                    if self.rank == sampler_rank {
                        self.replica.send(0, &serde_json::to_vec(&sampled)?)?;
                    }
                }
                Message::Idle => {}
                Message::Done => return Ok(()),
            }
        }
    }
}

/// Rank 0 of a replica: an [`Executor`] that broadcasts each step to the replica, runs its
/// own stage and collects the sampled tokens from the sampling rank.
pub struct ReplicaDriver {
    member: Member,
    tokenizer: Tokenizer,
}

impl ReplicaDriver {
    fn broadcast(&mut self, message: &Message<'_>) -> Result<()> {
        let mut bytes = serde_json::to_vec(message)?;
        self.member.replica.broadcast(&mut bytes, 0)
    }

    /// Tells the other ranks that the job is over, so they exit. Errors: a lost peer.
    pub fn finish(&mut self) -> Result<()> {
        self.broadcast(&Message::Done)
    }

    /// Ranks in the replica.
    pub fn world_size(&self) -> usize {
        self.member.replica.size()
    }

    /// Which data-parallel replica this driver drives (0: the one whose driver serves HTTP).
    pub fn replica_index(&self) -> usize {
        self.member.dp_rank
    }

    /// The timeout of every collective, which an idle driver must beat.
    pub fn timeout(&self) -> Duration {
        self.member.timeout
    }
}

impl Executor for ReplicaDriver {
    fn step(&mut self, entries: &[StepEntry], release: &[u64]) -> Result<Vec<Option<Sampled>>> {
        self.broadcast(&Message::Step {
            entries: entries.into(),
            release: release.into(),
        })?;
        let own = self.member.run_step(entries, release)?;
        let sampler_rank = self.member.sampler_rank();
        if sampler_rank == 0 {
            if own.len() != entries.len() {
                bail!(
                    "rank 0 sampled {} tokens for {} sequences",
                    own.len(),
                    entries.len()
                );
            }
            return Ok(own);
        }
        let bytes = self.member.replica.recv(sampler_rank)?;
        let sampled: Vec<Option<Sampled>> = serde_json::from_slice(&bytes)
            .with_context(|| format!("malformed tokens from rank {sampler_rank}"))?;
        if sampled.len() != entries.len() {
            bail!(
                "rank {sampler_rank} returned {} tokens for {} sequences",
                sampled.len(),
                entries.len()
            );
        }
        Ok(sampled)
    }

    fn idle(&mut self) -> Result<()> {
        self.broadcast(&Message::Idle)
    }

    fn kv_sent(&self) -> KvSent {
        match &self.member.pd {
            PdLink::Prefill { outbox, .. } => outbox.sent(),
            _ => KvSent::default(),
        }
    }

    fn errors_are_fatal(&self) -> bool {
        true
    }

    fn take_transfer_failures(&mut self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.member.transfer_failures)
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn max_context_tokens(&self) -> usize {
        self.member.shard.config.max_context_tokens
    }

    fn kv_pool(&self) -> &Arc<KvPool> {
        match &self.member.device {
            Some(device) => device.kv_pool(),
            None => self.member.shard.kv_pool(),
        }
    }
}

fn not_a_decode_replica(rank: usize, replica: usize) -> String {
    format!("rank {rank}: replica {replica} is not a decode replica")
}

fn bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

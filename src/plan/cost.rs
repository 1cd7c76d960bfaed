//! Roofline cost model of a decode step for one parallel layout: HBM time of the bytes each
//! GPU reads (weights, touched experts, KV cache) against tensor-core time, plus TP
//! all-reduces, EP all-to-alls and PP hops over the links the groups actually use.

use serde::{Deserialize, Serialize};

use super::calibration::MeasuredLink;
use super::cluster::{CpuAttention, CpuRowChain, HardwareSpec};
use super::memory::StageMemory;
use super::model::{Dtype, ModelSpec};
use crate::degrees::Degrees;

/// Small-message latency of one collective over NVLink, seconds (nccl-tests
/// `all_reduce_perf` at 8 B–64 KiB on 8×H100 NVSwitch: ≈ 8–12 µs).
///
/// Every collective the model counts — two all-reduces per layer for TP, a dispatch and a
/// combine per MoE layer for EP, one send per stage boundary for PP — pays its link's
/// latency once per call on top of its bytes. These latencies include NCCL's launch
/// overhead: nccl-tests times a call from the host, kernel launch and proxy included, so
/// its small-message times are the per-call floor (and `--calibration` replaces them with
/// the hosts' own).
pub(crate) const NVLINK_LATENCY_SECS: f64 = 8e-6;
/// Same over PCIe/SHM inside a host, seconds.
pub(crate) const PCIE_LATENCY_SECS: f64 = 15e-6;
/// Same across hosts over InfiniBand/RoCE, seconds.
pub(crate) const NETWORK_LATENCY_SECS: f64 = 25e-6;
/// Same across hosts over TCP sockets (NCCL's `NET/Socket`), when no RDMA is known on the
/// hosts, seconds: a kernel round trip per message on each side plus NCCL's proxy; our own
/// `infer bench allreduce --cluster` measures 40–55 µs for 8 B between network namespaces
/// on one machine (no wire, no switch), so 50 µs is the floor, not a typical figure.
pub(crate) const TCP_LATENCY_SECS: f64 = 50e-6;
/// Latency of one all-reduce between CPU ranks of one host through shared memory
/// (`runtime/collectives/shm.rs`), seconds: `infer bench allreduce --world 2` on a 2-core
/// Xeon VM measured 49–78 µs for 8 B to 16 KiB, each rank on its own core; a host with cores
/// to spare for the spin-waits answers faster (`--calibration` replaces it with its own).
pub(crate) const SHM_LATENCY_SECS: f64 = 50e-6;
/// Latency of one message between CPU ranks of one host through shared memory
/// (`runtime/collectives/shm_ring.rs`) when every rank of the host has a core, so the
/// receiver spins: `infer bench allreduce --world 2` on a 2-core EPYC VM measured 0.2 µs
/// (half a ping-pong round trip), three runs.
pub(crate) const SHM_SPINNING_MESSAGE_SECS: f64 = 0.2e-6;
/// The same when ranks outnumber cores, so the receiver sleeps on a futex and is woken:
/// `infer bench allreduce --world 3` on that VM measured 15.5–21.1 µs, three runs.
pub(crate) const SHM_SLEEPING_MESSAGE_SECS: f64 = 18e-6;
/// Bandwidth of TCP sockets across hosts when no RDMA is known, bytes/s per direction:
/// a 100 GbE port's line rate, 12.5 GB/s (the Ethernet rung of DESIGN's bandwidth ladder);
/// the hardware profile's RDMA NIC rate applies only when its HCAs are known.
pub(crate) const TCP_GB_PER_SEC: f64 = 12.5;

/// Average context per sequence the throughput estimate assumes, tokens (capped at `--max-model-len`).
pub(crate) const TYPICAL_CONTEXT_TOKENS: u64 = 2048;

/// The links a layout's groups use, one-direction bandwidth in bytes/s and latency in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bytes_per_sec: f64,
    /// The floor of one collective call (its smallest all-reduce).
    pub latency_secs: f64,
    /// The floor of one point-to-point message (a send and its receive), which CPU TP's
    /// exact-order chain pays per hop; the collective floor where nothing better is known.
    pub message_latency_secs: f64,
}

impl MeasuredLink {
    /// The cost model's link (a report without a message latency gives the collective's).
    pub fn link(&self) -> Link {
        Link {
            bytes_per_sec: self.bytes_per_sec,
            latency_secs: self.latency_secs,
            message_latency_secs: self.message_latency_secs.unwrap_or(self.latency_secs),
        }
    }
}

/// Links of each group kind for a placed layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Links {
    pub tp: Link,
    pub ep: Link,
    pub pp: Link,
}

/// What the cost model predicts for one layout. Part of `--json` (`estimate`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Time per output token of one sequence alone (batch 1), seconds.
    pub tpot_secs: f64,
    /// Sequences per replica in the throughput estimate (KV capacity and `max_num_seqs` bound it).
    pub batch_per_replica: u64,
    /// Time per output token at that batch, seconds.
    pub tpot_at_batch_secs: f64,
    /// Decode tokens per second of the whole cluster at that batch (all DP replicas).
    pub tokens_per_sec: f64,
    /// Fraction of a pipeline round the average stage idles at `batch_per_replica`:
    /// `1 − Σ_s m·t_s / (pp · round)` for `m` micro-batches of stage time `t_s`. With
    /// `m = pp` balanced micro-batches it is near 0 (steady-state decode keeps every stage
    /// busy); with one micro-batch it is GPipe's `(pp−1)/pp` (Huang et al. 2019). 0 without PP.
    pub pp_bubble_fraction: f64,
    /// Sequences of `--max-model-len` tokens the KV cache holds at once, per replica.
    pub max_concurrency: u64,
    /// MoE models: what the routed experts cost in a decode step at batch 1 and at
    /// `batch_per_replica`; absent for dense models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeCosts>,
}

/// The routed experts' share of a decode step at batch 1 and at the throughput batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeCosts {
    pub at_batch_1: MoeStep,
    pub at_batch: MoeStep,
}

/// What the routed experts of one layout cost in one decode step of `batch` sequences per
/// replica, summed over the MoE layers of every stage. The same formulas as the step time
/// ([`expert_layer`]), so its parts are parts of `tpot_secs`/`tpot_at_batch_secs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeStep {
    /// Sequences per replica in the step.
    pub batch: u64,
    /// Tokens that meet in one expert group per step: the replica's batch, or with EP the
    /// batches of the `ep / tp` attention replicas whose tokens the all-to-all gathers.
    pub group_tokens: u64,
    /// Mean rows (tokens) of one expert's GEMM per step: `group_tokens · top_k / n_experts`.
    pub tokens_per_expert: f64,
    /// Rows at which an expert's GEMM turns from memory- to compute-bound: the roofline's
    /// ridge `peak_flops · bytes_per_param / (2 · hbm_bytes_per_sec)` (Williams et al. 2009).
    pub ridge_tokens_per_expert: f64,
    /// The busiest GPU's token-expert assignments over the mean: 1 for MoE-TP (every GPU
    /// holds a slice of every expert), `1 + sqrt(2 · ln(ep) / mean)` for EP (balls into bins,
    /// Raab & Steger 1998, for uniformly routed top-k).
    pub busiest_gpu_load: f64,
    /// Seconds of the step in the experts' GEMMs on the busiest GPU.
    pub expert_secs: f64,
    /// Seconds of the step in the MoE layers' collectives: the dispatch and combine
    /// all-to-alls with EP, the all-reduce after each MoE layer with MoE-TP (0 at TP 1).
    pub collective_secs: f64,
}

/// Estimates decode performance of `parallel` with memory `stages` on `hardware` over `links`,
/// for sequences of up to `max_model_len_tokens` and batches of up to `max_batch` sequences
/// per replica (the engine's `max_num_seqs`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn estimate(
    spec: &ModelSpec,
    parallel: &Degrees,
    stages: &[StageMemory],
    dtype: Dtype,
    hardware: &HardwareSpec,
    links: &Links,
    max_model_len_tokens: u64,
    max_batch: u64,
) -> Estimate {
    let context = TYPICAL_CONTEXT_TOKENS.min(max_model_len_tokens);
    let kv_tokens = stages.iter().map(|s| s.kv_tokens).min().unwrap_or(0);
    let batch = (kv_tokens / context.max(1)).clamp(1, max_batch.max(1));
    let pp = parallel.pp as u64;
    let tpot =
        |b: u64| decode_step_secs(spec, parallel, stages, dtype, hardware, links, b, context);
    let tpot_secs = tpot(1);
    let tpot_at_batch_secs = tpot(batch);
    // With PP, `m = pp` micro-batches keep the stages busy (vLLM runs one virtual engine per
    // stage); a round is bounded by the slowest stage per micro-batch and by one traversal.
    let (micro_batches, micro) = if pp > 1 && batch >= pp {
        (pp, batch.div_ceil(pp))
    } else {
        (1, batch)
    };
    let stage_times: Vec<f64> = stages
        .iter()
        .map(|s| stage_secs(spec, parallel, s, dtype, hardware, links, micro, context))
        .collect();
    let round_secs = if micro_batches > 1 {
        let slowest =
            stage_times.iter().copied().fold(0.0, f64::max) + hop_secs(spec, links, micro);
        (micro_batches as f64 * slowest).max(tpot(micro))
    } else {
        tpot_at_batch_secs
    };
    let busy_secs: f64 = stage_times.iter().map(|t| micro_batches as f64 * t).sum();
    let replica_tokens_per_sec = batch as f64 / round_secs;
    Estimate {
        tpot_secs,
        batch_per_replica: batch,
        tpot_at_batch_secs,
        tokens_per_sec: replica_tokens_per_sec * parallel.dp as f64,
        pp_bubble_fraction: if pp > 1 {
            (1.0 - busy_secs / (pp as f64 * round_secs)).max(0.0)
        } else {
            0.0
        },
        max_concurrency: kv_tokens / max_model_len_tokens.max(1),
        moe: spec.moe.as_ref().map(|_| MoeCosts {
            at_batch_1: moe_step(spec, parallel, stages, dtype, hardware, links, 1),
            at_batch: moe_step(spec, parallel, stages, dtype, hardware, links, batch),
        }),
    }
}

/// The experts' share of a decode step of `batch` sequences per replica ([`MoeStep`]).
fn moe_step(
    spec: &ModelSpec,
    parallel: &Degrees,
    stages: &[StageMemory],
    dtype: Dtype,
    hardware: &HardwareSpec,
    links: &Links,
    batch: u64,
) -> MoeStep {
    let layer = expert_layer(spec, parallel, dtype, hardware, batch);
    let n_moe_layers: f64 = stages.iter().map(|s| moe_layers_in(spec, s)).sum();
    let collective_secs = stages
        .iter()
        .map(|s| moe_collective_secs(spec, parallel, s, links, batch, layer.busiest_gpu_load))
        .sum();
    MoeStep {
        batch,
        group_tokens: layer.group_tokens,
        tokens_per_expert: layer.tokens_per_expert,
        ridge_tokens_per_expert: layer.ridge_tokens_per_expert,
        busiest_gpu_load: layer.busiest_gpu_load,
        expert_secs: n_moe_layers * layer.secs,
        collective_secs,
    }
}

/// One MoE layer's routed experts on the busiest GPU of a decode step.
struct ExpertLayer {
    group_tokens: u64,
    tokens_per_expert: f64,
    ridge_tokens_per_expert: f64,
    busiest_gpu_load: f64,
    /// Seconds: the roofline of the expert bytes the busiest GPU reads (the experts it holds
    /// that some token of the step is routed to; its slice of each with MoE-TP) against
    /// `2 · rows · params` of GEMM.
    secs: f64,
}

/// The routed experts of one MoE layer in a decode step of `batch` sequences per replica.
///
/// - Tokens that meet: with EP (`ep > 1`) the all-to-all gathers the batches of the `ep / tp`
///   attention replicas of the EP group, `T = batch · ep / tp`; with MoE-TP a replica's own,
///   `T = batch`. Each expert's GEMM gets `M = T · top_k / n_experts` rows on average.
/// - EP: a GPU holds `n_experts / ep` whole experts and computes `T · top_k / ep` rows on
///   average; uniformly routed top-k puts `mean + sqrt(2 · mean · ln ep)` on the busiest of
///   `ep` GPUs (the max load of balls into bins for `mean ≫ ln ep`, Raab & Steger 1998), and
///   the step waits for it. MoE-TP: a GPU holds `1/tp` of every expert and computes its
///   slice of all `T · top_k` rows: every GPU alike.
/// - Time: the roofline of the expert bytes read (each touched expert once per step,
///   whatever its rows: `1 − (1 − top_k/n_experts)^T` of them are touched) against the
///   tensor-core time of `2 · rows · params` — memory-bound while `M` is below the ridge
///   (Williams et al. 2009, "Roofline").
fn expert_layer(
    spec: &ModelSpec,
    parallel: &Degrees,
    dtype: Dtype,
    hardware: &HardwareSpec,
    batch: u64,
) -> ExpertLayer {
    let Degrees { tp, ep, .. } = *parallel;
    let Some(moe) = &spec.moe else {
        return ExpertLayer {
            group_tokens: 0,
            tokens_per_expert: 0.0,
            ridge_tokens_per_expert: 0.0,
            busiest_gpu_load: 1.0,
            secs: 0.0,
        };
    };
    let n_experts = moe.n_experts.max(1) as f64;
    let top_k = moe.n_experts_per_token as f64;
    let layers = spec.n_moe_layers().max(1) as f64;
    let expert_bytes = spec.weight_bytes_by_part(dtype).routed_experts as f64 / layers / n_experts;
    let expert_params = spec.param_counts().routed_experts as f64 / layers / n_experts;
    let group_tokens = if ep > 1 {
        batch * (ep / tp.max(1)).max(1) as u64
    } else {
        batch
    };
    let t = group_tokens as f64;
    let touched = 1.0 - (1.0 - top_k / n_experts).powf(t);
    let (experts_here, slice, mean_rows, busiest) = if ep > 1 {
        let mean = t * top_k / ep as f64;
        let busiest = if mean > 0.0 {
            // A GPU holds n_experts/ep experts: it cannot get more rows than that many per token.
            (mean + (2.0 * mean * (ep as f64).ln()).sqrt())
                .min(t * top_k.min(n_experts / ep as f64))
        } else {
            mean
        };
        (n_experts / ep as f64, 1.0, mean, busiest)
    } else {
        let rows = t * top_k;
        (n_experts, 1.0 / tp.max(1) as f64, rows, rows)
    };
    let tflops = tensor_tflops(hardware, dtype) * 1e12;
    let hbm = hardware.hbm_gb_per_sec * 1e9;
    let weight_bytes = experts_here * touched * expert_bytes * slice;
    let compute_secs = 2.0 * busiest * expert_params * slice / tflops;
    ExpertLayer {
        group_tokens,
        tokens_per_expert: t * top_k / n_experts,
        ridge_tokens_per_expert: tflops * expert_bytes / expert_params.max(1.0) / (2.0 * hbm),
        busiest_gpu_load: if mean_rows > 0.0 {
            busiest / mean_rows
        } else {
            1.0
        },
        secs: (weight_bytes / hbm).max(compute_secs),
    }
}

/// MoE layers among the stage's layers.
fn moe_layers_in(spec: &ModelSpec, stage: &StageMemory) -> f64 {
    match &spec.moe {
        Some(moe) => (stage.first_layer..stage.first_layer + stage.n_layers)
            .filter(|&l| l >= moe.n_dense_layers)
            .count() as f64,
        None => 0.0,
    }
}

/// One PP stage's time for a decode step of `batch` sequences with `context` tokens each:
/// the roofline of everything but the routed experts (weights, KV cache, projections and
/// attention), then the routed experts of its MoE layers ([`expert_layer`]: kernels run one
/// after the other, so their times add), then its collectives.
#[allow(clippy::too_many_arguments)]
fn stage_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stage: &StageMemory,
    dtype: Dtype,
    hardware: &HardwareSpec,
    links: &Links,
    batch: u64,
    context: u64,
) -> f64 {
    let tp = parallel.tp;
    let layers = stage.n_layers as f64;
    let n_moe_layers_here = moe_layers_in(spec, stage);
    let experts = expert_layer(spec, parallel, dtype, hardware, batch);
    // Everything but the routed experts: the weights the stage reads whole in a step
    // (not the embedding table's rows it does not look up), less the experts it holds.
    let routed_here = match &spec.moe {
        Some(_) if n_moe_layers_here > 0.0 => {
            let split = if parallel.ep > 1 { parallel.ep } else { tp } as f64;
            n_moe_layers_here * spec.weight_bytes_by_part(dtype).routed_experts as f64
                / spec.n_moe_layers().max(1) as f64
                / split
        }
        _ => 0.0,
    };
    let weight_bytes = (stage.read_per_step_bytes as f64 - routed_here).max(0.0);
    let attention_flops =
        4.0 * (batch * context) as f64 * (spec.n_heads * spec.head_dim) as f64 / tp as f64 * layers;
    // The KV cache: read at the memory's rate on a GPU, its attention's arithmetic counted
    // with the step's; on a CPU rank, the attention's own measured time.
    let (kv_secs, compute_attention_flops) = match hardware.cpu_attention {
        Some(attention) => (
            cpu_attention_secs(spec, tp, attention, batch, attention_flops),
            0.0,
        ),
        None => (
            (batch * context * stage.kv_bytes_per_token) as f64 / (hardware.hbm_gb_per_sec * 1e9),
            attention_flops,
        ),
    };
    // A CPU rank's fixed cost per layer beyond its weights' bytes.
    let layers_secs = hardware.cpu_layer_secs.map_or(0.0, |secs| layers * secs);
    let memory_secs =
        weight_bytes / (weight_read_gb_per_sec(hardware, dtype) * 1e9) + layers_secs + kv_secs;
    let tflops = tensor_tflops(hardware, dtype);
    let routed_active = match &spec.moe {
        Some(moe) => {
            spec.param_counts().routed_experts / moe.n_experts.max(1) * moe.n_experts_per_token
        }
        None => 0,
    };
    let dense_params_here =
        (spec.active_params() - routed_active) as f64 * layers / spec.n_layers as f64 / tp as f64;
    let compute_secs =
        (2.0 * dense_params_here * batch as f64 + compute_attention_flops) / (tflops * 1e12);
    let chain = row_chain(hardware, dtype, tp);
    let chain_secs = chain.map_or(0.0, |chain| {
        chain_wait_secs(
            spec,
            tp,
            stage,
            dtype,
            chain,
            weight_read_gb_per_sec(hardware, dtype),
            tflops,
            batch,
        )
    });
    memory_secs.max(compute_secs)
        + chain_secs
        + n_moe_layers_here * experts.secs
        + collective_secs(
            spec,
            parallel,
            stage,
            links,
            batch,
            experts.busiest_gpu_load,
            chain.is_some(),
        )
}

/// The exact-order TP of a CPU rank ([`CpuRowChain`]) when it applies: TP over CPU ranks
/// with weights the integer kernels multiply (int4 and int8 run as `Q4_0` and `Q8_0`; a
/// GGUF plan is taken as `Q4_0`/`Q4_1`/`Q8_0`, the types CPU checkpoints ship in). bf16 and
/// fp16 products are summed with an all-reduce instead.
pub(crate) fn row_chain(hardware: &HardwareSpec, dtype: Dtype, tp: usize) -> Option<CpuRowChain> {
    match (hardware.cpu_row_chain, dtype) {
        (Some(chain), Dtype::Int4 | Dtype::Int8 | Dtype::Q4_0 | Dtype::Q8_0 | Dtype::Gguf)
            if tp > 1 =>
        {
            Some(chain)
        }
        _ => None,
    }
}

/// What a stage's exact-order row-parallel products add to a step of `tokens` tokens on a
/// CPU rank, seconds: the roofline (weights at `weights_gb_per_sec`, flops at `tflops`) of
/// its share of the row-parallel weights ([`ModelSpec::row_parallel_bytes`]) takes `tp`
/// turns instead of one, each turn [`CpuRowChain::alone_speedup`] times faster than with
/// every rank working; the stage's roofline already counts one turn.
#[allow(clippy::too_many_arguments)]
pub(crate) fn chain_wait_secs(
    spec: &ModelSpec,
    tp: usize,
    stage: &StageMemory,
    dtype: Dtype,
    chain: CpuRowChain,
    weights_gb_per_sec: f64,
    tflops: f64,
    tokens: u64,
) -> f64 {
    let share = stage.n_layers as f64 / spec.n_layers.max(1) as f64 / tp as f64;
    let bytes = spec.row_parallel_bytes(dtype) * share;
    let flops = 2.0 * spec.row_parallel_params() as f64 * share * tokens as f64;
    let turn_secs = (bytes / (weights_gb_per_sec * 1e9)).max(flops / (tflops * 1e12));
    turn_secs * (tp as f64 / chain.alone_speedup - 1.0).max(0.0)
}

/// The collectives of one stage over `tokens` tokens' activations (a decode batch or a
/// prompt): two ring all-reduces per layer over TP (after attention and after the MLP;
/// 2(n−1)/n of the message crosses each link, nccl-tests' bus-bandwidth factor), and a
/// dispatch and a combine all-to-all per MoE layer over EP (each token's hidden state to
/// its top-k experts, (ep−1)/ep of them on other ranks; the busiest GPU receives
/// `busiest_gpu_load` times the mean, and every GPU waits for it); each call also pays its
/// link's latency.
///
/// With `exact_chain` ([`row_chain`]), each of a layer's two TP sums is a chain instead
/// ([`chain_call_secs`]).
fn collective_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stage: &StageMemory,
    links: &Links,
    tokens: u64,
    busiest_gpu_load: f64,
    exact_chain: bool,
) -> f64 {
    let tp = parallel.tp;
    let layers = stage.n_layers as f64;
    let allreduce_secs = match (tp > 1, exact_chain) {
        (false, _) => 0.0,
        (true, false) => 2.0 * layers * allreduce_call_secs(spec, tp, links, tokens),
        (true, true) => 2.0 * layers * chain_call_secs(spec, tp, links, tokens),
    };
    allreduce_secs + all_to_all_secs(spec, parallel, stage, links, tokens, busiest_gpu_load)
}

/// One ring all-reduce of `tokens` tokens' bf16 activations over the TP link, seconds.
fn allreduce_call_secs(spec: &ModelSpec, tp: usize, links: &Links, tokens: u64) -> f64 {
    let message = (tokens * spec.hidden_size * 2) as f64;
    2.0 * (tp - 1) as f64 / tp as f64 * message / links.tp.bytes_per_sec + links.tp.latency_secs
}

/// One exact-order TP sum of `tokens` tokens' `hidden`-wide outputs over the TP link,
/// seconds: `tp − 1` hops of the running dot products (36 bytes per output: the engine's
/// `DotState` of 9 f32), then the last rank sends the sums (4 bytes per output) to the
/// `tp − 1` others; `tp` messages in a row, each paying the link's message latency.
pub(crate) fn chain_call_secs(spec: &ModelSpec, tp: usize, links: &Links, tokens: u64) -> f64 {
    let outputs = (tokens * spec.hidden_size) as f64;
    (tp - 1) as f64 * outputs * (36.0 + 4.0) / links.tp.bytes_per_sec
        + tp as f64 * links.tp.message_latency_secs
}

/// The EP dispatch and combine all-to-alls of the stage's MoE layers, seconds (0 without EP).
fn all_to_all_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stage: &StageMemory,
    links: &Links,
    tokens: u64,
    busiest_gpu_load: f64,
) -> f64 {
    let ep = parallel.ep;
    match &spec.moe {
        Some(moe) if ep > 1 => {
            let message = (tokens * spec.hidden_size * 2) as f64;
            let bytes = message * moe.n_experts_per_token as f64 * (ep - 1) as f64 / ep as f64
                * busiest_gpu_load;
            2.0 * moe_layers_in(spec, stage)
                * (bytes / links.ep.bytes_per_sec + links.ep.latency_secs)
        }
        _ => 0.0,
    }
}

/// The MoE layers' own collectives in a step of `tokens` tokens ([`MoeStep::collective_secs`]).
fn moe_collective_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stage: &StageMemory,
    links: &Links,
    tokens: u64,
    busiest_gpu_load: f64,
) -> f64 {
    if parallel.ep > 1 {
        all_to_all_secs(spec, parallel, stage, links, tokens, busiest_gpu_load)
    } else if parallel.tp > 1 {
        moe_layers_in(spec, stage) * allreduce_call_secs(spec, parallel.tp, links, tokens)
    } else {
        0.0
    }
}

/// The rate a decode step reads `dtype` weights at, GB/s: the HBM's, or a CPU rank's
/// measured rate for bf16 and fp16 weights ([`HardwareSpec::bf16_weights_gb_per_sec`]).
fn weight_read_gb_per_sec(hardware: &HardwareSpec, dtype: Dtype) -> f64 {
    match (dtype, hardware.bf16_weights_gb_per_sec) {
        (Dtype::Bf16 | Dtype::Fp16, Some(rate)) => rate,
        _ => hardware.hbm_gb_per_sec,
    }
}

/// Seconds a CPU rank's decode attention takes over `attention_flops` (the planner's count,
/// `4 · batch · context · n_heads · head_dim / tp` per layer): at its measured rate
/// ([`CpuAttention`]) times the share of its threads that `batch · kv_heads_per_rank(tp)`
/// tasks keep busy ([`attention_occupancy`](crate::topology::cpu::attention_occupancy)).
fn cpu_attention_secs(
    spec: &ModelSpec,
    tp: usize,
    attention: CpuAttention,
    batch: u64,
    attention_flops: f64,
) -> f64 {
    crate::topology::cpu::attention_secs(
        attention_flops,
        attention.flops_per_sec,
        batch * spec.kv_heads_per_rank(tp as u64),
        attention.threads,
    )
}

/// Dense tensor-core TFLOPS for `dtype`'s matrix products (FP8 and MXFP4 run on the FP8
/// units, everything else at bf16 rate; a CPU rank's bf16 and fp16 products at their own
/// measured rate, [`HardwareSpec::bf16_products_tflops`]).
fn tensor_tflops(hardware: &HardwareSpec, dtype: Dtype) -> f64 {
    match (dtype, hardware.bf16_products_tflops) {
        (Dtype::Fp8 | Dtype::Mxfp4, _) => hardware.fp8_tflops,
        (Dtype::Bf16 | Dtype::Fp16, Some(tflops)) => tflops,
        _ => hardware.bf16_tflops,
    }
}

/// Sending one micro-batch's activations to the next stage (one message).
fn hop_secs(spec: &ModelSpec, links: &Links, batch: u64) -> f64 {
    (batch * spec.hidden_size * 2) as f64 / links.pp.bytes_per_sec + links.pp.message_latency_secs
}

/// Time of one decode step of `batch` sequences with `context` tokens each: every stage's
/// time plus the `pp − 1` hops between stages (the batch-1 value is [`Estimate::tpot_secs`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_step_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stages: &[StageMemory],
    dtype: Dtype,
    hardware: &HardwareSpec,
    links: &Links,
    batch: u64,
    context: u64,
) -> f64 {
    stages
        .iter()
        .map(|s| stage_secs(spec, parallel, s, dtype, hardware, links, batch, context))
        .sum::<f64>()
        + (parallel.pp - 1) as f64 * hop_secs(spec, links, batch)
}

/// The arithmetic of prefilling one prompt of `prompt_tokens` on the whole model, flops:
/// `2 · layer params · tokens` for the layers' projections (the active parameters but the
/// embedding and the LM head), `2 · vocab · hidden` for the last token's logits, plus
/// `2 · tokens² · heads · head_dim` per
/// layer for causal attention (QKᵀ and PV, each `2 · tokens² · heads · head_dim` over the
/// full square, over half of it). What [`prefill_secs`] divides among the stages and TP ranks,
/// and what `infer bench decode --json` divides by its prefill time (`prefill_flops_per_sec`).
pub(crate) fn prefill_flops(spec: &ModelSpec, prompt_tokens: u64) -> f64 {
    let tokens = prompt_tokens.max(1) as f64;
    let counts = spec.param_counts();
    // The embedding is looked up, not multiplied; the LM head (the tied embedding or its
    // own) gives logits for the prompt's last token only, as vLLM and the CPU engine compute.
    let per_token = spec.active_params() - counts.embedding - counts.lm_head;
    2.0 * per_token as f64 * tokens
        + 2.0 * (spec.vocab_size * spec.hidden_size) as f64
        + prefill_attention_flops(spec, prompt_tokens)
}

/// The causal attention part of [`prefill_flops`], flops: `2 · tokens² · heads · head_dim`
/// per layer (QKᵀ and PV, each `2 · tokens² · heads · head_dim` over the full square, over
/// half of it). What a CPU rank computes at its prefill attention's own rate
/// ([`HardwareSpec::cpu_prefill_attention_flops_per_sec`]).
pub(crate) fn prefill_attention_flops(spec: &ModelSpec, prompt_tokens: u64) -> f64 {
    let tokens = prompt_tokens.max(1) as f64;
    2.0 * tokens * tokens * (spec.n_heads * spec.head_dim) as f64 * spec.n_layers as f64
}

/// Time to prefill one prompt of `prompt_tokens` on one replica, seconds: per stage, the
/// larger of its tensor-core time for everything but the routed experts (`2 · params ·
/// tokens` for the projections plus `2 · tokens² · heads · head_dim` for causal attention —
/// QKᵀ and PV over half the square — over TP; a CPU rank's attention at its own measured
/// rate) and reading those weights once from HBM; then
/// the routed experts of its MoE layers with the prompt's tokens as the GEMM rows
/// ([`expert_layer`]: with EP the busiest GPU's share of them); plus two ring all-reduces
/// per layer of `tokens × hidden` bf16 activations over TP, the EP dispatch/combine of
/// every token's top-k copies per MoE layer, and a hop of the prompt's activations per stage
/// boundary. Peak throughput, as the decode roofline: an optimistic bound (a measured
/// calibration replaces it).
pub(crate) fn prefill_secs(
    spec: &ModelSpec,
    parallel: &Degrees,
    stages: &[StageMemory],
    dtype: Dtype,
    hardware: &HardwareSpec,
    links: &Links,
    prompt_tokens: u64,
) -> f64 {
    let Degrees { tp, pp, .. } = *parallel;
    let tokens = prompt_tokens.max(1) as f64;
    let tflops = tensor_tflops(hardware, dtype);
    let experts = expert_layer(spec, parallel, dtype, hardware, prompt_tokens.max(1));
    let routed_active = match &spec.moe {
        Some(moe) => {
            spec.param_counts().routed_experts / moe.n_experts.max(1) * moe.n_experts_per_token
        }
        None => 0,
    };
    let dense_flops = prefill_flops(spec, prompt_tokens) - 2.0 * routed_active as f64 * tokens;
    let attention_flops = prefill_attention_flops(spec, prompt_tokens);
    let split = if parallel.ep > 1 { parallel.ep } else { tp } as f64;
    let routed_layer_bytes = spec.weight_bytes_by_part(dtype).routed_experts as f64
        / spec.n_moe_layers().max(1) as f64
        / split;
    let stage_times: f64 = stages
        .iter()
        .map(|stage| {
            let share = stage.n_layers as f64 / spec.n_layers.max(1) as f64 / tp as f64;
            let n_moe_layers_here = moe_layers_in(spec, stage);
            let compute_secs = match hardware.cpu_prefill_attention_flops_per_sec {
                Some(rate) => {
                    (dense_flops - attention_flops) * share / (tflops * 1e12)
                        + attention_flops * share / rate
                }
                None => dense_flops * share / (tflops * 1e12),
            };
            let memory_secs = (stage.read_per_step_bytes as f64
                - n_moe_layers_here * routed_layer_bytes)
                .max(0.0)
                / (hardware.hbm_gb_per_sec * 1e9);
            let chain = row_chain(hardware, dtype, tp);
            let chain_secs = chain.map_or(0.0, |chain| {
                let rate = hardware.hbm_gb_per_sec;
                chain_wait_secs(spec, tp, stage, dtype, chain, rate, tflops, prompt_tokens)
            });
            compute_secs.max(memory_secs)
                + chain_secs
                + n_moe_layers_here * experts.secs
                + collective_secs(
                    spec,
                    parallel,
                    stage,
                    links,
                    prompt_tokens.max(1),
                    experts.busiest_gpu_load,
                    chain.is_some(),
                )
        })
        .sum();
    let hops = (pp - 1) as f64
        * (tokens * (spec.hidden_size * 2) as f64 / links.pp.bytes_per_sec
            + links.pp.message_latency_secs);
    stage_times + hops
}

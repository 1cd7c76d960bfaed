//! Memory per GPU for one parallel layout: weights of its PP stage and TP/EP shard, the
//! reserve (CUDA context, NCCL buffers, activations), and what is left for the KV cache. A
//! CPU rank is costed the same way with its own reserve: its process instead of a CUDA
//! context, shared-memory segments instead of NCCL buffers, f32 activations of the CPU
//! scheduler's largest step.

use serde::{Deserialize, Serialize};

use super::cluster::Device;
use super::model::{Dtype, ModelSpec};
use crate::degrees::Degrees;

/// CUDA context, cuBLAS workspaces and allocator slack per process, bytes. vLLM reports this
/// "non-torch memory" at about 0.5 GiB per GPU on CUDA 12.
pub(crate) const CUDA_CONTEXT_BYTES: u64 = 512 << 20;

/// NCCL buffers per communicator a rank belongs to, bytes: `NCCL_BUFFSIZE` (4 MiB) per
/// channel and peer over up to 32 channels, rounded to 256 MiB.
pub(crate) const NCCL_COMMUNICATOR_BYTES: u64 = 256 << 20;

/// Tokens of one forward pass in vLLM's memory profiling run (`max_num_batched_tokens`,
/// 8192 by default for chunked prefill on datacenter GPUs).
pub(crate) const PROFILE_BATCH_TOKENS: u64 = 8192;

/// Sequences vLLM schedules at most per step (`max_num_seqs`, default 256): logits are
/// kept in fp32 for each.
pub(crate) const MAX_NUM_SEQS: u64 = 256;

/// Sequences `infer up`'s engine decodes together on CPU ranks unless told otherwise (its
/// `--max-batch` default, 16): the CPU counterpart of [`MAX_NUM_SEQS`].
pub(crate) const CPU_MAX_NUM_SEQS: u64 = 16;

/// A CPU rank's process besides its weights and KV cache, bytes: the tokenizer, thread pool,
/// HTTP server and allocator slack. `infer bench decode --json` of SmolLM2-135M Q4_1 reports
/// a peak RSS of 256 MB with 96 MB of weights mapped and a 256-token KV cache: about 160 MB,
/// rounded up to 256 MiB.
pub(crate) const CPU_PROCESS_BYTES: u64 = 256 << 20;

/// Tokens of the CPU scheduler's largest step: its token budget is 32 per core, 64 to 4096
/// (`serve::scheduler::Limits::with_max_batch`); the reserve takes the largest.
pub(crate) const CPU_STEP_TOKENS: u64 = 4096;

/// Sequences one replica decodes together at most on `device`.
pub(crate) fn max_num_seqs(device: Device) -> u64 {
    match device {
        Device::Gpu => MAX_NUM_SEQS,
        Device::Cpu => CPU_MAX_NUM_SEQS,
    }
}

/// Memory of every GPU of one PP stage. The `--json` `memory[]` entries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageMemory {
    /// Which stage (GPUs of other stages hold other layers).
    pub pp_rank: u64,
    /// Decoder layers of this stage: `first_layer..first_layer + n_layers`.
    pub first_layer: u64,
    pub n_layers: u64,
    /// Device memory of the GPU, bytes.
    pub gpu_memory_bytes: u64,
    /// `gpu_memory_bytes × gpu_memory_utilization`, bytes.
    pub usable_bytes: u64,
    /// Weights resident on each GPU of this stage, bytes.
    pub weights_bytes: u64,
    /// Of those, what a forward pass reads whole, bytes: all but an embedding table that is
    /// not also the LM head (a step looks up only its tokens' rows of it; a tied table on a
    /// single stage is read whole as the head).
    #[serde(default)]
    pub read_per_step_bytes: u64,
    /// CUDA context + NCCL buffers + peak activations, bytes.
    pub reserve_bytes: u64,
    /// What remains for the KV cache, bytes (0 when weights and reserve do not fit).
    pub kv_cache_bytes: u64,
    /// KV-cache bytes one token takes on this GPU.
    pub kv_bytes_per_token: u64,
    /// Tokens the KV cache holds: `kv_cache_bytes / kv_bytes_per_token`.
    pub kv_tokens: u64,
}

/// Contiguous layer ranges of `pp` stages over `n_layers`: an even split, the first
/// `n_layers % pp` stages one layer longer. Returns `(first_layer, n_layers)` per stage.
pub(crate) fn stage_layers(n_layers: u64, pp: u64) -> Vec<(u64, u64)> {
    let base = n_layers / pp;
    let extra = n_layers % pp;
    let mut first = 0;
    (0..pp)
        .map(|stage| {
            let count = base + u64::from(stage < extra);
            let range = (first, count);
            first += count;
            range
        })
        .collect()
}

/// Memory of each PP stage's GPUs (or CPU ranks, `device`) for `parallel` on devices of
/// `gpu_memory_bytes` (a CPU rank's share of its host's memory).
pub(crate) fn stage_memory(
    spec: &ModelSpec,
    parallel: &Degrees,
    dtype: Dtype,
    kv_dtype: Dtype,
    gpu_memory_bytes: u64,
    gpu_memory_utilization: f64,
    device: Device,
) -> Vec<StageMemory> {
    let (tp, pp, ep) = (parallel.tp as u64, parallel.pp as u64, parallel.ep as u64);
    let params = spec.param_counts();
    let bytes = spec.weight_bytes_by_part(dtype);
    // Bytes per parameter of each part (exact for GGUF, where bytes are spread by share).
    let factor = |part_bytes: u64, part_params: u64| {
        if part_params == 0 {
            0.0
        } else {
            part_bytes as f64 / part_params as f64
        }
    };
    let n_layers = spec.n_layers.max(1);
    let n_dense_layers = spec.n_layers - spec.n_moe_layers();
    let dense_layer_params = 3 * spec.hidden_size * spec.intermediate_size;
    let shared_params_per_moe_layer = if spec.n_moe_layers() > 0 {
        (params.dense_mlp - n_dense_layers * dense_layer_params) / spec.n_moe_layers()
    } else {
        0
    };
    let f_dense = factor(bytes.dense_mlp, params.dense_mlp);
    let attention_layer_bytes = bytes.attention as f64 / n_layers as f64;
    let replicated_layer_bytes = bytes.replicated as f64 / n_layers as f64;
    let routed_layer_bytes = if spec.n_moe_layers() > 0 {
        bytes.routed_experts as f64 / spec.n_moe_layers() as f64
    } else {
        0.0
    };
    // Experts are split over the EP group when EP is on, else each expert is TP-sliced.
    let expert_split = if ep > 1 { ep } else { tp } as f64;
    let usable_bytes = (gpu_memory_bytes as f64 * gpu_memory_utilization) as u64;

    stage_layers(spec.n_layers, pp)
        .into_iter()
        .enumerate()
        .map(|(stage, (first_layer, count))| {
            let pp_rank = stage as u64;
            let mut weights = 0.0;
            for layer in first_layer..first_layer + count {
                weights += attention_layer_bytes / tp as f64 + replicated_layer_bytes;
                if layer < n_dense_layers {
                    weights += dense_layer_params as f64 * f_dense / tp as f64;
                } else {
                    weights += shared_params_per_moe_layer as f64 * f_dense / tp as f64
                        + routed_layer_bytes / expert_split;
                }
            }
            // Embedding (vocab-parallel) on the first stage; LM head on the last. A tied head
            // on another stage than the embedding needs its own copy there.
            let mut looked_up = 0.0;
            if pp_rank == 0 {
                weights += bytes.embedding as f64 / tp as f64;
                if !(spec.tie_word_embeddings && pp == 1) {
                    looked_up = bytes.embedding as f64 / tp as f64;
                }
            }
            if pp_rank == pp - 1 {
                let head = if spec.tie_word_embeddings {
                    if pp > 1 { bytes.embedding } else { 0 }
                } else {
                    bytes.lm_head
                };
                weights += head as f64 / tp as f64;
            }
            let weights_bytes = weights as u64;
            let reserve_bytes = reserve_bytes(spec, parallel, pp_rank == pp - 1, device);
            let kv_cache_bytes = usable_bytes.saturating_sub(weights_bytes + reserve_bytes);
            let kv_bytes_per_token = spec.kv_bytes_per_token(count, tp, kv_dtype).max(1);
            StageMemory {
                pp_rank,
                first_layer,
                n_layers: count,
                gpu_memory_bytes,
                usable_bytes,
                weights_bytes,
                read_per_step_bytes: (weights - looked_up).max(0.0) as u64,
                reserve_bytes,
                kv_cache_bytes,
                kv_bytes_per_token,
                kv_tokens: kv_cache_bytes / kv_bytes_per_token,
            }
        })
        .collect()
}

/// Reserve per GPU, bytes: CUDA context, one NCCL communicator per group of size > 1, and
/// peak activations of a [`PROFILE_BATCH_TOKENS`] forward pass —
/// `tokens · (4·hidden + 2·mlp_width/tp) · 2 bytes` (residual, normed input, attention
/// output and the gate/up pair, bf16) — plus fp32 logits for [`MAX_NUM_SEQS`] on the last stage.
///
/// Per CPU rank: [`CPU_PROCESS_BYTES`], a shared-memory segment of `(2n + 2)` 1-MiB slots per
/// group of `n > 1` ranks (`runtime/collectives/shm.rs`), the same activations in f32 (the
/// CPU engine's) for a [`CPU_STEP_TOKENS`] step, and fp32 logits for [`CPU_MAX_NUM_SEQS`].
pub(crate) fn reserve_bytes(
    spec: &ModelSpec,
    parallel: &Degrees,
    last_stage: bool,
    device: Device,
) -> u64 {
    let tp = parallel.tp as u64;
    let groups = [parallel.tp, parallel.pp, parallel.ep, parallel.dp].map(|d| d as u64);
    let n_groups = groups.iter().filter(|&&d| d > 1).count() as u64;
    let mlp_width = match &spec.moe {
        Some(moe) => {
            (moe.n_experts_per_token + moe.n_shared_experts) * moe.expert_intermediate_size
        }
        None => spec.intermediate_size,
    };
    let activations_per_token = 4 * spec.hidden_size + 2 * mlp_width / tp;
    let logits_per_seq = spec.vocab_size / tp * 4;
    match device {
        Device::Gpu => {
            let logits = if last_stage {
                MAX_NUM_SEQS * logits_per_seq
            } else {
                0
            };
            CUDA_CONTEXT_BYTES
                + n_groups * NCCL_COMMUNICATOR_BYTES
                + PROFILE_BATCH_TOKENS * activations_per_token * 2
                + logits
        }
        Device::Cpu => {
            let segments: u64 = groups
                .iter()
                .filter(|&&n| n > 1)
                .map(|&n| (2 * n + 2) << 20)
                .sum();
            let logits = if last_stage {
                CPU_MAX_NUM_SEQS * logits_per_seq
            } else {
                0
            };
            CPU_PROCESS_BYTES + segments + CPU_STEP_TOKENS * activations_per_token * 4 + logits
        }
    }
}

/// Bytes in GiB (2³⁰ bytes), for messages.
pub(crate) fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_split_layers_evenly_first_stages_longer() {
        assert_eq!(stage_layers(30, 1), vec![(0, 30)]);
        assert_eq!(stage_layers(126, 2), vec![(0, 63), (63, 63)]);
        assert_eq!(stage_layers(30, 4), vec![(0, 8), (8, 8), (16, 7), (23, 7)]);
        let total: u64 = stage_layers(61, 7).iter().map(|(_, n)| n).sum();
        assert_eq!(total, 61);
    }

    /// A step reads every weight but the rows of an embedding table it does not look up:
    /// Llama-3.1-8B's untied table (128256 × 4096 in bf16, 1.05 GB) is held but not read,
    /// SmolLM2's tied table is read whole as the LM head on one stage, and with PP its first
    /// stage holds a table it only looks up while the last reads its own copy.
    #[test]
    fn a_step_reads_all_weights_but_an_embedding_table_it_only_looks_up() {
        let stages = |model: &str, tp: usize, pp: usize| {
            let spec = crate::model::load(model).expect("a shipped profile");
            let parallel = Degrees {
                tp,
                pp,
                dp: 1,
                ep: 1,
            };
            let table_bytes = spec.weight_bytes_by_part(Dtype::Bf16).embedding;
            let stages = stage_memory(
                &spec,
                &parallel,
                Dtype::Bf16,
                Dtype::Bf16,
                80 << 30,
                0.9,
                Device::Gpu,
            );
            (table_bytes, stages)
        };
        let (table, llama) = stages("llama-3.1-8b", 2, 1);
        assert_eq!(table, 128_256 * 4096 * 2);
        let unread = llama[0].weights_bytes - llama[0].read_per_step_bytes;
        assert!(unread.abs_diff(table / 2) <= 1, "{unread} vs {}", table / 2);
        let (_, smollm2) = stages("smollm2-135m", 1, 1);
        assert_eq!(smollm2[0].read_per_step_bytes, smollm2[0].weights_bytes);
        let (table, split) = stages("smollm2-135m", 1, 2);
        let unread = split[0].weights_bytes - split[0].read_per_step_bytes;
        assert!(unread.abs_diff(table) <= 1, "{unread} vs {table}");
        assert_eq!(split[1].read_per_step_bytes, split[1].weights_bytes);
    }
}

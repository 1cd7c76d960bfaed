//! What the planner knows of a model: its shape ([`ModelSpec`]), parameter counts by part,
//! weight bytes by dtype and KV-cache bytes per token. Pure arithmetic; loading specs from
//! files lives in `crate::model`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Decoder family, as `model_type` in a Hugging Face `config.json` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Llama 2/3 (`llama`).
    Llama,
    /// Mistral (`mistral`).
    Mistral,
    /// Qwen2/Qwen2.5 (`qwen2`): bias on Q/K/V.
    Qwen2,
    /// Qwen3 dense (`qwen3`): RMSNorm on Q and K per head.
    Qwen3,
    /// Mixtral (`mixtral`): every MLP is a top-k MoE.
    Mixtral,
    /// Qwen3 MoE (`qwen3_moe`).
    Qwen3Moe,
    /// DeepSeek-V3 (`deepseek_v3`): MLA attention, shared + routed experts.
    DeepseekV3,
    /// gpt-oss (`gpt_oss`): biased attention with sinks, MXFP4 experts.
    GptOss,
}

/// Mixture-of-experts shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub n_experts: u64,
    /// Experts each token is routed to (top-k).
    pub n_experts_per_token: u64,
    /// Intermediate size of one routed expert.
    pub expert_intermediate_size: u64,
    /// Always-active shared experts per MoE layer (DeepSeek), each of `expert_intermediate_size`.
    pub n_shared_experts: u64,
    /// Leading layers with a dense MLP of `intermediate_size` instead of experts.
    pub n_dense_layers: u64,
    /// Biases on expert projections and the router (gpt-oss).
    pub expert_bias: bool,
}

/// Multi-head latent attention shape (DeepSeek-V2/V3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// Rank of the query down-projection; `None` when queries are projected directly.
    pub q_lora_rank: Option<u64>,
    /// Rank of the compressed KV latent (what the cache stores).
    pub kv_lora_rank: u64,
    /// Per-head dims of the non-rotary and rotary query/key parts, and of values.
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// Storage type of weights or KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp8,
    Int8,
    /// 4-bit weights with group-128 fp16 scales and zeros (AWQ/GPTQ).
    Int4,
    /// OCP microscaling FP4: 32 × 4-bit values share one 8-bit scale.
    Mxfp4,
    /// Exact bytes from the file (GGUF): the per-parameter figure is an average.
    Gguf,
    /// ggml's Q4_0: blocks of 32 4-bit weights with one f16 scale, 18 bytes per 32, in every
    /// matrix and the LM head (llama.cpp's `--pure` quantization, the CPU engine's random
    /// weights): what the CPU engine runs int4 as.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// ggml's Q8_0: blocks of 32 8-bit weights with one f16 scale, 34 bytes per 32, as Q4_0:
    /// what the CPU engine runs int8 as.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl Dtype {
    /// Bytes per parameter, scales included: int4 is 4 bits + 32 bits of scale/zero per 128
    /// (AWQ group size), MXFP4 4 bits + 8 bits per 32 (OCP MX spec v1.0).
    pub fn bytes_per_param(self) -> f64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 | Dtype::Int8 => 1.0,
            Dtype::Int4 => 0.5 + 4.0 / 128.0,
            Dtype::Mxfp4 => 0.5 + 1.0 / 32.0,
            Dtype::Gguf => 2.0,
            Dtype::Q4_0 => 18.0 / 32.0,
            Dtype::Q8_0 => 34.0 / 32.0,
        }
    }

    /// The type the CPU engine runs this weight dtype in: int4 as [`Dtype::Q4_0`] and int8
    /// as [`Dtype::Q8_0`] (it runs no AWQ, GPTQ or W8A8 kernels); every other as it is.
    pub fn on_cpu(self) -> Dtype {
        match self {
            Dtype::Int4 => Dtype::Q4_0,
            Dtype::Int8 => Dtype::Q8_0,
            other => other,
        }
    }

    /// Whether every matrix, the LM head and the embedding are in this type (ggml's block
    /// types), rather than the linear layers only, with the tables in 16 bits (vLLM's
    /// quantized checkpoints).
    fn quantizes_tables(self) -> bool {
        matches!(self, Dtype::Q4_0 | Dtype::Q8_0)
    }

    /// The name vLLM's `--quantization` uses, or `None` for unquantized dtypes.
    pub fn vllm_quantization(self) -> Option<&'static str> {
        match self {
            Dtype::Fp8 => Some("fp8"),
            Dtype::Int8 => Some("experts_int8"),
            Dtype::Int4 => Some("awq"),
            Dtype::Mxfp4 => Some("mxfp4"),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Int8 => "int8",
            Dtype::Int4 => "int4",
            Dtype::Mxfp4 => "mxfp4",
            Dtype::Gguf => "gguf",
            Dtype::Q4_0 => "q4_0",
            Dtype::Q8_0 => "q8_0",
        })
    }
}

impl FromStr for Dtype {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(match text.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp16" | "float16" | "half" => Dtype::Fp16,
            "fp8" | "fp8_e4m3" | "e4m3" => Dtype::Fp8,
            "int8" | "w8a8" => Dtype::Int8,
            "int4" | "awq" | "gptq" => Dtype::Int4,
            "mxfp4" => Dtype::Mxfp4,
            "q4_0" => Dtype::Q4_0,
            "q8_0" => Dtype::Q8_0,
            _ => {
                return Err(format!(
                    "unknown dtype `{text}`; expected bf16, fp16, fp8, int8, int4 (awq), mxfp4, q4_0 or q8_0"
                ));
            }
        })
    }
}

/// A decoder-only transformer's shape: everything the memory and cost models need.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Display name (`llama-3.1-70b`).
    pub name: String,
    /// Where the weights would come from for `vllm serve` (a Hugging Face id or a path).
    pub serve_id: String,
    pub architecture: Architecture,
    pub hidden_size: u64,
    /// Dense MLP intermediate size (also the dense layers of a MoE model).
    pub intermediate_size: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    /// Bias on Q/K/V projections (Qwen2, gpt-oss).
    pub qkv_bias: bool,
    /// Bias on the output projection (gpt-oss).
    pub o_bias: bool,
    /// Per-head RMSNorm on Q and K (Qwen3).
    pub qk_norm: bool,
    /// Longest context the model was trained for, in tokens.
    pub max_position_embeddings: u64,
    pub moe: Option<MoeSpec>,
    pub mla: Option<MlaSpec>,
    /// Dtype of the linear weights as the checkpoint stores them.
    pub native_dtype: Dtype,
    /// Dtype of the routed experts when it differs from `native_dtype` (gpt-oss: MXFP4).
    pub expert_dtype: Option<Dtype>,
    /// Exact weight bytes of the file (GGUF, safetensors); `None` for profiles.
    pub file_weight_bytes: Option<u64>,
}

/// Parameter counts by where they live when sharded. All counts are whole-model totals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ParamCounts {
    /// Token embedding (`vocab × hidden`), first PP stage, vocab-parallel across TP.
    pub embedding: u64,
    /// LM head (`vocab × hidden`, 0 when tied), last PP stage, vocab-parallel across TP.
    pub lm_head: u64,
    /// Attention projections of all layers (TP-sharded).
    pub attention: u64,
    /// Dense MLPs and shared experts of all layers (TP-sharded).
    pub dense_mlp: u64,
    /// Routed experts of all layers (TP- or EP-sharded).
    pub routed_experts: u64,
    /// Norms and routers (replicated on every rank of a stage).
    pub replicated: u64,
}

impl ParamCounts {
    /// Every parameter.
    pub fn total(&self) -> u64 {
        self.embedding
            + self.lm_head
            + self.attention
            + self.dense_mlp
            + self.routed_experts
            + self.replicated
    }
}

impl ModelSpec {
    /// KV heads each TP rank stores: `max(1, n_kv_heads / tp)` (heads replicate when
    /// `tp > n_kv_heads`, as in vLLM).
    pub fn kv_heads_per_rank(&self, tp: u64) -> u64 {
        (self.n_kv_heads / tp).max(1)
    }

    /// Number of MoE layers (0 for dense models).
    pub fn n_moe_layers(&self) -> u64 {
        self.moe.as_ref().map_or(0, |moe| {
            self.n_layers - moe.n_dense_layers.min(self.n_layers)
        })
    }

    /// KV-cache bytes per token on one GPU holding `n_layers_on_gpu` layers with TP degree `tp`.
    ///
    /// Standard attention: `2 · layers · max(1, kv_heads / tp) · head_dim · kv_bytes` (K and V).
    /// MLA caches the compressed latent and the rotary key once, not per head and not split
    /// by TP: `layers · (kv_lora_rank + qk_rope_head_dim) · kv_bytes` (DeepSeek-V2 paper §2.1;
    /// vLLM's MLA backend).
    pub fn kv_bytes_per_token(&self, n_layers_on_gpu: u64, tp: u64, kv_dtype: Dtype) -> u64 {
        let kv_bytes = kv_dtype.bytes_per_param() as u64;
        match &self.mla {
            Some(mla) => n_layers_on_gpu * (mla.kv_lora_rank + mla.qk_rope_head_dim) * kv_bytes,
            None => 2 * n_layers_on_gpu * self.kv_heads_per_rank(tp) * self.head_dim * kv_bytes,
        }
    }

    /// Parameter counts by part, from the architecture's layer formulas (the shapes of the
    /// Hugging Face `modeling_*.py` modules).
    pub fn param_counts(&self) -> ParamCounts {
        let h = self.hidden_size;
        let q_dim = self.n_heads * self.head_dim;
        let kv_dim = self.n_kv_heads * self.head_dim;
        let attention_per_layer = match &self.mla {
            Some(mla) => {
                let qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
                let q = match mla.q_lora_rank {
                    Some(rank) => h * rank + rank * self.n_heads * qk_head,
                    None => h * self.n_heads * qk_head,
                };
                let kv_down = h * (mla.kv_lora_rank + mla.qk_rope_head_dim);
                let kv_up =
                    mla.kv_lora_rank * self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim);
                let o = self.n_heads * mla.v_head_dim * h;
                q + kv_down + kv_up + o
            }
            None => {
                let mut params = h * q_dim + 2 * h * kv_dim + q_dim * h;
                if self.qkv_bias {
                    params += q_dim + 2 * kv_dim;
                }
                if self.o_bias {
                    params += h;
                }
                params
            }
        };
        let mut replicated_per_layer = 2 * h;
        if self.qk_norm {
            replicated_per_layer += 2 * self.head_dim;
        }
        if let Some(mla) = &self.mla {
            replicated_per_layer += mla.kv_lora_rank + mla.q_lora_rank.unwrap_or(0);
        }
        if self.architecture == Architecture::GptOss {
            // Attention sinks: one learned logit per head.
            replicated_per_layer += self.n_heads;
        }
        let dense_mlp_per_layer = 3 * h * self.intermediate_size;
        let (n_moe_layers, n_dense_layers) =
            (self.n_moe_layers(), self.n_layers - self.n_moe_layers());
        let (routed, shared, router) = match &self.moe {
            Some(moe) => {
                let expert = 3 * h * moe.expert_intermediate_size
                    + if moe.expert_bias {
                        2 * moe.expert_intermediate_size + h
                    } else {
                        0
                    };
                let router = h * moe.n_experts
                    + if moe.expert_bias || self.architecture == Architecture::DeepseekV3 {
                        moe.n_experts
                    } else {
                        0
                    };
                (
                    moe.n_experts * expert,
                    moe.n_shared_experts * 3 * h * moe.expert_intermediate_size,
                    router,
                )
            }
            None => (0, 0, 0),
        };
        let embedding = self.vocab_size * h;
        ParamCounts {
            embedding,
            lm_head: if self.tie_word_embeddings {
                0
            } else {
                embedding
            },
            attention: self.n_layers * attention_per_layer,
            dense_mlp: n_dense_layers * dense_mlp_per_layer + n_moe_layers * shared,
            routed_experts: n_moe_layers * routed,
            replicated: self.n_layers * replicated_per_layer + n_moe_layers * router + h,
        }
    }

    /// Parameters touched per token: routed experts count `top_k / n_experts` of their total.
    pub fn active_params(&self) -> u64 {
        let counts = self.param_counts();
        let routed_active = match &self.moe {
            Some(moe) => counts.routed_experts / moe.n_experts * moe.n_experts_per_token,
            None => 0,
        };
        counts.total() - counts.routed_experts + routed_active
    }

    /// Whole-model weight bytes in `dtype` (linear layers; embeddings, LM head and norms stay
    /// 16-bit as vLLM keeps them, but for ggml's block types, which hold the tables too), or
    /// the file's exact bytes when `dtype` is the checkpoint's own.
    pub fn weight_bytes(&self, dtype: Dtype) -> u64 {
        let parts = self.weight_bytes_by_part(dtype);
        parts.total()
    }

    /// Parameters of the row-parallel products of all layers: the attention output
    /// projection (`n_heads · head_dim × hidden`, or MLA's `n_heads · v_head_dim × hidden`)
    /// and the down projection of the dense MLPs and shared experts (a third of
    /// [`ParamCounts::dense_mlp`]); Megatron-LM splits these by input columns and sums them
    /// across TP, and the CPU engine runs them in exact order ([`crate::plan::cluster::CpuRowChain`]).
    /// Routed experts are not counted.
    pub fn row_parallel_params(&self) -> u64 {
        let v_dim = match &self.mla {
            Some(mla) => self.n_heads * mla.v_head_dim,
            None => self.n_heads * self.head_dim,
        };
        v_dim * self.hidden_size * self.n_layers + self.param_counts().dense_mlp / 3
    }

    /// Bytes of [`ModelSpec::row_parallel_params`] in `dtype`, at the bytes per parameter of
    /// the attention and dense MLP weights ([`ModelSpec::weight_bytes_by_part`]).
    pub fn row_parallel_bytes(&self, dtype: Dtype) -> f64 {
        let (params, bytes) = (self.param_counts(), self.weight_bytes_by_part(dtype));
        let layer_params = (params.attention + params.dense_mlp).max(1) as f64;
        self.row_parallel_params() as f64 * (bytes.attention + bytes.dense_mlp) as f64
            / layer_params
    }

    /// Weight bytes split like [`ParamCounts`]; each field is bytes instead of parameters.
    pub fn weight_bytes_by_part(&self, dtype: Dtype) -> ParamCounts {
        let counts = self.param_counts();
        if let (true, Some(file_bytes)) = (dtype == self.native_dtype, self.file_weight_bytes) {
            // The checkpoint's exact bytes, spread over the parts in proportion to their
            // parameters; the rounding remainder goes to the attention part so the sum is exact.
            let total = counts.total().max(1) as f64;
            let share = |params: u64| (file_bytes as f64 * params as f64 / total) as u64;
            let mut parts = ParamCounts {
                embedding: share(counts.embedding),
                lm_head: share(counts.lm_head),
                attention: share(counts.attention),
                dense_mlp: share(counts.dense_mlp),
                routed_experts: share(counts.routed_experts),
                replicated: share(counts.replicated),
            };
            parts.attention += file_bytes - parts.total();
            return parts;
        }
        let linear = |params: u64, dtype: Dtype| (params as f64 * dtype.bytes_per_param()) as u64;
        let expert_dtype = match (self.expert_dtype, dtype == self.native_dtype) {
            (Some(expert), true) => expert,
            _ => dtype,
        };
        let table = |params: u64| {
            if dtype.quantizes_tables() {
                linear(params, dtype)
            } else {
                params * 2
            }
        };
        ParamCounts {
            embedding: table(counts.embedding),
            lm_head: table(counts.lm_head),
            attention: linear(counts.attention, dtype),
            dense_mlp: linear(counts.dense_mlp, dtype),
            routed_experts: linear(counts.routed_experts, expert_dtype),
            replicated: counts.replicated * 2,
        }
    }
}

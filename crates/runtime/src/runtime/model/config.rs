//! A Llama-family model's shape and constants, read from GGUF metadata or `config.json`.

/// How rotary embeddings pair the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF Llama, whose Q/K weights llama.cpp's converter
    /// permuted (llama.cpp's `LLAMA_ROPE_TYPE_NORM`).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: Hugging Face checkpoints (`rotate_half`, NeoX style).
    Neox,
}

/// Llama 3 RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

/// Shape and constants of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3Scaling>,
    /// Longest context the model supports, tokens.
    pub max_context_tokens: usize,
    /// Routed experts per MoE layer (0: dense model) and experts used per token.
    pub n_experts: usize,
    pub n_experts_used: usize,
}

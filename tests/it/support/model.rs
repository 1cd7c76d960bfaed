//! The real model the serving tests run (SmolLM2-135M-Instruct, Q4_1): where it is, the facts
//! tests compute expected numbers from, and the prompts several tests ask of it.

use std::path::PathBuf;

/// The real SmolLM2 GGUF file, fetched and checked against its sha256 the first time (the same
/// cache `infer up` uses without `--model`); panics when it cannot be fetched.
pub fn smollm2() -> PathBuf {
    infer::model::default::ensure(&mut |_| {}).expect("the default model can be fetched")
}

/// SmolLM2-135M's layers.
pub const SMOLLM2_LAYERS: u64 = 30;

/// SmolLM2's KV bytes per position: 30 layers × (keys, values) × 3 KV heads × 64 dims × f16.
pub const KV_BYTES_PER_TOKEN: u64 = SMOLLM2_LAYERS * 2 * 3 * 64 * 2;

/// A system prompt of several KV blocks, shared by the prefix-cache and scheduling tests.
pub const SYSTEM: &str = "You are a careful assistant for a team that runs inference on racks of GPU \
servers. Answer in one short sentence, name units, and never invent numbers you were not given. \
When a question is about bandwidth, remember that HBM is faster than NVLink, which is faster than \
PCIe, InfiniBand and Ethernet, in that order.";

/// Questions asked after [`SYSTEM`].
pub const QUESTIONS: [&str; 8] = [
    "What is a KV cache?",
    "Why does tensor parallelism need a fast link?",
    "What does TTFT measure?",
    "Name one way to reduce decode latency.",
    "What is prefill?",
    "Is Ethernet faster than NVLink?",
    "What is a rank?",
    "What does an all-reduce do?",
];

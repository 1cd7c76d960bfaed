//! Quantized matrix products on SmolLM2's shapes: `Weight::matmul` for `Q4_1` (every linear
//! layer of the model) and `Q8_0` (its LM head) against 1, 4 and 16 tokens, on 1 and 2
//! threads, in both rounding orders (`Numerics`). Prints GMAC/s (multiply-accumulates per second; one MAC = 2 FLOPs) and µs per
//! call; the weights are random bytes with valid f16 scales.
#![allow(clippy::print_stdout)]

use infer::runtime::formats::ggml::GgmlType;
use std::time::Instant;

use infer::runtime::cpu::quant::Numerics;
use infer::runtime::model::weights::Weight;

/// Deterministic pseudo-random bytes (xorshift64).
fn bytes(n: usize, mut state: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A matrix of `ty` whose block scales are small finite f16s.
fn matrix(ty: GgmlType, n_rows: usize, n_cols: usize) -> Weight {
    let (block_bytes, scale_bytes) = match ty {
        GgmlType::Q4_1 => (20, 4),
        GgmlType::Q8_0 => (34, 2),
        _ => unreachable!("bench covers Q4_1 and Q8_0"),
    };
    let mut data = bytes(n_rows * n_cols / 32 * block_bytes, 0x9E37_79B9);
    for block in data.chunks_exact_mut(block_bytes) {
        for half in block[..scale_bytes].chunks_exact_mut(2) {
            half.copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    Weight::from_bytes(ty, n_rows, n_cols, data).expect("shape matches")
}

fn main() {
    // `cargo bench --bench matmul -- WORD…`: only the cases whose line has every word.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let shapes = [
        ("q_proj", GgmlType::Q4_1, 576, 576),
        ("gate/up", GgmlType::Q4_1, 1536, 576),
        ("down", GgmlType::Q4_1, 576, 1536),
        ("lm_head", GgmlType::Q8_0, 49152, 576),
    ];
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        let cases = shapes
            .iter()
            .flat_map(|shape| [Numerics::Exact, Numerics::Fast].map(|n| (*shape, n)));
        for ((name, ty, n_rows, n_cols), numerics) in cases {
            let order = format!("{numerics:?}").to_lowercase();
            let case = |n_tokens: usize| {
                format!("threads {threads} {name} {ty:?} {order} tokens {n_tokens}")
            };
            let wanted =
                |n_tokens: usize| filters.iter().all(|f| case(n_tokens).contains(f.as_str()));
            if ![1, 4, 16].into_iter().any(wanted) {
                continue;
            }
            let mut weight = matrix(ty, n_rows, n_cols);
            weight.set_numerics(numerics);
            weight.pack();
            for n_tokens in [1, 4, 16].into_iter().filter(|n| wanted(*n)) {
                let x: Vec<f32> = (0..n_tokens * n_cols)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut out = vec![0f32; n_tokens * n_rows];
                let macs = (n_rows * n_cols * n_tokens) as f64;
                let iterations = ((2e9 / macs) as usize).clamp(5, 20_000);
                let secs = pool.install(|| {
                    weight.matmul(&x, n_tokens, &mut out);
                    let start = Instant::now();
                    for _ in 0..iterations {
                        weight.matmul(std::hint::black_box(&x), n_tokens, &mut out);
                    }
                    start.elapsed().as_secs_f64() / iterations as f64
                });
                println!(
                    "threads {threads}  {name:>8} {ty:?} {order:>5} {n_rows:>5}x{n_cols:<5} tokens {n_tokens:>2}: {:>8.1} us  {:>6.1} GMAC/s",
                    secs * 1e6,
                    macs / secs / 1e9
                );
            }
        }
    }
}

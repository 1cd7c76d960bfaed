//! Every kernel against the CPU backend, on awkward shapes, with llama.cpp's
//! `test-backend-ops` tolerances (normalized mean squared error ≤ 5e-4 for products, 1e-7
//! for everything else). The same checks run on any [`Runner`]: the host harness here
//! (`host::HostKernels`, in the tests) and the GPU (`gpu::GpuRunner`, in `infer smoke`).

use anyhow::Result;
use half::f16;

use super::smoke::Check;
use crate::runtime::cpu::quant::{GgmlType, dequantize_row};

/// NMSE limit of matrix products (test-backend-ops).
pub const NMSE_PRODUCTS: f64 = 5e-4;
/// NMSE limit of every other op (test-backend-ops).
pub const NMSE_OTHERS: f64 = 1e-7;

/// One kernel argument: a buffer the kernel reads, one it writes (or both), or a value.
pub enum Arg<'a> {
    In(&'a [u8]),
    Out(&'a mut [u8]),
    U32(u32),
    F32(f32),
}

/// Something that runs a kernel over a grid: the GPU, or the host harness.
pub trait Runner {
    /// Runs `kernel` over `grid` × `block` threads; `Out` buffers hold the results after.
    ///
    /// Errors: an unknown kernel, arguments that are not its parameters, a launch failure.
    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [Arg<'_>],
    ) -> Result<()>;
}

/// Normalized mean squared error, `Σ (a − b)² / Σ b²` (test-backend-ops' measure).
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let error: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    error / norm.max(f64::MIN_POSITIVE)
}

/// Deterministic values in [−1, 1) (a 64-bit LCG; the seed names the case).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bytes_of<T: Copy>(values: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    values.iter().flat_map(|v| to(*v)).collect()
}

fn f32s(values: &[f32]) -> Vec<u8> {
    bytes_of(values, |v| v.to_ne_bytes().to_vec())
}

fn i32s(values: &[i32]) -> Vec<u8> {
    bytes_of(values, |v| v.to_ne_bytes().to_vec())
}

fn to_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn check(name: &str, error: f64, limit: f64) -> Check {
    Check {
        name: name.to_string(),
        passed: error <= limit,
        detail: format!("NMSE {error:.2e} (limit {limit:.0e})"),
    }
}

fn failed(name: &str, error: anyhow::Error) -> Check {
    Check {
        name: name.to_string(),
        passed: false,
        detail: format!("{error:#}"),
    }
}

/// GGML rows of `ty` with random quants and sane f16 scales (2^-10 to 2^-6): `rows` rows
/// of `cols` values.
pub fn random_rows(ty: GgmlType, seed: u64, rows: usize, cols: usize) -> Vec<u8> {
    let (block_values, block_bytes, scales): (usize, usize, &[usize]) = match ty {
        GgmlType::Q4_0 => (32, 18, &[0]),
        GgmlType::Q4_1 => (32, 20, &[0, 2]),
        GgmlType::Q8_0 => (32, 34, &[0]),
        GgmlType::Q4K => (256, 144, &[0, 2]),
        GgmlType::Q6K => (256, 210, &[208]),
        _ => (32, 4 * 32, &[]),
    };
    let n = rows * cols / block_values * block_bytes;
    let mut bytes: Vec<u8> = values(seed, n)
        .iter()
        .map(|v| ((v + 1.0) * 127.5) as u8)
        .collect();
    let scale_values = values(seed + 1, n / block_bytes * scales.len().max(1));
    for (k, block) in bytes.chunks_mut(block_bytes).enumerate() {
        for (s, &offset) in scales.iter().enumerate() {
            let scale = f16::from_f32(
                (1.0 / 1024.0) * (1.0 + 15.0 * scale_values[k * scales.len() + s].abs()),
            );
            block[offset..offset + 2].copy_from_slice(&scale.to_bits().to_le_bytes());
        }
    }
    bytes
}

/// Runs every check on `runner`.
pub fn run_all(runner: &dyn Runner) -> Vec<Check> {
    let mut checks = Vec::new();
    let mut record = |name: &str, outcome: Result<Check>| {
        checks.push(outcome.unwrap_or_else(|e| failed(name, e)));
    };
    record("rms_norm_f32 3×576", rms_norm(runner));
    record("swiglu_f32 1000", swiglu(runner));
    for neox in [false, true] {
        let name = if neox {
            "rope_neox_f32"
        } else {
            "rope_interleaved_f32"
        };
        record(name, rope(runner, name, neox));
    }
    record("get_rows_f32 7×300", get_rows_f32(runner));
    record("get_rows_q8_0 5×96", get_rows_q8_0(runner));
    for (ty, kernel) in [
        (GgmlType::Q4_0, "mul_mat_vec_q4_0_q8_1"),
        (GgmlType::Q4_1, "mul_mat_vec_q4_1_q8_1"),
        (GgmlType::Q8_0, "mul_mat_vec_q8_0_q8_1"),
        (GgmlType::Q4K, "mul_mat_vec_q4_k_q8_1"),
        (GgmlType::Q6K, "mul_mat_vec_q6_k_q8_1"),
    ] {
        record(kernel, mul_mat_vec(runner, ty, kernel));
    }
    record("paged_attention_f16kv", attention(runner));
    record("argmax_f32", argmax(runner));
    checks
}

fn rms_norm(runner: &dyn Runner) -> Result<Check> {
    // 3 rows of 576 (SmolLM2's width): not a multiple of the 256 threads.
    let (rows, cols) = (3usize, 576usize);
    let (x, w) = (values(1, rows * cols), values(2, cols));
    let mut y = vec![0u8; rows * cols * 4];
    runner.launch(
        "rms_norm_f32",
        [rows as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut y),
            Arg::In(&f32s(&x)),
            Arg::In(&f32s(&w)),
            Arg::U32(cols as u32),
            Arg::F32(1e-5),
        ],
    )?;
    let mut cpu = vec![0f32; rows * cols];
    crate::runtime::model::llama::rms_norm(&x, &w, 1e-5, &mut cpu);
    Ok(check(
        "rms_norm_f32 3×576",
        nmse(&to_f32s(&y), &cpu),
        NMSE_OTHERS,
    ))
}

fn swiglu(runner: &dyn Runner) -> Result<Check> {
    let n = 1000;
    let (gate, up) = (values(3, n), values(4, n));
    let mut out = vec![0u8; n * 4];
    runner.launch(
        "swiglu_f32",
        [n.div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&f32s(&gate)),
            Arg::In(&f32s(&up)),
            Arg::U32(n as u32),
        ],
    )?;
    let cpu: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| crate::runtime::cpu::mathfn::silu(*g) * u)
        .collect();
    Ok(check(
        "swiglu_f32 1000",
        nmse(&to_f32s(&out), &cpu),
        NMSE_OTHERS,
    ))
}

fn rope(runner: &dyn Runner, kernel: &str, neox: bool) -> Result<Check> {
    // 3 tokens × 5 heads × 64 at positions 0, 7 and 4095, against f64 rotations.
    let (tokens, heads, head_dim) = (3usize, 5usize, 64usize);
    let positions: Vec<i32> = vec![0, 7, 4095];
    let inv_freqs: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let original = values(5, tokens * heads * head_dim);
    let mut x = f32s(&original);
    let pairs = tokens * heads * head_dim / 2;
    runner.launch(
        kernel,
        [pairs.div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut x),
            Arg::In(&i32s(&positions)),
            Arg::In(&f32s(&inv_freqs)),
            Arg::U32(tokens as u32),
            Arg::U32(heads as u32),
            Arg::U32(head_dim as u32),
        ],
    )?;
    let mut reference = original.clone();
    for (t, &position) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            for (i, &inv_freq) in inv_freqs.iter().enumerate() {
                let (a, b) = if neox {
                    (base + i, base + i + head_dim / 2)
                } else {
                    (base + 2 * i, base + 2 * i + 1)
                };
                let angle = position as f64 * inv_freq as f64;
                let (x0, x1) = (original[a] as f64, original[b] as f64);
                reference[a] = (x0 * angle.cos() - x1 * angle.sin()) as f32;
                reference[b] = (x0 * angle.sin() + x1 * angle.cos()) as f32;
            }
        }
    }
    Ok(check(kernel, nmse(&to_f32s(&x), &reference), NMSE_OTHERS))
}

fn get_rows_f32(runner: &dyn Runner) -> Result<Check> {
    // Rows 6, 2, 6, 0 of a 7 × 300 f32 table (300: a partial second block of 256 threads).
    let (vocab, dim) = (7usize, 300usize);
    let table = values(10, vocab * dim);
    let ids: Vec<i32> = vec![6, 2, 6, 0];
    let mut out = vec![0u8; ids.len() * dim * 4];
    runner.launch(
        "get_rows_f32",
        [ids.len() as u32, dim.div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&f32s(&table)),
            Arg::In(&i32s(&ids)),
            Arg::U32(dim as u32),
        ],
    )?;
    let expected: Vec<f32> = ids
        .iter()
        .flat_map(|&id| table[id as usize * dim..(id as usize + 1) * dim].to_vec())
        .collect();
    let got = to_f32s(&out);
    Ok(Check {
        name: "get_rows_f32 7×300".into(),
        passed: got == expected,
        detail: if got == expected {
            "the table's rows, bit for bit".into()
        } else {
            "rows differ from the table's".into()
        },
    })
}

fn get_rows_q8_0(runner: &dyn Runner) -> Result<Check> {
    // Rows 4, 0, 4 of a 5 × 96 Q8_0 table: exactly the CPU's dequantized rows.
    let (vocab, dim) = (5usize, 96usize);
    let table = random_rows(GgmlType::Q8_0, 6, vocab, dim);
    let ids: Vec<i32> = vec![4, 0, 4];
    let mut out = vec![0u8; ids.len() * dim * 4];
    runner.launch(
        "get_rows_q8_0",
        [ids.len() as u32, dim.div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&table),
            Arg::In(&i32s(&ids)),
            Arg::U32(dim as u32),
        ],
    )?;
    let row_bytes = dim / 32 * 34;
    let mut cpu = vec![0f32; ids.len() * dim];
    for (k, &id) in ids.iter().enumerate() {
        let id = id as usize;
        dequantize_row(
            GgmlType::Q8_0,
            &table[id * row_bytes..(id + 1) * row_bytes],
            &mut cpu[k * dim..(k + 1) * dim],
        );
    }
    let got = to_f32s(&out);
    Ok(Check {
        name: "get_rows_q8_0 5×96".into(),
        passed: got == cpu,
        detail: if got == cpu {
            "equal to the CPU's dequantized rows, bit for bit".into()
        } else {
            format!(
                "differs from the CPU's rows (NMSE {:.2e})",
                nmse(&got, &cpu)
            )
        },
    })
}

fn mul_mat_vec(runner: &dyn Runner, ty: GgmlType, kernel: &str) -> Result<Check> {
    // 5 rows × 8448 columns (33 super-blocks of 256; 264 blocks of 32 per row, more than the
    // 128 threads), against the f64 product of the CPU's dequantized rows.
    let (n_rows, n_cols) = (5usize, 8448usize);
    let activations = values(8, n_cols);
    let mut quantized = vec![0u8; n_cols / 32 * 40];
    runner.launch(
        "quantize_q8_1",
        [(n_cols / 32) as u32, 1, 1],
        [32, 1, 1],
        &mut [
            Arg::Out(&mut quantized),
            Arg::In(&f32s(&activations)),
            Arg::U32(n_cols as u32),
        ],
    )?;
    let weights = random_rows(ty, 20 + ty as u64, n_rows, n_cols);
    let row_bytes = weights.len() / n_rows;
    let mut product = vec![0u8; n_rows * 4];
    runner.launch(
        kernel,
        [n_rows as u32, 1, 1],
        [128, 1, 1],
        &mut [
            Arg::Out(&mut product),
            Arg::In(&weights),
            Arg::In(&quantized),
            Arg::U32(n_cols as u32),
            Arg::U32(row_bytes as u32),
        ],
    )?;
    let reference: Vec<f32> = (0..n_rows)
        .map(|r| {
            let mut row = vec![0f32; n_cols];
            dequantize_row(ty, &weights[r * row_bytes..(r + 1) * row_bytes], &mut row);
            row.iter()
                .zip(&activations)
                .map(|(w, x)| *w as f64 * *x as f64)
                .sum::<f64>() as f32
        })
        .collect();
    Ok(check(
        kernel,
        nmse(&to_f32s(&product), &reference),
        NMSE_PRODUCTS,
    ))
}

fn attention(runner: &dyn Runner) -> Result<Check> {
    // GQA (6 query heads on 2 KV heads, head_dim 64), blocks scattered over the pool: two
    // decode queries (37 and 600 positions: two tiles of 512) and four prefill queries of
    // the first sequence with their causal lengths, against f64 attention.
    let (n_heads, n_kv_heads, head_dim, n_blocks, block_len) = (6usize, 2usize, 64usize, 60, 16);
    let kv_values = n_blocks * n_kv_heads * block_len * head_dim;
    let to_f16 =
        |v: &[f32]| -> Vec<u16> { v.iter().map(|x| f16::from_f32(*x).to_bits()).collect() };
    let (k_cache, v_cache) = (
        to_f16(&values(50, kv_values)),
        to_f16(&values(51, kv_values)),
    );
    let max_blocks = 38usize;
    let mut tables = vec![0i32; 2 * max_blocks];
    tables[..3].copy_from_slice(&[59, 3, 17]);
    let others: Vec<i32> = (0..59)
        .rev()
        .filter(|b| *b != 3 && *b != 17)
        .take(38)
        .collect();
    tables[max_blocks..].copy_from_slice(&others);
    let table_rows: Vec<i32> = vec![0, 1, 0, 0, 0, 0];
    let context_lens: Vec<i32> = vec![37, 600, 34, 35, 36, 37];
    let n_queries = table_rows.len();
    let queries = values(52, n_queries * n_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let u16s = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let mut out = vec![0u8; queries.len() * 4];
    runner.launch(
        "paged_attention_f16kv",
        [n_heads as u32, n_queries as u32, 1],
        [128, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&f32s(&queries)),
            Arg::In(&u16s(&k_cache)),
            Arg::In(&u16s(&v_cache)),
            Arg::In(&i32s(&tables)),
            Arg::In(&i32s(&table_rows)),
            Arg::In(&i32s(&context_lens)),
            Arg::U32(max_blocks as u32),
            Arg::U32(n_heads as u32),
            Arg::U32(n_kv_heads as u32),
            Arg::U32(head_dim as u32),
            Arg::F32(scale),
        ],
    )?;
    let at = |cache: &[u16], block: i32, kv_head: usize, position: usize, d: usize| {
        let index = ((block as usize * n_kv_heads + kv_head) * block_len + position % block_len)
            * head_dim
            + d;
        f16::from_bits(cache[index]).to_f64()
    };
    let mut reference = vec![0f32; queries.len()];
    for query in 0..n_queries {
        let table = &tables[table_rows[query] as usize * max_blocks..][..max_blocks];
        for head in 0..n_heads {
            let kv_head = head / (n_heads / n_kv_heads);
            let q = &queries[(query * n_heads + head) * head_dim..][..head_dim];
            let len = context_lens[query] as usize;
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    q.iter()
                        .enumerate()
                        .map(|(d, qd)| {
                            *qd as f64 * at(&k_cache, table[p / block_len], kv_head, p, d)
                        })
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..head_dim {
                let value: f64 = weights
                    .iter()
                    .enumerate()
                    .map(|(p, w)| w * at(&v_cache, table[p / block_len], kv_head, p, d))
                    .sum();
                reference[(query * n_heads + head) * head_dim + d] = (value / total) as f32;
            }
        }
    }
    Ok(check(
        "paged_attention_f16kv",
        nmse(&to_f32s(&out), &reference),
        NMSE_OTHERS,
    ))
}

fn argmax(runner: &dyn Runner) -> Result<Check> {
    // Two rows of 1000 logits; the second with a tie at 10 and 900: the lowest index wins,
    // as the CPU's argmax.
    let vocab = 1000;
    let mut logits = values(9, 2 * vocab);
    logits[vocab + 10] = 5.0;
    logits[vocab + 900] = 5.0;
    let mut chosen = vec![0u8; 8];
    runner.launch(
        "argmax_f32",
        [2, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut chosen),
            Arg::In(&f32s(&logits)),
            Arg::U32(vocab as u32),
        ],
    )?;
    let got: Vec<u32> = chosen
        .chunks_exact(4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect();
    let cpu: Vec<u32> = logits
        .chunks_exact(vocab)
        .map(crate::runtime::model::sampling::argmax)
        .collect();
    Ok(Check {
        name: "argmax_f32".into(),
        passed: got == cpu && got[1] == 10,
        detail: format!("{got:?}, the CPU's {cpu:?}"),
    })
}

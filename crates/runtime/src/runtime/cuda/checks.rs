//! Every kernel against the CPU backend, on awkward shapes, with llama.cpp's
//! `test-backend-ops` tolerances (normalized mean squared error ≤ 5e-4 for products, 1e-7
//! for everything else). The same checks run on any [`Runner`]: the host harness here
//! (`host::HostKernels`, in the tests) and the GPU (`gpu::GpuRunner`, in `infer smoke`).

use crate::runtime::formats::ggml::GgmlType;
use anyhow::Result;
use half::f16;

use super::backend::split_blocks;
use crate::runtime::backend::{bytes_of, f32s_of, nmse};
use crate::runtime::cpu::quant::dequantize_row;

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// NMSE limit of matrix products (test-backend-ops).
pub const NMSE_PRODUCTS: f64 = 5e-4;
/// NMSE limit of every other op (test-backend-ops).
pub(crate) const NMSE_OTHERS: f64 = 1e-7;

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
    record("rms_norm_q8_1_f32 3×576", rms_norm_q8_1(runner));
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
        let x8 = format!("{kernel}_x8");
        record(&x8, mul_mat_vec(runner, ty, &x8));
    }
    for (ty, kernel) in [
        (GgmlType::F32, "mul_mat_vec_f32"),
        (GgmlType::F16, "mul_mat_vec_f16"),
        (GgmlType::Bf16, "mul_mat_vec_bf16"),
    ] {
        record(kernel, mul_mat_vec_float(runner, ty, kernel));
        let x8 = format!("{kernel}_x8");
        record(&x8, mul_mat_vec_float(runner, ty, &x8));
    }
    for (ty, kernel) in [
        (GgmlType::Q4_0, "mul_mat_vec_q4_0_q8_1"),
        (GgmlType::Q4_0, "mul_mat_vec_q4_0_q8_1_x8"),
        (GgmlType::Bf16, "mul_mat_vec_bf16"),
    ] {
        record(kernel, mul_mat_vec_fused(runner, ty, kernel));
    }
    for (ty, kernel) in [
        (GgmlType::Q4_0, "dequantize_q4_0_f16"),
        (GgmlType::Q4_1, "dequantize_q4_1_f16"),
        (GgmlType::Q8_0, "dequantize_q8_0_f16"),
        (GgmlType::Q4K, "dequantize_q4_k_f16"),
        (GgmlType::Q6K, "dequantize_q6_k_f16"),
    ] {
        record(kernel, dequantize(runner, ty, kernel));
    }
    for bf16 in [false, true] {
        let name = if bf16 {
            "convert_f32_bf16"
        } else {
            "convert_f32_f16"
        };
        record(name, convert(runner, bf16));
    }
    record("add_f32 1000", add(runner));
    record("add_bias_f32 3×300", add_bias(runner));
    record("scale_add_rows_f32 3 of 5×300", scale_add_rows(runner));
    record("store_kv_f16", store_kv(runner));
    for neox in [false, true] {
        record("rope_store_kv_f16", rope_store_kv(runner, neox));
    }
    record("read_kv_blocks 3 of 5", read_kv_blocks(runner));
    record("write_kv_blocks 2 of 5", write_kv_blocks(runner));
    record("paged_attention_f16kv", attention(runner));
    record("argmax_partial_f32 + argmax_combine_f32", argmax(runner));
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
            Arg::In(&bytes_of(&x)),
            Arg::In(&bytes_of(&w)),
            Arg::U32(cols as u32),
            Arg::F32(1e-5),
        ],
    )?;
    let mut cpu = vec![0f32; rows * cols];
    crate::runtime::model::llama::rms_norm(&x, &w, 1e-5, &mut cpu);
    Ok(check(
        "rms_norm_f32 3×576",
        nmse(&f32s_of(&y), &cpu),
        NMSE_OTHERS,
    ))
}

fn rms_norm_q8_1(runner: &dyn Runner) -> Result<Check> {
    // The same 3 rows of 576, normed and quantized in one kernel: the f32 rows as
    // rms_norm_f32's, and the Q8_1 blocks exactly quantize_q8_1's of them.
    let (rows, cols) = (3usize, 576usize);
    let (x, w) = (values(1, rows * cols), values(2, cols));
    let mut y = vec![0u8; rows * cols * 4];
    let mut yq = vec![0u8; rows * cols / 32 * 40];
    runner.launch(
        "rms_norm_q8_1_f32",
        [rows as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut y),
            Arg::Out(&mut yq),
            Arg::In(&bytes_of(&x)),
            Arg::In(&bytes_of(&w)),
            Arg::U32(cols as u32),
            Arg::F32(1e-5),
        ],
    )?;
    let mut cpu = vec![0f32; rows * cols];
    crate::runtime::model::llama::rms_norm(&x, &w, 1e-5, &mut cpu);
    let normed = f32s_of(&y);
    let same_blocks = yq == quantize_q8_1(runner, &normed)?;
    let error = nmse(&normed, &cpu);
    Ok(Check {
        name: "rms_norm_q8_1_f32 3×576".into(),
        passed: error <= NMSE_OTHERS && same_blocks,
        detail: format!(
            "NMSE {error:.2e} (limit {NMSE_OTHERS:.0e}); Q8_1 blocks {}",
            if same_blocks {
                "equal to quantize_q8_1's"
            } else {
                "differ from quantize_q8_1's"
            }
        ),
    })
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
            Arg::In(&bytes_of(&gate)),
            Arg::In(&bytes_of(&up)),
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
        nmse(&f32s_of(&out), &cpu),
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
    let mut x = bytes_of(&original);
    let pairs = tokens * heads * head_dim / 2;
    runner.launch(
        kernel,
        [pairs.div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut x),
            Arg::In(&bytes_of(&positions)),
            Arg::In(&bytes_of(&inv_freqs)),
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
    Ok(check(kernel, nmse(&f32s_of(&x), &reference), NMSE_OTHERS))
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
            Arg::In(&bytes_of(&table)),
            Arg::In(&bytes_of(&ids)),
            Arg::U32(dim as u32),
        ],
    )?;
    let expected: Vec<f32> = ids
        .iter()
        .flat_map(|&id| table[id as usize * dim..(id as usize + 1) * dim].to_vec())
        .collect();
    let got = f32s_of(&out);
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
            Arg::In(&split_blocks(GgmlType::Q8_0, &table)),
            Arg::In(&bytes_of(&ids)),
            Arg::U32(dim as u32),
            Arg::U32(vocab as u32),
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
    let got = f32s_of(&out);
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

/// `activations` (`n_values` f32) as split Q8_1 blocks, by `quantize_q8_1`.
fn quantize_q8_1(runner: &dyn Runner, activations: &[f32]) -> Result<Vec<u8>> {
    let n_blocks = activations.len() / 32;
    let mut quantized = vec![0u8; n_blocks * 40];
    runner.launch(
        "quantize_q8_1",
        [n_blocks as u32, 1, 1],
        [32, 1, 1],
        &mut [
            Arg::Out(&mut quantized),
            Arg::In(&bytes_of(activations)),
            Arg::U32(activations.len() as u32),
        ],
    )?;
    Ok(quantized)
}

/// Threads, rows and tokens of one block of the `mul_mat_vec_*` kernels (`MMV_THREADS`,
/// `MMV_ROWS`, 1) and of the `_x8` ones (`MMV_THREADS`, `MMV_ROWS_X8`, `MMV_TOKENS` in
/// `kernels/matvec.cu`).
fn mmv_block(kernel: &str) -> (u32, usize, usize) {
    if kernel.ends_with("_x8") {
        (128, 2, 8)
    } else {
        (128, 4, 1)
    }
}

/// One `mul_mat_vec_*` launch over up to three `(weights as the device holds them, n_rows)`
/// with their outputs `ys` (in swiglu mode (2), `ys[0]` gets the result and the second
/// product's output is not written), on `x` (split Q8_1 blocks, or f32).
#[allow(clippy::too_many_arguments)]
fn launch_mul_mat_vec(
    runner: &dyn Runner,
    kernel: &str,
    ys: &mut [Vec<u8>],
    weights: &[(&[u8], usize)],
    x: &[u8],
    n_cols: usize,
    n_tokens: usize,
    mode: u32,
) -> Result<()> {
    let (threads, rows_per_tile, tokens_per_block) = mmv_block(kernel);
    let tiles: usize = if mode == 2 {
        weights[0].1.div_ceil(rows_per_tile / 2)
    } else {
        weights
            .iter()
            .map(|(_, rows)| rows.div_ceil(rows_per_tile))
            .sum()
    };
    let mut spare: Vec<Vec<u8>> = (ys.len()..3).map(|_| vec![0u8; 4]).collect();
    let mut outs = ys.iter_mut().chain(spare.iter_mut());
    let mut args = Vec::new();
    for m in 0..3 {
        let y = outs.next().expect("three outputs");
        let (w, rows) = weights.get(m).copied().unwrap_or((weights[0].0, 0));
        args.extend([Arg::Out(y), Arg::In(w), Arg::U32(rows as u32)]);
    }
    args.extend([
        Arg::In(x),
        Arg::U32(n_cols as u32),
        Arg::U32(n_tokens as u32),
        Arg::U32(mode),
    ]);
    runner.launch(
        kernel,
        [(tiles * n_tokens.div_ceil(tokens_per_block)) as u32, 1, 1],
        [threads, 1, 1],
        &mut args,
    )
}

fn mul_mat_vec(runner: &dyn Runner, ty: GgmlType, kernel: &str) -> Result<Check> {
    // 5 rows (a partial tile) × 8448 columns (33 super-blocks of 256; 264 blocks of 32 per
    // row, more than the 128 threads) times 2 activation rows, or for the `_x8` kernels 11
    // (a block of 8 tokens and one of 3), against the f64 products of the CPU's dequantized
    // rows.
    let n_tokens = if kernel.ends_with("_x8") { 11 } else { 2 };
    let (n_rows, n_cols) = (5usize, 8448usize);
    let activations = values(8, n_tokens * n_cols);
    let quantized = quantize_q8_1(runner, &activations)?;
    let weights = random_rows(ty, 20 + ty as u64, n_rows, n_cols);
    let mut product = vec![vec![0u8; n_tokens * n_rows * 4]];
    launch_mul_mat_vec(
        runner,
        kernel,
        &mut product,
        &[(&split_blocks(ty, &weights), n_rows)],
        &quantized,
        n_cols,
        n_tokens,
        0,
    )?;
    let reference = reference_products(ty, &weights, &activations, n_rows, n_cols);
    Ok(check(
        &format!("{kernel} {n_tokens}×{n_rows}×{n_cols}"),
        nmse(&f32s_of(&product[0]), &reference),
        NMSE_PRODUCTS,
    ))
}

/// The fused forms of a `mul_mat_vec_*` kernel, against the CPU's f64 products: three
/// matrices of one input in one launch (Q, K and V: 6, 3 and 9 rows), a product added to a
/// residual, and SwiGLU of a gate and an up projection (7 rows each), for 2 tokens (5 for
/// the `_x8` kernels).
fn mul_mat_vec_fused(runner: &dyn Runner, ty: GgmlType, kernel: &str) -> Result<Check> {
    let n_cols = 256usize;
    let n_tokens = if kernel.ends_with("_x8") { 5 } else { 2 };
    let activations = values(90, n_tokens * n_cols);
    let quantized = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16);
    let x = if quantized {
        quantize_q8_1(runner, &activations)?
    } else {
        bytes_of(&activations)
    };
    let encode = |seed: u64, rows: usize| match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            float_rows(ty, &values(seed, rows * n_cols))
        }
        _ => random_rows(ty, seed, rows, n_cols),
    };
    let reference = |w: &[u8], rows: usize| reference_products(ty, w, &activations, rows, n_cols);
    let mut errors = Vec::new();
    // Three products of one input.
    let rows = [6usize, 3, 9];
    let weights: Vec<Vec<u8>> = rows
        .iter()
        .enumerate()
        .map(|(m, &r)| encode(91 + m as u64, r))
        .collect();
    let held: Vec<_> = weights.iter().map(|w| split_blocks(ty, w)).collect();
    let mut ys: Vec<Vec<u8>> = rows.iter().map(|r| vec![0u8; n_tokens * r * 4]).collect();
    let products: Vec<(&[u8], usize)> = held.iter().map(|w| &w[..]).zip(rows).collect();
    launch_mul_mat_vec(runner, kernel, &mut ys, &products, &x, n_cols, n_tokens, 0)?;
    for ((y, w), r) in ys.iter().zip(&weights).zip(rows) {
        errors.push(nmse(&f32s_of(y), &reference(w, r)));
    }
    // Added to a residual.
    let residual = values(95, n_tokens * 9);
    let mut y = vec![bytes_of(&residual)];
    launch_mul_mat_vec(
        runner,
        kernel,
        &mut y,
        &[(&held[2], 9)],
        &x,
        n_cols,
        n_tokens,
        1,
    )?;
    let expected: Vec<f32> = reference(&weights[2], 9)
        .iter()
        .zip(&residual)
        .map(|(p, r)| p + r)
        .collect();
    errors.push(nmse(&f32s_of(&y[0]), &expected));
    // SwiGLU of a gate and an up projection.
    let (gate, up) = (encode(96, 7), encode(97, 7));
    let mut y = vec![vec![0u8; n_tokens * 7 * 4], vec![0u8; 4]];
    launch_mul_mat_vec(
        runner,
        kernel,
        &mut y,
        &[(&split_blocks(ty, &gate), 7), (&split_blocks(ty, &up), 7)],
        &x,
        n_cols,
        n_tokens,
        2,
    )?;
    let expected: Vec<f32> = reference(&gate, 7)
        .iter()
        .zip(reference(&up, 7))
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    errors.push(nmse(&f32s_of(&y[0]), &expected));
    let worst = errors.iter().copied().fold(0.0, f64::max);
    Ok(check(
        &format!("{kernel} fused: QKV, += residual, SwiGLU"),
        worst,
        NMSE_PRODUCTS,
    ))
}

/// `(n_tokens, n_rows)` f64 products of the CPU's dequantized rows with each activation row.
fn reference_products(
    ty: GgmlType,
    weights: &[u8],
    activations: &[f32],
    n_rows: usize,
    n_cols: usize,
) -> Vec<f32> {
    let row_bytes = weights.len() / n_rows;
    let rows: Vec<Vec<f32>> = (0..n_rows)
        .map(|r| {
            let mut row = vec![0f32; n_cols];
            dequantize_row(ty, &weights[r * row_bytes..(r + 1) * row_bytes], &mut row);
            row
        })
        .collect();
    activations
        .chunks_exact(n_cols)
        .flat_map(|x| {
            rows.iter().map(move |row| {
                row.iter()
                    .zip(x)
                    .map(|(w, x)| *w as f64 * *x as f64)
                    .sum::<f64>() as f32
            })
        })
        .collect()
}

/// `values` encoded as `ty`: F16 or BF16 (rounded to nearest), else F32.
fn float_rows(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => bytes_of(values),
    }
}

fn mul_mat_vec_float(runner: &dyn Runner, ty: GgmlType, kernel: &str) -> Result<Check> {
    // 7 rows × 296 columns (37 units of 8 values: not a multiple of the 128 threads) times
    // 2 activation rows, or 13 for the `_x8` kernels (a block of 8 tokens and one of 5).
    let n_tokens = if kernel.ends_with("_x8") { 13 } else { 2 };
    let (n_rows, n_cols) = (7usize, 296usize);
    let activations = values(30, n_tokens * n_cols);
    let weights = float_rows(ty, &values(31 + ty as u64, n_rows * n_cols));
    let mut product = vec![vec![0u8; n_tokens * n_rows * 4]];
    launch_mul_mat_vec(
        runner,
        kernel,
        &mut product,
        &[(&weights, n_rows)],
        &bytes_of(&activations),
        n_cols,
        n_tokens,
        0,
    )?;
    let reference = reference_products(ty, &weights, &activations, n_rows, n_cols);
    Ok(check(
        &format!("{kernel} {n_tokens}×{n_rows}×{n_cols}"),
        nmse(&f32s_of(&product[0]), &reference),
        NMSE_PRODUCTS,
    ))
}

fn dequantize(runner: &dyn Runner, ty: GgmlType, kernel: &str) -> Result<Check> {
    // 3 rows of 768 values (3 super-blocks of 256; for the blocks of 32, 800: a partial
    // second block of 256 threads), against the CPU's dequantized rows rounded to f16.
    let (n_rows, n_cols) = (3usize, if ty.block().0 == 256 { 768 } else { 800 });
    let weights = random_rows(ty, 50 + ty as u64, n_rows, n_cols);
    let row_bytes = weights.len() / n_rows;
    let mut out = vec![0u8; n_rows * n_cols * 2];
    runner.launch(
        kernel,
        [n_rows as u32, n_cols.div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&split_blocks(ty, &weights)),
            Arg::U32(n_rows as u32),
            Arg::U32(n_cols as u32),
        ],
    )?;
    let mut cpu = vec![0f32; n_rows * n_cols];
    for (row, values) in weights.chunks_exact(row_bytes).zip(cpu.chunks_mut(n_cols)) {
        dequantize_row(ty, row, values);
    }
    let expected: Vec<f32> = cpu.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
    let got: Vec<f32> = out
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    Ok(check(
        &format!("{kernel} {n_rows}×{n_cols}"),
        nmse(&got, &expected),
        NMSE_OTHERS,
    ))
}

fn convert(runner: &dyn Runner, bf16: bool) -> Result<Check> {
    // 1000 values (a partial fourth block) and the edges of rounding: ties, the largest
    // half, what overflows it, subnormals, signed zero, infinities and NaN; bit for bit
    // what the `half` crate (the CPU backend's conversions) gives.
    let mut x = values(60, 1000);
    x.extend([
        0.0,
        -0.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        65504.0,
        65520.0,
        -1e6,
        6e-8,
        3e-5,
        1.0e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + 1.0 / 256.0,
        3.0e38,
    ]);
    let kernel = if bf16 {
        "convert_f32_bf16"
    } else {
        "convert_f32_f16"
    };
    let mut out = vec![0u8; x.len() * 2];
    runner.launch(
        kernel,
        [x.len().div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&bytes_of(&x)),
            Arg::U32(x.len() as u32),
        ],
    )?;
    let got: Vec<u16> = out
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let expected: Vec<u16> = x
        .iter()
        .map(|v| {
            if bf16 {
                half::bf16::from_f32(*v).to_bits()
            } else {
                f16::from_f32(*v).to_bits()
            }
        })
        .collect();
    // NaN payloads may differ; any NaN is a NaN.
    let is_nan = |bits: u16| {
        if bf16 {
            half::bf16::from_bits(bits).is_nan()
        } else {
            f16::from_bits(bits).is_nan()
        }
    };
    let wrong: Vec<usize> = (0..x.len())
        .filter(|&i| got[i] != expected[i] && !(is_nan(got[i]) && is_nan(expected[i])))
        .collect();
    Ok(Check {
        name: format!("{kernel} {}", x.len()),
        passed: wrong.is_empty(),
        detail: match wrong.first() {
            None => "the `half` crate's conversions, bit for bit".into(),
            Some(&i) => format!(
                "{} of {} differ; first: {} gave {:#06x}, not {:#06x}",
                wrong.len(),
                x.len(),
                x[i],
                got[i],
                expected[i]
            ),
        },
    })
}

/// The GEMM path of [`super::backend::KernelBackend`]'s products (more than
/// [`super::backend::MAX_MATVEC_TOKENS_QUANTIZED`] tokens: weights dequantized to f16 or taken as
/// they are, activations converted, then the device's GEMM: cuBLAS on a GPU) for every
/// weight type, against the f64 products of the CPU's dequantized rows, within the
/// products' NMSE limit. A device without a GEMM fails every check, saying so.
pub fn gemm_checks<D: super::backend::Device>(device: &D) -> Vec<Check> {
    use crate::runtime::backend::Backend;
    let backend = super::backend::KernelBackend::new(device);
    let n_tokens = super::backend::MAX_MATVEC_TOKENS_QUANTIZED + 4;
    let mut checks = Vec::new();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
    ] {
        // 37 rows; 768 columns for the super-blocks of 256, 800 for the blocks of 32 (a
        // partial block of the dequantize kernel's 256 threads), 300 for float weights.
        let n_rows = 37;
        let n_cols = match ty.block().0 {
            256 => 768,
            32 => 800,
            _ => 300,
        };
        let name = format!("GEMM {ty:?} {n_tokens}×{n_rows}×{n_cols}");
        if !device.has_gemm() {
            checks.push(Check {
                name,
                passed: false,
                detail: format!("{} has no GEMM", device.name()),
            });
            continue;
        }
        let weights = match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
                float_rows(ty, &values(70 + ty as u64, n_rows * n_cols))
            }
            _ => random_rows(ty, 70 + ty as u64, n_rows, n_cols),
        };
        let activations = values(71, n_tokens * n_cols);
        let run = || -> Result<Vec<f32>> {
            let w = backend.upload_matrix(ty, n_rows, n_cols, &weights)?;
            let x = backend.upload(&bytes_of(&activations))?;
            let y = backend.zeros(n_tokens * n_rows * 4)?;
            backend.matmul(&y, &w, &x, n_tokens)?;
            Ok(f32s_of(&backend.download(&y, n_tokens * n_rows * 4)?))
        };
        checks.push(match run() {
            Ok(got) => {
                let reference = reference_products(ty, &weights, &activations, n_rows, n_cols);
                check(&name, nmse(&got, &reference), NMSE_PRODUCTS)
            }
            Err(error) => failed(&name, error),
        });
    }
    checks
}

fn add(runner: &dyn Runner) -> Result<Check> {
    let n = 1000;
    let (x, y) = (values(40, n), values(41, n));
    let mut out = bytes_of(&x);
    runner.launch(
        "add_f32",
        [n.div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&bytes_of(&y)),
            Arg::U32(n as u32),
        ],
    )?;
    let cpu: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    Ok(check(
        "add_f32 1000",
        nmse(&f32s_of(&out), &cpu),
        NMSE_OTHERS,
    ))
}

fn add_bias(runner: &dyn Runner) -> Result<Check> {
    // 3 rows of 300 (not a multiple of the 256 threads), one bias row added to each.
    let (rows, cols) = (3usize, 300usize);
    let (x, bias) = (values(46, rows * cols), values(47, cols));
    let mut out = bytes_of(&x);
    runner.launch(
        "add_bias_f32",
        [(rows * cols).div_ceil(256) as u32, 1, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&bytes_of(&bias)),
            Arg::U32(cols as u32),
            Arg::U32((rows * cols) as u32),
        ],
    )?;
    let cpu: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % cols])
        .collect();
    Ok(check(
        "add_bias_f32 3×300",
        nmse(&f32s_of(&out), &cpu),
        NMSE_OTHERS,
    ))
}

fn scale_add_rows(runner: &dyn Runner) -> Result<Check> {
    // Rows for tokens 4, 0 and 2 of a 5 × 300 residual stream, each with its weight.
    let (n_tokens, dim) = (5usize, 300usize);
    let x = values(42, n_tokens * dim);
    let ids: Vec<i32> = vec![4, 0, 2];
    let rows = values(43, ids.len() * dim);
    let weights: Vec<f32> = vec![0.25, 0.5, 0.75];
    let mut out = bytes_of(&x);
    runner.launch(
        "scale_add_rows_f32",
        [ids.len() as u32, dim.div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&bytes_of(&rows)),
            Arg::In(&bytes_of(&ids)),
            Arg::In(&bytes_of(&weights)),
            Arg::U32(dim as u32),
        ],
    )?;
    let mut cpu = x.clone();
    for (r, &id) in ids.iter().enumerate() {
        for i in 0..dim {
            cpu[id as usize * dim + i] += weights[r] * rows[r * dim + i];
        }
    }
    Ok(check(
        "scale_add_rows_f32 3 of 5×300",
        nmse(&f32s_of(&out), &cpu),
        NMSE_OTHERS,
    ))
}

fn store_kv(runner: &dyn Runner) -> Result<Check> {
    // Three tokens into slots 5, 16 and 47 of a 3-block pool (2 KV heads × 80): every value
    // rounded as the CPU backend's cache rounds it (`half::f16::from_f32`), bit for bit,
    // with the awkward cases among them: ties, subnormals, overflow, infinities, NaN.
    let (n_kv_heads, head_dim, n_blocks) = (2usize, 80usize, 3usize);
    let width = n_kv_heads * head_dim;
    let slots: Vec<i32> = vec![5, 16, 47];
    let mut k = values(44, slots.len() * width);
    let v: Vec<f32> = values(45, slots.len() * width)
        .iter()
        .map(|x| x * 70000.0)
        .collect();
    let awkward = [
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        65504.0,
        65519.0,
        65520.0,
        -1e9,
        f32::INFINITY,
        f32::NAN,
        6.0e-8,
        2.98e-8,
        2.9802322e-8,
        1.0e-6,
        -3.0e-5,
        6.1e-5,
        0.0,
        -0.0,
    ];
    k[..awkward.len()].copy_from_slice(&awkward);
    let cache_bytes = n_blocks * n_kv_heads * 16 * head_dim * 2;
    let (mut k_cache, mut v_cache) = (vec![0u8; cache_bytes], vec![0u8; cache_bytes]);
    runner.launch(
        "store_kv_f16",
        [slots.len() as u32, width.div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut k_cache),
            Arg::Out(&mut v_cache),
            Arg::In(&bytes_of(&k)),
            Arg::In(&bytes_of(&v)),
            Arg::In(&bytes_of(&slots)),
            Arg::U32(n_kv_heads as u32),
            Arg::U32(head_dim as u32),
        ],
    )?;
    let mut wrong = 0;
    for (t, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / 16, slot as usize % 16);
        for i in 0..width {
            let (head, d) = (i / head_dim, i % head_dim);
            let at = 2 * (((block * n_kv_heads + head) * 16 + offset) * head_dim + d);
            for (cache, source) in [(&k_cache, &k), (&v_cache, &v)] {
                let got = u16::from_ne_bytes([cache[at], cache[at + 1]]);
                if got != f16::from_f32(source[t * width + i]).to_bits() {
                    wrong += 1;
                }
            }
        }
    }
    Ok(Check {
        name: "store_kv_f16".into(),
        passed: wrong == 0,
        detail: if wrong == 0 {
            "every value in its slot, rounded as the CPU's cache, bit for bit".into()
        } else {
            format!("{wrong} values differ from the CPU cache's")
        },
    })
}

fn rope_store_kv(runner: &dyn Runner, neox: bool) -> Result<Check> {
    // 3 tokens of 4 query heads and 2 KV heads × 64 at positions 0, 7 and 4095, into slots 5,
    // 16 and 47 of a 3-block pool: the fused kernel's q, k and caches are the bits of
    // rope_<style>_f32 on q and on k followed by store_kv_f16 (each checked on its own).
    let (tokens, heads, kv_heads, head_dim, n_blocks) = (3usize, 4usize, 2usize, 64usize, 3);
    let positions: Vec<i32> = vec![0, 7, 4095];
    let slots: Vec<i32> = vec![5, 16, 47];
    let inv_freqs: Vec<f32> = (0..head_dim / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let (positions, slots, inv_freqs) =
        (bytes_of(&positions), bytes_of(&slots), bytes_of(&inv_freqs));
    let q0 = bytes_of(&values(61, tokens * heads * head_dim));
    let k0 = bytes_of(&values(62, tokens * kv_heads * head_dim));
    let v = bytes_of(&values(63, tokens * kv_heads * head_dim));
    let cache_bytes = n_blocks * kv_heads * 16 * head_dim * 2;
    let rope = if neox {
        "rope_neox_f32"
    } else {
        "rope_interleaved_f32"
    };
    // The three kernels.
    let (mut q, mut k) = (q0.clone(), k0.clone());
    for (x, n_heads) in [(&mut q, heads), (&mut k, kv_heads)] {
        runner.launch(
            rope,
            [(tokens * n_heads * head_dim / 2).div_ceil(256) as u32, 1, 1],
            [256, 1, 1],
            &mut [
                Arg::Out(x),
                Arg::In(&positions),
                Arg::In(&inv_freqs),
                Arg::U32(tokens as u32),
                Arg::U32(n_heads as u32),
                Arg::U32(head_dim as u32),
            ],
        )?;
    }
    let (mut k_cache, mut v_cache) = (vec![0u8; cache_bytes], vec![0u8; cache_bytes]);
    runner.launch(
        "store_kv_f16",
        [tokens as u32, (kv_heads * head_dim).div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut k_cache),
            Arg::Out(&mut v_cache),
            Arg::In(&k),
            Arg::In(&v),
            Arg::In(&slots),
            Arg::U32(kv_heads as u32),
            Arg::U32(head_dim as u32),
        ],
    )?;
    // The fused one.
    let (mut fused_q, mut fused_k) = (q0, k0);
    let (mut fused_k_cache, mut fused_v_cache) = (vec![0u8; cache_bytes], vec![0u8; cache_bytes]);
    runner.launch(
        "rope_store_kv_f16",
        [
            tokens as u32,
            ((heads + kv_heads) * head_dim / 2).div_ceil(256) as u32,
            1,
        ],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut fused_q),
            Arg::Out(&mut fused_k),
            Arg::In(&v),
            Arg::Out(&mut fused_k_cache),
            Arg::Out(&mut fused_v_cache),
            Arg::In(&positions),
            Arg::In(&inv_freqs),
            Arg::In(&slots),
            Arg::U32(heads as u32),
            Arg::U32(kv_heads as u32),
            Arg::U32(head_dim as u32),
            Arg::U32(u32::from(neox)),
        ],
    )?;
    let differing: Vec<&str> = [
        ("q", q == fused_q),
        ("k", k == fused_k),
        ("k cache", k_cache == fused_k_cache),
        ("v cache", v_cache == fused_v_cache),
    ]
    .iter()
    .filter(|(_, same)| !same)
    .map(|(what, _)| *what)
    .collect();
    Ok(Check {
        name: format!("rope_store_kv_f16 ({rope} + store_kv_f16)"),
        passed: differing.is_empty(),
        detail: if differing.is_empty() {
            "q, k and both caches bit for bit those of the three kernels".into()
        } else {
            format!(
                "differs from the three kernels in: {}",
                differing.join(", ")
            )
        },
    })
}

/// A 5-block pool of 2 KV heads × 16 × 40 dims (640 words a block: not a multiple of the
/// 256 threads) filled with arbitrary bits (NaN patterns among them), and its block bytes.
fn kv_pool_bits(seed: u64, n_blocks: usize) -> (Vec<u8>, usize) {
    let block_bytes = 2 * 16 * 40 * 2;
    let bits = values(seed, n_blocks * block_bytes / 4)
        .iter()
        .flat_map(|v| (v.to_bits().wrapping_mul(0x9e37_79b9) | 0x7c00).to_ne_bytes())
        .collect();
    (bits, block_bytes)
}

/// Block `b` of `bytes`, blocks of `block_bytes`.
fn kv_block(bytes: &[u8], b: usize, block_bytes: usize) -> &[u8] {
    &bytes[b * block_bytes..(b + 1) * block_bytes]
}

fn read_kv_blocks(runner: &dyn Runner) -> Result<Check> {
    // Blocks 4, 0 and 2 of the pool read out in that order.
    let (cache, block_bytes) = kv_pool_bits(60, 5);
    let read: Vec<i32> = vec![4, 0, 2];
    let mut out = vec![0u8; read.len() * block_bytes];
    runner.launch(
        "read_kv_blocks",
        [read.len() as u32, (block_bytes / 4).div_ceil(256) as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&cache),
            Arg::In(&bytes_of(&read)),
            Arg::U32((block_bytes / 4) as u32),
        ],
    )?;
    let wrong = read
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            kv_block(&out, *i, block_bytes) != kv_block(&cache, **b as usize, block_bytes)
        })
        .count();
    Ok(Check {
        name: "read_kv_blocks 3 of 5".into(),
        passed: wrong == 0,
        detail: if wrong == 0 {
            "whole blocks out, bit for bit".into()
        } else {
            format!("{wrong} of 3 blocks differ")
        },
    })
}

fn write_kv_blocks(runner: &dyn Runner) -> Result<Check> {
    // Two rows written into blocks 3 and 1 of the pool; the other blocks keep their bits.
    let (cache, block_bytes) = kv_pool_bits(61, 5);
    let (rows, _) = kv_pool_bits(62, 2);
    let write: Vec<i32> = vec![3, 1];
    let mut written = cache.clone();
    runner.launch(
        "write_kv_blocks",
        [
            write.len() as u32,
            (block_bytes / 4).div_ceil(256) as u32,
            1,
        ],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut written),
            Arg::In(&rows),
            Arg::In(&bytes_of(&write)),
            Arg::U32((block_bytes / 4) as u32),
        ],
    )?;
    let wrong = (0..5)
        .filter(|&b| {
            let expected = match write.iter().position(|w| *w as usize == b) {
                Some(i) => kv_block(&rows, i, block_bytes),
                None => kv_block(&cache, b, block_bytes),
            };
            kv_block(&written, b, block_bytes) != expected
        })
        .count();
    Ok(Check {
        name: "write_kv_blocks 2 of 5".into(),
        passed: wrong == 0,
        detail: if wrong == 0 {
            "whole blocks in, bit for bit, the others untouched".into()
        } else {
            format!("{wrong} of 5 blocks differ")
        },
    })
}

fn attention(runner: &dyn Runner) -> Result<Check> {
    // GQA (6 query heads on 2 KV heads, head_dim 64), blocks scattered over the pool: two
    // decode queries (37 and 600 positions: warps with odd and even shares) and four prefill
    // queries of the first sequence with their causal lengths, against f64 attention.
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
    let mut out_q = vec![0u8; queries.len() / 32 * 40];
    runner.launch(
        "paged_attention_f16kv",
        [n_heads as u32, n_queries as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut out),
            Arg::In(&bytes_of(&queries)),
            Arg::In(&u16s(&k_cache)),
            Arg::In(&u16s(&v_cache)),
            Arg::In(&bytes_of(&tables)),
            Arg::In(&bytes_of(&table_rows)),
            Arg::In(&bytes_of(&context_lens)),
            Arg::U32(max_blocks as u32),
            Arg::U32(n_heads as u32),
            Arg::U32(n_kv_heads as u32),
            Arg::U32(head_dim as u32),
            Arg::F32(scale),
            Arg::Out(&mut out_q),
            Arg::U32(1),
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
    let mut outcome = check(
        "paged_attention_f16kv",
        nmse(&f32s_of(&out), &reference),
        NMSE_OTHERS,
    );
    // Its Q8_1 blocks are quantize_q8_1's of its output, bit for bit.
    if out_q != quantize_q8_1(runner, &f32s_of(&out))? {
        outcome.passed = false;
        outcome.detail += "; its Q8_1 blocks differ from quantize_q8_1's of its output";
    }
    Ok(outcome)
}

fn argmax(runner: &dyn Runner) -> Result<Check> {
    // Three rows of 1000 logits, each split over 64 blocks of 16: the second with a tie at 10
    // and 900 (different blocks; the lowest index wins, as the CPU's argmax), the third with
    // its largest the last logit.
    let (rows, vocab, split) = (3usize, 1000usize, 64usize);
    let mut logits = values(9, rows * vocab);
    logits[vocab + 10] = 5.0;
    logits[vocab + 900] = 5.0;
    logits[2 * vocab + vocab - 1] = 6.0;
    let mut partials = vec![0u8; rows * split * 8];
    runner.launch(
        "argmax_partial_f32",
        [rows as u32, split as u32, 1],
        [256, 1, 1],
        &mut [
            Arg::Out(&mut partials),
            Arg::In(&bytes_of(&logits)),
            Arg::U32(vocab as u32),
        ],
    )?;
    let mut chosen = vec![0u8; rows * 4];
    runner.launch(
        "argmax_combine_f32",
        [rows as u32, 1, 1],
        [256, 1, 1],
        &mut [Arg::Out(&mut chosen), Arg::In(&partials)],
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
        name: "argmax_partial_f32 + argmax_combine_f32".into(),
        passed: got == cpu && got[1] == 10 && got[2] == 999,
        detail: format!("{got:?}, the CPU's {cpu:?}"),
    })
}

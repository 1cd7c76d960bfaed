//! Quantized weights and their kernels: dequantization of every supported ggml type (block
//! layouts of llama.cpp's `ggml-common.h` / `ggml-quants.c`), quantization of activation rows
//! to 8-bit blocks, and dot products of a weight row with a quantized activation row.
//!
//! Weights stay in their file encoding. `Q4_0`, `Q4_1` and `Q8_0` rows are dotted in integer
//! arithmetic against 8-bit activations (AVX2 + FMA + F16C when the CPU has them, detected at
//! run time; a portable loop otherwise). Other types are dequantized a row at a time.

use super::simd::{has_avx2, has_vnni, hsum8};
use crate::runtime::formats::ggml::{GgmlType, QK, QK_K};
use half::{bf16, f16};

/// One block of 32 activations quantized to 8 bits: `x ≈ d · qs`, with `sum = d · Σ qs` kept
/// for the offset term of `Q4_1` (llama.cpp's `block_q8_1`, with f32 scales), and the exact
/// `lane_sums[k] = Σ qs[4k..4k+4]` (the eight four-element lanes of the integer kernels) for
/// kernels that multiply offset weights: `Σ (w + c)·q − c·lane_sum` is `Σ w·q` exactly.
/// (`|lane_sum| ≤ 4 · 127` fits i16, which keeps a block at one 64-byte cache line), and
/// their total `q_sum = Σ qs` for the same correction over a whole block
/// ([`Numerics::Fast`]).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct BlockQ8 {
    pub qs: [i8; QK],
    pub lane_sums: [i16; 8],
    pub d: f32,
    pub sum: f32,
    pub q_sum: i32,
}

// One cache line per block: the kernels stream many tokens' blocks per group of rows.
const _: () = assert!(size_of::<BlockQ8>() == 64);

/// Quantizes `x` (length a multiple of 32) to 8-bit blocks, symmetric, `d = max|x| / 127`,
/// exactly as llama.cpp's `quantize_row_q8_1` (AVX2 path): values rounded to nearest-even
/// with the f32 scale, then `d` and `sum` stored rounded to f16 (`block_q8_1` holds halves).
/// The AVX2 path and the portable one give the same bits (every step is exactly rounded).
pub fn quantize_row_q8(x: &[f32], out: &mut Vec<BlockQ8>) {
    out.clear();
    out.reserve(x.len() / QK);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked).
        unsafe { avx2::quantize_row(x, out) };
        return;
    }
    for chunk in x.chunks_exact(QK) {
        out.push(quantize_block(chunk.try_into().expect("32 values")));
    }
}

/// One block of [`quantize_row_q8`], portably.
fn quantize_block(chunk: &[f32; QK]) -> BlockQ8 {
    let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inverse = if d > 0.0 { 127.0 / amax } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, v) in qs.iter_mut().zip(chunk) {
        *q = (v * inverse).round_ties_even() as i8;
    }
    let lane_sums = std::array::from_fn(|k| qs[4 * k..4 * k + 4].iter().map(|&q| q as i16).sum());
    let total: i32 = qs.iter().map(|&q| q as i32).sum();
    let round_f16 = |v: f32| f16::from_f32(v).to_f32();
    BlockQ8 {
        qs,
        lane_sums,
        d: round_f16(d),
        sum: round_f16(d * total as f32),
        q_sum: total,
    }
}

fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([bytes[offset], bytes[offset + 1]]).to_f32()
}

/// Dequantizes one row (`row.len()` = `row_bytes(out.len())`) into `out`.
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (y, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    y[j] = ((b[2 + j] & 0x0F) as i32 - 8) as f32 * d;
                    y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (y, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    y[j] = (b[4 + j] & 0x0F) as f32 * d + m;
                    y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (y, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    y[j] = b[2 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4K => {
            for (y, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(144)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (group, chunk) in y.chunks_exact_mut(64).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * group, scales);
                    let (sc2, m2) = scale_min_k4(2 * group + 1, scales);
                    let q = &qs[32 * group..32 * group + 32];
                    for l in 0..32 {
                        chunk[l] = d * sc1 as f32 * (q[l] & 0x0F) as f32 - dmin * m1 as f32;
                        chunk[l + 32] = d * sc2 as f32 * (q[l] >> 4) as f32 - dmin * m2 as f32;
                    }
                }
            }
        }
        GgmlType::Q5K => {
            for (y, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(176)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qh = &b[16..48];
                let ql = &b[48..176];
                for (group, chunk) in y.chunks_exact_mut(64).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * group, scales);
                    let (sc2, m2) = scale_min_k4(2 * group + 1, scales);
                    let (u1, u2) = (1u8 << (2 * group), 2u8 << (2 * group));
                    let q = &ql[32 * group..32 * group + 32];
                    for l in 0..32 {
                        let high1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                        let high2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                        chunk[l] =
                            d * sc1 as f32 * ((q[l] & 0x0F) + high1) as f32 - dmin * m1 as f32;
                        chunk[l + 32] =
                            d * sc2 as f32 * ((q[l] >> 4) + high2) as f32 - dmin * m2 as f32;
                    }
                }
            }
        }
        GgmlType::Q6K => {
            for (y, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(210)) {
                let d = f16_at(b, 208);
                for half_block in 0..2 {
                    let ql = &b[64 * half_block..64 * half_block + 64];
                    let qh = &b[128 + 32 * half_block..128 + 32 * half_block + 32];
                    let sc = &b[192 + 8 * half_block..192 + 8 * half_block + 8];
                    let y = &mut y[128 * half_block..128 * half_block + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// 6-bit scale and min of sub-block `j` of a `Q4_K`/`Q5_K` super-block (`get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Whether `ty` has an integer kernel against [`BlockQ8`] activations.
pub fn has_q8_kernel(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// The order in which the integer kernels round a quantized dot product (every matrix
/// product with `Q4_0`, `Q4_1` or `Q8_0` weights). Either order is deterministic and
/// batch-invariant: a row's product with a token has the same bits whatever else shares
/// the batch, on every TP/PP layout, in `infer generate` and `infer up` alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// llama.cpp's AVX2 build bit for bit (see [`dot_q8`]): eight four-element integer sums
    /// per block, each rounded into its own lane, so greedy generation follows llama.cpp's
    /// tokens even through near-ties.
    #[default]
    Exact,
    /// Each block's integer dot product exact and rounded once (the order of ggml's scalar
    /// reference `vec_dot`s): one conversion and one fused multiply-add per block and row
    /// instead of eight, which roughly doubles what a batched step can do on CPUs where
    /// those instructions share the vector multipliers with `vpdpbusd` (measured in
    /// `cargo bench --bench matmul`). Logits differ from llama.cpp's in the last bits, so a
    /// near-tie can go the other way.
    Fast,
}

impl Numerics {
    /// The name `--numerics` and the ranks' `INFER_NUMERICS` use: `exact` or `fast`.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Exact => "exact",
            Numerics::Fast => "fast",
        }
    }

    /// The order named `name` ([`Numerics::name`]); `None` for any other string.
    pub fn from_name(name: &str) -> Option<Numerics> {
        [Numerics::Exact, Numerics::Fast]
            .into_iter()
            .find(|n| n.name() == name)
    }
}

/// The arithmetic every integer kernel reproduces bit for bit under [`Numerics::Exact`]:
/// llama.cpp's AVX2 `vec_dot`
/// for `Q4_1 · Q8_1` and `Q4_0 · Q8_0` (`ggml-cpu/arch/x86/quants.c`) and tinyBLAS's
/// `Q8_0 · Q8_0` (`llamafile/sgemm.cpp`), which share one order. Per block `i`, lane `j`
/// (of eight) holds the exact integer `Σ w·q` over elements `4j..4j+3` (what `vpmaddubsw` +
/// `vpmaddwd`, or `vpdpbusd`, produce; `w` the weight's integer levels: the `Q4_1` nibble,
/// `Q4_0`'s nibble − 8, `Q8_0`'s signed byte), converted to f32 and fused-multiply-added into
/// the lane's accumulator with the block scale `d_w · d_x`; `Q4_1` fused-multiply-adds
/// `m · s` into a separate sum (GCC contracts ggml's `summs += m*s` into an FMA). The result
/// is the lanes summed in `hsum8`'s order, plus that sum. Reproducing this order, not just
/// the value, is what lets greedy generation follow llama.cpp's tokens wherever their
/// logits are close: a change of one rounding in one lane flips 8-bit activation quants
/// some layers later (measured against llama.cpp 0.3.16's AVX2 build).
///
/// Under [`Numerics::Fast`] the whole block's integer sum goes into lane 0 (the other
/// lanes stay zero), the offsets as above.
///
/// The row has `x.len()` blocks; the matrix products run the packed kernels of
/// [`crate::runtime::cpu::packed`], which give exactly these bits.
pub fn dot_q8(ty: GgmlType, row: &[u8], x: &[BlockQ8], numerics: Numerics) -> f32 {
    let mut state = [0f32; 9];
    dot_q8_continue(ty, row, x, &mut state, numerics);
    dot_state_finish(&state)
}

/// The accumulators of a dot product between blocks: the eight lanes, then `Q4_1`'s offset
/// sum `Σ m · s`. A dot product split over ranks at block boundaries, each rank continuing
/// the state of the previous one ([`dot_q8_continue`]) and the last finishing it
/// ([`dot_state_finish`]), gives exactly the bits of the unsplit dot product.
pub type DotState = [f32; 9];

/// The dot product a [`DotState`] holds: the lanes summed in `hsum8`'s order, plus the
/// offsets.
pub fn dot_state_finish(state: &DotState) -> f32 {
    let lanes: &[f32; 8] = state[..8].try_into().expect("eight lanes");
    hsum8(lanes) + state[8]
}

/// Continues the dot product in `state` with a weight row (`Q4_0`, `Q4_1` or `Q8_0`) of
/// `x.len()` blocks, in the exact order of [`dot_q8`] for `numerics`.
pub fn dot_q8_continue(
    ty: GgmlType,
    row: &[u8],
    x: &[BlockQ8],
    state: &mut DotState,
    numerics: Numerics,
) {
    for (i, a) in x.iter().enumerate() {
        // The weight's integer level of element `e` and the block scale.
        let (level, scale): (&dyn Fn(usize) -> i32, f32) = match ty {
            GgmlType::Q4_1 => {
                let b = &row[20 * i..20 * i + 20];
                state[8] = f16_at(b, 2).mul_add(a.sum, state[8]);
                (&move |e: usize| nibble(&b[4..], e), f16_at(b, 0))
            }
            GgmlType::Q4_0 => {
                let b = &row[18 * i..18 * i + 18];
                (&move |e: usize| nibble(&b[2..], e) - 8, f16_at(b, 0))
            }
            _ => {
                let b = &row[34 * i..34 * i + 34];
                (&move |e: usize| b[2 + e] as i8 as i32, f16_at(b, 0))
            }
        };
        let d = scale * a.d;
        let sum = |elements: std::ops::Range<usize>| -> i32 {
            elements.map(|e| level(e) * a.qs[e] as i32).sum()
        };
        match numerics {
            Numerics::Exact => {
                for (j, lane) in state[..8].iter_mut().enumerate() {
                    *lane = d.mul_add(sum(4 * j..4 * j + 4) as f32, *lane);
                }
            }
            // Exact in f32: |Σ| ≤ 32 · 128 · 128 < 2^24.
            Numerics::Fast => state[0] = d.mul_add(sum(0..QK) as f32, state[0]),
        }
    }
}

/// Element `e` of a 32-element block of packed nibbles: low nibbles hold elements 0..16,
/// high nibbles 16..32 (ggml's `Q4_0`/`Q4_1` layout).
fn nibble(qs: &[u8], e: usize) -> i32 {
    if e < 16 {
        (qs[e] & 0x0F) as i32
    } else {
        (qs[e - 16] >> 4) as i32
    }
}

/// `Σ a[i]·b[i]` for f16 `a` and f32 `b` (attention scores over an f16 KV cache), as
/// tinyBLAS computes a row of llama.cpp's `kq` product: element `i` is fused-multiply-added
/// into lane `i mod 8`, the lanes summed by `hsum8`. The AVX2 and portable paths give
/// identical results.
pub fn dot_f16_f32(a: &[f16], b: &[f32]) -> f32 {
    assert_eq!(
        a.len(),
        b.len(),
        "dot_f16_f32: vectors of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && a.len().is_multiple_of(8) {
        // SAFETY: AVX2/FMA/F16C present; lengths are equal multiples of 8.
        return unsafe { avx2::dot_f16_f32(a, b) };
    }
    let mut lanes = [0f32; 8];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        lanes[i % 8] = x.to_f32().mul_add(*y, lanes[i % 8]);
    }
    hsum8(&lanes)
}

/// Panics unless cached row `p` (a key or value row) has `width` elements: the length the
/// SIMD paths below read and write by, as their SAFETY comments say.
fn assert_row_width(p: usize, row: &[f16], width: usize) {
    assert!(
        row.len() == width,
        "cached row {p} has {} elements, not the {width} of the output",
        row.len()
    );
}

/// [`assert_row_width`] for every row.
fn assert_rows_width(rows: &[&[f16]], width: usize) {
    for (p, row) in rows.iter().enumerate() {
        assert_row_width(p, row, width);
    }
}

/// Panics unless `weights` holds `heads` rows of `n_positions` (what the SIMD paths read).
fn assert_weights_len(weights: &[f32], heads: usize, n_positions: usize) {
    assert!(
        weights.len() >= heads * n_positions,
        "{} attention weights for {heads} heads of {n_positions} positions",
        weights.len()
    );
}

/// `out[d] = Σ_p f16(weights[p]) · values[p][d]`: attention's weighted sum of cached values,
/// as tinyBLAS computes llama.cpp's `kqv` product over the transposed V cache: position `p`
/// goes to lane `p mod 8` of each output's accumulator, lanes summed by `hsum8`.
pub fn weighted_sum_f16<'a>(
    weights: &[f32],
    values: impl Iterator<Item = &'a [f16]>,
    out: &mut [f32],
) {
    let width = out.len();
    let mut lanes = vec![0f32; 8 * width];
    for (p, (w, row)) in weights.iter().zip(values).enumerate() {
        assert_row_width(p, row, width);
        let w = f16::from_f32(*w).to_f32();
        let accumulator = &mut lanes[(p % 8) * width..(p % 8 + 1) * width];
        #[cfg(target_arch = "x86_64")]
        if has_avx2() && width.is_multiple_of(8) {
            // SAFETY: AVX2/FMA/F16C present; `row` and `accumulator` have `width` elements.
            unsafe { avx2::fma_f16_row(accumulator, w, row) };
            continue;
        }
        for (acc, v) in accumulator.iter_mut().zip(row) {
            *acc = v.to_f32().mul_add(w, *acc);
        }
    }
    for (d, o) in out.iter_mut().enumerate() {
        let l: [f32; 8] = std::array::from_fn(|lane| lanes[lane * width + d]);
        *o = hsum8(&l);
    }
}

/// Attention scores of `heads` query heads sharing one KV head (GQA):
/// `scores[h][p] = dot_f16_f32(keys[p], queries[h]) · scale`, with `queries` `(heads, width)`
/// and `scores` `(heads, keys.len())`. Each converted key element serves every head; each
/// score has exactly the bits of [`dot_f16_f32`] times `scale`.
pub fn attention_scores(keys: &[&[f16]], queries: &[f32], scale: f32, scores: &mut [f32]) {
    let n_positions = keys.len();
    let heads = scores.len() / n_positions.max(1);
    let width = queries.len() / heads.max(1);
    assert_rows_width(keys, width);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && width.is_multiple_of(8) && heads <= 8 {
        // SAFETY: AVX2/FMA/F16C present; every key has `width` elements, a multiple of 8;
        // `queries` holds `heads` rows of `width` and `scores` `heads` rows of `n_positions`.
        unsafe { avx2::attention_scores(keys, queries, scale, scores, heads, width) };
        return;
    }
    for (h, query) in queries.chunks_exact(width).enumerate() {
        for (p, key) in keys.iter().enumerate() {
            scores[h * n_positions + p] = dot_f16_f32(key, query) * scale;
        }
    }
}

/// [`weighted_sum_f16`] for `heads` sets of weights over the same value rows:
/// `out[h][d] = Σ_p f16(weights[h][p]) · values[p][d]` with `weights` `(heads, values.len())`
/// and `out` `(heads, width)`; each converted value serves every head. Each head's result
/// has exactly the bits of [`weighted_sum_f16`].
pub fn weighted_sum_f16_heads(weights: &[f32], values: &[&[f16]], out: &mut [f32], heads: usize) {
    let width = out.len() / heads;
    let n_positions = values.len();
    assert_rows_width(values, width);
    assert_weights_len(weights, heads, n_positions);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && width.is_multiple_of(8) && heads <= 8 {
        let mut rounded = weights.to_vec();
        // SAFETY: AVX2/FMA/F16C present; every value row has `width` elements, a multiple of
        // 8; `rounded` holds `heads` rows of `n_positions`, `out` `heads` rows of `width`.
        unsafe {
            avx2::round_through_f16(&mut rounded);
            if heads <= 3 && has_vnni() {
                // AVX-512 VL (checked with VNNI): 32 registers hold all eight lane classes.
                avx2::weighted_sum_heads_vl(&rounded, values, out, heads, width)
            } else {
                avx2::weighted_sum_heads(&rounded, values, out, heads, width)
            }
        };
        return;
    }
    for (h, out) in out.chunks_exact_mut(width).enumerate() {
        let weights = &weights[h * n_positions..(h + 1) * n_positions];
        weighted_sum_f16(weights, values.iter().copied(), out);
    }
}

/// Rounds every value to the nearest f16 (ties to even) and back, in place: what
/// `f16::from_f32(v).to_f32()` gives (F16C eight at a time where the CPU has it).
pub fn round_through_f16(values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked).
        unsafe { avx2::round_through_f16(values) };
        return;
    }
    for v in values.iter_mut() {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// Asks the cache for every line of `rows` (KV cache rows about to be read): a decode
/// step's attention reads each sequence's cache once, from memory, in an order (lane
/// classes, `p mod 32`) the hardware prefetcher does not follow.
pub fn prefetch_rows(rows: &[&[f16]]) {
    #[cfg(target_arch = "x86_64")]
    for row in rows {
        let bytes = row.as_ptr() as *const i8;
        for line in (0..std::mem::size_of_val(*row)).step_by(64) {
            // SAFETY: a prefetch has no effect beyond the cache, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    bytes.wrapping_add(line),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

/// The order in which ggml's AVX2 `ggml_vec_dot_f16` sums its 32 lane classes (element `i`
/// in accumulator `(i / 8) mod 4`, lane `i mod 8`; `GGML_F32x8_REDUCE`): accumulators 0+2
/// and 1+3, those two, then the halves of the vector, then two `hadd`s.
pub(crate) fn reduce32(a: &[f32; 32]) -> f32 {
    let s: [f32; 8] = std::array::from_fn(|l| (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]));
    let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

crate::runtime::cpu::mathfn::multiversion! {
    /// [`attention_scores`] for a sequence's single new token, as llama.cpp computes `kq`
    /// when the batch holds one token (tinyBLAS only takes two or more; `ggml_vec_dot_f16`
    /// then runs): each score sums its `width` products in 32 lane classes (`reduce32`).
    /// `keys`: `n_positions` rows of `width`; `queries` `(heads, width)` (already rounded
    /// to f16); `scores` `(heads, n_positions)`. When `width` is not a multiple of 32 (heads
    /// of 16, 48, 80 dimensions), the products past the last whole 32 are added after the
    /// reduction in f64, one by one, as `ggml_vec_dot_f16`'s leftover loop does.
    #[allow(clippy::needless_range_loop)]
    pub fn attention_scores_decode(keys: &[&[f16]], queries: &[f32], scale: f32, scores: &mut [f32]) {
        let n_positions = keys.len();
        let heads = scores.len() / n_positions.max(1);
        let width = queries.len() / heads.max(1);
        assert_rows_width(keys, width);
        #[cfg(target_arch = "x86_64")]
        if has_avx2() && width.is_multiple_of(32) {
            // SAFETY: AVX2/FMA/F16C present; every key has `width` elements, a multiple of
            // 32; `queries` holds `heads` rows of `width`, `scores` `heads` of `n_positions`.
            unsafe { avx2::attention_scores_decode(keys, queries, scale, scores, width) };
            return;
        }
        let mut key = vec![0f32; width];
        for (p, row) in keys.iter().enumerate() {
            for (k, v) in key.iter_mut().zip(row.iter()) {
                *k = v.to_f32();
            }
            let whole = width / 32 * 32;
            for (h, query) in queries.chunks_exact(width).enumerate() {
                let mut a = [0f32; 32];
                for (k32, q32) in key[..whole].chunks_exact(32).zip(query.chunks_exact(32)) {
                    for i in 0..32 {
                        a[i] = k32[i].mul_add(q32[i], a[i]);
                    }
                }
                let mut sum = reduce32(&a) as f64;
                for (k, q) in key[whole..].iter().zip(&query[whole..]) {
                    sum += (k * q) as f64;
                }
                scores[h * n_positions + p] = sum as f32 * scale;
            }
        }
    }
}

crate::runtime::cpu::mathfn::multiversion! {
    /// [`weighted_sum_f16_heads`] for a sequence's single new token, as llama.cpp's
    /// `ggml_vec_dot_f16` computes `kqv` then: position `p` goes to lane class `p mod 32`
    /// (each class a fused-multiply-add chain in position order), the classes summed by
    /// `reduce32`. `weights` `(heads, values.len())`, rounded to f16 here; `out`
    /// `(heads, width)`.
    #[allow(clippy::needless_range_loop)]
    pub fn weighted_sum_f16_heads_decode(weights: &[f32], values: &[&[f16]], out: &mut [f32], heads: usize) {
        let width = out.len() / heads;
        let n_positions = values.len();
        assert_rows_width(values, width);
        assert_weights_len(weights, heads, n_positions);
        #[cfg(target_arch = "x86_64")]
        if has_avx2() && width.is_multiple_of(32) {
            let mut rounded = weights.to_vec();
            // SAFETY: AVX2/FMA/F16C present; every value row has `width` elements, a
            // multiple of 32; `rounded` holds `heads` rows of `n_positions`, `out` `heads`
            // rows of `width`.
            unsafe {
                avx2::round_through_f16(&mut rounded);
                avx2::weighted_sum_heads_decode(&rounded, values, out, heads, width);
            }
            return;
        }
        let mut classes = vec![0f32; 32 * width];
        let mut row = vec![0f32; width];
        for (h, out) in out.chunks_exact_mut(width).enumerate() {
            let weights = &weights[h * n_positions..(h + 1) * n_positions];
            classes.iter_mut().for_each(|v| *v = 0.0);
            for (p, (w, values)) in weights.iter().zip(values).enumerate() {
                let w = f16::from_f32(*w).to_f32();
                for (r, v) in row.iter_mut().zip(values.iter()) {
                    *r = v.to_f32();
                }
                let class = &mut classes[(p % 32) * width..(p % 32 + 1) * width];
                for d in 0..width {
                    class[d] = row[d].mul_add(w, class[d]);
                }
            }
            for d in 0..width {
                let a: [f32; 32] = std::array::from_fn(|c| classes[c * width + d]);
                out[d] = reduce32(&a);
            }
        }
    }
}

/// f32 dot product (auto-vectorized).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[8 * i + l] * b[8 * i + l];
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for i in chunks * 8..a.len() {
        total += a[i] * b[i];
    }
    total
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ8, QK};

    /// [`super::quantize_row_q8`] on AVX2, the whole row in one function (no call or
    /// feature check per block): appends one block per 32 values of `x` to `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_row(x: &[f32], out: &mut Vec<BlockQ8>) {
        for chunk in x.chunks_exact(QK) {
            let chunk: &[f32; QK] = chunk.try_into().expect("32 values");
            // SAFETY: `quantize_row`'s contract: the CPU has AVX2, FMA and F16C.
            out.push(unsafe { quantize_block(chunk) });
        }
    }

    /// Rounds to the nearest f16 (ties to even) and back, as `f16::from_f32(v).to_f32()`.
    #[inline(always)]
    unsafe fn round_f16(v: f32) -> f32 {
        // SAFETY: only inlined into `quantize_row`, which has F16C.
        unsafe {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
                _mm_set_ss(v),
            )))
        }
    }

    /// [`super::quantize_block`] on AVX2: the same max, scale, products and
    /// round-to-nearest-even, eight values at a time.
    #[inline(always)]
    unsafe fn quantize_block(chunk: &[f32; QK]) -> BlockQ8 {
        // SAFETY: the CPU has AVX2, FMA and F16C (this function's contract); the loads read the 32
        // values of `chunk`.
        unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let v: [__m256; 4] =
                std::array::from_fn(|i| _mm256_loadu_ps(chunk.as_ptr().add(8 * i)));
            let abs = |x| _mm256_andnot_ps(sign, x);
            let m = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let d = amax / 127.0;
            let inverse = _mm256_set1_ps(if d > 0.0 { 127.0 / amax } else { 0.0 });
            let ints: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_round_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(_mm256_mul_ps(v[i], inverse)))
            });
            let total = _mm256_add_epi32(
                _mm256_add_epi32(ints[0], ints[1]),
                _mm256_add_epi32(ints[2], ints[3]),
            );
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total);
            // Packing interleaves 128-bit lanes; the permute puts elements back in order.
            let words = _mm256_packs_epi32(ints[0], ints[1]);
            let words2 = _mm256_packs_epi32(ints[2], ints[3]);
            let bytes = _mm256_packs_epi16(words, words2);
            let ordered =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let mut qs = [0i8; QK];
            _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, ordered);
            let total: i32 = lanes.iter().sum();
            // Sums of four consecutive quants: byte pairs (1·q, exact in i16), then pairs of
            // those.
            let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), ordered);
            let fours = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            let fours = _mm256_packs_epi32(fours, fours); // exact: |sum| ≤ 508
            let fours = _mm256_permute4x64_epi64::<0b1000>(fours);
            let mut lane_sums = [0i16; 8];
            _mm_storeu_si128(
                lane_sums.as_mut_ptr() as *mut __m128i,
                _mm256_castsi256_si128(fours),
            );
            BlockQ8 {
                qs,
                lane_sums,
                d: round_f16(d),
                sum: round_f16(d * total as f32),
                q_sum: total,
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let low = _mm256_castps256_ps128(v);
        let high = _mm256_extractf128_ps(v, 1);
        let sum = _mm_add_ps(low, high);
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        let sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
        _mm_cvtss_f32(sum)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_f32(a: &[half::f16], b: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in (0..a.len()).step_by(8) {
            // SAFETY: the caller's contract: `a` and `b` have equal lengths, a multiple of 8, so
            // eight halves from `i` are in `a`.
            let halves = unsafe { _mm_loadu_si128(a.as_ptr().add(i) as *const __m128i) };
            let x = _mm256_cvtph_ps(halves);
            // SAFETY: as above, eight values from `i` are in `b`.
            let y = unsafe { _mm256_loadu_ps(b.as_ptr().add(i)) };
            acc = _mm256_fmadd_ps(x, y, acc);
        }
        // SAFETY: the CPU has AVX2 (this function's contract).
        unsafe { hsum(acc) }
    }

    /// [`super::attention_scores`] on AVX2 (up to 8 heads): two positions at a time, so
    /// twice as many independent FMA chains are in flight (each position's lanes and order
    /// are those of [`dot_f16_f32`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attention_scores(
        keys: &[&[half::f16]],
        queries: &[f32],
        scale: f32,
        scores: &mut [f32],
        heads: usize,
        width: usize,
    ) {
        let n_positions = keys.len();
        let mut p = 0;
        while p + 2 <= n_positions {
            let (k0, k1) = (keys[p].as_ptr(), keys[p + 1].as_ptr());
            let mut acc0 = [_mm256_setzero_ps(); 8];
            let mut acc1 = [_mm256_setzero_ps(); 8];
            for i in (0..width).step_by(8) {
                // SAFETY: every key has `width` halves, a multiple of 8 (the caller's contract), so
                // eight from `i` are in `k0` and `k1`.
                let x0 = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(k0.add(i) as *const __m128i) });
                // SAFETY: as above, for `k1`.
                let x1 = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(k1.add(i) as *const __m128i) });
                for h in 0..heads {
                    // SAFETY: `queries` holds `heads` rows of `width` (the caller's contract).
                    let y = unsafe { _mm256_loadu_ps(queries.as_ptr().add(h * width + i)) };
                    acc0[h] = _mm256_fmadd_ps(x0, y, acc0[h]);
                    acc1[h] = _mm256_fmadd_ps(x1, y, acc1[h]);
                }
            }
            for h in 0..heads {
                // SAFETY: the CPU has AVX2 (this function's contract).
                scores[h * n_positions + p] = unsafe { hsum(acc0[h]) } * scale;
                // SAFETY: the CPU has AVX2 (this function's contract).
                scores[h * n_positions + p + 1] = unsafe { hsum(acc1[h]) } * scale;
            }
            p += 2;
        }
        if p < n_positions {
            let key = keys[p].as_ptr();
            let mut acc = [_mm256_setzero_ps(); 8];
            for i in (0..width).step_by(8) {
                // SAFETY: every key has `width` halves, a multiple of 8 (the caller's contract).
                let x = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(key.add(i) as *const __m128i) });
                for (h, acc) in acc.iter_mut().enumerate().take(heads) {
                    // SAFETY: `queries` holds `heads` rows of `width` (the caller's contract).
                    let y = unsafe { _mm256_loadu_ps(queries.as_ptr().add(h * width + i)) };
                    *acc = _mm256_fmadd_ps(x, y, *acc);
                }
            }
            for (h, acc) in acc.iter().enumerate().take(heads) {
                // SAFETY: the CPU has AVX2 (this function's contract).
                scores[h * n_positions + p] = unsafe { hsum(*acc) } * scale;
            }
        }
    }

    /// Rounds every value to the nearest f16 (ties to even) and back, in place: what
    /// `f16::from_f32(v).to_f32()` gives, eight at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn round_through_f16(values: &mut [f32]) {
        let mut chunks = values.chunks_exact_mut(8);
        for chunk in &mut chunks {
            // SAFETY: `chunk` holds exactly eight values.
            let v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
            let rounded = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
            // SAFETY: as above, eight values to store into `chunk`.
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), rounded) };
        }
        for v in chunks.into_remainder() {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }

    /// [`super::weighted_sum_f16_heads`] on AVX2 (up to 8 heads), `weights` already rounded
    /// to f16: per 8 outputs, each lane class `p mod 8` accumulates its positions in order in
    /// registers, then the 8 lane vectors are summed in `hsum8`'s order. `LANES` lane
    /// classes advance together, so `LANES × heads` FMA chains are independent.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_heads(
        weights: &[f32],
        values: &[&[half::f16]],
        out: &mut [f32],
        heads: usize,
        width: usize,
    ) {
        // SAFETY: the caller's contract (every value row `width` halves, a multiple of 8; `weights`
        // `heads` rows of the positions; `out` `heads` rows of `width`) is `weighted_sum_lanes`'.
        unsafe {
            match heads {
                1 => weighted_sum_lanes::<8>(weights, values, out, heads, width),
                2 | 3 => weighted_sum_lanes::<4>(weights, values, out, heads, width),
                4..=6 => weighted_sum_lanes::<2>(weights, values, out, heads, width),
                _ => weighted_sum_lanes::<1>(weights, values, out, heads, width),
            }
        }
    }

    /// [`weighted_sum_heads`] for up to 3 heads with AVX-512 VL's 32 vector registers: all
    /// eight lane classes advance together (24 independent chains).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub unsafe fn weighted_sum_heads_vl(
        weights: &[f32],
        values: &[&[half::f16]],
        out: &mut [f32],
        heads: usize,
        width: usize,
    ) {
        // SAFETY: the CPU has AVX-512 VL besides AVX2 (this function's contract), which
        // `weighted_sum_lanes::<8>`'s registers need; the lengths as in `weighted_sum_heads`.
        unsafe { weighted_sum_lanes::<8>(weights, values, out, heads, width) }
    }

    // Indexing by head and lane reads clearer than nested iterators here.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn weighted_sum_lanes<const LANES: usize>(
        weights: &[f32],
        values: &[&[half::f16]],
        out: &mut [f32],
        heads: usize,
        width: usize,
    ) {
        // SAFETY: the caller's contract: every value row has `width` halves, a multiple of 8;
        // `weights` holds `heads` rows of the positions; `out` `heads` rows of `width`.
        unsafe {
            let n_positions = values.len();
            for c in (0..width).step_by(8) {
                let mut lanes = [[_mm256_setzero_ps(); 8]; 8];
                for first in (0..8).step_by(LANES) {
                    let mut acc = [[_mm256_setzero_ps(); LANES]; 8];
                    let mut base = first;
                    while base < n_positions {
                        for j in 0..LANES.min(n_positions - base) {
                            let p = base + j;
                            let row = values[p].as_ptr();
                            let x = _mm256_cvtph_ps(_mm_loadu_si128(row.add(c) as *const __m128i));
                            for h in 0..heads {
                                let w = _mm256_set1_ps(*weights.get_unchecked(h * n_positions + p));
                                acc[h][j] = _mm256_fmadd_ps(x, w, acc[h][j]);
                            }
                        }
                        base += 8;
                    }
                    for h in 0..heads {
                        for j in 0..LANES {
                            lanes[h][first + j] = acc[h][j];
                        }
                    }
                }
                for (h, l) in lanes.iter().enumerate().take(heads) {
                    let even = _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6]));
                    let odd = _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7]));
                    let sum = _mm256_add_ps(even, odd);
                    _mm256_storeu_ps(out.as_mut_ptr().add(h * width + c), sum);
                }
            }
        }
    }

    /// `GGML_F32x8_REDUCE`'s horizontal part for eight vectors at once: lane `j` of the
    /// result is `(t0 + t1) + (t2 + t3)` with `t_i = x[j][i] + x[j][i + 4]`, the bits of
    /// ggml's last steps (`_mm_add_ps` of the halves, two `hadd`s) for `x[j]`.
    /// Pairing `x[j]` with `x[j + 4]` in each 256-bit register keeps the results in order.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce_eight(x: &[__m256; 8]) -> __m256 {
        let t: [__m256; 4] = std::array::from_fn(|j| {
            let low = _mm256_permute2f128_ps::<0x20>(x[j], x[j + 4]);
            let high = _mm256_permute2f128_ps::<0x31>(x[j], x[j + 4]);
            _mm256_add_ps(low, high)
        });
        _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]))
    }

    /// Most query heads one pass of the decode kernels takes (a KV head's GQA group is
    /// split into passes of at most this many).
    const PASS_HEADS: usize = 4;

    /// [`super::attention_scores_decode`] on AVX2 (`width` a multiple of 32): each key is
    /// converted once for up to [`PASS_HEADS`] heads, each score runs ggml's four
    /// accumulators, and eight positions' horizontal sums are done together
    /// ([`reduce_eight`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attention_scores_decode(
        keys: &[&[half::f16]],
        queries: &[f32],
        scale: f32,
        scores: &mut [f32],
        width: usize,
    ) {
        let heads = queries.len() / width;
        let n_positions = keys.len();
        for first in (0..heads).step_by(PASS_HEADS) {
            let pass = PASS_HEADS.min(heads - first);
            let queries = &queries[first * width..(first + pass) * width];
            let scores = &mut scores[first * n_positions..(first + pass) * n_positions];
            // SAFETY: as this function's caller promises, for `pass` heads.
            unsafe {
                match pass {
                    1 => scores_pass::<1>(keys, queries, scale, scores, width),
                    2 => scores_pass::<2>(keys, queries, scale, scores, width),
                    3 => scores_pass::<3>(keys, queries, scale, scores, width),
                    _ => scores_pass::<4>(keys, queries, scale, scores, width),
                }
            }
        }
    }

    /// [`attention_scores_decode`] for `H` heads, their accumulators in registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn scores_pass<const H: usize>(
        keys: &[&[half::f16]],
        queries: &[f32],
        scale: f32,
        scores: &mut [f32],
        width: usize,
    ) {
        let n_positions = keys.len();
        let scale = _mm256_set1_ps(scale);
        for first in (0..n_positions).step_by(8) {
            let count = 8.min(n_positions - first);
            let mut x = [[_mm256_setzero_ps(); 8]; H];
            for (j, row) in keys[first..first + count].iter().enumerate() {
                let mut a = [[_mm256_setzero_ps(); 4]; H];
                for c in (0..width / 8).step_by(4) {
                    for i in 0..4 {
                        // SAFETY: `row` has `width` halves, each query `width` values.
                        let k = unsafe {
                            _mm256_cvtph_ps(_mm_loadu_si128(row.as_ptr().add(8 * (c + i)) as _))
                        };
                        for h in 0..H {
                            // SAFETY: each query has `width` values (the caller's contract).
                            let q = unsafe {
                                _mm256_loadu_ps(queries.as_ptr().add(h * width + 8 * (c + i)))
                            };
                            a[h][i] = _mm256_fmadd_ps(k, q, a[h][i]);
                        }
                    }
                }
                for h in 0..H {
                    let a = &a[h];
                    x[h][j] = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
                }
            }
            for h in 0..H {
                let mut sums = [0f32; 8];
                let scaled = _mm256_mul_ps(reduce_eight(&x[h]), scale);
                // SAFETY: `sums` holds eight floats.
                unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), scaled) };
                let at = h * n_positions + first;
                scores[at..at + count].copy_from_slice(&sums[..count]);
            }
        }
    }

    /// [`super::weighted_sum_f16_heads_decode`] on AVX2 (`width` a multiple of 32, `weights`
    /// already rounded through f16): per eight outputs, lane classes `l`, `16 + l`, `8 + l`,
    /// `24 + l` (each a fused-multiply-add chain down its positions, every value row
    /// converted once for up to [`PASS_HEADS`] heads) summed into `s[l]` as `reduce32` does,
    /// then the eight `s[l]` reduced in its order.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_heads_decode(
        weights: &[f32],
        values: &[&[half::f16]],
        out: &mut [f32],
        heads: usize,
        width: usize,
    ) {
        let n_positions = values.len();
        for first in (0..heads).step_by(PASS_HEADS) {
            let pass = PASS_HEADS.min(heads - first);
            let weights = &weights[first * n_positions..(first + pass) * n_positions];
            let out = &mut out[first * width..(first + pass) * width];
            // SAFETY: as this function's caller promises, for `pass` heads.
            unsafe {
                match pass {
                    1 => weighted_pass::<1>(weights, values, out, width),
                    2 => weighted_pass::<2>(weights, values, out, width),
                    3 => weighted_pass::<3>(weights, values, out, width),
                    _ => weighted_pass::<4>(weights, values, out, width),
                }
            }
        }
    }

    /// [`weighted_sum_heads_decode`] for `H` heads, their sums in registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn weighted_pass<const H: usize>(
        weights: &[f32],
        values: &[&[half::f16]],
        out: &mut [f32],
        width: usize,
    ) {
        let n_positions = values.len();
        for chunk in 0..width / 8 {
            let class = |c: usize| {
                let mut acc = [_mm256_setzero_ps(); H];
                for p in (c..n_positions).step_by(32) {
                    // SAFETY: every value row has `width` halves.
                    let v = unsafe {
                        _mm256_cvtph_ps(_mm_loadu_si128(values[p].as_ptr().add(8 * chunk) as _))
                    };
                    for h in 0..H {
                        let w = _mm256_set1_ps(weights[h * n_positions + p]);
                        acc[h] = _mm256_fmadd_ps(v, w, acc[h]);
                    }
                }
                acc
            };
            let mut s = [[_mm256_setzero_ps(); 8]; H];
            for l in 0..8 {
                let (a0, a16, a8, a24) = (class(l), class(16 + l), class(8 + l), class(24 + l));
                for h in 0..H {
                    s[h][l] =
                        _mm256_add_ps(_mm256_add_ps(a0[h], a16[h]), _mm256_add_ps(a8[h], a24[h]));
                }
            }
            for h in 0..H {
                let s = &s[h];
                let t: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(s[i], s[i + 4]));
                let r = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
                // SAFETY: `out` holds `H` rows of `width`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(h * width + 8 * chunk), r) };
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn fma_f16_row(accumulator: &mut [f32], w: f32, v: &[half::f16]) {
        let weight = _mm256_set1_ps(w);
        for i in (0..v.len()).step_by(8) {
            // SAFETY: `v` and `accumulator` have the same length, a multiple of 8 (the caller's
            // contract).
            let halves = unsafe { _mm_loadu_si128(v.as_ptr().add(i) as *const __m128i) };
            let x = _mm256_cvtph_ps(halves);
            // SAFETY: as above.
            let acc = unsafe { _mm256_loadu_ps(accumulator.as_ptr().add(i)) };
            // SAFETY: as above, eight values of `accumulator` from `i`.
            unsafe {
                _mm256_storeu_ps(
                    accumulator.as_mut_ptr().add(i),
                    _mm256_fmadd_ps(x, weight, acc),
                )
            };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A cached row longer than the output (width 8, a row of 16) is refused before any
    /// SIMD path writes past the output's accumulators.
    #[test]
    #[should_panic(expected = "cached row 1 has 16 elements, not the 8 of the output")]
    fn a_value_row_longer_than_the_output_is_refused() {
        let (short, long) = (vec![f16::ONE; 8], vec![f16::ONE; 16]);
        let rows = [short.as_slice(), long.as_slice()];
        let mut out = vec![0f32; 8];
        weighted_sum_f16(&[0.5, 0.5], rows.iter().copied(), &mut out);
    }

    /// Keys shorter than the queries' width are refused by every score kernel, and the
    /// weights must cover every head's positions.
    #[test]
    fn short_keys_and_missing_weights_are_refused() {
        let (key, short) = (vec![f16::ONE; 32], vec![f16::ONE; 24]);
        let keys = [key.as_slice(), short.as_slice()];
        let queries = vec![1f32; 2 * 32];
        for decode in [false, true] {
            let outcome = std::panic::catch_unwind(|| {
                let mut scores = vec![0f32; 2 * 2];
                if decode {
                    attention_scores_decode(&keys, &queries, 1.0, &mut scores);
                } else {
                    attention_scores(&keys, &queries, 1.0, &mut scores);
                }
            });
            assert!(outcome.is_err(), "decode {decode}: a short key was read");
        }
        let values = [key.as_slice(), key.as_slice()];
        for decode in [false, true] {
            let outcome = std::panic::catch_unwind(|| {
                let mut out = vec![0f32; 2 * 32];
                // Two heads of two positions need four weights.
                if decode {
                    weighted_sum_f16_heads_decode(&[0.5; 3], &values, &mut out, 2);
                } else {
                    weighted_sum_f16_heads(&[0.5; 3], &values, &mut out, 2);
                }
            });
            assert!(
                outcome.is_err(),
                "decode {decode}: missing weights were read"
            );
        }
    }

    /// Deterministic pseudo-random bytes (xorshift), for blocks.
    pub(crate) fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    /// A row of `n_blocks` blocks of `ty` with sane f16 scales.
    fn row(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
        let (_, block_bytes) = ty.block();
        let mut row = bytes(n_blocks * block_bytes, seed);
        for block in row.chunks_exact_mut(block_bytes) {
            let scale = f16::from_f32(0.0123).to_le_bytes();
            let min = f16::from_f32(-0.25).to_le_bytes();
            block[..2].copy_from_slice(&scale);
            if ty == GgmlType::Q4_1 {
                block[2..4].copy_from_slice(&min);
            }
        }
        row
    }

    /// 18 blocks of deterministic activations, `((i·a mod b) − b/2) / c`, quantized.
    fn activations(a: usize, b: usize, c: f32) -> Vec<BlockQ8> {
        let x: Vec<f32> = (0..18 * QK)
            .map(|i| ((i * a % b) as f32 - (b / 2) as f32) / c)
            .collect();
        let mut xq = Vec::new();
        quantize_row_q8(&x, &mut xq);
        xq
    }

    #[test]
    fn integer_kernels_match_dequantized_dot_products() {
        let n = 18 * QK;
        let xq = activations(37, 101, 17.0);
        // What the quantized activations represent, for the float reference.
        let x_dequantized: Vec<f32> = xq
            .iter()
            .flat_map(|b| b.qs.iter().map(move |q| *q as f32 * b.d))
            .collect();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = row(ty, 18, 7);
            let mut w_f32 = vec![0f32; n];
            dequantize_row(ty, &w, &mut w_f32);
            let reference: f32 = w_f32.iter().zip(&x_dequantized).map(|(a, b)| a * b).sum();
            let tolerance = 1e-3 * reference.abs().max(1.0);
            for numerics in [Numerics::Exact, Numerics::Fast] {
                let portable = dot_q8(ty, &w, &xq, numerics);
                assert!(
                    (portable - reference).abs() < tolerance,
                    "{ty:?} {numerics:?}: {portable} vs {reference}"
                );
            }
            // The two orders round differently: the same value, not the same bits.
            assert_ne!(
                dot_q8(ty, &w, &xq, Numerics::Exact).to_bits(),
                dot_q8(ty, &w, &xq, Numerics::Fast).to_bits(),
                "{ty:?}"
            );
        }
    }

    /// A dot product split at block boundaries (as TP ranks split a row-parallel
    /// projection), each part continuing the previous state, gives exactly the bits of the
    /// whole one.
    #[test]
    fn continued_dot_products_equal_whole_ones_bit_for_bit() {
        let xq = activations(53, 97, 13.0);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = row(ty, 18, 11);
            let block_bytes = ty.row_bytes(QK).expect("one block");
            let numerics = [Numerics::Exact, Numerics::Fast];
            let cuts = [vec![0, 18], vec![0, 6, 12, 18], vec![0, 1, 17, 18]];
            for (cuts, numerics) in cuts.iter().flat_map(|c| numerics.map(|n| (c, n))) {
                let mut state = [0f32; 9];
                for part in cuts.windows(2) {
                    let (a, b) = (part[0], part[1]);
                    let w_part = &w[a * block_bytes..b * block_bytes];
                    dot_q8_continue(ty, w_part, &xq[a..b], &mut state, numerics);
                }
                assert_eq!(
                    dot_state_finish(&state).to_bits(),
                    dot_q8(ty, &w, &xq, numerics).to_bits(),
                    "{ty:?} {cuts:?} {numerics:?}"
                );
            }
        }
    }

    /// The AVX2 quantizer gives the portable one's bits, ties (x.5 after scaling) included.
    #[test]
    fn simd_quantization_equals_the_portable_one() {
        let mut x: Vec<f32> = (0..32 * 40)
            .map(|i| ((i * 7919) % 2003) as f32 / 333.0 - 3.0)
            .collect();
        // A block whose scale makes exact halves, an all-zero block, a tiny one.
        for (i, v) in x[..32].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { i as f32 + 0.5 };
        }
        x[32..64].fill(0.0);
        x[64..96].iter_mut().for_each(|v| *v *= 1e-30);
        let mut fast = Vec::new();
        quantize_row_q8(&x, &mut fast);
        for (block, chunk) in fast.iter().zip(x.chunks_exact(QK)) {
            let portable = quantize_block(chunk.try_into().expect("32"));
            assert_eq!(block.qs, portable.qs);
            assert_eq!(block.d.to_bits(), portable.d.to_bits());
            assert_eq!(block.sum.to_bits(), portable.sum.to_bits());
            assert_eq!(block.lane_sums, portable.lane_sums);
        }
    }

    #[test]
    fn activation_blocks_keep_their_exact_integer_sum() {
        let xq = activations(29, 83, 3.0);
        for block in &xq {
            for (k, sum) in block.lane_sums.iter().enumerate() {
                let four = &block.qs[4 * k..4 * k + 4];
                assert_eq!(*sum as i32, four.iter().map(|&q| q as i32).sum::<i32>());
            }
        }
    }

    #[test]
    fn q8_quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.1).collect();
        let mut xq = Vec::new();
        quantize_row_q8(&x, &mut xq);
        for (block, chunk) in xq.iter().zip(x.chunks(QK)) {
            let sum: i32 = block.qs.iter().map(|&q| q as i32).sum();
            // `d` and `sum` are stored as f16, as in llama.cpp's `block_q8_1`.
            assert!((block.sum - block.d * sum as f32).abs() <= 2e-3 * block.sum.abs().max(1.0));
            for (q, v) in block.qs.iter().zip(chunk) {
                assert!((*q as f32 * block.d - v).abs() <= block.d / 2.0 + 2e-3 * v.abs() + 1e-6);
            }
        }
    }

    #[test]
    fn f16_kernels_are_bit_identical_to_their_lane_emulation() {
        let a: Vec<f16> = (0..64)
            .map(|i| f16::from_f32((i as f32 - 30.0) / 7.0))
            .collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut lanes = [0f32; 8];
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            lanes[i % 8] = x.to_f32().mul_add(*y, lanes[i % 8]);
        }
        assert_eq!(dot_f16_f32(&a, &b).to_bits(), hsum8(&lanes).to_bits());

        let rows: Vec<Vec<f16>> = (0..11)
            .map(|p| {
                (0..16)
                    .map(|d| f16::from_f32(((p * 16 + d) as f32 * 0.77).sin()))
                    .collect()
            })
            .collect();
        let weights: Vec<f32> = (0..11).map(|p| 1.0 / (p as f32 + 2.0)).collect();
        let mut out = vec![0f32; 16];
        weighted_sum_f16(&weights, rows.iter().map(Vec::as_slice), &mut out);
        for (d, value) in out.iter().enumerate() {
            let mut lanes = [0f32; 8];
            for (p, row) in rows.iter().enumerate() {
                let w = f16::from_f32(weights[p]).to_f32();
                lanes[p % 8] = row[d].to_f32().mul_add(w, lanes[p % 8]);
            }
            assert_eq!(value.to_bits(), hsum8(&lanes).to_bits(), "d={d}");
        }
    }

    /// The decode-step attention kernels against a plain transcription of ggml's
    /// `ggml_vec_dot_f16` (four 8-lane accumulators, `GGML_F32x8_REDUCE`, two `hadd`s), with
    /// 1, 31, 32, 33 and 70 positions (partial and several lane classes), 3 and 5 heads.
    #[test]
    #[allow(clippy::needless_range_loop)] // a transcription of ggml's indexing
    fn decode_attention_kernels_follow_ggml_vec_dot_f16() {
        fn vec_dot_f16(x: &[f32], y: &[f32]) -> f32 {
            let mut sum = [[0f32; 8]; 4];
            for i in (0..x.len() / 32 * 32).step_by(32) {
                for j in 0..4 {
                    for l in 0..8 {
                        let e = i + 8 * j + l;
                        sum[j][l] = x[e].mul_add(y[e], sum[j][l]);
                    }
                }
            }
            let x0: [f32; 8] =
                std::array::from_fn(|l| (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]));
            let t0: [f32; 4] = std::array::from_fn(|i| x0[i] + x0[i + 4]);
            let t1 = [t0[0] + t0[1], t0[2] + t0[3]];
            let mut total = (t1[0] + t1[1]) as f64;
            for e in x.len() / 32 * 32..x.len() {
                total += (x[e] * y[e]) as f64;
            }
            total as f32
        }
        let width = 64;
        let half = |v: f32| f16::from_f32(v).to_f32();
        // Three heads (SmolLM2's GQA group) and five (a pass of four, then one).
        for (heads, n_positions) in [1, 31, 32, 33, 70]
            .map(|n| (3, n))
            .into_iter()
            .chain([(5, 70)])
        {
            let keys: Vec<Vec<f16>> = (0..n_positions)
                .map(|p| {
                    (0..width)
                        .map(|d| f16::from_f32(((p * 7 + d * 13) % 29) as f32 * 0.07 - 1.0))
                        .collect()
                })
                .collect();
            let queries: Vec<f32> = (0..heads * width)
                .map(|i| half(((i * 11) % 17) as f32 * 0.3 - 2.4))
                .collect();
            let key_rows: Vec<&[f16]> = keys.iter().map(|k| &k[..]).collect();
            let mut scores = vec![0f32; heads * n_positions];
            attention_scores_decode(&key_rows, &queries, 0.125, &mut scores);
            for h in 0..heads {
                for (p, key) in keys.iter().enumerate() {
                    let k: Vec<f32> = key.iter().map(|v| v.to_f32()).collect();
                    let want = vec_dot_f16(&k, &queries[h * width..(h + 1) * width]) * 0.125;
                    assert_eq!(
                        scores[h * n_positions + p].to_bits(),
                        want.to_bits(),
                        "kq {n_positions} {h} {p}"
                    );
                }
            }
            // kqv: each output is a dot product over positions (the transposed V cache,
            // padded with zeros to a multiple of 32 as ggml's KV view is).
            let weights: Vec<f32> = (0..heads * n_positions)
                .map(|i| ((i * 5) % 23) as f32 / 23.0)
                .collect();
            let mut out = vec![0f32; heads * width];
            weighted_sum_f16_heads_decode(&weights, &key_rows, &mut out, heads);
            let padded = n_positions.div_ceil(32) * 32;
            for h in 0..heads {
                for d in 0..width {
                    let mut column = vec![0f32; padded];
                    let mut probs = vec![0f32; padded];
                    for p in 0..n_positions {
                        column[p] = keys[p][d].to_f32();
                        probs[p] = half(weights[h * n_positions + p]);
                    }
                    let want = vec_dot_f16(&column, &probs);
                    assert_eq!(
                        out[h * width + d].to_bits(),
                        want.to_bits(),
                        "kqv {n_positions} {h} {d}"
                    );
                }
            }
        }
    }

    /// The grouped (GQA) attention kernels give each head exactly the one-head bits.
    #[test]
    fn grouped_attention_kernels_equal_one_head_at_a_time() {
        // Every lane grouping of the AVX2 weighted sum (1, 2–3, 4–6, 7–8 heads), odd and
        // even position counts, fewer positions than lanes.
        for heads in [1, 2, 3, 4, 7, 8] {
            for n_positions in [1, 2, 7, 19, 40] {
                grouped_attention_case(64, n_positions, heads);
            }
        }
    }

    fn grouped_attention_case(width: usize, n_positions: usize, heads: usize) {
        let rows: Vec<Vec<f16>> = (0..n_positions)
            .map(|p| {
                (0..width)
                    .map(|d| f16::from_f32(((p * width + d) as f32 * 0.71).sin()))
                    .collect()
            })
            .collect();
        let rows: Vec<&[f16]> = rows.iter().map(Vec::as_slice).collect();
        let queries: Vec<f32> = (0..heads * width)
            .map(|i| (i as f32 * 0.11).cos())
            .collect();
        let mut scores = vec![0f32; heads * n_positions];
        attention_scores(&rows, &queries, 0.125, &mut scores);
        for h in 0..heads {
            for (p, row) in rows.iter().enumerate() {
                let one = dot_f16_f32(row, &queries[h * width..(h + 1) * width]) * 0.125;
                assert_eq!(
                    scores[h * n_positions + p].to_bits(),
                    one.to_bits(),
                    "{h} {p}"
                );
            }
        }
        let weights: Vec<f32> = (0..heads * n_positions)
            .map(|i| 1.0 / (i as f32 + 3.0))
            .collect();
        let mut out = vec![0f32; heads * width];
        weighted_sum_f16_heads(&weights, &rows, &mut out, heads);
        for h in 0..heads {
            let mut one = vec![0f32; width];
            weighted_sum_f16(
                &weights[h * n_positions..(h + 1) * n_positions],
                rows.iter().copied(),
                &mut one,
            );
            for d in 0..width {
                assert_eq!(
                    out[h * width + d].to_bits(),
                    one[d].to_bits(),
                    "head {h} d {d}"
                );
            }
        }
    }

    #[test]
    fn unsupported_types_are_named() {
        let error = GgmlType::from_id(10, "blk.3.ffn_up.weight").expect_err("Q2_K is unsupported");
        assert!(
            error.to_string().contains("blk.3.ffn_up.weight") && error.to_string().contains("Q2_K"),
            "{error}"
        );
    }
}

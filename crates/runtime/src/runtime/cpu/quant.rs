//! Quantized weights and their kernels: dequantization of every supported ggml type (block
//! layouts of llama.cpp's `ggml-common.h` / `ggml-quants.c`), quantization of activation rows
//! to 8-bit blocks, and dot products of a weight row with a quantized activation row.
//!
//! Weights stay in their file encoding. `Q4_0`, `Q4_1` and `Q8_0` rows are dotted in integer
//! arithmetic against 8-bit activations (AVX2 + FMA + F16C when the CPU has them, detected at
//! run time; a portable loop otherwise). Other types are dequantized a row at a time.

use super::simd::{has_avx2, hsum8};
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
    pub(super) unsafe fn quantize_row(x: &[f32], out: &mut Vec<BlockQ8>) {
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
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
    fn unsupported_types_are_named() {
        let error = GgmlType::from_id(10, "blk.3.ffn_up.weight").expect_err("Q2_K is unsupported");
        assert!(
            error.to_string().contains("blk.3.ffn_up.weight") && error.to_string().contains("Q2_K"),
            "{error}"
        );
    }
}

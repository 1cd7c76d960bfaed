//! The f16 attention kernels of the CPU engine over its f16 KV cache: scores (`kq`) and
//! weighted sums of values (`kqv`) in llama.cpp's orders — tinyBLAS's for prompts, ggml's
//! `ggml_vec_dot_f16` for decode steps — with AVX2/F16C paths chosen at run time and
//! portable ones of the same bits. Grouped-query heads sharing a KV head go together, so
//! each converted row serves them all.

use super::simd::{has_avx2, has_vnni, hsum8};
use half::f16;

/// `Σ a[i]·b[i]` for f16 `a` and f32 `b` (attention scores over an f16 KV cache), as
/// tinyBLAS computes a row of llama.cpp's `kq` product: element `i` is fused-multiply-added
/// into lane `i mod 8`, the lanes summed by `hsum8`. The AVX2 and portable paths give
/// identical results.
pub(crate) fn dot_f16_f32(a: &[f16], b: &[f32]) -> f32 {
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
pub(crate) fn weighted_sum_f16<'a>(
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
pub(crate) fn attention_scores(keys: &[&[f16]], queries: &[f32], scale: f32, scores: &mut [f32]) {
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
pub(crate) fn weighted_sum_f16_heads(
    weights: &[f32],
    values: &[&[f16]],
    out: &mut [f32],
    heads: usize,
) {
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
pub(crate) fn round_through_f16(values: &mut [f32]) {
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
pub(crate) fn prefetch_rows(rows: &[&[f16]]) {
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
    pub(crate) fn attention_scores_decode(keys: &[&[f16]], queries: &[f32], scale: f32, scores: &mut [f32]) {
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
    pub(crate) fn weighted_sum_f16_heads_decode(weights: &[f32], values: &[&[f16]], out: &mut [f32], heads: usize) {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

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
    pub(super) unsafe fn dot_f16_f32(a: &[half::f16], b: &[f32]) -> f32 {
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
    pub(super) unsafe fn attention_scores(
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
    pub(super) unsafe fn round_through_f16(values: &mut [f32]) {
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
    pub(super) unsafe fn weighted_sum_heads(
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
    pub(super) unsafe fn weighted_sum_heads_vl(
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
    pub(super) unsafe fn attention_scores_decode(
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
    pub(super) unsafe fn weighted_sum_heads_decode(
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
    pub(super) unsafe fn fma_f16_row(accumulator: &mut [f32], w: f32, v: &[half::f16]) {
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
mod tests {
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
}

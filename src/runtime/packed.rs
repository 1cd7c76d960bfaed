//! Weights repacked eight rows at a time for the integer kernels, as llama.cpp's CPU
//! "repack" buffers do (`ggml-cpu/repack.cpp`, `block_q4_0x8`): within each 32-element
//! block, the same four weights of eight consecutive rows sit side by side, so one
//! `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd`) multiplies four weights of eight rows with the
//! same four activations at once, and one f32 vector holds eight rows' partial sums.
//!
//! The arithmetic is exactly that of the one-row reference [`super::quant::dot_q8`]
//! (tested bit for bit, for any number of tokens and across tensor-parallel splits): per
//! block, each row's exact integer sum over 32 elements, then one fused multiply-add with
//! the scale `d_w · d_x`. Integer sums are exact in any order, so eight rows' sums are built
//! in one register from four-element pieces and converted once per block: one `vcvtdq2ps`
//! and one `vfmadd` per 256 multiply-accumulates.
//!
//! Record layout, per group of eight rows and per block (32-byte chunks): the eight rows'
//! scales `d` as f32; for `Q4_1` their minimums `m` as f32; then the quants: for `Q4_0` and
//! `Q4_1` four chunks, chunk `q` holding bytes `4q..4q+4` of each row's 16 packed bytes
//! (low nibbles: elements `4q..4q+3`; high nibbles: elements `16+4q..16+4q+3`), row `r` at
//! bytes `4r..4r+4`; for `Q8_0` eight chunks, chunk `k` holding elements `4k..4k+3` of each
//! row plus 128 (as unsigned bytes, for `vpdpbusd`; `128 · Σ q` is subtracted after). A last
//! group with fewer than eight rows is padded with zero rows.

use super::quant::{BlockQ8, DotState, GgmlType};

/// Rows per packed group: the lanes of one 256-bit f32 vector.
pub const GROUP_ROWS: usize = 8;

/// Most tokens one [`Packed::continue_group`] call takes. With AVX-512 VL's 32 vector
/// registers, eight tokens' sums and offsets stay in registers next to the unpacked weights
/// (each block unpacked once per eight tokens); plain AVX2 (16 registers) runs them four at
/// a time.
pub const MAX_TOKENS: usize = 8;

/// 32 bytes, aligned for vector loads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct Chunk(pub [u8; 32]);

/// The [`DotState`]s of one group of eight rows against one token: `[0][r]` is row `r`'s
/// scaled sum, `[1][r]` its `Q4_1` offset sum `Σ m · s`.
pub type GroupState = [[f32; GROUP_ROWS]; 2];

/// A matrix `(n_rows, n_blocks · 32)` of `Q4_0`, `Q4_1` or `Q8_0` in the packed layout.
pub struct Packed {
    pub ty: GgmlType,
    pub n_rows: usize,
    /// 32-element blocks per row.
    pub n_blocks: usize,
    /// Chunks per (group, block) record: 5 (`Q4_0`), 6 (`Q4_1`) or 9 (`Q8_0`).
    record_chunks: usize,
    /// `(n_groups, n_blocks, record_chunks)`.
    data: Vec<Chunk>,
}

impl Packed {
    /// Packs `n_rows` rows of `ty`, row `r` given by `row(r)` (`n_blocks` blocks in the
    /// file encoding). `None` for types without an integer kernel.
    pub fn new<'a>(
        ty: GgmlType,
        n_rows: usize,
        n_blocks: usize,
        row: impl Fn(usize) -> &'a [u8],
    ) -> Option<Packed> {
        let record_chunks = match ty {
            GgmlType::Q4_0 => 5,
            GgmlType::Q4_1 => 6,
            GgmlType::Q8_0 => 9,
            _ => return None,
        };
        let n_groups = n_rows.div_ceil(GROUP_ROWS);
        let mut data = vec![Chunk::default(); n_groups * n_blocks * record_chunks];
        let block_bytes = ty.block().1;
        for (g, group) in data.chunks_exact_mut(n_blocks * record_chunks).enumerate() {
            for r in 0..GROUP_ROWS.min(n_rows - g * GROUP_ROWS) {
                let bytes = row(g * GROUP_ROWS + r);
                for (i, record) in group.chunks_exact_mut(record_chunks).enumerate() {
                    let block = &bytes[i * block_bytes..(i + 1) * block_bytes];
                    let half = |at: usize| half::f16::from_le_bytes([block[at], block[at + 1]]);
                    record[0].0[4 * r..4 * r + 4].copy_from_slice(&half(0).to_f32().to_le_bytes());
                    let (quants, first) = match ty {
                        GgmlType::Q4_1 => {
                            record[1].0[4 * r..4 * r + 4]
                                .copy_from_slice(&half(2).to_f32().to_le_bytes());
                            (&block[4..], 2)
                        }
                        _ => (&block[2..], 1),
                    };
                    for (q, four) in quants.chunks_exact(4).enumerate() {
                        let bytes = &mut record[first + q].0[4 * r..4 * r + 4];
                        bytes.copy_from_slice(four);
                        if ty == GgmlType::Q8_0 {
                            bytes.iter_mut().for_each(|b| *b ^= 0x80);
                        }
                    }
                }
            }
        }
        Some(Packed {
            ty,
            n_rows,
            n_blocks,
            record_chunks,
            data,
        })
    }

    /// Groups of eight rows (the last possibly padded).
    pub fn n_groups(&self) -> usize {
        self.n_rows.div_ceil(GROUP_ROWS)
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() * size_of::<Chunk>()
    }

    /// Continues the partial sums of group `g` with up to [`MAX_TOKENS`] tokens: `states[t]`
    /// with `x[t]` (`n_blocks` blocks each). Without AVX2 it runs the portable one-row kernel
    /// on the rows rebuilt from the records (same bits, slowly).
    ///
    /// Panics (a bug, not input): more than [`MAX_TOKENS`] tokens, or a token with another
    /// block count.
    pub fn continue_group(&self, g: usize, x: &[&[BlockQ8]], states: &mut [GroupState]) {
        assert!(x.len() <= MAX_TOKENS && x.len() == states.len());
        assert!(x.iter().all(|x| x.len() == self.n_blocks));
        let records = &self.data[g * self.n_blocks * self.record_chunks..]
            [..self.n_blocks * self.record_chunks];
        #[cfg(target_arch = "x86_64")]
        if super::quant::has_avx2() {
            // SAFETY: AVX2/FMA/F16C checked (VNNI and VL too for the `true` variants);
            // `records` holds `n_blocks` records of `record_chunks` chunks and every `x[t]`
            // holds `n_blocks` blocks (asserted above).
            let vnni = super::quant::has_vnni();
            let per_call = if vnni { MAX_TOKENS } else { 4 };
            for (x, states) in x.chunks(per_call).zip(states.chunks_mut(per_call)) {
                unsafe { avx2::dispatch(self.ty, vnni, records, self.record_chunks, x, states) };
            }
            return;
        }
        for (x, state) in x.iter().zip(states.iter_mut()) {
            let [sums, offsets] = state;
            for (r, (sum, offset)) in sums.iter_mut().zip(offsets.iter_mut()).enumerate() {
                let row = self.unpacked_row(records, r);
                let mut one: DotState = [*sum, *offset];
                super::quant::dot_q8_continue(self.ty, &row, x, &mut one);
                [*sum, *offset] = one;
            }
        }
    }

    /// Row `r` of a group's records back in the file encoding (the portable path).
    fn unpacked_row(&self, records: &[Chunk], r: usize) -> Vec<u8> {
        let mut row = Vec::with_capacity(self.n_blocks * self.ty.block().1);
        for record in records.chunks_exact(self.record_chunks) {
            let scale = |c: usize| {
                let v = f32::from_le_bytes(record[c].0[4 * r..4 * r + 4].try_into().expect("4"));
                half::f16::from_f32(v).to_le_bytes()
            };
            row.extend_from_slice(&scale(0));
            let first = if self.ty == GgmlType::Q4_1 {
                row.extend_from_slice(&scale(1));
                2
            } else {
                1
            };
            for chunk in &record[first..] {
                let four = &chunk.0[4 * r..4 * r + 4];
                let signed = if self.ty == GgmlType::Q8_0 { 0x80 } else { 0 };
                row.extend(four.iter().map(|b| b ^ signed));
            }
        }
        row
    }
}

/// The finished dot products of a group's eight rows ([`super::quant::dot_state_finish`]).
pub fn finish_group(state: &GroupState) -> [f32; GROUP_ROWS] {
    std::array::from_fn(|r| super::quant::dot_state_finish(&[state[0][r], state[1][r]]))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ8, Chunk, GROUP_ROWS, GroupState};
    use crate::runtime::quant::GgmlType;

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Calls the kernel for `ty`, `x.len()` tokens and this CPU.
    ///
    /// Safety: AVX2, FMA and F16C are available, and AVX-512 VNNI and VL if `vnni`;
    /// `records` holds one record per block of every `x[t]`; `x.len() == states.len()`, at
    /// most 8 with `vnni` and 4 without.
    pub unsafe fn dispatch(
        ty: GgmlType,
        vnni: bool,
        records: &[Chunk],
        record_chunks: usize,
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
    ) {
        macro_rules! tokens {
            ($kind:expr, true) => {
                match x.len() {
                    1 => kernel_vnni::<$kind, 1>(records, record_chunks, x, states),
                    2 => kernel_vnni::<$kind, 2>(records, record_chunks, x, states),
                    3 => kernel_vnni::<$kind, 3>(records, record_chunks, x, states),
                    4 => kernel_vnni::<$kind, 4>(records, record_chunks, x, states),
                    5 => kernel_vnni::<$kind, 5>(records, record_chunks, x, states),
                    6 => kernel_vnni::<$kind, 6>(records, record_chunks, x, states),
                    7 => kernel_vnni::<$kind, 7>(records, record_chunks, x, states),
                    8 => kernel_vnni::<$kind, 8>(records, record_chunks, x, states),
                    _ => {}
                }
            };
            ($kind:expr, false) => {
                match x.len() {
                    1 => kernel_avx2::<$kind, 1>(records, record_chunks, x, states),
                    2 => kernel_avx2::<$kind, 2>(records, record_chunks, x, states),
                    3 => kernel_avx2::<$kind, 3>(records, record_chunks, x, states),
                    4 => kernel_avx2::<$kind, 4>(records, record_chunks, x, states),
                    _ => {}
                }
            };
        }
        macro_rules! kinds {
            ($vnni:tt) => {
                match ty {
                    GgmlType::Q4_0 => tokens!(Q4_0, $vnni),
                    GgmlType::Q4_1 => tokens!(Q4_1, $vnni),
                    _ => tokens!(Q8_0, $vnni),
                }
            };
        }
        // SAFETY: as the caller promises.
        unsafe { if vnni { kinds!(true) } else { kinds!(false) } }
    }

    /// `vpdpbusd` on 256-bit vectors, with AVX-512 VL's 32 vector registers.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn kernel_vnni<const KIND: u8, const N: usize>(
        records: &[Chunk],
        record_chunks: usize,
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
    ) {
        unsafe { body::<KIND, N, true>(records, record_chunks, x, states) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn kernel_avx2<const KIND: u8, const N: usize>(
        records: &[Chunk],
        record_chunks: usize,
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
    ) {
        unsafe { body::<KIND, N, false>(records, record_chunks, x, states) }
    }

    // Indexing by token and piece reads clearer than nested iterators here.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn body<const KIND: u8, const N: usize, const VNNI: bool>(
        records: &[Chunk],
        record_chunks: usize,
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
    ) {
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            let mut offsets = [_mm256_setzero_ps(); N];
            for t in 0..N {
                acc[t] = _mm256_loadu_ps(states[t][0].as_ptr());
                offsets[t] = _mm256_loadu_ps(states[t][1].as_ptr());
            }
            let low_nibbles = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            // What the unsigned weight levels are offset by: Σ (u − c)·q = Σ u·q − c·Σ q.
            let bias = match KIND {
                Q4_0 => 8,
                Q8_0 => 128,
                _ => 0,
            };
            let n_blocks = x[0].len();
            for i in 0..n_blocks {
                let record = records.as_ptr().add(i * record_chunks) as *const __m256i;
                let scales = _mm256_load_ps(record as *const f32);
                let quants = record.add(if KIND == Q4_1 { 2 } else { 1 });
                // Unsigned weight levels of elements 4k..4k+3 of the eight rows.
                let mut w = [_mm256_setzero_si256(); 8];
                if KIND == Q8_0 {
                    for k in 0..8 {
                        w[k] = _mm256_load_si256(quants.add(k));
                    }
                } else {
                    for q in 0..4 {
                        let packed = _mm256_load_si256(quants.add(q));
                        w[q] = _mm256_and_si256(packed, low_nibbles);
                        w[q + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
                    }
                }
                for t in 0..N {
                    let a = &x[t][i];
                    let four = a.qs.as_ptr() as *const i32;
                    let q = |k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(four.add(k)));
                    let sums = if VNNI {
                        let mut even = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], q(0));
                        let mut odd = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[1], q(1));
                        for k in (2..8).step_by(2) {
                            even = _mm256_dpbusd_epi32(even, w[k], q(k));
                            odd = _mm256_dpbusd_epi32(odd, w[k + 1], q(k + 1));
                        }
                        _mm256_add_epi32(even, odd)
                    } else if KIND == Q8_0 {
                        // Bytes up to 255 would saturate `vpmaddubsw`: the sign trick on
                        // the signed weights instead (|w| ≤ 128, |q| ≤ 127), exact, plus
                        // the bias the common step below takes off again.
                        let flip = _mm256_set1_epi8(-128);
                        let mut sums = _mm256_set1_epi32(bias * a.qsum);
                        for k in 0..8 {
                            let signed = _mm256_xor_si256(w[k], flip);
                            let pairs = _mm256_maddubs_epi16(
                                _mm256_sign_epi8(signed, signed),
                                _mm256_sign_epi8(q(k), signed),
                            );
                            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
                        }
                        sums
                    } else {
                        // 4-bit levels: each pair ≤ 2·15·127, eight pairs fit in i16.
                        let mut pairs = _mm256_maddubs_epi16(w[0], q(0));
                        for k in 1..8 {
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[k], q(k)));
                        }
                        _mm256_madd_epi16(pairs, ones)
                    };
                    let sums = if bias != 0 {
                        _mm256_sub_epi32(sums, _mm256_set1_epi32(bias * a.qsum))
                    } else {
                        sums
                    };
                    let scale = _mm256_mul_ps(scales, _mm256_set1_ps(a.d));
                    acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc[t]);
                }
            }
            // `Q4_1` offsets `Σ m · s` are a separate accumulator (in block order, as the
            // reference's), so they take their own pass: in the loop above, eight tokens'
            // offsets would crowd the unpacked weights out of the registers.
            if KIND == Q4_1 {
                for i in 0..n_blocks {
                    let record = records.as_ptr().add(i * record_chunks) as *const __m256i;
                    let mins = _mm256_load_ps(record.add(1) as *const f32);
                    for t in 0..N {
                        let sum = _mm256_set1_ps(x[t][i].sum);
                        offsets[t] = _mm256_fmadd_ps(mins, sum, offsets[t]);
                    }
                }
            }
            for t in 0..N {
                _mm256_storeu_ps(states[t][0].as_mut_ptr(), acc[t]);
                _mm256_storeu_ps(states[t][1].as_mut_ptr(), offsets[t]);
            }
            debug_assert_eq!(GROUP_ROWS, 8);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::quant::tests::bytes;
    use crate::runtime::quant::{dot_q8, quantize_row_q8};

    /// `n_rows` rows of `ty` with random quants (every byte value, `Q8_0`'s −128 included)
    /// and varied finite scales.
    fn rows(ty: GgmlType, n_rows: usize, n_blocks: usize) -> Vec<Vec<u8>> {
        let block_bytes = ty.block().1;
        (0..n_rows)
            .map(|r| {
                let mut row = bytes(n_blocks * block_bytes, 0x51ED + 2 * r as u64);
                for (i, block) in row.chunks_exact_mut(block_bytes).enumerate() {
                    let d = half::f16::from_f32(0.002 * (1 + (r + i) % 7) as f32);
                    block[..2].copy_from_slice(&d.to_le_bytes());
                    if ty == GgmlType::Q4_1 {
                        let m = half::f16::from_f32(-0.03 * (1 + (r * i) % 5) as f32);
                        block[2..4].copy_from_slice(&m.to_le_bytes());
                    }
                }
                row
            })
            .collect()
    }

    /// A token's activations, quantized; `spread` varies their magnitudes per block.
    fn token(n_blocks: usize, seed: usize, spread: f32) -> Vec<BlockQ8> {
        let x: Vec<f32> = (0..n_blocks * 32)
            .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .map(|v| v * (1.0 + spread * ((seed + 1) % 5) as f32))
            .collect();
        let mut blocks = Vec::new();
        quantize_row_q8(&x, &mut blocks);
        blocks
    }

    /// Runs `packed` over every group for `tokens`, with or without VNNI, from zero states.
    fn products(packed: &Packed, tokens: &[Vec<BlockQ8>], vnni: Option<bool>) -> Vec<Vec<f32>> {
        let x: Vec<&[BlockQ8]> = tokens.iter().map(|t| &t[..]).collect();
        let mut out = vec![vec![0f32; packed.n_rows]; tokens.len()];
        for g in 0..packed.n_groups() {
            let mut states = vec![[[0f32; GROUP_ROWS]; 2]; tokens.len()];
            let records = &packed.data[g * packed.n_blocks * packed.record_chunks..]
                [..packed.n_blocks * packed.record_chunks];
            match vnni {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the callers check AVX2 (and VNNI + VL for `Some(true)`); records
                // and tokens have `n_blocks` blocks each.
                Some(vnni) => unsafe {
                    avx2::dispatch(
                        packed.ty,
                        vnni,
                        records,
                        packed.record_chunks,
                        &x,
                        &mut states,
                    )
                },
                _ => packed.continue_group(g, &x, &mut states),
            }
            for (t, state) in states.iter().enumerate() {
                for (r, value) in finish_group(state).iter().enumerate() {
                    if g * GROUP_ROWS + r < packed.n_rows {
                        out[t][g * GROUP_ROWS + r] = *value;
                    }
                }
            }
        }
        out
    }

    /// Every kernel variant (1–8 tokens with VNNI, 1–4 without, `continue_group` splitting
    /// as this CPU needs, the portable path on unpacked rows) gives each row exactly the bits
    /// of the one-row reference, for 13 rows (a padded last group) of each type.
    #[test]
    fn packed_kernels_equal_the_one_row_reference_bit_for_bit() {
        let n_blocks = 18;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let rows = rows(ty, 13, n_blocks);
            let packed = Packed::new(ty, 13, n_blocks, |r| &rows[r]).expect("integer type");
            assert_eq!(packed.n_groups(), 2);
            for n_tokens in 1..=MAX_TOKENS {
                let tokens: Vec<Vec<BlockQ8>> =
                    (0..n_tokens).map(|t| token(n_blocks, t, 3.0)).collect();
                let mut variants = vec![("dispatch", products(&packed, &tokens, None))];
                #[cfg(target_arch = "x86_64")]
                if crate::runtime::quant::has_avx2() {
                    if n_tokens <= 4 {
                        variants.push(("avx2", products(&packed, &tokens, Some(false))));
                    }
                    if crate::runtime::quant::has_vnni() {
                        variants.push(("vnni", products(&packed, &tokens, Some(true))));
                    }
                }
                for (name, out) in &variants {
                    for (t, per_row) in out.iter().enumerate() {
                        for (r, value) in per_row.iter().enumerate() {
                            let reference = dot_q8(ty, &rows[r], &tokens[t]);
                            assert_eq!(
                                value.to_bits(),
                                reference.to_bits(),
                                "{ty:?} {name}: {n_tokens} tokens, token {t}, row {r}"
                            );
                        }
                    }
                }
                // The portable path rebuilds the file encoding from the records exactly.
                let records = &packed.data[..n_blocks * packed.record_chunks];
                for (r, row) in rows.iter().enumerate().take(GROUP_ROWS) {
                    assert_eq!(&packed.unpacked_row(records, r), row, "{ty:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn other_types_are_not_packed() {
        let row = vec![0u8; 4 * 32];
        assert!(Packed::new(GgmlType::F32, 1, 1, |_| &row).is_none());
    }
}

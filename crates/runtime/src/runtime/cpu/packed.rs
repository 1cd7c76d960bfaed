//! Weights repacked sixteen rows at a time for the integer kernels, as llama.cpp's CPU
//! "repack" buffers do eight (`ggml-cpu/repack.cpp`, `block_q4_0x8`): within each
//! 32-element block, the same four weights of sixteen consecutive rows sit side by side, so
//! one 512-bit `vpdpbusd` multiplies four weights of sixteen rows with the same four
//! activations at once, and one f32 vector holds sixteen rows' partial sums. Without
//! AVX-512 the kernels take each group as two halves of eight rows in 256-bit vectors
//! (`vpmaddubsw` + `vpmaddwd`).
//!
//! The arithmetic is exactly that of the one-row reference [`crate::runtime::cpu::quant::dot_q8`]
//! (tested bit for bit, for any number of tokens and across tensor-parallel splits), which
//! is llama.cpp's AVX2 order: per block, each row's eight four-element integer sums, each
//! converted and fused-multiply-added with the scale `d_w · d_x` into its own lane
//! accumulator. In this layout chunk `k` holds exactly the four elements of lane `k`, so
//! one `vpdpbusd` gives lane `k` of sixteen rows, and the eight lane accumulators of a
//! token are eight f32 vectors (one per lane, a row per vector element).
//!
//! Why sixteen rows: on AMD Zen 4 (measured here, a C microbenchmark of this kernel on
//! L1-resident records, 16 tokens) the 512-bit kernel does ~90 GMAC/s per core against
//! ~70 for the 256-bit one. Both run the same multiply pipes (a 512-bit operation takes
//! two of them for a cycle), but the 256-bit kernel issues twice the instructions for the
//! same work and stalls on issue before the pipes fill.
//!
//! Record layout, per group of sixteen rows and per block (64-byte chunks): the rows'
//! scales `d` as f32; for `Q4_1` their minimums `m` as f32; then the quants: for `Q4_0` and
//! `Q4_1` four chunks, chunk `q` holding bytes `4q..4q+4` of each row's 16 packed bytes
//! (low nibbles: elements `4q..4q+3`; high nibbles: elements `16+4q..16+4q+3`), row `r` at
//! bytes `4r..4r+4`; for `Q8_0` eight chunks, chunk `k` holding elements `4k..4k+3` of each
//! row plus 128 (as unsigned bytes, for `vpdpbusd`: each lane's integer sum starts from
//! `−128 · Σ q` over the token's four quants, [`BlockQ8::lane_sums`], so it ends exactly at
//! `Σ w·q`; `Q4_0` likewise starts from `−8 · Σ q` for its nibbles' offset of 8). A last
//! group with fewer than sixteen rows is padded with zero rows.
//!
//! A product that starts from zero ([`Packed::product_group`], every matrix product that is
//! not a tensor-parallel continuation) keeps its accumulators in registers and stores only
//! the sixteen finished sums per token.

use crate::runtime::cpu::quant::{BlockQ8, DotState, Numerics};
use crate::runtime::formats::ggml::GgmlType;

/// Rows per packed group: the lanes of one 512-bit f32 vector.
pub(crate) const GROUP_ROWS: usize = 16;

/// Most tokens one [`Packed::continue_group`] call takes (the kernels take them two at a
/// time with AVX-512's 32 vector registers: two tokens' 16 lane accumulators next to the
/// unpacked weight vectors; one at a time with plain AVX2's 16).
pub(crate) const MAX_TOKENS: usize = 16;

/// 64 bytes (four bytes of each of a group's rows), aligned for vector loads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Chunk(pub [u8; 64]);

impl Default for Chunk {
    fn default() -> Chunk {
        Chunk([0; 64])
    }
}

/// Cache lines a kernel call asks for while it runs: `lines_per_block` lines from `from`
/// in each block iteration, `lines` in all (a null `from`: none).
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    from: *const u8,
    lines_per_block: usize,
    lines: usize,
}

impl Prefetch {
    const NONE: Prefetch = Prefetch {
        from: std::ptr::null(),
        lines_per_block: 0,
        lines: 0,
    };
}

/// The [`DotState`]s of one group of rows against one token: `[k][r]` is row `r`'s lane
/// `k` (`k < 8`), `[8][r]` its `Q4_1` offset sum `Σ m · s`.
pub(crate) type GroupState = [[f32; GROUP_ROWS]; 9];

/// Tokens the kernels take in one call. Exact: two with VNNI, one without (each token
/// holds eight lane accumulators). Fast: four with VNNI, two without (one accumulator and
/// one integer sum per token).
#[cfg(target_arch = "x86_64")]
fn tokens_per_call(vnni: bool, numerics: Numerics) -> usize {
    match (numerics, vnni) {
        (Numerics::Exact, true) => 2,
        (Numerics::Exact, false) => 1,
        (Numerics::Fast, true) => 4,
        (Numerics::Fast, false) => 2,
    }
}

/// A matrix `(n_rows, n_blocks · 32)` of `Q4_0`, `Q4_1` or `Q8_0` in the packed layout.
pub(crate) struct Packed {
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
    pub(crate) fn new<'a>(
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

    /// Groups of [`GROUP_ROWS`] rows (the last possibly padded).
    pub(crate) fn n_groups(&self) -> usize {
        self.n_rows.div_ceil(GROUP_ROWS)
    }

    /// Continues the partial sums of group `g` with up to [`MAX_TOKENS`] tokens: `states[t]`
    /// with `x[t]` (`n_blocks` blocks each), rounding as `numerics` says. Without AVX2 it
    /// runs the portable one-row kernel on the rows rebuilt from the records (same bits,
    /// slowly).
    ///
    /// Panics (a bug, not input): more than [`MAX_TOKENS`] tokens, or a token with another
    /// block count.
    pub(crate) fn continue_group(
        &self,
        g: usize,
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
        numerics: Numerics,
    ) {
        assert!(x.len() <= MAX_TOKENS && x.len() == states.len());
        let records = self.records(g, x);
        #[cfg(target_arch = "x86_64")]
        if self.run_simd(records, x, states, numerics, None, avx2::Io::Continue) {
            return;
        }
        self.continue_portably(records, x, states, numerics);
    }

    /// The finished dot products of group `g`'s rows with up to [`MAX_TOKENS`]
    /// tokens (`out[t]` for `x[t]`): [`continue_group`](Packed::continue_group) from zero
    /// states, then [`finish_group`], without the states ever leaving the registers. Same
    /// bits as that pair, and as [`crate::runtime::cpu::quant::dot_q8`] per row. `ahead`: a group to bring
    /// into the cache meanwhile (worth it when a group serves several tokens: the hardware
    /// prefetcher then sees re-reads of one group rather than a stream, and each next group
    /// would start with a run of cache misses); past the last group it is ignored.
    ///
    /// Panics (a bug, not input): as `continue_group`.
    pub(crate) fn product_group(
        &self,
        g: usize,
        x: &[&[BlockQ8]],
        out: &mut [[f32; GROUP_ROWS]],
        numerics: Numerics,
        ahead: Option<usize>,
    ) {
        assert!(x.len() <= MAX_TOKENS && x.len() == out.len());
        let records = self.records(g, x);
        #[cfg(target_arch = "x86_64")]
        if self.run_simd(records, x, out, numerics, ahead, avx2::Io::Fresh) {
            return;
        }
        let mut states = vec![[[0f32; GROUP_ROWS]; 9]; x.len()];
        self.continue_portably(records, x, &mut states, numerics);
        for (out, state) in out.iter_mut().zip(&states) {
            *out = finish_group(state);
        }
    }

    /// Runs the SIMD kernel over `x` as many tokens per call as this CPU takes, `io` making
    /// each call's states or outputs from its slice of `items` (one per token). `false`
    /// (nothing run) without AVX2.
    #[cfg(target_arch = "x86_64")]
    fn run_simd<'a, T>(
        &self,
        records: &[Chunk],
        x: &[&[BlockQ8]],
        items: &'a mut [T],
        numerics: Numerics,
        ahead: Option<usize>,
        io: impl Fn(&'a mut [T]) -> avx2::Io<'a>,
    ) -> bool {
        if !crate::runtime::cpu::simd::has_avx2() {
            return false;
        }
        let vnni = crate::runtime::cpu::simd::has_vnni();
        let per_call = tokens_per_call(vnni, numerics);
        let calls = x.len().div_ceil(per_call);
        // The calls share the prefetching of the `ahead` group evenly, each spreading its
        // part over its blocks: all of it in the first call asks for more lines at once than
        // the core has miss buffers (at 16 tokens, ~1.1× the throughput of `bench decode
        // --batch 16` measured, interleaved runs).
        let ahead = ahead
            .filter(|&g| g < self.n_groups())
            .map(|g| self.records_of(g));
        let total_lines = ahead.map_or(0, |r| size_of_val(r) / 64);
        for (j, (x, items)) in x
            .chunks(per_call)
            .zip(items.chunks_mut(per_call))
            .enumerate()
        {
            let kernel = avx2::Kernel {
                ty: self.ty,
                vnni,
                numerics,
            };
            let prefetch = ahead.map_or(Prefetch::NONE, |records| {
                let first = j * total_lines / calls;
                let lines = (j + 1) * total_lines / calls - first;
                Prefetch {
                    from: records.as_ptr().cast::<u8>().wrapping_add(first * 64),
                    lines_per_block: lines.div_ceil(self.n_blocks),
                    lines,
                }
            });
            // SAFETY: AVX2/FMA/F16C checked (VNNI and VL too for `vnni`); `records` holds
            // `n_blocks` records and every `x[t]` `n_blocks` blocks (`records` asserts it);
            // `items` has one entry per token (the callers assert it), at most `per_call`.
            unsafe { avx2::dispatch(kernel, records, self.record_chunks, prefetch, x, io(items)) };
        }
        true
    }

    /// Group `g`'s records, checking that every token has `n_blocks` blocks.
    fn records(&self, g: usize, x: &[&[BlockQ8]]) -> &[Chunk] {
        assert!(x.iter().all(|x| x.len() == self.n_blocks));
        self.records_of(g)
    }

    /// Group `g`'s records (`n_blocks` of `record_chunks` chunks).
    fn records_of(&self, g: usize) -> &[Chunk] {
        &self.data[g * self.n_blocks * self.record_chunks..][..self.n_blocks * self.record_chunks]
    }

    /// [`continue_group`](Packed::continue_group) with the portable one-row kernel on the
    /// rows rebuilt from the records (same bits, slowly).
    #[allow(clippy::needless_range_loop)] // rows index the lanes' arrays
    fn continue_portably(
        &self,
        records: &[Chunk],
        x: &[&[BlockQ8]],
        states: &mut [GroupState],
        numerics: Numerics,
    ) {
        for (x, state) in x.iter().zip(states.iter_mut()) {
            for r in 0..GROUP_ROWS {
                let row = self.unpacked_row(records, r);
                let mut one: DotState = std::array::from_fn(|k| state[k][r]);
                crate::runtime::cpu::quant::dot_q8_continue(self.ty, &row, x, &mut one, numerics);
                for (k, value) in one.iter().enumerate() {
                    state[k][r] = *value;
                }
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

/// The finished dot products of a group's rows ([`crate::runtime::cpu::quant::dot_state_finish`]).
/// Written as whole-vector additions in `hsum8`'s order (plain loops over the rows
/// vectorise; the lane-by-lane closure would not).
#[allow(clippy::needless_range_loop)]
pub(crate) fn finish_group(state: &GroupState) -> [f32; GROUP_ROWS] {
    let mut out = [0f32; GROUP_ROWS];
    for r in 0..GROUP_ROWS {
        let l = |k: usize| state[k][r];
        out[r] = ((l(0) + l(4)) + (l(2) + l(6))) + ((l(1) + l(5)) + (l(3) + l(7))) + l(8);
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ8, Chunk, GROUP_ROWS, GroupState, Prefetch};
    use crate::runtime::cpu::quant::Numerics;
    use crate::runtime::formats::ggml::GgmlType;

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Where a kernel call starts and what it leaves: `Continue` loads and stores the
    /// [`GroupState`]s (tensor-parallel continuation); `Fresh` starts from zero and stores
    /// the finished dot products (`[f32; GROUP_ROWS]` per token), never touching a state in
    /// memory.
    pub(super) enum Io<'a> {
        Continue(&'a mut [GroupState]),
        Fresh(&'a mut [[f32; GROUP_ROWS]]),
    }

    /// Which kernel to run: the weights' type, whether AVX-512 (F, BW, VL, VNNI) may be
    /// used, and the rounding order.
    #[derive(Clone, Copy)]
    pub(super) struct Kernel {
        pub ty: GgmlType,
        pub vnni: bool,
        pub numerics: Numerics,
    }

    /// Calls `kernel` for `x.len()` tokens; `ahead` (or null) is a group whose records to
    /// bring into the cache meanwhile, a record's worth per block. With AVX-512 one call
    /// takes a group's sixteen rows in 512-bit vectors; with plain AVX2 two calls take its
    /// two halves of eight rows in 256-bit vectors.
    ///
    /// Safety: AVX2, FMA and F16C are available, and AVX-512 F, BW, VL and VNNI if
    /// `kernel.vnni`; `records` holds one record per block of every `x[t]`; `io` holds
    /// `x.len()` entries, at most [`super::tokens_per_call`].
    pub(super) unsafe fn dispatch(
        kernel: Kernel,
        records: &[Chunk],
        record_chunks: usize,
        ahead: Prefetch,
        x: &[&[BlockQ8]],
        io: Io<'_>,
    ) {
        macro_rules! tokens {
            ($kind:expr, $fresh:expr, $at:expr, true, true) => {{
                let (base, ahead, io) = $at;
                match x.len() {
                    1 => kernel_vnni::<$kind, 1, $fresh>(base, record_chunks, ahead, x, io),
                    2 => kernel_vnni::<$kind, 2, $fresh>(base, record_chunks, ahead, x, io),
                    _ => {}
                }
            }};
            ($kind:expr, $fresh:expr, $at:expr, false, true) => {{
                let (base, ahead, io) = $at;
                if x.len() == 1 {
                    kernel_avx2::<$kind, 1, $fresh>(base, record_chunks, ahead, x, io)
                }
            }};
            ($kind:expr, $fresh:expr, $at:expr, true, false) => {{
                let (base, ahead, io) = $at;
                match x.len() {
                    1 => fast_vnni::<$kind, 1, $fresh>(base, record_chunks, ahead, x, io),
                    2 => fast_vnni::<$kind, 2, $fresh>(base, record_chunks, ahead, x, io),
                    3 => fast_vnni::<$kind, 3, $fresh>(base, record_chunks, ahead, x, io),
                    4 => fast_vnni::<$kind, 4, $fresh>(base, record_chunks, ahead, x, io),
                    _ => {}
                }
            }};
            ($kind:expr, $fresh:expr, $at:expr, false, false) => {{
                let (base, ahead, io) = $at;
                match x.len() {
                    1 => fast_avx2::<$kind, 1, $fresh>(base, record_chunks, ahead, x, io),
                    2 => fast_avx2::<$kind, 2, $fresh>(base, record_chunks, ahead, x, io),
                    _ => {}
                }
            }};
        }
        macro_rules! kinds {
            ($fresh:expr, $at:expr, $vnni:tt, $exact:tt) => {
                match kernel.ty {
                    GgmlType::Q4_0 => tokens!(Q4_0, $fresh, $at, $vnni, $exact),
                    GgmlType::Q4_1 => tokens!(Q4_1, $fresh, $at, $vnni, $exact),
                    _ => tokens!(Q8_0, $fresh, $at, $vnni, $exact),
                }
            };
        }
        macro_rules! orders {
            ($fresh:expr, $at:expr, $vnni:tt) => {
                match kernel.numerics {
                    Numerics::Exact => kinds!($fresh, $at, $vnni, true),
                    Numerics::Fast => kinds!($fresh, $at, $vnni, false),
                }
            };
        }
        // The states (or outputs) as one pointer per token, so one kernel serves both.
        let (fresh, pointer) = match io {
            Io::Continue(states) => {
                assert_eq!(states.len(), x.len());
                (false, states.as_mut_ptr() as *mut f32)
            }
            Io::Fresh(out) => {
                assert_eq!(out.len(), x.len());
                (true, out.as_mut_ptr() as *mut f32)
            }
        };
        let base = records.as_ptr() as *const u8;
        // SAFETY: as the caller promises; `pointer` covers `x.len()` states or outputs; a
        // half's pointers stay inside the group's chunks and rows.
        unsafe {
            if kernel.vnni {
                let at = (base, ahead, pointer);
                match fresh {
                    true => orders!(true, at, true),
                    false => orders!(false, at, true),
                }
            } else {
                for half in 0..GROUP_ROWS / Ymm::ROWS {
                    let at = (
                        base.add(half * 32),
                        if half == 0 { ahead } else { Prefetch::NONE },
                        pointer.add(half * Ymm::ROWS),
                    );
                    match fresh {
                        true => orders!(true, at, false),
                        false => orders!(false, at, false),
                    }
                }
            }
        }
    }

    /// The vector operations of the kernels at one width: [`Zmm`] takes a group's sixteen
    /// rows in 512-bit vectors with AVX-512 VNNI's `vpdpbusd`; [`Ymm`] takes eight rows
    /// (half a group) in 256-bit vectors with AVX2's `vpmaddubsw` + `vpmaddwd`. Both give
    /// the same exact integer sums, so the same bits.
    trait Width {
        /// Rows (f32 lanes) per vector.
        const ROWS: usize;
        /// Whether [`Width::dot4`] takes the weights as unsigned bytes (`vpdpbusd`):
        /// `Q8_0`'s stored byte is then its level + 128, corrected by the starting value.
        const VNNI: bool;
        type F: Copy;
        type I: Copy;
        unsafe fn zero() -> Self::F;
        unsafe fn load(p: *const f32) -> Self::F;
        unsafe fn store(p: *mut f32, v: Self::F);
        unsafe fn splat(v: f32) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        /// `a · b + c`, rounded once.
        unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn convert(v: Self::I) -> Self::F;
        unsafe fn load_bytes(p: *const u8) -> Self::I;
        unsafe fn splat_i(v: i32) -> Self::I;
        unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
        /// Each byte's low nibble.
        unsafe fn low_nibbles(v: Self::I) -> Self::I;
        /// Each byte's high nibble.
        unsafe fn high_nibbles(v: Self::I) -> Self::I;
        /// Each byte xor 0x80 (`Q8_0`'s stored byte back to its signed level).
        unsafe fn flip(v: Self::I) -> Self::I;
        /// Per 32-bit lane, `start` (zero if `None`) plus the exact sum of its four byte
        /// products `w · q`, `q` signed, `w` signed if `signed` else unsigned (`signed`
        /// only without VNNI; a constant once inlined).
        unsafe fn dot4(signed: bool, start: Option<Self::I>, w: Self::I, q: Self::I) -> Self::I;
    }

    /// Sixteen rows per vector, AVX-512.
    struct Zmm;

    /// Eight rows per vector, AVX2.
    struct Ymm;

    impl Width for Zmm {
        const ROWS: usize = 16;
        const VNNI: bool = true;
        type F = __m512;
        type I = __m512i;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn convert(v: __m512i) -> __m512 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_cvtepi32_ps(v) }
        }
        #[inline(always)]
        unsafe fn load_bytes(p: *const u8) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_loadu_si512(p as *const _) }
        }
        #[inline(always)]
        unsafe fn splat_i(v: i32) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_set1_epi32(v) }
        }
        #[inline(always)]
        unsafe fn add_i(a: __m512i, b: __m512i) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_add_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn low_nibbles(v: __m512i) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_and_si512(v, _mm512_set1_epi8(0x0F)) }
        }
        #[inline(always)]
        unsafe fn high_nibbles(v: __m512i) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(0x0F)) }
        }
        #[inline(always)]
        unsafe fn flip(v: __m512i) -> __m512i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_xor_si512(v, _mm512_set1_epi8(-128)) }
        }
        #[inline(always)]
        unsafe fn dot4(signed: bool, start: Option<__m512i>, w: __m512i, q: __m512i) -> __m512i {
            debug_assert!(!signed, "vpdpbusd takes unsigned weights");
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm512_dpbusd_epi32(start.unwrap_or(_mm512_setzero_si512()), w, q) }
        }
    }

    impl Width for Ymm {
        const ROWS: usize = 8;
        const VNNI: bool = false;
        type F = __m256;
        type I = __m256i;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn convert(v: __m256i) -> __m256 {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_cvtepi32_ps(v) }
        }
        #[inline(always)]
        unsafe fn load_bytes(p: *const u8) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_loadu_si256(p as *const __m256i) }
        }
        #[inline(always)]
        unsafe fn splat_i(v: i32) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_set1_epi32(v) }
        }
        #[inline(always)]
        unsafe fn add_i(a: __m256i, b: __m256i) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_add_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn low_nibbles(v: __m256i) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_and_si256(v, _mm256_set1_epi8(0x0F)) }
        }
        #[inline(always)]
        unsafe fn high_nibbles(v: __m256i) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F)) }
        }
        #[inline(always)]
        unsafe fn flip(v: __m256i) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe { _mm256_xor_si256(v, _mm256_set1_epi8(-128)) }
        }
        #[inline(always)]
        unsafe fn dot4(signed: bool, start: Option<__m256i>, w: __m256i, q: __m256i) -> __m256i {
            // SAFETY: the `Width` contract: the CPU has this width's features (checked before
            // dispatch) and pointers are valid for a whole vector.
            unsafe {
                let ones = _mm256_set1_epi16(1);
                let sums = if signed {
                    // |w| as unsigned bytes, w's sign moved onto q: exact (no saturation,
                    // |w·q| ≤ 128·127 per pair).
                    let unsigned = _mm256_sign_epi8(w, w);
                    let signed = _mm256_sign_epi8(q, w);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), ones)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones)
                };
                match start {
                    Some(start) => _mm256_add_epi32(start, sums),
                    None => sums,
                }
            }
        }
    }

    /// Arguments of every kernel: `base` the group's first record (a half's first byte
    /// with [`Ymm`]), `record_chunks` chunks per record, `ahead` a group to prefetch (or
    /// null), the tokens, and `io` their states or outputs (a half's first row with
    /// [`Ymm`]).
    macro_rules! kernel_fns {
        ($(#[$doc:meta] $name:ident, $body:ident, $width:ty, $features:literal;)*) => {$(
            #[$doc]
            #[target_feature(enable = $features)]
            unsafe fn $name<const KIND: u8, const N: usize, const FRESH: bool>(
                base: *const u8,
                record_chunks: usize,
                ahead: Prefetch,
                x: &[&[BlockQ8]],
                io: *mut f32,
            ) {
                // SAFETY: the target features above are the ones `$width` needs; the pointers are
                // the caller's, under `$body`'s contract.
                unsafe { $body::<$width, KIND, N, FRESH>(base, record_chunks, ahead, x, io) }
            }
        )*};
    }

    kernel_fns! {
        /// The exact kernel with AVX-512 VNNI.
        kernel_vnni, body, Zmm, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
        /// The exact kernel on plain AVX2.
        kernel_avx2, body, Ymm, "avx2,fma,f16c";
        /// The [`Numerics::Fast`] kernel with AVX-512 VNNI.
        fast_vnni, body_fast, Zmm, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
        /// The [`Numerics::Fast`] kernel on plain AVX2.
        fast_avx2, body_fast, Ymm, "avx2,fma,f16c";
    }

    /// Asks for block `i`'s share of `ahead`'s lines: a few 64-byte lines per block rather
    /// than all at once, which would fill the core's miss buffers and stall the kernel
    /// behind them.
    #[inline(always)]
    unsafe fn prefetch_block(ahead: Prefetch, i: usize) {
        let first = i * ahead.lines_per_block;
        let last = (first + ahead.lines_per_block).min(ahead.lines);
        for line in first..last {
            // SAFETY: a prefetch has no effect beyond the cache, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.from.wrapping_add(line * 64) as *const i8) };
        }
    }

    /// Whether `KIND`'s stored weights are signed bytes for [`Width::dot4`]: `Q8_0`'s
    /// without VNNI (flipped back from the stored level + 128).
    const fn signed<W: Width, const KIND: u8>() -> bool {
        KIND == Q8_0 && !W::VNNI
    }

    /// Lanes two at a time: pair `pair`'s two lane indices and the rows' weights of each,
    /// unpacked for [`Width::dot4`] (`Q4`'s chunk `q` holds lane `q` in its low nibbles and
    /// lane `q + 4` in its high ones; `Q8_0`'s chunks are one lane each, flipped back to
    /// signed bytes without VNNI). `chunk(c)` is the record's chunk `c` (its half with
    /// [`Ymm`]).
    #[inline(always)]
    unsafe fn lane_pair<W: Width, const KIND: u8>(
        chunk: impl Fn(usize) -> *const u8,
        pair: usize,
    ) -> ((usize, W::I), (usize, W::I)) {
        let first = first_quant_chunk(KIND);
        // SAFETY: this function's contract: the CPU has `W`'s features and `chunk` gives pointers
        // to whole chunks of one record.
        unsafe {
            if KIND == Q8_0 {
                let (k0, k1) = (2 * pair, 2 * pair + 1);
                let (raw0, raw1) = (
                    W::load_bytes(chunk(first + k0)),
                    W::load_bytes(chunk(first + k1)),
                );
                if W::VNNI {
                    ((k0, raw0), (k1, raw1))
                } else {
                    ((k0, W::flip(raw0)), (k1, W::flip(raw1)))
                }
            } else {
                let packed = W::load_bytes(chunk(first + pair));
                (
                    (pair, W::low_nibbles(packed)),
                    (pair + 4, W::high_nibbles(packed)),
                )
            }
        }
    }

    /// Chunks before the quants in a `KIND` record: the scales, and `Q4_1`'s minimums.
    const fn first_quant_chunk(kind: u8) -> usize {
        if kind == Q4_1 { 2 } else { 1 }
    }

    /// The exact order: per block, each row's eight lane sums, each converted and
    /// fused-multiply-added with the scale `d_w · d_x` into its own lane accumulator (one
    /// vector per lane and token); `Q4_1`'s offsets `Σ m · s` in a separate accumulator.
    // Indexing by token and lane reads clearer than nested iterators here.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn body<W: Width, const KIND: u8, const N: usize, const FRESH: bool>(
        base: *const u8,
        record_chunks: usize,
        ahead: Prefetch,
        x: &[&[BlockQ8]],
        io: *mut f32,
    ) {
        // SAFETY: this function's contract: the CPU has `W`'s features; `base` holds the group's
        // records of `record_chunks` chunks for every block of `x`, `io` one f32 per row per token
        // (`N`), `ahead` lines that may be prefetched.
        unsafe {
            let mut acc = [[W::zero(); 8]; N];
            let mut offsets = [W::zero(); N];
            if !FRESH {
                for t in 0..N {
                    let state = io.add(t * 9 * GROUP_ROWS);
                    for k in 0..8 {
                        acc[t][k] = W::load(state.add(k * GROUP_ROWS));
                    }
                    offsets[t] = W::load(state.add(8 * GROUP_ROWS));
                }
            }
            // Weights stored with an offset: Q4_0's nibble is its level + 8; with VNNI,
            // Q8_0's byte (as unsigned) its level + 128.
            let offset_shift = match KIND {
                Q4_0 => Some(3),
                Q8_0 if W::VNNI => Some(7),
                _ => None,
            };
            let mut bias = [[0i32; 8]; N];
            let n_blocks = x[0].len();
            for i in 0..n_blocks {
                prefetch_block(ahead, i);
                let record = base.add(i * record_chunks * size_of::<Chunk>());
                let chunk = |c: usize| record.add(c * size_of::<Chunk>());
                let scales = W::load(chunk(0) as *const f32);
                let mut scale = [W::zero(); N];
                for t in 0..N {
                    let a = &x[t][i];
                    scale[t] = W::mul(scales, W::splat(a.d));
                    if let Some(shift) = offset_shift {
                        // −c · lane_sum for the eight lanes, read back one at a time.
                        let sums = _mm256_cvtepi16_epi32(_mm_loadu_si128(
                            a.lane_sums.as_ptr() as *const __m128i
                        ));
                        let scaled = if shift == 3 {
                            _mm256_slli_epi32::<3>(sums)
                        } else {
                            _mm256_slli_epi32::<7>(sums)
                        };
                        let negated = _mm256_sub_epi32(_mm256_setzero_si256(), scaled);
                        _mm256_storeu_si256(bias[t].as_mut_ptr() as *mut __m256i, negated);
                    }
                    if KIND == Q4_1 {
                        // The offsets `Σ m · s`: a separate accumulator, in block order.
                        let mins = W::load(chunk(1) as *const f32);
                        offsets[t] = W::fmadd(mins, W::splat(a.sum), offsets[t]);
                    }
                }
                for pair in 0..4 {
                    let ((k0, w0), (k1, w1)) = lane_pair::<W, KIND>(chunk, pair);
                    for t in 0..N {
                        let four = x[t][i].qs.as_ptr() as *const i32;
                        for (k, w) in [(k0, w0), (k1, w1)] {
                            let q = W::splat_i(std::ptr::read_unaligned(four.add(k)));
                            let start = offset_shift.map(|_| W::splat_i(bias[t][k]));
                            let sums = W::dot4(signed::<W, KIND>(), start, w, q);
                            acc[t][k] = W::fmadd(scale[t], W::convert(sums), acc[t][k]);
                        }
                    }
                }
            }
            for t in 0..N {
                if FRESH {
                    // `finish_group`'s (and `hsum8`'s) order, a vector of rows at once.
                    let a = &acc[t];
                    let lanes = W::add(
                        W::add(W::add(a[0], a[4]), W::add(a[2], a[6])),
                        W::add(W::add(a[1], a[5]), W::add(a[3], a[7])),
                    );
                    W::store(io.add(t * GROUP_ROWS), W::add(lanes, offsets[t]));
                } else {
                    let state = io.add(t * 9 * GROUP_ROWS);
                    for k in 0..8 {
                        W::store(state.add(k * GROUP_ROWS), acc[t][k]);
                    }
                    W::store(state.add(8 * GROUP_ROWS), offsets[t]);
                }
            }
        }
    }

    /// The [`Numerics::Fast`] order ([`crate::runtime::cpu::quant::dot_q8`]): per block and token,
    /// each row's whole integer sum (the eight lanes' products added in integers, from
    /// `−c · q_sum` for weights stored with an offset `c`), converted once and
    /// fused-multiply-added with the scale into one accumulator per token. A state keeps it
    /// in lane 0 (the other lanes stay zero), so finishing adds `+0.0` as `hsum8` would.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn body_fast<W: Width, const KIND: u8, const N: usize, const FRESH: bool>(
        base: *const u8,
        record_chunks: usize,
        ahead: Prefetch,
        x: &[&[BlockQ8]],
        io: *mut f32,
    ) {
        // SAFETY: as `body`'s: the CPU has `W`'s features; `base`, `io` and `ahead` as described
        // there.
        unsafe {
            let mut acc = [W::zero(); N];
            let mut offsets = [W::zero(); N];
            if !FRESH {
                for t in 0..N {
                    let state = io.add(t * 9 * GROUP_ROWS);
                    acc[t] = W::load(state);
                    offsets[t] = W::load(state.add(8 * GROUP_ROWS));
                }
            }
            let offset: i32 = match KIND {
                Q4_0 => 8,
                Q8_0 if W::VNNI => 128,
                _ => 0,
            };
            let n_blocks = x[0].len();
            for i in 0..n_blocks {
                prefetch_block(ahead, i);
                let record = base.add(i * record_chunks * size_of::<Chunk>());
                let chunk = |c: usize| record.add(c * size_of::<Chunk>());
                // Two integer sums per token (the pair's first and second lanes), so the
                // chains of dependent sums are half as long; added at the end.
                let mut sums: [[W::I; 2]; N] =
                    std::array::from_fn(|t| [W::splat_i(-offset * x[t][i].q_sum), W::splat_i(0)]);
                for pair in 0..4 {
                    let ((k0, w0), (k1, w1)) = lane_pair::<W, KIND>(chunk, pair);
                    for t in 0..N {
                        let four = x[t][i].qs.as_ptr() as *const i32;
                        for (j, (k, w)) in [(k0, w0), (k1, w1)].into_iter().enumerate() {
                            let q = W::splat_i(std::ptr::read_unaligned(four.add(k)));
                            sums[t][j] = W::dot4(signed::<W, KIND>(), Some(sums[t][j]), w, q);
                        }
                    }
                }
                let scales = W::load(chunk(0) as *const f32);
                for t in 0..N {
                    let a = &x[t][i];
                    let sum = W::add_i(sums[t][0], sums[t][1]);
                    let scale = W::mul(scales, W::splat(a.d));
                    acc[t] = W::fmadd(scale, W::convert(sum), acc[t]);
                    if KIND == Q4_1 {
                        let mins = W::load(chunk(1) as *const f32);
                        offsets[t] = W::fmadd(mins, W::splat(a.sum), offsets[t]);
                    }
                }
            }
            for t in 0..N {
                if FRESH {
                    let lanes = W::add(acc[t], W::zero());
                    W::store(io.add(t * GROUP_ROWS), W::add(lanes, offsets[t]));
                } else {
                    let state = io.add(t * 9 * GROUP_ROWS);
                    W::store(state, acc[t]);
                    W::store(state.add(8 * GROUP_ROWS), offsets[t]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::quant::tests::bytes;
    use crate::runtime::cpu::quant::{dot_q8, quantize_row_q8};

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

    /// Runs `packed` over every group for `tokens` from zero states: `vnni` picks a kernel
    /// (`None`: what `Packed` picks for this CPU), `fresh` the finishing kernels
    /// ([`Packed::product_group`]) over continuing ones plus [`finish_group`].
    fn products(
        packed: &Packed,
        tokens: &[Vec<BlockQ8>],
        vnni: Option<bool>,
        fresh: bool,
        numerics: Numerics,
    ) -> Vec<Vec<f32>> {
        let x: Vec<&[BlockQ8]> = tokens.iter().map(|t| &t[..]).collect();
        let mut out = vec![vec![0f32; packed.n_rows]; tokens.len()];
        for g in 0..packed.n_groups() {
            let mut states = vec![[[0f32; GROUP_ROWS]; 9]; tokens.len()];
            let mut sums = vec![[f32::NAN; GROUP_ROWS]; tokens.len()];
            let records = packed.records(g, &x);
            match (vnni, fresh) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the callers check AVX2 (and VNNI + VL for `Some(true)`); records
                // and tokens have `n_blocks` blocks each.
                (Some(vnni), _) => unsafe {
                    let io = if fresh {
                        avx2::Io::Fresh(&mut sums)
                    } else {
                        avx2::Io::Continue(&mut states)
                    };
                    let kernel = avx2::Kernel {
                        ty: packed.ty,
                        vnni,
                        numerics,
                    };
                    avx2::dispatch(
                        kernel,
                        records,
                        packed.record_chunks,
                        Prefetch::NONE,
                        &x,
                        io,
                    )
                },
                (_, true) => packed.product_group(g, &x, &mut sums, numerics, Some(g + 1)),
                _ => packed.continue_group(g, &x, &mut states, numerics),
            }
            if !fresh {
                for (sum, state) in sums.iter_mut().zip(&states) {
                    *sum = finish_group(state);
                }
            }
            for (t, sum) in sums.iter().enumerate() {
                for (r, value) in sum.iter().enumerate() {
                    if g * GROUP_ROWS + r < packed.n_rows {
                        out[t][g * GROUP_ROWS + r] = *value;
                    }
                }
            }
        }
        out
    }

    /// Every kernel variant (as many tokens per call as each takes: exact 1–2 with VNNI and
    /// 1 without, fast 1–4 and 1–2; `continue_group` and `product_group` splitting as this
    /// CPU needs; the portable path on unpacked rows), each continuing and finishing, in
    /// both rounding orders, gives each row exactly the bits of the one-row reference, for
    /// 29 rows (a padded last group) of each type.
    #[test]
    fn packed_kernels_equal_the_one_row_reference_bit_for_bit() {
        let n_blocks = 18;
        for (ty, numerics) in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0]
            .into_iter()
            .flat_map(|ty| [Numerics::Exact, Numerics::Fast].map(|n| (ty, n)))
        {
            let n_rows = GROUP_ROWS + 13;
            let rows = rows(ty, n_rows, n_blocks);
            let packed = Packed::new(ty, n_rows, n_blocks, |r| &rows[r]).expect("integer type");
            assert_eq!(packed.n_groups(), 2);
            for n_tokens in 1..=MAX_TOKENS {
                let tokens: Vec<Vec<BlockQ8>> =
                    (0..n_tokens).map(|t| token(n_blocks, t, 3.0)).collect();
                let mut variants = Vec::new();
                for fresh in [false, true] {
                    variants.push((
                        format!("dispatch {fresh}"),
                        products(&packed, &tokens, None, fresh, numerics),
                    ));
                    #[cfg(target_arch = "x86_64")]
                    if crate::runtime::cpu::simd::has_avx2() {
                        for vnni in [false, true] {
                            if vnni && !crate::runtime::cpu::simd::has_vnni() {
                                continue;
                            }
                            let per_call = tokens_per_call(vnni, numerics);
                            let out = tokens
                                .chunks(per_call)
                                .flat_map(|some| {
                                    products(&packed, some, Some(vnni), fresh, numerics)
                                })
                                .collect();
                            variants.push((format!("vnni {vnni} {fresh}"), out));
                        }
                    }
                }
                for (name, out) in &variants {
                    for (t, per_row) in out.iter().enumerate() {
                        for (r, value) in per_row.iter().enumerate() {
                            let reference = dot_q8(ty, &rows[r], &tokens[t], numerics);
                            assert_eq!(
                                value.to_bits(),
                                reference.to_bits(),
                                "{ty:?} {numerics:?} {name}: {n_tokens} tokens, token {t}, row {r}"
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

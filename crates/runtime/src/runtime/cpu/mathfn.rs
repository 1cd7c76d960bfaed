//! Elementwise math with the rounding behaviour of ggml's CPU backend, so logits track
//! llama.cpp's closely: the vectorised `expf` that ggml uses in SiLU (adapted there from
//! Arm's optimized-routines: maximum error 1.45 + 0.5 ulp), evaluated lane by lane with fused
//! multiply-adds (each SIMD lane computes exactly this scalar sequence), and the softmax of
//! attention scores.

/// Defines `fn $name` twice: once as written, and once compiled with AVX2, FMA and F16C
/// enabled, called when the CPU has them ([`crate::runtime::cpu::simd::has_avx2`]). Without the features,
/// `f32::mul_add` and `round_ties_even` are libm calls (`fmaf`, `rintf`) in the hot loops;
/// with them they are single instructions and the loops vectorise. Both versions give the
/// same bits: these operations are exactly rounded either way.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                fn fast($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                if $crate::runtime::cpu::simd::has_avx2() {
                    // SAFETY: the CPU has every feature `fast` was compiled for.
                    return unsafe { fast($($arg),*) };
                }
            }
            portable($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// `2^23 · 1.5`: adding it rounds a float to an integer held in the low mantissa bits.
const SHIFT: f32 = 12_582_912.0;
/// The constants, as exact f32 bit patterns (hex-float values in comments).
/// 1 / ln 2 (0x1.715476p+0).
const INV_LN2: f32 = f32::from_bits(0x3fb8aa3b);
/// ln 2 split in a high part (0x1.62e4p-1) and a low correction (0x1.7f7d1cp-20).
const LN2_HI: f32 = f32::from_bits(0x3f317200);
const LN2_LO: f32 = f32::from_bits(0x35bfbe8e);
/// Polynomial for `exp(b) − 1` on `|b| ≤ ln2/2`, highest degree first
/// (0x1.0e4020p-7, 0x1.573e2ep-5, 0x1.555e66p-3, 0x1.fffdb6p-2, 0x1.ffffecp-1).
const C5: f32 = f32::from_bits(0x3c072010);
const C4: f32 = f32::from_bits(0x3d2b9f17);
const C3: f32 = f32::from_bits(0x3e2aaf33);
const C2: f32 = f32::from_bits(0x3efffedb);
const C1: f32 = f32::from_bits(0x3f7ffff6);

/// e^x as ggml computes it on AVX2 (`ggml_v_expf`, see the module docs), lane by lane,
/// including its scaled path for results outside the normal range (`|n| > 126`), so
/// underflow to subnormals and 0 (masked attention scores at −∞) and overflow to ∞ happen
/// exactly where ggml's do.
#[inline(always)]
pub(crate) fn expf(x: f32) -> f32 {
    let z = x.mul_add(INV_LN2, SHIFT);
    let n = z - SHIFT;
    if n.abs() > 126.0 {
        return expf_scaled(x, z, n);
    }
    expf_in_range(x, z, n)
}

/// [`expf`]'s path for `|n| > 126`: `2^n` split in two factors `s1 · s2` that are each
/// representable, or `s1²` (0 or ∞) beyond `|n| > 192`.
#[cold]
fn expf_scaled(x: f32, z: f32, n: f32) -> f32 {
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let e = z.to_bits() << 23;
    let u = b * b;
    let j = C5
        .mul_add(b, C4)
        .mul_add(u, C3.mul_add(b, C2))
        .mul_add(u, C1 * b);
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// [`expf`] once `x` is known to be in range: `z = x/ln2 + SHIFT`, `n = z − SHIFT`.
#[inline(always)]
fn expf_in_range(x: f32, z: f32, n: f32) -> f32 {
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let k = f32::from_bits((z.to_bits() << 23).wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = C5
        .mul_add(b, C4)
        .mul_add(u, C3.mul_add(b, C2))
        .mul_add(u, C1 * b);
    j.mul_add(k, k)
}

/// `x · sigmoid(x)` as ggml's vectorised SiLU: `x / (1 + e^−x)`.
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + expf(-x))
}

/// [`expf`] of eight values with the same operations lane by lane and no branch, so it
/// compiles to vector instructions; `None` when a lane is outside the range where the
/// polynomial applies (the caller then takes [`expf`]'s scalar path).
///
/// Plain loops, not `std::array::from_fn`: its closures are separate functions that need
/// not inherit the caller's `fma` target feature, and when LLVM declines to inline them,
/// `mul_add` becomes a call to the software `fmaf` (measured: 12% of a batched step).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn expf8(x: [f32; 8]) -> Option<[f32; 8]> {
    let (mut z, mut n) = ([0f32; 8], [0f32; 8]);
    for i in 0..8 {
        z[i] = x[i].mul_add(INV_LN2, SHIFT);
        n[i] = z[i] - SHIFT;
    }
    if n.iter().fold(0f32, |m, v| m.max(v.abs())) > 126.0 {
        return None;
    }
    let mut e = [0f32; 8];
    for i in 0..8 {
        e[i] = expf_in_range(x[i], z[i], n[i]);
    }
    Some(e)
}

multiversion! {
    /// SwiGLU in place: `gate[i] = silu(gate[i]) · up[i]` (`gate`, `up`: same length),
    /// eight at a time through a branch-free [`expf`] (the same bits as [`silu`] value by value).
    pub(crate) fn swiglu(gate: &mut [f32], up: &[f32]) {
        let mut gates = gate.chunks_exact_mut(8);
        let mut ups = up.chunks_exact(8);
        for (g, u) in (&mut gates).zip(&mut ups) {
            let mut x = [0f32; 8];
            for (x, g) in x.iter_mut().zip(g.iter()) {
                *x = -g;
            }
            match expf8(x) {
                Some(e) => {
                    for i in 0..8 {
                        g[i] = g[i] / (1.0 + e[i]) * u[i];
                    }
                }
                None => {
                    for (g, u) in g.iter_mut().zip(u) {
                        *g = silu(*g) * u;
                    }
                }
            }
        }
        for (g, u) in gates.into_remainder().iter_mut().zip(ups.remainder()) {
            *g = silu(*g) * u;
        }
    }
}

multiversion! {
    /// Softmax of `scores` in place as llama.cpp's AVX2 build computes attention probabilities
    /// (`ggml_compute_forward_soft_max_f32` → `ggml_vec_soft_max_f32`): `expf(score − max)`
    /// with ggml's [`expf`], summed eight at a time in f32 (in `hsum8`'s order) and those sums
    /// accumulated in f64, then every value scaled by `(f32)(1 / sum)`. ggml's KV view is
    /// padded to a multiple of 32 cells with masked (−∞, so 0) scores, so its vector loop covers
    /// every score: a last partial group of eight here sums as if padded with zeros.
    pub(crate) fn softmax(scores: &mut [f32]) {
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut total = 0f64;
        for group in scores.chunks_mut(8) {
            let mut lanes = [0f32; 8];
            for (lane, v) in lanes.iter_mut().zip(group.iter_mut()) {
                *v = expf(*v - max);
                *lane = *v;
            }
            total += crate::runtime::cpu::simd::hsum8(&lanes) as f64;
        }
        let inverse = (1.0 / total) as f32;
        for v in scores.iter_mut() {
            *v *= inverse;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_within_two_ulp_of_libm() {
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            let (ours, libm) = (expf(x), x.exp());
            let ulps = (ours.to_bits() as i64 - libm.to_bits() as i64).abs();
            assert!(ulps <= 2, "x={x}: {ours} vs {libm} ({ulps} ulp)");
        }
        assert_eq!(expf(0.0), 1.0);
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn swiglu_equals_silu_value_by_value() {
        // Ordinary values, and a chunk with one value beyond the polynomial's range.
        let mut gate: Vec<f32> = (0..37).map(|i| (i as f32 * 0.61).sin() * 9.0).collect();
        gate[9] = 120.0;
        let up: Vec<f32> = (0..37).map(|i| (i as f32 * 0.23).cos()).collect();
        let expected: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        swiglu(&mut gate, &up);
        for (i, (a, b)) in gate.iter().zip(&expected).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{i}: {a} vs {b}");
        }
    }

    #[test]
    fn softmax_sums_to_one_and_handles_tails() {
        for n in [1, 7, 8, 13, 64] {
            let mut scores: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
            softmax(&mut scores);
            let total: f32 = scores.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "n={n}: {total}");
        }
    }
}

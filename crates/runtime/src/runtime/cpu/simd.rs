//! What the CPU offers the kernels, detected once (AVX2/FMA/F16C, AVX-512 VNNI; switched
//! off with `INFER_NO_SIMD` / `INFER_NO_VNNI`), and the lane sums every kernel shares. Below
//! both `quant` and `mathfn`, so neither depends on the other for them.

/// Whether the integer kernels may use AVX2/FMA/F16C on this CPU (detected once).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            std::env::var_os(crate::envvars::NO_SIMD).is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the integer kernels may use AVX-512 (F, BW, VL and VNNI: `vpdpbusd` on 512-bit
/// vectors, and the 32 vector registers for 256-bit ones); `INFER_NO_VNNI` turns it off.
pub(crate) fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            has_avx2()
                && std::env::var_os(crate::envvars::NO_VNNI).is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The horizontal sum of 8 lanes in the order of the AVX2 kernels (and of llamafile's
/// tinyBLAS): low half + high half, then lanes 0+2 and 1+3, then those two.
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    let half = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (half[0] + half[2]) + (half[1] + half[3])
}

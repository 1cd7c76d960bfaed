// Device helpers every kernel family shares, prepended to each family's source before it is
// compiled (NVRTC or the host harness): the kernels stay header-free (no cuda_fp16.h, which
// NVRTC from PyPI cannot find without the runtime wheel).

// IEEE 754 binary16 bits to float (exact): the GPU's conversion instruction under NVRTC,
// the same arithmetic in C++ on the host harness.
__device__ __forceinline__ float half_to_float(unsigned short h) {
#ifdef __CUDACC_RTC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int exponent = (h >> 10) & 0x1fu;
    const unsigned int mantissa = h & 0x3ffu;
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24.
        const float value = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    const unsigned int bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))
                                             : (sign | ((exponent + 112) << 23) | (mantissa << 13));
    return __int_as_float((int)bits);
#endif
}

// The little-endian half at p (GGML's block scales).
__device__ __forceinline__ float half_at(const unsigned char* p) {
    return half_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

// Four bytes as an int, from any alignment (GGML's blocks are 2-byte aligned).
__device__ __forceinline__ int load_int(const unsigned char* p) {
    return (int)(p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned int)p[3] << 24));
}

// Float to IEEE 754 binary16 bits, rounding to nearest, ties to even (as `__float2half_rn`
// and the CPU backend's `half::f16::from_f32`): overflow to infinity, subnormals kept.
__device__ __forceinline__ unsigned short float_to_half(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // infinity or NaN (kept quiet)
        return (unsigned short)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477ff000u) {  // 65520 and up round to infinity
        return (unsigned short)(sign | 0x7c00u);
    }
    unsigned int h;
    unsigned int rest;
    unsigned int halfway;
    if (abs < 0x38800000u) {  // below 2^-14: a subnormal half, mantissa * 2^-24
        const unsigned int e = abs >> 23;
        if (e < 102) {
            return (unsigned short)sign;
        }
        const unsigned int m = (abs & 0x7fffffu) | 0x800000u;
        const unsigned int shift = 126 - e;
        h = m >> shift;
        rest = m & ((1u << shift) - 1u);
        halfway = 1u << (shift - 1u);
    } else {  // normal: rebias the exponent (127 - 15), keep 10 mantissa bits
        h = (abs - 0x38000000u) >> 13;
        rest = abs & 0x1fffu;
        halfway = 0x1000u;
    }
    if (rest > halfway || (rest == halfway && (h & 1u))) {
        h++;
    }
    return (unsigned short)(sign | h);
}

// Sum and maximum over the 32 lanes of a warp by butterfly shuffles: every lane gets the
// result. Every lane of the warp must call them.
__device__ __forceinline__ float warp_reduce_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ int warp_reduce_sum_int(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// 16- and 8-byte vectors for wide loads: a pointer cast to one must be aligned to its size
// (every buffer starts 256-byte aligned, and the kernels' offsets are multiples of it).
struct alignas(16) u32x4 {
    unsigned int x, y, z, w;
};
struct alignas(16) f32x4 {
    float x, y, z, w;
};
struct alignas(8) f32x2 {
    float x, y;
};

// Rotary position embedding of one pair (Su et al. 2021): (a, b) rotated by `angle` radians.
// Shared by rope.cu and the fused rope_store_kv_f16 (attention.cu), so both round alike.
__device__ __forceinline__ void rotate(float* a, float* b, float angle) {
    float s, c;
    sincosf(angle, &s, &c);
    const float x0 = *a;
    const float x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x0 * s + x1 * c;
}

// The dimensions of a head that pair i (of head_dim / 2) rotates: (2i, 2i + 1), GGML's
// normal mode (Llama), or (i, i + head_dim / 2), NeoX (GPT-NeoX, Qwen).
struct rope_pair {
    unsigned int a;
    unsigned int b;
};
__device__ __forceinline__ rope_pair rope_pair_of(unsigned int i, unsigned int head_dim,
                                                  bool neox) {
    rope_pair at;
    at.a = neox ? i : 2 * i;
    at.b = neox ? i + head_dim / 2 : 2 * i + 1;
    return at;
}

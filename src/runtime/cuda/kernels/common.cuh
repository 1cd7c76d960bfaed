// Device helpers every kernel family shares, prepended to each family's source before it is
// compiled (NVRTC or the host harness): the kernels stay header-free (no cuda_fp16.h, which
// NVRTC from PyPI cannot find without the runtime wheel).

// IEEE 754 binary16 bits to float.
__device__ __forceinline__ float half_to_float(unsigned short h) {
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
}

// The little-endian half at p (GGML's block scales).
__device__ __forceinline__ float half_at(const unsigned char* p) {
    return half_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

// Four bytes as an int, from any alignment (GGML's blocks are 2-byte aligned).
__device__ __forceinline__ int load_int(const unsigned char* p) {
    return (int)(p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned int)p[3] << 24));
}

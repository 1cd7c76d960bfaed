// Conversions for the GEMM path of prefill and large batches (as llama.cpp's CUDA backend
// hands batches above its matrix-vector limit to cuBLAS): quantized weights are expanded to
// f16 rows, and f32 activations are rounded to the GEMM's input type, before one GEMM with
// f32 accumulation (cuBLAS `cublasGemmEx` on a GPU).
//
// dequantize_<type>_f16: out[r, c] = value c of weight row r (n_cols values) as IEEE half
//   bits, from the matrix as the backend holds it: Q4_0, Q4_1 and Q8_0 split (every block's
//   quants, then every block's scales: `matvec.cu`), Q4_K and Q6_K in GGML's rows.
//   out: [n_rows, n_cols] u16. Launch: grid (n_rows, ceil(n_cols / 256)), block (256).
// convert_f32_{f16,bf16}: out[i] = x[i] rounded to nearest even. out: [n] u16.
//   Launch: grid (ceil(n / 256)), block (256).
// GGML's block layouts (ggml-common.h; dequantize_row_* in ggml-quants.c give the value
// order): Q4_0 {half d; u8 qs[16]}: values 0-15 the low nibbles, 16-31 the high, d (q - 8);
// Q4_1 {half d, m; u8 qs[16]}: d q + m; Q8_0 {half d; i8 qs[32]}: d q; Q4_K per 256
// {half d, dmin; u8 scales[12]; u8 qs[128]}: sub-block j of 32 is the low (even j) or high
// (odd j) nibbles of qs[32 (j / 2) ..], d sc_j q - dmin m_j; Q6_K per 256 {u8 ql[128],
// qh[64]; i8 scales[16]; half d}: d sc (q - 32), a scale per 16.

// Value c of row `row` of a split matrix of n_rows rows and n_cols values: `qbytes` of quants
// per block of 32, then the scales.
__device__ __forceinline__ float value_q4_0(const unsigned char* w, unsigned int n_rows,
                                            unsigned int n_cols, unsigned int row,
                                            unsigned int c) {
    const unsigned long long n_blocks = n_cols / 32;
    const unsigned long long block = row * n_blocks + c / 32;
    const unsigned char* qs = w + block * 16;
    const unsigned int i = c % 32;
    const int q = i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4);
    return half_at(w + n_rows * n_blocks * 16 + block * 2) * (float)(q - 8);
}

__device__ __forceinline__ float value_q4_1(const unsigned char* w, unsigned int n_rows,
                                            unsigned int n_cols, unsigned int row,
                                            unsigned int c) {
    const unsigned long long n_blocks = n_cols / 32;
    const unsigned long long block = row * n_blocks + c / 32;
    const unsigned char* qs = w + block * 16;
    const unsigned int i = c % 32;
    const int q = i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4);
    const unsigned char* dm = w + n_rows * n_blocks * 16 + block * 4;
    return half_at(dm) * (float)q + half_at(dm + 2);
}

__device__ __forceinline__ float value_q8_0(const unsigned char* w, unsigned int n_rows,
                                            unsigned int n_cols, unsigned int row,
                                            unsigned int c) {
    const unsigned long long n_blocks = n_cols / 32;
    const unsigned long long block = row * n_blocks + c / 32;
    const float d = half_at(w + n_rows * n_blocks * 32 + block * 2);
    return d * (float)(signed char)w[block * 32 + c % 32];
}

__device__ __forceinline__ float value_q4_k_row(const unsigned char* row, unsigned int c) {
    const unsigned char* w = row + (c / 256) * 144;
    const unsigned int i = c % 256;
    const int j = (int)(i / 32);
    const unsigned char* scales = w + 4;
    int sc, m;
    if (j < 4) {
        sc = scales[j] & 63;
        m = scales[j + 4] & 63;
    } else {
        sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
    const int q = (w[16 + 32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 0x0f;
    return half_at(w) * (float)sc * (float)q - half_at(w + 2) * (float)m;
}

__device__ __forceinline__ float value_q6_k_row(const unsigned char* row, unsigned int c) {
    const unsigned char* w = row + (c / 256) * 210;
    const unsigned int i = c % 256;
    const unsigned int half_block = i / 128;  // which 128 values
    const unsigned int quarter = (i % 128) / 32;  // values l, l + 32, l + 64, l + 96
    const unsigned int l = i % 32;
    const unsigned char ql = w[64 * half_block + 32 * (quarter % 2) + l];
    const unsigned char qh = w[128 + 32 * half_block + l];
    const int q = (((ql >> (4 * (quarter / 2))) & 0x0f) | (((qh >> (2 * quarter)) & 3) << 4)) - 32;
    const signed char scale = (signed char)w[192 + 8 * half_block + l / 16 + 2 * quarter];
    return half_at(w + 208) * (float)scale * (float)q;
}

// GGML's super-blocks, row `row` of n_cols values.
__device__ __forceinline__ float value_q4_k(const unsigned char* w, unsigned int n_rows,
                                            unsigned int n_cols, unsigned int row,
                                            unsigned int c) {
    return value_q4_k_row(w + (unsigned long long)row * (n_cols / 256) * 144, c);
}

__device__ __forceinline__ float value_q6_k(const unsigned char* w, unsigned int n_rows,
                                            unsigned int n_cols, unsigned int row,
                                            unsigned int c) {
    return value_q6_k_row(w + (unsigned long long)row * (n_cols / 256) * 210, c);
}

#define DEQUANTIZE_F16(NAME, VALUE)                                                             \
    extern "C" __global__ void NAME(unsigned short* __restrict__ out,                           \
                                    const unsigned char* __restrict__ w, unsigned int n_rows,   \
                                    unsigned int n_cols) {                                      \
        const unsigned int c = blockIdx.y * blockDim.x + threadIdx.x;                           \
        if (c < n_cols) {                                                                       \
            out[(unsigned long long)blockIdx.x * n_cols + c] =                                  \
                float_to_half(VALUE(w, n_rows, n_cols, blockIdx.x, c));                         \
        }                                                                                       \
    }

DEQUANTIZE_F16(dequantize_q4_0_f16, value_q4_0)
DEQUANTIZE_F16(dequantize_q4_1_f16, value_q4_1)
DEQUANTIZE_F16(dequantize_q8_0_f16, value_q8_0)
DEQUANTIZE_F16(dequantize_q4_k_f16, value_q4_k)
DEQUANTIZE_F16(dequantize_q6_k_f16, value_q6_k)

extern "C" __global__ void convert_f32_f16(unsigned short* __restrict__ out,
                                           const float* __restrict__ x, unsigned int n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = float_to_half(x[i]);
    }
}

// Float to bfloat16 bits, rounding to nearest, ties to even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    const unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u);
    }
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

extern "C" __global__ void convert_f32_bf16(unsigned short* __restrict__ out,
                                            const float* __restrict__ x, unsigned int n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = float_to_bf16(x[i]);
    }
}

// Quantized matrix-vector products for small batches, as llama.cpp's MMVQ: activations are
// quantized to Q8_1 blocks (32 int8 values q, a float scale d and s = d * sum(q)), then each
// weight block's integer dot product runs four int8 pairs at a time with __dp4a.
//
// quantize_q8_1: x [n_values] f32 (n_values a multiple of 32) -> xq [n_values / 32] blocks
//   of { float d; float s; signed char q[32]; } (40 bytes). Launch: grid (n_values / 32),
//   block (32).
// mul_mat_vec_<type>_q8_1: y[t, r] = row r of w (row_bytes bytes, GGML's <type> blocks) ·
//   activation row t (n_cols values, quantized: xq holds n_cols / 32 blocks per row). One
//   thread per 32 weights at a time; the block's partial sums meet by warp shuffles, then
//   through shared memory. y: [n_tokens, n_rows] f32. Launch: grid (n_rows, n_tokens),
//   block (128).
// mul_mat_vec_{f32,f16,bf16}: the same product for unquantized weights (rows of n_cols
//   values) and f32 activations x: [n_tokens, n_cols]. Launch: grid (n_rows, n_tokens),
//   block (128).
// GGML's block layouts (ggml-common.h): Q4_0 {half d; u8 qs[16]} (value = d (q - 8)); Q4_1
// {half d, m; u8 qs[16]} (d q + m); Q8_0 {half d; i8 qs[32]}; Q4_K per 256 {half d, dmin;
// u8 scales[12]; u8 qs[128]} (d sc_j q - dmin m_j, 6-bit sc/m per 32); Q6_K per 256
// {u8 ql[128], qh[64]; i8 scales[16]; half d} (d sc_i (q - 32), a scale per 16).

#define MMV_THREADS 128

struct block_q8_1 {
    float d;
    float s;
    signed char q[32];
};

__device__ __forceinline__ int x_int(const block_q8_1* x, int i) {
    return *(const int*)(x->q + 4 * i);
}

// Each returns the dot product of 32 weights (block b of the row) with x's block.

__device__ __forceinline__ float dot_q8_0(const unsigned char* row, unsigned int b,
                                          const block_q8_1* x) {
    const unsigned char* w = row + b * 34;
    int sum = 0;
    for (int i = 0; i < 8; i++) {
        sum = __dp4a(load_int(w + 2 + 4 * i), x_int(x, i), sum);
    }
    return half_at(w) * x->d * (float)sum;
}

__device__ __forceinline__ int dot_nibbles(const unsigned char* qs, const block_q8_1* x) {
    int sum = 0;
    for (int i = 0; i < 4; i++) {
        const int v = load_int(qs + 4 * i);
        sum = __dp4a(v & 0x0f0f0f0f, x_int(x, i), sum);
        sum = __dp4a((v >> 4) & 0x0f0f0f0f, x_int(x, 4 + i), sum);
    }
    return sum;
}

__device__ __forceinline__ float dot_q4_0(const unsigned char* row, unsigned int b,
                                          const block_q8_1* x) {
    const unsigned char* w = row + b * 18;
    // sum d_w (q - 8) d_x q_x = d_w (d_x sum(q q_x) - 8 s_x)
    return half_at(w) * (x->d * (float)dot_nibbles(w + 2, x) - 8.0f * x->s);
}

__device__ __forceinline__ float dot_q4_1(const unsigned char* row, unsigned int b,
                                          const block_q8_1* x) {
    const unsigned char* w = row + b * 20;
    return half_at(w) * x->d * (float)dot_nibbles(w + 4, x) + half_at(w + 2) * x->s;
}

__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ __forceinline__ float dot_q4_k(const unsigned char* row, unsigned int b,
                                          const block_q8_1* x) {
    const unsigned char* w = row + (b / 8) * 144;
    const int j = b % 8;
    int sc, m;
    scale_min_k4(j, w + 4, &sc, &m);
    // Sub-block j: the low (even j) or high (odd j) nibbles of qs[32 (j / 2) .. + 32].
    const unsigned char* qs = w + 16 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    int sum = 0;
    for (int i = 0; i < 8; i++) {
        sum = __dp4a((load_int(qs + 4 * i) >> shift) & 0x0f0f0f0f, x_int(x, i), sum);
    }
    return half_at(w) * (float)sc * x->d * (float)sum - half_at(w + 2) * (float)m * x->s;
}

__device__ __forceinline__ float dot_q6_k(const unsigned char* row, unsigned int b,
                                          const block_q8_1* x) {
    const unsigned char* w = row + (b / 8) * 210;
    const int j = b % 8;
    const int half_block = j / 4;
    const int quarter = j % 4;  // values l, l + 32, l + 64, l + 96 of the 128-value half
    const unsigned char* ql = w + 64 * half_block + 32 * (quarter % 2);
    const unsigned char* qh = w + 128 + 32 * half_block;
    const signed char* scales = (const signed char*)(w + 192 + 8 * half_block);
    const int low_shift = 4 * (quarter / 2);
    const int high_shift = 2 * quarter;
    int sums[2] = {0, 0};
    for (int i = 0; i < 8; i++) {
        int packed = 0;
        for (int k = 0; k < 4; k++) {
            const int l = 4 * i + k;
            const int q = (((ql[l] >> low_shift) & 0x0f) | (((qh[l] >> high_shift) & 3) << 4)) - 32;
            packed |= (q & 0xff) << (8 * k);
        }
        sums[i / 4] = __dp4a(packed, x_int(x, i), sums[i / 4]);
    }
    const int is = 2 * quarter;
    return half_at(w + 208) * x->d *
           ((float)scales[is] * (float)sums[0] + (float)scales[is + 1] * (float)sums[1]);
}

extern "C" __global__ void quantize_q8_1(block_q8_1* __restrict__ xq, const float* __restrict__ x,
                                         unsigned int n_values) {
    const unsigned long long i = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    const float v = i < n_values ? x[i] : 0.0f;
    const float d = warp_reduce_max(fabsf(v)) / 127.0f;
    const int q = d == 0.0f ? 0 : __float2int_rn(v / d);
    xq[blockIdx.x].q[threadIdx.x] = (signed char)q;
    const int sum = warp_reduce_sum_int(q);
    if (threadIdx.x == 0) {
        xq[blockIdx.x].d = d;
        xq[blockIdx.x].s = d * (float)sum;
    }
}

// The block's sum of every thread's `acc` (four warps), written by thread 0 to `out`.
__device__ __forceinline__ void block_sum_to(float acc, float* out) {
    __shared__ float warp_sums[MMV_THREADS / 32];
    acc = warp_reduce_sum(acc);
    if (threadIdx.x % 32 == 0) {
        warp_sums[threadIdx.x / 32] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < MMV_THREADS / 32; w++) {
            total += warp_sums[w];
        }
        *out = total;
    }
}

#define MUL_MAT_VEC(NAME, DOT)                                                                  \
    extern "C" __global__ void NAME(float* __restrict__ y, const unsigned char* __restrict__ w, \
                                    const block_q8_1* __restrict__ xq, unsigned int n_cols,     \
                                    unsigned int row_bytes) {                                   \
        const unsigned char* row = w + (unsigned long long)blockIdx.x * row_bytes;              \
        const block_q8_1* xt = xq + (unsigned long long)blockIdx.y * (n_cols / 32);             \
        float acc = 0.0f;                                                                       \
        for (unsigned int b = threadIdx.x; b < n_cols / 32; b += MMV_THREADS) {                 \
            acc += DOT(row, b, &xt[b]);                                                         \
        }                                                                                       \
        block_sum_to(acc, &y[(unsigned long long)blockIdx.y * gridDim.x + blockIdx.x]);         \
    }

MUL_MAT_VEC(mul_mat_vec_q4_0_q8_1, dot_q4_0)
MUL_MAT_VEC(mul_mat_vec_q4_1_q8_1, dot_q4_1)
MUL_MAT_VEC(mul_mat_vec_q8_0_q8_1, dot_q8_0)
MUL_MAT_VEC(mul_mat_vec_q4_k_q8_1, dot_q4_k)
MUL_MAT_VEC(mul_mat_vec_q6_k_q8_1, dot_q6_k)

__device__ __forceinline__ float load_f32(const float* w, unsigned long long i) { return w[i]; }
__device__ __forceinline__ float load_f16(const unsigned short* w, unsigned long long i) {
    return half_to_float(w[i]);
}
__device__ __forceinline__ float load_bf16(const unsigned short* w, unsigned long long i) {
    return __uint_as_float((unsigned int)w[i] << 16);
}

#define MUL_MAT_VEC_FLOAT(NAME, TYPE, LOAD)                                                     \
    extern "C" __global__ void NAME(float* __restrict__ y, const TYPE* __restrict__ w,         \
                                    const float* __restrict__ x, unsigned int n_cols) {         \
        const unsigned long long row = (unsigned long long)blockIdx.x * n_cols;                 \
        const float* xt = x + (unsigned long long)blockIdx.y * n_cols;                          \
        float acc = 0.0f;                                                                       \
        for (unsigned int c = threadIdx.x; c < n_cols; c += MMV_THREADS) {                      \
            acc += LOAD(w, row + c) * xt[c];                                                    \
        }                                                                                       \
        block_sum_to(acc, &y[(unsigned long long)blockIdx.y * gridDim.x + blockIdx.x]);         \
    }

MUL_MAT_VEC_FLOAT(mul_mat_vec_f32, float, load_f32)
MUL_MAT_VEC_FLOAT(mul_mat_vec_f16, unsigned short, load_f16)
MUL_MAT_VEC_FLOAT(mul_mat_vec_bf16, unsigned short, load_bf16)

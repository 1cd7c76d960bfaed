// Matrix-vector products for small batches (decode), as llama.cpp's MMVQ in what they compute:
// activations are quantized to Q8_1 (32 int8 values q, a float scale d and s = d * sum(q)),
// then each weight block's integer dot product runs four int8 pairs at a time with __dp4a;
// unquantized weights multiply f32 activations directly.
//
// Layouts. Q4_0, Q4_1 and Q8_0 matrices are held split (the backend reorders GGML's blocks
// when it uploads them, `split_blocks` in backend.rs): every block's quants first, [n_rows,
// n_blocks] of 16 bytes (Q4_0, Q4_1) or 32 (Q8_0), then every block's scales, [n_rows,
// n_blocks] of one half d (Q4_0, Q8_0) or two halves d, m (Q4_1). A warp's loads are then
// 16-byte vectors of consecutive blocks, where GGML's 18- and 34-byte blocks would need byte
// loads. Q4_K and Q6_K keep GGML's layout. Q8_1 activations are split the same way: for n
// blocks, q [n, 32] int8 then (d, s) [n, 2] f32.
//
// quantize_q8_1: x [n_values] f32 (n_values a multiple of 32) -> xq (n_values / 32 blocks,
//   split). Launch: grid (n_values / 32), block (32).
// mul_mat_vec_<type>, mul_mat_vec_<type>_x8: up to three products of one activation matrix
//   x [n_tokens, n_cols] (Q8_1 for the quantized types, f32 for f32/f16/bf16 weights, whose
//   n_cols must be a multiple of 8) with matrices w0, w1, w2 ([n_rows_m, n_cols]; n_rows_m =
//   0: none), by mode:
//     0 (store):  y_m[t, r] = w_m[r, :] · x[t, :] for each matrix m;
//     1 (add):    y_m[t, r] += w_m[r, :] · x[t, :] (a residual connection);
//     2 (swiglu): y0[t, r] = silu(w0[r, :] · x[t, :]) · (w1[r, :] · x[t, :]), w0 the gate
//                 and w1 the up projection, n_rows_1 = n_rows_0, w2 unused.
//   y_m: [n_tokens, n_rows_m] f32. A block computes a tile of R rows (in swiglu mode half of
//   them from each matrix), each thread taking every MMV_THREADS-th block (or 8 values) of
//   the rows: <type> for one token (R = MMV_ROWS), <type>_x8 for MMV_TOKENS tokens (R =
//   MMV_ROWS_X8), so that each weight is read once per 8 tokens. Launch: grid (tiles ×
//   token groups), tiles = sum over m of ceil(n_rows_m / R), or ceil(n_rows_0 / (R / 2)) in
//   swiglu mode, token groups = n_tokens (<type>) or ceil(n_tokens / MMV_TOKENS) (_x8),
//   block (MMV_THREADS).
// GGML's block layouts (ggml-common.h): Q4_0 {half d; u8 qs[16]} (value = d (q - 8), values
// 0-15 in the low nibbles, 16-31 in the high); Q4_1 {half d, m; u8 qs[16]} (d q + m); Q8_0
// {half d; i8 qs[32]}; Q4_K per 256 {half d, dmin; u8 scales[12]; u8 qs[128]} (d sc_j q -
// dmin m_j, 6-bit sc/m per 32); Q6_K per 256 {u8 ql[128], qh[64]; i8 scales[16]; half d}
// (d sc_i (q - 32), a scale per 16).

#define MMV_THREADS 128
#define MMV_ROWS 4
#define MMV_ROWS_X8 2
#define MMV_TOKENS 8

#define MMV_STORE 0u
#define MMV_ADD 1u
#define MMV_SWIGLU 2u

// One token's Q8_1 block of 32 activations.
struct x_q8_1 {
    int q[8];
    float d;
    float s;
};

// Block `index` of `n_blocks` split Q8_1 blocks at xq.
__device__ __forceinline__ x_q8_1 load_q8_1(const unsigned char* __restrict__ xq,
                                            unsigned long long n_blocks,
                                            unsigned long long index) {
    const u32x4* q = (const u32x4*)(xq + index * 32);
    const u32x4 a = q[0];
    const u32x4 b = q[1];
    const f32x2 ds = ((const f32x2*)(xq + n_blocks * 32))[index];
    x_q8_1 x;
    x.q[0] = (int)a.x;
    x.q[1] = (int)a.y;
    x.q[2] = (int)a.z;
    x.q[3] = (int)a.w;
    x.q[4] = (int)b.x;
    x.q[5] = (int)b.y;
    x.q[6] = (int)b.z;
    x.q[7] = (int)b.w;
    x.d = ds.x;
    x.s = ds.y;
    return x;
}

// The integer dot product of 16 bytes of nibbles (values j in the low nibble of byte j, 16 + j
// in the high) with x's 32 values.
__device__ __forceinline__ int dot_nibbles(u32x4 v, const x_q8_1& x) {
    int sum = 0;
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        sum = __dp4a((int)(w[i] & 0x0f0f0f0fu), x.q[i], sum);
        sum = __dp4a((int)((w[i] >> 4) & 0x0f0f0f0fu), x.q[4 + i], sum);
    }
    return sum;
}

// The activations the weight types below read: split Q8_1 blocks (quantized weights) or f32
// in units of 8 (unquantized ones).
struct q8_1_activations {
    typedef x_q8_1 x_unit;
    static __device__ __forceinline__ x_unit load_x(const unsigned char* __restrict__ x,
                                                    unsigned long long n_x_units,
                                                    unsigned long long index) {
        return load_q8_1(x, n_x_units, index);
    }
};

// Weight types: a `block` of W::COLS weights of one row, loaded by `load(w, n_rows, n_units,
// row, unit)` (n_units: blocks per row), and its dot product with the activations' `x`
// unit for the same columns (`load_x(x, n_x_units, index)`, index = token * n_units + unit,
// n_x_units = n_tokens * n_units).

struct w_q4_0 : q8_1_activations {
    static constexpr unsigned int COLS = 32;
    struct block {
        u32x4 q;
        float d;
    };
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        const unsigned long long i = (unsigned long long)row * n_units + unit;
        const unsigned long long n = (unsigned long long)n_rows * n_units;
        block k;
        k.q = ((const u32x4*)w)[i];
        k.d = half_to_float(((const unsigned short*)(w + n * 16))[i]);
        return k;
    }
    // sum d_w (q - 8) d_x q_x = d_w (d_x sum(q q_x) - 8 s_x)
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        return k.d * (x.d * (float)dot_nibbles(k.q, x) - 8.0f * x.s);
    }
};

struct w_q4_1 : q8_1_activations {
    static constexpr unsigned int COLS = 32;
    struct block {
        u32x4 q;
        float d;
        float m;
    };
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        const unsigned long long i = (unsigned long long)row * n_units + unit;
        const unsigned long long n = (unsigned long long)n_rows * n_units;
        block k;
        k.q = ((const u32x4*)w)[i];
        const unsigned int dm = ((const unsigned int*)(w + n * 16))[i];
        k.d = half_to_float((unsigned short)(dm & 0xffffu));
        k.m = half_to_float((unsigned short)(dm >> 16));
        return k;
    }
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        return k.d * x.d * (float)dot_nibbles(k.q, x) + k.m * x.s;
    }
};

struct w_q8_0 : q8_1_activations {
    static constexpr unsigned int COLS = 32;
    struct block {
        u32x4 a;
        u32x4 b;
        float d;
    };
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        const unsigned long long i = (unsigned long long)row * n_units + unit;
        const unsigned long long n = (unsigned long long)n_rows * n_units;
        block k;
        k.a = ((const u32x4*)w)[2 * i];
        k.b = ((const u32x4*)w)[2 * i + 1];
        k.d = half_to_float(((const unsigned short*)(w + n * 32))[i]);
        return k;
    }
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        int sum = __dp4a((int)k.a.x, x.q[0], 0);
        sum = __dp4a((int)k.a.y, x.q[1], sum);
        sum = __dp4a((int)k.a.z, x.q[2], sum);
        sum = __dp4a((int)k.a.w, x.q[3], sum);
        sum = __dp4a((int)k.b.x, x.q[4], sum);
        sum = __dp4a((int)k.b.y, x.q[5], sum);
        sum = __dp4a((int)k.b.z, x.q[6], sum);
        sum = __dp4a((int)k.b.w, x.q[7], sum);
        return k.d * x.d * (float)sum;
    }
};

__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K and Q6_K keep GGML's super-blocks: a `block` is the row and the 32-value sub-block,
// read where the dot product needs them.
struct k_block {
    const unsigned char* row;
    unsigned int b;
};

// Rows of super-blocks of 256 values, SUPER_BYTES each.
template <unsigned int SUPER_BYTES>
struct k_weights : q8_1_activations {
    static constexpr unsigned int COLS = 32;
    typedef k_block block;
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        block k;
        k.row = w + (unsigned long long)row * (n_units / 8) * SUPER_BYTES;
        k.b = unit;
        return k;
    }
};

struct w_q4_k : k_weights<144> {
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        const unsigned char* w = k.row + (k.b / 8) * 144;
        const int j = k.b % 8;
        int sc, m;
        scale_min_k4(j, w + 4, &sc, &m);
        // Sub-block j: the low (even j) or high (odd j) nibbles of qs[32 (j / 2) .. + 32].
        const unsigned char* qs = w + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        int sum = 0;
        for (int i = 0; i < 8; i++) {
            sum = __dp4a((load_int(qs + 4 * i) >> shift) & 0x0f0f0f0f, x.q[i], sum);
        }
        return half_at(w) * (float)sc * x.d * (float)sum - half_at(w + 2) * (float)m * x.s;
    }
};

struct w_q6_k : k_weights<210> {
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        const unsigned char* w = k.row + (k.b / 8) * 210;
        const int j = k.b % 8;
        const int half_block = j / 4;
        const int quarter = j % 4;  // values l, l + 32, l + 64, l + 96 of the 128-value half
        const unsigned char* ql = w + 64 * half_block + 32 * (quarter % 2);
        const unsigned char* qh = w + 128 + 32 * half_block;
        const signed char* scales = (const signed char*)(w + 192 + 8 * half_block);
        const int low_shift = 4 * (quarter / 2);
        const int high_shift = 2 * quarter;
        // Values 0-15 have one scale, 16-31 the next.
        int low = 0;
        int high = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int packed = 0;
#pragma unroll
            for (int k2 = 0; k2 < 4; k2++) {
                const int l = 4 * i + k2;
                const int q =
                    (((ql[l] >> low_shift) & 0x0f) | (((qh[l] >> high_shift) & 3) << 4)) - 32;
                packed |= (q & 0xff) << (8 * k2);
            }
            if (i < 4) {
                low = __dp4a(packed, x.q[i], low);
            } else {
                high = __dp4a(packed, x.q[i], high);
            }
        }
        const int is = 2 * quarter;
        return half_at(w + 208) * x.d *
               ((float)scales[is] * (float)low + (float)scales[is + 1] * (float)high);
    }
};

// Unquantized weights: units of 8 columns, f32 activations.
struct x_f32x8 {
    float v[8];
};

__device__ __forceinline__ x_f32x8 load_f32x8(const unsigned char* __restrict__ x,
                                              unsigned long long index) {
    const f32x4* p = (const f32x4*)x + 2 * index;
    const f32x4 a = p[0];
    const f32x4 b = p[1];
    x_f32x8 u;
    u.v[0] = a.x;
    u.v[1] = a.y;
    u.v[2] = a.z;
    u.v[3] = a.w;
    u.v[4] = b.x;
    u.v[5] = b.y;
    u.v[6] = b.z;
    u.v[7] = b.w;
    return u;
}

struct f32_activations {
    typedef x_f32x8 x_unit;
    static __device__ __forceinline__ x_unit load_x(const unsigned char* __restrict__ x,
                                                    unsigned long long n_x_units,
                                                    unsigned long long index) {
        return load_f32x8(x, index);
    }
};

// 8 halves (f16 or bf16) of a row.
struct half8_block {
    u32x4 h;
};

__device__ __forceinline__ half8_block load_half8(const unsigned char* __restrict__ w,
                                                  unsigned int n_units, unsigned int row,
                                                  unsigned int unit) {
    half8_block k;
    k.h = ((const u32x4*)w)[(unsigned long long)row * n_units + unit];
    return k;
}

// F16 and BF16 rows: 8 halves a unit.
struct half8_weights : f32_activations {
    static constexpr unsigned int COLS = 8;
    typedef half8_block block;
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        return load_half8(w, n_units, row, unit);
    }
};

struct w_bf16 : half8_weights {
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        const unsigned int h[4] = {k.h.x, k.h.y, k.h.z, k.h.w};
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sum += __uint_as_float(h[i] << 16) * x.v[2 * i];
            sum += __uint_as_float(h[i] & 0xffff0000u) * x.v[2 * i + 1];
        }
        return sum;
    }
};

struct w_f16 : half8_weights {
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        const unsigned int h[4] = {k.h.x, k.h.y, k.h.z, k.h.w};
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sum += half_to_float((unsigned short)(h[i] & 0xffffu)) * x.v[2 * i];
            sum += half_to_float((unsigned short)(h[i] >> 16)) * x.v[2 * i + 1];
        }
        return sum;
    }
};

struct w_f32 : f32_activations {
    static constexpr unsigned int COLS = 8;
    typedef x_f32x8 block;
    static __device__ __forceinline__ block load(const unsigned char* __restrict__ w,
                                                 unsigned int n_rows, unsigned int n_units,
                                                 unsigned int row, unsigned int unit) {
        return load_f32x8(w, (unsigned long long)row * n_units + unit);
    }
    static __device__ __forceinline__ float dot(const block& k, const x_unit& x) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            sum += k.v[i] * x.v[i];
        }
        return sum;
    }
};

extern "C" __global__ void quantize_q8_1(unsigned char* __restrict__ xq,
                                         const float* __restrict__ x, unsigned int n_values) {
    const unsigned long long n_blocks = (n_values + 31u) / 32u;
    const unsigned long long b = blockIdx.x;
    const unsigned long long i = b * 32 + threadIdx.x;
    const float v = i < n_values ? x[i] : 0.0f;
    const float d = warp_reduce_max(fabsf(v)) / 127.0f;
    const int q = d == 0.0f ? 0 : __float2int_rn(v / d);
    xq[i] = (unsigned char)(signed char)q;
    const int sum = warp_reduce_sum_int(q);
    if (threadIdx.x == 0) {
        f32x2 ds;
        ds.x = d;
        ds.y = d * (float)sum;
        ((f32x2*)(xq + n_blocks * 32))[b] = ds;
    }
}

// One block's R rows (each from its own matrix: `tile` counts R-row tiles over the matrices
// in order) for the NT tokens from t0 (those below n_tokens).
template <class W, int R, int NT>
__device__ __forceinline__ void mul_mat_vec(unsigned int tile, unsigned int t0,
                                            float* __restrict__ y0,
                                            const unsigned char* __restrict__ w0,
                                            unsigned int n_rows0, float* __restrict__ y1,
                                            const unsigned char* __restrict__ w1,
                                            unsigned int n_rows1, float* __restrict__ y2,
                                            const unsigned char* __restrict__ w2,
                                            unsigned int n_rows2,
                                            const unsigned char* __restrict__ x,
                                            unsigned int n_cols, unsigned int n_tokens,
                                            unsigned int mode) {
    __shared__ float partial[MMV_THREADS / 32][R * NT];
    // This block's rows: matrix pointer, its row count, the row, and where its product goes.
    const unsigned char* w[R];
    unsigned int rows_of[R];
    unsigned int row[R];
    float* y = y0;
    unsigned int n_rows = n_rows0;
    unsigned int first;
    if (mode == MMV_SWIGLU) {
        first = tile * (R / 2);
#pragma unroll
        for (int i = 0; i < R; i++) {
            const bool up = i >= R / 2;
            w[i] = up ? w1 : w0;
            rows_of[i] = n_rows0;
            row[i] = first + (up ? i - R / 2 : i);
        }
    } else {
        const unsigned char* wm = w0;
        const unsigned int tiles0 = (n_rows0 + R - 1) / R;
        const unsigned int tiles1 = (n_rows1 + R - 1) / R;
        if (tile >= tiles0) {
            tile -= tiles0;
            if (tile < tiles1) {
                y = y1;
                wm = w1;
                n_rows = n_rows1;
            } else {
                tile -= tiles1;
                y = y2;
                wm = w2;
                n_rows = n_rows2;
            }
        }
        first = tile * R;
#pragma unroll
        for (int i = 0; i < R; i++) {
            w[i] = wm;
            rows_of[i] = n_rows;
            row[i] = first + i;
        }
    }
    // Rows past the matrix read its last row and are not written.
#pragma unroll
    for (int i = 0; i < R; i++) {
        if (row[i] >= rows_of[i]) {
            row[i] = rows_of[i] - 1;
        }
    }
    const unsigned int n_units = n_cols / W::COLS;
    const unsigned long long n_x_units = (unsigned long long)n_tokens * n_units;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            acc[i][t] = 0.0f;
        }
    }
    for (unsigned int u = threadIdx.x; u < n_units; u += MMV_THREADS) {
        typename W::block k[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            k[i] = W::load(w[i], rows_of[i], n_units, row[i], u);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t0 + t < n_tokens) {
                const typename W::x_unit xu =
                    W::load_x(x, n_x_units, (unsigned long long)(t0 + t) * n_units + u);
#pragma unroll
                for (int i = 0; i < R; i++) {
                    acc[i][t] += W::dot(k[i], xu);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float sum = warp_reduce_sum(acc[i][t]);
            if (threadIdx.x % 32 == 0) {
                partial[threadIdx.x / 32][i * NT + t] = sum;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x >= R * NT) {
        return;
    }
    const unsigned int i = threadIdx.x / NT;
    const unsigned int t = threadIdx.x % NT;
    if (t0 + t >= n_tokens) {
        return;
    }
    float total = 0.0f;
    for (int v = 0; v < MMV_THREADS / 32; v++) {
        total += partial[v][threadIdx.x];
    }
    if (mode == MMV_SWIGLU) {
        const unsigned int r = first + i;
        if (i >= R / 2 || r >= n_rows0) {
            return;
        }
        float up = 0.0f;
        for (int v = 0; v < MMV_THREADS / 32; v++) {
            up += partial[v][(i + R / 2) * NT + t];
        }
        y0[(unsigned long long)(t0 + t) * n_rows0 + r] = total / (1.0f + expf(-total)) * up;
        return;
    }
    const unsigned int r = first + i;
    if (r >= n_rows) {
        return;
    }
    float* out = &y[(unsigned long long)(t0 + t) * n_rows + r];
    if (mode == MMV_ADD) {
        *out += total;
    } else {
        *out = total;
    }
}

#define MUL_MAT_VEC_PARAMS                                                                      \
    float *__restrict__ y0, const unsigned char *__restrict__ w0, unsigned int n_rows0,         \
        float *__restrict__ y1, const unsigned char *__restrict__ w1, unsigned int n_rows1,     \
        float *__restrict__ y2, const unsigned char *__restrict__ w2, unsigned int n_rows2,     \
        const unsigned char *__restrict__ x, unsigned int n_cols, unsigned int n_tokens,        \
        unsigned int mode
#define MUL_MAT_VEC_ARGS y0, w0, n_rows0, y1, w1, n_rows1, y2, w2, n_rows2, x, n_cols, n_tokens, mode

// <name>: one token per block, MMV_ROWS rows; the blocks of one tile's tokens are adjacent, so
// all but the first read its weights from L2. <name>_x8: MMV_TOKENS tokens per block (each
// weight read once per 8 tokens), MMV_ROWS_X8 rows (fewer, for the registers the tokens take).
// The launch bounds ask for MIN_BLOCKS resident blocks per SM of the plain kernel and 4 of
// _x8 (at most 65536 / 128 / MIN_BLOCKS registers a thread): without them ptxas picks fewer
// registers for sm_100 and sm_120 and spills. 8 (at most 64 registers, Q4_0, Q4_1 and the
// unquantized types) puts a 4096-row matrix's 1024 blocks in one wave on a 132-SM H100 or
// H200, where 7 left a second wave of 100 (Nsight Compute on H200: the 4096 x 14336 Q4_0
// product at 50% of HBM bandwidth, 4096 x 4096 at 32%); Q8_0 takes 6 (80 registers: 64
// spill) and the K-quants 4 (they need 128).
#define MUL_MAT_VEC(NAME, W, MIN_BLOCKS)                                                         \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS, MIN_BLOCKS) NAME(MUL_MAT_VEC_PARAMS) {\
        mul_mat_vec<W, MMV_ROWS, 1>(blockIdx.x / n_tokens, blockIdx.x % n_tokens,               \
                                    MUL_MAT_VEC_ARGS);                                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS, 4) NAME##_x8(MUL_MAT_VEC_PARAMS) {\
        const unsigned int token_blocks = (n_tokens + MMV_TOKENS - 1) / MMV_TOKENS;             \
        const unsigned int t0 = blockIdx.x % token_blocks * MMV_TOKENS;                         \
        if (n_tokens - t0 <= MMV_TOKENS / 2) {                                                  \
            mul_mat_vec<W, MMV_ROWS_X8, MMV_TOKENS / 2>(blockIdx.x / token_blocks, t0,          \
                                                        MUL_MAT_VEC_ARGS);                      \
        } else {                                                                                \
            mul_mat_vec<W, MMV_ROWS_X8, MMV_TOKENS>(blockIdx.x / token_blocks, t0,              \
                                                    MUL_MAT_VEC_ARGS);                          \
        }                                                                                       \
    }

MUL_MAT_VEC(mul_mat_vec_q4_0_q8_1, w_q4_0, 8)
MUL_MAT_VEC(mul_mat_vec_q4_1_q8_1, w_q4_1, 8)
MUL_MAT_VEC(mul_mat_vec_q8_0_q8_1, w_q8_0, 6)
MUL_MAT_VEC(mul_mat_vec_q4_k_q8_1, w_q4_k, 4)
MUL_MAT_VEC(mul_mat_vec_q6_k_q8_1, w_q6_k, 4)
MUL_MAT_VEC(mul_mat_vec_f32, w_f32, 8)
MUL_MAT_VEC(mul_mat_vec_f16, w_f16, 8)
MUL_MAT_VEC(mul_mat_vec_bf16, w_bf16, 8)

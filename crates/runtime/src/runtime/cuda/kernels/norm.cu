// RMSNorm, one row per block: y[r, i] = x[r, i] / sqrt(mean_j x[r, j]^2 + eps) * w[i]
// (Zhang & Sennrich 2019; llama.cpp's rms_norm then mul). x, y: [n_rows, n_cols] f32;
// w: [n_cols] f32. Launch: grid (n_rows), block (256): the reduction assumes 256 threads.
// rms_norm_q8_1_f32 also writes y as split Q8_1 blocks to yq (n_cols a multiple of 32, at
// most 8192; n_rows * n_cols / 32 blocks, exactly what quantize_q8_1 makes of y:
// `matvec.cu`), for the quantized products that read it next.

#define NORM_THREADS 256

extern "C" __global__ void rms_norm_f32(float* __restrict__ y, const float* __restrict__ x,
                                        const float* __restrict__ w, unsigned int n_cols,
                                        float eps) {
    __shared__ float partial[NORM_THREADS];
    const unsigned long long row = blockIdx.x;
    const float* xr = x + row * n_cols;
    float* yr = y + row * n_cols;
    float sum = 0.0f;
    for (unsigned int i = threadIdx.x; i < n_cols; i += NORM_THREADS) {
        const float v = xr[i];
        sum += v * v;
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float scale = rsqrtf(partial[0] / (float)n_cols + eps);
    for (unsigned int i = threadIdx.x; i < n_cols; i += NORM_THREADS) {
        yr[i] = xr[i] * scale * w[i];
    }
}

#define NORM_Q8_1_PASSES 8  // 1024 values a pass: rows of up to 8192 values

// The block's sum of every thread's `v` (8 warps: shuffles, then shared memory); every
// thread gets it.
__device__ __forceinline__ float norm_block_sum(float v, float* warp_sums) {
    v = warp_reduce_sum(v);
    if (threadIdx.x % 32 == 0) {
        warp_sums[threadIdx.x / 32] = v;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < NORM_THREADS / 32; w++) {
        total += warp_sums[w];
    }
    return total;
}

// Thread t holds values 4t .. 4t + 3 of each pass of 1024 (loaded at once, 16 bytes each),
// so a block of 32 values is 8 lanes' and its maximum and sum take three shuffles each.
// n_cols a multiple of 32, at most NORM_Q8_1_PASSES * 1024.
extern "C" __global__ void rms_norm_q8_1_f32(float* __restrict__ y,
                                             unsigned char* __restrict__ yq,
                                             const float* __restrict__ x,
                                             const float* __restrict__ w, unsigned int n_cols,
                                             float eps) {
    __shared__ float warp_sums[NORM_THREADS / 32];
    const unsigned long long row = blockIdx.x;
    const f32x4* xr = (const f32x4*)(x + row * n_cols);
    const f32x4* wr = (const f32x4*)w;
    f32x4* yr = (f32x4*)(y + row * n_cols);
    // The row and the weights, loaded at once (the weights before the reduction needs them).
    f32x4 v[NORM_Q8_1_PASSES];
    f32x4 g[NORM_Q8_1_PASSES];
    float sum = 0.0f;
#pragma unroll
    for (int p = 0; p < NORM_Q8_1_PASSES; p++) {
        const unsigned int i = p * NORM_THREADS + threadIdx.x;  // in units of 4 values
        if (4 * i < n_cols) {
            v[p] = xr[i];
            g[p] = wr[i];
        } else {
            v[p].x = v[p].y = v[p].z = v[p].w = 0.0f;
            g[p] = v[p];
        }
        sum += v[p].x * v[p].x + v[p].y * v[p].y + v[p].z * v[p].z + v[p].w * v[p].w;
    }
    const float scale = rsqrtf(norm_block_sum(sum, warp_sums) / (float)n_cols + eps);
    const unsigned long long n_blocks = (unsigned long long)gridDim.x * (n_cols / 32);
#pragma unroll
    for (int p = 0; p < NORM_Q8_1_PASSES; p++) {
        if (p * NORM_THREADS * 4 >= n_cols) {
            break;  // the same for every thread: the harness's shuffles meet block-wide
        }
        const unsigned int i = p * NORM_THREADS + threadIdx.x;
        const bool inside = 4 * i < n_cols;
        f32x4 out;
        out.x = out.y = out.z = out.w = 0.0f;
        if (inside) {
            out.x = v[p].x * scale * g[p].x;
            out.y = v[p].y * scale * g[p].y;
            out.z = v[p].z * scale * g[p].z;
            out.w = v[p].w * scale * g[p].w;
        }
        float m = fmaxf(fmaxf(fabsf(out.x), fabsf(out.y)), fmaxf(fabsf(out.z), fabsf(out.w)));
        for (int offset = 4; offset > 0; offset >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
        }
        const float d = m / 127.0f;
        const int q0 = d == 0.0f ? 0 : __float2int_rn(out.x / d);
        const int q1 = d == 0.0f ? 0 : __float2int_rn(out.y / d);
        const int q2 = d == 0.0f ? 0 : __float2int_rn(out.z / d);
        const int q3 = d == 0.0f ? 0 : __float2int_rn(out.w / d);
        int total = q0 + q1 + q2 + q3;
        for (int offset = 4; offset > 0; offset >>= 1) {
            total += __shfl_xor_sync(0xffffffffu, total, offset);
        }
        if (!inside) {
            continue;
        }
        yr[i] = out;
        const unsigned long long value = row * n_cols + 4ull * i;  // of the whole matrix
        const unsigned int packed = (unsigned int)(q0 & 0xff) | ((unsigned int)(q1 & 0xff) << 8) |
                                    ((unsigned int)(q2 & 0xff) << 16) |
                                    ((unsigned int)(q3 & 0xff) << 24);
        ((unsigned int*)yq)[value / 4] = packed;
        if (threadIdx.x % 8 == 0) {
            f32x2 ds;
            ds.x = d;
            ds.y = d * (float)total;
            ((f32x2*)(yq + n_blocks * 32))[value / 32] = ds;
        }
    }
}

// Quantized matrix-vector products for small batches, as llama.cpp's MMVQ: activations are
// quantized to Q8_1 blocks (32 int8 values, a float scale d and the scaled sum s), then
// each weight block's integer dot product runs four int8 pairs at a time with __dp4a.
//
// quantize_q8_1: x [n_rows, n_cols] f32 -> xq [n_rows, n_cols / 32] blocks of
//   { float d; float s; signed char q[32]; } (40 bytes). Launch: grid (n_rows * n_cols / 32),
//   block (32): one block of 32 values per thread block.
// mul_mat_vec_q8_0_q8_1: y[r] = sum_b d_w[r, b] * d_x[b] * dot(q_w[r, b], q_x[b]) for one
//   activation row, w in GGML Q8_0 (34-byte blocks). Launch: grid (n_rows), block (128).

#define MMV_THREADS 128

struct block_q8_1 {
    float d;
    float s;
    signed char q[32];
};

__device__ __forceinline__ float half_to_float(unsigned short h) {
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int exponent = (h >> 10) & 0x1fu;
    const unsigned int mantissa = h & 0x3ffu;
    if (exponent == 0) {
        const float value = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    const unsigned int bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))
                                             : (sign | ((exponent + 112) << 23) | (mantissa << 13));
    return __int_as_float((int)bits);
}

extern "C" __global__ void quantize_q8_1(block_q8_1* __restrict__ xq, const float* __restrict__ x,
                                         unsigned int n_values) {
    __shared__ float amax[32];
    __shared__ float sum[32];
    const unsigned long long i = (unsigned long long)blockIdx.x * 32 + threadIdx.x;
    const float v = i < n_values ? x[i] : 0.0f;
    amax[threadIdx.x] = fabsf(v);
    sum[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = 16; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            amax[threadIdx.x] = fmaxf(amax[threadIdx.x], amax[threadIdx.x + s]);
            sum[threadIdx.x] += sum[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float d = amax[0] / 127.0f;
    const int q = d == 0.0f ? 0 : __float2int_rn(v / d);
    xq[blockIdx.x].q[threadIdx.x] = (signed char)q;
    if (threadIdx.x == 0) {
        xq[blockIdx.x].d = d;
        xq[blockIdx.x].s = sum[0];
    }
}

extern "C" __global__ void mul_mat_vec_q8_0_q8_1(float* __restrict__ y,
                                                 const unsigned char* __restrict__ w,
                                                 const block_q8_1* __restrict__ xq,
                                                 unsigned int n_cols) {
    __shared__ float partial[MMV_THREADS];
    const unsigned int n_blocks = n_cols / 32;
    const unsigned char* row = w + (unsigned long long)blockIdx.x * n_blocks * 34;
    float acc = 0.0f;
    // Each thread takes 4 values (one int32 of each block) at a time: 8 threads per block.
    for (unsigned int k = threadIdx.x; k < n_blocks * 8; k += MMV_THREADS) {
        const unsigned int b = k / 8;
        const unsigned int part = k % 8;
        const unsigned char* wb = row + b * 34;
        const float dw = half_to_float((unsigned short)(wb[0] | (wb[1] << 8)));
        // Q8_0's quants start at byte 2: assemble the int32 byte by byte (2-byte aligned).
        const unsigned char* wq = wb + 2 + part * 4;
        const int wi = (int)(wq[0] | (wq[1] << 8) | (wq[2] << 16) | ((unsigned int)wq[3] << 24));
        const int xi = *(const int*)(xq[b].q + part * 4);
        acc += dw * xq[b].d * (float)__dp4a(wi, xi, 0);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = MMV_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        y[blockIdx.x] = partial[0];
    }
}

// RMSNorm, one row per block: y[r, i] = x[r, i] / sqrt(mean_j x[r, j]^2 + eps) * w[i]
// (Zhang & Sennrich 2019; llama.cpp's rms_norm then mul). x, y: [n_rows, n_cols] f32;
// w: [n_cols] f32. Launch: grid (n_rows), block (256): the reduction assumes 256 threads.

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

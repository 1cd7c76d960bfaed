// Elementwise ops of the residual stream and the MLP. Launch: grid (ceil(n / 256)), block (256).
// swiglu_f32 (Shazeer 2020): out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g).
// add_f32: x[i] += y[i] (a residual connection).
// add_bias_f32: x[i] += bias[i % n_cols] over rows of n_cols (Q/K/V biases, Qwen2).
// scale_add_rows_f32 (the MoE combine): x[ids[r], :] += weights[r] * rows[r, :] for rows
//   [n_rows, dim]; the ids of one launch must differ (one expert's tokens). Launch: grid
//   (n_rows, ceil(dim / 256)), block (256).

extern "C" __global__ void swiglu_f32(float* __restrict__ out, const float* __restrict__ gate,
                                      const float* __restrict__ up, unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y,
                                   unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] += y[i];
    }
}

extern "C" __global__ void scale_add_rows_f32(float* __restrict__ x, const float* __restrict__ rows,
                                              const int* __restrict__ ids,
                                              const float* __restrict__ weights, unsigned int dim) {
    const unsigned int r = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < dim) {
        x[(unsigned long long)ids[r] * dim + i] += weights[r] * rows[(unsigned long long)r * dim + i];
    }
}

extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ bias,
                                        unsigned int n_cols, unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] += bias[i % n_cols];
    }
}

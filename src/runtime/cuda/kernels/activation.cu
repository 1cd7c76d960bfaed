// SwiGLU (Shazeer 2020), elementwise: out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g).
// Launch: grid (ceil(n / 256)), block (256).

extern "C" __global__ void swiglu_f32(float* __restrict__ out, const float* __restrict__ gate,
                                      const float* __restrict__ up, unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// Rotary position embedding (Su et al. 2021) in place on x: [n_tokens, n_heads, head_dim] f32.
// Pair i of a head rotates by positions[t] * inv_freqs[i] (inv_freqs: [head_dim / 2], computed
// on the host with any Llama-3 frequency scaling, as the CPU backend does).
// Interleaved pairs (2i, 2i + 1): GGML's normal mode (Llama). NeoX pairs (i, i + head_dim / 2):
// GPT-NeoX / Qwen (`rope_pair_of`, common.cuh). Launch: grid (ceil(n_tokens * n_heads *
// head_dim / 2 / 256)), block (256).

// Rotates the pair this thread owns; `neox` picks the pairing.
__device__ __forceinline__ void rope_one_pair(float* x, const int* positions, const float* inv_freqs,
                                          unsigned int n_tokens, unsigned int n_heads,
                                          unsigned int head_dim, bool neox) {
    const unsigned int half = head_dim / 2;
    const unsigned long long pair = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= (unsigned long long)n_tokens * n_heads * half) {
        return;
    }
    const unsigned int i = pair % half;
    const unsigned long long head = pair / half;
    const unsigned int token = head / n_heads;
    float* h = x + head * head_dim;
    const float angle = (float)positions[token] * inv_freqs[i];
    const rope_pair at = rope_pair_of(i, head_dim, neox);
    rotate(&h[at.a], &h[at.b], angle);
}

extern "C" __global__ void rope_interleaved_f32(float* __restrict__ x,
                                                const int* __restrict__ positions,
                                                const float* __restrict__ inv_freqs,
                                                unsigned int n_tokens, unsigned int n_heads,
                                                unsigned int head_dim) {
    rope_one_pair(x, positions, inv_freqs, n_tokens, n_heads, head_dim, false);
}

extern "C" __global__ void rope_neox_f32(float* __restrict__ x, const int* __restrict__ positions,
                                         const float* __restrict__ inv_freqs,
                                         unsigned int n_tokens, unsigned int n_heads,
                                         unsigned int head_dim) {
    rope_one_pair(x, positions, inv_freqs, n_tokens, n_heads, head_dim, true);
}

// Embedding lookup: out[t, :] = table[ids[t], :] as f32. out: [n_ids, dim] f32.
// get_rows_f32: table [n_vocab, dim] f32. get_rows_q8_0: a Q8_0 table of n_vocab rows held
// split, as the backend uploads Q8_0 (`matvec.cu`): every block's 32 int8 q, [n_vocab,
// dim / 32, 32], then every block's IEEE half scale d, [n_vocab, dim / 32]; value = d * q.
// Launch: grid (n_ids, ceil(dim / 256)), block (256).

extern "C" __global__ void get_rows_f32(float* __restrict__ out, const float* __restrict__ table,
                                        const int* __restrict__ ids, unsigned int dim) {
    const unsigned int t = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < dim) {
        out[(unsigned long long)t * dim + i] = table[(unsigned long long)ids[t] * dim + i];
    }
}

extern "C" __global__ void get_rows_q8_0(float* __restrict__ out,
                                         const unsigned char* __restrict__ table,
                                         const int* __restrict__ ids, unsigned int dim,
                                         unsigned int n_vocab) {
    const unsigned int t = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= dim) {
        return;
    }
    const unsigned long long n_blocks = dim / 32;
    const unsigned long long block = (unsigned long long)ids[t] * n_blocks + i / 32;
    const float d = half_at(table + (unsigned long long)n_vocab * n_blocks * 32 + block * 2);
    out[(unsigned long long)t * dim + i] = d * (float)(signed char)table[block * 32 + i % 32];
}

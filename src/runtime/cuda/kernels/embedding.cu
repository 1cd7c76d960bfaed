// Embedding lookup: out[t, :] = table[ids[t], :] as f32. out: [n_ids, dim] f32.
// get_rows_f32: table [n_vocab, dim] f32. get_rows_q8_0: table rows in GGML's Q8_0 blocks
// (34 bytes per 32 values: an IEEE half scale d, then 32 int8 q; value = d * q).
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
                                         const int* __restrict__ ids, unsigned int dim) {
    const unsigned int t = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= dim) {
        return;
    }
    const unsigned long long row_bytes = (unsigned long long)(dim / 32) * 34;
    const unsigned char* block = table + (unsigned long long)ids[t] * row_bytes + (i / 32) * 34;
    const float d = half_at(block);
    out[(unsigned long long)t * dim + i] = d * (float)(signed char)block[2 + i % 32];
}

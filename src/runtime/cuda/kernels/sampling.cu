// Greedy sampling: the index of each row's largest logit (the lowest index on ties, as the
// CPU backend's argmax). logits: [n_rows, n_vocab] f32; out: [n_rows] int.
// Launch: grid (n_rows), block (256).

#define ARGMAX_THREADS 256

extern "C" __global__ void argmax_f32(int* __restrict__ out, const float* __restrict__ logits,
                                      unsigned int n_vocab) {
    __shared__ float best[ARGMAX_THREADS];
    __shared__ int where[ARGMAX_THREADS];
    const float* row = logits + (unsigned long long)blockIdx.x * n_vocab;
    float value = -3.402823466e38f;
    int index = 0x7fffffff;
    for (unsigned int i = threadIdx.x; i < n_vocab; i += ARGMAX_THREADS) {
        if (row[i] > value) {
            value = row[i];
            index = (int)i;
        }
    }
    best[threadIdx.x] = value;
    where[threadIdx.x] = index;
    __syncthreads();
    for (unsigned int s = ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float other = best[threadIdx.x + s];
            const int other_index = where[threadIdx.x + s];
            if (other > best[threadIdx.x] ||
                (other == best[threadIdx.x] && other_index < where[threadIdx.x])) {
                best[threadIdx.x] = other;
                where[threadIdx.x] = other_index;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = where[0];
    }
}

// Greedy sampling: the index of each row's largest logit (the lowest index on ties, as the
// CPU backend's argmax). logits: [n_rows, n_vocab] f32; out: [n_rows] int. Two passes, so a
// row of 128 K logits is read by many blocks at once rather than one:
// argmax_partial_f32: each of ARGMAX_SPLIT blocks of a row takes one slice of
//   ceil(n_vocab / ARGMAX_SPLIT) logits and writes its best to partials, held split:
//   values [n_rows, ARGMAX_SPLIT] f32 then indices [n_rows, ARGMAX_SPLIT] int.
//   Launch: grid (n_rows, ARGMAX_SPLIT), block (ARGMAX_THREADS).
// argmax_combine_f32: the best of a row's ARGMAX_SPLIT partials. Launch: grid (n_rows), block
//   (ARGMAX_THREADS).

#define ARGMAX_THREADS 256
#define ARGMAX_SPLIT 64

// The block's best (value, index) of every thread's, lowest index on ties, in best[0] and
// where[0] (ARGMAX_THREADS entries each).
__device__ __forceinline__ void argmax_block(float value, int index, float* best, int* where) {
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
}

extern "C" __global__ void argmax_partial_f32(float* __restrict__ partials,
                                              const float* __restrict__ logits,
                                              unsigned int n_vocab) {
    __shared__ float best[ARGMAX_THREADS];
    __shared__ int where[ARGMAX_THREADS];
    const unsigned long long row = blockIdx.x;
    const float* logits_row = logits + row * n_vocab;
    const unsigned int slice = (n_vocab + ARGMAX_SPLIT - 1) / ARGMAX_SPLIT;
    const unsigned int first = blockIdx.y * slice;
    const unsigned int end = first + slice < n_vocab ? first + slice : n_vocab;
    float value = -3.402823466e38f;
    int index = 0x7fffffff;
    for (unsigned int i = first + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        const float v = logits_row[i];
        if (v > value) {
            value = v;
            index = (int)i;
        }
    }
    argmax_block(value, index, best, where);
    if (threadIdx.x == 0) {
        const unsigned long long at = row * ARGMAX_SPLIT + blockIdx.y;
        partials[at] = best[0];
        ((int*)(partials + (unsigned long long)gridDim.x * ARGMAX_SPLIT))[at] = where[0];
    }
}

extern "C" __global__ void argmax_combine_f32(int* __restrict__ out,
                                              const float* __restrict__ partials) {
    __shared__ float best[ARGMAX_THREADS];
    __shared__ int where[ARGMAX_THREADS];
    const unsigned long long at = (unsigned long long)blockIdx.x * ARGMAX_SPLIT + threadIdx.x;
    const int* indices = (const int*)(partials + (unsigned long long)gridDim.x * ARGMAX_SPLIT);
    const bool mine = threadIdx.x < ARGMAX_SPLIT;
    argmax_block(mine ? partials[at] : -3.402823466e38f, mine ? indices[at] : 0x7fffffff, best,
                 where);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = where[0];
    }
}

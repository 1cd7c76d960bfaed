// Attention over the paged KV cache (vLLM's PagedAttention layout), one query vector per
// (query, head): decode is one query per sequence; prefill is one query per prompt token,
// each with its causal length (the positions up to and including its own).
//
// q, out: [n_queries, n_heads, head_dim] f32. k_cache, v_cache (one layer):
//   [n_blocks, n_kv_heads, 16, head_dim] f16 bits (16 positions per block, as the CPU
//   backend's kv::BLOCK_TOKENS). block_tables: [n_rows, max_blocks] int, the blocks of each
//   sequence in position order; table_rows: [n_queries] int, the row of each query's
//   sequence; context_lens: [n_queries] int, positions each query attends (p < len).
// GQA: query head h reads KV head h / (n_heads / n_kv_heads). Softmax of scale · q·k, online
// over tiles of 512 positions (Milakov & Gimelshein 2018), so any context length fits.
// Launch: grid (n_heads, n_queries), block (128); head_dim <= 128.

#define ATTN_THREADS 128
#define ATTN_TILE 512
#define KV_BLOCK 16

// Block-wide reduction of `value` (max or sum) through `scratch`; every thread gets it.
__device__ __forceinline__ float block_reduce(float value, float* scratch, bool is_max) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (unsigned int s = ATTN_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float other = scratch[threadIdx.x + s];
            scratch[threadIdx.x] = is_max ? fmaxf(scratch[threadIdx.x], other)
                                          : scratch[threadIdx.x] + other;
        }
        __syncthreads();
    }
    const float result = scratch[0];
    __syncthreads();
    return result;
}

extern "C" __global__ void paged_attention_f16kv(
    float* __restrict__ out, const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ table_rows, const int* __restrict__ context_lens,
    unsigned int max_blocks, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim,
    float scale) {
    __shared__ float q_shared[ATTN_THREADS];
    __shared__ float weights[ATTN_TILE];
    __shared__ float scratch[ATTN_THREADS];
    const unsigned int head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const unsigned int kv_head = head / (n_heads / n_kv_heads);
    const int* table = block_tables + (unsigned long long)table_rows[query] * max_blocks;
    const int context = context_lens[query];
    const unsigned long long row = ((unsigned long long)query * n_heads + head) * head_dim;
    if (threadIdx.x < head_dim) {
        q_shared[threadIdx.x] = q[row + threadIdx.x];
    }
    __syncthreads();
    float running_max = -3.402823466e38f;
    float running_sum = 0.0f;
    float acc = 0.0f;  // output dimension threadIdx.x
    for (int start = 0; start < context; start += ATTN_TILE) {
        const int n = context - start < ATTN_TILE ? context - start : ATTN_TILE;
        float tile_max = -3.402823466e38f;
        for (int p = threadIdx.x; p < n; p += ATTN_THREADS) {
            const int position = start + p;
            const unsigned long long slot =
                (((unsigned long long)table[position / KV_BLOCK] * n_kv_heads + kv_head) * KV_BLOCK +
                 position % KV_BLOCK) * head_dim;
            float dot = 0.0f;
            for (unsigned int d = 0; d < head_dim; d++) {
                dot += q_shared[d] * half_to_float(k_cache[slot + d]);
            }
            weights[p] = dot * scale;
            tile_max = fmaxf(tile_max, weights[p]);
        }
        tile_max = block_reduce(tile_max, scratch, true);
        const float new_max = fmaxf(running_max, tile_max);
        float tile_sum = 0.0f;
        for (int p = threadIdx.x; p < n; p += ATTN_THREADS) {
            weights[p] = expf(weights[p] - new_max);
            tile_sum += weights[p];
        }
        tile_sum = block_reduce(tile_sum, scratch, false);
        const float correction = expf(running_max - new_max);
        running_sum = running_sum * correction + tile_sum;
        running_max = new_max;
        if (threadIdx.x < head_dim) {
            float tile_acc = 0.0f;
            for (int p = 0; p < n; p++) {
                const int position = start + p;
                const unsigned long long slot =
                    (((unsigned long long)table[position / KV_BLOCK] * n_kv_heads + kv_head) *
                         KV_BLOCK +
                     position % KV_BLOCK) * head_dim;
                tile_acc += weights[p] * half_to_float(v_cache[slot + threadIdx.x]);
            }
            acc = acc * correction + tile_acc;
        }
        __syncthreads();
    }
    if (threadIdx.x < head_dim) {
        out[row + threadIdx.x] = context > 0 ? acc / running_sum : 0.0f;
    }
}

// Writes new tokens' keys and values into their cache slots (vLLM's reshape_and_cache), as
// f16 rounded to nearest even. k, v: [n_tokens, n_kv_heads, head_dim] f32; slots:
// [n_tokens] int, each block * 16 + offset. Launch: grid (n_tokens, ceil(n_kv_heads *
// head_dim / 256)), block (256).
extern "C" __global__ void store_kv_f16(unsigned short* __restrict__ k_cache,
                                        unsigned short* __restrict__ v_cache,
                                        const float* __restrict__ k, const float* __restrict__ v,
                                        const int* __restrict__ slots, unsigned int n_kv_heads,
                                        unsigned int head_dim) {
    const unsigned int t = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    const unsigned int width = n_kv_heads * head_dim;
    if (i >= width) {
        return;
    }
    const int slot = slots[t];
    const unsigned int head = i / head_dim;
    const unsigned int d = i % head_dim;
    const unsigned long long at =
        (((unsigned long long)(slot / KV_BLOCK) * n_kv_heads + head) * KV_BLOCK + slot % KV_BLOCK) *
            head_dim + d;
    k_cache[at] = float_to_half(k[(unsigned long long)t * width + i]);
    v_cache[at] = float_to_half(v[(unsigned long long)t * width + i]);
}

// Whole blocks of one layer's cache in and out, bit for bit: a sequence's keys or values
// handed between replicas (prefill/decode disaggregation). A block of the cache
// [n_blocks, n_kv_heads, 16, head_dim] f16 is `words` = n_kv_heads * 8 * head_dim 32-bit
// words. read_kv_blocks: out[i, :] = cache[ids[i], :]; write_kv_blocks: cache[ids[i], :] =
// rows[i, :] (ids distinct). Launch: grid (n_ids, ceil(words / 256)), block (256).
extern "C" __global__ void read_kv_blocks(unsigned int* __restrict__ out,
                                          const unsigned int* __restrict__ cache,
                                          const int* __restrict__ ids, unsigned int words) {
    const unsigned int b = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < words) {
        out[(unsigned long long)b * words + i] = cache[(unsigned long long)ids[b] * words + i];
    }
}

extern "C" __global__ void write_kv_blocks(unsigned int* __restrict__ cache,
                                           const unsigned int* __restrict__ rows,
                                           const int* __restrict__ ids, unsigned int words) {
    const unsigned int b = blockIdx.x;
    const unsigned int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < words) {
        cache[(unsigned long long)ids[b] * words + i] = rows[(unsigned long long)b * words + i];
    }
}

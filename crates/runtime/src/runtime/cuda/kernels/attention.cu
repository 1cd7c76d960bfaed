// Attention over the paged KV cache (vLLM's PagedAttention layout), one query vector per
// (query, head): decode is one query per sequence; prefill is one query per prompt token,
// each with its causal length (the positions up to and including its own).
//
// q, out: [n_queries, n_heads, head_dim] f32. k_cache, v_cache (one layer):
//   [n_blocks, n_kv_heads, 16, head_dim] f16 bits (16 positions per block, as the CPU
//   backend's kv::BLOCK_TOKENS). block_tables: [n_rows, max_blocks] int, the blocks of each
//   sequence in position order; table_rows: [n_queries] int, the row of each query's
//   sequence; context_lens: [n_queries] int, positions each query attends (p < len).
// GQA: query head h reads KV head h / (n_heads / n_kv_heads). One block per (head, query).
// The block takes the context in chunks of ATTN_WARPS * 32 positions, each warp 32 of them:
// lane p scores position p (its whole key row, 16-byte loads, against q in shared memory),
// the warp's softmax runs online over its chunks (Milakov & Gimelshein 2018), so any
// context length fits, and lane l then adds dimensions l, l + 32, ... of the 32 values
// rows, weighted (the weights through shared memory). The warps' maxima, sums and outputs
// meet in shared memory at the end (flash-decoding's split-K combine, Dao et al. 2023,
// within one block). With `quantize` (head_dim a multiple of 32), out_q gets out's split Q8_1
// blocks too (as quantize_q8_1 in matvec.cu). Launch: grid (n_heads, n_queries), block
// (ATTN_WARPS * 32); head_dim a multiple of 8, at most 128.

#define ATTN_WARPS 8
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_MAX_DIM 128
#define ATTN_MAX_DIMS (ATTN_MAX_DIM / 32)
#define KV_BLOCK 16

__device__ __forceinline__ unsigned long long kv_slot(const int* table, int position,
                                                      unsigned int n_kv_heads,
                                                      unsigned int kv_head,
                                                      unsigned int head_dim) {
    return (((unsigned long long)table[position / KV_BLOCK] * n_kv_heads + kv_head) * KV_BLOCK +
            position % KV_BLOCK) * head_dim;
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 2) paged_attention_f16kv(
    float* __restrict__ out, const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ table_rows, const int* __restrict__ context_lens,
    unsigned int max_blocks, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim,
    float scale, unsigned char* __restrict__ out_q, unsigned int quantize) {
    __shared__ float q_shared[ATTN_MAX_DIM];
    __shared__ float weights[ATTN_WARPS][32];
    __shared__ float warp_max[ATTN_WARPS];
    __shared__ float warp_sum[ATTN_WARPS];
    __shared__ float warp_out[ATTN_WARPS][ATTN_MAX_DIM];
    const unsigned int head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const unsigned int warp = threadIdx.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int kv_head = head / (n_heads / n_kv_heads);
    const int* table = block_tables + (unsigned long long)table_rows[query] * max_blocks;
    const int context = context_lens[query];
    const unsigned long long row = ((unsigned long long)query * n_heads + head) * head_dim;
    if (threadIdx.x < head_dim) {
        q_shared[threadIdx.x] = q[row + threadIdx.x] * scale;
    }
    __syncthreads();
    float running_max = -3.402823466e38f;
    float running_sum = 0.0f;
    float acc[ATTN_MAX_DIMS];
#pragma unroll
    for (int j = 0; j < ATTN_MAX_DIMS; j++) {
        acc[j] = 0.0f;
    }
    // Every warp takes the same number of steps (the harness's shuffles meet block-wide).
    for (int chunk = 0; chunk < context; chunk += ATTN_THREADS) {
        const int first = chunk + (int)warp * 32;
        const int position = first + (int)lane;
        float score = -3.402823466e38f;
        if (position < context) {
            const u32x4* k = (const u32x4*)(k_cache + kv_slot(table, position, n_kv_heads,
                                                               kv_head, head_dim));
            // Every 16-byte piece of the row loaded before any is used.
            u32x4 row_k[ATTN_MAX_DIM / 8];
#pragma unroll
            for (unsigned int d = 0; d < ATTN_MAX_DIM / 8; d++) {
                if (d < head_dim / 8) {
                    row_k[d] = k[d];
                }
            }
            float dot = 0.0f;
#pragma unroll
            for (unsigned int d = 0; d < ATTN_MAX_DIM / 8; d++) {
                if (d >= head_dim / 8) {
                    break;
                }
                const u32x4 h = row_k[d];
                const unsigned int halves[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    dot += q_shared[8 * d + 2 * i] * half_to_float((unsigned short)(halves[i] & 0xffffu));
                    dot += q_shared[8 * d + 2 * i + 1] * half_to_float((unsigned short)(halves[i] >> 16));
                }
            }
            score = dot;
        }
        const float chunk_max = warp_reduce_max(score);
        const float new_max = fmaxf(running_max, chunk_max);
        const float weight = position < context ? expf(score - new_max) : 0.0f;
        const float correction = expf(running_max - new_max);
        running_sum = running_sum * correction + warp_reduce_sum(weight);
        running_max = new_max;
        weights[warp][lane] = weight;
        __syncwarp();
        const int n = context - first < 32 ? context - first : 32;
#pragma unroll
        for (int j = 0; j < ATTN_MAX_DIMS; j++) {
            acc[j] *= correction;
        }
#pragma unroll 8
        for (int p = 0; p < n; p++) {
            const unsigned short* v =
                v_cache + kv_slot(table, first + p, n_kv_heads, kv_head, head_dim);
            const float w = weights[warp][p];
#pragma unroll
            for (int j = 0; j < ATTN_MAX_DIMS; j++) {
                const unsigned int d = j * 32 + lane;
                if (d < head_dim) {
                    acc[j] += w * half_to_float(v[d]);
                }
            }
        }
        __syncwarp();
    }
    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_sum[warp] = running_sum;
    }
#pragma unroll
    for (int j = 0; j < ATTN_MAX_DIMS; j++) {
        warp_out[warp][j * 32 + lane] = acc[j];
    }
    __syncthreads();
    const bool mine = threadIdx.x < head_dim;
    float result = 0.0f;
    if (mine) {
        float max = -3.402823466e38f;
        for (unsigned int w = 0; w < ATTN_WARPS; w++) {
            max = fmaxf(max, warp_max[w]);
        }
        float sum = 0.0f;
        float value = 0.0f;
        for (unsigned int w = 0; w < ATTN_WARPS; w++) {
            // A warp that had no position keeps sum 0 and adds nothing.
            const float factor = warp_sum[w] > 0.0f ? expf(warp_max[w] - max) : 0.0f;
            sum += warp_sum[w] * factor;
            value += warp_out[w][threadIdx.x] * factor;
        }
        result = context > 0 ? value / sum : 0.0f;
        out[row + threadIdx.x] = result;
    }
    if (quantize == 0) {
        return;
    }
    // The output's Q8_1 blocks (head_dim a multiple of 32: a warp's lanes are one block),
    // as quantize_q8_1 makes them from `out`, split over the whole [n_queries, n_heads *
    // head_dim] matrix: what the output projection reads next.
    const float d = warp_reduce_max(fabsf(result)) / 127.0f;
    const int q_value = d == 0.0f ? 0 : __float2int_rn(result / d);
    const int q_sum = warp_reduce_sum_int(q_value);
    if (!mine) {
        return;
    }
    const unsigned long long index = row + threadIdx.x;
    out_q[index] = (unsigned char)(signed char)q_value;
    if (lane == 0) {
        const unsigned long long n_blocks = (unsigned long long)gridDim.y * n_heads * head_dim / 32;
        f32x2 ds;
        ds.x = d;
        ds.y = d * (float)q_sum;
        ((f32x2*)(out_q + n_blocks * 32))[index / 32] = ds;
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

// rope_store_kv_f16: rope_<style>_f32 on q [n_tokens, n_heads, head_dim] and k [n_tokens,
// n_kv_heads, head_dim] in place, then store_kv_f16 of k and v: one launch for the three (a
// thread per rotated pair; a key pair's thread also stores its two keys and the two values
// of the same dimensions). The same arithmetic as the three, so the same bits. neox: 0
// interleaved pairs, 1 NeoX. Launch: grid (n_tokens, ceil((n_heads + n_kv_heads) *
// head_dim / 2 / 256)), block (256).
extern "C" __global__ void rope_store_kv_f16(float* __restrict__ q, float* __restrict__ k,
                                             const float* __restrict__ v,
                                             unsigned short* __restrict__ k_cache,
                                             unsigned short* __restrict__ v_cache,
                                             const int* __restrict__ positions,
                                             const float* __restrict__ inv_freqs,
                                             const int* __restrict__ slots, unsigned int n_heads,
                                             unsigned int n_kv_heads, unsigned int head_dim,
                                             unsigned int neox) {
    const unsigned int t = blockIdx.x;
    const unsigned int half = head_dim / 2;
    const unsigned int pair = blockIdx.y * blockDim.x + threadIdx.x;
    if (pair >= (n_heads + n_kv_heads) * half) {
        return;
    }
    const unsigned int head = pair / half;
    const unsigned int i = pair % half;
    const rope_pair at = rope_pair_of(i, head_dim, neox != 0);
    const float angle = (float)positions[t] * inv_freqs[i];
    if (head < n_heads) {
        float* h = q + ((unsigned long long)t * n_heads + head) * head_dim;
        rotate(&h[at.a], &h[at.b], angle);
        return;
    }
    const unsigned int kv_head = head - n_heads;
    const unsigned long long row = ((unsigned long long)t * n_kv_heads + kv_head) * head_dim;
    float* h = k + row;
    rotate(&h[at.a], &h[at.b], angle);
    const int slot = slots[t];
    const unsigned long long cached =
        (((unsigned long long)(slot / KV_BLOCK) * n_kv_heads + kv_head) * KV_BLOCK +
         slot % KV_BLOCK) * head_dim;
    k_cache[cached + at.a] = float_to_half(h[at.a]);
    k_cache[cached + at.b] = float_to_half(h[at.b]);
    v_cache[cached + at.a] = float_to_half(v[row + at.a]);
    v_cache[cached + at.b] = float_to_half(v[row + at.b]);
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

// The host harness's CUDA: what the kernel sources use, on CPU threads. A grid runs one block
// at a time; a block's threads are real threads meeting at a barrier for __syncthreads, so the
// kernels' shared-memory reductions and warp shuffles run as written. __shared__ arrays become function statics
// (blocks never overlap, and the launcher runs one grid at a time).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <thread>
#include <vector>

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
inline thread_local std::barrier<>* infer_host_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

inline void __syncthreads() { infer_host_barrier->arrive_and_wait(); }
// A warp's barrier: the block's here (the kernels call it where every warp does).
inline void __syncwarp(unsigned int = 0xffffffffu) { __syncthreads(); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline float __uint_as_float(unsigned int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int i;
    std::memcpy(&i, &f, sizeof i);
    return i;
}

// Warp shuffles through per-warp slots: each lane publishes its value in its slot, the block
// meets at the barrier, and each lane reads its partner's slot. Consecutive shuffles use the
// two halves of the slots in turn, so one barrier per shuffle suffices: a lane cannot write
// a half again before every lane has passed the next shuffle's barrier, after its read.
// Every thread of the block must call it together (the kernels' shuffles are all in
// convergent code); the mask is not consulted.
inline unsigned int infer_host_shuffle_slots[2][1024];
inline thread_local unsigned int infer_host_shuffle_parity;
template <class T>
inline T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const unsigned int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned int* slots = infer_host_shuffle_slots[infer_host_shuffle_parity];
    infer_host_shuffle_parity ^= 1u;
    std::memcpy(&slots[t], &value, 4);
    __syncthreads();
    const unsigned int lane = t % 32;
    const unsigned int partner = t - lane + (lane ^ (unsigned int)lane_mask);
    T result;
    std::memcpy(&result, &slots[partner], 4);
    return result;
}
// Round to nearest, ties to even: the default rounding mode, as cvt.rni.
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
// Four signed byte products summed into c (PTX dp4a.s32.s32).
inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++) {
        c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    }
    return c;
}

// Runs `body` as grid × block threads: one OS thread per CUDA thread of a block, the same
// threads for every block in turn, meeting at the barrier between blocks.
inline void infer_host_run(const unsigned int* grid, const unsigned int* block,
                           const std::function<void()>& body) {
    const unsigned int threads = block[0] * block[1] * block[2];
    std::barrier<> barrier((std::ptrdiff_t)threads);
    std::vector<std::thread> workers;
    workers.reserve(threads);
    for (unsigned int t = 0; t < threads; t++) {
        workers.emplace_back([&, t] {
            threadIdx = {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
            blockDim = {block[0], block[1], block[2]};
            gridDim = {grid[0], grid[1], grid[2]};
            infer_host_barrier = &barrier;
            for (unsigned int bz = 0; bz < grid[2]; bz++)
                for (unsigned int by = 0; by < grid[1]; by++)
                    for (unsigned int bx = 0; bx < grid[0]; bx++) {
                        blockIdx = {bx, by, bz};
                        body();
                        barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& w : workers) w.join();
}

// A pointer argument that converts to whatever pointer type the kernel declares.
struct InferHostPtr {
    void* p;
    template <class T>
    operator T*() const {
        return static_cast<T*>(p);
    }
};

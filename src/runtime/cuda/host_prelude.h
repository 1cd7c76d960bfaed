// The host harness's CUDA: what the kernel sources use, on CPU threads. A grid runs one block
// at a time; a block's threads are real threads meeting at a barrier for __syncthreads, so the
// kernels' shared-memory reductions run as written. __shared__ arrays become function statics
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
#define __restrict__ __restrict
#define __shared__ static

inline void __syncthreads() { infer_host_barrier->arrive_and_wait(); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
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

// Runs `body` as grid × block threads, one block at a time.
inline void infer_host_run(const unsigned int* grid, const unsigned int* block,
                           const std::function<void()>& body) {
    const unsigned int threads = block[0] * block[1] * block[2];
    for (unsigned int bz = 0; bz < grid[2]; bz++)
        for (unsigned int by = 0; by < grid[1]; by++)
            for (unsigned int bx = 0; bx < grid[0]; bx++) {
                std::barrier<> barrier((std::ptrdiff_t)threads);
                std::vector<std::thread> workers;
                workers.reserve(threads);
                for (unsigned int t = 0; t < threads; t++) {
                    workers.emplace_back([&, t] {
                        threadIdx = {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
                        blockIdx = {bx, by, bz};
                        blockDim = {block[0], block[1], block[2]};
                        gridDim = {grid[0], grid[1], grid[2]};
                        infer_host_barrier = &barrier;
                        body();
                    });
                }
                for (auto& w : workers) w.join();
            }
}

// A pointer argument that converts to whatever pointer type the kernel declares.
struct InferHostPtr {
    void* p;
    template <class T>
    operator T*() const {
        return static_cast<T*>(p);
    }
};

// The host harness's CUDA: what the kernel sources use, on the CPU. A grid runs one block at a
// time. A block's threads are fibers on the launching thread (x86-64): each runs until it
// meets __syncthreads or ends, then the next one in turn runs, so the kernels' shared-memory
// reductions and warp shuffles run as written, with no OS thread per CUDA thread. Sanitizer
// builds (HARNESS_OS_THREADS) run a block's threads as real threads meeting at a barrier,
// which ThreadSanitizer can see race. __shared__ arrays become function statics (blocks never
// overlap, and the launcher runs one grid at a time).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
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

#if defined(__x86_64__) && !defined(HARNESS_OS_THREADS)
#define HARNESS_FIBERS 1
#endif

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

#ifdef HARNESS_FIBERS
inline void infer_host_yield();
inline void __syncthreads() { infer_host_yield(); }
#else
inline void __syncthreads() { infer_host_barrier->arrive_and_wait(); }
#endif
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

#ifdef HARNESS_FIBERS
// Switches stacks (System V x86-64): pushes the callee-saved registers, stores the stack
// pointer in *save, loads `load` and pops the registers saved there. Every unit defines it
// weakly; the linker keeps one.
extern "C" void infer_host_switch(void** save, void* load) __attribute__((visibility("hidden")));
asm(".pushsection .text\n"
    ".weak infer_host_switch\n"
    ".hidden infer_host_switch\n"
    ".type infer_host_switch, @function\n"
    "infer_host_switch:\n"
    "    pushq %rbp\n    pushq %rbx\n    pushq %r12\n    pushq %r13\n    pushq %r14\n    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n    popq %r14\n    popq %r13\n    popq %r12\n    popq %rbx\n    popq %rbp\n"
    "    ret\n"
    ".size infer_host_switch, .-infer_host_switch\n"
    ".popsection\n");

// One CUDA thread of the block running: its saved stack pointer, whether it has ended, its
// index and its shuffle parity.
struct InferHostFiber {
    void* sp;
    bool done;
    unsigned int parity;
    uint3 index;
};

// The block running on this thread: its fibers, the launcher's saved stack pointer, the
// fiber running, how many have not ended, and the kernel's body.
struct InferHostBlock {
    std::vector<InferHostFiber> fibers;
    void* launcher_sp;
    unsigned int current;
    unsigned int remaining;
    const std::function<void()>* body;
};
inline thread_local InferHostBlock* infer_host_block;

// Bytes of stack per fiber (the kernels' frames are a few KiB; untouched pages cost nothing).
constexpr size_t INFER_HOST_STACK = 128 * 1024;

// Leaves the running fiber (at a barrier, or ended) for the next one in turn that has not
// ended, or for the launcher once every fiber has ended. An ended thread no longer counts at
// barriers, as on a GPU.
inline void infer_host_yield() {
    InferHostBlock& b = *infer_host_block;
    InferHostFiber& me = b.fibers[b.current];
    me.parity = infer_host_shuffle_parity;
    if (b.remaining == 0) {
        infer_host_switch(&me.sp, b.launcher_sp);
        return;
    }
    const unsigned int n = (unsigned int)b.fibers.size();
    unsigned int next = b.current;
    do {
        next = (next + 1) % n;
    } while (b.fibers[next].done);
    if (next == b.current) return;
    b.current = next;
    threadIdx = b.fibers[next].index;
    infer_host_shuffle_parity = b.fibers[next].parity;
    infer_host_switch(&me.sp, b.fibers[next].sp);
}

// Where every fiber starts: runs the body, ends, and leaves (never to be resumed).
[[noreturn]] inline void infer_host_fiber_main() {
    InferHostBlock& b = *infer_host_block;
    (*b.body)();
    b.fibers[b.current].done = true;
    b.remaining--;
    infer_host_yield();
    __builtin_unreachable();
}

// Runs `body` as grid × block threads: each block's threads as fibers on this thread.
inline void infer_host_run(const unsigned int* grid, const unsigned int* block,
                           const std::function<void()>& body) {
    const unsigned int threads = block[0] * block[1] * block[2];
    // The stacks stay allocated for the next launch on this thread.
    static thread_local std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() < threads) stacks.emplace_back(new char[INFER_HOST_STACK]);
    InferHostBlock b;
    b.fibers.resize(threads);
    b.body = &body;
    InferHostBlock* outer = infer_host_block;
    infer_host_block = &b;
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};
    for (unsigned int bz = 0; bz < grid[2]; bz++)
        for (unsigned int by = 0; by < grid[1]; by++)
            for (unsigned int bx = 0; bx < grid[0]; bx++) {
                blockIdx = {bx, by, bz};
                for (unsigned int t = 0; t < threads; t++) {
                    // A new stack: six zeroed registers, then the fiber's entry as the
                    // return address; 16-byte aligned so that the entry sees the stack as
                    // after a call.
                    uintptr_t top = ((uintptr_t)stacks[t].get() + INFER_HOST_STACK) & ~(uintptr_t)15;
                    void** sp = (void**)(top - 64);
                    for (int r = 0; r < 6; r++) sp[r] = nullptr;
                    sp[6] = (void*)&infer_host_fiber_main;
                    sp[7] = nullptr;
                    b.fibers[t] = {sp, false, 0,
                                   {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])}};
                }
                b.remaining = threads;
                b.current = 0;
                threadIdx = b.fibers[0].index;
                infer_host_shuffle_parity = 0;
                infer_host_switch(&b.launcher_sp, b.fibers[0].sp);
            }
    infer_host_block = outer;
}
#else
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

#endif

// A pointer argument that converts to whatever pointer type the kernel declares.
struct InferHostPtr {
    void* p;
    template <class T>
    operator T*() const {
        return static_cast<T*>(p);
    }
};

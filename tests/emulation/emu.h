#pragma once
// A small CUDA emulator for testing the CUDA kernels on a machine without a GPU.
//
// The kernel sources (csrc/cuda/kernels/*.cu) are compiled as host C++ after a textual
// translation (tests/emulation/translate.py): launches become emu::launch, dynamic shared
// memory becomes emu::dynamic_shared(), static __shared__ variables become function statics
// and the mma.sync inline assembly becomes emu::mma_16x8x16. Blocks run one after another;
// the threads of a block run as cooperative fibers on one OS thread, so __syncthreads and
// the warp shuffles are real rendezvous points: a thread that skips a barrier its block
// waits on is reported as a deadlock instead of hanging. Shared memory starts filled with
// NaN bytes each block, so a read before a write shows up in the results.
//
// Emulated semantics: __syncthreads, __shfl_sync, __shfl_xor_sync, atomicAdd, the
// m16n8k16 fp16/bf16 MMA with its PTX fragment layout, and the few device intrinsics the
// kernels use. Not emulated: timing, memory coalescing, bank conflicts, warp divergence
// costs, and races between blocks (blocks never overlap here).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// The built-in index variables: set by the scheduler before each switch to a thread.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace emu {

struct Config {
  dim3 grid;
  dim3 block;
  size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
};

class Block {
 public:
  static Block& current() {
    static Block block;
    return block;
  }

  // Runs body once per thread of one block, as fibers.
  void run(unsigned threads, const std::function<void()>& body) {
    threads_ = threads;
    fibers_.assign(threads, Fiber{});
    warp_slots_.assign((threads + 31) / 32 * 32, 0);
    warp_staging_.assign((threads + 31) / 32 * 32 * 10, 0);
    block_barrier_ = Barrier{};
    warp_barriers_.assign((threads + 31) / 32, Barrier{});
    body_ = &body;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& fiber = fibers_[t];
      fiber.stack.resize(kStackBytes);
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber.stack.data();
      fiber.context.uc_stack.ss_size = fiber.stack.size();
      fiber.context.uc_link = &scheduler_;
      makecontext(&fiber.context, reinterpret_cast<void (*)()>(&Block::fiber_entry), 0);
    }
    unsigned live = threads;
    while (live > 0) {
      const uint64_t progress_before = progress_;
      live = 0;
      for (unsigned t = 0; t < threads; ++t) {
        Fiber& fiber = fibers_[t];
        if (fiber.done) continue;
        current_ = t;
        threadIdx = make_uint3(t, 0, 0);
        swapcontext(&scheduler_, &fiber.context);
        if (error_) {
          const std::string message = *error_;
          error_.reset();
          throw std::runtime_error(message);
        }
        if (!fiber.done) ++live;
      }
      if (live > 0 && progress_ == progress_before) {
        throw std::runtime_error(
            "emu: deadlock: every live thread waits at a barrier or shuffle that not all "
            "threads of its block/warp reach");
      }
    }
  }

  // Called by the running thread: waits until every thread of the block arrived.
  void sync_block() { wait(block_barrier_, threads_); }

  // Called by a lane: waits until every lane of its warp arrived.
  void sync_warp() {
    const unsigned warp = current_ / 32;
    const unsigned lanes = std::min(32u, threads_ - warp * 32);
    wait(warp_barriers_[warp], lanes);
  }

  uint64_t& warp_slot(unsigned lane) { return warp_slots_[current_ / 32 * 32 + lane]; }
  uint32_t* staging(unsigned lane) { return &warp_staging_[(current_ / 32 * 32 + lane) * 10]; }

 private:
  static constexpr size_t kStackBytes = 256 * 1024;
  struct Fiber {
    ucontext_t context{};
    std::vector<char> stack;
    bool done = false;
  };
  struct Barrier {
    unsigned arrived = 0;
    uint64_t generation = 0;
  };

  static void fiber_entry() {
    Block& block = current();
    try {
      (*block.body_)();
    } catch (const std::exception& error) {
      block.error_ = std::make_unique<std::string>(error.what());
    }
    block.fibers_[block.current_].done = true;
    ++block.progress_;
  }

  void yield() { swapcontext(&fibers_[current_].context, &scheduler_); }

  void wait(Barrier& barrier, unsigned participants) {
    const uint64_t generation = barrier.generation;
    if (++barrier.arrived == participants) {
      barrier.arrived = 0;
      ++barrier.generation;
      ++progress_;
      return;
    }
    while (barrier.generation == generation) yield();
  }

  unsigned threads_ = 0;
  unsigned current_ = 0;
  uint64_t progress_ = 0;
  std::vector<Fiber> fibers_;
  std::vector<uint64_t> warp_slots_;
  std::vector<uint32_t> warp_staging_;
  Barrier block_barrier_;
  std::vector<Barrier> warp_barriers_;
  const std::function<void()>* body_ = nullptr;
  ucontext_t scheduler_{};
  std::unique_ptr<std::string> error_;
};

inline std::vector<unsigned char>& shared_memory() {
  static std::vector<unsigned char> memory;
  return memory;
}

inline unsigned char* dynamic_shared() { return shared_memory().data(); }

template <typename Kernel, typename... Args>
void launch(Kernel kernel, const Config& config, Args... args) {
  if (config.block.y != 1 || config.block.z != 1) throw std::runtime_error("emu: 1-D blocks only");
  if (config.grid.x == 0 || config.grid.y == 0 || config.grid.z == 0) {
    throw std::runtime_error("emu: empty grid (a CUDA launch error)");
  }
  gridDim = config.grid;
  blockDim = config.block;
  const std::function<void()> body = [&] { kernel(args...); };
  for (unsigned z = 0; z < config.grid.z; ++z) {
    for (unsigned y = 0; y < config.grid.y; ++y) {
      for (unsigned x = 0; x < config.grid.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        // NaN bytes: a read of shared memory nobody wrote poisons the result.
        shared_memory().assign(std::max<size_t>(config.shared_bytes, 1), 0xFF);
        Block::current().run(config.block.x, body);
      }
    }
  }
}

template <typename T>
T shuffle(T value, unsigned source_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "emu: shuffles move up to 8 bytes");
  Block& block = Block::current();
  const unsigned lane = threadIdx.x % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  block.warp_slot(lane) = bits;
  block.sync_warp();
  bits = block.warp_slot(source_lane % 32);
  block.sync_warp();  // every lane has read before any slot is written again
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

template <typename T>
float widen_16(T value) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(value);
  } else {
    return __bfloat162float(value);
  }
}

// D = A B + C for one warp, with the fragment layout of PTX's mma.m16n8k16 (lane = 4 g + t):
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..].
template <typename T>
void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  Block& block = Block::current();
  const unsigned lane = threadIdx.x % 32;
  uint32_t* mine = block.staging(lane);
  std::memcpy(mine, a, sizeof(a));
  std::memcpy(mine + 4, b, sizeof(b));
  block.sync_warp();
  auto element = [](uint32_t reg, int half) {
    const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xFFFF);
    T value;
    std::memcpy(&value, &bits, sizeof(bits));
    return widen_16(value);
  };
  float A[16][16], B[16][8];
  for (unsigned source = 0; source < 32; ++source) {
    const uint32_t* frag = block.staging(source);
    const unsigned g = source / 4, t = source % 4;
    for (int half = 0; half < 2; ++half) {
      A[g][2 * t + half] = element(frag[0], half);
      A[g + 8][2 * t + half] = element(frag[1], half);
      A[g][2 * t + 8 + half] = element(frag[2], half);
      A[g + 8][2 * t + 8 + half] = element(frag[3], half);
      B[2 * t + half][g] = element(frag[4], half);
      B[2 * t + 8 + half][g] = element(frag[5], half);
    }
  }
  block.sync_warp();  // every lane has read the staging before it is reused
  const unsigned g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const unsigned row = g + 8 * (e / 2), col = 2 * t + (e & 1);
    float sum = c[e];
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    c[e] = sum;
  }
}

}  // namespace emu

inline void __syncthreads() { emu::Block::current().sync_block(); }

template <typename T>
T __shfl_sync(unsigned, T value, int source_lane) {
  return emu::shuffle(value, static_cast<unsigned>(source_lane));
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return emu::shuffle(value, (threadIdx.x % 32) ^ static_cast<unsigned>(lane_mask));
}

template <typename T>
T atomicAdd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}

inline float __expf(float x) { return std::exp(x); }

// Device code calls min/max unqualified on integers; declared where the kernels live, so
// nothing else sees them.
namespace mha_ext::cuda {
template <typename T>
T min(T a, T b) {
  return a < b ? a : b;
}

template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
}
}  // namespace mha_ext::cuda

// The runtime calls of the launchers, renamed so they never bind to a real libcudart that
// torch has loaded into the process.
namespace emu {
inline cudaError_t get_last_error() { return cudaSuccess; }
inline const char* get_error_string(cudaError_t) { return "emulated CUDA error"; }
template <typename Kernel>
cudaError_t func_set_attribute(Kernel, cudaFuncAttribute, int) {
  return cudaSuccess;
}
}  // namespace emu
#define cudaGetLastError emu::get_last_error
#define cudaGetErrorString emu::get_error_string
#define cudaFuncSetAttribute emu::func_set_attribute

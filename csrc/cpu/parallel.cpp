#include "cpu/parallel.h"

#include <dirent.h>
#include <pthread.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace mha_ext::cpu {
namespace {

std::atomic<bool> parent_had_threads{false};
std::atomic<bool> serial_after_fork{false};

// The threads of this process, from /proc/self/task (one entry per thread, plus . and ..).
int count_threads() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return 2;  // unknown: assume a pool may exist
  int entries = 0;
  while (readdir(tasks) != nullptr) ++entries;
  closedir(tasks);
  return entries - 2;
}

// Runs in the parent just before fork(): the parent still has all its threads.
void before_fork() { parent_had_threads.store(count_threads() > 1); }

// Runs in the child, which has only the forking thread: only async-signal-safe work here.
void in_forked_child() {
  if (parent_had_threads.load()) serial_after_fork.store(true);
}

const bool fork_handlers_registered = [] {
  return pthread_atfork(before_fork, nullptr, in_forked_child) == 0;
}();

}  // namespace

bool loops_serial_after_fork() { return serial_after_fork.load(std::memory_order_relaxed); }

namespace {

constexpr uint64_t pack_bounds(uint64_t next, uint64_t end) { return end << 32 | next; }

}  // namespace

TaskShares::TaskShares(int64_t count, int64_t workers)
    : workers_(workers), shares_(new Share[workers]) {
  TORCH_CHECK(count < (int64_t(1) << 32), "mha_ext: a parallel loop of ", count,
              " tasks; at most 2^32 - 1 are supported");
  const int64_t per_worker = (count + workers - 1) / workers;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t first = std::min(count, w * per_worker);
    const int64_t last = std::min(count, first + per_worker);
    shares_[w].bounds.store(pack_bounds(first, last), std::memory_order_relaxed);
  }
}

int64_t TaskShares::claim(int64_t worker) {
  for (int64_t offset = 0; offset < workers_; ++offset) {
    std::atomic<uint64_t>& bounds = shares_[(worker + offset) % workers_].bounds;
    const bool own = offset == 0;
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t next = seen & 0xFFFFFFFFu, end = seen >> 32;
      if (next >= end) break;
      const uint64_t taken = own ? next : end - 1;
      const uint64_t left = own ? pack_bounds(next + 1, end) : pack_bounds(next, end - 1);
      if (bounds.compare_exchange_weak(seen, left, std::memory_order_relaxed)) {
        return static_cast<int64_t>(taken);
      }
    }
  }
  return -1;
}

}  // namespace mha_ext::cpu

// parallel_tasks (csrc/cpu/parallel.h), the loop the attention kernels share their tasks by:
// every task runs exactly once at any thread count and inside an outer parallel region, and
// a worker that starts late finds its share taken by the others. Exits 1 on a failure; a
// worker that waits forever for a steal that never comes is caught by ctest's timeout.
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>

#include "cpu/parallel.h"

namespace {

using mha_ext::cpu::ClaimedTasks;
using mha_ext::cpu::parallel_tasks;

// Runs of each task of one parallel_tasks(count) call.
class RunCounts {
 public:
  explicit RunCounts(int64_t count) : count_(count), runs_(new std::atomic<int>[count]) {
    for (int64_t task = 0; task < count; ++task) runs_[task].store(0);
  }
  void ran(int64_t task) { runs_[task].fetch_add(1); }
  // Prints the first task that did not run exactly once.
  bool each_once(const char* what) const {
    for (int64_t task = 0; task < count_; ++task) {
      const int runs = runs_[task].load();
      if (runs != 1) {
        std::printf("%s: task %ld of %ld ran %d times\n", what, static_cast<long>(task),
                    static_cast<long>(count_), runs);
        return false;
      }
    }
    return true;
  }

 private:
  int64_t count_;
  std::unique_ptr<std::atomic<int>[]> runs_;
};

bool check_counts(int threads) {
  at::set_num_threads(threads);
  bool ok = true;
  for (int64_t count : {0, 1, 2, 3, 7, 64, 1000}) {
    RunCounts counts(count);
    parallel_tasks(count, [&](ClaimedTasks& tasks) {
      for (const int64_t task : tasks) counts.ran(task);
    });
    char what[64];
    std::snprintf(what, sizeof(what), "%d threads, %ld tasks", threads, static_cast<long>(count));
    ok &= counts.each_once(what);
  }
  return ok;
}

// Inside an outer region the loop runs on the calling thread, all of it.
bool check_nested() {
  at::set_num_threads(4);
  constexpr int64_t kCount = 50;
  bool ok = true;
  at::parallel_for(0, 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t outer = begin; outer < end; ++outer) {
      RunCounts counts(kCount);
      parallel_tasks(kCount, [&](ClaimedTasks& tasks) {
        for (const int64_t task : tasks) counts.ran(task);
      });
      if (!counts.each_once("inside at::parallel_for")) ok = false;
    }
  });
  return ok;
}

// Two threads; the thread of the second share claims nothing until the first has taken a
// task of the second share, which it does only once its own share is done. Both shares'
// tasks then run once each, and the first thread ran more than its own 32.
bool check_late_worker() {
  at::set_num_threads(2);
  constexpr int64_t kCount = 64, kShare = 32;
  RunCounts counts(kCount);
  std::atomic<bool> stolen{false};
  std::atomic<int64_t> first_thread_runs{0};
  bool two_threads = true;
  parallel_tasks(kCount, [&](ClaimedTasks& tasks) {
    if (at::get_num_threads() != 2) two_threads = false;
    const bool late = at::get_thread_num() == 1;
    while (late && !stolen.load()) std::this_thread::yield();
    for (const int64_t task : tasks) {
      counts.ran(task);
      if (!late) {
        first_thread_runs.fetch_add(1);
        if (task >= kShare) stolen.store(true);
      }
    }
    // A thread with no partner (a one-thread team) must not wait for one.
    stolen.store(true);
  });
  bool ok = counts.each_once("a late worker");
  if (two_threads && first_thread_runs.load() <= kShare) {
    std::printf("a late worker: the first thread ran %ld tasks, no more than its share of %ld\n",
                static_cast<long>(first_thread_runs.load()), static_cast<long>(kShare));
    ok = false;
  }
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  for (int threads : {1, 2, 3, 4}) ok &= check_counts(threads);
  ok &= check_nested();
  ok &= check_late_worker();
  std::printf(ok ? "parallel_tasks: ok\n" : "parallel_tasks: FAILED\n");
  return ok ? 0 : 1;
}

#pragma once
// The CPU kernels' parallel loops: at::parallel_for, except in a process forked from one that
// had already started threads, where it runs the loop on the calling thread; and
// parallel_tasks, whose threads take each other's tasks when their own run out.
//
// libgomp keeps its worker threads between parallel regions; fork() copies its record of
// them into the child but not the threads, so the child's next region of more than one
// thread waits forever for them (torch's own ops hang there, also after the child calls
// torch.set_num_threads(2): measured with torch 2.14.1). Only a team of one thread is safe,
// which is why DataLoader workers set one thread. Our loops take that path by themselves.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace mha_ext::cpu {

// True in a child of fork() whose parent had more than one thread (so possibly a libgomp
// pool) when it forked. A child of a single-threaded parent starts libgomp afresh.
bool loops_serial_after_fork();

// at::parallel_for(begin, end, grain, f), serial where loops_serial_after_fork(). The task
// split is planned from at::get_num_threads() either way, so a forked child computes
// bitwise what its parent does.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  // A grain of the whole range makes at::parallel_for call f once on this thread, with the
  // same thread-id and nesting guards as its own serial path.
  const int64_t serial_grain = std::max(grain, end - begin);
  at::parallel_for(begin, end, loops_serial_after_fork() ? serial_grain : grain, f);
}

// The tasks [0, count) of one parallel loop, shared by `workers` workers: worker w starts on
// its own contiguous share (at::parallel_for's static split) and, when that runs out, takes
// what is left of the others' shares from their far end. A worker that starts late (an idle
// pool thread woken by the loop, or a thread another process holds on its core) then delays
// the loop by at most the task it runs, where a static split waits for its whole share.
class TaskShares {
 public:
  TaskShares(int64_t count, int64_t workers);
  // Worker w's next task: the next of its own share, else the last left in another's; -1
  // when every task is taken.
  int64_t claim(int64_t worker);

 private:
  // next task (low 32 bits) and end (high 32 bits) of one share, changed together
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds;
  };
  int64_t workers_;
  std::unique_ptr<Share[]> shares_;  // [workers_]
};

// The tasks one worker runs, claimed one at a time as the loop over them advances:
// for (const int64_t task : tasks) {...}
class ClaimedTasks {
 public:
  ClaimedTasks(TaskShares& shares, int64_t worker) : shares_(shares), worker_(worker) {}

  struct End {};
  class Iterator {
   public:
    Iterator(ClaimedTasks& owner, int64_t task) : owner_(owner), task_(task) {}
    int64_t operator*() const { return task_; }
    Iterator& operator++() {
      task_ = owner_.shares_.claim(owner_.worker_);
      return *this;
    }
    bool operator!=(End) const { return task_ >= 0; }

   private:
    ClaimedTasks& owner_;
    int64_t task_;
  };
  Iterator begin() { return Iterator(*this, shares_.claim(worker_)); }
  End end() const { return {}; }

 private:
  TaskShares& shares_;
  int64_t worker_;
};

// Runs tasks [0, count) on the threads of one parallel region, f(ClaimedTasks&) once per
// thread (its per-thread setup first, then a loop over the tasks it claims). For tasks whose
// results do not depend on the thread that runs them, nor on which tasks ran before on it:
// which thread runs a task changes from call to call.
template <typename F>
void parallel_tasks(int64_t count, const F& f) {
  if (count <= 0) return;
  const bool one_thread = loops_serial_after_fork() || at::in_parallel_region();
  const int64_t workers = one_thread ? 1 : std::min<int64_t>(at::get_num_threads(), count);
  TaskShares shares(count, workers);
  parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      ClaimedTasks tasks(shares, worker);
      f(tasks);
    }
  });
}

}  // namespace mha_ext::cpu

#pragma once
// The CPU kernels' parallel loop: at::parallel_for, except in a process forked from one that
// had already started threads, where it runs the loop on the calling thread.
//
// libgomp keeps its worker threads between parallel regions; fork() copies its record of
// them into the child but not the threads, so the child's next region of more than one
// thread waits forever for them (torch's own ops hang there, also after the child calls
// torch.set_num_threads(2): measured with torch 2.14.1). Only a team of one thread is safe,
// which is why DataLoader workers set one thread. Our loops take that path by themselves.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace mha_ext::cpu

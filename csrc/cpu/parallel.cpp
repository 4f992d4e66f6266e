#include "cpu/parallel.h"

#include <dirent.h>
#include <pthread.h>

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

}  // namespace mha_ext::cpu

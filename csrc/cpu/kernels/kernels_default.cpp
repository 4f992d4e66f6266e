// Portable build of the CPU kernels: at::vec falls back to plain C++ loops, so this runs on
// any CPU. Like every build it keeps its own code in its namespace (CPU_CAPABILITY), and the
// code the builds share is compiled for the baseline CPU in each (baseline_headers.h), so it
// does not matter which build's copy of a shared function the linker keeps.
#define CPU_CAPABILITY DEFAULT
#include "append_kernel.h"
#include "attention_kernel.h"
#include "paged_kernel.h"

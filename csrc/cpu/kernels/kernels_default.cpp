// Portable build of the CPU kernels: at::vec falls back to plain C++ loops, so
// this runs on any CPU. Listed first among the kernel sources in setup.py and
// CMakeLists.txt: where an inline function from a shared header is emitted by several ISA
// translation units, the linker keeps the first copy, and this one runs everywhere.
#define CPU_CAPABILITY DEFAULT
#include "attention_kernel.h"
#include "paged_kernel.h"

#pragma once
// Run-time choice among the CPU kernel builds (see kernels/kernels.h), as ATen
// does: the best ISA this CPU supports, or the one named by MHA_EXT_CPU_ISA
// (generic | avx2 | avx512), so that tests can force the portable build on any machine.
#include <string>
#include <vector>

namespace mha_ext::cpu {

enum class CpuIsa { kGeneric, kAvx2, kAvx512 };

// Name used by MHA_EXT_CPU_ISA and build_info(): "generic", "avx2" or "avx512".
const char* cpu_isa_name(CpuIsa isa);

// The ISA builds compiled into this library, portable first.
std::vector<CpuIsa> compiled_cpu_isas();

// Chosen on first use and fixed for the life of the process. Throws std::runtime_error
// when MHA_EXT_CPU_ISA names an unknown ISA or one this CPU lacks.
CpuIsa active_cpu_isa();

}  // namespace mha_ext::cpu

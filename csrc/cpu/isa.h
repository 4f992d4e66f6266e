#pragma once
// Run-time choice among the CPU code paths (see kernels/kernels.h), as ATen does: the best
// ISA this CPU supports, or the one named by MHA_EXT_CPU_ISA (generic | avx2 | avx512 |
// avx512_vnni | avx512_bf16 | avx512_amx), so that tests can force every path this CPU can run.
#include <string>
#include <vector>

namespace mha_ext::cpu {

// The first three ISAs are kernel builds of their own; the AVX-512 build runs at four levels.
// kAvx512Vnni is that build with its AVX512-VNNI path enabled (paged decode's int16 dot
// products over an int8 cache, PagedKernelTraits::kInt16Dots): Cascade Lake and Ice Lake
// Xeons, which have VNNI but not BF16. kAvx512Bf16 adds its AVX512-BF16 paths (the bf16
// attention on brgemm, the bf16 dot products of paged decode). Both are run-time levels of
// that build rather than builds of their own, because those paths already carry their own
// target("avx512bf16") attributes (or assembly) and differ from the rest of the build only by
// the check that selects them. A build of their own would compile
// kernels_avx512.cpp, the largest kernel build (24 s of the three builds' 61 s at -O3 on one
// Xeon core), a second time for code that differs only in that check. kAvx512Amx is the
// kAvx512Bf16 level on the CPU class with AMX tiles (Intel Xeon since Sapphire Rapids), whose
// kernels choose for that class where it differs from the other AVX512-BF16 CPUs (AMD Zen 4
// and 5): there VDPBF16PS runs at a quarter of the FMA's instruction rate, so paged decode
// scores a bf16 cache with FMAs (PagedKernelTraits::kScoreByBf16Dots).
enum class CpuIsa { kGeneric, kAvx2, kAvx512, kAvx512Vnni, kAvx512Bf16, kAvx512Amx };

// Name used by MHA_EXT_CPU_ISA and build_info(): "generic", "avx2", "avx512", "avx512_vnni",
// "avx512_bf16" or "avx512_amx".
const char* cpu_isa_name(CpuIsa isa);

// The ISAs this library can run, each level after the ones it extends, portable first.
std::vector<CpuIsa> compiled_cpu_isas();

// Whether the CPU reports AMX-BF16 and AMX-TILE (cpuid leaf 7), whatever Linux grants the
// process: the avx512_amx level's class, and the first condition of the AMX peak probe.
bool cpu_has_amx_bf16();

// Whether the AVX-512 build may run its AVX512-VBMI paths (byte permutes across a whole
// register, as assembly): from the avx512_vnni level on, where the CPU reports VBMI (Ice Lake
// and later Xeons, AMD Zen 4 and 5; not Skylake-SP, Cascade Lake or Cooper Lake) and
// MHA_EXT_CPU_VBMI is not 0, which tests set to run the paths of the CPUs without it. Not a
// level of its own, as Cooper Lake has AVX512-BF16 without VBMI. Fixed at first use; throws
// std::runtime_error where MHA_EXT_CPU_VBMI is neither 0 nor 1 (or MHA_EXT_CPU_ISA is bad).
bool avx512_vbmi_enabled();

// Chosen on first use and fixed for the life of the process. Throws std::runtime_error
// when MHA_EXT_CPU_ISA names an unknown ISA or one this CPU lacks.
CpuIsa active_cpu_isa();

}  // namespace mha_ext::cpu

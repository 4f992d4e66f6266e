#include "cpu/isa.h"

#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace mha_ext::cpu {
namespace {

bool cpu_supports(CpuIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case CpuIsa::kGeneric: return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi2");
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi2");
    case CpuIsa::kAvx512Vnni:
      return cpu_supports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512vnni");
    case CpuIsa::kAvx512Bf16:
      // On top of the VNNI level's int16 dot products: every CPU with AVX512-BF16 has VNNI.
      return cpu_supports(CpuIsa::kAvx512Vnni) && __builtin_cpu_supports("avx512bf16");
    case CpuIsa::kAvx512Amx:
      // The class, not Linux's permission to use the tiles: the kernels run no AMX
      // instruction of their own.
      return cpu_supports(CpuIsa::kAvx512Bf16) && cpu_has_amx_bf16();
  }
  return false;
#else
  return isa == CpuIsa::kGeneric;
#endif
}

CpuIsa choose_cpu_isa() {
  const std::vector<CpuIsa> compiled = compiled_cpu_isas();
  const char* forced = std::getenv("MHA_EXT_CPU_ISA");
  if (forced == nullptr || *forced == '\0') {
    CpuIsa best = CpuIsa::kGeneric;
    for (CpuIsa isa : compiled) {
      if (cpu_supports(isa)) best = isa;
    }
    return best;
  }
  std::string known;
  for (CpuIsa isa : compiled) {
    if (std::string(forced) != cpu_isa_name(isa)) {
      known += known.empty() ? "" : ", ";
      known += cpu_isa_name(isa);
      continue;
    }
    if (!cpu_supports(isa)) {
      throw std::runtime_error(std::string("mha_ext: MHA_EXT_CPU_ISA=") + forced +
                               " but this CPU does not support " + forced);
    }
    return isa;
  }
  throw std::runtime_error(std::string("mha_ext: MHA_EXT_CPU_ISA=") + forced +
                           " is not one of the compiled ISAs (" + known + ")");
}

}  // namespace

bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  return amx_bf16 && amx_tile;
#else
  return false;
#endif
}

bool avx512_vbmi_enabled() {
  static const bool enabled = [] {
    const char* variable = std::getenv("MHA_EXT_CPU_VBMI");
    const std::string setting = variable == nullptr ? "" : variable;
    if (!setting.empty() && setting != "0" && setting != "1") {
      throw std::runtime_error("mha_ext: MHA_EXT_CPU_VBMI=" + setting + " is neither 0 nor 1");
    }
#if defined(__x86_64__)
    return setting != "0" && active_cpu_isa() >= CpuIsa::kAvx512Vnni &&
           __builtin_cpu_supports("avx512vbmi");
#else
    return false;
#endif
  }();
  return enabled;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Vnni: return "avx512_vnni";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAvx512Amx: return "avx512_amx";
  }
  return "unknown";
}

std::vector<CpuIsa> compiled_cpu_isas() {
#if defined(__x86_64__)
  return {CpuIsa::kGeneric,    CpuIsa::kAvx2,       CpuIsa::kAvx512,
          CpuIsa::kAvx512Vnni, CpuIsa::kAvx512Bf16, CpuIsa::kAvx512Amx};
#else
  return {CpuIsa::kGeneric};
#endif
}

CpuIsa active_cpu_isa() {
  static const CpuIsa isa = choose_cpu_isa();
  return isa;
}

}  // namespace mha_ext::cpu

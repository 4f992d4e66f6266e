#pragma once
// Peak arithmetic of this CPU, measured: instruction-throughput loops (each keeps enough
// independent accumulators in registers that the instruction's throughput, not its latency,
// bounds it) run on every thread at once. They are the roofline of mha_ext.bench (a kernel's
// "% of peak") and of benchmarks/cpp/vector_peak: a rate the CPU really reached, so a kernel
// cannot beat it by construction, as it could beat torch's matmul.
#include <cstdint>
#include <string>
#include <vector>

namespace mha_ext::cpu {

enum class PeakProbeKind {
  kFp32Portable,   // acc = acc * x + y on a float array, vectorised by the compiler for the
                   // baseline CPU (SSE2 on x86-64): what code without an ISA build reaches
  kFp32FmaAvx2,    // VFMADD231PS on 256-bit registers
  kFp32FmaAvx512,  // VFMADD231PS on 512-bit registers
  kBf16DotAvx512,  // VDPBF16PS: bf16 pairs multiplied and summed into fp32 (AVX512-BF16)
  kBf16Amx,        // TDPBF16PS: 16x16 fp32 tiles += 16x32 bf16 by 32x16 bf16 (AMX)
};

// "fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512", "bf16_amx".
const char* peak_probe_name(PeakProbeKind kind);

// The kind of that name; throws std::invalid_argument naming the known kinds.
PeakProbeKind peak_probe_kind(const std::string& name);

// The kinds this process may run, portable first: those whose instructions the active CPU
// ISA (cpu/isa.h, so MHA_EXT_CPU_ISA too) includes, bf16_dot_avx512 only from avx512_bf16 on,
// and bf16_amx where also the CPU has AMX-BF16 and Linux lets this process use the tiles.
std::vector<PeakProbeKind> available_peak_probes();

// FLOPs one thread does per iteration of the kind's loop (a multiply-add counts 2).
double peak_probe_flops_per_iteration(PeakProbeKind kind);

struct PeakProbeResult {
  int64_t threads = 0;         // loops run, one per thread of at::get_num_threads()
  int64_t iterations = 0;      // of each thread's loop
  double slowest_seconds = 0;  // the longest time a thread took for its share
  double flops = 0;            // all threads' FLOPs
  double gflops() const { return flops / slowest_seconds / 1e9; }
};

// Runs the kind's loop for `iterations` on each of at::get_num_threads() threads at once
// (mha_ext's parallel_for) and times each thread's share: the rate is all threads' FLOPs over
// the slowest share, so a thread that ran alone for a while cannot inflate it. Throws
// std::invalid_argument for iterations < 1 or a kind available_peak_probes() leaves out.
PeakProbeResult run_peak_probe(PeakProbeKind kind, int64_t iterations);

}  // namespace mha_ext::cpu

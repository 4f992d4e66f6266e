#pragma once
// Every header the kernel builds include whose code is not compiled per ISA: the standard
// library, torch outside at::vec, and the host code the kernels share with the backend. Each
// kernels_<isa>.cpp includes this before it enables its instructions, so that the inline
// functions defined here are compiled for the baseline CPU in every build. Unlike at::vec's
// code and ours, they cannot move into the build's namespace (CPU_CAPABILITY), and a build
// may emit an out-of-line copy of one (std::copy, at::parallel_for's helpers, c10::Half's
// conversions): the linker keeps one copy for every caller, the portable build's included,
// so that copy must run on any CPU. Inlined into a kernel, they are compiled with its
// instructions all the same. Templates that at::vec instantiates on raw vectors
// (std::make_tuple of two __m512) therefore exist only inlined: an out-of-line copy for the
// baseline CPU does not compile (GCC 12 stops with an internal error), so none can be
// shared either. tests/test_isa.py checks what each build leaves to the linker.
#include <algorithm>
#include <array>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>  // brgemm, which only the AVX-512 build calls

// What at::vec includes from outside at::vec (torch 2.14). c10/util/Half.h matters most:
// included after CPU_CAPABILITY_AVX2 / _AVX512 are defined, it defines c10::Half's
// conversions with F16C / AVX-512 instructions.
#include <ATen/NumericUtils.h>
#include <ATen/native/Math.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>  // the paged kernels' float8_e4m3fn caches
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>
#include <c10/util/qint32.h>
#include <c10/util/qint8.h>
#include <c10/util/quint8.h>

#include "blocking.h"
#include "cpu/isa.h"

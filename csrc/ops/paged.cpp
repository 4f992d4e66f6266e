// Registers the paged KV-cache ops (ops/paged.h) for the CPU and CUDA backends.
#include "ops/paged.h"

#include <torch/library.h>

#include "cpu/backend.h"
#if defined(MHA_EXT_WITH_CUDA)
#include "cuda/backend.h"
#include "cuda/on_device.h"
#endif

namespace mha_ext {

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("paged_kv_append", &paged_kv_append<cpu::Backend>);
  m.impl("paged_attention", &paged_attention<cpu::Backend>);
}

#if defined(MHA_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("paged_kv_append", cuda::on_device<&paged_kv_append<cuda::Backend>>);
  m.impl("paged_attention", cuda::on_device<&paged_attention<cuda::Backend>>);
}
#endif

}  // namespace mha_ext

// Registers merge_attention_states (ops/merge.h) for the CPU and CUDA backends; its autograd
// formula is in mha_ext/ops.py.
#include "ops/merge.h"

#include <torch/library.h>

#include "cpu/backend.h"
#if defined(MHA_EXT_WITH_CUDA)
#include "cuda/backend.h"
#include "cuda/on_device.h"
#endif

namespace mha_ext {

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("merge_attention_states", &merge_attention_states<cpu::Backend>);
}

#if defined(MHA_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("merge_attention_states", cuda::on_device<&merge_attention_states<cuda::Backend>>);
}
#endif

}  // namespace mha_ext

// Python entry points of the emulated CUDA backend: the op functions of csrc/ops instantiated
// with the CUDA backend (cuda/backend.cpp) and run on CPU tensors, the kernels compiled for
// the emulator (emu.h). Here the "device" is the host: the stream is the default one and the
// multiprocessor count, which sizes paged attention's split-K plan, is what the test sets.
#include <torch/extension.h>

#include "cuda/backend.h"
#include "ops/attention.h"
#include "ops/merge.h"
#include "ops/paged.h"

namespace mha_ext::cuda {
namespace {
int emulated_multiprocessors = 1;
}  // namespace

cudaStream_t current_stream() { return nullptr; }

int multiprocessor_count() { return emulated_multiprocessors; }

}  // namespace mha_ext::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using mha_ext::cuda::Backend;
  m.def("attention_forward", &mha_ext::attention_forward<Backend>);
  m.def("attention_backward", &mha_ext::attention_backward<Backend>);
  m.def("dropout_mask", &mha_ext::dropout_mask<Backend>);
  m.def("paged_kv_append", &mha_ext::paged_kv_append<Backend>);
  m.def("paged_attention", &mha_ext::paged_attention<Backend>);
  m.def("merge_attention_states", &mha_ext::merge_attention_states<Backend>);
  m.def("set_multiprocessor_count",
        [](int count) { mha_ext::cuda::emulated_multiprocessors = count; });
}

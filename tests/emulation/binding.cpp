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
  // The 8-bit caches' scale arguments take the schema's defaults when left out.
  namespace py = pybind11;
  m.def("paged_kv_append", &mha_ext::paged_kv_append<Backend>, py::arg("key"), py::arg("value"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("paged_attention", &mha_ext::paged_attention<Backend>, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cu_seqlens_q"),
        py::arg("scale"), py::arg("window_left"), py::arg("softcap"), py::arg("alibi_slopes"),
        py::arg("sinks"), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("merge_attention_states", &mha_ext::merge_attention_states<Backend>);
  m.def("set_multiprocessor_count",
        [](int count) { mha_ext::cuda::emulated_multiprocessors = count; });
}

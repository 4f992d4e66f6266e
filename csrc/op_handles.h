// Typed dispatcher handles of the ops, for C++ callers (autograd.cpp, python_calls.cpp), each
// looked up once. A signature must match the one the kernels register for the op's schema in
// ops.cpp; typed() checks it when the handle is made.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace mha_ext {

using AttentionForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, double, int64_t, int64_t, bool);
using AttentionBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, double, int64_t, int64_t, bool);
using PagedKvAppendSignature = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                    const at::Tensor&);
using PagedAttentionSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&, double);

// The handle of op `name` ("mha_ext::<op>").
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline const c10::TypedOperatorHandle<AttentionForwardSignature>& attention_forward_op() {
  static const auto op = find_typed_op<AttentionForwardSignature>("mha_ext::attention_forward");
  return op;
}

inline const c10::TypedOperatorHandle<AttentionBackwardSignature>& attention_backward_op() {
  static const auto op = find_typed_op<AttentionBackwardSignature>("mha_ext::attention_backward");
  return op;
}

inline const c10::TypedOperatorHandle<PagedKvAppendSignature>& paged_kv_append_op() {
  static const auto op = find_typed_op<PagedKvAppendSignature>("mha_ext::paged_kv_append");
  return op;
}

inline const c10::TypedOperatorHandle<PagedAttentionSignature>& paged_attention_op() {
  static const auto op = find_typed_op<PagedAttentionSignature>("mha_ext::paged_attention");
  return op;
}

}  // namespace mha_ext

#pragma once
// The CUDA registration of an op function: on_device<&op<cuda::Backend>> runs the op with its
// first tensor argument's device current (every tensor of a valid call is on that device; the
// op's checks say so otherwise). Included only by the op files' CUDA registrations, which
// a CPU-only build and the emulator do not compile.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <type_traits>

namespace mha_ext::cuda {

template <typename First, typename... Rest>
at::Device first_tensor_device(const First& first, const Rest&... rest) {
  if constexpr (std::is_same_v<std::decay_t<First>, at::Tensor>) {
    return first.device();
  } else {
    static_assert(sizeof...(Rest) > 0, "an op without a tensor argument");
    return first_tensor_device(rest...);
  }
}

template <auto Op, typename Signature = std::remove_pointer_t<decltype(Op)>>
struct OnDevice;

template <auto Op, typename Result, typename... Args>
struct OnDevice<Op, Result(Args...)> {
  static Result call(Args... args) {
    const c10::cuda::CUDAGuard device_guard(first_tensor_device(args...));
    return Op(std::forward<Args>(args)...);
  }
};

template <auto Op>
constexpr auto on_device = &OnDevice<Op>::call;

}  // namespace mha_ext::cuda

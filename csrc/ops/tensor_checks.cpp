#include "ops/tensor_checks.h"

#include <c10/util/Exception.h>

namespace mha_ext {

std::string dtype_name(at::ScalarType dtype) {
  return "torch." + std::string(c10::getDtypeNames(dtype).first);
}

std::optional<DType> kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: return std::nullopt;
  }
}

DType to_dtype(at::ScalarType dtype, const char* op, const char* name) {
  const std::optional<DType> kernels_dtype = kernel_dtype(dtype);
  TORCH_CHECK(kernels_dtype.has_value(), op, name, " has dtype ", dtype_name(dtype),
              "; supported dtypes are torch.float32, torch.float64, torch.bfloat16 and "
              "torch.float16");
  return *kernels_dtype;
}

at::ScalarType accumulate_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

at::TensorOptions accumulate_options(const at::Tensor& like) {
  return like.options().dtype(accumulate_dtype(like.scalar_type()));
}

void check_rank(const char* op, const at::Tensor& t, const char* name, int64_t dim,
                const char* dims) {
  TORCH_CHECK(t.dim() == dim, op, name, " must be a ", dim, "-D tensor ", dims, ", got ", t.dim(),
              "-D with shape ", t.sizes());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1 || t.numel() == 0, op, name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

void check_same_dtype(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, a_name, " has dtype ",
              dtype_name(a.scalar_type()), " but ", b_name, " has ", dtype_name(b.scalar_type()));
  TORCH_CHECK(a.device() == b.device(), op, a_name, " is on ", a.device(), " but ", b_name,
              " is on ", b.device());
}

void check_index_tensor(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype,
                        const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, op, name, " must be ", dtype_name(dtype), ", got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == device, op, name, " is on ", t.device(), " but the cache is on ",
              device);
}

void check_per_head_values(const char* op, const at::Tensor& t, const char* name,
                           const at::Tensor& q, std::initializer_list<std::vector<int64_t>> shapes,
                           const char* shape_names) {
  const at::ScalarType dtype = accumulate_dtype(q.scalar_type());
  TORCH_CHECK(t.scalar_type() == dtype && t.device() == q.device(), op, name, " must be a ",
              dtype_name(dtype), " tensor on ", q.device(), " for ", dtype_name(q.scalar_type()),
              " q, got ", dtype_name(t.scalar_type()), " on ", t.device());
  bool shape_ok = false;
  for (const auto& shape : shapes) shape_ok = shape_ok || t.sizes() == at::IntArrayRef(shape);
  TORCH_CHECK(shape_ok, op, name, " must have shape ", shape_names, ", got ", t.sizes());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, name,
              " must be contiguous along the heads, got strides ", t.strides());
}

RowStrides row_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

TokenStrides token_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1)}; }

CacheStrides cache_strides(const at::Tensor& cache) {
  return {cache.stride(0), cache.stride(1), cache.stride(2)};
}

}  // namespace mha_ext

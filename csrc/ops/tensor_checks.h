#pragma once
// What every op file needs to validate tensors and fill a params struct: dtype names and
// mappings, rank / layout / device checks whose messages name the op and the argument, and the
// strides the params structs take.
#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "mha_ext/attention_params.h"
#include "mha_ext/paged_params.h"

namespace mha_ext {

// Largest head_dim (q/k) and head_dim_v (v) the kernels accept.
constexpr int64_t kMaxHeadDim = 256;

// "torch.float32", as a user writes the dtype.
std::string dtype_name(at::ScalarType dtype);

// The kernels' dtype for a tensor's dtype, nullopt for one they do not compute in.
std::optional<DType> kernel_dtype(at::ScalarType dtype);

// kernel_dtype where there is one; otherwise an error naming `op` (a message prefix such as
// "mha_ext.attention: ") and the argument.
DType to_dtype(at::ScalarType dtype, const char* op, const char* name);

// fp32 for every input dtype except fp64, which accumulates in fp64: the dtype of the
// logsumexp outputs and of the kernels' workspaces.
at::ScalarType accumulate_dtype(at::ScalarType dtype);

// `like`'s options with its accumulation dtype: for logsumexp outputs and workspaces.
at::TensorOptions accumulate_options(const at::Tensor& like);

// `t` has `dim` dims (named by `dims`, e.g. "[num_tokens, num_kv_heads, head_dim]") and a
// contiguous last dim. An empty tensor's strides are arbitrary (an empty gradient may come
// broadcast), so they are not checked.
void check_rank(const char* op, const at::Tensor& t, const char* name, int64_t dim,
                const char* dims);

// a and b share dtype and device.
void check_same_dtype(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name);

// An index tensor has `dtype` and lives on `device` (the cache's).
void check_index_tensor(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype,
                        const at::Device& device);

// A tensor of per-head values (ALiBi slopes, sink logits) in q's accumulation dtype (fp32, fp64
// for fp64 q), on q's device, of one of `shapes` (named by shape_names, e.g. "[heads] or
// [batch, heads]") and contiguous along its last dim (the heads).
void check_per_head_values(const char* op, const at::Tensor& t, const char* name,
                           const at::Tensor& q, std::initializer_list<std::vector<int64_t>> shapes,
                           const char* shape_names);

// Strides of dims 0..2 of a 4-D tensor whose last dim is contiguous.
RowStrides row_strides(const at::Tensor& t);

// Strides of dims 0..1 of a 3-D [tokens, heads, dim] tensor.
TokenStrides token_strides(const at::Tensor& t);

// Strides of dims 0..2 of a [num_blocks, num_kv_heads, block_size, dim] cache.
CacheStrides cache_strides(const at::Tensor& cache);

}  // namespace mha_ext

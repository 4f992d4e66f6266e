#include "paged_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "attention_checks.h"
#include "mha_ext/paged_cache.h"

namespace mha_ext {
namespace {

constexpr const char* kAppend = "mha_ext.paged_kv_append: ";
constexpr const char* kPaged = "mha_ext.paged_attention: ";
constexpr const char* kMerge = "mha_ext.merge_attention_states: ";

void check_rank(const char* op, const at::Tensor& t, const char* name, int64_t dim, const char* dims) {
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
  TORCH_CHECK(t.device() == device, op, name, " is on ", t.device(), " but the cache is on ", device);
}

CacheStrides cache_strides(const at::Tensor& cache) {
  return {cache.stride(0), cache.stride(1), cache.stride(2)};
}

TokenStrides token_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1)}; }

// The [num_blocks, num_kv_heads, block_size, dim] caches agree with each other.
void check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const char* dims = "[num_blocks, num_kv_heads, block_size, head_dim]";
  check_rank(op, k_cache, "k_cache", 4, dims);
  check_rank(op, v_cache, "v_cache", 4, dims);
  check_same_dtype(op, k_cache, "k_cache", v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), op,
              "k_cache and v_cache must agree in [num_blocks, num_kv_heads, block_size], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
}

}  // namespace

PagedAppendParams make_append_params(const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping) {
  const char* dims = "[num_tokens, num_kv_heads, head_dim]";
  check_rank(kAppend, key, "key", 3, dims);
  check_rank(kAppend, value, "value", 3, dims);
  check_caches(kAppend, k_cache, v_cache);
  check_same_dtype(kAppend, key, "key", k_cache, "k_cache");
  check_same_dtype(kAppend, value, "value", v_cache, "v_cache");
  TORCH_CHECK(slot_mapping.dim() == 1, kAppend, "slot_mapping must be 1-D [num_tokens], got shape ",
              slot_mapping.sizes());
  check_index_tensor(kAppend, slot_mapping, "slot_mapping", at::kLong, k_cache.device());
  TORCH_CHECK(value.size(0) == key.size(0) && slot_mapping.size(0) == key.size(0), kAppend,
              "key, value and slot_mapping must have one entry per token, got ", key.size(0),
              ", ", value.size(0), " and ", slot_mapping.size(0));
  TORCH_CHECK(key.size(1) == k_cache.size(1) && value.size(1) == k_cache.size(1), kAppend,
              "key and value have ", key.size(1), " and ", value.size(1),
              " kv heads but the cache has ", k_cache.size(1));
  TORCH_CHECK(key.size(2) == k_cache.size(3), kAppend, "key has head_dim ", key.size(2),
              " but k_cache has ", k_cache.size(3));
  TORCH_CHECK(value.size(2) == v_cache.size(3), kAppend, "value has head_dim ", value.size(2),
              " but v_cache has ", v_cache.size(3));

  PagedAppendParams p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = key.size(0);
  p.num_kv_heads = key.size(1);
  p.head_dim = key.size(2);
  p.head_dim_v = value.size(2);
  p.num_blocks = k_cache.size(0);
  p.block_size = k_cache.size(2);
  p.element_size = static_cast<int64_t>(key.element_size());
  p.key_strides = token_strides(key);
  p.value_strides = token_strides(value);
  p.k_cache_strides = cache_strides(k_cache);
  p.v_cache_strides = cache_strides(v_cache);
  return p;
}

void check_slot_values(const PagedAppendParams& p) {
  const int64_t capacity = p.num_blocks * p.block_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    TORCH_CHECK(slot >= -1 && slot < capacity, kAppend, "slot_mapping[", t, "] = ", slot,
                " is outside the cache's ", capacity, " slots (", p.num_blocks, " blocks x ",
                p.block_size, "); -1 marks a token to skip. Nothing was written.");
  }
}

PagedAttentionParams make_paged_attention_params(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache,
                                                 const at::Tensor& block_tables,
                                                 const at::Tensor& seq_lens,
                                                 const at::Tensor& cu_seqlens_q, double scale) {
  check_rank(kPaged, q, "q", 3, "[total_q, num_heads, head_dim]");
  check_caches(kPaged, k_cache, v_cache);
  check_same_dtype(kPaged, q, "q", k_cache, "k_cache");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, kPaged, "the cache has ",
              k_cache.size(1), " kv heads, which does not divide q's ", q.size(1), " heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), kPaged, "q has head_dim ", q.size(2),
              " but k_cache has ", k_cache.size(3));
  TORCH_CHECK(q.size(2) <= kMaxHeadDim && v_cache.size(3) <= kMaxHeadDim, kPaged, "head_dim ",
              q.size(2), " (q, k) and ", v_cache.size(3), " (v) must not exceed ", kMaxHeadDim);
  TORCH_CHECK(block_tables.dim() == 2, kPaged, "block_tables must be 2-D [batch, max_blocks], got shape ",
              block_tables.sizes());
  TORCH_CHECK(block_tables.size(1) <= 1 || block_tables.stride(1) == 1, kPaged,
              "block_tables must have a contiguous last dimension, got strides ", block_tables.strides());
  for (const auto& [tensor, name] : {std::pair{&block_tables, "block_tables"},
                                     std::pair{&seq_lens, "seq_lens"},
                                     std::pair{&cu_seqlens_q, "cu_seqlens_q"}}) {
    check_index_tensor(kPaged, *tensor, name, at::kInt, k_cache.device());
  }
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch, kPaged, "seq_lens must have shape [",
              batch, "] (one length per block table row), got ", seq_lens.sizes());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == batch + 1, kPaged,
              "cu_seqlens_q must have shape [", batch + 1, "] (batch + 1), got ", cu_seqlens_q.sizes());
  TORCH_CHECK(std::isfinite(scale), kPaged, "scale must be finite, got ", scale);

  PagedAttentionParams p;
  p.dtype = to_dtype(q.scalar_type(), kPaged, "q");
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.batch = batch;
  p.max_blocks_per_seq = block_tables.size(1);
  p.block_table_stride = block_tables.stride(0);
  p.total_q = q.size(0);
  p.num_heads = q.size(1);
  p.num_kv_heads = k_cache.size(1);
  p.head_dim = q.size(2);
  p.head_dim_v = v_cache.size(3);
  p.block_size = k_cache.size(2);
  p.num_blocks = k_cache.size(0);
  p.q_strides = token_strides(q);
  p.k_cache_strides = cache_strides(k_cache);
  p.v_cache_strides = cache_strides(v_cache);
  p.scale = scale;
  return p;
}

void check_paged_index_values(PagedAttentionParams& p) {
  TORCH_CHECK(p.cu_seqlens_q[0] == 0 && p.cu_seqlens_q[p.batch] == p.total_q, kPaged,
              "cu_seqlens_q must start at 0 and end at total_q = ", p.total_q, ", got ",
              p.cu_seqlens_q[0], " and ", p.cu_seqlens_q[p.batch]);
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  p.max_queries_per_seq = 0;
  p.max_seq_len = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t queries = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    const int64_t seq_len = p.seq_lens[b];
    TORCH_CHECK(queries >= 0, kPaged, "cu_seqlens_q must not decrease, got cu_seqlens_q[", b,
                "] = ", p.cu_seqlens_q[b], " > cu_seqlens_q[", b + 1, "] = ", p.cu_seqlens_q[b + 1]);
    TORCH_CHECK(seq_len >= queries, kPaged, "sequence ", b, " has ", queries,
                " queries but seq_lens[", b, "] = ", seq_len,
                " (seq_lens counts the cached tokens, the new ones included)");
    TORCH_CHECK(seq_len <= capacity, kPaged, "seq_lens[", b, "] = ", seq_len,
                " exceeds what a block table row holds: ", p.max_blocks_per_seq, " blocks x ",
                p.block_size, " = ", capacity);
    const int32_t* table = p.block_tables + b * p.block_table_stride;
    for (int64_t i = 0; i < (seq_len + p.block_size - 1) / p.block_size; ++i) {
      TORCH_CHECK(table[i] >= 0 && table[i] < p.num_blocks, kPaged, "block_tables[", b,
                  ", ", i, "] = ", table[i], " is outside the cache's ", p.num_blocks, " blocks");
    }
    p.max_queries_per_seq = std::max(p.max_queries_per_seq, queries);
    p.max_seq_len = std::max(p.max_seq_len, seq_len);
  }
}

PagedAttentionOutputs prepare_paged_outputs(PagedAttentionParams& params, const at::Tensor& q,
                                            int64_t num_kv_splits) {
  const at::TensorOptions acc_options = q.options().dtype(accumulate_dtype(q.scalar_type()));
  PagedAttentionOutputs t;
  t.out = at::empty({params.total_q, params.num_heads, params.head_dim_v}, q.options());
  t.lse = at::empty({params.total_q, params.num_heads}, acc_options);
  params.out = t.out.data_ptr();
  params.out_strides = {t.out.stride(0), t.out.stride(1)};
  params.lse = t.lse.data_ptr();
  params.num_kv_splits = num_kv_splits;
  if (num_kv_splits > 1) {
    t.partial_out = at::empty({num_kv_splits, params.total_q, params.num_heads, params.head_dim_v}, acc_options);
    t.partial_lse = at::empty({num_kv_splits, params.total_q, params.num_heads}, acc_options);
    params.partial_out = t.partial_out.data_ptr();
    params.partial_lse = t.partial_lse.data_ptr();
  }
  return t;
}

MergeStatesCall prepare_merge_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                     const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(out_a.dim() >= 1 && out_a.sizes() == out_b.sizes(), kMerge,
              "out_a and out_b must have one shape (..., head_dim), got ", out_a.sizes(), " and ",
              out_b.sizes());
  check_same_dtype(kMerge, out_a, "out_a", out_b, "out_b");
  const at::ScalarType lse_dtype = accumulate_dtype(out_a.scalar_type());
  const at::IntArrayRef rows_shape = out_a.sizes().slice(0, out_a.dim() - 1);
  for (const auto& [tensor, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}}) {
    TORCH_CHECK(tensor->sizes() == rows_shape && tensor->scalar_type() == lse_dtype &&
                    tensor->device() == out_a.device(),
                kMerge, name, " must be a ", dtype_name(lse_dtype), " tensor of shape ", rows_shape,
                " on ", out_a.device(), ", got ", dtype_name(tensor->scalar_type()), " of shape ",
                tensor->sizes(), " on ", tensor->device());
  }
  MergeStatesCall call;
  MergeStatesParams& p = call.params;
  p.dtype = to_dtype(out_a.scalar_type(), kMerge, "out_a");
  p.rows = lse_a.numel();
  p.head_dim = out_a.size(-1);
  call.rows_a = out_a.reshape({p.rows, p.head_dim});
  call.rows_b = out_b.reshape({p.rows, p.head_dim});
  call.lse_a = lse_a.contiguous();
  call.lse_b = lse_b.contiguous();
  call.out = at::empty(out_a.sizes(), out_a.options());
  call.lse = at::empty(lse_a.sizes(), lse_a.options());
  p.out_a = call.rows_a.data_ptr();
  p.out_b = call.rows_b.data_ptr();
  p.out_a_stride = p.rows > 1 ? call.rows_a.stride(0) : p.head_dim;
  p.out_b_stride = p.rows > 1 ? call.rows_b.stride(0) : p.head_dim;
  p.lse_a = call.lse_a.data_ptr();
  p.lse_b = call.lse_b.data_ptr();
  p.out = call.out.data_ptr();
  p.out_stride = p.head_dim;
  p.lse = call.lse.data_ptr();
  return call;
}

}  // namespace mha_ext

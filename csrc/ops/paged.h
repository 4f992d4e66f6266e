#pragma once
// The paged KV-cache ops, written once for every backend (ops/attention.h explains the
// plan/run contract): paged_kv_append and paged_attention. Contracts: the schemas in
// csrc/ops.cpp; ops/paged.cpp registers them.
//
// Index values (slots, block ids, lengths) are checked on the host before anything is
// written where the backend keeps its indices there (Backend::kIndicesOnHost: the CPU). A
// backend whose indices stay in device memory guards them in its kernels (cuda/kernels/
// launchers.h says how); MHA_EXT_CHECK_INDICES=1 copies them to the host and checks them there
// too (a debugging aid: it syncs).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

#include "mha_ext/paged_params.h"
#include "ops/op_signature.h"
#include "ops/tensor_checks.h"

namespace mha_ext {

namespace paged_detail {

constexpr const char* kAppendOp = "mha_ext.paged_kv_append: ";
constexpr const char* kPagedOp = "mha_ext.paged_attention: ";

inline bool check_device_indices_on_host() {
  const char* setting = std::getenv("MHA_EXT_CHECK_INDICES");
  return setting != nullptr && std::strcmp(setting, "1") == 0;
}

// The [num_blocks, num_kv_heads, block_size, dim] caches agree with each other.
inline void check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const char* dims = "[num_blocks, num_kv_heads, block_size, head_dim]";
  check_rank(op, k_cache, "k_cache", 4, dims);
  check_rank(op, v_cache, "v_cache", 4, dims);
  check_same_dtype(op, k_cache, "k_cache", v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), op,
              "k_cache and v_cache must agree in [num_blocks, num_kv_heads, block_size], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
}

// Every slot is -1 or inside the cache. slots: host memory, [num_tokens].
inline void check_slot_values(const int64_t* slots, int64_t num_tokens, int64_t num_blocks,
                              int64_t block_size) {
  const int64_t capacity = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < capacity, kAppendOp, "slot_mapping[", t,
                "] = ", slots[t], " is outside the cache's ", capacity, " slots (", num_blocks,
                " blocks x ", block_size, "); -1 marks a token to skip. Nothing was written.");
  }
}

// Checks the index values of a paged_attention call against its params and returns the
// largest query count and the largest length of a sequence. The index tensors: host memory.
inline std::pair<int64_t, int64_t> check_paged_index_values(const PagedAttentionParams& p,
                                                            const int32_t* block_tables,
                                                            int64_t block_table_stride,
                                                            const int32_t* seq_lens,
                                                            const int32_t* cu_seqlens_q) {
  TORCH_CHECK(cu_seqlens_q[0] == 0 && cu_seqlens_q[p.batch] == p.total_q, kPagedOp,
              "cu_seqlens_q must start at 0 and end at total_q = ", p.total_q, ", got ",
              cu_seqlens_q[0], " and ", cu_seqlens_q[p.batch]);
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  int64_t max_queries = 0, max_seq_len = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t queries = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const int64_t seq_len = seq_lens[b];
    TORCH_CHECK(queries >= 0, kPagedOp, "cu_seqlens_q must not decrease, got cu_seqlens_q[", b,
                "] = ", cu_seqlens_q[b], " > cu_seqlens_q[", b + 1, "] = ", cu_seqlens_q[b + 1]);
    TORCH_CHECK(seq_len >= queries, kPagedOp, "sequence ", b, " has ", queries,
                " queries but seq_lens[", b, "] = ", seq_len,
                " (seq_lens counts the cached tokens, the new ones included)");
    TORCH_CHECK(seq_len <= capacity, kPagedOp, "seq_lens[", b, "] = ", seq_len,
                " exceeds what a block table row holds: ", p.max_blocks_per_seq, " blocks x ",
                p.block_size, " = ", capacity);
    const int32_t* table = block_tables + b * block_table_stride;
    for (int64_t i = 0; i < (seq_len + p.block_size - 1) / p.block_size; ++i) {
      TORCH_CHECK(table[i] >= 0 && table[i] < p.num_blocks, kPagedOp, "block_tables[", b, ", ", i,
                  "] = ", table[i], " is outside the cache's ", p.num_blocks, " blocks");
    }
    max_queries = std::max(max_queries, queries);
    max_seq_len = std::max(max_seq_len, seq_len);
  }
  return {max_queries, max_seq_len};
}

inline CacheFormat cache_format(at::ScalarType cache_dtype) {
  if (cache_dtype == at::kChar) return CacheFormat::kInt8;
  if (cache_dtype == at::kFloat8_e4m3fn) return CacheFormat::kFloat8E4M3;
  return CacheFormat::kPlain;
}

// One cache tensor's scales, checked against its format: an int8 cache needs its per-row
// scale tensor (fp32 [num_blocks, num_kv_heads, block_size], on the cache's device) and a
// per-tensor scale of 1; an fp8 cache a finite per-tensor scale > 0 and no scale tensor; a
// plain cache neither.
inline QuantScales checked_scales(const char* op, CacheFormat format, const at::Tensor& cache,
                                  const char* cache_name, const std::optional<at::Tensor>& per_row,
                                  const char* per_row_name, double per_tensor,
                                  const char* per_tensor_name) {
  const std::string cache_dtype = dtype_name(cache.scalar_type());
  QuantScales scales;
  if (format == CacheFormat::kInt8) {
    TORCH_CHECK(per_row.has_value(), op, "an int8 ", cache_name, " needs ", per_row_name,
                ", its fp32 scales [num_blocks, num_kv_heads, block_size] = ",
                cache.sizes().slice(0, 3), ", got None");
    TORCH_CHECK(per_row->scalar_type() == at::kFloat, op, per_row_name,
                " must be torch.float32, got ", dtype_name(per_row->scalar_type()));
    TORCH_CHECK(per_row->device() == cache.device(), op, per_row_name, " is on ", per_row->device(),
                " but ", cache_name, " is on ", cache.device());
    TORCH_CHECK(per_row->sizes() == cache.sizes().slice(0, 3), op, per_row_name,
                " must have shape [num_blocks, num_kv_heads, block_size] = ",
                cache.sizes().slice(0, 3), " (", cache_name, "'s), got ", per_row->sizes());
    TORCH_CHECK(per_tensor == 1.0, op, per_tensor_name, " must be 1.0 for an int8 ", cache_name,
                " (its scales are per row, in ", per_row_name, "), got ", per_tensor);
    scales.per_row = per_row->data_ptr<float>();
    scales.strides = {per_row->stride(0), per_row->stride(1), per_row->stride(2)};
    return scales;
  }
  TORCH_CHECK(!per_row.has_value(), op, per_row_name, " is only for int8 caches, but ", cache_name,
              " is ", cache_dtype);
  if (format == CacheFormat::kFloat8E4M3) {
    TORCH_CHECK(std::isfinite(per_tensor) && per_tensor > 0.0, op, per_tensor_name,
                " must be finite and > 0 for a ", cache_dtype, " ", cache_name, ", got ",
                per_tensor);
    scales.per_tensor = static_cast<float>(per_tensor);
    TORCH_CHECK(std::isfinite(scales.per_tensor) && scales.per_tensor > 0.f, op, per_tensor_name,
                " = ", per_tensor, " is outside fp32's range");
    return scales;
  }
  TORCH_CHECK(per_tensor == 1.0, op, per_tensor_name, " is only for float8_e4m3fn caches, but ",
              cache_name, " is ", cache_dtype, "; got ", per_tensor);
  return scales;
}

// The rows an 8-bit cache takes in (key and value) or is read with (q): fp32, bf16 or fp16.
inline void check_quantized_rows_dtype(const char* op, const at::Tensor& rows, const char* name,
                                       const at::Tensor& cache) {
  const at::ScalarType dtype = rows.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, "a ",
              dtype_name(cache.scalar_type()), " cache takes ", name,
              " in torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(dtype));
  TORCH_CHECK(rows.device() == cache.device(), op, name, " is on ", rows.device(),
              " but the cache is on ", cache.device());
}

}  // namespace paged_detail

// Validates one append (slot values included, where indices_on_host or MHA_EXT_CHECK_INDICES
// says so) and fills its params.
inline PagedAppendParams make_append_params(const at::Tensor& key, const at::Tensor& value,
                                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            const at::Tensor& slot_mapping,
                                            const std::optional<at::Tensor>& k_scales,
                                            const std::optional<at::Tensor>& v_scales,
                                            double k_scale, double v_scale, bool indices_on_host) {
  using namespace paged_detail;
  const char* dims = "[num_tokens, num_kv_heads, head_dim]";
  check_rank(kAppendOp, key, "key", 3, dims);
  check_rank(kAppendOp, value, "value", 3, dims);
  check_caches(kAppendOp, k_cache, v_cache);
  const CacheFormat format = cache_format(k_cache.scalar_type());
  if (format == CacheFormat::kPlain) {
    check_same_dtype(kAppendOp, key, "key", k_cache, "k_cache");
    check_same_dtype(kAppendOp, value, "value", v_cache, "v_cache");
  } else {
    check_quantized_rows_dtype(kAppendOp, key, "key", k_cache);
    check_same_dtype(kAppendOp, value, "value", key, "key");
  }
  TORCH_CHECK(slot_mapping.dim() == 1, kAppendOp,
              "slot_mapping must be 1-D [num_tokens], got shape ", slot_mapping.sizes());
  check_index_tensor(kAppendOp, slot_mapping, "slot_mapping", at::kLong, k_cache.device());
  TORCH_CHECK(value.size(0) == key.size(0) && slot_mapping.size(0) == key.size(0), kAppendOp,
              "key, value and slot_mapping must have one entry per token, got ", key.size(0), ", ",
              value.size(0), " and ", slot_mapping.size(0));
  TORCH_CHECK(key.size(1) == k_cache.size(1) && value.size(1) == k_cache.size(1), kAppendOp,
              "key and value have ", key.size(1), " and ", value.size(1),
              " kv heads but the cache has ", k_cache.size(1));
  TORCH_CHECK(key.size(2) == k_cache.size(3), kAppendOp, "key has head_dim ", key.size(2),
              " but k_cache has ", k_cache.size(3));
  TORCH_CHECK(value.size(2) == v_cache.size(3), kAppendOp, "value has head_dim ", value.size(2),
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
  p.dtype = to_dtype(key.scalar_type(), kAppendOp, "key");
  p.format = format;
  p.k_scales = checked_scales(kAppendOp, format, k_cache, "k_cache", k_scales, "k_scales", k_scale,
                              "k_scale");
  p.v_scales = checked_scales(kAppendOp, format, v_cache, "v_cache", v_scales, "v_scales", v_scale,
                              "v_scale");
  p.key_strides = token_strides(key);
  p.value_strides = token_strides(value);
  p.k_cache_strides = cache_strides(k_cache);
  p.v_cache_strides = cache_strides(v_cache);
  if (indices_on_host) {
    check_slot_values(p.slot_mapping, p.num_tokens, p.num_blocks, p.block_size);
  } else if (check_device_indices_on_host()) {
    const at::Tensor host_slots = slot_mapping.cpu();
    check_slot_values(host_slots.const_data_ptr<int64_t>(), p.num_tokens, p.num_blocks,
                      p.block_size);
  }
  return p;
}

// k_scales / v_scales are written (the schema's "Tensor(c!)?"); C++ passes an optional tensor
// as const whether or not the op writes it (WrittenOptionalTensors below says which are).
template <typename Backend>
void paged_kv_append(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     const std::optional<at::Tensor>& k_scales,
                     const std::optional<at::Tensor>& v_scales, double k_scale, double v_scale) {
  PagedAppendParams params =
      make_append_params(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales, k_scale,
                         v_scale, Backend::kIndicesOnHost);
  Backend::run(params, Backend::plan(params, key));
}

// Validates one paged_attention call and fills its params, outputs excepted. With
// indices_on_host, max_queries_per_seq and max_seq_len are exact; for device indices they are
// the bounds the shapes give (all the queries, a whole block-table row).
inline PagedAttentionParams make_paged_attention_params(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
    double scale, int64_t window_left, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
    double k_scale, double v_scale, bool indices_on_host) {
  using namespace paged_detail;
  check_rank(kPagedOp, q, "q", 3, "[total_q, num_heads, head_dim]");
  check_caches(kPagedOp, k_cache, v_cache);
  const CacheFormat format = cache_format(k_cache.scalar_type());
  if (format == CacheFormat::kPlain) {
    check_same_dtype(kPagedOp, q, "q", k_cache, "k_cache");
  } else {
    check_quantized_rows_dtype(kPagedOp, q, "q", k_cache);
  }
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, kPagedOp, "the cache has ",
              k_cache.size(1), " kv heads, which does not divide q's ", q.size(1), " heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), kPagedOp, "q has head_dim ", q.size(2),
              " but k_cache has ", k_cache.size(3));
  TORCH_CHECK(q.size(2) <= kMaxHeadDim && v_cache.size(3) <= kMaxHeadDim, kPagedOp, "head_dim ",
              q.size(2), " (q, k) and ", v_cache.size(3), " (v) must not exceed ", kMaxHeadDim);
  TORCH_CHECK(block_tables.dim() == 2, kPagedOp,
              "block_tables must be 2-D [batch, max_blocks], got shape ", block_tables.sizes());
  TORCH_CHECK(block_tables.size(1) <= 1 || block_tables.stride(1) == 1, kPagedOp,
              "block_tables must have a contiguous last dimension, got strides ",
              block_tables.strides());
  for (const auto& [tensor, name] :
       {std::pair{&block_tables, "block_tables"}, std::pair{&seq_lens, "seq_lens"},
        std::pair{&cu_seqlens_q, "cu_seqlens_q"}}) {
    check_index_tensor(kPagedOp, *tensor, name, at::kInt, k_cache.device());
  }
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == batch, kPagedOp,
              "seq_lens must have shape [", batch, "] (one length per block table row), got ",
              seq_lens.sizes());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == batch + 1, kPagedOp,
              "cu_seqlens_q must have shape [", batch + 1, "] (batch + 1), got ",
              cu_seqlens_q.sizes());
  TORCH_CHECK(std::isfinite(scale), kPagedOp, "scale must be finite, got ", scale);
  TORCH_CHECK(window_left >= -1, kPagedOp,
              "window_left must be -1 (unbounded) or >= 0, got window_left ", window_left);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, kPagedOp,
              "softcap must be finite and >= 0 (0 = no softcap), got ", softcap);
  const int64_t heads = q.size(1);
  if (alibi_slopes.has_value()) {
    const std::string shapes =
        c10::str("[", heads, "] (heads) or [", batch, ", ", heads, "] (batch, heads)");
    check_per_head_values(kPagedOp, *alibi_slopes, "alibi_slopes", q, {{heads}, {batch, heads}},
                          shapes.c_str());
  }
  if (sinks.has_value()) {
    const std::string shape = c10::str("[", heads, "] (heads)");
    check_per_head_values(kPagedOp, *sinks, "sinks", q, {{heads}}, shape.c_str());
  }

  PagedAttentionParams p;
  p.dtype = to_dtype(q.scalar_type(), kPagedOp, "q");
  p.format = format;
  p.k_scales = checked_scales(kPagedOp, format, k_cache, "k_cache", k_scales, "k_scales", k_scale,
                              "k_scale");
  p.v_scales = checked_scales(kPagedOp, format, v_cache, "v_cache", v_scales, "v_scales", v_scale,
                              "v_scale");
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
  p.window_left = window_left;
  p.mods.softcap = softcap;
  if (alibi_slopes.has_value()) {
    p.mods.alibi_slopes = alibi_slopes->data_ptr();
    p.mods.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  if (sinks.has_value()) p.sinks = sinks->data_ptr();
  if (indices_on_host) {
    std::tie(p.max_queries_per_seq, p.max_seq_len) = check_paged_index_values(
        p, p.block_tables, p.block_table_stride, p.seq_lens, p.cu_seqlens_q);
    return p;
  }
  if (check_device_indices_on_host()) {
    const at::Tensor host_tables = block_tables.contiguous().cpu();
    const at::Tensor host_lens = seq_lens.cpu(), host_cu = cu_seqlens_q.cpu();
    check_paged_index_values(p, host_tables.const_data_ptr<int32_t>(), host_tables.size(1),
                             host_lens.const_data_ptr<int32_t>(),
                             host_cu.const_data_ptr<int32_t>());
  }
  p.max_queries_per_seq = p.total_q;
  p.max_seq_len = p.max_blocks_per_seq * p.block_size;
  return p;
}

// paged_attention's outputs, out [total_q, heads, head_dim_v] and lse [total_q, heads] in the
// accumulation type, and the split-K partials that the kernels merge by logsumexp into them
// for the num_kv_splits that the backend's plan chose (undefined with one split); the params
// point at them all.
struct PagedAttentionTensors {
  at::Tensor out, lse;
  at::Tensor partial_out, partial_lse;
};

inline PagedAttentionTensors allocate_paged_tensors(PagedAttentionParams& params,
                                                    const at::Tensor& q) {
  const at::TensorOptions acc_options = accumulate_options(q);
  PagedAttentionTensors t;
  t.out = at::empty({params.total_q, params.num_heads, params.head_dim_v}, q.options());
  t.lse = at::empty({params.total_q, params.num_heads}, acc_options);
  params.out = t.out.data_ptr();
  params.out_strides = token_strides(t.out);
  params.lse = t.lse.data_ptr();
  if (params.num_kv_splits > 1) {
    t.partial_out = at::empty(
        {params.num_kv_splits, params.total_q, params.num_heads, params.head_dim_v}, acc_options);
    t.partial_lse =
        at::empty({params.num_kv_splits, params.total_q, params.num_heads}, acc_options);
    params.partial_out = t.partial_out.data_ptr();
    params.partial_lse = t.partial_lse.data_ptr();
  }
  return t;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
    double scale, int64_t window_left, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
    double k_scale, double v_scale) {
  PagedAttentionParams params = make_paged_attention_params(
      q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window_left, softcap,
      alibi_slopes, sinks, k_scales, v_scales, k_scale, v_scale, Backend::kIndicesOnHost);
  const auto plan = Backend::plan(params, q);  // sets num_kv_splits
  const PagedAttentionTensors tensors = allocate_paged_tensors(params, q);
  Backend::run(params, plan);
  return {tensors.out, tensors.lse};
}

MHA_EXT_DESCRIBE_OP(PagedKvAppendOp, paged_kv_append);
MHA_EXT_DESCRIBE_OP(PagedAttentionOp, paged_attention);

template <>
struct WrittenOptionalTensors<PagedKvAppendOp> {
  static constexpr int positions[] = {5, 6};  // k_scales, v_scales
};

}  // namespace mha_ext

#pragma once
// Plain parameter structs for the attention kernels: pointers, int64 sizes and strides.
// No torch types, so the same struct feeds the CPU kernels, the CUDA kernels and the
// C++ benchmarks. Filled in one place per op (csrc/ops/<op family>.h).
#include <cstdint>

namespace mha_ext {

// Element type of q, k, v and out. Accumulation is fp32, or fp64 for kFloat64.
enum class DType : int32_t { kFloat32, kFloat64, kBFloat16, kFloat16 };

// How attn_mask enters the scores: kBool keeps a key where the mask is true (torch SDPA's
// convention); kAdditive adds the mask value to the scaled score.
enum class MaskKind : int32_t { kNone, kBool, kAdditive };

// Strides of a [batch, heads, seq, dim] tensor whose last dim is contiguous.
struct RowStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

// Which keys a query row sees. Key j is visible to query i when
//   i + diagonal_offset - window_left <= j <= i + diagonal_offset + window_right,
// a negative window side meaning "unbounded". Causal attention is window_right = 0;
// diagonal_offset is 0 for top-left alignment (torch SDPA's is_causal) and seq_k - seq_q
// for bottom-right alignment (FlashAttention's, queries are the last keys).
struct KeyWindow {
  int64_t window_left = -1;
  int64_t window_right = -1;
  int64_t diagonal_offset = 0;
};

struct AttnMaskParams {
  MaskKind kind = MaskKind::kNone;
  // [batch, num_heads, seq_q, seq_k] read through strides; broadcast dims have stride 0.
  // Element type: bool for kBool, the q dtype for kAdditive.
  const void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

struct DropoutParams {
  // A random 32-bit draw r drops an element when r < drop_threshold, so the keep
  // probability is 1 - drop_threshold / 2^32 (see philox.h).
  uint32_t drop_threshold = 0;
  double keep_scale = 1.0;  // 1 / (1 - dropout_p), applied to kept probabilities
  // The dropout_seed tensor's element, in the memory of the tensor's device: the CUDA kernels
  // read it there, so no launch waits for the host. `seed` holds its value where the host
  // can read it (a CPU seed).
  const int64_t* seed_address = nullptr;
  uint64_t seed = 0;
  // The RNG's batch coordinate of the params' batch 0: a varlen call's sequence params
  // (sequence_params) draw as batch b of the whole call.
  int64_t batch_offset = 0;
  bool enabled = false;
};

// Score modifications, applied to each scaled score s = scale * q.k in this order: the logit
// softcap (s -> softcap * tanh(s / softcap), Gemma 2), the ALiBi bias
// (-slope * |i + diagonal_offset - j| for query i and key j), then the mask and the window.
struct ScoreMods {
  double softcap = 0.0;  // 0 = none
  // [batch, num_heads] slopes through alibi_batch_stride (0: one slope per head for the whole
  // batch), accumulation type; nullptr = no ALiBi.
  const void* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
};

// Packed variable-length sequences. With cu_seqlens_q set, q and out are [total_q, heads,
// head_dim] and k, v [total_k, kv_heads, head_dim] viewed as batch 1 of [batch, heads, seq,
// dim] (batch stride 0): sequence b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b+1]),
// its keys rows from cu_seqlens_k[b], the first seqused_k[b] of them (all up to
// cu_seqlens_k[b+1] when seqused_k is nullptr). seq_q / seq_k of the params are then the
// longest sequence's lengths, and sequence_params gives one sequence's dense params.
struct VarlenParams {
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* cu_seqlens_k = nullptr;  // [batch + 1]
  const int32_t* seqused_k = nullptr;     // [batch] or nullptr
};

// The dropout_mask op: the keep-mask that attention with the same seed and dropout_p draws.
struct DropoutMaskParams {
  bool* keep = nullptr;  // [batch, num_heads, seq_q, seq_k] contiguous
  DropoutParams dropout;
  int64_t batch = 0;
  int64_t num_heads = 0;
  int64_t seq_q = 0;
  int64_t seq_k = 0;
};

struct AttentionForwardParams {
  DType dtype = DType::kFloat32;
  const void* q = nullptr;  // [batch, num_heads, seq_q, head_dim]
  const void* k = nullptr;  // [batch, num_kv_heads, seq_k, head_dim]
  const void* v = nullptr;  // [batch, num_kv_heads, seq_k, head_dim_v]
  void* out = nullptr;      // [batch, num_heads, seq_q, head_dim_v]
  // Natural-log logsumexp of the scaled, masked scores (the sink included), float or double
  // for kFloat64; -inf for a row that sees no key. Row i of (batch b, head h) is element
  // b * lse_batch_stride + h * lse_head_stride + i: [batch, num_heads, seq_q] contiguous, or
  // [num_heads, total_q] for varlen. delta, grad_lse and grad_q_accum share this layout.
  void* lse = nullptr;
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;

  int64_t batch = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // divides num_heads; query head h reads kv head h / group
  int64_t seq_q = 0;
  int64_t seq_k = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;

  RowStrides q_strides, k_strides, v_strides, out_strides;

  double scale = 1.0;
  KeyWindow window;
  // Whether window.diagonal_offset is seq_k - seq_q (per sequence for varlen) or 0.
  bool bottom_right = false;
  AttnMaskParams mask;
  DropoutParams dropout;
  ScoreMods mods;
  // [num_heads] logits, accumulation type, that join every row's softmax denominator and
  // carry no value (attention sinks); nullptr = none.
  const void* sinks = nullptr;
  VarlenParams varlen;
};

// FlashAttention-2 style backward: out and lse are inputs here, saved by the forward.
struct AttentionBackwardParams : AttentionForwardParams {
  const void* grad_out = nullptr;  // [batch, num_heads, seq_q, head_dim_v]
  // [batch, num_heads, seq_q] contiguous, lse's type; nullptr when lse gets no gradient.
  const void* grad_lse = nullptr;
  void* grad_q = nullptr;  // [batch, num_heads, seq_q, head_dim]
  void* grad_k = nullptr;  // [batch, num_kv_heads, seq_k, head_dim]
  void* grad_v = nullptr;  // [batch, num_kv_heads, seq_k, head_dim_v]
  RowStrides grad_out_strides, grad_q_strides, grad_k_strides, grad_v_strides;

  // Workspaces in the accumulation type, owned by the caller.
  // grad_q partial sums: num_kv_splits slices grad_q_accum_split_stride apart, each with one
  // [head_dim] row per lse element (row i of (b, h) at (lse offset) * head_dim), so splits
  // never share a row. Zero-filled for the CUDA kernel; the CPU kernels take it uncleared.
  void* grad_q_accum = nullptr;
  int64_t grad_q_accum_split_stride = 0;
  int64_t num_kv_splits = 1;
  // Gradients bitwise reproducible from run to run (and on CPU across thread counts): the
  // backend's plan fixes the dQ reduction order.
  bool deterministic = false;
  // rowsum(grad_out * out) - grad_lse, written by the kernel: [batch, num_heads, seq_q].
  void* delta = nullptr;
};

}  // namespace mha_ext

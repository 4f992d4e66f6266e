#pragma once
// Where each sequence of an attention call lies: the lse-layout offsets of the per-row arrays,
// and the dense params of one sequence of a packed variable-length call (VarlenParams).
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/macros.h"

namespace mha_ext {

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE int64_t element_size(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;
}

// Bytes of one lse element (the accumulation type).
MHA_EXT_HOST_DEVICE int64_t accumulate_size(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : 4;
}

// Element index of row 0 of (batch, head) in lse, delta and grad_lse.
MHA_EXT_HOST_DEVICE int64_t lse_offset(const AttentionForwardParams& p, int64_t batch,
                                       int64_t head) {
  return batch * p.lse_batch_stride + head * p.lse_head_stride;
}

// Elements of lse: [batch, heads, seq_q], or [heads, total_q] packed.
MHA_EXT_HOST_DEVICE int64_t lse_elements(const AttentionForwardParams& p) {
  return p.varlen.cu_seqlens_q != nullptr ? p.num_heads * p.lse_head_stride
                                          : p.batch * p.lse_batch_stride;
}

MHA_EXT_HOST_DEVICE const void* advance(const void* pointer, int64_t bytes) {
  return static_cast<const char*>(pointer) + bytes;
}
MHA_EXT_HOST_DEVICE void* advance(void* pointer, int64_t bytes) {
  return static_cast<char*>(pointer) + bytes;
}

// Sequence `sequence` of a call as a dense call of batch 1: its rows of q, k, v, out and lse,
// its lengths, its causal diagonal and ALiBi slopes, and dropout drawing as batch `sequence`.
// A varlen call's kernels run each sequence through these params; a dense call's sequence is
// its batch entry.
MHA_EXT_HOST_DEVICE AttentionForwardParams sequence_params(const AttentionForwardParams& p,
                                                           int64_t sequence) {
  AttentionForwardParams s = p;
  s.batch = 1;
  int64_t q_row = 0, k_row = 0;
  if (p.varlen.cu_seqlens_q != nullptr) {
    q_row = p.varlen.cu_seqlens_q[sequence];
    k_row = p.varlen.cu_seqlens_k[sequence];
    s.seq_q = p.varlen.cu_seqlens_q[sequence + 1] - q_row;
    s.seq_k = p.varlen.seqused_k != nullptr ? p.varlen.seqused_k[sequence]
                                            : p.varlen.cu_seqlens_k[sequence + 1] - k_row;
    s.varlen = VarlenParams{};
  }
  const int64_t size = element_size(p.dtype);
  s.q = advance(p.q, (sequence * p.q_strides.batch + q_row * p.q_strides.row) * size);
  s.out = advance(p.out, (sequence * p.out_strides.batch + q_row * p.out_strides.row) * size);
  s.k = advance(p.k, (sequence * p.k_strides.batch + k_row * p.k_strides.row) * size);
  s.v = advance(p.v, (sequence * p.v_strides.batch + k_row * p.v_strides.row) * size);
  s.lse = advance(p.lse, (sequence * p.lse_batch_stride + q_row) * accumulate_size(p.dtype));
  s.window.diagonal_offset = p.bottom_right ? s.seq_k - s.seq_q : 0;
  if (p.mods.alibi_slopes != nullptr) {
    s.mods.alibi_slopes = advance(p.mods.alibi_slopes,
                                  sequence * p.mods.alibi_batch_stride * accumulate_size(p.dtype));
  }
  if (p.mask.kind != MaskKind::kNone) {
    const int64_t mask_size = p.mask.kind == MaskKind::kBool ? 1 : size;
    s.mask.data = advance(p.mask.data, sequence * p.mask.batch_stride * mask_size);
  }
  s.dropout.batch_offset = p.dropout.batch_offset + sequence;
  return s;
}

// The backward's sequence params: the forward's, and its rows of dO, dQ, dK, dV, delta,
// grad_lse and the dQ partial sums.
MHA_EXT_HOST_DEVICE AttentionBackwardParams sequence_params(const AttentionBackwardParams& p,
                                                            int64_t sequence) {
  AttentionBackwardParams s = p;
  static_cast<AttentionForwardParams&>(s) =
      sequence_params(static_cast<const AttentionForwardParams&>(p), sequence);
  int64_t q_row = 0, k_row = 0;
  if (p.varlen.cu_seqlens_q != nullptr) {
    q_row = p.varlen.cu_seqlens_q[sequence];
    k_row = p.varlen.cu_seqlens_k[sequence];
  }
  const int64_t size = element_size(p.dtype), acc_size = accumulate_size(p.dtype);
  const int64_t lse_row = sequence * p.lse_batch_stride + q_row;
  s.grad_out = advance(
      p.grad_out, (sequence * p.grad_out_strides.batch + q_row * p.grad_out_strides.row) * size);
  s.grad_q =
      advance(p.grad_q, (sequence * p.grad_q_strides.batch + q_row * p.grad_q_strides.row) * size);
  s.grad_k =
      advance(p.grad_k, (sequence * p.grad_k_strides.batch + k_row * p.grad_k_strides.row) * size);
  s.grad_v =
      advance(p.grad_v, (sequence * p.grad_v_strides.batch + k_row * p.grad_v_strides.row) * size);
  if (p.grad_lse != nullptr) s.grad_lse = advance(p.grad_lse, lse_row * acc_size);
  s.delta = advance(p.delta, lse_row * acc_size);
  if (p.grad_q_accum != nullptr) {
    s.grad_q_accum = advance(p.grad_q_accum, lse_row * p.head_dim * acc_size);
  }
  return s;
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext

// Every op's schema, declared once. Backends register against these names with
// TORCH_LIBRARY_IMPL (cpu/*.cpp, cuda/*_api.cpp); mha_ext/ops.py adds the fake (meta)
// implementations and the autograd formulas.
#include <torch/library.h>

TORCH_LIBRARY(mha_ext, m) {
  // Fused attention forward. q [batch, heads, seq_q, head_dim], k [batch, kv_heads, seq_k,
  // head_dim], v [batch, kv_heads, seq_k, head_dim_v]; kv_heads divides heads (GQA/MQA).
  // attn_mask: bool (true = attend) or additive in q's dtype, broadcastable to
  // [batch, heads, seq_q, seq_k]. Keys outside [i + off - window_left, i + off + window_right]
  // are hidden (-1 = unbounded side; off = seq_k - seq_q if bottom_right else 0).
  // dropout_seed: one int64 seeding the counter-based dropout RNG (needed when dropout_p > 0).
  // Returns out [batch, heads, seq_q, head_dim_v] and the natural-log logsumexp
  // [batch, heads, seq_q] (fp32; fp64 for fp64 inputs).
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? dropout_seed, "
      "float dropout_p, float scale, int window_left, int window_right, bool bottom_right) "
      "-> (Tensor out, Tensor lse)");

  // Gradients of attention_forward from its saved out and lse (FlashAttention-2 recompute).
  // grad_lse, when given, is the gradient reaching the logsumexp output.
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask, Tensor? dropout_seed, float dropout_p, "
      "float scale, int window_left, int window_right, bool bottom_right) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");

  // The keep-mask [batch, heads, seq_q, seq_k] (bool) that attention with this seed and
  // dropout_p applies: for tests and for inspecting dropout, not for the hot path.
  m.def(
      "dropout_mask(Tensor dropout_seed, int batch, int num_heads, int seq_q, int seq_k, "
      "float dropout_p) -> Tensor");
}

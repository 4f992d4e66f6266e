// Every op's schema, declared once. The op files csrc/ops/<family>.{h,cpp} implement them once
// for every backend and register them with TORCH_LIBRARY_IMPL; mha_ext/ops.py adds the fake
// (meta) implementations and merge_attention_states' autograd formula.
#include <torch/library.h>

TORCH_LIBRARY(mha_ext, m) {
  // Fused attention forward. q [batch, heads, seq_q, head_dim], k [batch, kv_heads, seq_k,
  // head_dim], v [batch, kv_heads, seq_k, head_dim_v]; kv_heads divides heads (GQA/MQA).
  // attn_mask: bool (true = attend) or additive in q's dtype, broadcastable to
  // [batch, heads, seq_q, seq_k]. Keys outside [i + off - window_left, i + off + window_right]
  // are hidden (-1 = unbounded side; off = seq_k - seq_q if bottom_right else 0).
  // dropout_seed: one int64 seeding the counter-based dropout RNG (needed when dropout_p > 0).
  // softcap > 0 caps each scaled score s to softcap * tanh(s / softcap); alibi_slopes [heads]
  // or [batch, heads] add -slope * |i + off - j|; sinks [heads] join each row's softmax
  // denominator (both fp32, fp64 for fp64 inputs). With cu_seqlens_q / cu_seqlens_k (int32,
  // batch + 1) the call is packed: q [total_q, heads, head_dim], k/v [total_k, kv_heads, ...],
  // sequence b at rows cu_seqlens[b] .. cu_seqlens[b + 1] (seqused_k[b] of its keys when
  // given), max_seqlen_* bounding the lengths; out and lse are then [total_q, heads,
  // head_dim_v] and [heads, total_q]; max_seqlen_* are SymInt so that torch.compile keeps
  // them symbolic (one graph for every length). deterministic makes the backward
  // reproducible.
  // Returns out [batch, heads, seq_q, head_dim_v] and the natural-log logsumexp
  // [batch, heads, seq_q] (fp32; fp64 for fp64 inputs).
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? dropout_seed, "
      "float dropout_p, float scale, int window_left, int window_right, bool bottom_right, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_k=None, "
      "SymInt max_seqlen_q=0, SymInt max_seqlen_k=0, bool deterministic=False) "
      "-> (Tensor out, Tensor lse)");

  // Gradients of attention_forward from its saved out and lse (FlashAttention-2 recompute).
  // grad_lse, when given, is the gradient reaching the logsumexp output. grad_sinks is empty
  // (shape [0]) without sinks.
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask, Tensor? dropout_seed, float dropout_p, "
      "float scale, int window_left, int window_right, bool bottom_right, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_k=None, "
      "SymInt max_seqlen_q=0, SymInt max_seqlen_k=0, bool deterministic=False) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)");

  // The keep-mask [batch, heads, seq_q, seq_k] (bool) that attention with this seed and
  // dropout_p applies: for tests and for inspecting dropout, not for the hot path.
  m.def(
      "dropout_mask(Tensor dropout_seed, int batch, int num_heads, int seq_q, int seq_k, "
      "float dropout_p) -> Tensor");

  // Writes key [num_tokens, num_kv_heads, head_dim] and value [num_tokens, num_kv_heads,
  // head_dim_v] into the paged caches in place, token t at slot_mapping[t] (int64,
  // block * block_size + offset; -1 skips the token). Caches are [num_blocks, num_kv_heads,
  // block_size, head_dim] through strides. A slot outside the cache is an error and nothing
  // is written.
  // 8-bit caches quantize the rows as they are written (key and value fp32, bf16 or fp16;
  // CacheFormat in csrc/include/mha_ext/paged_params.h gives the formats): an int8 cache
  // writes each row's fp32 scale into k_scales / v_scales ([num_blocks, num_kv_heads,
  // block_size] through strides, at the row's slot); a float8_e4m3fn cache divides by the
  // per-tensor k_scale / v_scale (> 0) first.
  m.def(
      "paged_kv_append(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None, "
      "float k_scale=1., float v_scale=1.) -> ()");

  // Attention of packed queries q [total_q, num_heads, head_dim] over paged caches: sequence
  // b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b+1]), reads its seq_lens[b] cached tokens
  // (the new ones included) through block_tables[b], and its queries are its last tokens
  // (causal, bottom-right). All index tensors int32. Query at position p (seq_len - n_q + i)
  // sees keys [p - window_left, p] (-1: unbounded); softcap, alibi_slopes ([heads] or [batch,
  // heads], distance p - j) and sinks ([heads], in lse) as for attention_forward. Returns out
  // [total_q, num_heads, head_dim_v] and lse [total_q, num_heads] (fp32; fp64 for fp64).
  // 8-bit caches (as paged_kv_append wrote them, q fp32, bf16 or fp16) are dequantized as
  // they are read, with the same k_scales / v_scales (int8) or k_scale / v_scale (fp8).
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_seqlens_q, float scale, int window_left=-1, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "Tensor? k_scales=None, Tensor? v_scales=None, float k_scale=1., float v_scale=1.) "
      "-> (Tensor out, Tensor lse)");

  // Combines two attentions over disjoint key sets, out_* [..., head_dim] with their
  // logsumexps lse_* [...], into the attention over both. An empty side (lse -inf) drops out.
  m.def(
      "merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) "
      "-> (Tensor out, Tensor lse)");
}

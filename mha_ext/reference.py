"""Textbook PyTorch references: explicit score matrices, no fusion, exact in float64.

The tests compare the fused kernels against these run in float64, and use the same code in
the kernel's dtype to measure how far plain PyTorch lands from float64. The naive module is
the seed tutorial's, with GQA by repeating K/V heads the textbook way.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    attn_mask: Optional[Tensor] = None,
    dropout_keep: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of mha_ext.attention computed with explicit (B, H, Sq, Sk) scores.

    Same arguments as mha_ext.attention, except that dropout takes the bool keep-mask
    (B, H, Sq, Sk) to apply (see mha_ext.dropout_mask) instead of drawing one.
    Computes in q's dtype: pass float64 tensors for the ground truth. As FlashAttention's
    reference does, ALiBi and sinks lift the scores to the dtype of the slopes and sinks (the
    kernels' accumulation dtype), and the probabilities go back to v's dtype for the product.

    The score of query i and key j: s = scale * q_i . k_j, then softcap * tanh(s / softcap)
    for softcap > 0, then ALiBi's -slope[b, h] * |i + shift - j| (slopes (H,) or (B, H)),
    then the masks. sinks (H,) join every row's softmax denominator without a value; a row
    that sees no key gets out 0 and lse = its head's sink (-inf without sinks). Differentiable
    in q, k, v and sinks.
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1)  # (B, H, Sk, D)
    v = v.repeat_interleave(group, dim=1)  # (B, H, Sk, Dv)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    # Query i sits on key diagonal i + shift; the window keeps keys
    # diagonal - left .. diagonal + right, causal forcing right = 0.
    shift = 0 if causal == "top_left" else seq_k - seq_q
    if alibi_slopes is not None:
        query_index = torch.arange(seq_q, device=q.device)[:, None]
        key_index = torch.arange(seq_k, device=q.device)[None, :]
        distance = (query_index + shift - key_index).abs().to(alibi_slopes.dtype)  # (Sq, Sk)
        slopes = alibi_slopes.reshape(-1, heads)[..., None, None]  # (B or 1, H, 1, 1)
        scores = scores - slopes * distance
    left, right = window if window is not None else (None, None)
    left = None if left == -1 else left
    right = None if right == -1 else right
    if causal is not None:
        right = 0 if right is None else min(right, 0)
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if right is not None:
        allowed = allowed.tril(diagonal=shift + right)
    if left is not None:
        allowed = allowed.triu(diagonal=shift - left)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask

    if sinks is None:
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
        # Rows that see no key: softmax would give NaN (and NaN gradients); define them as 0.
        empty_rows = (lse == float("-inf"))[..., None]
        probs = F.softmax(scores.masked_fill(empty_rows, 0.0), dim=-1)
        probs = probs.masked_fill(empty_rows, 0.0)
    else:
        # The sink is one more logit per row, (B, H, Sq, 1), whose probability is dropped. It
        # keeps every lse finite, so exp(-inf - lse) = 0 needs no special case.
        sink_logits = sinks.reshape(1, heads, 1, 1).expand(batch, heads, seq_q, 1)
        scores = scores.to(torch.promote_types(scores.dtype, sinks.dtype))
        lse = torch.logsumexp(torch.cat([scores, sink_logits.to(scores.dtype)], dim=-1), dim=-1)
        probs = torch.exp(scores - lse[..., None])
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    return torch.matmul(probs.to(v.dtype), v), lse


def _as_batch_one(packed: Tensor, rows: slice) -> Tensor:
    """Rows of a packed (total, H, D) tensor as a dense (1, H, S, D) view."""
    return packed[rows].transpose(0, 1).unsqueeze(0)


def attention_varlen_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    dropout_keep: Optional[Sequence[Tensor]] = None,
    dropout_p: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of mha_ext.attention_varlen: each sequence alone through attention_reference.

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); sequence b owns q rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] and the first seqused_k[b] (default: all) of its
    k/v rows cu_seqlens_k[b]:cu_seqlens_k[b + 1], so its causal diagonal and ALiBi distances
    use those lengths. alibi_slopes (H,) or (batch, H); dropout_keep, if given, one bool
    keep-mask (1, H, Sq_b, Sk_b) per sequence. Returns out (total_q, H, Dv) in q's dtype and
    lse (H, total_q), as the packed op lays them out. Needs batch >= 1.
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q_rows = slice(starts_q[b], starts_q[b + 1])
        used_k = starts_k[b + 1] - starts_k[b] if seqused_k is None else int(seqused_k[b])
        k_rows = slice(starts_k[b], starts_k[b] + used_k)
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        out, lse = attention_reference(
            _as_batch_one(q, q_rows),
            _as_batch_one(k, k_rows),
            _as_batch_one(v, k_rows),
            causal=causal,
            scale=scale,
            window=window,
            softcap=softcap,
            alibi_slopes=slopes,
            sinks=sinks,
            dropout_keep=None if dropout_keep is None else dropout_keep[b],
            dropout_p=dropout_p,
        )
        outs.append(out[0].transpose(0, 1))  # (Sq_b, H, Dv)
        lses.append(lse[0])  # (H, Sq_b)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of mha_ext.paged_attention computed sequence by sequence with explicit
    (H, n_q, n_k) scores over keys gathered from the cache through the block tables.

    Same arguments as mha_ext.paged_attention. Only the keys some query of a sequence sees
    are gathered (from the first query's window on), so cache rows outside every window may
    hold anything. Computes in q's dtype: pass float64 tensors for the ground truth.
    """
    total_q, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    left = None if window is None or window[0] in (None, -1) else window[0]
    out = q.new_zeros(total_q, heads, v_cache.shape[-1])
    lse = q.new_full((total_q, heads), float("-inf"))
    for b in range(len(seq_lens)):
        begin, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seq_len, num_queries = int(seq_lens[b]), end - begin
        if num_queries == 0:
            continue
        # The queries are the sequence's last tokens.
        positions = torch.arange(seq_len - num_queries, seq_len, device=q.device)
        first_key = 0 if left is None else max(0, seq_len - num_queries - left)
        keys = torch.arange(first_key, seq_len, device=q.device)
        blocks = block_tables[b, keys // block_size].long()
        # (n_k, kv_heads, D) -> (H, n_k, D)
        k = k_cache[blocks, :, keys % block_size].to(q.dtype).repeat_interleave(group, 1)
        v = v_cache[blocks, :, keys % block_size].to(q.dtype).repeat_interleave(group, 1)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        scores = torch.matmul(q[begin:end].transpose(0, 1), k.transpose(-2, -1)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        distance = positions[:, None] - keys[None, :]  # (n_q, n_k)
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            scores = scores - slopes.to(q.dtype)[:, None, None] * distance.abs().to(q.dtype)
        allowed = distance >= 0
        if left is not None:
            allowed &= distance <= left
        scores = scores.masked_fill(~allowed, float("-inf"))  # (H, n_q, n_k)
        logits = scores
        if sinks is not None:  # one more logit per row, with no value
            sink_logits = sinks.to(q.dtype)[:, None, None].expand(heads, num_queries, 1)
            logits = torch.cat([scores, sink_logits], dim=-1)
        row_lse = torch.logsumexp(logits, dim=-1)  # (H, n_q)
        # A row that sees nothing has lse -inf and scores -inf: subtracting 0 keeps it at 0.
        finite_lse = torch.where(row_lse == float("-inf"), 0.0, row_lse)
        probs = torch.exp(scores - finite_lse[..., None])
        out[begin:end] = torch.matmul(probs, v).transpose(0, 1)
        lse[begin:end] = row_lse.transpose(0, 1)
    return out, lse


FLOAT8_E4M3_MAX = 448.0


def quantize_int8(x: Tensor) -> Tuple[Tensor, Tensor]:
    """(stored, scale) of rows x (..., dim) in the int8 cache format: scale = absmax / 127
    per row (fp32, shape x.shape[:-1]), stored = clamp(round_half_to_even(x / scale), -127,
    127) int8; an all-zero row stores zeros with scale 0. In fp32 with true division, the bits
    paged_kv_append writes."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0
    divisor = torch.where(scale == 0, 1.0, scale)[..., None].expand_as(x).contiguous()
    stored = torch.round(x / divisor).clamp(-127, 127)
    stored = torch.where(scale[..., None] == 0, 0.0, stored)
    return stored.to(torch.int8), scale


def quantize_float8(x: Tensor, scale: float) -> Tensor:
    """x / scale saturated to +-448 and rounded to float8_e4m3fn (ties to even), in fp32 with
    true division: the bits paged_kv_append writes into a float8_e4m3fn cache."""
    x = x.float()
    divisor = torch.full_like(x, scale)  # a tensor: torch divides by a Python float as a multiply
    y = x / divisor
    return torch.where(y.isnan(), y, y.clamp(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)).to(
        torch.float8_e4m3fn
    )


def dequantize_cache(
    cache: Tensor,
    scales: Optional[Tensor] = None,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The values an 8-bit cache (num_blocks, num_kv_heads, block_size, dim) holds, in `dtype`:
    stored * scales[..., None] (int8, per row) or stored * scale (float8_e4m3fn, per tensor);
    other caches converted as they are."""
    values = cache.to(dtype)
    if scales is not None:
        values = values * scales.to(dtype)[..., None]
    return values * scale if scale != 1.0 else values


class MultiHeadAttentionReference(nn.Module):
    """The seed tutorial's naive module (explicit scores, separate softmax and dropout),
    extended to GQA/MQA by repeating K/V heads. Parameters match MultiHeadAttention's, so
    state dicts move between the two."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        num_kv_heads: Optional[int] = None,
        bias: bool = False,
    ):
        super().__init__()
        assert d_model % num_heads == 0
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.d_k = d_model // num_heads
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, self.num_kv_heads * self.d_k, bias=bias)
        self.w_v = nn.Linear(d_model, self.num_kv_heads * self.d_k, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        group = self.num_heads // self.num_kv_heads
        # (batch, seq, d_model) -> (batch, heads, seq, d_k)
        q = self.w_q(q).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = self.w_k(k).view(batch_size, -1, self.num_kv_heads, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(batch_size, -1, self.num_kv_heads, self.d_k).transpose(1, 2)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)

        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_k**0.5)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v)  # (batch, heads, seq, d_k)
        out = out.transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        return self.w_o(out)

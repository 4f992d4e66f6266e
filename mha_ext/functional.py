"""Public attention functions on the fused kernels.

scaled_dot_product_attention is a drop-in for torch's; attention exposes the whole feature
set (both causal alignments, sliding windows, logsumexp output). Shapes are
(batch, heads, seq, head_dim); (batch, seq, heads, head_dim) storage works through
.transpose(1, 2) views, without copies.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops

CAUSAL_ALIGNMENTS = (None, "top_left", "bottom_right")

_INT64 = torch.iinfo(torch.int64)


def draw_dropout_seed(device: Union[str, torch.device]) -> Tensor:
    """Draws the one-element int64 seed of attention's dropout from torch's generator.

    attention draws its seed this way, so torch.manual_seed makes dropout reproducible, and
    after the same manual_seed, dropout_mask(draw_dropout_seed(...), ...) shows the mask an
    attention call applied.
    """
    return torch.randint(_INT64.min, _INT64.max, (1,), dtype=torch.int64, device=device)


def dropout_mask(
    dropout_seed: Tensor, batch: int, num_heads: int, seq_q: int, seq_k: int, dropout_p: float
) -> Tensor:
    """The bool keep-mask (batch, num_heads, seq_q, seq_k) that attention applies with this
    seed and dropout_p (True = kept, scaled by 1 / (1 - dropout_p)). O(seq_q x seq_k): for
    tests and inspection."""
    return ops.dropout_mask(dropout_seed, batch, num_heads, seq_q, seq_k, float(dropout_p))


def window_sides(window, fn: str) -> Tuple[int, int]:
    """(left, right) of a window argument, -1 for an unbounded side (None or -1 given); a
    ValueError naming fn for anything but a pair of ints >= -1 or None."""
    if window is None:
        return -1, -1
    sides = tuple(window) if isinstance(window, (tuple, list)) else None
    valid = (
        sides is not None
        and len(sides) == 2
        and all(side is None or (isinstance(side, int) and side >= -1) for side in sides)
    )
    if not valid:
        raise ValueError(
            f"{fn}: window must be a pair (left, right) of ints >= 0, with None or -1 "
            f"for an unbounded side, got {window!r}"
        )
    left, right = (-1 if side is None else side for side in sides)
    return left, right


def _window_bounds(causal, window, fn: str) -> Tuple[int, int, bool]:
    """(window_left, window_right, bottom_right) for the op; -1 means unbounded."""
    if causal not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"{fn}: causal must be None, 'top_left' or 'bottom_right', got {causal!r}")
    left, right = window_sides(window, fn)
    if causal is not None:
        right = 0 if right == -1 else min(right, 0)
    # A window without causal aligns bottom-right, as FlashAttention's does.
    return left, right, causal != "top_left"


def _head_values(values: Optional[Tensor], q: Tensor, name: str, fn: str) -> Optional[Tensor]:
    """alibi_slopes or sinks in the dtype the kernels read (fp32, fp64 for fp64 q)."""
    if values is None:
        return None
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {values!r}")
    return values.to(ops.lse_dtype(q.dtype))


def _attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    scale: Optional[float],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    fn: str,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    deterministic: Optional[bool] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the forward op, with attention's checks and defaults applied."""
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError(
            f"{fn}: attn_mask requires grad, but the fused kernels give the mask no gradient"
        )
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError(
            f"{fn}: alibi_slopes requires grad, but the slopes get no gradient "
            f"(as in FlashAttention)"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    dropout_seed = draw_dropout_seed(q.device) if dropout_p > 0 else None
    return ops.attention_forward(
        q,
        k,
        v,
        attn_mask,
        dropout_seed,
        float(dropout_p),
        scale,
        window_left,
        window_right,
        bottom_right,
        float(softcap),
        _head_values(alibi_slopes, q, "alibi_slopes", fn),
        _head_values(sinks, q, "sinks", fn),
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        bool(deterministic),
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    deterministic: Optional[bool] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Fused attention with the full feature set.

    Args:
        q: (B, H, Sq, D) queries. k: (B, Hkv, Sk, D), v: (B, Hkv, Sk, Dv); Hkv divides H
            (GQA/MQA: query head h reads kv head h // (H // Hkv), nothing is repeated).
        causal: None, "top_left" (query i sees keys <= i, torch SDPA's is_causal) or
            "bottom_right" (query i sees keys <= i + Sk - Sq: the queries are the last keys,
            FlashAttention's convention).
        scale: score multiplier, default 1 / sqrt(D).
        window: (left, right) sliding window: query i sees keys in
            [i' - left, i' + right], i' being i on the diagonal chosen by `causal`
            (bottom-right when causal is None); None or -1 leaves a side unbounded.
        attn_mask: bool (True = attend) or additive mask in q's dtype, broadcastable to
            (B, H, Sq, Sk). It gets no gradient.
        dropout_p: probability of dropping an attention weight (fused; the mask is drawn
            from a seed taken from torch's generator, see draw_dropout_seed).
        return_lse: also return the natural-log logsumexp of the scores, (B, H, Sq) in fp32
            (fp64 for fp64 inputs); -inf for rows that see no key, whose output is 0.
        softcap: > 0 replaces each scaled score s by softcap * tanh(s / softcap) before the
            bias and the masks (Gemma 2's logit softcap).
        alibi_slopes: (H,) or (B, H): adds -slope * |i' - j| to the score of query i and key
            j, i' as for window (ALiBi, FlashAttention's convention). No gradient.
        sinks: (H,) attention-sink logits: each joins its head's softmax denominators
            without a value (gpt-oss); lse includes it, and it gets a gradient.
        deterministic: bitwise reproducible gradients (on CPU also across thread counts);
            None follows torch.are_deterministic_algorithms_enabled().

    Returns:
        out (B, H, Sq, Dv) in q's dtype and memory order, or (out, lse).
    """
    fn = "mha_ext.attention"
    window_left, window_right, bottom_right = _window_bounds(causal, window, fn)
    out, lse = _attention_forward(
        q,
        k,
        v,
        attn_mask,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        fn,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        deterministic=deterministic,
    )
    return (out, lse) if return_lse else out


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    seqused_k: Optional[Tensor] = None,
    deterministic: Optional[bool] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over packed sequences of different lengths, with no padding anywhere.

    Args:
        q: (total_q, H, D), the queries of all sequences one after another; k: (total_k,
            Hkv, D), v: (total_k, Hkv, Dv) likewise.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets: sequence b owns q rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and k/v rows [cu_seqlens_k[b],
            cu_seqlens_k[b + 1]). Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: the longest query and key lengths (bounds the kernels
            plan with; a longer sequence is an error).
        seqused_k: (batch,) int32: sequence b attends to only its first seqused_k[b] keys.
        The other arguments as in attention, applied to each sequence alone (the causal
        diagonal and ALiBi distances per sequence; alibi_slopes (H,) or (batch, H)).

    Returns:
        out (total_q, H, Dv), or (out, lse) with lse (H, total_q) fp32 (fp64 for fp64), as
        FlashAttention's varlen functions return it. Differentiable in q, k, v and sinks.
    """
    fn = "mha_ext.attention_varlen"
    window_left, window_right, bottom_right = _window_bounds(causal, window, fn)
    out, lse = _attention_forward(
        q,
        k,
        v,
        None,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        fn,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        deterministic=deterministic,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on the fused kernels.

    Same arguments and semantics: (N, H, L, E) or (N, L, E) inputs, a bool (True = attend)
    or additive attn_mask broadcastable to (N, H, L, S), is_causal aligned top-left,
    dropout applied whenever dropout_p > 0, and GQA only with enable_gqa=True. Where torch
    rejects attn_mask together with is_causal, this applies both. Rows that see no key
    give 0 here where torch's math path gives NaN.
    """
    fn = "mha_ext.scaled_dot_product_attention"
    rank = query.dim()
    if rank not in (3, 4) or key.dim() != rank or value.dim() != rank:
        raise ValueError(
            f"{fn}: query, key and value must all be 3-D (N, L, E) or all 4-D (N, H, L, E), "
            f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not enable_gqa and query.shape[-3] != key.shape[-3]:
        raise ValueError(
            f"{fn}: query has {query.shape[-3]} heads but key has {key.shape[-3]}; "
            f"pass enable_gqa=True for grouped-query attention"
        )
    unbatched_heads = rank == 3
    if unbatched_heads:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if attn_mask is not None and attn_mask.dim() == 3:  # (N, L, S) -> (N, 1, L, S)
            attn_mask = attn_mask.unsqueeze(1)
    # is_causal is top-left causal; the window bounds as _window_bounds gives them.
    out, _ = _attention_forward(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        scale,
        -1,
        0 if is_causal else -1,
        not is_causal,
        fn,
    )
    return out.squeeze(1) if unbatched_heads else out


def attention_probs(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    attn_mask: Optional[Tensor] = None,
) -> Tensor:
    """The attention probabilities (B, H, Sq, Sk) that attention(..., return_lse=True)
    applied before dropout, rebuilt from its logsumexp. Materialises Sq x Sk per head: for
    inspecting heads, not for the fused path. Arguments as in attention."""
    fn = "mha_ext.attention_probs"
    window_left, window_right, bottom_right = _window_bounds(causal, window, fn)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    compute_dtype = lse.dtype
    # Group the query heads that share a kv head instead of repeating K:
    # (B, Hkv, G, Sq, D) @ (B, Hkv, 1, D, Sk) -> (B, Hkv, G, Sq, Sk)
    grouped_q = q.unflatten(1, (kv_heads, heads // kv_heads)).to(compute_dtype)
    scores = grouped_q @ k.unsqueeze(2).transpose(-1, -2).to(compute_dtype)
    scores = scores.flatten(1, 2) * scale  # (B, H, Sq, Sk)
    diagonal = torch.arange(seq_q, device=q.device)[:, None] + (
        seq_k - seq_q if bottom_right else 0
    )
    key_index = torch.arange(seq_k, device=q.device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        visible &= key_index >= diagonal - window_left
    if window_right >= 0:
        visible &= key_index <= diagonal + window_right
    scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(compute_dtype)
    # A row that sees no key has lse -inf and scores -inf: subtracting 0 keeps it at 0.
    finite_lse = torch.where(lse == float("-inf"), 0.0, lse)
    return torch.exp(scores - finite_lse[..., None]).to(q.dtype)


def paged_kv_append(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Writes new keys and values into a paged cache, in place.

    Args:
        key: (num_tokens, num_kv_heads, head_dim); value: (num_tokens, num_kv_heads, head_dim_v).
        k_cache, v_cache: (num_blocks, num_kv_heads, block_size, head_dim[_v]); any strides with
            a contiguous last dim, so a (num_blocks, block_size, num_kv_heads, head_dim) cache
            works through .transpose(1, 2).
        slot_mapping: (num_tokens,) int64, block * block_size + offset per token; -1 skips the
            token (padding). On CPU every slot is checked before anything is written: a slot
            outside the cache raises and leaves the cache untouched. On CUDA the slots stay on
            the GPU (no sync, CUDA-graph safe) and the kernel skips a slot outside the cache,
            writing only the valid ones; MHA_EXT_CHECK_INDICES=1 checks them on the host
            first and raises as the CPU does.
    """
    ops.paged_kv_append(key, value, k_cache, v_cache, slot_mapping)


def slot_mapping_for(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Slots (int64) of token positions of one sequence whose blocks are `block_table`."""
    block_table = torch.as_tensor(block_table, device=positions.device)
    return (
        block_table[positions // block_size].to(torch.int64) * block_size + positions % block_size
    )


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention for a batch of sequences of different lengths over a paged cache.

    Args:
        q: (total_q, num_heads, head_dim): the queries of all sequences, packed.
        k_cache, v_cache: as in paged_kv_append; num_kv_heads divides num_heads (GQA/MQA).
        block_tables: (batch, max_blocks) int32, the cache blocks of each sequence in order.
        seq_lens: (batch,) int32, cached tokens of each sequence, the new ones included.
        cu_seqlens_q: (batch + 1,) int32: sequence b owns q rows [cu[b], cu[b + 1]). One
            query per sequence is decode, several is chunked prefill; the queries are the last
            tokens of their sequence and attend causally (bottom-right).
        scale: default 1 / sqrt(head_dim).
        return_lse: also return the logsumexp (total_q, num_heads), fp32 (fp64 for fp64).
        window: (left, right): the query at position p sees keys [p - left, p] (Mistral's
            sliding window); left None or -1 is unbounded, right must be None, -1 or 0.
        softcap: > 0 replaces each scaled score s by softcap * tanh(s / softcap) (Gemma 2).
        alibi_slopes: (num_heads,) or (batch, num_heads): adds -slope * (p - j) for key j.
        sinks: (num_heads,) attention-sink logits joining each softmax denominator (gpt-oss).
    """
    fn = "mha_ext.paged_attention"
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = ops.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        _paged_window_left(window, fn),
        float(softcap),
        _head_values(alibi_slopes, q, "alibi_slopes", fn),
        _head_values(sinks, q, "sinks", fn),
    )
    return (out, lse) if return_lse else out


def _paged_window_left(window, fn: str) -> int:
    """window_left of paged attention's op from window = (left, right); the queries attend
    causally, so the right side may only be unbounded or 0."""
    left, right = window_sides(window, fn)
    if right not in (-1, 0):
        raise ValueError(
            f"{fn}: window must be a pair (left, right) with left an int >= 0 or None / -1 "
            f"(unbounded) and right None, -1 or 0 (the queries attend causally), got {window!r}"
        )
    return left


def merge_attention_states(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> Tuple[Tensor, Tensor]:
    """Combines two attentions over disjoint key sets into the attention over both.

    out_a, out_b: (..., head_dim), each normalised over its own keys; lse_a, lse_b: (...)
    their logsumexps (fp32; fp64 for fp64), as attention(..., return_lse=True) and
    paged_attention(..., return_lse=True) return them. A side with lse -inf (no keys) drops
    out exactly. Differentiable in all four inputs.
    """
    return ops.merge_attention_states(out_a, lse_a, out_b, lse_b)

"""Public attention functions on the fused kernels.

scaled_dot_product_attention is a drop-in for torch's; attention exposes the whole feature
set (both causal alignments, sliding windows, logsumexp output). Shapes are
(batch, heads, seq, head_dim); (batch, seq, heads, head_dim) storage works through
.transpose(1, 2) views, without copies.
"""

import math
import numbers
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops

CAUSAL_ALIGNMENTS = (None, "top_left", "bottom_right")

_INT64 = torch.iinfo(torch.int64)

# The dtypes the kernels compute in (csrc/ops/tensor_checks.cpp checks the same list).
KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
    if scale is None:
        # With head_dim 0 every score is an empty dot product, 0 whatever the scale (the
        # default 1/sqrt(0) would be inf): each row averages the values it sees.
        scale = q.shape[-1] ** -0.5 if q.shape[-1] else 1.0
    scale = float(scale)
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
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention (torch 2.14, CPU) on the
    fused kernels.

    Same signature (scale and enable_gqa keyword-only), shapes and results: q (..., L, E),
    k (..., S, E), v (..., S, Ev) of 2 or more dims whose leading dims broadcast (folded into
    the kernels' batch, as views where the strides allow); a bool (True = attend), float32 or
    query-dtype attn_mask that broadcasts to the attention weights (..., L, S) (a float32
    mask reaches the kernels in query's dtype, rounded for half types); is_causal
    aligned top-left; dropout applied whenever dropout_p > 0 (1 gives zeros); GQA (dim -3)
    only with enable_gqa=True; zeros shaped by query when L is 0 or value is empty. A row
    that sees no key gives 0, as torch gives.

    Where torch raises, this raises the same exception class (TypeError, RuntimeError,
    IndexError, NotImplementedError) with a message naming the arguments and values. It
    departs from torch where torch's result is undefined or out of the kernels' reach:
    key and value of different lengths, a non-finite scale, GQA with 0 kv heads, and a
    negative or NaN dropout_p raise RuntimeError (torch reads past value's rows, gives NaN,
    divides by zero, or ignores the bad dropout_p on its math path); head dims above 256
    raise RuntimeError; an attn_mask that requires grad raises ValueError (the kernels give
    the mask no gradient); nested tensors raise RuntimeError. is_causal with a negative
    scale gives the softmax of the scaled scores, as torch's math path does (its CPU flash
    kernel returns NaN).
    The extended features (bottom-right causal, windows, lse, softcap, ALiBi, sinks, mask
    and is_causal together) are in mha_ext.attention.
    """
    if attn_mask is None and dropout_p.__class__ in (float, int) and dropout_p == 0:
        # A decode loop's call: where every check below would pass and adapt nothing, one
        # C++ call does it all (at (1, 1, 1, 64) the checks cost more than the kernel).
        out = ops.sdpa_in_kernel_layout(query, key, value, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    fn = "mha_ext.scaled_dot_product_attention"
    _check_sdpa_argument_types(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fn
    )
    dropout_p = dropout_p.item() if isinstance(dropout_p, Tensor) else dropout_p
    scale = scale.item() if isinstance(scale, Tensor) else scale
    _check_sdpa_inputs(query, key, value, attn_mask, is_causal, fn)
    if query.shape[-2] == 0 or value.numel() == 0:
        # torch 2.14 returns zeros (..., L, Ev) shaped by query alone for no queries or no
        # values, before checking anything else (dropout_p, heads, broadcasting, the mask).
        return _sdpa_zeros(query, key, value)
    if enable_gqa:
        _check_sdpa_grouped_heads(query, key, value, fn)
    batch, weights_shape = _sdpa_batch_shapes(query, key, value, enable_gqa, fn)
    if attn_mask is not None:
        _check_sdpa_mask_shape(
            query, key, value, attn_mask, dropout_p, enable_gqa, weights_shape, fn
        )
    _check_sdpa_computable(query, key, value, dropout_p, fn)
    out_shape = batch + (query.shape[-2], value.shape[-1])  # (..., L, Ev)
    # What the kernels need that torch does not: a contiguous last dim, one mask dtype,
    # k and v with one head count, a (B, H, N, D) batch.
    if not query.stride(-1) == key.stride(-1) == value.stride(-1) == 1:
        query, key, value = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
        attn_mask = attn_mask.to(query.dtype)
    if enable_gqa and key.shape[-3] != value.shape[-3]:
        # torch repeats each to query's heads; the kernels want one kv head count.
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    if math.prod(batch) == 0:
        # Nothing to compute: empty kernel inputs (the kernels want heads >= 1), sliced from
        # the inputs so that backward gives them the zero gradients torch gives.
        query, key, value = (
            t.flatten()[:0].view(0, 1, 0, t.shape[-1]) for t in (query, key, value)
        )
        attn_mask = None
    else:
        heads = batch[-1] if batch else 1
        kv_heads = key.shape[-3] if enable_gqa else heads  # GQA: the kernels group the heads
        query = _sdpa_kernel_batch(query, batch, heads)  # (B, H, L, E)
        key = _sdpa_kernel_batch(key, batch[:-1] + (kv_heads,), kv_heads)  # (B, Hkv, S, E)
        value = _sdpa_kernel_batch(value, batch[:-1] + (kv_heads,), kv_heads)  # (B, Hkv, S, Ev)
        if attn_mask is not None and len(batch) > 2:
            # Fold the mask's leading dims as q's, keeping its heads / L / S dims (size 1 or
            # full: the kernels broadcast those without a copy). (B, Hm, Lm, Sm)
            lead_ones = (1,) * (len(batch) + 2 - attn_mask.dim())
            attn_mask = attn_mask.reshape(lead_ones + attn_mask.shape)
            attn_mask = attn_mask.expand(batch[:-1] + attn_mask.shape[-3:]).flatten(0, -4)
    # With E = 0 every score is an empty dot product, 0 whatever the scale (torch's default
    # 1/sqrt(0) is inf), and torch gives the mean of the visible values: so does scale 1.
    if query.shape[-1] == 0:
        scale = 1.0
    out, _ = _attention_forward(
        query,
        key,
        value,
        attn_mask,
        0.0 if dropout_p == 1 else dropout_p,
        scale,
        -1,
        0 if is_causal else -1,
        not is_causal,
        fn,
    )
    if dropout_p == 1:
        # Dropping every weight leaves zeros; multiplying keeps the graph, so q, k and v get
        # the zero gradients torch gives them.
        out = out * 0
    return out if out.shape == out_shape else out.reshape(out_shape)


def _sdpa_zeros(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Zeros (..., L, Ev) in query's dtype; when an input requires grad, tied to all three by
    sums over nothing, so backward gives them the zero gradients torch gives (whatever
    their values, NaN included)."""
    out = query.new_zeros(query.shape[:-1] + (value.shape[-1],))
    if not (
        torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad or value.requires_grad)
    ):
        return out
    nothing = query[..., :0].sum(-1, keepdim=True) + key[..., :0].sum() + value[..., :0].sum()
    return out + nothing


def _check_sdpa_argument_types(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, fn: str
) -> None:
    """TypeError where torch's argument parser rejects an argument: tensors must be Tensors,
    floats real numbers or 0-d tensors that need no grad, bools Python bools."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{fn}: argument '{name}' must be Tensor, not {type(tensor).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(
            f"{fn}: argument 'attn_mask' must be Tensor or None, not {type(attn_mask).__name__}"
        )
    for name, number in (("dropout_p", dropout_p), ("scale", scale)):
        if name == "scale" and number is None:
            continue
        if type(number) in (float, int, bool):
            continue
        if isinstance(number, Tensor):
            real = number.dim() == 0 and not number.requires_grad
        else:
            real = isinstance(number, (numbers.Real, torch.SymInt, torch.SymFloat))
        if not real:
            raise TypeError(f"{fn}: argument '{name}' must be float, not {_type_name(number)}")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, (bool, torch.SymBool)):
            raise TypeError(f"{fn}: argument '{name}' must be bool, not {type(flag).__name__}")


def _type_name(value) -> str:
    if isinstance(value, Tensor):
        return f"Tensor of shape {tuple(value.shape)}{' requiring grad' * value.requires_grad}"
    return type(value).__name__


def _check_sdpa_inputs(query, key, value, attn_mask, is_causal, fn: str) -> None:
    """RuntimeError for what torch's validate_sdpa_input rejects: checked before anything
    else, empty inputs included."""
    if query.is_nested or key.is_nested or value.is_nested:
        raise RuntimeError(
            f"{fn}: nested tensors are not supported; pack the sequences for "
            f"mha_ext.attention_varlen instead"
        )
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(
            f"{fn}: query, key and value must have the same dtype, got query {query.dtype}, "
            f"key {key.dtype}, value {value.dtype}"
        )
    if not query.device == key.device == value.device:
        raise RuntimeError(
            f"{fn}: query, key and value must be on the same device, got query on "
            f"{query.device}, key on {key.device}, value on {value.device}"
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(
            f"{fn}: attn_mask must be torch.bool, torch.float32 or query's dtype "
            f"{query.dtype}, got {attn_mask.dtype}"
        )
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError(
            f"{fn}: query, key and value must be at least 2-D (..., L or S, E), got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if is_causal and attn_mask is not None:
        raise RuntimeError(
            f"{fn}: attn_mask must be None when is_causal=True (torch rejects both together), "
            f"got a mask of shape {tuple(attn_mask.shape)}; mha_ext.attention(causal="
            f"'top_left', attn_mask=...) applies both"
        )


def _check_sdpa_computable(query, key, value, dropout_p, fn: str) -> None:
    """What torch rejects once it computes (after the shape checks)."""
    if query.dtype not in KERNEL_DTYPES:
        # torch: RuntimeError for integer dtypes, NotImplementedError (a RuntimeError) for
        # the floating and complex ones its kernels lack.
        floating = query.dtype.is_floating_point or query.dtype.is_complex
        raise (NotImplementedError if floating else RuntimeError)(
            f"{fn}: query, key and value have dtype {query.dtype}; supported dtypes are "
            f"{', '.join(str(dtype) for dtype in KERNEL_DTYPES)}"
        )
    if not 0.0 <= dropout_p <= 1.0:
        raise RuntimeError(f"{fn}: dropout_p must be in [0, 1], got {dropout_p}")
    if query.shape[-1] != key.shape[-1]:
        raise RuntimeError(
            f"{fn}: query and key must share the embedding dim E, got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"{fn}: key and value must share the source length S, got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}"
        )


def _check_sdpa_grouped_heads(query: Tensor, key: Tensor, value: Tensor, fn: str) -> None:
    """enable_gqa=True: torch reads the heads from dim -3 (IndexError below 3-D) and repeats
    kv head j for query heads j * g .. j * g + g - 1 (the kernels' own GQA mapping), so the
    heads of key and of value must each divide query's."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() < 3:
            raise IndexError(
                f"{fn}: enable_gqa=True reads the heads from dim -3, but {name} has shape "
                f"{tuple(tensor.shape)}"
            )
    heads = query.shape[-3]
    for name, tensor in (("key", key), ("value", value)):
        kv_heads = tensor.shape[-3]
        if (heads % kv_heads != 0) if kv_heads != 0 else heads != 0:
            raise RuntimeError(
                f"{fn}: with enable_gqa=True the heads of key and value must divide query's "
                f"{heads} heads, got {name} with {kv_heads}"
            )


def _broadcast_shapes(named_shapes, fn: str) -> Tuple:
    """numpy-style broadcast of the shapes (the batch dims torch's matmuls broadcast);
    RuntimeError naming the tensors when they do not broadcast."""
    first = named_shapes[0][1]
    if all(shape == first for _, shape in named_shapes):
        return first
    rank = max(len(shape) for _, shape in named_shapes)
    result = []
    for dim in range(rank):
        size = 1
        for _, shape in named_shapes:
            index = dim - rank + len(shape)
            if index < 0 or shape[index] == 1:
                continue
            if size != 1 and shape[index] != size:
                listed = ", ".join(f"{name} {tuple(shape)}" for name, shape in named_shapes)
                raise RuntimeError(f"{fn}: the leading (batch) dims do not broadcast: {listed}")
            size = shape[index]
        result.append(size)
    return tuple(result)


def _sdpa_batch_shapes(
    query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool, fn: str
) -> Tuple[Tuple, Tuple]:
    """(batch, weights_shape): the broadcast leading dims of the output (its heads last),
    and the shape (..., L, S) of the attention weights an attn_mask must broadcast to."""
    # Leading dims; under GQA the kv heads stand for query's (grouped, not broadcast).
    tail = 3 if enable_gqa else 2
    q_shape, k_shape = query.shape, key.shape
    q_lead, k_lead, v_lead = q_shape[:-tail], k_shape[:-tail], value.shape[:-tail]
    heads = (q_shape[-3],) if enable_gqa else ()
    weights_lead = _broadcast_shapes((("query", q_lead), ("key", k_lead)), fn)
    batch = tuple(
        weights_lead
        if v_lead == weights_lead
        else _broadcast_shapes((("query", q_lead), ("key", k_lead), ("value", v_lead)), fn)
    )
    batch += heads
    weights_shape = tuple(weights_lead) + heads + (q_shape[-2], k_shape[-2])
    if len(q_shape) == len(k_shape) == value.dim() == 3:
        # torch 2.14 runs 3-D inputs as (1, N, L, E): a mask may carry that leading 1.
        weights_shape = (1,) + weights_shape
    return batch, weights_shape


def _check_sdpa_mask_shape(
    query, key, value, attn_mask, dropout_p, enable_gqa, weights_shape, fn: str
) -> None:
    """torch adds the mask to the weights in place: it must broadcast to their shape without
    growing it. A mask of fewer than 2 dims is an IndexError where torch 2.14's CPU flash
    kernel would take the call (its gate reads attn_mask.size(-2)), and broadcasts elsewhere."""
    if attn_mask.dim() < 2 and _torch_cpu_flash_gate_reads_mask(
        query, key, value, dropout_p, enable_gqa
    ):
        raise IndexError(
            f"{fn}: attn_mask of shape {tuple(attn_mask.shape)} has no (L, S) dims; torch "
            f"needs at least 2 for 4-D query, key and value"
        )
    mask_shape = tuple(attn_mask.shape)
    fits = len(mask_shape) <= len(weights_shape) and all(
        size == 1 or size == full for size, full in zip(mask_shape[::-1], weights_shape[::-1])
    )
    if not fits:
        raise RuntimeError(
            f"{fn}: attn_mask of shape {mask_shape} does not broadcast to the attention "
            f"weights' shape {weights_shape}"
        )


def _torch_cpu_flash_gate_reads_mask(query, key, value, dropout_p, enable_gqa) -> bool:
    """Whether torch 2.14's CPU flash gate gets as far as the mask's shape: 4-D inputs, no
    dropout, a nonzero batch size shared by all three, and heads it takes (equal, k and v
    with one head, or k and v sharing a head count that divides query's under enable_gqa).
    (Its zero-length checks come first too; empty L or S never get here.)"""
    if not (query.dim() == key.dim() == value.dim() == 4) or dropout_p > 0:
        return False
    batch, heads, kv_heads = query.shape[0], query.shape[1], key.shape[1]
    if 0 in (batch, heads) or not batch == key.shape[0] == value.shape[0]:
        return False
    if kv_heads != value.shape[1]:
        return False
    return kv_heads in (heads, 1) or (enable_gqa and heads % kv_heads == 0)


def _sdpa_kernel_batch(tensor: Tensor, batch: Tuple, heads) -> Tensor:
    """tensor (..., N, D) as the kernels' (B, heads, N, D): broadcast to `batch`, the leading
    dims folded into B (a view unless broadcast dims must merge with others)."""
    lead = tensor.shape[:-2]
    if lead == batch and len(batch) == 2:
        return tensor  # already (B, H, N, D): the common case pays no view
    if lead != batch:
        tensor = tensor.expand(batch + tensor.shape[-2:])
    return tensor.reshape((math.prod(batch[:-1]), heads) + tensor.shape[-2:])


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
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scales: Optional[Tensor] = None,
    v_scales: Optional[Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
        k_scales, v_scales, k_scale, v_scale: the scales of an 8-bit cache (PagedKVCache
            allocates and passes them), which quantizes the rows as it writes them (key and
            value fp32, bf16 or fp16):
            - torch.int8 caches: symmetric, one fp32 scale per (token, kv head) row,
              scale = absmax(row) / 127, stored = clamp(round_half_to_even(x / scale), -127,
              127) (0 with scale 0 for an all-zero row); the scales are written into k_scales /
              v_scales, (num_blocks, num_kv_heads, block_size) fp32 (any strides) at the row's
              slot. k_scale / v_scale stay 1.
            - torch.float8_e4m3fn caches: one scale per cache tensor, k_scale / v_scale > 0
              (as vLLM and FlashInfer), stored = (x / k_scale) saturated to +-448 and rounded
              to e4m3fn (ties to even); no scale tensors.
            mha_ext.reference.quantize_int8 / quantize_float8 give the same bits. Bad scales
            raise before anything is written.
    """
    ops.paged_kv_append(
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales,
        v_scales,
        float(k_scale),
        float(v_scale),
    )


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
    k_scales: Optional[Tensor] = None,
    v_scales: Optional[Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
        k_scales, v_scales, k_scale, v_scale: an 8-bit cache's scales, as paged_kv_append
            took them; the kernels dequantize the cache as they read it (q fp32, bf16 or fp16,
            the output in q's dtype).
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
        k_scales,
        v_scales,
        float(k_scale),
        float(v_scale),
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

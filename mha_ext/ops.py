"""Typed wrappers over torch.ops.mha_ext.*, plus what torch.compile and autograd need.

The schemas are declared once in csrc/ops.cpp; the op files csrc/ops/<family>.{h,cpp} hold
each op's C++ body and register it for every backend, as does attention's autograd (in
csrc/ops/attention.cpp: its backward is the attention_backward op). This
module adds the fake (meta) implementations, which let torch.compile trace the ops without
running them, and the autograd formula of merge_attention_states.

The ops a decode loop calls every step (attention_forward, paged_kv_append,
paged_attention) go through _C's direct entry points (csrc/python_calls.cpp): the same
dispatcher call without torch.ops' per-argument boxing, a few microseconds a call.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C  # loading the library registers the ops

_ops = torch.ops.mha_ext
_has_torch_function = torch._C._has_torch_function
_is_compiling = torch.compiler.is_compiling


def calls_directly(tensors: tuple) -> bool:
    """Whether an op call on these arguments may take _C's direct entry point: not while
    torch.compile traces (it traces torch.ops) and not when an argument overrides
    __torch_function__ or a TorchFunctionMode is active (torch.ops honours them)."""
    return not _is_compiling() and not _has_torch_function(tensors)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    dropout_seed: Optional[Tensor],
    dropout_p: float,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Fused attention; returns (out, lse). See csrc/ops.cpp for the argument contract."""
    args = (
        q,
        k,
        v,
        attn_mask,
        dropout_seed,
        dropout_p,
        scale,
        window_left,
        window_right,
        bottom_right,
        softcap,
        alibi_slopes,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        deterministic,
    )
    tensors = (q, k, v, attn_mask, dropout_seed, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k)
    if calls_directly(tensors + (seqused_k,)):
        return _C.attention_forward(*args)
    return _ops.attention_forward.default(*args)


def sdpa_in_kernel_layout(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
) -> Optional[Tensor]:
    """scaled_dot_product_attention without mask or dropout in one C++ call, where query, key
    and value are already the kernels' (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev) and need
    none of its checks' adaptations; None otherwise (csrc/python_calls.cpp says exactly when).
    """
    if not calls_directly((query, key, value)):
        return None
    return _C._sdpa_in_kernel_layout(query, key, value, is_causal, scale, enable_gqa)


def attention_backward(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *options,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (grad_q, grad_k, grad_v, grad_sinks) of attention_forward from its saved out
    and lse; `options` are attention_forward's arguments after v."""
    return _ops.attention_backward.default(grad_out, grad_lse, q, k, v, out, lse, *options)


def dropout_mask(
    dropout_seed: Tensor, batch: int, num_heads: int, seq_q: int, seq_k: int, dropout_p: float
) -> Tensor:
    """The bool keep-mask (batch, num_heads, seq_q, seq_k) that attention draws from this seed."""
    return _ops.dropout_mask.default(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p)


def paged_kv_append(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scales: Optional[Tensor] = None,
    v_scales: Optional[Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes key/value rows into the caches in place at slot_mapping (-1 skips a token),
    quantized for an 8-bit cache (int8: k_scales / v_scales written too)."""
    tensors = (key, value, k_cache, v_cache, slot_mapping)
    args = (*tensors, k_scales, v_scales, k_scale, v_scale)
    if calls_directly(tensors + (k_scales, v_scales)):
        _C.paged_kv_append(*args)
    else:
        _ops.paged_kv_append.default(*args)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    window_left: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    k_scales: Optional[Tensor] = None,
    v_scales: Optional[Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """Attention of packed queries over paged caches; returns (out, lse). See csrc/ops.cpp
    for the argument contract."""
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    args = (*tensors, scale, window_left, softcap, alibi_slopes, sinks)
    args += (k_scales, v_scales, k_scale, v_scale)
    if calls_directly(tensors + (alibi_slopes, sinks, k_scales, v_scales)):
        return _C.paged_attention(*args)
    return _ops.paged_attention.default(*args)


def merge_attention_states(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> Tuple[Tensor, Tensor]:
    """Combines two partial attentions over disjoint keys; returns (out, lse)."""
    return _ops.merge_attention_states.default(out_a, lse_a, out_b, lse_b)


# attention_forward's options after v, as csrc/ops.cpp orders them: sinks is the 13th
# argument, the 10th option.
SINKS_OPTION = 9


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The logsumexp dtype of attention on `dtype` inputs: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("mha_ext::attention_forward")
def _attention_forward_fake(q, k, v, *options):
    head_dim_v = v.shape[-1]
    if q.dim() == 3:  # packed: (total_q, heads, head_dim), lse (heads, total_q)
        total_q, heads, _ = q.shape
        out = q.new_empty(total_q, heads, head_dim_v)
        return out, q.new_empty(heads, total_q, dtype=lse_dtype(q.dtype))
    batch, heads, seq_q, _ = q.shape
    # Same layout rule as empty_attention_output in csrc/ops/attention.h: the output
    # keeps q's memory order, so (B, S, H, D) views stay views through the op.
    if q.stride(1) < q.stride(2):
        out = q.new_empty(batch, seq_q, heads, head_dim_v).transpose(1, 2)
    else:
        out = q.new_empty(batch, heads, seq_q, head_dim_v)
    return out, q.new_empty(batch, heads, seq_q, dtype=lse_dtype(q.dtype))


@torch.library.register_fake("mha_ext::attention_backward")
def _attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, *options):
    sinks = options[SINKS_OPTION] if len(options) > SINKS_OPTION else None
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else lse.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), grad_sinks


@torch.library.register_fake("mha_ext::dropout_mask")
def _dropout_mask_fake(dropout_seed, batch, num_heads, seq_q, seq_k, dropout_p):
    return dropout_seed.new_empty(batch, num_heads, seq_q, seq_k, dtype=torch.bool)


@torch.library.register_fake("mha_ext::paged_kv_append")
def _paged_kv_append_fake(key, value, k_cache, v_cache, slot_mapping, *scales):
    return None


@torch.library.register_fake("mha_ext::paged_attention")
def _paged_attention_fake(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    window_left=-1,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    *scales,
):
    total_q, heads, _ = q.shape
    out = q.new_empty(total_q, heads, v_cache.shape[-1])
    return out, q.new_empty(total_q, heads, dtype=lse_dtype(q.dtype))


@torch.library.register_fake("mha_ext::merge_attention_states")
def _merge_attention_states_fake(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _merge_setup_context(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b = inputs
    _, lse = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, lse)


def _merge_backward(ctx, grad_out, grad_lse):
    # out = w_a out_a + w_b out_b with w_x = exp(lse_x - lse), so
    # d out / d lse_x = w_x (out_x - out) and d lse / d lse_x = w_x. An empty side has w = 0
    # and gets zero gradients even if its output holds garbage. The spreads are taken in the
    # lse's (accumulation) dtype against out recomputed there: the saved out is rounded to
    # fp16/bf16, and out_x - out of rounded values lost ~2.5e-3 of an fp16 gradient.
    out_a, lse_a, out_b, lse_b, lse = ctx.saved_tensors
    weights = [torch.where(x == float("-inf"), 0.0, torch.exp(x - lse)) for x in (lse_a, lse_b)]
    outs = [x.to(lse.dtype) for x in (out_a, out_b)]
    terms = [torch.where(w[..., None] == 0, 0.0, w[..., None] * o) for w, o in zip(weights, outs)]
    out = terms[0] + terms[1]
    grad_out_wide = grad_out.to(lse.dtype)
    grads = []
    for out_x, weight in zip(outs, weights):
        spread = (grad_out_wide * (out_x - out)).sum(-1)
        grad_lse_x = torch.where(weight == 0, 0.0, weight * (spread + grad_lse))
        grad_out_x = torch.where(
            weight[..., None] == 0, 0.0, weight[..., None].to(grad_out.dtype) * grad_out
        )
        grads += [grad_out_x, grad_lse_x]
    return tuple(grads)


torch.library.register_autograd(
    "mha_ext::merge_attention_states", _merge_backward, setup_context=_merge_setup_context
)

"""mha_ext behind torch's SDPA provider hook (torch.nn.attention, torch >= 2.14).

Importing mha_ext registers the flash-attention provider "mha_ext"; nothing changes until

    torch.nn.attention.activate_flash_attention_impl("mha_ext")

makes mha_ext's kernels the kernels of torch's flash-attention ops:

    CPU   aten::_scaled_dot_product_flash_attention_for_cpu and its backward: every
          F.scaled_dot_product_attention that torch runs on its CPU flash kernel
          (nn.MultiheadAttention, nn.Transformer*, Hugging Face's "sdpa" models, compiled code)
    CPU, CUDA  aten::_flash_attention_forward, its in-place form and its backward:
          torch.nn.attention.varlen.varlen_attn / varlen_attn_out (torch has no CPU kernel)
    CUDA  aten::_scaled_dot_product_flash_attention and its backward

torch.nn.attention.restore_flash_attention_impl() gives torch its kernels back. Each op keeps
its torch semantics: output and gradient layouts, the logsumexp's shape, dtype, layout and its
value for a row that sees no key (0 on the CPU op, +inf on the FlashAttention-2 ops), causal
alignment (top-left on the CPU op, bottom-right on the FlashAttention-2 ops, as torch's CUDA
kernel aligns it), masks, scale and grouped-query heads. A call mha_ext cannot take (dropout,
debug masks, ALiBi, seqused_k, paged KV, a dtype or layout its kernels lack) runs torch's own
kernel, reached through csrc/integrations/torch_flash_native.cpp; logging.DEBUG on this
module's logger says why. mha_ext's work shows in torch.profiler as mha_ext::attention_forward
and mha_ext::attention_backward.
"""

import functools
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.attention
from torch import Tensor

from .. import ops

PROVIDER = "mha_ext"

logger = logging.getLogger(__name__)

# The kernels mha_ext has; head dims up to csrc/ops/tensor_checks.h's kMaxHeadDim.
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256

# torch's flash kernels, reached past the dispatcher (csrc/integrations/torch_flash_native.cpp).
_native = torch.ops.torch_flash_native


@functools.cache
def _has_kernel(op: str, device_type: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, device_type.upper())


def _runs_on_cuda() -> bool:
    """Whether this build has mha_ext's CUDA kernels and the entry points to torch's."""
    return _has_kernel("mha_ext::attention_forward", "cuda") and _has_kernel(
        "torch_flash_native::flash_cuda", "cuda"
    )


# ---- what mha_ext's kernels can take: each *_problem returns why not, or None ----


def _rows_problem(tensor: Tensor) -> bool:
    """A last dim the kernels cannot read as rows (they need stride 1)."""
    return tensor.shape[-1] > 1 and tensor.stride(-1) != 1 and tensor.numel() > 0


def _qkv_problem(query: Tensor, key: Tensor, value: Tensor, packed: bool) -> Optional[str]:
    """q, k, v as mha_ext's op takes them: (B, H, S, D), or packed (total, H, D)."""
    rank = 3 if packed else 4
    if any(t.dim() != rank for t in (query, key, value)):
        return f"q, k, v of ranks {query.dim()}, {key.dim()}, {value.dim()} (need {rank})"
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    if key.device != query.device or value.device != query.device:
        return "q, k, v on different devices"
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or kv_heads == 0 or heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key and {value.shape[1]} value heads"
    seq_dim = 0 if packed else 2
    if key.shape[seq_dim] != value.shape[seq_dim]:
        return "different numbers of keys and values"
    if not packed and not query.shape[0] == key.shape[0] == value.shape[0]:
        return "different batch sizes"
    # torch's flash ops take one head dim for q, k and v (their outputs are shaped like q).
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        return "different head dims"
    if query.shape[-1] > _MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} > {_MAX_HEAD_DIM}"
    if any(_rows_problem(t) for t in (query, key, value)):
        return "a last dim with stride != 1"
    return None


def _scale_problem(scale: Optional[float]) -> Optional[str]:
    return None if scale is None or math.isfinite(scale) else f"scale {scale}"


def _mask_problem(mask: Optional[Tensor], query: Tensor, key: Tensor) -> Optional[str]:
    """attn_mask as mha_ext's op takes it: bool or q's dtype, broadcastable to the scores."""
    if mask is None:
        return None
    if mask.dtype not in (torch.bool, query.dtype):
        return f"a {mask.dtype} attn_mask for {query.dtype} q"
    if mask.device != query.device:
        return "attn_mask on another device"
    scores = (*query.shape[:3], key.shape[2])
    if mask.dim() > 4 or any(
        size not in (1, full) for size, full in zip(reversed(mask.shape), reversed(scores))
    ):
        return f"attn_mask of shape {tuple(mask.shape)} for scores of shape {scores}"
    return None


def _saved_problem(
    grad_out: Tensor, query: Tensor, out: Tensor, lse: Tensor, lse_shape
) -> Optional[str]:
    """A backward's grad_out and the forward's saved out and logsumexp, q's layout."""
    for name, tensor in (("out", out), ("grad_out", grad_out)):
        if tensor.shape != query.shape or tensor.dtype != query.dtype:
            return f"{name} of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
    if _rows_problem(out):
        return "out with a last dim of stride != 1"
    if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != ops.lse_dtype(query.dtype):
        return f"logsumexp of shape {tuple(lse.shape)} and dtype {lse.dtype}"
    return None


# ---- pieces every kernel uses ----


def _scale(query: Tensor, scale: Optional[float]) -> float:
    return query.shape[-1] ** -0.5 if scale is None else float(scale)


def _options(mask, scale, window_left, window_right, bottom_right, *packing):
    """attention_forward's arguments after v, which attention_backward takes too, for a call
    without dropout, softcap, ALiBi, sinks or seqused_k; packing: cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k of a packed call, none for a dense one."""
    cu_q, cu_k, max_q, max_k = packing or (None, None, 0, 0)
    no_dropout = (None, 0.0)  # dropout_seed, dropout_p
    no_score_mods = (0.0, None, None)  # softcap, alibi_slopes, sinks
    deterministic = torch.are_deterministic_algorithms_enabled()
    seqused_k = None
    window = (window_left, window_right, bottom_right)
    packed = (cu_q, cu_k, seqused_k, max_q, max_k)
    return (mask, *no_dropout, scale, *window, *no_score_mods, *packed, deterministic)


def _gradients(grad_out, query, key, value, out, lse, options):
    """grad_q, grad_k, grad_v from mha_ext's backward; grad_out gets the stride-1 rows the
    kernels read (out.sum() gives a broadcast one)."""
    if _rows_problem(grad_out):
        grad_out = grad_out.contiguous()
    return ops.attention_backward(grad_out, None, query, key, value, out, lse, *options)[:3]


def _laid_out_like(result: Tensor, like: Tensor) -> Tensor:
    """result in the memory layout torch.empty_like(like) has, which torch's kernels return
    (and torch.compile's fake kernels promise); copied only where mha_ext's layout differs."""
    if result.stride() == like.stride():
        return result
    target = torch.empty_like(like, dtype=result.dtype)
    return result if target.stride() == result.stride() else target.copy_(result)


def _fall_through(op: str, problem: str, native, *args):
    """torch's own kernel for aten::`op`, as mha_ext cannot take `problem`; where torch has
    none (its FlashAttention-2 ops on CPU: native is None), the error torch would raise."""
    logger.debug("aten::%s runs torch's kernel: mha_ext cannot take %s", op, problem)
    if native is None:
        raise NotImplementedError(
            f"aten::{op} has no CPU kernel in torch, and mha_ext's cannot take {problem}"
        )
    return native(*args)


# ---- aten::_scaled_dot_product_flash_attention_for_cpu and its backward: (B, H, S, D),
# is_causal aligned top-left. Each op's arguments come in a record whose fields follow its
# schema, which its torch_flash_native entry point shares. ----


class _CpuSdpa(NamedTuple):
    query: Tensor
    key: Tensor
    value: Tensor
    dropout_p: float = 0.0
    is_causal: bool = False
    attn_mask: Optional[Tensor] = None
    scale: Optional[float] = None


class _CpuSdpaBackward(NamedTuple):
    grad_out: Tensor
    query: Tensor
    key: Tensor
    value: Tensor
    out: Tensor
    logsumexp: Tensor
    dropout_p: float
    is_causal: bool
    attn_mask: Optional[Tensor] = None
    scale: Optional[float] = None


def _cpu_problem(call) -> Optional[str]:
    if call.dropout_p > 0.0:
        # The backward op takes no RNG state, so nothing could redraw the forward's mask.
        return f"dropout_p {call.dropout_p}"
    return (
        _qkv_problem(call.query, call.key, call.value, packed=False)
        or _scale_problem(call.scale)
        or _mask_problem(call.attn_mask, call.query, call.key)
    )


def _cpu_options(call):
    window_right = 0 if call.is_causal else -1
    return _options(call.attn_mask, _scale(call.query, call.scale), -1, window_right, False)


def _cpu_sdpa(*args, **kwargs):
    call = _CpuSdpa(*args, **kwargs)
    problem = _cpu_problem(call)
    if problem is not None:
        return _fall_through(_CPU_SDPA, problem, _native.sdpa_cpu, *call)
    out, lse = ops.attention_forward(call.query, call.key, call.value, *_cpu_options(call))
    # A row that sees no key (top-left causal always shows it key 0) has logsumexp 0 in
    # torch's kernel, -inf in mha_ext's.
    if call.attn_mask is not None or call.key.shape[2] == 0:
        lse.masked_fill_(lse == -math.inf, 0.0)
    batch, heads, seq_q = lse.shape
    # torch's logsumexp is (B, H, Sq) over (B, Sq, H) storage.
    torch_lse = lse.new_empty(batch, seq_q, heads).transpose(1, 2).copy_(lse)
    return _laid_out_like(out, call.query), torch_lse


def _cpu_sdpa_backward(*args, **kwargs):
    call = _CpuSdpaBackward(*args, **kwargs)
    problem = _cpu_problem(call) or _saved_problem(
        call.grad_out, call.query, call.out, call.logsumexp, call.query.shape[:3]
    )
    if problem is not None:
        return _fall_through(_CPU_SDPA_BACKWARD, problem, _native.sdpa_cpu_backward, *call)
    grads = _gradients(*call[:6], _cpu_options(call))
    # torch's kernel returns the gradients over (B, S, H, D) storage.
    return tuple(_bshd_storage(grad) for grad in grads)


def _bshd_storage(tensor: Tensor) -> Tensor:
    """tensor (B, H, S, D) over (B, S, H, D) storage, copied only if it is not already."""
    _, heads, seq, dim = tensor.shape
    if tensor.stride() == (seq * heads * dim, dim, heads * dim, 1):
        return tensor
    storage = torch.empty_permuted(
        tensor.shape, (0, 2, 1, 3), dtype=tensor.dtype, device=tensor.device
    )
    return storage.copy_(tensor)


# ---- torch's FlashAttention-2 ops: aten::_flash_attention_forward (its in-place form, its
# backward) with q, k, v (B, S, H, D) or packed (total, H, D) with cum_seq_q / cum_seq_k; and
# on CUDA aten::_scaled_dot_product_flash_attention (and backward), which torch builds on it
# with (B, H, S, D) tensors. Causal and windows align bottom-right (per sequence). ----


class _FlashForward(NamedTuple):
    query: Tensor
    key: Tensor
    value: Tensor
    cum_seq_q: Optional[Tensor]
    cum_seq_k: Optional[Tensor]
    max_q: int
    max_k: int
    dropout_p: float
    is_causal: bool
    return_debug_mask: bool
    scale: Optional[float] = None
    window_size_left: Optional[int] = None
    window_size_right: Optional[int] = None
    seqused_k: Optional[Tensor] = None
    alibi_slopes: Optional[Tensor] = None
    block_table: Optional[Tensor] = None
    num_splits: Optional[int] = None


class _FlashBackward(NamedTuple):
    grad_out: Tensor
    query: Tensor
    key: Tensor
    value: Tensor
    out: Tensor
    logsumexp: Tensor
    cum_seq_q: Optional[Tensor]
    cum_seq_k: Optional[Tensor]
    max_q: int
    max_k: int
    dropout_p: float
    is_causal: bool
    rng_state: Tensor
    unused: Tensor
    scale: Optional[float] = None
    window_size_left: Optional[int] = None
    window_size_right: Optional[int] = None


class _CudaSdpa(NamedTuple):
    query: Tensor
    key: Tensor
    value: Tensor
    dropout_p: float = 0.0
    is_causal: bool = False
    return_debug_mask: bool = False
    scale: Optional[float] = None


class _CudaSdpaBackward(NamedTuple):
    grad_out: Tensor
    query: Tensor
    key: Tensor
    value: Tensor
    out: Tensor
    logsumexp: Tensor
    cum_seq_q: Optional[Tensor]
    cum_seq_k: Optional[Tensor]
    max_q: int
    max_k: int
    dropout_p: float
    is_causal: bool
    philox_seed: Tensor
    philox_offset: Tensor
    scale: Optional[float] = None


def _fa2_problem(query, key, value, call, packing) -> Optional[str]:
    """Why mha_ext cannot take `call` (any of the records above), whose q, k, v are given in
    mha_ext's layout."""
    if call.dropout_p > 0.0:
        return f"dropout_p {call.dropout_p}"  # mha_ext's dropout RNG is not torch's Philox
    if getattr(call, "return_debug_mask", False):
        return "return_debug_mask"
    # The backward op takes none of these, so it could not give their gradients (torch takes
    # seqused_k and block_table for inference only).
    for name in ("alibi_slopes", "seqused_k", "block_table"):
        if getattr(call, name, None) is not None:
            return name
    if not packing and getattr(call, "cum_seq_k", None) is not None:
        return "cum_seq_k without cum_seq_q"
    if packing:
        cum_seq_q, cum_seq_k = packing[:2]
        if cum_seq_k is None:
            return "cum_seq_q without cum_seq_k"
        for name, cum in (("cum_seq_q", cum_seq_q), ("cum_seq_k", cum_seq_k)):
            if cum.dtype != torch.int32 or cum.dim() != 1 or not cum.is_contiguous():
                return f"{name} of dtype {cum.dtype} and shape {tuple(cum.shape)}"
            if cum.device != query.device or cum.numel() != cum_seq_q.numel():
                return f"{name} on another device or of another length"
    return _qkv_problem(query, key, value, bool(packing)) or _scale_problem(call.scale)


def _packing(call):
    """(cum_seq_q, cum_seq_k, max_q, max_k) of a packed call, () of a dense one."""
    cum_seq_q = getattr(call, "cum_seq_q", None)
    return () if cum_seq_q is None else (cum_seq_q, call.cum_seq_k, call.max_q, call.max_k)


def _swap_seq_heads(tensor: Tensor, packing) -> Tensor:
    """A dense call's (B, S, H, D) tensor as the (B, H, S, D) view mha_ext's op takes, and
    back; packed (total, H, D) tensors, which both take, as they are."""
    return tensor if packing or tensor.dim() != 4 else tensor.transpose(1, 2)


def _fa2_window(is_causal: bool, left, right, seq_k: int):
    """mha_ext's (window_left, window_right) for FlashAttention-2's: a side that is None,
    negative or at least seq_k keys wide is unbounded; is_causal ends the window at the
    diagonal."""
    left = -1 if left is None or left < 0 or left >= seq_k else left
    right = -1 if right is None or right < 0 or right >= seq_k else right
    return left, 0 if is_causal else right


def _fa2_options(query, key, call, packing):
    """Options for the call's q, k in mha_ext's layout."""
    seq_k = packing[3] if packing else key.shape[2]
    left, right = _fa2_window(
        call.is_causal,
        getattr(call, "window_size_left", None),
        getattr(call, "window_size_right", None),
        seq_k,
    )
    return _options(None, _scale(query, call.scale), left, right, True, *packing)


def _fa2_forward(query, key, value, call, packing):
    """(out, logsumexp) of the call on mha_ext's kernel, q, k, v in mha_ext's layout."""
    out, lse = ops.attention_forward(query, key, value, *_fa2_options(query, key, call, packing))
    # A row that sees no key has logsumexp +inf in FlashAttention-2, -inf in mha_ext.
    lse.masked_fill_(lse == -math.inf, math.inf)
    return out, lse


def _no_dropout_state(query: Tensor):
    """rng_state, unused and debug_attn_mask of a call without dropout, as torch's
    FlashAttention providers return them."""
    return (
        torch.zeros(2, dtype=torch.uint64, device=query.device),
        torch.zeros((), dtype=torch.uint64, device=query.device),
        query.new_empty(0),
    )


def _flash_forward(*args, **kwargs):
    call = _FlashForward(*args, **kwargs)
    packing = _packing(call)
    qkv = [_swap_seq_heads(t, packing) for t in call[:3]]
    problem = _fa2_problem(*qkv, call, packing)
    if problem is not None:
        native = _native.flash_cuda if call.query.is_cuda else None
        return _fall_through(_FLASH_FORWARD, problem, native, *call)
    out, lse = _fa2_forward(*qkv, call, packing)
    out = _laid_out_like(_swap_seq_heads(out, packing), call.query)
    return (out, lse, *_no_dropout_state(call.query))


def _flash_forward_inplace(out, *args, **kwargs):
    call = _FlashForward(*args, **kwargs)
    packing = _packing(call)
    qkv = [_swap_seq_heads(t, packing) for t in call[:3]]
    problem = _fa2_problem(*qkv, call, packing)
    if problem is None and (out.shape != call.query.shape or out.dtype != call.query.dtype):
        problem = f"out of shape {tuple(out.shape)} and dtype {out.dtype}"
    if problem is not None:
        native = _native.flash_cuda_inplace if call.query.is_cuda else None
        return _fall_through(_FLASH_FORWARD_INPLACE, problem, native, out, *call)
    result, lse = _fa2_forward(*qkv, call, packing)
    out.copy_(_swap_seq_heads(result, packing))
    return lse


def _flash_backward(*args, **kwargs):
    call = _FlashBackward(*args, **kwargs)
    packing = _packing(call)
    # grad_out, q, k, v, out in mha_ext's layout
    tensors = [_swap_seq_heads(t, packing) for t in call[:5]]
    query = call.query
    lse_shape = (query.shape[1], query.shape[0]) if packing else tensors[1].shape[:3]
    problem = _fa2_problem(*tensors[1:4], call, packing) or _saved_problem(
        call.grad_out, query, call.out, call.logsumexp, lse_shape
    )
    if problem is not None:
        native = _native.flash_cuda_backward if query.is_cuda else None
        return _fall_through(_FLASH_BACKWARD, problem, native, *call)
    options = _fa2_options(*tensors[1:3], call, packing)
    grads = _gradients(*tensors, call.logsumexp, options)
    return tuple(
        _laid_out_like(_swap_seq_heads(grad, packing), like) for grad, like in zip(grads, call[1:4])
    )


def _cuda_sdpa(*args, **kwargs):
    call = _CudaSdpa(*args, **kwargs)
    problem = _fa2_problem(*call[:3], call, ())
    if problem is not None:
        out, lse, rng_state, unused, debug_mask = _fall_through(
            _CUDA_SDPA, problem, _native.sdpa_cuda, *call
        )
    else:
        out, lse = _fa2_forward(*call[:3], call, ())
        out = _laid_out_like(out, call.query)
        rng_state, unused, debug_mask = _no_dropout_state(call.query)
    # cum_seq_q and cum_seq_k are undefined for a dense call; max_q and max_k its lengths.
    max_q, max_k = call.query.shape[2], call.key.shape[2]
    return out, lse, None, None, max_q, max_k, rng_state, unused, debug_mask


def _cuda_sdpa_backward(*args, **kwargs):
    call = _CudaSdpaBackward(*args, **kwargs)
    problem = _fa2_problem(*call[1:4], call, ()) or _saved_problem(
        call.grad_out, call.query, call.out, call.logsumexp, call.query.shape[:3]
    )
    if problem is not None:
        return _fall_through(_CUDA_SDPA_BACKWARD, problem, _native.sdpa_cuda_backward, *call)
    grads = _gradients(*call[:6], _fa2_options(*call[1:3], call, ()))
    return tuple(_laid_out_like(grad, like) for grad, like in zip(grads, call[1:4]))


# ---- the provider ----

_CPU_SDPA = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_CUDA_SDPA = "_scaled_dot_product_flash_attention"
_CUDA_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_backward"
_FLASH_FORWARD = "_flash_attention_forward"
_FLASH_FORWARD_INPLACE = "_flash_attention_forward_no_dropout_inplace"
_FLASH_BACKWARD = "_flash_attention_backward"

_FLASH_KERNELS = {
    _FLASH_FORWARD: _flash_forward,
    _FLASH_FORWARD_INPLACE: _flash_forward_inplace,
    _FLASH_BACKWARD: _flash_backward,
}
_KERNELS = {
    "CPU": {_CPU_SDPA: _cpu_sdpa, _CPU_SDPA_BACKWARD: _cpu_sdpa_backward, **_FLASH_KERNELS},
    "CUDA": {_CUDA_SDPA: _cuda_sdpa, _CUDA_SDPA_BACKWARD: _cuda_sdpa_backward, **_FLASH_KERNELS},
}


@dataclass
class _Activation:
    """One activation's registrations; torch's registry calls remove() on restore."""

    library: Optional[torch.library.Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()  # the dispatcher returns to torch's kernels
            self.library = None


def activate() -> _Activation:
    """Registers mha_ext's kernels for torch's flash-attention ops: on CPU, and on CUDA where
    this build has CUDA kernels. torch.nn.attention.activate_flash_attention_impl("mha_ext")
    calls it; call that instead."""
    library = torch.library.Library("aten", "IMPL")
    for dispatch_key, kernels in _KERNELS.items():
        if dispatch_key == "CPU" or _runs_on_cuda():
            for op, kernel in kernels.items():
                library.impl(op, kernel, dispatch_key)
    return _Activation(library)


def register() -> None:
    """Makes "mha_ext" a flash-attention provider torch can activate (a torch with the hook)."""
    if hasattr(torch.nn.attention, "register_flash_attention_impl"):
        torch.nn.attention.register_flash_attention_impl(PROVIDER, register_fn=activate)


register()

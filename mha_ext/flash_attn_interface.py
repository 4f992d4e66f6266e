"""FlashAttention 2.8's Python API on mha_ext's kernels.

Code written for FlashAttention runs with one changed import:

    from mha_ext.flash_attn_interface import flash_attn_func   # was: from flash_attn import ...

Same function names, argument order, defaults, layouts ((batch, seqlen, nheads, headdim) for
q/k/v, (total, nheads, headdim) for the varlen forms) and semantics: causal masks aligned to
the bottom-right corner, window_size=(left, right) with a negative side unbounded, softcap
(<= 0 is off), alibi_slopes (nheads,) or (batch, nheads), GQA/MQA through fewer K/V heads,
logsumexp (batch, nheads, seqlen_q) or (nheads, total_q). Gradients flow through
flash_attn_func, the packed forms and the varlen forms, as in FlashAttention.

Where this differs from FlashAttention, and why:
- dtypes: fp16, bf16, fp32 and fp64 all run (FlashAttention takes fp16/bf16 only). The
  logsumexp is fp32, fp64 for fp64 inputs. alibi_slopes may be any floating dtype; they are
  read in fp32 (fp64 for fp64 inputs).
- head dims: v may have a different head dim than q and k; no padding to multiples of 8 and
  no page_block_size multiple of 256 is needed.
- A query row that sees no key has output 0 and logsumexp -inf (FlashAttention's non-split
  kernels store +inf there; -inf is log 0, which merging attention states needs).
- return_attn_probs returns (out, softmax_lse, S_dmask). As in FlashAttention, S_dmask is an
  empty tensor when dropout_p == 0. With dropout it holds the attention probabilities with the
  dropped entries negated, shaped (batch, nheads, seqlen_q, seqlen_k) (varlen:
  (batch, nheads, max_seqlen_q, max_seqlen_k), zero beyond each sequence), where
  FlashAttention pads both lengths to multiples of 128 and its values may lack the final
  softmax normalisation. Rebuilding them takes O(seqlen_q x seqlen_k) memory: for tests only.
- deterministic=False does not force the non-deterministic backward: it leaves the choice to
  torch.are_deterministic_algorithms_enabled(); True always gives the deterministic one.
- The gradient of softmax_lse is honoured (FlashAttention drops it).
- flash_attn_varlen_func with block_table is differentiable too (in K/V through the cache).
- flash_attn_with_kvcache also takes cache_leftpad with a paged cache, any rotary_dim that is
  even and <= headdim (FlashAttention: multiples of 16), and int cache_seqlens with
  batch_size_cache != batch_size. It has no backward pass, as in FlashAttention.
- num_splits is accepted and ignored: the kernels choose their own key splits.
- Argument errors raise FlashAttnArgumentError, a ValueError that is also a RuntimeError
  (what FlashAttention's checks raise).
"""

import os
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .functional import (
    attention,
    attention_varlen,
    draw_dropout_seed,
    dropout_mask,
    paged_attention,
    paged_kv_append,
)
from .ops import lse_dtype

__all__ = [
    "FlashAttnArgumentError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


class FlashAttnArgumentError(ValueError, RuntimeError):
    """Bad argument to a flash_attn_* function: mha_ext's ValueError convention, and the
    RuntimeError that FlashAttention's TORCH_CHECKs raise, so either except clause catches it."""


def _contiguous_last_dim(x: Optional[Tensor]) -> Optional[Tensor]:
    """FlashAttention copies inputs whose last dim is strided; the kernels need it unit-stride."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _host_checks(device: torch.device) -> bool:
    """Whether value checks that read index tensors on the host run: always on CPU (free),
    on CUDA only with MHA_EXT_CHECK_INDICES=1 (a device sync), never while torch.compile traces.
    Without them the kernels still never write outside the addressed cache rows."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or os.environ.get("MHA_EXT_CHECK_INDICES") == "1"


def _window(window_size, causal: bool, seqlen_k, fn: str) -> Tuple[int, int]:
    """FlashAttention's window_size as (left, right), -1 for an unbounded side: a negative
    side, or one reaching seqlen_k or further, is unbounded; causal bounds the right at 0."""
    sides = tuple(window_size) if isinstance(window_size, (tuple, list, Tensor)) else None
    try:
        if sides is None or len(sides) != 2:
            raise TypeError
        left, right = (side.__index__() for side in sides)
    except (AttributeError, TypeError):
        raise FlashAttnArgumentError(
            f"{fn}: window_size must be a pair (left, right) of ints, got {window_size!r}"
        ) from None
    left, right = (-1 if side < 0 or side >= seqlen_k else side for side in (left, right))
    return left, 0 if causal else right


def _softcap(softcap) -> float:
    return float(softcap) if softcap > 0 else 0.0


def _deterministic(deterministic: bool) -> Optional[bool]:
    return True if deterministic else None


def _check_rank(x: Tensor, rank: int, name: str, layout: str, fn: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != rank:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise FlashAttnArgumentError(f"{fn}: {name} must be {layout}, got {shape}")


def _check_qkv(q, k, v, names, q_layout, kv_layout, fn) -> None:
    """q (..., nheads, headdim), k (..., nheads_k, headdim), v (..., nheads_k, headdim_v) with
    the leading dims (all but seqlen for the dense form) agreeing."""
    q_name, k_name, v_name = names
    rank = len(q_layout.split(","))
    _check_rank(q, rank, q_name, q_layout, fn)
    _check_rank(k, rank, k_name, kv_layout, fn)
    _check_rank(v, rank, v_name, kv_layout, fn)
    if k.shape[:-1] != v.shape[:-1]:
        raise FlashAttnArgumentError(
            f"{fn}: {k_name} and {v_name} must agree in all but the last dim, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if (rank == 4 and k.shape[0] != q.shape[0]) or k.shape[-1] != q.shape[-1]:
        raise FlashAttnArgumentError(
            f"{fn}: {k_name} {tuple(k.shape)} does not match {q_name} {tuple(q.shape)} "
            f"(layouts {kv_layout} and {q_layout})"
        )
    if q.shape[-2] % k.shape[-2] != 0:
        raise FlashAttnArgumentError(
            f"{fn}: the number of heads in {k_name} ({k.shape[-2]}) must divide the number "
            f"of heads in {q_name} ({q.shape[-2]})"
        )


def _check_alibi(alibi_slopes, batch: int, heads: int, fn: str) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, Tensor) or tuple(alibi_slopes.shape) not in (
        (heads,),
        (batch, heads),
    ):
        shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else alibi_slopes
        raise FlashAttnArgumentError(
            f"{fn}: alibi_slopes must have shape (nheads,) = ({heads},) or "
            f"(batch_size, nheads) = ({batch}, {heads}), got {shape}"
        )


def _check_packed(packed: Tensor, name: str, count: int, layout: str, fn: str) -> None:
    rank = len(layout.split(","))
    _check_rank(packed, rank, name, layout, fn)
    if packed.shape[-3] != count:
        raise FlashAttnArgumentError(
            f"{fn}: {name} must be {layout} with {count} at dim {rank - 3}, "
            f"got {tuple(packed.shape)}"
        )


# ---------------------------------------------------------------- attention probabilities


def _dropout_seed_ahead(device: torch.device) -> Tensor:
    """The dropout seed the next attention call on `device` draws (see draw_dropout_seed),
    read without consuming it, so that call's dropout pattern can be rebuilt afterwards."""
    if device.type == "cuda":
        generator = torch.cuda.default_generators[device.index or torch.cuda.current_device()]
    else:
        generator = torch.default_generator
    state = generator.get_state()
    try:
        return draw_dropout_seed(device)
    finally:
        generator.set_state(state)


def _probabilities(q, k, lse, scale, window_left, window_right, softcap, alibi_slopes):
    """Softmax probabilities (B, H, Sq, Sk) in lse's dtype, rebuilt from the logsumexp.

    q (B, Sq, H, D), k (B, Sk, Hkv, D), lse (B, H, Sq); the score features as the kernels
    apply them (bottom-right diagonal)."""
    batch, seq_q, heads, _ = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    dtype = lse.dtype
    # (B, Sq, Hkv, G, D) x (B, Sk, Hkv, D) -> (B, Hkv, G, Sq, Sk): query heads that share a kv
    # head are grouped rather than K repeated.
    grouped_q = q.to(dtype).unflatten(2, (kv_heads, heads // kv_heads))
    scores = torch.einsum("bqkgd,bskd->bkgqs", grouped_q, k.to(dtype)).flatten(1, 2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    diagonal = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)  # (Sq, 1)
    key_index = torch.arange(seq_k, device=q.device)[None, :]  # (1, Sk)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1, heads, 1, 1)  # (B or 1, H, 1, 1)
        scores = scores - slopes * (diagonal - key_index).abs().to(dtype)
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        visible &= key_index >= diagonal - window_left
    if window_right >= 0:
        visible &= key_index <= diagonal + window_right
    scores = scores.masked_fill(~visible, float("-inf"))
    # A row that sees no key has lse -inf and scores -inf: subtracting 0 keeps it at 0.
    finite_lse = torch.where(lse == float("-inf"), 0.0, lse)
    return torch.exp(scores - finite_lse[..., None])


def _dropout_probs(q, k, lse, cu_seqlens_q, k_starts, k_lens, max_q, max_k, seed, p, features):
    """S_dmask (batch, H, max_q, max_k) in q's dtype: probabilities, dropped entries negated.

    q (total_q, H, D), k (rows, Hkv, D), lse (H, total_q); sequence b owns q rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] and k rows k_starts[b]:k_starts[b] + k_lens[b]."""
    scale, window_left, window_right, softcap, alibi_slopes = features
    batch, heads = len(k_lens), q.shape[1]
    keep = dropout_mask(seed, batch, heads, max_q, max_k, p)
    signed = q.new_zeros(batch, heads, max_q, max_k)
    q_starts = cu_seqlens_q.tolist()
    for b in range(batch):
        q_rows = slice(q_starts[b], q_starts[b + 1])
        q_len, k_len, k_start = q_starts[b + 1] - q_starts[b], k_lens[b], k_starts[b]
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        probs = _probabilities(
            q[None, q_rows],
            k[None, k_start : k_start + k_len],
            lse[None, :, q_rows],
            scale,
            window_left,
            window_right,
            softcap,
            slopes,
        )[0]  # (H, q_len, k_len)
        kept = keep[b, :, :q_len, :k_len]
        signed[b, :, :q_len, :k_len] = torch.where(kept, probs, -probs).to(q.dtype)
    return signed


# ---------------------------------------------------------------- dense forms


def _dense(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    fn,
):
    """Attention of (B, S, H, D) q, k, v (views allowed) through mha_ext.attention."""
    q, k, v = (_contiguous_last_dim(x) for x in (q, k, v))
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2], fn)
    window_left, window_right = _window(window_size, causal, k.shape[1], fn)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    softcap = _softcap(softcap)
    seed = None
    if return_attn_probs and dropout_p > 0:
        seed = _dropout_seed_ahead(q.device)
    out, lse = attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal="bottom_right" if causal else None,
        scale=scale,
        window=(window_left, window_right),
        dropout_p=dropout_p,
        return_lse=True,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=_deterministic(deterministic),
    )
    out = out.transpose(1, 2)  # (B, Sq, H, Dv)
    if not return_attn_probs:
        return out
    if seed is None:
        return out, lse, q.new_empty(0)
    batch, seq_q, heads, _ = q.shape
    seq_k = k.shape[1]
    cu_seqlens_q = torch.arange(batch + 1) * seq_q
    features = (scale, window_left, window_right, softcap, alibi_slopes)
    s_dmask = _dropout_probs(
        q.flatten(0, 1),
        k.flatten(0, 1),
        lse.permute(1, 0, 2).flatten(1),  # (H, B * Sq)
        cu_seqlens_q,
        [b * seq_k for b in range(batch)],
        [seq_k] * batch,
        seq_q,
        seq_k,
        seed,
        dropout_p,
        features,
    )
    return out, lse, s_dmask


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """FlashAttention's flash_attn_func on mha_ext.attention (differentiable in q, k, v).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); k: (batch_size, seqlen_k, nheads_k,
            headdim); v: (batch_size, seqlen_k, nheads_k, headdim_v). nheads_k divides nheads:
            query head h reads kv head h // (nheads // nheads_k) (GQA/MQA).
        dropout_p: dropout probability (set 0.0 for evaluation).
        softmax_scale: default 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner: query i sees keys
            j <= i + seqlen_k - seqlen_q; a row that sees no key gives 0.
        window_size: (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
            i + seqlen_k - seqlen_q + right]; a negative side is unbounded.
        softcap: > 0 replaces each scaled score s by softcap * tanh(s / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads): adds
            -slope * |i + seqlen_k - seqlen_q - j| to the score of query i and key j.
        deterministic: True for the deterministic backward (False follows
            torch.are_deterministic_algorithms_enabled()).
        return_attn_probs: also return softmax_lse and S_dmask (see the module docstring).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v), or (out, softmax_lse, S_dmask) with
        softmax_lse (batch_size, nheads, seqlen_q) fp32 (fp64 for fp64 inputs).
    """
    fn = "flash_attn_func"
    layout = "(batch_size, seqlen, nheads, headdim)"
    _check_qkv(q, k, v, ("q", "k", "v"), layout, "(batch_size, seqlen, nheads_k, headdim)", fn)
    return _dense(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        fn,
    )


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func with q, k, v stacked: qkv (batch_size, seqlen, 3, nheads, headdim).

    The kernels read q, k and v as views of qkv (no copy); its gradient has qkv's shape.
    Other arguments and the return value as in flash_attn_func.
    """
    fn = "flash_attn_qkvpacked_func"
    _check_packed(qkv, "qkv", 3, "(batch_size, seqlen, 3, nheads, headdim)", fn)
    q, k, v = qkv.unbind(2)
    return _dense(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        fn,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func with k, v stacked: q (batch_size, seqlen_q, nheads, headdim),
    kv (batch_size, seqlen_k, 2, nheads_k, headdim) (GQA/MQA as in flash_attn_func).

    The kernels read k and v as views of kv; its gradient has kv's shape. Other arguments
    and the return value as in flash_attn_func.
    """
    fn = "flash_attn_kvpacked_func"
    _check_packed(kv, "kv", 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)", fn)
    k, v = kv.unbind(2)
    layout = "(batch_size, seqlen, nheads, headdim)"
    _check_qkv(q, k, v, ("q", "kv[:, :, 0]", "kv[:, :, 1]"), layout, layout, fn)
    return _dense(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        fn,
    )


# ---------------------------------------------------------------- varlen forms


def _check_index(x, name: str, shape: tuple, fn: str) -> None:
    """FlashAttention's index tensors are int32 of a fixed shape (None: any size there)."""
    valid = (
        isinstance(x, Tensor)
        and x.dtype == torch.int32
        and x.dim() == len(shape)
        and all(want is None or got == want for got, want in zip(x.shape, shape))
    )
    if not valid:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else repr(x)
        expected = tuple("any" if n is None else n for n in shape)
        raise FlashAttnArgumentError(
            f"{fn}: {name} must be a torch.int32 tensor of shape {expected}, got {got}"
        )


def _check_used_blocks(block_table, block_size, starts, ends, num_blocks, fn) -> None:
    """Host check: a sequence's tokens [starts[b], ends[b]) fit its block table row, and the
    entries they use name existing blocks (entries past them may hold anything)."""
    table = block_table.tolist()
    capacity = block_table.shape[1] * block_size
    for b, (begin, end) in enumerate(zip(starts, ends)):
        if end > capacity:
            raise FlashAttnArgumentError(
                f"{fn}: sequence {b} has {end} tokens, more than its block_table row holds: "
                f"{block_table.shape[1]} blocks x {block_size} = {capacity}"
            )
        for column in range(begin // block_size, (end + block_size - 1) // block_size):
            if not 0 <= table[b][column] < num_blocks:
                raise FlashAttnArgumentError(
                    f"{fn}: block_table[{b}, {column}] = {table[b][column]} is outside the "
                    f"cache's {num_blocks} blocks"
                )


def _pages_gathered(cache: Tensor, block_table: Tensor, starts: Tensor, ends: Tensor, count):
    """Rows (batch * count, nheads_k, headdim) of a paged cache (num_blocks, page_block_size,
    nheads_k, headdim): row b * count + j is the token at position starts[b] + j of sequence b.
    Positions at or past ends[b] read block 0 (their values go unused), so block table
    entries beyond a sequence, which may hold anything, are never followed."""
    block_size, max_blocks = cache.shape[1], block_table.shape[1]
    positions = starts[:, None] + torch.arange(count, device=cache.device)  # (B, count)
    columns = (positions // block_size).clamp(max=max_blocks - 1).long()
    blocks = block_table.gather(1, columns).long()
    blocks = torch.where(positions < ends[:, None], blocks, 0)
    return cache[blocks, positions % block_size].flatten(0, 1)


def _varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    block_table,
    fn,
):
    """Attention of packed sequences through attention_varlen, or paged_attention when the
    keys live in a paged cache and the mask is causal."""
    q, k, v = (_contiguous_last_dim(x) for x in (q, k, v))
    batch, heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    _check_alibi(alibi_slopes, batch, heads, fn)
    window_left, window_right = _window(window_size, causal, max_seqlen_k, fn)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    softcap = _softcap(softcap)
    seqused_k = None
    if block_table is not None:
        seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)  # (batch,)
        # The paged kernel masks causally and has no dropout or backward.
        paged_kernel = (
            window_right == 0
            and dropout_p == 0
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
            and not v.requires_grad
        )
        if _host_checks(q.device):
            starts, ends = [0] * batch, seq_lens.tolist()
            _check_used_blocks(block_table, k.shape[1], starts, ends, k.shape[0], fn)
            # It also needs as many keys as queries in every sequence (no empty rows).
            q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
            paged_kernel = paged_kernel and all(n_k >= n_q for n_k, n_q in zip(ends, q_lens))
        if paged_kernel:
            out, lse = paged_attention(
                q,
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_table,
                seq_lens,
                cu_seqlens_q,
                scale=scale,
                return_lse=True,
                window=(window_left, 0),
                softcap=softcap,
                alibi_slopes=alibi_slopes,
            )
            lse = lse.t().contiguous()  # (H, total_q)
            return (out, lse, q.new_empty(0)) if return_attn_probs else out
        zeros = torch.zeros_like(seq_lens)
        k = _pages_gathered(k, block_table, zeros, seq_lens, max_seqlen_k)
        v = _pages_gathered(v, block_table, zeros, seq_lens, max_seqlen_k)
        cu_seqlens_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * max_seqlen_k
        seqused_k = seq_lens
    seed = None
    if return_attn_probs and dropout_p > 0:
        seed = _dropout_seed_ahead(q.device)
    out, lse = attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal="bottom_right" if causal else None,
        scale=scale,
        window=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        return_lse=True,
        seqused_k=seqused_k,
        deterministic=_deterministic(deterministic),
    )
    if not return_attn_probs:
        return out
    if seed is None:
        return out, lse, q.new_empty(0)
    k_starts = cu_seqlens_k[:-1].tolist()
    used = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    features = (scale, window_left, window_right, softcap, alibi_slopes)
    s_dmask = _dropout_probs(
        q,
        k,
        lse,
        cu_seqlens_q,
        k_starts,
        used.tolist(),
        max_seqlen_q,
        max_seqlen_k,
        seed,
        dropout_p,
        features,
    )
    return out, lse, s_dmask


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FlashAttention's flash_attn_varlen_func on mha_ext.attention_varlen: sequences of
    different lengths packed without padding (differentiable in q, k, v).

    Args:
        q: (total_q, nheads, headdim); k: (total_k, nheads_k, headdim), v: (total_k, nheads_k,
            headdim_v), or with block_table paged caches (num_blocks, page_block_size,
            nheads_k, headdim[_v]).
        cu_seqlens_q, cu_seqlens_k: (batch_size + 1,) int32 cumulative sequence lengths:
            sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and k/v rows
            [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (with block_table: it has that many keys,
            at positions 0.. of its block table row). Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: the longest query and key sequence.
        block_table: (batch_size, max_num_blocks_per_seq) int32, the cache blocks of each
            sequence in order. Causal masks without dropout or gradient run on the paged
            kernel (no copy); anything else gathers each sequence's keys first.
        The other arguments as in flash_attn_func, per sequence (alibi_slopes (nheads,) or
        (batch_size, nheads)).

    Returns:
        out (total_q, nheads, headdim_v), or (out, softmax_lse, S_dmask) with softmax_lse
        (nheads, total_q) fp32 (fp64 for fp64 inputs).
    """
    fn = "flash_attn_varlen_func"
    q_layout = "(total_q, nheads, headdim)"
    if block_table is None:
        kv_layout = "(total_k, nheads_k, headdim)"
        _check_qkv(q, k, v, ("q", "k", "v"), q_layout, kv_layout, fn)
    else:
        kv_layout = "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
        _check_rank(q, 3, "q", q_layout, fn)
        _check_rank(k, 4, "k", kv_layout, fn)
        _check_rank(v, 4, "v", kv_layout, fn)
        _check_qkv(q, k.flatten(0, 1), v.flatten(0, 1), ("q", "k", "v"), q_layout, kv_layout, fn)
        batch = cu_seqlens_q.shape[0] - 1
        _check_index(block_table, "block_table", (batch, None), fn)
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
        fn,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func with q, k, v stacked: qkv (total, 3, nheads, headdim), one
    cu_seqlens (batch_size + 1,) int32 and max_seqlen for queries and keys. The kernels read
    views of qkv; its gradient has qkv's shape. Returns as flash_attn_varlen_func."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _check_packed(qkv, "qkv", 3, "(total, 3, nheads, headdim)", fn)
    q, k, v = qkv.unbind(1)
    return _varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        None,
        fn,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func with k, v stacked: q (total_q, nheads, headdim),
    kv (total_k, 2, nheads_k, headdim). The kernels read views of kv; its gradient has kv's
    shape. Returns as flash_attn_varlen_func."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_packed(kv, "kv", 2, "(total_k, 2, nheads_k, headdim)", fn)
    k, v = kv.unbind(1)
    layout = "(total, nheads, headdim)"
    _check_qkv(q, k, v, ("q", "kv[:, 0]", "kv[:, 1]"), layout, layout, fn)
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        None,
        fn,
    )


# ---------------------------------------------------------------- KV cache


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """x (B, S, H, D) with its first rotary_dim = 2 * cos.shape[1] dims rotated by the angles
    at positions (B, S): pairs (2i, 2i + 1) when interleaved (GPT-J), else (i, i + half)
    (GPT-NeoX). Computed in fp32 (fp64 for fp64), returned in x's dtype."""
    half = cos.shape[1]
    dtype = lse_dtype(x.dtype)
    cos_at = cos[positions].to(dtype)[:, :, None]  # (B, S, 1, half)
    sin_at = sin[positions].to(dtype)[:, :, None]
    rotated = x[..., : 2 * half].to(dtype)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        pairs = (x1 * cos_at - x2 * sin_at, x1 * sin_at + x2 * cos_at)
        rotated = torch.stack(pairs, dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * cos_at - x2 * sin_at, x1 * sin_at + x2 * cos_at), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)


def _cache_slots(tables: Tensor, positions: Tensor, block_size: int, num_slots: int) -> Tensor:
    """Cache slots (B, S) int64, block * block_size + offset, of token positions (B, S). A
    position past a table row's capacity gets num_slots, outside the cache, which the append
    refuses (CPU) or skips (CUDA): it never lands in another sequence's rows."""
    capacity = tables.shape[1] * block_size
    columns = (positions // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables.gather(1, columns).long() * block_size + positions % block_size
    return torch.where(positions < capacity, slots, num_slots)


def _cache_tables(q, k_cache, v_cache, cache_batch_idx, block_table, fn):
    """(tables (batch, blocks) int32, block_size) that address the cache as a paged one: a
    contiguous cache (batch_size_cache, seqlen_cache, ...) is one block of seqlen_cache tokens
    per cache row, cache_batch_idx choosing the rows (a view of the cache, no copy)."""
    batch, _, heads, head_dim = q.shape
    if block_table is None:
        layout = "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
    else:
        layout = "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
    _check_rank(k_cache, 4, "k_cache", layout, fn)
    _check_rank(v_cache, 4, "v_cache", layout, fn)
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != head_dim:
        raise FlashAttnArgumentError(
            f"{fn}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
            f"{layout} with q's headdim {head_dim} in k_cache"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise FlashAttnArgumentError(f"{fn}: {name} must have contiguous last dimension")
        if cache.dtype != q.dtype:
            raise FlashAttnArgumentError(
                f"{fn}: {name} has dtype {cache.dtype} but q has {q.dtype}; they must match"
            )
    if heads % k_cache.shape[2] != 0:
        raise FlashAttnArgumentError(
            f"{fn}: the number of heads in k_cache ({k_cache.shape[2]}) must divide the number "
            f"of heads in q ({heads})"
        )
    if block_table is not None:
        if cache_batch_idx is not None:
            raise FlashAttnArgumentError(
                f"{fn}: cache_batch_idx cannot be used with a paged cache (block_table already "
                f"chooses each sequence's blocks), as in FlashAttention"
            )
        _check_index(block_table, "block_table", (batch, None), fn)
        return block_table, k_cache.shape[1]
    if cache_batch_idx is None:
        if k_cache.shape[0] < batch:
            raise FlashAttnArgumentError(
                f"{fn}: k_cache holds {k_cache.shape[0]} sequences but q has batch_size "
                f"{batch}; pass cache_batch_idx to choose cache rows"
            )
        rows = torch.arange(batch, dtype=torch.int32, device=q.device)
    else:
        _check_index(cache_batch_idx, "cache_batch_idx", (batch,), fn)
        rows = cache_batch_idx
    return rows[:, None], k_cache.shape[1]


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """FlashAttention's flash_attn_with_kvcache: append new keys/values to a KV cache in place
    (optionally rotating them and q), then attend over the updated cache. No backward.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim[_v]), or with
            block_table a paged cache (num_blocks, page_block_size, nheads_k, headdim[_v]);
            q's dtype, contiguous last dim.
        k, v: optional new tokens (batch_size, seqlen_new, nheads_k, headdim[_v]), written into
            the cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 by
            mha_ext's paged append kernel; the attention then sees them as the last keys.
        rotary_cos, rotary_sin: optional (seqlen_ro >= the cache's length, rotary_dim / 2)
            tables (needs k and v): the new k is rotated at its positions; q at positions
            cache_seqlens[b] + i when causal or local (window_size not (-1, -1)), otherwise
            all of q at cache_seqlens[b].
        cache_seqlens: int or (batch_size,) int32: tokens already in each sequence's cache
            (None: the whole cache, only without k/v).
        cache_batch_idx: (batch_size,) int32: the cache row of each batch entry (contiguous
            cache only); default 0 .. batch_size - 1.
        cache_leftpad: (batch_size,) int32: sequence b's keys start at cache position
            cache_leftpad[b] (left padding before it is ignored; the causal diagonal, window
            and ALiBi distances count from there).
        block_table: (batch_size, max_num_blocks_per_seq) int32, each sequence's cache blocks.
        rotary_interleaved: True rotates dims (0, 1), (2, 3), ...; False (0, rotary_dim / 2),
            (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
        num_splits: a hint, accepted and ignored.
        return_softmax_lse: also return softmax_lse (batch_size, nheads, seqlen_q) fp32 (fp64
            for fp64 inputs).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash_attn_func, with
            seqlen_k each sequence's key count.

    The fast path is the paged decode kernel over the cache in place: taken without
    cache_leftpad when the mask is causal, the window's right side is 0, or seqlen_q == 1.
    Otherwise (non-causal chunks, cache_leftpad) each sequence's cache rows are gathered (a
    copy of batch_size x cache length tokens) and attention_varlen runs over them.

    Bad input raises before anything is written; on CPU the index values are checked too
    (on CUDA with MHA_EXT_CHECK_INDICES=1; without it a token addressed outside its own cache
    row is skipped rather than written elsewhere).

    Returns:
        out (batch_size, seqlen_q, nheads, headdim_v), or (out, softmax_lse).
    """
    fn = "flash_attn_with_kvcache"
    _check_rank(q, 4, "q", "(batch_size, seqlen_q, nheads, headdim)", fn)
    q, k, v = (_contiguous_last_dim(x) for x in (q, k, v))
    batch, seqlen_q, heads, head_dim = q.shape
    tables, block_size = _cache_tables(q, k_cache, v_cache, cache_batch_idx, block_table, fn)
    capacity = tables.shape[1] * block_size  # tokens one sequence's cache holds
    kv_heads = k_cache.shape[2]
    _check_alibi(alibi_slopes, batch, heads, fn)

    if (k is None) != (v is None):
        raise FlashAttnArgumentError(f"{fn}: k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1] if k.dim() == 4 else -1
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            expected = (batch, seqlen_new, kv_heads, cache.shape[3])
            if new.dim() != 4 or tuple(new.shape) != expected or new.dtype != cache.dtype:
                raise FlashAttnArgumentError(
                    f"{fn}: {name} must be (batch_size, seqlen_new, nheads_k, headdim) = "
                    f"{expected} in {cache.dtype}, got {tuple(new.shape)} {new.dtype}"
                )
        if cache_seqlens is None:
            raise FlashAttnArgumentError(
                f"{fn}: k and v need cache_seqlens (where to write the new tokens)"
            )
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, (int, torch.SymInt)):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_index(cache_seqlens, "cache_seqlens", (batch,), fn)
    if cache_leftpad is not None:
        _check_index(cache_leftpad, "cache_leftpad", (batch,), fn)

    if (rotary_cos is None) != (rotary_sin is None):
        raise FlashAttnArgumentError(f"{fn}: rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise FlashAttnArgumentError(
                f"{fn}: rotary_cos/rotary_sin rotate the new k, so k and v must be given"
            )
        if (
            rotary_cos.dim() != 2
            or rotary_cos.shape != rotary_sin.shape
            or not 0 < 2 * rotary_cos.shape[1] <= head_dim
            or rotary_cos.shape[0] < capacity
        ):
            raise FlashAttnArgumentError(
                f"{fn}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                f"seqlen_ro >= the cache's length {capacity} and rotary_dim <= headdim "
                f"{head_dim}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}"
            )

    # FlashAttention's window semantics: a side reaching past the cache is unbounded, and
    # "local" (a bounded side) rotates q per position as causal does.
    window_left, window_right = _window(window_size, False, capacity, fn)
    rotate_q_per_position = causal or window_left >= 0 or window_right >= 0
    if causal:
        window_right = 0

    if _host_checks(q.device):
        starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
        _check_cache_values(
            cache_seqlens.tolist(),
            starts,
            seqlen_new,
            capacity,
            seqlen_q,
            rotary_cos,
            rotate_q_per_position,
            cache_batch_idx,
            k_cache.shape[0],
            fn,
        )
        if block_table is not None:
            ends = [n + seqlen_new for n in cache_seqlens.tolist()]
            _check_used_blocks(block_table, block_size, starts, ends, k_cache.shape[0], fn)

    lengths = cache_seqlens.long()[:, None]  # (batch, 1)
    if k is not None:
        new_positions = lengths + torch.arange(seqlen_new, device=q.device)  # (batch, new)
        if rotary_cos is not None:
            k = _rotary(k, rotary_cos, rotary_sin, new_positions, rotary_interleaved)
            q_offsets = torch.arange(seqlen_q, device=q.device) * int(rotate_q_per_position)
            q = _rotary(q, rotary_cos, rotary_sin, lengths + q_offsets, rotary_interleaved)
        slots = _cache_slots(tables, new_positions, block_size, k_cache.shape[0] * block_size)
        paged_kv_append(
            k.reshape(batch * seqlen_new, kv_heads, head_dim),
            v.reshape(batch * seqlen_new, kv_heads, v.shape[-1]),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            slots.flatten(),
        )

    ends = (cache_seqlens + seqlen_new).to(torch.int32)  # (batch,) keys after the append
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    softcap = _softcap(softcap)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
    packed_q = q.reshape(batch * seqlen_q, heads, head_dim)
    paged_kernel = cache_leftpad is None and (window_right == 0 or seqlen_q == 1)
    if paged_kernel and _host_checks(q.device):
        # The paged kernel needs as many keys as queries in every sequence (no empty rows).
        paged_kernel = bool((ends >= seqlen_q).all())
    if paged_kernel:
        out, lse = paged_attention(
            packed_q,
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            tables,
            ends,
            cu_seqlens_q,
            scale=scale,
            return_lse=True,
            window=(window_left, 0),
            softcap=softcap,
            alibi_slopes=alibi_slopes,
        )
        lse = lse.view(batch, seqlen_q, heads).permute(0, 2, 1)  # (batch, nheads, seqlen_q)
    else:
        starts = cache_leftpad if cache_leftpad is not None else torch.zeros_like(ends)
        keys = _pages_gathered(k_cache, tables, starts, ends, capacity)
        values = _pages_gathered(v_cache, tables, starts, ends, capacity)
        out, lse = attention_varlen(
            packed_q,
            keys,
            values,
            cu_seqlens_q,
            torch.arange(batch + 1, dtype=torch.int32, device=q.device) * capacity,
            seqlen_q,
            capacity,
            causal="bottom_right" if causal else None,
            scale=scale,
            window=(window_left, window_right),
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_lse=True,
            seqused_k=ends - starts,
        )
        lse = lse.view(heads, batch, seqlen_q).transpose(0, 1)  # (batch, nheads, seqlen_q)
    out = out.view(batch, seqlen_q, heads, out.shape[-1])
    return (out, lse.contiguous()) if return_softmax_lse else out


def _check_cache_values(
    lengths,
    starts,
    seqlen_new,
    capacity,
    seqlen_q,
    rotary_cos,
    rotate_q_per_position,
    cache_batch_idx,
    cache_rows,
    fn,
):
    """Host checks of flash_attn_with_kvcache's index values, before anything is written."""
    for b, (length, start) in enumerate(zip(lengths, starts)):
        if not 0 <= length <= capacity - seqlen_new:
            raise FlashAttnArgumentError(
                f"{fn}: cache_seqlens[{b}] = {length} must be in [0, {capacity - seqlen_new}]: "
                f"the cache holds {capacity} tokens per sequence and {seqlen_new} new ones are "
                f"appended"
            )
        if not 0 <= start <= length:
            raise FlashAttnArgumentError(
                f"{fn}: cache_leftpad[{b}] = {start} must be in [0, cache_seqlens[{b}] = {length}]"
            )
        last_q_position = length + (seqlen_q - 1 if rotate_q_per_position else 0)
        if rotary_cos is not None and last_q_position >= rotary_cos.shape[0]:
            raise FlashAttnArgumentError(
                f"{fn}: query {seqlen_q - 1} of sequence {b} sits at position "
                f"{last_q_position}, past rotary_cos's {rotary_cos.shape[0]} positions"
            )
    if cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < cache_rows:
                raise FlashAttnArgumentError(
                    f"{fn}: cache_batch_idx[{b}] = {row} is outside the cache's {cache_rows} rows"
                )

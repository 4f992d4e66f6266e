"""MultiHeadAttention on the fused kernels, with the seed tutorial's interface."""

import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from . import functional
from .kv_cache import CacheBatch, PagedKVCache


@dataclass(frozen=True)
class AttentionConfig:
    """Attention shape of a published model."""

    d_model: int
    num_heads: int
    num_kv_heads: Optional[int] = None  # None: one kv head per query head (MHA)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# The model table of the seed tutorial, plus Llama-2 70B's grouped-query attention.
PRESETS: Dict[str, AttentionConfig] = {
    "bert-base": AttentionConfig(d_model=768, num_heads=12),
    "gpt2-small": AttentionConfig(d_model=768, num_heads=12),
    "gpt3-175b": AttentionConfig(d_model=12288, num_heads=96),
    "llama2-7b": AttentionConfig(d_model=4096, num_heads=32),
    "llama2-70b": AttentionConfig(d_model=8192, num_heads=64, num_kv_heads=8),
}


def alibi_slopes(num_heads: int, device=None) -> Tensor:
    """ALiBi's per-head slopes (Press et al.; FlashAttention's alibi_slopes), (num_heads,) fp32.

    For a power of two H the slopes are 2^(-8 i / H), i = 1..H. Otherwise the first P of them
    (P the largest power of two below H) are P's sequence, and the other H - P heads take
    every other slope of the sequence for 2P, starting at the first: 2^(-8 (2 j - 1) / (2P)),
    j = 1..H - P, slopes that fall between P's.
    """
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be a positive int, got {num_heads!r}")
    power = 2 ** int(math.floor(math.log2(num_heads)))
    exponents = [8.0 * i / power for i in range(1, power + 1)]
    exponents += [8.0 * (2 * j - 1) / (2 * power) for j in range(1, num_heads - power + 1)]
    return torch.tensor([2.0**-e for e in exponents], dtype=torch.float32, device=device)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with GQA/MQA, running on mha_ext's fused attention op.

    Compatible with the seed tutorial's module: the same constructor arguments, the same
    w_q / w_k / w_v / w_o projections (a seed state_dict loads unchanged when num_kv_heads
    is None and bias is False) and forward(q, k, v, mask=None) with mask == 0 marking a
    hidden position. Dropout acts on the attention weights in training mode only.

    Args:
        d_model: model width, divisible by num_heads.
        num_heads: query heads.
        dropout: attention-weight dropout probability.
        num_kv_heads: key/value heads, dividing num_heads (None: num_heads; 1: MQA).
        bias: whether the projections have biases.
        window: (left, right) sliding window of mha_ext.attention (Mistral-style (4096, 0));
            None or -1 leaves a side unbounded. is_causal clips right to 0.
        softcap: > 0 caps each scaled score s to softcap * tanh(s / softcap) (Gemma 2).
        alibi: add ALiBi's bias -slope_h * |i - j| with the slopes of alibi_slopes(num_heads),
            kept in the non-persistent fp32 buffer `alibi_slopes` (not in the state_dict).
        sinks: a learnable attention-sink logit per head (gpt-oss), the fp32 parameter
            `sinks` (num_heads,), zero-initialised: it joins each softmax denominator.

    With none of the four set, the module, its state_dict and its results are the seed's.

    mha_ext.distributed.parallelize_attention splits the heads across ranks: num_heads and
    num_kv_heads are then this rank's counts, out of tensor_parallel_size times as many.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        num_kv_heads: Optional[int] = None,
        bias: bool = False,
        *,
        window: Optional[Tuple[Optional[int], Optional[int]]] = None,
        softcap: float = 0.0,
        alibi: bool = False,
        sinks: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or d_model % num_heads != 0:
            raise ValueError(
                f"MultiHeadAttention: d_model {d_model} must be a positive multiple of "
                f"num_heads {num_heads}"
            )
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"MultiHeadAttention: num_kv_heads {num_kv_heads} must divide num_heads {num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.tensor_parallel_size = 1  # ranks the heads are split across
        self.d_k = d_model // num_heads
        factory = {"device": device, "dtype": dtype}
        kv_width = num_kv_heads * self.d_k
        self.w_q = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.w_k = nn.Linear(d_model, kv_width, bias=bias, **factory)
        self.w_v = nn.Linear(d_model, kv_width, bias=bias, **factory)
        self.w_o = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)  # holds p; the fused kernel applies it
        self.window = _checked_window(window)
        if not isinstance(softcap, (int, float)) or not 0.0 <= softcap < math.inf:
            raise ValueError(
                f"MultiHeadAttention: softcap must be a finite number >= 0 (0: off), "
                f"got {softcap!r}"
            )
        self.softcap = float(softcap)
        self.register_buffer(
            "alibi_slopes", alibi_slopes(num_heads, device) if alibi else None, persistent=False
        )
        # fp32 whatever the projections' dtype: the kernels read sinks in fp32 (fp64 for fp64).
        sink_logits = torch.zeros(num_heads, device=device, dtype=torch.float32)
        self.register_parameter("sinks", nn.Parameter(sink_logits) if sinks else None)
        # What forward attends with: None for mha_ext.attention, or a function of its
        # signature, e.g. mha_ext.distributed.context_parallel_attention_function's.
        self.attention_function: Optional[Callable[..., Tuple[Tensor, Tensor]]] = None

    def _apply(self, fn, recurse=True):
        # module.to(torch.bfloat16) casts floating buffers too; the fp32 slopes are kept
        # (moved) instead of rounded (bf16 holds 8 bits of 2^(-8/12) = 0.630..., off by up to
        # 0.2%).
        fp32_slopes = self.alibi_slopes
        super()._apply(fn, recurse)
        slopes = self.alibi_slopes
        if slopes is not None and slopes.dtype != torch.float32:
            self.alibi_slopes = fp32_slopes.to(slopes.device)
        return self

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "MultiHeadAttention":
        """The attention layer of a model in PRESETS, e.g. from_preset("llama2-70b")."""
        if name not in PRESETS:
            raise ValueError(
                f"MultiHeadAttention: unknown preset {name!r}; known: {', '.join(PRESETS)}"
            )
        config = PRESETS[name]
        return cls(config.d_model, config.num_heads, num_kv_heads=config.num_kv_heads, **kwargs)

    def _split_heads(self, x: Tensor, heads: int) -> Tensor:
        # (B, S, heads * d_k) -> (B, S, heads, d_k) -> (B, heads, S, d_k): a view
        return x.unflatten(-1, (heads, self.d_k)).transpose(1, 2)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Optional[Tensor] = None,
        *,
        is_causal: bool = False,
        need_weights: bool = False,
        head_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
        max_seqlen: Optional[int] = None,
    ):
        """Attend from q (B, Sq, d_model) to k, v (B, Sk, d_model), or, with cu_seqlens,
        self-attention within each of a batch of packed documents.

        Args:
            mask: broadcastable to (B, num_heads, Sq, Sk); positions where mask == 0 are hidden.
            is_causal: each query sees keys up to its own position, the queries being the
                last Sq of the Sk tokens (bottom-right alignment; for Sq == Sk the usual
                lower-triangular mask). Packed: within each document.
            need_weights: also return the per-head attention probabilities
                (B, num_heads, Sq, Sk), before dropout. Costs an Sq x Sk tensor per head.
            head_mask: (num_heads,) or (B, num_heads) factors applied to each head's output
                (0 switches a head off, for ablation studies); the returned weights are
                scaled alike. Packed: (num_heads,) or (documents, num_heads).
            cu_seqlens: (documents + 1,) int32 offsets for packed input: q, k, v are then
                (total_tokens, d_model), document b being rows [cu_seqlens[b],
                cu_seqlens[b + 1]), and each token attends only within its document
                (mha_ext.attention_varlen; no padding). No mask or need_weights then.
            max_seqlen: the longest document; None reads it from cu_seqlens (a device sync
                on CUDA).

        Returns:
            (B, Sq, d_model), or (output, weights) when need_weights; packed: (total_tokens,
            d_model).
        """
        if cu_seqlens is not None:
            return self._forward_packed(
                q, k, v, mask, is_causal, need_weights, head_mask, cu_seqlens, max_seqlen
            )
        if max_seqlen is not None:
            raise ValueError(
                f"MultiHeadAttention: max_seqlen {max_seqlen} given without cu_seqlens"
            )
        if need_weights and (self.softcap > 0 or self.alibi_slopes is not None):
            raise ValueError(
                f"MultiHeadAttention: need_weights is not available with softcap "
                f"({self.softcap}) or alibi ({self.alibi_slopes is not None}): "
                f"mha_ext.attention_probs rebuilds plain scores only"
            )
        batch = q.size(0)
        query = self._split_heads(self.w_q(q), self.num_heads)  # (B, H, Sq, d_k)
        key = self._split_heads(self.w_k(k), self.num_kv_heads)  # (B, Hkv, Sk, d_k)
        value = self._split_heads(self.w_v(v), self.num_kv_heads)  # (B, Hkv, Sk, d_k)
        attn_mask = None if mask is None else mask != 0
        causal = "bottom_right" if is_causal else None
        attend = (
            functional.attention if self.attention_function is None else self.attention_function
        )
        out, lse = attend(
            query,
            key,
            value,
            causal=causal,
            attn_mask=attn_mask,
            dropout_p=self.dropout.p if self.training else 0.0,
            return_lse=True,
            **self._score_options(),
        )  # (B, H, Sq, d_k)
        # The sink is inside lse, so the rebuilt rows sum to 1 - exp(sink - lse).
        weights = (
            functional.attention_probs(
                query, key, lse, causal=causal, window=self.window, attn_mask=attn_mask
            )
            if need_weights
            else None
        )
        if head_mask is not None:
            per_head = self._head_factors(head_mask, batch)  # (B or 1, H, 1, 1)
            out = out * per_head
            weights = None if weights is None else weights * per_head
        out = self.w_o(out.transpose(1, 2).flatten(2))  # (B, Sq, d_model)
        return (out, weights) if need_weights else out

    def _forward_packed(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Optional[Tensor],
        is_causal: bool,
        need_weights: bool,
        head_mask: Optional[Tensor],
        cu_seqlens: Tensor,
        max_seqlen: Optional[int],
    ) -> Tensor:
        if mask is not None or need_weights:
            raise ValueError(
                f"MultiHeadAttention: packed input (cu_seqlens) takes no mask (got "
                f"{None if mask is None else tuple(mask.shape)}) and no need_weights (got "
                f"{need_weights}): the documents' boundaries are the mask"
            )
        shapes = [tuple(x.shape) for x in (q, k, v)]
        if any(len(shape) != 2 or shape != shapes[0] for shape in shapes):
            raise ValueError(
                f"MultiHeadAttention: with cu_seqlens, q, k and v must all be "
                f"(total_tokens, d_model) of one shape (self-attention of packed documents), "
                f"got {shapes}"
            )
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"MultiHeadAttention: cu_seqlens must be a 1-D tensor of documents + 1 "
                f"offsets, got {cu_seqlens!r}"
            )
        if max_seqlen is None:
            max_seqlen = int(cu_seqlens.diff().max())
        query = self.w_q(q).unflatten(-1, (self.num_heads, self.d_k))  # (T, H, d_k)
        key = self.w_k(k).unflatten(-1, (self.num_kv_heads, self.d_k))  # (T, Hkv, d_k)
        value = self.w_v(v).unflatten(-1, (self.num_kv_heads, self.d_k))  # (T, Hkv, d_k)
        out = functional.attention_varlen(
            query,
            key,
            value,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            causal="bottom_right" if is_causal else None,
            dropout_p=self.dropout.p if self.training else 0.0,
            **self._score_options(),
        )  # (T, H, d_k)
        if head_mask is not None:
            out = out * self._packed_head_factors(head_mask, cu_seqlens)  # (T or 1, H, 1)
        return self.w_o(out.flatten(-2))  # (T, d_model)

    def forward_paged(
        self, x: Tensor, cache: PagedKVCache, layer: int, batch: CacheBatch
    ) -> Tensor:
        """Self-attention of new tokens through a paged KV cache (prefill, chunked prefill or
        decode): their keys and values are appended in place to the cache of `layer`, and each
        new token attends causally to its sequence's cached tokens, itself included, with the
        module's window, softcap, ALiBi and sinks (as forward(..., is_causal=True)).

        Args:
            x: (new_tokens, d_model), the new tokens of all sequences of `batch` packed in
                order (batch.cu_seqlens_q says which rows belong to which sequence).
            batch: from cache.prepare(seq_ids, new_token_counts) for this step.

        Returns:
            (new_tokens, d_model).
        """
        query = self.w_q(x).unflatten(-1, (self.num_heads, self.d_k))  # (T, H, d_k)
        key = self.w_k(x).unflatten(-1, (self.num_kv_heads, self.d_k))  # (T, Hkv, d_k)
        value = self.w_v(x).unflatten(-1, (self.num_kv_heads, self.d_k))  # (T, Hkv, d_k)
        k_cache, v_cache = cache.key_caches[layer], cache.value_caches[layer]
        scales = cache.scale_arguments(layer)  # an 8-bit cache's
        # An 8-bit cache takes fp32, bf16 or fp16 rows and queries; a float cache of another
        # dtype than the module's (a bf16 cache under an fp32 model) takes them in its own.
        rows_dtype = query.dtype if scales else k_cache.dtype
        key, value, query = (t.to(rows_dtype) for t in (key, value, query))
        functional.paged_kv_append(key, value, k_cache, v_cache, batch.slot_mapping, **scales)
        out = functional.paged_attention(
            query,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.cu_seqlens_q,
            **self._paged_score_options(),
            **scales,
        )  # (T, H, d_k)
        return self.w_o(out.flatten(-2).to(x.dtype))

    def _score_options(self) -> Dict[str, object]:
        """The score options of mha_ext.attention / attention_varlen for this module."""
        return {
            "window": self.window,
            "softcap": self.softcap,
            "alibi_slopes": self.alibi_slopes,
            "sinks": _local_shard(self.sinks),
        }

    def _paged_score_options(self) -> Dict[str, object]:
        """The options of mha_ext.paged_attention that are on, and only those, so that a
        module without them runs on a paged_attention that does not know them. The paged
        queries attend causally, so the window's right side is 0 whatever it says."""
        options: Dict[str, object] = {}
        if self.window is not None and self.window[0] is not None:
            options["window"] = (self.window[0], 0)
        if self.softcap > 0:
            options["softcap"] = self.softcap
        if self.alibi_slopes is not None:
            options["alibi_slopes"] = self.alibi_slopes
        if self.sinks is not None:
            options["sinks"] = _local_shard(self.sinks)
        return options

    def _head_factors(self, head_mask: Tensor, batch: int) -> Tensor:
        shape = tuple(head_mask.shape)
        if shape not in ((self.num_heads,), (batch, self.num_heads)):
            raise ValueError(
                f"MultiHeadAttention: head_mask must have shape ({self.num_heads},) or "
                f"({batch}, {self.num_heads}), got {shape}"
            )
        return head_mask.reshape(-1, self.num_heads, 1, 1)

    def _packed_head_factors(self, head_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
        documents = cu_seqlens.numel() - 1
        shape = tuple(head_mask.shape)
        if shape == (self.num_heads,):
            return head_mask.reshape(1, self.num_heads, 1)
        if shape != (documents, self.num_heads):
            raise ValueError(
                f"MultiHeadAttention: with cu_seqlens, head_mask must have shape "
                f"({self.num_heads},) or ({documents}, {self.num_heads}), got {shape}"
            )
        lengths = cu_seqlens.diff().long()  # (documents,)
        return head_mask.repeat_interleave(lengths, dim=0).unsqueeze(-1)  # (T, H, 1)


def _local_shard(tensor: Optional[Tensor]) -> Optional[Tensor]:
    """This rank's plain block of a per-head parameter that parallelize_attention made a
    DTensor sharded by head (the kernels take plain tensors), else the tensor itself."""
    # torch.distributed.tensor is loaded only where a DTensor exists: importing it here would
    # add 0.6 s to `import mha_ext`.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        return tensor.to_local()
    return tensor


def _checked_window(window) -> Optional[Tuple[Optional[int], Optional[int]]]:
    if window is None:
        return None
    sides = functional.window_sides(window, "MultiHeadAttention")
    return tuple(None if side == -1 else side for side in sides)

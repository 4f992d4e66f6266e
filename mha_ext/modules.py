"""MultiHeadAttention on the fused kernels, with the seed tutorial's interface."""

from dataclasses import dataclass
from typing import Dict, Optional

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
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        num_kv_heads: Optional[int] = None,
        bias: bool = False,
        *,
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
        self.d_k = d_model // num_heads
        factory = {"device": device, "dtype": dtype}
        kv_width = num_kv_heads * self.d_k
        self.w_q = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.w_k = nn.Linear(d_model, kv_width, bias=bias, **factory)
        self.w_v = nn.Linear(d_model, kv_width, bias=bias, **factory)
        self.w_o = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)  # holds p; the fused kernel applies it

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
    ):
        """Attend from q (B, Sq, d_model) to k, v (B, Sk, d_model).

        Args:
            mask: broadcastable to (B, num_heads, Sq, Sk); positions where mask == 0 are hidden.
            is_causal: each query sees keys up to its own position, the queries being the
                last Sq of the Sk tokens (bottom-right alignment; for Sq == Sk the usual
                lower-triangular mask).
            need_weights: also return the per-head attention probabilities
                (B, num_heads, Sq, Sk), before dropout. Costs an Sq x Sk tensor per head.
            head_mask: (num_heads,) or (B, num_heads) factors applied to each head's output
                (0 switches a head off, for ablation studies); the returned weights are
                scaled alike.

        Returns:
            (B, Sq, d_model), or (output, weights) when need_weights.
        """
        batch = q.size(0)
        query = self._split_heads(self.w_q(q), self.num_heads)  # (B, H, Sq, d_k)
        key = self._split_heads(self.w_k(k), self.num_kv_heads)  # (B, Hkv, Sk, d_k)
        value = self._split_heads(self.w_v(v), self.num_kv_heads)  # (B, Hkv, Sk, d_k)
        attn_mask = None if mask is None else mask != 0
        causal = "bottom_right" if is_causal else None
        out, lse = functional.attention(
            query,
            key,
            value,
            causal=causal,
            attn_mask=attn_mask,
            dropout_p=self.dropout.p if self.training else 0.0,
            return_lse=True,
        )  # (B, H, Sq, d_k)
        weights = (
            functional.attention_probs(query, key, lse, causal=causal, attn_mask=attn_mask)
            if need_weights
            else None
        )
        if head_mask is not None:
            per_head = self._head_factors(head_mask, batch)  # (B or 1, H, 1, 1)
            out = out * per_head
            weights = None if weights is None else weights * per_head
        out = self.w_o(out.transpose(1, 2).reshape(batch, -1, self.d_model))  # (B, Sq, d_model)
        return (out, weights) if need_weights else out

    def forward_paged(
        self, x: Tensor, cache: PagedKVCache, layer: int, batch: CacheBatch
    ) -> Tensor:
        """Self-attention of new tokens through a paged KV cache (prefill, chunked prefill or
        decode): their keys and values are appended in place to the cache of `layer`, and each
        new token attends causally to its sequence's cached tokens, itself included.

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
        functional.paged_kv_append(key, value, k_cache, v_cache, batch.slot_mapping)
        out = functional.paged_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q
        )  # (T, H, d_k)
        return self.w_o(out.flatten(-2))

    def _head_factors(self, head_mask: Tensor, batch: int) -> Tensor:
        shape = tuple(head_mask.shape)
        if shape not in ((self.num_heads,), (batch, self.num_heads)):
            raise ValueError(
                f"MultiHeadAttention: head_mask must have shape ({self.num_heads},) or "
                f"({batch}, {self.num_heads}), got {shape}"
            )
        return head_mask.reshape(-1, self.num_heads, 1, 1)

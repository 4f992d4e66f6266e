"""A small causal language model on MultiHeadAttention, trained by the demo, with greedy
generation through a paged KV cache."""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .kv_cache import CacheBatch, PagedKVCache
from .modules import MultiHeadAttention


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, dropout: float):
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(
            d_model, num_heads, dropout=dropout, num_kv_heads=num_kv_heads
        )
        self.norm_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(
        self, x: Tensor, cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None
    ) -> Tensor:
        # (B, T, d_model), or packed (total_tokens, d_model) with cu_seqlens
        h = self.norm_attn(x)
        x = x + self.attn(h, h, h, is_causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return x + self.mlp(self.norm_mlp(x))

    def forward_paged(
        self, x: Tensor, cache: PagedKVCache, layer: int, batch: CacheBatch
    ) -> Tensor:
        # (new_tokens, d_model)
        x = x + self.attn.forward_paged(self.norm_attn(x), cache, layer, batch)
        return x + self.mlp(self.norm_mlp(x))


class CausalLM(nn.Module):
    """Decoder-only transformer over a small vocabulary with learned positions."""

    def __init__(
        self,
        vocab_size: int,
        context: int,
        d_model: int = 128,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        num_layers: int = 2,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.context = context
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, num_heads, num_kv_heads, dropout) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """(B, T) token ids -> (B, T, vocab) logits, full causal attention. positions: (T,)
        the tokens' positions, default 0..T-1 (a context-parallel rank holds a shard of the
        sequence and passes its positions, see mha_ext.train)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def forward_packed(
        self, tokens: Tensor, cu_seqlens: Tensor, max_seqlen: Optional[int] = None
    ) -> Tensor:
        """(total_tokens,) ids of documents packed one after another (see pack_documents) ->
        (total_tokens, vocab) logits; each document attends causally to itself alone and its
        positions start at 0, as if it were run alone. No padding anywhere.

        Args:
            cu_seqlens: (documents + 1,) int32 offsets of the documents in tokens.
            max_seqlen: the longest document (None: read from cu_seqlens); at most context.
        """
        if max_seqlen is None:
            max_seqlen = int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0
        if max_seqlen > self.context:
            raise ValueError(
                f"CausalLM.forward_packed: documents of up to {max_seqlen} tokens exceed the "
                f"context {self.context} (the learned positions)"
            )
        x = self.token(tokens) + self.position(document_positions(cu_seqlens))
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen)
        return self.head(self.norm(x))

    def forward_paged(self, tokens: Tensor, cache: PagedKVCache, batch: CacheBatch) -> Tensor:
        """(new_tokens,) packed ids of the sequences in `batch` -> (new_tokens, vocab) logits,
        attending to everything each sequence has cached."""
        x = self.token(tokens) + self.position(batch.positions)
        for layer, block in enumerate(self.blocks):
            x = block.forward_paged(x, cache, layer, batch)
        return self.head(self.norm(x))

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        block_size: int = 16,
        kv_cache_dtype: Optional[torch.dtype] = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> List[List[int]]:
        """Greedy continuation of a batch of prompts of different lengths.

        The prompts are prefilled together (packed, one chunk each), then every step decodes
        one token per sequence; keys and values stay in a paged cache, so a step costs the same
        cache write however long the context is. Returns the new tokens of each prompt.

        Args:
            kv_cache_dtype: the cache's dtype: None (the model's), a float dtype, torch.int8
                (one scale per token and kv head, set as each token is appended) or
                torch.float8_e4m3fn (one scale per cache tensor: k_scale, v_scale). 8-bit
                caches halve a bf16 cache's bytes; README "8-bit KV caches" has their error.
            k_scale, v_scale: the fp8 cache's scales (keys and values are divided by them
                before rounding to e4m3, whose largest value is 448); 1.0 as in vLLM, and
                for every other cache.
        """
        longest = max(len(p) for p in prompts) + max_new_tokens
        if min(len(p) for p in prompts) == 0 or longest > self.context:
            raise ValueError(
                f"CausalLM.generate: prompts must be non-empty and prompt + max_new_tokens <= "
                f"context "
                f"{self.context}, got prompt lengths {[len(p) for p in prompts]} and "
                f"max_new_tokens {max_new_tokens}"
            )
        device = self.head.weight.device
        blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
        cache = PagedKVCache(
            len(self.blocks),
            blocks,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=kv_cache_dtype or self.head.weight.dtype,
            device=device,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        seq_ids = [cache.allocate() for _ in prompts]
        batch = cache.prepare(seq_ids, [len(p) for p in prompts])
        tokens = torch.tensor([t for p in prompts for t in p], device=device)
        generated: List[List[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            logits = self.forward_paged(tokens, cache, batch)
            last_rows = batch.cu_seqlens_q[1:].long() - 1  # each sequence's last new token
            tokens = logits[last_rows].argmax(-1)
            for out, token in zip(generated, tokens.tolist()):
                out.append(token)
            if step + 1 < max_new_tokens:
                batch = cache.prepare(seq_ids, [1] * len(prompts))
        return generated


def pack_documents(documents: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """Documents of any lengths (1-D tensors, empty allowed) -> (tokens (total,), cu_seqlens
    (documents + 1,) int32): the layout of CausalLM.forward_packed and attention_varlen."""
    if not documents or any(document.dim() != 1 for document in documents):
        raise ValueError(
            f"pack_documents: documents must be a non-empty sequence of 1-D tensors, got shapes "
            f"{[tuple(document.shape) for document in documents]}"
        )
    lengths = torch.tensor([0] + [len(document) for document in documents])
    cu_seqlens = lengths.cumsum(0).to(torch.int32).to(documents[0].device)
    return torch.cat(list(documents)), cu_seqlens


def document_positions(cu_seqlens: Tensor) -> Tensor:
    """(total,) position of each packed token within its document: 0, 1, ... per document."""
    lengths = cu_seqlens.diff().long()  # (documents,)
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths)  # (total,)
    return torch.arange(starts.numel(), device=cu_seqlens.device) - starts

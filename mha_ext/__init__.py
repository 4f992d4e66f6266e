"""mha_ext: fused multi-head attention for PyTorch (FlashAttention-style CPU and CUDA kernels).

import mha_ext
out = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True)    # torch drop-in
out, lse = mha_ext.attention(q, k, v, causal="bottom_right", window=(256, 0),
                             return_lse=True)                          # full feature set
layer = mha_ext.MultiHeadAttention(d_model=512, num_heads=8, num_kv_heads=2)
cache = mha_ext.PagedKVCache(num_layers=1, num_blocks=256, block_size=16,
                             num_kv_heads=2, head_dim=64)                # generation
"""

import torch  # noqa: F401  (loads libtorch, which the extension links against)

from . import _C
from .functional import (
    attention,
    attention_probs,
    attention_varlen,
    draw_dropout_seed,
    dropout_mask,
    merge_attention_states,
    paged_attention,
    paged_kv_append,
    scaled_dot_product_attention,
    slot_mapping_for,
)
from .integrations import torch_sdpa  # noqa: F401  (registers torch's SDPA provider "mha_ext")
from .kv_cache import CacheBatch, PagedKVCache
from .modules import PRESETS, AttentionConfig, MultiHeadAttention

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "CacheBatch",
    "MultiHeadAttention",
    "PRESETS",
    "PagedKVCache",
    "attention",
    "attention_probs",
    "attention_varlen",
    "build_info",
    "draw_dropout_seed",
    "dropout_mask",
    "merge_attention_states",
    "paged_attention",
    "paged_kv_append",
    "scaled_dot_product_attention",
    "slot_mapping_for",
]


def build_info() -> dict:
    """What this installation compiled: mha_ext and torch versions, the CPU ISA builds and
    the one in use (MHA_EXT_CPU_ISA forces one), CUDA version and architectures (None / [])."""
    return {"version": __version__, **_C.build_info()}

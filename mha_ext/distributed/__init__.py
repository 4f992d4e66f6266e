"""mha_ext on torch.distributed: attention over a sequence split across processes, and
MultiHeadAttention with its heads split across processes (parallelize_attention).

from mha_ext.distributed import context_parallel_attention, shard_sequence
q_local = shard_sequence(q, dim=2)                     # (B, H, S / W, D), zigzag order
out_local = context_parallel_attention(q_local, k_local, v_local, causal="top_left")
"""

from .context_parallel import context_parallel_attention, context_parallel_attention_function
from .sequence import gather_sequence, shard_sequence
from .tensor_parallel import parallelize_attention

__all__ = [
    "context_parallel_attention",
    "context_parallel_attention_function",
    "gather_sequence",
    "parallelize_attention",
    "shard_sequence",
]

"""A paged KV cache: per-layer key/value block pools and the allocator that hands out blocks.

Each sequence owns a block table (the ids of its blocks, in order) and a length. Appending a
token writes it in place into its slot, block * block_size + offset, so the cost of a token
does not grow with the context, unlike concatenating onto a contiguous cache. Blocks are
reference-counted: fork() lets a sequence share its parent's blocks (parallel sampling, beam
search), and a shared, partly filled last block is copied before the first write into it.
"""

import math
import mmap
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .functional import slot_mapping_for

LAYOUTS = ("HND", "NHD")
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
HUGE_PAGE_BYTES = 2 << 20


def _zeros_on_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """A zeroed CPU tensor whose memory starts on a 2 MiB boundary and that Linux is asked
    (madvise) to back with transparent huge pages.

    Decode reads each sequence's blocks from all over the pool, a few KiB per head and block.
    On 4 KiB pages nearly every block of every head costs a TLB miss and a page walk; on 2 MiB
    pages decode over a cache larger than the CPU's caches ran 15-20% faster here.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    # Private, not mmap's default shared mapping: Linux gives shared memory huge pages only
    # when shmem_enabled allows it, which it rarely does. Anonymous memory reads as zeros.
    pool = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, which allocates the pages
    raw = torch.frombuffer(pool, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(shape)


def _zeros(shape: Sequence[int], dtype: torch.dtype, device, huge_pages: bool) -> Tensor:
    on_cpu = device is None or torch.device(device).type == "cpu"
    large = math.prod(shape) * dtype.itemsize >= HUGE_PAGE_BYTES
    if (
        huge_pages
        and on_cpu
        and large
        and sys.platform == "linux"
        and hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return _zeros_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _check_scales(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """fp8 caches take finite per-tensor scales > 0; the others keep 1."""
    scales = (float(k_scale), float(v_scale))
    if dtype == torch.float8_e4m3fn:
        if not all(math.isfinite(s) and s > 0 for s in scales):
            raise ValueError(
                f"PagedKVCache: k_scale and v_scale must be finite and > 0, got {k_scale!r} "
                f"and {v_scale!r}"
            )
    elif scales != (1.0, 1.0):
        raise ValueError(
            f"PagedKVCache: k_scale and v_scale are float8_e4m3fn's per-tensor scales and must "
            f"stay 1.0 for a {dtype} cache, got {k_scale!r} and {v_scale!r}"
        )


@dataclass
class CacheBatch:
    """The tensors the paged ops need for one step of a batch of sequences."""

    seq_ids: List[int]
    block_tables: Tensor  # (batch, max_blocks) int32; rows padded with block 0
    seq_lens: Tensor  # (batch,) int32: tokens cached after this step, the new ones included
    cu_seqlens_q: Tensor  # (batch + 1,) int32: new tokens of sequence b are rows cu[b]:cu[b+1]
    slot_mapping: Tensor  # (new_tokens,) int64: where each new token goes
    positions: Tensor  # (new_tokens,) int64: each new token's position in its sequence


class PagedKVCache:
    """Key and value caches of every layer plus a block allocator.

    Args:
        num_layers: one key cache and one value cache per layer.
        num_blocks: blocks in each cache.
        block_size: tokens per block (any size, 1 included).
        num_kv_heads, head_dim: the attention's key/value heads and their width.
        layout: "HND" stores (num_blocks, num_kv_heads, block_size, head_dim), kv heads before
            positions; "NHD" stores (num_blocks, block_size, num_kv_heads, head_dim). Either
            way the caches are presented as (num_blocks, num_kv_heads, block_size, head_dim)
            tensors, NHD through a strided view.
        huge_pages: on Linux, CPU caches of 2 MiB or more are allocated on transparent huge
            pages (when the kernel allows them), which makes decode over large caches faster.
        dtype: the caches' dtype: that of the keys and values, or an 8-bit format that the
            ops quantize into as they append and dequantize as they attend (keys, values and
            queries then fp32, bf16 or fp16; mha_ext.paged_kv_append gives the formats):
            torch.int8 (one fp32 scale per token and kv head, in key_scales / value_scales,
            laid out like the caches without head_dim) or torch.float8_e4m3fn (one scale per
            cache tensor: k_scale, v_scale).
        k_scale, v_scale: float8_e4m3fn's scales (> 0; stored = x / scale); 1 otherwise.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype=torch.float32,
        device=None,
        layout: str = "HND",
        huge_pages: bool = True,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"PagedKVCache: sizes must be positive, got num_layers {num_layers}, num_blocks "
                f"{num_blocks}, "
                f"block_size {block_size}, num_kv_heads {num_kv_heads}, head_dim {head_dim}"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache: layout must be 'HND' or 'NHD', got {layout!r}")
        _check_scales(dtype, k_scale, v_scale)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

        def make(row_shape, dtype):
            # (num_blocks, num_kv_heads, block_size, *row_shape), NHD through a view
            if layout == "HND":
                shape = (num_blocks, num_kv_heads, block_size, *row_shape)
                return _zeros(shape, dtype, device, huge_pages)
            shape = (num_blocks, block_size, num_kv_heads, *row_shape)
            return _zeros(shape, dtype, device, huge_pages).transpose(1, 2)

        self.key_caches = [make((head_dim,), dtype) for _ in range(num_layers)]
        self.value_caches = [make((head_dim,), dtype) for _ in range(num_layers)]
        # int8's per-(token, kv head) scales, (num_blocks, num_kv_heads, block_size) fp32;
        # None for other dtypes.
        per_row = dtype == torch.int8
        self.key_scales: List[Optional[Tensor]] = [
            make((), torch.float32) if per_row else None for _ in range(num_layers)
        ]
        self.value_scales: List[Optional[Tensor]] = [
            make((), torch.float32) if per_row else None for _ in range(num_layers)
        ]
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref_counts = [0] * num_blocks
        self._tables: Dict[int, List[int]] = {}
        self._lengths: Dict[int, int] = {}
        self._next_id = 0

    def scale_arguments(self, layer: int) -> Dict[str, object]:
        """The scale keyword arguments of mha_ext.paged_kv_append and paged_attention for
        `layer`'s caches (empty for a cache that is not 8-bit)."""
        if self.dtype not in QUANTIZED_DTYPES:
            return {}
        return {
            "k_scales": self.key_scales[layer],
            "v_scales": self.value_scales[layer],
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
        }

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A new, empty sequence; returns its id."""
        seq_id = self._next_id
        self._next_id += 1
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0
        return seq_id

    def fork(self, parent: int) -> int:
        """A new sequence sharing all of parent's tokens (and blocks) so far."""
        self._check_known(parent)
        child = self.allocate()
        self._tables[child] = list(self._tables[parent])
        self._lengths[child] = self._lengths[parent]
        for block in self._tables[child]:
            self._ref_counts[block] += 1
        return child

    def free(self, seq_id: int) -> None:
        """Drops a sequence; blocks no other sequence shares return to the pool."""
        self._check_known(seq_id)
        for block in self._tables.pop(seq_id):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        del self._lengths[seq_id]

    def seq_len(self, seq_id: int) -> int:
        self._check_known(seq_id)
        return self._lengths[seq_id]

    def block_table(self, seq_id: int) -> List[int]:
        self._check_known(seq_id)
        return list(self._tables[seq_id])

    def prepare(self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]) -> CacheBatch:
        """Makes room for num_new_tokens[i] more tokens in sequence seq_ids[i] and returns the
        batch tensors for this step. Raises before changing anything when the pool is short."""
        if len(seq_ids) != len(num_new_tokens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(
                f"PagedKVCache.prepare: need distinct seq_ids and one count each, got "
                f"{list(seq_ids)} "
                f"and {list(num_new_tokens)}"
            )
        for seq_id, count in zip(seq_ids, num_new_tokens):
            self._check_known(seq_id)
            if count < 0:
                raise ValueError(f"PagedKVCache.prepare: sequence {seq_id} asks for {count} tokens")
        needed = sum(self._blocks_needed(s, n) for s, n in zip(seq_ids, num_new_tokens))
        if needed > len(self._free):
            raise RuntimeError(
                f"PagedKVCache: out of blocks: this step needs {needed} new blocks but only "
                f"{len(self._free)} of {self.num_blocks} are free; nothing was allocated"
            )
        slots, positions = [], []
        for seq_id, count in zip(seq_ids, num_new_tokens):
            self._make_writable(seq_id, count)
            start = self._lengths[seq_id]
            new_positions = torch.arange(start, start + count)
            slots.append(
                slot_mapping_for(torch.tensor(self._tables[seq_id]), new_positions, self.block_size)
            )
            positions.append(new_positions)
            self._lengths[seq_id] = start + count
        return self._batch(list(seq_ids), num_new_tokens, slots, positions)

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._tables:
            raise KeyError(f"PagedKVCache: unknown sequence {seq_id}")

    def _last_block_shared_and_partial(self, seq_id: int) -> bool:
        table, length = self._tables[seq_id], self._lengths[seq_id]
        return length % self.block_size != 0 and self._ref_counts[table[-1]] > 1

    def _blocks_needed(self, seq_id: int, count: int) -> int:
        if count == 0:
            return 0
        capacity = len(self._tables[seq_id]) * self.block_size
        missing = max(self._lengths[seq_id] + count - capacity, 0)
        copy_on_write = 1 if self._last_block_shared_and_partial(seq_id) else 0
        return -(-missing // self.block_size) + copy_on_write

    def _make_writable(self, seq_id: int, count: int) -> None:
        if count == 0:
            return
        table = self._tables[seq_id]
        if self._last_block_shared_and_partial(seq_id):
            shared = table[-1]
            private = self._take_block()
            scales = [t for t in self.key_scales + self.value_scales if t is not None]
            for cache in self.key_caches + self.value_caches + scales:
                cache[private] = cache[shared]
            self._ref_counts[shared] -= 1
            table[-1] = private
        while len(table) * self.block_size < self._lengths[seq_id] + count:
            table.append(self._take_block())

    def _take_block(self) -> int:
        block = self._free.pop()
        self._ref_counts[block] = 1
        return block

    def _batch(self, seq_ids, counts, slots, positions) -> CacheBatch:
        device = self.key_caches[0].device
        max_blocks = max((len(self._tables[s]) for s in seq_ids), default=0)
        tables = torch.zeros(len(seq_ids), max(max_blocks, 1), dtype=torch.int32)
        for row, seq_id in enumerate(seq_ids):
            tables[row, : len(self._tables[seq_id])] = torch.tensor(
                self._tables[seq_id], dtype=torch.int32
            )
        cu_seqlens = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(list(counts), dtype=torch.int32).cumsum(0)
        empty = torch.zeros(0, dtype=torch.int64)
        return CacheBatch(
            seq_ids=seq_ids,
            block_tables=tables.to(device),
            seq_lens=torch.tensor(
                [self._lengths[s] for s in seq_ids], dtype=torch.int32, device=device
            ),
            cu_seqlens_q=cu_seqlens.to(device),
            slot_mapping=torch.cat(slots or [empty]).to(device),
            positions=torch.cat(positions or [empty]).to(device),
        )

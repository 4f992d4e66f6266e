"""Splitting a sequence across the ranks of a process group, and joining it back.

The sequence of length S is cut into equal chunks. Contiguous sharding (load_balance=None)
gives rank r chunk r of W. Causal attention then loads the last rank most: its queries see
the whole sequence, rank 0's see one chunk. Zigzag sharding cuts 2W chunks and gives rank r
chunks r and 2W-1-r (rank 0 of 2 ranks: chunks 0 and 3, rank 1: chunks 1 and 2), so every
rank holds one early and one late chunk and does the same causal work. Counted in chunk
pairs of the 2W-chunk grid (a diagonal pair counted as one), zigzag gives every rank 2W + 1
pairs; contiguous sharding gives rank r 4r + 3, from 3 on rank 0 to 4W - 1 on the last (7
against 3 at W = 2), and every step waits for the last.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

LOAD_BALANCES = ("zigzag", None)


def group_rank_and_size(group: Optional[dist.ProcessGroup], fn: str) -> Tuple[int, int]:
    """(rank, world size) of this process in group (None: the default group), or a
    RuntimeError naming fn when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{fn}: torch.distributed is not initialised; call "
            f"torch.distributed.init_process_group first (torchrun sets up its environment)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def check_load_balance(load_balance, fn: str) -> None:
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"{fn}: load_balance must be 'zigzag' or None, got {load_balance!r}")


def chunk_count(world_size: int, load_balance: Optional[str]) -> int:
    """How many equal chunks the whole sequence is cut into: 2W for zigzag, W otherwise."""
    return 2 * world_size if load_balance == "zigzag" else world_size


def shard_chunks(rank: int, world_size: int, load_balance: Optional[str]) -> List[int]:
    """The indices of the chunks rank holds, in the order its shard stores them (increasing
    sequence positions)."""
    if load_balance == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    return [rank]


def shard_sequence(
    x: Tensor, dim: int, group: Optional[dist.ProcessGroup] = None, load_balance="zigzag"
) -> Tensor:
    """This rank's shard of the full tensor x along dim (the sequence dimension).

    Args:
        x: the whole tensor, the same on every rank, e.g. (B, H, S, D) with dim=2, or
            (B, S) token ids with dim=1.
        dim: the sequence dimension; its size S must be divisible by 2W (zigzag) or W
            (None), W the world size of group.
        group: the process group (None: the default group).
        load_balance: "zigzag" (rank r gets chunks r and 2W-1-r of 2W, concatenated) or
            None (rank r gets the contiguous chunk r of W).

    Returns:
        x's shard, size S / W along dim (a copy for zigzag, a view for None). Differentiable.
    """
    fn = "mha_ext.distributed.shard_sequence"
    check_load_balance(load_balance, fn)
    rank, world_size = group_rank_and_size(group, fn)
    chunks = chunk_count(world_size, load_balance)
    length = x.shape[dim]
    if length % chunks != 0:
        raise ValueError(
            f"{fn}: x's sequence dim {dim} has size {length}, which does not split into "
            f"{chunks} equal chunks (load_balance={load_balance!r}, world size {world_size})"
        )
    pieces = x.tensor_split(chunks, dim)
    mine = [pieces[chunk] for chunk in shard_chunks(rank, world_size, load_balance)]
    return mine[0] if len(mine) == 1 else torch.cat(mine, dim)


def gather_sequence(
    x: Tensor, dim: int, group: Optional[dist.ProcessGroup] = None, load_balance="zigzag"
) -> Tensor:
    """The full tensor from every rank's shard along dim: the inverse of shard_sequence.

    Args:
        x: this rank's shard, of the same shape on every rank (size S / W along dim).
        dim, group, load_balance: as given to shard_sequence.

    Returns:
        The whole tensor (size S along dim), the same on every rank. Not differentiable: an
        all_gather of values, for results, losses to print and checks.
    """
    fn = "mha_ext.distributed.gather_sequence"
    check_load_balance(load_balance, fn)
    rank, world_size = group_rank_and_size(group, fn)
    chunks_per_shard = 2 if load_balance == "zigzag" else 1
    if x.shape[dim] % chunks_per_shard != 0:
        raise ValueError(
            f"{fn}: x's sequence dim {dim} has size {x.shape[dim]}, which is not the 2 equal "
            f"chunks of a zigzag shard"
        )
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(shards, x, group=group)
    pieces: List[Optional[Tensor]] = [None] * chunk_count(world_size, load_balance)
    for source, shard in enumerate(shards):
        owned = shard_chunks(source, world_size, load_balance)
        for chunk, piece in zip(owned, shard.tensor_split(chunks_per_shard, dim)):
            pieces[chunk] = piece
    return torch.cat(pieces, dim)

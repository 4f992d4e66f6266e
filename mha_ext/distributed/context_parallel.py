"""Context-parallel attention: each rank holds a shard of the sequence, and together the
ranks compute the attention of the whole sequence, forward and backward.

Two strategies, both on torch.distributed alone (gloo on CPU, NCCL on CUDA):
- ring: the queries stay put; the key/value shards travel around the ring of ranks, one hop
  a step, sent with batch_isend_irecv while the kernels compute on the shard that arrived
  last (two K/V buffers per rank). Each step's partial result merges into the running one by
  logsumexp. The backward runs attention_backward per block with the global out and lse,
  and each shard's dK/dV accumulator travels the ring behind it, back to its owner.
- ulysses: one all_to_all turns sequence shards of all heads into the whole sequence of
  H / W heads, each rank runs mha_ext.attention on its heads, one all_to_all turns the
  result back.
"""

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .. import functional, ops
from .sequence import (
    check_load_balance,
    chunk_count,
    group_rank_and_size,
    shard_chunks,
)

STRATEGIES = ("ring", "ulysses")
_FN = "mha_ext.distributed.context_parallel_attention"

# batch_isend_irecv tags: K/V shards and dK/dV accumulators travel to the same neighbour at
# the same time in the backward, and have the same byte size for fp32 inputs.
_KV_TAG = 1
_GRAD_TAG = 2

Band = Tuple[Optional[int], Optional[int]]  # lo <= key - query <= hi; None: unbounded


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: local query rows [q_start, q_stop) against rows
    [k_start, k_stop) of the key/value shard held, with the window (left, right) of a
    top-left aligned call on those rows (-1: unbounded side)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window_left: int
    window_right: int


def _clip(band: Band, q_len: int, k_len: int) -> Optional[Band]:
    """The band over a block of q_len x k_len, where key - query runs over
    [-(q_len - 1), k_len - 1]: None when no pair of the block is in it, else the band with
    None for a side that reaches the block's edge."""
    lowest, highest = -(q_len - 1), k_len - 1
    lo = lowest if band[0] is None else max(band[0], lowest)
    hi = highest if band[1] is None else min(band[1], highest)
    if lo > hi:
        return None
    return (None if lo == lowest else lo, None if hi == highest else hi)


def _shifted(band: Band, shift: int) -> Band:
    """The band seen from a frame whose key - query is `shift` less."""
    return tuple(None if side is None else side - shift for side in band)


def _kernel_call(q_start: int, q_len: int, k_start: int, k_len: int, band: Band) -> BlockCall:
    """The call computing the clipped band over the block: the kernels' windows reach both
    ways from the diagonal (sides >= 0), so a band wholly above it (lo > 0) drops the first
    lo keys, which no query sees, and one wholly below it (hi < 0) drops the first -hi
    queries, which see no key (their rows keep out 0, lse -inf)."""
    lo, hi = band
    if lo is not None and lo > 0:
        k_start, k_len = k_start + lo, k_len - lo
        lo, hi = 0, None if hi is None else hi - lo
    elif hi is not None and hi < 0:
        q_start, q_len = q_start - hi, q_len + hi
        lo, hi = None if lo is None else lo - hi, 0
    return BlockCall(
        q_start,
        q_start + q_len,
        k_start,
        k_start + k_len,
        -1 if lo is None else -lo,
        -1 if hi is None else hi,
    )


def plan_ring_step(
    q_chunks: List[int], kv_chunks: List[int], q_chunk_len: int, k_chunk_len: int, band: Band
) -> List[BlockCall]:
    """The kernel calls of one ring step: this rank's query chunks (global chunk indices, in
    shard order) against the held key/value chunks, `band` bounding key - query in global
    positions. Fully masked chunk pairs are skipped; chunk pairs whose visible sets one
    call reproduces (the same band in one frame) share a call: rows of query chunks, columns
    of key chunks or the whole block, whichever needs the fewest calls."""

    def pair_band(a: int, b: int) -> Optional[Band]:
        shift = kv_chunks[b] * k_chunk_len - q_chunks[a] * q_chunk_len
        return _clip(_shifted(band, shift), q_chunk_len, k_chunk_len)

    def joint_call(rows: List[int], cols: List[int]):
        """One call over query chunks `rows` x key chunks `cols` (consecutive in the shard),
        [] when all their pairs are masked, None when one call cannot reproduce them."""
        frame_band = _shifted(
            band, kv_chunks[cols[0]] * k_chunk_len - q_chunks[rows[0]] * q_chunk_len
        )
        for a in rows:
            for b in cols:
                local_shift = (b - cols[0]) * k_chunk_len - (a - rows[0]) * q_chunk_len
                in_frame = _clip(_shifted(frame_band, local_shift), q_chunk_len, k_chunk_len)
                if in_frame != pair_band(a, b):
                    return None
        if all(pair_band(a, b) is None for a in rows for b in cols):
            return []
        q_len, k_len = len(rows) * q_chunk_len, len(cols) * k_chunk_len
        clipped = _clip(frame_band, q_len, k_len)
        return [_kernel_call(rows[0] * q_chunk_len, q_len, cols[0] * k_chunk_len, k_len, clipped)]

    def pair_call(a: int, b: int) -> List[BlockCall]:
        return joint_call([a], [b])

    rows, cols = list(range(len(q_chunks))), list(range(len(kv_chunks)))
    candidates = []
    whole = joint_call(rows, cols)
    if whole is not None:
        candidates.append(whole)
    by_rows, by_cols = [], []
    for a in rows:
        row = joint_call([a], cols)
        by_rows += row if row is not None else [c for b in cols for c in pair_call(a, b)]
    for b in cols:
        col = joint_call(rows, [b])
        by_cols += col if col is not None else [c for a in rows for c in pair_call(a, b)]
    candidates += [by_rows, by_cols]
    return min(candidates, key=len)


def global_band(causal, window, seq_q: int, seq_k: int) -> Band:
    """The keys query i sees, as bounds on key - query over the whole sequences, with
    mha_ext.attention's conventions (the diagonal of `causal`, bottom-right without it)."""
    left, right, bottom_right = functional._window_bounds(causal, window, _FN)
    offset = seq_k - seq_q if bottom_right else 0
    return (None if left == -1 else offset - left, None if right == -1 else offset + right)


class _Ring:
    """This rank's neighbours in the ring of a process group."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int):
        self.group = group
        self.world_size = world_size
        self.next = (rank + 1) % world_size
        self.previous = (rank - 1) % world_size

    def shift(self, send: Tensor, receive: Tensor, tag: int) -> List[dist.Work]:
        """Posts send to the next rank and receive from the previous one; returns the works."""
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, group=self.group, group_peer=self.next, tag=tag),
                dist.P2POp(
                    dist.irecv, receive, group=self.group, group_peer=self.previous, tag=tag
                ),
            ]
        )


def _wait(works: List[dist.Work]) -> None:
    for work in works:
        work.wait()


class _KVLayout:
    """k and v packed into one flat buffer, so that a ring hop is one message."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k_shape, self.v_shape = k.shape, v.shape
        self.k_numel = k.numel()

    def pack(self, k: Tensor, v: Tensor) -> Tensor:
        kv = k.new_empty(self.k_numel + v.numel())
        self.unpack(kv)[0].copy_(k)
        self.unpack(kv)[1].copy_(v)
        return kv

    def unpack(self, kv: Tensor) -> Tuple[Tensor, Tensor]:
        # (B, Hkv, S_local, D), (B, Hkv, S_local, Dv) views of the flat buffer
        return kv[: self.k_numel].view(self.k_shape), kv[self.k_numel :].view(self.v_shape)


def _ring_forward(q, kv, layout, ring, plans, scale, deterministic) -> Tuple[Tensor, Tensor]:
    """(out (B, H, S_local, Dv) in q's dtype, lse (B, H, S_local)) of q against every rank's
    keys and values, merged in the lse dtype (fp32; fp64 for fp64)."""
    accumulate = ops.lse_dtype(q.dtype)
    batch, heads, seq_q, _ = q.shape
    out = q.new_zeros(batch, heads, seq_q, layout.v_shape[-1], dtype=accumulate)
    lse = q.new_full((batch, heads, seq_q), -math.inf, dtype=accumulate)
    for step in range(ring.world_size):
        in_flight: List[dist.Work] = []
        if step + 1 < ring.world_size:
            incoming = torch.empty_like(kv)
            in_flight = ring.shift(kv, incoming, _KV_TAG)
        k, v = layout.unpack(kv)
        for call in plans[step]:
            rows, keys = slice(call.q_start, call.q_stop), slice(call.k_start, call.k_stop)
            block_out, block_lse = ops.attention_forward(
                q[:, :, rows],
                k[:, :, keys],
                v[:, :, keys],
                None,
                None,
                0.0,
                scale,
                call.window_left,
                call.window_right,
                False,
                deterministic=deterministic,
            )
            merged_out, merged_lse = ops.merge_attention_states(
                out[:, :, rows], lse[:, :, rows], block_out.to(accumulate), block_lse
            )
            out[:, :, rows] = merged_out
            lse[:, :, rows] = merged_lse
        _wait(in_flight)
        if in_flight:
            kv = incoming
    return out.to(q.dtype), lse


def _ring_backward(
    grad_out, grad_lse, q, kv, out, lse, layout, ring, plans, scale, deterministic
) -> Tuple[Tensor, Tensor]:
    """(grad_q, grad_kv): grad_kv is the packed dK/dV of this rank's own shard, summed over
    every rank's queries, in the lse dtype."""
    accumulate = ops.lse_dtype(q.dtype)
    grad_q = torch.zeros(q.shape, dtype=accumulate, device=q.device)
    grads_in_flight: List[dist.Work] = []
    received: Optional[Tensor] = None  # the accumulator of the shard held, from the previous rank
    for step in range(ring.world_size):
        kv_in_flight: List[dist.Work] = []
        if step + 1 < ring.world_size:
            incoming = torch.empty_like(kv)
            kv_in_flight = ring.shift(kv, incoming, _KV_TAG)
        k, v = layout.unpack(kv)
        grad_kv = torch.zeros(kv.shape, dtype=accumulate, device=kv.device)
        grad_k, grad_v = layout.unpack(grad_kv)
        for call in plans[step]:
            rows, keys = slice(call.q_start, call.q_stop), slice(call.k_start, call.k_stop)
            block_grad_q, block_grad_k, block_grad_v, _ = ops.attention_backward(
                grad_out[:, :, rows],
                None if grad_lse is None else grad_lse[:, :, rows],
                q[:, :, rows],
                k[:, :, keys],
                v[:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                None,  # attn_mask
                None,  # dropout_seed
                0.0,  # dropout_p
                scale,
                call.window_left,
                call.window_right,
                False,  # bottom_right
                0.0,  # softcap
                None,  # alibi_slopes
                None,  # sinks
                None,  # cu_seqlens_q
                None,  # cu_seqlens_k
                None,  # seqused_k
                0,  # max_seqlen_q
                0,  # max_seqlen_k
                deterministic,
            )
            grad_q[:, :, rows] += block_grad_q
            grad_k[:, :, keys] += block_grad_k
            grad_v[:, :, keys] += block_grad_v
        # The shard held now arrived from the previous rank, and its accumulator follows it
        # one step behind: add this rank's part and pass it on. After the last step it
        # arrives back at the shard's owner.
        _wait(grads_in_flight)
        if received is not None:
            grad_kv += received
        if ring.world_size > 1:
            received = torch.empty_like(grad_kv)
            grads_in_flight = ring.shift(grad_kv, received, _GRAD_TAG)
        _wait(kv_in_flight)
        if kv_in_flight:
            kv = incoming
    if ring.world_size == 1:
        return grad_q, grad_kv
    _wait(grads_in_flight)
    return grad_q, received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, plans, scale, deterministic):
        layout = _KVLayout(k, v)
        kv = layout.pack(k, v)
        out, lse = _ring_forward(q, kv, layout, ring, plans, scale, deterministic)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.layout, ctx.ring, ctx.plans = layout, ring, plans
        ctx.scale, ctx.deterministic = scale, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, kv, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_q, grad_kv = _ring_backward(
            grad_out,
            grad_lse,
            q,
            kv,
            out,
            lse,
            ctx.layout,
            ctx.ring,
            ctx.plans,
            ctx.scale,
            ctx.deterministic,
        )
        grad_k, grad_v = ctx.layout.unpack(grad_kv.to(q.dtype))
        return grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


def _ring_plans(rank, world_size, load_balance, q, k, band) -> List[List[BlockCall]]:
    """The kernel calls of each step: at step s this rank holds the shard of rank r - s."""
    q_chunks = shard_chunks(rank, world_size, load_balance)
    per_shard = len(q_chunks)
    q_chunk_len, k_chunk_len = q.shape[2] // per_shard, k.shape[2] // per_shard
    return [
        plan_ring_step(
            q_chunks,
            shard_chunks((rank - step) % world_size, world_size, load_balance),
            q_chunk_len,
            k_chunk_len,
            band,
        )
        for step in range(world_size)
    ]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 in equal parts: part w goes to rank w, and part w of
    the result comes from rank w. The transpose of that exchange is the exchange itself, so
    the backward sends the gradient the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def _natural_order_pieces(
    shards: Tensor, world_size: int, load_balance: Optional[str]
) -> List[Tensor]:
    """shards (W, B, h, S_local, D), shard w being rank w's -> the chunks of the whole
    sequence in order, each (B, h, S_local / chunks per shard, D)."""
    pieces: List[Optional[Tensor]] = [None] * chunk_count(world_size, load_balance)
    for source in range(world_size):
        owned = shard_chunks(source, world_size, load_balance)
        for chunk, piece in zip(owned, shards[source].tensor_split(len(owned), 2)):
            pieces[chunk] = piece
    return pieces


def _sequence_to_heads(x, group, world_size, load_balance) -> Tensor:
    """(B, Hx, S_local, D) this rank's sequence shard of all heads -> (B, Hx / W, S, D) the
    whole sequence of this rank's head group, in sequence order."""
    batch, heads, seq_local, dim = x.shape
    send = x.reshape(batch, world_size, heads // world_size, seq_local, dim)
    send = send.transpose(0, 1).contiguous()  # (W, B, Hx / W, S_local, D): w's heads first
    received = _AllToAll.apply(send, group)
    # received[w]: rank w's sequence shard of this rank's heads
    return torch.cat(_natural_order_pieces(received, world_size, load_balance), 2)


def _heads_to_sequence(x, group, world_size, load_balance) -> Tensor:
    """(B, Hx / W, S, D) the whole sequence of this rank's head group -> (B, Hx, S_local, D)
    this rank's sequence shard of all heads: the inverse of _sequence_to_heads."""
    batch, group_heads, seq, dim = x.shape
    chunks = x.tensor_split(chunk_count(world_size, load_balance), 2)
    send = torch.stack(
        [
            torch.cat([chunks[c] for c in shard_chunks(w, world_size, load_balance)], 2)
            for w in range(world_size)
        ]
    )  # (W, B, Hx / W, S_local, D): rank w's sequence shard first
    received = _AllToAll.apply(send, group)
    # received[w]: this rank's sequence shard of head group w
    return received.transpose(0, 1).reshape(batch, world_size * group_heads, -1, dim)


def _ulysses(q, k, v, group, world_size, load_balance, causal, scale, window, return_lse):
    kv_heads = k.shape[1]
    if kv_heads % world_size != 0:
        # Each rank needs the kv heads of its query heads: repeat them to lcm(Hkv, W), which
        # W divides and which divides H (both W and Hkv do), keeping the GQA grouping.
        repeat = math.lcm(kv_heads, world_size) // kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    q_heads, k_heads, v_heads = (
        _sequence_to_heads(x, group, world_size, load_balance) for x in (q, k, v)
    )  # (B, H / W, S, D), (B, Hkv' / W, S, D), (B, Hkv' / W, S, Dv)
    out, lse = functional.attention(
        q_heads, k_heads, v_heads, causal=causal, scale=scale, window=window, return_lse=True
    )
    out = _heads_to_sequence(out, group, world_size, load_balance)  # (B, H, S_local, Dv)
    if not return_lse:
        return out
    lse = _heads_to_sequence(lse.unsqueeze(-1), group, world_size, load_balance)
    return out, lse.squeeze(-1)  # (B, H, S_local)


def _check_inputs(q, k, v, strategy, load_balance, dropout_p, world_size) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"{_FN}: strategy must be 'ring' or 'ulysses', got {strategy!r}")
    check_load_balance(load_balance, _FN)
    if dropout_p != 0.0:
        raise ValueError(
            f"{_FN}: dropout_p must be 0, got {dropout_p!r}: dropout is not supported in "
            f"context parallelism (each block would draw its mask in its own coordinates)"
        )
    tensors = {"q": q, "k": k, "v": v}
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor) or tensor.dim() != 4:
            raise ValueError(
                f"{_FN}: {name} must be a 4-D tensor (batch, heads, seq_local, head_dim), got "
                f"{tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor)}"
            )
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if (
        k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1] != 0
    ):
        raise ValueError(
            f"{_FN}: q (B, H, Sq, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv) must agree, with "
            f"Hkv dividing H, got {shapes}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"{_FN}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    per_shard = 2 if load_balance == "zigzag" else 1
    for name in ("q", "k"):
        seq_local = tensors[name].shape[2]
        if seq_local == 0 or seq_local % per_shard != 0:
            need = (
                "even and positive (load_balance='zigzag': each shard holds 2 of the 2W "
                "equal chunks)"
                if per_shard == 2
                else "positive"
            )
            raise ValueError(f"{_FN}: {name}'s seq_local {seq_local} must be {need}")
    if strategy == "ulysses" and q.shape[1] % world_size != 0:
        raise ValueError(
            f"{_FN}: q has {q.shape[1]} heads, which the world size {world_size} does not "
            f"divide (strategy='ulysses' gives each rank H / W heads)"
        )


_LOAD_BALANCE_CODES = (None, "zigzag")


def _check_ranks_agree(q, k, v, strategy, load_balance, causal, window, scale, group) -> None:
    """Compares the shapes and options of every rank (one small all_gather), so that a
    mismatch raises the same error on every rank instead of hanging a collective."""
    left, right, bottom_right = functional._window_bounds(causal, window, _FN)
    dtypes = functional.KERNEL_DTYPES
    fields = {
        "batch": q.shape[0],
        "heads": q.shape[1],
        "kv_heads": k.shape[1],
        "q seq_local": q.shape[2],
        "k seq_local": k.shape[2],
        "head_dim": q.shape[3],
        "v head_dim": v.shape[3],
        "dtype": dtypes.index(q.dtype) if q.dtype in dtypes else -1,
        "strategy": STRATEGIES.index(strategy),
        "load_balance": _LOAD_BALANCE_CODES.index(load_balance),
        "window_left": left,
        "window_right": right,
        "bottom_right": int(bottom_right),
        "scale": scale,
    }
    mine = torch.tensor(list(fields.values()), dtype=torch.float64, device=q.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [
        index for index in range(len(fields)) if any(o[index] != mine[index] for o in everyone)
    ]
    if not differ:
        return
    names = list(fields)
    decode = {
        "dtype": lambda code: dtypes[code] if code >= 0 else "other",
        "strategy": lambda code: STRATEGIES[code],
        "load_balance": lambda code: _LOAD_BALANCE_CODES[code],
    }

    def shown(index, value):
        name = names[index]
        return value if name == "scale" else decode.get(name, int)(int(value))

    table = {
        rank: {names[i]: shown(i, other[i].item()) for i in differ}
        for rank, other in enumerate(everyone)
    }
    raise ValueError(
        f"{_FN}: the ranks disagree on {', '.join(names[i] for i in differ)} (by group rank: "
        f"{table}); every rank must pass shards of one shape and the same options"
    )


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    strategy: str = "ring",
    causal: Optional[str] = None,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    load_balance: Optional[str] = "zigzag",
    return_lse: bool = False,
    dropout_p: float = 0.0,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across the ranks of `group`: every rank calls it
    with its shards and gets its shard of mha_ext.attention's result on the whole sequence.

    Args:
        q: (B, H, Sq_local, D) this rank's query shard, as shard_sequence(q_full, 2, group,
            load_balance) gives it (Sq = W x Sq_local). k: (B, Hkv, Sk_local, D), v: (B, Hkv,
            Sk_local, Dv) likewise; Hkv divides H (GQA). With zigzag the local lengths are
            even (two chunks each); with load_balance=None any length >= 1.
        group: the process group of the sequence shards (None: the default group).
        strategy: "ring" (K/V shards travel the ring while the current block computes;
            fully masked blocks are skipped) or "ulysses" (all_to_all to H / W heads of the
            whole sequence, local attention, all_to_all back; W must divide H, and kv heads
            are repeated when W does not divide Hkv).
        causal, scale, window: as in mha_ext.attention, applied to the whole sequence
            (alignments and windows relative to global positions).
        load_balance: how the sequence was sharded, "zigzag" or None (see shard_sequence).
        return_lse: also return the logsumexp shard (B, H, Sq_local), fp32 (fp64 for fp64).
        dropout_p: must be 0: dropout is not supported here.

    Returns:
        out (B, H, Sq_local, Dv) in q's dtype, or (out, lse). Differentiable in q, k and v;
        the backward is distributed as well, so every rank must call it.

    Every rank must call this with shards of one shape and the same options: one small
    all_gather compares them first and raises a ValueError on every rank when they differ.
    """
    rank, world_size = group_rank_and_size(group, _FN)
    _check_inputs(q, k, v, strategy, load_balance, dropout_p, world_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    band = global_band(causal, window, world_size * q.shape[2], world_size * k.shape[2])
    _check_ranks_agree(q, k, v, strategy, load_balance, causal, window, scale, group)
    if strategy == "ulysses":
        return _ulysses(q, k, v, group, world_size, load_balance, causal, scale, window, return_lse)
    ring = _Ring(group, rank, world_size)
    plans = _ring_plans(rank, world_size, load_balance, q, k, band)
    deterministic = torch.are_deterministic_algorithms_enabled()
    out, lse = _RingAttention.apply(q, k, v, ring, plans, scale, deterministic)
    return (out, lse) if return_lse else out


def context_parallel_attention_function(
    *,
    group: Optional[dist.ProcessGroup] = None,
    strategy: str = "ring",
    load_balance: Optional[str] = "zigzag",
) -> Callable[..., Union[Tensor, Tuple[Tensor, Tensor]]]:
    """A function with mha_ext.attention's signature that runs context_parallel_attention,
    for MultiHeadAttention.attention_function: a model whose ranks each hold their shard of
    the sequence (shard_sequence, with this load_balance) then attends over the whole of it.

    The arguments context parallelism lacks (attn_mask, softcap, alibi_slopes, sinks,
    dropout_p) raise a ValueError naming them when set.
    """

    def attend(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: Optional[str] = None,
        scale: Optional[float] = None,
        window: Optional[Tuple[Optional[int], Optional[int]]] = None,
        attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        return_lse: bool = False,
        softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        unsupported = {
            "attn_mask": attn_mask is not None,
            "softcap": softcap != 0.0,
            "alibi_slopes": alibi_slopes is not None,
            "sinks": sinks is not None,
        }
        if any(unsupported.values()):
            raise ValueError(
                f"{_FN}: {', '.join(name for name, on in unsupported.items() if on)} not "
                f"supported in context parallelism"
            )
        return context_parallel_attention(
            q,
            k,
            v,
            group=group,
            strategy=strategy,
            causal=causal,
            scale=scale,
            window=window,
            load_balance=load_balance,
            return_lse=return_lse,
            dropout_p=dropout_p,
        )

    return attend

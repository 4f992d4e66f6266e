"""Memory over many calls, and requests the machine cannot serve."""

import pytest
import torch

import mha_ext

from memory_probe import resident_anonymous_bytes

# Resident memory of the CPU backend.
pytestmark = pytest.mark.cpu_only

CALLS = 10_000


SHAPES = 96  # calls cycle through this many (op, dtype, shape) combinations


def call_with_shape(index):
    """One op call whose kind and shape change with index: forward, backward, append and
    paged attention in turn, fp32 and bf16, 1..97 query and key rows, 1..4 heads."""
    index %= SHAPES
    dtype = torch.bfloat16 if index % 2 else torch.float32
    seq_q, seq_k = 1 + index * 7 % 97, 1 + index * 13 % 89
    heads, head_dim = (1, 2, 4)[index % 3], (16, 64, 40)[index % 3]
    kind = index // 2 % 4
    if kind < 2:
        q = torch.randn(1, heads, seq_q, head_dim, dtype=dtype, requires_grad=kind == 1)
        k, v = torch.randn(2, 1, 1, seq_k, head_dim, dtype=dtype, requires_grad=kind == 1)
        out = mha_ext.attention(q, k, v, causal="bottom_right")
        if kind == 1:
            out.sum().backward()
        return
    blocks = 2 + seq_k // 16
    k_cache = torch.zeros(blocks, 1, 16, head_dim, dtype=dtype)
    v_cache = torch.zeros(blocks, 1, 16, head_dim, dtype=dtype)
    if kind == 2:
        key, value = torch.randn(2, seq_k, 1, head_dim, dtype=dtype)
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, torch.arange(seq_k))
        return
    tables = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    queries = min(seq_q, seq_k)
    mha_ext.paged_attention(
        torch.randn(queries, heads, head_dim, dtype=dtype),
        k_cache,
        v_cache,
        tables,
        torch.tensor([seq_k], dtype=torch.int32),
        torch.tensor([0, queries], dtype=torch.int32),
    )


def test_ten_thousand_calls_of_changing_shapes_keep_memory_bounded():
    # The first calls grow what is kept between calls to its size for these shapes: the
    # kept workspaces, and torch's brgemm kernels, which it generates and keeps for every
    # new matrix shape and thread (about 40 KiB each: README, "Behaviour at the edges").
    # After them nothing may accumulate: a leak of 2 KiB a call would add 18 MiB over the
    # measured 9,000 calls.
    # One thread: what a call leaks does not depend on the thread count, and on a loaded
    # 2-core machine two threads wait for each other's wake-ups (18 ms a call measured at
    # load 10, against 0.4 ms on one thread).
    warm_up = 1_000
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for index in range(warm_up):
            call_with_shape(index)
        before = resident_anonymous_bytes()
        for index in range(warm_up, CALLS):
            call_with_shape(index)
        growth = resident_anonymous_bytes() - before
    finally:
        torch.set_num_threads(previous)
    assert growth < 16 << 20, f"{CALLS - warm_up} calls grew resident memory by {growth >> 10} KiB"


def test_allocations_too_large_for_any_machine_raise_a_clean_error():
    # 2^48 bytes exceed the 47-bit user address space of x86-64 Linux, so the request fails
    # whatever the overcommit policy: for the output (2^40 broadcast query rows of 64 fp32)
    # and for the bf16 forward's packed K/V workspace (2^40 broadcast keys).
    huge = 1 << 40
    q = torch.randn(1, 1, 1, 64).expand(1, 1, huge, 64)
    k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        mha_ext.attention(q, k, v)
    q = torch.randn(1, 1, 4, 64).bfloat16()
    k, v = (torch.randn(1, 1, 1, 64).bfloat16().expand(1, 1, huge, 64) for _ in range(2))
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        mha_ext.attention(q, k, v)
    # The process goes on: the next call works.
    assert mha_ext.attention(q, k[:, :, :8], v[:, :, :8]).shape == (1, 1, 4, 64)

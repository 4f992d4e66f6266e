"""The paged index math that the CPU and CUDA kernels share (csrc/include/mha_ext/
paged_cache.h), tested through the paged_attention op, which runs it for every query and
key: position_location and cache_row_offset (where a token's rows lie in the cache),
paged_keys_seen (queries are the last tokens of their sequence and see the keys up to
themselves) and split_key_range (the keys each key split takes). On CPU the thread count
decides the splits; test_cuda_emulation.py compares the CUDA kernels with the CPU op.

The caches are built so that a wrong index shows exactly: every value row holds its own
position, every slot no sequence owns holds NaN, and with q = 0 every score is 0, so a
query's output is the mean of the positions it sees and its logsumexp is the log of how
many it sees. A key read twice, missed or past the query moves both.
"""

import math

import pytest
import torch

import mha_ext

from conftest import seeded_generator

HEAD_DIM = 16
LENGTHS = [1, 17, 300, 2100]
QUERIES = {"decode": [1, 1, 1, 1], "chunked_prefill": [1, 5, 70, 9]}


def positional_cache(lengths, queries, heads, kv_heads, block_size, dtype):
    """Sequences at shuffled blocks of a NaN-filled cache, the value rows of token p holding
    p in every channel and the key rows random; q zero. Returns paged_attention's inputs."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns
    shape = (num_blocks, kv_heads, block_size, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=seeded_generator(1))
    tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        tables[b, : blocks_per_seq[b]] = order[used : used + blocks_per_seq[b]].int()
        used += blocks_per_seq[b]
        keys = torch.randn(n, kv_heads, HEAD_DIM, generator=seeded_generator(b)).to(dtype)
        values = torch.arange(n, dtype=dtype)[:, None, None]  # (n, 1, 1): row p holds p
        values = values.expand(n, kv_heads, HEAD_DIM).contiguous()
        slots = mha_ext.slot_mapping_for(tables[b], torch.arange(n), block_size)
        mha_ext.paged_kv_append(keys, values, k_cache, v_cache, slots)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(queries).cumsum(0)
    q = torch.zeros(int(cu[-1]), heads, HEAD_DIM, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), cu


def query_positions(lengths, queries):
    """The cache position of every packed query: the last tokens of its sequence."""
    return torch.tensor([n - count + i for n, count in zip(lengths, queries) for i in range(count)])


@pytest.fixture(params=[1, 4], ids=["1_thread", "4_threads"])
def threads(request):
    # With 4 threads the few long sequences leave threads idle, so their keys are split
    # (plan_paged_tasks); with 1 they are not.
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("mode", list(QUERIES))
def test_each_query_sees_exactly_the_keys_up_to_itself(mode, block_size, heads, dtype, threads):
    queries = QUERIES[mode]
    inputs = positional_cache(LENGTHS, queries, *heads, block_size, dtype)
    out, lse = mha_ext.paged_attention(*inputs, return_lse=True)
    position = query_positions(LENGTHS, queries)[:, None].double()  # (total_q, 1)
    # Keys 0..position, each with weight 1 / (position + 1).
    torch.testing.assert_close(
        lse.double(), torch.log(position + 1).expand_as(lse), rtol=0, atol=1e-5
    )
    expected = (position / 2)[:, :, None].expand_as(out)
    # bf16 rows hold positions rounded to 8 significant bits, the output a rounded mean.
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_each_position_is_read_from_its_own_slot(block_size, threads):
    # One key at a time gets a score that outweighs all others: every query that sees it
    # returns its position, the queries before it the mean of what they see.
    lengths, queries = [300, 2100], [70, 1]
    positions = query_positions(lengths, queries)
    for marked in sorted({0, block_size - 1, block_size, 299, 1000, 2099}):
        q, k_cache, v_cache, tables, seq_lens, cu = positional_cache(
            lengths, queries, 4, 2, block_size, torch.float32
        )
        q[:, :, 0] = 1.0
        k_cache[..., 0] = torch.where(k_cache[..., 0].isnan(), k_cache[..., 0], 0.0)
        for b, n in enumerate(lengths):
            if marked < n:
                slot = mha_ext.slot_mapping_for(tables[b], torch.tensor([marked]), block_size)
                # e^100 outweighs the other keys' e^0
                k_cache[slot // block_size, :, slot % block_size, 0] = 100.0
        out = mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=1.0)
        sees_marked = positions >= marked
        expected = torch.where(sees_marked, float(marked), positions / 2).double()
        torch.testing.assert_close(
            out[:, :, 0].double(),
            expected[:, None].expand(-1, 4),
            rtol=1e-5,
            atol=1e-4,
            msg=lambda m: f"marked position {marked}: {m}",
        )


def test_split_key_ranges_take_every_key_once():
    # A long decode at many threads splits its keys into as many ranges as the threads ask
    # for, at most one per 256 keys: 16 splits of 320 keys here, the last three empty. The
    # uniform mean over all of them stays exact.
    previous = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        lengths, queries = [4099], [1]
        inputs = positional_cache(lengths, queries, 2, 1, 16, torch.float32)
        out, lse = mha_ext.paged_attention(*inputs, return_lse=True)
    finally:
        torch.set_num_threads(previous)
    assert lse.flatten().tolist() == pytest.approx([math.log(4099)] * 2, abs=1e-5)
    torch.testing.assert_close(out, torch.full_like(out, 4098 / 2), rtol=1e-5, atol=1e-3)

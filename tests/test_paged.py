"""Paged KV cache: in-place append, paged attention, state merging, allocator, generation."""

import gc
import sys

import pytest
import torch

import mha_ext
from mha_ext.models import CausalLM
from mha_ext.reference import attention_reference, paged_attention_reference

from conftest import OUTPUT_FACTOR, assert_within_rule, seeded_generator


def make_cache(
    num_blocks, kv_heads, block_size, head_dim, dtype=torch.float32, layout="HND", fill=None
):
    generator = seeded_generator(5)
    shape = (
        (num_blocks, kv_heads, block_size, head_dim)
        if layout == "HND"
        else (num_blocks, block_size, kv_heads, head_dim)
    )
    cache = (
        torch.randn(shape, generator=generator).to(dtype)
        if fill is None
        else torch.full(shape, fill, dtype=dtype)
    )
    return cache if layout == "HND" else cache.transpose(1, 2)


# ---------------------------------------------------------------- append


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_append_writes_exactly_the_addressed_slots(layout, block_size, dtype):
    num_blocks, kv_heads, head_dim = 6, 2, 8
    k_cache = make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, layout)
    v_cache = make_cache(num_blocks, kv_heads, block_size, head_dim + 4, dtype, layout)
    capacity = num_blocks * block_size
    slots = torch.tensor([3, -1, capacity - 1, 0, -1][: min(5, capacity + 2)], dtype=torch.int64)
    slots = torch.where(slots >= capacity, -1, slots)
    key = torch.randn(len(slots), kv_heads, head_dim).to(dtype)
    value = torch.randn(len(slots), kv_heads, head_dim + 4).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[token]
            expected_v[slot // block_size, :, slot % block_size] = value[token]
    mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_append_takes_strided_keys():
    k_cache = make_cache(4, 2, 4, 8)
    v_cache = make_cache(4, 2, 4, 8)
    fused = torch.randn(3, 2, 16)  # keys and values side by side, as one projection gives them
    key, value = fused[..., :8], fused[..., 8:]
    mha_ext.paged_kv_append(key, value, k_cache, v_cache, torch.tensor([5, 6, 15]))
    assert torch.equal(k_cache[1, :, 1], key[0]) and torch.equal(v_cache[3, :, 3], value[2])


@pytest.mark.parametrize("bad_slot", [16, 1000, -2])
def test_out_of_range_slot_raises_and_changes_nothing(bad_slot, host_index_checks):
    k_cache, v_cache = make_cache(4, 2, 4, 8), make_cache(4, 2, 4, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 1, bad_slot, 2])
    with pytest.raises(
        RuntimeError,
        match=rf"slot_mapping\[2\] = {bad_slot} is outside the cache's 16 slots \(4 blocks x 4\)",
    ):
        mha_ext.paged_kv_append(torch.randn(4, 2, 8), torch.randn(4, 2, 8), k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.int32), before_k.view(torch.int32))
    assert torch.equal(v_cache.view(torch.int32), before_v.view(torch.int32))


def test_append_argument_errors():
    k_cache, v_cache = make_cache(4, 2, 4, 8), make_cache(4, 2, 4, 8)
    key, value, slots = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 1, 2])
    append = mha_ext.paged_kv_append
    with pytest.raises(
        RuntimeError, match=r"key and value have 3 and 2 kv heads but the cache has 2"
    ):
        append(torch.randn(3, 3, 8), value, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match=r"key has head_dim 6 but k_cache has 8"):
        append(key[..., :6], value, k_cache, v_cache, slots)
    with pytest.raises(
        RuntimeError, match=r"key has dtype torch.bfloat16 but k_cache has torch.float32"
    ):
        append(key.bfloat16(), value, k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match=r"slot_mapping must be torch.int64, got torch.int32"):
        append(key, value, k_cache, v_cache, slots.int())
    with pytest.raises(RuntimeError, match=r"one entry per token, got 3, 3 and 2"):
        append(key, value, k_cache, v_cache, slots[:2])
    with pytest.raises(
        RuntimeError,
        match=r"k_cache and v_cache must agree in \[num_blocks, num_kv_heads, block_size\]",
    ):
        append(key, value, k_cache, make_cache(5, 2, 4, 8), slots)


# ---------------------------------------------------------------- paged attention


def build_paged(
    lengths,
    queries,
    heads,
    kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    shuffle=True,
    seed=0,
):
    """A cache holding sequences of the given lengths at scattered blocks, NaN everywhere
    else, plus the packed queries and the contiguous K/V of each sequence."""
    generator = seeded_generator(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3  # three blocks nobody uses
    k_cache = make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, fill=float("nan"))
    v_cache = make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, fill=float("nan"))
    # The shuffle draws from its own generator, so the data is the same either way.
    order = (
        torch.randperm(num_blocks, generator=seeded_generator(seed + 1))
        if shuffle
        else torch.arange(num_blocks)
    )
    tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(lengths):
        tables[b, : blocks_per_seq[b]] = order[used : used + blocks_per_seq[b]].int()
        used += blocks_per_seq[b]
        k = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        slots = mha_ext.slot_mapping_for(tables[b], torch.arange(n), block_size)
        mha_ext.paged_kv_append(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(queries).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), cu, keys, values


def check_against_reference(
    lengths, queries, heads, kv_heads, head_dim, block_size, dtype=torch.float32
):
    q, k_cache, v_cache, tables, seq_lens, cu, keys, values = build_paged(
        lengths, queries, heads, kv_heads, head_dim, block_size, dtype
    )
    out, lse = mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2] and torch.isfinite(out).all()
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        # (tokens, heads, dim) -> (1, heads, tokens, dim)
        q_b, k_b, v_b = (t.transpose(0, 1)[None] for t in (q[rows], keys[b], values[b]))
        ref, ref_lse = attention_reference(
            q_b.double(), k_b.double(), v_b.double(), causal="bottom_right"
        )
        plain, _ = attention_reference(q_b, k_b, v_b, causal="bottom_right")
        assert_within_rule(
            out[rows].transpose(0, 1)[None], ref, plain, OUTPUT_FACTOR, f"sequence {b}"
        )
        torch.testing.assert_close(
            lse[rows].transpose(0, 1)[None].double(), ref_lse, rtol=1e-5, atol=1e-5
        )
    return out


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("mode", ["decode", "chunked_prefill"])
def test_paged_attention_matches_reference(heads, block_size, mode):
    # Lengths include 1, exact multiples of the block size and ragged ones.
    lengths = [1, 16, 33, 256, 300]
    queries = [1] * 5 if mode == "decode" else [1, 16, 7, 100, 64]
    check_against_reference(lengths, queries, *heads, 64, block_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_paged_attention_dtypes(dtype):
    check_against_reference([5, 70, 129], [5, 1, 30], 4, 2, 40, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [36, 40, 48, 96, 128])
def test_every_row_count_of_the_direct_path(dtype, head_dim):
    # Chunks of 1..9 queries of one head each: tiles of 1 to 8 rows read K/V straight from
    # the cache (one kernel per row count; on AVX2 the value pass weights fp32 rows past 4 as
    # a second group), 9 rows go through gathered tiles. Head dim 36 ends in a part vector on
    # every ISA; a bf16 cache is widened two vectors at a time (16 elements on AVX2, 32 on
    # AVX-512) where whole groups of that many remain, and head dim 48 ends in an O slice that
    # holds one whole group and a part (AVX2: 32 elements for 1 or 2 rows; AVX-512: 64). With
    # AVX512-BF16 a bf16 cache's whole O slices take bf16 pairs and the rest fp32 weights:
    # head dim 96 is one slice of 64 and 32 columns over for up to 6 rows.
    queries = list(range(1, 10))
    check_against_reference([q + 70 for q in queries], queries, 2, 2, head_dim, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_context_split_across_threads(dtype):
    # One sequence and one kv head leave threads idle: the keys are split and merged by lse.
    check_against_reference([3000], [1], 4, 1, 64, 16, dtype)
    check_against_reference([2500, 7], [3, 1], 8, 1, 128, 32, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(10, 5), (5, 5)], ids=["gqa", "mha"])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_decode_tasks_of_several_kv_heads(dtype, heads, threads):
    # Decode tasks take a sequence's kv heads together, head by head within each key tile,
    # divided among tasks as the thread count asks (blocking.h: plan_paged_tasks). One
    # sequence of 200 keys: 1 thread -> heads as 3 + 2, 2 threads -> 2 + 2 + 1, 3 -> one
    # each. Two of 700 and 90 keys: 1 thread -> all 5 together, 2 -> all 5 in each of two key
    # splits, 4 -> 3 + 2 in each split.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_against_reference([200], [1], *heads, 64, 16, dtype)
        check_against_reference([700, 90], [1, 1], *heads, 64, 16, dtype)
    finally:
        torch.set_num_threads(previous)


def test_shuffled_block_table_is_bitwise_identical():
    args = ([40, 129, 7], [1, 9, 7], 8, 2, 64, 16)
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(*args, shuffle=False)
    q2, k_cache2, v_cache2, tables2, _, _, _, _ = build_paged(*args, shuffle=True)
    assert not torch.equal(tables, tables2) and torch.equal(q, q2)
    first = mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu)
    second = mha_ext.paged_attention(q2, k_cache2, v_cache2, tables2, seq_lens, cu)
    assert torch.equal(first, second)


def test_nhd_cache_layout():
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([20, 50], [1, 4], 4, 2, 32, 8)
    k_nhd = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    v_nhd = v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_nhd.is_contiguous()
    torch.testing.assert_close(
        mha_ext.paged_attention(q, k_nhd, v_nhd, tables, seq_lens, cu),
        mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu),
        rtol=0,
        atol=0,
    )


def test_paged_attention_argument_errors(host_index_checks):
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([20, 50], [1, 4], 4, 2, 32, 8)
    attend = mha_ext.paged_attention
    with pytest.raises(
        RuntimeError, match=r"the cache has 2 kv heads, which does not divide q's 3 heads"
    ):
        attend(q[:, :3], k_cache, v_cache, tables, seq_lens, cu)
    with pytest.raises(RuntimeError, match=r"q has head_dim 16 but k_cache has 32"):
        attend(q[..., :16].contiguous(), k_cache, v_cache, tables, seq_lens, cu)
    with pytest.raises(
        RuntimeError, match=r"q has dtype torch.bfloat16 but k_cache has torch.float32"
    ):
        attend(q.bfloat16(), k_cache, v_cache, tables, seq_lens, cu)
    with pytest.raises(RuntimeError, match=r"block_tables must be torch.int32, got torch.int64"):
        attend(q, k_cache, v_cache, tables.long(), seq_lens, cu)
    with pytest.raises(RuntimeError, match=r"seq_lens must have shape \[2\]"):
        attend(q, k_cache, v_cache, tables, seq_lens[:1], cu)
    bad_tables = tables.clone()
    bad_tables[1, 2] = 999
    with pytest.raises(
        RuntimeError, match=r"block_tables\[1, 2\] = 999 is outside the cache's \d+ blocks"
    ):
        attend(q, k_cache, v_cache, bad_tables, seq_lens, cu)
    with pytest.raises(
        RuntimeError,
        match=r"seq_lens\[1\] = 80 exceeds what a block table row holds: 7 blocks x 8 = 56",
    ):
        attend(q, k_cache, v_cache, tables, torch.tensor([20, 80], dtype=torch.int32), cu)
    with pytest.raises(
        RuntimeError,
        match=r"cu_seqlens_q must not decrease, got cu_seqlens_q\[0\] = 0 > cu_seqlens_q\[1\] = -1",
    ):
        attend(q, k_cache, v_cache, tables, seq_lens, torch.tensor([0, -1, 5], dtype=torch.int32))
    with pytest.raises(
        RuntimeError, match=r"cu_seqlens_q must start at 0 and end at total_q = 5, got 0 and 4"
    ):
        attend(q, k_cache, v_cache, tables, seq_lens, torch.tensor([0, 1, 4], dtype=torch.int32))
    with pytest.raises(
        RuntimeError,
        match=r"sequence 0 has 3 queries \(cu_seqlens_q\[1\] - cu_seqlens_q\[0\] = 3 - 0\) "
        r"but seq_lens\[0\] = 2",
    ):
        attend(
            q,
            k_cache,
            v_cache,
            tables,
            torch.tensor([2, 50], dtype=torch.int32),
            torch.tensor([0, 3, 5], dtype=torch.int32),
        )


# ---------------------------------------------------------------- window, softcap, ALiBi, sinks


def feature_arguments(feature, heads, batch):
    """paged_attention's keyword arguments for one feature (or "all" of them), in fp32: the
    kernels take slopes and sinks in the accumulation dtype, functional converts them."""
    generator = seeded_generator(11)
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)  # ALiBi's geometric slopes
    arguments = {
        "window": dict(window=(37, 0)),
        "softcap": dict(softcap=1.5),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_per_sequence": dict(
            alibi_slopes=torch.rand(batch, heads, generator=generator) * 0.3
        ),
        "sinks": dict(sinks=torch.randn(heads, generator=generator) * 2.0),
    }
    if feature == "all":
        return dict(window=(53, None), softcap=1.5, alibi_slopes=slopes, sinks=2.0 + slopes)
    return arguments[feature]


def as_layout(cache, layout):
    """The same cache as a (num_blocks, block_size, kv_heads, dim) tensor viewed as HND."""
    return cache if layout == "HND" else cache.transpose(1, 2).contiguous().transpose(1, 2)


def window_start(seq_len, num_queries, window):
    """The first key a sequence's first query sees."""
    left = window[0] if window is not None else None
    return 0 if left in (None, -1) else max(0, seq_len - num_queries - left)


def check_features_against_reference(
    lengths,
    queries,
    heads,
    kv_heads,
    head_dim,
    block_size,
    dtype,
    arguments,
    layout="HND",
    poison_outside_window=False,
):
    """paged_attention with `arguments` against the float64 paged reference, by the accuracy
    rule. poison_outside_window: NaN in every cached row before each sequence's window, which
    neither the kernel nor the reference may read."""
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(
        lengths, queries, heads, kv_heads, head_dim, block_size, dtype
    )
    if poison_outside_window:
        for b, n in enumerate(lengths):
            outside = torch.arange(window_start(n, queries[b], arguments.get("window")))
            slots = mha_ext.slot_mapping_for(tables[b], outside, block_size)
            k_cache[slots // block_size, :, slots % block_size] = float("nan")
            v_cache[slots // block_size, :, slots % block_size] = float("nan")
    k_cache, v_cache = as_layout(k_cache, layout), as_layout(v_cache, layout)
    index = (tables, seq_lens, cu)
    out, lse = mha_ext.paged_attention(q, k_cache, v_cache, *index, return_lse=True, **arguments)
    ref, ref_lse = paged_attention_reference(q.double(), k_cache, v_cache, *index, **arguments)
    plain, _ = paged_attention_reference(q, k_cache, v_cache, *index, **arguments)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_within_rule(out, ref, plain, OUTPUT_FACTOR, f"{sorted(arguments)} output")
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    return out, lse


FEATURES = ["window", "softcap", "alibi", "alibi_per_sequence", "sinks", "all"]
PAGED_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", PAGED_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mode", ["decode", "chunked_prefill"])
@pytest.mark.parametrize("feature", FEATURES)
def test_score_features_match_reference(feature, mode, layout, dtype):
    # GQA 8/2: a decode tile is a kv head's 4 query heads (the direct path), a prefill chunk
    # of 17 or 70 queries goes through gathered tiles. Windows of 37 and 53 keys start inside
    # tiles and blocks, and the 300-token sequence's first key tiles lie wholly before them.
    lengths = [1, 40, 300]
    queries = [1, 1, 1] if mode == "decode" else [1, 17, 70]
    arguments = feature_arguments(feature, 8, len(lengths))
    check_features_against_reference(lengths, queries, 8, 2, 64, 16, dtype, arguments, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("heads", [(8, 1), (8, 8)], ids=["mqa", "mha"])
def test_every_direct_row_count_with_all_features(dtype, heads):
    # Chunks of 1..9 queries of one kv head's heads: every direct-path kernel and the
    # gathered one, each with the window, softcap, ALiBi and sinks together.
    queries = list(range(1, 10))
    lengths = [q + 90 for q in queries]
    arguments = feature_arguments("all", heads[0], len(lengths))
    check_features_against_reference(lengths, queries, *heads, 40, 16, dtype, arguments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("feature", ["window", "sinks", "all"])
def test_key_splits_with_features(feature, layout, dtype):
    # At 4 threads one sequence's tasks leave threads idle, so its keys split (blocking.h:
    # plan_paged_tasks): decode of 3000 tokens with a 1500-key window, 5 splits of the 1501
    # keys it sees; a 40-query chunk over 2500 tokens, 4 splits. The sink joins each row once,
    # in the merge of the splits.
    arguments = feature_arguments(feature, 8, 1)
    if "window" in arguments:
        arguments["window"] = (1500, 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        check_features_against_reference([3000], [1], 8, 1, 64, 16, dtype, arguments, layout)
        check_features_against_reference([2500], [40], 8, 2, 64, 16, dtype, arguments, layout)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("mode", ["decode", "chunked_prefill"])
def test_window_skips_the_blocks_before_it(mode, threads):
    # Every cached row before each sequence's window holds NaN: a kernel that read one of
    # them (and masked its score) would still carry the NaN into the output through P V.
    lengths = [2000, 700, 90]
    queries = [1, 1, 1] if mode == "decode" else [30, 5, 90]
    arguments = dict(window=(300, 0), sinks=torch.linspace(-1.0, 1.0, 8))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_features_against_reference(
            lengths, queries, 8, 2, 64, 16, torch.float32, arguments, poison_outside_window=True
        )
    finally:
        torch.set_num_threads(previous)


def test_window_wider_than_the_context_changes_nothing():
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([20, 50], [1, 4], 4, 2, 32, 8)
    plain = mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, return_lse=True)
    for window in [(10_000, 0), (None, 0), (-1, -1), (49, None)]:
        windowed = mha_ext.paged_attention(
            q, k_cache, v_cache, tables, seq_lens, cu, return_lse=True, window=window
        )
        assert all(torch.equal(a, b) for a, b in zip(windowed, plain)), window


def test_sinks_of_minus_infinity_change_nothing_and_large_ones_take_all_weight():
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([20, 50], [1, 4], 4, 2, 32, 8)
    index = (tables, seq_lens, cu)
    out, lse = mha_ext.paged_attention(q, k_cache, v_cache, *index, return_lse=True)
    none = torch.full((4,), float("-inf"))
    out_none, lse_none = mha_ext.paged_attention(
        q, k_cache, v_cache, *index, return_lse=True, sinks=none
    )
    torch.testing.assert_close(out_none, out, rtol=0, atol=0)
    torch.testing.assert_close(lse_none, lse, rtol=0, atol=0)
    huge = torch.full((4,), 200.0)  # e^200 outweighs every score: the output goes to 0
    out_huge, lse_huge = mha_ext.paged_attention(
        q, k_cache, v_cache, *index, return_lse=True, sinks=huge
    )
    assert out_huge.abs().max() < 1e-30 and torch.allclose(lse_huge, torch.full_like(lse, 200.0))


def test_paged_feature_argument_errors():
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([20, 50], [1, 4], 4, 2, 32, 8)
    args = (q, k_cache, v_cache, tables, seq_lens, cu)
    attend, op = mha_ext.paged_attention, torch.ops.mha_ext.paged_attention
    for softcap, shown in ((-1.0, "-1"), (float("inf"), "inf"), (float("nan"), "nan")):
        with pytest.raises(
            RuntimeError,
            match=rf"paged_attention: softcap must be finite and >= 0 \(0 = no softcap\), "
            rf"got {shown}",
        ):
            attend(*args, softcap=softcap)
    with pytest.raises(
        RuntimeError, match=r"window_left must be -1 \(unbounded\) or >= 0, got window_left -2"
    ):
        op(*args, 0.2, -2)
    for window in [(-2, 0), (8, 3), (8,), 8, (8.0, 0)]:
        with pytest.raises(ValueError, match=r"paged_attention: window must be a pair"):
            attend(*args, window=window)
    with pytest.raises(
        RuntimeError,
        match=r"alibi_slopes must have shape \[4\] \(heads\) or \[2, 4\] \(batch, heads\), "
        r"got \[3\]",
    ):
        attend(*args, alibi_slopes=torch.ones(3))
    with pytest.raises(
        RuntimeError,
        match=r"alibi_slopes must be a torch.float32 tensor on \S+ for torch.float32 q, got "
        r"torch.float64 on \S+",
    ):
        op(*args, 0.2, -1, 0.0, torch.ones(4, dtype=torch.float64))
    with pytest.raises(
        RuntimeError, match=r"alibi_slopes must be contiguous along the heads, got strides"
    ):
        op(*args, 0.2, -1, 0.0, torch.ones(4, 2)[:, 0])
    with pytest.raises(RuntimeError, match=r"sinks must have shape \[4\] \(heads\), got \[2, 4\]"):
        attend(*args, sinks=torch.zeros(2, 4))
    with pytest.raises(
        RuntimeError,
        match=r"sinks must be a torch.float32 tensor on \S+ for torch.float32 q, got "
        r"torch.bfloat16 on \S+",
    ):
        op(*args, 0.2, -1, 0.0, None, torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"paged_attention: sinks must be a floating-point tensor"):
        attend(*args, sinks=torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------- merging states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_merging_two_key_sets_equals_attention_over_both(dtype):
    generator = seeded_generator(2)
    q, k, v = (torch.randn(2, 4, 9, 32, generator=generator).to(dtype) for _ in range(3))
    k2, v2 = (torch.randn(2, 4, 13, 32, generator=generator).to(dtype) for _ in range(2))
    out_a, lse_a = mha_ext.attention(q, k, v, return_lse=True)
    out_b, lse_b = mha_ext.attention(q, k2, v2, return_lse=True)
    merged, lse = mha_ext.merge_attention_states(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = mha_ext.attention(
        q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), return_lse=True
    )
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(merged, whole, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_merging_with_an_empty_state_is_exact():
    out = torch.randn(3, 5, 16)
    lse = torch.randn(3, 5)
    garbage = torch.full_like(out, float("nan"))
    empty = torch.full_like(lse, float("-inf"))
    merged, merged_lse = mha_ext.merge_attention_states(out, lse, garbage, empty)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    merged, merged_lse = mha_ext.merge_attention_states(garbage, empty, out, lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    both, both_lse = mha_ext.merge_attention_states(garbage, empty, garbage, empty)
    assert (both == 0).all() and (both_lse == float("-inf")).all()


def test_merge_gradcheck_and_errors():
    generator = seeded_generator(4)
    inputs = [
        torch.randn(2, 3, 5, generator=generator, dtype=torch.float64).requires_grad_(),
        torch.randn(2, 3, generator=generator, dtype=torch.float64).requires_grad_(),
        torch.randn(2, 3, 5, generator=generator, dtype=torch.float64).requires_grad_(),
        torch.randn(2, 3, generator=generator, dtype=torch.float64).requires_grad_(),
    ]
    assert torch.autograd.gradcheck(mha_ext.merge_attention_states, inputs)
    out, lse = torch.randn(3, 5, 16), torch.randn(3, 5)
    with pytest.raises(
        RuntimeError,
        match=r"out_a and out_b must have one shape \(..., head_dim\), got \[3, 5, 16\] and "
        r"\[3, 5, 8\]",
    ):
        mha_ext.merge_attention_states(out, lse, out[..., :8], lse)
    with pytest.raises(
        RuntimeError,
        match=r"lse_b must be a torch.float32 tensor of shape \[3, 5\] on \S+, got "
        r"torch.float64 of shape \[3, 5\]",
    ):
        mha_ext.merge_attention_states(out, lse, out, lse.double())


def test_paged_ops_opcheck():
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(
        [20, 50], [1, 4], 4, 2, 32, 8, seed=3
    )
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    torch.library.opcheck(
        torch.ops.mha_ext.paged_attention.default, (q, k_cache, v_cache, tables, seq_lens, cu, 0.2)
    )
    features = (8, 1.5, torch.rand(2, 4), torch.randn(4))  # window_left, softcap, slopes, sinks
    torch.library.opcheck(
        torch.ops.mha_ext.paged_attention.default,
        (q, k_cache, v_cache, tables, seq_lens, cu, 0.2, *features),
    )
    torch.library.opcheck(
        torch.ops.mha_ext.paged_kv_append.default,
        (torch.randn(3, 2, 32), torch.randn(3, 2, 32), k_cache, v_cache, torch.tensor([0, -1, 9])),
    )
    out, lse = torch.randn(4, 2, 16), torch.randn(4, 2)
    torch.library.opcheck(
        torch.ops.mha_ext.merge_attention_states.default,
        (out, lse, torch.randn(4, 2, 16), torch.randn(4, 2)),
    )


# ---------------------------------------------------------------- allocator


def test_allocator_extends_frees_and_reuses_blocks():
    cache = mha_ext.PagedKVCache(1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    a, b = cache.allocate(), cache.allocate()
    batch = cache.prepare([a, b], [6, 1])
    assert cache.block_table(a) == [0, 1] and cache.block_table(b) == [2]
    assert batch.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert batch.seq_lens.tolist() == [6, 1] and batch.cu_seqlens_q.tolist() == [0, 6, 7]
    batch = cache.prepare([a], [3])  # fills block 1, then one new block
    assert batch.slot_mapping.tolist() == [6, 7, 12] and cache.seq_len(a) == 9
    cache.free(a)
    assert cache.num_free_blocks == 7
    c = cache.allocate()
    cache.prepare([c], [1])
    assert cache.block_table(c) == [3]


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    cache = mha_ext.PagedKVCache(2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2)
    parent = cache.allocate()
    batch = cache.prepare([parent], [6])  # blocks [0, 1], block 1 half full
    for layer in range(2):
        k = torch.arange(12.0).view(6, 1, 2) + 100 * layer
        mha_ext.paged_kv_append(
            k, -k, cache.key_caches[layer], cache.value_caches[layer], batch.slot_mapping
        )
    child = cache.fork(parent)
    assert cache.block_table(child) == [0, 1] and cache.num_free_blocks == 6
    batch = cache.prepare([child], [1])  # block 1 is shared and partial: copy before writing
    private = cache.block_table(child)[1]
    assert cache.block_table(child)[0] == 0 and private not in (0, 1)
    assert cache.block_table(parent) == [0, 1]
    assert batch.slot_mapping.tolist() == [private * 4 + 2]
    for layer in range(2):
        assert torch.equal(
            cache.key_caches[layer][private, :, :2], cache.key_caches[layer][1, :, :2]
        )
        assert torch.equal(
            cache.value_caches[layer][private, :, :2], cache.value_caches[layer][1, :, :2]
        )
    cache.free(parent)  # block 0 stays: the child still holds it
    assert cache.num_free_blocks == 6
    cache.free(child)
    assert cache.num_free_blocks == 8


def test_exhaustion_raises_before_anything_changes():
    cache = mha_ext.PagedKVCache(1, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=2)
    a, b = cache.allocate(), cache.allocate()
    cache.prepare([a], [5])
    with pytest.raises(
        RuntimeError, match=r"out of blocks: this step needs 2 new blocks but only 1 of 3 are free"
    ):
        cache.prepare([a, b], [1, 5])
    assert cache.seq_len(a) == 5 and cache.seq_len(b) == 0 and cache.num_free_blocks == 1
    assert cache.block_table(a) == [0, 1] and cache.block_table(b) == []
    with pytest.raises(KeyError, match=r"unknown sequence 7"):
        cache.prepare([7], [1])
    with pytest.raises(ValueError, match=r"layout must be 'HND' or 'NHD', got 'HDN'"):
        mha_ext.PagedKVCache(1, 3, 4, 1, 2, layout="HDN")


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked of Linux only")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_large_cpu_caches_live_on_huge_page_boundaries(layout):
    # 64 blocks x 2 heads x 16 tokens x 256 x 4 bytes = 2 MiB per cache: the huge-page path.
    cache = mha_ext.PagedKVCache(
        2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=256, layout=layout
    )
    small = mha_ext.PagedKVCache(
        1, num_blocks=2, block_size=16, num_kv_heads=2, head_dim=256, huge_pages=False
    )
    for tensor in cache.key_caches + cache.value_caches:
        assert tensor.shape == (64, 2, 16, 256) and tensor.dtype == torch.float32
        assert tensor.data_ptr() % (2 << 20) == 0
        assert torch.count_nonzero(tensor) == 0
    pointers = {t.data_ptr() for t in cache.key_caches + cache.value_caches}
    assert len(pointers) == 4  # one mapping per cache, none shared
    assert (
        small.key_caches[0].untyped_storage().nbytes() == 2 * 2 * 16 * 256 * 4
    )  # plain allocation

    # The tensors keep their mappings alive after the cache object is gone, and stay usable.
    keys = cache.key_caches[1]
    del cache
    gc.collect()
    slots = torch.tensor([0, 17, 1023], dtype=torch.int64)
    new_keys = torch.randn(3, 2, 256)
    mha_ext.paged_kv_append(new_keys, new_keys, keys, keys.clone(), slots)
    assert torch.equal(keys[0, :, 0], new_keys[0]) and torch.equal(keys[1, :, 1], new_keys[1])
    assert torch.equal(keys[63, :, 15], new_keys[2])
    assert torch.count_nonzero(keys) == 3 * 2 * 256


# ---------------------------------------------------------------- module and generation


def test_module_paged_forward_matches_full_attention():
    torch.manual_seed(0)
    layer = mha_ext.MultiHeadAttention(64, 8, dropout=0.0, num_kv_heads=2).eval()
    cache = mha_ext.PagedKVCache(
        1, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, layout="NHD"
    )
    x = [torch.randn(11, 64), torch.randn(5, 64)]
    seqs = [cache.allocate(), cache.allocate()]
    # Chunked prefill: 7 + 3 tokens, then 4 + 2 more, then one decode step each.
    outputs = [[], []]
    for chunk in ([7, 3], [4, 1], [0, 1]):
        starts = [cache.seq_len(s) for s in seqs]
        batch = cache.prepare(seqs, chunk)
        packed = torch.cat([x[i][starts[i] : starts[i] + chunk[i]] for i in range(2)])
        out = layer.forward_paged(packed, cache, 0, batch)
        for i, piece in enumerate(out.split(chunk)):
            outputs[i].append(piece)
    for i in range(2):
        length = cache.seq_len(seqs[i])
        full = layer(x[i][None, :length], x[i][None, :length], x[i][None, :length], is_causal=True)[
            0
        ]
        torch.testing.assert_close(torch.cat(outputs[i]), full, rtol=1e-5, atol=1e-5)


def test_generation_equals_recomputing_full_attention():
    torch.manual_seed(0)
    model = CausalLM(vocab_size=40, context=48).eval()
    prompts = [[1, 2, 3], [7], list(range(10, 26)), [5] * 8]
    generated = model.generate(prompts, max_new_tokens=12, block_size=4)
    for prompt, new_tokens in zip(prompts, generated):
        tokens = list(prompt)
        for _ in range(12):
            with torch.no_grad():
                tokens.append(model(torch.tensor([tokens]))[0, -1].argmax().item())
        assert new_tokens == tokens[len(prompt) :]

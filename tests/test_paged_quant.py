"""8-bit paged KV caches (int8 with per-row scales, float8_e4m3fn with per-tensor scales):
exact quantizing appends, paged attention over the values the cache holds, bad input."""

import os

import pytest
import torch

import mha_ext
from mha_ext.reference import (
    dequantize_cache,
    paged_attention_reference,
    quantize_float8,
    quantize_int8,
)

from conftest import (
    OUTPUT_FACTOR,
    assert_tests_pass_under_isa,
    assert_within_rule,
    run_python_under_isa,
    seeded_generator,
    skip_unless_isa_rerun_adds,
)
from test_paged import feature_arguments

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# fp8's per-tensor scales: not 1, so that a kernel that ignores one is caught.
FP8_SCALES = {"k_scale": 0.5, "v_scale": 2.0}


def new_cache(fmt, num_blocks, kv_heads, block_size, head_dim, layout="HND"):
    """(k_cache, v_cache, scale arguments) of an 8-bit cache poisoned everywhere: int8 rows
    of 127 with NaN scales, fp8 rows of 448 (its largest value; the kernels read the NaN
    encoding as 480, so a finite poison is what shows a stray read as well)."""
    dtype = FORMATS[fmt]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    poison = 127 if fmt == "int8" else 448.0

    def make(row_shape, dtype, fill):
        storage_shape = (num_blocks, block_size, kv_heads, *row_shape)
        if layout == "HND":
            return torch.full((num_blocks, kv_heads, block_size, *row_shape), fill, dtype=dtype)
        return torch.full(storage_shape, fill, dtype=dtype).transpose(1, 2)

    k_cache, v_cache = make(shape[3:], dtype, poison), make(shape[3:], dtype, poison)
    if fmt == "int8":
        scales = {
            "k_scales": make((), torch.float32, float("nan")),
            "v_scales": make((), torch.float32, float("nan")),
        }
    else:
        scales = dict(FP8_SCALES)
    return k_cache, v_cache, scales


def dequantized(cache, scales, which, dtype=torch.float64):
    return dequantize_cache(
        cache, scales.get(f"{which}_scales"), scales.get(f"{which}_scale", 1.0), dtype
    )


def bits(t):
    """A tensor's bytes, so that NaNs compare equal."""
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


# ---------------------------------------------------------------- append


def expected_rows(fmt, rows, scales, which):
    """(stored rows, their int8 scales or None) that appending `rows` must write."""
    if fmt == "int8":
        return quantize_int8(rows)
    return quantize_float8(rows, scales[f"{which}_scale"]), None


def expected_after_append(fmt, caches, scales, key, value, slots, block_size):
    """What appending key and value (tokens, kv_heads, dim) at slots must leave: ({"k", "v"}:
    copies of the caches with each token's rows at its slot, copied for fmt "plain" and
    quantized by expected_rows otherwise, -1 slots skipped; {"k", "v"}: likewise the int8
    scales, None for the other formats)."""
    expected = {which: cache.clone() for which, cache in zip("kv", caches)}
    expected_scales = {w: scales[f"{w}_scales"].clone() if fmt == "int8" else None for w in "kv"}
    for which, rows in (("k", key), ("v", value)):
        stored, row_scales = (
            (rows, None) if fmt == "plain" else expected_rows(fmt, rows, scales, which)
        )
        for token, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            block, offset = slot // block_size, slot % block_size
            expected[which][block, :, offset] = stored[token]
            if row_scales is not None:
                expected_scales[which][block, :, offset] = row_scales[token]
    return expected, expected_scales


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_writes_exactly_the_quantized_rows(fmt, dtype, block_size, layout):
    num_blocks, kv_heads, head_dim = 5, 2, 40
    k_cache, v_cache, scales = new_cache(fmt, num_blocks, kv_heads, block_size, head_dim, layout)
    capacity = num_blocks * block_size
    slots = torch.tensor([3, -1, capacity - 1, 0, -1, 2], dtype=torch.int64) % (capacity + 1)
    slots = torch.where(slots >= capacity, -1, slots)
    generator = seeded_generator(1)
    key = (torch.randn(len(slots), kv_heads, head_dim, generator=generator) * 3).to(dtype)
    value = (torch.randn(len(slots), kv_heads, head_dim, generator=generator) * 300).to(dtype)
    key[0, 0] = 0.0  # an all-zero row: scale 0
    # Ties of int8's rounding (scale 1: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2) and of e4m3's (1.0625
    # lies halfway between 1 and 1.125, 1.1875 between 1.125 and 1.25), fp8 subnormals.
    key[3, 1, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 1.0625, 1.1875])
    key[3, 1, 6:9] = torch.tensor([2.0**-8, -(2.0**-9), 3 * 2.0**-10])
    expected, expected_scales = expected_after_append(
        fmt, (k_cache, v_cache), scales, key, value, slots, block_size
    )
    mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots, **scales)
    assert torch.equal(bits(k_cache), bits(expected["k"]))
    assert torch.equal(bits(v_cache), bits(expected["v"]))
    if fmt == "int8":
        assert torch.equal(bits(scales["k_scales"]), bits(expected_scales["k"]))
        assert torch.equal(bits(scales["v_scales"]), bits(expected_scales["v"]))
        assert scales["k_scales"][3 // block_size, 0, 3 % block_size] == 0  # the zero row


@pytest.mark.cpu_only
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "tokens, kv_heads", [(48, 12), (1, 132)], ids=["tokens_and_heads", "one_token"]
)
@pytest.mark.parametrize("fmt", ["plain", *FORMATS])
def test_append_large_enough_to_split(fmt, tokens, kv_heads, threads):
    # Appends large enough to run on several threads (the 8-bit ones of one token too), split by
    # tokens and by groups of kv heads (12: a group of 8 and one of 4 on AVX-512; 132: 16 and a
    # half), padding tokens among them: every row lands where the reference puts it, whatever
    # the thread count.
    num_blocks, block_size, head_dim = 16, 4, 128
    if fmt == "plain":
        k_cache, v_cache = (
            torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan")).bfloat16()
            for _ in "kv"
        )
        scales = {}
    else:
        k_cache, v_cache, scales = new_cache(fmt, num_blocks, kv_heads, block_size, head_dim)
    generator = seeded_generator(7)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[1::5] = -1
    key, value = (
        torch.randn(tokens, kv_heads, head_dim, generator=generator).bfloat16() * 10.0 ** (i - 1)
        for i in range(2)
    )
    expected, expected_scales = expected_after_append(
        fmt, (k_cache, v_cache), scales, key, value, slots, block_size
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots, **scales)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(bits(k_cache), bits(expected["k"]))
    assert torch.equal(bits(v_cache), bits(expected["v"]))
    for which, expected_scale in expected_scales.items():
        if expected_scale is not None:
            assert torch.equal(bits(scales[f"{which}_scales"]), bits(expected_scale)), which


def test_reference_quantizers_round_half_to_even_and_saturate():
    stored, scale = quantize_int8(torch.tensor([[127.0, 0.5, 1.5, -2.5, 2.5]]))
    assert scale.item() == 1.0 and stored.tolist() == [[127, 0, 2, -2, 2]]
    fp8 = quantize_float8(torch.tensor([1.0625, 1.1875, 1000.0, -1000.0]), 1.0)
    assert fp8.float().tolist() == [1.0, 1.25, 448.0, -448.0]


def append_case(fmt):
    k_cache, v_cache, scales = new_cache(fmt, 4, 2, 4, 8)
    if fmt == "int8":  # written scales, so that "unchanged" covers them
        scales["k_scales"].copy_(torch.rand(4, 2, 4))
        scales["v_scales"].copy_(torch.rand(4, 2, 4))
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    return key, value, k_cache, v_cache, torch.tensor([0, 1, 2]), scales


def bad_append_inputs(fmt):
    """(what is wrong, argument changes, the error it must raise)."""
    if fmt == "int8":
        return [
            ("no scales", dict(k_scales=None), r"an int8 k_cache needs k_scales, its fp32 scales"),
            (
                "scale shape",
                dict(v_scales=torch.zeros(4, 2, 5)),
                r"v_scales must have shape \[num_blocks, num_kv_heads, block_size\] = \[4, 2, 4\]"
                r" \(v_cache's\), got \[4, 2, 5\]",
            ),
            (
                "scale dtype",
                dict(k_scales=torch.zeros(4, 2, 4, dtype=torch.float64)),
                r"k_scales must be torch.float32, got torch.float64",
            ),
            (
                "per-tensor scale",
                dict(k_scale=2.0),
                r"k_scale must be 1.0 for an int8 k_cache \(its scales are per row",
            ),
            ("bad slot", dict(slot_mapping=torch.tensor([0, 16, 1])), r"slot_mapping\[1\] = 16"),
            (
                "fp64 rows",
                dict(key=torch.randn(3, 2, 8, dtype=torch.float64)),
                r"a torch.int8 cache takes key in torch.float32, torch.bfloat16 or torch.float16,"
                r" got torch.float64",
            ),
        ]
    return [
        ("zero scale", dict(k_scale=0.0), r"k_scale must be finite and > 0 for a "),
        ("negative", dict(v_scale=-1.0), r"v_scale must be finite and > 0 .* got -1"),
        ("NaN", dict(k_scale=float("nan")), r"k_scale must be finite and > 0 .* got nan"),
        ("inf", dict(v_scale=float("inf")), r"v_scale must be finite and > 0 .* got inf"),
        ("too small for fp32", dict(k_scale=1e-60), r"k_scale = 1e-60 is outside fp32's range"),
        (
            "scale tensor",
            dict(k_scales=torch.ones(4, 2, 4)),
            r"k_scales is only for int8 caches, but k_cache is torch.float8_e4m3fn",
        ),
        ("bad slot", dict(slot_mapping=torch.tensor([0, -3, 1])), r"slot_mapping\[1\] = -3"),
        (
            "mixed rows",
            dict(value=torch.randn(3, 2, 8).bfloat16()),
            r"value has dtype torch.bfloat16 but key has torch.float32",
        ),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_append_raises_and_changes_nothing(fmt, host_index_checks):
    for what, changes, message in bad_append_inputs(fmt):
        key, value, k_cache, v_cache, slots, scales = append_case(fmt)
        arguments = dict(key=key, value=value, slot_mapping=slots, **scales)
        arguments.update(changes)
        before = [bits(t).clone() for t in (k_cache, v_cache, *scales_of(scales))]
        with pytest.raises(RuntimeError, match=message):
            mha_ext.paged_kv_append(
                arguments.pop("key"),
                arguments.pop("value"),
                k_cache,
                v_cache,
                arguments.pop("slot_mapping"),
                **arguments,
            )
        after = [bits(t) for t in (k_cache, v_cache, *scales_of(scales))]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), what


def scales_of(scales):
    return [t for t in scales.values() if isinstance(t, torch.Tensor)]


def test_plain_caches_refuse_scales():
    k_cache, v_cache = torch.zeros(4, 2, 4, 8), torch.zeros(4, 2, 4, 8)
    key, slots = torch.randn(3, 2, 8), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match=r"k_scales is only for int8 caches, but k_cache is"):
        mha_ext.paged_kv_append(key, key, k_cache, v_cache, slots, k_scales=torch.ones(4, 2, 4))
    with pytest.raises(RuntimeError, match=r"v_scale is only for float8_e4m3fn caches, but"):
        mha_ext.paged_kv_append(key, key, k_cache, v_cache, slots, v_scale=2.0)
    assert not k_cache.any() and not v_cache.any()


# ---------------------------------------------------------------- paged attention


def build_quantized(
    fmt, lengths, queries, heads, kv_heads, head_dim, block_size, dtype, layout="HND", seed=0
):
    """An 8-bit cache holding sequences of the given lengths at shuffled blocks (appended
    through the op), poisoned everywhere else (new_cache), and the packed queries."""
    generator = seeded_generator(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3  # three blocks nobody uses
    k_cache, v_cache, scales = new_cache(fmt, num_blocks, kv_heads, block_size, head_dim, layout)
    order = torch.randperm(num_blocks, generator=seeded_generator(seed + 1))
    tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        tables[b, : blocks_per_seq[b]] = order[used : used + blocks_per_seq[b]].int()
        used += blocks_per_seq[b]
        k = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        slots = mha_ext.slot_mapping_for(tables[b], torch.arange(n), block_size)
        mha_ext.paged_kv_append(k, v, k_cache, v_cache, slots, **scales)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(queries).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=generator).to(dtype)
    index = (tables, torch.tensor(lengths, dtype=torch.int32), cu)
    return q, k_cache, v_cache, index, scales


def scores_on_int16_queries(fmt, dtype):
    """Whether paged_attention scores q's rows rounded to 16-bit integers
    (PagedKernelTraits::kInt16Dots): a bf16 or fp16 q over an int8 cache at every x86 level
    but avx512 (AVX-512 without VNNI keeps fp32 FMAs)."""
    active = mha_ext.build_info()["cpu_isa"]
    return fmt == "int8" and dtype != torch.float32 and active not in ("generic", "avx512")


def int16_query_rows(q):
    """q's rows as kInt16Dots scores them: integers on a power-of-two step, the row's largest
    magnitude in [2^14, 2^15) steps, rounded half to even."""
    largest = q.double().abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(largest)
    step = torch.where(largest > 0, torch.ldexp(torch.ones_like(largest), exponent - 15), 1.0)
    return torch.round(q.double() / step) * step


def check_quantized_attention(
    fmt, lengths, queries, heads, kv_heads, head_dim, block_size, dtype, arguments, layout="HND"
):
    """paged_attention over the 8-bit cache against the float64 paged reference over the
    values the cache holds (dequantized), by the accuracy rule; the logsumexp within 1e-5 of
    the reference's over the q that the kernel scores (int16_query_rows where it rounds q)."""
    q, k_cache, v_cache, index, scales = build_quantized(
        fmt, lengths, queries, heads, kv_heads, head_dim, block_size, dtype, layout
    )
    out, lse = mha_ext.paged_attention(
        q, k_cache, v_cache, *index, return_lse=True, **arguments, **scales
    )
    k64, v64 = dequantized(k_cache, scales, "k"), dequantized(v_cache, scales, "v")
    ref, ref_lse = paged_attention_reference(q.double(), k64, v64, *index, **arguments)
    plain, _ = paged_attention_reference(q, k64.to(dtype), v64.to(dtype), *index, **arguments)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2]
    assert_within_rule(out, ref, plain, OUTPUT_FACTOR, f"{fmt} {sorted(arguments)} output")
    if scores_on_int16_queries(fmt, dtype):
        _, ref_lse = paged_attention_reference(int16_query_rows(q), k64, v64, *index, **arguments)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


QUERY_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mode", ["decode", "chunked_prefill"])
@pytest.mark.parametrize("feature", ["none", "window", "softcap", "alibi", "sinks", "all"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_matches_reference_with_features(fmt, feature, mode, layout):
    # GQA 8/2: a decode tile is a kv head's 4 query heads (the direct path), a prefill chunk
    # of 17 or 70 queries goes through gathered tiles; windows start inside tiles and blocks.
    lengths = [1, 40, 300]
    queries = [1, 1, 1] if mode == "decode" else [1, 17, 70]
    arguments = {} if feature == "none" else feature_arguments(feature, 8, len(lengths))
    dtype = QUERY_DTYPES[(len(feature) + len(mode)) % 3]  # each dtype meets every feature
    check_quantized_attention(fmt, lengths, queries, 8, 2, 64, 16, dtype, arguments, layout)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_block_sizes_and_groups(fmt, block_size, heads):
    lengths, queries = [1, 33, 130], [1, 9, 3]
    check_quantized_attention(fmt, lengths, queries, *heads, 48, block_size, torch.float32, {})


@pytest.mark.parametrize("head_dim", [40, 44, 100])
@pytest.mark.parametrize("dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_every_direct_row_count_and_odd_head_dim(fmt, dtype, head_dim):
    # Chunks of 1..9 queries of one kv head: each direct-path row count and the gathered
    # path, every score feature on, head dims with a ragged last vector: 40 on AVX-512 (and
    # AVX2's int16 scores, 16 elements a step), 44 on every ISA (and AVX2's int16 values, 8
    # columns a step, leave 4 columns over), 100 a whole 64 (the fp8 byte tables' group) and
    # 36 more.
    queries = list(range(1, 10))
    lengths = [q + 90 for q in queries]
    arguments = feature_arguments("all", 8, len(lengths))
    check_quantized_attention(fmt, lengths, queries, 8, 1, head_dim, 16, dtype, arguments)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_every_decode_group_at_model_head_dims(fmt, head_dim):
    # The head dims of real models (whole vectors, the direct path's unmasked steps), decode
    # tiles of 1 to 8 rows: the value pass's slices of 4 vectors (up to 6 rows) and of 2, and
    # for a bf16 q over an fp8 cache its bf16 pairs (up to 5 rows at once, more in two groups).
    for group in range(1, 9):
        for dtype in dict.fromkeys([QUERY_DTYPES[group % 3], torch.bfloat16]):
            check_quantized_attention(
                fmt, [5, 70, 130], [1, 1, 1], 2 * group, 2, head_dim, 16, dtype, {}
            )


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fp8_attention_reads_every_code(group, q_dtype):
    # Every e4m3 code but the two NaNs, subnormals and both zeros included, at many columns
    # of a head dim of 128: with one cached token per sequence, a row's output is that
    # token's value row times v_scale and its logsumexp the token's score, to fp32's rounding
    # (the softmax's weight of the one key is 1 to within an ulp), where a code read wrong is
    # off by an eighth of its value or more. A bf16 q takes the keys as bf16 units where the
    # CPU has AVX512-BF16 (kScoreFp8ByBf16Dots), an fp32 q as fp32 units.
    head_dim, sequences = 128, 64
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F]
    rows = torch.stack([codes.roll(-7 * s)[:head_dim] for s in range(sequences)])
    k_cache, v_cache, scales = new_cache("fp8", sequences, 1, 16, head_dim)
    k_cache.view(torch.uint8)[:, 0, 0] = rows.flip(-1).to(torch.uint8)
    v_cache.view(torch.uint8)[:, 0, 0] = rows.to(torch.uint8)
    tables = torch.arange(sequences, dtype=torch.int32).view(sequences, 1)
    lengths = torch.ones(sequences, dtype=torch.int32)
    cu = torch.arange(sequences + 1, dtype=torch.int32)
    q = torch.randn(sequences, group, head_dim, generator=seeded_generator(3)).to(q_dtype)
    out, lse = mha_ext.paged_attention(
        q, k_cache, v_cache, tables, lengths, cu, return_lse=True, **scales
    )
    k64, v64 = dequantized(k_cache, scales, "k"), dequantized(v_cache, scales, "v")
    ref, ref_lse = paged_attention_reference(q.double(), k64, v64, tables, lengths, cu)
    # the output rounds to q's dtype: half a unit of its precision
    rtol = 1e-6 if q_dtype == torch.float32 else torch.finfo(q_dtype).eps / 2
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=0)
    # The fp32 dot product's rounding, relative to its terms' magnitudes (the keys' codes
    # reach 448 x k_scale, and their terms cancel).
    terms = q.double() * k64[:, 0, 0].unsqueeze(1) / head_dim**0.5
    assert ((lse.double() - ref_lse).abs() <= 4e-6 * terms.abs().sum(-1)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_key_splits(fmt):
    # At 4 threads one sequence's tasks leave threads idle and its keys split; the sinks
    # join in the merge of the splits.
    arguments = feature_arguments("sinks", 8, 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        check_quantized_attention(fmt, [3000], [1], 8, 1, 64, 16, torch.float32, arguments)
        check_quantized_attention(fmt, [1200], [24], 8, 2, 64, 16, torch.bfloat16, arguments)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int8_attention_non_finite_and_tiny_inputs(dtype):
    # Where kInt16Dots rounds q's rows and P to integers, a NaN or infinity in a q row or a
    # value scale must still reach the output rows it reaches in float64, and rows too small
    # for a 16-bit step (below 2^-100) or all zero must still be scored (their scores are
    # exact, so the logsumexp check needs no rounded q).
    lengths, queries = [40, 300, 70], [1, 1, 1]
    q, k_cache, v_cache, index, scales = build_quantized(
        "int8", lengths, queries, 8, 2, 64, 16, dtype
    )
    tables = index[0]
    q[0, 1, 5] = float("nan")
    q[1, 2, 3] = float("inf")
    q[2, :2] = 0.0
    q[2, 2:4] = 1e-36 * torch.randn(2, 64, generator=seeded_generator(3)).to(dtype)
    scales["v_scales"][tables[1, 2], 1, 3] = float("nan")
    out, lse = mha_ext.paged_attention(q, k_cache, v_cache, *index, return_lse=True, **scales)
    k64, v64 = dequantized(k_cache, scales, "k"), dequantized(v_cache, scales, "v")
    ref, ref_lse = paged_attention_reference(q.double(), k64, v64, *index)
    finite = ref.isfinite().all(-1)  # (tokens, heads)
    assert torch.equal(out.isnan().any(-1), ~finite)
    assert finite.sum() == 24 - 1 - 1 - 4  # the two q rows and the NaN value's kv head
    plain, _ = paged_attention_reference(q, k64.to(dtype), v64.to(dtype), *index)
    assert_within_rule(out[finite], ref[finite], plain[finite], OUTPUT_FACTOR, "finite rows")
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int8_attention_largest_integer_sums(dtype):
    # Head dim 256, every q element at the top of its row's 16-bit range (1.99: about 32600
    # steps) and every code at +-127; kv head 0's keys and queries all positive, so that its
    # scores are kInt16Dots' largest int32 sums (256 x 32640 x 127, about 2^30).
    heads, kv_heads, head_dim = 8, 2, 256
    q, k_cache, v_cache, index, scales = build_quantized(
        "int8", [70, 130], [1, 1], heads, kv_heads, head_dim, 16, dtype
    )
    signs = torch.randn(q.shape, generator=seeded_generator(5)).sign()
    signs[:, : heads // kv_heads] = 1.0
    q = (1.99 * signs).to(dtype)
    k_cache.copy_(torch.where(k_cache >= 0, 127, -127).to(torch.int8))
    k_cache[:, 0] = 127
    v_cache.copy_(torch.where(v_cache >= 0, 127, -127).to(torch.int8))
    for name in ("k_scales", "v_scales"):
        scales[name][scales[name].isfinite()] = 0.01
    out, lse = mha_ext.paged_attention(q, k_cache, v_cache, *index, return_lse=True, **scales)
    k64, v64 = dequantized(k_cache, scales, "k"), dequantized(v_cache, scales, "v")
    ref, ref_lse = paged_attention_reference(q.double(), k64, v64, *index)
    plain, _ = paged_attention_reference(q, k64.to(dtype), v64.to(dtype), *index)
    assert_within_rule(out, ref, plain, OUTPUT_FACTOR, "output")
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_attention_argument_errors():
    q, k_cache, v_cache, index, scales = build_quantized(
        "int8", [20], [1], 4, 2, 32, 8, torch.float32
    )
    attend = mha_ext.paged_attention
    with pytest.raises(RuntimeError, match=r"an int8 v_cache needs v_scales"):
        attend(q, k_cache, v_cache, *index, k_scales=scales["k_scales"])
    with pytest.raises(RuntimeError, match=r"k_scales must have shape .* got \[3, 2, 8\]"):
        attend(q, k_cache, v_cache, *index, **{**scales, "k_scales": torch.ones(3, 2, 8)})
    with pytest.raises(RuntimeError, match=r"takes q in torch.float32, .* got torch.float64"):
        attend(q.double(), k_cache, v_cache, *index, **scales)
    fp8 = k_cache.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"v_scale must be finite and > 0 .* got 0"):
        attend(q, fp8, fp8, *index, v_scale=0.0)
    with pytest.raises(RuntimeError, match=r"k_cache has dtype torch.int8 but v_cache has"):
        attend(q, k_cache, fp8, *index, **scales)


def test_quantized_ops_opcheck():
    # The schemas' aliasing (k_scales / v_scales written by the append) and the fakes.
    q, k_cache, v_cache, index, scales = build_quantized(
        "int8", [20, 9], [1, 4], 4, 2, 32, 8, torch.float32
    )
    scales = {name: t.nan_to_num(0.0) for name, t in scales.items()}
    scale_args = (scales["k_scales"], scales["v_scales"])
    torch.library.opcheck(
        torch.ops.mha_ext.paged_attention.default,
        (q, k_cache, v_cache, *index, 0.2, -1, 0.0, None, None, *scale_args),
    )
    torch.library.opcheck(
        torch.ops.mha_ext.paged_kv_append.default,
        (torch.randn(3, 2, 32), torch.randn(3, 2, 32), k_cache, v_cache, torch.tensor([0, -1, 9]))
        + scale_args,
    )
    # (No float8_e4m3fn case: opcheck's schema check multiplies the tensors it compares,
    # which torch does not implement for float8_e4m3fn.)


# ---------------------------------------------------------------- forced ISAs

# Every direct-path row count and the gathered path, all features on, the decode groups at
# model head dims, the integer path's edges (int8_attention) and every fp8 code, under each
# ISA build.
FORCED_ISA_SELECTION = (
    "every_direct_row_count or every_decode_group or int8_attention or append_writes_exactly"
    " or fp8_attention_reads_every_code"
)


@pytest.mark.cpu_only
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512_bf16"])
def test_forced_isa_builds(isa):
    # avx512 runs the build of the levels above it, but scores a 16-bit q in fp32;
    # avx512_bf16 scores a bf16 q's fp8 keys by VDPBF16PS, which the AMX Xeons' avx512_amx
    # level leaves to the FMAs.
    skip_unless_isa_rerun_adds(isa, compare_builds=False)
    assert_tests_pass_under_isa(isa, ["test_paged_quant.py"], FORCED_ISA_SELECTION)


@pytest.mark.cpu_only
def test_paths_of_cpus_without_vbmi():
    # MHA_EXT_CPU_VBMI=0 runs what a CPU of the same level without AVX512-VBMI runs (Cooper
    # Lake at avx512_bf16): the fp8 codes converted without the byte tables in both passes.
    if os.environ.get("MHA_EXT_CPU_ISA") or os.environ.get("MHA_EXT_CPU_VBMI"):
        pytest.skip("already running under a forced ISA or VBMI setting")
    if not mha_ext.build_info()["cpu_vbmi"]:
        pytest.skip("this CPU runs no AVX512-VBMI path")
    assert_tests_pass_under_isa(
        None, ["test_paged_quant.py"], FORCED_ISA_SELECTION, env={"MHA_EXT_CPU_VBMI": "0"}
    )


# A bf16 decode over an int8 cache, its output saved to argv[1].
INT8_DECODE_CHILD = """
import sys
import torch
import mha_ext
from test_paged_quant import build_quantized

q, k_cache, v_cache, index, scales = build_quantized(
    "int8", [300, 77], [1, 1], 32, 8, 128, 16, torch.bfloat16
)
torch.save(mha_ext.paged_attention(q, k_cache, v_cache, *index, **scales), sys.argv[1])
"""


@pytest.mark.cpu_only
def test_avx512_levels_choose_the_int8_path(tmp_path):
    # The avx512_vnni level (Cascade Lake, Ice Lake) runs the int16 dot products of the levels
    # above it, bit for bit, and the avx512 level (Skylake-SP, no VNNI) the fp32 FMAs, whose
    # unrounded q and P give other bits.
    if "avx512_vnni" not in mha_ext.build_info()["cpu_isas"]:
        pytest.skip("no AVX-512 build on this platform")
    outputs = {}
    for isa in ("avx512", "avx512_vnni", "avx512_bf16"):
        path = tmp_path / f"{isa}.pt"
        result = run_python_under_isa(INT8_DECODE_CHILD, isa, str(path))
        if "this CPU does not support" in result.stderr:
            if isa == "avx512_bf16":
                continue
            pytest.skip(f"this CPU cannot run {isa}")
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[isa] = torch.load(path)
    assert not torch.equal(outputs["avx512_vnni"], outputs["avx512"])
    if "avx512_bf16" in outputs:
        assert torch.equal(outputs["avx512_vnni"], outputs["avx512_bf16"])


# ---------------------------------------------------------------- cache object and module


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_cache_allocates_scales_like_the_caches(layout):
    cache = mha_ext.PagedKVCache(2, 6, 4, 3, 16, dtype=torch.int8, layout=layout)
    for k, scales in zip(cache.key_caches, cache.key_scales):
        assert k.dtype == torch.int8 and k.shape == (6, 3, 4, 16)
        assert scales.dtype == torch.float32 and scales.shape == (6, 3, 4)
        assert (scales.stride(1) < scales.stride(2)) == (layout == "NHD")
    fp8 = mha_ext.PagedKVCache(1, 6, 4, 3, 16, dtype=torch.float8_e4m3fn, k_scale=0.25)
    assert fp8.key_scales == [None] and fp8.scale_arguments(0)["k_scale"] == 0.25
    with pytest.raises(ValueError, match=r"k_scale and v_scale must be finite and > 0"):
        mha_ext.PagedKVCache(1, 6, 4, 3, 16, dtype=torch.float8_e4m3fn, v_scale=0.0)
    with pytest.raises(ValueError, match=r"must stay 1.0 for a torch.int8 cache"):
        mha_ext.PagedKVCache(1, 6, 4, 3, 16, dtype=torch.int8, k_scale=2.0)


def test_fork_copies_the_scales_of_a_shared_block():
    cache = mha_ext.PagedKVCache(1, 4, 4, 1, 8, dtype=torch.int8)
    parent = cache.allocate()
    batch = cache.prepare([parent], [2])
    mha_ext.paged_kv_append(
        *(torch.randn(2, 1, 8),) * 2,
        cache.key_caches[0],
        cache.value_caches[0],
        batch.slot_mapping,
        **cache.scale_arguments(0),
    )
    child = cache.fork(parent)
    cache.prepare([child], [1])
    shared, private = cache.block_table(parent)[0], cache.block_table(child)[0]
    assert shared != private
    assert torch.equal(cache.key_scales[0][private], cache.key_scales[0][shared])


@pytest.mark.parametrize("fmt", FORMATS)
def test_module_forward_paged_over_an_8bit_cache(fmt):
    # The module's paged forward over an 8-bit cache stays close to an fp32 cache's.
    torch.manual_seed(0)
    attn = mha_ext.MultiHeadAttention(64, 4, num_kv_heads=2, dropout=0.0).eval()
    outputs = {}
    for dtype in (torch.float32, FORMATS[fmt]):
        cache = mha_ext.PagedKVCache(1, 8, 16, 2, 16, dtype=dtype)
        seqs = [cache.allocate(), cache.allocate()]
        x = torch.randn(30, 64, generator=seeded_generator(2))
        with torch.no_grad():
            first = attn.forward_paged(x[:26], cache, 0, cache.prepare(seqs, [20, 6]))
            step = attn.forward_paged(x[26:28], cache, 0, cache.prepare(seqs, [1, 1]))
        outputs[dtype] = torch.cat([first, step])
    exact, quantized = outputs.values()
    relative = (quantized - exact).norm() / exact.norm()
    assert relative < (0.02 if fmt == "int8" else 0.1), relative.item()

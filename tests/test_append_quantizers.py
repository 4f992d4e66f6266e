"""The quantizing append's encoders over every bf16 and fp16 bit pattern and the special
values: the int8 and float8_e4m3fn bytes (and int8 scales) paged_kv_append stores are exactly
those torch computes (mha_ext.reference.quantize_int8 / quantize_float8), on this CPU's ISA and
on the forced avx2 and generic builds. tests/check_fp8_exhaustive.py runs every fp32 pattern
through the fp8 encoder (minutes; run it by hand after changing the encoder)."""

from pathlib import Path

import pytest
import torch

import mha_ext
from mha_ext.reference import quantize_float8, quantize_int8

from conftest import assert_tests_pass_under_isa, skip_unless_isa_rerun_adds

# The CPU kernel's vector and scalar encoders; test_paged_quant checks the CUDA kernel's.
pytestmark = pytest.mark.cpu_only


# fp8's per-tensor scales: powers of two (the kernels multiply by the reciprocal) and others
# (they divide), below and above 1.
FP8_SCALES = [(1.0, 2.0**-3), (0.5, 2.0**20), (0.3, 7.0)]
# Row widths: whole AVX-512 and AVX2 vectors, and ragged last vectors.
HEAD_DIMS = [128, 40, 100]
# A token's 18 rows (keys and values): a whole group of rows quantized together and a partial one.
KV_HEADS = 9


def all_patterns(dtype):
    """Every bit pattern of a 16-bit float dtype, in order of the patterns (65536,)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def special_values():
    """fp32 values at the encoders' edges (fp32 (n,)): signed zeros, fp32 and e4m3
    subnormals, e4m3's rounding boundaries and saturation, infinities and NaNs."""
    tiny = torch.finfo(torch.float32).tiny
    values = [0.0, -0.0, tiny, -tiny, tiny / 2**20, 2.0**-149, -(2.0**-149)]
    values += [2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-6 * (1 - 2**-5), 2.0**-7 * 1.0625]
    values += [1.0625, 1.1875, 447.0, 448.0, 455.999, 456.0, 464.0, 479.9, 480.0, 1e30, 3.4e38]
    values += [float("inf"), float("nan"), -float("inf")]
    values += [-v for v in values]
    nan_payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, 0xFFC00001 - 2**32], dtype=torch.int32)
    return torch.cat([torch.tensor(values), nan_payloads.view(torch.float32)])


def kernel_int8(rows):
    """(stored, scale) the int8 append writes for rows (..., dim): quantize_int8, except that
    the absmax skips NaNs and a NaN element stores 0 (torch's amax would make the row's scale
    NaN, and its NaN -> int8 conversion is not defined). A row with an infinity has scale inf
    and stores 0 for its finite elements."""
    finite_or_inf = torch.where(rows.float().isnan(), 0.0, rows.float())
    stored, scale = quantize_int8(finite_or_inf)
    x = rows.float()
    divisor = torch.where(scale == 0, 1.0, scale)[..., None].expand_as(x).contiguous()
    quotient = x / divisor
    stored = torch.where(quotient.isnan() | (scale[..., None] == 0), 0, stored)
    return stored, scale


def append(rows, fmt, head_dim, scales):
    """Appends rows (n * KV_HEADS * head_dim values, the same as keys and, reversed, as values)
    into a fresh cache of block size 3 at shuffled slots; returns ((key, value) rows as
    appended (tokens, kv_heads, head_dim), the (k, v) caches and int8 scales read back in the
    rows' order)."""
    kv_heads = KV_HEADS
    key = rows.reshape(-1, kv_heads, head_dim)
    value = rows.flip(0).reshape(-1, kv_heads, head_dim)
    tokens, block_size = key.shape[0], 3
    num_blocks = -(-tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))
    slots = slots[:tokens]
    dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    caches = [torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype) for _ in "kv"]
    arguments = dict(scales)
    if fmt == "int8":
        arguments = {
            f"{w}_scales": torch.full((num_blocks, kv_heads, block_size), -1.0) for w in "kv"
        }
    mha_ext.paged_kv_append(key, value, *caches, slots, **arguments)
    block, offset = slots // block_size, slots % block_size
    read = [c[block, :, offset] for c in caches]  # (tokens, kv_heads, head_dim) each
    read_scales = (
        [arguments[f"{w}_scales"][block, :, offset] for w in "kv"] if fmt == "int8" else None
    )
    return (key, value), read, read_scales


def check(rows, fmt, head_dim, scales=None):
    (key, value), stored, stored_scales = append(rows, fmt, head_dim, scales or {})
    for which, appended, got in (("k", key, stored[0]), ("v", value, stored[1])):
        if fmt == "int8":
            expected, expected_scale = kernel_int8(appended)
            got_scale = stored_scales["kv".index(which)]
            assert torch.equal(got_scale.view(torch.int32), expected_scale.view(torch.int32)), which
            mismatch = got != expected
        else:
            expected = quantize_float8(appended, scales[f"{which}_scale"])
            mismatch = got.view(torch.uint8) != expected.view(torch.uint8)
        if mismatch.any():
            first = tuple(mismatch.nonzero()[0].tolist())
            pytest.fail(
                f"{fmt} {which} at {first}: input {appended[first].item()!r} stored"
                f" {got[first].float().item()!r}, torch {expected[first].float().item()!r}"
            )


def padded(values, head_dim):
    """values (n,) followed by zeros up to whole tokens of KV_HEADS rows of head_dim."""
    size = -(-values.numel() // (head_dim * KV_HEADS)) * head_dim * KV_HEADS
    return torch.cat([values, values.new_zeros(size - values.numel())])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k_scale, v_scale", FP8_SCALES)
def test_fp8_every_pattern(dtype, head_dim, k_scale, v_scale):
    check(
        padded(all_patterns(dtype), head_dim),
        "fp8",
        head_dim,
        {"k_scale": k_scale, "v_scale": v_scale},
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int8_every_pattern(dtype, head_dim):
    # In pattern order each row holds neighbouring patterns: every scale from the smallest
    # subnormal rows to the largest, rows with infinities and NaNs.
    check(padded(all_patterns(dtype), head_dim), "int8", head_dim)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int8_every_pattern_shuffled(dtype, head_dim):
    # Shuffled, the rows mix magnitudes: most elements quantize far below their row's absmax.
    patterns = all_patterns(dtype)
    patterns = patterns[
        torch.randperm(patterns.numel(), generator=torch.Generator().manual_seed(1))
    ]
    finite = patterns[patterns.float().isfinite()]
    check(padded(finite, head_dim), "int8", head_dim)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_special_values(fmt, head_dim):
    specials = special_values()
    # Each special alone in a row of small values, then all of them in one row.
    rows = torch.randn(specials.numel() + 1, head_dim, generator=torch.Generator().manual_seed(2))
    rows[torch.arange(specials.numel()), torch.arange(specials.numel()) % head_dim] = specials
    rows[-1, :] = specials.repeat(-(-head_dim // specials.numel()))[:head_dim]
    rows = padded(rows.flatten(), head_dim)
    scales = [{"k_scale": 1.0, "v_scale": 0.3}] if fmt == "fp8" else [None]
    for s in scales:
        check(rows, fmt, head_dim, s)


@pytest.mark.parametrize("kv_heads", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_row_groups(fmt, kv_heads):
    # A token's 2 * kv_heads rows are quantized in groups of a vector's width: fewer rows than
    # a group, whole groups and a partial last group, each row's scale its own.
    head_dim = 64
    generator = torch.Generator().manual_seed(3)
    magnitudes = 10.0 ** torch.randint(-20, 20, (7, kv_heads, 1), generator=generator)
    key = (torch.randn(7, kv_heads, head_dim, generator=generator) * magnitudes).bfloat16()
    value = (torch.randn(7, kv_heads, head_dim, generator=generator) / magnitudes).bfloat16()
    key[2, 0] = 0.0  # an all-zero row in the middle of a group: scale 0
    dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    k_cache, v_cache = (torch.zeros(7, kv_heads, 1, head_dim, dtype=dtype) for _ in "kv")
    slots = torch.arange(7)
    if fmt == "int8":
        scales = {f"{w}_scales": torch.full((7, kv_heads, 1), -1.0) for w in "kv"}
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots, **scales)
        for rows, cache, which in ((key, k_cache, "k"), (value, v_cache, "v")):
            stored, scale = quantize_int8(rows)
            assert torch.equal(cache[:, :, 0], stored), which
            assert torch.equal(scales[f"{which}_scales"][:, :, 0], scale), which
    else:
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots, k_scale=2.0, v_scale=0.3)
        for rows, cache, s in ((key, k_cache, 2.0), (value, v_cache, 0.3)):
            expected = quantize_float8(rows, s)
            assert torch.equal(cache[:, :, 0].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_forced_isa_builds(isa):
    skip_unless_isa_rerun_adds(isa, compare_builds=False)
    assert_tests_pass_under_isa(isa, [Path(__file__).name])

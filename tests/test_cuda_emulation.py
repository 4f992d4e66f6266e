"""The CUDA backend run on the CPU through the emulator in tests/emulation: the real kernel
sources and op bodies (csrc/cuda), every thread of a block a fiber with real barriers and
shuffles, the tensor-core MMA emulated with its PTX fragment layout. It checks index math,
fragment layouts, masking, dropout and barriers where no GPU is available; speed and races
between blocks need the GPU run (benchmarks/gpu_check.sh)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from feature_reference import featured_attention, featured_attention_varlen

import mha_ext  # noqa: F401  (loads torch.ops.mha_ext, the CPU side of every comparison)
from mha_ext.reference import attention_reference, paged_attention_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator

pytestmark = pytest.mark.cpu_only  # the emulator runs on the CPU; a GPU runs the real thing

ROOT = Path(__file__).resolve().parent.parent
EMULATION = Path(__file__).resolve().parent / "emulation"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
KERNEL_SOURCES = ["attention.cu", "attention_mma.cu", "dropout_mask.cu", "paged.cu"]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if not (CUDA_INCLUDE / "cuda_fp16.h").exists():
        # CI installs the toolkit: there a missing header is a broken setup, not a skip.
        message = f"no CUDA headers under {CUDA_INCLUDE} (set CUDA_HOME)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from torch.utils import cpp_extension

    sys.path.insert(0, str(EMULATION))
    from translate import translate

    build = tmp_path_factory.mktemp("emulated_cuda")
    sources = []
    # The kernels and the CUDA backend's host code, which launches them, go through the
    # translation; the op files (headers) and the checks they share compile as they are.
    for name in KERNEL_SOURCES + ["../backend.cpp"]:
        path = ROOT / "csrc" / "cuda" / "kernels" / name
        target = build / (path.stem + ".cpp")
        target.write_text(translate(path.read_text()))
        sources.append(str(target))
    sources.append(str(ROOT / "csrc" / "ops" / "tensor_checks.cpp"))
    sources.append(str(EMULATION / "binding.cpp"))
    return cpp_extension.load(
        "mha_ext_emulated_cuda",
        sources,
        build_directory=str(build),
        extra_include_paths=[
            str(ROOT / "csrc"),
            str(ROOT / "csrc" / "include"),
            str(EMULATION),
            str(CUDA_INCLUDE),
        ],
        extra_cflags=["-O1", "-std=c++20", "-Wno-attributes"],
        verbose=False,
    )


MASKINGS = {
    "none": dict(window_left=-1, window_right=-1, bottom_right=False),
    "causal_bottom_right": dict(window_left=-1, window_right=0, bottom_right=True),
    "window": dict(
        window_left=9, window_right=3, bottom_right=True
    ),  # a window aligns bottom-right
}


def op_args(
    head_dim,
    *,
    mask=None,
    seed=None,
    dropout_p=0.0,
    window=(-1, -1),
    bottom_right=False,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_k=None,
    max_seqlen_q=0,
    max_seqlen_k=0,
    deterministic=False,
):
    """The arguments after q, k, v of attention_forward (and after lse of attention_backward),
    in schema order: the emulated ops are plain functions without defaults."""
    return (
        mask,
        seed,
        dropout_p,
        head_dim**-0.5,
        window[0],
        window[1],
        bottom_right,
        softcap,
        alibi_slopes,
        sinks,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        deterministic,
    )


def run_both(emulated, q, k, v, mask=None, seed=None, dropout_p=0.0, masking="none"):
    """Forward and backward through the emulated CUDA ops and the CPU ops, same inputs."""
    window = MASKINGS[masking]
    args = op_args(
        q.shape[-1],
        mask=mask,
        seed=seed,
        dropout_p=dropout_p,
        window=(window["window_left"], window["window_right"]),
        bottom_right=window["bottom_right"],
    )
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=seeded_generator(3)).to(q.dtype)
    results = {}
    for name, forward, backward in (
        ("emulated", emulated.attention_forward, emulated.attention_backward),
        ("cpu", torch.ops.mha_ext.attention_forward, torch.ops.mha_ext.attention_backward),
    ):
        out, lse = forward(q, k, v, *args)
        grads = backward(grad_out, None, q, k, v, out, lse, *args)[:3]
        results[name] = (out, lse, *grads)
    return results


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masking", list(MASKINGS))
def test_attention_matches_the_reference(emulated, kernels, dtype, masking, monkeypatch):
    # auto: head dim 64 runs the tensor-core forward and backward; simt the generic kernels.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v = random_qkv(1, 4, 2, 70, 90, 64, dtype=dtype)
    window = MASKINGS[masking]
    kwargs = (
        {"causal": "bottom_right"}
        if masking == "causal_bottom_right"
        else (
            {"window": (window["window_left"], window["window_right"])}
            if masking == "window"
            else {}
        )
    )
    results = run_both(emulated, q, k, v, masking=masking)
    out, lse, grad_q, grad_k, grad_v = results["emulated"]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_reference(*leaves, **kwargs)
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=seeded_generator(3)).to(dtype)
    ref.backward(grad_out.double())
    plain_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    plain, _ = attention_reference(*plain_leaves, **kwargs)
    plain.backward(grad_out)
    assert_within_rule(out, ref.detach(), plain.detach(), OUTPUT_FACTOR, "output")
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)
    for got, leaf, plain_leaf, name in zip((grad_q, grad_k, grad_v), leaves, plain_leaves, "qkv"):
        assert_within_rule(got, leaf.grad, plain_leaf.grad, GRAD_FACTOR, f"grad_{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_generic_kernels_agree_with_the_cpu_in_full_precision(emulated, dtype):
    q, k, v = random_qkv(2, 4, 1, 33, 47, 40, dtype=dtype)
    mask = torch.rand(2, 1, 33, 47, generator=seeded_generator(1)) > 0.2
    results = run_both(emulated, q, k, v, mask=mask, masking="causal_bottom_right")
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for got, expected in zip(results["emulated"], results["cpu"]):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernels", ["auto", "simt"])
def test_dropout_uses_the_cpu_mask(emulated, kernels, monkeypatch):
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    seed = torch.tensor([4242], dtype=torch.int64)
    assert torch.equal(
        emulated.dropout_mask(seed, 2, 3, 37, 45, 0.3),
        torch.ops.mha_ext.dropout_mask(seed, 2, 3, 37, 45, 0.3),
    )
    q, k, v = random_qkv(1, 2, 2, 40, 72, 64, dtype=torch.bfloat16)
    results = run_both(emulated, q, k, v, seed=seed, dropout_p=0.3, masking="window")
    for got, expected, name in zip(
        results["emulated"], results["cpu"], ["out", "lse", "dq", "dk", "dv"]
    ):
        torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2, msg=name)


def test_paged_ops_match_the_cpu(emulated):
    from test_paged import build_paged

    # GQA 8 query / 2 kv heads, decode and a prefill chunk. With 1 "SM" the 4 (sequence, kv
    # head) blocks fill the GPU and the keys stay whole; with 64 they split in 2 and merge.
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged([9, 600], [1, 20], 8, 2, 32, 16)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    for num_sms in (1, 64):
        emulated.set_multiprocessor_count(num_sms)
        out, lse = emulated.paged_attention(
            q, k_cache, v_cache, tables, seq_lens, cu, 0.25, -1, 0.0, None, None
        )
        expected, expected_lse = torch.ops.mha_ext.paged_attention(
            q, k_cache, v_cache, tables, seq_lens, cu, 0.25
        )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)

    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    slots = torch.tensor([3, -1, 10**6, 17])
    emulated_k, emulated_v = k_cache.clone(), v_cache.clone()
    emulated.paged_kv_append(key, value, emulated_k, emulated_v, slots)
    keep = torch.tensor([3, -1, -1, 17])  # the out-of-range slot is skipped
    torch.ops.mha_ext.paged_kv_append(key, value, k_cache, v_cache, keep)
    assert torch.equal(emulated_k, k_cache) and torch.equal(emulated_v, v_cache)

    out_a, lse_a, out_b, lse_b = (
        torch.randn(3, 5, 16),
        torch.randn(3, 5),
        torch.randn(3, 5, 16),
        torch.randn(3, 5),
    )
    lse_b[0] = float("-inf")
    for got, expected in zip(
        emulated.merge_attention_states(out_a, lse_a, out_b, lse_b),
        torch.ops.mha_ext.merge_attention_states(out_a, lse_a, out_b, lse_b),
    ):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "sinks", "all"])
def test_paged_score_features_match_the_cpu_and_the_reference(emulated, feature, dtype):
    # GQA 8/2, decode and a 20-query chunk, with 1 "SM" (whole keys) and 64 (2 key splits,
    # the sink joined once in their merge; "all" has a window of 530 keys, wide enough to
    # split). Every cached row before each sequence's window is NaN: the kernel must not
    # read it.
    from test_paged import build_paged, feature_arguments, window_start

    lengths, queries = [9, 600], [1, 20]
    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(lengths, queries, 8, 2, 32, 16)
    q, k_cache, v_cache = q.to(dtype), k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    arguments = feature_arguments(feature, 8, len(lengths))
    if feature == "alibi":
        arguments = feature_arguments("alibi_per_sequence", 8, len(lengths))
    if feature == "all":
        arguments["window"] = (530, 0)
    for b, n in enumerate(lengths):
        outside = torch.arange(window_start(n, queries[b], arguments.get("window")))
        slots = mha_ext.slot_mapping_for(tables[b], outside, 16)
        k_cache[slots // 16, :, slots % 16] = float("nan")
        v_cache[slots // 16, :, slots % 16] = float("nan")
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    window = arguments.get("window")
    options = (
        -1 if window is None or window[0] is None else window[0],
        arguments.get("softcap", 0.0),
        *(
            arguments[name].to(lse_dtype) if name in arguments else None
            for name in ("alibi_slopes", "sinks")
        ),
    )
    index, scale = (tables, seq_lens, cu), 32**-0.5
    ref, ref_lse = paged_attention_reference(q.double(), k_cache, v_cache, *index, **arguments)
    plain, _ = paged_attention_reference(q, k_cache, v_cache, *index, **arguments)
    expected, expected_lse = torch.ops.mha_ext.paged_attention(
        q, k_cache, v_cache, *index, scale, *options
    )
    for num_sms in (1, 64):
        emulated.set_multiprocessor_count(num_sms)
        out, lse = emulated.paged_attention(q, k_cache, v_cache, *index, scale, *options)
        assert_within_rule(out, ref, plain, OUTPUT_FACTOR, f"{feature}, {num_sms} SMs")
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_head_dim_128_masks_and_fully_masked_rows(emulated, kernels, mask_kind, monkeypatch):
    # Bottom-right causal with 80 queries over 40 keys hides every key from rows 0-39 (and
    # the bool mask all of row 45): empty rows must give 0, lse -inf and finite gradients.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v = random_qkv(1, 8, 2, 80, 40, 128, dtype=torch.bfloat16)
    if mask_kind == "bool":
        mask = torch.rand(1, 1, 80, 40, generator=seeded_generator(2)) > 0.3
        mask[:, :, 45] = False
    else:
        mask = torch.randn(1, 8, 80, 40, generator=seeded_generator(2)).to(torch.bfloat16)
    results = run_both(emulated, q, k, v, mask=mask, masking="causal_bottom_right")
    for got, expected, name in zip(
        results["emulated"], results["cpu"], ["out", "lse", "dq", "dk", "dv"]
    ):
        assert torch.isfinite(got).all() or name == "lse", name
        torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2, msg=name)
    out, lse = results["emulated"][:2]
    empty = [*range(40), 45] if mask_kind == "bool" else list(range(40))
    assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()


@pytest.mark.parametrize("head_dim", [96, 256])
def test_generic_kernels_wide_head_dims(emulated, head_dim):
    # 4 and 8 output dims per lane (kDimChunks), and the 48 KiB shared-memory opt-in at 256.
    q, k, v = random_qkv(1, 2, 2, 20, 37, head_dim, dtype=torch.float32)
    results = run_both(emulated, q, k, v, masking="causal_bottom_right")
    for got, expected in zip(results["emulated"], results["cpu"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 7])
def test_paged_mqa_groups_wider_than_a_row_tile(emulated, block_size):
    # 32 query heads on one kv head: a query's rows span two 16-row tiles; bf16 cache.
    from test_paged import build_paged

    q, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(
        [5, 40], [2, 3], 32, 1, 64, block_size, dtype=torch.bfloat16
    )
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    emulated.set_multiprocessor_count(8)
    out, lse = emulated.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, cu, 0.125, -1, 0.0, None, None
    )
    expected, expected_lse = torch.ops.mha_ext.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, cu, 0.125
    )
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_paged_ops_match_the_cpu(emulated, fmt):
    # The CUDA append writes the CPU's bits (int8 rows and scales, e4m3fn rows), and attention
    # over the 8-bit cache (GQA 8/2, decode and a prefill chunk, whole keys and 2 splits,
    # all score features) matches the CPU op.
    from test_paged_quant import bits, build_quantized

    from test_paged import feature_arguments

    q, k_cache, v_cache, index, scales = build_quantized(
        fmt, [9, 600], [1, 20], 8, 2, 32, 16, torch.bfloat16
    )
    key, value = torch.randn(5, 2, 32).bfloat16() * 3, torch.randn(5, 2, 32).bfloat16()
    key[0, 0] = 0.0  # an all-zero row
    slots = torch.tensor([3, -1, 10**6, 17, 40])
    emulated_caches = [t.clone() for t in (k_cache, v_cache)]
    emulated_scales = {
        n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in scales.items()
    }
    emulated.paged_kv_append(key, value, *emulated_caches, slots, **emulated_scales)
    keep = torch.tensor([3, -1, -1, 17, 40])  # the out-of-range slot is skipped
    torch.ops.mha_ext.paged_kv_append(key, value, k_cache, v_cache, keep, **scales)
    assert torch.equal(bits(emulated_caches[0]), bits(k_cache))
    assert torch.equal(bits(emulated_caches[1]), bits(v_cache))
    for name, t in scales.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(bits(emulated_scales[name]), bits(t)), name

    features = feature_arguments("all", 8, 2)
    options = (53, 1.5, features["alibi_slopes"], features["sinks"])
    scale_options = (scales.get("k_scales"), scales.get("v_scales"))
    scale_options += (scales.get("k_scale", 1.0), scales.get("v_scale", 1.0))
    for num_sms in (1, 64):
        emulated.set_multiprocessor_count(num_sms)
        out, lse = emulated.paged_attention(
            q, k_cache, v_cache, *index, 0.2, *options, *scale_options
        )
        expected, expected_lse = torch.ops.mha_ext.paged_attention(
            q, k_cache, v_cache, *index, 0.2, *options, *scale_options
        )
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


# Issue 29's features against featured_attention in float64. GQA (4 query heads on 2 kv
# heads) and a two-sided bottom-right window throughout; head dim 64 takes the tensor-core
# kernels under "auto" for fp16/bf16. The packed layout has a sequence without queries
# (1), one whose queries see no key (3: seqused_k 0) and rows longer than one 64-row tile.
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
WINDOW = (20, 3)
SEQLENS_Q, SEQLENS_K, SEQUSED_K = [37, 0, 70, 9], [50, 12, 64, 20], [45, 12, 64, 0]
FEATURES = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(softcap=1.5, alibi=True, sinks=True),
}


def feature_case(feature, dtype, layout, seed=0):
    """q, k, v, the op options (op_args keywords) and the reference's options."""
    generator = seeded_generator(seed)
    batch = len(SEQLENS_Q)
    if layout == "varlen":
        total_q, total_k = sum(SEQLENS_Q), sum(SEQLENS_K)
        q = torch.randn(total_q, HEADS, HEAD_DIM, generator=generator).to(dtype)
        k = torch.randn(total_k, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(total_k, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        cu_q, cu_k = (
            torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            for lens in (SEQLENS_Q, SEQLENS_K)
        )
        options = dict(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            seqused_k=torch.tensor(SEQUSED_K, dtype=torch.int32),
            max_seqlen_q=max(SEQLENS_Q),
            max_seqlen_k=max(SEQLENS_K),
        )
    else:
        q, k, v = random_qkv(2, HEADS, KV_HEADS, 40, 70, HEAD_DIM, dtype=dtype, seed=seed)
        batch, options = 2, {}
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    wanted = FEATURES[feature]
    options.update(window=WINDOW, bottom_right=True, softcap=wanted.get("softcap", 0.0))
    if wanted.get("alibi"):
        # Per-sequence slopes for the packed call, one per head for the dense one.
        shape = (batch, HEADS) if layout == "varlen" else (HEADS,)
        options["alibi_slopes"] = (0.3 * torch.rand(shape, generator=generator)).to(accumulate)
    if wanted.get("sinks"):
        options["sinks"] = torch.randn(HEADS, generator=generator).to(accumulate)
    return q, k, v, options


def reference_of(q, k, v, options, dropout_keep=None, dropout_p=0.0):
    """(out, lse) of featured_attention(_varlen) for the op options."""
    reference = dict(
        window=options["window"],
        bottom_right=options["bottom_right"],
        softcap=options["softcap"],
        alibi_slopes=options.get("alibi_slopes"),
        sinks=options.get("sinks"),
        dropout_keep=dropout_keep,
        dropout_p=dropout_p,
    )
    if "cu_seqlens_q" in options:
        return featured_attention_varlen(
            q,
            k,
            v,
            options["cu_seqlens_q"],
            options["cu_seqlens_k"],
            options["seqused_k"],
            **reference,
        )
    return featured_attention(q, k, v, **reference)


def emulated_call(emulated, q, k, v, options, grad_out, grad_lse):
    """out, lse, grad_q, grad_k, grad_v, grad_sinks of the emulated forward and backward."""
    args = op_args(q.shape[-1], **options)
    out, lse = emulated.attention_forward(q, k, v, *args)
    grads = emulated.attention_backward(grad_out, grad_lse, q, k, v, out, lse, *args)
    return (out, lse, *grads)


def check_against_reference(results, q, k, v, options, grad_out, grad_lse, **dropout):
    """The accuracy rule for out and every gradient (sinks' included), lse to fp32 rounding."""
    out, lse, grad_q, grad_k, grad_v, grad_sinks = results
    leaves = {"q": q, "k": k, "v": v}
    if options.get("sinks") is not None:
        leaves["sinks"] = options["sinks"]
    expected = {}
    for precision in ("float64", "plain"):
        inputs = {
            name: (t.double() if precision == "float64" else t).detach().clone().requires_grad_()
            for name, t in leaves.items()
        }
        run_options = {**options, "sinks": inputs.get("sinks")}
        if precision == "float64" and run_options.get("alibi_slopes") is not None:
            run_options["alibi_slopes"] = run_options["alibi_slopes"].double()
        ref_out, ref_lse = reference_of(
            inputs["q"], inputs["k"], inputs["v"], run_options, **dropout
        )
        finite = torch.isfinite(ref_lse)
        ref_grads = torch.autograd.grad(
            (ref_out, ref_lse[finite]),
            list(inputs.values()),
            (grad_out.to(ref_out.dtype), grad_lse[finite].to(ref_lse.dtype)),
        )
        expected[precision] = (ref_out.detach(), ref_lse.detach(), dict(zip(inputs, ref_grads)))
    (ref_out, ref_lse, ref_grads), (plain_out, _, plain_grads) = (
        expected["float64"],
        expected["plain"],
    )
    assert_within_rule(out, ref_out, plain_out, OUTPUT_FACTOR, "output")
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), "lse -inf rows"
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), rtol=1e-5, atol=1e-5)
    got = {"q": grad_q, "k": grad_k, "v": grad_v, "sinks": grad_sinks}
    for name in leaves:
        assert got[name].shape == leaves[name].shape, name
        assert_within_rule(
            got[name], ref_grads[name], plain_grads[name], GRAD_FACTOR, f"grad_{name}"
        )


def random_grads(q, v, lse_shape, seed=3):
    generator = seeded_generator(seed)
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=generator).to(q.dtype)
    grad_lse = torch.randn(lse_shape, generator=generator)
    return grad_out, grad_lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def lse_shape_of(q):
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else q.shape[:3]


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_score_features_match_the_float64_reference(
    emulated, kernels, layout, feature, monkeypatch
):
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v, options = feature_case(feature, torch.bfloat16, layout)
    grad_out, grad_lse = random_grads(q, v, lse_shape_of(q))
    results = emulated_call(emulated, q, k, v, options, grad_out, grad_lse)
    check_against_reference(results, q, k, v, options, grad_out, grad_lse)


@pytest.mark.parametrize(
    "dtype, kernels",
    [(torch.float16, "auto"), (torch.float32, "auto"), (torch.float64, "auto")],
    ids=["fp16-tensor-cores", "fp32-simt", "fp64-simt"],
)
def test_all_features_packed_in_every_dtype(emulated, dtype, kernels, monkeypatch):
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v, options = feature_case("all", dtype, "varlen", seed=1)
    grad_out, grad_lse = random_grads(q, v, lse_shape_of(q))
    results = emulated_call(emulated, q, k, v, options, grad_out, grad_lse)
    check_against_reference(results, q, k, v, options, grad_out, grad_lse)


@pytest.mark.parametrize("kernels", ["auto", "simt"])
def test_packed_dropout_draws_each_sequence_as_its_batch_entry(emulated, kernels, monkeypatch):
    # Sequence b of a packed call drops what dropout_mask's batch entry b keeps, cut to its
    # lengths (DropoutParams::batch_offset).
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v, options = feature_case("all", torch.bfloat16, "varlen", seed=2)
    seed, dropout_p = torch.tensor([77], dtype=torch.int64), 0.25
    options.update(seed=seed, dropout_p=dropout_p)
    keep = emulated.dropout_mask(
        seed, len(SEQLENS_Q), HEADS, max(SEQLENS_Q), max(SEQLENS_K), dropout_p
    )
    grad_out, grad_lse = random_grads(q, v, lse_shape_of(q))
    results = emulated_call(emulated, q, k, v, options, grad_out, grad_lse)
    reference_options = {
        name: options[name] for name in options if name not in ("seed", "dropout_p")
    }
    check_against_reference(
        results,
        q,
        k,
        v,
        reference_options,
        grad_out,
        grad_lse,
        dropout_keep=keep,
        dropout_p=dropout_p,
    )


@pytest.mark.parametrize("kernels", ["auto", "simt"])
def test_deterministic_backward_is_bitwise_repeatable(emulated, kernels, monkeypatch):
    # The emulator runs blocks in one order, so repeatability here shows only that the
    # deterministic path computes dQ without the shared workspace; the GPU run
    # (test_cuda.py) checks it against real concurrency.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v, options = feature_case("all", torch.bfloat16, "varlen", seed=3)
    grad_out, grad_lse = random_grads(q, v, lse_shape_of(q))
    first = emulated_call(emulated, q, k, v, {**options, "deterministic": True}, grad_out, grad_lse)
    second = emulated_call(
        emulated, q, k, v, {**options, "deterministic": True}, grad_out, grad_lse
    )
    for a, b, name in zip(first, second, ["out", "lse", "dq", "dk", "dv", "dsinks"]):
        assert torch.equal(a, b), name
    check_against_reference(first, q, k, v, options, grad_out, grad_lse)
    atomic = emulated_call(emulated, q, k, v, options, grad_out, grad_lse)
    torch.testing.assert_close(first[2].float(), atomic[2].float(), rtol=1e-2, atol=1e-2)

"""mha_ext.scaled_dot_product_attention as a drop-in for torch's, and the reference itself
checked against torch's math path."""

import random
import re

import pytest
import torch
import torch.nn.functional as F

import mha_ext
from mha_ext.reference import attention_reference

from conftest import random_qkv, seeded_generator

CASES = {
    "plain": ({}, {}),
    "causal": ({"is_causal": True}, {}),
    "scale": ({"scale": 0.37}, {}),
    "bool_mask": ({"attn_mask": "bool"}, {}),
    "additive_mask": ({"attn_mask": "additive"}, {}),
    "gqa_causal": ({"is_causal": True, "enable_gqa": True}, {"kv_heads": 2}),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lengths", [(31, 31), (20, 45), (45, 20)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_torch_sdpa(name, lengths):
    kwargs, shape = CASES[name]
    seq_q, seq_k = lengths
    q, k, v = random_qkv(2, 4, shape.get("kv_heads", 4), seq_q, seq_k, 32)
    kwargs = dict(kwargs)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(seq_q, seq_k) > 0.2
        kwargs["attn_mask"][:, 0] = True  # torch's math path gives NaN for rows with no key
    elif kwargs.get("attn_mask") == "additive":
        kwargs["attn_mask"] = torch.randn(2, 1, seq_q, seq_k)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    actual = mha_ext.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_three_dimensional_inputs():
    q, k, v = (torch.randn(3, 11, 16), torch.randn(3, 13, 16), torch.randn(3, 13, 16))
    mask = torch.rand(3, 11, 13) > 0.1
    mask[..., 0] = True
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
        actual = mha_ext.scaled_dot_product_attention(q, k, v, **kwargs)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_gradients_match_torch_sdpa():
    q, k, v = random_qkv(2, 8, 2, 40, 40, 32)
    grads = []
    for fn in (F.scaled_dot_product_attention, mha_ext.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, is_causal=True, enable_gqa=True).square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for expected, actual in zip(*grads):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.2, "enable_gqa": True}])
def test_reference_matches_torch_math_in_fp64(kwargs):
    q, k, v = random_qkv(
        2, 4, 2 if kwargs.get("enable_gqa") else 4, 17, 29, 16, dtype=torch.float64
    )
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    actual, _ = attention_reference(
        q, k, v, causal="top_left" if kwargs.get("is_causal") else None, scale=kwargs.get("scale")
    )
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_reference_bottom_right_causal_and_window_by_hand():
    q, k, v = random_qkv(1, 1, 1, 3, 5, 4, dtype=torch.float64)
    # Bottom-right: query i is key 2 + i. Window (1, 0): keys 1+i .. 2+i.
    visible = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    actual, _ = attention_reference(q, k, v, causal="bottom_right", window=(1, 0))
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    fused = mha_ext.attention(q, k, v, causal="bottom_right", window=(1, 0))
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)


def test_mask_and_is_causal_together_raise_as_in_torch():
    q, k, v = random_qkv(2, 4, 4, 13, 13, 16, dtype=torch.float64)
    mask = torch.rand(13, 13, generator=seeded_generator(1)) > 0.3
    for sdpa in (F.scaled_dot_product_attention, mha_ext.scaled_dot_product_attention):
        with pytest.raises(RuntimeError, match=r"attn_mask .* is_causal=True"):
            sdpa(q, k, v, attn_mask=mask, is_causal=True)
    # The combination stays available through attention.
    expected, _ = attention_reference(q, k, v, causal="top_left", attn_mask=mask)
    actual = mha_ext.attention(q, k, v, attn_mask=mask, causal="top_left")
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# The drop-in's contract, checked against torch itself: on the same inputs torch and
# mha_ext.scaled_dot_product_attention raise the same exception class (mha_ext's message
# must match the pattern) or return equal outputs and gradients. (B, H, L, S, E) below.
B, H, L, S, E = 2, 4, 5, 7, 8


def _randn(*shape, dtype=torch.float64):
    return torch.randn(shape, dtype=torch.float64).to(dtype)


def _qkv(q=(B, H, L, E), k=(B, H, S, E), v=None, dtype=torch.float64):
    return _randn(*q, dtype=dtype), _randn(*k, dtype=dtype), _randn(*(v or k), dtype=dtype)


def _call(*args, **kwargs):
    """A case's arguments: q, k, v from _qkv's keywords, then the call's own."""
    shapes = {name: kwargs.pop(name) for name in ("q", "k", "v", "dtype") if name in kwargs}
    return lambda: (_qkv(**shapes) + args, kwargs)


def _mask(*shape, dtype=torch.bool):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.3
    return torch.randn(shape, dtype=torch.float64).to(dtype)


def _replacing(build, position, make):
    """build with its positional argument `position` (0, 1, 2: q, k, v) replaced by
    make(q, k, v)."""

    def replaced():
        args, kwargs = build()
        args = list(args)
        args[position] = make(*args[:3])
        return tuple(args), kwargs

    return replaced


def _fully_masked_rows():
    mask = torch.rand(L, S) > 0.3
    mask[1] = False
    return mask


def _additive_fully_masked_rows():
    return torch.zeros(L, S).masked_fill(~_fully_masked_rows(), float("-inf"))


def _strided_last_dim(q, k, v):
    return torch.randn(B, H, L, 2 * E, dtype=q.dtype)[..., ::2]


# (id, build, pattern of mha_ext's message where torch raises, else None)
SAME_AS_TORCH = [
    # Where torch raises.
    ("causal_with_mask", _call(_mask(L, S), 0.0, True), r"attn_mask must be None when is_causal"),
    ("1d_inputs", _call(q=(E,), k=(E,)), r"at least 2-D .* got shapes \(8,\), \(8,\), \(8,\)"),
    ("1d_key", _call(k=(E,), v=(S, E)), r"at least 2-D"),
    ("batch_2_vs_3", _call(k=(3, H, S, E)), r"do not broadcast: query \(2, 4\), key \(3, 4\)"),
    ("heads_without_gqa", _call(k=(B, 2, S, E)), r"do not broadcast: query \(2, 4\), key \(2, 2\)"),
    ("4d_query_3d_key", _call(k=(B, S, E)), r"do not broadcast: query \(2, 4\), key \(2,\)"),
    ("kv_heads_differ_no_gqa", _call(v=(B, 2, S, E)), r"value \(2, 2\)"),
    ("gqa_3_of_4", _call(k=(B, 3, S, E), enable_gqa=True), r"divide query's 4 heads, got key"),
    ("gqa_more_kv", _call(k=(B, 8, S, E), enable_gqa=True), r"divide query's 4 heads, got key"),
    ("gqa_2d", _call(q=(L, E), k=(S, E), enable_gqa=True), r"reads the heads from dim -3"),
    ("head_dim_q_vs_k", _call(k=(B, H, S, 4), v=(B, H, S, E)), r"share the embedding dim E"),
    ("dtype_q_vs_k", _replacing(_call(), 1, lambda q, k, v: k.float()), r"same dtype, got query"),
    ("dtype_int", _call(dtype=torch.int32), r"dtype torch.int32; supported dtypes"),
    ("dtype_complex", _call(dtype=torch.complex64), r"dtype torch.complex64; supported"),
    ("mask_int64", _call(_mask(L, S, dtype=torch.int64)), r"got torch.int64"),
    (
        "mask_f64_on_f32",
        _call(_mask(L, S, dtype=torch.float64), dtype=torch.float32),
        r"got torch.float64",
    ),
    ("mask_f16_on_f32", _call(_mask(L, S, dtype=torch.float16), dtype=torch.float32), r"float16"),
    ("mask_bad_L", _call(_mask(3, S)), r"\(3, 7\) does not broadcast to .* \(2, 4, 5, 7\)"),
    ("mask_bad_S", _call(_mask(B, H, L, S + 1)), r"does not broadcast"),
    ("mask_bad_batch", _call(_mask(3, B, L, S)), r"does not broadcast"),
    ("mask_5d_on_4d", _call(_mask(1, 1, 1, L, S)), r"does not broadcast"),
    ("mask_1d_on_4d", _call(_mask(S)), r"attn_mask of shape \(7,\) has no \(L, S\) dims"),
    ("mask_0d_on_4d", _call(torch.tensor(0.5)), r"attn_mask of shape \(\) has no"),
    ("mask_1d_on_4d_gqa", _call(_mask(S), k=(B, 2, S, E), enable_gqa=True), r"has no"),
    ("mask_4d_on_3d", _call(_mask(B, 1, L, S), q=(B, L, E), k=(B, S, E)), r"\(1, 2, 5, 7\)"),
    ("mask_3d_on_2d", _call(_mask(1, L, S), q=(L, E), k=(S, E)), r"does not broadcast"),
    ("mask_not_tensor", _call([[True]]), r"'attn_mask' must be Tensor or None, not list"),
    ("query_not_tensor", _replacing(_call(), 0, lambda q, k, v: [1.0]), r"'query' must be Tensor"),
    ("dropout_negative", _call(None, -0.1), r"dropout_p must be in \[0, 1\], got -0.1"),
    ("dropout_above_1", _call(None, 1.5), r"dropout_p must be in \[0, 1\], got 1.5"),
    ("dropout_nan", _call(None, float("nan")), r"got nan"),
    ("dropout_str", _call(None, "0"), r"'dropout_p' must be float, not str"),
    ("dropout_1d_tensor", _call(None, torch.zeros(1)), r"'dropout_p' must be float, not Tensor"),
    ("scale_str", _call(scale="0.5"), r"'scale' must be float, not str"),
    ("scale_positional", _call(None, 0.0, False, 0.5), r"positional argument"),
    ("is_causal_int", _call(is_causal=1), r"'is_causal' must be bool, not int"),
    ("is_causal_none", _call(is_causal=None), r"'is_causal' must be bool, not NoneType"),
    ("enable_gqa_int", _call(enable_gqa=1), r"'enable_gqa' must be bool, not int"),
    # Where torch computes: equal outputs and gradients.
    ("2d", _call(q=(L, E), k=(S, E)), None),
    ("2d_causal", _call(q=(L, E), k=(S, E), is_causal=True), None),
    ("3d_mask", _call(_mask(B, L, S), q=(B, L, E), k=(B, S, E)), None),
    ("3d_mask_with_leading_1", _call(_mask(1, B, L, S), q=(B, L, E), k=(B, S, E)), None),
    ("3d_mask_1d", _call(_mask(S), q=(B, L, E), k=(B, S, E)), None),
    ("5d", _call(q=(3, B, H, L, E), k=(3, B, H, S, E)), None),
    ("6d_causal", _call(q=(2, 3, B, H, L, E), k=(2, 3, B, H, S, E), is_causal=True), None),
    (
        "5d_mask",
        _call(_mask(3, 1, 1, L, S, dtype=torch.float64), q=(3, B, H, L, E), k=(3, B, H, S, E)),
        None,
    ),
    ("5d_mask_0d", _call(torch.tensor(True), q=(3, B, H, L, E), k=(3, B, H, S, E)), None),
    ("5d_kv_broadcast", _call(q=(3, B, H, L, E), k=(1, B, H, S, E)), None),
    ("5d_q_4d_kv", _call(q=(3, B, H, L, E), k=(B, H, S, E)), None),
    ("kv_batch_1", _call(k=(1, H, S, E)), None),
    ("q_batch_1", _call(q=(1, H, L, E)), None),
    ("2d_q_4d_kv", _call(q=(L, E)), None),
    ("4d_q_2d_kv", _call(k=(S, E)), None),
    ("3d_q_2d_k_3d_v", _call(q=(3, L, E), k=(S, E), v=(3, S, E)), None),
    ("kv_1_head_no_gqa", _call(k=(B, 1, S, E)), None),
    ("q_1_head_no_gqa", _call(q=(B, 1, L, E)), None),
    ("gqa_4_2", _call(k=(B, 2, S, E), enable_gqa=True), None),
    ("gqa_4_2_causal", _call(k=(B, 2, S, E), enable_gqa=True, is_causal=True), None),
    ("gqa_k2_v1", _call(k=(B, 2, S, E), v=(B, 1, S, E), enable_gqa=True), None),
    ("gqa_5d_kv_broadcast", _call(q=(3, B, H, L, E), k=(1, B, 2, S, E), enable_gqa=True), None),
    ("gqa_3d", _call(q=(H, L, E), k=(2, S, E), enable_gqa=True), None),
    ("gqa_equal_heads", _call(enable_gqa=True), None),
    ("value_dim_differs", _call(v=(B, H, S, 12)), None),
    ("causal_more_queries", _call(q=(B, H, 9, E), k=(B, H, 3, E), is_causal=True), None),
    ("causal_more_keys", _call(is_causal=True), None),
    ("mask_1d_kv_batch_1", _call(_mask(S), k=(1, H, S, E)), None),
    ("mask_3d_on_4d", _call(_mask(H, L, S)), None),
    ("mask_f32_on_f64", _call(_mask(B, 1, L, S, dtype=torch.float32)), None),
    ("mask_f32_on_bf16", _call(_mask(L, S, dtype=torch.float32), dtype=torch.bfloat16), None),
    ("fully_masked_rows", _call(_fully_masked_rows()), None),
    ("fully_masked_rows_additive", _call(_additive_fully_masked_rows()), None),
    ("dropout_1", _call(None, 1.0), None),
    ("dropout_int_0", _call(None, 0), None),
    ("dropout_0d_tensor", _call(None, torch.tensor(0.0)), None),
    ("scale_int", _call(scale=2), None),
    ("scale_0", _call(scale=0.0), None),
    ("scale_negative", _call(scale=-0.5), None),
    ("scale_0d_tensor", _call(scale=torch.tensor(0.25)), None),
    ("strided_last_dim", _replacing(_call(), 0, _strided_last_dim), None),
    (
        "bshd_views",
        _replacing(_call(), 0, lambda q, k, v: q.transpose(1, 2).contiguous().transpose(1, 2)),
        None,
    ),
    ("float32", _call(dtype=torch.float32, is_causal=True), None),
    ("float16", _call(dtype=torch.float16), None),
    ("batch_0", _call(q=(0, H, L, E), k=(0, H, S, E)), None),
    ("q_batch_0_kv_batch_1", _call(q=(0, H, L, E), k=(1, H, S, E)), None),
    ("heads_0", _call(q=(B, 0, L, E), k=(B, 0, S, E)), None),
    ("heads_0_gqa", _call(q=(B, 0, L, E), k=(B, 2, S, E), enable_gqa=True), None),
    ("no_queries", _call(q=(B, H, 0, E)), None),
    ("no_keys", _call(q=(B, H, L, E), k=(B, H, 0, E)), None),
    ("no_keys_causal", _call(k=(B, H, 0, E), is_causal=True), None),
    ("head_dim_0", _call(q=(B, H, L, 0), k=(B, H, S, 0), v=(B, H, S, E)), None),
    ("value_dim_0", _call(v=(B, H, S, 0)), None),
    # torch returns zeros shaped by query for no queries / no values before other checks.
    ("no_queries_bad_mask", _call(_mask(3, 9), q=(B, H, 0, E)), None),
    ("no_keys_bad_heads", _call(k=(B, 3, 0, E), enable_gqa=True), None),
    ("no_values_kv_batch_0", _call(q=(1, L, E), k=(0, S, E)), None),
    ("no_queries_dropout_above_1", _call(None, 1.5, q=(B, H, 0, E)), None),
    ("no_queries_int", _call(q=(B, 0, E), k=(B, S, E), dtype=torch.int32), None),
]


def _outcome(sdpa, args, kwargs):
    """sdpa's result, the exception it raised, with the gradients of q, k, v (None where
    not differentiable) from backward of a fixed random weighting of the output."""
    args = list(args)
    leaves = []
    for index in range(3):
        tensor = args[index]
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            args[index] = tensor.detach().clone().requires_grad_()
            leaves.append(args[index])
    try:
        out = sdpa(*args, **kwargs)
    except Exception as error:  # the class is what is compared
        return error, None
    if not (leaves and out.requires_grad):
        return out.detach(), None
    weights = torch.randn(out.shape, generator=seeded_generator(3)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, weights, allow_unused=True)
    return out.detach(), grads


def _tolerance(dtype):
    if dtype == torch.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 2e-2, "atol": 2e-2}  # the half types: rounding of the output


@pytest.mark.cpu_only  # torch's CPU behaviour is the specification
@pytest.mark.parametrize(
    "build, pattern", [case[1:] for case in SAME_AS_TORCH], ids=[case[0] for case in SAME_AS_TORCH]
)
def test_same_outcome_as_torch(build, pattern):
    args, kwargs = build()
    expected, expected_grads = _outcome(F.scaled_dot_product_attention, args, kwargs)
    actual, actual_grads = _outcome(mha_ext.scaled_dot_product_attention, args, kwargs)
    if isinstance(expected, Exception):
        assert isinstance(actual, type(expected)), f"torch raised {expected!r}, got {actual!r}"
        assert pattern is not None and re.search(pattern, str(actual)), str(actual)
        return
    assert pattern is None, f"torch returned where the table expects an error: {pattern}"
    assert not isinstance(actual, Exception), f"torch returned, mha_ext raised {actual!r}"
    assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype)
    torch.testing.assert_close(actual, expected, **_tolerance(expected.dtype))
    assert (actual_grads is None) == (expected_grads is None)
    for actual_grad, expected_grad in zip(actual_grads or (), expected_grads or ()):
        torch.testing.assert_close(actual_grad, expected_grad, **_tolerance(expected.dtype))


# Where mha_ext raises and torch does not, on purpose: (id, build, class, pattern, torch
# returns a result). torch's result for these is garbage (reads past value's rows, NaN
# scores) or a crash, or needs what the kernels do not compute (the mask's gradient).
DEPARTURES = [
    (
        "key_value_lengths_differ",
        _call(v=(B, H, S - 1, E)),
        RuntimeError,
        r"key and value must share the source length S",
        False,
    ),
    (
        "head_dim_above_256",
        _call(q=(1, 1, 3, 300), k=(1, 1, 3, 300)),
        RuntimeError,
        r"must not exceed 256",
        True,
    ),
    ("scale_nan", _call(scale=float("nan")), RuntimeError, r"scale must be finite, got nan", True),
    ("scale_inf", _call(scale=float("inf")), RuntimeError, r"scale must be finite, got inf", True),
    (
        "mask_requires_grad",
        _call(_mask(L, S, dtype=torch.float64).requires_grad_()),
        ValueError,
        r"attn_mask requires grad",
        True,
    ),
    # torch divides by key's 0 heads: the process dies of SIGFPE.
    (
        "gqa_zero_kv_heads",
        _call(k=(B, 0, S, E), v=(B, 1, S, E), enable_gqa=True),
        RuntimeError,
        r"divide query's 4 heads, got key with 0",
        False,
    ),
    # torch's math path (taken here for the broadcast batch) skips dropout_p <= 0 unchecked.
    (
        "negative_dropout_broadcast_batch",
        _call(None, -0.1, k=(1, H, S, E)),
        RuntimeError,
        r"dropout_p must be in \[0, 1\], got -0.1",
        True,
    ),
]


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "build, error, pattern, torch_returns",
    [case[1:] for case in DEPARTURES],
    ids=[case[0] for case in DEPARTURES],
)
def test_documented_departures_from_torch(build, error, pattern, torch_returns):
    args, kwargs = build()
    if torch_returns:
        F.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises(error, match=pattern):
        mha_ext.scaled_dot_product_attention(*args, **kwargs)


def test_nested_tensors_are_refused():
    nested = torch.nested.nested_tensor(
        [torch.randn(H, 3, E), torch.randn(H, 6, E)], layout=torch.jagged
    )
    with pytest.raises(RuntimeError, match=r"nested tensors are not supported"):
        mha_ext.scaled_dot_product_attention(nested, nested, nested)


def _random_case(rng: random.Random):
    """Random q / k / v / mask shapes around one (..., L, S) problem: leading dims dropped or
    set to 1 (broadcast), GQA heads, masks of every rank, empty sizes, causal, scale."""
    lead = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4)))
    seq_q, seq_k = rng.choice([0, 1, 3, 5]), rng.choice([0, 1, 4, 6])
    head_dim = rng.choice([0, 2, 8])
    head_dim_v = rng.choice([head_dim, 3])

    def lead_of():
        dims = list(lead[len(lead) - rng.randint(0, len(lead)) :])
        return tuple(1 if rng.random() < 0.25 else size for size in dims)

    leads = [lead_of() for _ in range(3)]
    kwargs = {}
    if rng.random() < 0.3 and all(leads):
        kwargs["enable_gqa"] = True
        kv_heads = rng.choice([1, 2, 3])
        leads = [
            leads[0][:-1] + (rng.choice([2, 4, 6]),),
            leads[1][:-1] + (kv_heads,),
            leads[2][:-1] + (rng.choice([kv_heads, 1, 2]),),
        ]
    q = _randn(*leads[0], seq_q, head_dim)
    k = _randn(*leads[1], seq_k, head_dim)
    v = _randn(*leads[2], seq_k, head_dim_v)
    choice = rng.random()
    if choice < 0.25:
        kwargs["is_causal"] = True
    elif choice < 0.7:
        weights = lead + (seq_q, seq_k)
        rank = rng.randint(0, len(weights) + 1)
        shape = [1 if rng.random() < 0.3 else size for size in ((2,) + weights)[-rank:]]
        kwargs["attn_mask"] = _mask(*shape, dtype=rng.choice([torch.bool, torch.float64]))
    if rng.random() < 0.3:
        kwargs["scale"] = rng.choice([0.0, 0.3, 2.0])  # negative: see the test below
    return (q, k, v), kwargs


@pytest.mark.cpu_only
def test_random_shapes_same_outcome_as_torch():
    rng = random.Random(0)
    outcomes = {"raised": 0, "returned": 0}
    for _ in range(300):
        args, kwargs = _random_case(rng)
        expected, expected_grads = _outcome(F.scaled_dot_product_attention, args, kwargs)
        actual, actual_grads = _outcome(mha_ext.scaled_dot_product_attention, args, kwargs)
        case = f"{[tuple(t.shape) for t in args]} {kwargs}"
        if isinstance(expected, Exception):
            assert isinstance(actual, type(expected)), f"{case}: {expected!r} vs {actual!r}"
            outcomes["raised"] += 1
            continue
        assert not isinstance(actual, Exception), f"{case}: mha_ext raised {actual!r}"
        assert actual.shape == expected.shape, case
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=case)
        for actual_grad, expected_grad in zip(actual_grads or (), expected_grads or ()):
            torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-10, atol=1e-10)
        outcomes["returned"] += 1
    # Both kinds of outcome are exercised in numbers (seeded: 300 cases).
    assert min(outcomes.values()) >= 20, outcomes


@pytest.mark.cpu_only
def test_causal_with_negative_scale_follows_torch_math_path():
    # torch 2.14's CPU flash kernel returns NaN for is_causal with a negative scale; its
    # math path, like mha_ext, gives the softmax of the negated scores.
    q, k, v = _qkv()
    kwargs = {"is_causal": True, "scale": -0.5}
    assert F.scaled_dot_product_attention(q, k, v, **kwargs).isnan().all()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    actual = mha_ext.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


# scaled_dot_product_attention's one-call way (ops.sdpa_in_kernel_layout) must give, bit for
# bit, what its checked Python path gives, and must decline whatever that path adapts.
KERNEL_LAYOUT_CASES = {
    "decode_row": (dict(heads=4, kv_heads=4, seq_q=1, seq_k=37, head_dim=64), {}),
    "causal": (dict(heads=4, kv_heads=4, seq_q=9, seq_k=9, head_dim=80), {"is_causal": True}),
    "scale": (dict(heads=2, kv_heads=2, seq_q=5, seq_k=11, head_dim=32), {"scale": 0.3}),
    "gqa": (dict(heads=8, kv_heads=2, seq_q=3, seq_k=21, head_dim=48), {"enable_gqa": True}),
    "bshd_views": (
        dict(heads=4, kv_heads=4, seq_q=6, seq_k=6, head_dim=32, layout="bshd"),
        {"is_causal": True},
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(KERNEL_LAYOUT_CASES))
def test_kernel_layout_call_equals_checked_path(name, dtype):
    shape, kwargs = KERNEL_LAYOUT_CASES[name]
    shape = dict(shape)
    layout = shape.pop("layout", "bhsd")
    q, k, v = random_qkv(2, *shape.values(), dtype=dtype, layout=layout)
    direct = mha_ext.ops.sdpa_in_kernel_layout(
        q,
        k,
        v,
        kwargs.get("is_causal", False),
        kwargs.get("scale"),
        kwargs.get("enable_gqa", False),
    )
    assert direct is not None, "inputs in the kernels' layout took the checked path"
    # mha_ext.attention runs the same kernel after the checks, with the default scale
    # computed in Python.
    scale = kwargs.get("scale", q.shape[-1] ** -0.5)
    checked = mha_ext.attention(
        q, k, v, causal="top_left" if kwargs.get("is_causal") else None, scale=scale
    )
    assert torch.equal(direct, checked)
    assert torch.equal(mha_ext.scaled_dot_product_attention(q, k, v, **kwargs), checked)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(direct, expected, **_tolerance(dtype))


def test_kernel_layout_call_records_gradients():
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 8, 2, 4, 19, 32))
    out = mha_ext.ops.sdpa_in_kernel_layout(q, k, v, True, None, True)
    assert out is not None and out.requires_grad
    weights = torch.randn(out.shape, generator=seeded_generator(5))
    grads = torch.autograd.grad(out, (q, k, v), weights)
    expected_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected_out, (q, k, v), weights)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


class _TracedTensor(torch.Tensor):
    """A subclass whose __torch_function__ the direct call would bypass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _declined_inputs():
    """(name, (query, key, value, is_causal, scale, enable_gqa)) the Python path must take."""
    q, k, v = random_qkv(2, 4, 4, 3, 7, 16)
    q_gqa, k_gqa, v_gqa = random_qkv(2, 4, 2, 3, 7, 16)
    return {
        "3d": (q[0], k[0], v[0], False, None, False),
        "broadcast_batch": (q, k[:1], v[:1], False, None, False),
        "heads_differ_without_gqa": (q_gqa, k_gqa, v_gqa, False, None, False),
        "gqa_kv_heads_differ": (q_gqa, k_gqa, v_gqa[:, :1], False, None, True),
        "strided_last_dim": (q, torch.randn(2, 4, 7, 32)[..., ::2], v, False, None, False),
        "column_major_key": (
            q,
            k.transpose(-1, -2).contiguous().transpose(-1, -2),
            v,
            False,
            None,
            False,
        ),
        "mixed_dtypes": (q, k.double(), v, False, None, False),
        "integer_dtype": (q.long(), k.long(), v.long(), False, None, False),
        "no_queries": (q[:, :, :0], k, v, False, None, False),
        "no_keys": (q, k[:, :, :0], v[:, :, :0], False, None, False),
        "zero_head_dim": (q[..., :0], k[..., :0], v, False, None, False),
        "int_scale": (q, k, v, False, 1, False),
        "tensor_scale": (q, k, v, False, torch.tensor(0.5), False),
        "non_bool_causal": (q, k, v, 1, None, False),
        "function_subclass": (q.as_subclass(_TracedTensor), k, v, False, None, False),
        "not_a_tensor": (q.tolist(), k, v, False, None, False),
    }


@pytest.mark.parametrize("name", list(_declined_inputs()))
def test_kernel_layout_call_declines_what_the_checks_adapt(name):
    args = _declined_inputs()[name]
    assert mha_ext.ops.sdpa_in_kernel_layout(*args) is None

"""Semantics at the edges, as the README's "Edge cases" section states them: non-finite
inputs (which rows they reach), rows that see no key, empty tensors, scale 0 and negative,
head_dim 1. Where mha_ext mirrors torch's SDPA, the test compares with torch."""

import pytest
import torch
import torch.nn.functional as F

import mha_ext
from mha_ext.reference import attention_reference

from conftest import seeded_generator

NAN, INF = float("nan"), float("inf")


def qkv(batch=1, heads=2, seq_q=200, seq_k=200, head_dim=64, dtype=torch.float32, seed=0):
    generator = seeded_generator(seed)
    return (
        torch.randn(batch, heads, seq, head_dim, generator=generator).to(dtype)
        for seq in (seq_q, seq_k, seq_k)
    )


def nonfinite_rows(out):
    """Query rows (of batch 0, head 0) with a non-finite output element."""
    return set((~torch.isfinite(out[0, 0])).any(-1).nonzero().flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_nonfinite_query_reaches_only_its_own_row(dtype, value):
    q, k, v = qkv(dtype=dtype)
    q[0, 0, 70, 5] = value
    out = mha_ext.attention(q, k, v)
    assert nonfinite_rows(out) == {70}
    clean = mha_ext.attention(qkv(dtype=dtype).__next__(), k, v)
    assert torch.equal(out[:, :, :70], clean[:, :, :70])
    assert torch.equal(out[:, 1], clean[:, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_key_reaches_exactly_the_rows_that_see_it(dtype):
    # Causal top-left: key 130 is seen by rows 130.. only; rows before keep their values.
    q, k, v = qkv(dtype=dtype)
    k[0, 0, 130, 9] = NAN
    out = mha_ext.attention(q, k, v, causal="top_left")
    assert nonfinite_rows(out) == set(range(130, 200))
    assert torch.isfinite(out[:, 1]).all()
    # torch's SDPA (CPU flash) agrees row for row.
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert nonfinite_rows(expected) == nonfinite_rows(out)


def test_infinite_key_gives_nan_where_its_score_is_plus_inf_and_is_ignored_where_minus_inf():
    q, k, v = qkv(seq_q=6, seq_k=6, head_dim=8)
    q[0, 0, :, 3] = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5])
    k[0, 0, 2, 3] = INF  # score +inf for rows 0, 2, 4; -inf for rows 1, 3, 5
    out = mha_ext.attention(q, k, v)
    assert nonfinite_rows(out) == {0, 2, 4}
    k_without = torch.cat([k[:, :, :2], k[:, :, 3:]], 2)
    v_without = torch.cat([v[:, :, :2], v[:, :, 3:]], 2)
    reference, _ = attention_reference(q.double(), k_without.double(), v_without.double())
    torch.testing.assert_close(out[0, 0, 1::2], reference[0, 0, 1::2].float())
    assert nonfinite_rows(F.scaled_dot_product_attention(q, k, v)) == {0, 2, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value", [NAN, INF])
def test_nonfinite_value_reaches_the_rows_that_see_it_and_not_the_far_ones(dtype, value):
    # A window of 10 keys each side: rows 140..160 see key 150. Rows that do not see it but
    # multiply its key tile by weights of 0 may turn NaN too (0 x inf), as torch's kernels
    # do: every row of a 64-row query block that reads the tile. Rows 0..63 see keys up to
    # 73 only, so their block never reads the tile of key 150 (tiles start at multiples of 64
    # keys) and stays clean.
    q, k, v = qkv(dtype=dtype)
    v[0, 0, 150, 3] = value
    out = mha_ext.attention(q, k, v, window=(10, 10))
    rows = nonfinite_rows(out)
    assert set(range(140, 161)) <= rows
    assert not rows & set(range(64)), sorted(rows & set(range(64)))
    assert torch.isfinite(out[:, 1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fully_masked_additive_rows_give_zero_and_zero_gradients(dtype):
    q, k, v = (t.requires_grad_() for t in qkv(seq_q=9, seq_k=11, head_dim=16, dtype=dtype))
    mask = torch.zeros(1, 1, 9, 11, dtype=dtype)
    mask[..., 4, :] = -INF
    out, lse = mha_ext.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4]))
    assert torch.equal(lse[:, :, 4], torch.full_like(lse[:, :, 4], -INF))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 4], torch.zeros_like(q.grad[:, :, 4]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # torch gives 0 for such rows too (forward and the drop-in).
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ours = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(expected[:, :, 4], ours[:, :, 4])


def test_a_row_whose_scores_are_all_minus_inf_gives_zero():
    # q row 2 of -inf against keys whose dim 0 is positive: every score is -inf.
    q, k, v = qkv(seq_q=4, seq_k=5, head_dim=8)
    k[..., 0] = k[..., 0].abs() + 0.1
    q[0, 0, 2] = 0.0
    q[0, 0, 2, 0] = -INF
    out, lse = mha_ext.attention(q, k, v, return_lse=True)
    assert torch.equal(out[0, 0, 2], torch.zeros(8))
    assert lse[0, 0, 2].item() == -INF


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [
        ((1, 2, 0, 8), (1, 2, 5, 8)),  # no queries
        ((1, 2, 4, 8), (1, 2, 0, 8)),  # no keys: zeros, lse -inf
        ((0, 2, 4, 8), (0, 2, 5, 8)),  # no batch
        ((1, 2, 4, 0), (1, 2, 5, 0)),  # head_dim 0
    ],
    ids=["no_queries", "no_keys", "no_batch", "head_dim_0"],
)
def test_empty_tensors_match_torch(q_shape, kv_shape):
    q, k, v = (torch.randn(shape).requires_grad_() for shape in (q_shape, kv_shape, kv_shape))
    out, lse = mha_ext.attention(q, k, v, return_lse=True)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == expected.shape and torch.equal(out, expected)
    # lse: -inf for rows with no keys, log(keys) for head_dim 0 (every score is 0).
    _, reference_lse = attention_reference(*(t.detach().double() for t in (q, k, v)))
    torch.testing.assert_close(lse.double(), reference_lse)
    assert torch.equal(mha_ext.scaled_dot_product_attention(q, k, v), expected)
    out.sum().backward()
    for tensor in (q, k, v):
        assert torch.equal(tensor.grad, torch.zeros_like(tensor))


def test_head_dim_0_averages_the_visible_values():
    q, k = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 6, 0)
    v = torch.randn(1, 2, 6, 3)
    out = mha_ext.attention(q, k, v, causal="bottom_right")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 6).tril(2).bool())
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("causal", [None, "top_left"])
def test_scale_zero_averages_the_visible_values(causal):
    q, k, v = qkv(seq_q=70, seq_k=70, head_dim=32)
    out = mha_ext.attention(q, k, v, scale=0.0, causal=causal)
    if causal is None:
        expected = v.mean(2, keepdim=True).expand_as(out)
    else:
        expected = v.cumsum(2) / torch.arange(1, 71).view(1, 1, 70, 1)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("causal", [None, "top_left"])
def test_negative_scale_is_the_softmax_of_the_scaled_scores(causal):
    q, k, v = (t.requires_grad_() for t in qkv(seq_q=70, seq_k=90, head_dim=32))
    out = mha_ext.attention(q, k, v, scale=-0.3, causal=causal)
    reference, _ = attention_reference(
        *(t.detach().double().requires_grad_() for t in (q, k, v)), scale=-0.3, causal=causal
    )
    torch.testing.assert_close(out, reference.float(), atol=1e-5, rtol=1e-5)
    # torch's math path agrees (its CPU flash kernel gives NaN for causal with scale < 0).
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, scale=-0.3, is_causal=causal is not None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_dim_1_forward_and_backward(dtype):
    q, k, v = (
        t.requires_grad_() for t in qkv(batch=2, seq_q=33, seq_k=47, head_dim=1, dtype=dtype)
    )
    grad_out = torch.randn(2, 2, 33, 1).to(dtype)
    out = mha_ext.attention(q, k, v, causal="bottom_right")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference, _ = attention_reference(*leaves, causal="bottom_right")
    reference_grads = torch.autograd.grad(reference, leaves, grad_out.double())
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    )
    torch.testing.assert_close(out.double(), reference, **tolerance)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got.double(), want, **tolerance)

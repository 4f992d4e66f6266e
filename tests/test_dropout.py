"""Fused dropout: keep rate, reproducibility, the mask the kernels apply, and gradients that
use the same regenerated mask."""

import math

import pytest
import torch

import mha_ext
from mha_ext.reference import attention_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv


def applied_keep_mask(batch, heads, seq_k, dropout_p, seed):
    """Reads back the mask an attention call applied: with q = k = 0 every key gets weight
    1 / Sk, and with V = I the output row is the row of scaled kept weights."""
    q = torch.zeros(batch, heads, seq_k, 16)
    k = torch.zeros(batch, heads, seq_k, 16)
    v = torch.eye(seq_k).expand(batch, heads, seq_k, seq_k)
    torch.manual_seed(seed)
    out = mha_ext.attention(q, k, v, dropout_p=dropout_p)
    scaled = out * seq_k * (1.0 - dropout_p)  # 1 where kept, 0 where dropped
    assert torch.allclose(scaled, scaled.round(), atol=1e-4)
    return scaled.round().bool()


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_rate_matches_probability(dropout_p):
    seed = torch.tensor([12345], dtype=torch.int64)
    keep = mha_ext.dropout_mask(seed, 2, 4, 128, 256, dropout_p)
    count = keep.numel()
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / count)
    assert abs(keep.float().mean().item() - (1 - dropout_p)) < 6 * sigma
    # Heads, batches and rows draw independent masks.
    assert not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_attention_applies_the_mask_dropout_mask_reports(device):
    dropout_p = 0.3
    applied = applied_keep_mask(2, 3, 200, dropout_p, seed=5)
    torch.manual_seed(5)
    reported = mha_ext.dropout_mask(mha_ext.draw_dropout_seed(device), 2, 3, 200, 200, dropout_p)
    assert torch.equal(applied, reported)


def test_manual_seed_makes_dropout_reproducible():
    q, k, v = random_qkv(2, 4, 2, 50, 70, 32)
    torch.manual_seed(0)
    first = mha_ext.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(0)
    second = mha_ext.attention(q, k, v, dropout_p=0.2)
    third = mha_ext.attention(q, k, v, dropout_p=0.2)
    assert torch.equal(first, second)
    assert not torch.equal(second, third)
    assert not torch.equal(first, mha_ext.attention(q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"causal": "bottom_right"}, {"window": (20, 3)}],
    ids=["plain", "causal", "window"],
)
def test_forward_and_gradients_use_the_regenerated_mask(dtype, kwargs, device):
    dropout_p = 0.25
    # 301 query rows: more than one chunk of the bf16 backward's dK / dV products (4 blocks).
    q, k, v = random_qkv(2, 8, 2, 301, 90, 48, dtype=dtype)
    torch.manual_seed(11)
    keep = mha_ext.dropout_mask(mha_ext.draw_dropout_seed(device), 2, 8, 301, 90, dropout_p)
    grad_out = torch.randn(2, 8, 301, 48).to(dtype)

    def run(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        return [out] + [leaf.grad for leaf in leaves]

    torch.manual_seed(11)
    fused = run(lambda *t: mha_ext.attention(*t, dropout_p=dropout_p, **kwargs), (q, k, v))
    reference = run(
        lambda *t: attention_reference(*t, dropout_keep=keep, dropout_p=dropout_p, **kwargs)[0],
        (q.double(), k.double(), v.double()),
    )
    plain = run(
        lambda *t: attention_reference(*t, dropout_keep=keep, dropout_p=dropout_p, **kwargs)[0],
        (q, k, v),
    )
    for name, actual, ref, pl, factor in zip(
        ["out", "grad_q", "grad_k", "grad_v"],
        fused,
        reference,
        plain,
        [OUTPUT_FACTOR, GRAD_FACTOR, GRAD_FACTOR, GRAD_FACTOR],
    ):
        assert_within_rule(actual, ref, pl, factor, name)


def test_gradcheck_with_dropout():
    q, k, v = random_qkv(1, 2, 1, 7, 11, 8, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]

    def fn(*t):
        torch.manual_seed(3)  # the same mask at every evaluation
        return mha_ext.attention(*t, dropout_p=0.4, causal="bottom_right")

    assert torch.autograd.gradcheck(fn, inputs)


def test_one_seed_draws_one_mask_on_every_device(device):
    # The CPU and CUDA kernels share the Philox counters (mha_ext/philox.h), and attention on
    # this device applies exactly the mask the CPU reports for the same seed value.
    seed = torch.tensor([987654321], dtype=torch.int64)
    on_cpu = mha_ext.dropout_mask(seed.cpu(), 2, 3, 37, 45, 0.4)
    assert torch.equal(mha_ext.dropout_mask(seed, 2, 3, 37, 45, 0.4).cpu(), on_cpu)
    q, k, v = random_qkv(2, 3, 3, 37, 45, 16)
    v = torch.eye(45).expand(2, 3, 45, 45)  # out = P after dropout, so the zeros show the mask
    k = torch.zeros_like(k)  # uniform P = 1 / 45 before dropout
    out, _ = torch.ops.mha_ext.attention_forward(q, k, v, None, seed, 0.4, 1.0, -1, -1, False)
    assert torch.equal((out != 0).cpu(), on_cpu)

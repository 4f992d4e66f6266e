"""Op registration: opcheck for every op, and the ops inside torch.compile(fullgraph=True)."""
import pytest
import torch

import mha_ext
from mha_ext import ops

from conftest import random_qkv


def attention_cases():
    q, k, v = random_qkv(2, 4, 2, 9, 13, 16, head_dim_v=8)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.randn(2, 1, 9, 13)
    seed = torch.tensor([42], dtype=torch.int64)
    return [
        (q, k, v, None, None, 0.0, 0.25, -1, -1, False),
        (*grad, None, None, 0.0, 0.25, -1, 0, True),
        (*grad, mask, seed, 0.3, 0.5, 4, 0, False),
        (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask > 0, None, 0.0, 0.25, 3, 2, True),
    ]


@pytest.mark.parametrize("case", range(4))
def test_opcheck_attention_forward(case):
    torch.library.opcheck(torch.ops.mha_ext.attention_forward.default, attention_cases()[case])


def test_opcheck_attention_backward():
    q, k, v = random_qkv(2, 4, 2, 9, 13, 16)
    seed = torch.tensor([7], dtype=torch.int64)
    options = (torch.randn(2, 1, 9, 13), seed, 0.2, 0.25, -1, 0, True)
    out, lse = ops.attention_forward(q, k, v, *options)
    args = (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *options)
    torch.library.opcheck(torch.ops.mha_ext.attention_backward.default, args)


def test_opcheck_dropout_mask():
    seed = torch.tensor([3], dtype=torch.int64)
    torch.library.opcheck(torch.ops.mha_ext.dropout_mask.default, (seed, 2, 3, 5, 7, 0.25))


def test_compile_fullgraph_forward_and_backward():
    layer = mha_ext.MultiHeadAttention(64, 8, dropout=0.0, num_kv_heads=2)
    x = torch.randn(2, 33, 64)

    def step(x):
        out = layer(x, x, x, is_causal=True)
        return out, mha_ext.attention(*(x.unflatten(-1, (8, 8)).transpose(1, 2),) * 3, window=(4, 4))

    compiled = torch.compile(step, fullgraph=True)
    eager_out, eager_windowed = step(x)
    compiled_out, compiled_windowed = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(compiled_windowed, eager_windowed)
    compiled_out.sum().backward()
    grad = layer.w_q.weight.grad.clone()
    layer.zero_grad()
    eager_out.sum().backward()
    torch.testing.assert_close(grad, layer.w_q.weight.grad)


def test_compile_fullgraph_with_dropout_is_reproducible():
    q, k, v = random_qkv(1, 4, 4, 20, 20, 16)
    compiled = torch.compile(lambda q, k, v: mha_ext.attention(q, k, v, dropout_p=0.3), fullgraph=True)
    torch.manual_seed(9)
    first = compiled(q, k, v)
    torch.manual_seed(9)
    second = compiled(q, k, v)
    assert torch.equal(first, second)
    assert not torch.equal(first, compiled(q, k, v))

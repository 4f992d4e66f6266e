"""mha_ext.scaled_dot_product_attention as a drop-in for torch's, and the reference itself
checked against torch's math path."""

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


def test_mask_and_is_causal_together_apply_both():
    # torch rejects this combination; the drop-in applies the mask inside the causal window.
    q, k, v = random_qkv(2, 4, 4, 13, 13, 16, dtype=torch.float64)
    mask = torch.rand(13, 13, generator=seeded_generator(1)) > 0.3
    expected, _ = attention_reference(q, k, v, causal="top_left", attn_mask=mask)
    actual = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)

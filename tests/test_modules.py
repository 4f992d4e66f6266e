"""MultiHeadAttention: seed compatibility, GQA/MQA, masks, weights, head masks, presets."""

import pytest
import torch

import mha_ext
from mha_ext.reference import MultiHeadAttentionReference


def pair(d_model=64, num_heads=8, num_kv_heads=None, bias=False):
    """A fused module and the naive reference module with the same weights."""
    fused = mha_ext.MultiHeadAttention(
        d_model, num_heads, dropout=0.1, num_kv_heads=num_kv_heads, bias=bias
    )
    naive = MultiHeadAttentionReference(
        d_model, num_heads, dropout=0.1, num_kv_heads=num_kv_heads, bias=bias
    )
    naive.load_state_dict(fused.state_dict())
    return fused.eval(), naive.eval()


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_naive_module(num_kv_heads, bias):
    fused, naive = pair(num_kv_heads=num_kv_heads, bias=bias)
    q, k = torch.randn(3, 10, 64), torch.randn(3, 14, 64)
    torch.testing.assert_close(fused(q, k, k), naive(q, k, k), rtol=1e-5, atol=1e-5)


def test_seed_state_dict_loads_unchanged():
    fused, naive = pair()
    assert list(fused.state_dict()) == ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]
    assert fused.state_dict().keys() == naive.state_dict().keys()


def test_seed_mask_convention():
    fused, naive = pair(num_kv_heads=4)
    x = torch.randn(2, 9, 64)
    padding = torch.ones(2, 1, 1, 9)
    padding[1, ..., 6:] = 0  # last three tokens of sequence 1 are padding
    causal = torch.tril(torch.ones(9, 9)).view(1, 1, 9, 9)
    for mask in (padding, causal, padding * causal):
        torch.testing.assert_close(fused(x, x, x, mask), naive(x, x, x, mask), rtol=1e-5, atol=1e-5)


def test_is_causal_equals_lower_triangular_mask():
    fused, _ = pair()
    x = torch.randn(2, 12, 64)
    tril = torch.tril(torch.ones(12, 12))
    torch.testing.assert_close(
        fused(x, x, x, is_causal=True), fused(x, x, x, tril), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_need_weights_returns_per_head_probabilities(num_kv_heads):
    fused, _ = pair(num_kv_heads=num_kv_heads)
    x = torch.randn(2, 7, 64)
    mask = torch.ones(2, 1, 1, 7)
    mask[0, ..., 5:] = 0
    out, weights = fused(x, x, x, mask, need_weights=True)
    assert weights.shape == (2, 8, 7, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 8, 7))
    assert (weights[0, :, :, 5:] == 0).all()
    # The weights are the ones the output was built from.
    value = fused._split_heads(fused.w_v(x), fused.num_kv_heads).repeat_interleave(
        8 // fused.num_kv_heads, 1
    )
    rebuilt = fused.w_o((weights @ value).transpose(1, 2).reshape(2, 7, 64))
    torch.testing.assert_close(rebuilt, out, rtol=1e-5, atol=1e-5)


def test_head_mask_switches_heads_off():
    fused, _ = pair()
    x = torch.randn(2, 6, 64)
    head_mask = torch.ones(8)
    head_mask[3] = 0
    out, weights = fused(x, x, x, need_weights=True, head_mask=head_mask)
    assert (weights[:, 3] == 0).all() and (weights[:, 2] != 0).any()
    # Zeroing head 3 equals zeroing its slice of the output projection's input.
    pruned = torch.nn.Linear(64, 64, bias=False)
    pruned.weight.data = fused.w_o.weight.data.clone()
    pruned.weight.data[:, 3 * 8 : 4 * 8] = 0
    full_out = fused.w_o
    fused.w_o = pruned
    expected = fused(x, x, x)
    fused.w_o = full_out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    per_batch = torch.ones(2, 8)
    per_batch[1, 0] = 0
    _, weights = fused(x, x, x, need_weights=True, head_mask=per_batch)
    assert (weights[1, 0] == 0).all() and (weights[0, 0] != 0).any()


def test_dropout_only_in_training():
    layer = mha_ext.MultiHeadAttention(64, 8, dropout=0.5)
    x = torch.randn(2, 16, 64)
    layer.eval()
    assert torch.equal(layer(x, x, x), layer(x, x, x))
    layer.train()
    torch.manual_seed(0)
    first = layer(x, x, x)
    torch.manual_seed(0)
    assert torch.equal(first, layer(x, x, x))
    assert not torch.equal(first, layer(x, x, x))


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    layer = mha_ext.MultiHeadAttention(32, 4, dropout=0.0, num_kv_heads=2)
    x, target = torch.randn(4, 10, 32), torch.randn(4, 10, 32)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(layer(x, x, x, is_causal=True), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "name, d_model, heads, kv_heads, head_dim",
    [
        ("bert-base", 768, 12, 12, 64),
        ("gpt2-small", 768, 12, 12, 64),
        ("gpt3-175b", 12288, 96, 96, 128),
        ("llama2-7b", 4096, 32, 32, 128),
        ("llama2-70b", 8192, 64, 8, 128),
    ],
)
def test_presets(name, d_model, heads, kv_heads, head_dim):
    layer = mha_ext.MultiHeadAttention.from_preset(name, device="meta")
    assert (layer.d_model, layer.num_heads, layer.num_kv_heads, layer.d_k) == (
        d_model,
        heads,
        kv_heads,
        head_dim,
    )
    assert layer.w_k.weight.shape == (kv_heads * head_dim, d_model)
    assert mha_ext.PRESETS[name].head_dim == head_dim

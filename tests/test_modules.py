"""MultiHeadAttention: seed compatibility, GQA/MQA, masks, weights, head masks, presets,
score options (window, softcap, ALiBi, sinks), packed documents, the paged pass-through."""

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


# ---------------------------------------------------------------- score options


def scores_reference64(query, key, value, *, causal, window, softcap, slopes, sinks):
    """(B, H, Sq, Dv) attention in float64 with explicit scores, written from the issue's
    semantics: scale, softcap, ALiBi bias, window / causal masks, sinks in the denominator."""
    query, key, value = query.double(), key.double(), value.double()
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    seq_q, seq_k = query.shape[2], key.shape[2]
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(seq_q)[:, None] + seq_k - seq_q  # bottom-right diagonal
    distance = torch.arange(seq_k)[None, :] - row  # key minus the query's diagonal position
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * distance.abs()
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    hidden = torch.zeros(seq_q, seq_k, dtype=torch.bool)
    if left is not None:
        hidden |= distance < -left
    if right is not None:
        hidden |= distance > right
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], -1)
    probs = torch.softmax(scores, -1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ value


def module_reference64(layer, x, causal):
    """layer's forward on x (B, S, d_model) in float64, attention from scores_reference64."""
    weights = {name: p.double() for name, p in layer.named_parameters()}
    batch, seq, _ = x.shape

    def project(name, heads):  # (B, S, d_model) -> (B, heads, S, d_k)
        y = x.double() @ weights[f"{name}.weight"].T
        return y.view(batch, seq, heads, layer.d_k).transpose(1, 2)

    out = scores_reference64(
        project("w_q", layer.num_heads),
        project("w_k", layer.num_kv_heads),
        project("w_v", layer.num_kv_heads),
        causal=causal,
        window=layer.window,
        softcap=layer.softcap,
        slopes=layer.alibi_slopes,
        sinks=weights.get("sinks"),
    )
    return out.transpose(1, 2).reshape(batch, seq, -1) @ weights["w_o.weight"].T


OPTIONS = {
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "window": dict(window=(3, 1)),
    "all": dict(window=(4, None), softcap=1.5, alibi=True, sinks=True),
}


def optioned_layer(options, num_kv_heads=2, d_model=64, num_heads=8):
    layer = mha_ext.MultiHeadAttention(
        d_model, num_heads, dropout=0.0, num_kv_heads=num_kv_heads, **options
    ).eval()
    if layer.sinks is not None:
        with torch.no_grad():  # zero sinks are a special case; give each head its own
            layer.sinks.copy_(torch.linspace(-1.0, 2.0, num_heads))
    return layer


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_score_options_match_float64_semantics(name, causal):
    layer = optioned_layer(OPTIONS[name])
    # Scores of a few units: the softcaps of 1.5 and 2 bend them.
    x = 2.0 * torch.randn(2, 11, 64)
    out = layer(x, x, x, is_causal=causal)
    torch.testing.assert_close(
        out.double(), module_reference64(layer, x, causal), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name", ["softcap", "alibi", "sinks", "all"])
def test_score_options_gradients_match_float64(name):
    layer = optioned_layer(OPTIONS[name])
    x = (2.0 * torch.randn(2, 9, 64)).requires_grad_()
    grad_out = torch.randn(2, 9, 64)
    layer(x, x, x, is_causal=True).backward(grad_out)
    reference_layer = optioned_layer(OPTIONS[name])
    reference_layer.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    module_reference64(reference_layer, x64, True).backward(grad_out.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    for (param_name, param), reference_param in zip(
        layer.named_parameters(), reference_layer.parameters()
    ):
        # module_reference64 differentiates through float64 copies of the parameters.
        assert reference_param.grad is not None, param_name
        torch.testing.assert_close(
            param.grad, reference_param.grad, rtol=1e-4, atol=1e-5, msg=param_name
        )


def test_score_options_are_passed_to_attention(monkeypatch):
    layer = optioned_layer(OPTIONS["all"])
    calls = []
    attention = mha_ext.functional.attention

    def recording_attention(*args, **kwargs):
        calls.append(kwargs)
        return attention(*args, **kwargs)

    monkeypatch.setattr(mha_ext.functional, "attention", recording_attention)
    x = torch.randn(1, 5, 64)
    layer(x, x, x)
    (options,) = calls
    assert options["window"] == (4, None) and options["softcap"] == 1.5
    assert options["alibi_slopes"] is layer.alibi_slopes and options["sinks"] is layer.sinks


def test_sinks_are_a_zero_initialised_fp32_parameter_that_round_trips():
    layer = mha_ext.MultiHeadAttention(64, 8, sinks=True, dtype=torch.bfloat16)
    assert layer.sinks.dtype == torch.float32 and layer.sinks.shape == (8,)
    assert torch.equal(layer.sinks.detach(), torch.zeros(8)) and layer.sinks.requires_grad
    seed_keys = ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]
    assert list(layer.state_dict()) == ["sinks"] + seed_keys
    with torch.no_grad():
        layer.sinks.copy_(torch.arange(8.0))
    loaded = mha_ext.MultiHeadAttention(64, 8, sinks=True, dtype=torch.bfloat16)
    loaded.load_state_dict(layer.state_dict())
    assert torch.equal(loaded.sinks, layer.sinks)
    # A module without sinks refuses the extra key rather than dropping it silently.
    with pytest.raises(RuntimeError, match="sinks"):
        mha_ext.MultiHeadAttention(64, 8, dtype=torch.bfloat16).load_state_dict(layer.state_dict())


def test_zero_sinks_still_join_the_denominator():
    plain = mha_ext.MultiHeadAttention(64, 8, dropout=0.0).eval()
    with_sinks = mha_ext.MultiHeadAttention(64, 8, dropout=0.0, sinks=True).eval()
    with_sinks.load_state_dict({**plain.state_dict(), "sinks": torch.zeros(8)})
    x = torch.randn(1, 1, 64)  # one key of score s: weight 1 alone, e^s / (e^0 + e^s) with a sink
    query = plain._split_heads(plain.w_q(x), 8)  # (1, 8, 1, 8)
    key, value = plain._split_heads(plain.w_k(x), 8), plain._split_heads(plain.w_v(x), 8)
    score = (query * key).sum(-1, keepdim=True) * 8**-0.5  # (1, 8, 1, 1)
    torch.testing.assert_close(plain(x, x, x), plain.w_o(value.transpose(1, 2).reshape(1, 1, 64)))
    expected = (torch.sigmoid(score) * value).transpose(1, 2).reshape(1, 1, 64)
    torch.testing.assert_close(with_sinks(x, x, x), plain.w_o(expected))


def test_options_off_keep_the_seed_state_dict():
    layer = mha_ext.MultiHeadAttention(64, 8, alibi=True, window=(8, 0), softcap=30.0)
    assert list(layer.state_dict()) == ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]
    assert layer.sinks is None and "alibi_slopes" in dict(layer.named_buffers())


@pytest.mark.parametrize(
    "num_heads, expected_exponents",
    [
        (8, [1, 2, 3, 4, 5, 6, 7, 8]),
        # 2^(-8 i / 4) for the largest power of two, 4, then odd steps of 2^(-8 j / 8).
        (6, [2, 4, 6, 8, 1, 3]),
        (12, [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]),
        (1, [8]),
    ],
)
def test_alibi_slopes_follow_the_paper(num_heads, expected_exponents):
    expected = torch.tensor([2.0**-e for e in expected_exponents], dtype=torch.float64)
    slopes = mha_ext.modules.alibi_slopes(num_heads)
    assert slopes.dtype == torch.float32
    torch.testing.assert_close(slopes.double(), expected, rtol=1e-7, atol=0)
    layer = mha_ext.MultiHeadAttention(8 * num_heads, num_heads, alibi=True)
    assert torch.equal(layer.alibi_slopes, slopes)
    layer.to(torch.bfloat16)  # casts the projections, not the slopes
    assert layer.w_q.weight.dtype == torch.bfloat16 and torch.equal(layer.alibi_slopes, slopes)
    assert layer.to("meta").alibi_slopes.device.type == "meta"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=(4,)), "window must be a pair"),
        (dict(window=(-2, 0)), "window must be a pair"),
        (dict(window=(4.5, 0)), "window must be a pair"),
        (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
        (dict(softcap=float("inf")), "softcap must be a finite number >= 0"),
    ],
)
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mha_ext.MultiHeadAttention(64, 8, **kwargs)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        mha_ext.modules.alibi_slopes(0)


@pytest.mark.parametrize("options", [dict(softcap=5.0), dict(alibi=True)])
def test_need_weights_refuses_scores_it_cannot_rebuild(options):
    layer = mha_ext.MultiHeadAttention(64, 8, **options)
    x = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="need_weights is not available with softcap"):
        layer(x, x, x, need_weights=True)


def test_need_weights_with_sinks_and_window():
    layer = optioned_layer(dict(sinks=True, window=(2, 0)))
    x = torch.randn(2, 7, 64)
    out, weights = layer(x, x, x, need_weights=True)
    # The sink takes its share of every row, and keys outside the window get none.
    assert (weights.sum(-1) < 1).all()
    assert (weights.triu(1) == 0).all() and (weights.tril(-3) == 0).all()
    value = layer._split_heads(layer.w_v(x), 2).repeat_interleave(4, 1)
    rebuilt = layer.w_o((weights @ value).transpose(1, 2).reshape(2, 7, 64))
    torch.testing.assert_close(rebuilt, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- packed documents

LENGTHS = [5, 1, 0, 13, 8]  # ragged, with a one-token and an empty document


def packed_documents(lengths, d_model=64):
    documents = [torch.randn(length, d_model) for length in lengths]
    offsets = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    return documents, torch.cat(documents), offsets


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("options", ["plain", "all"])
def test_packed_equals_each_document_alone(causal, options):
    layer = optioned_layer({} if options == "plain" else OPTIONS["all"])
    documents, packed, cu_seqlens = packed_documents(LENGTHS)
    packed.requires_grad_()
    out = layer(packed, packed, packed, is_causal=causal, cu_seqlens=cu_seqlens)
    assert out.shape == (sum(LENGTHS), 64)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    packed_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    # Each non-empty document alone, its loss weighted by its rows of the same grad_out.
    loss = 0.0
    inputs = []
    for document, rows, row_grads in zip(documents, out.split(LENGTHS), grad_out.split(LENGTHS)):
        if len(document) == 0:
            continue
        x = document[None].clone().requires_grad_()  # (1, S, d_model)
        alone = layer(x, x, x, is_causal=causal)[0]  # (S, d_model)
        torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-5)
        loss = loss + (alone * row_grads).sum()
        inputs.append(x)
    loss.backward()
    nonempty_grads = [g for g, n in zip(packed.grad.split(LENGTHS), LENGTHS) if n]
    for packed_grad, x in zip(nonempty_grads, inputs):
        torch.testing.assert_close(packed_grad, x.grad[0], rtol=1e-5, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_head_mask_per_model_and_per_document():
    layer = optioned_layer({})
    documents, packed, cu_seqlens = packed_documents([4, 6, 3])
    per_document = torch.rand(3, 8)
    for head_mask in (per_document[0], per_document):
        out = layer(packed, packed, packed, cu_seqlens=cu_seqlens, head_mask=head_mask)
        for b, (document, rows) in enumerate(zip(documents, out.split([4, 6, 3]))):
            factors = head_mask if head_mask.dim() == 1 else head_mask[b]
            alone = layer(document[None], document[None], document[None], head_mask=factors)
            torch.testing.assert_close(rows, alone[0], rtol=1e-5, atol=1e-5)


def test_packed_max_seqlen_given_or_read():
    layer = optioned_layer({})
    _, packed, cu_seqlens = packed_documents([4, 9, 2])
    read = layer(packed, packed, packed, is_causal=True, cu_seqlens=cu_seqlens)
    given = layer(packed, packed, packed, is_causal=True, cu_seqlens=cu_seqlens, max_seqlen=9)
    assert torch.equal(read, given)
    with pytest.raises(RuntimeError, match="max_seqlen_q is 5 but sequence 1 has 9 queries"):
        layer(packed, packed, packed, cu_seqlens=cu_seqlens, max_seqlen=5)


def test_packed_bad_inputs_raise():
    layer = optioned_layer({})
    _, packed, cu_seqlens = packed_documents([4, 6])
    x = packed
    with pytest.raises(ValueError, match=r"takes no mask \(got \(10, 10\)\)"):
        layer(x, x, x, torch.ones(10, 10), cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match="no need_weights"):
        layer(x, x, x, need_weights=True, cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=r"\(total_tokens, d_model\).*\[\(1, 10, 64\)"):
        layer(x[None], x[None], x[None], cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=r"one shape.*\(10, 64\), \(9, 64\)"):
        layer(x, x[:9], x, cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D tensor"):
        layer(x, x, x, cu_seqlens=cu_seqlens[None])
    with pytest.raises(ValueError, match=r"head_mask must have shape \(8,\) or \(2, 8\)"):
        layer(x, x, x, cu_seqlens=cu_seqlens, head_mask=torch.ones(3, 8))
    with pytest.raises(ValueError, match="max_seqlen 6 given without cu_seqlens"):
        layer(x[None], x[None], x[None], max_seqlen=6)
    # The op's own checks name the offsets: wrong dtype, wrong total.
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        layer(x, x, x, cu_seqlens=cu_seqlens.long())
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        layer(x, x, x, cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32))


# ---------------------------------------------------------------- paged pass-through


def recorded_paged_options(monkeypatch, layer):
    """The keyword arguments forward_paged gives mha_ext.paged_attention."""
    calls = []

    def recording_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(mha_ext.functional, "paged_attention", recording_paged_attention)
    cache = mha_ext.PagedKVCache(1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    batch = cache.prepare([cache.allocate()], [3])
    layer.forward_paged(torch.randn(3, 64), cache, 0, batch)
    (options,) = calls
    return options


def test_forward_paged_passes_only_the_options_that_are_on(monkeypatch):
    assert recorded_paged_options(monkeypatch, optioned_layer({})) == {}
    assert recorded_paged_options(monkeypatch, optioned_layer(dict(window=(None, 3)))) == {}
    layer = optioned_layer(dict(window=(6, 2), softcap=4.0, alibi=True, sinks=True))
    options = recorded_paged_options(monkeypatch, layer)
    # The paged queries attend causally: the window's right side is 0, as with is_causal.
    assert options.keys() == {"window", "softcap", "alibi_slopes", "sinks"}
    assert options["window"] == (6, 0) and options["softcap"] == 4.0
    assert options["alibi_slopes"] is layer.alibi_slopes and options["sinks"] is layer.sinks


def test_forward_paged_with_options_matches_causal_forward():
    layer = optioned_layer(dict(window=(5, 2), softcap=3.0, alibi=True, sinks=True))
    cache = mha_ext.PagedKVCache(1, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
    x = [torch.randn(12, 64), torch.randn(6, 64)]
    seqs = [cache.allocate(), cache.allocate()]
    outputs = [[], []]
    for chunk in ([7, 3], [4, 2], [1, 1]):  # chunked prefill, then a decode step each
        starts = [cache.seq_len(s) for s in seqs]
        batch = cache.prepare(seqs, chunk)
        packed = torch.cat([x[i][starts[i] : starts[i] + chunk[i]] for i in range(2)])
        for i, piece in enumerate(layer.forward_paged(packed, cache, 0, batch).split(chunk)):
            outputs[i].append(piece)
    for i in range(2):
        whole = x[i][None]
        full = layer(whole, whole, whole, is_causal=True)[0]
        torch.testing.assert_close(torch.cat(outputs[i]), full, rtol=1e-5, atol=1e-5)

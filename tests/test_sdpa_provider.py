"""mha_ext as torch's flash-attention provider (torch.nn.attention's SDPA hook): the routing,
seen in torch.profiler; torch's results through it (F.scaled_dot_product_attention, a
Transformer layer in training, a compiled model, a Hugging Face model, varlen_attn); torch's
op semantics (layouts, logsumexp); and the calls that fall through to torch's own kernels."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import attention

from mha_ext.integrations import torch_sdpa

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator

pytestmark = pytest.mark.skipif(
    not hasattr(attention, "activate_flash_attention_impl"),
    reason="this torch has no flash-attention provider hook",
)

MHA_EXT_OPS = {"mha_ext::attention_forward", "mha_ext::attention_backward"}


class Provider:
    """Switches torch's flash-attention kernels between torch's own and mha_ext's."""

    def on(self):
        attention.activate_flash_attention_impl(torch_sdpa.PROVIDER)

    def off(self):
        if attention.current_flash_attention_impl() == torch_sdpa.PROVIDER:
            attention.restore_flash_attention_impl()


@pytest.fixture
def provider():
    """The switch, off to begin with; torch gets its kernels back however the test ends."""
    switch = Provider()
    switch.off()
    try:
        yield switch
    finally:
        switch.off()


def profiled(fn):
    """fn's result and the names of the mha_ext ops that ran, from torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = fn()
    return result, {event.name for event in profile.events() if "mha_ext" in event.name}


def with_grads(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(*inputs), grad_out> with respect to inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def assert_torch_result(actual, reference64, plain, what):
    """(out, grads) within the accuracy rule of torch's own float64 and same-dtype results."""
    assert_within_rule(actual[0], reference64[0], plain[0], OUTPUT_FACTOR, f"{what} out")
    for name, grad, grad64, plain_grad in zip("qkv", actual[1], reference64[1], plain[1]):
        assert_within_rule(grad, grad64, plain_grad, GRAD_FACTOR, f"{what} grad_{name}")


# ---- F.scaled_dot_product_attention on CPU ----

# name: (sdpa keyword arguments, shape overrides)
SDPA_CASES = {
    "plain": ({}, {}),
    "causal_short_q": ({"is_causal": True}, {"seq_q": 20, "seq_k": 45}),
    "causal_long_q": ({"is_causal": True}, {"seq_q": 45, "seq_k": 20}),
    "scale": ({"scale": 0.37}, {}),
    "bool_mask": ({"attn_mask": "bool"}, {}),
    "additive_mask": ({"attn_mask": "additive"}, {}),
    "gqa_causal": ({"is_causal": True, "enable_gqa": True}, {"kv_heads": 2}),
    "bshd_views": ({"is_causal": True}, {"layout": "bshd"}),
}


def sdpa_inputs(case, dtype):
    kwargs, shape = SDPA_CASES[case]
    seq_q, seq_k = shape.get("seq_q", 31), shape.get("seq_k", 31)
    q, k, v = random_qkv(
        2,
        4,
        shape.get("kv_heads", 4),
        seq_q,
        seq_k,
        32,
        dtype=dtype,
        layout=shape.get("layout", "bhsd"),
    )
    kwargs = dict(kwargs)
    generator = seeded_generator(1)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(seq_q, seq_k, generator=generator) > 0.3
        kwargs["attn_mask"][:, 0] = True  # every row sees a key
    elif kwargs.get("attn_mask") == "additive":
        kwargs["attn_mask"] = torch.randn(2, 1, seq_q, seq_k, generator=generator).to(dtype)
    grad_out = torch.randn(q.shape, generator=generator).to(dtype)
    return (q, k, v), kwargs, grad_out


def in_float64(tensors, kwargs):
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs = {**kwargs, "attn_mask": mask.double()}
    return [t.double() for t in tensors], kwargs


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_runs_on_mha_ext_with_torchs_results(provider, case, dtype):
    qkv, kwargs, grad_out = sdpa_inputs(case, dtype)
    qkv64, kwargs64 = in_float64(qkv, kwargs)
    reference64 = with_grads(
        lambda *t: F.scaled_dot_product_attention(*t, **kwargs64), qkv64, grad_out.double()
    )
    plain = with_grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), qkv, grad_out)
    provider.on()
    actual, ran = profiled(
        lambda: with_grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), qkv, grad_out)
    )
    assert ran == MHA_EXT_OPS
    assert_torch_result(actual, reference64, plain, case)


@pytest.mark.cpu_only
def test_registered_on_import_and_restore_undoes_activation(provider):
    assert torch_sdpa.PROVIDER in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None  # importing activates nothing
    qkv, kwargs, grad_out = sdpa_inputs("gqa_causal", torch.float32)

    def step():
        return with_grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), qkv, grad_out)

    def torch_has_cpu_flash_forward():  # torch itself has no CPU kernel for this op
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_flash_attention_forward", "CPU"
        )

    assert profiled(step)[1] == set() and not torch_has_cpu_flash_forward()
    provider.on()
    assert attention.current_flash_attention_impl() == torch_sdpa.PROVIDER
    assert profiled(step)[1] == MHA_EXT_OPS and torch_has_cpu_flash_forward()
    attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert profiled(step)[1] == set() and not torch_has_cpu_flash_forward()


# ---- the CPU op itself: aten::_scaled_dot_product_flash_attention_for_cpu ----

CPU_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_OP_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def cpu_op_with_grads(q, k, v, **kwargs):
    out, lse = CPU_OP(q, k, v, **kwargs)
    grad_out = torch.randn(out.shape, generator=seeded_generator(2)).to(out.dtype)
    grads = CPU_OP_BACKWARD(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        0.0,
        kwargs.get("is_causal", False),
        attn_mask=kwargs.get("attn_mask"),
        scale=kwargs.get("scale"),
    )
    return out, lse, grads


def permuted(shape, order):
    """A (B, H, S, D) tensor over storage whose dims are in `order`."""
    return torch.randn([shape[i] for i in order], generator=seeded_generator(3)).permute(
        [order.index(i) for i in range(4)]
    )


@pytest.mark.cpu_only
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3), (2, 0, 1, 3)])
def test_cpu_op_keeps_torchs_layouts_and_logsumexp(provider, order):
    q = permuted((2, 4, 9, 16), order)
    k, v = permuted((2, 2, 13, 16), order), permuted((2, 2, 13, 16), order)
    mask = torch.zeros(9, 13)
    mask[3] = -math.inf  # a row that sees no key: out 0, logsumexp 0 in torch's kernel
    mask[5, 4:] = -math.inf
    for kwargs in ({"is_causal": True, "scale": 0.3}, {"attn_mask": mask}):
        expected = cpu_op_with_grads(q, k, v, **kwargs)
        provider.on()
        actual, ran = profiled(lambda: cpu_op_with_grads(q, k, v, **kwargs))
        provider.off()
        assert ran == MHA_EXT_OPS
        for got, want in zip((actual[0], actual[1], *actual[2]), (*expected[:2], *expected[2])):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(actual[1][..., 3], torch.zeros(2, 4)) and actual[0][:, :, 3].eq(0).all()


# ---- whole models ----


@pytest.mark.cpu_only
def test_transformer_encoder_layer_training(provider):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    src = torch.randn(3, 37, 64, generator=seeded_generator(4))
    causal = nn.Transformer.generate_square_subsequent_mask(37)

    def step(model, x):
        model.zero_grad()
        out = model(x, src_mask=causal.to(x.dtype), is_causal=True)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    reference64 = step(copy.deepcopy(layer).double(), src.double())
    plain = step(layer, src)
    provider.on()
    actual, ran = profiled(lambda: step(layer, src))
    assert ran == MHA_EXT_OPS
    assert_within_rule(actual[0], reference64[0], plain[0], OUTPUT_FACTOR, "out")
    for i, grads in enumerate(zip(actual[1], reference64[1], plain[1])):
        assert_within_rule(*grads, GRAD_FACTOR, f"parameter {i} grad")


class AttentionBlock(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        # (B, S, 3 * dim) -> 3 x (B, heads, S, head_dim)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(2))


@pytest.mark.cpu_only
def test_compiled_model(provider):
    torch.manual_seed(0)
    block = AttentionBlock()
    x = torch.randn(2, 33, 64, generator=seeded_generator(5))

    def step(model, x):
        model.zero_grad()
        out = model(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    reference64 = step(copy.deepcopy(block).double(), x.double())
    plain = step(block, x)
    compiled = torch.compile(block, fullgraph=True)
    provider.on()
    actual, ran = profiled(lambda: step(compiled, x))
    assert ran == MHA_EXT_OPS
    assert_within_rule(actual[0], reference64[0], plain[0], OUTPUT_FACTOR, "out")
    for i, grads in enumerate(zip(actual[1], reference64[1], plain[1])):
        assert_within_rule(*grads, GRAD_FACTOR, f"parameter {i} grad")
    # The compiled code calls the aten ops, so torch's kernels are back without a recompile.
    provider.off()
    assert profiled(lambda: step(compiled, x))[1] == set()


@pytest.mark.cpu_only
def test_hugging_face_llama_with_sdpa(provider):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    generator = seeded_generator(6)
    input_ids = torch.randint(0, 128, (2, 21), generator=generator)
    attention_mask = torch.ones(2, 21, dtype=torch.long)
    attention_mask[1, :5] = 0  # left padding

    def step(model):
        model.zero_grad()
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        out.loss.backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    reference64 = step(copy.deepcopy(model).double())
    plain = step(model)
    provider.on()
    actual, ran = profiled(lambda: step(model))
    assert ran == MHA_EXT_OPS
    assert_within_rule(actual[0], reference64[0], plain[0], OUTPUT_FACTOR, "logits")
    for i, grads in enumerate(zip(actual[1], reference64[1], plain[1])):
        assert_within_rule(*grads, GRAD_FACTOR, f"parameter {i} grad")


# ---- torch.nn.attention.varlen on CPU, through aten::_flash_attention_forward ----


def varlen_reference(q, k, v, cu_q, cu_k, window, scale=None):
    """FlashAttention-2's packed attention, sequence by sequence, in q's dtype: key j is
    visible to query i within [i' - left, i' + right], i' = i + seq_k - seq_q (-1: unbounded);
    a row that sees no key gives 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (ks, vs))
        diagonal = torch.arange(len(qs))[:, None] + len(ks) - len(qs)
        key = torch.arange(len(ks))[None, :]
        visible = torch.ones(len(qs), len(ks), dtype=torch.bool)
        if window[0] >= 0:
            visible &= key >= diagonal - window[0]
        if window[1] >= 0:
            visible &= key <= diagonal + window[1]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        probs = scores.masked_fill(~visible, torch.finfo(q.dtype).min).softmax(-1)
        probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
    return torch.cat(outs)


@pytest.mark.cpu_only
def test_varlen_attn_runs_on_mha_ext(provider):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn, varlen_attn_out

    generator = seeded_generator(7)
    # Sequence 1 has more queries than keys: causal bottom-right leaves its first 5 rows
    # without a key (out 0, logsumexp +inf).
    lengths_q, lengths_k = [5, 9, 3], [7, 4, 3]
    cu_q, cu_k = (
        torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for lengths in (lengths_q, lengths_k)
    )
    q = torch.randn(17, 4, 16, generator=generator)
    k, v = torch.randn(2, 14, 2, 16, generator=generator)
    grad_out = torch.randn(q.shape, generator=generator)
    lengths = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    with pytest.raises(NotImplementedError):  # torch has no CPU kernel
        varlen_attn(q, k, v, *lengths, enable_gqa=True)
    provider.on()
    for window in ((-1, 0), (2, 1)):

        def reference(*qkv):
            return varlen_reference(*qkv, cu_q, cu_k, window)

        def packed(*qkv):
            return varlen_attn(*qkv, *lengths, window_size=window, enable_gqa=True)

        reference64 = with_grads(reference, [t.double() for t in (q, k, v)], grad_out.double())
        plain = with_grads(reference, (q, k, v), grad_out)
        actual, ran = profiled(lambda: with_grads(packed, (q, k, v), grad_out))
        assert ran == MHA_EXT_OPS
        assert_torch_result(actual, reference64, plain, f"window {window}")
        out = torch.empty_like(q)
        varlen_attn_out(out, q, k, v, *lengths, window_size=window, enable_gqa=True)
        assert torch.equal(out, actual[0])
    causal = {"window_size": (-1, 0), "enable_gqa": True}
    _, lse = varlen_attn(q, k, v, *lengths, **causal, return_aux=AuxRequest(lse=True))
    assert lse.shape == (4, 17) and lse.dtype == torch.float32
    assert torch.isinf(lse[:, 5:10]).all() and (lse[:, 5:10] > 0).all()
    assert torch.isfinite(lse[:, :5]).all() and torch.isfinite(lse[:, 10:]).all()
    # What mha_ext cannot take gets the error torch gives, as torch has no CPU kernel.
    with pytest.raises(NotImplementedError, match="seqused_k"):
        used = torch.tensor([7, 4, 3], dtype=torch.int32)
        varlen_attn(q, k, v, *lengths, enable_gqa=True, seqused_k=used)


@pytest.mark.cpu_only
def test_flash_attention_op_on_cpu_keeps_fa2_semantics(provider):
    """aten::_flash_attention_forward / _backward called as torch's own code calls them: dense
    (B, S, H, D), is_causal aligned bottom-right (with more queries than keys, the first rows
    see no key), the outputs shaped as torch's fake kernel says."""
    generator = seeded_generator(10)
    q = torch.randn(2, 12, 4, 16, generator=generator)
    k, v = torch.randn(2, 2, 9, 2, 16, generator=generator)
    grad_out = torch.randn(q.shape, generator=generator)
    provider.on()

    def attention_op(q, k, v):
        args = (None, None, 12, 9, 0.0, True, False)  # cum_seq_q/k, max_q/k, dropout, causal
        return torch.ops.aten._flash_attention_forward(q, k, v, *args, scale=0.3)

    out, lse, rng_state, unused, debug_mask = attention_op(q, k, v)
    assert out.stride() == q.stride() and (lse.shape, lse.dtype) == ((2, 4, 12), torch.float32)
    assert (rng_state.shape, unused.shape, debug_mask.shape) == ((2,), (), (0,))
    assert torch.isposinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    actual, ran = profiled(lambda: with_grads(lambda *t: attention_op(*t)[0], (q, k, v), grad_out))
    assert ran == MHA_EXT_OPS

    def reference(q, k, v):  # the batch as packed sequences of equal lengths
        cu_q, cu_k = torch.tensor([0, 12, 24]), torch.tensor([0, 9, 18])
        packed = varlen_reference(*(t.flatten(0, 1) for t in (q, k, v)), cu_q, cu_k, (-1, 0), 0.3)
        return packed.unflatten(0, (2, 12))

    reference64 = with_grads(reference, [t.double() for t in (q, k, v)], grad_out.double())
    plain = with_grads(reference, (q, k, v), grad_out)
    assert_torch_result(actual, reference64, plain, "dense causal")


# ---- calls mha_ext cannot take: torch's kernel runs, with torch's results ----


def noncontiguous_rows(t):
    """t with a last dim of stride 2."""
    return torch.stack([t, t], -1)[..., 0]


FALLTHROUGH_CASES = {
    # torch takes an fp32 mask for bf16 q; mha_ext's kernels read masks in q's dtype.
    "bf16_with_fp32_mask": lambda q, k, v: (
        (q.bfloat16(), k.bfloat16(), v.bfloat16()),
        {"attn_mask": torch.randn(q.shape[2], k.shape[2], generator=seeded_generator(8))},
    ),
    "head_dim_over_256": lambda q, k, v: (
        tuple(t.repeat(1, 1, 1, 10) for t in (q, k, v)),
        {"is_causal": True},
    ),
    "strided_last_dim": lambda q, k, v: (tuple(noncontiguous_rows(t) for t in (q, k, v)), {}),
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", list(FALLTHROUGH_CASES))
def test_calls_mha_ext_cannot_take_run_torchs_kernel(provider, case):
    base = random_qkv(2, 4, 4, 11, 13, 32)
    qkv, kwargs = FALLTHROUGH_CASES[case](*base)
    expected = cpu_op_with_grads(*qkv, **kwargs)
    provider.on()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        actual = cpu_op_with_grads(*qkv, **kwargs)
    ran = {event.name for event in profile.events()}
    assert not any("mha_ext" in name for name in ran)
    assert {"torch_flash_native::sdpa_cpu", "torch_flash_native::sdpa_cpu_backward"} <= ran
    for got, want in zip((actual[0], actual[1], *actual[2]), (*expected[:2], *expected[2])):
        assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.cpu_only
def test_dropout_through_sdpa_keeps_torchs_path(provider):
    qkv, kwargs, grad_out = sdpa_inputs("causal_short_q", torch.float32)

    def step():
        torch.manual_seed(9)
        return with_grads(
            lambda *t: F.scaled_dot_product_attention(*t, dropout_p=0.3, **kwargs), qkv, grad_out
        )

    expected = step()
    provider.on()
    actual, ran = profiled(step)
    assert ran == set()
    assert torch.equal(actual[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(actual[1], expected[1]))


# ---- CUDA: torch's flash kernel (FlashAttention-2, fp16/bf16) ----


@pytest.mark.cuda_only
@pytest.mark.skipif(not torch_sdpa._runs_on_cuda(), reason="mha_ext built without CUDA")
@pytest.mark.parametrize("case", ["plain", "scale", "gqa_causal", "bshd_views"])
def test_cuda_flash_sdpa_runs_on_mha_ext(provider, case):
    qkv, kwargs, grad_out = sdpa_inputs(case, torch.bfloat16)
    qkv64, kwargs64 = in_float64(qkv, kwargs)
    reference64 = with_grads(
        lambda *t: F.scaled_dot_product_attention(*t, **kwargs64), qkv64, grad_out.double()
    )

    def flash(*t):
        with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*t, **kwargs)

    plain = with_grads(flash, qkv, grad_out)
    provider.on()
    actual, ran = profiled(lambda: with_grads(flash, qkv, grad_out))
    assert ran == MHA_EXT_OPS
    assert_torch_result(actual, reference64, plain, case)

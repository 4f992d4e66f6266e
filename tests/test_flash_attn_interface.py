"""mha_ext.flash_attn_interface against FlashAttention 2.8's documented semantics.

The float64 reference here is written from FlashAttention's docstrings, independently of
mha_ext's own reference: causal masks and windows aligned to the bottom-right corner (query
i sits on key diagonal i + seqlen_k - seqlen_q), softcap before ALiBi's
-slope * |diagonal - j|, rows that see no key give 0 and logsumexp -inf.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import mha_ext.flash_attn_interface as fa
from mha_ext.flash_attn_interface import (
    FlashAttnArgumentError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, seeded_generator

INF = float("inf")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def fa_reference(
    q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, key_start=None, key_end=None
):
    """(out (B, Sq, H, Dv), lse (B, H, Sq)) computed in q's dtype with explicit scores.

    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv). Sequence b's keys are k rows
    [key_start[b], key_end[b]) (default: all); its diagonal, window and ALiBi distances count
    from key_start[b]. Differentiable in q, k, v."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * head_dim**-0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    device = q.device
    start = torch.zeros(batch, dtype=torch.long, device=device) if key_start is None else key_start
    end = torch.full((batch,), seq_k, device=device) if key_end is None else key_end
    key = torch.arange(seq_k, device=device)[None, None, :] - start.long()[:, None, None]
    count = (end.long() - start.long())[:, None, None]  # (B, 1, 1) keys of each sequence
    diagonal = torch.arange(seq_q, device=device)[None, :, None] + count - seq_q  # (B, Sq, 1)
    left, right = window
    right = 0 if causal else right
    visible = (key >= 0) & (key < count) & (diagonal >= -INF)  # (B, Sq, Sk)
    if right >= 0:
        visible = visible & (key <= diagonal + right)
    if left >= 0:
        visible = visible & (key >= diagonal - left)
    if alibi is not None:
        # In fp32 at least, as the kernels read them (fp64 for fp64).
        slopes = alibi.to(torch.promote_types(q.dtype, alibi.dtype)).reshape(-1, heads)
        slopes = slopes[:, :, None, None]
        scores = scores - slopes * (diagonal - key).abs()[:, None]
    scores = scores.masked_fill(~visible[:, None], -INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse == -INF, 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v), lse


def varlen_reference(q, k, v, cu_q, cu_k, alibi=None, **features):
    """fa_reference per packed sequence: (out (total_q, H, Dv), lse (H, total_q))."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
        out, lse = fa_reference(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], alibi=slopes, **features
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check(actual, reference64, plain, what, factor=OUTPUT_FACTOR):
    """The tolerance rule; entries that are -inf (rows that see no key) must match exactly."""
    empty = reference64 == -INF
    assert torch.equal(actual == -INF, empty), f"{what}: -inf entries differ"
    assert_within_rule(actual[~empty], reference64[~empty], plain[~empty], factor, what)


def compare(run, reference, inputs, dtype, what, names):
    """run(*leaves) -> (out, lse) against reference(*float64 leaves), with the reference in
    `dtype` as plain PyTorch's error: output, logsumexp and the gradients of `inputs`."""
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    plain_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out, lse = run(*leaves)
    out64, lse64 = reference(*leaves64)
    plain, plain_lse = reference(*plain_leaves)
    check(out, out64, plain, f"{what} out")
    check(lse, lse64, plain_lse, f"{what} lse")
    grad_out = torch.randn(out.shape, generator=seeded_generator(9)).to(dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    grads64 = torch.autograd.grad(out64, leaves64, grad_out.double())
    plain_grads = torch.autograd.grad(plain, plain_leaves, grad_out)
    for name, grad, grad64, plain_grad in zip(names, grads, grads64, plain_grads):
        assert grad.shape == grad64.shape
        check(grad, grad64, plain_grad, f"{what} d{name}", GRAD_FACTOR)
    return out, lse


def randn(*shape, seed):
    return torch.randn(*shape, generator=seeded_generator(seed))


# Each entry: flash_attn keyword arguments; "alibi" names the slopes' shape.
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 1)},
    "causal_window_softcap": {"causal": True, "window_size": (2, 5), "softcap": 2.0},
    "alibi_per_head": {"alibi": "heads"},
    "alibi_per_batch_causal": {"alibi": "batch", "causal": True},
}


def split_features(features, batch):
    """(flash_attn keyword arguments, fa_reference keyword arguments) of a FEATURES entry."""
    kernel = dict(features)
    shape = {"heads": (HEADS,), "batch": (batch, HEADS)}.get(kernel.pop("alibi", None))
    if shape is not None:
        kernel["alibi_slopes"] = torch.rand(*shape, generator=seeded_generator(5)) * 0.5
    reference = {
        "causal": kernel.get("causal", False),
        "window": kernel.get("window_size", (-1, -1)),
        "softcap": kernel.get("softcap", 0.0),
        "alibi": kernel.get("alibi_slopes"),
    }
    return kernel, reference


# ---------------------------------------------------------------- dense forms


@pytest.mark.parametrize("seq_q, seq_k", [(5, 9), (9, 5)])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_func_matches_reference(dtype, feature, seq_q, seq_k):
    batch = 2
    kernel, reference = split_features(FEATURES[feature], batch)
    q = randn(batch, seq_q, HEADS, HEAD_DIM, seed=1)
    k = randn(batch, seq_k, KV_HEADS, HEAD_DIM, seed=2)
    v = randn(batch, seq_k, KV_HEADS, 8, seed=3)  # headdim_v != headdim works too

    def run(q, k, v):
        out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True, **kernel)
        assert out.shape == (batch, seq_q, HEADS, 8) and out.dtype == dtype
        assert lse.shape == (batch, HEADS, seq_q)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert s_dmask.numel() == 0  # FlashAttention returns no probabilities without dropout
        return out, lse

    def ref(q, k, v):
        return fa_reference(q, k, v, **reference)

    compare(run, ref, [q, k, v], dtype, f"{feature} {dtype}", "qkv")


@pytest.mark.parametrize("feature", ["causal", "alibi_per_batch_causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forms_match_reference(dtype, feature):
    batch, seq_q, seq_k = 2, 4, 7
    kernel, reference = split_features(FEATURES[feature], batch)
    qkv = randn(batch, seq_k, 3, HEADS, HEAD_DIM, seed=1)

    def run_qkv(qkv):
        out, lse, _ = flash_attn_qkvpacked_func(qkv, return_attn_probs=True, **kernel)
        return out, lse

    compare(
        run_qkv,
        lambda qkv: fa_reference(*qkv.unbind(2), **reference),
        [qkv],
        dtype,
        f"qkvpacked {feature}",
        ["qkv"],
    )

    q = randn(batch, seq_q, HEADS, HEAD_DIM, seed=2)
    kv = randn(batch, seq_k, 2, KV_HEADS, HEAD_DIM, seed=3)

    def run_kv(q, kv):
        out, lse, _ = flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **kernel)
        return out, lse

    compare(
        run_kv,
        lambda q, kv: fa_reference(q, *kv.unbind(2), **reference),
        [q, kv],
        dtype,
        f"kvpacked {feature}",
        ["q", "kv"],
    )


def test_default_output_is_the_tensor_alone():
    q, k, v = (randn(1, 3, HEADS, HEAD_DIM, seed=s) for s in (1, 2, 3))
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    qkv = torch.stack([q, k, v], dim=2)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv), out, rtol=0, atol=0)


# ---------------------------------------------------------------- varlen forms

# Sequence lengths: a zero-length query sequence, a zero-length key sequence (its query sees
# nothing), more queries than keys (bottom-right causal leaves the first rows empty).
Q_LENS, K_LENS = [3, 0, 5, 1], [6, 0, 2, 0]


def cumulative(lengths):
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_reference(dtype, feature):
    kernel, reference = split_features(FEATURES[feature], len(Q_LENS))
    cu_q, cu_k = cumulative(Q_LENS), cumulative(K_LENS)
    q = randn(cu_q[-1], HEADS, HEAD_DIM, seed=1)
    k = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=2)
    v = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=3)
    cu_q_t, cu_k_t = (torch.tensor(cu, dtype=torch.int32) for cu in (cu_q, cu_k))

    def run(q, k, v):
        out, lse, s_dmask = flash_attn_varlen_func(
            q, k, v, cu_q_t, cu_k_t, max(Q_LENS), max(K_LENS), return_attn_probs=True, **kernel
        )
        assert lse.shape == (HEADS, cu_q[-1]) and s_dmask.numel() == 0
        return out, lse

    def ref(q, k, v):
        return varlen_reference(q, k, v, cu_q, cu_k, **reference)

    compare(run, ref, [q, k, v], dtype, f"varlen {feature}", "qkv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_packed_forms_match_reference(dtype):
    kernel, reference = split_features(FEATURES["causal_window_softcap"], len(Q_LENS))
    cu = cumulative(Q_LENS)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    qkv = randn(cu[-1], 3, HEADS, HEAD_DIM, seed=1)

    def run_qkv(qkv):
        out, lse, _ = flash_attn_varlen_qkvpacked_func(
            qkv, cu_t, max(Q_LENS), return_attn_probs=True, **kernel
        )
        return out, lse

    def ref_qkv(qkv):
        return varlen_reference(*qkv.unbind(1), cu, cu, **reference)

    compare(run_qkv, ref_qkv, [qkv], dtype, "varlen qkvpacked", ["qkv"])

    cu_k = cumulative(K_LENS)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32)
    q = randn(cu[-1], HEADS, HEAD_DIM, seed=2)
    kv = randn(cu_k[-1], 2, KV_HEADS, HEAD_DIM, seed=3)

    def run_kv(q, kv):
        out, lse, _ = flash_attn_varlen_kvpacked_func(
            q, kv, cu_t, cu_k_t, max(Q_LENS), max(K_LENS), return_attn_probs=True, **kernel
        )
        return out, lse

    def ref_kv(q, kv):
        return varlen_reference(q, *kv.unbind(1), cu, cu_k, **reference)

    compare(run_kv, ref_kv, [q, kv], dtype, "varlen kvpacked", ["q", "kv"])


def packed_slots(lengths, block_table, block_size):
    """(blocks, offsets) of every packed key row in a paged cache: sequence b's token j sits
    at block block_table[b, j // block_size], offset j % block_size."""
    blocks, offsets = [], []
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        blocks.append(block_table[b, positions // block_size].long())
        offsets.append(positions % block_size)
    return torch.cat(blocks), torch.cat(offsets)


def shuffled_block_table(batch, blocks_per_sequence, num_blocks, seed):
    order = torch.randperm(num_blocks, generator=seeded_generator(seed))
    return order[: batch * blocks_per_sequence].view(batch, -1).to(torch.int32)


def spy_on_paged_kernel(monkeypatch):
    """Records the calls of the paged kernel (flash_attn_interface's fast path)."""
    calls = []
    original = fa.paged_attention

    def counted(*args, **kwargs):
        calls.append(args[3].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fa, "paged_attention", counted)
    return calls


@pytest.mark.parametrize(
    "mode, q_lens, paged_kernel",
    [
        ("causal", [3, 0, 5, 1], True),
        ("causal", [3, 2, 5, 1], False),  # sequence 1 has queries but no keys
        ("window", [3, 0, 5, 1], False),
        ("grad", [3, 0, 5, 1], False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_with_block_table(dtype, mode, q_lens, paged_kernel, monkeypatch):
    k_lens, block_size, num_blocks = [6, 0, 13, 4], 4, 20
    table = shuffled_block_table(len(k_lens), 4, num_blocks, seed=4)
    cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
    q = randn(cu_q[-1], HEADS, HEAD_DIM, seed=1).to(dtype)
    k = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=2).to(dtype)
    v = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=3).to(dtype)
    slots = packed_slots(k_lens, table, block_size)
    # Caches with the sequences at their slots and random values everywhere else.
    k_cache = randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, seed=5).to(dtype)
    v_cache = randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, seed=6).to(dtype)
    k_cache[slots], v_cache[slots] = k, v
    features = {"causal": True, "softcap": 1.5} if mode != "window" else {"window_size": (3, 2)}
    features["alibi_slopes"] = torch.rand(len(k_lens), HEADS, generator=seeded_generator(7))
    calls = spy_on_paged_kernel(monkeypatch)
    leaves = [x.clone().requires_grad_(mode == "grad") for x in (q, k_cache, v_cache)]
    out, lse, _ = flash_attn_varlen_func(
        *leaves,
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        max(q_lens),
        max(k_lens),
        return_attn_probs=True,
        block_table=table,
        **features,
    )
    assert bool(calls) == paged_kernel
    reference = {
        "causal": features.get("causal", False),
        "window": features.get("window_size", (-1, -1)),
        "softcap": features.get("softcap", 0.0),
        "alibi": features["alibi_slopes"],
    }
    inputs64 = [x.double().requires_grad_() for x in (q, k, v)]
    plain_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out64, lse64 = varlen_reference(*inputs64, cu_q, cu_k, **reference)
    plain, plain_lse = varlen_reference(*plain_inputs, cu_q, cu_k, **reference)
    check(out, out64, plain, f"paged varlen {mode} out")
    check(lse, lse64, plain_lse, f"paged varlen {mode} lse")
    if mode != "grad":
        return
    grad_out = torch.randn(out.shape, generator=seeded_generator(9)).to(dtype)
    dq, dk_cache, dv_cache = torch.autograd.grad(out, leaves, grad_out)
    grads64 = torch.autograd.grad(out64, inputs64, grad_out.double())
    plain_grads = torch.autograd.grad(plain, plain_inputs, grad_out)
    # The caches' gradients sit at the sequences' slots, and are zero everywhere else.
    for name, grad in (("k_cache", dk_cache), ("v_cache", dv_cache)):
        elsewhere = grad.clone()
        elsewhere[slots] = 0
        assert not elsewhere.any(), f"d{name} is nonzero outside the sequences' slots"
    for name, grad, grad64, plain_grad in zip(
        "qkv", (dq, dk_cache[slots], dv_cache[slots]), grads64, plain_grads
    ):
        check(grad, grad64, plain_grad, f"paged varlen d{name}", GRAD_FACTOR)


# ---------------------------------------------------------------- return_attn_probs, deterministic


def reference_probs(q, k, seq_k_used=None, **reference):
    """(B, H, Sq, Sk) float64 softmax probabilities: fa_reference with v = identity."""
    batch, seq_k, kv_heads, _ = k.shape
    identity = torch.eye(seq_k, dtype=torch.float64).expand(batch, kv_heads, seq_k, seq_k)
    probs, _ = fa_reference(q.double(), k.double(), identity.transpose(1, 2), **reference)
    return probs.permute(0, 2, 1, 3)  # (B, Sq, H, Sk) -> (B, H, Sq, Sk)


def check_dropout_probs(s_dmask, out, q, k, v, dropout_p, reference, what):
    """|S_dmask| are the probabilities, its sign the dropout pattern: out must equal the
    attention that drops the negative entries."""
    probs64 = reference_probs(q, k, **reference)
    assert_within_rule(s_dmask.abs(), probs64, probs64.to(q.dtype), OUTPUT_FACTOR, what)
    kept = ~torch.signbit(s_dmask)
    dropped_fraction = 1 - kept[probs64 > 0].double().mean().item()
    assert abs(dropped_fraction - dropout_p) < 0.15, f"{what}: dropped {dropped_fraction:.2f}"
    group = q.shape[2] // k.shape[2]
    v_heads = v.double().repeat_interleave(group, dim=2)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs64 * kept / (1 - dropout_p), v_heads)
    plain = torch.einsum(
        "bhqk,bkhd->bqhd", (probs64 * kept / (1 - dropout_p)).to(q.dtype), v_heads.to(q.dtype)
    )
    check(out, expected, plain, f"{what} out with S_dmask's dropout pattern")


def test_return_attn_probs_with_dropout():
    batch, seq_q, seq_k, dropout_p = 2, 6, 9, 0.3
    q = randn(batch, seq_q, HEADS, HEAD_DIM, seed=1)
    k = randn(batch, seq_k, KV_HEADS, HEAD_DIM, seed=2)
    v = randn(batch, seq_k, KV_HEADS, HEAD_DIM, seed=3)
    slopes = torch.rand(HEADS, generator=seeded_generator(4))
    out, lse, s_dmask = flash_attn_func(
        q, k, v, dropout_p, causal=True, softcap=3.0, alibi_slopes=slopes, return_attn_probs=True
    )
    assert s_dmask.shape == (batch, HEADS, seq_q, seq_k) and s_dmask.dtype == q.dtype
    reference = {"causal": True, "softcap": 3.0, "alibi": slopes}
    check_dropout_probs(s_dmask, out, q, k, v, dropout_p, reference, "dense S_dmask")


def test_varlen_return_attn_probs_with_dropout():
    q_lens, k_lens, dropout_p = [4, 0, 6], [7, 3, 5], 0.25
    cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
    q = randn(cu_q[-1], HEADS, HEAD_DIM, seed=1)
    k = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=2)
    v = randn(cu_k[-1], KV_HEADS, HEAD_DIM, seed=3)
    out, lse, s_dmask = flash_attn_varlen_func(
        q,
        k,
        v,
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        max(q_lens),
        max(k_lens),
        dropout_p,
        window_size=(2, 1),
        return_attn_probs=True,
    )
    assert s_dmask.shape == (len(q_lens), HEADS, max(q_lens), max(k_lens))
    for b, (n_q, n_k) in enumerate(zip(q_lens, k_lens)):
        assert not s_dmask[b, :, n_q:].any() and not s_dmask[b, :, :, n_k:].any()
        if n_q == 0:
            continue
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        check_dropout_probs(
            s_dmask[b : b + 1, :, :n_q, :n_k],
            out[None, rows_q],
            q[None, rows_q],
            k[None, rows_k],
            v[None, rows_k],
            dropout_p,
            {"window": (2, 1)},
            f"varlen S_dmask of sequence {b}",
        )


@pytest.mark.cpu_only
def test_deterministic_gradients_are_bitwise_equal_across_thread_counts():
    # One (batch, head) task over 300 keys (5 blocks of 64): the CPU backward splits the keys
    # by thread count unless deterministic, so without it the two sums differ in the last bits.
    qkv = randn(1, 300, 3, 1, 32, seed=1).requires_grad_()
    grad_out = randn(1, 300, 1, 32, seed=2)
    threads = torch.get_num_threads()
    grads = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
            grads.append(torch.autograd.grad(out, qkv, grad_out)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------- flash_attn_with_kvcache

BATCH, CAPACITY, BLOCK_SIZE, ROTARY_HALF = 3, 24, 8, 4
CACHE_SEQLENS, LEFTPAD = [5, 0, 17], [2, 0, 9]


def rotate_reference(x, cos, sin, positions, interleaved):
    """float64 rotary embedding of x (B, S, H, D) at positions (B, S): complex products of
    dim pairs (2i, 2i + 1) when interleaved, x * cos + rotate_half(x) * sin (GPT-NeoX)
    otherwise; dims past 2 * cos.shape[1] unchanged."""
    half = cos.shape[1]
    cos_at = cos.double()[positions][:, :, None]  # (B, S, 1, half)
    sin_at = sin.double()[positions][:, :, None]
    head, tail = x.double()[..., : 2 * half], x.double()[..., 2 * half :]
    if interleaved:
        pairs = torch.view_as_complex(head.unflatten(-1, (half, 2)).contiguous())
        head = torch.view_as_real(pairs * torch.complex(cos_at, sin_at)).flatten(-2)
    else:
        first, second = head.chunk(2, dim=-1)
        rotate_half = torch.cat((-second, first), dim=-1)
        head = head * torch.cat((cos_at, cos_at), -1) + rotate_half * torch.cat(
            (sin_at, sin_at), -1
        )
    return torch.cat((head, tail), dim=-1)


KVCACHE_CASES = {
    "decode_paged_causal": {"paged": True, "seqlen_q": 1, "new": 1, "causal": True},
    "decode_read_only": {"paged": False, "seqlen_q": 1, "new": 0},
    "chunk_paged_causal_rotary_interleaved": {
        "paged": True, "seqlen_q": 3, "new": 3, "causal": True, "rotary": True,
    },
    "chunk_noncausal_rotary_neox": {
        "paged": False, "seqlen_q": 3, "new": 2, "rotary": True, "interleaved": False,
    },
    "batch_idx_window_alibi_rotary": {
        "paged": False, "batch_idx": True, "seqlen_q": 2, "new": 2, "window": (4, 0),
        "alibi": (BATCH, HEADS), "rotary": True,
    },
    "leftpad_causal_rotary_neox": {
        "paged": False, "leftpad": True, "seqlen_q": 2, "new": 2, "causal": True,
        "rotary": True, "interleaved": False,
    },
    "leftpad_paged_noncausal_softcap": {
        "paged": True, "leftpad": True, "seqlen_q": 3, "new": 1, "softcap": 1.5,
    },
    "read_only_more_queries_than_keys": {"paged": True, "seqlen_q": 3, "new": 0, "causal": True},
    "decode_window_softcap_alibi": {
        "paged": True, "seqlen_q": 1, "new": 1, "window": (5, 3), "softcap": 2.0,
        "alibi": (HEADS,), "rotary": True,
    },
}  # fmt: skip


def kvcache_inputs(case, dtype):
    """The arguments of a KVCACHE_CASES entry, and (positions of the cache rows that hold each
    sequence, (B, CAPACITY) as (block, offset) pairs)."""
    seqlen_q, new = case["seqlen_q"], case["new"]
    args = {
        "q": randn(BATCH, seqlen_q, HEADS, HEAD_DIM, seed=1).to(dtype),
        "cache_seqlens": torch.tensor(CACHE_SEQLENS, dtype=torch.int32),
        "causal": case.get("causal", False),
        "window_size": case.get("window", (-1, -1)),
        "softcap": case.get("softcap", 0.0),
        "return_softmax_lse": True,
    }
    positions = torch.arange(CAPACITY)
    if case["paged"]:
        num_blocks = BATCH * CAPACITY // BLOCK_SIZE + 3  # spare blocks no sequence owns
        table = shuffled_block_table(BATCH, CAPACITY // BLOCK_SIZE, num_blocks, seed=4)
        args["block_table"] = table
        cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        rows = (
            table[:, positions // BLOCK_SIZE].long(),
            (positions % BLOCK_SIZE).expand(BATCH, -1),
        )
    else:
        batch_cache = BATCH + 2 if case.get("batch_idx") else BATCH
        cache_shape = (batch_cache, CAPACITY, KV_HEADS, HEAD_DIM)
        row_of = torch.arange(BATCH)
        if case.get("batch_idx"):
            row_of = torch.tensor([3, 0, 4])
            args["cache_batch_idx"] = row_of.to(torch.int32)
        rows = (row_of[:, None].expand(BATCH, CAPACITY), positions.expand(BATCH, CAPACITY))
    args["k_cache"] = randn(*cache_shape, seed=5).to(dtype)
    args["v_cache"] = randn(*cache_shape, seed=6).to(dtype)
    if new:
        args["k"] = randn(BATCH, new, KV_HEADS, HEAD_DIM, seed=7).to(dtype)
        args["v"] = randn(BATCH, new, KV_HEADS, HEAD_DIM, seed=8).to(dtype)
    if case.get("leftpad"):
        args["cache_leftpad"] = torch.tensor(LEFTPAD, dtype=torch.int32)
    if case.get("alibi"):
        args["alibi_slopes"] = torch.rand(*case["alibi"], generator=seeded_generator(9))
    if case.get("rotary"):
        angles = torch.rand(CAPACITY, ROTARY_HALF, generator=seeded_generator(10)) * 6.3
        args["rotary_cos"], args["rotary_sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
        args["rotary_interleaved"] = case.get("interleaved", True)
    return args, rows


def kvcache_expected(args, rows, compute_dtype):
    """(out, lse, k rows written, v rows written, where they go) of a flash_attn_with_kvcache
    call, computed in compute_dtype from FlashAttention's documented semantics."""
    lengths = args["cache_seqlens"].long()
    new = args["k"].shape[1] if "k" in args else 0
    q, k_new = args["q"].to(compute_dtype), args.get("k")
    k_cache, v_cache = (args[name].to(compute_dtype).clone() for name in ("k_cache", "v_cache"))
    if "rotary_cos" in args:
        cos, sin, interleaved = args["rotary_cos"], args["rotary_sin"], args["rotary_interleaved"]
        per_position = args["causal"] or args["window_size"] != (-1, -1)
        steps = torch.arange(q.shape[1]) * int(per_position)
        q = rotate_reference(q, cos, sin, lengths[:, None] + steps, interleaved)
        k_positions = lengths[:, None] + torch.arange(new)
        k_new = rotate_reference(k_new, cos, sin, k_positions, interleaved)
        q = q.to(compute_dtype)
    written = None
    if new:
        k_new, v_new = k_new.to(compute_dtype), args["v"].to(compute_dtype)
        positions = lengths[:, None] + torch.arange(new)  # (B, new)
        batch_index = torch.arange(BATCH)[:, None]
        written = (rows[0][batch_index, positions], rows[1][batch_index, positions])
        k_cache[written], v_cache[written] = k_new, v_new
    keys, values = k_cache[rows], v_cache[rows]  # (B, CAPACITY, Hkv, D) each sequence's rows
    out, lse = fa_reference(
        q,
        keys,
        values,
        causal=args["causal"],
        window=args["window_size"],
        softcap=args["softcap"],
        alibi=args.get("alibi_slopes"),
        key_start=args.get("cache_leftpad"),
        key_end=lengths + new,
    )
    return out, lse, k_new, (args.get("v") if new else None), written


@pytest.mark.parametrize("case", KVCACHE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_kvcache(dtype, case, monkeypatch):
    options = KVCACHE_CASES[case]
    args, rows = kvcache_inputs(options, dtype)
    original_k, original_v = args["k_cache"].clone(), args["v_cache"].clone()
    out64, lse64, k_rows, v_rows, written = kvcache_expected(args, rows, torch.float64)
    plain, plain_lse, _, _, _ = kvcache_expected(args, rows, dtype)
    calls = spy_on_paged_kernel(monkeypatch)
    out, lse = flash_attn_with_kvcache(**args)

    assert out.shape == args["q"].shape and lse.shape == (BATCH, HEADS, options["seqlen_q"])
    check(out, out64, plain, f"{case} out")
    check(lse, lse64, plain_lse, f"{case} lse")
    # The documented fast path: the paged kernel unless leftpad or a non-causal chunk, or a
    # sequence with fewer keys than queries.
    fits = min(n + options["new"] for n in CACHE_SEQLENS) >= options["seqlen_q"]
    bounded_right = options.get("causal") or options.get("window", (-1, -1))[1] == 0
    expect_paged = (
        not options.get("leftpad") and (bounded_right or options["seqlen_q"] == 1) and fits
    )
    assert bool(calls) == expect_paged

    k_after, v_after = args["k_cache"], args["v_cache"]
    if written is None:
        assert torch.equal(k_after, original_k) and torch.equal(v_after, original_v)
        return
    assert torch.equal(v_after[written], v_rows)
    if "rotary_cos" in args:  # rotated in fp32 by the kernel: one rounding of k's dtype apart
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(k_after[written], k_rows.to(dtype), rtol=eps, atol=eps)
    else:
        assert torch.equal(k_after[written], args["k"])
    untouched = torch.ones(k_after.shape[:2], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_after[untouched], original_k[untouched])
    assert torch.equal(v_after[untouched], original_v[untouched])


def test_with_kvcache_defaults():
    # No cache_seqlens: the whole cache; an int cache_seqlens: every sequence; no lse.
    q = randn(2, 1, HEADS, HEAD_DIM, seed=1)
    k_cache = randn(2, 6, KV_HEADS, HEAD_DIM, seed=2)
    v_cache = randn(2, 6, KV_HEADS, HEAD_DIM, seed=3)
    out = flash_attn_with_kvcache(q, k_cache, v_cache)
    expected, _ = fa_reference(q.double(), k_cache.double(), v_cache.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    out4 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, num_splits=3)
    expected4, _ = fa_reference(q.double(), k_cache[:, :4].double(), v_cache[:, :4].double())
    torch.testing.assert_close(out4.double(), expected4, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- argument errors


def with_kvcache_error_cases():
    """(description, arguments changed from a valid paged or contiguous call, error pattern)."""
    paged = KVCACHE_CASES["chunk_paged_causal_rotary_interleaved"]
    contiguous = KVCACHE_CASES["batch_idx_window_alibi_rotary"]
    bad_table = shuffled_block_table(BATCH, CAPACITY // BLOCK_SIZE, 12, seed=4)
    bad_table[2, 1] = 99  # sequence 2's tokens 8..15 would be there
    bad_table[0, 2] = -5  # past sequence 0's 8 tokens: never followed, so allowed
    two_bad = shuffled_block_table(BATCH, CAPACITY // BLOCK_SIZE, 12, seed=4)
    two_bad[2, 0] = -1
    two_bad[1, 0] = 12  # one past the last block; reported first, in row-major order
    int32 = torch.int32
    return [
        ("overflow", paged, {"cache_seqlens": torch.tensor([5, 0, 22], dtype=int32)},
         r"cache_seqlens\[2\] = 22 must be in \[0, 21\]"),
        ("negative length", paged, {"cache_seqlens": torch.tensor([5, -1, 2], dtype=int32)},
         r"cache_seqlens\[1\] = -1"),
        ("int64 lengths", paged, {"cache_seqlens": torch.tensor(CACHE_SEQLENS)},
         r"cache_seqlens must be a torch.int32 tensor of shape \(3,\), got torch.int64"),
        ("block table", paged, {"block_table": bad_table},
         r"block_table\[2, 1\] = 99 is outside the cache's 12 blocks"),
        ("block table, first bad entry", paged, {"block_table": two_bad},
         r"block_table\[1, 0\] = 12 is outside the cache's 12 blocks"),
        ("paged batch idx", paged, {"cache_batch_idx": torch.tensor([0, 1, 2], dtype=int32)},
         r"cache_batch_idx cannot be used with a paged cache"),
        ("batch idx", contiguous, {"cache_batch_idx": torch.tensor([0, 7, 1], dtype=int32)},
         r"cache_batch_idx\[1\] = 7 is outside the cache's 5 rows"),
        ("leftpad", contiguous, {"cache_leftpad": torch.tensor([6, 0, 0], dtype=int32)},
         r"cache_leftpad\[0\] = 6 must be in \[0, cache_seqlens\[0\] = 5\]"),
        ("k shape", paged, {"k": torch.zeros(BATCH, 3, HEADS, HEAD_DIM)},
         r"k must be \(batch_size, seqlen_new, nheads_k, headdim\) = \(3, 3, 2, 16\)"),
        ("k without v", paged, {"v": None}, r"k and v must be given together"),
        ("rotary without k", paged, {"k": None, "v": None},
         r"rotary_cos/rotary_sin rotate the new k"),
        ("short rotary", paged,
         {"rotary_cos": torch.zeros(10, ROTARY_HALF), "rotary_sin": torch.zeros(10, ROTARY_HALF)},
         r"seqlen_ro >= the cache's length 24"),
        ("k without lengths", paged, {"cache_seqlens": None}, r"k and v need cache_seqlens"),
        ("window", paged, {"window_size": (1, 2, 3)}, r"window_size must be a pair"),
        ("alibi", contiguous, {"alibi_slopes": torch.zeros(HEADS + 1)},
         r"alibi_slopes must have shape \(nheads,\) = \(4,\)"),
    ]  # fmt: skip


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    "case, change, pattern",
    [case[1:] for case in with_kvcache_error_cases()],
    ids=[case[0] for case in with_kvcache_error_cases()],
)
def test_with_kvcache_bad_input_raises_and_leaves_the_cache_unchanged(case, change, pattern):
    args, _ = kvcache_inputs(case, torch.float32)
    original_k, original_v = args["k_cache"].clone(), args["v_cache"].clone()
    args.update(change)
    with pytest.raises(FlashAttnArgumentError, match=pattern) as raised:
        flash_attn_with_kvcache(**args)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, RuntimeError)
    assert torch.equal(args["k_cache"], original_k) and torch.equal(args["v_cache"], original_v)


def test_with_kvcache_cache_layout_errors():
    q = torch.zeros(2, 1, HEADS, HEAD_DIM)
    cache = torch.zeros(2, 8, KV_HEADS, HEAD_DIM)
    strided = torch.zeros(2, 8, KV_HEADS, 2 * HEAD_DIM)[..., ::2]
    with pytest.raises(FlashAttnArgumentError, match="k_cache must have contiguous last dim"):
        flash_attn_with_kvcache(q, strided, cache)
    with pytest.raises(FlashAttnArgumentError, match=r"v_cache has dtype torch.bfloat16"):
        flash_attn_with_kvcache(q, cache, cache.bfloat16())
    with pytest.raises(FlashAttnArgumentError, match=r"k_cache holds 2 sequences but q has"):
        flash_attn_with_kvcache(torch.zeros(3, 1, HEADS, HEAD_DIM), cache, cache)
    with pytest.raises(FlashAttnArgumentError, match=r"heads in k_cache \(3\) must divide"):
        three_heads = torch.zeros(2, 8, 3, HEAD_DIM)
        flash_attn_with_kvcache(q, three_heads, three_heads)


def test_dense_and_varlen_argument_errors():
    q = torch.zeros(2, 5, HEADS, HEAD_DIM)
    kv = torch.zeros(2, 7, 3, HEAD_DIM)
    with pytest.raises(FlashAttnArgumentError, match=r"heads in k \(3\) must divide .* q \(4\)"):
        flash_attn_func(q, kv, kv)
    with pytest.raises(FlashAttnArgumentError, match=r"q must be \(batch_size, seqlen, nheads"):
        flash_attn_func(q[0], kv[0], kv[0])
    with pytest.raises(FlashAttnArgumentError, match=r"k and v must agree"):
        flash_attn_func(q, q, q[:, :4])
    with pytest.raises(FlashAttnArgumentError, match=r"alibi_slopes must have shape"):
        flash_attn_func(q, q, q, alibi_slopes=torch.zeros(3, HEADS))
    with pytest.raises(FlashAttnArgumentError, match=r"window_size must be a pair"):
        flash_attn_func(q, q, q, window_size=(1.5, 2))
    with pytest.raises(FlashAttnArgumentError, match=r"qkv must be .* with 3 at dim 2"):
        flash_attn_qkvpacked_func(torch.zeros(2, 5, 2, HEADS, HEAD_DIM))
    with pytest.raises(FlashAttnArgumentError, match=r"kv must be .* with 2 at dim 1"):
        flash_attn_varlen_kvpacked_func(q[0], q[0, :, None], None, None, 5, 5)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(FlashAttnArgumentError, match=r"block_table must be a torch.int32"):
        flash_attn_varlen_func(q[0], q, q, cu, cu, 5, 5, block_table=torch.zeros(1, 2))


# ---------------------------------------------------------------- torch.compile


def compiled_with_counter(fn):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def test_compile_flash_attn_func_without_recompiling_per_length():
    compiled, counter = compiled_with_counter(flash_attn_func)
    for seq_q, seq_k in ((5, 9), (7, 12), (11, 20)):
        q = randn(2, seq_q, HEADS, HEAD_DIM, seed=seq_q)
        k, v = (randn(2, seq_k, KV_HEADS, HEAD_DIM, seed=seq_k + s) for s in (0, 1))
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 1)
        options = {"causal": True, "window_size": (4, 0), "softcap": 2.0}
        out = compiled(q, k, v, **options)
        torch.testing.assert_close(out, flash_attn_func(q, k, v, **options))
    assert counter.frame_count == 1


def test_compile_flash_attn_varlen_func_without_recompiling_per_length():
    compiled, counter = compiled_with_counter(flash_attn_varlen_func)
    batches = (([3, 5], [4, 5]), ([6, 1], [6, 2]), ([2, 7], [5, 7]), ([9, 4], [9, 6]))
    for step, (q_lens, k_lens) in enumerate(batches):
        cu_q, cu_k = (torch.tensor(cumulative(n), dtype=torch.int32) for n in (q_lens, k_lens))
        q = randn(sum(q_lens), HEADS, HEAD_DIM, seed=sum(q_lens))
        k, v = (randn(sum(k_lens), KV_HEADS, HEAD_DIM, seed=sum(k_lens) + s) for s in (0, 1))
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 0)
        args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
        # The max_seqlen ints are constants in the first graph; once they change dynamo
        # compiles them symbolic (automatic dynamic), and no new value recompiles after that.
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            out = compiled(*args, causal=True)
        torch.testing.assert_close(out, flash_attn_varlen_func(*args, causal=True))
    assert counter.frame_count == 2


def test_compile_flash_attn_with_kvcache_without_recompiling_per_length():
    compiled, counter = compiled_with_counter(flash_attn_with_kvcache)
    case = KVCACHE_CASES["chunk_paged_causal_rotary_interleaved"]
    for seqlen, lengths in ((2, [5, 0, 17]), (3, [1, 9, 4]), (5, [0, 2, 19])):
        args, _ = kvcache_inputs(dict(case, seqlen_q=seqlen, new=seqlen), torch.float32)
        args["cache_seqlens"] = torch.tensor(lengths, dtype=torch.int32)
        for name in ("q", "k", "v"):
            torch._dynamo.mark_dynamic(args[name], 1)
        eager_k, eager_v = args["k_cache"].clone(), args["v_cache"].clone()
        out, lse = compiled(**args)
        eager_out, eager_lse = flash_attn_with_kvcache(
            **dict(args, k_cache=eager_k, v_cache=eager_v)
        )
        torch.testing.assert_close((out, lse), (eager_out, eager_lse))
        assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)
    assert counter.frame_count == 1
    # Traced code skips the host checks; a token addressed past its sequence's blocks is still
    # refused by the append kernel before anything is written.
    del args["rotary_cos"], args["rotary_sin"]
    args["cache_seqlens"] = torch.tensor([5, 0, 22], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        compiled(**args)
    assert torch.equal(args["k_cache"], eager_k) and torch.equal(args["v_cache"], eager_v)

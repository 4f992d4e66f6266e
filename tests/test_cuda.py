"""What only the CUDA backend has: streams, CUDA graphs, torch.compile's reduce-overhead mode,
both kernel families (tensor cores and the generic SIMT path), guarded paged indices, and a
race check. Every other test file also runs on CUDA through the `device` fixture."""

import pytest
import torch
from feature_reference import featured_attention, featured_attention_varlen
from test_attention import check_backward, check_forward, gradients, resolve

import mha_ext
from mha_ext.reference import attention_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator
from test_paged import build_paged, make_cache

pytestmark = pytest.mark.cuda_only


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize(
    "masking", ["none", "causal_bottom_right", "window_both_sides", "additive_mask"]
)
def test_both_kernel_families_match_the_reference(kernels, dtype, head_dim, masking, monkeypatch):
    # auto takes the tensor-core forward and backward for head dims 64 and 128, simt never does.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v = random_qkv(2, 8, 2, 150, 333, head_dim, dtype=dtype)
    check_forward(q, k, v, resolve(masking, 2, 8, 150, 333, dtype))
    check_backward(q, k, v, resolve(masking, 2, 8, 150, 333, dtype))


def test_unknown_kernel_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", "fast")
    q, k, v = random_qkv(1, 2, 2, 8, 8, 64)
    with pytest.raises(
        RuntimeError, match=r"MHA_EXT_CUDA_KERNELS must be auto or simt, got 'fast'"
    ):
        mha_ext.attention(q, k, v)


def test_unaligned_rows_take_the_generic_kernel():
    # A head-dim-64 view into rows of 68: 16-byte loads would be misaligned.
    base = torch.randn(1, 4, 100, 68, dtype=torch.float16)
    q, k, v = base[..., :64], base[..., 2:66], base[..., 4:68]
    check_forward(q, k, v, {"causal": "top_left"})


def test_side_stream_gives_the_default_stream_results():
    q, k, v = random_qkv(2, 8, 4, 300, 300, 64, dtype=torch.bfloat16)
    grad_out = torch.randn_like(q)
    expected = gradients(
        lambda *t: mha_ext.attention(*t, causal="bottom_right"), (q, k, v), grad_out
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = gradients(
            lambda *t: mha_ext.attention(*t, causal="bottom_right"), (q, k, v), grad_out
        )
        q_p, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(
            [40, 300], [1, 5], 8, 2, 64, 16
        )
        paged = mha_ext.paged_attention(q_p, k_cache, v_cache, tables, seq_lens, cu)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got[0], expected[0])  # the forward is deterministic
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b)  # dQ is summed with atomics: order may differ
    torch.testing.assert_close(
        paged, mha_ext.paged_attention(q_p, k_cache, v_cache, tables, seq_lens, cu), rtol=0, atol=0
    )


def test_decode_step_captured_in_a_cuda_graph():
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    # 26, 60 and 5 cached tokens in 2, 4 and 1 blocks: room for the 4 appended tokens.
    _, k_cache, v_cache, tables, _, _, _, _ = build_paged(
        [26, 60, 5], [1, 1, 1], heads, kv_heads, head_dim, block_size
    )
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    generator = seeded_generator(11)
    static_q = torch.randn(3, heads, head_dim, generator=generator)
    static_key = torch.randn(3, kv_heads, head_dim, generator=generator)
    static_value = torch.randn(3, kv_heads, head_dim, generator=generator)
    static_lens = torch.tensor([27, 61, 6], dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)

    def slots_of(lens):
        return torch.stack(
            [
                mha_ext.slot_mapping_for(tables[b], lens[b : b + 1].long() - 1, block_size)[0]
                for b in range(3)
            ]
        )

    static_slots = slots_of(static_lens)

    def step(k_cache, v_cache):
        mha_ext.paged_kv_append(static_key, static_value, k_cache, v_cache, static_slots)
        return mha_ext.paged_attention(static_q, k_cache, v_cache, tables, static_lens, cu)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(k_cache, v_cache)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    for _ in range(3):  # three decode steps: new tokens, longer sequences
        static_q.copy_(torch.randn(static_q.shape, generator=generator))
        static_key.copy_(torch.randn(static_key.shape, generator=generator))
        static_value.copy_(torch.randn(static_value.shape, generator=generator))
        static_lens += 1
        static_slots.copy_(slots_of(static_lens))
        graph.replay()
        expected = step(eager_k, eager_v)
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_decode_step_captured_in_a_cuda_graph(fmt):
    # An 8-bit cache's append (the int8 scales written too) and attention replay in a graph.
    from test_paged_quant import bits, build_quantized

    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    _, k_cache, v_cache, (tables, _, cu), scales = build_quantized(
        fmt, [26, 60, 5], [1, 1, 1], heads, kv_heads, head_dim, block_size, torch.bfloat16
    )
    generator = seeded_generator(12)
    static_q = torch.randn(3, heads, head_dim, generator=generator).bfloat16()
    static_key = torch.randn(3, kv_heads, head_dim, generator=generator).bfloat16()
    static_value = torch.randn(3, kv_heads, head_dim, generator=generator).bfloat16()
    static_lens = torch.tensor([27, 61, 6], dtype=torch.int32)
    static_slots = torch.stack(
        [
            mha_ext.slot_mapping_for(tables[b], static_lens[b : b + 1].long() - 1, block_size)[0]
            for b in range(3)
        ]
    )

    def step(k_cache, v_cache, scales):
        mha_ext.paged_kv_append(static_key, static_value, k_cache, v_cache, static_slots, **scales)
        return mha_ext.paged_attention(
            static_q, k_cache, v_cache, tables, static_lens, cu, **scales
        )

    def copies():
        return (
            k_cache.clone(),
            v_cache.clone(),
            {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in scales.items()},
        )

    eager = copies()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        step(*copies())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(k_cache, v_cache, scales)
    graph.replay()
    expected = step(*eager)
    torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
    assert torch.equal(bits(k_cache), bits(eager[0])) and torch.equal(bits(v_cache), bits(eager[1]))


def test_compile_reduce_overhead_matches_eager():
    torch.manual_seed(0)
    layer = mha_ext.MultiHeadAttention(256, 8, dropout=0.0, num_kv_heads=2).eval()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(2, 100, 256)
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            got = compiled(x, x, x, is_causal=True)
        torch.testing.assert_close(got, layer(x, x, x, is_causal=True), rtol=1e-5, atol=1e-5)


def test_out_of_range_slots_are_skipped_in_the_kernel():
    k_cache, v_cache = make_cache(4, 2, 4, 8), make_cache(4, 2, 4, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    mha_ext.paged_kv_append(key, value, k_cache, v_cache, torch.tensor([0, 1000, -2, 5]))
    expected_k, expected_v = before_k.clone(), before_v.clone()
    expected_k[0, :, 0], expected_v[0, :, 0] = key[0], value[0]
    expected_k[1, :, 1], expected_v[1, :, 1] = key[3], value[3]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_bad_block_ids_hide_keys_instead_of_reading_outside_the_cache():
    q, k_cache, v_cache, tables, seq_lens, cu, keys, values = build_paged(
        [20, 40], [1, 1], 4, 2, 32, 8
    )
    bad = tables.clone()
    bad[1, 0] = 10**6  # keys 0-7 of sequence 1 become invisible
    out = mha_ext.paged_attention(q, k_cache, v_cache, bad, seq_lens, cu)
    torch.cuda.synchronize()
    q_b, k_b, v_b = (t.transpose(0, 1)[None] for t in (q[1:2], keys[1][8:], values[1][8:]))
    ref, _ = attention_reference(q_b.double(), k_b.double(), v_b.double())
    plain, _ = attention_reference(q_b, k_b, v_b)
    assert_within_rule(out[1:2].transpose(0, 1)[None], ref, plain, OUTPUT_FACTOR, "visible keys")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repeated_runs_agree_race_check(dtype):
    # A missing barrier or a shared-memory race shows as results that change from run to run.
    q, k, v = random_qkv(2, 8, 2, 257, 513, 128, dtype=dtype)
    grad_out = torch.randn(q.shape, dtype=dtype)

    def fn(*t):
        return mha_ext.attention(*t, causal="bottom_right", window=(100, 0))

    out, (grad_q, grad_k, grad_v) = gradients(fn, (q, k, v), grad_out)
    for _ in range(20):
        out_again, (grad_q_again, grad_k_again, grad_v_again) = gradients(fn, (q, k, v), grad_out)
        assert torch.equal(out_again, out)
        # dQ adds the key blocks' parts with atomics in any order: equal up to fp32 rounding.
        torch.testing.assert_close(
            grad_q_again, grad_q, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3
        )
        assert torch.equal(grad_k_again, grad_k) and torch.equal(grad_v_again, grad_v)


def packed_case(seqlens_q, seqlens_k, heads, kv_heads, head_dim, dtype, seed=0):
    """Packed q, k, v and their cu_seqlens for the given lengths."""
    generator = seeded_generator(seed)
    q = torch.randn(sum(seqlens_q), heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(sum(seqlens_k), kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(sum(seqlens_k), kv_heads, head_dim, generator=generator).to(dtype)
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        for lens in (seqlens_q, seqlens_k)
    )
    return q, k, v, cu_q, cu_k


def check_with_features(call, reference, inputs, grad_out, grad_lse):
    """call(*leaves) -> (out, lse) of mha_ext; reference(*leaves) -> featured_attention's. The
    accuracy rule for out and the gradients of every input (q, k, v, sinks)."""
    results = {}
    for name, fn, cast in (
        ("kernel", call, lambda t: t),
        ("float64", reference, lambda t: t.double()),
        ("plain", reference, lambda t: t),
    ):
        leaves = [cast(t).detach().clone().requires_grad_() for t in inputs]
        out, lse = fn(*leaves)
        finite = torch.isfinite(lse)
        grads = torch.autograd.grad(
            (out, lse[finite]), leaves, (grad_out.to(out.dtype), grad_lse[finite].to(lse.dtype))
        )
        results[name] = (out.detach(), lse.detach(), grads)
    out, lse, grads = results["kernel"]
    ref_out, ref_lse, ref_grads = results["float64"]
    plain_out, _, plain_grads = results["plain"]
    assert_within_rule(out, ref_out, plain_out, OUTPUT_FACTOR, "output")
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), "lse -inf rows"
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)
    for name, grad, ref, plain in zip(["q", "k", "v", "sinks"], grads, ref_grads, plain_grads):
        assert_within_rule(grad, ref, plain, GRAD_FACTOR, f"grad_{name}")


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
def test_packed_sequences_with_softcap_alibi_and_sinks(
    kernels, dtype, head_dim, deterministic, monkeypatch
):
    # GQA, a bottom-right window, a sequence without queries, one whose queries see no key
    # (seqused_k 0), sequences longer than a row tile, per-sequence ALiBi slopes.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    seqlens_q, seqlens_k, used_k = (
        [300, 0, 129, 17, 64],
        [280, 40, 400, 30, 64],
        [280, 40, 333, 0, 64],
    )
    heads, kv_heads = 8, 2
    q, k, v, cu_q, cu_k = packed_case(seqlens_q, seqlens_k, heads, kv_heads, head_dim, dtype)
    generator = seeded_generator(5)
    slopes = 0.2 * torch.rand(len(seqlens_q), heads, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    seqused_k = torch.tensor(used_k, dtype=torch.int32)
    options = dict(window=(150, 7), softcap=8.0)
    grad_out = torch.randn(q.shape, generator=generator).to(dtype)
    grad_lse = torch.randn(heads, q.shape[0], generator=generator)

    def call(q, k, v, sinks):
        return mha_ext.attention_varlen(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(seqlens_q),
            max(seqlens_k),
            alibi_slopes=slopes,
            sinks=sinks,
            seqused_k=seqused_k,
            return_lse=True,
            deterministic=deterministic,
            **options,
        )

    def reference(q, k, v, sinks):
        return featured_attention_varlen(
            q,
            k,
            v,
            cu_q,
            cu_k,
            seqused_k,
            bottom_right=True,
            alibi_slopes=slopes.to(q.dtype),
            sinks=sinks,
            **options,
        )

    check_with_features(call, reference, (q, k, v, sinks), grad_out, grad_lse)


@pytest.mark.parametrize("kernels", ["auto", "simt"])
def test_dense_softcap_alibi_and_sinks(kernels, monkeypatch):
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    q, k, v = random_qkv(2, 8, 2, 150, 333, 128, dtype=torch.bfloat16)
    generator = seeded_generator(6)
    slopes = 0.1 * torch.rand(8, generator=generator)
    sinks = torch.randn(8, generator=generator)
    grad_out = torch.randn(q.shape, generator=generator).to(q.dtype)
    grad_lse = torch.randn(q.shape[:3], generator=generator)

    def call(q, k, v, sinks):
        return mha_ext.attention(
            q,
            k,
            v,
            causal="bottom_right",
            softcap=10.0,
            alibi_slopes=slopes,
            sinks=sinks,
            return_lse=True,
        )

    def reference(q, k, v, sinks):
        return featured_attention(
            q,
            k,
            v,
            window=(-1, 0),
            bottom_right=True,
            softcap=10.0,
            alibi_slopes=slopes.to(q.dtype),
            sinks=sinks,
        )

    check_with_features(call, reference, (q, k, v, sinks), grad_out, grad_lse)


@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_deterministic_gradients_are_bitwise_equal_race_check(kernels, layout, monkeypatch):
    # Many key blocks add into each dQ row with atomics unless deterministic=True.
    monkeypatch.setenv("MHA_EXT_CUDA_KERNELS", kernels)
    if layout == "dense":
        q, k, v = random_qkv(2, 8, 2, 257, 1025, 128, dtype=torch.bfloat16)

        def fn(*t):
            return mha_ext.attention(*t, causal="bottom_right", softcap=20.0, deterministic=True)
    else:
        q, k, v, cu_q, cu_k = packed_case([500, 3, 700], [900, 1, 1024], 8, 2, 128, torch.bfloat16)

        def fn(*t):
            return mha_ext.attention_varlen(
                *t, cu_q, cu_k, 700, 1024, causal="bottom_right", deterministic=True
            )

    grad_out = torch.randn(q.shape, dtype=q.dtype)
    out, grads = gradients(fn, (q, k, v), grad_out)
    for _ in range(10):
        out_again, grads_again = gradients(fn, (q, k, v), grad_out)
        assert torch.equal(out_again, out)
        for a, b in zip(grads_again, grads):
            assert torch.equal(a, b)

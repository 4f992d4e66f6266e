"""What only the CUDA backend has: streams, CUDA graphs, torch.compile's reduce-overhead mode,
both kernel families (tensor cores and the generic SIMT path), guarded paged indices, and a
race check. Every other test file also runs on CUDA through the `device` fixture."""

import pytest
import torch
from test_attention import check_backward, check_forward, gradients, resolve

import mha_ext
from mha_ext.reference import attention_reference

from conftest import OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator
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

"""Fused attention against the float64 reference: forward, backward, layouts, masks."""

import pytest
import torch

import mha_ext
from mha_ext.reference import attention_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator
from test_paged import build_paged

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = [(8, 8), (8, 2), (8, 1)]
# (batch, seq_q, seq_k, head_dim, head_dim_v): odd lengths, one-token rows, Sq != Sk both
# ways, head dims that are not powers of two, the 256 maximum and a distinct value dim.
SHAPES = [
    (1, 1, 1, 64, 64),
    (2, 17, 17, 40, 40),
    (1, 113, 203, 80, 80),
    (2, 203, 113, 128, 128),
    (1, 64, 130, 256, 256),
    (1, 17, 300, 64, 32),
]
# Keyword sets for mha_ext.attention (attn_mask is built per case).
MASKINGS = {
    "none": {},
    "causal_top_left": {"causal": "top_left"},
    "causal_bottom_right": {"causal": "bottom_right"},
    "window_causal": {"causal": "bottom_right", "window": (16, 0)},
    "window_both_sides": {"window": (7, 5)},
    "bool_mask": {"attn_mask": "bool"},
    "additive_mask": {"attn_mask": "additive"},
}


def build_mask(kind, batch, heads, seq_q, seq_k, dtype):
    generator = seeded_generator(7)
    if kind == "bool":  # (B, 1, Sq, Sk): broadcast over heads
        return torch.rand(batch, 1, seq_q, seq_k, generator=generator) > 0.3
    return torch.randn(1, heads, seq_q, seq_k, generator=generator).to(dtype)  # over batch


def resolve(masking, batch, heads, seq_q, seq_k, dtype):
    kwargs = dict(MASKINGS[masking])
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = build_mask(kwargs["attn_mask"], batch, heads, seq_q, seq_k, dtype)
    return kwargs


def as_dtype(kwargs, dtype):
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        return {**kwargs, "attn_mask": mask.to(dtype)}
    return kwargs


def check_forward(q, k, v, kwargs):
    out, lse = mha_ext.attention(q, k, v, return_lse=True, **kwargs)
    ref, ref_lse = attention_reference(
        q.double(), k.double(), v.double(), **as_dtype(kwargs, torch.float64)
    )
    plain, _ = attention_reference(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_within_rule(out, ref, plain, OUTPUT_FACTOR, "output")
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows without keys must have lse -inf"
    assert (lse[~seen] == float("-inf")).all()
    # Scores are exact products of the inputs summed in fp32: lse is accurate to fp32 rounding.
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("masking", list(MASKINGS))
def test_forward_matches_reference(dtype, heads, shape, masking):
    batch, seq_q, seq_k, head_dim, head_dim_v = shape
    q, k, v = random_qkv(batch, *heads, seq_q, seq_k, head_dim, head_dim_v, dtype=dtype)
    check_forward(q, k, v, resolve(masking, batch, heads[0], seq_q, seq_k, dtype))


def gradients(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out, [leaf.grad for leaf in leaves]


def check_backward(q, k, v, kwargs):
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=seeded_generator(3)).to(q.dtype)
    _, grads = gradients(lambda *t: mha_ext.attention(*t, **kwargs), (q, k, v), grad_out)
    _, ref_grads = gradients(
        lambda *t: attention_reference(*t, **as_dtype(kwargs, torch.float64))[0],
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    _, plain_grads = gradients(lambda *t: attention_reference(*t, **kwargs)[0], (q, k, v), grad_out)
    for name, grad, ref, plain, like in zip("qkv", grads, ref_grads, plain_grads, (q, k, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert_within_rule(grad, ref, plain, GRAD_FACTOR, f"grad_{name}")


BACKWARD_SHAPES = [
    (1, 1, 1, 64, 64),
    (2, 17, 17, 40, 40),
    (1, 113, 203, 80, 80),
    (1, 130, 70, 128, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("masking", list(MASKINGS))
def test_backward_matches_reference(dtype, heads, shape, masking):
    batch, seq_q, seq_k, head_dim, head_dim_v = shape
    q, k, v = random_qkv(batch, *heads, seq_q, seq_k, head_dim, head_dim_v, dtype=dtype)
    check_backward(q, k, v, resolve(masking, batch, heads[0], seq_q, seq_k, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bshd_views_work_without_copies(dtype):
    q, k, v = random_qkv(2, 8, 2, 45, 77, 64, dtype=dtype, layout="bshd")
    assert not q.is_contiguous()
    out = mha_ext.attention(q, k, v, causal="bottom_right")
    # The output keeps q's (B, S, H, D) storage, so the model's reshape back is a view.
    assert out.transpose(1, 2).is_contiguous()
    check_forward(q, k, v, {"causal": "bottom_right"})
    check_backward(q, k, v, {"causal": "bottom_right"})


def test_strided_rows_and_heads():
    # Slices of wider tensors: row and head strides differ from the packed ones.
    base = torch.randn(2, 8, 60, 96)
    q = base[:, :, :50, :64]
    k = torch.randn(2, 4, 70, 80)[:, ::2, :, 16:]  # every other head, offset columns
    v = torch.randn(2, 2, 140, 32)[:, :, ::2]  # every other row
    assert q.stride(2) == 96 and k.stride(1) == 2 * 70 * 80 and v.stride(2) == 64
    check_forward(q, k, v, {"causal": "top_left"})
    check_backward(q, k, v, {"window": (9, 3)})


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", ["odd_head_dim", "odd_value_dim", "rows_off_4_bytes"])
def test_bf16_inputs_the_brgemm_kernels_refuse_take_the_fp32_tiles(case):
    # The AVX-512 build runs bf16 on brgemm only for even head dims (the backward also an
    # even value dim) and 4-byte aligned rows, read as bf16 pairs; anything else must fall
    # back to the fp32 tile kernels, not read pairs across rows.
    dims = {"odd_head_dim": (63, 64), "odd_value_dim": (64, 33), "rows_off_4_bytes": (64, 64)}[case]
    q, k, v = random_qkv(2, 8, 2, 37, 70, *dims, dtype=torch.bfloat16)
    if case == "rows_off_4_bytes":  # every tensor one bf16 element past a 4-byte boundary
        q, k, v = (torch.cat([t.flatten(), t.new_zeros(1)])[1:].view(t.shape) for t in (q, k, v))
        assert all(t.data_ptr() % 4 == 2 for t in (q, k, v))
    check_forward(q, k, v, {"causal": "bottom_right"})
    check_backward(q, k, v, {"causal": "bottom_right"})


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_finite_grads():
    q, k, v = random_qkv(2, 4, 2, 24, 16, 32)
    mask = torch.rand(2, 1, 24, 16) > 0.5
    mask[:, :, 3] = False  # row 3 sees nothing, in every batch and head
    mask[1, :, 10:14] = False
    out, lse = mha_ext.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out[:, :, 3] == 0).all() and (lse[:, :, 3] == float("-inf")).all()
    assert (out[1, :, 10:14] == 0).all()
    check_forward(q, k, v, {"attn_mask": mask})
    check_backward(q, k, v, {"attn_mask": mask})
    # Bottom-right causal with more queries than keys: the first Sq - Sk rows see no key.
    q2, k2, v2 = random_qkv(1, 4, 4, 40, 25, 32)
    out2, lse2 = mha_ext.attention(q2, k2, v2, causal="bottom_right", return_lse=True)
    assert (out2[:, :, :15] == 0).all() and (lse2[:, :, :15] == float("-inf")).all()
    assert torch.isfinite(lse2[:, :, 15:]).all()
    check_backward(q2, k2, v2, {"causal": "bottom_right"})


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_no_key_reaches_get_zero_grad_q_whatever_memory_they_get(dtype):
    # Rows that see no key get dQ = 0, which the CPU backward writes itself rather than
    # relying on zeroed memory: freed buffers of grad_q's size, filled with NaN, are what
    # the allocator hands out next. Bottom-right causal with 200 queries over 40 keys
    # leaves the first 160 rows (two whole 64-row blocks) without keys; 4 kv heads keep the
    # key range in one split.
    q, k, v = random_qkv(1, 4, 4, 200, 40, 64, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mha_ext.attention(*leaves, causal="bottom_right")
    grad_out = torch.randn(out.shape).to(dtype)
    for _ in range(3):
        poison = [torch.full_like(q, float("nan")) for _ in range(32)]
        del poison
        (grad_q,) = torch.autograd.grad(out, leaves[0], grad_out, retain_graph=True)
        assert (grad_q[:, :, :160] == 0).all()
        assert torch.isfinite(grad_q).all()


def test_lse_gradient_flows():
    q, k, v = random_qkv(1, 4, 2, 33, 47, 32, dtype=torch.float64)
    weights = torch.randn(1, 4, 33, dtype=torch.float64)

    def loss(fn, *t):
        out, lse = fn(*t)
        return out.sum() + (lse * weights).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(
        lambda *t: mha_ext.attention(*t, causal="bottom_right", return_lse=True), *leaves
    ).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(lambda *t: attention_reference(*t, causal="bottom_right"), *ref_leaves).backward()
    for leaf, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("needs_grad", ["none", "q", "k", "v"])
def test_graph_is_recorded_only_when_an_input_needs_grad(needs_grad):
    q, k, v = random_qkv(1, 4, 2, 9, 13, 16)
    inputs = {"q": q, "k": k, "v": v}
    if needs_grad != "none":
        inputs[needs_grad].requires_grad_()
    expected, _ = attention_reference(q.double(), k.double(), v.double())
    out = mha_ext.attention(inputs["q"], inputs["k"], inputs["v"])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert out.requires_grad == (needs_grad != "none")
    if needs_grad != "none":
        out.sum().backward()
        assert inputs[needs_grad].grad is not None and inputs[needs_grad].grad.abs().sum() > 0
        with torch.no_grad():  # grad mode off: no graph even for inputs that need grad
            assert mha_ext.attention(inputs["q"], inputs["k"], inputs["v"]).grad_fn is None
    with torch.inference_mode():
        torch.testing.assert_close(
            mha_ext.attention(q, k, v).double(), expected, rtol=1e-5, atol=1e-5
        )


def test_fp64_lse_is_fp64():
    q, k, v = random_qkv(1, 2, 2, 5, 7, 16, dtype=torch.float64)
    _, lse = mha_ext.attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"causal": "top_left", "scale": 0.3},
        {"causal": "bottom_right", "window": (5, 0)},
        {"window": (3, 2)},
        {"attn_mask": "additive"},
        {"attn_mask": "bool"},
    ],
    ids=["plain", "causal_tl_scale", "causal_br_window", "window", "additive", "bool"],
)
def test_gradcheck_fp64(kwargs):
    q, k, v = random_qkv(1, 4, 2, 9, 13, 8, head_dim_v=6, dtype=torch.float64)
    kwargs = dict(kwargs)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = build_mask(kwargs["attn_mask"], 1, 4, 9, 13, torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]

    def fn(*t):
        out, lse = mha_ext.attention(*t, return_lse=True, **kwargs)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_tiles_many_blocks_causal(dtype):
    # Several 64-row query and key blocks, ragged edges, both alignments, GQA. 301 query
    # rows: the bf16 backward's dK / dV products take 4 query blocks at a time, so this is
    # a whole chunk and an odd-length one, and the window starts chunks mid-sequence.
    q, k, v = random_qkv(1, 4, 2, 301, 333, 64, dtype=dtype)
    for causal in ("top_left", "bottom_right"):
        check_forward(q, k, v, {"causal": causal})
    check_backward(q, k, v, {"causal": "bottom_right", "window": (100, 0)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_scores_that_outgrow_the_running_max(dtype, causal):
    # The forward's online softmax moves a row's max only when a key tile's scores exceed it
    # by a margin, rescaling the sum and output then. Keys scaled up along the sequence give
    # scores whose spread grows from ~0.5 to ~12 standard deviations, so later tiles keep
    # overtaking the max of earlier ones.
    q, k, v = random_qkv(1, 4, 2, 150, 300, 64, dtype=dtype)
    k = (k.float() * torch.linspace(0.5, 12.0, 300)[:, None]).to(dtype)
    kwargs = {} if causal is None else {"causal": causal}
    check_forward(q, k, v, kwargs)
    check_backward(q, k, v, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(dtype):
    # A NaN score must leave the softmax's exp as NaN, as in torch SDPA, and reach no row that
    # cannot see it: the exps zero only arguments that compare below their cut-off, and the
    # AVX2 one builds 2^n from the bits of its rounded argument, where only the multiply by
    # the polynomial keeps a NaN a NaN. Key 70 (the second key tile) of kv head 1, which
    # query heads 2 and 3 read, holds one NaN; causal rows before 70 never see it.
    q, k, v = random_qkv(1, 4, 2, 100, 100, 64, dtype=dtype)
    k[0, 1, 70, 5] = float("nan")
    out = mha_ext.attention(q, k, v, causal="top_left")
    sees_key = torch.arange(100) >= 70
    assert out[0, 2:, sees_key].isnan().all()
    assert torch.isfinite(out[0, 2:, ~sees_key]).all() and torch.isfinite(out[0, :2]).all()


def test_bf16_outputs_keep_subnormal_values():
    # bf16 outputs below the smallest normal (1.2e-38) must round as torch's conversion does,
    # not flush to zero (the CPU kernels' fast bf16 rounding instruction alone would). With
    # q = 0 every key weighs 1/90; values of +-2e-38 (normal) sum to 2 x 2e-38 and average
    # to 4.4e-40, a bf16 subnormal. (Subnormal inputs would not do: AMX products read them
    # as 0, in torch's kernels too.)
    seq_k = 90
    q = torch.zeros(1, 4, 30, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, seq_k, 64).bfloat16()
    value = torch.tensor(2e-38).bfloat16()
    signs = torch.tensor([1.0] * 46 + [-1.0] * 44)
    v = (
        (signs[:, None] * value.float())
        .expand(seq_k, 64)
        .reshape(1, 1, seq_k, 64)
        .expand(1, 2, seq_k, 64)
    )
    out = mha_ext.attention(q, k, v.bfloat16().contiguous())
    expected = 2 * value.double() / seq_k
    assert 0 < expected < 1.17e-38
    assert (out != 0).all()
    assert (out.double() - expected).abs().max() <= 9.2e-41  # one bf16 subnormal step


@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 5, 0), (2, 4, 2, 0, 7), (0, 4, 2, 5, 7)],
    ids=["no_keys", "no_queries", "no_batch"],
)
def test_empty_dimensions(shape):
    batch, heads, kv_heads, seq_q, seq_k = shape
    q, k, v = random_qkv(batch, heads, kv_heads, seq_q, seq_k, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = mha_ext.attention(*leaves, return_lse=True)
    assert out.shape == (batch, heads, seq_q, 16) and lse.shape == (batch, heads, seq_q)
    assert (out == 0).all() and (lse == float("-inf")).all()  # no key: output 0, lse -inf
    out.sum().backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape and (leaf.grad == 0).all()


@pytest.mark.cpu_only
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_results_do_not_depend_on_the_thread_count(threads):
    # The kernels size their tasks (query blocks per task, key splits in the backward) by
    # the thread count; every row still sums its keys in the same order, so the forward is
    # bitwise the same, and the backward's split partial sums agree to rounding.
    q, k, v = random_qkv(1, 8, 1, 200, 333, 64)
    grad_out = torch.randn(1, 8, 200, 64)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = mha_ext.attention(*leaves, causal="bottom_right", return_lse=True)
        out.backward(grad_out)
        return out, lse, [leaf.grad for leaf in leaves]

    baseline = run()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        other = run()
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(other[0], baseline[0]) and torch.equal(other[1], baseline[1])
    for grad, expected in zip(other[2], baseline[2]):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    # Paged attention splits long contexts by the thread count too.
    q2, k_cache, v_cache, tables, seq_lens, cu, _, _ = build_paged(
        [100, 2000], [3, 1], 8, 1, 64, 16
    )
    expected = mha_ext.paged_attention(q2, k_cache, v_cache, tables, seq_lens, cu)
    torch.set_num_threads(threads)
    try:
        actual = mha_ext.paged_attention(q2, k_cache, v_cache, tables, seq_lens, cu)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kv_heads, kwargs",
    [(2, {"causal": "bottom_right"}), (1, {"window": (20, 0)})],
    ids=["causal", "window_one_kv_head"],
)
def test_backward_does_not_depend_on_earlier_calls(dtype, kv_heads, kwargs):
    # The CPU backward keeps its workspaces (dQ partial sums, bf16's Q^T and dO^T) between
    # calls, uncleared: a call after a larger one, whose data is still in them, must give the
    # same gradients bit for bit, including the zero padding of a ragged last query block.
    # With one kv head the key range splits across threads, and a window leaves each split
    # query rows that none of its keys reach, whose partial dQ sums the kernels must zero.
    def grads(seq_q, seq_k):
        q, k, v = random_qkv(1, 4, kv_heads, seq_q, seq_k, 64, dtype=dtype)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mha_ext.attention(*leaves, **kwargs)
        out.backward(torch.randn(out.shape, generator=seeded_generator(5)).to(dtype))
        return [leaf.grad for leaf in leaves]

    first = grads(75, 99)
    larger = grads(300, 320)
    again = grads(75, 99)
    assert all(torch.isfinite(g).all() for g in larger)
    for grad, expected in zip(again, first):
        assert torch.equal(grad, expected)

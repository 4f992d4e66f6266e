"""Issue 29's attention variants against the float64 references: softcap, ALiBi, sinks,
packed variable-length sequences, q/k head dims other than v's, and the deterministic
backward; each alone and all at once, forward and backward, with FlashAttention's rule."""

import pytest
import torch

import mha_ext
from mha_ext import ops
from mha_ext.reference import attention_reference, attention_varlen_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule, random_qkv, seeded_generator

# Scores of unit-normal q and k with scale 1/sqrt(D) are about N(0, 1): a cap of 1.5 bends
# most of them and saturates the tails, so the tanh and its derivative both matter.
SOFTCAP = 1.5


def alibi_slopes_for(heads):
    """ALiBi's geometric slopes 2^(-8 h / H), h = 1..H: (H,) fp32."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1) / heads)


def sink_logits_for(heads):
    """(H,) fp32 sinks from -1 to 4: from a share of a few percent of a row of ~50 keys
    (whose lse is about log 50 = 3.9) to most of a row that sees one key."""
    return torch.linspace(-1.0, 4.0, heads)


def features(name, batch, heads):
    """Keyword arguments of one feature set: softcap, ALiBi ((H,) or (B, H) slopes), sinks,
    or all of them."""
    per_batch_slopes = torch.rand(batch, heads, generator=seeded_generator(11)) * 0.5
    return {
        "softcap": {"softcap": SOFTCAP},
        "alibi": {"alibi_slopes": alibi_slopes_for(heads)},
        "alibi_per_batch": {"alibi_slopes": per_batch_slopes},
        "sinks": {"sinks": sink_logits_for(heads)},
        "all": {
            "softcap": SOFTCAP,
            "alibi_slopes": alibi_slopes_for(heads),
            "sinks": sink_logits_for(heads),
        },
    }[name]


FEATURES = ["softcap", "alibi", "alibi_per_batch", "sinks", "all"]
MASKINGS = {
    "none": {},
    "causal_top_left": {"causal": "top_left"},
    "causal_bottom_right": {"causal": "bottom_right"},
    "window": {"window": (6, 2)},
    "window_causal_top_left": {"causal": "top_left", "window": (5, 0)},
}
# (heads, kv_heads, batch, seq_q, seq_k, head_dim, head_dim_v): MHA / GQA / MQA, one token,
# prime lengths both ways round (with bottom-right causal the first Sq - Sk rows of 37 x 23
# see no key), and q/k head dims other than v's (MLA's 192 / 128, and 96 / 64).
GEOMETRIES = [
    (4, 4, 1, 1, 1, 32, 32),
    (4, 2, 2, 17, 17, 40, 40),
    (4, 1, 1, 37, 23, 64, 64),
    (4, 2, 1, 23, 61, 192, 128),
    (2, 1, 2, 13, 29, 96, 64),
]


def geometry_id(geometry):
    heads, kv_heads, batch, seq_q, seq_k, head_dim, head_dim_v = geometry
    return f"h{heads}kv{kv_heads}b{batch}_{seq_q}x{seq_k}_d{head_dim}v{head_dim_v}"


def converted(values, dtype):
    """values (a dict) with its floating-point tensors in `dtype`."""
    return {
        name: value.to(dtype)
        if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in values.items()
    }


def split_inputs(q, k, v, options):
    """(differentiable inputs, other options): sinks get a gradient, ALiBi slopes do not. The
    sinks and slopes go to the accumulation dtype, where the kernels read them."""
    options = converted(options, ops.lse_dtype(q.dtype))
    inputs = {"q": q, "k": k, "v": v}
    if "sinks" in options:
        inputs["sinks"] = options.pop("sinks")
    return inputs, options


def run_with_grads(fn, inputs, options, grad_out):
    """fn(**inputs, **options) -> (out, lse); returns out, lse and the gradients of inputs
    for out.backward(grad_out)."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    out, lse = fn(**leaves, **options)
    out.backward(grad_out)
    return out.detach(), lse.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def assert_lse_close(lse, reference_lse, dtype):
    """Scores are exact products of the inputs summed in the accumulation dtype, so lse is
    accurate to its rounding; -inf (a row without keys or sink) must be exact."""
    assert lse.dtype == ops.lse_dtype(dtype) and lse.shape == reference_lse.shape
    finite = torch.isfinite(reference_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly where no key is"
    tolerance = 1e-12 if lse.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(
        lse[finite].double(), reference_lse[finite], rtol=tolerance, atol=tolerance
    )


def assert_accurate(actual, reference64, plain, factor, what):
    """FlashAttention's rule for the low-precision dtypes; fp64 kernels must match the fp64
    reference up to accumulation-order rounding."""
    assert actual.dtype == plain.dtype and actual.shape == reference64.shape, what
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, reference64, rtol=1e-10, atol=1e-10, msg=what)
    else:
        assert_within_rule(actual, reference64, plain, factor, what)


def check_against_reference(kernel, reference, inputs, options):
    """kernel and reference take (**inputs, **options) and return (out, lse); compares out,
    lse and the gradients of every input (q, k, v, sinks) against the float64 reference."""
    q, v = inputs["q"], inputs["v"]
    grad_out_shape = q.shape[:-1] + (v.shape[-1],)
    grad_out = torch.randn(grad_out_shape, generator=seeded_generator(3)).to(q.dtype)
    out, lse, grads = run_with_grads(kernel, inputs, options, grad_out)
    ref_out, ref_lse, ref_grads = run_with_grads(
        reference,
        converted(inputs, torch.float64),
        converted(options, torch.float64),
        grad_out.double(),
    )
    plain_out, _, plain_grads = run_with_grads(reference, inputs, options, grad_out)
    assert_accurate(out, ref_out, plain_out, OUTPUT_FACTOR, "output")
    assert_lse_close(lse, ref_lse, q.dtype)
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, f"grad_{name}"
        if name == "sinks" and q.dtype != torch.float64:
            assert_sinks_gradient_of_output(grad, inputs["sinks"], ref_lse, out, grad_out)
        else:
            assert_accurate(grad, ref_grads[name], plain_grads[name], GRAD_FACTOR, f"grad_{name}")


def assert_sinks_gradient_of_output(grad_sinks, sinks, reference_lse, out, grad_out):
    """d loss / d sinks[h] = -sum over h's rows of exp(sink_h - lse) * (dO . out), from the
    kernel's own output (checked by the rule), evaluated in float64 with the float64 lse.

    Not FlashAttention's rule: d sinks is one sum per head, so the rule's max error runs over
    a handful of values and plain PyTorch's error is a noisy yardstick. Measured on 23 x 61
    bf16 (h4kv2, d192/128, all features): plain 2.3e-3, kernel 7.1e-3, and the float64 formula
    on the kernel's bf16 output also 7.1e-3; across the other cases plain's error spreads
    from 7e-4 to 2.8e-2. The error comes from rounding `out`, which the rule checks."""
    delta = (grad_out.double() * out.double()).sum(-1)  # dense (B, H, Sq); packed (total_q, H)
    if out.dim() == 3:  # packed: lse's layout (H, total_q), as a batch of one
        delta, reference_lse = delta.T[None], reference_lse[None]
    share = torch.exp(sinks.double()[None, :, None] - reference_lse)  # (B, H, Sq)
    expected = -(share * delta).sum((0, 2))
    # The kernels sum delta and the rows in fp32: a few fp32 units of the terms' size.
    torch.testing.assert_close(grad_sinks.double(), expected, rtol=1e-5, atol=1e-5)


def dense_kernel(q, k, v, **options):
    return mha_ext.attention(q, k, v, return_lse=True, **options)


# ---------------------------------------------------------------- dense calls


def feature_dtype_cases(features_in_every_dtype):
    """(feature, dtype) pairs: every feature in fp32 and bf16, the combined one also in fp16
    and fp64. fp16 shares bf16's kernels but for the tile conversions, and fp64 runs one
    generic kernel for every feature, so crossing each feature with them again would mostly
    repeat the same code paths (and double the file's runtime)."""
    return [
        pytest.param(feature, dtype, id=f"{feature}-{str(dtype)[6:]}")
        for feature in features_in_every_dtype
        for dtype in (torch.float32, torch.bfloat16)
    ] + [
        pytest.param("all", dtype, id=f"all-{str(dtype)[6:]}")
        for dtype in (torch.float16, torch.float64)
    ]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=geometry_id)
@pytest.mark.parametrize("masking", list(MASKINGS))
@pytest.mark.parametrize("feature, dtype", feature_dtype_cases(FEATURES))
def test_feature_matches_reference(feature, masking, geometry, dtype):
    heads, kv_heads, batch, seq_q, seq_k, head_dim, head_dim_v = geometry
    q, k, v = random_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, head_dim_v, dtype=dtype)
    options = {**features(feature, batch, heads), **MASKINGS[masking]}
    check_against_reference(dense_kernel, attention_reference, *split_inputs(q, k, v, options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("seq_k, head_dim", [(257, 128), (531, 64)])
def test_all_features_on_many_tiles(dtype, causal, seq_k, head_dim):
    # Several 64-row query and key blocks with ragged edges: the kernels' tiling, online
    # softmax rescaling and key splits in the backward meet every score feature at once (the
    # bf16 forward takes keys in tiles of 128 at head dim 128 and of 256 at 64).
    q, k, v = random_qkv(1, 8, 2, 131, seq_k, head_dim, dtype=dtype)
    options = {**features("all", 1, 8), "causal": causal, "window": (90, 0)}
    check_against_reference(dense_kernel, attention_reference, *split_inputs(q, k, v, options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_features_on_bshd_views(dtype):
    q, k, v = random_qkv(2, 4, 2, 29, 41, 64, dtype=dtype, layout="bshd")
    assert not q.is_contiguous()
    options = {**features("all", 2, 4), "causal": "bottom_right", "window": (9, 0)}
    check_against_reference(dense_kernel, attention_reference, *split_inputs(q, k, v, options))


def test_all_features_on_strided_rows_and_heads():
    # Slices of wider tensors: row and head strides differ from the packed ones.
    q = torch.randn(2, 4, 40, 96)[:, :, :31, :64]
    k = torch.randn(2, 4, 50, 80)[:, ::2, :, 16:]  # every other head, offset columns
    v = torch.randn(2, 2, 100, 48)[:, :, ::2]  # every other row
    assert q.stride(2) == 96 and k.stride(1) == 2 * 50 * 80 and v.stride(2) == 96
    options = {**features("all", 2, 4), "window": (7, 3)}
    check_against_reference(dense_kernel, attention_reference, *split_inputs(q, k, v, options))


@pytest.mark.parametrize("seq_q, seq_k", [(0, 7), (5, 0)], ids=["no_queries", "no_keys"])
def test_empty_lengths_with_sinks(seq_q, seq_k):
    # Without keys every row's softmax holds only the sink: out 0, lse the sink. Its gradient
    # is -sum exp(sink - lse) * delta with delta = dO . out = 0.
    q, k, v = random_qkv(2, 4, 2, seq_q, seq_k, 16)
    sinks = sink_logits_for(4).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = mha_ext.attention(*leaves, sinks=sinks, softcap=SOFTCAP, return_lse=True)
    assert out.shape == (2, 4, seq_q, 16) and (out == 0).all()
    assert torch.equal(lse, sinks.detach()[None, :, None].expand(2, 4, seq_q))
    out.sum().backward()
    for leaf in leaves + [sinks]:
        assert leaf.grad.shape == leaf.shape and (leaf.grad == 0).all()


# ---------------------------------------------------------------- packed (varlen) calls


def packed_qkv(lengths_q, lengths_k, heads, kv_heads, head_dim, head_dim_v, dtype, seed=0):
    """q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) and int32 cu_seqlens for
    sequences of the given lengths. k and v are the two halves of one (total_k, 2, Hkv, D)
    tensor, as a fused kv projection gives them: their row stride is twice their row."""
    generator = seeded_generator(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, heads, head_dim, generator=generator).to(dtype)
    width = max(head_dim, head_dim_v)
    kv = torch.randn(total_k, 2, kv_heads, width, generator=generator).to(dtype)
    k, v = kv[:, 0, :, :head_dim], kv[:, 1, :, :head_dim_v]
    assert k.stride(0) == v.stride(0) == 2 * kv_heads * width

    def offsets(lengths):
        return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def varlen_functions(cu_seqlens_q, cu_seqlens_k):
    """(kernel, reference) over fixed sequence offsets, both (q, k, v, **options) ->
    (out, lse)."""
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    longest_q, longest_k = max(lengths_q), max(lengths_k)

    def kernel(q, k, v, **options):
        return mha_ext.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, longest_q, longest_k, return_lse=True, **options
        )

    def reference(q, k, v, **options):
        return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    return kernel, reference


# (lengths_q, lengths_k): ragged primes; a sequence with no queries; one with no keys (its
# rows see nothing: out 0, lse -inf or the sink); more queries than keys and the reverse;
# one-token sequences.
SEQUENCES = {
    "ragged": ([13, 1, 29, 7], [13, 1, 29, 7]),
    "empty_q": ([5, 0, 11], [9, 6, 11]),
    "empty_k": ([5, 8, 3], [7, 0, 12]),
    "uneven": ([17, 2, 31, 1], [5, 23, 31, 1]),
}
# GQA and MQA; MHA packs the same way and is covered by the dense tests.
VARLEN_HEADS = [(4, 2), (4, 1)]


@pytest.mark.parametrize("heads", VARLEN_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("sequences", list(SEQUENCES))
@pytest.mark.parametrize("masking", ["none", "causal_top_left", "causal_bottom_right", "window"])
@pytest.mark.parametrize("feature, dtype", feature_dtype_cases(["none", "all"]))
def test_varlen_matches_reference(feature, masking, sequences, heads, dtype):
    lengths_q, lengths_k = SEQUENCES[sequences]
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, *heads, 40, 40, dtype)
    options = dict(MASKINGS[masking])
    if feature == "all":
        options.update(features("all", len(lengths_q), heads[0]))
    check_against_reference(*varlen_functions(cu_q, cu_k), *split_inputs(q, k, v, options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dims", [(192, 128), (96, 64)], ids=lambda d: f"d{d[0]}v{d[1]}")
def test_varlen_all_features_at_once(dims, dtype):
    # softcap + window + sinks + ALiBi (slopes per sequence) + GQA + varlen + seqused_k in
    # one call, with q/k head dims other than v's.
    lengths_q, lengths_k = [19, 0, 37, 4], [23, 5, 41, 1]
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, 6, 2, *dims, dtype)
    options = {
        **features("all", 4, 6),
        "alibi_slopes": features("alibi_per_batch", 4, 6)["alibi_slopes"],
        "causal": "bottom_right",
        "window": (11, 0),
        "seqused_k": torch.tensor([20, 3, 41, 0], dtype=torch.int32),
    }
    check_against_reference(*varlen_functions(cu_q, cu_k), *split_inputs(q, k, v, options))


def per_sequence_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, options):
    """Each sequence of a packed call alone through mha_ext.attention: (out, lse) packed as
    attention_varlen returns them."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q_b = q[starts_q[b] : starts_q[b + 1]].transpose(0, 1)[None]  # (1, H, Sq_b, D)
        k_b = k[starts_k[b] : starts_k[b + 1]].transpose(0, 1)[None]  # (1, Hkv, Sk_b, D)
        v_b = v[starts_k[b] : starts_k[b + 1]].transpose(0, 1)[None]  # (1, Hkv, Sk_b, Dv)
        slopes = options.get("alibi_slopes")
        sequence_options = dict(options)
        if slopes is not None and slopes.dim() == 2:
            sequence_options["alibi_slopes"] = slopes[b]
        out, lse = mha_ext.attention(q_b, k_b, v_b, return_lse=True, **sequence_options)
        outs.append(out[0].transpose(0, 1))  # (Sq_b, H, Dv)
        lses.append(lse[0])  # (H, Sq_b)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", ["none", "all"])
def test_varlen_equals_each_sequence_alone(feature, dtype):
    # The CPU backend runs a packed call sequence by sequence with the dense kernels, so the
    # forward must be bitwise that of each sequence alone. The deterministic backward plans its
    # key splits independently of the call, so its gradients are bitwise equal too; sinks sum
    # their per-sequence gradients in another order, so they agree to rounding.
    lengths_q, lengths_k = [70, 0, 3, 130], [90, 4, 0, 150]
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, 4, 2, 64, 64, dtype)
    options = {"causal": "bottom_right", "deterministic": True}
    if feature == "all":
        options.update(features("all", 4, 4))
        options["alibi_slopes"] = features("alibi_per_batch", 4, 4)["alibi_slopes"]
        options["window"] = (40, 0)
    inputs, options = split_inputs(q, k, v, options)
    grad_out = torch.randn(q.shape[:-1] + (64,), generator=seeded_generator(5)).to(dtype)
    kernel, _ = varlen_functions(cu_q, cu_k)
    out, lse, grads = run_with_grads(kernel, inputs, options, grad_out)

    def alone(q, k, v, **options):
        return per_sequence_attention(q, k, v, cu_q, cu_k, options)

    out_alone, lse_alone, grads_alone = run_with_grads(alone, inputs, options, grad_out)
    assert torch.equal(out, out_alone) and torch.equal(lse, lse_alone)
    for name in "qkv":
        assert torch.equal(grads[name], grads_alone[name]), f"grad_{name}"
    if "sinks" in grads:
        torch.testing.assert_close(grads["sinks"], grads_alone["sinks"], rtol=1e-5, atol=1e-6)


def test_varlen_seqused_k_leaves_unused_keys_without_gradient():
    lengths = [10, 12]
    q, k, v, cu_q, cu_k = packed_qkv(lengths, lengths, 2, 1, 16, 16, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    used = torch.tensor([4, 12], dtype=torch.int32)
    out = mha_ext.attention_varlen(*leaves, cu_q, cu_k, 12, 12, seqused_k=used)
    out.sum().backward()
    for leaf in leaves[1:]:
        assert (leaf.grad[4:10] == 0).all() and (leaf.grad[:4] != 0).any()


# ---------------------------------------------------------------- gradcheck (fp64)


def gradcheck_inputs(inputs):
    return {name: t.clone().requires_grad_() for name, t in inputs.items()}


@pytest.mark.parametrize(
    "options",
    [
        {"softcap": 0.7},
        {"softcap": 0.7, "causal": "top_left"},
        {"alibi_slopes": alibi_slopes_for(4), "causal": "bottom_right"},
        {"alibi_slopes": torch.linspace(0.1, 0.8, 8).reshape(2, 4), "window": (3, 2)},
        {"sinks": sink_logits_for(4)},
        {"sinks": sink_logits_for(4), "causal": "bottom_right"},
        {
            "softcap": 0.7,
            "alibi_slopes": alibi_slopes_for(4),
            "sinks": sink_logits_for(4),
            "window": (4, 0),
        },
    ],
    ids=[
        "softcap",
        "softcap_causal",
        "alibi",
        "alibi_per_batch_window",
        "sinks",
        "sinks_empty_rows",
        "all",
    ],
)
def test_gradcheck_fp64(options):
    # 11 queries over 7 keys: bottom-right causal leaves the first 4 rows without keys.
    q, k, v = random_qkv(2, 4, 2, 11, 7, 8, head_dim_v=6, dtype=torch.float64)
    inputs, options = split_inputs(q, k, v, options)
    names = list(inputs)

    def fn(*tensors):
        out, lse = mha_ext.attention(**dict(zip(names, tensors)), return_lse=True, **options)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, list(gradcheck_inputs(inputs).values()))


@pytest.mark.parametrize("feature", ["none", "all"])
def test_gradcheck_varlen_fp64(feature):
    lengths_q, lengths_k = [3, 0, 6, 4], [5, 2, 6, 0]
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, 4, 2, 8, 6, torch.float64)
    options = {"causal": "bottom_right"}
    if feature == "all":
        options.update(features("all", 4, 4), window=(2, 0), softcap=0.7)
    inputs, options = split_inputs(q, k, v, options)
    names = list(inputs)
    kernel, _ = varlen_functions(cu_q, cu_k)

    def fn(*tensors):
        out, lse = kernel(**dict(zip(names, tensors)), **options)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, list(gradcheck_inputs(inputs).values()))


# ---------------------------------------------------------------- deterministic backward


def deterministic_case():
    """One kv head and 400 keys: the backward splits the keys and sums the splits' dQ
    partials, the order a deterministic call has to fix. Dense and packed inputs."""
    dense = random_qkv(1, 4, 1, 150, 400, 64)
    packed = packed_qkv([150, 60], [400, 90], 4, 1, 64, 64, torch.float32)
    return dense, packed


def gradients_of(run, inputs, grad_seed=9):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = run(*leaves)
    out.backward(torch.randn(out.shape, generator=seeded_generator(grad_seed)))
    return [leaf.grad for leaf in leaves]


def deterministic_runs(deterministic):
    """Gradients of a dense and a packed call (both with sinks) under `deterministic`."""
    (q, k, v), (pq, pk, pv, cu_q, cu_k) = deterministic_case()
    options = {"causal": "bottom_right", "deterministic": deterministic, "softcap": SOFTCAP}

    def dense(q, k, v, sinks):
        return mha_ext.attention(q, k, v, sinks=sinks, **options)

    def packed(q, k, v, sinks):
        return mha_ext.attention_varlen(q, k, v, cu_q, cu_k, 150, 400, sinks=sinks, **options)

    sinks = sink_logits_for(4)
    return gradients_of(dense, (q, k, v, sinks)) + gradients_of(packed, (pq, pk, pv, sinks))


def with_threads(threads, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def assert_bitwise_equal(grads, expected):
    for index, (grad, other) in enumerate(zip(grads, expected)):
        assert torch.equal(grad, other), f"gradient {index} differs"


@pytest.mark.cpu_only
def test_deterministic_gradients_are_bitwise_reproducible_across_thread_counts():
    one_thread = with_threads(1, lambda: deterministic_runs(True))
    assert_bitwise_equal(with_threads(2, lambda: deterministic_runs(True)), one_thread)
    assert_bitwise_equal(with_threads(2, lambda: deterministic_runs(True)), one_thread)


@pytest.mark.cpu_only
def test_use_deterministic_algorithms_turns_the_deterministic_backward_on():
    expected = with_threads(1, lambda: deterministic_runs(True))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert_bitwise_equal(with_threads(2, lambda: deterministic_runs(None)), expected)
    finally:
        torch.use_deterministic_algorithms(previous)


def test_deterministic_gradients_are_bitwise_reproducible_across_runs():
    first = deterministic_runs(True)
    assert_bitwise_equal(deterministic_runs(True), first)


# ---------------------------------------------------------------- op registration


def opcheck_cases():
    """attention_forward's arguments for softcap, ALiBi, sinks and a packed call."""
    q, k, v = random_qkv(2, 4, 2, 9, 13, 16, head_dim_v=8)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = sink_logits_for(4).requires_grad_()
    slopes = alibi_slopes_for(4)
    pq, pk, pv, cu_q, cu_k = packed_qkv([4, 0, 7], [6, 3, 5], 4, 2, 16, 8, torch.float32)
    packed = [t.clone().requires_grad_() for t in (pq, pk, pv)]
    used = torch.tensor([5, 3, 0], dtype=torch.int32)
    dense_options = (None, None, 0.0, 0.25, -1, 0, True)
    return {
        "softcap": (*grad, *dense_options, 1.5),
        "alibi": (*grad, *dense_options, 0.0, slopes),
        "sinks": (*grad, *dense_options, 0.0, None, sinks),
        "all": (q, k, v, None, None, 0.0, 0.25, 3, 1, False, 1.5, slopes.repeat(2, 1), sinks),
        "varlen": (
            *packed,
            None,
            None,
            0.0,
            0.25,
            -1,
            0,
            True,
            1.5,
            slopes,
            sinks,
            cu_q,
            cu_k,
            used,
            7,
            6,
            True,
        ),
    }


@pytest.mark.parametrize("case", ["softcap", "alibi", "sinks", "all", "varlen"])
def test_opcheck_attention_forward_with_variants(case):
    torch.library.opcheck(torch.ops.mha_ext.attention_forward.default, opcheck_cases()[case])


@pytest.mark.parametrize("case", ["all", "varlen"])
def test_opcheck_attention_backward_with_variants(case):
    q, k, v, *options = opcheck_cases()[case]
    q, k, v = (t.detach() for t in (q, k, v))
    options = [o.detach() if isinstance(o, torch.Tensor) else o for o in options]
    out, lse = ops.attention_forward(q, k, v, *options)
    args = (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *options)
    torch.library.opcheck(torch.ops.mha_ext.attention_backward.default, args)


def test_compile_fullgraph_varlen_with_sinks_forward_and_backward():
    q, k, v, cu_q, cu_k = packed_qkv([9, 0, 14], [9, 5, 20], 4, 2, 16, 16, torch.float32)

    def step(q, k, v, sinks):
        out, lse = mha_ext.attention_varlen(
            q, k, v, cu_q, cu_k, 14, 20, causal="bottom_right", sinks=sinks, return_lse=True
        )
        return out.square().sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True)
    inputs = (q, k, v, sink_logits_for(4))
    eager = [t.clone().requires_grad_() for t in inputs]
    traced = [t.clone().requires_grad_() for t in inputs]
    eager_loss, compiled_loss = step(*eager), compiled(*traced)
    torch.testing.assert_close(compiled_loss, eager_loss)
    eager_loss.backward()
    compiled_loss.backward()
    for got, expected in zip(traced, eager):
        torch.testing.assert_close(got.grad, expected.grad)


# ---------------------------------------------------------------- bad inputs


def varlen_call(**overrides):
    """attention_varlen on two sequences (4 and 6 queries over 5 and 7 keys) with
    `overrides` replacing its arguments."""
    q, k, v, cu_q, cu_k = packed_qkv([4, 6], [5, 7], 4, 2, 16, 16, torch.float32)
    args = {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": 6,
        "max_seqlen_k": 7,
    }
    args.update(overrides)
    return mha_ext.attention_varlen(**args)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"cu_seqlens_q": int32([0, 6, 4, 10]), "cu_seqlens_k": int32([0, 5, 5, 12])},
            r"cu_seqlens_q must be non-decreasing, got 6 then 4 at sequence 1",
        ),
        (
            {"cu_seqlens_k": int32([0, 7, 5])},
            r"cu_seqlens_k must run from 0 to the 12 packed rows, got 0 \.\. 5",
        ),
        (
            {"cu_seqlens_q": int32([0, 4, 9])},
            r"cu_seqlens_q must run from 0 to the 10 packed rows, got 0 \.\. 9",
        ),
        (
            {"cu_seqlens_k": int32([0, 5, 12, 12])},
            r"cu_seqlens_q has 3 entries but cu_seqlens_k has 4",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0, 4, 10])},
            r"cu_seqlens_q must be a contiguous 1-D torch.int32 tensor \(batch \+ 1\) on cpu, "
            r"got torch.int64 of shape \[3\]",
        ),
        ({"max_seqlen_q": 5}, r"max_seqlen_q is 5 but sequence 1 has 6 queries"),
        ({"max_seqlen_k": 6}, r"max_seqlen_k is 6 but sequence 1 has 7 keys"),
        ({"softcap": -1.0}, r"softcap must be >= 0 \(0 = no softcap\), got -1"),
        (
            {"alibi_slopes": torch.rand(3)},
            r"alibi_slopes must have shape \(heads\) or \(batch, heads\), got \[3\]",
        ),
        (
            {"alibi_slopes": torch.rand(3, 4)},
            r"alibi_slopes must have shape \(heads\) or \(batch, heads\), got \[3, 4\]",
        ),
        ({"sinks": torch.rand(2, 4)}, r"sinks must have shape \(heads\), got \[2, 4\]"),
        ({"sinks": torch.rand(2)}, r"sinks must have shape \(heads\), got \[2\]"),
        (
            {"seqused_k": int32([5, 8])},
            r"seqused_k\[1\] is 8 but sequence 1 has 7 keys",
        ),
        (
            {"seqused_k": torch.tensor([5, 7])},
            r"seqused_k must be a contiguous torch.int32 tensor of shape \(2\) on cpu, got "
            r"torch.int64",
        ),
    ],
    ids=[
        "cu_seqlens_decreasing",
        "cu_seqlens_k_short_of_total",
        "cu_seqlens_q_short_of_total",
        "cu_seqlens_lengths_differ",
        "cu_seqlens_int64",
        "max_seqlen_q_too_small",
        "max_seqlen_k_too_small",
        "softcap_negative",
        "slopes_wrong_heads",
        "slopes_wrong_batch",
        "sinks_2d",
        "sinks_wrong_heads",
        "seqused_k_too_long",
        "seqused_k_int64",
    ],
)
@pytest.mark.cpu_only
def test_bad_varlen_inputs_raise(overrides, message):
    with pytest.raises(RuntimeError, match=message):
        varlen_call(**overrides)


def test_bad_dense_variant_inputs_raise():
    q, k, v = random_qkv(2, 4, 2, 5, 7, 16)
    with pytest.raises(RuntimeError, match=r"softcap must be >= 0 \(0 = no softcap\), got -0.5"):
        mha_ext.attention(q, k, v, softcap=-0.5)
    with pytest.raises(
        RuntimeError, match=r"alibi_slopes must have shape \(heads\) or \(batch, heads\), got \[2\]"
    ):
        mha_ext.attention(q, k, v, alibi_slopes=torch.rand(2))
    with pytest.raises(RuntimeError, match=r"sinks must have shape \(heads\), got \[1, 4\]"):
        mha_ext.attention(q, k, v, sinks=torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor"):
        mha_ext.attention(q, k, v, sinks=torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"alibi_slopes requires grad, but the slopes get no"):
        mha_ext.attention(q, k, v, alibi_slopes=torch.rand(4, requires_grad=True))


def test_attn_mask_with_packed_sequences_raises():
    # attention_varlen takes no attn_mask; the op refuses one with cu_seqlens.
    q, k, v, cu_q, cu_k = packed_qkv([4, 6], [5, 7], 4, 2, 16, 16, torch.float32)
    mask = torch.ones(10, 12, dtype=torch.bool)
    with pytest.raises(
        RuntimeError, match=r"attn_mask is not supported with cu_seqlens \(packed sequences\)"
    ):
        ops.attention_forward(
            q, k, v, mask, None, 0.0, 0.25, -1, -1, False, 0.0, None, None, cu_q, cu_k, None, 6, 7
        )


def test_packed_arguments_without_a_packed_call_raise():
    q, k, v, cu_q, cu_k = packed_qkv([4, 6], [5, 7], 4, 2, 16, 16, torch.float32)
    dense_q, dense_k, dense_v = random_qkv(2, 4, 2, 5, 7, 16)
    options = (None, None, 0.0, 0.25, -1, -1, False, 0.0, None, None)
    with pytest.raises(
        RuntimeError, match=r"cu_seqlens_q and cu_seqlens_k go together, got only cu_seqlens_q"
    ):
        ops.attention_forward(q, k, v, *options, cu_q, None, None, 6, 7)
    with pytest.raises(
        RuntimeError, match=r"seqused_k needs cu_seqlens_q and cu_seqlens_k \(a packed call\)"
    ):
        ops.attention_forward(
            dense_q, dense_k, dense_v, *options, None, None, torch.tensor([5, 7], dtype=torch.int32)
        )
    with pytest.raises(
        RuntimeError, match=r"max_seqlen_q and max_seqlen_k must be >= 0, got -1 and 7"
    ):
        ops.attention_forward(q, k, v, *options, cu_q, cu_k, None, -1, 7)

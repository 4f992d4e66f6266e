"""hypothesis strategies for the property-based tests (tests/test_fuzz_*.py), their settings
profiles and the checks they share.

Every strategy draws a frozen *Case: plain numbers, dtypes and strings, with a seed from which
its tensors are built. A case's repr is Python that rebuilds it, so a failing example prints
the exact call (hypothesis shows the case; each test also notes the call it made), and a
found bug keeps its case as an @example.

Profiles, chosen by MHA_EXT_FUZZ: "ci" (the default: derandomised, so every run draws the
same examples, each test its own few hundred) and "long" (20x the examples, random: for
releases and the GPU run).
"""

import dataclasses
import hashlib
import math
import os
from typing import Optional, Sequence, Tuple

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import mha_ext
import mha_ext.flash_attn_interface as flash_attn
from mha_ext.reference import attention_reference, attention_varlen_reference

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, ROUNDING_UNITS, max_error, seeded_generator

_SHARED = {
    # Each example is small and builds its tensors from a seed, so the timing of one says
    # nothing; the autouse device / seed fixtures are per test and hold no per-example state.
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
}
settings.register_profile("ci", derandomize=True, **_SHARED)
settings.register_profile("long", derandomize=False, **_SHARED)
PROFILE = os.environ.get("MHA_EXT_FUZZ", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"MHA_EXT_FUZZ must be 'ci' or 'long', got {PROFILE!r}")
settings.load_profile(PROFILE)
LONG_FACTOR = 20


def fuzz_settings(ci_examples: int) -> settings:
    """Settings of one fuzz test: ci_examples in CI, LONG_FACTOR times more with
    MHA_EXT_FUZZ=long."""
    factor = LONG_FACTOR if PROFILE == "long" else 1
    return settings(max_examples=ci_examples * factor)


# ---------------------------------------------------------------- sizes

# Lengths worth hitting: empty, one, primes (no tile divides them), tile edges +- 1.
LENGTHS = (0, 1, 2, 3, 5, 7, 11, 13, 16, 17, 31, 32, 33, 61, 64, 67, 97, 127, 128, 131, 193, 257)
HEAD_DIMS = (1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 80, 96, 127, 128, 129, 255, 256)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BLOCK_SIZES = (1, 2, 3, 5, 7, 8, 16, 17, 32, 64, 128, 256)
# Per example: at most this many scores (batch x heads x seq_q x seq_k) and elements in one of
# q, k, v; the float64 reference and its autograd then take a few ms.
SCORE_BUDGET = 8_000
ELEMENT_BUDGET = 16_000

lengths = st.sampled_from(LENGTHS)
head_dims = st.one_of(st.sampled_from(HEAD_DIMS), st.integers(1, 256))
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


def shrink_to_budget(seq_q: int, seq_k: int, rows: int, width: int) -> Tuple[int, int]:
    """(seq_q, seq_k), the longer halved until rows (batch x heads) x seq_q x seq_k and
    rows x seq x width fit the budgets."""
    while rows * seq_q * seq_k > SCORE_BUDGET or rows * max(seq_q, seq_k) * width > ELEMENT_BUDGET:
        if seq_q >= seq_k:
            seq_q //= 2
        else:
            seq_k //= 2
    return seq_q, seq_k


@st.composite
def head_counts(draw, max_group: int = 4):
    """(heads, kv_heads): kv_heads divides heads (MHA, GQA, MQA)."""
    kv_heads = draw(st.integers(1, 3))
    return kv_heads * draw(st.integers(1, max_group)), kv_heads


# ---------------------------------------------------------------- tensors


def normal(generator, shape, dtype, std: float = 1.0) -> torch.Tensor:
    """N(0, std) values drawn in fp64 (the same values whatever the dtype), rounded to dtype."""
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * std).to(dtype)


def uniform(generator, shape, low: float, high: float) -> torch.Tensor:
    values = torch.rand(shape, generator=generator, dtype=torch.float64)
    return (low + (high - low) * values).to(torch.float32)


# Layouts of a (B, H, S, D) operand: its storage (the autograd leaf) and the view the op gets.
LAYOUTS = ("bhsd", "bshd", "padded", "broadcast")


def leaf_shape(layout: str, shape: Tuple[int, int, int, int]) -> Tuple[int, ...]:
    batch, heads, seq, dim = shape
    if layout == "bshd":
        return (batch, seq, heads, dim)
    if layout == "padded":  # rows of a wider buffer: strided rows, unit-stride last dim
        return (batch, heads, seq + 1, dim + 3)
    if layout == "broadcast":  # one row for all batches and positions: zero strides
        return (1, heads, 1, dim)
    return shape


def laid_out(leaf: torch.Tensor, layout: str, shape: Tuple[int, int, int, int]) -> torch.Tensor:
    """The (B, H, S, D) view of `leaf` (made by leaf_shape) that the op receives."""
    batch, heads, seq, dim = shape
    if layout == "bshd":
        return leaf.transpose(1, 2)
    if layout == "padded":
        return leaf[:, :, :seq, :dim]
    if layout == "broadcast":
        return leaf.expand(batch, heads, seq, dim)
    return leaf


def leaves_like(tensors, dtype=None):
    """Fresh autograd leaves with the same values (in `dtype`, default their own)."""
    return [
        None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad)
        for t in tensors
    ]


def bytes_digest(*tensors: torch.Tensor) -> str:
    """A hash of the tensors' storage bytes (NaN payloads included): bitwise comparisons of
    caches before and after a call, views included."""
    digest = hashlib.sha256()
    for t in tensors:
        whole = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        digest.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- checks


def check_rule(
    actual,
    reference64,
    plain,
    factor,
    what,
    unit_scale: float = 0.0,
    sum_scale: float = 1.0,
    unit_dtype: Optional[torch.dtype] = None,
    score_scale: float = 0.0,
    known_error: float = 0.0,
    score_gain: Optional[float] = None,
):
    """FlashAttention's rule (tests/conftest.py) on tensors that may hold -inf (logsumexps of
    rows that see no key) or NaN nowhere: -inf exactly where the reference has it, the rule on
    the rest."""
    assert actual.shape == reference64.shape, f"{what}: shape {actual.shape} != {reference64.shape}"
    assert not torch.isnan(actual).any(), f"{what}: NaN values"
    infinite = torch.isinf(reference64)
    assert torch.equal(torch.isinf(actual), infinite), f"{what}: -inf in other places"
    if infinite.any():
        assert torch.equal(actual[infinite].double(), reference64[infinite]), f"{what}: inf sign"
    finite = ~infinite
    actual, reference64 = actual[finite], reference64[finite]
    plain = plain[finite]
    error = max_error(actual, reference64)
    plain_error = max_error(plain, reference64) if torch.isfinite(plain).all() else math.inf
    magnitude = reference64.abs().max().item() if reference64.numel() else 0.0
    accumulate_eps = torch.finfo(
        torch.float64 if actual.dtype == torch.float64 else torch.float32
    ).eps
    # Plus one unit of the result's own dtype at the larger of its magnitude and unit_scale:
    # storing it rounds by up to half a unit, and on tiny problems plain PyTorch's error can
    # fall far below that by chance (fp16 grad_q of a 1 x 2 softmax: 2e-5 where rounding
    # alone may cost 1.2e-4). unit_scale covers results that cancel to ~0: grad_q over equal
    # keys is exactly 0, but the fused backward's delta = rowsum(dO * O) reads O rounded to
    # bf16, which leaves one bf16 unit of the other gradients (4.6e-4 for |dO| ~ 1).
    # unit_dtype: the inputs' dtype where it is coarser than the result's (fp32 grad_sinks
    # of fp16 attention come from the fp16 output).
    own_unit = torch.finfo(unit_dtype or actual.dtype).eps * max(magnitude, unit_scale)
    # sum_scale: the size of the sums a result cancels from, where that exceeds the result.
    accumulated = ROUNDING_UNITS * accumulate_eps * max(magnitude, 1.0, sum_scale)
    # score_scale: the largest |score|. Each score carries the rounding of its fp32 dot
    # product, which grows with |score| (|s| ~ 40, head_dim 256: 6e-6 RMS, 2e-5 at most, for
    # the kernels' sequential FMA over head_dim and torch's matmul alike) and reaches the
    # output as p_i p_j (ds_i - ds_j)(v_i - v_j). The two sum in different orders, so their
    # errors are independent draws, and over a few rows plain PyTorch's can be small by luck:
    # 1.2e-6 where its two dominant keys' score errors came out equal, against the kernel's
    # 1.7e-5 on outputs of 3.5 (14x). Folding scale * log2(e) into exp2 adds under 1e-7.
    # score_gain: what a score's error is multiplied by on its way to the result; by default
    # the result's magnitude, as an output weighs values by probabilities. A logsumexp moves
    # by sum_i p_i ds_i, its scores' errors unscaled (score_gain 1): a float64 lse of -0.064
    # from a score over 255 head dims whose terms sum to 170 in size was 6e-15 off, and
    # torch's float64 reference 5e-15 the other way.
    gain = magnitude if score_gain is None else score_gain
    score_rounding = 2 * accumulate_eps * gain * score_scale
    # known_error: what the kernel's definition of the result costs, computed in float64 by
    # the caller (DenseCase.definition_errors, VarlenCase.definition_errors).
    allowed = factor * plain_error + accumulated + own_unit + score_rounding + known_error
    assert error <= allowed, (
        f"{what}: max error {error:.3e} exceeds {allowed:.3e} "
        f"({factor}x plain PyTorch's {plain_error:.3e} + rounding)"
    )


def check_logsumexp(lse, reference64, plain, sum_scale: float = 1.0, score_scale: float = 0.0):
    """check_rule on a logsumexp, at the outputs' factor: it moves by sum_i p_i ds_i, so its
    scores' rounding reaches it unscaled (score_gain 1)."""
    check_rule(
        lse,
        reference64,
        plain,
        OUTPUT_FACTOR,
        "lse",
        sum_scale=sum_scale,
        score_scale=score_scale,
        score_gain=1.0,
    )


def call_text(fn: str, *args, **kwargs) -> str:
    """`fn(args..., key=value...)` with tensors shown as the names the case builds them by."""
    shown = [a if isinstance(a, str) else repr(a) for a in args]
    shown += [f"{k}={v if isinstance(v, Arg) else repr(v)}" for k, v in kwargs.items()]
    return f"{fn}({', '.join(shown)})"


def seeded(seed: int) -> torch.Generator:
    return seeded_generator(seed)


class Arg(str):
    """A name shown as is in call_text (a tensor the case builds)."""

    def __repr__(self):
        return str(self)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation dtype (slopes, sinks, lse): fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def score_extent(qk_size: float, alibi_slopes, rows: int, keys: int, sinks) -> float:
    """check_rule's score_scale: the size of the scores a call's exps take, from qk_size (a
    bound on |scale q . k|, or the size of its terms) plus ALiBi's largest bias (slope x
    distance, at most rows + keys), or the largest |sink| logit where that is larger."""
    extent = qk_size
    if alibi_slopes is not None and alibi_slopes.numel():
        extent += alibi_slopes.detach().abs().max().item() * (rows + keys)
    if sinks is not None and sinks.numel():
        extent = max(extent, sinks.detach().abs().max().item())
    return extent


def key_sums(values, keys: int) -> Tuple[float, float]:
    """check_rule's sum_scale for an output and for its logsumexp, sums over `keys` keys:
    their rounding grows like the square root of the count, for the output at the size of the
    values it weighs (float64 has no plain PyTorch error to lean on: its reference is the
    same computation)."""
    size = values.detach().abs().max().item() if values.numel() else 0.0
    return size * math.sqrt(max(keys, 1)), math.sqrt(max(keys, 1))


def cancel_scale(score_scale, reference_out, grad_out, q, k, dropout_p: float = 0.0) -> float:
    """same_grads' cancel_scale: |score_scale| x max rowsum(|dO * O|) x max(|q|, |k|), with
    dropout's 1 / (1 - p). The rows run along the output's last dim, its value dim in every
    layout."""
    if reference_out.numel() == 0:
        return 0.0
    delta = (reference_out.abs() * grad_out.double().abs()).sum(-1).max().item()
    largest = max((x.detach().abs().max().item() for x in (q, k) if x.numel()), default=0.0)
    return abs(score_scale) * delta * largest / (1.0 - dropout_p)


def delta_defined_grads(out, lse, inputs, grad_out, delta_error):
    """(exact, defined): the float64 gradients of inputs through a reference's (out, lse),
    and as the kernels define them. Their delta = rowsum(dO * O) reads the output as the
    kernel rounded it, delta_error (lse's shape) off, so they give the gradients of out . dO -
    sum_rows (delta_error lse), as d lse / d score = P; a row that saw no key (lse -inf)
    takes none. None where nothing reaches an input."""
    delta_error = torch.where(torch.isfinite(lse.detach()), delta_error, 0.0)
    exact = torch.autograd.grad(out, inputs, grad_out, retain_graph=True, allow_unused=True)
    defined = torch.autograd.grad((out, lse), inputs, (grad_out, -delta_error), allow_unused=True)
    return exact, defined


def same_grads(
    kernel,
    reference,
    plain,
    what,
    length: int = 1,
    cancel_scale: float = 0.0,
    known_errors: Sequence[float] = (),
):
    """Gradient lists (None for a leaf nothing reached) by the rule. Each may be off by one
    unit of the inputs' dtype at the largest reference gradient or at cancel_scale (check_rule's
    unit_scale), and by rounding units of sums over `length` such terms: the longest of the
    sums the gradients take, over head dims, query rows (grad_k, grad_v) or keys (grad_q).
    cancel_scale: the size of the terms whose difference a gradient is. grad_q and grad_k of
    one key are exactly 0 but come out of dP - delta, delta = rowsum(dO * O) over the output
    rounded to its dtype: |scale| * max rowsum(|dO * O|) * max(|q|, |k|) (6e-3 in bf16 with
    dropout's 1 / (1 - p) where the largest reference gradient allowed 5e-3).
    known_errors: per gradient, allowed on top of the rule (the cases' definition_errors())."""
    scale = max((g.abs().max().item() for g in reference if g is not None and g.numel()), default=0)
    scale = max(scale, cancel_scale)
    for index, (actual, truth, baseline) in enumerate(zip(kernel, reference, plain)):
        if actual is None and truth is None:
            continue
        assert actual is not None and truth is not None, f"{what}[{index}]: a gradient is missing"
        check_rule(
            actual,
            truth,
            baseline,
            GRAD_FACTOR,
            f"{what}[{index}]",
            unit_scale=scale,
            sum_scale=scale * math.sqrt(length),
            unit_dtype=kernel[0].dtype,
            known_error=known_errors[index] if index < len(known_errors) else 0.0,
        )


# ---------------------------------------------------------------- dense attention

CAUSAL = (None, "top_left", "bottom_right")
WINDOW_SIDES = (None, -1, 0, 1, 2, 5, 17, 100)
SCALES = (None, None, None, 0.0, -0.5, 0.05, 1.0, 2.0)
SOFTCAPS = (0.0, 0.0, 0.0, 1.0, 5.0, 30.0)
DROPOUT_PS = (0.1, 0.25, 0.5, 0.9)


@dataclasses.dataclass
class Operands:
    """What a case builds: autograd leaves (the storage of q, k, v), the views the op gets,
    the optional tensors and a gradient for the output."""

    leaves: list
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    grad_out: Optional[torch.Tensor] = None

    def views(self) -> list:
        return [self.q, self.k, self.v]


@dataclasses.dataclass(frozen=True)
class DenseCase:
    """One mha_ext.attention call: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) in
    the given layouts (LAYOUTS), with the options of mha_ext.attention. mask_shape broadcasts
    to (B, H, Sq, Sk); empty_rows are query rows the mask hides entirely."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype = torch.float32
    layouts: Tuple[str, str, str] = ("bhsd", "bhsd", "bhsd")
    causal: Optional[str] = None
    window: Optional[tuple] = None
    mask: Optional[str] = None  # None, "bool" (True = attend) or "additive"
    mask_shape: Tuple[int, ...] = ()
    mask_expanded: bool = False  # passed expanded to (B, H, Sq, Sk): zero strides
    empty_rows: Tuple[int, ...] = ()
    scale: Optional[float] = None
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "heads" (H,) or "batch" (B, H)
    sinks: bool = False
    dropout_p: float = 0.0
    deterministic: Optional[bool] = None
    seed: int = 0

    def shapes(self):
        b, sq, sk = self.batch, self.seq_q, self.seq_k
        return (
            (b, self.heads, sq, self.head_dim),
            (b, self.kv_heads, sk, self.head_dim),
            (b, self.kv_heads, sk, self.head_dim_v),
        )

    def build(self) -> Operands:
        generator = seeded(self.seed)
        leaves = [
            normal(generator, leaf_shape(layout, shape), self.dtype).requires_grad_()
            for layout, shape in zip(self.layouts, self.shapes())
        ]
        operands = Operands(leaves, *self.views(leaves))
        if self.mask is not None:
            keep = torch.rand(self.mask_shape, generator=generator) < 0.75
            if self.empty_rows:
                keep[..., list(self.empty_rows), :] = False
            mask = keep
            if self.mask == "additive":
                bias = normal(generator, self.mask_shape, self.dtype)
                mask = bias.masked_fill(~keep, float("-inf"))
            if self.mask_expanded:
                mask = mask.expand(self.batch, self.heads, self.seq_q, self.seq_k)
            operands.attn_mask = mask
        if self.alibi is not None:
            shape = (self.heads,) if self.alibi == "heads" else (self.batch, self.heads)
            operands.alibi_slopes = uniform(generator, shape, 0.0, 1.0)
        if self.sinks:
            operands.sinks = normal(generator, (self.heads,), torch.float32).requires_grad_()
        out_shape = (self.batch, self.heads, self.seq_q, self.head_dim_v)
        operands.grad_out = normal(generator, out_shape, self.dtype)
        return operands

    def views(self, leaves):
        return [laid_out(x, lay, s) for x, lay, s in zip(leaves, self.layouts, self.shapes())]

    def options(self, operands: Operands) -> dict:
        return {
            "causal": self.causal,
            "scale": self.scale,
            "window": self.window,
            "attn_mask": operands.attn_mask,
            "dropout_p": self.dropout_p,
            "return_lse": True,
            "softcap": self.softcap,
            "alibi_slopes": operands.alibi_slopes,
            "sinks": operands.sinks,
            "deterministic": self.deterministic,
        }

    def call_text(self) -> str:
        """The call the test makes, as Python to paste after `from fuzz_strategies import *`."""
        options = self.options(Operands([], None, None, None))
        present = {"attn_mask": self.mask, "alibi_slopes": self.alibi, "sinks": self.sinks}
        for key, given in present.items():
            if given:
                options[key] = Arg(f"ops.{key}")
        call = call_text("mha_ext.attention", "ops.q", "ops.k", "ops.v", **options)
        return f"ops = {self!r}.build()\nout, lse = {call}"

    def definition_errors(self, operands: Operands, kernel_out, dropout_keep=None) -> list:
        """Per gradient (q, k, v leaves, then sinks), how far it is off by the kernels'
        definition, in float64 from the reference. Two effects add up over a sum the rule sees
        as one result. The backward's delta = rowsum(dO * O) reads the output as the kernel
        rounded it (cancel_scale's reason): the gradients it gives are those of out . dO -
        sum_rows (delta's error) lse, since d lse / d score = P; summed over a head's rows
        (grad_sinks) or over a broadcast leaf's copies that reaches 2% of a bf16 gradient.
        And where a leaf is broadcast (one row for every batch and position), the kernels
        round each element of the view's gradient to the dtype before autograd sums them
        (122 elements of up to 3.5 into a gradient of 0.21)."""
        views = [x.detach().double().contiguous().requires_grad_() for x in operands.views()]
        (sinks,) = leaves_like([operands.sinks], torch.float64)
        inputs = views + ([sinks] if sinks is not None else [])
        out, lse = self._attend(*views, sinks, operands, torch.float64, dropout_keep)
        grad_out = operands.grad_out.double()
        delta_error = (grad_out * (kernel_out.double() - out.detach())).sum(-1)
        exact, defined = delta_defined_grads(out, lse, inputs, grad_out, delta_error)
        errors = []
        for index, (true, kernel) in enumerate(zip(exact, defined)):
            if true is None or kernel is None or true.numel() == 0:
                errors.append(0.0)
                continue
            true, kernel = true.nan_to_num(), kernel.nan_to_num()
            if index < 3 and self.layouts[index] == "broadcast":
                kernel = kernel.to(self.dtype).double()
                true, kernel = true.sum((0, 2)), kernel.sum((0, 2))
            errors.append((kernel - true).abs().max().item())
        return errors

    def _attend(self, q, k, v, sinks, operands: Operands, dtype: torch.dtype, dropout_keep):
        """attention_reference's (out, lse) over these q, k, v views and sinks in dtype."""
        mask = operands.attn_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        slopes = operands.alibi_slopes
        slopes = None if slopes is None else slopes.to(accumulate_dtype(dtype))
        return attention_reference(
            q,
            k,
            v,
            causal=self.causal,
            scale=self.scale,
            window=self.window,
            attn_mask=mask,
            dropout_keep=dropout_keep,
            dropout_p=self.dropout_p,
            softcap=self.softcap,
            alibi_slopes=slopes,
            sinks=sinks,
        )

    def reference(self, operands: Operands, dtype: torch.dtype, dropout_keep=None):
        """(out, lse, grads of q, k, v leaves and sinks) of attention_reference in dtype."""
        leaves = leaves_like(operands.leaves, dtype)
        (sinks,) = leaves_like([operands.sinks], accumulate_dtype(dtype))
        out, lse = self._attend(*self.views(leaves), sinks, operands, dtype, dropout_keep)
        out.backward(operands.grad_out.to(dtype))
        grads = [leaf.grad for leaf in leaves] + ([sinks.grad] if sinks is not None else [])
        return out.detach(), lse.detach(), grads


@st.composite
def window_options(draw):
    sides = st.sampled_from(WINDOW_SIDES)
    return draw(st.one_of(st.none(), st.tuples(sides, sides)))


@st.composite
def dense_cases(draw, dropout: bool = False, dtypes_from=DTYPES):
    heads, kv_heads = draw(head_counts())
    batch = draw(st.sampled_from((0, 1, 1, 2, 3)))
    head_dim = draw(head_dims)
    head_dim_v = draw(st.one_of(st.just(head_dim), head_dims))
    seq_q, seq_k = shrink_to_budget(
        draw(lengths), draw(lengths), max(batch, 1) * heads, max(head_dim, head_dim_v)
    )
    mask = draw(st.sampled_from((None, None, "bool", "additive")))
    mask_shape, mask_expanded, empty_rows = (), False, ()
    if mask is not None:
        full = (batch, heads, seq_q, seq_k)
        rank = draw(st.integers(1, 4))
        mask_shape = tuple(size if draw(st.booleans()) else 1 for size in full[4 - rank :])
        mask_expanded = draw(st.booleans())
        if rank >= 2 and mask_shape[-2] == seq_q and seq_q > 0:
            empty_rows = tuple(draw(st.sets(st.integers(0, seq_q - 1), max_size=3)))
    alibi = draw(st.sampled_from((None, None, "heads", "batch")))
    return DenseCase(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=draw(st.sampled_from(dtypes_from)),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
        causal=draw(st.sampled_from(CAUSAL)),
        window=draw(window_options()),
        mask=mask,
        mask_shape=mask_shape,
        mask_expanded=mask_expanded,
        empty_rows=tuple(sorted(empty_rows)),
        scale=draw(st.sampled_from(SCALES)),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=alibi,
        sinks=draw(st.booleans()),
        dropout_p=draw(st.sampled_from(DROPOUT_PS)) if dropout else 0.0,
        deterministic=draw(st.sampled_from((None, True))),
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- paged caches

CACHE_LAYOUTS = ("HND", "NHD")
# Entries of a block table past a sequence's blocks may hold anything; these must never be read.
TABLE_GARBAGE = (-1, 0, 10**6, -(2**31))


def cache_tensor(generator, layout, num_blocks, kv_heads, block_size, dim, dtype):
    """A (num_blocks, kv_heads, block_size, dim) cache full of NaN (NHD: a strided view)."""
    if layout == "HND":
        return torch.full((num_blocks, kv_heads, block_size, dim), math.nan, dtype=dtype)
    storage = torch.full((num_blocks, block_size, kv_heads, dim), math.nan, dtype=dtype)
    return storage.transpose(1, 2)


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One mha_ext.paged_attention call over caches whose unused slots hold NaN. Sequence b has
    seq_lens[b] cached tokens, the last queries[b] of them queried; its blocks are a shuffled
    choice of the pool, and with shared_blocks sequence 1 starts with sequence 0's first
    blocks (a fork). table_padding extra columns of each table row hold garbage."""

    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    block_size: int
    seq_lens: Tuple[int, ...]
    queries: Tuple[int, ...]
    dtype: torch.dtype = torch.float32
    layout: str = "HND"
    spare_blocks: int = 0
    shared_blocks: int = 0
    table_padding: int = 0
    padded_q: bool = False
    scale: Optional[float] = None
    window_left: Optional[int] = None
    softcap: float = 0.0
    alibi: Optional[str] = None
    sinks: bool = False
    seed: int = 0

    def blocks_of(self, seq_len: int) -> int:
        return -(-seq_len // self.block_size)

    def build(self) -> dict:
        """q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, alibi_slopes, sinks."""
        generator = seeded(self.seed)
        counts = [self.blocks_of(n) for n in self.seq_lens]
        shared = min(self.shared_blocks, *counts[:2]) if len(counts) >= 2 else 0
        num_blocks = sum(counts) - shared + self.spare_blocks
        order = torch.randperm(max(num_blocks, 1), generator=generator).tolist()
        width = max(counts, default=0) + self.table_padding
        garbage = torch.tensor(TABLE_GARBAGE, dtype=torch.int32)
        picks = torch.randint(len(TABLE_GARBAGE), (len(counts), max(width, 1)), generator=generator)
        tables = garbage[picks]
        taken = 0
        for b, count in enumerate(counts):
            if b == 1 and shared:
                tables[1, :shared] = tables[0, :shared]
                row = order[taken : taken + count - shared]
                tables[1, shared:count] = torch.tensor(row, dtype=torch.int32)
                taken += count - shared
            else:
                tables[b, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
                taken += count
        shape = (max(num_blocks, 1), self.kv_heads, self.block_size)
        k_cache = cache_tensor(generator, self.layout, *shape, self.head_dim, self.dtype)
        v_cache = cache_tensor(generator, self.layout, *shape, self.head_dim_v, self.dtype)
        for b, seq_len in enumerate(self.seq_lens):
            positions = torch.arange(seq_len)
            blocks = tables[b, positions // self.block_size].long()
            offsets = positions % self.block_size
            for cache in (k_cache, v_cache):
                values = normal(generator, (seq_len, self.kv_heads, cache.shape[-1]), self.dtype)
                cache[blocks, :, offsets] = values
        total_q = sum(self.queries)
        width_q = self.head_dim + (3 if self.padded_q else 0)
        q = normal(generator, (total_q, self.heads, width_q), self.dtype)[..., : self.head_dim]
        cu_seqlens_q = torch.zeros(len(self.queries) + 1, dtype=torch.int32)
        cu_seqlens_q[1:] = torch.tensor(self.queries, dtype=torch.int32).cumsum(0)
        built = {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": tables,
            "seq_lens": torch.tensor(self.seq_lens, dtype=torch.int32),
            "cu_seqlens_q": cu_seqlens_q,
            "alibi_slopes": None,
            "sinks": None,
        }
        if self.alibi is not None:
            heads = self.heads
            shape = (heads,) if self.alibi == "heads" else (len(self.seq_lens), heads)
            built["alibi_slopes"] = uniform(generator, shape, 0.0, 1.0)
        if self.sinks:
            built["sinks"] = normal(generator, (self.heads,), torch.float32)
        return built

    def options(self, built: dict) -> dict:
        return {
            "scale": self.scale,
            "return_lse": True,
            "window": None if self.window_left is None else (self.window_left, 0),
            "softcap": self.softcap,
            "alibi_slopes": built["alibi_slopes"],
            "sinks": built["sinks"],
        }

    def call_text(self) -> str:
        options = self.options({"alibi_slopes": None, "sinks": None})
        if self.alibi:
            options["alibi_slopes"] = Arg("t['alibi_slopes']")
        if self.sinks:
            options["sinks"] = Arg("t['sinks']")
        names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q")
        call = call_text("mha_ext.paged_attention", *(f"t['{n}']" for n in names), **options)
        return f"t = {self!r}.build()\nout, lse = {call}"


@st.composite
def paged_cases(draw):
    heads, kv_heads = draw(head_counts())
    head_dim = draw(head_dims)
    head_dim_v = draw(st.one_of(st.just(head_dim), head_dims))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    batch = draw(st.integers(0, 4))
    # Tokens per call: the caches hold about this many rows of kv_heads x head_dim.
    token_budget = max(ELEMENT_BUDGET // (kv_heads * max(head_dim, head_dim_v)), 1)
    seq_lens, queries = [], []
    for _ in range(batch):
        seq_len = min(draw(lengths), max(token_budget // max(batch, 1), 0))
        seq_lens.append(seq_len)
        queries.append(draw(st.integers(0, min(seq_len, 9))))
    return PagedCase(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        seq_lens=tuple(seq_lens),
        queries=tuple(queries),
        dtype=draw(dtypes),
        layout=draw(st.sampled_from(CACHE_LAYOUTS)),
        spare_blocks=draw(st.integers(0, 3)),
        shared_blocks=draw(st.sampled_from((0, 0, 1, 2, 5))),
        table_padding=draw(st.integers(0, 2)),
        padded_q=draw(st.booleans()),
        scale=draw(st.sampled_from(SCALES)),
        window_left=draw(st.sampled_from((None, None, 0, 1, 3, 16, 100))),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=draw(st.sampled_from((None, None, "heads", "batch"))),
        sinks=draw(st.booleans()),
        seed=draw(seeds),
    )


@dataclasses.dataclass(frozen=True)
class AppendCase:
    """One mha_ext.paged_kv_append call: num_tokens new rows into NaN-poisoned caches at
    distinct shuffled slots, skipped_tokens of them with slot -1; keys and values optionally
    strided views (one projection holding both)."""

    kv_heads: int
    head_dim: int
    head_dim_v: int
    block_size: int
    num_blocks: int
    num_tokens: int
    skipped_tokens: int = 0
    dtype: torch.dtype = torch.float32
    layout: str = "HND"
    fused_kv: bool = False
    seed: int = 0

    def build(self) -> dict:
        generator = seeded(self.seed)
        shape = (self.num_blocks, self.kv_heads, self.block_size)
        k_cache = cache_tensor(generator, self.layout, *shape, self.head_dim, self.dtype)
        v_cache = cache_tensor(generator, self.layout, *shape, self.head_dim_v, self.dtype)
        capacity = self.num_blocks * self.block_size
        slots = torch.randperm(capacity, generator=generator)[: self.num_tokens]
        skipped = torch.randperm(self.num_tokens, generator=generator)[: self.skipped_tokens]
        slots[skipped] = -1
        rows = (self.num_tokens, self.kv_heads)
        if self.fused_kv:
            both = normal(generator, (*rows, self.head_dim + self.head_dim_v), self.dtype)
            key, value = both[..., : self.head_dim], both[..., self.head_dim :]
        else:
            key = normal(generator, (*rows, self.head_dim), self.dtype)
            value = normal(generator, (*rows, self.head_dim_v), self.dtype)
        return {
            "key": key,
            "value": value,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "slot_mapping": slots.to(torch.int64),
        }

    def call_text(self) -> str:
        names = ("key", "value", "k_cache", "v_cache", "slot_mapping")
        call = call_text("mha_ext.paged_kv_append", *(f"t['{n}']" for n in names))
        return f"t = {self!r}.build()\n{call}"


@st.composite
def append_cases(draw):
    kv_heads = draw(st.integers(1, 4))
    head_dim = draw(head_dims)
    head_dim_v = draw(st.one_of(st.just(head_dim), head_dims))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    slots_budget = max(ELEMENT_BUDGET // (kv_heads * max(head_dim, head_dim_v)), 1)
    num_blocks = draw(st.integers(1, max(1, min(8, slots_budget // block_size))))
    capacity = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(capacity, 300)))
    return AppendCase(
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        num_blocks=num_blocks,
        num_tokens=num_tokens,
        skipped_tokens=draw(st.integers(0, num_tokens)),
        dtype=draw(dtypes),
        layout=draw(st.sampled_from(CACHE_LAYOUTS)),
        fused_kv=draw(st.booleans()),
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- merging states

MERGE_LAYOUTS = ("contiguous", "transposed", "broadcast")


@dataclasses.dataclass(frozen=True)
class MergeCase:
    """One mha_ext.merge_attention_states call: outputs (*rows, head_dim) in a layout of
    MERGE_LAYOUTS each ("transposed": a strided last dim), logsumexps (*rows) with -inf (an
    empty side) in the rows listed, on one side or both."""

    rows: Tuple[int, ...]
    head_dim: int
    dtype: torch.dtype = torch.float32
    layouts: Tuple[str, str] = ("contiguous", "contiguous")
    empty_a: Tuple[int, ...] = ()  # flat row indices whose lse_a is -inf
    empty_b: Tuple[int, ...] = ()
    seed: int = 0

    def build(self) -> dict:
        generator = seeded(self.seed)
        shape = (*self.rows, self.head_dim)
        built = {}
        for side, layout, empty in (
            ("a", self.layouts[0], self.empty_a),
            ("b", self.layouts[1], self.empty_b),
        ):
            if layout == "transposed":
                out = normal(generator, shape[::-1], self.dtype).permute(
                    *range(len(shape) - 1, -1, -1)
                )
            elif layout == "broadcast":
                out = normal(generator, (1,) * len(self.rows) + (self.head_dim,), self.dtype)
                out = out.expand(shape)
            else:
                out = normal(generator, shape, self.dtype)
            lse = normal(generator, self.rows, accumulate_dtype(self.dtype), std=3.0)
            flat = lse.view(-1)
            flat[list(empty)] = -math.inf
            built[f"out_{side}"] = out.requires_grad_()
            built[f"lse_{side}"] = lse.requires_grad_()
        return built

    def call_text(self) -> str:
        names = ("out_a", "lse_a", "out_b", "lse_b")
        call = call_text("mha_ext.merge_attention_states", *(f"t['{n}']" for n in names))
        return f"t = {self!r}.build()\nout, lse = {call}"


@st.composite
def merge_cases(draw):
    rank = draw(st.integers(0, 3))
    rows = tuple(draw(st.sampled_from((0, 1, 2, 3, 5, 17))) for _ in range(rank))
    count = math.prod(rows)
    row_ids = st.sets(st.integers(0, count - 1), max_size=count) if count else st.just(set())
    return MergeCase(
        rows=rows,
        head_dim=draw(head_dims),
        dtype=draw(dtypes),
        layouts=(draw(st.sampled_from(MERGE_LAYOUTS)), draw(st.sampled_from(MERGE_LAYOUTS))),
        empty_a=tuple(sorted(draw(row_ids))),
        empty_b=tuple(sorted(draw(row_ids))),
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- packed (varlen) attention


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """One mha_ext.attention_varlen call: sequence b has q_lens[b] queries and k_lens[b] keys
    (0 allowed), of which it uses the first used_k[b] when used_k is given (seqused_k).
    max_slack is added to both max_seqlen bounds (the kernels plan with them; larger than
    the longest sequence is allowed). padded_q: q rows of a wider buffer (strided rows)."""

    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    used_k: Optional[Tuple[int, ...]] = None
    dtype: torch.dtype = torch.float32
    causal: Optional[str] = None
    window: Optional[tuple] = None
    scale: Optional[float] = None
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "heads" (H,) or "batch" (batch, H)
    sinks: bool = False
    max_slack: int = 0
    padded_q: bool = False
    deterministic: Optional[bool] = None
    seed: int = 0

    def build(self) -> dict:
        """q, k, v (autograd leaves but for a padded q's view), cu_seqlens_q / _k, seqused_k,
        alibi_slopes, sinks, grad_out and the leaves."""
        generator = seeded(self.seed)
        total_q, total_k = sum(self.q_lens), sum(self.k_lens)
        width = self.head_dim + (2 if self.padded_q else 0)
        q_leaf = normal(generator, (total_q, self.heads, width), self.dtype).requires_grad_()
        k = normal(generator, (total_k, self.kv_heads, self.head_dim), self.dtype)
        v = normal(generator, (total_k, self.kv_heads, self.head_dim_v), self.dtype)
        built = {
            "q": q_leaf[..., : self.head_dim],
            "k": k.requires_grad_(),
            "v": v.requires_grad_(),
            "cu_seqlens_q": offsets(self.q_lens),
            "cu_seqlens_k": offsets(self.k_lens),
            "seqused_k": None,
            "alibi_slopes": None,
            "sinks": None,
        }
        if self.used_k is not None:
            built["seqused_k"] = torch.tensor(self.used_k, dtype=torch.int32)
        if self.alibi is not None:
            shape = (self.heads,) if self.alibi == "heads" else (len(self.q_lens), self.heads)
            built["alibi_slopes"] = uniform(generator, shape, 0.0, 1.0)
        if self.sinks:
            built["sinks"] = normal(generator, (self.heads,), torch.float32).requires_grad_()
        built["grad_out"] = normal(generator, (total_q, self.heads, self.head_dim_v), self.dtype)
        built["leaves"] = [q_leaf, built["k"], built["v"]]
        return built

    def max_seqlens(self) -> Tuple[int, int]:
        return (
            max(self.q_lens, default=0) + self.max_slack,
            max(self.k_lens, default=0) + self.max_slack,
        )

    def options(self, built: dict) -> dict:
        return {
            "causal": self.causal,
            "scale": self.scale,
            "window": self.window,
            "softcap": self.softcap,
            "alibi_slopes": built["alibi_slopes"],
            "sinks": built["sinks"],
            "return_lse": True,
            "seqused_k": built["seqused_k"],
            "deterministic": self.deterministic,
        }

    def call_text(self) -> str:
        options = self.options({"alibi_slopes": None, "sinks": None, "seqused_k": None})
        present = {"alibi_slopes": self.alibi, "sinks": self.sinks, "seqused_k": self.used_k}
        for key, given in present.items():
            if given is not None and given is not False:
                options[key] = Arg(f"t['{key}']")
        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
        args = [f"t['{n}']" for n in names] + [repr(n) for n in self.max_seqlens()]
        call = call_text("mha_ext.attention_varlen", *args, **options)
        return f"t = {self!r}.build()\nout, lse = {call}"

    def _attend(self, leaves, sinks, built: dict, dtype: torch.dtype):
        """attention_varlen_reference's (out, lse) over these q, k, v leaves and sinks in
        dtype; there must be a sequence."""
        slopes = built["alibi_slopes"]
        slopes = None if slopes is None else slopes.to(accumulate_dtype(dtype))
        return attention_varlen_reference(
            leaves[0][..., : self.head_dim],
            leaves[1],
            leaves[2],
            built["cu_seqlens_q"],
            built["cu_seqlens_k"],
            causal=self.causal,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=slopes,
            sinks=sinks,
            seqused_k=built["seqused_k"],
        )

    def reference(self, built: dict, dtype: torch.dtype):
        """(out, lse, grads of the q, k, v leaves and sinks) of attention_varlen_reference."""
        leaves = leaves_like(built["leaves"], dtype)
        (sinks,) = leaves_like([built["sinks"]], accumulate_dtype(dtype))
        if not self.q_lens:  # no sequence: nothing to compute
            out = leaves[0].new_zeros(0, self.heads, self.head_dim_v)
            lse = leaves[0].new_zeros(self.heads, 0, dtype=accumulate_dtype(dtype))
            grads = [torch.zeros_like(x) for x in leaves + ([] if sinks is None else [sinks])]
            return out, lse, grads
        out, lse = self._attend(leaves, sinks, built, dtype)
        out.backward(built["grad_out"].to(dtype))
        grads = [leaf.grad for leaf in leaves] + ([sinks.grad] if sinks is not None else [])
        return out.detach(), lse.detach(), grads

    def definition_errors(self, built: dict, kernel_out) -> list:
        """Per gradient (q, k, v leaves, then sinks), how far it is off by the kernels'
        definition, in float64: delta = rowsum(dO * O) reads the output as the kernel rounded
        it, so the gradients are those of out . dO - sum_rows (delta's error) lse
        (DenseCase.definition_errors); summed over a head's rows, grad_sinks' share reaches
        2% of a bf16 gradient."""
        sinks_given = built["sinks"] is not None
        if not self.q_lens:
            return [0.0] * (3 + sinks_given)
        leaves = leaves_like(built["leaves"], torch.float64)
        (sinks,) = leaves_like([built["sinks"]], torch.float64)
        inputs = leaves + ([sinks] if sinks_given else [])
        out, lse = self._attend(leaves, sinks, built, torch.float64)  # lse (heads, total_q)
        grad_out = built["grad_out"].double()
        delta_error = (grad_out * (kernel_out.double() - out.detach())).sum(-1).T
        exact, defined = delta_defined_grads(out, lse, inputs, grad_out, delta_error)
        return [
            0.0
            if true is None or kernel is None or true.numel() == 0
            else (kernel.nan_to_num() - true.nan_to_num()).abs().max().item()
            for true, kernel in zip(exact, defined)
        ]


def offsets(lengths) -> torch.Tensor:
    """cu_seqlens (batch + 1,) int32 of the lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


VARLEN_LENGTHS = (0, 0, 1, 2, 3, 5, 7, 13, 16, 17, 31, 33, 64, 97)


@st.composite
def varlen_cases(draw):
    heads, kv_heads = draw(head_counts())
    head_dim = draw(head_dims)
    head_dim_v = draw(st.one_of(st.just(head_dim), head_dims))
    batch = draw(st.integers(0, 5))
    q_lens = [draw(st.sampled_from(VARLEN_LENGTHS)) for _ in range(batch)]
    k_lens = [draw(st.sampled_from(VARLEN_LENGTHS)) for _ in range(batch)]
    # The budgets hold for the packed call as a whole: halve the longest until it fits.
    width = max(head_dim, head_dim_v)
    while (
        heads * sum(a * b for a, b in zip(q_lens, k_lens)) > SCORE_BUDGET
        or heads * max(sum(q_lens), sum(k_lens)) * width > ELEMENT_BUDGET
    ):
        lens = q_lens if sum(q_lens) >= sum(k_lens) else k_lens
        longest = max(range(batch), key=lambda b: lens[b])
        lens[longest] //= 2
    used_k = None
    if draw(st.booleans()):
        used_k = tuple(draw(st.integers(0, n)) for n in k_lens)
    return VarlenCase(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        q_lens=tuple(q_lens),
        k_lens=tuple(k_lens),
        used_k=used_k,
        dtype=draw(dtypes),
        causal=draw(st.sampled_from(CAUSAL)),
        window=draw(window_options()),
        scale=draw(st.sampled_from(SCALES)),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=draw(st.sampled_from((None, None, "heads", "batch"))),
        sinks=draw(st.booleans()),
        max_slack=draw(st.sampled_from((0, 0, 1, 7))),
        padded_q=draw(st.booleans()),
        deterministic=draw(st.sampled_from((None, True))),
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- torch's SDPA signature


@dataclasses.dataclass(frozen=True)
class SdpaCase:
    """One scaled_dot_product_attention call, made to mha_ext's drop-in and to torch's:
    q (*q_lead, L, E), k (*k_lead, S, E), v (*v_lead, S, Ev), leading dims that broadcast (or,
    drawn on purpose, do not), an optional mask of mask_shape (mask_dtype: "bool", "query"
    for q's dtype, or a dtype name), is_causal, scale, enable_gqa; dropout off."""

    q_lead: Tuple[int, ...]
    k_lead: Tuple[int, ...]
    v_lead: Tuple[int, ...]
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype = torch.float32
    mask_shape: Optional[Tuple[int, ...]] = None
    mask_dtype: str = "bool"
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False
    seed: int = 0

    def build(self):
        """(args, kwargs) of the call: q, k, v as autograd leaves."""
        generator = seeded(self.seed)
        q = normal(generator, (*self.q_lead, self.seq_q, self.head_dim), self.dtype)
        k = normal(generator, (*self.k_lead, self.seq_k, self.head_dim), self.dtype)
        v = normal(generator, (*self.v_lead, self.seq_k, self.head_dim_v), self.dtype)
        kwargs = {"is_causal": self.is_causal, "scale": self.scale, "enable_gqa": self.enable_gqa}
        if self.mask_shape is not None:
            keep = torch.rand(self.mask_shape, generator=generator) < 0.8
            if self.mask_dtype == "bool":
                kwargs["attn_mask"] = keep
            else:
                dtype = (
                    self.dtype if self.mask_dtype == "query" else getattr(torch, self.mask_dtype)
                )
                bias = normal(generator, self.mask_shape, dtype)
                kwargs["attn_mask"] = bias.masked_fill(~keep, float("-inf"))
        return [x.requires_grad_() for x in (q, k, v)], kwargs

    def call_text(self) -> str:
        call = call_text("mha_ext.scaled_dot_product_attention", "*args", "**kwargs")
        return f"args, kwargs = {self!r}.build()\nout = {call}"


@st.composite
def sdpa_cases(draw):
    """Mostly valid calls; now and then leading dims, heads or a mask that torch refuses."""
    lead = tuple(draw(st.sampled_from((0, 1, 2, 3))) for _ in range(draw(st.integers(0, 2))))
    head_pairs = st.sampled_from(((1, 1), (2, 1), (4, 2), (6, 3), (6, 2), (3, 2)))
    heads, kv_heads = draw(head_pairs)
    enable_gqa = bool(lead) and draw(st.booleans())

    def lead_of(last):
        dims = list(lead[: len(lead) - 1]) + ([last] if lead else [])
        dims = dims[draw(st.integers(0, len(dims))) :] if draw(st.booleans()) else dims
        return tuple(1 if draw(st.integers(0, 4)) == 0 else d for d in dims)

    q_lead = lead_of(heads)
    k_lead = lead_of(kv_heads if enable_gqa else heads)
    v_lead = k_lead if draw(st.integers(0, 4)) else lead_of(kv_heads if enable_gqa else heads)
    head_dim = draw(st.sampled_from((1, 2, 8, 17, 64, 100)))
    head_dim_v = draw(st.sampled_from((head_dim, head_dim, 3, 33)))
    rows = max(math.prod(q_lead), math.prod(k_lead), 1)
    seq_q, seq_k = shrink_to_budget(draw(lengths), draw(lengths), rows, max(head_dim, head_dim_v))
    mask_shape, mask_dtype = None, "bool"
    is_causal = draw(st.integers(0, 3)) == 0
    if draw(st.booleans()):
        weights = (*q_lead, seq_q, seq_k)
        rank = draw(st.integers(0, len(weights) + (1 if draw(st.integers(0, 9)) == 0 else 0)))
        full = ((2,) + weights)[len(weights) + 1 - rank :]
        mask_shape = tuple(1 if draw(st.integers(0, 2)) == 0 else d for d in full)
        mask_dtype = draw(st.sampled_from(("bool", "bool", "query", "float32", "float64")))
    return SdpaCase(
        q_lead=q_lead,
        k_lead=k_lead,
        v_lead=v_lead,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16))),
        mask_shape=mask_shape,
        mask_dtype=mask_dtype,
        is_causal=is_causal,
        scale=draw(st.sampled_from((None, None, 0.0, 0.3, 2.0))),
        enable_gqa=enable_gqa,
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- flash_attn_interface

FLASH_FORMS = ("func", "kvpacked", "qkvpacked", "varlen", "varlen_kvpacked", "varlen_qkvpacked")


@dataclasses.dataclass(frozen=True)
class FlashCase:
    """One call of a flash_attn_interface function (form: FLASH_FORMS): dense forms take
    q (batch, seq_q, H, D), k / v (batch, seq_k, Hkv, D(v)); varlen forms pack sequences of
    q_lens / k_lens. The packed forms stack q / k / v (or k / v) along a new dim of one
    tensor, the autograd leaf. window: FlashAttention's (left, right), -1 unbounded."""

    form: str
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    dtype: torch.dtype = torch.float32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "heads" (H,) or "batch" (batch, H)
    seed: int = 0

    @property
    def varlen(self) -> bool:
        return self.form.startswith("varlen")

    def build(self) -> dict:
        """leaves (the tensors the call takes, before unpacking), alibi_slopes, grad_out."""
        generator = seeded(self.seed)
        batch = len(self.q_lens)
        if self.varlen:
            q_rows, k_rows = (sum(self.q_lens),), (sum(self.k_lens),)
        else:
            q_rows, k_rows = (batch, self.q_lens[0]), (batch, self.k_lens[0])
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if self.form.endswith("qkvpacked"):
            shapes = [(*q_rows, 3, heads, dim)]
        elif self.form.endswith("kvpacked"):
            shapes = [(*q_rows, heads, dim), (*k_rows, 2, kv_heads, dim)]
        else:
            shapes = [(*q_rows, heads, dim), (*k_rows, kv_heads, dim)]
            shapes.append((*k_rows, kv_heads, self.head_dim_v))
        built = {"leaves": [normal(generator, s, self.dtype).requires_grad_() for s in shapes]}
        built["alibi_slopes"] = None
        if self.alibi is not None:
            shape = (heads,) if self.alibi == "heads" else (batch, heads)
            built["alibi_slopes"] = uniform(generator, shape, 0.0, 1.0)
        out_rows = q_rows
        built["grad_out"] = normal(generator, (*out_rows, heads, self.head_dim_v), self.dtype)
        return built

    def unpacked(self, leaves):
        """(q, k, v) views of the leaves."""
        if self.form.endswith("qkvpacked"):
            qkv = leaves[0]
            return qkv.select(-3, 0), qkv.select(-3, 1), qkv.select(-3, 2)
        if self.form.endswith("kvpacked"):
            return leaves[0], leaves[1].select(-3, 0), leaves[1].select(-3, 1)
        return tuple(leaves)

    def lengths(self):
        return offsets(self.q_lens), offsets(self.k_lens)

    def call(self, leaves, alibi_slopes):
        """(out, lse) of the case's function."""
        options = {
            "causal": self.causal,
            "window_size": self.window,
            "softcap": self.softcap,
            "alibi_slopes": alibi_slopes,
            "return_attn_probs": True,
        }
        name = "flash_attn_func" if self.form == "func" else f"flash_attn_{self.form}_func"
        function = getattr(flash_attn, name)
        if self.varlen:
            cu_q, cu_k = self.lengths()
            bounds = (max(self.q_lens, default=0), max(self.k_lens, default=0))
            if self.form == "varlen_qkvpacked":
                out, lse, _ = function(*leaves, cu_q, bounds[0], **options)
            else:
                out, lse, _ = function(*leaves, cu_q, cu_k, *bounds, **options)
        else:
            out, lse, _ = function(*leaves, **options)
        return out, lse

    def call_text(self) -> str:
        call = "out, lse = case.call(t['leaves'], t['alibi_slopes'])"
        return f"case = {self!r}\nt = case.build()\n{call}"


@st.composite
def flash_cases(draw):
    form = draw(st.sampled_from(FLASH_FORMS))
    heads, kv_heads = draw(head_counts())
    head_dim = draw(head_dims)
    head_dim_v = head_dim
    if form.endswith("qkvpacked"):
        kv_heads = heads
    elif not form.endswith("kvpacked"):
        head_dim_v = draw(st.one_of(st.just(head_dim), head_dims))
    batch = draw(st.integers(1 if not form.startswith("varlen") else 0, 3))
    if form.startswith("varlen"):
        q_lens = [draw(st.sampled_from(VARLEN_LENGTHS)) for _ in range(batch)]
        k_lens = [draw(st.sampled_from(VARLEN_LENGTHS)) for _ in range(batch)]
    else:
        q_lens, k_lens = [draw(lengths)] * batch, [draw(lengths)] * batch
    if form.endswith("qkvpacked"):
        k_lens = list(q_lens)
    width = max(head_dim, head_dim_v)
    while (
        heads * sum(a * b for a, b in zip(q_lens, k_lens)) > SCORE_BUDGET
        or heads * max(sum(q_lens), sum(k_lens)) * width > ELEMENT_BUDGET
    ):
        q_lens, k_lens = [n // 2 for n in q_lens], [n // 2 for n in k_lens]
    sides = st.sampled_from((-1, -1, 0, 1, 3, 17))
    return FlashCase(
        form=form,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        q_lens=tuple(q_lens),
        k_lens=tuple(k_lens),
        dtype=draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16))),
        causal=draw(st.booleans()),
        window=(draw(sides), draw(sides)),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=draw(st.sampled_from((None, None, "heads", "batch"))),
        seed=draw(seeds),
    )


@dataclasses.dataclass(frozen=True)
class KvcacheCase:
    """One flash_attn_with_kvcache call: sequence b holds cache_seqlens[b] tokens of a cache
    of `capacity` rows (paged: blocks of block_size, a shuffled table; else (batch, capacity)
    rows), appends `new` tokens in place and attends from seqlen_q queries."""

    heads: int
    kv_heads: int
    head_dim: int
    cache_seqlens: Tuple[int, ...]
    capacity: int
    new: int
    seqlen_q: int
    block_size: Optional[int] = None  # None: a contiguous cache
    dtype: torch.dtype = torch.float32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    seed: int = 0

    def build(self) -> dict:
        generator = seeded(self.seed)
        batch, dim = len(self.cache_seqlens), self.head_dim
        args = {"q": normal(generator, (batch, self.seqlen_q, self.heads, dim), self.dtype)}
        if self.block_size is None:
            shape = (batch, self.capacity, self.kv_heads, dim)
        else:
            per_sequence = self.capacity // self.block_size
            num_blocks = batch * per_sequence + 2  # two blocks no sequence owns
            order = torch.randperm(num_blocks, generator=generator)[: batch * per_sequence]
            args["block_table"] = order.view(batch, per_sequence).to(torch.int32)
            shape = (num_blocks, self.block_size, self.kv_heads, dim)
        args["k_cache"] = normal(generator, shape, self.dtype)
        args["v_cache"] = normal(generator, shape, self.dtype)
        if self.new:
            args["k"] = normal(generator, (batch, self.new, self.kv_heads, dim), self.dtype)
            args["v"] = normal(generator, (batch, self.new, self.kv_heads, dim), self.dtype)
        args["cache_seqlens"] = torch.tensor(self.cache_seqlens, dtype=torch.int32)
        if self.alibi is not None:
            shape = (self.heads,) if self.alibi == "heads" else (batch, self.heads)
            args["alibi_slopes"] = uniform(generator, shape, 0.0, 1.0)
        args.update(
            causal=self.causal,
            window_size=self.window,
            softcap=self.softcap,
            return_softmax_lse=True,
        )
        return args

    def cache_rows(self, args: dict):
        """(index tuple of each sequence's capacity rows in the cache: (batch, capacity)
        block and offset, or sequence and position)."""
        batch = len(self.cache_seqlens)
        positions = torch.arange(self.capacity)
        if self.block_size is None:
            return torch.arange(batch)[:, None].expand(batch, self.capacity), positions.expand(
                batch, self.capacity
            )
        table = args["block_table"].long()
        offsets_in_block = (positions % self.block_size).expand(batch, self.capacity)
        return table[:, positions // self.block_size], offsets_in_block

    def call_text(self) -> str:
        return f"args = {self!r}.build()\nout, lse = flash_attn.flash_attn_with_kvcache(**args)"


@st.composite
def kvcache_cases(draw):
    heads, kv_heads = draw(head_counts())
    head_dim = draw(st.sampled_from((1, 8, 17, 64, 128)))
    block_size = draw(st.sampled_from((None, None, 1, 2, 16, 64)))
    unit = block_size or 1
    capacity = unit * draw(st.integers(1, max(1, 96 // unit)))
    batch = draw(st.integers(1, 3))
    new = draw(st.integers(0, min(capacity, 5)))
    seqlen_q = draw(st.integers(1, 5))
    cache_seqlens = tuple(draw(st.integers(0, capacity - new)) for _ in range(batch))
    sides = st.sampled_from((-1, -1, 0, 1, 4))
    return KvcacheCase(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        cache_seqlens=cache_seqlens,
        capacity=capacity,
        new=new,
        seqlen_q=seqlen_q,
        block_size=block_size,
        dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
        causal=draw(st.booleans()),
        window=(draw(sides), draw(sides)),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=draw(st.sampled_from((None, None, "heads", "batch"))),
        seed=draw(seeds),
    )


# ---------------------------------------------------------------- MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class ModuleCase:
    """One MultiHeadAttention forward (eval, dropout off): q (batch, seq_q, d_model) and k, v
    (batch, seq_k, d_model), with the module's score options, is_causal or a 0 / 1 mask of
    mask_shape (broadcast to (batch, heads, seq_q, seq_k))."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    seq_q: int
    seq_k: int
    dtype: torch.dtype = torch.float32
    bias: bool = False
    window: Optional[tuple] = None
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    is_causal: bool = False
    mask_shape: Optional[Tuple[int, ...]] = None
    seed: int = 0

    def build(self) -> dict:
        """The layer (in dtype, parameters drawn from the seed) and its inputs."""
        torch.manual_seed(self.seed)
        d_model = self.num_heads * self.head_dim
        layer = mha_ext.MultiHeadAttention(
            d_model,
            self.num_heads,
            dropout=0.0,
            num_kv_heads=self.num_kv_heads,
            bias=self.bias,
            window=self.window,
            softcap=self.softcap,
            alibi=self.alibi,
            sinks=self.sinks,
        ).eval()
        generator = seeded(self.seed)
        if layer.sinks is not None:
            with torch.no_grad():
                layer.sinks.copy_(normal(generator, (self.num_heads,), torch.float32))
        layer = layer.to(self.dtype)
        built = {"layer": layer, "mask": None}
        for name, seq in (("q", self.seq_q), ("k", self.seq_k), ("v", self.seq_k)):
            built[name] = normal(generator, (self.batch, seq, d_model), self.dtype)
        if self.mask_shape is not None:
            built["mask"] = (torch.rand(self.mask_shape, generator=generator) < 0.8).int()
        return built

    def call_text(self) -> str:
        call = "t['layer'](t['q'], t['k'], t['v'], t['mask'], is_causal=" + f"{self.is_causal})"
        return f"t = {self!r}.build()\nout = {call}"


@st.composite
def module_cases(draw):
    heads, kv_heads = draw(head_counts())
    head_dim = draw(st.sampled_from((1, 2, 8, 16, 17, 64)))
    batch = draw(st.integers(1, 3))
    seq_q, seq_k = shrink_to_budget(
        draw(lengths), draw(lengths), batch * heads, heads * head_dim * 4
    )
    is_causal = draw(st.booleans())
    mask_shape = None
    if not is_causal and draw(st.booleans()):
        full = (batch, heads, seq_q, seq_k)
        mask_shape = tuple(d if draw(st.booleans()) else 1 for d in full)
    sides = st.sampled_from((None, 0, 1, 4))
    return ModuleCase(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        batch=batch,
        seq_q=seq_q,
        seq_k=seq_k,
        dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
        bias=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.tuples(sides, sides))),
        softcap=draw(st.sampled_from(SOFTCAPS)),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        is_causal=is_causal,
        mask_shape=mask_shape,
        seed=draw(seeds),
    )

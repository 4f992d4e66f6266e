"""Property-based tests of the paged KV-cache ops and of merging attention states: generated
caches (HND / NHD, block sizes 1..256, shuffled and shared block tables, garbage past each
sequence's blocks, NaN in every unused slot) against the float64 references."""

import math

import torch
from hypothesis import example, given, note

import mha_ext
from mha_ext.reference import paged_attention_reference

from conftest import OUTPUT_FACTOR
from fuzz_strategies import (
    MergeCase,
    append_cases,
    check_logsumexp,
    check_rule,
    fuzz_settings,
    merge_cases,
    paged_cases,
    same_grads,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN payloads compare equal to themselves)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@fuzz_settings(200)
@given(case=append_cases())
def test_append_writes_exactly_the_addressed_slots(case):
    note(case.call_text())
    t = case.build()
    expected_k, expected_v = t["k_cache"].clone(), t["v_cache"].clone()
    for token, slot in enumerate(t["slot_mapping"].tolist()):
        if slot >= 0:
            block, offset = divmod(slot, case.block_size)
            expected_k[block, :, offset] = t["key"][token]
            expected_v[block, :, offset] = t["value"][token]
    mha_ext.paged_kv_append(t["key"], t["value"], t["k_cache"], t["v_cache"], t["slot_mapping"])
    assert torch.equal(bits(t["k_cache"]), bits(expected_k))
    assert torch.equal(bits(t["v_cache"]), bits(expected_v))


@fuzz_settings(200)
@given(case=paged_cases())
def test_paged_attention_matches_reference(case):
    note(case.call_text())
    t = case.build()
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q")
    tensors = [t[n] for n in names]
    out, lse = mha_ext.paged_attention(*tensors, **case.options(t))

    def reference(dtype):
        accumulate = torch.float64 if dtype == torch.float64 else torch.float32
        options = case.options(t)
        del options["return_lse"]
        for name in ("alibi_slopes", "sinks"):
            if options[name] is not None:
                options[name] = options[name].to(accumulate)
        q, k_cache, v_cache = (x.to(dtype) for x in tensors[:3])
        return paged_attention_reference(q, k_cache, v_cache, *tensors[3:], **options)

    truth, plain = reference(torch.float64), reference(case.dtype)
    check_rule(out, truth[0], plain[0], OUTPUT_FACTOR, "out", score_scale=largest_score(case, t))
    check_logsumexp(lse, truth[1], plain[1], score_scale=largest_score(case, t))


def largest_score(case, t) -> float:
    """max |scale x q . k| over the cached keys (NaN slots skipped): check_rule's score_scale."""
    q = t["q"].double()
    keys = t["k_cache"].double().transpose(1, 2).flatten(0, 1)  # (slots, Hkv, D)
    keys = keys[~keys.isnan().any(-1).any(-1)]
    if q.numel() == 0 or keys.numel() == 0:
        return 0.0
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    return abs(scale) * q.abs().max().item() * keys.abs().max().item() * case.head_dim**0.5


def merged_reference(out_a, lse_a, out_b, lse_b):
    """(out, lse) of merging two states, in out_a's dtype; rows empty on both sides give
    (0, -inf) with zero gradients."""
    neither = (lse_a == -math.inf) & (lse_b == -math.inf)
    lse_a, lse_b = (torch.where(neither, 0.0, x) for x in (lse_a, lse_b))
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse)[..., None].to(out_a.dtype)
    weight_b = torch.exp(lse_b - lse)[..., None].to(out_a.dtype)
    out = weight_a * out_a + weight_b * out_b
    out = torch.where(neither[..., None], 0.0, out)
    return out, torch.where(neither, -math.inf, lse)


# Found by this test: a strided last dim (a transposed view) was read as if contiguous.
@example(case=MergeCase(rows=(5,), head_dim=3, layouts=("transposed", "contiguous"), empty_b=(1,)))
# Found by this test: the backward's spreads were taken against the fp16-rounded output.
@example(case=MergeCase(rows=(), head_dim=15, dtype=torch.float16))
@fuzz_settings(200)
@given(case=merge_cases())
def test_merge_matches_reference_forward_and_backward(case):
    note(case.call_text())
    t = case.build()
    inputs = [t[n] for n in ("out_a", "lse_a", "out_b", "lse_b")]
    out, lse = mha_ext.merge_attention_states(*inputs)
    generator = torch.Generator().manual_seed(case.seed)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=generator, dtype=torch.float64)
    (out.double() * grad_out).sum().add((lse.double() * grad_lse).nan_to_num(0.0).sum()).backward()
    grads = [x.grad for x in inputs]

    def reference(dtype):
        leaves = [x.detach().to(dtype if i % 2 == 0 else lse.dtype) for i, x in enumerate(inputs)]
        if dtype == torch.float64:
            leaves = [x.double() for x in leaves]
        leaves = [x.requires_grad_() for x in leaves]
        ref_out, ref_lse = merged_reference(*leaves)
        finite = torch.isfinite(ref_lse)
        loss = (ref_out.double() * grad_out).sum() + (ref_lse.double() * grad_lse)[finite].sum()
        loss.backward()
        return ref_out.detach(), ref_lse.detach(), [x.grad for x in leaves]

    truth, plain = reference(torch.float64), reference(case.dtype)
    check_rule(out, truth[0], plain[0], OUTPUT_FACTOR, "out")
    check_logsumexp(lse, truth[1], plain[1])
    same_grads(grads, truth[2], plain[2], "grad (out_a, lse_a, out_b, lse_b)", case.head_dim)

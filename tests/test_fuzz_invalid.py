"""Generated invalid calls of the paged ops and of attention: each raises an error of the
expected type naming the bad argument, and the caches are bitwise unchanged (hashed before
and after)."""

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import mha_ext

from fuzz_strategies import append_cases, bytes_digest, dense_cases, fuzz_settings, paged_cases

CPU_ONLY = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def on_meta(t: dict, name: str) -> None:
    """Moves one argument to the meta device; the call then goes to the CPU kernel through
    redispatch (the dispatcher would send any call with a meta tensor to the fake kernel)."""
    t[name] = t[name].to("meta")
    t["_redispatch"] = True


def raise_paged(case, t, corruption, data):
    """Applies one corruption to a valid paged_attention call's tensors; returns the argument
    name the error must mention."""
    batch = len(case.seq_lens)
    b = data.draw(st.integers(0, batch - 1), label="sequence")
    capacity = t["block_tables"].shape[1] * case.block_size
    if corruption.endswith("int64"):
        name = corruption.split()[0]
        t[name] = t[name].to(torch.int64)
        return name
    if corruption == "negative seq_len":
        t["seq_lens"][b] = data.draw(st.sampled_from((-1, -(2**31))), label="length")
        return "seq_lens"
    if corruption == "seq_len beyond table":
        t["seq_lens"][b] = capacity + data.draw(st.integers(1, 3), label="excess")
        return "seq_lens"
    if corruption == "cu_seqlens_q end":
        t["cu_seqlens_q"][-1] += data.draw(st.sampled_from((-1, 1)), label="shift")
        return "cu_seqlens_q"
    if corruption == "cu_seqlens_q decreasing":
        cu = t["cu_seqlens_q"]
        assume(batch >= 2 and cu[1] > 0)
        cu[2] = cu[1] - 1
        return "cu_seqlens_q"
    if corruption == "block id out of range":
        used = -(-case.seq_lens[b] // case.block_size)
        assume(used > 0)
        column = data.draw(st.integers(0, used - 1), label="column")
        bad = data.draw(st.sampled_from((-1, t["k_cache"].shape[0], 2**31 - 1)), label="id")
        t["block_tables"][b, column] = bad
        return "block_tables"
    if corruption == "non-finite scale":
        t["scale"] = data.draw(st.sampled_from((math.nan, math.inf, -math.inf)), label="scale")
        return "scale"
    if corruption == "seq_lens shape":
        t["seq_lens"] = torch.cat([t["seq_lens"], t["seq_lens"][:1]])
        return "seq_lens"
    if corruption == "q head_dim":
        t["q"] = torch.zeros(*t["q"].shape[:2], case.head_dim + 1, dtype=case.dtype)
        return "q has head_dim"
    name = data.draw(st.sampled_from(("block_tables", "seq_lens", "cu_seqlens_q")), label="arg")
    on_meta(t, name)
    return name


PAGED_CORRUPTIONS = (
    "block_tables int64",
    "seq_lens int64",
    "cu_seqlens_q int64",
    "negative seq_len",
    "seq_len beyond table",
    "cu_seqlens_q end",
    "cu_seqlens_q decreasing",
    "block id out of range",
    "non-finite scale",
    "seq_lens shape",
    "q head_dim",
    "device",
)


@fuzz_settings(200)
@given(case=paged_cases(), corruption=st.sampled_from(PAGED_CORRUPTIONS), data=st.data())
def test_invalid_paged_attention_raises_and_changes_nothing(case, corruption, data):
    assume(len(case.seq_lens) > 0)
    note(case.call_text())
    t = case.build()
    t["scale"] = case.head_dim**-0.5 if case.scale is None else case.scale
    name = raise_paged(case, t, corruption, data)
    note(f"then {corruption}: {name}")
    before = bytes_digest(t["k_cache"], t["v_cache"])
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q")
    args = [t[n] for n in names] + [t["scale"], -1, 0.0, None, None]
    with pytest.raises(RuntimeError) as error:
        if t.get("_redispatch"):
            torch.ops.mha_ext.paged_attention.default.redispatch(CPU_ONLY, *args)
        else:
            mha_ext.ops.paged_attention(*args)
    assert "mha_ext.paged_attention" in str(error.value) and name in str(error.value)
    assert bytes_digest(t["k_cache"], t["v_cache"]) == before


APPEND_CORRUPTIONS = (
    "slot_mapping int32",
    "slot past the cache",
    "slot below -1",
    "token counts",
    "key dtype",
    "value head_dim",
    "device",
)


@fuzz_settings(200)
@given(case=append_cases(), corruption=st.sampled_from(APPEND_CORRUPTIONS), data=st.data())
def test_invalid_append_raises_and_writes_nothing(case, corruption, data):
    assume(case.num_tokens > 0)
    note(case.call_text())
    t = case.build()
    token = data.draw(st.integers(0, case.num_tokens - 1), label="token")
    capacity = case.num_blocks * case.block_size
    if corruption == "slot_mapping int32":
        t["slot_mapping"], name = t["slot_mapping"].to(torch.int32), "slot_mapping"
    elif corruption == "slot past the cache":
        t["slot_mapping"][token] = capacity + data.draw(st.sampled_from((0, 1, 2**40)))
        name = "slot_mapping"
    elif corruption == "slot below -1":
        t["slot_mapping"][token] = data.draw(st.sampled_from((-2, -(2**62))))
        name = "slot_mapping"
    elif corruption == "token counts":
        t["key"], name = t["key"][1:], "key"
    elif corruption == "key dtype":
        other = torch.float64 if case.dtype != torch.float64 else torch.float32
        t["key"], name = t["key"].to(other), "key"
    elif corruption == "value head_dim":
        t["value"], name = t["value"][..., 1:], "value"
        assume(case.head_dim_v > 1)
    else:
        name = data.draw(st.sampled_from(("key", "value", "slot_mapping")), label="arg")
        on_meta(t, name)
    note(f"then {corruption}: {name}")
    before = bytes_digest(t["k_cache"], t["v_cache"])
    args = [t[n] for n in ("key", "value", "k_cache", "v_cache", "slot_mapping")]
    with pytest.raises(RuntimeError) as error:
        if t.get("_redispatch"):
            torch.ops.mha_ext.paged_kv_append.default.redispatch(CPU_ONLY, *args)
        else:
            mha_ext.paged_kv_append(*args)
    assert "mha_ext.paged_kv_append" in str(error.value) and name in str(error.value)
    assert bytes_digest(t["k_cache"], t["v_cache"]) == before


@fuzz_settings(100)
@given(
    case=dense_cases(),
    scale=st.sampled_from((math.nan, math.inf, -math.inf)),
    mask_rows=st.integers(2, 5),
)
def test_invalid_attention_raises_naming_the_argument(case, scale, mask_rows):
    """A non-finite scale, and a mask whose rows do not broadcast to seq_q."""
    note(case.call_text())
    operands = case.build()
    options = case.options(operands)
    with pytest.raises(RuntimeError, match=r"mha_ext.attention: scale must be finite, got"):
        mha_ext.attention(operands.q, operands.k, operands.v, **{**options, "scale": scale})
    assume(case.seq_q not in (1, mask_rows))
    mask = torch.ones(mask_rows, case.seq_k, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"attn_mask of shape .* does not broadcast"):
        mha_ext.attention(operands.q, operands.k, operands.v, **{**options, "attn_mask": mask})

"""Generated invalid calls of the paged ops and of attention: each raises an error of the
expected type naming the bad argument, and the caches are bitwise unchanged (hashed before
and after)."""

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import mha_ext
import mha_ext.flash_attn_interface as flash_attn

from fuzz_strategies import (
    append_cases,
    bytes_digest,
    dense_cases,
    fuzz_settings,
    kvcache_cases,
    paged_cases,
    varlen_cases,
)

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
    if corruption == "queries beyond seq_len":
        queries = case.queries[b]
        assume(queries > 0)
        t["seq_lens"][b] = data.draw(st.integers(0, queries - 1), label="length")
        return "cu_seqlens_q"
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
    "queries beyond seq_len",
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


VARLEN_CORRUPTIONS = (
    "cu_seqlens_q decreasing",
    "cu_seqlens_k decreasing",
    "cu_seqlens_k negative",
    "cu_seqlens_q end",
    "cu_seqlens_k int64",
    "seqused_k int64",
    "max_seqlen_q short",
    "max_seqlen_k short",
    "seqused_k beyond",
    "seqused_k negative",
)


@fuzz_settings(200)
@given(case=varlen_cases(), corruption=st.sampled_from(VARLEN_CORRUPTIONS), data=st.data())
def test_invalid_varlen_raises_naming_the_argument(case, corruption, data):
    assume(len(case.q_lens) > 0)
    note(case.call_text())
    t = case.build()
    max_q, max_k = case.max_seqlens()
    b = data.draw(st.integers(0, len(case.q_lens) - 1), label="sequence")
    side = "q" if "_q" in corruption else "k"
    lens = case.q_lens if side == "q" else case.k_lens
    cu = t[f"cu_seqlens_{side}"]
    if corruption.endswith("decreasing"):
        assume(len(lens) >= 2 and lens[b] > 0 and b + 1 < len(lens))
        cu[b + 1] = cu[b] - 1
        name = f"cu_seqlens_{side}"
    elif corruption == "cu_seqlens_k negative":
        cu[0], name = -data.draw(st.integers(1, 2**31 - 1), label="first"), "cu_seqlens_k"
    elif corruption == "cu_seqlens_q end":
        cu[-1] += data.draw(st.sampled_from((-1, 1)), label="shift")
        name = "cu_seqlens_q"
    elif corruption.endswith("int64"):
        name = corruption.split()[0]
        if name == "seqused_k" and t["seqused_k"] is None:
            t["seqused_k"] = torch.tensor(case.k_lens, dtype=torch.int32)
        t[name] = t[name].to(torch.int64)
    elif corruption.startswith("max_seqlen"):
        assume(max(lens) > 0)
        name = f"max_seqlen_{side}"
        shortened = max(lens) - data.draw(st.integers(1, max(lens)), label="short")
        max_q, max_k = (shortened, max_k) if side == "q" else (max_q, shortened)
    else:
        used = torch.tensor(case.k_lens, dtype=torch.int32)
        used[b] = used[b] + 1 if corruption.endswith("beyond") else -1
        t["seqused_k"], name = used, "seqused_k"
    note(f"then {corruption}: {name}")
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    with pytest.raises(RuntimeError) as error:
        mha_ext.attention_varlen(*(t[n] for n in names), max_q, max_k, **case.options(t))
    # The op's own checks speak as mha_ext.attention (the op both functions call).
    assert "mha_ext.attention" in str(error.value) and name in str(error.value)


KVCACHE_CORRUPTIONS = (
    "cache_seqlens beyond",
    "cache_seqlens negative",
    "cache_seqlens int64",
    "block id out of range",
    "block_table int64",
    "k shape",
    "v head_dim",
    "k dtype",
)


@fuzz_settings(200)
@given(case=kvcache_cases(), corruption=st.sampled_from(KVCACHE_CORRUPTIONS), data=st.data())
def test_invalid_kvcache_raises_and_changes_nothing(case, corruption, data):
    note(case.call_text())
    args = case.build()
    b = data.draw(st.integers(0, len(case.cache_seqlens) - 1), label="sequence")
    if corruption == "cache_seqlens beyond":
        args["cache_seqlens"][b] = case.capacity - case.new + data.draw(st.integers(1, 3))
        name = "cache_seqlens"
    elif corruption == "cache_seqlens negative":
        args["cache_seqlens"][b], name = -1, "cache_seqlens"
    elif corruption.endswith("int64"):
        name = corruption.split()[0]
        assume(name in args)
        args[name] = args[name].to(torch.int64)
    elif corruption == "block id out of range":
        assume("block_table" in args)
        used = -(-(case.cache_seqlens[b] + case.new) // case.block_size)
        assume(used > 0)
        column = data.draw(st.integers(0, used - 1), label="column")
        bad = data.draw(st.sampled_from((-1, args["k_cache"].shape[0], 2**31 - 1)), label="id")
        args["block_table"][b, column], name = bad, "block_table"
    else:
        assume(case.new > 0)
        name = "k" if corruption.startswith("k") else "v"
        if corruption == "k shape":
            args["k"] = args["k"][:, :, :, :-1] if case.head_dim > 1 else args["k"][:1, :0]
            assume(args["k"].shape != args["v"].shape or case.head_dim > 1)
        elif corruption == "v head_dim":
            args["v"] = torch.cat([args["v"], args["v"][..., :1]], -1)
        else:
            other = torch.float64 if case.dtype != torch.float64 else torch.float32
            args["k"] = args["k"].to(other)
    note(f"then {corruption}: {name}")
    before = bytes_digest(args["k_cache"], args["v_cache"])
    with pytest.raises((RuntimeError, ValueError)) as error:
        flash_attn.flash_attn_with_kvcache(**args)
    assert "flash_attn_with_kvcache" in str(error.value) and name in str(error.value)
    assert bytes_digest(args["k_cache"], args["v_cache"]) == before

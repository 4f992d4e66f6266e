"""The flex suite: mha_ext against FlexAttention (torch.nn.attention.flex_attention compiled by
torch.compile; on a CPU, inductor's C++ flex template) on the cases FlexAttention is made
for: causal prefill, a sliding window, a softcap score_mod, and decode over torch's paged
cache (torch.nn.attention.experimental._paged_attention).

Each case compiles FlexAttention first (torch.compile with dynamo reset, so every case
compiles its own graph) and records the seconds of that first call apart from the timing;
then it checks FlexAttention's output against mha_ext's before anything is timed. A case
FlexAttention fails to compile or run, or whose output differs, keeps mha_ext's row and
reports flex as unsupported with the reason. Not among the default suites: each compile
takes tens of seconds on 2 cores.
"""

import itertools
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import functional
from ..kv_cache import PagedKVCache
from .roofline import cpu_cache_bytes
from .suites import Case, dtype_name, fill_cache_layers

# torch.compile's backend for FlexAttention; the tests swap in "eager" (the same graph run by
# torch's reference implementation, no code generation).
FLEX_BACKEND = "inductor"
# Prefill: (label, batch, heads, kv_heads, head_dim) at each of the run's lengths.
PREFILL_SHAPE = ("h8-d128", 1, 8, 8, 128)
PREFILL_CASES = ("causal", "window", "softcap")
WINDOW_LEFT = 256  # query i sees keys i - 256 .. i
SOFTCAP = 30.0  # each scaled score s becomes 30 tanh(s / 30)
# Decode: one query per sequence, batch --decode-batch, over a context of the run's lengths.
DECODE_SHAPE = ("gqa-32q-8kv", 32, 8, 128)  # (label, heads, kv_heads, head_dim)
PAGE_SIZE = 128  # torch's paged cache needs the block mask's kv block: FlexAttention's 128
# Output check, elementwise |flex - mha_ext| <= atol + rtol |mha_ext|: about one rounding of
# each output in bf16 and fp16, and the difference of two fp32 accumulation orders in fp32.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}


def _compiled_first_call(
    attend: Callable, arguments: Tuple
) -> Tuple[Callable, torch.Tensor, float]:
    """attend compiled (full graph: a graph break would time eager FlexAttention, torch's slow
    reference), its first output and that call's seconds, the compile's cost."""
    torch._dynamo.reset()  # a fresh compile per case, clear of dynamo's recompile limit
    compiled = torch.compile(attend, backend=FLEX_BACKEND, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    out = compiled(*arguments)
    return compiled, out, time.perf_counter() - start


def failure_reason(error: BaseException) -> str:
    """One line: the exception and, where it wraps others (dynamo's "Observed exception",
    inductor's compile errors), the innermost one, which says what failed."""

    def first_line(exception):
        lines = str(exception).strip().splitlines()
        return f"{type(exception).__name__}: {lines[0] if lines else ''}"

    root, seen = error, {id(error)}
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
        if id(root) in seen:  # a chain that loops back
            break
        seen.add(id(root))
    if root is error:
        return first_line(error)
    return f"{first_line(error)} ({first_line(root)})"


def output_mismatch(flex_out: torch.Tensor, mha_out: torch.Tensor) -> str:
    """'' when flex_out is within TOLERANCE of mha_out, else what differs."""
    atol, rtol = TOLERANCE[mha_out.dtype]
    difference = (flex_out.float() - mha_out.float()).abs()
    allowed = atol + rtol * mha_out.float().abs()
    if flex_out.shape == mha_out.shape and bool((difference <= allowed).all()):
        return ""
    if flex_out.shape != mha_out.shape:
        return f"output shape {tuple(flex_out.shape)}, mha_ext's {tuple(mha_out.shape)}"
    return (
        f"output differs from mha_ext's: max |flex - mha_ext| {difference.max().item():.3g}, "
        f"tolerance {atol:g} + {rtol:g} |mha_ext|"
    )


def _with_flex(
    steps: Dict[str, Callable[[], None]],
    mha_out: torch.Tensor,
    attend: Callable,
    arguments: Tuple,
    rotate: Optional[Callable[[], Tuple]] = None,
) -> Tuple[Dict[str, str], Dict[str, float]]:
    """Compiles and checks FlexAttention's attend(*arguments) against mha_out; adds its step
    to steps (calling attend(*rotate()) when given: the decode cycles through layers) when it
    compiles and agrees. Returns (unsupported, checks): the reason flex is not timed, and the
    compile's seconds and the largest difference from mha_ext's output."""
    try:
        compiled, flex_out, compile_seconds = _compiled_first_call(attend, arguments)
    except Exception as error:  # whatever dynamo or inductor raise: the row says why
        return {"flex": failure_reason(error)}, {}
    checks = {"flex_compile_seconds": compile_seconds}
    if flex_out.shape == mha_out.shape:
        checks["flex_max_difference"] = (flex_out.float() - mha_out.float()).abs().max().item()
    mismatch = output_mismatch(flex_out, mha_out)
    if mismatch:
        return {"flex": mismatch}, checks
    steps["flex"] = (lambda: compiled(*rotate())) if rotate else (lambda: compiled(*arguments))
    return {}, checks


def _prefill_case(kind: str, seq: int, dtype: torch.dtype, device: torch.device) -> Case:
    """Causal attention over seq tokens: plain, within a window of WINDOW_LEFT keys, or with
    SOFTCAP. FlexAttention gets the mask as a block mask (blocks no query sees are skipped)
    built before the timing, and the softcap as a score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    name, batch, heads, kv_heads, head_dim = PREFILL_SHAPE
    generator = torch.Generator().manual_seed(0)
    # (B, H, S, D) each
    q, k, v = (
        torch.randn(batch, h, seq, head_dim, generator=generator).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    window = (WINDOW_LEFT, 0) if kind == "window" else None
    softcap = SOFTCAP if kind == "softcap" else 0.0

    def mha_ext_attend():
        return functional.attention(q, k, v, causal="bottom_right", window=window, softcap=softcap)

    def visible(b, h, q_idx, kv_idx):  # noqa: ARG001 (FlexAttention's mask_mod signature)
        if window is None:
            return q_idx >= kv_idx
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW_LEFT)

    def capped(score, b, h, q_idx, kv_idx):  # noqa: ARG001 (FlexAttention's score_mod)
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    block_mask = create_block_mask(visible, None, None, seq, seq, device=device)

    def flex_attend(q, k, v):
        return flex_attention(
            q,
            k,
            v,
            score_mod=capped if softcap else None,
            block_mask=block_mask,
            enable_gqa=heads != kv_heads,
        )

    steps = {"mha_ext": mha_ext_attend}
    unsupported, checks = _with_flex(steps, mha_ext_attend(), flex_attend, (q, k, v))
    left = WINDOW_LEFT if window else seq
    keys_seen = sum(min(i, left) + 1 for i in range(seq))
    return Case(
        "flex",
        f"{kind} {name} {dtype_name(dtype)} S={seq}",
        {
            "case": kind,
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "seq": seq,
            "dtype": dtype_name(dtype),
            "window": window,
            "softcap": softcap,
        },
        4.0 * batch * heads * keys_seen * head_dim,
        "GFLOP/s",
        f"matmul_{dtype_name(dtype)}",
        steps,
        baseline="flex",
        unsupported=unsupported,
        checks=checks,
    )


def _decode_case(context: int, batch: int, dtype: torch.dtype, device: torch.device) -> Case:
    """One decode step of one layer: batch queries, each over its sequence's context keys in
    a paged cache of PAGE_SIZE-token pages, mha_ext's paged_attention on a PagedKVCache
    against FlexAttention on torch's PagedAttention cache (its block mask converted to the
    page table before the timing). As the paged_decode suite's, the steps cycle through
    enough layers that each contender's caches are twice the CPU's largest cache: every step
    reads its keys and values from memory."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    name, heads, kv_heads, head_dim = DECODE_SHAPE
    generator = torch.Generator().manual_seed(0)
    pages = batch * -(-context // PAGE_SIZE)
    layer_bytes = 2 * batch * kv_heads * context * head_dim * dtype.itemsize
    layers = max(1, -(-2 * cpu_cache_bytes() // layer_bytes)) if device.type == "cpu" else 1
    cache = PagedKVCache(layers, pages, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
    prefill = cache.prepare([cache.allocate() for _ in range(batch)], [context] * batch)
    torch_pages = PagedAttention(pages, PAGE_SIZE, batch, device=str(device))
    sequences = torch.arange(batch, device=device)
    for sequence in sequences:
        torch_pages.reserve(sequence, torch.tensor(context, device=device))
    positions = torch.arange(context, device=device).expand(batch, context)  # (B, S)
    torch_caches = []  # per layer: K, V   (1, Hkv, pages * PAGE_SIZE, D)
    shape = (batch, kv_heads, context, head_dim)
    for k, v in fill_cache_layers(cache, prefill.slot_mapping, shape, dtype, generator):
        k_pages, v_pages = (
            torch.zeros(1, kv_heads, pages * PAGE_SIZE, head_dim, device=device, dtype=dtype)
            for _ in range(2)
        )
        torch_pages.assign(sequences, positions, k, v, k_pages, v_pages)
        torch_caches.append((k_pages, v_pages))
    q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device=device, dtype=dtype)
    q_packed = q[:, :, 0]  # (B, H, D)
    one_query_each = torch.arange(batch + 1, dtype=torch.int32, device=device)
    logical_mask = create_block_mask(
        noop_mask, batch, None, 1, context, device=device, BLOCK_SIZE=PAGE_SIZE
    )
    kv_lengths = torch.full((batch,), context, device=device)
    block_mask = torch_pages.convert_logical_block_mask(logical_mask, sequences, kv_lengths)

    def mha_ext_attend(layer):
        return functional.paged_attention(
            q_packed,
            cache.key_caches[layer],
            cache.value_caches[layer],
            prefill.block_tables,
            prefill.seq_lens,
            one_query_each,
        )

    def flex_attend(q, k_pages, v_pages):
        # (B, H, 1, D) -> (B, H, D), mha_ext's packed layout, for the output check
        return flex_attention(q, k_pages, v_pages, block_mask=block_mask, enable_gqa=True)[:, :, 0]

    mha_layer, flex_layer = itertools.cycle(range(layers)), itertools.cycle(range(layers))
    steps = {"mha_ext": lambda: mha_ext_attend(next(mha_layer))}
    unsupported, checks = _with_flex(
        steps,
        mha_ext_attend(0),
        flex_attend,
        (q, *torch_caches[0]),
        rotate=lambda: (q, *torch_caches[next(flex_layer)]),
    )
    return Case(
        "flex",
        f"decode {name} {dtype_name(dtype)} ctx={context} batch={batch}",
        {
            "case": "decode",
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "context": context,
            "dtype": dtype_name(dtype),
            "page_size": PAGE_SIZE,
            "layers": layers,
        },
        layer_bytes,
        "GB/s",
        "stream_read",
        steps,
        baseline="flex",
        unsupported=unsupported,
        checks=checks,
    )


def case_factories(
    seqs: List[int], contexts: List[int], dtypes, device: torch.device, decode_batch: int
) -> List[Callable[[], Case]]:
    """Per dtype: the prefill cases at each length, then decode at each context."""
    factories = []
    for dtype in dtypes:
        for seq in seqs:
            for kind in PREFILL_CASES:
                factories.append(lambda k=kind, s=seq, t=dtype: _prefill_case(k, s, t, device))
        for context in contexts:
            factories.append(lambda c=context, t=dtype: _decode_case(c, decode_batch, t, device))
    return factories

"""The benchmark suites: each builds cases (a shape, the work it does, and one step per
contender) and times them.

Suites: forward and forward_backward (attention on model shapes), gqa_prefill (causal
grouped-query prefill), paged_decode (one query per sequence over a paged cache, against
torch SDPA on a contiguous cache), cache_append (one token into the cache, against the
seed tutorial's torch.cat update) and call_overhead (the time of one small forward call,
where fixed costs weigh as much as the arithmetic). Contenders: mha_ext, torch SDPA (on
CUDA its flash, cuDNN and efficient backends separately) and the textbook "naive"
attention the seed tutorial writes out, where its O(S^2) memory allows. The context_parallel
suite (context_parallel.py) runs on spawned ranks instead of as Cases here.
"""

import contextlib
import itertools
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import functional
from ..kv_cache import PagedKVCache
from ..reference import attention_reference
from .roofline import Probe, cpu_cache_bytes, peak_key_of
from .timing import interleaved_seconds, ratio_range

# Attention shapes of the seed tutorial's model table: (query heads, kv heads, head dim).
MODELS = {
    "bert-base": (12, 12, 64),
    "gpt2-small": (12, 12, 64),
    "llama2-7b": (32, 32, 128),
    "llama2-70b": (64, 8, 128),
}
# The grouped-query prefill shape of the CPU performance targets: 32 query / 8 kv heads.
GQA_SHAPE = ("gqa-32q-8kv", 32, 8, 128)
DEFAULT_SUITES = (
    "forward",
    "forward_backward",
    "gqa_prefill",
    "paged_decode",
    "cache_append",
    "call_overhead",
    "variants",
    "varlen",
    "integrations",
    "context_parallel",
)
# Suites run only when named: each of the flex suite's cases compiles FlexAttention first
# (tens of seconds on 2 cores), past the default runs' budget.
OPT_IN_SUITES = ("flex",)
SUITES = DEFAULT_SUITES + OPT_IN_SUITES
# The variants suite: each score feature of attention alone, against plain attention of the
# same shape (the feature's cost). (label, attention keyword arguments given the heads)
VARIANTS = {
    "softcap": lambda heads: {"softcap": 30.0},
    "alibi": lambda heads: {"alibi_slopes": torch.rand(heads) / 4},
    "sinks": lambda heads: {"sinks": torch.randn(heads)},
    "window": lambda heads: {"window": (256, 0)},
    "all": lambda heads: {
        "softcap": 30.0,
        "alibi_slopes": torch.rand(heads) / 4,
        "sinks": torch.randn(heads),
        "window": (256, 0),
    },
}
VARIANTS_SHAPE = ("gqa-32q-8kv", 32, 8, 128)
# The varlen suite: documents with lengths drawn log-uniform in [64, 4096] packed into about
# this many tokens, trained (forward + backward, causal) as one packed call, against the same
# tokens as a uniform batch and torch SDPA on the documents padded to the longest.
VARLEN_TOKENS = 16384
VARLEN_SHAPE = ("4q-2kv-d128", 4, 2, 128)
# Small forward calls (batch 1), where fixed costs (Python, dispatch, autograd, allocation,
# threads) matter as much as arithmetic: a decode step of one head, a short prompt, and
# issue 5's small case (12 heads, 128 tokens, head dim 64). (heads, seq, head_dim)
CALL_OVERHEAD_SHAPES = [(1, 1, 64), (12, 16, 64), (12, 128, 64)]
CALLS_PER_STEP = 200  # such a call takes microseconds: time a run of them
# The naive attention materialises (B, H, S, S) scores and their gradients: skip it beyond.
NAIVE_MAX_SEQ = 1024
# Nor is it timed where its matmuls alone would take longer than this per call at the run's
# matmul rate: a CPU without bf16 instructions multiplies bf16 at about 2 GFLOP/s, where one
# llama2-70b forward + backward of it takes over a minute.
NAIVE_MAX_SECONDS = 2.0
DECODE_BATCH = 8
# Decode calls per timed sample, each on the next layer: at the targets' shapes (context 4096)
# a whole pass over the layers. One call per sample (about 10 ms) moved by more than a 20%
# kernel change on a 2-core VM (Xeon model 167: one case's samples 494-620 tokens/s, where
# passes over its 15 layers told two builds apart every time), and layers of one run can sit
# on differently backed pages.
DECODE_CALLS_PER_SAMPLE = 16
# The decode suite's cases with score features, 32 query / 8 kv heads x 128, at each of the
# suite's contexts: a Mistral-style sliding window of that many keys over a context this many
# times longer (4096 over 32k at the full run's 4096: the window's keys are all a step reads,
# the bytes of the plain case of that context), and Gemma 2's logit softcap of 50 with
# gpt-oss-style sinks.
WINDOW_CONTEXT_FACTOR = 8
SOFTCAP_DECODE = dict(softcap=50.0, sinks=True)
# The 8-bit caches of the decode suite (--kv-cache-dtype), each timed against mha_ext over a
# bf16 cache of the same keys and values, at the CPU performance targets' decode shape.
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANTIZED_DECODE_SHAPE = GQA_SHAPE
APPEND_TOKENS_PER_RUN = 64  # an append takes microseconds: time a run of them
# The contender of the append flatness case that appends at the shortest context.
APPEND_SHORT_CONTEXT = "mha_ext_short_context"
# The step names of a case's probes among its contenders' (run_case): the probe of its
# roofline_key, and the peak probe of its dtype.
ROOFLINE_PROBE = "roofline_probe"
PEAK_PROBE = "peak_probe"
# The integrations suite: the same attention reached through each interface mha_ext offers
# (FlashAttention's API, torch's SDPA provider hook, Hugging Face's attention function)
# against the direct mha_ext call: one small forward (12 heads x 64, 128 tokens; fixed costs
# show, timed CALLS_PER_STEP calls at a time) and, at each of the run's sequence lengths, a
# grouped-query prefill forward and forward + backward. (label, heads, kv_heads, head_dim)
INTEGRATION_SMALL = ("small", 12, 12, 64, 128)
INTEGRATION_PREFILL = ("gqa-32q-8kv", 32, 8, 128)
INTEGRATION_DECODE = dict(batch=8, heads=32, kv_heads=8, head_dim=128, context=1024)


@dataclass
class Case:
    suite: str
    label: str
    params: Dict
    work: float  # FLOPs or bytes of one step
    unit: str  # "GFLOP/s" or "GB/s"
    # The probe timed with the case (roofline.probes): "matmul_<dtype>", torch's matmul,
    # beside the dtype's peak for arithmetic; "stream_read", the roofline of bytes.
    roofline_key: str
    steps: Dict[str, Callable[[], None]]
    baseline: str = "torch_sdpa"
    interleave: bool = True
    per_call: Dict[str, int] = field(default_factory=dict)  # calls per step, for per-call times
    # Contender -> the work of its step where it differs from `work` (e.g. the bytes of a cache
    # in another dtype).
    work_by_contender: Dict[str, float] = field(default_factory=dict)
    # Contender -> context manager factory its step runs under (timed apart from the others,
    # as the state it sets, e.g. an active SDPA provider, is global).
    contexts: Dict[str, Callable[[], contextlib.AbstractContextManager]] = field(
        default_factory=dict
    )
    # Contender -> why it is not timed, known when the case is built (e.g. it failed to
    # compile, or its output differs from mha_ext's).
    unsupported: Dict[str, str] = field(default_factory=dict)
    # What the case measured or checked before the timing (e.g. a compile's seconds), kept
    # in its result.
    checks: Dict[str, float] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def attention_flops(batch, heads, seq_q, seq_k, head_dim, causal, backward) -> float:
    """4 B H Sq Sk D for the two forward matmuls, halved when causal; the backward adds
    2.5x the forward."""
    forward = 4.0 * batch * heads * seq_q * seq_k * head_dim / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def _torch_sdpa_contenders(device: torch.device) -> Dict[str, Optional[object]]:
    """name -> SDPBackend to force (None: let torch choose)."""
    if device.type != "cuda":
        return {"torch_sdpa": None}
    from torch.nn.attention import SDPBackend

    return {
        "torch_sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "torch_sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "torch_sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def _backend(backend):
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backend)


def attention_case(
    suite, name, heads, kv_heads, head_dim, seq, dtype, causal, backward, device
) -> Case:
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, h, seq, head_dim) for h in (heads, kv_heads, kv_heads)]
    q, k, v = (
        torch.randn(s, generator=generator).to(device=device, dtype=dtype).requires_grad_(backward)
        for s in shapes
    )
    grad_out = torch.randn(shapes[0], generator=generator).to(device=device, dtype=dtype)
    gqa = heads != kv_heads

    # Gradients as a layer's backward produces them: in a model q, k and v are activations,
    # so nothing adds them into .grad buffers (an elementwise pass over q, k and v per step
    # that is no part of either contender's attention).
    def step_of(attend):
        def step():
            out = attend()
            if backward:
                torch.autograd.grad(out, (q, k, v), grad_out)

        return step

    steps = {
        "mha_ext": step_of(
            lambda: functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=gqa
            )
        )
    }
    for contender, backend in _torch_sdpa_contenders(device).items():

        def torch_attend(backend=backend):
            with _backend(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        steps[contender] = step_of(torch_attend)
    if seq <= NAIVE_MAX_SEQ:
        steps["naive"] = step_of(
            lambda: attention_reference(q, k, v, causal="top_left" if causal else None)[0]
        )
    label = f"{name} {dtype_name(dtype)} S={seq}{' causal' if causal else ''}"
    params = {
        "model": name,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seq": seq,
        "dtype": dtype_name(dtype),
        "causal": causal,
        "backward": backward,
    }
    return Case(
        suite,
        label,
        params,
        attention_flops(1, heads, seq, seq, head_dim, causal, backward),
        "GFLOP/s",
        f"matmul_{dtype_name(dtype)}",
        steps,
        baseline=next(iter(_torch_sdpa_contenders(device))),
    )


def fill_cache_layers(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    shape: Tuple[int, int, int, int],
    dtype: torch.dtype,
    generator: torch.Generator,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Appends random K and V of shape (B, Hkv, S, D) and dtype to every layer of the cache at
    the prefill's slot_mapping (B * S slots, sequence by sequence); returns each layer's K, V."""
    device = cache.key_caches[0].device
    layers = []
    for layer in range(len(cache.key_caches)):
        k, v = (
            torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for _ in range(2)
        )
        # (B, Hkv, S, D) -> (B * S, Hkv, D), the token order of the slot mapping
        functional.paged_kv_append(
            k.transpose(1, 2).flatten(0, 1),
            v.transpose(1, 2).flatten(0, 1),
            cache.key_caches[layer],
            cache.value_caches[layer],
            slot_mapping,
        )
        layers.append((k, v))
    return layers


def _decode_case(
    name,
    heads,
    kv_heads,
    head_dim,
    context,
    dtype,
    device,
    batch=DECODE_BATCH,
    block_size=16,
    window=None,
    softcap=0.0,
    sinks=False,
) -> Case:
    """One decode step of one layer, timed DECODE_CALLS_PER_SAMPLE layers' steps to a sample. A
    model's step reads every layer's cache once, so on a CPU the steps cycle through enough
    layers that their caches are twice the size of the CPU's largest cache: each step reads its
    K/V from memory, as in a real model.

    window: the query sees its last window + 1 keys; torch's contenders attend to a contiguous
    cache of just those (a rolling window cache), and the work is their bytes. softcap and
    sinks (one logit per head): torch SDPA has neither, so the baseline is the same math in
    plain torch ops (torch_eager: scores, tanh, the sink as one more logit, softmax, P V)."""
    generator = torch.Generator().manual_seed(0)
    keys_read = context if window is None else min(context, window + 1)
    layer_bytes = 2 * batch * kv_heads * context * head_dim * dtype.itemsize
    work_bytes = 2 * batch * kv_heads * keys_read * head_dim * dtype.itemsize
    layers = (
        max(1, -(-2 * cpu_cache_bytes() // layer_bytes)) if device.type == "cpu" else 1
    )  # 1 if unknown
    cache = PagedKVCache(
        layers,
        batch * -(-context // block_size),
        block_size,
        kv_heads,
        head_dim,
        dtype=dtype,
        device=device,
    )
    seqs = [cache.allocate() for _ in range(batch)]
    prefill = cache.prepare(seqs, [context] * batch)
    contiguous = []  # per layer: K, V   (B, Hkv, S, D)
    shape = (batch, kv_heads, context, head_dim)
    for k, v in fill_cache_layers(cache, prefill.slot_mapping, shape, dtype, generator):
        # The keys the query sees, contiguous: (B, Hkv, keys_read, D)
        contiguous.append(tuple(t[:, :, context - keys_read :].contiguous() for t in (k, v)))
    q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device=device, dtype=dtype)
    one_query_each = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q_packed = q[:, :, 0]  # (B, H, D)
    gqa = heads != kv_heads
    features = {}  # paged_attention's feature arguments, only those the case sets
    if window is not None:
        features["window"] = (window, 0)
    if softcap:
        features["softcap"] = softcap
    if sinks:
        features["sinks"] = sink_logits = torch.randn(heads, generator=generator).to(device)

    # calls per sample by contender: the naive attention's one call already takes 20-50 times
    # as long as mha_ext's
    calls = {}

    def rotating(name, step, count=min(layers, DECODE_CALLS_PER_SAMPLE)):
        calls[name] = count
        return _layer_samples(step, layers, count)

    steps = {
        "mha_ext": rotating(
            "mha_ext",
            lambda layer: functional.paged_attention(
                q_packed,
                cache.key_caches[layer],
                cache.value_caches[layer],
                prefill.block_tables,
                prefill.seq_lens,
                one_query_each,
                **features,
            ),
        )
    }
    baseline = next(iter(_torch_sdpa_contenders(device)))
    if softcap or sinks:
        baseline = "torch_eager"

        def torch_eager(layer):
            k, v = contiguous[layer]
            group = heads // kv_heads
            # (B, Hkv, group, D) @ (B, Hkv, D, S) -> (B, Hkv, group, S)
            scores = (q.view(batch, kv_heads, group, head_dim) @ k.transpose(-2, -1)).float()
            scores = scores * head_dim**-0.5
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks:
                sink_column = sink_logits.view(1, kv_heads, group, 1).expand(batch, -1, -1, 1)
                scores = torch.cat([scores, sink_column], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :keys_read].to(dtype)
            return probs @ v

        steps[baseline] = rotating(baseline, torch_eager)
    else:
        for contender, backend in _torch_sdpa_contenders(device).items():

            def torch_decode(layer, backend=backend):
                with _backend(backend):
                    F.scaled_dot_product_attention(q, *contiguous[layer], enable_gqa=gqa)

            steps[contender] = rotating(contender, torch_decode)

        def naive(layer):
            return attention_reference(q, *contiguous[layer])

        steps["naive"] = rotating("naive", naive, count=1)
    label = f"{name} {dtype_name(dtype)} ctx={context} batch={batch}"
    if window is not None:
        label += f" window={window}"
    if softcap:
        label += f" softcap={softcap:g}"
    if sinks:
        label += " sinks"
    if baseline != next(iter(_torch_sdpa_contenders(device))):
        label += f" (vs {baseline})"
    params = {
        "model": name,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "context": context,
        "batch": batch,
        "dtype": dtype_name(dtype),
        "block_size": block_size,
        "layers": layers,
        "calls_per_sample": calls["mha_ext"],
        "window": window,
        "softcap": softcap,
        "sinks": sinks,
    }
    return Case(
        "paged_decode",
        label,
        params,
        work_bytes,
        "GB/s",
        "stream_read",
        steps,
        baseline=baseline,
        per_call=calls,
    )


def cache_bytes_read(cache_dtype: torch.dtype, batch, kv_heads, keys, head_dim) -> int:
    """Bytes of K and V one decode step reads from a cache of cache_dtype: the 8-bit values
    plus, for int8, one fp32 scale per (token, kv head) of each."""
    scale_bytes = 4 if cache_dtype == torch.int8 else 0
    return 2 * batch * kv_heads * keys * (head_dim * cache_dtype.itemsize + scale_bytes)


def _quantized_decode_case(
    cache_name, name, heads, kv_heads, head_dim, context, dtype, device, batch, block_size=16
) -> Case:
    """One decode step of one layer over an 8-bit cache (KV_CACHE_DTYPES[cache_name], fp8 at
    unit scale), against the same step over a bf16 cache of the same keys and values, the two
    interleaved so their ratio comes from one run. q is in dtype; the bf16 cache's contender
    gets it in bf16. As in _decode_case, the steps cycle through enough layers that the 8-bit
    caches are twice the CPU's largest cache (the bf16 ones four times), every step reading
    from memory, and a sample times DECODE_CALLS_PER_SAMPLE of them. Work: the bytes each
    contender's cache holds for the step (scales included)."""
    generator = torch.Generator().manual_seed(0)
    cache_dtype = KV_CACHE_DTYPES[cache_name]
    work_bytes = cache_bytes_read(cache_dtype, batch, kv_heads, context, head_dim)
    bf16_bytes = cache_bytes_read(torch.bfloat16, batch, kv_heads, context, head_dim)
    layers = max(1, -(-2 * cpu_cache_bytes() // work_bytes)) if device.type == "cpu" else 1
    caches = {
        contender: PagedKVCache(
            layers,
            batch * -(-context // block_size),
            block_size,
            kv_heads,
            head_dim,
            dtype=contender_dtype,
            device=device,
        )
        for contender, contender_dtype in (("mha_ext", cache_dtype), ("bf16_cache", torch.bfloat16))
    }
    for cache in caches.values():  # both hand out the same blocks: one batch serves both
        seqs = [cache.allocate() for _ in range(batch)]
        prefill = cache.prepare(seqs, [context] * batch)
    q = torch.randn(batch, heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    queries = {"mha_ext": q, "bf16_cache": q.to(torch.bfloat16)}
    for layer in range(layers):
        # (B * S, Hkv, D): the token order of the slot mapping
        k, v = (
            torch.randn(batch * context, kv_heads, head_dim, generator=generator).to(device)
            for _ in range(2)
        )
        for contender, cache in caches.items():
            rows_dtype = queries[contender].dtype  # a bf16 cache takes bf16 rows
            functional.paged_kv_append(
                k.to(rows_dtype),
                v.to(rows_dtype),
                cache.key_caches[layer],
                cache.value_caches[layer],
                prefill.slot_mapping,
                **cache.scale_arguments(layer),
            )
    one_query_each = torch.arange(batch + 1, dtype=torch.int32, device=device)
    calls = min(layers, DECODE_CALLS_PER_SAMPLE)

    def decode(contender):
        cache = caches[contender]

        def step(layer):
            functional.paged_attention(
                queries[contender],
                cache.key_caches[layer],
                cache.value_caches[layer],
                prefill.block_tables,
                prefill.seq_lens,
                one_query_each,
                **cache.scale_arguments(layer),
            )

        return _layer_samples(step, layers, calls)

    params = {
        "model": name,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "context": context,
        "batch": batch,
        "dtype": dtype_name(dtype),
        "kv_cache_dtype": cache_name,
        "block_size": block_size,
        "layers": layers,
        "calls_per_sample": calls,
    }
    return Case(
        "paged_decode",
        f"{name} {dtype_name(dtype)} ctx={context} batch={batch} {cache_name} cache",
        params,
        work_bytes,
        "GB/s",
        "stream_read",
        {contender: decode(contender) for contender in caches},
        baseline="bf16_cache",
        work_by_contender={"bf16_cache": bf16_bytes},
        per_call=dict.fromkeys(caches, calls),
    )


def _paged_append_step(context, device, batch, kv_heads, head_dim, block_size):
    """A step that appends APPEND_TOKENS_PER_RUN tokens of a Llama-2 7B layer (fp32) to each of
    `batch` sequences, a call per token, into a cache already holding `context` tokens of each
    (the same slots every step); and the new key and value of each call."""
    tokens = context + APPEND_TOKENS_PER_RUN
    cache = PagedKVCache(
        1, batch * -(-tokens // block_size), block_size, kv_heads, head_dim, device=device
    )
    seqs = [cache.allocate() for _ in range(batch)]
    cache.prepare(seqs, [tokens] * batch)
    # slots[i]: the slot of token context + i of every sequence   [APPEND_TOKENS_PER_RUN, batch]
    slots = torch.stack(
        [
            functional.slot_mapping_for(
                torch.tensor(cache.block_table(seq), device=device),
                torch.arange(context, tokens, device=device),
                block_size,
            )
            for seq in seqs
        ],
        dim=1,
    )
    key, value = (torch.randn(batch, kv_heads, head_dim, device=device) for _ in range(2))

    def paged():  # tokens context, context + 1, ... each written in place by its own call
        for step_slots in slots:
            functional.paged_kv_append(
                key, value, cache.key_caches[0], cache.value_caches[0], step_slots
            )

    return paged, key, value


def _append_case(context, device, batch=1, kv_heads=32, head_dim=128, block_size=16) -> Case:
    """One token of a Llama-2 7B layer (fp32) for each of `batch` sequences, into a cache
    already holding `context` tokens of each."""
    paged, key, value = _paged_append_step(context, device, batch, kv_heads, head_dim, block_size)
    contiguous = [
        tuple(torch.randn(batch, kv_heads, context, head_dim, device=device) for _ in range(2))
    ]
    new_k, new_v = key.view(batch, kv_heads, 1, head_dim), value.view(batch, kv_heads, 1, head_dim)

    def seed_torch_cat():  # the seed tutorial's update_kv_cache: concatenation copies the cache
        k_cache, v_cache = contiguous[0]
        torch.cat([k_cache, new_k], dim=2), torch.cat([v_cache, new_v], dim=2)

    token_bytes = 2 * key.numel() * key.element_size()
    params = {
        "context": context,
        "batch": batch,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": "float32",
    }
    label = f"llama2-7b layer ctx={context}" + (f" batch={batch}" if batch > 1 else "")
    # Timed apart, not interleaved: each torch.cat maps a context-sized buffer, which would
    # leave the next paged append with cold caches and TLB.
    return Case(
        "cache_append",
        label,
        params,
        token_bytes,
        "GB/s",
        "stream_read",
        {"mha_ext": paged, "seed_torch_cat": seed_torch_cat},
        baseline="seed_torch_cat",
        interleave=False,
        per_call={"mha_ext": APPEND_TOKENS_PER_RUN, "seed_torch_cat": 1},
    )


def _append_flatness_case(
    short, long, device, batch=1, kv_heads=32, head_dim=128, block_size=16
) -> Case:
    """mha_ext's append per token into a cache holding `long` tokens of each sequence against
    one holding `short` (the baseline), the two caches alive together and their steps
    interleaved: the ratio of the two contexts (the append's flatness) from one run, where the
    per-context cases, timed one after another, read whatever the machine's load did between
    them (32k / 512 read 0.64 and 1.63 in two runs on one idle Xeon). Each step is timed after
    the streaming read (run_case), as a decode step's append follows the other layers' work:
    interleaved with the read in a fixed order, the context timed right after it read 1.2-1.4x
    the other's time per token whichever it was (Xeon model 167, 32768 against 512: 1.21-1.37
    first, 0.69-0.76 second), and 0.94-1.02 with the read before each."""
    long_step, key, _ = _paged_append_step(long, device, batch, kv_heads, head_dim, block_size)
    short_step, _, _ = _paged_append_step(short, device, batch, kv_heads, head_dim, block_size)
    params = {
        "context": long,
        "short_context": short,
        "batch": batch,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": "float32",
    }
    return Case(
        "cache_append",
        f"llama2-7b layer ctx={long} against ctx={short}"
        + (f" batch={batch}" if batch > 1 else ""),
        params,
        2 * key.numel() * key.element_size(),
        "GB/s",
        "stream_read",
        {"mha_ext": long_step, APPEND_SHORT_CONTEXT: short_step},
        baseline=APPEND_SHORT_CONTEXT,
        per_call=dict.fromkeys(("mha_ext", APPEND_SHORT_CONTEXT), APPEND_TOKENS_PER_RUN),
    )


def _call_overhead_case(heads, seq, head_dim, dtype, device) -> Case:
    """The attention forward case of one small shape, each step CALLS_PER_STEP calls back to
    back, reported per call."""
    single = attention_case(
        "call_overhead",
        "small",
        heads,
        heads,
        head_dim,
        seq,
        dtype,
        causal=False,
        backward=False,
        device=device,
    )

    steps = {name: _repeated(step, CALLS_PER_STEP) for name, step in single.steps.items()}
    # Timed apart, not interleaved: timed between the other contenders and the roofline
    # probe's matmul, a (1, 1, 1, 64) fp32 call read 5.2-5.6 us for mha_ext and 6.1-6.9 for
    # torch, against 3.3-3.5 and 4.9-5.1 timed alone as in a plain loop of calls (2 Xeon cores).
    return replace(
        single,
        label=f"{(1, heads, seq, head_dim)} {dtype_name(dtype)}",
        steps=steps,
        interleave=False,
        per_call=dict.fromkeys(steps, CALLS_PER_STEP),
    )


def _variant_case(variant, seq, dtype, backward, device) -> Case:
    """One feature's attention against plain attention of the same shape (baseline)."""
    name, heads, kv_heads, head_dim = VARIANTS_SHAPE
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    options = {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in VARIANTS[variant](heads).items()
    }
    q, k, v = (
        torch.randn(1, h, seq, head_dim, generator=generator)
        .to(device=device, dtype=dtype)
        .requires_grad_(backward)
        for h in (heads, kv_heads, kv_heads)
    )
    grad_out = torch.randn_like(q)

    def step_of(**kwargs):
        def step():
            out = functional.attention(q, k, v, causal="bottom_right", **kwargs)
            if backward:
                torch.autograd.grad(out, (q, k, v), grad_out)

        return step

    # Keys each query sees, causal and within the window where there is one: both contenders
    # do only that work.
    left = options.get("window", (seq, 0))[0]
    keys_seen = sum(min(i, left) + 1 for i in range(seq))
    work = 4.0 * heads * keys_seen * head_dim * (3.5 if backward else 1.0)
    return Case(
        "variants",
        f"{variant} {dtype_name(dtype)} S={seq}{' fwd+bwd' if backward else ''}",
        {"variant": variant, "seq": seq, "dtype": dtype_name(dtype), "backward": backward},
        work,
        "GFLOP/s",
        f"matmul_{dtype_name(dtype)}",
        {"mha_ext": step_of(**options), "mha_ext_plain": step_of(window=options.get("window"))},
        baseline="mha_ext_plain",
    )


def varlen_document_lengths(total_tokens: int, seed: int = 0) -> List[int]:
    """Lengths drawn log-uniform in [64, 4096] until they hold total_tokens (the last one
    trimmed so that they hold exactly that many)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: List[int] = []
    while sum(lengths) < total_tokens:
        draw = torch.empty(1).uniform_(6.0, 12.0, generator=generator)  # log2 of 64 .. 4096
        lengths.append(int(2.0 ** draw.item()))
    lengths[-1] -= sum(lengths) - total_tokens
    return [n for n in lengths if n > 0]


def _varlen_cases(dtype, device, total_tokens=VARLEN_TOKENS) -> List[Case]:
    """Packed documents (mha_ext's varlen against torch SDPA on the documents padded to the
    longest) and a uniform batch of the same tokens (mha_ext and torch SDPA), all causal,
    forward + backward. work counts only the documents' own (unpadded) causal FLOPs."""
    name, heads, kv_heads, head_dim = VARLEN_SHAPE
    lengths = varlen_document_lengths(total_tokens)
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return (
            torch.randn(*shape, generator=generator)
            .to(device=device, dtype=dtype)
            .requires_grad_(True)
        )

    q, k, v = (tensor(total_tokens, h, head_dim) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn_like(q)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    cu_seqlens = offsets.to(device=device, dtype=torch.int32)
    longest = max(lengths)

    def packed_step():
        out = functional.attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal="bottom_right"
        )
        torch.autograd.grad(out, (q, k, v), grad_out)

    # Padded to the longest document: (documents, heads, longest, head_dim). Causal attention
    # keeps every real query off the padded keys, so no mask is needed.
    def padded(x):
        rows = torch.zeros(len(lengths), longest, *x.shape[1:], device=device, dtype=dtype)
        for b, n in enumerate(lengths):
            rows[b, :n] = x[offsets[b] : offsets[b + 1]]
        return rows.transpose(1, 2).detach().requires_grad_(True)

    q_pad, k_pad, v_pad = padded(q), padded(k), padded(v)
    grad_pad = padded(grad_out).detach()

    def padded_step():
        out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q_pad, k_pad, v_pad), grad_pad)

    packed_work = sum(attention_flops(1, heads, n, n, head_dim, True, True) for n in lengths)
    uniform_seq = min(2048, total_tokens)
    uniform_batch = total_tokens // uniform_seq
    q_uni, k_uni, v_uni = (
        x.detach().reshape(uniform_batch, uniform_seq, -1, head_dim).transpose(1, 2)
        for x in (q, k, v)
    )
    for x in (q_uni, k_uni, v_uni):
        x.requires_grad_(True)
    grad_uni = grad_out.reshape(uniform_batch, uniform_seq, heads, head_dim).transpose(1, 2)

    def uniform_step(attend):
        def step():
            out = attend(q_uni, k_uni, v_uni, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q_uni, k_uni, v_uni), grad_uni)

        return step

    params = {"tokens": total_tokens, "documents": len(lengths), "dtype": dtype_name(dtype)}
    return [
        Case(
            "varlen",
            f"{len(lengths)} docs (64-4096, longest {longest}) {dtype_name(dtype)}",
            {**params, "layout": "packed", "lengths": lengths},
            packed_work,
            "GFLOP/s",
            f"matmul_{dtype_name(dtype)}",
            {"mha_ext": packed_step, "torch_sdpa": padded_step},
        ),
        Case(
            "varlen",
            f"uniform {uniform_batch} x {uniform_seq} {dtype_name(dtype)}",
            {**params, "layout": "uniform"},
            attention_flops(uniform_batch, heads, uniform_seq, uniform_seq, head_dim, True, True),
            "GFLOP/s",
            f"matmul_{dtype_name(dtype)}",
            {
                "mha_ext": uniform_step(functional.scaled_dot_product_attention),
                "torch_sdpa": uniform_step(F.scaled_dot_product_attention),
            },
        ),
    ]


def _sdpa_provider_active():
    """torch's flash-attention impl switched to mha_ext's for the duration."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    @contextlib.contextmanager
    def active():
        activate_flash_attention_impl("mha_ext")
        try:
            yield
        finally:
            restore_flash_attention_impl()

    return active()


def _integration_specs(seqs):
    """(integration, shape, backward) of each integrations case; shape None: the decode case."""
    shapes = [INTEGRATION_SMALL] + [INTEGRATION_PREFILL + (seq,) for seq in seqs]
    specs = []
    for integration in ("flash_attn_func", "torch_sdpa_provider", "transformers"):
        specs.append((integration, shapes[0], False))
        specs += [
            (integration, shape, backward) for shape in shapes[1:] for backward in (False, True)
        ]
    return specs + [("flash_attn_with_kvcache", None, False)]


def _attention_integration_case(
    integration, name, heads, kv_heads, head_dim, seq, dtype, backward, device
) -> Case:
    generator = torch.Generator().manual_seed(0)
    # (B, S, H, D) storage, FlashAttention's and Hugging Face's layout; mha_ext reads the
    # (B, H, S, D) views of it.
    q_bshd, k_bshd, v_bshd = (
        torch.randn(1, seq, h, head_dim, generator=generator)
        .to(device=device, dtype=dtype)
        .requires_grad_(backward)
        for h in (heads, kv_heads, kv_heads)
    )
    q, k, v = (t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd))
    leaves = (q_bshd, k_bshd, v_bshd)

    def step_of(attend):
        def step():
            out = attend()
            if backward:
                torch.autograd.grad(out, leaves, torch.ones_like(out))

        return step

    gqa = heads != kv_heads
    direct = lambda: functional.attention(q, k, v, causal="bottom_right")  # noqa: E731
    contexts = {}
    steps = {}
    if integration == "flash_attn_func":
        from ..flash_attn_interface import flash_attn_func

        steps["integration"] = step_of(lambda: flash_attn_func(q_bshd, k_bshd, v_bshd, causal=True))
    elif integration == "torch_sdpa_provider":
        direct = lambda: functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, enable_gqa=gqa
        )
        steps["integration"] = step_of(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        )
        contexts["integration"] = _sdpa_provider_active
        steps["torch_sdpa"] = step_of(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        )
    elif integration == "transformers":
        layer = torch.nn.Module()  # what the attention function reads of a model's layer
        layer.is_causal = True
        attention_function = _transformers_attention_function()
        hf_attend = lambda: attention_function(  # noqa: E731
            layer, q, k, v, None, scaling=head_dim**-0.5
        )[0]
        steps["integration"] = step_of(hf_attend)
    else:
        raise ValueError(f"mha_ext.bench: unknown integration {integration!r}")
    steps["mha_ext"] = step_of(direct)
    label = f"{integration} {name} {dtype_name(dtype)} S={seq}{' fwd+bwd' if backward else ''}"
    calls = CALLS_PER_STEP if name == INTEGRATION_SMALL[0] else 1
    if calls > 1:
        steps = {contender: _repeated(step, calls) for contender, step in steps.items()}
    return Case(
        "integrations",
        label,
        {
            "integration": integration,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "seq": seq,
            "dtype": dtype_name(dtype),
            "backward": backward,
        },
        attention_flops(1, heads, seq, seq, head_dim, True, backward),
        "GFLOP/s",
        f"matmul_{dtype_name(dtype)}",
        steps,
        baseline="integration",
        interleave=not contexts,
        per_call=dict.fromkeys(steps, calls),
        contexts=contexts,
    )


def _kvcache_integration_case(dtype, device) -> Case:
    """One decode step through flash_attn_with_kvcache (append the new token, attend) against
    paged_kv_append + paged_attention on the same paged cache."""
    from ..flash_attn_interface import flash_attn_with_kvcache

    batch, heads, kv_heads, head_dim, context = INTEGRATION_DECODE.values()
    block_size = 16
    blocks_per_seq = -(-(context + 1) // block_size)
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    # (num_blocks, block_size, Hkv, D): FlashAttention's paged layout; mha_ext's kernels
    # read its (num_blocks, Hkv, block_size, D) view.
    k_cache, v_cache = (randn(batch * blocks_per_seq, block_size, kv_heads, head_dim) for _ in "kv")
    order = torch.randperm(batch * blocks_per_seq, generator=generator)
    block_table = order.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    cache_seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = randn(batch, 1, heads, head_dim)
    k_new, v_new = (randn(batch, 1, kv_heads, head_dim) for _ in "kv")
    new_positions = cache_seqlens.to(torch.int64)
    slot_mapping = (
        block_table.gather(1, (new_positions // block_size)[:, None])[:, 0].to(torch.int64)
        * block_size
        + new_positions % block_size
    )
    seq_lens = cache_seqlens + 1
    one_query_each = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def direct():
        functional.paged_kv_append(
            k_new[:, 0], v_new[:, 0], k_cache.transpose(1, 2), v_cache.transpose(1, 2), slot_mapping
        )
        functional.paged_attention(
            q[:, 0],
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            block_table,
            seq_lens,
            one_query_each,
        )

    def integration():
        flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k_new,
            v_new,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=True,
        )

    steps = {"integration": integration, "mha_ext": direct}
    return Case(
        "integrations",
        f"flash_attn_with_kvcache decode {dtype_name(dtype)} ctx={context} batch={batch}",
        {
            "integration": "flash_attn_with_kvcache",
            **INTEGRATION_DECODE,
            "dtype": dtype_name(dtype),
        },
        2.0 * batch * kv_heads * (context + 1) * head_dim * dtype.itemsize,
        "GB/s",
        "stream_read",
        steps,
        baseline="integration",
    )


def _transformers_attention_function():
    """mha_ext's Hugging Face attention function; without transformers, one that raises the
    ImportError, which run_case reports as the contender being unsupported."""
    try:
        from ..integrations.transformers import mha_ext_attention_forward
    except ImportError as error:
        missing = error

        def mha_ext_attention_forward(*args, **kwargs):
            raise missing

    return mha_ext_attention_forward


def _repeated(step, calls):
    def run():
        for _ in range(calls):
            step()

    return run


def _layer_samples(step, layers, calls):
    """A timed sample of a decode case: step(layer) on each of the next `calls` layers, cycling
    through `layers`."""
    next_layer = itertools.cycle(range(layers))
    return _repeated(lambda: step(next(next_layer)), calls)


def build_cases(
    suites,
    models,
    seqs,
    contexts,
    append_contexts,
    dtypes,
    device,
    decode_batch=DECODE_BATCH,
    append_batch=1,
    varlen_tokens=VARLEN_TOKENS,
    kv_cache_dtypes=tuple(KV_CACHE_DTYPES),
    kv_cache_only=False,
    flex_seqs=(2048,),
    flex_contexts=(4096,),
) -> List[Callable[[], Case]]:
    """Case factories (cases allocate their tensors only when they run). kv_cache_only: the
    decode suite times its 8-bit cache cases alone. flex_seqs, flex_contexts: the flex
    suite's prefill lengths and decode contexts."""
    factories = []
    for suite in suites:
        if suite in ("forward", "forward_backward"):
            for model in models:
                heads, kv_heads, head_dim = MODELS[model]
                for dtype in dtypes:
                    for seq in seqs:
                        for causal in (False, True):
                            shape = (model, heads, kv_heads, head_dim, seq, dtype, causal)
                            factories.append(
                                lambda su=suite, shape=shape: attention_case(
                                    su, *shape, su == "forward_backward", device
                                )
                            )
        elif suite == "gqa_prefill":
            for dtype in dtypes:
                for seq in seqs:
                    factories.append(
                        lambda t=dtype, s=seq: attention_case(
                            "gqa_prefill", *GQA_SHAPE, s, t, True, False, device
                        )
                    )
        elif suite == "paged_decode":
            plain_shapes = [("llama2-7b", 32, 32), (GQA_SHAPE[0], 32, 8), ("llama2-70b", 64, 8)]
            for name, heads, kv_heads in [] if kv_cache_only else plain_shapes:
                for dtype in dtypes:
                    for context in contexts:
                        factories.append(
                            lambda n=name, h=heads, kv=kv_heads, t=dtype, c=context: _decode_case(
                                n, h, kv, 128, c, t, device, decode_batch
                            )
                        )
            for dtype in dtypes:
                for context in contexts:
                    window_case = dict(context=WINDOW_CONTEXT_FACTOR * context, window=context)
                    feature_cases = (window_case, dict(context=context, **SOFTCAP_DECODE))
                    for features in () if kv_cache_only else feature_cases:
                        factories.append(
                            lambda t=dtype, f=features: _decode_case(
                                *GQA_SHAPE, dtype=t, device=device, batch=decode_batch, **f
                            )
                        )
                    for cache_name in kv_cache_dtypes:
                        factories.append(
                            lambda n=cache_name, t=dtype, c=context: _quantized_decode_case(
                                n, *QUANTIZED_DECODE_SHAPE, c, t, device, decode_batch
                            )
                        )
        elif suite == "cache_append":
            for context in append_contexts:
                factories.append(lambda c=context: _append_case(c, device, append_batch))
            if len(set(append_contexts)) > 1:
                short, long = min(append_contexts), max(append_contexts)
                factories.append(
                    lambda lo=short, hi=long: _append_flatness_case(lo, hi, device, append_batch)
                )
        elif suite == "call_overhead":
            for dtype in dtypes:
                for heads, seq, head_dim in CALL_OVERHEAD_SHAPES:
                    factories.append(
                        lambda h=heads, s=seq, d=head_dim, t=dtype: _call_overhead_case(
                            h, s, d, t, device
                        )
                    )
        elif suite == "variants":
            for dtype in dtypes:
                for seq in seqs:
                    for backward in (False, True):
                        for variant in VARIANTS:
                            factories.append(
                                lambda v=variant, s=seq, t=dtype, b=backward: _variant_case(
                                    v, s, t, b, device
                                )
                            )
        elif suite == "varlen":
            for dtype in dtypes:
                for index in range(2):
                    factories.append(
                        lambda t=dtype, i=index: _varlen_cases(t, device, varlen_tokens)[i]
                    )
        elif suite == "integrations":
            for dtype in dtypes:
                for integration, shape, backward in _integration_specs(seqs):
                    if shape is None:
                        factories.append(lambda t=dtype: _kvcache_integration_case(t, device))
                    else:
                        factories.append(
                            lambda i=integration, s=shape, t=dtype, b=backward: (
                                _attention_integration_case(i, *s, t, b, device)
                            )
                        )
        elif suite == "flex":
            from . import flex  # flex builds on this module's Case

            factories += flex.case_factories(flex_seqs, flex_contexts, dtypes, device, decode_batch)
        elif suite == "context_parallel":
            continue  # runs on spawned ranks: context_parallel.run_suite, not a Case
        else:
            raise ValueError(f"mha_ext.bench: unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return factories


def run_case(
    case: Case,
    roofline: Dict[str, float],
    device: torch.device,
    repeats: int,
    probes: Optional[Dict[str, Probe]] = None,
) -> Dict:
    """Times a case; returns its JSON-ready result. A contender with no kernel for this
    device (mha_ext's CUDA attention before the CUDA issue lands), or the naive attention
    where it would take too long (NAIVE_MAX_SECONDS), is reported, not timed.
    With probes, the case's probe (torch's matmul or the streaming read) is timed with the
    contenders (interleaved where they are, each step after an untimed run of the probe) and
    roofline_fraction is of its rate there, recorded as roofline_rate; without, of
    roofline's (the run's headline ceilings). A case of arithmetic also gets peak_fraction,
    of the dtype's peak where there is one: the higher of roofline's "peak_<dtype>" and the
    rate of probes' "peak_<dtype>" timed with the case, recorded as peak_rate. Not clamped:
    a kernel that beat both readings would show it. Each contender's speedup_vs_baseline is
    the ratio of the medians; where the contenders run interleaved, speedup_range is the
    lowest and highest ratio of one repeat's pair."""
    unsupported = dict(case.unsupported)
    if "naive" in case.steps and case.unit == "GFLOP/s":
        naive_seconds = case.work / (roofline[case.roofline_key] * 1e9)
        if naive_seconds > NAIVE_MAX_SECONDS:
            unsupported["naive"] = (
                f"not timed: its matmuls alone take {naive_seconds:.0f} s per call at this run's "
                f"{case.roofline_key} rate"
            )
            del case.steps["naive"]
    for name, step in list(case.steps.items()):
        try:
            with case.contexts.get(name, contextlib.nullcontext)():
                step()
        except (NotImplementedError, RuntimeError, ImportError) as error:
            unsupported[name] = str(error).splitlines()[0]
            del case.steps[name]
    probe = (probes or {}).get(case.roofline_key)
    peak_key = peak_key_of(case.roofline_key)
    peak_probe = (probes or {}).get(peak_key) if peak_key else None
    steps = dict(case.steps)
    if probe:
        steps[ROOFLINE_PROBE] = probe.step
    if peak_probe:
        steps[PEAK_PROBE] = peak_probe.step
    samples = {}
    if case.interleave:
        # Every step (the probes' too) right after an untimed run of the case's probe, so that
        # each starts from the caches, TLB and idle threads the probe leaves, as a layer's
        # attention follows its projections' matmuls. Interleaved with the probes in a fixed
        # order, the step right after them started colder than the others in every round: the
        # append flatness case's first context read 1.2-1.4x the other's time per token
        # whichever it was, and FlexAttention's window case read mha_ext at 1.49-1.51x flex
        # timed first, 1.68-1.72x timed second (Xeon model 167; 1.47-1.58x and 1.56-1.66x with
        # the probe before each step).
        samples = interleaved_seconds(
            steps,
            warmup=1,
            repeats=repeats,
            device=device,
            before_each=probe.step if probe else None,
        )
        seconds = {name: statistics.median(times) for name, times in samples.items()}
    else:
        seconds = {}
        for name, step in steps.items():
            with case.contexts.get(name, contextlib.nullcontext)():
                alone = interleaved_seconds({name: step}, warmup=2, repeats=repeats, device=device)
                seconds[name] = statistics.median(alone[name])
    ceiling = (
        probe.work / seconds.pop(ROOFLINE_PROBE) / 1e9 if probe else roofline[case.roofline_key]
    )
    peak = roofline.get(peak_key) if peak_key else None
    if peak_probe:
        peak = max(peak or 0.0, peak_probe.work / seconds.pop(PEAK_PROBE) / 1e9)
    results = {}
    for name, step_seconds in seconds.items():
        calls = case.per_call.get(name, 1)
        throughput = case.work_by_contender.get(name, case.work) * calls / step_seconds / 1e9
        results[name] = {
            "seconds_per_call": step_seconds / calls,
            "throughput": throughput,
            "roofline_fraction": throughput / ceiling,
        }
        if peak:
            results[name]["peak_fraction"] = throughput / peak
    if case.baseline in results:
        baseline = results[case.baseline]["seconds_per_call"]
        for name, entry in results.items():
            entry["speedup_vs_baseline"] = baseline / entry["seconds_per_call"]
            if samples:  # interleaved: the ratio of each repeat's pair too
                calls = case.per_call.get(name, 1) / case.per_call.get(case.baseline, 1)
                low, high = ratio_range(samples[case.baseline], samples[name])
                entry["speedup_range"] = [low * calls, high * calls]
    return {
        "suite": case.suite,
        "label": case.label,
        "params": case.params,
        "unit": case.unit,
        "roofline": case.roofline_key,
        "roofline_rate": ceiling,
        "peak": peak_key if peak else None,
        "peak_rate": peak,
        "baseline": case.baseline,
        "results": results,
        "unsupported": unsupported,
        "checks": case.checks,
    }

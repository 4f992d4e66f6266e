"""The error an 8-bit paged KV cache adds to decode attention, by format.

For one query per head over a cached context, the relative RMS error of the attention output
against float64 attention over the unquantized K/V, two ways on the same data:

- simulation: the format's rounding done in float64 (bf16; int8 with one absmax / 127 scale
  per (token, kv head), rounded half to even; fp8 e4m3fn with one scale per tensor, both unit
  (1.0, the vLLM / FlashInfer default) and calibrated (absmax / 448)), then float64 attention;
- kernel: mha_ext.paged_kv_append into a PagedKVCache of that dtype, then
  mha_ext.paged_attention (dequantizing inside the kernel).

On random-normal K/V and on K/V whose keys have a few channels 20x larger, as real models'
keys have. "smoothed" rows divide each key channel by a fixed factor measured once on
calibration keys (the channel's RMS) before caching and multiply the query by it: the scores
are unchanged in exact arithmetic, so no kernel changes, and the outlier channels no longer
set every row's int8 scale.

    python benchmarks/kv_cache_accuracy.py [--context 4096] [--json results.json]
"""

import argparse
import json
import platform
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

import mha_ext
from mha_ext.kv_cache import PagedKVCache

E4M3_MAX = 448.0  # the largest finite torch.float8_e4m3fn
INT8_MAX = 127
QUERY_SCALE = 2.0  # queries a little larger than unit normal sharpen the softmax
OUTLIER_CHANNELS = 4
OUTLIER_FACTOR = 20.0
CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 10_000  # the draws use seeds 0, 1, ...; the calibration keys another
# The cache dtype of each format; fp8's unit and calibrated scales share one, int8's two
# query dtypes theirs.
CACHE_DTYPES = {
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int8-bf16-q": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8-calibrated": torch.float8_e4m3fn,
    "fp8-bf16-q": torch.float8_e4m3fn,
}
FORMATS = tuple(CACHE_DTYPES)
# The dtype of the q, K and V rows each format's kernel takes (and of its output): a bf16
# cache's own; an 8-bit cache's fp32, or bf16 as a bf16 model gives them, where the AVX-512
# kernels score and weight in 16-bit integers (int8, PagedKernelTraits::kInt16Dots) or in
# bf16 pairs with the softmax weights in bf16 (fp8, where the CPU has AVX512-BF16).
ROWS_DTYPES = {"bf16": torch.bfloat16, "int8-bf16-q": torch.bfloat16, "fp8-bf16-q": torch.bfloat16}


@dataclass
class Data:
    q: Tensor  # (heads, head_dim) fp32, one decode query per head
    k: Tensor  # (context, kv_heads, head_dim) fp32, in append's token order
    v: Tensor  # (context, kv_heads, head_dim) fp32


def make_data(
    heads: int,
    kv_heads: int,
    context: int,
    head_dim: int,
    outliers: bool,
    seed: int = 0,
    device=None,
) -> Data:
    """Normal queries (x QUERY_SCALE), keys and values on device (drawn on the CPU, so a seed
    gives the same data everywhere); with outliers, OUTLIER_CHANNELS key channels of every kv
    head OUTLIER_FACTOR times larger."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device="cpu").to(device)

    q = QUERY_SCALE * normal(heads, head_dim)
    k = normal(context, kv_heads, head_dim)
    v = normal(context, kv_heads, head_dim)
    if outliers:
        k[..., outlier_channels(head_dim)] *= OUTLIER_FACTOR
    return Data(q, k, v)


def outlier_channels(head_dim: int) -> Tensor:
    """The key channels made large: the same ones in every draw (and every kv head), as a
    model's outlier channels are a property of its weights."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randperm(head_dim, generator=generator, device="cpu")[:OUTLIER_CHANNELS]


def attention64(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(heads, D) query over (S, kv_heads, D) keys and values -> (heads, D), in float64."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, 1).transpose(0, 1)  # (heads, S, D)
    v = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (k @ q.double()[:, :, None])[..., 0] * q.shape[-1] ** -0.5  # (heads, S)
    return (torch.softmax(scores, dim=-1)[:, None, :] @ v)[:, 0]


def relative_rms(out: Tensor, reference: Tensor) -> float:
    return ((out.double() - reference).norm() / reference.norm()).item()


def int8_round_trip(x: Tensor) -> Tensor:
    """x (S, kv_heads, D) through the int8 format in float64: one absmax / 127 scale per
    (token, kv head), codes rounded half to even (torch.round) and clamped to +-127."""
    x = x.double()
    scale = x.abs().amax(-1, keepdim=True) / INT8_MAX  # (S, kv_heads, 1)
    safe = torch.where(scale == 0, 1.0, scale)  # an all-zero row stays 0
    return torch.round(x / safe).clamp(-INT8_MAX, INT8_MAX) * scale


def fp8_round_trip(x: Tensor, scale: float) -> Tensor:
    """x through fp8 e4m3fn with one per-tensor scale: saturated to +-448 after dividing
    (the cast alone would turn out-of-range values into NaN), rounded to nearest even."""
    scaled = (x.double() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).double() * scale


def calibrated_scale(x: Tensor) -> float:
    """The per-tensor fp8 scale that maps the tensor's absmax onto 448."""
    return max(x.abs().max().item(), 1e-30) / E4M3_MAX


def fp8_scales(fmt: str, data: Data):
    """(k_scale, v_scale) of an fp8 format."""
    if fmt == "fp8-calibrated":
        return calibrated_scale(data.k), calibrated_scale(data.v)
    return 1.0, 1.0


def simulate(fmt: str, data: Data) -> Tensor:
    """Float64 attention over K/V as the format stores them. An 8-bit format fed bf16 rows
    (ROWS_DTYPES) takes q, K and V in bf16 and gives its output in bf16, as its kernel does,
    so that the two differ only by the kernel's arithmetic."""
    bf16_rows = fmt != "bf16" and ROWS_DTYPES.get(fmt) == torch.bfloat16
    if bf16_rows:
        data = Data(*(x.to(torch.bfloat16).float() for x in (data.q, data.k, data.v)))
    if fmt == "bf16":
        k, v = (x.to(torch.bfloat16) for x in (data.k, data.v))
    elif CACHE_DTYPES[fmt] == torch.int8:
        k, v = int8_round_trip(data.k), int8_round_trip(data.v)
    else:
        k_scale, v_scale = fp8_scales(fmt, data)
        k, v = fp8_round_trip(data.k, k_scale), fp8_round_trip(data.v, v_scale)
    out = attention64(data.q, k, v)
    return out.to(torch.bfloat16).double() if bf16_rows else out


def kernel(fmt: str, data: Data, block_size: int = 16) -> Tensor:
    """mha_ext's append and paged attention over a cache of the format's dtype, one sequence
    -> (heads, D). The q, K and V rows (and the output) are ROWS_DTYPES[fmt], fp32 where it
    names none."""
    context, kv_heads, head_dim = data.k.shape
    scales = dict(zip(("k_scale", "v_scale"), fp8_scales(fmt, data))) if "fp8" in fmt else {}
    cache = PagedKVCache(
        1,
        -(-context // block_size),
        block_size,
        kv_heads,
        head_dim,
        dtype=CACHE_DTYPES[fmt],
        device=data.k.device,
        **scales,
    )
    seq = cache.allocate()
    batch = cache.prepare([seq], [context])
    k_cache, v_cache = cache.key_caches[0], cache.value_caches[0]
    quantization = cache.scale_arguments(0)
    rows_dtype = ROWS_DTYPES.get(fmt, torch.float32)
    q, k, v = (t.to(rows_dtype) for t in (data.q, data.k, data.v))
    mha_ext.paged_kv_append(k, v, k_cache, v_cache, batch.slot_mapping, **quantization)
    return mha_ext.paged_attention(
        q[None],  # (1, heads, D): one query
        k_cache,
        v_cache,
        batch.block_tables,
        batch.seq_lens,
        torch.tensor([0, 1], dtype=torch.int32, device=data.k.device),
        **quantization,
    )[0]


def channel_smoothing(calibration_keys: Tensor) -> Tensor:
    """(kv_heads, D) factors: each key channel's RMS over calibration keys (S, kv_heads, D),
    fixed at cache creation. Dividing the keys by them gives every channel unit RMS."""
    return calibration_keys.double().pow(2).mean(0).sqrt().clamp_min(1e-6).float()


def smoothed(data: Data, factors: Tensor) -> Data:
    """The same attention with keys divided and queries multiplied channel-wise by factors
    (kv_heads, D): q.k is unchanged in exact arithmetic."""
    group = data.q.shape[0] // data.k.shape[1]
    return Data(data.q * factors.repeat_interleave(group, 0), data.k / factors, data.v)


def format_errors(data: Data, calibration_keys: Tensor, kernels: bool) -> Dict[str, Dict]:
    """{format (and "<format> smoothed"): {"simulation": error, "kernel": error or None}} of
    one draw; the smoothing factors come from calibration_keys (S', kv_heads, D)."""
    reference = attention64(data.q, data.k, data.v)
    smooth = smoothed(data, channel_smoothing(calibration_keys))
    errors = {}
    for fmt in FORMATS:
        for name, variant in ((fmt, data), (f"{fmt} smoothed", smooth)):
            if fmt == "bf16" and variant is smooth:
                continue  # bf16's error is relative per element: nothing to smooth
            errors[name] = {
                "simulation": relative_rms(simulate(fmt, variant), reference),
                "kernel": relative_rms(kernel(fmt, variant), reference) if kernels else None,
            }
    return errors


def measure(
    heads: int,
    kv_heads: int,
    context: int,
    head_dim: int,
    outliers: bool,
    draws: int,
    kernels: bool,
) -> Dict[str, Dict[str, Optional[float]]]:
    """format_errors averaged over independent draws of q, K and V. With outlier channels the
    softmax is sharp and one draw's error swings 3x (int8: 4% to 14% over six draws)."""
    # The smoothing factors come from calibration keys: a separate, shorter draw of the
    # same distribution (same outlier channels), as a model's would from a calibration set.
    calibration = make_data(
        heads, kv_heads, CALIBRATION_TOKENS, head_dim, outliers, CALIBRATION_SEED
    ).k
    per_draw = [
        format_errors(
            make_data(heads, kv_heads, context, head_dim, outliers, seed), calibration, kernels
        )
        for seed in range(draws)
    ]
    return {
        fmt: {
            way: None if not kernels and way == "kernel" else mean([e[fmt][way] for e in per_draw])
            for way in ("simulation", "kernel")
        }
        for fmt in per_draw[0]
    }


def mean(values):
    return sum(values) / len(values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--draws", type=int, default=8, help="independent q, K, V draws")
    parser.add_argument("--no-kernels", action="store_true", help="the simulation only")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    rows = []
    for kv_heads in args.kv_heads:
        for outliers in (False, True):
            errors = measure(
                args.heads,
                kv_heads,
                args.context,
                args.head_dim,
                outliers,
                args.draws,
                not args.no_kernels,
            )
            data = "normal" if not outliers else f"{OUTLIER_CHANNELS} key channels x20"
            for fmt, error in errors.items():
                rows.append({"kv_heads": kv_heads, "data": data, "format": fmt, **error})
    print(
        f"relative RMS error of decode attention against float64 over the unquantized K/V: "
        f"1 query x {args.heads} heads, context {args.context}, D{args.head_dim}, q x"
        f"{QUERY_SCALE:g}, mean of {args.draws} draws "
        f"({platform.processor() or platform.machine()}, "
        f"{mha_ext.build_info()['cpu_isa']} kernels)"
    )
    print(f"{'heads':<8}{'data':<22}{'format':<26}{'simulation':>12}{'kernel':>10}{'ratio':>8}")
    for row in rows:
        kernel_error = row["kernel"]
        kernel_text = f"{100 * kernel_error:>9.2f}%" if kernel_error is not None else f"{'-':>10}"
        ratio = f"{kernel_error / row['simulation']:>8.2f}" if kernel_error is not None else ""
        print(
            f"{args.heads}q/{row['kv_heads']}kv".ljust(8)
            + f"{row['data']:<22}{row['format']:<26}{100 * row['simulation']:>11.2f}%"
            + kernel_text
            + ratio
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"arguments": vars(args), "rows": rows}, out, indent=2)
    return rows


if __name__ == "__main__":
    main()

"""Tables on the terminal, JSON, and PNG plots (matplotlib, optional) of suite results."""

import json
from pathlib import Path
from typing import Dict, List, Optional

from .roofline import Roofline, peak_key_of
from .suites import CALLS_PER_STEP

SUITE_TITLES = {
    "forward": "attention forward",
    "forward_backward": "attention forward + backward",
    "gqa_prefill": "grouped-query causal prefill",
    "paged_decode": "paged decode (K/V read per step)",
    "cache_append": "cache append (K/V written per token)",
    "call_overhead": f"small forward calls, batch 1 ({CALLS_PER_STEP} back to back per timed step)",
    "variants": "each score feature against plain attention of the same shape, causal",
    "varlen": "packed documents, causal forward + backward (work: the documents' own FLOPs)",
    "integrations": "mha_ext through each interface against the direct call, causal",
    "context_parallel": "context-parallel attention on spawned ranks against one process, causal",
    "flex": "against FlexAttention (torch.compile), causal; compiles apart from the timing",
}
# Suites whose tables show each contender's microseconds per call, not its throughput: the
# fixed costs of a small call are what they measure.
PER_CALL_SUITES = {"call_overhead", "integrations"}
# Suites whose cases are not a line over one length: a table and no plot.
TABLE_ONLY_SUITES = PER_CALL_SUITES | {"variants", "varlen", "context_parallel", "flex"}


# mha_ext's fraction columns: of the dtype's measured peak and of torch's matmul timed with
# the case (cases of arithmetic), or of the streaming read timed with the case (of bytes).
PEAK_COLUMN = "mha_ext % peak"
MATMUL_COLUMN = "% torch matmul"
STREAM_COLUMN = "mha_ext % stream read"


def format_roofline(measured: Roofline) -> str:
    """The run's peak probe readings and, per key, the ceilings the suites compare with."""
    lines = []
    if measured.peak_readings:
        lines.append(
            "peak probes (GFLOP/s, all threads): "
            + ", ".join(f"{kind} {rate:.1f}" for kind, rate in measured.peak_readings.items())
        )
    parts = []
    for key, value in measured.ceilings.items():
        unit = "GB/s" if key == "stream_read" else "GFLOP/s"
        source = f" ({measured.peak_kinds[key]})" if key in measured.peak_kinds else ""
        label = f"torch {key}" if key.startswith("matmul_") else key
        parts.append(f"{label} {value:.1f} {unit}{source}")
    lines.append("roofline: " + ", ".join(parts))
    return "\n".join(lines)


def _fractions(result: Dict) -> Dict[str, Optional[float]]:
    """mha_ext's fraction columns of one case; None where it was not timed or has no peak."""
    mha = result["results"].get("mha_ext") or {}
    if result["roofline"] == "stream_read":
        return {STREAM_COLUMN: mha.get("roofline_fraction")}
    return {PEAK_COLUMN: mha.get("peak_fraction"), MATMUL_COLUMN: mha.get("roofline_fraction")}


def _contenders(results: List[Dict]) -> List[str]:
    names: List[str] = []
    for result in results:
        names += [
            n for n in list(result["results"]) + list(result["unsupported"]) if n not in names
        ]
    return names


def format_suite(
    suite: str,
    results: List[Dict],
    roofline: Dict[str, float],
    peak_kinds: Optional[Dict[str, str]] = None,
) -> str:
    """One suite's table: each contender's throughput (time per call in PER_CALL_SUITES),
    mha_ext's ratio to the baseline (_ratio_text: with its range over the repeats), its
    fraction of the dtype's peak and of torch's matmul measured with the case, or of the
    streaming read measured with the case (run_case). The decode suite's 8-bit cache cases get
    a table of their own. peak_kinds: "peak_<dtype>" -> the probe that set it, for the summary
    line."""
    if suite == "context_parallel":
        return _context_parallel_table(results)
    quantized = [r for r in results if r["params"].get("kv_cache_dtype")]
    flatness = [r for r in results if _is_append_flatness(r)]
    results = [
        r for r in results if not r["params"].get("kv_cache_dtype") and not _is_append_flatness(r)
    ]
    if suite == "flex":
        lines = _flex_table(results)
    else:
        lines = _contender_table(suite, results) if results else []
    if quantized:
        lines += _quantized_decode_table(quantized)
    lines.append(
        "roofline: "
        + ", ".join(
            _roofline_summary(key, roofline, results + quantized + flatness, peak_kinds or {})
            for key in sorted({r["roofline"] for r in results + quantized + flatness})
        )
    )
    if suite == "cache_append":
        lines += _append_summary(results, flatness)
    if suite == "varlen":
        lines += _varlen_summary(results)
    if suite == "integrations":
        lines += _integrations_summary(results)
    return "\n".join(lines)


def _is_append_flatness(result: Dict) -> bool:
    """Whether a result is the cache_append suite's flatness case (two contexts, interleaved),
    which is no row of the per-context table and no point of its plot."""
    return "short_context" in result["params"]


def _ratio_text(entry: Optional[Dict], width: int) -> str:
    """entry's speedup_vs_baseline, right-aligned in width: "1.23x", and where the contenders
    ran interleaved the range of the repeats' ratios, "1.23x (1.10-1.31)"; "n/a" without."""
    ratio = entry.get("speedup_vs_baseline") if entry else None
    if not ratio:
        return f"{'n/a':>{width}}"
    text = f"{ratio:.2f}x"
    if entry.get("speedup_range"):
        low, high = entry["speedup_range"]
        text += f" ({low:.2f}-{high:.2f})"
    return f"{text:>{width}}"


def _contender_table(suite: str, results: List[Dict]) -> List[str]:
    contenders = _contenders(results)
    per_call = suite in PER_CALL_SUITES
    unit = "us per call" if per_call else results[0]["unit"]
    baseline = results[0]["baseline"]
    label_width = max(len(r["label"]) for r in results) + 2
    header = f"{'case':<{label_width}}" + "".join(f"{name:>22}" for name in contenders)
    fraction_columns = []
    for result in results:
        fraction_columns += [c for c in _fractions(result) if c not in fraction_columns]
    header += f"{'mha_ext / ' + baseline:>28}" + "".join(f"{c:>23}" for c in fraction_columns)
    lines = [f"{SUITE_TITLES[suite]} ({unit})", header, "-" * len(header)]
    for result in results:
        line = f"{result['label']:<{label_width}}"
        for name in contenders:
            entry = result["results"].get(name)
            if not entry:
                line += f"{'n/a':>22}"
            elif per_call:
                line += f"{entry['seconds_per_call'] * 1e6:>22.1f}"
            else:
                line += f"{entry['throughput']:>22.4g}"
        line += _ratio_text(result["results"].get("mha_ext"), 28)
        fractions = _fractions(result)
        for column in fraction_columns:
            fraction = fractions.get(column)
            line += f"{100 * fraction:>22.0f}%" if fraction is not None else f"{'n/a':>23}"
        lines.append(line)
    return lines


def _flex_table(results: List[Dict]) -> List[str]:
    """Per case: each contender's throughput, flex's time over mha_ext's (> 1: mha_ext is
    faster), mha_ext's fractions of the roofline as the other tables give them (_fractions),
    FlexAttention's compile (its first call) and the largest difference of its output from
    mha_ext's; where flex is not timed, n/a and why."""
    label_width = max(len(r["label"]) for r in results) + 2
    width = 2 + len(STREAM_COLUMN)  # the widest column title, and a space before it
    fraction_columns = [PEAK_COLUMN, MATMUL_COLUMN, STREAM_COLUMN]
    columns = ["mha_ext", "flex", "mha_ext / flex", *fraction_columns, "flex compile s"]
    columns.append("max |flex - mha_ext|")
    header = f"{'case':<{label_width}}{'unit':>9}" + "".join(f"{c:>{width}}" for c in columns)
    lines = [SUITE_TITLES["flex"], header, "-" * len(header)]
    for result in results:
        timed, checks = result["results"], result.get("checks", {})
        line = f"{result['label']:<{label_width}}{result['unit']:>9}"
        for name in ("mha_ext", "flex"):
            line += (
                f"{timed[name]['throughput']:>{width}.4g}" if name in timed else f"{'n/a':>{width}}"
            )
        line += _ratio_text(timed.get("mha_ext"), width)
        fractions = _fractions(result)
        for column in fraction_columns:
            fraction = fractions.get(column)
            line += (
                f"{100 * fraction:>{width - 1}.0f}%" if fraction is not None else f"{'':>{width}}"
            )
        for key, form in (("flex_compile_seconds", ".1f"), ("flex_max_difference", ".2g")):
            line += f"{checks[key]:>{width}{form}}" if key in checks else f"{'n/a':>{width}}"
        if result["unsupported"]:
            line += "  " + "; ".join(f"{k}: {v}" for k, v in result["unsupported"].items())
        lines.append(line)
    return lines


def _quantized_decode_table(results: List[Dict]) -> List[str]:
    """Decode over an 8-bit cache (mha_ext) against the same step over a bf16 cache
    (bf16_cache), interleaved in one run: tokens/s of one layer's step, their ratio, and each
    one's GB/s of the bytes its cache holds for the step (scales included) as a % of the
    streaming read measured with the case."""
    label_width = max(len(r["label"]) for r in results) + 2
    columns = ["tokens/s", "bf16 cache tokens/s", "vs bf16 cache", "GB/s", "% stream read"]
    columns.append("bf16 cache % stream")
    header = f"{'case':<{label_width}}" + "".join(f"{c:>21}" for c in columns)
    lines = [
        "",
        "decode over 8-bit caches against a bf16 cache (one layer's step; GB/s of the bytes "
        "each cache holds for it, scales included)",
        header,
        "-" * len(header),
    ]
    for result in results:
        timed, batch = result["results"], result["params"]["batch"]
        line = f"{result['label']:<{label_width}}"
        if "mha_ext" not in timed or "bf16_cache" not in timed:
            missing = "; ".join(f"{k}: {v}" for k, v in result["unsupported"].items())
            lines.append(line + f"  not timed: {missing}")
            continue
        quantized, bf16 = timed["mha_ext"], timed["bf16_cache"]
        line += f"{batch / quantized['seconds_per_call']:>21.0f}"
        line += f"{batch / bf16['seconds_per_call']:>21.0f}"
        line += _ratio_text(quantized, 21)
        line += f"{quantized['throughput']:>21.1f}"
        line += f"{100 * quantized['roofline_fraction']:>20.0f}%"
        line += f"{100 * bf16['roofline_fraction']:>20.0f}%"
        lines.append(line)
    return lines


def _context_parallel_table(results: List[Dict]) -> str:
    """Per case: step time on the ranks and alone, compute-only and communication-only times,
    the share of communication hidden, and per rank the bytes sent and the peak memory
    (the largest over ranks; the single process's alongside)."""
    params = results[0]["params"]
    label_width = max(len(r["label"]) for r in results) + 2
    header = (
        f"{'case':<{label_width}}{'ranks ms':>10}{'1 proc ms':>11}{'speedup':>9}{'compute ms':>12}"
        f"{'comm ms':>9}{'hidden':>8}{'MB sent/rank':>14}{'peak MB/rank':>14}{'1 proc MB':>11}"
    )
    lines = [
        f"{SUITE_TITLES['context_parallel']}: world {params['world']} (gloo), "
        f"{params['threads_per_rank']} thread(s) per rank and for the single process, "
        f"B{params['batch']} H{params['heads']}",
        header,
        "-" * len(header),
    ]
    for result in results:
        ranks = result["results"]["context_parallel"]["seconds_per_call"]
        alone = result["results"]["single_process"]["seconds_per_call"]
        sent = max(r["bytes_sent"] for r in result["ranks"])
        peak = max(r["peak_memory_bytes"] for r in result["ranks"])
        lines.append(
            f"{result['label']:<{label_width}}{ranks * 1e3:>10.2f}{alone * 1e3:>11.2f}"
            f"{alone / ranks:>8.2f}x"
            f"{result['compute_only_seconds'] * 1e3:>12.2f}"
            f"{result['communication_only_seconds'] * 1e3:>9.2f}"
            f"{100 * result['hidden_communication_share']:>7.0f}%{sent / 2**20:>14.2f}"
            f"{peak / 2**20:>14.1f}{result['single_process_peak_memory_bytes'] / 2**20:>11.1f}"
        )
    lines.append(
        "hidden = 1 - (step - compute-only) / communication-only; bytes counted in the "
        "torch.distributed calls the step makes"
    )
    return "\n".join(lines)


def _roofline_summary(
    key: str, roofline: Dict[str, float], results: List[Dict], peak_kinds: Dict[str, str]
) -> str:
    """key = its rate before the suites and the range of its rates side by side with the
    cases; for torch's matmul, the dtype's peak (and the probe that set it) first."""
    unit = "GB/s" if key == "stream_read" else "GFLOP/s"
    summary = f"{key} = {roofline[key]:.1f} {unit} ({_with_cases(results, key, 'roofline_rate')})"
    peak_key = peak_key_of(key)
    if peak_key is None:
        return summary
    peak = roofline.get(peak_key)
    if not peak:
        return f"{peak_key}: not measured, torch {summary}"
    source = f"{peak_kinds[peak_key]}; " if peak_key in peak_kinds else ""
    with_cases = _with_cases(results, key, "peak_rate")
    return f"{peak_key} = {peak:.1f} GFLOP/s ({source}{with_cases}), torch {summary}"


def _with_cases(results: List[Dict], key: str, rate: str) -> str:
    """The range of a rate over the cases of the key: "with the cases: 80.1 - 95.3"."""
    rates = [r[rate] for r in results if r["roofline"] == key and r.get(rate)]
    if len(rates) == 1:
        return f"with the case: {rates[0]:.1f}"
    return f"with the cases: {min(rates):.1f} - {max(rates):.1f}" if rates else "alone"


def _append_summary(results: List[Dict], flatness: List[Dict]) -> List[str]:
    """Each contender's time per token at the first and last context (cases timed one after
    another), then mha_ext's ratio of the two from the flatness case, which times them
    interleaved, each after the streaming read: its median and its range over the repeats."""
    first, last = results[0], results[-1]
    lines = []
    for name in first["results"]:
        per_call = [r["results"][name]["seconds_per_call"] * 1e6 for r in (first, last)]
        lines.append(
            f"{name}: {per_call[0]:.2f} us per token at context {first['params']['context']}, "
            f"{per_call[1]:.2f} us at {last['params']['context']} "
            f"(ratio {per_call[1] / per_call[0]:.2f}, timed apart)"
        )
    for result in flatness:
        timed = result["results"]
        if "mha_ext" not in timed:
            continue
        long, short = timed["mha_ext"], timed[result["baseline"]]
        text = (
            f"mha_ext interleaved, each after the read: "
            f"{long['seconds_per_call'] * 1e6:.2f} us per token at context "
            f"{result['params']['context']} against {short['seconds_per_call'] * 1e6:.2f} at "
            f"{result['params']['short_context']}: ratio {1 / long['speedup_vs_baseline']:.2f}"
        )
        if long.get("speedup_range"):
            fastest, slowest = long["speedup_range"]
            text += f" ({1 / slowest:.2f}-{1 / fastest:.2f} over the repeats)"
        lines.append(text)
    return lines


def _varlen_summary(results: List[Dict]) -> List[str]:
    """mha_ext's packed GFLOP/s as a fraction of its uniform batch's, per dtype."""
    lines = []
    for dtype in sorted({r["params"]["dtype"] for r in results}):
        rates = {
            r["params"]["layout"]: r["results"]["mha_ext"]["throughput"]
            for r in results
            if r["params"]["dtype"] == dtype and "mha_ext" in r["results"]
        }
        if len(rates) == 2:
            lines.append(
                f"{dtype}: packed documents run at {100 * rates['packed'] / rates['uniform']:.0f}% "
                f"of the uniform batch's GFLOP/s"
            )
    return lines


def _integrations_summary(results: List[Dict]) -> List[str]:
    """What each interface adds to the direct call: microseconds and percent per call."""
    lines = ["time an interface adds to the direct mha_ext call:"]
    for result in results:
        timed = result["results"]
        if "integration" in timed and "mha_ext" in timed:
            direct = timed["mha_ext"]["seconds_per_call"]
            added = timed["integration"]["seconds_per_call"] - direct
            lines.append(
                f"  {result['label']}: {added * 1e6:+.1f} us ({100 * added / direct:+.1f}%)"
            )
    return lines


def write_json(path: Path, machine: Dict, roofline: Dict[str, float], results: List[Dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"machine": machine, "roofline": roofline, "results": results}, indent=2)
    )


def write_plots(directory: Path, results: List[Dict]) -> List[Path]:
    """One PNG per suite: throughput against sequence length (context for the cache suites),
    a line per contender and dtype, a panel per model. Needs matplotlib; returns [] without."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    # The call_overhead shapes differ in heads as well as length: one line over them would
    # mislead, so its table is its only result.
    for suite in (s for s in SUITE_TITLES if s not in TABLE_ONLY_SUITES):
        # the append flatness case repeats a context of the lines, against another
        suite_results = [r for r in results if r["suite"] == suite and not _is_append_flatness(r)]
        if not suite_results:
            continue
        x_key = "seq" if "seq" in suite_results[0]["params"] else "context"
        panels = sorted(
            {
                r["params"].get("model", "llama2-7b layer")
                + (" causal" if r["params"].get("causal") else "")
                for r in suite_results
            }
        )
        figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
        for axis, panel in zip(axes[0], panels):
            lines: Dict[str, List] = {}
            for r in suite_results:
                if (
                    r["params"].get("model", "llama2-7b layer")
                    + (" causal" if r["params"].get("causal") else "")
                    != panel
                ):
                    continue
                kv_cache = r["params"].get("kv_cache_dtype")
                for name, entry in r["results"].items():
                    if kv_cache and name == "bf16_cache":
                        continue  # the plain decode cases draw mha_ext over a bf16 cache
                    line_label = f"{name} {r['params']['dtype']}"
                    line_label += f" {kv_cache} cache" if kv_cache else ""
                    lines.setdefault(line_label, []).append(
                        (r["params"][x_key], entry["throughput"])
                    )
            for line_label, points in sorted(lines.items()):
                points.sort()
                axis.plot(
                    [p[0] for p in points], [p[1] for p in points], marker="o", label=line_label
                )
            axis.set_title(panel)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("context" if x_key == "context" else "sequence length")
            axis.set_ylabel(suite_results[0]["unit"])
            axis.legend(fontsize=7)
        figure.suptitle(SUITE_TITLES[suite])
        figure.tight_layout()
        path = directory / f"{suite}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written

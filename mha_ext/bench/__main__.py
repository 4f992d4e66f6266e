r"""python -m mha_ext.bench: mha_ext against torch SDPA and the naive attention, in one run.

    python -m mha_ext.bench --quick              # every suite but flex, small, under 2 minutes
    python -m mha_ext.bench --suite forward --models llama2-7b --seq 1024 4096 --dtype bfloat16
    python -m mha_ext.bench --suite context_parallel --world 2   # ring and ulysses on 2 ranks
    python -m mha_ext.bench --suite paged_decode --context 4096 --dtype bfloat16 \
        --kv-cache-dtype int8 fp8 --kv-cache-only        # 8-bit caches against a bf16 cache
    python -m mha_ext.bench --suite flex --seq 2048 --context 4096   # against FlexAttention
    python -m mha_ext.bench --suite forward --busy-cores 1   # with a neighbour spinning on a core

Prints a table per suite (throughput, mha_ext's ratio to torch, mha_ext's fraction of this
CPU's measured peak for the dtype and of torch's matmul, or of a streaming read for the cache
suites, the last two measured side by side with each case), and writes results.json and one
PNG per suite (with matplotlib installed) to --out.
"""

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import mha_ext

from . import context_parallel, report, roofline
from .suites import (
    DECODE_BATCH,
    DEFAULT_SUITES,
    KV_CACHE_DTYPES,
    MODELS,
    SUITES,
    build_cases,
    run_case,
)
from .timing import busy_cores

QUICK = {
    "models": ["gpt2-small", "llama2-70b"],
    "seq": [512],
    "context": [1024],
    "append_context": [512, 4096, 32768],
    "varlen_tokens": 4096,
    "context_parallel_seq": [1024],
    "context_parallel_head_dims": [64],
    "flex_seq": [512],
    "flex_context": [1024],
}
FULL = {
    "models": list(MODELS),
    "seq": [512, 1024, 2048],
    "context": [1024, 4096],
    "append_context": [512, 2048, 8192, 32768],
    "varlen_tokens": 16384,
    "context_parallel_seq": [2048, 4096, 8192],
    "context_parallel_head_dims": [64, 128],
    "flex_seq": [2048],
    "flex_context": [4096],
}


class Progress:
    """A one-line progress bar on a terminal; silent when stderr is a file (CI logs)."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.enabled = sys.stderr.isatty()

    def update(self, label: str):
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // self.total
            elapsed = time.perf_counter() - self.start
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                f"{elapsed:5.0f}s {label[:50]:<50}"
            )
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mha_ext.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--suite",
        nargs="+",
        default=list(DEFAULT_SUITES),
        choices=SUITES,
        help=f"default: all but {', '.join(s for s in SUITES if s not in DEFAULT_SUITES)} "
        "(FlexAttention's compiles take minutes: name it to run it)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes: the whole run under 2 minutes"
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument(
        "--seq", nargs="+", type=int, help="sequence lengths of the attention suites"
    )
    parser.add_argument("--context", nargs="+", type=int, help="contexts of the decode suite")
    parser.add_argument(
        "--varlen-tokens", type=int, help="tokens the varlen suite packs its documents into"
    )
    parser.add_argument(
        "--append-context", nargs="+", type=int, help="contexts of the append suite"
    )
    parser.add_argument(
        "--decode-batch", type=int, default=DECODE_BATCH, help="sequences per decode step"
    )
    parser.add_argument(
        "--append-batch", type=int, default=1, help="sequences per append call (one token each)"
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    parser.add_argument(
        "--world", type=int, default=2, help="ranks the context_parallel suite spawns (gloo, CPU)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="*",
        default=list(KV_CACHE_DTYPES),
        choices=list(KV_CACHE_DTYPES),
        help="8-bit caches the decode suite times against a bf16 cache (none: leave them out)",
    )
    parser.add_argument(
        "--kv-cache-only",
        action="store_true",
        help="the decode suite's 8-bit cache cases alone",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--repeats", type=int, help="timed repeats per case (median); default 3 quick, 5 full"
    )
    parser.add_argument(
        "--out", default="benchmarks/results", help="folder for results.json and the plots"
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="processes spinning on a core each for the whole run, as a shared machine's "
        "neighbours: every contender, and the roofline, is timed under that load",
    )
    args = parser.parse_args(argv)
    if args.busy_cores < 0:
        parser.error(f"--busy-cores must be 0 or more, got {args.busy_cores}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with busy_cores(args.busy_cores):
        return _run(args)


def _run(args):
    sizes = QUICK if args.quick else FULL
    device = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in args.dtype]
    repeats = args.repeats or (3 if args.quick else 5)
    machine = {
        "torch": torch.__version__,
        "mha_ext": mha_ext.build_info(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "processor": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "busy_cores": args.busy_cores,
    }
    print(
        f"mha_ext {machine['mha_ext']['version']} ({machine['mha_ext']['cpu_isa']} CPU "
        f"kernels), torch "
        f"{machine['torch']}, {machine['threads']} threads, device {device}, median of {repeats}"
        + (f", {args.busy_cores} busy core(s) beside" if args.busy_cores else "")
    )
    print("measuring the roofline ...", flush=True)
    measured = roofline.measure_roofline(dtypes, device, args.quick)
    probes, ceilings = measured.probes, measured.ceilings
    machine["peak_probes"] = measured.peak_readings
    machine["peak_kinds"] = measured.peak_kinds
    print(report.format_roofline(measured))

    factories = build_cases(
        args.suite,
        args.models or sizes["models"],
        args.seq or sizes["seq"],
        args.context or sizes["context"],
        args.append_context or sizes["append_context"],
        dtypes,
        device,
        args.decode_batch,
        args.append_batch,
        args.varlen_tokens or sizes["varlen_tokens"],
        args.kv_cache_dtype,
        args.kv_cache_only,
        args.seq or sizes["flex_seq"],
        args.context or sizes["flex_context"],
    )
    progress = Progress(len(factories))
    results = []
    for factory in factories:
        case = factory()
        results.append(run_case(case, ceilings, device, repeats, probes))
        progress.update(case.label)
        del case  # free the case's tensors before the next one allocates
    progress.close()
    if "context_parallel" in args.suite:
        print(f"context_parallel: spawning {args.world} ranks ...", flush=True)
        results += context_parallel.run_suite(
            args.world,
            args.seq or sizes["context_parallel_seq"],
            sizes["context_parallel_head_dims"],
            dtypes,
            repeats,
        )

    for suite in args.suite:
        suite_results = [r for r in results if r["suite"] == suite]
        if suite_results:
            print()
            print(report.format_suite(suite, suite_results, ceilings, measured.peak_kinds))
    out = Path(args.out)
    report.write_json(out / "results.json", machine, ceilings, results)
    print(f"\nwrote {out / 'results.json'}")
    if not args.no_plots:
        plots = report.write_plots(out, results)
        print(
            f"wrote {', '.join(str(p) for p in plots)}"
            if plots
            else "plots skipped: pip install matplotlib"
        )
    return results


if __name__ == "__main__":
    main()

"""Peak extra memory of one fused attention forward + backward, against one S x S matrix.

Run in a fresh process, since the peak resident set size (ru_maxrss) only ever grows:

    python benchmarks/peak_memory.py --batch 1 --heads 8 --seq 16384 --head-dim 64

"Extra" is the growth of the peak RSS over the resident size once the inputs, the output
gradient and the thread pools exist: outputs, gradients and every kernel workspace. Pages of
shared libraries (libtorch's code) that the run faults in, for instance after other
programs pushed them out of the page cache, are file-backed, not memory the attention
allocates, and are taken off.
"""

import argparse
import ctypes
import json
import resource
import time

# glibc raises its mmap threshold after large frees, after which big tensors may come from
# (and stay in) the heap: resident memory then depends on allocation order and thread timing
# (seen once as +60 MiB in a CI run). A fixed threshold, set before torch allocates, makes
# every large tensor its own mapping, returned when freed.
M_MMAP_THRESHOLD = -3
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)

import torch  # noqa: E402

import mha_ext  # noqa: E402

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def resident_file_bytes() -> int:
    """File-backed resident memory (RssFile in /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("peak_memory.py: /proc/self/status has no RssFile line")


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> dict:
    shape = (batch, heads, seq, head_dim)
    q, k, v, grad_out = (torch.randn(shape).requires_grad_(i < 3) for i in range(4))
    # Thread pools and per-thread scratch come up on a small call first.
    small = [t.detach()[:, :, :128].clone().requires_grad_() for t in (q, k, v)]
    mha_ext.attention(*small).sum().backward()
    baseline, baseline_file = resident_bytes(), resident_file_bytes()
    start = time.perf_counter()
    out = mha_ext.attention(q, k, v, causal="bottom_right" if causal else None)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    file_growth = max(resident_file_bytes() - baseline_file, 0)
    extra = max(peak_resident_bytes() - baseline - file_growth, 0)
    score_matrix = seq * seq * 4  # one head's fp32 S x S matrix
    return {
        "shape": list(shape),
        "causal": causal,
        "extra_peak_bytes": extra,
        "score_matrix_bytes": score_matrix,
        "extra_over_score_matrix": extra / score_matrix,
        "seconds": seconds,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = measure(args.batch, args.heads, args.seq, args.head_dim, args.causal)
    print(
        f"fused attention fwd+bwd, shape (B, H, S, D) = {tuple(result['shape'])}, fp32"
        f"{', causal' if args.causal else ''}: {result['seconds']:.1f} s\n"
        f"peak extra memory: {result['extra_peak_bytes'] / MIB:.0f} MiB = "
        f"{result['extra_over_score_matrix']:.3f} x one {args.seq} x {args.seq} fp32 score matrix "
        f"({result['score_matrix_bytes'] / MIB:.0f} MiB)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()

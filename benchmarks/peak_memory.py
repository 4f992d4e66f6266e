"""Peak extra memory of one fused attention forward + backward, against one S x S matrix.

    python benchmarks/peak_memory.py --batch 1 --heads 8 --seq 16384 --head-dim 64

"Extra" is the growth of the process's anonymous resident memory (RssAnon: what malloc and
torch allocate) over its size once the inputs, the output gradient and the thread pools
exist: outputs, gradients and every kernel workspace. A thread samples it every 0.2 ms during
the call (the ops release the GIL); an allocation that could matter against an S x S matrix
takes far longer than that to touch. File-backed pages (libtorch's code, faulted in or
evicted as the machine's page cache comes and goes) are not the attention's and are not
counted: the peak RSS (ru_maxrss), which counts them, read 0.50 and 0.52 x a score matrix at
S = 16384 in two clean-clone CI runs of a build that reads 0.11 either way when run alone.
"""

import argparse
import ctypes
import json
import threading
import time

M_MMAP_THRESHOLD = -3
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)

import torch  # noqa: E402

import mha_ext  # noqa: E402

MIB = 1 << 20
SAMPLE_SECONDS = 0.0002


def resident_anonymous_bytes() -> int:
    """Anonymous resident memory (RssAnon in /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("peak_memory.py: /proc/self/status has no RssAnon line")


class PeakSampler(threading.Thread):
    """The largest RssAnon seen while running (sampled), and at start and stop."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = resident_anonymous_bytes()
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            self.peak = max(self.peak, resident_anonymous_bytes())
            time.sleep(SAMPLE_SECONDS)

    def stop(self) -> int:
        self.stopped.set()
        self.join()
        return max(self.peak, resident_anonymous_bytes())


def measure(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> dict:
    shape = (batch, heads, seq, head_dim)
    q, k, v, grad_out = (torch.randn(shape).requires_grad_(i < 3) for i in range(4))
    # Thread pools and per-thread scratch come up on a small call first.
    small = [t.detach()[:, :, :128].clone().requires_grad_() for t in (q, k, v)]
    mha_ext.attention(*small).sum().backward()
    baseline = resident_anonymous_bytes()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    out = mha_ext.attention(q, k, v, causal="bottom_right" if causal else None)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    extra = max(sampler.stop() - baseline, 0)
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

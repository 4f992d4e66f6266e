"""Per-call time of small attention calls, mha_ext against torch SDPA, where fixed costs
(Python, dispatch, autograd, allocation, threads) matter as much as arithmetic: the shapes
of a decode loop and issue 5's small case (batch 1, 128 tokens, head dim 64).

    python benchmarks/call_overhead.py            # fp32; --dtype bfloat16 for bf16
"""
import argparse
import time

import torch
import torch.nn.functional as F

import mha_ext

SHAPES = [(1, 1, 1, 64), (1, 12, 16, 64), (1, 12, 128, 64)]  # (batch, heads, seq, head_dim)
CALLS_PER_SAMPLE = 200


def microseconds_per_call(fn, samples: int) -> float:
    """Median over samples of the mean time of CALLS_PER_SAMPLE back-to-back calls."""
    for _ in range(CALLS_PER_SAMPLE):
        fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            fn()
        times.append((time.perf_counter() - start) / CALLS_PER_SAMPLE * 1e6)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=15)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, forward, "
          f"median of {args.samples} x {CALLS_PER_SAMPLE} calls")
    print(f"{'shape (B, H, S, D)':>20} {'mha_ext us':>11} {'torch us':>9} {'mha_ext / torch':>16}")
    for shape in SHAPES:
        q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
        ours = microseconds_per_call(lambda: mha_ext.scaled_dot_product_attention(q, k, v), args.samples)
        theirs = microseconds_per_call(lambda: F.scaled_dot_product_attention(q, k, v), args.samples)
        print(f"{str(shape):>20} {ours:>11.1f} {theirs:>9.1f} {theirs / ours:>15.2f}x")


if __name__ == "__main__":
    main()

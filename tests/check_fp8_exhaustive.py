"""Every fp32 bit pattern through the float8_e4m3fn append, against torch's conversion.

paged_kv_append into a float8_e4m3fn cache (k_scale 1, so the quotient is x itself) must store
exactly mha_ext.reference.quantize_float8(x, 1.0): x saturated to +-448 (NaN kept NaN) and
converted by torch's .to(torch.float8_e4m3fn). This script checks that for all 2^32 fp32 inputs,
in chunks, on the ISA the process dispatches to. It takes minutes, so it is not a pytest file
(pytest collects test_*.py only); tests/test_append_quantizers.py covers every bf16 and fp16
pattern and the special values on every run. Run it after changing the kernel's fp8 encoder:

    PYTHONPATH=. python tests/check_fp8_exhaustive.py
    MHA_EXT_CPU_ISA=avx2 PYTHONPATH=. python tests/check_fp8_exhaustive.py
    MHA_EXT_CPU_ISA=generic PYTHONPATH=. python tests/check_fp8_exhaustive.py

It prints the ISA, and the first mismatching inputs if any (exit status 1).
"""

import argparse
import sys
import time

import torch

import mha_ext
from mha_ext.reference import quantize_float8

HEADS, HEAD_DIM = 8, 128  # one token's rows: 1024 inputs per token


def append_codes(x: torch.Tensor) -> torch.Tensor:
    """The e4m3fn bytes paged_kv_append stores for fp32 inputs x (n,), n a multiple of 1024."""
    tokens = x.numel() // (HEADS * HEAD_DIM)
    rows = x.view(tokens, HEADS, HEAD_DIM)
    cache = torch.empty(tokens, HEADS, 1, HEAD_DIM, dtype=torch.float8_e4m3fn)  # block size 1
    slots = torch.arange(tokens, dtype=torch.int64)
    mha_ext.paged_kv_append(rows, rows, cache, cache, slots, k_scale=1.0, v_scale=1.0)
    return cache.view(torch.uint8).view(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-bits", type=int, default=24, help="2^bits inputs per chunk")
    args = parser.parse_args()
    chunk = 1 << args.chunk_bits
    print(f"ISA {mha_ext.build_info()['cpu_isa']}, 2^32 inputs in chunks of 2^{args.chunk_bits}")
    start = time.perf_counter()
    offsets = torch.arange(chunk, dtype=torch.int64)
    for first in range(0, 1 << 32, chunk):
        # the bit patterns first .. first + chunk - 1 as int32 (two's complement), then fp32
        patterns = ((offsets + first + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)
        x = patterns.view(torch.float32)
        got = append_codes(x)
        expected = quantize_float8(x, 1.0).view(torch.uint8)
        bad = (got != expected).nonzero().flatten()
        if bad.numel():
            for i in bad[:10].tolist():
                print(
                    f"input 0x{int(patterns[i]) & 0xFFFFFFFF:08x} ({x[i].item()!r}): stored"
                    f" 0x{int(got[i]):02x}, torch 0x{int(expected[i]):02x}"
                )
            print(f"{bad.numel()} mismatches in the chunk at 0x{first:08x}")
            sys.exit(1)
    print(f"all 2^32 inputs match ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

"""The paged KV cache benchmark: per-token append cost as the context grows (against the
seed tutorial's torch.cat update) and decode attention in GB/s of K/V read (against torch
SDPA on a contiguous cache). The suites live in mha_ext.bench; this runs those two.

    python benchmarks/kv_cache.py [--quick] [other python -m mha_ext.bench options]
"""

import sys

from mha_ext.bench.__main__ import main

if __name__ == "__main__":
    main(["--suite", "cache_append", "paged_decode", *sys.argv[1:]])

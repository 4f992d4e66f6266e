"""What this machine can do, measured in the same run as the benchmarks: a large matmul's
GFLOP/s per dtype and a streaming read's GB/s. Results are printed as fractions of these."""
import glob
from typing import Dict, Iterable

import torch

from .timing import median_seconds


def matmul_gflops(dtype: torch.dtype, device: torch.device, max_size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of torch.matmul on square matrices, the size doubled from 256 until a call takes
    50 ms or reaches max_size: a CPU without bf16 instructions multiplies bf16 at about 2
    GFLOP/s, where one 2048 product takes 10 s."""
    size = 256
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        seconds = median_seconds({"matmul": lambda: torch.matmul(a, b)}, warmup=1, repeats=1, device=device)
        if seconds["matmul"] >= 0.05 or size >= max_size:
            break
        size *= 2
    # The probe's calls warmed a and b up.
    seconds = median_seconds({"matmul": lambda: torch.matmul(a, b)}, warmup=0, repeats=repeats, device=device)
    return 2.0 * size ** 3 / seconds["matmul"] / 1e9


def cpu_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs; 0 where unknown). Data meant to come from memory must
    be several times larger: this machine's VM reports a 480 MiB L3."""
    sizes = [0]
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


def stream_read_gbps(device: torch.device, mebibytes: int = 512, repeats: int = 5) -> float:
    if device.type == "cpu":  # read from memory, not from the last-level cache
        mebibytes = max(mebibytes, 2 * cpu_cache_bytes() >> 20)
    data = torch.ones(mebibytes << 18, device=device)  # float32: 2^18 per MiB
    seconds = median_seconds({"read": lambda: data.sum()}, warmup=2, repeats=repeats, device=device)
    return data.numel() * data.element_size() / seconds["read"] / 1e9


def measure(dtypes: Iterable[torch.dtype], device: torch.device, quick: bool) -> Dict[str, float]:
    """{"matmul_<dtype>": GFLOP/s, ..., "stream_read": GB/s}"""
    repeats = 3 if quick else 5
    roofline = {f"matmul_{str(d).replace('torch.', '')}": matmul_gflops(d, device, repeats=repeats) for d in dtypes}
    roofline["stream_read"] = stream_read_gbps(device, 256 if quick else 512, repeats)
    return roofline

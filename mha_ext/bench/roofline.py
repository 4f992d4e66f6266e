"""What this machine can do, measured in the same run as the benchmarks: a large matmul's
GFLOP/s per dtype and a streaming read's GB/s. Each is a probe (a call and its work) that
runs once before the suites, for the run's headline ceilings, and again side by side with
every case's contenders (suites.run_case), so that a case's fraction of the roofline compares
runs made under the same conditions: on a shared VM the matmul's rate drifted by 25% between
suites of one run."""

import glob
from dataclasses import dataclass
from typing import Callable, Dict, Iterable

import torch

from .timing import median_seconds


@dataclass
class Probe:
    step: Callable[[], None]
    work: float  # FLOPs or bytes of one call of step

    def rate(self, device: torch.device, warmup: int = 1, repeats: int = 5) -> float:
        """GFLOP/s or GB/s: work over the median time of a call."""
        seconds = median_seconds(
            {"probe": self.step}, warmup=warmup, repeats=repeats, device=device
        )
        return self.work / seconds["probe"] / 1e9


def matmul_probe(dtype: torch.dtype, device: torch.device, max_size: int = 2048) -> Probe:
    """torch.matmul on square matrices, the size doubled from 256 until a call takes 50 ms or
    reaches max_size: a CPU without bf16 instructions multiplies bf16 at about 2 GFLOP/s,
    where one 2048 product takes 10 s."""
    size = 256
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        seconds = median_seconds(
            {"matmul": lambda: torch.matmul(a, b)}, warmup=1, repeats=1, device=device
        )
        if seconds["matmul"] >= 0.05 or size >= max_size:
            return Probe(lambda: torch.matmul(a, b), 2.0 * size**3)
        size *= 2


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


def stream_probe(device: torch.device, mebibytes: int = 512) -> Probe:
    """A sum over a float32 buffer, read from memory: on a CPU at least twice its largest cache."""
    if device.type == "cpu":
        mebibytes = max(mebibytes, 2 * cpu_cache_bytes() >> 20)
    data = torch.ones(mebibytes << 18, device=device)  # float32: 2^18 per MiB
    return Probe(lambda: data.sum(), data.numel() * data.element_size())


def probes(dtypes: Iterable[torch.dtype], device: torch.device, quick: bool) -> Dict[str, Probe]:
    """{"matmul_<dtype>": probe, ..., "stream_read": probe}, the keys of Case.roofline_key."""
    found = {f"matmul_{str(d).replace('torch.', '')}": matmul_probe(d, device) for d in dtypes}
    found["stream_read"] = stream_probe(device, 256 if quick else 512)
    return found


def measure(found: Dict[str, Probe], device: torch.device, quick: bool) -> Dict[str, float]:
    """{"matmul_<dtype>": GFLOP/s, ..., "stream_read": GB/s}"""
    return {
        key: probe.rate(device, warmup=2, repeats=3 if quick else 5) for key, probe in found.items()
    }

"""What this machine can do, measured in the same run as the benchmarks.

The roofline of a case's arithmetic is the dtype's peak: the fastest rate this CPU ran that
dtype's arithmetic in an instruction-throughput loop on all threads (the extension's peak
probes, csrc/cpu/peak_probe.h), so no kernel can print more than 100% of it by construction
of the measure, as kernels did of torch's matmul. Beside it, torch's matmul rate per dtype and
a streaming read's GB/s (the roofline of the decode and cache cases) are probes (a call and
its work) that run once before the suites, for the run's headline numbers, and again side by
side with every case's contenders, interleaved round by round (suites.run_case), so that the
case and the probe run under the same conditions: on a shared VM the matmul's rate drifted by
25% between suites of one run. The peak probe of the case's dtype runs with them too, and the
higher of its two readings is the case's peak."""

import glob
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch

from .. import _C
from .timing import median_seconds

# The peak probes of each arithmetic (csrc/cpu/peak_probe.h). bf16 may run on either: a CPU
# without bf16 instructions converts it to fp32, whose FMA rate is then its peak. fp16 has no
# probe of its own: mha_ext's kernels compute it in fp32.
FP32_PEAK_PROBES = ("fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512")
BF16_PEAK_PROBES = ("bf16_dot_avx512", "bf16_amx")
PEAK_PROBES_BY_DTYPE = {
    torch.float32: FP32_PEAK_PROBES,
    torch.float16: FP32_PEAK_PROBES,
    torch.bfloat16: FP32_PEAK_PROBES + BF16_PEAK_PROBES,
}


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


def peak_probe_kinds() -> List[str]:
    """The peak probes this CPU and MHA_EXT_CPU_ISA allow, portable first."""
    return list(_C._peak_probe_kinds())


def peak_probe_rate(kind: str, min_seconds: float = 0.05, repeats: int = 3) -> float:
    """GFLOP/s of one peak probe on all of torch's threads: its iterations grown until a run
    takes min_seconds, then the fastest of `repeats` runs. The fastest, not the median: the
    CPU reached that rate, and a neighbour on a shared machine only ever slows a run down."""
    iterations = 1000
    run = _C._run_peak_probe(kind, iterations)
    while run["seconds"] < min_seconds:
        # Aim 20% past min_seconds; at most 16x per step, as the first runs are timer noise.
        growth = min(16.0, 1.2 * min_seconds / max(run["seconds"], 1e-9))
        iterations = max(iterations + 1, int(iterations * growth))
        run = _C._run_peak_probe(kind, iterations)
    rates = [run["gflops"]] + [
        _C._run_peak_probe(kind, iterations)["gflops"] for _ in range(repeats - 1)
    ]
    return max(rates)


def measure_peak_probes(quick: bool) -> Dict[str, float]:
    """{probe kind: GFLOP/s} for every probe this process may run."""
    return {
        kind: peak_probe_rate(kind, 0.05 if quick else 0.2, 3 if quick else 5)
        for kind in peak_probe_kinds()
    }


def peak_probe(kind: str, gflops: float, seconds: float = 0.05) -> Probe:
    """The peak probe of that kind as a Probe of about `seconds` a call at the rate measured,
    for suites.run_case to time round by round with a case. Its wall time includes starting
    the threads, so its rate reads at most the probe's own."""
    per_iteration = _C._run_peak_probe(kind, 1)
    flops = per_iteration["flops_per_iteration"] * per_iteration["threads"]
    iterations = max(1, int(gflops * 1e9 * seconds / flops))
    return Probe(lambda: _C._run_peak_probe(kind, iterations), flops * iterations)


@dataclass
class Peak:
    kind: str  # the probe that set it
    rate: float  # GFLOP/s


def dtype_peak(dtype: torch.dtype, readings: Dict[str, float]) -> Optional[Peak]:
    """The dtype's roofline: the highest reading among the probes of arithmetic that dtype can
    run on (PEAK_PROBES_BY_DTYPE); None when readings has none of them (no probes: not a CPU)."""
    if dtype not in PEAK_PROBES_BY_DTYPE:
        known = ", ".join(str(d) for d in PEAK_PROBES_BY_DTYPE)
        raise ValueError(f"mha_ext.bench: no peak probe for dtype {dtype}; known: {known}")
    valid = {k: v for k, v in readings.items() if k in PEAK_PROBES_BY_DTYPE[dtype]}
    if not valid:
        return None
    kind = max(valid, key=valid.get)
    return Peak(kind, valid[kind])


def peak_key(dtype: torch.dtype) -> str:
    """The key of the dtype's peak among the run's ceilings: "peak_float32"."""
    return f"peak_{str(dtype).replace('torch.', '')}"


def peak_key_of(probe_key: str) -> Optional[str]:
    """The peak key of a case whose probe timed with it is probe_key ("matmul_bfloat16" ->
    "peak_bfloat16"); None for the streaming read, which is its own roofline."""
    return "peak_" + probe_key[len("matmul_") :] if probe_key.startswith("matmul_") else None


@dataclass
class Roofline:
    # The probes suites.run_case times with each case: those of ceilings' keys.
    probes: Dict[str, Probe]
    # "matmul_<dtype>" (GFLOP/s), "stream_read" (GB/s): the probes' rates before the suites;
    # "peak_<dtype>" (GFLOP/s): the dtype's peak, where the device has peak probes.
    ceilings: Dict[str, float]
    peak_readings: Dict[str, float]  # every peak probe's GFLOP/s
    peak_kinds: Dict[str, str]  # "peak_<dtype>" -> the probe that set it


def measure_roofline(dtypes: Iterable[torch.dtype], device: torch.device, quick: bool) -> Roofline:
    """The run's roofline: peak probes (on a CPU; they are CPU loops, so a GPU run has
    torch's matmul as its only reference), then torch's matmul and the streaming read."""
    dtypes = list(dtypes)
    readings = measure_peak_probes(quick) if device.type == "cpu" else {}
    peaks = {peak_key(d): dtype_peak(d, readings) for d in dtypes}
    found = probes(dtypes, device, quick)
    ceilings = measure(found, device, quick)
    ceilings.update({key: peak.rate for key, peak in peaks.items() if peak})
    found.update({key: peak_probe(peak.kind, peak.rate) for key, peak in peaks.items() if peak})
    kinds = {key: peak.kind for key, peak in peaks.items() if peak}
    return Roofline(found, ceilings, readings, kinds)

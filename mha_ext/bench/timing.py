"""Honest timing: warm-up first (memory touched for the first time is slow on many
machines), then the median of several repeats, contenders interleaved repeat by repeat so
drift on a shared machine hits all of them alike. On CUDA, CUDA events time the device and
every measurement synchronises."""

import contextlib
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch


def _elapsed_seconds(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    start_time = time.perf_counter()
    step()
    return time.perf_counter() - start_time


def interleaved_seconds(
    steps: Dict[str, Callable[[], None]],
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device = torch.device("cpu"),
    before_each: Optional[Callable[[], None]] = None,
) -> Dict[str, List[float]]:
    """Wall time (device time on CUDA) of each step in each repeat, the steps run interleaved:
    entry i of every list comes from the same repeat. before_each, untimed, runs before every
    timed step."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if before_each is not None:
                before_each()
            samples[name].append(_elapsed_seconds(step, device))
    return samples


def median_seconds(
    steps: Dict[str, Callable[[], None]],
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device = torch.device("cpu"),
) -> Dict[str, float]:
    """Median wall time (device time on CUDA) of each step, the steps run interleaved."""
    samples = interleaved_seconds(steps, warmup, repeats, device)
    return {name: statistics.median(times) for name, times in samples.items()}


def ratio_range(numerators: List[float], denominators: List[float]) -> Tuple[float, float]:
    """The smallest and largest of the ratios of paired samples (same repeat): how far a
    ratio of medians moved within the run."""
    ratios = [n / d for n, d in zip(numerators, denominators)]
    return min(ratios), max(ratios)


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[List[subprocess.Popen]]:
    """count other processes, each spinning on a core until the block ends: the neighbours of
    a shared machine, which hold a core that a contender's thread then waits for. Every
    contender and probe of a run under it is timed under the same load."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()

"""Side-by-side attention timing: mha_ext against torch SDPA and the textbook reference.

Used by `python -m mha_ext` (the demo) and benchmarks/attention_speed.py. Timing rules:
warm-up runs first (memory touched for the first time is slow), then the contenders run
interleaved, repeat by repeat, so drift on a shared machine hits all of them alike, and each
reports its median.
"""
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from . import functional
from .reference import attention_reference


@dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    backward: bool

    @property
    def flops(self) -> float:
        """4 B H S^2 D for the two forward matmuls, halved when causal; the backward's five
        matmuls add 2.5x the forward."""
        forward = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        forward /= 2 if self.causal else 1
        return forward * (3.5 if self.backward else 1.0)


def _torch_sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _mha_ext_sdpa(q, k, v, causal):
    return functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _reference(q, k, v, causal):
    return attention_reference(q, k, v, causal="top_left" if causal else None)[0]


CONTENDERS: Dict[str, Callable] = {
    "mha_ext": _mha_ext_sdpa,
    "torch_sdpa": _torch_sdpa,
    "reference": _reference,
}


def _step(case: AttentionCase, attend: Callable):
    generator = torch.Generator().manual_seed(0)
    shapes = [(case.batch, h, case.seq, case.head_dim) for h in (case.heads, case.kv_heads, case.kv_heads)]
    q, k, v = (torch.randn(s, generator=generator).to(case.dtype).requires_grad_(case.backward) for s in shapes)
    grad_out = torch.randn(shapes[0], generator=generator).to(case.dtype)

    def step():
        out = attend(q, k, v, case.causal)
        if case.backward:
            out.backward(grad_out)

    return step


def median_seconds(steps: Dict[str, Callable[[], None]], warmup: int = 1, repeats: int = 5) -> Dict[str, float]:
    """Median wall time of each step, the steps run interleaved repeat by repeat."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def time_case(case: AttentionCase, contenders: List[str], warmup: int = 1, repeats: int = 5) -> Dict:
    """Median seconds and GFLOP/s per contender, plus each one's speed relative to torch SDPA."""
    seconds = median_seconds({name: _step(case, CONTENDERS[name]) for name in contenders}, warmup, repeats)
    result = {**asdict(case), "dtype": str(case.dtype).replace("torch.", ""), "results": {}}
    for name in contenders:
        result["results"][name] = {"seconds": seconds[name], "gflops": case.flops / seconds[name] / 1e9}
    if "torch_sdpa" in contenders:
        for entry in result["results"].values():
            entry["speedup_vs_torch_sdpa"] = seconds["torch_sdpa"] / entry["seconds"]
    return result


def format_table(results: List[Dict]) -> str:
    """One line per case: GFLOP/s of each contender, and the ratio to torch SDPA."""
    contenders = list(results[0]["results"])
    header = f"{'case':<40}" + "".join(f"{name + ' GF/s':>17}" for name in contenders)
    header += f"{'mha_ext / torch':>17}" if "torch_sdpa" in contenders else ""
    lines = [header, "-" * len(header)]
    for r in results:
        label = (f"{r['name']} {r['dtype']} S={r['seq']}{' causal' if r['causal'] else ''}"
                 f"{' fwd+bwd' if r['backward'] else ' fwd'}")
        line = f"{label:<40}" + "".join(f"{r['results'][n]['gflops']:>17.1f}" for n in contenders)
        if "torch_sdpa" in contenders:
            line += f"{r['results']['mha_ext']['speedup_vs_torch_sdpa']:>16.2f}x"
        lines.append(line)
    return "\n".join(lines)

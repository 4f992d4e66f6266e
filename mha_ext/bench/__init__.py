"""Benchmarks users can run: `python -m mha_ext.bench` compares mha_ext with torch SDPA and
the textbook attention on this machine, against its own measured roofline."""

from .suites import MODELS, SUITES, Case, attention_case, attention_flops, build_cases, run_case
from .timing import median_seconds

__all__ = [
    "MODELS",
    "SUITES",
    "Case",
    "attention_case",
    "attention_flops",
    "build_cases",
    "median_seconds",
    "run_case",
]

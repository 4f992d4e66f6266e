"""Shared helpers: the accuracy rule, input builders and reruns under a forced CPU ISA."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch

# FlashAttention's accuracy rule: the kernel's max error against the float64 reference may
# be at most FACTOR x the error of plain PyTorch in the same dtype (3x for gradients), plus
# a few units of rounding in the kernels' fp32 accumulation (fp64 for fp64). The floor
# matters where plain PyTorch is exact, e.g. softmax over one key, whose gradient the fused
# backward gets as the difference of two equal fp32 dot products.
OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
ROUNDING_UNITS = 16


def max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return (actual.double() - reference.double()).abs().max().item() if actual.numel() else 0.0


def assert_within_rule(actual, reference64, plain, factor, what):
    """actual: kernel result; reference64: float64 reference; plain: reference computed in
    the kernel's dtype."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    error = max_error(actual, reference64)
    plain_error = max_error(plain, reference64)
    magnitude = reference64.abs().max().item() if reference64.numel() else 0.0
    accumulate_eps = torch.finfo(
        torch.float64 if actual.dtype == torch.float64 else torch.float32
    ).eps
    allowed = factor * plain_error + ROUNDING_UNITS * accumulate_eps * max(magnitude, 1.0)
    assert error <= allowed, (
        f"{what}: max error {error:.3e} exceeds {allowed:.3e} "
        f"({factor}x plain PyTorch's {plain_error:.3e} + rounding)"
    )


def random_qkv(
    batch,
    heads,
    kv_heads,
    seq_q,
    seq_k,
    head_dim,
    head_dim_v=None,
    dtype=torch.float32,
    layout="bhsd",
    seed=0,
):
    """q, k, v as (B, H, S, D) tensors; layout "bshd" gives transposed views of
    (B, S, H, D) storage, as a model's projections produce."""
    generator = seeded_generator(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v

    def make(h, s, d):
        if layout == "bshd":
            return torch.randn(batch, s, h, d, generator=generator).to(dtype).transpose(1, 2)
        return torch.randn(batch, h, s, d, generator=generator).to(dtype)

    return (
        make(heads, seq_q, head_dim),
        make(kv_heads, seq_k, head_dim),
        make(kv_heads, seq_k, head_dim_v),
    )


def seeded_generator(seed):
    """A generator on the current test's device: what it draws lands there, and the same
    seed gives the same data on every call."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_only: tests CPU-specific behaviour (ISA builds, threads, resident memory); "
        "not rerun on CUDA",
    )
    config.addinivalue_line(
        "markers", "cuda_only: tests CUDA-specific behaviour (streams, graphs, kernel choice)"
    )


CUDA_AVAILABLE = torch.cuda.is_available()


@pytest.fixture(
    autouse=True,
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device")),
    ],
)
def device(request):
    """Every test runs once per device. On CUDA, torch's default device is the GPU for the
    test, so the same test code, references and tolerances check the CUDA kernels."""
    if request.param == "cpu":
        if request.node.get_closest_marker("cuda_only"):
            pytest.skip("CUDA-specific test")
        yield torch.device("cpu")
        return
    if request.node.get_closest_marker("cpu_only"):
        pytest.skip("CPU-specific test")
    torch.set_default_device("cuda")
    try:
        yield torch.device("cuda", torch.cuda.current_device())
    finally:
        torch.set_default_device("cpu")


@pytest.fixture
def host_index_checks(monkeypatch):
    """Paged ops on CUDA keep index tensors on the device and guard them in the kernels;
    MHA_EXT_CHECK_INDICES=1 makes them raise the CPU backend's errors for bad values."""
    monkeypatch.setenv("MHA_EXT_CHECK_INDICES", "1")


@pytest.fixture(autouse=True)
def _fixed_seed(device):
    torch.manual_seed(1234)


# ------------------------------------------------------------- reruns under a forced CPU ISA

TESTS_DIR = Path(__file__).resolve().parent
# The kernel build each MHA_EXT_CPU_ISA level runs: avx512_vnni is the avx512 build with its
# VNNI instructions allowed, avx512_bf16 adds its bf16 ones, avx512_amx is the same tuned for
# the CPUs with AMX.
ISA_BUILDS = {
    "generic": "generic",
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512_vnni": "avx512",
    "avx512_bf16": "avx512",
    "avx512_amx": "avx512",
}


def run_python_under_isa(code: str, isa: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `python -c code *args` in tests/ (so the test modules import) under
    MHA_EXT_CPU_ISA=isa, capturing its output as text."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "MHA_EXT_CPU_ISA": isa},
        capture_output=True,
        text=True,
        cwd=TESTS_DIR,
    )


def skip_unless_isa_rerun_adds(isa: str, *, compare_builds: bool) -> None:
    """Skips the calling test unless rerunning tests under MHA_EXT_CPU_ISA=isa can run here
    and covers what the suite does not: not from a suite already forced, not for an ISA this
    platform does not compile or this CPU cannot run, and not for the ISA the suite runs on
    (with compare_builds, for no ISA that runs the same kernel build)."""
    import mha_ext

    if os.environ.get("MHA_EXT_CPU_ISA"):
        pytest.skip("already running under a forced ISA")
    info = mha_ext.build_info()
    if isa not in info["cpu_isas"]:
        pytest.skip(f"{isa} is not compiled on this platform")
    best = info["cpu_isa"]
    if ISA_BUILDS[isa] == ISA_BUILDS[best] if compare_builds else isa == best:
        pytest.skip(f"{isa} runs what this CPU's best ISA {best} runs, which the suite tests")
    # The forced ISA is checked at its first use (build_info or an op), not on import.
    probe = run_python_under_isa("import mha_ext; mha_ext.build_info()", isa)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        pytest.skip(f"this CPU cannot run {isa}: {reason}")


def assert_tests_pass_under_isa(
    isa: Optional[str],
    files: Sequence[str],
    selection: Optional[str] = None,
    min_passed: int = 1,
    env: Optional[dict] = None,
) -> None:
    """Runs pytest on files (in tests/), -k selection where given, in a subprocess under
    MHA_EXT_CPU_ISA=isa (None: the default ISA) and the variables in env; fails with the
    output's tail unless no test fails and at least min_passed pass."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if selection is not None:
        command += ["-k", selection]
    command += [str(TESTS_DIR / name) for name in files]
    variables = {**os.environ, **(env or {})}
    if isa is not None:
        variables["MHA_EXT_CPU_ISA"] = isa
    result = subprocess.run(command, env=variables, capture_output=True, text=True, cwd=TESTS_DIR)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    summary = (result.stdout.strip().splitlines() or [""])[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed, output

"""Run-time CPU ISA dispatch: build_info, the MHA_EXT_CPU_ISA override, and every ISA this CPU
can run passing the accuracy tests."""
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mha_ext

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

TESTS = Path(__file__).resolve().parent
X86 = platform.machine() in ("x86_64", "AMD64")


def run_python(code, isa):
    env = {**os.environ, "MHA_EXT_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_build_info_reports_what_was_compiled():
    info = mha_ext.build_info()
    assert info["version"] == mha_ext.__version__
    assert info["torch_version"] and info["torch_version"] in __import__("torch").__version__
    expected = ["generic", "avx2", "avx512", "avx512_bf16"] if X86 else ["generic"]
    assert info["cpu_isas"] == expected
    assert info["cpu_isa"] in info["cpu_isas"]
    assert isinstance(info["cuda_archs"], list)
    assert (info["cuda_version"] is None) == (info["cuda_archs"] == [])


def test_active_isa_matches_environment():
    forced = os.environ.get("MHA_EXT_CPU_ISA")
    if not forced:
        pytest.skip("MHA_EXT_CPU_ISA is not set in this process")
    assert mha_ext.build_info()["cpu_isa"] == forced


def test_unknown_isa_is_a_clear_error():
    result = run_python("import mha_ext; mha_ext.build_info()", "sse9")
    assert result.returncode != 0
    assert "MHA_EXT_CPU_ISA=sse9 is not one of the compiled ISAs (generic" in result.stderr


# Under each forced ISA: the forward of every dtype and masking at one odd shape (bf16 with an
# even head dim: the brgemm forward at avx512_bf16), the backward at one small shape (bf16's on
# brgemm there), the fp64 gradchecks, dropout's forward and gradients, and paged attention with
# a bf16 cache, decode and up to 9 queries (the bf16 dot products of avx512_bf16's direct path).
FORCED_ISA_SELECTION = " or ".join([
    "active_isa_matches_environment",
    "(forward_matches_reference and 113x203 and not h8kv8)",
    "(backward_matches_reference and 17x17)",
    "gradcheck",
    "forward_and_gradients_use_the_regenerated_mask",
    "(every_row_count_of_the_direct_path and bfloat16)",
    "(decode_tasks_of_several_kv_heads and bfloat16 and 2-gqa)",
    "paged_attention_dtypes",
])


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512_bf16"])
def test_forced_isa_passes_the_accuracy_tests(isa):
    if os.environ.get("MHA_EXT_CPU_ISA"):
        pytest.skip("already running under a forced ISA")
    info = mha_ext.build_info()
    if isa not in info["cpu_isas"]:
        pytest.skip(f"{isa} is not compiled on this platform")
    if isa == info["cpu_isa"]:
        pytest.skip(f"{isa} is this CPU's best ISA, which the whole suite runs on")
    probe = run_python("import mha_ext; mha_ext.build_info()", isa)
    if probe.returncode != 0:
        pytest.skip(f"this CPU cannot run {isa}: {probe.stderr.strip().splitlines()[-1]}")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", FORCED_ISA_SELECTION,
         str(TESTS / "test_isa.py"), str(TESTS / "test_attention.py"), str(TESTS / "test_dropout.py"),
         str(TESTS / "test_paged.py")],
        env={**os.environ, "MHA_EXT_CPU_ISA": isa}, capture_output=True, text=True, cwd=TESTS,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", result.stdout.splitlines()[-1])
    assert passed and int(passed.group(1)) > 1, result.stdout[-3000:]


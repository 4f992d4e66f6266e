"""Run-time CPU ISA dispatch: build_info, the MHA_EXT_CPU_ISA override, and the portable
build passing the accuracy tests on a machine that has AVX-512."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mha_ext

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

TESTS = Path(__file__).resolve().parent


def run_python(code, isa):
    env = {**os.environ, "MHA_EXT_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_build_info_reports_what_was_compiled():
    info = mha_ext.build_info()
    assert info["version"] == mha_ext.__version__
    assert info["torch_version"] and info["torch_version"] in __import__("torch").__version__
    assert "generic" in info["cpu_isas"]
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


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_forced_isa_passes_the_accuracy_tests(isa):
    if os.environ.get("MHA_EXT_CPU_ISA"):
        pytest.skip("already running under a forced ISA")
    if isa not in mha_ext.build_info()["cpu_isas"]:
        pytest.skip(f"{isa} is not compiled on this platform")
    probe = run_python("import mha_ext; mha_ext.build_info()", isa)
    if probe.returncode != 0:
        pytest.skip(f"this CPU cannot run {isa}: {probe.stderr.strip().splitlines()[-1]}")
    selection = "active_isa_matches_environment or (forward and 113x203 and not h8kv8) or (backward and 17x17) or gradcheck"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
         str(TESTS / "test_isa.py"), str(TESTS / "test_attention.py"), str(TESTS / "test_dropout.py")],
        env={**os.environ, "MHA_EXT_CPU_ISA": isa}, capture_output=True, text=True, cwd=TESTS,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "1 passed" not in result.stdout.splitlines()[-1]

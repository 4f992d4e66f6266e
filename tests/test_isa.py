"""Run-time CPU ISA dispatch: build_info, the MHA_EXT_CPU_ISA override, every ISA this CPU can
run passing the accuracy tests, and the ISA builds keeping their instructions to themselves."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import mha_ext

from conftest import (
    ISA_BUILDS,
    assert_tests_pass_under_isa,
    run_python_under_isa,
    skip_unless_isa_rerun_adds,
)

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
X86 = platform.machine() in ("x86_64", "AMD64")


def test_build_info_reports_what_was_compiled():
    info = mha_ext.build_info()
    assert info["version"] == mha_ext.__version__
    assert info["torch_version"] and info["torch_version"] in __import__("torch").__version__
    expected = ["generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx512_amx"]
    expected = expected if X86 else ["generic"]
    assert info["cpu_isas"] == expected
    assert info["cpu_isa"] in info["cpu_isas"]
    assert isinstance(info["cpu_vbmi"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert (info["cuda_version"] is None) == (info["cuda_archs"] == [])


def test_active_isa_matches_environment():
    forced = os.environ.get("MHA_EXT_CPU_ISA")
    if not forced:
        pytest.skip("MHA_EXT_CPU_ISA is not set in this process")
    assert mha_ext.build_info()["cpu_isa"] == forced


# The flags Linux reports for each level's features (/proc/cpuinfo), each level's on top of
# the one before.
ISA_FLAGS = {
    "avx2": {"avx2", "fma", "bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_vnni": {"avx512_vnni"},
    "avx512_bf16": {"avx512_bf16"},
    "avx512_amx": {"amx_bf16", "amx_tile"},
}


def test_default_isa_is_the_best_the_cpu_flags_allow():
    # The levels read cpuid themselves (cpu/isa.cpp); Linux lists the same bits by name (the
    # AMX ones since 5.16), so a wrong bit or a missing feature check shows here.
    if os.environ.get("MHA_EXT_CPU_ISA"):
        pytest.skip("MHA_EXT_CPU_ISA is set in this process")
    if not X86 or not Path("/proc/cpuinfo").exists():
        pytest.skip("needs x86-64 Linux")
    if tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2]) < (5, 16):
        pytest.skip("Linux before 5.16 does not list the AMX flags")
    flags_line = next(
        line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
    )
    flags = set(flags_line.split(":", 1)[1].split())
    expected = "generic"
    for isa, needed in ISA_FLAGS.items():
        if not needed <= flags:
            break
        expected = isa
    assert mha_ext.build_info()["cpu_isa"] == expected


def test_isa_beyond_this_cpu_is_a_clear_error():
    # The levels above the one chosen by default are those this CPU lacks (on a Zen 4 or 5:
    # avx512_amx); forcing one names it.
    if os.environ.get("MHA_EXT_CPU_ISA"):
        pytest.skip("MHA_EXT_CPU_ISA is set in this process")
    info = mha_ext.build_info()
    beyond = info["cpu_isas"][info["cpu_isas"].index(info["cpu_isa"]) + 1 :]
    if not beyond:
        pytest.skip(f"this CPU runs every compiled ISA up to {info['cpu_isa']}")
    result = run_python_under_isa("import mha_ext; mha_ext.build_info()", beyond[-1])
    assert result.returncode != 0
    expected = f"MHA_EXT_CPU_ISA={beyond[-1]} but this CPU does not support {beyond[-1]}"
    assert expected in result.stderr


def vbmi_reported_with(setting):
    """The completed run of a child that prints build_info()'s cpu_vbmi under
    MHA_EXT_CPU_VBMI=setting."""
    return subprocess.run(
        [sys.executable, "-c", "import mha_ext; print(mha_ext.build_info()['cpu_vbmi'])"],
        env={**os.environ, "MHA_EXT_CPU_VBMI": setting},
        capture_output=True,
        text=True,
    )


def test_vbmi_setting_is_checked_and_follows_the_cpu_flags():
    bad = vbmi_reported_with("yes")
    assert bad.returncode != 0
    assert "MHA_EXT_CPU_VBMI=yes is neither 0 nor 1" in bad.stderr
    off = vbmi_reported_with("0")
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    if os.environ.get("MHA_EXT_CPU_ISA") or os.environ.get("MHA_EXT_CPU_VBMI"):
        return
    if not X86 or not Path("/proc/cpuinfo").exists():
        assert mha_ext.build_info()["cpu_vbmi"] is False
        return
    # The VBMI paths run from the avx512_vnni level on, where Linux lists the CPU's VBMI.
    flags_line = next(
        line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
    )
    flags = set(flags_line.split(":", 1)[1].split())
    level = mha_ext.build_info()["cpu_isa"]
    expected = "avx512vbmi" in flags and level in ("avx512_vnni", "avx512_bf16", "avx512_amx")
    assert mha_ext.build_info()["cpu_vbmi"] == expected


def test_unknown_isa_is_a_clear_error():
    result = run_python_under_isa("import mha_ext; mha_ext.build_info()", "sse9")
    assert result.returncode != 0
    assert "MHA_EXT_CPU_ISA=sse9 is not one of the compiled ISAs (generic" in result.stderr


# Under each forced ISA: the forward of every dtype and masking at one odd shape (bf16 with an
# even head dim: the brgemm forward at avx512_bf16), the backward at one small shape (bf16's on
# brgemm there), the fp64 gradchecks, dropout's forward and gradients, and paged attention with
# a bf16 cache, decode and up to 9 queries (the bf16 dot products of avx512_bf16's direct path,
# FMAs at avx512_amx).
FORCED_ISA_SELECTION = " or ".join(
    [
        "active_isa_matches_environment",
        "(forward_matches_reference and 113x203 and not h8kv8)",
        "(backward_matches_reference and 17x17)",
        "gradcheck",
        "forward_and_gradients_use_the_regenerated_mask",
        "(every_row_count_of_the_direct_path and bfloat16)",
        "(decode_tasks_of_several_kv_heads and bfloat16 and 2-gqa)",
        "paged_attention_dtypes",
    ]
)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512_bf16", "avx512_amx"])
def test_forced_isa_passes_the_accuracy_tests(isa):
    skip_unless_isa_rerun_adds(isa, compare_builds=False)
    selection = FORCED_ISA_SELECTION
    # avx512, avx512_bf16 and avx512_amx are levels of one build that differ only in how they
    # run bf16: forced to a level the suite does not run on, the bf16 cases take other paths.
    if ISA_BUILDS[isa] == ISA_BUILDS[mha_ext.build_info()["cpu_isa"]]:
        selection = f"active_isa_matches_environment or (bfloat16 and ({FORCED_ISA_SELECTION}))"
    files = ("test_isa.py", "test_attention.py", "test_dropout.py", "test_paged.py")
    assert_tests_pass_under_isa(isa, files, selection, min_passed=2)


# ------------------------------------------------ what the ISA builds leave to the linker

# An instruction beyond x86-64's baseline (SSE2): VEX / EVEX encoded (AVX, AVX2, FMA, F16C,
# AVX-512 and its mask registers), or BMI / BMI2, LZCNT, POPCNT, MOVBE, CRC32 (SSE4.2).
BEYOND_BASELINE = re.compile(
    r"^(v(?!err$|erw$)\w+"
    r"|k(and|andn|mov|not|or|ortest|shiftl|shiftr|test|unpck|xnor|xor|add)[bwdq]"
    r"|andn|bextr|blsi|blsmsk|blsr|bzhi|lzcnt|tzcnt|mulx|pdep|pext|rorx|sarx|shlx|shrx"
    r"|popcnt|movbe|crc32)$"
)
PREFIXES = {
    "lock",
    "rep",
    "repz",
    "repe",
    "repnz",
    "repne",
    "bnd",
    "notrack",
    "data16",
    "addr32",
    "cs",
    "ds",
    "es",
    "fs",
    "gs",
    "ss",
}


def compile_isa_build(source, obj):
    """Starts compiling csrc/cpu/kernels/<source> as setup.py does, but at -Og.

    -Og inlines the least of the levels that compile these kernels (at -O0 the intrinsics that
    take immediates do not compile), so every inline function a build calls is left out of
    line, as a debug build or another inliner would leave it: the check below sees every
    function a build could hand the linker, not only those -O3 happened to keep (at -O3 the
    shared headers' functions were all inlined, whatever namespace they were in).
    """
    includes = [ROOT / "csrc" / "include", ROOT / "csrc", *cpp_extension.include_paths()]
    command = [
        os.environ.get("CXX", "c++"),
        "-Og",
        "-std=c++20",
        "-fPIC",
        "-fopenmp",
        "-w",
        "-c",
        str(ROOT / "csrc" / "cpu" / "kernels" / source),
        "-o",
        str(obj),
    ]
    command += [f"-I{path}" for path in includes]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def output_of(command, stdin=None):
    return subprocess.run(command, input=stdin, capture_output=True, text=True, check=True).stdout


def shared_code_beyond_baseline(obj, namespace):
    """{function: its first instruction beyond the baseline} for the functions obj defines
    with external linkage outside `namespace` (C++ names, demangled)."""
    listing = output_of(["nm", "--defined-only", str(obj)])
    # T: global code, W: weak (inline functions, templates), i: indirect functions.
    code = [
        fields[2]
        for fields in map(str.split, listing.splitlines())
        if len(fields) == 3 and fields[1] in "TWi"
    ]
    demangled = output_of(["c++filt"], "\n".join(code)).splitlines()
    own = re.compile(rf"(^|[^\w]){namespace}::")
    shared = {symbol: name for symbol, name in zip(code, demangled) if not own.search(name)}
    found, function = {}, None
    for line in output_of(["objdump", "-d", "--no-show-raw-insn", str(obj)]).splitlines():
        header = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if header:
            function = header.group(1)
            continue
        if function not in shared or shared[function] in found or ":\t" not in line:
            continue
        words = line.split(":\t", 1)[1].split()
        mnemonic = next((word for word in words if word not in PREFIXES), "")
        if BEYOND_BASELINE.match(mnemonic):
            found[shared[function]] = line.split(":\t", 1)[1].strip()
    return found


@pytest.mark.skipif(not X86, reason="the AVX2 and AVX-512 builds are compiled on x86-64 only")
def test_isa_builds_share_only_code_every_cpu_runs(tmp_path):
    # Where several kernel builds define the same function with external linkage, the linker
    # keeps one copy for every caller: the portable build, the host code, a CPU without the
    # instructions the copy was compiled with. So a build may define functions outside its
    # namespace (AVX2 / AVX512: its kernels, at::vec's, the shared headers' mha_ext/macros.h
    # puts there) only where they run on every x86-64 CPU, which is how baseline_headers.h
    # compiles the standard library's and torch's.
    builds = {"kernels_avx2.cpp": "AVX2", "kernels_avx512.cpp": "AVX512"}
    compiles = {source: compile_isa_build(source, tmp_path / f"{source}.o") for source in builds}
    for source, process in compiles.items():
        output, _ = process.communicate()
        assert process.returncode == 0, f"{source} did not compile:\n{output[-3000:]}"
    problems = []
    for source, namespace in builds.items():
        found = shared_code_beyond_baseline(tmp_path / f"{source}.o", namespace)
        problems += [f"{source}: {name} ({first})" for name, first in sorted(found.items())]
    assert not problems, (
        "functions other builds could get, with instructions beyond x86-64's "
        "baseline:\n" + "\n".join(problems)
    )

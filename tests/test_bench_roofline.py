"""The roofline of mha_ext.bench: the extension's peak probes (which ones a CPU and
MHA_EXT_CPU_ISA allow, what they return), each dtype's peak chosen from them, and the
fractions the suites and their tables report. Correctness only: no test asserts a time."""

import functools
import json
import math

import pytest
import torch

import mha_ext
from mha_ext import _C
from mha_ext.bench import report, roofline, suites, timing

from conftest import run_python_under_isa

# The probes are CPU loops, and a GPU run has none.
pytestmark = pytest.mark.cpu_only

ALL_KINDS = roofline.FP32_PEAK_PROBES + roofline.BF16_PEAK_PROBES


# Run with MHA_EXT_CPU_ISA set: the probes the process lists, and what running the AVX2 one
# does there.
CHILD = """
import json, mha_ext
kinds = mha_ext._C._peak_probe_kinds()
try:
    mha_ext._C._run_peak_probe("fp32_fma_avx2", 10)
    refused = None
except ValueError as error:
    refused = str(error)
print(json.dumps({"kinds": kinds, "avx2_refused": refused}))
"""


@functools.lru_cache(maxsize=None)
def under_isa(isa):
    """CHILD's answer with MHA_EXT_CPU_ISA=isa; None where this CPU lacks the ISA."""
    result = run_python_under_isa(CHILD, isa)
    if result.returncode != 0 and (
        "this CPU does not support" in result.stderr or "not one of the compiled" in result.stderr
    ):
        return None
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "isa, expected",
    [
        ("generic", ["fp32_portable"]),
        ("avx2", ["fp32_portable", "fp32_fma_avx2"]),
        ("avx512", ["fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512"]),
        ("avx512_vnni", ["fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512"]),
    ],
)
def test_forced_isa_lists_only_its_probes(isa, expected):
    answer = under_isa(isa)
    if answer is None:
        pytest.skip(f"this build or CPU cannot run MHA_EXT_CPU_ISA={isa}")
    assert answer["kinds"] == expected


@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512_amx"])
def test_bf16_probes_need_the_avx512_bf16_level(isa):
    answer = under_isa(isa)
    if answer is None:
        pytest.skip(f"this CPU cannot run MHA_EXT_CPU_ISA={isa}")
    kinds = answer["kinds"]
    assert kinds[:4] == ["fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512"]
    assert kinds[4:] in ([], ["bf16_amx"])  # AMX where the CPU has it and Linux grants it


def test_this_process_lists_known_kinds_portable_first():
    kinds = _C._peak_probe_kinds()
    assert kinds[0] == "fp32_portable"
    assert set(kinds) <= set(ALL_KINDS)
    assert kinds == [k for k in ALL_KINDS if k in kinds]  # in the documented order


@pytest.mark.parametrize("kind", _C._peak_probe_kinds())
def test_probe_returns_a_positive_finite_rate_of_its_own_flops(kind):
    run = _C._run_peak_probe(kind, 2000)
    assert run["threads"] == torch.get_num_threads() and run["iterations"] == 2000
    assert run["flops_per_iteration"] > 0 and run["seconds"] > 0
    assert math.isfinite(run["gflops"]) and run["gflops"] > 0
    flops = run["flops_per_iteration"] * run["iterations"] * run["threads"]
    assert run["gflops"] == pytest.approx(flops / run["seconds"] / 1e9)


def test_one_thread_runs_one_loop():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        run = _C._run_peak_probe("fp32_portable", 1000)
    finally:
        torch.set_num_threads(threads)
    assert run["threads"] == 1
    assert run["gflops"] == pytest.approx(run["flops_per_iteration"] * 1000 / run["seconds"] / 1e9)


def test_amx_probe_leaves_bf16_attention_working():
    # The probe configures AMX tiles on the threads that torch's brgemm (mha_ext's bf16
    # forward) also configures: after it, the kernels must still compute right.
    if "bf16_amx" not in _C._peak_probe_kinds():
        pytest.skip("no AMX here")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=generator).to(torch.bfloat16) for _ in "qkv")
    before = mha_ext.scaled_dot_product_attention(q, k, v)
    _C._run_peak_probe("bf16_amx", 1000)
    after = mha_ext.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_probe_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown peak probe 'fp64_fma'; known: fp32_portable"):
        _C._run_peak_probe("fp64_fma", 10)
    with pytest.raises(ValueError, match="iterations must be at least 1, got 0"):
        _C._run_peak_probe("fp32_portable", 0)


def test_probe_the_isa_leaves_out_is_refused():
    assert under_isa("generic")["avx2_refused"] == (
        "mha_ext: peak probe fp32_fma_avx2 cannot run here (CPU ISA generic); "
        "available: fp32_portable"
    )


READINGS = {
    "fp32_portable": 40.0,
    "fp32_fma_avx2": 116.0,
    "fp32_fma_avx512": 225.0,
    "bf16_dot_avx512": 109.0,
    "bf16_amx": 3175.0,
}


def test_fp32_peak_is_the_fastest_fp32_probe():
    assert roofline.dtype_peak(torch.float32, READINGS) == roofline.Peak("fp32_fma_avx512", 225.0)
    # fp16 has no probe of its own: the kernels compute it in fp32
    assert roofline.dtype_peak(torch.float16, READINGS) == roofline.Peak("fp32_fma_avx512", 225.0)


def test_bf16_peak_is_the_fastest_probe_bf16_can_run_on():
    assert roofline.dtype_peak(torch.bfloat16, READINGS) == roofline.Peak("bf16_amx", 3175.0)
    no_amx = {k: v for k, v in READINGS.items() if k != "bf16_amx"}
    # VDPBF16PS at half the FMA rate (a Xeon): bf16 converted to fp32 is the faster way
    assert roofline.dtype_peak(torch.bfloat16, no_amx) == roofline.Peak("fp32_fma_avx512", 225.0)


def test_bf16_peak_without_bf16_instructions_is_the_fp32_rate():
    avx2_only = {"fp32_portable": 40.0, "fp32_fma_avx2": 116.0}
    assert roofline.dtype_peak(torch.bfloat16, avx2_only) == roofline.Peak("fp32_fma_avx2", 116.0)
    assert roofline.dtype_peak(torch.bfloat16, {}) is None  # no probes: a GPU run
    with pytest.raises(ValueError, match="no peak probe for dtype torch.float64"):
        roofline.dtype_peak(torch.float64, READINGS)


def test_peak_probe_rate_is_the_fastest_run_of_a_long_enough_loop(monkeypatch):
    # Fake probe: 1 us per iteration, 1 GFLOP per iteration; the repeats read 900, 1000 and
    # 950 GFLOP/s in turn once the loop is long enough.
    calls = []
    repeat_rates = iter([900.0, 1000.0, 950.0])

    def fake_run(kind, iterations):
        calls.append(iterations)
        seconds = iterations * 1e-6
        gflops = next(repeat_rates) if seconds >= 0.05 else 1.0
        return {"seconds": seconds, "gflops": gflops}

    monkeypatch.setattr(roofline._C, "_run_peak_probe", fake_run)
    assert roofline.peak_probe_rate("fp32_portable", min_seconds=0.05, repeats=3) == 1000.0
    assert all(c * 1e-6 < 0.05 for c in calls[:-3]) and all(c * 1e-6 >= 0.05 for c in calls[-3:])
    assert len(set(calls[-3:])) == 1  # the repeats run the length found


def test_dtype_peak_uses_this_cpus_probes():
    threads = torch.get_num_threads()
    readings = {kind: roofline.peak_probe_rate(kind, 0.001, 1) for kind in _C._peak_probe_kinds()}
    assert torch.get_num_threads() == threads
    fp32 = roofline.dtype_peak(torch.float32, readings)
    bf16 = roofline.dtype_peak(torch.bfloat16, readings)
    assert fp32.rate == max(v for k, v in readings.items() if k in roofline.FP32_PEAK_PROBES)
    assert bf16.rate == max(readings.values())


def fake_timed_case(monkeypatch, mha_seconds, probe_seconds):
    case = suites.attention_case(
        "forward", "tiny", 2, 2, 32, 64, torch.float32, False, False, torch.device("cpu")
    )
    step_seconds = {
        "mha_ext": mha_seconds,
        "torch_sdpa": 2 * mha_seconds,
        "naive": 4 * mha_seconds,
        suites.ROOFLINE_PROBE: probe_seconds,
    }
    monkeypatch.setattr(
        suites,
        "interleaved_seconds",
        lambda steps, warmup, repeats, device, before_each=None: {
            name: [step_seconds.get(name, 1.0)] for name in steps
        },
    )
    return case


def test_case_reports_peak_and_torch_matmul_fractions(monkeypatch):
    case = fake_timed_case(monkeypatch, 0.001, 2.0)
    throughput = case.work / 0.001 / 1e9
    result = suites.run_case(
        case,
        {"matmul_float32": 1000.0, "peak_float32": 4 * throughput},
        torch.device("cpu"),
        repeats=1,
        probes={"matmul_float32": roofline.Probe(lambda: None, 4e9)},
    )
    mha = result["results"]["mha_ext"]
    assert mha["peak_fraction"] == pytest.approx(0.25)
    assert mha["roofline_fraction"] == pytest.approx(throughput / 2.0)  # the matmul with it
    assert result["peak"] == "peak_float32" and result["peak_rate"] == 4 * throughput


@pytest.mark.parametrize("with_case_gflops, peak", [(8.0, 8.0), (2.0, 5.0)])
def test_peak_probe_timed_with_the_case_counts_where_it_read_higher(
    monkeypatch, with_case_gflops, peak
):
    # The run's peak read 5 GFLOP/s before the suites; timed round by round with the case the
    # probe reads with_case_gflops (its 1 GFLOP in 1 / with_case_gflops s): the higher counts.
    case = fake_timed_case(monkeypatch, 0.001, 2.0)
    calls = []
    timed = suites.interleaved_seconds

    def recording(steps, warmup, repeats, device, before_each=None):
        calls.append((list(steps), before_each))
        return {
            **timed(steps, warmup, repeats, device, before_each),
            suites.PEAK_PROBE: [1 / with_case_gflops],
        }

    monkeypatch.setattr(suites, "interleaved_seconds", recording)
    probes = {
        "matmul_float32": roofline.Probe(lambda: None, 4e9),
        "peak_float32": roofline.Probe(lambda: None, 1e9),
    }
    result = suites.run_case(
        case, {"matmul_float32": 1.0, "peak_float32": 5.0}, torch.device("cpu"), 1, probes
    )
    # Every step, the probes' too, follows an untimed run of the case's probe: none starts
    # colder than the others.
    steps = ["mha_ext", "torch_sdpa", "naive", suites.ROOFLINE_PROBE, suites.PEAK_PROBE]
    assert calls == [(steps, probes["matmul_float32"].step)]
    assert result["peak_rate"] == pytest.approx(peak)
    assert suites.PEAK_PROBE not in result["results"]
    throughput = case.work / 0.001 / 1e9
    assert result["results"]["mha_ext"]["peak_fraction"] == pytest.approx(throughput / peak)


def test_a_case_faster_than_the_peak_is_reported_not_clamped(monkeypatch):
    case = fake_timed_case(monkeypatch, 0.001, 2.0)
    throughput = case.work / 0.001 / 1e9
    result = suites.run_case(
        case, {"matmul_float32": 1.0, "peak_float32": throughput / 2}, torch.device("cpu"), 1
    )
    assert result["results"]["mha_ext"]["peak_fraction"] == pytest.approx(2.0)


def test_case_without_a_peak_has_no_peak_fraction(monkeypatch):
    case = fake_timed_case(monkeypatch, 0.001, 2.0)
    result = suites.run_case(case, {"matmul_float32": 1.0}, torch.device("cpu"), 1)
    assert "peak_fraction" not in result["results"]["mha_ext"] and result["peak"] is None


def test_tables_show_peak_and_torch_matmul_for_flops_and_stream_read_for_bytes():
    def result(suite, unit, key, fractions):
        mha = {"throughput": 1.0, "seconds_per_call": 1.0, "speedup_vs_baseline": 1.5}
        return {
            "suite": suite,
            "label": f"{suite} case",
            "params": {},
            "unit": unit,
            "roofline": key,
            "roofline_rate": 10.0,
            "peak_rate": 500.0 if key != "stream_read" else None,
            "baseline": "torch_sdpa",
            "results": {"mha_ext": {**mha, **fractions}, "torch_sdpa": mha},
            "unsupported": {},
        }

    ceilings = {"matmul_float32": 300.0, "peak_float32": 450.0, "stream_read": 25.0}
    flops = result(
        "forward", "GFLOP/s", "matmul_float32", {"roofline_fraction": 0.9, "peak_fraction": 0.6}
    )
    table = report.format_suite("forward", [flops], ceilings, {"peak_float32": "fp32_fma_avx512"})
    header, row = table.splitlines()[1], table.splitlines()[3]
    assert "mha_ext % peak" in header and "% torch matmul" in header
    assert "stream read" not in header
    assert row.split()[-2:] == ["60%", "90%"]
    assert (
        "peak_float32 = 450.0 GFLOP/s (fp32_fma_avx512; with the case: 500.0), "
        "torch matmul_float32 = 300.0 GFLOP/s (with the case: 10.0)" in table
    )
    decode = result("paged_decode", "GB/s", "stream_read", {"roofline_fraction": 0.7})
    table = report.format_suite("paged_decode", [decode], ceilings)
    header, row = table.splitlines()[1], table.splitlines()[3]
    assert "mha_ext % stream read" in header and "peak" not in header
    assert row.split()[-1] == "70%"


def test_roofline_summary_names_each_probe_and_the_peaks_source():
    measured = roofline.Roofline(
        probes={},
        ceilings={"matmul_bfloat16": 1800.0, "stream_read": 30.0, "peak_bfloat16": 6000.0},
        peak_readings={"fp32_portable": 80.0, "bf16_amx": 6000.0},
        peak_kinds={"peak_bfloat16": "bf16_amx"},
    )
    text = report.format_roofline(measured)
    assert "peak probes (GFLOP/s, all threads): fp32_portable 80.0, bf16_amx 6000.0" in text
    assert "torch matmul_bfloat16 1800.0 GFLOP/s" in text
    assert "peak_bfloat16 6000.0 GFLOP/s (bf16_amx)" in text and "stream_read 30.0 GB/s" in text


def test_decode_times_the_streaming_read_in_rounds_with_it(monkeypatch):
    # One interleaved_seconds call for the decode contenders and the streaming read: it runs
    # them round by round, so a neighbour's load hits both alike.
    monkeypatch.setattr(suites, "cpu_cache_bytes", lambda: 0)  # one layer: a small cache
    case = suites._decode_case("tiny", 4, 2, 32, 64, torch.float32, torch.device("cpu"), batch=2)
    calls = []

    def fake_interleaved_seconds(steps, warmup, repeats, device, before_each=None):
        calls.append(list(steps))
        return {name: [0.001] for name in steps}

    monkeypatch.setattr(suites, "interleaved_seconds", fake_interleaved_seconds)
    probes = {"stream_read": roofline.Probe(lambda: None, 2e6)}
    result = suites.run_case(case, {"stream_read": 1.0}, torch.device("cpu"), 1, probes)
    assert case.interleave and len(calls) == 1
    assert calls[0][0] == "mha_ext" and calls[0][-1] == suites.ROOFLINE_PROBE
    assert result["roofline_rate"] == pytest.approx(2.0)  # 2e6 bytes in 1 ms
    assert result["results"]["mha_ext"]["roofline_fraction"] == pytest.approx(
        case.work / 0.001 / 1e9 / 2.0
    )
    assert result["peak"] is None and "peak_fraction" not in result["results"]["mha_ext"]


def test_before_each_runs_ahead_of_every_timed_step_outside_its_timing(monkeypatch):
    # The flatness case's eviction (cold_steps) precedes each step, the warm-up excepted, and is
    # not inside any step's timed call.
    order = []

    def recording_elapsed(step, device):
        order.append("timed start")
        step()
        return 0.0

    monkeypatch.setattr(timing, "_elapsed_seconds", recording_elapsed)
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    samples = timing.interleaved_seconds(
        steps, warmup=1, repeats=2, before_each=lambda: order.append("evict")
    )
    assert order == ["a", "b"] + ["evict", "timed start", "a", "evict", "timed start", "b"] * 2
    assert samples == {"a": [0.0, 0.0], "b": [0.0, 0.0]}

"""The flex suite (mha_ext against FlexAttention) runs its cases, checks FlexAttention's output
against mha_ext's before timing it, and reports a contender that fails or disagrees instead of
timing it. FlexAttention is compiled with torch.compile's eager backend here: inductor's C++
compile of each case takes minutes on 2 cores, and what these tests check is the suite."""

import json

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from mha_ext.bench import flex, report, roofline, suites
from mha_ext.bench.__main__ import main as bench_main
from mha_ext.bench.__main__ import parse_args

CPU = torch.device("cpu")
SEQ = 384  # past the window of 256 keys, so that the window case masks keys
CONTEXT = 256  # two pages of 128 tokens per sequence


@pytest.fixture(autouse=True)
def _small_eager_flex(monkeypatch):
    monkeypatch.setattr(flex, "FLEX_BACKEND", "eager")
    # No CPU cache to overflow: one layer per decode case instead of the hundreds a small
    # context needs to fill twice this VM's reported 480 MiB L3.
    monkeypatch.setattr(flex, "cpu_cache_bytes", lambda: 0)
    monkeypatch.setattr(roofline, "cpu_cache_bytes", lambda: 0)  # --quick's 256 MiB read
    # Fewer heads: eager FlexAttention is torch's reference, seconds a call at the real shapes.
    monkeypatch.setattr(flex, "PREFILL_SHAPE", ("h2-d64", 1, 2, 2, 64))
    monkeypatch.setattr(flex, "DECODE_SHAPE", ("gqa-4q-2kv", 4, 2, 64))


def test_flex_suite_is_named_only():
    assert "flex" not in parse_args([]).suite
    assert "flex" not in parse_args(["--quick"]).suite
    assert parse_args(["--suite", "flex"]).suite == ["flex"]


@pytest.mark.cpu_only  # the bench runs on --device cpu either way
def test_flex_suite_checks_then_times_each_case(tmp_path, capsys):
    arguments = ["--suite", "flex", "--seq", str(SEQ), "--context", str(CONTEXT)]
    arguments += ["--decode-batch", "2", "--dtype", "float32", "bfloat16", "--quick"]
    bench_main([*arguments, "--repeats", "1", "--no-plots", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    cases = json.loads((tmp_path / "results.json").read_text())["results"]
    expected = [(dtype, kind) for dtype in ("float32", "bfloat16") for kind in flex.PREFILL_CASES]
    expected.insert(3, ("float32", "decode"))
    expected.append(("bfloat16", "decode"))
    assert [(c["params"]["dtype"], c["params"]["case"]) for c in cases] == expected
    for case in cases:
        assert case["unsupported"] == {}, case["label"]
        assert case["baseline"] == "flex" and set(case["results"]) == {"mha_ext", "flex"}
        timed = case["results"]
        ratio = timed["flex"]["seconds_per_call"] / timed["mha_ext"]["seconds_per_call"]
        assert timed["mha_ext"]["speedup_vs_baseline"] == pytest.approx(ratio)
        atol, rtol = flex.TOLERANCE[getattr(torch, case["params"]["dtype"])]
        assert 0 <= case["checks"]["flex_max_difference"] <= atol + rtol * 10
        assert case["checks"]["flex_compile_seconds"] > 0
    windows = [c["params"].get("window") for c in cases if c["params"]["case"] == "window"]
    assert windows == [[flex.WINDOW_LEFT, 0]] * 2
    assert "mha_ext / flex" in stdout and "flex compile s" in stdout
    # the fraction columns the other tables print: prefill of the dtype's peak and of torch's
    # matmul, decode of the streaming read, each in its own column
    table = stdout[stdout.index("against FlexAttention") :].splitlines()
    header = table[1]
    for column in (report.PEAK_COLUMN, report.MATMUL_COLUMN, report.STREAM_COLUMN):
        assert f" {column}" in header  # apart from the column before it
    stream_end = header.index(report.STREAM_COLUMN) + len(report.STREAM_COLUMN)
    peak_end = header.index(report.PEAK_COLUMN) + len(report.PEAK_COLUMN)
    rows = [
        line for line in table[3:] if line.startswith(("causal", "window", "softcap", "decode"))
    ]
    assert len(rows) == len(cases)
    for row in rows:
        decode = row.startswith("decode")
        assert row[stream_end - 1] == ("%" if decode else " "), row
        assert row[peak_end - 1] == (" " if decode else "%"), row


def _run_and_format(case):
    """The case's result and the suite's table of it."""
    roofline = {"matmul_float32": 1.0}
    result = suites.run_case(case, roofline, CPU, repeats=1)
    return result, report.format_suite("flex", [result], roofline)


@pytest.mark.parametrize("kind", flex.PREFILL_CASES)
def test_flex_output_that_differs_from_mha_ext_is_reported_not_timed(kind, monkeypatch):
    real = torch_flex.flex_attention

    def off_by_a_little(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 0.01 * out.abs().max()

    monkeypatch.setattr(torch_flex, "flex_attention", off_by_a_little)
    case = flex._prefill_case(kind, 128, torch.float32, CPU)
    assert set(case.steps) == {"mha_ext"}
    result, table = _run_and_format(case)
    assert result["unsupported"]["flex"].startswith("output differs from mha_ext's")
    assert set(result["results"]) == {"mha_ext"}
    row = table.splitlines()[3]
    assert row.startswith(case.label) and "n/a" in row and "output differs" in row


def test_flex_decode_output_check_catches_a_wrong_page(monkeypatch):
    """FlexAttention reading the pages of one sequence for every sequence: the check must see
    that the outputs of the others differ."""
    real = torch_flex.flex_attention

    def first_sequence_for_all(q, k, v, *args, **kwargs):
        out = real(q, k, v, *args, **kwargs)  # (B, H, 1, D)
        return out[:1].expand_as(out)

    monkeypatch.setattr(torch_flex, "flex_attention", first_sequence_for_all)
    case = flex._decode_case(CONTEXT, 2, torch.float32, CPU)
    assert case.unsupported["flex"].startswith("output differs from mha_ext's")
    assert set(case.steps) == {"mha_ext"}


def test_flex_that_fails_to_compile_or_run_is_reported_with_the_reason(monkeypatch):
    def unsupported(*args, **kwargs):
        raise NotImplementedError("no CPU kernel for this mask")

    monkeypatch.setattr(torch_flex, "flex_attention", unsupported)
    result, table = _run_and_format(flex._prefill_case("causal", 128, torch.float32, CPU))
    assert "no CPU kernel for this mask" in result["unsupported"]["flex"]
    assert set(result["results"]) == {"mha_ext"}
    assert "no CPU kernel for this mask" in table.splitlines()[3]

"""The demo and the benchmark entry points run end to end. Their timings are not checked
(tests never assert a time); the structure of what they report is."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_generates_and_compares():
    result = subprocess.run([sys.executable, "-m", "mha_ext", "--steps", "12", "--quick"],
                            capture_output=True, text=True, check=True)
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines() if line.strip().startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert result.stdout.count("' -> '") == 3  # one continuation per prompt
    assert "mha_ext / torch_sdpa" in result.stdout and "gpt2-small float32 S=256 causal" in result.stdout


def test_bench_suites_write_json_and_tables(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mha_ext.bench", "--suite", "forward", "gqa_prefill", "paged_decode", "cache_append",
         "--models", "gpt2-small", "--seq", "128", "--context", "64", "--append-context", "64", "256",
         "--dtype", "float32", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["roofline"]) == {"matmul_float32", "stream_read"}
    assert all(value > 0 for value in data["roofline"].values())
    suites = [r["suite"] for r in data["results"]]
    assert suites.count("forward") == 2 and suites.count("gqa_prefill") == 1
    assert suites.count("paged_decode") == 3 and suites.count("cache_append") == 2
    for entry in data["results"]:
        assert "mha_ext" in entry["results"] and entry["baseline"] in entry["results"]
        mha = entry["results"]["mha_ext"]
        assert mha["throughput"] > 0 and mha["roofline_fraction"] > 0 and mha["speedup_vs_baseline"] > 0
    for title in ("attention forward (GFLOP/s)", "paged decode (K/V read per step) (GB/s)", "us per token at context 64"):
        assert title in result.stdout
    pytest.importorskip("matplotlib")
    assert (tmp_path / "forward.png").stat().st_size > 0 and (tmp_path / "cache_append.png").stat().st_size > 0


def test_kv_cache_script_runs_the_cache_suites(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--context", "64", "--append-context", "64",
                    "--dtype", "bfloat16", "--repeats", "1", "--no-plots", "--out", str(tmp_path)],
                   capture_output=True, check=True)
    suites = {r["suite"] for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert suites == {"cache_append", "paged_decode"}


def test_call_overhead_script_times_every_small_shape():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_overhead.py"), "--samples", "1"],
                            capture_output=True, text=True, check=True)
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("(1,")]
    assert len(rows) == 3 and all(line.rstrip().endswith("x") for line in rows)

"""The variants and varlen benchmark suites run and report what they promise."""

import json
import os
import subprocess
import sys
import time

import pytest

from mha_ext.bench import suites, timing
from mha_ext.bench.__main__ import main as bench_main


def run_bench(tmp_path, *arguments):
    """python -m mha_ext.bench with the given arguments, fp32, one repeat, results in tmp_path."""
    command = [sys.executable, "-m", "mha_ext.bench", *arguments, "--dtype", "float32"]
    command += ["--repeats", "1", "--no-plots", "--out", str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, check=True)


def test_varlen_document_lengths_fill_the_tokens_log_uniformly():
    lengths = suites.varlen_document_lengths(16384)
    assert sum(lengths) == 16384
    assert all(0 < n <= 4096 for n in lengths)
    assert all(n >= 64 for n in lengths[:-1])  # only the trimmed last one may be shorter
    assert len(set(lengths)) > len(lengths) // 2  # drawn, not one repeated length


def test_variants_and_varlen_suites_write_json_and_tables(tmp_path):
    result = run_bench(
        tmp_path, "--suite", "variants", "varlen", "--seq", "128", "--varlen-tokens", "1024"
    )
    data = json.loads((tmp_path / "results.json").read_text())
    variants = [r for r in data["results"] if r["suite"] == "variants"]
    assert len(variants) == 2 * len(suites.VARIANTS)  # forward and forward + backward
    assert all(r["baseline"] == "mha_ext_plain" for r in variants)
    assert all(set(r["results"]) == {"mha_ext", "mha_ext_plain"} for r in variants)
    varlen = [r for r in data["results"] if r["suite"] == "varlen"]
    assert [r["params"]["layout"] for r in varlen] == ["packed", "uniform"]
    assert all(set(r["results"]) == {"mha_ext", "torch_sdpa"} for r in varlen)
    assert "packed documents run at" in result.stdout


def _cpu_ticks(pid):
    """User + system CPU time of a process so far, in clock ticks (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_busy_cores_spin_while_the_block_runs_and_stop_with_it():
    with timing.busy_cores(2) as spinners:
        assert len(spinners) == 2
        time.sleep(0.2)  # past the interpreters' start
        before = [_cpu_ticks(s.pid) for s in spinners]
        time.sleep(0.5)
        spun = [_cpu_ticks(s.pid) - b for s, b in zip(spinners, before)]
        assert all(s.poll() is None for s in spinners)
    # Each held a core for most of the half second (50 ticks at Linux's 100 a second), even
    # on two cores shared with this test's process.
    assert all(ticks >= 10 for ticks in spun), spun
    assert all(s.returncode is not None for s in spinners)


def test_bench_runs_under_busy_cores_and_records_them(tmp_path):
    result = run_bench(tmp_path, "--suite", "variants", "--seq", "64", "--busy-cores", "1")
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["machine"]["busy_cores"] == 1
    assert "1 busy core(s) beside" in result.stdout
    rejected = subprocess.run(
        [sys.executable, "-m", "mha_ext.bench", "--busy-cores", "-1"],
        capture_output=True,
        text=True,
    )
    assert rejected.returncode == 2 and "--busy-cores must be 0 or more, got -1" in rejected.stderr


def test_integrations_suite_times_each_interface_against_the_direct_call(tmp_path):
    result = run_bench(tmp_path, "--suite", "integrations", "--seq", "64")
    data = json.loads((tmp_path / "results.json").read_text())
    cases = data["results"]
    integrations = [r["params"]["integration"] for r in cases]
    # Per interface: the small forward and, at the one --seq, forward and forward + backward.
    for name in ("flash_attn_func", "torch_sdpa_provider", "transformers"):
        assert integrations.count(name) == 3
    assert integrations.count("flash_attn_with_kvcache") == 1
    for case in cases:
        expected = {"integration", "mha_ext"}
        if case["params"]["integration"] == "torch_sdpa_provider":
            expected.add("torch_sdpa")
        if case["params"]["integration"] == "transformers" and case["unsupported"]:
            continue  # transformers is an optional extra
        assert set(case["results"]) == expected, case
    assert "time an interface adds to the direct mha_ext call:" in result.stdout


def test_sdpa_provider_is_active_only_inside_its_contenders_context():
    from torch.nn.attention import current_flash_attention_impl

    before = current_flash_attention_impl()
    with suites._sdpa_provider_active():
        assert current_flash_attention_impl() == "mha_ext"
    assert current_flash_attention_impl() == before


def test_context_parallel_suite_reports_ranks_bytes_overlap_and_memory(tmp_path):
    result = run_bench(
        tmp_path, "--suite", "context_parallel", "--quick", "--world", "2", "--seq", "64"
    )
    cases = json.loads((tmp_path / "results.json").read_text())["results"]
    # ring and ulysses, forward and forward + backward, at --quick's one head dim
    assert sorted((c["params"]["strategy"], c["params"]["backward"]) for c in cases) == [
        ("ring", False),
        ("ring", True),
        ("ulysses", False),
        ("ulysses", True),
    ]
    # --seq 64 on 2 ranks: a (1, 8, 32, 64) fp32 shard of q, k or v is 64 KiB. The forward
    # sends, besides a small all_gather of the ranks' options: ring, K and V one hop; ulysses,
    # half of q, k, v and the output each.
    shard = 8 * 32 * 64 * 4
    forward_bytes = {"ring": 2 * shard, "ulysses": 4 * shard // 2}
    for case in cases:
        assert case["params"]["world"] == 2 and len(case["ranks"]) == 2
        if not case["params"]["backward"]:
            expected = forward_bytes[case["params"]["strategy"]]
            for rank in case["ranks"]:
                assert expected <= rank["bytes_sent"] <= expected + 1024, case
        assert set(case["results"]) == {"context_parallel", "single_process"}
        assert all(entry["seconds_per_call"] > 0 for entry in case["results"].values())
        assert all(rank["bytes_sent"] > 0 for rank in case["ranks"]), case
        assert 0.0 <= case["hidden_communication_share"] <= 1.0
        assert case["compute_only_seconds"] > 0 and case["communication_only_seconds"] > 0
    assert "hidden = 1 - (step - compute-only) / communication-only" in result.stdout


@pytest.mark.cpu_only  # the bench runs on --device cpu either way
def test_paged_decode_times_each_8bit_cache_against_a_bf16_cache(tmp_path, monkeypatch, capsys):
    # In process, with no CPU cache to overflow: one layer per case instead of the hundreds
    # a tiny context needs to fill twice this VM's reported 480 MiB L3.
    monkeypatch.setattr(suites, "cpu_cache_bytes", lambda: 0)
    arguments = ["--suite", "paged_decode", "--context", "32", "--decode-batch", "2"]
    arguments += ["--kv-cache-only", "--dtype", "float32", "--repeats", "1", "--no-plots"]
    bench_main([*arguments, "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    cases = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["params"]["kv_cache_dtype"] for r in cases] == list(suites.KV_CACHE_DTYPES)
    for case in cases:
        assert case["baseline"] == "bf16_cache" and case["unsupported"] == {}, case
        assert set(case["results"]) == {"mha_ext", "bf16_cache"}
        params = case["params"]
        shape = (params["heads"], params["kv_heads"], params["head_dim"])
        assert shape == suites.QUANTIZED_DECODE_SHAPE[1:]
        # Throughput is of the bytes each cache holds: bf16's are 2x the 8-bit values, int8
        # adds a 4-byte scale per token and kv head to each row of head_dim bytes.
        timed = case["results"]
        bytes_ratio = timed["bf16_cache"]["seconds_per_call"] * timed["bf16_cache"]["throughput"]
        bytes_ratio /= timed["mha_ext"]["seconds_per_call"] * timed["mha_ext"]["throughput"]
        scales = 4 if params["kv_cache_dtype"] == "int8" else 0
        head_dim = params["head_dim"]
        assert abs(bytes_ratio - 2 * head_dim / (head_dim + scales)) < 1e-9
    assert "decode over 8-bit caches against a bf16 cache" in stdout
    assert "int8 cache" in stdout and "fp8 cache" in stdout

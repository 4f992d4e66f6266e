"""The demo and the benchmark entry points run end to end. Their timings are not checked
(tests never assert a time); the structure of what they report is."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mha_ext.__main__ import MIN_DOCUMENT, draw_documents
from mha_ext.bench import report, roofline, suites
from mha_ext.bench.roofline import cpu_cache_bytes
from mha_ext.models import CausalLM, document_positions, pack_documents

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_generates_and_compares():
    result = subprocess.run(
        [sys.executable, "-m", "mha_ext", "--steps", "12", "--quick"],
        capture_output=True,
        text=True,
        check=True,
    )
    losses = [
        float(line.split()[-1])
        for line in result.stdout.splitlines()
        if line.strip().startswith("step")
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert result.stdout.count("' -> '") == 3  # one continuation per prompt
    assert (
        "mha_ext / torch_sdpa" in result.stdout
        and "gpt2-small float32 S=256 causal" in result.stdout
    )


def test_pack_documents_offsets_and_positions():
    documents = [torch.tensor([4, 5, 6]), torch.tensor([], dtype=torch.int64), torch.tensor([7])]
    tokens, cu_seqlens = pack_documents(documents)
    assert tokens.tolist() == [4, 5, 6, 7]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 3, 4]
    assert document_positions(cu_seqlens).tolist() == [0, 1, 2, 0]
    with pytest.raises(ValueError, match=r"1-D tensors, got shapes \[\(2, 2\)\]"):
        pack_documents([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="non-empty sequence"):
        pack_documents([])


def test_packed_language_model_equals_each_document_alone():
    torch.manual_seed(0)
    model = CausalLM(vocab_size=30, context=16).eval()
    documents = [torch.randint(0, 30, (n,)) for n in (16, 3, 1, 9)]
    tokens, cu_seqlens = pack_documents(documents)
    logits = model.forward_packed(tokens, cu_seqlens)  # (29, 30)
    assert logits.shape == (29, 30)
    for document, rows in zip(documents, logits.split([16, 3, 1, 9])):
        torch.testing.assert_close(rows, model(document[None])[0], rtol=1e-5, atol=1e-5)
    too_long, offsets = pack_documents([torch.zeros(17, dtype=torch.int64)])
    with pytest.raises(ValueError, match="documents of up to 17 tokens exceed the context 16"):
        model.forward_packed(too_long, offsets)


def test_demo_documents_vary_and_fill_the_token_budget():
    torch.manual_seed(0)
    data = torch.arange(1000)
    starts = torch.tensor([0, 100, 500, 900])
    for _ in range(5):
        documents = draw_documents(data, starts, 1024, 64)
        inputs = [len(d) - 1 for d in documents]
        assert sum(inputs) == 1024 and all(1 <= n <= 64 for n in inputs)
        assert all(MIN_DOCUMENT <= n for n in inputs[:-1])  # only the last one is cut to fit
        assert len(set(inputs)) > 5
        for document in documents:  # a span of the text from one of the starts
            assert document[0].item() in starts.tolist()
            assert torch.equal(document, data[document[0] : document[0] + len(document)])


def test_bench_suites_write_json_and_tables(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_ext.bench",
            "--suite",
            "forward",
            "gqa_prefill",
            "paged_decode",
            "cache_append",
            "--models",
            "gpt2-small",
            "--seq",
            "128",
            "--context",
            "64",
            "--append-context",
            "64",
            "256",
            "--kv-cache-dtype",  # none: test_bench_suites times the 8-bit caches, in process
            "--dtype",
            "float32",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["roofline"]) == {"matmul_float32", "peak_float32", "stream_read"}
    assert all(value > 0 for value in data["roofline"].values())
    # the fp32 peak: the fastest fp32 probe this CPU ran
    readings = data["machine"]["peak_probes"]
    kind = data["machine"]["peak_kinds"]["peak_float32"]
    assert data["roofline"]["peak_float32"] == readings[kind]
    assert readings[kind] == max(readings[k] for k in roofline.FP32_PEAK_PROBES if k in readings)
    assert all(entry["roofline_rate"] > 0 for entry in data["results"])
    suites = [r["suite"] for r in data["results"]]
    assert suites.count("forward") == 2 and suites.count("gqa_prefill") == 1
    # paged_decode: three model shapes, a window case and a softcap + sinks case
    # cache_append: a case per context, and the flatness case timing 256 against 64
    assert suites.count("paged_decode") == 5 and suites.count("cache_append") == 3
    flatness = [r for r in data["results"] if r["params"].get("short_context")]
    assert [(r["params"]["context"], r["params"]["short_context"]) for r in flatness] == [(256, 64)]
    for entry in data["results"]:
        assert "mha_ext" in entry["results"] and entry["baseline"] in entry["results"]
        mha = entry["results"]["mha_ext"]
        assert (
            mha["throughput"] > 0
            and mha["roofline_fraction"] > 0
            and mha["speedup_vs_baseline"] > 0
        )
        if entry["unit"] == "GFLOP/s":
            assert mha["peak_fraction"] > 0
    for entry in data["results"]:
        if (
            entry["suite"] == "paged_decode"
        ):  # steps cycle through layers twice the CPU cache's size
            shape = entry["params"]
            layer_bytes = (
                2 * shape["batch"] * shape["kv_heads"] * shape["context"] * shape["head_dim"] * 4
            )
            assert shape["layers"] >= 1 and shape["layers"] * layer_bytes >= 2 * cpu_cache_bytes()
    for title in (
        "attention forward (GFLOP/s)",
        "paged decode (K/V read per step) (GB/s)",
        "us per token at context 64",
        "mha_ext interleaved, each after the read: ",
        "stream_read = ",
        "(with the cases: ",
        "(with the case: ",
    ):
        assert title in result.stdout
    pytest.importorskip("matplotlib")
    assert (tmp_path / "forward.png").stat().st_size > 0 and (
        tmp_path / "cache_append.png"
    ).stat().st_size > 0


def test_kv_cache_script_runs_the_cache_suites(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "kv_cache.py"),
            "--context",
            "64",
            "--append-context",
            "64",
            "--kv-cache-dtype",  # none, as above
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        check=True,
    )
    suites = {r["suite"] for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert suites == {"cache_append", "paged_decode"}


def test_call_overhead_suite_times_every_small_shape(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_ext.bench",
            "--suite",
            "call_overhead",
            "--dtype",
            "float32",
            "--repeats",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in data["results"]] == [
        "(1, 1, 1, 64) float32",
        "(1, 12, 16, 64) float32",
        "(1, 12, 128, 64) float32",
    ]
    for entry in data["results"]:
        assert entry["suite"] == "call_overhead" and entry["baseline"] == "torch_sdpa"
        assert entry["results"]["mha_ext"]["speedup_vs_baseline"] > 0
    title = "small forward calls, batch 1 (200 back to back per timed step) (us per call)"
    assert title in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("(1,")]
    assert len(rows) == 3 and all(line.rstrip().endswith("%") for line in rows)


def test_call_overhead_steps_are_timed_per_call(monkeypatch):
    # Each step makes CALLS_PER_STEP calls; a fake median of 0.02 s per step is 0.1 ms per call.
    calls = []
    monkeypatch.setattr(
        suites.functional, "scaled_dot_product_attention", lambda *args, **kwargs: calls.append(1)
    )
    case = suites._call_overhead_case(2, 16, 32, torch.float32, torch.device("cpu"))
    case.steps["mha_ext"]()
    assert len(calls) == suites.CALLS_PER_STEP == 200
    assert not case.interleave  # timed apart: see _call_overhead_case
    monkeypatch.setattr(
        suites,
        "interleaved_seconds",
        lambda steps, warmup, repeats, device, before_each=None: {name: [0.02] for name in steps},
    )
    result = suites.run_case(case, {"matmul_float32": 1000.0}, torch.device("cpu"), repeats=1)
    for name in ("mha_ext", "torch_sdpa", "naive"):
        entry = result["results"][name]
        assert entry["seconds_per_call"] == pytest.approx(1e-4)
        assert entry["throughput"] == pytest.approx(case.work / 1e-4 / 1e9)


def key_caches_read(monkeypatch, case, samples):
    """The data pointers of the key caches mha_ext's paged_attention reads, in order, over
    `samples` of the case's mha_ext steps."""
    key_caches = []
    monkeypatch.setattr(
        suites.functional, "paged_attention", lambda q, k_cache, *rest: key_caches.append(k_cache)
    )
    for _ in range(samples):
        case.steps["mha_ext"]()
    return [k_cache.data_ptr() for k_cache in key_caches]


@pytest.mark.parametrize("cache_bytes, layers", [(0, 1), (3 * 16384, 6), (3 * 16384 + 1, 7)])
def test_decode_case_cycles_through_layers_twice_the_cpu_cache(monkeypatch, cache_bytes, layers):
    # One layer of batch 2, 2 kv heads, context 16, head dim 32, fp32 K and V: 16 KiB. A CPU
    # cache of unknown size (0) still gets one layer.
    monkeypatch.setattr(suites, "cpu_cache_bytes", lambda: cache_bytes)
    case = suites._decode_case("tiny", 4, 2, 32, 16, torch.float32, torch.device("cpu"), batch=2)
    assert case.work == 16384 and case.params["layers"] == layers
    for step in case.steps.values():
        for _ in range(layers + 1):  # every layer, then the first again
            step()
    # mha_ext's steps read each layer's cache in turn, a sample every layer's (at most
    # DECODE_CALLS_PER_SAMPLE; the naive attention one), reported per call.
    assert case.params["calls_per_sample"] == layers
    assert case.per_call == {"mha_ext": layers, "torch_sdpa": layers, "naive": 1}
    pointers = key_caches_read(monkeypatch, case, 2)
    assert len(pointers) == 2 * layers
    assert len(set(pointers)) == layers and pointers[:layers] == pointers[layers:]


def test_decode_samples_take_at_most_the_calls_per_sample(monkeypatch):
    # 40 layers (a cache of 20 layers' bytes): each sample decodes the next 16 of them.
    monkeypatch.setattr(suites, "cpu_cache_bytes", lambda: 20 * 16384)
    case = suites._decode_case("tiny", 4, 2, 32, 16, torch.float32, torch.device("cpu"), batch=2)
    assert case.params["layers"] == 40 and suites.DECODE_CALLS_PER_SAMPLE == 16
    pointers = key_caches_read(monkeypatch, case, 3)
    assert len(pointers) == 48 and len(set(pointers)) == 40 and pointers[40:] == pointers[:8]
    monkeypatch.setattr(
        suites,
        "interleaved_seconds",
        lambda steps, warmup, repeats, device, before_each=None: {name: [0.016] for name in steps},
    )
    result = suites.run_case(case, {"stream_read": 1.0}, torch.device("cpu"), repeats=1)
    assert result["results"]["mha_ext"]["seconds_per_call"] == pytest.approx(1e-3)


@pytest.mark.parametrize("matmul_gflops, naive_timed", [(1000.0, True), (0.0001, False)])
def test_naive_attention_is_timed_only_where_its_matmuls_are_quick(matmul_gflops, naive_timed):
    # S 64, D 32, 2 heads: 1.05 MFLOP, 10 s at 0.0001 GFLOP/s (over NAIVE_MAX_SECONDS).
    case = suites.attention_case(
        "forward", "tiny", 2, 2, 32, 64, torch.float32, False, False, torch.device("cpu")
    )
    calls = []
    naive_step = case.steps["naive"]
    case.steps["naive"] = lambda: calls.append(1) or naive_step()
    result = suites.run_case(
        case, {"matmul_float32": matmul_gflops}, torch.device("cpu"), repeats=1
    )
    assert ("naive" in result["results"]) == naive_timed
    assert ("naive" in result["unsupported"]) != naive_timed
    assert bool(calls) == naive_timed
    if not naive_timed:
        assert result["unsupported"]["naive"].startswith(
            "not timed: its matmuls alone take 10 s per call"
        )
    assert "mha_ext" in result["results"] and "torch_sdpa" in result["results"]


@pytest.mark.parametrize("interleave", [True, False])
def test_roofline_fraction_is_of_the_probe_timed_with_the_case(monkeypatch, interleave):
    # Fake clocks: each step's median is its fixed time, the probe's 2 s for 4 GFLOP (2 GFLOP/s,
    # against 1000 at the run's start); the steps' call order shows the interleaving.
    case = suites.attention_case(
        "forward", "tiny", 2, 2, 32, 64, torch.float32, False, False, torch.device("cpu")
    )
    case.interleave = interleave
    step_seconds = {
        "mha_ext": 0.001,
        "torch_sdpa": 0.002,
        "naive": 0.004,
        suites.ROOFLINE_PROBE: 2.0,
    }
    calls = []

    def fake_interleaved_seconds(steps, warmup, repeats, device, before_each=None):
        for name in steps:
            calls.append(name)
        return {name: [step_seconds[name]] for name in steps}

    monkeypatch.setattr(suites, "interleaved_seconds", fake_interleaved_seconds)
    probe = roofline.Probe(lambda: None, 4e9)
    result = suites.run_case(
        case,
        {"matmul_float32": 1000.0},
        torch.device("cpu"),
        repeats=1,
        probes={"matmul_float32": probe, "stream_read": roofline.Probe(lambda: None, 1.0)},
    )
    assert result["roofline_rate"] == pytest.approx(2.0)
    assert suites.ROOFLINE_PROBE not in result["results"]
    mha = result["results"]["mha_ext"]
    assert mha["roofline_fraction"] == pytest.approx(case.work / 0.001 / 1e9 / 2.0)
    assert mha["speedup_vs_baseline"] == pytest.approx(2.0)
    assert calls == ["mha_ext", "torch_sdpa", "naive", suites.ROOFLINE_PROBE]
    without = suites.run_case(case, {"matmul_float32": 1000.0}, torch.device("cpu"), repeats=1)
    assert without["roofline_rate"] == 1000.0
    assert without["results"]["mha_ext"]["roofline_fraction"] == pytest.approx(
        case.work / 0.001 / 1e9 / 1000.0
    )


@pytest.mark.parametrize("interleave", [True, False])
def test_speedup_range_spans_the_repeats_paired_ratios(monkeypatch, interleave):
    # Three repeats: torch_sdpa 2, 3 and 1.5 ms against mha_ext's 1 ms each, so the ratio of
    # medians is 2 and the repeats' ratios run from 1.5 to 3; timed apart, repeats pair
    # nothing, so there is no range.
    case = suites.attention_case(
        "forward", "tiny", 2, 2, 32, 64, torch.float32, False, False, torch.device("cpu")
    )
    case.interleave = interleave
    times = {"mha_ext": [1e-3] * 3, "torch_sdpa": [2e-3, 3e-3, 1.5e-3], "naive": [4e-3] * 3}
    monkeypatch.setattr(
        suites,
        "interleaved_seconds",
        lambda steps, warmup, repeats, device, before_each=None: {
            name: times[name] for name in steps
        },
    )
    result = suites.run_case(case, {"matmul_float32": 1000.0}, torch.device("cpu"), repeats=3)
    mha = result["results"]["mha_ext"]
    assert mha["speedup_vs_baseline"] == pytest.approx(2.0)
    table = report.format_suite("forward", [result], {"matmul_float32": 1000.0})
    row = next(line for line in table.splitlines() if line.startswith(case.label))
    if interleave:
        assert mha["speedup_range"] == pytest.approx([1.5, 3.0])
        assert result["results"]["naive"]["speedup_range"] == pytest.approx([0.375, 0.75])
        assert "2.00x (1.50-3.00)" in row
    else:
        assert "speedup_range" not in mha
        assert "2.00x" in row and "(" not in row


def test_append_flatness_case_times_both_contexts_interleaved(monkeypatch):
    # The long context's run of appends 2, 3 and 2.5 ms against the short one's 2 ms each: a
    # ratio of medians 1.25, 1.0 to 1.5 over the repeats, printed as the flatness line. Every
    # step runs after the streaming read (before_each), which leaves both contexts alike.
    case = suites._append_flatness_case(16, 48, torch.device("cpu"))
    assert case.interleave and case.baseline == suites.APPEND_SHORT_CONTEXT
    assert set(case.steps) == {"mha_ext", suites.APPEND_SHORT_CONTEXT}
    times = {"mha_ext": [2e-3, 3e-3, 2.5e-3], suites.APPEND_SHORT_CONTEXT: [2e-3] * 3}
    evictions = []

    def fake_interleaved_seconds(steps, warmup, repeats, device, before_each=None):
        evictions.append(before_each)
        return {name: times.get(name, [1.0] * 3) for name in steps}

    monkeypatch.setattr(suites, "interleaved_seconds", fake_interleaved_seconds)
    probe = roofline.Probe(lambda: None, 1e9)
    flat = suites.run_case(
        case, {"stream_read": 1.0}, torch.device("cpu"), 3, {"stream_read": probe}
    )
    assert evictions == [probe.step]
    assert flat["params"]["context"] == 48 and flat["params"]["short_context"] == 16
    per_token = 2.5e-3 / suites.APPEND_TOKENS_PER_RUN * 1e6
    apart = {
        "label": "ctx=16",
        "params": {"context": 16},
        "unit": "GB/s",
        "roofline": "stream_read",
        "baseline": "mha_ext",
        "results": {"mha_ext": {"seconds_per_call": 1e-6, "throughput": 1.0}},
        "unsupported": {},
    }
    table = report.format_suite("cache_append", [apart, flat], {"stream_read": 1.0})
    assert "ctx=48 against ctx=16" not in table  # not a row of the per-context table
    assert (
        f"mha_ext interleaved, each after the read: {per_token:.2f} us per token at context 48 "
        f"against "
        f"{per_token * 0.8:.2f} at 16: ratio 1.25 (1.00-1.50 over the repeats)"
    ) in table


@pytest.mark.parametrize("slow_from, sizes", [(512, [256, 512]), (None, [256, 512, 1024])])
def test_matmul_roofline_grows_the_size_until_a_call_is_slow(monkeypatch, slow_from, sizes):
    # The size doubles from 256 until a call takes 50 ms or reaches max_size (1024 here).
    called = []
    monkeypatch.setattr(torch, "matmul", lambda a, b: called.append(a.shape[0]))

    def fake_median_seconds(steps, warmup, repeats, device):
        ((name, step),) = steps.items()
        step()
        slow = slow_from is not None and called[-1] >= slow_from
        return {name: 0.08 if slow else 0.001}

    monkeypatch.setattr(roofline, "median_seconds", fake_median_seconds)
    probe = roofline.matmul_probe(torch.float32, torch.device("cpu"), max_size=1024)
    assert sorted(set(called)) == sizes and probe.work == 2.0 * sizes[-1] ** 3
    gflops = probe.rate(torch.device("cpu"))
    assert called[-1] == sizes[-1]  # the probe multiplies matrices of the size found
    assert gflops == pytest.approx(2.0 * sizes[-1] ** 3 / (0.08 if slow_from else 0.001) / 1e9)

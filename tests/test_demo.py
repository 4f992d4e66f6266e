"""The demo and the speed benchmark script run end to end (their numbers are not checked:
tests never assert a time)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_and_compares():
    result = subprocess.run([sys.executable, "-m", "mha_ext", "--steps", "12", "--quick"],
                            capture_output=True, text=True, check=True)
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines() if line.strip().startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "mha_ext / torch" in result.stdout and "gpt2-small float32 S=256 causal fwd+bwd" in result.stdout


def test_speed_benchmark_writes_json(tmp_path):
    out = tmp_path / "speed.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_speed.py"), "--models", "llama2-70b",
         "--seq", "64", "--dtype", "bfloat16", "--repeats", "1", "--json", str(out)],
        check=True, capture_output=True,
    )
    results = json.loads(out.read_text())
    assert len(results) == 4  # causal x backward
    for entry in results:
        assert (entry["heads"], entry["kv_heads"]) == (64, 8)
        assert set(entry["results"]) == {"mha_ext", "torch_sdpa", "reference"}
        assert all(r["seconds"] > 0 for r in entry["results"].values())

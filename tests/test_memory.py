"""The fused kernels never hold an O(Sq x Sk) buffer: measured in a fresh process."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peak_memory.py"


def test_peak_extra_memory_stays_below_half_a_score_matrix(tmp_path):
    # At S = 8192 one head's fp32 score matrix is 256 MiB, while the outputs, gradients
    # and workspaces of 4 heads x 64 dims take about 8 MiB each.
    result_file = tmp_path / "memory.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--heads", "4", "--seq", "8192", "--causal", "--json", str(result_file)],
        check=True,
    )
    result = json.loads(result_file.read_text())
    assert result["score_matrix_bytes"] == 8192 * 8192 * 4
    assert 0 < result["extra_peak_bytes"] < result["score_matrix_bytes"] / 2, result

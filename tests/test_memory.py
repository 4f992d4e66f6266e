"""The fused kernels never hold an O(Sq x Sk) buffer: measured in a fresh process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Subprocess runs of CPU builds, resident memory and the CPU demo: nothing to repeat on CUDA.
pytestmark = pytest.mark.cpu_only

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peak_memory.py"


def test_peak_extra_memory_stays_below_half_a_score_matrix(tmp_path):
    # At S = 16384 one head's fp32 score matrix is 1 GiB, while the outputs, gradients and
    # workspaces of 4 heads x 64 dims take about 16 MiB each (about 110 MiB in all). Resident
    # memory moves by tens of MiB with allocator and page timing on a busy machine (seen:
    # +60 MiB at S = 8192), so the length makes one matrix dwarf that noise.
    result_file = tmp_path / "memory.json"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--heads",
            "4",
            "--seq",
            "16384",
            "--causal",
            "--json",
            str(result_file),
        ],
        check=True,
    )
    result = json.loads(result_file.read_text())
    assert result["score_matrix_bytes"] == 16384 * 16384 * 4
    assert 0 < result["extra_peak_bytes"] < result["score_matrix_bytes"] / 2, result

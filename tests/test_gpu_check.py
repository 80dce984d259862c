"""bench/gpu_check.py: one sentence without a GPU; the whole script on the CPU as a dry run (no timings
asserted: its numbers say nothing about a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the bench script in a process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_without_cuda_one_sentence_and_status_1():
    out = _run()
    assert out.returncode == 1
    assert out.stdout.strip().splitlines() == [
        "No CUDA device is available: bench/gpu_check.py measures the GPU path and needs one GPU."]
    assert "Traceback" not in out.stderr


def test_dry_run_on_cpu_prints_every_figure():
    out = _run("--device", "cpu", "--rounds", "1", "--layers", "1", "--hidden", "64", "--batch", "2", "--seq", "16",
               "--stats-elems", "50000")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for line_start in ("plain", "full", "summary mode", "capture_pair", "float32", "bfloat16"):
        assert any(line.startswith(line_start) for line in text.splitlines()), line_start
    # no GPU here, so no sync can be seen; the counts must still be printed for each mode
    assert "syncs over" in text and "per op (target 0)" in text and "the step's end (one transfer)" in text
    recorded = [int(line.split("syncs over")[1].split()[0]) for line in text.splitlines() if "syncs over" in line]
    assert len(recorded) == 2 and all(n > 10 for n in recorded)
    assert "capture's statistics path on cpu: the CPU kernel" in text  # the Triton kernel's rows need CUDA

"""The first command after an install: the compiled kernels are not in numba's cache yet.

Calls are served by the float64 numpy/torch paths (no compilation) while one background process fills the
cache; once it has, a new process takes the kernels with nothing to compile.  Results are checked against the
kernel and a float64 numpy computation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from precision_lab import metrics, numba_loader
from precision_lab.stats import kernels, tensor_stats

pytestmark = pytest.mark.slow  # processes that compile the kernels

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import numpy as np
from precision_lab import metrics
from precision_lab.stats import kernels, tensor_stats
rng = np.random.default_rng(0)
x = (rng.standard_normal(300_000) * 40).astype(np.float32)
x[::1000] = np.nan
x[5::999] = np.inf
x[7::1001] = 1e5  # beyond fp16: introduced below
c = x.astype(np.float16)
s = tensor_stats(x)
m = metrics.compare(x, c)
print(json.dumps({"kernel": kernels.KERNELS.ready() is not None, "compare_kernel": metrics.KERNEL.ready() is not None,
                  "torch": "torch" in sys.modules, "hist": s.hist.tolist(), "nan": s.nan_count, "inf": s.inf_count,
                  "min": s.min, "max": s.max, "mean": s.mean, "std": s.std, "l2": s.l2norm,
                  "rmse": m.rmse, "max_rel": m.max_rel_err, "introduced": m.nonfinite_introduced}))
"""


def _probe(cache: Path) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PRECISION_LAB_COMPILE="background", PYTHONPATH=str(ROOT))
    env.pop("PRECISION_LAB_NO_NUMBA", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _reference() -> dict:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(300_000) * 40).astype(np.float32)
    x[::1000] = np.nan
    x[5::999] = np.inf
    x[7::1001] = 1e5
    fin = x[np.isfinite(x)].astype(np.float64)
    return {"nan": int(np.isnan(x).sum()), "inf": int(np.isinf(x).sum()), "min": fin.min(), "max": fin.max(),
            "mean": fin.mean(), "std": fin.std(), "l2": math.sqrt(math.fsum(fin * fin))}


@pytest.mark.skipif(not numba_loader.load_numba(), reason="numba is not installed: there is nothing to compile")
def test_first_process_needs_no_compilation_and_fills_the_cache(tmp_path):
    cache = tmp_path / "numba-cache"
    first = _probe(cache)
    assert not first["kernel"] and not first["compare_kernel"]
    assert not first["torch"], "numpy inputs took the torch path (importing torch costs a second)"
    # the background compiler: one lock file while it works, gone when the cache is full
    deadline = time.monotonic() + 600
    while any(cache.rglob("precision-lab-compiling")) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(cache.rglob("precision-lab-compiling")), "the background compilation did not finish"
    assert any(cache.rglob("*.nbi")), "nothing was cached"
    second = _probe(cache)
    assert second["kernel"] and second["compare_kernel"]
    ref = _reference()
    for run in (first, second):
        for k in ("nan", "inf", "min", "max"):
            assert run[k] == ref[k], k
        for k in ("mean", "std", "l2"):
            assert run[k] == pytest.approx(ref[k], rel=1e-12), k
    assert first["hist"] == second["hist"]
    assert first["introduced"] == second["introduced"] > 0
    for k in ("rmse", "max_rel"):
        assert first[k] == pytest.approx(second[k], rel=1e-12), k


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, np.ndarray):
            assert np.array_equal(va, vb), f.name
        else:
            assert va == vb or (isinstance(va, float) and math.isnan(va) and math.isnan(vb)), f.name


def test_cold_calls_take_the_float64_paths_and_start_one_compiler(monkeypatch):
    """In one process: with the cache reported empty, auto calls equal the numpy backend's (numba's to
    rounding), and the compiler is asked for once per recheck interval, not per call."""
    monkeypatch.setenv(numba_loader.COMPILE_ENV, "background")
    started = []
    monkeypatch.setattr(numba_loader, "cache_holds", lambda roots: False)
    monkeypatch.setattr(numba_loader, "start_compiler", lambda directory: started.append(directory) or True)
    for kernel_set in (kernels.KERNELS, metrics.KERNEL):
        monkeypatch.setattr(kernel_set, "_value", None)
        monkeypatch.setattr(kernel_set, "_next_check", 0.0)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(70_001) * np.exp(rng.uniform(-20, 20, 70_001))).astype(np.float32)
    x[::701] = -np.inf
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    got = [tensor_stats(x) for _ in range(3)]
    cmp = [metrics.compare(x, h) for _ in range(3)]
    want = tensor_stats(x, backend="numpy")
    for g in got:
        _same(g, want)
    assert all(c == metrics.compare(x, h, backend="numpy") for c in cmp)
    assert kernels.KERNELS._value is None and metrics.KERNEL._value is None
    if numba_loader.load_numba() is not None:
        assert len(started) == 2  # one ask per kernel set; start_compiler itself starts one process
        k = tensor_stats(x, backend="numba")  # an explicit backend compiles here, whatever the cache says
        assert np.array_equal(k.hist, want.hist) and k.neg_inf_count == want.neg_inf_count == 100
        assert k.std == pytest.approx(want.std, rel=1e-12)


def test_small_numpy_arrays_do_not_load_numba():
    """A command over small tensors (a `compare` of small dumps) never imports numba: loading it and its cache
    costs more than the float64 numpy path of many small arrays.  A large one loads it."""
    code = """
import sys
import numpy as np
from precision_lab import metrics
from precision_lab.numba_loader import SMALL_NUMPY
from precision_lab.stats import tensor_stats
x = np.linspace(-3, 3, SMALL_NUMPY - 1, dtype=np.float32)
s = tensor_stats(x)
m = metrics.compare(x, x.astype(np.float16))
small = "numba" in sys.modules
tensor_stats(np.linspace(-3, 3, SMALL_NUMPY, dtype=np.float32))
print(small, "numba" in sys.modules, s.zero_count, s.max, m.compared)
"""
    env = dict(os.environ, PRECISION_LAB_COMPILE="now", PYTHONPATH=str(ROOT))
    env.pop("PRECISION_LAB_NO_NUMBA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    small, large, zeros, top, compared = out.stdout.split()
    assert small == "False"
    assert large == str(numba_loader.load_numba() is not None)
    assert (int(zeros), float(top), int(compared)) == (1, 3.0, (1 << 14) - 1)  # linspace holds 0 exactly


def test_a_long_command_compiles_after_its_fallback_budget(monkeypatch):
    """Past FALLBACK_BUDGET_S of float64-path work the process takes the kernels (compiling them itself if the
    background compiler has not filled the cache): a large dump's first compare is not float64 to the end."""
    monkeypatch.setenv(numba_loader.COMPILE_ENV, "background")
    monkeypatch.setattr(numba_loader, "cache_holds", lambda roots: False)
    monkeypatch.setattr(numba_loader, "start_compiler", lambda directory: True)
    for kernel_set in (kernels.KERNELS, metrics.KERNEL):
        monkeypatch.setattr(kernel_set, "_value", None)
        monkeypatch.setattr(kernel_set, "_next_check", 0.0)
    monkeypatch.setattr(numba_loader, "_FALLBACK_SPENT", [0.0])
    x = np.linspace(-1.0, 1.0, 4097, dtype=np.float32)
    tensor_stats(x)
    assert kernels.KERNELS._value is None and 0.0 < numba_loader._FALLBACK_SPENT[0] < numba_loader.FALLBACK_BUDGET_S
    numba_loader.note_fallback(numba_loader.FALLBACK_BUDGET_S)
    s = tensor_stats(x)
    metrics.compare(x, x)
    if numba_loader.load_numba() is None:
        assert kernels.KERNELS._value is False
        return
    assert kernels.KERNELS.loaded() and metrics.KERNEL.loaded()
    assert s.zero_count == 1 and s.max == 1.0 and s.min == -1.0

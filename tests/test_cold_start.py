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
from precision_lab.stats import scan, tensor_stats

pytestmark = pytest.mark.slow  # processes that compile the kernels

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import numpy as np
from precision_lab import metrics
from precision_lab.stats import scan, tensor_stats
rng = np.random.default_rng(0)
x = (rng.standard_normal(300_000) * 40).astype(np.float32)
x[::1000] = np.nan
x[5::999] = np.inf
x[7::1001] = 1e5  # beyond fp16: introduced below
c = x.astype(np.float16)
s = tensor_stats(x)
m = metrics.compare(x, c)
print(json.dumps({"kernel": scan.KERNELS.ready() is not None, "compare_kernel": metrics.KERNEL.ready() is not None,
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
    # the background compiler: one lock for both kernel sets, held while it works, free when the cache is full
    locks = list(cache.rglob("precision-lab-compiling*"))
    assert len(locks) == 1, locks
    deadline = time.monotonic() + 600
    fd = None
    while fd is None and time.monotonic() < deadline:
        fd = numba_loader.take_compiler_lock(str(locks[0]))
        time.sleep(0 if fd is not None else 1)
    assert fd is not None, "the background compilation did not finish"
    os.close(fd)
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


KERNEL_SETS = (scan.KERNELS, metrics.KERNEL)


@pytest.fixture(autouse=True)
def _loader_afresh_after():
    """Each test leaves the loader as a process just started would find it (no fake compiler, no budget spent)."""
    yield
    numba_loader.start_afresh(*KERNEL_SETS)


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
    monkeypatch.setattr(numba_loader, "start_compiler", lambda: started.append(1) or True)
    numba_loader.start_afresh(*KERNEL_SETS)
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
    assert not scan.KERNELS.loaded() and not metrics.KERNEL.loaded()
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
    monkeypatch.setattr(numba_loader, "start_compiler", lambda: True)
    numba_loader.start_afresh(*KERNEL_SETS)
    x = np.linspace(-1.0, 1.0, 4097, dtype=np.float32)
    tensor_stats(x)
    assert not scan.KERNELS.loaded() and 0.0 < numba_loader.fallback_spent() < numba_loader.FALLBACK_BUDGET_S
    numba_loader.note_fallback(numba_loader.FALLBACK_BUDGET_S)
    s = tensor_stats(x)
    metrics.compare(x, x)
    if numba_loader.load_numba() is None:
        assert not scan.KERNELS.loaded()
        return
    assert scan.KERNELS.loaded() and metrics.KERNEL.loaded()
    assert s.zero_count == 1 and s.max == 1.0 and s.min == -1.0


class _Compilers:
    """``subprocess.Popen`` for numba_loader: each compiler it is asked to start runs ``code`` instead (with the
    same arguments otherwise: the inherited lock descriptor), and is kept to be ended by the test."""

    def __init__(self, code: str) -> None:
        self.code, self.procs = code, []
        self.real = subprocess.Popen

    def __call__(self, args, **kw):
        p = self.real([sys.executable, "-c", self.code, *args[3:]], **kw)
        self.procs.append(p)
        return p

    def end(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _cold(monkeypatch, tmp_path, code: str) -> _Compilers:
    """Both kernel sets reported not cached; compilers started by ``ready()`` run ``code``."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(numba_loader.COMPILE_ENV, "background")
    monkeypatch.setattr(numba_loader, "cache_holds", lambda roots: False)
    numba_loader.start_afresh(*KERNEL_SETS)
    fake = _Compilers(code)
    monkeypatch.setattr(numba_loader.subprocess, "Popen", fake)
    return fake


def _another_process() -> None:
    """What a second process would see: it has started no compiler and asks again at once."""
    numba_loader.start_afresh(*KERNEL_SETS)


@pytest.mark.skipif(not numba_loader.load_numba(), reason="numba is not installed: there is nothing to compile")
def test_one_compiler_at_a_time_for_both_kernel_sets(monkeypatch, tmp_path):
    """A compiler compiles both kernel sets, so one lock covers both: while one runs, a process missing either
    set starts none, however old the lock file is; once it has ended, the next one starts at once."""
    fake = _cold(monkeypatch, tmp_path, "import time; time.sleep(120)")
    try:
        assert scan.KERNELS.ready() is None
        assert len(fake.procs) == 1
        for path in tmp_path.rglob("precision-lab-compiling*"):
            os.utime(path, (time.time() - 7200, time.time() - 7200))  # old: its age says nothing
        _another_process()
        assert metrics.KERNEL.ready() is None and scan.KERNELS.ready() is None
        assert len(fake.procs) == 1, "a second compiler started while the first one was writing the cache"
        fake.procs[0].kill()
        fake.procs[0].wait()
        _another_process()
        assert metrics.KERNEL.ready() is None
        assert len(fake.procs) == 2  # the lock died with its holder: no stale lock to wait out
    finally:
        fake.end()


@pytest.mark.skipif(not numba_loader.load_numba(), reason="numba is not installed: there is nothing to compile")
def test_a_compiler_that_fails_at_once_is_reaped_and_leaves_no_lock(monkeypatch, tmp_path):
    """A compiler that dies on its imports does not block the next one (the old lock file stayed 900 s), and the
    process that started it reaps it without being asked (no zombie in a long-lived server)."""
    fake = _cold(monkeypatch, tmp_path, "raise ImportError('a broken install')")
    try:
        assert scan.KERNELS.ready() is None
        proc = fake.procs[0]
        deadline = time.monotonic() + 60
        while proc.returncode is None and time.monotonic() < deadline:  # set by whoever waits for it; never poll()
            time.sleep(0.05)
        assert proc.returncode == 1, "the compiler that ended was not reaped"
        _another_process()
        assert scan.KERNELS.ready() is None
        assert len(fake.procs) == 2
    finally:
        fake.end()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_has_its_own_fallback_budget():
    """A child forked after its parent spent its fallback budget starts afresh: its own budget is unspent."""
    numba_loader.note_fallback(numba_loader.FALLBACK_BUDGET_S)
    assert numba_loader.over_budget()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of the parent's
        os.close(r)
        os.write(w, json.dumps(numba_loader.fallback_spent()).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        seen = json.loads(f.read())
    os.waitpid(pid, 0)
    assert seen == 0.0
    assert numba_loader.over_budget()  # the parent's own state is untouched

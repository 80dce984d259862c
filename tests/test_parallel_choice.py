"""Serial or parallel kernel calls: chosen by what each has cost per element lately (a core taken by another
process makes the serial path the faster), with identical results either way."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from precision_lab import metric_sums, metrics
from precision_lab.numba_loader import ParallelChoice, load_numba, run_parts
from precision_lab.stats import scan, tensor_stats


class _Forced(ParallelChoice):
    """Always the given path."""

    __slots__ = ("parallel",)

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def pick(self) -> bool:
        return self.parallel


def _feed(choice: ParallelChoice, calls: int, serial_s: float, parallel_s: float) -> list:
    """Run ``calls`` picks, each reported at the given cost for a 1M-element call; the picks made."""
    picks = []
    for _ in range(calls):
        p = choice.pick()
        picks.append(p)
        choice.record(p, parallel_s if p else serial_s, 1 << 20)
    return picks


def test_follows_the_faster_path_and_notices_a_change_in_load():
    c = ParallelChoice(explore=16, max_gap=64)
    c.record(True, 5.0, 1 << 20)  # a path's first call starts threads: not counted
    quiet = _feed(c, 96, serial_s=0.010, parallel_s=0.006)
    assert sum(quiet[8:]) >= len(quiet[8:]) - 4  # parallel but for a few exploring calls (16, then 32, 64 apart)
    busy = _feed(c, 96, serial_s=0.012, parallel_s=0.040)  # a core taken: every parallel call waits for it
    assert sum(busy[4:20]) <= 2 and sum(busy[-48:]) <= 1  # serial within a few calls; exploring less and less
    s, p = c.estimates()
    assert s == pytest.approx(0.012 / (1 << 20), rel=1e-9) and p > 2 * s
    again = _feed(c, 96, serial_s=0.010, parallel_s=0.006)  # quiet again: back at the next exploring call
    assert sum(again[-32:]) >= 30


def test_one_outlier_does_not_flip_the_choice():
    c = ParallelChoice(explore=1000)
    _feed(c, 20, serial_s=0.010, parallel_s=0.006)
    c.record(True, 1.0, 1 << 20)  # one call descheduled for a second
    assert c.pick() is True


@pytest.mark.skipif(load_numba() is None, reason="numba is not installed")
@pytest.mark.parametrize("histogram", [True, False])
def test_stats_identical_on_both_paths(monkeypatch, histogram):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(1 << 19) * np.exp(rng.uniform(-25, 25, 1 << 19))).astype(np.float32)
    x[::997] = np.nan
    x[3::1009] = -np.inf
    x[::7] = 0.0
    got = {}
    for parallel in (False, True):
        for key in list(scan._CHOICE):
            monkeypatch.setitem(scan._CHOICE, key, _Forced(parallel))
        got[parallel] = tensor_stats(x, histogram=histogram, backend="numba")
    a, b = got[False], got[True]
    for f in ("nan_count", "inf_count", "neg_inf_count", "zero_count", "min", "max", "absmax", "min_abs_nonzero",
              "mean", "std", "l2norm"):  # the same parts in the same order: bit for bit
        assert getattr(a, f) == getattr(b, f), f
    if histogram:
        assert np.array_equal(a.hist, b.hist)
    fin = x[np.isfinite(x)].astype(np.float64)
    for f, want in (("mean", fin.mean()), ("std", fin.std()), ("l2norm", math.sqrt(math.fsum(fin * fin)))):
        assert getattr(a, f) == pytest.approx(want, rel=1e-12), f
        assert getattr(b, f) == pytest.approx(want, rel=1e-12), f


@pytest.mark.skipif(load_numba() is None, reason="numba is not installed")
def test_compare_identical_on_both_paths(monkeypatch):
    rng = np.random.default_rng(9)
    r = rng.standard_normal(300_001).astype(np.float32)
    c = (r * (1 + 1e-3 * rng.standard_normal(r.size))).astype(np.float32)
    c[::1001] = np.nan
    got = {}
    for parallel in (False, True):
        for key in list(metric_sums._CHOICE):
            monkeypatch.setitem(metric_sums._CHOICE, key, _Forced(parallel))
        got[parallel] = metrics.compare(r, c, backend="numba")
    a, b = got[False], got[True]
    assert a == b  # the same parts in the same order: bit for bit
    both = np.isfinite(c)
    d = c[both].astype(np.float64) - r[both].astype(np.float64)
    assert a.rmse == pytest.approx(math.sqrt(np.mean(d * d)), rel=1e-12)
    assert b.rmse == pytest.approx(math.sqrt(np.mean(d * d)), rel=1e-12)


@pytest.mark.skipif(load_numba() is None, reason="numba is not installed")
def test_compare_measures_float32_and_float64_apart(monkeypatch):
    """A float64 element costs about twice a float32 one: float64 comparisons move only their own estimates, so
    a run of them cannot make the float32 ones look slow on the path they took."""
    monkeypatch.setattr(metric_sums, "_CHOICE", {k: ParallelChoice() for k in metric_sums._CHOICE})
    rng = np.random.default_rng(10)
    r = rng.standard_normal(1 << 18)
    c = r * (1 + 1e-6 * rng.standard_normal(r.size))
    for _ in range(6):
        got = metrics.compare(r, c, backend="numba")
    d = c - r
    assert got.rmse == pytest.approx(math.sqrt(np.mean(d * d)), rel=1e-12)
    assert metric_sums._CHOICE[8].estimates() != (None, None)  # float64 calls measured (after each path's first)
    assert metric_sums._CHOICE[4].estimates() == (None, None)  # and nothing credited to float32
    float64_estimates = metric_sums._CHOICE[8].estimates()
    for _ in range(6):
        metrics.compare(r.astype(np.float32), c.astype(np.float32), backend="numba")
    assert metric_sums._CHOICE[4].estimates() != (None, None)
    assert metric_sums._CHOICE[8].estimates() == float64_estimates


def test_a_held_up_thread_delays_its_own_part_not_the_others():
    """Parts go to whichever thread is free: while one thread is held up (as by a core another process holds),
    the other takes every remaining part.  A fixed share per thread would leave half of them waiting."""
    others = []
    all_others_done = threading.Event()
    first = threading.Lock()

    def part(i):
        if first.acquire(blocking=False):  # the first part taken is held up until every other part is done
            assert all_others_done.wait(30), "the other parts waited for the held-up thread"
        else:
            others.append(i)
            if len(others) == 7:
                all_others_done.set()
        return i * i

    assert run_parts(part, 8, 2) == [i * i for i in range(8)]
    assert sorted(others + [sorted(set(range(8)) - set(others))[0]]) == list(range(8))


def test_an_error_in_a_part_is_raised_once_every_part_has_ended():
    ended = []

    def part(i):
        if i == 2:
            raise ZeroDivisionError("part 2")
        ended.append(i)
        return i

    with pytest.raises(ZeroDivisionError, match="part 2"):
        run_parts(part, 6, 2)
    assert sorted(ended) == [0, 1, 3, 4, 5]

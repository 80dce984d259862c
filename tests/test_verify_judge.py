"""A fix is judged by its effect (services.verify.judge_fix): it works only where it leaves no unexpected
NaN/Inf and improves on the run it fixes."""

from __future__ import annotations

import math

from precision_lab.origin import Origin
from precision_lab.services.verify import IMPROVE_DB, judge_fix


def _origin(op="pool.add.0") -> Origin:
    return Origin(run="fp16", run_id="r", op=op, op_type="add", direction="forward", seq=3, step=0, rank=0, rid=7,
                  role="output", index="0", origin="op", reason="", order="execution", order_known=True,
                  certainty="certain")


def test_a_fix_that_removes_the_nan_works():
    works, why = judge_fix(None, 41.25, _origin(), 58.75)  # the parent's SQNR is of its finite values only
    assert works and why == "no NaN/Inf left, output SQNR 41.2 dB"


def test_a_fix_that_leaves_a_nan_fails_whatever_its_sqnr():
    works, why = judge_fix(_origin("head.linear.0"), 60.0, _origin(), 10.0)
    assert not works and why == "still NaN/Inf at head.linear.0"


def test_an_island_that_changes_nothing_on_a_finite_run_does_not_work():
    # an fp16 counter stuck at 2048: the island on a module without parameters leaves the output as it was
    works, why = judge_fix(None, 17.5, None, 17.5)
    assert not works and "changes nothing" in why and "17.5 dB" in why


def test_a_fix_that_makes_a_finite_run_worse_does_not_work():
    works, why = judge_fix(None, -18.7, None, 17.5)  # bf16 makes the counter stick at 256
    assert not works and why.startswith("worse than the run it fixes") and "-18.7 dB against 17.5 dB" in why


def test_a_fix_must_gain_at_least_the_margin():
    assert not judge_fix(None, 17.5 + IMPROVE_DB / 2, None, 17.5)[0]
    works, why = judge_fix(None, 17.5 + 3 * IMPROVE_DB, None, 17.5)
    assert works and why == "output SQNR 17.5 dB -> 20.5 dB"
    assert judge_fix(None, math.inf, None, 17.5) == (True, "output SQNR 17.5 dB -> exact")
    assert not judge_fix(None, None, None, 17.5)[0]  # nothing says it is better

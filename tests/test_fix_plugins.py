"""A fix added from outside the package, the way a plug-in adds one: one module, named by entry points, that
registers a fix with what it does to the model (``FixDef.prepare``) and the rule whose diagnosis proposes it; a
session's one-click re-run (the ``rerun`` command over ``services.rerun.rerun_session``, which the dashboard's
button calls) applies it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from precision_lab.fixes.catalogue import FIXES
from precision_lab.fixes.rulebook import RULES

from plugin_kit import doc_examples, install

runner = CliRunner()

# the worked example of docs/architecture.md's "Adding a fix": a LayerNorm gives the same result for x / s (up to its
# epsilon), so dividing its input by a power of two first keeps x^2 inside fp16's range where rows of magnitude
# ~300 overflow it
EXAMPLE = doc_examples("Adding a fix")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plug-in installed (a module and a distribution naming it in two entry point groups), as in a process
    that has not read either registry yet; what it registered is taken out again afterwards."""
    fixes_before, rules_before = set(FIXES.names()), set(RULES.names())
    assert list(EXAMPLE) == ["my_fix.py"]
    install(tmp_path, monkeypatch, EXAMPLE, {"precision_lab.fixes": ["mine = my_fix"],
                                             "precision_lab.rules": ["mine = my_fix"]}, (FIXES, RULES))
    yield tmp_path
    for name in set(FIXES.names()) - fixes_before:
        FIXES.unregister(name)
    for name in set(RULES.names()) - rules_before:
        RULES.unregister(name)


def _cli(*args):
    from precision_lab.cli import app

    return runner.invoke(app, [str(a) for a in args])


def _record(store, run_id: str, op: str, role: str) -> dict:
    got = store.df("SELECT absmax, inf_count, nan_count FROM tensors WHERE run_id = ? AND op = ? AND role = ?",
                   [run_id, op, role]).to_dict("records")
    assert len(got) == 1, (op, role, got)
    return got[0]


@pytest.mark.slow
def test_a_fix_from_an_entry_point_is_proposed_and_a_rerun_applies_it(plugin):
    from precision_lab.fixes.policy import PrecisionPolicy
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store, close_all

    db = plugin / "lab.duckdb"
    r = _cli("capture", "--recipe", "fp16-layernorm", "--db", db)
    assert r.exit_code == 0, r.output
    store = Store(db)
    try:
        sid = store.session("fp16-layernorm").session_id
        runs = {r["kind"]: r for r in store.runs(sid).to_dict("records")}
        cand = runs["candidate"]["run_id"]
        # the diagnosis proposes the plug-in's fix, its power of two worked out here from the stored input
        x = _record(store, cand, "ln.forward.0", "input")["absmax"]
        s = 2 ** math.ceil(math.log2(x / math.sqrt(65504.0)) + 2)
        diag = store.df("SELECT rule, op, fixes FROM diagnoses WHERE run_id = ? AND severity = 'error'",
                        [cand]).to_dict("records")
        assert [(d["rule"], d["op"], json.loads(d["fixes"])) for d in diag] == \
            [("norm-input-squares", "ln", [f"prescale-norm:{s}"])]
        before = _record(store, cand, "ln.mul.0", "output")  # x * x, the first square
        assert before["inf_count"] > 0 and first_nonfinite(store, cand).op == "ln.mul.0"
    finally:
        close_all()

    r = _cli("fixes")
    assert r.exit_code == 0 and "prescale-norm:8" in r.output
    r = _cli("rerun", "--session", "fp16-layernorm", "--fix", f"prescale-norm:{s}", "--db", db)
    # the square no longer overflows; the recipe's zero-variance row still meets an epsilon flushed to zero, so the
    # first non-finite value moves on to rsqrt and the command says the run still fails (exit 1)
    assert r.exit_code == 1, r.output
    assert "first non-finite: ln.rsqrt.0" in r.output
    store = Store(db)
    try:
        rerun = next(r for r in store.runs(sid).to_dict("records") if r["kind"] == "rerun")
        assert rerun["fix"] == f"prescale-norm:{s}" and rerun["parent_run_id"] == cand
        assert PrecisionPolicy.from_json(rerun["policy"]).fixes == (f"prescale-norm:{s}",)
        # as the fix says: the norm divides its input by s first, and x^2 no longer overflows fp16
        divided = _record(store, rerun["run_id"], "ln.div.0", "output")
        assert divided["absmax"] == float(np.float16(x) / np.float16(s))
        after = _record(store, rerun["run_id"], "ln.mul.0", "output")
        assert after["inf_count"] == 0 and after["nan_count"] == 0
        assert after["absmax"] == float(np.float16(divided["absmax"]) * np.float16(divided["absmax"]))
    finally:
        close_all()


def test_a_fix_that_edits_the_model_leaves_the_policy_and_records_itself(plugin):
    from precision_lab.fixes.catalogue import apply_fixes, model_edits, parse_fix
    from precision_lab.fixes.policy import get_policy

    fix = parse_fix("prescale-norm:4")
    assert fix.value == 4.0 and fix.reason.startswith("divide every normalisation's input by 4 first")
    policy = apply_fixes(get_policy("fp16"), ["prescale-norm:4", "stats-fp32"])
    assert policy == get_policy("fp16").replace(stats_fp32=True)
    assert policy.fixes == ("prescale-norm:4", "stats-fp32")
    assert [f.spec for f in model_edits(policy)] == ["prescale-norm:4"]

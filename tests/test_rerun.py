"""Re-run under a fix (the ledger of runs), the fp32-island search, and their commands."""

import json
import threading

import pytest
import torch
from typer.testing import CliRunner

from precision_lab.fixes.catalogue import FixError, apply_fixes
from precision_lab.fixes.policy import PolicyError, PrecisionPolicy
from precision_lab.fixes.recipes import get_recipe
from precision_lab.services.islands import Tolerance, bisect_fp32_islands, parse_tolerance
from precision_lab.services.rerun import RerunError, capture_recipe, rerun_session
from precision_lab.metrics import compare
from precision_lab.services.report import first_nonfinite


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from precision_lab.store import Store, close_all

    path = tmp_path_factory.mktemp("rerun") / "rerun.duckdb"
    store = Store(path)
    with store.held():  # the file opened once for the reads of the captures, not once per read
        names = {n: capture_recipe(store, n) for n in ("fp8-zero-scale", "fp16-mlp-overflow",
                                                      "softmax-fp16-overflow")}
    yield store, names, path
    close_all()


def _runs(store, session):
    return store.runs(store.session(session).session_id)


def _plain_output_sqnr(recipe, policy):
    ref_m, x = recipe.build()
    m, x2 = recipe.build()
    policy.prepare(m)
    with torch.no_grad():
        return compare(ref_m(x), m(policy.prepare_inputs(x2))).sqnr_db


@pytest.mark.slow
def test_rerun_adds_a_child_run_that_fixes_the_failure(lab):
    store, s, _ = lab
    name = s["fp8-zero-scale"]
    before = _runs(store, name)
    cand = before[before.kind == "candidate"].iloc[0]
    ref = before[before.kind == "reference"].iloc[0]
    seen = []
    run_id = rerun_session(store, name, "scale-fp32", lambda d, t, label: seen.append((d, t, label)))
    assert seen[-1][0] == seen[-1][1] and [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    # the progress says which model run of how many, and what it is doing
    labels = [label for _, _, label in seen]
    assert labels[0].endswith("model run 1 of 2, the fp32 reference") and "model run 2 of 2, " in labels[1]
    assert [lab.split(": ")[-1] for lab in labels[2:]] == ["comparing with the fp32 reference", "diagnosing", "done"]
    runs = _runs(store, name)
    assert len(runs) == len(before) + 1
    new = runs[runs.run_id == run_id].iloc[0]
    assert new.kind == "rerun" and new.parent_run_id == cand.run_id and new.fix == "scale-fp32"
    pol = PrecisionPolicy.from_json(new.policy)
    assert pol.quant.scale_format == "fp32" and pol.fixes == ("scale-fp32",)
    assert first_nonfinite(store, run_id) is None
    assert first_nonfinite(store, cand.run_id) is not None  # the candidate is left as it was
    # accumulated comparisons against the session's stored reference, plus local ones
    kinds = dict(store.sql("SELECT kind, count(*) FROM comparisons WHERE cand_run_id = ? GROUP BY kind",
                           [run_id]).fetchall())
    assert kinds.get("accumulated", 0) > 0 and kinds.get("local", 0) > 0
    assert store.sql("SELECT DISTINCT ref_run_id FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated'",
                     [run_id]).fetchall() == [(ref.run_id,)]
    # the stored output SQNR is the one a plain (uncaptured) forward gives
    sqnr = store.sql("""SELECT sqnr_db FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated'
                        AND op = 'forward.0' AND role = 'output'""", [run_id]).fetchone()[0]
    r = get_recipe("fp8-zero-scale")
    assert sqnr == pytest.approx(_plain_output_sqnr(r, apply_fixes(r.default_policy, "scale-fp32")), abs=1e-6)
    diags = store.df("SELECT rule, severity, run_id FROM diagnoses WHERE session_id = ?",
                     [store.session(name).session_id])
    assert {"fp8-scale", "fix-verified"} <= set(diags.rule)
    assert (diags[diags.rule == "fix-verified"].run_id == run_id).all()


@pytest.mark.slow
def test_rerun_chains_from_a_rerun(lab):
    store, s, _ = lab
    name = s["fp8-zero-scale"]
    first = rerun_session(store, name, ["scale-fp32"])
    second = rerun_session(store, name, "amax-floor:1e-12", parent=first)
    run = store.run(second)
    assert run.parent_run_id == first and run.fix == "amax-floor:1e-12"
    assert PrecisionPolicy.from_json(run.policy).fixes == ("scale-fp32", "amax-floor:1e-12")
    assert run.name.startswith("fix: amax-floor:1e-12")


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(fixes="no-such"), FixError, r"unknown fix 'no-such'"),
    (dict(fixes="keep-fp32:nothing_here"), PolicyError, r"pattern 'nothing_here' matches no module"),
    (dict(fixes="stats-fp32", parent="nope"), RerunError, r"has no run 'nope'"),
    (dict(fixes=[]), RerunError, r"needs at least one fix"),
    (dict(fixes="two-pass-variance", parent="fp32 reference"), RerunError, r"is the fp32 reference"),
])
def test_rerun_refuses_with_a_reason(lab, kwargs, exc, msg):
    store, s, _ = lab
    n = len(_runs(store, s["softmax-fp16-overflow"]))
    with pytest.raises(exc, match=msg):
        rerun_session(store, s["softmax-fp16-overflow"], **kwargs)
    assert len(_runs(store, s["softmax-fp16-overflow"])) == n  # nothing written


def test_rerun_of_a_dump_session_says_to_replay(lab):
    from tests.conftest import SAMPLES
    from precision_lab.services.ingest import ingest

    store = lab[0]
    name = ingest([SAMPLES / "stat_mix_fp16_inner_ovf"], store=store)
    with pytest.raises(RerunError, match=r"holds dumps, not a model: re-running needs the model.*capture --model"):
        rerun_session(store, name, "use-bf16")


@pytest.mark.slow
def test_reruns_from_two_threads(lab):
    store, s, _ = lab
    results, errors = {}, []

    def work(session, fix):
        try:
            results[session] = rerun_session(store, session, fix)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    jobs = [(s["softmax-fp16-overflow"], "stable-softmax"), (s["fp8-zero-scale"], "amax-floor:1")]
    threads = [threading.Thread(target=work, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for session, fix in jobs:
        run = store.run(results[session])
        assert run.fix == fix and first_nonfinite(store, results[session]) is None
        assert run.session_id == store.session(session).session_id


@pytest.mark.slow
def test_bisect_finds_the_fp32_island(lab):
    store, s, _ = lab
    name = s["fp16-mlp-overflow"]
    before = len(_runs(store, name))
    labels = []
    res = bisect_fp32_islands(store, name, tolerance="sqnr>=30", progress=lambda d, t, label: labels.append(label))
    assert res.passed, res.message
    tries = [lab for lab in labels if lab.startswith("model run ")]
    assert tries == [f"model run {i} of at most 16: bisect: {a.fix}" for i, a in enumerate(res.attempts[1:], 1)]
    assert res.modules == ["layers.0.mlp.down_proj", "layers.0.residual", "norm"]
    runs = _runs(store, name)
    cand = runs[runs.kind == "candidate"].run_id.iloc[0]
    assert res.attempts[0].run_id == cand and res.attempts[0].modules == ()  # starts from the candidate
    # the candidate's output holds NaN (independently: the recipe run under its policy), so that try has no SQNR:
    # the SQNR of its finite values would rank a broken output above a working one
    recipe = get_recipe("fp16-mlp-overflow")
    model, x = recipe.build()
    recipe.default_policy.prepare(model)
    with torch.no_grad():
        out = model(recipe.default_policy.prepare_inputs(x))
    assert 0 < int((~torch.isfinite(out)).sum()) < out.numel()
    assert res.attempts[0].sqnr_db is None
    assert all(a.sqnr_db is not None and a.sqnr_db >= 30 for a in res.attempts if a.passed)
    assert len(runs) == before + len(res.attempts) - 1  # every other try is stored
    for a in res.attempts[1:]:
        kind, parent, fix = store.sql("SELECT kind, parent_run_id, fix FROM runs WHERE run_id = ?",
                                      [a.run_id]).fetchone()
        assert kind == "rerun" and parent == cand and fix == a.fix
    for a in res.attempts:
        assert (first_nonfinite(store, a.run_id) is None) == (a.nonfinite == 0)
    final = res.final_run_id
    assert final is not None and first_nonfinite(store, final) is None
    # dropping any island module breaks it again (the island is minimal)
    for m in res.modules:
        others = "+".join(f"keep-fp32:{x}" for x in res.modules if x != m)
        pol = apply_fixes(get_recipe("fp16-mlp-overflow").default_policy, others)
        model, x = get_recipe("fp16-mlp-overflow").build()
        pol.prepare(model)
        with torch.no_grad():
            assert not torch.isfinite(model(pol.prepare_inputs(x))).all() or m == "layers.0.residual"


@pytest.mark.slow
def test_bisect_budget(lab):
    store, s, _ = lab
    res = bisect_fp32_islands(store, s["fp16-mlp-overflow"], tolerance=30.0, max_runs=2)
    # the starting run and two new ones
    assert not res.passed and "stopped after 2 runs" in res.message and len(res.attempts) == 3


@pytest.mark.parametrize("text, tol", [
    ("30", Tolerance(30.0)), ("sqnr>=25.5", Tolerance(25.5)), ("SQNR>=40dB", Tolerance(40.0)),
    ("nonfinite", Tolerance(None)), ("sqnr>=30,allow-nonfinite", Tolerance(30.0, True)),
])
def test_parse_tolerance(text, tol):
    assert parse_tolerance(text) == tol


def test_parse_tolerance_error():
    with pytest.raises(RerunError, match=r"tolerance 'loose': cannot read 'loose'"):
        parse_tolerance("loose")


@pytest.mark.slow
def test_cli_rerun_bisect_recipes(lab):
    from precision_lab.cli import app

    store, s, path = lab
    runner = CliRunner()
    res = runner.invoke(app, ["rerun", "--session", s["softmax-fp16-overflow"], "--fix", "keep-fp32:attn.softmax",
                              "--db", str(path)])
    assert res.exit_code == 0, res.output
    assert "no NaN or inf anywhere in the run" in res.output and "fix-verified" in res.output
    res = runner.invoke(app, ["rerun", "--session", s["softmax-fp16-overflow"], "--fix", "use-bf16", "--fix",
                              "stable-softmax", "--db", str(path)])
    assert res.exit_code == 0 and "fix use-bf16+stable-softmax" in res.output
    res = runner.invoke(app, ["rerun", "--session", "missing", "--fix", "use-bf16", "--db", str(path)])
    assert res.exit_code == 2 and "no session named 'missing'" in res.output
    res = runner.invoke(app, ["rerun", "--session", s["softmax-fp16-overflow"], "--fix", "eps:zero", "--db",
                              str(path)])
    assert res.exit_code == 2 and "'zero' is not a number" in res.output
    res = runner.invoke(app, ["bisect", "--session", s["softmax-fp16-overflow"], "--tolerance", "sqnr>=30",
                              "--db", str(path)])
    assert res.exit_code == 0, res.output
    assert "fp32 island: attn.softmax" in res.output
    res = runner.invoke(app, ["recipes"])
    assert res.exit_code == 0 and "fp16-mlp-overflow" in res.output and "fixed by:" in res.output
    res = runner.invoke(app, ["fixes"])
    assert res.exit_code == 0 and "keep-fp32:layers.0.mlp.down_proj" in res.output


@pytest.mark.slow
def test_cli_capture_with_fix_then_report_diagnoses(tmp_path):
    """`capture --recipe R` shows the failure; the diagnosis's first fix, passed as --fix, removes it."""
    from precision_lab.cli import app

    db = str(tmp_path / "cap.duckdb")
    runner = CliRunner()
    res = runner.invoke(app, ["capture", "--recipe", "fp16-layernorm", "--db", db])
    assert res.exit_code == 0, res.output
    assert "first non-finite at ln." in res.output
    assert "diagnosis [error]" in res.output and ": ln: `ln` in fp16:" in res.output
    assert "fixes (best first): stats-fp32" in res.output
    res = runner.invoke(app, ["report", "--session", "fp16-layernorm", "--json", "--db", db])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    diag = [d for d in rep["diagnoses"] if d["rule"] == "norm-statistics"]
    assert diag and diag[0]["op"] == "ln" and "flush-to-zero" in diag[0]["message"]
    res = runner.invoke(app, ["capture", "--recipe", "fp16-layernorm", "--fix", diag[0]["fixes"][0], "--db", db])
    assert res.exit_code == 0, res.output
    assert "first non-finite" not in res.output and res.output.count("no NaN/Inf") == 2


@pytest.mark.slow
def test_verify_says_which_suggested_fixes_leave_the_run_finite(tmp_path):
    """calibration-nan: eps works; sanitising the norm works too (its 0/0 NaN stays inside the norm, replaced at
    its output, and never reaches the model's output); calibrating on finite values leaves NaN; the verdicts come
    from the re-runs, checked independently."""
    from typer.testing import CliRunner

    from precision_lab.cli import app
    from precision_lab.services.rerun import capture_recipe
    from precision_lab.services.report import first_nonfinite
    from precision_lab.services.verify import verification
    from precision_lab.store import Store

    db = tmp_path / "v.duckdb"
    store = Store(db)
    name = capture_recipe(store, "calibration-nan")
    got = CliRunner().invoke(app, ["verify", "-s", name, "--db", str(db), "--top", "3"])
    assert got.exit_code == 0, got.output
    lines = [ln.split() for ln in got.output.splitlines() if ln.strip()]
    verdicts = {ln[1]: ln[0] for ln in lines if ln[0] in ("works", "fails")}
    assert verdicts == {"eps:1e-6": "works", "sanitize-nonfinite:norm": "works", "calibrate-finite-only": "fails"}
    sanitized = next(v for (_, fix), v in verification(store, name).by_fix.items() if fix == "sanitize-nonfinite:norm")
    inside = store.sql("SELECT count(*) FROM tensors WHERE run_id = ? AND nonfinite AND op LIKE 'norm.%'",
                       [sanitized.run_id]).fetchone()[0]
    assert inside > 0  # the NaN is still made inside the norm: intended now, since nothing after it sees it
    for (parent, fix), v in verification(store, name).by_fix.items():
        assert v.works == (first_nonfinite(store, v.run_id) is None)
        assert (verdicts[fix] == "works") == v.works
    # the text, JSON and HTML reports list each fix tried with what it gave, as the Overview's buttons say it
    import json

    from precision_lab.services.report import build_report, render_text, to_json
    from precision_lab.ui.html_report import render_html

    report = build_report(store, name)
    runs = store.runs(store.session(name).session_id)
    parent = runs[runs.kind != "reference"].iloc[0]["name"]  # the candidate the fixes are for
    tried = {v.fix: v for v in report.fixes_tried}
    assert {f: v.works for f, v in tried.items()} == {f: verdicts[f] == "works" for f in verdicts}
    assert {v.parent for v in tried.values()} == {parent}
    text = render_text(report)
    assert "Fixes tried (3):" in text
    for fix, v in tried.items():
        assert f"{parent}: {fix} -> {v.run}: {v.outcome()}" in text
        assert v.outcome().startswith("works") == v.works
    doc = json.loads(to_json(report))
    assert [(d["fix"], d["works"]) for d in doc["fixes_tried"]] == [(v.fix, v.works) for v in report.fixes_tried]
    page = render_html(store, name)
    assert "Fixes tried (3)" in page and all(v.run in page for v in tried.values())
    # a second verify re-runs nothing: the verdicts are already in the re-runs
    n = store.sql("SELECT count(*) FROM runs").fetchone()[0]
    assert CliRunner().invoke(app, ["verify", "-s", name, "--db", str(db)]).exit_code == 0
    assert store.sql("SELECT count(*) FROM runs").fetchone()[0] == n

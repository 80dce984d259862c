"""``precision-lab capture --model FILE.py:FUNCTION --inputs ...``: a user's own model, captured, diagnosed and
re-run under a fix from the command line; entry points recorded by a session are never run on their own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.fixes.recipes import MODELS_ENV, RECIPES
from precision_lab.services.report import first_nonfinite
from precision_lab.store import Store, close_all
from precision_lab.store import queries as q

MODEL = str(Path(__file__).parent / "models" / "qwen2_overflow.py")


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def _capture(tmp_path_factory):
    """One capture of the model for the module (its own database and data folder, as each test has)."""
    root = tmp_path_factory.mktemp("entry_points")
    db = root / "m.duckdb"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISION_LAB_DB", str(root / "default.duckdb"))
        mp.setenv("XDG_DATA_HOME", str(root / "xdg"))
        res = _cli("capture", "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs", "--dtype", "fp16",
                   "--db", db, "--no-local")
        assert res.exit_code == 0, res.output
    close_all()
    return db


@pytest.fixture
def captured(_capture, tmp_path):
    """A copy of the module's capture, for this test to read and re-run."""
    db = tmp_path / "m.duckdb"
    shutil.copy(_capture, db)
    # another process knows nothing of the entry points: forget them here too
    for name in [n for n in RECIPES if n.startswith("model:")]:
        RECIPES.unregister(name)
    yield db
    close_all()


def test_capture_names_the_overflow_in_the_users_model(captured):
    store = Store(captured)
    info = store.session("build")
    runs = {r.kind: r for r in q.session_runs(store, info.session_id)}
    assert first_nonfinite(store, runs["reference"].run_id) is None
    f = first_nonfinite(store, runs["candidate"].run_id)
    assert f.op.startswith("model.layers.1.mlp.down_proj.")
    assert info.recipe.startswith("model:model=") and "qwen2_overflow.py:build" in info.recipe


@pytest.mark.slow
def test_rerun_needs_the_entry_points_again_and_then_fixes_it(captured, monkeypatch):
    monkeypatch.delenv(MODELS_ENV, raising=False)
    res = _cli("rerun", "--session", "build", "--fix", "use-bf16", "--db", captured)
    assert res.exit_code == 2
    assert "never run on their own" in res.output and f"--model {MODEL}:build" in res.output
    other = _cli("rerun", "--session", "build", "--fix", "use-bf16", "--db", captured,
                 "--model", f"{MODEL}:inputs", "--inputs", f"{MODEL}:inputs")
    assert other.exit_code == 2 and "was captured from the model entry points" in other.output
    res = _cli("rerun", "--session", "build", "--fix", "use-bf16", "--db", captured,
               "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs")
    assert res.exit_code == 0, res.output
    assert "no NaN or inf anywhere in the run" in res.output
    store = Store(captured)
    runs = q.session_runs(store, store.session("build").session_id)
    rerun = next(r for r in runs if r.kind == "rerun")
    assert rerun.fix == "use-bf16" and first_nonfinite(store, rerun.run_id) is None


@pytest.mark.slow
def test_a_server_may_allow_a_model_for_re_runs(captured, monkeypatch):
    # the model alone is not enough: a session also names the inputs function, which would run too
    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build")
    res = _cli("rerun", "--session", "build", "--fix", "use-bf16", "--db", captured)
    assert res.exit_code == 2 and "never run on their own" in res.output
    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build,{MODEL}:inputs")
    res = _cli("rerun", "--session", "build", "--fix", "use-bf16", "--db", captured)
    assert res.exit_code == 0, res.output


def test_a_session_naming_other_inputs_is_not_run_on_an_allowed_model(monkeypatch, tmp_path):
    """A shared session could name an allowed model with inputs of its own choosing: nothing of it runs."""
    from precision_lab.fixes.recipes import get_recipe, RecipeNotFound

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"def inputs():\n    open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build")
    with pytest.raises(RecipeNotFound, match="never run on their own"):
        get_recipe(f"model:model={MODEL}:build|inputs={evil}:inputs")
    assert not marker.exists()


def test_bad_entry_points_are_one_sentence(tmp_path):
    db = tmp_path / "m.duckdb"
    for args, words in (((("--model", f"{MODEL}:nope", "--inputs", f"{MODEL}:inputs")), "has no function 'nope'"),
                        ((("--model", str(tmp_path / "missing.py") + ":f", "--inputs", f"{MODEL}:inputs")), "no file"),
                        ((("--model", f"{MODEL}:build")), "--model needs --inputs"),
                        ((("--recipe", "fp16-layernorm", "--model", f"{MODEL}:build")), "not both")):
        res = _cli("capture", *args, "--db", db)
        assert res.exit_code == 2 and words in res.output, res.output
        assert "Traceback" not in res.output


@pytest.mark.slow
def test_an_fp32_island_keeps_every_other_name_aligned(tmp_path):
    """keep-fp32 islands cast at their boundary: those casts are recorded under the island's (or its consumer's)
    own name, so every other record of the re-run pairs exactly with the reference."""
    from precision_lab.fixes.recipes import entry_point_recipe, register_recipe
    from precision_lab.services.rerun import capture_recipe, rerun_session

    recipe = register_recipe(entry_point_recipe(f"{MODEL}:build", f"{MODEL}:inputs"), replace=True)
    store = Store(tmp_path / "i.duckdb")
    name = capture_recipe(store, recipe, local_error=False)
    run_id = rerun_session(store, name, "keep-fp32:model.layers.1.mlp.down_proj+keep-fp32:model.norm")
    rows = store.sql("SELECT op, match FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated'",
                     [run_id]).fetchall()
    off = {op for op, match in rows if match != "exact"}
    assert off == {"model.layers.1.mlp.down_proj.to.0", "lm_head.to.0"}  # into the island; out of model.norm
    assert sum(1 for _, m in rows if m == "exact") == len(rows) - 4 > 300
    assert first_nonfinite(store, run_id) is None  # the island fixes the overflow


@pytest.mark.slow
def test_dashboard_verifies_the_suggestions_on_the_users_model(captured, monkeypatch):
    """A Qwen2 model from config, captured by entry point and allowed by the server: Overview's "Verify the
    suggestions" re-runs the proposed fixes; at least one leaves the run finite, and its button says so with the
    output SQNR read from the re-run."""
    from precision_lab.services.verify import suggestions, verification
    from ui_fixtures import assert_clean, open_page, serve_db

    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build,{MODEL}:inputs")
    with serve_db(captured, monkeypatch):
        store = Store(captured)
        want = suggestions(store, "build", top=3)
        assert want
        at = open_page("overview", session="build")
        at.button(key="verify_fixes").click().run()
        assert_clean(at)
        jobs = at.session_state["_pl_verify"]
        assert [j.fix for j in jobs] == [s.fix for s in want]
        assert all(j.wait(600) and j.error is None for j in jobs), [j.error for j in jobs]
        at.run()
        assert_clean(at)
        got = verification(store, "build")
        works = [s for s in want if got.get(s.parent, s.label).works]
        assert works, got
        for s in works:
            run_id = got.get(s.parent, s.label).run_id
            assert first_nonfinite(store, run_id) is None
        labels = [b.label.replace("\\", "") for b in at.button if b.key and b.key.startswith("rerun_")]
        assert any(lab.startswith(f"Open fix: {works[0].label}: works") for lab in labels), labels


def test_fixes_lists_what_applies_to_the_users_model(captured):
    res = _cli("fixes", "--session", "build", "--db", captured, "--model", f"{MODEL}:build", "--inputs",
               f"{MODEL}:inputs")
    assert res.exit_code == 0, res.output
    got = {}
    header, *lines = res.output.splitlines()
    assert header.split()[:2] == ["applies", "fix"]
    for line in lines:
        verdict, spec = line.split()[:2]
        got[spec.split(":")[0]] = (verdict, spec, line)
    applies = {k for k, (v, _, _) in got.items() if v == "applies"}
    # cast, island and sanitise fixes reach any module; the epsilon reaches Qwen2's own RMSNorm
    assert {"use-bf16", "keep-fp32", "sanitize-nonfinite", "eps"} <= applies
    assert got["keep-fp32"][1] == "keep-fp32:model.layers.1.mlp.down_proj"  # the first non-finite producer
    # fp8 scale fixes need an fp8 policy, compile fixes a compiled run; options no module of Qwen2 reads
    for name in ("scale-fp32", "amax-floor", "scaling", "emulate-precision-casts", "eager", "keep-subnormals"):
        assert got[name][0] == "no", got[name]
    for name in ("stable-softmax", "stats-fp32", "two-pass-variance"):
        assert got[name][0] == "no" and "changes nothing in this model" in got[name][2], got[name]
    assert set(got) == set(_catalogue())


def _catalogue():
    from precision_lab.fixes.catalogue import FIXES

    return list(FIXES)


def test_fixes_on_a_session_without_a_model_is_one_sentence(captured):
    res = _cli("fixes", "--session", "build", "--db", captured)  # entry points not given again
    assert res.exit_code == 2 and "never run on their own" in res.output and "Traceback" not in res.output
    res = _cli("fixes", "--session", "nope", "--db", captured)
    assert res.exit_code == 2 and "nope" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_verify_grows_an_island_along_the_data_flow_when_no_suggestion_works(captured):
    """With no suggestion tried (--top 0), --grow keeps modules in fp32 from the first non-finite producer
    onwards until the run is finite, then drops those it does not need; the island it reports was verified by
    its own stored re-run."""
    res = _cli("verify", "--session", "build", "--top", "0", "--grow", "--tolerance", "nonfinite", "--db", captured,
               "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "grown along the data flow" in ln)
    assert line.split()[0] == "works"
    island = line.split()[1]
    assert island.startswith("keep-fp32:model.layers.1.mlp.down_proj")  # from the producer onwards
    store = Store(captured)
    runs = q.session_runs(store, store.session("build").session_id)
    final = next(r for r in runs if r.fix == island)
    assert first_nonfinite(store, final.run_id) is None
    assert len({r.fix for r in runs if r.kind == "rerun"}) >= 2  # the growth itself was stored


@pytest.mark.slow
def test_dashboard_grows_an_island_on_the_users_model(captured, monkeypatch):
    """Overview's "Grow an fp32 island" runs the growth in the server's worker processes and opens the island's
    run, which is finite; once a run of the session works, the button is gone."""
    from ui_fixtures import assert_clean, open_page, serve_db

    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build,{MODEL}:inputs")
    with serve_db(captured, monkeypatch):
        at = open_page("overview", session="build")
        at.button(key="grow_island").click().run()
        assert_clean(at)
        job = at.session_state["_pl_rerun"]
        assert job.wait(600) and job.error is None, job.error
        assert job.fix.startswith("keep-fp32:model.layers.1.mlp.down_proj")
        at.run()
        assert_clean(at)
        store = Store(captured)
        assert first_nonfinite(store, job.run_id) is None
        again = open_page("overview", session="build")
        assert not [b for b in again.button if b.key == "grow_island"]


MASKED = str(Path(__file__).parent / "models" / "masked_overflow.py")


@pytest.mark.slow
def test_grow_finds_a_finite_island_on_a_model_with_a_minus_inf_mask(tmp_path):
    """The model masks its scores with masked_fill(-inf) in every run: that -inf is intended, so the island
    search counts only the overflow and stops at the module that makes it, not at the whole model."""
    db = tmp_path / "mask.duckdb"
    res = _cli("capture", "--model", f"{MASKED}:build", "--inputs", f"{MASKED}:inputs", "--dtype", "fp16",
               "--db", db, "--no-local")
    assert res.exit_code == 0, res.output
    store = Store(db)
    runs = {r.kind: r for r in q.session_runs(store, store.session("build").session_id)}
    assert first_nonfinite(store, runs["reference"].run_id) is None  # fp32 holds only the mask's -inf
    assert q.count_records(store, runs["reference"].run_id, nonfinite=True) > 0
    f = first_nonfinite(store, runs["candidate"].run_id)
    assert f.op.startswith("blocks.1.down.") and f.origin == "op"
    close_all()
    res = _cli("verify", "--session", "build", "--top", "0", "--grow", "--tolerance", "nonfinite", "--db", db,
               "--model", f"{MASKED}:build", "--inputs", f"{MASKED}:inputs")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "grown along the data flow" in ln)
    assert line.split()[0] == "works", res.output
    island = line.split()[1]
    # the overflow and what reads it; never the whole model (keep-fp32 of the root)
    assert island.startswith("keep-fp32:blocks.1.down") and "keep-fp32:+" not in island + "+"
    store = Store(db)
    final = next(r for r in q.session_runs(store, store.session("build").session_id) if r.fix == island)
    assert first_nonfinite(store, final.run_id) is None
    assert q.count_records(store, final.run_id, nonfinite=True) > 0  # the mask is still there


@pytest.mark.slow
def test_a_partial_island_names_the_cast_into_fp16_not_a_square_computed_in_fp32(tmp_path):
    """Keeping only the down projection in fp32 sends a value past fp16's max into the final norm, still in fp32:
    the first failure is its cast to fp16 there (Qwen2's RMSNorm squares in fp32), and the diagnosis says so."""
    import numpy as np
    import torch

    from precision_lab.fixes.catalogue import apply_fixes
    from precision_lab.fixes.recipes import entry_point_recipe, register_recipe
    from precision_lab.fixes.rules import fmt_num
    from precision_lab.services.diagnose import diagnose
    from precision_lab.services.rerun import capture_recipe, rerun_session

    fix = "keep-fp32:model.layers.1.mlp.down_proj"
    recipe = register_recipe(entry_point_recipe(f"{MODEL}:build", f"{MODEL}:inputs"), replace=True)
    # independent: the norm's input under that island, from a plain forward with a hook
    model, inputs = recipe.build()
    policy = apply_fixes(recipe.default_policy, fix)
    model = policy.prepare(model) or model
    seen = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].detach()), prepend=True)
    with torch.no_grad():
        model(**policy.prepare_inputs(inputs))
    x = seen["x"]
    absmax = float(x.abs().max())
    assert x.dtype == torch.float32 and absmax > float(np.finfo(np.float16).max)
    store = Store(tmp_path / "p.duckdb")
    name = capture_recipe(store, recipe, local_error=False)
    run_id = rerun_session(store, name, fix)
    cards = [d for d in diagnose(store, name) if d.run_id == run_id and d.op == "model.norm"]
    assert cards, [(d.run_id, d.op) for d in diagnose(store, name)]
    msg = cards[0].message
    assert "x^2" not in msg and "mean(x^2)" not in msg
    assert f"input absmax {fmt_num(absmax)} arrives in fp32" in msg and "casting it to fp16 gives inf" in msg
    assert "keep-fp32:model.norm" in cards[0].fixes and "stats-fp32" not in cards[0].fixes


@pytest.mark.slow
def test_a_fixed_run_is_judged_in_its_own_format_not_fp32s(tmp_path):
    """With the island that fixes it, the model's module calls output fp32 (the island's end) but compute in fp16:
    their local error is measured in fp16's unit roundoff, so the fixed run gets no precision-loss warning
    offering to keep the whole model in fp32."""
    import numpy as np

    from precision_lab.fixes.recipes import entry_point_recipe, register_recipe
    from precision_lab.services.diagnose import diagnose
    from precision_lab.services.rerun import capture_recipe, rerun_session

    recipe = register_recipe(entry_point_recipe(f"{MODEL}:build", f"{MODEL}:inputs"), replace=True)
    store = Store(tmp_path / "f.duckdb")
    name = capture_recipe(store, recipe)
    run_id = rerun_session(store, name, "keep-fp32:model.layers.1.mlp.down_proj+keep-fp32:model.norm")
    assert first_nonfinite(store, run_id) is None
    rows = store.sql("""SELECT t.dtype, c.cand_format, c.sqnr_db, c.rounding_units, c.verdict FROM comparisons c
                        JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                        WHERE c.cand_run_id = ? AND c.kind = 'local' AND c.op = 'model.forward.0'""",
                     [run_id]).fetchall()
    assert rows
    u16 = float(np.finfo(np.float16).eps) / 2
    for dtype, fmt, sqnr, units, verdict in rows:
        assert dtype == "float32" and fmt == "fp16"  # an fp32 output of fp16 arithmetic
        assert units == pytest.approx(10 ** (-sqnr / 20) / u16, rel=1e-6)
        assert verdict != "error"
    assert not [d for d in diagnose(store, name) if d.run_id == run_id and d.rule == "precision-loss"]


def test_two_threads_loading_entry_points_at_once_get_the_package_a_model_file_imports(tmp_path, monkeypatch):
    """A package that replaces itself in sys.modules as its import ends (as ``transformers`` does) and is first
    imported by two threads' model files at once: both see the package it put there, not the module from before
    the swap (which lacks its names: "module 'transformers' has no attribute 'Qwen2ForCausalLM'")."""
    import sys
    import threading

    from precision_lab.fixes.recipes import load_entry_point

    pkg = f"swapping_pkg_{tmp_path.name}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text(
        "import sys, time, types\ntime.sleep(0.5)\nm = types.ModuleType(__name__)\nm.MODEL = 'built'\n"
        "sys.modules[__name__] = m\n")
    files = []
    for i in range(2):
        files.append(tmp_path / f"model_{i}.py")
        files[-1].write_text(f"import {pkg}\n\n\ndef build():\n    return {pkg}.MODEL\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = {}

    def load(i):
        try:
            got[i] = load_entry_point(f"{files[i]}:build")()
        except Exception as e:  # noqa: BLE001 - compared below
            got[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.delitem(sys.modules, pkg)
    assert got == {0: "built", 1: "built"}

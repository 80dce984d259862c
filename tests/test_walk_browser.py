"""A practitioner's whole path in Chromium, on a ``transformers`` model: capture → Overview → Op detail of the first
failure → re-run with a fix → Diff card → HTML report.

The model is ``tests/models/qwen2_overflow.py`` (a 2-layer Qwen2 built from config, random weights, whose layer-1
MLP down projection overflows fp16), captured in fp16 with local error, as ``precision-lab capture --model`` does.
Every number the pages show is checked against plain torch run here: the first module whose fp16 output leaves
fp16's range, and its absmax in fp32 beyond fp16's max. Uses the server and browser fixtures of
``test_browser.py`` (same skip rule, see conftest.py). Screenshots: ``test-artifacts/browser-walk-*.png``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from test_browser import _idle, _shot, page, server  # noqa: F401  (fixtures)
from test_browser_truth import _table_with

pytestmark = pytest.mark.browser

MODEL = str(Path(__file__).parent / "models" / "qwen2_overflow.py")
SESSION = "build"  # capture names the session after the model's entry point


def _first_overflow_in_torch() -> tuple[str, float]:
    """Independently of the capture: the first Linear (in execution order) whose fp16 output holds Inf, and the
    absmax of its output in an fp32 run of the same model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("walk_model", MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    outs: dict = {}

    def run(model, key):
        order = []
        hooks = [m.register_forward_hook(lambda m, a, o, n=n: order.append((n, o.detach().double())))
                 for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            model(**mod.inputs())
        for h in hooks:
            h.remove()
        outs[key] = order

    run(mod.build(), "fp32")
    run(mod.build().half(), "fp16")
    name = next(n for n, o in outs["fp16"] if not torch.isfinite(o).all())
    return name, float(dict(outs["fp32"])[name].abs().max())


@pytest.fixture
def captured(tmp_path, monkeypatch):
    """The model captured into the database the server will open; the server (started after this fixture) is
    allowed to run it for re-runs."""
    from precision_lab.cli import app
    from precision_lab.fixes.recipes import MODELS_ENV, RECIPES
    from precision_lab.store import close_all

    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build,{MODEL}:inputs")
    res = CliRunner().invoke(app, ["capture", "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs",
                                   "--dtype", "fp16", "--db", str(tmp_path / "browser.duckdb")])
    assert res.exit_code == 0, res.output
    for name in [n for n in RECIPES if n.startswith("model:")]:
        RECIPES.unregister(name)
    close_all()  # the server's process opens the file next
    return tmp_path / "browser.duckdb"


def _metric(pg, card, label: str):
    got = card.locator("[data-testid='stMetric']", has_text=label)
    got.first.wait_for()
    assert got.count() == 1
    return got.first


def test_capture_to_verified_fix_and_report(captured, server, page, tmp_path):  # noqa: F811
    pg = page
    want_op, want_absmax = _first_overflow_in_torch()
    assert want_op == "model.layers.1.mlp.down_proj"
    assert want_absmax > float(torch.finfo(torch.float16).max)  # past fp16's range in fp32: a real overflow
    try:
        _walk(pg, server, tmp_path, want_op, want_absmax)
    except Exception:
        _shot(pg, "browser-walk-failure.png")
        raise


def _walk(pg, server, tmp_path, want_op, want_absmax):
    # Overview names the first failing op, and no capture hook failed anywhere
    pg.goto(f"{server}/overview?session={SESSION}")
    first = pg.get_by_text("first non-finite producer:").first
    first.wait_for()
    _idle(pg)
    first_line = first.inner_text()
    assert f"{want_op}." in first_line, first_line
    op = first_line.split("producer:")[1].split("(")[0].strip()
    assert op.startswith(f"{want_op}.")
    assert "hook error" not in pg.inner_text("body")
    _shot(pg, "browser-walk-overview.png")

    # Op detail of the first failure: its values drawn against fp16, overflowing
    pg.get_by_role("button", name="Open this op").first.click()
    pg.get_by_role("heading", name="Op detail").wait_for()
    # the page's own run may not have begun when the heading shows (the navigation draws it): wait for its
    # content to name the op, or time out
    pg.get_by_text(op).first.wait_for()
    _idle(pg)
    assert "/op_detail" in pg.url
    assert op in pg.inner_text("body")
    heads, rows = _table_with(pg, "headroom (bits)")
    this = [dict(zip(heads, r)) for r in rows if r[heads.index("record")].endswith("(this)")]
    assert this and all(r["overflows"].startswith("yes") for r in this), rows
    assert any(r["absmax"] == "inf" for r in this), rows  # the fp16 output holds inf
    _shot(pg, "browser-walk-op-detail.png")

    # re-run with the first proposed fix, from the Overview's diagnosis card
    pg.goto(f"{server}/overview?session={SESSION}")
    button = pg.get_by_role("button", name="Re-run with use-bf16")
    button.first.wait_for()
    _idle(pg)
    button.first.click()
    pg.get_by_role("heading", name="Diff").wait_for(timeout=180_000)
    _idle(pg)

    # the Diff card: the fixed run finite, credited with a finite SQNR, and no delta against a NaN output
    pg.get_by_text("fix: use-bf16").first.wait_for()
    card = pg  # the session's one re-run: one card
    assert _metric(pg, card, "records with unexpected NaN/Inf").locator("[data-testid='stMetricValue']").inner_text() == "0"
    assert _metric(pg, card, "first non-finite op").locator("[data-testid='stMetricValue']").inner_text() == "none"
    sqnr = _metric(pg, card, "output SQNR")
    value = float(sqnr.locator("[data-testid='stMetricValue']").inner_text())
    assert np.isfinite(value) and value > 20  # bf16 against fp32: a working output
    assert sqnr.locator("[data-testid='stMetricDelta']").count() == 0  # no difference with a broken output
    assert "hook error" not in pg.inner_text("body")
    # below the card, every run side by side at the op the fix was for: the reference's absmax as torch has it
    heads, rows = _table_with(pg, "fp32 reference: absmax")
    out = next(dict(zip(heads, r)) for r in rows if r[heads.index("op")] == op and r[heads.index("role")] == "output")
    assert float(out["fp32 reference: absmax"]) == pytest.approx(want_absmax, rel=5e-3)
    _shot(pg, "browser-walk-diff.png")

    # the HTML report, downloaded from the Overview and opened offline: the same story
    pg.goto(f"{server}/overview?session={SESSION}")
    report = pg.get_by_role("button", name="HTML report")
    report.first.wait_for()
    _idle(pg)
    with pg.expect_download() as got:
        report.first.click()
    path = tmp_path / "walk.html"
    got.value.save_as(path)
    offline = pg.context.browser.new_context(offline=True).new_page()
    offline.goto(path.as_uri())
    assert offline.inner_text("#session-name") == SESSION
    text = offline.inner_text("body")
    assert op in text and "hook error" not in text
    runs = offline.evaluate("""Array.from(document.querySelectorAll('table')[0].rows).map(
        r => Array.from(r.cells).map(c => c.textContent.trim()))""")
    head, body = runs[0], runs[1:]
    fixed = [dict(zip(head, r)) for r in body if "use-bf16" in r]
    assert len(fixed) == 1 and fixed[0]["non-finite records"] == "0"
    firsts = offline.evaluate("""Array.from(document.querySelectorAll('table')[1].rows).map(
        r => Array.from(r.cells).map(c => c.textContent.trim()))""")
    by_run = {r[0]: r[1] for r in firsts[1:]}
    assert by_run[fixed[0]["run"]].startswith("none")
    assert sum(v == op for v in by_run.values()) == 1  # the fp16 candidate, at the same op
    _shot(offline, "browser-walk-report.png")

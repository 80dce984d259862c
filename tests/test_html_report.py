"""The static HTML report: self-contained, numbers that match an independent
computation, and a page that renders offline in a real browser."""

import json
import math
import re

import numpy as np
import pytest

from precision_lab.ui.html_report import render_html, write_html
from test_share import make_session
from ui_fixtures import CHROMIUM, CHROMIUM_ARGS

from conftest import SAMPLES  # noqa: E402


def _body(page: str) -> str:
    """The page without the inlined plotly.js bundle (which has its own strings)."""
    head_end = page.index("</head>")
    return page[head_end:]


@pytest.mark.slow
def test_page_is_self_contained(store, tmp_path):
    make_session(store, "demo")
    path = write_html(store, "demo", tmp_path / "r.html")
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    # plotly.js itself is inlined, nothing is loaded from elsewhere
    assert "Plotly" in page and len(page) > 1_000_000
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"<link[^>]*\bhref=", page)
    assert "cdn.plot.ly" not in _body(page)
    assert "default-src 'none'" in page  # the browser refuses any fetch
    # exactly the two plots, each as a plotly div
    assert 'id="plot-error"' in page and 'id="plot-focus"' in page


@pytest.mark.slow
def test_tables_hold_the_numbers(store, tmp_path):
    made = make_session(store, "demo")
    page = _body(render_html(store, "demo"))
    # run table: record counts
    assert re.search(r'<td class="name">fp16</td><td>candidate</td><td>float16</td>.*?<td class="num">6</td>'
                     r'<td class="num">1</td>', page)
    # first non-finite producer: the op whose value overflowed fp16 (1e6 > 65504)
    assert '<td class="name">blocks.5.fc</td><td>Linear</td><td>step 0, rank 0, seq 5</td>' in page
    # largest errors: max |ref - cand| of a finite op, computed here in float64
    for i in range(5):
        xr = made["arrays"][(f"blocks.{i}.fc", "ref")].astype(np.float64)
        xc = made["arrays"][(f"blocks.{i}.fc", "cand")].astype(np.float64)
        want = f"{np.max(np.abs(xr - xc)):.6g}"
        row = re.search(rf'<td class="name">blocks\.{i}\.fc</td>.*?</tr>', page).group(0)
        assert f'<td class="num">{want}</td>' in row, (i, want, row)
    # diagnoses and warnings
    assert "output exceeds fp16 max" in page and "bf16, fp32_island" in page
    assert "extra.txt" in page and "not a tensor file; skipped" in page
    assert "Warnings (2)" in page


@pytest.mark.slow
def test_focus_plot_uses_the_format_of_the_failing_op(store):
    make_session(store, "demo")
    page = render_html(store, "demo")
    div = page[page.index('id="plot-focus"'):]
    # the histogram overlays fp16 limits (the candidate's own format) as data, not literals
    from precision_lab.formats import get_format

    assert "fp16 max: 65504" in div
    assert f"{get_format('fp16').max:.6g}" == "65504"
    assert "blocks.5.fc.output.0 (first non-finite producer)" in div


@pytest.mark.slow
def test_statistics_only_session(store, tmp_path):
    from precision_lab.services.ingest import ingest

    name = ingest(SAMPLES / "stat_mix_fp16_inner_ovf", reference=SAMPLES / "stat_mix_fp32_inner_ovf", store=store)
    page = _body(render_html(store, name))
    assert 'id="plot-error"' in page and 'id="plot-focus"' in page
    # no element-wise error: the plot draws how far the summaries moved, and says so
    err = page[page.index('id="plot-error"'):page.index('id="plot-focus"')]
    assert "summary relative error" in err and "summary_rel_err %{y" in err
    import base64

    line = json.loads(re.search(r'Plotly\.newPlot\(\s*"plot-error",\s*(\[.*?\]),\s*\{', err, re.S).group(1))[0]
    y = line["y"]  # plotly writes numbers as typed arrays
    y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]) if isinstance(y, dict) else np.array(y, float)
    assert np.isfinite(y).sum() > 10  # the values are there, not an empty axis
    assert "<th>max rel err</th><th>summary abs err</th><th>summary rel err</th>" in page
    # independently: the first entry of the raw dump.json whose inputs' Max/Min are finite and whose output's
    # are not (a non-finite Norm alone is the dump's fp16 arithmetic, not the values)
    raw = json.loads(next((SAMPLES / "stat_mix_fp16_inner_ovf").rglob("dump.json")).read_text())["data"]

    def finite(items):
        return all(math.isfinite(t["Max"]) and math.isfinite(t["Min"]) for t in items if isinstance(t, dict)
                   and "Max" in t)

    want = next(k for k, v in raw.items() if finite(v.get("input_args", [])) and not finite(v.get("output", [])))
    assert want == "Functional.linear.10.forward"
    row = re.search(r'<td class="name">[^<]*fp16[^<]*</td><td class="name">([^<]*)</td>', page)
    assert row and row.group(1).startswith("Functional.linear.10")


def test_session_without_comparisons(store):
    from precision_lab.records import TensorRecord
    from precision_lab.stats import tensor_stats

    with store.new_session("lonely") as w:
        r = w.add_run(name="only", dtype="float32")
        w.add_record(TensorRecord(run_id=r, seq=0, op="a", op_type="Linear", role="output", index="0",
                                  stats=tensor_stats(np.ones(3, np.float32))))
    page = _body(render_html(store, "lonely"))
    assert "no comparisons in this session" in page and "no diagnoses" in page and "no warnings" in page
    assert "none: every recorded value is finite" in page


@pytest.mark.slow
def test_cli_report_html(store, tmp_path):
    from typer.testing import CliRunner

    from precision_lab.cli import app

    make_session(store, "demo")
    out = CliRunner().invoke(app, ["report", "--session", "demo", "--db", store.path, "--json",
                                   "--html", str(tmp_path / "r.html")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert "wrote" in out.stderr and json.loads(out.stdout)["session"] == "demo"


@pytest.mark.browser
def test_report_opens_offline_in_browser(store, tmp_path):
    from playwright.sync_api import sync_playwright

    from precision_lab.metrics import compare

    made = make_session(store, "demo")
    path = write_html(store, "demo", tmp_path / "r.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(offline=True)
            page = ctx.new_page()
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(path.as_uri())
            page.wait_for_selector("#plot-error .main-svg", timeout=30_000)
            page.wait_for_selector("#plot-focus .main-svg", timeout=30_000)
            # one marker per comparison with a finite error, plus a cross per NaN/Inf introduced
            cmps = [compare(made["arrays"][(f"blocks.{i}.fc", "ref")], made["arrays"][(f"blocks.{i}.fc", "cand")],
                            cand_format="fp16") for i in range(6)]
            want = sum(math.isfinite(c.rounding_units) for c in cmps if c.rounding_units is not None) + \
                sum(c.verdict == "nonfinite" for c in cmps)
            n_points = page.evaluate("document.querySelectorAll('#plot-error .scatterlayer .point').length")
            assert n_points == want >= 6
            assert page.inner_text("#session-name") == "demo"
            assert [u for u in requests if not u.startswith("file://")] == []
            assert errors == []
        finally:
            browser.close()


@pytest.mark.slow
def test_a_long_run_has_its_timeline_and_alerts_as_report_lists_them(store):
    import html

    from precision_lab.display import num_text
    from precision_lab.services.report import build_report, render_text
    from training import GROWTH_RUN, train

    losses = {}

    def keep_losses(cap):
        step = cap.step

        def recording(*args, **kwargs):
            losses[cap.step_no] = float(kwargs["loss"])
            return step(*args, **kwargs)
        cap.step = recording

    train(store, lr=0.2, steps=30, grow=True, hook=keep_losses)
    report = build_report(store, GROWTH_RUN)
    assert report.alerts and report.timeline
    text = render_text(report, top=1000)
    page = _body(render_html(store, GROWTH_RUN))
    assert 'id="plot-timeline-0"' in page
    t = report.timeline[GROWTH_RUN]
    assert f"{len(t.steps)} steps, full records at {len(t.full_steps)}; first non-finite value at step " \
           f"{t.first_nonfinite_step}" in text
    assert f"<p>{len(t.steps)} steps, full records at {len(t.full_steps)}; first non-finite value at step " \
           f"{t.first_nonfinite_step}</p>" in page
    # every alert the text report lists, with its step and rule
    assert f"Alerts of {GROWTH_RUN} ({len(report.alerts)})" in page
    for a in report.alerts:
        assert f"[{a.rule}] {GROWTH_RUN} step {a.step}: {a.message}" in text
        assert (f'<td class="num">{a.step}</td><td>{html.escape(a.rule)}</td>'
                f'<td>{html.escape(a.message)}</td>') in page
    # the per-step losses, as the training loop computed them
    assert len(losses) == 30
    for step, loss in losses.items():
        assert re.search(rf'<tr><td class="num">{step}</td><td class="num">{re.escape(num_text(loss))}</td>', page), \
            (step, loss)

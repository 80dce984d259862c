"""End to end in a real browser: start ``streamlit run app.py`` on a free port
with an empty database, upload the msprobe fp16 dump folder with its fp32
reference through the file uploader, find the first non-finite op on the
overview, open it, and check its values are drawn against fp16's range.
A second upload (a .zip of .npy files) checks the magnitude histogram.
Screenshots go to ``test-artifacts/``.

Needs Debian's chromium (``/usr/bin/chromium``) and Python Playwright; it is
skipped when chromium is missing, except in CI (``CI=true``) where it fails (see conftest.py).
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ui_fixtures import (CHROMIUM, CHROMIUM_ARGS, ROOT, STAT_CAND, STAT_FIRST_NONFINITE, STAT_REF,  # noqa: F401
                         free_port, serving)

pytestmark = pytest.mark.browser

ARTIFACTS = ROOT / "test-artifacts"
TIMEOUT_MS = 60_000


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(tmp_path / "browser.duckdb"), CI="true")
    env.pop("PRECISION_LAB_CONFIG", None)
    env.pop("PRECISION_LAB_READ_ONLY", None)
    with serving([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                  "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"],
                 port=port, env=env, log_path=tmp_path / "streamlit.log") as url:
        yield url


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1500, "height": 1400})
        pg.set_default_timeout(TIMEOUT_MS)
        yield pg
        browser.close()


def _wide_zip(tmp: Path) -> Path:
    """A .zip of a small .npy dump whose fp16 output overflows (the histogram case)."""
    rng = np.random.default_rng(7)
    x = (rng.choice([-1.0, 1.0], 2000) * np.exp2(rng.uniform(-28, 19, 2000))).astype(np.float32)
    path = tmp / "wide_fp16.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for name, arr in (("layer.input.0.npy", np.ones(8, np.float16)), ("layer.output.0.npy", x)):
            buf = io.BytesIO()
            with np.errstate(over="ignore"):
                np.save(buf, arr.astype(np.float16))
            zf.writestr(f"wide_fp16/{name}", buf.getvalue())
    return path


def _idle(pg) -> None:
    """Wait until the app's script run has ended (Streamlit's running indicator is gone): a click made while
    the page is still being rebuilt can land on an element that is then replaced."""
    pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")


def _file_input(pg, label: str):
    """The hidden <input type=file> of the uploader labelled ``label``."""
    loc = pg.locator('[data-testid="stFileUploader"]', has_text=label).locator('input[type="file"]')
    loc.wait_for(state="attached")
    return loc


def _choose(pg, option: str, uploader: str):
    """Click the radio ``option`` until the uploader labelled ``uploader`` shows (a click that lands while the
    page is still being rebuilt is lost on a loaded machine); its file input."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(3):
        _idle(pg)
        pg.get_by_text(option, exact=True).first.click()
        _idle(pg)
        loc = pg.locator('[data-testid="stFileUploader"]', has_text=uploader).locator('input[type="file"]')
        try:
            loc.wait_for(state="attached", timeout=15_000)
            return loc
        except PlaywrightTimeout:
            continue
    return _file_input(pg, uploader)


def _shot(pg, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / name
    pg.screenshot(path=str(out), full_page=True)
    return out


def test_upload_find_the_overflow_and_open_it(server, page, tmp_path):
    try:
        _flow(server, page, tmp_path)
    except Exception:
        _shot(page, "browser-failure.png")
        raise


def _flow(server, page, tmp_path):
    pg = page
    pg.goto(server)
    pg.get_by_text("No sessions yet").wait_for()
    _idle(pg)

    # copies so the uploaded folders carry exactly the sample's name
    cand, ref = tmp_path / STAT_CAND.name, tmp_path / STAT_REF.name
    shutil.copytree(STAT_CAND, cand)
    shutil.copytree(STAT_REF, ref)
    cand_input = _file_input(pg, "Dump (folder)")
    assert cand_input.get_attribute("webkitdirectory") is not None  # a directory upload
    cand_input.set_input_files(str(cand))
    # one folder at a time: the rerun the first upload starts can rebuild the second uploader under a loaded
    # machine's slower page, and files set on it meanwhile are lost
    pg.wait_for_function("() => (document.body.innerText.match(/dump\\.json/g) || []).length >= 1")
    _idle(pg)
    _file_input(pg, "Reference (folder)").set_input_files(str(ref))
    # both folders fully uploaded: each uploader lists its dump.json
    pg.wait_for_function("() => (document.body.innerText.match(/dump\\.json/g) || []).length >= 2")
    ingest = pg.get_by_role("button", name="Ingest")
    ingest.wait_for()
    pg.wait_for_function("() => [...document.querySelectorAll('button')]"
                         ".some(b => b.innerText.trim() === 'Ingest' && !b.disabled)")
    ingest.click()

    pg.get_by_text("first non-finite producer:").wait_for()
    producer = pg.get_by_text(STAT_FIRST_NONFINITE, exact=True).first
    producer.wait_for()
    assert "/overview" in pg.url and "session=" in pg.url
    _shot(pg, "browser-overview.png")

    pg.get_by_role("button", name="Open this op").first.click()
    pg.get_by_role("heading", name=f"{STAT_FIRST_NONFINITE}.output.0").wait_for()
    pg.get_by_text("Summary statistics against the format limits").wait_for()
    chart = pg.locator('[data-testid="stPlotlyChart"]').first
    chart.wait_for()
    pg.locator(".js-plotly-plot .xtitle").first.wait_for()
    assert "log2 |value|" in pg.locator(".js-plotly-plot .xtitle").first.text_content()
    assert "fp16: max" in chart.inner_text()  # fp16's limits are drawn for an fp16 record
    assert "op=" in pg.url and "fmt=fp16" in pg.url
    _shot(pg, "browser-op-detail.png")

    # a shared link opens the same view in a fresh browser page
    link = pg.url
    pg.goto("about:blank")
    pg.goto(link)
    pg.get_by_role("heading", name=f"{STAT_FIRST_NONFINITE}.output.0").wait_for()

    # a .zip of .npy files gets a real magnitude histogram
    pg.goto(server)
    pg.get_by_text("New session").wait_for()
    _idle(pg)
    _choose(pg, ".zip", "Dump (.zip)").set_input_files(str(_wide_zip(tmp_path)))
    pg.get_by_text("wide_fp16.zip").first.wait_for()
    pg.wait_for_function("() => [...document.querySelectorAll('button')]"
                         ".some(b => b.innerText.trim() === 'Ingest' && !b.disabled)")
    pg.get_by_role("button", name="Ingest").click()
    pg.get_by_text("first non-finite producer:").wait_for()
    pg.get_by_role("button", name="Open this op").first.click()
    pg.get_by_text("Exact counts per format").wait_for()
    pg.locator(".js-plotly-plot .ytitle").first.wait_for()
    assert "values per binade" in pg.locator(".js-plotly-plot .ytitle").first.text_content()
    _shot(pg, "browser-histogram.png")


@pytest.fixture
def timeline_server(tmp_path):
    """A server over a database holding a 40-step fp16 training run that overflows at step 20."""
    from precision_lab.store import Store, close_all
    from training import GROWTH_RUN, train

    db = tmp_path / "timeline.duckdb"
    train(Store(db), lr=0.2, steps=40, grow=True)
    close_all()
    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(db), CI="true")
    env.pop("PRECISION_LAB_CONFIG", None)
    env.pop("PRECISION_LAB_READ_ONLY", None)
    with serving([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                  "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"],
                 port=port, env=env, log_path=tmp_path / "streamlit.log") as url:
        yield url, GROWTH_RUN


def test_timeline_heatmap_and_tree_then_click_a_cell_to_open_the_op(timeline_server, page):
    url, session = timeline_server
    pg = page
    try:
        pg.goto(f"{url}/timeline?session={session}")
        pg.get_by_text("Ops over steps").wait_for()
        pg.get_by_text("The model as a tree").wait_for()
        _idle(pg)
        plots = pg.locator(".js-plotly-plot")
        pg.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3")
        # the tree: an icicle holding the model's root and its three modules
        tree = plots.nth(2)
        tree.scroll_into_view_if_needed()
        pg.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')]"
                             ".some(p => p.textContent.includes('(model)') && p.textContent.includes('bits'))")
        _shot(pg, "browser-timeline.png")
        # a click on a heatmap cell (the top row: the first op, the middle step) opens Op detail at that op
        heat = plots.first.locator(".nsewdrag").first
        heat.scroll_into_view_if_needed()
        box = heat.bounding_box()
        pg.mouse.click(box["x"] + box["width"] * 0.25, box["y"] + 8)
        pg.get_by_role("heading", name="Op detail").wait_for()
        pg.get_by_role("heading", name="0.forward.0.output.0").wait_for()
        assert "/op_detail" in pg.url and f"run={session}" in pg.url
        _shot(pg, "browser-timeline-click.png")
    except Exception:
        _shot(pg, "browser-timeline-failure.png")
        raise


def _boxes(pg, plot: str, selector: str) -> list[dict]:
    return pg.evaluate(
        "([plot, sel]) => [...document.querySelectorAll(`#${plot} ${sel}`)].map(e => {"
        " const r = e.getBoundingClientRect(); return {x: r.left, y: r.top, r: r.right, b: r.bottom}; })"
        ".filter(r => r.r > r.x && r.b > r.y)", [plot, selector])


def _overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["r"] and b["x"] < a["r"] and a["y"] < b["b"] and b["y"] < a["b"]


def test_html_report_plots_do_not_overlap_their_own_text(page, tmp_path):
    """The static report's plots, drawn by a real browser: no title over the legend, no axis title over its
    tick labels, no tick label cut off at the plot's left edge.  Written in a process that has imported
    streamlit, as the dashboard's download button does (streamlit makes its own plotly template the default)."""
    import streamlit  # noqa: F401

    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all
    from precision_lab.ui.html_report import write_html

    store = Store(tmp_path / "r.duckdb")
    ingest([STAT_CAND], reference=[STAT_REF], session="ovf", store=store)
    out = write_html(store, "ovf", tmp_path / "report.html")
    close_all()
    pg = page
    pg.goto(f"file://{out}")
    pg.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4")
    problems = ["not measured"]
    for _ in range(20):  # plotly lays a responsive plot out again once it knows its width: measure when settled
        pg.wait_for_timeout(250)
        problems = _layout_problems(pg)
        if not problems:
            break
    _shot(pg, "html-report.png")
    assert not problems, problems


def _layout_problems(pg) -> list[str]:
    out = []
    for plot in ("plot-error", "plot-focus"):
        svgs = _boxes(pg, plot, ".main-svg")
        titles, legends = _boxes(pg, plot, ".gtitle"), _boxes(pg, plot, ".legend")
        if not (svgs and titles and legends):
            out.append(f"{plot}: not drawn yet")
            continue
        if any(_overlap(t, g) for t in titles for g in legends):
            out.append(f"{plot}: title over the legend")
        for axis in ("x", "y"):
            ticks, title = _boxes(pg, plot, f".{axis}tick text"), _boxes(pg, plot, f".{axis}title")
            if not (ticks and title):
                out.append(f"{plot}: {axis} axis not drawn yet")
            elif any(_overlap(t, title[0]) for t in ticks):
                out.append(f"{plot}: {axis} axis title over its ticks")
        ys = _boxes(pg, plot, ".ytick text")
        if ys and min(t["x"] for t in ys) < svgs[0]["x"] - 0.5:
            out.append(f"{plot}: y labels clipped")
    return out


def test_diff_page_pairs_a_transformers_model_with_its_rewrite_by_their_data(page, tmp_path):
    """In Chromium: a transformers Llama and a rewrite with other module names and a fused qkv (LayerNorm's eps
    wrong) in one session; the Diff page's pairing by data shows the fused pairs and names the first divergent
    pair at the norm."""
    from test_xdiff import llama_and_rewrite_db

    db = llama_and_rewrite_db(tmp_path / "xdiff.duckdb")
    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(db), CI="true")
    for var in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY"):
        env.pop(var, None)
    with serving([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                  "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"],
                 port=port, env=env, log_path=tmp_path / "streamlit.log") as url:
        pg = page
        pg.goto(f"{url}/diff?session=hf&view=data")
        alert = pg.get_by_text("First divergent pair:")
        alert.wait_for()
        said = alert.inner_text()
        assert "layers.0.input_layernorm.add.0" in said and "blocks.0.norm1.add.0" in said, said
        pg.locator("[data-testid='stDataFrame'] [role='columnheader']").filter(
            has_text="how").first.wait_for(state="attached")
        _shot(pg, "browser-xdiff.png")
        from test_browser_truth import _grids

        heads, rows = next((h, r) for h, r in _grids(pg) if "how" in h)
        how = [row[heads.index("how")] for row in rows if len(row) == len(heads)]
        refs = " ".join(row[heads.index("ref")] for row in rows if len(row) == len(heads))
        assert "fused N:1" in how and "anchor" in how, how  # q, k and v against the fused qkv; values as anchors
        assert "layers.0.self_attn.q_proj.linear.0" in refs

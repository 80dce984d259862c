"""In Chromium at 1400 px: the dashboard's tables say what the data hold.

A tensor holding Inf shows absmax inf, headroom -inf and "overflows: yes" on Op detail; a far-off element is
never called "expected" on Diff, whose decisive columns (verdict, max_rel_err, reason) are on screen at
1400 px; an unknown session in a link says "not found". Cell text is read from the grid's accessible table
(the cells a visitor can see), and every expected value is computed here with numpy from the dumped arrays.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys

import numpy as np
import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, _shot  # noqa: F401
from test_ui_truth import INF_OP, NEAR0_OP, SESSION, _arrays, _candidate, truth_template  # noqa: F401
from ui_fixtures import free_port, serving

pytestmark = pytest.mark.browser

WIDTH = 1400


@pytest.fixture(scope="module")
def truth_server(truth_template, tmp_path_factory):  # noqa: F811
    from precision_lab.store import Store, close_all

    root = tmp_path_factory.mktemp("truth-browser")
    db = root / "truth.duckdb"
    shutil.copy(truth_template, db)
    store = Store(db)
    cand = str(store.df("SELECT name FROM runs WHERE kind = 'candidate'").name[0])
    rids = {n: int(r) for n, r in store.df("""SELECT t.name, t.rid FROM tensors t JOIN runs r USING (run_id)
                                               WHERE r.kind = 'candidate'""").itertuples(index=False)}
    close_all()  # the server's process opens the file next
    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(db), CI="true")
    env.pop("PRECISION_LAB_CONFIG", None)
    with serving([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                  "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"],
                 port=port, env=env, log_path=root / "streamlit.log") as url:
        yield url, cand, rids


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": WIDTH, "height": 1400})
        pg.set_default_timeout(TIMEOUT_MS)
        yield pg
        browser.close()


def _grids(pg) -> list[tuple[list[str], list[list[str]]]]:
    """Every table on the page as (visible column headers, visible rows of cell text)."""
    out = []
    grids = pg.locator("[data-testid='stDataFrame']")
    for i in range(grids.count()):
        g = grids.nth(i)
        heads = [h.text_content() for h in g.locator("[role='columnheader']").all()]
        cells = [c.text_content() for c in g.locator("[role='gridcell']").all()]
        if heads:
            n = len(heads)
            out.append((heads, [cells[k:k + n] for k in range(0, len(cells), n)]))
    return out


def _table_with(pg, column: str, under: str | None = None):
    """The first table with ``column``; with ``under``, the one in the page column captioned ``under``
    (a page shows one headroom table per run side by side, and they render in no fixed order)."""
    scope = pg
    if under is not None:
        scope = pg.locator("[data-testid='stColumn']").filter(has=pg.get_by_text(under, exact=True))
    scope.locator("[data-testid='stDataFrame'] [role='columnheader']").filter(
        has_text=column).first.wait_for(state="attached")
    return next((h, rows) for h, rows in _grids(scope) if column in h)


@contextlib.contextmanager
def _screenshots(pg, name: str, *, on_success: bool = True):
    """A screenshot of the page as the test ends: ``name.png``, or ``name-failure.png`` when it failed."""
    try:
        yield
    except Exception:
        _shot(pg, f"{name}-failure.png")
        raise
    if on_success:
        _shot(pg, f"{name}.png")


def _num(v: float) -> str:
    """How the dashboard spells a non-finite number (finite ones are compared as numbers)."""
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def test_op_detail_of_a_tensor_holding_inf(truth_server, page):
    url, cand, rids = truth_server
    pg = page
    with np.errstate(over="ignore"):
        values = _arrays()[INF_OP].astype(np.float16).astype(np.float64)
    n_inf = int(np.isinf(values).sum())
    assert n_inf == 2
    with _screenshots(pg, "browser-op-detail-inf"):
        pg.goto(f"{url}/op_detail?session={SESSION}&run={cand}&op={rids[INF_OP]}&fmt=fp16")
        pg.get_by_role("heading", name="Op detail").wait_for()
        heads, rows = _table_with(pg, "headroom (bits)")  # one table, a row per record and format
        row = next(dict(zip(heads, r)) for r in rows if r[heads.index("record")] == f"{cand} (this)")
        assert row["absmax"] == _num(float(np.max(np.abs(values))))  # inf counts in absmax
        assert row["headroom (bits)"] == "-inf" and row["overflows"].startswith("yes")
        heads, rows = _table_with(pg, f"{cand} (this)")
        stats = {r[0]: r[1] for r in rows}
        assert stats["inf_count"] == str(n_inf) and stats["nan_count"] == "0"
        assert stats["max"] == _num(float(np.max(values))) and stats["min"] == _num(float(np.min(values)))


def test_diff_puts_the_verdict_of_a_far_off_element_on_screen_at_1400px(truth_server, page):
    url, cand, _ = truth_server
    pg = page
    r = _arrays()[NEAR0_OP].astype(np.float64)
    c = _candidate(NEAR0_OP, _arrays()[NEAR0_OP]).astype(np.float64)
    rel = float((np.abs(c - r) / np.maximum(np.abs(r), 2.0 ** -14)).max())
    assert rel > 10  # 1500% off: anything but "expected"
    with _screenshots(pg, "browser-diff-1400"):
        pg.goto(f"{url}/diff?session={SESSION}&q={NEAR0_OP}")
        pg.get_by_role("heading", name="Diff").wait_for()
        heads, rows = _table_with(pg, "verdict")
        # the decisive columns are visible without scrolling, ahead of the two sides' statistics
        for col in ("op", "role", "verdict", "max_rel_err", "reason"):
            assert col in heads, heads
        assert heads.index("verdict") < heads.index("max_rel_err") < heads.index("reason")
        row = dict(zip(heads, next(x for x in rows if NEAR0_OP.rsplit(".", 2)[0] in " ".join(x))))
        assert row["verdict"] != "expected"
        assert float(row["max_rel_err"]) == pytest.approx(rel, rel=1e-3)
        assert "one element" in row["reason"]
        # the page's settings are bound to the URL: the browser writes a choice there, beside the link's own
        pg.get_by_text("runs", exact=True).first.click()
        pg.wait_for_url(re.compile(r"[?&]view=runs(&|$)"))
        assert f"q={NEAR0_OP}" in pg.url


def test_a_link_to_an_unknown_session_says_not_found(truth_server, page):
    url, _, _ = truth_server
    pg = page
    with _screenshots(pg, "browser-unknown-session", on_success=False):
        for where in ("overview", "diff"):
            pg.goto(f"{url}/{where}?session=nope")
            pg.get_by_text("There is no session named nope").first.wait_for()
            assert pg.locator("[data-testid='stDataFrame']").count() == 0

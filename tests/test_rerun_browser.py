"""In a real browser: a recipe session's diagnosis card, one click on "Re-run with ...", the N-run diff.

Uses the server and browser fixtures of ``test_browser.py`` (same skip rule:
skipped without Debian's chromium, except in CI).  Screenshot:
``test-artifacts/browser-rerun.png``.
"""

from __future__ import annotations

import pytest

from test_browser import CHROMIUM, _shot, page, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser


@pytest.fixture
def recipe_session(tmp_path):
    """The database the server will open, holding a captured recipe session (closed before it starts)."""
    from precision_lab.services.rerun import capture_recipe
    from precision_lab.store import Store, close_all

    store = Store(tmp_path / "browser.duckdb")  # the path the server fixture points the app at
    name = capture_recipe(store, "softmax-fp16-overflow")
    close_all()  # a second process cannot open a DuckDB file this one holds
    return name


def test_rerun_with_fix_in_one_click(recipe_session, server, page):  # noqa: F811
    pg = page
    try:
        pg.goto(f"{server}/overview?session={recipe_session}")
        pg.get_by_text("exp() overflows fp16").first.wait_for()
        button = pg.get_by_role("button", name="Re-run with stable-softmax")
        button.first.wait_for()
        button.first.scroll_into_view_if_needed()
        _shot(pg, "browser-rerun-card.png")
        button.first.click()
        # the re-run runs in the background; the page moves to the N-run diff when it is done
        pg.get_by_role("heading", name="Diff").wait_for(timeout=180_000)
        pg.get_by_text("fix: stable-softmax").first.wait_for()
        assert "/diff" in pg.url
        _shot(pg, "browser-rerun.png")
    except Exception:
        _shot(pg, "browser-rerun-failure.png")
        raise

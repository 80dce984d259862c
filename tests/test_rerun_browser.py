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


@pytest.fixture
def user_model_session(tmp_path, monkeypatch):
    """A session captured from a user's model by entry point, in the database the server will open; the server
    (started after this fixture) is allowed to run that model."""
    from pathlib import Path

    from precision_lab.fixes.recipes import MODELS_ENV, RECIPES, entry_point_recipe, register_recipe
    from precision_lab.services.rerun import capture_recipe
    from precision_lab.store import Store, close_all

    model = str(Path(__file__).parent / "models" / "worker_probe.py")
    monkeypatch.setenv(MODELS_ENV, f"{model}:build,{model}:inputs")
    recipe = register_recipe(entry_point_recipe(f"{model}:build", f"{model}:inputs"), replace=True)
    store = Store(tmp_path / "browser.duckdb")
    name = capture_recipe(store, recipe, local_error=False, session="probe")
    close_all()
    RECIPES.unregister(recipe.name)
    return name


def test_rerun_of_a_users_model_in_one_click_leaves_it_finite(user_model_session, server, page):  # noqa: F811
    pg = page
    try:
        pg.goto(f"{server}/overview?session={user_model_session}")
        button = pg.get_by_role("button", name="Re-run with use-bf16")
        button.first.wait_for()
        button.first.scroll_into_view_if_needed()
        button.first.click()
        # the model runs in the server's worker process; the page moves to the diff with a before/after card
        pg.get_by_role("heading", name="Diff").wait_for(timeout=180_000)
        pg.get_by_text("fix: use-bf16").first.wait_for()
        first = pg.locator("[data-testid='stMetric']", has_text="first non-finite op")
        first.first.wait_for()
        assert first.first.locator("[data-testid='stMetricValue']").inner_text().strip() == "none"
        nonfinite = pg.locator("[data-testid='stMetric']", has_text="records with unexpected NaN/Inf")
        assert nonfinite.first.locator("[data-testid='stMetricValue']").inner_text().strip() == "0"
        _shot(pg, "browser-rerun-user-model.png")
    except Exception:
        _shot(pg, "browser-rerun-user-model-failure.png")
        raise

"""A dashboard page added from outside the package, the way a plug-in adds one: one module, named by an entry point
in the ``precision_lab.pages`` group, whose function ``register_page`` makes a page; AppTest drives app.py."""

from __future__ import annotations

import numpy as np
import pytest

from precision_lab.ui.page import PAGES

from plugin_kit import doc_examples, install
from ui_fixtures import WIDE_OP, _write_wide_dumps, app_test, assert_clean, serve_db, texts, wide_values

EXAMPLE = doc_examples("Adding a page")


@pytest.fixture
def plugin_page(tmp_path, monkeypatch):
    """The worked example of docs/architecture.md's "Adding a page", installed as a distribution's
    ``precision_lab.pages`` entry point and read as by a fresh process; taken out again afterwards."""
    before = PAGES.names()
    assert list(EXAMPLE) == ["my_page.py"]
    install(tmp_path, monkeypatch, EXAMPLE, {"precision_lab.pages": ["mine = my_page"]}, (PAGES,))
    yield
    for name in set(PAGES.names()) - set(before):
        PAGES.unregister(name)


@pytest.fixture
def wide_db(tmp_path, monkeypatch):
    """A database holding the wide-range .npy pair (fp32 reference, fp16 candidate), served to the app."""
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    ref, cand = _write_wide_dumps(tmp_path / "dumps")
    db = tmp_path / "app.duckdb"
    ingest([cand], reference=[ref], session="wide", store=Store(db))
    close_all()
    with serve_db(db, monkeypatch):
        yield db


def test_a_page_from_an_entry_point_is_in_the_menu_and_renders_through_ui(plugin_page, wide_db):
    assert PAGES.names() == ["sessions", "overview", "ops", "op_detail", "diff", "timeline", "largest"]
    page = PAGES["largest"]
    assert (page.title, page.render.__module__) == ("Largest values", "my_page")
    # placed first, the page opens at / (AppTest switches pages by script, and a plug-in page is a function)
    PAGES.register("largest", PAGES.pop("largest"), before="sessions")
    at = app_test(session="wide")
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Largest values"
    shown = at.dataframe[0].value
    # the candidate run (fp16): the largest magnitudes of its records (inf where one overflowed), worked out here
    # from what was written
    with np.errstate(over="ignore"):
        x16 = wide_values().astype(np.float16)
    small = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
    want = [(WIDE_OP, "output", float(np.abs(x16).max())),
            ("blocks.1.proj", "output", float(np.abs((small * 3).astype(np.float16)).max())),
            (WIDE_OP, "input", float(np.abs(small.astype(np.float16)).max()))]
    assert want[0][2] == float("inf") and list(zip(shown["op"], shown["role"], shown["absmax"])) == want
    assert "wide_fp16" in texts(at)


def test_a_page_without_a_session_says_where_one_comes_from(plugin_page, tmp_path, monkeypatch):
    from precision_lab.store import Store, close_all

    Store(tmp_path / "empty.duckdb")
    close_all()
    PAGES.register("largest", PAGES["largest"], replace=True, before="sessions")
    with serve_db(tmp_path / "empty.duckdb", monkeypatch):
        at = app_test()
        at.run()
    assert_clean(at)
    assert at.title[0].value == "Largest values" and len(at.info) == 1 and not at.dataframe

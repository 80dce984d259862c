import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the kernels compile in this process on first use (not in a background process while the float64 paths
# serve): every test sees the path it asks for; tests of the background compilation set it themselves
os.environ.setdefault("PRECISION_LAB_COMPILE", "now")

FIXTURES = ROOT / "tests" / "data" / "msprobe"  # recorded msprobe dumps, copied into the repo
SAMPLES = ROOT / "sample_dumps"

TABLES = ("meta", "sessions", "runs", "tensors", "histograms", "tensor_data", "comparisons", "diagnoses", "warnings",
          "timeline", "timeline_formats", "step_scalars")


def snapshot(store) -> str:
    """A digest of every row of every table: equal digests mean an unchanged database."""
    h = hashlib.sha256()
    with store.reading() as cur:  # one read of one state: the file is opened once, not once per table
        for t in TABLES:
            for row in sorted(map(repr, cur.execute(f"SELECT * FROM {t}").fetchall())):
                h.update(row.encode())
    return h.hexdigest()


def refused(store, fn, exc, *words) -> str:
    """``fn()`` raises ``exc`` whose message holds every word, and the database is unchanged; the message."""
    before = snapshot(store)
    with pytest.raises(exc) as ei:
        fn()
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert snapshot(store) == before
    return msg


def ingest_refused(store, path, *words, **kw) -> str:
    """Ingesting ``path`` raises IngestError naming every word and writes nothing; the message."""
    from precision_lab.services.ingest import IngestError, ingest

    return refused(store, lambda: ingest(path, store=store, **kw), IngestError, *words)


@pytest.fixture(scope="session")
def _empty_database(tmp_path_factory) -> Path:
    """A database file with the schema and nothing else, made once: each ``store`` starts from a copy."""
    from precision_lab.store import Store, close_all

    path = tmp_path_factory.mktemp("empty_database") / "empty.duckdb"
    Store(path)
    close_all()
    return path


@pytest.fixture
def store_template(_empty_database) -> Path:
    """The database file each ``store`` starts as a copy of: the schema and nothing else, unless a module says
    otherwise."""
    return _empty_database


@pytest.fixture
def store(store_template, tmp_path, request):
    """A fresh database file per test; kept open between the test's operations (``Store.held()``, as a dashboard
    page run keeps it) where the test is marked ``held_store``."""
    from precision_lab.store import Store, close_all

    path = tmp_path / "test.duckdb"
    shutil.copy(store_template, path)
    s = Store(path)
    if request.node.get_closest_marker("held_store") is None:
        yield s
    else:
        with s.held():
            yield s
    close_all()


@pytest.fixture(autouse=True)
def _isolated_default_db(tmp_path, monkeypatch):
    # no test may touch the user's real database
    monkeypatch.setenv("PRECISION_LAB_DB", str(tmp_path / "default.duckdb"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    # a dashboard page run on localhost trusts the user's allow-list for the rest of its process: not across tests
    from precision_lab.fixes.recipes import trust_user_models

    trust_user_models(False)


def pytest_configure(config):
    config.addinivalue_line("markers", "held_store: the `store` fixture keeps its database open between the test's "
                                       "operations (Store.held()): for tests of what is read and stored, not of how "
                                       "the file is opened, shared or locked")


def pytest_collection_modifyitems(items):
    """A browser test starts a server and chromium: it is slow too (``pytest -m "not slow"`` leaves it out)."""
    for item in items:
        if item.get_closest_marker("browser") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    """A browser test without Debian's chromium: skipped with the reason on a developer's machine; failed with
    the reason in CI (``CI=true``), which installs chromium, so its absence there is a broken setup, never a
    pass.  Either way the message names the missing path, not a launch error from deep inside Playwright."""
    if item.get_closest_marker("browser") is None:
        return
    from ui_fixtures import CHROMIUM

    if Path(CHROMIUM).exists():
        return
    reason = f"{CHROMIUM} is missing: the browser tests drive Debian's chromium (apt-get install -y chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason + "; CI must run them", pytrace=False)
    pytest.skip(reason)


def add_masked_softmax(w, run_id: str, out) -> None:
    """Hand-made records of one run: a ``masked_fill`` writing a mask's -inf, a softmax reading it and writing
    ``out`` (finite in a healthy run, NaN in a failing one)."""
    import numpy as np

    from precision_lab.records import TensorRecord
    from precision_lab.stats import tensor_stats

    mask = np.array([[0.0, -np.inf], [0.0, 0.0]], np.float16)
    for seq, op, role, values in ((0, "attn.masked_fill.0", "output", mask), (1, "attn.softmax.0", "input", mask),
                                  (1, "attn.softmax.0", "output", np.asarray(out, np.float16))):
        w.add_record(TensorRecord(run_id=run_id, seq=seq, op=op, op_type=op.split(".")[1], role=role, index="0",
                                  stats=tensor_stats(values)))

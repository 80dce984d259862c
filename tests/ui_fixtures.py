"""Fixtures for the dashboard tests (AppTest and browser).

``ui_template`` builds, once per test run, a database holding
  * the msprobe statistics-mode sample pair from ``sample_dumps/``
    (fp16 candidate with an overflow inside block 2, fp32 reference), and
  * a small generic tensor dump (``.npy`` files, fp32 reference and fp16
    candidate) whose values span fp16's and fp8's ranges, so that overflow,
    subnormal and underflow counts are all nonzero;
``ui_db`` copies it into the test's own folder and points the app at it.
"""

from __future__ import annotations

import contextlib

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_dumps"
STAT_CAND = SAMPLES / "stat_mix_fp16_inner_ovf"
STAT_REF = SAMPLES / "stat_mix_fp32_inner_ovf"
STAT_SESSION = "stats-sample"
TENSOR_SESSION = "tensor-wide"
# the op the fp16 sample first overflows in (see the fixture README: block 2 fc1)
STAT_FIRST_NONFINITE = "Functional.linear.10.forward"
WIDE_OP = "blocks.0.wide"
TIMELINE_SESSION = "fp16-growth"  # a 40-step fp16 training run whose activations grow until they overflow

# the browser tests drive Debian's chromium (never `playwright install`); conftest skips them without it, except
# in CI, where its absence fails each of them with this path named
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def wide_values() -> np.ndarray:
    """fp32 values spanning fp16's and fp8's ranges: subnormal and
    underflowing in fp16, overflowing fp16 and e4m3fn, plus zeros."""
    rng = np.random.default_rng(1234)
    exps = rng.uniform(-30.0, 20.0, size=4000)
    signs = rng.choice([-1.0, 1.0], size=exps.size)
    x = (signs * np.exp2(exps)).astype(np.float32)
    x[:7] = 0.0
    return x.reshape(40, 100)


def msprobe_tensor_entries(dump_json: Path) -> list[dict]:
    """Every tensor stat dict in an msprobe dump.json, parsed independently of the reader."""
    data = json.loads(dump_json.read_text())["data"]

    def walk(x):
        if isinstance(x, dict):
            if x.get("type") == "torch.Tensor":
                yield x
                return
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)

    return [t for entry in data.values() for t in walk(entry)]


def msprobe_nonfinite_count(dump_json: Path) -> int:
    return sum(1 for t in msprobe_tensor_entries(dump_json)
               if not (math.isfinite(t["Max"]) and math.isfinite(t["Min"])))


def _write_wide_dumps(root: Path) -> tuple[Path, Path]:
    x = wide_values()
    ref, cand = root / "wide_fp32", root / "wide_fp16"
    for d in (ref, cand):
        d.mkdir(parents=True)
    small = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
    for d, cast in ((ref, np.float32), (cand, np.float16)):
        with np.errstate(over="ignore"):
            np.save(d / f"{WIDE_OP}.input.0.npy", small.astype(cast))
            np.save(d / f"{WIDE_OP}.output.0.npy", x.astype(cast))
            np.save(d / "blocks.1.proj.output.0.npy", (small * 3).astype(cast))
    return ref, cand


# the template of each test run in this process: every test module imports ``ui_template``, which makes it a
# fixture of that module, so its session scope alone would build it once per module
_TEMPLATES: dict = {}


@pytest.fixture(scope="session")
def ui_template(tmp_path_factory) -> Path:
    run = tmp_path_factory.getbasetemp()
    if run not in _TEMPLATES:
        _TEMPLATES[run] = _build_template(tmp_path_factory.mktemp("ui_template"))
    return _TEMPLATES[run]


def _build_template(root: Path) -> Path:
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    db = root / "template.duckdb"
    store = Store(db)
    with store.held():  # the file opened once for the reads of the build, not once per read
        ingest([STAT_CAND], reference=[STAT_REF], session=STAT_SESSION, store=store)
        ref, cand = _write_wide_dumps(root / "dumps")
        ingest([cand], reference=[ref], session=TENSOR_SESSION, store=store)
        from training import train

        train(store, lr=0.2, steps=40, grow=True, run=TIMELINE_SESSION)  # a long run: the Timeline page
    close_all()
    return db


@contextlib.contextmanager
def serve_db(db, monkeypatch):
    """Point the app under test at ``db`` with default settings; clear cached stores around it."""
    import streamlit as st

    from precision_lab.store import close_all

    monkeypatch.setenv("PRECISION_LAB_DB", str(db))
    monkeypatch.delenv("PRECISION_LAB_CONFIG", raising=False)
    monkeypatch.delenv("PRECISION_LAB_READ_ONLY", raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()
    try:
        yield db
    finally:
        st.cache_resource.clear()
        close_all()


@pytest.fixture
def ui_db(ui_template, tmp_path, monkeypatch) -> Path:
    """A private copy of the template database, used by the app under test."""
    db = tmp_path / "app.duckdb"
    shutil.copy(ui_template, db)
    with serve_db(db, monkeypatch):
        yield db


@pytest.fixture
def empty_db(tmp_path, monkeypatch) -> Path:
    import streamlit as st

    from precision_lab.store import close_all

    db = tmp_path / "empty.duckdb"
    monkeypatch.setenv("PRECISION_LAB_DB", str(db))
    st.cache_resource.clear()
    yield db
    st.cache_resource.clear()
    close_all()


def app_test(**query):
    """An AppTest of app.py with optional URL parameters."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at


def open_page(page: str, /, **query):
    """Run app.py once, switch to ``page`` (a name in ``precision_lab.ui.page.PAGES``) with the URL
    parameters ``query``, and run it.  ``page`` is positional-only, so ``page=`` is a URL parameter."""
    from precision_lab.ui.page import page_script

    at = app_test()
    at.run()
    at.switch_page(page_script(page))
    for k, v in query.items():
        at.query_params[k] = v
    at.run()
    assert_clean(at)
    return at


def link(at) -> dict:
    """The URL parameters of the view ``at`` shows, as a copied link carries them: the pickers' (written by the
    page) and every widget bound to the URL (``bind="query-params"``: Streamlit's browser side writes the widget's
    value under its key, which AppTest has no browser to do), in the text the URL holds."""
    def text(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return [text(x) for x in v] if isinstance(v, (list, tuple)) else str(v)

    out = dict(at.query_params)
    for kind in ("selectbox", "multiselect", "toggle", "text_input", "pagination", "radio"):
        for w in at.get(kind):
            if getattr(w.proto, "query_param_key", ""):
                out[w.proto.query_param_key] = text(w.value)
    return out


def assert_clean(at) -> None:
    """No exception element (a traceback) on the page."""
    assert not at.exception, [e.value for e in at.exception]


def frames(at) -> list:
    """Every st.dataframe on the page as a DataFrame (a Styler's data)."""
    return [d.value for d in at.dataframe]


def frame_with(at, column: str):
    return next(f for f in frames(at) if column in f.columns)


def texts(at) -> str:
    """All text-like elements of the page, joined: what a reader sees."""
    parts = []
    for kind in ("title", "header", "subheader", "markdown", "caption", "info", "error", "warning", "success",
                 "text"):
        parts += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(parts)


# ---- a real server -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(argv: list, *, port: int, env: dict, log_path: Path, cwd: Path = ROOT, timeout_s: float = 60):
    """Run ``argv`` (a command serving the dashboard on ``port``), wait until its health check answers,
    yield its URL, and stop it afterwards; a server that does not come up fails with its log."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().decode().strip() == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                raise RuntimeError("streamlit did not start:\n" + Path(log_path).read_text()[-3000:])
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class DashboardTab:
    """A browser tab on a served dashboard, spoken to over Streamlit's own websocket (no browser needed): each
    ``run()`` is one page run of the same browser session, as a click or a reload of an open page is.  Reads what
    the page drew: its text elements and its tables (Arrow)."""

    def __init__(self, url: str, query: str = "", timeout_s: float = 60):
        from websockets.sync.client import connect

        self.query, self.timeout_s = query, timeout_s
        self._ws = connect(url.replace("http://", "ws://") + "/_stcore/stream", subprotocols=["streamlit"],
                           max_size=None, open_timeout=timeout_s, legacy=True)

    def run(self) -> dict:
        """One page run: ``{"texts": [...], "tables": [pyarrow.Table, ...]}`` of what it drew."""
        import pyarrow as pa
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        msg = BackMsg()
        msg.rerun_script.query_string = self.query
        self._ws.send(msg.SerializeToString())
        texts, tables = [], []
        deadline = time.time() + self.timeout_s
        while True:
            fwd = ForwardMsg.FromString(self._ws.recv(timeout=max(0.1, deadline - time.time())))
            kind = fwd.WhichOneof("type")
            if kind == "script_finished":
                return {"texts": texts, "tables": tables}
            if kind != "delta" or fwd.delta.WhichOneof("type") != "new_element":
                continue
            el = fwd.delta.new_element
            which = el.WhichOneof("type")
            if which == "markdown":
                texts.append(el.markdown.body)
            elif which == "alert":
                texts.append(el.alert.body)
            elif which == "dataframe" and el.dataframe.arrow_data.data:
                tables.append(pa.ipc.open_stream(el.dataframe.arrow_data.data).read_all())

    def sessions(self) -> list[str]:
        """The session names the Sessions page lists on one page run."""
        got = self.run()
        return [n for t in got["tables"] if "session" in t.column_names for n in t.column("session").to_pylist()]

    def close(self) -> None:
        self._ws.close()

    def __enter__(self) -> "DashboardTab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Names that come from dumps (ops, runs, files, sessions) are shown as text:
never as HTML, never as a markdown link, in the static HTML report and on
every dashboard page.

Markdown shown by Streamlit is rendered here with markdown-it in
CommonMark mode with raw HTML off (Streamlit's default without
``unsafe_allow_html``), so the test sees what a browser would: the name as
literal text, no ``<a>`` to the planted URL, no ``<script>``.
"""

import html
import json
import re

import pytest

from test_share import make_session
from ui_fixtures import CHROMIUM, CHROMIUM_ARGS, assert_clean, free_port, open_page, serve_db, serving

EVIL = ("<script>alert(1)</script>[click](http://evil.example)*x* ![i](http://evil.example/i.png) "
        "https://evil.example/bare www.evil.example mail@evil.example")
OP_PREFIX = "blk<img src=x onerror=alert(2)>[a](http://evil.example)"
SESSION = "sess<script>alert(3)</script>[s](http://evil.example)"
RUN_FILE = "dump/<b>bold</b>[f](http://evil.example).npy"


def _hostile_session(store):
    """A session whose session name, op names, warning file and diagnosis message are hostile."""
    from precision_lab.records import Diagnosis

    from precision_lab.records import RunInfo

    made = make_session(store, SESSION, op_prefix=OP_PREFIX)
    sid = store.session(SESSION).session_id
    with store.extend_session(SESSION) as w:
        w.add_warning(RUN_FILE, f"skipped {EVIL}", run_id=made["cand"])
        # a re-run of the candidate whose name and fix come from data: the Diff page's card and its tooltips
        w.add_run(RunInfo(session_id=sid, run_id="evilrerun01", name=f"fix {EVIL}", dtype="float16", kind="rerun",
                          parent_run_id=made["cand"], fix=f"keep-fp32:{OP_PREFIX}", policy=None, source="t",
                          order="execution"))
        w.add_diagnosis(Diagnosis(sid, made["cand"], f"{OP_PREFIX}.5.fc", "overflow", f"message {EVIL}",
                                  (EVIL,), "error", 5))
    return made


# ---- HTML report -------------------------------------------------------------------------

@pytest.mark.slow
def test_html_report_escapes_every_name(store):
    from precision_lab.ui.html_report import render_html

    _hostile_session(store)
    page = render_html(store, SESSION)
    body = page[page.index("</head>"):]
    # the only script tags are plotly's own (the bundle in <head>, one per plot in the body)
    plots = len(re.findall(r'<div id="plot-[^"]*" class="plotly-graph-div"', body))
    assert plots >= 2 and body.count("<script") == plots
    for raw in ("<script>alert", "<img src=x", "<b>bold</b>"):
        assert raw not in body
    # every name is there, escaped: shown as the characters typed
    for name in (SESSION, f"{OP_PREFIX}.5.fc", RUN_FILE, f"message {EVIL}"):
        assert html.escape(name) in body, name
    assert "href" not in re.sub(r"<script.*?</script>", "", body, flags=re.S)
    # inside plot data, names are escaped for plotly's label markup (which would make <a> a link)
    plot_json = "".join(re.findall(r"Plotly\.newPlot\((.*?)\)\s*};", body, flags=re.S))
    assert "blk&lt;img src=x onerror=alert(2)&gt;" in plot_json.replace("\\u003c", "<").replace("\\u003e", ">")
    assert "<img" not in plot_json.replace("\\u003c", "<")


@pytest.mark.browser
def test_html_report_shows_names_as_text_in_browser(store, tmp_path):
    from playwright.sync_api import sync_playwright

    from precision_lab.ui.html_report import write_html

    _hostile_session(store)
    path = write_html(store, SESSION, tmp_path / "evil.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(offline=True).new_page()
            dialogs = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(path.as_uri())
            page.wait_for_selector("#plot-error .main-svg", timeout=30_000)
            assert page.inner_text("#session-name") == SESSION
            assert f"{OP_PREFIX}.5.fc" in page.inner_text("body")
            assert page.evaluate("document.querySelectorAll('img, b, a').length") == 0
            # plotly draws the first-NaN annotation with the op name as typed, not as markup
            ann = page.evaluate("Array.from(document.querySelectorAll('#plot-error .annotation-text'))"
                                ".map(e => e.textContent)")
            assert any(f"{OP_PREFIX}.5.fc" in a for a in ann)
            assert page.evaluate("document.querySelectorAll('#plot-error a, #plot-focus a').length") == 0
            assert dialogs == []
        finally:
            browser.close()


# ---- dashboard pages (AppTest) ------------------------------------------------------------------

@pytest.fixture
def hostile_db(tmp_path, monkeypatch):
    from precision_lab.store import Store, close_all

    db = tmp_path / "hostile.duckdb"
    made = _hostile_session(Store(db))
    close_all()
    with serve_db(db, monkeypatch):
        yield made


_MD = None


def _render(src: str) -> str:
    """Markdown -> HTML as Streamlit shows it without unsafe_allow_html (raw HTML is not rendered)."""
    global _MD
    if _MD is None:
        from markdown_it import MarkdownIt

        _MD = MarkdownIt("commonmark", {"html": False})
    return _MD.render(src)


_MD_KINDS = ("title", "header", "subheader", "markdown", "caption", "info", "error", "warning", "success")


# GFM's autolink-literal pass (remark-gfm, which Streamlit's markdown uses) over text after escapes are resolved:
# a URL, a www. host and an e-mail address become links whatever escaping surrounds them
_GFM_URL = re.compile(r"(https?://|www(?=\.))([-.\w]+)", re.IGNORECASE)
_GFM_EMAIL = re.compile(r"([-.\w+]+)@([-\w]+(?:\.[-\w]+)+)")
_HELP_KINDS = ("button", "metric", "checkbox", "toggle", "radio", "selectbox", "text_input", "number_input")


def _check_markdown(kind, src) -> str:
    out = _render(str(src))
    assert "evil.example" not in " ".join(re.findall(r'(?:href|src)="([^"]*)"', out)), (kind, src)
    assert not re.search(r"<(script|img|b)[ >]", out.replace("&lt;", "«")), (kind, src)
    text = html.unescape(re.sub(r"<[^>]+>", "", out))
    prose = html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"<code>.*?</code>", " ", out, flags=re.S)))
    for m in list(_GFM_URL.finditer(prose)) + list(_GFM_EMAIL.finditer(prose)):  # code spans are never linked
        assert "evil" not in m.group(0), (kind, "autolinked", m.group(0), src)
    return text.replace("\u2060", "")  # the word joiners that keep a URL from linking read as nothing


def _check_page(at):
    assert_clean(at)
    assert not at.get("html"), "st.html renders raw HTML"
    shown = []
    for kind in _MD_KINDS:
        for el in getattr(at, kind):
            if getattr(el.proto, "allow_html", False):
                raise AssertionError(f"{kind} uses unsafe_allow_html: {el.value[:80]!r}")
            shown.append(_check_markdown(kind, el.value))
    for kind in _HELP_KINDS:  # labels and tooltips are markdown too
        for el in at.get(kind):
            for field in ("label", "help"):
                value = getattr(el.proto, field, "")
                if value:
                    shown.append(_check_markdown(f"{kind} {field}", value))
    for chart in at.get("plotly_chart"):
        spec = json.loads(chart.proto.spec) if chart.proto.spec else {}
        strings = json.dumps(spec)
        assert "<script" not in strings and "<img" not in strings and "<b>bold" not in strings, \
            "a plot draws a name as plotly markup"
    return "\n".join(shown)


def _frames_text(at) -> str:
    return "\n".join(d.value.to_string() if hasattr(d.value, "to_string") else str(d.value) for d in at.dataframe)


def test_sessions_page_shows_names_as_text(hostile_db):
    at = open_page("sessions")
    _check_page(at)
    tables = [d.value for d in at.dataframe]
    assert any(SESSION in set(t["session"]) for t in tables if "session" in t.columns)


@pytest.mark.slow
def test_overview_page_shows_names_as_text(hostile_db):
    at = open_page("overview", session=SESSION)
    text = _check_page(at)
    assert SESSION in text  # the title shows the name as typed
    assert f"message {EVIL}" in text and f"{OP_PREFIX}.5.fc" in text
    assert f"{OP_PREFIX}.5.fc" in _frames_text(at) or f"{OP_PREFIX}.0.fc" in _frames_text(at)


def test_ops_page_shows_names_as_text(hostile_db):
    at = open_page("ops", session=SESSION, run="fp16")
    _check_page(at)
    assert f"{OP_PREFIX}.3.fc" in _frames_text(at)


@pytest.mark.slow
def test_detail_page_shows_names_as_text(hostile_db):
    at = open_page("op_detail", session=SESSION, run="fp16", op="5")
    text = _check_page(at)
    assert f"{OP_PREFIX}.5.fc.output.0" in text


@pytest.mark.slow
def test_diff_page_shows_names_as_text(hostile_db):
    at = open_page("diff", session=SESSION)
    _check_page(at)


# a link or image the data chose: to its host, or mail (the pages' own links may carry a name in their query)
_EVIL_TARGET = ("a[href*='//evil.example'], a[href*='//www.evil'], a[href^='www.'], a[href^='mailto:'], "
                "img[src*='evil']")


def _hrefs(page) -> list:
    return page.evaluate("Array.from(document.querySelectorAll('a, img')).map(e => e.href || e.src)")[:20]


@pytest.mark.browser
def test_the_served_dashboard_shows_names_as_text_in_chromium(tmp_path):
    """Overview and Diff of the hostile session in Chromium, every tooltip hovered: no link or image the data
    chose, no request to its host, no script run."""
    import os
    import sys
    from urllib.parse import quote

    from playwright.sync_api import sync_playwright

    from precision_lab.store import Store, close_all

    db = tmp_path / "hostile.duckdb"
    _hostile_session(Store(db))
    close_all()
    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(db))
    for k in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
            "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"]
    with serving(argv, port=port, env=env, log_path=tmp_path / "streamlit.log") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context().new_page()
            dialogs, asked = [], []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("request", lambda r: asked.append(r.url))
            for where in ("overview", "diff"):
                page.goto(f"{url}/{where}?session={quote(SESSION)}")
                page.wait_for_selector("[data-testid='stMetric'], [data-testid='stButton']", timeout=60_000)
                page.wait_for_timeout(1500)
                targets = page.locator("[data-testid='stTooltipHoverTarget'], [data-testid='stTooltipIcon']")
                hovered = 0
                for i in range(min(targets.count(), 40)):
                    try:
                        targets.nth(i).hover(timeout=2000)
                    except Exception:  # noqa: BLE001 - one off-screen target: the others still count
                        continue
                    hovered += 1
                    page.wait_for_timeout(100)
                    assert page.locator(_EVIL_TARGET).count() == 0, (where, _hrefs(page))
                assert hovered, f"no tooltip on {where}"
                assert page.locator(_EVIL_TARGET).count() == 0, (where, _hrefs(page))
                assert "www.evil.example" in page.inner_text("body").replace("\u2060", ""), where
            from urllib.parse import urlsplit

            assert not [u for u in asked if "evil" in (urlsplit(u).hostname or "")] and dialogs == []
        finally:
            browser.close()


# ---- diagnosis messages: quoted op names as code, never as markup ------------------------------

@pytest.mark.parametrize("op", [OP_PREFIX, "a`b", "``x", "y`", "plain.op", EVIL])
def test_message_md_shows_quoted_names_as_code(op):
    from precision_lab.ui.common import code_md, message_md

    # a name holding backticks is quoted with a longer fence, as CommonMark does
    q = (lambda s: f"`{s}`") if "`" not in op else code_md
    msg = f"{q(op)} overflows fp16 *here* [x](http://evil.example) at {q(op + '.1')}"
    out = _render(message_md(msg))
    assert "href" not in out and not re.search(r"<(script|img|b|em)[ >]", out)
    codes = [html.unescape(c) for c in re.findall(r"<code>(.*?)</code>", out, flags=re.S)]
    assert len(codes) == 2
    # CommonMark strips one leading and trailing space of a padded code span
    assert codes[0] == op and codes[1] == f"{op}.1"
    text = html.unescape(re.sub(r"<[^>]+>", "", out)).strip()
    prose = html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"<code>.*?</code>", " ", out, flags=re.S)))
    assert not _GFM_URL.search(prose)  # GFM would not link the bare URL either
    assert text.replace("\u2060", "") == f"{op} overflows fp16 *here* [x](http://evil.example) at {op}.1"


def test_message_md_without_quotes_is_plain_escaping():
    from precision_lab.ui.common import escape_md, message_md

    assert message_md(f"message {EVIL}") == escape_md(f"message {EVIL}")
    assert message_md("") == ""
    # an unpaired backtick is text
    assert html.unescape(re.sub(r"<[^>]+>", "", _render(message_md("1 ` 2 `` 3")))).strip() == "1 ` 2 `` 3"


# ---- error messages: a name in an exception's text is shown as typed ---------------------------

def test_ingest_error_holding_markup_is_shown_as_text(monkeypatch, tmp_path):
    import streamlit as st

    import precision_lab.services.ingest as ingest_mod
    from precision_lab.store import close_all
    from ui_fixtures import app_test

    bad_file = "dump/[click](http://evil.example)<script>alert(4)</script>_x_.json"

    def refuse(*a, **kw):
        raise ingest_mod.IngestError(f"{bad_file}: not a msprobe dump")

    monkeypatch.setattr("precision_lab.ui.sessions.ingest", refuse)
    monkeypatch.setenv("PRECISION_LAB_DB", str(tmp_path / "err.duckdb"))
    st.cache_resource.clear()
    try:
        at = app_test()
        at.run()
        at.file_uploader(key="up_cand_dir").set_value([("cand/dump.json", b"{}", "application/json")])
        at.run()
        at.button(key="ingest").click().run()
        text = _check_page(at)
    finally:
        st.cache_resource.clear()
        close_all()
    assert len(at.error) == 1
    assert f"The upload could not be ingested: {bad_file}: not a msprobe dump" in text
    out = _render(at.error[0].value)
    assert "<a" not in out and "<script" not in out and "<em>" not in out

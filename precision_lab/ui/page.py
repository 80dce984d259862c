"""Streamlit plumbing the pages share: the page table, the store, who may do what, the session/run/op/format
pickers, navigation between pages, and errors shown as sentences.

The only module of ``precision_lab`` that imports streamlit; the view-models
beside it return DataFrames and figures and are tested without a browser.

URL state.  A page's own settings (the Ops filters, the Diff view) are widgets
bound to the URL by Streamlit (``bind="query-params"``: the widget's key is
the parameter, a value the widget cannot show is dropped, a default is left
out of the link).  The pickers that name what a page shows
(``?session=<name>&run=<run name>&op=<rid>&step=<n>&fmt=fp16&fmt=bf16``) are
the hand-made part, because a binding cannot serve them: Streamlit keeps a
bound value for its own page, while these carry over to the next page (the
navigation menu opens a page without the last one's URL) and are handed over
by ``navigate``; and their options come from the session or run chosen just
before.  Each picker starts from (in order) a value handed over by
``navigate``, its own widget state, the URL, the value last chosen on another
page, then a default; what it shows is written back to the URL, so a copied
link opens the same view.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import pandas as pd
import streamlit as st
from streamlit.navigation.page import StreamlitPage

from ..formats import FORMAT_NAMES
from ..public import public_text
from ..records import RunInfo
from .common import escape_md, run_label
from .overview import session_headline
from . import sessions as sessions_view
from ..store.queries import session_data_version, session_runs
from ..store import Store, default_db_path, held
from ..store.rows import SessionRow
from ..config import SHARE_PARAM, Access, ConfigError, ServerConfig, load_config, resolve_access
from ..scratch import scratch_root, sweep
from ..fixes.recipes import trust_user_models
from ..registry import Registry

__all__ = ["DashboardPage", "PAGES", "register_page", "page_script", "navigation", "routed", "page_run",
           "require_session", "start", "session_views", "cached_sessions_table", "get_config", "get_store", "access",
           "while_allowed", "sweep_scratch", "choose_session", "choose_run", "choose_formats", "url_select",
           "no_session_text", "bound_value", "linked", "not_found", "scoped", "peek", "page_key", "navigate",
           "show_error", "guard", "selected_row", "table_height", "progress_callback", "PAGE_ICON"]


@dataclass(frozen=True)
class DashboardPage:
    """One page of the dashboard under one name: its URL path and the name ``start``/``require_session`` take.
    ``render``: a plug-in's page function; None for a built-in page, whose script is ``pages/<name>.py``."""

    name: str
    title: str
    icon: str = ":material/extension:"
    render: Optional[Callable[[], None]] = None


# the dashboard's pages in menu order (the first opens at /); a plug-in adds one with ``register_page``, named by
# the ``precision_lab.pages`` entry point group
PAGES = Registry("dashboard page", group="precision_lab.pages", name_of=lambda p: p.name)
for _p in (DashboardPage("sessions", "Sessions", ":material/folder_open:"),
           DashboardPage("overview", "Overview", ":material/monitoring:"),
           DashboardPage("ops", "Ops", ":material/table_rows:"),
           DashboardPage("op_detail", "Op detail", ":material/bar_chart:"),
           DashboardPage("diff", "Diff", ":material/compare_arrows:"),
           DashboardPage("timeline", "Timeline", ":material/timeline:")):
    PAGES.register(_p.name, _p)
del _p


def register_page(name: str, title: str, icon: str = DashboardPage.icon, *, before: Optional[str] = None,
                  replace: bool = False):
    """Decorator: the decorated function is the dashboard page ``name`` (in the menu as ``title``, after the
    built-in pages or ahead of page ``before``).  It begins with ``require_session(name)`` or ``start(name)`` and
    renders what ``precision_lab.ui`` returns, as a built-in page does."""
    def add(render: Callable[[], None]) -> Callable[[], None]:
        PAGES.register(name, DashboardPage(name, title, icon, render), replace=replace, before=before)
        return render

    return add


def page_script(name: str) -> str:
    """The script of built-in page ``name``, relative to app.py."""
    return f"pages/{name}.py"


def _st_page(p: DashboardPage, default: bool = False) -> StreamlitPage:
    if p.render is None:
        return st.Page(page_script(p.name), title=p.title, icon=p.icon, default=default)
    return st.Page(p.render, title=p.title, icon=p.icon, url_path=p.name, default=default)


T = TypeVar("T")


class SessionView(Protocol):
    """``view(fn, *args, **kwargs)`` of ``session_views``: what ``fn(store, session_id, *args, **kwargs)`` gives."""

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...


def navigation() -> StreamlitPage:
    """The one registration of the pages (``st.navigation``), in ``PAGES`` order."""
    return st.navigation([_st_page(p, default=i == 0) for i, p in enumerate(PAGES.values())])


# the browser tab's icon: a file shipped with the package, served by this server (a material icon would be
# fetched from a font CDN, which an offline or air-gapped server cannot reach)
PAGE_ICON = str(Path(__file__).with_name("icon.png"))

_PENDING = "_pl_pending"  # values handed to the next page by navigate()
_REMEMBER = "_pl_last_"  # + param: last value chosen, carried across pages
_SHARE = "_pl_share"
_PAGE = "_pl_page"


# ---- store, config, access ------------------------------------------------------

@st.cache_data(max_entries=20_000, show_spinner=False)
def _headline(db_path: str, session_id: str, version: tuple, _store) -> dict:
    return session_headline(_store, session_id)


@st.cache_data(max_entries=2_000, show_spinner=False)
def _view(name: str, db_path: str, session_id: str, version: tuple, args: tuple, kwargs: tuple, _fn, _store):
    return _fn(_store, session_id, *args, **dict(kwargs))


def session_views(store, session_id: str) -> SessionView:
    """``view(fn, *args, **kwargs)``: ``fn(store, session_id, *args, **kwargs)``, a view-model of one session,
    cached per (function, database, session, data version, arguments).  The version is read once here (one
    query), so a page run costs one query for everything it shows that did not change since the last run;
    a re-run or a refreshed diagnosis changes the version and every view is computed again."""
    version = session_data_version(store, session_id)

    def view(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return _view(f"{fn.__module__}.{fn.__qualname__}", store.path, session_id, version, args,
                     tuple(sorted(kwargs.items())), fn, store)

    return view


def cached_headline(store) -> Callable[[str, tuple], dict]:
    """A session's headline for the Sessions list, cached per (database, session, version of its runs): the
    list of 200 sessions is not recomputed on every keystroke."""
    return lambda session_id, version: _headline(store.path, session_id, version, store)


@st.cache_resource(show_spinner=False)
def _open_store(path: str, lock_wait: float):
    return Store(path, lock_wait=lock_wait)


LOOPBACK = ("localhost", "127.0.0.1", "::1")


def local_server(cfg) -> bool:
    """Whether this dashboard serves only its own user: writable and listening on a loopback address (Streamlit
    unset listens on every address)."""
    return cfg is not None and not cfg.read_only and str(st.get_option("server.address") or "") in LOOPBACK


@contextlib.contextmanager
def page_run() -> Iterator[None]:
    """One page run: the database stays open (read-only) between the page's questions and is let go when the
    run ends, so terminals, notebooks and training jobs write between runs (app.py wraps every run).  A local
    dashboard also re-runs the models this user captured from the command line (``precision_lab.allowed``)."""
    cfg = _quiet_config()
    trust_user_models(local_server(cfg))
    with held((cfg.db_path if cfg else None) or default_db_path()):
        yield


@st.cache_data(max_entries=64, show_spinner=False)
def _sessions_table(db_path: str, version: tuple, _store) -> pd.DataFrame:
    return sessions_view.sessions_table(_store, headline=cached_headline(_store))


def cached_sessions_table(store) -> pd.DataFrame:
    """The Sessions list, cached on the database's version (``Store.data_version``: no query): a session
    written by another process shows on the next page run, and a run with nothing new asks nothing."""
    return _sessions_table(store.path, store.data_version(), store)


def get_config() -> ServerConfig:
    """The server configuration; a bad setting stops the page with its message."""

    try:
        return load_config()
    except ConfigError as e:
        st.error(escape_md(f"The server configuration cannot be used: {e}"))
        st.stop()


def get_store() -> Store:
    """The process-wide Store (one DuckDB connection; a cursor per thread)."""

    cfg = get_config()
    path = cfg.db_path or str(default_db_path())
    try:
        return _open_store(str(path), cfg.lock_wait)
    except Exception as e:  # a locked or unreadable database file
        st.error(escape_md(f"Cannot open the database {path}: {e}"))
        st.stop()


def _quiet_config():
    try:
        return load_config()
    except ConfigError:
        return None  # the page says so through get_config()


@st.cache_resource(show_spinner=False)
def _swept(root: str) -> tuple:
    return tuple(str(p) for p in sweep(root))


def sweep_scratch() -> None:
    """Remove leftovers of killed ingests from the scratch folder, once per server process
    (``precision_lab.scratch.sweep``; uploads sweep again as they start)."""

    _swept(str(scratch_root(_quiet_config())))


def server_folders() -> tuple:
    """Folders whose paths a message must not show a browser (see ``common.public_text``)."""
    root, tmp = scratch_root(_quiet_config()), Path(tempfile.gettempdir())
    return (str(root), str(root.resolve()), str(tmp), str(tmp.resolve()))


def access(store) -> Access:
    """What this visitor may do (``precision_lab.config.resolve_access``).

    A ``?share=`` token is remembered for the browser session, so moving
    between pages keeps the visitor on the shared session.
    """

    token = url_value(SHARE_PARAM) or st.session_state.get(_SHARE)
    params = {k: st.query_params.get_all(k) for k in st.query_params.keys()}
    if token:
        st.session_state[_SHARE] = token
        params[SHARE_PARAM] = [token]
        st.query_params[SHARE_PARAM] = token
    acc = resolve_access(params, store, get_config())
    if acc.error:
        st.error(escape_md(acc.error))
        st.stop()
    return acc


def while_allowed(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` for a download made when clicked: a visitor who came by a share link
    gets nothing once the link is revoked, though the page is still open."""
    token = st.session_state.get(_SHARE)
    if not token:
        return fn
    store = get_store()

    def run() -> T:
        if store.session_by_token(token) is None:
            raise PermissionError("this share link is not valid: the token is unknown or was revoked")
        return fn()

    return run


# ---- the pickers of what a page shows, carried across pages (hand-made: see the module's docstring for why a
# ---- binding to the URL cannot serve them)

def url_value(param: str) -> Optional[str]:
    vals = st.query_params.get_all(param)
    return vals[-1] if vals else None


_ROUTED = threading.local()


def routed() -> None:
    """Called by app.py right before ``st.navigation(...).run()``."""
    _ROUTED.flag = True


def _ensure_routed() -> None:
    """Make sure the page runs under app.py's ``st.navigation``.

    Streamlit still supports the older multipage mode in which every script
    in a ``pages/`` folder is a page of its own.  Until app.py has called
    ``st.navigation`` once in this process, a first request for a deep link
    (``/overview?session=...``) runs the page script directly in that mode,
    without app.py's page list, layout or error handling, and the process
    would stay in it.  Switching the flag Streamlit keeps for this and
    rerunning sends the same request through app.py.  The rerun happens
    only on a browser session's first run, where no click can be lost;
    later runs render the page as it is (Streamlit's AppTest resets the
    flag before every run).
    """
    if getattr(_ROUTED, "flag", False):
        _ROUTED.flag = False
        return
    from streamlit.runtime.pages_manager import PagesManager

    if PagesManager.uses_pages_directory:
        PagesManager.uses_pages_directory = False
        if _PAGE not in st.session_state:
            st.rerun()


def start(name: str) -> tuple[Store, Access]:
    """Begin page ``name`` (a key of ``PAGES``): record which page runs (picker keys are per page), drop
    values handed over by ``navigate`` to an earlier page, and return ``(store, access)``."""
    _ensure_routed()
    st.session_state[_PAGE] = name
    pending = st.session_state.get(_PENDING)
    if pending is not None:
        if pending.get("_page") != name or pending.get("_runs", 0) >= 1:
            st.session_state.pop(_PENDING, None)
        else:
            pending["_runs"] = 1
    store = get_store()
    return store, access(store)


def require_session(name: str, title: Optional[Callable[[SessionRow], str]] = None) -> tuple[Store, Access, SessionRow]:
    """Begin page ``name`` on a session: ``(store, access, session)``.  Draws the session picker and the page's title
    (``title(session)``, default the page's title in ``PAGES``); with no session to show, says where one comes
    from and stops."""
    store, acc = start(name)
    info = choose_session(store, acc)
    if info is None:
        st.title(PAGES[name].title)
        st.info(no_session_text(acc))
        st.stop()
    st.title(title(info) if title else PAGES[name].title)
    return store, acc, info


def bound_value(key: str, parse: Callable[[str], T], default: T) -> T:
    """The value a widget bound to the URL (``bind="query-params"``, key ``key``) is about to show, for a page that
    needs it before drawing the widget: the table's page number, read before the table and its pager are drawn.
    Streamlit seeds a bound widget from the URL only when the widget is drawn, so before that the URL is read
    here: the widget's state, else the URL's text through ``parse``, else ``default`` (a value ``parse`` refuses
    with ValueError/TypeError, as the widget would)."""
    if key in st.session_state:
        return st.session_state[key]
    text = url_value(key)
    try:
        return default if text is None else parse(text)
    except (ValueError, TypeError):
        return default


def page_key(key: str) -> str:
    """A widget key private to the current page.

    Streamlit forgets a widget's state when another page runs; a key shared
    by two pages would make the second page start from a stale value
    instead of the URL.
    """
    return f"{key}@{st.session_state.get(_PAGE, '')}"


def url_select(label: str, options: Sequence[T], *, param: str, key: str, default: Optional[T] = None,
               format_func: Callable = str) -> T:
    """A sidebar selectbox whose value is the URL parameter ``param`` (widget key ``page_key(key)``)."""
    key = page_key(key)
    options = list(options)
    # URL values are strings; match options by their string form
    by_text = {str(o): o for o in options}
    _initial(param, key, options, default, by_text)
    value = st.sidebar.selectbox(label, options, key=key, format_func=format_func)
    st.session_state[_REMEMBER + param] = str(value)
    st.query_params[param] = str(value)
    return value


def _initial(param: str, key: str, options: list, default: Any, by_text: dict) -> None:
    pending = st.session_state.get(_PENDING, {})
    if param in pending:
        want = pending.pop(param)
        want = by_text.get(str(want), want)
        if want in options:
            st.session_state[key] = want
            return
    if key in st.session_state and st.session_state[key] in options:
        return
    for want in (url_value(param), st.session_state.get(_REMEMBER + param)):
        if want is not None and str(want) in by_text:
            st.session_state[key] = by_text[str(want)]
            return
    st.session_state[key] = default if default in options else options[0]


def choose_session(store, acc) -> Optional[SessionRow]:
    """The session picker (``?session=``); None when there is no session.

    A visitor who came through a share link sees only that session.
    """
    if acc.shared:
        info = store.session(acc.session)
        st.query_params["session"] = info.name
        st.sidebar.caption(f"Shared session (read-only): {escape_md(info.name)}")
        return info
    if not acc.can_list:
        if acc.session:
            return store.session(acc.session)
        return None
    names = list(store.sessions()["name"])
    if not names:
        return None
    wanted = linked("session")
    if wanted is not None and wanted not in names:
        not_found(f"There is no session named {wanted}; choose one on the Sessions page.")
    name = url_select("Session", names, param="session", key="pick_session", default=acc.session)
    return store.session(name)


def no_session_text(acc) -> str:
    """What a page opened with no session says: where one comes from, for this visitor."""
    if acc.can_upload:
        return "No session yet: upload a dump or open a sample on the Sessions page."
    if acc.can_list:
        return "No session on this server yet. It is read-only: sessions cannot be added here."
    return "This server is read-only: a session opens through its share link."


def choose_run(store, session_id: str) -> Optional[RunInfo]:
    """The run picker (``?run=<run name>``) over the session's runs; the first candidate by default, None for a
    session with no run."""
    runs = session_runs(store, session_id)
    if not runs:
        return None
    names = [r.name for r in runs]
    default = next((r.name for r in runs if r.kind == "candidate"), names[0])
    by_name = {r.name: r for r in runs}
    name = url_select("Run", names, param="run", key="pick_run", default=default,
                      format_func=lambda n: run_label(by_name[n]))
    return by_name[name]


def choose_formats(default: Sequence[str]) -> list[str]:
    """The format multiselect (``?fmt=fp16&fmt=bf16``)."""
    key = page_key("pick_formats")
    pending = st.session_state.get(_PENDING, {})
    if "fmt" in pending:
        st.session_state[key] = [f for f in pending.pop("fmt") if f in FORMAT_NAMES]
    elif key not in st.session_state:
        from_url = [f for f in st.query_params.get_all("fmt") if f in FORMAT_NAMES]
        remembered = st.session_state.get(_REMEMBER + "fmt")
        st.session_state[key] = from_url or remembered or [f for f in default if f in FORMAT_NAMES]
    chosen = st.multiselect("Formats to overlay", list(FORMAT_NAMES), key=key,
                                   help="Number formats drawn over the values: shaded overflow, subnormal and "
                                        "underflow-to-zero regions, lines at max / smallest normal / smallest "
                                        "subnormal.")
    st.session_state[_REMEMBER + "fmt"] = list(chosen)
    st.query_params["fmt"] = list(chosen)
    return list(chosen)


def navigate(page: str, **params: Any) -> None:
    """Switch to ``page`` (a key of ``PAGES``) showing ``params``: the pickers' (session, run, op, fmt) and the
    page's own URL-bound settings (the Diff's ``view`` and ``q``)."""
    clean = {k: v for k, v in params.items() if v is not None}
    st.session_state[_PENDING] = {**clean, "_page": page}
    for k, v in clean.items():
        st.session_state[_REMEMBER + k] = v if isinstance(v, list) else str(v)
    token = st.session_state.get(_SHARE)
    qp = {k: ([str(x) for x in v] if isinstance(v, list) else str(v)) for k, v in clean.items()}
    if token:
        qp["share"] = token
    to = PAGES[page]
    st.switch_page(page_script(page) if to.render is None else _st_page(to), query_params=qp)


# ---- errors and progress -------------------------------------------------------------

def show_error(e: BaseException, what: str = "") -> None:
    """An exception as one plain sentence (never a traceback), without the
    server's upload and temporary folders in the paths it quotes.

    ``st.error`` renders markdown and messages quote op and file names from
    uploaded dumps, so the whole sentence is escaped to show as typed.
    """
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    msg = public_text(msg.strip(), server_folders()) or type(e).__name__
    st.error(escape_md(f"{what}: {msg}" if what else msg))


@contextlib.contextmanager
def guard(what: str = "") -> Iterator[None]:
    """Show an error from the library as a sentence and stop the page."""
    try:
        yield
    except Exception as e:  # st.stop / st.switch_page are BaseExceptions and pass through
        show_error(e, what)
        st.stop()


def selected_row(frame: pd.DataFrame, event) -> Optional[pd.Series]:
    """The row of ``frame`` that a single-row table selection ``event`` points at, or None: nothing selected, or a
    selection kept from before the table shrank (a filter, another page) that points past its end."""
    picked = event.selection.rows if event is not None else []
    if not picked or not 0 <= picked[0] < len(frame):
        return None
    return frame.iloc[picked[0]]


def table_height(rows: int) -> int:
    """Pixel height that shows every row of a table page, up to about 20 rows."""
    return min(38 + 35 * max(rows, 1), 740)


def progress_callback(bar) -> Callable[[int, int, str], None]:
    """``progress(done, total, label)`` for ``ingest`` drawing on an ``st.progress`` bar."""
    def cb(done: int, total: int, label: str) -> None:
        frac = 0.0 if not total else max(0.0, min(1.0, done / total))
        bar.progress(frac, text=escape_md(str(label)[:120]))  # file names are data, not markdown

    return cb


def linked(param: str) -> Optional[str]:
    """The value a link asks for (``navigate`` or the URL), or None when nothing asked for one."""
    pending = st.session_state.get(_PENDING, {})
    if param in pending:
        return str(pending[param])
    return url_value(param)


def not_found(sentence: str) -> None:
    """Say that what a link names does not exist, and stop: nothing else is opened in its place."""
    st.warning(escape_md(sentence), icon=":material/search_off:")
    st.stop()


def scoped(param: str, key: str, scope: str) -> None:
    """Forget the value last chosen for ``param`` (picker ``key``, the URL, the value carried across pages) when
    it was chosen under another ``scope``: an op's record number means nothing in another run.  A value handed
    over by ``navigate`` comes with its own run and is kept; so is one in a URL opened afresh."""
    mark = f"{_REMEMBER}{param}@scope"
    if param not in st.session_state.get(_PENDING, {}) and st.session_state.get(mark, scope) != scope:
        st.session_state.pop(page_key(key), None)
        st.session_state.pop(_REMEMBER + param, None)
        if param in st.query_params:
            del st.query_params[param]
    st.session_state[mark] = scope


def peek(param: str, key: str) -> Optional[str]:
    """The value a picker for ``param`` (widget ``key``) is about to start from, as text."""
    key = page_key(key)
    pending = st.session_state.get(_PENDING, {})
    if param in pending:
        return str(pending[param])
    if key in st.session_state:
        return str(st.session_state[key])
    return url_value(param) or st.session_state.get(_REMEMBER + param)

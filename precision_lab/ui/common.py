"""Small pieces every view-model shares: pages of a table, severity, number text."""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional

import pandas as pd

from ..display import num_text
from ..enums import Verdict, worst_first
from ..records import RunInfo

if TYPE_CHECKING:
    from pandas.io.formats.style import Styler

__all__ = ["Choices", "Page", "paged", "severity_label", "plot_text", "SEVERITIES", "SEVERITY_COLORS", "cosine_text", "escape_md",
           "code_md", "message_md", "run_label", "style_severity", "text_columns"]

# A record's severity as the tables show it, worst first: "nonfinite" (NaN/inf in the record or
# introduced against the reference), then the comparisons' verdicts ("ok" = expected).
SEVERITIES = tuple(v.label for v in worst_first(Verdict))
SEVERITY_COLORS = {v.label: v.colour for v in Verdict}


def severity_label(value: Any) -> str:
    """A record's severity (a ``Verdict`` value, as the read model gives it) as the tables write it; "" for none."""
    return Verdict(value).label if isinstance(value, str) and value else ""


@dataclass(frozen=True, slots=True)
class Choices:
    """What a picker offers: its options in order and the label each one is shown with."""

    options: tuple
    labels: tuple[str, ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[Hashable, str]]) -> "Choices":
        """From ``(option, label)`` pairs, in order; a repeated option keeps its last label, in its first place."""
        by_option = dict(pairs)
        return cls(tuple(by_option), tuple(by_option.values()))

    def label(self, option: Hashable) -> Optional[str]:
        """The label of ``option`` (a picker's ``format_func``); None for an option not offered."""
        try:
            return self.labels[self.options.index(option)]
        except ValueError:
            return None

    def __len__(self) -> int:
        return len(self.options)

    def __bool__(self) -> bool:
        return bool(self.options)


@dataclass(frozen=True)
class Page:
    """Page ``page`` (0-based) of a table: its rows, the table's row count, and whether any of its comparisons is
    on summary statistics only (``summary_*_err``, no ``max_*_err``)."""

    rows: pd.DataFrame
    total: int
    page: int
    page_size: int
    stats_basis: bool = False

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))


def paged(fetch: Callable[[int, int], Any], page: int, page_size: int) -> Page:
    """Page ``page`` of a table the read model gives a window at a time (``fetch(offset, limit)`` returns a
    ``store.views.Window``).  A page past the end shows the last page: a filter shrank the table, or a link is
    older than the data."""
    if page < 0 or page_size <= 0:
        raise ValueError(f"invalid page {page} of size {page_size}")
    got = fetch(page * page_size, page_size)
    last = max(0, -(-got.total // page_size) - 1)
    if page > last:
        page = last
        got = fetch(page * page_size, page_size)
    return Page(got.rows, got.total, page, page_size, got.stats_basis)


def cosine_text(cosine: Any, deficit: Any) -> str:
    """Cosine with enough digits to tell 0.99999 from 1, plus ``1-cos``.

    ``deficit`` (metrics' ``cosine_deficit``) is computed without the
    cancellation of ``1 - cosine``, so it is what the digits show.
    """
    if cosine is None or not math.isfinite(float(cosine)):
        return num_text(cosine)
    if deficit is None or not math.isfinite(float(deficit)):
        return f"{cosine:.12f}"
    return f"{1.0 - deficit:.12f} (1-cos = {deficit:.3e})"


# characters that start markup anywhere in a line (":" starts Streamlit's
# :color[...] and :material/...: directives)
_MD_SPECIAL = set("\\`*_{}[]()#!|<>~$:&")
# characters that start markup only at the beginning of a line (lists, rules)
_MD_LEADING = set("-+=")
_MD_ORDERED = re.compile(r"^(\d+)([.)])")
# what GFM turns into a link in plain text, whatever is escaped around it (its autolink-literal pass reads the text
# after escapes are resolved): "http://", "https://", "www." and "name@host"; a word joiner (U+2060, invisible)
# after the scheme's colon, after "www" and after "@" leaves the text as it reads and no link
_AUTOLINK = re.compile(r"((?:https?|ftp|mailto|xmpp):|\bwww(?=\.)|@)", re.IGNORECASE)


def plot_text(text: Any) -> str:
    """A name for a plotly label, shown as typed: plotly renders ``<a href>``,
    ``<b>``, ``<br>`` in hover text, legends and annotations, and decodes
    ``&lt; &gt; &amp;`` (not ``&quot;``) back to characters."""
    return html.escape("" if text is None else str(text), quote=False)


def escape_md(text: Any) -> str:
    """Text for ``st.markdown`` shown literally: op and file names come from
    uploaded dumps and must never render as links, HTML or formatting."""
    s = _AUTOLINK.sub("\\1\u2060", str(text).replace("\r", " ").replace("\n", " "))
    out = "".join("\\" + ch if ch in _MD_SPECIAL else ch for ch in s)
    if out[:1] in _MD_LEADING:
        out = "\\" + out
    return _MD_ORDERED.sub(r"\1\\\2", out)


def code_md(text: Any) -> str:
    """``text`` as a markdown inline code span, shown literally whatever it holds.

    The fence is one backtick longer than the longest run inside, so a name
    holding backticks cannot close it early (CommonMark code spans).
    """
    s = str(text).replace("\r", " ").replace("\n", " ")
    fence = "`" * (max((len(r) for r in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s[:1] == "`" or s[-1:] == "`" else ""
    return f"{fence}{pad}{s}{pad}{fence}"


_TICKS = re.compile(r"`+")


def message_md(text: Any) -> str:
    """A diagnosis message for ``st.markdown``: its `quoted` names as code, every other character escaped.

    Diagnosis messages quote op names in backticks; escaping the whole
    message would show the backticks, and passing it through would let a
    name render as markup.  Spans are found by CommonMark's rule (a run of N
    backticks closes at the next run of exactly N) and re-emitted with
    ``code_md``; a run with no partner is escaped like any other text.
    """
    s = str(text)
    out, at, pos = [], 0, 0
    while (m := _TICKS.search(s, pos)) is not None:
        n = len(m.group())
        close = next((c for c in _TICKS.finditer(s, m.end()) if len(c.group()) == n), None)
        if close is None:
            pos = m.end()
            continue
        if m.start() > at:
            out.append(escape_md(s[at:m.start()]))
        body = s[m.end():close.start()]
        if len(body) >= 2 and body[0] == " " and body[-1] == " " and body.strip(" "):
            body = body[1:-1]  # the padding a fence next to a backtick needs
        out.append(code_md(body))
        at = pos = close.end()
    if at < len(s) or not out:
        out.append(escape_md(s[at:]))
    return "".join(out)


def run_label(run: RunInfo) -> str:
    """``name (float16, candidate)``"""
    bits = [b for b in (run.dtype, run.kind) if b]
    if run.fix:
        bits.append(f"fix {run.fix}")
    return f"{run.name} ({', '.join(bits)})" if bits else str(run.name)


def style_severity(df: pd.DataFrame, column: str = "severity") -> Styler:
    """A pandas Styler colouring each row by its severity (nonfinite, error, warn, ok)."""
    def paint(row):
        color = SEVERITY_COLORS.get(row.get(column) or "", "")
        return [f"background-color: {color}" if color else "" for _ in row]

    return df.style.apply(paint, axis=1)


def _is_number(v: Any) -> bool:
    import numbers

    return isinstance(v, numbers.Number) and not isinstance(v, bool)


def text_columns(df: pd.DataFrame, columns=None, digits: int = 6) -> pd.DataFrame:
    """A copy of ``df`` with ``columns`` as short text (``num_text``): format
    limits span 1e-45..3e38, which no single fixed-width number format shows,
    and a table widget would print NaN as "None" and inf as "Infinity".
    ``columns=None``: every column holding only numbers (not flags) and missing values."""
    out = df.copy()
    if columns is None:
        columns = [c for c in out.columns if out[c].map(lambda v: v is None or _is_number(v)).all()]
    for c in columns:
        if c in out.columns:
            out[c] = [num_text(v, digits) for v in out[c]]
    return out



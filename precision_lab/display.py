"""How a number (and a string from data) is written for a person: one rule for the CLI, the dashboard, the HTML
report and diagnoses.

- no value (None, a missing cell): ``MISSING``, never "None" or "nan";
- NaN: ``nan``; infinities: ``inf`` and ``-inf``;
- an integer value below 10^15 exactly (``1024``, or ``1,024`` with ``grouped``);
- anything else to ``digits`` significant digits (``0.0975``, ``1.7e-06``).
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["MISSING", "num_text", "cosine_brief", "visible", "few"]

# what a table or card shows where there is no value (SQL NULL, None): not "nan", not "None"
MISSING = "—"


def visible(text: str) -> str:
    """``text`` with its control characters (escape, carriage return, bell, C1 controls, line and bidi overrides;
    not newline or tab) shown as escapes (``\\x1b``): a name from a file cannot move a terminal's cursor, retitle
    it, hide what follows or fake a line of output."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), str(text))


def few(names, shown: int = 5, width: int = 60, *, quoted: bool = False) -> str:
    """Names from a file for a message: the first ``shown``, each cut to ``width`` characters and its control
    characters escaped (``quoted``: in quotes), then how many more (a message naming 20,000 columns stays one
    short line)."""
    names = list(names)
    out = ", ".join((repr if quoted else str)(visible(str(n))[:width]) for n in names[:shown])
    return out + (f" and {len(names) - shown} more" if len(names) > shown else "")


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def num_text(v: Any, digits: int = 6, *, grouped: bool = False) -> str:
    """``v`` as text (see the module doc); ``grouped`` puts thousands separators in large numbers, for prose."""
    if v is None or type(v).__name__ == "NAType":
        return MISSING
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if grouped and 1000 <= abs(f) < 1e7:
        return f"{f:,.0f}"  # in a sentence a large count reads better whole: 78,450
    if f.is_integer() and abs(f) < 1e15:
        return f"{int(f):,}" if grouped else str(int(f))
    return f"{f:.{digits}g}"


def cosine_brief(cosine: Any, deficit: Any) -> str:
    """A cosine similarity in a table cell: near 1 as ``1-`` its deficit (``1-2.4e-05``, exact where the
    cosine's own digits would round to 1), else the value itself to 9 decimals (``0``, ``-0.0625``: the
    rounding left by computing 1 - deficit is not shown as a value)."""
    if deficit is None or cosine is None or not math.isfinite(float(deficit)) or not 0 < float(deficit) < 1e-3:
        c = None if cosine is None else float(cosine)
        return num_text(round(c, 9) + 0.0 if c is not None and math.isfinite(c) else cosine)
    return f"1-{num_text(deficit, 3)}"

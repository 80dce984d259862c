"""How a number is written for a person: one rule for the CLI, the dashboard, the HTML report and diagnoses.

- no value (None, a missing cell): ``MISSING``, never "None" or "nan";
- NaN: ``nan``; infinities: ``inf`` and ``-inf``;
- an integer value below 10^15 exactly (``1024``, or ``1,024`` with ``grouped``);
- anything else to ``digits`` significant digits (``0.0975``, ``1.7e-06``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MISSING", "num_text"]

# what a table or card shows where there is no value (SQL NULL, None): not "nan", not "None"
MISSING = "—"


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

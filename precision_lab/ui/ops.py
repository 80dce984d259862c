"""The Ops table: every record of a run with its comparison, filtered, sorted
and paginated inside DuckDB (LIMIT/OFFSET), so a session of a million
records costs one page of rows in pandas, not the whole table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from ..services.origins import nonfinite_origin
from ..store.views import SORTABLE, OpsFilter, filter_options, ops_rows
from .common import Page, cosine_text, paged, severity_label, text_columns

__all__ = ["FilterChoices", "ops_page", "filtered_page", "filter_choices", "SORT_OPTIONS", "display_frame", "intended_nonfinite"]

# what the table may be sorted by (the read model's SORTABLE)
SORT_OPTIONS = tuple(SORTABLE)


@dataclass(frozen=True, slots=True)
class FilterChoices:
    """What each filter of the Ops page offers for a run: its roles, op types, steps and ranks (the run's
    distinct values, ``store.views.filter_options``) and the columns to sort by (``SORT_OPTIONS``)."""

    roles: list
    op_types: list
    steps: list
    ranks: list
    sort: list


def filter_choices(store, run_id: str) -> FilterChoices:
    """The Ops page's filters' options for a run."""
    opts = filter_options(store, run_id)
    return FilterChoices(opts.roles, opts.op_types, opts.steps, opts.ranks, list(SORT_OPTIONS))


def intended_nonfinite(store, run_id: str) -> tuple[bool, tuple[str, ...]]:
    """``(failed, intended ops)`` of a run, what "Problems only" leaves out (``OpsFilter.intended``/``failed``):
    whether a NaN/Inf of the run reaches a failure (``services.report.nonfinite_origin``), and the ops that
    wrote NaN/Inf on purpose."""
    first, masks = nonfinite_origin(store, run_id)
    return first is not None, tuple(dict.fromkeys(m.op for m in masks))


def ops_page(store, f: OpsFilter, *, page: int = 0, page_size: int = 50) -> Page:
    """Page ``page`` (0-based; past the end: the last) of the op table for the filter ``f``."""
    return paged(lambda offset, limit: ops_rows(store, f, offset=offset, limit=limit), page, page_size)


def filtered_page(store, run_id: str, *, only_problems: bool = False, page: int = 0, page_size: int = 50,
                  **chosen) -> Page:
    """Page ``page`` of run ``run_id``'s op table as the Ops page's filters chose it (``chosen``: the other
    ``OpsFilter`` fields); "Problems only" leaves out what the run wrote on purpose (``intended_nonfinite``)."""
    failed, intended = intended_nonfinite(store, run_id) if only_problems else (True, ())
    f = OpsFilter(run_id=run_id, only_problems=only_problems, intended=intended, failed=failed, **chosen)
    return ops_page(store, f, page=page, page_size=page_size)


def display_frame(df: pd.DataFrame, *, summary: Optional[bool] = None) -> pd.DataFrame:
    """The columns the Ops page shows, in reading order (rid stays for selection).

    ``summary``: show ``summary_rel_err`` (the error of a comparison on summary statistics, which has no
    element-wise ``max_rel_err``) beside ``max_rel_err``; pass ``Page.stats_basis``, or leave None to
    decide from the rows shown.  Numbers are text by ``num_text``: NaN reads ``nan``, infinities ``inf``,
    a value that was never computed (no comparison) ``MISSING``."""
    if summary is None:
        summary = bool((df["basis"] == "stats").any()) if "basis" in df.columns else False
    out = pd.DataFrame({
        "severity": df["severity"].map(severity_label),
        "seq": df["seq"], "op": df["op"], "type": df["op_type"], "role": df["role"], "index": df["index"],
        "dtype": df["dtype"], "shape": df["shape"], "nan": df["nan_count"], "inf": df["inf_count"],
        "zero": df["zero_count"], "absmax": df["absmax"],
        "max_abs_err": df["max_abs_err"], "max_rel_err": df["max_rel_err"],
        **({"summary_rel_err": df["summary_rel_err"]} if summary else {}),
        "cosine": [cosine_text(c, d) for c, d in zip(df["cosine"], df["cosine_deficit"])],
        "sqnr_db": df["sqnr_db"], "verdict": df["verdict"].fillna(""),
        "local_max_rel_err": df["local_max_rel_err"], "match": df["match"].fillna(""),
        "step": df["step"], "rank": df["rank"], "rid": df["rid"],
    })
    numbers = ["nan", "inf", "zero", "absmax", "max_abs_err", "max_rel_err", "sqnr_db", "local_max_rel_err"]
    return text_columns(out, numbers + (["summary_rel_err"] if summary else []), 4)

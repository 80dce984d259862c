"""The Diff page: reference stats | candidate stats | metrics, aligned per op,
and the N-run view with one column group per run."""

from __future__ import annotations

from dataclasses import replace
from ..services import browse
from ..services.browse import SHOW_OPTIONS, DiffPage, base_run, nrun_page, pair_options, unmatched_counts
from .common import cosine_text

__all__ = ["DiffPage", "pair_options", "diff_page", "nrun_page", "base_run", "SHOW_OPTIONS", "unmatched_counts"]


def diff_page(store, session_id: str, ref_run_id: str, cand_run_id: str, *, show: str = "all",
              pattern: str = "", page: int = 0, page_size: int = 50) -> DiffPage:
    """One page of the reference | candidate | metrics table (``services.browse.diff_page``), cosine shown
    as text with 1 - cos."""
    got = browse.diff_page(store, session_id, ref_run_id, cand_run_id, show=show, pattern=pattern, page=page,
                           page_size=page_size)
    df = got.rows
    if "cosine" in df.columns:
        df.insert(df.columns.get_loc("sqnr_db"), "cosine (1-cos)",
                  [cosine_text(c, d) for c, d in zip(df["cosine"], df["cosine_deficit"])])
        df = df.drop(columns=["cosine", "cosine_deficit"])
    return replace(got, rows=df)

"""Lookups about a stored session that several use cases share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..fixes.policy import PrecisionPolicy
from ..records import RunInfo
from ..store import queries as q
from ..store.rows import SessionRow

__all__ = ["recipe_name", "run_policy"]


def run_policy(run: RunInfo) -> Optional[PrecisionPolicy]:
    """The precision policy a run recorded (its ``policy`` column); None for a run as built (an fp32
    reference, a dump) or one whose policy was not a PrecisionPolicy."""
    text = run.policy
    if not text:
        return None
    try:
        return PrecisionPolicy.from_json(text)
    except (ValueError, TypeError):
        return None


def recipe_name(store, info: SessionRow, runs=None) -> Optional[str]:
    """The recipe a session was made from: its ``recipe`` column, else its runs' ``recipe:<name>`` source
    (``runs``: the session's runs where the caller has read them).

    A sample dump written by ``precision_lab.services.samples`` names its recipe
    in its ``manifest.json``, so a session ingested from it (while the
    folder is there) can be re-run too.
    """
    name = info.recipe or info.notes.get("recipe")
    if name:
        return name
    srcs = ({r.source for r in runs if r.source} if runs is not None
            else set(q.run_sources(store, info.session_id)))
    names = {s.split(":", 1)[1] for s in srcs if s.startswith("recipe:")}
    for s in srcs - {f"recipe:{n}" for n in names}:
        manifest = Path(s) / "manifest.json"
        try:
            doc = json.loads(manifest.read_text()) if manifest.is_file() else {}
        except (OSError, ValueError):
            doc = {}
        if isinstance(doc, dict) and isinstance(doc.get("recipe"), str):
            names.add(doc["recipe"])
        else:
            return None
    return names.pop() if len(names) == 1 else None

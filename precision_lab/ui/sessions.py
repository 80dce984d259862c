"""The Sessions page's data: the list of sessions with their headline, and
turning an upload or a sample into a new session."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pandas as pd

from ..store import queries as q
from ..store import views
from ..public import public_source, public_text
from ..records import RunInfo
from .common import run_label
from .overview import session_headline
from ..services.samples import Sample
from ..services.upload import UploadError, write_upload
from ..services.ingest import IngestError, ingest
from ..readers import first_line
from ..readers.safeio import plain_error
from ..scratch import scratch_dir, scratch_root, sweep

__all__ = ["sessions_table", "session_version", "ingest_upload", "open_sample", "sample_session_name", "IngestFailed"]

Progress = Callable[[int, int, str], None]


class IngestFailed(ValueError):
    """An upload or sample could not be ingested; the message is a sentence for the user."""


def session_version(runs: list[RunInfo]) -> tuple:
    """What a session's headline depends on, from its runs: a re-run adds one (records never change)."""
    return (len(runs), max((str(r.created or "") for r in runs), default=""),
            tuple(sorted(r.run_id for r in runs)))


def sessions_table(store, *, headlines: bool = True, headline: Optional[Callable[[str, tuple], dict]] = None
                   ) -> pd.DataFrame:
    """Sessions, newest first: name, created, runs, first non-finite op, worst op, source.

    ``headline(session_id, version)``: the session's headline (default ``session_headline``); the page passes
    a cached one, keyed on ``session_version`` so a re-run shows at once.
    """
    sessions = q.session_list(store)
    runs = views.all_runs(store)
    by_session: dict[str, list[RunInfo]] = {}
    for r in runs:
        by_session.setdefault(r.session_id, []).append(r)
    if headline is None:
        headline = lambda sid, _version: session_headline(store, sid)  # noqa: E731
    undiagnosed = set(store.undiagnosed_sessions())
    out = []
    for s in sessions:
        version = session_version(by_session.get(s.session_id, []))
        head = headline(s.session_id, version) if headlines else {"first_nonfinite": "", "worst": ""}
        out.append({
            "session": s.name, "created": s.created,
            "runs": ", ".join(run_label(r) for r in by_session.get(s.session_id, [])),
            "first non-finite": head["first_nonfinite"], "largest error": head["worst"],
            "diagnosed": s.name not in undiagnosed,
            "source": s.recipe or public_source(s.source), "session_id": s.session_id,
        })
    return pd.DataFrame(out, columns=["session", "created", "runs", "first non-finite", "largest error", "diagnosed",
                                      "source", "session_id"])


def _ingest(store, cand: Path, ref: Optional[Path], *, session: Optional[str], progress: Optional[Progress],
            zip_limits=None, labels: Optional[dict] = None, recipe: Optional[str] = None) -> str:
    kw: dict[str, Any] = {"recipe": recipe} if recipe else {}
    if zip_limits is not None:
        kw["zip_limits"] = zip_limits
    try:
        return ingest([cand], reference=[ref] if ref else None, session=session or None, store=store,
                      progress=progress, labels=labels, **kw)
    except IngestError as e:
        raise IngestFailed(str(e)) from None


def _upload_name(files: list, default: str) -> str:
    """What the visitor chose: the .zip's name, or the folder the files share."""
    names = [str(getattr(f, "name", f[0] if isinstance(f, tuple) else "")).replace("\\", "/") for f in files]
    tops = {n.strip("/").split("/")[0] for n in names if n.strip("/")}
    if len(names) == 1 and "/" not in names[0].strip("/"):
        return names[0].strip("/") or default
    return next(iter(tops)) if len(tops) == 1 else default


def ingest_upload(store, candidate: Iterable[Any], reference: Optional[Iterable[Any]] = None, *,
                  session: Optional[str] = None, progress: Optional[Progress] = None, max_depth: int = 32,
                  zip_limits=None, config=None) -> str:
    """Write the uploaded candidate (and optional fp32 reference) files to a
    scratch folder (``precision_lab.scratch``) and ingest them into a new
    session; returns its name.

    Raises ``IngestFailed`` with one sentence naming the uploaded file and
    the problem, whatever went wrong; messages and the stored sources name
    files relative to the upload, never the server's folders.  The scratch
    folder is removed whatever happens, and leftovers of killed ingests are
    swept first.
    """
    candidate = list(candidate or [])
    reference = list(reference or [])
    if not candidate:
        raise IngestFailed("choose the dump folder (or .zip) to analyse first")
    shown = _upload_name(candidate, "candidate")
    if reference:
        shown += f" (reference {_upload_name(reference, 'reference')})"
    root = scratch_root(config)
    folders = (root, root.resolve(), tempfile.gettempdir(), Path(tempfile.gettempdir()).resolve())
    try:
        sweep(root)
        with scratch_dir("upload", root=root) as tmp:
            try:
                cand_path = write_upload(candidate, tmp / "candidate", max_depth=max_depth, default_name="candidate")
                ref_path = (write_upload(reference, tmp / "reference", max_depth=max_depth,
                                         default_name="reference") if reference else None)
            except UploadError as e:
                raise IngestFailed(str(e)) from None
            labels = {str(p): p.name for p in (cand_path, ref_path) if p is not None}
            return _ingest(store, cand_path, ref_path, session=session, progress=progress, zip_limits=zip_limits,
                           labels=labels)
    except IngestFailed as e:
        raise IngestFailed(public_text(e, folders)) from None
    except OSError as e:  # the upload cannot be written on the server (disk full, permissions)
        raise IngestFailed(f"{shown}: cannot be stored on the server for reading "
                           f"({e.strerror or type(e).__name__})") from None
    except (RecursionError, MemoryError, OverflowError) as e:
        raise IngestFailed(f"{shown}: {plain_error(e)}") from None
    except Exception as e:  # one sentence whatever failed: never a bare exception
        raise IngestFailed(public_text(f"{shown}: could not be ingested ({first_line(e)})", folders)) from None


def sample_session_name(sample: Sample) -> str:
    return f"{sample.name}-vs-{sample.reference.name}" if sample.reference else sample.name


def open_sample(store, sample: Sample, *, progress: Optional[Progress] = None) -> str:
    """The session of a sample dump (with its reference when it has one),
    ingested on first use and reused after; returns the session name."""
    name = sample_session_name(sample)
    if views.session_exists(store, name):
        return name
    labels = {str(p): p.name for p in (sample.candidate, sample.reference) if p is not None}
    return _ingest(store, sample.candidate, sample.reference, session=name, progress=progress, labels=labels,
                   recipe=sample.recipe)

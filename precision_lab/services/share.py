"""Move a session between databases as one file, and give it a share link.

An exported session is a zip holding one Parquet file per table (sessions,
runs, tensors, histograms, tensor_data, comparisons, diagnoses, warnings),
restricted to that session's rows, plus ``manifest.json``::

    {"format": "precision-lab-session", "format_version": 1,
     "schema_version": <store schema>, "hist_edges_id": ..., "session": {"session_id", "name"},
     "tables": {"runs": {"file": "runs.parquet", "rows": 3, "sha256": "...", "bytes": 1234}, ...}}

Import trusts nothing in the file: the zip passes ``safezip.check_zip``, every
table's checksum and row count must match the manifest, columns must be ones
the store knows, and every row must belong to the declared session and its
runs.  The whole import is one transaction, so a refused or failed import
leaves the database as it was.  An import never replaces an existing session:
a clashing name gets a suffix and the result says so; clashing ids are
replaced by fresh ones.  An archive written at an older schema version
imports too: the tables and columns it lacks read as empty, and rows whose
meaning changed since are brought up to this version (a statistics-only
comparison's errors move to their summary columns, schema 5).

Share tokens are not exported: a token is a capability on one server (an
archive written before schema 7 has a ``share_token`` column in
sessions.parquet, always empty; it is dropped on import).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union
from urllib.parse import urlencode, urlsplit, urlunsplit, parse_qsl

from ..scratch import scratch_dir
from ..public import PATH_DIRS, PATH_DIRS_KEEP
from ..store.transfer import TABLES, ImportRefused, copy_session_tables, insert_session_tables, table_columns
from .. import __version__
from ..stats import HIST_EDGES_ID
from ..store import SCHEMA_VERSION, resolve_db_path
from ..config import SHARE_PARAM
from ..tokens import token_file_for
from .share_archive import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShareError, _check_consistency, _load_manifest,
                            _open_zip, _read_table)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TABLES",
    "ShareError",
    "ExportResult",
    "ImportResult",
    "export_session",
    "export_bytes",
    "import_session",
    "read_manifest",
    "create_share_token",
    "revoke_share_token",
    "revoke_recorded_token",
    "RevokedLink",
    "share_url",
]

# A fixed zip timestamp makes two exports of the same session byte-identical.
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class ExportResult:
    path: Optional[str]
    session: str
    rows: dict
    bytes: int


@dataclass(frozen=True)
class ImportResult:
    session: str  # name in this database
    session_id: str
    original_name: str
    rows: dict
    renamed: bool = False
    new_ids: bool = False  # session or run ids were replaced because they already existed here
    notes: tuple = field(default=())

    @property
    def message(self) -> str:
        n = self.rows.get("tensors", 0)
        runs = self.rows.get("runs", 0)
        msg = f"imported session {self.session!r} ({runs} runs, {n} tensor records)"
        if self.renamed:
            msg += f"; a session named {self.original_name!r} already exists, so it was imported as {self.session!r}"
        for note in self.notes:
            msg += f"; {note}"
        return msg


# ---- export -----------------------------------------------------------------

_COPY_CHUNK = 1 << 20


def _file_digest(path: Path) -> tuple[str, int]:
    """(sha256, size) of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest(), path.stat().st_size


def export_bytes(store, session: str) -> bytes:
    """The exported session as zip bytes (for a download button)."""
    out = io.BytesIO()
    _export(store, session, out)
    return out.getvalue()


def _export(store, session: str, out) -> dict:
    """Write the zip to the binary file object ``out``; returns rows per table.

    Tables go to temporary Parquet files first, so memory stays bounded by
    DuckDB's buffers whatever the size of the kept tensors; the manifest,
    which needs their checksums, is the zip's last entry.
    """
    info = store.session(session)
    sid = info.session_id
    tables: dict[str, dict] = {}
    with scratch_dir("export") as tmp:
        # what the file carries of the sharer's machine: no path, each file or folder by its name
        public = {"runs": ("source",), "sessions": ("source", "recipe"), "warnings": ("file", "message")}
        for t in copy_session_tables(store, sid, Path(tmp), rewrite=public, pattern=PATH_DIRS,
                                     replacement=PATH_DIRS_KEEP):
            digest, size = _file_digest(t.path)
            tables[t.table] = {"file": t.path.name, "rows": t.rows, "sha256": digest, "bytes": size}
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "schema_version": SCHEMA_VERSION,
            "precision_lab_version": __version__,
            "hist_edges_id": HIST_EDGES_ID,
            "session": {"session_id": sid, "name": info.name},
            "tables": tables,
        }
        with zipfile.ZipFile(out, "w", allowZip64=True) as zf:
            for table in TABLES:
                zi = zipfile.ZipInfo(tables[table]["file"], date_time=_ZIP_DATE)
                zi.compress_type = zipfile.ZIP_STORED  # Parquet is already compressed
                with open(Path(tmp) / tables[table]["file"], "rb") as src, zf.open(zi, "w", force_zip64=True) as dst:
                    while chunk := src.read(_COPY_CHUNK):
                        dst.write(chunk)
            zi = zipfile.ZipInfo(MANIFEST, date_time=_ZIP_DATE)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, json.dumps(manifest, indent=2, sort_keys=True))
    return {t: v["rows"] for t, v in tables.items()}


def export_session(store, session: str, path: os.PathLike | str) -> ExportResult:
    """Write ``session`` to ``path`` (a zip); the file appears complete or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".zip", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            rows = _export(store, session, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ExportResult(path=str(path), session=store.session(session).name, rows=rows,
                        bytes=path.stat().st_size)


# ---- import -----------------------------------------------------------------

def read_manifest(path: os.PathLike | str) -> dict:
    """The validated manifest of an exported session (no table is read)."""
    path = Path(path)
    with _open_zip(path, None) as zf:
        return _load_manifest(zf, str(path))


def import_session(store, source: Union[os.PathLike, str, bytes], *, name: Optional[str] = None,
                   config=None, filename: Optional[str] = None) -> ImportResult:
    """Import an exported session into ``store`` in one transaction.

    ``source``: a path, or the file's bytes (an upload; ``filename`` names it
    in messages).  ``name``: the session's name here (default: its exported
    name); a name already taken gets a ``-2``, ``-3``... suffix, reported in
    ``ImportResult.message``.  Raises ShareError naming the file and the
    problem; the database is unchanged then.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        label = filename or "uploaded file"
        with scratch_dir("import", config) as d:
            p = d / "session.zip"
            p.write_bytes(bytes(source))
            try:
                return _import_path(store, p, name=name, config=config, where=label)
            except ShareError as e:
                # messages name the upload, not the temporary copy
                raise ShareError(str(e).replace(str(p), label)) from None
    p = Path(source)
    return _import_path(store, p, name=name, config=config, where=str(p))


SHARED_SOURCE = "shared archive: "


def _sources_as_text(tables: dict) -> dict:
    """An archive's run sources name folders on the machine that exported it, and replay reads a run's tensors
    from its source folder.  Imported, each becomes ``shared archive: <source>``: kept as text to show, never a
    folder this machine reads (a crafted archive could otherwise point replay at any local dump)."""
    import pyarrow.compute as pc

    runs = tables.get("runs")
    if runs is None or "source" not in runs.column_names:
        return tables
    i = runs.column_names.index("source")
    col = pc.utf8_replace_slice(runs.column(i).cast("string"), start=0, stop=0, replacement=SHARED_SOURCE)
    return {**tables, "runs": runs.set_column(i, "source", col)}


def _import_path(store, path: Path, *, name, config, where: str) -> ImportResult:
    if name is not None:
        name = name.strip()
        if not name:
            raise ShareError(f"{where}: the name to import as cannot be empty")
    with _open_zip(path, config) as zf:
        m = _load_manifest(zf, where)
        held = [t for t in TABLES if t in m["tables"]]
        listed = {MANIFEST} | {m["tables"][t]["file"] for t in held}
        for info in zf.infolist():
            if info.is_dir():
                continue
            if info.filename not in listed:
                raise ShareError(f"{where}: entry {info.filename!r} is not listed in {MANIFEST}; refusing a file "
                                 "that carries more than it declares")
        present = {i.filename for i in zf.infolist()}
        for t in held:
            if m["tables"][t]["file"] not in present:
                raise ShareError(f"{where}: {MANIFEST} lists {m['tables'][t]['file']} but the zip does not hold it")
        columns = table_columns(store, held).by_table
        tables = {t: _read_table(zf, where, t, m["tables"][t], columns[t]) for t in held}
    tables = _sources_as_text(tables)
    sid, orig_name = m["session"]["session_id"], m["session"]["name"]
    _check_consistency(store, where, sid, orig_name, tables)

    wanted = name or orig_name
    try:
        got = insert_session_tables(
            store, tables, session_id=sid, name=wanted, where=where, hist_edges_id=m.get("hist_edges_id"),
            schema_version=m["schema_version"])
    except ImportRefused as e:
        raise ShareError(str(e)) from None
    final_name, new_sid, run_map, notes = got.name, got.session_id, got.run_map, got.notes
    if new_sid != sid or run_map:
        notes.append("its ids already existed in this database, so fresh ones were given")
    rows = {t: tables[t].num_rows if t in tables else 0 for t in TABLES}
    return ImportResult(session=final_name, session_id=new_sid, original_name=wanted, rows=rows,
                        renamed=final_name != wanted, new_ids=bool(new_sid != sid or run_map), notes=tuple(notes))


# ---- share links ------------------------------------------------------------

def create_share_token(store, session: str) -> str:
    """Give ``session`` a fresh unguessable token (replacing any old one) and return it."""
    token = secrets.token_urlsafe(16)  # 128 random bits
    store.set_share_token(session, token)
    return token


def revoke_share_token(store, session: str) -> None:
    """Make the session's share link stop working (from the server's next request)."""
    store.set_share_token(session, None)


@dataclass(frozen=True, slots=True)
class RevokedLink:
    """A share link revoked: the session's id and name as recorded with it, and its token."""

    session_id: str
    name: str
    token: str


def revoke_recorded_token(db_path, session: str) -> list[RevokedLink]:
    """Revoke ``session``'s link in the token file beside the database at ``db_path``,
    without opening the database (a running server holds it).

    ``session``: the name or id recorded with the token.  Returns the links
    removed; empty when no link of that session is recorded.  A server
    reading the same file refuses the token from its next request.
    """
    tf = token_file_for(resolve_db_path(db_path))
    if tf is None or not tf.exists():
        return []
    return [RevokedLink(e["session_id"], e.get("name"), e.get("token")) for e in tf.revoke(session)]


def share_url(base_url: str, token: str) -> str:
    """``base_url`` with ``?share=<token>`` added (other query parameters kept)."""

    parts = urlsplit(base_url)
    q = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in (SHARE_PARAM, "session")]
    q.append((SHARE_PARAM, token))
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/", urlencode(q), parts.fragment))

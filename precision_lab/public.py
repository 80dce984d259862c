"""What of a stored string may leave this machine: paths as a browser, a shared file or a report may see them.

Sources name the folders a dump was read from (for an upload, a folder on the server) and the files a model was
built from; a page, an export, a share link and an HTML report show each path below the upload folder, or as
its last name, never the sharer's or the server's file system.
"""

from __future__ import annotations

import math
import re

__all__ = ["public_source", "public_text", "paths_by_name", "PATH_DIRS", "PATH_DIRS_KEEP"]


# ---- server paths never reach a browser -----------------------------------------------

# folders a server makes for one upload: scratch folders (precision_lab.scratch) and the
# temporary folders of earlier versions, whose names a stored source may still hold
_SERVER_DIR = (r"(?:[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?-\d{1,10}-\d{1,20}-[a-z0-9_]{8}"
               r"|precision-lab-upload-[A-Za-z0-9_]+|precision-lab-[a-z0-9_]{8}|pl-(?:import|export)-[a-z0-9_]{8})")
_SERVER_DIR_RE = re.compile(_SERVER_DIR)
_SEP = re.compile(r"[\\/]+")
_ROLE_DIR = r"(?:[\\/]+(?:candidate|reference)(?=[\\/]))?"
# a path token (no spaces or quotes) that runs through a server folder, up to and including it
_SERVER_PATH_RE = re.compile(r"(?<![^\s'\"(\[=,;])[^\s'\"]*?(?<![^\s'\"(\[=,;\\/])" + _SERVER_DIR + _ROLE_DIR
                             + r"(?:[\\/]+|(?=[\s'\"),;:]|$))")
_ROLE_PART = re.compile(r"(candidate|reference): (.*)", re.S)


def _is_absolute(path: str) -> bool:
    return path.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:[\\/]", path) is not None


def _public_path(path: str) -> str:
    """One stored path as a browser may see it: below the upload folder, else its last name."""
    parts = [c for c in _SEP.split(path.strip())]
    marks = [i for i, c in enumerate(parts) if _SERVER_DIR_RE.fullmatch(c)]
    if marks:
        below = [c for c in parts[marks[-1] + 1:] if c]
        if len(below) > 1 and below[0] in ("candidate", "reference"):
            below = below[1:]
        return "/".join(below) or "upload"
    named = [c for c in parts if c]
    if named and (_is_absolute(path.strip()) or ".." in named):
        return named[-1]
    return path


def public_source(text) -> str:
    """A session's or run's stored ``source`` as the dashboard shows it.

    Sources name the folders a dump was read from, which for an upload is a
    folder on the server.  Each path becomes what is below the upload
    folder (``candidate: /srv/.../upload-.../candidate/my_dump.zip`` ->
    ``candidate: my_dump.zip``); any other absolute path becomes its last
    name.  Text that is not a path (a recipe, ``capture``) is kept.
    """
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return ""
    out = []
    for part in re.split(r"; (?=(?:candidate|reference): )", str(text)):
        m = _ROLE_PART.fullmatch(part)
        if m:
            out.append(f"{m.group(1)}: {_public_path(m.group(2))}")
        elif _ENTRY.match(part):  # a model's entry points: each file by its name
            out.append(paths_by_name(part))
        else:
            out.append(_public_path(part))
    return "; ".join(out)


# a model named by entry points (``model:/home/me/m.py:build,/home/me/m.py:inputs``, behind ``recipe:`` or
# ``replay:``): its file paths are cut to their names (``paths_by_name``)
_ENTRY = re.compile(r"^(?:(?:recipe|replay):)?model:")


def public_text(text, folders=()) -> str:
    """A message with the server's folders taken out of the paths it quotes.

    ``folders``: folders whose first level below is a per-upload folder
    (the scratch root, the system's temporary folder); ``<folder>/<upload
    folder>/`` is removed wherever it appears, and so is any path up to a
    folder named like an upload folder.  What stays names files relative to
    the upload (``my_dump.zip``, ``dump/step0/x.npy``).
    """
    s = str(text)
    for base in sorted({str(f).rstrip("/\\") for f in folders if f and str(f).rstrip("/\\")}, key=len,
                       reverse=True):
        s = re.sub(re.escape(base) + r"[\\/]+[^\\/\s'\"]+" + _ROLE_DIR + r"(?:[\\/]+|(?=[\s'\"),;:]|$))", "", s)
    return _SERVER_PATH_RE.sub("", s)


# an absolute path inside a text, up to its last name: its directories, after the start or a separator (a space,
# ":", ";", ",", "=", "("), which stays.  Written for RE2 too (no look-behind): an export applies it with
# pyarrow.compute, ``paths_by_name`` with ``re``
PATH_DIRS = r"(^|[\s:;,=(])(?:/|~/|[A-Za-z]:\\)(?:[^\s/\\:;,]*[/\\])+"
PATH_DIRS_KEEP = r"\1"
_PATH_DIRS = re.compile(PATH_DIRS)


def paths_by_name(text) -> str:
    """``text`` with every absolute path in it cut to its last name (``could not write
    /home/me/x.duckdb.replay/ab12.pt`` -> ``could not write ab12.pt``, ``model:/home/me/m.py:build`` ->
    ``model:m.py:build``): what a file passed on says of a path."""
    if text is None:
        return text
    return _PATH_DIRS.sub(lambda m: m.group(1), str(text))

"""Where Precision Lab keeps its files by default."""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Optional

__all__ = ["ENV_DB", "default_data_dir", "default_db_path", "resolve_db_path", "samples_dir", "replay_kit_path"]

ENV_DB = "PRECISION_LAB_DB"


def samples_dir() -> Path:
    """The sample dumps: ``precision_lab/sample_dumps`` in an installed package (the wheel carries the
    checkout's ``sample_dumps/`` there), else ``sample_dumps/`` beside the package in a source checkout."""
    packaged = files(__package__) / "sample_dumps"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[1] / "sample_dumps"


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/precision-lab`` (``~/.local/share/precision-lab`` when unset)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "precision-lab"


def default_db_path() -> Path:
    """``$PRECISION_LAB_DB``, else ``$XDG_DATA_HOME/precision-lab/precision_lab.duckdb``."""
    env = os.environ.get(ENV_DB)
    if env:
        return Path(env).expanduser()
    return default_data_dir() / "precision_lab.duckdb"


def resolve_db_path(path: Optional[os.PathLike | str] = None) -> str:
    """The absolute path ``Store(path)`` opens (``:memory:`` stays as is)."""
    p = str(path) if path is not None else str(default_db_path())
    return p if p == ":memory:" else str(Path(p).expanduser().resolve())


_RUN_ID = re.compile(r"^[0-9a-f]{6,64}$")


def replay_kit_path(db_path: os.PathLike | str, run_id: str) -> Optional[Path]:
    """Where the replay kit of run ``run_id`` lives: ``<database>.replay/<run_id>.pt`` beside the database file
    (None for an in-memory database).  Made from the run's id, never read from a session; ``ValueError`` for an
    id that is not one."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run id {run_id!r} does not name a replay kit")
    db = resolve_db_path(db_path)
    return None if db == ":memory:" else Path(db + ".replay") / f"{run_id}.pt"

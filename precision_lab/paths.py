"""Where Precision Lab keeps its files by default."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import Optional

__all__ = ["ENV_DB", "default_data_dir", "default_db_path", "resolve_db_path", "samples_dir"]

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

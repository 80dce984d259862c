"""Where Precision Lab keeps its files by default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["ENV_DB", "default_data_dir", "default_db_path", "resolve_db_path"]

ENV_DB = "PRECISION_LAB_DB"


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

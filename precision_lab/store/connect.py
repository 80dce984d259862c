"""The one way this package connects to DuckDB.

Every connection reads and writes its own database file only: no ``read_text``, ``glob``, ``read_csv``,
``COPY`` or ``ATTACH`` of other files, no extension fetched or loaded, the settings locked.  So a database file
someone hands over cannot make a query read this machine's files or reach the network.
"""

from __future__ import annotations

__all__ = ["SAFE_CONFIG", "connect_duckdb"]

SAFE_CONFIG = {"enable_external_access": False, "autoload_known_extensions": False,
               "autoinstall_known_extensions": False, "lock_configuration": True}


def connect_duckdb(path: str = ":memory:", read_only: bool = False, readable: tuple = (),
                   threads: int | None = None):
    """``duckdb.connect`` with ``SAFE_CONFIG`` (DuckDB is imported here: importing the store loads none).
    ``readable``: files (never folders or globs) its queries may read besides its own database, the only
    exception to ``enable_external_access``, set before the settings are locked; ``threads`` (with
    ``readable``): DuckDB's threads for it."""
    import duckdb

    if not readable:
        return duckdb.connect(path, read_only=read_only, config=dict(SAFE_CONFIG))
    con = duckdb.connect(path, read_only=read_only, config={k: v for k, v in SAFE_CONFIG.items()
                                                            if k in ("autoload_known_extensions",
                                                                     "autoinstall_known_extensions")})
    try:
        con.execute("SET allowed_paths = ?", [[str(p) for p in readable]])
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con

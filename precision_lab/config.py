"""Server configuration: who may do what when the dashboard is served to a team.

Settings come from, in increasing priority: the defaults below, a TOML file
(``$PRECISION_LAB_CONFIG``, else ``precision_lab.toml`` in the working
directory when present), then one environment variable per setting.  Every
setting is listed in ``SETTINGS`` with its variable and meaning; docs/sharing.md
documents the same list and a test keeps the two in step.

``resolve_access(query_params, store)`` turns a request's URL parameters into
an ``Access``: which session to open and whether this visitor may upload,
delete or re-run.  A ``?share=<token>`` URL opens exactly one session read-only
whatever the server mode; a read-only server never allows writes.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .readers.safeio import ReadLimits
from .safezip import ZipLimits

__all__ = [
    "ServerConfig",
    "Setting",
    "SETTINGS",
    "ConfigError",
    "load_config",
    "Access",
    "resolve_access",
    "CONFIG_ENV",
    "SHARE_PARAM",
]

CONFIG_ENV = "PRECISION_LAB_CONFIG"
DEFAULT_CONFIG_FILE = "precision_lab.toml"
SHARE_PARAM = "share"
SESSION_PARAM = "session"

_MB = 1024 * 1024
DEFAULT_LOCK_WAIT = 30.0  # seconds
LOCK_WAIT_ENV = "PRECISION_LAB_LOCK_WAIT"


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names where it came from."""


@dataclass(frozen=True)
class Setting:
    name: str  # field of ServerConfig and key in the TOML file
    env: str
    kind: type
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("db_path", "PRECISION_LAB_DB", str,
            "DuckDB database file the server reads and writes (default: the per-user data directory)."),
    Setting("read_only", "PRECISION_LAB_READ_ONLY", bool,
            "Serve existing sessions only: no uploads, imports, deletes, renames or re-runs."),
    Setting("list_sessions", "PRECISION_LAB_LIST_SESSIONS", bool,
            "Show the list of all sessions. Default: on, except on a read-only server, where "
            "sessions are reached by share link only."),
    Setting("max_upload_mb", "PRECISION_LAB_MAX_UPLOAD_MB", int,
            "Largest single upload (dump file, zip or exported session) accepted, in MiB."),
    Setting("zip_max_files", "PRECISION_LAB_ZIP_MAX_FILES", int,
            "Most entries a zip (upload or exported session) may hold."),
    Setting("zip_max_total_mb", "PRECISION_LAB_ZIP_MAX_TOTAL_MB", int,
            "Most bytes, in MiB, a zip may expand to in total."),
    Setting("zip_max_ratio", "PRECISION_LAB_ZIP_MAX_RATIO", float,
            "Largest compression ratio (uncompressed / compressed) of any zip entry over 64 KiB, and of a "
            "whole zip expanding to more than 16 MiB; above it the zip is treated as a zip bomb. Applies to "
            "uploads and to the zip inside every .npz and .pt file."),
    Setting("max_path_depth", "PRECISION_LAB_MAX_PATH_DEPTH", int,
            "Deepest folder nesting accepted inside an uploaded folder or zip."),
    Setting("max_tensor_mb", "PRECISION_LAB_MAX_TENSOR_MB", int,
            "Largest tensor read from a dump, in MiB, as its header declares it (elements x item size), "
            "checked before any data is read; also the most one member of a .npz or .pt may expand to."),
    Setting("max_file_records", "PRECISION_LAB_MAX_FILE_RECORDS", int,
            "Most tensors one dump file may describe: dump.json entries, Parquet shard rows, or tensors "
            "in one .npz, .pt or .safetensors file."),
    Setting("max_json_mb", "PRECISION_LAB_MAX_JSON_MB", int,
            "Largest JSON file read from a dump (dump.json, manifests, order files, sidecars), in MiB."),
    Setting("work_dir", "PRECISION_LAB_WORK_DIR", str,
            "Folder for uploads and extracted zips while they are ingested (default: scratch/ in the "
            "per-user data directory); leftovers of killed ingests are swept from it."),
    Setting("lock_wait", LOCK_WAIT_ENV, float,
            "Seconds a command, notebook or page waits for another process to let go of the database before it "
            "stops with one sentence naming that process (0 or more)."),
)


@dataclass(frozen=True)
class ServerConfig:
    """Validated settings; build with ``load_config()``."""

    db_path: Optional[str] = None
    read_only: bool = False
    list_sessions: Optional[bool] = None  # None: on unless read_only
    max_upload_mb: int = 1024
    # the zip defaults are ZipLimits' own (one definition)
    zip_max_files: int = ZipLimits.max_files
    zip_max_total_mb: int = ZipLimits.max_total_bytes >> 20
    zip_max_ratio: float = ZipLimits.max_ratio
    max_path_depth: int = ZipLimits.max_depth
    max_tensor_mb: int = ReadLimits.max_tensor_bytes >> 20  # the read defaults are ReadLimits' own
    max_file_records: int = ReadLimits.max_file_records
    max_json_mb: int = ReadLimits.max_json_bytes >> 20
    work_dir: Optional[str] = None
    lock_wait: float = DEFAULT_LOCK_WAIT
    source: str = "defaults"  # where the settings came from, for messages

    def __post_init__(self) -> None:
        for f in ("max_upload_mb", "zip_max_files", "zip_max_total_mb", "max_path_depth", "max_tensor_mb",
                  "max_file_records", "max_json_mb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{self.source}: {f} must be a positive integer, got {v!r}")
        if not isinstance(self.zip_max_ratio, (int, float)) or isinstance(self.zip_max_ratio, bool) \
                or not self.zip_max_ratio > 1:
            raise ConfigError(f"{self.source}: zip_max_ratio must be a number above 1, got {self.zip_max_ratio!r}")
        check_lock_wait(self.lock_wait, self.source)

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * _MB

    @property
    def zip_max_total_bytes(self) -> int:
        return self.zip_max_total_mb * _MB

    @property
    def can_list_sessions(self) -> bool:
        return (not self.read_only) if self.list_sessions is None else bool(self.list_sessions)

    def zip_limits(self) -> ZipLimits:
        """The zip limits as ``precision_lab.safezip.ZipLimits``."""
        return ZipLimits.from_config(self)

    def read_limits(self) -> ReadLimits:
        """The limits on reading dump files as ``precision_lab.readers.safeio.ReadLimits``."""
        return ReadLimits.from_config(self)


def check_lock_wait(value: Any, where: str) -> float:
    """``value`` as the ``lock_wait`` setting: a finite number of seconds, 0 or more (``ConfigError`` otherwise)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    if not ok:
        raise ConfigError(f"{where}: lock_wait must be a number of seconds, 0 or more, got {value!r}")
    return float(value)


def env_lock_wait(env: Optional[Mapping[str, str]] = None) -> float:
    """The ``lock_wait`` setting from ``$PRECISION_LAB_LOCK_WAIT`` alone (unset or empty: the default), for every
    process that opens the database, not only a server."""
    text = (os.environ if env is None else env).get(LOCK_WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_LOCK_WAIT
    where = f"environment variable {LOCK_WAIT_ENV}"
    return check_lock_wait(_parse(_LOCK_WAIT, text, where), where)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}  # an empty value is an unset switch (``VAR=`` in a shell)


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case; empty is off), for settings and URL toggles alike."""
    t = str(text).strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"not a switch: {text!r} (use true or false)")


def _parse(setting: Setting, raw: Any, where: str) -> Any:
    if setting.kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return parse_bool(raw)
        raise ConfigError(f"{where}: {setting.name} must be true or false, got {raw!r}")
    if setting.kind is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{where}: {setting.name} must be an integer, got {raw!r}")
        try:
            return int(str(raw).strip()) if not isinstance(raw, int) else raw
        except ValueError:
            raise ConfigError(f"{where}: {setting.name} must be an integer, got {raw!r}") from None
    if setting.kind is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{where}: {setting.name} must be a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {setting.name} must be a number, got {raw!r}") from None
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: {setting.name} must be a string, got {raw!r}")
    return raw


_LOCK_WAIT = next(s for s in SETTINGS if s.name == "lock_wait")


def load_config(path: Optional[os.PathLike | str] = None, env: Optional[Mapping[str, str]] = None) -> ServerConfig:
    """Defaults <- TOML file <- environment variables.

    ``path`` overrides ``$PRECISION_LAB_CONFIG``; a named file that does not
    exist is an error (a typo must not silently give an open server).  The
    TOML file may hold the settings at top level or under ``[server]``.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources = []
    cfg_path = path if path is not None else env.get(CONFIG_ENV)
    if cfg_path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        cfg_path = DEFAULT_CONFIG_FILE
    if cfg_path:
        p = Path(cfg_path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (named by {CONFIG_ENV} or --config)")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p}: not valid TOML ({e})") from None
        table = data.get("server", data)
        if not isinstance(table, dict):
            raise ConfigError(f"config file {p}: [server] must be a table")
        known = {s.name: s for s in SETTINGS}
        unknown = sorted(k for k in table if k not in known)
        if unknown:
            raise ConfigError(
                f"config file {p}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
        for k, raw in table.items():
            values[k] = _parse(known[k], raw, f"config file {p}")
        sources.append(str(p))
    for s in SETTINGS:
        if s.env in env:
            raw = env[s.env]
            if s.kind is str and not raw.strip():
                continue  # an empty variable means "not set"
            values[s.name] = _parse(s, raw, f"environment variable {s.env}")
            sources.append(s.env)
    values["source"] = ", ".join(sources) if sources else "defaults"
    if values.get("db_path"):
        values["db_path"] = str(Path(values["db_path"]).expanduser())
    return ServerConfig(**values)


# ---- access for one visitor -------------------------------------------------

@dataclass(frozen=True)
class Access:
    """What one visitor may see and do.

    ``session``: the session to open (name), or None for "choose one".
    ``read_only``: nothing may be written. ``can_list``: the session picker
    may show every session. ``shared``: opened through a share token, so the
    page must stay on that one session. ``error``: a sentence to show instead
    (unknown or revoked token).
    """

    session: Optional[str]
    read_only: bool
    can_upload: bool
    can_delete: bool
    can_rerun: bool = False
    can_list: bool = True
    shared: bool = False
    error: Optional[str] = None


def _param(query_params: Mapping[str, Any], key: str) -> Optional[str]:
    if query_params is None:
        return None
    try:
        v = query_params.get(key)
    except Exception:
        return None
    if isinstance(v, (list, tuple)):
        v = v[-1] if v else None
    if v is None:
        return None
    v = str(v).strip()
    return v or None


def resolve_access(query_params: Mapping[str, Any], store, config: Optional[ServerConfig] = None) -> Access:
    """Decide what this visitor sees from the URL's parameters and the server config.

    - ``?share=<token>``: the one session holding that token, read-only, no
      session list (the token is the only capability the visitor has).  An
      unknown token gives an ``error`` and no session, never a fallback to the
      full list.
    - read-only server: ``?session=`` may name a session only when listing is
      allowed; nothing may be written.
    - otherwise: full access; ``?session=`` preselects a session.
    """
    config = config or load_config()
    token = _param(query_params, SHARE_PARAM)
    if token is not None:
        info = store.session_by_token(token)
        if info is None:
            return Access(session=None, read_only=True, can_upload=False, can_delete=False, can_rerun=False,
                          can_list=False, shared=True,
                          error="This share link is not valid: the token is unknown or was revoked.")
        return Access(session=info.name, read_only=True, can_upload=False, can_delete=False,
                      can_rerun=False, can_list=False, shared=True)
    can_list = config.can_list_sessions
    wanted = _param(query_params, SESSION_PARAM)
    session = None
    if wanted is not None and can_list:
        try:
            session = store.session(wanted).name
        except KeyError:
            session = None
    if config.read_only:
        return Access(session=session, read_only=True, can_upload=False, can_delete=False, can_rerun=False,
                      can_list=can_list)
    return Access(session=session, read_only=False, can_upload=True, can_delete=True, can_rerun=True,
                  can_list=can_list)


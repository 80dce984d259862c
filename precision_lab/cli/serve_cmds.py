"""``precision-lab serve``: run the dashboard with the server settings applied.

Streamlit reads some limits only when it starts (``server.maxUploadSize``,
the address it listens on), so they are set here, on its command line:

- it listens on ``localhost`` unless ``--address`` says otherwise; serving
  to a team (``--address 0.0.0.0``) is a choice made on purpose, with the
  trust model of docs/sharing.md;
- a read-only server (``--read-only`` or the ``read_only`` setting) gets
  ``PRECISION_LAB_READ_ONLY=1`` and Streamlit's smallest upload limit, so its
  own upload endpoint (``PUT /_stcore/upload_file/...``) refuses every
  non-empty file before holding it; otherwise the limit is ``max_upload_mb``.

``serve_command`` builds the command without running anything (tests).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import typer

from ._app import app, echo
from ._common import fail
from ..config import CONFIG_ENV, ConfigError, DEFAULT_CONFIG_FILE, load_config

__all__ = ["ServeCommand", "serve_command", "APP", "READ_ONLY_UPLOAD_MB", "LOOPBACK"]

# app.py beside the package in a source checkout
APP = Path(__file__).resolve().parents[2] / "app.py"
# Streamlit 1.67 takes any integer for server.maxUploadSize and compares each upload's size (Content-Length
# first, then the bytes received) against it: 0 MB refuses every non-empty file with 413. A negative value
# would also refuse empty ones, but it is outside what the option means and what its widgets expect.
READ_ONLY_UPLOAD_MB = 0
LOOPBACK = ("localhost", "127.0.0.1", "::1")
# options this command sets itself; given as extra Streamlit arguments they would undo it
_OWN = {"--server.address": "--address", "--server.port": "--port",
        "--server.maxUploadSize": "--read-only or the max_upload_mb setting"}


@dataclass(frozen=True)
class ServeCommand:
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    cwd: str
    read_only: bool
    warning: Optional[str] = None  # to print before starting


def serve_command(config, *, read_only: bool = False, address: str = "localhost", port: Optional[int] = None,
                  extra: Sequence[str] = (), config_file: Optional[str] = None,
                  environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                  app_path: os.PathLike | str = APP) -> ServeCommand:
    """The ``streamlit run`` command line, environment and working folder for the dashboard.

    ``config``: the loaded ``ServerConfig``; ``config_file``: the TOML file
    it came from, if any.  The server runs in app.py's folder (so its
    ``.streamlit/config.toml`` applies), so the settings that name paths are
    handed over as absolute paths (resolved against ``cwd``).  Raises
    ``ValueError`` for an extra argument that would override what this
    command sets.
    """
    env = dict(os.environ if environ is None else environ)
    here = Path(cwd) if cwd is not None else Path.cwd()
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in _OWN:
            raise ValueError(f"{name} is set by this command: use {_OWN[name]}")
    ro = bool(read_only or config.read_only)
    upload_mb = READ_ONLY_UPLOAD_MB if ro else int(config.max_upload_mb)
    app_path = Path(app_path)
    argv = [sys.executable, "-m", "streamlit", "run", str(app_path),
            "--server.address", address, "--server.maxUploadSize", str(upload_mb)]
    if port is not None:
        argv += ["--server.port", str(int(port))]
    argv += list(extra)

    def absolute(p: str) -> str:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (here / q))

    if config_file:
        env[CONFIG_ENV] = absolute(config_file)
    elif env.get(CONFIG_ENV):
        env[CONFIG_ENV] = absolute(env[CONFIG_ENV])
    if config.db_path:
        env["PRECISION_LAB_DB"] = absolute(config.db_path)
    if getattr(config, "work_dir", None):
        env["PRECISION_LAB_WORK_DIR"] = absolute(config.work_dir)
    if ro:
        env["PRECISION_LAB_READ_ONLY"] = "1"
    warning = None
    if address not in LOOPBACK and not ro:
        warning = (f"serving a writable dashboard on {address}: everyone who can reach this port can see every "
                   "session, upload, import, re-run, rename and delete, with no login (docs/sharing.md, "
                   "'Trust model'); --read-only serves sessions by share link only")
    return ServeCommand(argv=argv, env=env, cwd=str(app_path.parent), read_only=ro, warning=warning)


def _config_file(explicit: Optional[str]) -> Optional[str]:
    """The TOML file ``load_config`` reads: ``--config``, ``$PRECISION_LAB_CONFIG`` or ./precision_lab.toml."""

    if explicit:
        return explicit
    if os.environ.get(CONFIG_ENV):
        return os.environ[CONFIG_ENV]
    return DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).is_file() else None


def _exec(cmd: ServeCommand) -> None:  # replaced in tests
    os.chdir(cmd.cwd)
    os.execve(cmd.argv[0], cmd.argv, cmd.env)


@app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_cmd(
    ctx: typer.Context,
    read_only: bool = typer.Option(False, "--read-only", help="serve sessions by share link only; no uploads"),
    address: str = typer.Option("localhost", "--address",
                                help="interface to listen on; 0.0.0.0 serves everyone who can reach this machine"),
    port: Optional[int] = typer.Option(None, "--port", help="port (default: Streamlit's, 8501)"),
    db: Optional[str] = typer.Option(None, "--db", help="database file (default: the db_path setting)"),
    config_file: Optional[str] = typer.Option(None, "--config", help="TOML file (default $PRECISION_LAB_CONFIG)"),
) -> None:
    """Start the dashboard: localhost only unless --address says otherwise.

    Arguments after the options go to ``streamlit run`` (``--server.headless true``).
    """

    cfg_file = _config_file(config_file)
    try:
        cfg = load_config(config_file)
    except ConfigError as e:
        fail(str(e))
    if db:
        import dataclasses

        cfg = dataclasses.replace(cfg, db_path=db)
    if not APP.is_file():
        fail(f"{APP} not found: serve runs the dashboard of a source checkout (streamlit run app.py)")
    try:
        cmd = serve_command(cfg, read_only=read_only, address=address, port=port, extra=ctx.args,
                            config_file=cfg_file)
    except ValueError as e:
        fail(str(e))
    if cmd.warning:
        echo(f"warning: {cmd.warning}", err=True)
    _exec(cmd)

"""``precision-lab serve``: localhost by default, and a read-only server whose upload endpoint takes nothing."""

from __future__ import annotations

import asyncio
import os
import sys
import tomllib
from pathlib import Path

import pytest

from precision_lab.cli.serve_cmds import APP, READ_ONLY_UPLOAD_MB, serve_command
from precision_lab.config import ServerConfig

pytestmark = pytest.mark.slow  # starts servers

ROOT = Path(__file__).resolve().parents[1]


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_streamlit_config_binds_to_localhost():
    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "localhost"


def test_default_command_listens_on_localhost_with_the_upload_limit(tmp_path):
    cmd = serve_command(ServerConfig(max_upload_mb=300), environ={}, cwd=str(tmp_path))
    assert cmd.argv[:5] == [sys.executable, "-m", "streamlit", "run", str(APP)]
    assert _opt(cmd.argv, "--server.address") == "localhost"
    assert _opt(cmd.argv, "--server.maxUploadSize") == "300"
    assert "--server.port" not in cmd.argv
    assert "PRECISION_LAB_READ_ONLY" not in cmd.env and not cmd.read_only and cmd.warning is None
    assert cmd.cwd == str(APP.parent)  # .streamlit/config.toml beside app.py applies


@pytest.mark.parametrize("flag, setting", [(True, False), (False, True)])
def test_read_only_takes_no_uploads(tmp_path, flag, setting):
    cmd = serve_command(ServerConfig(read_only=setting), read_only=flag, environ={"KEEP": "1"}, cwd=str(tmp_path))
    assert _opt(cmd.argv, "--server.maxUploadSize") == str(READ_ONLY_UPLOAD_MB) == "0"
    assert cmd.env["PRECISION_LAB_READ_ONLY"] == "1" and cmd.env["KEEP"] == "1" and cmd.read_only


def test_team_address_port_and_extra_arguments(tmp_path):
    cmd = serve_command(ServerConfig(), address="0.0.0.0", port=9000, extra=["--server.headless", "true"],
                        environ={}, cwd=str(tmp_path))
    assert _opt(cmd.argv, "--server.address") == "0.0.0.0" and _opt(cmd.argv, "--server.port") == "9000"
    assert cmd.argv[-2:] == ["--server.headless", "true"]
    assert "writable dashboard on 0.0.0.0" in cmd.warning and "Trust model" in cmd.warning
    ro = serve_command(ServerConfig(), address="0.0.0.0", read_only=True, environ={}, cwd=str(tmp_path))
    assert ro.warning is None
    for extra in (["--server.maxUploadSize", "500"], ["--server.maxUploadSize=500"], ["--server.address=::"]):
        with pytest.raises(ValueError, match="set by this command"):
            serve_command(ServerConfig(read_only=True), extra=extra, environ={}, cwd=str(tmp_path))


def test_paths_in_settings_are_made_absolute(tmp_path):
    """The server runs in app.py's folder: relative paths the operator gave still mean what they meant."""
    cfg = ServerConfig(db_path="data/lab.duckdb", work_dir="scratch")
    cmd = serve_command(cfg, config_file="lab.toml", environ={}, cwd=str(tmp_path))
    assert cmd.env["PRECISION_LAB_DB"] == str(tmp_path / "data" / "lab.duckdb")
    assert cmd.env["PRECISION_LAB_WORK_DIR"] == str(tmp_path / "scratch")
    assert cmd.env["PRECISION_LAB_CONFIG"] == str(tmp_path / "lab.toml")
    cmd = serve_command(ServerConfig(), environ={"PRECISION_LAB_CONFIG": "other.toml"}, cwd=str(tmp_path))
    assert cmd.env["PRECISION_LAB_CONFIG"] == str(tmp_path / "other.toml")


def test_cli_serve_builds_and_hands_over(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import precision_lab.cli.serve_cmds as serve_mod
    from precision_lab.cli import app

    ran = []
    monkeypatch.setattr(serve_mod, "_exec", ran.append)
    monkeypatch.delenv("PRECISION_LAB_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["serve", "--read-only", "--port", "8600", "--db", "lab.duckdb",
                                   "--server.headless", "true"])
    assert out.exit_code == 0, out.output
    (cmd,) = ran
    assert _opt(cmd.argv, "--server.maxUploadSize") == "0" and _opt(cmd.argv, "--server.port") == "8600"
    assert cmd.argv[-2:] == ["--server.headless", "true"]
    assert cmd.env["PRECISION_LAB_DB"] == str(tmp_path / "lab.duckdb")
    assert cmd.env["PRECISION_LAB_READ_ONLY"] == "1"

    out = CliRunner().invoke(app, ["serve", "--address", "0.0.0.0"])
    assert out.exit_code == 0 and "warning: serving a writable dashboard on 0.0.0.0" in out.output
    out = CliRunner().invoke(app, ["serve", "--server.maxUploadSize", "900", "--read-only"])
    assert out.exit_code == 2 and "set by this command" in out.output
    monkeypatch.setenv("PRECISION_LAB_MAX_UPLOAD_MB", "lots")
    out = CliRunner().invoke(app, ["serve"])
    assert out.exit_code == 2 and "PRECISION_LAB_MAX_UPLOAD_MB" in out.output
    assert len(ran) == 2


# ---- Streamlit's own upload endpoint under the read-only limit -------------------------------

async def _put(asgi, size: int, content_length: bool) -> int:
    boundary = "pl-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="dump.zip"\r\n'
            "Content-Type: application/zip\r\n\r\n").encode() + b"x" * size + f"\r\n--{boundary}--\r\n".encode()
    headers = [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())]
    if content_length:
        headers.append((b"content-length", str(len(body)).encode()))
    path = "/_stcore/upload_file/session-1/file-1"
    scope = {"type": "http", "method": "PUT", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("localhost", 8501),
             "client": ("127.0.0.1", 50000), "root_path": ""}
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]

    async def receive():
        if chunks:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    status = []

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await asgi(scope, receive, send)
    return status[0]


@pytest.mark.parametrize("content_length", [True, False])
def test_the_read_only_limit_refuses_every_upload(content_length):
    """Against the installed Streamlit: at the limit ``serve --read-only`` sets, its upload
    endpoint stores nothing (413), with or without a Content-Length; a 1 MB limit stores."""
    from starlette.applications import Starlette
    from streamlit import config
    from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager
    from streamlit.web.server.starlette.starlette_routes import create_upload_routes

    class Runtime:
        def is_active_session(self, session_id):
            return True

    saved = {k: config.get_option(k) for k in ("server.maxUploadSize", "server.enableXsrfProtection")}
    try:
        config.set_option("server.enableXsrfProtection", False)
        for limit, sizes, stored in ((READ_ONLY_UPLOAD_MB, (1, 100_000, 3_000_000), False), (1, (100_000,), True)):
            config.set_option("server.maxUploadSize", limit)
            mgr = MemoryUploadedFileManager("/_stcore/upload_file")
            asgi = Starlette(routes=create_upload_routes(Runtime(), mgr, None))
            for size in sizes:
                code = asyncio.run(_put(asgi, size, content_length))
                assert (code == 204) == stored, (limit, size, code)
            assert bool(mgr.get_files("session-1", ["file-1"])) == stored
    finally:
        for k, v in saved.items():
            config.set_option(k, v)


def test_serve_starts_streamlit_on_localhost(tmp_path):
    """The real command: Streamlit accepts the arguments (the read-only upload limit included)."""
    from ui_fixtures import free_port, serving

    port = free_port()
    env = dict(os.environ, PRECISION_LAB_DB=str(tmp_path / "serve.duckdb"))
    env.pop("PRECISION_LAB_CONFIG", None)
    argv = [sys.executable, "-c", "from precision_lab.cli import main; main()", "serve", "--read-only",
            "--port", str(port), "--server.headless", "true"]
    with serving(argv, port=port, env=env, log_path=tmp_path / "serve.log", cwd=tmp_path):
        pass
    assert "localhost" in (tmp_path / "serve.log").read_text()

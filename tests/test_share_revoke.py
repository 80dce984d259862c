"""Share links are revoked while a server holds the database, and stop working on its next request."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _session(store, name: str) -> None:
    with store.new_session(name, source="capture"):
        pass


def _cli(*args: str, env_db: str) -> subprocess.CompletedProcess:
    """The command line in another process, as an operator runs it beside a server."""
    env = dict(os.environ, PRECISION_LAB_DB=env_db)
    env.pop("PRECISION_LAB_CONFIG", None)
    return subprocess.run([sys.executable, "-c", "from precision_lab.cli import main; main()", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_revoke_while_a_server_holds_the_database(store):
    from precision_lab.config import ServerConfig, resolve_access
    from precision_lab.services.share import create_share_token
    from precision_lab.tokens import token_file_for

    _session(store, "demo")
    _session(store, "other")
    token = create_share_token(store, "demo")
    keep = create_share_token(store, "other")
    cfg = ServerConfig(read_only=True)
    assert resolve_access({"share": token}, store, cfg).session == "demo"

    # this process is the server; the CLI opens the database between its reads
    out = _cli("share-link", "--session", "demo", "--revoke", env_db=store.path)
    assert out.returncode == 0, out.stderr
    assert "revoked" in out.stdout and "next request" in out.stdout

    refused = resolve_access({"share": token}, store, cfg)  # the very next request
    assert refused.session is None and refused.error and "not valid" in refused.error
    assert resolve_access({"share": keep}, store, cfg).session == "other"  # the other link still works

    # a new link made from the terminal opens on the server's next request
    out = _cli("share-link", "--session", "demo", env_db=store.path)
    assert out.returncode == 0, out.stderr
    fresh = out.stdout.strip().rsplit("share=", 1)[1]
    assert fresh != token and resolve_access({"share": fresh}, store, cfg).session == "demo"
    out = _cli("share-link", "--session", "nope", "--revoke", env_db=store.path)
    assert out.returncode == 2 and "no session named 'nope'" in out.stderr
    recorded = {e["name"]: e["token"] for e in token_file_for(store.path).sessions().values()}
    assert recorded == {"demo": fresh, "other": keep}


def _raw_holder(db) -> subprocess.Popen:
    """A process holding the database file read-write with DuckDB itself, as a job that never lets go would."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, duckdb\ncon = duckdb.connect(sys.argv[1])\n"
                               "print('ready', flush=True)\nsys.stdin.read()", str(db)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    return holder


@pytest.mark.slow
def test_a_lock_held_too_long_is_one_sentence_and_revoking_still_works(tmp_path):
    """A process that holds the file past the wait: creating a link fails in one sentence naming that process
    (by its pid), never DuckDB's message; revoking goes through the token file the server reads."""
    from precision_lab.config import ServerConfig, resolve_access
    from precision_lab.services.share import create_share_token
    from precision_lab.store import Store, close_all

    db = tmp_path / "held.duckdb"
    s = Store(db)
    _session(s, "demo")
    token = create_share_token(s, "demo")
    close_all()
    holder = _raw_holder(db)
    try:
        env = dict(os.environ, PRECISION_LAB_DB=str(db), PRECISION_LAB_LOCK_WAIT="0.5")
        env.pop("PRECISION_LAB_CONFIG", None)
        run = lambda *a: subprocess.run([sys.executable, "-c", "from precision_lab.cli import main; main()", *a],  # noqa: E731
                                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        out = run("share-link", "--session", "demo")
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert f"in use by process {holder.pid}" in lines[0] and str(db) in lines[0]
        assert "within 0.5 s" in lines[0] and "PRECISION_LAB_LOCK_WAIT" in lines[0]
        assert "Conflicting lock" not in lines[0] and "IO Error" not in lines[0]
        out = run("share-link", "--session", "demo", "--revoke")
        assert out.returncode == 0 and "revoked" in out.stdout, out.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert resolve_access({"share": token}, Store(db), ServerConfig()).error


@pytest.mark.slow
def test_revoke_through_the_cli_in_process_with_the_database_held_elsewhere(tmp_path):
    """The same with typer's CliRunner: the database is held by another process (a child holding it open)."""
    from typer.testing import CliRunner

    from precision_lab.cli import app
    from precision_lab.services.share import create_share_token
    from precision_lab.store import Store, close_all

    db = tmp_path / "held.duckdb"
    s = Store(db)
    _session(s, "demo")
    token = create_share_token(s, "demo")
    close_all()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom precision_lab.config import ServerConfig, resolve_access\n"
         "from precision_lab.store import Store\ns = Store(sys.argv[1])\nprint('ready', flush=True)\n"
         "for line in sys.stdin:\n"
         "    a = resolve_access({'share': line.strip()}, s, ServerConfig())\n"
         "    print(a.session or 'refused', flush=True)\n",
         str(db)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"

        def ask(tok: str) -> str:
            holder.stdin.write(tok + "\n")
            holder.stdin.flush()
            return holder.stdout.readline().strip()

        assert ask(token) == "demo"
        out = CliRunner().invoke(app, ["share-link", "--session", "demo", "--revoke", "--db", str(db)])
        assert out.exit_code == 0, out.output
        assert ask(token) == "refused"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()


def test_token_file_is_private_and_follows_renames_and_deletes(store):
    from precision_lab.services.share import create_share_token, revoke_recorded_token
    from precision_lab.tokens import token_file_for

    _session(store, "demo")
    _session(store, "gone")
    token = create_share_token(store, "demo")
    create_share_token(store, "gone")
    path = Path(store.path + ".tokens.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["format"] == "precision-lab-share-tokens" and len(doc["sessions"]) == 2

    store.rename_session("demo", "renamed")
    assert {e["name"] for e in json.loads(path.read_text())["sessions"].values()} == {"renamed", "gone"}
    store.delete_session("gone")
    assert [e["name"] for e in json.loads(path.read_text())["sessions"].values()] == ["renamed"]

    # revoking by the file alone (as the CLI does when a server holds the database), by the current name
    assert revoke_recorded_token(store.path, "demo") == []
    removed = revoke_recorded_token(store.path, "renamed")
    assert [r.token for r in removed] == [token]
    assert store.session_by_token(token) is None
    assert token_file_for(store.path).sessions() == {}


def test_a_damaged_token_file_opens_nothing(store):
    from precision_lab.services.share import create_share_token
    from typer.testing import CliRunner

    from precision_lab.cli import app

    _session(store, "demo")
    token = create_share_token(store, "demo")
    Path(store.path + ".tokens.json").write_text("{not json")
    assert store.session_by_token(token) is None  # fail closed
    out = CliRunner().invoke(app, ["share-link", "--session", "demo", "--db", store.path])
    assert out.exit_code == 2 and "tokens.json" in out.output and "not valid JSON" in out.output
    # a missing file, once there was one, is no file of links: nothing opens
    Path(store.path + ".tokens.json").unlink()
    assert store.session_by_token(token) is None
    # a damaged file does not stop a delete (a deleted session's token opens nothing anyway)
    Path(store.path + ".tokens.json").write_text("{not json")
    store.delete_session("demo")
    assert store.sessions().empty


def _as_schema_6(s, tokens: dict) -> None:
    """The database as schema 6 left it: each session's token also in a share_token column."""
    s.sql("ALTER TABLE sessions ADD COLUMN share_token VARCHAR")
    for name, token in tokens.items():
        s.sql("UPDATE sessions SET share_token = ? WHERE name = ?", [token, name])
    s.sql("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


def test_tokens_of_an_older_database_move_into_the_file(tmp_path):
    """A schema-6 database whose tokens were only in its column gets a token file when it is opened, and the
    column goes."""
    from precision_lab.store import SCHEMA_VERSION, Store, close_all

    db = tmp_path / "old.duckdb"
    s = Store(db)
    _session(s, "demo")
    _session(s, "plain")
    _as_schema_6(s, {"demo": "legacy-token"})
    assert not Path(s.path + ".tokens.json").exists()
    close_all()
    s = Store(db)
    assert s.schema_version() == SCHEMA_VERSION == 7
    entries = json.loads(Path(s.path + ".tokens.json").read_text())["sessions"]
    assert [(e["name"], e["token"]) for e in entries.values()] == [("demo", "legacy-token")]
    assert s.session_by_token("legacy-token").name == "demo"
    assert "share_token" not in [c[0] for c in s.sql("DESCRIBE sessions").fetchall()]


def test_an_older_database_with_a_token_file_keeps_the_file(tmp_path):
    """Where schema 6 had a token file, the file was already the truth (the column a copy that could lag
    behind a revocation): the upgrade keeps the file and forgets the column."""
    from precision_lab.services.share import create_share_token, revoke_recorded_token
    from precision_lab.store import Store, close_all

    db = tmp_path / "old.duckdb"
    s = Store(db)
    _session(s, "demo")
    _session(s, "other")
    kept = create_share_token(s, "other")
    revoked = create_share_token(s, "demo")
    revoke_recorded_token(db, "demo")  # made while a server held the database: the column still had it
    _as_schema_6(s, {"demo": revoked, "other": kept})
    close_all()
    s = Store(db)
    assert s.session_by_token(revoked) is None and s.session_by_token(kept).name == "other"


@pytest.mark.slow
def test_no_copy_of_a_token_is_kept_in_the_database(store, tmp_path):
    """The token file is the one record of the links: nothing in the database can disagree with it, whatever
    process changed it (a revocation through the file alone, as while a server holds the database)."""
    from precision_lab.services.share import create_share_token, export_session, import_session, revoke_recorded_token
    from precision_lab.store import Store
    from precision_lab.tokens import token_file_for

    _session(store, "demo")
    token = create_share_token(store, "demo")
    revoke_recorded_token(store.path, "demo")
    fresh = create_share_token(store, "demo")
    export_session(store, "demo", tmp_path / "demo.zip")
    other = Store(tmp_path / "other.duckdb")
    import_session(other, tmp_path / "demo.zip", name="copy")
    for s in (store, other):
        columns = s.sql("SELECT table_name, column_name FROM information_schema.columns "
                        "WHERE data_type = 'VARCHAR'").fetchall()
        assert not [c for c in columns if "token" in c[1]]
        for table, column in columns:  # neither the old nor the new token is anywhere in the database
            got = s.sql(f'SELECT count(*) FROM "{table}" WHERE "{column}" IN (?, ?)', [token, fresh]).fetchone()
            assert got == (0,), (table, column)
    assert list(token_file_for(store.path).sessions().values()) == [{"name": "demo", "token": fresh}]
    assert store.session_by_token(token) is None and store.session_by_token(fresh).name == "demo"
    assert other.session_by_token(fresh) is None and token_file_for(other.path).sessions() is None


def test_an_archive_from_before_schema_7_imports_without_its_token_column(store, tmp_path):
    """Archives written before schema 7 carry an always-empty share_token column in sessions.parquet."""
    import pyarrow as pa

    from precision_lab.services.share import export_bytes, import_session
    from test_share import with_table

    _session(store, "demo")
    v6 = with_table(export_bytes(store, "demo"), "sessions",
                    lambda t: t.append_column("share_token", pa.array([None], pa.string())), 6)
    res = import_session(store, v6, filename="v6.zip")
    assert res.session == "demo-2" and store.session("demo-2").source == "capture"


def test_memory_store_keeps_tokens_in_memory():
    from precision_lab.services.share import create_share_token, revoke_share_token
    from precision_lab.store import Store

    s = Store(":memory:")
    _session(s, "m")
    t = create_share_token(s, "m")
    assert s.session_by_token(t).name == "m"
    assert Store(":memory:").session_by_token(t).name == "m"  # the same database, the same links
    revoke_share_token(s, "m")
    assert s.session_by_token(t) is None


def test_an_open_page_cannot_download_after_revocation(store, monkeypatch):
    """Downloads are made when clicked, without a rerun: they check the link again."""
    from types import SimpleNamespace

    from precision_lab.services.share import create_share_token, revoke_share_token
    from precision_lab.ui import page

    _session(store, "demo")
    token = create_share_token(store, "demo")
    monkeypatch.setattr(page, "st", SimpleNamespace(session_state={page._SHARE: token}))
    monkeypatch.setattr(page, "get_store", lambda: store)
    download = page.while_allowed(lambda: b"zip bytes")
    assert download() == b"zip bytes"
    revoke_share_token(store, "demo")
    with pytest.raises(PermissionError, match="revoked"):
        download()
    monkeypatch.setattr(page, "st", SimpleNamespace(session_state={}))
    assert page.while_allowed(lambda: 1)() == 1  # no link: nothing to check

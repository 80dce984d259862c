"""One database, many processes: a served dashboard keeps being read while the command line and a notebook
ingest, capture, re-run, report and share into the same file; new sessions show on the open page's next run;
a writer killed half-way leaves nothing and blocks no one; two writers to one session take turns; a lock held
too long is one sentence naming its holder."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from precision_lab.store import DatabaseLocked, Store, close_all

from ui_fixtures import ROOT, DashboardTab, free_port, serving

pytestmark = pytest.mark.slow  # a served dashboard and writer processes

TINY_MODEL = """
import torch


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight.mul_(3000.0)  # the first layer's outputs pass fp16's largest value
    return m


def inputs():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 100
"""

NOTEBOOK = """
import sys, torch, precision_lab
m = torch.nn.Linear(4, 3)
with precision_lab.capture(m, run="notebook", store=sys.argv[1]) as cap:
    m(torch.ones(2, 4))
print(cap.session)
"""


def _dumps(root: Path, values: list) -> tuple[Path, Path]:
    ref, cand = root / "ref", root / "cand"
    ref.mkdir()
    cand.mkdir()
    for k, a in enumerate(values):
        np.save(ref / f"layers.{k:02d}.fc.output.0.npy", a)
        np.save(cand / f"layers.{k:02d}.fc.output.0.npy", a.astype(np.float16))
    return ref, cand


def _env(db: Path) -> dict:
    env = dict(os.environ, PRECISION_LAB_DB=str(db))
    for k in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY", "PRECISION_LAB_MODELS"):
        env.pop(k, None)
    return env


def _cli(env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from precision_lab.cli import main; main()", *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(p: subprocess.Popen, what: str) -> str:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, f"{what}: exit {p.returncode}: {err}"
    assert "lock" not in err.lower(), f"{what}: {err}"
    return out


def test_the_command_line_and_a_notebook_work_while_a_dashboard_serves(tmp_path):
    db = tmp_path / "lab.duckdb"
    env = _env(db)
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    values = [(np.random.default_rng(k).standard_normal(64) * 10 ** k).astype(np.float32) for k in range(5)]
    ref, cand = _dumps(tmp_path, values)
    port = free_port()
    argv = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true", "--server.address=127.0.0.1",
            f"--server.port={port}", "--browser.gatherUsageStats=false"]
    with serving(argv, port=port, env=env, log_path=tmp_path / "streamlit.log") as url, DashboardTab(url) as tab:
        assert tab.sessions() == []
        seen: dict = {}
        errors: list = []
        stop = threading.Event()

        def browse():  # the open tab keeps running its page while the other processes write
            try:
                while not stop.is_set():
                    for name in tab.sessions():
                        seen.setdefault(name, time.monotonic())
                    time.sleep(0.05)
            except Exception:
                errors.append(traceback.format_exc())

        reader = threading.Thread(target=browse)
        reader.start()
        try:
            started = {
                "ingest": _cli(env, "ingest", cand, "--reference", ref, "--session", "dumps"),
                "capture --model": _cli(env, "capture", "--model", f"{model}:build", "--inputs", f"{model}:inputs",
                                        "--dtype", "fp16", "--session", "mine", "--no-local"),
                "python capture": subprocess.Popen([sys.executable, "-c", NOTEBOOK, str(db)], cwd=ROOT, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            }
            outs = {what: _done(p, what) for what, p in started.items()}
            written = time.monotonic()
            assert outs["python capture"].strip().splitlines()[-1] == "notebook"
            rerun = _cli(env, "rerun", "--session", "mine", "--fix", "use-bf16", "--model", f"{model}:build",
                         "--inputs", f"{model}:inputs")
            report = _cli(env, "report", "--session", "dumps", "--json")
            link = _cli(env, "share-link", "--session", "dumps", "--base-url", url + "/")
            outs.update({"rerun": _done(rerun, "rerun"), "report": _done(report, "report"),
                         "share-link": _done(link, "share-link")})
            deadline = time.monotonic() + 60
            while not {"dumps", "mine", "notebook"} <= set(seen) and time.monotonic() < deadline and not errors:
                time.sleep(0.1)
        finally:
            stop.set()
            reader.join(timeout=120)
        assert not errors, errors[0]
        assert {"dumps", "mine", "notebook"} <= set(seen), seen  # listed by the open page, no restart
        assert all(seen[n] <= written + 30 for n in ("dumps", "mine", "notebook"))

        import json

        assert json.loads(outs["report"])["session"] == "dumps"
        token = outs["share-link"].strip().rsplit("share=", 1)[1]
        with DashboardTab(url, query=f"share={token}") as shared:
            texts = "\n".join(shared.run()["texts"])
        assert "not valid" not in texts

    store = Store(db)
    info = store.session("mine")
    runs = {r["kind"]: r for r in store.runs(info.session_id).to_dict("records")}
    assert runs["rerun"]["fix"] == "use-bf16" and runs["rerun"]["parent_run_id"] == runs["candidate"]["run_id"]
    # the ingested records hold the dumps' values (computed here in float64)
    sid = store.session("dumps").session_id
    cand_run = store.sql("SELECT run_id FROM runs WHERE session_id = ? AND name = 'cand'", [sid]).fetchone()[0]
    got = store.df("SELECT max, min FROM tensors WHERE run_id = ? ORDER BY seq", [cand_run])
    want = [a.astype(np.float16).astype(np.float64) for a in values]
    assert got["max"].tolist() == [w.max() for w in want] and got["min"].tolist() == [w.min() for w in want]


def test_a_local_dashboard_re_runs_the_model_its_user_captured(tmp_path, monkeypatch):
    """``capture --model`` records its entry points (mode 0600); a dashboard on localhost offers re-runs of that
    session with no setting, one on another address does not."""
    import stat

    import streamlit as st
    from typer.testing import CliRunner

    from precision_lab.allowed import allow_list_path, allowed_entry_points
    from precision_lab.cli import app
    from precision_lab.fixes.recipes import MODELS_ENV, RECIPES

    from ui_fixtures import open_page, serve_db, texts

    monkeypatch.delenv(MODELS_ENV, raising=False)
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    db = tmp_path / "m.duckdb"
    res = CliRunner().invoke(app, ["capture", "--model", f"{model}:build", "--inputs", f"{model}:inputs",
                                   "--dtype", "fp16", "--session", "mine", "--no-local", "--db", str(db)])
    assert res.exit_code == 0, res.output
    def forget():  # as a dashboard process that never ran them (an allowed model stays registered in its process)
        for name in [n for n in RECIPES if n.startswith("model:")]:
            RECIPES.unregister(name)

    forget()
    path = allow_list_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert allowed_entry_points() == {f"{model}:build", f"{model}:inputs"}
    close_all()
    with serve_db(db, monkeypatch):
        assert st.get_option("server.address") == "localhost"  # .streamlit/config.toml
        at = open_page("overview", session="mine")
        body = texts(at)
        assert "No re-run button" not in body
        assert any(b.key and b.key.startswith("rerun_") for b in at.button)
        try:  # the same dashboard served to a team: only what its operator listed runs
            st.config.set_option("server.address", "0.0.0.0")
            forget()
            at = open_page("overview", session="mine")
            assert "No re-run button" in texts(at) and "never run on their own" in texts(at)
            assert not any(b.key and b.key.startswith("rerun_") for b in at.button)
        finally:
            st.config.set_option("server.address", "localhost")
        path.chmod(0o644)  # a list others could have written allows nothing
        forget()
        at = open_page("overview", session="mine")
        assert "No re-run button" in texts(at)


def test_a_sample_opened_on_the_sessions_page_can_be_re_run(store):
    from precision_lab.services.jobs import rerun_blocker
    from precision_lab.services.rerun import rerun_session
    from precision_lab.services.samples import list_samples
    from precision_lab.ui.sessions import open_sample

    sample = next(s for s in list_samples() if s.name == "fp16-mlp-overflow")
    assert sample.recipe == "fp16-mlp-overflow"
    name = open_sample(store, sample)
    assert rerun_blocker(store, name) is None
    rerun_session(store, name, "use-bf16")
    sid = store.session(name).session_id
    kinds = sorted(store.runs(sid)["kind"])
    assert kinds == ["candidate", "reference", "rerun"]
    rerun = store.sql("SELECT run_id FROM runs WHERE session_id = ? AND kind = 'rerun'", [sid]).fetchone()[0]
    assert store.sql("SELECT count(*) FROM tensors WHERE run_id = ? AND nonfinite", [rerun]).fetchone()[0] == 0


HALF_WRITER = """
import sys, time
import numpy as np
from precision_lab.records import TensorRecord
from precision_lab.stats import tensor_stats
from precision_lab.store import Store
store = Store(sys.argv[1], staged=False)  # written straight in: the file is the writer's until it commits
with store.new_session("half", source="x") as w:
    run = w.add_run(name="r", dtype="float32")
    for k in range(50):
        w.add_record(TensorRecord(run_id=run, seq=k, op=f"op{k}", op_type="Linear", role="output", index="0",
                                  stats=tensor_stats(np.full(8, k, np.float32))))
    w.flush()
    print("writing", flush=True)
    time.sleep(600)
"""


def test_a_killed_writer_leaves_no_half_session_and_blocks_no_one(tmp_path):
    db = tmp_path / "k.duckdb"
    store = Store(db)
    with store.new_session("before", source="x") as w:
        w.add_run(name="r")
    p = subprocess.Popen([sys.executable, "-c", HALF_WRITER, str(db)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        with pytest.raises(DatabaseLocked, match=f"in use by process {p.pid}"):
            Store(db, lock_wait=0.3).sessions()  # mid-transaction: the file is the writer's
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
    assert list(store.sessions()["name"]) == ["before"]
    assert store.sql("SELECT count(*) FROM tensors").fetchone()[0] == 0
    assert store.sql("SELECT count(*) FROM runs").fetchone()[0] == 1
    with Store(db, lock_wait=5).new_session("after", source="x") as w:  # the lock died with the writer
        w.add_run(name="r")
    assert sorted(store.sessions()["name"]) == ["after", "before"]


EXTENDER = """
import sys
import numpy as np
from precision_lab.records import TensorRecord
from precision_lab.stats import tensor_stats
from precision_lab.store import Store
store, me = Store(sys.argv[1]), int(sys.argv[2])
for k in range(8):
    with store.extend_session("shared") as w:
        run = w.add_run(name=f"p{me}-{k}", dtype="float32")
        for j in range(5):
            a = np.arange(16, dtype=np.float32) * (me + 1) + 100 * k + j
            w.add_record(TensorRecord(run_id=run, seq=j, op=f"op{j}", op_type="Linear", role="output", index="0",
                                      stats=tensor_stats(a)))
"""


def test_two_writers_to_one_session_take_turns(tmp_path):
    db = tmp_path / "t.duckdb"
    store = Store(db)
    with store.new_session("shared", source="x"):
        pass
    close_all()
    procs = [subprocess.Popen([sys.executable, "-c", EXTENDER, str(db), str(i)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    sid = store.session("shared").session_id
    runs = store.runs(sid)
    assert sorted(runs["name"]) == sorted(f"p{i}-{k}" for i in range(2) for k in range(8))
    for r in runs.to_dict("records"):
        me, k = (int(x) for x in r["name"][1:].split("-"))
        got = store.df("SELECT rid, max, min FROM tensors WHERE run_id = ? ORDER BY seq", [r["run_id"]])
        assert got["rid"].tolist() == list(range(5))
        for j in range(5):
            a = np.arange(16, dtype=np.float64) * (me + 1) + 100 * k + j
            assert got["max"][j] == a.max() and got["min"][j] == a.min()


def test_an_open_retries_until_the_holder_lets_go_and_names_it_when_it_does_not(tmp_path):
    db = tmp_path / "h.duckdb"
    Store(db)
    close_all()
    code = ("import sys, time, duckdb\ncon = duckdb.connect(sys.argv[1])\nprint('ready', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\ncon.close()\nprint('gone', flush=True)\nsys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(db), "1.5"], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DatabaseLocked) as e:
            Store(db, lock_wait=0.2)
        msg = str(e.value)
        assert msg.startswith(f"database {db} is in use by process {holder.pid} (")
        assert "\n" not in msg and "Conflicting lock" not in msg and "IO Error" not in msg
        s = Store(db, lock_wait=60)  # waits for the holder, then opens
        assert holder.stdout.readline().strip() == "gone"
        assert list(s.sessions()["name"]) == []
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()


def test_lock_wait_is_a_server_setting_checked_in_one_sentence(monkeypatch, tmp_path):
    from precision_lab.config import SETTINGS, ConfigError, env_lock_wait, load_config
    from precision_lab.store import LOCK_WAIT_ENV

    assert [s.env for s in SETTINGS if s.name == "lock_wait"] == [LOCK_WAIT_ENV]
    monkeypatch.setenv(LOCK_WAIT_ENV, "2.5")
    assert env_lock_wait() == 2.5 and load_config(env={LOCK_WAIT_ENV: "2.5"}).lock_wait == 2.5
    assert Store(tmp_path / "w.duckdb").lock_wait == 2.5
    toml = tmp_path / "s.toml"
    toml.write_text("[server]\nlock_wait = 0\n")
    assert load_config(toml, env={}).lock_wait == 0.0
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(LOCK_WAIT_ENV, bad)
        with pytest.raises(ConfigError, match=LOCK_WAIT_ENV) as e:
            env_lock_wait()
        assert "\n" not in str(e.value) and "lock_wait must be a number" in str(e.value)
        with pytest.raises(ConfigError, match=LOCK_WAIT_ENV):
            load_config(env={LOCK_WAIT_ENV: bad})
    toml.write_text("lock_wait = -3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{toml}: lock_wait must be a number of seconds, 0 or more, got -3")):
        load_config(toml, env={})


def test_a_lock_met_mid_command_in_process_is_one_sentence_and_exit_2(tmp_path, monkeypatch):
    """Under typer's CliRunner (as from the console script): a write that meets a reader of another process
    past the wait ends the command with one sentence naming it, exit 2, and writes nothing."""
    from typer.testing import CliRunner

    from precision_lab.cli import app

    db = tmp_path / "m.duckdb"
    Store(db)
    close_all()
    dump = tmp_path / "dump"
    dump.mkdir()
    np.save(dump / "a.npy", np.arange(8, dtype=np.float32))
    code = ("import sys, duckdb\ncon = duckdb.connect(sys.argv[1], read_only=True)\nprint('ready', flush=True)\n"
            "sys.stdin.read()\ncon.close()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(db)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        monkeypatch.setenv("PRECISION_LAB_LOCK_WAIT", "0.3")
        # the command's reads open the file beside the holder; its write cannot
        res = CliRunner().invoke(app, ["ingest", str(dump), "--db", str(db)])
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert res.exit_code == 2, (res.exception, res.output)
    assert not isinstance(res.exception, DatabaseLocked)
    err = res.stderr.strip()
    assert err.startswith(f"error: database {db} is in use by process {holder.pid} (") and "\n" not in err
    assert "Conflicting lock" not in err and "Traceback" not in res.output
    assert list(Store(db).sessions()["name"]) == []

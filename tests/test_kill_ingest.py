"""A process killed with SIGKILL mid-ingest leaves a database that opens
cleanly and holds no trace of the half-written session.

Each test lets a child process write into the database, waits until the
child reports that uncommitted rows are inside DuckDB (not just buffered in
Python), kills it with SIGKILL, and then opens the database here.
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from precision_lab.scratch import scratch_root
from precision_lab.store import Store, close_all

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")]

TABLES = ("sessions", "runs", "tensors", "histograms", "tensor_data", "comparisons", "diagnoses", "warnings")


def _counts(store):
    return {t: store.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in TABLES}


def _seed_database(db: Path) -> dict:
    """A committed session that must survive the crash untouched."""
    from test_share import make_session

    store = Store(db)
    make_session(store, "keep")
    counts = _counts(store)
    close_all()  # the child process needs the file lock
    return counts


class _Child:
    """A Python child whose stdout lines arrive on a queue."""

    def __init__(self, code: str, env_extra=None):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PRECISION_LAB_NO_NUMBA="1", **(env_extra or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 120.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                pytest.fail(f"child printed no {prefix!r} line in {timeout} s")
            if line is None:
                err = self.proc.stderr.read()
                pytest.fail(f"child exited (code {self.proc.wait()}) before {prefix!r}: {err[-2000:]}")
            if line.startswith(prefix):
                return line

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


def _check_clean(db: Path, before: dict) -> Store:
    """The database opens, holds exactly what was committed before, and takes new writes."""
    store = Store(db)
    assert list(store.sessions()["name"]) == ["keep"]
    assert _counts(store) == before
    # no row anywhere belongs to a run that does not exist
    for t in ("tensors", "histograms", "tensor_data"):
        assert store.sql(f"SELECT count(*) FROM {t} WHERE run_id NOT IN (SELECT run_id FROM runs)"
                         ).fetchall()[0][0] == 0, t
    # every surviving row can be read back in full
    for t in TABLES:
        store.sql(f"SELECT * FROM {t}").fetchall()
    from test_share import make_session

    make_session(store, "after-crash", seed=3)
    store.sql("CHECKPOINT")
    assert set(store.sessions()["name"]) == {"keep", "after-crash"}
    return store


def test_sigkill_mid_ingest_of_a_dump(tmp_path):
    db = tmp_path / "lab.duckdb"
    before = _seed_database(db)
    dump = tmp_path / "dump"
    dump.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):  # ~24 MB of kept tensors: DuckDB writes blocks to the file before the commit
        np.save(dump / f"layers.{i:02d}.fc.output.0.npy", rng.standard_normal(250_000).astype(np.float32))
    child = _Child(f"""
        import sys, time
        from precision_lab.store import Store
        from precision_lab.services.ingest import ingest
        store = Store({str(db)!r}, staged=False)  # written straight in: the uncommitted rows are in the file
        def progress(done, total, label):
            if done >= total * 3 // 4:
                # this thread's cursor is the ingest's transaction: it sees the uncommitted rows
                n = store.sql("SELECT count(*) FROM tensor_data").fetchall()[0][0]
                print("READY", n, flush=True)
                time.sleep(600)
        ingest({str(dump)!r}, store=store, session="victim", progress=progress, keep_tensors=True)
        print("FINISHED", flush=True)
    """)
    line = child.wait_for("READY")
    assert int(line.split()[1]) > 0  # uncommitted tensors were inside DuckDB when the process died
    assert child.kill() == -signal.SIGKILL
    _check_clean(db, before)


@pytest.mark.parametrize("staged", [False, True])
def test_sigkill_with_large_uncommitted_session(tmp_path, staged):
    """More rows than a DuckDB row group, flushed in batches, then the kill: written straight into the file (its
    transaction holds them) or staged in a private file (the shared one is untouched, the staging folder is
    swept by the next writer)."""
    db = tmp_path / "lab.duckdb"
    before = _seed_database(db)
    child = _Child(f"""
        import time
        from precision_lab.records import TensorRecord
        from precision_lab.stats import TensorStats
        from precision_lab.store import Store
        store = Store({str(db)!r}, staged={staged!r})
        with store.new_session("victim") as w:
            run = w.add_run(name="fp16", dtype="float16")
            for i in range(150_000):
                st = TensorStats.summary_only(dtype="float16", shape=(4,), min=-1.0, max=float(i), mean=0.0)
                w.add_record(TensorRecord(run_id=run, seq=i, op=f"op{{i}}", op_type="Linear", role="output",
                                          index="0", stats=st))
            w.flush()
            n = w.cur.execute("SELECT count(*) FROM tensors").fetchall()[0][0]
            print("READY", n, flush=True)
            time.sleep(600)
    """)
    line = child.wait_for("READY", timeout=300)
    assert int(line.split()[1]) == (0 if staged else before["tensors"]) + 150_000
    stage = [p for p in scratch_root().glob("stage-*")]
    assert len(stage) == (1 if staged else 0)
    assert child.kill() == -signal.SIGKILL
    _check_clean(db, before)  # its new session was staged: the leftover folder is swept
    assert not [p for p in scratch_root().glob("stage-*")]


def test_sigkill_during_back_to_back_commits(tmp_path):
    """Killed at an arbitrary moment among many commits: every session present is whole."""
    db = tmp_path / "lab.duckdb"
    _seed_database(db)
    n_records = 40
    child = _Child(f"""
        import numpy as np
        from precision_lab.records import TensorRecord
        from precision_lab.stats import tensor_stats
        from precision_lab.store import Store
        store = Store({str(db)!r})
        for k in range(100_000):
            with store.new_session(f"s{{k}}") as w:
                run = w.add_run(name="fp16", dtype="float16")
                for i in range({n_records}):
                    x = np.full(16, k + i, dtype=np.float32)
                    w.add_record(TensorRecord(run_id=run, seq=i, op=f"op{{i}}", op_type="Linear", role="output",
                                              index="0", stats=tensor_stats(x), tensor=x))
                w.add_warning("f", f"session {{k}}")
            print("COMMITTED", k, flush=True)
    """)
    for _ in range(8):
        child.wait_for("COMMITTED")
    assert child.kill() == -signal.SIGKILL
    store = Store(db)
    names = [n for n in store.sessions()["name"] if n != "keep"]
    assert len(names) >= 8
    for name in names:
        sid = store.session(name).session_id
        (run_id,), = store.sql("SELECT run_id FROM runs WHERE session_id = ?", [sid]).fetchall()
        k = int(name[1:])
        got = store.df("SELECT seq, max FROM tensors WHERE run_id = ? ORDER BY seq", [run_id])
        # all records, each with the values that session wrote (max = k + i)
        assert list(got["seq"]) == list(range(n_records))
        assert np.array_equal(got["max"].to_numpy(), np.arange(n_records, dtype=np.float64) + k)
        for t in ("histograms", "tensor_data"):
            assert store.sql(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchall()[0][0] == n_records
        assert store.sql("SELECT message FROM warnings WHERE session_id = ?", [sid]).fetchall() == [(f"session {k}",)]


def test_sigkill_mid_extraction_leaves_a_folder_the_next_ingest_sweeps(tmp_path):
    """A zip ingest killed while its archive is extracted leaves its scratch folder; the next zip ingest removes it."""
    import zipfile

    from precision_lab.scratch import scratch_root

    env = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "PRECISION_LAB_DB": str(tmp_path / "lab.duckdb")}
    z = tmp_path / "dump.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for i in range(3):
            buf = __import__("io").BytesIO()
            np.save(buf, np.full(8, i, np.float32))
            zf.writestr(f"dump/t{i}.output.0.npy", buf.getvalue())
    child = _Child(f"""
        import time
        import precision_lab.services.ingest as ing
        from precision_lab.store import Store

        real = ing.safe_extract
        def slow(*a, **kw):
            root = real(*a, **kw)
            print("EXTRACTED", root, flush=True)
            time.sleep(600)
        ing.safe_extract = slow
        ing.ingest({str(z)!r}, store=Store())
    """, env_extra=env)
    line = child.wait_for("EXTRACTED")
    left = Path(line.split(" ", 1)[1])
    assert left.is_dir() and (left / "dump" / "t0.output.0.npy").is_file()
    child.kill()
    assert left.exists()  # SIGKILL runs no clean-up
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        root = scratch_root()
        assert root in left.parents
        store = Store(tmp_path / "lab.duckdb")
        from precision_lab.services.ingest import ingest

        ingest(z, store=store)
        close_all()
    assert not left.exists() and not any(root.iterdir())  # swept, and the second ingest cleaned up after itself

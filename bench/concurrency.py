"""Writers in several processes against one database while a served dashboard keeps reading it.

Starts ``streamlit run app.py`` on a fresh database and keeps one tab of it
running its Sessions page over Streamlit's websocket (as an open browser tab
whose page is rerun), then starts ``--writers`` processes of ``--ops``
operations each, cycling through: ingest a small dump pair (a new session),
capture a small model from Python (a new session), build a session's report
(a read), make a share link (a write), and re-run a fix into one session all
writers share (a new run there).  Prints

  * lock errors: operations that failed on another process's lock (target 0),
  * lost or half sessions: a session a writer committed that is missing, or whose
    runs or records are not all there, and any session nobody committed (target 0),
  * time until visible: from a writer's commit until the open tab lists the new
    session (median, 95th percentile, max; target <= 2 s),
  * duplicate run names: runs of the shared session whose name another run there
    has too (target 0),

and, as the baseline of the same run, the writers' throughput with no
dashboard serving against their throughput beside it.

With ``--staging`` it measures instead what staging a large write buys: the
dumps of bench/ingest.py are ingested (fp16 against fp32) while another
process runs page runs (the Sessions list, held read-only) every 50 ms, once
written straight into the shared file (the baseline) and once staged in a
private file and inserted in one short transaction, interleaved ``--reps``
times; it prints how long the ingest held the shared file read-write and
the longest and median page run of the reader, medians over the repetitions.

    python bench/concurrency.py [--writers 4] [--ops 50]
    python bench/concurrency.py --staging [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

N_OPS_IN_DUMP = 5
KINDS = ("ingest", "capture", "report", "share", "rerun")
SHARED = "shared"  # the recipe session every writer re-runs a fix into (run names must stay distinct)


def _dump_pair(root: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    ref, cand = root / "ref", root / "cand"
    for d in (ref, cand):
        d.mkdir(parents=True, exist_ok=True)
    for k in range(N_OPS_IN_DUMP):
        a = (rng.standard_normal(256) * 10 ** k).astype(np.float32)
        np.save(ref / f"layers.{k}.fc.output.0.npy", a)
        np.save(cand / f"layers.{k}.fc.output.0.npy", a.astype(np.float16))
    return ref, cand


def writer(me: int, db: str, ops: int, dumps: str) -> None:
    """One writer process: ``ops`` operations, one JSON line each on stdout."""
    import torch

    import precision_lab
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import build_report
    from precision_lab.services.rerun import rerun_session
    from precision_lab.services.share import create_share_token
    from precision_lab.store import Store

    ref, cand = Path(dumps) / "ref", Path(dumps) / "cand"
    mine: list[str] = []
    for k in range(ops):
        kind = KINDS[k % len(KINDS)]
        name = f"w{me}-{k}"
        t0 = time.time()
        line = {"writer": me, "op": k, "kind": kind, "error": None}
        try:
            store = Store(db)
            if kind == "ingest":
                line["session"] = ingest(cand, reference=ref, store=store, session=name)
                line["runs"], line["records"] = 2, 2 * N_OPS_IN_DUMP
            elif kind == "capture":
                m = torch.nn.Linear(4, 3)
                with precision_lab.capture(m, run=name, store=db) as cap:
                    m(torch.ones(2, 4))
                line["session"], line["runs"], line["records"] = cap.session, 1, len(cap.records)
            elif kind == "report" and mine:
                build_report(store, mine[-1])
            elif kind == "share" and mine:
                create_share_token(store, mine[-1])
            elif kind == "rerun":
                line["rerun"] = rerun_session(store, SHARED, "stable-softmax")
        except Exception as e:  # counted, never fatal: the bench reports what failed
            line["error"] = f"{type(e).__name__}: {e}"
        line["committed"] = time.time()
        line["seconds"] = line["committed"] - t0
        if line.get("session"):
            mine.append(line["session"])
        print(json.dumps(line), flush=True)


def reader_page_runs(db: str) -> None:
    """A reader process: page runs (the Sessions list, the file held read-only for the run) every 50 ms until
    stdin closes; then one JSON line of their durations."""
    from precision_lab.store import Store

    store = Store(db, lock_wait=600)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    took = []
    while not stop.is_set():
        t = time.perf_counter()
        with store.held():
            store.sessions()
        took.append(time.perf_counter() - t)
        time.sleep(0.05)
    print(json.dumps(took), flush=True)


def staged_ingest(ref: Path, cand: Path, db: Path, staged: bool) -> tuple[float, float, list[float]]:
    """(seconds the ingest took, seconds it held the shared file read-write, a concurrent reader's page runs)."""
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    Store(db)
    close_all()
    reader = subprocess.Popen([sys.executable, __file__, "--reader", str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert reader.stdout.readline().strip() == "ready"
        store = Store(db, staged=staged)
        held0, t0 = store.write_held_s, time.perf_counter()
        ingest(cand, reference=ref, store=store)
        took, held = time.perf_counter() - t0, store.write_held_s - held0
        close_all()
        time.sleep(0.3)  # a few page runs after it
        reader.stdin.close()
        runs = json.loads(reader.stdout.readline())
    finally:
        if reader.poll() is None and not reader.stdin.closed:
            reader.kill()
        reader.wait(timeout=60)
        reader.stdout.close()
    return took, held, runs


def staging_bench(reps: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from ingest import tensor_bytes, write_dumps

    with tempfile.TemporaryDirectory(prefix="pl-staging-") as tmp:
        tmp = Path(tmp)
        os.environ["XDG_DATA_HOME"] = str(tmp / "xdg")  # scratch (the staging files) stays in tmp
        os.environ.pop("PRECISION_LAB_CONFIG", None)
        ref, cand = write_dumps(tmp / "dumps")
        mb = tensor_bytes(ref, cand) / 1e6
        nfiles = sum(1 for r in (ref, cand) for _ in r.rglob("*.pt"))
        got: dict = {False: [], True: []}
        staged_ingest(ref, cand, tmp / "warm.duckdb", True)  # compile kernels, import modules once
        for i in range(reps):
            for staged in (False, True):
                got[staged].append(staged_ingest(ref, cand, tmp / f"{i}-{staged}.duckdb", staged))

    def med(staged: bool, k: int) -> float:
        return statistics.median(g[k] for g in got[staged])

    def page(staged: bool, how) -> float:
        return statistics.median(how(g[2]) for g in got[staged])

    print(f"ingest of bench/ingest.py's dumps ({mb:.1f} MB, {nfiles} files, fp16 vs fp32) beside a process running "
          f"page runs every 50 ms; medians of {reps} interleaved repetitions")
    for staged, label in ((False, "written straight in (baseline)"), (True, "staged, then inserted")):
        print(f"  {label:<31} ingest {med(staged, 0):6.2f} s, shared file held read-write {med(staged, 1):6.2f} s; "
              f"page run max {page(staged, max):6.2f} s, median {page(staged, statistics.median):.3f} s")
    print(f"held read-write: staged / baseline {med(True, 1) / med(False, 1):.3f}; longest page run: staged / "
          f"baseline {page(True, max) / page(False, max):.3f}; ingest time: staged / baseline "
          f"{med(True, 0) / med(False, 0):.2f}")


def shared_session(db: Path) -> None:
    """The recipe session the writers re-run fixes into."""
    from precision_lab.services.rerun import capture_recipe
    from precision_lab.store import Store, close_all

    capture_recipe(Store(db), "softmax-fp16-overflow", session=SHARED)
    close_all()


def duplicate_names(db: Path) -> int:
    """Runs of the shared session whose name another of its runs has too."""
    from precision_lab.store import Store

    names = [r[0] for r in Store(db).sql("SELECT r.name FROM runs r JOIN sessions s USING (session_id) "
                                         "WHERE s.name = ?", [SHARED]).fetchall()]
    return len(names) - len(set(names))


def run_writers(db: Path, n: int, ops: int, dumps: Path) -> tuple[list[dict], float]:
    shared_session(db)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--writer", str(i), "--db", str(db), "--ops", str(ops),
                               "--dumps", str(dumps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT) for i in range(n)]
    lines = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a writer process failed: {err[-2000:]}")
        lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return lines, time.time() - t0


def check(db: Path, lines: list[dict]) -> tuple[int, list[str]]:
    """(sessions checked, problems): every committed session whole, nothing else there."""
    from precision_lab.store import Store

    store = Store(db)
    want = {ln["session"]: ln for ln in lines if ln.get("session") and not ln["error"]}
    problems = []
    have = {r["name"]: r for r in store.sessions().to_dict("records")}
    for name, ln in want.items():
        if name not in have:
            problems.append(f"{name}: lost")
            continue
        sid = have[name]["session_id"]
        runs = store.sql("SELECT count(*) FROM runs WHERE session_id = ?", [sid]).fetchone()[0]
        recs = store.sql("SELECT count(*) FROM tensors t JOIN runs r USING (run_id) WHERE r.session_id = ?",
                         [sid]).fetchone()[0]
        if runs != ln["runs"] or recs != ln["records"]:
            problems.append(f"{name}: {runs} runs, {recs} records, committed {ln['runs']} and {ln['records']}")
    problems += [f"{name}: nobody committed it" for name in have if name not in want and name != SHARED]
    return len(want), problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--ops", type=int, default=50)
    ap.add_argument("--staging", action="store_true", help="measure staging a large ingest instead (see above)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of --staging")
    ap.add_argument("--writer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reader", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--db", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dumps", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.writer is not None:
        writer(args.writer, args.db, args.ops, args.dumps)
        return
    if args.reader is not None:
        reader_page_runs(args.reader)
        return
    if args.staging:
        staging_bench(args.reps)
        return

    from ui_fixtures import DashboardTab, free_port, serving

    with tempfile.TemporaryDirectory(prefix="pl-concurrency-") as tmp:
        tmp = Path(tmp)
        dumps = tmp / "dumps"
        _dump_pair(dumps)
        env = dict(os.environ, PRECISION_LAB_DB=str(tmp / "served.duckdb"), XDG_DATA_HOME=str(tmp / "xdg"))
        for k in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY"):
            env.pop(k, None)
        os.environ["XDG_DATA_HOME"] = env["XDG_DATA_HOME"]  # the writers' allow-list and data stay in tmp

        # baseline: the same writers with no dashboard serving
        base_lines, base_s = run_writers(tmp / "alone.duckdb", args.writers, args.ops, dumps)

        port = free_port()
        argv = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                "--server.address=127.0.0.1", f"--server.port={port}", "--browser.gatherUsageStats=false"]
        seen: dict = {}
        page_runs = [0]
        errors: list = []
        stop = threading.Event()
        with serving(argv, port=port, env=env, log_path=tmp / "streamlit.log") as url, DashboardTab(url) as tab:
            def browse():
                try:
                    while not stop.is_set():
                        names = tab.sessions()
                        now = time.time()
                        page_runs[0] += 1
                        for n in names:
                            seen.setdefault(n, now)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")

            reader = threading.Thread(target=browse)
            reader.start()
            lines, served_s = run_writers(Path(env["PRECISION_LAB_DB"]), args.writers, args.ops, dumps)
            want = {ln["session"] for ln in lines if ln.get("session") and not ln["error"]}
            deadline = time.time() + 30
            while not want <= set(seen) and time.time() < deadline and not errors:
                time.sleep(0.1)
            stop.set()
            reader.join(timeout=120)
        n_sessions, problems = check(Path(env["PRECISION_LAB_DB"]), lines)
        dupes = duplicate_names(Path(env["PRECISION_LAB_DB"]))
        reruns = sum(1 for ln in lines if ln.get("rerun"))

    lock_errors = [ln for ln in lines if ln["error"] and "lock" in ln["error"].lower()]
    other_errors = [ln for ln in lines if ln["error"] and ln not in lock_errors]
    delays = sorted(seen[ln["session"]] - ln["committed"] for ln in lines
                    if ln.get("session") and not ln["error"] and ln["session"] in seen)
    unseen = sum(1 for ln in lines if ln.get("session") and not ln["error"] and ln["session"] not in seen)
    n_ops = args.writers * args.ops
    print(f"{args.writers} writer processes x {args.ops} operations ({', '.join(KINDS)}) against a served dashboard "
          f"({page_runs[0]} page runs of its open Sessions tab meanwhile)")
    print(f"lock errors:                 {len(lock_errors)} of {n_ops} operations (target 0)")
    print(f"other errors:                {len(other_errors)}" + (f" (first: {other_errors[0]['error']})"
                                                                 if other_errors else ""))
    print(f"lost or half sessions:       {len(problems)} of {n_sessions} committed (target 0)"
          + (f": {problems[:3]}" if problems else ""))
    print(f"duplicate run names:         {dupes} among the shared session's runs after {reruns} concurrent "
          "re-runs into it (target 0)")
    if delays:
        p95 = delays[min(len(delays) - 1, int(round(0.95 * (len(delays) - 1))))]
        print(f"time until visible:          median {statistics.median(delays):.2f} s, p95 {p95:.2f} s, "
              f"max {delays[-1]:.2f} s (target <= 2 s)" + (f"; {unseen} never listed" if unseen else ""))
    if errors:
        print(f"dashboard tab errors:        {errors[0]}")
    base_err = sum(1 for ln in base_lines if ln["error"])
    print(f"throughput: {n_ops / served_s:.1f} ops/s beside the dashboard vs {n_ops / base_s:.1f} ops/s with none "
          f"(baseline, same run; {base_err} errors): ratio {base_s / served_s:.2f}")


if __name__ == "__main__":
    main()

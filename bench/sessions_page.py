"""The Sessions page with many sessions, against the same page with one, rendered by Streamlit's AppTest.

Writes N small sessions (an fp32 reference and an fp16 candidate of 20 ops each,
with their comparisons) to a temporary database, renders the page ``--renders``
times in one process and prints the first (cold: every headline computed) and
the median of the others (warm: what each click or keystroke costs), for one
session and for ``--sessions``.  Target: the warm page with 200 sessions within
1.5x of the page with one.  ``--browser`` times the same in Debian's chromium
against a real server instead (from navigation until the session table is on
screen and the script run has ended; each load is a new browser session).

    python bench/sessions_page.py [--sessions 200] [--renders 5] [--browser]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from precision_lab.metrics import compare  # noqa: E402
from precision_lab.records import TensorRecord  # noqa: E402
from precision_lab.stats import tensor_stats  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402


def build(db: Path, n: int) -> None:
    store = Store(db)
    rng = np.random.default_rng(0)
    for k in range(n):
        with store.new_session(f"s{k}") as w:
            ref = w.add_run(name="fp32", dtype="float32", kind="reference")
            cand = w.add_run(name="fp16", dtype="float16", kind="candidate")
            for i in range(20):
                x = rng.standard_normal(64) * 10 ** (i / 4)
                xr = x.astype(np.float32)
                with np.errstate(over="ignore"):
                    xc = x.astype(np.float16)
                for run, a in ((ref, xr), (cand, xc)):
                    w.add_record(TensorRecord(run_id=run, seq=i, op=f"l{i}", op_type="Linear", role="output",
                                              index="0", stats=tensor_stats(a)))
                w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=i, cand_run_id=cand, cand_rid=i, step=0,
                                 rank=0, seq=i, op=f"l{i}", role="output", index="0", match="exact",
                                 comparison=compare(xr, xc, cand_format="fp16"))
    close_all()


def renders(db: Path, k: int) -> list[float]:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    os.environ["PRECISION_LAB_DB"] = str(db)
    st.cache_resource.clear()
    st.cache_data.clear()
    out = []
    for _ in range(k):
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
        t = time.perf_counter()
        at.run()
        out.append(time.perf_counter() - t)
        if at.exception:
            raise RuntimeError(at.exception[0].value)
    close_all()
    return out


def browser_loads(db: Path, k: int) -> list[float]:
    """``k`` loads of /sessions in chromium against a server on ``db``: seconds from navigation until the
    session table is shown and the script run has ended."""
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PRECISION_LAB_DB=str(db))
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless=true",
                             "--server.address=127.0.0.1", f"--server.port={port}",
                             "--browser.gatherUsageStats=false"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                time.sleep(0.3)
        out = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            for _ in range(k):
                pg = browser.new_page(viewport={"width": 1400, "height": 1000})
                t = time.perf_counter()
                pg.goto(f"{url}/sessions")
                pg.locator("[data-testid='stDataFrame'] [role='gridcell']").first.wait_for(state="attached",
                                                                                     timeout=600_000)
                pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                     timeout=600_000)
                out.append(time.perf_counter() - t)
                pg.close()
            browser.close()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--renders", type=int, default=5)
    ap.add_argument("--browser", action="store_true", help="time page loads in chromium against a real server")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for n in (1, args.sessions):
            db = Path(tmp) / f"s{n}.duckdb"
            build(db, n)
            r = browser_loads(db, args.renders) if args.browser else renders(db, args.renders)
            got[n] = (r[0], statistics.median(r[1:]))
        (c1, w1), (cn, wn) = got[1], got[args.sessions]
        print(f"{'sessions':>9}{'cold ms':>10}{'warm ms':>10}")
        for n, (c, w) in got.items():
            print(f"{n:>9}{c * 1e3:>10.0f}{w * 1e3:>10.0f}")
        how = "chromium page load, " if args.browser else ""
        print(f"\n{how}warm page, {args.sessions} sessions / 1 session: {wn / w1:.2f}x (target <= 1.5x: "
              f"{'met' if wn / w1 <= 1.5 else 'not met'}); cold: {cn / c1:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

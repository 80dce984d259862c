"""The Sessions page with many sessions, against the same page with one, rendered by Streamlit's AppTest.

Writes N small sessions (an fp32 reference and an fp16 candidate of 20 ops each,
with their comparisons) to a temporary database, renders the page ``--renders``
times in one process and prints the first (cold: every headline computed) and
the median of the others (warm: what each click or keystroke costs), for one
session and for ``--sessions``.  Target: the warm page with 200 sessions within
1.5x of the page with one.

    python bench/sessions_page.py [--sessions 200] [--renders 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--renders", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for n in (1, args.sessions):
            db = Path(tmp) / f"s{n}.duckdb"
            build(db, n)
            r = renders(db, args.renders)
            got[n] = (r[0], statistics.median(r[1:]))
        (c1, w1), (cn, wn) = got[1], got[args.sessions]
        print(f"{'sessions':>9}{'cold ms':>10}{'warm ms':>10}")
        for n, (c, w) in got.items():
            print(f"{n:>9}{c * 1e3:>10.0f}{w * 1e3:>10.0f}")
        print(f"\nwarm page, {args.sessions} sessions / 1 session: {wn / w1:.2f}x (target <= 1.5x: "
              f"{'met' if wn / w1 <= 1.5 else 'not met'}); cold: {cn / c1:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dashboard queries on a large session: one page of the Ops table, the Diff
table and the error-vs-order series, on a session of N records per run
(default 1,000,000) with a reference run and a comparison per record.

Baseline, measured in the same run: loading the candidate run's records into
pandas (``SELECT * ... .df()``), which is what a page would cost without
filtering, sorting and LIMIT/OFFSET inside DuckDB.  Prints the median time
of each query and its ratio to the baseline.

    python bench/ops_table.py [--records 1000000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precision_lab.store import Store, close_all  # noqa: E402
from precision_lab.store.views import OpsFilter, error_series, top_offenders  # noqa: E402
from precision_lab.ui import diff, ops  # noqa: E402

OP_TYPES = ("linear", "matmul", "layer_norm", "gelu", "softmax", "add")


def build(store: Store, n: int) -> tuple[str, str, str]:
    """A session with a reference and a candidate run of ``n`` records each,
    written with set-based SQL (building a million TensorStats in Python
    would measure the generator, not the dashboard)."""
    with store.new_session("bench-1m") as w:
        ref = w.add_run(name="ref", dtype="float32", kind="reference")
        cand = w.add_run(name="cand", dtype="float16", kind="candidate")
        for run_id, dtype, bad in ((ref, "float32", "false"), (cand, "float16", "(i % 997 = 500)")):
            w.cur.execute(f"""
                INSERT INTO tensors BY NAME
                SELECT i AS rid, '{run_id}' AS run_id, i // 3 AS seq,
                       'blocks.' || (i // 3000) || '.op' || ((i // 3) % 1000) AS op,
                       list_extract({list(OP_TYPES)}, (i // 3) % 6 + 1) AS op_type,
                       CASE i % 3 WHEN 2 THEN 'output' ELSE 'input' END AS role, (i % 3)::VARCHAR AS "index",
                       0 AS step, (i // 100000) % 4 AS rank, 'forward' AS direction, 'bench' AS source,
                       4096 AS numel, '{dtype}' AS dtype, '[64, 64]' AS shape,
                       0 AS nan_count, CASE WHEN {bad} THEN 3 ELSE 0 END AS inf_count, 0 AS zero_count,
                       -1.0 - (i % 17) AS min, 1.0 + (i % 13) AS max, 1.0 + (i % 17) AS absmax,
                       1e-3 AS min_abs_nonzero, 0.0 AS mean, 1.0 AS std, 64.0 AS l2norm,
                       'blocks.' || (i // 3000) || '.op' || ((i // 3) % 1000) || '.'
                         || CASE i % 3 WHEN 2 THEN 'output' ELSE 'input' END || '.' || (i % 3) AS name,
                       {bad} AS nonfinite, false AS has_hist
                FROM range({n}) t(i)""")
        w.cur.execute(f"""
            INSERT INTO comparisons BY NAME
            SELECT '{w.session_id}' AS session_id, 'accumulated' AS kind, '{ref}' AS ref_run_id, i AS ref_rid,
                   '{cand}' AS cand_run_id, i AS cand_rid, 0 AS step, (i // 100000) % 4 AS rank, i // 3 AS seq,
                   'blocks.' || (i // 3000) || '.op' || ((i // 3) % 1000) AS op,
                   CASE i % 3 WHEN 2 THEN 'output' ELSE 'input' END AS role, (i % 3)::VARCHAR AS "index",
                   'exact' AS "match", 'tensor' AS basis, 4096 AS numel, 4096 AS compared,
                   (i % 101) * 1e-4 AS max_abs_err, (i % 89) * 1e-4 AS max_rel_err, 6.1e-5 AS rel_floor,
                   CASE WHEN i % 997 = 500 THEN 1 ELSE 0 END AS nonfinite_introduced, 0 AS nonfinite_in_ref,
                   'fp16' AS cand_format,
                   CASE WHEN i % 997 = 500 THEN 'nonfinite' WHEN i % 89 > 80 THEN 'warn' ELSE 'expected' END
                     AS verdict, '' AS reason
            FROM range({n}) t(i)""")
        return w.session_id, ref, cand


def timed(fn, repeat: int) -> float:
    fn()  # warm the cache of the first call
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.duckdb")
        t0 = time.perf_counter()
        sid, ref, cand = build(store, args.records)
        print(f"built {args.records:,} records per run (2 runs + comparisons) in {time.perf_counter() - t0:.1f} s")
        base = timed(lambda: store.df("SELECT * FROM tensors WHERE run_id = ?", [cand]), max(3, args.repeat // 2))
        print(f"baseline: load the candidate run into pandas  {base * 1e3:9.1f} ms")
        cases = {
            "ops page 1, execution order": lambda: ops.ops_page(store, OpsFilter(cand)),
            "ops page 500, execution order": lambda: ops.ops_page(store, OpsFilter(cand), page=500),
            "ops sorted by max_rel_err desc": lambda: ops.ops_page(
                store, OpsFilter(cand, sort="max_rel_err", descending=True)),
            "ops sorted by severity": lambda: ops.ops_page(
                store, OpsFilter(cand, sort="severity", descending=True)),
            "ops only problems": lambda: ops.ops_page(store, OpsFilter(cand, only_problems=True)),
            "ops name pattern + role": lambda: ops.ops_page(
                store, OpsFilter(cand, pattern="blocks.12*", roles=("output",))),
            "diff pair page 1": lambda: diff.diff_page(store, sid, ref, cand),
            "diff pair, problems only": lambda: diff.diff_page(store, sid, ref, cand, show="problems"),
            "N-run diff page 1": lambda: diff.nrun_page(store, sid, [ref, cand]),
            "error series (5k points)": lambda: error_series(store, sid, "max_rel_err"),
            "top offenders": lambda: top_offenders(store, sid),
        }
        print(f"{'query':<34}{'median ms':>12}{'vs baseline':>14}")
        for name, fn in cases.items():
            t = timed(fn, args.repeat)
            print(f"{name:<34}{t * 1e3:12.1f}{t / base:13.3f}x")
        close_all()


if __name__ == "__main__":
    main()

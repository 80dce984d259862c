"""Export and import of a large session, against DuckDB copying the same rows.

Builds a session of ``--records`` tensor records (two runs, every record with
a magnitude histogram, one comparison per candidate record), then measures,
interleaved over rounds (medians):

- ``copy out``: DuckDB ``COPY (SELECT ...) TO '...parquet'`` of the
  session's rows of every table, one Parquet file per table (the least an
  export has to do);
- ``export``: ``share.export_session`` (the same rows, plus checksums, the
  manifest and the zip);
- ``copy in``: ``INSERT INTO ... SELECT * FROM read_parquet(...)`` of those
  files into an empty database (the least an import has to do);
- ``import``: ``share.import_session`` into an empty database (zip safety
  checks, manifest and checksum validation, referential checks, one
  transaction).

    python bench/share.py                    # 100k records, 3 rounds
    python bench/share.py --records 300000 --rounds 5

Not part of CI's pass/fail: wall-clock ratios depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precision_lab.metrics import compare  # noqa: E402
from precision_lab.records import TensorRecord  # noqa: E402
from precision_lab.services.share import TABLES, export_session, import_session  # noqa: E402
from precision_lab.stats import tensor_stats  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402


def build(db: Path, n: int) -> str:
    store = Store(db)
    rng = np.random.default_rng(0)
    # a few distinct tensors reused: the stores' cost is per row, not per value
    pool = [rng.standard_normal(256).astype(np.float32) * 10.0 ** k for k in range(-3, 4)]
    stats32 = [tensor_stats(a) for a in pool]
    stats16 = [tensor_stats(a.astype(np.float16)) for a in pool]
    cmps = [compare(a, a.astype(np.float16), cand_format="fp16") for a in pool]
    with store.new_session("big", source="bench") as w:
        ref = w.add_run(name="fp32", dtype="float32", kind="reference")
        cand = w.add_run(name="fp16", dtype="float16", kind="candidate")
        for i in range(n // 2):
            k = i % len(pool)
            op = f"layers.{i // 8}.op{i % 8}"
            w.add_record(TensorRecord(run_id=ref, seq=i, op=op, op_type="Linear", role="output", index="0",
                                      stats=stats32[k]))
            w.add_record(TensorRecord(run_id=cand, seq=i, op=op, op_type="Linear", role="output", index="0",
                                      stats=stats16[k]))
            w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=i, cand_run_id=cand, cand_rid=i, step=0,
                             rank=0, seq=i, op=op, role="output", index="0", match="exact", comparison=cmps[k])
    return store.session("big").session_id


_WHERE = {
    "sessions": "session_id = $sid", "runs": "session_id = $sid", "comparisons": "session_id = $sid",
    "diagnoses": "session_id = $sid", "warnings": "session_id = $sid",
}


# the baseline is DuckDB doing its own file I/O, on a connection of its own: the store's connections read and
# write their database file only (store.connect)
def copy_out(store: Store, sid: str, folder: Path) -> None:
    import duckdb

    con = duckdb.connect(store.path, read_only=True)
    try:
        for t in TABLES:
            where = _WHERE.get(t, "run_id IN (SELECT run_id FROM runs WHERE session_id = $sid)")
            con.execute(f"COPY (SELECT * FROM {t} WHERE {where}) TO '{folder / t}.parquet' (FORMAT parquet)",
                        {"sid": sid})
    finally:
        con.close()


def copy_in(store: Store, folder: Path) -> None:
    import duckdb

    con = duckdb.connect(store.path)
    try:
        con.execute("BEGIN TRANSACTION")
        for t in TABLES:
            con.execute(f"INSERT INTO {t} SELECT * FROM read_parquet('{folder / t}.parquet')")
        con.execute("COMMIT")
    finally:
        con.close()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-share-"))
    t_build = timed(lambda: build(tmp / "src.duckdb", args.records))
    src = Store(tmp / "src.duckdb")
    sid = src.session("big").session_id
    times: dict[str, list[float]] = {k: [] for k in ("copy out", "export", "copy in", "import")}
    size = 0
    for r in range(args.rounds):
        out = tmp / f"copy{r}"
        out.mkdir()
        zpath = tmp / f"export{r}.zip"
        steps = [("copy out", lambda: copy_out(src, sid, out)), ("export", lambda: export_session(src, "big", zpath))]
        for name, fn in (steps if r % 2 == 0 else steps[::-1]):
            times[name].append(timed(fn))
        size = zpath.stat().st_size
        dst_copy, dst_imp = Store(tmp / f"copy-in{r}.duckdb"), Store(tmp / f"import{r}.duckdb")
        steps = [("copy in", lambda: copy_in(dst_copy, out)), ("import", lambda: import_session(dst_imp, zpath))]
        for name, fn in (steps if r % 2 == 0 else steps[::-1]):
            times[name].append(timed(fn))
        n_copy = dst_copy.sql("SELECT count(*) FROM tensors").fetchall()[0][0]
        n_imp = dst_imp.sql("SELECT count(*) FROM tensors").fetchall()[0][0]
        assert n_copy == n_imp == args.records, (n_copy, n_imp)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"session: {args.records} records (+ histograms, {args.records // 2} comparisons); built in "
          f"{t_build:.1f} s; exported file {size / 1e6:.1f} MB; {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    for k in ("copy out", "export", "copy in", "import"):
        print(f"  {k:<9} {med[k]:7.3f} s  ({args.records / med[k] / 1e3:8.0f} k records/s)")
    print(f"  export / copy out = {med['export'] / med['copy out']:.2f}x")
    print(f"  import / copy in  = {med['import'] / med['copy in']:.2f}x")
    close_all()


if __name__ == "__main__":
    main()

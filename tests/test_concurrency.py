"""Eight browser sessions at once: threads of one process sharing one database,
as Streamlit runs them, each uploading a dump, capturing a model into it,
adding a re-run, exporting/importing it, and capturing a built-in recipe and
re-running it under its fix, while another thread keeps reading.  Nothing may be lost or mixed: every thread's data is checked
against values computed here from that thread's own inputs.
"""

import json
import threading
import traceback

import numpy as np
import pytest

from precision_lab.metrics import compare
from precision_lab.records import TensorRecord
from precision_lab.stats import tensor_stats

pytestmark = pytest.mark.slow  # eight sessions at once, threads and a database each

N_THREADS = 8
N_OPS = 10


def _arrays(i: int) -> list[np.ndarray]:
    """Thread i's reference values: distinct per thread (every value scaled by i + 1)."""
    rng = np.random.default_rng(1000 + i)
    return [(rng.standard_normal(64) * (k + 1) * (i + 1)).astype(np.float32) for k in range(N_OPS)]


def _write_dumps(root, i):
    ref, cand = root / f"ref{i}", root / f"cand{i}"
    ref.mkdir()
    cand.mkdir()
    for k, a in enumerate(_arrays(i)):
        np.save(ref / f"layers.{k:02d}.fc.output.0.npy", a)
        np.save(cand / f"layers.{k:02d}.fc.output.0.npy", a.astype(np.float16))
    return ref, cand


def _model(i: int):
    """Thread i's model; weights from its own generator (torch's global one is shared by all threads)."""
    import torch

    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    rng = np.random.default_rng(500 + i)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)))
    return m


def _inputs(i: int):
    import torch

    return torch.from_numpy(np.random.default_rng(i).standard_normal((3, 8)).astype(np.float32))


def _worker(store_for, i, root, barrier, results):
    import precision_lab
    from precision_lab.services.rerun import capture_recipe, rerun_session
    from precision_lab.services.ingest import ingest
    from precision_lab.services.share import export_bytes, import_session

    try:
        store = store_for(i)
        ref, cand = _write_dumps(root, i)
        barrier.wait(timeout=60)
        # 1. upload: a reference and a candidate dump
        name = ingest(cand, reference=ref, store=store, session=f"upload-{i}")
        # 2. capture a live model into the same session
        with precision_lab.capture(_model(i), run=f"cap-{i}", store=store, session=name) as cap:
            cap.model(_inputs(i))
        # 3. re-run under a fix: a child run of the candidate with its comparisons
        sid = store.session(name).session_id
        runs = store.runs(sid).set_index("name")
        ref_id, cand_id = runs.loc["ref" + str(i), "run_id"], runs.loc["cand" + str(i), "run_id"]
        with store.extend_session(name) as w:
            rr = w.add_run(name=f"rerun-{i}", dtype="float32", kind="rerun", parent_run_id=cand_id, fix="fp32_island")
            for k, a in enumerate(_arrays(i)):
                rid = w.add_record(TensorRecord(run_id=rr, seq=k, op=f"layers.{k:02d}.fc", op_type="Linear",
                                                role="output", index="0", stats=tensor_stats(a), tensor=a))
                w.add_comparison(kind="accumulated", ref_run_id=ref_id, ref_rid=k, cand_run_id=rr, cand_rid=rid,
                                 step=0, rank=0, seq=k, op=f"layers.{k:02d}.fc", role="output", index="0",
                                 match="exact", comparison=compare(a, a))
        # 4. export and import back as a copy
        res = import_session(store, export_bytes(store, name), name=f"copy-{i}")
        # 5. capture a built-in recipe (fp32 reference + failing fp8 candidate) and re-run it under its fix
        recipe = capture_recipe(store, "fp8-zero-scale", session=f"recipe-{i}")
        rerun_session(store, recipe, "scale-fp32")
        results[i] = {"name": name, "copy": res.session, "recipe": recipe}
    except BaseException:
        results[i] = {"error": traceback.format_exc()}


def _reader(store, stop, errors):
    from precision_lab.services.report import build_report

    try:
        while not stop.is_set():
            for name in store.sessions()["name"]:
                build_report(store, name)
    except BaseException:
        errors.append(traceback.format_exc())


@pytest.mark.parametrize("stores", ["one Store", "a Store per thread"])
def test_eight_sessions_write_at_once(store, tmp_path, stores):
    from precision_lab.services.report import build_report, to_json
    from precision_lab.store import Store

    path = store.path
    store_for = (lambda i: store) if stores == "one Store" else (lambda i: Store(path))
    barrier = threading.Barrier(N_THREADS)
    results: dict = {}
    stop, read_errors = threading.Event(), []
    reader = threading.Thread(target=_reader, args=(store, stop, read_errors))
    reader.start()
    threads = [threading.Thread(target=_worker, args=(store_for, i, tmp_path, barrier, results))
               for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    stop.set()
    reader.join(timeout=120)
    errors = [r["error"] for r in results.values() if "error" in r]
    assert not errors, errors[0]
    assert not read_errors, read_errors[0]
    assert len(results) == N_THREADS

    names = set(store.sessions()["name"])
    assert names == {f"{kind}-{i}" for kind in ("upload", "copy", "recipe") for i in range(N_THREADS)}
    import torch

    for i in range(N_THREADS):
        arrays = _arrays(i)
        sid = store.session(f"upload-{i}").session_id
        runs = store.runs(sid).set_index("name")
        assert set(runs.index) == {f"ref{i}", f"cand{i}", f"cap-{i}", f"rerun-{i}"}
        # uploaded records hold this thread's values, computed here in float64
        for run, cast in ((f"ref{i}", np.float32), (f"cand{i}", np.float16)):
            got = store.df("SELECT op, numel, max, min, l2norm FROM tensors WHERE run_id = ? ORDER BY seq",
                           [runs.loc[run, "run_id"]])
            assert len(got) == N_OPS
            for k, a in enumerate(arrays):
                x = a.astype(cast).astype(np.float64)
                row = got.iloc[k]
                assert row["op"] == f"layers.{k:02d}.fc" and row["numel"] == 64
                assert row["max"] == x.max() and row["min"] == x.min()
                assert row["l2norm"] == pytest.approx(np.sqrt(np.sum(x * x)), rel=1e-12)
        # the captured model output is this thread's model applied to this thread's input
        with torch.no_grad():
            y = _model(i)(_inputs(i)).double().numpy()
        out = store.df("SELECT max, min FROM tensors WHERE run_id = ? AND op = 'forward.0' AND role = 'output'",
                       [runs.loc[f"cap-{i}", "run_id"]])
        assert len(out) == 1 and out.iloc[0]["max"] == y.max() and out.iloc[0]["min"] == y.min()
        # the re-run: its own records and comparisons, parent link intact
        rr = runs.loc[f"rerun-{i}"]
        assert rr["parent_run_id"] == runs.loc[f"cand{i}", "run_id"]
        maxes = store.df("SELECT max FROM tensors WHERE run_id = ? ORDER BY seq", [rr["run_id"]])["max"]
        assert np.array_equal(maxes.to_numpy(), np.array([a.astype(np.float64).max() for a in arrays]))
        n_cmp = store.sql("SELECT count(*) FROM comparisons WHERE cand_run_id = ?", [rr["run_id"]]).fetchall()[0][0]
        assert n_cmp == N_OPS
        # the copy shows the same records and comparisons as its original
        a = json.loads(to_json(build_report(store, f"upload-{i}")))
        b = json.loads(to_json(build_report(store, f"copy-{i}")))
        for key in ("tensors", "comparisons", "diagnoses", "warnings", "first_nonfinite"):
            if key == "first_nonfinite":
                strip = lambda d: {r: (v and {k: x for k, x in v.items() if k != "run_id"}) for r, v in d.items()}  # noqa
                assert strip(a[key]) == strip(b[key])
            else:  # comparisons are ordered by run id, and the copy's run ids are new
                assert sorted(map(json.dumps, a[key])) == sorted(map(json.dumps, b[key])), key
    # recipe sessions: each a ledger of reference, failing candidate and its fixed re-run, with the same
    # records as every other thread's (the recipe is seeded), so nothing was lost or mixed in
    ledgers = []
    for i in range(N_THREADS):
        sid = store.session(f"recipe-{i}").session_id
        runs = store.runs(sid).set_index("kind")
        assert sorted(runs.index) == ["candidate", "reference", "rerun"]
        assert runs.loc["rerun", "parent_run_id"] == runs.loc["candidate", "run_id"]
        assert runs.loc["rerun", "fix"] == "scale-fp32"
        counts = {}
        for kind in ("reference", "candidate", "rerun"):
            counts[kind] = store.df(
                "SELECT name, seq, max, min, nan_count, inf_count FROM tensors WHERE run_id = ? ORDER BY seq, name",
                [runs.loc[kind, "run_id"]]).to_json()
        nonfinite = {k: store.sql("SELECT count(*) FROM tensors WHERE run_id = ? AND nonfinite",
                                  [runs.loc[k, "run_id"]]).fetchall()[0][0] for k in ("candidate", "rerun")}
        assert nonfinite["candidate"] > 0 and nonfinite["rerun"] == 0  # the fix removed the NaN
        ledgers.append(counts)
    assert all(led == ledgers[0] for led in ledgers)
    # no stray rows: every record belongs to a run of some session
    assert store.sql("SELECT count(*) FROM tensors WHERE run_id NOT IN (SELECT run_id FROM runs)").fetchall()[0][0] == 0
    assert store.sql("SELECT count(*) FROM runs WHERE session_id NOT IN (SELECT session_id FROM sessions)"
                     ).fetchall()[0][0] == 0

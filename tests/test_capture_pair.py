"""capture_pair: an fp32 reference and an fp16 candidate, accumulated and local error for every op."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import precision_lab
from precision_lab.live import CaptureOptions, PairOptions
from precision_lab.services.report import first_nonfinite

from test_capture import build_tiny, loss_fn, tiny_input


def _runs(store, name):
    runs = store.runs(store.session(name).session_id)
    return {r["kind"]: r for _, r in runs.iterrows()}


def _rows(store, sql, params):
    cur = store.sql(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _np_compare(ref, cand):
    r = ref.detach().double().numpy().ravel()
    c = cand.detach().double().numpy().ravel()
    d = c - r
    return {"max_abs_err": np.abs(d).max(), "rmse": math.sqrt(np.mean(d * d)),
            "cosine": float(r @ c / (np.linalg.norm(r) * np.linalg.norm(c)))}


@pytest.mark.slow
def test_pair_compares_every_op_accumulated_and_local(store):
    name = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                      pair=PairOptions(loss_fn=loss_fn))
    runs = _runs(store, name)
    assert set(runs) == {"reference", "candidate"}
    ref_id, cand_id = runs["reference"]["run_id"], runs["candidate"]["run_id"]
    assert runs["reference"]["dtype"] == "float32" and runs["candidate"]["dtype"] == "float16"
    n_ref = store.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [ref_id]).fetchone()[0]
    n_cand = store.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [cand_id]).fetchone()[0]
    assert n_ref == n_cand > 200
    acc = _rows(store, "SELECT * FROM comparisons WHERE kind = 'accumulated' AND cand_run_id = ?", [cand_id])
    # one accumulated comparison per candidate tensor, all matched by name, all element-wise
    assert len(acc) == n_cand
    assert {r["match"] for r in acc} == {"exact"} and {r["basis"] for r in acc} == {"tensor"}
    names = _rows(store, """SELECT t.name AS cn, r.name AS rn FROM comparisons c
                           JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                           JOIN tensors r ON r.run_id = c.ref_run_id AND r.rid = c.ref_rid
                           WHERE c.kind = 'accumulated' AND c.cand_run_id = ?""", [cand_id])
    assert all(x["cn"] == x["rn"] for x in names) and len(names) == n_cand
    # one local comparison for every floating output of every forward op
    outs = _rows(store, """SELECT rid, op FROM tensors WHERE run_id = ? AND role = 'output'
                          AND direction = 'forward' AND dtype LIKE '%float%'""", [cand_id])
    local = _rows(store, "SELECT * FROM comparisons WHERE kind = 'local' AND cand_run_id = ?", [cand_id])
    assert sorted(r["cand_rid"] for r in local) == sorted(r["rid"] for r in outs)
    assert {r["op"] for r in local} >= {"blocks.0.attn.softmax.0", "blocks.1.fc1.linear.0", "blocks.0.forward.0",
                                        "forward.0", "blocks.0.attn.to.0"}
    # nothing non-finite, rounding-level error everywhere
    assert first_nonfinite(store, ref_id) is None and first_nonfinite(store, cand_id) is None
    assert {r["verdict"] for r in local} <= {"expected", "warn"}


@pytest.mark.slow
def test_pair_numbers_equal_an_independent_computation(store):
    name = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store)
    cand_id = _runs(store, name)["candidate"]["run_id"]
    # the same two models run by hand
    torch.manual_seed(0)
    ref = build_tiny()
    torch.manual_seed(0)
    cand = build_tiny()
    cand.load_state_dict(ref.state_dict())
    cand = cand.half()
    with torch.no_grad():
        ref(tiny_input())
        cand(tiny_input().half())
    attn_r, attn_c = ref.blocks[1].attn, cand.blocks[1].attn
    # accumulated: the candidate's softmax output against the reference's
    row = _rows(store, """SELECT * FROM comparisons WHERE kind = 'accumulated' AND cand_run_id = ?
                         AND op = 'blocks.1.attn.to.0' AND role = 'output'""", [cand_id])[0]
    exp = _np_compare(attn_r.last_probs, attn_c.last_probs)
    assert row["max_abs_err"] == pytest.approx(exp["max_abs_err"], rel=1e-12)
    assert row["rmse"] == pytest.approx(exp["rmse"], rel=1e-9)
    assert row["cosine"] == pytest.approx(exp["cosine"], rel=1e-12)
    assert row["cand_format"] == "fp16"
    # local: each op against itself re-run in fp32 on its own (upcast) inputs.  The softmax is called on the
    # fp32 cast of the fp16 scores, so it already runs in fp32: no error of its own
    s16 = attn_c.last_scores
    assert s16.dtype == torch.float16
    s64 = s16.double().numpy()
    e64 = np.exp(s64 - s64.max(axis=-1, keepdims=True))
    p64 = e64 / e64.sum(axis=-1, keepdims=True)  # the exact softmax of the fp16 scores, float64
    soft = _rows(store, """SELECT t.dtype, t.max FROM tensors t WHERE t.run_id = ? AND t.role = 'output'
                          AND t.direction = 'forward' AND t.op = 'blocks.1.attn.softmax.0'""", [cand_id])
    assert [r["dtype"] for r in soft] == ["float32"]
    assert soft[0]["max"] == pytest.approx(p64.max(), abs=2 ** -23)  # fp32 rounding of the exact softmax
    row = _rows(store, """SELECT * FROM comparisons WHERE kind = 'local' AND cand_run_id = ?
                         AND op = 'blocks.1.attn.softmax.0'""", [cand_id])[0]
    assert row["max_abs_err"] == 0.0 and row["rmse"] == 0.0
    # the cast back to fp16 is the error: the fp16 probabilities against the fp32 ones (within fp32 rounding of
    # the exact softmax, far below the fp16 rounding measured)
    row = _rows(store, """SELECT * FROM comparisons WHERE kind = 'local' AND cand_run_id = ?
                         AND op = 'blocks.1.attn.to.0'""", [cand_id])[0]
    p16 = attn_c.last_probs.double().numpy()
    d = p16 - p64
    assert row["max_abs_err"] == pytest.approx(np.abs(d).max(), abs=1e-6) and np.abs(d).max() > 1e-5
    assert row["rmse"] == pytest.approx(math.sqrt(np.mean(d * d)), abs=1e-6)
    exp = _np_compare(F.softmax(s16.float(), dim=-1), attn_c.last_probs)  # the op's own fp32 input
    assert row["max_abs_err"] == pytest.approx(exp["max_abs_err"], rel=1e-12) and exp["max_abs_err"] > 0
    assert row["rmse"] == pytest.approx(exp["rmse"], rel=1e-9)


@pytest.mark.slow
def test_pair_with_injected_overflow_local_vs_accumulated(store):
    name = precision_lab.capture_pair(lambda: build_tiny(overflow_scale=2e5), tiny_input(), torch.float16,
                                      store=store, pair=PairOptions(loss_fn=loss_fn))
    runs = _runs(store, name)
    ref_id, cand_id = runs["reference"]["run_id"], runs["candidate"]["run_id"]
    assert first_nonfinite(store, ref_id) is None
    hit = first_nonfinite(store, cand_id)
    assert hit.producer and hit.op == "blocks.1.fc1.linear.0" and hit.direction == "forward"

    def verdict(kind, op):
        return _rows(store, """SELECT verdict, nonfinite_introduced FROM comparisons WHERE kind = ?
                              AND cand_run_id = ? AND op = ? AND role = 'output'""", [kind, cand_id, op])[0]

    # fc1 introduces the overflow: both kinds say so
    assert verdict("local", "blocks.1.fc1.linear.0")["verdict"] == "nonfinite"
    assert verdict("accumulated", "blocks.1.fc1.linear.0")["verdict"] == "nonfinite"
    # gelu only passes it on: accumulated error is non-finite, its own (local) error is not
    assert verdict("accumulated", "blocks.1.gelu.0")["verdict"] == "nonfinite"
    assert verdict("local", "blocks.1.gelu.0")["nonfinite_introduced"] == 0
    # ops before the overflow are fine in both
    assert verdict("accumulated", "blocks.1.ln2.layer_norm.0")["verdict"] in ("expected", "warn")


@pytest.mark.slow
def test_pair_spills_reference_to_disk_with_the_same_results(store, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                   pair=PairOptions(local_error=False))
    b = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                   pair=PairOptions(local_error=False, keep_bytes=0))
    q = """SELECT c.op, c.role, c."index", c.max_abs_err, c.rmse, c.cosine FROM comparisons c
           JOIN runs r ON r.run_id = c.cand_run_id JOIN sessions s ON s.session_id = r.session_id
           WHERE s.name = ? ORDER BY c.op, c.role, c."index", c.seq"""
    ra, rb = _rows(store, q, [a]), _rows(store, q, [b])
    assert ra == rb and len(ra) > 100
    assert not [p for p in os.listdir(tmp_path) if p.startswith("precision-lab-ref-")]  # spill folder removed
    assert not store.df("SELECT * FROM comparisons WHERE kind = 'local'").shape[0]


@pytest.mark.slow
def test_pair_with_a_precision_policy_and_into_an_existing_session(store):
    from precision_lab.fixes.policy import POLICIES

    first = precision_lab.capture_pair(build_tiny, tiny_input(), POLICIES["bf16"], store=store)
    runs = _runs(store, first)
    assert runs["candidate"]["dtype"] == "bfloat16"
    assert '"dtype": "bf16"' in runs["candidate"]["policy"]
    again = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store, session=first,
                                       options=CaptureOptions(backward=False), pair=PairOptions(local_error=False))
    assert again == first
    assert len(store.runs(store.session(first).session_id)) == 4


def test_pair_input_errors(store):
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        precision_lab.capture_pair(lambda: 3, tiny_input(), torch.float16, store=store)
    with pytest.raises(ValueError, match="candidate_policy is None"):
        precision_lab.capture_pair(build_tiny, tiny_input(), None, store=store)
    with pytest.raises(ValueError, match="one-element tensor"):
        precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                   pair=PairOptions(loss_fn=lambda y: y))
    sizes = iter([16, 8])
    with pytest.raises(ValueError, match="same architecture"):
        precision_lab.capture_pair(lambda: torch.nn.Linear(next(sizes), 4), torch.ones(2, 16), torch.float16,
                                   store=store)
    assert store.sessions().empty  # nothing half-written


@pytest.mark.slow
def test_report_lists_every_op_with_stats_both_errors_and_the_first_nonfinite_op(store):
    """The issue's acceptance check: fp32 and fp16 runs of a small transformer with an injected overflow."""
    import json

    from precision_lab.services.report import build_report, to_json

    called = set()

    def build():
        m = build_tiny(overflow_scale=2e5)
        for p, mod in m.named_modules():
            mod.register_forward_hook(lambda mod, i, o, p=p: called.add(p))
        return m

    name = precision_lab.capture_pair(build, tiny_input(), torch.float16, store=store,
                                      pair=PairOptions(loss_fn=loss_fn))
    rep = json.loads(to_json(build_report(store, name)))
    runs = {r["kind"]: r["name"] for r in rep["runs"]}
    assert rep["first_nonfinite"][runs["reference"]] is None
    first = rep["first_nonfinite"][runs["candidate"]]
    assert first["op"] == "blocks.1.fc1.linear.0" and first["producer"]
    cand = [t for t in rep["tensors"] if t["run"] == runs["candidate"] and t["direction"] == "forward"]
    ops = {t["op"] for t in cand}
    functional = {f"blocks.{b}.{op}" for b in (0, 1) for op in (
        "ln1.layer_norm.0", "attn.qkv.linear.0", "attn.matmul.0", "attn.div.0", "attn.float.0", "attn.softmax.0",
        "attn.to.0", "attn.matmul.1", "attn.proj.linear.0", "add.0", "ln2.layer_norm.0", "fc1.linear.0",
        "gelu.0", "fc2.linear.0", "add.1")} | {"ln.layer_norm.0"}
    modules = {f"{p}.forward.0" if p else "forward.0" for p in called}
    assert len(modules) == 2 + 2 * 8  # root, ln, and per block: itself, ln1, attn, qkv, proj, ln2, fc1, fc2
    assert functional | modules <= ops, (functional | modules) - ops
    for op in functional | modules:
        outs = [t for t in cand if t["op"] == op and t["role"] == "output"]
        assert outs and all(t["numel"] > 0 and t["max"] is not None and t["std"] is not None for t in outs), op
        kinds = {c["kind"] for c in rep["comparisons"] if c["op"] == op and c["role"] == "output"}
        assert kinds == {"local", "accumulated"}, (op, kinds)
    # the text lists the local comparisons as the candidate's local error, never as "candidate vs candidate"
    from precision_lab.services.report import render_text

    text = render_text(build_report(store, name))
    cand = runs["candidate"]
    assert f"{cand} vs {cand}" not in text
    local = dict(store.sql("""SELECT verdict, count(*) FROM comparisons c JOIN runs r ON r.run_id = c.cand_run_id
                              WHERE r.name = ? AND c.kind = 'local' GROUP BY verdict""", [cand]).fetchall())
    want = ", ".join(f"{k} {n}" for k, n in sorted(local.items()))
    assert f"  {cand}: local error (each op against its fp32 re-run): {want}" in text.splitlines()


def test_pair_warns_when_no_name_lines_up(store):
    from test_capture import ToyPolicy

    name = precision_lab.capture_pair(build_tiny, tiny_input(), ToyPolicy(), store=store,
                                      pair=PairOptions(local_error=False))
    msgs = store.df("SELECT message FROM warnings")["message"].tolist()
    assert any("changed the model's module paths" in m for m in msgs)
    # the one pairing rule: names that do not line up are aligned by op sequence (as ingest does) and compared
    # by their summaries, each reference record at most once
    rows = store.df("SELECT match, kind, ref_rid, max_rel_err, summary_rel_err FROM comparisons "
                    "WHERE kind <> 'local'")
    aligned = rows[rows["match"] == "aligned"]
    # a comparison of summaries has the summaries' error, never an element-wise one
    assert len(aligned) > 0 and set(aligned["kind"]) == {"stats"} and aligned["summary_rel_err"].notna().all()
    assert aligned["max_rel_err"].isna().all()
    paired = rows[rows["ref_rid"].notna() & rows["match"].isin(["exact", "aligned"])]
    assert paired["ref_rid"].is_unique
    assert name


class _CastToFloat(torch.nn.Module):
    """An fp16 op whose output is cast to float32 inside the model (``.float()``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)

    def forward(self, x):
        return torch.tanh(self.fc(x)).float() * 3.0


@pytest.mark.slow
def test_pair_judges_an_fp32_tensor_in_an_fp16_run_like_run_pairing(store):
    from precision_lab.records import TensorRecord
    from precision_lab.services.pairing import Item, compare_runs

    name = precision_lab.capture_pair(_CastToFloat, tiny_input(), torch.float16, store=store,
                                      options=CaptureOptions(keep_tensors=("*",)),
                                      pair=PairOptions(local_error=False, loss_fn=lambda y: y.mean()))
    runs = _runs(store, name)
    ref_id, cand = runs["reference"]["run_id"], runs["candidate"]
    assert cand["dtype"] == "float16"
    got = {r["cand_rid"]: r for r in _rows(store, """SELECT * FROM comparisons
                                                   WHERE kind = 'accumulated' AND cand_run_id = ?""",
                                           [cand["run_id"]])}

    # the same records and tensors paired by the path re-runs use
    class Rows:
        def __init__(self):
            self.rows = []

        def add_comparison(self, **kw):
            self.rows.append(kw)

    def items(run_id):
        out = []
        for _, r in store.df("SELECT * FROM tensors WHERE run_id = ? ORDER BY rid", [run_id]).iterrows():
            rec = TensorRecord(run_id=run_id, seq=int(r["seq"]), op=r["op"], op_type=r["op_type"], role=r["role"],
                               index=r["index"], stats=store.record_stats(run_id, int(r["rid"])),
                               step=int(r["step"]), rank=int(r["rank"]), direction=r["direction"])
            out.append(Item(int(r["rid"]), rec, True))
        return out

    w = Rows()
    compare_runs(w, items(ref_id), items(cand["run_id"]), ref_run_id=ref_id, cand_run_id=cand["run_id"],
                 load=lambda run_id, it: torch.from_numpy(store.tensor(run_id, it.rid)), run_dtype=cand["dtype"])
    theirs = {r["cand_rid"]: r["comparison"] for r in w.rows if r["comparison"] is not None}
    assert set(theirs) == set(got) and len(got) > 10

    # the .float() output and the multiply after it are float32 tensors in the fp16 run
    fp32 = store.df("""SELECT rid, op FROM tensors WHERE run_id = ? AND role = 'output' AND direction = 'forward'
                       AND dtype = 'float32'""", [cand["run_id"]])
    assert {"float.0", "mul.0"} <= set(fp32["op"])
    for rid in fp32["rid"]:
        mine, other = got[int(rid)], theirs[int(rid)]
        # judged against fp16 (the run's format), not fp32: fp16 rounding in an fp32 tensor is expected
        assert mine["cand_format"] == other.cand_format == "fp16"
        assert mine["verdict"] == other.verdict == "expected"
        assert mine["max_abs_err"] == pytest.approx(other.max_abs_err, rel=0, abs=0)
    # every other tensor gets the same verdict by both paths too
    assert all(got[rid]["verdict"] == theirs[rid].verdict for rid in got)


def test_reference_keeper_keeps_a_device_tensor_on_its_device_within_its_budget():
    """A GPU tensor's reference copy stays on its device while the device budget lasts (comparing it needs no
    copy to the host); past it, host memory, then disk.  The device here is ``meta`` (no GPU on every
    machine): its copies take no memory, and the budget is counted the same way."""
    from precision_lab.services.capture import _ReferenceKeeper

    keeper = _ReferenceKeeper(budget_bytes=64, device_budget_bytes=100)
    first = torch.empty(16, device="meta")  # 64 bytes: within the device budget
    cpu = torch.arange(16, dtype=torch.float32)  # host tensors never count against the device budget
    sk_dev, sk_cpu = keeper._store(first), keeper._store(cpu)
    assert keeper._mem[sk_dev].device.type == "meta" and keeper.device_used == 64
    assert keeper._mem[sk_cpu].device.type == "cpu" and keeper.used == 64
    over = torch.arange(32, dtype=torch.float32)  # past the host budget: to disk
    sk_disk = keeper._store(over)
    assert isinstance(keeper._mem[sk_disk], str) and np.array_equal(np.load(keeper._mem[sk_disk]), over.numpy())
    keeper.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pair_keeps_references_on_the_device_and_matches_a_cpu_pair(store):
    from precision_lab.services import capture as cap_mod

    devices = []
    real = cap_mod._ReferenceKeeper._store

    def spy(self, t):
        sk = real(self, t)
        v = self._mem[sk]
        devices.append("disk" if isinstance(v, str) else v.device.type)
        return sk

    cap_mod._ReferenceKeeper._store = spy
    try:
        name = precision_lab.capture_pair(lambda: build_tiny().cuda(), tiny_input().cuda(), torch.float16,
                                          store=store, pair=PairOptions(loss_fn=loss_fn, local_error=False),
                                          name="gpu")
    finally:
        cap_mod._ReferenceKeeper._store = real
    assert devices and set(devices) == {"cuda"}
    cpu = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                     pair=PairOptions(loss_fn=loss_fn, local_error=False), name="cpu")
    worst = {}
    for n in (name, cpu):
        cand = _runs(store, n)["candidate"]["run_id"]
        worst[n] = _rows(store, """SELECT count(*) AS n, max(max_rel_err) AS m FROM comparisons
                                   WHERE kind = 'accumulated' AND cand_run_id = ?""", [cand])[0]
    assert worst[name]["n"] == worst[cpu]["n"]
    assert worst[name]["m"] == pytest.approx(worst[cpu]["m"], rel=0.5)  # fp16 rounding on two devices


@pytest.mark.slow
def test_device_comparisons_are_finished_together_with_the_numbers_of_immediate_ones(store, monkeypatch):
    """GPU tensors are compared on their device and finished together when the candidate run ends (one
    transfer); run here on CPU tensors through the same path, the session holds the numbers the immediate
    comparison gives."""
    from precision_lab import metrics
    from precision_lab.services import capture as cap_mod

    plain = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                       pair=PairOptions(loss_fn=loss_fn, local_error=False), name="immediate")
    finished = []
    real_finish = metrics.finish_all

    def spy(pending):
        finished.append(len(pending))
        return real_finish(pending)

    class Deferred(cap_mod._Comparer):
        def __init__(self, keeper, run_dtype):
            super().__init__(keeper, run_dtype, deferred_cpu=True)

    monkeypatch.setattr(cap_mod, "_Comparer", Deferred)
    monkeypatch.setattr(cap_mod, "finish_all", spy)
    later = precision_lab.capture_pair(build_tiny, tiny_input(), torch.float16, store=store,
                                       pair=PairOptions(loss_fn=loss_fn, local_error=False), name="deferred")
    assert len(finished) == 1 and finished[0] > 100  # every comparison of the run, finished in one call
    cols = ("max_abs_err", "max_rel_err", "max_ulp_err", "rmse", "sqnr_db", "compared", "verdict")
    got = {}
    for n in (plain, later):
        cand = _runs(store, n)["candidate"]["run_id"]
        got[n] = _rows(store, f"""SELECT t.name, {', '.join('c.' + c for c in cols)} FROM comparisons c
                                 JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                                 WHERE c.kind = 'accumulated' AND c.cand_run_id = ? ORDER BY t.name""", [cand])
    assert len(got[plain]) == len(got[later]) > 100
    for a, b in zip(got[plain], got[later]):
        assert a["name"] == b["name"] and a["compared"] == b["compared"] and a["verdict"] == b["verdict"]
        for c in ("max_abs_err", "max_rel_err", "max_ulp_err"):
            assert a[c] == b[c], (a["name"], c)
        for c in ("rmse", "sqnr_db"):
            assert a[c] == pytest.approx(b[c], rel=1e-9), (a["name"], c)

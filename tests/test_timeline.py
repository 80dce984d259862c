"""A long run: the per-step timeline, the frames kept before a failure, alerts, and --fail-on alert."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from precision_lab.alerts import (grad_spike_alerts, headroom_bits, loss_scale_alerts, op_alerts,
                                  op_format, _rolling_fit)
from precision_lab.cli import app
from precision_lab.formats import get_format
from precision_lab import capture
from precision_lab.live.engine import StatsEngine
from precision_lab.live.options import CaptureOptions
from precision_lab.services import timeline as svc
from precision_lab.services.report import build_report, to_json
from precision_lab.store import Store
from training import mlp as _mlp
from training import train as _train

runner = CliRunner()


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    db = tmp_path_factory.mktemp("tl") / "lab.duckdb"
    store = Store(db)
    with store.held():  # the file opened once for the reads of the captures, not once per read
        cap = _train(store, lr=0.2, steps=40, grow=True, run="fp16")
        healthy = _train(store, lr=0.01, steps=30, grow=False, run="fp16-healthy")
    return db, store, cap, healthy


# ---- the capture ------------------------------------------------------------------------------

def test_growing_fp16_training_alerts_before_the_first_nonfinite_step(grown):
    db, store, cap, _ = grown
    first = cap.first_nonfinite_step
    assert first is not None and first >= 12  # dozens of steps of healthy-looking training first
    sid = store.session(cap.session).session_id
    assert {t.run: t.first_nonfinite_step for t in svc.timeline_report(store, sid)}["fp16"] == first
    alerts = svc.run_alerts(store, cap.run_id)
    assert alerts, "no alert on a run whose activations grow until fp16 overflows"
    assert min(a.step for a in alerts) < first
    growth = [a for a in alerts if a.rule == "growth"]
    assert growth and min(a.step for a in growth) < first
    # the growth alert's prediction is causal: it used no step after the one it names
    g = min(growth, key=lambda a: a.step)
    assert f"fp16's max {65504:,}".replace(",", "") in g.message.replace(",", "")


def test_frames_before_the_failure_are_stored(grown):
    db, store, cap, _ = grown
    first = cap.first_nonfinite_step
    # keep_last=4: the last four steps up to the failure (every 10th step is kept anyway)
    want = [s for s in range(first - 3, first + 1) if s % 10]
    kept = sorted({r.step for r in cap.records})
    assert set(want) <= set(kept)
    assert cap.frames == [s for s in want if s != first]
    stored = [r[0] for r in store.sql("SELECT DISTINCT step FROM tensors WHERE run_id = ? ORDER BY step",
                                      [cap.run_id]).fetchall()]
    assert stored == kept
    # nothing else in between: steps that are neither every-10th nor frames have no full records
    assert all(s % 10 == 0 or s in want for s in stored)
    notes = store.session(cap.session).notes["capture"]
    assert notes["first_nonfinite_step"] == first and notes["frames"] == cap.frames


def test_summary_rows_match_numpy_and_real_casts():
    """The summary of one module output at a summary step against float64 numpy and ml_dtypes casts."""
    seen = {}
    store = Store(":memory:")
    opts = CaptureOptions(every=4)  # step 2 is a summary step

    def hook(cap):
        def grab(mod, args, out):
            if cap.step_no == 2:
                seen["out"] = out.detach().float().numpy().astype(np.float64)
        cap.model[0].register_forward_hook(grab)

    cap = _train(store, lr=0.01, steps=3, grow=False, options=opts, hook=hook)
    x = seen["out"]
    row = next(r for r in cap.timeline_rows if r.step == 2 and r.op == "0.forward.0" and r.role == "output")
    a = np.abs(x)
    assert row.absmax == a.max() and row.min_abs_nonzero == a[a > 0].min()
    assert row.l2norm == pytest.approx(math.sqrt((x * x).sum()), rel=1e-12)
    assert row.nan_count == 0 and row.inf_count == 0 and row.numel == x.size and row.dtype == "float16"
    assert not any(r.step == 2 for r in cap.records)  # no full records on a summary step
    shares = {s.fmt: s for s in cap.timeline_shares if s.tid == row.tid}
    assert set(shares) == {"fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"}
    for name, dt in (("fp8_e4m3fn", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2),
                     ("bf16", ml_dtypes.bfloat16)):
        f = get_format(name)
        y = x.astype(np.float32).astype(dt).astype(np.float64)
        nz = x != 0
        over = int((~np.isfinite(y) & nz).sum())
        under = int(((y == 0) & nz).sum())
        sub = int(((np.abs(y) < f.smallest_normal) & (y != 0) & np.isfinite(y)).sum())
        s = shares[name]
        assert (s.finite, s.overflow, s.underflow, s.subnormal) == (x.size, over, under, sub), name


def test_summary_engine_counts_the_watched_thresholds_without_the_histogram():
    """CPU tensors of a summary step take no histogram: the scan counts the magnitudes at or above each watched
    format's thresholds, and those counts give every format's overflow / underflow / subnormal exactly (a real
    cast through ml_dtypes as the reference); a view of a measured tensor keeps them."""
    from precision_lab.stats import format_counts_above, format_edges

    fmts = [get_format(n) for n in ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")]
    edges = {i for f in fmts for i in format_edges(f) if i is not None}
    eng = StatsEngine(CaptureOptions(every=2), warn=lambda *a: None, histogram=False, above_edges=edges)
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(300_001) * np.exp(rng.uniform(-30, 14, 300_001))).astype(np.float32)
    x[::97] = 0.0
    x[5], x[6], x[7] = np.inf, np.nan, 1e-40  # a non-finite block, and a float32 subnormal
    for t in (torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(x).to(torch.float16),
              torch.from_numpy(x[:4096].copy()).to(torch.float8_e4m3fn)):
        h = eng.measure(t, "x")
        assert h.stats.hist is None and set(h.above) == edges
        v = t.float().numpy().astype(np.float64)
        nz = np.isfinite(v) & (v != 0)
        for f, dt in zip(fmts, (np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)):
            with np.errstate(over="ignore", invalid="ignore"):
                y = v[nz].astype(np.float32).astype(dt).astype(np.float64)
            want = (int((~np.isfinite(y) | (np.abs(y) > float(ml_dtypes.finfo(dt).max))).sum()),
                    int((y == 0).sum()), int(((np.abs(y) < f.smallest_normal) & (y != 0) & np.isfinite(y)).sum()))
            assert format_counts_above(h.above, int(nz.sum()), f) == want, (t.dtype, f.name)
    base = torch.from_numpy(x.copy())
    h = eng.measure(base, "b")
    v = eng.measure(base.view(1, -1), "v")  # the same memory: the same counts, no second scan
    assert v.above == h.above and v.stats.shape == (1, x.size)


def test_summary_device_path_takes_the_histogram_and_one_transfer():
    """The deferred (device) path of the summary engine: histogram on the device, resolved at step end."""
    eng = StatsEngine(CaptureOptions(every=2), warn=lambda *a: None, deferred_cpu=True, histogram=False,
                      device_histogram=True)
    t = torch.tensor([1e-6, 3.0, -70000.0, float("nan")], dtype=torch.float32)
    h = eng.measure(t, "x")
    assert h.stats is None
    eng.resolve()
    r = h.stats.representability("fp16")
    assert h.stats.hist is not None and r.overflow == 1 and r.subnormal == 1 and h.stats.nan_count == 1


def test_loss_and_grad_scaler_scalars():
    class Scaler:  # the two GradScaler methods the capture reads
        def __init__(self):
            self.scale = 2.0 ** 16

        def is_enabled(self):
            return True

        def get_scale(self):
            return self.scale

    model = _mlp()
    scaler = Scaler()
    live = []
    opts = CaptureOptions(every=5, on_alert=lambda a: live.append((a.step, a.rule)) if a.op is None else None)
    with capture(model, run="s", store=Store(":memory:"), options=opts) as cap:
        for i in range(12):
            loss = cap.model(torch.randn(4, 16)).pow(2).mean()
            loss.backward()
            cap.step(loss=loss, grad_scaler=scaler)
            scaler.scale /= 2 if i >= 4 else 1  # repeated overflow skips halve it
    scales = [(s.step, s.value) for s in cap.step_scalars if s.name == "loss_scale"]
    assert scales[0] == (0, 65536.0) and scales[-1] == (11, 65536.0 / 2 ** 7)
    got = loss_scale_alerts("s", [s for s, _ in scales], [v for _, v in scales])
    assert [a.step for a in got] == [10]  # 2^16 / 2^10 = 64x below the peak first at step 10
    assert (10, "loss_scale") in live  # raised live at the same step


def test_locations_name_the_calling_line():
    import inspect

    model = _mlp()
    with capture(model, run="loc", store=Store(":memory:"), options=CaptureOptions(backward=False)) as cap:
        line = inspect.currentframe().f_lineno + 1
        cap.model(torch.randn(2, 16))
    rec = next(r for r in cap.records if r.op == "forward.0" and r.role == "output")
    assert rec.location.endswith(f"test_timeline.py:{line} in test_locations_name_the_calling_line")
    inner = next(r for r in cap.records if r.op == "0.forward.0")
    assert inner.location is not None and "torch" not in inner.location.split(":")[0]


@pytest.mark.slow
def test_an_installed_librarys_op_is_located_in_the_library_not_at_the_model_call():
    """A ``transformers`` model lives in site-packages, inside Python's own folder: its ops are located in its
    modeling file (where the user can read the line), not all at the line that called the model."""
    import inspect

    import transformers  # a test dependency (requirements-test.txt)

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with capture(model, run="hf", store=Store(":memory:"), options=CaptureOptions(backward=False)) as cap:
        line = inspect.currentframe().f_lineno + 1
        cap.model(input_ids=ids)
    top = next(r for r in cap.records if r.op == "forward.0" and r.role == "output")
    assert top.location.endswith(f"test_timeline.py:{line} in "
                                 "test_an_installed_librarys_op_is_located_in_the_library_not_at_the_model_call")
    down = next(r for r in cap.records if r.op.startswith("model.layers.0.mlp.down_proj.") and r.role == "output")
    assert "modeling_qwen2.py:" in down.location, down.location
    inside = {r.location.split(":")[0] for r in cap.records if r.location and r.op != "forward.0"}
    assert all("test_timeline.py" not in x for x in inside), inside


# ---- the rules ---------------------------------------------------------------------------------

def test_rolling_fit_matches_polyfit():
    rng = np.random.default_rng(0)
    x = np.arange(30, dtype=float)
    y = 0.7 * x + rng.normal(0, 0.5, 30)
    slope, r2 = _rolling_fit(x, y, 6)
    for i in range(5, 30):
        xs, ys = x[i - 5:i + 1], y[i - 5:i + 1]
        b = np.polyfit(xs, ys, 1)[0]
        r = np.corrcoef(xs, ys)[0, 1] ** 2
        assert slope[i] == pytest.approx(b, rel=1e-9) and r2[i] == pytest.approx(r, rel=1e-9)
    assert np.isnan(slope[:5]).all()


def test_headroom_and_growth_rules_on_a_doubling_series():
    fmt = get_format("fp16")
    steps = np.arange(20)
    absmax = 2.0 ** (steps - 2.0)  # doubles every step: 2^15 at step 17, overflow after
    got = {a.rule: a for a in op_alerts("r", "op", steps, absmax, fmt)}
    # headroom: log2(65504 / 2^(s-2)) < 2 first at s = 16 (65504 / 2^14 = 3.998 -> 1.9993 bits)
    assert got["headroom"].step == 16
    assert got["headroom"].value == pytest.approx(math.log2(65504 / 2.0 ** 14))
    # growth: a perfect fit of 1 bit/step once 6 points exist (step 5); 50-step horizon: fires at once
    assert got["growth"].step == 5 and "1.00 bits/step" in got["growth"].message
    assert got["growth"].value == pytest.approx(math.log2(65504) - 3.0)
    assert headroom_bits(np.array([65504.0]), fmt)[0] == 0.0


def test_growth_rule_is_causal_and_quiet_on_noise():
    fmt = get_format("fp16")
    rng = np.random.default_rng(3)
    flat = np.exp(rng.normal(0, 0.2, 200))  # no trend
    assert not [a for a in op_alerts("r", "op", np.arange(200), flat, fmt) if a.rule == "growth"]
    # the series' future does not change when an alert fires
    series = np.concatenate([np.ones(30), 2.0 ** np.arange(1, 20)])
    a = [x for x in op_alerts("r", "op", np.arange(len(series)), series, fmt) if x.rule == "growth"][0]
    b = [x for x in op_alerts("r", "op", np.arange(a.step + 1), series[:a.step + 1], fmt)
         if x.rule == "growth"][0]
    assert a.step == b.step and a.value == b.value


def test_underflow_rule_and_overrides():
    fmt = get_format("fp8_e4m3fn")
    share = np.array([0.0, 0.01, 0.049, 0.06, 0.2])
    got = [a for a in op_alerts("r", "op", np.arange(5), np.ones(5), fmt, share) if a.rule == "underflow"]
    assert got[0].step == 3 and got[0].steps_firing == 2
    got = [a for a in op_alerts("r", "op", np.arange(5), np.ones(5), fmt, share, {"underflow": {"share": 0.1}})
           if a.rule == "underflow"]
    assert got[0].step == 4


def test_grad_spike_against_running_median():
    norms = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 9.0, 12.0, float("inf")]
    got = grad_spike_alerts("r", list(range(len(norms))), norms)
    assert got[0].step == 7 and got[0].value == pytest.approx(12.0 / np.median(norms[:7]))
    assert "x the median" in got[0].message
    # a norm that is inf at once: no "infx the median", the median it left said as a number
    calm = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, float("inf")]
    got = grad_spike_alerts("r", list(range(len(calm))), calm)
    assert got[0].step == 6 and "infx" not in got[0].message
    from precision_lab.display import num_text

    assert got[0].message == ("gradient norm at step 6 is not finite (the median of the previous 6 steps: "
                              f"{num_text(float(np.median(calm[:6])))})")


def test_op_format_judges_low_precision_dtypes_only():
    assert op_format("float16").name == "fp16" and op_format("bfloat16").name == "bf16"
    assert op_format("float32") is None and op_format("float32", "fp8_e4m3fn").name == "fp8_e4m3fn"


# ---- the report and the command line ------------------------------------------------------------

def test_report_json_carries_alerts_and_steps(grown):
    db, store, cap, healthy = grown
    rep = json.loads(to_json(build_report(store, cap.session)))
    assert rep["alerts"] and {"run", "op", "step", "rule", "message", "value", "threshold",
                              "steps_firing"} <= set(rep["alerts"][0])
    steps = rep["timeline"]["fp16"]["steps"]
    assert [s["step"] for s in steps] == list(range(40))
    # the global gradient norm of a step, from the parameter gradients' norms
    losses = [s.value for s in cap.step_scalars if s.name == "loss"]
    assert [s["loss"] for s in steps[:5]] == losses[:5]
    norms = {}
    for r in cap.timeline_rows:
        if r.role == "param_grad":
            norms[r.step] = norms.get(r.step, 0.0) + r.l2norm ** 2
    assert steps[3]["grad_norm"] == pytest.approx(math.sqrt(norms[3]), rel=1e-12)


def test_fail_on_alert_exit_codes(grown):
    db, store, cap, healthy = grown
    got = runner.invoke(app, ["report", "--db", str(db), "-s", cap.session, "--fail-on", "alert"])
    assert got.exit_code == 1, got.output
    assert "FAIL alert" in got.stderr and "step" in got.stderr
    got = runner.invoke(app, ["report", "--db", str(db), "-s", cap.session, "--json", "--fail-on", "alert:growth"])
    assert got.exit_code == 1
    assert json.loads(got.stdout)["alerts"]
    got = runner.invoke(app, ["report", "--db", str(db), "-s", healthy.session, "--fail-on", "alert"])
    assert got.exit_code == 0, got.output
    assert svc.run_alerts(store, healthy.run_id) == []
    got = runner.invoke(app, ["report", "--db", str(db), "-s", cap.session, "--fail-on", "alert:nope"])
    assert got.exit_code == 2 and "no alert rule 'nope'" in got.output


def test_fail_on_alert_without_a_timeline_is_unusable(tmp_path):
    db = tmp_path / "x.duckdb"
    store = Store(db)
    with capture(_mlp(), run="one", store=store) as cap:
        cap.model(torch.randn(2, 16))
    got = runner.invoke(app, ["report", "--db", str(db), "-s", cap.session, "--fail-on", "alert"])
    assert got.exit_code == 2 and "no timeline" in got.stderr


# ---- heatmap, series, tree ----------------------------------------------------------------------

def test_heatmap_buckets_aggregate_like_numpy(grown):
    db, store, cap, _ = grown
    got = svc.heatmap(store, cap.run_id, metric="headroom", fmt="fp16", max_steps=7)
    width = got.width
    assert width == math.ceil(40 / 7)
    rows = [r for r in cap.timeline_rows if r.op == "2.forward.0" and r.role == "output"]
    for cell in (c for c in got.cells if c.op == "2.forward.0"):
        vals = [math.log2(65504 / r.absmax) for r in rows
                if cell.bucket <= r.step < cell.bucket + width and r.absmax and math.isfinite(r.absmax)]
        if vals:
            assert cell.value == pytest.approx(min(vals), rel=1e-12)
    assert [o.op for o in got.ops][:3] == ["0.forward.0", "1.forward.0", "2.forward.0"]
    low = svc.heatmap(store, cap.run_id, metric="low", fmt="fp8_e4m3fn", max_steps=400)
    assert low.width == 1
    shares = {s.tid: s for s in cap.timeline_shares if s.fmt == "fp8_e4m3fn"}
    row = next(r for r in rows if r.step == 5)
    cell = next(c for c in low.cells if c.op == "2.forward.0" and c.bucket == 5)
    s = shares[row.tid]
    assert cell.value == pytest.approx((s.underflow + s.subnormal) / s.finite)


def test_module_tree_and_record_at(grown):
    db, store, cap, _ = grown
    nodes = {n.id: n for n in svc.module_tree(store, cap.run_id, fmt="fp16")}
    assert {"(model)", "0", "1", "2"} <= set(nodes)
    assert nodes["0"].parent == "(model)"
    worst = min(math.log2(65504 / r.absmax) for r in cap.timeline_rows
                if r.op == "2.forward.0" and r.role == "output" and r.absmax and math.isfinite(r.absmax))
    assert nodes["2"].headroom == pytest.approx(worst)
    assert any(n.on_path for k, n in nodes.items() if k != "(model)") and nodes["(model)"].on_path
    first = cap.first_nonfinite_step
    rec = svc.record_at(store, cap.run_id, "2.forward.0", first - 1)
    assert rec.step == first - 1 and rec.name == "2.forward.0.output.0"
    rec = svc.record_at(store, cap.run_id, "2.forward.0", 3)  # a summary step: the full step before it
    assert rec.step == 0


# ---- where in the code: msprobe's stack.json ----------------------------------------------------

@pytest.mark.slow
def test_msprobe_stack_json_gives_each_op_its_line_of_user_code(tmp_path):
    import re
    import shutil
    from pathlib import Path

    from precision_lab.services.ingest import ingest

    src = Path(__file__).resolve().parents[1] / "sample_dumps" / "stat_mix_fp16_inner_ovf"
    dump = tmp_path / src.name
    shutil.copytree(src, dump)
    stack_path = next(dump.rglob("stack.json"))
    stack = json.loads(stack_path.read_text())
    want = {}
    for keys, frames in stack.values():  # independent reading: the first frame outside torch
        m = next(re.match(r"File (.*?), line (\d+), in ([^,]+),", f) for f in frames if "/torch/" not in f)
        path = "/".join(m.group(1).split("/")[-3:])
        want.update((k, f"{path}:{m.group(2)} in {m.group(3)}") for k in keys)
    store = Store(tmp_path / "lab.duckdb")
    ingest([dump], store=store, session="s")
    got = dict(store.sql("SELECT DISTINCT op, location FROM tensors WHERE location IS NOT NULL").fetchall())
    assert got and all(want[op] == loc for op, loc in got.items())
    assert set(got) == {op for op in want if store.sql("SELECT 1 FROM tensors WHERE op = ?", [op]).fetchone()}
    # a stack.json that is not what msprobe writes is a warning; the records stand
    stack_path.write_text("[1, 2, 3]")
    ingest([dump], store=store, session="t")
    assert store.sql("SELECT count(*) FROM tensors t JOIN runs r USING (run_id) JOIN sessions s USING "
                     "(session_id) WHERE s.name = 't' AND t.location IS NOT NULL").fetchone()[0] == 0
    stack_path.write_text("{not json")
    ingest([dump], store=store, session="u")
    msgs = [m for (m,) in store.sql("SELECT w.message FROM warnings w JOIN sessions s USING (session_id) "
                                    "WHERE s.name = 'u'").fetchall()]
    assert any("op locations not shown" in m for m in msgs)


# ---- several ranks: each writes its own timeline beside its shards --------------------------------

def test_timeline_of_two_ranks_through_shards(tmp_path, monkeypatch):
    from precision_lab.services.ingest import IngestError, ingest

    root = tmp_path / "shards"
    caps = {}
    for rank, scale in ((0, 1.0), (1, 8.0)):
        monkeypatch.setenv("RANK", str(rank))
        model = _mlp()
        with capture(model, run="fp16", shard_dir=root, options=CaptureOptions(every=4)) as cap:
            g = torch.Generator().manual_seed(rank)
            for _ in range(6):
                loss = cap.model(torch.randn(8, 16, generator=g) * scale).pow(2).mean()
                loss.backward()
                cap.step(loss=loss)
        caps[rank] = cap
    assert (root / "fp16" / "rank1" / "timeline.parquet").exists()
    store = Store(tmp_path / "lab.duckdb")
    name = ingest([root], store=store, session="ranks")
    run_id = store.sql("SELECT run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                       [name]).fetchone()[0]
    n = store.sql("SELECT count(*), count(DISTINCT tid), count(DISTINCT rank) FROM timeline WHERE run_id = ?",
                  [run_id]).fetchone()
    assert n == (len(caps[0].timeline_rows) + len(caps[1].timeline_rows),) * 2 + (2,)
    # ranks merged per op and step: the larger |x| max, the summed counts; every share row finds its summary
    series = svc.op_series(store, run_id, "0.forward.0", fmt="fp16")
    for step in range(6):
        want = max(r.absmax for c in caps.values() for r in c.timeline_rows
                   if r.step == step and r.op == "0.forward.0" and r.role == "output")
        assert series[step].absmax == want
    orphans = store.sql("SELECT count(*) FROM timeline_formats f LEFT JOIN timeline t ON t.run_id = f.run_id "
                        "AND t.tid = f.tid WHERE f.run_id = ? AND t.tid IS NULL", [run_id]).fetchone()[0]
    assert orphans == 0
    losses = store.sql("SELECT count(*) FROM step_scalars WHERE run_id = ? AND name = 'loss'", [run_id]).fetchone()
    assert losses == (12,)
    # a timeline file that lies about its types is refused in one sentence naming it
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(root / "fp16" / "rank1" / "step_scalars.parquet")
    t = t.set_column(t.column_names.index("value"), "value", pa.array(["x"] * t.num_rows))
    pq.write_table(t, root / "fp16" / "rank1" / "step_scalars.parquet")
    with pytest.raises(IngestError, match=r"fp16/rank1/step_scalars\.parquet: column value holds str"):
        ingest([root], store=store, session="bad")
    assert "bad" not in set(store.sessions()["name"])


def test_live_alerts_fire_at_the_step_the_stored_run_names(tmp_path):
    """on_alert is called during training, at the end of the step that trips each op rule, before the first
    non-finite step; the stored run's alerts name the same first steps."""
    fired = []
    store = Store(tmp_path / "live.duckdb")
    opts = CaptureOptions(every=10, on_alert=lambda a: fired.append((a.step, a.rule, a.op)))
    cap = _train(store, lr=0.2, steps=30, grow=True, run="live", options=opts)
    assert fired and fired == [(a.step, a.rule, a.op) for a in cap.alerts]
    first = cap.first_nonfinite_step
    assert min(s for s, _, _ in fired) < first and any(r == "growth" and s < first for s, r, _ in fired)
    stored = {(a.rule, a.op): a.step for a in svc.run_alerts(store, cap.run_id)}
    assert {(r, op): s for s, r, op in fired} == stored
    assert ("grad_spike", None) in stored  # a whole-step rule, raised live too
    with pytest.raises(ValueError, match="on_alert needs every="):
        CaptureOptions(on_alert=print)


@pytest.mark.slow
def test_a_long_runs_memory_per_step_is_what_the_options_state():
    """The timeline is held until the capture ends: measured per summarised tensor per step, it stays within the
    1.1 KB the options document (with the four default watched formats)."""
    import tracemalloc

    from precision_lab.live.recorder import Capture

    model = _mlp()
    with Capture(model, run="mem", options=CaptureOptions(every=10 ** 6), write=False) as cap:
        for _ in range(3):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            cap.step(loss=1.0)
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for _ in range(100):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                cap.step(loss=1.0)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    per_step = len([r for r in cap.timeline_rows if r.step == 10])
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert per_step == 8 and grown / (100 * per_step) <= 1.1 * 1024 * 1.15  # 15% for the allocator's rounding


def test_two_files_identical_functions_are_located_each_in_its_own_file(tmp_path):
    """Code objects compare equal by contents, not by file: ``transformers`` copies one model's MLP into another's
    modeling file, and the second model's ops were located in the first one's file."""
    from precision_lab.live.where import user_location

    src = "def f():\n    return user_location(skip=0)\n"
    found = []
    for name in ("modeling_a.py", "modeling_b.py"):
        path = tmp_path / name
        path.write_text(src)
        ns = {"user_location": user_location}
        exec(compile(src, str(path), "exec"), ns)
        found.append(ns["f"]())
    assert ns["f"].__code__ == compile(src, "elsewhere.py", "exec").co_consts[0]  # equal whatever the file
    assert "modeling_a.py:2" in found[0] and "modeling_b.py:2" in found[1], found


def test_a_capture_given_the_grad_scaler_records_each_step_unscaled_with_the_scale_it_used():
    """A real ``torch.amp.GradScaler`` under fp16 autocast, growing its scale after every step: each step's
    loss scale is the one its backward used (not the one ``update()`` set for the next), and the recorded
    gradients are divided by it, so the gradient norm is the model's, not the scaled one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    used, norms = [], []
    with capture(model, run="amp", store=Store(":memory:"), options=CaptureOptions(every=1),
                 grad_scaler=scaler) as cap:
        for x in xs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            used.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # independently: the true gradients, as the optimizer sees them
            norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            cap.step(loss=loss)
    assert used == [1024.0, 2048.0, 4096.0]
    assert [s.value for s in cap.step_scalars if s.name == "loss_scale"] == used
    grads = [r for r in cap.records if r.role == "param_grad"]
    assert grads
    for step, want in enumerate(norms):
        got = math.sqrt(sum(r.stats.l2norm ** 2 for r in grads if r.step == step))
        assert got == pytest.approx(want, rel=1e-3), step
    assert all(p.dtype == torch.float32 for p in model.parameters())

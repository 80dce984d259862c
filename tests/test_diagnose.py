"""Diagnosis rules: the right op, the right reason, real numbers, ranked fixes that work."""

import json
import math
import re

import numpy as np
import pytest

from precision_lab.fixes.rules import fmt_num, representable_floor
from precision_lab.services.diagnose import diagnose, diagnose_session
from precision_lab.fixes.recipes import get_recipe
from precision_lab.services.rerun import capture_recipe
from precision_lab.formats import FORMATS

F16 = np.finfo(np.float16)
RECIPES = ["fp8-zero-scale", "calibration-nan", "fp8-rowwise-rmsnorm", "fp16-mlp-overflow", "fp16-layernorm",
           "softmax-fp16-overflow"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from precision_lab.store import Store, close_all

    store = Store(tmp_path_factory.mktemp("diag") / "diag.duckdb")
    with store.held():  # the file opened once for the reads of the captures, not once per read
        sessions = {name: capture_recipe(store, name) for name in RECIPES}
    yield store, sessions
    close_all()


def _errors(store, session):
    sid = store.session(session).session_id
    df = store.df("SELECT d.*, r.kind FROM diagnoses d JOIN runs r ON r.run_id = d.run_id "
                  "WHERE d.session_id = ? AND d.severity = 'error'", [sid])
    return [row for _, row in df.iterrows()]


def _one(store, session):
    errs = _errors(store, session)
    assert len(errs) == 1, [e["message"] for e in errs]
    e = errs[0]
    assert e["kind"] == "candidate"
    return e, json.loads(e["fixes"])


def _numbers(text):
    return [float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*\.?\d*(?:e[+-]?\d+)?", text)]


def _stat(store, session, op_like, role="output", run_kind="candidate"):
    sid = store.session(session).session_id
    df = store.df("""SELECT t.* FROM tensors t JOIN runs r ON r.run_id = t.run_id WHERE r.session_id = ?
                     AND r.kind = ? AND t.op LIKE ? AND t.role = ? ORDER BY t.seq LIMIT 1""",
                  [sid, run_kind, op_like, role])
    assert len(df) == 1, op_like
    return df.iloc[0]


@pytest.mark.slow
def test_fp8_zero_scale_explains_subnormal_scale(lab):
    store, s = lab
    d, fixes = _one(store, s["fp8-zero-scale"])
    assert d["rule"] == "fp8-scale" and d["op"] == "proj.act_quant.inv_scale"
    amax = _stat(store, s["fp8-zero-scale"], "proj.act_quant.amax.forward.%")["max"]
    # the scale as fp16 arithmetic makes it, computed with numpy's float16
    e5m2_max = float(__import__("ml_dtypes").finfo(__import__("ml_dtypes").float8_e5m2).max)
    scale = np.float16(np.float16(amax) / np.float32(e5m2_max))
    assert 0 < scale < F16.tiny  # subnormal
    recip = 1.0 / float(scale)
    assert recip > float(F16.max)
    msg = d["message"]
    assert f"scale {float(scale):.2g} is subnormal in fp16 (smallest normal {float(F16.tiny):.2g})" in msg
    assert f"its reciprocal {recip:.2g} exceeds fp16 max {float(F16.max):,.0f} -> inf" in msg
    assert "0 x inf = NaN at `proj.act_quant.inv_scale`" in msg
    # scale in fp32 first; then a floor whose reciprocal scale fp16 can hold: 2^ceil(log2(57344/65504)) = 1
    assert fixes == ["scale-fp32", "amax-floor:1"]


def test_rowwise_counts_zero_rows_and_floor(lab):
    store, s = lab
    d, fixes = _one(store, s["fp8-rowwise-rmsnorm"])
    assert d["rule"] == "fp8-scale" and d["op"] == "proj.act_quant.inv_scale"
    _, x = get_recipe("fp8-rowwise-rmsnorm").build()
    zero_rows = int((np.abs(x.numpy()).reshape(-1, x.shape[-1]).max(-1) == 0).sum())
    assert zero_rows == 3
    assert f"amax is 0 for {zero_rows} rows (all zeros)" in d["message"]
    assert "e4m3fn max 448" in d["message"]
    assert "clamp(min=1e-12) does nothing in fp16" in d["message"] and np.float16(1e-12) == 0
    # smallest power of two floor with 448 / floor <= 65504
    floor = 2.0 ** math.ceil(math.log2(448 / float(F16.max)))
    assert fixes == ["scale-fp32+amax-floor:1e-12", f"amax-floor:{floor:g}"]


def _np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_mlp_overflow_reports_reference_absmax_and_island(lab):
    store, s = lab
    d, fixes = _one(store, s["fp16-mlp-overflow"])
    assert d["rule"] == "overflow" and d["op"] == "layers.0.mlp.down_proj"
    model, x = get_recipe("fp16-mlp-overflow").build()
    layer = model.layers[0]
    p = lambda t: t.detach().double().numpy()  # noqa: E731
    h = _np_rms(p(x), p(layer.input_layernorm.weight), layer.input_layernorm.eps)
    g, u = h @ p(layer.mlp.gate_proj.weight).T, h @ p(layer.mlp.up_proj.weight).T
    down = (g / (1 + np.exp(-g)) * u) @ p(layer.mlp.down_proj.weight).T
    expect = np.abs(down).max()
    assert expect > float(F16.max)
    got = _numbers(d["message"].split("output absmax ")[1])[0]
    assert got == pytest.approx(expect, abs=1.0)  # printed to the unit
    assert f"> fp16 max {float(F16.max):,.0f}" in d["message"]
    assert fixes[0] == "use-bf16"
    assert fixes[1] == "keep-fp32:layers.0.mlp.down_proj+keep-fp32:layers.0.residual+keep-fp32:norm"


def test_layernorm_names_overflow_and_flushed_eps(lab):
    store, s = lab
    d, fixes = _one(store, s["fp16-layernorm"])
    assert d["rule"] == "norm-statistics" and d["op"] == "ln"
    _, x = get_recipe("fp16-layernorm").build()
    a = float(np.abs(x.numpy().astype(np.float16)).max())
    msg = d["message"]
    assert f"input absmax {a:.4g}: x^2 = {a * a:,.0f} > fp16 max 65,504" in msg
    assert "epsilon 1e-05 is subnormal in fp16 (smallest normal 6.1e-05) and becomes 0 under flush-to-zero" in msg
    assert 0 < abs(np.float16(1e-5)) < F16.tiny
    assert fixes[0] == "stats-fp32"
    assert fixes[1] == "two-pass-variance+eps:0.0001" and 1e-4 >= F16.tiny  # a normal fp16 epsilon


def test_softmax_overflow_gives_logit_and_ln_max(lab):
    store, s = lab
    d, fixes = _one(store, s["softmax-fp16-overflow"])
    assert d["rule"] == "softmax-overflow" and d["op"] == "attn.softmax"
    top = _stat(store, s["softmax-fp16-overflow"], "attn.softmax.forward.%", role="input")["max"]
    assert f"logits reach {top:.4g} > ln(65,504) = {math.log(float(F16.max)):.2f}" in d["message"]
    assert fixes == ["stable-softmax", "keep-fp32:attn.softmax", "use-bf16"]


def test_calibration_nan_points_at_the_producer(lab):
    store, s = lab
    d, fixes = _one(store, s["calibration-nan"])
    assert d["rule"] == "nonfinite-in-reference" and d["op"] == "norm"
    _, x = get_recipe("calibration-nan").build()
    zero_rows = int((np.abs(x.numpy()).max(-1) == 0).sum())
    n = zero_rows * 32  # every element of a zero row of the 32-wide normalisation is 0/0
    assert f"`norm` produces {n} NaN in the fp32 reference run too" in d["message"]
    assert f"Its input holds {n} zeros: 0/0" in d["message"]
    assert "Histogram calibration at `proj.act_quant.amax.forward.0`" in d["message"]
    assert "is not finite" in d["message"]  # torch.histc's own words, as recorded on the run
    assert fixes == ["eps:1e-6", "sanitize-nonfinite:norm", "calibrate-finite-only"]


@pytest.mark.slow
def test_diagnose_is_idempotent_and_in_the_report(lab):
    from precision_lab.services.report import build_report

    store, s = lab
    name = s["softmax-fp16-overflow"]
    first = diagnose_session(store, name)
    second = diagnose_session(store, name)
    assert [(d.rule, d.op, d.message, d.fixes) for d in first] == [(d.rule, d.op, d.message, d.fixes) for d in second]
    sid = store.session(name).session_id
    assert store.sql("SELECT count(*) FROM diagnoses WHERE session_id = ?", [sid]).fetchone()[0] == len(first)
    rep = build_report(store, name)
    assert rep.diagnoses[0].op and rep.diagnoses[0].rule and rep.diagnoses[0].message
    assert rep.diagnoses[0].fixes[0] == "stable-softmax"


def test_thresholds_come_from_formats():
    fp16, e4m3, e5m2 = FORMATS["fp16"], FORMATS["fp8_e4m3fn"], FORMATS["fp8_e5m2"]
    assert representable_floor(e5m2, fp16) == 1.0
    assert representable_floor(e4m3, fp16) == 2.0 ** -7
    assert 448 / representable_floor(e4m3, fp16) <= 65504 < 448 / (representable_floor(e4m3, fp16) / 2)
    assert fmt_num(78450.0) == "78,450" and fmt_num(1.7e-6) == "1.7e-06" and fmt_num(float("inf")) == "inf"


@pytest.mark.slow
def test_dump_session_without_recipe(lab):
    """An msprobe statistics dump: the overflowing op is found from the reference's Max/Min."""
    from tests.conftest import SAMPLES
    from precision_lab.services.ingest import ingest

    store = lab[0]
    name = ingest([SAMPLES / "stat_mix_fp16_inner_ovf"], reference=[SAMPLES / "stat_mix_fp32_inner_ovf"],
                  store=store)
    stored = store.df("SELECT rule FROM diagnoses WHERE session_id = ?", [store.session(name).session_id])
    assert list(stored.rule) == ["overflow"]  # ingest diagnosed the new session
    found = diagnose(store, name)
    errs = [d for d in found if d.severity == "error"]
    assert len(errs) == 1 and errs[0].rule == "overflow"
    op = errs[0].op
    sid = store.session(name).session_id
    ref_max = store.sql("""SELECT max(greatest(abs(t.max), abs(t.min))) FROM tensors t JOIN runs r
                           ON r.run_id = t.run_id WHERE r.session_id = ? AND r.kind = 'reference' AND t.op = ?
                           AND t.role = 'output'""", [sid, op]).fetchone()[0]
    assert ref_max > float(F16.max)
    assert f"output absmax {ref_max:,.0f} (fp32 reference) > fp16 max 65,504" in errs[0].message
    assert errs[0].fixes == ("use-bf16",)


def test_precision_loss_without_nonfinite(lab):
    """A finite run whose op introduces far more error than its format's rounding gets a warning."""
    import torch

    from precision_lab.metrics import compare
    from precision_lab.records import TensorRecord
    from precision_lab.stats import tensor_stats

    store = lab[0]
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(64, 64, generator=g)
    cand = (ref * 1.05).half()  # a 5% error: ~100x fp16's unit roundoff (2^-11)
    with store.new_session("lossy", source="test") as w:
        rid_ref = w.add_run(run_id="lossy-ref", name="reference", kind="reference", dtype="float32")
        rid_c = w.add_run(run_id="lossy-cand", name="candidate", kind="candidate", dtype="float16")
        r = w.add_record(TensorRecord(rid_ref, 0, "blk.proj.linear.0", "linear", "output", "0", tensor_stats(ref)))
        c = w.add_record(TensorRecord(rid_c, 0, "blk.proj.linear.0", "linear", "output", "0", tensor_stats(cand)))
        cmp = compare(ref, cand)
        for kind, ref_run, ref_rid in (("local", rid_c, None), ("accumulated", rid_ref, r)):
            w.add_comparison(kind=kind, ref_run_id=ref_run, ref_rid=ref_rid, cand_run_id=rid_c, cand_rid=c, step=0,
                             rank=0, seq=0, op="blk.proj.linear.0", role="output", index="0", match="exact",
                             comparison=cmp)
    found = diagnose(store, "lossy")
    assert [d.rule for d in found] == ["precision-loss"] and found[0].severity == "warn"
    rn, cn = ref.double().numpy(), cand.double().numpy()
    sqnr = 10 * np.log10((rn ** 2).sum() / ((cn - rn) ** 2).sum())
    units = np.sqrt(((cn - rn) ** 2).mean()) / np.sqrt((rn ** 2).mean()) / (2.0 ** -11)
    assert cmp.verdict == "error" and units > 64
    assert f"introduces error {units:.3g}x fp16's unit roundoff (SQNR {sqnr:.1f} dB" in found[0].message
    assert found[0].fixes == ("use-bf16",)

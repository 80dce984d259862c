"""Mechanisms with their own diagnoses, alerts and fixes: a count past its format's contiguous-integer limit, a
non-finite gradient reaching Adam, gradients flushed to zero; a fix whose target format cannot hold the values
is never offered; a quantise op's verdict from its own input; the op that introduced the error ranks first."""

from __future__ import annotations

import pytest
import importlib.util
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from torch import nn
from typer.testing import CliRunner

from precision_lab import capture, capture_pair
from precision_lab.alerts import op_alerts
from precision_lab.cli import app
from precision_lab.fixes.catalogue import apply_fixes, unreachable
from precision_lab.fixes.policy import get_policy
from precision_lab.fixes.recipes import Recipe, register_recipe
from precision_lab.formats import FORMATS
from precision_lab.quantisation import flushed_by_underflow
from precision_lab.live import CaptureOptions, PairOptions
from precision_lab.services.applicable import applicable_fixes
from precision_lab.services.diagnose import diagnose
from precision_lab.services.rerun import capture_recipe
from precision_lab.services.report import build_report, first_nonfinite, render_text
from precision_lab.services.timeline import session_alerts
from precision_lab.store import Store
from precision_lab.store import queries as q
from precision_lab.store.views import top_offenders

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened



def _corpus():
    """bench/localization_cases.py, the published localization corpus: its models are the cases tested here."""
    spec = importlib.util.spec_from_file_location("localization_cases",
                                                  Path(__file__).parents[1] / "bench" / "localization_cases.py")
    if spec.name in sys.modules:  # loaded already (bench/localization.py imports it)
        return sys.modules[spec.name]
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LC = _corpus()
START, ADDS = LC.TokenPool().start, 24
CounterModel = LC.TokenCounter


def _tokens():
    return torch.randn(2, ADDS, 16, generator=torch.Generator().manual_seed(0))


def _count(dtype) -> tuple[float, int]:
    """The count after ``ADDS`` adds of 1 from ``START`` in ``dtype`` (a numpy/ml_dtypes type), and how many
    adds left it where it was."""
    c, lost = dtype(START), 0
    for _ in range(ADDS):
        n = dtype(float(c) + 1.0)
        lost += float(n) == float(c)
        c = n
    return float(c), lost


def _output(policy):
    """The counter model's pooled tokens under ``policy`` (None: fp32 as built), in float64."""
    torch.manual_seed(0)
    m = CounterModel()
    x = _tokens()
    if policy is not None:
        m, x = policy.prepare(m), policy.prepare_inputs(x)
    with torch.no_grad():
        return m.pool(x).double()


def test_integer_limits_come_from_the_mantissa():
    for name, dt in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        lim = FORMATS[name].integer_limit
        assert all(float(dt(i)) == i for i in range(lim + 1))  # every integer up to the limit
        assert float(dt(lim + 1)) == lim  # the next one rounds back (to even)
    assert (FORMATS["fp16"].integer_limit, FORMATS["bf16"].integer_limit) == (2048, 256)


@pytest.mark.slow
def test_positions_counted_by_cumsum_past_2048_are_named_there_and_ranked_first(store):
    """``ones.cumsum(-1)`` in fp16 (position ids): past 2048 only even integers exist, so the counts round (2049 ->
    2048, 2051 -> 2052); cos after it amplifies the error, but the count is where it first appears."""
    x = torch.randn(1, 3000, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.ones(1, 3000, dtype=torch.float16).cumsum(-1).double()
    off = float((pos - torch.arange(1, 3001, dtype=torch.float64)).abs().max())
    assert off == 1.0  # independently: odd counts past 2048 are rounded by one
    name = capture_pair(LC.PositionsByCumsum, x, torch.float16, store=store, pair=PairOptions(local_error=True))
    d = next(d for d in diagnose(store, name) if d.rule == "integer-limit")
    assert d.op == "cumsum.0" and "counts to 3,000" in d.message and "by up to 1)" in d.message
    assert "only multiples of 2 exist" in d.message
    first = top_offenders(store, store.session(name).session_id, n=1).iloc[0]
    assert first["op"] == "cumsum.0"  # not cos.0, whose error is larger


@pytest.mark.slow
def test_a_count_stuck_at_2048_is_named_with_a_fix_that_can_help(store):
    stuck, lost = _count(np.float16)
    reach, _ = _count(np.float32)
    assert (stuck, reach, lost) == (2048.0, START + ADDS, 16)  # independently: 16 adds of 1 are lost in fp16
    assert _count(ml_dtypes.bfloat16)[0] < reach - 16  # and bf16 is worse, not a fix
    register_recipe(Recipe("test-token-counter", "fp16 token counter past 2048",
                           lambda: (CounterModel(), _tokens()), get_policy("fp16")), replace=True)
    name = capture_pair(CounterModel, _tokens(), get_policy("fp16"), store=store,
                        pair=PairOptions(recipe="test-token-counter"))
    d = next(d for d in diagnose(store, name) if d.rule == "integer-limit")
    assert d.op.startswith("pool.add.")
    assert "integers above 2048 are not representable in fp16: +1 is lost" in d.message
    assert f"{lost} add(s) are lost" in d.message and f"reaches {reach:,.0f}" in d.message
    assert f"stays at {stuck:,.0f}" in d.message
    assert "keep-fp32:pool" in d.fixes  # pool's dtype comes from its own Linear: the island moves the count
    assert "use-bf16" not in d.fixes  # bf16 counts worse (its limit is 256)
    # and the island does help: with pool in fp32 its output is the fp32 one, in bf16 it moves further away
    ref = _output(None)
    err = {f: float((_output(apply_fixes(get_policy("fp16"), f)) - ref).abs().max()) for f in ("keep-fp32:pool",
                                                                                           "use-bf16")}
    base = float((_output(get_policy("fp16")) - ref).abs().max())
    assert err["keep-fp32:pool"] < base / 4 < base < err["use-bf16"]
    assert unreachable("use-bf16", integers_to=reach) and not unreachable("keep-fp32:pool", integers_to=reach)
    # the add that lost the count ranks first, ahead of the ops that carry its error on
    sid = store.session(name).session_id
    assert top_offenders(store, sid, n=1).iloc[0]["op"] == d.op
    worst = render_text(build_report(store, name)).split("Worst")[1].splitlines()[3]
    assert worst.split()[1] == d.op


TinyGrad, _tiny_loss = LC.TinyGrad, LC._tiny_loss


@pytest.mark.slow
def test_gradients_flushed_to_zero_raise_the_alert_and_a_loss_scaling_diagnosis(store):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = TinyGrad()
    _tiny_loss(ref(x)).backward()
    g = ref.a.weight.grad.numpy()
    assert np.count_nonzero(g) == g.size and not np.any(g.astype(np.float16))  # every value flushes in fp16
    name = capture_pair(TinyGrad, x, torch.float16, store=store, pair=PairOptions(loss_fn=_tiny_loss))
    d = next(d for d in diagnose(store, name) if d.rule == "gradient-underflow")
    assert d.op == "mul.0.backward"  # the first backward op that writes zeros
    assert f"{g.size:,} of {g.size:,}" in d.message and "Scale the loss" in d.message
    assert "use-bf16" in d.fixes  # bf16 holds 1e-12 as fp32 does
    alerts = [a for a in session_alerts(store, name) if a.rule == "underflow"]
    weight = next(a for a in alerts if a.op == "a.backward.0" and "param_grad.weight" in a.message)
    assert weight.value == 1.0 and "flushed to zero" in weight.message


def test_flushed_share_alone_fires_the_underflow_rule():
    fmt = FORMATS["fp16"]
    got = op_alerts("r", "g", np.arange(3), np.ones(3), fmt, flushed_share=[0.0, 0.02, 0.5])
    a = next(a for a in got if a.rule == "underflow")
    assert a.step == 2 and a.value == 0.5 and "50.0% of its values were flushed to zero" in a.message
    # both shares add up: 3% round to a subnormal and 3% flushed is over 5%
    got = op_alerts("r", "g", np.arange(2), np.ones(2), fmt, [0.03, 0.03], flushed_share=[0.0, 0.03])
    assert [a.step for a in got if a.rule == "underflow"] == [1]


def _overflowing():
    torch.manual_seed(0)
    m = LC.BackwardOverflow()
    with torch.no_grad():
        LC._bo_edit(m)
    return m


def test_an_inf_gradient_that_adam_turns_into_nan_weights_is_explained(store):
    # independently: Adam's update of an inf gradient is inf / inf = NaN
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([math.inf, 1.0])
    torch.optim.Adam([p], lr=1e-3).step()
    assert math.isnan(float(p.detach()[0])) and math.isfinite(float(p.detach()[1]))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).abs()
    model = _overflowing()
    with capture(model, run="fp16-adam", store=store, dtype_policy=torch.float16, options=CaptureOptions()) as cap:
        opt = torch.optim.Adam(cap.model.parameters(), lr=1e-3, eps=1e-4)
        for _ in range(2):
            opt.zero_grad()
            (cap.model(cap.prepare_inputs(x)).float().sum() * 64.0).backward()
            opt.step()
            cap.step()
    run = q.session_runs(store, store.session(cap.session).session_id)[0]
    origin = first_nonfinite(store, run.run_id)
    assert origin.direction == "backward" and origin.step == 0
    d = next(d for d in diagnose(store, cap.session) if d.rule == "optimizer-nonfinite")
    assert d.op == origin.op and "(step 0)" in d.message and "inf / inf = NaN" in d.message
    assert "from step 1 on" in d.message and "GradScaler" in d.message


class PadAttention(nn.Module):
    """The transformers additive mask built from finfo(float32).min; query 0 is fully padded."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        keep = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)
        keep[0] = False
        bias = (~keep).to(s.dtype) * torch.finfo(torch.float32).min
        return torch.softmax(s + bias, -1) @ x


@pytest.mark.slow
def test_a_fix_whose_format_cannot_hold_the_value_is_not_offered(store):
    lowest = torch.finfo(torch.float32).min
    assert torch.tensor(lowest).to(torch.bfloat16).item() == -math.inf  # -inf in bf16 as in fp16
    assert torch.tensor(lowest).to(torch.float16).item() == -math.inf
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    name = capture_pair(PadAttention, x, torch.float16, store=store)
    d = next(d for d in diagnose(store, name) if d.rule != "compiled")
    # the mask that became -inf is named, not the softmax that turns its fully masked row into NaN (fp16 only)
    assert (d.op, d.rule) == ("mul.0", "mask-overflow")
    assert "use-bf16" not in d.fixes and "-65,504" in d.message
    why = unreachable("use-bf16", absmax=abs(lowest))
    assert why and "beyond bf16's range" in why
    assert unreachable("fp8-format:fp8_e4m3fn", absmax=1e3) and not unreachable("fp8-format:fp8_e5m2", absmax=1e3)
    assert unreachable("use-bf16", smallest=1e-41) and not unreachable("use-bf16", smallest=1e-12)


def _weight_outlier():
    torch.manual_seed(0)
    m = LC.QuantMLP()
    with torch.no_grad():
        m.layers[1].weight[0, 0] = 3.0e4
    return m


def test_a_quantise_op_that_flushes_values_is_judged_by_them(store):
    w = _weight_outlier().layers[1].weight.detach().half().float()
    scale = w.abs().max() / FORMATS["fp8_e4m3fn"].max
    deq = (w / scale).to(torch.float8_e4m3fn).float() * scale
    flushed = int(((deq == 0) & (w != 0)).sum())
    assert flushed / w.numel() > 0.05  # independently: a real e4m3 cast flushes most small weights
    name = capture_pair(_weight_outlier, torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).abs(),
                        get_policy("fp8-e4m3-tensor"), store=store)
    rows = store.sql("""SELECT verdict, reason FROM comparisons WHERE op = 'layers.1.weight_quant.forward.0'
                        AND role = 'output' AND verdict IS NOT NULL""").fetchall()
    assert rows and all(v == "error" for v, _ in rows)
    assert all(f"{flushed:,} of {w.numel():,}" in r and "round to 0" in r for _, r in rows)
    sid = store.session(name).session_id
    assert top_offenders(store, sid, n=1).iloc[0]["op"] == "layers.1.weight_quant.forward.0"


def test_fail_on_underflow_trips_on_a_compared_run_with_flushed_gradients(tmp_path):
    db = tmp_path / "x.duckdb"
    name = capture_pair(TinyGrad, torch.randn(4, 32, generator=torch.Generator().manual_seed(0)), torch.float16,
                        store=Store(db), pair=PairOptions(loss_fn=_tiny_loss))
    got = CliRunner().invoke(app, ["report", "--db", str(db), "-s", name, "--fail-on", "alert:underflow"])
    assert got.exit_code == 1 and "flushed to zero" in got.output
    got = CliRunner().invoke(app, ["report", "--db", str(db), "-s", name, "--fail-on", "alert:growth"])
    assert got.exit_code == 2 and "no timeline" in got.stderr


def test_zeros_count_as_flushed_only_where_the_reference_holds_values_the_format_rounds_to_zero():
    ref = np.array([1e-9] * 4 + [1.0] * 4, dtype=np.float32)
    got = ref.astype(np.float16)  # a real cast: 1e-9 is below half fp16's smallest subnormal
    zeros = lambda a: int(np.count_nonzero(a == 0))  # noqa: E731
    smallest = float(np.abs(ref[ref != 0]).min())
    assert flushed_by_underflow(zeros(ref), zeros(got), smallest, FORMATS["fp16"]) == 4
    # a difference that cancels exactly in bf16 is a zero, not an underflow: 1 + 2^-10 rounds to 1 there
    a = np.array([1.0, 1.0 + 2.0 ** -10], dtype=np.float32)
    ref = a - np.float32(1.0)
    got = a.astype(ml_dtypes.bfloat16) - ml_dtypes.bfloat16(1.0)
    assert zeros(got) == 2 and zeros(ref) == 1
    assert flushed_by_underflow(zeros(ref), zeros(got), float(ref[1]), FORMATS["bf16"]) == 0


@pytest.mark.slow
def test_the_fixes_listing_and_the_card_leave_out_the_same_fix_whose_format_cannot_hold_the_value(store):
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    register_recipe(Recipe("test-pad-attention", "finfo(float32).min mask in fp16", lambda: (PadAttention(), x),
                           get_policy("fp16")), replace=True)
    name = capture_recipe(store, "test-pad-attention")
    card = next(d for d in diagnose(store, name) if d.rule != "compiled")
    listed = {r.fix: r for r in applicable_fixes(store, name)}
    bf16 = listed["use-bf16"]
    assert not bf16.applies and "beyond bf16's range" in bf16.reason
    assert "use-bf16" not in card.fixes and "not offered: use-bf16" in card.message
    # the value at stake is finfo(float32).min, which a real bf16 cast cannot hold
    assert torch.tensor(torch.finfo(torch.float32).min).to(torch.bfloat16).item() == -math.inf
    # the fixes the card offers are listed as applying (an island on the softmax's module, if offered)
    assert all(listed[f].applies for f in card.fixes if f in listed)
    loss = next(r for f, r in listed.items() if f.startswith("loss-scale"))
    assert not loss.applies and "no backward pass" in loss.reason
    assert not listed["skip-nonfinite-step"].applies and "no optimizer" in listed["skip-nonfinite-step"].reason

"""Loss scaling as a fix: gradients flushed to zero in fp16 come back under a loss scale (numerically, against the
fp32 gradients), a gradient overflow goes away under a dynamic scale, and verify judges both by their effect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision_lab.fixes.catalogue import apply_fixes, parse_fix
from precision_lab.fixes.policy import PolicyError, PrecisionPolicy, get_policy
from precision_lab.fixes.recipes import Recipe, register_recipe
from precision_lab.formats import FORMATS
from precision_lab.services.applicable import applicable_fixes
from precision_lab.services.diagnose import diagnose
from precision_lab.services.rerun import capture_recipe, rerun_session
from precision_lab.services.verify import judge_fix, verify_session
from precision_lab.store import queries as q

from test_mechanisms import LC, TinyGrad, _tiny_loss

X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return 10.0 * math.log10(float((ref ** 2).sum()) / float(((ref - got) ** 2).sum()))


def _grads(scale):
    """TinyGrad's a.weight gradient: fp32, and fp16 under ``scale`` (None: none) unscaled in fp32, by hand."""
    torch.manual_seed(0)
    ref = TinyGrad()
    _tiny_loss(ref(X)).backward()
    torch.manual_seed(0)
    half = TinyGrad().half()
    loss = _tiny_loss(half(X.half()))
    (loss if scale is None else loss * scale).backward()
    g = half.a.weight.grad.float() / (1.0 if scale is None else scale)
    return ref.a.weight.grad.numpy(), g.numpy()


def _param_grad_sqnr(store, run_id: str, op: str, index: str) -> float:
    return store.sql("""SELECT c.sqnr_db FROM comparisons c JOIN tensors t ON t.rid = c.cand_rid
                        WHERE c.cand_run_id = ? AND c.kind = 'accumulated' AND c.role = 'param_grad'
                        AND t.op = ? AND t."index" = ?""", [run_id, op, index]).fetchone()[0]


@pytest.mark.slow
def test_a_loss_scale_brings_back_gradients_fp16_flushes_to_zero(store):
    ref, flushed = _grads(None)
    assert not np.any(flushed) and np.all(ref)  # independently: every a.weight gradient is 0 in fp16
    register_recipe(Recipe("test-tiny-grad", "fp16 gradients below the smallest subnormal",
                           lambda: (TinyGrad(), X), get_policy("fp16"), loss_fn=_tiny_loss), replace=True)
    name = capture_recipe(store, "test-tiny-grad")
    d = next(d for d in diagnose(store, name) if d.rule == "gradient-underflow")
    static = next(f for f in d.fixes if f.startswith("loss-scale:"))
    scale = parse_fix(static).value
    assert math.log2(scale).is_integer() and "dynamic-loss-scale" in d.fixes
    verdicts = {r.label: r for r in verify_session(store, name, top=3)}
    rows = {label: r.result for label, r in verdicts.items()}
    for fix in (static, "dynamic-loss-scale"):
        assert rows[fix].works, rows[fix]
        assert rows[fix].sqnr_db == rows[fix].parent_sqnr_db  # the output is the same: the gradients differ
        assert "parameter gradients' worst SQNR" in rows[fix].why
        assert rows[fix].grad_sqnr_db > rows[fix].parent_grad_sqnr_db + 20
    # the re-run's a.weight gradient is the one a hand-made fp16 backward under that scale gives, against fp32
    _, by_hand = _grads(scale)
    want = _sqnr(ref, by_hand)
    assert want > 30
    got = _param_grad_sqnr(store, rows[static].run_id, "a.backward.0", "weight")
    assert abs(got - want) < 0.05
    parent = _param_grad_sqnr(store, verdicts[static].parent, "a.backward.0", "weight")
    assert abs(parent - _sqnr(ref, flushed)) < 0.05  # 0 dB: all zeros
    zeros = store.sql("""SELECT zero_count FROM tensors WHERE run_id = ? AND role = 'param_grad'
                         AND op = 'a.backward.0' AND "index" = 'weight'""", [rows[static].run_id]).fetchone()[0]
    assert zeros == int(np.count_nonzero(by_hand == 0))


@pytest.mark.slow
def test_a_dynamic_loss_scale_backs_off_until_the_gradients_are_finite(store):
    register_recipe(Recipe("test-grad-overflow", "fp16 grad_input past 65504 under a loss scale of 64",
                           lambda: (LC._with(LC.BackwardOverflow, LC._bo_edit)(), X.repeat(1, 2).abs()),
                           get_policy("fp16"), loss_fn=LC._scaled_sum), replace=True)
    name = capture_recipe(store, "test-grad-overflow")
    cand = next(r for r in q.session_runs(store, store.session(name).session_id) if r.kind == "candidate")
    assert q.worst_gradient_sqnr(store, cand.run_id) == -math.inf  # an inf gradient would reach the optimizer
    run_id = rerun_session(store, name, "dynamic-loss-scale")
    grads = store.sql("""SELECT count(*), sum(nan_count + inf_count), min(dtype) FROM tensors WHERE run_id = ?
                         AND role = 'param_grad'""", [run_id]).fetchone()
    assert grads[0] >= 6 and grads[1] == 0 and grads[2] == "float32"  # finite, unscaled into fp32
    # independently: Adam on fp32 master weights stays finite with these gradients and turns NaN on the inf one
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([math.inf, 1.0])
    torch.optim.Adam([p], lr=1e-3).step()
    assert math.isnan(float(p.detach()[0]))
    assert q.worst_gradient_sqnr(store, run_id) > 20


def test_loss_scale_fixes_edit_the_policy_and_judge_by_gradients():
    p = apply_fixes(get_policy("fp16"), "loss-scale:1024")
    assert p.loss_scale == 1024 and "loss scale 1024" in p.describe()
    assert PrecisionPolicy.from_json(p.to_json()).loss_scale == 1024
    assert apply_fixes(get_policy("fp16"), "dynamic-loss-scale").loss_scale == "dynamic"
    for bad in (0.0, -1.0, math.inf, "often"):
        try:
            PrecisionPolicy(dtype="fp16", loss_scale=bad)
        except PolicyError as e:
            assert "loss scale" in str(e)
        else:
            raise AssertionError(bad)
    assert FORMATS["fp16"].smallest_subnormal * 1024 < FORMATS["fp16"].max
    works, why = judge_fix(None, 62.6, None, 62.6, 45.0, 0.0)
    assert works and why == "parameter gradients' worst SQNR 0.0 dB -> 45.0 dB"
    works, why = judge_fix(None, 62.6, None, 62.6, 0.2, 0.0)
    assert not works and "changes nothing the output shows" in why


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-4)


@pytest.mark.slow
def test_skipping_a_step_with_an_inf_gradient_keeps_adam_and_the_weights_finite(store):
    x = X.repeat(1, 2).abs()
    build = LC._with(LC.BackwardOverflow, LC._bo_edit)
    register_recipe(Recipe("test-adam-inf", "an inf gradient that Adam turns into NaN weights",
                           lambda: (build(), x), get_policy("fp16"), loss_fn=LC._scaled_sum, optimizer_fn=_adam,
                           steps=2), replace=True)
    name = capture_recipe(store, "test-adam-inf")
    card = next(d for d in diagnose(store, name) if d.rule == "optimizer-nonfinite")
    assert card.fixes[0] == "skip-nonfinite-step" and "from step 1 on" in card.message
    listed = {r.fix: r for r in applicable_fixes(store, name)}
    assert listed["skip-nonfinite-step"].applies and listed["dynamic-loss-scale"].applies
    rows = {r.label: r.result for r in verify_session(store, name, top=4)}
    skip = rows["skip-nonfinite-step"]
    assert skip.works and "no longer reaches the weights" in skip.why, skip
    states = store.sql("""SELECT count(*), sum(CASE WHEN nonfinite THEN 1 ELSE 0 END) FROM tensors
                          WHERE run_id = ? AND role = 'param' AND step = 1""", [skip.run_id]).fetchone()
    assert states[0] >= 6 and states[1] == 0
    # independently: the fp16 model's step-0 gradient is inf; Adam on it makes NaN weights, a skipped step none
    half = build().half()
    LC._scaled_sum(half(x.half())).backward()
    assert not all(bool(torch.isfinite(p.grad).all()) for p in half.parameters())
    opt = _adam(list(half.parameters()))
    before = [p.detach().clone() for p in half.parameters()]
    opt.step()
    assert any(bool(torch.isnan(p).any()) for p in half.parameters())
    # the skipped step leaves the weights as they were: the re-run's step-1 parameters are the step-0 ones
    same = store.sql("""SELECT count(*) FROM tensors a JOIN tensors b ON a.run_id = b.run_id AND a.op = b.op
                        AND a."index" = b."index" AND a.role = b.role WHERE a.run_id = ? AND a.role = 'param'
                        AND a.step = 0 AND b.step = 1 AND a.absmax = b.absmax AND a.l2norm = b.l2norm""",
                     [skip.run_id]).fetchone()[0]
    assert same == states[0] and float(before[2].abs().max()) == 3000.0

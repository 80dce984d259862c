"""Live capture: what is recorded, with which numbers, and that the user's step is untouched."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_lab
from precision_lab import capture
from precision_lab.live import CaptureOptions
from precision_lab.live.recorder import Capture
from precision_lab.store import Store
from precision_lab.stats import HIST_EDGES, N_BINS, tensor_stats


# ---- a small pre-LN transformer (also used by the other capture tests) -------------------------

class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.last_scores = self.last_probs = None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        # softmax statistics in fp32, result back in the compute dtype: two casts
        probs = F.softmax(scores.float(), dim=-1).to(x.dtype)
        self.last_scores, self.last_probs = scores.detach(), probs.detach()
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, hidden: int = 32, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, heads, hidden) for _ in range(n_blocks)])
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln(x)


def build_tiny(overflow_scale: float = 1.0):
    """A fresh fp32 TinyTransformer; ``overflow_scale`` scales blocks.1.fc1 (fp16 overflow above ~1e5)."""
    m = TinyTransformer()
    with torch.no_grad():
        m.blocks[1].fc1.weight.mul_(overflow_scale)
    return m


def tiny_input(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 16, generator=g)


def loss_fn(y):
    return y.float().pow(2).mean()


# ---- an independent float64 summary --------------------------------------------------------------

def np_stats(t) -> dict:
    a = t.detach().cpu().double().numpy().ravel() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64).ravel()
    fin = np.isfinite(a)
    f = a[fin]
    nz = np.abs(f[f != 0])
    hist = np.bincount(np.searchsorted(HIST_EDGES, nz, side="right") - 1, minlength=N_BINS)
    return {
        "numel": a.size, "nan_count": int(np.isnan(a).sum()), "inf_count": int(np.isinf(a).sum()),
        "zero_count": int((a == 0).sum()),
        "min": f.min() if f.size else math.nan, "max": f.max() if f.size else math.nan,
        "absmax": np.abs(f).max() if f.size else math.nan, "min_abs_nonzero": nz.min() if nz.size else math.nan,
        "mean": f.mean() if f.size else math.nan, "std": f.std() if f.size else math.nan,
        "l2norm": math.sqrt(float(np.sum(f * f))) if f.size else math.nan, "hist": hist,
    }


def assert_stats_match(stats, t, *, hist=True):
    exp = np_stats(t)
    assert stats.numel == exp["numel"]
    for k in ("nan_count", "inf_count", "zero_count"):
        assert getattr(stats, k) == exp[k], k
    for k in ("min", "max", "absmax", "min_abs_nonzero"):
        a, b = getattr(stats, k), exp[k]
        assert (math.isnan(a) and math.isnan(b)) or a == b, (k, a, b)
    for k in ("mean", "std", "l2norm"):
        a, b = getattr(stats, k), exp[k]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), (k, a, b)
    if hist:
        np.testing.assert_array_equal(stats.hist, exp["hist"])


def run_step(model, x, backward=True):
    model.zero_grad(set_to_none=True)
    y = model(x)
    if backward:
        loss_fn(y).backward()
    return y


def by_name(records, direction="forward"):
    return {r.name: r for r in records if r.direction == direction}


# ---- what is recorded -------------------------------------------------------------------------

def test_every_called_module_and_functional_op_is_recorded(store):
    torch.manual_seed(0)
    model = build_tiny()
    called = []
    handles = [m.register_forward_hook(lambda m, i, o, p=p: called.append(p)) for p, m in model.named_modules()]
    with capture(model, run="fp32", store=store) as cap:
        run_step(model, tiny_input())
    for h in handles:
        h.remove()
    ops = {r.op for r in cap.records if r.direction == "forward"}
    for path in set(called):
        op = f"{path}.forward.0" if path else "forward.0"
        roles = {r.role for r in cap.records if r.op == op and r.direction == "forward"}
        assert {"input", "output"} <= roles, (op, roles)
    for b in (0, 1):
        p = f"blocks.{b}"
        expected = {
            f"{p}.ln1.layer_norm.0", f"{p}.attn.qkv.linear.0", f"{p}.attn.matmul.0", f"{p}.attn.div.0",
            f"{p}.attn.float.0", f"{p}.attn.softmax.0", f"{p}.attn.to.0", f"{p}.attn.matmul.1",
            f"{p}.attn.proj.linear.0", f"{p}.add.0", f"{p}.ln2.layer_norm.0", f"{p}.fc1.linear.0",
            f"{p}.gelu.0", f"{p}.fc2.linear.0", f"{p}.add.1",
        }
        assert expected <= ops, expected - ops
    # view-like ops are not recorded by default; parameters are, once per module
    assert not any(".transpose." in o or ".split." in o or ".view." in o for o in ops)
    params = [r for r in cap.records if r.role == "param"]
    assert sorted((r.op, r.index) for r in params) == sorted(
        (f"{p}.forward.0" if p else "forward.0", n.rsplit(".", 1)[-1])
        for p, m in model.named_modules() for n, _ in m.named_parameters(recurse=False))
    # backward: every op whose output needs grad gets grad_output, parameters get param_grad
    bw = {(r.op, r.role) for r in cap.records if r.direction == "backward"}
    assert ("blocks.1.fc2.linear.0.backward", "grad_output") in bw
    assert ("blocks.1.fc2.linear.0.backward", "grad_input") in bw
    assert ("blocks.0.fc1.backward.0", "grad_output") in bw
    assert ("blocks.0.fc1.backward.0", "param_grad") in bw
    # the session is in the store, one run, every record
    info = store.session(cap.session)
    runs = store.runs(info.session_id)
    assert len(runs) == 1 and runs.iloc[0]["run_id"] == cap.run_id and runs.iloc[0]["kind"] == "reference"
    n = store.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [cap.run_id]).fetchone()[0]
    assert n == len(cap.records)


def test_seq_is_execution_order_inner_ops_first():
    torch.manual_seed(0)
    model = build_tiny()
    with capture(model, run="r", store=":memory:") as cap:
        run_step(model, tiny_input())
    seq = {r.op: r.seq for r in cap.records if r.direction == "forward"}
    # an op nested in a module finishes before the module does
    assert seq["blocks.0.fc1.linear.0"] < seq["blocks.0.fc1.forward.0"] < seq["blocks.0.gelu.0"]
    assert seq["blocks.0.attn.softmax.0"] < seq["blocks.0.attn.forward.0"] < seq["blocks.0.add.0"]
    assert seq["blocks.1.forward.0"] < seq["ln.layer_norm.0"] < seq["forward.0"]
    # inputs and outputs of one op share its seq; backward comes after forward
    for op in ("blocks.0.fc1.linear.0", "blocks.0.fc1.forward.0"):
        assert len({r.seq for r in cap.records if r.op == op and r.direction == "forward"}) == 1
    fwd_max = max(r.seq for r in cap.records if r.direction == "forward")
    assert min(r.seq for r in cap.records if r.direction == "backward") > fwd_max


def test_statistics_equal_an_independent_float64_computation():
    torch.manual_seed(0)
    model = build_tiny().half()
    x = tiny_input().half()
    with capture(model, run="fp16", store=":memory:", options=CaptureOptions(keep_tensors=("*",))) as cap:
        y = run_step(model, x)
    assert len(cap.records) > 100
    for rec in cap.records:
        assert rec.tensor is not None, rec.name
        assert_stats_match(rec.stats, rec.tensor)
        assert rec.stats.dtype == str(rec.tensor.dtype).replace("torch.", "")
    recs = by_name(cap.records)
    # the kept tensors are the real ones
    assert torch.equal(recs["forward.0.output.0"].tensor, y)
    assert torch.equal(recs["blocks.0.attn.softmax.0.output.0"].tensor.to(torch.float16),
                       model.blocks[0].attn.last_probs)
    grads = by_name(cap.records, "backward")
    w = model.blocks[0].fc1.weight
    assert torch.equal(grads["blocks.0.fc1.backward.0.param_grad.weight"].tensor, w.grad)


def test_moments_only_and_no_histogram():
    torch.manual_seed(0)
    model = build_tiny()
    x = tiny_input()
    with capture(model, run="m", store=":memory:",
                 options=CaptureOptions(moments_only=True, keep_tensors=("*",))) as cap:
        run_step(model, x)
    assert cap.records and all(r.stats.hist is None for r in cap.records)
    for rec in cap.records[:40]:
        assert_stats_match(rec.stats, rec.tensor, hist=False)


# ---- results untouched ----------------------------------------------------------------------------

def _outputs_and_grads(model, x, capture_kwargs=None):
    torch.manual_seed(123)
    if capture_kwargs is None:
        y = run_step(model, x)
    else:
        with capture(model, store=":memory:", **capture_kwargs):
            torch.manual_seed(123)
            y = run_step(model, x)
    return y.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), 0.2, training=True)
        return self.fc2(self.drop(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("local_error", [False, True])
def test_outputs_bit_identical_with_and_without_capture(dtype, local_error):
    torch.manual_seed(0)
    model = build_tiny().to(dtype)
    x = tiny_input().to(dtype)
    y0, g0 = _outputs_and_grads(model, x)
    y1, g1 = _outputs_and_grads(model, x, {"run": "c", "options": CaptureOptions(local_error=local_error)})
    assert torch.equal(y0, y1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    # random ops (dropout) draw the same numbers even though local error re-runs them
    torch.manual_seed(0)
    net = DropoutNet().to(dtype).train()
    y0, g0 = _outputs_and_grads(net, x)
    y1, g1 = _outputs_and_grads(net, x, {"run": "d", "options": CaptureOptions(local_error=local_error)})
    assert torch.equal(y0, y1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_hook_errors_are_recorded_and_never_break_the_step(store, monkeypatch):
    torch.manual_seed(0)
    model = build_tiny()
    x = tiny_input()
    y0, g0 = _outputs_and_grads(model, x)
    from precision_lab.live import engine

    real = engine.StatsEngine.measure
    calls = {"n": 0}

    def flaky(self, t, where, **kw):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("synthetic failure in statistics")
        return real(self, t, where, **kw)

    monkeypatch.setattr(engine.StatsEngine, "measure", flaky)
    with capture(model, run="flaky", store=store) as cap:
        torch.manual_seed(123)
        y1 = run_step(model, x)
    assert torch.equal(y0, y1)
    assert all(torch.equal(g0[n], p.grad) for n, p in model.named_parameters())
    assert any("synthetic failure in statistics" in m for _, m in cap.warnings)
    assert cap.records  # what could be measured was
    msgs = store.df("SELECT message FROM warnings WHERE run_id = ?", [cap.run_id])["message"].tolist()
    assert any("synthetic failure" in m and "the step ran unchanged" in m for m in msgs)


def _no_hooks_left(model) -> bool:
    for m in model.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return False
    for p in model.parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            return False
    return torch._C._len_torch_function_stack() == 0


def test_hooks_removed_on_exit_and_when_user_code_raises(store):
    torch.manual_seed(0)
    model = build_tiny()
    with capture(model, run="ok", store=store):
        run_step(model, tiny_input())
    assert _no_hooks_left(model)
    with pytest.raises(ZeroDivisionError):
        with capture(model, run="boom", store=store) as cap:
            run_step(model, tiny_input())
            1 / 0
    assert _no_hooks_left(model)
    # what was captured before the error is written, with a warning that says so
    assert cap.records and cap.session is not None
    msgs = store.df("SELECT message FROM warnings WHERE run_id = ?", [cap.run_id])["message"].tolist()
    assert any("ZeroDivisionError" in m for m in msgs)
    # an exception inside the model's forward also leaves no hooks behind
    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).sum() / torch.tensor(1.0) + self.missing  # AttributeError in forward

    r = Raises()
    with pytest.raises(AttributeError):
        with capture(r, run="raises", store=store):
            r(torch.ones(2, 4))
    assert _no_hooks_left(r)


# ---- unusual tensors ------------------------------------------------------------------------------

class Unusual(nn.Module):
    def forward(self, x):
        i = (x * 10).to(torch.int32) + 1
        b = x > 0
        c = torch.complex(x, x) * 2
        f8 = x.to(torch.float8_e4m3fn)
        back = f8.to(torch.float32) * 1.0
        sp = (x * (x > 0.5)).to_sparse()
        sp2 = sp * 2.0
        meta = torch.empty(3, device="meta") + 1
        return i, b, c, back, sp2, meta


def test_unusual_dtypes_are_recorded_or_skipped_with_a_reason():
    x = torch.tensor([[0.25, -1.5, 3.0, 0.0], [1.0, 0.75, -0.125, 400.0]])
    m = Unusual()
    with capture(m, run="u", store=":memory:", options=CaptureOptions(keep_tensors=("*",))) as cap:
        out = m(x)
    recs = by_name(cap.records)
    # integer, bool and fp8 tensors are recorded with exact statistics
    assert_stats_match(recs["add.0.output.0"].stats, out[0])
    assert recs["add.0.output.0"].stats.dtype == "int32"
    assert_stats_match(recs["gt.0.output.0"].stats, out[1])
    f8 = recs["to.1.output.0"]
    assert f8.stats.dtype == "float8_e4m3fn"
    assert_stats_match(f8.stats, x.to(torch.float8_e4m3fn).float())
    # sparse tensors are summarised without densifying (implicit zeros counted)
    sp = recs["mul.3.output.0"]
    assert sp.stats.numel == 8 and sp.stats.zero_count == int((out[4].to_dense() == 0).sum())
    # complex and meta tensors are skipped, each with a reason
    text = " | ".join(m for _, m in cap.warnings)
    assert "complex tensor" in text and "meta tensor" in text
    assert not any(r.stats.dtype.startswith("complex") for r in cap.records)
    assert torch.equal(out[3], x.to(torch.float8_e4m3fn).float())


# ---- casts, in-place ops, names ---------------------------------------------------------------------

class InPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        y[0] = -7.0
        z = F.relu(y, inplace=True)
        return z.half().float()


def test_inplace_ops_see_values_before_and_after():
    x = torch.tensor([[1.0, -3.0], [2.0, -0.5]])
    m = InPlace()
    with capture(m, run="ip", store=":memory:", options=CaptureOptions(keep_tensors=("*",))) as cap:
        m(x)
    recs = by_name(cap.records)
    y = x * 2
    assert_stats_match(recs["add_.0.input.0"].stats, y)
    assert_stats_match(recs["add_.0.output.0"].stats, y + 1)
    y1 = y + 1
    y1[0] = -7.0
    assert_stats_match(recs["setitem.0.output.0"].stats, y1)
    assert_stats_match(recs["relu.0.input.0"].stats, y1)
    assert_stats_match(recs["relu.0.output.0"].stats, torch.relu(y1))
    # casts are recorded, not dropped
    assert recs["half.0.output.0"].stats.dtype == "float16"
    assert recs["float.0.input.0"].stats.dtype == "float16"


def test_names_line_up_across_fp32_and_fp16_runs():
    torch.manual_seed(0)
    a = build_tiny()
    b = build_tiny().half()
    with capture(a, run="a", store=":memory:") as ca:
        run_step(a, tiny_input())
    with capture(b, run="b", store=":memory:") as cb:
        run_step(b, tiny_input().half())
    names_a = [(r.direction, r.name) for r in ca.records]
    names_b = [(r.direction, r.name) for r in cb.records]
    assert sorted(names_a) == sorted(names_b)
    assert len(set(names_a)) == len(names_a)  # unique within a run


# ---- options ----------------------------------------------------------------------------------------

def test_steps_every_n_and_list():
    torch.manual_seed(0)
    model = build_tiny()
    with capture(model, run="s", store=":memory:", options=CaptureOptions(steps=2, backward=False)) as cap:
        for _ in range(5):
            run_step(model, tiny_input(), backward=False)
            cap.step()
    assert sorted({r.step for r in cap.records}) == [0, 2, 4]
    per_step = [sorted(r.name for r in cap.records if r.step == s) for s in (0, 2, 4)]
    assert per_step[0] == per_step[1] == per_step[2]  # counters restart every step
    with capture(model, run="s2", store=":memory:", options=CaptureOptions(steps=(1, 3), backward=False)) as cap:
        for _ in range(4):
            run_step(model, tiny_input(), backward=False)
            cap.step()
    assert sorted({r.step for r in cap.records}) == [1, 3]


def test_include_exclude_and_op_type_filters():
    torch.manual_seed(0)
    model = build_tiny()
    opts = CaptureOptions(include=("blocks.1*",), exclude=("blocks.1.attn*",), backward=False)
    with capture(model, run="f", store=":memory:", options=opts) as cap:
        run_step(model, tiny_input(), backward=False)
    ops = {r.op for r in cap.records}
    assert ops and all(o.startswith("blocks.1") for o in ops)
    assert not any(o.startswith("blocks.1.attn") for o in ops)
    assert "blocks.1.fc1.linear.0" in ops and "blocks.1.forward.0" in ops
    opts = CaptureOptions(op_types=("softmax", "Linear"), backward=False)
    with capture(model, run="g", store=":memory:", options=opts) as cap:
        run_step(model, tiny_input(), backward=False)
    assert {r.op_type for r in cap.records} == {"softmax", "Linear"}
    opts = CaptureOptions(functional=False, params=False, backward=False)
    with capture(model, run="h", store=":memory:", options=opts) as cap:
        run_step(model, tiny_input(), backward=False)
    assert all(".forward." in r.op or r.op == "forward.0" for r in cap.records)
    opts = CaptureOptions(views=True, backward=False)
    with capture(model, run="v", store=":memory:", options=opts) as cap:
        run_step(model, tiny_input(), backward=False)
    assert "blocks.0.attn.transpose.0" in {r.op for r in cap.records}


def test_options_validate():
    assert precision_lab.capture is capture  # the package's lazy export
    with pytest.raises(ValueError, match="every-N must be >= 1"):
        CaptureOptions(steps=0)
    with pytest.raises(ValueError, match="step numbers must be >= 0"):
        CaptureOptions(steps=[-1])
    with pytest.raises(TypeError, match="patterns must be strings"):
        CaptureOptions(include=(3,))
    assert CaptureOptions(include="blocks.*").include == ("blocks.*",)
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        capture(lambda x: x)
    with pytest.raises(ValueError, match="fp8 weights"):
        capture(nn.Linear(2, 2), dtype_policy=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="no prepare_inputs"):
        capture(nn.Linear(2, 2), dtype_policy=type("P", (), {"prepare": lambda self, m: m})())
    with pytest.raises(ValueError, match="either store= .* or shard_dir="):
        capture(nn.Linear(2, 2), store=":memory:", shard_dir="/tmp/x")


class ToyPolicy:
    """The duck-typed policy protocol: prepare(model), prepare_inputs(inputs)."""

    def __init__(self):
        self.prepared = False

    def prepare(self, model):
        self.prepared = True
        return nn.Sequential(model).to(torch.bfloat16)

    def prepare_inputs(self, inputs):
        return inputs.to(torch.bfloat16)


def test_dtype_policy_torch_dtype_and_duck_typed(store):
    torch.manual_seed(0)
    model = build_tiny()
    with capture(model, run="bf16", store=store, dtype_policy=torch.bfloat16) as cap:
        y = cap.model(cap.prepare_inputs(tiny_input()))
    assert y.dtype == torch.bfloat16 and cap.dominant_dtype() == "bfloat16"
    run = store.run(cap.run_id)
    # a bare dtype is recorded as the precision policy of that format, which re-runs and diagnosis read back
    from precision_lab.fixes.policy import PrecisionPolicy
    from precision_lab.services.sessions import run_policy

    assert run.kind == "candidate" and run_policy(run) == PrecisionPolicy("bfloat16", "bf16")
    pol = ToyPolicy()
    with capture(build_tiny(), run="toy", store=store, dtype_policy=pol) as cap:
        cap.model(cap.prepare_inputs(tiny_input()))
    assert pol.prepared and "0.blocks.0.fc1.linear.0" in {r.op for r in cap.records}


def test_a_capture_under_a_policy_leaves_the_users_model_as_it_found_it(store):
    """``capture(model, dtype_policy=torch.float16)`` casts the model while it records (cast hooks, fp16 tensors, an
    eps floor, a training step that updates the fp16 copy); afterwards the model is the user's again: the same
    parameter objects with their fp32 values, no hook, no attribute, its mode and its own eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-12), nn.Linear(8, 2)).train()
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    before = {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks), sorted(vars(m))) for n, m in model.named_modules()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture(model, run="fp16", store=store, dtype_policy=torch.float16) as cap:
        assert model[0].weight.dtype == torch.float16 and model[0]._forward_pre_hooks
        out = model(cap.prepare_inputs(torch.randn(4, 8)))
        out.float().pow(2).mean().backward()
        opt.step()
    assert cap.records and out.dtype == torch.float16
    for n, p in model.named_parameters():
        same, value = params[n]
        assert p is same and p.dtype == torch.float32 and torch.equal(p.detach(), value), n
    after = {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks), sorted(vars(m))) for n, m in model.named_modules()}
    assert after == before and model.training and model[1].eps == 1e-12
    assert model(torch.randn(4, 8)).dtype == torch.float32


def test_session_extension_and_store_path(tmp_path, store):
    torch.manual_seed(0)
    model = build_tiny()
    with capture(model, run="first", store=store) as c1:
        run_step(model, tiny_input())
    with capture(model, run="second", store=store, session=c1.session) as c2:
        run_step(model, tiny_input())
    assert c2.session == c1.session
    assert len(store.runs(store.session(c1.session).session_id)) == 2
    from precision_lab.store import SessionNotFound

    with pytest.raises(SessionNotFound):
        with capture(model, run="third", store=store, session="no-such-session"):
            run_step(model, tiny_input())
    assert len(store.sessions()) == 1  # nothing half-written
    # None: the default database ($PRECISION_LAB_DB in tests)
    with capture(model, run="default-db") as c3:
        run_step(model, tiny_input(), backward=False)
    from precision_lab.store import Store

    assert Store().session(c3.session).name == "default-db"


@pytest.mark.slow
def test_memory_holds_no_activations():
    torch.manual_seed(0)
    model = build_tiny()
    refs = []

    def keep_ref(m, i, o):
        refs.append(weakref.ref(o))

    h = model.blocks[0].fc1.register_forward_hook(keep_ref)
    with capture(model, run="mem", store=":memory:") as cap:
        for _ in range(3):
            with torch.no_grad():
                model(tiny_input())
            cap.step()
            gc.collect()
            assert refs and all(r() is None for r in refs), "capture keeps activations alive"
    h.remove()
    assert all(r.tensor is None for r in cap.records)


# ---- first non-finite producer ----------------------------------------------------------------------

def test_first_nonfinite_producer_with_injected_overflow(store):
    from precision_lab.services.report import first_nonfinite

    torch.manual_seed(0)
    model = build_tiny(overflow_scale=2e5).half()
    x = tiny_input().half()
    # independently: blocks.1.ln2's output is finite, blocks.1.fc1's is not
    seen = {}
    hs = [model.blocks[1].ln2.register_forward_hook(lambda m, i, o: seen.__setitem__("ln2", o)),
          model.blocks[1].fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1", o))]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    assert torch.isfinite(seen["ln2"]).all() and not torch.isfinite(seen["fc1"]).all()
    with capture(model, run="fp16", store=store) as cap:
        run_step(model, x)
    hit = first_nonfinite(store, cap.run_id)
    assert hit is not None and hit.producer
    assert hit.op == "blocks.1.fc1.linear.0" and hit.role == "output" and hit.rank == 0


# ---- CUDA (real device path, skipped without a GPU) ----------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capture_has_no_host_sync_per_op_and_matches_cpu():
    torch.manual_seed(0)
    model = build_tiny().cuda()
    x = tiny_input().cuda()
    with capture(model, run="cuda", store=":memory:", options=CaptureOptions(keep_tensors=("*",))) as cap:
        run_step(model, x)  # warm-up step: caches and lazy initialisation
        cap.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_step(model, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        cap.step()
    # a sync inside a hook raises there and would be swallowed into a warning: there must be none
    assert not cap.warnings, cap.warnings
    recs = [r for r in cap.records if r.step == 1]
    assert len(recs) > 100
    for r in recs:
        assert_stats_match(r.stats, r.tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_long_run_summary_steps_have_no_host_sync_per_op():
    """A summary step of a long run on the GPU: statistics and the histogram stay on the device until the step
    ends (one transfer); the counts match the CPU kernel on the same values."""
    torch.manual_seed(0)
    model = build_tiny().cuda()
    x = tiny_input().cuda()
    seen = {}
    with capture(model, run="cuda-long", store=":memory:", options=CaptureOptions(every=10)) as cap:
        run_step(model, x)  # step 0: full records, warm-up
        cap.step()
        # kept on the device: a copy to the host inside the window would be the test's own sync
        h = model.blocks[0].register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.detach().clone()))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_step(model, x)  # step 1: a summary step
        finally:
            torch.cuda.set_sync_debug_mode(0)
            h.remove()
        cap.step()
    assert not cap.warnings, cap.warnings
    row = next(r for r in cap.timeline_rows if r.step == 1 and r.op == "blocks.0.forward.0" and r.role == "output")
    want = tensor_stats(seen["out"].cpu())
    assert row.absmax == want.absmax and row.nan_count == want.nan_count and row.numel == want.numel
    shares = {s.fmt: s for s in cap.timeline_shares if s.tid == row.tid}
    for fmt in ("fp16", "fp8_e4m3fn"):
        r = want.representability(fmt)
        assert (shares[fmt].overflow, shares[fmt].underflow, shares[fmt].subnormal) == \
            (r.overflow, r.underflow, r.subnormal)


# ---- backward values --------------------------------------------------------------------------------

class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 5)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h) + h * 3.0  # h feeds two ops: each gets its own grad_input


def test_backward_gradients_equal_autograd():
    torch.manual_seed(0)
    m = Residual()
    x = torch.randn(4, 6)
    # independent: autograd on a plain run
    h = m.fc1(x)
    h.retain_grad()
    a = m.fc2(h)
    a.retain_grad()
    out = a + h * 3.0
    out.retain_grad()
    (out * out).sum().backward()
    exp = {"out": out.grad.clone(), "h": h.grad.clone(), "via_fc2": out.grad @ m.fc2.weight,
           "via_mul": out.grad * 3.0, "w1": m.fc1.weight.grad.clone(), "w2": m.fc2.weight.grad.clone()}
    m.zero_grad(set_to_none=True)
    with capture(m, run="bw", store=":memory:", options=CaptureOptions(keep_tensors=("*",))) as cap:
        y = m(x)
        (y * y).sum().backward()
    g = by_name(cap.records, "backward")
    close = lambda name, t: torch.testing.assert_close(g[name].tensor, t, rtol=1e-6, atol=1e-7)  # noqa: E731
    close("fc2.backward.0.grad_output.0", exp["out"])
    close("fc2.backward.0.grad_input.0", exp["via_fc2"])
    close("mul.0.backward.grad_output.0", exp["out"])
    close("mul.0.backward.grad_input.0", exp["via_mul"])
    close("fc1.backward.0.grad_output.0", exp["h"])  # the sum of both contributions
    close("fc1.backward.0.param_grad.weight", exp["w1"])
    close("fc2.backward.0.param_grad.weight", exp["w2"])
    # a parameter's gradient is recorded once, as param_grad, not again as F.linear's grad_input 1
    assert "fc2.linear.0.backward.grad_input.1" not in g and "fc2.linear.0.backward.grad_input.0" in g
    for rec in cap.records:
        assert_stats_match(rec.stats, rec.tensor)
    # a backward op's records share one seq, given when its gradient arrived
    bw = [r for r in cap.records if r.op == "fc2.backward.0"]
    assert len({r.seq for r in bw if r.role != "param_grad"}) == 1
    assert torch.equal(m.fc1.weight.grad, exp["w1"])
    # without parameter records, F.linear's weight input gets its gradient as grad_input
    m.zero_grad(set_to_none=True)
    with capture(m, run="bw2", store=":memory:",
                 options=CaptureOptions(keep_tensors=("*",), params=False)) as cap:
        y = m(x)
        (y * y).sum().backward()
    g = by_name(cap.records, "backward")
    close("fc2.linear.0.backward.grad_input.1", exp["w2"])
    close("fc1.linear.0.backward.grad_input.2", m.fc1.bias.grad)
    assert not any(r.role in ("param", "param_grad") for r in cap.records)


def test_deferred_device_path_on_cpu_matches():
    """The CUDA bookkeeping (device-side results, one transfer per step) run on CPU tensors."""
    torch.manual_seed(0)
    model = build_tiny().half()
    x = tiny_input().half()
    cap = Capture(model, run="deferred", store=Store(":memory:"), options=CaptureOptions(keep_tensors=("*",)))
    cap._engine.deferred_cpu = True
    with cap:
        for _ in range(2):
            run_step(model, x)
            assert all(item[-1].stats is None for item in cap._pending)  # nothing on the host until the step ends
            cap.step()
    assert len({r.step for r in cap.records}) == 2 and len(cap.records) > 200
    for rec in cap.records:
        assert_stats_match(rec.stats, rec.tensor)


def test_statistics_kernel_threads_set_while_capturing_and_restored(monkeypatch):
    from precision_lab import numba_loader
    from precision_lab.live import engine

    monkeypatch.setattr(engine, "running_elsewhere", lambda: 0)  # a quiet machine (the busy one: test_stats_engine)
    from precision_lab.stats import numba_available

    if not numba_available():
        pytest.skip("numba kernel disabled")
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(numba_loader.kernel_threads())
            return x * 2

    before = numba_loader.kernel_threads()
    m = Probe()
    with capture(m, run="t", store=":memory:", options=CaptureOptions(stats_threads=1)):
        m(torch.ones(3))
    # the default: the cores torch's intra-op threads leave free, at least one (numba's maximum at most)
    cores = len(os.sched_getaffinity(0))
    torch_threads = torch.get_num_threads()
    expected = []
    try:
        for n in (cores, 1):
            torch.set_num_threads(n)
            with capture(m, run=f"t{n}", store=":memory:"):
                m(torch.ones(3))
            expected.append(max(1, cores - n + 1))
    finally:
        torch.set_num_threads(torch_threads)
    assert seen == [1, *expected] and numba_loader.kernel_threads() == before
    if cores > 1:
        assert expected[0] == 1  # torch on every core: one statistics thread
    with pytest.raises(ValueError, match="stats_threads"):
        CaptureOptions(stats_threads=0)


def test_user_exception_wins_over_a_failed_write(store):
    torch.manual_seed(0)
    model = build_tiny()
    with pytest.raises(KeyError) as e:
        with capture(model, run="x", store=store, session="no-such-session"):
            run_step(model, tiny_input())
            raise KeyError("the user's own error")
    assert "the user's own error" in str(e.value)
    assert any("could not write run 'x'" in n for n in e.value.__notes__)
    assert _no_hooks_left(model)


def test_lost_device_results_keep_records_and_warn(monkeypatch):
    from precision_lab import stats as S

    def broken(*a, **k):
        raise RuntimeError("device results lost")

    torch.manual_seed(0)
    model = build_tiny()
    cap = Capture(model, run="lost", store=Store(":memory:"), options=CaptureOptions(local_error=True))
    cap._engine.deferred_cpu = True
    monkeypatch.setattr(S, "finish_partials", broken)
    with cap:
        run_step(model, tiny_input())
    assert cap.records and all(r.stats.is_summary_only and r.stats.max is None for r in cap.records)
    assert any("device results lost" in m for _, m in cap.warnings)
    # local comparisons still point at the right records
    assert all(cap.records[pos].role == "output" for pos, _ in cap.local_comparisons)


def _other_process_reads(db) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    code = ("from precision_lab.store import Store\n"
            f"s = Store({str(db)!r})\n"
            "print(len(s.sessions()))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_capture_to_a_path_releases_the_database_for_other_processes(tmp_path):
    from precision_lab.store import is_open

    db = tmp_path / "nb.duckdb"
    m = nn.Linear(4, 4)
    with capture(m, store=str(db)):
        m(torch.randn(2, 4))
    assert not is_open(db)
    got = _other_process_reads(db)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "1"


@pytest.mark.slow
def test_a_store_holds_its_file_only_while_an_operation_runs(tmp_path):
    """A Store in a notebook does not keep other processes out: between operations the file is free, a new
    session is staged apart from it until it is inserted whole, and ``held()`` keeps it (read-only) only for its
    block."""
    from precision_lab.store import is_open

    db = tmp_path / "s.duckdb"
    with Store(db) as s:
        with s.new_session("kept") as w:
            w.add_run(name="r")
            assert not is_open(db)
            meanwhile = _other_process_reads(db)  # the file is free while the session is written, and without it
            assert meanwhile.returncode == 0 and meanwhile.stdout.strip() == "0", meanwhile.stderr
        assert not is_open(db)
        got = _other_process_reads(db)
        assert got.returncode == 0 and got.stdout.strip() == "1", got.stderr
        with s.held():
            assert list(s.sessions()["name"]) == ["kept"]
            assert is_open(db)
            held = _other_process_reads(db)  # a reader beside a reader: both read-only
            assert held.returncode == 0 and held.stdout.strip() == "1", held.stderr
        assert not is_open(db)
    assert list(Store(db).sessions()["name"]) == ["kept"]


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))


def test_local_error_leaves_the_model_as_a_plain_training_step_does():
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    plain = _bn_model().train()
    plain(x).sum().backward()
    m = _bn_model().train()
    with capture(m, store=Store(":memory:"), options=CaptureOptions(local_error=True)):
        m(x).sum().backward()
    want, got = plain.state_dict(), m.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k  # bit-identical, running statistics included
    for (n, p), (_, q) in zip(plain.named_parameters(), m.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_local_error_under_autocast_is_measured_in_true_fp32():
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    m = _bn_model().eval()
    store = Store(":memory:")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with capture(m, store=store, options=CaptureOptions(local_error=True)) as cap:
            m(x)
    got = store.sql("SELECT max_abs_err FROM comparisons WHERE kind = 'local' AND cand_run_id = ? AND op = ?",
                    [cap.run_id, "0.conv2d.0"]).fetchone()[0]
    # independent: the same conv in fp32 against autocast's bf16 conv
    conv = m[0]
    with torch.no_grad():
        ref = conv(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = conv(x)
    assert low.dtype == torch.bfloat16
    assert got > 0 and got == pytest.approx(float((ref - low.float()).abs().max()), rel=1e-6)


def test_module_re_runs_hold_no_copy_of_the_parameters():
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with capture(m, store=Store(":memory:"), options=CaptureOptions(local_error=True)) as cap:
        m(torch.randn(2, 64))
        skeletons = [s for s in cap._shadow.skeletons.values() if s is not False]
        assert skeletons
        assert all(t.device.type == "meta" for s in skeletons for t in list(s.parameters()) + list(s.buffers()))




def test_a_float64_reference_is_cast_and_recorded_as_float64(store):
    """float64 is no compute format of a precision policy: a bare float64 casts the model and inputs and
    records {"dtype": "float64"}; every other bare dtype is that format's precision policy."""
    from precision_lab.fixes.policy import PrecisionPolicy
    from precision_lab.live.policies import as_policy

    assert as_policy(torch.float16) == PrecisionPolicy("float16", "fp16") == as_policy("fp16")
    with pytest.raises(ValueError, match="bare dtype"):
        as_policy(torch.float8_e4m3fn)
    torch.manual_seed(0)
    with capture(build_tiny(), run="f64", store=store, dtype_policy=torch.float64) as cap:
        y = cap.model(cap.prepare_inputs(tiny_input()))
    assert y.dtype == torch.float64 and cap.dominant_dtype() == "float64"
    assert json.loads(store.run(cap.run_id).policy) == {"dtype": "float64"}


def _np_summary(t: torch.Tensor) -> tuple:
    a = t.detach().double().numpy().ravel()
    return int(a.size), float(a.min()), float(a.max()), float(np.abs(a).max()), float(a.sum()), float(np.sqrt((a * a).sum()))


def test_a_view_over_measured_memory_reuses_its_statistics_until_the_memory_changes(monkeypatch):
    from precision_lab.live import engine

    calls = []
    real = engine._stats.tensor_stats

    def counting(t, **kw):
        calls.append(tuple(t.shape))
        return real(t, **kw)

    monkeypatch.setattr(engine._stats, "tensor_stats", counting)
    eng = engine.StatsEngine(CaptureOptions(), warn=lambda *a: None)
    base = torch.randn(6, 8, 4) * 100
    hb = eng.measure(base, "base")
    for view in (base.transpose(0, 2), base.view(48, 4), base.permute(1, 0, 2), base.reshape(-1)):
        h = eng.measure(view, "view")
        assert h.shape == tuple(view.shape) and h.stats.shape == tuple(view.shape)
        s = h.stats
        n, lo, hi, amax, total, l2 = _np_summary(view)
        assert (s.numel, s.min, s.max, s.absmax) == (n, lo, hi, amax)
        assert s.mean == pytest.approx(total / n, rel=1e-12, abs=1e-12) and s.l2norm == pytest.approx(l2, rel=1e-12)
        assert np.array_equal(s.hist, hb.stats.hist)
    assert calls == [(6, 8, 4)]  # the views were not scanned again
    # memory that is not the whole region is measured: a slice, a strided view, a view of other bytes
    for part in (base[:3], base[:, :, ::2], base[..., 0], base.view(torch.int32)):
        eng.measure(part, "part")
    assert len(calls) == 5
    # an in-place write through the base changes the shared version: the view is measured again, right
    base.mul_(2)
    view = base.transpose(0, 1)
    s = eng.measure(view, "after").stats
    assert len(calls) == 6 and s.max == pytest.approx(float(base.max()))
    # a new step forgets every region
    eng.new_step()
    eng.measure(base.t() if base.dim() == 2 else base.transpose(1, 2), "next step")
    assert len(calls) == 7


def test_capture_records_of_views_hold_the_views_own_statistics(store):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 12)

        def forward(self, x):
            y = self.fc(x)
            z = y.view(4, 3, 4).transpose(1, 2)  # same memory as y, another shape
            return torch.softmax(z, dim=-1).sum()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    with capture(net, run="views", store=store) as cap:
        net(x).backward()
    outs = {(r.op_type, r.role): r for r in cap.records if r.direction == "forward"}
    y = net.fc(x).detach()
    # softmax's input is a transposed view of the Linear's output: the same memory, another shape
    for key, want in ((("softmax", "input"), y.view(4, 3, 4).transpose(1, 2)), (("Linear", "output"), y)):
        s = outs[key].stats
        assert s.shape == tuple(want.shape)
        n, lo, hi, amax, total, l2 = _np_summary(want)
        assert (s.numel, s.min, s.max) == (n, pytest.approx(lo, rel=1e-6), pytest.approx(hi, rel=1e-6))
        assert s.l2norm == pytest.approx(l2, rel=1e-5)


def test_only_views_of_one_tensor_share_statistics():
    """Memory seen again through something that is not a view of the measured tensor is measured again:
    ``x.data = ...`` moves a tensor to other memory without changing its version (and its old memory may be
    handed to the next tensor), another tensor made over the same memory (``from_numpy`` twice) is no view
    of it, and a negative view holds other values over the same memory.  (A write through an alias with its
    own version counter is not seen by the version check, for a view as for the tensor itself.)"""
    import numpy as np

    from precision_lab.live import engine

    calls = []
    eng = engine.StatsEngine(CaptureOptions(), warn=lambda *a: None)
    real = engine._stats.tensor_stats
    t = torch.full((1024,), 1.0)
    assert eng.measure(t, "t").stats.max == 1.0
    t.data = torch.empty(0)  # t now covers no memory
    u = torch.full((1024,), 7.0)
    assert eng.measure(u.view(-1, 1), "u").stats.max == 7.0
    arr = np.arange(12, dtype=np.float32)
    a, b = torch.from_numpy(arr), torch.from_numpy(arr)
    eng.measure(a, "a")
    try:
        engine._stats.tensor_stats = lambda x, **kw: calls.append(x.shape) or real(x, **kw)
        eng.measure(b.view(3, 4), "b")  # the same memory, but no view of a: measured
    finally:
        engine._stats.tensor_stats = real
    assert calls == [torch.Size([3, 4])]
    x = torch.arange(6, dtype=torch.float32)
    eng.measure(x, "x")
    h = eng.measure(torch._neg_view(x), "neg")  # -x, over the same memory: never x's statistics
    assert h is None or h.stats.max == 0.0


def test_one_public_capture_over_the_recorder():
    """``precision_lab.capture`` is the one capture function (the use case that also takes a database path);
    the live layer's producer is the ``Capture`` class, in ``live.recorder``, which no function hides."""
    import importlib

    import precision_lab.live as live
    from precision_lab.services import capture as use_case

    assert precision_lab.capture is capture is use_case.capture
    assert not hasattr(live, "capture")
    assert importlib.import_module("precision_lab.live.recorder").Capture is live.Capture is Capture
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("precision_lab.live.capture")


def test_an_operator_overload_is_named_by_its_operator():
    """``torch.ops.aten.mul.Tensor(x, 2)`` is the op ``mul``, not its overload's name (``Tensor``, ``default``)."""
    class M(nn.Module):
        def forward(self, x):
            return torch.ops.aten.mul.Tensor(x, 2.0) + torch.ops.aten.relu.default(x)

    model = M()
    with capture(model, run="ops", store=":memory:") as cap:
        model(torch.randn(3))
    names = {r.op for r in cap.records}
    assert {"mul.0", "relu.0"} <= names, names
    assert not any(n.startswith(("Tensor.", "default.")) for n in names), names


@pytest.mark.slow  # a process of its own
def test_a_capture_leaves_torch_on_the_threads_the_user_set(tmp_path):
    """A process that runs torch on one thread (torchrun sets ``OMP_NUM_THREADS=1`` for each rank) still runs it
    on one thread while and after its steps are captured with the statistics kernel: numba's OpenMP layer, once
    started, set the thread's OpenMP count -- torch's -- to every core."""
    code = """
import torch
torch.set_num_threads(1)
from precision_lab import capture
from precision_lab.stats import numba_available
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
seen = []
m.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
with capture(m, run="r", store=":memory:"):
    m(torch.randn(512, 64)).sum().backward()
print(numba_available(), seen[0], torch.get_num_threads())
"""
    env = {**os.environ, "PRECISION_LAB_COMPILE": "now", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "1", "1"]

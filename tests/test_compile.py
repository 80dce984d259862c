"""torch.compile: a model compiled per block or whole is captured without graph breaks; the recorded inputs and
outputs of each compiled region are the compiled numbers, the ops inside come from an eager re-run on the same
inputs that changes nothing in the model; eager-vs-compiled is a session like fp32-vs-bf16, and
emulate-precision-casts is a fix that makes the compiled numbers the eager ones."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.fixes.recipes import RECIPES
from precision_lab.live import CaptureOptions
from precision_lab.live.recorder import Capture
from precision_lab.store import Store, close_all
from precision_lab.store import queries as q

pytestmark = pytest.mark.slow  # torch.compile compiles each model

MODEL = str(Path(__file__).parent / "models" / "compile_blocks.py")


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_blocks_for_tests", MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


blocks = _load()


def _capture(model, x, **opts):
    cap = Capture(model, write=False, options=CaptureOptions(**opts))
    with cap:
        out = cap.model(x)
    return cap, out


def _by_name(cap):
    return {(r.op, r.role, r.index): r for r in cap.records}


@pytest.fixture(autouse=True)
def counters():
    """torch._dynamo's counters, cleared (importing dynamo costs seconds: only these tests load it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_per_block_compile_records_the_compiled_numbers_with_eager_detail_inside(counters):
    eager = blocks.build().to(torch.bfloat16)
    x = blocks.inputs().to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    for b in compiled.blocks:
        b.compile()
    e_cap, e_out = _capture(eager, x, local_error=False)
    c_cap, c_out = _capture(compiled, x, local_error=False)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did run compiled
    assert not torch.equal(e_out, c_out)  # fused fp32 intermediates: the compiled numbers differ
    e, c = _by_name(e_cap), _by_name(c_cap)
    assert set(c) == set(e)  # the same names as an eager capture of the same model
    # the last block's output is the model's output: its record holds the compiled numbers
    last = c[("blocks.1.forward.0", "output", "0")].stats
    want = c_out.detach().double().numpy()
    assert last.max == want.max() and last.min == want.min()
    assert last.mean == pytest.approx(want.mean(), rel=1e-12, abs=1e-12)
    assert last.l2norm == pytest.approx(np.sqrt((want ** 2).sum()), rel=1e-12)
    assert last.max != e[("blocks.1.forward.0", "output", "0")].stats.max or \
        last.mean != e[("blocks.1.forward.0", "output", "0")].stats.mean
    # inside the first block the eager re-run saw the model's own input: eager numbers, exactly
    for key in (("blocks.0.l.forward.0", "output", "0"), ("blocks.0.n.forward.0", "output", "0")):
        assert c[key].stats.mean == e[key].stats.mean and c[key].stats.absmax == e[key].stats.absmax
    assert any("compiled with torch.compile: blocks.0, blocks.1" in m for _, m in c_cap.warnings)
    assert not [m for _, m in c_cap.warnings if "hook error" in m or "failed" in m]
    # the hooks are gone afterwards and the compiled call is the model's own again
    assert all(b._compiled_call_impl is not None and b._compiled_call_impl.__name__ != "call"
               for b in compiled.blocks)


def test_compiled_modules_inside_a_compiled_block_stay_inside_its_graph(counters):
    eager = blocks.build().to(torch.bfloat16)
    x = blocks.inputs().to(torch.bfloat16)
    model = copy.deepcopy(eager)
    for b in model.blocks:  # a block and its children compiled, as a pattern like "blocks.*" could select
        for m in b.modules():
            m.compile()
    plain = model(x)  # the compiled numbers, with no capture
    for step in range(3):  # a few steps: the wrapper would be traced and recompiled per step if nested
        cap, out = _capture(model, x, local_error=False)
        assert torch.equal(out, plain), step  # never an eager fallback
    assert not torch.equal(out, eager(x))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [m for w, m in cap.warnings if w == "torch.compile"] == [
        "compiled with torch.compile: blocks.0, blocks.1. Inputs and outputs recorded there are the compiled "
        "numbers; the ops inside come from an eager re-run on the same inputs"]
    # a policy's pattern compiles the outermost matches only
    from precision_lab.fixes.policy import PrecisionPolicy

    fresh = blocks.build()
    PrecisionPolicy("bf16", "bf16", compile="blocks.*").prepare(fresh)
    assert [n for n, m in fresh.named_modules() if m._compiled_call_impl is not None] == ["blocks.0", "blocks.1"]


def test_a_model_wrapped_whole_by_torch_compile_is_named_as_the_eager_model(counters):
    eager = blocks.build().to(torch.bfloat16)
    x = blocks.inputs().to(torch.bfloat16)
    wrapped = torch.compile(copy.deepcopy(eager))  # an OptimizedModule around the model
    e_cap, e_out = _capture(eager, x, local_error=False)
    c_cap, c_out = _capture(wrapped, x, local_error=False)
    assert not counters["graph_break"], dict(counters["graph_break"])
    c = _by_name(c_cap)
    assert set(c) == set(_by_name(e_cap))  # no "_orig_mod" in any name
    root = c[("forward.0", "output", "0")]
    assert root.op_type == "Blocks" and root.stats.max == c_out.detach().double().numpy().max()
    assert not torch.equal(e_out, c_out)
    assert any("compiled with torch.compile: the model" in m for _, m in c_cap.warnings)


def test_the_eager_rerun_inside_a_compiled_region_changes_nothing_in_the_model():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                             torch.nn.Dropout(0.5))

        def forward(self, x):
            return self.block(x).sum(-1)

    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    a.block.compile()
    b.block.compile()
    x = torch.randn(16, 8)
    torch.manual_seed(5)
    plain = b(x)  # train mode: batch statistics, running stats updated once, dropout draws
    torch.manual_seed(5)
    cap, out = _capture(a, x, local_error=False)
    assert torch.equal(out, plain)  # same random draws, same numbers
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k  # running stats and counters updated once, not twice
    after_capture = torch.rand(3)
    torch.manual_seed(5)
    b(x)
    assert torch.equal(after_capture, torch.rand(3))  # the random state is where a plain step leaves it
    assert ("block.1.forward.0", "output", "0") in _by_name(cap)


def test_a_block_that_updates_its_input_in_place_is_re_run_on_the_input_it_got():
    class Bump(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            x.add_(1.0)  # in place, on the caller's tensor
            return self.l(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = Bump()

        def forward(self, x):
            return self.blk(x * 1.0)

    torch.manual_seed(0)
    eager = Net()
    compiled = copy.deepcopy(eager)
    compiled.blk.compile()
    x = torch.randn(4, 8)
    e_cap, _ = _capture(eager, x.clone(), local_error=False)
    c_cap, _ = _capture(compiled, x.clone(), local_error=False)
    key = ("blk.l.forward.0", "input", "0")
    e, c = _by_name(e_cap)[key].stats, _by_name(c_cap)[key].stats
    want = (x.double() + 1.0).numpy()  # bumped once, not twice
    assert c.mean == pytest.approx(want.mean(), rel=1e-6) and c.max == pytest.approx(want.max(), rel=1e-6)
    assert (c.mean, c.max, c.min) == (e.mean, e.max, e.min)


def test_backward_through_compiled_blocks_records_boundary_and_parameter_gradients(counters):
    model = blocks.build()
    for b in model.blocks:
        b.compile()
    cap = Capture(model, write=False, options=CaptureOptions(backward=True, local_error=False))
    with cap:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = cap.model(blocks.inputs())
        y.float().square().mean().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    got = {(r.op, r.role) for r in cap.records if r.direction == "backward"}
    assert ("blocks.1.backward.0", "grad_output") in got
    grads = {r.index: r for r in cap.records if r.role == "param_grad" and r.op == "blocks.0.l.backward.0"}
    w = model.blocks[0].l.weight.grad.double().numpy()
    assert grads["weight"].stats.absmax == np.abs(w).max()


def test_a_compiled_function_inside_the_model_is_named_on_the_run():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)
            self.act = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2)

        def forward(self, x):
            return self.act(self.l(x))

    plain, _ = _capture(blocks.build(), blocks.inputs(), local_error=False)
    assert not [m for w, m in plain.warnings if w == "torch.compile"]
    cap, _ = _capture(Net(), torch.randn(2, 8), local_error=False)
    assert any("a function compiled with torch.compile, not a compiled module, ran inside the capture" in m
               for w, m in cap.warnings if w == "torch.compile")


def test_a_forward_replaced_by_a_compiled_function_is_refused_in_one_sentence():
    model = blocks.build()
    model.blocks[0].forward = torch.compile(model.blocks[0].forward)
    with pytest.raises(ValueError, match=r"forward of module 'blocks.0' was replaced by a function compiled"):
        Capture(model, write=False)


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _accumulated(store, run_id):
    return store.sql("SELECT op, role, max_abs_err, match FROM comparisons WHERE cand_run_id = ? "
                     "AND kind = 'accumulated'", [run_id]).fetchall()


def test_eager_vs_compiled_session_and_emulate_precision_casts_fix_from_the_cli(tmp_path):
    db = tmp_path / "c.duckdb"
    try:
        res = _cli("capture", "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs", "--dtype", "bf16",
                   "--compile", "blocks.*", "--reference", "eager", "--no-local", "--db", db)
        assert res.exit_code == 0, res.output
        store = Store(db)
        runs = {r.kind: r for r in q.session_runs(store, store.session("build").session_id)}
        assert runs["reference"].name == "eager reference" and "compiled" in runs["candidate"].name
        rows = _accumulated(store, runs["candidate"].run_id)
        assert rows and all(m == "exact" for *_, m in rows)  # compiled and eager runs name every op alike
        boundary = [e for op, role, e, _ in rows if op == "blocks.1.forward.0" and role == "output"]
        assert boundary and boundary[0] > 0  # compilation alone changes the block's output

        diags = q.session_diagnoses(store, store.session("build").session_id)
        comp = [d for d in diags if d.rule == "compiled"]
        assert [d.run_id for d in comp] == [runs["candidate"].run_id]
        assert "emulate-precision-casts" in comp[0].fixes and "eager" in comp[0].fixes

        listed = _cli("fixes", "--session", "build", "--db", db, "--model", f"{MODEL}:build", "--inputs",
                      f"{MODEL}:inputs")
        assert listed.exit_code == 0, listed.output
        verdicts = {ln.split()[1]: ln.split()[0] for ln in listed.output.splitlines()}
        assert verdicts["emulate-precision-casts"] == "applies" and verdicts["eager"] == "applies"
        assert verdicts["eps:1e-3"] == "applies"  # the blocks' LayerNorms
        assert verdicts["stable-softmax"] == "no"

        res = _cli("rerun", "--session", "build", "--fix", "emulate-precision-casts", "--db", db,
                   "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs")
        assert res.exit_code == 0, res.output
        runs = q.session_runs(store, store.session("build").session_id)
        fixed = next(r for r in runs if r.kind == "rerun")
        assert "emulating precision casts" in fixed.policy or "emulate_precision_casts" in fixed.policy
        diags = q.session_diagnoses(store, store.session("build").session_id)
        # rounding as eager code does, the re-run no longer carries the compiler's note
        assert fixed.run_id not in {d.run_id for d in diags if d.rule == "compiled"}
        rows = _accumulated(store, fixed.run_id)
        outs = [e for op, role, e, _ in rows if op.endswith(".forward.0") and role == "output"]
        assert outs and max(outs) == 0.0  # every module output now equals the eager one, bit for bit

        bad = _cli("capture", "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs", "--dtype", "bf16",
                   "--reference", "eager", "--db", db)
        assert bad.exit_code == 2 and "give --compile too" in bad.output
        nomatch = _cli("capture", "--model", f"{MODEL}:build", "--inputs", f"{MODEL}:inputs", "--dtype", "bf16",
                       "--compile", "nothing.here", "--db", db)
        assert nomatch.exit_code == 2 and "compile: pattern 'nothing.here' matches no module" in nomatch.output
        assert "Traceback" not in bad.output + nomatch.output
    finally:
        for name in [n for n in RECIPES if n.startswith("model:")]:
            RECIPES.unregister(name)
        close_all()

"""Following a failure back (precision_lab.origin): a non-finite value is a failure only where it reaches the
model's output, a gradient or a parameter; the op named is where that value started, whatever op type wrote it;
and an answer is "certain" only when nothing was guessed.  Hand-made facts first, then real models captured
live and dumped by hooks (the localization bench's own cases, judged by its own rule)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from precision_lab.origin import ComparedRecord, NonfiniteCall, RunFacts, analyse, model_outputs
from precision_lab.origin.calls import _inside
from precision_lab.stats import tensor_stats
from precision_lab.store.rows import ForwardEnds

INF, NAN = math.inf, math.nan
_RID = iter(range(10_000))


def rec(op, role, values, *, seq, introduced=None, masked=None, op_type=None, index="0", ref_nonfinite=None,
        direction="forward"):
    t = torch.tensor(values, dtype=torch.float16)
    st = tensor_stats(t)
    row = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "hist"}
    row.update(rid=next(_RID), op=op, op_type=op_type or op.split(".")[max(0, op.count(".") - 1)], role=role, index=index, step=0, rank=0,
               seq=seq, dtype="float16", shape=json.dumps(list(t.shape)), introduced=introduced, masked=masked,
               ref_absmax=None, ref_nonfinite=ref_nonfinite, location=None, parent=None, nonfinite=True,
               direction=direction)
    return ComparedRecord.from_row(row)


def call(op, seq, *, no_inputs=False, op_type=None, direction="forward"):
    return NonfiniteCall.from_row({"step": 0, "rank": 0, "op": op, "seq": seq, "op_type": op_type or op.split(".")[max(0, op.count(".") - 1)],
                                   "direction": direction, "no_inputs": no_inputs})


def facts(calls, recs, *, output="forward.0", root=True, order="execution", inputs_recorded=True):
    outputs = {(0, 0): (output, root)} if output else {}
    return RunFacts("fp16", "r1", order, tuple(calls), tuple(recs), {}, inputs_recorded=inputs_recorded,
                    outputs=outputs)


def test_plus_inf_that_min_consumes_is_no_failure():
    # x.masked_fill(eye, inf).min(-1): +inf written on purpose, the model's output finite
    calls = [call("masked_fill.0", 3), call("min.0", 4)]
    recs = [rec("masked_fill.0", "output", [1.0, INF, 2.0], seq=3),
            rec("min.0", "input", [1.0, INF, 2.0], seq=4)]
    first, intended = analyse(facts(calls, recs))
    assert first is None
    assert [m.op for m in intended] == ["masked_fill.0"]
    # the same +inf reaching the output is a failure, named at the fill
    calls += [call("mean.0", 5), call("forward.0", 6)]
    recs += [rec("mean.0", "input", [1.0, INF], seq=5), rec("mean.0", "output", [INF], seq=5),
             rec("forward.0", "output", [INF], seq=6)]
    first, _ = analyse(facts(calls, recs))
    assert first is not None and first.op == "masked_fill.0" and first.origin == "op"
    assert first.certainty == "certain" and "the model's output (forward.0)" in first.reason


def test_a_buffer_of_inf_constants_is_no_failure_unless_its_value_reaches_one():
    # torch.minimum(self.HI, x) with HI = +inf, the start of a running min: a buffer holding +inf, output finite
    calls = [call("forward.0", 1), call("minimum.0", 2)]
    recs = [rec("forward.0", "buffer", [INF], seq=1, index="HI"), rec("minimum.0", "input", [INF, INF], seq=2)]
    assert analyse(facts(calls, recs))[0] is None
    # a parameter holding inf is a failure by itself (a weight that overflowed when the model was cast)
    recs[0] = rec("forward.0", "param", [INF, 1.0], seq=1, index="weight")
    first, _ = analyse(facts(calls, recs))
    assert first.origin == "parameter" and first.parameter.name == "weight"


def test_a_mask_whose_row_turns_nan_is_the_origin_not_the_softmax():
    # no reference: the mask's -inf fills a whole row; softmax makes it NaN; the output is NaN
    calls = [call("attn.masked_fill.0", 1), call("attn.softmax.0", 2), call("forward.0", 3)]
    recs = [rec("attn.masked_fill.0", "output", [0.5, -INF, -INF, -INF], seq=1),
            rec("attn.softmax.0", "input", [0.5, -INF, -INF, -INF], seq=2),
            rec("attn.softmax.0", "output", [1.0, 0.0, NAN, NAN], seq=2),
            rec("forward.0", "output", [NAN, 1.0], seq=3)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "attn.masked_fill.0" and first.origin == "op"
    assert "looks like a mask's, but it reaches the model's output" in first.reason


def test_a_finfo_min_mask_that_became_minus_inf_in_fp16_is_blamed_over_the_softmax():
    # with a reference: fp32 holds finfo(fp32).min (finite); the comparison counts those positions as masked in
    # both runs (introduced 0), yet they are -inf here where the reference is finite
    calls = [call("pad_mask.mul.0", 1), call("attn.add.0", 2), call("attn.softmax.0", 3), call("forward.0", 4)]
    recs = [rec("pad_mask.mul.0", "output", [0.0, -INF, -INF], seq=1, introduced=0, masked=2, ref_nonfinite=False),
            rec("attn.add.0", "input", [0.0, -INF, -INF], seq=2, introduced=0, masked=2, ref_nonfinite=False,
                index="1"),
            rec("attn.add.0", "output", [-INF, -INF, -INF], seq=2, introduced=0, masked=3, ref_nonfinite=False),
            rec("attn.softmax.0", "input", [-INF, -INF, -INF], seq=3, introduced=0, masked=3, ref_nonfinite=False),
            rec("attn.softmax.0", "output", [NAN, NAN, NAN], seq=3, introduced=3, ref_nonfinite=False),
            rec("forward.0", "output", [NAN], seq=4, introduced=1, ref_nonfinite=False)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "pad_mask.mul.0" and first.origin == "op"
    assert "became -inf in the cast" in first.reason and first.certainty == "certain"
    # the same mask with the run's output finite (no row fully masked) is healthy
    healthy = [r for r in recs if r.op not in ("attn.softmax.0", "forward.0")]
    first, intended = analyse(facts(calls[:2], healthy))
    assert first is None


def test_an_exp_that_overflows_beside_a_mask_is_blamed_not_the_mask():
    # exp receives the mask's -inf (exp(-inf) = 0) and writes +inf: +inf cannot come from -inf
    calls = [call("attn.masked_fill.0", 1), call("attn.exp.0", 2), call("attn.div.0", 3), call("forward.0", 4)]
    recs = [rec("attn.masked_fill.0", "output", [9.0, -INF], seq=1),
            rec("attn.exp.0", "input", [9.0, -INF], seq=2), rec("attn.exp.0", "output", [INF, 0.0], seq=2),
            rec("attn.div.0", "input", [INF, 0.0], seq=3), rec("attn.div.0", "output", [NAN, 0.0], seq=3),
            rec("forward.0", "output", [NAN], seq=4)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "attn.exp.0" and first.certainty == "certain"


def test_log_underflow_is_not_excused_as_log_zero():
    # log(softmax(x)): the softmax's tiny values are 0 in fp16, log writes -inf from finite inputs, the next
    # Linear turns it into NaN; no reference, so log's own -inf must be followed from the failure
    calls = [call("logp.log.0", 2, op_type="log"), call("out.linear.0", 3), call("forward.0", 4)]
    recs = [rec("logp.log.0", "output", [-1.0, -INF], seq=2, op_type="log"),
            rec("out.linear.0", "input", [-1.0, -INF], seq=3), rec("out.linear.0", "output", [NAN, NAN], seq=3),
            rec("forward.0", "output", [NAN], seq=4)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "logp.log.0"


def test_an_earlier_minus_inf_of_a_users_own_op_does_not_hide_a_later_overflow():
    # -1/keep writes -inf (a user's own mask: no list knows it), the softmax absorbs it; then a Linear overflows
    calls = [call("bias.div.0", 1), call("attn.softmax.0", 2), call("fc.linear.0", 5), call("act.gelu.0", 6),
             call("forward.0", 7)]
    recs = [rec("bias.div.0", "output", [-1.0, -INF], seq=1),
            rec("attn.softmax.0", "input", [-1.0, -INF], seq=2),
            rec("fc.linear.0", "output", [INF, 1.0], seq=5),
            rec("act.gelu.0", "input", [INF, 1.0], seq=6), rec("act.gelu.0", "output", [INF, NAN], seq=6),
            rec("forward.0", "output", [NAN], seq=7)]
    first, intended = analyse(facts(calls, recs))
    assert first.op == "fc.linear.0" and first.certainty == "certain"


def test_a_constant_made_from_a_nan_through_python_is_not_the_origin():
    # torch.tensor(x.amax().item()) after 0/0: the constant reads no tensor but holds the NaN made before it
    calls = [call("norm.div.0", 1), call("q.amax.0", 2), call("q.tensor.0", 3, no_inputs=True), call("forward.0", 4)]
    recs = [rec("norm.div.0", "output", [NAN, 1.0], seq=1), rec("q.amax.0", "input", [NAN, 1.0], seq=2),
            rec("q.amax.0", "output", [NAN], seq=2), rec("q.tensor.0", "output", [NAN, NAN], seq=3),
            rec("forward.0", "output", [NAN], seq=4)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "norm.div.0"


def test_outputs_only_answers_are_likely_and_say_what_would_decide():
    calls = [call("model.a", 1, no_inputs=True, op_type="Linear"), call("model.b", 2, no_inputs=True, op_type="Linear"),
             call("model", 3, no_inputs=True, op_type="Model")]
    recs = [rec("model.a", "output", [INF, 1.0], seq=1), rec("model.b", "output", [NAN, 1.0], seq=2),
            rec("model", "output", [NAN], seq=3)]
    first, _ = analyse(facts(calls, recs, output="model", inputs_recorded=False))
    assert first.op == "model.a" and first.certainty == "likely"
    assert any("not recorded" in g for g in first.guessed) and "inputs" in first.decide
    assert first.certainty_text.startswith("likely, not certain:")


def test_two_producers_in_an_order_recovered_from_the_data_are_a_guess():
    calls = [call("model.a", 1, op_type="Linear"), call("model.b", 2, op_type="Linear"), call("model", 3)]
    recs = [rec("model.a", "output", [INF], seq=1), rec("model.b", "output", [INF], seq=2),
            rec("model", "output", [INF], seq=3)]
    first, _ = analyse(facts(calls, recs, output="model", order="data"))
    assert first.certainty == "likely" and {first.op, *first.others} == {"model.a", "model.b"}
    assert "order" in first.decide
    # the same in execution order: nothing recorded read model.a's +inf, so it went somewhere unrecorded (into
    # model, beside model.b's): the first one is named, and which one reached the output is a guess
    first, _ = analyse(facts(calls, recs, output="model"))
    assert first.op == "model.a" and first.certainty == "likely" and first.others == ("model.b",)


def test_records_never_nest_by_name_prefix():
    assert not _inside("softmax.0.backward", "softmax.0")
    assert not _inside("x.01", "x.0") and not _inside("linear.10", "linear.1")
    assert _inside("blocks.0.fc.linear.0", "blocks.0.fc.forward.0")
    assert _inside("003-layers.1.0", "009-layers.1")  # a call number the file names begin with
    assert not _inside("Functional.linear.3.backward", "Module.fc.Linear.forward.0",
                       {"Functional.linear.3.backward": "Module.fc.Linear.forward.0"})


def test_the_model_output_is_the_root_or_else_the_last_op():
    ends = [ForwardEnds(0, 0, "forward.0", "fc.linear.0", None),  # call order: root first
            ForwardEnds(1, 0, "embed.forward.0", "forward.0", None),  # completion order
            ForwardEnds(2, 0, "hook_embed", "blocks.1.hook_resid_post", None)]  # no root
    assert model_outputs(ends, "execution").by_step == {(0, 0): ("forward.0", True), (1, 0): ("forward.0", True),
                                                        (2, 0): ("blocks.1.hook_resid_post", False)}
    assert (2, 0) not in model_outputs(ends, "name").by_step  # with the order unknown, the last op says nothing
    # a record named as a model's output is, where nothing nests it (``model.npy`` beside ``layers.0.npy``),
    # whatever the order: the last file by time or name may be any module's
    named = [ForwardEnds(0, 0, "base", "tail.fill", "model")]
    assert model_outputs(named, "name").by_step == model_outputs(named, "mtime").by_step == {(0, 0): ("model", False)}


@pytest.mark.parametrize("root", ["model", "SeedBlocks", "logits"])
def test_an_outputs_only_dump_whose_root_is_finite_is_healthy_whatever_it_holds(tmp_path, root):
    """Files saved per module with the root under a name of its own: the +inf a tail writes for a ``min`` never
    reaches ``<root>.npy``; the same dump with a NaN in the root is a failure, its origin a guess."""
    import os

    import numpy as np

    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store
    from precision_lab.store import queries as q

    def dump(folder, out):
        folder.mkdir()
        files = {root: out, "layers.0": np.ones((2, 4), np.float16), "tail": np.ones((2,), np.float16),
                 "tail.fill": np.array([[1.0, np.inf], [np.inf, 2.0]], np.float16)}
        for i, (name, a) in enumerate(files.items()):  # the root's file first, the +inf fill's last
            np.save(folder / f"{name}.npy", a)
            os.utime(folder / f"{name}.npy", ns=(1_700_000_000_000_000_000 + i * 10**9,) * 2)
        s = Store(":memory:")
        name = ingest(folder, store=s)
        run = q.session_runs(s, s.session(name).session_id)[0]
        return run, first_nonfinite(s, run.run_id)

    run, f = dump(tmp_path / "healthy", np.ones((2, 4), np.float16))
    assert run.order == "mtime" and f is None  # not the last file (tail.fill) taken as the output
    run, f = dump(tmp_path / "failing", np.array([[np.nan, 1.0, 1.0, 1.0]] * 2, np.float16))
    assert f is not None and f.certainty == "likely" and "order" in f.decide


# ---- real models, captured live and dumped by hooks, judged by the bench's own rule ------------------

@pytest.fixture(scope="module")
def bench():
    root = Path(__file__).parents[1] / "bench"
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("localization_for_tests", root / "localization.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import localization_cases

    return mod, localization_cases


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nearest-neighbour-plus-inf-min/fp16", "entropy-log-zero-where/fp16",
                                  "hook-point-attn-scores/fp16", "inf-padding-dropped-by-index/fp16",
                                  "fully-padded-row-finfo32-mask-fp16", "log-softmax-underflow-fp16",
                                  "plus-inf-fill-reaches-output", "log-keep-mask-softmax-then-overflow"])
def test_bench_cases_live_and_dumped(bench, tmp_path, name):
    loc, cases = bench
    case = next(c for c in cases.intended(True) + cases.not_excused(True) if c.name == name)
    rows = loc._run_case(case, tmp_path, True)
    assert len(rows) >= 3
    bad = [f"{r['case']} [{r['how']}]: named {r['named']}: {r['reason']}" for r in rows if not r["right"]]
    assert not bad, "\n".join(bad)
    # an answer stated certain is never wrong (the healthy ones name nothing and state nothing)
    assert not any(r["certain"] and not r["right"] for r in rows)


@pytest.mark.slow
def test_a_finfo_min_padding_mask_in_fp16_gets_a_fix_that_works_and_grow_finds_an_island(tmp_path):
    """The mask is named, the fix offered is a mask value fp16 holds (sanitize: -inf -> -65504), verified by a
    re-run; growing fp32 islands, whose outputs meet fp16 in the model's own matmuls (cast there to the wider
    dtype), finds one that leaves the run finite: the embedding, whose fp32 output makes the mask fp32."""
    from typer.testing import CliRunner

    from precision_lab.cli import app
    from precision_lab.store import Store, close_all
    from precision_lab.store import queries as q
    from precision_lab.services.report import first_nonfinite

    model = str(Path(__file__).parent / "models" / "padded_mask.py")
    db = tmp_path / "pad.duckdb"
    run = lambda *a: CliRunner().invoke(app, [str(x) for x in a])  # noqa: E731
    res = run("capture", "--model", f"{model}:build", "--inputs", f"{model}:inputs", "--dtype", "fp16", "--db", db,
              "--no-local", "--session", "pad")
    assert res.exit_code == 0, res.output
    assert "first non-finite at layer.pad_mask.mul.0" in res.output
    assert "sanitize-nonfinite:layer.pad_mask" in res.output
    res = run("verify", "--session", "pad", "--db", db, "--model", f"{model}:build", "--inputs", f"{model}:inputs")
    assert res.exit_code == 0, res.output
    assert any(ln.split()[:2] == ["works", "sanitize-nonfinite:layer.pad_mask"] for ln in res.output.splitlines()), \
        res.output
    res = run("bisect", "--session", "pad", "--db", db, "--model", f"{model}:build", "--inputs", f"{model}:inputs")
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "does not run" not in res.output  # fp32 keys meeting fp16 queries are cast, not an error
    island = next(ln.split(": ", 1)[1] for ln in res.output.splitlines() if ln.startswith("fix: "))
    assert island == "keep-fp32:embed", res.output
    store = Store(db)
    runs = {r.fix: r for r in q.session_runs(store, store.session("pad").session_id)}
    for fix in ("sanitize-nonfinite:layer.pad_mask", "keep-fp32:embed"):
        assert first_nonfinite(store, runs[fix].run_id) is None, fix
    close_all()

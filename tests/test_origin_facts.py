"""The origin analysis on hand-made facts, without a database (precision_lab.origin), and the mask-aware
comparison it relies on (metrics: positions masked in both runs compare as equal)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from precision_lab.metrics import compare, compare_stats
from precision_lab.origin import ComparedRecord, NonfiniteCall, Origin, RunFacts, analyse, intended_output, is_additive_mask
from precision_lab.stats import TensorStats, tensor_stats

_RID = iter(range(10_000))


def rec(op: str, role: str, values, *, seq: int, introduced=None, op_type=None, index="0", dtype="float16",
        ref_absmax=None):
    """A non-finite record as the store answers it, its statistics computed from ``values``."""
    t = torch.tensor(values, dtype=getattr(torch, dtype))
    st = tensor_stats(t)
    row = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "hist"}
    row.update(rid=next(_RID), op=op, op_type=op_type or op.split(".")[-2], role=role, index=index, step=0,
               rank=0, seq=seq, dtype=dtype, shape=json.dumps(list(t.shape)), introduced=introduced,
               ref_absmax=ref_absmax, ref_nonfinite=None, location=None, parent=None, nonfinite=True)
    return ComparedRecord.from_row(row)


def call(op: str, seq: int, *, no_inputs=False, op_type=None):
    return NonfiniteCall.from_row({"step": 0, "rank": 0, "op": op, "seq": seq, "op_type": op_type or op.split(".")[-2],
                                   "direction": "forward", "no_inputs": no_inputs})


def facts(calls, recs, *, order="execution", inputs_recorded=True):
    return RunFacts("fp16", "r1", order, tuple(calls), tuple(recs), {}, inputs_recorded=inputs_recorded)


INF = math.inf


def test_a_constant_minus_inf_is_intended_not_the_producer():
    # torch.where(mask, scores, torch.tensor(float("-inf"))): the constant reads no tensor
    calls = [call("attn.tensor.0", 3, no_inputs=True), call("attn.where.0", 4)]
    recs = [rec("attn.tensor.0", "output", [-INF], seq=3),
            rec("attn.where.0", "input", [-INF], seq=4, index="2"),
            rec("attn.where.0", "output", [1.0, -INF, 2.0, -INF], seq=4)]
    first, intended = analyse(facts(calls, recs))
    assert first is None
    assert [m.op for m in intended] == ["attn.tensor.0"] and intended[0].count == 1


def test_in_an_outputs_only_dump_an_op_without_inputs_is_no_constant():
    # nothing records inputs: an overflow to -inf of a Linear is an overflow, not a constant
    calls = [call("model.fc", 0, no_inputs=True, op_type="Linear")]
    recs = [rec("model.fc", "output", [3.0, -INF, 1.0], seq=0, op_type="Linear")]
    first, intended = analyse(facts(calls, recs, inputs_recorded=False))
    assert first is not None and first.op == "model.fc" and first.origin == "op" and intended == []


def test_an_additive_mask_that_became_minus_inf_is_intended_and_an_overflow_is_not():
    # keep_not.to(fp16) * finfo(fp32).min: 0 where kept, -inf where masked
    calls = [call("attn.mul.0", 1), call("attn.mul.1", 2)]
    recs = [rec("attn.mul.0", "output", [0.0, -INF, 0.0, -INF], seq=1),
            # a product that overflowed negatively among ordinary values is a failure
            rec("attn.mul.1", "output", [0.5, -INF, 2.0, 1.0], seq=2)]
    first, intended = analyse(facts(calls, recs))
    assert [m.op for m in intended] == ["attn.mul.0"]
    assert first is not None and first.op == "attn.mul.1" and first.certainty == "certain"
    assert "attn.mul.0" in first.intended and "not blamed" in first.reason


def test_additive_mask_from_counts_and_from_a_summary():
    assert is_additive_mask(tensor_stats(torch.tensor([0.0, -0.0, -INF])))
    assert not is_additive_mask(tensor_stats(torch.tensor([0.0, -1.0, -INF])))
    assert not is_additive_mask(tensor_stats(torch.tensor([0.0, INF])))  # +inf is no mask
    summary = TensorStats(numel=8, dtype="float16", shape=(8,), nan_count=None, inf_count=None, zero_count=None,
                          min=-INF, max=0.0, absmax=INF, min_abs_nonzero=None, mean=None, std=None, l2norm=None)
    assert is_additive_mask(summary)
    st = tensor_stats(torch.tensor([1.0, -INF]))
    assert not intended_output("linear", st, received_mask=False, read_tensors=True)
    assert intended_output("masked_fill", st, received_mask=False, read_tensors=True)
    assert intended_output("full_like", st, received_mask=False, read_tensors=True)
    assert intended_output("scalar_tensor", st, received_mask=False, read_tensors=True)


def test_a_reference_decides_and_positions_masked_in_both_are_not_introduced():
    calls = [call("attn.mul.0", 1), call("attn.add.0", 2)]
    recs = [rec("attn.mul.0", "output", [0.0, -INF], seq=1, introduced=0),
            rec("attn.add.0", "input", [0.0, -INF], seq=2, introduced=0, index="1"),
            rec("attn.add.0", "output", [0.3, -INF], seq=2, introduced=0)]
    first, intended = analyse(facts(calls, recs))
    assert first is None and [m.op for m in intended] == ["attn.mul.0"]
    recs[-1] = rec("attn.add.0", "output", [INF, -INF], seq=2, introduced=1)
    first, _ = analyse(facts(calls, recs))
    assert first is None or first.op == "attn.add.0"
    assert first is not None and first.origin == "op" and first.op_type == "add"


def test_a_buffer_non_finite_after_the_cast_is_the_origin_named_with_its_value():
    calls = [call("bn.forward.0", 0)]
    buf = rec("bn.forward.0", "buffer", [INF, 0.0], seq=0, index="running_mean", ref_absmax=1e5)
    first, _ = analyse(facts(calls, [buf, rec("bn.forward.0", "output", [INF, -INF], seq=0)]))
    assert first.origin == "parameter" and not first.producer
    assert first.parameter.name == "bn.running_mean" and first.parameter.role == "buffer"
    assert first.reason.startswith("buffer bn.running_mean holds 1.0e+05 > fp16 max 65,504")


def test_order_unknown_names_the_first_innermost_by_name_and_says_so():
    calls = [call("model.b", 0, op_type="Linear"), call("model.a", 1, op_type="Linear")]
    recs = [rec("model.b", "output", [INF], seq=0), rec("model.a", "output", [INF], seq=1)]
    first, _ = analyse(facts(calls, recs, order="name"))
    assert first.certainty == "likely" and not first.order_known
    assert first.guessed and "order" in first.decide
    assert {first.op, *first.others} == {"model.a", "model.b"}


def test_the_json_form_keeps_every_field():
    calls = [call("m.fc.linear.0", 0)]
    recs = [rec("m.fc.linear.0", "output", [INF], seq=0)]  # the facts hold non-finite records only
    first, _ = analyse(facts(calls, recs))
    assert isinstance(first, Origin)
    d = first.as_dict()
    assert d["producer"] is True and d["op"] == "m.fc.linear.0" and d["path"] == [] and d["certainty"] == "certain"
    with pytest.raises(AttributeError):
        first.op = "other"  # frozen


# ---- the mask-aware comparison -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_finfo_min_mask_compares_as_equal_where_both_runs_mask(backend):
    rng = np.random.default_rng(0)
    scores = rng.standard_normal(64).astype(np.float32)
    keep = rng.random(64) < 0.6
    ref = np.where(keep, scores, np.finfo(np.float32).min).astype(np.float32)
    cand16 = torch.tensor(np.where(keep, scores, -np.inf)).to(torch.float16)  # finfo(fp32).min is -inf in fp16
    c = compare(torch.from_numpy(ref), cand16, backend=backend)
    assert c.masked == int((~keep).sum()) and c.nonfinite_introduced == 0
    assert c.verdict == "expected" and "masked in both runs" in c.reason
    # the error over the kept positions, in float64
    r64, c64 = ref[keep].astype(np.float64), cand16.double().numpy()[keep]
    assert c.max_abs_err == pytest.approx(np.max(np.abs(c64 - r64)), rel=1e-12)
    assert c.compared == int(keep.sum())
    # fp16's own finfo.min (-65504) in the candidate is masked too
    own = torch.tensor(np.where(keep, scores, np.finfo(np.float16).min)).to(torch.float16)
    c2 = compare(torch.from_numpy(ref), own, backend=backend)
    assert c2.masked == int((~keep).sum()) and c2.max_abs_err == pytest.approx(c.max_abs_err)
    # a real overflow at a position the reference does not mask is still introduced
    bad = cand16.clone()
    bad[int(np.flatnonzero(keep)[0])] = -math.inf
    assert compare(torch.from_numpy(ref), bad, backend=backend).nonfinite_introduced == 1


def test_a_large_negative_activation_is_no_mask():
    # -40000 is a value in both runs (beyond fp16's half-min but far from fp32's): compared, not masked
    ref = torch.tensor([-40000.0, 1.0])
    c = compare(ref, ref.to(torch.float16))
    assert c.masked == 0 and c.compared == 2


def test_statistics_only_mask_in_both():
    ref = tensor_stats(torch.tensor([0.5, torch.finfo(torch.float32).min, 1.0]))
    cand = tensor_stats(torch.tensor([0.5, -INF, 1.0], dtype=torch.float16))
    c = compare_stats(ref, cand)
    assert c.nonfinite_introduced == 0 and c.masked == 1 and "masked in both runs" in c.reason
    plain = tensor_stats(torch.tensor([0.5, -3.0, 1.0]))
    assert compare_stats(plain, cand).nonfinite_introduced == 1


def test_an_overflow_after_a_nan_the_reference_shares_is_named():
    # a 0/0 row both runs hold, then an fp16-only overflow in fc that also carries the NaN row along
    calls = [call("pad.div.0", 0), call("fc.linear.0", 1)]
    recs = [rec("pad.div.0", "output", [math.nan, 1.0], seq=0, introduced=0),
            rec("fc.linear.0", "input", [math.nan, 1.0], seq=1, introduced=0),
            rec("fc.linear.0", "output", [math.nan, INF, 2.0], seq=1, introduced=1)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "fc.linear.0" and first.origin == "op" and not first.in_reference
    # the same NaN only spreading (no inf of its own): the reference's producer is the answer
    recs[-1] = rec("fc.linear.0", "output", [math.nan, math.nan, 2.0], seq=1, introduced=1)
    first, _ = analyse(facts(calls, recs))
    assert first.op == "pad.div.0" and first.in_reference and "reference run holds the same" in first.reason


def test_a_container_whose_weight_is_inf_names_the_weight():
    # a dump that records modules and their own weights: the container's output is the first non-finite one
    calls = [call("model.mlp", 0, op_type="MLP"), call("model.mlp.up", 1, op_type="Linear")]
    w = rec("model.mlp.up", "param", [INF, 0.1], seq=1, index="weight")
    recs = [rec("model.mlp", "output", [INF, 1.0], seq=0), w, rec("model.mlp.up", "output", [INF, -INF], seq=1)]
    first, _ = analyse(facts(calls, recs))
    assert first.origin == "parameter" and first.parameter.name == "model.mlp.up.weight"


def test_a_consumer_whose_input_is_newly_non_finite_names_the_gap_not_a_later_op():
    # msprobe records no Tensor.to: the cast that overflowed is missing; the comparison marks the matmul's input
    # as newly non-finite (the reference's is finite), and a later op that only passes the value on is not named
    calls = [call("Functional.matmul.0", 5, op_type="matmul"), call("Functional.add.0", 6, op_type="add")]
    recs = [rec("Functional.matmul.0", "input", [1.0, INF], seq=5, introduced=1),
            rec("Functional.matmul.0", "output", [INF, INF], seq=5, introduced=2),
            rec("Functional.add.0", "input", [INF, INF], seq=6, introduced=2),
            rec("Functional.add.0", "output", [INF, INF], seq=6, introduced=2)]
    first, _ = analyse(facts(calls, recs))
    assert first.op == "Functional.matmul.0" and first.origin == "input"
    assert "producer was not recorded" in first.reason and "cast" in first.reason
    # without a reference nothing says the input is new: it came from before the first recorded op
    plain, _ = analyse(facts(calls, [dataclasses.replace(r, introduced=None) for r in recs]))
    assert plain.op == "Functional.matmul.0" and "before the first recorded op" in plain.reason


def test_an_outputs_only_answer_says_what_it_knows_and_never_that_inputs_were_finite():
    calls = [call("model.layers.1.mlp", 3, op_type="MLP"), call("model.layers.1.mlp.down_proj", 4, op_type="Linear"),
             call("lm_head", 7, op_type="Linear")]
    recs = [rec("model.layers.1.mlp", "output", [1.0, INF], seq=3, op_type="MLP"),
            rec("model.layers.1.mlp.down_proj", "output", [1.0, INF], seq=4, op_type="Linear"),
            rec("lm_head", "output", [math.nan, math.nan], seq=7, op_type="Linear")]
    for order in ("execution", "name"):
        first, _ = analyse(facts(calls, recs, order=order, inputs_recorded=False))
        assert first.op == "model.layers.1.mlp.down_proj"  # the innermost, not the module holding it
        assert "first module whose output is non-finite (inputs not recorded)" in first.reason
        assert "inputs are all finite" not in first.reason
    assert first.others == ("lm_head",) and "order unknown" in first.reason


@pytest.mark.parametrize("order", ["execution", "name"])
def test_a_gap_inside_a_recorded_container_names_the_consumer_not_the_container(order):
    # hooks on modules only: the block's input is finite, a cast inside it (not recorded) overflows before the
    # block's first Linear; the block is called first and its output is non-finite, but the value appeared inside
    calls = [call("layers.1", 0, op_type="Sequential"), call("layers.1.0", 1, op_type="Linear"),
             call("layers.1.1", 2, op_type="GELU")]
    recs = [rec("layers.1", "output", [INF, 1.0], seq=0, introduced=1),
            rec("layers.1.0", "input", [INF, 1.0], seq=1, introduced=1),
            rec("layers.1.0", "output", [INF, -INF], seq=1, introduced=2),
            rec("layers.1.1", "input", [INF, -INF], seq=2, introduced=2),
            rec("layers.1.1", "output", [INF, math.nan], seq=2, introduced=2)]
    first, _ = analyse(facts(calls, recs, order=order))
    assert first.op == "layers.1.0" and first.origin == "input"
    assert "producer was not recorded" in first.reason
    # without a reference nothing says the value is new: the block that holds the unrecorded op is named
    plain, _ = analyse(facts(calls, [dataclasses.replace(r, introduced=None) for r in recs], order=order))
    assert plain.op == "layers.1" and plain.origin == "op"

"""Which op introduced a run's first unexpected NaN/inf: intended -inf masks, inherited values, parameters that
overflow on the model's cast, and values the reference shares, on captured models (our own, torch's
nn.TransformerEncoderLayer, Hugging Face Qwen2 built from config) and on an msprobe statistics dump.

Every expectation that a value overflows is checked against an independent fp32 forward pass with plain
torch hooks, and against fp16's max from torch.finfo."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.services import report
from precision_lab.services.diagnose import diagnose
from precision_lab.services.ingest import ingest
from precision_lab.store import queries as q

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened

FP16_MAX = float(torch.finfo(torch.float16).max)
SAMPLES = Path(__file__).parent / "data" / "msprobe"


@functools.cache
def _bench():
    """bench/localization.py, the published corpus: its models and its judge of a right answer (loaded by the
    tests that use it, not when the suite is collected)."""
    spec = importlib.util.spec_from_file_location("localization", Path(__file__).parents[1] / "bench" / "localization.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runs(store, name):
    return {r.kind: r for r in q.session_runs(store, store.session(name).session_id)}


def _fp32_absmax(model, inputs, names):
    """absmax of the named modules' outputs in a plain fp32 forward (torch hooks, no Precision Lab)."""
    got = {}
    hooks = [mod.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, float(o.detach().abs().max())))
             for n, mod in model.named_modules() if n in names]
    with torch.no_grad():
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    for h in hooks:
        h.remove()
    return got


class TwoAttentions(nn.Module):
    def __init__(self, out_scale=1.0):
        super().__init__()
        self.a1, self.a2 = _bench().MaskedAttention(), _bench().MaskedAttention()
        with torch.no_grad():
            self.a2.out.weight.mul_(out_scale)

    def forward(self, x):
        return self.a2(x + self.a1(x))


X = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.slow
def test_a_healthy_masked_attention_is_clean_and_its_masks_are_listed_quietly(store):
    name = capture_pair(lambda: TwoAttentions(), X, torch.float16, store=store)
    rep = report.build_report(store, name)
    assert rep.first_nonfinite == {"fp32": None, "float16": None}
    masks = {m.op for m in rep.intended_nonfinite["fp32"]}
    assert masks == {"a1.masked_fill.0", "a2.masked_fill.0"}
    # the count is the strict upper triangle of 16x16 per batch element: independent arithmetic
    assert {m.count for m in rep.intended_nonfinite["fp32"]} == {2 * (16 * 15 // 2)}
    assert not [d for d in rep.diagnoses if d.severity == "error"]
    assert "apart from intended values (a mask, log(0), a fill)" in report.render_text(rep)


@pytest.mark.slow
def test_the_real_overflow_after_a_mask_is_named_not_the_mask(store):
    torch.manual_seed(0)
    probe = TwoAttentions(out_scale=30000.0)
    ref = _fp32_absmax(probe, X, {"a2.out"})["a2.out"]
    assert ref > FP16_MAX  # the injected failure is real
    torch.manual_seed(0)
    name = capture_pair(lambda: TwoAttentions(out_scale=30000.0), X, torch.float16, store=store)
    runs = _runs(store, name)
    assert report.first_nonfinite(store, runs["reference"].run_id) is None
    f = report.first_nonfinite(store, runs["candidate"].run_id)
    assert f.op == "a2.out.linear.0" and f.origin == "op"
    assert set(f.intended) >= {"a1.masked_fill.0", "a2.masked_fill.0"}
    d = [x for x in diagnose(store, name) if x.severity in ("error", "warn")]
    assert d[0].op == "a2.out.linear.0" and d[0].rule == "overflow"
    # the message quotes the reference's absmax of that op, which the hook above measured independently
    shown = float(d[0].message.split("absmax ")[1].split(" ")[0].replace(",", ""))
    assert shown == pytest.approx(ref, rel=1e-3)


@pytest.mark.slow
def test_torch_transformer_layer_with_a_float_causal_mask_is_not_blamed(store):
    def build():
        return nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)

    mask = nn.Transformer.generate_square_subsequent_mask(16)
    assert torch.isneginf(mask).any()
    name = capture_pair(build, {"src": X, "src_mask": mask, "is_causal": True}, torch.float16, store=store)
    for run in _runs(store, name).values():
        assert report.first_nonfinite(store, run.run_id) is None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        with torch.no_grad():
            self.blocks[1].fc.weight[0, 0] = 1e5

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.slow
def test_a_weight_that_overflows_on_the_cast_is_named_with_its_value(store):
    assert torch.isinf(torch.tensor(1e5).half())  # independent: 1e5 is beyond fp16
    name = capture_pair(Blocks, torch.randn(4, 8), torch.float16, store=store)
    f = report.first_nonfinite(store, _runs(store, name)["candidate"].run_id)
    assert f.origin == "parameter" and not f.producer
    assert f.parameter.name == "blocks.1.fc.weight"
    assert f.parameter.ref_absmax == pytest.approx(1e5)
    assert "1.0e+05 > fp16 max 65,504" in f.reason
    d = diagnose(store, name)[0]
    assert d.rule == "parameter-nonfinite" and "blocks.1.fc.weight" in d.message
    assert "keep-fp32:blocks.1.fc" in d.fixes and "use-bf16" in d.fixes


@pytest.mark.slow
def test_qwen2_mlp_overflow_is_named_at_down_proj_with_the_first_nan_apart(store):
    import transformers  # a test dependency (requirements-test.txt)

    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")

    def build():
        m = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight.mul_(1000.0)
            m.model.layers[1].post_attention_layernorm.weight.mul_(80.0)
        return m

    ids = {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))}
    torch.manual_seed(0)
    absmax = _fp32_absmax(build(), ids, {"model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj"})
    assert absmax["model.layers.1.mlp.down_proj"] > FP16_MAX > absmax["model.layers.0.mlp.down_proj"]
    name = capture_pair(build, ids, torch.float16, store=store)
    runs = _runs(store, name)
    assert report.first_nonfinite(store, runs["reference"].run_id) is None
    f = report.first_nonfinite(store, runs["candidate"].run_id)
    assert f.op.startswith("model.layers.1.mlp.down_proj.") and f.origin == "op"
    # the overflow makes inf; the NaN is made later, where the inf is combined (the final RMSNorm)
    assert f.first_nan is not None and f.first_nan.seq > f.seq
    assert f.first_nan.op != f.op


@pytest.mark.slow
def test_an_msprobe_dump_with_a_mask_keeps_its_producer_and_lists_the_mask(store, tmp_path):
    def ingest_copy(name, mutate=None):
        d = tmp_path / name
        shutil.copytree(SAMPLES / "stat_mix_fp16_inner_ovf", d)
        if mutate:
            p = next(d.rglob("dump.json"))
            j = json.loads(p.read_text())
            j["data"] = mutate(j["data"])
            p.write_text(json.dumps(j))
        sess = ingest(d, store=store, session=name)
        rid = q.session_runs(store, store.session(sess).session_id)[0].run_id
        return rid

    def add_mask(data):
        out = {}
        for k, v in data.items():
            out[k] = v
            if k == "Tensor.__truediv__.0.forward":
                o = dict(v["output"][0], Min=float("-inf"))
                out["Tensor.masked_fill.0.forward"] = {"input_args": [v["output"][0]], "input_kwargs": {},
                                                       "output": [o]}
            if k == "Functional.softmax.0.forward":
                v["input_args"][0] = dict(v["input_args"][0], Min=float("-inf"))
        return out

    plain = report.first_nonfinite(store, ingest_copy("plain"))
    masked_run = ingest_copy("masked", add_mask)
    masked = report.first_nonfinite(store, masked_run)
    assert plain is not None and masked.op == plain.op
    assert [m.op for m in report.intended_nonfinite(store, masked_run)] == ["Tensor.masked_fill.0.forward"]


def test_an_empty_tensor_is_not_a_norm_artefact(store, tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    np.save(d / "model.empty.output.0.npy", np.zeros((0, 4), np.float16))
    big = np.full(70000, 300.0, np.float16)  # finite values whose fp16 sum of squares would overflow
    np.save(d / "model.big.output.0.npy", big)
    name = ingest(d, store=store)
    arts = report.norm_artefacts(store, store.session(name).session_id)
    assert [a.op for a in arts] == []  # our own statistics are float64: neither is an artefact
    rec = store.sql("SELECT numel, l2norm FROM tensors WHERE op = 'model.empty'").fetchone()
    assert rec[0] == 0 and (rec[1] is None or math.isnan(rec[1]))
    assert report.first_nonfinite(store, q.session_runs(store, store.session(name).session_id)[0].run_id) is None


def test_an_overflow_to_minus_inf_is_not_taken_for_a_mask(store, tmp_path):
    """Only masking ops write -inf on purpose: a Linear whose output overflows to -inf alone is the producer."""
    d = tmp_path / "dump"
    d.mkdir()
    x = np.linspace(-1, 1, 8, dtype=np.float16).reshape(2, 4)
    y = np.where(np.arange(8).reshape(2, 4) == 3, -np.inf, x).astype(np.float16)
    assert (np.isneginf(y).sum(), np.isposinf(y).sum()) == (1, 0)
    np.save(d / "model.fc.input.0.npy", x)
    np.save(d / "model.fc.output.0.npy", y)
    np.save(d / "model.act.input.0.npy", y)
    np.save(d / "model.act.output.0.npy", np.where(np.isneginf(y), np.nan, y).astype(np.float16))
    name = ingest(d, store=store)
    run_id = q.session_runs(store, store.session(name).session_id)[0].run_id
    f = report.first_nonfinite(store, run_id)
    assert f.op == "model.fc" and f.producer and f.order_known  # the order came from the data
    assert report.intended_nonfinite(store, run_id) == []


def _stat(dtype="torch.float16", shape=(2, 4), mx=1.0, mn=-1.0):
    return {"type": "torch.Tensor", "dtype": dtype, "shape": list(shape), "Max": mx, "Min": mn, "Mean": 0.0,
            "Norm": 1.0, "requires_grad": False}


@pytest.mark.slow
def test_an_msprobe_weight_that_overflowed_is_named_through_construct_json(store, tmp_path):
    """msprobe names functional ops by counter (Functional.linear.0.forward), not by module: its construct.json
    says which module each ran in, so the parameter the module records is found and named."""
    inf = float("inf")
    data = {
        "Functional.linear.0.forward": {"input_args": [_stat(), _stat(shape=(4, 4), mx=inf), _stat(shape=(4,))],
                                        "input_kwargs": {}, "output": [_stat(mx=inf)]},
        "Module.block.fc.Linear.forward.0": {"input_args": [_stat()], "input_kwargs": {}, "output": [_stat(mx=inf)],
                                             "parameters": {"weight": _stat(shape=(4, 4), mx=inf),
                                                            "bias": _stat(shape=(4,))}},
        "Functional.gelu.0.forward": {"input_args": [_stat(mx=inf)], "input_kwargs": {},
                                      "output": [_stat(mx=float("nan"), mn=float("nan"))]},
    }
    d = tmp_path / "ms" / "step0" / "rank0"
    d.mkdir(parents=True)
    (d / "dump.json").write_text(json.dumps({"task": "statistics", "level": "mix", "framework": "pytorch",
                                             "dump_data_dir": None, "data": data}))
    (d / "construct.json").write_text(json.dumps({"Functional.linear.0.forward": "Module.block.fc.Linear.forward.0",
                                                  "Module.block.fc.Linear.forward.0": None,
                                                  "Functional.gelu.0.forward": None}))
    name = ingest(tmp_path / "ms", store=store)
    run_id = q.session_runs(store, store.session(name).session_id)[0].run_id
    assert q.op_parents(store, run_id).by_op == {"Functional.linear.0.forward": "Module.block.fc.Linear.forward.0"}
    f = report.first_nonfinite(store, run_id)
    assert f.origin == "parameter" and f.parameter.name == "block.fc.weight"
    assert f.op == "Module.block.fc.Linear.forward.0"
    # without construct.json the module is not known to hold the functional op; walking back from gelu's NaN, the
    # nearest op that wrote +inf is the module whose weight holds it
    (d / "construct.json").unlink()
    name2 = ingest(tmp_path / "ms", store=store)
    run2 = q.session_runs(store, store.session(name2).session_id)[0].run_id
    f2 = report.first_nonfinite(store, run2)
    print(f2)
    assert f2.origin == "parameter" and f2.parameter.name == "block.fc.weight"



# a fast subset of the published localization corpus (bench/localization.py), judged by the bench's own rule
@pytest.mark.parametrize("model,kind,how", [
    ("seed-softmax", "softmax", "live"), ("seed-tiny-eps", "tiny-eps", "dump-unordered"),
    ("seed-fp8-zero-scale", "fp8-zero-scale", "live"), ("seed-zero-norm", "zero-norm", "dump-ordered"),
    ("seed-attention", "activation", "live"), ("seed-blocks", "weight", "dump-unordered"),
    ("gpt2", "weight", "live"), ("bert", "activation", "dump-unordered"),
])
@pytest.mark.slow
def test_localization_corpus_subset(store, tmp_path, model, kind, how):
    LOC = _bench()
    base, template, inputs = LOC._model(model)
    path = template.format(i=1)
    build = LOC._injector(base, inputs, path, kind) if kind in LOC.KINDS else base
    if how == "live":
        f, _ = LOC._live(store, build, inputs)
    else:
        folder = tmp_path / "dump"
        LOC._dump(build, inputs, folder, ordered=how == "dump-ordered")
        f, _ = LOC._from_dump(store, folder)
    assert LOC._right(f, path, kind, how, None), (path, f and f.op, f and f.reason)


def _msprobe_dump(tmp_path, data) -> Path:
    d = tmp_path / "ms" / "step0" / "rank0"
    d.mkdir(parents=True)
    (d / "dump.json").write_text(json.dumps({"task": "statistics", "level": "mix", "framework": "pytorch",
                                             "dump_data_dir": None, "data": data}))
    return tmp_path / "ms"


def test_a_dump_gets_the_format_story_of_a_square_that_overflows(store, tmp_path):
    x = _stat(mx=304.0, mn=296.0)
    data = {"Tensor.__add__.0.forward": {"input_args": [_stat()], "input_kwargs": {}, "output": [x]},
            "Tensor.__mul__.0.forward": {"input_args": [x, x], "input_kwargs": {},
                                         "output": [_stat(mx=float("inf"), mn=float("inf"))]}}
    name = ingest(_msprobe_dump(tmp_path, data), store=store)
    d = diagnose(store, name)[0]
    assert d.rule == "product-overflow" and d.op == "Tensor.__mul__.0.forward"
    assert f"x^2 = {304 * 304:,}" in d.message and f"{FP16_MAX:,.0f}" in d.message
    assert f"{math.sqrt(FP16_MAX):.4g}" in d.message


@pytest.mark.parametrize("op,args,words", [
    ("Tensor.reciprocal.0.forward", [_stat(mn=0.0, mx=0.009)], ["1/0 = inf"]),
    ("Tensor.__truediv__.0.forward", [_stat(), _stat(shape=(2, 1), mn=0.0, mx=3.0)], ["0/0 = NaN"]),
    ("Torch.rsqrt.0.forward", [_stat(shape=(2, 1), mn=0.0, mx=0.5)], ["rsqrt(0) = inf", "1e-8"]),
    ("Tensor.reciprocal.0.forward", [_stat(mn=1e-6, mx=3e-6)], ["1e-06 < 1/65,504"]),
])
@pytest.mark.slow
def test_a_dump_gets_the_format_story_of_a_division(store, tmp_path, op, args, words):
    out_nan = "truediv" in op
    out = _stat(mx=float("nan") if out_nan else float("inf"), mn=float("nan") if out_nan else 0.0)
    name = ingest(_msprobe_dump(tmp_path, {op: {"input_args": args, "input_kwargs": {}, "output": [out]}}),
                  store=store)
    d = diagnose(store, name)[0]
    assert d.rule == "division" and d.op == op
    for w in words:
        assert w in d.message, d.message
    # independent facts the message rests on
    assert np.float16(1e-8) == 0 and np.isinf(np.float16(1) / np.float16(0))


@pytest.mark.slow
def test_a_captured_rsqrt_of_a_padding_row_is_explained(store):
    base, _t, x = _bench()._model("seed-tiny-eps")
    name = capture_pair(base, x, torch.float16, store=store)
    d = [x for x in diagnose(store, name) if x.severity == "error"][0]
    assert d.rule == "division" and d.op == "fail.rsqrt.0" and "rsqrt(0) = inf" in d.message

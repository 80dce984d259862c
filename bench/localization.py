"""How often Precision Lab names the op where a failure really started, how often it names one where nothing
failed, and how long it takes to say so.

Every model is built from config or from code with random weights (no downloads).  Two corpora:

The injected corpus: Hugging Face ``transformers`` Qwen2, Llama, GPT-2, BERT and T5, and two small seed models
(a causal attention that masks its scores with ``masked_fill(-inf)``, and a stack of Linear+GELU blocks).  Kinds:

- ``activation``: one Linear-like module's weight and bias are scaled so its fp32 output reaches twice fp16's
  max (measured first with a plain fp32 forward), while the weight itself stays inside fp16's range;
- ``weight``: one weight element is set to 1e5, which becomes inf when the model is cast to fp16;
- seed failures that need no injection, each after a causal attention that masks with ``-inf``: softmax without
  max subtraction (exp overflows fp16), one-pass variance on values near 300 (x^2 overflows), RMSNorm with eps
  1e-8 (0 in fp16: 0 x rsqrt(0) = NaN on a padding row), row-wise fp8-style scale of an all-zero row (0 x inf),
  and L2 normalisation of a zero row (0/0, in fp32 too).

The extended corpus (``bench/localization_cases.py``):

- ``healthy`` controls, scored as false alarms: Qwen2, Llama, GPT-2, BERT, T5, Mistral, GPT-NeoX, OPT, Gemma
  (eager attention, an ``attention_mask`` with padding so ``transformers`` builds its ``finfo.min`` additive
  mask) and both seed models, in fp16 and bf16, forward and forward + ``loss.backward()``; the fp32 reference of
  each fp16 pair is a control of its own;
- ``mask-constant`` controls: the seed attention with its causal mask made by ``masked_fill(-inf)``,
  ``torch.where(mask, s, tensor(-inf))``, ``s + mask.to(dtype) * finfo(float32).min`` (``-inf`` in fp16, the
  output finite and right), ``full_like(s, -inf).triu(1)`` and ``s.new_full(..., -inf).triu(1)``;
- ``not-first``: the first non-finite value in execution order is not the origin: a mask's ``-inf`` (written by
  a mul, ``where`` or ``full_like``) or ``log_softmax``'s ``-inf`` before a real overflow, a NaN the fp32
  reference holds too before an fp16-only overflow, a padding mask in Llama/BERT/GPT-2 before an overflow in
  layer 1;
- ``quiet-loss`` (no NaN; judged by the op ranked first by local error, or a diagnosis): one-pass variance with
  a large common mean in bf16 and fp16 (the subtraction cancels), ``(h + 2048) - 2048`` in fp16 (the add is
  named, by an ``absorption`` diagnosis: it rounds h to fp16's spacing 2 there, and the subtraction after it is
  exact), position ids counted past 2048 in fp16, a token count in fp16 that sticks at 2048 (``integer-limit``),
  gradients below fp16's smallest subnormal (``gradient-underflow``);
- ``fp8-outlier`` (policy ``fp8-e4m3-tensor``): one weight element, or one input channel, far above the rest
  flushes the other values to zero; the layer's own quantisation (``weight_quant`` / ``act_quant``) must rank
  first by local error or be diagnosed;
- ``buffer``: a BatchNorm ``running_var`` / ``running_mean`` element set to 1e5 (inf in fp16): the buffer must
  be named, origin "parameter";
- ``tied-weight``: an element of an embedding tied to the output projection set to 1e5: the parameter named;
- ``backward-only``: forward finite, a gradient overflows in the fp16 backward: the backward op named;
- ``report``: failures rebuilt from public reports, each printed with its source: an fp8 scale computed in fp16
  (reciprocal overflows), row-wise fp8 scaling of an all-zero row, softmax without max subtraction, a bf16
  one-pass LayerNorm whose variance cancels to a negative number, eps 1e-12 (0 in fp16) in a LayerNorm over a
  zero row, a Qwen2 MLP ``down_proj`` output above 65504, a half-precision token counter stuck at 2048, and a
  +inf gradient that Adam turns into NaN weights on the next step (two training steps captured).

Each case is answered by the input kinds that apply: ``live`` (``capture_pair`` of the fp32 model against the
candidate dtype or policy), ``dump-ordered`` (every module's tensor inputs, its own parameters (``param``) and
buffers (``buffer``) and first output, and with a loss every leaf module's gradients as op ``<module>.backward``,
saved with forward and backward hooks as ``<path>.<input.i|kwarg.name|param.name|buffer.name|output.0>`` ``.npy`` files, ``.pt``
for bf16, with a ``manifest.json`` call-order list), ``dump-unordered`` (the same folder with no list and equal
file times, so the order must come from the data), and ``msprobe`` (Ascend msprobe's statistics dump, level
"mix", of the fp16 forward of the injected corpus, when ``mindstudio-probe`` is installed).

The judge is strict.  A failure is right only when the answer names the exact op and the right origin kind
("op", "parameter" or "input"): live, an op of the failing module itself (its functional op or its call; for a
seed or rebuilt failure, the op of the type that first produces the value; for a backward failure, its
backward op); in a dump, the failing module itself (``model.<path>``, ``model.<path>.backward``); for a
weight, buffer or tied weight, that parameter.  The enclosing module or an op of the right type elsewhere
earns nothing.  Where the op that writes the first NaN is not where the failure started, the live answer must
name both: the bf16 one-pass LayerNorm's ``rsqrt`` as the origin and its cancelling subtraction in an
``error-amplified`` diagnosis; the Adam case's backward op as the origin and ``optimizer-nonfinite`` for what
the optimizer did with it.  A quiet case with a mechanism of its own counts only that mechanism's diagnosis.
A healthy control is right when ``first_nonfinite`` names nothing.  Cases that raise are counted wrong and say
why.

    python bench/localization.py            # everything: two layers per injected model, every control dump
    python bench/localization.py --quick    # one layer per injected model; forward+backward controls live only

The ranked table is scored too: where a live capture has comparisons, the first row of its ranked worst
comparisons (``store.views.top_offenders``, non-finite rows included) must be the op the answer names (for a
quiet loss, an op the judge accepts).

It prints a table per kind and input kind (right, wrong, total, share, the ranked table's first row, answers
stated certain and how many of them were wrong, runs holding NaN/inf, median seconds), the same for the
healthy controls (wrong = false alarm), the rebuilt failures with their sources, every false alarm (case, input
kind, what was named, the reason given) and every miss with what was named instead.  Not part of CI's
pass/fail; ``tests/test_origin.py`` runs a few of the same cases as tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision_lab import capture_pair  # noqa: E402
from precision_lab.enums import Certainty, Direction, OriginKind  # noqa: E402
from precision_lab.fixes.policy import call_model  # noqa: E402
from precision_lab.live import PairOptions  # noqa: E402
from precision_lab.ops import canonical, module_path  # noqa: E402
from precision_lab.services.ingest import ingest  # noqa: E402
from precision_lab.services.report import first_nonfinite  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402
from precision_lab.store import queries as q  # noqa: E402
from precision_lab.store import views  # noqa: E402
from localization_cases import MaskedAttention, SeedAttention, SeedBlocks  # noqa: E402

FP16_MAX = float(torch.finfo(torch.float16).max)
INPUT_KINDS = ("live", "dump-ordered", "dump-unordered")


# ---- models --------------------------------------------------------------------------------------

def _hf(name: str):
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="eager", **small)
        return (lambda: tf.Qwen2ForCausalLM(cfg)), "model.layers.{i}.mlp.gate_proj"
    if name == "llama":
        cfg = tf.LlamaConfig(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="eager", **small)
        return (lambda: tf.LlamaForCausalLM(cfg)), "model.layers.{i}.mlp.up_proj"
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            attn_implementation="eager")
        return (lambda: tf.GPT2LMHeadModel(cfg)), "transformer.h.{i}.mlp.c_fc"
    if name == "bert":
        cfg = tf.BertConfig(intermediate_size=128, max_position_embeddings=64, attn_implementation="eager",
                            **small)
        return (lambda: tf.BertModel(cfg)), "encoder.layer.{i}.intermediate.dense"
    if name == "t5":
        cfg = tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, attn_implementation="eager")
        return (lambda: tf.T5ForConditionalGeneration(cfg)), "encoder.block.{i}.layer.1.DenseReluDense.wi"
    raise KeyError(name)


# failures that need no injection: each computes in the input's dtype, after a masked attention
class NaiveSoftmax(nn.Module):
    """exp() without max subtraction: logits above ln(65504) = 11.09 overflow fp16."""

    def forward(self, x):
        e = torch.exp(x * 8)
        return e / e.sum(-1, keepdim=True)


class OnePassNorm(nn.Module):
    """LayerNorm with E[x^2] - E[x]^2 on values near 300: x^2 overflows fp16."""

    def forward(self, x):
        x = x + 300
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) * torch.rsqrt(v + 1e-5)


class TinyEpsNorm(nn.Module):
    """RMSNorm with eps 1e-8, which rounds to 0 in fp16: a zero row gives 0 x rsqrt(0) = 0 x inf = NaN."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)


class ZeroScaleQuant(nn.Module):
    """Row-wise fp8-style fake quantisation: an all-zero row has amax 0, scale 0, reciprocal inf, 0 x inf."""

    def forward(self, x):
        scale = x.abs().amax(-1, keepdim=True) / 448.0
        inv = scale.reciprocal()
        return (x * inv).clamp(-448, 448) * scale


class ZeroNorm(nn.Module):
    """L2 normalisation of an all-zero (padding) row: 0 / 0 = NaN in fp32 as much as in fp16."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


SEED_FAILURES = {"seed-softmax": NaiveSoftmax, "seed-onepass-norm": OnePassNorm, "seed-tiny-eps": TinyEpsNorm,
                 "seed-fp8-zero-scale": ZeroScaleQuant, "seed-zero-norm": ZeroNorm}


class AttentionThen(nn.Module):
    """A masked causal attention (its -inf present in every run), then ``fail`` on the same input."""

    def __init__(self, fail: nn.Module):
        super().__init__()
        self.attn = MaskedAttention()
        self.fail = fail

    def forward(self, x):
        a = self.attn(x)
        return self.fail(x) + 0 * a.sum()


def _model(name: str):
    """(build, target path template, inputs)."""
    g = torch.Generator().manual_seed(0)
    if name in SEED_FAILURES:
        x = torch.randn(2, 8, 32, generator=g)
        x[0, 0] = 0.0  # a padding row
        return (lambda: AttentionThen(SEED_FAILURES[name]())), "fail", x
    if name == "seed-attention":
        return SeedAttention, "layers.{i}.out", torch.randn(2, 16, 32, generator=g)
    if name == "seed-blocks":
        return SeedBlocks, "layers.{i}.0", torch.randn(4, 16, generator=g)
    build, target = _hf(name)
    inputs = {"input_ids": torch.randint(0, 128, (2, 16), generator=g)}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(0, 128, (2, 8), generator=g)
    return build, target, inputs


# ---- injection -----------------------------------------------------------------------------------

def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _output_absmax(model, inputs, path: str) -> float:
    got = {}
    h = model.get_submodule(path).register_forward_hook(
        lambda m, i, o: got.__setitem__("a", float(o.detach().abs().max())))
    _forward(model, inputs)
    h.remove()
    return got["a"]


def _injector(base_build, inputs, path: str, kind: str):
    """A build() that returns the model with the failure injected (the same every call)."""
    torch.manual_seed(0)
    probe = base_build()
    scale = 2 * FP16_MAX / _output_absmax(probe, inputs, path) if kind == "activation" else None

    def build():
        torch.manual_seed(0)
        m = base_build()
        mod = m.get_submodule(path)
        with torch.no_grad():
            if kind == "activation":
                mod.weight.mul_(scale)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.mul_(scale)
            else:
                mod.weight.view(-1)[0] = 1e5
        return m

    m = build()
    if kind == "activation":
        assert float(m.get_submodule(path).weight.detach().abs().max()) < FP16_MAX, "the weight itself would overflow"
        assert _output_absmax(m, inputs, path) > FP16_MAX
    return build


# ---- the three ways to answer --------------------------------------------------------------------

def _live_pair(store, build, inputs, dtype=torch.float16, loss=None, local_error=False):
    """capture_pair of the fp32 model against ``dtype`` (a torch dtype or a policy): (candidate's answer,
    reference's answer, session name, candidate run id, seconds)."""
    t = time.perf_counter()
    name = capture_pair(build, inputs, dtype, store=store, pair=PairOptions(local_error=local_error, loss_fn=loss))
    runs = q.session_runs(store, store.session(name).session_id)
    cand = next(r for r in runs if r.kind == "candidate")
    ref = next(r for r in runs if r.kind == "reference")
    f = first_nonfinite(store, cand.run_id)
    secs = time.perf_counter() - t
    return f, first_nonfinite(store, ref.run_id), name, cand.run_id, secs


def _live(store, build, inputs):
    f, _, _, _, secs = _live_pair(store, build, inputs)
    return f, secs


def _dump(build, inputs, folder: Path, ordered: bool, dtype=torch.float16, loss=None) -> None:
    """Every module's tensor inputs, its own parameters (``param``) and buffers (``buffer``) and first output, and with
    ``loss`` every leaf module's gradients (as op ``<module>.backward``), saved in ``dtype``."""
    torch.manual_seed(0)
    model = build().to(dtype)
    if isinstance(inputs, dict):
        inputs = {k: v for k, v in inputs.items()}
    elif isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        inputs = inputs.to(dtype)
    saved, calls = {}, []

    def keep(key, x):
        if torch.is_tensor(x):
            saved[key] = x.detach().clone()

    def first_tensor(args, kwargs):
        for v in list(args) + list(kwargs.values()):
            if torch.is_tensor(v):
                return v
        return None

    def pre(name, mod):
        def hook(_m, args, kwargs):
            calls.append(name)
            for i, x in enumerate(args):
                keep(f"{name}.input.{i}", x)
            for k, x in kwargs.items():
                keep(f"{name}.kwarg.{k}", x)
            for role, got in (("param", mod.named_parameters(recurse=False)),
                              ("buffer", mod.named_buffers(recurse=False))):
                for k, x in got:
                    if x.is_floating_point() and x.numel():
                        keep(f"{name}.{role}.{k}", x)
        return hook

    def post(name):
        def hook(_m, _args, _kwargs, out):
            y = out if torch.is_tensor(out) else first_tensor(out if isinstance(out, (tuple, list)) else
                                                                 list(getattr(out, "values", lambda: [])()), {})
            if y is not None:
                keep(f"{name}.output.0", y)
        return hook

    def back(name):
        def hook(_m, grad_input, grad_output):
            calls.append(f"{name}.backward")
            for i, g in enumerate(grad_output):
                keep(f"{name}.backward.grad_output.{i}", g)
            for i, g in enumerate(grad_input):
                keep(f"{name}.backward.grad_input.{i}", g)
        return hook

    for path, mod in model.named_modules():
        name = f"model.{path}" if path else "model"  # the root's name is a prefix of every other
        mod.register_forward_pre_hook(pre(name, mod), with_kwargs=True)
        mod.register_forward_hook(post(name), with_kwargs=True)
        if loss is not None and path and not any(True for _ in mod.children()) and any(
                True for _ in mod.parameters(recurse=False)):
            mod.register_full_backward_hook(back(name))
    if loss is None:
        _forward(model, inputs)
    else:
        loss(call_model(model, inputs)).backward()
    folder.mkdir(parents=True)
    for n, a in saved.items():
        if a.dtype == torch.bfloat16:
            f = folder / f"{n}.pt"
            torch.save(a.contiguous(), f)
        else:
            f = folder / f"{n}.npy"
            np.save(f, a.numpy())
        os.utime(f, ns=(1_700_000_000_000_000_000,) * 2)
    if ordered:
        order = [n for c in calls for n in saved if n.rsplit(".", 2)[0] == c]
        (folder / "manifest.json").write_text(json.dumps({"call_order": order}))


class _Msprobe:
    """Ascend msprobe's statistics dump (level "mix": modules and functional ops) of one fp16 forward per case.
    Its debugger is one per process: each case is one of its steps."""

    def __init__(self, root: Path):
        from msprobe.pytorch import PrecisionDebugger

        root.mkdir(parents=True, exist_ok=True)
        cfg = root / "config.json"
        cfg.write_text(json.dumps({"task": "statistics", "dump_path": str(root), "rank": [], "step": [],
                                   "level": "mix", "statistics": {"scope": [], "list": [], "data_mode": ["all"]}}))
        self.root, self.debugger, self.step = root, PrecisionDebugger(config_path=str(cfg)), 0

    def dump(self, build, inputs) -> Path:
        model = build().half()
        inputs = inputs if isinstance(inputs, dict) else inputs.half()
        self.debugger.start(model)
        _forward(model, inputs)
        self.debugger.stop()
        self.debugger.step()
        self.step += 1
        return self.root / f"step{self.step - 1}"


def _msprobe(root: Path):
    """The msprobe dumper, or None when ``mindstudio-probe`` is not installed."""
    try:
        return _Msprobe(root)
    except ImportError:
        return None


_LAST_RUN: dict = {}  # the run _from_dump read last (for _held)


def _from_dump(store, folder: Path):
    t = time.perf_counter()
    name = ingest(folder, store=store)
    run = q.session_runs(store, store.session(name).session_id)[0]
    _LAST_RUN["run_id"] = run.run_id
    return first_nonfinite(store, run.run_id), time.perf_counter() - t


# the op inside a seed failure that makes the first non-finite value, as a live capture names its type
FIRST_OP_TYPE = {"softmax": "exp", "onepass-norm": "mul", "tiny-eps": "rsqrt", "fp8-zero-scale": "reciprocal",
                 "zero-norm": "div"}


def _live_module(op: str) -> str:
    """The module a live capture's op belongs to: ``a.b.linear.0`` and ``a.b.forward.0`` -> ``a.b``, a
    backward op ``a.b.linear.0.backward`` -> ``a.b``, a root-level ``exp.0`` -> ``""``."""
    parts = op.removesuffix(".backward").split(".")
    return ".".join(parts[:-2])


def _type_in(op_type, types) -> bool:
    return types is None or op_type in types or canonical(op_type) in types


def _expect(path: str, kind: str) -> dict:
    """What the original kinds must name."""
    if kind == "weight":
        return {"origin": "parameter", "params": {f"{path}.weight"}}
    if kind in FIRST_OP_TYPE:
        return {"origin": "op", "module": path, "types": {FIRST_OP_TYPE[kind]}}
    return {"origin": "op", "module": path, "types": None}


def _judge(f, expect: Optional[dict], how: str) -> bool:
    """The strict judge: a healthy control (``expect`` None) is right when nothing is named; a failure when the
    exact op (or parameter) and the right origin kind are named."""
    if expect is None:
        return f is None
    if f is None:
        return False
    if "params" in expect:
        name = f.parameter.name if f.parameter else None
        if name and how != "live":
            name = name.removeprefix("model.")
        return f.origin is OriginKind.PARAMETER and name in expect["params"]
    if f.origin is not OriginKind.OP:
        return False
    op, backward = f.op, expect.get("backward", False)
    if how == "live":
        return ((f.direction is Direction.BACKWARD) == backward and _live_module(op) == expect["module"]
                and _type_in(f.op_type, expect.get("types")))
    want = "model" + (f".{expect['module']}" if expect["module"] else "") + (".backward" if backward else "")
    return op == want


def _right(f, path: str, kind: str, how: str, folder: Optional[Path] = None) -> bool:
    if how == "msprobe":
        if f is None or (kind in FIRST_OP_TYPE and canonical(f.op_type) != FIRST_OP_TYPE[kind]):
            return False
        if kind == "weight":
            return f.origin is OriginKind.PARAMETER and f.parameter.name.endswith(f"{path}.weight")
        # the named op, or a module call it ran inside (msprobe's own construct.json), is the injected module
        parents = json.loads(next(folder.rglob("construct.json")).read_text())
        op, seen = f.op, 0
        while op is not None and seen < 64:
            if module_path(op) == path:
                return True
            op, seen = parents.get(op), seen + 1
        return False
    return _judge(f, _expect(path, kind), how)


def _op_type_of(store, run_id: str, op: str) -> Optional[str]:
    got = store.sql("SELECT any_value(op_type) FROM tensors WHERE run_id = ? AND op = ?", [run_id, op]).fetchone()
    return got[0] if got else None


def _judge_quiet(store, session: str, run_id: str, expect: dict) -> tuple[bool, str, Optional[bool]]:
    """A quiet loss is found when the op ranked first by local error, or an op a diagnosis names, is an op of
    the expected module (of the expected type, when given).  Returns (right, what was named, whether the
    ranked table's first row is such an op)."""
    from precision_lab.services.diagnose import diagnose

    def match(op):
        if not op:
            return False
        m, types = expect["module"], expect.get("types")
        if types is None:
            return op == m or op.startswith(m + ".")
        return _live_module(op) == m and _type_in(_op_type_of(store, run_id, op), types)

    ranked = q.ops_by_local_error(store, run_id)
    diags = [d for d in diagnose(store, session) if d.run_id == run_id]
    named = f"top local error: {ranked[0] if ranked else None}"
    if diags:
        named += "; diagnoses: " + ", ".join(f"{d.rule}@{d.op}" for d in diags[:3])
    row = _first_row(store, run_id)
    first = None if row is None else match(row["op"])
    if row is not None and not first:
        named += f"; first row: {row['op']}"
    if expect.get("rule"):  # only that mechanism's diagnosis counts
        return any(d.rule == expect["rule"] and match(d.op) for d in diags), named, first
    return (bool(ranked) and match(ranked[0])) or any(match(d.op) for d in diags), named, first


def _cause_named(store, session: str, run_id: str, cause: dict) -> tuple[bool, str]:
    """Whether the run's diagnoses name an op of ``cause['types']`` with rule ``cause['rule']``; (right, what the
    diagnoses named)."""
    from precision_lab.services.diagnose import diagnose

    diags = [d for d in diagnose(store, session) if d.run_id == run_id]
    hit = any(d.rule == cause["rule"] and _type_in(_op_type_of(store, run_id, d.op), cause.get("types"))
              for d in diags)
    return hit, "diagnoses: " + (", ".join(f"{d.rule}@{d.op}" for d in diags[:3]) or "none")


def _first_row(store, run_id: str):
    """The first row of the run's ranked worst comparisons (Top offenders and the report's table, non-finite
    ones included); None where the run has no comparison (a dump without a reference)."""
    sid = store.sql("SELECT session_id FROM runs WHERE run_id = ?", [run_id]).fetchone()[0]
    top = views.top_offenders(store, sid, kinds=views.ACCUMULATED_KINDS + views.LOCAL_KINDS,
                              include_nonfinite=True, n=1, run_id=run_id)
    return None if top.empty else top.iloc[0]


def _first_row_right(store, f, right: bool) -> Optional[bool]:
    """Whether the ranked table's first row is the op the (right) answer names: None where there is no table."""
    if f is None:
        return None
    row = _first_row(store, f.run_id)
    return None if row is None else bool(right and row["op"] == f.op)


# ---- the corpus ---------------------------------------------------------------------------------

MODELS = ("qwen2", "llama", "gpt2", "bert", "t5", "seed-attention", "seed-blocks")
KINDS = ("activation", "weight")  # injected into MODELS; SEED_FAILURES fail by themselves
HEALTHY = ("healthy", "mask-constant", "intended-nonfinite")


def _dtype_name(d) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(d, getattr(d, "name", str(d)))


def _held(store, kind: Optional[str] = None, last: bool = False) -> bool:
    """Whether the runs of ``store`` of run kind ``kind`` (reference or candidate), or the run made last, hold any
    NaN or inf: a healthy control that does holds intended non-finite values."""
    where = "r.run_id = ?" if last else "r.kind = ?"
    got = store.sql("SELECT coalesce(bool_or(t.nonfinite), false) FROM tensors t JOIN runs r USING (run_id) "
                    f"WHERE {where}", [_LAST_RUN.get("run_id") if last else kind]).fetchone()
    return bool(got and got[0])


def _row(kind, case, how, right, f, secs, expected="", source="", named=None, held=False, first=None):
    return {"kind": kind, "case": case, "how": how, "right": right, "secs": secs, "expected": expected,
            "held": held, "first": first,
            "source": source, "certain": f is not None and f.certainty is Certainty.CERTAIN,
            "named": named if named is not None else (
                None if f is None else f"{f.op} ({f.op_type}, origin {f.origin}"
                + (f", parameter {f.parameter.name}" if f.parameter else "") + ")"),
            "reason": None if f is None else f.reason}


def _describe(expect) -> str:
    if expect is None:
        return "nothing"
    if "params" in expect:
        return "parameter " + " or ".join(sorted(expect["params"]))
    where = expect["module"] or "<root>"
    types = "/".join(sorted(expect["types"])) if expect.get("types") else "its own op"
    cause = expect.get("cause")
    return (f"{'quiet: ' if expect.get('quiet') else ''}{where} {types}" + (" (backward)" if expect.get("backward") else "")
            + (f" ({expect['rule']})" if expect.get("rule") else "")
            + (f", and {cause['rule']}" + (f" at {'/'.join(sorted(cause['types']))}" if cause.get("types") else "")
               if cause else ""))


def _run_case(c, tmp: Path, quick: bool) -> list[dict]:
    """Every input kind of one extended-corpus case."""
    rows = []
    healthy = c.expect is None
    quiet = bool(c.expect and c.expect.get("quiet"))
    dname = _dtype_name(c.dtype)
    hows = c.hows if not (quick and healthy and c.loss is not None) else ("live",)
    for how in hows:
        store = Store(":memory:")
        try:
            if how == "live":
                if c.runner is not None:
                    t = time.perf_counter()
                    f = c.runner(store)
                    right, named = _judge(f, c.expect, how), None
                    if right and c.expect.get("cause"):
                        right, why = _cause_named(store, q.session_list(store)[0].name, f.run_id,
                                                  c.expect["cause"])
                        named = None if right else f"{f.op}; {why}"
                    rows.append(_row(c.kind, c.name, how, right, f, time.perf_counter() - t,
                                     _describe(c.expect), c.source, named))
                    continue
                f, fref, session, run_id, secs = _live_pair(store, c.build, c.inputs, c.dtype, c.loss,
                                                            local_error=quiet)
                if quiet:
                    right, named, first = _judge_quiet(store, session, run_id, c.expect)
                    if f is not None and not c.expect.get("any_nonfinite"):
                        named += f"; first_nonfinite {f.op}"
                    rows.append(_row(c.kind, c.name, how, right, f, secs, _describe(c.expect), c.source, named,
                                     first=first))
                    continue
                right, named = _judge(f, c.expect, how), None
                if right and c.expect and c.expect.get("cause"):
                    right, why = _cause_named(store, session, run_id, c.expect["cause"])
                    named = None if right else f"{f.op}; {why}"
                rows.append(_row(c.kind, c.name, how, right, f, secs, _describe(c.expect), c.source, named,
                                 held=_held(store, "candidate"),
                                 first=None if healthy else _first_row_right(store, f, right)))
                if healthy and c.fp32_control:
                    fp32 = c.name.replace(f"/{dname}", "/fp32")
                    rows.append(_row(c.kind, fp32, how, fref is None, fref, secs, "nothing",
                                     held=_held(store, "reference")))
                elif healthy and fref is not None:
                    rows.append(_row(c.kind, c.name + " (its fp32 reference)", how, False, fref, secs, "nothing"))
            else:
                dtypes = [c.dtype] + ([torch.float32] if healthy and c.fp32_control else [])
                for d in dtypes:
                    folder = tmp / f"{c.kind}-{c.name.replace('/', '_')}-{_dtype_name(d)}-{how}"
                    _dump(c.build, c.inputs, folder, ordered=how == "dump-ordered", dtype=d, loss=c.loss)
                    f, secs = _from_dump(store, folder)
                    name = c.name if d is c.dtype else c.name.replace(f"/{dname}", "/fp32")
                    rows.append(_row(c.kind, name, how, _judge(f, c.expect, how), f, secs, _describe(c.expect),
                                     c.source, held=_held(store, last=True)))
        except Exception as e:  # a case the tool (or the dump) cannot run is a miss, and says why
            rows.append(_row(c.kind, c.name, how, False, None, 0.0, _describe(c.expect), c.source,
                             named=f"ERROR {type(e).__name__}: {str(e)[:200]}"))
        finally:
            close_all()
    return rows


def _table(rows, title):
    groups = defaultdict(list)
    for r in rows:
        groups[(r["kind"], r["how"])].append(r)
    print(f"| {title} | input | right | wrong | total | share | ranked table's first row right | stated certain | "
          f"certain and wrong | runs holding NaN/inf | median seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (k, h), rs in sorted(groups.items()):
        right = sum(r["right"] for r in rs)
        certain = sum(r["certain"] for r in rs)
        tabled = [r for r in rs if r["first"] is not None]
        first = (f"{sum(r['first'] for r in tabled)}/{len(tabled)}" if tabled else "-")
        print(f"| {k} | {h} | {right} | {len(rs) - right} | {len(rs)} | {100 * right / len(rs):.0f}% | {first} | "
              f"{certain} | "
              f"{sum(r['certain'] and not r['right'] for r in rs)} | {sum(r['held'] for r in rs)} | "
              f"{sorted(r['secs'] for r in rs)[len(rs) // 2]:.2f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one layer per model, fewer healthy dumps")
    ap.add_argument("--kinds", nargs="*", help="only these kinds of the extended corpus (and no injected corpus)")
    ap.add_argument("--no-msprobe", action="store_true", help="leave out msprobe dumps even when it is installed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import localization_cases as LC

    started = time.perf_counter()
    layers = (1,) if args.quick else (0, 1)
    rows = []
    cases = [(m, layer, kind) for m in MODELS for layer in layers for kind in KINDS]
    cases += [(m, None, m.removeprefix("seed-")) for m in SEED_FAILURES]
    if args.kinds:
        cases = []
    with tempfile.TemporaryDirectory() as tmp:
        ms = _msprobe(Path(tmp) / "msprobe") if not args.no_msprobe else None
        kinds = INPUT_KINDS + (("msprobe",) if ms is not None else ())
        for model, layer, kind in cases:
            base, template, inputs = _model(model)
            path = template.format(i=layer)
            build = _injector(base, inputs, path, kind) if kind in KINDS else base
            for how in kinds:
                store = Store(":memory:")
                folder, first = None, None
                if how == "live":
                    f, secs = _live(store, build, inputs)
                    first = _first_row_right(store, f, _right(f, path, kind, how))
                elif how == "msprobe":
                    folder = ms.dump(build, inputs)
                    f, secs = _from_dump(store, folder)
                else:
                    folder = Path(tmp) / f"{model}-{layer}-{kind}-{how}"
                    _dump(build, inputs, folder, ordered=how == "dump-ordered")
                    f, secs = _from_dump(store, folder)
                exp = _expect(path, kind)
                rows.append(_row(kind, f"{model}" + (f" layer {layer}" if layer is not None else ""), how,
                                 _right(f, path, kind, how, folder), f, secs, _describe(exp), first=first))
                close_all()
        for c in LC.corpus(args.quick):
            if args.kinds and c.kind not in args.kinds:
                continue
            rows.extend(_run_case(c, Path(tmp), args.quick))
    failing = [r for r in rows if r["kind"] not in HEALTHY]
    healthy = [r for r in rows if r["kind"] in HEALTHY]
    right = sum(r["right"] for r in failing)
    certain = [r for r in rows if r["certain"]]
    tabled = [r for r in failing if r["first"] is not None]
    print(f"{len(failing)} failing answers: {right} right ({100 * right / max(len(failing), 1):.0f}%), "
          f"the ranked table's first row right in {sum(r['first'] for r in tabled)} of the {len(tabled)} with a "
          f"table; "
          f"{len(healthy)} healthy answers: {sum(not r['right'] for r in healthy)} false alarms "
          f"({100 * sum(not r['right'] for r in healthy) / max(len(healthy), 1):.0f}%), on "
          f"{sum(r['held'] for r in healthy)} runs holding intended NaN/inf: "
          f"{sum(r['held'] and not r['right'] for r in healthy)} false alarms; "
          f"{len(certain)} answers stated certain: {sum(not r['right'] for r in certain)} of them wrong; "
          f"{time.perf_counter() - started:.0f} s\n")
    _table(failing, "kind")
    print("Healthy controls (right = nothing named; wrong = a false alarm):\n")
    _table(healthy, "controls")
    sources = {}
    for r in rows:
        if r["source"]:
            sources.setdefault((r["kind"], r["case"], r["source"]), []).append(f"{r['how']}: {'right' if r['right'] else 'WRONG'}")
    print("| rebuilt failure | kind | source | answers |")
    print("|---|---|---|---|")
    for (k, case, src), answers in sources.items():
        print(f"| {case} | {k} | {src} | {'; '.join(answers)} |")
    print()
    for r in healthy:
        if not r["right"]:
            print(f"false alarm: {r['case']} [{r['how']}]: named {r['named']}; reason: {r['reason']}")
    print()
    for r in failing:
        if not r["right"]:
            print(f"miss: {r['kind']} {r['case']} [{r['how']}]: expected {r['expected']}; named {r['named']}"
                  + (f"; reason: {r['reason']}" if r["reason"] else ""))
        elif r["first"] is False:
            print(f"first row wrong: {r['kind']} {r['case']} [{r['how']}]: expected {r['expected']}; "
                  f"named {r['named']}")


if __name__ == "__main__":
    main()

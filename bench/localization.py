"""How often Precision Lab names the op where a failure really started, and how long it takes to say so.

The corpus injects failures with a known origin into models built from config with random weights (no
downloads): Hugging Face ``transformers`` Qwen2, Llama, GPT-2, BERT and T5, and two small seed models (a causal
attention that masks its scores with ``masked_fill(-inf)``, and a stack of Linear+GELU blocks).  Kinds:

- ``activation``: one Linear-like module's weight and bias are scaled so its fp32 output reaches twice fp16's
  max (measured first with a plain fp32 forward), while the weight itself stays inside fp16's range;
- ``weight``: one weight element is set to 1e5, which becomes inf when the model is cast to fp16.

Each case is answered three ways: ``live`` (``capture_pair`` of the fp32 model against fp16), ``dump-ordered``
(every module's fp16 tensor inputs and first output saved with forward hooks as
``<path>.<input.i|kwarg.name|output.0>.npy``, with a
``manifest.json`` call-order list) and ``dump-unordered`` (the same folder with no list and equal file times,
so the order must come from the data), and ``msprobe`` (Ascend msprobe's statistics dump, level "mix", of
the fp16 forward, when ``mindstudio-probe`` is installed: its functional ops show the masks' -inf, and its
``construct.json`` says which module each op ran in).  A case counts as right when the named op is the injected module or
an op inside it; for a live ``weight`` case the parameter itself must be named, and for a live seed failure
the op inside the module that makes the first non-finite value (``FIRST_OP_TYPE``).

Seed failures that need no injection, each after a causal attention that masks with ``-inf`` (so the mask
is present in every run): softmax without max subtraction (exp overflows fp16), one-pass variance on values
near 300 (x^2 overflows), RMSNorm with eps 1e-8 (0 in fp16: 0 x rsqrt(0) = NaN on a padding row), row-wise
fp8-style scale of an all-zero row (0 x inf), and L2 normalisation of a zero row (0/0, in fp32 too).

    python bench/localization.py            # the whole corpus, a table per kind and per input
    python bench/localization.py --quick    # one layer per model

Not part of CI's pass/fail; ``tests/test_origin.py`` runs a few of the same cases as tests.
"""

from __future__ import annotations

import argparse
import json
import math
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

from precision_lab import capture_pair  # noqa: E402
from precision_lab.ops import canonical, module_path  # noqa: E402
from precision_lab.services.ingest import ingest  # noqa: E402
from precision_lab.services.report import first_nonfinite  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402
from precision_lab.store import queries as q  # noqa: E402

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


class MaskedAttention(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        t = x.shape[1]
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
        return self.out(torch.softmax(s, -1) @ self.v(x))


class SeedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MaskedAttention(), MaskedAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class SeedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


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

def _live(store, build, inputs):
    t = time.perf_counter()
    name = capture_pair(build, inputs, torch.float16, store=store, local_error=False)
    cand = next(r for r in q.session_runs(store, store.session(name)["session_id"]) if r["kind"] == "candidate")
    f = first_nonfinite(store, cand["run_id"])
    return f, time.perf_counter() - t


def _dump(build, inputs, folder: Path, ordered: bool) -> None:
    model = build().half()
    inputs = {k: v for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.half()
    saved, calls = {}, []

    def first_tensor(args, kwargs):
        for v in list(args) + list(kwargs.values()):
            if torch.is_tensor(v):
                return v
        return None

    def pre(name):
        def hook(_m, args, kwargs):
            calls.append(name)
            for i, x in enumerate(args):
                if torch.is_tensor(x):
                    saved[f"{name}.input.{i}"] = x.detach().numpy().copy()
            for k, x in kwargs.items():
                if torch.is_tensor(x):
                    saved[f"{name}.kwarg.{k}"] = x.detach().numpy().copy()
        return hook

    def post(name):
        def hook(_m, _args, _kwargs, out):
            y = out if torch.is_tensor(out) else first_tensor(out if isinstance(out, (tuple, list)) else
                                                                 list(getattr(out, "values", lambda: [])()), {})
            if y is not None:
                saved[f"{name}.output.0"] = y.detach().numpy().copy()
        return hook

    for path, mod in model.named_modules():
        name = f"model.{path}" if path else "model"  # the root's name is a prefix of every other
        mod.register_forward_pre_hook(pre(name), with_kwargs=True)
        mod.register_forward_hook(post(name), with_kwargs=True)
    _forward(model, inputs)
    folder.mkdir(parents=True)
    for n, a in saved.items():
        np.save(folder / f"{n}.npy", a)
        os.utime(folder / f"{n}.npy", ns=(1_700_000_000_000_000_000,) * 2)
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


def _from_dump(store, folder: Path):
    t = time.perf_counter()
    name = ingest(folder, store=store)
    run = q.session_runs(store, store.session(name)["session_id"])[0]
    return first_nonfinite(store, run["run_id"]), time.perf_counter() - t


# the op inside a seed failure that makes the first non-finite value, as a live capture names its type
FIRST_OP_TYPE = {"softmax": "exp", "onepass-norm": "mul", "tiny-eps": "rsqrt", "fp8-zero-scale": "reciprocal",
                 "zero-norm": "div"}


def _right(f, path: str, kind: str, how: str, folder: Optional[Path] = None) -> bool:
    if f is None:
        return False
    if how == "live" and kind == "weight":
        return f.origin == "parameter" and f.parameter.name == f"{path}.weight"
    if how in ("live", "msprobe") and kind in FIRST_OP_TYPE and canonical(f.op_type) != FIRST_OP_TYPE[kind]:
        return False
    if how == "msprobe":
        # the named op, or a module call it ran inside (msprobe's own construct.json), is the injected module
        parents = json.loads(next(folder.rglob("construct.json")).read_text())
        op, seen = f.op, 0
        while op is not None and seen < 64:
            if module_path(op) == path:
                return True
            op, seen = parents.get(op), seen + 1
        return False
    op = f.op
    if how != "live":
        path = f"model.{path}"
    return op == path or op.startswith(path + ".")


# ---- the corpus ---------------------------------------------------------------------------------

MODELS = ("qwen2", "llama", "gpt2", "bert", "t5", "seed-attention", "seed-blocks")
KINDS = ("activation", "weight")  # injected into MODELS; SEED_FAILURES fail by themselves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one layer per model")
    ap.add_argument("--no-msprobe", action="store_true", help="leave out msprobe dumps even when it is installed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = (1,) if args.quick else (0, 1)
    results = []
    cases = [(m, layer, kind) for m in MODELS for layer in layers for kind in KINDS]
    cases += [(m, None, m.removeprefix("seed-")) for m in SEED_FAILURES]
    with tempfile.TemporaryDirectory() as tmp:
        ms = _msprobe(Path(tmp) / "msprobe") if not args.no_msprobe else None
        kinds = INPUT_KINDS + (("msprobe",) if ms is not None else ())
        for model, layer, kind in cases:
            base, template, inputs = _model(model)
            path = template.format(i=layer)
            build = _injector(base, inputs, path, kind) if kind in KINDS else base
            for how in kinds:
                store = Store(":memory:")
                folder = None
                if how == "live":
                    f, secs = _live(store, build, inputs)
                elif how == "msprobe":
                    folder = ms.dump(build, inputs)
                    f, secs = _from_dump(store, folder)
                else:
                    folder = Path(tmp) / f"{model}-{layer}-{kind}-{how}"
                    _dump(build, inputs, folder, ordered=how == "dump-ordered")
                    f, secs = _from_dump(store, folder)
                results.append((model, kind, how, _right(f, path, kind, how, folder), secs, path, f and f.op))
                close_all()
    print(f"{len(results)} cases: {sum(r[3] for r in results)} right "
          f"({100 * sum(r[3] for r in results) / len(results):.0f}%)\n")
    for title, key in (("model", 0), ("kind", 1), ("input", 2)):
        groups = defaultdict(list)
        for r in results:
            groups[r[key]].append(r)
        print(f"| {title} | cases | right | share | median seconds to answer |")
        print("|---|---|---|---|---|")
        for g, rs in groups.items():
            right = sum(r[3] for r in rs)
            print(f"| {g} | {len(rs)} | {right} | {100 * right / len(rs):.0f}% | "
                  f"{sorted(r[4] for r in rs)[len(rs) // 2]:.2f} |")
        print()
    misses = [r for r in results if not r[3]]
    for r in misses:
        print(f"miss: {r[0]} {r[1]} {r[2]}: origin {r[5]}, named {r[6]}")


if __name__ == "__main__":
    main()

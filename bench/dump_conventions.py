"""Dumps as users really write them: does Precision Lab name the right module from a folder of tensors written
by plain PyTorch hooks, whatever its order, names or gaps?

Each case is one architecture, one failure kind and one writer.  The model (random weights, built from config
or code, no downloads) runs once in fp16 with a forward pre-hook and a forward hook on every module; every
writer then lays the same calls out as a folder the way people write them, and the ground truth is written
next to the folder (``<case>.truth.json``) before the tool reads it.

Architectures: ``transformers`` Qwen2, GPT-2 and BERT built from config, a conv net (Conv2d, BatchNorm, ReLU,
a Linear head), a hand-written causal attention (``masked_fill(-inf)``), a TransformerLens-style attention with
hook points and a stack of Linear+GELU blocks.

Failure kinds: ``activation`` (one Linear-like module's weight and bias scaled so its fp32 output reaches twice
fp16's max, the weight itself finite in fp16), ``weight`` (one weight element set to 1e5: inf once cast to
fp16), ``cast-gap`` (the same module's input scaled to twice fp16's max and cast with ``.to(torch.float16)``
where no module hook sees it; the dump is compared with the same writer's dump of the fp32 run), ``healthy``
(no failure: right when nothing is named, wrong = a false alarm) and ``healthy-intended`` (the healthy model
followed by a tail that holds NaN/inf on purpose and keeps the output finite, one kind per architecture:
``TAILS``; judged as ``healthy``).

Writers (``WRITERS``):

- ``outputs-equal``: ``register_forward_hook(lambda m, i, o: np.save(f"{name}.npy", o))``: outputs only, the
  root saved as ``model.npy`` (over the child of the same name in a Hugging Face model), all file times equal;
- ``outputs-coarse``: the same with coarse file times (8 files per clock tick);
- ``io-coarse``: ``<module>.input.0.npy`` and ``<module>.output.0.npy``, root ``model``, coarse file times;
- ``io-root-empty``: the same with the root written as ``input.0.npy``/``output.0.npy`` (name ``""``), equal
  times;
- ``io-root-class``: the root named by its class (``Qwen2ForCausalLM.output.0.npy``), equal times;
- ``dict-pt``: ``torch.save({"input": x, "output": y}, f"{name}.pt")`` per module, equal times;
- ``tuple-pt``: ``torch.save((args, out), f"{name}.pt")`` per module, coarse times;
- ``module-order-call``: inputs and outputs, ``manifest.json`` ``{"module_order": [...]}`` listing the
  modules in call order (pre-order), equal times;
- ``module-order-done``: the same, ``order.json`` listing the modules in completion order (post-order);
- ``tensor-order``: inputs and outputs, ``manifest.json`` ``{"execution_order": [...]}`` of file names in save
  order, equal times;
- ``prefixed-mtime``: every name under ``model.`` (``model.model.layers.1...``), distinct file times;
- ``safetensors-slash``: outputs only, every module's output in one ``activations.safetensors`` keyed by its
  path with ``/`` between names (``model/layers/1/mlp``), as ``save_file({name.replace(".", "/"): o})`` writes it;
  the file's keys come back sorted, so nothing in it gives the order;
- ``float32-dtypes``: inputs and outputs saved as ``t.float().numpy()`` with ``manifest.json``
  ``{"dtypes": {name: "float16"}}``, coarse times; right only when every tensor also comes back in its own dtype;
- ``numbered-npz``: ``np.savez(f"{n:03d}-{name}.npz", input=x.float().numpy(), output=y.float().numpy())`` per
  module, ``n`` counting the hook's calls (completion order), no order list, no dtypes, all file times equal;
  right only when the floating tensors also come back as fp16 (told from their values alone);

and as other people's scripts and libraries write them:

- ``one-pt-dict``: ``torch.save({name: out for each module}, "activations.pt")``: one file, outputs only, the
  keys in completion order;
- ``one-pt-nested``: ``torch.save({name: {"input": x, "output": y}}, "activations.pt")``;
- ``one-npz-keys``: ``np.savez("activations.npz", **{f"{name}.input.0": x, f"{name}.output.0": y})``;
- ``one-safetensors-io``: the same keys in one ``activations.safetensors`` (read back sorted: no order);
- ``folder-per-module-pt``: ``<name>/input.pt`` and ``<name>/output.pt``, one folder per module;
- ``step-folders``: inputs and outputs under ``step_000/`` and again under ``step_001/`` (two steps);
- ``rank-step-folders``: ``torch.save(out, f"rank0/step0/{name}.pt")``, outputs only, coarse times;
- ``outputs-pt-distinct``: ``torch.save(out, f"{name}.pt")``, distinct file times;
- ``order-txt``: inputs and outputs with ``order.txt``, one module name per line in call order;
- ``numbered-dict-pt``: ``torch.save({"input": x, "output": y}, f"{n:03d}_{name}.pt")``;
- ``float32-sidecars``: ``t.float().numpy()`` saved with a ``<file>.npy.json`` sidecar ``{"dtype": "float16"}``;
- ``inputs-only``: forward pre-hooks only (``<name>.input.0.npy``): the failing module's output is never seen,
  so the first module receiving it is right (origin "input").

``hooked-attention`` is a TransformerLens-style model whose ``hook_attn_scores`` modules output causal scores
with ``-inf`` above the diagonal in every run: its healthy dumps hold intended non-finite values, and its
failures come after them.

The judge is strict: a failure is right when the named op is the failing module under the writer's own name
(origin "op"), or its weight (origin "parameter"); a cast-gap case when that module is named for its input
(origin "input", "producer was not recorded"; with outputs only, origin "op"); a healthy case when nothing is
named.

    python bench/dump_conventions.py            # every architecture x kind x writer
    python bench/dump_conventions.py --quick    # three small architectures and Qwen2

It prints one line per writer and per architecture (right, wrong, false alarms, total, share, answers stated
certain and how many of them were wrong), the false alarms, and every miss with what was named instead.  ``tests/test_dump_conventions.py`` runs the small architectures as tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.numpy import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision_lab.enums import Certainty, OriginKind  # noqa: E402
from precision_lab.services.ingest import ingest  # noqa: E402
from precision_lab.services.report import first_nonfinite  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402
from precision_lab.store import queries as q  # noqa: E402
from localization_cases import (ArgmaxPick, HookPointAttention, InfPadSliced, LogMaskAttention,  # noqa: E402
                                LogZeroEntropy, MaskedMaxPool, NanToNum, NearestNeighbour, SeedAttention,
                                SeedBlocks, WithIntended)

FP16_MAX = float(torch.finfo(torch.float16).max)
KINDS = ("activation", "weight", "cast-gap", "healthy", "healthy-intended")
HEALTHY_KINDS = ("healthy", "healthy-intended")
BASE_NS = 1_700_000_000_000_000_000
TICK = 8  # files per clock tick with coarse file times


# ---- architectures ---------------------------------------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


def _hf(name: str):
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="eager", **small)
        return (lambda: tf.Qwen2ForCausalLM(cfg)), "model.layers.1.mlp.down_proj"  # fed by up_proj (FEEDS)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            attn_implementation="eager")
        return (lambda: tf.GPT2LMHeadModel(cfg)), "transformer.h.1.mlp.c_fc"
    if name == "bert":
        cfg = tf.BertConfig(intermediate_size=128, max_position_embeddings=64, attn_implementation="eager", **small)
        return (lambda: tf.BertModel(cfg)), "encoder.layer.1.intermediate.dense"
    raise KeyError(name)


# a target whose own weight cannot carry the whole scale shares it with the module feeding it (its output is
# linear in that module's weight: Qwen2's down_proj(act(gate_proj(x)) * up_proj(x)))
FEEDS = {"model.layers.1.mlp.down_proj": "model.layers.1.mlp.up_proj"}
class HookedAttention(nn.Module):
    """Two TransformerLens-style attention layers: each ``hook_attn_scores`` module outputs causal scores with
    ``-inf`` above the diagonal in every run (intended), ``hook_pattern`` the softmax over them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([HookPointAttention(), HookPointAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


SMALL_ARCHS = ("mlp", "attention", "convnet", "hooked-attention")
ARCHS = SMALL_ARCHS + ("qwen2", "gpt2", "bert")


# ``healthy-intended``: each architecture's healthy model with a tail that holds non-finite values on purpose
# (of 8 kinds, with hooked-attention's own hook points) and keeps the output finite
TAILS = {"mlp": NearestNeighbour, "attention": MaskedMaxPool, "convnet": LogZeroEntropy,
         "hooked-attention": NanToNum, "qwen2": InfPadSliced, "gpt2": LogMaskAttention, "bert": ArgmaxPick}


def arch(name: str):
    """``(build, target module path, inputs)`` of an architecture."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        return SeedBlocks, "layers.1.0", torch.randn(4, 16, generator=g)
    if name == "attention":
        return SeedAttention, "layers.1.v", torch.randn(2, 16, 32, generator=g)
    if name == "convnet":
        return ConvNet, "features.3", torch.randn(2, 3, 8, 8, generator=g)
    if name == "hooked-attention":
        return HookedAttention, "layers.1.v", torch.randn(2, 16, 32, generator=g)
    build, target = _hf(name)
    return build, target, {"input_ids": torch.randint(0, 128, (2, 16), generator=g)}


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _first_tensor(obj):
    if torch.is_tensor(obj):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for v in obj:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _cast_before(model: nn.Module, target: str, inputs, dtype) -> None:
    """``cast-gap``: a scale and ``.to(dtype)`` of the target's input that no module hook sees (registered before
    the capture's hooks, so they record its result): in fp16 the cast overflows, in fp32 it does not."""
    mod = model.get_submodule(target)
    got = {}
    h = mod.register_forward_pre_hook(lambda m, a: got.__setitem__("a", float(a[0].detach().float().abs().max())))
    _forward(model, inputs)
    h.remove()
    scale = 2 * FP16_MAX / got["a"]
    mod.register_forward_pre_hook(lambda m, a: ((a[0].float() * scale).to(dtype),) + tuple(a[1:]))


def _built(name: str, kind: str, dtype=torch.float16):
    """The model of ``arch(name)`` with failure ``kind`` injected, in ``dtype`` (fp16; fp32 for the reference of
    ``cast-gap``), and its inputs."""
    base, target, inputs = arch(name)
    torch.manual_seed(0)
    model = base().eval()
    mod = model.get_submodule(target)
    if kind == "healthy-intended":
        width = _first_tensor(_forward(model, inputs)).shape[-1]
        model = WithIntended(model, TAILS[name], width).eval()
    if kind == "cast-gap":
        model = model.to(dtype)
        inputs = inputs if isinstance(inputs, dict) else inputs.to(dtype)
        _cast_before(model, target, inputs, dtype)
        return model, target, inputs
    if kind == "activation":
        got = {}
        h = mod.register_forward_hook(lambda m, i, o: got.__setitem__("a", float(o.detach().abs().max())))
        _forward(model, inputs)
        h.remove()
        scale = 2 * FP16_MAX / got["a"]
        share = {target: scale}
        if target in FEEDS:
            share = {target: scale ** 0.5, FEEDS[target]: scale ** 0.5}
        with torch.no_grad():
            for path, s in share.items():
                m = model.get_submodule(path)
                m.weight.mul_(s)
                if getattr(m, "bias", None) is not None:
                    m.bias.mul_(s)
                assert float(m.weight.abs().max()) < FP16_MAX, "the weight itself would overflow"
    elif kind == "weight":
        with torch.no_grad():
            mod.weight.view(-1)[0] = 1e5
    model = model.half()
    if not isinstance(inputs, dict):
        inputs = inputs.half()
    return model, target, inputs


# ---- one run, every module's call ------------------------------------------------------------------

@dataclass
class Call:
    path: str  # "" for the root
    pre: int  # call order
    post: int  # completion order
    input: Optional[np.ndarray]
    output: Optional[np.ndarray]


def capture(model: nn.Module, inputs) -> tuple[list[Call], str]:
    """Every module's first call (its first tensor input and first tensor output), and the root's class name."""
    calls: dict[str, Call] = {}
    counter = {"pre": 0, "post": 0}
    handles = []

    def arr(t):
        return None if t is None else t.detach().cpu().numpy().copy()

    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue

        def pre(m, args, kwargs, path=path):
            if path not in calls:
                calls[path] = Call(path, counter["pre"], -1, arr(_first_tensor((args, kwargs))), None)
                counter["pre"] += 1

        def post(m, args, kwargs, out, path=path):
            c = calls[path]
            if c.post < 0:
                c.post, c.output = counter["post"], arr(_first_tensor(out))
                counter["post"] += 1

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    _forward(model, inputs)
    for h in handles:
        h.remove()
    return [c for c in calls.values() if c.post >= 0 and c.output is not None], type(model).__name__


def _bad(a: Optional[np.ndarray]) -> bool:
    """Whether a tensor holds a NaN or inf that is no causal mask's ``-inf`` (those are intended)."""
    if a is None or a.dtype.kind != "f":
        return False
    a = a.astype(np.float32)
    return bool(np.isnan(a).any() or np.isposinf(a).any()) or (bool(np.isneginf(a).any()) and not _mask(a))


def _mask(a: np.ndarray) -> bool:
    """Whether ``a``'s ``-inf`` values are exactly a causal mask's (above the diagonal of its last two axes)."""
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        return False
    upper = np.triu(np.ones(a.shape[-2:], bool), 1)
    return bool((np.isneginf(a) == upper).all())


def truth(calls: list[Call], target: str, kind: str) -> Optional[str]:
    """The module path the tool must name (None: nothing), checked against the run itself: the target's input
    is finite and its output is not, and no module that finished before it holds a non-finite output."""
    if kind == "healthy":
        assert not any(_bad(c.output) for c in calls), "the healthy control is not healthy"
        return None
    if kind == "healthy-intended":
        root = next(c for c in calls if c.path == "")
        assert not _bad(root.output), "the healthy control's output is not finite"
        assert any(c.output.dtype.kind == "f" and not np.isfinite(c.output.astype(np.float32)).all()
                   for c in calls), "the healthy control holds no intended non-finite value"
        return None
    c = next(c for c in calls if c.path == target)
    if kind == "cast-gap":
        assert _bad(c.input), f"{target}: the unrecorded cast did not overflow"
        assert not any(_bad(o.output) for o in calls if o.post < c.post), "a module before the target failed"
        return target
    assert not _bad(c.input) and _bad(c.output), f"{target}: the injection did not make its output non-finite"
    assert not any(_bad(o.output) for o in calls if o.post < c.post), "a module before the target failed"
    return target


# ---- writers ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Writer:
    name: str
    root: str  # "model" | "prefixed" | "empty" | "class"
    layout: str  # "outputs" | "outputs-st" (one safetensors, "/" keys) | "io" | "io-float32" (t.float().numpy(), manifest "dtypes") | "dict-pt" | "tuple-pt"
    times: str  # "equal" | "coarse" | "distinct"
    order: Optional[str] = None  # "module-call" | "module-done" | "tensor" | "txt" (order.txt, call order)
    numbered: bool = False  # file names begin with the hook's call number: "000-<module>"
    folders: tuple = ()  # the same files written under each of these folders ("step_000", "rank0/step0")
    sep: str = "-"  # between a call number and the module name

    def module_name(self, path: str, cls: str, calls: Optional[list[Call]] = None) -> str:
        if path == "":
            name = {"model": "model", "prefixed": "model", "empty": "", "class": cls}[self.root]
        else:
            name = f"model.{path}" if self.root == "prefixed" else path
        if self.numbered:  # the number of the call among the calls in completion order
            done = sorted(calls, key=lambda c: c.post)
            name = f"{next(i for i, c in enumerate(done) if c.path == path):03d}{self.sep}{name}"
        return name


WRITERS = {w.name: w for w in (
    Writer("outputs-equal", "model", "outputs", "equal"),
    Writer("outputs-coarse", "model", "outputs", "coarse"),
    Writer("io-coarse", "model", "io", "coarse"),
    Writer("io-root-empty", "empty", "io", "equal"),
    Writer("io-root-class", "class", "io", "equal"),
    Writer("dict-pt", "model", "dict-pt", "equal"),
    Writer("tuple-pt", "model", "tuple-pt", "coarse"),
    Writer("module-order-call", "model", "io", "equal", "module-call"),
    Writer("module-order-done", "model", "io", "equal", "module-done"),
    Writer("tensor-order", "model", "io", "equal", "tensor"),
    Writer("prefixed-mtime", "prefixed", "io", "distinct"),
    Writer("float32-dtypes", "model", "io-float32", "coarse"),
    Writer("safetensors-slash", "model", "outputs-st", "equal"),
    Writer("numbered-npz", "model", "npz-float32", "equal", numbered=True),
    # conventions of other people's scripts and libraries
    Writer("one-pt-dict", "model", "one-pt-dict", "equal"),
    Writer("one-pt-nested", "model", "one-pt-nested", "equal"),
    Writer("one-npz-keys", "model", "one-npz", "equal"),
    Writer("one-safetensors-io", "model", "one-st-io", "equal"),
    Writer("folder-per-module-pt", "model", "folders-pt", "equal"),
    Writer("step-folders", "model", "io", "equal", folders=("step_000", "step_001")),
    Writer("rank-step-folders", "model", "outputs-pt", "coarse", folders=("rank0/step0",)),
    Writer("outputs-pt-distinct", "model", "outputs-pt", "distinct"),
    Writer("order-txt", "model", "io", "equal", "txt"),
    Writer("numbered-dict-pt", "model", "dict-pt", "equal", numbered=True, sep="_"),
    Writer("float32-sidecars", "model", "io-sidecar", "coarse"),
    Writer("inputs-only", "model", "inputs", "distinct"),
)}


# the layouts that record module outputs only
OUTPUTS_ONLY = frozenset({"outputs", "outputs-st", "outputs-pt", "one-pt-dict"})


def _join(name: str, rest: str) -> str:
    return f"{name}.{rest}" if name else rest


def write(w: Writer, calls: list[Call], cls: str, folder: Path) -> None:
    """Lay the calls out as ``w`` does: files saved in completion order (a forward hook fires when its module
    finishes), a later save of the same file name replacing the earlier one."""
    folder.mkdir(parents=True)
    files: dict[str, object] = {}  # file name -> content, in save order
    saved: list[str] = []  # tensor names in save order
    dtypes: dict[str, str] = {}  # tensor name -> the dtype it was saved from (io-float32)
    keyed: dict[str, np.ndarray] = {}  # key -> output, for the one safetensors file (outputs-st)

    def put(fn, content, names):
        files.pop(fn, None)
        files[fn] = content
        saved.extend(names)

    one: dict[str, object] = {}  # key -> value of the one container file (one-pt-*, one-npz, one-st-io)
    for c in sorted(calls, key=lambda c: c.post):
        name = w.module_name(c.path, cls, calls)
        if w.layout == "outputs":
            put(f"{name}.npy", c.output, [name])
        elif w.layout == "outputs-pt":
            put(f"{name}.pt", torch.from_numpy(c.output), [name])
        elif w.layout == "inputs":
            if c.input is not None:
                put(f"{_join(name, 'input.0')}.npy", c.input, [_join(name, "input.0")])
        elif w.layout == "one-pt-dict":
            one[name] = torch.from_numpy(c.output)
        elif w.layout == "one-pt-nested":
            one[name] = {**({"input": torch.from_numpy(c.input)} if c.input is not None else {}),
                         "output": torch.from_numpy(c.output)}
        elif w.layout in ("one-npz", "one-st-io"):
            for role, a in (("input.0", c.input), ("output.0", c.output)):
                if a is not None:
                    one[_join(name, role)] = np.ascontiguousarray(a)
        elif w.layout == "folders-pt":
            for role, a in (("input", c.input), ("output", c.output)):
                if a is not None:
                    put(f"{name or 'model'}/{role}.pt", torch.from_numpy(a), [])
        elif w.layout == "io-sidecar":
            for role, a in (("input.0", c.input), ("output.0", c.output)):
                if a is not None:
                    fn = f"{_join(name, role)}.npy"
                    if a.dtype.kind == "f":
                        put(f"{fn}.json", {"dtype": a.dtype.name}, [])
                        a = a.astype(np.float32)
                    put(fn, a, [_join(name, role)])
        elif w.layout == "outputs-st":
            keyed[name.replace(".", "/")] = np.ascontiguousarray(c.output)
        elif w.layout in ("io", "io-float32"):
            for role, a in (("input.0", c.input), ("output.0", c.output)):
                if a is not None:
                    if w.layout == "io-float32" and a.dtype.kind == "f":
                        dtypes[_join(name, role)] = a.dtype.name
                        a = a.astype(np.float32)
                    put(f"{_join(name, role)}.npy", a, [_join(name, role)])
        elif w.layout == "npz-float32":
            d = {k: a.astype(np.float32) if a.dtype.kind == "f" else a
                 for k, a in (("input", c.input), ("output", c.output)) if a is not None}
            put(f"{name}.npz", d, [])
        elif w.layout == "dict-pt":
            d = {"output": torch.from_numpy(c.output)}
            if c.input is not None:
                d = {"input": torch.from_numpy(c.input), **d}
            put(f"{name}.pt", d, [])
        else:
            args = (torch.from_numpy(c.input),) if c.input is not None else ()
            put(f"{name}.pt", (args, torch.from_numpy(c.output)), [])
    if keyed:
        files["activations.safetensors"] = keyed
    if one:
        files[{"one-pt-dict": "activations.pt", "one-pt-nested": "activations.pt", "one-npz": "activations.npz",
               "one-st-io": "activations.safetensors"}[w.layout]] = one
    for sub in w.folders or ("",):
        base = folder / sub
        for fn, content in files.items():
            (base / fn).parent.mkdir(parents=True, exist_ok=True)
            if fn.endswith(".safetensors"):
                save_file(content, base / fn)
            elif fn.endswith(".npz"):
                np.savez(base / fn, **content)
            elif fn.endswith(".json"):
                (base / fn).write_text(json.dumps(content))
            elif isinstance(content, np.ndarray):
                np.save(base / fn, content)
            else:
                torch.save(content, base / fn)
        for i, fn in enumerate(files):
            t = {"equal": BASE_NS, "coarse": BASE_NS + (i // TICK) * 1_000_000_000,
                 "distinct": BASE_NS + i * 1_000}[w.times]
            os.utime(base / fn, ns=(t, t))
    if w.order == "module-call":
        names = [w.module_name(c.path, cls, calls) for c in sorted(calls, key=lambda c: c.pre)]
        (folder / "manifest.json").write_text(json.dumps({"module_order": list(dict.fromkeys(names))}))
    elif w.order == "module-done":
        names = [w.module_name(c.path, cls, calls) for c in sorted(calls, key=lambda c: c.post)]
        (folder / "order.json").write_text(json.dumps(list(dict.fromkeys(reversed(names)))[::-1]))
    elif w.order == "tensor":
        (folder / "manifest.json").write_text(json.dumps({"execution_order": [f"{n}.npy" for n in saved]}))
    elif w.order == "txt":
        names = [w.module_name(c.path, cls, calls) for c in sorted(calls, key=lambda c: c.pre)]
        (folder / "order.txt").write_text("\n".join(dict.fromkeys(names)) + "\n")
    if dtypes:
        (folder / "manifest.json").write_text(json.dumps({"dtypes": dtypes}))


# ---- answers and the judge -------------------------------------------------------------------------

def answer(folder: Path, reference: Optional[Path] = None, floats: Optional[str] = None):
    """The tool's answer for a dump folder (compared with ``reference`` if given): ``(first_nonfinite, order,
    seconds, why wrong whatever it names)``: tensors saved as float32 that do not come back in the dtype they
    were saved from (``manifest.json``'s ``dtypes``, or ``floats`` for every floating tensor), or a float32
    reference run read in another dtype, make it wrong."""
    t = time.perf_counter()
    store = Store(":memory:")
    try:
        name = ingest(folder, reference=reference, store=store)
        run = next(r for r in q.session_runs(store, store.session(name).session_id) if r.kind != "reference")
        f = first_nonfinite(store, run.run_id)
        manifest = folder / "manifest.json"
        want = json.loads(manifest.read_text()).get("dtypes", {}) if manifest.exists() else {}
        got = dict(store.df("SELECT name, dtype FROM tensors WHERE run_id = ?", [run.run_id]).values)
        bad = sorted({f"{got.get(n)} for {d}" for n, d in want.items() if got.get(n) != d})
        if floats is not None:  # tensors saved as float32 without dtypes must be told from their values
            bad += sorted({f"{d} for {floats}" for d in got.values() if "float" in d and d != floats})
        if reference is not None:  # the fp32 reference run is float32 data: never relabelled
            ref = next(r for r in q.session_runs(store, store.session(name).session_id) if r.kind == "reference")
            ref_got = store.df("SELECT DISTINCT dtype FROM tensors WHERE run_id = ?", [ref.run_id])["dtype"]
            bad += sorted({f"{d} for float32 (reference)" for d in ref_got if "float" in d and d != "float32"})
        why = f"tensors read as {', '.join(bad)}; " if bad else ""
        return f, run.order, time.perf_counter() - t, why
    finally:
        close_all()


def right(f, expected: Optional[str], kind: str = "", inputs: bool = True, inputs_only: bool = False) -> bool:
    if expected is None:
        return f is None
    if f is None:
        return False
    if inputs_only:  # the first module to receive the value, which no recorded op produced
        return f.origin is OriginKind.INPUT and f.op == expected
    if kind == "cast-gap":  # the consumer named, its producer said not recorded; outputs only: the first output
        if not inputs:
            return f.origin is OriginKind.OP and f.op == expected
        return f.origin is OriginKind.INPUT and f.op == expected and "producer was not recorded" in f.reason
    if f.origin is OriginKind.PARAMETER:
        return f.parameter is not None and f.parameter.name == f"{expected}.weight"
    return f.origin is OriginKind.OP and f.op == expected


@dataclass(frozen=True)
class Case:
    arch: str
    kind: str
    writer: str


def cases(archs=ARCHS, kinds=KINDS, writers=tuple(WRITERS)) -> list[Case]:
    return [Case(a, k, w) for a in archs for k in kinds for w in writers]


def run(case_list: list[Case], tmp: Path, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Score every case; the model of an (architecture, kind) runs once and every writer lays it out."""
    rows = []
    by_model = defaultdict(list)
    for c in case_list:
        by_model[(c.arch, c.kind)].append(c)
    for (a, kind), cs in by_model.items():
        model, target, inputs = _built(a, kind)
        calls, cls = capture(model, inputs)
        path = truth(calls, target, kind)
        ref_calls = capture(*_built(a, kind, torch.float32)[::2])[0] if kind == "cast-gap" else None
        for c in cs:
            w = WRITERS[c.writer]
            folder = tmp / f"{a}-{kind}-{c.writer}"
            expected = None if path is None else w.module_name(path, cls, calls)
            if w.layout == "inputs" and path is not None:
                # inputs only: the failing module's output is never seen; the first module to receive it is named,
                # origin "input"
                first = min((o for o in calls if _bad(o.input)), key=lambda o: o.pre)
                expected = w.module_name(first.path, cls, calls)
            write(w, calls, cls, folder)
            ref = None
            if ref_calls is not None:
                ref = tmp / f"{folder.name}-fp32"
                write(w, ref_calls, cls, ref)
            (tmp / f"{folder.name}.truth.json").write_text(json.dumps({"expected": expected, "target": path}))
            try:
                f, order, secs, why = answer(folder, ref, "float16" if w.layout == "npz-float32" else None)
                ok = right(f, expected, kind, w.layout not in OUTPUTS_ONLY, w.layout == "inputs") and not why
                named, reason = (None if f is None else f"{f.op} ({f.origin})"), (None if f is None else f.reason)
                reason = why + str(reason) if why else reason
            except Exception as e:  # noqa: BLE001 - a case that raises is counted wrong, with why
                f, order, secs, ok, named, reason = None, "?", 0.0, False, "raised", f"{type(e).__name__}: {e}"
                f = None
            held = any(o is not None and o.dtype.kind == "f" and not np.isfinite(o.astype(np.float32)).all()
                       for c2 in calls for o in ((c2.output,) if w.layout != "inputs" else (c2.input,)))
            rows.append({"arch": a, "kind": kind, "writer": c.writer, "expected": expected, "right": ok,
                         "named": named, "reason": reason, "order": order, "secs": secs, "held": held,
                         "certain": f is not None and f.certainty is Certainty.CERTAIN})
            progress(f"{a} {kind} {c.writer}: {'right' if ok else 'WRONG'}")
    return rows


def table(rows: list[dict], by: str) -> list[str]:
    groups = defaultdict(list)
    for r in rows:
        groups[r[by]].append(r)
    out = [f"| {by} | right | wrong | false alarms | total | share | stated certain | certain and wrong |",
           "|---|---|---|---|---|---|---|---|"]
    for k, rs in groups.items():
        ok = sum(r["right"] for r in rs)
        alarms = sum(_alarm(r) for r in rs)
        certain = sum(r["certain"] for r in rs)
        out.append(f"| {k} | {ok} | {len(rs) - ok} | {alarms} | {len(rs)} | {100 * ok / len(rs):.0f}% | {certain} | "
                   f"{sum(r['certain'] and not r['right'] for r in rs)} |")
    return out


def _alarm(r: dict) -> bool:
    """A healthy dump in which something was named (or that raised)."""
    return r["kind"] in HEALTHY_KINDS and r["named"] is not None


def summary(rows: list[dict]) -> str:
    failing = [r for r in rows if r["kind"] not in HEALTHY_KINDS]
    healthy = [r for r in rows if r["kind"] in HEALTHY_KINDS]
    ok = sum(r["right"] for r in failing)
    held = [r for r in healthy if r["held"]]
    certain = [r for r in rows if r["certain"]]
    return (f"{len(failing)} failing dumps: {ok} right ({100 * ok / max(len(failing), 1):.0f}%); "
            f"{len(healthy)} healthy dumps: {sum(map(_alarm, healthy))} false alarms, {len(held)} of them holding "
            f"intended NaN/inf: {sum(map(_alarm, held))} false alarms; {len(certain)} answers stated certain: "
            f"{sum(not r['right'] for r in certain)} of them wrong")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the three small architectures and Qwen2")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case as it is scored")
    ap.add_argument("--writers", nargs="*", help="only these writers")
    ap.add_argument("--archs", nargs="*", help="only these architectures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    archs = args.archs or (SMALL_ARCHS + ("qwen2",) if args.quick else ARCHS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(cases(archs, writers=tuple(args.writers or WRITERS)), Path(tmp),
                   progress=print if args.verbose else (lambda s: None))
    print(f"{summary(rows)}; {time.perf_counter() - started:.0f} s\n")
    print("\n".join(table(rows, "writer")) + "\n")
    print("\n".join(table(rows, "arch")) + "\n")
    for r in rows:
        if not r["right"]:
            what = "false alarm" if _alarm(r) else "miss"
            print(f"{what}: {r['arch']} {r['kind']} [{r['writer']}, order {r['order']}]: expected "
                  f"{r['expected'] or 'nothing'}; named {r['named']}; reason: {r['reason']}")


if __name__ == "__main__":
    main()

"""Local error on stock ``transformers`` decoder layers (Qwen2, Mistral built from config, random weights): their
self-attention and decoder-layer modules take the key/value cache, which the call itself updates; the fp32 re-run
must find the cache as the module did, and must leave the model's own cache as the plain step left it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from precision_lab.live.recorder import Capture
from precision_lab.live.options import CaptureOptions

pytestmark = pytest.mark.slow  # builds transformers models

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
MODELS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
WATCHED = ("model.layers.1", "model.layers.1.self_attn")


def _model(arch):
    import transformers  # seconds to import: only the tests that build a decoder load it

    config_cls, model_cls = (getattr(transformers, n) for n in MODELS[arch])
    torch.manual_seed(0)
    return model_cls(config_cls(**SIZES)).half().eval()


def _fp32(obj):
    """A copy with every fp16 tensor as float32, independent of the capture's own upcast."""
    memo = {}

    def walk(o, depth=0):
        if isinstance(o, torch.Tensor):
            memo[id(o)] = o.detach().float() if o.dtype == torch.float16 else o.detach().clone()
        elif depth < 5 and isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif depth < 5 and isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif depth < 5 and hasattr(o, "__dict__") and not isinstance(o, type):
            for v in vars(o).values():
                walk(v, depth + 1)
    walk(obj)
    return copy.deepcopy(obj, memo)


def _independent_max_abs_err(arch) -> dict:
    """Each watched module run in fp32 on its fp16 inputs (cache as it was at entry), against its fp16 output,
    in float64 numpy."""
    model = _model(arch)
    seen = {}

    def pre(name):
        def hook(mod, args, kwargs):
            seen[name] = {"in": _fp32((args, kwargs))}
        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            seen[name]["out"] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    handles = []
    for name in WATCHED:
        mod = model.get_submodule(name)
        handles += [mod.register_forward_pre_hook(pre(name), with_kwargs=True),
                    mod.register_forward_hook(post(name), with_kwargs=True)]
    with torch.no_grad():
        model(input_ids=IDS)
    for h in handles:
        h.remove()
    errs = {}
    for name in WATCHED:
        mod32 = copy.deepcopy(model.get_submodule(name)).float()
        args, kwargs = seen[name]["in"]
        with torch.no_grad():
            ref = mod32(*args, **kwargs)
        ref = (ref[0] if isinstance(ref, tuple) else ref).double().numpy()
        errs[name] = float(np.abs(ref - seen[name]["out"].double().numpy()).max())
    return errs


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_decoder_layers_get_local_error_without_a_hook_error(arch):
    model = _model(arch)
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
    with Capture(model, run=arch, write=False, options=CaptureOptions(local_error=True)) as cap:
        with torch.no_grad():
            out = model(input_ids=IDS).logits
    assert not [w for w in cap.warnings if "hook error" in w[1]], cap.warnings
    # the re-runs left the model's own cache alone: the captured step computes what the plain one did
    assert torch.equal(out, plain)
    local = {cap.records[pos].op: cmp for pos, cmp in cap.local_comparisons
             if cap.records[pos].index in ("0", "0_0")}
    for layer in range(2):
        for mod in (f"model.layers.{layer}", f"model.layers.{layer}.self_attn"):
            assert f"{mod}.forward.0" in local, mod
    want = _independent_max_abs_err(arch)
    for name in WATCHED:
        got = local[f"{name}.forward.0"]
        assert got.max_abs_err > 0
        assert got.max_abs_err == pytest.approx(want[name], rel=1e-5)


def test_an_argument_object_is_copied_for_the_re_run_without_the_modules_it_refers_to():
    """A module given an object that it updates (a cache) and that refers to a module: the re-run gets the
    object as it was at entry, the model's own is updated once, and the referred module is shared, not copied."""
    from torch import nn

    class Log:
        def __init__(self, owner):
            self.owner = owner  # a module: never copied with its parameters
            self.seen = []

    class Appender(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, log):
            owners.append(log.owner)
            log.seen.append(x)
            return self.lin(x) * len(log.seen)  # depends on the log's state at entry

    owners = []
    torch.manual_seed(0)
    m = nn.Sequential(Appender()).half()
    x = torch.randn(2, 8).half()
    log = Log(m)
    with Capture(m, run="log", write=False, options=CaptureOptions(local_error=True)) as cap:
        with torch.no_grad():
            out = m[0](x, log)
    assert len(log.seen) == 1 and log.owner is m  # updated once, by the model's own call
    assert len(owners) == 2 and all(o is m for o in owners)  # the call and its re-run: the same module
    assert not [w for w in cap.warnings if "hook error" in w[1] or "re-run" in w[1]], cap.warnings
    local = {cap.records[pos].op: c for pos, c in cap.local_comparisons}
    got = local["0.forward.0"]
    # independent: the fp32 module on the fp32 input, with the log as it was at entry (empty: factor 1)
    lin = nn.Linear(8, 8)
    lin.load_state_dict({k: v.float() for k, v in m[0].lin.state_dict().items()})
    with torch.no_grad():
        ref = (lin(x.float()) * 1).double().numpy()
    assert got.max_abs_err == pytest.approx(float(np.abs(ref - out.double().numpy()).max()), rel=1e-6)

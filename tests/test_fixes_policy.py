"""Precision policies: format per module, casting, options, JSON."""

import pytest
import torch
from torch import nn

from precision_lab.fixes.modules import Linear, RMSNorm, Softmax
from precision_lab.fixes.policy import (POLICIES, PolicyError, PrecisionPolicy, QuantConfig, get_policy,
                                        module_matches)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module(), nn.Module()])
        for b in self.blocks:
            b.fc = Linear(4, 4)
            b.norm = RMSNorm(4)
        self.softmax = Softmax()
        self.head = nn.Linear(4, 2)  # a plain torch module: gets a cast hook

    def forward(self, x):
        for b in self.blocks:
            x = b.norm(b.fc(x))
        return self.head(self.softmax(x))


def test_module_matches_full_name_and_dotted_suffix():
    assert module_matches("layers.0.mlp.down_proj", "down_proj")
    assert module_matches("layers.0.mlp.down_proj", "layers.*.mlp.down_proj")
    assert module_matches("layers.0.mlp.down_proj", "mlp.down_proj")
    assert not module_matches("layers.0.mlp.down_proj", "proj")
    assert not module_matches("layers.0.mlp.down_proj_x", "down_proj")


def test_dtype_for_overrides_inherit_and_last_wins():
    p = PrecisionPolicy("p", "fp16", overrides=(("blocks.1", "fp32"), ("blocks.1.norm", "bf16")))
    assert p.dtype_for("blocks.0.fc") == "fp16"
    assert p.dtype_for("blocks.1") == "fp32"
    assert p.dtype_for("blocks.1.fc") == "fp32"  # inherited from the parent
    assert p.dtype_for("blocks.1.norm") == "bf16"  # later, more specific override wins
    assert p.override_for("blocks.0.fc") is None


def test_prepare_casts_each_module_and_hooks_plain_modules():
    m = Tiny()
    p = PrecisionPolicy("p", "fp16", overrides=(("blocks.1.fc", "fp32"), ("head", "bf16")))
    p.prepare(m)
    assert m.blocks[0].fc.weight.dtype == torch.float16
    assert m.blocks[0].fc.compute_dtype == torch.float16
    assert m.blocks[1].fc.weight.dtype == torch.float32
    assert m.blocks[1].fc.compute_dtype == torch.float32
    assert m.head.weight.dtype == torch.bfloat16
    x = p.prepare_inputs(torch.randn(3, 4))
    assert x.dtype == torch.float16
    with torch.no_grad():
        out = m(x)
    # the plain nn.Linear received fp16 from the softmax and cast it to its bf16 weights
    assert out.dtype == torch.bfloat16


def test_prepare_configures_options():
    m = Tiny()
    PrecisionPolicy("p", "fp16", eps=1e-3, stable_softmax=True, stats_fp32=True, flush_to_zero=True).prepare(m)
    assert m.blocks[0].norm.eps == 1e-3 and m.blocks[0].norm.stats_fp32
    assert m.blocks[0].norm.flush_to_zero
    assert m.softmax.stable
    m2 = Tiny()
    PrecisionPolicy("p", "fp16").prepare(m2)
    assert m2.blocks[0].norm.eps == 1e-6  # the module's own default
    assert not m2.softmax.stable


def test_prepare_refuses_a_pattern_that_matches_nothing():
    m = Tiny()
    with pytest.raises(PolicyError, match=r"keep-fp32: pattern 'down_proj' matches no module of this model"):
        PrecisionPolicy("p", "fp16", overrides=(("down_proj", "fp32"),)).prepare(m)
    with pytest.raises(PolicyError, match=r"sanitize-nonfinite: pattern 'nope'"):
        PrecisionPolicy("p", "fp16", sanitize=("nope",)).prepare(m)


def test_sanitize_replaces_nonfinite_with_format_limits():
    import numpy as np

    m = nn.Sequential(Linear(2, 2, bias=False))
    with torch.no_grad():
        m[0].weight.copy_(torch.tensor([[1e5, 0.0], [0.0, 1.0]]))
    p = PrecisionPolicy("p", "fp16", sanitize=("0",))
    p.prepare(m)
    with torch.no_grad():
        out = m(p.prepare_inputs(torch.tensor([[1.0, 0.0], [0.0, float("nan")]])))
    # 1e5 overflows fp16 -> +inf -> replaced by fp16's max; the NaN by 0
    assert out[0, 0].item() == float(np.finfo(np.float16).max)
    assert out[1, 1].item() == 0.0 and torch.isfinite(out).all()


def test_json_round_trip_and_describe():
    p = PrecisionPolicy("x", "fp16", overrides=(("a", "fp32"),), quant=QuantConfig("fp8_e5m2", "row", "fp16", 0.5),
                        flush_to_zero=True, eps=1e-4, sanitize=("n",), fixes=("eps:1e-4",))
    q = PrecisionPolicy.from_json(p.to_json())
    assert q == p and q.fixes == p.fixes
    d = p.describe()
    assert "fp8_e5m2 per-row (scale fp16, amax floor 0.5)" in d and "flush-to-zero" in d and "a=fp32" in d


@pytest.mark.parametrize("kw, msg", [
    (dict(dtype="fp8_e4m3fn"), "compute format 'fp8_e4m3fn' is not a compute format"),
    (dict(overrides=(("a", "int8"),)), "override 'a': format 'int8'"),
    (dict(eps=0.0), "epsilon 0.0 must be a number > 0"),
])
def test_policy_validation(kw, msg):
    with pytest.raises(PolicyError, match=msg):
        PrecisionPolicy("bad", **kw)


@pytest.mark.parametrize("kw, msg", [
    (dict(format="fp16"), "fake-quant format 'fp16' is not a narrow float"),
    (dict(granularity="block"), "granularity 'block'"),
    (dict(scale_format="fp8_e4m3fn"), "scale format 'fp8_e4m3fn'"),
    (dict(amax_floor=-1.0), "amax floor -1.0"),
    (dict(calibration="minmax"), "calibration 'minmax'"),
])
def test_quant_config_validation(kw, msg):
    with pytest.raises(PolicyError, match=msg):
        QuantConfig(**kw)


def test_presets():
    assert get_policy("fp16").dtype == "fp16"
    assert POLICIES["fp8-e4m3-row"].quant.granularity == "row"
    with pytest.raises(PolicyError, match="unknown precision policy 'fp12'; presets: fp32, fp16"):
        get_policy("fp12")
    assert not POLICIES["fp32"].low_precision and POLICIES["fp16"].low_precision


def test_every_policy_casts_the_same_input_trees():
    """One tree walk (torch's pytree) for every policy: namedtuples, dicts, lists keep their type."""
    from collections import namedtuple

    import torch

    from precision_lab.fixes.policy import PrecisionPolicy
    from precision_lab.live.policies import as_policy

    Batch = namedtuple("Batch", "x mask ids")
    tree = {"b": Batch(torch.randn(3), torch.tensor([True, False]), torch.arange(3)), "l": [torch.ones(2), 7]}
    for pol, want in ((PrecisionPolicy("fp16", "fp16"), torch.float16), (as_policy(torch.bfloat16), torch.bfloat16)):
        out = pol.prepare_inputs(tree)
        assert isinstance(out["b"], Batch) and isinstance(out["l"], list) and out["l"][1] == 7
        assert out["b"].x.dtype == want and out["l"][0].dtype == want
        assert out["b"].mask.dtype == torch.bool and out["b"].ids.dtype == torch.int64
        # values are a real cast of the originals
        assert torch.equal(out["b"].x, tree["b"].x.to(want))


@pytest.mark.slow
def test_eps_raises_every_normalisations_epsilon_on_any_model():
    """``eps:V`` reaches torch's and transformers' own normalisations, as a floor: a larger epsilon stays, a
    missing one (torch's RMSNorm, which then uses its format's machine epsilon) becomes at least that."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from precision_lab.fixes.catalogue import apply_fixes
    from precision_lab.fixes.policy import PrecisionPolicy

    model = torch.nn.ModuleDict({
        "ln": torch.nn.LayerNorm(8, eps=1e-5), "big": torch.nn.LayerNorm(8, eps=0.5),
        "rms": torch.nn.RMSNorm(8), "gn": torch.nn.GroupNorm(2, 8, eps=1e-5), "bn": torch.nn.BatchNorm1d(8),
        "qwen": Qwen2RMSNorm(8, eps=1e-6), "lin": torch.nn.Linear(8, 8)})
    policy = apply_fixes(PrecisionPolicy("fp16", "fp16"), "eps:1e-3")
    policy.prepare(model)
    assert model["ln"].eps == 1e-3 and model["gn"].eps == 1e-3 and model["bn"].eps == 1e-3
    assert model["qwen"].variance_epsilon == 1e-3
    assert model["big"].eps == 0.5  # a floor: never lowered
    assert model["rms"].eps == max(1e-3, float(torch.finfo(torch.float16).eps))
    assert not hasattr(model["lin"], "eps")
    # the raised epsilon is the one the forward uses: the module equals F.layer_norm with eps 1e-3
    x = torch.zeros(2, 8, dtype=torch.float16)
    x[:, 0] = 1e-2  # a row whose variance (about 1e-5) is below the new epsilon
    want = torch.nn.functional.layer_norm(x.float(), (8,), model["ln"].weight.float(), model["ln"].bias.float(),
                                          eps=1e-3)
    got = model["ln"](x).float()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    loose = torch.nn.functional.layer_norm(x.float(), (8,), eps=1e-5)
    assert (got - loose).abs().max() > 0.5  # the old epsilon gives a different answer


class _QK(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.q(x) @ self.k(x).transpose(-1, -2)


def test_an_fp32_island_meeting_fp16_in_a_matmul_is_cast_to_the_wider_dtype_not_an_error():
    """keep-fp32:k under fp16: k's fp32 output meets q's fp16 one in a plain ``@`` (which mixes no dtypes); the
    operands are brought to fp32 there, as an elementwise op would promote them, and only while the model runs."""
    from precision_lab.fixes.catalogue import apply_fixes

    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _QK()
    policy = apply_fixes(get_policy("fp16"), "keep-fp32:k")
    policy.prepare(model)
    assert model.q.weight.dtype == torch.float16 and model.k.weight.dtype == torch.float32
    out = model(policy.prepare_inputs(x))
    # independently: q in fp16 from fp16 inputs, k in fp32 from the fp16 inputs cast up, the product in fp32
    torch.manual_seed(0)
    ref = _QK()
    q16 = torch.nn.functional.linear(x.half(), ref.q.weight.half(), ref.q.bias.half())
    k32 = torch.nn.functional.linear(x.half().float(), ref.k.weight, ref.k.bias)
    assert out.dtype == torch.float32 and torch.equal(out, q16.float() @ k32.transpose(-1, -2))
    # outside the model's forward nothing is cast: torch refuses the mix
    with pytest.raises(RuntimeError):
        q16 @ k32.transpose(-1, -2)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_an_autocast_policy_runs_the_model_as_torch_autocast_does(fmt):
    """``autocast-fp16``/``autocast-bf16``: the parameters stay fp32, the inputs are left alone, and the output is
    bit for bit what the same model gives inside ``torch.autocast``; ``keep-fp32:2`` takes the head out of
    autocast (its input cast to fp32), ``use-bf16`` switches autocast's format."""
    from precision_lab.fixes.catalogue import apply_fixes

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    policy = get_policy(f"autocast-{fmt}")
    model = policy.prepare(_mlp())
    assert all(p.dtype == torch.float32 for p in model.parameters()) and policy.prepare_inputs(x) is x
    ref = _mlp()
    with torch.autocast("cpu", dtype=dtype):
        want = ref(x)
    got = model(x)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.is_autocast_enabled("cpu")  # nothing left switched on after the forward
    island = apply_fixes(policy, "keep-fp32:2")
    assert "2=fp32 (out of autocast)" in island.describe()
    m = island.prepare(_mlp())
    with torch.autocast("cpu", dtype=dtype):
        h = ref[1](ref[0](x))
    assert torch.equal(m(x), torch.nn.functional.linear(h.float(), ref[2].weight, ref[2].bias))
    if fmt == "fp16":
        bf = apply_fixes(policy, "use-bf16")
        assert bf.autocast == "bf16" and bf.dtype == "fp32"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(bf.prepare(_mlp())(x), ref(x))
    with pytest.raises(PolicyError):
        PrecisionPolicy("bad", "fp16", autocast="fp16")  # autocast keeps the parameters in fp32
    with pytest.raises(PolicyError):
        PrecisionPolicy("bad", "fp32", autocast="fp8")

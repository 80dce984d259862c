"""Precision policies: which format each module computes in, and how.

A ``PrecisionPolicy`` is a frozen description of one low-precision regime:

- the default compute format (``fp32``, ``fp16`` or ``bf16``) and per-module
  overrides by name pattern (``fnmatch``; a pattern also matches any dotted
  suffix of a module name, so ``down_proj`` matches ``layers.0.mlp.down_proj``;
  a module inherits its parent's override; later overrides win);
- fp8 fake-quantisation settings (``QuantConfig``): the fp8 format, per-tensor
  or per-row scaling, the format the scale is computed in, an amax floor, and
  how a static calibration treats non-finite values;
- flush-to-zero emulation (subnormal results and operands become 0, as on
  hardware or compilers that run with FTZ/DAZ set; CPU torch keeps
  subnormals, so the regime has to be stated);
- op options: an epsilon override for normalisations, max-subtracted
  softmax, two-pass variance, normalisation statistics in fp32;
- modules whose outputs are sanitised (NaN -> 0, +/-inf -> +/-max).

The policy implements the capture protocol ``prepare(model) -> model`` and
``prepare_inputs(inputs) -> inputs``.  Modules from
``precision_lab.fixes.modules`` read their options from the policy; any other
module with parameters is cast to its format and gets its floating inputs cast
on entry (autocast-like), so user models work too.

Scale convention for fake quantisation: ``scale = amax / fmt.max`` is the
dequantisation scale and ``inv_scale = 1 / scale`` multiplies the input
before the cast (torchao calls ``inv_scale`` the scale).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Optional

from ..formats import FORMATS

__all__ = [
    "PrecisionPolicy",
    "QuantConfig",
    "PolicyError",
    "COMPUTE_FORMATS",
    "POLICIES",
    "get_policy",
    "module_matches",
    "cast_floating",
    "call_model",
    "first_tensor",
]

# formats a module can compute in: the ones torch runs arithmetic in on CPU
COMPUTE_FORMATS = ("fp32", "fp16", "bf16")


class PolicyError(ValueError):
    """A policy (or a fix applied to one) cannot be used; the message says why."""


def _check_compute(fmt: str, what: str) -> None:
    if fmt not in COMPUTE_FORMATS:
        raise PolicyError(f"{what} {fmt!r} is not a compute format; use one of {', '.join(COMPUTE_FORMATS)}")


@dataclass(frozen=True)
class QuantConfig:
    """fp8 (or other narrow float) fake-quantisation of ``QuantLinear`` operands (a user's ``torch.nn.Linear``
    layers become ``QuantLinear``s over the same parameters when the policy prepares the model).

    ``granularity``: ``"tensor"`` (one scale per tensor) or ``"row"`` (one per
    row of the activation / output channel of the weight).
    ``scale_format``: the format amax, scale and its reciprocal are computed in.
    ``amax_floor``: amax is clamped to at least this value *in the scale
    format* (so a floor the scale format cannot hold rounds, as on hardware).
    ``calibration``: ``"dynamic"`` (amax of the current tensor) or
    ``"histogram"`` (static, from a ``torch.histc`` histogram of |x|).
    ``finite_only``: calibration ignores NaN/Inf values.
    ``weights``: quantise the weight as well as the input activation.
    """

    format: str = "fp8_e4m3fn"
    granularity: str = "tensor"
    scale_format: str = "fp32"
    amax_floor: float = 0.0
    calibration: str = "dynamic"
    finite_only: bool = False
    weights: bool = True
    histogram_bins: int = 2048
    percentile: float = 100.0

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.format)
        if fmt is None or fmt.kind != "float" or fmt.bits > 8 or fmt.torch_name is None:
            narrow = [f.name for f in FORMATS.values() if f.kind == "float" and f.bits <= 8 and f.torch_name]
            raise PolicyError(f"fake-quant format {self.format!r} is not a narrow float torch can cast to; "
                              f"use one of {', '.join(narrow)}")
        if self.granularity not in ("tensor", "row"):
            raise PolicyError(f"quant granularity {self.granularity!r} must be 'tensor' or 'row'")
        _check_compute(self.scale_format, "scale format")
        if not (self.amax_floor >= 0.0):
            raise PolicyError(f"amax floor {self.amax_floor!r} must be a number >= 0")
        if self.calibration not in ("dynamic", "histogram"):
            raise PolicyError(f"calibration {self.calibration!r} must be 'dynamic' or 'histogram'")
        if not (0.0 < self.percentile <= 100.0):
            raise PolicyError(f"calibration percentile {self.percentile!r} must be in (0, 100]")
        if self.histogram_bins < 1:
            raise PolicyError(f"histogram bins {self.histogram_bins!r} must be >= 1")


def module_matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names module ``name`` itself (full name or a dotted suffix)."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def _ancestors(name: str) -> list[str]:
    """``'a.b.c'`` -> ``['a', 'a.b', 'a.b.c']`` (the module and every parent)."""
    if not name:
        return [""]
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str = "fp32"
    dtype: str = "fp32"
    overrides: tuple[tuple[str, str], ...] = ()
    quant: Optional[QuantConfig] = None
    flush_to_zero: bool = False
    eps: Optional[float] = None
    stable_softmax: bool = False
    two_pass_variance: bool = False
    stats_fp32: bool = False
    sanitize: tuple[str, ...] = ()
    compile: Optional[str] = None  # torch.compile: "model" (the whole model) or a module pattern (each match)
    emulate_precision_casts: bool = False  # compiled code rounds where eager would (inductor's option)
    fixes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        _check_compute(self.dtype, "compute format")
        for ov in self.overrides:
            if not (isinstance(ov, tuple) and len(ov) == 2):
                raise PolicyError(f"override {ov!r} must be a (pattern, format) pair")
            _check_compute(ov[1], f"override {ov[0]!r}: format")
        if self.eps is not None and not (self.eps > 0.0):
            raise PolicyError(f"epsilon {self.eps!r} must be a number > 0")
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile.strip()):
            raise PolicyError(f"compile {self.compile!r} must be 'model' or a module pattern")
        if self.emulate_precision_casts and self.compile is None:
            raise PolicyError("emulate_precision_casts applies to compiled code; the policy compiles nothing")

    # ---- which format where ------------------------------------------------
    def override_for(self, module_name: str) -> Optional[str]:
        """The format of the last override matching the module or a parent, or None."""
        fmt = None
        chain = _ancestors(module_name)
        for pattern, f in self.overrides:
            if any(module_matches(n, pattern) for n in chain if n):
                fmt = f
        return fmt

    def dtype_for(self, module_name: str) -> str:
        """The compute format of a module: its override, else the default."""
        return self.override_for(module_name) or self.dtype

    def eps_for(self, current: Optional[float]) -> Optional[float]:
        """The epsilon a normalisation uses under this policy: its own (``current``), raised to at least the
        policy's ``eps`` when it has one."""
        if self.eps is None:
            return current
        return self.eps if current is None else max(float(current), self.eps)

    def sanitizes(self, module_name: str) -> bool:
        return any(module_matches(module_name, p) for p in self.sanitize)

    @property
    def low_precision(self) -> bool:
        return self.dtype != "fp32" or self.quant is not None or any(f != "fp32" for _, f in self.overrides)

    # ---- the capture protocol ---------------------------------------------
    def prepare(self, model):
        """Cast and configure ``model`` in place for this policy; returns it.

        Raises ``PolicyError`` when an override or sanitize pattern names no
        module, so a fix aimed at the wrong name fails loudly instead of
        changing nothing.
        """
        from .modules import PolicyModule, install_cast_hook, install_sanitize_hook  # deferred: loads torch

        if self.quant is not None:
            _quantise_linears(model, self.quant)
        named = list(model.named_modules())
        names = [n for n, _ in named if n]
        for pattern, _ in self.overrides:
            if not any(module_matches(n, pattern) for n in names):
                raise PolicyError(_no_match(pattern, names, "keep-fp32"))
        for pattern in self.sanitize:
            if not any(module_matches(n, pattern) for n in names):
                raise PolicyError(_no_match(pattern, names, "sanitize-nonfinite"))
        for name, mod in named:
            fmt = self.dtype_for(name)
            tdtype = FORMATS[fmt].torch_dtype()
            _cast_own(mod, tdtype)
            if isinstance(mod, PolicyModule):
                mod.configure(self, name)
            else:
                if self.eps is not None:
                    _floor_eps(mod, self, fmt)
                if any(p.is_floating_point() for p in mod.parameters(recurse=False)):
                    install_cast_hook(mod, tdtype)
            if name and self.sanitizes(name) and not isinstance(mod, PolicyModule):
                install_sanitize_hook(mod)
        if self.compile is not None:
            # the outermost matches: a block's own children run inside its compiled graph
            matched = [n for n, _ in named if n and module_matches(n, self.compile)]
            outer = [n for n in matched if not any(n.startswith(o + ".") for o in matched)]
            targets = [model] if self.compile == "model" else [model.get_submodule(n) for n in outer]
            if not targets:
                raise PolicyError(_no_match(self.compile, names, "compile"))
            # in place (Module.compile): module paths, and so op names, stay those of the eager model
            options = {"emulate_precision_casts": True} if self.emulate_precision_casts else None
            for m in targets:
                m.compile(options=options)
        return model

    def prepare_inputs(self, inputs):
        """Floating tensors (in tuples, lists, dicts) cast to the default compute format."""
        tdtype = FORMATS[self.dtype].torch_dtype()
        return cast_floating(inputs, tdtype)

    # ---- text ---------------------------------------------------------------
    def describe(self) -> str:
        """One line a person can read: ``fp16, fp8_e5m2 per-tensor (scale fp16), FTZ``."""
        parts = [self.dtype]
        for pattern, f in self.overrides:
            parts.append(f"{pattern}={f}")
        q = self.quant
        if q is not None:
            s = f"{q.format} per-{q.granularity} (scale {q.scale_format}"
            if q.amax_floor:
                s += f", amax floor {q.amax_floor:g}"
            s += ")"
            if q.calibration == "histogram":
                s += " histogram-calibrated" + (" finite-only" if q.finite_only else "")
            parts.append(s)
        if self.flush_to_zero:
            parts.append("flush-to-zero")
        if self.eps is not None:
            parts.append(f"eps {self.eps:g}")
        for flag, text in ((self.stable_softmax, "stable softmax"), (self.two_pass_variance, "two-pass variance"),
                           (self.stats_fp32, "norm statistics fp32")):
            if flag:
                parts.append(text)
        for p in self.sanitize:
            parts.append(f"sanitize {p}")
        if self.compile is not None:
            parts.append("torch.compile" + ("" if self.compile == "model" else f" {self.compile}")
                         + (" emulating precision casts" if self.emulate_precision_casts else ""))
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["overrides"] = [list(o) for o in self.overrides]
        d["sanitize"] = list(self.sanitize)
        d["fixes"] = list(self.fixes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "PrecisionPolicy":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PolicyError(f"policy has unknown field(s) {', '.join(sorted(unknown))}")
        if d.get("quant") is not None:
            d["quant"] = QuantConfig(**d["quant"])
        d["overrides"] = tuple(tuple(o) for o in d.get("overrides", ()))
        d["sanitize"] = tuple(d.get("sanitize", ()))
        d["fixes"] = tuple(d.get("fixes", ()))
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "PrecisionPolicy":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(f"policy JSON is not valid: {e}") from None
        return cls.from_dict(d)

    def replace(self, **kw) -> "PrecisionPolicy":
        return dataclasses.replace(self, **kw)


# where normalisations keep their epsilon: torch's LayerNorm, GroupNorm, BatchNorm, RMSNorm (``eps``) and
# transformers' RMSNorms (``variance_epsilon``, or ``eps``)
EPS_ATTRS = ("eps", "variance_epsilon")


def eps_attrs(mod) -> list[str]:
    """The epsilon attributes of a module a policy's ``eps`` raises: numbers, or None (torch's RMSNorm then
    uses its format's machine epsilon)."""
    out = []
    for a in EPS_ATTRS:
        v = getattr(mod, a, "absent")
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            out.append(a)
    return out


def _floor_eps(mod, policy: "PrecisionPolicy", fmt: str) -> None:
    for attr in eps_attrs(mod):
        cur = getattr(mod, attr)
        setattr(mod, attr, policy.eps_for(FORMATS[fmt].eps if cur is None else cur))


def _no_match(pattern: str, names: list[str], fix: str) -> str:
    shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
    return f"{fix}: pattern {pattern!r} matches no module of this model (modules: {shown})"


def _quantise_linears(model, quant: "QuantConfig") -> None:
    """Every ``torch.nn.Linear`` of ``model`` becomes a ``QuantLinear`` over the same parameters (same module
    path, same parameter objects), so fp8 fake quantisation reaches a user's model the way torchao's float8
    recipes swap linears; PolicyError when the model has none (a run is never labelled with a format it did not
    use)."""
    import torch  # deferred: see cast_floating

    from .modules import QuantLinear  # deferred with torch

    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = QuantLinear(1, 1, bias=child.bias is not None)
                q.weight = child.weight
                q.bias = child.bias
                q.in_features, q.out_features = child.in_features, child.out_features
                setattr(parent, child_name, q)
                swapped += 1
    if not swapped and not any(isinstance(m, QuantLinear) for m in model.modules()):
        raise PolicyError(f"the {quant.format} preset quantises torch.nn.Linear layers, and this model has none "
                          f"(e.g. GPT-2's Conv1D is not one); use a compute format (fp16, bf16) instead")


def _cast_own(mod, tdtype) -> None:
    """Cast a module's own floating parameters and buffers (not its children's)."""
    for key, p in mod._parameters.items():
        if p is not None and p.is_floating_point() and p.dtype != tdtype:
            p.data = p.data.to(tdtype)
    for key, b in mod._buffers.items():
        if b is not None and b.is_floating_point() and b.dtype != tdtype:
            mod._buffers[key] = b.to(tdtype)


def cast_floating(tree, tdtype):
    """Every floating tensor in a pytree (tuples, namedtuples, lists, dicts, registered containers) cast to
    ``tdtype``; everything else as it is."""
    import torch  # deferred: policies are built and described without torch
    from torch.utils._pytree import tree_map_only

    # a tensor already in ``tdtype`` is passed as it is: no cast op for a capture to record
    return tree_map_only(torch.Tensor, lambda t: t.to(tdtype) if t.is_floating_point() and t.dtype != tdtype else t,
                         tree)


def call_model(model, inputs):
    """``model`` called on ``inputs`` as recipes and captures give them: a dict is keyword arguments, a tuple or
    list positional ones, anything else the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def first_tensor(output):
    """The first tensor of a model's output (the output itself, a tuple's first, a Hugging Face ModelOutput's
    logits or last hidden state), or None."""
    import torch  # deferred: see cast_floating
    from torch.utils._pytree import tree_leaves

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput: its fields in order, Nones left out
        output = output.to_tuple()
    return next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)


# ---- named presets ----------------------------------------------------------

POLICIES: dict[str, PrecisionPolicy] = {
    p.name: p
    for p in (
        PrecisionPolicy("fp32", "fp32"),
        PrecisionPolicy("fp16", "fp16"),
        PrecisionPolicy("bf16", "bf16"),
        PrecisionPolicy("fp16-ftz", "fp16", flush_to_zero=True),
        PrecisionPolicy("fp8-e4m3-tensor", "fp16", quant=QuantConfig("fp8_e4m3fn", "tensor", "fp32")),
        PrecisionPolicy("fp8-e4m3-row", "fp16", quant=QuantConfig("fp8_e4m3fn", "row", "fp32")),
        PrecisionPolicy("fp8-e5m2-tensor", "fp16", quant=QuantConfig("fp8_e5m2", "tensor", "fp32")),
        # scales kept in the compute format: the configuration behind the
        # fp16 scale-underflow failures
        PrecisionPolicy("fp8-e5m2-tensor-fp16-scale", "fp16",
                        quant=QuantConfig("fp8_e5m2", "tensor", "fp16", weights=False)),
        PrecisionPolicy("fp8-e4m3-row-fp16-scale", "fp16", quant=QuantConfig("fp8_e4m3fn", "row", "fp16")),
    )
}


def get_policy(name: str) -> PrecisionPolicy:
    """A named preset, or a compute format name (``fp16``), with a helpful error."""
    if name in POLICIES:
        return POLICIES[name]
    raise PolicyError(f"unknown precision policy {name!r}; presets: {', '.join(POLICIES)}")

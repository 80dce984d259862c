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
``precision_lab.fixes.modules`` read their options from the policy and cast
their own inputs; any other module with floating parameters or buffers is cast
to its format and gets its floating inputs cast on entry (autocast-like), so
user models work too.  A module holding neither computes in whatever format
its inputs arrive in: an override (an fp32 island, ``keep-fp32``) on such a
module alone changes nothing (``island_effect`` says so), while an override on
a container reaches the children that hold parameters or buffers.

Tied tensors: modules that share a parameter or buffer (the same tensor object,
or tensors over the same storage: an embedding and an LM head with tied
weights) compute in one format, because one tensor has one dtype.  An override
reaching any of them covers its partners too (the latest override among them
wins); ``tied_groups`` finds them and ``PrecisionPolicy.island_notes`` /
``island_effect`` say which modules move with an island.

Scale convention for fake quantisation: ``scale = amax / fmt.max`` is the
dequantisation scale and ``inv_scale = 1 / scale`` multiplies the input
before the cast (torchao calls ``inv_scale`` the scale).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

from ..formats import FORMATS
from .islands import (COMPUTE_FORMATS, IslandEffect, IslandEffects, PolicyError, ancestors, check_compute,
                      island_effect, island_effects, module_formats, module_matches, tied_groups)
from .trees import call_model, cast_floating, first_tensor

__all__ = [
    "AUTOCAST_FORMATS",
    "DYNAMIC_INIT_SCALE",
    "GRAD_SCALER_SETTINGS",
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
    "tied_groups",
    "island_effect",
    "island_effects",
    "IslandEffect",
    "IslandEffects",
]

# where a "dynamic" loss scale starts its backoff (2^24: GradScaler starts at 2^16 and doubles every 2000 finite
# steps; a one-batch re-run stands for the scale a long run settles at)
DYNAMIC_INIT_SCALE = 2.0 ** 24


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
        check_compute(self.scale_format, "scale format")
        if not (self.amax_floor >= 0.0):
            raise PolicyError(f"amax floor {self.amax_floor!r} must be a number >= 0")
        if self.calibration not in ("dynamic", "histogram"):
            raise PolicyError(f"calibration {self.calibration!r} must be 'dynamic' or 'histogram'")
        if not (0.0 < self.percentile <= 100.0):
            raise PolicyError(f"calibration percentile {self.percentile!r} must be in (0, 100]")
        if self.histogram_bins < 1:
            raise PolicyError(f"histogram bins {self.histogram_bins!r} must be >= 1")


AUTOCAST_FORMATS = ("fp16", "bf16")  # what torch.autocast computes in
# what a policy's grad_scaler may set: torch.amp.GradScaler's state-dict entries ("enabled": the job's own, as is)
GRAD_SCALER_SETTINGS = ("enabled", "scale", "growth_interval", "backoff_factor", "growth_factor")


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
    # the loss is multiplied by this before backward and the gradients divided by it, into fp32, before they are
    # used (torch.amp.GradScaler's scale and unscale_); "dynamic": the largest power of two, from
    # DYNAMIC_INIT_SCALE down, at which every gradient stays finite (GradScaler's backoff: a step with inf is
    # skipped and the scale halved)
    loss_scale: Optional[object] = None
    skip_nonfinite_step: bool = False  # an optimizer step whose gradients hold NaN/inf is skipped (GradScaler's)
    # torch.autocast in this format (fp16 or bf16) around the model's forward, the parameters left in ``dtype``
    # (fp32): each op runs in the dtype autocast gives it; an override is an autocast island (``fp32``: autocast
    # off and the module's floating inputs cast to fp32; another format: autocast in that one)
    autocast: Optional[str] = None
    # the job's torch.amp.GradScaler, where it has one: ``(name, value)`` pairs of its state dict put over the
    # state a replay starts from (``scale``, ``growth_interval``, ``backoff_factor``, ``growth_factor``); ``()``
    # for none, ``(("enabled", 1),)`` for one used as the job left it
    grad_scaler: tuple[tuple[str, float], ...] = ()
    fixes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        check_compute(self.dtype, "compute format")
        for ov in self.overrides:
            if not (isinstance(ov, tuple) and len(ov) == 2):
                raise PolicyError(f"override {ov!r} must be a (pattern, format) pair")
            check_compute(ov[1], f"override {ov[0]!r}: format")
        if self.eps is not None and not (self.eps > 0.0):
            raise PolicyError(f"epsilon {self.eps!r} must be a number > 0")
        if self.compile is not None and (not isinstance(self.compile, str) or not self.compile.strip()):
            raise PolicyError(f"compile {self.compile!r} must be 'model' or a module pattern")
        if self.loss_scale is not None and self.loss_scale != "dynamic" and not (
                isinstance(self.loss_scale, (int, float)) and 0 < self.loss_scale < float("inf")):
            raise PolicyError(f"loss scale {self.loss_scale!r} must be a finite number > 0 or 'dynamic'")
        if self.emulate_precision_casts and self.compile is None:
            raise PolicyError("emulate_precision_casts applies to compiled code; the policy compiles nothing")
        if self.autocast is not None:
            if self.autocast not in AUTOCAST_FORMATS:
                raise PolicyError(f"autocast format {self.autocast!r}: autocast runs in "
                                  f"{' or '.join(AUTOCAST_FORMATS)}")
            if self.dtype != "fp32" or self.quant is not None:
                raise PolicyError("an autocast policy keeps the parameters in fp32 (dtype fp32) and quantises nothing")
        for kv in self.grad_scaler:
            if not (isinstance(kv, tuple) and len(kv) == 2 and kv[0] in GRAD_SCALER_SETTINGS
                    and isinstance(kv[1], (int, float)) and 0 < kv[1] < float("inf")):
                raise PolicyError(f"GradScaler setting {kv!r} must be one of {', '.join(GRAD_SCALER_SETTINGS)} "
                                  "with a finite value > 0")

    # ---- which format where ------------------------------------------------
    def override_for(self, module_name: str) -> Optional[str]:
        """The format of the last override matching the module or a parent, or None."""
        fmt = None
        chain = ancestors(module_name)
        for pattern, f in self.overrides:
            if any(module_matches(n, pattern) for n in chain if n):
                fmt = f
        return fmt

    def dtype_for(self, module_name: str) -> str:
        """The compute format of a module by its name alone: its override, else the default (``module_formats``
        gives the formats ``prepare`` uses, with tied modules aligned)."""
        return self.override_for(module_name) or self.dtype

    def module_formats(self, model) -> dict:
        """Module path -> the format ``prepare`` gives it: ``dtype_for``, except that modules sharing a parameter
        or buffer (``tied_groups``) all take the format of the latest override reaching any of them (one tensor
        has one dtype).  A module registered at several paths is one module: every path gets its format."""
        return module_formats(self, model)[0]

    def island_notes(self, model) -> list:
        """Sentences about what the overrides do on ``model`` beyond their names: the tied modules that move
        with an island (``keep-fp32:lm_head`` also runs ``transformer.wte`` in fp32), and an override that
        changes nothing (a module with no parameter or buffer, whose inputs the policy does not cast)."""
        fmts, moved = module_formats(self, model)
        notes = []
        for partner, (fmt, island, via) in moved.items():
            notes.append(f"{partner} runs in {fmt} with {island}: they share {via} (tied), and one tensor has one "
                         "dtype, so the island covers both")
        for i, (pattern, fmt) in enumerate(self.overrides):
            before = dataclasses.replace(self, overrides=self.overrides[:i])
            try:
                eff = island_effect(model, pattern, before, fmt=fmt)
            except PolicyError:
                continue  # prepare says so
            if not eff.changes:
                notes.append(eff.reason)
        return notes

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
        """Cast and configure ``model`` in place for this policy; returns it (``prepare.prepare_model``).

        Raises ``PolicyError`` when an override or sanitize pattern names no
        module, so a fix aimed at the wrong name fails loudly instead of
        changing nothing.
        """
        from .prepare import prepare_model  # deferred: loads torch

        return prepare_model(self, model)

    def prepare_inputs(self, inputs):
        """Floating tensors (in tuples, lists, dicts) cast to the default compute format (under autocast the
        inputs stay as they are: autocast casts per op)."""
        if self.autocast is not None:
            return inputs
        tdtype = FORMATS[self.dtype].torch_dtype()
        return cast_floating(inputs, tdtype)

    # ---- text ---------------------------------------------------------------
    def describe(self) -> str:
        """One line a person can read: ``fp16, fp8_e5m2 per-tensor (scale fp16), FTZ``."""
        parts = [f"autocast {self.autocast} (parameters {self.dtype})" if self.autocast else self.dtype]
        for pattern, f in self.overrides:
            parts.append(f"{pattern}={f}" + (" (out of autocast)" if self.autocast and f == "fp32" else ""))
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
        if self.skip_nonfinite_step:
            parts.append("skips non-finite steps")
        if self.loss_scale is not None:
            parts.append("dynamic loss scale" if self.loss_scale == "dynamic" else f"loss scale {self.loss_scale:g}")
        if self.grad_scaler:
            set_ = [f"{k.replace('_', ' ')} {v:g}" for k, v in self.grad_scaler if k != "enabled"]
            parts.append("GradScaler" + (f" ({', '.join(set_)})" if set_ else ""))
        return ", ".join(parts)

    def scaler_settings(self) -> dict:
        """The GradScaler state entries this policy sets over the job's (none for ``enabled``)."""
        return {k: (int(v) if k == "growth_interval" else float(v)) for k, v in self.grad_scaler if k != "enabled"}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["overrides"] = [list(o) for o in self.overrides]
        d["sanitize"] = list(self.sanitize)
        d["fixes"] = list(self.fixes)
        d["grad_scaler"] = [list(kv) for kv in self.grad_scaler]
        if not self.grad_scaler:
            del d["grad_scaler"]  # policies stored before GradScaler settings read the same
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
        d["grad_scaler"] = tuple(tuple(kv) for kv in d.get("grad_scaler", ()))
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
        # torch.autocast as a training job runs it: fp32 parameters, each op in the dtype autocast picks
        PrecisionPolicy("autocast-fp16", "fp32", autocast="fp16"),
        PrecisionPolicy("autocast-bf16", "fp32", autocast="bf16"),
    )
}


def get_policy(name: str) -> PrecisionPolicy:
    """A named preset, or a compute format name (``fp16``), with a helpful error."""
    if name in POLICIES:
        return POLICIES[name]
    raise PolicyError(f"unknown precision policy {name!r}; presets: {', '.join(POLICIES)}")

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
from fnmatch import fnmatchcase
from typing import Optional

from ..formats import FORMATS

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
]

# formats a module can compute in: the ones torch runs arithmetic in on CPU
COMPUTE_FORMATS = ("fp32", "fp16", "bf16")


# where a "dynamic" loss scale starts its backoff (2^24: GradScaler starts at 2^16 and doubles every 2000 finite
# steps; a one-batch re-run stands for the scale a long run settles at)
DYNAMIC_INIT_SCALE = 2.0 ** 24


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
    if not any(c in pattern for c in "*?["):  # a literal name: the same test without fnmatch's translation
        return name == pattern or name.endswith("." + pattern)
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def _ancestors(name: str) -> list[str]:
    """``'a.b.c'`` -> ``['a', 'a.b', 'a.b.c']`` (the module and every parent)."""
    if not name:
        return [""]
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


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
        _check_compute(self.dtype, "compute format")
        for ov in self.overrides:
            if not (isinstance(ov, tuple) and len(ov) == 2):
                raise PolicyError(f"override {ov!r} must be a (pattern, format) pair")
            _check_compute(ov[1], f"override {ov[0]!r}: format")
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
        chain = _ancestors(module_name)
        for pattern, f in self.overrides:
            if any(module_matches(n, pattern) for n in chain if n):
                fmt = f
        return fmt

    def dtype_for(self, module_name: str) -> str:
        """The compute format of a module by its name alone: its override, else the default (``module_formats``
        gives the formats ``prepare`` uses, with tied modules aligned)."""
        return self.override_for(module_name) or self.dtype

    def _override_at(self, module_name: str) -> int:
        """The position of the last override matching the module or a parent, -1 when none does."""
        chain = [n for n in _ancestors(module_name) if n]
        at = -1
        for i, (pattern, _) in enumerate(self.overrides):
            if any(module_matches(n, pattern) for n in chain):
                at = i
        return at

    def module_formats(self, model) -> dict:
        """Module path -> the format ``prepare`` gives it: ``dtype_for``, except that modules sharing a parameter
        or buffer (``tied_groups``) all take the format of the latest override reaching any of them (one tensor
        has one dtype).  A module registered at several paths is one module: every path gets its format."""
        return _module_formats(self, model)[0]

    def island_notes(self, model) -> list:
        """Sentences about what the overrides do on ``model`` beyond their names: the tied modules that move
        with an island (``keep-fp32:lm_head`` also runs ``transformer.wte`` in fp32), and an override that
        changes nothing (a module with no parameter or buffer, whose inputs the policy does not cast)."""
        fmts, moved = _module_formats(self, model)
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
        """Cast and configure ``model`` in place for this policy; returns it.

        Raises ``PolicyError`` when an override or sanitize pattern names no
        module, so a fix aimed at the wrong name fails loudly instead of
        changing nothing.
        """
        from .modules import (PolicyModule, install_autocast, install_cast_hook,  # deferred: loads torch
                              install_island_boundary, install_sanitize_hook)

        if self.autocast is not None:
            return self._prepare_autocast(model, install_autocast, install_sanitize_hook)

        if self.quant is not None:
            _quantise_linears(model, self.quant)
        named = list(model.named_modules())
        # every path a module is registered at (a module used twice is named twice)
        fmts = _module_formats(self, model)[0] if self.overrides else None
        self._check_patterns(model)
        for name, mod in named:
            fmt = fmts[name] if fmts is not None else self.dtype
            tdtype = FORMATS[fmt].torch_dtype()
            _cast_own(mod, tdtype)
            if isinstance(mod, PolicyModule):
                mod.configure(self, name)
            else:
                if self.eps is not None:
                    _floor_eps(mod, self, fmt)
                if _holds_floating(mod):
                    install_cast_hook(mod, tdtype)
            if name and self.sanitizes(name) and not isinstance(mod, PolicyModule):
                install_sanitize_hook(mod)
        if fmts is not None and len(set(fmts.values())) > 1:
            # islands in another format than the rest: where their outputs meet it, the operands are cast
            install_island_boundary(model)
        if self.compile is not None:
            # the outermost matches: a block's own children run inside its compiled graph
            matched = [n for n, _ in named if n and module_matches(n, self.compile)]
            outer = [n for n in matched if not any(n.startswith(o + ".") for o in matched)]
            targets = [model] if self.compile == "model" else [model.get_submodule(n) for n in outer]
            if not targets:
                names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
                raise PolicyError(_no_match(self.compile, names, "compile"))
            # in place (Module.compile): module paths, and so op names, stay those of the eager model
            options = {"emulate_precision_casts": True} if self.emulate_precision_casts else None
            for m in targets:
                m.compile(options=options)
        return model

    def _check_patterns(self, model) -> None:
        """PolicyError when an override or sanitize pattern names no module of ``model`` (every path a module is
        registered at: a module used twice is named twice)."""
        names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
        for pattern, _ in self.overrides:
            if not any(module_matches(n, pattern) for n in names):
                raise PolicyError(_no_match(pattern, names, "keep-fp32"))
        for pattern in self.sanitize:
            if not any(module_matches(n, pattern) for n in names):
                raise PolicyError(_no_match(pattern, names, "sanitize-nonfinite"))

    def _prepare_autocast(self, model, install_autocast, install_sanitize_hook):
        """``torch.autocast`` in ``self.autocast`` around the model's forward; each override an autocast island."""
        self._check_patterns(model)
        install_autocast(model, self.autocast)
        for name, mod in model.named_modules():
            if not name:
                continue
            fmt, parent = self.override_for(name), self.override_for(name.rpartition(".")[0])
            if fmt is not None and fmt != parent:  # the outermost module of an island
                install_autocast(mod, fmt)
            if self.sanitizes(name):
                install_sanitize_hook(mod)
        return model

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


def _own_tensors(mod):
    """(kind, name, tensor) of a module's own parameters and buffers (not its children's), Nones left out."""
    for key, p in mod._parameters.items():
        if p is not None:
            yield "parameter", key, p
    for key, b in mod._buffers.items():
        if b is not None:
            yield "buffer", key, b


def _holds_floating(mod) -> bool:
    """Whether a module has a floating parameter or buffer of its own: what a policy casts, and what makes it
    cast its inputs."""
    return any(t.is_floating_point() for _, _, t in _own_tensors(mod))


def _storage_key(t):
    """What identifies the memory a tensor lives in (device and storage address), None for a tensor without
    memory (meta, empty)."""
    try:
        if t.device.type == "meta":
            return None
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # a tensor subclass without storage
        return None
    return (str(t.device), ptr) if ptr else None


class _Ties:
    """Which modules of a model share a parameter or buffer (the same tensor object, or tensors over the same
    storage), over every path a module is registered at; one module at two paths shares everything with itself."""

    def __init__(self, model):
        self.paths: dict = {}  # module id -> its paths, in named_modules order
        self.modules: dict = {}  # module id -> module
        for path, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), []).append(path)
            self.modules[id(m)] = m
        seen: dict = {}  # tensor id or storage key -> (module id, "path.name")
        self.links: dict = {}  # (module id a, module id b), a first seen -> "path.name" of a tensor they share
        for mid, m in self.modules.items():
            for _, key, t in _own_tensors(m):
                label = f"{self.paths[mid][0]}.{key}" if self.paths[mid][0] else key
                for k in (("id", id(t)), ("storage", _storage_key(t))):
                    if k[1] is None:
                        continue
                    got = seen.get(k)
                    if got is None:
                        seen[k] = (mid, label)
                    elif got[0] != mid:
                        self.links.setdefault((got[0], mid), got[1])
        parent = {mid: mid for mid in self.paths}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for x, y in self.links:
            parent[find(x)] = find(y)
        self.group = {mid: find(mid) for mid in self.paths}  # module id -> its group's representative
        self.members: dict = {}  # group representative -> its module ids
        for mid, g in self.group.items():
            self.members.setdefault(g, []).append(mid)
        self.owner = {p: mid for mid, ps in self.paths.items() for p in ps}  # path -> module id
        self.children: dict = {}  # path -> the paths directly under it
        self.suffixes: dict = {}  # dotted suffix -> the paths ending with it ("c", "b.c", "a.b.c" for "a.b.c")
        for p in self.owner:
            if not p:
                continue
            self.children.setdefault(p.rsplit(".", 1)[0] if "." in p else "", []).append(p)
            parts = p.split(".")
            for i in range(len(parts)):
                self.suffixes.setdefault(".".join(parts[i:]), []).append(p)

    def reached(self, pattern: str) -> list:
        """The paths an override ``pattern`` reaches: the modules it names (``module_matches``) and every path
        under them, in no particular order."""
        if any(c in pattern for c in "*?["):
            named = [p for p in self.owner if p and module_matches(p, pattern)]
        else:  # a literal name: its dotted-suffix index, no scan
            named = list(self.suffixes.get(pattern, ()))
        out, seen, stack = [], set(), named
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            out.append(p)
            stack.extend(self.children.get(p, ()))
        return out

    def via(self, a, b) -> str:
        """A tensor ``a`` shares with ``b`` (directly when they do, else one ``a`` shares with its group)."""
        got = self.links.get((a, b)) or self.links.get((b, a))
        if got is None:
            got = next(v for (x, y), v in self.links.items() if a in (x, y))
        return got

    def formats(self, policy: Optional["PrecisionPolicy"], own_at: dict) -> tuple[dict, dict]:
        """(path -> format, partner path -> (format, island path, shared tensor)) given each module's latest
        override position (``own_at``: module id -> index into ``policy.overrides``, -1 for none): a tied group
        takes the format of the latest override reaching any of its modules."""
        if policy is None:
            return {p: None for ps in self.paths.values() for p in ps}, {}
        best: dict = {}
        for mid, at in own_at.items():
            g = self.group[mid]
            if g not in best or at > best[g][0]:
                best[g] = (at, mid)
        fmt_of, moved = {}, {}
        for mid, ps in self.paths.items():
            at, src = best[self.group[mid]]
            fmt = policy.overrides[at][1] if at >= 0 else policy.dtype
            own = policy.overrides[own_at[mid]][1] if own_at[mid] >= 0 else policy.dtype
            for p in ps:
                fmt_of[p] = fmt
                if src != mid and fmt != own:
                    moved[p] = (fmt, self.paths[src][0] or "the model", self.via(mid, src))
        return fmt_of, moved

    def own_at(self, policy: "PrecisionPolicy") -> dict:
        """Module id -> the position of the latest override of ``policy`` reaching any of its paths (-1: none)."""
        return {mid: max(policy._override_at(p) for p in ps) for mid, ps in self.paths.items()}


def tied_groups(model) -> dict:
    """Module path -> the other module paths that share a parameter or buffer with it (the same tensor object, or
    tensors over the same storage), for the modules that share any.  GPT-2 with tied embeddings gives
    ``{'transformer.wte': ['lm_head'], 'lm_head': ['transformer.wte']}``.  Sharing is transitive (a tensor shared
    by three modules ties all three); a module registered at two paths is tied to itself under the other path."""
    ties = _Ties(model)
    members: dict = {}
    for mid, ps in ties.paths.items():
        members.setdefault(ties.group[mid], []).extend(ps)
    out = {}
    for group in members.values():
        if len(group) < 2:
            continue
        for p in group:
            out[p] = [q for q in group if q != p]
    return out


def _module_formats(policy: Optional["PrecisionPolicy"], model) -> tuple[dict, dict]:
    """(path -> the format ``prepare`` gives the module, partner path -> (format, island path, shared tensor) for
    each module whose format comes from a tied module's override rather than its own name).  ``policy`` None:
    every format None, nothing moves."""
    ties = _Ties(model)
    return ties.formats(policy, ties.own_at(policy) if policy is not None else {})


@dataclass(frozen=True)
class IslandEffect:
    """What an override (``keep-fp32:<pattern>``) does to one model under one policy.

    ``modules``: the paths the pattern reaches by name (the matches and their children); ``partners``: modules
    outside them that move too, because they share a parameter or buffer with one inside (tied weights), with
    that tensor; ``tensors``: ``<module path>.<name>`` of each floating parameter or buffer whose format
    changes (each tensor once).  The override changes the model exactly when ``tensors`` is not empty: a
    module's inputs are cast by the policy only when it holds a floating parameter or buffer, so an island
    holding none computes in whatever format its inputs arrive in, as before."""

    pattern: str
    fmt: str
    modules: tuple
    partners: tuple  # ((partner path, island path, shared tensor), ...)
    tensors: tuple

    @property
    def changes(self) -> bool:
        return bool(self.tensors)

    @property
    def note(self) -> str:
        """The tied modules that move with the island, as a sentence ("" when none)."""
        if not self.partners:
            return ""
        parts = [f"{p} (shares {via} with {isl})" for p, isl, via in self.partners]
        return (f"the island also runs {', '.join(parts)} in {self.fmt}: tied tensors have one dtype, so the "
                "modules sharing them move together")

    @property
    def reason(self) -> str:
        """Why the override changes nothing (when it does not), else the note."""
        if self.changes:
            return self.note
        spec = f"keep-{self.fmt}:{self.pattern}" if self.fmt == "fp32" else f"{self.pattern}={self.fmt}"
        if not self.modules:
            return f"{spec} reaches no module"
        return (f"{spec} changes nothing: the modules it reaches ({', '.join(self.modules[:6])}"
                f"{' ...' if len(self.modules) > 6 else ''}) hold no floating parameter or buffer whose format it "
                "changes, and the policy casts the inputs only of modules that hold one: they compute in the "
                "format their inputs arrive in")


def island_effect(model, pattern: str, policy: Optional["PrecisionPolicy"] = None, *, fmt: str = "fp32",
                  _ties: Optional[_Ties] = None, _before: Optional[dict] = None) -> IslandEffect:
    """What adding the override ``(pattern, fmt)`` to ``policy`` changes in ``model`` (see ``IslandEffect``).

    With ``policy`` None the question is structural: does the island (the modules the pattern reaches and their
    tied partners) hold any floating parameter or buffer at all.  ``PolicyError`` when the pattern names no
    module.  This is the one rule for "this island changes nothing": the fix listing (``services.applicable``)
    and whatever offers an island (the diagnosis rules) should both ask it."""
    _check_compute(fmt, f"override {pattern!r}: format")
    if policy is None:  # judged against a run in another format: every floating tensor reached would change
        policy = PrecisionPolicy(name="any", dtype="fp16" if fmt != "fp16" else "fp32")
    ties = _ties if _ties is not None else _Ties(model)
    before = _before if _before is not None else _formats_now(ties, policy)
    reached = ties.reached(pattern)
    if not reached:
        raise PolicyError(_no_match(pattern, [p for p in ties.owner if p], "keep-fp32"))
    # the new override is the policy's last: every module it reaches, and every module tied to one, takes ``fmt``
    inside = {ties.owner[p] for p in reached}
    source = {}  # group -> a module of the island in it
    for mid in inside:
        source.setdefault(ties.group[mid], mid)
    changed = [mid for g in source for mid in ties.members[g] if before[ties.paths[mid][0]] != fmt]
    partners = tuple((p or "the model", ties.paths[source[ties.group[mid]]][0] or "the model",
                      ties.via(mid, source[ties.group[mid]]))
                     for mid in changed if mid not in inside for p in ties.paths[mid])
    tensors, seen = [], set()
    for mid in sorted(changed, key=lambda m: ties.paths[m][0]):
        path = ties.paths[mid][0]
        for _, key, t in _own_tensors(ties.modules[mid]):
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                tensors.append(f"{path}.{key}" if path else key)
    return IslandEffect(pattern, fmt, tuple(sorted(reached)), partners, tuple(tensors))


def _formats_now(ties: _Ties, policy: "PrecisionPolicy") -> dict:
    """Each path's format under ``policy``."""
    return ties.formats(policy, ties.own_at(policy))[0]


def island_effects(model, patterns, policy: Optional["PrecisionPolicy"] = None, *, fmt: str = "fp32") -> dict:
    """``island_effect`` of each pattern, the model's ties and the policy's formats worked out once."""
    if policy is None:
        policy = PrecisionPolicy(name="any", dtype="fp16" if fmt != "fp16" else "fp32")
    ties = _Ties(model)
    before = _formats_now(ties, policy)
    return {p: island_effect(model, p, policy, fmt=fmt, _ties=ties, _before=before) for p in patterns}


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

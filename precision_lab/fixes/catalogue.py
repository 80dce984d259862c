"""The fix catalogue: named, parameterised edits of a ``PrecisionPolicy``.

A fix spec is ``name`` or ``name:argument`` (``keep-fp32:layers.0.mlp.down_proj``,
``amax-floor:1e-12``).  Several fixes applied together are written with ``+``
(``scale-fp32+amax-floor:1e-12``) or passed as a list.  Every fix has a
one-line reason in number-format terms, with the limits read from
``FORMATS``.  User code registers more with ``register_fix`` — the built-ins
use the same registry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Union

from ..display import num_text
from ..formats import FORMATS
from ..registry import Registry
from .policy import PolicyError, PrecisionPolicy, QuantConfig

__all__ = ["FixDef", "Fix", "FixError", "FIXES", "register_fix", "parse_fix", "apply_fixes", "model_edits",
           "split_specs", "fix_label", "unreachable"]


class FixError(PolicyError):
    """A fix spec cannot be parsed or does not apply to the policy; the message says which and why."""


@dataclass(frozen=True)
class FixDef:
    """One catalogue entry.

    ``param``: None (no argument), ``"pattern"`` (module name pattern),
    ``"value"`` (a positive number), ``"format"`` (a format name) or
    ``"choice:a|b"``.  ``reason(arg)`` returns the one-line reason;
    ``edit(policy, value)`` returns the edited policy or raises FixError.
    ``target(value)``: the format the fix computes in instead (``use-bf16``: bf16), None where it changes no
    format; a fix whose target cannot hold the values at stake is never offered (``unreachable``).
    ``prepare(model, value)``: what the fix does to the model that no policy field says (a hook, a module
    swapped), done to the model the policy has prepared; ``edit`` may then be None (the policy is left as it is
    and records the fix in ``fixes``, so a re-run made from this one keeps it).
    """

    name: str
    param: Optional[str]
    reason: Callable[[Any], str]
    edit: Optional[Callable[[PrecisionPolicy, Any], PrecisionPolicy]]
    example: str
    target: Optional[Callable[[Any], Optional[str]]] = None
    prepare: Optional[Callable[[Any, Any], None]] = None


@dataclass(frozen=True)
class Fix:
    name: str
    arg: Optional[str]
    value: Any
    definition: FixDef

    @property
    def spec(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    @property
    def reason(self) -> str:
        return self.definition.reason(self.value)

    def apply(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        edit = self.definition.edit
        try:
            new = edit(policy, self.value) if edit is not None else policy
        except FixError:
            raise
        except PolicyError as e:
            raise FixError(f"fix {self.spec!r}: {e}") from None
        return replace(new, fixes=policy.fixes + (self.spec,))


FIXES = Registry("fix", group="precision_lab.fixes", name_of=lambda f: f.name)


def register_fix(fix: FixDef, *, replace: bool = False) -> FixDef:
    """Add a fix to the catalogue (``precision-lab fixes``, the dashboard, diagnosis suggestions)."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", fix.name):
        raise ValueError(f"fix name {fix.name!r} must be lower-case letters, digits and dashes")
    return FIXES.register(fix.name, fix, replace=replace)


def _parse_value(name: str, param: str, arg: str):
    if param == "value":
        try:
            v = float(arg)
        except ValueError:
            raise FixError(f"fix {name!r}: {arg!r} is not a number (e.g. {FIXES[name].example})") from None
        if not math.isfinite(v) or v <= 0:
            raise FixError(f"fix {name!r}: value {arg} must be a finite number > 0")
        return v
    if param == "format":
        if arg not in FORMATS:
            raise FixError(f"fix {name!r}: unknown format {arg!r}; known: {', '.join(FORMATS)}")
        return arg
    if param.startswith("choice:"):
        choices = param.split(":", 1)[1].split("|")
        if arg not in choices:
            raise FixError(f"fix {name!r}: {arg!r} must be one of {', '.join(choices)}")
        return arg
    if param == "pattern":
        if not arg or any(c.isspace() for c in arg):
            raise FixError(f"fix {name!r}: module pattern {arg!r} must be non-empty with no spaces")
        return arg
    raise FixError(f"fix {name!r}: unknown parameter kind {param!r}")


def parse_fix(spec: str) -> Fix:
    """``'amax-floor:1e-12'`` -> ``Fix``; raises FixError naming the problem and the known fixes."""
    if not isinstance(spec, str) or not spec.strip():
        raise FixError(f"a fix spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    name, sep, arg = spec.partition(":")
    name = name.strip()
    d = FIXES.get(name)
    if d is None:
        raise FixError(f"unknown fix {name!r}; known fixes: {', '.join(sorted(FIXES))}")
    if d.param is None:
        if sep:
            raise FixError(f"fix {name!r} takes no argument (got {arg!r}); write just {name}")
        return Fix(name, None, None, d)
    if not sep or not arg.strip():
        raise FixError(f"fix {name!r} needs an argument: e.g. {d.example}")
    arg = arg.strip()
    return Fix(name, arg, _parse_value(name, d.param, arg), d)


_SPLIT = re.compile(r"\+(?=[a-z])")


def split_specs(specs: Union[str, Iterable[str], None]) -> list[str]:
    """A spec string (``a+b``) or a list of them -> a flat list of single specs."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    out = []
    for s in specs:
        if isinstance(s, Fix):
            out.append(s.spec)
            continue
        out.extend(p.strip() for p in _SPLIT.split(str(s)) if p.strip())
    return out


def fix_label(specs) -> str:
    """Canonical ``+``-joined form of some specs (what a run's ``fix`` column records)."""
    return "+".join(parse_fix(s).spec for s in split_specs(specs))


def apply_fixes(policy: PrecisionPolicy, specs) -> PrecisionPolicy:
    """Apply fix specs in order; the result records them in ``policy.fixes``."""
    for s in split_specs(specs):
        policy = parse_fix(s).apply(policy)
    return policy


def model_edits(policy: PrecisionPolicy) -> list[Fix]:
    """The fixes of ``policy.fixes`` that do something to the model itself (``FixDef.prepare``), in order."""
    return [f for f in map(parse_fix, policy.fixes) if f.definition.prepare is not None]


# ---- the built-in catalogue ------------------------------------------------------

def unreachable(spec: str, *, absmax: Optional[float] = None, smallest: Optional[float] = None,
                integers_to: Optional[float] = None) -> Optional[str]:
    """Why the fix ``spec`` (``a+b`` too) cannot help values of these magnitudes, or None: a part of it computes
    in a format that cannot hold them either (``Format.cannot_hold``), e.g. ``use-bf16`` for
    ``finfo(float32).min`` (-inf in bf16 as in fp16) or for a count past 256."""
    for part in split_specs(spec):
        try:
            fix = parse_fix(part)
        except FixError:
            continue
        name = fix.definition.target(fix.value) if fix.definition.target is not None else None
        why = FORMATS[name].cannot_hold(absmax=absmax, smallest=smallest, integers_to=integers_to) \
            if name in FORMATS else None
        if why:
            return f"{fix.spec}: {why}"
    return None


def _need_quant(policy: PrecisionPolicy, fix: str):
    if policy.quant is None:
        raise FixError(f"fix {fix!r} edits fp8 fake-quantisation settings, but policy "
                       f"{policy.name!r} ({policy.describe()}) quantises nothing")
    return policy.quant


def _keep_fp32(p: PrecisionPolicy, pattern: str) -> PrecisionPolicy:
    return replace(p, overrides=p.overrides + ((pattern, "fp32"),))


def _use_bf16(p: PrecisionPolicy, _) -> PrecisionPolicy:
    def sw(f):
        return "bf16" if f == "fp16" else f

    q = p.quant
    # under autocast: autocast in bf16 (the parameters stay fp32)
    new = replace(p, dtype=sw(p.dtype), overrides=tuple((pat, sw(f)) for pat, f in p.overrides),
                  quant=replace(q, scale_format=sw(q.scale_format)) if q is not None else None,
                  autocast=sw(p.autocast) if p.autocast else None)
    if new == p:
        raise FixError(f"fix 'use-bf16' replaces fp16 by bf16, but policy {p.name!r} ({p.describe()}) uses no fp16")
    return new


def _scale_fp32(p, _):
    q = _need_quant(p, "scale-fp32")
    if q.scale_format == "fp32":
        raise FixError(f"fix 'scale-fp32': policy {p.name!r} already computes scales in fp32")
    return replace(p, quant=replace(q, scale_format="fp32"))


def _amax_floor(p, v):
    return replace(p, quant=replace(_need_quant(p, "amax-floor"), amax_floor=v))


def _eps(p, v):
    return replace(p, eps=v)


def _flag(field: str, fix: str):
    def edit(p, _):
        if getattr(p, field):
            raise FixError(f"fix {fix!r}: policy {p.name!r} already has it")
        return replace(p, **{field: True})

    return edit


def _sanitize(p, pattern):
    return replace(p, sanitize=p.sanitize + (pattern,))


def _finite_only(p, _):
    q = _need_quant(p, "calibrate-finite-only")
    if q.calibration != "histogram":
        raise FixError("fix 'calibrate-finite-only' applies to histogram calibration; "
                       f"policy {p.name!r} scales dynamically")
    return replace(p, quant=replace(q, finite_only=True))


def _keep_subnormals(p, _):
    if not p.flush_to_zero:
        raise FixError(f"fix 'keep-subnormals': policy {p.name!r} does not flush subnormals to zero")
    return replace(p, flush_to_zero=False)


def _fp8_format(p, fmt):
    q = _need_quant(p, "fp8-format")
    return replace(p, quant=QuantConfig(**{**q.__dict__, "format": fmt}))


def _amax_percentile(p, v):
    if not 0 < v <= 100:
        raise FixError(f"fix 'amax-percentile': {v:g} is not a percentile in (0, 100]")
    return replace(p, quant=replace(_need_quant(p, "amax-percentile"), calibration="histogram", percentile=v))


def _scaling(p, gran):
    return replace(p, quant=replace(_need_quant(p, "scaling"), granularity=gran))


def _emulate_casts(p, _):
    if p.compile is None:
        raise FixError(f"fix 'emulate-precision-casts' applies to compiled runs; policy {p.name!r} runs eagerly")
    if p.emulate_precision_casts:
        raise FixError(f"fix 'emulate-precision-casts': policy {p.name!r} already has it")
    return replace(p, emulate_precision_casts=True)


def _eager(p, _):
    if p.compile is None:
        raise FixError(f"fix 'eager': policy {p.name!r} compiles nothing")
    return replace(p, compile=None, emulate_precision_casts=False)


def _loss_scale(value):
    def edit(p, _):
        if p.loss_scale == value:
            raise FixError(f"policy {p.name!r} already has loss scale {value}")
        return replace(p, loss_scale=value)

    return edit


def _scaler(entry: str, fix: str, check=None):
    """A fix that sets one of the job's GradScaler state entries (``PrecisionPolicy.grad_scaler``)."""

    def edit(p, v):
        if not p.grad_scaler:
            raise FixError(f"fix {fix!r}: policy {p.name!r} trains without a torch.amp.GradScaler")
        if check is not None:
            check(v)
        kept = tuple(kv for kv in p.grad_scaler if kv[0] not in (entry, "enabled"))
        return replace(p, grad_scaler=kept + ((entry, v),))

    return edit


def _backoff_below_one(v) -> None:
    if not v < 1:
        raise FixError(f"fix 'scaler-backoff': the backoff factor multiplies the scale after an overflow and must "
                       f"be below 1, got {v:g}")


def _whole(v) -> None:
    if v != int(v):
        raise FixError(f"fix 'scaler-growth-interval': a number of steps, got {v:g}")


_F32, _F16, _B16 = FORMATS["fp32"], FORMATS["fp16"], FORMATS["bf16"]

for _d in (
    FixDef("keep-fp32", "pattern",
           lambda pat: f"run modules matching {pat!r} in fp32 (max {num_text(_F32.max, 3)}, "
                       f"eps {num_text(_F32.eps, 3)}): "
                       "an fp32 island where values leave the low-precision range or lose precision",
           _keep_fp32, "keep-fp32:layers.0.mlp.down_proj", target=lambda _: "fp32"),
    FixDef("use-bf16", None,
           lambda _: f"compute in bf16 instead of fp16: bf16 keeps fp32's exponent range (max {num_text(_B16.max, 3)} vs "
                     f"fp16 {num_text(_F16.max, grouped=True)}) at {_B16.eps / _F16.eps:g}x coarser rounding",
           _use_bf16, "use-bf16", target=lambda _: "bf16"),
    FixDef("scale-fp32", None,
           lambda _: f"compute fp8 amax, scale and its reciprocal in fp32: a scale below fp16's smallest normal "
                     f"({num_text(_F16.smallest_normal, 3)}) stays normal in fp32 and its reciprocal stays below "
                     f"fp32 max ({num_text(_F32.max, 3)})",
           _scale_fp32, "scale-fp32"),
    FixDef("amax-floor", "value",
           lambda v: f"clamp amax to at least {v:g} so an all-zero or tiny tensor or row gets a finite "
                     "reciprocal scale instead of 1/0 = inf (the floor must be representable in the scale format)",
           _amax_floor, "amax-floor:1e-12"),
    FixDef("eps", "value",
           lambda v: f"raise every normalisation's epsilon to at least {v:g} (LayerNorm, RMSNorm, GroupNorm, "
                     "BatchNorm, transformers' RMSNorm); it keeps 1/sqrt(var + eps) finite when the "
                     f"variance is 0 if the compute format holds it as a normal number "
                     f"(fp16 smallest normal {num_text(_F16.smallest_normal, 3)})",
           _eps, "eps:1e-3"),
    FixDef("stable-softmax", None,
           lambda _: f"subtract the row max before exp(): exp(x - max) <= 1 cannot overflow "
                     f"(in fp16 exp(x) overflows for x > ln({num_text(_F16.max, grouped=True)}) = "
                     f"{math.log(_F16.max):.2f})",
           _flag("stable_softmax", "stable-softmax"), "stable-softmax"),
    FixDef("stats-fp32", None,
           lambda _: f"compute normalisation statistics in fp32: x^2 cannot overflow (fp16 overflows for "
                     f"|x| > {math.sqrt(_F16.max):.1f}) and E[x^2] - E[x]^2 does not cancel to a negative number",
           _flag("stats_fp32", "stats-fp32"), "stats-fp32"),
    FixDef("two-pass-variance", None,
           lambda _: "compute the variance as mean((x - mean)^2): never negative, no cancellation between "
                     "two large nearly equal numbers",
           _flag("two_pass_variance", "two-pass-variance"), "two-pass-variance"),
    FixDef("sanitize-nonfinite", "pattern",
           lambda pat: f"replace NaN by 0 and +/-inf by +/-max in the output of {pat!r} so one bad row does "
                       "not poison everything after it (hides the cause: fix the producer where possible)",
           _sanitize, "sanitize-nonfinite:norm"),
    FixDef("calibrate-finite-only", None,
           lambda _: "build calibration histograms from finite values only: torch.histc refuses a NaN/Inf "
                     "range, and a NaN amax makes every scale NaN",
           _finite_only, "calibrate-finite-only"),
    FixDef("keep-subnormals", None,
           lambda _: f"turn flush-to-zero off: values between fp16's smallest subnormal "
                     f"({num_text(_F16.smallest_subnormal, 3)}) and smallest normal ({num_text(_F16.smallest_normal, 3)}) "
                     "keep their value instead of becoming 0",
           _keep_subnormals, "keep-subnormals"),
    FixDef("fp8-format", "format",
           lambda f: f"fake-quantise to {f} (max {num_text(FORMATS[f].max, 3)}, smallest normal "
                     f"{num_text(FORMATS[f].smallest_normal, 3)}, eps {num_text(FORMATS[f].eps, 3)})",
           _fp8_format, "fp8-format:fp8_e5m2", target=lambda f: f),
    FixDef("scaling", "choice:tensor|row",
           lambda g: f"one fp8 scale per {g}" + (": an outlier row no longer coarsens every other row"
                                                  if g == "row" else ""),
           _scaling, "scaling:row"),
    FixDef("amax-percentile", "value",
           lambda v: f"build each fp8 scale from the {v:g}th percentile of |x| instead of its max: values above it "
                     "saturate at the format's max, and one outlier no longer flushes the others to zero",
           _amax_percentile, "amax-percentile:99.9"),
    FixDef("emulate-precision-casts", None,
           lambda _: "compile with inductor's emulate_precision_casts (TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1): "
                     "fused kernels round each intermediate to the low-precision format where eager code does, "
                     "so compiled numbers match eager ones instead of keeping fp32 intermediates",
           _emulate_casts, "emulate-precision-casts"),
    FixDef("loss-scale", "value",
           lambda v: f"multiply the loss by {v:g} before backward and divide the gradients by it in fp32 before the "
                     f"optimizer uses them (a static torch.amp.GradScaler): a gradient below fp16's smallest "
                     f"subnormal ({num_text(_F16.smallest_subnormal, 3)}) is computed {v:g}x larger instead of "
                     "flushing to 0",
           lambda p, v: _loss_scale(v)(p, v), "loss-scale:65536"),
    FixDef("dynamic-loss-scale", None,
           lambda _: "torch.amp.GradScaler's dynamic loss scale: the largest power of two at which every gradient "
                     f"stays finite (below fp16's max {num_text(_F16.max, grouped=True)}), found by halving it on "
                     "each step whose gradients hold inf or NaN, a step that is skipped so Adam's state never "
                     "sees them; the gradients are unscaled in fp32",
           _loss_scale("dynamic"), "dynamic-loss-scale"),
    FixDef("skip-nonfinite-step", None,
           lambda _: "skip an optimizer step whose gradients hold inf or NaN (what GradScaler's scaler.step does): "
                     "Adam's exp_avg_sq = g^2 = inf and its update inf / inf = NaN never reach the weights; "
                     "clipping cannot do it (the norm of an inf gradient is inf, the clipped gradient NaN)",
           _flag("skip_nonfinite_step", "skip-nonfinite-step"), "skip-nonfinite-step"),
    FixDef("scaler-init", "value",
           lambda v: f"start the GradScaler's loss scale at {v:g}: the scaled loss's gradients stay below fp16's max "
                     f"({num_text(_F16.max, grouped=True)}) where the job's scale made them inf, while staying "
                     f"above its smallest subnormal ({num_text(_F16.smallest_subnormal, 3)})",
           _scaler("scale", "scaler-init"), "scaler-init:1024"),
    FixDef("scaler-growth-interval", "value",
           lambda v: f"let the GradScaler double its scale only after {v:g} steps without inf/NaN gradients: a scale "
                     "that grows less often overflows fp16 less often (each overflow skips a step)",
           _scaler("growth_interval", "scaler-growth-interval", _whole), "scaler-growth-interval:2000"),
    FixDef("scaler-backoff", "value",
           lambda v: f"multiply the GradScaler's scale by {v:g} after a step with inf/NaN gradients: a smaller "
                     "factor brings gradients back under fp16's max in fewer skipped steps",
           _scaler("backoff_factor", "scaler-backoff", _backoff_below_one), "scaler-backoff:0.25"),
    FixDef("eager", None,
           lambda _: "run without torch.compile: tells apart what compilation changes (fused kernels, fp32 "
                     "intermediates, reordered reductions) from what the format does",
           _eager, "eager"),
):
    register_fix(_d)

del _d

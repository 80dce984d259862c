"""Diagnosis rules: explain what went wrong in number-format terms, and rank fixes.

The rules read facts about recorded runs through a ``RunFacts`` they are
given (the service ``services.diagnose`` answers it from the store) and
return ``Diagnosis`` records; they never touch a database.

For a run with non-finite values the rules look at the first non-finite
producer and the op or module around it, and are tried in order; the first that recognises the failure writes the
diagnosis:

``parameter-nonfinite``     a parameter is NaN/inf before any op reads it
                            (its fp32 value is beyond the format's max)
``nonfinite-in-reference``  the fp32 reference produces it too (not a
                            precision problem; calibration downstream fails)
``fp8-scale``               a fake-quant scale is 0 or subnormal in its format
                            and its reciprocal is inf: 0 x inf = NaN
``softmax-overflow``        exp() of logits above ln(max) overflows
``norm-statistics``         x^2 overflow, cancelling one-pass variance, an
                            epsilon lost to flush-to-zero
``division``                x / 0, 1 / (a value below 1/max), rsqrt(0),
                            sqrt/log of a negative, from the divisor's record
``overflow``                an output larger than the format's max
``product-overflow``        x * y or x^2 past the max, from the inputs' records
``nonfinite-producer``      anything else, with the numbers that are known
``nonfinite-input``         the run's inputs are already non-finite

Runs without non-finite values get ``precision-loss`` (an op whose local
error is far above its format's rounding), ``error-amplified`` (an op that
multiplies the relative error it receives: cancellation), ``integer-limit``
(an add whose count passed the format's contiguous-integer limit, fp16 2048,
bf16 256, so its +1 is lost), ``gradient-underflow`` (gradients zero where the
fp32 run's are not: loss scaling) and ``fp8-quantisation``; re-runs get
``fix-verified`` when the fix removed every non-finite value.  A run whose
non-finite value is a backward op's gradient that the optimizer then turned
into NaN weights also gets ``optimizer-nonfinite`` (Adam: inf / inf).  Every
threshold is read from ``FORMATS``; every number in a message comes from the
stored stats.  A fix whose target format cannot hold the values at stake
(``catalogue.unreachable``: ``use-bf16`` for ``finfo(float32).min``) is never
offered.

Sessions made from recipes carry the recipe name and the run's policy, so
the rules also know module classes, epsilons and flush-to-zero, and propose
fixes by module name.  For dump-only sessions they use op types and names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol

from ..formats import FORMATS, Format, format_for_dtype
from ..metrics import VERDICT_THRESHOLDS
from ..display import num_text
from ..enums import Direction, OriginKind
from ..ops import aliases_of, canonical, innermost_module, module_path, module_prefixes
from ..quantisation import FLUSH_ERROR, QUANT_FIXES, flushed_by_underflow, quant_facts
from ..origin import Origin
from ..records import INPUT_ROLES, Diagnosis, RunInfo, StoredRecord
from ..registry import Registry
from .catalogue import unreachable
from .facts import ErrorGrowth, FinalOutput, LocalError, OpSeen, PairedValues, QuantiseCall, StateAfter
from .policy import PolicyError, island_effects

__all__ = ["Context", "Evidence", "RunFacts", "RULES", "register_rule", "diagnose_run", "module_facts", "fmt_num",
           "representable_floor", "quantise_findings", "at_stake"]



def fmt_num(v: Optional[float]) -> str:
    """A number in a diagnosis sentence: ``display.num_text`` with large values grouped (78,450), 4 digits,
    2 for values below 1e-3 (a scale of 3.5e-06 is about its exponent, not its digits)."""
    tiny = isinstance(v, (int, float)) and math.isfinite(v) and 0 < abs(v) < 1e-3
    return num_text(v, 2 if tiny else 4, grouped=True)


def representable_floor(quant_fmt: Format, scale_fmt: Format) -> float:
    """Smallest power of two amax floor that keeps ``1 / (amax / quant max)`` finite in ``scale_fmt``."""
    need = quant_fmt.max / scale_fmt.max
    return 2.0 ** math.ceil(math.log2(need))


def _eps_normal(fmt: Format) -> float:
    """A round epsilon that ``fmt`` holds as a normal number (survives flush-to-zero)."""
    return 10.0 ** math.ceil(math.log10(fmt.smallest_normal))


# ---- what a rule sees -------------------------------------------------------------

class RunFacts(Protocol):
    """What a rule may ask about the recorded runs, as typed rows (``records.StoredRecord``, ``fixes.facts``).

    The service layer answers these from the store; tests may answer them from lists.
    """

    def op_records(self, run_id: str, op: str, step: int, rank: int) -> list[StoredRecord]: ...

    def module_call(self, run_id: str, module: str, step: int, rank: int, seq: int, *,
                    after: bool = True) -> list[StoredRecord]:
        """Records of one call of ``module`` (capture names it ``<module>.forward.<n>``): with ``after`` the
        call that encloses ``seq`` (first at or after it), else the last call at or before it."""

    def reference_of(self, cand_run_id: str, recs: list[StoredRecord], ref_run_id: str) -> dict[int, StoredRecord]:
        """Reference records paired with ``recs`` (by stored comparisons, else by name), by candidate rid."""

    def first_nonfinite_output_of_type(self, run_id: str, op_type: str) -> Optional[str]: ...

    def warning_starting(self, run_id: str, prefix: str) -> Optional[str]: ...

    def ops_above(self, run_id: str, absmax: float) -> list[OpSeen]:
        """Ops whose inputs or outputs exceed ``absmax``, in execution order."""

    def worst_local_errors(self, run_id: str, limit: int) -> list[LocalError]: ...

    def last_accumulated_output(self, run_id: str) -> Optional[FinalOutput]: ...

    def last_forward_output_finite(self, run_id: str) -> bool: ...

    def error_growth(self, run_id: str) -> list[ErrorGrowth]:
        """Per op call, its output's and inputs' accumulated error, in execution order."""

    def paired_values(self, run_id: str, roles, op_types=None) -> list[PairedValues]:
        """The run's records of ``roles`` (ops of ``op_types`` when given) compared element-wise, beside the
        reference's, in execution order."""

    def first_nonfinite_state_after(self, run_id: str, step: int) -> Optional[StateAfter]:
        """The first non-finite parameter or buffer record after ``step``."""

    def quantise_calls(self, run_id: str) -> list[QuantiseCall]:
        """Each quantise op call with its first input and output records."""


@dataclass
class Context:
    facts: RunFacts
    session: dict
    runs: list[RunInfo]
    ref_run: Optional[RunInfo]
    modules: dict[str, dict] = field(default_factory=dict)  # module path -> facts (class, eps, leaf, ...)
    policies: dict[str, object] = field(default_factory=dict)  # run_id -> PrecisionPolicy

    def module_call(self, run_id: str, module: str, step: int, rank: int, seq: int, *, after: bool = True):
        return self.facts.module_call(run_id, module, step, rank, seq, after=after)

    def module_of(self, op: str) -> Optional[str]:
        """The innermost known module an op name belongs to (recipe sessions), else None."""
        return innermost_module(op, self.modules)


@dataclass
class Evidence:
    run: RunInfo
    producer: Origin  # the run's first non-finite origin
    op: str
    op_type: str
    module: Optional[str]
    module_facts: dict
    records: list[StoredRecord]  # the producer op's records in this run
    module_records: list[StoredRecord]  # the enclosing module's records (may equal records)
    fmt: Format  # the format the producer computed in
    policy: object  # PrecisionPolicy or None

    def inputs(self, recs=None) -> list[StoredRecord]:
        return [r for r in (recs if recs is not None else self.records) if r.role in INPUT_ROLES]

    def outputs(self, recs=None) -> list[StoredRecord]:
        return [r for r in (recs if recs is not None else self.records) if r.role not in INPUT_ROLES]

    @property
    def where(self) -> str:
        return self.module or self.op


Rule = Callable[[Context, Evidence], Optional[Diagnosis]]
RULES = Registry("diagnosis rule", group="precision_lab.rules")


def register_rule(name: str, *, before: Optional[str] = None, replace: bool = False):
    """Add a producer rule (``fn(ctx, evidence) -> Diagnosis | None``), tried in order (``before=`` puts it ahead
    of another); built-ins use this too."""

    def deco(fn):
        RULES.register(name, fn, before=before, replace=replace)
        return fn

    return deco


def _diag(ev: Evidence, rule: str, message: str, fixes, severity: str = "error") -> Diagnosis:
    seen, ranked = set(), []
    for f in fixes:
        if f and f not in seen:
            seen.add(f)
            ranked.append(f)
    return Diagnosis(session_id="", run_id=ev.run.run_id, op=ev.where, rule=rule, message=message,
                     fixes=tuple(ranked), severity=severity, seq=ev.producer.seq)


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _ref_records(ctx: Context, ev: Evidence, recs: list[StoredRecord]) -> dict[int, StoredRecord]:
    """Reference records paired with ``recs`` (by the stored comparisons, else by name)."""
    if ctx.ref_run is None or not recs:
        return {}
    return ctx.facts.reference_of(ev.run.run_id, recs, ctx.ref_run.run_id)


def _keep_fp32(ev: Evidence) -> Optional[str]:
    if not ev.module or ev.module_facts.get("island_changes") is False:  # an island there changes nothing
        return None
    return f"keep-fp32:{ev.module}"


def _reachable(fixes, **values) -> list:
    """``fixes`` without those that cannot help values of these magnitudes (``catalogue.unreachable``: a fix
    whose target format cannot hold them either is never offered)."""
    return [f for f in fixes if f and not unreachable(f, **values)]


def at_stake(reference_records: Iterable[StoredRecord]) -> Optional[float]:
    """The largest finite magnitude among the reference's records of the producer's inputs and outputs: what a
    fix's target format must hold (``catalogue.unreachable(fix, absmax=...)``); None without them.  The cards and
    the fixes listing (``services.applicable``) both ask it."""
    return max((r.magnitude for r in reference_records if _finite(r.magnitude)), default=None)


def _at_stake(ctx: Context, ev: Evidence) -> Optional[float]:
    return at_stake(_ref_records(ctx, ev, ev.records).values())


# ---- producer rules ------------------------------------------------------------------

@register_rule("parameter-nonfinite")
def _rule_parameter(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    """A parameter that is NaN/inf before any op uses it: it overflowed in the model's cast, or was stored so."""
    param = ev.producer.parameter
    if ev.producer.origin is not OriginKind.PARAMETER or not param:
        return None
    module = param.name.rsplit(".", 1)[0] if "." in param.name else ""
    ref = param.ref_absmax
    fixes = []
    if ref is not None and math.isfinite(ref):
        if ref < FORMATS["bf16"].max and ev.fmt.name == "fp16":
            fixes.append("use-bf16")
        fixes.append(f"keep-fp32:{module}" if module and ctx.modules.get(module, {}).get("island_changes") is not False
                     else None)
        msg = (f"{param.reason}. Every op that reads it inherits the inf; keep `{module or 'the model'}` in fp32, "
               f"rescale the weight below {fmt_num(ev.fmt.max)}, or use a format with a wider range")
    else:
        msg = f"{param.reason}. Reload or re-initialise the weights; no precision change helps"
    return _diag(ev, "parameter-nonfinite", msg, fixes, "error")


@register_rule("nonfinite-input")
def _rule_input(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if ev.producer.origin is not OriginKind.INPUT:
        return None
    msg = (f"`{ev.op}` already receives non-finite values in its {ev.producer.role} {ev.producer.index}: "
           "no recorded op produced them (they come from the model's inputs or from before the first recorded op)")
    return _diag(ev, "nonfinite-input", msg, [], "error")


@register_rule("nonfinite-in-reference")
def _rule_reference(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if ctx.ref_run is None or ev.run.run_id == ctx.ref_run.run_id:
        return None
    recs = ev.module_records or ev.records
    refs = _ref_records(ctx, ev, ev.outputs(recs))
    bad = [r for r in refs.values() if r.nonfinite]
    if not bad:
        return None
    out = bad[0]
    ins = ev.inputs(recs)
    zeros = sum(r.stats.zero_count or 0 for r in ins)
    nan, inf = out.stats.nan_count or 0, out.stats.inf_count or 0
    what = []
    if nan:
        what.append(f"{nan:,} NaN")
    if inf:
        what.append(f"{inf:,} inf")
    msg = (f"`{ev.where}` produces {' and '.join(what) or 'non-finite values'} in the fp32 reference run too: "
           "this is not a precision problem.")
    if zeros and nan:
        msg += f" Its input holds {zeros:,} zeros: 0/0 (e.g. normalising an all-zero row)."
    fixes = []
    if ev.module_facts.get("eps") is not None:
        fixes.append("eps:1e-6")  # removes the 0/0 itself
    fixes.append(f"sanitize-nonfinite:{ev.module}" if ev.module else None)
    policy = ev.policy
    q = getattr(policy, "quant", None)
    if q is not None and q.calibration == "histogram":
        calib = ctx.facts.first_nonfinite_output_of_type(ev.run.run_id, "Amax")
        if calib:
            warn = ctx.facts.warning_starting(ev.run.run_id, "histogram calibration failed:")
            if warn:
                err = warn.split(":", 1)[1].strip()
            else:  # torch's own words for a histogram over a NaN range
                import torch  # deferred: diagnosis runs without torch unless it must quote torch's own error

                from .modules import histogram_amax  # deferred with torch (it defines torch modules)

                err = histogram_amax(torch.tensor([float("nan")]))[1]
            msg += (f" Histogram calibration at `{calib}` then receives NaN and fails ({err}), so its "
                    "amax and every scale after it are NaN; the calibration is a victim, not the cause.")
            fixes.append("calibrate-finite-only")
    return _diag(ev, "nonfinite-in-reference", msg, fixes)


def _quant_chain(ctx: Context, ev: Evidence):
    """(scale, reciprocal, amax output records, fake-quant path) when the producer sits in a fake-quant chain."""
    path = ev.module or ev.op
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        base = ".".join(parts[:cut])
        facts = ctx.modules.get(base, {})
        if facts.get("class") == "FakeQuant":
            fq = base
            break
    else:
        if ev.module_facts.get("class") in ("Reciprocal", "QuantScale", "Amax"):
            fq = ".".join(parts[:-1])
        elif ev.op_type in ("reciprocal",) or parts[-1] in ("inv_scale", "scale"):
            fq = ".".join(parts[:-1])
        else:
            return None
    step, rank, seq = ev.producer.step, ev.producer.rank, ev.producer.seq
    run_id = ev.run.run_id
    scale = _outputs(ctx.module_call(run_id, f"{fq}.scale", step, rank, seq, after=False))
    inv = _outputs(ctx.module_call(run_id, f"{fq}.inv_scale", step, rank, seq, after=False))
    amax = _outputs(ctx.module_call(run_id, f"{fq}.amax", step, rank, seq, after=False))
    if not scale:
        return None
    return scale[0], (inv[0] if inv else None), (amax[0] if amax else None), fq


def _outputs(recs: list[StoredRecord]) -> list[StoredRecord]:
    return [r for r in recs if r.role == "output"]


@register_rule("fp8-scale")
def _rule_fp8_scale(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    got = _quant_chain(ctx, ev)
    if got is None:
        return None
    scale, inv, amax, fq = got
    sfmt = format_for_dtype(scale.dtype) or FORMATS["fp32"]
    q = getattr(ev.policy, "quant", None)
    qfmt = FORMATS[q.format] if q is not None else None
    inv_op = inv.op if inv else f"{fq}.inv_scale"
    zeros = scale.stats.zero_count or 0
    amax_zeros = (amax.stats.zero_count or 0) if amax else zeros
    smallest = scale.stats.min_abs_nonzero
    per_row = q is not None and q.granularity == "row"
    qmax = f"{qfmt.name} max {fmt_num(qfmt.max)}" if qfmt else "the format's max"
    parts = []

    def rows(n):
        return f"{n:,} row{'s' if n > 1 else ''}" if per_row else "the tensor"

    if amax_zeros:
        parts.append(f"amax is 0 for {rows(amax_zeros)} (all zeros), so scale = amax / {qmax} = 0 in {sfmt.name}; "
                     f"its reciprocal is inf and 0 x inf = NaN at `{inv_op}`")
    if zeros > amax_zeros:
        parts.append(f"the scale of {rows(zeros - amax_zeros)} with a tiny nonzero amax underflows to 0 in "
                     f"{sfmt.name} (amax / {qmax} < its smallest subnormal {fmt_num(sfmt.smallest_positive)}), "
                     "so its reciprocal is inf as well")
    if _finite(smallest) and smallest > 0 and smallest < sfmt.smallest_normal:
        recip = 1.0 / smallest
        s = (f"scale {fmt_num(smallest)} is subnormal in {sfmt.name} (smallest normal "
             f"{fmt_num(sfmt.smallest_normal)})")
        if recip > sfmt.max:
            s += f"; its reciprocal {recip:.2g} exceeds {sfmt.name} max {fmt_num(sfmt.max)} -> inf"
            s += f"; 0 x inf = NaN at `{inv_op}`" if not parts else ""
        parts.append(s)
    elif _finite(smallest) and smallest > 0 and 1.0 / smallest > sfmt.max:
        parts.append(f"scale {fmt_num(smallest)}: its reciprocal {1.0 / smallest:.2g} exceeds {sfmt.name} max "
                     f"{fmt_num(sfmt.max)} -> inf at `{inv_op}`")
    if not parts:
        if inv is None or not inv.nonfinite:
            return None
        parts.append(f"the reciprocal scale at `{inv_op}` is not finite")
    msg = "; ".join(parts)
    fixes = []
    if zeros:
        if sfmt.name != "fp32":
            fixes.append("scale-fp32+amax-floor:1e-12")
            msg += (f". A floor like clamp(min=1e-12) does nothing in {sfmt.name} "
                    f"(1e-12 < its smallest subnormal {fmt_num(sfmt.smallest_positive)} rounds to 0)")
        else:
            fixes.append("amax-floor:1e-12")
    elif sfmt.name != "fp32":
        fixes.append("scale-fp32")
    if qfmt is not None and sfmt.name != "fp32":
        fixes.append(f"amax-floor:{representable_floor(qfmt, sfmt):g}")
    return _diag(ev, "fp8-scale", msg, fixes)


def _is_softmax(ev: Evidence) -> bool:
    # exp() of the logits overflows first when softmax is written out by hand
    return canonical(ev.module_facts.get("class")) == "softmax" or canonical(ev.op_type) in ("softmax", "exp")


@register_rule("softmax-overflow")
def _rule_softmax(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if not _is_softmax(ev):
        return None
    recs = ev.module_records or ev.records
    ins = [r for r in ev.inputs(recs) if _finite(r.stats.max)]
    if not ins:
        return None
    top = max(r.stats.max for r in ins)
    lim = math.log(ev.fmt.max)
    if top <= lim:
        return None
    stable = ev.module_facts.get("stable")
    msg = (f"logits reach {fmt_num(top)} > ln({fmt_num(ev.fmt.max)}) = {lim:.2f}: exp() overflows {ev.fmt.name} "
           f"-> inf, and inf / inf = NaN in `{ev.where}`")
    msg += " (softmax without max subtraction)" if stable is False else ""
    return _diag(ev, "softmax-overflow", msg, ["stable-softmax", _keep_fp32(ev),
                                                "use-bf16" if ev.fmt.name == "fp16" else None])


def _is_norm(ev: Evidence) -> bool:
    return bool({canonical(ev.module_facts.get("class")), canonical(ev.op_type)} & {"layer_norm", "rms_norm"})


@register_rule("norm-statistics")
def _rule_norm(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if not _is_norm(ev):
        return None
    f = ev.fmt
    recs = ev.module_records or ev.records
    ins = ev.inputs(recs)
    held = [r for r in ins if r.role == "input" and _finite(r.magnitude)]
    widest = max(held, key=lambda r: r.magnitude, default=None)
    x = widest.magnitude if widest is not None else None
    if x is not None and x > f.max:
        # the input arrives in a wider format (an fp32 island before it) and is past the format's range: the
        # first failure is its cast into the format, not a square computed in it
        held_in = format_for_dtype(widest.dtype) if widest.dtype else None
        return _diag(ev, "norm-statistics",
                     f"`{ev.where}` in {f.name}: input absmax {fmt_num(x)}"
                     + (f" arrives in {held_in.name} and" if held_in is not None and held_in.name != f.name else "")
                     + f" exceeds {f.name} max {fmt_num(f.max)}, so casting it to {f.name} gives inf before the "
                       "normalisation computes anything",
                     [_keep_fp32(ev), "use-bf16" if f.name == "fp16" else None])
    facts = ev.module_facts
    parts, fixes = [], []
    one_pass = facts.get("class") == "LayerNorm" and not facts.get("two_pass")
    stats_fp32 = facts.get("stats_fp32")
    if x is not None and not stats_fp32 and x * x > f.max:
        what = "E[x^2] (one-pass variance)" if one_pass else "mean(x^2)"
        parts.append(f"input absmax {fmt_num(x)}: x^2 = {fmt_num(x * x)} > {f.name} max {fmt_num(f.max)}, so {what} "
                     f"overflows to inf" + (" and inf - inf = NaN" if one_pass else ""))
    eps = facts.get("eps")
    if eps is not None and facts.get("flush_to_zero") and f.has_subnormals and eps < f.smallest_normal:
        parts.append(f"epsilon {eps:g} is subnormal in {f.name} (smallest normal {fmt_num(f.smallest_normal)}) "
                     "and becomes 0 under flush-to-zero: a zero-variance row gives 0 x rsqrt(0) = 0 x inf = NaN")
        fixes.append(f"eps:{_eps_normal(f):g}")
    if one_pass and not stats_fp32 and x is not None and x * x <= f.max:
        sq = x * x
        spacing = 2.0 ** (math.floor(math.log2(sq)) - f.man_bits) if sq > 0 else 0.0
        parts.append(f"the one-pass variance E[x^2] - E[x]^2 subtracts numbers up to {fmt_num(sq)} whose "
                     f"{f.name} spacing is {fmt_num(spacing)}: a small variance cancels and can go negative, "
                     "and rsqrt(negative) = NaN")
    if not parts:
        parts.append(f"the normalisation statistics of `{ev.where}` are not finite in {f.name}")
    # every proposal addresses every cause found: fp32 statistics cover all of them
    needs_two_pass = one_pass and not stats_fp32 and x is not None
    eps_fix = next((x for x in fixes if x.startswith("eps:")), None)
    combo = "+".join(p for p in ("two-pass-variance" if needs_two_pass else None, eps_fix) if p)
    fixes = ["stats-fp32", combo or None, _keep_fp32(ev)]
    return _diag(ev, "norm-statistics", f"`{ev.where}` in {f.name}: " + "; ".join(parts), fixes)


def _island(ctx: Context, fmt: Format) -> list[str]:
    """Leaf modules whose reference inputs or outputs exceed ``fmt``'s max (need fp32), in execution order."""
    if ctx.ref_run is None or not ctx.modules:
        return []
    leaves = {n for n, f in ctx.modules.items() if f.get("leaf") and n}
    rows = ctx.facts.ops_above(ctx.ref_run.run_id, fmt.max)
    out = []
    for r in rows:
        m = ctx.module_of(r.op)
        if m in leaves and m not in out:
            out.append(m)
    return out


def _zeros(r: StoredRecord) -> Optional[int]:
    """How many zeros a record holds: its count, else 1 when a summary's Min or Max is exactly 0, else None."""
    if r.stats.zero_count is not None:
        return r.stats.zero_count
    return 1 if 0.0 in (r.stats.min, r.stats.max) else None


def _smallest_magnitude(r: StoredRecord) -> Optional[float]:
    v = r.stats.min_abs_nonzero
    if _finite(v) and v > 0:
        return float(v)
    mn, mx = r.stats.min, r.stats.max
    if _finite(mn) and _finite(mx) and (mn > 0 or mx < 0):  # one sign: the extreme nearest 0 bounds it
        return min(abs(mn), abs(mx))
    return None


# the input that divides (or is taken the root or log of), by op type
_DIVISOR = {"reciprocal": "0", "div": "1", "rsqrt": "0", "sqrt": "0", "log": "0"}


@register_rule("division")
def _rule_division(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    """x / 0, 1 / (a value below 1/max), rsqrt(0), sqrt or log of a negative: from the recorded divisor."""
    op = canonical(ev.op_type)
    idx = _DIVISOR.get(op or "")
    if idx is None:
        return None
    ins = [r for r in ev.inputs() if r.role == "input"]
    den = next((r for r in ins if r.index == idx), None)
    if den is None:
        return None
    f = ev.fmt
    zeros = _zeros(den)
    small = _smallest_magnitude(den)
    negative = _finite(den.stats.min) and den.stats.min < 0 and op in ("rsqrt", "sqrt", "log")
    parts = []
    name = {"reciprocal": "1 / x", "div": "x / y", "rsqrt": "rsqrt(x)", "sqrt": "sqrt(x)", "log": "log(x)"}[op]
    if zeros:
        num = next((r for r in ins if r.index == "0"), None) if op == "div" else None
        # 0/0: the numerator's own zeros, or (statistics only) a NaN where a quotient by zero alone gives inf
        both = num is not None and (_zeros(num) or any(
            r.stats.nan_count or (isinstance(r.stats.max, float) and math.isnan(r.stats.max)) for r in ev.outputs()))
        what = {"reciprocal": "1/0 = inf", "div": "0/0 = NaN" if both else "x/0 = inf", "rsqrt": "rsqrt(0) = inf",
                "sqrt": "sqrt(0) = 0", "log": "log(0) = -inf"}[op]
        parts.append(f"`{ev.where}` computes {name} where the {'divisor' if op in ('div', 'reciprocal') else 'input'} "
                     f"holds {'zeros' if zeros != 1 else 'a zero'} in {f.name}: {what}")
    if negative:
        parts.append(f"its input goes down to {fmt_num(den.stats.min)}: {name} of a negative number is NaN (a "
                     "variance computed as E[x^2] - E[x]^2 that cancelled below zero)")
    if small is not None and op in ("reciprocal", "div") and 1.0 / small > f.max:
        parts.append(f"the divisor reaches {fmt_num(small)} < 1/{fmt_num(f.max)} = {1.0 / f.max:.2g}, so the quotient "
                     f"overflows {f.name}")
    if not parts:
        return None
    msg = "; ".join(parts)
    if op in ("rsqrt", "sqrt", "log") and zeros:
        msg += (f". An epsilon added before it must survive {f.name}: values below its smallest subnormal "
                f"{fmt_num(f.smallest_positive)} round to 0 (1e-8 does), and below its smallest normal "
                f"{fmt_num(f.smallest_normal)} flush-to-zero removes them; use eps >= {_eps_normal(f):g}")
    elif op in ("reciprocal", "div"):
        msg += (f". Floor the divisor at a value {f.name} holds (clamp(min=...) >= {_eps_normal(f):g}; for a "
                "quantisation scale, floor amax), or compute it in fp32")
    fixes = [f"eps:{_eps_normal(f):g}" if ev.module_facts.get("eps") is not None else None,
             "scale-fp32" if f.name != "fp32" and getattr(ev.policy, "quant", None) is not None else None,
             _keep_fp32(ev)]
    return _diag(ev, "division", msg, fixes)


@register_rule("mask-overflow")
def _rule_mask_overflow(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    """A mask value beyond the format's range (``finfo(float32).min`` in fp16): finite in the reference, ``-inf``
    here, and a row masked throughout is all ``-inf``, which a softmax turns into NaN."""
    outs = [r for r in ev.outputs(ev.records) if r.stats.negative_inf_only]
    refs = _ref_records(ctx, ev, outs)
    f = ev.fmt
    ref_min = min((r.stats.min for r in refs.values() if r.stats.min is not None and math.isfinite(r.stats.min)),
                  default=None)
    if not outs or ref_min is None or ref_min >= -f.max:
        return None
    msg = (f"`{ev.where}` writes a mask value {fmt_num(ref_min)} (finite in the fp32 reference) below {f.name}'s most "
           f"negative number -{fmt_num(f.max)}: it becomes -inf, and a row masked throughout (a sequence that is all "
           f"padding) is then all -inf, which a softmax turns into NaN (-inf - -inf). Use a mask value {f.name} "
           f"holds (torch.finfo of the compute dtype: -{fmt_num(f.max)}), or clamp the scores before the softmax")
    # bf16 is offered only where it holds the value (``unreachable`` drops it, and says so, for finfo(fp32).min)
    return _diag(ev, "mask-overflow", msg, [f"sanitize-nonfinite:{ev.module}" if ev.module else None,
                                            "use-bf16" if f.name == "fp16" else None])


@register_rule("overflow")
def _rule_overflow(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    recs = ev.module_records or ev.records
    outs = ev.outputs(recs)
    refs = _ref_records(ctx, ev, outs)
    ref_max = at_stake(refs.values())
    f = ev.fmt
    if ref_max is None or ref_max <= f.max:
        return None
    msg = (f"`{ev.where}` output absmax {fmt_num(ref_max)} (fp32 reference) > {f.name} max {fmt_num(f.max)}: "
           f"the value itself exceeds {f.name}'s range, so fp32 accumulation alone does not help")
    fixes = ["use-bf16" if f.name == "fp16" else None]
    island = _island(ctx, f)
    if island:
        fixes.append("+".join(f"keep-fp32:{m}" for m in island))
        if len(island) > 1:
            msg += (f"; values stay above {fmt_num(f.max)} until a normalisation, so the fp32 island is "
                    + ", ".join(f"`{m}`" for m in island))
    else:
        fixes.append(_keep_fp32(ev))
    return _diag(ev, "overflow", msg, fixes)


@register_rule("product-overflow")
def _rule_product(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    """x * y (or x ** 2) whose inputs' magnitudes multiply past the format's max: from the recorded inputs."""
    op = canonical(ev.op_type)
    if op not in ("mul", "pow"):
        return None
    ins = [r for r in ev.inputs() if r.role == "input"]
    mags = [r.magnitude for r in ins[:2]]
    if op == "pow" or (len(mags) == 2 and mags[0] == mags[1] and ins[0].stats.min == ins[1].stats.min):
        mags = [mags[0], mags[0]] if mags and mags[0] is not None else []
        square = True
    else:
        square = False
    if len(mags) != 2 or not all(_finite(m) for m in mags) or mags[0] * mags[1] <= ev.fmt.max:
        return None
    f = ev.fmt
    prod = mags[0] * mags[1]
    if square:
        msg = (f"`{ev.where}` squares values up to {fmt_num(mags[0])}: x^2 = {fmt_num(prod)} > {f.name} max "
               f"{fmt_num(f.max)} (|x| above sqrt(max) = {math.sqrt(f.max):.4g} overflows), as in a sum of squares "
               "or a one-pass variance. Compute the statistics in fp32, or scale x down first")
        fixes = ["stats-fp32" if ev.module_facts else None, _keep_fp32(ev),
                 "use-bf16" if f.name == "fp16" else None]
    else:
        msg = (f"`{ev.where}` multiplies values up to {fmt_num(mags[0])} and {fmt_num(mags[1])}: the product reaches "
               f"{fmt_num(prod)} > {f.name} max {fmt_num(f.max)}")
        fixes = ["use-bf16" if f.name == "fp16" else None, _keep_fp32(ev)]
    return _diag(ev, "product-overflow", msg, fixes)


@register_rule("nonfinite-producer")
def _rule_fallback(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    recs = ev.records
    ins = [r for r in ev.inputs(recs)]
    outs = ev.outputs(recs)
    x = max((r.magnitude for r in ins if _finite(r.magnitude)), default=None)
    nan = sum(r.stats.nan_count or 0 for r in outs)
    inf = sum(r.stats.inf_count or 0 for r in outs)
    what = " and ".join(s for s in (f"{nan:,} NaN" if nan else "", f"{inf:,} inf" if inf else "") if s)
    msg = (f"`{ev.op}` ({ev.op_type}) turns finite inputs" + (f" (absmax {fmt_num(x)})" if x is not None else "")
           + f" into {what or 'non-finite values'} in {ev.fmt.name} (max {fmt_num(ev.fmt.max)})")
    return _diag(ev, "nonfinite-producer", msg,
                 ["use-bf16" if ev.fmt.name == "fp16" else None, _keep_fp32(ev)])


# ---- run-level findings ---------------------------------------------------------------

def _precision_loss(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    policy = ctx.policies.get(run.run_id)
    rows = ctx.facts.worst_local_errors(run.run_id, 20)
    out = []
    for r in rows:
        m = ctx.module_of(r.op)
        facts = ctx.modules.get(m or "", {})
        # fp8 fake quantisation is expected to be far coarser than the compute format
        if getattr(policy, "quant", None) is not None and any(
                ctx.modules.get(p, {}).get("class") in ("QuantLinear", "FakeQuant") for p in module_prefixes(m or r.op)):
            continue
        fmt = FORMATS.get(r.cand_format or "") or FORMATS["fp32"]
        where = m or r.op
        msg = (f"`{where}` introduces error {r.rounding_units:.3g}x {fmt.name}'s unit roundoff "
               f"(SQNR {r.sqnr_db:.1f} dB against fp32 recomputed from its own inputs)")
        out.append(Diagnosis("", run.run_id, where, "precision-loss", msg,
                             tuple(x for x in (f"keep-fp32:{m}" if m and facts and facts.get("island_changes")
                                               is not False else None,
                                               "use-bf16" if fmt.name == "fp16" else None) if x),
                             "warn", r.seq))
        if len(out) >= 3:
            break
    return out


AMPLIFY_MIN = 16.0  # how many times an op must multiply the relative error it receives to be named for it


def _amplified(ctx: Context, run: RunInfo, before: Optional[Origin] = None) -> list[Diagnosis]:
    """``error-amplified``: the first op whose inputs arrive within rounding (``VERDICT_THRESHOLDS['expected']``
    unit roundoffs) and whose output leaves beyond ``warn``, multiplying the relative error it received at
    least ``AMPLIFY_MIN`` times: cancellation (x - mean, E[x^2] - E[x]^2) turns rounding into lost bits
    without any local error of its own."""
    growth = getattr(ctx.facts, "error_growth", None)
    if run.kind == "reference" or growth is None:
        return []
    rows = growth(run.run_id)
    if before is not None:  # what went wrong before the first non-finite value (a variance cancelled below 0)
        rows = [g for g in rows if (g.step, g.seq) < (before.step, before.seq)]
    for i, g in enumerate(rows):
        out_u, in_u = g.out_units, g.in_units
        if not (_finite(out_u) and _finite(in_u)) or out_u <= VERDICT_THRESHOLDS["warn"] \
                or in_u > VERDICT_THRESHOLDS["expected"]:
            continue
        amp = out_u / max(in_u, 0.5)  # an exact input still carries half a unit of rounding once cast
        if amp < AMPLIFY_MIN:
            continue
        fmt = FORMATS.get(g.cand_format or "") or FORMATS["fp32"]
        bits = fmt.man_bits + 1
        lost = min(float(bits), math.log2(amp))
        kind = canonical(g.op_type)
        absorbed = _absorbed_before(rows[:i], g, fmt) if kind in ("sub", "add") else None
        if absorbed is not None:
            p, msg = absorbed
            m = ctx.module_of(p.op)
            fixes = (f"keep-fp32:{m}",) if m and ctx.modules.get(m, {}).get("island_changes") is not False else ()
            return [Diagnosis("", run.run_id, p.op, "absorption", msg, fixes, "warn", p.seq)]
        why = ("cancellation: its output is far smaller than its inputs, so their rounding becomes most of it"
               if kind in ("sub", "add") else "its output is far more sensitive to its inputs than they are to "
               "rounding")
        msg = (f"`{g.op}` amplifies the relative error it receives {amp:.3g}x (inputs within "
               f"{in_u:.3g}x {fmt.name}'s unit roundoff, output {out_u:.3g}x): it loses {lost:.1f} of the {bits} "
               f"significant bits {fmt.name} holds ({why}). Compute it in fp32 or reformulate it (two-pass "
               "variance, subtract the mean first)")
        m = ctx.module_of(g.op)
        fixes = (f"keep-fp32:{m}",) if m and ctx.modules.get(m, {}).get("island_changes") is not False else ()
        return [Diagnosis("", run.run_id, g.op, "error-amplified", msg, fixes, "warn", g.seq)]
    return []


def _absorbed_before(earlier: list[ErrorGrowth], g: ErrorGrowth, fmt: Format) -> Optional[tuple[ErrorGrowth, str]]:
    """``absorption`` (the earlier op call and its message): where the error a cancelling add/sub ``g`` shows
    was made, when an earlier add of the same step rounded its smaller operand away (its output's absolute
    error is at least ``AMPLIFY_MIN`` unit roundoffs of that operand), ``g``'s operands are of that add's
    output's magnitude (within 2x) and ``g`` carries the same error on, no more than twice it: ``g`` itself
    rounds nothing, as a difference of operands within a factor 2 of each other is exact.  (h + 2048) - 2048
    in fp16: the add keeps none of h's low bits, the subtraction only shows it."""
    for p in reversed(earlier):
        if (p.step, p.rank) != (g.step, g.rank) or canonical(p.op_type) not in ("add", "sub"):
            continue
        err, small, big = p.out_abs_err, p.in_absmax, p.out_absmax
        shown, received = g.out_abs_err, g.in_absmax
        if not all(_finite(v) and v > 0 for v in (err, small, big, shown, received)) or big <= small:
            continue
        # g receives what p wrote (an operand of p's magnitude) and carries its error on
        if err / small >= AMPLIFY_MIN * fmt.eps / 2 and shown <= 2 * err and 0.5 <= received / big <= 2:
            bits = fmt.man_bits + 1
            lost = min(float(bits), math.log2(big / small))
            msg = (f"`{p.op}` adds values up to {fmt_num(small)} to values near {fmt_num(big)}, whose {fmt.name} "
                   f"spacing is {fmt_num(fmt.spacing_at(big))}: it loses {lost:.1f} of the {bits} significant bits "
                   f"of its smaller operand (absorption: their low bits round away; its error {fmt_num(err)} is "
                   f"{err / small:.0%} of them). `{g.op}` after it rounds nothing (a difference of operands "
                   "within a factor 2 of each other is exact) and only shows the loss. Subtract the large offset "
                   "before adding, add the small values last, or compute it in fp32")
            return p, msg
    return None


def quantise_findings(ctx: Context, run: RunInfo) -> list[tuple[QuantiseCall, object]]:
    """``(call, QuantFacts)`` of each quantise op call of ``run`` judged worse than expected against its own
    input (``quantisation.quant_facts``), most values flushed first: what the ``fp8-quantisation`` diagnosis
    says, and the verdict its output comparisons get (``services.diagnose``)."""
    calls = getattr(ctx.facts, "quantise_calls", None)
    if calls is None or run.kind == "reference":
        return []
    quant = getattr(ctx.policies.get(run.run_id), "quant", None)
    found = []
    for c in calls(run.run_id):
        fmt = (quant.format if quant is not None else None) or "fp8_e4m3fn"
        qf = quant_facts(c.op, fmt, c.input.stats, c.output.stats, c.amax)
        if qf.verdict != "expected":
            found.append((c, qf))
    found.sort(key=lambda cq: -cq[1].flushed_share)
    return found


def _quantisation(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    """``fp8-quantisation``: a quantise op that flushes a share of its values to zero (one outlier set the
    scale) or saturates them, judged against its own input (``quantise_findings``); the worst three."""
    quant = getattr(ctx.policies.get(run.run_id), "quant", None)
    found = quantise_findings(ctx, run)
    out = []
    for c, qf in found[:3]:
        where = module_path(c.op)
        layer = where.rsplit(".", 1)[0] if "." in where else where
        fixes = [f for f in QUANT_FIXES
                 if not (f.startswith("scaling:") and quant is not None and quant.granularity == "row")]
        msg = (f"`{where}` ({'weight' if 'weight' in where.rsplit('.', 1)[-1] else 'input'} of `{layer}`): "
               f"{qf.message}. A scale per row, or an amax clipped at a high percentile, keeps the other values "
               "apart from the outlier")
        out.append(Diagnosis("", run.run_id, where, "fp8-quantisation", msg, tuple(fixes),
                             "error" if qf.verdict == "error" else "warn", c.seq))
    return out


# ops that count: an increment lost above a format's contiguous-integer limit; a running sum of ones
# (``mask.cumsum(-1)``: position ids counted in the compute dtype) counts by itself
COUNTING_OPS = ("add", "sub")
RUNNING_COUNTS = ("cumsum",)


def _integer_limit(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    """``integer-limit``: an add whose operands are integers past its format's ``integer_limit`` (fp16 2048,
    bf16 256) leaves the count where it was in the run while the reference's moves on: the increment is below
    half the format's spacing there and rounds away (a token counter stuck at 2048).  Names the first such op
    call and counts the others."""
    paired = getattr(ctx.facts, "paired_values", None)
    if run.kind == "reference" or paired is None:
        return []
    calls: dict[tuple, list] = {}
    kinds = tuple(t for k in COUNTING_OPS + RUNNING_COUNTS for t in (k,) + aliases_of(k))
    for r in paired(run.run_id, ("input", "output"), kinds):
        calls.setdefault((r.step, r.rank, r.op), []).append(r)
    lost, counted = [], []
    growth = getattr(ctx.facts, "error_growth", None)
    # a running count's largest error against the reference: whole integers it could not hold
    off = {(g.step, g.rank, g.op): g.out_abs_err for g in (growth(run.run_id) if growth else ())
           if canonical(g.op_type or "") in RUNNING_COUNTS}
    for rs in calls.values():
        out = next((r for r in rs if r.role == "output"), None)
        ins = [r for r in rs if r.role == "input" and _finite(r.ref_max) and _finite(r.ref_min)]
        fmt = format_for_dtype(out.dtype) if out else None
        if fmt is None or fmt.kind != "float" or fmt.bits >= 32:
            continue
        if canonical(out.op_type or "") in RUNNING_COUNTS:
            vals = (out.min, out.max, out.ref_min, out.ref_max)
            # a running count of integers that passes the limit in the reference and ends elsewhere in the run
            if all(_finite(v) and float(v).is_integer() for v in vals) and \
                    max(abs(out.ref_max), abs(out.ref_min)) > fmt.integer_limit and \
                    (out.max != out.ref_max or (off.get((out.step, out.rank, out.op)) or 0.0) >= 1.0):
                counted.append((out, fmt))
            continue
        if not ins:
            continue
        acc = max(ins, key=lambda r: max(abs(r.ref_max), abs(r.ref_min)))  # the count: the larger operand
        vals = (out.min, out.max, out.ref_min, out.ref_max, acc.min, acc.max, acc.ref_min,
                acc.ref_max)
        if not all(_finite(v) and float(v).is_integer() for v in vals):
            continue
        step = out.ref_max - acc.ref_max
        # the run's count did not move where the reference's did, at a magnitude past the integer limit
        if step and (out.min, out.max) == (acc.min, acc.max) and \
                max(abs(acc.max), abs(acc.min)) >= fmt.integer_limit:
            lost.append((out, acc, step, fmt))
    if counted and (not lost or counted[0][0].seq < lost[0][0].seq):
        out, fmt = counted[0]
        reach, got = max(abs(out.ref_max), abs(out.ref_min)), max(abs(out.max), abs(out.min))
        err = off.get((out.step, out.rank, out.op))
        msg = (f"`{out.op}` counts to {reach:,.0f}"
               + (f" (in {fmt.name} it ends at {got:,.0f})" if got != reach else "")
               + f": integers above {fmt.integer_limit} are not all representable in {fmt.name} (from "
               f"{fmt.integer_limit:,} on only multiples of {fmt.spacing_at(fmt.integer_limit):g} exist), so the "
               "counts past it are rounded" + (f" (by up to {err:g})" if err else "")
               + ". Count in fp32 or an integer dtype (torch.long)")
        # no format switch helps: past fp16's limit, bf16's (256) is passed too; the fix is in the user's code
        return [Diagnosis("", run.run_id, out.op, "integer-limit", msg, (), "warn", out.seq)]
    if not lost:
        return []
    out, acc, step, fmt = lost[0]
    last = lost[-1][0]
    at, limit = max(abs(acc.max), abs(acc.min)), fmt.integer_limit
    reach = max(abs(last.ref_max), abs(last.ref_min))
    stuck = max(abs(last.max), abs(last.min))
    msg = (f"`{out.op}` adds {step:+g} to a count at {at:,.0f} in {fmt.name}: integers above {limit} are not "
           f"representable in {fmt.name}: {step:+g} is lost (from {limit:,} on only multiples of "
           f"{fmt.spacing_at(at):g} exist, so {at:,.0f} {step:+g} rounds back to {at:,.0f}). {len(lost)} add(s) are "
           f"lost this way: the count stays at {stuck:,.0f} where the fp32 run reaches {reach:,.0f} "
           f"({abs(reach - stuck) / reach:.1%} off). Count in fp32 or an integer dtype (torch.long)")
    m = ctx.module_of(out.op)
    island = f"keep-fp32:{m}" if m and ctx.modules.get(m, {}).get("island_changes") is True else None
    if island:
        msg += f", or keep `{m}` in fp32 (its dtype comes from its own parameters)"
    fixes = _reachable([island, "use-bf16" if fmt.name == "fp16" else None], integers_to=reach)
    return [Diagnosis("", run.run_id, out.op, "integer-limit", msg, tuple(fixes), "warn", out.seq)]


# gradients written by a backward op: a gradient flushed to zero there never reaches the optimizer
_WRITTEN_GRADS = ("grad_input", "param_grad")


def _gradient_underflow(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    """``gradient-underflow``: gradients that are zero in the run where the reference's are not (flushed to
    zero: below half the format's smallest subnormal), at least ``FLUSH_ERROR`` of a tensor; names the first
    backward op that writes them and the parameter gradients that are lost."""
    paired = getattr(ctx.facts, "paired_values", None)
    if run.kind == "reference" or paired is None:
        return []
    hit = []
    for r in paired(run.run_id, _WRITTEN_GRADS):
        n, fmt = int(r.numel or 0), format_for_dtype(r.dtype)
        k = flushed_by_underflow(r.ref_zero_count, r.zero_count, r.ref_min_abs_nonzero, fmt) if fmt else 0
        if n and k / n >= FLUSH_ERROR:
            hit.append((r, k, n))
    if not hit:
        return []
    r, k, n = hit[0]
    fmt = format_for_dtype(r.dtype) or FORMATS["fp32"]
    smallest = min((x.ref_min_abs_nonzero for x, _, _ in hit if _finite(x.ref_min_abs_nonzero)), default=None)
    largest = max((x.ref_absmax for x, _, _ in hit if _finite(x.ref_absmax)), default=None)
    params = [(x, kk, nn) for x, kk, nn in hit if x.role == "param_grad"]
    msg = (f"`{r.op}` (step {r.step}) writes a gradient ({r.role} {r.index}) whose values are 0 in "
           f"{fmt.name} where the fp32 run's are not: {k:,} of {n:,} ({k / n:.0%}) flushed to zero")
    if largest is not None:
        msg += (f" (the fp32 gradients reach only {largest:.2g}; {fmt.name} rounds every magnitude below "
                f"{fmt.underflow_threshold:.2g} to 0)")
    if params:
        x, kk, nn = max(params, key=lambda p: p[1])
        msg += (f". {len(params)} parameter gradient(s) lose values this way, e.g. `{x.op}` {x.index}: "
                f"{kk:,} of {nn:,}, so the optimizer does not update them")
    if largest:
        need = 2.0 ** math.ceil(math.log2(fmt.smallest_normal / (smallest or largest)))
        msg += (f". Scale the loss before backward (torch.amp.GradScaler, or a constant scale of at least "
                f"{need:.3g} = 2^{math.log2(need):.0f}) and unscale the gradients before the optimizer step")
        if largest * need > fmt.max:
            msg += (f"; no one scale fits: it lifts the largest gradient {largest:.2g} past {fmt.name}'s max "
                    f"{fmt_num(fmt.max)}, so compute the gradients in a wider format")
    scaled = []
    if largest and largest * need <= fmt.max:  # one scale lifts the smallest without overflowing the largest
        scaled = [f"loss-scale:{need:.0f}", "dynamic-loss-scale"]
    fixes = _reachable(scaled + ["use-bf16" if fmt.name == "fp16" else None], smallest=smallest)
    return [Diagnosis("", run.run_id, r.op, "gradient-underflow", msg, tuple(fixes), "warn", r.seq)]


def _zero_gradients(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    """``gradient-underflow`` without a reference: a parameter gradient that is 0 in every element while the
    gradient arriving at its backward op was not, and arrived below the format's smallest normal (so every
    product with it lands in the subnormal range or under it): the optimizer never updates that parameter.  A
    gradient that is zero because nothing arrived (an unused parameter, a dead ReLU) is no finding."""
    zero = getattr(ctx.facts, "zero_gradients", None)
    if zero is None or run.kind == "reference" or getattr(ctx.facts, "paired_values", None) and \
            ctx.facts.paired_values(run.run_id, ("param_grad",)):
        return []  # compared with a reference: the paired rule counts the values flushed to zero exactly
    hit = []
    for g in zero(run.run_id):
        fmt = format_for_dtype(g.dtype)
        if fmt is None or fmt.kind != "float" or not _finite(g.arriving_absmax) or not g.arriving_absmax:
            continue
        if g.arriving_absmax < fmt.smallest_normal:
            hit.append((g, fmt))
    if not hit:
        return []
    g, fmt = hit[0]
    need = 2.0 ** math.ceil(math.log2(fmt.smallest_normal / g.arriving_absmax))
    msg = (f"`{g.op}` (step {g.step}) writes a parameter gradient ({g.index}) that is 0 in all {g.numel:,} values "
           f"in {fmt.name}, while the gradient arriving there reached only {g.arriving_absmax:.2g}, below "
           f"{fmt.name}'s smallest normal {fmt.smallest_normal:.3g}: its products with the inputs round to 0 "
           f"(every magnitude below {fmt.underflow_threshold:.2g}), so the optimizer never updates this "
           f"parameter" + (f" ({len(hit)} parameter gradients like it)" if len(hit) > 1 else "")
           + f". Scale the loss before backward and unscale the gradients before the optimizer step: by at least "
           f"{need:.3g} to bring the arriving gradient to normal numbers, more where the inputs are small "
           "(torch.amp.GradScaler finds the largest scale that stays finite)")
    fixes = _reachable(["dynamic-loss-scale", "use-bf16" if fmt.name == "fp16" else None],
                       smallest=g.arriving_smallest)
    return [Diagnosis("", run.run_id, g.op, "gradient-underflow", msg, tuple(fixes), "warn", g.seq)]


def _optimizer_state(ctx: Context, run: RunInfo, fn: Origin) -> list[Diagnosis]:
    """``optimizer-nonfinite``: a backward op's NaN/inf gradient reached the optimizer, whose step made the
    weights non-finite (Adam: exp_avg_sq = g^2 = inf, the update inf / inf = NaN)."""
    after = getattr(ctx.facts, "first_nonfinite_state_after", None)
    if after is None or fn.direction is not Direction.BACKWARD:
        return []
    st = after(run.run_id, fn.step)
    if st is None:
        return []
    rec = next((r for r in ctx.facts.op_records(run.run_id, fn.op, fn.step, fn.rank) if r.rid == fn.rid), None)
    inf, nan = (0, 0) if rec is None else (rec.stats.inf_count or 0, rec.stats.nan_count or 0)
    what = "+/-inf" if inf and not nan else "NaN/inf"
    msg = (f"`{fn.op}` (step {fn.step}) writes {what} into a gradient ({fn.role} {fn.index}) and the optimizer "
           f"step takes it: with Adam, exp_avg_sq = g^2 = inf, so the update exp_avg / (sqrt(exp_avg_sq) + eps) = "
           f"inf / inf = NaN, and the weights are non-finite from step {st.step} on (`{st.op}` {st.index}, "
           f"{st.count} parameter record(s) that step). Skip a step whose gradients are not finite "
           "(torch.amp.GradScaler's scaler.step does, and lowers the loss scale; by hand: check "
           "torch.isfinite of the gradient norm before optimizer.step()); clipping alone does not help once a "
           "gradient is inf (its norm is inf and the clipped gradient NaN)")
    return [Diagnosis("", run.run_id, fn.op, "optimizer-nonfinite", msg, ("skip-nonfinite-step", "dynamic-loss-scale"),
                      "error", fn.seq)]


def _fix_verified(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    if run.kind != "rerun" or not run.fix:
        return []
    last = ctx.facts.last_accumulated_output(run.run_id)
    parent = next((r for r in ctx.runs if r.run_id == run.parent_run_id), None)
    msg = f"re-run with `{run.fix}`" + (f" (from run {parent.name})" if parent else "")
    msg += ": no NaN or inf anywhere in the run"
    if last and _finite(last.sqnr_db):
        msg += f"; final output SQNR {last.sqnr_db:.1f} dB against the fp32 reference"
    return [Diagnosis("", run.run_id, last.op if last else "", "fix-verified", msg, (), "info",
                      last.seq if last else -1)]


def _compiled(ctx: Context, run: RunInfo) -> list[Diagnosis]:
    """A run compiled with torch.compile without emulated precision casts: its fused kernels keep intermediates
    in fp32 where eager code rounds, so part of its difference from any eager run is the compiler's."""
    policy = ctx.policies.get(run.run_id)
    if getattr(policy, "compile", None) is None or policy.emulate_precision_casts:
        return []
    last = ctx.facts.last_accumulated_output(run.run_id)
    fmt = format_for_dtype(run.dtype)
    msg = (f"run compiled with torch.compile ({'the whole model' if policy.compile == 'model' else policy.compile}): "
           f"fused kernels keep intermediates in fp32 where eager code rounds each op's result to "
           f"{fmt.name if fmt else 'its format'}, so its numbers differ from an eager run in the same format; to "
           "tell what compilation changes from what the format does, re-run it rounding as eager code does "
           "(emulate-precision-casts) or without compiling (eager)")
    return [Diagnosis("", run.run_id, last.op if last else "", "compiled", msg,
                      ("emulate-precision-casts", "eager"), "info", last.seq if last else -1)]


# ---- one run ------------------------------------------------------------------------

def diagnose_run(ctx: Context, run: RunInfo, first_nonfinite: Optional[Origin]) -> list[Diagnosis]:
    """The findings for one candidate or re-run, given its first non-finite producer (or None)."""
    policy = ctx.policies.get(run.run_id)
    if first_nonfinite is None:
        return (_fix_verified(ctx, run) + _quantisation(ctx, run) + _integer_limit(ctx, run) + _amplified(ctx, run)
                + (_gradient_underflow(ctx, run) or _zero_gradients(ctx, run)) + _precision_loss(ctx, run)
                + _compiled(ctx, run))
    found = _producer_diagnosis(ctx, run, first_nonfinite, policy)
    if found and first_nonfinite.producer:
        found += _amplified(ctx, run, before=first_nonfinite)
    nan = first_nonfinite.first_nan
    if found and nan:
        d = found[0]
        found = [Diagnosis(d.session_id, d.run_id, d.op, d.rule,
                           d.message.rstrip(".") + f". That value is inf; the first NaN appears later, at `{nan.op}` "
                           f"({nan.op_type}), which combines it (inf - inf, 0 x inf or inf / inf)",
                           d.fixes, d.severity, d.seq)] + found[1:]
    if found and ctx.facts.last_forward_output_finite(run.run_id):
        d = found[0]
        found = [Diagnosis(d.session_id, d.run_id, d.op, d.rule,
                           d.message + f" The non-finite values stop before the run's output, which is finite "
                           f"(run fix: {run.fix or 'none'}).", d.fixes, "warn", d.seq)] + found[1:]
    return found + _compiled(ctx, run)


def _producer_diagnosis(ctx: Context, run: RunInfo, fn: Origin, policy) -> list[Diagnosis]:
    recs = ctx.facts.op_records(run.run_id, fn.op, fn.step, fn.rank)
    module = ctx.module_of(fn.op)
    mrecs = recs
    if module:
        mrecs = ctx.module_call(run.run_id, module, fn.step, fn.rank, fn.seq) or recs
    out_rec = next((r for r in recs if r.rid == fn.rid), recs[0] if recs else None)
    fmt = format_for_dtype(out_rec and out_rec.dtype) or format_for_dtype(run.dtype) or FORMATS["fp32"]
    if fmt.kind != "float" or fmt.bits <= 8:
        fmt = format_for_dtype(run.dtype) or FORMATS["fp32"]
    ev = Evidence(run, fn, fn.op, fn.op_type or "", module, ctx.modules.get(module or "", {}),
                  recs, mrecs, fmt, policy)
    for name, rule in RULES.items():
        d = rule(ctx, ev)
        if d is not None:
            stake = _at_stake(ctx, ev)
            if stake is not None:
                dropped = [why for why in (unreachable(f, absmax=stake) for f in d.fixes) if why]
                msg = d.message + ("" if not dropped else f" (not offered: {'; '.join(dropped)})")
                d = Diagnosis(d.session_id, d.run_id, d.op, d.rule, msg, tuple(_reachable(d.fixes, absmax=stake)),
                              d.severity, d.seq)
            return [d] + _optimizer_state(ctx, run, fn)
    return []


def module_facts(model) -> dict[str, dict]:
    """Module path -> {class, leaf, eps, flush_to_zero, two_pass, stats_fp32, stable, island_changes,
    island_note} of a built model: ``island_changes`` is whether an fp32 island there changes anything
    (``policy.island_effect``: the island or its tied partners hold a floating parameter or buffer), and
    ``island_note`` names the tied modules that move with it."""
    facts = {}
    names = [n for n, _ in model.named_modules() if n]
    try:
        effects = island_effects(model, names)
    except PolicyError:
        effects = {}
    for name, mod in model.named_modules():
        d = {"class": type(mod).__name__, "leaf": not any(True for _ in mod.children())}
        eff = effects.get(name)
        if eff is not None:
            d["island_changes"], d["island_note"] = bool(eff.tensors), eff.note
        for attr in ("eps", "flush_to_zero", "two_pass", "stats_fp32", "stable"):
            if hasattr(mod, attr):
                d[attr] = getattr(mod, attr)
        facts[name] = d
    return facts

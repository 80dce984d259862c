"""The built-in op rules: for a run with non-finite values, what its first non-finite producer did.

Tried in this order; the first that recognises the failure writes the diagnosis (``rulebook`` says how a rule is
registered):

``parameter-nonfinite``     a parameter is NaN/inf before any op reads it
                            (its fp32 value is beyond the format's max)
``nonfinite-input``         the run's inputs are already non-finite
``nonfinite-in-reference``  the fp32 reference produces it too (not a
                            precision problem; calibration downstream fails)
``fp8-scale``               a fake-quant scale is 0 or subnormal in its format
                            and its reciprocal is inf: 0 x inf = NaN
``softmax-overflow``        exp() of logits above ln(max) overflows
``norm-statistics``         x^2 overflow, cancelling one-pass variance, an
                            epsilon lost to flush-to-zero
``division``                x / 0, 1 / (a value below 1/max), rsqrt(0),
                            sqrt/log of a negative, from the divisor's record
``mask-overflow``           a mask value beyond the format's range becomes -inf
``overflow``                an output larger than the format's max
``product-overflow``        x * y or x^2 past the max, from the inputs' records
``nonfinite-producer``      anything else, with the numbers that are known
"""

from __future__ import annotations

import math
from typing import Optional

from ..enums import OriginKind
from ..formats import FORMATS, Format, format_for_dtype
from ..ops import canonical
from ..records import Diagnosis, StoredRecord
from .rulebook import (Context, Evidence, at_stake, eps_normal, finding, finite, fmt_num, keep_fp32, ref_records,
                       register_rule, representable_floor)

__all__: list[str] = []


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
    return finding(ev, "parameter-nonfinite", msg, fixes, "error")


@register_rule("nonfinite-input")
def _rule_input(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if ev.producer.origin is not OriginKind.INPUT:
        return None
    msg = (f"`{ev.op}` already receives non-finite values in its {ev.producer.role} {ev.producer.index}: "
           "no recorded op produced them (they come from the model's inputs or from before the first recorded op)")
    return finding(ev, "nonfinite-input", msg, [], "error")


@register_rule("nonfinite-in-reference",
               needs=("reference_of", "first_nonfinite_output_of_type", "warning_starting"))
def _rule_reference(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if ctx.ref_run is None or ev.run.run_id == ctx.ref_run.run_id:
        return None
    recs = ev.module_records or ev.records
    refs = ref_records(ctx, ev, ev.outputs(recs))
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
    return finding(ev, "nonfinite-in-reference", msg, fixes)


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


@register_rule("fp8-scale", needs=("module_call",))
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
    if finite(smallest) and smallest > 0 and smallest < sfmt.smallest_normal:
        recip = 1.0 / smallest
        s = (f"scale {fmt_num(smallest)} is subnormal in {sfmt.name} (smallest normal "
             f"{fmt_num(sfmt.smallest_normal)})")
        if recip > sfmt.max:
            s += f"; its reciprocal {recip:.2g} exceeds {sfmt.name} max {fmt_num(sfmt.max)} -> inf"
            s += f"; 0 x inf = NaN at `{inv_op}`" if not parts else ""
        parts.append(s)
    elif finite(smallest) and smallest > 0 and 1.0 / smallest > sfmt.max:
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
    return finding(ev, "fp8-scale", msg, fixes)


def _is_softmax(ev: Evidence) -> bool:
    # exp() of the logits overflows first when softmax is written out by hand
    return canonical(ev.module_facts.get("class")) == "softmax" or canonical(ev.op_type) in ("softmax", "exp")


@register_rule("softmax-overflow")
def _rule_softmax(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    if not _is_softmax(ev):
        return None
    recs = ev.module_records or ev.records
    ins = [r for r in ev.inputs(recs) if finite(r.stats.max)]
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
    return finding(ev, "softmax-overflow", msg, ["stable-softmax", keep_fp32(ev),
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
    held = [r for r in ins if r.role == "input" and finite(r.magnitude)]
    widest = max(held, key=lambda r: r.magnitude, default=None)
    x = widest.magnitude if widest is not None else None
    if x is not None and x > f.max:
        # the input arrives in a wider format (an fp32 island before it) and is past the format's range: the
        # first failure is its cast into the format, not a square computed in it
        held_in = format_for_dtype(widest.dtype) if widest.dtype else None
        return finding(ev, "norm-statistics",
                     f"`{ev.where}` in {f.name}: input absmax {fmt_num(x)}"
                     + (f" arrives in {held_in.name} and" if held_in is not None and held_in.name != f.name else "")
                     + f" exceeds {f.name} max {fmt_num(f.max)}, so casting it to {f.name} gives inf before the "
                       "normalisation computes anything",
                     [keep_fp32(ev), "use-bf16" if f.name == "fp16" else None])
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
        fixes.append(f"eps:{eps_normal(f):g}")
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
    fixes = ["stats-fp32", combo or None, keep_fp32(ev)]
    return finding(ev, "norm-statistics", f"`{ev.where}` in {f.name}: " + "; ".join(parts), fixes)


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
    if finite(v) and v > 0:
        return float(v)
    mn, mx = r.stats.min, r.stats.max
    if finite(mn) and finite(mx) and (mn > 0 or mx < 0):  # one sign: the extreme nearest 0 bounds it
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
    negative = finite(den.stats.min) and den.stats.min < 0 and op in ("rsqrt", "sqrt", "log")
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
                f"{fmt_num(f.smallest_normal)} flush-to-zero removes them; use eps >= {eps_normal(f):g}")
    elif op in ("reciprocal", "div"):
        msg += (f". Floor the divisor at a value {f.name} holds (clamp(min=...) >= {eps_normal(f):g}; for a "
                "quantisation scale, floor amax), or compute it in fp32")
    fixes = [f"eps:{eps_normal(f):g}" if ev.module_facts.get("eps") is not None else None,
             "scale-fp32" if f.name != "fp32" and getattr(ev.policy, "quant", None) is not None else None,
             keep_fp32(ev)]
    return finding(ev, "division", msg, fixes)


@register_rule("mask-overflow", needs=("reference_of",))
def _rule_mask_overflow(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    """A mask value beyond the format's range (``finfo(float32).min`` in fp16): finite in the reference, ``-inf``
    here, and a row masked throughout is all ``-inf``, which a softmax turns into NaN."""
    outs = [r for r in ev.outputs(ev.records) if r.stats.negative_inf_only]
    refs = ref_records(ctx, ev, outs)
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
    return finding(ev, "mask-overflow", msg, [f"sanitize-nonfinite:{ev.module}" if ev.module else None,
                                            "use-bf16" if f.name == "fp16" else None])


@register_rule("overflow", needs=("reference_of", "ops_above"))
def _rule_overflow(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    recs = ev.module_records or ev.records
    outs = ev.outputs(recs)
    refs = ref_records(ctx, ev, outs)
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
        fixes.append(keep_fp32(ev))
    return finding(ev, "overflow", msg, fixes)


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
    if len(mags) != 2 or not all(finite(m) for m in mags) or mags[0] * mags[1] <= ev.fmt.max:
        return None
    f = ev.fmt
    prod = mags[0] * mags[1]
    if square:
        msg = (f"`{ev.where}` squares values up to {fmt_num(mags[0])}: x^2 = {fmt_num(prod)} > {f.name} max "
               f"{fmt_num(f.max)} (|x| above sqrt(max) = {math.sqrt(f.max):.4g} overflows), as in a sum of squares "
               "or a one-pass variance. Compute the statistics in fp32, or scale x down first")
        fixes = ["stats-fp32" if ev.module_facts else None, keep_fp32(ev),
                 "use-bf16" if f.name == "fp16" else None]
    else:
        msg = (f"`{ev.where}` multiplies values up to {fmt_num(mags[0])} and {fmt_num(mags[1])}: the product reaches "
               f"{fmt_num(prod)} > {f.name} max {fmt_num(f.max)}")
        fixes = ["use-bf16" if f.name == "fp16" else None, keep_fp32(ev)]
    return finding(ev, "product-overflow", msg, fixes)


@register_rule("nonfinite-producer")
def _rule_fallback(ctx: Context, ev: Evidence) -> Optional[Diagnosis]:
    recs = ev.records
    ins = [r for r in ev.inputs(recs)]
    outs = ev.outputs(recs)
    x = max((r.magnitude for r in ins if finite(r.magnitude)), default=None)
    nan = sum(r.stats.nan_count or 0 for r in outs)
    inf = sum(r.stats.inf_count or 0 for r in outs)
    what = " and ".join(s for s in (f"{nan:,} NaN" if nan else "", f"{inf:,} inf" if inf else "") if s)
    msg = (f"`{ev.op}` ({ev.op_type}) turns finite inputs" + (f" (absmax {fmt_num(x)})" if x is not None else "")
           + f" into {what or 'non-finite values'} in {ev.fmt.name} (max {fmt_num(ev.fmt.max)})")
    return finding(ev, "nonfinite-producer", msg,
                 ["use-bf16" if ev.fmt.name == "fp16" else None, keep_fp32(ev)])

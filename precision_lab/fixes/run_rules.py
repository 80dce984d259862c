"""The built-in run rules: what a whole run shows, beside (or instead of) its first non-finite value.

Runs without non-finite values get ``precision-loss`` (an op whose local error is far above its format's
rounding), ``error-amplified`` (an op that multiplies the relative error it receives: cancellation) or
``absorption`` (an earlier add that rounded its smaller operand away), ``integer-limit`` (an add whose count
passed the format's contiguous-integer limit, fp16 2048, bf16 256, so its +1 is lost), ``gradient-underflow``
(gradients zero where the fp32 run's are not: loss scaling) and ``fp8-quantisation``; re-runs get
``fix-verified`` when the fix removed every non-finite value.  A run whose non-finite value is a backward op's
gradient that the optimizer then turned into NaN weights also gets ``optimizer-nonfinite`` (Adam: inf / inf),
and a compiled run ``compiled``.  Their order here is the order of their findings.
"""

from __future__ import annotations

import math
from typing import Optional

from ..enums import Direction
from ..formats import FORMATS, Format, format_for_dtype
from ..metrics import VERDICT_THRESHOLDS
from ..ops import aliases_of, canonical, module_path, module_prefixes
from ..origin import Origin
from ..quantisation import FLUSH_ERROR, QUANT_FIXES, flushed_by_underflow, quant_facts
from ..records import Diagnosis, RunInfo
from .facts import ErrorGrowth, QuantiseCall
from .rulebook import EXPLAINED, FINITE, UNEXPLAINED, Context, finite, fmt_num, reachable, register_rule

__all__ = ["AMPLIFY_MIN", "COUNTING_OPS", "RUNNING_COUNTS", "quantise_findings"]


@register_rule("fix-verified", kind="run", needs=("last_accumulated_output",), names_op=False)
def _fix_verified(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
    if run.kind != "rerun" or not run.fix:
        return []
    last = ctx.facts.last_accumulated_output(run.run_id)
    parent = next((r for r in ctx.runs if r.run_id == run.parent_run_id), None)
    msg = f"re-run with `{run.fix}`" + (f" (from run {parent.name})" if parent else "")
    msg += ": no NaN or inf anywhere in the run"
    if last and finite(last.sqnr_db):
        msg += f"; final output SQNR {last.sqnr_db:.1f} dB against the fp32 reference"
    return [Diagnosis("", run.run_id, last.op if last else "", "fix-verified", msg, (), "info",
                      last.seq if last else -1)]


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


@register_rule("fp8-quantisation", kind="run", needs=("quantise_calls",))
def _quantisation(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
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


@register_rule("integer-limit", kind="run", needs=("paired_values",))
def _integer_limit(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
    """``integer-limit``: an add whose operands are integers past its format's ``integer_limit`` (fp16 2048,
    bf16 256) leaves the count where it was in the run while the reference's moves on: the increment is below
    half the format's spacing there and rounds away (a token counter stuck at 2048).  Names the first such op
    call and counts the others."""
    if run.kind == "reference":
        return []
    calls: dict[tuple, list] = {}
    kinds = tuple(t for k in COUNTING_OPS + RUNNING_COUNTS for t in (k,) + aliases_of(k))
    for r in ctx.facts.paired_values(run.run_id, ("input", "output"), kinds):
        calls.setdefault((r.step, r.rank, r.op), []).append(r)
    growth = getattr(ctx.facts, "error_growth", None)
    # a running count's largest error against the reference: whole integers it could not hold
    off = {(g.step, g.rank, g.op): g.out_abs_err for g in (growth(run.run_id) if growth else ())
           if canonical(g.op_type or "") in RUNNING_COUNTS}
    lost, counted = _counts_past_the_limit(calls.values(), off)
    if counted and (not lost or counted[0][0].seq < lost[0][0].seq):
        out, fmt = counted[0]
        return [_running_count_rounded(run, out, fmt, off.get((out.step, out.rank, out.op)))]
    if not lost:
        return []
    return [_increments_lost(ctx, run, lost)]


def _counts_past_the_limit(calls, off: dict) -> tuple[list, list]:
    """``(lost, counted)`` among the paired records of each counting op call: ``(output, count, increment,
    format)`` of each add whose increment was lost, ``(output, format)`` of each running count that ended off."""
    lost, counted = [], []
    for rs in calls:
        out = next((r for r in rs if r.role == "output"), None)
        ins = [r for r in rs if r.role == "input" and finite(r.ref_max) and finite(r.ref_min)]
        fmt = format_for_dtype(out.dtype) if out else None
        if fmt is None or fmt.kind != "float" or fmt.bits >= 32:
            continue
        if canonical(out.op_type or "") in RUNNING_COUNTS:
            vals = (out.min, out.max, out.ref_min, out.ref_max)
            # a running count of integers that passes the limit in the reference and ends elsewhere in the run
            if all(finite(v) and float(v).is_integer() for v in vals) and \
                    max(abs(out.ref_max), abs(out.ref_min)) > fmt.integer_limit and \
                    (out.max != out.ref_max or (off.get((out.step, out.rank, out.op)) or 0.0) >= 1.0):
                counted.append((out, fmt))
            continue
        if not ins:
            continue
        acc = max(ins, key=lambda r: max(abs(r.ref_max), abs(r.ref_min)))  # the count: the larger operand
        vals = (out.min, out.max, out.ref_min, out.ref_max, acc.min, acc.max, acc.ref_min,
                acc.ref_max)
        if not all(finite(v) and float(v).is_integer() for v in vals):
            continue
        step = out.ref_max - acc.ref_max
        # the run's count did not move where the reference's did, at a magnitude past the integer limit
        if step and (out.min, out.max) == (acc.min, acc.max) and \
                max(abs(acc.max), abs(acc.min)) >= fmt.integer_limit:
            lost.append((out, acc, step, fmt))
    return lost, counted


def _running_count_rounded(run: RunInfo, out, fmt: Format, err: Optional[float]) -> Diagnosis:
    reach, got = max(abs(out.ref_max), abs(out.ref_min)), max(abs(out.max), abs(out.min))
    msg = (f"`{out.op}` counts to {reach:,.0f}"
           + (f" (in {fmt.name} it ends at {got:,.0f})" if got != reach else "")
           + f": integers above {fmt.integer_limit} are not all representable in {fmt.name} (from "
           f"{fmt.integer_limit:,} on only multiples of {fmt.spacing_at(fmt.integer_limit):g} exist), so the "
           "counts past it are rounded" + (f" (by up to {err:g})" if err else "")
           + ". Count in fp32 or an integer dtype (torch.long)")
    # no format switch helps: past fp16's limit, bf16's (256) is passed too; the fix is in the user's code
    return Diagnosis("", run.run_id, out.op, "integer-limit", msg, (), "warn", out.seq)


def _increments_lost(ctx: Context, run: RunInfo, lost: list) -> Diagnosis:
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
    fixes = reachable([island, "use-bf16" if fmt.name == "fp16" else None], integers_to=reach)
    return Diagnosis("", run.run_id, out.op, "integer-limit", msg, tuple(fixes), "warn", out.seq)


@register_rule("optimizer-nonfinite", kind="run", needs=("first_nonfinite_state_after", "op_records"),
               when=(EXPLAINED,))
def _optimizer_state(ctx: Context, run: RunInfo, fn: Origin) -> list[Diagnosis]:
    """``optimizer-nonfinite``: a backward op's NaN/inf gradient reached the optimizer, whose step made the
    weights non-finite (Adam: exp_avg_sq = g^2 = inf, the update inf / inf = NaN)."""
    if fn.direction is not Direction.BACKWARD:
        return []
    st = ctx.facts.first_nonfinite_state_after(run.run_id, fn.step)
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


AMPLIFY_MIN = 16.0  # how many times an op must multiply the relative error it receives to be named for it


@register_rule("error-amplified", kind="run", needs=("error_growth",), when=(FINITE, EXPLAINED))
def _amplified(ctx: Context, run: RunInfo, before: Optional[Origin]) -> list[Diagnosis]:
    """``error-amplified``: the first op whose inputs arrive within rounding (``VERDICT_THRESHOLDS['expected']``
    unit roundoffs) and whose output leaves beyond ``warn``, multiplying the relative error it received at
    least ``AMPLIFY_MIN`` times: cancellation (x - mean, E[x^2] - E[x]^2) turns rounding into lost bits
    without any local error of its own."""
    if run.kind == "reference" or (before is not None and not before.producer):
        return []
    rows = ctx.facts.error_growth(run.run_id)
    if before is not None:  # what went wrong before the first non-finite value (a variance cancelled below 0)
        rows = [g for g in rows if (g.step, g.seq) < (before.step, before.seq)]
    for i, g in enumerate(rows):
        out_u, in_u = g.out_units, g.in_units
        if not (finite(out_u) and finite(in_u)) or out_u <= VERDICT_THRESHOLDS["warn"] \
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
        if not all(finite(v) and v > 0 for v in (err, small, big, shown, received)) or big <= small:
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


# gradients written by a backward op: a gradient flushed to zero there never reaches the optimizer
_WRITTEN_GRADS = ("grad_input", "param_grad")


@register_rule("gradient-underflow", kind="run", needs=("paired_values",))
def _gradient_underflow(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
    """``gradient-underflow``: gradients that are zero in the run where the reference's are not (flushed to
    zero: below half the format's smallest subnormal), at least ``FLUSH_ERROR`` of a tensor; names the first
    backward op that writes them and the parameter gradients that are lost."""
    if run.kind == "reference":
        return []
    hit = []
    for r in ctx.facts.paired_values(run.run_id, _WRITTEN_GRADS):
        n, fmt = int(r.numel or 0), format_for_dtype(r.dtype)
        k = flushed_by_underflow(r.ref_zero_count, r.zero_count, r.ref_min_abs_nonzero, fmt) if fmt else 0
        if n and k / n >= FLUSH_ERROR:
            hit.append((r, k, n))
    if not hit:
        return []
    r, k, n = hit[0]
    fmt = format_for_dtype(r.dtype) or FORMATS["fp32"]
    smallest = min((x.ref_min_abs_nonzero for x, _, _ in hit if finite(x.ref_min_abs_nonzero)), default=None)
    largest = max((x.ref_absmax for x, _, _ in hit if finite(x.ref_absmax)), default=None)
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
    fixes = reachable(scaled + ["use-bf16" if fmt.name == "fp16" else None], smallest=smallest)
    return [Diagnosis("", run.run_id, r.op, "gradient-underflow", msg, tuple(fixes), "warn", r.seq)]


@register_rule("gradient-underflow-unpaired", kind="run", needs=("zero_gradients",), unless=("gradient-underflow",))
def _zero_gradients(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
    """``gradient-underflow`` without a reference: a parameter gradient that is 0 in every element while the
    gradient arriving at its backward op was not, and arrived below the format's smallest normal (so every
    product with it lands in the subnormal range or under it): the optimizer never updates that parameter.  A
    gradient that is zero because nothing arrived (an unused parameter, a dead ReLU) is no finding."""
    if run.kind == "reference" or getattr(ctx.facts, "paired_values", None) and \
            ctx.facts.paired_values(run.run_id, ("param_grad",)):
        return []  # compared with a reference: the paired rule counts the values flushed to zero exactly
    hit = []
    for g in ctx.facts.zero_gradients(run.run_id):
        fmt = format_for_dtype(g.dtype)
        if fmt is None or fmt.kind != "float" or not finite(g.arriving_absmax) or not g.arriving_absmax:
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
    fixes = reachable(["dynamic-loss-scale", "use-bf16" if fmt.name == "fp16" else None],
                       smallest=g.arriving_smallest)
    return [Diagnosis("", run.run_id, g.op, "gradient-underflow", msg, tuple(fixes), "warn", g.seq)]


@register_rule("precision-loss", kind="run", needs=("worst_local_errors",))
def _precision_loss(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
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


@register_rule("compiled", kind="run", needs=("last_accumulated_output",), names_op=False,
               when=(FINITE, EXPLAINED, UNEXPLAINED))
def _compiled(ctx: Context, run: RunInfo, origin: Optional[Origin]) -> list[Diagnosis]:
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

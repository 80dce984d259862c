"""Diagnosis: explain what went wrong in a run in number-format terms, and rank fixes.

The rules read facts about recorded runs through a ``RunFacts`` they are
given (the service ``services.diagnose`` answers it from the store) and
return ``Diagnosis`` records; they never touch a database.  Every rule is
registered in one registry (``rulebook.RULES``, through ``register_rule``),
which says for each its kind, the facts it needs and its rank:

- op rules (``op_rules``) look at a run's first non-finite producer and the
  op or module around it, and are tried in order; the first that recognises
  the failure writes the diagnosis;
- run rules (``run_rules``) read the whole run: the findings of runs without
  non-finite values (precision loss, amplified error, integer limits,
  gradient underflow, fp8 quantisation, a verified fix), and those that go
  beside a non-finite value (the optimizer step that spread it).

Every threshold is read from ``FORMATS``; every number in a message comes
from the stored stats.  A fix whose target format cannot hold the values at
stake (``catalogue.unreachable``: ``use-bf16`` for ``finfo(float32).min``)
is never offered.

Sessions made from recipes carry the recipe name and the run's policy, so
the rules also know module classes, epsilons and flush-to-zero, and propose
fixes by module name.  For dump-only sessions they use op types and names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..formats import FORMATS, format_for_dtype
from ..origin import Origin
from ..records import Diagnosis, RunInfo
from . import op_rules, run_rules  # noqa: F401  (the built-in rules register themselves on import)
from .catalogue import unreachable
from .islands import PolicyError, island_effects
from .rulebook import (EXPLAINED, FINITE, RULES, UNEXPLAINED, Context, Evidence, RunFacts, at_stake,
                       evidence_at_stake, fmt_num, reachable, register_rule, representable_floor, rules_of)
from .run_rules import quantise_findings

__all__ = ["Context", "Evidence", "RunFacts", "RULES", "register_rule", "diagnose_run", "ModelFacts", "module_facts",
           "fmt_num", "representable_floor", "quantise_findings", "at_stake"]


def diagnose_run(ctx: Context, run: RunInfo, first_nonfinite: Optional[Origin]) -> list[Diagnosis]:
    """The findings for one candidate or re-run, given its first non-finite producer (or None): the op rule's
    finding first, then the run rules' in rank order."""
    if first_nonfinite is None:
        return _run_findings(ctx, run, None, FINITE)
    found = _producer_diagnosis(ctx, run, first_nonfinite)
    if found is None:
        return _run_findings(ctx, run, first_nonfinite, UNEXPLAINED)
    return [_where_it_goes(ctx, run, first_nonfinite, found)] + _run_findings(ctx, run, first_nonfinite, EXPLAINED)


def _run_findings(ctx: Context, run: RunInfo, origin: Optional[Origin], situation: str) -> list[Diagnosis]:
    """The findings of the run rules that read runs in ``situation`` and whose facts ``ctx.facts`` answers, in
    rank order; a rule is skipped where one it gives way to (``unless``) found something."""
    out: list[Diagnosis] = []
    found_by: set[str] = set()
    for rule in rules_of("run"):
        if situation not in rule.when or not rule.answered(ctx.facts) or found_by.intersection(rule.unless):
            continue
        got = [rule.stamped(d) for d in rule.check(ctx, run, origin)]
        if got:
            found_by.add(rule.name)
        out += got
    return out


def _where_it_goes(ctx: Context, run: RunInfo, fn: Origin, d: Diagnosis) -> Diagnosis:
    """The producer's finding, saying where the first NaN appears when the value is inf, and that the run's
    output is finite where the non-finite values stop before it (then a warning)."""
    nan = fn.first_nan
    if nan:
        d = Diagnosis(d.session_id, d.run_id, d.op, d.rule,
                      d.message.rstrip(".") + f". That value is inf; the first NaN appears later, at `{nan.op}` "
                      f"({nan.op_type}), which combines it (inf - inf, 0 x inf or inf / inf)",
                      d.fixes, d.severity, d.seq)
    if ctx.facts.last_forward_output_finite(run.run_id):
        d = Diagnosis(d.session_id, d.run_id, d.op, d.rule,
                      d.message + f" The non-finite values stop before the run's output, which is finite "
                      f"(run fix: {run.fix or 'none'}).", d.fixes, "warn", d.seq)
    return d


def _producer_diagnosis(ctx: Context, run: RunInfo, fn: Origin) -> Optional[Diagnosis]:
    """The finding of the first op rule that recognises the run's first non-finite producer, without the fixes
    whose target format cannot hold the values at stake; None when none does."""
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
                  recs, mrecs, fmt, ctx.policies.get(run.run_id))
    for rule in rules_of("op"):
        d = rule.check(ctx, ev) if rule.answered(ctx.facts) else None
        if d is None:
            continue
        d = rule.stamped(d)
        stake = evidence_at_stake(ctx, ev)
        if stake is not None:
            dropped = [why for why in (unreachable(f, absmax=stake) for f in d.fixes) if why]
            msg = d.message + ("" if not dropped else f" (not offered: {'; '.join(dropped)})")
            d = Diagnosis(d.session_id, d.run_id, d.op, d.rule, msg, tuple(reachable(d.fixes, absmax=stake)),
                          d.severity, d.seq)
        return d
    return None


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a built model's modules say (``module_facts``): ``modules`` maps each module path to its facts."""

    modules: dict  # module path -> {"class", "leaf", "eps", ...}


def module_facts(model) -> ModelFacts:
    """Module path -> {class, leaf, eps, flush_to_zero, two_pass, stats_fp32, stable, island_changes,
    island_note} of a built model (``ModelFacts.modules``): ``island_changes`` is whether an fp32 island there changes anything
    (``policy.island_effect``: the island or its tied partners hold a floating parameter or buffer), and
    ``island_note`` names the tied modules that move with it."""
    facts = {}
    names = [n for n, _ in model.named_modules() if n]
    try:
        effects = island_effects(model, names).by_pattern
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
    return ModelFacts(facts)

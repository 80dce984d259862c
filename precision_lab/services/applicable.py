"""Which fixes of the catalogue apply to a session's model, and why the others do not.

A fix applies when it edits the session's low-precision policy (``apply_fixes`` raises ``FixError`` for one that
cannot: a scale fix on a policy without fp8, emulate-precision-casts on an eager run), the edited policy
prepares the model (``PolicyError`` for a pattern naming no module), and the prepared model differs from the one
the session's own policy prepares (or its loss scale, where the model runs backward): a fix that changes nothing
on this model (``stable-softmax`` where no module computes a softmax the policy can reach) is listed as such,
never offered.  Nor is a fix whose target format cannot hold the values at stake where the first non-finite
value is made (``catalogue.unreachable`` of ``rules.at_stake``: the rule the diagnosis cards apply), e.g.
``use-bf16`` for a mask built from ``finfo(float32).min``.  Pattern fixes are tried on the
innermost module around the first non-finite producer (or the op with the worst local error) on which an fp32
island changes something, and a fix with a choice on each choice in turn.

An fp32 island (``keep-fp32:<module>``) changes the model exactly when ``fixes.policy.island_effect`` says so:
when the modules it reaches, or the modules tied to them (sharing a parameter or buffer), hold a floating
parameter or buffer whose format it changes; the policy casts the inputs only of modules that hold one, so an
island on a module holding none (a pooling, an activation, a counter) computes as before.  The same function
picks the module an island is offered on and predicts "changes nothing" for it; an island that moves tied
modules with it says which.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, is_dataclass
from typing import Optional

from ..fixes.catalogue import FIXES, FixError, apply_fixes, parse_fix, unreachable
from ..fixes.policy import PolicyError, island_effect, island_effects
from ..fixes.rules import at_stake
from ..ops import innermost_module
from ..records import RunInfo
from ..store import queries as q
from .diagnose import StoreFacts
from .origins import first_nonfinite
from .rerun import session_recipe
from .sessions import run_policy

__all__ = ["FixApplicability", "applicable_fixes", "island_targets"]

_SIMPLE = (int, float, bool, str, type(None))


@dataclass(frozen=True, slots=True)
class FixApplicability:
    """A fix of the catalogue tried on a session's model: the spec tried, whether it applies, and what it would do
    or why it does not apply."""

    fix: str
    applies: bool
    reason: str


def _fingerprint(model) -> tuple:
    """What a policy can change in a model: each module's class, public settings, parameter and buffer formats,
    hooks and whether it is compiled."""
    out = []
    for name, m in model.named_modules():
        settings = tuple(sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_")
                                and (isinstance(v, _SIMPLE) or is_dataclass(v))))
        dtypes = (tuple(str(p.dtype) for p in m.parameters(recurse=False))
                  + tuple(str(b.dtype) for b in m.buffers(recurse=False)))
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks))
        out.append((name, type(m).__name__, settings, dtypes, hooks, m._compiled_call_impl is not None))
    return tuple(out)


def _target(store, run: RunInfo, names: list[str]) -> Optional[str]:
    """The module a pattern fix is tried on: the first non-finite producer's, else the worst local error's."""
    fn = first_nonfinite(store, run.run_id)
    ops = ([fn.op] if fn else []) + list(q.ops_by_local_error(store, run.run_id))
    for op in ops:
        m = innermost_module(op, names)
        if m:
            return m
    return None


def island_targets(model, policy) -> list[str]:
    """The module paths on which an fp32 island changes something under ``policy`` (``island_effect``): the
    modules an island fix may be offered on."""
    names = [n for n, _ in model.named_modules() if n]
    effects = island_effects(model, names, policy)
    return [n for n in names if effects.get(n).changes]


def _island_pattern(spec: str) -> Optional[str]:
    """The pattern of a lone ``keep-fp32:<pattern>`` spec, else None."""
    name, _, arg = spec.partition(":")
    return arg if name == "keep-fp32" and arg and "+" not in spec else None


def _stake(store, runs: list[RunInfo], cand: Optional[RunInfo]) -> Optional[float]:
    """The largest finite magnitude the reference holds where the candidate's first non-finite value is made
    (``rules.at_stake``, as its diagnosis card asks): what a fix's target format must hold; None without one."""
    ref = next((r for r in runs if r.kind == "reference"), None)
    fn = first_nonfinite(store, cand.run_id) if cand and ref else None
    if fn is None:
        return None
    facts = StoreFacts(store)  # the typed rows the rules read
    recs = facts.op_records(cand.run_id, fn.op, fn.step, fn.rank)
    return at_stake(facts.reference_of(cand.run_id, recs, ref.run_id).values())


def _try(model, policy, base: tuple, spec: str, *, stake: Optional[float] = None, backward: bool = False,
         trains: bool = False) -> FixApplicability:
    why = unreachable(spec, absmax=stake) if stake is not None else None
    if why:
        return FixApplicability(spec, False, f"cannot help: {why}")
    pattern = _island_pattern(spec)
    effect = None
    if pattern is not None:
        try:
            effect = island_effect(model, pattern, policy)
        except PolicyError as e:
            return FixApplicability(spec, False, str(e))
        if not effect.changes:
            return FixApplicability(spec, False, f"changes nothing in this model under {policy.describe()}: {effect.reason}")
    try:
        fixed = apply_fixes(policy, spec)
        prepared = fixed.prepare(copy.deepcopy(model))
    except (FixError, PolicyError) as e:
        return FixApplicability(spec, False, str(e))
    if fixed.loss_scale != policy.loss_scale and not backward:
        return FixApplicability(spec, False, "scales the loss, but this model runs no backward pass (its recipe has no loss)")
    if fixed.skip_nonfinite_step != policy.skip_nonfinite_step and not trains:
        return FixApplicability(spec, False, "skips optimizer steps, but this model takes none (its recipe has no optimizer)")
    if effect is None and _fingerprint(prepared) == base and (
            fixed.compile, fixed.emulate_precision_casts, fixed.loss_scale, fixed.skip_nonfinite_step) == (
            policy.compile, policy.emulate_precision_casts, policy.loss_scale, policy.skip_nonfinite_step):
        return FixApplicability(spec, False, f"changes nothing in this model under {policy.describe()} (no module it reaches)")
    reason = parse_fix(spec).reason
    if effect is not None and effect.note:
        reason += f"; {effect.note}"
    return FixApplicability(spec, True, reason)


def applicable_fixes(store, session: str) -> list[FixApplicability]:
    """Every fix of the catalogue for the session's model, as tried on it.  Builds the model (fp32) once; runs
    nothing."""
    info, recipe = session_recipe(store, session)
    runs = q.session_runs(store, info.session_id)
    cand = next((r for r in runs if r.kind == "candidate"), None)
    policy = (run_policy(cand) if cand else None) or recipe.default_policy
    model, _ = recipe.build()
    # an island changes something only where island_effect says so: the modules it is offered on
    names = island_targets(model, policy)
    base = _fingerprint(policy.prepare(copy.deepcopy(model)))
    target = _target(store, cand, names) if cand else None
    stake, backward = _stake(store, runs, cand), recipe.loss_fn is not None
    trains = backward and recipe.optimizer_fn is not None
    out = []
    for name in sorted(FIXES):
        d = FIXES[name]
        if d.param == "pattern":
            specs = [f"{name}:{target or (names[0] if names else '*')}"]
        elif d.param and d.param.startswith("choice:"):
            specs = [f"{name}:{c}" for c in d.param.split(":", 1)[1].split("|")]
        else:
            specs = [d.example]
        for spec in specs:
            got = _try(model, policy, base, spec, stake=stake, backward=backward, trains=trains)
            if got.applies:
                break
        out.append(got)
    return out

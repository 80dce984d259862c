"""The diagnosis rule registry: what a rule is, what it sees, and the helpers the rules share.

A rule is registered once, with ``register_rule``, and declares:

- ``kind``: ``"op"`` (``fn(ctx, evidence) -> Diagnosis | None``: reads the first non-finite producer of a run and
  the op or module around it; the first op rule that recognises the failure writes the run's diagnosis) or
  ``"run"`` (``fn(ctx, run, origin) -> list[Diagnosis]``: reads the whole run; ``origin`` is its first
  non-finite ``Origin``, None when it has none);
- ``needs``: the facts it asks ``ctx.facts`` (``RunFacts`` methods, or facts registered with
  ``facts.register_fact``); a rule whose facts the run's facts do not answer is not tried;
- its rank: its place in the registry (``before=`` puts it ahead of another): op rules are tried in that
  order, and the findings of run rules come in that order; ``names_op``: whether its findings name the op
  where a failure was introduced or amplified, which the ranking of the worst comparisons puts first
  (``records.NAMING_SEVERITIES``); a rule that reports on the run (a fix verified, a compiled graph) is
  registered with ``names_op=False`` and its findings are ``info``;
- for a run rule, ``when``: the runs it reads (``FINITE``: no non-finite value; ``EXPLAINED``: an op rule
  explained its first non-finite value; ``UNEXPLAINED``: none did), and ``unless``: rules whose findings on
  the same run make it unnecessary.

Built-in rules (``op_rules``, ``run_rules``) register exactly as a plug-in does; a package adds rules through
the ``precision_lab.rules`` entry point group (naming a module whose import registers them, a function that
takes the registry and registers them, or a ``Rule``).  ``docs/architecture.md`` ("Adding a rule") shows one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol

from ..display import num_text
from ..formats import Format
from ..ops import innermost_module
from ..origin import Origin
from ..records import INPUT_ROLES, NAMING_SEVERITIES, Diagnosis, RunInfo, StoredRecord
from ..registry import Registry
from .catalogue import unreachable
from .facts import ErrorGrowth, FinalOutput, LocalError, OpSeen, PairedValues, QuantiseCall, StateAfter

__all__ = ["Context", "Evidence", "RunFacts", "Rule", "RULES", "register_rule", "rules_of", "FINITE", "EXPLAINED",
           "UNEXPLAINED", "fmt_num", "representable_floor", "at_stake"]


def fmt_num(v: Optional[float]) -> str:
    """A number in a diagnosis sentence: ``display.num_text`` with large values grouped (78,450), 4 digits,
    2 for values below 1e-3 (a scale of 3.5e-06 is about its exponent, not its digits)."""
    tiny = isinstance(v, (int, float)) and math.isfinite(v) and 0 < abs(v) < 1e-3
    return num_text(v, 2 if tiny else 4, grouped=True)


def representable_floor(quant_fmt: Format, scale_fmt: Format) -> float:
    """Smallest power of two amax floor that keeps ``1 / (amax / quant max)`` finite in ``scale_fmt``."""
    need = quant_fmt.max / scale_fmt.max
    return 2.0 ** math.ceil(math.log2(need))


def eps_normal(fmt: Format) -> float:
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

    def last_forward_outputfinite(self, run_id: str) -> bool: ...

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


# the runs a run rule reads
FINITE = "finite"  # no non-finite value anywhere
EXPLAINED = "explained"  # an op rule explained its first non-finite value
UNEXPLAINED = "unexplained"  # it holds non-finite values no op rule recognised
KINDS = ("op", "run")


@dataclass(frozen=True)
class Rule:
    """One diagnosis rule as registered (see the module's docstring; ``when`` and ``unless`` are read for run
    rules only)."""

    name: str
    check: Callable
    kind: str = "op"
    needs: tuple[str, ...] = ()
    names_op: bool = True
    when: tuple[str, ...] = (FINITE,)
    unless: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rule {self.name!r}: kind {self.kind!r} must be one of {', '.join(KINDS)}")
        bad = set(self.when) - {FINITE, EXPLAINED, UNEXPLAINED}
        if bad:
            raise ValueError(f"rule {self.name!r}: when {sorted(bad)} must be among {FINITE}, {EXPLAINED}, "
                             f"{UNEXPLAINED}")

    def answered(self, facts) -> bool:
        """Whether ``facts`` answers every fact this rule needs."""
        return all(callable(getattr(facts, n, None)) for n in self.needs)

    def stamped(self, d: Diagnosis) -> Diagnosis:
        """A finding of this rule with the severity its rank gives: ``info`` for a rule that names no op."""
        if not self.names_op:
            return dataclasses.replace(d, severity="info")
        if d.severity not in NAMING_SEVERITIES:
            raise ValueError(f"rule {self.name!r} names an op but reported severity {d.severity!r}; register it "
                             "with names_op=False if it reports on the run")
        return d


RULES = Registry("diagnosis rule", group="precision_lab.rules", name_of=lambda r: r.name)


def register_rule(name: str, *, kind: str = "op", needs: Iterable[str] = (), names_op: bool = True,
                  when: Iterable[str] = (FINITE,), unless: Iterable[str] = (), before: Optional[str] = None,
                  replace: bool = False):
    """Register the decorated function as the rule ``name`` (see the module's docstring for the arguments);
    built-ins use this too.  Returns the function unchanged."""

    def deco(fn):
        RULES.register(name, Rule(name, fn, kind, tuple(needs), names_op, tuple(when), tuple(unless)),
                       before=before, replace=replace)
        return fn

    return deco


def rules_of(kind: str) -> list[Rule]:
    """The registered rules of ``kind`` (``"op"`` or ``"run"``), in rank order."""
    return [r for r in RULES.values() if r.kind == kind]


def finding(ev: Evidence, rule: str, message: str, fixes, severity: str = "error") -> Diagnosis:
    seen, ranked = set(), []
    for f in fixes:
        if f and f not in seen:
            seen.add(f)
            ranked.append(f)
    return Diagnosis(session_id="", run_id=ev.run.run_id, op=ev.where, rule=rule, message=message,
                     fixes=tuple(ranked), severity=severity, seq=ev.producer.seq)


def finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def ref_records(ctx: Context, ev: Evidence, recs: list[StoredRecord]) -> dict[int, StoredRecord]:
    """Reference records paired with ``recs`` (by the stored comparisons, else by name)."""
    if ctx.ref_run is None or not recs:
        return {}
    return ctx.facts.reference_of(ev.run.run_id, recs, ctx.ref_run.run_id)


def keep_fp32(ev: Evidence) -> Optional[str]:
    if not ev.module or ev.module_facts.get("island_changes") is False:  # an island there changes nothing
        return None
    return f"keep-fp32:{ev.module}"


def reachable(fixes, **values) -> list:
    """``fixes`` without those that cannot help values of these magnitudes (``catalogue.unreachable``: a fix
    whose target format cannot hold them either is never offered)."""
    return [f for f in fixes if f and not unreachable(f, **values)]


def at_stake(reference_records: Iterable[StoredRecord]) -> Optional[float]:
    """The largest finite magnitude among the reference's records of the producer's inputs and outputs: what a
    fix's target format must hold (``catalogue.unreachable(fix, absmax=...)``); None without them.  The cards and
    the fixes listing (``services.applicable``) both ask it."""
    return max((r.magnitude for r in reference_records if finite(r.magnitude)), default=None)


def evidence_at_stake(ctx: Context, ev: Evidence) -> Optional[float]:
    return at_stake(ref_records(ctx, ev, ev.records).values())


"""Where a run's failure started: the first unexpected non-finite value of a run (``origin.analyse`` over what the
store holds of it, with the ops before it), the intended ones beside it, and with several ranks which rank made
it and which received it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from ..enums import OriginKind
from ..origin import model_outputs, Intended, Origin, RunFacts, analyse
from ..ops import COLLECTIVE_OPS
from ..records import GRAD_ROLES, INPUT_ROLES, STATE_ROLES
from ..store import queries as q

__all__ = ["first_nonfinite", "intended_nonfinite", "nonfinite_origin", "run_facts", "rank_spread", "FiniteRank",
           "RankOrigin", "RankState", "PATH_LENGTH", "finite_text", "producer_text"]

PATH_LENGTH = 5  # ops shown before the producer


@dataclass(frozen=True, slots=True)
class FiniteRank:
    """A rank of a distributed run whose every recorded value is finite."""

    rank: int
    state: str
    text: str

    step = op = role = index = None  # no first non-finite value: read like a ``RankOrigin``'s, these are None


@dataclass(frozen=True, slots=True)
class RankOrigin:
    """A rank of a distributed run that holds an unexpected non-finite value: ``state`` says whether it
    ``produced`` its own or ``received`` it, where it first holds one, and a sentence saying so."""

    rank: int
    state: str
    step: int
    op: str
    role: str
    index: str
    text: str


RankState = Union[FiniteRank, RankOrigin]


def run_facts(store, run_id: str) -> RunFacts:
    """What ``origin.analyse`` reads about a run, from the store."""
    run = q.run_row(store, run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r}")
    calls = tuple(q.nonfinite_op_calls(store, run_id, INPUT_ROLES))
    recs = tuple(q.nonfinite_records(store, run_id)) if calls else ()
    parents = q.op_parents(store, run_id).by_op if calls else {}
    return RunFacts(run.name, run_id, run.order, calls, recs, parents,
                    inputs_recorded=bool(calls) and q.records_inputs(store, run_id, INPUT_ROLES),
                    outputs=model_outputs(q.forward_ends(store, run_id), run.order, parents).by_step if calls else {})


def first_nonfinite(store, run_id: str) -> Optional[Origin]:
    """The origin of ``run_id``'s first unexpected non-finite value (``origin.Origin``), None when it holds
    none (see ``nonfinite_origin``, which also gives the intended ones from the same pass)."""
    return nonfinite_origin(store, run_id)[0]


def intended_nonfinite(store, run_id: str) -> list[Intended]:
    """The op calls of a run that wrote ``-inf`` that is no error by itself (a mask, a constant, ``log(0)``, or
    a module holding one), in execution order."""
    return nonfinite_origin(store, run_id)[1]


def nonfinite_origin(store, run_id: str) -> tuple[Optional[Origin], list[Intended]]:
    """``(origin, intended)`` of a run (``origin.analyse`` over ``run_facts``), with the origin's ``path``:
    the last ``PATH_LENGTH`` op calls before it in the same step and rank, then the op itself."""
    facts = run_facts(store, run_id)
    first, masks = analyse(facts)
    if first is None:
        return None, masks
    first = _producing_rank(facts, first)
    path = q.op_calls_up_to(store, run_id, first.step, first.rank, first.seq, INPUT_ROLES, PATH_LENGTH + 1)
    path = [p for p in path if not (p.seq == first.seq and p.op != first.op)][::-1]
    return first.with_path(path), masks


def _rank_facts(facts: RunFacts, rank: int) -> RunFacts:
    """``facts`` of one rank only."""
    return dataclasses.replace(facts, calls=tuple(c for c in facts.calls if c.rank == rank),
                               records=tuple(x for x in facts.records if x.rank == rank),
                               outputs={k: v for k, v in facts.outputs.items() if k[1] == rank})


def _arrived(o: Origin) -> bool:
    """Whether a rank's first non-finite value is one that reaches a rank from the others: a collective's output,
    or a parameter's gradient or a parameter (what DDP's all-reduce, FSDP's reduce-scatter and all-gather and the
    optimizer step after them write)."""
    return o.op_type in COLLECTIVE_OPS or o.role in GRAD_ROLES + STATE_ROLES or o.origin == OriginKind.PARAMETER


def _producing_rank(facts: RunFacts, first: Origin) -> Origin:
    """With several ranks, the first failure found may be one a rank received: in the same step a collective
    hands every rank the value one rank made (FSDP's reduce-scatter during backward, a tensor-parallel
    all-reduce), and the receiver that comes first by rank number is no producer.  Where ``first`` arrived so,
    the earliest origin another rank computed itself (in the same or an earlier step) is the answer."""
    if not _arrived(first):
        return first
    ranks = sorted({c.rank for c in facts.calls})
    if len(ranks) < 2:
        return first
    made = [o for r in ranks if r != first.rank
            for o in (analyse(_rank_facts(facts, r))[0],) if o is not None and o.step <= first.step
            and not _arrived(o)]
    return min(made, key=lambda o: (o.step, o.rank)) if made else first


def rank_spread(store, run_id: str, first: Optional[Origin]) -> list[RankState]:
    """With several ranks: where each rank other than the origin's first holds an unexpected non-finite value,
    and whether it made that value or received it.  Each rank is analysed on its own records (``origin.analyse``
    over its share of ``run_facts``); a rank whose own first value comes after the origin's step, or at that step
    in a parameter's gradient or a parameter (what a collective writes: DDP's gradient all-reduce, an FSDP
    all-gather, and the optimizer step after them), received it; one that made its own in that step's forward
    or from its own finite inputs before it is a producer too.  ``[]`` for a run of one rank."""
    ranks = q.run_ranks(store, run_id) if first is not None else []
    if len(ranks) < 2:
        return []
    facts = run_facts(store, run_id)
    out = []
    for r in ranks:
        if r == first.rank:
            continue
        mine = _rank_facts(facts, r)
        o = analyse(mine)[0] if mine.calls else None
        if o is None:
            out.append(FiniteRank(r, "finite", f"rank {r}: every value it recorded is finite"))
            continue
        received = o.step > first.step or (o.step == first.step and _arrived(o))
        where = f"{o.op} (step {o.step}, {o.role} {o.index})"
        how = (f"through the {o.op_type} it records" if o.op_type in COLLECTIVE_OPS else
               "through a gradient collective in the same step (FSDP's reduce-scatter, an all-reduce)"
               if o.step == first.step else
               "through a collective (DDP's gradient all-reduce, FSDP's all-gather) and the optimizer step after it")
        text = (f"rank {r}: received it, first non-finite at {where}, after rank {first.rank}'s step {first.step}: "
                f"{how}" if received else f"rank {r}: produced its own, at {where}")
        out.append(RankOrigin(r, "received" if received else "produced", o.step, o.op, o.role, o.index, text))
    return out


def finite_text(intended: list[Intended]) -> str:
    """What a run without an unexpected non-finite value holds, as the Overview, the HTML report and the text
    report say it (``intended``: the ops that wrote a mask's ``-inf`` or a fill, which are no failure)."""
    if not intended:
        return "every recorded value is finite"
    return (f"every recorded value is finite apart from intended values (a mask, log(0), a fill) that never reach "
            f"the model's output, a gradient or a parameter, written by {len(intended)} op(s), e.g. {intended[0].op}")


def producer_text(o: Origin) -> str:
    """What made a run's first non-finite value, as the Overview, the HTML report and the text report name it:
    the op, or the parameter or buffer an op read it from."""
    if o.origin != OriginKind.PARAMETER:
        return o.op
    return f"{'buffer' if o.parameter.role == 'buffer' else 'parameter'} {o.parameter.name}, read by {o.op}"

"""A session's stored diagnoses as the cards the Overview, the reports and ``capture`` show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..store import queries

__all__ = ["DiagnosisCard", "diagnosis_cards"]


@dataclass(frozen=True, slots=True)
class DiagnosisCard:
    """A stored diagnosis as the Overview, the reports and ``capture`` show it: the run's name beside its id, the
    op, rule and message, the fixes it proposes (best first), its severity (``info`` when none was stored) and the
    op's place in execution order."""

    run: Optional[str]
    run_id: str
    op: str
    rule: str
    message: str
    fixes: tuple[str, ...]
    severity: str
    seq: Optional[int]


def diagnosis_cards(store, session_id: str) -> list[DiagnosisCard]:
    """The session's diagnoses as cards, errors first, then by execution order."""
    return [DiagnosisCard(d.run, d.run_id, d.op, d.rule, d.message, tuple(d.fixes),
                          d.severity or "info", d.seq)
            for d in queries.diagnoses_worst_first(store, session_id)]

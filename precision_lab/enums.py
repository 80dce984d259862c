"""The verdicts a comparison gets and the severities a diagnosis has, with their order, words and colours.

Every place that ranks, filters, labels or paints them reads these (the SQL
``CASE`` the store sorts by is built from ``rank``).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Verdict", "Severity", "worst_first"]


class Verdict(str, Enum):
    """A comparison's verdict (``metrics.verdict_for``), or ``nonfinite`` for NaN/inf in a record."""

    EXPECTED = "expected"
    WARN = "warn"
    ERROR = "error"
    NONFINITE = "nonfinite"

    @property
    def rank(self) -> int:
        """Higher is worse."""
        return _VERDICT_RANK[self]

    @property
    def label(self) -> str:
        """The word the dashboard shows: ``ok`` for an error within the format's own rounding."""
        return "ok" if self is Verdict.EXPECTED else self.value

    @property
    def colour(self) -> str:
        """Background with alpha, readable on the light and the dark theme alike."""
        return _VERDICT_COLOUR[self]

    @property
    def problem(self) -> bool:
        """What "only problems" keeps."""
        return self in (Verdict.NONFINITE, Verdict.ERROR)

    @classmethod
    def of_label(cls, label: str) -> "Verdict":
        return next(v for v in cls if v.label == label)


_VERDICT_RANK = {Verdict.EXPECTED: 0, Verdict.WARN: 1, Verdict.ERROR: 2, Verdict.NONFINITE: 3}
_VERDICT_COLOUR = {
    Verdict.NONFINITE: "rgba(220, 38, 38, 0.35)",
    Verdict.ERROR: "rgba(234, 88, 12, 0.30)",
    Verdict.WARN: "rgba(202, 138, 4, 0.25)",
    Verdict.EXPECTED: "rgba(22, 163, 74, 0.15)",
}


class Severity(str, Enum):
    """How much a diagnosis matters."""

    INFO = "info"
    WARN = "warn"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """Higher is worse."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARN: 1, Severity.ERROR: 2}


def worst_first(kind) -> list:
    """The members of ``Verdict`` or ``Severity``, worst first."""
    return sorted(kind, key=lambda m: -m.rank)

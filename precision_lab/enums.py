"""The fixed sets of words the project's results use: the verdicts a comparison gets and the severities a
diagnosis has, with their order, words and colours; what an origin is, how certain, in which run order.

Every place that ranks, filters, labels or paints them reads these (the SQL
``CASE`` the store sorts by is built from ``rank``).
"""

from __future__ import annotations

from enum import Enum, StrEnum

__all__ = ["Verdict", "Severity", "worst_first", "OriginKind", "Certainty", "RunOrder", "Direction"]


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


# The words below are StrEnums: each member is its word (``OriginKind.OP == "op"``, ``f"{OriginKind.OP}"`` is
# ``op``), so JSON, SQL parameters and text written from them read as before.

class OriginKind(StrEnum):
    """What a run's first unexpected non-finite value came from (``origin.Origin.origin``)."""

    OP = "op"  # an op call wrote it from finite inputs
    PARAMETER = "parameter"  # a parameter or buffer already held it before any op read it
    INPUT = "input"  # it arrived from before the first recorded op (the model's inputs, an op not recorded)


class Certainty(StrEnum):
    """How sure an origin is (``origin.Origin.certainty``): from the evidence, per answer."""

    CERTAIN = "certain"  # nothing was guessed: inputs seen, the order to every other candidate known
    LIKELY = "likely"  # something was guessed (``Origin.guessed`` says what, ``Origin.decide`` what would settle it)
    ORDER_UNKNOWN = "order unknown"  # an older row's word: the dump gave no order (read as a guess)


class RunOrder(StrEnum):
    """Where a run's op order comes from (the ``runs.order`` column)."""

    EXECUTION = "execution"  # recorded as the ops ran (capture, msprobe, an order list)
    DATA = "data"  # recovered from the data: outputs that are later inputs
    MTIME = "mtime"  # the dump's file modification times
    NAME = "name"  # nothing says: ops sorted by name

    @property
    def text(self) -> str:
        """The order in words, as the reports and the Overview show it."""
        return _ORDER_TEXT[self]

    @property
    def known(self) -> bool:
        """Whether the order says which op ran first."""
        return self is not RunOrder.NAME

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """The words a stored run's ``order`` may hold."""
        return tuple(o.value for o in cls)

    @classmethod
    def of(cls, word) -> "RunOrder":
        """The order a stored word names; no word (an older row) is ``execution``; a word that names no order
        (a row no check of this version wrote) is ``name``: nothing says which op ran first."""
        try:
            return cls(word or cls.EXECUTION)
        except ValueError:
            return cls.NAME


_ORDER_TEXT = {RunOrder.EXECUTION: "execution order",
               RunOrder.DATA: "order recovered from the data (outputs that are later inputs)",
               RunOrder.MTIME: "order from file modification times",
               RunOrder.NAME: "order unknown: by name"}


class Direction(StrEnum):
    """Which pass an op call ran in (the ``tensors.direction`` column)."""

    FORWARD = "forward"
    BACKWARD = "backward"

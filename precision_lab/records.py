"""The records every layer exchanges.  Store columns are derived from these."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["TensorRecord", "RunInfo", "Diagnosis", "tensor_name", "ROLES", "split_tensor_name", "free_name"]

# input/output of a forward op; grad_input/grad_output of a backward op
# (msprobe's backward "input" is the gradient flowing in = grad_output in torch
# terms; we keep the dump's own words); param/param_grad for parameters.
ROLES = ("input", "output", "kwarg", "param", "grad_input", "grad_output", "param_grad", "tensor")


def tensor_name(op: str, role: str, index: int | str) -> str:
    return f"{op}.{role}.{index}"


_NAME_RE = re.compile(r"^(?P<op>.+)\.(?P<role>input|output|kwarg|param|grad_input|grad_output|param_grad)\.(?P<index>[^.]+)$")


def split_tensor_name(name: str) -> Optional[tuple[str, str, str]]:
    """``'blocks.0.fc1.output.0'`` -> ``('blocks.0.fc1', 'output', '0')``; None if not of that form."""
    m = _NAME_RE.match(name)
    return (m["op"], m["role"], m["index"]) if m else None


def free_name(base: str, taken, pattern: str = "{base}-{i}") -> str:
    """``base`` if it is not in ``taken``, else ``pattern`` with the smallest ``i >= 2`` that is free.

    Session and run names are chosen this way so a new one never replaces an old one.
    """
    if base not in taken:
        return base
    i = 2
    while pattern.format(base=base, i=i) in taken:
        i += 1
    return pattern.format(base=base, i=i)


@dataclass
class TensorRecord:
    """Where one tensor came from, with its statistics.

    ``seq`` is execution order within a run (per step and rank).  ``op`` is
    stable across runs of the same model (module path + op + call counter),
    which is what pairs a reference with a candidate.  ``index`` is a string
    so dict keys (``weight``, ``bias``) and positions share one column.
    ``tensor`` is kept only when asked for (exact comparison, replay); it is
    not a store column.
    """

    run_id: str
    seq: int
    op: str
    op_type: str
    role: str
    index: str
    stats: Any  # precision_lab.stats.TensorStats
    step: int = 0
    rank: int = 0
    direction: str = "forward"  # forward | backward
    source: str = ""  # file it was read from, or "capture"
    tensor: Any = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return tensor_name(self.op, self.role, self.index)


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    session_id: str
    name: str
    dtype: str = ""  # dominant compute dtype, e.g. float16
    kind: str = "candidate"  # reference | candidate | rerun
    parent_run_id: Optional[str] = None
    fix: Optional[str] = None  # fix spec(s) that made this run from its parent
    policy: Optional[str] = None  # JSON of the precision policy, when known
    source: str = ""  # folder/zip path, recipe name, or "capture"
    order: str = "execution"  # execution | name (when a dump carries no order)
    created: Optional[str] = None


@dataclass(frozen=True)
class Diagnosis:
    session_id: str
    run_id: str
    op: str
    rule: str
    message: str
    fixes: tuple[str, ...] = ()
    severity: str = "error"  # error | warn | info
    seq: int = -1

    def fixes_json(self) -> str:
        return json.dumps(list(self.fixes))

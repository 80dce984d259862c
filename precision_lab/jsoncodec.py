"""JSON with non-finite floats: strict JSON has no NaN or Infinity, so they travel as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (which ``float()`` reads back).  One encoder, one decoder.

A frozen result (a dataclass) travels as the object of its fields, in the order they are declared
(``fields_tree``); one that has a JSON form of its own (an ``as_dict`` method, as ``origin.Origin`` has: its fields
and the words they imply) travels as that form."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional

__all__ = ["NONFINITE_WORDS", "json_float", "from_json_float", "fields_tree", "jsonable", "decode_nonfinite",
           "dumps"]

NONFINITE_WORDS = frozenset({"nan", "inf", "-inf"})


def json_float(v: Optional[float]):
    """A float for strict JSON: non-finite values become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def from_json_float(v) -> Optional[float]:
    """The inverse of ``json_float``."""
    if v is None:
        return None
    return float(v)  # float("nan") / float("inf") / float("-inf") parse the words


def decode_nonfinite(v: object) -> object:
    """``v`` with a non-finite word turned back into its float; every other value as it is."""
    return float(v) if isinstance(v, str) and v in NONFINITE_WORDS else v


def fields_tree(v: object) -> object:
    """``v`` with every dataclass in it (in lists, tuples and dict values too) turned into the dict of its fields,
    in declaration order (or into its ``as_dict()``, where it has one); every other value as it is."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        if hasattr(v, "as_dict"):
            return fields_tree(v.as_dict())
        return {f.name: fields_tree(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {k: fields_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [fields_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(fields_tree(x) for x in v)
    return v


def jsonable(v: Any) -> Any:
    """A tree of dicts, lists, tuples, dataclasses (``fields_tree``) and numbers (numpy scalars included) with every
    float ready for strict JSON."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return jsonable(fields_tree(v))
    if isinstance(v, float):
        return json_float(v)
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        return jsonable(v.item())
    return v


def dumps(v: Any, **kwargs) -> str:
    """Strict JSON text of ``jsonable(v)``."""
    return json.dumps(jsonable(v), allow_nan=False, **kwargs)

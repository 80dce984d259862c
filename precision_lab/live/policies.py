"""The dtype policy a bare torch dtype stands for, and how any policy is described in a run's record."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch

from ..fixes.policy import cast_floating
from ..formats import get_format


def policy_description(policy) -> Optional[str]:
    """A JSON description of a dtype policy for the run's ``policy`` column."""
    if policy is None:
        return None
    if isinstance(policy, torch.dtype):
        return json.dumps({"dtype": str(policy).replace("torch.", "")})
    for attr in ("to_json", "describe"):
        fn = getattr(policy, attr, None)
        if callable(fn):
            try:
                out = fn()
                return out if isinstance(out, str) else json.dumps(out, default=str)
            except Exception:
                break
    if dataclasses.is_dataclass(policy):
        try:
            return json.dumps(dataclasses.asdict(policy), default=str)
        except Exception:
            pass
    return json.dumps({"policy": repr(policy)})


class DtypePolicy:
    """The policy a bare torch dtype stands for: cast the model and its floating inputs."""

    _OK = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(self, dtype: torch.dtype):
        if dtype not in self._OK:
            raise ValueError(
                f"dtype_policy={dtype}: a bare dtype can only cast a model to float16, bfloat16, float32 or "
                "float64 (torch cannot run modules with fp8 weights); pass a precision policy with fp8 "
                "fake-quantisation instead"
            )
        self.dtype = dtype

    @property
    def name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def to_json(self) -> str:
        return json.dumps({"dtype": self.name})

    def prepare(self, model):
        return model.to(self.dtype)

    def prepare_inputs(self, inputs):
        return cast_floating(inputs, self.dtype)


def as_policy(dtype_policy):
    if dtype_policy is None or isinstance(dtype_policy, DtypePolicy):
        return dtype_policy
    if isinstance(dtype_policy, torch.dtype):
        return DtypePolicy(dtype_policy)
    if isinstance(dtype_policy, str):
        td = get_format(dtype_policy).torch_dtype()
        if td is None:
            raise ValueError(f"dtype_policy={dtype_policy!r}: no torch dtype for this format")
        return DtypePolicy(td)
    missing = [m for m in ("prepare", "prepare_inputs") if not callable(getattr(dtype_policy, m, None))]
    if missing:
        raise TypeError(
            f"dtype_policy {dtype_policy!r} must be None, a torch dtype, or an object with prepare(model) and "
            f"prepare_inputs(inputs); it has no {' or '.join(missing)}()"
        )
    return dtype_policy

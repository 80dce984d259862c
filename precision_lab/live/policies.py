"""The policy a bare torch dtype stands for, and how any policy is described in a run's record."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Protocol

import torch

from ..fixes.policy import COMPUTE_FORMATS, PrecisionPolicy, cast_floating
from ..formats import format_for_dtype, get_format


class CapturePolicy(Protocol):
    """What a capture runs a model under: it casts the model and its inputs."""

    def prepare(self, model): ...

    def prepare_inputs(self, inputs): ...


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


class Float64Policy:
    """A float64 model and inputs (a reference above fp32). Every other bare dtype is a ``PrecisionPolicy``;
    float64 is no compute format of a precision policy, so this one casts and records ``{"dtype": "float64"}``."""

    name = "float64"

    def to_json(self) -> str:
        return json.dumps({"dtype": self.name})

    def prepare(self, model):
        return model.to(torch.float64)

    def prepare_inputs(self, inputs):
        return cast_floating(inputs, torch.float64)


def as_policy(dtype_policy) -> Optional[CapturePolicy]:
    """The policy a capture runs under: a bare torch dtype or format name is the ``PrecisionPolicy`` of that
    compute format (so the run records, and re-runs read back, one kind of policy); float64 is
    ``Float64Policy``; an object with ``prepare`` and ``prepare_inputs`` is used as it is."""
    if dtype_policy is None:
        return None
    if isinstance(dtype_policy, str):
        td = get_format(dtype_policy).torch_dtype()
        if td is None:
            raise ValueError(f"dtype_policy={dtype_policy!r}: no torch dtype for this format")
        dtype_policy = td
    if isinstance(dtype_policy, torch.dtype):
        if dtype_policy == torch.float64:
            return Float64Policy()
        fmt = format_for_dtype(dtype_policy)
        if fmt is None or fmt.name not in COMPUTE_FORMATS:
            raise ValueError(
                f"dtype_policy={dtype_policy}: a bare dtype can only cast a model to float16, bfloat16, float32 or "
                "float64 (torch cannot run modules with fp8 weights); pass a precision policy with fp8 "
                "fake-quantisation instead"
            )
        # named as the dtype was (runs are named after their policy: "float16", as before)
        return PrecisionPolicy(name=str(dtype_policy).replace("torch.", ""), dtype=fmt.name)
    missing = [m for m in ("prepare", "prepare_inputs") if not callable(getattr(dtype_policy, m, None))]
    if missing:
        raise TypeError(
            f"dtype_policy {dtype_policy!r} must be None, a torch dtype, or an object with prepare(model) and "
            f"prepare_inputs(inputs); it has no {' or '.join(missing)}()"
        )
    return dtype_policy

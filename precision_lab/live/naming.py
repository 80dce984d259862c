"""How a torch function or tensor method becomes an op name, and which calls are not ops at all."""

from __future__ import annotations

from typing import Optional

import torch
from torch.overrides import resolve_name

from ..ops import NON_COMPUTE_OPS as _NON_COMPUTE


# Tensor methods that change dtype: recorded like any op (their local error
# is the rounding of the cast itself), and their fp32 shadow is the input.
CAST_OPS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})


_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})


class _OpInfo:
    __slots__ = ("name", "skip", "inplace", "cast", "waits")

    def __init__(self, name: str, skip: bool, inplace: bool, cast: bool, waits: Optional[str] = None):
        self.name, self.skip, self.inplace, self.cast = name, skip, inplace, cast
        # a functional collective's operator namespace: its output is written by the collective after the call
        # returns, and holds the result once ``torch.ops.<namespace>.wait_tensor`` has waited for it
        self.waits = waits


_FUNC_INFO: dict = {}

# operator namespaces of sharding plumbing, not numerics: FSDP's copy-in fills its all-gather buffer with this
# rank's shard and leaves the rest of the buffer as allocated (any bits) until the collective runs, so the buffer
# it takes and returns would read as a tensor full of NaN that no op made
_PLUMBING = frozenset({"fsdp"})

# operator namespaces of the functional collectives (``torch.distributed._functional_collectives``, which
# DTensor's redistribution and torch.compile's traced collectives call): a call returns before its output is
# written; ``wait_tensor`` and the wrapping of that output for autograd move no value, so they are no ops
_FUNCTIONAL_COLLECTIVES = frozenset({"_c10d_functional", "c10d_functional"})
_FUNCTIONAL_PASS = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def _namespace(func) -> str:
    return getattr(func, "namespace", None) or str(getattr(func, "_qualified_op_name", "")).partition("::")[0]


def _func_info(func) -> _OpInfo:
    info = _FUNC_INFO.get(func)
    if info is not None:
        return info
    schema = getattr(func, "_schema", None)  # a torch.ops overload: its own name, not "default"
    if schema is not None:
        full = schema.name.rpartition("::")[2]
    else:
        full = None
    try:
        full = full or resolve_name(func) or getattr(func, "__qualname__", None) or getattr(func, "__name__",
                                                                                            repr(func))
    except Exception:
        full = getattr(func, "__name__", repr(func))
    parts = full.split(".")
    last = parts[-1]
    ns = _namespace(func)
    waits = ns if ns in _FUNCTIONAL_COLLECTIVES and last not in _FUNCTIONAL_PASS else None
    skip = (last in ("__get__", "__set__", "__delete__") or last in _NON_COMPUTE or ns in _PLUMBING
            or (ns in _FUNCTIONAL_COLLECTIVES and last in _FUNCTIONAL_PASS)
            # torch.distributed's Python functions (``recv`` and ``send`` pass through torch-function handling):
            # recorded where they reach the process group (``collectives``), not as calls of their own
            or getattr(func, "__module__", None) == "torch.distributed.distributed_c10d")
    inplace = last in _INPLACE_DUNDERS or (last.endswith("_") and not last.endswith("__"))
    name = last
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and f"__{name}__" in _INPLACE_DUNDERS and name != "index":
            name = name[1:] + "_"  # __iadd__ -> add_
        elif name.startswith("r") and name not in ("rshift",):
            name = name[1:]  # __radd__ -> add
    name = name.lstrip("_") or name
    info = _OpInfo(name, skip, inplace, name in CAST_OPS, waits)
    _FUNC_INFO[func] = info
    return info


def _flatten(obj, prefix: str = "", depth: int = 0):
    """(index, tensor) pairs of the tensors in a nested output/argument structure."""
    if isinstance(obj, torch.Tensor):
        yield (prefix or "0"), obj
        return
    if depth > 4:
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                yield (f"{prefix}_{i}" if prefix else str(i)), v
            elif isinstance(v, (tuple, list, dict)):
                yield from _flatten(v, f"{prefix}_{i}" if prefix else str(i), depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = str(k).replace(".", "_")
            if isinstance(v, torch.Tensor):
                yield (f"{prefix}_{key}" if prefix else key), v
            elif isinstance(v, (tuple, list, dict)):
                yield from _flatten(v, f"{prefix}_{key}" if prefix else key, depth + 1)


def _backward_name(module_op: str) -> str:
    """``blocks.0.fc1.forward.3`` -> ``blocks.0.fc1.backward.3``."""
    head, _, n = module_op.rpartition(".forward.")
    if head or module_op.startswith("forward."):
        return f"{head}.backward.{n}" if head else "backward." + module_op.split(".", 1)[1]
    return module_op + ".backward"


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class _Frame:
    __slots__ = ("module", "path", "op", "op_type", "scope_ok", "record", "inputs", "shadow_in", "start_seq",
                 "rng", "location", "autocast")

    def __init__(self, module, path, op, op_type, scope_ok, record, start_seq):
        self.module, self.path, self.op, self.op_type = module, path, op, op_type
        self.scope_ok, self.record, self.start_seq = scope_ok, record, start_seq
        self.inputs = None
        self.shadow_in = None
        self.rng = None
        self.location = None
        self.autocast = None  # the dtype torch.autocast computed in when the module was called, if it was on


def remove_handles(handles: list) -> None:
    """Remove each hook handle (one already gone is no matter) and empty the list."""
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass
    handles.clear()

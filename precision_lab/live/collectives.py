"""torch.distributed's collectives recorded as ops of a capture.

A ProcessGroup call (``dist.all_reduce``, ``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``...)
runs no torch function, so the capture's function mode never sees it.  While a capture is active the
functions of ``torch.distributed`` are wrapped: each call made while a step is recorded becomes an op of this
rank -- its input what the rank sent, its output what it got back -- named in the module that made it
(``blocks.0.mlp.all_reduce.0``: a tensor-parallel layer, FSDP's all-gather) or, outside the model's forward,
at the top (``all_reduce.0``: a loss averaged over ranks, a gradient reduced in backward, direction
``backward`` while autograd runs).  A collective's output that turns non-finite from finite inputs is a value
another rank made: the origin analysis reads it as received (``ops.COLLECTIVE_OPS``).  The calls run on the
user's process group exactly as they were made: the capture adds no collective of its own.  A call with
``async_op=True`` returns before its output is written: what it sent is recorded at the call, what it got back
once its work has completed, where the tensor is next read or at the step's end
(``StepRecords.collective_after``); one whose work has not completed by the step's end is counted, and the run
says how many were.  The wrapped functions are put back when the capture ends.

Code that bound a collective before the capture began (``from torch.distributed import all_reduce``) calls
the unwrapped function, as does DDP's gradient all-reduce (C++, inside its reducer).  Functional collectives
(``torch.ops._c10d_functional``: DTensor's redistribution, ``_functional_collectives``) are torch functions the
capture's function mode sees; ``functional.FunctionalOps`` waits for their results before reading them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from ..ops import COLLECTIVE_OPS

__all__ = ["COLLECTIVE_SPECS", "install"]

# function -> (the argument it sends, the argument it writes): by name, as torch.distributed declares them
COLLECTIVE_SPECS = {
    "all_reduce": ("tensor", "tensor"),
    "broadcast": ("tensor", "tensor"),
    "reduce": ("tensor", "tensor"),
    "all_gather_into_tensor": ("input_tensor", "output_tensor"),
    "reduce_scatter_tensor": ("input", "output"),
    "all_gather": ("tensor", "tensor_list"),
    "reduce_scatter": ("input_list", "output"),
    "all_to_all_single": ("input", "output"),
}
# point to point (pipeline stages), at the process group, which every way of calling them reaches (``send``,
# ``isend``, each operation of ``batch_isend_irecv``): ProcessGroup method -> (op name, whether it receives)
P2P_METHODS = {"send": ("send", False), "recv": ("recv", True), "recv_anysource": ("recv", True)}
assert set(COLLECTIVE_SPECS) | {n for n, _ in P2P_METHODS.values()} <= COLLECTIVE_OPS


def install(cap) -> Callable[[], None]:
    """Wrap torch.distributed's collectives for ``cap`` (a no-op without torch.distributed); returns the undo."""
    if not torch.distributed.is_available():
        return lambda: None
    dist = torch.distributed
    saved = _patch(dist, {name: functools.partial(_wrap, cap, name, sent=sent, written=written)
                          for name, (sent, written) in COLLECTIVE_SPECS.items()})
    saved += _patch(getattr(dist, "ProcessGroup", None),
                    {method: functools.partial(_wrap_p2p, cap, name, receives=receives)
                     for method, (name, receives) in P2P_METHODS.items()})

    def undo() -> None:
        for owner, name, fn in saved:
            setattr(owner, name, fn)

    return undo


def _patch(owner, makers: dict) -> list:
    """Replace each function ``name`` of ``owner`` with ``makers[name](function)``; ``(owner, name, function)``
    of each replaced (one already wrapped, by a capture running meanwhile, is left as it is)."""
    saved = []
    for name, make in makers.items():
        fn = getattr(owner, name, None)
        if fn is None or getattr(fn, "_precision_lab_wrapped", False):
            continue
        saved.append((owner, name, fn))
        setattr(owner, name, make(fn))
    return saved


def _wrap(cap, name: str, fn, *, sent: str, written: str):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not cap.recording or getattr(cap._tls, "busy", False):
            return fn(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # torch says what is wrong with the call
        ctx = cap.collective_before(name, bound.arguments.get(sent))
        out = fn(*args, **kwargs)
        if ctx is not None:
            work = (out,) if bound.arguments.get("async_op") else ()  # a Work: the output lands when it completes
            cap.collective_after(ctx, bound.arguments.get(written), *work)
        return out

    call._precision_lab_wrapped = True
    return call


def _wrap_p2p(cap, name: str, fn, *, receives: bool):
    """A process group's ``send``/``recv`` of a list of tensors, returning its work: an op of its own, what this
    rank sent, or what it received once the work has completed (``StepRecords.collective_after``)."""

    @functools.wraps(fn)
    def call(group, tensors, *args, **kwargs):
        if not cap.recording or getattr(cap._tls, "busy", False):
            return fn(group, tensors, *args, **kwargs)
        ctx = cap.collective_before(name, None if receives else tensors)
        work = fn(group, tensors, *args, **kwargs)
        if ctx is not None:
            cap.collective_after(ctx, tensors if receives else None, work)
        return work

    call._precision_lab_wrapped = True
    return call

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
once its work has completed, where the tensor is next read or at the step's end (``StepRecords.collective_after``); one
whose work has not completed by the step's end is counted, and the run says how many were.  The wrapped
functions are put back when the capture ends.

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
    # point to point (pipeline stages): a send writes nothing here, a receive sends nothing
    "send": ("tensor", None),
    "recv": (None, "tensor"),
}
assert set(COLLECTIVE_SPECS) <= COLLECTIVE_OPS
assert {"isend", "irecv"} <= COLLECTIVE_OPS  # the operations of ``batch_isend_irecv``


def install(cap) -> Callable[[], None]:
    """Wrap torch.distributed's collectives for ``cap`` (a no-op without torch.distributed); returns the undo."""
    if not torch.distributed.is_available():
        return lambda: None
    dist = torch.distributed
    saved = {}
    for name, (sent, written) in COLLECTIVE_SPECS.items():
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_precision_lab_wrapped", False):
            continue
        saved[name] = fn
        setattr(dist, name, _wrap(cap, name, fn, sent, written))
    fn = getattr(dist, "batch_isend_irecv", None)
    if fn is not None and not getattr(fn, "_precision_lab_wrapped", False):
        saved["batch_isend_irecv"] = fn
        setattr(dist, "batch_isend_irecv", _wrap_batch(cap, fn))

    def undo() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return undo


def _wrap(cap, name: str, fn, sent: str, written: str):
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
            if bound.arguments.get("async_op"):
                cap.collective_after(ctx, bound.arguments.get(written), out)
            else:
                cap.collective_after(ctx, bound.arguments.get(written))
        return out

    call._precision_lab_wrapped = True
    return call


class _AllOf:
    """The works of one ``batch_isend_irecv`` call, done when each is: which of them writes which receive is
    the backend's affair (NCCL coalesces them into one)."""

    def __init__(self, works):
        self.works = [w for w in works or () if w is not None]

    def is_completed(self) -> bool:
        return bool(self.works) and all(w.is_completed() for w in self.works)


def _wrap_batch(cap, fn):
    """``batch_isend_irecv(p2p_ops)``: each ``P2POp`` is an op of its own, ``isend`` (what this rank sent) or
    ``irecv`` (what it received, once the works have completed: ``StepRecords.collective_after``).  The
    ``P2POp``s are passed on as they are: torch checks their functions by identity, so ``isend`` and
    ``irecv`` themselves are not wrapped, and calls of them outside a batch run unrecorded."""

    @functools.wraps(fn)
    def call(p2p_op_list, *args, **kwargs):
        if not cap.recording or getattr(cap._tls, "busy", False):
            return fn(p2p_op_list, *args, **kwargs)
        ops = []
        for p in p2p_op_list:
            name = getattr(getattr(p, "op", None), "__name__", "")
            kind = "isend" if "send" in name else "irecv" if "recv" in name else None
            if kind is not None:
                ops.append((kind, p.tensor, cap.collective_before(kind, p.tensor if kind == "isend" else None)))
        works = fn(p2p_op_list, *args, **kwargs)
        done = _AllOf(works)
        for kind, t, ctx in ops:
            if ctx is not None:
                cap.collective_after(ctx, t if kind == "irecv" else None, done)
        return works

    call._precision_lab_wrapped = True
    return call

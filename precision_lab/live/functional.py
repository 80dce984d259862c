"""Functional ops: the torch-function mode that sees every torch function and tensor method called while a
capture is active, and what records one such call as an op (its inputs on entry, its outputs on return)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from .naming import _Frame, _OpInfo, _flatten, _func_info
from .shadow import _cuda_devices, _rng_state_of
from .where import user_location

_UNSEEN = object()


class _Mode(TorchFunctionMode):
    """Sees every torch function and tensor method called while the capture is active."""

    def __init__(self, cap: "FunctionalOps"):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        cap = self.cap
        # the per-function decision (skipped, view, filtered out) is made once per capture:
        # most calls in a forward are views and metadata, and they return here
        info = cap._fn_selected.get(func, _UNSEEN)
        if info is _UNSEEN:
            info = cap._select_func(func)
        if info is None or not cap.recording:
            return func(*args, **kwargs)
        st = cap._tls
        stack = getattr(st, "stack", None)
        if not stack or st.busy:
            return func(*args, **kwargs)
        frame = stack[-1]
        if not frame.scope_ok:
            return func(*args, **kwargs)
        ctx = None
        st.busy = True
        try:
            ctx = cap._op_before(frame, info, args, kwargs)
        except Exception as e:  # never break the user's step
            cap.hook_error(f"{frame.path}.{info.name}", e)
        finally:
            st.busy = False
        out = func(*args, **kwargs)
        if ctx is not None:
            st.busy = True
            try:
                cap._op_after(ctx, func, args, kwargs, out)
            except Exception as e:
                cap.hook_error(ctx[0], e)
            finally:
                st.busy = False
        return out

class FunctionalOps:
    """The capture's functional-op recording (part of ``Capture``, on its state): which torch functions are ops,
    and an op call's records from the mode above."""

    def _select_func(self, func) -> Optional[_OpInfo]:
        info = _func_info(func)
        if info.skip or not self.options.op_type_selected(info.name):
            info = None
        self._fn_selected[func] = info
        return info


    def _op_before(self, frame: _Frame, info: _OpInfo, args, kwargs):
        op = self._next_name(frame.path, info.name)
        where = user_location(2) if self.options.locations else None
        ins = self._measure_inputs(op, args, kwargs)
        shadow = None
        rng = None
        if self.options.local_error:
            inplace = info.inplace or kwargs.get("out") is not None or kwargs.get("inplace") is True
            shadow = self._shadow.functional_inputs(args, kwargs, inplace)
            rng = _rng_state_of(_cuda_devices((args, kwargs)))
        return (op, info, ins, self._seq, shadow, rng, where)

    def _op_after(self, ctx, func, args, kwargs, out):
        op, info, ins, start_seq, shadow, rng, where = ctx
        if info.name == "setitem":
            # x[i] = v returns nothing; its result is the mutated x
            outs = list(_flatten(args[0] if args else None))
        else:
            outs = list(_flatten(out))
        if not outs:
            return
        if info.waits:
            # a functional collective: its output holds what the ranks sent once it is waited for (the user's
            # own wait, later, then finds it done); its statistics are of that
            wait = getattr(torch.ops, info.waits).wait_tensor
            for _, t in outs:
                wait(t)
        out_recs = self._record_call(op, info.name, ins, outs, start_seq, f"{op}.backward", where)
        if shadow is not None and out_recs:
            self._shadow.functional(op, info, func, shadow, rng, out_recs)

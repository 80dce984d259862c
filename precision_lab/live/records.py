"""The records of a capture's current step: op names, execution order, tensors noted with the handles their
statistics arrive on, warnings, and the calls (ops, modules, collectives) they are recorded for."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..records import TensorRecord
from .naming import _flatten


class _InFlight(NamedTuple):
    """A tensor that an asynchronous collective writes, and the op call it is recorded under."""

    ref: weakref.ref
    work: object  # torch.distributed's Work
    seq: int
    op: str
    name: str
    idx: str
    direction: str
    step: int
    version: int  # the tensor's version at the call: the collective writes it without a new one


class _Written:
    """The work of a collective that returned with its output written."""

    @staticmethod
    def is_completed() -> bool:
        return True


_SYNC = _Written()


def _completed(work) -> bool:
    """Whether a collective's work has completed (False where the backend cannot say)."""
    try:
        return bool(work.is_completed())
    except Exception:
        return False


class StepRecords:
    """What the capture's parts record through (part of ``Capture``, on its state)."""

    def warn(self, where: str, message: str) -> None:
        """Note a warning on the run (each one once, up to ``options.max_warnings``)."""
        key = (where, message)
        with self._lock:
            if key in self._warned or len(self.warnings) >= self.options.max_warnings:
                return
            self._warned.add(key)
            self.warnings.append((where, message))

    def hook_error(self, where: str, e: BaseException) -> None:
        self.warn(where, f"capture hook error ({type(e).__name__}: {e}); the step ran unchanged")
    def next_name(self, path: str, opname: str) -> str:
        """``<path>.<opname>.<n>``, n counting this step's calls of ``opname`` in ``path``."""
        return self._next_name(path, opname)

    def forget(self, t) -> None:
        """Earlier statistics of ``t`` no longer hold: it was written without its version changing."""
        self._engine.forget(t)

    def _next_name(self, path: str, opname: str) -> str:
        key = (path, opname)
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        # the same names come back every step: one string each for the whole capture (a long run keeps them)
        name = self._names.get((path, opname, n))
        if name is None:
            name = self._names[(path, opname, n)] = f"{path}.{opname}.{n}" if path else f"{opname}.{n}"
        return name

    def measure(self, op: str, t: torch.Tensor, hold: bool = False, defer: bool = False):
        """Start the statistics of ``t`` (recorded under ``op``): a handle they arrive on when the step ends
        (``defer``: see ``StatsEngine.measure``)."""
        if self._in_flight:
            self._land(t)
        return self._engine.measure(t, op, hold=hold, defer=defer)

    def resolve_deferred(self) -> None:
        """Take the CPU statistics deferred so far now, not at the step's end."""
        self._engine.resolve_deferred()

    def _add(self, seq, op, op_type, role, index, handle, direction="forward", tensor=None, step=None,
             location=None) -> int:
        """Note one record of the current step (its TensorRecord is made when the step ends); its position."""
        item = (seq, op, op_type, role, index, direction, self.step_no if step is None else step, tensor, location,
                handle)
        with self._lock:
            self._pending.append(item)
            return len(self.records) + len(self._pending) - 1

    def _make_record(self, item, stats) -> TensorRecord:
        seq, op, op_type, role, index, direction, step, tensor, location, _ = item
        return TensorRecord(run_id=self.run_id, seq=seq, op=op, op_type=op_type, role=role, index=str(index),
                            stats=stats, step=step, rank=self.rank, direction=direction, source="capture",
                            tensor=tensor, location=location)

    def _keep(self, op: str, t: torch.Tensor):
        if not self.options.keep_tensors:
            return None
        keep = self._keep_ops.get(op)
        if keep is None:
            keep = self._keep_ops[op] = self.options.keep_selected(op)
        if not keep:
            return None
        if t.layout != torch.strided or t.device.type == "meta" or t.is_complex():
            self.warn(op, f"{t.layout} {str(t.dtype).replace('torch.', '')} tensor not kept: only dense real "
                           "tensors are stored whole")
            return None
        return t.detach().clone()

    def _observe(self, pos, t, handle):
        if self.observer is None:
            return
        with self._lock:
            item = self._pending[pos - len(self.records)]
        rec = self._make_record(item, None)
        try:
            self.observer.on_record(self, pos, rec, t, handle)
        except Exception as e:
            self.hook_error(rec.op, e)

    def add_tensor(self, seq, op, op_type, role, index, t, handle, direction="forward", step=None,
                   location=None) -> int:
        """Record tensor ``t`` (its statistics on ``handle``; kept whole where the options say): its position."""
        pos = self._add(seq, op, op_type, role, index, handle, direction,
                        tensor=None if t is None else self._keep(op, t), step=step, location=location)
        if t is not None:  # None: statistics taken earlier of values no longer there (DDP's local gradient)
            self._observe(pos, t, handle)
        return pos

    def summarise(self, seq, op, op_type, role, index, direction, t, location) -> None:
        """Note tensor ``t`` in the step's timeline summary."""
        self.timeline.summarise(seq, op, op_type, role, index, direction, t, location, full=self.recording)

    def _add_comparison(self, pos: int, cmp) -> None:
        with self._lock:
            self.local_comparisons.append((pos, cmp))

    # -- collectives (collectives.install wraps torch.distributed's functions to call these)
    def collective_before(self, name: str, sent):
        """A collective is about to run: its op name and what this rank sends, measured now (an in-place
        collective overwrites it)."""
        st = self._tls
        stack = getattr(st, "stack", None)
        if stack and not stack[-1].scope_ok:
            return None
        st.busy = True
        try:
            op = self._next_name(stack[-1].path if stack else "", name)
            backward = torch._C._current_graph_task_id() != -1  # inside autograd's backward pass
            ins = [("input", idx, t, h) for idx, t in _flatten(sent) for h in (self.measure(op, t),) if h is not None]
            return op, name, ins, "backward" if backward else "forward"
        except Exception as e:
            self.hook_error(name, e)
            return None
        finally:
            st.busy = False

    def collective_after(self, ctx, written, work=_SYNC) -> None:
        """The collective returned: what this rank sent, recorded with what it got back as one op call.  A call
        with ``async_op=True`` returned its ``work`` and writes ``written`` when that completes, without a new
        version of the tensor: until then nothing known of it holds, and once the work has completed it is
        read as the collective's output where it is next read (the op that uses it), or at the step's end."""
        op, name, ins, direction = ctx
        st = self._tls
        st.busy = True
        try:
            seq = self.take_seq()
            for role, idx, t, h in ins:
                self.add_tensor(seq, op, name, role, idx, t, h, direction)
            for idx, t in _flatten(written):
                self.forget(t)  # written in place, perhaps without a new version: measured afresh
                if work is None:  # an asynchronous call with no work to ask (a group this rank is not in)
                    continue
                with self._lock:
                    self._in_flight[id(t)] = _InFlight(weakref.ref(t), work, seq, op, name, idx, direction,
                                                       self.step_no, t._version)
                if work is _SYNC:
                    self._land(t)  # written already: its output now
        except Exception as e:
            self.hook_error(op, e)
        finally:
            st.busy = False

    def _land(self, t) -> None:
        """``t`` is about to be read: where an asynchronous collective writes it, nothing measured before holds,
        and once its work has completed it is recorded as that collective's output."""
        f = self._in_flight.get(id(t))
        if f is None or f.ref() is not t:
            return
        self.forget(t)
        if not _completed(f.work):
            return  # still being written (read before its wait): measured as it is, and again once it lands
        with self._lock:
            self._in_flight.pop(id(t), None)
        if t._version != f.version:
            # written since by the step itself (a device collective is often still running where the tensor is
            # first read, and lands for the capture at the step's end): what the collective wrote is gone
            self.note_unrecorded_collective(f.name)
            return
        h = self._engine.measure(t, f.op)
        if h is not None:
            self.add_tensor(f.seq, f.op, f.name, "output", f.idx, t, h, f.direction, step=f.step)

    def _land_completed(self) -> bool:
        """Record the outputs of this step's asynchronous collectives whose work has completed (at the step's
        end); whether any was."""
        landed = False
        for f in list(self._in_flight.values()):
            t = f.ref()  # a tensor freed meanwhile stays, and is counted with those never completed
            if t is not None and _completed(f.work):
                self._land(t)
                landed = True
        return landed

    def _drop_in_flight(self) -> None:
        """The step ended with these collectives' work not completed (or their tensors freed before it was):
        their outputs are not recorded."""
        for f in self._in_flight.values():
            self.note_unrecorded_collective(f.name)
        self._in_flight.clear()

    def note_unrecorded_collective(self, name: str) -> None:
        with self._lock:
            self._async_collectives[name] = self._async_collectives.get(name, 0) + 1

    def _measure_inputs(self, op, args, kwargs) -> list:
        """(role, index, tensor, handle) of a call's tensor arguments."""
        ins = []
        for idx, t in _flatten(args):
            h = self.measure(op, t)
            if h is not None:
                ins.append(("input", idx, t, h))
        if kwargs:
            # ``out=`` is where the op writes: what it held before is no input (often uninitialised memory)
            for idx, t in _flatten({k: v for k, v in kwargs.items() if k != "out"} if "out" in kwargs else kwargs):
                h = self.measure(op, t)
                if h is not None:
                    ins.append(("kwarg", idx, t, h))
        return ins

    def _record_call(self, op, op_type, ins, outs, start_seq, backward_op, location=None) -> list:
        """Record a finished op or module call: its inputs, its outputs and the hooks on its backward.

        Returns (index, tensor, position) of the recorded outputs, for the local error.
        """
        seq = self.take_seq()
        for role, idx, t, h in ins:
            self.add_tensor(seq, op, op_type, role, idx, t, h, location=location)
        out_recs = []
        for idx, t in outs:
            h = self.measure(op, t)
            if h is None:
                continue
            pos = self.add_tensor(seq, op, op_type, "output", idx, t, h, location=location)
            out_recs.append((idx, t, pos))
        self._backward.mark_outputs(outs, seq)
        if self.options.backward and torch.is_grad_enabled():
            # a parameter's gradient is recorded as its param_grad, not through the graph walk; a buffer gets none
            self._backward.register(backward_op, op_type,
                                    [(r, i, t) for r, i, t, _ in ins if r not in ("param", "buffer")],
                                    outs, start_seq)
        return out_recs

    def take_seq(self) -> int:
        """The next seq (execution order) of this step."""
        with self._lock:
            s = self._seq
            self._seq += 1
            return s

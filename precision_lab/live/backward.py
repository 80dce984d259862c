"""The backward pass: each op's gradients, found by walking the autograd graph from its outputs."""

from __future__ import annotations

import threading
from typing import Optional, Protocol

from .naming import remove_handles

# Bounds of the autograd-graph walk that finds an op's own gradient edges.
_MAX_WALK_NODES = 4096


class _BackwardOp:
    """One op's backward: gets its seq when its first gradient arrives."""

    __slots__ = ("op", "op_type", "seq", "step", "pending")

    def __init__(self, op, op_type, step):
        self.op, self.op_type, self.step = op, op_type, step
        self.seq = None
        self.pending = {}  # (role, index) -> [expected, arrived, sum]


class Recorder(Protocol):
    """What the backward hooks need from the capture they record for."""

    recording: bool  # this step is recorded in full
    summarising: bool  # this step is summarised for the timeline only
    step_no: int

    def take_seq(self) -> int: ...

    def measure(self, op: str, t, hold: bool = False, defer: bool = False): ...

    def add_tensor(self, seq, op, op_type, role, index, t, handle, direction="forward", step=None,
                   location=None) -> int: ...

    def summarise(self, seq, op, op_type, role, index, direction, t, location) -> None: ...

    def hook_error(self, where: str, e: BaseException) -> None: ...

    def next_name(self, path: str, opname: str) -> str: ...

    def forget(self, t) -> None: ...

    def resolve_deferred(self) -> None: ...


class BackwardHooks:
    """A capture's gradient hooks: each op's ``grad_output`` and ``grad_input`` through autograd node hooks
    registered on the step's graph as the op finishes (``register``), each parameter's ``param_grad`` after it
    is accumulated (``watch_param``).  ``timeline``: parameter gradients are summarised on every step."""

    def __init__(self, recorder: Recorder, *, timeline: bool):
        self._rec = recorder
        self._timeline = timeline
        self._lock = threading.Lock()
        # the loss scale of this backward: gradients are recorded divided by it, in fp32 (GradScaler's unscale_)
        self.grad_scale: Optional[float] = None
        self._node_birth: dict = {}  # id(autograd node) -> seq of the op that made it, this step
        self._param_owner: dict = {}  # id(parameter) -> (op, op_type, name) of the module whose backward owns it
        self._handles: list = []  # parameter hooks, for the whole capture
        self._step_handles: list = []  # node hooks on this step's graph
        # DDP's gradient all-reduce (watch_ddp): the parameters it reduces, and this backward's local gradients
        self._ddps: list = []
        self._ddp_params: set = set()
        self._ddp_local: dict = {}  # id(parameter) -> (parameter, owner op, name, handle of the local gradient)
        self._ddp_queued = False
        # gradients' statistics taken once the backward has handed every gradient over, while DDP's last
        # all-reduces are in flight (``_ddp_ready``; else when the step ends), not in the hooks
        # (``StatsEngine.measure(defer=True)``): under DDP a hook's work delays this rank's gradients, and the
        # bucket's all-reduce waits for the slowest rank.  The gradients autograd hands the hooks are kept as
        # they are (nothing writes them); a parameter's is copied, as DDP writes the all-reduced average over it
        # and accumulation adds to it
        self.defer = False

    def watch_param(self, p, op: str, op_type: str, pname: str) -> None:
        """Record parameter ``p``'s gradient as ``op``'s ``param_grad`` ``pname`` (once per parameter)."""
        if id(p) in self._param_owner or not p.requires_grad:
            return
        self._param_owner[id(p)] = (op, op_type, pname)
        self._handles.append(p.register_post_accumulate_grad_hook(self._param_grad_hook))

    def watch_ddp(self, ddps: list) -> None:
        """Record DDP's gradient all-reduce of these DistributedDataParallel modules' parameters as ops: it runs
        in DDP's C++ reducer, where no hook of the capture sees it, so each parameter's gradient is read twice --
        as accumulated on this rank (the op's input, the ``param_grad`` record) and once DDP has written the
        all-reduced average back (its output), at the end of the backward pass -- as
        ``<module>.all_reduce.<n>`` with the parameter's name as index.  A backward under ``no_sync()``
        reduces nothing and records nothing."""
        self._ddps = list(ddps)
        self._ddp_params = {id(p) for d in ddps for p in d.parameters()}
        self.defer = True

    def _note_local_grad(self, p, op, pname, h) -> None:
        if id(p) not in self._ddp_params or not all(d.require_backward_grad_sync for d in self._ddps):
            return
        self._ddp_local[id(p)] = (p, op, pname, h)
        if not self._ddp_queued:
            import torch  # already loaded: a backward pass is running

            # DDP queues its write-back when its last bucket is ready, after this hook: a callback queued now
            # runs before that one, so it takes the deferred statistics and queues the reading behind it
            # (callbacks queued while the engine runs them are run in turn)
            self._ddp_queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._ddp_ready)

    def _ddp_ready(self) -> None:
        """The backward has handed every gradient over and DDP's bucket all-reduces are under way: the
        statistics deferred so far are taken now, while the last buckets are still in flight (DDP's own
        callback, queued after this one, waits for them), then the reading of the reduced gradients is queued
        behind that callback."""
        import torch  # already loaded: a backward pass is running

        if self._rec.recording:
            try:
                self._rec.resolve_deferred()
            except Exception as e:
                self._rec.hook_error("statistics", e)
        torch.autograd.Variable._execution_engine.queue_callback(self._ddp_reduced)

    def _ddp_reduced(self) -> None:
        rec = self._rec
        local, self._ddp_local, self._ddp_queued = self._ddp_local, {}, False
        if not rec.recording:
            return
        for p, op, pname, h_local in local.values():
            try:
                g = p.grad
                if g is None:
                    continue
                path = op.rpartition(".backward.")[0]
                red = rec.next_name(path, "all_reduce")
                rec.forget(g)  # written back in place by DDP
                g = self._unscaled(g)
                h = rec.measure(red, g)
                seq = rec.take_seq()
                rec.add_tensor(seq, red, "all_reduce", "input", pname, None, h_local, "backward")
                if h is not None:
                    rec.add_tensor(seq, red, "all_reduce", "output", pname, g, h, "backward")
            except Exception as e:
                rec.hook_error(op, e)

    def mark_outputs(self, outs, seq: int) -> None:
        """Note the seq of the op that made these outputs' autograd nodes: the graph walk stops there."""
        for _, t in outs:
            gf = t.grad_fn
            if gf is not None:
                self._node_birth.setdefault(id(gf), seq)

    def new_step(self) -> None:
        self._node_birth.clear()

    def end_step(self) -> None:
        """Drop the hooks registered on this step's autograd graph."""
        remove_handles(self._step_handles)

    def remove(self) -> None:
        remove_handles(self._handles)
        remove_handles(self._step_handles)

    def register(self, op, op_type, ins, outs, start_seq) -> None:
        """Hook the backward of an op that just finished: ``ins`` (role, index, tensor), ``outs`` (index,
        tensor), ``start_seq`` the seq when it started (nodes made since are its own)."""
        nodes: dict = {}
        for idx, t in outs:
            gf = t.grad_fn
            if gf is not None and t.requires_grad:
                nodes.setdefault(gf, []).append((idx, t.output_nr))
        if not nodes:
            return
        bop = _BackwardOp(op, op_type, self._rec.step_no)
        # the edges through which this op hands gradient to its inputs
        nonleaf: dict = {}
        leaf: dict = {}
        for role, idx, t in ins:
            if not t.requires_grad:
                continue
            if t.grad_fn is not None:
                nonleaf.setdefault((id(t.grad_fn), t.output_nr), []).append((role, idx))
            elif id(t) not in self._param_owner:  # a recorded parameter's gradient is its param_grad
                leaf.setdefault(id(t), []).append((role, idx))
        # an output that is one of the inputs (x.float() on a float32 x, x.to(x.dtype))
        # passes its gradient straight through: grad_input is its grad_output
        for node, outputs in nodes.items():
            through = {}
            for oidx, nr in outputs:
                for role, idx in nonleaf.pop((id(node), nr), ()):
                    through.setdefault(oidx, []).append((role, idx))
            self._step_handles.append(node.register_prehook(self._make_grad_output_hook(bop, outputs, through)))
        if not nonleaf and not leaf:
            return
        hits: dict = {}  # node -> [(k, role, idx)]
        seen = set()
        frontier = list(nodes)
        birth = self._node_birth
        while frontier and len(seen) < _MAX_WALK_NODES:
            n = frontier.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            for k, (nx, nr) in enumerate(n.next_functions):
                if nx is None:
                    continue
                targets = nonleaf.get((id(nx), nr))
                if targets is None and not nx.next_functions and hasattr(nx, "variable"):
                    targets = leaf.get(id(nx.variable))
                if targets is not None:
                    for role, idx in targets:
                        hits.setdefault(n, []).append((k, role, idx))
                    continue
                b = birth.get(id(nx))
                if b is not None and b < start_seq:
                    continue  # made by an earlier op: outside this one
                if nx.next_functions:
                    frontier.append(nx)
        for n, lst in hits.items():
            for _, role, idx in lst:
                entry = bop.pending.setdefault((role, idx), [0, 0, None])
                entry[0] += 1
            self._step_handles.append(n.register_hook(self._make_grad_input_hook(bop, lst)))

    def _bw_seq(self, bop: _BackwardOp) -> int:
        with self._lock:
            if bop.seq is None:
                bop.seq = self._rec.take_seq()
            return bop.seq

    def _unscaled(self, g):
        """A gradient as the optimizer sees it under a loss scale: divided by the scale in fp32 (GradScaler's
        unscale_ into fp32 master gradients); the gradient itself where no loss scale is set."""
        return g if not self.grad_scale else g.float() / self.grad_scale

    def _add_grad(self, seq, bop: _BackwardOp, role, index, g, h) -> None:
        self._rec.add_tensor(seq, bop.op, bop.op_type, role, index, g, h, "backward", step=bop.step)

    def _make_grad_output_hook(self, bop, outputs, through):
        def hook(grad_outputs):
            if not self._rec.recording:
                return None
            try:
                seq = self._bw_seq(bop)
                for idx, nr in outputs:
                    g = grad_outputs[nr] if nr < len(grad_outputs) else None
                    if g is None:
                        continue
                    g = self._unscaled(g)
                    h = self._rec.measure(bop.op, g, hold=True, defer=self.defer)
                    if h is None:
                        continue
                    self._add_grad(seq, bop, "grad_output", idx, g, h)
                    for role, in_idx in through.get(idx, ()):
                        self._add_grad(seq, bop, "grad_input", in_idx if role == "input" else f"{role}_{in_idx}",
                                       g, h)
            except Exception as e:
                self._rec.hook_error(bop.op, e)
            return None

        return hook

    def _make_grad_input_hook(self, bop, lst):
        def hook(grad_inputs, grad_outputs):
            if not self._rec.recording:
                return None
            try:
                seq = self._bw_seq(bop)
                for k, role, idx in lst:
                    g = grad_inputs[k] if k < len(grad_inputs) else None
                    entry = bop.pending.get((role, idx))
                    if entry is None:
                        continue
                    entry[1] += 1
                    if g is not None:
                        entry[2] = g if entry[2] is None else entry[2] + g
                    if entry[1] < entry[0] or entry[2] is None:
                        continue
                    total = self._unscaled(entry[2])
                    entry[2] = None
                    out_idx = idx if role == "input" else f"{role}_{idx}"
                    h = self._rec.measure(bop.op, total, hold=True, defer=self.defer)
                    if h is not None:
                        self._add_grad(seq, bop, "grad_input", out_idx, total, h)
            except Exception as e:
                self._rec.hook_error(bop.op, e)
            return None

        return hook

    def _param_grad_hook(self, p) -> None:
        rec = self._rec
        if not (rec.recording or rec.summarising):
            return
        owner = self._param_owner.get(id(p))
        if owner is None or p.grad is None:
            return
        op, op_type, pname = owner
        try:
            g = self._unscaled(p.grad)
            seq = None
            if rec.recording:
                # the parameter's gradient is written later (DDP's average, the next accumulation): a copy waits
                h = rec.measure(op, g.detach().clone() if self.defer and g is p.grad else g, hold=True,
                                defer=self.defer)
                if h is not None:
                    seq = rec.take_seq()
                    rec.add_tensor(seq, op, op_type, "param_grad", pname, g, h, "backward")
                    if self._ddp_params:
                        self._note_local_grad(p, op, pname, h)
            if self._timeline:
                rec.summarise(rec.take_seq() if seq is None else seq, op, op_type, "param_grad", pname,
                              "backward", g, None)
        except Exception as e:
            rec.hook_error(op, e)

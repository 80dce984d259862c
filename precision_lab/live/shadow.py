"""Local error: each op re-run in fp32 on its own (upcast) inputs, under the same random state.

The re-runs leave the model as a plain step would: a functional op gets copies of the model's buffers (a
training-mode batch_norm updates its running statistics in place), and a module is re-run with
``torch.func.functional_call`` on a copy of its structure whose parameters and buffers live on the meta device
(no memory), given the module's own parameters (upcast copies only where they are low precision) and copies of
its buffers.  Only the parameters of the module being re-run are copied, and only while it runs.  Re-runs
happen with autocast switched off: an "fp32" re-run under autocast would compute in the autocast format.
"""

from __future__ import annotations

import contextlib
import copy
import enum

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_map

from ..formats import format_for_dtype
from ..metrics import compare
from .naming import _HOOK_DICTS, _Frame, _flatten

_LOW_FLOAT = {torch.float16, torch.bfloat16}
for _n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _n):
        _LOW_FLOAT.add(getattr(torch, _n))


_PLAIN = (torch.dtype, torch.device, torch.Size, torch.nn.Module, str, bytes, int, float, complex, bool, type(None),
          type, enum.Enum)


def _tensors_in(obj, depth: int = 0, seen=None) -> list:
    """The tensors (and modules) an argument object holds in its attributes, lists and dicts (a key/value
    cache's past keys)."""
    seen = set() if seen is None else seen
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return [obj]
    if depth > 4 or id(obj) in seen or isinstance(obj, _PLAIN) or callable(obj):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, n, None) for n in getattr(type(obj), "__slots__", ()) if isinstance(n, str)]
    return [t for v in items for t in _tensors_in(v, depth + 1, seen)]


def _upcast(obj, clone: bool, copy_ids: frozenset = frozenset()):
    """Every low-precision floating tensor (and dtype argument) of a pytree upcast to float32; other tensors
    detached (copied when ``clone``, or when their ``id`` is in ``copy_ids``: the model's buffers).

    With ``clone``, any other argument object (a ``transformers`` key/value cache) is copied, the tensors it holds
    upcast and copied alike: the op may update it, and its re-run must find it as the op did and must not update
    the one the model goes on with.  An object that cannot be copied is passed as it is."""
    def up(x):
        if isinstance(x, torch.Tensor):
            if x.dtype in _LOW_FLOAT:
                return x.detach().to(torch.float32)
            return x.detach().clone() if clone or id(x) in copy_ids else x.detach()
        if isinstance(x, torch.dtype):
            return torch.float32 if x in _LOW_FLOAT else x
        if clone and not isinstance(x, _PLAIN) and not callable(x):
            try:  # a module it refers to is shared, never copied with its parameters
                return copy.deepcopy(x, {id(t): t if isinstance(t, torch.nn.Module) else up(t)
                                         for t in _tensors_in(x)})
            except Exception:
                return x
        return x

    return tree_map(up, obj)


def _cuda_devices(obj) -> dict:
    """{device index: None} for the CUDA tensors in a nested structure."""
    out: dict = {}
    for _, t in _flatten(obj):
        if t.is_cuda:
            out[t.device.index] = None
    return out


def _rng_state_of(cuda_devices: dict):
    """(CPU generator state, {device: CUDA generator state}); neither reads device memory."""
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices}


@contextlib.contextmanager
def _exact_fp32():
    """Autocast off on every device type that has it on, so an fp32 re-run computes in fp32."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32) if t.dtype in _LOW_FLOAT else t.detach()


def with_rng(state, fn):
    """Run ``fn`` with the RNG state an op itself saw (``_rng_state_of``), then restore the current one.

    A random op (dropout) re-run in fp32 then draws the numbers the op drew,
    and the user's next random op draws what it would have without capture.
    """
    if state is None:
        return fn()
    cpu, cuda = state
    cur = _rng_state_of(cuda)
    torch.set_rng_state(cpu)
    for dev, st in cuda.items():
        torch.cuda.set_rng_state(st, dev)
    try:
        return fn()
    finally:
        torch.set_rng_state(cur[0])
        for dev, st in cur[1].items():
            torch.cuda.set_rng_state(st, dev)


class ShadowRuns:
    """The fp32 re-runs of a capture's ops, each output compared with its re-run: the local error.

    ``add_comparison(position, comparison)`` takes each output's comparison (by its record's position);
    ``warn(where, message)`` notes a problem on the run; ``shared``: objects the model's hooks refer to (the
    capture), shared by a module's re-run copy rather than copied with it.
    """

    def __init__(self, *, add_comparison, warn, shared=()):
        self._add_comparison = add_comparison
        self._warn = warn
        self._shared = tuple(shared)
        self.skeletons: dict = {}  # id(module) -> its re-run skeleton (no memory), or False, for the whole capture
        self._buffer_ids: frozenset = frozenset()

    def new_step(self, model=None) -> None:
        """A step starts: ``model``'s buffers are copied (not shared) into a functional op's re-run."""
        self._buffer_ids = frozenset(id(b) for b in model.buffers()) if model is not None else frozenset()

    def clear(self) -> None:
        self.skeletons.clear()

    def functional_inputs(self, args, kwargs, inplace: bool) -> tuple:
        """A functional op's arguments for its re-run, taken before it runs (upcast; copied where it writes)."""
        return (_upcast(args, clone=inplace, copy_ids=self._buffer_ids),
                _upcast(kwargs, clone=inplace, copy_ids=self._buffer_ids))

    def module_inputs(self, args, kwargs) -> tuple:
        """A module call's arguments for its re-run, taken before it runs (upcast copies)."""
        return _upcast(args, clone=True), _upcast(kwargs, clone=True)

    def functional(self, op, info, func, shadow, rng, out_recs) -> None:
        sargs, skwargs = shadow
        with torch.no_grad():
            if info.cast:
                first = next((t for _, t in _flatten(sargs)), None)
                if first is None:
                    return
                ref = first.to(torch.float32) if first.is_floating_point() else first
                ref_outs = {"0": ref}
            else:
                if not any(t.is_floating_point() for _, t in _flatten((sargs, skwargs))):
                    return
                with _exact_fp32():
                    ref_out = with_rng(rng, lambda: func(*sargs, **skwargs))
                ref_outs = dict(_flatten(ref_out))
        self._compare(op, ref_outs, out_recs)

    def module(self, frame: _Frame, out_recs) -> None:
        module = frame.module
        skeleton = self.skeletons.get(id(module))
        if skeleton is False:
            return
        if skeleton is None:
            skeleton = self._skeleton(frame)
            self.skeletons[id(module)] = skeleton
            if skeleton is False:
                return
        sargs, skwargs = frame.shadow_in
        with torch.no_grad():
            # the module's own parameters (fp32 copies of low-precision ones, for this call only) and copies of
            # its buffers, so running statistics are not updated twice
            params = dict(module.named_parameters())
            state = {n: _fp32_copy(p) for n, p in params.items()}
            state.update((n, b.detach().to(torch.float32) if b.dtype in _LOW_FLOAT else b.detach().clone())
                         for n, b in module.named_buffers())
            with _exact_fp32():
                ref_out = with_rng(frame.rng, lambda: functional_call(skeleton, state, sargs, skwargs))
        # a module computes in the coarsest format of its parameters, or of the autocast it was called under: an
        # fp32 output (an fp32 island inside it, a cast at its end, autocast's fp32 ops) does not make its fp16
        # arithmetic fp32's
        dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
        if frame.autocast is not None:
            dtypes.add(frame.autocast)
        self._compare(frame.op, dict(_flatten(ref_out)), out_recs, compute_dtypes=dtypes)

    def _skeleton(self, frame: _Frame):
        """A copy of the module's structure for its fp32 re-run: parameters and buffers on the meta device (the
        real ones are passed at each call), and no hooks (the user's, a policy's input casts, ours); False when
        the module cannot be copied."""
        module = frame.module
        memo = {id(o): o for o in self._shared}  # the module's hooks refer to the capture: share it, do not copy it
        for p in module.parameters():
            memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        try:
            skeleton = copy.deepcopy(module, memo)
        except Exception as e:
            self._warn(frame.op, f"local error unavailable: the module cannot be copied for its fp32 re-run "
                                 f"({type(e).__name__}: {e})")
            return False
        for m in skeleton.modules():
            for attr in _HOOK_DICTS:
                d = getattr(m, attr, None)
                if d:
                    d.clear()
        return skeleton

    def _compare(self, op, ref_outs: dict, out_recs, compute_dtypes=frozenset()) -> None:
        """Each output against its fp32 re-run, judged in the coarsest of its own format and ``compute_dtypes``."""
        for idx, t, pos in out_recs:
            ref = ref_outs.get(idx)
            if ref is None or not isinstance(ref, torch.Tensor):
                self._warn(op, f"local error: the fp32 re-run gave no output {idx}")
                continue
            if tuple(ref.shape) != tuple(t.shape):
                self._warn(op, f"local error: fp32 re-run output {idx} has shape {tuple(ref.shape)}, "
                               f"the op's has {tuple(t.shape)}")
                continue
            if not (t.is_floating_point() and ref.is_floating_point()):
                continue
            fmts = [f for f in map(format_for_dtype, {t.dtype, *compute_dtypes}) if f is not None]
            fmt = max(fmts, key=lambda f: f.eps, default=None)
            cmp = compare(ref.detach(), t.detach(), cand_format=fmt.name if fmt else None)
            self._add_comparison(pos, cmp)

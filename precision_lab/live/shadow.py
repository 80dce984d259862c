"""Local error: each op re-run in fp32 on its own (upcast) inputs, under the same random state."""

from __future__ import annotations

import copy

import torch
from torch.utils._pytree import tree_map

from ..formats import format_for_dtype
from ..metrics import compare
from .naming import _HOOK_DICTS, _Frame, _flatten

_LOW_FLOAT = {torch.float16, torch.bfloat16}
for _n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _n):
        _LOW_FLOAT.add(getattr(torch, _n))


def _upcast(obj, clone: bool):
    """Every low-precision floating tensor (and dtype argument) of a pytree upcast to float32; other tensors
    detached (copied when ``clone``)."""
    def up(x):
        if isinstance(x, torch.Tensor):
            if x.dtype in _LOW_FLOAT:
                return x.detach().to(torch.float32)
            return x.detach().clone() if clone else x.detach()
        if isinstance(x, torch.dtype):
            return torch.float32 if x in _LOW_FLOAT else x
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


class ShadowRuns:
    """Part of ``Capture``: see ``live.capture``."""

    # -- local (shadow) error
    def _local_functional(self, op, info, func, shadow, rng, out_recs) -> None:
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
                ref_out = self._with_rng(rng, lambda: func(*sargs, **skwargs))
                ref_outs = dict(_flatten(ref_out))
        self._store_local(op, ref_outs, out_recs)

    def _local_module(self, frame: _Frame, out_recs) -> None:
        module = frame.module
        shadow = self._shadow_cache.get(id(module))
        if shadow is False:
            return
        if shadow is None:
            # the module's hooks refer to this capture: share it, do not copy it
            try:
                shadow = copy.deepcopy(module, {id(self): self})
            except Exception as e:
                self._warn(frame.op, f"local error unavailable: the module cannot be copied for its fp32 re-run "
                                     f"({type(e).__name__}: {e})")
                self._shadow_cache[id(module)] = False
                return
            for t in list(shadow.parameters()) + list(shadow.buffers()):
                if t.dtype in _LOW_FLOAT:
                    t.data = t.data.to(torch.float32)
            # the copy runs the module's own forward in fp32: no hooks (the user's, a
            # policy's input casts, ours) come with it
            for m in shadow.modules():
                for attr in _HOOK_DICTS:
                    d = getattr(m, attr, None)
                    if d:
                        d.clear()
            self._shadow_cache[id(module)] = shadow
        sargs, skwargs = frame.shadow_in
        with torch.no_grad():
            ref_out = self._with_rng(frame.rng, lambda: shadow(*sargs, **skwargs))
        self._store_local(frame.op, dict(_flatten(ref_out)), out_recs)

    def _with_rng(self, state, fn):
        """Run ``fn`` with the RNG state the op itself saw, then restore the current one.

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

    def _store_local(self, op, ref_outs: dict, out_recs) -> None:
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
            fmt = format_for_dtype(t.dtype)
            cmp = compare(ref.detach(), t.detach(), cand_format=fmt.name if fmt else None)
            with self._lock:
                self.local_comparisons.append((pos, cmp))

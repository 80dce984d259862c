"""Regions compiled with torch.compile inside a captured model: found before the hooks go on, each one's
compiled call wrapped so its inputs and outputs are recorded as the compiled numbers, and the ops inside taken
from an eager re-run on the same inputs."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map_only

from .shadow import _cuda_devices, _rng_state_of, with_rng

_ORIG = "_orig_mod"  # where torch.compile(module) keeps the module it compiled


def _compiled_regions(model) -> dict:
    """id(module) -> (module, attribute) for every region compiled with torch.compile in ``model``: a module
    wrapped by ``torch.compile(module)`` (its ``forward`` is the compiled call) or compiled in place by
    ``module.compile()`` (its ``_compiled_call_impl``).  A ``forward`` replaced by a compiled function cannot be
    captured and is refused in one sentence."""
    regions, inside = {}, set()
    for path, m in model.named_modules():
        if id(m) in inside:
            continue  # a compiled module inside a compiled region is traced into the region's graph
        if isinstance(getattr(m, _ORIG, None), torch.nn.Module) and callable(m.__dict__.get("forward")):
            regions[id(m)] = (m, "forward")
        elif getattr(m, "_compiled_call_impl", None) is not None:
            regions[id(m)] = (m, "_compiled_call_impl")
        elif hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable"):
            where = f"module {path!r}" if path else "the model"
            raise ValueError(f"capture(): the forward of {where} was replaced by a function compiled with "
                             "torch.compile, whose graphs the capture cannot enter or wrap; compile the module "
                             "instead (module.compile() or torch.compile(module)) and its outputs are recorded "
                             "as compiled, with op-level detail from an eager re-run")
        else:
            continue
        inside.update(id(c) for c in m.modules() if c is not m)
    return regions


def _name_path(path: str) -> str:
    """A module's path with torch.compile's wrapper left out, so compiled and eager runs name ops alike."""
    return ".".join(p for p in path.split(".") if p != _ORIG) if _ORIG in path else path


class CompiledRegions:
    """The capture's handling of compiled regions (part of ``Capture``, on its state)."""

    def _on_compile(self, *_) -> None:
        if self._active and not getattr(self._tls, "in_region", False):
            self.warn("torch.compile", "a function compiled with torch.compile, not a compiled module, ran inside "
                                       "the capture: its ops are not recorded as compiled numbers. Compile the "
                                       "module that calls it (module.compile() or torch.compile(module)) so its "
                                       "inputs and outputs are recorded as compiled")

    def _region_call(self, module, compiled):
        """The compiled call of ``module``, wrapped: its inputs and outputs recorded as the module's own call (the
        compiled numbers), the capture's function mode off while the compiled code runs (it would be traced into
        its graphs), and an eager re-run of the module on the same inputs for the ops inside."""

        def call(*args, **kwargs):
            if not (self.recording or self.summarising) or getattr(self._tls, "busy", False):
                with self._compiled_code():
                    return compiled(*args, **kwargs)
            self._pre_hook(module, args, kwargs)
            frame = self._tls.stack[-1] if getattr(self._tls, "stack", None) else None
            if frame is not None and frame.module is module:
                frame.shadow_in = None  # the eager re-run below stands in for a local error at the boundary
            rng = _rng_state_of(_cuda_devices((args, kwargs)))
            # the inputs as the compiled call got them, for the eager re-run (compiled code may update them in place)
            eager_in = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs)) \
                if self.recording else None
            out = None
            try:
                with self._compiled_code():
                    out = compiled(*args, **kwargs)
                if eager_in is not None:
                    self._eager_detail(module, *eager_in, rng)
            finally:
                self._post_hook(module, args, kwargs, out)
            return out

        return call

    def _eager_detail(self, module, args, kwargs, rng) -> None:
        """Run a compiled region's module eagerly on the inputs the compiled call had, with the random state it
        had, under no_grad and with its buffers put back after: the ops inside are recorded from this run."""
        eager = getattr(module, _ORIG, None)
        run = eager.__call__ if eager is not None else module._call_impl
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            # eager all the way down: compiled modules inside the region run eagerly too
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                with_rng(rng, lambda: run(*args, **kwargs))
        except Exception as e:
            self.warn(self._module_paths.get(id(module), "?"),
                      f"the eager re-run for the ops inside this compiled region failed ({type(e).__name__}: {e})")
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    @contextlib.contextmanager
    def _compiled_code(self):
        """While a compiled region's code runs (and compiles): the capture's function mode popped (when it is
        the innermost mode), and the thread marked as inside a region for ``_on_compile``."""
        mode = self._mode
        pop = mode is not None and torch.overrides._get_current_function_mode() is mode
        if pop:
            mode.__exit__(None, None, None)
        self._tls.in_region = True
        try:
            yield
        finally:
            self._tls.in_region = False
            if pop:
                mode.__enter__()

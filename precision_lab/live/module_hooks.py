"""Module hooks: each module call recorded through forward pre/post hooks (inputs and keyword inputs at entry,
parameters and floating-point buffers once per step as the module reads them, outputs at exit)."""

from __future__ import annotations

import torch

from ..formats import format_for_dtype
from .naming import _Frame, _backward_name, _flatten
from .shadow import _cuda_devices, _rng_state_of
from .where import user_location

def _autocast_dtype(device: str):
    """The dtype ``torch.autocast`` computes in on ``device`` now, None where it is off."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class ModuleHooks:
    """The capture's module hooks (part of ``Capture``, on its state)."""

    def _module_of(self, module):
        """(path, op_type, scope_ok, record) of a hooked module, or None for one added after install."""
        got = self._module_info.get(id(module))
        if got is None:
            path = self._module_paths.get(id(module))
            if path is None:
                return None
            op_type = type(module).__name__
            scope_ok = self.options.module_selected(path)
            got = (path, op_type, scope_ok, scope_ok and self.options.op_type_selected(op_type))
            self._module_info[id(module)] = got
        return got


    def _root_pre_hook(self, module, args, kwargs):
        """The model's own forward begins: the autocast it runs under and, for a replay, the state it starts
        from."""
        if torch.compiler.is_compiling() or not self._active or getattr(self._tls, "busy", False) \
                or module is not self.model:  # a copy an fp32 re-run made carries this hook too
            return None
        try:
            p = next(module.parameters(), None)
            device = p.device.type if p is not None else "cpu"
            on = _autocast_dtype(device)
            fmt = format_for_dtype(on) if on is not None else None
            if fmt is not None and self.autocast_seen is None:
                self.autocast_seen = fmt.name
            if self._kit is not None:
                model = self._user_model[0] if self._user_model is not None else self.model
                self._kit.begin(self.step_no, model, args, kwargs, fmt.name if fmt is not None else None)
        except Exception as e:
            self.hook_error("replay", e)
        return None

    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # a module inside a compiled region, being traced: nothing to do
            return None
        tls = self._tls
        if not (self.recording or self.summarising) or getattr(tls, "busy", False):
            return None
        if getattr(tls, "stack", None) is None:
            tls.stack = []  # a forward run in another thread than the one that entered the capture
        tls.busy = True
        try:
            got = self._module_of(module)
            if got is None:
                return None
            path, op_type, scope_ok, record = got
            op = self._next_name(path, "forward") if record else path
            frame = _Frame(module, path, op, op_type, scope_ok, record, self._seq)
            tls.stack.append(frame)
            if not record:
                return None
            if self.options.locations:
                frame.location = user_location(1)
            if not self.recording:  # a summary step: the module's output only
                frame.inputs = []
                return None
            ins = self._measure_inputs(op, args, kwargs)
            if self.options.params and id(module) not in self._params_done:
                self._params_done.add(id(module))
                self._measure_params(op, module, ins)
            frame.inputs = ins
            if self.options.local_error:
                frame.shadow_in = self._shadow.module_inputs(args, kwargs)
                devs = _cuda_devices((args, kwargs))
                devs.update(_cuda_devices(list(module.parameters())))
                frame.rng = _rng_state_of(devs)
                frame.autocast = getattr(module, "_precision_lab_autocast_dtype",  # a policy's, entered after this
                                         _autocast_dtype("cuda" if devs else "cpu"))
        except Exception as e:
            self.hook_error(self._module_paths.get(id(module), "?"), e)
        finally:
            tls.busy = False
        return None

    def _measure_params(self, op: str, module, ins: list) -> None:
        """Add the module's own parameters and floating-point buffers to ``ins``, as it reads them on entry (once
        per step)."""
        for pname, p in module.named_parameters(recurse=False):
            h = self.measure(op, p)
            if h is not None:
                ins.append(("param", pname, p, h))
        for bname, b in module.named_buffers(recurse=False):
            # floating buffers (running statistics, rotary frequencies) feed the op like parameters;
            # an empty one is a marker (a policy module's format), integer ones are counters
            if not b.is_floating_point() or b.numel() == 0:
                continue
            h = self.measure(op, b)
            if h is not None:
                ins.append(("buffer", bname, self._buffer_as_read(op, b), h))

    def _buffer_as_read(self, op: str, b: torch.Tensor) -> torch.Tensor:
        """The buffer as the module reads it on entry, for what uses the tensor itself after the call (a kept
        tensor, a paired run's comparison): a copy when something will, since the module may update it in place
        (BatchNorm's running statistics in training); its statistics were taken already."""
        if self.observer is None and not (self.options.keep_tensors and self.options.keep_selected(op)):
            return b
        return b.detach().clone()

    def _post_hook(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return None
        tls = self._tls
        if getattr(tls, "busy", False):
            return None
        stack = getattr(tls, "stack", None)
        if not stack:
            return None
        # pop up to this module's frame (a child that raised leaves its frame behind);
        # a module without a frame (added after the capture started) leaves the stack alone
        at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].module is module), None)
        if at is None:
            return None
        frame = stack[at]
        del stack[at:]
        if frame is None or not frame.record or frame.inputs is None or not (self.recording or self.summarising):
            return None
        tls.busy = True
        try:
            op = frame.op
            outs = list(_flatten(output))
            if self.recording:
                out_recs = self._record_call(op, frame.op_type, frame.inputs, outs, frame.start_seq,
                                             _backward_name(op), frame.location)
                if frame.shadow_in is not None and out_recs:
                    self._shadow.module(frame, out_recs)
                seq = self._seq - 1
            else:
                seq = self.take_seq()
            if self.options.timeline:
                for idx, t in outs:
                    self.summarise(seq, op, frame.op_type, "output", idx, "forward", t, frame.location)
        except Exception as e:
            self.hook_error(frame.op, e)
        finally:
            tls.busy = False
        return None

"""What a precision policy changes in a model, kept so a capture can put the user's model back."""

from __future__ import annotations

import torch

class ModelState:
    """What a precision policy changes in a model, kept to be put back: every module's attributes (its dicts of
    parameters, buffers, children and hooks, its ``eps``, its mode), each parameter's tensor and gradient.  A
    capture under a policy leaves the user's model as it found it: its dtypes, values, modules, hooks and modes."""

    _DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")

    def __init__(self, model: torch.nn.Module):
        self.modules = []
        for mod in model.modules():
            attrs = dict(mod.__dict__)
            for key in self._DICTS:
                if isinstance(attrs.get(key), dict):
                    attrs[key] = type(attrs[key])(attrs[key])
            params = [(p, p.data, p.grad) for p in mod._parameters.values() if p is not None]
            self.modules.append((mod, attrs, params))

    def restore(self) -> None:
        for mod, attrs, params in self.modules:
            for key in [k for k in mod.__dict__ if k not in attrs]:
                del mod.__dict__[key]
            mod.__dict__.update(attrs)
            for p, data, grad in params:
                p.data, p.grad = data, grad

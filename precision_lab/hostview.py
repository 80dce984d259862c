"""A CPU tensor's values as a numpy array over the same memory, leaving the tensor's storage as it was.

``Tensor.numpy()`` marks the tensor's storage non-resizable for as long as it lives.  Code that frees or grows
storages in place then fails: FSDP frees each unsharded parameter with ``untyped_storage().resize_(0)`` after the
module's forward, so statistics read through ``.numpy()`` during a capture stopped every FSDP model with "Trying to
resize storage that is not resizable".  An observer must leave the tensors it reads as it found them: DLPack
shares the memory without that mark.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["host_view"]


def host_view(t) -> np.ndarray:
    """The values of a CPU tensor (no autograd history) as a numpy array sharing its memory, without marking its
    storage.  Anything but a plain tensor or parameter goes through ``.numpy()``, which refuses tensor subclasses
    (a DTensor's own memory is not its values: DLPack would hand out that memory), and so does a dtype DLPack
    does not carry."""
    torch = sys.modules.get("torch")
    if torch is not None and type(t) in (torch.Tensor, torch.nn.Parameter):
        if t.is_neg() or t.is_conj():  # a lazy negation or conjugate: DLPack would hand out the memory as it is
            t = t.resolve_neg().resolve_conj()
        try:
            return np.from_dlpack(t)
        except (TypeError, BufferError, RuntimeError):
            pass
    return t.numpy()

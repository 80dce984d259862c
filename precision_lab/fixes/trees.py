"""Trees of tensors as models take and give them: one cast of every floating tensor, one call, the first tensor.

``torch`` is imported inside each function: policies are built and described without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

__all__ = ["cast_floating", "call_model", "first_tensor"]


def cast_floating(tree, tdtype):
    """Every floating tensor in a pytree (tuples, namedtuples, lists, dicts, registered containers) cast to
    ``tdtype``; everything else as it is."""
    import torch  # deferred: policies are built and described without torch
    from torch.utils._pytree import tree_map_only

    # a tensor already in ``tdtype`` is passed as it is: no cast op for a capture to record
    return tree_map_only(torch.Tensor, lambda t: t.to(tdtype) if t.is_floating_point() and t.dtype != tdtype else t,
                         tree)


def call_model(model, inputs) -> object:
    """``model`` called on ``inputs`` as recipes and captures give them: a dict is keyword arguments, a tuple or
    list positional ones, anything else the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def first_tensor(output) -> Optional["torch.Tensor"]:
    """The first tensor of a model's output (the output itself, a tuple's first, a Hugging Face ModelOutput's
    logits or last hidden state), or None."""
    import torch  # deferred: see cast_floating
    from torch.utils._pytree import tree_leaves

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput: its fields in order, Nones left out
        output = output.to_tuple()
    return next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)

"""The op vocabulary: canonical op types and the names they go by, and how op names nest in module paths.

Dumps and captures name one op many ways: msprobe keys (``Functional.layer_norm.0.forward``,
``Tensor.__truediv__.0.forward``), torch functions and methods (``softmax``, ``__truediv__``), aten
overloads (``aten._softmax.default``, ``aten::native_layer_norm``) and module classes (``LayerNorm``).
``canonical(name)`` maps any of them to one op type; replay, diagnosis and the readers all ask it.  The op
categories are defined here too, once: ops that write a mask or a constant (``MASKING_OPS``, ``CONSTANT_OPS``)
and the calls capture does not record by default or at all (``VIEW_OPS``, ``NON_COMPUTE_OPS``).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

__all__ = ["OPS", "MASKING_OPS", "CONSTANT_OPS", "VIEW_OPS", "NON_COMPUTE_OPS", "MSPROBE_PREFIXES", "canonical", "parse_op", "is_msprobe_key", "op_type_of", "module_path", "enclosing_module", "aliases_of", "module_prefixes", "innermost_module"]

# canonical op type -> the other names it goes by (compared case-insensitively, leading/trailing "_" ignored);
# an alias is listed only where it computes the same function with the same arguments
OPS: dict[str, tuple[str, ...]] = {
    "linear": ("Linear",),  # not addmm: its arguments come in another order
    "matmul": ("mm", "bmm", "MatMul", "aten::mm", "aten::bmm"),
    "layer_norm": ("LayerNorm", "layernorm"),
    "rms_norm": ("RMSNorm", "rmsnorm", "Qwen2RMSNorm", "LlamaRMSNorm", "T5LayerNorm"),
    "softmax": ("Softmax", "_softmax", "safe_softmax"),
    "gelu": ("GELU", "GELUActivation"),  # not NewGELUActivation: the tanh approximation
    "silu": ("SiLU", "SiLUActivation"),
    "relu": ("ReLU",),
    "exp": (),
    "rsqrt": (),
    "sqrt": (),
    "log": (),
    "pow": ("__pow__", "square"),
    "reciprocal": ("Reciprocal",),
    "add": ("__add__", "__radd__", "Add", "iadd"),
    "sub": ("__sub__", "subtract"),
    "mul": ("__mul__", "__rmul__", "Mul", "multiply"),
    "div": ("__truediv__", "truediv", "divide", "true_divide"),
    "quantise": ("FakeQuant", "quantize", "fake_quant"),
    "cumsum": ("cumsum_",),
    # ops that write a mask's -inf (or finfo.min) on purpose
    "masked_fill": ("MaskedFill", "masked_fill_"),
    "where": (),
    "full": ("full_like", "new_full"),
    "fill": ("fill_", "fill_diagonal"),
    "triu": (),
    "tril": (),
    # constants made from Python numbers (``torch.tensor(float("-inf"))`` as a mask's fill value)
    "tensor": ("scalar_tensor", "as_tensor"),
}

# canonical op types whose -inf output is not an error by itself: a mask written on purpose, or log's exact
# log(0) = -inf (log gives -inf for 0 and nothing else; T5's position buckets take log(0) and discard it)
MASKING_OPS = frozenset({"masked_fill", "where", "full", "fill", "triu", "tril", "log"})
# canonical op types that make a tensor from Python numbers: a -inf they hold is a constant, no error by itself
CONSTANT_OPS = frozenset({"tensor"})

# collectives: what one rank gets from the others.  An output that is non-finite from finite inputs is a value
# another rank made (the capture records torch.distributed's calls and functional collectives under these names)
COLLECTIVE_OPS = frozenset({"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                            "all_gather", "reduce_scatter", "all_to_all_single", "all_gather_tensor",
                            "all_to_all", "wait_tensor", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
                            "reduce_scatter_tensor_coalesced", "send", "recv"})

# calls, by the name capture gives them (a torch function's or a tensor method's), whose output values are a
# rearrangement or subset of their input's (views, reshapes, indexing, splitting, detaching): they cannot
# introduce error or a non-finite value, so capture does not record them by default (the data flows through
# them to the next op, which is).  Casts are NOT here: a cast is where precision is lost.
VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "transpose_", "t", "permute", "contiguous",
    "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select",
    "getitem", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "movedim", "moveaxis",
    "swapaxes", "swapdims", "detach", "detach_", "as_strided", "unfold", "clone", "squeeze_", "unsqueeze_",
    "requires_grad_", "retain_grad", "broadcast_to", "mT", "mH", "T", "H", "real", "imag", "view_as_real",
    "view_as_complex", "diagonal", "stack", "cat", "concat", "concatenate", "hstack", "vstack", "repeat",
    "repeat_interleave", "tile", "roll", "flip", "gather", "index_select", "masked_select", "take",
})

# calls, by the name capture gives them, that compute nothing from tensor values (metadata, conversions to
# Python, autograd plumbing): capture skips them before any statistics are taken
NON_COMPUTE_OPS = frozenset({
    "size", "dim", "numel", "item", "tolist", "is_floating_point", "is_complex", "data_ptr", "element_size",
    "stride", "storage_offset", "is_contiguous", "__len__", "__bool__", "__index__", "__int__", "__float__",
    "__format__", "__repr__", "__str__", "__iter__", "__contains__", "__hash__", "__reduce_ex__",
    "__deepcopy__", "__array__", "numpy", "cpu_numpy", "backward", "register_hook", "retain_grad",
    "register_post_accumulate_grad_hook", "untyped_storage", "storage", "get_device", "nelement",
    "has_names", "is_set_to", "is_same_size", "__dir__", "__getstate__", "__setstate__", "_is_view",
    "is_nonzero", "equal", "allclose", "__array_wrap__", "dim_order", "pin_memory", "share_memory_",
    "record_stream", "is_pinned", "is_shared", "nbytes", "itemsize", "new_empty", "new_zeros", "new_ones",
    "new_tensor", "empty_like", "zeros_like", "ones_like", "empty",
})  # full_like and new_full are recorded: they write a mask's -inf (MASKING_OPS)

_BY_NAME = {a.lower().strip("_"): op for op, aliases in OPS.items() for a in (op,) + aliases}


def _key(name: str) -> str:
    s = name.strip()
    s = re.sub(r"^aten(::|\.)", "", s)  # aten::mm, aten.mm.default
    s = re.sub(r"\.(default|Tensor|Scalar|int|out|self)$", "", s)
    return s.lower().strip("_")


def canonical(name: Optional[str]) -> Optional[str]:
    """The canonical op type of a name (``__truediv__`` -> ``div``, ``aten._softmax.default`` -> ``softmax``,
    ``LayerNorm`` -> ``layer_norm``), or None for a name the table does not know."""
    if not name:
        return None
    return _BY_NAME.get(name.lower().strip("_")) or _BY_NAME.get(_key(name))


def aliases_of(op: str) -> tuple[str, ...]:
    """The names a canonical op type goes by."""
    return OPS[op]


def module_prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b", "a.b.c"]``: every module path an op name lies in, outermost first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def innermost_module(op: str, modules: Iterable[str]) -> Optional[str]:
    """The longest of ``modules`` that is ``op`` or a path ``op`` lies in, else None."""
    best = None
    for m in modules:
        if m and (op == m or op.startswith(m + ".")) and (best is None or len(m) > len(best)):
            best = m
    return best


# the first part of an msprobe data key: the API family it hooked (torch on GPU/NPU, MindSpore)
MSPROBE_PREFIXES = frozenset({"Functional", "Torch", "Tensor", "Module", "Aten", "NPU", "Distributed", "VF", "Jit",
                              "Mint", "MintFunctional", "Primitive"})
_DIRECTIONS = ("forward", "backward")


def parse_op(key: str) -> tuple[str, str]:
    """``(op_type, direction)`` of an msprobe data key: ``Functional.linear.3.forward`` -> ``("linear",
    "forward")``, ``Module.blocks.0.fc1.Linear.backward.0`` -> ``("Linear", "backward")``."""
    parts = key.split(".")
    if parts[0] == "Module":
        for i in range(len(parts) - 1, 0, -1):
            if parts[i] in ("forward", "backward", "parameters_grad"):
                direction = "forward" if parts[i] == "forward" else "backward"
                return (parts[i - 1] if i >= 2 else "Module"), direction
        return (parts[-1] if len(parts) > 1 else "Module"), "forward"
    direction = parts[-1] if parts[-1] in _DIRECTIONS else "forward"
    body = parts[1:-1] if parts[-1] in _DIRECTIONS else parts[1:]
    if body and body[-1].isdigit():
        body = body[:-1]
    op_type = ".".join(body).strip("_") if body else parts[0]
    return op_type or parts[0], direction


def is_msprobe_key(name: str) -> bool:
    head, dot, rest = name.partition(".")
    return bool(dot and rest) and head in MSPROBE_PREFIXES


def op_type_of(op: str) -> str:
    """The op type a dump's op name carries: an msprobe key's (``parse_op``), else the last part that is not a
    call number (``blocks.0.fc1`` -> ``fc1``, ``attn.softmax.2`` -> ``softmax``)."""
    if is_msprobe_key(op):
        return parse_op(op)[0]
    for p in reversed(op.split(".")):
        if p and not p.isdigit():
            return p
    return op


_MSPROBE_MODULE = re.compile(r"^Module\.(.+)\.[A-Za-z_]\w*\.(?:forward|backward)\.\d+$")
_CALL = re.compile(r"^(?:(.*)\.)?(?:forward|backward)\.\d+$")


def module_path(op: str) -> str:
    """The module path an op call stands for: msprobe's ``Module.blocks.0.fc.Linear.forward.0`` ->
    ``blocks.0.fc``; a capture's ``blocks.0.fc.forward.0`` -> ``blocks.0.fc`` and the root's ``forward.0`` ->
    ``""``; any other name (a dump's module path, a functional op) is its own path."""
    m = _MSPROBE_MODULE.match(op)
    if m:
        return m.group(1)
    m = _CALL.match(op)
    return (m.group(1) or "") if m else op


_FUNC_CALL = re.compile(r"^(?:(.*)\.)?[A-Za-z_]\w*\.\d+$")  # a capture's "<module path>.<function>.<n>"


def enclosing_module(op: str, parent: Optional[str] = None) -> str:
    """The module an op call belongs to: a module call's own path; a functional op's module by the dump's
    nesting (``parent``), else by a capture's name (``blocks.0.attn.softmax.0`` -> ``blocks.0.attn``); an
    msprobe API call without nesting belongs to the root (``""``); any other name (a dump's module path)
    is its own."""
    path = module_path(op)
    if path != op:
        return path
    if parent:
        return module_path(parent)
    head, dot, _ = op.partition(".")
    if dot and head in MSPROBE_PREFIXES:  # Module.* was a module call above
        return ""
    m = _FUNC_CALL.match(op)
    return (m.group(1) or "") if m else op

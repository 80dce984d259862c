"""A policy applied to a model (``PrecisionPolicy.prepare``), and the hooks that reach modules that are not
policy-aware.

``prepare_model`` swaps ``torch.nn.Linear`` layers for ``QuantLinear`` under fp8 fake quantisation, casts each
module's own parameters and buffers to its format (``islands.module_formats``), lets each ``PolicyModule`` read
its options, and hooks every other module that holds a floating tensor: its inputs cast on entry, its output
sanitised where asked; where an fp32 island's output meets the compute format, operands are cast; under an
autocast policy ``torch.autocast`` runs around the model and each island.  Each hook is kept on the module under
a ``_precision_lab_*`` attribute, and installing one again replaces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import FORMATS
from .catalogue import model_edits
from .islands import PolicyError, holds_floating, module_formats, module_matches, no_match
from .modules import PolicyModule, QuantLinear, sanitize_nonfinite
from .trees import cast_floating

__all__ = ["prepare_model", "check_patterns", "EPS_ATTRS", "eps_attrs", "install_cast_hook", "install_sanitize_hook",
           "install_island_boundary", "ISLAND_MEETING_OPS", "install_autocast"]


def prepare_model(policy, model):
    """Cast and configure ``model`` in place for ``policy`` (a ``PrecisionPolicy``), then let each of its fixes
    that edits the model itself (``catalogue.model_edits``) do so; returns it.  PolicyError when an override or
    sanitize pattern names no module."""
    model = _prepare_autocast(policy, model) if policy.autocast is not None else _prepare(policy, model)
    for fix in model_edits(policy):
        fix.definition.prepare(model, fix.value)
    return model


def _prepare(policy, model):
    if policy.quant is not None:
        _quantise_linears(model, policy.quant)
    named = list(model.named_modules())
    # every path a module is registered at (a module used twice is named twice)
    fmts = module_formats(policy, model)[0] if policy.overrides else None
    check_patterns(policy, model)
    for name, mod in named:
        fmt = fmts[name] if fmts is not None else policy.dtype
        tdtype = FORMATS[fmt].torch_dtype()
        _cast_own(mod, tdtype)
        if isinstance(mod, PolicyModule):
            mod.configure(policy, name)
        else:
            if policy.eps is not None:
                _floor_eps(mod, policy, fmt)
            if holds_floating(mod):
                install_cast_hook(mod, tdtype)
        if name and policy.sanitizes(name) and not isinstance(mod, PolicyModule):
            install_sanitize_hook(mod)
    if fmts is not None and len(set(fmts.values())) > 1:
        # islands in another format than the rest: where their outputs meet it, the operands are cast
        install_island_boundary(model)
    if policy.compile is not None:
        _compile(policy, model, named)
    return model


def _compile(policy, model, named) -> None:
    """``torch.compile`` of the whole model, or of the outermost modules ``policy.compile`` matches (a block's own
    children run inside its compiled graph)."""
    matched = [n for n, _ in named if n and module_matches(n, policy.compile)]
    outer = [n for n in matched if not any(n.startswith(o + ".") for o in matched)]
    targets = [model] if policy.compile == "model" else [model.get_submodule(n) for n in outer]
    if not targets:
        names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
        raise PolicyError(no_match(policy.compile, names, "compile"))
    # in place (Module.compile): module paths, and so op names, stay those of the eager model
    options = {"emulate_precision_casts": True} if policy.emulate_precision_casts else None
    for m in targets:
        m.compile(options=options)


def check_patterns(policy, model) -> None:
    """PolicyError when an override or sanitize pattern of ``policy`` names no module of ``model`` (every path a
    module is registered at: a module used twice is named twice)."""
    names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    for pattern, _ in policy.overrides:
        if not any(module_matches(n, pattern) for n in names):
            raise PolicyError(no_match(pattern, names, "keep-fp32"))
    for pattern in policy.sanitize:
        if not any(module_matches(n, pattern) for n in names):
            raise PolicyError(no_match(pattern, names, "sanitize-nonfinite"))


def _prepare_autocast(policy, model):
    """``torch.autocast`` in ``policy.autocast`` around the model's forward; each override an autocast island."""
    check_patterns(policy, model)
    install_autocast(model, policy.autocast)
    for name, mod in model.named_modules():
        if not name:
            continue
        fmt, parent = policy.override_for(name), policy.override_for(name.rpartition(".")[0])
        if fmt is not None and fmt != parent:  # the outermost module of an island
            install_autocast(mod, fmt)
        if policy.sanitizes(name):
            install_sanitize_hook(mod)
    return model


# where normalisations keep their epsilon: torch's LayerNorm, GroupNorm, BatchNorm, RMSNorm (``eps``) and
# transformers' RMSNorms (``variance_epsilon``, or ``eps``)
EPS_ATTRS = ("eps", "variance_epsilon")


def eps_attrs(mod) -> list[str]:
    """The epsilon attributes of a module a policy's ``eps`` raises: numbers, or None (torch's RMSNorm then
    uses its format's machine epsilon)."""
    out = []
    for a in EPS_ATTRS:
        v = getattr(mod, a, "absent")
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            out.append(a)
    return out


def _floor_eps(mod, policy, fmt: str) -> None:
    for attr in eps_attrs(mod):
        cur = getattr(mod, attr)
        setattr(mod, attr, policy.eps_for(FORMATS[fmt].eps if cur is None else cur))


def _quantise_linears(model, quant) -> None:
    """Every ``torch.nn.Linear`` of ``model`` becomes a ``QuantLinear`` over the same parameters (same module
    path, same parameter objects), so fp8 fake quantisation reaches a user's model the way torchao's float8
    recipes swap linears; PolicyError when the model has none (a run is never labelled with a format it did not
    use)."""
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = QuantLinear(1, 1, bias=child.bias is not None)
                q.weight = child.weight
                q.bias = child.bias
                q.in_features, q.out_features = child.in_features, child.out_features
                setattr(parent, child_name, q)
                swapped += 1
    if not swapped and not any(isinstance(m, QuantLinear) for m in model.modules()):
        raise PolicyError(f"the {quant.format} preset quantises torch.nn.Linear layers, and this model has none "
                          f"(e.g. GPT-2's Conv1D is not one); use a compute format (fp16, bf16) instead")


def _cast_own(mod, tdtype) -> None:
    """Cast a module's own floating parameters and buffers (not its children's)."""
    for key, p in mod._parameters.items():
        if p is not None and p.is_floating_point() and p.dtype != tdtype:
            p.data = p.data.to(tdtype)
    for key, b in mod._buffers.items():
        if b is not None and b.is_floating_point() and b.dtype != tdtype:
            mod._buffers[key] = b.to(tdtype)


def install_cast_hook(mod: nn.Module, dtype) -> None:
    """Cast floating inputs to ``dtype`` before ``mod`` runs (autocast-like); replaces an earlier one."""
    old = getattr(mod, "_precision_lab_cast_hook", None)
    if old is not None:
        old.remove()

    def cast(m, args, kwargs):
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    mod._precision_lab_cast_hook = mod.register_forward_pre_hook(cast, with_kwargs=True)


# ops that take no operands of two floating dtypes (``expected scalar type Float but found Half``), where an fp32
# island's output meets the compute format: their operands are brought to the wider of the two first, as
# elementwise ops promote by themselves (an island's values go on in fp32 until a module casts them)
ISLAND_MEETING_OPS = frozenset({
    torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.addbmm, torch.einsum, torch.bilinear,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm, torch.Tensor.bmm,
    F.linear, F.scaled_dot_product_attention, F.conv1d, F.conv2d, F.conv3d, F.layer_norm, F.group_norm,
    F.embedding,
})


class _IslandBoundary(torch.overrides.TorchFunctionMode):
    """Operands of an ``ISLAND_MEETING_OPS`` op in two floating dtypes are cast to their promoted dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ISLAND_MEETING_OPS:
            from torch.utils._pytree import tree_leaves

            dts = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dts) > 1:
                wide = dts.pop()
                for d in dts:
                    wide = torch.promote_types(wide, d)
                args, kwargs = cast_floating((args, kwargs), wide)
        return func(*args, **kwargs)


def _around_forward(mod: nn.Module, attr: str, make, cast_to=None) -> None:
    """The context ``make(args, kwargs)`` gives entered as ``mod``'s forward starts and left as it ends (an error
    raised in it too), nested calls nested; ``cast_to``: the floating inputs cast to that dtype on entry.  The
    hooks are kept in ``mod.<attr>``, and replace earlier ones there."""
    for h in getattr(mod, attr, None) or ():
        h.remove()
    stack: list = []

    def enter(m, args, kwargs):
        ctx = make(args, kwargs)
        ctx.__enter__()
        stack.append(ctx)
        return None if cast_to is None else (cast_floating(args, cast_to), cast_floating(kwargs, cast_to))

    def leave(m, args, kwargs, out):
        if stack:
            stack.pop().__exit__(None, None, None)

    setattr(mod, attr, (mod.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
                        mod.register_forward_hook(leave, with_kwargs=True, always_call=True)))


def install_island_boundary(model: nn.Module) -> None:
    """While ``model`` runs, where an fp32 island's output meets the compute format in an op that cannot mix them
    (a matmul of an fp32 key with an fp16 query), the operands are cast to the wider dtype
    (``ISLAND_MEETING_OPS``) instead of the run failing."""
    _around_forward(model, "_precision_lab_island_boundary", lambda args, kwargs: _IslandBoundary())


def install_autocast(mod: nn.Module, fmt: str) -> None:
    """``torch.autocast`` in format ``fmt`` (``fp16``, ``bf16``) around ``mod``'s forward, on the device of its
    first floating tensor (of its parameters, else of its inputs); ``fp32``: autocast off there, and the
    module's floating inputs cast to fp32 (an autocast island).  Replaces an earlier one."""
    from torch.utils._pytree import tree_leaves

    dtype = FORMATS[fmt].torch_dtype()

    def device_of(args, kwargs) -> str:
        for t in list(mod.parameters()) + [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]:
            if t.is_floating_point():
                return t.device.type
        return "cpu"

    _around_forward(mod, "_precision_lab_autocast",
                    lambda args, kwargs: torch.autocast(device_of(args, kwargs), dtype=dtype, enabled=fmt != "fp32"),
                    cast_to=torch.float32 if fmt == "fp32" else None)
    # what a capture's hooks (which may run before these) read as the dtype the module computes in
    mod._precision_lab_autocast_dtype = None if fmt == "fp32" else dtype


def install_sanitize_hook(mod: nn.Module) -> None:
    """Replace NaN/Inf in ``mod``'s tensor output (registered before capture hooks, which then see it)."""
    if getattr(mod, "_precision_lab_sanitize_hook", None) is not None:
        return

    def clean(m, args, out):
        if isinstance(out, torch.Tensor):
            return sanitize_nonfinite(out)
        if isinstance(out, tuple):
            return tuple(sanitize_nonfinite(o) if isinstance(o, torch.Tensor) else o for o in out)
        return None

    mod._precision_lab_sanitize_hook = mod.register_forward_hook(clean)

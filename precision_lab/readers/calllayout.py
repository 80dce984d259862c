"""How the tensors of a generic folder are named after the module calls they belong to: files or containers
holding one call (``CALL_KEYS``), calls one level down in a container, a folder per call, the call numbers
file names begin with, and the op, role and index a tensor name stands for."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from .base import natural_key
from .tensorfile import CONTAINERS
from ..ops import is_msprobe_key, op_type_of, parse_op
from ..records import GRAD_ROLES, INPUT_ROLES, ROLES, split_tensor_name

# how hook writers name the tensors of one module call in one file (a key, ``_<i>`` or ``.<i>`` after it for
# the position): the role each name stands for
CALL_KEYS = {"input": "input", "inputs": "input", "args": "input", "x": "input",
             "output": "output", "outputs": "output", "out": "output", "y": "output",
             "grad_input": "grad_input", "grad_inputs": "grad_input",
             "grad_output": "grad_output", "grad_outputs": "grad_output"}
_CALL_KEY = re.compile(r"(?P<head>[A-Za-z_]+?)(?:_(?P<i>\d+))?(?:\.(?P<rest>.+))?$")


def _call_layout(keys: list[str], positions: bool = False) -> Optional[dict[str, str]]:
    """key -> ``<role>.<i>`` for a file holding one module call: ``{"input": x, "output": y}`` and the other
    names of ``CALL_KEYS`` (``np.savez``, ``torch.save`` of a dict, ``safetensors``), or with ``positions`` (a
    ``.pt``) ``torch.save((args, out))``; None for any other content.  It needs a key of a role other than
    ``input`` (an output, or a gradient)."""
    found = {k: _CALL_KEY.match(k) for k in keys}
    if keys and all(m and m["head"].lower() in CALL_KEYS for m in found.values()):
        roles = {k: CALL_KEYS[m["head"].lower()] for k, m in found.items()}
        named = {k: f"{roles[k]}.{'.'.join(x for x in (m['i'], m['rest']) if x) or 0}" for k, m in found.items()}
        if any(r != "input" for r in roles.values()) and len(set(named.values())) == len(named):
            return named
    if not positions:
        return None
    heads = {k: k.split(".", 1) for k in keys}
    # (args, out): positions only ("0.<i>", "1" or "1.<j>"), never a Sequential's state dict ("0.weight")
    if heads and all(h[0] in ("0", "1") and (h[0] == "1" or len(h) > 1)
                     and (len(h) == 1 or h[1].split(".")[0].isdigit()) for h in heads.values()) and any(
            h[0] == "1" for h in heads.values()):
        return {k: f"{'input' if h[0] == '0' else 'output'}.{h[1] if len(h) > 1 else 0}" for k, h in heads.items()}
    return None


# a call number at the start of a file's name ("000-", "001_", "12.") before the rest of it
_CALL_NUMBER = re.compile(r"(\d+)[-_.](?=.)")
UNNUMBERED_SHARE = 0.1  # of a folder's data files that may lack a call number when the others give the order


def call_folders(files: list[Path]) -> dict[Path, str]:
    """file -> ``<role>.<i>`` for the files of a folder that holds one module call: every data file in it named
    as a role (``CALL_KEYS``), an input and an output among them (``003_fc/input.npy``, ``003_fc/output.npy``:
    the folder is the module).  A folder holding ``output.npy`` alone may be a module named ``output``
    (``attention/output.npy``): not taken."""
    by_dir: dict[Path, list[Path]] = {}
    for p in files:
        by_dir.setdefault(p.parent, []).append(p)
    out: dict[Path, str] = {}
    for group in by_dir.values():
        # a .pt is a container only when it holds one; named as a role, it holds that role's tensor
        if any(p.suffix.lower() in CONTAINERS and p.suffix.lower() not in (".pt", ".pth") for p in group):
            continue
        stems = [p.name[: -len(p.suffix)] for p in group]
        layout = _call_layout(stems)
        roles = {v.split(".")[0] for v in (layout or {}).values()}
        if layout and roles & set(INPUT_ROLES) and "output" in roles:
            out.update({p: layout[stem] for p, stem in zip(group, stems)})
    return out


def nested_calls(keys: list[str]) -> dict[str, str]:
    """key -> ``<module>.<role>.<i>`` for the keys of one container that hold module calls one level down:
    ``torch.save({name: {"input": x, "output": y}})`` flattens to ``<name>.input`` and ``<name>.output``.  Only
    a module whose keys are all role names (``CALL_KEYS``), an input and an output among them, is taken: a
    module named ``output`` beside others (BERT's ``attention.output``) is left as it is."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        head, _, last = k.rpartition(".")
        groups.setdefault(head, []).append(last)
    out: dict[str, str] = {}
    for head, lasts in groups.items():
        if not head:
            continue
        layout = _call_layout(lasts)
        roles = {v.split(".")[0] for v in (layout or {}).values()}
        if layout and roles & set(INPUT_ROLES) and "output" in roles:
            out.update({f"{head}.{k}": f"{head}.{v}" for k, v in layout.items()})
    return out


def call_numbers(files: list[Path], folders: Optional[dict[Path, str]] = None) -> dict[Path, int]:
    """file -> the call number its name begins with, for the folders whose data files (every one, or all but
    ``UNNUMBERED_SHARE`` of them) begin with one, each number naming one op and each op one number: a hook
    that counts its calls (``f"{n:03d}-{name}.npz"``).  A file of a folder holding one call (``folders``,
    ``call_folders``) takes the number its folder's name begins with (``003_fc/output.npy``).  ``layer10`` or
    a Sequential's ``0.weight`` beside ``0.bias`` (two names, one number) are no call numbers."""
    folders = folders or {}
    by_dir: dict[Path, list[Path]] = {}
    named: dict[Path, str] = {}  # file -> the name its number is read from
    for p in files:
        unit = p.parent if p in folders else p
        named[p] = unit.name if p in folders else p.name[: -len(p.suffix)]
        by_dir.setdefault(unit.parent, []).append(p)
    out: dict[Path, int] = {}
    for group in by_dir.values():
        found = {p: m for p in group if (m := _CALL_NUMBER.match(named[p]))}
        units = {p.parent if p in folders else p for p in group}
        if len(found) < 2 or len(units) - len({p.parent if p in folders else p for p in found}) > int(
                UNNUMBERED_SHARE * len(units)):
            continue
        ops: dict[int, set] = {}
        numbers: dict[str, set] = {}
        for p, m in found.items():
            op = named[p] if p in folders else _record_fields(named[p])["op"]  # "000-fc.output.0", "000-fc": "000-fc"
            ops.setdefault(int(m[1]), set()).add(op)
            numbers.setdefault(op, set()).add(int(m[1]))
        if all(len(v) == 1 for v in ops.values()) and all(len(v) == 1 for v in numbers.values()):
            out.update({p: int(m[1]) for p, m in found.items()})
    return out


_ROOT_ROLE = frozenset(ROLES) - {"tensor"}


def _record_fields(name: str) -> dict:
    split = split_tensor_name(name)
    head, _, tail = name.partition(".")
    if split:
        op, role, index = split
    elif head in _ROOT_ROLE and tail and "." not in tail:
        op, role, index = "", head, tail  # the root module, saved without a name
    else:
        op, role, index = name, "tensor", "0"
    parts = op.split(".")
    backward = role in GRAD_ROLES or "backward" in parts
    if is_msprobe_key(op):
        backward = parse_op(op)[1] == "backward" or role in GRAD_ROLES
    numbered = _CALL_NUMBER.match(op)  # a call number the name begins with is no part of its type: "005-softmax"
    return {"op": op, "role": role, "index": index, "op_type": op_type_of(op[numbered.end():] if numbered else op),
            "direction": "backward" if backward else "forward"}


def _file_calls(p: Path, items: list, lone_container: bool) -> tuple[list, Optional[dict[str, str]], dict[str, str]]:
    """``(items, layout, nested)`` of data file ``p`` read as ``(key, tensor)`` pairs: ``layout`` the keys of a
    file holding one module call (``_call_layout``; its inputs then come first, as the call received them),
    ``nested`` the keys of a container holding calls one level down (``nested_calls``)."""
    layout = _call_layout([k for k, _ in items], p.suffix.lower() in (".pt", ".pth")) if \
        p.suffix.lower() in CONTAINERS and not lone_container else None
    if layout is not None:  # inputs first, as the call received them
        items.sort(key=lambda kv: (layout[kv[0]].split(".")[0] not in INPUT_ROLES, natural_key(layout[kv[0]])))
    nested = nested_calls([k for k, _ in items]) if layout is None and p.suffix.lower() in CONTAINERS else {}
    return items, layout, nested


def _tensor_name(p: Path, key: str, prefix: str, folders: dict[Path, str], layout: Optional[dict[str, str]],
                 nested: dict[str, str], lone_container: bool) -> str:
    """The name of the tensor under ``key`` of data file ``p`` (``""``: the file is the tensor)."""
    if key == "" and p in folders:  # "003_fc/output.npy": the output of the call "003_fc"
        stem = p.name[: -len(p.suffix)]
        parent = prefix[: -len(stem)].rstrip(".")
        return f"{parent}.{folders[p]}" if parent else folders[p]
    if key == "":
        return prefix
    if layout is not None:
        return f"{prefix}.{layout[key]}"
    # a key's "/" separates module names as a folder's does ("model/layers/1/mlp")
    dotted = nested.get(key, key).replace("/", ".")
    return dotted if lone_container else f"{prefix}.{dotted}"

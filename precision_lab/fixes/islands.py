"""Which modules of a model a name pattern reaches, which share tensors, and what an fp32 island changes.

A pattern (``fnmatch``) names a module by its full path or any dotted suffix (``down_proj`` matches
``layers.0.mlp.down_proj``).  Modules that share a parameter or buffer (the same tensor object, or tensors over
the same storage: an embedding and an LM head with tied weights) compute in one format, because one tensor has
one dtype: an override reaching any of them covers its partners too (the latest override among them wins).
``tied_groups`` finds them, ``module_formats`` gives each module its format under a policy, and
``island_effect`` says what an override changes (nothing, for modules holding no floating parameter or buffer,
whose inputs a policy does not cast).  ``PrecisionPolicy`` (``policy``) asks these; they read a policy's
``dtype`` and ``overrides`` only.  ``PolicyError`` (a pattern that names no module, a format a module cannot
compute in) is defined here, under both.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional, Protocol

__all__ = ["Formats", "PolicyError", "COMPUTE_FORMATS", "check_compute", "module_matches", "ancestors", "override_at",
           "no_match", "holds_floating", "tied_groups", "module_formats", "IslandEffect", "island_effect",
           "IslandEffects", "island_effects"]


class Formats(Protocol):
    """What these functions read of a policy (a ``policy.PrecisionPolicy``): its default format and its
    ``(pattern, format)`` overrides, later ones winning."""

    dtype: str
    overrides: tuple[tuple[str, str], ...]


# formats a module can compute in: the ones torch runs arithmetic in on CPU
COMPUTE_FORMATS = ("fp32", "fp16", "bf16")


class PolicyError(ValueError):
    """A policy (or a fix applied to one) cannot be used; the message says why."""


def check_compute(fmt: str, what: str) -> None:
    if fmt not in COMPUTE_FORMATS:
        raise PolicyError(f"{what} {fmt!r} is not a compute format; use one of {', '.join(COMPUTE_FORMATS)}")


def module_matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names module ``name`` itself (full name or a dotted suffix)."""
    if not any(c in pattern for c in "*?["):  # a literal name: the same test without fnmatch's translation
        return name == pattern or name.endswith("." + pattern)
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def ancestors(name: str) -> list[str]:
    """``'a.b.c'`` -> ``['a', 'a.b', 'a.b.c']`` (the module and every parent)."""
    if not name:
        return [""]
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def override_at(policy: Formats, module_name: str) -> int:
    """The position of the last override of ``policy`` matching the module or a parent, -1 when none does."""
    chain = [n for n in ancestors(module_name) if n]
    at = -1
    for i, (pattern, _) in enumerate(policy.overrides):
        if any(module_matches(n, pattern) for n in chain):
            at = i
    return at


def no_match(pattern: str, names: list[str], fix: str) -> str:
    shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
    return f"{fix}: pattern {pattern!r} matches no module of this model (modules: {shown})"


def own_tensors(mod):
    """(kind, name, tensor) of a module's own parameters and buffers (not its children's), Nones left out."""
    for key, p in mod._parameters.items():
        if p is not None:
            yield "parameter", key, p
    for key, b in mod._buffers.items():
        if b is not None:
            yield "buffer", key, b


def holds_floating(mod) -> bool:
    """Whether a module has a floating parameter or buffer of its own: what a policy casts, and what makes it
    cast its inputs."""
    return any(t.is_floating_point() for _, _, t in own_tensors(mod))


def _storage_key(t):
    """What identifies the memory a tensor lives in (device and storage address), None for a tensor without
    memory (meta, empty)."""
    try:
        if t.device.type == "meta":
            return None
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # a tensor subclass without storage
        return None
    return (str(t.device), ptr) if ptr else None


class _Ties:
    """Which modules of a model share a parameter or buffer (the same tensor object, or tensors over the same
    storage), over every path a module is registered at; one module at two paths shares everything with itself."""

    def __init__(self, model):
        self.paths: dict = {}  # module id -> its paths, in named_modules order
        self.modules: dict = {}  # module id -> module
        for path, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), []).append(path)
            self.modules[id(m)] = m
        seen: dict = {}  # tensor id or storage key -> (module id, "path.name")
        self.links: dict = {}  # (module id a, module id b), a first seen -> "path.name" of a tensor they share
        for mid, m in self.modules.items():
            for _, key, t in own_tensors(m):
                label = f"{self.paths[mid][0]}.{key}" if self.paths[mid][0] else key
                for k in (("id", id(t)), ("storage", _storage_key(t))):
                    if k[1] is None:
                        continue
                    got = seen.get(k)
                    if got is None:
                        seen[k] = (mid, label)
                    elif got[0] != mid:
                        self.links.setdefault((got[0], mid), got[1])
        parent = {mid: mid for mid in self.paths}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for x, y in self.links:
            parent[find(x)] = find(y)
        self.group = {mid: find(mid) for mid in self.paths}  # module id -> its group's representative
        self.members: dict = {}  # group representative -> its module ids
        for mid, g in self.group.items():
            self.members.setdefault(g, []).append(mid)
        self.owner = {p: mid for mid, ps in self.paths.items() for p in ps}  # path -> module id
        self.children: dict = {}  # path -> the paths directly under it
        self.suffixes: dict = {}  # dotted suffix -> the paths ending with it ("c", "b.c", "a.b.c" for "a.b.c")
        for p in self.owner:
            if not p:
                continue
            self.children.setdefault(p.rsplit(".", 1)[0] if "." in p else "", []).append(p)
            parts = p.split(".")
            for i in range(len(parts)):
                self.suffixes.setdefault(".".join(parts[i:]), []).append(p)

    def reached(self, pattern: str) -> list:
        """The paths an override ``pattern`` reaches: the modules it names (``module_matches``) and every path
        under them, in no particular order."""
        if any(c in pattern for c in "*?["):
            named = [p for p in self.owner if p and module_matches(p, pattern)]
        else:  # a literal name: its dotted-suffix index, no scan
            named = list(self.suffixes.get(pattern, ()))
        out, seen, stack = [], set(), named
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            out.append(p)
            stack.extend(self.children.get(p, ()))
        return out

    def via(self, a, b) -> str:
        """A tensor ``a`` shares with ``b`` (directly when they do, else one ``a`` shares with its group)."""
        got = self.links.get((a, b)) or self.links.get((b, a))
        if got is None:
            got = next(v for (x, y), v in self.links.items() if a in (x, y))
        return got

    def formats(self, policy: Optional[Formats], own_at: dict) -> tuple[dict, dict]:
        """(path -> format, partner path -> (format, island path, shared tensor)) given each module's latest
        override position (``own_at``: module id -> index into ``policy.overrides``, -1 for none): a tied group
        takes the format of the latest override reaching any of its modules."""
        if policy is None:
            return {p: None for ps in self.paths.values() for p in ps}, {}
        best: dict = {}
        for mid, at in own_at.items():
            g = self.group[mid]
            if g not in best or at > best[g][0]:
                best[g] = (at, mid)
        fmt_of, moved = {}, {}
        for mid, ps in self.paths.items():
            at, src = best[self.group[mid]]
            fmt = policy.overrides[at][1] if at >= 0 else policy.dtype
            own = policy.overrides[own_at[mid]][1] if own_at[mid] >= 0 else policy.dtype
            for p in ps:
                fmt_of[p] = fmt
                if src != mid and fmt != own:
                    moved[p] = (fmt, self.paths[src][0] or "the model", self.via(mid, src))
        return fmt_of, moved

    def own_at(self, policy: Formats) -> dict:
        """Module id -> the position of the latest override of ``policy`` reaching any of its paths (-1: none)."""
        return {mid: max(override_at(policy, p) for p in ps) for mid, ps in self.paths.items()}


def tied_groups(model) -> dict:
    """Module path -> the other module paths that share a parameter or buffer with it (the same tensor object, or
    tensors over the same storage), for the modules that share any.  GPT-2 with tied embeddings gives
    ``{'transformer.wte': ['lm_head'], 'lm_head': ['transformer.wte']}``.  Sharing is transitive (a tensor shared
    by three modules ties all three); a module registered at two paths is tied to itself under the other path."""
    ties = _Ties(model)
    members: dict = {}
    for mid, ps in ties.paths.items():
        members.setdefault(ties.group[mid], []).extend(ps)
    out = {}
    for group in members.values():
        if len(group) < 2:
            continue
        for p in group:
            out[p] = [q for q in group if q != p]
    return out


def module_formats(policy: Optional[Formats], model) -> tuple[dict, dict]:
    """(path -> the format ``prepare`` gives the module, partner path -> (format, island path, shared tensor) for
    each module whose format comes from a tied module's override rather than its own name).  ``policy`` None:
    every format None, nothing moves."""
    ties = _Ties(model)
    return ties.formats(policy, ties.own_at(policy) if policy is not None else {})


@dataclass(frozen=True)
class IslandEffect:
    """What an override (``keep-fp32:<pattern>``) does to one model under one policy.

    ``modules``: the paths the pattern reaches by name (the matches and their children); ``partners``: modules
    outside them that move too, because they share a parameter or buffer with one inside (tied weights), with
    that tensor; ``tensors``: ``<module path>.<name>`` of each floating parameter or buffer whose format
    changes (each tensor once).  The override changes the model exactly when ``tensors`` is not empty: a
    module's inputs are cast by the policy only when it holds a floating parameter or buffer, so an island
    holding none computes in whatever format its inputs arrive in, as before."""

    pattern: str
    fmt: str
    modules: tuple
    partners: tuple  # ((partner path, island path, shared tensor), ...)
    tensors: tuple

    @property
    def changes(self) -> bool:
        return bool(self.tensors)

    @property
    def note(self) -> str:
        """The tied modules that move with the island, as a sentence ("" when none)."""
        if not self.partners:
            return ""
        parts = [f"{p} (shares {via} with {isl})" for p, isl, via in self.partners]
        return (f"the island also runs {', '.join(parts)} in {self.fmt}: tied tensors have one dtype, so the "
                "modules sharing them move together")

    @property
    def reason(self) -> str:
        """Why the override changes nothing (when it does not), else the note."""
        if self.changes:
            return self.note
        spec = f"keep-{self.fmt}:{self.pattern}" if self.fmt == "fp32" else f"{self.pattern}={self.fmt}"
        if not self.modules:
            return f"{spec} reaches no module"
        return (f"{spec} changes nothing: the modules it reaches ({', '.join(self.modules[:6])}"
                f"{' ...' if len(self.modules) > 6 else ''}) hold no floating parameter or buffer whose format it "
                "changes, and the policy casts the inputs only of modules that hold one: they compute in the "
                "format their inputs arrive in")


def island_effect(model, pattern: str, policy: Optional[Formats] = None, *, fmt: str = "fp32",
                  _ties: Optional[_Ties] = None, _before: Optional[dict] = None) -> IslandEffect:
    """What adding the override ``(pattern, fmt)`` to ``policy`` changes in ``model`` (see ``IslandEffect``).

    With ``policy`` None the question is structural: does the island (the modules the pattern reaches and their
    tied partners) hold any floating parameter or buffer at all.  ``PolicyError`` when the pattern names no
    module.  This is the one rule for "this island changes nothing": the fix listing (``services.applicable``)
    and whatever offers an island (the diagnosis rules) should both ask it."""
    check_compute(fmt, f"override {pattern!r}: format")
    ties = _ties if _ties is not None else _Ties(model)
    before = _before if _before is not None else _formats_now(ties, policy, fmt)
    reached = ties.reached(pattern)
    if not reached:
        raise PolicyError(no_match(pattern, [p for p in ties.owner if p], "keep-fp32"))
    # the new override is the policy's last: every module it reaches, and every module tied to one, takes ``fmt``
    inside = {ties.owner[p] for p in reached}
    source = {}  # group -> a module of the island in it
    for mid in inside:
        source.setdefault(ties.group[mid], mid)
    changed = [mid for g in source for mid in ties.members[g] if before[ties.paths[mid][0]] != fmt]
    partners = tuple((p or "the model", ties.paths[source[ties.group[mid]]][0] or "the model",
                      ties.via(mid, source[ties.group[mid]]))
                     for mid in changed if mid not in inside for p in ties.paths[mid])
    tensors, seen = [], set()
    for mid in sorted(changed, key=lambda m: ties.paths[m][0]):
        path = ties.paths[mid][0]
        for _, key, t in own_tensors(ties.modules[mid]):
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                tensors.append(f"{path}.{key}" if path else key)
    return IslandEffect(pattern, fmt, tuple(sorted(reached)), partners, tuple(tensors))


def _formats_now(ties: _Ties, policy: Optional[Formats], fmt: str) -> dict:
    """Each path's format under ``policy``; without one, judged against a run in another format than ``fmt``:
    every floating tensor an island in ``fmt`` reaches would change."""
    if policy is None:
        other = "fp16" if fmt != "fp16" else "fp32"
        return {p: other for ps in ties.paths.values() for p in ps}
    return ties.formats(policy, ties.own_at(policy))[0]


@dataclass(frozen=True, slots=True)
class IslandEffects:
    """``IslandEffect`` of each of several patterns on one model under one policy (``island_effects``)."""

    by_pattern: dict  # pattern -> IslandEffect

    def get(self, pattern: str) -> Optional[IslandEffect]:
        return self.by_pattern.get(pattern)


def island_effects(model, patterns, policy: Optional[Formats] = None, *, fmt: str = "fp32") -> IslandEffects:
    """``island_effect`` of each pattern, the model's ties and the policy's formats worked out once."""
    ties = _Ties(model)
    before = _formats_now(ties, policy, fmt)
    return IslandEffects({p: island_effect(model, p, policy, fmt=fmt, _ties=ties, _before=before)
                          for p in patterns})

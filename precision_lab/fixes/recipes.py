"""Recipes: server-side Python that builds a model and its inputs, reproducibly.

Built-in recipes reproduce known low-precision failures (see ``RECIPES``);
each fails under its ``default_policy`` and passes under the fixes listed in
``fixes``.  Users add recipes the same way the built-ins are added, with
``register_recipe``, or by naming Python objects on the server in the
environment variable ``PRECISION_LAB_RECIPES="pkg.mod:fn,other.mod:RECIPE"``:
each entry is a ``Recipe``, or a callable returning a ``Recipe``, a list of
them, or None (when it called ``register_recipe`` itself).  Recipes are never
read from uploaded files.

A user's own model becomes a recipe through entry points
(``entry_point_recipe``: ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``
for the model, its inputs and optionally a loss), as ``precision-lab capture
--model ... --inputs ...`` does.  The session records them in the recipe's
name; they are run again only when given again on the command line, listed
in ``PRECISION_LAB_MODELS`` by whoever configures the server, or recorded by
this user's own ``capture --model`` for a dashboard this user serves on
localhost (``precision_lab.allowed``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..allowed import allowed_entry_points
from ..formats import FORMATS
from ..registry import DuplicateName, Registry
from .policy import PrecisionPolicy, QuantConfig

__all__ = ["Recipe", "RecipeError", "RecipeNotFound", "RECIPES", "BUILTIN_RECIPES", "register_recipe", "get_recipe",
           "list_recipes", "load_user_recipes", "RECIPES_ENV", "BUILD_LOCK", "MODELS_ENV", "MODEL_PREFIX",
           "entry_point_recipe", "load_entry_point", "EntryPoints", "parse_entry_point_recipe", "allowed_models",
           "trust_user_models"]

RECIPES_ENV = "PRECISION_LAB_RECIPES"

# a build reseeds torch's global generator: builds (and the captures around
# them) run one at a time, or two threads would draw from each other's seed.
# Loading a model's entry points holds it too: a package that replaces itself
# in sys.modules while it is first imported (``transformers``) hands a second
# thread importing it at the same time its module from before the swap, which
# lacks the package's lazily imported names
BUILD_LOCK = threading.RLock()


class RecipeError(ValueError):
    """A recipe cannot be registered or loaded; the message names it."""


class RecipeNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "recipe not found"


@dataclass(frozen=True)
class Recipe:
    """A reproducible model + inputs and the low-precision policy under which it fails.

    ``build_fn()`` returns ``(model, inputs)``: a fresh fp32 model and a
    tensor (or tuple of tensors) to call it with; ``build()`` runs it under a
    fixed seed without disturbing the caller's random state.  ``fixes`` are
    specs known to make the failure go away (most direct first);
    ``tolerance_db`` is the output SQNR against the fp32 reference that a
    fixed run reaches.  ``loss_fn(output) -> scalar`` enables a backward pass.
    """

    name: str
    description: str
    build_fn: Callable[[], tuple[Any, Any]]
    default_policy: PrecisionPolicy
    seed: int = 0
    loss_fn: Optional[Callable] = None
    # ``optimizer_fn(parameters) -> torch.optim.Optimizer`` and ``steps``: with a loss, each run trains for
    # ``steps`` steps on the same inputs (a gradient's effect on the weights and the optimizer's state is seen)
    optimizer_fn: Optional[Callable] = None
    steps: int = 1
    fixes: tuple[str, ...] = ()
    tolerance_db: float = 20.0
    failure: str = "nonfinite"  # what the default policy shows: "nonfinite" or "accuracy"
    nonfinite_in_reference: bool = False  # the fp32 reference itself produces NaN/Inf
    tags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise RecipeError(f"recipe name {self.name!r} must be non-empty with no spaces")
        if not callable(self.build_fn):
            raise RecipeError(f"recipe {self.name!r}: build_fn is not callable")
        if self.steps < 1 or (self.steps > 1 and (self.optimizer_fn is None or self.loss_fn is None)):
            raise RecipeError(f"recipe {self.name!r}: {self.steps} step(s) need a loss_fn and an optimizer_fn")
        if not isinstance(self.default_policy, PrecisionPolicy):
            raise RecipeError(f"recipe {self.name!r}: default_policy must be a PrecisionPolicy")

    def build(self):
        """``(model, inputs)`` built under this recipe's seed; the model is fp32 and in eval mode."""
        import torch

        with BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model, inputs = self.build_fn()
        if not isinstance(model, torch.nn.Module):
            raise RecipeError(f"recipe {self.name!r}: build_fn returned {type(model).__name__}, not a torch module")
        model.eval()
        return model, inputs

    def build_model(self):
        return self.build()[0]

    def inputs(self):
        return self.build()[1]


RECIPES = Registry("recipe", group="precision_lab.recipes", name_of=lambda r: r.name)
_USER_LOADED: set[str] = set()


def register_recipe(recipe: Recipe, *, replace: bool = False) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"register_recipe expects a Recipe, got {type(recipe).__name__}")
    try:
        return RECIPES.register(recipe.name, recipe, replace=replace)
    except DuplicateName as e:
        raise RecipeError(str(e)) from None


def load_user_recipes(spec: Optional[str] = None) -> list[str]:
    """Register the recipes named in ``$PRECISION_LAB_RECIPES`` (or ``spec``); returns their names."""
    spec = os.environ.get(RECIPES_ENV, "") if spec is None else spec
    names = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        mod_name, sep, attr = entry.partition(":")
        if not sep or not mod_name or not attr:
            raise RecipeError(f"{RECIPES_ENV} entry {entry!r} must look like 'package.module:function'")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise RecipeError(f"{RECIPES_ENV} entry {entry!r}: cannot import {mod_name!r} ({e})") from None
        obj = getattr(mod, attr, None)
        if obj is None:
            raise RecipeError(f"{RECIPES_ENV} entry {entry!r}: module {mod_name!r} has no attribute {attr!r}")
        if not isinstance(obj, Recipe):
            if not callable(obj):
                raise RecipeError(f"{RECIPES_ENV} entry {entry!r} is neither a Recipe nor callable")
            obj = obj()
        found = [] if obj is None else ([obj] if isinstance(obj, Recipe) else list(obj))
        for r in found:
            if not isinstance(r, Recipe):
                raise RecipeError(f"{RECIPES_ENV} entry {entry!r} returned {type(r).__name__}, not a Recipe")
            if r.name in RECIPES and RECIPES[r.name] is not r and entry not in _USER_LOADED:
                raise RecipeError(f"{RECIPES_ENV} entry {entry!r}: a recipe named {r.name!r} is already registered")
            RECIPES.register(r.name, r, replace=True)
            names.append(r.name)
        _USER_LOADED.add(entry)
    return names


def _ensure_user_recipes() -> None:
    spec = os.environ.get(RECIPES_ENV, "")
    pending = [e.strip() for e in spec.split(",") if e.strip() and e.strip() not in _USER_LOADED]
    if pending:
        load_user_recipes(",".join(pending))


def get_recipe(name: str) -> Recipe:
    """A registered recipe by name (user recipes from ``$PRECISION_LAB_RECIPES`` included; a model entry point's
    recipe when ``$PRECISION_LAB_MODELS`` allows its model)."""
    _ensure_user_recipes()
    r = RECIPES.get(name)
    if r is None and name.startswith(MODEL_PREFIX):
        eps = parse_entry_point_recipe(name)
        allowed = allowed_models()
        # every function the recipe would run must be listed: a session names its inputs and loss too
        if not set(eps.values()) <= allowed:
            raise RecipeNotFound(
                f"this session was captured from the model entry point {eps.model!r}; entry points named by a "
                f"session are never run on their own: pass --model {eps.model} --inputs {eps.inputs}"
                + (f" --loss {eps.loss}" if eps.loss else "")
                + f" on the command line, or list every one of them in {MODELS_ENV} on the server"
                + ("" if _TRUST_USER[0] else " (a dashboard you start on localhost runs the models you captured "
                                             "from the command line)"))
        r = register_recipe(entry_point_recipe(eps.model, eps.inputs, eps.loss), replace=True)
    if r is None:
        raise RecipeNotFound(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}")
    return r


# ---- a user's model, named by entry points ------------------------------------------------

MODEL_PREFIX = "model:"
MODELS_ENV = "PRECISION_LAB_MODELS"  # model entry points this server may run for re-runs from the dashboard
_TRUST_USER = [False]  # whether this process also runs the entry points of this user's allow-list


def trust_user_models(on: bool) -> None:
    """Whether the entry points this user recorded (``precision_lab.allowed``) may run in this process, beside
    ``$PRECISION_LAB_MODELS``: set by a dashboard this user serves on localhost, never by a shared server."""
    _TRUST_USER[0] = bool(on)


def allowed_models() -> set[str]:
    """The model entry points this process may run for a session that names them: ``$PRECISION_LAB_MODELS``,
    and, where ``trust_user_models`` said so, this user's allow-list."""
    allowed = {_normalise(e) for e in os.environ.get(MODELS_ENV, "").split(",") if e.strip()}
    return allowed | allowed_entry_points() if _TRUST_USER[0] else allowed


def _normalise(spec: str) -> str:
    """``FILE.py:FUNCTION`` with the file made absolute; ``package.module:FUNCTION`` as given."""
    spec = spec.strip()
    target, sep, fn = spec.rpartition(":")
    if not sep or not target or not fn or not fn.isidentifier():
        raise RecipeError(f"entry point {spec!r} must look like FILE.py:FUNCTION or package.module:FUNCTION")
    if target.endswith(".py"):
        target = os.path.abspath(target)
    return f"{target}:{fn}"


def load_entry_point(spec: str) -> Callable:
    """The function an entry point names: ``FILE.py:FUNCTION`` (the file is imported as a module) or
    ``package.module:FUNCTION``.  Only ever called with entry points given by whoever runs the command or
    configures the server, never with one read from a session or an upload."""
    spec = _normalise(spec)
    target, _, fn = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            import importlib.util

            if not os.path.isfile(target):
                raise RecipeError(f"entry point {spec!r}: no file {target}")
            mod_name = "precision_lab_user_" + "".join(c if c.isalnum() else "_" for c in target)
            folder = os.path.dirname(os.path.abspath(target))
            if folder not in sys.path:  # its own imports find the modules beside it, as `python FILE.py` would
                sys.path.insert(0, folder)
            loader = importlib.util.spec_from_file_location(mod_name, target)
            mod = importlib.util.module_from_spec(loader)
            with BUILD_LOCK:  # the user's imports, one thread at a time (see BUILD_LOCK)
                loader.loader.exec_module(mod)
        else:
            with BUILD_LOCK:
                mod = importlib.import_module(target)
    except RecipeError:
        raise
    except Exception as e:  # the user's own module failed to import: say where
        raise RecipeError(f"entry point {spec!r}: importing {target} failed ({type(e).__name__}: {e})") from None
    obj = getattr(mod, fn, None)
    if not callable(obj):
        raise RecipeError(f"entry point {spec!r}: {target} has no function {fn!r}")
    return obj


def entry_point_recipe(model: str, inputs: str, loss: Optional[str] = None, *, dtype: str = "fp16",
                       seed: int = 0) -> Recipe:
    """A recipe for a user's model: ``model`` returns a fresh fp32 ``nn.Module``, ``inputs`` what to call it with
    (a tensor, a tuple of positional arguments or a dict of keyword arguments), ``loss`` (optional) maps the
    output to a scalar for a backward pass.  Its name records the entry points, so the session it makes can be
    re-run when the same entry points are given again."""
    eps = EntryPoints(_normalise(model), _normalise(inputs), _normalise(loss) if loss else None)
    name = MODEL_PREFIX + "|".join(f"{k}={v}" for k, v in eps.pairs())
    if any(c.isspace() for c in name):
        raise RecipeError(f"entry points {', '.join(eps.values())}: paths with spaces cannot name a session's model")
    model_fn, inputs_fn = load_entry_point(eps.model), load_entry_point(eps.inputs)
    loss_fn = load_entry_point(eps.loss) if loss else None
    return Recipe(name, f"the model built by {eps.model}, called on {eps.inputs}",
                  lambda: (model_fn(), inputs_fn()), PrecisionPolicy(dtype, dtype), seed=seed, loss_fn=loss_fn,
                  tags=("model",))


@dataclass(frozen=True, slots=True)
class EntryPoints:
    """The entry points an entry-point recipe's name records: ``model`` builds the model, ``inputs`` gives what
    it is called with, ``loss`` (optional) maps its output to a scalar.  Shown as ``{'model': ..., ...}``."""

    model: str
    inputs: str
    loss: Optional[str] = None

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """``(key, entry point)`` of each one given, in the order a recipe's name lists them."""
        return (("model", self.model), ("inputs", self.inputs)) + ((("loss", self.loss),) if self.loss else ())

    def values(self) -> tuple[str, ...]:
        return tuple(v for _, v in self.pairs())

    def __str__(self) -> str:
        return str(dict(self.pairs()))


def parse_entry_point_recipe(name: str) -> EntryPoints:
    """The ``EntryPoints`` an entry-point recipe's name records (nothing is imported)."""
    if not name.startswith(MODEL_PREFIX):
        raise RecipeError(f"{name!r} is not a model entry point recipe")
    out = {}
    for part in name[len(MODEL_PREFIX):].split("|"):
        k, sep, v = part.partition("=")
        if not sep or k not in ("model", "inputs", "loss") or not v:
            raise RecipeError(f"{name!r} is not a model entry point recipe")
        out[k] = v
    if "model" not in out or "inputs" not in out:
        raise RecipeError(f"{name!r} is not a model entry point recipe")
    return EntryPoints(**out)


def list_recipes() -> list[Recipe]:
    _ensure_user_recipes()
    return [RECIPES[k] for k in sorted(RECIPES)]


# ---- built-in recipes -----------------------------------------------------------

@dataclass(frozen=True)
class _Deferred:
    """A builder named ``module:function``, imported when first called: the built-in models need torch,
    listing recipes does not."""

    target: str

    def __call__(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)()


# Models are small (a few thousand parameters) so each runs in well under a
# second on CPU; weights that make the failure happen are set explicitly and
# the reason is written next to them.

_F16 = FORMATS["fp16"]


def _builtin() -> list[Recipe]:
    return _fp8_recipes() + _fp16_recipes()


def _fp8_recipes() -> list[Recipe]:
    """The built-in recipes that fail in fp8 quantisation: its scales and its calibration."""
    return [
        Recipe(
            "fp8-zero-scale",
            "fp16 -> fp8 e5m2 per-tensor quantisation of a ReLU output holding zeros, scale computed in fp16: "
            "amax / e5m2 max is subnormal in fp16, its reciprocal overflows to inf, and 0 x inf = NaN.",
            _Deferred("precision_lab.fixes.recipe_models:build_fp8_zero_scale"),
            PrecisionPolicy("fp16-fp8-e5m2-fp16-scale", "fp16",
                            quant=QuantConfig("fp8_e5m2", "tensor", "fp16", weights=False)),
            seed=11, fixes=("scale-fp32", "amax-floor:1"), tolerance_db=12.0,
            tags=("fp8", "scale"),
        ),
        Recipe(
            "calibration-nan",
            "An L2 normalisation divides an all-zero padding row by its norm (0/0 = NaN) in fp32 itself; "
            "histogram calibration of the next fp8 layer then fails (torch.histc: range is not finite) and "
            "every scale becomes NaN. The producer is the normalisation, not the calibration.",
            _Deferred("precision_lab.fixes.recipe_models:build_calibration_nan"),
            PrecisionPolicy("fp32-fp8-e4m3-histogram", "fp32",
                            quant=QuantConfig("fp8_e4m3fn", "tensor", "fp32", calibration="histogram")),
            seed=12, fixes=("eps:1e-6", "sanitize-nonfinite:norm"), tolerance_db=15.0,
            nonfinite_in_reference=True, tags=("fp8", "calibration"),
        ),
        Recipe(
            "fp8-rowwise-rmsnorm",
            "RMSNorm, then a Linear with row-wise fp8 e4m3fn fake quantisation and fp16 scales: an all-zero "
            "(padding) row has amax 0, scale 0, reciprocal inf and 0 x inf = NaN; a tiny row's scale "
            "underflows fp16.",
            _Deferred("precision_lab.fixes.recipe_models:build_fp8_rowwise_rmsnorm"),
            PrecisionPolicy("fp16-fp8-e4m3-row-fp16-scale", "fp16",
                            quant=QuantConfig("fp8_e4m3fn", "row", "fp16")),
            seed=13, fixes=("scale-fp32+amax-floor:1e-12", "amax-floor:0.0078125"), tolerance_db=15.0,
            tags=("fp8", "rowwise"),
        ),
    ]


def _fp16_recipes() -> list[Recipe]:
    """The built-in recipes that fail in fp16 arithmetic: overflow, flush-to-zero and cancellation."""
    ln_max = math.log(_F16.max)
    return [
        Recipe(
            "fp16-mlp-overflow",
            f"A Qwen2-like SwiGLU decoder layer with bf16-scale outlier channels: the down projection's output "
            f"reaches ~78,000, beyond fp16's max {_F16.max:,.0f}, so fp16 gives inf and the final RMSNorm NaN. "
            "bf16, or an fp32 island from down_proj to the next norm, fixes it.",
            _Deferred("precision_lab.fixes.recipe_models:build_fp16_mlp_overflow"),
            PrecisionPolicy("fp16", "fp16"),
            seed=14,
            fixes=("use-bf16",
                   "keep-fp32:layers.0.mlp.down_proj+keep-fp32:layers.0.residual+keep-fp32:norm"),
            tolerance_db=25.0, tags=("overflow", "mlp"),
        ),
        Recipe(
            "fp16-layernorm",
            "LayerNorm in fp16 with one-pass variance E[x^2] - E[x]^2, eps 1e-5 and flush-to-zero, on rows of "
            "large magnitude (x^2 overflows), zero variance (eps flushed to 0: 0/0) and a large mean with small "
            "spread (the variance cancels to a negative number).",
            _Deferred("precision_lab.fixes.recipe_models:build_fp16_layernorm"),
            PrecisionPolicy("fp16-ftz", "fp16", flush_to_zero=True),
            seed=15, fixes=("stats-fp32", "two-pass-variance+eps:1e-3"), tolerance_db=30.0,
            tags=("norm", "ftz"),
        ),
        Recipe(
            "softmax-fp16-overflow",
            f"Attention logits softmaxed in fp16 without max subtraction: exp(x) overflows for x > "
            f"ln({_F16.max:,.0f}) = {ln_max:.2f}, and inf / inf = NaN.",
            _Deferred("precision_lab.fixes.recipe_models:build_softmax_fp16_overflow"),
            PrecisionPolicy("fp16", "fp16"),
            seed=16, fixes=("stable-softmax", "keep-fp32:attn.softmax"), tolerance_db=30.0,
            tags=("softmax", "overflow"),
        ),
    ]


for _r in _builtin():
    register_recipe(_r)
BUILTIN_RECIPES: tuple[str, ...] = tuple(RECIPES)
del _r

"""What a replay of a training run's failing steps needs, kept while the run trains.

A long capture given the job's optimizer (``capture(..., optimizer=opt, options=CaptureOptions(every=N,
keep_last=K))``) copies, as each step's forward begins, the state that step starts from: the model's and the
optimizer's state dicts, the GradScaler's, torch's random state and the batch the model is called with.  Two
steps are held (the one running and the one before it); when a step first holds an unexpected non-finite value
(the timeline's failure marker), the state at the start of the step before it and the batches of both are
frozen into a :class:`ReplayKit` and saved when the capture ends, beside the database
(``kit_path``).  ``services.rerun`` replays those steps from that state, in fp32, as the job ran them and under
a fix.

Memory: two copies of the model's and the optimizer's state and two batches, on the host; time: one copy of
them to the host per step.  The file is written with ``torch.save`` and read with ``weights_only=True``: tensors,
numbers, strings and containers only, never code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..paths import replay_kit_path

__all__ = ["ReplayKit", "KitKeeper", "kit_path", "load_kit", "KitError", "KIT_VERSION"]

KIT_VERSION = 1
_PLAIN = (int, float, bool, str, type(None))


class KitError(ValueError):
    """A replay kit cannot be kept or read; the message names it and why."""


def kit_path(db_path: os.PathLike | str, run_id: str) -> Optional[Path]:
    """``paths.replay_kit_path`` with a ``KitError`` for an id that names no kit."""
    try:
        return replay_kit_path(db_path, run_id)
    except ValueError as e:
        raise KitError(str(e)) from None


def _host(tree):
    """``tree`` with every tensor copied to the host, detached."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), tree)


def _plain(tree) -> bool:
    """Whether ``tree`` holds only tensors, numbers, strings and None in tuples, lists and dicts (what a file
    read with ``weights_only=True`` can hold)."""
    leaves, _ = tree_flatten(tree)
    return all(isinstance(x, (torch.Tensor,) + _PLAIN) for x in leaves)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


@dataclass
class KitStep:
    """One step to replay: its number, torch's random state as its forward began and its batch."""

    step: int
    rng: dict
    args: tuple
    kwargs: dict
    groups: list = field(default_factory=list)  # the optimizer's hyperparameters per group (a schedule's lr)

    def set_groups(self, opt) -> None:
        """Put this step's hyperparameters (learning rate, ...) on ``opt``'s groups, as the job's schedule had
        them."""
        if opt is None or len(self.groups) != len(opt.param_groups):
            return
        for group, kept in zip(opt.param_groups, self.groups):
            for k, v in kept.items():
                if k in group:
                    group[k] = v

    def set_rng(self) -> None:
        torch.set_rng_state(self.rng["cpu"])
        cuda = self.rng.get("cuda")
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)


@dataclass
class ReplayKit:
    """The state at the start of ``steps[0]`` and every step from it through ``failed_step``."""

    failed_step: int
    model: dict  # the model's state dict
    optimizer: Optional[dict]
    scaler: Optional[dict]  # GradScaler.state_dict(), None without an enabled one
    training: bool
    autocast: Optional[str]  # the format autocast ran the forward in: "fp16", "bf16", None
    steps: list = field(default_factory=list)  # KitStep

    @property
    def from_step(self) -> int:
        return self.steps[0].step

    def save(self, path: os.PathLike | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {"version": KIT_VERSION, "failed_step": self.failed_step, "model": self.model,
               "optimizer": self.optimizer, "scaler": self.scaler, "training": self.training,
               "autocast": self.autocast,
               "steps": [{"step": s.step, "rng": s.rng, "args": list(s.args), "kwargs": s.kwargs, "groups": s.groups}
                         for s in self.steps]}
        tmp = Path(f"{path}.part")
        try:
            torch.save(doc, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    # ---- restoring --------------------------------------------------------------------
    def restore_model(self, model: torch.nn.Module) -> None:
        """Load the kept state into ``model`` (built the same way), in the mode it trained in."""
        try:
            model.load_state_dict(self.model, strict=True)
        except RuntimeError as e:
            raise KitError(f"the replay kit's model state does not fit the model built now: {str(e).splitlines()[0]}") \
                from None
        model.train(self.training)

    def restore_optimizer(self, opt) -> None:
        if self.optimizer is None:
            return
        try:
            opt.load_state_dict(self.optimizer)
        except (ValueError, KeyError, RuntimeError) as e:
            raise KitError(f"the replay kit's optimizer state does not fit the optimizer built now: {e}") from None

    def grad_scaler(self, device: str, settings: tuple = (), *, enabled: bool = True):
        """A ``torch.amp.GradScaler`` in the kept state, ``settings`` (``(name, value)`` pairs of its state dict:
        ``scale``, ``growth_interval``, ``backoff_factor``, ``growth_factor``) put over it; None where the job
        had none (or ``enabled`` is false: an fp32 reference)."""
        if self.scaler is None or not enabled:
            return None
        state = dict(self.scaler)
        state.update(dict(settings))
        scaler = torch.amp.GradScaler(device)
        scaler.load_state_dict(state)
        return scaler


def load_kit(path: os.PathLike | str) -> ReplayKit:
    """Read a kit written by ``ReplayKit.save`` (``weights_only=True``); ``KitError`` names the file and the
    problem."""
    p = Path(path)
    if not p.is_file():
        raise KitError(f"{p}: no replay kit (the capture kept none, or the file was removed)")
    try:
        doc = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(doc, dict) or doc.get("version") != KIT_VERSION:
            raise KitError(f"{p}: not a replay kit of version {KIT_VERSION}")
        steps = [KitStep(int(s["step"]), dict(s["rng"]), tuple(s["args"]), dict(s["kwargs"]), list(s["groups"]))
                 for s in doc["steps"]]
        if not steps:
            raise KitError(f"{p}: the replay kit holds no step")
        return ReplayKit(failed_step=int(doc["failed_step"]), model=doc["model"], optimizer=doc["optimizer"],
                         scaler=doc["scaler"], training=bool(doc["training"]), autocast=doc["autocast"],
                         steps=steps)
    except KitError:
        raise
    except Exception as e:
        raise KitError(f"{p}: not a readable replay kit ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None


class KitKeeper:
    """Keeps, for the running step and the one before it, what a replay starts from (``begin``, as a step's
    forward begins), and freezes a :class:`ReplayKit` when a step first fails (``failed``)."""

    def __init__(self, optimizer, grad_scaler, warn):
        self.optimizer = optimizer
        self.scaler = grad_scaler
        self._warn = warn
        self._held: list = []  # [(state dict, KitStep)] of the step before and this one
        self.kit: Optional[ReplayKit] = None
        self._step: Optional[int] = None

    def begin(self, step: int, model: torch.nn.Module, args, kwargs, autocast: Optional[str]) -> None:
        """The first forward of ``step`` begins: copy the state it starts from and its batch.  A second forward in
        the same step (gradient accumulation, a second model call) is more than a replay runs: the step is
        dropped, and said once."""
        if self.kit is not None:
            return
        if self._step == step:
            if self._held and self._held[-1][1].step == step:
                self._held.pop()
                self._warn("replay", "a step calls the model more than once (gradient accumulation?): a replay "
                                     "runs one forward per step, so no replay kit is kept for such steps")
            return
        self._step = step
        if not _plain((args, kwargs)):
            self._warn("replay", f"step {step}'s batch holds objects other than tensors, numbers and strings; "
                                 "no replay kit is kept for it")
            self._held = []
            return
        scaler = None
        if self.scaler is not None and self.scaler.is_enabled():
            scaler = dict(self.scaler.state_dict())
        state = {"model": _host(model.state_dict()),
                 "optimizer": _host(self.optimizer.state_dict()) if self.optimizer is not None else None,
                 "scaler": scaler, "training": model.training, "autocast": autocast}
        self._held = [h for h in self._held if h[1].step == step - 1][-1:]
        groups = [] if self.optimizer is None else [
            {k: v for k, v in g.items() if k != "params" and _plain(v)} for g in self.optimizer.param_groups]
        self._held.append((state, KitStep(step, _rng_state(), _host(tuple(args)), _host(dict(kwargs)),
                                          _host(groups))))

    def failed(self, step: int) -> None:
        """``step`` holds the run's first unexpected non-finite value: freeze the steps held through it."""
        if self.kit is not None:
            return
        held = [h for h in self._held if h[1].step <= step]
        if not held or held[-1][1].step != step:
            self._warn("replay", f"no replay kit for step {step}: its forward's start was not seen")
            return
        state = held[0][0]
        self.kit = ReplayKit(failed_step=step, model=state["model"], optimizer=state["optimizer"],
                             scaler=state["scaler"], training=state["training"],
                             autocast=held[-1][0]["autocast"] or state["autocast"], steps=[h[1] for h in held])
        self._held = []

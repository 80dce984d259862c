"""Hooks on a running PyTorch model: per-op statistics as it runs.

What is recorded, and how:

- every module call, through forward pre/post hooks on each module (inputs
  and keyword inputs at entry, outputs at exit, parameters -- role
  ``param`` -- and floating-point buffers -- role ``buffer``, e.g.
  BatchNorm's ``running_mean`` -- once per step, as the module reads them on
  entry);
- every functional and tensor op run inside the model's forward
  (``F.softmax``, ``torch.matmul``, ``x / y``, ``.float()``), through a
  ``TorchFunctionMode``; ops run outside the model's forward (loss,
  optimizer) are not the model's and are not recorded;
- gradients when the user runs backward, through autograd node hooks that
  never touch the forward values: ``grad_output`` (the gradient arriving at
  an op's output) from a pre-hook on the node that made the output, and
  ``grad_input`` (this op's contribution to the gradient of each input) from
  hooks on the op's own nodes where they hand gradient to the input; and
  ``param_grad`` after each parameter's gradient is accumulated.

Names are ``<module path>.<op>.<call counter>`` (``blocks.0.attn.softmax.0``,
``blocks.0.attn.forward.0`` for the module call itself), counted per step,
so the same model run twice -- in fp32 and in fp16 -- gives the same names.
An op's backward is its own op, ``blocks.0.attn.softmax.0.backward`` and
``blocks.0.attn.backward.0`` (which also owns the module's parameter
gradients), as in msprobe dumps: grouping records by op never mixes the
two directions.

``seq`` is execution order: an op's inputs and outputs share the seq given
when the op *finishes*, so an op nested in a module comes before the module.
Backward ops get a seq when their gradient arrives.

Hook code never raises into the user's step: an error inside Precision Lab
is caught and kept as a warning on the run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from functools import partial
from typing import Any, Optional

import torch

from ..fixes.policy import PrecisionPolicy
from ..records import TensorRecord
from . import collectives as _collectives
from .backward import BackwardHooks
from .engine import StatsEngine
from .functional import FunctionalOps, _Mode
from .model_state import ModelState
from .module_hooks import ModuleHooks
from .naming import remove_handles
from .output import CapturedRun, RunOutput, _rank, _world_size
from .policies import as_policy
from .replaykit import KitKeeper, kit_path
from .records import StepRecords
from .regions import _ORIG, CompiledRegions, _compiled_regions, _name_path
from .shadow import ShadowRuns
from .steps import StepBoundary
from .options import CaptureOptions
from .timeline import Timeline

__all__ = ["Capture"]


def _ddp_modules(model) -> list:
    """The DistributedDataParallel modules in ``model`` (itself included)."""
    if not torch.distributed.is_available():
        return []
    from torch.nn.parallel import DistributedDataParallel

    return [m for m in model.modules() if isinstance(m, DistributedDataParallel)]


def _checked_arguments(model, run, store, shard_dir, write, options) -> CaptureOptions:
    """Refuse what a capture cannot be made of, each in one sentence, before anything is set up; the options."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture() needs a torch.nn.Module, got {type(model).__name__}")
    _compiled_regions(model)  # refuses what cannot be captured, before anything is set up
    if not isinstance(run, str) or not run.strip():
        raise ValueError("capture(run=...) needs a non-empty run name")
    if shard_dir is not None and store is not None:
        raise ValueError("capture(): give either store= (a database) or shard_dir= (Parquet shards), not both")
    if write and shard_dir is None and not (hasattr(store, "new_session") and hasattr(store, "extend_session")):
        raise TypeError("capture(store=...) needs a Store (or an object with new_session and extend_session); "
                        "precision_lab.capture(...) also takes a database path or None for the default database")
    if options is None:
        options = CaptureOptions()
    elif not isinstance(options, CaptureOptions):
        raise TypeError(f"capture(options=...) needs a CaptureOptions, got {type(options).__name__}")
    return options


def _new_run_id(run: str, shard_dir) -> str:
    """A run id for a run given none: under ``shard_dir``, every rank of a job must name the run the same without
    talking to the others, so the id comes from where the shards go."""
    if shard_dir is not None:
        root = os.path.abspath(os.fspath(shard_dir))
        return uuid.uuid5(uuid.NAMESPACE_URL, f"precision-lab:{root}:{run}").hex[:12]
    return uuid.uuid4().hex[:12]


class Capture(FunctionalOps, ModuleHooks, CompiledRegions, StepBoundary, StepRecords):
    """A live capture of ``model``: hooks while the ``with`` block runs, the records written when it ends.

    ``precision_lab.capture(...)`` makes one (and also takes a database path); the arguments are its own.
    ``store``: a :class:`~precision_lab.store.Store`, or any object with its ``new_session``/``extend_session``;
    ``shard_dir``: Parquet shards instead, for a process that cannot hold the database; ``write=False``: neither
    (``detached()`` hands the records over).  ``observer.on_record(capture, position, record, tensor, handle)``
    sees each tensor as it is recorded; ``kind``, ``source``, ``run_id``: the run's.

    It is made of four parts that each own their state: the forward hooks and the step's records here, the
    gradient hooks (``BackwardHooks``), the fp32 re-runs (``ShadowRuns``), the timeline (``Timeline``) and the
    destination (``RunOutput``).  The parts call back only ``recording``, ``summarising``, ``step_no``,
    ``take_seq``, ``measure``, ``add_tensor``, ``summarise``, ``warn`` and ``hook_error``.  Its own share is
    written in sibling modules on the same state: the torch-function mode and functional ops (``functional``),
    the module hooks (``module_hooks``), compiled regions (``regions``), step boundaries (``steps``) and the
    step's records (``records``).
    """

    def __init__(self, model, *, run: str = "capture", store=None, session: Optional[str] = None,
                 dtype_policy=None, options: Optional[CaptureOptions] = None, shard_dir=None,
                 kind: Optional[str] = None, source: str = "capture", observer=None, write: bool = True,
                 run_id: Optional[str] = None, grad_scaler=None, optimizer=None, recipe: Optional[str] = None,
                 on_written=None):
        self.options = options = _checked_arguments(model, run, store, shard_dir, write, options)
        self.run = run.strip()
        self.policy = as_policy(dtype_policy)
        self.kind = kind
        self.source = source
        self.observer = observer
        self.rank = _rank()
        if write and shard_dir is None and _world_size() > 1:
            raise ValueError(
                "capture(): under torch.distributed every rank runs its own capture and a database file "
                "admits one writer; pass shard_dir= so each rank writes its own Parquet shards"
            )
        if run_id is None:
            run_id = _new_run_id(self.run, shard_dir)
        self.run_id = run_id
        self.model = model
        self._user_model = None  # (model, ModelState) while a policy has changed it
        # the job's GradScaler: the scale each step's backward uses is read as the step begins (update() changes
        # it only at the step's end), its gradients recorded divided by it
        self._scaler = grad_scaler
        self._step_scale: Optional[float] = None
        # the job's optimizer: with keep_last, what a replay of the failing steps starts from is kept (ReplayKit)
        if optimizer is not None and not options.keep_last:
            raise ValueError("capture(optimizer=...) keeps what a replay of the failing steps needs, from the last "
                             "steps a long capture holds: give options=CaptureOptions(every=N, keep_last=K)")
        self._kit = KitKeeper(optimizer, grad_scaler, self.warn) if optimizer is not None else None
        self.recipe = recipe  # what builds this model again (a recipe's name): a replay needs it
        self._on_written = on_written  # called with the capture once its run is written
        self.autocast_seen: Optional[str] = None  # the format torch.autocast ran the model's forward in
        self.skipped_steps: list[int] = []  # steps the job's GradScaler skipped (inf/NaN in scaled gradients)
        self.records: list[TensorRecord] = []
        self.local_comparisons: list[tuple[int, Any]] = []  # (record index, Comparison)
        self.warnings: list[tuple[str, str]] = []
        self._written = None  # the writer of the session the run went to (its name: ``session``)
        self._session: Optional[str] = None
        self.step_no = 0
        self.recording = False  # this step is recorded in full
        self.summarising = False  # this step is summarised for the timeline only
        self._warned: set = set()
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._engine = StatsEngine(options, warn=self.warn)
        # the parts, each with its own state
        self._output = RunOutput(store=store, session=session, shard_dir=shard_dir, rank=self.rank) \
            if write else None
        self.timeline = Timeline(options, run=self.run, run_id=run_id, rank=self.rank, engine=self._engine,
                                 warn=self.warn, hook_error=self.hook_error)
        self._backward = BackwardHooks(self, timeline=options.timeline)
        # a module's re-run copy shares this capture (its hooks on the module refer to it)
        self._shadow = ShadowRuns(add_comparison=self._add_comparison, warn=self.warn, shared=(self,))
        self._active = False
        self._user_error: Optional[str] = None
        self._init_hook_state()

    def _init_hook_state(self) -> None:
        """The hooks' bookkeeping, empty: what is installed, the step's counters and pending records, and the
        decisions made once per capture."""
        self._handles: list = []
        self._mode: Optional[_Mode] = None
        self._seq = 0
        self._counters: dict = {}
        self._names: dict = {}  # (path, op, n) -> its name, made once
        self._pending: list = []  # (TensorRecord, handle) of the current step
        self._params_done: set = set()
        self._module_paths: dict = {}
        self._regions: dict = {}  # id(module) -> (module, attribute, the compiled callable it held)
        self._compile_watch = None  # torch._dynamo's compile-start callback, while installed
        self._collectives_undo = None  # puts torch.distributed's collectives back (collectives.install)
        self._async_collectives: dict = {}  # name -> calls with async_op=True whose output went unrecorded
        self._in_flight: dict = {}  # id(tensor) -> _InFlight: written by an asynchronous collective, this step
        # decisions that depend only on the options and the op or module, made once per capture
        self._fn_selected: dict = {}  # torch function -> _OpInfo, or None when not recorded
        self._module_info: dict = {}  # id(module) -> (path, op_type, scope_ok, record)
        self._keep_ops: dict = {}  # op name -> whether its tensors are kept whole

    # ---- public ---------------------------------------------------------------
    def prepare_inputs(self, inputs):
        """Apply the dtype policy to model inputs (identity without a policy)."""
        return self.policy.prepare_inputs(inputs) if self.policy is not None else inputs
    @property
    def grad_scale(self) -> Optional[float]:
        """The loss scale of this backward: gradients are recorded divided by it, in fp32 (GradScaler's
        ``unscale_``); None for none."""
        return self._backward.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: Optional[float]) -> None:
        self._backward.grad_scale = value

    @contextlib.contextmanager
    def paused(self):
        """Nothing is recorded inside (a loss-scale search's trial backward passes)."""
        recording, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = recording

    # what the timeline holds, as the run has it
    timeline_rows = property(lambda self: self.timeline.rows)
    timeline_shares = property(lambda self: self.timeline.shares)
    step_scalars = property(lambda self: self.timeline.scalars)
    frames = property(lambda self: self.timeline.frames)
    first_nonfinite_step = property(lambda self: self.timeline.first_nonfinite_step)
    alerts = property(lambda self: self.timeline.alerts)

    @property
    def shard_files(self) -> list:
        """Parquet files written (shard mode)."""
        return self._output.shard_files if self._output is not None else []

    def step_scalars_pending(self) -> bool:
        """Whether the current step has scalars (a loss, a loss scale) waiting for its end."""
        return bool(self.step_scalars) and self.step_scalars[-1].step == self.step_no

    def detached(self) -> CapturedRun:
        """What this capture recorded, without its model, hooks or store: picklable, so a worker process can
        send it back to be written."""
        tl = self.timeline
        return CapturedRun(run_id=self.run_id, run=self.run, kind=self.kind, source=self.source,
                           policy=self.policy if self.policy is not None else self.observed_policy(),
                           records=self.records, local_comparisons=self.local_comparisons, warnings=self.warnings,
                           timeline_rows=tl.rows, timeline_shares=tl.shares, step_scalars=tl.scalars)

    def observed_policy(self) -> Optional[PrecisionPolicy]:
        """The configuration a capture without a policy saw the job run in: ``torch.autocast`` in a format around
        the model's forward, and the job's GradScaler (None where the model ran as it is)."""
        if self.autocast_seen is None:
            return None
        scaler = ()
        try:
            if self._scaler is not None and self._scaler.is_enabled():
                scaler = (("enabled", 1),)
        except Exception:
            pass
        return PrecisionPolicy(f"autocast-{self.autocast_seen}", "fp32", autocast=self.autocast_seen,
                               grad_scaler=scaler)

    def run_meta(self) -> dict:
        return self.detached().run_meta()

    def dominant_dtype(self) -> str:
        return self.detached().dominant_dtype()

    def run_kind(self) -> str:
        return self.detached().run_kind()

    def write_run(self, w) -> list[int]:
        """Add this run, its records, local comparisons and warnings to a session writer; returns the rids."""
        return self.detached().write_run(w)

    # ---- context manager ------------------------------------------------------
    @property
    def session(self) -> Optional[str]:
        """The session the run was written to (None before, and for shards).  A database's new session is
        inserted behind the code after the ``with`` block: asking for its name waits until it is there (and
        raises where it could not be written)."""
        if self._session is None and self._written is not None:
            self._session = self._written.name
            self._written = None  # the name is all the capture keeps of its session's writer
        return self._session

    @session.setter
    def session(self, name: Optional[str]) -> None:
        self._session = name

    def __enter__(self) -> "Capture":
        if self._active:
            raise RuntimeError("this capture is already active")
        if self.policy is not None:
            # what the policy's islands do beyond their names (tied modules moving together, an island that
            # changes nothing), read before prepare: a cast can separate tensors that shared storage
            notes = getattr(self.policy, "island_notes", None)
            if callable(notes):
                try:
                    for note in notes(self.model):
                        self.warn("policy", note)
                except Exception as e:
                    self.hook_error("policy", e)
            self._user_model = (self.model, ModelState(self.model))
            prepared = self.policy.prepare(self.model)
            if prepared is not None:
                self.model = prepared
        self._engine.enter(self.options.stats_threads)
        try:
            self._install()
        except BaseException:
            self._uninstall()
            self._engine.exit()
            raise
        self._active = True
        self._begin_step()
        return self

    def __exit__(self, et, ev, tb):
        try:
            self._uninstall()
        finally:
            self._active = False
            self.recording = False
            self._engine.exit()
            if self._user_model is not None:  # the user's model as it was before the policy
                self.model, state = self._user_model
                self._user_model = None
                state.restore()
        if et is not None and not issubclass(et, Exception):
            return False  # KeyboardInterrupt and friends: leave at once
        if et is not None:
            self._user_error = f"{et.__name__}: {ev}"
            self.warn("capture", f"the captured code raised {self._user_error}; records up to that point are kept")
        self._end_step()
        for name, n in self._async_collectives.items():
            self.warn("collectives", f"{n} call(s) of torch.distributed.{name} with async_op=True: what they got "
                                     "back is not recorded (their work had not completed when their step ended, or "
                                     "the step wrote the tensor before it was seen completed)")
        self._async_collectives.clear()
        if self._output is not None:
            if et is None:
                self._finish_output()
            else:
                # the user's exception is the one to see; a failed write is noted on it
                try:
                    self._finish_output()
                except Exception as e:
                    ev.add_note(f"precision_lab.capture could not write run {self.run!r}: {type(e).__name__}: {e}")
        return False

    def _finish_output(self) -> None:
        notes = {"capture": {"run": self.run, "steps": self.step_no + 1, "options": repr(self.options)}}
        if self.options.timeline:
            notes["capture"].update(frames=self.frames, first_nonfinite_step=self.first_nonfinite_step)
        if self.recipe:
            notes["recipe"] = self.recipe
        if self.skipped_steps:
            notes["capture"]["scaler_skipped_steps"] = self.skipped_steps
        kit = self._kit.kit if self._kit is not None else None
        saved = None
        if kit is not None:
            db = getattr(self._output.store, "path", None)
            if self._output.sharded or self._output.session or not hasattr(self._output.store, "path"):
                self.warn("replay", "a replay kit is kept for a run written to a new session in a database only")
            else:
                try:
                    saved = kit_path(db, self.run_id)
                    if saved is None:
                        raise OSError("an in-memory database keeps no files")
                    kit.save(saved)
                except Exception as e:
                    self.warn("replay", f"could not write the replay kit ({type(e).__name__}: {e})")
                    saved = None
                else:
                    notes["replay"] = {"from_step": kit.from_step, "failed_step": kit.failed_step,
                                       "steps": len(kit.steps), "autocast": kit.autocast,
                                       "grad_scaler": kit.scaler is not None, "run_id": self.run_id}
        # the write and the diagnosis after it through one read-write open of the database (a sink that can)
        writing = getattr(self._output.store, "writing", None) if not self._output.sharded else None
        with writing() if writing is not None else contextlib.nullcontext():
            try:
                self._written = self._output.finish(self.detached(), notes)
            except BaseException:
                if saved is not None:  # no run names it: nothing would ever delete it
                    saved.unlink(missing_ok=True)
                raise
            if saved is not None and hasattr(self._written, "if_failed"):  # a session still being inserted
                self._written.if_failed(partial(saved.unlink, missing_ok=True))
            if self._written is not None and self._on_written is not None:
                try:
                    self._on_written(self)
                except Exception as e:  # the run is stored; its diagnosis is left to `precision-lab check`
                    self.warn("diagnose", f"the stored session was not diagnosed ({type(e).__name__}: {e}); "
                                          "`precision-lab check` diagnoses it")

    # ---- installing hooks --------------------------------------------------------
    def _install(self) -> None:
        opts = self.options
        regions = _compiled_regions(self.model)
        # a compiled region's own call is recorded by the wrapper around its compiled call (_region_call); hooks on
        # it, or on the module torch.compile(module) wraps, would run inside the compiled code
        unhooked = set(regions) | {id(m._orig_mod) for m, attr in regions.values() if attr == "forward"}
        for path, mod in self.model.named_modules():
            self._module_paths[id(mod)] = _name_path(path)
            wrapped = getattr(mod, _ORIG, None) if id(mod) in regions else None
            if wrapped is not None:  # torch.compile(module): the wrapper stands for the module it wraps
                self._module_paths[id(wrapped)] = _name_path(path)
                self._module_info[id(mod)] = self._module_of(wrapped)
            if id(mod) not in unhooked:
                # ahead of a policy's input cast, so an island's boundary cast is recorded under the island's own
                # name (its parent's op counters stay as in a run without the island)
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True))
                self._handles.append(mod.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))
            if opts.backward and opts.params and opts.module_selected(path) and opts.op_type_selected(
                    type(mod).__name__):
                # a parameter's gradient is produced by its module's backward
                named = _name_path(path)  # "" for the model, and for the model torch.compile(model) wraps
                op = f"{named}.backward.0" if named else "backward.0"
                for pname, p in mod.named_parameters(recurse=False):
                    self._backward.watch_param(p, op, type(mod).__name__, pname)
        if id(self.model) not in unhooked:
            self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True,
                                                                      prepend=True))
        elif self._kit is not None:
            self.warn("replay", "the model itself is compiled: no replay kit is kept (its forward's start is not seen)")
        for key, (mod, attr) in regions.items():
            compiled = getattr(mod, attr)
            self._regions[key] = (mod, attr, compiled)
            setattr(mod, attr, self._region_call(mod, compiled))
        if regions:
            shown = ", ".join(self._module_paths[k] or "the model" for k in regions)
            self.warn("torch.compile", f"compiled with torch.compile: {shown}. Inputs and outputs recorded there "
                                       "are the compiled numbers; the ops inside come from an eager re-run on the "
                                       "same inputs")
        # code compiled anywhere else (a function given to torch.compile) would be traced with the capture's
        # function mode on the stack: say so on the run rather than record it silently as something it is not
        self._compile_watch = torch._dynamo.callback.callback_handler.register_start_callback(self._on_compile)
        self._collectives_undo = _collectives.install(self)
        ddps = _ddp_modules(self.model)
        if ddps and opts.backward:
            self._backward.watch_ddp(ddps)
        if opts.functional:
            self._mode = _Mode(self)
            self._mode.__enter__()

    def _uninstall(self) -> None:
        err = None
        for mod, attr, compiled in self._regions.values():
            setattr(mod, attr, compiled)
        self._regions.clear()
        if self._compile_watch is not None:
            torch._dynamo.callback.callback_handler.remove_start_callback(self._compile_watch)
            self._compile_watch = None
        if self._collectives_undo is not None:
            self._collectives_undo()
            self._collectives_undo = None
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as e:  # a mode pushed by user code on top of ours
                err = e
            self._mode = None
        remove_handles(self._handles)
        self._backward.remove()
        self._shadow.clear()
        if err is not None:
            self.warn("capture", f"could not pop the capture's function mode cleanly: {err}")

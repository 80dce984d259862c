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
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ..fixes.policy import PrecisionPolicy
from ..formats import format_for_dtype
from ..records import TensorRecord
from ..stats import TensorStats
from . import collectives as _collectives
from .backward import BackwardHooks
from .engine import StatsEngine
from .naming import _Frame, _OpInfo, _backward_name, _flatten, _func_info, remove_handles
from .output import CapturedRun, RunOutput, _rank, _world_size
from .policies import as_policy
from .replaykit import KitKeeper, kit_path
from .shadow import ShadowRuns, _cuda_devices, _rng_state_of, with_rng
from .options import CaptureOptions
from .timeline import Timeline
from .where import user_location

__all__ = ["Capture"]


_UNSEEN = object()


class _Mode(TorchFunctionMode):
    """Sees every torch function and tensor method called while the capture is active."""

    def __init__(self, cap: "Capture"):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        cap = self.cap
        # the per-function decision (skipped, view, filtered out) is made once per capture:
        # most calls in a forward are views and metadata, and they return here
        info = cap._fn_selected.get(func, _UNSEEN)
        if info is _UNSEEN:
            info = cap._select_func(func)
        if info is None or not cap.recording:
            return func(*args, **kwargs)
        st = cap._tls
        stack = getattr(st, "stack", None)
        if not stack or st.busy:
            return func(*args, **kwargs)
        frame = stack[-1]
        if not frame.scope_ok:
            return func(*args, **kwargs)
        ctx = None
        st.busy = True
        try:
            ctx = cap._op_before(frame, info, args, kwargs)
        except Exception as e:  # never break the user's step
            cap.hook_error(f"{frame.path}.{info.name}", e)
        finally:
            st.busy = False
        out = func(*args, **kwargs)
        if ctx is not None:
            st.busy = True
            try:
                cap._op_after(ctx, func, args, kwargs, out)
            except Exception as e:
                cap.hook_error(ctx[0], e)
            finally:
                st.busy = False
        return out


_ORIG = "_orig_mod"  # where torch.compile(module) keeps the module it compiled


def _ddp_modules(model) -> list:
    """The DistributedDataParallel modules in ``model`` (itself included)."""
    if not torch.distributed.is_available():
        return []
    from torch.nn.parallel import DistributedDataParallel

    return [m for m in model.modules() if isinstance(m, DistributedDataParallel)]


def _compiled_regions(model) -> dict:
    """id(module) -> (module, attribute) for every region compiled with torch.compile in ``model``: a module
    wrapped by ``torch.compile(module)`` (its ``forward`` is the compiled call) or compiled in place by
    ``module.compile()`` (its ``_compiled_call_impl``).  A ``forward`` replaced by a compiled function cannot be
    captured and is refused in one sentence."""
    regions, inside = {}, set()
    for path, m in model.named_modules():
        if id(m) in inside:
            continue  # a compiled module inside a compiled region is traced into the region's graph
        if isinstance(getattr(m, _ORIG, None), torch.nn.Module) and callable(m.__dict__.get("forward")):
            regions[id(m)] = (m, "forward")
        elif getattr(m, "_compiled_call_impl", None) is not None:
            regions[id(m)] = (m, "_compiled_call_impl")
        elif hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable"):
            where = f"module {path!r}" if path else "the model"
            raise ValueError(f"capture(): the forward of {where} was replaced by a function compiled with "
                             "torch.compile, whose graphs the capture cannot enter or wrap; compile the module "
                             "instead (module.compile() or torch.compile(module)) and its outputs are recorded "
                             "as compiled, with op-level detail from an eager re-run")
        else:
            continue
        inside.update(id(c) for c in m.modules() if c is not m)
    return regions


def _name_path(path: str) -> str:
    """A module's path with torch.compile's wrapper left out, so compiled and eager runs name ops alike."""
    return ".".join(p for p in path.split(".") if p != _ORIG) if _ORIG in path else path


def _autocast_dtype(device: str):
    """The dtype ``torch.autocast`` computes in on ``device`` now, None where it is off."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


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


class Capture:
    """A live capture of ``model``: hooks while the ``with`` block runs, the records written when it ends.

    ``precision_lab.capture(...)`` makes one (and also takes a database path); the arguments are its own.
    ``store``: a :class:`~precision_lab.store.Store`, or any object with its ``new_session``/``extend_session``;
    ``shard_dir``: Parquet shards instead, for a process that cannot hold the database; ``write=False``: neither
    (``detached()`` hands the records over).  ``observer.on_record(capture, position, record, tensor, handle)``
    sees each tensor as it is recorded; ``kind``, ``source``, ``run_id``: the run's.

    It is made of four parts that each own their state: the forward hooks and the step's records here, the
    gradient hooks (``BackwardHooks``), the fp32 re-runs (``ShadowRuns``), the timeline (``Timeline``) and the
    destination (``RunOutput``).  The parts call back only ``recording``, ``summarising``, ``step_no``,
    ``take_seq``, ``measure``, ``add_tensor``, ``summarise``, ``warn`` and ``hook_error``.
    """

    def __init__(self, model, *, run: str = "capture", store=None, session: Optional[str] = None,
                 dtype_policy=None, options: Optional[CaptureOptions] = None, shard_dir=None,
                 kind: Optional[str] = None, source: str = "capture", observer=None, write: bool = True,
                 run_id: Optional[str] = None, grad_scaler=None, optimizer=None, recipe: Optional[str] = None,
                 on_written=None):
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
        self.options = options
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
            if shard_dir is not None:
                # every rank of a job must name the run the same without talking
                # to the others: derive the id from where the shards go
                root = os.path.abspath(os.fspath(shard_dir))
                run_id = uuid.uuid5(uuid.NAMESPACE_URL, f"precision-lab:{root}:{self.run}").hex[:12]
            else:
                run_id = uuid.uuid4().hex[:12]
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
        self._on_written = on_written  # called with the session's name once the run is written
        self.autocast_seen: Optional[str] = None  # the format torch.autocast ran the model's forward in
        self.skipped_steps: list[int] = []  # steps the job's GradScaler skipped (inf/NaN in scaled gradients)
        self.records: list[TensorRecord] = []
        self.local_comparisons: list[tuple[int, Any]] = []  # (record index, Comparison)
        self.warnings: list[tuple[str, str]] = []
        self.session: Optional[str] = None
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
        self._handles: list = []
        self._mode: Optional[_Mode] = None
        self._active = False
        self._seq = 0
        self._counters: dict = {}
        self._names: dict = {}  # (path, op, n) -> its name, made once
        self._pending: list = []  # (TensorRecord, handle) of the current step
        self._params_done: set = set()
        self._module_paths: dict = {}
        self._regions: dict = {}  # id(module) -> (module, attribute, the compiled callable it held)
        self._compile_watch = None  # torch._dynamo's compile-start callback, while installed
        self._collectives_undo = None  # puts torch.distributed's collectives back (collectives.install)
        self._async_collectives: dict = {}  # name -> calls with async_op=True, run unrecorded
        # decisions that depend only on the options and the op or module, made once per capture
        self._fn_selected: dict = {}  # torch function -> _OpInfo, or None when not recorded
        self._module_info: dict = {}  # id(module) -> (path, op_type, scope_ok, record)
        self._keep_ops: dict = {}  # op name -> whether its tensors are kept whole
        self._user_error: Optional[str] = None

    # ---- public ---------------------------------------------------------------
    def prepare_inputs(self, inputs):
        """Apply the dtype policy to model inputs (identity without a policy)."""
        return self.policy.prepare_inputs(inputs) if self.policy is not None else inputs

    def step(self, *, loss=None, grad_scaler=None) -> None:
        """End the current step: finish its statistics (one host transfer) and start the next.

        ``loss`` (a tensor or number) and ``grad_scaler`` (a ``torch.amp.GradScaler``, for its loss scale)
        go to the run's timeline as the step's scalars; reading them costs one host sync each.
        """
        with self._lock:
            if self._step_scale is not None:  # the scale this step used, not the one update() set for the next
                self.timeline.add_scalars(self.step_no, loss, None, scale=self._step_scale)
            elif loss is not None or grad_scaler is not None:
                self.timeline.add_scalars(self.step_no, loss, grad_scaler)
            self._end_step()
            self.step_no += 1
            self._begin_step()

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
                self.session = self._output.finish(self.detached(), notes)
            except BaseException:
                if saved is not None:  # no run names it: nothing would ever delete it
                    saved.unlink(missing_ok=True)
                raise
            if self.session and self._on_written is not None:
                try:
                    self._on_written(self.session)
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

    def _on_compile(self, *_) -> None:
        if self._active and not getattr(self._tls, "in_region", False):
            self.warn("torch.compile", "a function compiled with torch.compile, not a compiled module, ran inside "
                                       "the capture: its ops are not recorded as compiled numbers. Compile the "
                                       "module that calls it (module.compile() or torch.compile(module)) so its "
                                       "inputs and outputs are recorded as compiled")

    def _region_call(self, module, compiled):
        """The compiled call of ``module``, wrapped: its inputs and outputs recorded as the module's own call (the
        compiled numbers), the capture's function mode off while the compiled code runs (it would be traced into
        its graphs), and an eager re-run of the module on the same inputs for the ops inside."""

        def call(*args, **kwargs):
            if not (self.recording or self.summarising) or getattr(self._tls, "busy", False):
                with self._compiled_code():
                    return compiled(*args, **kwargs)
            self._pre_hook(module, args, kwargs)
            frame = self._tls.stack[-1] if getattr(self._tls, "stack", None) else None
            if frame is not None and frame.module is module:
                frame.shadow_in = None  # the eager re-run below stands in for a local error at the boundary
            rng = _rng_state_of(_cuda_devices((args, kwargs)))
            # the inputs as the compiled call got them, for the eager re-run (compiled code may update them in place)
            eager_in = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs)) \
                if self.recording else None
            out = None
            try:
                with self._compiled_code():
                    out = compiled(*args, **kwargs)
                if eager_in is not None:
                    self._eager_detail(module, *eager_in, rng)
            finally:
                self._post_hook(module, args, kwargs, out)
            return out

        return call

    def _eager_detail(self, module, args, kwargs, rng) -> None:
        """Run a compiled region's module eagerly on the inputs the compiled call had, with the random state it
        had, under no_grad and with its buffers put back after: the ops inside are recorded from this run."""
        eager = getattr(module, _ORIG, None)
        run = eager.__call__ if eager is not None else module._call_impl
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            # eager all the way down: compiled modules inside the region run eagerly too
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                with_rng(rng, lambda: run(*args, **kwargs))
        except Exception as e:
            self.warn(self._module_paths.get(id(module), "?"),
                      f"the eager re-run for the ops inside this compiled region failed ({type(e).__name__}: {e})")
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    @contextlib.contextmanager
    def _compiled_code(self):
        """While a compiled region's code runs (and compiles): the capture's function mode popped (when it is
        the innermost mode), and the thread marked as inside a region for ``_on_compile``."""
        mode = self._mode
        pop = mode is not None and torch.overrides._get_current_function_mode() is mode
        if pop:
            mode.__exit__(None, None, None)
        self._tls.in_region = True
        try:
            yield
        finally:
            self._tls.in_region = False
            if pop:
                mode.__enter__()

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
        for name, n in self._async_collectives.items():
            self.warn("collectives", f"{n} call(s) of torch.distributed.{name} with async_op=True ran unrecorded: "
                                     "their output is written after they return")
        self._async_collectives.clear()
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

    # ---- steps -------------------------------------------------------------------------
    def _begin_step(self) -> None:
        if self._scaler is not None and self._active:
            self._step_scale = None
            try:
                if self._scaler.is_enabled():
                    self._step_scale = float(self._scaler.get_scale())
            except Exception as e:
                self.hook_error("grad_scaler", e)
            self._backward.grad_scale = self._step_scale
        self.recording = self._active and self.options.step_selected(self.step_no)
        self.summarising = self._active and self.options.timeline and not self.recording
        self._seq = 0
        self._counters.clear()
        self._backward.new_step()
        self._params_done.clear()
        # the model's buffers, copied (not shared) into a functional op's fp32 re-run
        self._shadow.new_step(self.model if self.options.local_error else None)
        self._engine.new_step()
        self.timeline.new_step()
        tls = self._tls
        tls.stack = []
        tls.busy = False

    def _scaler_skipped(self) -> bool:
        """Whether the job's GradScaler skipped this step: its scale is below the one the step's backward used
        (``update()`` backs off after finding inf/NaN gradients)."""
        if self._scaler is None or self._step_scale is None:
            return False
        try:
            return float(self._scaler.get_scale()) < self._step_scale
        except Exception as e:
            self.hook_error("grad_scaler", e)
            return False

    def _end_step(self) -> None:
        if not self._pending and not self.timeline.pending(self.step_no):
            self._engine.new_step()
            return
        try:
            self._engine.resolve()
            self.timeline.resolve()
        except Exception as e:
            self.hook_error("statistics", e)
        step_records = []
        skipped = self._scaler_skipped()
        if skipped:
            # the GradScaler found inf/NaN in this step's scaled gradients and skipped the step, as it is made to:
            # those gradients never reached the weights and are not the run's failure (as a loss-scale search's
            # tries are not recorded); the forward's records stay
            kept = [i for i, item in enumerate(self._pending) if item[5] != "backward"]
            base = len(self.records)
            at = {base + old: base + new for new, old in enumerate(kept)}
            self._pending = [self._pending[i] for i in kept]
            self.local_comparisons = [(at[p], c) if p >= base else (p, c) for p, c in self.local_comparisons
                                      if p < base or p in at]
            self.skipped_steps.append(self.step_no)
        for item in self._pending:
            handle = item[-1]
            stats = handle.stats
            if stats is None:  # the device results never arrived: keep the record (positions stay), say so

                stats = TensorStats.summary_only(dtype=handle.dtype, shape=handle.shape, numel=handle.numel)
            rec = self._make_record(item, stats)
            if rec.tensor is not None and isinstance(rec.tensor, torch.Tensor):
                rec.tensor = rec.tensor.detach().cpu()
            step_records.append(rec)
        self._pending.clear()
        # handles registered on this step's autograd graph are dropped with it
        self._backward.end_step()
        # this step's local comparisons (the last ones), by position among its records: they go where its
        # records go, now or (a step the timeline holds back) later or never
        base = len(self.records)
        split = len(self.local_comparisons)
        while split and self.local_comparisons[split - 1][0] >= base:
            split -= 1
        local = [(p - base, c) for p, c in self.local_comparisons[split:]]
        del self.local_comparisons[split:]
        if not self.options.timeline:
            groups = [(self.step_no, step_records, local)] if step_records else []
        else:
            groups = self.timeline.end_step(self.step_no, step_records, local, scaler_skipped=skipped)
            if self._kit is not None and self.timeline.first_nonfinite_step == self.step_no:
                self._kit.failed(self.step_no)
        for step, recs, group_local in groups:
            at = len(self.records)
            self.records.extend(recs)
            self.local_comparisons.extend((at + p, c) for p, c in group_local)
            if self._output is not None and self._output.sharded:
                self._output.write_step(self.detached(), recs, dict(group_local), step)

    # ---- recording -----------------------------------------------------------------------
    def warn(self, where: str, message: str) -> None:
        """Note a warning on the run (each one once, up to ``options.max_warnings``)."""
        key = (where, message)
        with self._lock:
            if key in self._warned or len(self.warnings) >= self.options.max_warnings:
                return
            self._warned.add(key)
            self.warnings.append((where, message))

    def hook_error(self, where: str, e: BaseException) -> None:
        self.warn(where, f"capture hook error ({type(e).__name__}: {e}); the step ran unchanged")

    def _select_func(self, func) -> Optional[_OpInfo]:
        info = _func_info(func)
        if info.skip or not self.options.op_type_selected(info.name):
            info = None
        self._fn_selected[func] = info
        return info

    def _module_of(self, module):
        """(path, op_type, scope_ok, record) of a hooked module, or None for one added after install."""
        got = self._module_info.get(id(module))
        if got is None:
            path = self._module_paths.get(id(module))
            if path is None:
                return None
            op_type = type(module).__name__
            scope_ok = self.options.module_selected(path)
            got = (path, op_type, scope_ok, scope_ok and self.options.op_type_selected(op_type))
            self._module_info[id(module)] = got
        return got

    def next_name(self, path: str, opname: str) -> str:
        """``<path>.<opname>.<n>``, n counting this step's calls of ``opname`` in ``path``."""
        return self._next_name(path, opname)

    def forget(self, t) -> None:
        """Earlier statistics of ``t`` no longer hold: it was written without its version changing."""
        self._engine.forget(t)

    def _next_name(self, path: str, opname: str) -> str:
        key = (path, opname)
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        # the same names come back every step: one string each for the whole capture (a long run keeps them)
        name = self._names.get((path, opname, n))
        if name is None:
            name = self._names[(path, opname, n)] = f"{path}.{opname}.{n}" if path else f"{opname}.{n}"
        return name

    def measure(self, op: str, t: torch.Tensor, hold: bool = False):
        """Start the statistics of ``t`` (recorded under ``op``): a handle they arrive on when the step ends."""
        return self._engine.measure(t, op, hold=hold)

    def _add(self, seq, op, op_type, role, index, handle, direction="forward", tensor=None, step=None,
             location=None) -> int:
        """Note one record of the current step (its TensorRecord is made when the step ends); its position."""
        item = (seq, op, op_type, role, index, direction, self.step_no if step is None else step, tensor, location,
                handle)
        with self._lock:
            self._pending.append(item)
            return len(self.records) + len(self._pending) - 1

    def _make_record(self, item, stats) -> TensorRecord:
        seq, op, op_type, role, index, direction, step, tensor, location, _ = item
        return TensorRecord(run_id=self.run_id, seq=seq, op=op, op_type=op_type, role=role, index=str(index),
                            stats=stats, step=step, rank=self.rank, direction=direction, source="capture",
                            tensor=tensor, location=location)

    def _keep(self, op: str, t: torch.Tensor):
        if not self.options.keep_tensors:
            return None
        keep = self._keep_ops.get(op)
        if keep is None:
            keep = self._keep_ops[op] = self.options.keep_selected(op)
        if not keep:
            return None
        if t.layout != torch.strided or t.device.type == "meta" or t.is_complex():
            self.warn(op, f"{t.layout} {str(t.dtype).replace('torch.', '')} tensor not kept: only dense real "
                           "tensors are stored whole")
            return None
        return t.detach().clone()

    def _observe(self, pos, t, handle):
        if self.observer is None:
            return
        with self._lock:
            item = self._pending[pos - len(self.records)]
        rec = self._make_record(item, None)
        try:
            self.observer.on_record(self, pos, rec, t, handle)
        except Exception as e:
            self.hook_error(rec.op, e)

    def add_tensor(self, seq, op, op_type, role, index, t, handle, direction="forward", step=None,
                   location=None) -> int:
        """Record tensor ``t`` (its statistics on ``handle``; kept whole where the options say): its position."""
        pos = self._add(seq, op, op_type, role, index, handle, direction,
                        tensor=None if t is None else self._keep(op, t), step=step, location=location)
        if t is not None:  # None: statistics taken earlier of values no longer there (DDP's local gradient)
            self._observe(pos, t, handle)
        return pos

    def summarise(self, seq, op, op_type, role, index, direction, t, location) -> None:
        """Note tensor ``t`` in the step's timeline summary."""
        self.timeline.summarise(seq, op, op_type, role, index, direction, t, location, full=self.recording)

    def _add_comparison(self, pos: int, cmp) -> None:
        with self._lock:
            self.local_comparisons.append((pos, cmp))

    # -- collectives (collectives.install wraps torch.distributed's functions to call these)
    def collective_before(self, name: str, sent):
        """A collective is about to run: its op name and what this rank sends, measured now (an in-place
        collective overwrites it)."""
        st = self._tls
        stack = getattr(st, "stack", None)
        if stack and not stack[-1].scope_ok:
            return None
        st.busy = True
        try:
            op = self._next_name(stack[-1].path if stack else "", name)
            backward = torch._C._current_graph_task_id() != -1  # inside autograd's backward pass
            ins = [("input", idx, t, h) for idx, t in _flatten(sent) for h in (self.measure(op, t),) if h is not None]
            return op, name, ins, "backward" if backward else "forward"
        except Exception as e:
            self.hook_error(name, e)
            return None
        finally:
            st.busy = False

    def collective_after(self, ctx, written) -> None:
        """The collective returned: what this rank got back, recorded with what it sent as one op call."""
        op, name, ins, direction = ctx
        st = self._tls
        st.busy = True
        try:
            seq = self.take_seq()
            for role, idx, t, h in ins:
                self.add_tensor(seq, op, name, role, idx, t, h, direction)
            for idx, t in _flatten(written):
                self.forget(t)  # written in place, perhaps without a new version: measured afresh
                h = self.measure(op, t)
                if h is not None:
                    self.add_tensor(seq, op, name, "output", idx, t, h, direction)
        except Exception as e:
            self.hook_error(op, e)
        finally:
            st.busy = False

    def note_unrecorded_collective(self, name: str) -> None:
        with self._lock:
            self._async_collectives[name] = self._async_collectives.get(name, 0) + 1

    # -- functional ops
    def _op_before(self, frame: _Frame, info: _OpInfo, args, kwargs):
        op = self._next_name(frame.path, info.name)
        where = user_location(2) if self.options.locations else None
        ins = self._measure_inputs(op, args, kwargs)
        shadow = None
        rng = None
        if self.options.local_error:
            inplace = info.inplace or kwargs.get("out") is not None or kwargs.get("inplace") is True
            shadow = self._shadow.functional_inputs(args, kwargs, inplace)
            rng = _rng_state_of(_cuda_devices((args, kwargs)))
        return (op, info, ins, self._seq, shadow, rng, where)

    def _op_after(self, ctx, func, args, kwargs, out):
        op, info, ins, start_seq, shadow, rng, where = ctx
        if info.name == "setitem":
            # x[i] = v returns nothing; its result is the mutated x
            outs = list(_flatten(args[0] if args else None))
        else:
            outs = list(_flatten(out))
        if not outs:
            return
        out_recs = self._record_call(op, info.name, ins, outs, start_seq, f"{op}.backward", where)
        if shadow is not None and out_recs:
            self._shadow.functional(op, info, func, shadow, rng, out_recs)

    def _measure_inputs(self, op, args, kwargs) -> list:
        """(role, index, tensor, handle) of a call's tensor arguments."""
        ins = []
        for idx, t in _flatten(args):
            h = self.measure(op, t)
            if h is not None:
                ins.append(("input", idx, t, h))
        if kwargs:
            # ``out=`` is where the op writes: what it held before is no input (often uninitialised memory)
            for idx, t in _flatten({k: v for k, v in kwargs.items() if k != "out"} if "out" in kwargs else kwargs):
                h = self.measure(op, t)
                if h is not None:
                    ins.append(("kwarg", idx, t, h))
        return ins

    def _record_call(self, op, op_type, ins, outs, start_seq, backward_op, location=None) -> list:
        """Record a finished op or module call: its inputs, its outputs and the hooks on its backward.

        Returns (index, tensor, position) of the recorded outputs, for the local error.
        """
        seq = self.take_seq()
        for role, idx, t, h in ins:
            self.add_tensor(seq, op, op_type, role, idx, t, h, location=location)
        out_recs = []
        for idx, t in outs:
            h = self.measure(op, t)
            if h is None:
                continue
            pos = self.add_tensor(seq, op, op_type, "output", idx, t, h, location=location)
            out_recs.append((idx, t, pos))
        self._backward.mark_outputs(outs, seq)
        if self.options.backward and torch.is_grad_enabled():
            # a parameter's gradient is recorded as its param_grad, not through the graph walk; a buffer gets none
            self._backward.register(backward_op, op_type,
                                    [(r, i, t) for r, i, t, _ in ins if r not in ("param", "buffer")],
                                    outs, start_seq)
        return out_recs

    def take_seq(self) -> int:
        """The next seq (execution order) of this step."""
        with self._lock:
            s = self._seq
            self._seq += 1
            return s

    # -- modules
    def _root_pre_hook(self, module, args, kwargs):
        """The model's own forward begins: the autocast it runs under and, for a replay, the state it starts
        from."""
        if torch.compiler.is_compiling() or not self._active or getattr(self._tls, "busy", False) \
                or module is not self.model:  # a copy an fp32 re-run made carries this hook too
            return None
        try:
            p = next(module.parameters(), None)
            device = p.device.type if p is not None else "cpu"
            on = _autocast_dtype(device)
            fmt = format_for_dtype(on) if on is not None else None
            if fmt is not None and self.autocast_seen is None:
                self.autocast_seen = fmt.name
            if self._kit is not None:
                model = self._user_model[0] if self._user_model is not None else self.model
                self._kit.begin(self.step_no, model, args, kwargs, fmt.name if fmt is not None else None)
        except Exception as e:
            self.hook_error("replay", e)
        return None

    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # a module inside a compiled region, being traced: nothing to do
            return None
        tls = self._tls
        if not (self.recording or self.summarising) or getattr(tls, "busy", False):
            return None
        if getattr(tls, "stack", None) is None:
            tls.stack = []  # a forward run in another thread than the one that entered the capture
        tls.busy = True
        try:
            got = self._module_of(module)
            if got is None:
                return None
            path, op_type, scope_ok, record = got
            op = self._next_name(path, "forward") if record else path
            frame = _Frame(module, path, op, op_type, scope_ok, record, self._seq)
            tls.stack.append(frame)
            if not record:
                return None
            if self.options.locations:
                frame.location = user_location(1)
            if not self.recording:  # a summary step: the module's output only
                frame.inputs = []
                return None
            ins = self._measure_inputs(op, args, kwargs)
            if self.options.params and id(module) not in self._params_done:
                self._params_done.add(id(module))
                for pname, p in module.named_parameters(recurse=False):
                    h = self.measure(op, p)
                    if h is not None:
                        ins.append(("param", pname, p, h))
                for bname, b in module.named_buffers(recurse=False):
                    # floating buffers (running statistics, rotary frequencies) feed the op like parameters;
                    # an empty one is a marker (a policy module's format), integer ones are counters
                    if not b.is_floating_point() or b.numel() == 0:
                        continue
                    h = self.measure(op, b)
                    if h is not None:
                        ins.append(("buffer", bname, self._buffer_as_read(op, b), h))
            frame.inputs = ins
            if self.options.local_error:
                frame.shadow_in = self._shadow.module_inputs(args, kwargs)
                devs = _cuda_devices((args, kwargs))
                devs.update(_cuda_devices(list(module.parameters())))
                frame.rng = _rng_state_of(devs)
                frame.autocast = getattr(module, "_precision_lab_autocast_dtype",  # a policy's, entered after this
                                         _autocast_dtype("cuda" if devs else "cpu"))
        except Exception as e:
            self.hook_error(self._module_paths.get(id(module), "?"), e)
        finally:
            tls.busy = False
        return None

    def _buffer_as_read(self, op: str, b: torch.Tensor) -> torch.Tensor:
        """The buffer as the module reads it on entry, for what uses the tensor itself after the call (a kept
        tensor, a paired run's comparison): a copy when something will, since the module may update it in place
        (BatchNorm's running statistics in training); its statistics were taken already."""
        if self.observer is None and not (self.options.keep_tensors and self.options.keep_selected(op)):
            return b
        return b.detach().clone()

    def _post_hook(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return None
        tls = self._tls
        if getattr(tls, "busy", False):
            return None
        stack = getattr(tls, "stack", None)
        if not stack:
            return None
        # pop up to this module's frame (a child that raised leaves its frame behind);
        # a module without a frame (added after the capture started) leaves the stack alone
        at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].module is module), None)
        if at is None:
            return None
        frame = stack[at]
        del stack[at:]
        if frame is None or not frame.record or frame.inputs is None or not (self.recording or self.summarising):
            return None
        tls.busy = True
        try:
            op = frame.op
            outs = list(_flatten(output))
            if self.recording:
                out_recs = self._record_call(op, frame.op_type, frame.inputs, outs, frame.start_seq,
                                             _backward_name(op), frame.location)
                if frame.shadow_in is not None and out_recs:
                    self._shadow.module(frame, out_recs)
                seq = self._seq - 1
            else:
                seq = self.take_seq()
            if self.options.timeline:
                for idx, t in outs:
                    self.summarise(seq, op, frame.op_type, "output", idx, "forward", t, frame.location)
        except Exception as e:
            self.hook_error(frame.op, e)
        finally:
            tls.busy = False
        return None


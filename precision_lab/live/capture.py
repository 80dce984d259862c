"""Hooks on a running PyTorch model: per-op statistics as it runs.

What is recorded, and how:

- every module call, through forward pre/post hooks on each module (inputs
  and keyword inputs at entry, outputs at exit, parameters once per step);
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

import copy
import dataclasses
import json
import os
import threading
import uuid
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_map

from ..fixes.policy import cast_floating
from ..formats import format_for_dtype, get_format
from ..metrics import compare
from ..readers.shards import write_manifest, write_shard
from ..records import RunInfo, TensorRecord
from ..stats import TensorStats
from .engine import StatsEngine
from .options import CaptureOptions

__all__ = ["Capture", "capture", "CAST_OPS"]

# Tensor methods that change dtype: recorded like any op (their local error
# is the rounding of the cast itself), and their fp32 shadow is the input.
CAST_OPS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})

# Calls that compute nothing from tensor values (metadata, conversions to
# Python, autograd plumbing); skipped before any statistics are taken.
_NON_COMPUTE = frozenset({
    "size", "dim", "numel", "item", "tolist", "is_floating_point", "is_complex", "data_ptr", "element_size",
    "stride", "storage_offset", "is_contiguous", "__len__", "__bool__", "__index__", "__int__", "__float__",
    "__format__", "__repr__", "__str__", "__iter__", "__contains__", "__hash__", "__reduce_ex__",
    "__deepcopy__", "__array__", "numpy", "cpu_numpy", "backward", "register_hook", "retain_grad",
    "register_post_accumulate_grad_hook", "untyped_storage", "storage", "get_device", "nelement",
    "has_names", "is_set_to", "is_same_size", "__dir__", "__getstate__", "__setstate__", "_is_view",
    "is_nonzero", "equal", "allclose", "__array_wrap__", "dim_order", "pin_memory", "share_memory_",
    "record_stream", "is_pinned", "is_shared", "nbytes", "itemsize", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "empty",
})

_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})

_LOW_FLOAT = {torch.float16, torch.bfloat16}
for _n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _n):
        _LOW_FLOAT.add(getattr(torch, _n))

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")

# Bounds of the autograd-graph walk that finds an op's own gradient edges.
_MAX_WALK_NODES = 4096

_UNSEEN = object()


class _OpInfo:
    __slots__ = ("name", "skip", "inplace", "cast")

    def __init__(self, name: str, skip: bool, inplace: bool, cast: bool):
        self.name, self.skip, self.inplace, self.cast = name, skip, inplace, cast


_FUNC_INFO: dict = {}


def _func_info(func) -> _OpInfo:
    info = _FUNC_INFO.get(func)
    if info is not None:
        return info
    try:
        full = resolve_name(func) or getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    except Exception:
        full = getattr(func, "__name__", repr(func))
    parts = full.split(".")
    last = parts[-1]
    skip = last in ("__get__", "__set__", "__delete__") or last in _NON_COMPUTE
    inplace = last in _INPLACE_DUNDERS or (last.endswith("_") and not last.endswith("__"))
    name = last
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and f"__{name}__" in _INPLACE_DUNDERS and name != "index":
            name = name[1:] + "_"  # __iadd__ -> add_
        elif name.startswith("r") and name not in ("rshift",):
            name = name[1:]  # __radd__ -> add
    name = name.lstrip("_") or name
    info = _OpInfo(name, skip, inplace, name in CAST_OPS)
    _FUNC_INFO[func] = info
    return info


def _flatten(obj, prefix: str = "", depth: int = 0):
    """(index, tensor) pairs of the tensors in a nested output/argument structure."""
    if isinstance(obj, torch.Tensor):
        yield (prefix or "0"), obj
        return
    if depth > 4:
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                yield (f"{prefix}_{i}" if prefix else str(i)), v
            elif isinstance(v, (tuple, list, dict)):
                yield from _flatten(v, f"{prefix}_{i}" if prefix else str(i), depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = str(k).replace(".", "_")
            if isinstance(v, torch.Tensor):
                yield (f"{prefix}_{key}" if prefix else key), v
            elif isinstance(v, (tuple, list, dict)):
                yield from _flatten(v, f"{prefix}_{key}" if prefix else key, depth + 1)


def _upcast(obj, clone: bool):
    """Every low-precision floating tensor (and dtype argument) of a pytree upcast to float32; other tensors
    detached (copied when ``clone``)."""
    def up(x):
        if isinstance(x, torch.Tensor):
            if x.dtype in _LOW_FLOAT:
                return x.detach().to(torch.float32)
            return x.detach().clone() if clone else x.detach()
        if isinstance(x, torch.dtype):
            return torch.float32 if x in _LOW_FLOAT else x
        return x

    return tree_map(up, obj)


def _cuda_devices(obj) -> dict:
    """{device index: None} for the CUDA tensors in a nested structure."""
    out: dict = {}
    for _, t in _flatten(obj):
        if t.is_cuda:
            out[t.device.index] = None
    return out


def _rng_state_of(cuda_devices: dict):
    """(CPU generator state, {device: CUDA generator state}); neither reads device memory."""
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices}


def _dist(getter: str) -> Optional[int]:
    """``torch.distributed.<getter>()`` when a process group is up, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(getattr(dist, getter)())
    except Exception:
        pass
    return None


def _rank() -> int:
    r = _dist("get_rank")
    return r if r is not None else int(os.environ.get("RANK", "0") or 0)


def _world_size() -> int:
    n = _dist("get_world_size")
    return n if n is not None else 1


def policy_description(policy) -> Optional[str]:
    """A JSON description of a dtype policy for the run's ``policy`` column."""
    if policy is None:
        return None
    if isinstance(policy, torch.dtype):
        return json.dumps({"dtype": str(policy).replace("torch.", "")})
    for attr in ("to_json", "describe"):
        fn = getattr(policy, attr, None)
        if callable(fn):
            try:
                out = fn()
                return out if isinstance(out, str) else json.dumps(out, default=str)
            except Exception:
                break
    if dataclasses.is_dataclass(policy):
        try:
            return json.dumps(dataclasses.asdict(policy), default=str)
        except Exception:
            pass
    return json.dumps({"policy": repr(policy)})


class DtypePolicy:
    """The policy a bare torch dtype stands for: cast the model and its floating inputs."""

    _OK = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(self, dtype: torch.dtype):
        if dtype not in self._OK:
            raise ValueError(
                f"dtype_policy={dtype}: a bare dtype can only cast a model to float16, bfloat16, float32 or "
                "float64 (torch cannot run modules with fp8 weights); pass a precision policy with fp8 "
                "fake-quantisation instead"
            )
        self.dtype = dtype

    @property
    def name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def to_json(self) -> str:
        return json.dumps({"dtype": self.name})

    def prepare(self, model):
        return model.to(self.dtype)

    def prepare_inputs(self, inputs):
        return cast_floating(inputs, self.dtype)


def as_policy(dtype_policy):
    if dtype_policy is None or isinstance(dtype_policy, DtypePolicy):
        return dtype_policy
    if isinstance(dtype_policy, torch.dtype):
        return DtypePolicy(dtype_policy)
    if isinstance(dtype_policy, str):
        td = get_format(dtype_policy).torch_dtype()
        if td is None:
            raise ValueError(f"dtype_policy={dtype_policy!r}: no torch dtype for this format")
        return DtypePolicy(td)
    missing = [m for m in ("prepare", "prepare_inputs") if not callable(getattr(dtype_policy, m, None))]
    if missing:
        raise TypeError(
            f"dtype_policy {dtype_policy!r} must be None, a torch dtype, or an object with prepare(model) and "
            f"prepare_inputs(inputs); it has no {' or '.join(missing)}()"
        )
    return dtype_policy


def _backward_name(module_op: str) -> str:
    """``blocks.0.fc1.forward.3`` -> ``blocks.0.fc1.backward.3``."""
    head, _, n = module_op.rpartition(".forward.")
    if head or module_op.startswith("forward."):
        return f"{head}.backward.{n}" if head else "backward." + module_op.split(".", 1)[1]
    return module_op + ".backward"


class _Frame:
    __slots__ = ("module", "path", "op", "op_type", "scope_ok", "record", "inputs", "shadow_in", "start_seq",
                 "rng")

    def __init__(self, module, path, op, op_type, scope_ok, record, start_seq):
        self.module, self.path, self.op, self.op_type = module, path, op, op_type
        self.scope_ok, self.record, self.start_seq = scope_ok, record, start_seq
        self.inputs = None
        self.shadow_in = None
        self.rng = None


class _BackwardOp:
    """One op's backward: gets its seq when its first gradient arrives."""

    __slots__ = ("op", "op_type", "seq", "step", "pending")

    def __init__(self, op, op_type, step):
        self.op, self.op_type, self.step = op, op_type, step
        self.seq = None
        self.pending = {}  # (role, index) -> [expected, arrived, sum]


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
        if info is None or not cap._recording:
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
            cap._hook_error(f"{frame.path}.{info.name}", e)
        finally:
            st.busy = False
        out = func(*args, **kwargs)
        if ctx is not None:
            st.busy = True
            try:
                cap._op_after(ctx, func, args, kwargs, out)
            except Exception as e:
                cap._hook_error(ctx[0], e)
            finally:
                st.busy = False
        return out


class Capture:
    """A live capture; use :func:`capture` to make one."""

    def __init__(self, model, *, run: str = "capture", store=None, session: Optional[str] = None,
                 dtype_policy=None, options: Optional[CaptureOptions] = None, shard_dir=None,
                 kind: Optional[str] = None, source: str = "capture", observer=None, write: bool = True,
                 run_id: Optional[str] = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"capture() needs a torch.nn.Module, got {type(model).__name__}")
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
        self._store_arg = store
        self.session_arg = session
        self.shard_dir = shard_dir
        self.kind = kind
        self.source = source
        self.observer = observer
        self._write = write
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
        self.records: list[TensorRecord] = []
        self.local_comparisons: list[tuple[int, Any]] = []  # (record index, Comparison)
        self.warnings: list[tuple[str, str]] = []
        self.session: Optional[str] = None
        self.step_no = 0
        self._warned: set = set()
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._engine = StatsEngine(options, warn=self._warn)
        self._handles: list = []
        self._step_handles: list = []
        self._mode: Optional[_Mode] = None
        self._active = False
        self._recording = False
        self._seq = 0
        self._counters: dict = {}
        self._pending: list = []  # (TensorRecord, handle) of the current step
        self._node_birth: dict = {}
        self._params_done: set = set()
        self._module_paths: dict = {}
        self._param_owner: dict = {}
        self._shadow_cache: dict = {}
        # decisions that depend only on the options and the op or module, made once per capture
        self._fn_selected: dict = {}  # torch function -> _OpInfo, or None when not recorded
        self._module_info: dict = {}  # id(module) -> (path, op_type, scope_ok, record)
        self._keep_ops: dict = {}  # op name -> whether its tensors are kept whole
        self.shard_files: list = []  # Parquet files written (shard mode)
        self._user_error: Optional[str] = None

    # ---- public ---------------------------------------------------------------
    def prepare_inputs(self, inputs):
        """Apply the dtype policy to model inputs (identity without a policy)."""
        return self.policy.prepare_inputs(inputs) if self.policy is not None else inputs

    def step(self) -> None:
        """End the current step: finish its statistics (one host transfer) and start the next."""
        with self._lock:
            self._end_step()
            self.step_no += 1
            self._begin_step()

    # ---- context manager ------------------------------------------------------
    def __enter__(self) -> "Capture":
        if self._active:
            raise RuntimeError("this capture is already active")
        if self.policy is not None:
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
            self._recording = False
            self._engine.exit()
        if et is not None and not issubclass(et, Exception):
            return False  # KeyboardInterrupt and friends: leave at once
        if et is not None:
            self._user_error = f"{et.__name__}: {ev}"
            self._warn("capture", f"the captured code raised {self._user_error}; records up to that point are kept")
        self._end_step()
        if self._write:
            if et is None:
                self._finish_output()
            else:
                # the user's exception is the one to see; a failed write is noted on it
                try:
                    self._finish_output()
                except Exception as e:
                    ev.add_note(f"precision_lab.capture could not write run {self.run!r}: {type(e).__name__}: {e}")
        return False

    # ---- installing hooks --------------------------------------------------------
    def _install(self) -> None:
        opts = self.options
        for path, mod in self.model.named_modules():
            self._module_paths[id(mod)] = path
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))
            if opts.backward and opts.params and opts.module_selected(path) and opts.op_type_selected(
                    type(mod).__name__):
                for pname, p in mod.named_parameters(recurse=False):
                    if id(p) in self._param_owner or not p.requires_grad:
                        continue
                    # a parameter's gradient is produced by its module's backward
                    op = f"{path}.backward.0" if path else "backward.0"
                    self._param_owner[id(p)] = (op, type(mod).__name__, pname)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._param_grad_hook))
        if opts.functional:
            self._mode = _Mode(self)
            self._mode.__enter__()

    def _uninstall(self) -> None:
        err = None
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as e:  # a mode pushed by user code on top of ours
                err = e
            self._mode = None
        for h in self._handles + self._step_handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles.clear()
        self._step_handles.clear()
        self._shadow_cache.clear()
        if err is not None:
            self._warn("capture", f"could not pop the capture's function mode cleanly: {err}")

    # ---- steps -------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._recording = self._active and self.options.step_selected(self.step_no)
        self._seq = 0
        self._counters.clear()
        self._node_birth.clear()
        self._params_done.clear()
        self._shadow_cache.clear()
        self._engine.new_step()
        tls = self._tls
        tls.stack = []
        tls.busy = False

    def _end_step(self) -> None:
        if not self._pending:
            self._engine.new_step()
            return
        try:
            self._engine.resolve()
        except Exception as e:
            self._hook_error("statistics", e)
        step_records = []
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
        for h in self._step_handles:
            try:
                h.remove()
            except Exception:
                pass
        self._step_handles.clear()
        base = len(self.records)
        self.records.extend(step_records)
        if self.shard_dir is not None and self._write and step_records:
            self._write_step_shard(step_records, base)

    # ---- recording -----------------------------------------------------------------------
    def _warn(self, where: str, message: str) -> None:
        key = (where, message)
        with self._lock:
            if key in self._warned or len(self.warnings) >= self.options.max_warnings:
                return
            self._warned.add(key)
            self.warnings.append((where, message))

    def _hook_error(self, where: str, e: BaseException) -> None:
        self._warn(where, f"capture hook error ({type(e).__name__}: {e}); the step ran unchanged")

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

    def _next_name(self, path: str, opname: str) -> str:
        key = (path, opname)
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return f"{path}.{opname}.{n}" if path else f"{opname}.{n}"

    def _measure(self, op: str, t: torch.Tensor, hold: bool = False):
        return self._engine.measure(t, op, hold=hold)

    def _add(self, seq, op, op_type, role, index, handle, direction="forward", tensor=None, step=None) -> int:
        """Note one record of the current step (its TensorRecord is made when the step ends); its position."""
        item = (seq, op, op_type, role, index, direction, self.step_no if step is None else step, tensor, handle)
        with self._lock:
            self._pending.append(item)
            return len(self.records) + len(self._pending) - 1

    def _make_record(self, item, stats) -> TensorRecord:
        seq, op, op_type, role, index, direction, step, tensor, _ = item
        return TensorRecord(run_id=self.run_id, seq=seq, op=op, op_type=op_type, role=role, index=str(index),
                            stats=stats, step=step, rank=self.rank, direction=direction, source="capture",
                            tensor=tensor)

    def _keep(self, op: str, t: torch.Tensor):
        if not self.options.keep_tensors:
            return None
        keep = self._keep_ops.get(op)
        if keep is None:
            keep = self._keep_ops[op] = self.options.keep_selected(op)
        if not keep:
            return None
        if t.layout != torch.strided or t.device.type == "meta" or t.is_complex():
            self._warn(op, f"{t.layout} {str(t.dtype).replace('torch.', '')} tensor not kept: only dense real "
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
            self._hook_error(rec.op, e)

    # -- functional ops
    def _op_before(self, frame: _Frame, info: _OpInfo, args, kwargs):
        op = self._next_name(frame.path, info.name)
        ins = self._measure_inputs(op, args, kwargs)
        shadow = None
        rng = None
        if self.options.local_error:
            inplace = info.inplace or kwargs.get("out") is not None or kwargs.get("inplace") is True
            shadow = (_upcast(args, clone=inplace), _upcast(kwargs, clone=inplace))
            rng = _rng_state_of(_cuda_devices((args, kwargs)))
        return (op, info, ins, self._seq, shadow, rng)

    def _op_after(self, ctx, func, args, kwargs, out):
        op, info, ins, start_seq, shadow, rng = ctx
        if info.name == "setitem":
            # x[i] = v returns nothing; its result is the mutated x
            outs = list(_flatten(args[0] if args else None))
        else:
            outs = list(_flatten(out))
        if not outs:
            return
        out_recs = self._record_call(op, info.name, ins, outs, start_seq, f"{op}.backward")
        if shadow is not None and out_recs:
            self._local_functional(op, info, func, shadow, rng, out_recs)

    def _measure_inputs(self, op, args, kwargs) -> list:
        """(role, index, tensor, handle) of a call's tensor arguments."""
        ins = []
        for idx, t in _flatten(args):
            h = self._measure(op, t)
            if h is not None:
                ins.append(("input", idx, t, h))
        if kwargs:
            for idx, t in _flatten(kwargs):
                h = self._measure(op, t)
                if h is not None:
                    ins.append(("kwarg", idx, t, h))
        return ins

    def _record_call(self, op, op_type, ins, outs, start_seq, backward_op) -> list:
        """Record a finished op or module call: its inputs, its outputs and the hooks on its backward.

        Returns (index, tensor, position) of the recorded outputs, for the local error.
        """
        seq = self._take_seq()
        for role, idx, t, h in ins:
            pos = self._add(seq, op, op_type, role, idx, h, tensor=self._keep(op, t))
            self._observe(pos, t, h)
        out_recs = []
        for idx, t in outs:
            h = self._measure(op, t)
            if h is None:
                continue
            pos = self._add(seq, op, op_type, "output", idx, h, tensor=self._keep(op, t))
            self._observe(pos, t, h)
            out_recs.append((idx, t, pos))
        self._mark_outputs(outs, seq)
        if self.options.backward and torch.is_grad_enabled():
            # a parameter's gradient is recorded as its param_grad, not through the graph walk
            self._register_backward(backward_op, op_type, [(r, i, t) for r, i, t, _ in ins if r != "param"],
                                    outs, start_seq)
        return out_recs

    def _take_seq(self) -> int:
        with self._lock:
            s = self._seq
            self._seq += 1
            return s

    def _mark_outputs(self, outs, seq) -> None:
        for _, t in outs:
            gf = t.grad_fn
            if gf is not None:
                self._node_birth.setdefault(id(gf), seq)

    # -- modules
    def _pre_hook(self, module, args, kwargs):
        tls = self._tls
        if not self._recording or getattr(tls, "busy", False):
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
            ins = self._measure_inputs(op, args, kwargs)
            if self.options.params and id(module) not in self._params_done:
                self._params_done.add(id(module))
                for pname, p in module.named_parameters(recurse=False):
                    h = self._measure(op, p)
                    if h is not None:
                        ins.append(("param", pname, p, h))
            frame.inputs = ins
            if self.options.local_error:
                frame.shadow_in = (_upcast(args, clone=True), _upcast(kwargs, clone=True))
                devs = _cuda_devices((args, kwargs))
                devs.update(_cuda_devices(list(module.parameters())))
                frame.rng = _rng_state_of(devs)
        except Exception as e:
            self._hook_error(self._module_paths.get(id(module), "?"), e)
        finally:
            tls.busy = False
        return None

    def _post_hook(self, module, args, kwargs, output):
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
        if frame is None or not frame.record or not self._recording or frame.inputs is None:
            return None
        tls.busy = True
        try:
            op = frame.op
            out_recs = self._record_call(op, frame.op_type, frame.inputs, list(_flatten(output)),
                                         frame.start_seq, _backward_name(op))
            if frame.shadow_in is not None and out_recs:
                self._local_module(frame, out_recs)
        except Exception as e:
            self._hook_error(frame.op, e)
        finally:
            tls.busy = False
        return None

    # -- backward
    def _register_backward(self, op, op_type, ins, outs, start_seq) -> None:
        nodes: dict = {}
        for idx, t in outs:
            gf = t.grad_fn
            if gf is not None and t.requires_grad:
                nodes.setdefault(gf, []).append((idx, t.output_nr))
        if not nodes:
            return
        bop = _BackwardOp(op, op_type, self.step_no)
        # the edges through which this op hands gradient to its inputs
        nonleaf: dict = {}
        leaf: dict = {}
        for role, idx, t in ins:
            if not t.requires_grad:
                continue
            if t.grad_fn is not None:
                nonleaf.setdefault((id(t.grad_fn), t.output_nr), []).append((role, idx))
            elif id(t) not in self._param_owner:  # a recorded parameter's gradient is its param_grad
                leaf.setdefault(id(t), []).append((role, idx))
        # an output that is one of the inputs (x.float() on a float32 x, x.to(x.dtype))
        # passes its gradient straight through: grad_input is its grad_output
        for node, outputs in nodes.items():
            through = {}
            for oidx, nr in outputs:
                for role, idx in nonleaf.pop((id(node), nr), ()):
                    through.setdefault(oidx, []).append((role, idx))
            self._step_handles.append(node.register_prehook(self._make_grad_output_hook(bop, outputs, through)))
        if not nonleaf and not leaf:
            return
        hits: dict = {}  # node -> [(k, role, idx)]
        seen = set()
        frontier = list(nodes)
        birth = self._node_birth
        while frontier and len(seen) < _MAX_WALK_NODES:
            n = frontier.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            for k, (nx, nr) in enumerate(n.next_functions):
                if nx is None:
                    continue
                targets = nonleaf.get((id(nx), nr))
                if targets is None and not nx.next_functions and hasattr(nx, "variable"):
                    targets = leaf.get(id(nx.variable))
                if targets is not None:
                    for role, idx in targets:
                        hits.setdefault(n, []).append((k, role, idx))
                    continue
                b = birth.get(id(nx))
                if b is not None and b < start_seq:
                    continue  # made by an earlier op: outside this one
                if nx.next_functions:
                    frontier.append(nx)
        for n, lst in hits.items():
            for _, role, idx in lst:
                entry = bop.pending.setdefault((role, idx), [0, 0, None])
                entry[0] += 1
            self._step_handles.append(n.register_hook(self._make_grad_input_hook(bop, lst)))

    def _bw_seq(self, bop: _BackwardOp) -> int:
        with self._lock:
            if bop.seq is None:
                bop.seq = self._take_seq()
            return bop.seq

    def _add_grad(self, seq, bop: _BackwardOp, role, index, g, h) -> None:
        pos = self._add(seq, bop.op, bop.op_type, role, index, h, "backward", tensor=self._keep(bop.op, g),
                        step=bop.step)
        self._observe(pos, g, h)

    def _make_grad_output_hook(self, bop, outputs, through):
        def hook(grad_outputs):
            if not self._recording:
                return None
            try:
                seq = self._bw_seq(bop)
                for idx, nr in outputs:
                    g = grad_outputs[nr] if nr < len(grad_outputs) else None
                    if g is None:
                        continue
                    h = self._measure(bop.op, g, hold=True)
                    if h is None:
                        continue
                    self._add_grad(seq, bop, "grad_output", idx, g, h)
                    for role, in_idx in through.get(idx, ()):
                        self._add_grad(seq, bop, "grad_input", in_idx if role == "input" else f"{role}_{in_idx}",
                                       g, h)
            except Exception as e:
                self._hook_error(bop.op, e)
            return None

        return hook

    def _make_grad_input_hook(self, bop, lst):
        def hook(grad_inputs, grad_outputs):
            if not self._recording:
                return None
            try:
                seq = self._bw_seq(bop)
                for k, role, idx in lst:
                    g = grad_inputs[k] if k < len(grad_inputs) else None
                    entry = bop.pending.get((role, idx))
                    if entry is None:
                        continue
                    entry[1] += 1
                    if g is not None:
                        entry[2] = g if entry[2] is None else entry[2] + g
                    if entry[1] < entry[0] or entry[2] is None:
                        continue
                    total = entry[2]
                    entry[2] = None
                    out_idx = idx if role == "input" else f"{role}_{idx}"
                    h = self._measure(bop.op, total, hold=True)
                    if h is not None:
                        self._add_grad(seq, bop, "grad_input", out_idx, total, h)
            except Exception as e:
                self._hook_error(bop.op, e)
            return None

        return hook

    def _param_grad_hook(self, p) -> None:
        if not self._recording:
            return
        owner = self._param_owner.get(id(p))
        if owner is None or p.grad is None:
            return
        op, op_type, pname = owner
        try:
            g = p.grad
            h = self._measure(op, g, hold=True)
            if h is not None:
                seq = self._take_seq()
                pos = self._add(seq, op, op_type, "param_grad", pname, h, "backward", tensor=self._keep(op, g))
                self._observe(pos, g, h)
        except Exception as e:
            self._hook_error(op, e)

    # -- local (shadow) error
    def _local_functional(self, op, info, func, shadow, rng, out_recs) -> None:
        sargs, skwargs = shadow
        with torch.no_grad():
            if info.cast:
                first = next((t for _, t in _flatten(sargs)), None)
                if first is None:
                    return
                ref = first.to(torch.float32) if first.is_floating_point() else first
                ref_outs = {"0": ref}
            else:
                if not any(t.is_floating_point() for _, t in _flatten((sargs, skwargs))):
                    return
                ref_out = self._with_rng(rng, lambda: func(*sargs, **skwargs))
                ref_outs = dict(_flatten(ref_out))
        self._store_local(op, ref_outs, out_recs)

    def _local_module(self, frame: _Frame, out_recs) -> None:
        module = frame.module
        shadow = self._shadow_cache.get(id(module))
        if shadow is False:
            return
        if shadow is None:
            # the module's hooks refer to this capture: share it, do not copy it
            try:
                shadow = copy.deepcopy(module, {id(self): self})
            except Exception as e:
                self._warn(frame.op, f"local error unavailable: the module cannot be copied for its fp32 re-run "
                                     f"({type(e).__name__}: {e})")
                self._shadow_cache[id(module)] = False
                return
            for t in list(shadow.parameters()) + list(shadow.buffers()):
                if t.dtype in _LOW_FLOAT:
                    t.data = t.data.to(torch.float32)
            # the copy runs the module's own forward in fp32: no hooks (the user's, a
            # policy's input casts, ours) come with it
            for m in shadow.modules():
                for attr in _HOOK_DICTS:
                    d = getattr(m, attr, None)
                    if d:
                        d.clear()
            self._shadow_cache[id(module)] = shadow
        sargs, skwargs = frame.shadow_in
        with torch.no_grad():
            ref_out = self._with_rng(frame.rng, lambda: shadow(*sargs, **skwargs))
        self._store_local(frame.op, dict(_flatten(ref_out)), out_recs)

    def _with_rng(self, state, fn):
        """Run ``fn`` with the RNG state the op itself saw, then restore the current one.

        A random op (dropout) re-run in fp32 then draws the numbers the op drew,
        and the user's next random op draws what it would have without capture.
        """
        if state is None:
            return fn()
        cpu, cuda = state
        cur = _rng_state_of(cuda)
        torch.set_rng_state(cpu)
        for dev, st in cuda.items():
            torch.cuda.set_rng_state(st, dev)
        try:
            return fn()
        finally:
            torch.set_rng_state(cur[0])
            for dev, st in cur[1].items():
                torch.cuda.set_rng_state(st, dev)

    def _store_local(self, op, ref_outs: dict, out_recs) -> None:
        for idx, t, pos in out_recs:
            ref = ref_outs.get(idx)
            if ref is None or not isinstance(ref, torch.Tensor):
                self._warn(op, f"local error: the fp32 re-run gave no output {idx}")
                continue
            if tuple(ref.shape) != tuple(t.shape):
                self._warn(op, f"local error: fp32 re-run output {idx} has shape {tuple(ref.shape)}, "
                               f"the op's has {tuple(t.shape)}")
                continue
            if not (t.is_floating_point() and ref.is_floating_point()):
                continue
            fmt = format_for_dtype(t.dtype)
            cmp = compare(ref.detach(), t.detach(), cand_format=fmt.name if fmt else None)
            with self._lock:
                self.local_comparisons.append((pos, cmp))

    # ---- output ----------------------------------------------------------------------------
    def run_meta(self) -> dict:
        return {
            "run_id": self.run_id, "name": self.run, "dtype": self.dominant_dtype(), "kind": self.run_kind(),
            "parent_run_id": None, "fix": None, "policy": policy_description(self.policy),
            "source": self.source, "order": "execution",
        }

    def dominant_dtype(self) -> str:
        counts: dict = {}
        for r in self.records:
            if r.role == "output" and r.direction == "forward" and r.stats is not None:
                counts[r.stats.dtype] = counts.get(r.stats.dtype, 0) + 1
        floats = {k: v for k, v in counts.items() if "float" in k}
        pick = floats or counts
        return max(pick, key=pick.get) if pick else ""

    def run_kind(self) -> str:
        if self.kind:
            return self.kind
        return "reference" if self.policy is None and self.dominant_dtype() in ("float32", "float64") else "candidate"

    def write_run(self, w) -> list[int]:
        """Add this run, its records, local comparisons and warnings to a session writer; returns the rids."""
        meta = self.run_meta()
        w.add_run(RunInfo(session_id=w.session_id, **meta))
        rids = [w.add_record(rec) for rec in self.records]
        for pos, cmp in self.local_comparisons:
            if pos >= len(rids):
                continue
            rec = self.records[pos]
            w.add_comparison(kind="local", ref_run_id=self.run_id, ref_rid=None, cand_run_id=self.run_id,
                             cand_rid=rids[pos], step=rec.step, rank=rec.rank, seq=rec.seq, op=rec.op,
                             role=rec.role, index=rec.index, match="exact", comparison=cmp)
        for where, msg in self.warnings:
            w.add_warning(where, msg, run_id=self.run_id)
        return rids

    def _finish_output(self) -> None:
        if self.shard_dir is not None:
            meta = self.run_meta()
            meta["warnings"] = [{"where": a, "message": b} for a, b in self.warnings]
            write_manifest(self.shard_dir, [meta])
            self.session = None
            return
        store = self._store_arg  # a Store, or any sink with new_session/extend_session
        notes = {"capture": {"run": self.run, "steps": self.step_no + 1, "options": repr(self.options)}}
        if self.session_arg:
            with store.extend_session(self.session_arg) as w:
                self.write_run(w)
                self.session = w.name
        else:
            with store.new_session(self.run, source=self.source, notes=notes) as w:
                self.write_run(w)
                self.session = w.name

    def _write_step_shard(self, step_records, base) -> None:
        local = {}
        for pos, cmp in self.local_comparisons:
            if base <= pos < base + len(step_records):
                local[pos - base] = cmp
        meta = self.run_meta()
        path = write_shard(self.shard_dir, meta, step_records, rank=self.rank, step=self.step_no,
                           local_comparisons=local)
        self.shard_files.append(path)


def capture(model, *, run: str = "capture", store=None, session: Optional[str] = None, dtype_policy=None,
            options: Optional[CaptureOptions] = None, shard_dir=None) -> Capture:
    """Record per-op statistics of ``model`` while the ``with`` block runs.

    ``with precision_lab.capture(model, run="fp16", dtype_policy=torch.float16) as cap:``
    then run forward (and backward) on ``cap.model`` with inputs from
    ``cap.prepare_inputs(...)``; call ``cap.step()`` between training steps.

    On exit the records go to ``store`` (a :class:`~precision_lab.store.Store`,
    or any object with its ``new_session``/``extend_session``; the package's
    ``precision_lab.capture`` also takes a database path, None meaning the
    default database) in one transaction
    -- a new session named after the run, or a new run in ``session`` -- or,
    with ``shard_dir``, to Parquet shards (one file per rank and step plus
    ``manifest.json``), for a process that cannot hold the database.

    ``dtype_policy``: None (run as is), a torch dtype (``torch.float16``,
    ``torch.bfloat16``: the model and floating inputs are cast), or any
    object with ``prepare(model) -> model`` and ``prepare_inputs(inputs)``.
    Use ``cap.model``: a policy may return a new module.
    """
    return Capture(model, run=run, store=store, session=session, dtype_policy=dtype_policy, options=options,
                   shard_dir=shard_dir)

"""An fp32 reference and a low-precision candidate of the same model, compared op by op.

``capture_pair`` runs the reference first and keeps a copy of each tensor it
records (a GPU tensor on its own device up to a device budget, so comparing
it needs no copy to the host; then in host memory up to a budget, then in a
temporary folder on disk), then
runs the candidate and compares each of its tensors with the reference
tensor of the same name *as it is produced*, so nothing of the candidate is
kept and the comparison is element-wise for every recorded tensor.  The
reference copies are deleted when the pair is written.
"""

from __future__ import annotations

import os
from functools import partial
import shutil
import tempfile
import weakref
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from ..fixes.policy import DYNAMIC_INIT_SCALE, call_model
from ..formats import format_for_dtype, get_format
from ..live.options import DEFAULT_DEVICE_KEEP_BYTES, DEFAULT_KEEP_BYTES, CaptureOptions, PairOptions
from ..live.policies import as_policy, policy_description
from ..live.recorder import Capture
from ..live.replaykit import load_kit
from ..metrics import Comparison, PendingComparison, compare, compare_later, compare_stats, finish_all
from ..stats import canonical_dtype
from ..store import Store
from .capture_sink import StoreSink, diagnose_captured, diagnose_written
from .pairing import Item, match_records, verdict_format

__all__ = ["capture", "capture_pair", "PairOptions", "scaled_backward", "run_steps", "replay_capture", "replay_steps",
           "optimizer_step", "DEFAULT_KEEP_BYTES", "DEFAULT_DEVICE_KEEP_BYTES"]


def _key(rec) -> tuple:
    return (rec.step, rec.rank, rec.direction, rec.name)


class _ReferenceKeeper:
    """Keeps the reference run's tensors by record name, bounded in memory."""

    def __init__(self, budget_bytes: int, device_budget_bytes: int = DEFAULT_DEVICE_KEEP_BYTES):
        self.budget = budget_bytes
        self.used = 0
        self.device_budget = device_budget_bytes
        self.device_used = 0
        self._mem: dict = {}  # storage key -> tensor (on its device, or cpu) or path
        self._by_key: dict = {}  # record key -> (pos, storage key)
        self._ident: dict = {}  # (id, version) -> storage key, to store a shared tensor once
        self._dir: Optional[str] = None
        self._n = 0

    def on_record(self, cap, pos, rec, t, handle) -> None:
        k = _key(rec)
        if k in self._by_key:
            return
        sk = None
        try:
            ident = (id(t), t._version)
        except Exception:
            ident = None
        if ident is not None:
            hit = self._ident.get(ident)
            if hit is not None and hit[0]() is t:
                sk = hit[1]
        if sk is None:
            sk = self._store(t)
            if ident is not None:
                self._ident[ident] = (weakref.ref(t), sk)
        self._by_key[k] = (pos, sk)

    def _store(self, t) -> int:
        sk = self._n
        self._n += 1
        c = t.detach()
        nbytes = c.numel() * c.element_size()
        kept = None
        if c.device.type != "cpu" and self.device_used + nbytes <= self.device_budget:
            try:
                kept = c.clone()  # stays on the device: no host copy, no sync
            except torch.OutOfMemoryError:  # the model needs that memory: to the host instead
                kept = None
        if kept is not None:
            self._mem[sk] = kept
            self.device_used += nbytes
        elif self.used + nbytes <= self.budget:
            self._mem[sk] = c.to("cpu", copy=True)
            self.used += nbytes
        else:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="precision-lab-ref-")
            path = os.path.join(self._dir, f"{sk}.npy")
            arr = c.cpu()
            if arr.dtype not in (torch.float32, torch.float64) and arr.is_floating_point():
                arr = arr.to(torch.float32)  # numpy has no bf16/fp8: float32 holds them exactly
            np.save(path, arr.numpy(), allow_pickle=False)
            self._mem[sk] = path
        return sk

    def drop_objects(self) -> None:
        self._ident.clear()

    def lookup(self, rec):
        """(reference position, storage key, tensor) for a candidate record, or None."""
        hit = self._by_key.get(_key(rec))
        if hit is None:
            return None
        pos, sk = hit
        v = self._mem[sk]
        if isinstance(v, str):
            v = torch.from_numpy(np.load(v, allow_pickle=False))
        return pos, sk, v

    def positions(self) -> dict:
        return {k: pos for k, (pos, _) in self._by_key.items()}

    def close(self) -> None:
        self._mem.clear()
        self._by_key.clear()
        self._ident.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _declared_dtype(policy) -> Optional[str]:
    """The narrowest format a policy says its values pass through (a torch dtype name), if it says one.

    That is its compute dtype (its autocast format under autocast), or its
    fake-quantisation format when that is coarser (fp8 inside an fp16 run):
    quantisation noise is the rounding the candidate is entitled to, not an
    error.
    """

    def fmt_of(d):
        if d is None:
            return None
        try:
            return get_format(d) if isinstance(d, str) else format_for_dtype(d)
        except (KeyError, ValueError):
            return None

    fmt = fmt_of(getattr(policy, "dtype", None))
    auto = fmt_of(getattr(policy, "autocast", None))
    if auto is not None:  # under autocast the values pass through its format, whatever the parameters hold
        fmt = auto
    quant = getattr(policy, "quant", None)
    qfmt = fmt_of(getattr(quant, "format", None)) if quant is not None else None
    if qfmt is not None and qfmt.torch_name and (fmt is None or qfmt.eps > fmt.eps):
        fmt = qfmt
    return fmt.torch_name if fmt is not None and fmt.torch_name else None


def judged_run_dtype(policy, dominant: Optional[str]) -> Optional[str]:
    """The run dtype comparisons of a candidate run are judged against (``pairing.verdict_format``).

    The coarser of what the policy declares (see ``_declared_dtype``) and
    the dtype the run's outputs mostly had.
    """
    declared = _declared_dtype(policy)
    if declared is None or dominant is None:
        return declared or dominant
    a, b = format_for_dtype(declared), format_for_dtype(dominant)
    if a is None or b is None:
        return dominant
    return declared if a.eps > b.eps else dominant


class _Comparer:
    """Compares each candidate tensor with its reference as it is recorded.

    The format a tensor is judged against is ``pairing.verdict_format`` of
    its dtype and the run's compute dtype -- the rule every other comparison
    of two runs uses.  The run's dtype (its dominant output dtype) is known
    only when the run ends, so the comparisons are made with the dtype the
    policy declares and :meth:`settle` checks them against the real one.
    """

    def __init__(self, keeper: _ReferenceKeeper, run_dtype: Optional[str], *, deferred_cpu: bool = False):
        self.keeper = keeper
        self.run_dtype = run_dtype
        # GPU tensors are compared on their device and their sums brought to the host together when the run
        # ends (``resolve``): no host sync per op.  ``deferred_cpu`` takes that path for CPU tensors too (tests).
        self.deferred_cpu = deferred_cpu
        self.results: dict = {}  # candidate position -> (reference position | None, Comparison | None, match)
        self._cache: dict = {}

    def on_record(self, cap, pos, rec, t, handle) -> None:
        hit = self.keeper.lookup(rec)
        if hit is None:
            self.results[pos] = (None, None, "unmatched_cand")
            return
        ref_pos, sk, ref = hit
        try:
            ident = (id(t), t._version, sk)
        except Exception:
            ident = None
        hit = self._cache.get(ident) if ident is not None else None
        if hit is not None and hit[0]() is t:
            cmp = hit[1]
        else:
            cmp = self._compare(ref, t, cap, rec)
            if ident is not None:
                self._cache[ident] = (weakref.ref(t), cmp)
        self.results[pos] = (ref_pos, cmp, "exact")

    def _compare(self, ref, t, cap, rec):
        t = t.detach()
        if t.is_complex() or ref.is_complex():
            return None
        if tuple(ref.shape) != tuple(t.shape):
            cap.warn(rec.op, f"{rec.name}: reference shape {tuple(ref.shape)} differs from candidate "
                             f"{tuple(t.shape)}; compared by summary statistics")
            return "stats"
        fmt = verdict_format(canonical_dtype(t.dtype), self.run_dtype)
        if t.device != ref.device:
            ref = ref.to(t.device)
        if t.device.type != "cpu" or self.deferred_cpu:
            return compare_later(ref, t, cand_format=fmt)
        return compare(ref, t, cand_format=fmt)

    def clear_cache(self) -> None:
        self._cache.clear()

    def resolve(self) -> None:
        """Finish every comparison still on a device, all in one transfer per device."""
        pending = {id(c): c for _, c, _ in self.results.values() if isinstance(c, PendingComparison)}
        if not pending:
            return
        done = dict(zip(pending, finish_all(list(pending.values()))))
        for pos, (ref_pos, cmp, match) in self.results.items():
            if isinstance(cmp, PendingComparison):
                self.results[pos] = (ref_pos, done[id(cmp)], match)

    def settle(self, cand_cap: Capture) -> None:
        """Re-judge by summary statistics the comparisons made against a format the real run dtype rejects."""
        actual = judged_run_dtype(cand_cap.policy, cand_cap.dominant_dtype() or None)
        if actual == self.run_dtype:
            return
        changed = 0
        for pos, (ref_pos, cmp, match) in self.results.items():
            if cmp is None or cmp == "stats":
                continue
            dtype = cand_cap.records[pos].stats.dtype
            if verdict_format(dtype, actual) != verdict_format(dtype, self.run_dtype):
                self.results[pos] = (ref_pos, "stats", match)
                changed += 1
        if changed:
            cand_cap.warn("capture_pair", f"the candidate ran mostly in {actual}, not the {self.run_dtype} its "
                                          f"policy declares; {changed} tensors were compared by summary "
                                          "statistics against the format that rule gives")


def run_steps(cap: Capture, inputs, loss_fn, seed: int, optimizer_fn: Optional[Callable] = None, steps: int = 1):
    """Run the model under ``cap``: once, or with a loss and an optimizer ``steps`` training steps on the same
    inputs (backward under the policy's loss scale, ``scaled_backward``; then ``optimizer_step``); the last
    output."""
    out = None
    with cap:
        opt = optimizer_fn([p for p in cap.model.parameters() if p.requires_grad]) \
            if optimizer_fn is not None and loss_fn is not None else None
        for i in range(steps if opt is not None else 1):
            if i:
                cap.step()
            x = cap.prepare_inputs(inputs)
            torch.manual_seed(seed)
            out = call_model(cap.model, x)
            if loss_fn is not None:
                loss = loss_fn(out)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a one-element tensor, got "
                                     f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
                scaled_backward(cap, loss)
                if opt is not None:
                    optimizer_step(cap, opt)
    return out


def replay_capture(model, kit_file: str, policy, *, loss_fn: Callable, optimizer_fn: Callable, run_name: str,
                   kind: str, source: str, options: CaptureOptions) -> tuple[Capture, object]:
    """Replay the steps a training capture kept (the replay kit at ``kit_file``) on ``model`` (built as the
    job's, fp32) under ``policy`` (None: fp32, no GradScaler): the kept state loaded, the job's GradScaler with
    the policy's settings over it; ``(capture, the last output)``."""
    kit = load_kit(kit_file)
    kit.restore_model(model)
    p = next(model.parameters(), None)
    scaler = kit.grad_scaler(p.device.type if p is not None else "cpu",
                             tuple(policy.scaler_settings().items()) if policy is not None else (),
                             enabled=policy is not None and bool(policy.grad_scaler))
    cap = Capture(model, run=run_name, dtype_policy=policy, options=options, write=False, kind=kind, source=source,
                  grad_scaler=scaler)
    return cap, replay_steps(cap, kit, loss_fn, optimizer_fn, scaler)


def replay_steps(cap: Capture, kit, loss_fn: Callable, optimizer_fn: Callable, scaler=None):
    """Replay a kept training run's steps (``live.replaykit.ReplayKit``) under ``cap``: the optimizer built by
    ``optimizer_fn`` and loaded with the kept state, each step's random state and batch as the job had them,
    ``scaler`` (a GradScaler in the kept state, or None) scaling the loss and stepping; the last output."""
    if loss_fn is None or optimizer_fn is None:
        raise ValueError("replaying training steps needs the recipe's loss_fn and optimizer_fn")
    out = None
    cap.step_no = kit.from_step
    with cap:
        opt = optimizer_fn([p for p in cap.model.parameters() if p.requires_grad])
        kit.restore_optimizer(opt)
        p = next(cap.model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        for i, st in enumerate(kit.steps):
            if i:
                cap.step()
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(device), (st.args, st.kwargs))
            st.set_groups(opt)
            st.set_rng()
            out = cap.model(*args, **kwargs)
            loss = loss_fn(out)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            else:  # the policy's own loss scale and skipped steps, as a recipe's training runs them
                scaled_backward(cap, loss)
                optimizer_step(cap, opt)
    return out


def optimizer_step(cap: Capture, opt) -> None:
    """``opt.step()`` on the gradients unscaled in place (``Capture.grad_scale``), then ``zero_grad``; skipped
    (and said in a warning) where the policy skips non-finite steps and a gradient holds NaN/inf, as
    GradScaler's ``scaler.step`` does."""
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if cap.grad_scale:
        for g in grads:
            g.div_(cap.grad_scale)
    if getattr(cap.policy, "skip_nonfinite_step", False) and not all(bool(torch.isfinite(g).all()) for g in grads):
        cap.warn("optimizer", f"step {cap.step_no} skipped: its gradients hold NaN/inf")
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


MIN_LOSS_SCALE = 2.0 ** -24  # a dynamic scale goes below 1 where the loss itself overflows the gradients


def scaled_backward(cap: Capture, loss) -> None:
    """``loss.backward()`` under the capture policy's loss scale: the loss is multiplied by the scale and the
    gradients recorded divided by it (``Capture.grad_scale``).  A ``"dynamic"`` scale is GradScaler's backoff on
    this one batch: from ``DYNAMIC_INIT_SCALE``, halved while any parameter's gradient is not finite (those tries
    are not recorded, as GradScaler skips their steps), down to ``MIN_LOSS_SCALE``.  The parameters' ``.grad``
    stay scaled; the records hold the gradients unscaled in fp32 (fp32 master gradients)."""
    scale = getattr(cap.policy, "loss_scale", None)
    if scale is None:
        loss.backward()
        return
    if scale == "dynamic":
        params = [p for p in cap.model.parameters() if p.requires_grad]
        scale = DYNAMIC_INIT_SCALE
        with cap.paused():
            # a loss that is itself NaN/Inf has no scale that makes its gradients finite: no search
            while scale > MIN_LOSS_SCALE and params and bool(torch.isfinite(loss).all()):
                grads = torch.autograd.grad(loss * scale, params, retain_graph=True, allow_unused=True)
                if all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                    break
                scale /= 2.0
    cap.grad_scale = float(scale)
    (loss * scale).backward()


def capture(model, *, run: str = "capture", store=None, session: Optional[str] = None, dtype_policy=None,
            options: Optional[CaptureOptions] = None, shard_dir=None, grad_scaler=None, optimizer=None,
            recipe=None) -> Capture:
    """Record per-op statistics of ``model`` while the ``with`` block runs (``precision_lab.capture``).

    ``with precision_lab.capture(model, run="fp16", dtype_policy=torch.float16) as cap:``
    then run forward (and backward) on ``cap.model`` with inputs from
    ``cap.prepare_inputs(...)``; call ``cap.step()`` between training steps.

    On exit the records go to ``store`` (a database path, None meaning the
    default database, opened only when the capture writes; or a
    :class:`~precision_lab.store.Store`, or any object with its
    ``new_session``/``extend_session``) in one transaction -- a new session
    named after the run, or a new run in ``session`` -- or, with
    ``shard_dir``, to Parquet shards (one file per rank and step plus
    ``manifest.json``), for a process that cannot hold the database.

    ``dtype_policy``: None (run as is), a torch dtype (``torch.float16``,
    ``torch.bfloat16``: the model and floating inputs are cast), or any
    object with ``prepare(model) -> model`` and ``prepare_inputs(inputs)``.
    Use ``cap.model``: a policy may return a new module.  Returns the
    ``live.Capture`` that records.

    ``grad_scaler``: the job's ``torch.amp.GradScaler``: each step's gradients are recorded divided by the
    scale that step's backward used (as its ``unscale_`` does), and that scale is the step's ``loss_scale``.

    ``optimizer`` (with ``options=CaptureOptions(every=N, keep_last=K)``): the job's optimizer; when a step
    first holds an unexpected NaN/Inf, the state the step before it started from (model, optimizer, GradScaler,
    random state) and the batches of both are kept beside the database (``live.replaykit``), and ``recipe`` (a
    ``Recipe`` or a registered recipe's name: what builds this model and its loss and optimizer again) lets
    ``precision-lab rerun`` and the dashboard replay those steps under a fix.  A new session is diagnosed as it
    is written.
    """
    recipe_name = getattr(recipe, "name", recipe)
    if recipe_name is not None and not isinstance(recipe_name, str):
        raise TypeError(f"capture(recipe=...) needs a Recipe or a recipe's name, got {type(recipe).__name__}")
    if shard_dir is None and (store is None or isinstance(store, (str, os.PathLike, Store))):
        store = StoreSink(None, store) if isinstance(store, Store) else StoreSink(store)
    diagnosed = isinstance(store, StoreSink) and shard_dir is None
    return Capture(model, run=run, store=store, session=session, dtype_policy=dtype_policy, options=options,
                   shard_dir=shard_dir, grad_scaler=grad_scaler, optimizer=optimizer, recipe=recipe_name,
                   on_written=partial(diagnose_written, store) if diagnosed else None)


def capture_pair(build_model: Callable[[], torch.nn.Module], inputs, candidate_policy, *, store,
                 pair: Optional[PairOptions] = None, options: Optional[CaptureOptions] = None,
                 session: Optional[str] = None, name: Optional[str] = None) -> str:
    """Capture an fp32 reference and a candidate run of one model; returns the session name.  ``pair``
    (``PairOptions``) says how the two runs are made (their names, seed, loss and optimizer, local error, how
    much of the reference is kept where), ``options`` (``CaptureOptions``) what they record.

    ``build_model()`` must return a fresh fp32 model; it is called twice
    (after ``torch.manual_seed(pair.seed)`` each time) and the candidate is
    given the reference's exact weights before ``candidate_policy.prepare``
    runs.  ``inputs``: a tensor, a tuple/list of positional arguments, or a
    dict of keyword arguments (fp32; the policy's ``prepare_inputs`` casts
    them for the candidate).

    Writes ONE session (a new one named ``name``, with a suffix if the name
    is taken, or a new pair of runs in the existing ``session``)
    in one transaction: the reference run (kind "reference"), the candidate
    run (kind "candidate"), the runs' records paired by the one rule ingest
    uses (``services.pairing.match_records``): an "exact" pair (same step,
    rank, name and shape) gets the element-wise "accumulated" comparison made
    as the candidate ran, an "aligned" pair (names that differ, matched by op
    sequence) a "stats" comparison of their summaries, and a record only one
    run has an "unmatched_cand"/"unmatched_ref" row; and, with
    ``pair.local_error``, the "local" comparisons.
    """
    policy = _pair_policy(build_model, store, candidate_policy)
    pair = pair or PairOptions()
    opts = options or CaptureOptions()
    ref_model, cand_model = _same_models(build_model, pair.seed)
    cand_name = pair.candidate_name
    if cand_name is None:
        cand_name = str(getattr(policy, "name", None) or "candidate")
    keeper = _ReferenceKeeper(pair.keep_bytes, pair.device_keep_bytes)
    comparer = _Comparer(keeper, _declared_dtype(policy))
    try:
        ref_cap = Capture(ref_model, run=pair.reference_name, dtype_policy=pair.reference_policy,
                          options=replace(opts, local_error=False), kind="reference", source=pair.source,
                          observer=keeper, write=False)
        run_steps(ref_cap, inputs, pair.loss_fn, pair.seed, pair.optimizer_fn, pair.steps)
        del ref_model
        keeper.drop_objects()
        cand_cap = Capture(cand_model, run=cand_name, dtype_policy=policy,
                           options=replace(opts, local_error=pair.local_error), kind="candidate", source=pair.source,
                           observer=comparer, write=False)
        run_steps(cand_cap, inputs, pair.loss_fn, pair.seed, pair.optimizer_fn, pair.steps)
        _settle(comparer, cand_cap)
        name = _write_pair(store, session, ref_cap, cand_cap, comparer, keeper, recipe=pair.recipe,
                           source=pair.source, policy=policy, name=name)
    finally:
        keeper.close()
    diagnose_captured(store, name)
    return name


def _pair_policy(build_model, store, candidate_policy):
    """``capture_pair``'s arguments checked: the candidate's policy (``live.policies.as_policy``)."""
    if not callable(build_model):
        raise TypeError("capture_pair: build_model must be a callable returning a fresh fp32 model")
    if store is None:
        raise ValueError("capture_pair: pass store= (a precision_lab.store.Store)")
    policy = as_policy(candidate_policy)
    if policy is None:
        raise ValueError("capture_pair: candidate_policy is None; give a dtype (torch.float16) or a precision policy")
    return policy


def _same_models(build_model: Callable[[], torch.nn.Module], seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two models from ``build_model`` (each after ``torch.manual_seed(seed)``), the second given the first's
    exact weights: the reference and the candidate."""
    torch.manual_seed(seed)
    ref_model = build_model()
    if not isinstance(ref_model, torch.nn.Module):
        raise TypeError(f"capture_pair: build_model() returned {type(ref_model).__name__}, not a torch.nn.Module")
    state = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    torch.manual_seed(seed)
    cand_model = build_model()
    try:
        cand_model.load_state_dict(state)
    except Exception as e:
        raise ValueError(f"capture_pair: the second model from build_model() does not take the first one's "
                         f"weights ({e}); build_model must build the same architecture each time") from None
    return ref_model, cand_model


def _settle(comparer: _Comparer, cand_cap: Capture) -> None:
    """The candidate's comparisons finished; a warning on the candidate when most of its tensors had no
    reference tensor of the same name."""
    comparer.clear_cache()
    comparer.resolve()
    comparer.settle(cand_cap)
    unmatched = sum(1 for _, _, m in comparer.results.values() if m != "exact")
    if cand_cap.records and unmatched * 2 > len(cand_cap.records):
        cand_cap.warn("capture_pair", f"{unmatched} of {len(cand_cap.records)} candidate tensors have no "
                                      "reference tensor of the same name: the candidate policy added ops or "
                                      "changed the model's module paths (those are paired by op sequence "
                                      "and compared by summary statistics)")


def _write_pair(store, session, ref_cap, cand_cap, comparer, keeper, *, recipe, source, policy, name) -> str:
    notes = {"capture_pair": {"reference": ref_cap.run, "candidate": cand_cap.run,
                              "policy": policy_description(policy), "local_error": cand_cap.options.local_error}}
    ctx = store.extend_session(session) if session else store.new_session(
        name or recipe or f"{ref_cap.run}-vs-{cand_cap.run}", source=source, recipe=recipe, notes=notes)
    with ctx as w:
        ref_rids = ref_cap.write_run(w)
        cand_rids = cand_cap.write_run(w)
        run_dtype = judged_run_dtype(cand_cap.policy, cand_cap.dominant_dtype() or None)
        # the one pairing rule (services.pairing): same step, rank and name with the same shape, one to one,
        # then the rest aligned by op sequence; only an exact pair has the element-wise comparison the capture
        # made as the candidate ran, every other pair is compared by its summary statistics
        matches = match_records([Item(i, r) for i, r in enumerate(ref_cap.records)],
                                [Item(i, r) for i, r in enumerate(cand_cap.records)])
        matches.sort(key=lambda m: (m.cand is None, m.cand.rid if m.cand else m.ref.rid))
        for m in matches:
            rec = (m.cand or m.ref).record
            kind, cmp = "accumulated", None
            if m.ref is not None and m.cand is not None:
                ref_pos, online, _ = comparer.results.get(m.cand.rid, (None, None, None))
                if m.match == "exact" and ref_pos == m.ref.rid and isinstance(online, Comparison):
                    cmp = online
                else:
                    kind, cmp = "stats", compare_stats(m.ref.record.stats, rec.stats,
                                                       cand_format=verdict_format(rec.stats.dtype, run_dtype))
            w.add_comparison(kind=kind, ref_run_id=ref_cap.run_id,
                             ref_rid=ref_rids[m.ref.rid] if m.ref is not None else None,
                             cand_run_id=cand_cap.run_id, cand_rid=cand_rids[m.cand.rid] if m.cand is not None else None,
                             step=rec.step, rank=rec.rank, seq=rec.seq, op=rec.op, role=rec.role, index=rec.index,
                             match=m.match, comparison=cmp)
    name = w.name  # the name it got: made unique as the session is inserted
    ref_cap.session = cand_cap.session = name
    return name

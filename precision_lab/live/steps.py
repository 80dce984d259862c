"""Step boundaries: what a capture does as each step of the user's job ends and the next begins."""

from __future__ import annotations

import torch

from ..stats import TensorStats


class StepBoundary:
    """The capture's per-step bookkeeping (part of ``Capture``, on its state)."""

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
            self._drop_in_flight()
            self._engine.new_step()
            return
        try:
            self._land_completed()
            self._engine.resolve()
            # a device collective the step waited for has completed once the device has run the step
            if self._in_flight and self._land_completed():
                self._engine.resolve()
            self._drop_in_flight()
            self.timeline.resolve()
        except Exception as e:
            self.hook_error("statistics", e)
        skipped = self._scaler_skipped()
        if skipped:
            self._drop_skipped_backward()
        step_records = self._take_step_records()
        # handles registered on this step's autograd graph are dropped with it
        self._backward.end_step()
        local = self._take_step_local()
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

    def _drop_skipped_backward(self) -> None:
        """The GradScaler found inf/NaN in this step's scaled gradients and skipped the step, as it is made to:
        those gradients never reached the weights and are not the run's failure (as a loss-scale search's tries
        are not recorded); the forward's records stay."""
        kept = [i for i, item in enumerate(self._pending) if item[5] != "backward"]
        base = len(self.records)
        at = {base + old: base + new for new, old in enumerate(kept)}
        self._pending = [self._pending[i] for i in kept]
        self.local_comparisons = [(at[p], c) if p >= base else (p, c) for p, c in self.local_comparisons
                                  if p < base or p in at]
        self.skipped_steps.append(self.step_no)

    def _take_step_records(self) -> list:
        """The step's pending records, made into TensorRecords with the statistics that arrived."""
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
        return step_records

    def _take_step_local(self) -> list:
        """This step's local comparisons (the last ones), by position among its records: they go where its
        records go, now or (a step the timeline holds back) later or never."""
        base = len(self.records)
        split = len(self.local_comparisons)
        while split and self.local_comparisons[split - 1][0] >= base:
            split -= 1
        local = [(p - base, c) for p, c in self.local_comparisons[split:]]
        del self.local_comparisons[split:]
        return local

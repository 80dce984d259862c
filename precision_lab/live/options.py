"""What a live capture records: one frozen, validated options object; and how a pair of runs is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable, Optional, Union

from ..formats import get_format
from ..ops import VIEW_OPS

__all__ = ["CaptureOptions", "PairOptions", "DEFAULT_KEEP_BYTES", "DEFAULT_DEVICE_KEEP_BYTES"]

# reference copies held in memory before spilling to disk
DEFAULT_KEEP_BYTES = 1 << 30
# reference copies of GPU tensors kept on their device before going to host memory
DEFAULT_DEVICE_KEEP_BYTES = 1 << 30


@dataclass(frozen=True)
class CaptureOptions:
    """Options of :func:`precision_lab.capture`.

    Module and op filters are shell-style patterns (``fnmatch``):

    - ``include`` / ``exclude``: module paths (``"blocks.*.attn"``; the root
      module's path is ``""``).  A functional op is recorded when the
      innermost module it runs in is; a module is recorded when its path
      matches ``include`` and not ``exclude``.
    - ``op_types`` / ``exclude_op_types``: op types -- a module's class name
      (``"Linear"``) or a function's name (``"softmax"``, ``"matmul"``,
      ``"to"``, ``"add"``).
    - ``steps``: ``None`` records every step, an int ``N`` every N-th step
      (0, N, 2N, ...), a sequence the listed step numbers.
    - ``keep_tensors``: patterns over op names (``"blocks.2.fc1.*"``) whose
      tensors are kept whole (for exact comparison and replay), not only
      summarised.
    - ``histogram``: the magnitude histogram against every format's range.
    - ``moments_only``: every summary statistic (counts, extrema, mean, std,
      norm) but no magnitude histogram: the cheapest setting.
    - ``local_error``: re-run every recorded op in fp32 from upcast copies of
      its own inputs and compare with its low-precision output.
    - ``functional``: record functional and tensor ops (``F.softmax``,
      ``x / y``, ``.float()``) as well as module calls.
    - ``views``: also record view-like ops (``ops.VIEW_OPS``), off by default.
    - ``backward``: record gradients when the user runs backward.
    - ``params``: record each module's parameters (once per step) and their
      gradients, and its non-empty floating-point buffers (role ``buffer``,
      once per step, no gradient).
    - ``stats_threads``: threads the CPU statistics kernel may use while the
      capture runs; None (the default): the cores torch's intra-op threads
      leave free, at least one (one where torch uses every core: its OpenMP
      threads keep spinning between ops, so a second statistics thread would
      wait for them).
    - ``max_warnings``: stop recording distinct hook warnings after this many.
    - ``locations``: record the user code that called each op (the first
      frame outside torch, Python and Precision Lab), cached per call site.

    A long run (a training loop of many steps) is recorded with ``every``:

    - ``every=N``: on every step, a cheap summary of each module's output and
      each parameter's gradient (absmax, smallest nonzero magnitude, NaN/inf
      counts, norm, and the overflow/underflow/subnormal counts in each
      ``watch`` format) goes to the run's timeline; full records are taken
      every N-th step (0, N, 2N, ...).  ``steps`` must then be None.  The
      timeline is held until the capture ends: about 1.1 KB per summarised
      tensor per step with four watched formats (90 KB a step for 80 tensors).
    - ``keep_last=K``: also take full records on the steps in between, keep
      the last K steps of them in memory, and keep them for good when a step
      holds an unexpected non-finite value (NaN, +inf, or -inf outside a
      masking op) or a non-finite loss: the frames that led to it.  Memory:
      K steps of records (about 2 KB per record with its histogram).
    - ``watch``: the formats whose overflow and underflow the timeline counts.
    - ``on_alert``: called with each ``precision_lab.alerts.Alert`` the
      moment it first fires, at the end of the step that trips it -- the same
      step the stored run's alerts name; ``cap.alerts`` lists them too.
    """

    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    op_types: Optional[tuple[str, ...]] = None
    exclude_op_types: tuple[str, ...] = ()
    steps: Union[None, int, tuple[int, ...]] = None
    keep_tensors: tuple[str, ...] = ()
    histogram: bool = True
    moments_only: bool = False
    local_error: bool = False
    functional: bool = True
    views: bool = False
    backward: bool = True
    params: bool = True
    stats_threads: Optional[int] = None
    max_warnings: int = 200
    locations: bool = True
    every: Optional[int] = None
    keep_last: int = 0
    watch: tuple[str, ...] = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
    on_alert: Optional[Callable] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("include", "exclude", "exclude_op_types", "keep_tensors"):
            v = getattr(self, name)
            if isinstance(v, str):
                object.__setattr__(self, name, (v,))
            elif not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(v))
            for p in getattr(self, name):
                if not isinstance(p, str):
                    raise TypeError(f"CaptureOptions.{name}: patterns must be strings, got {p!r}")
        if self.op_types is not None:
            v = (self.op_types,) if isinstance(self.op_types, str) else tuple(self.op_types)
            object.__setattr__(self, "op_types", v)
        s = self.steps
        if s is not None:
            if isinstance(s, bool):
                raise TypeError("CaptureOptions.steps: give None, an int N (every N-th step) or a list of steps")
            if isinstance(s, int):
                if s < 1:
                    raise ValueError(f"CaptureOptions.steps: every-N must be >= 1, got {s}")
            else:
                steps = tuple(int(x) for x in s)
                if any(x < 0 for x in steps):
                    raise ValueError(f"CaptureOptions.steps: step numbers must be >= 0, got {steps}")
                object.__setattr__(self, "steps", steps)
        if self.stats_threads is not None and (isinstance(self.stats_threads, bool) or self.stats_threads < 1):
            raise ValueError(f"CaptureOptions.stats_threads must be None or >= 1, got {self.stats_threads!r}")
        if self.max_warnings < 0:
            raise ValueError("CaptureOptions.max_warnings must be >= 0")
        if self.every is not None:
            if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
                raise ValueError(f"CaptureOptions.every must be None or an int >= 1, got {self.every!r}")
            if self.steps is not None:
                raise ValueError("CaptureOptions: give either steps= or every= (every records a summary of every "
                                 "step and full records every N-th), not both")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"CaptureOptions.keep_last must be an int >= 0, got {self.keep_last!r}")
        if self.on_alert is not None and (self.every is None or not callable(self.on_alert)):
            raise ValueError("CaptureOptions.on_alert needs every= and a callable (it is called with each alert)")
        if self.keep_last and self.every is None:
            raise ValueError("CaptureOptions.keep_last needs every= (the frames are kept from a long run's steps)")
        watch = (self.watch,) if isinstance(self.watch, str) else tuple(self.watch)
        try:
            object.__setattr__(self, "watch", tuple(dict.fromkeys(get_format(w).name for w in watch)))
        except KeyError as e:
            raise ValueError(f"CaptureOptions.watch: {e.args[0]}") from None
        if self.moments_only and self.histogram:
            # moments-only is the cheapest mode: no histogram, whatever the default says
            object.__setattr__(self, "histogram", False)

    # ---- filters -----------------------------------------------------------
    @property
    def timeline(self) -> bool:
        """Whether every step's summary goes to the run's timeline."""
        return self.every is not None

    def full_step(self, step: int) -> bool:
        """Whether ``step``'s full records are kept (every N-th step of a long run)."""
        return self.every is None or step % self.every == 0

    def step_selected(self, step: int) -> bool:
        if self.every is not None:  # full records are taken: every N-th step, or every step with keep_last
            return self.keep_last > 0 or step % self.every == 0
        if self.steps is None:
            return True
        if isinstance(self.steps, int):
            return step % self.steps == 0
        return step in self.steps

    def module_selected(self, path: str) -> bool:
        return any(fnmatchcase(path, p) for p in self.include) and not any(
            fnmatchcase(path, p) for p in self.exclude)

    def op_type_selected(self, op_type: str) -> bool:
        if not self.views and op_type in VIEW_OPS:
            return False
        if self.op_types is not None and not any(fnmatchcase(op_type, p) for p in self.op_types):
            return False
        return not any(fnmatchcase(op_type, p) for p in self.exclude_op_types)

    def keep_selected(self, op: str) -> bool:
        return any(fnmatchcase(op, p) for p in self.keep_tensors)


@dataclass(frozen=True, slots=True)
class PairOptions:
    """How :func:`precision_lab.capture_pair` makes its fp32 reference run and its candidate run.

    - ``reference_name`` / ``candidate_name``: the runs' names (None: the
      candidate policy's name, else ``"candidate"``).
    - ``reference_policy`` (default None: fp32 as built) runs the reference
      under a policy too: the candidate's policy without ``compile`` makes the
      session eager-vs-compiled in the same format, so what compilation alone
      changes is compared op by op like fp32-vs-fp16.
    - ``seed``: ``torch.manual_seed(seed)`` before each model is built and
      before each forward.
    - ``loss_fn(output) -> scalar`` runs backward in both runs; with
      ``optimizer_fn(params) -> optimizer`` as well, both train ``steps``
      steps on the inputs (``run_steps``).
    - ``local_error``: one "local" comparison per candidate op output against
      the op re-run in fp32 from upcast copies of its own inputs.
    - ``keep_bytes`` / ``device_keep_bytes``: how much of the reference's
      tensors is kept in host memory and, for GPU tensors, on their device
      (compared there; every comparison of the run reaches the host in one
      transfer when it ends) before the rest goes to host memory and then to
      disk.
    - ``recipe``: the registered recipe the session records (what runs it
      again); ``source``: where the session says it came from.
    """

    reference_name: str = "fp32"
    candidate_name: Optional[str] = None
    reference_policy: object = None
    seed: int = 0
    loss_fn: Optional[Callable] = None
    optimizer_fn: Optional[Callable] = None
    steps: int = 1
    local_error: bool = True
    keep_bytes: int = DEFAULT_KEEP_BYTES
    device_keep_bytes: int = DEFAULT_DEVICE_KEEP_BYTES
    recipe: Optional[str] = None
    source: str = "capture"

"""numba, when it can be used: one switch, one way to compile, the threads and the thread limit for every kernel.

``PRECISION_LAB_NO_NUMBA=1`` turns the compiled kernels off (the numpy/torch
paths run instead).  Kernels are cached on disk by numba (``njit``) and
release the GIL.  They are compiled without numba's parallel regions: a large
call is cut into parts that the calling thread and helper threads take as they
become free (``run_parts``), so a core taken by another process delays one
part, not every call; ``limit_threads`` bounds the threads (per calling
thread: ``kernel_threads``).

Compiling the kernels takes 10-20 s, once per install.  A command must not
pay that: ``CompiledOnce.ready()`` hands out the kernels only when numba's
cache holds them (loading takes a fraction of a second).  When it does not,
the caller runs its path that needs no compilation and one low-priority
process, ``python -m precision_lab.compile_kernels``, fills the cache in the
background (it outlives a short command; one at a time per install and cache: one lock,
``compiler_lock_path``, held by the compiler for as long as it runs).
A command that has spent ``FALLBACK_BUDGET_S`` on those paths compiles the
kernels itself (a large dump's first ``compare``: at most that much slower
than compiling from the start).
``PRECISION_LAB_COMPILE=now`` compiles in the process instead, on first use.
``get()`` always compiles in the process (an explicit ``backend="numba"``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, Optional, TypeVar

try:
    import fcntl
except ImportError:  # Windows: no background compiler (see start_compiler)
    fcntl = None

__all__ = ["DISABLE_ENV", "COMPILE_ENV", "SMALL_NUMPY", "FALLBACK_BUDGET_S", "CompiledOnce",
           "ParallelChoice", "run_parts", "load_numba", "njit", "prefetch_intrinsic", "kernel_threads", "limit_threads", "restore_threads", "readonly", "note_fallback",
           "over_budget", "fallback_spent", "start_afresh"]

DISABLE_ENV = "PRECISION_LAB_NO_NUMBA"
COMPILE_ENV = "PRECISION_LAB_COMPILE"  # "background" (the default) or "now"
COMPILER_MODULE = "precision_lab.compile_kernels"
_LOCK_NAME = "precision-lab-compiling"
LOCK_FD_FLAG = "--lock-fd"  # compile_kernels' argument: the inherited descriptor holding the compiler lock
_COMPILER = [sys.executable, "-m", COMPILER_MODULE]
_RECHECK_S = 2.0  # how often a process without the kernels looks at the cache again
# A numpy array below this many elements does not load the kernels (``auto``): its float64 numpy path costs
# 50-400 us more than the kernel's 25-30 us, importing numba and loading its cache 0.5-1.5 s; once a larger one
# has loaded them, small ones take them too.  (A `compare` of 270 tensors of at most 4096 elements never loads
# them: docs/benchmarks.md, "Command-line start-up".)
SMALL_NUMPY = 1 << 14
# Seconds of work (CPU time of the calling thread: a loaded machine does not shorten it) a process may serve from the no-compilation paths while the kernels compile elsewhere; past
# them the command is long enough that compiling pays: a large dump's first `compare` compiles the kernels here
# after a few seconds instead of running the float64 paths (some 100 times slower per element) to the end.
FALLBACK_BUDGET_S = 3.0
_FALLBACK_SPENT = [0.0]

K = TypeVar("K")


def load_numba() -> Optional[Any]:
    """The ``numba`` module, or None when it is switched off or not installed."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        import numba  # deferred: compiling is paid only by the first kernel call
    except ImportError:
        return None
    return numba


def njit(numba: Any, fn: Callable, **options: Any) -> Callable:
    """``fn`` compiled by ``numba.njit`` with the project's defaults: cached on disk, GIL released."""
    return numba.njit(cache=True, nogil=True, **options)(fn)


def prefetch_intrinsic(numba: Any) -> Callable:
    """``prefetch(arr, i)`` for compiled kernels: asks for the cache line holding ``arr[i]`` (LLVM's
    ``llvm.prefetch``, a read kept in every cache level) and goes on without waiting for it, where a load would
    hold the instructions after it until the line came.  A kernel that computes on one block while the next is
    read spreads these through its work: the next block is in cache when it starts on it."""
    from llvmlite import ir  # deferred with numba (llvmlite comes with it)
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, arr, idx):
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return prefetch


def readonly(a):
    """A read-only view of the numpy array ``a``: every kernel takes its inputs read-only, so a writable array
    and a read-only memory map share one compiled signature (and one cache entry)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def compile_in_background() -> bool:
    """Whether a process without cached kernels runs its no-compilation path and compiles in the background."""
    return os.environ.get(COMPILE_ENV, "background").strip().lower() != "now"


def cache_holds(roots) -> bool:
    """Whether numba's cache holds, for this machine and this source, ``n`` signatures of each ``(dispatcher,
    n)`` in ``roots``.  True when it cannot tell (numba's cache layout changed): then the kernels compile in the
    process on first use, as they would without a cache."""
    try:
        for disp, n in roots:
            magic = disp.targetctx.codegen().magic_tuple()
            code = hashlib.sha256(disp.py_func.__code__.co_code).hexdigest()
            index = disp._cache._cache_file._load_index()  # {(signature, machine, (code hash, ...)): file}
            if sum(1 for key in index if key[1] == magic and key[2][0] == code) < n:
                return False
        return True
    except Exception:
        return True


_STARTED: list = []  # the compiler this process started (one per process: it compiles every kernel set)


def compiler_lock_path() -> str:
    """The one lock file of every compiler that fills this install's kernel cache (every kernel set: a compiler
    compiles them all).  In ``NUMBA_CACHE_DIR`` when set, else in the temporary directory; named after the
    package's directory, the cache directory and the user, so another install or user compiles on its own."""
    cache = os.environ.get("NUMBA_CACHE_DIR", "")
    key = "\0".join((os.path.dirname(os.path.abspath(__file__)), cache, str(getattr(os, "getuid", lambda: "")())))
    return os.path.join(cache or tempfile.gettempdir(), f"{_LOCK_NAME}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def take_compiler_lock(path: str, wait: bool = False) -> Optional[int]:
    """An open descriptor of ``path`` holding its exclusive ``flock`` (``wait``: until it is free), or None when
    another process holds it or it cannot be taken.  The operating system releases the lock when every
    descriptor of that open file is closed -- when its holder ends, however it ends -- so no lock outlives a
    crashed compiler and none is ever removed by another process."""
    if fcntl is None:
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def start_compiler() -> bool:
    """Start ``python -m precision_lab.compile_kernels`` unless this process started one or one holds the
    compiler lock (``compiler_lock_path``); True when started.  The lock is taken here and handed to the
    compiler (its descriptor inherited), so it is held from before the start until the compiler ends; a daemon
    thread waits for the compiler, so it does not linger as a zombie in a long-lived process.  Without ``fcntl``
    (Windows) no compiler is started: a long command compiles in the process (``FALLBACK_BUDGET_S``)."""
    if _STARTED:
        return False
    fd = take_compiler_lock(compiler_lock_path())
    if fd is None:
        return False
    try:
        proc = subprocess.Popen([*_COMPILER, LOCK_FD_FLAG, str(fd)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(fd,),
                                start_new_session=True)
    except OSError:
        return False
    finally:
        os.close(fd)  # the compiler holds the lock now (or, not started, nobody does)
    _STARTED.append(proc)
    threading.Thread(target=proc.wait, name="precision-lab-compiler-reaper", daemon=True).start()
    return True


def note_fallback(seconds: float) -> None:
    """A caller ran its no-compilation path for ``seconds`` (counted against ``FALLBACK_BUDGET_S``)."""
    _FALLBACK_SPENT[0] += seconds


def over_budget() -> bool:
    """Whether this process has spent its ``FALLBACK_BUDGET_S`` on the no-compilation paths."""
    return _FALLBACK_SPENT[0] >= FALLBACK_BUDGET_S


def fallback_spent() -> float:
    """Seconds this process has run the no-compilation paths (``note_fallback``)."""
    return _FALLBACK_SPENT[0]


def start_afresh(*kernel_sets: "CompiledOnce") -> None:
    """Forget what this process has learned, as a process just started: the compiler it started, the time
    spent on the no-compilation paths, and ``kernel_sets``' kernels (the next ``ready()`` looks at the cache at
    once).  A forked child runs it with no kernel set: its parent's compiler and budget are not its own, while
    the kernels it inherited are still loaded."""
    _STARTED.clear()
    _FALLBACK_SPENT[0] = 0.0
    for kernel_set in kernel_sets:
        kernel_set.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=start_afresh)


class CompiledOnce(Generic[K]):
    """``build(numba)``'s result: ``get()`` compiles it in this process; ``ready()`` returns it only when it
    needs no compilation (see the module's docstring).  Both are None without numba.

    ``roots(value)``: the dispatchers called from Python, each with the number of signatures ``warm(value)``
    compiles (every signature the callers use)."""

    def __init__(self, build: Callable[[Any], K], *, roots: Callable[[K], list], warm: Callable[[K], None]) -> None:
        self._build = build
        self._roots = roots
        self._warm = warm
        self._built: Any = None  # the dispatchers (nothing compiled yet); False: numba unavailable
        self._value: Any = None  # handed out: the kernels, or False (numba unavailable)
        self._next_check = 0.0
        self._lock = threading.Lock()

    def _dispatchers(self) -> Any:
        if self._built is None:
            numba = load_numba()
            self._built = self._build(numba) if numba is not None else False
        return self._built

    def get(self) -> Optional[K]:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._dispatchers()
        return self._value or None

    def ready(self) -> Optional[K]:
        """The kernels if they are compiled here or cached; else None, and the cache is being filled."""
        if self._value is not None:
            return self._value or None
        if not compile_in_background():
            return self.get()
        now = time.monotonic()
        if now < self._next_check and not over_budget():
            return None
        with self._lock:
            if self._value is not None:
                return self._value or None
            built = self._dispatchers()
            if built is False or cache_holds(self._roots(built)):
                self._value = built
                return built or None
            if over_budget():  # a long command: the kernels pay for their compilation here (or load the cache
                self._value = built  # if the background compiler has filled it by the first call)
                return built
            self._next_check = now + _RECHECK_S
            start_compiler()
            return None

    def forget(self) -> None:
        """Hand out nothing until asked again; the next ``ready()`` looks at the cache at once."""
        with self._lock:
            self._value = None
            self._next_check = 0.0

    def loaded(self) -> bool:
        """Whether this process has the kernels already (``get()`` or ``ready()`` handed them out)."""
        return bool(self._value)

    def warm(self) -> None:
        """Compile every signature the callers use (into numba's cache)."""
        value = self.get()
        if value is not None:
            self._warm(value)


class ParallelChoice:
    """Serial or parallel, for a kernel call large enough that parallel can pay: whichever has cost less per
    element lately in this process.

    On a quiet machine two threads halve a large scan; when other processes hold the cores, waking a helper
    and waiting for its last part can cost more than it saves, and the calling thread alone is faster.  Each call's time per element updates its path's running
    estimate (a few slow calls in a row turn the choice).  Now and then a call takes the other path and its
    time replaces that path's estimate: after ``explore`` calls, then twice as many each time the other path
    is still the slower (at most ``max_gap``), so a change in the load is noticed while a path that stays slow
    costs little.  A path's first call is not counted (it may start threads).  ``pick()`` says whether to go
    parallel; ``record(parallel, seconds, n)`` reports the call."""

    __slots__ = ("_est", "_seen", "_calls", "_next", "_gap", "explore", "max_gap", "alpha")

    def __init__(self, explore: int = 16, max_gap: int = 512, alpha: float = 0.25) -> None:
        self._est: list = [None, None]  # seconds per element: serial, parallel
        self._seen = [0, 0]
        self._calls = 0
        self._gap = self._next = explore
        self.explore, self.max_gap, self.alpha = explore, max_gap, alpha

    def _faster(self) -> bool:
        serial, parallel = self._est
        return parallel < serial

    def pick(self) -> bool:
        self._calls += 1
        serial, parallel = self._est
        if parallel is None:
            return True
        if serial is None:
            return False
        return self._faster() != (self._calls >= self._next)

    def record(self, parallel: bool, seconds: float, n: int) -> None:
        self._seen[parallel] += 1
        if self._seen[parallel] == 1:
            return
        v = seconds / max(n, 1)
        old, other = self._est[parallel], self._est[not parallel]
        if old is None or other is None:
            self._est[parallel] = v
            return
        if self._calls >= self._next and parallel != self._faster():  # the exploring call
            self._est[parallel] = v
            self._gap = min(self._gap * 2, self.max_gap) if v >= other else self.explore  # still the slower
            self._next = self._calls + self._gap
            return
        v = min(max(v, old / 2), old * 2)  # one descheduled call moves the estimate, it does not set it
        self._est[parallel] = old + self.alpha * (v - old)

    def estimates(self) -> tuple:
        """(serial, parallel) seconds per element, None where not measured yet."""
        return tuple(self._est)


_POOL: list = []  # the helper threads' executor, made on first use (and again in a forked child)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.clear)


def run_parts(fn: Callable[[int], Any], n_parts: int, threads: int) -> list:
    """``[fn(0), ..., fn(n_parts - 1)]`` on up to ``threads`` threads: the calling one and helpers (the kernels
    release the GIL).  Each part is taken by whichever thread is free, the calling thread included, so a thread
    that waits for a core (another process holds it) holds up one part, not the call: the others take the rest.
    (numba's parallel regions give each thread a fixed share and end when the last thread does: with a core
    taken, every call waited for the descheduled thread.)  Idle helpers block; nothing spins.  The results do
    not depend on the threads: each part is computed alone and they come back in order; the first exception a
    part raised is raised here once every part has ended."""
    helpers = max(0, min(threads, n_parts) - 1)
    if not helpers:
        return [fn(i) for i in range(n_parts)]
    results: list = [None] * n_parts
    errors: list = []
    taken = itertools.count()
    left = [n_parts]
    finished = threading.Event()
    count_lock = threading.Lock()

    def work() -> None:
        while True:
            i = next(taken)  # atomic under the GIL: each part is taken once
            if i >= n_parts:
                return
            try:
                results[i] = fn(i)
            except BaseException as e:  # raised in the calling thread below
                errors.append(e)
            with count_lock:
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                        thread_name_prefix="precision-lab-kernel"))
    for _ in range(helpers):
        _POOL[0].submit(work)  # a helper that comes late finds every part taken and returns
    work()
    finished.wait()
    if errors:
        raise errors[0]
    return results


_THREADS = threading.local()  # .n: this thread's limit (``limit_threads``); unset: every core


def kernel_threads() -> int:
    """Threads the kernels called from this thread may use: its ``limit_threads``, else the cores this process
    may run on (at most ``NUMBA_NUM_THREADS`` when set).  Kept here, per calling thread, not in numba: reading numba's thread count starts its threading
    layer, and its OpenMP layer sets the calling thread's OpenMP thread count to every core -- the count torch
    reads for its own intra-op threads, so a process running torch on one thread (torchrun sets
    ``OMP_NUM_THREADS=1`` for each rank) would run it on every core after its first statistics."""
    n = getattr(_THREADS, "n", None)
    if n is not None:
        return n
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        return max(1, min(cores, int(os.environ.get("NUMBA_NUM_THREADS") or cores)))
    except ValueError:
        return cores


def limit_threads(n: int) -> Optional[int]:
    """Run the kernels called from this thread on at most ``n`` threads; returns the previous limit for
    ``restore_threads`` (None: there was none)."""
    previous = getattr(_THREADS, "n", None)
    _THREADS.n = max(1, int(n))
    return previous


def restore_threads(previous: Optional[int]) -> None:
    """Undo ``limit_threads``: ``previous`` is what it returned."""
    _THREADS.n = previous

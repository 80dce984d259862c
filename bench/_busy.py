"""``--busy N`` for the benches: N processes that spin on a core each while the measurement runs, as
data-loader workers, other ranks or other jobs do on a shared machine."""

from __future__ import annotations

import contextlib
import subprocess
import sys

SPIN = "while True: pass"


@contextlib.contextmanager
def busy(n: int):
    """N busy-looping processes for the duration of the block (ended, by their ids, when it ends)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(max(n, 0))]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def describe(n: int) -> str:
    return f"{n} busy process{'es' if n != 1 else ''} (python '{SPIN}') beside every variant"

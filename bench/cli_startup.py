"""Start-up of the command line: commands that need no tensors, against bare Python and the CLI library.

Each command runs in a fresh process ``--repeat`` times; medians.  Baselines
in the same run: ``python -c pass`` (the interpreter) and ``python -c "import
typer"`` (the command-line library alone).  Target: <= 0.5 s for report, db,
formats, fixes, export, import, share-link and config.

The package's bytecode is compiled first, as an installed package has it:
where ``PYTHONDONTWRITEBYTECODE`` is set (as on this machine) a checkout
otherwise compiles every module from source on every start, about 70 ms.
``--no-compile`` measures that case.

``--cold``: the first command after an install, when numba's cache holds no
compiled kernel, against the same command warm.  Each cold run gets a new,
empty ``NUMBA_CACHE_DIR``; the command serves its statistics and comparisons
from the float64 paths while one background process compiles the kernels
into that directory.  The warm runs reuse a directory that process filled.
Also printed: the same empty cache with the kernels compiled in the command
(``PRECISION_LAB_COMPILE=now``, what every first command paid before).
Commands: ``compare`` of the msprobe tensor-mode pair in
``tests/data/msprobe`` (``sample_dumps`` holds statistics-mode msprobe dumps
only, which need no kernel) and ``capture --recipe fp16-mlp-overflow``.
Target: cold <= 1.5x warm.

    python bench/cli_startup.py [--repeat 7] [--no-compile]
    python bench/cli_startup.py --cold [--repeat 3]
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 0.5


def timed(argv, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, check=False)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


COLD_TARGET = 1.5
COLD_COMMANDS = [
    ("compare (msprobe tensor pair)", ["compare", "tests/data/msprobe/tensor_mix_fp32", "tests/data/msprobe/tensor_mix_fp16"]),
    ("capture --recipe fp16-mlp-overflow", ["capture", "--recipe", "fp16-mlp-overflow"]),
]
LOCK_NAME = "precision-lab-compiling"  # the background compiler's lock file (numba_loader)


def _run_cli(args, cache: Path, db: Path, compile_mode: str) -> float:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PRECISION_LAB_DB=str(db), PRECISION_LAB_COMPILE=compile_mode,
               PYTHONPATH=str(ROOT))
    env.pop("PRECISION_LAB_NO_NUMBA", None)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from precision_lab.cli import main; main()", *args], env=env,
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - t
    if done.returncode not in (0, 1):  # 1: the comparison found what it should
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return wall


def _wait_for_compiler(cache: Path, timeout: float = 900.0) -> float:
    """Seconds until the background compiler's lock file in ``cache`` is gone."""
    t = time.perf_counter()
    while any(cache.rglob(LOCK_NAME)):
        if time.perf_counter() - t > timeout:
            raise SystemExit(f"the background compilation into {cache} did not finish in {timeout:.0f} s")
        time.sleep(0.2)
    return time.perf_counter() - t


def cold(repeat: int) -> int:
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}  cpus {os.cpu_count()}")
    print(f"rounds {repeat}, medians; each cold run: a new empty NUMBA_CACHE_DIR; warm: a cache the background "
          f"compiler filled")
    print(f"\n{'command':<36}{'warm s':>8}{'cold s':>8}{'cold/warm':>10}{'compile here s':>16}{'/warm':>7}"
          f"   target cold <= {COLD_TARGET}x warm")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, args in COLD_COMMANDS:
            warm_cache = tmp / f"warm-{len(args)}-{name[:7]}"
            subprocess.run([sys.executable, "-m", "precision_lab.compile_kernels"], cwd=ROOT, check=True,
                           env=dict(os.environ, NUMBA_CACHE_DIR=str(warm_cache), PYTHONPATH=str(ROOT)))
            _run_cli(args, warm_cache, tmp / "w0.duckdb", "background")  # file caches warm for every variant
            times: dict = {"warm": [], "cold": [], "now": []}
            bg = []
            for i in range(repeat):  # interleaved: cold, warm, compiled in the command
                c = tmp / f"cold-{name[:7]}-{i}"
                times["cold"].append(_run_cli(args, c, tmp / f"c{i}.duckdb", "background"))
                bg.append(_wait_for_compiler(c))
                times["warm"].append(_run_cli(args, warm_cache, tmp / f"w{i}.duckdb", "background"))
                times["now"].append(_run_cli(args, tmp / f"now-{name[:7]}-{i}", tmp / f"n{i}.duckdb", "now"))
            w, c, n = (statistics.median(times[k]) for k in ("warm", "cold", "now"))
            worst = max(worst, c / w)
            print(f"{name:<36}{w:>8.2f}{c:>8.2f}{c / w:>9.2f}x{n:>16.2f}{n / w:>6.1f}x   "
                  f"{'met' if c / w <= COLD_TARGET else 'not met'}")
            print(f"{'':<36}background compilation still running {statistics.median(bg):.1f} s after the cold "
                  f"command ended (median)")
    print(f"\nworst cold/warm {worst:.2f}x: target {'met' if worst <= COLD_TARGET else 'not met'}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=None, help="runs per command (7; 3 with --cold)")
    ap.add_argument("--no-compile", action="store_true", help="do not compile the package's bytecode first")
    ap.add_argument("--cold", action="store_true", help="first command after an install (empty numba cache) vs warm")
    args = ap.parse_args(argv)
    if not args.no_compile:
        compileall.compile_dir(str(ROOT / "precision_lab"), quiet=1)
    print(f"bytecode: {'as found' if args.no_compile else 'compiled first'}; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
    if args.cold:
        return cold(args.repeat or 3)
    args.repeat = args.repeat or 7
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "lab.duckdb"
        samples = ROOT / "sample_dumps"
        ingest([samples / "stat_mix_fp16_inner_ovf"], reference=[samples / "stat_mix_fp32_inner_ovf"],
               session="ovf", store=Store(db))
        close_all()
        cli = [sys.executable, "-c", "from precision_lab.cli import main; main()"]
        zip_path = Path(tmp) / "s.zip"
        py = timed([sys.executable, "-c", "pass"], args.repeat)
        typer_t = timed([sys.executable, "-c", "import typer"], args.repeat)
        print(f"python -c pass: {py * 1e3:.0f} ms; python -c 'import typer': {typer_t * 1e3:.0f} ms")
        print(f"\n{'command':<28}{'ms':>7}{'x python':>10}   target <= {TARGET} s")
        cmds = [("report -s ovf", ["report", "-s", "ovf", "--db", str(db)]),
                ("report -s ovf --json", ["report", "-s", "ovf", "--db", str(db), "--json"]),
                ("db", ["db", "--db", str(db)]), ("formats", ["formats"]), ("fixes", ["fixes"]),
                ("config", ["config"]), ("export -s ovf", ["export", "-s", "ovf", "--db", str(db), "-o", str(zip_path)]),
                ("import", ["import", str(zip_path), "--db", str(Path(tmp) / "other.duckdb")]),
                ("share-link -s ovf", ["share-link", "-s", "ovf", "--db", str(db)])]
        worst = 0.0
        for name, a in cmds:
            t = timed(cli + a, args.repeat)
            worst = max(worst, t)
            print(f"{name:<28}{t * 1e3:>7.0f}{t / py:>9.1f}x   {'met' if t <= TARGET else 'not met'}")
        print(f"\nslowest {worst * 1e3:.0f} ms: target {'met' if worst <= TARGET else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

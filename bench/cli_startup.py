"""Start-up of the command line: commands that need no tensors, against bare Python and the CLI library.

Each command runs in a fresh process ``--repeat`` times; medians.  Baselines
in the same run: ``python -c pass`` (the interpreter) and ``python -c "import
typer"`` (the command-line library alone).  Target: <= 0.5 s for report, db,
formats, fixes, export, import, share-link and config.

The package's bytecode is compiled first, as an installed package has it:
where ``PYTHONDONTWRITEBYTECODE`` is set (as on this machine) a checkout
otherwise compiles every module from source on every start, about 70 ms.
``--no-compile`` measures that case.

    python bench/cli_startup.py [--repeat 7] [--no-compile]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true", help="do not compile the package's bytecode first")
    args = ap.parse_args(argv)
    if not args.no_compile:
        compileall.compile_dir(str(ROOT / "precision_lab"), quiet=1)
    print(f"bytecode: {'as found' if args.no_compile else 'compiled first'}; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
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

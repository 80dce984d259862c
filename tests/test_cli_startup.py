"""Commands that need no tensors start without torch, numba or pandas (each in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from precision_lab.services.ingest import ingest
from precision_lab.store import Store, close_all

_PROBE = """
import sys
sys.argv = ["precision-lab", *sys.argv[1:]]
from precision_lab.cli import main
code = 0
try:
    main()
except SystemExit as e:
    code = e.code or 0
print("HEAVY=" + ",".join(m for m in ("torch", "numba", "pandas") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    root = Path(__file__).resolve().parents[1] / "sample_dumps"
    path = tmp_path_factory.mktemp("cli") / "lab.duckdb"
    ingest([root / "stat_mix_fp16_inner_ovf"], reference=[root / "stat_mix_fp32_inner_ovf"], session="ovf",
           store=Store(path))
    close_all()
    return path


@pytest.fixture(scope="module")
def archive(db, tmp_path_factory):
    from precision_lab.services.share import export_session

    path = tmp_path_factory.mktemp("archive") / "ovf.zip"
    with Store(db) as store:
        export_session(store, "ovf", path)
    close_all()
    return path


def _run(*args):
    return subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, code, says", [
    (("report", "-s", "ovf"), 0, "Session ovf"),
    (("report", "-s", "ovf", "--json", "--fail-on", "nonfinite"), 1, '"session": "ovf"'),  # the fp16 run trips it
    (("db",), 0, "ovf  (2 runs"), (("formats",), 0, "fp16"), (("fixes",), 0, "what it does"),
    (("recipes",), 0, "calibration-nan"), (("config",), 0, "db_path"),
    (("export", "-s", "ovf", "-o", "{tmp}/s.zip"), 0, "exported session 'ovf'"),
    (("share-link", "-s", "ovf"), 0, "?share="),
    (("import", "{archive}", "--db", "{tmp}/other.duckdb"), 0, "imported session 'ovf'"),
])
@pytest.mark.slow
def test_no_tensor_commands_import_no_torch_numba_or_pandas(db, archive, tmp_path, args, code, says):
    args = [a.replace("{tmp}", str(tmp_path)).replace("{archive}", str(archive)) for a in args]
    if args[0] in ("report", "db", "export", "share-link"):
        args += ["--db", str(db)]
    got = _run(*args)
    heavy = next(ln for ln in got.stderr.splitlines() if ln.startswith("HEAVY="))
    assert heavy == "HEAVY=", (args, heavy)
    assert got.returncode == code, got.stderr
    assert says in got.stdout, got.stdout
    assert (code == 1) == ("FAIL nonfinite" in got.stderr), got.stderr


@pytest.mark.slow
def test_one_loaded_command_still_runs_as_a_subcommand(db):
    got = _run("report", "-s", "ovf", "--db", db, "--json")
    assert got.returncode == 0 and got.stdout.lstrip().startswith("{")
    got = _run("--help")
    assert all(c in got.stdout for c in ("ingest", "report", "capture", "formats", "serve"))


def test_progress_on_a_terminal_is_a_rich_bar():
    import io

    from rich.console import Console

    from precision_lab.cli._common import RichProgress, end_progress, tty_progress

    out = io.StringIO()
    bar = RichProgress(Console(file=out, force_terminal=True, width=100))
    bar(5, 10, "reading blocks.0.fc1.pt")
    bar(10, 10, "reading blocks.1.fc2.pt")
    end_progress(bar)
    text = out.getvalue()
    assert "reading blocks." in text and "10/10" in text
    assert tty_progress() is None  # pytest captures stderr: not a terminal, so no bar at all

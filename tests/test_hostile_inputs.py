"""Every generated hostile input (tests/hostile_inputs.py) through ``precision-lab ingest``.

Each refused case must: exit with status 2; print exactly one line, on
stderr, starting ``error:`` and naming the offending file or entry (by its
path inside the dump, never by an absolute path other than the one given on
the command line); print no traceback; leave the database as it was (the
baseline session and nothing else); never run a pickle payload.  Cases that
may hang or crash (pipes, devices) and bombs run in a separate worker
process, each case in a fresh child forked from it, with a time limit; for
those the peak RSS of the process that ingests the case must stay under
1.5 GiB.

Cases of one twin group (a name inside the dump pointing at an outside file
that exists, one that does not, a folder, ...) must give the same message
apart from that name: a refusal must not reveal what exists outside.

The last test prints a summary: inputs tried, refused clearly, accepted,
failing, and the worst peak memory.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hostile_inputs as H

ROOT = Path(__file__).resolve().parents[1]
PEAK_LIMIT_KIB = 1536 * 1024  # 1.5 GiB: the README's target for any single ingest at the default limits

SPECS = list(H.SPECS.values())
# in-process cases first: the worker runs the others meanwhile
ORDER = [s.id for s in SPECS if not s.subprocess] + [s.id for s in SPECS if s.subprocess]
TWINS = sorted({s.twin for s in SPECS if s.twin})

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hostile")]  # 281 cases, a worker process for the bombs (the fast set keeps test_malformed_inputs)


def _hermetic_env(root: Path) -> dict:
    """This environment without any Precision Lab setting, so the default limits apply."""
    from precision_lab.config import CONFIG_ENV, SETTINGS

    env = {k: v for k, v in os.environ.items() if k not in {s.env for s in SETTINGS}}
    env[CONFIG_ENV] = ""  # set but empty: no config file, not even ./precision_lab.toml
    env["XDG_DATA_HOME"] = str(root / "xdg")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class Isolated:
    """Runs cases in worker processes (``hostile_inputs.py --worker``), one after another.

    A case that outlives its time limit, or kills its worker, is recorded as
    such; a fresh worker goes on with the rest.
    """

    def __init__(self, root: Path, ids: list[str], env: dict):
        self.root, self.env = root, env
        self.db = root / "isolated.duckdb"
        self.results: dict[str, tuple] = {}
        self.pending = list(ids)
        self.done = threading.Event()
        self._procs: list[subprocess.Popen] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            n = 0
            while self.pending:
                n += 1
                self._batch(n)
        except Exception as e:  # noqa: BLE001 - report it on every case still pending
            for cid in self.pending:
                self.results.setdefault(cid, (None, {"id": cid, "crashed": "runner", "phase": "start",
                                                     "tail": repr(e)}))
            self.pending.clear()
        finally:
            self.done.set()

    def _batch(self, n: int) -> None:
        job = self.root / f"job{n}.json"
        out = self.root / f"results{n}.jsonl"
        err = self.root / f"worker{n}.err"
        job.write_text(json.dumps({"root": str(self.root), "db": str(self.db), "good": str(self.root / "_good"),
                                   "cases": self.pending, "results": str(out)}))
        with open(err, "wb") as ef:
            proc = subprocess.Popen([sys.executable, str(Path(H.__file__)), "--worker", str(job)], cwd=str(ROOT),
                                    env=self.env, stdout=subprocess.DEVNULL, stderr=ef, start_new_session=True)
        self._procs.append(proc)
        current, phase, since, case_json, pos = None, "start", time.monotonic(), None, 0
        buf = ""
        while True:
            with open(out, "a+") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                ev = json.loads(line)
                kind = ev["event"]
                if kind == "build":
                    current, phase, since, case_json = ev["id"], "build", time.monotonic(), None
                elif kind == "run":
                    phase, since, case_json = "run", time.monotonic(), ev["case"]
                elif kind == "done":
                    self._record(ev["id"], ev.get("case"), ev["result"])
                    current = None
                elif kind == "fatal":
                    raise RuntimeError(ev["message"])
                elif kind == "finished":
                    proc.wait()
                    return
            rc = proc.poll()
            if rc is not None and not lines:
                tail = err.read_text(errors="replace")[-2000:]
                if current is None:  # died between cases or before the first one
                    raise RuntimeError(f"worker exited with {rc} outside a case: {tail}")
                self._record(current, case_json, {"id": current, "crashed": rc, "phase": phase, "tail": tail})
                return
            if current is not None:
                # the worker stops a case itself at its limit; this only catches a worker that is stuck
                limit = H.BUILD_LIMIT_S + 30 if phase == "build" else H.SPECS[current].max_seconds + 30
                if time.monotonic() - since > limit:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self._record(current, case_json, {"id": current, "timeout": True, "phase": phase,
                                                      "limit": limit})
                    return
            time.sleep(0.05)

    def _record(self, cid: str, case_json, res: dict) -> None:
        case = H.Case.from_json(case_json) if case_json else None
        self.results[cid] = (case, res)
        if cid in self.pending:
            self.pending.remove(cid)

    def get(self, cid: str, timeout: float = 900) -> tuple:
        deadline = time.monotonic() + timeout
        while cid not in self.results:
            if self.done.is_set() and cid not in self.results:
                raise AssertionError(f"{cid}: the worker never ran it")
            if time.monotonic() > deadline:
                raise AssertionError(f"{cid}: no result from the worker after {timeout} s")
            time.sleep(0.1)
        return self.results[cid]

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class World:
    """The shared pieces, the in-process database, and every result so far."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env = root, env
        self.db = root / "lab.duckdb"
        self.results: dict[str, tuple] = {}
        self.runners: list[Isolated] = []
        self._owner: dict[str, Isolated] = {}

    def start(self, ids: list[str]) -> None:
        ids = [i for i in ids if i not in self._owner]
        if ids:
            r = Isolated(self.root, ids, self.env)
            self.runners.append(r)
            self._owner.update({i: r for i in ids})

    def result(self, cid: str) -> tuple:
        """(Case, result) of ``cid``, running it if it has not run yet."""
        if cid not in self.results:
            if H.SPECS[cid].subprocess:
                self.start([cid])
                case, res = self._owner[cid].get(cid)
                if case is None:  # killed before its description came back
                    case = H.Case(id=cid, category=H.SPECS[cid].category, paths=[], name="")
            else:
                case = H.build(cid, self.root)
                res = H.run_case(case, self.db)
            self.results[cid] = (case, res)
        return self.results[cid]

    def stop(self) -> None:
        for r in self.runners:
            r.stop()


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    from precision_lab.cli import app
    from precision_lab.config import CONFIG_ENV, SETTINGS
    from precision_lab.store import close_all

    root = tmp_path_factory.mktemp("hostile")
    env = _hermetic_env(root)
    with pytest.MonkeyPatch.context() as mp:
        for s in SETTINGS:
            mp.delenv(s.env, raising=False)
        mp.setenv(CONFIG_ENV, "")
        H.prepare(root)
        w = World(root, env)
        chosen = [it.callspec.params["case_id"] for it in request.session.items
                  if getattr(it, "originalname", "") == "test_hostile_input" and hasattr(it, "callspec")]
        w.start([cid for cid in chosen if H.SPECS[cid].subprocess])
        r = CliRunner().invoke(app, ["ingest", str(root / "_good"), "--db", str(w.db)])
        assert r.exit_code == 0, r.output  # the baseline session every case must leave alone
        try:
            yield w
        finally:
            w.stop()
            close_all()


# ---- what a clear refusal is ------------------------------------------------------------

def _alts(item) -> tuple:
    return item if isinstance(item, tuple) else (item,)


_PATH_TOKEN = r"[^\s'\"`,;:()\[\]]*"


def _path_leaks(line: str, case: H.Case, world: World) -> list[str]:
    """Absolute paths in ``line`` other than the ones given on the command line or written in the dump."""
    allowed = set(case.paths) | {case.vary} | {a for item in case.also for a in _alts(item)}
    leaks = []
    for prefix in {str(world.root), tempfile.gettempdir()}:
        for m in re.finditer(re.escape(prefix) + _PATH_TOKEN, line):
            tok = m.group(0).rstrip(".")
            if tok not in allowed and tok != prefix.rstrip("/"):
                leaks.append(tok)
    return sorted(set(leaks))


# a generic message lists the file names readers look for; that is not naming the file
_HINTS = ("(dump.json)", "(manifest.json)")


def _named(line: str) -> str:
    for h in _HINTS:
        line = line.replace(h, "")
    return line


def problems(case: H.Case, res: dict, world: World) -> list[str]:
    """Why this result is not what the case expects; empty when it is."""
    if res.get("timeout"):
        return [f"did not finish within {res['limit']:.0f} s (killed while it was in its {res['phase']} phase)"]
    if res.get("crashed") is not None:
        return [f"the worker process died (exit {res['crashed']}) during {res['phase']}: {res['tail'][-600:]}"]
    if res.get("build_error"):
        return [f"the input could not be built: {res['build_error'][-600:]}"]
    out = []
    text = res["stdout"] + res["stderr"]
    if res["exception"]:
        tb = res["traceback"].strip().splitlines()
        out.append(f"uncaught {res['exception'][:300]} (at {tb[-3].strip() if len(tb) >= 3 else '?'})")
    if "Traceback" in text:
        out.append("a traceback was printed")
    if case.payload and os.path.lexists(case.payload):
        out.append("the pickle payload ran: its marker file exists")
    if case.expect == "accept":
        if res["exit"] != 0:
            out.append(f"exit {res['exit']} (expected 0, accepted with a warning): {res['stderr'].strip()[:300]!r}")
        elif res["after"]["sessions"] != res["before"]["sessions"] + 1:
            out.append(f"sessions {res['before']['sessions']} -> {res['after']['sessions']} (expected one more)")
        else:
            hits = [w for w in res["warnings"] if any(n in w for n in _alts(case.name))
                    and all(any(a.lower() in w.lower() for a in _alts(x)) for x in case.words)]
            if not hits:
                out.append(f"no warning names {case.name!r} with {case.words}: {res['warnings'][:5]}")
    else:
        if res["exit"] != 2:
            out.append(f"exit {res['exit']} (expected 2)")
        if res["stdout"].strip():
            out.append(f"printed on stdout: {res['stdout'].strip()[:200]!r}")
        lines = [ln for ln in res["stderr"].splitlines() if ln.strip()]
        if len(lines) != 1:
            out.append(f"{len(lines)} lines on stderr, expected one: {res['stderr'][:400]!r}")
        line = lines[0] if lines else ""
        if lines and not line.startswith("error: "):
            out.append(f"the line does not start with 'error: ': {line[:300]!r}")
        if lines:
            named = _named(line)
            missing = [" / ".join(_alts(case.name))] if not any(n in named for n in _alts(case.name)) else []
            missing += [_alts(a)[0] for a in case.also if not any(x in named for x in _alts(a))]
            missing += [" / ".join(_alts(w)) for w in case.words
                        if not any(x.lower() in line.lower() for x in _alts(w))]
            if missing:
                out.append(f"does not name {missing}: {line[:400]!r}")
            bad = [w for w in case.not_words if w.lower() in line.lower()]
            if bad:
                out.append(f"says {bad}, which it must not: {line[:400]!r}")
            leaks = _path_leaks(line, case, world)
            if leaks:
                out.append(f"shows absolute path(s) {leaks}: {line[:400]!r}")
        if res["before"] != res["after"]:
            changed = {t: (res["before"][t], res["after"][t]) for t in res["before"]
                       if res["before"][t] != res["after"][t]}
            out.append(f"the database changed: {changed}")
    if case.subprocess:
        peak = res.get("peak_kib")
        if peak is not None and peak > PEAK_LIMIT_KIB:
            out.append(f"peak RSS {peak / 1024:.0f} MiB, over the {PEAK_LIMIT_KIB // 1024} MiB bound")
        if res.get("seconds", 0) > case.max_seconds:
            out.append(f"took {res['seconds']:.1f} s, more than {case.max_seconds:.0f} s")
    return out


@pytest.mark.parametrize("case_id", ORDER)
def test_hostile_input(world, case_id):
    case, res = world.result(case_id)
    bad = problems(case, res, world)
    extra = ""
    if case.subprocess and res.get("peak_kib"):
        extra = f" [peak {res['peak_kib'] / 1024:.0f} MiB, {res.get('seconds', 0):.1f} s]"
    assert not bad, f"{case_id} ({case.category}){extra}: " + " | ".join(bad)


@pytest.mark.parametrize("case_id", ["zip-traversal", "name-newline-injection", "fifo-npy"])
def test_entry_point(world, tmp_path, case_id):
    """The installed command (not the test runner's in-process call): exit 2, one line on stderr, nothing else."""
    import shutil

    case = H.build(case_id, world.root / "_entry")
    exe = shutil.which("precision-lab")
    cmd = [exe] if exe else [sys.executable, "-c", "from precision_lab.cli import main; main()"]
    p = subprocess.run(cmd + ["ingest", *case.paths, "--db", str(tmp_path / "entry.duckdb")], capture_output=True,
                       text=True, timeout=120, env=world.env, cwd=str(ROOT))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-2000:]
    assert any(n in lines[0] for n in _alts(case.name)), lines[0]


@pytest.mark.parametrize("group", TWINS)
def test_outside_targets_read_alike(world, group):
    """A name pointing outside the dump is refused in the same words whatever is (or is not) there."""
    msgs = {}
    for cid in [s.id for s in SPECS if s.twin == group]:
        case, res = world.result(cid)
        line = (res.get("stderr") or "").strip()
        for n in sorted({case.vary, repr(case.vary)[1:-1]} - {""}, key=len, reverse=True):
            line = line.replace(n, "<NAME>")
        for p in sorted(case.paths, key=len, reverse=True):
            line = line.replace(p, "<ARG>")
        msgs[cid] = line
    distinct = collections.defaultdict(list)
    for cid, m in msgs.items():
        distinct[m].append(cid)
    assert len(distinct) == 1, f"{group}: the messages differ:\n" + "\n".join(
        f"  {ids}: {m!r}" for m, ids in distinct.items())


def test_summary(world, capsys):
    """Counts over every case (runs any not run yet): tried, refused clearly, accepted, failing; worst memory."""
    per = collections.defaultdict(collections.Counter)
    worst = (0, "")
    failing = []
    for s in SPECS:
        case, res = world.result(s.id)
        bad = problems(case, res, world)
        c = per[s.category]
        c["tried"] += 1
        if not bad:
            c["accepted" if case.expect == "accept" else "refused clearly"] += 1
        else:
            c["failing"] += 1
            failing.append(s.id)
        if res.get("exit") == 0:
            c["exit 0"] += 1
        if res.get("peak_kib") and res["peak_kib"] > worst[0]:
            worst = (res["peak_kib"], s.id)
    total = sum(per.values(), collections.Counter())
    rows = [f"{'category':<20}{'tried':>7}{'refused':>9}{'accepted':>10}{'exit 0':>8}{'failing':>9}"]
    for cat in sorted(per) + ["all"]:
        c = total if cat == "all" else per[cat]
        rows.append(f"{cat:<20}{c['tried']:>7}{c['refused clearly']:>9}{c['accepted']:>10}{c['exit 0']:>8}"
                    f"{c['failing']:>9}")
    rows.append(f"worst peak RSS of a separately run case: {worst[0] / 1024:.0f} MiB ({worst[1] or '-'}); "
                f"bound {PEAK_LIMIT_KIB // 1024} MiB")
    if failing:
        rows.append("failing: " + ", ".join(failing))
    with capsys.disabled():
        print("\n\nhostile inputs\n" + "\n".join(rows))
    assert total["tried"] == len(SPECS) >= 100

"""Dumps laid out the way users write them (bench/dump_conventions.py, small architectures): every writer --
outputs-only hooks, inputs and outputs, ``torch.save`` of a dict or ``(args, out)`` per module, module- and
tensor-name order lists in call and completion order, equal and coarse file times, the root saved as
``model``, ``""`` or its class name -- must name the module that overflowed, and nothing in a healthy run,
also where the healthy run holds NaN/inf on purpose (a ``+inf`` excluded by ``min``, ``log(0)`` behind
``where``, ``-inf`` before ``argmax``...).

The ground truth comes from the run itself (the target's input finite and its output not, no module finishing
before it non-finite) and is written next to each folder before the tool reads it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the bench's models and writes every dump

_spec = importlib.util.spec_from_file_location("dump_conventions",
                                               Path(__file__).parents[1] / "bench" / "dump_conventions.py")
D = importlib.util.module_from_spec(_spec)
sys.modules["dump_conventions"] = D  # its dataclasses look their module up
_spec.loader.exec_module(D)


def _check(rows, misses=0):
    """Every dump right, but for at most ``misses`` failing ones (the gaps the bench prints), none of them a false
    alarm and none stated certain."""
    assert rows
    say = lambda r: f"{r['arch']} {r['kind']} [{r['writer']}]: expected {r['expected']}, named {r['named']} ({r['reason']})"  # noqa: E731
    wrong = [r for r in rows if not r["right"]]
    assert not [r for r in wrong if r["certain"] or r["kind"] in D.HEALTHY_KINDS], "\n".join(map(say, wrong))
    assert len(wrong) <= misses, "\n".join(map(say, wrong))


@pytest.mark.parametrize("arch", ["mlp", "attention", "hooked-attention"])
def test_every_writer_names_the_overflow_and_nothing_in_a_healthy_run(arch, tmp_path):
    rows = D.run(D.cases((arch,)), tmp_path)
    assert len(rows) == len(D.WRITERS) * len(D.KINDS) >= 26 * 5
    # the healthy controls that hold intended NaN/inf (each architecture's own tail of them) are scored too; a
    # dump of inputs only holds them where a module receives them
    held = {r["writer"] for r in rows if r["kind"] == "healthy-intended" and r["held"]}
    assert set(D.WRITERS) - held <= {"inputs-only"}
    # inputs only: an overflow to -inf that the next module receives reads like a mask's -inf (one miss, not certain)
    _check(rows, misses=1 if arch == "mlp" else 0)
    # the truth was written before the answer, beside each folder
    truth = json.loads((tmp_path / f"{arch}-activation-outputs-equal.truth.json").read_text())
    assert truth["expected"] == D.arch(arch)[1]


def test_a_conv_net_with_its_weight_overflowed_in_every_layout(tmp_path):
    _check(D.run(D.cases(("convnet",), ("weight", "healthy", "healthy-intended")), tmp_path))


def test_the_writers_lay_out_what_they_say(tmp_path):
    """The corpus itself: names, layouts and file times as described, so the conventions stay covered."""
    import os

    import numpy as np
    import torch

    model, target, inputs = D._built("mlp", "activation")
    calls, cls = D.capture(model, inputs)
    assert cls == "SeedBlocks" and [c.path for c in sorted(calls, key=lambda c: c.pre)][:3] == ["", "layers.0",
                                                                                               "layers.0.0"]
    for name, w in D.WRITERS.items():
        D.write(w, calls, cls, tmp_path / name)
    files = lambda n: sorted(p.name for p in (tmp_path / n).iterdir())  # noqa: E731
    assert "model.npy" in files("outputs-equal") and "layers.1.0.npy" in files("outputs-equal")
    assert "input.0.npy" in files("io-root-empty") and "SeedBlocks.output.0.npy" in files("io-root-class")
    assert "model.model.layers.1.0.input.0.npy" not in files("prefixed-mtime")
    assert "model.layers.1.0.input.0.npy" in files("prefixed-mtime")
    d = torch.load(tmp_path / "dict-pt" / "layers.1.0.pt")
    assert set(d) == {"input", "output"}
    args, out = torch.load(tmp_path / "tuple-pt" / "layers.1.0.pt")
    assert isinstance(args, tuple) and torch.equal(args[0], d["input"]) and torch.equal(out, d["output"])
    times = {os.stat(p).st_mtime_ns for p in (tmp_path / "outputs-equal").iterdir()}
    assert len(times) == 1
    coarse = [os.stat(tmp_path / "io-coarse" / f).st_mtime_ns for f in files("io-coarse")]
    assert 1 < len(set(coarse)) < len(coarse)
    call = json.loads((tmp_path / "module-order-call" / "manifest.json").read_text())["module_order"]
    done = json.loads((tmp_path / "module-order-done" / "order.json").read_text())
    assert call[0] == "model" and done[-1] == "model" and call.index("layers.1") < call.index("layers.1.0")
    assert done.index("layers.1") > done.index("layers.1.0")
    # numbered-npz: "<call number>-<module>.npz" in completion order, keys input/output, fp16 values as float32
    done = [c.path for c in sorted(calls, key=lambda c: c.post)]
    numbered = files("numbered-npz")
    assert numbered == [f"{i:03d}-{p or 'model'}.npz" for i, p in enumerate(done)]
    z = np.load(tmp_path / "numbered-npz" / f"{done.index('layers.1.0'):03d}-layers.1.0.npz")
    assert set(z.files) == {"input", "output"} and z["output"].dtype == np.float32
    fp16 = next(c for c in calls if c.path == "layers.1.0").output
    assert fp16.dtype == np.float16 and np.array_equal(z["output"], fp16.astype(np.float32), equal_nan=True)
    assert len({os.stat(tmp_path / "numbered-npz" / f).st_mtime_ns for f in numbered}) == 1


def test_a_cast_between_two_recorded_modules_is_named_as_a_gap_end_to_end(tmp_path):
    """Hooks that record modules only: ``.to(torch.float16)`` inside forward overflows between ``up`` (fp32,
    finite output) and ``down``.  Against the fp32 run, ``down``'s input is newly non-finite and no recorded op
    wrote it: ``down`` is named, its producer said not recorded -- not ``down`` as an op that overflowed."""
    import numpy as np
    import torch
    from torch import nn

    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store, close_all
    from precision_lab.store import queries as q

    class Net(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.up(x).to(self.dtype)  # the cast no hook sees
            return self.down.to(self.dtype)(h)

    def dump(dtype, folder):
        torch.manual_seed(0)
        net = Net(dtype)
        with torch.no_grad():
            net.up.weight.mul_(1e5)
        folder.mkdir()
        def hook(m, i, o, name):
            np.save(folder / f"{name}.input.0.npy", i[0].numpy())
            np.save(folder / f"{name}.output.0.npy", o.numpy())

        for name, m in (("up", net.up), ("down", net.down)):
            m.register_forward_hook(lambda m, i, o, name=name: hook(m, i, o, name))
        (folder / "manifest.json").write_text(json.dumps({"module_order": ["up", "down"]}))
        with torch.no_grad():
            return net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))

    ref, cand = tmp_path / "fp32", tmp_path / "fp16"
    assert torch.isfinite(dump(torch.float32, ref)).all()
    dump(torch.float16, cand)
    up_out = np.load(cand / "up.output.0.npy")
    assert np.isfinite(up_out).all() and np.abs(up_out).max() > float(torch.finfo(torch.float16).max)
    assert not np.isfinite(np.load(cand / "down.input.0.npy")).all()  # the cast overflowed, unrecorded
    store = Store(tmp_path / "w.duckdb")
    try:
        name = ingest(cand, reference=ref, store=store)
        runs = q.session_runs(store, store.session(name).session_id)
        run = next(r for r in runs if r.kind != "reference")
        f = first_nonfinite(store, run.run_id)
        assert f.op == "down" and f.origin == "input"
        assert "newly non-finite" in f.reason and "producer was not recorded" in f.reason and "cast" in f.reason
    finally:
        close_all()

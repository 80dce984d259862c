"""A user's own forward hooks: one ``NNN-<module>.npz`` per call (``np.savez(f, input=x, output=y)``), the
values cast to float32 before saving, every file with the same modification time, no order list.

The keys are read as roles (the module's input and output), the leading call number as the order the modules
ran in, and the float32 values, every one of them an fp16 value, as fp16 saved wider: the overflow is named
in fp16's terms."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab.formats import FORMATS
from precision_lab.readers.calllayout import _call_layout, call_numbers
from precision_lab.readers.saveddtype import _Evidence
from precision_lab.services.ingest import ingest
from precision_lab.services.report import build_report, render_text

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened

BASE_NS = 1_700_000_000_000_000_000
FP16_MAX = float(torch.finfo(torch.float16).max)


def hook_dump(folder, *, fp16: bool = True, overflow: bool = True, name=lambda n, module: f"{n:03d}-{module}"):
    """An MLP whose middle Linear (``2``) overflows in fp16, dumped by plain forward hooks; returns the model's
    output.  ``fp16=False`` runs it in float32 (healthy: nothing overflows) and saves that."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    if overflow:
        with torch.no_grad():
            s = 2 * FP16_MAX / float(model[2](model[1](model[0](x))).abs().max())
            model[2].weight.mul_(s)
            model[2].bias.mul_(s)
    if fp16:
        model, x = model.half(), x.half()
    folder.mkdir()
    calls = []

    def hook(mod, args, out, module):
        fn = folder / f"{name(len(calls), module)}.npz"
        np.savez(fn, input=args[0].float().numpy(), output=out.float().numpy())
        calls.append(fn)

    for module, mod in model.named_children():
        mod.register_forward_hook(lambda m, a, o, module=module: hook(m, a, o, module))
    with torch.no_grad():
        y = model(x)
    for fn in calls:
        os.utime(fn, ns=(BASE_NS, BASE_NS))
    return y


def _report(store, folder):
    return build_report(store, ingest(folder, store=store))


@pytest.mark.slow
def test_the_users_hook_dump_is_read_as_module_calls_in_their_numbered_order_and_in_fp16(store, tmp_path):
    y = hook_dump(tmp_path / "mlp")
    assert not torch.isfinite(y).all()
    saved = np.load(tmp_path / "mlp" / "002-2.npz")
    assert saved["output"].dtype == np.float32 and np.isinf(saved["output"]).sum() > 0
    assert np.isfinite(saved["input"]).all()
    assert np.array_equal(np.load(tmp_path / "mlp" / "001-1.npz")["output"], saved["input"])  # the data link
    rep = _report(store, tmp_path / "mlp")
    run = rep.runs[0]
    f = rep.first_nonfinite[run.name]
    # the module that overflowed, named for its output, its input recorded
    assert (f.op, f.role, f.origin) == ("002-2", "output", "op")
    assert "inputs not recorded" not in f.reason
    assert {(t.op, t.role) for t in rep.tensors} == {
        (f"{i:03d}-{i}", r) for i in range(5) for r in ("input", "output")}
    # the call numbers are the order, and the note says so
    assert run.order == "execution" and f.order_known
    assert "call numbers" in run.order_note and "000-" in run.order_note
    assert "Order used:" in render_text(rep) and "call numbers" in render_text(rep)
    # every value is an fp16 value: read as fp16, the overflow said in fp16's terms
    assert run.dtype == "float16" and {t.dtype for t in rep.tensors} == {"float16"}
    out = next(t for t in rep.tensors if (t.op, t.role) == ("002-2", "output"))
    assert out.inf == int(np.isinf(saved["output"]).sum())
    d = next(d for d in rep.diagnoses if d.op == "002-2")
    assert f"in fp16 (max {FORMATS['fp16'].max:,.0f})" in d.message  # 65,504
    assert "3.403e+38" not in d.message
    said = [w.message for w in rep.warnings]
    assert any("look like fp16 saved as float32" in m for m in said), said


@pytest.mark.slow
def test_the_same_dump_from_a_float32_run_stays_float32_and_healthy(store, tmp_path):
    y = hook_dump(tmp_path / "fp32", fp16=False, overflow=False)
    assert torch.isfinite(y).all()
    rep = _report(store, tmp_path / "fp32")
    run = rep.runs[0]
    assert run.dtype == "float32" and {t.dtype for t in rep.tensors} == {"float32"}
    assert rep.first_nonfinite[run.name] is None and not rep.diagnoses
    assert not any("saved as float32" in w.message for w in rep.warnings)
    assert run.order == "execution" and "call numbers" in run.order_note


@pytest.mark.slow
def test_report_json_on_the_command_line(store, tmp_path):
    import json

    from typer.testing import CliRunner

    from precision_lab.cli import app

    hook_dump(tmp_path / "mlp")
    runner = CliRunner()
    got = runner.invoke(app, ["ingest", str(tmp_path / "mlp"), "--db", str(store.path)])
    assert got.exit_code == 0, got.output
    got = runner.invoke(app, ["report", "--session", got.stdout.strip(), "--db", str(store.path), "--json"])
    rep = json.loads(got.stdout)
    f = rep["first_nonfinite"]["mlp"]
    assert (f["op"], f["role"]) == ("002-2", "output") and "inputs not recorded" not in f["reason"]
    assert "call numbers" in rep["runs"][0]["order_note"]
    assert any("in fp16 (max 65,504)" in d["message"] for d in rep["diagnoses"])


# ---- the keys of one call's file, read as roles ---------------------------------------------------------------

@pytest.mark.parametrize("keys, roles", [
    (["input", "output"], ["input.0", "output.0"]),
    (["inputs", "out"], ["input.0", "output.0"]),
    (["x", "y"], ["input.0", "output.0"]),
    (["args.0", "args.1", "outputs"], ["input.0", "input.1", "output.0"]),
    (["input_0", "input_1", "output_1"], ["input.0", "input.1", "output.1"]),
    (["grad_input", "grad_output"], ["grad_input.0", "grad_output.0"]),
    (["grad_input_0", "grad_output_1"], ["grad_input.0", "grad_output.1"]),
    (["Input", "Output"], ["input.0", "output.0"]),
])
def test_hook_writers_key_names_are_roles(keys, roles):
    assert _call_layout(keys) == dict(zip(keys, roles))


@pytest.mark.parametrize("keys", [
    ["x"],  # no output: a tensor named x
    ["input", "weight"],  # a key that is no role: every key stays a name
    ["arr_0", "arr_1"],  # np.savez(f, a, b)
    ["input", "input_0", "output"],  # two keys for one place
    ["0.weight", "1.weight"],  # a Sequential's state dict
    ["0.0", "1"],  # (args, out) positions only in a .pt
])
def test_other_keys_stay_tensor_names(keys):
    assert _call_layout(keys) is None


def test_positions_of_a_pt_still_read_as_args_and_output():
    assert _call_layout(["0.0", "0.1", "1"], positions=True) == {"0.0": "input.0", "0.1": "input.1", "1": "output.0"}


@pytest.mark.slow
def test_npz_and_safetensors_per_module_are_module_calls_and_other_keys_names(store, tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "keys"
    d.mkdir()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(d / "fc.npz", x=x, y=x * 2)
    save_file({"input": x * 2, "output_0": x * 2 + 1}, d / "act.safetensors")
    np.savez(d / "stats.npz", input=x, weight=x - 1)
    ingest(d, store=store)
    got = store.df('SELECT op, role, "index", max FROM tensors ORDER BY op, role').values.tolist()
    assert got == [["act", "input", "0", 10.0], ["act", "output", "0", 11.0], ["fc", "input", "0", 5.0],
                   ["fc", "output", "0", 10.0], ["stats.input", "tensor", "0", 5.0],
                   ["stats.weight", "tensor", "0", 4.0]]


# ---- call numbers in the file names, as the order ----------------------------------------------------------------

def _files(tmp_path, names):
    d = tmp_path / "n"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")
    return [d / n for n in names]


@pytest.mark.parametrize("names, numbers", [
    (["000-a.npz", "001-b.npz", "002-c.npz"], [0, 1, 2]),
    (["001_a.npy", "12.b.npy", "0003-c.npy"], [1, 12, 3]),
    # one op's input and output in two files under one number
    (["000-a.input.0.npy", "000-a.output.0.npy", "001-b.output.0.npy"], [0, 0, 1]),
    # all but one in ten: the unnumbered one (the root) placed by the other sources
    ([f"{i:03d}-m{i}.npy" for i in range(10)] + ["model.npy"], list(range(10)) + [None]),
])
def test_call_numbers_found(tmp_path, names, numbers):
    got = call_numbers(_files(tmp_path, names))
    assert [got.get(p) for p in _files(tmp_path, names)] == numbers


@pytest.mark.parametrize("names", [
    ["000-a.npz", "001-b.npz", "c.npz", "d.npz"],  # mixed: half the files carry no number
    ["000-a.npz", "000-b.npz", "001-c.npz"],  # one number for two modules
    ["layer9.npy", "layer10.npy", "layer11.npy"],  # a number inside a name is no call number
    ["0.weight.npy", "0.bias.npy", "1.weight.npy"],  # a Sequential's parameters
    ["0.npy", "1.npy"],  # a name that is only a number: a Sequential's children
    ["000-a.npz"],  # one file says nothing about order
])
def test_no_call_numbers(tmp_path, names):
    assert call_numbers(_files(tmp_path, names)) == {}


def test_call_numbers_per_folder(tmp_path):
    files = []
    for sub, names in (("step0", ["000-a.npy", "001-b.npy"]), ("step1", ["a.npy", "b.npy"])):
        (tmp_path / sub).mkdir()
        for n in names:
            (tmp_path / sub / n).write_bytes(b"")
            files.append(tmp_path / sub / n)
    assert call_numbers(files) == {tmp_path / "step0" / "000-a.npy": 0, tmp_path / "step0" / "001-b.npy": 1}


def _outputs(d, arrays, times=None):
    d.mkdir()
    for i, (fn, a) in enumerate(arrays.items()):
        np.save(d / fn, a)
        t = BASE_NS + (i * 1_000 if times == "distinct" else 0)
        os.utime(d / fn, ns=(t, t))


def _spread(nonfinite: int) -> np.ndarray:
    a = np.linspace(-1, 1, 8)
    a[:nonfinite] = np.inf
    return a  # float64: not read as a narrower dtype


@pytest.mark.slow
def test_call_numbers_are_the_order_over_the_ties_of_an_outputs_only_dump(store, tmp_path):
    """Outputs only, equal times, no links: without the numbers the fewest non-finite values would go first and
    ``c`` (2 inf) be named before ``b`` (8 inf, the overflow), as the name order of ``b-``/``c-`` alone would
    be right only by luck."""
    _outputs(tmp_path / "d", {"000-a.npy": _spread(0), "001-b.npy": _spread(8), "002-c.npy": _spread(2)})
    rep = _report(store, tmp_path / "d")
    run = rep.runs[0]
    assert run.order == "execution"
    assert run.order_note == ("execution order from the call numbers the file (or folder) names begin with (000-a.npy, "
                                 "001-b.npy, ...)")
    assert rep.first_nonfinite["d"].op == "001-b"
    # and without the numbers the same dump goes by the fewest non-finite values
    _outputs(tmp_path / "e", {"a.npy": _spread(0), "b.npy": _spread(8), "c.npy": _spread(2)})
    rep = _report(store, tmp_path / "e")
    assert rep.runs[0].order == "name" and rep.first_nonfinite["e"].op == "c"


@pytest.mark.slow
def test_an_order_list_wins_over_call_numbers(store, tmp_path):
    import json

    _outputs(tmp_path / "d", {"000-a.npy": _spread(0), "001-b.npy": _spread(8), "002-c.npy": _spread(2)})
    (tmp_path / "d" / "order.json").write_text(json.dumps(["000-a", "002-c", "001-b"]))
    rep = _report(store, tmp_path / "d")
    assert rep.runs[0].order_note.startswith("execution order from order.json")
    assert rep.first_nonfinite["d"].op == "002-c"


@pytest.mark.slow
def test_call_numbers_over_file_times_that_disagree(store, tmp_path):
    """Files copied in another order (distinct times, reversed): the numbers the hook wrote still give it."""
    _outputs(tmp_path / "d", {"002-c.npy": _spread(2), "001-b.npy": _spread(8), "000-a.npy": _spread(0)},
             times="distinct")
    rep = _report(store, tmp_path / "d")
    assert "call numbers" in rep.runs[0].order_note and rep.first_nonfinite["d"].op == "001-b"


def test_a_call_number_is_no_part_of_the_op_type(store, tmp_path):
    _outputs(tmp_path / "d", {"000-fc.npy": _spread(0), "001-softmax.npy": _spread(0)})
    ingest(tmp_path / "d", store=store)
    assert sorted(store.df("SELECT op_type FROM tensors").op_type) == ["fc", "softmax"]


# ---- fp16 / bf16 values saved as float32 --------------------------------------------------------------------------

def _rows(store):
    return store.df("SELECT op, dtype, max, inf_count FROM tensors ORDER BY op")


def _save(d, arrays):
    d.mkdir()
    for fn, a in arrays.items():
        np.save(d / fn, a)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype, name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_values_of_a_narrower_dtype_saved_as_float32_are_read_in_it(store, tmp_path, dtype, name):
    a = (torch.randn(8, 16, generator=_gen()) * 3).to(dtype)
    b = (torch.randn(8, 16, generator=_gen(1)) * 1e3).to(dtype)
    b[0, :3] = float("inf")
    _save(tmp_path / "d", {"a.npy": a.float().numpy(), "b.npy": b.float().numpy(),
                           "ids.npy": np.arange(16, dtype=np.int64)})
    ingest(tmp_path / "d", store=store)
    rows = _rows(store)
    assert list(rows.dtype) == [name, name, "int64"]
    # statistics of the values as torch holds them
    finite = b.float()[torch.isfinite(b.float())]
    assert rows["max"][1] == float(finite.max()) and rows["inf_count"][1] == 3
    said = store.df("SELECT file, message FROM warnings")
    fmt = FORMATS["fp16" if name == "float16" else "bf16"]
    assert list(said.file) == ["."] and f"look like {fmt.name} saved as float32" in said.message[0]
    assert "every finite value of the 2 float32 tensors" in said.message[0]


@pytest.mark.parametrize("arrays", [
    # genuine float32 data: its values fill float32's mantissa
    {"a.npy": torch.randn(8, 16, generator=_gen()).numpy()},
    # every value exact in every format: small integers, zeros, halves
    {"a.npy": np.arange(256, dtype=np.float32), "z.npy": np.zeros(64, np.float32),
     "h.npy": np.arange(64, dtype=np.float32) / 2},
    # a fixed-point grid: fp16 values all of them, by construction
    {"a.npy": np.arange(1024, dtype=np.float32) / 256},
    # too few values to tell
    {"a.npy": torch.randn(2, 4, generator=_gen()).half().float().numpy()},
    # one genuine float32 tensor beside fp16 values: none of them is relabelled
    {"a.npy": torch.randn(8, 16, generator=_gen()).half().float().numpy(),
     "b.npy": torch.randn(8, 16, generator=_gen(1)).numpy()},
    # floats kept in their own dtype beside: the dump saved them as computed
    {"a.npy": torch.randn(8, 16, generator=_gen()).half().float().numpy(),
     "b.npy": torch.randn(8, 16, generator=_gen(1)).half().numpy()},
])
def test_float32_is_kept_when_the_values_do_not_say_otherwise(store, tmp_path, arrays):
    _save(tmp_path / "d", arrays)
    ingest(tmp_path / "d", store=store)
    assert set(_rows(store).dtype) == {a.dtype.name for a in arrays.values()}
    assert not any("saved as float32" in m for m in store.df("SELECT message FROM warnings").message)


def test_dtypes_given_in_the_manifest_are_taken_as_given(store, tmp_path):
    import json

    a = torch.randn(8, 16, generator=_gen()).half().float().numpy()
    _save(tmp_path / "d", {"a.npy": a, "b.npy": a * 2})
    (tmp_path / "d" / "manifest.json").write_text(json.dumps({"dtypes": {"a": "float32"}}))
    ingest(tmp_path / "d", store=store)
    assert set(_rows(store).dtype) == {"float32"}


def test_the_evidence_counts_against_real_casts():
    """``_Evidence`` against ml_dtypes: an fp16 tensor's float32 copy holds, the same values nudged by one
    float32 ulp do not; bf16 values past fp16's range are no fp16 values."""
    import ml_dtypes

    h = np.random.default_rng(0).standard_normal(256).astype(np.float16).astype(np.float32)
    e = _Evidence(np.dtype(np.float16))
    assert e.add(h) and e.holds() and e.tensors == 1
    assert not _Evidence(np.dtype(np.float16)).add(np.nextafter(h, np.float32(np.inf)))
    big = (np.random.default_rng(1).standard_normal(64) * 1e6).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert _Evidence(np.dtype(ml_dtypes.bfloat16)).add(big)
    assert not _Evidence(np.dtype(np.float16)).add(big)
    # non-finite values say nothing either way
    e = _Evidence(np.dtype(np.float16))
    assert e.add(np.float32([np.inf, -np.inf, np.nan, 1.5])) and not e.holds()


@pytest.mark.slow
def test_a_folder_per_call_is_the_module_its_files_the_roles_and_its_number_the_order(store, tmp_path):
    """``003_fc/input.npy`` and ``003_fc/output.npy`` (a hook that makes a folder per call): the folder is the
    module, the files its input and output, the number its name begins with the order.  A folder holding only
    ``output.npy`` beside modules of its own (``attention/output``) stays a module named ``output``."""
    y = hook_dump(tmp_path / "flat")  # the same model and overflow, one npz per call
    assert not torch.isfinite(y).all()
    calls = tmp_path / "calls"
    calls.mkdir()
    for fn in sorted((tmp_path / "flat").glob("*.npz")):
        d = calls / fn.stem.replace("-", "_")
        d.mkdir()
        with np.load(fn) as z:
            for key in ("input", "output"):
                np.save(d / f"{key}.npy", z[key])
                os.utime(d / f"{key}.npy", ns=(BASE_NS, BASE_NS))
    rep = _report(store, calls)
    run = rep.runs[0]
    f = rep.first_nonfinite[run.name]
    assert (f.op, f.role, f.origin) == ("002_2", "output", "op")
    assert {(t.op, t.role) for t in rep.tensors} == {
        (f"{i:03d}_{i}", r) for i in range(5) for r in ("input", "output")}
    assert run.order == "execution" and "000_0/input.npy" in run.order_note
    nested = tmp_path / "nested"
    (nested / "attention").mkdir(parents=True)
    np.save(nested / "attention" / "output.npy", np.full(4, np.inf, np.float32))
    np.save(nested / "embed.npy", np.ones(4, np.float32))
    rep = _report(store, nested)
    assert {(t.op, t.role) for t in rep.tensors} == {("attention.output", "tensor"), ("embed", "tensor")}


def test_telling_the_saved_dtype_holds_a_few_chunks_in_memory_not_copies_of_the_tensor():
    import ml_dtypes
    import tracemalloc

    rng = np.random.default_rng(5)
    a = rng.standard_normal(8 << 20, dtype=np.float32)  # 32 MiB of genuine float32 values
    exact = a.astype(ml_dtypes.bfloat16).astype(np.float32)  # the same, every value a bf16 one
    exact[::1000] = np.nan
    for arr, want in ((a, False), (exact, True)):
        ev = _Evidence(np.dtype(ml_dtypes.bfloat16))
        tracemalloc.start()
        got = ev.add(arr)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert got is want
        # a comparison of whole copies held several times the array (the check cast it, cast it back, masked the
        # NaNs and compared the copies: about 4x its size at once)
        assert peak < arr.nbytes // 2, (want, peak)
    # the evidence of the exact tensor, read a chunk at a time, is what float64 numpy finds over all of it
    v = exact[np.isfinite(exact)]
    expo = (v.view(np.uint32) >> 23) & 0xFF
    assert ev.high == int(expo.max()) - 127 and ev.tensors == 1

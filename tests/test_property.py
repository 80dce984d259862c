"""Property-based tests of ``tensor_stats`` and the dump readers, and a short
fuzz run of the .npy and msprobe ``dump.json`` readers.

Each property compares against an independent computation: float64 numpy
for the statistics, real casts (numpy / ml_dtypes) for the per-format
counts, and the array itself for what a reader hands back.

The default sizes keep this file to seconds.  To search longer, set
``PRECISION_LAB_FUZZ_EXAMPLES`` (hypothesis examples per property, default
40) and ``PRECISION_LAB_FUZZ_ITERATIONS`` (mutated files per fuzz test,
default 150), e.g.::

    PRECISION_LAB_FUZZ_EXAMPLES=2000 PRECISION_LAB_FUZZ_ITERATIONS=20000 \\
        python -m pytest tests/test_property.py -q

``PRECISION_LAB_FUZZ_SEED`` picks another fuzz seed (default 0).
"""

import io
import json
import math
import os
import random
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from precision_lab.formats import get_format
from precision_lab.readers import ReadError, detect
from precision_lab.stats import tensor_stats

from conftest import SAMPLES

EXAMPLES = int(os.environ.get("PRECISION_LAB_FUZZ_EXAMPLES", "40"))
ITERATIONS = int(os.environ.get("PRECISION_LAB_FUZZ_ITERATIONS", "150"))
SEED = int(os.environ.get("PRECISION_LAB_FUZZ_SEED", "0"))

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

# each reader example writes and reads files: fewer of them buy the same seconds
READER_SETTINGS = settings(SETTINGS, max_examples=max(10, EXAMPLES // 3))

# shapes up to 3-d, zero-sized dimensions included
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


def float_arrays(dtype):
    """Arrays of ``dtype`` holding anything: NaN, +-Inf, zeros, subnormals, extremes."""
    return hnp.arrays(dtype, SHAPES, elements=st.floats(width=np.dtype(dtype).itemsize * 8, allow_nan=True,
                                                         allow_infinity=True, allow_subnormal=True))


def _check_against_numpy(s, arr):
    x = np.asarray(arr).astype(np.float64).ravel()
    fin = x[np.isfinite(x)]
    assert s.numel == x.size
    assert s.shape == tuple(np.shape(arr))
    assert s.nan_count == int(np.isnan(x).sum())
    assert s.inf_count == int(np.isinf(x).sum())
    assert s.zero_count == int((x == 0).sum())
    if fin.size:
        assert s.min == fin.min() and s.max == fin.max()
        assert s.absmax == np.abs(fin).max()
        nz = np.abs(fin[fin != 0])
        if nz.size:
            assert s.min_abs_nonzero == nz.min()
        # scaled by the largest magnitude so the oracle itself cannot overflow near float64's max
        m = np.abs(fin).max()
        if m > 0:
            y = fin / m
            assert s.l2norm == pytest.approx(m * math.sqrt(math.fsum(y * y)), rel=1e-9, abs=0)
            assert s.mean == pytest.approx(m * (math.fsum(y) / fin.size), rel=1e-9, abs=1e-12 * m)
        else:
            assert s.l2norm == 0 and s.mean == 0
    else:
        assert s.min is None or math.isnan(s.min)
    assert s.hist is not None and int(s.hist.sum()) == int((fin != 0).sum())


def _cast_counts(fin: np.ndarray, fmt_name: str) -> dict:
    """Overflow / underflow / subnormal counts by really casting the finite values (float64 -> format)."""
    fmt = get_format(fmt_name)
    c = fin.astype(getattr(ml_dtypes, fmt.ml_dtypes_name) if fmt.ml_dtypes_name not in ("float16", "float32")
                   else np.dtype(fmt.ml_dtypes_name)).astype(np.float64)
    ac = np.abs(c)
    overflow = ~np.isfinite(c) | (ac > fmt.max)
    return {
        "overflow": int(overflow.sum()),
        "underflow": int(((fin != 0) & (c == 0)).sum()),
        "subnormal": int(((c != 0) & (ac < fmt.smallest_normal) & ~overflow).sum()),
    }


@SETTINGS
@given(st.one_of(float_arrays(np.float16), float_arrays(np.float32), float_arrays(np.float64)))
def test_tensor_stats_of_arbitrary_float_arrays(arr):
    _check_against_numpy(tensor_stats(arr), arr)


@SETTINGS
@given(arr=float_arrays(np.float32), fmt=st.sampled_from(["fp16", "bf16", "fp8_e5m2"]))
def test_format_counts_agree_with_real_casts(arr, fmt):
    """The histogram's per-format counts equal what casting the values really does.

    (fp8_e4m3fn is left out here: torch's cast saturates, ml_dtypes' does not;
    tests/test_stats.py pins that case.)
    """
    s = tensor_stats(arr)
    x = arr.astype(np.float64).ravel()
    fin = x[np.isfinite(x)]
    rep = s.representability(fmt)
    want = _cast_counts(fin, fmt)
    assert (rep.overflow, rep.underflow, rep.subnormal) == (want["overflow"], want["underflow"], want["subnormal"])
    assert rep.overflow + rep.underflow + rep.subnormal + rep.normal == int((fin != 0).sum())


@SETTINGS
@given(hnp.arrays(st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint16, np.bool_]), SHAPES))
def test_tensor_stats_of_integer_and_bool_arrays(arr):
    _check_against_numpy(tensor_stats(arr), arr)


@SETTINGS
@given(arr=float_arrays(np.float32), dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_tensor_stats_of_torch_tensors(arr, dtype):
    import torch

    t = torch.from_numpy(arr.copy()).to(getattr(torch, dtype))
    ref = t.to(torch.float64).numpy()  # the values the tensor really holds after its cast
    s = tensor_stats(t)
    assert s.dtype == dtype
    _check_against_numpy(s, ref)


@SETTINGS
@given(arr=float_arrays(np.float32), step=st.integers(1, 3))
def test_tensor_stats_of_strided_views(arr, step):
    view = arr[..., ::step] if arr.ndim else arr
    _check_against_numpy(tensor_stats(view), view.copy())


# ---- readers -----------------------------------------------------------------------

def _read_all(root: Path):
    reader = detect(root)
    assert reader is not None
    out = []
    for src in reader.iter_runs(root, lambda n, label: None):
        for rec in src.records:
            out.append((src, rec))
    return out


def _save(path: Path, fmt: str, arrays: dict):
    if fmt == "npy":
        for name, a in arrays.items():
            np.save(path / f"{name}.npy", a)
    elif fmt == "npz":
        np.savez(path / "all.npz", **arrays)
    elif fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file({k: v.copy(order="C") for k, v in arrays.items()}, str(path / "all.safetensors"))
    elif fmt == "pt":
        import torch

        torch.save({k: torch.from_numpy(v.copy(order="C")) for k, v in arrays.items()}, path / "all.pt")


NAMES = st.dictionaries(
    keys=st.from_regex(r"[a-z][a-z0-9_]{0,6}\.output\.[0-9]", fullmatch=True),
    values=st.one_of(float_arrays(np.float16), float_arrays(np.float32), float_arrays(np.float64),
                     hnp.arrays(np.int32, SHAPES)),
    min_size=1, max_size=4)


@pytest.mark.slow
@READER_SETTINGS
@given(arrays=NAMES, fmt=st.sampled_from(["npy", "npz", "safetensors", "pt"]))
def test_generic_reader_round_trips_arrays(tmp_path_factory, arrays, fmt):
    d = tmp_path_factory.mktemp("dump")
    _save(d, fmt, arrays)
    got = _read_all(d)
    assert len(got) == len(arrays)
    for src, rec in got:
        key = rec.name if rec.name in arrays else next(k for k in arrays if rec.name.endswith(k))
        want = arrays[key]
        # the reader hands back the array itself, its statistics match numpy, and a reload gives it again
        assert np.array_equal(np.asarray(rec.tensor), want, equal_nan=True)
        assert np.asarray(rec.tensor).dtype == want.dtype
        _check_against_numpy(rec.stats, want)
        again = src.load(rec.source)
        assert np.array_equal(np.asarray(again), want, equal_nan=True)
    shutil.rmtree(d)


STAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6))


@READER_SETTINGS
@given(entries=st.lists(st.tuples(st.sampled_from(["linear", "relu", "softmax", "__add__"]),
                                   st.lists(STAT, min_size=4, max_size=4),
                                   st.lists(st.integers(0, 64), min_size=0, max_size=3)),
                        min_size=1, max_size=6))
def test_msprobe_reader_keeps_the_dumped_statistics(tmp_path_factory, entries):
    d = tmp_path_factory.mktemp("ms")
    proc = d / "step0" / "rank0"
    proc.mkdir(parents=True)
    data = {}
    for i, (api, (mx, mn, mean, norm), shape) in enumerate(entries):
        data[f"Functional.{api}.{i}.forward"] = {"input_args": [], "input_kwargs": {}, "output": [
            {"type": "torch.Tensor", "dtype": "torch.float16", "shape": shape, "Max": mx, "Min": mn, "Mean": mean,
             "Norm": norm, "requires_grad": False}]}
    # json.dumps writes bare NaN / Infinity tokens, as msprobe does
    (proc / "dump.json").write_text(json.dumps({"task": "statistics", "level": "mix", "framework": "pytorch",
                                                "dump_data_dir": None, "data": data}))
    got = _read_all(d)
    assert len(got) == len(entries)
    for (_, rec), (_, (mx, mn, mean, norm), shape) in zip(got, entries):
        s = rec.stats
        assert list(s.shape) == shape and s.numel == math.prod(shape)
        for have, want in ((s.max, mx), (s.min, mn), (s.mean, mean), (s.l2norm, norm)):
            assert have == float(want) or (math.isnan(have) and math.isnan(want))
    shutil.rmtree(d)


# ---- fuzz: mutated files give a ReadError naming the file, never another exception ----------------

def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        if op < 0.4 and b:  # flip bytes
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
        elif op < 0.6 and b:  # truncate
            del b[rng.randrange(len(b)):]
        elif op < 0.8:  # insert junk
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif b:  # duplicate a slice
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 32)]
    return bytes(b)


def _fuzz(tmp_path, make_dir, target_rel: str, seed_bytes: bytes, iterations: int):
    rng = random.Random(SEED)
    outcomes = {"read": 0, "refused": 0}
    for it in range(iterations):
        d = tmp_path / f"f{it}"
        make_dir(d)
        (d / target_rel).write_bytes(_mutate(rng, seed_bytes))
        try:
            _read_all(d)
            outcomes["read"] += 1
        except ReadError as e:
            assert Path(target_rel).name in str(e), str(e)
            outcomes["refused"] += 1
        except Exception as e:  # anything else is a reader bug: show the input that caused it
            pytest.fail(f"iteration {it} (seed {SEED}): {type(e).__name__}: {e}")
        shutil.rmtree(d)
    return outcomes


def test_fuzz_npy_reader(tmp_path):
    seed = io.BytesIO()
    np.save(seed, np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6))

    def make(d):
        d.mkdir()

    out = _fuzz(tmp_path, make, "x.output.0.npy", seed.getvalue(), ITERATIONS)
    assert out["refused"] > 0  # the mutations really did break files


def test_fuzz_msprobe_json_reader(tmp_path):
    src = next((SAMPLES / "stat_mix_fp16_inner_ovf").rglob("dump.json"))
    text = src.read_text()
    # a smaller seed (the first entries) keeps each iteration fast
    doc = json.loads(text)
    doc["data"] = dict(list(doc["data"].items())[:12])
    seed_bytes = json.dumps(doc).encode()
    rel = src.relative_to(SAMPLES / "stat_mix_fp16_inner_ovf")

    def make(d):
        (d / rel.parent).mkdir(parents=True)

    out = _fuzz(tmp_path, make, str(rel), seed_bytes, ITERATIONS)
    assert out["refused"] > 0

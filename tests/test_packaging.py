"""The wheel carries the sample dumps: built from a copy of the source tree and installed into an empty folder,
the package finds its samples there, with no checkout beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import setuptools

pytestmark = pytest.mark.slow  # builds and installs the wheel

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(setuptools.find_packages(str(ROOT), include=["precision_lab*"]))
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"
    assert listed - found == {"precision_lab.sample_dumps"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("precision_lab", "sample_dumps"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md", "requirements.txt", "requirements-test.txt", "requirements-gpu.txt"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("precision_lab-*.whl")
    return whl


def test_the_wheel_holds_every_sample_file(wheel):
    want = {"precision_lab/sample_dumps/" + p.relative_to(ROOT / "sample_dumps").as_posix()
            for p in (ROOT / "sample_dumps").rglob("*") if p.is_file()}
    with zipfile.ZipFile(wheel) as z:
        got = {n for n in z.namelist() if n.startswith("precision_lab/sample_dumps/")}
    assert want and got == want


def test_an_installed_package_finds_its_samples_without_a_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                          str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    code = ("from precision_lab.paths import samples_dir; from precision_lab.services.samples import list_samples; "
            "print(samples_dir()); print(sorted(s.name for s in list_samples()))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)  # ahead of the editable install of the checkout
    res = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    where, names = res.stdout.splitlines()[:2]
    assert Path(where) == target / "precision_lab" / "sample_dumps"
    from precision_lab.services.samples import list_samples

    assert names == repr(sorted(s.name for s in list_samples())) and "fp16-mlp-overflow" in names

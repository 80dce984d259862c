"""The README's Python snippets run as written, on a small model standing in for the reader's, and do what
their comments say (the model is fp32 again after a capture under fp16)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

README = Path(__file__).parents[1] / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


def test_the_readme_python_snippets_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the training snippet writes run.duckdb where it runs
    snippets = _snippets()
    assert len(snippets) >= 2
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ns = {"torch": torch, "model": model, "batch": torch.randn(4, 8), "build_model": _model,
          "inputs": torch.randn(4, 8), "loader": [torch.randn(4, 8) for _ in range(2)], "opt": opt,
          "scaler": torch.amp.GradScaler("cpu")}
    for code in snippets:
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the project's own README
    # "model is as it was again: fp32, no hooks"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert (tmp_path / "run.duckdb").exists() and ns["cap"].session

"""The run the user has: ``torch.autocast`` with fp32 parameters, each op in the dtype autocast gives it.  A pair
captured under the ``autocast-fp16``/``autocast-bf16`` presets is judged against the autocast format (an op
autocast keeps in fp32 still carries the fp16 error of the ops before it), so a healthy transformer gets no error
verdict; a failure gets fixes that exist under autocast, and they work when re-run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.policy import get_policy
from precision_lab.live import PairOptions
from precision_lab.services.report import build_report, first_nonfinite
from precision_lab.store import queries as q

pytestmark = pytest.mark.slow  # builds transformers models and captures each twice


def _bench():
    root = Path(__file__).parents[1] / "bench"
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("localization_cases", root / "localization_cases.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("localization_cases", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2", "bert", "t5"])
def test_a_healthy_transformer_under_autocast_gets_no_error_verdict(store, arch):
    build, _, inputs = _bench().hf(arch)

    def make():
        torch.manual_seed(0)
        return build()

    for fmt in ("fp16", "bf16"):
        name = capture_pair(make, inputs, get_policy(f"autocast-{fmt}"), store=store, session=None,
                            pair=PairOptions(candidate_name=f"autocast-{fmt}"))
        rep = build_report(store, name)
        verdicts = [c.verdict for c in rep.comparisons if c.verdict]
        assert verdicts and "error" not in verdicts and "nonfinite" not in verdicts, (arch, fmt)
        assert not [d for d in rep.diagnoses if d.severity in ("error", "warn")], (arch, fmt, rep.diagnoses)
        # the ops really ran in autocast's format: matmuls in it, the parameters in fp32
        cand = next(r for r in rep.runs if r.kind == "candidate")
        dtypes = {t.dtype for t in rep.tensors if t.run == cand.name and t.role == "output"}
        assert {"float16" if fmt == "fp16" else "bfloat16", "float32"} <= dtypes
        params = {t.dtype for t in rep.tensors if t.run == cand.name and t.role == "param"}
        assert params == {"float32"}


class Overflow(nn.Module):
    """A Linear whose output overflows fp16 (its weight scaled), then a LayerNorm that turns the inf into NaN."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.fc.weight.mul_(3e4)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def _overflow():
    torch.manual_seed(0)
    return Overflow()


def test_an_overflow_under_autocast_is_named_and_the_fixes_offered_work_under_autocast(store):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        assert _overflow().fc(x).abs().max() > 65504  # independently: fp32 holds it, fp16 cannot
    name = capture_pair(_overflow, x, get_policy("autocast-fp16"), store=store)
    runs = {r.kind: r for r in q.session_runs(store, store.session(name).session_id)}
    f = first_nonfinite(store, runs["candidate"].run_id)
    assert f is not None and f.op.startswith("fc.") and first_nonfinite(store, runs["reference"].run_id) is None
    rep = build_report(store, name)
    d = next(d for d in rep.diagnoses if d.severity == "error")
    assert "keep-fp32:fc" in d.fixes or "use-bf16" in d.fixes, d
    for fix in [fx for fx in d.fixes if fx in ("keep-fp32:fc", "use-bf16")]:
        fixed = apply_fixes(get_policy("autocast-fp16"), fix)
        assert fixed.autocast in ("fp16", "bf16") and fixed.dtype == "fp32"  # still an autocast run
        again = capture_pair(_overflow, x, fixed, store=store, name=f"fixed-{fix}")
        cand = next(r for r in q.session_runs(store, store.session(again).session_id) if r.kind == "candidate")
        assert first_nonfinite(store, cand.run_id) is None, fix

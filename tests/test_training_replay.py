"""A training job as users run it -- a ``transformers`` model under fp16 autocast with a GradScaler, their own loop
-- captured with its optimizer: the capture names the failing step and op, keeps what a replay needs, and one
re-run replays the steps before the failure under a fix, in the job's own configuration."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch

import precision_lab
from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.recipes import RECIPES, Recipe, register_recipe
from precision_lab.fixes.policy import PrecisionPolicy
from precision_lab.live import CaptureOptions
from precision_lab.live.replaykit import KitError, kit_path, load_kit
from precision_lab.ops import innermost_module
from precision_lab.services.report import build_report, first_nonfinite
from precision_lab.services.rerun import RerunError, replay_kit, rerun_session
from precision_lab.services.sessions import run_policy
from precision_lab.services.verify import verification
from precision_lab.store import Store, close_all
from precision_lab.store import queries as q

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
SPIKE = 3  # the step whose learning rate spikes: its update makes the next step's forward overflow fp16
STEPS = 6


def _build():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CFG)), None


def _loss(out):
    return out.loss


def _optimizer(params):
    # plain SGD: a step's update is linear in its gradient, so bf16's rounding moves the fixed run's output by a
    # stable amount (Adam's sign-like first update of a spiked learning rate would amplify any last-bit
    # difference of a CPU kernel's summation order into a different run)
    return torch.optim.SGD(params, lr=1e-3)


@pytest.fixture(scope="module")
def recipe():
    r = register_recipe(Recipe("test-gpt2-train", "a tiny GPT-2 trained under fp16 autocast", _build,
                               PrecisionPolicy("autocast-fp16", "fp32", autocast="fp16"), loss_fn=_loss,
                               optimizer_fn=_optimizer), replace=True)
    yield r
    RECIPES.unregister(r.name)


def _lr(step: int) -> float:
    return 1e3 if step == SPIKE else 1e-3


def _batch(step: int):
    ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(100 + step))
    return ids


def _model_fingerprint(model):
    return ([(n, p.dtype, p.data_ptr()) for n, p in model.named_parameters()],
            [(n, len(m._forward_hooks), len(m._forward_pre_hooks), m.training) for n, m in model.named_modules()])


def _train(store, recipe, *, init_scale=2.0 ** 10, capture=True):
    """The user's loop: fp16 autocast, a GradScaler, a learning-rate spike at step SPIKE.  Returns the capture, the
    model, and the state the step before the failure started from (copied by the loop itself)."""
    model, _ = _build()
    model.train()
    opt = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    before = _model_fingerprint(model)
    snap = {}
    ctx = precision_lab.capture(model, run="train", store=store, grad_scaler=scaler, optimizer=opt, recipe=recipe,
                                options=CaptureOptions(every=1, keep_last=2))
    with ctx as cap:
        for step in range(STEPS):
            for g in opt.param_groups:
                g["lr"] = _lr(step)
            if step == SPIKE:
                snap = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                        "scaler": scaler.state_dict()}
            torch.manual_seed(1000 + step)  # the job's dropout draws
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(input_ids=_batch(step), labels=_batch(step))
            scaler.scale(out.loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            cap.step(loss=out.loss)
    return cap, model, before, snap


def _independent(snap, fmt, first, last):
    """Steps ``first``..``last`` replayed by hand from the loop's own copy of the state: in fp32 (``fmt`` None) or
    under ``torch.autocast(fmt)`` with the GradScaler; the last step's logits."""
    model, _ = _build()
    model.load_state_dict(snap["model"])
    model.train()
    opt = _optimizer(model.parameters())
    opt.load_state_dict(snap["opt"])
    scaler = None
    if fmt is not None:
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(snap["scaler"])
    for step in range(first, last + 1):
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        torch.manual_seed(1000 + step)
        with torch.autocast("cpu", dtype=fmt or torch.float32, enabled=fmt is not None):
            out = model(input_ids=_batch(step), labels=_batch(step))
        if scaler is not None:
            scaler.scale(out.loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            out.loss.backward()
            opt.step()
        opt.zero_grad()
    return out.logits.detach().double().numpy()


def _first_overflowing_module(snap, step):
    """Independently: the first leaf module whose output holds inf when step ``step``'s forward runs in fp16
    autocast from the state after step ``step - 1``'s update."""
    model, _ = _build()
    model.load_state_dict(snap["model"])
    model.train()
    opt = _optimizer(model.parameters())
    opt.load_state_dict(snap["opt"])
    for g in opt.param_groups:
        g["lr"] = _lr(step - 1)
    torch.manual_seed(1000 + step - 1)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(input_ids=_batch(step - 1), labels=_batch(step - 1))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    hits = []
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: hits.append(n) if isinstance(o, torch.Tensor)
                                     and not torch.isfinite(o).all() else None)
             for n, m in model.named_modules() if not list(m.children())]
    torch.manual_seed(1000 + step)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=_batch(step), labels=_batch(step))
    for h in hooks:
        h.remove()
    return hits[0]


@pytest.fixture(scope="module")
def _trained(recipe, tmp_path_factory):
    """One run of the failing job for the module: its database (with the replay kit beside it) and what the
    loop kept."""
    root = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:  # as each test has: no default database or data folder of the user
        mp.setenv("PRECISION_LAB_DB", str(root / "default.duckdb"))
        mp.setenv("XDG_DATA_HOME", str(root / "xdg"))
        store = Store(root / "train.duckdb")
        out = _train(store, recipe)
    close_all()
    return store.path, out


@pytest.fixture
def trained(_trained, tmp_path):
    """A copy of the module's run for this test to re-run and delete from: (store, capture, model, the model's
    state before the capture, the loop's copy of the state the step before the failure)."""
    src, out = _trained
    db = tmp_path / "train.duckdb"
    shutil.copy(src, db)
    shutil.copytree(src + ".replay", str(db) + ".replay")
    yield (Store(db), *out)
    close_all()


def test_a_training_job_is_captured_diagnosed_and_fixed_by_one_replay(trained):
    store, cap, model, before, snap = trained
    fail = SPIKE + 1
    # the capture leaves the user's model as it found it: same parameters, dtypes, no hooks, same modes
    assert _model_fingerprint(model) == before
    assert cap.first_nonfinite_step == fail
    info = store.session(cap.session)
    note = info.notes["replay"]
    assert (note["from_step"], note["failed_step"], note["autocast"], note["grad_scaler"]) == (SPIKE, fail, "fp16", True)
    run = q.session_runs(store, info.session_id)[0]
    policy = run_policy(run)
    assert policy.autocast == "fp16" and policy.grad_scaler  # the configuration the job ran in, seen, not declared

    # the step and op: where the first overflow happens, found independently with plain hooks
    origin = first_nonfinite(store, run.run_id)
    assert origin.step == fail and origin.direction == "forward"
    names = [n for n, _ in model.named_modules() if n]
    assert innermost_module(origin.op, names) == _first_overflowing_module(snap, fail)

    # the diagnosis card: stored with the session, its fixes exist under autocast
    rep = build_report(store, cap.session)
    card = next(d for d in rep.diagnoses if d.severity == "error")
    assert "use-bf16" in card.fixes, card
    for f in card.fixes:
        assert apply_fixes(policy, f).autocast is not None, f

    # one click: the card's re-run, from the kept step, in the job's configuration with the fix
    rid = rerun_session(store, cap.session, "use-bf16", parent=run.run_id)
    verdict = verification(store, cap.session).get(run.run_id, "use-bf16")
    assert verdict.run_id == rid and verdict.works, verdict
    ref = _independent(snap, None, SPIKE, fail)
    fixed = _independent(snap, torch.bfloat16, SPIKE, fail)
    assert np.isfinite(fixed).all()
    sqnr = 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - fixed) ** 2))
    assert abs(verdict.sqnr_db - sqnr) < 0.1, (verdict.sqnr_db, sqnr)
    # the replay started from the kept step: its records are steps SPIKE..fail only, the reference's too
    runs = {r.name: r for r in q.session_runs(store, info.session_id)}
    steps = {r["step"] for r in q.rows(store, "SELECT DISTINCT step FROM tensors WHERE run_id = ?", [rid])}
    assert steps == {SPIKE, fail}
    assert {r.kind for r in runs.values()} == {"candidate", "reference", "rerun"}

    # a GradScaler fix edits the scaler the replay starts from
    rid2 = rerun_session(store, cap.session, "scaler-init:64", parent=run.run_id)
    fixed_run = next(r for r in q.session_runs(store, info.session_id) if r.run_id == rid2)
    assert dict(run_policy(fixed_run).grad_scaler)["scale"] == 64
    scales = q.rows(store, "SELECT step, value FROM step_scalars WHERE run_id = ? AND name = 'loss_scale'", [rid2])
    assert {(int(r["step"]), r["value"]) for r in scales} >= {(SPIKE, 64.0)}


def test_a_healthy_amp_job_whose_scaler_backs_off_is_no_failure(store, recipe):
    """A GradScaler starting high finds inf gradients and skips steps until its scale fits: that is the scaler at
    work, not a failure; no step is marked, no kit is kept, no error is diagnosed."""
    cap, _, _, _ = _train(store, recipe, init_scale=2.0 ** 24)
    assert cap.first_nonfinite_step is None
    info = store.session(cap.session)
    assert "replay" not in info.notes and info.notes["capture"]["scaler_skipped_steps"]
    rep = build_report(store, cap.session)
    assert not [d for d in rep.diagnoses if d.severity == "error"], rep.diagnoses
    with pytest.raises(RerunError, match="replay kit"):
        rerun_session(store, cap.session, "use-bf16")


def test_the_kit_is_data_read_back_safely(trained, tmp_path):
    store, cap, _, _, _ = trained
    path = kit_path(store.path, cap.run_id)
    kit = load_kit(path)
    assert [s.step for s in kit.steps] == [SPIKE, SPIKE + 1] and kit.steps[0].groups[0]["lr"] == _lr(SPIKE)
    assert replay_kit(store, store.session(cap.session)) == str(path)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x04not a kit")
    with pytest.raises(KitError, match="bad.pt: not a readable replay kit"):
        load_kit(bad)
    with pytest.raises(KitError, match="does not name a replay kit"):
        kit_path(store.path, "../../etc/passwd")
    store.delete_session(cap.session)  # the kit goes with its session
    assert not path.exists()
    with pytest.raises(ValueError, match="keep_last"):
        precision_lab.capture(torch.nn.Linear(2, 2), store=store, optimizer=object())

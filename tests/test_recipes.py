"""Recipes: the registry, reproducibility, and each recipe really failing and really passing."""

import textwrap

import numpy as np
import pytest
import torch

from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.recipes import (RECIPES, RECIPES_ENV, Recipe, RecipeError, RecipeNotFound, get_recipe,
                                         list_recipes, load_user_recipes)
from precision_lab.metrics import compare

NAMES = ["fp8-zero-scale", "calibration-nan", "fp8-rowwise-rmsnorm", "fp16-mlp-overflow", "fp16-layernorm",
         "softmax-fp16-overflow"]
# the module whose op first turns finite values into NaN/Inf under the default policy
PRODUCER = {
    "fp8-zero-scale": "proj.act_quant.inv_scale",
    "calibration-nan": "norm",
    "fp8-rowwise-rmsnorm": "proj.act_quant.inv_scale",
    "fp16-mlp-overflow": "layers.0.mlp.down_proj",
    "fp16-layernorm": "ln",
    "softmax-fp16-overflow": "attn.softmax",
}


def test_builtin_names_exact():
    assert set(NAMES) <= set(RECIPES)
    for n in NAMES:
        r = get_recipe(n)
        assert r.name == n and r.description and r.fixes and r.default_policy.low_precision


def test_unknown_recipe_message():
    with pytest.raises(RecipeNotFound, match=r"unknown recipe 'nope'; known recipes: calibration-nan, "):
        get_recipe("nope")


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for n in NAMES:
        r = get_recipe(n)
        (m1, x1), (m2, x2) = r.build(), r.build()
        assert torch.equal(x1, x2)
        for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
            assert torch.equal(a, b), k
        assert all(p.dtype == torch.float32 for p in m1.parameters())
    assert torch.equal(torch.get_rng_state(), before)


def _run(recipe, policy):
    model, x = recipe.build()
    if policy is not None:
        policy.prepare(model)
        x = policy.prepare_inputs(x)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", NAMES)
def test_fails_by_default_and_passes_under_each_fix(name):
    r = get_recipe(name)
    ref = _run(r, None)
    bad = _run(r, r.default_policy)
    n_ref = int((~torch.isfinite(ref)).sum())
    n_bad = int((~torch.isfinite(bad)).sum())
    assert n_bad > n_ref  # the low-precision run makes values non-finite
    assert (n_ref > 0) == r.nonfinite_in_reference
    for fix in r.fixes:
        out = _run(r, apply_fixes(r.default_policy, fix))
        assert torch.isfinite(out).all(), fix
        c = compare(ref, out)  # positions non-finite in the reference are left out
        assert c.nonfinite_introduced == 0
        assert c.sqnr_db >= r.tolerance_db, (fix, c.sqnr_db)


def _final_output(store, run_id):
    row = store.sql("""SELECT sqnr_db, verdict FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated'
                       AND op = 'forward.0' AND role = 'output'""", [run_id]).fetchone()
    assert row is not None
    return row


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_capture_pair_shows_failure_and_fix(name, store):
    from precision_lab import capture_pair
    from precision_lab.live import PairOptions
    from precision_lab.services.report import first_nonfinite

    r = get_recipe(name)
    for fixes in ((), r.fixes[0]):
        policy = apply_fixes(r.default_policy, fixes) if fixes else r.default_policy
        sess = capture_pair(r.build_model, r.inputs(), policy, store=store, pair=PairOptions(seed=r.seed, recipe=r.name),
                            name=f"{name}-{'fixed' if fixes else 'default'}")
        runs = store.runs(store.session(sess).session_id)
        ref_id = runs[runs.kind == "reference"].run_id.iloc[0]
        cand_id = runs[runs.kind == "candidate"].run_id.iloc[0]
        fn_ref, fn = first_nonfinite(store, ref_id), first_nonfinite(store, cand_id)
        if r.nonfinite_in_reference:
            assert fn_ref is not None and fn_ref.op.startswith(PRODUCER[name] + ".")
        else:
            assert fn_ref is None
        if not fixes:
            assert fn is not None and fn.producer
            assert fn.op.startswith(PRODUCER[name] + "."), fn.op
            assert _final_output(store, cand_id)[1] == "nonfinite" or r.nonfinite_in_reference
        else:
            assert fn is None, fn and fn.op
            sqnr, verdict = _final_output(store, cand_id)
            assert verdict != "nonfinite" and sqnr >= r.tolerance_db


def test_user_recipes_from_env(tmp_path, monkeypatch):
    mod = tmp_path / "my_recipes_mod.py"
    mod.write_text(textwrap.dedent("""
        import torch
        from precision_lab.fixes.recipes import Recipe
        from precision_lab.fixes.policy import PrecisionPolicy

        def _build():
            return torch.nn.Linear(4, 4), torch.randn(2, 4)

        def make():
            return [Recipe("user-linear", "a user's model", _build, PrecisionPolicy("fp16", "fp16"))]

        SINGLE = Recipe("user-single", "another", _build, PrecisionPolicy("bf16", "bf16"))
        NOT_A_RECIPE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(RECIPES_ENV, "my_recipes_mod:make, my_recipes_mod:SINGLE")
    try:
        assert get_recipe("user-linear").description == "a user's model"
        assert "user-single" in {r.name for r in list_recipes()}
        model, x = get_recipe("user-linear").build()
        assert model(x).shape == (2, 4)
        with pytest.raises(RecipeError, match=r"entry 'my_recipes_mod:NOT_A_RECIPE' is neither a Recipe nor callable"):
            load_user_recipes("my_recipes_mod:NOT_A_RECIPE")
        with pytest.raises(RecipeError, match=r"cannot import 'no_such_mod_xyz'"):
            load_user_recipes("no_such_mod_xyz:f")
        with pytest.raises(RecipeError, match=r"must look like 'package.module:function'"):
            load_user_recipes("just_a_module")
        with pytest.raises(RecipeError, match=r"has no attribute 'missing'"):
            load_user_recipes("my_recipes_mod:missing")
    finally:
        RECIPES.pop("user-linear", None)
        RECIPES.pop("user-single", None)


def test_recipe_validation():
    from precision_lab.fixes.policy import PrecisionPolicy

    with pytest.raises(RecipeError, match="must be non-empty with no spaces"):
        Recipe("a b", "", lambda: None, PrecisionPolicy())
    with pytest.raises(RecipeError, match="default_policy must be a PrecisionPolicy"):
        Recipe("x", "", lambda: None, "fp16")
    with pytest.raises(RecipeError, match="already registered"):
        from precision_lab.fixes.recipes import register_recipe

        register_recipe(Recipe("fp16-layernorm", "dup", lambda: None, PrecisionPolicy()))
    r = Recipe("not-a-module", "", lambda: (np.zeros(2), None), PrecisionPolicy())
    with pytest.raises(RecipeError, match="returned ndarray, not a torch module"):
        r.build()


def test_a_model_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    import sys

    from precision_lab.fixes.recipes import load_entry_point

    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "blocks_beside.py").write_text("import torch\n\n\ndef block():\n    return torch.nn.Linear(4, 3)\n")
    (folder / "model.py").write_text("from blocks_beside import block\n\n\ndef build():\n    return block()\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder joins the path for this test only
    monkeypatch.delitem(sys.modules, "blocks_beside", raising=False)
    build = load_entry_point(f"{folder / 'model.py'}:build")
    m = build()
    assert type(m).__name__ == "Linear" and tuple(m.weight.shape) == (3, 4)

"""The op table: one canonical name per op, whatever a dump or a capture calls it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from precision_lab.fixes.replay import canonical_op, replay
from precision_lab.ops import OPS, canonical, innermost_module, module_prefixes


@pytest.mark.parametrize("name, want", [
    ("__truediv__", "div"), ("Tensor.__truediv__"[7:], "div"), ("LayerNorm", "layer_norm"), ("layer_norm", "layer_norm"),
    ("aten._softmax.default", "softmax"), ("aten::mm", "matmul"), ("bmm", "matmul"), ("Qwen2RMSNorm", "rms_norm"),
    ("FakeQuant", "quantise"), ("__radd__", "add"), ("SiLU", "silu"), ("addmm", None), ("rsub", None),
    ("NewGELUActivation", None), ("Functional", None), ("", None),
])
def test_canonical_names(name, want):
    assert canonical(name) == want
    assert canonical_op(name) == want


def test_each_alias_names_one_op_and_replays_as_it():
    seen = {}
    for op, aliases in OPS.items():
        for a in (op,) + aliases:
            assert seen.setdefault(a.lower().strip("_"), op) == op, f"{a} names two ops"
    # an alias replays as the function it names: softmax's aliases give torch's softmax in fp32
    x = torch.randn(4, 7) * 5
    for a in ("Softmax", "_softmax", "aten._softmax.default"):
        got = replay(a, [x], {"dim": -1}, cand_format="fp16").fp32
        assert torch.allclose(got, F.softmax(x.double(), dim=-1).float(), rtol=1e-6, atol=1e-7)


def test_module_paths():
    assert module_prefixes("a.b.c") == ["a", "a.b", "a.b.c"]
    mods = ["layers", "layers.0", "layers.0.mlp", "layers.0.mlp_gate"]
    assert innermost_module("layers.0.mlp.down_proj.linear.0", mods) == "layers.0.mlp"
    assert innermost_module("layers.0.mlp_gate", mods) == "layers.0.mlp_gate"
    assert innermost_module("embed.forward.0", mods) is None


def test_enclosing_module_of_module_calls_functional_ops_and_dump_names():
    from precision_lab.ops import enclosing_module

    assert enclosing_module("blocks.0.fc.forward.0") == "blocks.0.fc"
    assert enclosing_module("forward.0") == ""
    assert enclosing_module("blocks.0.attn.softmax.0") == "blocks.0.attn"  # a capture's functional op
    assert enclosing_module("softmax.0") == ""
    assert enclosing_module("Module.blocks.0.fc.Linear.forward.0") == "blocks.0.fc"
    # msprobe API calls: by the dump's nesting, else the root
    assert enclosing_module("Functional.linear.10.forward", "Module.blocks.2.fc1.Linear.forward.0") == "blocks.2.fc1"
    assert enclosing_module("Functional.linear.10.forward") == ""
    assert enclosing_module("blocks.0.fc1") == "blocks.0.fc1"  # a dump named by module path


@pytest.mark.parametrize("name,expected", [
    ("Functional.layer_norm.0.forward", "layer_norm"),
    ("Module.blocks.0.fc1.Linear.forward.0", "Linear"),
    ("Mint.add.2.backward", "add"),
    ("blocks.0.fc1", "fc1"),
    ("blocks.0.attn.softmax.2", "softmax"),
    ("Functional", "Functional"),  # a bare prefix is a name, not a key
    ("7", "7"),
])
def test_op_type_of_a_dump_name(name, expected):
    from precision_lab.ops import op_type_of
    assert op_type_of(name) == expected


@pytest.mark.parametrize("op,expected", [
    ("Functional.softmax.0.forward", ""),   # an msprobe API call without nesting: the root
    ("Jit.add.0.forward", ""),              # every msprobe prefix, not only torch's
    ("Module.blocks.0.fc.Linear.forward.0", "blocks.0.fc"),
    ("blocks.0.attn.softmax.0", "blocks.0.attn"),
])
def test_enclosing_module_of_msprobe_and_capture_names(op, expected):
    from precision_lab.ops import enclosing_module
    assert enclosing_module(op) == expected


def test_op_categories_are_defined_once_in_the_op_table():
    """``VIEW_OPS`` keeps its public name in ``precision_lab.live``; capture asks the op table's categories."""
    import precision_lab.live as live
    from precision_lab import ops
    from precision_lab.live.options import CaptureOptions

    assert live.VIEW_OPS is ops.VIEW_OPS
    assert {"view", "reshape", "getitem", "cat"} <= ops.VIEW_OPS and not {"to", "float", "add"} & ops.VIEW_OPS
    assert {"size", "item", "numpy"} <= ops.NON_COMPUTE_OPS and not {"full_like", "new_full"} & ops.NON_COMPUTE_OPS
    default, views = CaptureOptions(), CaptureOptions(views=True)
    assert [default.op_type_selected(t) for t in ("view", "transpose", "softmax")] == [False, False, True]
    assert views.op_type_selected("view") and views.op_type_selected("transpose")

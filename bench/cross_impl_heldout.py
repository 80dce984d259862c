"""Held-out cases for the cross-implementation diff: models, bugs and benign variants that ``bench/cross_impl.py``
does not hold, graded by its harness (``report``, ``grade_pairing``, ``first_right``).

    python bench/cross_impl_heldout.py            (about a minute on 2 CPU cores)

Written after the main bench, against the code as it stood, to test it on what its thresholds were not set from:

* a ``transformers`` GPT-2 (``Conv1D`` weights stored (in, out), one fused ``c_attn`` projection for q, k and v,
  a written-out tanh GELU) against a rewrite with ``nn.Linear``, separate q/k/v projections, its own written-out
  attention, a fused ``F.gelu`` and other module names -- so the *reference* holds the fused projection;
* a ``transformers`` Mistral built from config against the Llama rewrite of ``cross_impl_models``;
* a ``transformers`` ViT (a conv patch embedding) against itself with the patch embedding done by unfold and a
  matmul, with eager attention, and in bf16;
* eager against ``torch.compile`` of the GPT-2 rewrite (dropout off, a fused GELU).

Bugs (each in one module): attention softmax over the wrong axis, a causal mask one position off, the 1/sqrt(d)
scale missing in half of the heads, a LayerNorm without its bias, a weight loaded without its transpose in one
layer, a residual added twice, position ids one off, key/value heads tiled instead of interleaved for GQA, patches
read in the wrong order.  Benign: separate vs fused projections, SDPA vs written-out attention, a projection as
elementwise products and a sum vs a matmul, bf16 autocast, compile, unfold vs conv.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cross_impl as X  # noqa: E402
import cross_impl_models as M  # noqa: E402

GPT2_BUGS = {"softmax_dim": "h.1.attn", "mask_off_by_one": "h.1.attn", "scale_one_group": "h.1.attn",
             "ln_no_bias": "h.1.ln_2", "transposed_weight": "h.1.attn.c_proj", "residual_twice": "h.1",
             "pos_offset": "wpe"}


def _randomise(model, seed: int = 1):
    """Biases and norm scales away from their init (zeros and ones), so a dropped bias or scale shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


# ---- GPT-2 and a rewrite of it ----------------------------------------------------------------------------

def gpt2_config(layers: int = 2, attn: str = "sdpa"):
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=32, vocab_size=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, attn_implementation=attn)


def hf_gpt2(layers: int = 2, attn: str = "sdpa"):
    from transformers import GPT2Model

    torch.manual_seed(0)
    return _randomise(GPT2Model(gpt2_config(layers, attn)).eval())


class GAttn(nn.Module):
    def __init__(self, d, heads, bugs=(), variant=None):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv = nn.ModuleDict({n: nn.Linear(d, d) for n in "qkv"})
        self.proj = nn.Linear(d, d)
        self.bugs, self.variant = set(bugs), variant

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (self.qkv[n](x).view(b, s, self.heads, self.hd).transpose(1, 2) for n in "qkv")
        if self.variant == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = torch.full((self.heads, 1, 1), 1.0 / math.sqrt(self.hd))
            if "scale_one_group" in self.bugs:
                scale[: self.heads // 2] = 1.0
            w = torch.matmul(q, k.transpose(-1, -2)) * scale
            above = torch.ones(s, s, dtype=torch.bool).triu(2 if "mask_off_by_one" in self.bugs else 1)
            w = w.masked_fill(above, float("-inf"))
            o = torch.matmul(torch.softmax(w, dim=-2 if "softmax_dim" in self.bugs else -1), v)
        return self.proj(o.transpose(1, 2).reshape(b, s, d))


class GFfn(nn.Module):
    def __init__(self, d, variant=None):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.variant = variant

    def forward(self, x):
        if self.variant == "mul_sum":  # the projection as elementwise products and a sum
            h = (x[..., None, :] * self.up.weight).sum(-1) + self.up.bias
        else:
            h = self.up(x)
        return self.down(F.gelu(h, approximate="tanh"))


class GBlock(nn.Module):
    def __init__(self, d, heads, bugs=(), variant=None):
        super().__init__()
        self.norm_a = nn.LayerNorm(d)
        self.att = GAttn(d, heads, bugs, variant)
        self.norm_b = nn.LayerNorm(d, bias="ln_no_bias" not in bugs)
        self.ff = GFfn(d, variant)
        self.bugs = set(bugs)

    def forward(self, x):
        a = self.att(self.norm_a(x))
        x = x + x + a if "residual_twice" in self.bugs else x + a
        return x + self.ff(self.norm_b(x))


class MyGPT2(nn.Module):
    """``tok``, ``pos``, ``blocks.N.{norm_a, att.qkv.{q, k, v}, att.proj, norm_b, ff.{up, down}}``, ``norm_out``;
    ``bug`` in block 1 (``pos_offset``: the model's), ``variant`` everywhere."""

    def __init__(self, cfg, bug=None, variant=None):
        super().__init__()
        d = cfg.n_embd
        self.tok = nn.Embedding(cfg.vocab_size, d)
        self.pos = nn.Embedding(cfg.n_positions, d)
        self.blocks = nn.ModuleList(GBlock(d, cfg.n_head, (bug,) if bug and i == 1 else (), variant)
                                    for i in range(cfg.n_layer))
        self.norm_out = nn.LayerNorm(d)
        self.bug, self.variant = bug, variant

    def forward(self, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.variant == "autocast"):
            p = torch.arange(ids.shape[1]) + (1 if self.bug == "pos_offset" else 0)
            x = self.tok(ids) + self.pos(p)[None]
            for b in self.blocks:
                x = b(x)
            return self.norm_out(x)


def gpt2_rewrite(hf, bug=None, variant=None) -> MyGPT2:
    """The rewrite with ``hf``'s weights (``Conv1D`` weights transposed into ``nn.Linear``'s layout, ``c_attn``
    split into q, k and v); ``transposed_weight``: layer 1's attention output loaded without the transpose."""
    mine = MyGPT2(hf.config, bug, variant)
    sd = hf.state_dict()
    d = hf.config.n_embd
    new = {"tok.weight": sd["wte.weight"], "pos.weight": sd["wpe.weight"], "norm_out.weight": sd["ln_f.weight"],
           "norm_out.bias": sd["ln_f.bias"]}
    for i in range(hf.config.n_layer):
        p, q = f"h.{i}.", f"blocks.{i}."
        for a, b in (("ln_1", "norm_a"), ("ln_2", "norm_b")):
            new[q + b + ".weight"], new[q + b + ".bias"] = sd[p + a + ".weight"], sd[p + a + ".bias"]
        w, bias = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
        for k, n in enumerate("qkv"):
            new[q + f"att.qkv.{n}.weight"] = w[:, k * d:(k + 1) * d].T
            new[q + f"att.qkv.{n}.bias"] = bias[k * d:(k + 1) * d]
        for a, b in (("attn.c_proj", "att.proj"), ("mlp.c_fc", "ff.up"), ("mlp.c_proj", "ff.down")):
            w = sd[p + a + ".weight"]
            new[q + b + ".weight"] = w if (bug == "transposed_weight" and i == 1 and b == "att.proj") else w.T
            new[q + b + ".bias"] = sd[p + a + ".bias"]
    own = mine.state_dict()
    mine.load_state_dict({k: v.contiguous() for k, v in new.items() if k in own})
    return mine.eval()


_GPT2_MODULES = [
    (r"^wte", "tok"), (r"^wpe", "pos"), (r"^ln_f", "norm_out"), (r"^add\.1$", "add.0"),
    (r"^h\.(\d+)\.ln_1", r"blocks.\1.norm_a"), (r"^h\.(\d+)\.ln_2", r"blocks.\1.norm_b"),
    (r"^h\.(\d+)\.attn\.c_attn\.addmm", r"blocks.\1.att.qkv.linear"), (r"^h\.(\d+)\.attn\.c_attn", r"blocks.\1.att.qkv"),
    (r"^h\.(\d+)\.attn\.c_proj\.addmm", r"blocks.\1.att.proj.linear"), (r"^h\.(\d+)\.attn\.c_proj", r"blocks.\1.att.proj"),
    (r"^h\.(\d+)\.attn", r"blocks.\1.att"),
    (r"^h\.(\d+)\.mlp\.c_fc\.addmm", r"blocks.\1.ff.up.linear"), (r"^h\.(\d+)\.mlp\.c_fc", r"blocks.\1.ff.up"),
    (r"^h\.(\d+)\.mlp\.c_proj\.addmm", r"blocks.\1.ff.down.linear"), (r"^h\.(\d+)\.mlp\.c_proj", r"blocks.\1.ff.down"),
    (r"^h\.(\d+)\.mlp\.act\.(?!forward)", r"blocks.\1.ff."), (r"^h\.(\d+)\.mlp", r"blocks.\1.ff"),
    (r"^h\.(\d+)", r"blocks.\1"),
]


def gpt2_module(ref_op: str) -> str:
    """The rewrite's name for a GPT-2 op (its module path, and ``linear`` for a ``Conv1D``'s ``addmm``)."""
    return M.renamed(ref_op, _GPT2_MODULES)


def gpt2_cases(compile_ok: bool) -> list[X.Case]:
    hf = hf_gpt2()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = X.capture(hf, x)
    out = [X.Case("gpt2", "hf vs rewrite", bug, "bug", ref, X.capture(gpt2_rewrite(hf, bug), x), gpt2_module,
                  bug_module=where) for bug, where in GPT2_BUGS.items()]
    for v, name in ((None, "rewrite, written-out attn"), ("sdpa", "rewrite, sdpa"), ("mul_sum", "mul+sum vs matmul"),
                    ("autocast", "bf16 autocast")):
        out.append(X.Case("gpt2", "hf vs rewrite", name, "benign", ref, X.capture(gpt2_rewrite(hf, variant=v), x),
                          gpt2_module))
    eager = hf_gpt2(attn="eager")
    out.append(X.Case("gpt2", "sdpa vs eager attention", "attention kernel", "benign", ref, X.capture(eager, x)))
    if compile_ok:
        mine = gpt2_rewrite(hf)
        comp = copy.deepcopy(mine)
        comp.compile()
        out.append(X.Case("gpt2", "eager vs compiled", "rewrite, fused gelu", "benign", X.capture(mine, x),
                          X.capture(comp, x)))
        torch._dynamo.reset()
    return out


# ---- Mistral against the Llama rewrite --------------------------------------------------------------------

def hf_mistral(layers: int = 2):
    from transformers import MistralConfig, MistralModel

    cfg = MistralConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=64, sliding_window=None,
                        bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    return _randomise(MistralModel(cfg).eval())


def mistral_cases() -> list[X.Case]:
    hf = hf_mistral()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = X.capture(hf, x)
    out = []
    for bug in ("gqa_repeat", "mask_off_by_one"):
        mine = M.load_from_hf(M.MyLlama(hf.config, bug=bug, bug_layer=1, variant="manual_attn"), hf)
        out.append(X.Case("mistral", "hf vs llama rewrite", bug, "bug", ref, X.capture(mine, x), M.llama_module,
                          bug_module="layers.1.self_attn"))
    for v, name in ((None, "rewrite, sdpa"), ("manual_attn", "rewrite, written-out attn")):
        mine = M.load_from_hf(M.MyLlama(hf.config, variant=v), hf)
        out.append(X.Case("mistral", "hf vs llama rewrite", name, "benign", ref, X.capture(mine, x), M.llama_module))
    return out


# ---- ViT: the patch embedding by unfold and a matmul ------------------------------------------------------

class UnfoldPatches(nn.Module):
    """A conv patch embedding (kernel = stride = patch) as unfold and a matmul; ``swap``: the patch grid read
    with its rows and columns swapped."""

    def __init__(self, conv: nn.Conv2d, swap: bool = False):
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1).clone())
        self.bias = nn.Parameter(conv.bias.detach().clone())
        self.p, self.swap = conv.kernel_size[0], swap

    def forward(self, x):
        b, _, h, w = x.shape
        cols = F.unfold(x, self.p, stride=self.p)  # (b, c*p*p, patches)
        y = F.linear(cols.transpose(1, 2), self.weight, self.bias).transpose(1, 2)
        gh, gw = h // self.p, w // self.p
        return y.reshape(b, -1, gw, gh).transpose(-1, -2) if self.swap else y.reshape(b, -1, gh, gw)


def hf_vit(attn: str = "sdpa"):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=12, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, attn_implementation=attn)
    torch.manual_seed(0)
    return _randomise(ViTModel(cfg, add_pooling_layer=False).eval())


def vit_cases() -> list[X.Case]:
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    base = hf_vit()
    ref = X.capture(base, x)

    def unfolded(swap=False):
        m = copy.deepcopy(base)
        pe = m.embeddings.patch_embeddings
        pe.projection = UnfoldPatches(pe.projection, swap)
        return m

    out = [X.Case("vit", "conv vs unfold patches", "patch order", "bug", ref, X.capture(unfolded(True), x),
                  bug_module="embeddings.patch_embeddings")]
    nb = copy.deepcopy(base)
    with torch.no_grad():
        nb.layers[1].layernorm_after.bias.zero_()
    out.append(X.Case("vit", "two versions", "ln_no_bias", "bug", ref, X.capture(nb, x),
                      bug_module="layers.1.layernorm_after"))
    out.append(X.Case("vit", "conv vs unfold patches", "unfold + matmul", "benign", ref, X.capture(unfolded(), x)))
    out.append(X.Case("vit", "sdpa vs eager attention", "attention kernel", "benign", ref,
                      X.capture(hf_vit("eager"), x)))
    out.append(X.Case("vit", "fp32 vs bf16", "bf16", "benign", ref,
                      X.capture(copy.deepcopy(base).to(torch.bfloat16), x.to(torch.bfloat16))))
    return out


def heldout_cases(compile_ok: bool = True) -> list[X.Case]:
    return gpt2_cases(compile_ok) + mistral_cases() + vit_cases()


def main() -> None:
    t0 = time.perf_counter()
    cases = heldout_cases("--no-compile" not in sys.argv)
    X.run_cases(cases)
    s = X.report(cases)
    X.summary(cases, s, time.perf_counter() - t0)


if __name__ == "__main__":
    main()

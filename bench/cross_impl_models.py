"""Models for bench/cross_impl.py and tests/test_xdiff.py: a ``transformers`` Llama built from config and a
rewrite of it with other module names, a fused qkv projection and its own attention and RoPE code, into which
silent bugs and benign variants are switched on by name."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

# bugs that change the numbers without a NaN, and variants that should change nothing beyond rounding
LLAMA_BUGS = ("eps", "rope_offset", "mask", "scale", "residual", "transposed_scale", "silu_gelu")
LLAMA_BENIGN = ("manual_attn", "sum_div_norm", "split_matmul", "fp64_rope", "rsqrt_div")


def llama_config(layers: int = 2, d: int = 32, heads: int = 4, kv: int = 2, inter: int = 64, vocab: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=inter, vocab_size=vocab, max_position_embeddings=64,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation="sdpa")


def hf_llama(cfg, seed: int = 0):
    from transformers import LlamaModel

    torch.manual_seed(seed)
    return LlamaModel(cfg).eval()


class Norm(nn.Module):
    def __init__(self, d, eps, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.variant = eps, variant

    def forward(self, x):
        h = x.float()
        if self.variant == "sum_div_norm":
            var = h.pow(2).sum(-1, keepdim=True) / h.shape[-1]
        else:
            var = h.pow(2).mean(-1, keepdim=True)
        if self.variant == "rsqrt_div":
            h = h / torch.sqrt(var + self.eps)
        else:
            h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(x.dtype)


class Rope(nn.Module):
    def __init__(self, head_dim, theta, offset=0, variant=None):
        super().__init__()
        self.register_buffer("inv", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)
        self.offset, self.variant = offset, variant

    def forward(self, x, pos):
        p = pos[..., None].float() + self.offset if self.offset else pos[..., None].float()
        if self.variant == "fp64_rope":
            f = (p.double() * self.inv.double()).float()
        else:
            f = p * self.inv
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rot(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Mix(nn.Module):
    """Attention with one fused qkv projection; q and k stay (batch, seq, heads, dim) through RoPE."""

    def __init__(self, d, heads, kv, bugs=(), variant=None):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv) * self.hd, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.bugs, self.variant = set(bugs), variant

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = q.reshape(b, s, self.heads, self.hd)
        k = k.reshape(b, s, self.kv, self.hd)
        v = v.reshape(b, s, self.kv, self.hd).transpose(1, 2)
        c, sn = cos.unsqueeze(2), sin.unsqueeze(2)
        if "rope_offset" in self.bugs:  # the queries' positions one step off the keys'
            c, sn = torch.roll(c, 1, dims=1), torch.roll(sn, 1, dims=1)
            q = (q * c) + (_rot(q) * sn)
            c, sn = cos.unsqueeze(2), sin.unsqueeze(2)
        else:
            q = (q * c) + (_rot(q) * sn)
        k = (k * c) + (_rot(k) * sn)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        scale = 1.0 if "scale" in self.bugs else 1.0 / math.sqrt(self.hd)
        if "transposed_scale" in self.bugs:
            scale = math.sqrt(self.hd)
        causal = "mask" not in self.bugs
        if self.variant == "manual_attn":
            rep = self.heads // self.kv
            if "gqa_repeat" in self.bugs:  # the kv heads tiled, not interleaved: queries read another group's keys
                kk, vv = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
            else:
                kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            w = torch.matmul(q, kk.transpose(-1, -2)) * scale
            if causal:  # "mask_off_by_one": each query also sees the next key
                w = w.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(2 if "mask_off_by_one" in self.bugs else 1),
                                  float("-inf"))
            o = torch.matmul(torch.softmax(w, dim=-1), vv)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Ffn(nn.Module):
    def __init__(self, d, inter, bugs=(), variant=None):
        super().__init__()
        self.gate = nn.Linear(d, inter, bias=False)
        self.up = nn.Linear(d, inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)
        self.bugs, self.variant = set(bugs), variant

    def forward(self, x):
        g = F.gelu(self.gate(x)) if "silu_gelu" in self.bugs else F.silu(self.gate(x))
        h = g * self.up(x)
        if self.variant == "split_matmul":  # the inner sum in two halves: another reduction order
            k = h.shape[-1] // 2
            w = self.down.weight
            return F.linear(h[..., :k], w[:, :k]) + F.linear(h[..., k:], w[:, k:])
        return self.down(h)


class Block(nn.Module):
    def __init__(self, cfg, bugs=(), variant=None):
        super().__init__()
        eps = cfg.rms_norm_eps * (1e3 if "eps" in bugs else 1.0)
        self.norm1 = Norm(cfg.hidden_size, eps, variant)
        self.mix = Mix(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, bugs, variant)
        self.norm2 = Norm(cfg.hidden_size, cfg.rms_norm_eps, variant)
        self.ffn = Ffn(cfg.hidden_size, cfg.intermediate_size, bugs, variant)
        self.bugs = set(bugs)

    def forward(self, x, cos, sin):
        a = self.mix(self.norm1(x), cos, sin)
        x = a if "residual" in self.bugs else x + a
        return x + self.ffn(self.norm2(x))


class MyLlama(nn.Module):
    """The rewrite: ``embed``, ``rope``, ``blocks.N.{norm1, mix.qkv, mix.out, norm2, ffn.{gate, up, down}}``,
    ``final``.  ``bug`` is switched on in block ``bug_layer``; ``variant`` everywhere."""

    def __init__(self, cfg, bug=None, bug_layer=0, variant=None):
        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        self.rope = Rope(hd, theta, 0, variant)
        self.blocks = nn.ModuleList(Block(cfg, (bug,) if bug and i == bug_layer else (), variant)
                                    for i in range(cfg.num_hidden_layers))
        self.final = Norm(cfg.hidden_size, cfg.rms_norm_eps, variant)

    def forward(self, ids):
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = self.rope(x, pos)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.final(x)


def load_from_hf(mine: MyLlama, hf) -> MyLlama:
    sd = hf.state_dict()
    new = {"embed.weight": sd["embed_tokens.weight"], "final.weight": sd["norm.weight"]}
    for i in range(len(mine.blocks)):
        p = f"layers.{i}."
        new[f"blocks.{i}.norm1.weight"] = sd[p + "input_layernorm.weight"]
        new[f"blocks.{i}.norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        new[f"blocks.{i}.mix.qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        new[f"blocks.{i}.mix.out.weight"] = sd[p + "self_attn.o_proj.weight"]
        for a, b in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            new[f"blocks.{i}.ffn.{a}.weight"] = sd[p + f"mlp.{b}.weight"]
    mine.load_state_dict(new)
    return mine.eval()


# the rewrite's module paths for the reference's (ground truth of the pairing)
_LLAMA_MODULES = [
    (r"^embed_tokens", "embed"), (r"^rotary_emb", "rope"), (r"^norm(?=\.)", "final"),
    (r"^layers\.(\d+)\.input_layernorm", r"blocks.\1.norm1"),
    (r"^layers\.(\d+)\.post_attention_layernorm", r"blocks.\1.norm2"),
    (r"^layers\.(\d+)\.self_attn\.[qkv]_proj", r"blocks.\1.mix.qkv"),
    (r"^layers\.(\d+)\.self_attn\.o_proj", r"blocks.\1.mix.out"),
    (r"^layers\.(\d+)\.self_attn", r"blocks.\1.mix"),
    (r"^layers\.(\d+)\.mlp\.act_fn\.(?!forward)", r"blocks.\1.ffn."),
    (r"^layers\.(\d+)\.mlp\.gate_proj", r"blocks.\1.ffn.gate"), (r"^layers\.(\d+)\.mlp\.up_proj", r"blocks.\1.ffn.up"),
    (r"^layers\.(\d+)\.mlp\.down_proj", r"blocks.\1.ffn.down"), (r"^layers\.(\d+)\.mlp", r"blocks.\1.ffn"),
    (r"^layers\.(\d+)", r"blocks.\1"),
]


def renamed(ref_op: str, table) -> str:
    """A reference op's name in a rewrite: the first ``(pattern, replacement)`` of ``table`` that matches it
    applied (the op's own suffix kept); the name itself when none does."""
    for pat, rep in table:
        new, n = re.subn(pat, rep, ref_op)
        if n:
            return new
    return ref_op


def llama_module(ref_op: str) -> str:
    """The rewrite's name for a reference op's module path (the op's own suffix kept)."""
    return renamed(ref_op, _LLAMA_MODULES)


# ---- an encoder: transformers BERT built from config ------------------------------------------------------

def bert(attn: str = "sdpa", seed: int = 0, layers: int = 2):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=64, max_position_embeddings=32, attn_implementation=attn)
    torch.manual_seed(seed)
    return BertModel(cfg, add_pooling_layer=False).eval()


def _no_residual(self, hidden_states, input_tensor):
    return self.LayerNorm(self.dropout(self.dense(hidden_states)))


def bert_bug(model, bug: str, layer: int = 1):
    """Switch a silent bug on in one layer of a BERT model (in place); returns the module path it is in."""
    lay = model.encoder.layer[layer]
    p = f"encoder.layer.{layer}"
    if bug == "eps":
        lay.output.LayerNorm.eps = 1e-1
        return p + ".output.LayerNorm"
    if bug == "scale":
        lay.attention.self.scaling = 1.0
        return p + ".attention.self"
    if bug == "transposed":
        with torch.no_grad():
            lay.attention.output.dense.weight.copy_(lay.attention.output.dense.weight.T.clone())
        return p + ".attention.output.dense"
    if bug == "act":
        lay.intermediate.intermediate_act_fn = nn.ReLU()
        return p + ".intermediate"
    if bug == "residual":
        import types

        lay.output.forward = types.MethodType(_no_residual, lay.output)
        return p + ".output"
    raise ValueError(bug)


BERT_BUGS = ("eps", "scale", "transposed", "act", "residual")


# ---- a conv net (own) --------------------------------------------------------------------------------------

class ConvBlock(nn.Module):
    def __init__(self, c, bug=None, fold=False):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=fold)
        self.bn = nn.BatchNorm2d(c, eps=1e-1 if bug == "eps" else 1e-5)
        self.bug, self.fold = bug, fold

    def forward(self, x):
        h = self.conv(x) if self.fold else self.bn(self.conv(x))
        if self.bug == "scale":
            h = h * 0.5
        h = h if self.bug == "relu" else F.relu(h)
        return h if self.bug == "residual" else x + h


class ConvNet(nn.Module):
    def __init__(self, c=8, n=3, bug=None, bug_block=1, fold=False):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(c, bug if i == bug_block else None, fold) for i in range(n))
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(dim=(2, 3)))


CONV_BUGS = ("eps", "scale", "relu", "residual", "flipped")


def conv_net(bug=None, fold=False, seed=0):
    torch.manual_seed(seed)
    ref = ConvNet().eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for b in ref.blocks:
            b.bn.running_mean.uniform_(-0.5, 0.5)
            b.bn.running_var.uniform_(0.5, 2.0)
    if bug is None and not fold:
        return ref
    new = ConvNet(bug=None if bug == "flipped" else bug, fold=fold).eval()
    sd = ref.state_dict()
    if fold:  # BatchNorm folded into the conv before it: one conv computes what two ops did
        for i, b in enumerate(new.blocks):
            rb = ref.blocks[i]
            s = rb.bn.weight / torch.sqrt(rb.bn.running_var + rb.bn.eps)
            sd[f"blocks.{i}.conv.weight"] = rb.conv.weight * s[:, None, None, None]
            sd[f"blocks.{i}.conv.bias"] = rb.bn.bias - rb.bn.running_mean * s
            for k in list(sd):
                if k.startswith(f"blocks.{i}.bn."):
                    sd.pop(k)
        new.load_state_dict(sd, strict=False)
    else:
        new.load_state_dict(sd)
    if bug == "flipped":  # the kernel read the other way round (a port that mixed up cross-correlation)
        with torch.no_grad():
            new.blocks[1].conv.weight.copy_(torch.flip(new.blocks[1].conv.weight, dims=(2, 3)))
    return new


# ---- a mixture-of-experts block (own) ---------------------------------------------------------------------

class Moe(nn.Module):
    """Top-2 routing over 4 experts, then a residual; ``batched``: every expert on every token with the
    routing weights as a dense matrix (another op sequence, the same numbers up to rounding)."""

    def __init__(self, d=16, e=4, bug=None, batched=False, reverse=False):
        super().__init__()
        self.router = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.SiLU(), nn.Linear(32, d)) for _ in range(e))
        self.norm = nn.LayerNorm(d)
        self.bug, self.batched, self.reverse = bug, batched, reverse

    def forward(self, x):
        h = self.norm(x)
        logits = self.router(h)
        probs = torch.softmax(logits * (2.0 if self.bug == "temperature" else 1.0), dim=-1)
        w, idx = probs.topk(2, dim=-1)
        if self.bug != "no_renorm":
            w = w / w.sum(-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(-1, idx, w)
        if self.bug == "wrong_expert":
            dense = dense.roll(1, dims=-1)
        if self.batched:  # every expert's output stacked, weighted and summed in one reduction
            ys = torch.stack([e(h) for e in self.experts], dim=-1)
            out = (ys * dense[..., None, :]).sum(-1)
        else:
            order = range(len(self.experts) - 1, -1, -1) if self.reverse else range(len(self.experts))
            out = torch.zeros_like(x)
            for k in order:
                y = self.experts[k](h)
                out = out + y * dense[..., k:k + 1]
        return out if self.bug == "residual" else x + out


MOE_BUGS = ("no_renorm", "temperature", "wrong_expert", "residual")


class MoeNet(nn.Module):
    """A projection, the mixture-of-experts block (``moe``), a projection."""

    def __init__(self, **kw):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.moe = Moe(**kw)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


# ---- a model of our own: fp32 against fp8 with quantise ops -----------------------------------------------

class Quant(nn.Module):
    """Fake fp8 (e4m3) quantisation: scale to the format's range, round through float8, scale back."""

    def __init__(self, per_row=False, bug=None):
        super().__init__()
        self.per_row, self.bug = per_row, bug

    def forward(self, x):
        per_row = self.per_row or self.bug == "transposed_scale"
        amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
        scale = 448.0 / amax.clamp(min=1e-12)
        q = (x * scale).to(torch.float8_e4m3fn).float()
        if self.bug == "missing_scale":
            return q
        return q / (scale.T if self.bug == "transposed_scale" else scale)  # a row's scale read as a column's


class QLinear(nn.Module):
    def __init__(self, lin, per_row=False, bug=None):
        super().__init__()
        self.lin = lin
        self.qx, self.qw = Quant(per_row), Quant(per_row, bug)

    def forward(self, x):
        return F.linear(self.qx(x), self.qw(self.lin.weight), self.lin.bias)


class OwnBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop_residual = False

    def forward(self, x):
        h = torch.tanh(self.fc(self.norm(x)))
        return h if self.drop_residual else x + h


class Own(nn.Module):
    def __init__(self, d=32, n=3):
        super().__init__()
        self.layers = nn.ModuleList(OwnBlock(d) for _ in range(n))
        self.out = nn.Linear(d, d)
        with torch.no_grad():  # rows of very different sizes: what per-row fp8 scales are for
            for layer in self.layers:
                layer.fc.weight.mul_(torch.logspace(-1, 1, d)[:, None])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


OWN_BUGS = ("transposed_scale", "missing_scale", "residual")


def own_fp8(bug=None, per_row=False, quantise=True, seed=0):
    """The own model, its ``layers.N.fc`` in fake fp8 (with ``bug`` in layer 1) when ``quantise``."""
    torch.manual_seed(seed)
    m = Own().eval()
    if not quantise:
        return m
    for i, layer in enumerate(m.layers):
        layer.fc = QLinear(layer.fc, per_row, bug if i == 1 and bug != "residual" else None)
    m.layers[1].drop_residual = bug == "residual"
    return m

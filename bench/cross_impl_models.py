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
            kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            w = torch.matmul(q, kk.transpose(-1, -2)) * scale
            if causal:
                w = w.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
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
    (r"^layers\.(\d+)\.mlp\.gate_proj", r"blocks.\1.ffn.gate"), (r"^layers\.(\d+)\.mlp\.up_proj", r"blocks.\1.ffn.up"),
    (r"^layers\.(\d+)\.mlp\.down_proj", r"blocks.\1.ffn.down"), (r"^layers\.(\d+)\.mlp", r"blocks.\1.ffn"),
    (r"^layers\.(\d+)", r"blocks.\1"),
]


def llama_module(ref_op: str) -> str:
    """The rewrite's name for a reference op's module path (the op's own suffix kept)."""
    for pat, rep in _LLAMA_MODULES:
        new, n = re.subn(pat, rep, ref_op)
        if n:
            return new
    return ref_op

"""A user's model for the entry-point tests: a 2-layer Qwen2 built from config (no download) whose layer-1 MLP
overflows fp16 (its gate/up inputs are scaled by the post-attention norm, its down projection by 1000)."""

import torch
# the classes from their own modules, not through the package's lazy attributes: a process whose threads import
# ``transformers`` for the first time at once (a dashboard page and a re-run) gives all but one of them the
# package's module from before it replaced itself in sys.modules, which has no model classes
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")


def build():
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.mul_(1000.0)
        m.model.layers[1].post_attention_layernorm.weight.mul_(80.0)
    return m


def inputs():
    return {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))}


def loss(out):
    return out.logits.float().pow(2).mean()

"""Which fixes apply to which kind of model: ``precision-lab fixes --session`` over models nobody here wrote.

Each model is built from config with random weights (no downloads): Hugging Face ``transformers`` Qwen2,
Llama, GPT-2, BERT and T5, a conv net with BatchNorm and GroupNorm, and the same Qwen2 under torch.compile (per
decoder layer) and under the fp8 row-wise preset.  Each is captured (fp32 reference and candidate, no local
error) into a temporary database, and ``services.applicable.applicable_fixes`` says, for every fix of the
catalogue, whether it applies to that session's model.  Prints one table: a row per fix, a column per model,
``yes`` where it applies, ``-`` where it does not (the reason is in ``fixes --session``).

    python bench/fix_applicability.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from precision_lab.fixes.catalogue import FIXES  # noqa: E402
from precision_lab.fixes.policy import POLICIES, PrecisionPolicy  # noqa: E402
from precision_lab.fixes.recipes import Recipe, register_recipe  # noqa: E402
from precision_lab.services.applicable import applicable_fixes  # noqa: E402
from precision_lab.services.rerun import capture_recipe  # noqa: E402
from precision_lab.store import Store, close_all  # noqa: E402


def _hf(kind: str):
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64, **small)
        return tf.Qwen2ForCausalLM(cfg)
    if kind == "llama":
        cfg = tf.LlamaConfig(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64, **small)
        return tf.LlamaForCausalLM(cfg)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    if kind == "bert":
        return tf.BertModel(tf.BertConfig(intermediate_size=128, max_position_embeddings=64, **small))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                                         num_layers=2, num_heads=4, decoder_start_token_id=0))
    raise KeyError(kind)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def _ids(kind: str):
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, 128, (2, 16), generator=g)}
    if kind == "t5":
        inputs["decoder_input_ids"] = torch.randint(0, 128, (2, 8), generator=g)
    return inputs


FP16 = PrecisionPolicy("fp16", "fp16")
MODELS = {
    "Qwen2": (lambda: (_hf("qwen2"), _ids("qwen2")), FP16),
    "Llama": (lambda: (_hf("llama"), _ids("llama")), FP16),
    "GPT-2": (lambda: (_hf("gpt2"), _ids("gpt2")), FP16),
    "BERT": (lambda: (_hf("bert"), _ids("bert")), FP16),
    "T5": (lambda: (_hf("t5"), _ids("t5")), FP16),
    "conv+BN": (lambda: (ConvNet(), torch.randn(2, 3, 8, 8)), FP16),
    "Qwen2 compiled": (lambda: (_hf("qwen2"), _ids("qwen2")), FP16.replace(compile="layers.*")),
    "Llama fp8 row": (lambda: (_hf("llama"), _ids("llama")), POLICIES["fp8-e4m3-row"]),
}


def main() -> int:
    columns = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "fixes.duckdb")
        for i, (label, (build, policy)) in enumerate(MODELS.items()):
            recipe = register_recipe(Recipe(f"bench-fixes-{i}", label, build, policy), replace=True)
            name = capture_recipe(store, recipe, local_error=False, session=f"m{i}")
            columns[label] = {r.fix.split(":")[0]: r.applies for r in applicable_fixes(store, name)}
            print(f"{label}: captured", file=sys.stderr)
        close_all()
    labels = list(columns)
    width = max(len(n) for n in FIXES) + 2
    print("fix".ljust(width) + "  ".join(labels))
    for name in sorted(FIXES):
        print(name.ljust(width) + "  ".join(("yes" if columns[m].get(name) else "-").ljust(len(m)) for m in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())

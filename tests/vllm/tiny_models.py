"""Tiny random-weight checkpoints with a word-level tokenizer, built offline for the vLLM tier.

Sizes fit vLLM's CPU backend (head size 32; hidden and MoE intermediate sizes multiples of 32).
Weights are drawn with a larger std than HF's default so that greedy decoding has clear margins
(near-uniform logits would make token equality a coin toss on rounding noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 256
WORDS = ("the quick brown fox jumps over lazy dog hello world serve model kernel token cache page block "
         "norm gate expert router layer head query key value plugin engine batch decode prefill").split()

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

FAMILIES = {
    "llama": dict(model_type="llama"),
    "gemma": dict(model_type="gemma", num_key_value_heads=1, hidden_activation="gelu_pytorch_tanh"),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=128),
}


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    names = specials + list(WORDS)
    names += [f"w{i}" for i in range(VOCAB_SIZE - len(names))]
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


def build(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a ``family`` checkpoint (config, safetensors, tokenizer) to ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    settings = {**COMMON, **FAMILIES[family]}
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma norms are (1 + w): keep them near the identity either way
                param.normal_(0.0, 0.1).add_(0.0 if family == "gemma" else 1.0)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    (directory / "hw_agnostic_family.json").write_text(json.dumps({"family": family}))
    return directory


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1], sys.argv[2]))

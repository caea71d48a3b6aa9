"""Tiny random-weight Hugging Face models, built offline, shared by the backend tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": 16},
    "phi3": {},
    "granite": {},
    "olmo2": {},
}

#: What rewire must do to each family's 2 decoder layers: (norms, MLPs, q/k/v merges, fused layout).
EXPECTED = {
    "llama": (5, 2, 2, "pre_norm"),
    "mistral": (5, 2, 2, "pre_norm"),
    "qwen2": (5, 2, 2, "pre_norm"),
    "qwen3": (9, 2, 2, "pre_norm"),  # + q_norm/k_norm per layer
    "gemma": (5, 2, 2, "pre_norm"),
    "gemma2": (9, 2, 2, "sandwich"),
    "gemma3_text": (13, 2, 2, "sandwich"),  # + q_norm/k_norm
    "phi3": (5, 2, 0, "pre_norm"),  # q/k/v and gate/up already merged in the checkpoint layout
    "granite": (5, 2, 2, "pre_norm"),
    "olmo2": (9, 2, 2, None),  # post-norm: nothing to fuse
}


def config(family: str, **overrides):
    return AutoConfig.for_model(family, **{**TINY, **TOKENS, **FAMILIES[family], **overrides})


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(family, **overrides), dtype=dtype).eval()


def prompt(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def padded_prompt(batch: int = 2, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt and its attention mask, the second row left-padded by 3 (pad id 0)."""
    ids = prompt(batch, length)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask

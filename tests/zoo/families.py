"""Tiny configs for every causal-LM family transformers ships, built offline from its defaults.

Each family's default config is shrunk by one rule table over the attribute names configs use
for sizes (hidden, intermediate, layers, heads, experts, vocabulary, positions, ...): a value is
replaced only where the default config has that attribute, so the config's own ``__init__``
derives the rest (layer types, head dims, ...). Sub-configs (``text_config`` and the like) are
shrunk by the same table. :data:`OVERRIDES` holds what a family needs beyond the table, and
:data:`UNBUILDABLE` the families that cannot be built offline at all, with why.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 256

#: attribute name -> tiny value (applied where the default config has the attribute).
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "word_embed_proj_dim",
                     "hidden_dim", "lru_width", "backbone_hidden_size", "embedding_dim", "emb_dim",
                     "input_embedding_size", "output_embedding_size"), 64),
    "ffn_dim": 256,  # Moshi halves it for its gated MLP
    **dict.fromkeys(("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "mlp_dim",
                     "intermediate_size_mlp", "dense_intermediate_size", "feed_forward_size", "d_inner",
                     "decoder_ffn_dim", "encoder_ffn_dim", "inner_hidden_size", "dim_ff"), 128),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
                     "num_encoder_layers", "decoder_layers", "encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads", "decoder_attention_heads", "encoder_attention_heads",
                     "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
                     "n_kv_heads", "swa_num_key_value_heads"), 2),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_head", "kv_channels"), 16),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "n_vocab", "padded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_target_positions", "max_source_positions", "context_length"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_total"),
                    4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_selected_experts"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_groups"), 1),
    "n_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "sliding_window": 16,
    "attention_window_size": 16,
    "first_k_dense_replace": 1,
    "mamba_n_heads": 4,  # x mamba_d_head = hidden x mamba_expand (2)
    "mamba_d_head": 32,
    "mamba_d_ssm": 128,
}

#: what a family needs beyond the table (merged over the shrunk values).
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1]},  # its default has no attention layer at all
    "mamba2": {"head_dim": 32},  # num_heads x head_dim = hidden x expand
    "reformer": {"is_decoder": True},
    "zaya": {"num_experts_per_tok": 1},
}

#: families that cannot be built (or run, unrewired) offline at tiny size: model type -> why.
UNBUILDABLE: dict[str, str] = {
    "bailing_hybrid": "its linear-attention heads come out 0-wide at the shrunk sizes",
    "blt": "byte-latent config with no num_hidden_layers of its own (patcher/encoder/decoder sub-configs)",
    "cohere_compass_text": "its default config names no layer type its own cache knows ('full_attention' KeyError)",
    "dbrx": "its nested attention config loses rope_theta when rebuilt from a dict",
    "dory": "its layer_types must match input/recurrent/output layer counts that the shrunk config cannot keep",
    "dots3_note": "multimodal: its sliding-attention head_dim must equal qk_nope + qk_rope of another sub-config",
    "dots3_note_text": "its sliding-attention head_dim must equal qk_nope + qk_rope head dims at every size",
    "gemma3n": "needs the timm package for its vision tower",
    "gemma3n_text": "its KV-sharing layer pattern cannot be kept with fewer layers",
    "gemma4_assistant": "an assistant (drafter) model that needs its target's per-layer inputs",
    "gemma4_unified_assistant": "an assistant (drafter) model whose KV-sharing pattern cannot be kept with fewer layers",
    "granitemoehybrid": "its shrunk layer pattern keeps no attention layer, and its cache then refuses get_seq_length",
    "inkling2_loop_text": "its loop/hybrid-sliding layer pattern indexes past the shrunk layers",
    "inkling2_text": "its hybrid-sliding layer pattern indexes past the shrunk layers",
    "kimi_linear": "its MoE routing asks for more experts than the shrunk expert count",
    "kolibri1_1": "its default KV-sharing sources (kv_source_layers) are set for its full layer count, which a "
                  "shrunk config cannot keep (transformers 5.25)",
    "lfm2_moe": "its default config leaves layer_types unset, which its own forward reads",
    "mamba2": "its group/head split does not divide at the shrunk sizes",
    "musicgen": "text-to-audio: two text configs (encoder and decoder), not a plain causal LM",
    "musicgen_melody": "text-to-audio: two text configs (encoder and decoder), not a plain causal LM",
    "qwen4_exp": "its default config leaves sizes unset (None // None)",
    "qwen4_exp_text": "its default config leaves sizes unset (None // None)",
    "reformer": "its axial position embeddings must factor the hidden size and the sequence length",
    "xlstm": "its matrix-memory state shape does not follow the shrunk head sizes",
    "xmod": "needs a default language set on the model before any forward",
    "zamba": "its shared-transformer weight tying names layers the shrunk model does not have",
}

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "unk_token_id", "mask_token_id")


def families() -> list[str]:
    """Every model type with a causal-LM class in this transformers."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "decoder_layers")
#: attributes whose values are never shrunk when the default leaves them unset (None keeps a feature off).
_KEEP_NONE = ("sliding_window", "attention_window_size", "q_lora_rank", "first_k_dense_replace", "mamba_d_ssm")


def _layer_count(values: dict[str, Any]) -> int | None:
    return next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)


def _representative_layers(values: dict[str, Any], count: int) -> list[int] | None:
    """Layer indices keeping one layer of every kind a per-layer list names (two at least)."""
    kinds = [v for v in values.values() if isinstance(v, list) and len(v) == count and count > 2
             and all(isinstance(x, (str, int, bool)) for x in v)]
    if not kinds:
        return None
    chosen: list[int] = []
    for kind_list in kinds:
        firsts = {}
        for i, kind in enumerate(kind_list):
            firsts.setdefault(kind, i)
        chosen += firsts.values()
    chosen = sorted(set(chosen))
    i = 0
    while len(chosen) < 2:
        chosen = sorted(set(chosen) | {i})
        i += 1
    return chosen


def _shrunk(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    count = _layer_count(values)
    layers = _representative_layers(values, count) if count else None
    for name, value in values.items():
        if isinstance(value, dict) and ("hidden_size" in value or "vocab_size" in value or "d_model" in value):
            out[name] = {**value, **_shrunk(value)}
        elif name in SIZES and (isinstance(value, int) and not isinstance(value, bool)
                                or value is None and name not in _KEEP_NONE):
            out[name] = SIZES[name]
        elif name in _TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            out[name] = _TOKEN_IDS.index(name) % 3
        elif name in _TOKEN_IDS and isinstance(value, list):
            out[name] = [v if v < VOCAB else 2 for v in value if isinstance(v, int)]
    if layers is not None:
        for name in _LAYER_COUNTS:
            if name in out:
                out[name] = len(layers)
        for name, value in values.items():
            if isinstance(value, list) and len(value) == count:
                out[name] = [value[i] for i in layers]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                index = {old: new for new, old in enumerate(layers)}
                out[name] = {type(k)(index[int(k)]): v for k, v in value.items() if int(k) in index}
    if values.get("is_decoder") is False and "d_model" not in values:  # used as a causal LM: a decoder
        out["is_decoder"] = True
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv_heads:  # multi-head attention stays multi-head
        out["num_key_value_heads"] = SIZES["num_attention_heads"]
    if "qk_rope_head_dim" in values and values.get("head_dim") == values["qk_rope_head_dim"]:
        out["head_dim"] = SIZES["qk_rope_head_dim"]  # latent attention: head_dim names the rotary part
    return out


def _layer_kinds(config: Any) -> set[str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = getattr(text, name, None)
        if isinstance(value, (list, str)) and value:
            return set(value)
    return set()


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's default config, shrunk; grown back to more layers while the shrunk one loses
    a kind of layer the default has (a hybrid model's attention layers, say)."""
    default = AutoConfig.for_model(model_type)
    defaults = default.to_dict()
    values = {**_shrunk(defaults), **OVERRIDES.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **values)
    wanted = _layer_kinds(default)
    count_key = next((k for k in _LAYER_COUNTS if k in values), None)
    if count_key is None or not wanted or count_key in overrides:
        return config
    count = values[count_key]
    while _layer_kinds(config) != wanted and count < 8:
        count += 1
        config = AutoConfig.for_model(model_type, **{**values, count_key: count})
    return config


def build(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    _redraw_zero_linears(model)
    return model


def _redraw_zero_linears(model: torch.nn.Module) -> None:
    """Linear weights a family initialises to zero (Afmoe's router, some output projections) drawn
    like the others: a zero projection hides what it feeds from every check (anything times zero
    agrees) and ties every router score, where ``torch.topk``'s order is unspecified. Trained
    checkpoints have no such weights."""
    std = getattr(model.config, "initializer_range", None) or 0.02
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and weight is not None and not weight.is_meta and not weight.any():
                weight.normal_(0.0, std)

"""One side of the vLLM bench: greedy generation with vLLM, timed; run with ``.venv-vllm``'s python.

    python bench/vllm_generate.py --model DIR [--eager] --seqs 16 --prompt-len 64 --max-tokens 64

Builds a random-weight Llama-style (or, with ``--family mixtral``, Mixtral-style) checkpoint in
DIR if there is none, loads it with vLLM's
Transformers backend, generates once to warm up, then ``--repeats`` timed times, and prints one
JSON line: generated tokens per second for each repeat. Whether the plugin runs is the caller's
environment (``VLLM_USE_HW_AGNOSTIC=1``, ``VLLM_PLUGINS``), so both sides run this same script.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

BENCH_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {"llama": {}, "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512)}


def build(directory: Path, family: str = "llama") -> None:
    if (directory / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**BENCH_MODEL, **FAMILIES[family]})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    args = parser.parse_args()
    build(args.model, args.family)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    generator = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, BENCH_MODEL["vocab_size"], (args.prompt_len,),
                                                           generator=generator).tolist())
               for _ in range(args.seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(model=str(args.model), model_impl="transformers", dtype="float32", skip_tokenizer_init=True,
              max_model_len=args.prompt_len + args.max_tokens, max_num_seqs=args.seqs,
              enforce_eager=args.eager, gpu_memory_utilization=0.1, seed=0)
    llm.generate(prompts, params, use_tqdm=False)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    print("RESULT " + json.dumps({"tokens_per_s": rates}), flush=True)


if __name__ == "__main__":
    main()

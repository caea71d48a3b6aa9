"""Run greedy generation with vLLM for a list of checkpoints and write the tokens as JSON.

    python run_llm.py SPEC.json OUT.json

SPEC: ``{"runs": [{"name", "model", "tp", "eager"}], "max_tokens": N, "prompts": [[ids]]}``.
The environment decides the rest (``VLLM_USE_HW_AGNOSTIC``, ``VLLM_PLUGINS``, ...), so the
same script is vLLM with and without the plugin. Runs execute one after another in this process
(the engine in-process when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to pay vLLM's start-up once.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(spec_path).read())
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    results = {}
    for run in spec["runs"]:
        start = time.perf_counter()
        llm = LLM(model=run["model"], model_impl="transformers", dtype="float32", max_model_len=128,
                  max_num_seqs=8, enforce_eager=run["eager"], tensor_parallel_size=run.get("tp", 1),
                  distributed_executor_backend="mp" if run.get("tp", 1) > 1 else None,
                  gpu_memory_utilization=0.1, seed=0)
        loaded = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        done = time.perf_counter()
        results[run["name"]] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "load_s": loaded - start, "generate_s": done - loaded,
        }
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        with open(out_path, "w") as f:  # written after each run: a later failure keeps the earlier
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

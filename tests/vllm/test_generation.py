"""vLLM with the plugin against vLLM without it, end to end, on tiny offline checkpoints.

Three child processes (each pays vLLM's start-up once; see ``run_llm.py``), the first two side by side:

* vLLM without the plugin (``VLLM_PLUGINS=""``), its own hw-agnostic layers: llama, gemma and
  mixtral eager, llama compiled;
* vLLM with the plugin, the same four runs, with Dynamo's graph code logged;
* vLLM with the plugin at tensor parallel 2 (mixtral: norms, attention and the MoE reduction
  across two worker processes).

Greedy fp32 tokens must be identical, the plugin's ops must have run (counted in the processes
that ran the model), the compiled graph must hold ``torch.ops.hw_agnostic`` nodes with no graph
break, and TP=2 must give TP=1's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from hw_agnostic.integrations.vllm import counts  # noqa: E402

from .tiny_models import FAMILIES, build  # noqa: E402

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 20], [1, 4, 30, 31, 32, 33]]
MAX_TOKENS = 12
CHILD_TIMEOUT_S = 420


def _inspect_model_classes(root: Path) -> Path:
    """vLLM's facts about the Transformers backend's model classes (``$VLLM_CACHE_ROOT/modelinfos``),
    inspected once, in this process, for every child to read.

    Without them each child inspects each class in a fresh Python process of its own (12-14 s each
    on 2 cores: 37 s of the tier's critical path over the three children); here it takes about 2 s.
    vLLM uses a subprocess only to keep CUDA uninitialised in the engine's process, which importing
    these classes on the CPU does not touch."""
    from vllm.model_executor.models import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(root))
        patch.setattr(registry, "_run_in_subprocess", lambda fn: fn())
        for architecture in ("TransformersForCausalLM", "TransformersMoEForCausalLM"):
            registry.ModelRegistry.models[architecture].inspect_model_cls()
    infos = root / "modelinfos"
    assert len(list(infos.glob("*.json"))) == 2, list(infos.iterdir())
    return infos


def _start(tmp: Path, name: str, runs: list[dict], model_infos: Path, *, plugin: bool,
           extra_env: dict[str, str] | None = None):
    spec = tmp / f"{name}.spec.json"
    spec.write_text(json.dumps({"runs": runs, "max_tokens": MAX_TOKENS, "prompts": PROMPTS}))
    cache = tmp / f"{name}.cache"  # each child compiles into its own cache; the model-class facts are shared
    cache.mkdir()
    (cache / "modelinfos").symlink_to(model_infos, target_is_directory=True)
    env = dict(os.environ)
    env.pop("HW_AGNOSTIC_COMPILE_REFERENCE", None)  # the library's default CPU path, as a user gets it
    env.update(VLLM_USE_HW_AGNOSTIC="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(cache),
               HW_AGNOSTIC_VLLM_COUNTS_DIR=str(tmp / f"{name}.counts"),
               HW_AGNOSTIC_VLLM_OVERRIDES="+attention,+moe",  # off by default on the CPU (speed), tested here
               **(extra_env or {}))
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin
    stream = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(HERE / "run_llm.py"), str(spec), str(tmp / f"{name}.out.json")],
                            env=env, stdout=stream, stderr=subprocess.STDOUT, cwd=tmp)
    return name, proc, stream


def _finish(tmp: Path, started) -> dict:
    name, proc, stream = started
    try:
        proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stream.close()
    text = (tmp / f"{name}.log").read_text()
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}); log tail:\n{text[-6000:]}"
    counts_dir = tmp / f"{name}.counts"
    return {"tokens": json.loads((tmp / f"{name}.out.json").read_text()), "log": text,
            "counts": counts.read_counts(counts_dir) if counts_dir.exists() else []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    models = {family: str(build(family, tmp / family)) for family in FAMILIES}
    infos = _inspect_model_classes(tmp / "inspected")
    single = [{"name": f, "model": models[f], "eager": True} for f in FAMILIES]
    single.append({"name": "llama_compiled", "model": models["llama"], "eager": False})
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, f"tensor parallel 2 needs two cores, this process may use {cores}"
    # Without and with the plugin side by side, each on a core of its own (vLLM's start-up is
    # mostly single-threaded Python: together they take about the time of one).
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    without = _start(tmp, "vllm", single, infos, plugin=False,
                     extra_env={**in_process, "VLLM_CPU_OMP_THREADS_BIND": str(cores[0])})
    with_plugin = _start(tmp, "plugin", single, infos, plugin=True,
                         extra_env={**in_process, "VLLM_CPU_OMP_THREADS_BIND": str(cores[1]),
                                    "TORCH_LOGS": "graph_code,graph_breaks"})
    try:
        results = {"vllm": _finish(tmp, without), "plugin": _finish(tmp, with_plugin)}
    finally:  # one failed: do not leave the other running
        for _, proc, _ in (without, with_plugin):
            if proc.poll() is None:
                proc.kill()
    tp2 = _start(tmp, "tp2", [{"name": "mixtral_tp2", "model": models["mixtral"], "eager": True, "tp": 2}], infos,
                 plugin=True, extra_env={"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"})
    results["tp2"] = _finish(tmp, tp2)
    return results


@pytest.mark.parametrize("name", [*FAMILIES, "llama_compiled"])
def test_tokens_identical_to_vllm_without_the_plugin(runs, name):
    expected = runs["vllm"]["tokens"][name]["tokens"]
    assert len(expected) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in expected)
    assert runs["plugin"]["tokens"][name]["tokens"] == expected


def test_without_the_plugin_nothing_of_ours_ran(runs):
    assert runs["vllm"]["counts"] == []
    assert "hw_agnostic: serving" not in runs["vllm"]["log"]


def test_the_plugin_ran_every_op_it_overrides(runs):
    records = runs["plugin"]["counts"]
    assert records, "the plugin wrote no counts"
    for op in ("rms_norm", "silu_and_mul", "gelu_and_mul", "fused_experts", "write_kv_cache", "paged_attention"):
        assert counts.total_calls(records, op) > 0, (op, records)
    layers = {k: sum(r["layers"].get(k, 0) for r in records) for k in
              ("rms_norm", "gemma_rms_norm", "silu_and_mul", "gelu_and_mul", "moe", "attention")}
    assert all(layers.values()), layers
    assert not any(r["fallbacks"] for r in records), records
    assert "hw_agnostic: serving rms_norm" in runs["plugin"]["log"]  # logged where vLLM shows it


def test_compiled_graph_holds_our_custom_ops_without_graph_breaks(runs):
    log = runs["plugin"]["log"]
    for node in ("torch.ops.hw_agnostic.rms_norm", "torch.ops.hw_agnostic.silu_and_mul"):
        assert node in log, f"{node} not in the compiled graph"
    assert "Graph break" not in log
    assert all(r["graph_breaks"] == 0 for r in runs["plugin"]["counts"])


def test_tensor_parallel_2_gives_the_single_device_tokens(runs):
    assert runs["tp2"]["tokens"]["mixtral_tp2"]["tokens"] == runs["plugin"]["tokens"]["mixtral"]["tokens"]
    records = runs["tp2"]["counts"]
    workers = [r for r in records if counts.total_calls([r], "paged_attention")]
    assert len(workers) == 2, records  # one process per rank ran the model
    assert len(records) > 2  # and the driver (and the engine core) did not
    for record in workers:
        for op in ("rms_norm", "fused_experts", "write_kv_cache", "paged_attention"):
            assert counts.total_calls([record], op) > 0, (op, record)

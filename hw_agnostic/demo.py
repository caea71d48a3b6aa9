"""``python -m hw_agnostic demo``: rewire a model, generate, and check the tokens against HF eager.

Without arguments it builds a small Llama-style model from a config with random weights
(offline, seconds on a CPU); ``--family`` picks another architecture, ``--checkpoint DIR`` loads
a local checkpoint through the construction-time path instead. It prints the rewire report, the
generated tokens of both models and their timings, and exits non-zero if the tokens differ.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512)
FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "sliding_window": 64}, "gemma3_text": {"head_dim": 32, "sliding_window": 64},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, "granite": {},
    "olmo2": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}


def _generate(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if prompt.is_cuda:
            torch.cuda.synchronize()
    return out[:, prompt.shape[1]:], time.perf_counter() - start


def _check_device(name: str) -> None:
    from .cli import UsageError

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UsageError(f"--device {name!r} is not a device name ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this machine has no CUDA device (torch {torch.__version__}); "
                         "use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise UsageError(f"--device {name}: this machine has no XPU device; use --device cpu")


def _check_checkpoint(path: str) -> None:
    from .cli import UsageError

    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"--checkpoint {path}: no such directory")
    if not (folder / "config.json").is_file():
        raise UsageError(f"--checkpoint {path}: not a Hugging Face checkpoint (it has no config.json)")


def main(argv: list[str] | None = None) -> int:
    from .cli import ArgumentParser

    parser = ArgumentParser(prog="hw-agnostic demo", description=__doc__)
    parser.add_argument("--family", default="llama", choices=sorted(FAMILY_EXTRAS), metavar="FAMILY",
                        help=f"one of {', '.join(sorted(FAMILY_EXTRAS))} (default llama)")
    parser.add_argument("--checkpoint", default=None, help="a local checkpoint directory to load instead")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    _check_device(args.device)
    if args.checkpoint:
        _check_checkpoint(args.checkpoint)

    from transformers import AutoConfig, AutoModelForCausalLM

    from .backend import from_pretrained, rewire

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        reference = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(args.device).eval()
        model, report = from_pretrained(args.checkpoint, dtype=dtype)
        model = model.to(args.device).eval()
        source = args.checkpoint
    else:
        config = AutoConfig.for_model(args.family, **TINY, **FAMILY_EXTRAS[args.family])
        reference = AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()
        model = copy.deepcopy(reference)
        report = rewire(model)
        source = f"a random-weight {args.family} ({TINY['num_hidden_layers']} layers, hidden {TINY['hidden_size']})"
    print(f"hw_agnostic demo: {source} on {args.device} in {args.dtype}\n")
    print(report.table(), "\n")

    vocab = reference.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    want, hf_time = _generate(reference, prompt, args.new_tokens)
    got, first_time = _generate(model, prompt, args.new_tokens)
    got_again, second_time = _generate(model, prompt, args.new_tokens)
    print(f"HF eager     : {want[0].tolist()}")
    print(f"hw_agnostic  : {got[0].tolist()}")
    print(f"\n{args.new_tokens} tokens: HF eager {hf_time:.2f} s; hw_agnostic {first_time:.2f} s first run "
          f"(includes compiling), {second_time:.2f} s second run")
    same = torch.equal(want, got) and torch.equal(got, got_again)
    print("tokens identical: yes" if same else "tokens identical: NO")
    if not same and args.dtype != "float32":
        print("(low-precision runs can diverge by rounding; float32 must match)")
    return 0 if same or args.dtype != "float32" else 1


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["demo", *sys.argv[1:]]))

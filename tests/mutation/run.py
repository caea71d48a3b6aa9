"""``make mutation``: plant small, plausible bugs in a copy of the repository; the tests must catch each.

Every mutation replaces one piece of source text (found exactly once, or the run fails: a
mutation that no longer applies must be updated, not skipped) in a temporary copy of the working
tree, then runs the tests that should see it, in the tier where it matters, and passes when at
least one of them fails. The same test selections are first run on the unmutated copy, so a
mutation cannot be "caught" by a test that fails anyway.

    python tests/mutation/run.py                 # all mutations
    python tests/mutation/run.py -k eps -v       # those whose name contains "eps", with pytest output
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tier: str  # reference, triton or helion
    tests: tuple[str, ...]  # pytest arguments selecting the tests that must catch it


MUTATIONS = [
    # -- norms: eps and numerics, in the kernel, the layer and the detection rule
    Mutation("rms_norm kernel ignores eps", "hw_agnostic/kernels/rms_norm.py",
             "inv_rms = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)",
             "inv_rms = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True))",
             "helion", ("tests/ops/test_rms_norm.py", "-k", "test_rms_norm_dsl")),
    Mutation("fused_add_rms_norm kernel uses 10 x eps", "hw_agnostic/kernels/rms_norm.py",
             "inv_rms = torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + eps)",
             "inv_rms = torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + 10 * eps)",
             "triton", ("tests/ops/test_rms_norm.py", "-k", "test_fused_add_rms_norm_dsl")),
    Mutation("llama numerics computed as fp32_scale in the kernel", "hw_agnostic/kernels/rms_norm.py",
             "return normed.to(input_dtype).to(torch.float32) * weight_row", "return normed * weight_row",
             "triton", ("tests/ops/test_rms_norm.py", "-k", "matches_hf")),
    Mutation("RMSNorm layer uses 10 x eps", "hw_agnostic/layers/norm.py",
             "self.eps = float(eps)", "self.eps = float(eps) * 10",
             "reference", ("tests/models/test_model_numerics.py", "-k", "bf16")),
    Mutation("RMSNorm layer swaps llama and fp32_scale numerics", "hw_agnostic/layers/norm.py",
             "return rms_norm(x, self.weight, self.eps, numerics=self.numerics)",
             "return rms_norm(x, self.weight, self.eps, numerics={'llama': 'fp32_scale', 'fp32_scale': 'llama'}"
             ".get(self.numerics, self.numerics))",
             "reference", ("tests/models/test_model_numerics.py", "-k", "bf16")),
    Mutation("norm detection reads 10 x eps", "hw_agnostic/backend/detect.py",
             "return float(scalars[0])", "return float(scalars[0]) * 10",
             "reference", ("tests/models/test_model_numerics.py", "-k", "bf16")),
    Mutation("norm detection swaps llama and fp32_scale numerics", "hw_agnostic/backend/detect.py",
             "    return best\n", "    return {'llama': 'fp32_scale', 'fp32_scale': 'llama'}.get(best, best)\n",
             "reference", ("tests/models/test_model_numerics.py", "-k", "bf16")),
    # -- gated activations: where the kernel rounds
    Mutation("silu kernel skips rounding act(gate) before the multiply", "hw_agnostic/kernels/activations.py",
             "act = (g * torch.sigmoid(g)).to(out.dtype).to(torch.float32)", "act = g * torch.sigmoid(g)",
             "triton", ("tests/ops/test_activations.py", "-k", "matches_hf")),
    Mutation("swiglu_oai kernel skips rounding the glu", "hw_agnostic/kernels/activations.py",
             "glu = (g * sig).to(out.dtype).to(torch.float32)", "glu = g * sig",
             "helion", ("tests/ops/test_activations.py", "-k", "matches_hf")),
    Mutation("compiled reference fuses the casts away", "hw_agnostic/ops/registry.py",
             'options={"emulate_precision_casts": True}', 'options={"emulate_precision_casts": False}',
             "reference", ("tests/test_compile.py", "-k", "rounds_where")),
    # -- attention: a scale 1% off, in the layer and in the kernel
    Mutation("attention layer scale x 1.01", "hw_agnostic/layers/attention.py",
             "batch.kv_lens, scale=scale,", "batch.kv_lens, scale=scale * 1.01,",
             "reference", ("tests/models/test_model_numerics.py",)),
    Mutation("paged attention kernel scale x 1.01", "hw_agnostic/kernels/paged_attention.py",
             "logits = logits * (scale * 1.4426950408889634)", "logits = logits * (scale * 1.01 * 1.4426950408889634)",
             "helion", ("tests/ops/test_paged_attention.py", "-k", "test_paged_attention_dsl")),
    # -- dispatch: a provider that declines everything, an inner op bypassing its kernels
    Mutation("rms_norm kernel provider declines every call", "hw_agnostic/ops/rms_norm.py",
             "def _helion_accepts(key: NormKey) -> str | None:\n",
             "def _helion_accepts(key: NormKey) -> str | None:\n    return 'not today'\n",
             "helion", ("tests/ops/test_rms_norm.py", "-k", "test_rms_norm_dsl")),
    Mutation("fused_experts runs its activation on the reference", "hw_agnostic/ops/fused_experts.py",
             'gated = act_op.run_inside("fused_experts", projected, *options)',
             "gated = act_op.reference(projected, *options)",
             "helion", ("tests/ops/test_fused_experts.py", "-k", "activation_inside")),
]

TIER_ENV = {"reference": {}, "triton": {"TRITON_INTERPRET": "1"}, "helion": {"HELION_INTERPRET": "1"}}


def copy_tree(destination: Path) -> None:
    """The working tree as git sees it (tracked and untracked-not-ignored files)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def run_tests(copy: Path, tier: str, tests: tuple[str, ...], verbose: bool) -> tuple[int, list[str], float]:
    """(pytest's exit code, the failing test ids, seconds)."""
    env = {**os.environ, **TIER_ENV[tier], "PYTHONPATH": str(copy), "HYPOTHESIS_PROFILE": "ci"}
    for other in ("TRITON_INTERPRET", "HELION_INTERPRET"):
        if other not in TIER_ENV[tier]:
            env.pop(other, None)
    marker = () if tier == "reference" else ("-m", "dsl")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", "--maxfail=3", "-rf",
               *marker, *tests]
    start = time.monotonic()
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    if verbose:
        print(done.stdout[-6000:], done.stderr[-2000:], sep="\n")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, flags=re.MULTILINE)
    return done.returncode, failed, time.monotonic() - start


def apply(copy: Path, mutation: Mutation) -> str:
    """Plants the mutation; returns the original text of the file."""
    target = copy / mutation.path
    text = target.read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise SystemExit(f"mutation {mutation.name!r} no longer applies: {mutation.path} contains its text "
                         f"{found} times (want exactly once): update tests/mutation/run.py")
    target.write_text(text.replace(mutation.old, mutation.new))
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the selections unmutated first")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    with tempfile.TemporaryDirectory(prefix="hw_agnostic_mutation_") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        for mutation in chosen:  # fail before spending time on the tests
            (copy / mutation.path).write_text(apply(copy, mutation))
        if not args.no_baseline:
            for tier in dict.fromkeys(m.tier for m in chosen):
                selections = dict.fromkeys(m.tests for m in chosen if m.tier == tier)
                for tests in selections:
                    code, failed, seconds = run_tests(copy, tier, tests, args.verbose)
                    if code != 0:
                        print(f"baseline {tier} {' '.join(tests)} fails unmutated ({failed or code}): fix that first")
                        return 2
                print(f"baseline {tier}: {len(selections)} selections pass unmutated")
        survived = []
        for mutation in chosen:
            original = apply(copy, mutation)
            try:
                code, failed, seconds = run_tests(copy, mutation.tier, mutation.tests, args.verbose)
            finally:
                (copy / mutation.path).write_text(original)
            if code == 1 and failed:
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                print(f"caught    {mutation.name} [{mutation.tier}, {seconds:.0f} s] by {failed[0]}{more}")
            else:
                survived.append(mutation.name)
                print(f"SURVIVED  {mutation.name} [{mutation.tier}, {seconds:.0f} s]: pytest exit code {code}")
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

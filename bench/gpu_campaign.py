"""The first GPU run, prepared: install, GPU tests, tune the headline shapes, bench, pack results.

``make gpu-campaign`` on a fresh GPU machine (no network; the wheels it lacks travel in
``.whl/``, see ``make gpu-wheels``) runs, each phase in its own process under its own time
budget, all inside ``--budget`` seconds (a little over 9 minutes by default):

1. ``install``: the carried wheels into a private target directory (helion, liger-kernel,
   filecheck, transformers), then ``hw-agnostic doctor``: it imports hw_agnostic and Helion and
   reports every package's version, the device and which provider runs each op;
2. ``tests``: the GPU test tier (``tests/test_gpu.py``, every op's DSL harness on the GPU, the
   launches bound to call signatures through Triton's launcher);
3. ``compile-check``: what compile-for-target mode predicts for this GPU's target (registers,
   spills, shared memory, matrix instruction) next to what the JIT really built, per kernel;
4. ``autotune``: the headline shapes of each op (Llama-3-8B, Qwen3-30B-A3B) within a time budget,
   saved after every key, written as the tuned-config files to ship;
5. ``bench``: ``python -m bench --quick`` with those configs against HF eager, ``torch.compile``
   and Liger, copy bandwidth measured in the same run, with plots: one suite at a time under its
   own budget (attention, whole decode steps eager and graphed, MoE, the model step, then the ops
   at their headline widths);
6. ``pack``: everything into ``$OUT`` (at most 8 files): ``summary.md``, the bench CSV and
   markdown, ``tuned_configs.tar.gz`` (``<platform>/<kernel>.json``, to commit under
   ``hw_agnostic/autotune_cache/``), and ``campaign.tar.gz`` with every log, plot and file.

A phase that fails or runs out of time is recorded and the next one runs; one out of time is
interrupted first (SIGINT), so pytest reports what failed so far and the bench writes its report. ``--dry-run`` runs
the same phases on a CPU (the Triton interpreter, a tiny subset, seconds of budget), which is
how CI knows the script works before a GPU ever runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".whl"
#: The ops and shapes tuned on the GPU: Llama-3-8B's layers (decode, a batch, a prefill chunk)
#: and Qwen3-30B-A3B's experts. (op, width, token counts)
HEADLINE = (
    ("rms_norm", 4096, (1, 128, 4096)),
    ("fused_add_rms_norm", 4096, (1, 128, 4096)),
    ("silu_and_mul", 14336, (1, 128, 4096)),
    ("write_kv_cache", 128, (1, 128, 4096)),
    ("rotary_write_kv_cache", 128, (1, 128, 4096)),  # the direct attention path's rotary + KV write
    ("paged_attention", 128, (1, 128, 4096)),
    ("moe_route", 2048, (1, 128, 4096)),
    ("fused_experts", 2048, (1, 128, 4096)),
)
DRY_HEADLINE = (("rms_norm", 64, (3,)),)


@dataclasses.dataclass
class Phase:
    name: str
    budget_s: float
    status: str = "not run"
    seconds: float = 0.0
    detail: str = ""


class Campaign:
    def __init__(self, out: Path, work: Path, budget_s: float, dry_run: bool) -> None:
        self.out, self.work, self.dry_run = out, work, dry_run
        self.deadline = time.monotonic() + budget_s
        self.started = time.monotonic()
        self.phases: list[Phase] = []
        self.log_path = work / "campaign.log"
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), self.env.get("PYTHONPATH", "")]))
        self.env["HW_AGNOSTIC_CACHE_DIR"] = str(work / "tuned")
        if dry_run:
            self.env.setdefault("HW_AGNOSTIC_COMPILE_REFERENCE", "0")

    def say(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f}s] {message}"
        print(line, flush=True)
        with open(self.log_path, "a") as handle:
            handle.write(line + "\n")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, phase: Phase, command: list[str], *, env: dict[str, str] | None = None, log_name: str) -> bool:
        """Run one phase's command under its budget (cut to what the campaign has left)."""
        # A CPU dry run pays interpreter and import time, not GPU time: three times the budget.
        budget = min(phase.budget_s * (3 if self.dry_run else 1), self.remaining() - self.reserve())
        self.phases.append(phase)
        if budget < 5:
            phase.status, phase.detail = "skipped", "no time left"
            self.say(f"{phase.name}: skipped, no time left")
            return False
        self.say(f"{phase.name}: {' '.join(command)} (budget {budget:.0f} s)")
        start = time.monotonic()
        with open(self.work / log_name, "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=env or self.env, stdout=log, stderr=subprocess.STDOUT)
            try:
                code: int | None = process.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                code = None
                # Interrupted, pytest prints what failed so far and the bench writes its report of
                # the rows it measured; killed only if it does not stop within the grace period.
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=self.GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        phase.seconds = time.monotonic() - start
        tail = _tail(self.work / log_name)
        if code is None:
            phase.status, phase.detail = "timed out", tail
        elif code == 0:
            phase.status, phase.detail = "ok", tail
        else:
            phase.status, phase.detail = f"failed ({code})", tail
        self.say(f"{phase.name}: {phase.status} in {phase.seconds:.0f} s; {tail.splitlines()[-1] if tail else ''}")
        return code == 0

    #: seconds an interrupted phase has to write what it has before it is killed
    GRACE_S = 15.0

    def reserve(self) -> float:
        """Seconds kept back for packing the results (and an interrupted phase's grace)."""
        return 5.0 if self.dry_run else 20.0 + self.GRACE_S


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# phases


def install(c: Campaign) -> None:
    """The carried wheels into a target directory the later phases put first on their path."""
    phase = Phase("install", 90)
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels:
        site = c.work / "site"
        ok = c.run(phase, [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                   log_name="install.log")
        if ok:
            c.env["PYTHONPATH"] = os.pathsep.join([str(site), c.env["PYTHONPATH"]])
    else:
        c.phases.append(phase)
        phase.status, phase.detail = "ok", "no .whl/ folder: using the packages already installed"
        c.say("install: no .whl/, using the installed packages")
    # the import check and what a bug report needs: package versions, the device, which provider
    # runs each op here and why, the config directories
    c.run(Phase("doctor", 60), [sys.executable, "-m", "hw_agnostic", "doctor"], log_name="doctor.log")


def tests(c: Campaign) -> None:
    """The GPU tier: what only a GPU can check, and every op's harness on real launches."""
    report = c.work / "tests.xml"
    if c.dry_run:
        env = {**c.env, "TRITON_INTERPRET": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "dsl", "-k",
                   "test_rms_norm_dsl and 7x37-float32-llama", f"--junitxml={report}", "tests/ops/test_rms_norm.py"]
        c.run(Phase("tests", 120), command, env=env, log_name="tests.log")
        return
    # -v: a line per test as it ends, so a run cut short still says what passed and failed
    command = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider", "-n", "8",
               "-m", "gpu or dsl", f"--junitxml={report}", "tests/test_gpu.py", "tests/ops",
               "tests/backend/test_static_cache.py", "tests/test_launch_binding.py"]
    c.run(Phase("tests", 130), command, log_name="tests.log")


def compile_check(c: Campaign) -> None:
    script = c.work / "compile_check.py"
    script.write_text(_COMPILE_CHECK)
    command = [sys.executable, str(script), "dry" if c.dry_run else "gpu", str(c.work / "compile_check.json")]
    c.run(Phase("compile-check", 40), command, log_name="compile_check.log")


_COMPILE_CHECK = r'''
"""Compile-for-target mode's predictions for this GPU's target next to what the JIT built on it."""
import json
import sys

import torch
from triton import knobs

from hw_agnostic.autotune.platform import compile_target
from hw_agnostic.kernels import targets
from hw_agnostic.ops.registry import get_op

dry = sys.argv[1] == "dry"
target = "sm_90" if dry else compile_target(torch.device("cuda"))
shapes = [("rms_norm", 4, 64)] if dry else [("rms_norm", 128, 4096), ("silu_and_mul", 128, 14336),
                                             ("write_kv_cache", 128, 128), ("paged_attention", 4096, 128),
                                             ("fused_experts", 128, 2048)]
if target is None:
    sys.exit("this GPU is none of the compile targets")
compiled = []


def keep(*args, **kwargs):
    compiled.append(kwargs.get("key"))


rows = []
for name, tokens, width in shapes:
    op = get_op(name)
    # Real tensors, not meta ones: with torch 2.11 Helion cannot generate a reduction for meta
    # tensors (Inductor's lowering asserts; seen on the H200 image, 2026-12-04). Nothing runs.
    with targets.compile_for([target], run_reference=False) as log:
        op(*op.example_inputs(tokens, width, torch.bfloat16, "cpu" if dry else "cuda"))
    predicted = {r.kernel: r for r in log.records}
    real = {}
    if not dry:
        seen = []
        knobs.runtime.jit_post_compile_hook = lambda *a, **k: seen.append(k) or False
        try:
            op(*op.example_inputs(tokens, width, torch.bfloat16, "cuda"))
            torch.cuda.synchronize()
        finally:
            knobs.runtime.jit_post_compile_hook = None
        for info in seen:
            fn, key = info.get("fn"), info.get("key")
            if fn is None:
                continue
            name = fn.jit_function.fn.__name__.removeprefix("_helion__").lstrip("_")
            try:  # the loaded kernel's own numbers (JIT internals: recorded, never fatal)
                kernel = fn.jit_function.device_caches[torch.cuda.current_device()][0][key]
                kernel._init_handles()
                real[name] = {"registers": kernel.n_regs, "spills": kernel.n_spills, "shared": kernel.metadata.shared}
            except Exception as err:
                real[name] = {"error": f"{type(err).__name__}: {err}"}
    for kernel, record in predicted.items():
        rows.append({"op": name, "tokens": tokens, "width": width, "kernel": kernel, "target": target,
                     "config": record.config, "predicted": {"registers": record.registers,
                     "spills": record.spill_bytes, "shared": record.shared, "matrix": record.matrix,
                     "load_bits": record.load_bits}, "real": real.get(kernel), "problems": record.problems()})
json.dump(rows, open(sys.argv[2], "w"), indent=1)
for row in rows:
    print(row["op"], row["kernel"], "predicted", row["predicted"], "real", row["real"])
'''


def autotune(c: Campaign) -> None:
    """The headline shapes of each op, within a budget split evenly between the ops."""
    headline = DRY_HEADLINE if c.dry_run else HEADLINE
    budget = 90 if c.dry_run else 120
    bench_s = 5 if c.dry_run else sum(seconds for _, seconds, _ in GPU_BENCH)  # kept for the bench after it
    per_op = max(3.0, (min(budget, c.remaining() - c.reserve() - bench_s) - 15) / len(headline))
    device = "cpu" if c.dry_run else "cuda"
    script = (
        "import json, sys, torch\n"
        "from hw_agnostic.autotune.tuner import tune\n"
        "from hw_agnostic.ops.registry import get_op\n"
        f"headline, per_op, device = json.loads(sys.argv[1]), {per_op!r}, {device!r}\n"
        "for name, width, tokens in headline:\n"
        "    results = tune(get_op(name), [(t, width) for t in tokens], dtype=torch.bfloat16, device=device,\n"
        f"                   budget_s=per_op, root=sys.argv[2], progress=False)\n"
        "    for r in results:\n"
        "        print(name, r.status, r.key, r.config, r.time_us, f'tried {r.tried}', flush=True)\n"
    )
    env = {**c.env, "TRITON_INTERPRET": "1"} if c.dry_run else c.env
    command = [sys.executable, "-c", script, json.dumps(headline), str(c.work / "tuned")]
    c.run(Phase("autotune", budget), command, env=env, log_name="autotune.log")


def bench(c: Campaign) -> None:
    """The bench with the configs just tuned (the user cache points at them)."""
    if c.dry_run:
        # The same CLI on one small workload: the CPU grid takes minutes (a torch.compile per shape).
        # If the bench stops reading ops_suite._grid, this runs the whole grid and the dry run times out.
        one = ("import sys, torch, bench.ops_suite as suite\n"
               "suite._grid = lambda device, quick: [('rms_norm', 16, 128, torch.bfloat16)]\n"
               "from bench.__main__ import main\n"
               "sys.exit(main(sys.argv[1:]))\n")
        command = [sys.executable, "-c", one, "--device", "cpu", "--quick", "--suites", "ops",
                   "--out", str(c.work / "bench")]
        c.run(Phase("bench", 150), command, log_name="bench.log")
        return
    # One suite at a time, each under its own budget, so a slow one (torch.compile baselines) cannot
    # starve the others; they merge into one results folder.
    for suite, budget, only in GPU_BENCH:
        command = [sys.executable, "-m", "bench", "--device", "auto", "--quick", "--suites", suite,
                   "--out", str(c.work / "bench"), "--merge", *(["--only", only] if only else [])]
        c.run(Phase(f"bench-{suite}", budget), command, log_name=f"bench_{suite}.log")


#: (suite, seconds, --only) of the GPU bench, in the order they run: attention, experts and a
#: model step first (where the decode step's time goes), then each op at its headline width
GPU_BENCH = (
    ("attention", 40, None),
    # whole decode steps, eager and as one CUDA graph on a static cache (each graphed shape compiles)
    ("decode", 100, None),
    ("moe", 45, None),
    # its first row compiles HF's model; the H200 run of 2026-12-04 measured nothing in 50 s
    ("model", 80, None),
    ("ops", 60, r"^((fused_add_)?rms_norm_?|(fused_add_)?layer_norm_?) \d+x4096 |^(silu|gelu)_and_mul \d+x14336 "
                 r"|^swiglu_oai \d+x2880 |^gated_rms_norm \d+x(128|8192) |^rotary_embedding \d+x128 "),
)


def pack(c: Campaign) -> None:
    """At most 8 files into $OUT: the summary, the bench tables, the configs, and one archive."""
    c.out.mkdir(parents=True, exist_ok=True)
    tuned = c.work / "tuned"
    if tuned.exists() and any(tuned.glob("*/*.json")):
        with tarfile.open(c.out / "tuned_configs.tar.gz", "w:gz") as archive:
            for path in sorted(tuned.glob("*/*.json")):
                archive.add(path, arcname=str(path.relative_to(tuned)))
    for name in ("results.csv", "results.md"):
        source = c.work / "bench" / name
        if source.exists():
            shutil.copy(source, c.out / f"bench_{name}")
    summary = summary_markdown(c)
    (c.work / "summary.md").write_text(summary)
    (c.out / "summary.md").write_text(summary)
    with tarfile.open(c.out / "campaign.tar.gz", "w:gz") as archive:
        for path in sorted(c.work.rglob("*")):
            if path.is_file() and "site" not in path.relative_to(c.work).parts:
                archive.add(path, arcname=str(path.relative_to(c.work)))
    c.say(f"pack: wrote {', '.join(sorted(p.name for p in c.out.iterdir()))} to {c.out}")


def summary_markdown(c: Campaign) -> str:
    lines = ["# GPU campaign" + (" (dry run on the CPU)" if c.dry_run else ""), "",
             f"`python bench/gpu_campaign.py{' --dry-run' if c.dry_run else ''}`, "
             f"{time.monotonic() - c.started:.0f} s in all.", "",
             "| phase | status | seconds |", "|---|---|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} |" for p in c.phases]
    for p in c.phases:
        if p.detail:
            lines += ["", f"## {p.name}", "", "```", p.detail, "```"]
    tuned = sorted(str(p.relative_to(c.work / "tuned")) for p in (c.work / "tuned").glob("*/*.json")) \
        if (c.work / "tuned").exists() else []
    lines += ["", "## Tuned configs", "", ", ".join(tuned) or "none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/gpu_campaign.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "campaign-out"),
                        help="where the results go (default: $OUT, else ./campaign-out)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 565; dry 300)")
    parser.add_argument("--dry-run", action="store_true", help="the same phases on a CPU, tiny and interpreted")
    parser.add_argument("--phases", default="install,tests,compile-check,autotune,bench",
                        help="comma-separated subset of the phases to run (pack always runs)")
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else (300.0 if args.dry_run else 565.0)
    phases = {"install": install, "tests": tests, "compile-check": compile_check, "autotune": autotune,
              "bench": bench}
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in phases]
    if unknown:
        print(f"error: unknown phases {unknown}; phases: {', '.join(phases)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="hw_agnostic_campaign_"))
    campaign = Campaign(args.out, work, budget, args.dry_run)
    campaign.say(f"campaign{' (dry run)' if args.dry_run else ''}: budget {budget:.0f} s, work {work}, out {args.out}")
    try:
        try:
            for name in wanted:
                phases[name](campaign)
        finally:
            pack(campaign)
        failed = [p.name for p in campaign.phases if p.status != "ok"]
        campaign.say("done" + (f"; not ok: {', '.join(failed)}" if failed else ", every phase ok"))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # pack archived it under out
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

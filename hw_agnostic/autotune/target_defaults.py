"""Compile-chosen defaults: a config per GPU target where a platform has no tuned configs.

Without tuned configs every kernel used to launch with one built-in default on every device.
Compile-for-target mode (:mod:`hw_agnostic.kernels.targets`) measures, without a GPU, what a
config costs on a target: whether it compiles, spills, fits shared memory, reads with 128-bit
vectors, and which matrix instruction its products use. This module chooses among each
kernel's candidates by those measurements, for every key of the model shapes
(:mod:`.shapes`) and every target, and writes ``<root>/<target>/<kernel>.json`` in the tuned-config
format; the config lookup (:func:`.cache.lookup`) uses them for a device of that target whose
platform has no tuned file of its own.

The rule, per key and target:

1. Candidates are the kernel's built-in default, then its search space ordered by distance from
   the default (how many settings differ, nested configs included), at most ``budget`` of them.
2. Each is launched through the op on meta tensors of the key's shape and compiled for the target.
3. A candidate qualifies when every launch compiles, spills nothing (beyond the few bytes outside
   loops :mod:`~hw_agnostic.kernels.targets` allows on NVIDIA targets), fits the target's shared
   memory, and (memory-bound kernels on aligned rows) reads with 128-bit vectors.
4. Among qualifying candidates the best uses the best matrix instruction the target has for
   each of its products (``wgmma`` over ``mma.sync`` on sm_90, ``tcgen05`` on sm_100, ``mfma`` on
   gfx942, ``wmma`` on gfx1100; products on exact fp32 run on FMA units anywhere); ties go to
   the candidate nearest the default, then to the earlier one in the search space.
5. The search stops at the first candidate that qualifies with every product on the best
   instruction (the default, most of the time). If nothing qualifies, the key gets no entry and
   the built-in default applies, with the reason logged.

Timing decides nothing here: this picks a config that is sound on the target; a tuned config
(``make autotune``) measured on the device replaces it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..kernels import targets as compile_targets
from . import cache
from .shapes import widths

log = logging.getLogger(__name__)

TOKEN_BUCKETS = tuple(1 << i for i in range(15))  # 1 .. 16384: every bucket the model shapes reach
DEFAULT_BUDGET = 12


@dataclasses.dataclass(frozen=True)
class Trial:
    config: dict[str, Any]
    distance: int
    problems: tuple[str, ...]
    matrix_score: int
    matrix_best: int
    records: tuple[compile_targets.CompileRecord, ...]

    @property
    def qualifies(self) -> bool:
        return not self.problems

    @property
    def best_possible(self) -> bool:
        return self.qualifies and self.matrix_score == self.matrix_best


@dataclasses.dataclass(frozen=True)
class Choice:
    op: str
    target: str
    key: dict[str, Any]
    config: dict[str, Any] | None  # None: nothing qualified, the built-in default stays
    default_kept: bool
    trials: tuple[Trial, ...]

    def summary(self) -> dict[str, Any]:
        chosen = next((t for t in self.trials if t.config == self.config), None)
        return {
            "rule": "compile-chosen",
            "tried": len(self.trials),
            "default_kept": self.default_kept,
            "matrix": sorted({r.matrix for r in chosen.records if r.matrix_dots}) if chosen else [],
            "max_registers": max((r.registers or 0 for r in chosen.records), default=0) if chosen else None,
            "max_shared": max((r.shared or 0 for r in chosen.records), default=0) if chosen else None,
        }


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        found: dict[str, Any] = {}
        for name, item in value.items():
            found.update(_leaves(item, f"{path}.{name}" if path else str(name)))
        return found
    if isinstance(value, list):
        found = {}
        for index, item in enumerate(value):
            found.update(_leaves(item, f"{path}[{index}]"))
        return found
    return {path: value}


def distance(config: Mapping[str, Any], default: Mapping[str, Any]) -> int:
    """How many settings of ``config`` differ from ``default`` (leaves of nested configs)."""
    a, b = _leaves(config), _leaves(default)
    return sum(a.get(name) != b.get(name) for name in set(a) | set(b))


def ordered_candidates(kernel: Any, key: Mapping[str, Any], budget: int) -> list[tuple[dict[str, Any], int]]:
    """The built-in default, then the search space by distance from it (stable), ``budget`` in all."""
    default = kernel.default_config(key)
    others = [c for c in kernel.candidate_configs(key) if c != default]
    others.sort(key=lambda c: distance(c, default))  # sort is stable: search-space order breaks ties
    return [(default, 0), *((c, distance(c, default)) for c in others)][:budget]


def _rank(matrix: str | None, target: compile_targets.Target) -> int:
    classes = target.matrix_instructions
    return len(classes) - classes.index(matrix) if matrix in classes else 0


def trial(op: Any, args: tuple[Any, ...], config: dict[str, Any], dist: int,
          target: compile_targets.Target) -> Trial:
    """Compile what ``op`` launches on ``args`` (meta tensors) with ``config`` for ``target``."""
    from ..ops import use_config

    try:
        with compile_targets.compile_for([target.name], run_reference=False) as compile_log, use_config(op, config):
            op(*args)
    except Exception as err:  # the op refuses the config before any launch
        return Trial(config, dist, (f"{op.name}: {type(err).__name__}: {err}",), 0, 0, ())
    records = tuple(compile_log.records)
    score = sum(_rank(r.matrix, target) for r in records if r.matrix_dots)
    best = sum(len(target.matrix_instructions) for r in records if r.matrix_dots)
    return Trial(config, dist, tuple(compile_log.problems()), score, best, records)


def choose(op_name: str, tokens: int, width: int, dtype: torch.dtype, target: str, *,
           budget: int = DEFAULT_BUDGET) -> Choice | None:
    """Apply the rule to one key (the op's example inputs of this shape) and one target."""
    from ..ops.registry import get_op

    op = get_op(op_name)
    spec = compile_targets.TARGETS[target]
    args = op.example_inputs(tokens, width, dtype, "meta")
    with compile_targets.compile_for([target], run_reference=False):
        plan = op.plan(*args)
    if plan.config is None:
        return None  # the op declines this shape on a GPU; the reference runs it
    provider = next(p for p in op.providers if p.name == plan.provider)
    key = plan.config.key
    trials: list[Trial] = []
    for config, dist in ordered_candidates(provider.kernel, key, budget):
        result = trial(op, args, config, dist, spec)
        trials.append(result)
        if result.best_possible:
            break
    qualifying = [t for t in trials if t.qualifies]
    if not qualifying:
        log.warning("hw_agnostic: %s %s on %s: none of %d candidates qualifies (%s); the built-in default stays",
                    op_name, key, target, len(trials), trials[0].problems[0] if trials[0].problems else "?")
        return Choice(op_name, target, key, None, True, tuple(trials))
    best = max(qualifying, key=lambda t: (t.matrix_score, -t.distance, -trials.index(t)))
    return Choice(op_name, target, key, best.config, best.distance == 0, tuple(trials))


def choose_all(op_names: Sequence[str], target_names: Sequence[str], dtypes: Sequence[torch.dtype],
               tokens: Iterable[int] = TOKEN_BUCKETS, *, budget: int = DEFAULT_BUDGET,
               progress: bool = True) -> list[Choice]:
    shapes = [(name, t, w, d) for name in op_names for d in dtypes for w in widths(name) for t in tokens]
    bar = _progress(len(shapes) * len(target_names), progress)
    choices: list[Choice] = []
    seen: set[tuple[str, str, str]] = set()
    for target in target_names:
        for name, t, w, dtype in shapes:
            bar.update(1)
            choice = choose(name, t, w, dtype, target, budget=budget)
            if choice is None:
                continue
            marker = (target, name, json.dumps(choice.key, sort_keys=True))
            if marker not in seen:  # several shapes can share a key (token buckets)
                seen.add(marker)
                choices.append(choice)
    bar.close()
    return choices


def save(choices: Sequence[Choice], root: Path) -> list[Path]:
    """Write one file per (target, kernel) with an entry per key that has a qualifying config."""
    from importlib import metadata

    import triton

    from ..ops.registry import get_op

    by_file: dict[tuple[str, Any], list[Choice]] = {}
    for choice in choices:
        if choice.config is None:
            continue
        kernel = next(p.kernel for p in get_op(choice.op).providers if p.kernel is not None)
        by_file.setdefault((choice.target, kernel), []).append(choice)
    made_with = {"rule": "hw_agnostic.autotune.target_defaults", "triton": triton.__version__,
                 "helion": metadata.version("helion"), "torch": torch.__version__}
    paths = []
    for (target, kernel), group in by_file.items():
        entries = [(c.key, c.config, {"chosen": c.summary()}) for c in group]
        paths.append(cache.save_entries(kernel, target, entries, root=root, tuned_with=made_with))
    return paths


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="choose defaults", unit="key")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    from ..compile_report import SAME_KERNELS_AS, tunable_ops

    parser = argparse.ArgumentParser(prog="python -m hw_agnostic.autotune.target_defaults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="all", help="comma-separated compile targets, or all")
    parser.add_argument("--ops", default="all", help="comma-separated op names, or all")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_BUCKETS)))
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="candidates compiled per key and target")
    parser.add_argument("--out", type=Path, default=cache.SHIPPED_ROOT, help="config root (default: the package's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        target_names = [t.name for t in compile_targets.parse_targets(args.targets)]
        op_names = [n for n in tunable_ops(args.ops) if n not in SAME_KERNELS_AS]
        dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    except (ValueError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    choices = choose_all(op_names, target_names, dtypes, [int(t) for t in args.tokens.split(",")], budget=args.budget)
    paths = save(choices, args.out)
    changed = sum(1 for c in choices if c.config is not None and not c.default_kept)
    kept = sum(1 for c in choices if c.default_kept and c.config is not None)
    none = sum(1 for c in choices if c.config is None)
    print(f"{len(choices)} keys x targets in {time.perf_counter() - start:.0f} s: default kept {kept}, "
          f"another candidate chosen {changed}, none qualifies {none}; wrote {len(paths)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

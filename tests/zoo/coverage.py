"""How much of each zoo family ``rewire`` serves: ``python -m tests.zoo.coverage`` (a few minutes).

A family is *fully rewired* when the report leaves none of its norms, gated MLPs, attention
modules, experts or routers: every one runs on the library's ops. Left entries that are not such
a module do not count against it: plain MLPs (``fc2(act(fc1(x)))``: two linears, no op of ours
to run), decoder layers whose residual layout has nothing to fuse, q/k/v groups that are not
merged, and rotary code left as the model defines it (another layout than ``rotary_embedding``'s). Prints the count and, for the other families, what is left, most common first.
"""

from __future__ import annotations

import collections
import logging
import re
import warnings

import torch

from hw_agnostic import rewire
from tests.zoo.families import UNBUILDABLE, build, families

#: Left entries that do not keep a family from being fully rewired (see the module docstring).
NOT_COUNTED = re.compile(r"a plain MLP|layout: no norm follows|^not fused|q/k/v not merged|^merged projection"
                         r"|^rotary embedding runs as")


def left_in(family: str) -> list[str]:
    """What the report leaves in ``family`` that counts (empty: fully rewired)."""
    report = rewire(build(family))
    return [f"{e.path}: {e.detail}" for e in report.left if not NOT_COUNTED.search(e.detail)]


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    full, partial = [], {}
    for family in families():
        if family in UNBUILDABLE:
            continue
        try:
            left = left_in(family)
        except Exception as err:  # the zoo tier fails on this; here it is one more line
            left = [f"rewire raised {type(err).__name__}: {err}"]
        if left:
            partial[family] = left
        else:
            full.append(family)
    causes: dict[str, set[str]] = collections.defaultdict(set)
    for family, left in partial.items():
        for entry in left:
            detail = entry.split(": ", 1)[-1]
            causes[re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", detail)[:100]].add(family)
    print(f"{len(full)} of {len(full) + len(partial)} families fully rewired; {len(partial)} in part")
    for cause, names in sorted(causes.items(), key=lambda item: -len(item[1])):
        print(f"{len(names):4d}  {cause}  (e.g. {', '.join(sorted(names)[:5])})")


if __name__ == "__main__":
    main()

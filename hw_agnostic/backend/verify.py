"""Whole-model verification: the rewired model must compute what the original computed.

A :class:`Verification` is made before rewiring: it runs the original model on a probe and keeps
the logits. After every rule has run, :meth:`Verification.settle` runs the rewired model on the same
probe and compares the logits with the tolerance table (the least precise parameter dtype's),
two-sided: the original's logits are a computation in that dtype too, not a float64 evaluation,
so each of the two may lie the table's width from the exact logits (Hugging Face's own eager and
SDPA attention give Gemma-4 logits 1.4-1.5x the one-sided fp32 table apart, each 2.3-2.6x it
from a float64 run; the library's paged attention matches the eager one there, 2.0-2.3x). On
disagreement (or an exception) it finds the changes responsible and undoes them for good:

1. each kind of change (norms, MLPs, q/k/v, attention, fused layers, experts, routers) is tried
   alone; in a kind that fails alone, each group of modules of one class is tried alone, and a
   group whose first module also fails alone is undone whole (modules of one class fail alike,
   and this bounds the probes a large model needs); otherwise the group is bisected;
2. if what is left still fails (changes that fail only together), whole kinds are undone from the
   last rule back until the model agrees.

The probe: two sequences of 8 tokens (or, where the model has a sliding window or attention
chunk of at most 64 tokens, 3 more than it), the second left-padded by 3, forward without a
cache (every real position's logits), then ``generate`` with the model's own cache: the prefill and two
cached decode steps, with the tokens forced to the same values for both models so a near-tie in
one step cannot make the two runs diverge. Cost: two forwards and two 3-step generations of a
2 × 8 batch, plus two more per bisection step; memory: the probe's activations and its logits
(2 × 8 × vocab values), and no weights. Weights on the meta device (or fake tensors) cannot be
run: the check is then made on the first forward whose weights are real, before that forward runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from ..tolerances import least_precise, mismatch
from .changes import KINDS, Change, apply_only
from .report import RewireReport

log = logging.getLogger(__name__)

#: runs the probe with exactly these changes applied: None when the model agrees, else what differs
Probe = Callable[[list[Change]], "str | None"]

PROMPT_LENGTH = 8
MAX_PROBED_WINDOW = 64  # windows up to this long are probed past their end
PADDING = 3
DECODE_STEPS = 2


@dataclasses.dataclass
class Outcome:
    """What verification found, for the report."""

    ran: bool
    reason: str = ""  # why it did not run, or what it ran
    error: str | None = None  # the disagreement before anything was undone
    undone: int = 0
    probes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        if not self.ran:
            return f"not verified: {self.reason}"
        if self.error is None:
            return f"verified against the original model ({self.reason}; {self.seconds:.1f} s)"
        return (f"verified: {self.undone} change(s) undone after disagreeing with the original "
                f"({self.probes} probes, {self.seconds:.1f} s)")


def _weights_are_real(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and not any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        try:
            return config.get_text_config()
        except Exception:
            return config
    return config


class _ForceTokens:
    """A logits processor choosing the given token at each step (the probe's decode inputs)."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        forced = torch.full_like(scores, float("-inf"))
        column = self.tokens[:, min(self.step, self.tokens.shape[1] - 1)].to(scores.device)
        forced.scatter_(1, column[:, None], 0.0)
        self.step += 1
        return forced


def _probe_length(config: Any) -> int:
    """The prompt length: past the model's smallest attention window or chunk where that is short,
    so the probe sees tokens leave it."""
    windows = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size", "chunk_size")]
    short = [w for w in windows if isinstance(w, int) and 0 < w <= MAX_PROBED_WINDOW]
    return max(PROMPT_LENGTH, min(short) + 3) if short else PROMPT_LENGTH


class Verification:
    """The original model's logits on the probe, and the check of the rewired one against them."""

    def __init__(self, model: nn.Module, prior: list[Change] | None = None) -> None:
        self.model = model
        self.outcome = Outcome(ran=False)
        self.done = True  # False while verification waits for real weights (the originals must stay)
        self.expected: list[Tensor] | None = None
        self._hook: Any = None
        started = time.perf_counter()
        if not _weights_are_real(model):
            self.outcome.reason = "the weights are on the meta device or fake; checked on the first real forward"
            self.done = False
            return
        try:
            self.inputs = self._probe_inputs()
        except Exception as err:  # a config this probe does not understand
            self.inputs = f"no probe could be built for this model ({type(err).__name__}: {err})"
        if isinstance(self.inputs, str):
            self.outcome.reason = self.inputs
            return
        try:
            with _without(prior or []):
                self.expected = self._run()
        except Exception as err:
            self.outcome.reason = (f"the model's own forward failed on the probe ({type(err).__name__}: {err}); "
                                   "only changes checked module by module are kept")
            self.expected = None
        self.outcome.seconds = time.perf_counter() - started

    # -- the probe ------------------------------------------------------------------------------

    def _probe_inputs(self) -> dict[str, Tensor] | str:
        config = _text_config(self.model)
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2:
            return "the model has no vocabulary size to draw probe tokens from"
        device = next(self.model.parameters()).device
        special: set[Any] = set()
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            special.update(value if isinstance(value, (list, tuple)) else [value])
        generator = torch.Generator().manual_seed(0)
        choices = torch.tensor([t for t in range(min(vocab, 4096)) if t not in special] or [0])
        self.length = _probe_length(config)
        ids = choices[torch.randint(len(choices), (2, self.length), generator=generator)]
        forced = choices[torch.randint(len(choices), (2, DECODE_STEPS + 1), generator=generator)]
        mask = torch.ones_like(ids)
        mask[1, :PADDING] = 0
        pad = getattr(config, "pad_token_id", None)
        ids[1, :PADDING] = pad if isinstance(pad, int) and 0 <= pad < vocab else ids[1, PADDING]
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "forced": forced}

    def _run(self) -> list[Tensor]:
        model, inputs = self.model, self.inputs
        assert isinstance(inputs, dict)
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                outputs = [logits[mask.bool()].float()]
                if hasattr(model, "generate") and getattr(model, "can_generate", lambda: False)():
                    generated = model.generate(
                        ids, attention_mask=mask, max_new_tokens=DECODE_STEPS + 1, min_new_tokens=DECODE_STEPS + 1,
                        do_sample=False, num_beams=1, logits_processor=[_ForceTokens(inputs["forced"])],
                        output_logits=True, return_dict_in_generate=True, use_cache=True,
                        pad_token_id=getattr(_text_config(model), "pad_token_id", None) or 0,
                    )
                    outputs += [step.float() for step in generated.logits]
        finally:
            model.train(training)
        return outputs

    def disagreement(self) -> str | None:
        """None when the model as it stands computes what the original did, else what differs."""
        assert self.expected is not None
        self.outcome.probes += 1
        try:
            got = self._run()
        except Exception as err:
            return f"raised {type(err).__name__}: {err}"
        if len(got) != len(self.expected):
            return f"{len(got)} outputs instead of {len(self.expected)}"
        dtype = least_precise(*{p.dtype for p in self.model.parameters() if p.is_floating_point()}, torch.float32)
        names = ["forward logits", "prefill logits"] + [f"decode step {i + 1} logits" for i in range(DECODE_STEPS)]
        for name, a, b in zip(names, got, self.expected):
            problem = mismatch(a, b.double(), dtype, two_sided=True)
            if problem:
                return f"{name}: {problem}"
        return None

    # -- settling -------------------------------------------------------------------------------

    def settle(self, changes: list[Change], report: RewireReport) -> None:
        """Undo the changes that make the model disagree; record what was found in ``report``."""
        if not self.done:
            self._defer(changes, report)
            return
        started = time.perf_counter()
        if self.expected is None:
            self._keep_local_only(changes, report)
        else:
            self.outcome.ran = True
            self.outcome.reason = (f"{self.length}-token prefill of 2 sequences, one left-padded, "
                                   f"{DECODE_STEPS} cached decode steps")
            self.outcome.error = self.disagreement()
            if self.outcome.error is not None:
                log.info("hw_agnostic: rewired model disagrees with the original (%s); finding why", self.outcome.error)
                for change, why in self._culprits(changes):
                    change.undo()
                    self.outcome.undone += 1
                    report.retract(change.path, change.result)
                    report.add("left", change.path, change.original,
                               detail=f"undone: the rewired model disagreed with the original ({why})")
        self.outcome.seconds += time.perf_counter() - started
        report.verification = self.outcome

    def _keep_local_only(self, changes: list[Change], report: RewireReport) -> None:
        """Without a probe, keep only what each module's own check covers."""
        for change in changes:
            # a linear's class swap computes F.linear's values by construction (tests/ops/test_linear.py)
            if change.kind not in ("norm", "mlp", "qkv", "router", "linear"):
                change.undo()
                self.outcome.undone += 1
                report.retract(change.path, change.result)
                report.add("left", change.path, change.original,
                           detail=f"undone: the whole model could not be verified ({self.outcome.reason})")

    def _culprits(self, changes: list[Change]) -> list[tuple[Change, str]]:
        active = [c for c in changes if c.active]

        def fails(subset: list[Change]) -> str | None:
            apply_only(active, {id(c) for c in subset})
            return self.disagreement()

        bad: list[tuple[Change, str]] = []
        for kind in KINDS:
            group = [c for c in active if c.kind == kind]
            if group:
                error = fails(group)
                if error is not None:
                    bad += self._within(group, error, fails)
        culprits = {id(c) for c, _ in bad}
        rest = [c for c in active if id(c) not in culprits]
        error = fails(rest)
        for kind in reversed(KINDS):  # changes that disagree only together
            if error is None:
                break
            group = [c for c in rest if c.kind == kind]
            if not group:
                continue
            rest = [c for c in rest if c.kind != kind]
            bad += [(c, f"together with the rest: {error}") for c in group]
            error = fails(rest)
        apply_only(active, {id(c) for c in rest})
        if error is not None:  # nothing left to undo but the model still disagrees: undo everything
            bad += [(c, error) for c in rest]
            apply_only(active, set())
        return bad

    @staticmethod
    def _within(group: list[Change], error: str, fails: Probe) -> list[tuple[Change, str]]:
        by_class: dict[str, list[Change]] = defaultdict(list)
        for change in group:
            by_class[change.original].append(change)
        bad: list[tuple[Change, str]] = []
        for members in by_class.values():
            if len(by_class) > 1:
                error = fails(members)
                if error is None:
                    continue
            first = fails(members[:1]) if len(members) > 1 else error
            if first is not None:
                bad += [(c, first) for c in members]
            else:
                bad += Verification._bisect(members, error, fails)
        return bad

    @staticmethod
    def _bisect(members: list[Change], error: str, fails: Probe) -> list[tuple[Change, str]]:
        if len(members) == 1:
            return [(members[0], error)]
        half = len(members) // 2
        found: list[tuple[Change, str]] = []
        for part in (members[:half], members[half:]):
            part_error = fails(part)
            if part_error is not None:
                found += Verification._bisect(part, part_error, fails)
        return found or [(c, error) for c in members]

    # -- meta weights ---------------------------------------------------------------------------

    def _defer(self, changes: list[Change], report: RewireReport) -> None:
        """Verify on the first forward with real weights, before that forward runs."""
        report.verification = self.outcome
        verification = self

        def check_first(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not _weights_are_real(module):
                return
            verification._hook.remove()
            fresh = Verification(module, [c for c in changes if c.active])
            fresh.settle(changes, report)
            for change in changes:
                change.release()
            log.info("hw_agnostic: %s", report.verification.describe())

        self._hook = self.model.register_forward_pre_hook(check_first, with_kwargs=True)


class _without:
    """Within the block, ``changes`` are undone (the original model); reapplied after."""

    def __init__(self, changes: list[Change]) -> None:
        self.changes = [c for c in changes if c.active]

    def __enter__(self) -> None:
        for change in reversed(self.changes):
            change.undo()

    def __exit__(self, *exc: Any) -> None:
        for change in self.changes:
            change.apply()

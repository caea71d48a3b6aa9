"""``moe_route``: router logits ``[T, E]`` -> ``(weights [T, K] fp32, ids [T, K] int64)``.

Softmax then top-k (Qwen, Mixtral, OLMoE), sigmoid with correction bias and group-limited top-k
(DeepSeek-V3), top-k of the logits then softmax (gpt-oss) or sigmoid (Llama-4, Kolibri); optional
renormalisation and scaling factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..autotune.shapes import moe_model
from ..kernels import moe_route as kernels
from ..kernels.launch_binding import bindable
from ..kernels.runtime import next_power_of_2
from . import checks
from .compiled_reference import CompiledReference
from .moe_common import MAX_KERNEL_EXPERTS, dtype_name, helion_provider
from .registry import Op

SCORINGS = kernels.SCORINGS
#: Upper limits of the routing kernel (the reference runs beyond them).
MAX_KERNEL_TOP_K = 32
MAX_KERNEL_GROUPS = 32


# --------------------------------------------------------------------------------------------
# the spec


def moe_route_reference(
    router_logits: Tensor,
    correction_bias: Optional[Tensor],
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    return _choose(_scores(router_logits, scoring), correction_bias, top_k, scoring, renormalize, n_group, topk_group,
                   routed_scaling_factor, _top)


def _scores(router_logits: Tensor, scoring: str) -> Tensor:
    """What the experts are chosen by, in fp32 (fp64 for fp64 logits): the softmax or the sigmoid
    of the logits, or the logits themselves (the scorings that take the top-k first)."""
    compute = torch.promote_types(router_logits.dtype, torch.float32)
    if scoring == "softmax":
        return torch.softmax(router_logits, dim=-1, dtype=compute)  # the upcast fused: the same values
    if scoring == "sigmoid":
        return torch.sigmoid(router_logits.to(compute))
    return router_logits.to(compute)


def _choose(scores: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str, renormalize: bool,
            n_group: int, topk_group: int, routed_scaling_factor: float,
            top: Callable[[Tensor, int], Tensor]) -> tuple[Tensor, Tensor]:
    """The experts the scores choose and their weights, the top-k taken by ``top``."""
    compute = scores.dtype
    choice = _nan_as_inf(scores if correction_bias is None else scores + correction_bias.to(compute))
    num_experts = scores.shape[-1]
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.view(-1, n_group, per_group)
        group_scores = _nan_as_inf(grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1))
        best_groups = top(group_scores, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = top(choice, top_k)
    weights = scores.gather(1, ids)
    if scoring == "topk_then_softmax":
        weights = torch.softmax(weights, dim=-1)
    elif scoring == "topk_then_sigmoid":
        weights = torch.sigmoid(weights)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    return weights * routed_scaling_factor, ids


def _nan_as_inf(values: Tensor) -> Tensor:
    """A NaN score ranks above every number, as ``torch.topk`` ranks it (it still weighs NaN).
    One call: ``nan_to_num`` with the infinities kept as they are."""
    return torch.nan_to_num(values, nan=float("inf"), posinf=float("inf"), neginf=-float("inf"))


def _top(values: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest values per row; between equal values the lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][..., :k].contiguous()


# --------------------------------------------------------------------------------------------
# the reference provider's path where compiling is on


def _top_keyed(values: Tensor, k: int) -> Tensor:
    """:func:`_top` of fp32 values without NaN, as ``torch.topk`` of distinct int64 keys.

    Each value's bits become an int32 that orders as the value does (negative floats have their
    magnitude bits flipped; -0 becomes +0 first, as the sort ties them), shifted above 32 bits of
    the reversed index: keys order as the stable descending sort orders the values, and none tie,
    so the order ``torch.topk`` leaves unspecified between equal keys never arises. Top-8 of 256 x
    128 (AMD EPYC, one thread): 224 us against 329 for ``torch.topk`` of the fp32 values and 1356
    for the stable sort; compiled, the keys are made in the kernel that makes the values.
    Other dtypes (fp64 scores) take the sort."""
    if values.dtype != torch.float32:
        return _top(values, k)
    bits = values.view(torch.int32)
    bits = torch.where(bits == _NEGATIVE_ZERO_BITS, 0, bits)
    ordered = torch.bitwise_xor(bits, torch.bitwise_and(torch.bitwise_right_shift(bits, 31), 0x7FFFFFFF))
    experts = values.shape[-1]
    reversed_index = torch.arange(experts - 1, -1, -1, dtype=torch.int64, device=values.device)
    return torch.topk(ordered.to(torch.int64) * (1 << 32) + reversed_index, k, dim=-1)[1]


_NEGATIVE_ZERO_BITS = -(1 << 31)


def _choose_keyed(scores: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str, renormalize: bool,
                  n_group: int, topk_group: int, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _choose(scores, correction_bias, top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor,
                   _top_keyed)


class _KeyedRoute:
    """The scores by ATen's kernels, the choice compiled with integer keys for its top-k.

    What the reference provider runs while compiling is on: the scores as the reference computes
    them, then its choice traced and compiled (the lean path of :mod:`.compiled_reference`) with
    the top-k of :func:`_top_keyed`: one C++ kernel before each ``torch.topk`` and one after the
    last. The experts chosen are the reference's (the same scores, the same order); the weights'
    sum may add in another order (a last-bit difference).
    Per call of the op against the eager form before it (its fp64 keys' ``torch.topk`` for softmax,
    the sort for the rest), AMD EPYC, one thread: softmax over 128 experts, top-8, 1 / 16 / 256 rows
    25 / 41 / 435 against 31 / 46 / 479 us; DeepSeek-V3's (32 experts in 8 groups) 47 / 60 / 306
    against 122 / 147 / 458."""

    def __init__(self, op_name: str, reference: object) -> None:
        self.choose = CompiledReference(op_name, _choose_keyed, lean=True)

    def __call__(self, router_logits: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
        return self.choose(_scores(router_logits, rest[2]), *rest)

    def bind(self, args: tuple) -> Optional[Callable[..., tuple[Tensor, Tensor]]]:
        """See :meth:`.CompiledReference.bind` (the scores' metadata follows from the logits')."""
        logits, rest = args[0], args[1:]
        scoring = rest[2]
        choose = self.choose.bind((_scores(logits, scoring), *rest))
        if choose is None:
            return None

        def run(router_logits: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
            return choose(_scores(router_logits, scoring), *rest)

        return run


# --------------------------------------------------------------------------------------------
# checks


def check_moe_route(router_logits: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str,
                    renormalize: bool, n_group: int, topk_group: int, routed_scaling_factor: float) -> None:
    op = "moe_route"
    checks.matrix(op, "router_logits", router_logits)
    num_experts = router_logits.shape[1]
    if num_experts == 0:
        raise ValueError(f"{op}: router_logits must have at least one expert column; got shape "
                         f"{tuple(router_logits.shape)}")
    checks.integer(op, "top_k", top_k, minimum=1, maximum=num_experts)
    checks.choice(op, "scoring", scoring, SCORINGS)
    checks.flag(op, "renormalize", renormalize)
    if correction_bias is not None:
        checks.vector(op, "correction_bias", correction_bias, num_experts, "router_logits", router_logits)
    checks.integer(op, "n_group", n_group, minimum=1, maximum=num_experts)
    checks.integer(op, "topk_group", topk_group, minimum=1, maximum=n_group)
    if num_experts % n_group:
        raise ValueError(f"{op}: n_group ({n_group}) must divide the number of experts ({num_experts})")
    if n_group > 1 and scoring != "sigmoid":
        raise ValueError(f"{op}: group-limited routing (n_group={n_group}) is DeepSeek-V3's and needs "
                         f"scoring='sigmoid'; got scoring={scoring!r}")
    eligible = topk_group * (num_experts // n_group)
    if top_k > eligible:
        raise ValueError(f"{op}: top_k ({top_k}) exceeds the {eligible} experts of the topk_group={topk_group} "
                         f"best groups")
    checks.number(op, "routed_scaling_factor", routed_scaling_factor)


# --------------------------------------------------------------------------------------------
# keys


class RouteKey(NamedTuple):
    device: str
    dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]
    experts: int
    top_k: int
    scoring: str
    renormalize: bool
    n_group: int
    topk_group: int
    tokens: int
    int64: bool


def moe_route_key(router_logits: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str,
                  renormalize: bool, n_group: int, topk_group: int, routed_scaling_factor: float) -> RouteKey:
    return RouteKey(
        router_logits.device.type, router_logits.dtype, None if correction_bias is None else correction_bias.dtype,
        router_logits.shape[1], top_k, scoring, renormalize, n_group, topk_group,
        token_bucket(router_logits.shape[0]), checks.needs_int64(router_logits),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _route_accepts(key: RouteKey) -> str | None:
    problem = checks.kernel_dtype_problem("router_logits / correction_bias", key.dtype, key.bias_dtype)
    if problem:
        return problem
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the routing kernel's {MAX_KERNEL_EXPERTS}"
    if key.top_k > MAX_KERNEL_TOP_K or key.n_group > MAX_KERNEL_GROUPS:
        return f"top_k {key.top_k} / n_group {key.n_group} exceed the routing kernel's {MAX_KERNEL_TOP_K} / " \
               f"{MAX_KERNEL_GROUPS} (its loops over them are unrolled)"
    return None


def _route_tuning_key(key: RouteKey) -> dict[str, object]:
    return {"dtype": dtype_name(key.dtype), "experts": key.experts, "top_k": key.top_k, "scoring": key.scoring}


def _build_route(key: RouteKey, config: dict, args: tuple) -> object:
    logits, bias = args[0], args[1]
    top_k, has_bias = key.top_k, key.bias_dtype is not None
    block_e, block_k = next_power_of_2(key.experts), next_power_of_2(top_k)
    constants = (block_e, block_k, top_k, key.scoring, key.renormalize, has_bias, key.n_group, key.topk_group)

    def outputs(logits: Tensor) -> tuple[Tensor, Tensor]:
        rows = logits.shape[0]
        return (torch.empty((rows, top_k), dtype=torch.float32, device=logits.device),
                torch.empty((rows, top_k), dtype=torch.int64, device=logits.device))

    if key.tokens == 0:  # this key only ever sees empty calls
        return lambda logits, *rest: outputs(logits)
    weights, ids = outputs(logits)
    # Without a correction bias the kernel never reads that argument; any 1-D tensor binds it.
    launch = kernels.route_kernel.compile(
        config, (logits, bias if has_bias else logits[0], weights, ids, float(args[7]), *constants), int64=key.int64)

    def running(launch: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        def run(logits: Tensor, bias: Optional[Tensor], top_k: int, scoring: str, renormalize: bool, n_group: int,
                topk_group: int, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
            weights, ids = outputs(logits)
            if logits.shape[0]:
                launch(logits, bias if has_bias else logits[0], weights, ids, float(routed_scaling_factor), *constants)
            return weights, ids

        return run

    return bindable(running, launch)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck; see .moe_common)


def _example_route(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    logits = torch.randn(tokens, model.experts, dtype=dtype, device=device)
    if model.n_group > 1:
        bias = 0.1 * torch.randn(model.experts, device=device)
        return logits, bias, model.top_k, "sigmoid", True, model.n_group, model.topk_group, 2.5
    return logits, None, model.top_k, "softmax", True, 1, 1, 1.0


moe_route_op = Op(
    "moe_route", moe_route_reference, check=check_moe_route, key=moe_route_key,
    providers=[helion_provider(_build_route, _route_accepts, kernels.MOE_ROUTE, _route_tuning_key)],
    example_inputs=_example_route, compiled_reference=_KeyedRoute, fusable=True,
)


# --------------------------------------------------------------------------------------------
# public API


def moe_route(
    router_logits: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Pick ``top_k`` experts per token from router logits ``[T, E]``.

    Args:
        router_logits: ``[T, E]``; scored in fp32 whatever their dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (softmax over all experts, then top-k: Qwen-MoE, Mixtral, OLMoE),
            ``"sigmoid"`` (DeepSeek-V3: sigmoid scores, chosen by ``score + correction_bias``,
            weighted by the unbiased score), ``"topk_then_softmax"`` (gpt-oss, Granite-MoE:
            top-k of the logits, softmax over those k) or ``"topk_then_sigmoid"`` (Llama-4,
            Kolibri: top-k of the (biased) logits, each weighted by the sigmoid of its logit).
        renormalize: divide the k weights by their sum (DeepSeek-V3 adds 1e-20 to the sum).
        correction_bias: ``[E]``, added to the scores only to choose experts.
        n_group, topk_group: DeepSeek-V3's group-limited routing: experts form ``n_group``
            groups, a group scores the sum of its two best (biased) scores, and only experts of
            the ``topk_group`` best groups are eligible (``scoring="sigmoid"`` only).
        routed_scaling_factor: multiplies the final weights.

    Returns:
        ``(weights [T, top_k] fp32, ids [T, top_k] int64)``, best expert first: ``top_k``
        distinct experts in ``[0, E)`` whatever the logits hold. Between equal scores the lower
        expert index goes first (``torch.topk``, which the Hugging Face routers call, leaves that
        order unspecified); a NaN score ranks above every number, as ``torch.topk`` ranks it, and
        its weight is NaN. Cast the weights as the model does (Qwen casts them to the model
        dtype, Mixtral and DeepSeek-V3 keep fp32).
    """
    return moe_route_op.call(router_logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group,
                             routed_scaling_factor)

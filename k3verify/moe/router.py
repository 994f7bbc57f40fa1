"""The router of Stable LatentMoE (docs/model.md §4): logits, selection with a bias, mixture weights.

    r = x W_r            (FP32 at least: fp64 inputs stay fp64; ``logits_dtype`` may round it)
    s = σ(r)
    I = TopK_k(s + b)     (b only here; ties by ``config.tie_break``)
    p_j = ρ · s_j / (Σ_{i∈I} s_i + renorm_eps),   j ∈ I

The selection is a stable descending sort of ``s + b``, so among equal biased scores the
lower expert index comes first (``tie_break="lowest_index"``) — ``torch.topk`` documents no
order among equal values. Equal biased scores are common in fp32: ``σ(r)`` rounds to exactly 1
for ``r`` above about 16.6 (37 in fp64), and then only ``b`` and the tie rule decide.
"""

from __future__ import annotations

import torch

from ..numerics import compute_dtype, resolve_dtype, round_to
from .inputs import MoEConfig, MoEWeights, Routing


def router_logits(x: torch.Tensor, w_router: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``x:[T, d] @ w_router:[d, E]`` in fp32 (fp64 for fp64 inputs), rounded to
    ``config.logits_dtype`` when one is set (the values stay in the compute dtype's storage)."""
    dtype = compute_dtype(x.dtype)
    logits = x.to(dtype) @ w_router.to(dtype)
    if config.logits_dtype is not None:
        logits = round_to(logits, config.logits_dtype)
    return logits


def select(scores: torch.Tensor, bias: torch.Tensor, top_k: int, tie_break: str = "lowest_index") -> torch.Tensor:
    """``TopK(scores + bias)`` per row: ``[T, E] -> [T, k]`` int64, best first, ties by ``tie_break``."""
    biased = scores + bias.to(scores.dtype)
    if tie_break == "highest_index":
        # Reverse the expert axis so the stable sort keeps the higher index first, then map back.
        E = biased.shape[-1]
        return E - 1 - torch.sort(biased.flip(-1), dim=-1, descending=True, stable=True).indices[:, :top_k]
    if tie_break != "lowest_index":
        raise ValueError(f"unknown tie_break {tie_break!r}; choose one of lowest_index, highest_index")
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]


def mixture_weights(scores: torch.Tensor, indices: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``ρ s_I / (Σ s_I + renorm_eps)`` from the *unbiased* scores of the selected experts: ``[T, k]``."""
    s = torch.gather(scores, -1, indices)
    return s / (s.sum(-1, keepdim=True) + config.renorm_eps) * config.routed_scaling_factor


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, config: MoEConfig) -> Routing:
    """The router's :class:`Routing` for ``x:[T, d]`` (scores and weights in the compute dtype)."""
    scores = torch.sigmoid(router_logits(x, w_router, config))
    indices = select(scores, bias, config.top_k, config.tie_break)
    return Routing(indices, mixture_weights(scores, indices, config), scores)


def topk_gap(scores: torch.Tensor, bias: torch.Tensor, top_k: int, *, ordered: bool = False) -> torch.Tensor:
    """Per token, the k-th minus the (k+1)-th largest biased score ``[T]`` (inf when k = E); with
    ``ordered``, the smallest difference between neighbours among the k + 1 largest.

    A perturbation of every biased score by less than half this gap cannot change the selection
    (with ``ordered``: neither the selection nor its best-first order).
    """
    biased = scores + bias.to(scores.dtype)
    top = torch.topk(biased, min(top_k + 1, biased.shape[-1]), dim=-1).values  # values only: tie order is moot
    neighbours = top[:, :-1] - top[:, 1:]  # [T, min(k + 1, E) - 1], best first
    if not ordered:
        neighbours = neighbours[:, top_k - 1 :]  # the k-th minus the (k+1)-th; none when k = E
    if neighbours.shape[-1] == 0:
        return torch.full(biased.shape[:-1], float("inf"), dtype=biased.dtype)
    return neighbours.amin(-1)


def changed_choices(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Compare two selections ``[T, k]`` as sets per token.

    Returns ``(pairs, tokens)``: the fraction of selected (token, expert) pairs of ``a`` that
    ``b`` did not select, and the fraction of tokens with at least one changed choice.
    """
    if a.shape != b.shape:
        raise ValueError(f"selections differ in shape: {list(a.shape)} vs {list(b.shape)}")
    if a.numel() == 0:
        return 0.0, 0.0
    kept = (a[:, :, None] == b[:, None, :]).any(-1)  # [T, k]
    return 1.0 - float(kept.double().mean()), float((~kept.all(-1)).double().mean())


def routing_for(
    x: torch.Tensor, weights: MoEWeights, config: MoEConfig, routing: Routing | None, dtype: torch.dtype
) -> Routing:
    """``routing`` with its weights in ``dtype`` when given, else the router run in ``dtype``
    on ``x`` as given (a form's operand rounding never reaches the router: the fp32 logits of docs/model.md §4)."""
    if routing is not None:
        return routing.to(dtype)
    return route(x.to(dtype), weights.w_router.to(dtype), weights.bias.to(dtype), config)


def mixture(x: torch.Tensor, w_router: torch.Tensor, indices: torch.Tensor, config: MoEConfig,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [T, E], p [T, k])`` of the router run in ``dtype`` on ``x`` as given, for the
    selection ``indices`` (best first): differentiable in ``x`` and ``w_router``, the selection
    held fixed (it is not differentiable; a backward follows the forward's choices)."""
    scores = torch.sigmoid(router_logits(x.to(dtype), w_router.to(dtype), config))
    p = mixture_weights(scores, indices, config)
    if config.top_k == 1 and config.renorm_eps == 0:
        # p = ρ s / s is the constant ρ: its gradient is exactly 0, where autograd of s / s
        # leaves a rounding residue that no relative rule can judge.
        p = p.detach()
    return scores, p


def score_error_bound(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, config: MoEConfig,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per token ``[T]``, a bound on how far the router run in ``dtype`` on ``x`` as given can put
    any biased score ``σ(x W_r) + b`` from its exact value (fp64 arguments).

    Each logit is a dot product of ``d`` terms whose factors are cast to ``dtype`` first: it errs
    by at most ``δ = γ_{d+2} Σ_i |x_i| |W_r[i, e]|`` (``γ_n = n u / (1 − n u)``, ``u`` the unit
    roundoff; plus half a unit of ``logits_dtype`` when the logits are rounded). ``σ'`` falls
    with ``|r|``, so the score moves by at most ``δ σ'(max(|r| − δ, 0))`` (``δ / 4`` near 0, far
    less where the sigmoid saturates); ``σ`` is allowed 4 units of its result and the bias's
    addition one unit of the biased score.
    """
    u = torch.finfo(dtype).eps / 2
    n = x.shape[-1] + 2
    xd, wd = x.to(torch.float64), w_router.to(torch.float64)
    logits = xd @ wd
    delta = (n * u / (1 - n * u)) * (xd.abs() @ wd.abs())
    if config.logits_dtype is not None:
        delta = delta + torch.finfo(resolve_dtype(config.logits_dtype)).eps / 2 * logits.abs()
    nearest = torch.sigmoid((logits.abs() - delta).clamp(min=0))
    score = delta * nearest * (1 - nearest) + 4 * u + u * (torch.sigmoid(logits) + bias.to(torch.float64)).abs()
    return score.amax(-1)


def clear_of_ties(x: torch.Tensor, weights: MoEWeights, config: MoEConfig,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tokens ``[T]`` (bool) whose exact top-k gap exceeds twice :func:`score_error_bound`: the
    router in ``dtype`` selects the same experts as the exact one for them, whatever its rounding
    (each biased score moves by less than the bound, so the gap shrinks by less than twice it).
    The order among the selected does not matter to a gradient, only the set."""
    scores = torch.sigmoid(x.to(torch.float64) @ weights.w_router.to(torch.float64))
    gap = topk_gap(scores, weights.bias.to(torch.float64), config.top_k)
    return gap > 2 * score_error_bound(x, weights.w_router, weights.bias, config, dtype)

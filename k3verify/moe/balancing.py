"""Quantile Balancing: the bias update that trains ``e_score_correction_bias`` (docs/model.md §4).

On one batch of router scores ``s:[T, n]`` with the current bias ``b``:

    α_i  = the (k+1)-th largest biased score s_i + b of token i
    b̂_j = −quantile_{1 − k/n}(s_{:,j} − α)
    b    ← b̂ − mean(b̂)                    (applied to the next batch)

With ``b̂`` expert j is chosen by token i when ``s_ij + b̂_j > α_i``, which holds for a fraction
``k/n`` of the batch's tokens: every expert gets the average load ``kT/n`` as long as the
thresholds ``α`` move little. Adding a constant to ``b`` shifts every ``α_i`` and every ``b̂_j``
by that constant, which the centring removes; and routing itself is invariant to ``b + c``.
"""

from __future__ import annotations

import torch

from ..numerics.validate import require_finite, require_float, require_positive_int, require_shape, require_tensor


def quantile_balancing(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, *, interpolation: str = "linear"
) -> torch.Tensor:
    """The next bias ``[n]``: :func:`quantile_thresholds`' ``b̂`` centred to mean 0.

    ``scores:[T, n]`` are σ of the router logits, ``bias:[n]`` the current bias; ``interpolation``
    is :func:`torch.quantile`'s ([assumed]: the spec names no rule). Computes in the scores' dtype.
    """
    b_hat, _ = quantile_thresholds(scores, bias, top_k, interpolation=interpolation)
    return b_hat - b_hat.mean()


def quantile_thresholds(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, *, interpolation: str = "linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b̂ [n], α [T])``: the uncentred bias and each token's (k+1)-th largest biased score.

    With ``b̂`` a fraction ``k/n`` of the batch's tokens has ``s_ij + b̂_j > α_i`` for every expert.
    """
    scores, bias = require_tensor("scores", scores), require_tensor("bias", bias)
    require_float("scores", scores)
    require_float("bias", bias)
    if scores.dim() != 2 or scores.shape[0] == 0:
        raise ValueError(f"scores has shape {list(scores.shape)}; expected [T >= 1, n]")
    n = scores.shape[1]
    require_shape("bias", bias, (n,), "n")
    require_positive_int("top_k", top_k)
    if top_k >= n:
        raise ValueError(f"Quantile Balancing needs top_k < number of experts; got top_k {top_k}, n {n}")
    require_finite("scores", scores)
    require_finite("bias", bias)
    biased = scores + bias.to(scores.dtype)
    alpha = torch.topk(biased, top_k + 1, dim=-1).values[:, -1]  # values only: ties do not matter
    b_hat = -torch.quantile(scores - alpha[:, None], 1.0 - top_k / n, dim=0, interpolation=interpolation)
    return b_hat, alpha


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert ``[n]`` (int64) from selections ``[T, k]``."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def imbalance(load: torch.Tensor) -> float:
    """``max(load) / mean(load)``: 1 for a perfectly balanced layer, ``n / k`` at worst."""
    mean = float(load.double().mean())
    return float(load.max()) / mean if mean > 0 else float("nan")

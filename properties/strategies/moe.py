"""What Stable LatentMoE's tests share beyond the drawn problems (which are
``k3verify.moe.samples``' :func:`problems`, the users' strategy too): which routing choices another
router run cannot change, and one intra-op thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from k3verify import moe
from k3verify.harness.environment import one_thread as _one_thread


def settled_choices(scores: torch.Tensor, bias: torch.Tensor, top_k: int,
                    spread: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens whose selection another router run cannot change: ``(same_set, same_order)``, ``[T]`` bool.

    ``spread`` (per token ``[T]`` or one number) bounds how far the other run's biased scores can
    be from these ones. Then the selected set is settled where the k-th minus the (k+1)-th biased
    score exceeds ``2 spread``, and its order (best first) where every adjacent gap of the top
    ``k + 1`` does. Closer to a tie, rounding that differs between the runs (another summation
    order, another CPU's kernels) may legitimately pick differently.
    """
    biased = scores + bias.to(scores.dtype)
    top = torch.topk(biased, min(top_k + 1, biased.shape[-1]), dim=-1).values
    spread = torch.as_tensor(spread, dtype=scores.dtype)
    same_set = moe.topk_gap(scores, bias, top_k) > 2 * spread
    return same_set, same_set & ((top[:, :-1] - top[:, 1:]) > 2 * spread[..., None]).all(-1)


def fp64_score_spread(x: torch.Tensor, weights: moe.MoEWeights) -> torch.Tensor:
    """Per token ``[T]``: how far an fp64 router's biased scores can be from the exact ones, in any
    summation order and with any libm. The logit's dot product errs by at most
    ``(d + 2) eps Σ|x||w|`` (γ_d, generously), which ``σ' <= 1/4`` quarters; rounding ``σ`` (an
    exp and three basic operations) and ``s + b`` add at most ``4 eps (1 + max|b|)``."""
    eps = torch.finfo(torch.float64).eps
    d = x.shape[-1]
    dot = (x.abs() @ weights.w_router.abs()).amax(-1)
    return (d + 2) * eps * dot / 4 + 4 * eps * (1 + float(weights.bias.abs().max()))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread for MoE tests (tiny tensors; two threads spin-wait on shared cores,
    measured 10x slower), restored afterwards. Import it into a test module to apply it there."""
    with _one_thread():
        yield

"""Quantile Balancing (docs/model.md §4): what the update guarantees on its own batch, that it balances
the next batch of skewed scores, and its invariance to a constant added to the bias.

Synthetic scores ``s = σ(r + skew_j)`` with ``r ~ N(0, 1)`` and ``skew_j`` spread linearly over
``[−strength, strength]``: expert ``n−1`` is preferred by most tokens, expert 0 by few.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies.moe import one_thread  # noqa: F401

from k3verify import moe
from k3verify.numerics import fp64_agreement


def skewed_batches(n: int, strength: float, seed: int, T: int):
    gen = torch.Generator().manual_seed(seed)
    skew = strength * torch.linspace(-1, 1, n, dtype=torch.float64)

    def batch() -> torch.Tensor:
        return torch.sigmoid(torch.randn(T, n, generator=gen, dtype=torch.float64) + skew)

    return batch


@given(n=st.sampled_from((8, 16, 32)), k=st.integers(1, 6), T=st.integers(5, 300), seed=st.integers(0, 1000),
       bias_scale=st.sampled_from((0.0, 0.1)))
def test_thresholds_give_each_expert_k_over_n_of_the_batch(n: int, k: int, T: int, seed: int,
                                                           bias_scale: float) -> None:
    """Exact counting (the quantile's definition): with b̂ and the batch's own thresholds α, the
    tokens with ``s_ij + b̂_j > α_i`` number at most ⌈T k / n⌉ and those with ``>=`` at least
    ⌊T k / n⌋ for every expert j, whatever the current bias. (The threshold −b̂_j lies between two
    order statistics of ``s_:j − α``; ``>=`` matters where tokens tie with it, e.g. the tokens for
    which j is the (k+1)-th choice, whose value is exactly −b_j.)"""
    k = min(k, n - 1)
    s = skewed_batches(n, 2.0, seed, T)()
    bias = bias_scale * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    b_hat, alpha = moe.quantile_thresholds(s, bias, k)
    v = s - alpha[:, None]
    above, at_least = (v > -b_hat).sum(0), (v >= -b_hat).sum(0)
    target = T * k / n
    assert bool((above <= math.ceil(target)).all()), (above.tolist(), target)
    assert bool((at_least >= math.floor(target)).all()), (at_least.tolist(), target)


@given(n=st.sampled_from((8, 16)), k=st.integers(1, 4), strength=st.floats(1.0, 4.0), seed=st.integers(0, 1000))
def test_balancing_reduces_the_imbalance_of_the_next_batch(n: int, k: int, strength: float, seed: int) -> None:
    """Structural: computed on one batch and applied to the next, one update lowers max/mean load;
    four more updates (each on a fresh batch) leave at most half of the initial excess load
    ``max/mean − 1``. The thresholds α move when the bias does, so one step is not exact and the
    iteration converges; sampling noise of a finite batch stays."""
    T = 1024
    batch = skewed_batches(n, strength, seed, T)
    zero = torch.zeros(n, dtype=torch.float64)
    calibration, evaluation = batch(), batch()
    before = moe.imbalance(moe.expert_load(moe.select(evaluation, zero, k), n))
    b = moe.quantile_balancing(calibration, zero, k)
    after = moe.imbalance(moe.expert_load(moe.select(evaluation, b, k), n))
    assert after < before
    for _ in range(4):
        b = moe.quantile_balancing(batch(), b, k)
    settled = moe.imbalance(moe.expert_load(moe.select(batch(), b, k), n))
    assert settled - 1 <= (before - 1) / 2, (before, after, settled)


@given(c=st.floats(-10, 10), seed=st.integers(0, 1000), k=st.integers(1, 5))
def test_update_is_invariant_to_a_constant_added_to_the_bias(c: float, seed: int, k: int) -> None:
    """fp64-agreement: α and b̂ both shift by c, which the centring removes, so QB(b + c) = QB(b)
    up to the rounding of the shifted sums."""
    s = skewed_batches(16, 2.0, seed, 200)()
    b = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    v = fp64_agreement(moe.quantile_balancing(s, b + c, k), moe.quantile_balancing(s, b, k))
    # Normwise relative to the bias, whose entries are O(0.1) while s + b + c carries |c| <= 10:
    # rounding of the shifted sums is ~|c| 2^-53 absolute, far below 1e-10 of the bias.
    assert v.passed, v.reason


def test_bad_arguments_are_named() -> None:
    """Structural: the right exception, naming the argument."""
    s = torch.rand(4, 8, dtype=torch.float64)
    b = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="top_k < number of experts"):
        moe.quantile_balancing(s, b, 8)
    with pytest.raises(ValueError, match="bias"):
        moe.quantile_balancing(s, b[:-1], 2)
    with pytest.raises(ValueError, match="scores"):
        moe.quantile_balancing(s[0], b, 2)
    with pytest.raises(ValueError, match="scores"):
        moe.quantile_balancing(s.index_fill(0, torch.tensor([1]), float("nan")), b, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe.quantile_balancing(s, b, 0)

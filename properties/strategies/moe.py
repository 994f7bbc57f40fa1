"""Hypothesis strategies for Stable LatentMoE problems.

Sizes are drawn directly (so they shrink toward one token, few experts, top-1, narrow widths);
tensor values come from a drawn seed, so a failing example replays exactly from its printed
``make_problem`` call. Widths keep K3's ratio latent = d / 2; the shared MLP is two experts wide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import strategies as st

from k3verify import moe
from k3verify.harness.environment import one_thread as _one_thread
from k3verify.moe import samples


@dataclass
class MoEProblem:
    """One drawn problem: fp64 inputs, weights and the configuration that made them."""

    T: int
    E: int
    k: int
    d: int
    H: int
    seed: int
    x_scale: float
    activation: str
    rho: float
    bias_scale: float
    cfg: moe.MoEConfig = field(repr=False)
    weights: moe.MoEWeights = field(repr=False)
    x: torch.Tensor = field(repr=False)

    def __repr__(self) -> str:
        # Replayable: the make_problem call that rebuilds this problem bit for bit.
        return (f"make_problem({self.T}, E={self.E}, k={self.k}, d={self.d}, H={self.H}, seed={self.seed}, "
                f"x_scale={self.x_scale!r}, activation={self.activation!r}, rho={self.rho!r}, "
                f"bias_scale={self.bias_scale!r})")

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # Hypothesis pretty-prints dataclasses field by field (tensors included); print the replay call.
        printer.text(repr(self))

    def args(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, moe.MoEWeights, moe.MoEConfig]:
        """``(x, weights, config)`` with tensors in ``dtype``."""
        return self.x.to(dtype), self.weights.to(dtype), self.cfg

    def with_weights(self, **changes: torch.Tensor) -> MoEProblem:
        """The same problem with some weight tensors replaced."""
        return dataclasses.replace(self, weights=dataclasses.replace(self.weights, **changes))

    def with_config(self, **changes: object) -> MoEProblem:
        """The same problem under another configuration (same tensors)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, **changes))


def make_problem(T: int = 8, *, E: int = 8, k: int = 2, d: int = 16, H: int = 8, seed: int = 0,
                 x_scale: float = 1.0, activation: str = "situ", rho: float = 1.0,
                 bias_scale: float = 0.1) -> MoEProblem:
    """A problem built directly (for pinned examples and plain tests) by
    :func:`k3verify.moe.samples.random_inputs`: bias ~ N(0, bias_scale²), x ~ N(0, x_scale²)."""
    cfg = moe.MoEConfig(hidden_size=d, num_experts=E, top_k=k, latent_size=d // 2, expert_hidden=H,
                        routed_scaling_factor=rho, activation=activation)
    made = samples.random_inputs(cfg, T, seed=seed, x_scale=x_scale, bias_scale=bias_scale)
    return MoEProblem(T, E, k, d, H, seed, x_scale, activation, rho, bias_scale, cfg, made["weights"], made["x"])


@st.composite
def moe_problems(
    draw: st.DrawFn,
    *,
    min_T: int = 1,
    max_T: int = 12,
    experts: tuple[int, ...] = (4, 8, 16),
    max_k: int = 4,
    widths: tuple[int, ...] = (8, 16, 32),
    hidden: tuple[int, ...] = (4, 8, 12),
    x_scale: st.SearchStrategy[float] | None = None,
    activation: st.SearchStrategy[str] | None = None,
    rho: st.SearchStrategy[float] | None = None,
    bias_scale: st.SearchStrategy[float] | None = None,
) -> MoEProblem:
    """Random problems: any token count, top-k up to ``max_k`` of the experts, random bias."""
    T = draw(st.integers(min_T, max_T))
    E = draw(st.sampled_from(experts))
    k = draw(st.integers(1, min(max_k, E)))
    d = draw(st.sampled_from(widths))
    H = draw(st.sampled_from(hidden))
    seed = draw(st.integers(0, 2**16))
    return make_problem(
        T, E=E, k=k, d=d, H=H, seed=seed,
        x_scale=draw(x_scale) if x_scale is not None else 1.0,
        activation=draw(activation) if activation is not None else "situ",
        rho=draw(rho) if rho is not None else 1.0,
        bias_scale=draw(bias_scale) if bias_scale is not None else 0.1,
    )


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

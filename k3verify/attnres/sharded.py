"""Block AttnRes under tensor parallelism: it runs on the full-width residual stream, after the
all-reduce of the sublayer's row-parallel output, so every rank must compute the same mixture.

:func:`rank_forward` models one step on rank ``r`` of ``N``: the sublayer output arrives as this
rank's partial sum (its slice of the contraction ``a W``, ``a:[T, K]``, ``W:[K, d]``, ``K`` split
over the ranks), is all-reduced and added to the partial sum ``p`` (the last source); then the
AttnRes call mixes the stored blocks and the new ``p``. Run under
:func:`k3verify.harness.tp.run_ranks`. In a low-precision ``dtype`` the contraction computes in
fp32 and stores ``dtype``, the sum is taken in ``reduce_dtype``, ``p`` is stored in ``dtype`` and
the mixture is the plain definition storing ``dtype`` (:func:`naive_baseline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import all_reduce, compute_dtype, resolve_dtype
from .recurrent import aggregate, naive_baseline


@dataclass(frozen=True)
class ShardedCall:
    """``sources:[N, T, d]`` (stored blocks, then the partial sum before this sublayer),
    ``w, gamma:[d]``, the sublayer's input ``a:[T, K]`` and weight ``W:[K, d]``."""

    sources: torch.Tensor
    w: torch.Tensor
    gamma: torch.Tensor
    a: torch.Tensor
    weight: torch.Tensor
    dtype: str = "fp64"
    reduce_dtype: str = "fp64"


def make_call(size: str, seed: int, world_size: int) -> ShardedCall:
    """``small`` (9 sources of width 64, T = 16, K = 4 per rank) or ``k3`` (9 sources of width
    7168, T = 64, the sublayer contraction K = 7168: K3's largest source set at its width), the
    logits scaled by 8, from ``seed``."""
    from .samples import aggregation_sample

    if size not in ("small", "k3"):
        raise ValueError(f"size must be 'small' or 'k3', got {size!r}")
    T, d, K = (16, 64, 4 * world_size) if size == "small" else (64, 7168, 7168)
    inputs, _ = aggregation_sample(9, T, d, logit_scale=8.0, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(T, K, generator=gen, dtype=torch.float64)
    return ShardedCall(inputs["sources"], inputs["w"], inputs["gamma"], a,
                       torch.randn(K, d, generator=gen, dtype=torch.float64) / K**0.5)  # fmt: skip


def _product(call: ShardedCall, part: slice) -> torch.Tensor:
    """``a[:, part] W[part]`` computed in fp32 (fp64) from ``dtype`` operands, stored in fp32 (fp64)."""
    dtype = resolve_dtype(call.dtype)
    acc = compute_dtype(dtype)
    return (call.a[:, part].to(dtype).to(acc) @ call.weight[part].to(dtype).to(acc)).to(dtype).to(acc)


def _mix(call: ShardedCall, delta: torch.Tensor) -> torch.Tensor:
    dtype = resolve_dtype(call.dtype)
    acc = compute_dtype(dtype)
    p = (call.sources[-1].to(dtype).to(acc) + delta).to(dtype).to(acc)
    sources = torch.cat([call.sources[:-1].to(acc), p[None]])
    if dtype == torch.float64:
        return aggregate(sources, call.w, call.gamma)
    return naive_baseline(sources, call.w.to(acc), call.gamma.to(acc), dtype=dtype)


def unsharded(call: ShardedCall) -> dict[str, torch.Tensor]:
    """The same step on one process in ``call.dtype``: ``{"h": [T, d]}``."""
    return {"h": _mix(call, _product(call, slice(None)))}


def rank_forward(rank: int, world_size: int, call: ShardedCall) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s partial of ``a W``, the all-reduce, the new partial sum and the mixture."""
    K = call.a.shape[-1]
    if K % world_size:
        raise ValueError(f"contraction size {K} does not split over {world_size} ranks")
    part = slice(rank * K // world_size, (rank + 1) * K // world_size)
    dtype = resolve_dtype(call.dtype)
    delta = all_reduce(_product(call, part).to(dtype), call.reduce_dtype).to(compute_dtype(dtype))
    return {"h": _mix(call, delta)}

"""Block AttnRes under tensor parallelism: it runs on the full-width residual stream, after the
all-reduce of the sublayer's row-parallel output, so every rank must compute the same mixture.

:func:`rank_forward` models one step on rank ``r`` of ``N``: the sublayer output arrives as this
rank's partial sum (its slice of the contraction ``a W``, ``a:[T, K]``, ``W:[K, d]``, ``K`` split
over the ranks), is all-reduced and added to the partial sum ``p`` (the last source); then the
AttnRes call mixes the stored blocks and the new ``p``. Run under
:func:`k3verify.harness.tp.run_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .recurrent import aggregate


@dataclass(frozen=True)
class ShardedCall:
    """``sources:[N, T, d]`` (stored blocks, then the partial sum before this sublayer),
    ``w, gamma:[d]``, the sublayer's input ``a:[T, K]`` and weight ``W:[K, d]``."""

    sources: torch.Tensor
    w: torch.Tensor
    gamma: torch.Tensor
    a: torch.Tensor
    weight: torch.Tensor


def unsharded(call: ShardedCall) -> torch.Tensor:
    """The same step on one process: ``h:[T, d]``."""
    p = call.sources[-1] + call.a @ call.weight
    return aggregate(torch.cat([call.sources[:-1], p[None]]), call.w, call.gamma)


def rank_forward(rank: int, world_size: int, call: ShardedCall) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s partial of ``a W``, the all-reduce, the new partial sum and the mixture."""
    K = call.a.shape[-1]
    if K % world_size:
        raise ValueError(f"contraction size {K} does not split over {world_size} ranks")
    part = slice(rank * K // world_size, (rank + 1) * K // world_size)
    delta = call.a[:, part] @ call.weight[part]
    dist.all_reduce(delta)
    p = call.sources[-1] + delta
    return {"h": aggregate(torch.cat([call.sources[:-1], p[None]]), call.w, call.gamma)}

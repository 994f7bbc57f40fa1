"""Gated MLA sharded over tensor-parallel ranks, as vLLM shards it (SPEC §0: 96 heads, 12 per
rank at TP = 8).

Each rank holds its heads' slices of ``W_UQ``, ``W_UK``, ``W_UV``, ``W_G`` and ``W_O``
(:func:`k3verify.mla.layer.shard`); ``W_DQ``, ``W_DKV`` and both norms are replicated, so every
rank writes the same latent cache entries. The output projection is row-parallel: each rank's
``[gate ⊙ o] W_O`` is a partial sum over its heads, all-reduced into ``y``.

:func:`rank_forward` is what a rank runs under :func:`k3verify.harness.tp.run_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .cache import LatentCache
from .layer import MLAConfig, MLAWeights, forward, shard

# ``split_latent``: W_DKV split across ranks by mistake (each rank keeps only its share of the
# latent columns), the kind of wrong placement a test plants to show it is caught.
PLANTS = ("split_latent",)


@dataclass(frozen=True)
class ShardedCall:
    """What every rank is given: ``x:[B, T, d]``, all heads' weights and the cache to write."""

    x: torch.Tensor
    weights: MLAWeights
    config: MLAConfig
    cache: LatentCache
    plant: str | None = None


def _split_latent(w: MLAWeights, rank: int, world_size: int) -> MLAWeights:
    cols = w.w_dkv.shape[1]
    keep = torch.zeros(cols, dtype=w.w_dkv.dtype)
    keep[rank * cols // world_size : (rank + 1) * cols // world_size] = 1
    return replace(w, w_dkv=w.w_dkv * keep)


def rank_forward(rank: int, world_size: int, call: ShardedCall) -> dict[str, torch.Tensor]:
    """One rank: its heads' attention over the replicated cache, ``y`` all-reduced.

    Returns the cache entries it wrote (``entries``), its partial output (``y sent``) and the
    all-reduced ``y``."""
    cfg = replace(call.config, tp_size=world_size)
    w = shard(call.weights, cfg, rank)
    if call.plant == "split_latent":
        w = _split_latent(w, rank, world_size)
    out = forward(call.x, w, cfg, call.cache)
    y = out.y.clone()
    dist.all_reduce(y)
    return {"entries": out.entries, "y sent": out.y, "y": y}

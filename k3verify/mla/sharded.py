"""Gated MLA sharded over tensor-parallel ranks, as vLLM shards it (docs/model.md §0: 96 heads, 12 per
rank at TP = 8).

Each rank holds its heads' slices of ``W_UQ``, ``W_UK``, ``W_UV``, ``W_G`` and ``W_O``
(:func:`k3verify.mla.layer.shard`); ``W_DQ``, ``W_DKV`` and both norms are replicated, so every
rank writes the same latent cache entries. The output projection is row-parallel: each rank's
``[gate ⊙ o] W_O`` is a partial sum over its heads, all-reduced into ``y``.

:func:`rank_forward` is what a rank runs under :func:`k3verify.harness.tp.run_ranks`;
:func:`unsharded` is the same layer on one process; :func:`make_call` builds the inputs every
rank and the parent build alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..numerics import all_reduce, cast_floats, resolve_dtype
from .cache import LatentCache, allocate, append
from .layer import MLAConfig, MLAWeights, forward, init_weights, shard

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
    dtype: str = "fp64"
    reduce_dtype: str = "fp64"
    plant: str | None = None


def make_call(size: str, seed: int, world_size: int) -> ShardedCall:
    """``small`` (one head per rank at the small layer's widths) or ``k3`` (96 heads, cache
    512 + 64): two requests of ``T`` new tokens over ``C`` earlier cached ones (small: T = 5,
    C = 11; k3: T = 16, C = 48), in pages of 4 or 16, from ``seed``."""
    if size == "small":
        cfg, T, C, page = replace(MLAConfig.small(), num_heads=world_size), 5, 11, 4
    elif size == "k3":
        cfg, T, C, page = MLAConfig.production(), 16, 48, 16
    else:
        raise ValueError(f"size must be 'small' or 'k3', got {size!r}")
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, T, cfg.hidden_size, generator=gen, dtype=torch.float64)
    earlier = torch.randn(2, C, cfg.cache_width, generator=gen, dtype=torch.float64)
    cache = append(allocate(2, C + T, page, cfg.cache_width, generator=gen), earlier)
    return ShardedCall(x, init_weights(cfg, seed=seed), cfg, cache)


def _forward(call: ShardedCall, weights: MLAWeights, cfg: MLAConfig):
    dtype = resolve_dtype(call.dtype)
    return forward(call.x.to(dtype), cast_floats(weights, dtype), cfg, cast_floats(call.cache, dtype))


def unsharded(call: ShardedCall) -> dict[str, torch.Tensor]:
    """The layer on one process in ``call.dtype``: ``y:[B, T, d]`` and the new cache entries."""
    out = _forward(call, call.weights, call.config)
    return {"y": out.y, "cache": out.entries}


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
    out = _forward(call, w, cfg)
    y = all_reduce(out.y, call.reduce_dtype)
    return {"entries": out.entries, "y sent": out.y, "y": y}

"""KDA sharded over tensor-parallel ranks, as vLLM shards it (docs/model.md §0: 96 heads, 12 per rank at
TP = 8).

:func:`shard` cuts the unsharded layer's weights into rank ``r``'s: its heads' columns of each
head-split segment of the packed projection (``q, k, v, g_out, beta``) beside the replicated
``f_a`` columns, zero-padded again to a multiple of ``pad_to`` (6284 -> 6288 columns at TP = 8);
its heads' rows of the short convolution (conv cache ``[3 h K, W - 1]``: ``[4608, 3]``), of
``W_fb``'s columns, ``a_log`` and ``dt_bias``; its heads' rows of the row-parallel ``W_o``,
whose partial outputs are all-reduced. Each rank keeps its own conv and recurrent state.

:func:`rank_forward` is what a rank runs under :func:`k3verify.harness.tp.run_ranks`;
:func:`unsharded` is the same layer on one process (the fp64 oracle, or the same-dtype
baseline); :func:`make_call` builds the inputs every rank and the parent build alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import all_reduce, cast_floats, resolve_dtype
from .layer import PACKED_ORDER, KDAConfig, KDALayer, KDAWeights, init_weights, local_shapes

# ``ignore_padding``: the padded packed projection cut into equal column ranges, as if it had
# no segments and no padding — the placement bug a test plants to show it is caught.
PLANTS = ("ignore_padding",)


def _head_columns(segment: slice, rank: int, tp: int) -> slice:
    """Rank ``rank``'s share of a head-split segment (contiguous, heads in order)."""
    n = segment.stop - segment.start
    return slice(segment.start + rank * n // tp, segment.start + (rank + 1) * n // tp)


def shard(full: KDAWeights, cfg: KDAConfig, rank: int, tp: int, plant: str | None = None) -> KDAWeights:
    """Rank ``rank`` of ``tp``'s weights from the unsharded ones (``init_weights(cfg, tp=1)``)."""
    everything, mine = local_shapes(cfg, 1), local_shapes(cfg, tp)
    d = full.w_packed.shape[0]
    cols = []
    for name in PACKED_ORDER:
        segment = everything.slices()[name]
        cols.append(full.w_packed[:, segment if name == "f_a" else _head_columns(segment, rank, tp)])
    packed = torch.cat(cols, 1)
    w_packed = torch.zeros(d, mine.padded_columns, dtype=full.w_packed.dtype, device=full.w_packed.device)
    w_packed[:, : packed.shape[1]] = packed
    if plant == "ignore_padding":
        total = full.w_packed.shape[1]
        w_packed = full.w_packed[:, (rank * (total // tp) + torch.arange(mine.padded_columns)) % total]
    width = cfg.heads * cfg.head_dim
    heads = _head_columns(slice(0, width), rank, tp)
    conv = torch.cat([full.conv[_head_columns(slice(i * width, (i + 1) * width), rank, tp)] for i in range(3)])
    return KDAWeights(w_packed=w_packed, w_fb=full.w_fb[:, heads], conv=conv,
                      a_log=full.a_log[_head_columns(slice(0, cfg.heads), rank, tp)],
                      dt_bias=full.dt_bias[heads], norm=full.norm, w_o=full.w_o[heads])  # fmt: skip


@dataclass(frozen=True)
class ShardedCall:
    """What every rank is given: ``x:[B, T, d]``, the unsharded weights and their config (fp64);
    the layer runs in ``dtype`` and the all-reduce sums in ``reduce_dtype``."""

    x: torch.Tensor
    weights: KDAWeights
    config: KDAConfig
    dtype: str = "fp64"
    reduce_dtype: str = "fp64"
    plant: str | None = None


def make_call(size: str, seed: int, world_size: int) -> ShardedCall:
    """``small`` (one 16-wide head per rank, B = 2, T = 70: a full and a partial chunk) or ``k3``
    (the production layer, 96 heads, B = 1, T = 64), from ``seed``."""
    if size == "small":
        cfg, B, T = KDAConfig(hidden=112, heads=world_size, head_dim=16, gate_rank=16), 2, 70
    elif size == "k3":
        cfg, B, T = KDAConfig.production(), 1, 64
    else:
        raise ValueError(f"size must be 'small' or 'k3', got {size!r}")
    x = torch.randn(B, T, cfg.hidden, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return ShardedCall(x, init_weights(cfg, seed=seed), cfg)


def _prefill(call: ShardedCall, weights: KDAWeights, tp: int) -> tuple[torch.Tensor, object]:
    dtype = resolve_dtype(call.dtype)
    return KDALayer(call.config, cast_floats(weights, dtype), tp=tp).prefill(call.x.to(dtype))


def unsharded(call: ShardedCall) -> dict[str, torch.Tensor]:
    """The layer on one process in ``call.dtype``: ``y:[B, T, d]`` and ``final_state:[B, H, K, V]``."""
    y, state = _prefill(call, call.weights, 1)
    return {"y": y, "final_state": state.recurrent}


def rank_forward(rank: int, world_size: int, call: ShardedCall) -> dict[str, torch.Tensor]:
    """One rank's prefill: its heads, its state, the row-parallel output all-reduced.

    Returns its partial output (``y sent``), the all-reduced ``y`` and its state (``conv``,
    ``recurrent``)."""
    mine = shard(call.weights, call.config, rank, world_size, call.plant)
    y_part, state = _prefill(call, mine, world_size)
    y = all_reduce(y_part, call.reduce_dtype)
    return {"y sent": y_part, "y": y, "conv": state.conv, "recurrent": state.recurrent}

"""Stable LatentMoE chunkwise form — permute tokens by expert, grouped matmuls, weighted un-permute.

What a dispatching MoE does (vLLM's fused MoE, expert-parallel all-to-all):

1. the ``T k`` (token, slot) pairs are sorted by expert with a stable sort, so each expert's
   rows are contiguous and in token order (:func:`dispatch`);
2. each expert multiplies its contiguous block of latent rows ``z`` — one code path for any
   load: an expert with no tokens multiplies an empty ``[0, Dl]`` block;
3. every output row is scaled by its mixture weight and added back to its token
   (``index_add``), which sums a token's ``k`` contributions in expert order rather than in
   selection order — the only difference from the recurrent form, a rounding one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import FormOptions, MoEConfig, MoEWeights, Routing
from .layer import glu, layer_output, reference_setup


@dataclass(frozen=True)
class Dispatch:
    """The expert-sorted order of the ``P = T k`` (token, slot) pairs.

    ``order:[P]`` flat pair index (``token k + slot``) of each permuted row; ``token:[P]`` and
    ``expert:[P]`` of each permuted row; ``counts[e]`` rows of expert ``e``; ``offsets[e]`` its
    first row (``offsets[E] = P``).
    """

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    counts: list[int]
    offsets: list[int]


def dispatch(indices: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the pairs of ``indices:[T, k]`` by expert (stable: token order inside an expert)."""
    flat = indices.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return Dispatch(order, order // indices.shape[1], flat[order], counts, offsets)


def chunkwise(
    x: torch.Tensor,
    weights: MoEWeights,
    config: MoEConfig,
    *,
    routing: Routing | None = None,
    tile_m: int = 16,
    tile_k: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
    overflow: str = "nonfinite",
) -> torch.Tensor:
    """Permute, grouped matmuls, weighted un-permute. Arguments as in :mod:`k3verify.moe.inputs`.

    Computes in fp64 for fp64 inputs and in fp32 otherwise; returns ``y:[T, d]`` in ``x``'s
    dtype. The tiling options are validated and unused.
    """
    options = FormOptions(tile_m, tile_k, operand_dtype, fp8_scaling, fp8_static_scale, overflow)
    dims, xw, w, r = reference_setup(x, weights, config, routing, options)
    z = xw @ w.w_latent_down
    d = dispatch(r.indices, dims.E)
    rows = z[d.token]  # [P, Dl], contiguous per expert
    out = torch.empty_like(rows)
    for e in range(dims.E):
        block = slice(d.offsets[e], d.offsets[e + 1])
        out[block] = glu(rows[block], w.w1[e], w.w3[e], w.w2[e], config)
    weighted = out * r.weights.reshape(-1)[d.order, None]
    u = torch.zeros(dims.T, dims.Dl, dtype=xw.dtype, device=x.device).index_add_(0, d.token, weighted)
    return layer_output(u, xw, w, config).to(x.dtype)

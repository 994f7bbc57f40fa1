"""Stable LatentMoE chunkwise form — permute tokens by expert, grouped matmuls, weighted un-permute.

What a dispatching MoE does (vLLM's fused MoE, expert-parallel all-to-all):

1. the ``T k`` (token, slot) pairs are sorted by expert with a stable sort, so each expert's
   rows are contiguous and in token order (:func:`dispatch`);
2. each expert multiplies its contiguous block of latent rows ``z`` — one code path for any
   load: an expert with no tokens multiplies an empty ``[0, Dl]`` block;
3. every output row is scaled by its mixture weight and added back to its token
   (:func:`token_sums`), which sums a token's ``k`` contributions in expert order rather than in
   selection order — the only difference from the recurrent form, a rounding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from ..numerics import compute_dtype
from ..numerics.ops import rms_norm, rms_norm_backward
from .inputs import FormOptions, MoEConfig, MoEWeights, Routing, check_backward
from .layer import glu, layer_output, reference_setup
from .quantize import Caster
from .recurrent import GRADIENTS
from .router import mixture
from .situ import activation, activation_backward

GEMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


@dataclass(frozen=True)
class SortedPairs:
    """The expert-sorted order of the ``P = T k`` (token, slot) pairs, all on the indices' device:
    ``order:[P]``, ``token:[P]`` and ``expert:[P]`` (int64) as in :class:`Dispatch`,
    ``offsets:[E + 1]`` (int32) each expert's first row (``offsets[E] = P``). Made without the
    host waiting on the device."""

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    offsets: torch.Tensor


def sort_pairs(indices: torch.Tensor, num_experts: int) -> SortedPairs:
    """The pairs of ``indices:[T, k]`` (every index in ``[0, num_experts)``, checked by the
    caller) sorted by expert, stable (token order inside an expert), each expert's first row
    found in the sorted experts by a binary search: no value is read back to the host (on a
    CUDA device ``bincount`` reads the indices' extremes back, two waits) and no atomics."""
    flat = indices.reshape(-1).to(torch.int64)
    experts, order = torch.sort(flat, stable=True)
    starts = torch.arange(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets = torch.searchsorted(experts, starts).to(torch.int32)
    return SortedPairs(order, order // indices.shape[1], experts, offsets)


def dispatch(indices: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the pairs of ``indices:[T, k]`` by expert (stable: token order inside an expert),
    with the counts on the host (:func:`sort_pairs` and one wait for its offsets)."""
    s = sort_pairs(indices, num_experts)
    offsets = s.offsets.tolist()
    counts = [b - a for a, b in pairwise(offsets)]
    return Dispatch(s.order, s.token, s.expert, counts, offsets)


def token_sums(rows: torch.Tensor, d: Dispatch, num_tokens: int) -> torch.Tensor:
    """Each token's sum of its permuted ``rows:[P, n]`` in dispatch (expert) order: ``[T, n]``
    in ``rows``' dtype, ``P = T k``.

    The rows are added one after another from zero, as ``index_add_`` does on the host (the same
    bits there), but in a fixed order on every device: ``index_add_`` on a CUDA device adds with
    atomics, whose order — and so the last bits of an fp64 sum — changes from run to run, and a
    bit-for-bit check (``page_placement``) cannot rely on it.
    """
    total = torch.zeros(num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    if not num_tokens:
        return total
    k = rows.shape[0] // num_tokens
    grouped = rows[torch.sort(d.token, stable=True).indices].reshape(num_tokens, k, -1)
    for slot in range(k):  # one addition at a time: a reduction over the slots may pair them
        total = total + grouped[:, slot]
    return total


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
        if d.counts[e]:  # an expert no token chose has no rows to compute
            block = slice(d.offsets[e], d.offsets[e + 1])
            out[block] = glu(rows[block], w.w1[e], w.w3[e], w.w2[e], config)
    weighted = out * r.weights.reshape(-1)[d.order, None]
    u = token_sums(weighted, d, dims.T)
    return layer_output(u, xw, w, config).to(x.dtype)


def chunkwise_backward(
    x: torch.Tensor,
    weights: MoEWeights,
    config: MoEConfig,
    *,
    dy: torch.Tensor,
    indices: torch.Tensor,
    tile_m: int = 16,
    tile_k: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    fp8_scaling: str = "per_row",
    fp8_static_scale: float = 1.0,
    overflow: str = "nonfinite",
    **pieces: Callable[..., Any],
) -> dict[str, torch.Tensor]:
    """The hand-written backward of ``L = sum(y * dy)`` on the forward's selection
    ``indices:[T, k]`` (:func:`backward_pass`), exact in the compute dtype: fp64 for fp64 inputs,
    fp32 otherwise. Returns :data:`~k3verify.moe.recurrent.GRADIENTS` by name, each of its
    input's shape, in the compute dtype. The tiling options are validated and unused; ``pieces``
    go to :func:`backward_pass` (``act_grad``, ``norm_grad``)."""
    FormOptions(tile_m, tile_k, operand_dtype, fp8_scaling, fp8_static_scale, overflow)
    check_backward(x, weights, config, dy, indices)
    dtype = compute_dtype(x.dtype)
    return backward_pass(x, weights, config, dy, indices, Caster.make(FormOptions(operand_dtype=dtype)), torch.matmul,
                         **pieces)


def backward_pass(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, dy: torch.Tensor, indices: torch.Tensor,
                  cast: Caster, mm: GEMM, *, act_grad: Callable[..., Any] = activation_backward,
                  norm_grad: Callable[..., torch.Tensor] = rms_norm_backward) -> dict[str, torch.Tensor]:
    """The backward as a dispatching kernel computes it, every stored tensor through ``cast``
    (GEMM operands in the operand dtype, results in the output dtype; exact when that is the
    accumulator) and every GEMM through ``mm`` (``a @ b`` or a K loop).

    Forward recomputation: the router (fp32, on ``x`` as the layer holds it: the operand), ``z``, each
    expert's ``G, U`` (accumulators), hidden ``H`` (operand), output ``E_j`` (accumulator),
    ``u`` and the RMSNorm. Backward, with ``du`` the latent's gradient:
    ``dE = p du``, ``dp = <du, E_j>``, ``dW2_e = H_eᵀ dE_e``, ``dH = dE W2_eᵀ``,
    ``dG, dU = act'(G, U) dH``, ``dW1_e = Z_eᵀ dG_e``, ``dW3_e = Z_eᵀ dU_e`` (grouped GEMMs with
    transposed operands), ``dz = Σ (dG W1ᵀ + dU W3ᵀ)`` over a token's pairs, ``dW↓ = xᵀ dz``;
    the router's ``ds_i = (ρ dp_i − Σ_j p_j dp_j) / (Σ_I s + ε)`` and ``dr = ds σ'``.
    ``act_grad`` and ``norm_grad`` are the activation's and the RMSNorm's backward (a planted bug
    replaces one: :mod:`k3verify.harness.selftest`). Returns the gradients in the accumulator dtype.
    """
    acc = cast.opts.accumulator
    T, k, E = indices.shape[0], cfg.top_k, cfg.num_experts
    xo = cast.operand("input x", x)
    # The router reads the layer input as the layer holds it (xo), in the accumulator.
    scores, p = mixture(xo, weights.w_router, indices, cfg, acc)
    w = {n: cast.operand(f"weight {n}", t, weight=True) for n, t in weights.tensors().items()
         if n not in ("bias", "latent_norm", "w_router")}
    gamma = cast.output("weight latent_norm γ", weights.latent_norm)

    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return activation(g, u, cfg.activation, beta1=cfg.beta1, beta2=cfg.beta2)

    def act_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return act_grad(g, u, dh, cfg.activation, beta1=cfg.beta1, beta2=cfg.beta2)

    z = cast.operand("latent z = x W↓ (dispatch payload)", mm(xo, w["w_latent_down"]))
    d = dispatch(indices, E)
    blocks = [slice(d.offsets[e], d.offsets[e + 1]) for e in range(E)]
    zr, pair_p = z[d.token], p.reshape(-1)[d.order]  # [P, Dl], [P]
    g = torch.cat([mm(zr[b], w["w1"][e]) for e, b in enumerate(blocks)])
    u = torch.cat([mm(zr[b], w["w3"][e]) for e, b in enumerate(blocks)])
    h = cast.operand("expert hidden h = act(g, u)", act(g, u))
    out = torch.cat([mm(h[b], w["w2"][e]) for e, b in enumerate(blocks)])  # E_j, the accumulator
    pairs = torch.zeros(T * k, cfg.latent_size, dtype=acc, device=x.device)
    pairs[d.order] = cast.output("weighted expert output p·E_j", out * pair_p[:, None])
    lat = cast.output("latent u = Σ p_j E_j", pairs.reshape(T, k, -1).sum(1))
    rstd = torch.rsqrt((lat * lat).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    n = lat * rstd
    normed = cast.operand("normalised latent RMSNorm(u)", rms_norm(lat, gamma, eps=cfg.rms_norm_eps))
    gs, us = mm(xo, w["shared_w1"]), mm(xo, w["shared_w3"])
    hs = cast.operand("shared hidden", act(gs, us))

    dyo = cast.operand("upstream gradient dy", dy)
    grads = {"dw_latent_up": cast.output("gradient dW↑", mm(normed.T, dyo))}
    dnormed = cast.operand("gradient of the normalised latent", mm(dyo, w["w_latent_up"].T))
    grads["dlatent_norm"] = cast.output("gradient dγ", (dnormed * n).sum(0))
    dn = dnormed * gamma
    du = cast.operand("gradient of the latent du", norm_grad(n, rstd, dn))
    dpair = du[d.token]
    dp = (dpair * out).sum(-1)  # [P], in the accumulator (a kernel's epilogue)
    de = cast.operand("gradient of an expert's output p·du", dpair * pair_p[:, None])
    grads["dw2"] = cast.output("gradient dW2", torch.stack([mm(h[b].T, de[b]) for b in blocks]))
    dh = torch.cat([mm(de[b], w["w2"][e].T) for e, b in enumerate(blocks)])
    dg, du_ = act_backward(g, u, dh)
    dg, du_ = cast.operand("gradient dG", dg), cast.operand("gradient dU", du_)
    grads["dw1"] = cast.output("gradient dW1", torch.stack([mm(zr[b].T, dg[b]) for b in blocks]))
    grads["dw3"] = cast.output("gradient dW3", torch.stack([mm(zr[b].T, du_[b]) for b in blocks]))
    dzr = torch.cat([mm(dg[b], w["w1"][e].T) + mm(du_[b], w["w3"][e].T) for e, b in enumerate(blocks)])
    dz = cast.operand("gradient dz", token_sums(dzr, d, T))
    grads["dw_latent_down"] = cast.output("gradient dW↓", mm(xo.T, dz))
    dx = mm(dz, w["w_latent_down"].T)

    dgs, dus = act_backward(gs, us, mm(dyo, w["shared_w2"].T))
    dgs, dus = cast.operand("gradient of the shared G", dgs), cast.operand("gradient of the shared U", dus)
    grads["dshared_w2"] = cast.output("gradient dS2", mm(hs.T, dyo))
    grads["dshared_w1"] = cast.output("gradient dS1", mm(xo.T, dgs))
    grads["dshared_w3"] = cast.output("gradient dS3", mm(xo.T, dus))
    dx = dx + mm(dgs, w["shared_w1"].T) + mm(dus, w["shared_w3"].T)

    # The router, in the accumulator (the FP32 router of docs/model.md §4).
    dpt = torch.empty_like(pair_p)
    dpt[d.order] = dp
    dpt = dpt.reshape(T, k)
    denom = torch.gather(scores, -1, indices).sum(-1, keepdim=True) + cfg.renorm_eps
    ds = (cfg.routed_scaling_factor * dpt - (dpt * p).sum(-1, keepdim=True)) / denom
    dr = torch.zeros_like(scores).scatter_(-1, indices, ds) * scores * (1 - scores)
    grads["dw_router"] = xo.T @ dr
    grads["dx"] = cast.output("gradient dx", dx + dr @ weights.w_router.to(acc).T)
    return {name: grads[name] for name in GRADIENTS}

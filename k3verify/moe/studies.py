"""Stable LatentMoE studies: curves beside the overflow map, as plain JSON-ready dicts.

``routing_flips`` (written as ``moe_routing_flips.json``): how many expert choices the
production-size router changes when its logits are bf16 instead of fp32 (docs/model.md §4) (and, on a CUDA
device, with our Triton router), each against fp64, at every input scale of the overflow map,
and the error in ``y`` those choices cause. The map itself routes every cell with the fp64
oracle's choices (its error is the arithmetic's); this is the part that routing adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from . import kernels
from .balancing import quantile_balancing
from .inputs import MoEConfig, MoEWeights, Routing
from .layer import glu, init_weights, latent_output, shared_output
from .router import changed_choices, mixture_weights, router_logits, select
from .samples import log2_scale_grid

# Only logits are needed for the choices, so the production router's sizes are affordable on a
# CPU; the error they cause in y is measured through small experts behind that router (what a
# changed choice costs is an expert's contribution, whatever its width).
FLIP_CONFIG = MoEConfig.production()
FLIP_EXPERTS = dict(latent_size=64, expert_hidden=32, num_shared_experts=2)
FLIP_TOKENS, QUICK_FLIP_TOKENS = 1024, 256
Y_TOKENS = 64  # the first tokens' y: what a changed choice costs needs no more


def _routed_latent(z: torch.Tensor, w: MoEWeights, cfg: MoEConfig, routing: Routing) -> torch.Tensor:
    """``u = Σ_j p_j E_j(z)`` of ``z:[T, Dl]`` (fp64) with every token's own experts gathered at
    once (small experts: ``[T, k, Dl, H]`` fits), in the recurrent form's slot order."""
    i = routing.indices[: z.shape[0]]
    out = glu(z[:, None, None, :], w.w1[i], w.w3[i], w.w2[i], cfg)[:, :, 0]  # [T, k, Dl]
    return (routing.weights[: z.shape[0], :, None].to(z.dtype) * out).sum(1)


def routing_flips(seed: int = 0, *, exponents: Sequence[float] | None = None,
                  tokens: int = FLIP_TOKENS) -> dict[str, Any]:
    """Changed expert choices of the production-size router (d 7168, 896 experts, top 16) at
    each input scale ``2^e`` (``exponents``; the full map's grid by default): bf16 logits vs the
    spec's fp32 logits, and each vs fp64.

    Logits of ``2^e x`` are ``2^e`` times those of ``x`` exactly in every dtype here (scaling by a
    power of two is exact and commutes with rounding), so one GEMM per dtype serves all scales.
    The bias is trained by Quantile Balancing on ``tokens`` unit-scale tokens. On a CUDA device
    our Triton router (``kernel``) is compared too. ``<router>_y_error`` is the relative RMS error
    of ``y`` computed in fp64 with that router's choices and weights against ``y`` with the fp64
    router's, over the first :data:`Y_TOKENS` tokens, the experts small (:data:`FLIP_EXPERTS`).
    Returns ``{"router", "definition", "by_scale": [{"log2_input_scale", "<a>_vs_<b>":
    {"changed_pairs", "changed_tokens"}, "<router>_y_error"}]}`` (the keys the HTML report reads).
    """
    cfg = FLIP_CONFIG
    grid = list(exponents) if exponents is not None else log2_scale_grid(quick=False)
    gen = torch.Generator().manual_seed(seed + 11)
    w_router = torch.randn(cfg.hidden_size, cfg.num_experts, generator=gen, dtype=torch.float64)
    w_router *= cfg.hidden_size**-0.5
    calib = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
    bias = quantile_balancing(torch.sigmoid(calib @ w_router), torch.zeros(cfg.num_experts, dtype=torch.float64),
                              cfg.top_k)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
    l64 = router_logits(x, w_router, cfg)
    l32 = router_logits(x.float(), w_router.float(), cfg)
    lbf = router_logits(x.float(), w_router.float(), dataclasses.replace(cfg, logits_dtype="bf16"))
    small = dataclasses.replace(cfg, **FLIP_EXPERTS)
    weights = dataclasses.replace(init_weights(small, seed=seed + 12), w_router=w_router, bias=bias)
    on_gpu = torch.cuda.is_available() and kernels.unavailable_reason() is None
    rows = []
    for e in grid:
        s = 2.0**e
        routings = {}
        for n, logits in (("fp64", l64), ("fp32", l32), ("bf16", lbf)):
            scores = torch.sigmoid(logits * s)
            chosen = select(scores, bias.to(logits.dtype), cfg.top_k, cfg.tie_break)
            routings[n] = Routing(chosen, mixture_weights(scores, chosen, cfg))
        if on_gpu:
            r = kernels.route((x * s).float().cuda(), w_router.float().cuda(), bias.float().cuda(), cfg)
            routings["kernel"] = Routing(r.indices.cpu(), r.weights.cpu())
        picks = {n: r.indices for n, r in routings.items()}
        row: dict[str, Any] = {"log2_input_scale": e}
        for a, b in (("bf16", "fp32"), ("bf16", "fp64"), ("fp32", "fp64"), ("kernel", "fp64")):
            if a in picks:
                pairs, toks = changed_choices(picks[a], picks[b])
                row[f"{a}_vs_{b}"] = {"changed_pairs": pairs, "changed_tokens": toks}
        xs = x[:Y_TOKENS] * s
        z, shared = xs @ weights.w_latent_down, shared_output(xs, weights, small)
        y = {n: latent_output(_routed_latent(z, weights, small, r), weights, small) + shared
             for n, r in routings.items()}  # fmt: skip
        for n in routings:
            if n != "fp64":
                row[f"{n}_y_error"] = float((y[n] - y["fp64"]).norm() / y["fp64"].norm())
        rows.append(row)
    return {
        "title": "Stable LatentMoE: routing flips",
        "router": {"hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                   "tokens": tokens, "tie_break": cfg.tie_break},
        "definition": "changed_pairs: fraction of selected (token, expert) pairs the other router did not select; "
                      "changed_tokens: fraction of tokens with any changed choice; <router>_y_error: relative "
                      "RMS error of y (fp64 arithmetic, small experts) with that router's choices and weights "
                      "against the fp64 router's",
        "by_scale": rows,
    }

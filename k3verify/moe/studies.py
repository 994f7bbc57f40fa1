"""Stable LatentMoE studies: curves beside the overflow map, as plain JSON-ready dicts.

``routing_flips`` (written as ``moe_routing_flips.json``): how many expert choices the
production-size router changes when its logits are bf16 instead of SPEC's fp32, and each
against fp64, at every input scale of the overflow map. The map itself routes every cell with
the fp64 oracle's choices (its error is the arithmetic's); this is the part that routing adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .balancing import quantile_balancing
from .inputs import MoEConfig
from .router import changed_choices, router_logits, select
from .samples import log2_scale_grid

# Only logits are needed, so the production router's sizes are affordable on a CPU.
FLIP_CONFIG = MoEConfig.production()
FLIP_TOKENS, QUICK_FLIP_TOKENS = 1024, 256


def routing_flips(seed: int = 0, *, exponents: Sequence[float] | None = None,
                  tokens: int = FLIP_TOKENS) -> dict[str, Any]:
    """Changed expert choices of the production-size router (d 7168, 896 experts, top 16) at
    each input scale ``2^e`` (``exponents``; the full map's grid by default): bf16 logits vs the
    spec's fp32 logits, and each vs fp64.

    Logits of ``2^e x`` are ``2^e`` times those of ``x`` exactly in every dtype here (scaling by a
    power of two is exact and commutes with rounding), so one GEMM per dtype serves all scales.
    The bias is trained by Quantile Balancing on ``tokens`` unit-scale tokens. Returns
    ``{"router", "definition", "by_scale": [{"log2_input_scale", "<a>_vs_<b>": {"changed_pairs",
    "changed_tokens"}}]}`` (the keys the HTML report reads).
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
    rows = []
    for e in grid:
        s = 2.0**e
        picks = {n: select(torch.sigmoid(logits * s), bias.to(logits.dtype), cfg.top_k, cfg.tie_break)
                 for n, logits in (("fp64", l64), ("fp32", l32), ("bf16", lbf))}
        row: dict[str, Any] = {"log2_input_scale": e}
        for a, b in (("bf16", "fp32"), ("bf16", "fp64"), ("fp32", "fp64")):
            pairs, toks = changed_choices(picks[a], picks[b])
            row[f"{a}_vs_{b}"] = {"changed_pairs": pairs, "changed_tokens": toks}
        rows.append(row)
    return {
        "title": "Stable LatentMoE: routing flips",
        "router": {"hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                   "tokens": tokens, "tie_break": cfg.tie_break},
        "definition": "changed_pairs: fraction of selected (token, expert) pairs the other router did not select; "
                      "changed_tokens: fraction of tokens with any changed choice",
        "by_scale": rows,
    }

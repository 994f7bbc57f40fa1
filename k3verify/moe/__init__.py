"""Stable LatentMoE: every form of docs/model.md §4 in one common signature, and its overflow model.

``from k3verify.moe import recurrent, chunkwise, tiled`` gives the per-token definition (the
fp64 oracle), the expert-sorted dispatch with grouped matmuls, and the grouped-GEMM kernel with
low-precision operands. All take ``(x, weights, config, *, routing=None, tile_m, tile_k,
operand_dtype, fp8_scaling, fp8_static_scale, overflow)`` — see :mod:`k3verify.moe.inputs`.
``overflow_quantities``, ``predict`` and ``explain_overflow`` are the overflow model under the
names every module package gives them; :mod:`k3verify.moe.samples` makes the verification
inputs and :mod:`k3verify.moe.studies` the routing-flips study.
"""

from .balancing import expert_load, imbalance, quantile_balancing, quantile_thresholds
from .chunkwise import Dispatch, chunkwise, dispatch
from .inputs import ACTIVATIONS, FP8_SCALINGS, TIE_BREAKS, FormOptions, MoEConfig, MoEWeights, Routing
from .layer import active_parameters, forward, init_weights, parameter_counts
from .recurrent import naive_baseline, recurrent
from .router import changed_choices, mixture_weights, route, router_logits, routing_for, select, topk_gap
from .situ import situ, situ_gate, swiglu
from .tiled import (
    OverflowPrediction,
    OverflowQuantities,
    explain_overflow,
    overflow_events,
    overflow_quantities,
    predict,
    tiled,
    tiled_traced,
)

__all__ = [
    "ACTIVATIONS",
    "FP8_SCALINGS",
    "TIE_BREAKS",
    "Dispatch",
    "FormOptions",
    "MoEConfig",
    "MoEWeights",
    "OverflowPrediction",
    "OverflowQuantities",
    "Routing",
    "active_parameters",
    "changed_choices",
    "chunkwise",
    "dispatch",
    "expert_load",
    "explain_overflow",
    "forward",
    "imbalance",
    "init_weights",
    "mixture_weights",
    "naive_baseline",
    "overflow_events",
    "overflow_quantities",
    "parameter_counts",
    "predict",
    "quantile_balancing",
    "quantile_thresholds",
    "recurrent",
    "route",
    "router_logits",
    "routing_for",
    "select",
    "situ",
    "situ_gate",
    "swiglu",
    "tiled",
    "tiled_traced",
    "topk_gap",
]

"""Kimi Delta Attention: every form of docs/model.md §1 with the fla-core argument layout, and its
overflow model (``overflow_quantities``, ``predict``, ``explain_overflow``: the names every
module package gives them)."""

from .chunkwise import chunkwise, naive_chunk_baseline
from .gate import beta_gate, l2norm, lower_bound_gate, softplus_gate
from .recurrent import naive_baseline, recurrent
from .tiled import (
    OverflowPrediction,
    OverflowQuantities,
    explain_overflow,
    explain_underflow,
    overflow_events,
    overflow_quantities,
    predict,
    tiled,
)

__all__ = [
    "OverflowPrediction",
    "OverflowQuantities",
    "beta_gate",
    "chunkwise",
    "explain_overflow",
    "explain_underflow",
    "l2norm",
    "lower_bound_gate",
    "naive_baseline",
    "naive_chunk_baseline",
    "overflow_events",
    "overflow_quantities",
    "predict",
    "recurrent",
    "softplus_gate",
    "tiled",
]

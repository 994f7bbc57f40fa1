"""Kimi Delta Attention: every form of SPEC §1 with the fla-core argument layout."""

from .chunkwise import chunkwise, naive_chunk_baseline
from .gate import beta_gate, l2norm, lower_bound_gate, softplus_gate
from .recurrent import naive_baseline, recurrent
from .tiled import explain_overflow, tiled

__all__ = [
    "beta_gate",
    "chunkwise",
    "explain_overflow",
    "l2norm",
    "lower_bound_gate",
    "naive_baseline",
    "naive_chunk_baseline",
    "recurrent",
    "softplus_gate",
    "tiled",
]

"""Gated MLA: every form of docs/model.md §2 over one paged latent cache, in one common signature.

``from k3verify.mla import recurrent, chunkwise, tiled`` gives the absorbed decode, the
expanded chunked prefill and the FlashMLA-style tiled kernel; ``expanded`` is the definition
(the fp64 oracle) and ``naive_baseline`` the same-dtype baseline of the tolerance policy. All
take ``(q_nope, q_pe, cache, w_uk, w_uv, *, scale, chunk_size, tile, operand_dtype, num_splits,
subtract_max, overflow)`` — see :mod:`k3verify.mla.inputs`. The overflow model has the names
every module package gives it: ``overflow_quantities``, ``predict`` and ``explain_overflow``;
:mod:`k3verify.mla.samples` makes the verification inputs.
"""

from .cache import (
    LatentCache,
    allocate,
    append,
    build,
    gather,
    live_entries,
    quantize,
    quantize_entries,
    release,
    split_entry,
)
from .chunkwise import chunkwise
from .layer import MLAConfig, MLAWeights, forward, init_weights, shard
from .recurrent import absorb_output, absorb_query, recurrent
from .reference import expand, expanded, naive_baseline
from .softmax import merge_partials, partial_attention
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
    "LatentCache",
    "MLAConfig",
    "MLAWeights",
    "OverflowPrediction",
    "OverflowQuantities",
    "absorb_output",
    "absorb_query",
    "allocate",
    "append",
    "build",
    "chunkwise",
    "expand",
    "expanded",
    "explain_overflow",
    "forward",
    "gather",
    "init_weights",
    "live_entries",
    "merge_partials",
    "naive_baseline",
    "overflow_events",
    "overflow_quantities",
    "partial_attention",
    "predict",
    "quantize",
    "quantize_entries",
    "recurrent",
    "release",
    "shard",
    "split_entry",
    "tiled",
    "tiled_traced",
]

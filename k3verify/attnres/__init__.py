"""Block AttnRes: every form of docs/model.md §3 at two levels, in one signature per level.

``from k3verify.attnres import recurrent, chunkwise, tiled`` gives the depth walk by definition
(explicit source lists, one-shot softmax), with two-phase computation per block, and with a tiled
online softmax over a low-precision stream; each takes ``(embedding, weights, sublayers, *,
schedule, stream_dtype, logit_dtype, tile, subtract_max, eps)`` and returns a :class:`Walk`.
One AttnRes call on its own is ``aggregate`` (the definition, the fp64 oracle),
``aggregate_two_phase`` and ``aggregate_tiled``, each ``(sources, w, gamma, *, <same options>)``.
``naive_baseline`` / ``naive_walk`` are the same-dtype baselines of the tolerance policy.
The overflow model (``overflow_quantities``, ``predict``, ``explain_overflow``: the names every
module package gives them) takes either level's positional arguments. Inputs are made in
:mod:`k3verify.attnres.samples`, the depth-drift curve in :mod:`k3verify.attnres.studies`.
"""

from .chunkwise import _ChunkwiseMixer, aggregate_two_phase, chunkwise, merge, mix_two_phase, phase1
from .inputs import Options
from .layer import AttnResWeights, DepthWalk, StandInSublayers, Walk, init_weights
from .recurrent import _RecurrentMixer, aggregate, keys, logits, mix, naive_baseline, naive_walk, recurrent
from .schedule import Call, Schedule, Source
from .tiled import (
    OverflowPrediction,
    OverflowQuantities,
    WalkOverflowQuantities,
    _TiledMixer,
    aggregate_tiled,
    aggregate_tiled_traced,
    explain_logit_rounding,
    explain_overflow,
    online_mix,
    overflow_quantities,
    predict,
    tiled,
)

AGGREGATIONS = {"recurrent": aggregate, "chunkwise": aggregate_two_phase, "tiled": aggregate_tiled}
WALKS = {"recurrent": recurrent, "chunkwise": chunkwise, "tiled": tiled}
# The mixer of each walk form, for a caller that drives the walk itself (:class:`DepthWalk`).
MIXERS = {"recurrent": _RecurrentMixer, "chunkwise": _ChunkwiseMixer, "tiled": _TiledMixer}

__all__ = [
    "AGGREGATIONS",
    "MIXERS",
    "WALKS",
    "AttnResWeights",
    "Call",
    "DepthWalk",
    "Options",
    "OverflowPrediction",
    "OverflowQuantities",
    "Schedule",
    "Source",
    "StandInSublayers",
    "Walk",
    "WalkOverflowQuantities",
    "aggregate",
    "aggregate_tiled",
    "aggregate_tiled_traced",
    "aggregate_two_phase",
    "chunkwise",
    "explain_logit_rounding",
    "explain_overflow",
    "init_weights",
    "keys",
    "logits",
    "merge",
    "mix",
    "mix_two_phase",
    "naive_baseline",
    "naive_walk",
    "online_mix",
    "overflow_quantities",
    "phase1",
    "predict",
    "recurrent",
    "tiled",
]

"""Block AttnRes studies: curves beside the overflow map, as plain JSON-ready documents.

``DEPTH_DRIFT_FILE`` (``attnres_depth_drift.json``) is :func:`depth_drift`: how the error of
every call's mixture grows along the 93-layer walk in a bf16 stream against an fp32 one. The
report reads it from the maps folder, shows it under its ``title`` and draws every ``error_*``
list against ``layers``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..numerics import compare
from .recurrent import naive_walk, recurrent
from .samples import WALK, walk_inputs
from .schedule import Schedule

DEPTH_DRIFT_FILE = "attnres_depth_drift.json"


# A walk to draw beside the forms: (embedding, weights, sublayers, schedule) of the walk case in
# fp64 -> h:[calls, T, d] (each walk casts the inputs to its own stream).
WalkCurve = Callable[..., torch.Tensor]


def depth_drift(seed: int = 0, quick: bool = False, *, schedule: Schedule | None = None,
                walks: Mapping[str, WalkCurve] | None = None) -> dict[str, Any]:  # fmt: skip
    """Error of every call's AttnRes output against depth over the full walk, bf16 vs fp32 stream.

    The ``walk`` case's inputs (bf16-representable, so both runs start from the oracle's exact
    inputs) run through the recurrent definition in fp64 (the reference), with an fp32 stream and
    with a bf16 stream (fp32 softmax in both), and through the plain bf16 implementation. Each
    entry is ``rms(h_s − h_s^ref) / rms(h_s^ref)`` of call ``s`` (``layers``: its 1-indexed layer;
    ``sublayer``: ``attn``, ``mlp`` or ``output``); ``sources`` is how many sources it mixed.
    The walk is narrow (``d = 64``, 8 tokens) and takes seconds, so ``quick`` (what a quick map
    asks for) makes the same curve. ``walks`` adds one curve ``error_<name>`` per named walk (the
    registry entry passes the kernels that can run here).
    """
    schedule = schedule or Schedule()
    x = walk_inputs(schedule, **WALK, seed=seed)
    args = (x["embedding"], x["weights"], x["sublayers"])
    ref = recurrent(*args, schedule=schedule).h

    def errors(h: torch.Tensor) -> list[float]:
        return [compare(h[s], ref[s], ulp_dtype="fp32").rms_ratio for s in range(len(ref))]

    calls = schedule.calls()
    extra = {f"error_{name}": errors(walk(*args, schedule).detach().cpu().double())
             for name, walk in (walks or {}).items()}  # fmt: skip
    return {
        "title": "Block AttnRes: error against depth",
        "layers": [c.layer + 1 for c in calls],
        "sublayer": [c.side for c in calls],
        "error_bf16": errors(recurrent(*args, schedule=schedule, stream_dtype="bf16").h),
        "error_fp32": errors(recurrent(*args, schedule=schedule, stream_dtype="fp32").h),
        "error_bf16_naive": errors(naive_walk(*args, dtype="bf16", schedule=schedule).h),
        **extra,
        "metric": "rms_ratio",
        "sources": [len(c.sources) for c in calls],
        "setup": {**WALK, "num_layers": schedule.num_layers, "block_sublayers": schedule.block_sublayers,
                  "seed": seed, "form": "recurrent (definition); error_bf16_naive: plain bf16 implementation",
                  "reference": "recurrent in fp64"},
    }


# File name -> study(seed, quick) -> JSON-ready document.
STUDIES = {DEPTH_DRIFT_FILE: depth_drift}

"""The Kimi K3 decoder stack composed from the four modules' layers (docs/decoder.md): the layer
schedule, serving state, precision plans, serving scenarios, precision walks, attribution and
the first-divergence search."""

from .config import ATTNRES, DENSE, KDA, MLA, MODULES, MOE, DecoderConfig
from .model import (
    AttnResForm,
    Decoder,
    Form,
    Pass,
    Plan,
    ServingState,
    fp64_plan,
    kernel_plan,
    naive_plan,
    only,
    tiled_plan,
)
from .weights import DecoderWeights, init_weights

__all__ = [
    "ATTNRES",
    "DENSE",
    "KDA",
    "MLA",
    "MODULES",
    "MOE",
    "AttnResForm",
    "Decoder",
    "DecoderConfig",
    "DecoderWeights",
    "Form",
    "Pass",
    "Plan",
    "ServingState",
    "fp64_plan",
    "init_weights",
    "kernel_plan",
    "naive_plan",
    "only",
    "tiled_plan",
]

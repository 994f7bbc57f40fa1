"""Hypothesis strategies for Block AttnRes: single aggregations and whole depth walks.

Sizes are drawn directly (they shrink toward one source, one token, width 1, one layer, block
size 1); tensor values come from a drawn seed, so a failing example replays exactly from its
printed ``make_*`` call. Aggregations use :func:`k3verify.attnres.samples.controlled_sources`, whose
largest logit per token equals the drawn logit scale ``‖w⊙γ‖·sqrt(d)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import strategies as st

from k3verify import attnres
from k3verify.attnres.samples import controlled_sources, walk_inputs
from k3verify.harness.environment import one_thread as single_thread

# Every form of one aggregation, with the options that make it what it is.
FORMS = {
    "recurrent": (attnres.aggregate, {}),
    "chunkwise": (attnres.aggregate_two_phase, {}),
    "tiled tile=1": (attnres.aggregate_tiled, {"tile": 1}),
    "tiled tile=3": (attnres.aggregate_tiled, {"tile": 3}),
    "tiled no-max": (attnres.aggregate_tiled, {"tile": 2, "subtract_max": False}),
}
MAX_SUBTRACTING = tuple(name for name, (_, opts) in FORMS.items() if opts.get("subtract_max", True))
STREAMS = ("fp64", "fp32", "bf16", "fp16")


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only spins (4x slower on a busy 2-core box)."""
    with single_thread():
        yield


@dataclass
class Aggregation:
    """One drawn AttnRes call: fp64 ``sources:[N, T, d]``, ``w, gamma:[d]``."""

    N: int
    T: int
    d: int
    seed: int
    logit_scale: float
    sources: torch.Tensor = field(repr=False)
    w: torch.Tensor = field(repr=False)
    gamma: torch.Tensor = field(repr=False)

    def __repr__(self) -> str:
        return f"make_aggregation({self.N}, {self.T}, {self.d}, seed={self.seed}, logit_scale={self.logit_scale!r})"

    @property
    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sources, self.w, self.gamma


def make_aggregation(N: int = 3, T: int = 2, d: int = 8, *, seed: int = 0, logit_scale: float = 4.0) -> Aggregation:
    """A problem built directly (for pinned examples and plain tests)."""
    x = controlled_sources(N, T, d, logit_scale=logit_scale, seed=seed)
    return Aggregation(N, T, d, seed, logit_scale, x["sources"], x["w"], x["gamma"])


@st.composite
def aggregations(
    draw: st.DrawFn,
    *,
    max_N: int = 12,
    min_T: int = 1,
    max_T: int = 4,
    widths: tuple[int, ...] = (1, 2, 3, 8, 16),
    logit_scale: st.SearchStrategy[float] | None = None,
) -> Aggregation:
    N = draw(st.integers(1, max_N))
    T = draw(st.integers(min_T, max_T))
    d = draw(st.sampled_from(widths))
    seed = draw(st.integers(0, 2**16))
    scale = draw(logit_scale if logit_scale is not None else st.floats(0.25, 40.0))
    return make_aggregation(N, T, d, seed=seed, logit_scale=scale)


@dataclass
class WalkProblem:
    """A drawn depth walk: ``num_layers`` layers in blocks of ``block_sublayers`` sublayers."""

    num_layers: int
    block_sublayers: int
    d: int
    T: int
    seed: int
    logit_scale: float
    inputs: dict = field(repr=False)

    def __repr__(self) -> str:
        return (f"make_walk({self.num_layers}, {self.block_sublayers}, d={self.d}, T={self.T}, seed={self.seed}, "
                f"logit_scale={self.logit_scale!r})")

    @property
    def schedule(self) -> attnres.Schedule:
        return self.inputs["schedule"]

    def run(self, form: str = "recurrent", **opts) -> attnres.Walk:
        x = self.inputs
        return attnres.WALKS[form](x["embedding"], x["weights"], x["sublayers"], schedule=x["schedule"], **opts)


def make_walk(num_layers: int = 3, block_sublayers: int = 2, *, d: int = 8, T: int = 2, seed: int = 0,
              logit_scale: float = 4.0) -> WalkProblem:
    schedule = attnres.Schedule(num_layers, block_sublayers)
    inputs = walk_inputs(schedule, T=T, d=d, logit_scale=logit_scale, seed=seed)
    return WalkProblem(num_layers, block_sublayers, d, T, seed, logit_scale, inputs)


@st.composite
def walks(draw: st.DrawFn, *, max_layers: int = 8, max_block: int = 20) -> WalkProblem:
    return make_walk(
        draw(st.integers(1, max_layers)),
        draw(st.integers(1, max_block)),
        d=draw(st.sampled_from((1, 2, 8, 16))),
        T=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        logit_scale=draw(st.floats(0.25, 24.0)),
    )

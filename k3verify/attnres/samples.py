"""Block AttnRes's verification inputs: aggregations whose logits are set by construction, depth
walks with stand-in sublayers, and the named cases a run, the goldens and the overflow map use.

A sample is ``(inputs, params)``: ``inputs`` the form arguments by name — ``sources, w, gamma``
for one aggregation, ``embedding, weights, sublayers, schedule`` for a walk — and ``params``
what generated them (JSON-ready). Nothing here knows the harness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..numerics import round_to
from .layer import StandInSublayers, init_weights
from .schedule import Schedule

AGGREGATION = dict(N=9, T=32, d=256)  # K3's largest source set
DEFAULT_LOGIT_SCALE = 8.0
# Past ln(max fp32) = 88.72: the softmax without max subtraction overflows, the correct one must not.
HOT_LOGIT_SCALE = 96.0
LOGIT_SPREAD = 4.0  # logits of a token's sources lie within this many units below the largest
WALK = dict(T=8, d=64, logit_scale=16.0)
AGGREGATION_CASES = ("sources", "hot")
WALK_CASES = ("walk", "walk_full")
# K3's width and blocks over 1024 tokens, for the GPU rows. The stand-in sublayers are narrow
# (d -> 16 -> d: 340 MB in fp64 where d -> d would take 76 GB); AttnRes never sees their width.
K3_WALK = "walk_k3"
WALK_K3 = dict(T=1024, d=7168, logit_scale=16.0, hidden=16)

# Golden slices of the walk: 14 layers cross one 12-layer block boundary (K3's blocks, a
# 2-layer tail), and Full AttnRes over 6 layers; the stand-in sublayers of the full 93-layer
# walk would take 12.5 MB per case.
# T = 32 tokens give 1024 outputs: the baseline rule compares two RMS errors, and over 128
# outputs (T = 4) their ratio scattered past 2 for 3 of 30 seeds (worst 1.25x the limit), where
# over 1024 the worst of 30 seeds is 0.61x (recurrent, chunkwise and tiled bf16 alike).
GOLDEN_WALK = dict(T=32, d=32, logit_scale=WALK["logit_scale"])
GOLDEN_SCHEDULES = {
    "walk.small": Schedule.layers(12, num_layers=14),
    "walk_full.small": Schedule.full(num_layers=6),
}
# The K3-width walk's golden slice: all 93 layers in K3's blocks, narrow (its rows are GPU rows;
# a K3-width golden would take 400 MB).
GOLDEN_K3_WALK = ("walk_k3.narrow", Schedule(), dict(GOLDEN_WALK, hidden=16))

# The overflow map: 16 tokens of width 64, logit scale x number of sources.
MAP_SHAPE = dict(T=16, d=64)
MAP_LOGIT_SCALES = (1, 2, 4, 8, 11, 12, 16, 32, 64, 80, 85, 88, 90, 96, 128, 256, 4096, 32768, 65536, 131072)
MAP_SOURCES = (1, 2, 3, 5, 9, 33, 187)
QUICK_LOGIT_SCALES = (4, 12, 85, 96, 131072)
QUICK_SOURCES = (1, 9)

Sample = tuple[dict[str, Any], dict[str, Any]]


def controlled_sources(
    N: int, T: int, d: int, *, logit_scale: float, spread: float = LOGIT_SPREAD, seed: int = 0
) -> dict[str, torch.Tensor]:
    """fp64 ``sources:[N, T, d]``, ``w, gamma:[d]`` whose logits are set by construction.

    ``w ⊙ γ = (logit_scale / sqrt(d)) u`` for a random unit ``u``, so ``logit_scale`` is the
    a-priori bound ``‖w⊙γ‖·sqrt(d)``. Source ``i`` of token ``t`` is ``s (c u + sqrt(1 − c²) n)
    sqrt(d)`` with ``n ⊥ u`` random, a log-normal RMS ``s`` and cosine ``c``, so its logit is
    ``logit_scale · c · s / sqrt(s² + ε)``: one source per token has ``c = 1`` (the logit reaches
    the bound), the others ``c = 1 − U · min(1.5, spread / logit_scale)``, ``U ~ U(0, 1)`` (logits
    within ``spread`` below the largest at large scale, so several sources carry weight; at
    small scale they span ``[-0.5, 1]`` of it). Source order is shuffled per token. With ``d = 1``
    there is no direction orthogonal to ``u`` and every logit is ``±logit_scale``.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    gamma = 1 + 0.1 * randn(d)
    u = randn(d)
    u = u / u.norm()
    w = logit_scale * d**-0.5 * u / gamma
    U = torch.rand(N, T, generator=gen, dtype=torch.float64)
    U[0] = 0
    c = (1 - U * min(1.5, spread / logit_scale))[..., None]
    n = randn(N, T, d)
    n = n - (n @ u)[..., None] * u
    n = n / n.norm(dim=-1, keepdim=True).clamp(min=1e-300)  # d = 1 leaves no orthogonal direction: n = 0
    s = torch.exp(0.5 * randn(N, T))[..., None]
    v = s * d**0.5 * (c * u + (1 - c * c).clamp(min=0).sqrt() * n)
    order = torch.argsort(torch.rand(N, T, generator=gen), dim=0)
    v = torch.gather(v, 0, order[..., None].expand(-1, -1, d))
    return dict(sources=v, w=w, gamma=gamma)


def walk_inputs(schedule: Schedule, *, T: int, d: int, logit_scale: float, seed: int = 0,
                hidden: int | None = None) -> dict[str, Any]:  # fmt: skip
    """A depth walk's inputs: fp64 ``embedding:[T, d]``, :class:`AttnResWeights` with every
    ``‖w_s⊙γ_s‖·sqrt(d) = logit_scale``, :class:`StandInSublayers` (width ``hidden``, default
    ``d``) and the ``schedule``; values bf16-representable (the same at every precision, so a
    low-precision run differs only by its arithmetic)."""
    gen = torch.Generator().manual_seed(seed + 1)
    embedding = round_to(torch.randn(T, d, generator=gen, dtype=torch.float64), "bf16")
    return dict(
        embedding=embedding,
        weights=init_weights(schedule, d, logit_scale=logit_scale, seed=seed),
        sublayers=StandInSublayers.make(schedule.num_sublayers, d, hidden=hidden, seed=seed),
        schedule=schedule,
    )


def aggregation_params(N: int, T: int, d: int, *, logit_scale: float, seed: int = 0) -> dict[str, Any]:
    """The params of an aggregation sample (``kind="aggregation"``)."""
    return dict(N=N, T=T, d=d, kind="aggregation", logit_scale=logit_scale, logit_spread=LOGIT_SPREAD, seed=seed)


def aggregation_sample(N: int, T: int, d: int, *, logit_scale: float, seed: int = 0) -> Sample:
    """:func:`controlled_sources` with the params that made them (``kind="aggregation"``)."""
    inputs = controlled_sources(N, T, d, logit_scale=logit_scale, seed=seed)
    return inputs, aggregation_params(N, T, d, logit_scale=logit_scale, seed=seed)


def walk_params(schedule: Schedule, *, T: int, d: int, logit_scale: float, seed: int = 0,
                hidden: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The params of a walk sample (``kind="walk"``)."""
    return dict(T=T, d=d, logit_scale=logit_scale, kind="walk", num_layers=schedule.num_layers,
                **({"sublayer_hidden": hidden} if hidden else {}), block_sublayers=schedule.block_sublayers, seed=seed)


def walk_sample(schedule: Schedule, *, T: int, d: int, logit_scale: float, seed: int = 0,
                hidden: int | None = None) -> Sample:  # fmt: skip
    """:func:`walk_inputs` with the params that made them (``kind="walk"``)."""
    inputs = walk_inputs(schedule, T=T, d=d, logit_scale=logit_scale, seed=seed, hidden=hidden)
    return inputs, walk_params(schedule, T=T, d=d, logit_scale=logit_scale, seed=seed, hidden=hidden)


def make_cases(seed: int = 0) -> dict[str, Sample]:
    """Aggregation cases over K3's largest source set (9 sources): ``sources`` (largest logit 8)
    and ``hot`` (96, past ``ln(max fp32)``); walk cases over 93 layers: ``walk`` (K3's blocks of
    12 layers), ``walk_full`` (Full AttnRes, up to 187 sources) and, on a machine with a CUDA
    device, ``walk_k3`` (K3's blocks at K3's width over 1024 tokens, :data:`WALK_K3`)."""
    cases = {name: aggregation_sample(**AGGREGATION, logit_scale=scale, seed=seed)
             for name, scale in (("sources", DEFAULT_LOGIT_SCALE), ("hot", HOT_LOGIT_SCALE))}
    for name, schedule in (("walk", Schedule()), ("walk_full", Schedule.full())):
        cases[name] = walk_sample(schedule, **WALK, seed=seed)
    if torch.cuda.is_available():  # its rows are GPU rows, and its fp64 references run there (11 GB)
        inputs, params = walk_sample(Schedule(), **WALK_K3, seed=seed)
        cases[K3_WALK] = (inputs, dict(params, device="cuda"))
    return cases


def golden_cases(seed: int = 0) -> dict[str, Sample]:
    """The aggregation cases as they are, and the two walk kinds on short, narrow walks."""
    made = make_cases(seed)
    cases = {name: made[name] for name in AGGREGATION_CASES}
    for name, schedule in GOLDEN_SCHEDULES.items():
        cases[name] = walk_sample(schedule, **GOLDEN_WALK, seed=seed)
    name, schedule, shape = GOLDEN_K3_WALK
    cases[name] = walk_sample(schedule, **shape, seed=seed)
    return cases


def map_inputs(logit_scale: float, sources: int, seed: int = 0) -> Sample:
    """The overflow map's aggregation at one point: ``sources`` sources of :data:`MAP_SHAPE`
    whose largest logit per token is ``logit_scale``."""
    return aggregation_sample(sources, **MAP_SHAPE, logit_scale=logit_scale, seed=seed)


def map_grid(quick: bool) -> tuple[list[float], list[int]]:
    """The map's logit scales (1 to 2^17) and source counts (1 to 187; Full AttnRes's 187)."""
    if quick:
        return list(QUICK_LOGIT_SCALES), list(QUICK_SOURCES)
    return list(MAP_LOGIT_SCALES), list(MAP_SOURCES)


# --- drawn problems: the strategies Block AttnRes's tests and users draw from --------------------


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

    @property
    def sample(self) -> Sample:
        """The problem as a sample ``(inputs, params)``."""
        inputs = dict(sources=self.sources, w=self.w, gamma=self.gamma)
        return inputs, aggregation_params(self.N, self.T, self.d, logit_scale=self.logit_scale, seed=self.seed)


def make_aggregation(N: int = 3, T: int = 2, d: int = 8, *, seed: int = 0, logit_scale: float = 4.0) -> Aggregation:
    """A problem built directly (for pinned examples and plain tests): :func:`controlled_sources`,
    whose largest logit per token equals ``logit_scale = ‖w⊙γ‖·sqrt(d)``."""
    x = controlled_sources(N, T, d, logit_scale=logit_scale, seed=seed)
    return Aggregation(N, T, d, seed, logit_scale, x["sources"], x["w"], x["gamma"])


def aggregations(*, max_N: int = 12, min_T: int = 1, max_T: int = 4, widths: tuple[int, ...] = (1, 2, 3, 8, 16),
                 logit_scale: Any = None) -> Any:
    """A Hypothesis strategy of :class:`Aggregation` (needs ``hypothesis``): sizes drawn
    directly, so they shrink toward one source, one token and width 1; the tensors from a drawn
    seed, so a failing example replays from its printed :func:`make_aggregation` call; the logit
    scale from ``logit_scale`` (a strategy; default [0.25, 40])."""
    from hypothesis import strategies as st

    @st.composite
    def aggregations(draw: Any) -> Aggregation:
        N = draw(st.integers(1, max_N))
        T = draw(st.integers(min_T, max_T))
        d = draw(st.sampled_from(widths))
        seed = draw(st.integers(0, 2**16))
        scale = draw(logit_scale if logit_scale is not None else st.floats(0.25, 40.0))
        return make_aggregation(N, T, d, seed=seed, logit_scale=scale)

    return aggregations()


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
    def schedule(self) -> Schedule:
        return self.inputs["schedule"]

    def run(self, form: str = "recurrent", **opts: Any) -> Any:
        """The walk by ``form`` (``attnres.WALKS``) on these inputs."""
        from . import WALKS

        x = self.inputs
        return WALKS[form](x["embedding"], x["weights"], x["sublayers"], schedule=x["schedule"], **opts)

    @property
    def sample(self) -> Sample:
        """The problem as a sample ``(inputs, params)``."""
        return dict(self.inputs), walk_params(self.schedule, T=self.T, d=self.d, logit_scale=self.logit_scale,
                                              seed=self.seed)


def make_walk(num_layers: int = 3, block_sublayers: int = 2, *, d: int = 8, T: int = 2, seed: int = 0,
              logit_scale: float = 4.0) -> WalkProblem:
    """A walk built directly (for pinned examples and plain tests): :func:`walk_inputs`."""
    schedule = Schedule(num_layers, block_sublayers)
    inputs = walk_inputs(schedule, T=T, d=d, logit_scale=logit_scale, seed=seed)
    return WalkProblem(num_layers, block_sublayers, d, T, seed, logit_scale, inputs)


def walks(*, max_layers: int = 8, max_block: int = 20, widths: tuple[int, ...] = (1, 2, 8, 16)) -> Any:
    """A Hypothesis strategy of :class:`WalkProblem` (needs ``hypothesis``): shrinking toward one
    layer, block size 1, the first of ``widths`` and one token; logit scale in [0.25, 24]."""
    from hypothesis import strategies as st

    @st.composite
    def walks(draw: Any) -> WalkProblem:
        return make_walk(
            draw(st.integers(1, max_layers)),
            draw(st.integers(1, max_block)),
            d=draw(st.sampled_from(widths)),
            T=draw(st.integers(1, 3)),
            seed=draw(st.integers(0, 2**16)),
            logit_scale=draw(st.floats(0.25, 24.0)),
        )

    return walks()


def strategy(kind: str | None = None) -> Any:
    """A Hypothesis strategy of Block AttnRes samples ``(inputs, params)``: aggregations
    (:func:`aggregations`, ``kind="aggregation"``), walks (:func:`walks`, ``"walk"``) or either
    (``None``), as the tests draw them (for users' property tests; needs ``hypothesis``)."""
    from hypothesis import strategies as st

    if kind not in (None, "aggregation", "walk"):
        raise ValueError(f"kind must be 'aggregation', 'walk' or None, got {kind!r}")
    aggregation, walk = aggregations().map(lambda p: p.sample), walks().map(lambda p: p.sample)
    if kind is None:
        return st.one_of(aggregation, walk)
    return aggregation if kind == "aggregation" else walk

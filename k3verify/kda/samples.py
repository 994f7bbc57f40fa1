"""KDA's verification inputs: fp64 tensors drawn as the layer produces them, the worst case of
docs/model.md §1.6, and the named cases a run, the goldens and the overflow map use.

A case is ``(inputs, params)``: ``inputs`` the form arguments by name (``q, k, v, g, beta,
initial_state``), ``params`` what generated them (JSON-ready). Nothing here knows the harness.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from .gate import DEFAULT_G_MIN, l2norm, lower_bound_gate

G_MIN = DEFAULT_G_MIN  # K3's gate lower bound
CHUNK = 64
TILE = 16
INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state")

# The default case: K3's head dim, chunk, sub-tile and gate bound; T not a multiple of 64 so
# the partial last chunk and partial last tile are always exercised.
DEFAULT_SHAPE = dict(B=2, T=200, H=2, K=128, V=128)
# The interpreter runs a kernel program by program in numpy: keep its cases small.
SMALL_SHAPE = dict(B=2, T=72, H=1, K=32, V=32)
DECODE_SHAPE = dict(B=8, T=1, H=2, K=128, V=128)
# Golden slices: a small configuration, and a production-shape slice (K3's head dims 128/128,
# one head, one full chunk plus a partial one), each as random and as saturated gates, and a
# decode slice (two requests, one head). The default case above (T = 200, two heads) would take
# 4.7 MB, the decode case's eight states 2 MB.
GOLDEN_SHAPES = {"small": dict(B=1, T=72, H=2, K=16, V=16), "production": dict(B=1, T=80, H=1, K=128, V=128)}
GOLDEN_DECODE_SHAPE = dict(B=2, T=1, H=1, K=128, V=128)
# The overflow map's inputs: one chunk pair, two heads, head dim 32.
MAP_SHAPE = dict(B=1, T=128, H=2, K=32, V=32)

Sample = tuple[dict[str, Any], dict[str, Any]]


def random_inputs(
    B: int, T: int, H: int, K: int, V: int, *, g_min: float = G_MIN, seed: int = 0, initial_state: bool = True
) -> dict[str, torch.Tensor | None]:
    """fp64 inputs drawn as the layer produces them: l2-normalised q/k, K3's bounded gate."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    q, k = l2norm(randn(B, T, H, K)), l2norm(randn(B, T, H, K))
    v = randn(B, T, H, V)
    g = lower_bound_gate(randn(B, T, H, K), torch.zeros(H, dtype=torch.float64), randn(H * K), g_min=g_min)
    beta = torch.sigmoid(randn(B, T, H))
    s0 = 0.1 * randn(B, H, K, V) if initial_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)


def saturated_inputs(
    B: int, T: int, H: int, K: int, V: int, *, g_min: float = G_MIN, seed: int = 0, one_hot: bool = True
) -> dict[str, torch.Tensor | None]:
    """docs/model.md §1.6's worst case: every gate exactly ``g_min``.

    With ``one_hot`` the q/k rows are unit basis vectors, so an operand's largest entry is
    exactly its decay factor and the frontier is sharp; otherwise l2-normalised random rows.
    """
    x = random_inputs(B, T, H, K, V, g_min=g_min, seed=seed, initial_state=False)
    if one_hot:
        basis = torch.nn.functional.one_hot(torch.arange(T) % K, K).to(torch.float64)
        x["q"] = basis[None, :, None, :].expand(B, T, H, K).contiguous()
        x["k"] = x["q"].clone()
    x["g"] = torch.full((B, T, H, K), g_min, dtype=torch.float64)
    return x


def cotangents(B: int, T: int, H: int, K: int, V: int, *, seed: int = 0, states: int | None = None,
               dht_scale: float | None = None) -> dict[str, torch.Tensor]:
    """The backward's upstream gradients in fp64 (the loss ``sum(o * do) + sum(S_T * dht)``,
    numerics.gradients): ``do:[B,T,H,V]`` standard normal and ``dht`` like the final state(s),
    ``[states or B, H, K, V]``, normal with standard deviation ``dht_scale``, ``1/K`` by default.

    At ``1/K`` the final state's cotangent weighs what one token's output cotangent weighs on the
    state: ``o_t = (K^-1/2 q_t)^T S_t`` reaches ``S_t`` through ``K^-1/2 q_t do_t^T``, of Frobenius
    norm ``sqrt(V/K)`` for a unit ``q_t``, and ``dht`` has ``sqrt(K V)/K``. At unit scale (as
    fla-core's tests draw it) the final state's term held 99 % of ``dk``'s, ``dv``'s, ``dg``'s and
    ``dbeta``'s energy in the last 4 of 200 tokens, and a gradient's error measured those tokens
    only (docs/modules/kda.md, "The backward's cotangents")."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    scale = 1.0 / K if dht_scale is None else dht_scale
    return {"do": torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
            "dht": torch.randn(states or B, H, K, V, generator=gen, dtype=torch.float64) * scale}


# The backward's packed batch: a chunk and more, one token, an empty sequence, and a short one, in
# one call along T (fla-core's cu_seqlens layout); and its case with the gate in the kernel. Small
# heads: these cases are about structure, and their goldens stay near 200 kB.
PACKED_LENGTHS = (70, 1, 0, 9)
PACKED_SHAPE = dict(H=2, K=16, V=16)


def packed_inputs(lengths: tuple[int, ...] = PACKED_LENGTHS, *, H: int, K: int, V: int, g_min: float = G_MIN,
                  seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Sequences of ``lengths`` packed along ``T`` (``B = 1``): the inputs of
    :func:`random_inputs`, an initial state per sequence ``[N,H,K,V]`` and ``cu_seqlens`` (int64)."""
    T, N = sum(lengths), len(lengths)
    x = random_inputs(1, T, H, K, V, g_min=g_min, seed=seed, initial_state=False)
    gen = torch.Generator().manual_seed(seed + 1)
    x["initial_state"] = 0.1 * torch.randn(N, H, K, V, generator=gen, dtype=torch.float64)
    x["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return x


def gated_inputs(B: int, T: int, H: int, K: int, V: int, *, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """The inputs of :func:`random_inputs` with ``g`` replaced by decay logits (standard normal,
    scaled by 3 so that some of the gate's sigmoids saturate) and the gate's parameters
    ``A_log:[H]`` and ``dt_bias:[H*K]`` beside them, for a kernel that computes the gate itself."""
    x = random_inputs(B, T, H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    x["g"] = 3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    x["A_log"] = torch.randn(H, generator=gen, dtype=torch.float64)
    x["dt_bias"] = torch.randn(H * K, generator=gen, dtype=torch.float64)
    return x


def make_cases(seed: int = 0) -> dict[str, Sample]:
    """``default`` (random, bounded gates, initial state), ``saturated`` (gates at g_min),
    ``small`` (the chunk kernel under Triton's interpreter: a full and a partial chunk) and
    ``decode`` (one token per request on a carried state)."""
    params = dict(DEFAULT_SHAPE, g_min=G_MIN, seed=seed)
    cases = {
        "default": (random_inputs(**DEFAULT_SHAPE, seed=seed), params),
        "saturated": (saturated_inputs(**DEFAULT_SHAPE, seed=seed + 1, one_hot=False),
                      dict(params, gates="all at g_min")),
    }
    for name, shape in (("small", SMALL_SHAPE), ("decode", DECODE_SHAPE)):
        cases[name] = (random_inputs(**shape, seed=seed + 2), dict(shape, g_min=G_MIN, seed=seed + 2))
    return cases


def golden_cases(seed: int = 0) -> dict[str, Sample]:
    """``default.<slice>`` and ``saturated.<slice>`` for every slice of :data:`GOLDEN_SHAPES`, and
    ``decode.production``; other case kinds are stored as :func:`make_cases` makes them."""
    shape = GOLDEN_DECODE_SHAPE
    cases = {"decode.production": (random_inputs(**shape, seed=seed + 2),
                                   dict(shape, g_min=G_MIN, seed=seed + 2, slice="production"))}
    for variant, shape in GOLDEN_SHAPES.items():
        params = dict(shape, g_min=G_MIN, seed=seed, slice=variant)
        cases[f"default.{variant}"] = (random_inputs(**shape, seed=seed), params)
        cases[f"saturated.{variant}"] = (saturated_inputs(**shape, seed=seed + 1, one_hot=False),
                                         dict(params, gates="all at g_min"))
    return cases


def map_inputs(kind: str, g_min: float, seed: int = 0) -> Sample:
    """The overflow map's input at ``g_min``: ``worst`` (every gate at g_min, one-hot q/k rows so
    an operand's largest entry is its decay factor) or ``random`` (the bounded gate with random
    logits); no initial state."""
    make = saturated_inputs if kind == "worst" else random_inputs
    x = make(**MAP_SHAPE, g_min=g_min, seed=seed)
    x["initial_state"] = None
    return x, dict(MAP_SHAPE, input=kind, g_min=g_min, seed=seed)


def g_min_grid(quick: bool) -> list[float]:
    """-0.5 to -20: every 0.1 (196 values), or every 0.5 for a quick map."""
    step = 0.5 if quick else 0.1
    n = round((20 - 0.5) / step)
    return [round(-0.5 - i * step, 4) for i in range(n + 1)]


@dataclass
class KDAProblem:
    """One drawn problem: fp64 inputs plus how they were made (shown when a test fails)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    g_min: float
    seed: int
    kind: str
    inputs: dict[str, torch.Tensor | None]

    def __repr__(self) -> str:
        return (
            f"KDAProblem(B={self.B}, T={self.T}, H={self.H}, K={self.K}, V={self.V}, "
            f"g_min={self.g_min}, seed={self.seed}, kind={self.kind!r}, "
            f"initial_state={self.inputs['initial_state'] is not None})"
        )

    def args(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, g, beta)`` cast to ``dtype``."""
        return tuple(self.inputs[n].to(dtype) for n in ("q", "k", "v", "g", "beta"))

    def state(self, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
        s = self.inputs["initial_state"]
        return None if s is None else s.to(dtype)

    def cotangents(self) -> dict[str, torch.Tensor]:
        """``do`` and ``dht`` drawn from the problem's seed (:func:`cotangents`)."""
        return cotangents(self.B, self.T, self.H, self.K, self.V, seed=self.seed)

    @property
    def sample(self) -> Sample:
        """The problem as a sample ``(inputs, params)``."""
        params = dict(B=self.B, T=self.T, H=self.H, K=self.K, V=self.V, g_min=self.g_min, seed=self.seed,
                      gates=self.kind, initial_state=self.inputs["initial_state"] is not None)
        return dict(self.inputs), params


def make_problem(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    g_min: float = -5.0,
    seed: int = 0,
    kind: str = "random",
    initial_state: bool = True,
) -> KDAProblem:
    """A problem built directly (for pinned examples and plain tests): ``kind`` ``random``
    (:func:`random_inputs`), ``saturated`` (every gate at ``g_min``) or ``worst`` (saturated,
    with one-hot ``q``/``k`` rows)."""
    if kind == "random":
        x = random_inputs(B, T, H, K, V, g_min=g_min, seed=seed, initial_state=initial_state)
    else:
        x = saturated_inputs(B, T, H, K, V, g_min=g_min, seed=seed, one_hot=(kind == "worst"))
        if initial_state:
            x["initial_state"] = random_inputs(B, 1, H, K, V, seed=seed)["initial_state"]
    return KDAProblem(B, T, H, K, V, g_min, seed, kind, x)


def problems(
    *,
    min_T: int = 1,
    max_T: int = 150,
    lengths: Any = None,
    g_min: Any = None,
    kinds: tuple[str, ...] = ("random",),
    K: tuple[int, ...] = (4, 8, 16),
    V: tuple[int, ...] = (4, 6, 16),
    initial_state: bool | None = None,
    B: tuple[int, ...] = (1, 2),
    H: tuple[int, ...] = (1, 2),
) -> Any:
    """A Hypothesis strategy of :class:`KDAProblem`, the one KDA's tests and users draw from
    (needs ``hypothesis``). Sizes are drawn directly, so they shrink toward the smallest problem;
    the tensors come from a drawn seed, so a failing example replays from its printed sizes and
    seed. ``T`` is drawn from ``lengths`` (a strategy), else in ``[min_T, max_T]``, and is often
    not a multiple of any chunk or tile size; ``g_min`` is a strategy of gate bounds (default
    ``[-8, -0.5]``); ``initial_state`` ``None`` draws it."""
    from hypothesis import strategies as st

    @st.composite
    def kda_problems(draw: Any) -> KDAProblem:
        batch = draw(st.sampled_from(B))
        T = draw(lengths if lengths is not None else st.integers(min_T, max_T))
        heads = draw(st.sampled_from(H))
        k = draw(st.sampled_from(K))
        v = draw(st.sampled_from(V))
        gm = draw(g_min if g_min is not None else st.floats(-8.0, -0.5).map(lambda x: round(x, 2)))
        seed = draw(st.integers(0, 2**16))
        kind = draw(st.sampled_from(kinds))
        with_state = draw(st.booleans()) if initial_state is None else initial_state
        return make_problem(batch, T, heads, k, v, g_min=gm, seed=seed, kind=kind, initial_state=with_state)

    return kda_problems()


# Lengths at a 64-token chunk's edges: one short of it, exactly it, one past it.
EDGE_LENGTHS = (63, 64, 65, 127, 128, 129, 191, 192, 193)


def strategy() -> Any:
    """A Hypothesis strategy of KDA samples ``(inputs, params)`` (:func:`problems`): lengths
    shorter than a chunk (from one token), at a chunk's edges (``T % 64`` in {63, 0, 1}) and in
    between, shrinking toward one token; a drawn gate bound in [-8, -0.1], random or saturated
    gates, with or without an initial state (for users' property tests; needs ``hypothesis``).
    Short outputs are judged with the baseline rule's small-output factor (``numerics.policy``)."""
    from hypothesis import strategies as st

    lengths = st.one_of(st.integers(1, 63), st.sampled_from(EDGE_LENGTHS), st.integers(64, 160))
    return problems(lengths=lengths, g_min=st.floats(-8.0, -0.1).map(lambda x: round(x, 2)),
                    kinds=("random", "saturated"), K=(16, 32), V=(16, 32)).map(lambda p: p.sample)

"""Hypothesis strategies for KDA problems.

Sizes are drawn directly (so they shrink toward the smallest problem); tensor values come
from a drawn seed through the same generators the harness uses, so a failing example is
replayed exactly from its printed sizes and seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from k3verify.kda.samples import random_inputs, saturated_inputs


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
    """A problem built directly (for pinned examples and plain tests)."""
    if kind == "random":
        x = random_inputs(B, T, H, K, V, g_min=g_min, seed=seed, initial_state=initial_state)
    else:
        x = saturated_inputs(B, T, H, K, V, g_min=g_min, seed=seed, one_hot=(kind == "worst"))
        if initial_state:
            x["initial_state"] = random_inputs(B, 1, H, K, V, seed=seed)["initial_state"]
    return KDAProblem(B, T, H, K, V, g_min, seed, kind, x)


@st.composite
def kda_problems(
    draw: st.DrawFn,
    *,
    min_T: int = 1,
    max_T: int = 150,
    g_min: st.SearchStrategy[float] | None = None,
    kinds: tuple[str, ...] = ("random",),
    K: tuple[int, ...] = (4, 8, 16),
    V: tuple[int, ...] = (4, 6, 16),
    initial_state: bool | None = None,
    B: tuple[int, ...] = (1, 2),
    H: tuple[int, ...] = (1, 2),
) -> KDAProblem:
    """Random KDA problems; ``T`` is often not a multiple of any chunk or tile size."""
    batch = draw(st.sampled_from(B))
    T = draw(st.integers(min_T, max_T))
    heads = draw(st.sampled_from(H))
    k = draw(st.sampled_from(K))
    v = draw(st.sampled_from(V))
    gm = draw(g_min if g_min is not None else st.floats(-8.0, -0.5).map(lambda x: round(x, 2)))
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(kinds))
    with_state = draw(st.booleans()) if initial_state is None else initial_state
    return make_problem(batch, T, heads, k, v, g_min=gm, seed=seed, kind=kind, initial_state=with_state)

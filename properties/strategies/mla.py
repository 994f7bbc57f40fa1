"""Hypothesis strategies for Gated MLA problems.

Sizes are drawn directly (so they shrink toward one request, one head, one token, page size 1);
tensor values come from a drawn seed (through :func:`k3verify.mla.samples.random_inputs`), so a
failing example replays exactly from its printed sizes and seed. Dimensions keep K3's
proportions: ``R = 8 Dr`` (512 : 64), ``Dn = 2 Dr`` (128 : 64). Cached entries look like the
layer's: ``ĉ`` RMS-normalised, ``k^p`` raw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from k3verify import mla
from k3verify.mla.samples import PAGE_SIZES, random_inputs

__all__ = ["PAGE_SIZES", "MLAProblem", "make_problem", "mla_problems"]


@dataclass
class MLAProblem:
    """One drawn problem: fp64 form inputs, the logical cache contents and how they were made."""

    B: int
    T: int
    H: int
    Dr: int
    Dv: int
    contexts: tuple[int, ...]  # earlier tokens per request; seq_lens = contexts + T
    page_size: int
    seed: int
    q_scale: float
    latent_scale: float
    entries: torch.Tensor = field(repr=False)  # [B, Lmax, R + Dr] logical cache contents, 0 past each length
    q_nope: torch.Tensor = field(repr=False)
    q_pe: torch.Tensor = field(repr=False)
    w_uk: torch.Tensor = field(repr=False)
    w_uv: torch.Tensor = field(repr=False)
    cache: mla.LatentCache = field(repr=False)

    def __repr__(self) -> str:
        # Replayable: the make_problem call that rebuilds this problem bit for bit.
        return (f"make_problem({self.contexts!r}, {self.T}, H={self.H}, Dr={self.Dr}, Dv={self.Dv}, "
                f"page_size={self.page_size}, seed={self.seed}, q_scale={self.q_scale!r}, "
                f"latent_scale={self.latent_scale!r})")

    @property
    def R(self) -> int:
        return 8 * self.Dr

    @property
    def Dn(self) -> int:
        return 2 * self.Dr

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(c + self.T for c in self.contexts)

    def args(self, dtype: torch.dtype = torch.float64, cache: mla.LatentCache | None = None) -> tuple:
        """``(q_nope, q_pe, cache, w_uk, w_uv)`` with tensors in ``dtype``."""
        c = (cache if cache is not None else self.cache).to(dtype)
        return self.q_nope.to(dtype), self.q_pe.to(dtype), c, self.w_uk.to(dtype), self.w_uv.to(dtype)

    def layout(self, page_size: int | None = None, *, page_order: str | torch.Tensor = "shuffled",
               spare_pages: int = 1, seed: int = 0) -> mla.LatentCache:
        """The same tokens in another paged layout (dead slots NaN)."""
        gen = torch.Generator().manual_seed(seed)
        return mla.build(self.entries, self.lengths, page_size or self.page_size, page_order=page_order,
                         spare_pages=spare_pages, generator=gen)


def make_problem(contexts: tuple[int, ...] = (3,), T: int = 2, *, H: int = 2, Dr: int = 2, Dv: int | None = None,
                 page_size: int = 4, seed: int = 0, q_scale: float = 1.0, latent_scale: float = 1.0) -> MLAProblem:
    """A problem built directly (for pinned examples and plain tests): :func:`k3verify.mla.samples.random_inputs`."""
    x = random_inputs(contexts, T, H=H, Dr=Dr, Dv=Dv, page_size=page_size, seed=seed, q_scale=q_scale,
                      latent_scale=latent_scale)
    return MLAProblem(
        B=len(contexts), T=T, H=H, Dr=Dr, Dv=x["w_uv"].shape[-1], contexts=tuple(contexts), page_size=page_size,
        seed=seed, q_scale=q_scale, latent_scale=latent_scale, entries=mla.live_entries(x["cache"]), **x,
    )


@st.composite
def mla_problems(
    draw: st.DrawFn,
    *,
    max_B: int = 2,
    min_T: int = 1,
    max_T: int = 8,
    max_context: int = 20,
    max_H: int = 2,
    Dr: tuple[int, ...] = (1, 2, 4),
    q_scale: st.SearchStrategy[float] | None = None,
) -> MLAProblem:
    """Random problems: ragged lengths, any page size, shuffled pages, NaN in dead slots."""
    B = draw(st.integers(1, max_B))
    T = draw(st.integers(min_T, max_T))
    contexts = tuple(draw(st.lists(st.integers(0, max_context), min_size=B, max_size=B)))
    H = draw(st.integers(1, max_H))
    dr = draw(st.sampled_from(Dr))
    Dv = draw(st.sampled_from((2 * dr, 3)))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    seed = draw(st.integers(0, 2**16))
    scale = draw(q_scale) if q_scale is not None else 1.0
    return make_problem(contexts, T, H=H, Dr=dr, Dv=Dv, page_size=page_size, seed=seed, q_scale=scale)

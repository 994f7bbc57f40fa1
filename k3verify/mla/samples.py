"""Gated MLA's verification inputs: form arguments made as the layer makes them (a paged latent
cache of every token, queries of the last ``T``), the named cases a run, the goldens and the
overflow map use, and a Hypothesis strategy of drawn problems.

A case is ``(inputs, params)``: ``inputs`` the form arguments by name (``q_nope, q_pe, cache,
w_uk, w_uv``, fp64, the cache a :class:`~k3verify.mla.cache.LatentCache` with shuffled pages and
NaN in dead slots), ``params`` what generated them (JSON-ready). Nothing here knows the harness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..numerics.ops import rms_norm
from . import layer
from .cache import LatentCache, build, live_entries

CONFIG = layer.MLAConfig.small()  # K3's proportions (512:64, 128:64, v = 128), 4 heads
PAGE_SIZE = 16
# Query scale of the "hot" case: scores ~ N(0, 32^2); the largest (176) passes ln(max bf16) = 88.7.
HOT_QUERY_SCALE = 32.0
INPUT_NAMES = ("q_nope", "q_pe", "cache", "w_uk", "w_uv")

CASES = {
    # Chunked prefill: 24 new tokens after 37, 16 and 0 cached ones (the last request's first
    # chunk has an empty prefix), pages shuffled, dead slots NaN.
    "default": dict(lengths=(61, 40, 24), T=24),
    # Decode: one new token per request, lengths not multiples of the page size.
    "decode": dict(lengths=(77, 18, 33, 50, 5, 64, 29, 41), T=1),
}

# A production-shape slice for the goldens: K3's latent (512 + 64) and head dims (128 + 64,
# v 128), one head; the hidden size does not reach the forms' inputs, so it stays small. One
# chunked prefill (8 new tokens after 33 cached, across three pages) runs every form,
# absorbed and expanded; its weights alone take 1 MB in fp64, so there is no second slice.
PRODUCTION_SLICE = dataclasses.replace(layer.MLAConfig.production(), num_heads=1, hidden_size=1024)
GOLDEN_PRODUCTION_CASES = {"default.production": dict(lengths=(41,), T=8)}

# The overflow map's inputs: one request, a full prefill of ``context`` tokens, 2 heads.
MAP_CONFIG = dataclasses.replace(CONFIG, num_heads=2)

Sample = tuple[dict[str, Any], dict[str, Any]]


def layer_inputs(
    cfg: layer.MLAConfig,
    lengths: tuple[int, ...],
    T: int,
    *,
    seed: int = 0,
    page_size: int = PAGE_SIZE,
    spare_pages: int = 2,
) -> dict[str, Any]:
    """fp64 form inputs as the layer makes them: random ``x`` -> latents of every token into a
    paged cache (shuffled pages, NaN in dead slots) and queries of the last ``T`` tokens.

    ``q_nope:[B, T, H, Dn]``, ``q_pe:[B, T, H, Dr]``, ``w_uk:[H, R, Dn]``, ``w_uv:[H, R, Dv]``,
    ``cache`` holding ``lengths[b]`` tokens of width ``R + Dr`` per request.
    """
    w = layer.init_weights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, L = len(lengths), max(lengths)
    x = torch.randn(B, L, cfg.hidden_size, generator=gen, dtype=torch.float64)
    cache = build(layer.project_latent(x, w, cfg), lengths, page_size, generator=gen, spare_pages=spare_pages)
    last = torch.tensor(lengths)[:, None] - T + torch.arange(T)[None, :]
    q_nope, q_pe = layer.project_query(torch.gather(x, 1, last[..., None].expand(-1, -1, x.shape[-1])), w, cfg)
    return dict(q_nope=q_nope, q_pe=q_pe, cache=cache, w_uk=w.w_uk, w_uv=w.w_uv)


def _dims(cfg: layer.MLAConfig, seed: int) -> dict[str, Any]:
    return dict(heads=cfg.num_heads, R=cfg.kv_lora_rank, Dr=cfg.qk_rope_head_dim, Dn=cfg.qk_nope_head_dim,
                Dv=cfg.v_head_dim, page_size=PAGE_SIZE, seed=seed)


def make_cases(seed: int = 0) -> dict[str, Sample]:
    """``default`` (chunked prefill), ``decode`` (one token per request) and ``hot`` (the
    default case with queries scaled so that scores pass ln(max bf16))."""
    cases = {}
    for name, spec in CASES.items():
        inputs = layer_inputs(CONFIG, spec["lengths"], spec["T"], seed=seed)
        cases[name] = (inputs, dict(_dims(CONFIG, seed), lengths=list(spec["lengths"]), T=spec["T"]))
    default, params = cases["default"]
    hot = dict(default, q_nope=default["q_nope"] * HOT_QUERY_SCALE, q_pe=default["q_pe"] * HOT_QUERY_SCALE)
    cases["hot"] = (hot, dict(params, query_scale=HOT_QUERY_SCALE))
    return cases


def golden_cases(seed: int = 0) -> dict[str, Sample]:
    """The default cases (small configuration) plus the production-shape slice."""
    cases = make_cases(seed)
    cfg = PRODUCTION_SLICE
    for name, spec in GOLDEN_PRODUCTION_CASES.items():
        inputs = layer_inputs(cfg, spec["lengths"], spec["T"], seed=seed, spare_pages=1)
        cases[name] = (inputs, dict(_dims(cfg, seed), slice="production", lengths=list(spec["lengths"]),
                                    T=spec["T"]))
    return cases


def map_inputs(context: int, seed: int = 0) -> dict[str, Any]:
    """The overflow map's base inputs: one request, a full prefill of ``context`` tokens through
    :data:`MAP_CONFIG` (2 heads of the small configuration)."""
    return layer_inputs(MAP_CONFIG, (context,), context, seed=seed, spare_pages=1)


def scaled(inputs: dict[str, Any], log2_q_scale: float, log2_latent_scale: float) -> dict[str, Any]:
    """``inputs`` with the queries times ``2^log2_q_scale`` and every cached entry ``[ĉ ; k^p]``
    times ``2^log2_latent_scale`` (powers of two: exact in fp64; NaN poison stays NaN)."""
    qs, ls = 2.0**log2_q_scale, 2.0**log2_latent_scale
    c = inputs["cache"]
    cache = LatentCache(c.pool * ls, c.block_table, c.seq_lens)
    return dict(inputs, q_nope=inputs["q_nope"] * qs, q_pe=inputs["q_pe"] * qs, cache=cache)


def random_inputs(
    contexts: Sequence[int] = (3,),
    T: int = 2,
    *,
    H: int = 2,
    Dr: int = 2,
    Dv: int | None = None,
    page_size: int = 4,
    seed: int = 0,
    q_scale: float = 1.0,
    latent_scale: float = 1.0,
) -> dict[str, Any]:
    """fp64 form inputs drawn directly, with K3's proportions ``R = 8 Dr``, ``Dn = 2 Dr``
    (``Dv`` defaults to ``2 Dr``): request ``b`` holds ``contexts[b] + T`` tokens whose ``ĉ`` is
    RMS-normalised and ``k^p`` raw (both times ``latent_scale``), in shuffled pages with one
    spare; queries times ``q_scale``; weights ``N(0, 1/R)``."""
    B = len(contexts)
    R, Dn, Dv = 8 * Dr, 2 * Dr, (2 * Dr if Dv is None else Dv)
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    lengths = [c + T for c in contexts]
    L = max(lengths)
    c_hat = rms_norm(randn(B, L, R), torch.ones(R, dtype=torch.float64))
    entries = torch.cat([c_hat, randn(B, L, Dr)], dim=-1) * latent_scale
    cache = build(entries, lengths, page_size, generator=gen, spare_pages=1)
    q_nope, q_pe = randn(B, T, H, Dn) * q_scale, randn(B, T, H, Dr) * q_scale
    w_uk, w_uv = randn(H, R, Dn) * R**-0.5, randn(H, R, Dv) * R**-0.5
    return dict(q_nope=q_nope, q_pe=q_pe, cache=cache, w_uk=w_uk, w_uv=w_uv)


PAGE_SIZES = (1, 2, 3, 4, 8, 16)


@dataclasses.dataclass
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
    entries: torch.Tensor = dataclasses.field(repr=False)  # [B, Lmax, R + Dr] logical contents, 0 past each length
    q_nope: torch.Tensor = dataclasses.field(repr=False)
    q_pe: torch.Tensor = dataclasses.field(repr=False)
    w_uk: torch.Tensor = dataclasses.field(repr=False)
    w_uv: torch.Tensor = dataclasses.field(repr=False)
    cache: LatentCache = dataclasses.field(repr=False)

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

    def args(self, dtype: torch.dtype = torch.float64, cache: LatentCache | None = None) -> tuple:
        """``(q_nope, q_pe, cache, w_uk, w_uv)`` with tensors in ``dtype``."""
        c = (cache if cache is not None else self.cache).to(dtype)
        return self.q_nope.to(dtype), self.q_pe.to(dtype), c, self.w_uk.to(dtype), self.w_uv.to(dtype)

    def layout(self, page_size: int | None = None, *, page_order: str | torch.Tensor = "shuffled",
               spare_pages: int = 1, seed: int = 0) -> LatentCache:
        """The same tokens in another paged layout (dead slots NaN)."""
        gen = torch.Generator().manual_seed(seed)
        return build(self.entries, self.lengths, page_size or self.page_size, page_order=page_order,
                     spare_pages=spare_pages, generator=gen)

    @property
    def sample(self) -> Sample:
        """The problem as a sample ``(inputs, params)``."""
        inputs = dict(q_nope=self.q_nope, q_pe=self.q_pe, cache=self.cache, w_uk=self.w_uk, w_uv=self.w_uv)
        params = dict(T=self.T, H=self.H, Dr=self.Dr, Dv=self.Dv, page_size=self.page_size, seed=self.seed,
                      contexts=list(self.contexts), lengths=list(self.lengths))
        return inputs, params


def make_problem(contexts: tuple[int, ...] = (3,), T: int = 2, *, H: int = 2, Dr: int = 2, Dv: int | None = None,
                 page_size: int = 4, seed: int = 0, q_scale: float = 1.0, latent_scale: float = 1.0) -> MLAProblem:
    """A problem built directly (for pinned examples and plain tests): :func:`random_inputs`."""
    x = random_inputs(contexts, T, H=H, Dr=Dr, Dv=Dv, page_size=page_size, seed=seed, q_scale=q_scale,
                      latent_scale=latent_scale)
    return MLAProblem(
        B=len(contexts), T=T, H=H, Dr=Dr, Dv=x["w_uv"].shape[-1], contexts=tuple(contexts), page_size=page_size,
        seed=seed, q_scale=q_scale, latent_scale=latent_scale, entries=live_entries(x["cache"]), **x,
    )


def problems(*, max_B: int = 2, min_T: int = 1, max_T: int = 8, max_context: int = 20, max_H: int = 2,
             Dr: tuple[int, ...] = (1, 2, 4), q_scale: Any = None) -> Any:
    """A Hypothesis strategy of :class:`MLAProblem`, the one MLA's tests and users draw from
    (needs ``hypothesis``): ragged lengths, any page size, shuffled pages, NaN in dead slots.
    Sizes are drawn directly (they shrink toward one request, one head, one token, page size 1);
    tensor values come from a drawn seed, so a failing example replays from its printed
    :func:`make_problem` call. Dimensions keep K3's proportions ``R = 8 Dr``, ``Dn = 2 Dr``;
    ``q_scale`` is a strategy of query scales (default 1)."""
    from hypothesis import strategies as st

    @st.composite
    def mla_problems(draw: Any) -> MLAProblem:
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

    return mla_problems()


def strategy() -> Any:
    """A Hypothesis strategy of MLA samples ``(inputs, params)`` (:func:`problems`): sizes that
    shrink toward one request, one token, no context, one head, ``Dr = 1`` and page size 1;
    ragged lengths, shuffled pages, NaN in dead slots (for users' property tests; needs
    ``hypothesis``)."""
    return problems().map(lambda p: p.sample)

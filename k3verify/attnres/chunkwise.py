"""Block AttnRes chunkwise form — two-phase computation per block (docs/model.md §3).

The pseudo-queries are parameters, not functions of the hidden state, so every query of a
block is known before the block runs. With the stored blocks ``b_0 … b_k`` fixed for the whole
of block ``k``:

phase 1, once per block, for all of its calls' queries at once (one batched product)::

    ℓ_{s,i} = (w_s ⊙ γ_s)ᵀ v̂_i,   v̂_i = v_i / sqrt(mean(v_i²) + ε)     (every query s, stored block i)
    m_s = max_i ℓ_{s,i},   Z_s = Σ_i e^{ℓ_{s,i} − m_s},   N_s = Σ_i e^{ℓ_{s,i} − m_s} v_i

phase 2, per call, merging the current partial sum ``p`` (logit ``r = w_sᵀ RMSNorm_{γ_s}(p)``)::

    M = max(m, r),   Z' = e^{m−M} Z + e^{r−M},   N' = e^{m−M} N + e^{r−M} p,   h = N' / Z'

and ``h = N / Z`` at a block start, where there is no partial sum yet. Statistics are kept in
the compute dtype. An empty stored set (an aggregation of a single source) has ``m = −∞``,
``Z = 0``, ``N = 0`` and contributes weight ``e^{−∞} = 0``. In fp64 this equals the one-shot
definition to rounding (the policy's ``fp64-agreement``: ≤ 1e-10 relative).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..numerics.ops import RMS_NORM_EPS, rms_norm
from .inputs import Options, Precision, Sublayers, prepare_sources
from .layer import AttnResWeights, DepthStream, Walk, walk
from .recurrent import logits
from .schedule import Call, Schedule, Source

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Stats:
    """Phase-1 statistics of ``Q`` queries over stored blocks: ``m, Z:[Q, T]``, ``N:[Q, T, d]``."""

    m: torch.Tensor
    Z: torch.Tensor
    N: torch.Tensor

    def __getitem__(self, q: int) -> Stats:
        return Stats(self.m[q], self.Z[q], self.N[q])


def phase1(ell: torch.Tensor, stored: torch.Tensor) -> Stats:
    """Statistics of logits ``ℓ:[Q, n, T]`` over stored values ``[n, T, d]`` (``n = 0`` allowed)."""
    Q, n, T = ell.shape
    if n == 0:
        zeros = ell.new_zeros(Q, T)
        return Stats(torch.full_like(zeros, NEG_INF), zeros, ell.new_zeros(Q, T, stored.shape[-1]))
    m = ell.amax(1)
    p = torch.exp(ell - m[:, None])
    return Stats(m, p.sum(1), torch.einsum("qnt,ntd->qtd", p, stored))


def merge(stats: Stats, r: torch.Tensor | None = None, partial: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 2: ``h:[T, d]`` from one query's stats and (optionally) the partial sum's logit ``r:[T]``."""
    if r is None:
        return stats.N / stats.Z[..., None]
    M = torch.maximum(stats.m, r)
    a = torch.exp(stats.m - M)  # 0 for an empty stored set (m = −inf, M finite)
    b = torch.exp(r - M)
    return (a[..., None] * stats.N + b[..., None] * partial) / (a * stats.Z + b)[..., None]


def stored_logits(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """Phase-1 logits of queries ``w, gamma:[Q, d]`` over ``stored:[n, T, d]``: ``[Q, n, T]``.

    The normalised blocks ``v̂`` are computed once and shared by every query (``γ`` folded into ``w``).
    """
    return torch.einsum("ntd,qd->qnt", rms_norm(stored, eps=eps), w * gamma)


def mix_two_phase(ell: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Two-phase mixing of one query's logits ``ℓ:[N, T]`` over ``v:[N, T, d]``: the first ``N − 1``
    sources are the stored set, the last is merged as the partial sum."""
    return merge(phase1(ell[None, :-1], v[:-1])[0], ell[-1], v[-1])


def aggregate_two_phase(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    *,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    tile: int = 4,
    subtract_max: bool = True,
    eps: float = RMS_NORM_EPS,
) -> torch.Tensor:
    """One AttnRes call in two phases (stored = all sources but the last, partial = the last).

    Arguments as in :mod:`k3verify.attnres.inputs`; returns ``h:[T, d]`` in the stream dtype.
    ``tile`` and ``subtract_max`` are validated and unused.
    """
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    v, w, gamma, prec = prepare_sources(sources, w, gamma, opts)
    ell_stored = prec.logit("logits ℓ", stored_logits(v[:-1], w[None], gamma[None], eps))
    r = prec.logit("logits ℓ", logits(v[-1:], w, gamma, eps)[0])
    return prec.output(merge(phase1(ell_stored, v[:-1])[0], r, v[-1]))


class _ChunkwiseMixer(DepthStream):
    """Phase 1 at every block start for the block's calls; phase 2 per call."""

    def __init__(self, e: torch.Tensor, params: AttnResWeights, schedule: Schedule, prec: Precision, opts: Options):
        super().__init__(e, schedule, prec)
        self.params, self.eps = params, opts.eps
        self.stats: Stats | None = None
        self.first_query = 0

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        s, B = call.index, self.schedule.block_sublayers
        if s % B == 0:  # block start: the stored set is final for the whole block
            queries = slice(s, min(s + B, self.schedule.num_calls))
            stored = torch.stack(self.blocks)
            ell = stored_logits(stored, self.params.w[queries], self.params.gamma[queries], self.eps)
            self.stats, self.first_query = phase1(self.prec.logit("logits ℓ", ell), stored), s
        stats = self.stats[s - self.first_query]
        if self.partial is None:
            return merge(stats), tuple(self.block_refs)
        r = self.prec.logit("logits ℓ", logits(self.partial[None], self.params.w[s], self.params.gamma[s], self.eps)[0])
        return merge(stats, r, self.partial), (*self.block_refs, self.partial_ref)


def chunkwise(
    embedding: torch.Tensor,
    weights: AttnResWeights,
    sublayers: Sublayers,
    *,
    schedule: Schedule | None = None,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    tile: int = 4,
    subtract_max: bool = True,
    eps: float = RMS_NORM_EPS,
) -> Walk:
    """The depth walk with two-phase AttnRes over a stored-blocks buffer and one partial sum.

    Arguments as in :func:`k3verify.attnres.recurrent`; ``tile`` and ``subtract_max`` are
    validated and unused.
    """
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    return walk(embedding, weights, sublayers, schedule or Schedule(), opts, _ChunkwiseMixer)


# --- the backward (docs/model.md §3.1) ----------------------------------------------------------

GRADIENTS = ("dsources", "dw", "dgamma")
DELTAS = ("weights", "output")


def _keep(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


def aggregate_backward(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    *,
    dh: torch.Tensor,
    stream_dtype: torch.dtype | str | None = None,
    logit_dtype: torch.dtype | str | None = None,
    tile: int = 4,
    subtract_max: bool = True,
    eps: float = RMS_NORM_EPS,
    delta: str = "weights",
) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(h * dh)`` for one AttnRes call, by hand, through the two-phase form:
    the row statistics are phase 1's over the stored sources merged with the partial sum's logit
    (phase 2), ``M`` and ``Z'``; then every source's weight ``α_i = e^{ℓ_i − M} / Z'`` and

        dℓ_i = α_i (dh·v_i − δ),   δ = Σ_j α_j (dh·v_j)   (``delta="weights"``)
        dv_i = α_i dh + (g_i − v̂_i (v̂_i·g_i)/d) / r_i,   g_i = dℓ_i (w ⊙ γ)
        dw = Σ dℓ_i k_i,   dγ = Σ dℓ_i (w ⊙ v̂_i)

    with ``r_i = sqrt(mean(v_i²) + ε)``, ``v̂_i = v_i / r_i``, ``k_i = γ ⊙ v̂_i``. Arguments as
    :mod:`k3verify.attnres.inputs` plus ``dh:[T, d]``; returns ``dsources:[N, T, d]``, ``dw:[d]``,
    ``dgamma:[d]`` in the compute dtype (fp64 stays fp64). Never calls autograd. With a narrow
    ``stream_dtype`` it is the backward as a kernel stores it: sources, parameters and ``dh``
    arrive in the stream dtype, ``h`` (which ``δ`` reads) and ``dsources`` are stored in it, and
    logits, statistics and the parameters' gradients stay in fp32.

    ``delta="output"`` takes ``δ = dh·h`` instead, with ``h`` as stored, as FlashAttention-2 does with
    ``rowsum(dO ∘ O)`` (it cannot hold every key's ``dP``): equal in exact arithmetic, but in a bf16
    stream ``h`` is rounded, and ``dw``, ``dγ`` (sums of ``dℓ`` over every source and token) carry
    about twice the error (docs/model.md §3.1).
    """
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    v, w, gamma, prec = prepare_sources(sources, w, gamma, opts)
    if delta not in DELTAS:
        raise ValueError(f"delta is one of {', '.join(DELTAS)}, got {delta!r}")
    return two_phase_backward(v, w, gamma, dh.to(v.dtype), eps, cast=prec.store, delta=delta)


def two_phase_backward(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, dh: torch.Tensor, eps: float,
                       cast: Callable[[str, torch.Tensor], torch.Tensor] = _keep,
                       delta: str = "weights") -> dict[str, torch.Tensor]:
    """:func:`aggregate_backward`'s body on ``v:[N, T, d]`` in the compute dtype; ``cast(name, t)``
    sees what a kernel stores between its steps (the tiled form rounds there)."""
    d = v.shape[-1]
    r = torch.sqrt(v.square().mean(-1, keepdim=True) + eps)  # [N, T, 1]
    v_hat = v / r
    ell = (v_hat * (gamma * w)).sum(-1)  # [N, T]
    stats = phase1(ell[None, :-1], v[:-1])[0]  # the stored sources
    M = torch.maximum(stats.m, ell[-1])
    Z = torch.exp(stats.m - M) * stats.Z + torch.exp(ell[-1] - M)
    # α from the merged maximum and sum, not e^{ℓ − lse}: with logits near 100 the fp32 rounding of
    # lse = M + log Z' alone (ulp 7.6e-6) moves every weight by that much (docs/model.md §3.1).
    alpha = torch.exp(ell - M) / Z  # [N, T]
    h = cast("output h", torch.einsum("nt,ntd->td", alpha, v))
    dh = cast("input dh", dh)
    d_alpha = (dh * v).sum(-1)  # [N, T]
    delta_t = (alpha * d_alpha).sum(0) if delta == "weights" else (dh * h).sum(-1)
    d_ell = alpha * (d_alpha - delta_t)
    g = d_ell[..., None] * (w * gamma)
    dv = alpha[..., None] * dh + (g - v_hat * (v_hat * g).sum(-1, keepdim=True) / d) / r
    return {"dsources": cast("dsources", dv), "dw": (d_ell[..., None] * gamma * v_hat).sum((0, 1)),
            "dgamma": (d_ell[..., None] * w * v_hat).sum((0, 1))}

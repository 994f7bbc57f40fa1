"""Block AttnRes recurrent form — the definition, call by call over explicit source lists (docs/model.md §3).

One aggregation over sources ``v_0 … v_{N-1}`` (``[N, T, d]``, current partial sum last)::

    k_i = RMSNorm_γ(v_i) = γ ⊙ v_i / sqrt(mean(v_i²) + ε)       keys (ε = 1e-5)
    ℓ_i = wᵀ k_i                                                 logits, no temperature
    α = softmax_i(ℓ)                                             in the compute dtype (FP32 / FP64)
    h = Σ_i α_i v_i                                              raw values, not the keys

The walk (:func:`recurrent`) resolves every call's source list from :meth:`Schedule.calls` —
the embedding, or a sum of a range of sublayer outputs — from the list of all outputs so far
(sums formed left to right in the stream dtype, exactly as the running prefix is), and mixes it
one-shot. It keeps every output (``O(L·d)``): the definition, not the deployment.

In fp64 this is the oracle. :func:`naive_baseline` and :func:`naive_walk` are the same
computation as a plain implementation storing every tensor in a narrow dtype — the
``baseline`` rule's same-dtype baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..numerics import rounder
from ..numerics.ops import RMS_NORM_EPS, rms_norm
from .inputs import Options, Precision, Sublayers, check_sources, prepare_sources
from .layer import AttnResWeights, Walk, walk
from .schedule import BLOCK, EMBEDDING, Call, Schedule, Source


def keys(v: torch.Tensor, gamma: torch.Tensor, eps: float = RMS_NORM_EPS) -> torch.Tensor:
    """``RMSNorm_γ(v)`` over the last axis: ``[..., d]``, in ``v``'s dtype."""
    return rms_norm(v, gamma, eps=eps)


def logits(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float = RMS_NORM_EPS) -> torch.Tensor:
    """``ℓ = wᵀ RMSNorm_γ(v)``: ``v:[N, T, d] -> [N, T]``."""
    return keys(v, gamma, eps) @ w


def mix(ell: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One-shot softmax mixing: ``ℓ:[N, T]``, ``v:[N, T, d] -> h:[T, d]`` in ``ℓ``'s dtype."""
    alpha = torch.softmax(ell, dim=0)
    return torch.einsum("nt,ntd->td", alpha, v)


def _aggregate(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, prec: Precision, eps: float) -> torch.Tensor:
    return mix(prec.logit("logits ℓ", logits(v, w, gamma, eps)), v)


def aggregate(
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
    """The definition of one AttnRes call. Arguments as in :mod:`k3verify.attnres.inputs`.

    Returns ``h:[T, d]`` in the stream dtype. ``tile`` and ``subtract_max`` are validated and unused.
    """
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    v, w, gamma, prec = prepare_sources(sources, w, gamma, opts)
    return prec.output(_aggregate(v, w, gamma, prec, eps))


def naive_baseline(
    sources: torch.Tensor | Sequence[torch.Tensor],
    w: torch.Tensor,
    gamma: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    eps: float = RMS_NORM_EPS,
) -> torch.Tensor:
    """The definition as a plain implementation storing every tensor in ``dtype``.

    Sources, parameters, the keys and the output are rounded to ``dtype``; each operation
    computes in fp32 (fp64 for ``dtype=fp64``). Logits and the softmax stay in fp32, as docs/model.md §3
    states, so a form that stores its logits in bf16 does worse than this
    baseline. Returns fp32 holding ``dtype`` values.
    """
    v, _ = check_sources(sources, w, gamma)
    rnd = rounder(dtype)
    return _naive(rnd(v), rnd(w), rnd(gamma), rnd, Options(eps=eps).eps)


def _naive(v, w, gamma, rnd: Callable[[torch.Tensor], torch.Tensor], eps: float) -> torch.Tensor:
    return rnd(mix(rnd(keys(v, gamma, eps)) @ w, v))


class ExplicitSources:
    """Every sublayer output so far; a source of the schedule is resolved from them on demand.

    The sum over outputs ``[first, stop)`` is formed left to right with a rounding to the stream
    dtype after each addition — the same values the running prefix holds — and memoised.
    """

    def __init__(self, embedding: torch.Tensor, prec: Precision):
        self.embedding, self.prec = embedding, prec
        self.outputs: list[torch.Tensor] = []
        self._sums: dict[tuple[int, int], torch.Tensor] = {}

    def push(self, s: int, y: torch.Tensor) -> None:
        self.outputs.append(y)

    def resolve(self, source: Source) -> torch.Tensor:
        if source.kind == EMBEDDING:
            return self.embedding
        first, stop = source.first, source.stop
        if stop > len(self.outputs) or stop <= first:
            raise ValueError(f"source {source} needs sublayer outputs not produced yet ({len(self.outputs)} so far)")
        k = stop
        while k > first + 1 and (first, k) not in self._sums:
            k -= 1
        acc = self._sums.get((first, k), self.outputs[first])
        for j in range(k, stop):
            acc = self.prec.store("partial sum", acc + self.outputs[j])
            self._sums[(first, j + 1)] = acc
        return acc

    def stack(self, call: Call) -> torch.Tensor:
        return torch.stack([self.resolve(src) for src in call.sources])


class _RecurrentMixer(ExplicitSources):
    def __init__(self, e: torch.Tensor, params: AttnResWeights, schedule: Schedule, prec: Precision, opts: Options):
        super().__init__(e, prec)
        self.params, self.eps, self.schedule = params, opts.eps, schedule

    def stored(self) -> list[torch.Tensor]:
        """The embedding and every completed block, resolved as the sums the schedule names
        (memoised: the calls that mixed them formed them already)."""
        B = self.schedule.block_sublayers
        done = len(self.outputs) // B
        return [self.embedding, *(self.resolve(Source(BLOCK, b * B, (b + 1) * B)) for b in range(done))]

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        s = call.index
        return _aggregate(self.stack(call), self.params.w[s], self.params.gamma[s], self.prec, self.eps), call.sources


class _NaiveMixer(_RecurrentMixer):
    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        s = call.index
        store = self.prec.store
        h = _naive(self.stack(call), self.params.w[s], self.params.gamma[s], lambda x: store("naive", x), self.eps)
        return h, call.sources


def recurrent(
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
    """The depth walk by definition: every call mixes its explicit source list one-shot.

    ``embedding:[T, d]``; ``weights`` and ``sublayers`` as in :mod:`k3verify.attnres.layer`;
    ``schedule`` defaults to K3's (93 layers, blocks of 12). ``tile`` and ``subtract_max`` are
    validated and unused.
    """
    opts = Options(stream_dtype, logit_dtype, tile, subtract_max, eps)
    return walk(embedding, weights, sublayers, schedule or Schedule(), opts, _RecurrentMixer)


def naive_walk(
    embedding: torch.Tensor,
    weights: AttnResWeights,
    sublayers: Sublayers,
    *,
    dtype: torch.dtype | str,
    schedule: Schedule | None = None,
    eps: float = RMS_NORM_EPS,
) -> Walk:
    """The walk as a plain implementation in ``dtype``: :func:`naive_baseline` for every call
    and every stored tensor (stream, keys, mixtures, sublayer inputs and outputs) in ``dtype``."""
    return walk(embedding, weights, sublayers, schedule or Schedule(), Options(stream_dtype=dtype, eps=eps),
                _NaiveMixer)


def term_sizes(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, dh: torch.Tensor,
               eps: float = RMS_NORM_EPS) -> dict[str, torch.Tensor]:
    """The size of the terms one call's backward adds into ``dw`` and ``dγ``, per element.

    ``v:[N, T, d]``, ``w, gamma:[d]``, ``dh:[T, d]``; fp64 in, ``{"dw", "dgamma"}: [d]`` out.
    ``dw_j = Σ_{n,t} α (dα − δ) γ_j v̂_j`` with ``dα = dh·v``, ``δ = Σ_n α dα`` (``dγ`` with
    ``w_j`` for ``γ_j``): every form of the chain rule adds the products ``α dα k`` and ``α δ k``,
    so its rounding error is relative to ``Σ α (|dα| + |δ|) |k|``, however small the sum. Where a
    token's keys are alike the sum cancels far below its terms (``Σ_n dℓ_n = 0``)."""
    v_hat = v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps)
    alpha = torch.softmax((v_hat * gamma * w).sum(-1), dim=0)
    d_alpha = (dh * v).sum(-1)
    weight = (alpha * (d_alpha.abs() + (alpha * d_alpha).sum(0).abs()))[..., None]
    return {"dw": (weight * (gamma * v_hat).abs()).sum((0, 1)), "dgamma": (weight * (w * v_hat).abs()).sum((0, 1))}


class _RecordingMixer(_RecurrentMixer):
    """The recurrent mixer, keeping every call's stacked sources and output."""

    def __init__(self, *args: object):
        super().__init__(*args)
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        v = self.stack(call)
        s = call.index
        h = _aggregate(v, self.params.w[s], self.params.gamma[s], self.prec, self.eps)
        self.calls.append((s, v, h))
        return h, call.sources


def walk_term_sizes(embedding: torch.Tensor, weights: AttnResWeights, sublayers: Sublayers, *,
                    schedule: Schedule | None = None, dh: torch.Tensor,
                    eps: float = RMS_NORM_EPS) -> dict[str, torch.Tensor]:
    """:func:`term_sizes` of every call of the walk, for ``L = sum(output * dh)``.

    ``embedding, dh:[T, d]`` fp64; returns ``{"dw", "dgamma"}: [calls, d]`` (fp64; zero for a call
    that mixes one source, whose weights get no gradient). Each call's ``dh`` is the gradient
    reaching its output, from one fp64 backward through the recurrent walk."""
    if embedding.dtype != torch.float64 or dh.dtype != torch.float64:
        raise TypeError(f"walk_term_sizes computes in fp64; got {embedding.dtype} and {dh.dtype}")
    recorded: list[_RecordingMixer] = []

    def mixer(*args: object) -> _RecordingMixer:
        recorded.append(_RecordingMixer(*args))
        return recorded[0]

    with torch.enable_grad():
        e = embedding.detach().requires_grad_()
        out = walk(e, weights, sublayers, schedule or Schedule(), Options(eps=eps), mixer)
        calls = recorded[0].calls
        grads = torch.autograd.grad(out.output, [h for _, _, h in calls], dh, allow_unused=True)
    sizes = {name: torch.zeros_like(weights.w, dtype=torch.float64) for name in ("dw", "dgamma")}
    for (s, v, _), g in zip(calls, grads):
        if g is None or v.shape[0] == 1:
            continue
        one = term_sizes(v.detach(), weights.w[s], weights.gamma[s], g, eps)
        for name in sizes:
            sizes[name][s] = one[name]
    return sizes

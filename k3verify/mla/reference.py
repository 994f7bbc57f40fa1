"""Gated MLA attention by definition — expanded K/V, one causal softmax (docs/model.md §2.3).

For query ``t`` of request ``b`` at absolute position ``p = seq_lens[b] − T + t`` and every
cached key ``j <= p``, with the entry ``[ĉ_j ; k^p_j]`` read from the paged cache:

    k^n_{h,j} = W_UK,hᵀ ĉ_j,   v_{h,j} = W_UV,hᵀ ĉ_j                      (up-projection)
    s_{h,t,j} = τ (q^n_{h,t} · k^n_{h,j} + q^p_{h,t} · k^p_j),   τ = (Dn + Dr)^{-1/2}
    o_{h,t}   = Σ_j softmax_j(s_{h,t,·}) v_{h,j}

``k^p_j`` is one 64-vector shared by every head. In fp64 :func:`expanded` is the oracle every
other form is measured against; :func:`naive_baseline` is the same computation as a plain
implementation in a narrow dtype would run it (the ``baseline`` rule of the tolerance policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..numerics import rounder
from ..numerics.gradients import vjp
from .cache import LatentCache, gather, live_entries, split_entry, with_entries
from .inputs import Dims, FormOptions, check_inputs, heads_first, key_mask, working_dtype


def up_project(entries: torch.Tensor, w_uk: torch.Tensor,
               w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-head keys and values of cached entries, the shared rope key kept once.

    ``entries:[B, L, R + Dr]``, ``w_uk:[H, R, Dn]``, ``w_uv:[H, R, Dv]`` -> ``k^n:[B, H, L, Dn]``,
    ``v:[B, H, L, Dv]`` and ``k^p:[B, L, Dr]`` (a view of ``entries``). Computes in the inputs' dtype.
    """
    c_hat, k_pe = split_entry(entries, w_uk.shape[1])
    return torch.einsum("blr,hrn->bhln", c_hat, w_uk), torch.einsum("blr,hrv->bhlv", c_hat, w_uv), k_pe


def expand(entries: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from cached entries.

    ``entries:[B, L, R + Dr]``, ``w_uk:[H, R, Dn]``, ``w_uv:[H, R, Dv]`` ->
    ``K:[B, H, L, Dn + Dr]`` (``[k^n_h ; k^p]``, the ``k^p`` part identical for every head) and
    ``V:[B, H, L, Dv]``. Computes in the inputs' dtype.
    """
    k_nope, v, k_pe = up_project(entries, w_uk, w_uv)
    return torch.cat([k_nope, k_pe[:, None].expand(-1, w_uk.shape[0], -1, -1)], dim=-1), v


def expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    tile: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    num_splits: int = 1,
    subtract_max: bool = True,
    overflow: str = "nonfinite",
) -> torch.Tensor:
    """The definition, in the common signature (:mod:`k3verify.mla.inputs`).

    Computes in fp64 for fp64 inputs and in fp32 otherwise; returns ``o:[B, T, H, Dv]`` in the
    queries' dtype. The tiling options are validated and unused.
    """
    FormOptions(chunk_size, tile, operand_dtype, num_splits, subtract_max, overflow)
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    dtype = working_dtype(q_nope)
    entries, _ = gather(cache, dtype)
    o = _attention(q_nope.to(dtype), q_pe.to(dtype), entries, w_uk.to(dtype), w_uv.to(dtype), scale, dims, None)
    return o.to(q_nope.dtype)


def naive_baseline(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    scale: float | None = None,
    recompute_p: bool = False,
    prescale: bool = False,
) -> torch.Tensor:
    """The definition as a plain implementation storing every tensor in ``dtype``.

    Inputs (queries, weights, cached entries — dequantised first for an fp8 cache), the
    expanded keys and values, the raw and the scaled scores, the probabilities and the output
    are each rounded to ``dtype``; every operation computes in fp32 (fp64 for ``dtype=fp64``)
    and rounds its result, which is what torch does for bf16/fp16 tensors (its softmax
    evaluates in fp32 and rounds once). Returns fp32 holding ``dtype`` values.

    ``recompute_p``: under autograd, the attention's backward recomputes the probabilities from
    the row log-sum-exp, ``P = e^{s - lse}`` (:class:`_AttentionFromLse`), as a FlashAttention
    backward does instead of storing ``P``; the forward is unchanged. ``prescale``: the scores
    are the product of ``q √τ`` and ``K √τ``, each stored (torch SDPA's math backend scales both
    operands so), instead of ``τ (q Kᵀ)``.
    """
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    rnd = rounder(dtype)
    entries, _ = gather(cache, torch.float64)
    o = _attention(rnd(q_nope), rnd(q_pe), rnd(entries), rnd(w_uk), rnd(w_uv), scale, dims, rnd, recompute_p,
                   prescale)
    return o


Keep = Callable[[torch.Tensor], torch.Tensor]  # how a baseline stores a tensor


class _AttentionFromLse(torch.autograd.Function):
    """``o = keep(softmax(s) V)`` over the last axis of the masked scores ``s:[..., T, L]`` with
    ``V:[..., L, Dv]``, whose backward is a FlashAttention backward without tiles: the
    probabilities recomputed from the scores and the row log-sum-exp kept by the forward,
    ``P = keep(e^{s - lse})``, then ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - δ)`` with
    ``δ = rowsum(dO ∘ o)`` on the stored output; ``keep`` stores each of them.

    The recomputation rounds ``s - lse``, a difference of two numbers of the logits' size: each
    probability carries a relative error of about ``|lse| · u`` (u: the working dtype's unit
    roundoff) that a stored softmax does not have, the largest error of an fp32 FlashAttention
    backward where logits are large (the ``hot`` case)."""

    @staticmethod
    def forward(ctx: Any, s: torch.Tensor, v: torch.Tensor, keep: Keep) -> torch.Tensor:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        o = keep(keep(torch.softmax(s, dim=-1)) @ v)
        ctx.save_for_backward(s, lse, v, o)
        ctx.keep = keep
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        s, lse, v, o = ctx.saved_tensors
        keep = ctx.keep
        p = keep(torch.exp(s - lse))  # masked scores: e^{-inf} = 0
        dv = keep(p.transpose(-1, -2) @ do)
        dp = keep(do @ v.transpose(-1, -2))
        delta = (do * o).sum(-1, keepdim=True)
        return keep(p * (dp - delta)), dv, None


def _attention(q_nope, q_pe, entries, w_uk, w_uv, scale: float, dims: Dims,
               rnd: Keep | None, recompute_p: bool = False,
               prescale: bool = False) -> torch.Tensor:
    """Shared body; ``rnd`` (or identity) is applied to every stored intermediate;
    ``recompute_p``: the softmax and its product with ``V`` are :class:`_AttentionFromLse`;
    ``prescale``: the scores are ``(q √τ)(K √τ)ᵀ`` rather than ``τ (q Kᵀ)``."""
    keep = rnd if rnd is not None else (lambda x: x)
    K, V = expand(entries, w_uk, w_uv)
    K, V = keep(K), keep(V)
    q = torch.cat([heads_first(q_nope), heads_first(q_pe)], dim=-1)  # [B, H, T, Dn + Dr]
    if prescale:
        root = math.sqrt(scale)
        s = keep(keep(q * root) @ keep(K * root).transpose(-1, -2))
    else:
        s = keep(keep(q @ K.transpose(-1, -2)) * scale)
    visible = key_mask(dims, torch.arange(K.shape[2], device=K.device)[None, :].expand(dims.B, -1))
    s = s.masked_fill(~visible, float("-inf"))
    if recompute_p:
        return keep(_AttentionFromLse.apply(s, V, keep)).transpose(1, 2)
    p = keep(torch.softmax(s, dim=-1))
    return keep(p @ V).transpose(1, 2)  # [B, T, H, Dv]


GRADIENTS = ("dq_nope", "dq_pe", "dkv", "dw_uk", "dw_uv")


def autograd_backward(
    form: Callable[..., torch.Tensor],
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    do: torch.Tensor,
    scale: float | None = None,
    **options: object,
) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(o * do)`` through a differentiable MLA ``form`` (docs/model.md §2.6).

    Returns ``dq_nope, dq_pe`` (like the queries), ``dkv:[B, Lmax, R + Dr]`` (the live latent
    entries' gradient in :func:`~k3verify.mla.cache.live_entries`' order, zero past each
    request's length) and ``dw_uk, dw_uv``; fp64 inputs give fp64 gradients. Through
    :func:`expanded` in fp64 this is the gradient oracle.
    """
    check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    entries = live_entries(cache)

    def forward(q_nope, q_pe, kv, w_uk, w_uv):
        return {"o": form(q_nope, q_pe, with_entries(cache, kv), w_uk, w_uv, scale=scale, **options)}

    grads = vjp(forward, dict(q_nope=q_nope, q_pe=q_pe, kv=entries, w_uk=w_uk, w_uv=w_uv), {"o": do})
    return {n: grads[n] for n in GRADIENTS}


def expanded_backward(q_nope, q_pe, cache, w_uk, w_uv, *, do, scale=None, **options) -> dict[str, torch.Tensor]:
    """The oracle's gradients: :func:`autograd_backward` through :func:`expanded`."""
    return autograd_backward(expanded, q_nope, q_pe, cache, w_uk, w_uv, do=do, scale=scale, **options)

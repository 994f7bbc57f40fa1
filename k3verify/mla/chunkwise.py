"""Gated MLA chunkwise form — expanded chunked prefill merged by log-sum-exp (docs/model.md §2.3).

The ``T`` new query tokens are processed in chunks of ``C``. For the chunk starting at absolute
position ``a_b`` of request ``b`` the keys fall in two disjoint parts:

- ``prefix``: positions ``j < a_b`` — earlier context and earlier chunks, read from the paged
  cache and up-projected (``k^n = W_UK,hᵀ ĉ``, ``v = W_UV,hᵀ ĉ``), every one visible;
- ``self``: the chunk's own tokens ``a_b <= j < a_b + C``, visible causally (``j <= p``).

Each part gives a normalised partial output and log-sum-exp (:mod:`k3verify.mla.softmax`):

    L = log(e^{L_prefix} + e^{L_self}),   o = e^{L_prefix − L} o_prefix + e^{L_self − L} o_self

A request without earlier tokens has an empty prefix, ``L_prefix = −∞``, weight exactly 0 —
the first chunk of a fresh prefill takes that path and must not produce NaN. The ``self``
part is never empty: a query always sees itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cache import LatentCache, gather, split_entry
from .inputs import Dims, FormOptions, check_inputs, heads_first, key_mask, working_dtype
from .reference import expand
from .softmax import merge_partials, partial_attention


def chunkwise(
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
    """Expanded prefill in query chunks of ``chunk_size`` (a partial last chunk is fine).

    Arguments as in :mod:`k3verify.mla.inputs`; computes in fp64 for fp64 inputs and in fp32
    otherwise; returns ``o:[B, T, H, Dv]`` in the queries' dtype. The tiling options are
    validated and unused.
    """
    opts = FormOptions(chunk_size, tile, operand_dtype, num_splits, subtract_max, overflow)
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    dtype = working_dtype(q_nope)
    entries, _ = gather(cache, dtype)
    w_uk, w_uv = w_uk.to(dtype), w_uv.to(dtype)
    q = torch.cat([heads_first(q_nope), heads_first(q_pe)], dim=-1).to(dtype)  # [B, H, T, Dn + Dr]
    lens = torch.tensor(dims.lengths, dtype=torch.int64, device=entries.device)
    first_query = lens - dims.T  # absolute position of query 0 of each request
    out = torch.empty(dims.B, dims.H, dims.T, dims.Dv, dtype=dtype, device=entries.device)
    for t0 in range(0, dims.T, opts.chunk_size):
        t1 = min(dims.T, t0 + opts.chunk_size)
        start = first_query + t0  # [B]: first position of this chunk
        parts = [
            _prefix_part(q[:, :, t0:t1], entries, start, w_uk, w_uv, scale),
            _self_part(q[:, :, t0:t1], entries, start, t0, t1, w_uk, w_uv, scale, dims),
        ]
        out[:, :, t0:t1] = merge_partials(parts)[0]
    return out.transpose(1, 2).to(q_nope.dtype)


def _prefix_part(q, entries, start, w_uk, w_uv, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier tokens ``j < start[b]``, all visible; ``(o, lse)`` with ``lse = −inf`` where none exist."""
    n = int(start.max())
    prefix = entries[:, :n]  # up-projected only as far as some request has earlier tokens
    K, V = expand(prefix, w_uk, w_uv)
    visible = (torch.arange(n, device=start.device)[None, :] < start[:, None])[:, None, None, :]
    return partial_attention(scale * (q @ K.transpose(-1, -2)), visible, V)


def _chunk_positions(start: torch.Tensor, n: int) -> torch.Tensor:
    return start[:, None] + torch.arange(n, device=start.device)[None, :]


def _self_part(q, entries, start, t0: int, t1: int, w_uk, w_uv, scale: float,
               dims) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's own tokens, visible causally."""
    positions = _chunk_positions(start, t1 - t0)  # [B, n], all live: a chunk's tokens are cached
    own = torch.gather(entries, 1, positions[..., None].expand(-1, -1, entries.shape[-1]))
    K, V = expand(own, w_uk, w_uv)
    visible = key_mask(dims, positions)[:, :, t0:t1]
    return partial_attention(scale * (q @ K.transpose(-1, -2)), visible, V)


Cast = Callable[[str, torch.Tensor], torch.Tensor]


def _keep(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


def chunkwise_backward(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    do: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    tile: int = 64,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    num_splits: int = 1,
    subtract_max: bool = True,
    overflow: str = "nonfinite",
) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(o * do)`` for the expanded prefill, by hand: FlashAttention-2's
    backward over key tiles of ``tile`` tokens, then through the up-projections to the latent
    entries (docs/model.md §2.6). Arguments as :mod:`k3verify.mla.inputs` plus the cotangent
    ``do:[B, T, H, Dv]``; returns what :func:`k3verify.mla.reference.autograd_backward` returns.
    Computes in fp64 for fp64 inputs and in fp32 otherwise; never calls autograd.
    """
    FormOptions(chunk_size, tile, operand_dtype, num_splits, subtract_max, overflow)
    x, scale, dims = backward_operands(q_nope, q_pe, cache, w_uk, w_uv, do, scale)
    return attention_backward(*x, scale, dims, key_tile=tile)


def backward_operands(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                      w_uv: torch.Tensor, do: torch.Tensor, scale: float | None,
                      dtype: torch.dtype | None = None) -> tuple[tuple[torch.Tensor, ...], float, Dims]:
    """A backward call checked and laid out for :func:`attention_backward`: ``(q_nope, q_pe,
    entries, w_uk, w_uv, do)`` with the cache's live entries gathered (``[B, L, R + Dr]``), all in
    ``dtype`` (default: the working dtype, fp64 for fp64 inputs and fp32 otherwise), the
    effective scale and the sizes."""
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    dtype = working_dtype(q_nope) if dtype is None else dtype
    entries, _ = gather(cache, dtype)
    return tuple(t.to(dtype) for t in (q_nope, q_pe, entries, w_uk, w_uv, do)), scale, dims


def attention_backward(q_nope, q_pe, entries, w_uk, w_uv, do, scale: float, dims: Dims, *, key_tile: int,
                       cast: Cast = _keep, output: Cast = _keep, delta_from: str = "output") -> dict[str, torch.Tensor]:
    """The backward's body on gathered ``entries:[B, L, R + Dr]`` (every tensor in the working dtype).

    The forward's statistics are recomputed as a kernel keeps them: the row log-sum-exp ``lse``
    and the output ``O`` (``output(name, t)`` stores it, in the output dtype for a low-precision
    run). Per key tile: ``P = e^{S - lse}``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``,
    ``dS = P ∘ (dP - δ)`` with ``δ = rowsum(dO ∘ O)`` (``delta_from="output"``: the stored ``O``;
    ``"fp32"``: ``O`` as accumulated), ``dQ += τ dS K``, ``dK = τ dSᵀ Q``. ``cast(name, t)`` sees
    every matrix-product operand. Then ``K = [ĉ W_UK ; k^p]``, ``V = ĉ W_UV`` carry ``dK, dV`` to the
    latent entries and the up-projections.
    """
    if delta_from not in ("output", "fp32"):
        raise ValueError(f"delta_from is 'output' or 'fp32', got {delta_from!r}")
    R, Dn = w_uk.shape[1], w_uk.shape[2]
    entries, w_uk, w_uv = cast("input entries", entries), cast("input w_uk", w_uk), cast("input w_uv", w_uv)
    K, V = expand(entries, w_uk, w_uv)
    K, V = cast("expanded K", K), cast("expanded V", V)  # a training kernel reads them from memory
    q = cast("input q", torch.cat([heads_first(q_nope), heads_first(q_pe)], dim=-1))  # [B, H, T, Dn + Dr]
    dO = cast("input do", heads_first(do))  # [B, H, T, Dv]
    L = K.shape[2]
    visible = key_mask(dims, torch.arange(L, device=K.device)[None, :].expand(dims.B, -1))  # [B, 1, T, L]
    s = (scale * (q @ K.transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # every query sees itself: finite
    O = torch.softmax(s, dim=-1) @ V
    stored = output("output o", O)
    delta = (dO * (stored if delta_from == "output" else O)).sum(-1)  # [B, H, T]
    dQ = torch.zeros_like(q)
    dK, dV = torch.zeros_like(K), torch.zeros_like(V)
    for j0 in range(0, L, key_tile):
        j1 = min(L, j0 + key_tile)
        P = torch.exp(s[..., j0:j1] - lse[..., None])  # masked keys: e^{-inf} = 0
        dV[:, :, j0:j1] = cast("P", P).transpose(-1, -2) @ dO
        dS = cast("dS", P * (dO @ V[:, :, j0:j1].transpose(-1, -2) - delta[..., None]))
        dQ += scale * (dS @ K[:, :, j0:j1])
        dK[:, :, j0:j1] = scale * (dS.transpose(-1, -2) @ q)
    c_hat, _ = split_entry(entries, R)
    dKn, dV_op = cast("key gradient", dK[..., :Dn]), cast("value gradient", dV)
    dc = torch.einsum("bhln,hrn->blr", dKn, w_uk) + torch.einsum("bhlv,hrv->blr", dV_op, w_uv)
    dq = dQ.transpose(1, 2)  # [B, T, H, Dn + Dr]
    return {
        "dq_nope": output("dq_nope", dq[..., :Dn]),
        "dq_pe": output("dq_pe", dq[..., Dn:]),
        "dkv": output("dkv", torch.cat([dc, dK[..., Dn:].sum(1)], dim=-1)),
        "dw_uk": torch.einsum("blr,bhln->hrn", c_hat, dKn),
        "dw_uv": torch.einsum("blr,bhlv->hrv", c_hat, dV_op),
    }

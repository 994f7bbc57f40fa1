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

import torch

from .cache import LatentCache, gather
from .inputs import FormOptions, check_inputs, heads_first, key_mask, working_dtype
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

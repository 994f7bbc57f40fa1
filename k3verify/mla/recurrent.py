"""Gated MLA recurrent form — absorbed decode over the paged latent cache (docs/model.md §2.4).

One query token at a time, exactly as a decode step runs it; no per-head key or value is ever
formed. With ``W_UK_T`` and ``W_UV`` the per-head up-projections prepared for absorption
(vLLM's names):

    q̃_h = W_UK,h q^n_h ∈ ℝ^R                                  (BMM1: absorb W_UK into the query)
    s_{h,j} = τ ([q̃_h ; q^p_h] · [ĉ_j ; k^p_j])                 (latent MQA over the R + Dr cache entry)
    õ_h = Σ_j softmax_j(s_{h,·}) ĉ_j ∈ ℝ^R
    o_h = W_UV,hᵀ õ_h                                          (BMM2: absorb W_UV into the output)

By associativity ``q̃_h · ĉ_j = q^n_h · (W_UK,hᵀ ĉ_j) = q^n_h · k^n_{h,j}`` and
``W_UV,hᵀ Σ_j P_j ĉ_j = Σ_j P_j v_{h,j}``, so in exact arithmetic this equals the expanded
definition of :mod:`k3verify.mla.reference`; in fp64 the two agree to rounding (≤ 1e-10
relative is the policy's bar). The softmax scale is ``τ = (Dn + Dr)^{-1/2}``, the qk head dim
of the *expanded* heads, even though the dot product here runs over ``R + Dr`` numbers.
"""

from __future__ import annotations

import torch

from .cache import LatentCache, gather, split_entry
from .inputs import FormOptions, check_inputs, heads_first, query_positions, working_dtype


def recurrent(
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
    """Absorbed decode, one query token per step. Arguments as in :mod:`k3verify.mla.inputs`.

    Computes in fp64 for fp64 inputs and in fp32 otherwise; returns ``o:[B, T, H, Dv]`` in the
    queries' dtype. ``chunk_size`` and the tiling options are validated and unused.
    """
    FormOptions(chunk_size, tile, operand_dtype, num_splits, subtract_max, overflow)
    dims, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    dtype = working_dtype(q_nope)
    entries, _ = gather(cache, dtype)  # [B, L, R + Dr]; dead positions are zeros
    c_hat, _ = split_entry(entries, dims.R)
    q_abs = absorb_query(q_nope.to(dtype), w_uk.to(dtype))  # [B, T, H, R]
    q_full = heads_first(torch.cat([q_abs, q_pe.to(dtype)], dim=-1))  # [B, H, T, R + Dr]
    positions = query_positions(dims, entries.device)  # [B, T]
    keys = torch.arange(entries.shape[1], device=entries.device)
    o_latent = torch.empty(dims.B, dims.H, dims.T, dims.R, dtype=dtype, device=entries.device)
    for t in range(dims.T):
        s = scale * torch.einsum("bhw,blw->bhl", q_full[:, :, t], entries)
        visible = keys[None, :] <= positions[:, t, None]  # [B, L]: causal, hence live
        p = torch.softmax(s.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        o_latent[:, :, t] = torch.einsum("bhl,blr->bhr", p, c_hat)
    return absorb_output(o_latent, w_uv.to(dtype)).to(q_nope.dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """BMM1: ``q̃_h = W_UK,h q^n_h``. ``q_nope:[B, T, H, Dn]``, ``w_uk:[H, R, Dn]`` -> ``[B, T, H, R]``."""
    return torch.einsum("bthn,hrn->bthr", q_nope, w_uk)


def absorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """BMM2: ``o_h = W_UV,hᵀ õ_h``. ``o_latent:[B, H, T, R]``, ``w_uv:[H, R, Dv]`` -> ``[B, T, H, Dv]``."""
    return torch.einsum("bhtr,hrv->bthv", o_latent, w_uv)

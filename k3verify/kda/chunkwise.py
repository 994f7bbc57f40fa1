"""KDA chunkwise form — the parallel WY/UT matrix form (docs/model.md §1.5).

Inside each chunk of ``C`` tokens, with inclusive chunk-local prefix ``G_r = sum_{s<=r} g_s``:

    A_kk[r,c] = beta_r * sum_d k_r[d] k_c[d] exp(G_r[d] - G_c[d])      (c < r)
    A_qk[r,c] = scale * sum_d q_r[d] k_c[d] exp(G_r[d] - G_c[d])       (c <= r)
    M = (I + A_kk)^{-1} Diag(beta),  W = M (exp(G) * K),  U = M V
    V~ = U - W S,  O = (exp(G) * Q) scale S + A_qk V~
    S <- Diag(exp(G_C)) S + (K * exp(G_C - G))^T V~

The pairwise decays ``exp(G_r - G_c)`` with ``c <= r`` are all ``<= 1``, so this form cannot
overflow for any gate; it is the exact reference for the tiled form. Everything except the
chunk-to-chunk state pass is vectorised over batch, heads and chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..numerics import rounder, storage_for
from ..numerics.validate import require_block
from .inputs import check_inputs, from_chunks, initial, to_chunks, working_dtype

# Sub-tile of the exact two-level split. Measured at T=4096, H=4, K=V=128, C=64 on two
# cores: 16 beats 8 (0.86 s vs 1.0 s) and 4 (2.7 s); the pairwise diagonal work dominates.
EXACT_SUB_TILE = 16

Cast = Callable[[str, torch.Tensor], torch.Tensor]


def _keep(name: str, t: torch.Tensor) -> torch.Tensor:
    return t


def chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA for any ``chunk_size`` (a partial last chunk is zero-padded).

    Same arguments and returns as :func:`k3verify.kda.recurrent`; fp64 stays fp64.
    """
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    C = require_block("chunk_size", chunk_size)
    dtype = working_dtype(q)
    S = initial(initial_state, dims, dtype, q.device)
    if dims.T == 0:
        return v.new_zeros(dims.B, 0, dims.H, dims.V), (S if output_final_state else None)
    qc, kc, vc, gc = (to_chunks(t.to(dtype), C) for t in (q, k, v, g))
    bc = to_chunks(beta.to(dtype)[..., None], C)[..., 0]
    G = gc.cumsum(-2)
    A = decayed_products({"q": qc, "k": kc}, kc, G, tile=_exact_tile(C))
    O, S = wy_pipeline(qc, kc, vc, bc, G, A, S, scale)
    return from_chunks(O, dims.T).to(v.dtype), (S if output_final_state else None)


def naive_chunk_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunkwise form as a plain implementation in ``dtype`` would run it.

    Inputs and every stored matrix (``A_qk, A_kk, M, W, U, V~``, the state after each chunk
    and the output) are rounded to ``dtype``; arithmetic is fp32 per operation. The log-decay
    and its prefix sums stay fp32, as in every kernel (gates arrive in fp32). This is the
    same-dtype baseline for chunk-parallel implementations: it shares their algorithm, so
    the fp32 cancellation in ``G_r - G_c`` that any chunked form suffers is in it too.
    Returns fp32 tensors holding ``dtype`` values (fp64 for ``dtype=fp64``).
    """
    dims, scale = check_inputs(q, k, v, g, beta, initial_state, scale)
    C = require_block("chunk_size", chunk_size)
    rnd, storage = rounder(dtype), storage_for(dtype)

    def keep(name: str, x: torch.Tensor) -> torch.Tensor:
        return rnd(x)

    S = keep("state", initial(initial_state, dims, storage, q.device))
    if dims.T == 0:
        return torch.zeros(dims.B, 0, dims.H, dims.V, dtype=storage), (S if output_final_state else None)
    qc, kc, vc = (to_chunks(keep("input", t), C) for t in (q, k, v))
    bc = to_chunks(keep("input", beta)[..., None], C)[..., 0]
    G = to_chunks(g.to(storage), C).cumsum(-2)
    A = decayed_products({"q": qc, "k": kc}, kc, G, tile=_exact_tile(C))
    O, S = wy_pipeline(qc, kc, vc, bc, G, A, S, scale, cast=keep, store=keep)
    return keep("output", from_chunks(O, dims.T)), (S if output_final_state else None)


def wy_pipeline(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    bc: torch.Tensor,
    G: torch.Tensor,
    A: dict[str, torch.Tensor],
    S: torch.Tensor,
    scale: float,
    *,
    cast: Cast = _keep,
    store: Cast = _keep,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything after the intra-chunk products: WY inverse, pseudo-values, outputs, state.

    ``qc, kc:[B,H,N,C,K]``, ``vc:[B,H,N,C,V]``, ``bc:[B,H,N,C]``, ``G`` the inclusive prefixes,
    ``A = {"q": A_qk, "k": A_kk}`` unscaled and unmasked from :func:`decayed_products`,
    ``S:[B,H,K,V]``. ``cast`` sees every matrix-product operand; ``store`` sees what a kernel
    keeps in its accumulator dtype but a plain implementation stores (``A_kk``, the state).
    Returns ``O:[B,H,N,C,V]`` and the final state.
    """
    A_qk = cast("A_qk", A["q"] * scale)
    A_kk = store("A_kk", A["k"].tril(-1) * bc[..., :, None])
    M = cast("M = (I + A_kk)^-1 Diag(beta)", wy_inverse(A_kk, bc))
    gamma = torch.exp(G)
    W = cast("W", M @ cast("exp(G) * k", gamma * kc))
    U = cast("U", M @ vc)
    q_decayed = cast("exp(G) * q", gamma * qc)
    k_to_end = cast("k * exp(G_C - G)", kc * torch.exp(G[..., -1:, :] - G))
    O = torch.empty_like(U)
    for n in range(G.shape[2]):
        S_op = cast("state", S)
        v_new = cast("pseudo-values V~", U[:, :, n] - W[:, :, n] @ S_op)
        O[:, :, n] = scale * (q_decayed[:, :, n] @ S_op) + A_qk[:, :, n] @ v_new
        S = store("state", torch.exp(G[:, :, n, -1])[..., None] * S + k_to_end[:, :, n].transpose(-1, -2) @ v_new)
    return O, S


def decayed_products(
    xs: dict[str, torch.Tensor],
    k: torch.Tensor,
    G: torch.Tensor,
    *,
    tile: int = EXACT_SUB_TILE,
    cast: Cast = _keep,
    diagonal_anchor: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``A_x[r,c] = sum_d x_r[d] k_c[d] exp(G_r[d] - G_c[d])`` for ``c <= r``, for each ``x``.

    ``xs[name], k, G: [..., C, D]`` with ``C`` a multiple of ``tile``; returns ``[..., C, C]``
    lower-triangular matrices under the same names (diagonal kept; mask it for ``c < r``).

    Two-level split (docs/model.md §1.6): for a key tile ``J`` before the query tile ``I`` the decay is
    ``exp(G_r - a_I) * exp(a_I - G_c)`` with ``a_I`` the prefix at the start of tile ``I``, so
    both factors are ``<= 1`` and the block is one matrix product. Diagonal tiles are formed
    pair by pair (exact, never overflowing) unless ``diagonal_anchor:[..., C/tile, D]`` is
    given; then they too are a product split at that anchor. ``cast(name, t)`` sees every
    matrix-product operand (the tiled form rounds them there).
    """
    C, D = G.shape[-2:]
    nT = C // tile
    if nT * tile != C:
        raise ValueError(f"chunk size {C} is not a multiple of the sub-tile {tile}")
    lead = G.shape[:-2]
    Gt = G.reshape(*lead, nT, tile, D)
    kt = k.reshape(*lead, nT, tile, D)
    start = tile_start_prefix(Gt)  # [..., nT, D]
    # Key factors for every (query tile I, key tile J < I); blocks with J >= I are exact zeros.
    earlier = torch.ones(nT, nT, dtype=torch.bool, device=G.device).tril(-1)  # [I, J]
    key_exp = start[..., :, None, None, :] - Gt[..., None, :, :, :]  # [..., I, J, tile, D]
    key_exp = key_exp.masked_fill(~earlier[:, :, None, None], float("-inf"))
    k_off = cast("off-diagonal key operand", kt[..., None, :, :, :] * torch.exp(key_exp))
    k_off = k_off.reshape(*lead, nT, C, D)
    if diagonal_anchor is not None:
        k_diag = cast("diagonal key operand", kt * torch.exp(diagonal_anchor[..., None, :] - Gt))
    else:
        within = torch.ones(tile, tile, dtype=torch.bool, device=G.device).tril()
        pair_exp = (Gt[..., :, None, :] - Gt[..., None, :, :]).masked_fill(~within[..., None], float("-inf"))
        pair_decay = torch.exp(pair_exp) * cast("diagonal key operand", kt)[..., None, :, :]  # [..., nT, r, c, D]
    out = {}
    for name, x in xs.items():
        xt = x.reshape(*lead, nT, tile, D)
        x_off = cast(f"off-diagonal {name} operand", xt * torch.exp(Gt - start[..., None, :]))
        A = (x_off @ k_off.transpose(-1, -2)).reshape(*lead, nT, tile, nT, tile)
        if diagonal_anchor is not None:
            x_diag = cast(f"diagonal {name} operand", xt * torch.exp(Gt - diagonal_anchor[..., None, :]))
            A_diag = x_diag @ k_diag.transpose(-1, -2)
        else:
            A_diag = torch.einsum("...rd,...rcd->...rc", cast(f"diagonal {name} operand", xt), pair_decay)
        # The diagonal blocks of A are exact zeros so far; write the diagonal tiles into them.
        A.diagonal(dim1=-4, dim2=-2).copy_(A_diag.movedim(-3, -1))
        out[name] = A.reshape(*lead, C, C).tril()
    return out


def tile_start_prefix(Gt: torch.Tensor) -> torch.Tensor:
    """Prefix at each tile's start boundary: ``Gt:[..., nT, BC, D] -> [..., nT, D]``.

    0 for the first tile of a chunk, else the inclusive prefix of the previous tile's last row.
    """
    return torch.cat([torch.zeros_like(Gt[..., :1, -1, :]), Gt[..., :-1, -1, :]], dim=-2)


def _exact_tile(chunk_size: int) -> int:
    """Largest divisor of ``chunk_size`` not above ``EXACT_SUB_TILE`` (any chunk size works)."""
    return max(d for d in range(1, min(chunk_size, EXACT_SUB_TILE) + 1) if chunk_size % d == 0)


def wy_inverse(A_kk: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``M = (I + A_kk)^{-1} Diag(beta)`` for strictly lower triangular ``A_kk:[..., C, C]``.

    ``I + A_kk`` is unit lower triangular, so a batched triangular solve gives the exact
    forward substitution without a Python loop over rows.
    """
    C = A_kk.shape[-1]
    eye = torch.eye(C, dtype=A_kk.dtype, device=A_kk.device)
    return torch.linalg.solve_triangular(eye + A_kk, torch.diag_embed(beta), upper=False, unitriangular=True)

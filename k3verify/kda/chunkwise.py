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

``chunkwise_backward`` is its backward written by hand, the way production kernels compute it
(docs/model.md §1.9): recompute the WY quantities and the state entering each chunk, carry the
state gradient backward over the chunks, then form the intra-chunk gradients; the gate's
gradient is the reverse cumulative sum, over the chunk, of the gradient of its prefix ``G``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..numerics import rounder, storage_for
from ..numerics.validate import require_block
from .gate import InKernelGate, lower_bound_gate_backward
from .inputs import (
    Dims,
    check_backward,
    check_inputs,
    from_chunks,
    initial,
    to_chunks,
    working_dtype,
)

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


GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


def _cumsum(gc: torch.Tensor) -> torch.Tensor:
    return gc.cumsum(-2)


@dataclass(frozen=True)
class Emulation:
    """How the backward rounds (the tiled form's choices; the defaults are the exact backward).

    ``cast(name, t)`` sees every matrix-product operand and every stored input; ``split(name, t)``
    the operands of the backward's split diagonal products; ``accumulate(name, t)`` what stays in
    the accumulator but can leave its range (the products' cotangents, the split products multiplied
    back up: the tiled form traces their overflow there); ``tile`` is the sub-tile of the two-level split (``None``:
    the exact :data:`EXACT_SUB_TILE`); ``anchor(Gt:[..., nT, BC, D]) -> [..., nT, D]`` splits the
    diagonal tiles (``None``: pair by pair, exact); ``prefix(g_chunks)`` sums the chunk-local
    prefixes along the rows; ``outputs(name, t)`` stores each gradient.
    """

    cast: Cast = _keep
    split: Cast = _keep
    accumulate: Cast = _keep
    tile: int | None = None
    anchor: Callable[[torch.Tensor], torch.Tensor] | None = None
    prefix: Callable[[torch.Tensor], torch.Tensor] = _cumsum
    outputs: Cast = _keep


EXACT = Emulation()


def chunkwise_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    gate: InKernelGate | None = None,
) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(o * do) + sum(S_T * dht)`` for :func:`chunkwise`, by hand.

    Arguments and returns as :func:`k3verify.kda.recurrent.autograd_backward` (``cu_seqlens``
    packs sequences along ``T`` with ``B = 1``; every chunk starts at its sequence's start). The
    arithmetic runs in the working dtype: fp64 for fp64 inputs, fp32 otherwise.
    """
    return backward(q, k, v, g, beta, do=do, dht=dht, scale=scale, initial_state=initial_state,
                    chunk_size=chunk_size, cu_seqlens=cu_seqlens, gate=gate, dtype=working_dtype(q))


def naive_backward_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    gate: InKernelGate | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`chunkwise_backward` as a plain implementation in ``dtype`` runs it: every tensor it
    stores rounded to ``dtype`` (the inputs and cotangents, every product operand, the state and
    its gradient, the gradients but the gate's), the arithmetic in fp32 (in fp64 for fp64, then
    exact), no tiles or anchors. The gates, their prefix sums and ``dg`` stay fp32, as in the
    naive forward baselines.

    It is the chunkwise family's baseline for the backward: a chunkwise kernel computes ``dg`` as
    the reverse prefix sum of ``q * dq - k * dk`` (and the state's term), a difference of terms
    that can be hundreds of times larger than ``dg``, so its error follows the terms; autograd
    through a naive forward never forms that difference (docs/modules/kda.md, "The backward's
    baselines")."""
    rnd = rounder(dtype)
    exempt = ("dg", "dA_log", "ddt_bias")
    em = Emulation(cast=lambda name, t: rnd(t), outputs=lambda name, t: t if name in exempt else rnd(t))
    return backward(q, k, v, g, beta, do=do, dht=dht, scale=scale, initial_state=initial_state,
                    chunk_size=chunk_size, cu_seqlens=cu_seqlens, gate=gate, dtype=storage_for(dtype), emulation=em)


def backward(q, k, v, g, beta, *, do, dht, scale, initial_state, chunk_size: int, cu_seqlens, gate,
             dtype: torch.dtype, emulation: Emulation = EXACT, record: dict | None = None) -> dict[str, torch.Tensor]:
    """:func:`chunkwise_backward` in ``dtype`` with ``emulation``'s rounding (the tiled backward
    passes its own). ``record``, when given, receives per sequence the cotangents of the decayed
    products (``"D_q"``, ``"D_k"``: lists of ``[B,H,N,C,C]``) that the overflow model reads."""
    z = g
    if gate is not None:
        g = gate(z.to(dtype))
    _, scale, bounds = check_backward(q, k, v, g, beta, initial_state, scale, do, dht, cu_seqlens)
    C = require_block("chunk_size", chunk_size)
    packed = cu_seqlens is not None
    parts = []
    for i, (a, b) in enumerate(bounds):
        s0 = initial_state[i : i + 1] if packed and initial_state is not None else initial_state
        ht = dht[i : i + 1] if packed and dht is not None else dht
        x = (t[:, a:b].to(dtype) for t in (q, k, v, g, beta, do))
        parts.append(_sequence_backward(*x, s0, ht, scale, C, emulation, record))
    grads = {n: torch.cat([p[n] for p in parts], 1) for n in GRADIENTS}
    if initial_state is not None:
        grads["dh0"] = torch.cat([p["dh0"] for p in parts], 0)
    if gate is not None:
        grads["dg"], grads["dA_log"], grads["ddt_bias"] = lower_bound_gate_backward(grads["dg"], z, gate)
    return grads


def _sequence_backward(q, k, v, g, beta, do, initial_state, dht, scale: float, C: int, em: Emulation = EXACT,
                       record: dict | None = None) -> dict[str, torch.Tensor]:
    """:func:`chunkwise_backward` of one run of sequences from their states (``[B, T, ...]``, all
    in the working dtype); ``dh0`` is always returned."""
    B, T, H, K = q.shape
    S0 = initial(initial_state, Dims(B, T, H, K, v.shape[-1]), q.dtype, q.device)
    dS = torch.zeros_like(S0) if dht is None else dht.to(q.dtype).clone()
    if T == 0:
        empty = {n: t.new_zeros(t.shape) for n, t in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta))}
        return empty | {"dh0": dS}
    cast = em.cast
    qc, kc, vc, doc = (to_chunks(cast(f"input {n}", t), C) for n, t in (("q", q), ("k", k), ("v", v), ("do", do)))
    bc = to_chunks(cast("input beta", beta)[..., None], C)[..., 0]
    G = em.prefix(to_chunks(g, C))
    f = _forward_quantities(qc, kc, vc, bc, G, S0, scale, em)
    N = G.shape[2]
    # The state gradient runs backward over the chunks; what each chunk needs of it is kept.
    dvt, dW, dqd, dkend, dlam = (torch.empty_like(t) for t in (f["vt"], f["W"], f["qd"], f["kend"], f["lam"]))
    for n in reversed(range(N)):
        S, vt_n, dS_op = f["states"][n], f["vt"][:, :, n], cast("state gradient", dS)
        dvt_n = cast("pseudo-value gradient", f["A_qk"][:, :, n].transpose(-1, -2) @ doc[:, :, n]
                     + f["kend"][:, :, n] @ dS_op)
        dqd[:, :, n] = doc[:, :, n] @ S.transpose(-1, -2)
        dkend[:, :, n] = vt_n @ dS_op.transpose(-1, -2)
        dlam[:, :, n] = (S * dS).sum(-1)
        dW[:, :, n] = -dvt_n @ S.transpose(-1, -2)
        dvt[:, :, n] = dvt_n
        dS = (f["qd"][:, :, n].transpose(-1, -2) @ doc[:, :, n] + f["lam"][:, :, n, :, None] * dS
              - f["W"][:, :, n].transpose(-1, -2) @ dvt_n)
    # Through U = M V and W = M (exp(G) * K), then M = (I + A_kk)^-1 Diag(beta).
    M, Linv = f["M"], f["Linv"]
    dW = cast("W gradient", dW)
    dM = dvt @ vc.transpose(-1, -2) + dW @ f["kg"].transpose(-1, -2)
    dv = M.transpose(-1, -2) @ dvt
    dkg = M.transpose(-1, -2) @ dW
    dbeta = (Linv * dM).sum(-2)
    solved = cast("M gradient, solved", f["Linv_op"].transpose(-1, -2) @ cast("M gradient", dM))
    dA_kk = -(solved @ M.transpose(-1, -2)).tril(-1)
    dbeta = dbeta + (dA_kk * f["P"]).sum(-1)
    dA_qk = (doc @ f["vt"].transpose(-1, -2)).tril()
    # Through the decayed products A_qk = scale * A_q and A_kk = Diag(beta) A_k.
    D_q, D_k = scale * dA_qk, dA_kk * bc[..., :, None]
    if record is not None:
        record.setdefault("D_q", []).append(D_q)
        record.setdefault("D_k", []).append(D_k)
    dq_A, dk_Aq, dG_q = _decayed_product_backward(qc, kc, G, D_q, em, "q")
    dk_x, dk_key, dG_k = _decayed_product_backward(kc, kc, G, D_k, em, "k")
    gam = torch.exp(G)
    to_end = torch.exp(G[..., -1:, :] - G)
    dq = scale * gam * dqd + dq_A
    dk = gam * dkg + to_end * dkend + dk_Aq + dk_x + dk_key
    # k * exp(G_C - G_r) moves G_C up and G_r down; the last row's own factor is exp(0) and
    # moves neither, so it is left out of both.
    to_end_grad = f["kend"] * dkend
    dG = f["qd"] * dqd + f["kg"] * dkg + dG_q + dG_k
    dG[..., :-1, :] -= to_end_grad[..., :-1, :]
    dG[..., -1, :] += to_end_grad[..., :-1, :].sum(-2) + f["lam"] * dlam
    dg = dG.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g) over the chunk: its gradient sums from the end
    out = {"dq": dq, "dk": dk, "dv": dv, "dg": dg}
    grads = {n: em.outputs(n, from_chunks(t, T)) for n, t in out.items()}
    grads["dbeta"] = em.outputs("dbeta", from_chunks(dbeta[..., None], T)[..., 0])
    return grads | {"dh0": dS}


def _forward_quantities(qc, kc, vc, bc, G, S0, scale: float, em: Emulation = EXACT) -> dict:
    """What the backward recomputes of the forward (all ``[B,H,N,...]``), rounded as ``em`` says
    (as the forward stores it): the decayed products ``P = A_k`` (strict) and ``A_qk``, ``Linv =
    (I + A_kk)^-1`` (and ``Linv_op``, its product operand), ``M``, ``W``, the decayed operands
    ``qd = scale exp(G) q``, ``kg = exp(G) k``, ``kend = k exp(G_C - G)``, ``lam = exp(G_C)``, the
    state entering each chunk (``states``, a list) and the pseudo-values ``vt``."""
    C, cast = G.shape[-2], em.cast
    tile = em.tile or _exact_tile(C)
    A = decayed_products({"q": qc, "k": kc}, kc, G, tile=tile, cast=cast, diagonal_anchor=_anchor_of(G, tile, em))
    P = A["k"].tril(-1)
    eye = torch.eye(C, dtype=G.dtype, device=G.device)
    Linv = torch.linalg.solve_triangular(eye + P * bc[..., :, None], eye.expand_as(P), upper=False,
                                         unitriangular=True)
    M = cast("M = (I + A_kk)^-1 Diag(beta)", Linv * bc[..., None, :])
    gam = torch.exp(G)
    f = dict(P=P, A_qk=cast("A_qk", A["q"] * scale), Linv=Linv, Linv_op=cast("(I + A_kk)^-1", Linv), M=M,
             qd=scale * cast("exp(G) * q", gam * qc), kg=cast("exp(G) * k", gam * kc),
             kend=cast("k * exp(G_C - G)", kc * torch.exp(G[..., -1:, :] - G)), lam=torch.exp(G[..., -1, :]))
    f["W"] = cast("W", M @ f["kg"])
    U = cast("U", M @ vc)
    vt = torch.empty_like(U)
    states, S = [], S0
    for n in range(G.shape[2]):
        S_op = cast("state", S)
        states.append(S_op)
        vt[:, :, n] = cast("pseudo-values V~", U[:, :, n] - f["W"][:, :, n] @ S_op)
        S = f["lam"][:, :, n, :, None] * S + f["kend"][:, :, n].transpose(-1, -2) @ vt[:, :, n]
    return f | {"states": states, "vt": vt}


def _anchor_of(G: torch.Tensor, tile: int, em: Emulation) -> torch.Tensor | None:
    """The diagonal tiles' anchors ``[..., C/tile, D]`` of ``em``, or ``None`` (pair by pair)."""
    if em.anchor is None:
        return None
    C, D = G.shape[-2:]
    return em.anchor(G.reshape(*G.shape[:-2], C // tile, tile, D))


def _decayed_product_backward(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, D: torch.Tensor,
                              em: Emulation = EXACT, name: str = "x"):
    """Gradients of ``A[r,c] = sum_d x_r[d] k_c[d] exp(G_r[d] - G_c[d])`` (``c <= r``) for the
    cotangent ``D:[..., C, C]`` (zero above the diagonal): ``(dx, dk, dG)``, each ``[..., C, D]``.

    The two-level split of :func:`decayed_products`, transposed: for a key tile ``J`` before the
    query tile ``I`` both factors ``exp(G_r - a_I)`` and ``exp(a_I - G_c)`` are ``<= 1`` and the
    block is a matrix product. Diagonal tiles are formed pair by pair (exact for any gate), or,
    with ``em.anchor``, as products split at the anchor ``a`` the way a kernel forms them:
    ``dx = (D (k e^(a-G))) e^(G-a)`` and ``dk = (D^T (x e^(G-a))) e^(a-G)`` (fla-core 0.6.0,
    ``chunk_kda_bwd_kernel_intra`` with ``safe_gate``): the same operands as the forward's, then a
    factor as large as the forward's key factor applied to an fp32 accumulator. In the exact form
    a diagonal pair ``r = c`` has no decay, so it reaches ``dx`` and ``dk`` but not ``dG``: it is
    left out of ``dG`` rather than added and subtracted (a gradient that is exactly zero stays zero).
    """
    C, Dd = G.shape[-2:]
    tile = em.tile or _exact_tile(C)
    nT = C // tile
    lead = G.shape[:-2]
    Gt, xt, kt = (t.reshape(*lead, nT, tile, Dd) for t in (G, x, k))
    D = em.accumulate(f"A_{name}k gradient", D)  # kernels keep it in fp32 (fla-core 0.6.0: float buffers)
    start = tile_start_prefix(Gt)  # a_I: [..., nT, Dd]
    blocks = D.reshape(*lead, nT, tile, nT, tile)  # [..., I, r, J, c]
    earlier = torch.ones(nT, nT, dtype=torch.bool, device=G.device).tril(-1)  # [I, J]: J < I
    key_exp = (start[..., :, None, None, :] - Gt[..., None, :, :, :]).masked_fill(~earlier[:, :, None, None],
                                                                                 float("-inf"))
    key_f = torch.exp(key_exp)  # [..., I, J, c, Dd], 0 unless J < I
    query_f = torch.exp(Gt - start[..., None, :])  # [..., I, r, Dd]
    key_op = em.cast("off-diagonal key operand", kt[..., None, :, :, :] * key_f)
    dx = query_f * torch.einsum("...irjc,...ijcd->...ird", blocks, key_op)
    x_op = em.cast(f"off-diagonal {name} operand", xt * query_f)
    dk = (torch.einsum("...irjc,...ird->...ijcd", blocks, x_op) * key_f).sum(-4)
    diagonal_blocks = blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., nT, r, c]
    anchor = _anchor_of(G, tile, em)
    if anchor is not None:
        a = anchor[..., None, :]
        Dt = diagonal_blocks.tril()
        k_diag = em.split("diagonal key operand, backward", kt * torch.exp(a - Gt))
        x_diag = em.split(f"diagonal {name} operand, backward", xt * torch.exp(Gt - a))
        dx = dx + em.accumulate(f"diagonal d{name} (D k e^(a-G)) e^(G-a)", (Dt @ k_diag) * torch.exp(Gt - a))
        dk = dk + em.accumulate(f"diagonal dk from A_{name}k (D^T {name} e^(G-a)) e^(a-G)",
                                (Dt.transpose(-1, -2) @ x_diag) * torch.exp(a - Gt))
        dx, dk = dx.reshape(*lead, C, Dd), dk.reshape(*lead, C, Dd)
        return dx, dk, x * dx - k * dk
    strict = torch.ones(tile, tile, dtype=torch.bool, device=G.device).tril(-1)  # c < r
    pairs = torch.exp((Gt[..., :, None, :] - Gt[..., None, :, :]).masked_fill(~strict[..., None], float("-inf")))
    weighted = diagonal_blocks[..., None] * pairs  # [..., nT, r, c, Dd]
    dx = (dx + torch.einsum("...nrcd,...ncd->...nrd", weighted, kt)).reshape(*lead, C, Dd)
    dk = (dk + torch.einsum("...nrcd,...nrd->...ncd", weighted, xt)).reshape(*lead, C, Dd)
    dG = x * dx - k * dk
    diag = D.diagonal(dim1=-2, dim2=-1)[..., None]
    return dx + diag * k, dk + diag * x, dG

"""KDA GPU kernels in Triton: chunkwise prefill and fused recurrent decode.

``chunk`` runs the chunkwise form of docs/model.md §1.5 with the two-level tiling of §1.6 in five
launches:

1. *prefix* (one program per chunk, head and key block): the chunk-local log-decay prefix
   ``G`` (fp32) and what needs nothing else: ``exp(G) k`` (the right-hand side of ``W``),
   ``k exp(G_C - G)`` transposed per chunk (the state update's operand) and ``exp(G_C)``.
2. *blocks*, twice (one program per chunk and head, key slice by key slice): the 16-row
   sub-tile blocks ``(i, j)``, ``j <= i``, of ``A_kk`` and of ``A_qk`` as operand-dtype
   matrix products with fp32 accumulation. Off-diagonal blocks split the decay at the query
   tile's start, so both factors are ``<= 1``; diagonal blocks split it at the anchor chosen at
   compile time (``tile_start``, ``tile_middle`` or ``row0_shift``, as in
   :mod:`k3verify.kda.tiled`). The ``A_kk`` launch goes on to ``T = (I + A_kk)^{-1}`` block by
   block in fp32 (each diagonal inverse a product of powers of the nilpotent block) and the
   pseudo-keys and values as whole-chunk products, ``W = T diag(beta) exp(G) k`` and
   ``U = T diag(beta) v``. Two launches, not one: a ``[16, 16]`` block is the same registers on
   every warp, so each launch keeps half the blocks live on as few warps as they need. The
   ``A_qk`` launch also stores ``exp(G) q`` (the output launch's operand); nothing but the
   output launch waits for it, so on a GPU it runs on a second stream beside the state pass.
3. *state* (one program per sequence, head and value block; sequential over chunks): stores
   the state entering each chunk, the pseudo-values ``V~ = U - W S`` and the next state
   ``exp(G_C) S + (k exp(G_C - G))^T V~``. Chunk bounds are arithmetic, so the loop prefetches
   the next chunk's operands (``num_stages``) while this one's products run.
4. *output* (one program per chunk, head and value block):
   ``O = scale (exp(G) q) S + A_qk V~``.

``fused_recurrent`` is the decode kernel: one program per request, head and value block
keeps a ``[K, BV]`` slice of the fp32 state in registers for every token of the step and
reads/writes it in a state pool through per-request indices (``-1`` marks a padding slot).

Every matrix-product operand is in the operand dtype (the dtype the inputs are given in:
bf16, fp16 or fp32) and every product accumulates in fp32; gates and states are fp32.
Sequences of different lengths go in one call through ``cu_seqlens`` (fla-core's layout:
``B = 1`` and cumulative offsets); a batch of equal lengths is the same thing internally.

Where no CUDA device is visible the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set on import by :mod:`k3verify.triton_support` if unset). It is faithful for fp32 operands
only: it rounds fp32 -> bf16 by truncation and its bf16 ``tl.dot`` is wrong (docs/model.md §5), so
:func:`unavailable_reason` refuses the other dtypes there.
"""

from __future__ import annotations

import functools

import torch

from ..numerics import dtype_name, resolve_dtype
from ..numerics.validate import require_block, require_finite, require_float, require_tensor
from ..triton_support import beside, device_for, dot, interpreted, mark, multiprocessors, tl, triton, wait
from ..triton_support import block as _block
from ..triton_support import unavailable_reason as _unavailable
from .inputs import check_cu_seqlens, check_inputs
from .tiled import ANCHORS, DEFAULT_ROW0_SHIFT

SUB_TILE = 16
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ANCHOR_CODE = {name: i for i, name in enumerate(ANCHORS)}


__all__ = ["chunk", "chunk_table", "fused_recurrent", "interpreted", "unavailable_reason"]


def unavailable_reason(operand_dtype: torch.dtype | str = torch.bfloat16) -> str | None:
    """Why the kernels cannot give faithful results for ``operand_dtype`` here, or ``None``."""
    return _unavailable("the KDA kernels", operand_dtype, KERNEL_DTYPES)


# --- device helpers ----------------------------------------------------------------------


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    """``exp(x)``. On a GPU ``tl.exp`` is ``exp2(x * log2 e)`` with that product rounded: a
    relative error near ``|x| * 6e-8`` (1e-6 at ``|x| = 15``, where shifted anchors put their
    factors). ``ACCURATE`` (fp32 operands) reduces the argument first, ``x = n ln 2 + r`` with
    ``ln 2`` split in two (Cody and Waite), so only the small ``r`` is rounded; ``2^n`` is
    applied in two halves so results up to fp32's largest finite value stay finite."""
    return _exp_split(x, 0.0, ACCURATE)


@triton.jit
def _exp_split(x, x_lo, ACCURATE: tl.constexpr):
    """``exp(x + x_lo)`` for an exponent held as a rounded value ``x`` and its rounding error
    ``x_lo`` (``|x_lo| <= ulp(x) / 2``): the error joins the reduced argument, where it is not
    rounded away. Without ``ACCURATE`` ``x_lo`` is ignored (16-bit operands cannot hold it)."""
    if ACCURATE:
        n = tl.floor(x * 1.4426950408889634 + 0.5)
        r = ((x - n * 0.693359375) + n * 2.1219444005469057e-4) + x_lo
        half = tl.floor(n * 0.5)
        return tl.exp2(r * 1.4426950408889634) * tl.exp2(half) * tl.exp2(n - half)
    else:
        return tl.exp(x)


@triton.jit
def _two_sum(a, b):
    """``a + b`` as the rounded sum and its exact rounding error (Knuth's TwoSum)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


@triton.jit
def _rows(ptr, start, row0, length, h, col0, H, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """:func:`_cols` as fp32."""
    return _cols(ptr, start, row0, length, h, col0, H, D, R, BD).to(tl.float32)


@triton.jit
def _cols(ptr, start, row0, length, h, col0, H, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """``[R, BD]`` block of a ``[tokens, H, D]`` tensor: rows ``row0 .. row0+R`` of the chunk,
    columns ``col0 .. col0+BD``, in the tensor's own dtype (0 outside)."""
    rr = row0 + tl.arange(0, R)
    dd = col0 + tl.arange(0, BD)
    mask = (rr < length)[:, None] & (dd < D)[None, :]
    # A 64-bit scalar base and 32-bit offsets within the chunk: fewer registers per element.
    return tl.load(ptr + (start * H + h) * D + rr[:, None] * (H * D) + dd[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, x, start, row0, length, h, col0, H, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """Store ``x:[R, BD]`` into the block :func:`_cols` reads, in the tensor's dtype."""
    rr = row0 + tl.arange(0, R)
    dd = col0 + tl.arange(0, BD)
    mask = (rr < length)[:, None] & (dd < D)[None, :]
    tl.store(ptr + (start * H + h) * D + rr[:, None] * (H * D) + dd[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_bounds(chunk_start, chunk_end, n):
    """First token and length of chunk ``n`` (the chunk table's entries)."""
    start = tl.load(chunk_start + n)
    return start, tl.load(chunk_end + n) - start


@triton.jit
def _state_offsets(iv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets and mask of value block ``iv`` of one ``[K, V]`` state."""
    dk = tl.arange(0, BK)
    dv = iv * BV + tl.arange(0, BV)
    return dk[:, None] * V + dv[None, :], (dk < K)[:, None] & (dv < V)[None, :]


@triton.jit
def _unit_lower_inverse(N, BC: tl.constexpr):
    """``(I + N)^{-1}`` for strictly lower triangular ``N:[BC, BC]`` (fp32).

    ``N`` is nilpotent (``N^BC = 0``), so the inverse is the finite series ``sum_k (-N)^k =
    (I - N)(I + N^2)(I + N^4)(I + N^8)`` at ``BC = 16``: six fp32 products whose chain is three
    squarings deep, where forward substitution makes 15 dependent row steps (faster on an H200:
    docs/gpu.md, "KDA launch settings")."""
    tl.static_assert(BC == 16, "the product is written out for 16-row sub-tiles")
    rows = tl.arange(0, BC)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    X = eye - N
    P = N
    for _ in tl.static_range(3):  # with N^2, N^4, N^8
        P = tl.dot(P, P, input_precision="ieee")
        X = tl.dot(X, eye + P, input_precision="ieee")
    return X


# --- prefill: intra-chunk ----------------------------------------------------------------


@triton.jit
def _pick_row(x, rows, r):
    """Row ``r`` of ``x:[R, D]`` as ``[D]`` (exact: every other row contributes 0)."""
    return tl.sum(tl.where(rows[:, None] == r, x, 0.0), axis=0)


@triton.jit
def _chunk_head(INNER: tl.constexpr, H):
    """``(n, h, i)``: chunk, head and inner block of this program in a 1-D grid of ``NC · H ·
    INNER`` programs ordered inner block fastest, then head, then chunk. Programs that run
    together then cover whole ``[tokens, H, D]`` rows of a few chunks rather than one head's
    slice of many chunks (faster for every launch that uses it: docs/gpu.md, "KDA launch
    settings")."""
    pid = tl.program_id(0)
    return (pid // INNER // H).to(tl.int64), (pid // INNER) % H, pid % INNER


@triton.jit
def _prefix_kernel(
    k, g, G, KG, KE, GL, chunk_start, chunk_end,
    H, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Per chunk, head and key block: the chunk-local log-decay prefix ``G`` (fp32) and the
    operands of the launches on the state pass's path that need nothing else: ``exp(G) k``
    (the right-hand side of ``W``), ``k exp(G_C - G)`` transposed to ``[K, C]`` (state update)
    and ``exp(G_C)``. (``exp(G) q`` is formed by the ``A_qk`` launch, off that path.)"""
    n, h, kb = _chunk_head(tl.cdiv(K, BK), H)
    col0 = kb * BK
    start, length = _chunk_bounds(chunk_start, chunk_end, n)
    rows = tl.arange(0, C)
    dk = col0 + tl.arange(0, BK)
    # Rows past the end read g = 0, so G stays at the last real row's value there.
    gc = _rows(g, start, 0, length, h, col0, H, K, C, BK)
    if IEEE:
        # On a GPU tl.cumsum is a parallel scan: summed in fp32, neighbouring rows carry
        # unrelated rounding errors, and a decay exp(G_r - G_c) inherits one of ulp(|G|), not
        # of ulp(|G_r - G_c|) as after a sequential sum (2.1x the fp32 baseline's error on the
        # pinned example, 0.93x on the interpreter, which sums in order). Summed in fp64 and
        # rounded once, every G_r is the correctly rounded prefix, as the naive form's is.
        Gc = tl.cumsum(gc.to(tl.float64), axis=0).to(tl.float32)
    else:
        Gc = tl.cumsum(gc, axis=0)
    _store_rows(G, Gc, start, 0, length, h, col0, H, K, C, BK)
    e = _exp(Gc, IEEE)
    k_c = _rows(k, start, 0, length, h, col0, H, K, C, BK)
    _store_rows(KG, k_c * e, start, 0, length, h, col0, H, K, C, BK)
    s_end = _pick_row(Gc, rows, C - 1)
    tl.store(GL + (n * H + h) * K + dk, _exp(s_end, IEEE), mask=dk < K)
    # Rows past the end are stored too, as 0 (k is 0 there): the state pass then loads whole
    # chunk blocks, with no mask along their contiguous dimension, which is what lets Triton
    # prefetch them asynchronously (with one, the load waits inside the sequential loop).
    k_end = k_c * _exp(s_end[None, :] - Gc, IEEE)
    tl.store(KE + (n * H + h) * K * C + dk[:, None] * C + rows[None, :], tl.trans(k_end).to(KE.dtype.element_ty),
             mask=(dk < K)[:, None])  # fmt: skip


@triton.jit
def _prefix_at(G, start, row, length, h, col0, H, K: tl.constexpr, BK: tl.constexpr):
    """``G:[BK]`` at chunk row ``row``: the last real row's if the chunk ends before it, 0 for
    ``row = -1`` (the prefix before the chunk's first row)."""
    dk = col0 + tl.arange(0, BK)
    at = tl.maximum(tl.minimum(row, length - 1), 0)
    return tl.where(row >= 0, tl.load(G + ((start + at) * H + h) * K + dk, mask=dk < K, other=0.0), 0.0)


@triton.jit
def _diagonal(xi, ki, Gi, s, row0, length, anchor_offset, acc,
              BC: tl.constexpr, ANCHOR: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Add one key slice's share of the diagonal block ``x_i k_i^T`` with its decay (``x`` is
    ``q`` for ``A_qk``, ``k`` for ``A_kk``; unscaled, unmasked) to ``acc:[BC, BC]`` fp32.
    ``xi, ki:[BC, BK]`` are in the operand dtype, ``Gi`` the prefix, ``s`` its value at the
    tile's start. ``exp(G_r - G_c)`` is split at the anchor ``a`` as ``exp(G_r - a) exp(a - G_c)``."""
    r = tl.arange(0, BC)
    ok = (row0 + r) < length
    if ANCHOR == 0:
        d = Gi - s[None, :]
        d_lo = tl.zeros_like(d)
    elif ANCHOR == 1:
        # A partial tail tile splits at its last real row when that comes before the middle.
        d = Gi - _pick_row(Gi, r, tl.minimum(BC // 2, length - 1 - row0))[None, :]
        d_lo = tl.zeros_like(d)
    else:
        # G_r - a = (G_r - G_0) + offset sits near the offset (15 at BC = 16) even for
        # neighbouring rows: rounded there, the factors of a product exp(G_r - G_c) that is
        # near 1 carry errors up to 2^-24 * 16 each. The sum's rounding error is kept.
        d, d_lo = _two_sum(Gi - _pick_row(Gi, r, 0)[None, :], anchor_offset)
    # Padded rows get exponent 0 (their q, k are 0): no spurious inf * 0 there.
    d = tl.where(ok[:, None], d, 0.0)
    d_lo = tl.where(ok[:, None], d_lo, 0.0)
    k_d = tl.trans((ki.to(tl.float32) * _exp_split(-d, -d_lo, IEEE)).to(ki.dtype))
    return dot((xi.to(tl.float32) * _exp_split(d, d_lo, IEEE)).to(xi.dtype), k_d, IEEE, acc)


@triton.jit
def _to_tile_start(xi, Gi, s, row0, length, BC: tl.constexpr, IEEE: tl.constexpr):
    """``x`` of tile ``i`` times ``exp(G - s)`` (``<= 1``), the row operand of its
    off-diagonal blocks, in the operand dtype."""
    ok = (row0 + tl.arange(0, BC)) < length
    return (xi.to(tl.float32) * _exp(tl.where(ok[:, None], Gi - s[None, :], 0.0), IEEE)).to(xi.dtype)


@triton.jit
def _off_diagonal(x_o, kj, Gj, s, acc, IEEE: tl.constexpr):
    """Add one key slice's share of block ``(i, j)``, ``j < i``, to ``acc``: the decay splits
    at tile ``i``'s start ``s``, so the column factor ``exp(s - G_j)`` is ``<= 1`` too."""
    return dot(x_o, tl.trans((kj.to(tl.float32) * _exp(s[None, :] - Gj, IEEE)).to(kj.dtype)), IEEE, acc)


@triton.jit
def _row_tile(x, k, G, XG, acc, start, row0, length, h, col0, anchor_offset, H, K: tl.constexpr,
              STORE_XG: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, ANCHOR: tl.constexpr,
              IEEE: tl.constexpr):  # fmt: skip
    """Sub-tile ``i`` (rows ``row0 ..``) of one key slice: adds its diagonal block to ``acc``
    (with ``STORE_XG`` also stores the tile's ``exp(G) x`` into ``XG``, as the prefix launch
    would: the same ``G``, the same ``exp``) and returns ``(k_i, G_i, s_i, x_i exp(G_i - s_i),
    acc)``, ``s_i`` the prefix at the tile's start and the fourth the row operand of the tile's
    off-diagonal blocks."""
    s = _prefix_at(G, start, row0 - 1, length, h, col0, H, K, BK)
    xi = _cols(x, start, row0, length, h, col0, H, K, BC, BK)
    ki = _cols(k, start, row0, length, h, col0, H, K, BC, BK)
    Gi = _rows(G, start, row0, length, h, col0, H, K, BC, BK)
    if STORE_XG:
        _store_rows(XG, xi.to(tl.float32) * _exp(Gi, IEEE), start, row0, length, h, col0, H, K, BC, BK)
    acc = _diagonal(xi, ki, Gi, s, row0, length, anchor_offset, acc, BC, ANCHOR, IEEE)
    return ki, Gi, s, _to_tile_start(xi, Gi, s, row0, length, BC, IEEE), acc


@triton.jit
def _store_block(ptr, x, start, row0, col0, length, h, H, C: tl.constexpr, BC: tl.constexpr):
    """Store ``x:[BC, BC]`` at rows ``row0 ..``, columns ``col0 ..`` of a ``[tokens, H, C]``
    per-chunk matrix."""
    _store_rows(ptr, x, start, row0, length, h, col0, H, C, BC, BC)


@triton.jit
def _blocks_kernel(
    x, k, v, G, beta, XG, Aqk, Tb, W, U, chunk_start, chunk_end, scale, anchor_offset,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, ANCHOR: tl.constexpr, IEEE: tl.constexpr, QK: tl.constexpr,
):  # fmt: skip
    """The sub-tile blocks of ``x k^T`` with decay, ``x = q`` (``QK``: stores ``A_qk`` and
    ``exp(G) q`` into ``XG``, for the output launch) or
    ``x = k`` (then ``T = (I + A_kk)^{-1}`` and ``W = T diag(beta) exp(G) k``,
    ``U = T diag(beta) v``, where ``W`` holds ``exp(G) k`` on entry)."""
    # Not `_`: the loop below unpacks into `_`, which Triton would then carry through the loop.
    n, h, _single = _chunk_head(1, H)
    start, length = _chunk_bounds(chunk_start, chunk_end, n)
    tl.static_assert(C == BC or C == 2 * BC or C == 4 * BC, "a chunk is 1, 2 or 4 sub-tiles")
    # Block (i, j) accumulated over key slices of BK columns (fewer live registers than whole
    # rows of K). Blocks past the chunk's sub-tiles stay 0 and unused.
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a10, a11, a20, a21, a22, a30, a31, a32, a33 = a00, a00, a00, a00, a00, a00, a00, a00, a00
    for col0 in range(0, K, BK):
        k0, G0, _, _, a00 = _row_tile(x, k, G, XG, a00, start, 0, length, h, col0, anchor_offset,
                                      H, K, QK, BC, BK, ANCHOR, IEEE)  # fmt: skip
        if C >= 2 * BC:
            k1, G1, s1, x_o, a11 = _row_tile(x, k, G, XG, a11, start, BC, length, h, col0, anchor_offset,
                                             H, K, QK, BC, BK, ANCHOR, IEEE)  # fmt: skip
            a10 = _off_diagonal(x_o, k0, G0, s1, a10, IEEE)
        if C >= 4 * BC:
            k2, G2, s2, x_o, a22 = _row_tile(x, k, G, XG, a22, start, 2 * BC, length, h, col0, anchor_offset,
                                             H, K, QK, BC, BK, ANCHOR, IEEE)  # fmt: skip
            a20 = _off_diagonal(x_o, k0, G0, s2, a20, IEEE)
            a21 = _off_diagonal(x_o, k1, G1, s2, a21, IEEE)
            _, _, s3, x_o, a33 = _row_tile(x, k, G, XG, a33, start, 3 * BC, length, h, col0, anchor_offset,
                                           H, K, QK, BC, BK, ANCHOR, IEEE)  # fmt: skip
            a30 = _off_diagonal(x_o, k0, G0, s3, a30, IEEE)
            a31 = _off_diagonal(x_o, k1, G1, s3, a31, IEEE)
            a32 = _off_diagonal(x_o, k2, G2, s3, a32, IEEE)
    if QK:
        # Stored scaled; the output launch keeps only the causal lower triangle of what it reads.
        _store_block(Aqk, a00 * scale, start, 0, 0, length, h, H, C, BC)
        if C >= 2 * BC:
            _store_block(Aqk, a10 * scale, start, BC, 0, length, h, H, C, BC)
            _store_block(Aqk, a11 * scale, start, BC, BC, length, h, H, C, BC)
        if C >= 4 * BC:
            _store_block(Aqk, a20 * scale, start, 2 * BC, 0, length, h, H, C, BC)
            _store_block(Aqk, a21 * scale, start, 2 * BC, BC, length, h, H, C, BC)
            _store_block(Aqk, a22 * scale, start, 2 * BC, 2 * BC, length, h, H, C, BC)
            _store_block(Aqk, a30 * scale, start, 3 * BC, 0, length, h, H, C, BC)
            _store_block(Aqk, a31 * scale, start, 3 * BC, BC, length, h, H, C, BC)
            _store_block(Aqk, a32 * scale, start, 3 * BC, 2 * BC, length, h, H, C, BC)
            _store_block(Aqk, a33 * scale, start, 3 * BC, 3 * BC, length, h, H, C, BC)
    else:
        _solve(v, beta, Tb, W, U, start, length, h, H, a00, a10, a11, a20, a21, a22, a30, a31, a32, a33,
               K, V, BK, BV, C, BC, IEEE)  # fmt: skip


@triton.jit
def _solve(v, beta, Tb, W, U, start, length, h, H, a00, a10, a11, a20, a21, a22, a30, a31, a32, a33,
           K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
           BC: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """From the blocks ``a_ij`` of ``k k^T`` with decay (before ``beta``): ``T = (I + A_kk)^{-1}``
    block by block (``T_ii`` inverts a diagonal block; below it ``T_ij = -T_ii sum_{j<=m<i}
    A_im T_mj``; all fp32), then ``W = T diag(beta) W`` and ``U = T diag(beta) v`` as
    whole-chunk products."""
    r = tl.arange(0, BC)
    strict = r[:, None] > r[None, :]
    b0 = _beta_rows(beta, start, 0, length, h, H, BC)
    t00 = _unit_lower_inverse(tl.where(strict, a00 * b0[:, None], 0.0), BC)
    _store_block(Tb, t00 * b0[None, :], start, 0, 0, length, h, H, C, BC)
    if C >= 2 * BC:
        b1 = _beta_rows(beta, start, BC, length, h, H, BC)
        t11 = _unit_lower_inverse(tl.where(strict, a11 * b1[:, None], 0.0), BC)
        t10 = -_exact(t11, _exact(a10 * b1[:, None], t00))
        _store_block(Tb, t10 * b0[None, :], start, BC, 0, length, h, H, C, BC)
        _store_block(Tb, t11 * b1[None, :], start, BC, BC, length, h, H, C, BC)
    if C >= 4 * BC:
        b2 = _beta_rows(beta, start, 2 * BC, length, h, H, BC)
        b3 = _beta_rows(beta, start, 3 * BC, length, h, H, BC)
        t22 = _unit_lower_inverse(tl.where(strict, a22 * b2[:, None], 0.0), BC)
        t33 = _unit_lower_inverse(tl.where(strict, a33 * b3[:, None], 0.0), BC)
        a20, a21 = a20 * b2[:, None], a21 * b2[:, None]
        a30, a31, a32 = a30 * b3[:, None], a31 * b3[:, None], a32 * b3[:, None]
        t21 = -_exact(t22, _exact(a21, t11))
        t20 = -_exact(t22, _exact(a20, t00) + _exact(a21, t10))
        t32 = -_exact(t33, _exact(a32, t22))
        t31 = -_exact(t33, _exact(a31, t11) + _exact(a32, t21))
        t30 = -_exact(t33, _exact(a30, t00) + _exact(a31, t10) + _exact(a32, t20))
        _store_block(Tb, t20 * b0[None, :], start, 2 * BC, 0, length, h, H, C, BC)
        _store_block(Tb, t21 * b1[None, :], start, 2 * BC, BC, length, h, H, C, BC)
        _store_block(Tb, t22 * b2[None, :], start, 2 * BC, 2 * BC, length, h, H, C, BC)
        _store_block(Tb, t30 * b0[None, :], start, 3 * BC, 0, length, h, H, C, BC)
        _store_block(Tb, t31 * b1[None, :], start, 3 * BC, BC, length, h, H, C, BC)
        _store_block(Tb, t32 * b2[None, :], start, 3 * BC, 2 * BC, length, h, H, C, BC)
        _store_block(Tb, t33 * b3[None, :], start, 3 * BC, 3 * BC, length, h, H, C, BC)
    # This program reads its own T diag(beta) back as one whole-chunk tile.
    tl.debug_barrier()
    # 64-row products (at C = 64) where blocked substitution would chain 16-row ones. Blocks
    # above the diagonal were not written.
    rows = tl.arange(0, C)
    Tt = _cols(Tb, start, 0, length, h, 0, H, C, C, C)
    Tt = tl.where((rows[:, None] // BC) >= (rows[None, :] // BC), Tt, 0.0)
    for col0 in range(0, K, BV):
        _store_rows(W, dot(Tt, _cols(W, start, 0, length, h, col0, H, K, C, BV), IEEE),
                    start, 0, length, h, col0, H, K, C, BV)  # fmt: skip
    for col0 in range(0, V, BV):
        _store_rows(U, dot(Tt, _cols(v, start, 0, length, h, col0, H, V, C, BV), IEEE),
                    start, 0, length, h, col0, H, V, C, BV)  # fmt: skip


@triton.jit
def _exact(a, b):
    """``a @ b`` of fp32 ``[16, 16]`` blocks with exact products (the inverse's precision)."""
    return dot(a, b, True)


@triton.jit
def _beta_rows(beta, start, row0, length, h, H, BC: tl.constexpr):
    """``beta:[BC]`` fp32 of rows ``row0 ..`` of the chunk (0 past its end)."""
    rr = row0 + tl.arange(0, BC)
    return tl.load(beta + (start + rr) * H + h, mask=rr < length, other=0.0).to(tl.float32)


# --- prefill: state pass and output ------------------------------------------------------


@triton.jit
def _state_kernel(
    KE, GL, W, U, VN, Hs, h0, hT, cu, seq_chunks,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    sh = tl.program_id(1).to(tl.int64)
    seq = sh // H
    h = sh % H
    OP = W.dtype.element_ty
    bos = tl.load(cu + seq)
    eos = tl.load(cu + seq + 1)
    first = tl.load(seq_chunks + seq)
    dk = tl.arange(0, BK)
    cc = tl.arange(0, C)
    soffs, smask = _state_offsets(iv, K, V, BK, BV)
    if HAS_H0:
        S = tl.load(h0 + sh * K * V + soffs, mask=smask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    # Chunk bounds are arithmetic, so no load of a step waits on another load or on the state,
    # and the loop may prefetch the next chunk's operands while this one's products run.
    for i in tl.range(0, tl.cdiv(eos - bos, C), num_stages=STAGES):
        n = first + i
        start = bos + i * C
        length = tl.minimum(eos - start, C)
        tl.store(Hs + (n * H + h) * K * V + soffs, S.to(OP), mask=smask)
        W_n = _cols(W, start, 0, length, h, 0, H, K, C, BK)
        # Whole [K, C] blocks (the prefix launch zeroes a partial chunk's tail): prefetched.
        k_end = tl.load((KE + (n * H + h) * K * C) + dk[:, None] * C + cc[None, :], mask=(dk < K)[:, None], other=0.0)
        decay = tl.load(GL + (n * H + h) * K + dk, mask=dk < K, other=0.0)
        v_new = _cols(U, start, 0, length, h, iv * BV, H, V, C, BV).to(tl.float32) - dot(W_n, S.to(OP), IEEE)
        v_op = v_new.to(OP)
        _store_rows(VN, v_op, start, 0, length, h, iv * BV, H, V, C, BV)
        # The decayed state is the product's accumulator: one fused step, no separate add.
        S = dot(k_end, v_op, IEEE, S * decay[:, None])
    if STORE_HT:
        tl.store(hT + sh * K * V + soffs, S, mask=smask)


@triton.jit
def _output_kernel(
    QG, Aqk, VN, Hs, o, chunk_start, chunk_end, scale,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    n, h, iv = _chunk_head(tl.cdiv(V, BV), H)
    start, length = _chunk_bounds(chunk_start, chunk_end, n)
    OP = VN.dtype.element_ty
    rows = tl.arange(0, C)
    soffs, smask = _state_offsets(iv, K, V, BK, BV)
    q_g = _cols(QG, start, 0, length, h, 0, H, K, C, BK)
    S = tl.load(Hs + (n * H + h) * K * V + soffs, mask=smask, other=0.0)
    # Only blocks on and below the diagonal of A_qk are written (diagonal ones whole): the causal
    # mask keeps what is data, so nothing above it is ever read as such.
    A = tl.where(rows[:, None] >= rows[None, :], _cols(Aqk, start, 0, length, h, 0, H, C, C, C), 0.0).to(OP)
    v_new = _cols(VN, start, 0, length, h, iv * BV, H, V, C, BV)
    out = scale * dot(q_g, S, IEEE) + dot(A, v_new, IEEE)
    _store_rows(o, out, start, 0, length, h, iv * BV, H, V, C, BV)


# --- decode --------------------------------------------------------------------------------


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, o, pool, indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    slot = tl.load(indices + b)
    live = slot >= 0
    dk = tl.arange(0, BK)
    dv = iv * BV + tl.arange(0, BV)
    kmask = dk < K
    vmask = dv < V
    smask = kmask[:, None] & vmask[None, :] & (tl.zeros([BK, BV], dtype=tl.int32) + slot >= 0)
    soffs = (tl.maximum(slot, 0) * H + h) * K * V + dk[:, None] * V + dv[None, :]
    S = tl.load(pool + soffs, mask=smask, other=0.0)
    for t in range(0, T):
        tok = (b * T + t) * H + h
        # A padding request's rows exist in q/k/v; only its pool slot and output are masked.
        q_t = tl.load(q + tok * K + dk, mask=kmask, other=0.0).to(tl.float32) * scale
        k_t = tl.load(k + tok * K + dk, mask=kmask, other=0.0).to(tl.float32)
        g_t = tl.load(g + tok * K + dk, mask=kmask, other=0.0).to(tl.float32)
        v_t = tl.load(v + tok * V + dv, mask=vmask, other=0.0).to(tl.float32)
        b_t = tl.load(beta + tok).to(tl.float32)
        S = S * tl.exp(g_t)[:, None]
        error = v_t - tl.sum(k_t[:, None] * S, axis=0)
        S = S + k_t[:, None] * (b_t * error)[None, :]
        o_t = tl.where(live, tl.sum(q_t[:, None] * S, axis=0), 0.0)
        tl.store(o + tok * V + dv, o_t.to(o.dtype.element_ty), mask=vmask)
    tl.store(pool + soffs, S, mask=smask)


# --- host side -----------------------------------------------------------------------------


def _device(x: torch.Tensor) -> torch.device:
    return device_for(x, "the KDA kernels")


def _check_operand_dtype(operand_dtype: torch.dtype | str) -> torch.dtype:
    dt = resolve_dtype(operand_dtype)
    reason = unavailable_reason(dt)
    if reason is not None:
        raise RuntimeError(reason)
    return dt


def chunk_table(cu: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks of every sequence: ``(start, end, seq_chunks)``.

    ``start, end:[NC]`` token offsets of each chunk (a chunk never crosses a sequence
    boundary; the last of a sequence may be partial), ``seq_chunks:[N+1]`` the first chunk of
    each sequence. All int64 on the CPU.
    """
    lengths = cu[1:] - cu[:-1]
    counts = (lengths + chunk_size - 1) // chunk_size
    seq_chunks = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    start = cu[seq] + (torch.arange(int(seq_chunks[-1])) - seq_chunks[seq]) * chunk_size
    end = torch.minimum(start + chunk_size, cu[seq + 1])
    return start, end, seq_chunks


@functools.lru_cache(maxsize=64)
def _equal_lengths_table(B: int, T: int, C: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Offsets and :func:`chunk_table` of ``B`` sequences of ``T`` tokens on ``dev``, built once
    per shape (the host-to-device copy would otherwise precede every launch)."""
    cu = _equal_offsets(B, T)
    return tuple(t.to(dev) for t in (cu, *chunk_table(cu, C)))


def _equal_offsets(B: int, T: int) -> torch.Tensor:
    """``cu_seqlens`` of ``B`` sequences of ``T`` tokens each (int64, CPU)."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int64) if T else torch.zeros(B + 1, dtype=torch.int64)


def chunk(
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
    tile: int = SUB_TILE,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    anchor: str = "tile_start",
    anchor_shift: float = DEFAULT_ROW0_SHIFT,
    cu_seqlens: torch.Tensor | None = None,
    block_v: int | None = None,
    output_block_v: int = 64,
    num_warps: int = 4,
    intra_warps: int = 2,
    qk_warps: int = 1,
    intra_block_k: int = 16,
    solve_block: int = 64,
    prefix_block_k: int = 64,
    prefix_warps: int = 4,
    output_warps: int = 4,
    num_stages: int | None = None,
    overlap: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA prefill on the GPU (or the interpreter). Arguments as :func:`k3verify.kda.tiled`.

    ``q, k:[B,T,H,K]``, ``v:[B,T,H,V]``, ``g:[B,T,H,K]`` (log-decay), ``beta:[B,T,H]`` in any
    float dtype; they are cast to ``operand_dtype`` (``g`` to fp32) on the kernel's device.
    With ``cu_seqlens:[N+1]``, ``B`` must be 1 and ``initial_state`` is ``[N,H,K,V]``.
    ``tile`` must be 16 (the sub-tile is compiled in); ``chunk_size`` 16, 32 or 64.
    Launch shapes (speed only; the defaults are the fastest measured on an H200,
    benchmarks/kda_gpu.py): ``block_v`` (default: by occupancy), ``num_warps`` and
    ``num_stages`` the state pass; ``output_block_v`` and ``output_warps`` the output launch;
    ``prefix_block_k`` and ``prefix_warps`` the prefix launch; ``intra_block_k`` (key slice),
    ``qk_warps`` (``A_qk`` launch), ``intra_warps`` and ``solve_block`` (the ``A_kk`` launch and
    the column width of its ``W``, ``U`` products) the sub-tile blocks. ``overlap`` (CUDA only)
    runs the ``A_qk`` launch on a second stream beside the state pass; ``False`` runs the
    launches in order on the current stream (the results are the same bits either way).
    ``validate=False`` skips the value scans (NaN, positive log-decay) that wait for the device.
    Returns ``o:[B,T,H,V]`` in ``operand_dtype`` and the final state (fp32) on the kernel's device.
    """
    C = require_block("chunk_size", chunk_size)
    if tile != SUB_TILE:
        raise ValueError(f"the KDA chunk kernel is compiled for sub-tile {SUB_TILE}, got tile={tile}")
    if C not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 (a power of two from the sub-tile {SUB_TILE}), got {C}")
    if anchor not in ANCHORS:
        raise ValueError(f"unknown anchor {anchor!r}; choose one of {', '.join(ANCHORS)}")
    if block_v not in (None, 16, 32, 64, 128) or output_block_v not in (16, 32, 64, 128):
        raise ValueError(f"block_v and output_block_v must be 16, 32, 64 or 128, got {block_v}, {output_block_v}")
    for name, value in (("intra_block_k", intra_block_k), ("solve_block", solve_block),
                        ("prefix_block_k", prefix_block_k)):  # fmt: skip
        if value not in (16, 32, 64, 128):
            raise ValueError(f"{name} must be 16, 32, 64 or 128, got {value}")
    for name, value in (("num_warps", num_warps), ("intra_warps", intra_warps), ("qk_warps", qk_warps),
                        ("prefix_warps", prefix_warps), ("output_warps", output_warps)):  # fmt: skip
        if value not in (1, 2, 4, 8):
            raise ValueError(f"{name} must be 1, 2, 4 or 8, got {value}")
    if num_stages not in (2, 3, 4, None):
        # One stage gave wrong state-pass results on an H200 (Triton 3.6, block_v 32, H=96).
        raise ValueError(f"num_stages must be 2, 3 or 4, got {num_stages}")
    op = _check_operand_dtype(operand_dtype)
    dims, scale, cu = _check_layout(q, k, v, g, beta, initial_state, scale, cu_seqlens, validate)
    dev = _device(q)
    B, T, H, K, V = dims.B, dims.T, dims.H, dims.K, dims.V
    flat = [t.to(dev, op).reshape(B * T, H, d).contiguous() for t, d in ((q, K), (k, K), (v, V))]
    g32 = g.to(dev, torch.float32).reshape(B * T, H, K).contiguous()
    b_op = beta.to(dev, op).reshape(B * T, H).contiguous()
    if cu_seqlens is None:
        cu_dev, start, end, seq_chunks = _equal_lengths_table(B, T, C, dev)
    else:
        cu_dev, start, end, seq_chunks = (t.to(dev) for t in (cu, *chunk_table(cu, C)))
    NS, NC = len(cu) - 1, len(start)
    if block_v is None:
        # 64 when the state pass fills the device, else 16: more programs for the sequential
        # pass (measured on an H200: docs/gpu.md, "KDA launch settings").
        block_v = 64 if NS * H * triton.cdiv(V, 64) >= multiprocessors(dev) else 16
    BK, BV_full, BV = _block(K), _block(V), min(block_v, _block(V))
    BV_out = min(output_block_v, BV_full)
    BKP = min(prefix_block_k, BK)
    if num_stages is None:
        # 3 stages at block_v 16 and 32, 2 at 64: the fastest measured (same section).
        num_stages = 3 if BV <= 32 else 2
    ieee = op == torch.float32
    o = torch.empty(B * T, H, V, dtype=op, device=dev)
    hT = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.to(dev, torch.float32).contiguous() if initial_state is not None else None
    if NC:
        G = torch.empty(B * T, H, K, dtype=torch.float32, device=dev)
        QG, W = (torch.empty(B * T, H, K, dtype=op, device=dev) for _ in range(2))
        KE = torch.empty(NC, H, K, C, dtype=op, device=dev)
        U, VN = (torch.empty(B * T, H, V, dtype=op, device=dev) for _ in range(2))
        GL = torch.empty(NC, H, K, dtype=torch.float32, device=dev)
        Aqk, Tb = (torch.empty(B * T, H, C, dtype=op, device=dev) for _ in range(2))
        Hs = torch.empty(NC, H, K, V, dtype=op, device=dev)
        offset = anchor_shift * (SUB_TILE - 1) / 2
        # The launch defaults are the fastest measured on an H200 (docs/gpu.md, "KDA launch
        # settings", with the alternatives tried).
        _prefix_kernel[(NC * H * triton.cdiv(K, BKP),)](
            flat[1], g32, G, W, KE, GL, start, end, H=H, K=K, BK=BKP, C=C, IEEE=ieee,
            num_warps=prefix_warps,
        )  # fmt: skip
        def blocks(x: torch.Tensor, qk: bool, warps: int) -> None:
            _blocks_kernel[(NC * H,)](
                x, flat[1], flat[2], G, b_op, QG, Aqk, Tb, W, U, start, end, scale, offset,
                H=H, K=K, V=V, BK=min(intra_block_k, BK), BV=min(solve_block, BV_full, BK), C=C, BC=SUB_TILE,
                ANCHOR=_ANCHOR_CODE[anchor], IEEE=ieee, QK=qk, num_warps=warps,
            )  # fmt: skip

        blocks(flat[1], False, intra_warps)
        kk_done = mark(dev) if overlap else None
        _state_kernel[(triton.cdiv(V, BV), NS * H)](
            KE, GL, W, U, VN, Hs, h0, hT, cu_dev, seq_chunks,
            H=H, K=K, V=V, BK=BK, BV=BV, C=C, HAS_H0=h0 is not None, STORE_HT=hT is not None, IEEE=ieee,
            STAGES=num_stages, num_warps=num_warps,
        )  # fmt: skip
        # The state pass is a chain over chunks that leaves most of the device idle, and A_qk
        # (with e^G q) is needed only by the output launch: launched after the state pass on a
        # second stream, it runs beside it (faster than in order: docs/gpu.md).
        with beside(dev, kk_done):
            blocks(flat[0], True, qk_warps)
            qk_done = mark(dev) if kk_done is not None else None
        wait(dev, qk_done)
        _output_kernel[(NC * H * triton.cdiv(V, BV_out),)](
            QG, Aqk, VN, Hs, o, start, end, scale,
            H=H, K=K, V=V, BK=BK, BV=BV_out, C=C, IEEE=ieee, num_warps=output_warps,
        )  # fmt: skip
    elif hT is not None:
        hT.copy_(h0 if h0 is not None else torch.zeros_like(hT))
    out = o.reshape(B, T, H, V)
    if not output_final_state:
        return out, None
    return out, (hT if cu_seqlens is not None else hT.reshape(B, H, K, V))


def _check_layout(q, k, v, g, beta, initial_state, scale, cu_seqlens, validate=True):
    """Validate shapes, values (unless ``validate`` is off) and ``cu_seqlens``; return sizes,
    scale and sequence offsets."""
    dims, scale = check_inputs(q, k, v, g, beta, None, scale, values=validate)
    if cu_seqlens is None:
        _check_state(initial_state, (dims.B, dims.H, dims.K, dims.V), "B,H,K,V", validate)
        return dims, scale, _equal_offsets(dims.B, dims.T)
    if dims.B != 1:
        raise ValueError(f"with cu_seqlens the batch dimension must be 1 (sequences packed along T); got B={dims.B}")
    cu = check_cu_seqlens(cu_seqlens, dims.T)
    _check_state(initial_state, (len(cu) - 1, dims.H, dims.K, dims.V), "N,H,K,V", validate)
    return dims, scale, cu


def _check_state(state: torch.Tensor | None, expected: tuple[int, ...], names: str, validate: bool) -> None:
    """A state may come in any float dtype (kernels keep it fp32), finite, of ``expected`` shape."""
    if state is None:
        return
    require_float("initial_state", require_tensor("initial_state", state))
    if tuple(state.shape) != expected:
        raise ValueError(f"initial_state has shape {list(state.shape)}; expected [{names}] = {list(expected)}")
    if validate:
        require_finite("initial_state", state)


def fused_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_indices: torch.Tensor | None = None,
    operand_dtype: torch.dtype | str = torch.bfloat16,
    block_v: int = 64,
    num_warps: int = 4,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused recurrent KDA (the decode kernel), fp32 state.

    Without ``state_indices``: arguments and returns as :func:`k3verify.kda.recurrent`
    (``initial_state:[B,H,K,V]`` is copied, never modified). With ``state_indices:[B]`` (int),
    ``initial_state`` is a state pool ``[P,H,K,V]`` fp32 on the kernel's device that request
    ``b`` reads and updates in place at slot ``state_indices[b]``; ``-1`` marks a padding
    request (output 0, pool untouched); the pool is returned as the final state.
    ``o`` comes back in ``operand_dtype``; ``validate`` as in :func:`chunk`. ``block_v = 64``
    measured best on an H200 (docs/gpu.md, "KDA launch settings").
    """
    op = _check_operand_dtype(operand_dtype)
    if block_v not in (16, 32, 64, 128):
        raise ValueError(f"block_v must be 16, 32, 64 or 128, got {block_v}")
    dev = _device(q)
    if state_indices is None:
        dims, scale, _ = _check_layout(q, k, v, g, beta, initial_state, scale, None, validate)
        B, H, K, V = dims.B, dims.H, dims.K, dims.V
        if initial_state is None:
            pool = torch.zeros(B, H, K, V, dtype=torch.float32, device=dev)
        else:
            pool = initial_state.to(dev, torch.float32).clone()
        indices = torch.arange(B, device=dev)
    else:
        dims, scale = check_inputs(q, k, v, g, beta, None, scale, values=validate)
        B, H, K, V = dims.B, dims.H, dims.K, dims.V
        pool, indices = _check_pool(initial_state, state_indices, dims, dev, validate)
    T = dims.T
    args = [t.to(dev, op).contiguous() for t in (q, k, v)]
    g32 = g.to(dev, torch.float32).contiguous()
    b_op = beta.to(dev, op).contiguous()
    o = torch.zeros(B, T, H, V, dtype=op, device=dev)
    BV = min(block_v, _block(V))
    if T:
        _recurrent_kernel[(triton.cdiv(V, BV), B * H)](
            *args, g32, b_op, o, pool, indices, scale, T, H=H, K=K, V=V, BK=_block(K), BV=BV, num_warps=num_warps
        )
    return o, (pool if output_final_state or state_indices is not None else None)


def _check_pool(pool, state_indices, dims, dev, validate) -> tuple[torch.Tensor, torch.Tensor]:
    """A state pool must be fp32, contiguous, on the kernel's device, ``[P,H,K,V]``; indices
    ``[B]`` integers in ``[-1, P)``."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError("with state_indices, initial_state must be the state pool tensor [P,H,K,V]")
    if pool.dtype != torch.float32 or pool.device.type != dev.type or not pool.is_contiguous():
        raise ValueError(
            f"the state pool is updated in place: it must be a contiguous fp32 tensor on {dev}, "
            f"got {dtype_name(pool.dtype)} on {pool.device}"
        )
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (dims.H, dims.K, dims.V):
        raise ValueError(f"state pool has shape {list(pool.shape)}; expected [P, {dims.H}, {dims.K}, {dims.V}]")
    if not isinstance(state_indices, torch.Tensor) or state_indices.dtype.is_floating_point:
        raise TypeError("state_indices must be an integer tensor [B]")
    if tuple(state_indices.shape) != (dims.B,):
        raise ValueError(f"state_indices has shape {list(state_indices.shape)}; expected [B] = [{dims.B}]")
    idx = state_indices.to(dev, torch.int64).contiguous()
    if not validate:
        return pool, idx
    if bool(((idx < -1) | (idx >= pool.shape[0])).any()):
        raise ValueError(f"state_indices must lie in [-1, {pool.shape[0]}); got {state_indices.tolist()}")
    live = idx[idx >= 0]
    if live.numel() != live.unique().numel():
        raise ValueError("state_indices names a pool slot twice; requests would race on one state")
    return pool, idx

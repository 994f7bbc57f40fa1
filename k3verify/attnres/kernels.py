"""Block AttnRes GPU kernels in Triton: the two phases of a block, the single call and the walk.

AttnRes is memory-bound: every call reads its stored blocks ``[n, T, d]``. The kernels read
the stream in its own dtype (bf16 in production, fp32 under the interpreter), compute RMSNorm,
logits and the softmax in fp32 and write the statistics in fp32 (docs/model.md §3):

- :func:`phase1`, once per block for the block's ``Q`` queries (24 for K3), in two launches:
  *logits*, one program per token tile for all stored blocks, reads each block once and
  computes its squares and its products with every query's ``w ⊙ γ`` as one product of the
  tile with the queries (bf16 streams: exact products with a three-part bf16 split of
  ``w ⊙ γ``; fp16: tf32x3; fp32: fp64);
  *accumulate*, one program per token and quarter of the width, applies the RMS scale to the
  products (fp64) and forms for every query at once ``m = max ℓ``, ``Z = Σ e^{ℓ−m}`` and
  ``N = Σ e^{ℓ−m} v``, reading each block's tile once (bf16: exact products of the tile with
  the weights split into three bf16 parts). The blocks may be any ``[n, T, d]`` view with
  contiguous rows (the walk's stack, or the token-major buffer ``[T, n, d]`` transposed).
- :func:`phase2`, per call: one program per token tile takes the partial sum's logit ``r``
  (RMS and product over the whole width, fp32), then writes ``h = (e^{m−M} N + e^{r−M} p) /
  (e^{m−M} Z + e^{r−M})``, ``M = max(m, r)``, in the stream dtype.
- :func:`aggregate` is one call over ``N`` sources (decode): phase 1 over all but the last
  (one query), phase 2 with the last as the partial sum.
- :func:`walk` is the depth walk (:mod:`k3verify.attnres.layer`) with these kernels.

Under the interpreter only fp32 streams are faithful (:mod:`k3verify.triton_support`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch

from ..numerics import map_tensors, resolve_dtype
from ..numerics.ops import RMS_NORM_EPS
from ..numerics.validate import require_finite, require_float, require_tensor
from ..triton_support import block, device_for, dot_fp32, interpreted, tl, triton
from ..triton_support import unavailable_reason as _unavailable
from .chunkwise import Stats
from .inputs import Options, Precision, Sublayers
from .layer import AttnResWeights, DepthStream, Walk
from .layer import walk as drive_walk
from .schedule import Call, Schedule, Source

__all__ = ["aggregate", "interpreted", "phase1", "phase2", "unavailable_reason", "walk", "walk_with"]

STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Logits: one [blocks × tokens, width] tile of 128 rows per step shares the step's w ⊙ γ parts
# (read from cache); measured on an H200 at K3's shape: 64-wide steps, 4 stages, 8 warps.
LOGITS_ROWS = 128
LOGITS_WIDTH = 64
LOGITS_STAGES = 4
LOGITS_WARPS = 8
EXACT_ROWS = 16  # fp64 products of a [rows, width, queries] tile
EXACT_WIDTH = 16
# Accumulate (bf16, measured on an H200 at K3's shape): a token's width in 4 programs, 256-wide
# tiles, 3 stages, 4 warps.
ACC_SPLIT = 4
ACC_WIDTH = 256
ACC_STAGES = 3
EXACT_ACC_WIDTH = 128
# Merge: 2 tokens and 1024-wide tiles per step (measured on an H200, d = 1024 to 7168).
MERGE_TOKENS = 2
MERGE_WIDTH = 1024
PARTS_WIDTH = 128


def unavailable_reason(stream_dtype: torch.dtype | str = torch.bfloat16) -> str | None:
    """Why the kernels cannot give faithful results for a ``stream_dtype`` stream here, or ``None``."""
    return _unavailable("the AttnRes kernels", stream_dtype, STREAM_DTYPES)


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _normalised(dot, ss, D, eps):
    """``dot / sqrt(ss / D + eps)`` rounded once to fp32, from fp64 ``ss`` (and ``dot``): a few
    values per token, and a logit near 100 then carries one fp32 rounding, as the definition's."""
    return (dot.to(tl.float64) / tl.sqrt(ss / D + eps)).to(tl.float32)


@triton.jit
def _logits_kernel(v, sb, st, wg, g3, ell, ess, T, D, n, BT: tl.constexpr, BD: tl.constexpr, QP: tl.constexpr,
                   NP: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The logits' parts for a tile of ``BT`` tokens and all ``n`` stored blocks (row ``v[i, t]``
    at ``i·sb + t·st``): ``ell[t, i, q] = v[i, t] · wg[:, q]`` and ``ess[t, i] = ‖v[i, t]‖²``
    (fp64), which the accumulate launch normalises (:func:`_normalised`), as one ``[NP·BT,
    width]`` tile per width step: each tile of the queries serves every block (padded queries
    have ``wg = 0``: logit 0).

    ``MODE`` 0 (fp32 streams, the interpreter): products and sums in fp64, so a logit carries one
    fp32 rounding. 1 (bf16): the bf16 tile against ``w ⊙ γ`` split into three bf16 parts
    ``g3[k]`` (24 bits kept), each product exact; every width step's sums are fresh tensor-core
    sums added in fp32 (carried across steps in the tensor cores' accumulator instead, the logits
    moved by up to 1e-3 at K3's shape on an H200). 2 (fp16): one tf32x3 product per step (the
    stream is exact in tf32). ``PDL``: the accumulate launch may start once every program is
    past its loads (it waits for this launch's end in the kernel)."""
    r = tl.arange(0, NP * BT)
    src = r // BT
    t = tl.program_id(0) * BT + r % BT
    ok = (src < n) & (t < T)
    q = tl.arange(0, QP)
    rows = v + src.to(tl.int64) * sb + t.to(tl.int64) * st
    ss = tl.zeros([NP * BT], dtype=tl.float64)
    sq = tl.zeros([NP * BT, BD], dtype=tl.float32)
    if MODE == 0:
        acc = tl.zeros([NP * BT, QP], dtype=tl.float64)
    else:
        acc = tl.zeros([NP * BT, QP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        x = tl.load(rows[:, None] + dd[None, :], mask=ok[:, None] & (dd < D)[None, :], other=0.0)
        xf = x.to(tl.float32)
        if MODE == 0:
            g = tl.load(wg + dd[:, None] * QP + q[None, :], mask=(dd < D)[:, None], other=0.0)
            ss += tl.sum(xf.to(tl.float64) * xf.to(tl.float64), axis=1)
            acc += tl.sum(xf.to(tl.float64)[:, :, None] * g.to(tl.float64)[None, :, :], axis=1)
        else:
            # A 16-bit square is exact in fp32; each column's squares add in fp32 across the
            # steps (rounding at 2^-24 as a step's row sum would), the columns in fp64 at the end:
            # no row reduction per step (0.265 ms against 0.302 for the launch at K3's shape).
            sq += xf * xf
            if MODE == 1:
                parts = g3 + dd[:, None] * QP + q[None, :]
                step = tl.dot(x, tl.load(parts, mask=(dd < D)[:, None], other=0.0))
                step += tl.dot(x, tl.load(parts + D * QP, mask=(dd < D)[:, None], other=0.0))
                step += tl.dot(x, tl.load(parts + 2 * D * QP, mask=(dd < D)[:, None], other=0.0))
                acc += step
            else:
                g = tl.load(wg + dd[:, None] * QP + q[None, :], mask=(dd < D)[:, None], other=0.0)
                acc += dot_fp32(xf, g, False)
    if MODE != 0:
        ss = tl.sum(sq.to(tl.float64), axis=1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Unnormalised: the fp64 division and square root go to the accumulate launch (bf16: the
    # same bits and a faster phase; fp32 streams on a GPU: the fp64 sums' order is the
    # compiler's; docs/gpu.md, "AttnRes, MLA and MoE launch settings").
    cell = t.to(tl.int64) * n + src
    tl.store(ell + cell[:, None] * QP + q[None, :], acc, mask=ok[:, None])
    tl.store(ess + cell, ss, mask=ok)


@triton.jit
def _accumulate_kernel(v, sb, st, ell, ess, m_out, z_out, n_out, T, D, n, Q, eps, SPLIT: tl.constexpr,
                       BD: tl.constexpr, QP: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """For one token and ``1/SPLIT`` of the width, every query at once: its logits from the
    logits launch's products and squares (:func:`_normalised`), ``m, Z`` over the ``n`` stored
    blocks and ``N = P X``, the weights ``P:[queries, blocks]`` times the blocks' tiles
    ``X:[blocks, width]``, width tile by width tile; each output row is written once.

    ``MODE`` as :func:`_logits_kernel`'s: 0 exact fp32 products; 1 (bf16 stream) ``P`` split
    once into three bf16 parts, each times the bf16 tile (``NP >= 16`` rows, padding zero):
    exact products, the weights to 24 bits, the tile never converted; 2 (fp16) tf32x3. ``PDL``:
    launched as a programmatic dependent of the logits launch, whose end it waits for here.
    ``N`` is stored streaming (``.cs``): it is read by a later launch, not this one (faster on
    an H200: docs/gpu.md, "AttnRes, MLA and MoE launch settings")."""
    # A token's tiles run in one program: the weights are formed once, the tile loads are
    # pipelined ahead of the products and the stores, and a token's rows are read and its
    # outputs written as long runs (faster on an H200 than one program per tile, whose every
    # program waits for its own loads: docs/gpu.md).
    t = (tl.program_id(0) // SPLIT).to(tl.int64)
    qq = tl.arange(0, QP)
    src = tl.arange(0, NP)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dot = tl.load(ell + (t * n + src[None, :]) * QP + qq[:, None], mask=(src < n)[None, :], other=0.0)
    ss = tl.load(ess + t * n + src, mask=src < n, other=1.0)
    L = tl.where((src < n)[None, :], _normalised(dot, ss[None, :], D, eps), float("-inf"))
    _write_token(v, sb, st, L, m_out, z_out, n_out, t, tl.program_id(0) % SPLIT, T, D, n, Q, SPLIT, BD, QP, NP, MODE,
                 STAGES, "", "", ".cs")  # fmt: skip


@triton.jit
def _write_token(v, sb, st, L, m_out, z_out, n_out, t, part, T, D, n, Q, SPLIT: tl.constexpr, BD: tl.constexpr,
                 QP: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr, LOAD_EV: tl.constexpr,
                 STORE_EV: tl.constexpr, STORE_CM: tl.constexpr):  # fmt: skip
    """Token ``t``'s statistics from its logits ``L:[QP, NP]`` (fp32, ``-inf`` past ``n``) and
    its block rows (``v[i, t]`` at ``i·sb + t·st``): ``N`` for part ``part`` of ``SPLIT`` of the
    width (and ``m, Z`` from part 0), as :func:`_accumulate_kernel` says; ``LOAD_EV``,
    ``STORE_EV``, ``STORE_CM`` are the block loads' and the ``N`` stores' eviction policies and
    the stores' cache modifier."""
    span = tl.cdiv(tl.cdiv(D, SPLIT), BD) * BD
    qq = tl.arange(0, QP)
    src = tl.arange(0, NP)
    m = tl.max(L, axis=1)
    P = tl.exp(L - m[:, None])  # padded blocks: weight 0
    p1 = P.to(tl.bfloat16)
    rest = P - p1.to(tl.float32)
    p2 = rest.to(tl.bfloat16)
    p3 = (rest - p2.to(tl.float32)).to(tl.bfloat16)
    rows = v + src[:, None].to(tl.int64) * sb + t * st
    outs = n_out + (qq[:, None] * T + t) * D
    for d0 in tl.range(part * span, tl.minimum(part * span + span, D), BD, num_stages=STAGES):
        dd = d0 + tl.arange(0, BD)
        X = tl.load(rows + dd[None, :], mask=(src < n)[:, None] & (dd < D)[None, :], other=0.0,
                    eviction_policy=LOAD_EV)  # fmt: skip
        if MODE == 1:
            acc = tl.dot(p1, X)
            acc = tl.dot(p2, X, acc)
            acc = tl.dot(p3, X, acc)
        else:
            acc = dot_fp32(P, X.to(tl.float32), MODE == 0)
        tl.store(outs + dd[None, :], acc, mask=(qq < Q)[:, None] & (dd < D)[None, :], eviction_policy=STORE_EV,
                 cache_modifier=STORE_CM)  # fmt: skip
    if part == 0:
        tl.store(m_out + qq * T + t, m, mask=qq < Q)
        tl.store(z_out + qq * T + t, tl.sum(P, axis=1), mask=qq < Q)


@triton.jit
def _parts_kernel(w, gamma, g3, D, Q, QP: tl.constexpr, BD: tl.constexpr):
    """``g3[j, c, q]``, ``j < 3``: the bf16 parts of ``w[q, c] · γ[q, c]`` (fp32 operands; zero
    columns past ``Q``), a ``BD``-wide slice of the width per program: :func:`_split_bf16` of
    :func:`_queries` in one launch (cheaper than the torch operations on an H200: docs/gpu.md)."""
    c = tl.program_id(0) * BD + tl.arange(0, BD)
    q = tl.arange(0, QP)
    ok = (c < D)[:, None] & (q < Q)[None, :]
    at = q[None, :] * D + c[:, None]
    # The product rounded to fp32, as torch's (no flush of subnormals): contracted into the first
    # residual's fma, the parts would carry the exact product instead.
    x = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r",
                                  [tl.load(w + at, mask=ok, other=0.0), tl.load(gamma + at, mask=ok, other=0.0)],
                                  dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    out = g3 + c[:, None] * QP + q[None, :]
    for j in tl.static_range(3):
        part = x.to(tl.bfloat16)
        tl.store(out + j * D * QP, part, mask=(c < D)[:, None])
        x = x - part.to(tl.float32)


@triton.jit
def _merge_kernel(m_in, z_in, n_in, p, wg, h, T, D, eps, HAS_P: tl.constexpr, BT: tl.constexpr,
                  BD: tl.constexpr):  # fmt: skip
    """``h`` for a tile of tokens: the stored-set statistics merged with the partial sum ``p``."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    rows = t[:, None].to(tl.int64) * D
    m = tl.load(m_in + t, mask=t < T, other=0.0)
    Z = tl.load(z_in + t, mask=t < T, other=1.0)
    if HAS_P:
        # One product per element: fp64 costs nothing here, and r then carries one fp32 rounding.
        ss = tl.zeros([BT], dtype=tl.float64)
        dot = tl.zeros([BT], dtype=tl.float64)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            x = tl.load(p + rows + dd[None, :], mask=(t < T)[:, None] & (dd < D)[None, :], other=0.0).to(tl.float64)
            g = tl.load(wg + dd, mask=dd < D, other=0.0).to(tl.float64)
            ss += tl.sum(x * x, axis=1)
            dot += tl.sum(x * g[None, :], axis=1)
        r = _normalised(dot, ss, D, eps)
        M = tl.maximum(m, r)
        a = tl.exp(m - M)  # 0 for an empty stored set (m = -inf)
        b = tl.exp(r - M)
    else:
        a = tl.full([BT], 1.0, dtype=tl.float32)
        b = tl.zeros([BT], dtype=tl.float32)
    den = a * Z + b
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        tile = (t < T)[:, None] & (dd < D)[None, :]
        num = a[:, None] * tl.load(n_in + rows + dd[None, :], mask=tile, other=0.0)
        if HAS_P:
            num += b[:, None] * tl.load(p + rows + dd[None, :], mask=tile, other=0.0).to(tl.float32)
        out = tl.math.div_rn(num, tl.broadcast_to(den[:, None], (BT, BD)))
        tl.store(h + rows + dd[None, :], out.to(h.dtype.element_ty), mask=tile)


# --- launchers -------------------------------------------------------------------------------


def _check_stream(name: str, x: torch.Tensor) -> torch.dtype:
    require_tensor(name, x)
    require_float(name, x)
    reason = unavailable_reason(x.dtype)
    if reason is not None:
        raise RuntimeError(reason)
    return x.dtype


def _queries(w: torch.Tensor, gamma: torch.Tensor, d: int, dev: torch.device, pad: int,
             split: bool = False) -> torch.Tensor:  # fmt: skip
    """``(w ⊙ γ)ᵀ`` in fp32, ``[d, pad]`` with zero columns past the ``Q`` queries; with ``split``
    (CUDA only) its three bf16 parts ``[3, d, pad]``, as :func:`_split_bf16` makes them, in one
    launch."""
    if w.shape != gamma.shape or w.shape[-1] != d:
        raise ValueError(f"w {list(w.shape)} and gamma {list(gamma.shape)} must both be [Q, d] with d = {d}")
    if split:
        parts = torch.empty(3, d, pad, dtype=torch.bfloat16, device=dev)
        _parts_kernel[(triton.cdiv(d, PARTS_WIDTH),)](
            w.to(dev, torch.float32).contiguous(), gamma.to(dev, torch.float32).contiguous(), parts, d, w.shape[0],
            QP=pad, BD=PARTS_WIDTH)  # fmt: skip
        return parts
    wg = torch.zeros(d, pad, dtype=torch.float32, device=dev)
    wg[:, : w.shape[0]] = (w.to(dev, torch.float32) * gamma.to(dev, torch.float32)).T
    return wg


def _dependent_launches(dev: torch.device) -> bool:
    """Whether a launch on ``dev`` may start before the one it depends on ends (programmatic
    dependent launch: CUDA devices from sm_90 on; not the interpreter)."""
    return dev.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(dev)[0] >= 9


def _split_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) as three bf16 parts ``[3, *x.shape]`` whose sum keeps 24 bits of each value:
    a bf16 operand times each part is exact in fp32."""
    parts, rest = [], x
    for _ in range(3):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()
    return torch.stack(parts).contiguous()


def _rows_contiguous(stored: torch.Tensor) -> torch.Tensor:
    """``stored:[n, T, d]`` as it is where each row ``stored[i, t]`` is contiguous (the walk's
    stack ``[n, T, d]``, or a view ``buffer.transpose(0, 1)`` of vLLM's token-major block buffer
    ``[T, n, d]``: the kernels address rows by the two outer strides), else a contiguous copy."""
    return stored if stored.stride(-1) == 1 else stored.contiguous()


def phase1(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = RMS_NORM_EPS) -> Stats:
    """Phase-1 statistics of queries ``w, gamma:[Q, d]`` over ``stored:[n, T, d]`` (the stream
    dtype; ``n = 0`` allowed; any strides with contiguous rows, such as a view of a token-major
    buffer ``[T, n, d]``): ``m, Z:[Q, T]`` and ``N:[Q, T, d]``, fp32, on the stream's device."""
    _check_stream("stored", stored)
    if stored.dim() != 3:
        raise ValueError(f"stored has shape {list(stored.shape)}; expected [n, T, d]")
    w, gamma = torch.atleast_2d(w), torch.atleast_2d(gamma)
    n, T, d = stored.shape
    Q = w.shape[0]
    dev = device_for(stored, "the AttnRes kernels")
    stored = _rows_contiguous(stored.to(dev))
    if n == 0 or T == 0:
        return Stats(torch.full((Q, T), float("-inf"), dtype=torch.float32, device=dev),
                     torch.zeros(Q, T, dtype=torch.float32, device=dev),
                     torch.zeros(Q, T, d, dtype=torch.float32, device=dev))  # fmt: skip
    # Every entry is written below: no fill (a memset of N costs as much as a third of the pass).
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty(Q, T, dtype=torch.float32, device=dev)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    QP, NP = block(Q), block(n)
    rows_np = triton.next_power_of_2(n)  # the logits' rows need no padding to 16 blocks
    exact = interpreted() or stored.dtype == torch.float32
    mode = 0 if exact else 1 if stored.dtype == torch.bfloat16 else 2
    # A token's products together (fp64 where they are summed in fp64), and their squares.
    ell = torch.empty(T, n, QP, dtype=torch.float64 if exact else torch.float32, device=dev)
    ess = torch.empty(T, n, dtype=torch.float64, device=dev)
    wg = _queries(w, gamma, d, dev, QP, split=mode == 1)
    pdl = _dependent_launches(dev) and not exact
    BT = max((EXACT_ROWS if exact else LOGITS_ROWS) // rows_np, 1)
    sb, st = stored.stride(0), stored.stride(1)
    _logits_kernel[(triton.cdiv(T, BT),)](
        stored, sb, st, wg, wg, ell, ess, T, d, n, BT=BT, QP=QP, NP=rows_np, PDL=pdl,
        BD=EXACT_WIDTH if exact else LOGITS_WIDTH, MODE=mode, num_stages=1 if exact else LOGITS_STAGES,
        num_warps=4 if exact else LOGITS_WARPS,
    )  # fmt: skip
    width = ACC_WIDTH if mode == 1 else EXACT_ACC_WIDTH
    split = min(ACC_SPLIT, triton.cdiv(d, width))
    _accumulate_kernel[(T * split,)](
        stored, sb, st, ell, ess, m, Z, N, T, d, n, Q, float(eps), SPLIT=split, BD=width, QP=QP, NP=NP, MODE=mode,
        STAGES=1 if exact else ACC_STAGES, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return Stats(m, Z, N)


def phase2(stats: Stats, partial: torch.Tensor | None, w: torch.Tensor, gamma: torch.Tensor, *,
           eps: float = RMS_NORM_EPS, out_dtype: torch.dtype | str | None = None) -> torch.Tensor:  # fmt: skip
    """One call's ``h:[T, d]`` from its query's statistics (``m, Z:[T]``, ``N:[T, d]``) and the
    partial sum ``partial:[T, d]`` (``None`` at a block start) with its query's ``w, gamma:[d]``,
    in ``out_dtype`` (default: the partial's dtype, else fp32)."""
    T, d = stats.N.shape
    dev = stats.N.device
    if partial is not None:
        _check_stream("partial", partial)
        if tuple(partial.shape) != (T, d):
            raise ValueError(f"partial has shape {list(partial.shape)}; expected {[T, d]}")
        partial = partial.to(dev).contiguous()
    dtype = resolve_dtype(out_dtype) if out_dtype is not None else (partial.dtype if partial is not None
                                                                    else torch.float32)  # fmt: skip
    h = torch.empty(T, d, dtype=dtype, device=dev)
    if T == 0:
        return h
    if w.shape != (d,) or gamma.shape != (d,):
        raise ValueError(f"w {list(w.shape)} and gamma {list(gamma.shape)} must both be [d] with d = {d}")
    wg = (w.to(dev, torch.float32) * gamma.to(dev, torch.float32)).contiguous()
    _merge_kernel[(triton.cdiv(T, MERGE_TOKENS),)](
        stats.m.contiguous(), stats.Z.contiguous(), stats.N.contiguous(), partial if partial is not None else h, wg,
        h, T, d, float(eps), HAS_P=partial is not None, BT=MERGE_TOKENS, BD=MERGE_WIDTH,
    )  # fmt: skip
    return h


def aggregate(sources: torch.Tensor | Sequence[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor, *,
              eps: float = RMS_NORM_EPS) -> torch.Tensor:  # fmt: skip
    """One AttnRes call over ``sources:[N, T, d]`` (stored blocks, then the partial sum last) with
    ``w, gamma:[d]``: ``h:[T, d]`` in the sources' dtype, on their device."""
    v = torch.stack(list(sources)) if not isinstance(sources, torch.Tensor) else sources
    _check_stream("sources", v)
    require_finite("sources", v)
    if v.dim() != 3 or v.shape[0] < 1:
        raise ValueError(f"sources has shape {list(v.shape)}; expected [N, T, d] with N >= 1")
    stats = phase1(v[:-1], w, gamma, eps=eps)
    return phase2(stats[0], v[-1], w, gamma, eps=eps, out_dtype=v.dtype)


class TwoPhase(Protocol):
    """A two-phase implementation of AttnRes calls: ``first(stored:[n, T, d], w, gamma:[Q, d],
    eps)`` returns per-query state indexable by query, ``second(state[q], partial:[T, d] | None,
    w, gamma:[d], eps, out_dtype)`` returns that call's ``h:[T, d]``. Ours: :func:`phase1`,
    :func:`phase2`; an adapter brings its own."""

    def first(self, stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float) -> Any: ...

    def second(self, state: Any, partial: torch.Tensor | None, w: torch.Tensor, gamma: torch.Tensor, eps: float,
               out_dtype: torch.dtype) -> torch.Tensor: ...  # fmt: skip


class _Ours:
    def first(self, stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, eps: float) -> Stats:
        return phase1(stored, w, gamma, eps=eps)

    def second(self, state: Stats, partial: torch.Tensor | None, w: torch.Tensor, gamma: torch.Tensor, eps: float,
               out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return phase2(state, partial, w, gamma, eps=eps, out_dtype=out_dtype)


class _TwoPhaseMixer(DepthStream):
    """Phase 1 at every block start for the block's calls; phase 2 per call (the chunkwise
    walk's schedule, :class:`k3verify.attnres.chunkwise._ChunkwiseMixer`, on kernels)."""

    def __init__(self, e: torch.Tensor, params: AttnResWeights, schedule: Schedule, prec: Precision, opts: Options,
                 *, phases: TwoPhase):  # fmt: skip
        super().__init__(e, schedule, prec)
        self.params, self.eps, self.phases = params, opts.eps, phases
        self.state: Any = None
        self.first_query = 0

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]:
        s, B = call.index, self.schedule.block_sublayers
        stream = self.prec.stream
        if s % B == 0:
            queries = slice(s, min(s + B, self.schedule.num_calls))
            stored = torch.stack(self.blocks).to(stream)  # exact: blocks hold stream values
            self.state = self.phases.first(stored, self.params.w[queries], self.params.gamma[queries], self.eps)
            self.first_query = s
        partial = None if self.partial is None else self.partial.to(stream)
        h = self.phases.second(self.state[s - self.first_query], partial, self.params.w[s], self.params.gamma[s],
                               self.eps, stream)  # fmt: skip
        refs = tuple(self.block_refs) if partial is None else (*self.block_refs, self.partial_ref)
        return h.to(self.prec.compute), refs


def walk_with(phases: TwoPhase, embedding: torch.Tensor, weights: AttnResWeights, sublayers: Sublayers, *,
              schedule: Schedule | None = None, eps: float = RMS_NORM_EPS) -> Walk:  # fmt: skip
    """The depth walk with ``phases``, the stream in ``embedding``'s dtype, on the kernels' device."""
    dev = device_for(embedding, "the AttnRes kernels")
    opts = Options(embedding.dtype, None, 4, True, eps)
    return drive_walk(embedding.to(dev), map_tensors(weights, lambda t: t.to(dev)), sublayers, schedule or Schedule(),
                      opts, partial(_TwoPhaseMixer, phases=phases))  # fmt: skip


def walk(embedding: torch.Tensor, weights: AttnResWeights, sublayers: Sublayers, *, schedule: Schedule | None = None,
         eps: float = RMS_NORM_EPS) -> Walk:  # fmt: skip
    """The depth walk with our kernels, the stream in ``embedding``'s dtype (bf16 or fp16 on a
    GPU, fp32 anywhere Triton runs) on its device; arguments as :func:`k3verify.attnres.recurrent`."""
    _check_stream("embedding", embedding)
    return walk_with(_Ours(), embedding, weights, sublayers, schedule=schedule, eps=eps)

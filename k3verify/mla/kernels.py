"""Gated MLA GPU kernels in Triton: absorbed decode over the paged latent cache (docs/model.md §2.4) and
the expanded chunked prefill (docs/model.md §2.3).

``decode(q_nope, q_pe, cache, w_uk, w_uv, *, scale=None, num_splits=1)`` takes the common MLA
signature (:mod:`k3verify.mla.inputs`) and returns ``o:[B, T, H, Dv]``; query ``t`` of request
``b`` sees positions ``< seq_lens[b] - T + t + 1`` (one token per request in decode; a chunk
of the last ``T`` tokens, causal, works the same way):

1. host: the absorbed query ``q_lat,h = W_UK,hᵀ q^n_h`` (fp32 product, then the operand dtype);
2. kernel, one program per (request and query token, block of heads, split of the keys): every
   head of the block shares the cache tile it reads (latent MQA). Key positions map to slots
   through ``block_table``; positions past the query's own are masked and never loaded, so a
   dead slot's NaN poison cannot reach an output. Scores ``scale (q_latᵀ ĉ + q^pᵀ k^p)`` and the
   online softmax run in fp32, products take operand-dtype tiles with fp32 accumulation, an
   fp8 e4m3 cache is dequantised per token (code × scale) into the operand dtype as it is
   loaded. Each split writes its normalised partial output and its log-sum-exp in fp32;
3. host: splits merged by their log-sum-exp in fp32, then ``o_h = W_UV,hᵀ o_lat,h`` (fp32
   product), written in the operand dtype.

``prefill(q_nope, q_pe, cache, w_uk, w_uv, *, scale=None)`` is the expanded form of the same
attention (docs/model.md §2.3), for chunks of many new tokens:

1. host: the cached latents of every position the queries see are read through
   ``block_table`` (dead slots selected away, an fp8 cache dequantised in fp32) and
   up-projected per head, ``k^n = W_UKᵀ ĉ`` and ``v = W_UVᵀ ĉ`` (fp32 products, then the operand
   dtype); ``k^p`` stays one vector per position, shared by the heads;
2. kernel, one program per (request and head, block of queries): one fp32 online softmax of
   ``τ (q^n·k^n + q^p·k^p)`` over the *prefix* (positions before the chunk, every one
   visible) and then the chunk's own tokens (causal). The online softmax is the log-sum-exp
   merge of the two parts taken key tile by key tile, so there is no second pass and an empty
   prefix adds nothing; the output is written in the operand dtype.

Operands are the dtype the queries are given in (bf16, fp16, fp32; with an fp8 cache, bf16 or
fp16). Under Triton's interpreter fp32 and fp16 are faithful (its fp16 conversions round to
nearest even and its fp16 products are exact); bf16 and fp8 need a GPU
(:mod:`k3verify.triton_support`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..numerics import map_tensors
from ..numerics.validate import require_block
from ..triton_support import block, check_launch, device_for, dot, interpreted, tl, triton
from ..triton_support import unavailable_reason as _unavailable
from .cache import LatentCache, gather
from .inputs import check_inputs, heads_first
from .recurrent import absorb_output, absorb_query
from .reference import up_project

__all__ = ["DecodeLaunch", "decode", "decode_launch", "expanded_operands", "interpreted", "latent_attention", "prefill",
           "prefill_attention", "unavailable_reason"]

OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_BLOCKS = (16, 32, 64)  # the head blocks a decode program may take: tl.dot sides up to a wgmma's 64 rows


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's launch shape on a GPU: ``heads`` per program (one of
    :data:`HEAD_BLOCKS`, a ``tl.dot`` side; the heads of a program share every cache tile they
    read), ``keys`` per cache tile, Triton's ``warps`` and pipeline ``stages`` (the interpreter
    ignores those two). On sm_90 only a 64-head block is a wgmma side (Triton takes warpgroup
    products for 64 rows and more); 16 and 32 take the older ``mma.sync`` products."""

    heads: int = 16
    keys: int = 64
    warps: int = 4
    stages: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads not in HEAD_BLOCKS:
            raise ValueError(f"DecodeLaunch.heads must be one of {HEAD_BLOCKS}, got {self.heads!r}")
        check_launch("DecodeLaunch", dict(keys=self.keys), self.warps, self.stages)

    def __str__(self) -> str:
        return f"{self.heads} heads x {self.keys} keys w{self.warps} s{self.stages}"


# Decode launch shape: 16 heads by 64-key tiles on 4 warps, 2 stages, the fastest timed on an H200
# at 12 heads (docs/gpu.md, "AttnRes, MLA and MoE launch settings").
DECODE_LAUNCH = DecodeLaunch()
# The shapes benchmarks/mla_gpu.py sweeps (with the split counts) and benchmarks/kernel_compile.py
# compiles: the 16- and 32-head blocks on 4 and 8 warps, and the 64-head block, a wgmma side, on 8
# (on 4 warps its fp32 accumulator of 64 x 512 spills about 1 KB).
DECODE_SHAPES = (DECODE_LAUNCH, DecodeLaunch(16, warps=8), DecodeLaunch(32), DecodeLaunch(32, warps=8),
                 DecodeLaunch(64, warps=8), DecodeLaunch(64, keys=32, warps=8),
                 DecodeLaunch(64, keys=32, warps=8, stages=3))  # fmt: skip


# More than 32 heads (K3's 96 on one device), timed on an H100 at B = 64 and 256, context 4096 and
# 32768 (docs/gpu.md, "Gated MLA"): a bf16 cache runs fastest in 32-head blocks on 4 warps (0.81-0.86x
# the 16-head default's time at three of the four shapes, 0.95x at the fourth, where the 64-head
# block took 0.92x), an fp8 cache in 64-head blocks on 8 warps (0.48-0.53x: its tiles are
# dequantised by a third as many programs).
WIDE_DECODE_LAUNCH = DecodeLaunch(32)
WIDE_FP8_DECODE_LAUNCH = DecodeLaunch(64, warps=8)


def decode_launch(heads: int, quantized: bool = False) -> DecodeLaunch:
    """The decode launch shape for ``heads`` query heads over a cache stored in the operand dtype
    or, ``quantized``, in fp8 codes; up to 32 heads the 16-head default (timed at 12)."""
    if heads <= 32:
        return DECODE_LAUNCH
    return WIDE_FP8_DECODE_LAUNCH if quantized else WIDE_DECODE_LAUNCH


# Prefill tiles (16 x 16 under the interpreter, where size is time), the fastest of those timed on
# an H200 at K3's widths (benchmarks/mla_gpu.py): 128 queries by 64 keys, 8 warps, 3 stages.
# The query block must be a multiple of the key block (the diagonal's tiles start on it).
PREFILL_QUERIES = 128
PREFILL_KEYS = 64
PREFILL_WARPS = 8
PREFILL_STAGES = 3
PREFILL_GROUP = 2  # heads whose query blocks are launched together (the launch order)
# fp32 operands take twice the shared memory per tile: 128 x 64 with 3 stages asks an H200 for
# 295 KB against its 227 KB, so they run on half-size tiles with 2 stages (fp32 is a reference
# path on the GPU, not a speed one).
PREFILL_FP32_QUERIES = 64
PREFILL_FP32_KEYS = 32
PREFILL_FP32_STAGES = 2


def unavailable_reason(operand_dtype: torch.dtype | str = torch.bfloat16) -> str | None:
    """Why the kernels cannot give faithful results for ``operand_dtype`` here, or ``None``."""
    return _unavailable("the MLA kernels", operand_dtype, OPERAND_DTYPES, (torch.float32, torch.float16))


@triton.jit
def _latent_chunk(pool, slot, col, pm, R, W, sc, QUANT: tl.constexpr, OP: tl.constexpr):
    """Columns ``col:[BC]`` of the cache entries at ``slot:[BN]`` (rows ``pm`` only; the rest
    read as 0), dequantised per token by ``sc:[BN]`` into ``OP`` for an fp8 cache."""
    c = tl.load(pool + slot[:, None] * W + col[None, :], mask=pm[:, None] & (col < R)[None, :], other=0.0)
    if QUANT:
        c = (c.to(tl.float32) * sc[:, None]).to(OP)
    return c


@triton.jit
def _decode_kernel(
    q_lat, q_pe, pool, scales, block_table, seq_lens, o_part, lse_part,
    T, H, R, Dr, W, page_size, max_pages, BT, scale, num_splits, head_blocks,
    BH: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr,
    QUANT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (request and query token, key split, block of ``BH`` heads): the online softmax of
    the block's heads over the split's keys, the latent width in ``NC`` chunks of ``BC``."""
    # The head blocks of one (token, split) are neighbours in the launch, so the cache tiles they
    # all read are fetched from memory once and then from L2.
    pid = tl.program_id(0)
    hh = (pid % head_blocks) * BH + tl.arange(0, BH)
    sp = (pid // head_blocks) % num_splits
    bt = (pid // (head_blocks * num_splits)).to(tl.int64)
    b = bt // T
    visible = tl.load(seq_lens + b).to(tl.int32) - T + (bt % T).to(tl.int32) + 1
    per = tl.cdiv(visible, num_splits)
    k0 = sp * per
    k1 = tl.minimum(visible, k0 + per)
    rc = tl.arange(0, BC)
    pp = tl.arange(0, BDR)
    hm = hh < H
    rows = (bt * H + hh)[:, None]
    OP = q_lat.dtype.element_ty
    # The latent width in up to four chunks, each with its own score product and accumulator:
    # with 16 head rows per tile, one product over all 512 columns is a chain of dependent
    # tensor-core steps whose latency the pass waits on; four chains run side by side (what
    # this buys on an H200: docs/gpu.md).
    q_at = q_lat + rows * R + rc[None, :]
    ql0 = tl.load(q_at, mask=hm[:, None] & (rc < R)[None, :], other=0.0)
    acc0 = tl.zeros([BH, BC], dtype=tl.float32)
    if NC >= 2:
        ql1 = tl.load(q_at + BC, mask=hm[:, None] & (BC + rc < R)[None, :], other=0.0)
        acc1 = tl.zeros([BH, BC], dtype=tl.float32)
    if NC == 4:
        ql2 = tl.load(q_at + 2 * BC, mask=hm[:, None] & (2 * BC + rc < R)[None, :], other=0.0)
        ql3 = tl.load(q_at + 3 * BC, mask=hm[:, None] & (3 * BC + rc < R)[None, :], other=0.0)
        acc2 = tl.zeros([BH, BC], dtype=tl.float32)
        acc3 = tl.zeros([BH, BC], dtype=tl.float32)
    qp = tl.load(q_pe + rows * Dr + pp[None, :], mask=hm[:, None] & (pp < Dr)[None, :], other=0.0)
    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BH], dtype=tl.float32)
    # Each tile's pages are read one iteration ahead: a cache load whose address comes from a
    # load in the same iteration is single-buffered by the software pipeliner, one whose address
    # was read the iteration before is buffered num_stages - 1 deep (the bandwidth of the pass).
    ahead = k0 + tl.arange(0, BN)
    next_page = tl.load(block_table + b * max_pages + ahead // page_size, mask=ahead < k1, other=0).to(tl.int32)
    for n0 in range(k0, k1, BN):
        pos = n0 + tl.arange(0, BN)
        pm = pos < k1
        page = next_page
        ahead = pos + BN
        next_page = tl.load(block_table + b * max_pages + ahead // page_size, mask=ahead < k1, other=0).to(tl.int32)
        slot = page.to(tl.int64) * page_size + pos % page_size
        if QUANT:
            sc = tl.load(scales + slot, mask=pm, other=0.0)
        else:
            sc = tl.zeros([BN], dtype=tl.float32)
        c0 = _latent_chunk(pool, slot, rc, pm, R, W, sc, QUANT, OP)
        s = dot(ql0, tl.trans(c0), IEEE)
        if NC >= 2:
            c1 = _latent_chunk(pool, slot, BC + rc, pm, R, W, sc, QUANT, OP)
            s += dot(ql1, tl.trans(c1), IEEE)
        if NC == 4:
            c2 = _latent_chunk(pool, slot, 2 * BC + rc, pm, R, W, sc, QUANT, OP)
            c3 = _latent_chunk(pool, slot, 3 * BC + rc, pm, R, W, sc, QUANT, OP)
            s += dot(ql2, tl.trans(c2), IEEE) + dot(ql3, tl.trans(c3), IEEE)
        kp = tl.load(pool + slot[:, None] * W + R + pp[None, :], mask=pm[:, None] & (pp < Dr)[None, :], other=0.0)
        if QUANT:
            kp = (kp.to(tl.float32) * sc[:, None]).to(OP)
        s += dot(qp, tl.trans(kp), IEEE)
        s = tl.where(pm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        p = p.to(OP)
        acc0 = dot(p, c0, IEEE, acc0 * alpha[:, None])
        if NC >= 2:
            acc1 = dot(p, c1, IEEE, acc1 * alpha[:, None])
        if NC == 4:
            acc2 = dot(p, c2, IEEE, acc2 * alpha[:, None])
            acc3 = dot(p, c3, IEEE, acc3 * alpha[:, None])
        m = m_new
    # An empty split (more splits than keys) leaves m = -inf, den = 0: weight 0 in the merge.
    inv = 1.0 / tl.where(den > 0, den, 1.0)[:, None]
    base = sp.to(tl.int64) * BT + bt
    o_at = o_part + (base * H + hh)[:, None] * R + rc[None, :]
    tl.store(o_at, acc0 * inv, mask=hm[:, None] & (rc < R)[None, :])
    if NC >= 2:
        tl.store(o_at + BC, acc1 * inv, mask=hm[:, None] & (BC + rc < R)[None, :])
    if NC == 4:
        tl.store(o_at + 2 * BC, acc2 * inv, mask=hm[:, None] & (2 * BC + rc < R)[None, :])
        tl.store(o_at + 3 * BC, acc3 * inv, mask=hm[:, None] & (3 * BC + rc < R)[None, :])
    tl.store(lse_part + base * H + hh, tl.where(den > 0, m + tl.log(tl.where(den > 0, den, 1.0)), float("-inf")),
             mask=hm)  # fmt: skip


@triton.jit
def _softmax_step(qn, qp, kn_at, kp_at, v_at, pos, ok, seen, dn, dr, dv, Dn, Dr, Dv, scale2, m, den, acc,
                  IEEE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One key tile of an fp32 online softmax in base 2 (``m`` in units of log2, ``scale2 = τ
    log2 e``): the keys at positions ``pos:[BN]`` (int32 offsets from this head's ``kn_at``,
    ``v_at`` and this request's shared ``kp_at``). With ``MASKED``, ``ok:[BN]`` are the keys to
    load (the rest read as 0) and ``seen:[BM, BN]`` the visible pairs; without, every key of
    the tile is loaded and seen by every query. Returns the new ``m, den, acc``."""
    if MASKED:
        kn = tl.load(kn_at + pos[:, None] * Dn + dn[None, :], mask=ok[:, None] & (dn < Dn)[None, :], other=0.0)
        kp = tl.load(kp_at + pos[:, None] * Dr + dr[None, :], mask=ok[:, None] & (dr < Dr)[None, :], other=0.0)
        vv = tl.load(v_at + pos[:, None] * Dv + dv[None, :], mask=ok[:, None] & (dv < Dv)[None, :], other=0.0)
    else:
        kn = tl.load(kn_at + pos[:, None] * Dn + dn[None, :], mask=(dn < Dn)[None, :], other=0.0)
        kp = tl.load(kp_at + pos[:, None] * Dr + dr[None, :], mask=(dr < Dr)[None, :], other=0.0)
        vv = tl.load(v_at + pos[:, None] * Dv + dv[None, :], mask=(dv < Dv)[None, :], other=0.0)
    # The rope part accumulates onto the nope part's product (one accumulator, no separate add).
    s = dot(qp, tl.trans(kp), IEEE, dot(qn, tl.trans(kn), IEEE)) * scale2
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A query that has seen no key yet keeps m = -inf: its exponentials use 0 instead (all 0).
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - ref)
    p = tl.exp2(s - ref[:, None])
    return m_new, den * alpha + tl.sum(p, axis=1), dot(p.to(qn.dtype), vv, IEEE, acc * alpha[:, None])


@triton.jit
def _prefill_kernel(
    q_n, q_p, k_n, k_p, v, o, starts, T, H, L, Dn, Dr, Dv, scale,
    BM: tl.constexpr, BN: tl.constexpr, BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
    GROUP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A block of ``BM`` queries of one (request, head): one fp32 online softmax over the prefix
    (the ``starts[b]`` positions before the chunk, every one visible) and then the chunk's own
    tokens (key ``start + i`` visible to query ``t`` when ``i <= t``) — the two parts' log-sum-exp
    merge of docs/model.md §2.3, done as the softmax goes. Writes ``o:[B, T, H, Dv]`` in its dtype."""
    # Launch order: GROUP heads at a time, each group's query blocks longest (last, causal) first,
    # the group's heads side by side: the programs running together share their heads' keys and
    # values in L2, and the short blocks fill the tail of the launch (faster on an H200 than
    # every head's longest block first: docs/gpu.md).
    blocks = tl.cdiv(T, BM)
    pid = tl.program_id(0)
    within = pid % (blocks * GROUP)
    bh = ((pid // (blocks * GROUP)) * GROUP + within % GROUP).to(tl.int64)
    qb = blocks - 1 - within // GROUP
    b = bh // H
    # 64-bit arithmetic on the per-program bases only: the tiles' offsets stay 32-bit (a tensor of
    # 64-bit addresses per element costs twice the registers and spills).
    kn_at = k_n + bh * L * Dn
    v_at = v + bh * L * Dv
    kp_at = k_p + b * L * Dr
    tq = qb * BM + tl.arange(0, BM)
    start = tl.load(starts + b).to(tl.int32)
    dn = tl.arange(0, BDN)
    dr = tl.arange(0, BDR)
    dv = tl.arange(0, BDV)
    qm = tq < T
    qn = tl.load(q_n + bh * T * Dn + tq[:, None] * Dn + dn[None, :], mask=qm[:, None] & (dn < Dn)[None, :], other=0.0)
    qp = tl.load(q_p + bh * T * Dr + tq[:, None] * Dr + dr[None, :], mask=qm[:, None] & (dr < Dr)[None, :], other=0.0)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    scale2 = scale * 1.4426950408889634  # log2 e: the softmax runs in base 2
    for n0 in range(0, start, BN):
        pos = n0 + tl.arange(0, BN)
        ok = pos < start
        m, den, acc = _softmax_step(qn, qp, kn_at, kp_at, v_at, pos, ok, ok[None, :] & qm[:, None], dn, dr, dv, Dn, Dr,
                                    Dv, scale2, m, den, acc, IEEE, True)  # fmt: skip
    # Key tiles left of the query block's diagonal are visible to every query of the block (no
    # causal mask); only the tiles the diagonal crosses are masked.
    diagonal = qb * BM
    for n0 in range(0, diagonal, BN):
        i = n0 + tl.arange(0, BN)
        m, den, acc = _softmax_step(qn, qp, kn_at, kp_at, v_at, start + i, i < T, qm[:, None], dn, dr, dv, Dn, Dr, Dv,
                                    scale2, m, den, acc, IEEE, False)  # fmt: skip
    for n0 in range(diagonal, tl.minimum(T, diagonal + BM), BN):
        i = n0 + tl.arange(0, BN)
        ok = i < T
        seen = (i[None, :] <= tq[:, None]) & ok[None, :] & qm[:, None]
        m, den, acc = _softmax_step(qn, qp, kn_at, kp_at, v_at, start + i, ok, seen, dn, dr, dv, Dn, Dr, Dv, scale2,
                                    m, den, acc, IEEE, True)  # fmt: skip
    out = acc / tl.where(den > 0, den, 1.0)[:, None]  # every query sees itself: den > 0
    o_at = o + (b * T * H + bh % H) * Dv
    tl.store(o_at + (tq * H)[:, None] * Dv + dv[None, :], out.to(o.dtype.element_ty),
             mask=qm[:, None] & (dv < Dv)[None, :])  # fmt: skip


def decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int = 1,
    launch: DecodeLaunch | None = None,
) -> torch.Tensor:
    """Absorbed attention over the paged cache (the common MLA signature): ``o:[B, T, H, Dv]``
    in the operand dtype. ``num_splits`` splits each query's keys into that many ranges, merged
    by their fp32 log-sum-exp (split-KV); ``launch`` is the kernel's shape (how many heads one
    program carries over the cache tiles it reads, keys per tile, warps, stages), by default
    :func:`decode_launch` of the head count and the cache's storage."""
    _, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    reason = unavailable_reason(q_nope.dtype)
    if reason is not None:
        raise RuntimeError(reason)
    dev = device_for(q_nope, "the MLA kernels")
    op = q_nope.dtype
    q_lat = absorb_query(q_nope.to(dev, torch.float32), w_uk.to(dev, torch.float32)).to(op)
    o_lat = latent_attention(q_lat, q_pe.to(dev), cache, scale=scale, num_splits=num_splits, launch=launch)
    return absorb_output(o_lat.transpose(1, 2), w_uv.to(dev, torch.float32)).to(op)


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, *, scale: float,
                     num_splits: int = 1, launch: DecodeLaunch | None = None) -> torch.Tensor:  # fmt: skip
    """The kernel alone: ``q_lat:[B, T, H, R]``, ``q_pe:[B, T, H, Dr]`` (operand dtype) over the
    cache -> the latent output ``o_lat:[B, T, H, R]`` in fp32, splits merged. Arguments are
    taken as :func:`decode` checked them. A larger head block reads (and, for an fp8 cache,
    dequantises) each cache tile in fewer programs: at 96 heads, 6 programs of 16 share a tile."""
    require_block("num_splits", num_splits)
    B, T, H, R = q_lat.shape
    launch = decode_launch(H, cache.quantized) if launch is None else launch
    if not isinstance(launch, DecodeLaunch):
        raise TypeError(f"launch must be a DecodeLaunch, got {type(launch).__name__}")
    Dr = q_pe.shape[-1]
    dev = q_lat.device
    pool = cache.pool.to(dev).contiguous()
    BT = B * T
    o_part = torch.empty(num_splits, BT, H, R, dtype=torch.float32, device=dev)
    lse = torch.empty(num_splits, BT, H, dtype=torch.float32, device=dev)
    table = cache.block_table.to(dev).contiguous()
    scales = cache.scales.to(dev, torch.float32).contiguous() if cache.quantized else pool
    BR = block(R)
    chunks = 4 if BR >= 64 else 2 if BR >= 32 else 1  # a chunk is at least 16 wide (a tl.dot side)
    head_blocks = triton.cdiv(H, launch.heads)
    _decode_kernel[(BT * num_splits * head_blocks,)](
        q_lat.contiguous(), q_pe.contiguous(), pool, scales, table, cache.seq_lens.to(dev).contiguous(),
        o_part, lse, T, H, R, Dr, R + Dr, cache.page_size, table.shape[1], BT, float(scale), num_splits, head_blocks,
        BH=launch.heads, BC=BR // chunks, NC=chunks, BDR=block(Dr), BN=launch.keys, QUANT=cache.quantized,
        IEEE=q_lat.dtype == torch.float32, num_warps=launch.warps, num_stages=launch.stages,
    )  # fmt: skip
    weights = torch.softmax(lse, dim=0)  # e^{lse_s - LSE}; an empty split's -inf gets 0
    return (weights[..., None] * o_part).sum(0).reshape(B, T, H, R)


def prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: LatentCache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Expanded chunked prefill over the paged cache (the common MLA signature): ``o:[B, T, H,
    Dv]`` in the operand dtype; the queries' tokens must already be in the cache (as the layer
    writes them)."""
    _, scale = check_inputs(q_nope, q_pe, cache, w_uk, w_uv, scale)
    reason = unavailable_reason(q_nope.dtype)
    if reason is not None:
        raise RuntimeError(reason)
    q_n, q_p, k_n, k_p, v, starts = expanded_operands(q_nope, q_pe, cache, w_uk, w_uv,
                                                      device_for(q_nope, "the MLA kernels"))  # fmt: skip
    return prefill_attention(q_n, q_p, k_n, k_p, v, starts, scale=scale)


def prefill_attention(q_n: torch.Tensor, q_p: torch.Tensor, k_n: torch.Tensor, k_p: torch.Tensor, v: torch.Tensor,
                      starts: torch.Tensor, *, scale: float) -> torch.Tensor:  # fmt: skip
    """The prefill kernel alone on :func:`expanded_operands`' tensors: ``o:[B, T, H, Dv]`` in
    the operand dtype."""
    B, H, T, Dn = q_n.shape
    L, Dr, Dv = k_n.shape[2], q_p.shape[-1], v.shape[-1]
    o = torch.empty(B, T, H, Dv, dtype=q_n.dtype, device=q_n.device)
    bm, bn, stages = _prefill_tiles(q_n.dtype)
    if bm % bn:
        # A key tile across the diagonal would be read unmasked by the full-tile loop.
        raise ValueError(f"prefill query block {bm} is not a multiple of the key block {bn}")
    group = PREFILL_GROUP if (B * H) % PREFILL_GROUP == 0 else 1
    _prefill_kernel[(B * H * triton.cdiv(T, bm),)](
        q_n, q_p, k_n, k_p, v, o, starts, T, H, L, Dn, Dr, Dv, float(scale), BM=bm, BN=bn, BDN=block(Dn),
        BDR=block(Dr), BDV=block(Dv), GROUP=group,
        IEEE=q_n.dtype == torch.float32, num_warps=PREFILL_WARPS, num_stages=stages,
    )  # fmt: skip
    return o


def _prefill_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(query block, key block, stages)`` of the prefill launch for operands of ``dtype``:
    16 x 16 under the interpreter (where size is time), half-size tiles for fp32 on a GPU."""
    if interpreted():
        return 16, 16, PREFILL_STAGES
    if dtype == torch.float32:
        return PREFILL_FP32_QUERIES, PREFILL_FP32_KEYS, PREFILL_FP32_STAGES
    return PREFILL_QUERIES, PREFILL_KEYS, PREFILL_STAGES


def expanded_operands(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                      w_uv: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """What an expanded prefill kernel reads, on ``dev`` in the queries' dtype: ``q_n:[B, H, T,
    Dn]``, ``q_p:[B, H, T, Dr]``, ``k_n:[B, H, L, Dn]``, ``k_p:[B, L, Dr]`` (one per position,
    shared by the heads), ``v:[B, H, L, Dv]`` for every cached position (``L = max seq_lens``;
    dead slots and positions past a request's length are zeros, never the slot's contents), and
    ``starts:[B]`` int64, each request's number of earlier tokens. The up-projections are fp32
    products of the cached latents (an fp8 cache dequantised in fp32), then the queries' dtype."""
    op = q_nope.dtype
    moved = map_tensors(cache, lambda t: t.to(dev))
    entries, _ = gather(moved, torch.float32)
    k_n, v, k_p = up_project(entries, w_uk.to(dev, torch.float32), w_uv.to(dev, torch.float32))
    starts = moved.seq_lens.to(torch.int64) - q_nope.shape[1]
    return (heads_first(q_nope.to(dev)).contiguous(), heads_first(q_pe.to(dev)).contiguous(),
            k_n.to(op).contiguous(), k_p.to(op).contiguous(), v.to(op).contiguous(), starts.contiguous())  # fmt: skip

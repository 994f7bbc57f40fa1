"""Block AttnRes phase 1 in one launch on a Hopper GPU (Triton's Gluon dialect): an experiment.

    python benchmarks/attnres_one_launch.py --out DIR [--variants NAME ...]
    python benchmarks/attnres_one_launch.py --compile [--variants NAME ...]   # no GPU needed

Our phase 1 (:func:`k3verify.attnres.kernels.phase1`) is two launches that both read the stored
blocks (docs/gpu.md, "Block AttnRes on a GPU", says why every two-launch form stays near 76% of
the copy bandwidth at K3's shape). This script holds the one-launch form measured there: a
*team* of persistent programs shares each token pair's width, one program per width slab (16
slabs of 448 at d = 7168, one program an SM). Each keeps its slab of the three bf16 parts of
``w ⊙ γ`` in shared memory for the whole launch and runs three warp partitions over token pairs
(16 rows: the 8 stored blocks of two tokens):

- a loader warp: TMA copies of each pair's slab into a ring of ``ring`` slots;
- logits warps: the pair's partial logits (``mma``, queries × rows) and squares, posted to the
  team through global memory (a counter per team and buffer, release/acquire); then, ``look``
  pairs later, the wait for the team, the partials summed in fixed order, the softmax, and each
  token's weights split into three bf16 parts for the writer;
- the writer (default partition): the pair's ``N`` for its slab with ``mma``, stored from
  registers.

Team and slab come from a ticket taken when a program starts, so a waiting program's teammates
are running or next to start. Variants switch off the team wait (``exchange=False``: each
program uses its own partials, wrong values, timing only) and the logits products
(``math=False``) to show what each part costs. It prints our two-launch phase 1 and every
variant in the same process (do_bench medians; bytes moved once against the copy bandwidth) and
each variant's agreement with ours; ``--compile`` compiles the variants for sm_90 with the
installed Triton and prints registers and shared memory. Writes ``attnres_one_launch.json``,
``.md`` and ``_benchmark.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from functools import partial
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

try:
    from triton.experimental.gluon.language.nvidia.hopper import mma_v2
except ImportError:  # Triton releases that keep it with Ampere's operations
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from k3verify.attnres import kernels as ours
from k3verify.attnres.chunkwise import Stats

# Names that moved between Triton releases: a CTA-wide barrier (inside a partition, its warps
# only) and the TMA copy into shared memory.
_bar = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

QP = 32  # queries padded to the products' tile
BOX = 64  # columns of a TMA copy and of a product step
# name -> keyword arguments of phase1
VARIANTS: dict[str, dict[str, Any]] = {
    "ws": {},
    "ws_logit_warps8": dict(logit_warps=8, lregs=128),
    "ws_look2": dict(look=2, ring=5),
    "ws_writer_warps8": dict(warps=8),
    "no_wait": dict(exchange=False, look=0),
    "no_wait_no_logits": dict(exchange=False, look=0, math=False),
    "ws_part_acc": dict(part_acc=True),
    "split": dict(split=True),
    "split_part_acc": dict(split=True, part_acc=True),
}


@gluon.jit
def _loader(desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH: gl.constexpr, CH: gl.constexpr,
            RING: gl.constexpr):
    """Loader warp: TMA copies of pair k's slab (two tokens' 8 block rows) into ring slot k % RING
    once the writer has released it."""
    for k in range(nk):
        slot = k % RING
        mbarrier.wait(empty.index(slot), ((k // RING) & 1) ^ 1)
        mbarrier.expect(full.index(slot), 2 * NCH * desc.block_type.nbytes)
        t0 = 2 * (team + k * TEAMS)
        for c in range(NCH):
            tile = ring.index(slot * NCH + c)
            _tma_load(desc, [0, t0 * D + lo + c * CH], full.index(slot), tile.slice(0, 8))
            _tma_load(desc, [0, (t0 + 1) * D + lo + c * CH], full.index(slot), tile.slice(8, 8))


@gluon.jit
def _partials(ring, wsm, slot, NCH: gl.constexpr, CH: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr,
              PART_ACC: gl.constexpr):
    """One pair's partial logits ``[QP, 16]`` (queries × rows; mma with the three parts of
    ``w ⊙ γ``) and squares ``[16]`` over this slab, in the ``[QP, 16]`` blocked layout of ``LW``
    warps. ``PART_ACC``: one accumulator per part (three shorter chains of dependent mma)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, LW // 2], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    XB: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
    acc3 = gl.zeros([QP, R], gl.float32, MMA)
    acc2 = gl.zeros([QP, R], gl.float32, MMA)
    acc1 = gl.zeros([QP, R], gl.float32, MMA)
    ss2 = gl.zeros([R, CH], gl.float32, XB)
    for c in range(NCH):
        tile = ring.index(slot * NCH + c)
        xf = tile.load(XB).to(gl.float32)
        ss2 += xf * xf
        if MATH:
            xb = tile.permute([1, 0]).load(OPB)
            if PART_ACC:
                acc3 = mma_v2(wsm.index(2 * NCH + c).load(OPA), xb, acc3)
                acc2 = mma_v2(wsm.index(NCH + c).load(OPA), xb, acc2)
                acc1 = mma_v2(wsm.index(c).load(OPA), xb, acc1)
            else:
                acc1 = mma_v2(wsm.index(2 * NCH + c).load(OPA), xb, acc1)
                acc1 = mma_v2(wsm.index(NCH + c).load(OPA), xb, acc1)
                acc1 = mma_v2(wsm.index(c).load(OPA), xb, acc1)
    if PART_ACC:
        acc1 = acc1 + (acc2 + acc3)
    return gl.convert_layout(acc1, BL), gl.convert_layout(gl.sum(ss2, axis=1), gl.SliceLayout(0, BL))


@gluon.jit
def _post(pacc, pss, ctr, team, s, j, acc, ss, S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr):
    """Post pair ``j``'s partials of slab ``s`` to its team's buffer and count them (release)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    b = j % NBUF
    row = (team * NBUF + b) * S + s
    gl.store(pacc + (row * QP + aq[:, None]) * R + ar[None, :], acc)
    gl.store(pss + row * R + ar, ss)
    _bar()
    gl.atomic_add(ctr + team * NBUF + b, 1, sem="release")


@gluon.jit
def _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
             S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, EXCHANGE: gl.constexpr):
    """Pair ``kk``: wait for its team (or, without ``EXCHANGE``, take ``acc, ss`` as the whole),
    sum the partials in slab order, softmax over each token's blocks (m, Z written by slab 0),
    and hand each token's weights in three bf16 parts to the writer."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    if EXCHANGE:
        b = kk % NBUF
        cptr = ctr + team * NBUF + b
        target = S * (kk // NBUF + 1)
        cur = gl.atomic_add(cptr, 0, sem="acquire")
        while cur < target:
            cur = gl.atomic_add(cptr, 0, sem="acquire")
        _bar()
        tot = gl.zeros([QP, R], gl.float32, BL)
        sst = gl.zeros([R], gl.float64, gl.SliceLayout(0, BL))
        base = (team * NBUF + b) * S
        for mm in gl.static_range(S):
            tot += gl.load(pacc + ((base + mm) * QP + aq[:, None]) * R + ar[None, :], cache_modifier=".cg")
            sst += gl.load(pss + (base + mm) * R + ar, cache_modifier=".cg").to(gl.float64)
    else:
        tot = acc
        sst = ss.to(gl.float64) * S
    L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
    ok = ((ar % 8) < n)[None, :] & (aq >= 0)[:, None]
    first = (ar < 8)[None, :] & (aq >= 0)[:, None]
    L = gl.where(ok, L, float("-inf"))
    m0 = gl.max(gl.where(first, L, float("-inf")), axis=1)
    m1 = gl.max(gl.where(first, float("-inf"), L), axis=1)
    P = gl.exp(L - gl.where(first, m0[:, None], m1[:, None]))
    z0 = gl.sum(gl.where(first, P, 0.0), axis=1)
    z1 = gl.sum(gl.where(first, 0.0, P), axis=1)
    t0 = 2 * (team + kk * TEAMS)
    if s == 0:
        gl.store(m_out + aq * T + t0, m0, mask=aq < Q)
        gl.store(z_out + aq * T + t0, z0, mask=aq < Q)
        gl.store(m_out + aq * T + t0 + 1, m1, mask=aq < Q)
        gl.store(z_out + aq * T + t0 + 1, z1, mask=aq < Q)
    pb = kk % 2
    mbarrier.wait(pfree.index(pb), ((kk // 2) & 1) ^ 1)
    for u in gl.static_range(2):
        if u == 0:
            Pu = gl.where(first, P, 0.0)
        else:
            Pu = gl.where(first, 0.0, P)
        p1 = Pu.to(gl.bfloat16)
        rest = Pu - p1.to(gl.float32)
        p2 = rest.to(gl.bfloat16)
        p3 = (rest - p2.to(gl.float32)).to(gl.bfloat16)
        psm.index(pb * 6 + 3 * u).store(p1)
        psm.index(pb * 6 + 3 * u + 1).store(p2)
        psm.index(pb * 6 + 3 * u + 2).store(p3)
    _bar()
    mbarrier.arrive(pready.index(pb))


@gluon.jit
def _logits(ring, wsm, psm, full, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps,
            TEAMS, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr,
            LOOK: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr, EXCHANGE: gl.constexpr,
            PART_ACC: gl.constexpr):
    """Logits warps doing both roles: pair j's partials posted, then pair j - LOOK's weights."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    for j in range(nk + LOOK):
        acc = gl.zeros([QP, R], gl.float32, BL)
        ss = gl.zeros([R], gl.float32, gl.SliceLayout(0, BL))
        if j < nk:
            slot = j % RING
            mbarrier.wait(full.index(slot), (j // RING) & 1)
            acc, ss = _partials(ring, wsm, slot, NCH, CH, LW, MATH, PART_ACC)
            if EXCHANGE:
                _post(pacc, pss, ctr, team, s, j, acc, ss, S, NBUF, LW)
        kk = j - LOOK
        if kk >= 0:
            _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
                     S, NBUF, LW, EXCHANGE)


@gluon.jit
def _poster(ring, wsm, full, pacc, pss, ctr, team, s, nk, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr,
            RING: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr, PART_ACC: gl.constexpr):
    """Partials warps (``split`` variants): every pair's partials posted as soon as its slab lands."""
    for j in range(nk):
        slot = j % RING
        mbarrier.wait(full.index(slot), (j // RING) & 1)
        acc, ss = _partials(ring, wsm, slot, NCH, CH, LW, MATH, PART_ACC)
        _post(pacc, pss, ctr, team, s, j, acc, ss, S, NBUF, LW)


@gluon.jit
def _weigher(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps, TEAMS,
             S: gl.constexpr, NBUF: gl.constexpr, XW: gl.constexpr):
    """Weights warps (``split`` variants): each pair's team wait, softmax and weights in turn."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [XW, 1], [1, 0])
    acc = gl.zeros([QP, R], gl.float32, BL)
    ss = gl.zeros([R], gl.float32, gl.SliceLayout(0, BL))
    for kk in range(nk):
        _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
                 S, NBUF, XW, True)


@gluon.jit
def _writer(ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH: gl.constexpr,
            CH: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr):
    """Writer warps: ``N`` of each pair's two tokens for this slab, ``[QP, CH]`` products per step."""
    QP: gl.constexpr = 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, NW // 2], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    oq = gl.arange(0, QP, layout=gl.SliceLayout(1, MMA))
    oc = gl.arange(0, CH, layout=gl.SliceLayout(0, MMA))
    for k in range(nk):
        pb = k % 2
        mbarrier.wait(pready.index(pb), (k // 2) & 1)
        a01 = psm.index(pb * 6).load(OPA)
        a02 = psm.index(pb * 6 + 1).load(OPA)
        a03 = psm.index(pb * 6 + 2).load(OPA)
        a11 = psm.index(pb * 6 + 3).load(OPA)
        a12 = psm.index(pb * 6 + 4).load(OPA)
        a13 = psm.index(pb * 6 + 5).load(OPA)
        _bar()
        mbarrier.arrive(pfree.index(pb))
        slot = k % RING
        mbarrier.wait(full.index(slot), (k // RING) & 1)
        t0 = 2 * (team + k * TEAMS)
        out0 = n_out + (oq[:, None].to(gl.int64) * T + t0) * D + lo + oc[None, :]
        for c in range(NCH):
            xb = ring.index(slot * NCH + c).load(OPB)
            z = gl.zeros([QP, CH], gl.float32, MMA)
            o = mma_v2(a03, xb, z)
            o = mma_v2(a02, xb, o)
            o = mma_v2(a01, xb, o)
            gl.store(out0 + c * CH, o, mask=(oq < Q)[:, None])
            o = mma_v2(a13, xb, z)
            o = mma_v2(a12, xb, o)
            o = mma_v2(a11, xb, o)
            gl.store(out0 + D + c * CH, o, mask=(oq < Q)[:, None])
        _bar()
        mbarrier.arrive(empty.index(slot))


@gluon.jit
def _ws_kernel(desc, g3_ptr, m_out, z_out, n_out, pacc, pss, tickets, ctr, T, D, n, Q, eps, TEAMS,
               S: gl.constexpr, W: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr,
               NW: gl.constexpr, LW: gl.constexpr, LOOK: gl.constexpr, EXCHANGE: gl.constexpr, MATH: gl.constexpr,
               LREGS: gl.constexpr, PART_ACC: gl.constexpr, SPLIT: gl.constexpr, XW: gl.constexpr,
               XREGS: gl.constexpr):
    """One program per (team, slab): its slab of ``w ⊙ γ`` into shared memory, then the three
    partitions."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    NCH: gl.constexpr = W // CH
    WLD: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    SX: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SP: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    tk = gl.atomic_add(tickets, 1)
    team = tk // S
    s = tk % S
    lo = s * W
    pairs = T // 2
    nk = (pairs - team + TEAMS - 1) // TEAMS

    ring = gl.allocate_shared_memory(gl.bfloat16, [RING * NCH, R, CH], SX)
    wsm = gl.allocate_shared_memory(gl.bfloat16, [3 * NCH, QP, CH], SX)
    psm = gl.allocate_shared_memory(gl.bfloat16, [12, QP, R], SP)
    full = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(pready.index(i), count=1)
        mbarrier.init(pfree.index(i), count=1)

    wq = gl.arange(0, QP, layout=gl.SliceLayout(1, WLD))
    wc = gl.arange(0, CH, layout=gl.SliceLayout(0, WLD))
    for j in gl.static_range(3):
        for c in range(NCH):
            wsm.index(j * NCH + c).store(gl.load(g3_ptr + (j * QP + wq[:, None]) * D + lo + c * CH + wc[None, :]))
    _bar()

    if SPLIT:
        gl.warp_specialize([
            (_writer, (ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH, CH, RING, NW)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nk, S, NCH, CH, RING, NBUF, LW, MATH, PART_ACC)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW)),
        ], [1, LW, XW], [24, LREGS, XREGS])
    else:
        gl.warp_specialize([
            (_writer, (ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH, CH, RING, NW)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_logits, (ring, wsm, psm, full, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q,
                       eps, TEAMS, S, NCH, CH, RING, NBUF, LOOK, LW, MATH, EXCHANGE, PART_ACC)),
        ], [1, LW], [24, LREGS])


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _descriptor(stored: torch.Tensor) -> TensorDescriptor:
    """TMA descriptor of ``stored:[n, T, d]`` viewed as ``[n, T·d]``: one box is a token's 8
    block rows × 64 columns (rows past ``n`` read as zero)."""
    n, T, d = stored.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(stored.view(n, T * d), [n, T * d], [T * d, 1], [8, BOX], layout)


def phase1(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = ours.RMS_NORM_EPS,
           slabs: int = 16, ring: int = 4, warps: int = 4, logit_warps: int = 4, look: int = 1,
           exchange: bool = True, math: bool = True, teams: int | None = None, lregs: int = 152,
           part_acc: bool = False, split: bool = False, weigh_warps: int = 4, xregs: int = 128) -> Stats:
    """Phase-1 statistics of ``w, gamma:[Q, d]`` (Q <= 32) over ``stored:[n, T, d]`` (bf16,
    n <= 8, T even, d a multiple of 64 per slab) in one launch: ``m, Z:[Q, T]``, ``N:[Q, T, d]``.
    ``split``: the partials and the weights in two partitions (``weigh_warps`` warps for the
    latter), so that the partials never wait for the team."""
    n, T, d = stored.shape
    Q = w.shape[0]
    dev = stored.device
    W = d // slabs
    if (d % slabs or W % BOX or n > 8 or Q > QP or T % 2 or ring < look + 2 or not (exchange or look == 0)
            or (split and not exchange)):
        raise ValueError(f"unsupported shape or variant: stored {list(stored.shape)}, {Q} queries, slabs={slabs}, "
                         f"ring={ring}, look={look}, exchange={exchange}, split={split}")
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty(Q, T, dtype=torch.float32, device=dev)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    g3 = ours._split_bf16(ours._queries(w, gamma, d, dev, QP).T.contiguous()).contiguous()  # [3, QP, d]
    if teams is None:
        teams = max(1, min(T // 2, torch.cuda.get_device_properties(dev).multi_processor_count // slabs))
    nbuf = _buffers(ring, look, split)
    key = (teams, slabs, nbuf, dev)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(teams * nbuf * slabs * QP * 16, dtype=torch.float32, device=dev),
                         torch.empty(teams * nbuf * slabs * 16, dtype=torch.float32, device=dev))  # fmt: skip
    pacc, pss = _SCRATCH[key]
    counters = torch.zeros(teams * nbuf + 1, dtype=torch.int32, device=dev)
    constexprs = _constexprs(d, slabs=slabs, ring=ring, warps=warps, logit_warps=logit_warps, look=look,
                             exchange=exchange, math=math, lregs=lregs, part_acc=part_acc, split=split,
                             weigh_warps=weigh_warps, xregs=xregs)  # fmt: skip
    _ws_kernel[(teams * slabs,)](
        _descriptor(stored), g3, m, Z, N, pacc, pss, counters[teams * nbuf:], counters, T, d, n, Q, float(eps), teams,
        **constexprs, num_warps=warps,
    )  # fmt: skip
    return Stats(m, Z, N)


def _buffers(ring: int, look: int, split: bool) -> int:
    """Partials buffers per team: a program posts pair j while a teammate may still read pair
    j - look - 1 (one role), or, with split roles, pair j - 2 ring (its weights lag its ring)."""
    return 2 * ring + 2 if split else 2 * look + 2


def _constexprs(d: int, *, slabs: int, ring: int, warps: int, logit_warps: int, look: int, exchange: bool,
                math: bool, lregs: int, part_acc: bool, split: bool, weigh_warps: int, xregs: int) -> dict[str, Any]:
    """The kernel's constexprs for :func:`phase1`'s launch options at width ``d``."""
    return dict(S=slabs, W=d // slabs, CH=BOX, RING=ring, NBUF=_buffers(ring, look, split), NW=warps, LW=logit_warps,
                LOOK=look, EXCHANGE=exchange, MATH=math, LREGS=lregs, PART_ACC=part_acc, SPLIT=split, XW=weigh_warps,
                XREGS=xregs)  # fmt: skip


def _options(kw: dict[str, Any]) -> dict[str, Any]:
    """A variant's launch options over :func:`phase1`'s defaults (``teams`` and ``eps`` left out)."""
    defaults = {name: p.default for name, p in inspect.signature(phase1).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("eps", "teams")}  # fmt: skip
    return defaults | kw


def compile_usage(kw: dict[str, Any], arch: int = 90) -> str:
    """Registers and shared memory of a variant compiled for ``sm_<arch>`` (no GPU needed)."""
    from kernel_compile import resource_usage
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(torch.empty(8, 64, dtype=torch.bfloat16), [8, 64], [64, 1], [8, BOX], layout)
    desc_type = triton.runtime.jit.mangle_type(desc)
    ints = dict.fromkeys(("T", "D", "n", "Q", "TEAMS"), "i32")
    types = dict(desc=desc_type, g3_ptr="*bf16", tickets="*i32", ctr="*i32", eps="fp32", **ints)
    fn = _ws_kernel
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "*fp32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name].startswith("*") or p.name in ("T", "D")}  # fmt: skip
    options = _options(kw)
    source = GluonASTSource(fn=fn, signature=sig, constexprs=_constexprs(7168, **options), attrs=attrs)
    compiled = triton.compile(source,
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=options["warps"]))  # fmt: skip
    regs, stack = resource_usage(compiled.asm["cubin"])
    return f"{regs} registers (largest partition), {stack} B stack (spills), {compiled.metadata.shared} B shared"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="reports/latest/bench", help="output folder")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 and print resources; no GPU")
    args = parser.parse_args(argv)
    if args.compile:
        print(f"Triton {triton.__version__}, sm_90, T = 8192, d = 7168")
        for name in args.variants:
            print(f"{name:20s} {compile_usage(VARIANTS[name])}", flush=True)
        return 0
    import attnres_gpu
    import gpu_timing
    from gpu_timing import copy_bandwidth, ms, write_results

    from k3verify.harness.environment import environment

    begun = gpu_timing.start(args.out, "the one-launch AttnRes experiment")
    if begun is None:
        return 2
    out, log = begun
    copy_tbps = copy_bandwidth()
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    T, d = 8192, 7168
    x = attnres_gpu._block_inputs(T, d)
    moved = attnres_gpu.STORED * T * d * 2 + attnres_gpu.QUERIES * T * d * 4
    ref = ours.phase1(x["stored"], x["w"], x["gamma"])
    rows = []
    runs = {"ours (two launches)": partial(ours.phase1, x["stored"], x["w"], x["gamma"])}
    runs |= {name: partial(phase1, x["stored"], x["w"], x["gamma"], **VARIANTS[name]) for name in args.variants}
    for name, run in runs.items():
        try:
            got = run()
        except Exception as exc:  # a variant that does not compile or run is a result; go on
            rows.append(dict(variant=name, options=VARIANTS.get(name, {}), error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{name}: {rows[-1]['error']}")
            continue
        agree = dict(m=(got.m - ref.m).abs().max().item(), Z=((got.Z - ref.Z).abs() / ref.Z).max().item(),
                     N=((got.N - ref.N).abs().max() / ref.N.abs().max()).item())  # fmt: skip
        t = ms(run, "attnres one launch", name, T=T, d=d)
        frac = moved / (t * 1e-3) / 1e12 / copy_tbps
        rows.append(dict(variant=name, options=VARIANTS.get(name, {}), ms=t, fraction_of_copy=frac, agreement=agree))
        log(f"{name}: {t:.4f} ms, {100 * frac:.1f}% of copy; max |dm| {agree['m']:.1e}, dZ {agree['Z']:.1e}, "
            f"dN {agree['N']:.1e}")
    lines = ["# Block AttnRes phase 1 in one launch (experiment)", "",
             f"T = {T}, d = {d}, 24 queries over 8 stored blocks, bf16; copy {copy_tbps:.2f} TB/s; do_bench medians.",
             "", "| variant | options | ms | of copy | max abs dm | max rel dZ | max rel dN |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['options']} | {r['error']} | | | | |")
            continue
        a = r["agreement"]
        lines.append(f"| {r['variant']} | {r['options']} | {r['ms']:.4f} | {100 * r['fraction_of_copy']:.1f}% | "
                     f"{a['m']:.1e} | {a['Z']:.1e} | {a['N']:.1e} |")
    result = dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, rows=rows, environment=environment())
    write_results(out, "attnres_one_launch", result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

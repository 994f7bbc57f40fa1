"""Block AttnRes phase 1 in one launch on a Hopper GPU (Triton's Gluon dialect): an experiment.

    python benchmarks/attnres_one_launch.py --out DIR [--variants VARIANT ...]
    python benchmarks/attnres_one_launch.py --compile [--variants VARIANT ...]   # no GPU needed

A VARIANT is a name in ``VARIANTS``, optionally followed by ``key=value`` overrides of
:func:`phase1`'s options, joined by commas (``split_vector,chains=3``, ``split,store=vector``).

Our phase 1 (:func:`k3verify.attnres.kernels.phase1`) is two launches that both read the stored
blocks (docs/gpu.md, "Block AttnRes on a GPU", says why every two-launch form stays near 76% of
the copy bandwidth at K3's shape). This script holds the one-launch form measured there: a
*team* of persistent programs shares each token pair's width, one program per width slab (16
slabs of 448 at d = 7168, one program an SM). Each keeps its slab of the three bf16 parts of
``w ⊙ γ`` in shared memory for the whole launch and runs warp partitions over token pairs (16
rows: the 8 stored blocks of two tokens):

- a loader warp: TMA copies of each pair's slab into a ring of ``ring`` slots;
- logits warps: the pair's partial logits (``mma``, queries × rows) and squares, posted to the
  team through global memory (a counter per team and buffer, release/acquire); then, ``look``
  pairs later, the wait for the team, the partials summed in fixed order, the softmax, and each
  token's weights split into three bf16 parts for the writer. With ``split`` the two roles are
  partitions of their own (partials warps and weights warps; ``lanes=2``: two of each, taking
  alternate pairs);
- the writer (default partition): the pair's ``N`` for its slab with ``mma``, stored from the
  mma layout's registers, through a layout of 16-byte vectors (``store="vector"``) or by TMA.

Team and slab come from a ticket taken when a program starts, so a waiting program's teammates
are running or next to start. Timing-only variants (wrong values) switch parts off to show what
each costs: the team wait (``exchange=False``), the gather of the team's partials
(``gather=False``), the coupling between the team (``own``), the logits products
(``math=False``) and the logits partitions altogether (``logits=False``). It prints our
two-launch phase 1 and every variant in the same process (do_bench medians; bytes moved once
against the copy bandwidth) and each variant's agreement with ours; ``--compile`` compiles the
variants for sm_90 with the installed Triton and prints registers and shared memory. Writes
``attnres_one_launch.json``, ``.md`` and ``_benchmark.json`` under ``--out``.
"""

from __future__ import annotations

import inspect
import sys
from functools import partial
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

try:
    from triton.experimental.gluon.language.nvidia.hopper import mma_v2
except ImportError:  # Triton releases that keep it with Ampere's operations
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from k3verify.attnres import kernels as ours
from k3verify.attnres.chunkwise import Stats

# Names that moved between Triton releases: a CTA-wide barrier (inside a partition, its warps
# only) and the TMA copies into and out of shared memory.
_bar = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

QP = 32  # queries padded to the products' tile
# name -> keyword arguments of phase1
VARIANTS: dict[str, dict[str, Any]] = {
    # one logits partition doing both roles, N stored from the mma layout
    "ws": {},
    "ws_chains6": dict(chains=6),
    "no_wait": dict(exchange=False, look=0),
    "no_wait_no_logits": dict(exchange=False, look=0, math=False),
    # the writer and the loader alone: the data movement's own pace
    "writer_only": dict(exchange=False, look=0, math=False, logits=False),
    "writer_only_vector": dict(exchange=False, look=0, math=False, logits=False, store="vector"),
    "writer_only_packed": dict(exchange=False, look=0, math=False, logits=False, store="vector", pack=True),
    "writer_only_turned8": dict(exchange=False, look=0, math=False, logits=False, store="vector", pack=True, qonly=True,
                                turn=True, slabs=8, ring=2),
    "writer_only_tma": dict(exchange=False, look=0, math=False, logits=False, box=32, store="tma"),
    # partials and weights in partitions of their own, N in 16-byte vectors
    "split": dict(split=True),
    "split_vector": dict(split=True, store="vector"),
    "split_vector_chains3": dict(split=True, store="vector", chains=3),
    "split_vector_wreg": dict(split=True, store="vector", wreg=True, lregs=240, xregs=96),
    "split_vector_rounds2": dict(split=True, store="vector", rounds=2),
    "split_vector_no_gather": dict(split=True, store="vector", gather=False),
    "split_vector_no_gather_no_math": dict(split=True, store="vector", gather=False, math=False),
    "split_vector_defer": dict(split=True, store="vector", defer=True),
    "split_vector_lanes2": dict(split=True, store="vector", lanes=2, logit_warps=2, weigh_warps=2, lregs=200,
                                xregs=160),
    # the gather in 16-byte loads (32 load instructions a pair and thread instead of 80)
    "split_vector_vgather": dict(split=True, store="vector", vgather=True),
    "split_vector_chains3_vgather": dict(split=True, store="vector", chains=3, vgather=True),
    # the writer's products over 48 rows, not 64; only the real queries' partials read
    "split_vector_chains3_pack": dict(split=True, store="vector", chains=3, qonly=True, pack=True),
    "pack14": dict(split=True, store="vector", chains=3, qonly=True, pack=True, slabs=14),  # 9 teams of 14 slabs of 512
    # 8 slabs of 896 (16 teams): a quarter of the team's gather traffic, one partials warp
    "turned8": dict(split=True, store="vector", qonly=True, pack=True, turn=True, logit_warps=1, slabs=8, ring=2,
                    look=0, lregs=168),
}
STORES = ("mma", "vector", "tma")  # the writer's ways of storing N (phase1's ``store``)


@gluon.jit
def _loader(desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH: gl.constexpr, CH: gl.constexpr,
            RING: gl.constexpr):
    """Loader warp: TMA copies of pair k's slab (two tokens' 8 block rows) into ring slot k % RING
    once the writer has released it."""
    for k in range(nk):
        _load_pair(desc, ring, full, empty, k, team, lo, TEAMS, D, NCH, CH, RING)


@gluon.jit
def _load_pair(desc, ring, full, empty, k, team, lo, TEAMS, D, NCH: gl.constexpr, CH: gl.constexpr,
               RING: gl.constexpr):
    """Pair k's slab into slot k % RING of ``ring`` by TMA, once its reader has released the slot."""
    slot = k % RING
    mbarrier.wait(empty.index(slot), ((k // RING) & 1) ^ 1)
    mbarrier.expect(full.index(slot), 2 * NCH * desc.block_type.nbytes)
    t0 = 2 * (team + k * TEAMS)
    for c in range(NCH):
        tile = ring.index(slot * NCH + c)
        _tma_load(desc, [0, t0 * D + lo + c * CH], full.index(slot), tile.slice(0, 8))
        _tma_load(desc, [0, (t0 + 1) * D + lo + c * CH], full.index(slot), tile.slice(8, 8))


@gluon.jit
def _loader_early(desc, ring, full, empty, pring, pfull, pempty, team, lo, nk, TEAMS, D, NCH: gl.constexpr,
                  CH: gl.constexpr, RING: gl.constexpr, PRING: gl.constexpr, EARLY: gl.constexpr):
    """Loader warp with ``early``: each pair's slab twice, ``EARLY`` pairs ahead into the partials
    warps' own ring ``pring`` (the read from memory) and then into the writer's ring (mostly from
    L2), so the team's partials are posted well before the writer needs the weights."""
    for k in range(gl.minimum(nk, EARLY)):
        _load_pair(desc, pring, pfull, pempty, k, team, lo, TEAMS, D, NCH, CH, PRING)
    for k in range(nk):
        if k + EARLY < nk:
            _load_pair(desc, pring, pfull, pempty, k + EARLY, team, lo, TEAMS, D, NCH, CH, PRING)
        _load_pair(desc, ring, full, empty, k, team, lo, TEAMS, D, NCH, CH, RING)


@gluon.jit
def _add_squares(ss2, tile):
    """``ss2 + x²`` elementwise for a ring tile ``x:[16, CH]`` (bf16) read in ``ss2``'s layout
    (fp32, exact: a bf16 square fits fp32's significand)."""
    xf = tile.load(ss2.type.layout).to(gl.float32)
    return ss2 + xf * xf


@gluon.jit
def _partials(ring, wsm, slot, NCH: gl.constexpr, CH: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr,
              CHAINS: gl.constexpr):
    """One pair's partial logits ``[QP, 16]`` (queries × rows; mma with the three parts of
    ``w ⊙ γ``) and squares ``[16]`` over this slab, in the ``[QP, 16]`` blocked layout of ``LW``
    warps. ``CHAINS`` independent accumulators (1: one chain of dependent mma; 3: one a part; 6:
    one a part and chunk parity), because one chain leaves the tensor cores waiting on latency."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, LW // 2], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    XB: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
    a1 = gl.zeros([QP, R], gl.float32, MMA)
    a2 = gl.zeros([QP, R], gl.float32, MMA)
    a3 = gl.zeros([QP, R], gl.float32, MMA)
    b1 = gl.zeros([QP, R], gl.float32, MMA)
    b2 = gl.zeros([QP, R], gl.float32, MMA)
    b3 = gl.zeros([QP, R], gl.float32, MMA)
    ss2 = gl.zeros([R, CH], gl.float32, XB)
    for c in gl.static_range(NCH):
        tile = ring.index(slot * NCH + c)
        ss2 = _add_squares(ss2, tile)
        if MATH:
            xb = tile.permute([1, 0]).load(OPB)
            w3 = wsm.index(2 * NCH + c).load(OPA)
            w2 = wsm.index(NCH + c).load(OPA)
            w1 = wsm.index(c).load(OPA)
            if CHAINS == 1:
                a1 = mma_v2(w3, xb, a1)
                a1 = mma_v2(w2, xb, a1)
                a1 = mma_v2(w1, xb, a1)
            elif CHAINS == 3 or c % 2 == 0:
                a3 = mma_v2(w3, xb, a3)
                a2 = mma_v2(w2, xb, a2)
                a1 = mma_v2(w1, xb, a1)
            else:
                b3 = mma_v2(w3, xb, b3)
                b2 = mma_v2(w2, xb, b2)
                b1 = mma_v2(w1, xb, b1)
    acc = (a1 + (a2 + a3)) + (b1 + (b2 + b3))
    return gl.convert_layout(acc, BL), gl.convert_layout(gl.sum(ss2, axis=1), gl.SliceLayout(0, BL))


@gluon.jit
def _post(pacc, pss, ctr, team, s, j, acc, ss, S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr,
          OWN: gl.constexpr):
    """Post pair ``j``'s partials of slab ``s`` to its team's buffer and count them (release; with
    ``OWN``, on a counter of this program's own)."""
    _post_store(pacc, pss, team, s, j, acc, ss, S, NBUF, LW)
    _post_count(ctr, team, s, j, S, NBUF, OWN)


@gluon.jit
def _post_store(pacc, pss, team, s, j, acc, ss, S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr):
    """Store pair ``j``'s partials of slab ``s`` in its team's buffer (not yet counted)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    row = (team * NBUF + j % NBUF) * S + s
    gl.store(pacc + (row * QP + aq[:, None]) * R + ar[None, :], acc)
    gl.store(pss + row * R + ar, ss)


@gluon.jit
def _post_count(ctr, team, s, j, S: gl.constexpr, NBUF: gl.constexpr, OWN: gl.constexpr):
    """Count pair ``j``'s stored partials on the team's counter (release: the partition's stores
    before it are seen by whoever acquires the count)."""
    _bar()
    group = team * S + s if OWN else team
    gl.atomic_add(ctr + group * NBUF + j % NBUF, 1, sem="release")


@gluon.jit
def _wait(cptr, target, RELAXED: gl.constexpr):
    """Spin until the counter at ``cptr`` reaches ``target`` (acquire), then sync the partition.
    ``RELAXED``: spin on relaxed reads (an acquire at GPU scope also invalidates the SM's L1 each
    time), then acquire once."""
    if RELAXED:
        cur = gl.atomic_add(cptr, 0, sem="relaxed")
        while cur < target:
            cur = gl.atomic_add(cptr, 0, sem="relaxed")
        gl.atomic_max(cptr, 0, sem="acquire")  # an RMW: an acquire load left unused is dropped
    else:
        cur = gl.atomic_add(cptr, 0, sem="acquire")
        while cur < target:
            cur = gl.atomic_add(cptr, 0, sem="acquire")
    _bar()


@gluon.jit
def _gather(pacc, pss, base, q, r, rs, S: gl.constexpr, LQR: gl.constexpr, LS: gl.constexpr, QG: gl.constexpr = 32,
            STEP: gl.constexpr = 1):
    """The team's posted partials at buffer rows ``base .. base + S`` (one a slab), summed in slab
    order: logits of queries ``q`` and rows ``r`` (fp32, layout ``LQR``, whose slices ``q`` and
    ``r`` are in) and squares of rows ``rs`` (fp64, layout ``LS``, ``rs``'s). Queries from ``QG``
    on are not read (their partials are zero: padded queries). ``STEP`` 2 (``presum``): only the
    odd rows, each the sum of two slabs."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    tot = gl.zeros([q.shape[0], R], gl.float32, LQR)
    sst = gl.zeros([R], gl.float64, LS)
    for i in gl.static_range(S // STEP):
        mm = STEP * i + STEP - 1  # a constant: with STEP 1 the code is the plain slab loop's
        if QG < QP:
            tot += gl.load(pacc + ((base + mm) * QP + q[:, None]) * R + r[None, :],
                           mask=(q < QG)[:, None] & (r >= 0)[None, :], other=0.0, cache_modifier=".cg")
        else:
            tot += gl.load(pacc + ((base + mm) * QP + q[:, None]) * R + r[None, :], cache_modifier=".cg")
        sst += gl.load(pss + (base + mm) * R + rs, cache_modifier=".cg").to(gl.float64)
    return tot, sst


@gluon.jit
def _softmax(L, q, r, n, m_out, z_out, t0, T, Q, STORE_MZ):
    """Weights ``[rows q, 16]`` of logits ``L`` (the pair's two tokens' 8 blocks side by side;
    blocks past ``n`` get none); with ``STORE_MZ`` each token's ``m, Z`` for queries ``q``."""
    ok = ((r % 8) < n)[None, :] & (q >= 0)[:, None]
    first = (r < 8)[None, :] & (q >= 0)[:, None]
    L = gl.where(ok, L, float("-inf"))
    m0 = gl.max(gl.where(first, L, float("-inf")), axis=1)
    m1 = gl.max(gl.where(first, float("-inf"), L), axis=1)
    P = gl.exp(L - gl.where(first, m0[:, None], m1[:, None]))
    if STORE_MZ:
        gl.store(m_out + q * T + t0, m0, mask=q < Q)
        gl.store(z_out + q * T + t0, gl.sum(gl.where(first, P, 0.0), axis=1), mask=q < Q)
        gl.store(m_out + q * T + t0 + 1, m1, mask=q < Q)
        gl.store(z_out + q * T + t0 + 1, gl.sum(gl.where(first, 0.0, P), axis=1), mask=q < Q)
    return P


@gluon.jit
def _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
             S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, EXCHANGE: gl.constexpr,
             RELAXED: gl.constexpr, OWN: gl.constexpr, GS: gl.constexpr, QG: gl.constexpr,
             PACK: gl.constexpr = False, PRESUM: gl.constexpr = False):
    """Pair ``kk``: wait for its team, sum the partials in slab order, softmax over each token's
    blocks (m, Z written by slab 0), and hand each token's weights in three bf16 parts to the
    writer (through ``psm``'s buffers, six tiles each). ``EXCHANGE`` 0: no wait, ``acc, ss``
    taken as the whole; 1: the wait only, then as 0 (timing only); 2: all of it; 3: in two
    rounds (:func:`_two_rounds`); 4: as 2, the partials read in 16-byte pieces; 5: as 4, the
    softmax in the layout of the reads (no change of layout; with ``PACK``). ``OWN``: the
    wait is for this program's own post only (no team coupling; wrong values, timing only). ``GS``:
    slabs whose partials are read (below ``S``: wrong values, timing only); ``QG``: queries read
    (the real ones suffice: the padded ones' partials are zero). ``PACK``: the weights packed for
    the writer by :func:`_pack_weights`. ``PRESUM``: the team's posts are sums of two slabs
    (:func:`_presum`)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    if EXCHANGE == 5:
        BL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LW, 1], [1, 0])
    else:
        BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    t0 = 2 * (team + kk * TEAMS)
    b = kk % NBUF
    if EXCHANGE == 3:
        P = _two_rounds(pacc, pss, ctr, m_out, z_out, team, s, b, kk, T, D, n, Q, eps, TEAMS, S, NBUF, LW, RELAXED,
                        QG)
    else:
        if EXCHANGE:
            group = team * S + s if OWN else team
            _wait(ctr + group * NBUF + b, (1 if OWN else S // (1 + PRESUM)) * (kk // NBUF + 1), RELAXED)
        if EXCHANGE == 2 or EXCHANGE == 5:
            tot, sst = _gather(pacc, pss, (team * NBUF + b) * S, aq, ar, ar, GS, BL, gl.SliceLayout(0, BL), QG,
                               1 + PRESUM)
        elif EXCHANGE == 4:
            # The same sums in the same order, each thread reading 16-byte pieces (a quarter of
            # the load instructions), then one change of layout.
            GL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LW, 1], [1, 0])
            gq = gl.arange(0, QP, layout=gl.SliceLayout(1, GL))
            gr = gl.arange(0, R, layout=gl.SliceLayout(0, GL))
            tot, sst = _gather(pacc, pss, (team * NBUF + b) * S, gq, gr, ar, GS, GL, gl.SliceLayout(0, BL), QG)
            tot = gl.convert_layout(tot, BL)
        else:
            tot = acc
            sst = ss.to(gl.float64) * S
        L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
        P = _softmax(L, aq, ar, n, m_out, z_out, t0, T, Q, s == 0)
    _deliver(psm, pready, pfree, P, aq, ar, kk, LW, PACK)


@gluon.jit
def _deliver(psm, pready, pfree, P, aq, ar, kk, LW: gl.constexpr, PACK: gl.constexpr):
    """Pair ``kk``'s weights ``P`` (queries ``aq`` × rows ``ar``) into the writer's buffer ``kk % PB``
    once the writer has released it, in three bf16 parts (``PACK``: as :func:`_pack_weights`), and
    the buffer marked ready."""
    first = (ar < 8)[None, :] & (aq >= 0)[:, None]
    PB: gl.constexpr = psm.shape[0] // 6
    pb = kk % PB
    mbarrier.wait(pfree.index(pb), ((kk // PB) & 1) ^ 1)
    if PACK:
        _pack_weights(psm, pb, P, LW)
    else:
        for u in gl.static_range(2):
            if u == 0:
                Pu = gl.where(first, P, 0.0)
            else:
                Pu = gl.where(first, 0.0, P)
            p1, p2, p3 = _three_parts(Pu)
            psm.index(pb * 6 + 3 * u).store(p1)
            psm.index(pb * 6 + 3 * u + 1).store(p2)
            psm.index(pb * 6 + 3 * u + 2).store(p3)
    _bar()
    mbarrier.arrive(pready.index(pb))


@gluon.jit
def _three_parts(x):
    """``x`` (fp32) as three bf16 parts whose sum keeps its 24 significant bits."""
    p1 = x.to(gl.bfloat16)
    rest = x - p1.to(gl.float32)
    p2 = rest.to(gl.bfloat16)
    return p1, p2, (rest - p2.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def _pack_weights(psm, pb, P, LW: gl.constexpr):
    """The pair's weights ``P:[32 queries, 16 rows]`` (rows: token 0's 8 blocks, then token 1's)
    as the writer's packed operands, three bf16 parts each: buffer ``pb·6 + k`` holds part ``k`` of
    ``[32, 16]``, queries 0–15 of token 0 then of token 1; buffer ``pb·6 + 3 + k`` rows 0–15,
    queries 16–23 of token 0 then of token 1 (each token's rows zero outside its own blocks). So
    the writer's products cover 48 rows (24 queries × 2 tokens) instead of 64. Rows are regrouped
    through the scratch buffers after the ``PB·6`` of ``psm``."""
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    scratch: gl.constexpr = psm.shape[0] // 6 * 6
    parts = _three_parts(P)
    for k in gl.static_range(3):
        psm.index(scratch + k).store(parts[k])
    _bar()
    first = (gl.arange(0, R, layout=gl.SliceLayout(0, BL)) < 8)[None, :]  # token 0's blocks
    t0_16 = first & (gl.arange(0, 16, layout=gl.SliceLayout(1, BL)) >= 0)[:, None]
    t0_8 = first & (gl.arange(0, 8, layout=gl.SliceLayout(1, BL)) >= 0)[:, None]
    for k in gl.static_range(3):
        lo = psm.index(scratch + k).slice(0, 16).load(BL)
        hi = psm.index(scratch + k).slice(16, 8).load(BL)
        a1 = psm.index(pb * 6 + k)
        a1.slice(0, 16).store(gl.where(t0_16, lo, 0.0))
        a1.slice(16, 16).store(gl.where(t0_16, 0.0, lo))
        a2 = psm.index(pb * 6 + 3 + k)
        a2.slice(0, 8).store(gl.where(t0_8, hi, 0.0))
        a2.slice(8, 8).store(gl.where(t0_8, 0.0, hi))


@gluon.jit
def _two_rounds(pacc, pss, ctr, m_out, z_out, team, s, b, kk, T, D, n, Q, eps, TEAMS, S: gl.constexpr,
                NBUF: gl.constexpr, LW: gl.constexpr, RELAXED: gl.constexpr, QG: gl.constexpr = 32):
    """Pair ``kk``'s weights ``[QP, 16]`` with a reduce-scatter over the team: slab ``s`` sums
    the team's partials of its own ``QS = ⌈QG / S⌉`` queries only (and every slab's squares),
    takes their softmax (and writes their ``m, Z``), and posts those weights; then every slab
    reads the team's weights (rows from ``QS·S`` on are never posted: the writer leaves them out).
    Each program reads about a sixth of what one round reads."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    QS: gl.constexpr = (QG + S - 1) // S
    gl.static_assert(QS * S <= QP, "two rounds need ceil(queries read / slabs) · slabs <= 32")
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    q = s * QS + gl.arange(0, QS, layout=gl.SliceLayout(1, BL))
    _wait(ctr + team * NBUF + b, S * (kk // NBUF + 1), RELAXED)
    tot, sst = _gather(pacc, pss, (team * NBUF + b) * S, q, ar, ar, S, BL, gl.SliceLayout(0, BL))
    L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
    P = _softmax(L, q, ar, n, m_out, z_out, 2 * (team + kk * TEAMS), T, Q, True)
    row = team * NBUF + b
    pw = pacc + TEAMS * NBUF * S * QP * R  # the weights buffers, after the partials'
    gl.store(pw + (row * QP + q[:, None]) * R + ar[None, :], P)
    _bar()
    gl.atomic_add(ctr + TEAMS * NBUF + row, 1, sem="release")
    _wait(ctr + TEAMS * NBUF + row, S * (kk // NBUF + 1), RELAXED)
    return gl.load(pw + (row * QP + aq[:, None]) * R + ar[None, :], cache_modifier=".cg")


@gluon.jit
def _logits(ring, wsm, psm, full, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps,
            TEAMS, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr,
            LOOK: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr, EXCHANGE: gl.constexpr,
            CHAINS: gl.constexpr, RELAXED: gl.constexpr, OWN: gl.constexpr, GS: gl.constexpr, QG: gl.constexpr):
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
            acc, ss = _partials(ring, wsm, slot, NCH, CH, LW, MATH, CHAINS)
            if EXCHANGE:
                _post(pacc, pss, ctr, team, s, j, acc, ss, S, NBUF, LW, OWN)
        kk = j - LOOK
        if kk >= 0:
            _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
                     S, NBUF, LW, EXCHANGE, RELAXED, OWN, GS, QG)


@gluon.jit
def _poster(ring, wsm, full, pacc, pss, ctr, team, s, nk, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr,
            RING: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, MATH: gl.constexpr, CHAINS: gl.constexpr,
            WREG: gl.constexpr, OWN: gl.constexpr, LANE: gl.constexpr, LANES: gl.constexpr,
            DEFER: gl.constexpr, PRESUM: gl.constexpr = False, TEAMS=0, pempty=None, OWNRING: gl.constexpr = False):
    """Partials warps (``split`` variants): pairs ``LANE, LANE + LANES, ...``, each one's partials
    posted as soon as its slab lands (``WREG``: by :func:`_poster_wreg`). ``DEFER``: a pair's
    count (a release, which waits for its stores to land) only after the next pair's products,
    so that the stores land meanwhile. ``PRESUM``: each even slab posts to its odd neighbour
    (:func:`_presum`), which posts the two slabs' sum for the team: the team reads half as much.
    ``OWNRING``: ``ring`` is the partials warps' own (``early``), released on ``pempty``."""
    if WREG == 2:
        _poster_turned(ring, wsm, full, pacc, pss, ctr, team, s, nk, S, NCH, CH, RING, NBUF, OWN)
    elif WREG:
        _poster_wreg(ring, wsm, full, pacc, pss, ctr, team, s, nk, S, NCH, CH, RING, NBUF, LW, OWN)
    else:
        for j in range(LANE, nk, LANES):
            slot = j % RING
            mbarrier.wait(full.index(slot), (j // RING) & 1)
            acc, ss = _partials(ring, wsm, slot, NCH, CH, LW, MATH, CHAINS)
            if OWNRING:
                _bar()
                mbarrier.arrive(pempty.index(slot))
            if DEFER:
                if j >= LANE + LANES:
                    _post_count(ctr, team, s, j - LANES, S, NBUF, OWN)
                _post_store(pacc, pss, team, s, j, acc, ss, S, NBUF, LW)
            elif PRESUM:
                _presum(pacc, pss, ctr, team, s, j, acc, ss, TEAMS, S, NBUF, LW)
            else:
                _post(pacc, pss, ctr, team, s, j, acc, ss, S, NBUF, LW, OWN)
        if DEFER:
            if nk > LANE:
                _post_count(ctr, team, s, LANE + (nk - 1 - LANE) // LANES * LANES, S, NBUF, OWN)


@gluon.jit
def _presum(pacc, pss, ctr, team, s, j, acc, ss, TEAMS, S: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr):
    """Pair ``j``'s partials of slab ``s`` summed by pairs of slabs: an even slab posts its own
    and counts on a counter of its own (after the team's, :func:`_presum_counter`); an odd slab
    waits for it, adds its own to it (``p[s-1] + p[s]``) and posts the sum in its place,
    counted on the team's counter."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    if s % 2 == 0:
        _post_store(pacc, pss, team, s, j, acc, ss, S, NBUF, LW)
        _bar()
        gl.atomic_add(_presum_counter(ctr, team, s, j, TEAMS, S, NBUF), 1, sem="release")
    else:
        _wait(_presum_counter(ctr, team, s - 1, j, TEAMS, S, NBUF), j // NBUF + 1, False)
        aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
        ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
        row = (team * NBUF + j % NBUF) * S + s - 1
        other = gl.load(pacc + (row * QP + aq[:, None]) * R + ar[None, :], cache_modifier=".cg")
        other_ss = gl.load(pss + row * R + ar, cache_modifier=".cg")
        _post(pacc, pss, ctr, team, s, j, other + acc, other_ss + ss, S, NBUF, LW, False)


@gluon.jit
def _presum_counter(ctr, team, s, j, TEAMS, S: gl.constexpr, NBUF: gl.constexpr):
    """The counter of slab ``s``'s posts for ``presum``, after the team counters and the
    second-round counters (``2 · TEAMS · NBUF`` of them)."""
    return ctr + (2 * TEAMS + team * S + s) * NBUF + j % NBUF


@gluon.jit
def _poster_turned(ring, wsm, full, pacc, pss, ctr, team, s, nk, S: gl.constexpr, NCH: gl.constexpr,
                   CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr, OWN: gl.constexpr):
    """One partials warp with the products turned round (rows × queries: the ring tile the A
    operand, ``w ⊙ γ`` the B operand in three groups of 8 queries, ``wsm[(3·part + group)·NCH +
    chunk]`` of ``[8, CH]``), so ``w ⊙ γ`` takes 24 rows of shared memory, not 32, and a team of
    8 wider slabs fits; posts the 24 real queries' partials (``qonly`` reads no others). One
    accumulator per part and group."""
    R: gl.constexpr = 16
    QP: gl.constexpr = 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    XB: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    PL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [1, 1], [1, 0])
    pq = gl.arange(0, 8, layout=gl.SliceLayout(1, PL))
    pr = gl.arange(0, R, layout=gl.SliceLayout(0, PL))
    for j in range(nk):
        slot = j % RING
        mbarrier.wait(full.index(slot), (j // RING) & 1)
        acc = ()
        for _ in gl.static_range(9):
            acc = acc + (gl.zeros([R, 8], gl.float32, MMA),)  # noqa: RUF005
        ss2 = gl.zeros([R, CH], gl.float32, XB)
        for c in gl.static_range(NCH):
            tile = ring.index(slot * NCH + c)
            ss2 = _add_squares(ss2, tile)
            xa = tile.load(OPA)
            new = ()
            for i in gl.static_range(9):  # i = 3 * group + (2 - part): the third part first
                wb = wsm.index((3 * (2 - i % 3) + i // 3) * NCH + c).permute([1, 0]).load(OPB)
                new = new + (mma_v2(xa, wb, acc[i]),)  # noqa: RUF005
            acc = new
        row = (team * NBUF + j % NBUF) * S + s
        for g in gl.static_range(3):
            tot = acc[3 * g + 2] + (acc[3 * g + 1] + acc[3 * g])  # first + (second + third), as _partials
            tot = gl.convert_layout(gl.permute(tot, [1, 0]), PL)  # [8 queries, 16 rows]
            gl.store(pacc + (row * QP + 8 * g + pq[:, None]) * R + pr[None, :], tot)
        gl.store(pss + row * R + pr, gl.convert_layout(gl.sum(ss2, axis=1), gl.SliceLayout(0, PL)))
        _post_count(ctr, team, s, j, S, NBUF, OWN)


@gluon.jit
def _poster_wreg(ring, wsm, full, pacc, pss, ctr, team, s, nk, S: gl.constexpr, NCH: gl.constexpr,
                 CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, OWN: gl.constexpr):
    """Partials warps with the slab of ``w ⊙ γ`` held in registers for the whole launch: the
    products turned round (rows × queries, the pair's rows the ``mma``'s A operand, each warp
    eight queries), so each pair reads only its ring slot from shared memory."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, LW], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [LW, 1], [1, 0])
    XB: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
    wb = ()  # the three parts of each chunk; Gluon builds tuples by concatenation, not unpacking
    for c in gl.static_range(NCH):
        wb = wb + (wsm.index(2 * NCH + c).permute([1, 0]).load(OPB), wsm.index(NCH + c).permute([1, 0]).load(OPB),  # noqa: RUF005
                   wsm.index(c).permute([1, 0]).load(OPB))  # fmt: skip
    for j in range(nk):
        slot = j % RING
        mbarrier.wait(full.index(slot), (j // RING) & 1)
        a3 = gl.zeros([R, QP], gl.float32, MMA)
        a2 = gl.zeros([R, QP], gl.float32, MMA)
        a1 = gl.zeros([R, QP], gl.float32, MMA)
        ss2 = gl.zeros([R, CH], gl.float32, XB)
        for c in gl.static_range(NCH):
            tile = ring.index(slot * NCH + c)
            ss2 = _add_squares(ss2, tile)
            xa = tile.load(OPA)
            a3 = mma_v2(xa, wb[3 * c], a3)
            a2 = mma_v2(xa, wb[3 * c + 1], a2)
            a1 = mma_v2(xa, wb[3 * c + 2], a1)
        acc = gl.convert_layout(gl.permute(a1 + (a2 + a3), [1, 0]), BL)
        ss = gl.convert_layout(gl.sum(ss2, axis=1), gl.SliceLayout(0, BL))
        _post(pacc, pss, ctr, team, s, j, acc, ss, S, NBUF, LW, OWN)


@gluon.jit
def _weigher(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps, TEAMS,
             S: gl.constexpr, NBUF: gl.constexpr, XW: gl.constexpr, EXCHANGE: gl.constexpr,
             RELAXED: gl.constexpr, OWN: gl.constexpr, LANE: gl.constexpr, LANES: gl.constexpr, GS: gl.constexpr,
             QG: gl.constexpr, PACK: gl.constexpr = False, PRESUM: gl.constexpr = False):
    """Weights warps (``split`` variants): pairs ``LANE, LANE + LANES, ...``, each one's team wait,
    softmax and weights in turn (without ``EXCHANGE``: no wait, weights of zero logits; timing
    only)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [XW, 1], [1, 0])
    acc = gl.zeros([QP, R], gl.float32, BL)
    ss = gl.zeros([R], gl.float32, gl.SliceLayout(0, BL))
    for kk in range(LANE, nk, LANES):
        _weights(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, acc, ss, team, s, kk, T, D, n, Q, eps, TEAMS,
                 S, NBUF, XW, EXCHANGE, RELAXED, OWN, GS, QG, PACK, PRESUM)


@gluon.jit
def _weigher_pipe2(psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nk, T, D, n, Q, eps, TEAMS,
                   S: gl.constexpr, NBUF: gl.constexpr, XW: gl.constexpr, RELAXED: gl.constexpr, QG: gl.constexpr,
                   PRESUM: gl.constexpr = False):
    """Weights warps taking pairs two at a time (``pipe2``; with ``PACK``): the second pair's team
    wait and its reads of the partials are issued before the first pair's sums, so the two pairs'
    latencies overlap instead of adding up. The same sums in the same order as :func:`_weights`."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [XW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, BL))
    ar = gl.arange(0, R, layout=gl.SliceLayout(0, BL))
    for k0 in range(0, nk, 2):
        G: gl.constexpr = S // (1 + PRESUM)  # posts a pair
        _wait(ctr + team * NBUF + k0 % NBUF, G * (k0 // NBUF + 1), RELAXED)
        raw0 = _gather_raw(pacc, pss, (team * NBUF + k0 % NBUF) * S + PRESUM, aq, ar, G, QG, 1 + PRESUM)
        k1 = k0 + 1
        if k1 < nk:
            _wait(ctr + team * NBUF + k1 % NBUF, G * (k1 // NBUF + 1), RELAXED)
        raw1 = _gather_raw(pacc, pss, (team * NBUF + k1 % NBUF) * S + PRESUM, aq, ar, G, QG, 1 + PRESUM)
        _hand_over(psm, pready, pfree, m_out, z_out, raw0, aq, ar, team, s, k0, T, D, n, Q, eps, TEAMS, G, XW)
        if k1 < nk:
            _hand_over(psm, pready, pfree, m_out, z_out, raw1, aq, ar, team, s, k1, T, D, n, Q, eps, TEAMS, G, XW)


@gluon.jit
def _gather_raw(pacc, pss, base, q, r, S: gl.constexpr, QG: gl.constexpr, STEP: gl.constexpr = 1):
    """The team's ``S`` posts at buffer rows ``base, base + STEP, ...`` as loaded, unsummed: a
    tuple of ``S`` logits tiles (queries ``q`` × rows ``r``; from ``QG`` on not read, zero) and
    then ``S`` squares vectors (rows ``r``)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    raw = ()
    for mm in gl.static_range(S):
        raw = raw + (gl.load(pacc + ((base + STEP * mm) * QP + q[:, None]) * R + r[None, :],  # noqa: RUF005
                             mask=(q < QG)[:, None] & (r >= 0)[None, :], other=0.0, cache_modifier=".cg"),)
    for mm in gl.static_range(S):
        raw = raw + (gl.load(pss + (base + STEP * mm) * R + r, cache_modifier=".cg"),)  # noqa: RUF005
    return raw


@gluon.jit
def _hand_over(psm, pready, pfree, m_out, z_out, raw, aq, ar, team, s, kk, T, D, n, Q, eps, TEAMS, S: gl.constexpr,
               XW: gl.constexpr):
    """Pair ``kk``'s partials ``raw`` (:func:`_gather_raw`) summed in slab order, the softmax (m, Z
    written by slab 0) and the packed weights handed to the writer."""
    BL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [XW, 1], [1, 0])
    tot = gl.zeros([32, 16], gl.float32, BL)
    sst = gl.zeros([16], gl.float64, gl.SliceLayout(0, BL))
    for mm in gl.static_range(S):
        tot += raw[mm]
        sst += raw[S + mm].to(gl.float64)
    L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
    P = _softmax(L, aq, ar, n, m_out, z_out, 2 * (team + kk * TEAMS), T, Q, s == 0)
    _deliver(psm, pready, pfree, P, aq, ar, kk, XW, True)


@gluon.jit
def _tma_tile(o, stage, ndesc, col, i, NSTAGE: gl.constexpr):
    """Stage tile ``o`` in slot ``i % NSTAGE`` of ``stage`` once that slot's previous copy has read
    it, and copy it by TMA to flat column ``col`` of ``N`` viewed ``[Q, T·d]`` (rows past ``Q``
    clipped)."""
    buf = stage.index(i % NSTAGE)
    tma.store_wait(NSTAGE - 1)
    _bar()
    buf.store(o)
    fence_async_shared()
    _bar()
    _tma_store(ndesc, [0, col], buf)


@gluon.jit
def _writer(ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
            NCH: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, STORE: gl.constexpr,
            NSTAGE: gl.constexpr, LOGITS: gl.constexpr, PACK: gl.constexpr = False):
    """Writer warps (default partition): :func:`_writer_packed` with ``PACK``, else
    :func:`_writer_rows`."""
    if PACK:
        _writer_packed(ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH, CH, RING, NW,
                       LOGITS, PACK == 2)
    else:
        _writer_rows(ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS, NCH,
                     CH, RING, NW, STORE, NSTAGE, LOGITS)


@gluon.jit
def _writer_packed(ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH: gl.constexpr,
                   CH: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, LOGITS: gl.constexpr,
                   EVICT: gl.constexpr = False):
    """Writer warps with the packed weights of :func:`_pack_weights`: per step the products
    ``[32, CH]`` (queries 0–15 of both tokens) and ``[16, CH]`` (queries 16–23), 48 rows where
    :func:`_writer_rows` computes 64, each warp a ``CH / NW`` column slice (the tile read once from
    shared memory, the weights whole in every warp), stored in 16-byte vectors (``EVICT``: marked
    evict-first in L2, so that they do not push out the blocks read for the writer's ring)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    OB: gl.constexpr = gl.BlockedLayout([1, 4], [128 // CH, CH // 4], [NW, 1], [1, 0])
    r32 = gl.arange(0, 32, layout=gl.SliceLayout(1, OB))
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, OB))
    bc = gl.arange(0, CH, layout=gl.SliceLayout(0, OB))
    q1 = r32 % 16  # [32, CH] rows: query i % 16 of token i // 16
    q2 = 16 + r16 % 8  # [16, CH] rows: query 16 + i % 8 of token i // 8
    off1 = q1.to(gl.int64) * T * D + (r32 // 16) * D
    off2 = q2.to(gl.int64) * T * D + (r16 // 8) * D
    for k in range(nk):
        a11, a12, a13, a21, a22, a23, slot = _take_pair(psm, pready, pfree, full, k, OPA, 16, RING, LOGITS)
        t0 = 2 * (team + k * TEAMS)
        for c in range(NCH):
            xb = ring.index(slot * NCH + c).load(OPB)
            o1 = mma_v2(a11, xb, mma_v2(a12, xb, mma_v2(a13, xb, gl.zeros([32, CH], gl.float32, MMA))))
            o2 = mma_v2(a21, xb, mma_v2(a22, xb, mma_v2(a23, xb, gl.zeros([16, CH], gl.float32, MMA))))
            col = t0 * D + lo + c * CH
            policy: gl.constexpr = "evict_first" if EVICT else ""
            gl.store(n_out + off1[:, None] + col + bc[None, :], gl.convert_layout(o1, OB), mask=(q1 < Q)[:, None],
                     eviction_policy=policy)
            gl.store(n_out + off2[:, None] + col + bc[None, :], gl.convert_layout(o2, OB), mask=(q2 < Q)[:, None],
                     eviction_policy=policy)
        _bar()
        mbarrier.arrive(empty.index(slot))


@gluon.jit
def _take_pair(psm, pready, pfree, full, k, OPA: gl.constexpr, ROWS: gl.constexpr, RING: gl.constexpr,
               LOGITS: gl.constexpr):
    """The writer's start of pair ``k``: its six weights tiles from buffer ``k % PB`` as ``mma`` A
    operands (the last three cut to their first ``ROWS`` rows), once the weights warps have filled
    it (the buffer is then handed back; without ``LOGITS`` nothing is waited for: timing the
    writer alone), and its ring slot, once the slab has landed."""
    PB: gl.constexpr = psm.shape[0] // 6
    pb = k % PB
    if LOGITS:
        mbarrier.wait(pready.index(pb), (k // PB) & 1)
    a1 = psm.index(pb * 6).load(OPA)
    a2 = psm.index(pb * 6 + 1).load(OPA)
    a3 = psm.index(pb * 6 + 2).load(OPA)
    b1 = psm.index(pb * 6 + 3).slice(0, ROWS).load(OPA)
    b2 = psm.index(pb * 6 + 4).slice(0, ROWS).load(OPA)
    b3 = psm.index(pb * 6 + 5).slice(0, ROWS).load(OPA)
    _bar()
    if LOGITS:
        mbarrier.arrive(pfree.index(pb))
    slot = k % RING
    mbarrier.wait(full.index(slot), (k // RING) & 1)
    return a1, a2, a3, b1, b2, b3, slot


@gluon.jit
def _writer_rows(ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                 NCH: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NW: gl.constexpr, STORE: gl.constexpr,
                 NSTAGE: gl.constexpr, LOGITS: gl.constexpr):
    """Writer warps: ``N`` of each pair's two tokens for this slab, ``[QP, CH]`` products per step.
    ``STORE``: 0 from the mma layout's registers (8-byte pieces), 1 through a layout of 16-byte
    vectors, 2 staged in shared memory and copied by TMA (``_tma_tile``). Without ``LOGITS`` it
    takes whatever the weights buffers hold (timing the data movement alone)."""
    QP: gl.constexpr = 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, NW // 2], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    OB: gl.constexpr = gl.BlockedLayout([1, 4], [128 // CH, CH // 4], [NW, 1], [1, 0])
    oq = gl.arange(0, QP, layout=gl.SliceLayout(1, MMA))
    oc = gl.arange(0, CH, layout=gl.SliceLayout(0, MMA))
    bq = gl.arange(0, QP, layout=gl.SliceLayout(1, OB))
    bc = gl.arange(0, CH, layout=gl.SliceLayout(0, OB))
    row = T * D
    for k in range(nk):
        a01, a02, a03, a11, a12, a13, slot = _take_pair(psm, pready, pfree, full, k, OPA, 32, RING, LOGITS)
        t0 = 2 * (team + k * TEAMS)
        for c in range(NCH):
            xb = ring.index(slot * NCH + c).load(OPB)
            z = gl.zeros([QP, CH], gl.float32, MMA)
            for u in gl.static_range(2):
                if u == 0:
                    o = mma_v2(a01, xb, mma_v2(a02, xb, mma_v2(a03, xb, z)))
                else:
                    o = mma_v2(a11, xb, mma_v2(a12, xb, mma_v2(a13, xb, z)))
                col = (t0 + u) * D + lo + c * CH
                if STORE == 0:
                    gl.store(n_out + oq[:, None].to(gl.int64) * row + col + oc[None, :], o, mask=(oq < Q)[:, None])
                elif STORE == 1:
                    gl.store(n_out + bq[:, None].to(gl.int64) * row + col + bc[None, :], gl.convert_layout(o, OB),
                             mask=(bq < Q)[:, None])
                else:
                    _tma_tile(o, stage, ndesc, col, (k * NCH + c) * 2 + u, NSTAGE)
        _bar()
        mbarrier.arrive(empty.index(slot))
    if STORE == 2:
        tma.store_wait(0)


@gluon.jit
def _pipeline_barriers(RING: gl.constexpr, PB: gl.constexpr):
    """The barriers between a team program's partitions, initialised: ``full`` and ``empty`` of
    each of the ``RING`` ring slots (the loader's copy landed; the writer done with it), and
    ``pready`` and ``pfree`` of each of the ``PB`` weights buffers (the weights written; the
    writer done with them)."""
    full = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(PB):
        mbarrier.init(pready.index(i), count=1)
        mbarrier.init(pfree.index(i), count=1)
    return full, empty, pready, pfree


@gluon.jit
def _ws_kernel(desc, ndesc, g3_ptr, m_out, z_out, n_out, pacc, pss, tickets, ctr, T, D, n, Q, eps, TEAMS,
               S: gl.constexpr, W: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr,
               NW: gl.constexpr, LW: gl.constexpr, LOOK: gl.constexpr, EXCHANGE: gl.constexpr, MATH: gl.constexpr,
               LREGS: gl.constexpr, CHAINS: gl.constexpr, SPLIT: gl.constexpr, XW: gl.constexpr,
               XREGS: gl.constexpr, STORE: gl.constexpr, NSTAGE: gl.constexpr, LOGITS: gl.constexpr,
               WREG: gl.constexpr, PB: gl.constexpr, RELAXED: gl.constexpr, OWN: gl.constexpr,
               LANES: gl.constexpr, DEFER: gl.constexpr, GS: gl.constexpr, QG: gl.constexpr, WLANES: gl.constexpr,
               PACK: gl.constexpr, PIPE2: gl.constexpr, PRESUM: gl.constexpr, EARLY: gl.constexpr,
               PRING: gl.constexpr):
    """One program per (team, slab): its slab of ``w ⊙ γ`` into shared memory, then the
    partitions (three, or four with ``SPLIT``)."""
    QP: gl.constexpr = 32
    R: gl.constexpr = 16
    NCH: gl.constexpr = W // CH
    WLD: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    SX: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * CH), element_bitwidth=16, rank=2)
    SP: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SO: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

    tk = gl.atomic_add(tickets, 1)
    team = tk // S
    s = tk % S
    lo = s * W
    pairs = T // 2
    nk = (pairs - team + TEAMS - 1) // TEAMS
    nlog = nk if LOGITS else 0  # pairs the logits partitions see

    ring = gl.allocate_shared_memory(gl.bfloat16, [RING * NCH, R, CH], SX)
    if WREG == 2:  # three parts × three groups of 8 queries (:func:`_poster_turned`)
        wsm = gl.allocate_shared_memory(gl.bfloat16, [9 * NCH, 8, CH], SX)
    else:
        wsm = gl.allocate_shared_memory(gl.bfloat16, [3 * NCH, QP, CH], SX)
    psm = gl.allocate_shared_memory(gl.bfloat16, [PB * 6 + (3 if PACK else 0), QP, R], SP)  # PACK: 3 scratch tiles
    if STORE == 2:
        stage = gl.allocate_shared_memory(gl.float32, [NSTAGE, QP, CH], SO)
    else:
        stage = gl.allocate_shared_memory(gl.float32, [1, 8, 32], SP)  # unused
    full, empty, pready, pfree = _pipeline_barriers(RING, PB)
    if EARLY:  # the partials warps' own ring (allocated only then: other variants keep their code)
        pring = gl.allocate_shared_memory(gl.bfloat16, [PRING * NCH, R, CH], SX)
        pfull = gl.allocate_shared_memory(gl.int64, [PRING, 1], mbarrier.MBarrierLayout())
        pempty = gl.allocate_shared_memory(gl.int64, [PRING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(PRING):
            mbarrier.init(pfull.index(i), count=1)
            mbarrier.init(pempty.index(i), count=1)
    else:
        pring = ring
        pfull = full
        pempty = empty

    wq = gl.arange(0, QP, layout=gl.SliceLayout(1, WLD))
    wc = gl.arange(0, CH, layout=gl.SliceLayout(0, WLD))
    if WREG == 2:
        w8 = gl.arange(0, 8, layout=gl.SliceLayout(1, WLD))
        for j in gl.static_range(9):  # part j // 3, queries 8 (j % 3) ...
            for c in range(NCH):
                wsm.index(j * NCH + c).store(gl.load(g3_ptr + ((j // 3) * QP + 8 * (j % 3) + w8[:, None]) * D + lo
                                                     + c * CH + wc[None, :]))  # fmt: skip
    else:
        for j in gl.static_range(3):
            for c in range(NCH):
                wsm.index(j * NCH + c).store(gl.load(g3_ptr + (j * QP + wq[:, None]) * D + lo + c * CH + wc[None, :]))
    _bar()

    if SPLIT and LANES == 2:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nlog, S, NCH, CH, RING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 0, 2, DEFER)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nlog, S, NCH, CH, RING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 1, 2, DEFER)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 0, 2, GS, QG)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 1, 2, GS, QG)),
        ], [1, LW, LW, XW, XW], [24, LREGS, LREGS, XREGS, XREGS])
    elif SPLIT and WLANES == 2:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nlog, S, NCH, CH, RING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 0, 1, DEFER)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 0, 2, GS, QG)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 1, 2, GS, QG)),
        ], [1, LW, XW, XW], [24, LREGS, XREGS, XREGS])
    elif SPLIT and EARLY:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS, PACK)),
            (_loader_early, (desc, ring, full, empty, pring, pfull, pempty, team, lo, nk, TEAMS, D, NCH, CH, RING,
                             PRING, EARLY)),
            (_poster, (pring, wsm, pfull, pacc, pss, ctr, team, s, nlog, S, NCH, CH, PRING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 0, 1, DEFER, PRESUM, TEAMS, pempty, True)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 0, 1, GS, QG, PACK, PRESUM)),
        ], [1, LW, XW], [40, LREGS, XREGS])
    elif SPLIT and PIPE2:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS, PACK)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nlog, S, NCH, CH, RING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 0, 1, DEFER, PRESUM, TEAMS)),
            (_weigher_pipe2, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS,
                              S, NBUF, XW, RELAXED, QG, PRESUM)),
        ], [1, LW, XW], [24, LREGS, XREGS])
    elif SPLIT:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS, PACK)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_poster, (ring, wsm, full, pacc, pss, ctr, team, s, nlog, S, NCH, CH, RING, NBUF, LW, MATH, CHAINS,
                       WREG, OWN, 0, 1, DEFER, PRESUM, TEAMS)),
            (_weigher, (psm, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q, eps, TEAMS, S,
                        NBUF, XW, EXCHANGE, RELAXED, OWN, 0, 1, GS, QG, PACK, PRESUM)),
        ], [1, LW, XW], [24, LREGS, XREGS])
    else:
        gl.warp_specialize([
            (_writer, (ring, psm, stage, full, empty, pready, pfree, n_out, ndesc, team, lo, nk, T, D, Q, TEAMS,
                       NCH, CH, RING, NW, STORE, NSTAGE, LOGITS, PACK)),
            (_loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_logits, (ring, wsm, psm, full, pready, pfree, pacc, pss, ctr, m_out, z_out, team, s, nlog, T, D, n, Q,
                       eps, TEAMS, S, NCH, CH, RING, NBUF, LOOK, LW, MATH, EXCHANGE, CHAINS, RELAXED, OWN, GS, QG)),
        ], [1, LW], [24, LREGS])


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _descriptors(stored: torch.Tensor, N: torch.Tensor, box: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of ``stored:[n, T, d]`` viewed as ``[n, T·d]`` (a box is a token's 8 block
    rows × ``box`` columns, rows past ``n`` read as zero) and of ``N:[Q, T, d]`` viewed as
    ``[Q, T·d]`` (a box is 32 query rows × ``box`` columns, rows past ``Q`` clipped; swizzled
    where a row of the box fits the 128-byte swizzle, which TMA requires)."""
    n, T, d = stored.shape
    Q = N.shape[0]
    sx = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * box), element_bitwidth=16, rank=2)
    so = gl.NVMMASharedLayout(swizzle_byte_width=128 if 4 * box <= 128 else 0, element_bitwidth=32, rank=2)
    return (TensorDescriptor(stored.view(n, T * d), [n, T * d], [T * d, 1], [8, box], sx),
            TensorDescriptor(N.view(Q, T * d), [Q, T * d], [T * d, 1], [QP, box], so))


def phase1(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = ours.RMS_NORM_EPS,
           slabs: int = 16, ring: int = 4, warps: int = 4, logit_warps: int = 4, look: int = 1,
           exchange: bool = True, math: bool = True, teams: int | None = None, lregs: int = 152,
           chains: int = 1, split: bool = False, weigh_warps: int = 4, xregs: int = 128, box: int = 64,
           store: str = "mma", stages: int = 4, logits: bool = True, wreg: bool = False, gather: bool = True,
           pbufs: int = 2, relaxed: bool = False, own: bool = False, rounds: int = 1, lanes: int = 1,
           defer: bool = False, vgather: bool = False, qonly: bool = False, gslabs: int = 0,
           wlanes: int = 1, pack: bool = False, turn: bool = False, vnative: bool = False,
           pipe2: bool = False, presum: bool = False, early: int = 0, pring: int = 2, evict: bool = False) -> Stats:
    """Phase-1 statistics of ``w, gamma:[Q, d]`` (Q <= 32) over ``stored:[n, T, d]`` (bf16,
    n <= 8, T even, d a multiple of ``box`` per slab) in one launch: ``m, Z:[Q, T]``,
    ``N:[Q, T, d]``. ``chains``: independent accumulators of the partial logits (1, 3 or 6).
    ``split``: the partials and the weights in two partitions (``weigh_warps`` warps for the
    latter), so that the partials never wait for the team. ``box``: columns of a TMA copy and of
    a product step. ``store``: how the writer stores ``N`` (``"mma"``, ``"vector"`` or ``"tma"``
    through ``stages`` staging tiles, which needs ``box`` <= 32). ``logits=False``: the writer
    alone with the loader (wrong values, timing only). ``wreg`` (with ``split``): the partials
    warps hold ``w ⊙ γ`` in registers (:func:`_poster_wreg`). ``gather=False``: the team wait
    without reading the team's partials (wrong values, timing only). ``pbufs``: weights buffers
    between the weights warps and the writer. ``relaxed``: the team wait spins on relaxed reads
    and acquires once. ``own``: each program waits for its own posts only, reading the team's
    buffers all the same (no coupling between the team; wrong values, timing only). ``rounds=2``:
    the team's partials reduced in two rounds (:func:`_two_rounds`). ``lanes=2`` (with
    ``split``): two partials partitions and two weights partitions, each taking every other pair.
    ``defer``: each pair's count posted after the next pair's products (:func:`_poster`).
    ``vgather``: the team's partials read in 16-byte pieces (the same sums). ``qonly``: only the
    real queries' partials read (the same sums: the padded ones are zero). ``gslabs`` (1 to
    ``slabs``): only that many slabs' partials read (wrong values, timing only; 0: all). ``wlanes=2`` (with
    ``split``, ``lanes=1``): one partials partition and two weights partitions taking alternate
    pairs, so that one pair's wait and gather overlap the other's. ``pack`` (with ``split`` or ``logits=False``,
    ``store="vector"``, at most 24 queries): the writer's products cover the 48 rows of 24 queries
    and two tokens instead of 64 (:func:`_writer_packed`; the same sums). ``turn`` (with ``split``
    or ``logits=False``, ``pack``, ``qonly``; ``logit_warps=1``): one partials warp with the products turned round
    (:func:`_poster_turned`), whose ``w ⊙ γ`` takes three quarters of the shared memory, so 8
    slabs of 896 fit. ``vnative`` (with ``pack``): the team's partials read in 16-byte pieces and
    the softmax taken in that layout (no change of layout). ``pipe2`` (with ``pack``): the weights
    warps take pairs two at a time, the second's wait and reads issued before the first's sums
    (:func:`_weigher_pipe2`). ``presum`` (with ``split``, an even slab count): the partials summed
    by pairs of slabs before the team reads them (:func:`_presum`), half the reads. ``early`` (with
    ``split``): the partials warps read each pair ``early`` pairs ahead of the writer, from a ring
    of their own of ``pring`` slots (:func:`_loader_early`). ``evict`` (with ``pack``): ``N``
    stored evict-first."""
    n, T, d = stored.shape
    Q = w.shape[0]
    dev = stored.device
    refused = _refusals(n, T, d, Q, slabs=slabs, ring=ring, look=look, exchange=exchange, chains=chains, split=split,
                        box=box, store=store, logits=logits, wreg=wreg, gather=gather, own=own, rounds=rounds,
                        lanes=lanes, defer=defer, vgather=vgather, qonly=qonly, gslabs=gslabs, wlanes=wlanes, pack=pack,
                        turn=turn, vnative=vnative, pipe2=pipe2, presum=presum, early=early, pring=pring,
                        evict=evict, logit_warps=logit_warps)  # fmt: skip
    if refused:
        raise ValueError(f"unsupported shape or variant (stored {list(stored.shape)}, {Q} queries): "
                         + "; ".join(refused))  # fmt: skip
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty(Q, T, dtype=torch.float32, device=dev)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    g3 = ours._split_bf16(ours._queries(w, gamma, d, dev, QP).T.contiguous()).contiguous()  # [3, QP, d]
    if teams is None:
        teams = max(1, min(T // 2, torch.cuda.get_device_properties(dev).multi_processor_count // slabs))
    nbuf = _buffers(ring, look, split)
    key = (teams, slabs, nbuf, dev)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(teams * nbuf * (slabs + 1) * QP * 16, dtype=torch.float32, device=dev),
                         torch.empty(teams * nbuf * slabs * 16, dtype=torch.float32, device=dev))  # fmt: skip
    pacc, pss = _SCRATCH[key]
    # team counters, second-round counters, a counter per slab (presum); the ticket last
    counters = torch.zeros(teams * (slabs + 2) * nbuf + 1, dtype=torch.int32, device=dev)
    constexprs = _constexprs(d, Q, slabs=slabs, ring=ring, warps=warps, logit_warps=logit_warps, look=look,
                             exchange=exchange, math=math, lregs=lregs, chains=chains, split=split,
                             weigh_warps=weigh_warps, xregs=xregs, box=box, store=store, stages=stages,
                             logits=logits, wreg=wreg, gather=gather, pbufs=pbufs, relaxed=relaxed,
                             own=own, rounds=rounds, lanes=lanes, defer=defer, vgather=vgather, qonly=qonly,
                             gslabs=gslabs, wlanes=wlanes, pack=pack, turn=turn, vnative=vnative,
                             pipe2=pipe2, presum=presum, early=early, pring=pring, evict=evict)  # fmt: skip
    _ws_kernel[(teams * slabs,)](
        *_descriptors(stored, N, box), g3, m, Z, N, pacc, pss, counters[-1:], counters, T, d, n, Q,
        float(eps), teams, **constexprs, num_warps=warps,
    )  # fmt: skip
    return Stats(m, Z, N)


def _refusals(n: int, T: int, d: int, Q: int, *, slabs: int, ring: int, look: int, exchange: bool, chains: int,
              split: bool, box: int, store: str, logits: bool, wreg: bool, gather: bool, own: bool, rounds: int,
              lanes: int, defer: bool, vgather: bool, qonly: bool, gslabs: int, wlanes: int, pack: bool, turn: bool,
              vnative: bool, pipe2: bool, presum: bool, early: int, pring: int, evict: bool,
              logit_warps: int) -> list[str]:
    """Why :func:`phase1` cannot run ``n`` stored blocks of ``[T, d]`` for ``Q`` queries with these
    options: one reason per rule broken (none: it can)."""
    qs = -(-(Q if qonly else QP) // slabs)  # queries a slab sums in the first of two rounds
    rules = [
        (d % slabs or (d // slabs) % box, f"d = {d} must split into {slabs} slabs, each a multiple of box = {box}"),
        (n > 8, f"at most 8 stored blocks, not {n}"),
        (Q > QP, f"at most {QP} queries, not {Q}"),
        (T % 2, f"T = {T} must be even (the items are token pairs)"),
        (ring < look + 2, f"ring = {ring} must be at least look + 2 = {look + 2}"),
        (not (exchange or look == 0), "look needs the exchange"),
        # without the exchange nothing holds the writer back to the partials warps, which then
        # fall more than a ring behind and wait on a barrier phase long gone (a hang)
        (split and not exchange, "split needs the exchange (without it the partials warps hang)"),
        (chains not in (1, 3, 6), f"chains is 1, 3 or 6, not {chains}"),
        (rounds not in (1, 2), f"rounds is 1 or 2, not {rounds}"),
        (rounds == 2 and (own or vgather or gslabs), "rounds=2 takes neither own, vgather nor gslabs"),
        (rounds == 2 and (qs not in (1, 2, 4) or qs * slabs > QP),
         f"rounds=2 needs ceil(queries / slabs) = {qs} to be 1, 2 or 4 and {qs} x {slabs} <= {QP}"),
        (lanes not in (1, 2), f"lanes is 1 or 2, not {lanes}"),
        (lanes == 2 and not split, "lanes=2 needs split"),
        (wlanes not in (1, 2), f"wlanes is 1 or 2, not {wlanes}"),
        (wlanes == 2 and (not split or lanes == 2), "wlanes=2 needs split and lanes=1"),
        (not 0 <= gslabs <= slabs, f"gslabs is 0 to slabs = {slabs}, not {gslabs}"),
        (store not in STORES, f"store is one of {STORES}, not {store!r}"),
        (store == "tma" and 4 * box > 128, f"store='tma' needs box <= 32, not {box}"),
        (vnative and (not pack or vgather or rounds == 2), "vnative needs pack and takes neither vgather nor rounds=2"),
        (pipe2 and (not (pack and split and exchange and gather) or rounds == 2 or vgather or vnative or own
                    or wlanes == 2 or lanes == 2),
         "pipe2 needs pack, split, the exchange and the gather, and takes none of rounds=2, vgather, vnative, own, "
         "wlanes=2, lanes=2"),
        (evict and not pack, "evict needs pack"),
        (early and (not split or lanes == 2 or wlanes == 2 or pipe2 or wreg or turn or pring < 1),
         "early needs split and pring >= 1, and takes none of lanes=2, wlanes=2, pipe2, wreg, turn"),
        (presum and (not (split and exchange and gather) or slabs % 2 or rounds == 2 or vgather or own or gslabs
                     or wlanes == 2 or lanes == 2 or defer or wreg or turn),
         "presum needs split, the exchange, the gather and an even slab count, and takes none of rounds=2, vgather, "
         "own, gslabs, wlanes=2, lanes=2, defer, wreg, turn"),
        (pack and ((not split and logits) or lanes == 2 or wlanes == 2 or store != "vector" or Q > 24),
         "pack needs split (or logits=False), store='vector' and at most 24 queries, and takes neither lanes=2 nor "
         "wlanes=2"),
        (turn and (not ((split or not logits) and pack and qonly) or (split and logit_warps != 1) or wreg or defer),
         "turn needs split (or logits=False), pack and qonly, logit_warps=1 with split, and takes neither wreg nor "
         "defer"),
    ]  # fmt: skip
    return [reason for broken, reason in rules if broken]


def _buffers(ring: int, look: int, split: bool) -> int:
    """Partials buffers per team: a program posts pair j while a teammate may still read pair
    j - look - 1 (one role), or, with split roles, pair j - 2 ring (its weights lag its ring)."""
    return 2 * ring + 2 if split else 2 * look + 2


def _constexprs(d: int, Q: int, *, slabs: int, ring: int, warps: int, logit_warps: int, look: int, exchange: bool,
                math: bool, lregs: int, chains: int, split: bool, weigh_warps: int, xregs: int, box: int, store: str,
                stages: int, logits: bool, wreg: bool, gather: bool, pbufs: int, relaxed: bool,
                own: bool, rounds: int, lanes: int, defer: bool, vgather: bool, qonly: bool,
                gslabs: int, wlanes: int, pack: bool, turn: bool, vnative: bool, pipe2: bool,
                presum: bool, early: int, pring: int, evict: bool) -> dict[str, Any]:
    """The kernel's constexprs for :func:`phase1`'s launch options at width ``d`` and ``Q`` queries."""
    # _weights's EXCHANGE
    exchange_level = ((3 if rounds == 2 else 4 if vgather else 5 if vnative else 2) if exchange and gather
                      else int(exchange))
    return dict(S=slabs, W=d // slabs, CH=box, RING=ring, NBUF=_buffers(ring, look, split), NW=warps, LW=logit_warps,
                LOOK=look, EXCHANGE=exchange_level, MATH=math, LREGS=lregs, CHAINS=chains, SPLIT=split,
                XW=weigh_warps, XREGS=xregs, STORE=STORES.index(store), NSTAGE=stages, LOGITS=logits,
                WREG=2 if turn else int(wreg), PB=pbufs, RELAXED=relaxed, OWN=own, LANES=lanes, DEFER=defer,
                GS=gslabs or slabs, QG=Q if qonly else QP, WLANES=wlanes, PACK=2 if evict else int(pack), PIPE2=pipe2,
                PRESUM=presum, EARLY=early, PRING=pring)  # fmt: skip


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

    options = _options(kw)
    descs = _descriptors(torch.empty(8, 2, 64, dtype=torch.bfloat16), torch.empty(24, 2, 64), options["box"])
    ints = dict.fromkeys(("T", "D", "n", "Q", "TEAMS"), "i32")
    types = dict(desc=triton.runtime.jit.mangle_type(descs[0]), ndesc=triton.runtime.jit.mangle_type(descs[1]),
                 g3_ptr="*bf16", tickets="*i32", ctr="*i32", eps="fp32", **ints)  # fmt: skip
    fn = _ws_kernel
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "*fp32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name].startswith("*") or p.name in ("T", "D")}  # fmt: skip
    source = GluonASTSource(fn=fn, signature=sig, constexprs=_constexprs(7168, 24, **options), attrs=attrs)
    compiled = triton.compile(source,
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=options["warps"]))  # fmt: skip
    regs, stack = resource_usage(compiled.asm["cubin"])
    return f"{regs} registers (largest partition), {stack} B stack (spills), {compiled.metadata.shared} B shared"


def main(argv: list[str] | None = None) -> int:
    from attnres_gpu import phase1_experiment
    from gpu_timing import variant_row, write_variants

    started = phase1_experiment(__doc__, VARIANTS, _options({}), compile_usage, argv,
                                "the one-launch AttnRes experiment")
    if isinstance(started, int):
        return started
    chosen, T, out, log, copy_tbps, x, moved, ref = started
    d = 7168
    runs = {"ours (two launches)": partial(ours.phase1, x["stored"], x["w"], x["gamma"])}
    runs |= {name: partial(phase1, x["stored"], x["w"], x["gamma"], **kw) for name, kw in chosen.items()}
    rows = [variant_row(name, run, ref, moved, copy_tbps, "attnres one launch", log, T, options=chosen.get(name, {}))
            for name, run in runs.items()]  # fmt: skip
    write_variants(out, "attnres_one_launch", "Block AttnRes phase 1 in one launch (experiment)", T, d, copy_tbps, rows,
                   options=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

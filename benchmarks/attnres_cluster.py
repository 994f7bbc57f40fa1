"""Block AttnRes phase 1 in one launch of thread-block clusters on a Hopper GPU: an experiment.

    python benchmarks/attnres_cluster.py --out DIR [--variants VARIANT ...]
    python benchmarks/attnres_cluster.py --compile [--variants VARIANT ...]   # no GPU needed

The one-launch team form of ``benchmarks/attnres_one_launch.py`` (``pack14``: a team of slab
programs shares each token pair's width, each keeps its slab of ``w ⊙ γ`` in shared memory)
spends about 0.14 ms of its 2.03 on the exchange of the team's partial logits through global
memory (docs/gpu.md: without that gather it runs 1.89 ms). Here a team is a *cluster*: its
slab programs are co-scheduled on one GPC and exchange their partials through distributed
shared memory, so a pair's partials never leave the chip:

- each program pushes its pair's partial logits and squares (25 rows of 16 fp32) into slot
  ``pair % nbuf`` of every teammate's exchange buffer with ``st.async``, which counts the bytes
  on the receiver's ``landed`` barrier;
- each program's weights warps wait on their own ``landed`` barrier, sum the team's partials
  in slab order (the same sums as the global-memory gather), take the softmax and hand the
  packed weights to the writer; then they tell every teammate, on its ``free`` barrier, that
  the slot may be written again.

With ``rs`` the exchange is a reduce-scatter and an all-gather instead: slab ``c < 12`` owns
queries ``2c, 2c + 1``, receives only their partials and the squares (3 rows from each slab),
sums them in slab order, takes their softmax (and writes their ``m, Z``) and pushes the two
rows of weights to every teammate: an owner takes in 3 KB of partials and every program 1.5 KB
of weights per pair, instead of 25 KB, in two hops.

The loader, the partials' products and the writer are ``attnres_one_launch``'s. Triton 3.6
(the GPU machine's) has no cluster operations in Gluon, so the kernel is compiled for one CTA
and launched as clusters of ``slabs`` (its compiled kernel's ``num_ctas`` set before the first
launch, which Triton's launcher turns into the cluster dimension); the distributed shared
memory work is inline PTX on an exchange region placed after Triton's own shared memory (the
compiled ``shared`` size raised by the region's bytes). It prints our two-launch phase 1, the
global-memory ``pack14`` and every variant in the same process (do_bench medians; bytes moved
once against the copy bandwidth), each one's agreement with ours and the number of clusters
the GPU holds at once; ``--compile`` prints registers and shared memory without a GPU.
docs/gpu.md ("Teams as thread-block clusters") has what it measured on an H200: 7 clusters of
16 or 14 at once, whose writer alone runs at 79.8% of copy, and correct forms far slower.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import attnres_one_launch as ol
import torch
import triton
from gpu_timing import with_defaults
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from k3verify.attnres import kernels as ours
from k3verify.attnres.chunkwise import Stats

QP = gl.constexpr(32)  # queries padded to the products' tile
ROWS = gl.constexpr(25)  # rows a slab posts per pair: 24 queries' partial logits, then the 16 squares
BLOCK = gl.constexpr(25 * 16 * 4)  # bytes of one slab's post
OWNERS = gl.constexpr(12)  # rs: slabs that own two of the 24 queries each
DEFAULTS: dict[str, Any] = dict(slabs=16, ring=4, nbuf=2, chains=3, weigh_warps=4, lregs=168, xregs=128, box=64,
                                pbufs=2, evict=False, logits=True, own=False, rs=False)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "cluster16": {},
    "cluster16_ring3": dict(ring=3),
    "cluster16_nbuf1": dict(nbuf=1),
    "cluster16_evict": dict(evict=True),
    "cluster14": dict(slabs=14),  # pack14's slabs of 512 (a non-portable cluster size)
    # timing only (wrong values): the writer and the loader alone; each program exchanging with itself
    "cluster16_writer_only": dict(logits=False),
    "cluster16_own": dict(own=True),
    # reduce-scatter, then all-gather of the weights: two small hops instead of one large one
    "rs16": dict(rs=True, nbuf=4, xregs=152),
    "rs14": dict(rs=True, nbuf=4, slabs=14, xregs=152),
}

# Inline PTX on the exchange region. Every address operand is a byte offset from the start of
# the kernel's dynamic shared memory (``global_smem``, where Triton places its own buffers);
# ``mapa`` turns a local shared address into the same offset in another CTA of the cluster.
_PUSH = gl.constexpr("""{
.reg .u32 xb, xa, xm;
.reg .pred xp;
mov.u32 xb, global_smem;
add.u32 xa, xb, $4;
add.u32 xm, xb, $12;
mapa.shared::cluster.u32 xa, xa, $16;
mapa.shared::cluster.u32 xm, xm, $16;
setp.ne.u32 xp, $20, 0;
@xp st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [xa], {$8, $9, $10, $11}, [xm];
mov.u32 $0, 0;
mov.u32 $1, 0;
mov.u32 $2, 0;
mov.u32 $3, 0;
}""")
_PULL = gl.constexpr("""{
.reg .u32 xa;
.reg .pred xp;
mov.u32 xa, global_smem;
add.u32 xa, xa, $4;
setp.ne.u32 xp, $8, 0;
mov.f32 $0, 0f00000000;
mov.f32 $1, 0f00000000;
mov.f32 $2, 0f00000000;
mov.f32 $3, 0f00000000;
@xp ld.shared.v4.f32 {$0, $1, $2, $3}, [xa];
}""")


def _on_barrier(body: str) -> gl.constexpr:
    """Inline PTX run by one thread a warp (or as ``body`` says) on the barrier at byte ``$1``
    of the shared memory, with ``$2`` its argument: ``xm`` holds the barrier's address, ``xp``
    is a free predicate, ``$0`` a scratch register that ends as zero."""
    return gl.constexpr("{\n.reg .u32 xm;\n.reg .pred xp;\nmov.u32 xm, global_smem;\nadd.u32 xm, xm, $1;\n"
                        + body + "\nmov.u32 $0, 0;\n}")  # fmt: skip


_LANE0 = "mov.u32 $0, %laneid;\nsetp.eq.u32 xp, $0, 0;\n"
_EXPECT = _on_barrier(_LANE0 + "@xp mbarrier.arrive.expect_tx.shared::cta.b64 _, [xm], $2;")
_WAIT = _on_barrier("XWAIT_${:uid}:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 xp, [xm], $2;\n"
                    "@!xp bra XWAIT_${:uid};")  # fmt: skip
_ARRIVE = _on_barrier("mapa.shared::cluster.u32 xm, xm, $2;\n" + _LANE0
                      + "@xp mbarrier.arrive.release.cluster.shared::cluster.b64 _, [xm];")  # fmt: skip
_INIT = _on_barrier("mov.u32 $0, %tid.x;\nsetp.eq.u32 xp, $0, 0;\n@xp mbarrier.init.shared::cta.b64 [xm], $2;")
_PUSH_ARGS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 4 + ["f"] * 4 + ["r"] * 12))
_PULL_ARGS = gl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 8))
_FENCE_INIT = gl.constexpr("fence.mbarrier_init.release.cluster; mov.u32 $0, $1;")


@gluon.jit
def _lane_op(asm: gl.constexpr, lanes, offset, value):
    """Run ``asm`` once in every thread (a ``[32]`` tensor, one element a thread, in ``lanes``'s
    layout) on a barrier at byte ``offset`` with ``value`` (a count, a parity or a CTA rank);
    returns zeros, so that a later address can depend on it."""
    return gl.inline_asm_elementwise(asm, "=r,r,r", [lanes * 0 + offset, lanes * 0 + value], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _lanes(W: gl.constexpr):
    """``[32]`` lane indices, one a thread in a partition of ``W`` warps (each warp a copy)."""
    return gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [W], [0]))


@gluon.jit
def _post_cluster(ring, wsm, full, xoff, s, nk, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr,
                  RING: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, CHAINS: gl.constexpr,
                  OWN: gl.constexpr):
    """Partials warps: each pair's partial logits (queries 0–23) and squares (as row 24) of this
    slab, pushed into slot ``pair % NBUF`` of every teammate's exchange buffer (``st.async``,
    counted on the teammate's ``landed`` barrier), once every teammate has freed that slot.
    ``OWN``: into this program's own buffer only (no coupling between the team; timing only)."""
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LW, 1], [1, 0])
    q = gl.arange(0, QP, layout=gl.SliceLayout(1, EL))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, EL))
    lanes = _lanes(LW)
    bars = xoff + NBUF * S * BLOCK
    ok = ((q < ROWS)[:, None] & (c >= 0)[None, :]).to(gl.int32)
    for j in range(nk):
        slot = j % RING
        mbarrier.wait(full.index(slot), (j // RING) & 1)
        acc, ss = ol._partials(ring, wsm, slot, NCH, CH, LW, True, CHAINS)
        x = gl.convert_layout(acc, EL)
        x = gl.where((q == QP - 8)[:, None], gl.convert_layout(ss, gl.SliceLayout(0, EL))[None, :], x)
        b = j % NBUF
        if j >= NBUF:
            _lane_op(_WAIT, lanes, bars + 8 * (NBUF + b), (j // NBUF - 1) & 1)
        addr = xoff + (b * S + s) * BLOCK + (q * 64)[:, None] + (c * 4)[None, :]
        if OWN:
            gl.inline_asm_elementwise(_PUSH, _PUSH_ARGS, [addr, x, addr * 0 + bars + 8 * b, addr * 0 + s, ok],
                                      dtype=gl.int32, is_pure=False, pack=4)  # fmt: skip
        else:
            for p in gl.static_range(S):
                gl.inline_asm_elementwise(_PUSH, _PUSH_ARGS, [addr, x, addr * 0 + bars + 8 * b, addr * 0 + p, ok],
                                          dtype=gl.int32, is_pure=False, pack=4)  # fmt: skip


@gluon.jit
def _weigh_cluster(psm, pready, pfree, m_out, z_out, xoff, team, s, nk, T, D, n, Q, eps, TEAMS, S: gl.constexpr,
                   NBUF: gl.constexpr, XW: gl.constexpr, OWN: gl.constexpr):
    """Weights warps: pair ``kk``'s team partials from the exchange buffer once they have all
    landed, summed in slab order (logits in fp32, squares in fp64, as ``_gather``), the softmax
    (m, Z written by slab 0), the packed weights handed to the writer, and the slot freed in
    every teammate (but for the last ``NBUF`` pairs, which nobody waits for). ``OWN``: only this
    program's own post is waited for (the others' slots are read as they are; timing only)."""
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [XW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, EL))
    ar = gl.arange(0, 16, layout=gl.SliceLayout(0, EL))
    lanes = _lanes(XW)
    bars = xoff + NBUF * S * BLOCK
    ok = ((aq < ROWS)[:, None] & (ar >= 0)[None, :]).to(gl.int32)
    sq_row = (aq == QP - 8)[:, None] & (ar >= 0)[None, :]
    for kk in range(nk):
        b = kk % NBUF
        _lane_op(_EXPECT, lanes, bars + 8 * b, (1 if OWN else S) * BLOCK // XW)
        _lane_op(_WAIT, lanes, bars + 8 * b, (kk // NBUF) & 1)
        tot = gl.zeros([QP, 16], gl.float32, EL)
        sq = gl.zeros([QP, 16], gl.float64, EL)
        addr = xoff + (b * S) * BLOCK + (aq * 64)[:, None] + (ar * 4)[None, :]
        for p in gl.static_range(S):
            v = gl.inline_asm_elementwise(_PULL, _PULL_ARGS, [addr + p * BLOCK, ok],
                                          dtype=gl.float32, is_pure=False, pack=4)  # fmt: skip
            tot += gl.where(aq[:, None] < QP - 8, v, 0.0)
            sq += gl.where(sq_row, v.to(gl.float64), 0.0)
        sst = gl.sum(sq, axis=0)
        ol._bar()
        if kk + NBUF < nk:
            if OWN:
                _lane_op(_ARRIVE, lanes, bars + 8 * (NBUF + b), s)
            else:
                for p in gl.static_range(S):
                    _lane_op(_ARRIVE, lanes, bars + 8 * (NBUF + b), p)
        L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
        P = ol._softmax(L, aq, ar, n, m_out, z_out, 2 * (team + kk * TEAMS), T, Q, s == 0)
        ol._deliver(psm, pready, pfree, P, aq, ar, kk, XW, True)


@gluon.jit
def _push_rows(x, addr, bar, peer, ok):
    """``st.async`` of the 16-byte row pieces of ``x`` (``[32, 16]`` fp32, four columns a thread)
    where ``ok``, to byte ``addr`` of CTA ``peer``'s shared memory, counted on its barrier at
    byte ``bar``."""
    gl.inline_asm_elementwise(_PUSH, _PUSH_ARGS, [addr, x, addr * 0 + bar, addr * 0 + peer, ok], dtype=gl.int32,
                              is_pure=False, pack=4)  # fmt: skip


@gluon.jit
def _pull_rows(addr, ok):
    """``[32, 16]`` fp32 from byte ``addr`` of this CTA's shared memory where ``ok`` (else zero)."""
    return gl.inline_asm_elementwise(_PULL, _PULL_ARGS, [addr, ok], dtype=gl.float32, is_pure=False, pack=4)


@gluon.jit
def _post_rs(ring, wsm, full, xoff, s, nk, S: gl.constexpr, NCH: gl.constexpr, CH: gl.constexpr,
             RING: gl.constexpr, NBUF: gl.constexpr, LW: gl.constexpr, CHAINS: gl.constexpr):
    """Partials warps (``rs``): each pair's partial logits of queries ``2c, 2c + 1`` and the
    squares go to owner ``c`` only (``3 × 16`` fp32), once the owners have freed the slot."""
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LW, 1], [1, 0])
    q = gl.arange(0, QP, layout=gl.SliceLayout(1, EL))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, EL))
    lanes = _lanes(LW)
    a1, _a2, bars = _rs_regions(xoff, S, NBUF)
    own_rows = ((q < 2 * OWNERS)[:, None] & (c >= 0)[None, :]).to(gl.int32)
    sq_rows = ((q == 2 * OWNERS)[:, None] & (c >= 0)[None, :]).to(gl.int32)
    for j in range(nk):
        slot = j % RING
        mbarrier.wait(full.index(slot), (j // RING) & 1)
        acc, ss = ol._partials(ring, wsm, slot, NCH, CH, LW, True, CHAINS)
        x = gl.convert_layout(acc, EL)
        x = gl.where((q == 2 * OWNERS)[:, None], gl.convert_layout(ss, gl.SliceLayout(0, EL))[None, :], x)
        b = j % NBUF
        if j >= NBUF:
            _lane_op(_WAIT, lanes, bars + 8 * (NBUF + b), (j // NBUF - 1) & 1)
        base = a1 + (b * S + s) * 192 + (c * 4)[None, :]
        _push_rows(x, base + ((q % 2) * 64)[:, None], bars + 8 * b, (q // 2)[:, None] + c[None, :] * 0, own_rows)
        for o in gl.static_range(OWNERS):
            _push_rows(x, base + 128 + (q * 0)[:, None], bars + 8 * b, o, sq_rows)


@gluon.jit
def _rs_regions(xoff, S: gl.constexpr, NBUF: gl.constexpr):
    """Byte offsets of ``rs``'s exchange region: the owners' partials slots (``NBUF × S × 3``
    rows), the weights slots (``NBUF × 32`` rows), then the barriers: ``landed`` and ``free`` of
    the partials, then of the weights, ``NBUF`` each."""
    a2 = xoff + NBUF * S * 192
    return xoff, a2, a2 + NBUF * 32 * 64


@gluon.jit
def _own_pair(m_out, z_out, xoff, team, s, kk, nk, T, D, n, Q, eps, TEAMS, S: gl.constexpr, NBUF: gl.constexpr,
              XW: gl.constexpr):
    """Owner ``s``'s part of pair ``kk`` (``rs``): the team's partials of its two queries summed
    in slab order once landed, their softmax (and m, Z), the weights pushed into every
    teammate's weights slot, and the partials slot freed for the team's partials warps."""
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [XW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, EL))
    ar = gl.arange(0, 16, layout=gl.SliceLayout(0, EL))
    lanes = _lanes(XW)
    a1, a2, bars = _rs_regions(xoff, S, NBUF)
    b = kk % NBUF
    _lane_op(_EXPECT, lanes, bars + 8 * b, S * 192 // XW)
    _lane_op(_WAIT, lanes, bars + 8 * b, (kk // NBUF) & 1)
    three = ((aq < 3)[:, None] & (ar >= 0)[None, :]).to(gl.int32)
    tot = gl.zeros([QP, 16], gl.float32, EL)
    sq = gl.zeros([QP, 16], gl.float64, EL)
    addr = a1 + (b * S) * 192 + (aq * 64)[:, None] + (ar * 4)[None, :]
    for p in gl.static_range(S):
        v = _pull_rows(addr + p * 192, three)
        tot += gl.where((aq < 2)[:, None], v, 0.0)
        sq += gl.where((aq == 2)[:, None] & (ar >= 0)[None, :], v.to(gl.float64), 0.0)
    sst = gl.sum(sq, axis=0)
    ol._bar()
    if kk + NBUF < nk:
        for p in gl.static_range(S):
            _lane_op(_ARRIVE, lanes, bars + 8 * (NBUF + b), p)
    L = (tot.to(gl.float64) / gl.sqrt(sst[None, :] / D + eps)).to(gl.float32)
    query = gl.where(aq < 2, 2 * s + aq, 1 << 20)  # rows past the two owned: no query (m, Z not stored)
    P = ol._softmax(L, query, ar, n, m_out, z_out, 2 * (team + kk * TEAMS), T, Q, True)
    if kk >= NBUF:
        _lane_op(_WAIT, lanes, bars + 8 * (3 * NBUF + b), (kk // NBUF - 1) & 1)
    two = ((aq < 2)[:, None] & (ar >= 0)[None, :]).to(gl.int32)
    waddr = a2 + (b * 32 + 2 * s + aq * 1)[:, None] * 64 + (ar * 4)[None, :]
    for p in gl.static_range(S):
        _push_rows(P, waddr, bars + 8 * (2 * NBUF + b), p, two)


@gluon.jit
def _weigh_rs(psm, pready, pfree, m_out, z_out, xoff, team, s, nk, T, D, n, Q, eps, TEAMS, S: gl.constexpr,
              NBUF: gl.constexpr, XW: gl.constexpr):
    """Weights warps (``rs``): an owner's part of the next pair (:func:`_own_pair`) before this
    pair's weights are awaited, so that the two hops overlap; then this pair's weights from
    the weights slot, handed to the writer, and the slot freed for the owners."""
    EL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [XW, 1], [1, 0])
    aq = gl.arange(0, QP, layout=gl.SliceLayout(1, EL))
    ar = gl.arange(0, 16, layout=gl.SliceLayout(0, EL))
    lanes = _lanes(XW)
    _a1, a2, bars = _rs_regions(xoff, S, NBUF)
    real = ((aq < 2 * OWNERS)[:, None] & (ar >= 0)[None, :]).to(gl.int32)
    owner = s < OWNERS
    if owner and nk > 0:
        _own_pair(m_out, z_out, xoff, team, s, 0, nk, T, D, n, Q, eps, TEAMS, S, NBUF, XW)
    for kk in range(nk):
        if owner and kk + 1 < nk:
            _own_pair(m_out, z_out, xoff, team, s, kk + 1, nk, T, D, n, Q, eps, TEAMS, S, NBUF, XW)
        b = kk % NBUF
        _lane_op(_EXPECT, lanes, bars + 8 * (2 * NBUF + b), OWNERS * 128 // XW)
        _lane_op(_WAIT, lanes, bars + 8 * (2 * NBUF + b), (kk // NBUF) & 1)
        P = _pull_rows(a2 + (b * 32 + aq)[:, None] * 64 + (ar * 4)[None, :], real)
        ol._bar()
        if kk + NBUF < nk:
            for o in gl.static_range(OWNERS):
                _lane_op(_ARRIVE, lanes, bars + 8 * (3 * NBUF + b), o)
        ol._deliver(psm, pready, pfree, P, aq, ar, kk, XW, True)


@gluon.jit
def _cluster_kernel(desc, g3_ptr, m_out, z_out, n_out, ready, xoff, T, D, n, Q, eps, TEAMS, S: gl.constexpr,
                    W: gl.constexpr, CH: gl.constexpr, RING: gl.constexpr, NBUF: gl.constexpr, NW: gl.constexpr,
                    LW: gl.constexpr, XW: gl.constexpr, LREGS: gl.constexpr, XREGS: gl.constexpr,
                    CHAINS: gl.constexpr, PB: gl.constexpr, EVICT: gl.constexpr, LOGITS: gl.constexpr,
                    OWN: gl.constexpr, RS: gl.constexpr):
    """One CTA per (cluster, slab): its slab of ``w ⊙ γ`` into shared memory, the exchange
    barriers initialised and the cluster's CTAs met (a count in global memory: a cluster
    barrier would need the idle partitions' threads too), then the four partitions. Without
    ``LOGITS`` the partials and weights warps have no pairs (the writer alone; timing only)."""
    R: gl.constexpr = 16
    NCH: gl.constexpr = W // CH
    WLD: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    SX: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * CH), element_bitwidth=16, rank=2)
    SP: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid = gl.program_id(0)
    team = pid // S
    s = pid % S  # the CTA's rank in its cluster (clusters of S consecutive CTAs)
    lo = s * W
    nk = (T // 2 - team + TEAMS - 1) // TEAMS
    nlog = nk if LOGITS else 0

    ring = gl.allocate_shared_memory(gl.bfloat16, [RING * NCH, R, CH], SX)
    wsm = gl.allocate_shared_memory(gl.bfloat16, [3 * NCH, QP, CH], SX)
    psm = gl.allocate_shared_memory(gl.bfloat16, [PB * 6 + 3, QP, R], SP)
    full, empty, pready, pfree = ol._pipeline_barriers(RING, PB)
    wq = gl.arange(0, QP, layout=gl.SliceLayout(1, WLD))
    wc = gl.arange(0, CH, layout=gl.SliceLayout(0, WLD))
    for j in gl.static_range(3):
        for c in range(NCH):
            wsm.index(j * NCH + c).store(gl.load(g3_ptr + (j * QP + wq[:, None]) * D + lo + c * CH + wc[None, :]))
    lanes = _lanes(NW)
    if RS:
        _a1, _a2, bars = _rs_regions(xoff, S, NBUF)
        for b in gl.static_range(NBUF):
            _lane_op(_INIT, lanes, bars + 8 * b, XW)  # partials landed: the owner's weights warps
            _lane_op(_INIT, lanes, bars + 8 * (NBUF + b), OWNERS * XW)  # partials freed: every owner
            _lane_op(_INIT, lanes, bars + 8 * (2 * NBUF + b), XW)  # weights landed
            _lane_op(_INIT, lanes, bars + 8 * (3 * NBUF + b), S * XW)  # weights freed: every teammate
    else:
        bars = xoff + NBUF * S * BLOCK
        for b in gl.static_range(NBUF):
            _lane_op(_INIT, lanes, bars + 8 * b, XW)  # landed: each weights warp's expect
            _lane_op(_INIT, lanes, bars + 8 * (NBUF + b), (1 if OWN else S) * XW)  # free: the teammates' warps
    gl.inline_asm_elementwise(_FENCE_INIT, "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)
    ol._bar()
    gl.atomic_add(ready + team, 1, sem="release")
    ol._wait(ready + team, S, False)

    if RS:
        gl.warp_specialize([
            (ol._writer_packed, (ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH,
                                 CH, RING, NW, LOGITS, EVICT)),
            (ol._loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
            (_post_rs, (ring, wsm, full, xoff, s, nlog, S, NCH, CH, RING, NBUF, LW, CHAINS)),
            (_weigh_rs, (psm, pready, pfree, m_out, z_out, xoff, team, s, nlog, T, D, n, Q, eps, TEAMS, S, NBUF,
                         XW)),
        ], [1, LW, XW], [24, LREGS, XREGS])
        return
    gl.warp_specialize([
        (ol._writer_packed, (ring, psm, full, empty, pready, pfree, n_out, team, lo, nk, T, D, Q, TEAMS, NCH, CH,
                             RING, NW, LOGITS, EVICT)),
        (ol._loader, (desc, ring, full, empty, team, lo, nk, TEAMS, D, NCH, CH, RING)),
        (_post_cluster, (ring, wsm, full, xoff, s, nlog, S, NCH, CH, RING, NBUF, LW, CHAINS, OWN)),
        (_weigh_cluster, (psm, pready, pfree, m_out, z_out, xoff, team, s, nlog, T, D, n, Q, eps, TEAMS, S, NBUF, XW,
                          OWN)),
    ], [1, LW, XW], [24, LREGS, XREGS])


def exchange_bytes(slabs: int, nbuf: int, rs: bool = False) -> int:
    """Shared memory of the exchange region: ``nbuf`` slots of every slab's post, then the
    ``landed`` and ``free`` barriers of each slot (``rs``: the owners' partials slots and the
    weights slots, :func:`_rs_regions`)."""
    if rs:
        return nbuf * (slabs * 192 + 32 * 64) + 32 * nbuf
    return nbuf * slabs * BLOCK.value + 16 * nbuf


def _constexprs(d: int, o: dict[str, Any]) -> dict[str, Any]:
    return dict(S=o["slabs"], W=d // o["slabs"], CH=o["box"], RING=o["ring"], NBUF=o["nbuf"], NW=4, LW=4,
                XW=o["weigh_warps"], LREGS=o["lregs"], XREGS=o["xregs"], CHAINS=o["chains"], PB=o["pbufs"],
                EVICT=o["evict"], LOGITS=o["logits"], OWN=o["own"], RS=o["rs"])  # fmt: skip


_LAUNCHES: dict[tuple, Any] = {}


def _clustered(args: tuple, constexprs: dict[str, Any], slabs: int, nbuf: int, rs: bool) -> tuple[Any, int, int]:
    """The kernel compiled for these arguments' types, set to launch as clusters of ``slabs``
    CTAs with the exchange region after Triton's shared memory; that region's offset; and how
    many such clusters the GPU holds at once."""
    key = tuple(sorted(constexprs.items()))
    if key not in _LAUNCHES:
        compiled = _cluster_kernel.warmup(*args, **constexprs, num_warps=4, grid=(1,))
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        xoff = -(-compiled.metadata.shared // 128) * 128
        meta = compiled.metadata._replace(shared=xoff + exchange_bytes(slabs, nbuf, rs), num_ctas=slabs)
        compiled.metadata = meta
        compiled.packed_metadata = (meta.num_warps, meta.num_ctas, meta.shared)
        compiled._init_handles()
        if slabs > 8:  # Triton's launcher allows a non-portable size for 16 CTAs only
            _non_portable(compiled)
        _LAUNCHES[key] = (compiled, xoff, max_clusters(compiled, slabs))
    return _LAUNCHES[key]


def _non_portable(compiled: Any) -> None:
    """Allow ``compiled`` clusters of more than 8 CTAs (Hopper holds up to 16)."""
    from cuda.bindings import driver as cu

    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    (err,) = cu.cuFuncSetAttribute(cu.CUfunction(compiled.function), attr, 1)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"clusters of more than 8 CTAs refused: {err}")


def phase1(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = ours.RMS_NORM_EPS,
           teams: int | None = None, **options: Any) -> Stats:
    """Phase-1 statistics of ``w, gamma:[Q, d]`` (Q <= 24) over ``stored:[n, T, d]`` (bf16,
    contiguous, n <= 8, T even) in one launch of ``teams`` clusters: ``m, Z:[Q, T]``,
    ``N:[Q, T, d]``. ``options`` over :data:`DEFAULTS`."""
    o = with_defaults(DEFAULTS, options)
    n, T, d = stored.shape
    Q = w.shape[0]
    S = o["slabs"]
    if o["rs"] and (o["nbuf"] < 2 or S < OWNERS.value or o["own"]):
        raise ValueError("rs needs nbuf >= 2 (an owner's next pair runs before this pair's weights), at least "
                         f"{OWNERS.value} slabs, and no own")  # fmt: skip
    if d % S or (d // S) % o["box"] or n > 8 or Q > 24 or T % 2 or not stored.is_contiguous():
        raise ValueError(f"unsupported: stored {list(stored.shape)} (contiguous, n <= 8, T even, d a multiple of "
                         f"{S} x {o['box']}), {Q} queries (at most 24)")  # fmt: skip
    dev = stored.device
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty(Q, T, dtype=torch.float32, device=dev)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    g3 = ours._split_bf16(ours._queries(w, gamma, d, dev, QP.value).T.contiguous()).contiguous()  # [3, QP, d]
    desc, _ = ol._descriptors(stored, N, o["box"])
    constexprs = _constexprs(d, o)
    ready = torch.zeros(torch.cuda.get_device_properties(dev).multi_processor_count, dtype=torch.int32, device=dev)
    args = (desc, g3, m, Z, N, ready, 128, T, d, n, Q, float(eps), 3)  # 3: an int Triton does not specialise
    compiled, xoff, at_once = _clustered(args, constexprs, S, o["nbuf"], o["rs"])
    # as many clusters as are resident at once (every GPC holds one or two), or one a 16 SMs
    teams = teams or (at_once if at_once > 0 else torch.cuda.get_device_properties(dev).multi_processor_count // S)
    ready = ready[:teams]
    compiled[(teams, 1, 1)](desc, g3, m, Z, N, ready, xoff, T, d, n, Q, float(eps), teams, *constexprs.values())
    return Stats(m, Z, N)


def max_clusters(compiled: Any, slabs: int) -> int:
    """How many clusters of ``slabs`` CTAs of ``compiled`` the GPU holds at once (negative: the
    driver's error)."""
    from cuda.bindings import driver as cu

    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = slabs * 64, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 32 * compiled.metadata.num_warps, 1, 1
    cfg.sharedMemBytes = compiled.metadata.shared
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = slabs, 1, 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    try:
        err, count = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(compiled.function), cfg)
    except Exception as exc:  # an occupancy query the driver bindings refuse: say so, launch by SM count
        print(f"cuOccupancyMaxActiveClusters: {type(exc).__name__}: {exc}", file=sys.stderr)
        return -1
    return int(count) if err == cu.CUresult.CUDA_SUCCESS else -int(err)


def compile_usage(kw: dict[str, Any], arch: int = 90) -> str:
    """Registers and shared memory of a variant compiled for ``sm_<arch>`` (no GPU needed)."""
    from kernel_compile import resource_usage
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    o = with_defaults(DEFAULTS, kw)
    desc, _ = ol._descriptors(torch.empty(8, 2, 64, dtype=torch.bfloat16), torch.empty(24, 2, 64), o["box"])
    types = dict(desc=triton.runtime.jit.mangle_type(desc), g3_ptr="*bf16", ready="*i32", eps="fp32",
                 **dict.fromkeys(("xoff", "T", "D", "n", "Q", "TEAMS"), "i32"))  # fmt: skip
    fn = _cluster_kernel
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "*fp32") for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name].startswith("*") or p.name in ("T", "D", "xoff")}  # fmt: skip
    source = GluonASTSource(fn=fn, signature=sig, constexprs=_constexprs(7168, o), attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    regs, stack = resource_usage(compiled.asm["cubin"])
    xoff = -(-compiled.metadata.shared // 128) * 128
    total = xoff + exchange_bytes(o["slabs"], o["nbuf"], o["rs"])
    return (f"{regs} registers (largest partition), {stack} B stack (spills), {compiled.metadata.shared} B shared "
            f"+ exchange = {total} B")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from attnres_gpu import phase1_experiment
    from gpu_timing import variant_row, write_variants

    started = phase1_experiment(__doc__, VARIANTS, DEFAULTS, compile_usage, argv, "the clustered AttnRes experiment")
    if isinstance(started, int):
        return started
    chosen, T, out, log, copy_tbps, x, moved, ref = started
    d = 7168
    runs = {"ours (two launches)": partial(ours.phase1, x["stored"], x["w"], x["gamma"]),
            "pack14 (global memory)": partial(ol.phase1, x["stored"], x["w"], x["gamma"], **ol.VARIANTS["pack14"])}
    runs |= {name: partial(phase1, x["stored"], x["w"], x["gamma"], **kw) for name, kw in chosen.items()}
    rows = []
    for name, run in runs.items():
        rows.append(variant_row(name, run, ref, moved, copy_tbps, "attnres clusters", log, T,
                                options=chosen.get(name, {})))  # fmt: skip
        if name in chosen and "error" not in rows[-1]:
            key = tuple(sorted(_constexprs(d, with_defaults(DEFAULTS, chosen[name])).items()))
            rows[-1]["clusters_at_once"] = _LAUNCHES[key][2]
            log(f"{name}: {rows[-1]['clusters_at_once']} clusters at once")
    write_variants(out, "attnres_cluster", "Block AttnRes phase 1 in one launch of clusters (experiment)", T, d,
                   copy_tbps, rows, options=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block AttnRes phase 1 (bf16, CUDA): the two launches' settings, eviction hints, launch order
and token segments, timed side by side (an experiment).

    python benchmarks/attnres_phase1_tune.py --out DIR [--variants VARIANT ...]

Our phase 1 (:func:`k3verify.attnres.kernels.phase1`) is a logits launch and an accumulate
launch that both read the stored blocks. Here the logits launch may split the width into
``slices`` (partial products and squares, summed in fixed order by the accumulate), and the
tokens may go in segments of ``seg`` tokens, each segment's logits launch followed by its
accumulate launch, so that the second read of a segment's blocks can come from L2 (``seg``
tokens of 8 blocks at d = 7168 is ``seg`` × 115 KB). Options, as ``key=value`` joined by commas:

- logits launch: ``rows`` (rows of a tile: blocks × tokens), ``width``, ``warps``, ``stages``,
  ``slices``, ``hint`` (1: its loads ``evict_last``);
- accumulate launch: ``asplit`` (programs a token), ``awidth``, ``awarps``, ``astages``,
  ``store`` (the ``N`` stores' eviction policy, or a cache modifier such as ``.cs``), ``load``
  (the block loads' eviction policy);
- ``pdl``: the accumulate launched as a programmatic dependent of the logits launch (it waits in
  the kernel, so its launch overlaps the logits launch's tail);
- ``prep``: what the timed call includes of ``w ⊙ γ``'s three bf16 parts: 0 nothing (made
  once), 1 main's torch operations, 2 one Triton launch;
- ``chain``: the logits' tensor-core sums carried across width steps (1) or fresh per step and
  added in fp32 (0); ``squares``: 1 each step's squares summed in fp32 and the steps in fp64,
  2 each column's squares summed in fp32 over the steps and the columns in fp64 at the end, 0
  none (timing only);
- ``graph``: the call's launches captured in one CUDA graph (for many segments).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl
from gpu_timing import chosen_variants, experiment_arguments, with_defaults

from k3verify.attnres import kernels as ours
from k3verify.attnres.chunkwise import Stats

# Our phase 1's settings (the accumulate's width, split and stages are ours.ACC_*).
DEFAULTS = dict(seg=8192, slices=1, hint=0, warps=8, stages=4, rows=128, width=64, asplit=4, awidth=256,
                astages=3, awarps=4, store=".cs", load="", pdl=1, prep=2, graph=0, chain=0, squares=2)
# Before the streaming stores, the dependent launch, the one-launch parts and the squares by column;
# ours; without the squares (timing only); 32 segments of 256 tokens.
VARIANTS = ["store=,pdl=0,prep=1,squares=1", "squares=2", "squares=0", "seg=256,slices=8,graph=1,pdl=0"]


@triton.jit
def _slice_logits_kernel(v, g3, pdot, pss, t0, T, D, n, Q, SEG, BT: tl.constexpr, BD: tl.constexpr,
                         QP: tl.constexpr, NP: tl.constexpr, SPAN: tl.constexpr, STAGES: tl.constexpr,
                         EV: tl.constexpr, PDL: tl.constexpr, CHAIN: tl.constexpr,
                         SQUARES: tl.constexpr):  # fmt: skip
    """Partial products ``pdot[k, s, i, q] = v[i, t0 + s, slice k] · (w ⊙ γ)[slice k, q]`` (three
    exact bf16 parts, fp32 sums) and squares ``pss[k, s, i]`` (fp64) for a tile of ``BT``
    tokens and all ``n`` blocks, slice ``k = program_id(1)`` of ``SPAN`` columns."""
    r = tl.arange(0, NP * BT)
    src = r // BT
    s = tl.program_id(0) * BT + r % BT
    t = t0 + s
    ok = (src < n) & (t < T) & (s < SEG)
    q = tl.arange(0, QP)
    k = tl.program_id(1)
    rows = v + (src.to(tl.int64) * T + t) * D
    ss = tl.zeros([NP * BT], dtype=tl.float64)
    sq = tl.zeros([NP * BT, BD], dtype=tl.float32)
    acc = tl.zeros([NP * BT, QP], dtype=tl.float32)
    for d0 in tl.range(k * SPAN, k * SPAN + SPAN, BD, num_stages=STAGES):
        dd = d0 + tl.arange(0, BD)
        x = tl.load(rows[:, None] + dd[None, :], mask=ok[:, None] & (dd < D)[None, :], other=0.0,
                    eviction_policy=EV)  # fmt: skip
        if SQUARES == 1:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1).to(tl.float64)
        elif SQUARES == 2:  # each column's squares summed in fp32, the columns once at the end
            xf = x.to(tl.float32)
            sq += xf * xf
        parts = g3 + dd[:, None] * QP + q[None, :]
        if CHAIN:  # the tensor cores accumulate across steps: no wait for each step's sums
            acc = tl.dot(x, tl.load(parts, mask=(dd < D)[:, None], other=0.0), acc)
            acc = tl.dot(x, tl.load(parts + D * QP, mask=(dd < D)[:, None], other=0.0), acc)
            acc = tl.dot(x, tl.load(parts + 2 * D * QP, mask=(dd < D)[:, None], other=0.0), acc)
        else:
            step = tl.dot(x, tl.load(parts, mask=(dd < D)[:, None], other=0.0))
            step += tl.dot(x, tl.load(parts + D * QP, mask=(dd < D)[:, None], other=0.0))
            step += tl.dot(x, tl.load(parts + 2 * D * QP, mask=(dd < D)[:, None], other=0.0))
            acc += step
    if SQUARES == 2:
        ss = tl.sum(sq.to(tl.float64), axis=1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    cell = (k * SEG + s) * n + src
    tl.store(pdot + cell[:, None] * QP + q[None, :], acc, mask=ok[:, None] & (q < Q)[None, :])
    tl.store(pss + cell, ss, mask=ok)


@triton.jit
def _segment_accumulate_kernel(v, pdot, pss, m_out, z_out, n_out, t0, T, D, n, Q, SEG, eps,
                               SLICES: tl.constexpr, SPLIT: tl.constexpr, BD: tl.constexpr, QP: tl.constexpr,
                               NP: tl.constexpr, STAGES: tl.constexpr, LOAD_EV: tl.constexpr,
                               STORE_EV: tl.constexpr, STORE_CM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Main's accumulate for token ``t0 + program_id(0) // SPLIT``, its logits summed from the
    ``SLICES`` partials in fixed order (products in fp32, squares in fp64)."""
    s = tl.program_id(0) // SPLIT
    t = (t0 + s).to(tl.int64)
    qq = tl.arange(0, QP)
    src = tl.arange(0, NP)
    dot = tl.zeros([QP, NP], dtype=tl.float32)
    ss = tl.zeros([NP], dtype=tl.float64)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k in tl.static_range(SLICES):
        cell = (k * SEG + s) * n + src
        dot += tl.load(pdot + cell[None, :] * QP + qq[:, None], mask=(src < n)[None, :] & (qq < Q)[:, None],
                       other=0.0)  # fmt: skip
        ss += tl.load(pss + cell, mask=src < n, other=1.0)
    L = ours._normalised(dot, ss[None, :], D, eps)
    L = tl.where((src < n)[None, :], L, float("-inf"))
    ours._write_token(v, D * T, D, L, m_out, z_out, n_out, t, tl.program_id(0) % SPLIT, T, D, n, Q, SPLIT, BD, QP, NP,
                      1, STAGES, LOAD_EV, STORE_EV, STORE_CM)  # fmt: skip


def options(kw: dict[str, Any]) -> dict[str, Any]:
    """The defaults overridden by ``kw`` (:func:`gpu_timing.with_defaults`)."""
    return with_defaults(DEFAULTS, kw)


def prepare(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = ours.RMS_NORM_EPS,
            **kw: Any):
    """A function that writes phase 1's ``Stats`` of ``stored:[n, T, d]`` (bf16) for queries
    ``w, gamma:[Q, d]`` (fp32) into buffers allocated here, and those ``Stats``."""
    o = options(kw)
    n, T, d = stored.shape
    Q = w.shape[0]
    QP, NP = ours.block(Q), ours.block(n)
    rows_np = triton.next_power_of_2(n)
    BT = max(o["rows"] // rows_np, 1)
    seg, slices, width = min(o["seg"], T), o["slices"], o["width"]
    span = triton.cdiv(triton.cdiv(d, slices), width) * width
    dev = stored.device
    g3 = ours._split_bf16(ours._queries(w, gamma, d, dev, QP))
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty_like(m)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    pdot = torch.empty(slices, seg, n, QP, dtype=torch.float32, device=dev)
    pss = torch.empty(slices, seg, n, dtype=torch.float64, device=dev)
    store_ev, store_cm = (o["store"], "") if not o["store"].startswith(".") else ("", o["store"])
    split = min(o["asplit"], triton.cdiv(d, o["awidth"]))

    def run() -> None:
        parts = g3
        if o["prep"] == 1:
            parts = ours._split_bf16(ours._queries(w, gamma, d, dev, QP))
        elif o["prep"] == 2:
            parts = ours._queries(w, gamma, d, dev, QP, split=True)
        for t0 in range(0, T, seg):
            count = min(seg, T - t0)
            _slice_logits_kernel[(triton.cdiv(count, BT), slices)](
                stored, parts, pdot, pss, t0, T, d, n, Q, seg, BT=BT, BD=width, QP=QP, NP=rows_np, SPAN=span,
                STAGES=o["stages"], EV="evict_last" if o["hint"] else "", PDL=bool(o["pdl"]),
                CHAIN=bool(o["chain"]), SQUARES=o["squares"],
                num_warps=o["warps"], num_stages=o["stages"])  # fmt: skip
            _segment_accumulate_kernel[(count * split,)](
                stored, pdot, pss, m, Z, N, t0, T, d, n, Q, seg, float(eps), SLICES=slices, SPLIT=split,
                BD=o["awidth"], QP=QP, NP=NP, STAGES=o["astages"], LOAD_EV=o["load"], STORE_EV=store_ev,
                STORE_CM=store_cm, PDL=bool(o["pdl"]), num_warps=o["awarps"], launch_pdl=bool(o["pdl"]))  # fmt: skip

    run()
    if not o["graph"]:
        return run, Stats(m, Z, N)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay, Stats(m, Z, N)


@triton.jit
def _read_kernel(x, out, numel, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Sum of ``x`` (bf16) by a persistent grid: the read-only bandwidth, nothing else."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK, num_stages=STAGES):
        off = start + tl.arange(0, BLOCK)
        acc += tl.load(x + off, mask=off < numel, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


def main(argv: list[str] | None = None) -> int:
    parser = experiment_arguments(__doc__, VARIANTS)
    args = parser.parse_args(argv)
    chosen = chosen_variants(parser, args.variants, DEFAULTS)
    import attnres_gpu
    import gpu_timing
    from gpu_timing import agreement, copy_bandwidth, launch_split, ms, write_variants

    begun = gpu_timing.start(args.out, "the AttnRes phase-1 settings experiment")
    if begun is None:
        return 2
    out, log = begun
    copy_tbps = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    log(f"copy bandwidth {copy_tbps:.2f} TB/s; L2 {props.L2_cache_size / 2**20:.0f} MiB, "
        f"{props.multi_processor_count} SMs")  # fmt: skip
    T, d = args.tokens, 7168
    x = attnres_gpu._block_inputs(T, d)
    flat = x["stored"].view(-1)
    sums = torch.empty(props.multi_processor_count * 8, dtype=torch.float32, device="cuda")
    for block_, stages in ((4096, 3), (8192, 4), (2048, 4)):
        read = partial(_read_kernel[(sums.numel(),)], flat, sums, flat.numel(), BLOCK=block_, STAGES=stages,
                       num_warps=8)  # fmt: skip
        t = ms(read)
        log(f"read-only: {flat.numel() * 2 / 1e9:.2f} GB in {t:.4f} ms, {flat.numel() * 2 / t / 1e9:.2f} TB/s "
            f"(blocks of {block_}, {stages} stages)")  # fmt: skip
    moved = attnres_gpu.STORED * T * d * 2 + attnres_gpu.QUERIES * T * d * 4
    ref = ours.phase1(x["stored"], x["w"], x["gamma"])
    rows = []
    t = ms(partial(ours.phase1, x["stored"], x["w"], x["gamma"]), "attnres phase 1 settings", "ours", T=T)
    rows.append(dict(variant="ours (two launches)", ms=t, fraction_of_copy=moved / (t * 1e-3) / 1e12 / copy_tbps))
    log(f"ours: {t:.4f} ms, {100 * rows[-1]['fraction_of_copy']:.1f}% of copy")
    for name, kw in chosen.items():
        try:
            run, got = prepare(x["stored"], x["w"], x["gamma"], **kw)
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile or run is a result; go on
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{name}: {rows[-1]['error']}")
            continue
        agree = agreement(got, ref)
        t = ms(run, "attnres phase 1 settings", name, T=T)
        frac = moved / (t * 1e-3) / 1e12 / copy_tbps
        split = launch_split(run, repeats=3)
        rows.append(dict(variant=name, options=options(kw), ms=t, fraction_of_copy=frac, agreement=agree,
                         split=split))  # fmt: skip
        log(f"{name}: {t:.4f} ms, {100 * frac:.1f}% of copy; max |dm| {agree['m']:.1e}, dZ {agree['Z']:.1e}, "
            f"dN {agree['N']:.1e}; {split}")
        del got, run
        torch.cuda.empty_cache()
    write_variants(out, "attnres_phase1_tune", "Block AttnRes phase 1: settings of the two launches (experiment)", T, d,
                   copy_tbps, rows, options=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block AttnRes phase 1 (bf16, CUDA) in one launch of ticketed work items: width-slab logits
items a few token groups ahead of the accumulate items that re-read the same blocks (an
experiment).

    python benchmarks/attnres_ticketed.py --out DIR [--variants VARIANT ...] [--compile]

Main's phase 1 reads every stored block twice from memory: once in its logits launch, once in
its accumulate launch. Here one launch does both. Each program takes a ticket when it starts
(an atomic counter, not its program id, so that every lower ticket is held by a program that is
running or done), and the ticket names its work item. Tickets come in rounds; round ``r`` holds
the ``slabs`` logits items of token group ``r`` (partial products of one width slab of the
group's blocks with the three bf16 parts of ``w ⊙ γ``, and partial squares) and then the
accumulate items of group ``r - lag`` (main's per-token work, :func:`kernels._write_token`).
An accumulate item waits for its group's logits (release/acquire counters); it only ever waits
for lower tickets and a logits item never waits, so no program waits on one that cannot run.
The second read of a group's blocks comes ``lag`` groups after the first, which is meant to
find them in L2.

What it measured on the H200 (81% of copy for its memory pattern with the second read from
L2, 74% at best with the products): docs/gpu.md, "One launch of ticketed items".

The logits are summed over the slabs in fixed order (fp32 products, fp64 squares): the same
rounding class as main, not its order, so the agreement with main is reported, not asserted
bitwise. Options, as ``key=value`` joined by commas:

- ``tokens`` (a group), ``slabs`` (width slabs of the logits), ``lag`` (groups between a
  group's logits items and its accumulate items), ``warps``;
- ``lwidth``, ``lstages``: the logits items' width step and pipeline stages; ``lev``: their
  block loads' eviction policy (``evict_last`` keeps them for the second read);
- ``final``: 1 the last logits item of a group sums the slabs and writes the group's logits,
  which the accumulate items read (a ring of ``ring`` groups of partials); 0 every accumulate
  item sums the slabs' partials of its token itself (partials for every group);
- ``asplit``, ``awidth``, ``astages``, ``aev``, ``store``: the accumulate items' programs a
  token, width step, stages, block loads' eviction policy and ``N`` stores' cache modifier or
  eviction policy (main's: 4, 256, 3, none, ``.cs``);
- ``maxnreg``: a register limit per thread (0: the compiler's choice), so that more programs fit
  on an SM;
- ``persist``: MiB of L2 set aside for persisting lines (``cudaLimitPersistingL2CacheSize``;
  0: none), which the ``evict_last`` loads of the logits items may then hold;
- ``pattern`` (timing only): 1 the memory pattern without products or softmax (logits items
  read their slab and post; accumulate items write their tile of the blocks' sum); 2 the
  logits items' products kept, the accumulate items as 1; 3 the accumulate items' work kept
  (partials read, softmax, products), the logits items as 1.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if "--compile" in sys.argv:  # compile for the GPU target, not the interpreter (set before Triton loads)
    os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
import triton.language as tl
from gpu_timing import chosen_variants, experiment_arguments, with_defaults

from k3verify.attnres import kernels as ours
from k3verify.attnres.chunkwise import Stats

DEFAULTS = dict(tokens=16, slabs=14, lag=8, warps=4, lwidth=64, lstages=3, lev="evict_last", final=1, ring=32,
                asplit=4, awidth=256, astages=3, aev="", store=".cs", pattern=0, maxnreg=0,
                persist=0)
# Fewest registers that fit three programs an SM (tokens=8, maxnreg=160: no spills) at two
# lags; the memory pattern alone at a long and a short lag; persisting L2 lines set aside.
VARIANTS = ["tokens=8,maxnreg=160,lag=16", "tokens=8,maxnreg=160,lag=4", "pattern=1,tokens=8,lag=16",
            "pattern=1,tokens=8,lag=2", "tokens=8,maxnreg=160,lag=16,persist=40"]


@triton.jit
def _wait_at_least(ptr, target):
    """Spin until the counter at ``ptr`` reaches ``target`` (acquire: what was released before
    each increment is visible after)."""
    seen = tl.atomic_add(ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _slab_item(v, g3, pdot, pss, ell, cnt, g, k, T, D, n, Q, eps, G, GT: tl.constexpr, NPR: tl.constexpr,
               SLABS: tl.constexpr, SPAN: tl.constexpr, BD: tl.constexpr, QP: tl.constexpr, STAGES: tl.constexpr,
               EV: tl.constexpr, FINAL: tl.constexpr, RING: tl.constexpr, PATTERN: tl.constexpr):  # fmt: skip
    """Slab ``k`` of group ``g``: partial products ``[NPR·GT, QP]`` and squares of the group's
    blocks over the slab's columns, posted to ``cnt[g]``; the group's last slab (``FINAL``)
    sums all slabs in order and posts the group's logits ``ell[t, i, q]`` to ``cnt[G + g]``."""
    r = tl.arange(0, NPR * GT)
    src = r // GT
    t = g * GT + r % GT
    ok = (src < n) & (t < T)
    q = tl.arange(0, QP)
    slot = g % RING if FINAL else g
    if FINAL:
        if g >= RING:  # the slot's previous group has summed its partials
            _wait_at_least(cnt + G + g - RING, 1)
    rows = v + (src.to(tl.int64) * T + t) * D
    sq = tl.zeros([NPR * GT, BD], dtype=tl.float32)
    acc = tl.zeros([NPR * GT, QP], dtype=tl.float32)
    for d0 in tl.range(k * SPAN, tl.minimum(k * SPAN + SPAN, D), BD, num_stages=STAGES):
        dd = d0 + tl.arange(0, BD)
        x = tl.load(rows[:, None] + dd[None, :], mask=ok[:, None] & (dd < D)[None, :], other=0.0, eviction_policy=EV)
        xf = x.to(tl.float32)
        sq += xf * xf
        if PATTERN != 1 and PATTERN != 3:
            parts = g3 + dd[:, None] * QP + q[None, :]
            step = tl.dot(x, tl.load(parts, mask=(dd < D)[:, None], other=0.0))
            step += tl.dot(x, tl.load(parts + D * QP, mask=(dd < D)[:, None], other=0.0))
            step += tl.dot(x, tl.load(parts + 2 * D * QP, mask=(dd < D)[:, None], other=0.0))
            acc += step
    ss = tl.sum(sq.to(tl.float64), axis=1)
    cell = (slot * SLABS + k) * (NPR * GT) + r
    tl.store(pdot + cell[:, None] * QP + q[None, :], acc)
    tl.store(pss + cell, ss)
    tl.debug_barrier()  # every thread's partials before the post
    done = tl.atomic_add(cnt + g, 1, sem="acq_rel")
    if FINAL:
        if done == SLABS - 1:
            dot = tl.zeros([NPR * GT, QP], dtype=tl.float32)
            tot = tl.zeros([NPR * GT], dtype=tl.float64)
            for j in tl.static_range(SLABS):
                c = (slot * SLABS + j) * (NPR * GT) + r
                dot += tl.load(pdot + c[:, None] * QP + q[None, :], cache_modifier=".cg")
                tot += tl.load(pss + c, cache_modifier=".cg")
            out = ell + (t[:, None].to(tl.int64) * n + src[:, None]) * QP + q[None, :]
            tl.store(out, ours._normalised(dot, tot[:, None], D, eps), mask=ok[:, None])
            tl.debug_barrier()
            tl.atomic_add(cnt + G + g, 1, sem="release")


@triton.jit
def _token_logits(pdot, pss, ell, cnt, g, s, T, D, n, eps, G, GT: tl.constexpr, NPR: tl.constexpr,
                  SLABS: tl.constexpr, QP: tl.constexpr, NP: tl.constexpr, FINAL: tl.constexpr):  # fmt: skip
    """Token ``g·GT + s``'s logits ``[QP, NP]`` (``-inf`` past ``n``) once its group is posted."""
    qq = tl.arange(0, QP)
    src = tl.arange(0, NP)
    t = (g * GT + s).to(tl.int64)
    if FINAL:
        _wait_at_least(cnt + G + g, 1)
        L = tl.load(ell + (t * n + src[None, :]) * QP + qq[:, None], mask=(src < n)[None, :], other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
    else:
        _wait_at_least(cnt + g, SLABS)
        dot = tl.zeros([QP, NP], dtype=tl.float32)
        ss = tl.zeros([NP], dtype=tl.float64)
        for j in tl.static_range(SLABS):
            c = (g * SLABS + j) * (NPR * GT) + src * GT + s
            dot += tl.load(pdot + c[None, :] * QP + qq[:, None], mask=(src < n)[None, :], other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            ss += tl.load(pss + c, mask=src < n, other=1.0, cache_modifier=".cg")
        L = tl.where((src < n)[None, :], ours._normalised(dot, ss[None, :], D, eps), float("-inf"))
    return L


@triton.jit
def _pattern_token(v, n_out, t, part, T, D, n, Q, SPLIT: tl.constexpr, BD: tl.constexpr, QP: tl.constexpr,
                   NP: tl.constexpr, STAGES: tl.constexpr, LOAD_EV: tl.constexpr, STORE_CM: tl.constexpr):  # fmt: skip
    """Timing only: the accumulate's loads and stores, each query's row the blocks' column sums."""
    span = tl.cdiv(tl.cdiv(D, SPLIT), BD) * BD
    qq = tl.arange(0, QP)
    src = tl.arange(0, NP)
    rows = v + (src[:, None].to(tl.int64) * T + t) * D
    outs = n_out + (qq[:, None] * T + t) * D
    for d0 in tl.range(part * span, tl.minimum(part * span + span, D), BD, num_stages=STAGES):
        dd = d0 + tl.arange(0, BD)
        X = tl.load(rows + dd[None, :], mask=(src < n)[:, None] & (dd < D)[None, :], other=0.0,
                    eviction_policy=LOAD_EV)  # fmt: skip
        col = tl.sum(X.to(tl.float32), axis=0)
        acc = col[None, :] + qq[:, None].to(tl.float32)
        tl.store(outs + dd[None, :], acc, mask=(qq < Q)[:, None] & (dd < D)[None, :], cache_modifier=STORE_CM)


@triton.jit
def _ticketed_kernel(v, g3, pdot, pss, ell, cnt, m_out, z_out, n_out, T, D, n, Q, eps, G,
                     GT: tl.constexpr, NPR: tl.constexpr, SLABS: tl.constexpr, SPAN: tl.constexpr,
                     LBD: tl.constexpr, LSTAGES: tl.constexpr, LEV: tl.constexpr, LAG: tl.constexpr,
                     FINAL: tl.constexpr, RING: tl.constexpr, SPLIT: tl.constexpr, BD: tl.constexpr,
                     QP: tl.constexpr, NP: tl.constexpr, STAGES: tl.constexpr, AEV: tl.constexpr,
                     STORE_EV: tl.constexpr, STORE_CM: tl.constexpr, PATTERN: tl.constexpr):  # fmt: skip
    """One work item per program, named by the ticket it takes (``cnt[2G]``): round ``r`` is the
    logits slabs of group ``r``, then the accumulate items of group ``r - LAG``."""
    R: tl.constexpr = SLABS + GT * SPLIT
    tk = tl.atomic_add(cnt + 2 * G, 1)
    r = tk // R
    j = tk % R
    if j < SLABS:
        if r < G:
            _slab_item(v, g3, pdot, pss, ell, cnt, r, j, T, D, n, Q, eps, G, GT, NPR, SLABS, SPAN, LBD, QP, LSTAGES,
                       LEV, FINAL, RING, PATTERN)  # fmt: skip
    else:
        g = r - LAG
        a = j - SLABS
        s = a // SPLIT
        if (g >= 0) & (g < G):
            if g * GT + s < T:
                t = (g * GT + s).to(tl.int64)
                if PATTERN == 1 or PATTERN == 2:
                    _wait_at_least(cnt + g, SLABS)
                    _pattern_token(v, n_out, t, a % SPLIT, T, D, n, Q, SPLIT, BD, QP, NP, STAGES, AEV, STORE_CM)
                else:
                    L = _token_logits(pdot, pss, ell, cnt, g, s, T, D, n, eps, G, GT, NPR, SLABS, QP, NP, FINAL)
                    ours._write_token(v, D * T, D, L, m_out, z_out, n_out, t, a % SPLIT, T, D, n, Q, SPLIT, BD, QP,
                                      NP, 1, STAGES, AEV, STORE_EV, STORE_CM)  # fmt: skip


def options(kw: dict[str, Any]) -> dict[str, Any]:
    """The defaults overridden by ``kw`` (:func:`gpu_timing.with_defaults`)."""
    return with_defaults(DEFAULTS, kw)


def _constants(o: dict[str, Any], n: int, Q: int, d: int) -> dict[str, Any]:
    """The kernel's constexprs for options ``o`` at ``n`` blocks, ``Q`` queries, width ``d``."""
    store_ev, store_cm = (o["store"], "") if not o["store"].startswith(".") else ("", o["store"])
    span = triton.cdiv(triton.cdiv(d, o["slabs"]), o["lwidth"]) * o["lwidth"]
    return dict(GT=o["tokens"], NPR=triton.next_power_of_2(n), SLABS=triton.cdiv(d, span), SPAN=span, LBD=o["lwidth"],
                LSTAGES=o["lstages"], LEV=o["lev"], LAG=o["lag"], FINAL=o["final"], RING=o["ring"],
                SPLIT=min(o["asplit"], triton.cdiv(d, o["awidth"])), BD=o["awidth"], QP=ours.block(Q),
                NP=ours.block(n), STAGES=o["astages"], AEV=o["aev"], STORE_EV=store_ev, STORE_CM=store_cm,
                PATTERN=o["pattern"])  # fmt: skip


def prepare(stored: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, *, eps: float = ours.RMS_NORM_EPS,
            **kw: Any):
    """A function that writes phase 1's ``Stats`` of ``stored:[n, T, d]`` (bf16) for queries
    ``w, gamma:[Q, d]`` (fp32) into buffers allocated here (its counters zeroed in the call),
    and those ``Stats``."""
    o = options(kw)
    n, T, d = stored.shape
    Q = w.shape[0]
    c = _constants(o, n, Q, d)
    GT, R = c["GT"], c["SLABS"] + c["GT"] * c["SPLIT"]
    G = triton.cdiv(T, GT)
    dev = stored.device
    m = torch.empty(Q, T, dtype=torch.float32, device=dev)
    Z = torch.empty_like(m)
    N = torch.empty(Q, T, d, dtype=torch.float32, device=dev)
    groups = min(o["ring"], G) if o["final"] else G
    rows = c["NPR"] * GT
    pdot = torch.empty(groups * c["SLABS"] * rows, c["QP"], dtype=torch.float32, device=dev)
    pss = torch.empty(groups * c["SLABS"] * rows, dtype=torch.float64, device=dev)
    ell = torch.empty(T, n, c["QP"], dtype=torch.float32, device=dev)
    cnt = torch.zeros(2 * G + 1, dtype=torch.int32, device=dev)
    grid = ((G + o["lag"]) * R,)
    limit = {"maxnreg": o["maxnreg"]} if o["maxnreg"] else {}

    def run() -> None:
        if ours.interpreted():  # the one-launch split is inline PTX: the torch split, the same bits
            parts = ours._split_bf16(ours._queries(w, gamma, d, dev, c["QP"]))
        else:
            parts = ours._queries(w, gamma, d, dev, c["QP"], split=True)
        cnt.zero_()
        _ticketed_kernel[grid](stored, parts, pdot, pss, ell, cnt, m, Z, N, T, d, n, Q, float(eps), G, **c,
                               num_warps=o["warps"], **limit)  # fmt: skip

    return run, Stats(m, Z, N)


def persisting_l2(mib: int) -> int:
    """Set aside ``mib`` MiB of the device's L2 for persisting lines (0 gives it back and resets
    the persisting lines); the bytes granted."""
    from cuda.bindings import runtime as rt

    err, most = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMaxPersistingL2CacheSize, 0)
    want = min(mib * 2**20, most)
    (err,) = rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize, want)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceSetLimit(persisting L2, {want}): {err}")
    if not mib:
        rt.cudaCtxResetPersistingL2Cache()
    return want


def _set_aside(mib: int, say) -> None:
    """With ``mib`` > 0, :func:`persisting_l2` and ``say`` how much was granted."""
    if mib:
        say(f"{persisting_l2(mib) / 2**20:.1f} MiB of L2 set aside")


def compile_report(variants: dict[str, dict[str, Any]]) -> None:
    """Registers, spills and shared memory of each variant for sm_90, without a GPU."""
    from kernel_compile import Launch, usage

    types = dict(g3="*bf16", pdot="*fp32", pss="*fp64", ell="*fp32", cnt="*i32", m_out="*fp32", z_out="*fp32",
                 n_out="*fp32", T="i32", D="i32", n="i32", Q="i32", G="i32", eps="fp32")  # fmt: skip
    for name, kw in variants.items():
        o = options(kw)
        launch = Launch(name, _ticketed_kernel, _constants(o, 8, 24, 7168), 3, types, frozenset({"T", "D"}))
        print(f"{name:32s} {o['warps']} warps: {usage(launch, 90, o['warps'], o['maxnreg'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = experiment_arguments(__doc__, VARIANTS)
    parser.add_argument("--compile", action="store_true", help="print registers and shared memory (no GPU)")
    parser.add_argument("--once", default=None, help="run one variant once (for a profiler), no timing")
    args = parser.parse_args(argv)
    chosen = chosen_variants(parser, args.variants, DEFAULTS)
    once = None if args.once is None else chosen_variants(parser, [args.once], DEFAULTS)[args.once]
    if args.compile:
        compile_report(chosen)
        return 0
    import attnres_gpu
    import gpu_timing
    from gpu_timing import agreement, copy_bandwidth, ms, write_variants

    T, d = args.tokens, 7168
    x = attnres_gpu._block_inputs(T, d)
    if once is not None:
        _set_aside(options(once)["persist"], print)
        run, _ = prepare(x["stored"], x["w"], x["gamma"], **once)
        run()
        torch.cuda.synchronize()
        ours.phase1(x["stored"], x["w"], x["gamma"])
        torch.cuda.synchronize()
        return 0
    begun = gpu_timing.start(args.out, "the AttnRes ticketed phase-1 experiment")
    if begun is None:
        return 2
    out, log = begun
    copy_tbps = copy_bandwidth()
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    moved = attnres_gpu.STORED * T * d * 2 + attnres_gpu.QUERIES * T * d * 4
    ref = ours.phase1(x["stored"], x["w"], x["gamma"])
    rows = []

    def ours_row(label: str) -> None:
        t = ms(lambda: ours.phase1(x["stored"], x["w"], x["gamma"]), "attnres phase 1 ticketed", label, T=T)
        rows.append(dict(variant=label, ms=t, fraction_of_copy=moved / (t * 1e-3) / 1e12 / copy_tbps))
        log(f"{label}: {t:.4f} ms, {100 * rows[-1]['fraction_of_copy']:.1f}% of copy")

    ours_row("ours (two launches)")
    for name, kw in chosen.items():
        persist = options(kw)["persist"]
        try:
            _set_aside(persist, lambda msg, name=name: log(f"{name}: {msg}"))
            run, got = prepare(x["stored"], x["w"], x["gamma"], **kw)
            for buf in (got.m, got.Z, got.N):  # every entry must be written
                buf.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            agree = agreement(got, ref)
            again = torch.clone(got.N[:, :64])
            run()
            torch.cuda.synchronize()
            repeat = bool(torch.equal(again, got.N[:, :64]))
            t = ms(run, "attnres phase 1 ticketed", name, T=T)
        except Exception as exc:  # a variant that does not compile or run is a result; go on
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{name}: {rows[-1]['error']}")
            continue
        finally:
            if persist:
                persisting_l2(0)
        frac = moved / (t * 1e-3) / 1e12 / copy_tbps
        rows.append(dict(variant=name, options=options(kw), ms=t, fraction_of_copy=frac, agreement=agree,
                         repeatable=repeat))  # fmt: skip
        log(f"{name}: {t:.4f} ms, {100 * frac:.1f}% of copy; max |dm| {agree['m']:.1e}, dZ {agree['Z']:.1e}, "
            f"dN {agree['N']:.1e}; same bits on a second call: {repeat}")
        del got, run
        torch.cuda.empty_cache()
    ours_row("ours (two launches), again")
    write_variants(out, "attnres_ticketed", "Block AttnRes phase 1 in one ticketed launch (experiment)", T, d,
                   copy_tbps, rows, options=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

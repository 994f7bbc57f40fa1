"""Stable LatentMoE kernels on a CUDA device: the grouped expert GEMMs with fused SiTU against
torch._grouped_mm, and the layer's time by part, in one process.

    python benchmarks/moe_gpu.py --out DIR [--quick]

K3's routed experts, bf16 operands, fp32 accumulation: E = 896 experts, top 16, latent 3584;
the TP-local expert hidden 384 (3072 / 8) at T = 4096 and 16384 tokens, and the full hidden
3072 at T = 4096. Tokens are routed by our router kernel on random inputs (fp32 logits).

- experts: our two grouped launches (``kernels._grouped_experts``: up with SiTU fused, down
  with the routing weight) against ``torch._grouped_mm`` for the same two GEMMs with SiTU as
  separate torch operations between them (``adapters.torch_grouped_mm``, its fused ``[W1 | W3]``
  made once, as a deployment stores it), on the same sorted rows; TFLOP/s counts ``6 P Dl H``
  (``P = T k`` rows) against the bf16 matmul peak measured in the same run (an 8192³
  ``torch.matmul``).
- layer: the time of each part of our path — router, dispatch (sort and row offsets), ``z = x W↓``,
  the expert GEMMs, the combine (each token's rows summed and normed: ``kernels.combine_norm``,
  and the torch operations it replaced) — and of the whole, with the GEMMs outside the experts
  in fp32 torch operations and (``production=True``) in our launches with bf16 operands; for
  one production-dtype call, the device time of each kernel and the gaps in which the device
  stood idle, each named by the layer's part (``moe.*``) the host was in then
  (``gpu_timing.idle_gaps``).

Ratios are ``peer time / our time`` (> 1: ours is faster). Writes ``moe_gpu.json``,
``moe_gpu.md`` and ``moe_gpu_benchmark.json`` (pytest-benchmark's shape) under ``--out``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import gpu_timing
import torch
from gpu_timing import attempt, cell, ms, write_results

from k3verify.adapters import torch_grouped_mm
from k3verify.harness.environment import environment
from k3verify.moe import kernels
from k3verify.moe.chunkwise import sort_pairs
from k3verify.moe.inputs import MoEConfig, MoEWeights, weight_shapes
from k3verify.numerics.ops import rms_norm

SHAPES = [(4096, 384), (16384, 384), (4096, 3072)]  # (tokens, expert hidden)
DEVICE = "cuda"


def matmul_peak() -> float:
    """bf16 ``torch.matmul`` of 8192³, TFLOP/s (the peak the GEMM rows are read against)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (ms(lambda: a @ b, "matmul", "torch bf16 8192^3") * 1e-3) / 1e12


def _weights(cfg: MoEConfig, gen: torch.Generator) -> MoEWeights:
    """Random bf16 weights of ``cfg`` on the GPU (drawn in bf16: the full expert hidden is 59 GB),
    scaled by ``fan_in^{-1/2}``, the bias 0, the norm gain near 1."""
    out = {}
    for name, shape in weight_shapes(cfg).items():
        t = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
        if name == "bias":
            t.zero_()
        elif name == "latent_norm":
            t = 1 + 0.1 * t
        else:
            t *= shape[-2] ** -0.5
        out[name] = t
    return MoEWeights(**out)


def _distinct(tiles: list[kernels.Tiles]) -> list[kernels.Tiles]:
    """``tiles`` without repeats, in order (the default may equal a listed candidate)."""
    return list(dict.fromkeys(tiles))


_T = kernels.Tiles
# Launch shapes timed per launch, the current default first; none spills registers in an
# offline sm_90 compile (benchmarks/kernel_compile.py --module moe), and the persistent ones (a
# last field of 1 or 2 programs per multiprocessor) fit that many programs' shared memory in an SM.
# 64-row tiles: at T = 16384 an expert has 236-354 rows, and 128-row tiles compute 77% useful
# rows where 64-row tiles compute 91% (docs/gpu.md); they lost at every shape on an H100 (95564bd).
# The pointer-load shapes that were the defaults before it stay in the sweep.
CANDIDATES = {
    "logits": _distinct([kernels.LOGIT_TILES, _T(64, 64, 32, 4, 3), _T(128, 128, 32, 8, 3), _T(128, 128, 32, 8, 4),
                         _T(64, 128, 32, 8, 4), _T(128, 64, 32, 4, 3), _T(64, 128, 32, 4, 3)]),
    "up": _distinct([kernels.UP_TILES, _T(128, 128, 64, 8, 3), _T(128, 64, 64, 8, 3), _T(128, 128, 64, 8, 4),
                     _T(128, 128, 64, 8, 3, True),
                     _T(128, 128, 64, 8, 4, True), _T(64, 128, 64, 4, 3), _T(64, 128, 64, 4, 4, True),
                     _T(64, 128, 64, 4, 2, True), _T(64, 128, 64, 8, 4, True), _T(128, 128, 64, 8, 3, True, 1),
                     _T(64, 128, 64, 4, 2, True, 2), _T(64, 128, 64, 4, 3, True, 1)]),
    "down": _distinct([kernels.DOWN_TILES, _T(128, 128, 64, 8, 3), _T(64, 128, 64, 4, 3), _T(128, 256, 64, 8, 3),
                       _T(128, 128, 64, 8, 3, True),
                       _T(128, 256, 64, 8, 3, True), _T(64, 256, 64, 4, 3), _T(64, 256, 64, 4, 4, True),
                       _T(64, 256, 64, 4, 2, True), _T(64, 256, 64, 8, 3, True), _T(128, 256, 64, 8, 3, True, 1),
                       _T(128, 128, 64, 8, 3, True, 1), _T(64, 256, 64, 4, 2, True, 2),
                       _T(64, 128, 64, 4, 3, True, 2)]),
}
CANDIDATES["dense"] = _distinct([kernels.DENSE_TILES, _T(128, 256, 64, 8, 3), *CANDIDATES["down"]])
# A shape whose result is this far from the default shape's (relative to its largest value) is
# wrong, not faster: the shapes change only the order of fp32 sums (relative differences near
# 1e-6), which a result stored in bf16 or fp16 can turn into one unit in its last place.
AGREE = 1e-3


def agreement(dtype: torch.dtype) -> float:
    """The largest difference from the default shape's result a correct shape can make: two units
    in the last place of a 16-bit result's largest value, else :data:`AGREE`."""
    return max(AGREE, 2 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def sweep(launch: str, make, group: str, log) -> tuple[list[dict[str, Any]], kernels.Tiles]:
    """Time ``make(tiles)()`` for every candidate shape of ``launch`` (the first, the default, is
    the reference its results must agree with); the rows and the fastest agreeing shape."""
    rows: list[dict[str, Any]] = []
    reference = None
    best: tuple[float, kernels.Tiles] | None = None
    for t in CANDIDATES[launch]:
        fn = make(t)
        got = attempt(fn)
        row: dict[str, Any] = dict(kind="tiles", launch=launch, group=group, tiles=str(t))
        if isinstance(got, str):
            rows.append(row | dict(error=got))
            continue
        got = got.indices if isinstance(got, kernels.Routing) else got
        limit = agreement(got.dtype)
        got = got.float()  # exact for 16-bit results; fp32 differences far below every limit
        reference = got if reference is None else reference
        row["difference"] = float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
        if row["difference"] > limit:
            rows.append(row | dict(error=f"differs from the default shape's result by {row['difference']:.2e}"))
            continue
        row["ms"] = ms(fn, group, f"{launch} {t}")
        best = min(best or (row["ms"], t), (row["ms"], t), key=lambda b: b[0])
        rows.append(row)
    if best is None:
        raise RuntimeError(f"no shape of the {launch} launch ran: {rows}")
    log(f"  {launch} tiles: " + ", ".join(f"{r['tiles']} {r['ms']:.3f}" if "ms" in r else f"{r['tiles']} {r['error']}"
                                        for r in rows) + f"; best {best[1]}")  # fmt: skip
    return rows, best[1]


def shape_rows(T: int, H: int, peak: float, log) -> list[dict[str, Any]]:
    cfg = MoEConfig.production(expert_hidden=H)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = _weights(cfg, gen)
    x = torch.randn(T, cfg.hidden_size, generator=gen, device=DEVICE)
    xb = x.bfloat16()
    group = f"moe T={T} H={H}"
    w_r, bias = w.w_router.float(), w.bias.float()  # the fp32 router of docs/model.md §4
    r = kernels.route(x, w_r, bias, cfg)
    d = sort_pairs(r.indices, cfg.num_experts)
    z = (xb @ w.w_latent_down).contiguous()
    p = r.weights.reshape(-1)[d.order].contiguous()
    P = d.order.numel()
    flops = 6 * P * cfg.latent_size * H
    table = kernels._RowTables(d.offsets, P)
    h = kernels._up(z, d.token, table, w.w1, w.w3, cfg)
    dense_rows = kernels._RowTables.whole(T, z.device)
    ones = torch.ones(T, device=DEVICE)
    rows = padding_rows(T, H, d.offsets, log)
    best: dict[str, kernels.Tiles] = {}
    makers = {
        "logits": lambda t: partial(kernels.route, x, w_r, bias, cfg, tiles=t),
        "up": lambda t: partial(kernels._up, z, d.token, table, w.w1, w.w3, cfg, t),
        "down": lambda t: partial(kernels._down, h, table, w.w2, p, t, d.order, out_dtype=z.dtype),
        "dense": lambda t: partial(kernels._down, xb, dense_rows, w.w_latent_down[None], ones, t, dense=True,
                                   out_dtype=torch.bfloat16),
    }
    for launch, make in makers.items():
        swept, best[launch] = sweep(launch, make, group, log)
        rows += [dict(r, T=T, H=H) for r in swept]
    default = ms(partial(kernels._grouped_experts, z, d, p, w, cfg), group, "k3verify experts, default tiles")
    ours = ms(partial(kernels._grouped_experts, z, d, p, w, cfg, best["up"], best["down"]), group, "k3verify experts")
    for name, t, tiles in (("k3verify, default tiles", default, f"{kernels.UP_TILES} / {kernels.DOWN_TILES}"),
                           ("k3verify", ours, f"{best['up']} / {best['down']}")):  # fmt: skip
        rows.append(dict(kind="experts", T=T, H=H, implementation=name, tiles=tiles, ms=t,
                         tflops=flops / (t * 1e-3) / 1e12, fraction_of_peak=flops / (t * 1e-3) / 1e12 / peak))
        log(f"experts T={T} H={H} {name} ({tiles}): {t:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s "
            f"({100 * rows[-1]['fraction_of_peak']:.0f}% of matmul peak)")  # fmt: skip
    # The peer's fused [W1 | W3] is made inside the attempt: at the full hidden it is 39 GB beside
    # the layer's 59 GB, more than an 80 GB device holds, and that is a row, not a crash.
    peer = attempt(lambda: partial(torch_grouped_mm._experts, z, d, p, w, config=cfg,
                                   w13=torch_grouped_mm.fused_up(w)))  # fmt: skip
    first = peer if isinstance(peer, str) else attempt(peer)
    if isinstance(first, str):
        rows.append(dict(kind="experts", T=T, H=H, implementation="torch._grouped_mm + SiTU", error=first))
        log(f"  torch._grouped_mm: {first}")
    else:
        t = ms(peer, group, "torch._grouped_mm + SiTU")
        rows.append(dict(kind="experts", T=T, H=H, implementation="torch._grouped_mm + SiTU", ms=t,
                         tflops=flops / (t * 1e-3) / 1e12, ratio_peer_over_ours=t / ours))  # fmt: skip
        log(f"  torch._grouped_mm + SiTU: {t:.3f} ms ({t / ours:.2f}x ours)")
    del peer, first  # its fused [W1 | W3] (40 GB at the full hidden) before the layer is timed
    torch.cuda.empty_cache()
    rows += layer_rows(T, H, cfg, w, x, r, best, ours, group, log)
    return rows


def padding_rows(T: int, H: int, offsets: torch.Tensor, log) -> list[dict[str, Any]]:
    """How many of the rows that tiles of 64 and of 128 compute are real, for this routing: an
    expert's last tile is short, and the grouped launches compute it whole."""
    counts = offsets.diff().long()
    real = int(counts.sum())
    rows = []
    for height in (64, 128):
        computed = int(((counts + height - 1) // height).sum()) * height
        rows.append(dict(kind="padding", T=T, H=H, tile_rows=height, rows=real, computed_rows=computed,
                         real_fraction=real / computed))  # fmt: skip
        log(f"  {height}-row tiles: {real} of {computed} computed rows real ({100 * real / computed:.1f}%), "
            f"{int(counts.min())}-{int(counts.max())} rows an expert")  # fmt: skip
    return rows


def layer_rows(T: int, H: int, cfg: MoEConfig, w: MoEWeights, x: torch.Tensor, r, best: dict[str, kernels.Tiles],
               experts_ms: float, group: str, log) -> list[dict[str, Any]]:  # fmt: skip
    """The layer's time by part with the swept shapes as the launches' defaults, and the whole
    layer against the sum of its GEMMs (``x W↓``, the experts, ``RMSNorm(u) W↑``, the shared MLP)."""
    tuned = dict(LOGIT_TILES=best["logits"], UP_TILES=best["up"], DOWN_TILES=best["down"], DENSE_TILES=best["dense"])
    before = {name: getattr(kernels, name) for name in tuned}
    for name, t in tuned.items():
        setattr(kernels, name, t)
    try:
        xb = x.bfloat16()
        d = sort_pairs(r.indices, cfg.num_experts)
        z = (xb @ w.w_latent_down).contiguous()
        p = r.weights.reshape(-1)[d.order].contiguous()
        out = kernels._grouped_experts(z, d, p, w, cfg)
        rows_of = out.reshape(T, cfg.top_k, -1)
        gain = w.latent_norm.float()
        normed = kernels.combine_norm(rows_of, gain, cfg.rms_norm_eps, torch.bfloat16)
        dense = kernels.kernel_dense(cfg)
        gemms = {
            "latent down-projection": partial(dense.matmul, xb, w.w_latent_down),
            "latent up-projection": partial(dense.matmul, normed, w.w_latent_up),
            "shared MLP": partial(dense.shared, xb, w.shared_w1, w.shared_w3, w.shared_w2),
        }
        parts = {
            "router": partial(kernels.route, x, w.w_router.float(), w.bias.float(), cfg),
            "dispatch": partial(sort_pairs, r.indices, cfg.num_experts),
            **gemms,
            "latent down-projection, cuBLAS": lambda: xb @ w.w_latent_down,
            "combine and norm": partial(kernels.combine_norm, rows_of, gain, cfg.rms_norm_eps, torch.bfloat16),
            # the same in torch operations, as the production layer ran it before combine_norm
            "combine and norm, torch": lambda: rms_norm(rows_of.sum(1, dtype=torch.float32), gain,
                                                        eps=cfg.rms_norm_eps).bfloat16(),
            "layer": partial(kernels.grouped, xb, w, cfg, routing=r),
            # every GEMM in our launches with bf16 operands (x W↓, RMSNorm(u) W↑, the shared MLP)
            "layer, production dtype": partial(kernels.grouped, xb, w, cfg, routing=r, production=True),
        }
        rows = [dict(kind="layer", T=T, H=H, part="expert GEMMs", ms=experts_ms)]  # timed above
        for name, fn in parts.items():
            t = attempt(partial(ms, fn, group, name))
            rows.append(dict(kind="layer", T=T, H=H, part=name) | (dict(error=t) if isinstance(t, str) else dict(ms=t)))
            log(f"  {name}: " + (t if isinstance(t, str) else f"{t:.3f} ms"))
        # Device time per kernel of one production-dtype layer call: what the wall time holds
        # beyond it is the device waiting on the host.
        split = attempt(partial(gpu_timing.launch_split, parts["layer, production dtype"]))
        if isinstance(split, str):
            rows.append(dict(kind="split", T=T, H=H, kernel="(profiler)", error=split))
        else:
            rows += [dict(kind="split", T=T, H=H, kernel=k, ms=v) for k, v in split.items()]
            log(f"  device busy {sum(split.values()):.3f} ms a production-dtype layer call: "
                + ", ".join(f"{k} {v:.3f}" for k, v in list(split.items())[:6]))  # fmt: skip
        # Where in the call the device stood idle, and what the host was doing then.
        gaps = attempt(partial(gpu_timing.idle_gaps, parts["layer, production dtype"]))
        if isinstance(gaps, str):
            rows.append(dict(kind="gap", T=T, H=H, host="(profiler)", error=gaps))
        else:
            rows.append(dict(kind="gap", T=T, H=H, host="(the whole call)", at_ms=0.0, ms=gaps["idle_ms"],
                             span_ms=gaps["span_ms"], busy_ms=gaps["busy_ms"]))  # fmt: skip
            rows += [dict(kind="gap", T=T, H=H, **g) for g in gaps["gaps"]]
            log(f"  device idle {gaps['idle_ms']:.3f} of {gaps['span_ms']:.3f} ms: "
                + ", ".join(f"{g['ms']:.3f} at {g['at_ms']:.3f} in {g['host']}" for g in gaps["gaps"]))
    finally:
        for name, t in before.items():
            setattr(kernels, name, t)
    timed = {row["part"]: row.get("ms") for row in rows if row["kind"] == "layer"}
    parts_of_sum = ["expert GEMMs", *gemms]
    if all(timed.get(n) for n in [*parts_of_sum, "layer, production dtype"]):
        total = sum(timed[n] for n in parts_of_sum)
        rows.append(dict(kind="layer", T=T, H=H, part="sum of the GEMMs", ms=total))
        rows.append(dict(kind="layer", T=T, H=H, part="layer, production dtype / sum of the GEMMs",
                         ratio=timed["layer, production dtype"] / total))
        log(f"  layer / sum of its GEMMs: {timed['layer, production dtype']:.3f} / {total:.3f} ms = "
            f"{timed['layer, production dtype'] / total:.2f}x")
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Stable LatentMoE kernels on {cell(result['device'])}", "",
             f"bf16 matmul peak (8192³): {result['peak_tflops']:.0f} TFLOP/s. Times: do_bench medians, ms. E = 896, "
             "top 16, latent 3584, bf16 operands.", "",
             "| T | expert hidden | implementation | ms | TFLOP/s | of peak | peer / ours |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if r["kind"] != "experts":
            continue
        if "error" in r:
            lines.append(f"| {r['T']} | {r['H']} | {cell(r['implementation'])} | {cell(r['error'])} | | | |")
            continue
        frac = f"{100 * r['fraction_of_peak']:.0f}%" if "fraction_of_peak" in r else ""
        ratio = gpu_timing.ratio_cell(r)
        lines.append(f"| {r['T']} | {r['H']} | {cell(r['implementation'])} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{frac} | {ratio} |")  # fmt: skip
    lines += ["", "| T | expert hidden | part | ms |", "|---|---|---|---|"]
    layer = [r for r in result["rows"] if r["kind"] == "layer"]
    lines += [f"| {r['T']} | {r['H']} | {cell(r['part'])} | {_figure(r)} |" for r in layer]
    lines += ["", "Device time per kernel of one production-dtype layer call (torch profiler):", "",
              "| T | expert hidden | kernel | ms |", "|---|---|---|---|"]
    split = [r for r in result["rows"] if r["kind"] == "split"]
    lines += [f"| {r['T']} | {r['H']} | {cell(r['kernel'])} | {_figure(r)} |" for r in split]
    lines += ["", "Device idle in one production-dtype layer call (torch profiler; the host range running then,"
              " `(python)` where none is recorded; the first row: the whole call):", "",
              "| T | expert hidden | at ms | idle ms | host |", "|---|---|---|---|---|"]
    gaps = [r for r in result["rows"] if r["kind"] == "gap"]
    lines += [f"| {r['T']} | {r['H']} | {format(r['at_ms'], '.3f') if 'at_ms' in r else ''} | {_figure(r)} | "
              f"{cell(r['host'])} |" for r in gaps]  # fmt: skip
    lines += ["", "Rows the grouped launches compute at each tile height (an expert's last tile is short):", "",
              "| T | expert hidden | tile rows | real rows | computed rows | real |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['H']} | {r['tile_rows']} | {r['rows']} | {r['computed_rows']} | "
              f"{100 * r['real_fraction']:.1f}% |" for r in result["rows"] if r["kind"] == "padding"]  # fmt: skip
    lines += ["", "Launch shapes (rows x columns x depth, warps, stages; the first is the default; p: persistent"
              " programs per multiprocessor):", "",
              "| T | expert hidden | launch | tiles | ms | difference from the default |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "tiles":
            diff = format(r["difference"], ".1e") if "difference" in r else ""
            lines.append(f"| {r['T']} | {r['H']} | {r['launch']} | {cell(r['tiles'])} | {_figure(r)} | {diff} |")
    return "\n".join(lines) + "\n"


def _figure(row: dict[str, Any]) -> str:
    """A row's figure for its table cell: its error (escaped), its ratio, or its time in ms."""
    if "error" in row:
        return cell(row["error"])
    if "ratio" in row:
        return f"{row['ratio']:.2f}x"
    return format(row["ms"], ".3f") if "ms" in row else ""


def main(argv: list[str] | None = None) -> int:
    parser = gpu_timing.arguments(__doc__, "T = 4096, expert hidden 384 only")
    args = parser.parse_args(argv)
    begun = gpu_timing.start(args.out, "the MoE GPU benchmark")
    if begun is None:
        return 2
    out, log = begun
    peak = matmul_peak()
    log(f"bf16 matmul peak {peak:.0f} TFLOP/s")
    rows = []
    for T, H in SHAPES[:1] if args.quick else SHAPES:
        rows += shape_rows(T, H, peak, log)
        torch.cuda.empty_cache()  # the shape's weights (up to 59 GB) are gone once it returns
    result = dict(device=torch.cuda.get_device_name(0), peak_tflops=peak, rows=rows, environment=environment())
    write_results(out, "moe_gpu", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

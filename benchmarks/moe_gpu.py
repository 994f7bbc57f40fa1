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
- layer: the time of each part of our path — router, dispatch (sort and counts), ``z = x W↓``,
  the expert GEMMs, the combine (each token's rows summed) — and of the whole, with the GEMMs
  outside the experts in fp32 torch operations and (``production=True``) in our launches with
  bf16 operands.

Ratios are ``peer time / our time`` (> 1: ours is faster). Writes ``moe_gpu.json``,
``moe_gpu.md`` and ``moe_gpu_benchmark.json`` (pytest-benchmark's shape) under ``--out``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import gpu_timing
import torch
from gpu_timing import attempt, ms, write_results

from k3verify.adapters import torch_grouped_mm
from k3verify.harness.environment import environment
from k3verify.moe import kernels
from k3verify.moe.chunkwise import dispatch
from k3verify.moe.inputs import MoEConfig, MoEWeights, weight_shapes

SHAPES = [(4096, 384), (16384, 384), (4096, 3072)]  # (tokens, expert hidden)


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
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        if name == "bias":
            t.zero_()
        elif name == "latent_norm":
            t = 1 + 0.1 * t
        else:
            t *= shape[-2] ** -0.5
        out[name] = t
    return MoEWeights(**out)


def shape_rows(T: int, H: int, peak: float, log) -> list[dict[str, Any]]:
    cfg = MoEConfig.production(expert_hidden=H)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = _weights(cfg, gen)
    x = torch.randn(T, cfg.hidden_size, generator=gen, device="cuda")
    group = f"moe T={T} H={H}"
    route = partial(kernels.route, x, w.w_router.float(), w.bias.float(), cfg)  # the fp32 router of docs/model.md §4
    r = route()
    d = dispatch(r.indices, cfg.num_experts)
    z = (x.bfloat16() @ w.w_latent_down).contiguous()
    p = r.weights.reshape(-1)[d.order].contiguous()
    P = d.order.numel()
    flops = 6 * P * cfg.latent_size * H
    ours = ms(partial(kernels._grouped_experts, z, d, p, w, cfg), group, "k3verify experts")
    rows = [dict(kind="experts", T=T, H=H, implementation="k3verify", ms=ours, tflops=flops / (ours * 1e-3) / 1e12,
                 fraction_of_peak=flops / (ours * 1e-3) / 1e12 / peak)]  # fmt: skip
    log(f"experts T={T} H={H}: {ours:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s "
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
    slot_rows = torch.empty_like(d.order)
    slot_rows[d.order] = torch.arange(P, device="cuda")
    out = kernels._grouped_experts(z, d, p, w, cfg)
    parts = {
        "router": route,
        "dispatch": partial(dispatch, r.indices, cfg.num_experts),
        "latent down-projection": lambda: x.bfloat16() @ w.w_latent_down,
        "combine": lambda: out[slot_rows].reshape(T, cfg.top_k, -1).sum(1),
        "layer": partial(kernels.grouped, x.bfloat16(), w, cfg, routing=r),
        # every GEMM in our launches with bf16 operands (x W↓, RMSNorm(u) W↑, the shared MLP)
        "layer, production dtype": partial(kernels.grouped, x.bfloat16(), w, cfg, routing=r, production=True),
    }
    rows.append(dict(kind="layer", T=T, H=H, part="expert GEMMs", ms=ours))  # timed above
    for name, fn in parts.items():
        t = attempt(partial(ms, fn, group, name))
        rows.append(dict(kind="layer", T=T, H=H, part=name) | (dict(error=t) if isinstance(t, str) else dict(ms=t)))
        log(f"  {name}: " + (t if isinstance(t, str) else f"{t:.3f} ms"))
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Stable LatentMoE kernels on {result['device']}", "",
             f"bf16 matmul peak (8192³): {result['peak_tflops']:.0f} TFLOP/s. Times: do_bench medians, ms. E = 896, "
             "top 16, latent 3584, bf16 operands.", "",
             "| T | expert hidden | implementation | ms | TFLOP/s | of peak | peer / ours |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if r["kind"] != "experts":
            continue
        if "error" in r:
            lines.append(f"| {r['T']} | {r['H']} | {r['implementation']} | {r['error']} | | | |")
            continue
        frac = f"{100 * r['fraction_of_peak']:.0f}%" if "fraction_of_peak" in r else ""
        ratio = gpu_timing.ratio_cell(r)
        lines.append(f"| {r['T']} | {r['H']} | {r['implementation']} | {r['ms']:.3f} | {r['tflops']:.0f} | {frac} | "
                     f"{ratio} |")  # fmt: skip
    lines += ["", "| T | expert hidden | part | ms |", "|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "layer":
            lines.append(f"| {r['T']} | {r['H']} | {r['part']} | {r.get('error') or format(r['ms'], '.3f')} |")
    return "\n".join(lines) + "\n"


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

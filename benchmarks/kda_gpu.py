"""KDA kernels on a CUDA device: speed against fla-core in the same process, and accuracy.

    python benchmarks/kda_gpu.py --out DIR [--quick]

Times come from ``triton.testing.do_bench`` (median of its repetitions, milliseconds), bf16
operands, K = V = 128, gates pre-computed in fp32. Every row names its peer and the ratio
``peer time / our time`` (> 1: ours is faster). Decode rows also give the state traffic
(fp32 state read and written once per step) against the device's copy bandwidth measured in
the same run. Accuracy rows give each kernel's RMS error ratio against the fp64 oracle and
the naive chunkwise bf16 baseline's, as the policy compares them. Our kernels are timed with
``validate=False`` (no NaN / sign scans of the inputs), since fla-core checks no values either.
Writes ``kda_gpu.json`` and ``kda_gpu.md`` under ``--out``, and every timing's repetitions as
``kda_gpu_benchmark.json`` in pytest-benchmark's shape (``pytest-benchmark compare`` reads it
beside the CPU benchmarks' saved runs).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import gpu_timing
import torch
from gpu_timing import cell, copy_bandwidth, launch_split, write_results
from gpu_timing import ms as _ms

from k3verify import kda
from k3verify.adapters import fla
from k3verify.harness.environment import environment
from k3verify.kda import kernels
from k3verify.kda.samples import random_inputs
from k3verify.kda.tiled import ANCHORS
from k3verify.numerics import compare

PREFILL = [dict(B=1, T=8192, H=96), dict(B=1, T=8192, H=12), dict(B=1, T=32768, H=12)]
DECODE = [dict(B=256, H=12), dict(B=64, H=96)]
D = 128
G_MIN = -5.0


def _inputs(B: int, T: int, H: int, seed: int = 0) -> list[torch.Tensor]:
    """bf16 q, k, v, fp32 g, bf16 beta on the GPU, drawn as the layer draws them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device="cuda", dtype=torch.float32)

    q, k = kda.l2norm(randn(B, T, H, D)), kda.l2norm(randn(B, T, H, D))
    g = G_MIN * torch.sigmoid(randn(B, T, H, D))
    beta = torch.sigmoid(randn(B, T, H))
    return [q.bfloat16(), k.bfloat16(), randn(B, T, H, D).bfloat16(), g, beta.bfloat16()]


def split_rows(log, peers: bool) -> list[dict[str, Any]]:
    """Per-launch device time of the prefill call at every benchmark shape (and fla-core's).
    Ours with the launches in order (``overlap=False``): beside the state pass the ``A_qk``
    launch shares the device, and the profiler would count both at their stretched times."""
    rows = []
    for shape in PREFILL:
        x = _inputs(**shape)
        runs = {"ours": partial(kernels.chunk, *x, validate=False, overlap=False)}
        if peers:
            runs["fla-core"] = partial(fla.chunk_gpu, *x, safe_gate=True, lower_bound=G_MIN)
        for name, run in runs.items():
            split = launch_split(run)
            rows.append(dict(kind="split", implementation=name, **shape, launches=split))
            log(f"split {name} {shape}: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    return rows


TUNE = {
    "_prefix_kernel": [dict(prefix_block_k=b, prefix_warps=w) for b in (32, 64) for w in (4, 8)],
    "_blocks_kernel": [
        dict(intra_block_k=b, qk_warps=q, intra_warps=w, solve_block=s)
        for b, q, w, s in ((16, 1, 2, 64), (32, 1, 2, 64), (16, 2, 2, 64), (16, 1, 2, 32))
    ],
    "_state_kernel": [dict(block_v=v, num_warps=w, num_stages=s) for v in (32, 64) for w in (4, 8) for s in (2, 3)],
    "_output_kernel": [dict(output_block_v=v, output_warps=w) for v in (64, 128) for w in (4, 8)],
}


def tune_rows(log) -> list[dict[str, Any]]:
    """Each launch's device time under each of its launch configurations, at every prefill shape."""
    rows = []
    for shape in PREFILL:
        x = _inputs(**shape)
        for kernel, configs in TUNE.items():
            for config in configs:
                ms = launch_split(partial(kernels.chunk, *x, validate=False, **config), repeats=10).get(kernel)
                rows.append(dict(kind="tune", kernel=kernel, **shape, config=config, ms=ms))
                log(f"tune {shape} {kernel} {config}: " + (f"{ms:.4f} ms" if ms is not None else "not launched"))
    return rows


def _sweep(run, configs: list[dict[str, int]], label: str, log) -> tuple[float, float, dict[str, int]]:
    """``run(**config)`` timed at the defaults and at every config: (default, best, best config)."""
    default = _ms(run, label, "ours")
    timings = []
    for config in configs:
        timings.append((_ms(partial(run, **config), label, "ours", **config), config))
        log(f"{label} {config}: {timings[-1][0]:.4f} ms")
    best_ms, best = min(timings, key=lambda t: t[0], default=(default, {}))
    if default <= best_ms:
        best_ms, best = default, {}
    return default, best_ms, best


def _row(kind: str, shape: dict[str, int], peer: str, peer_ms: float, default: float, best: float, config) -> dict:
    return dict(kind=kind, **shape, ours_ms=default, best_ms=best, best_config=config or "defaults", peer=peer,
                peer_ms=peer_ms, ratio=peer_ms / default, ratio_best=peer_ms / best)  # fmt: skip


def prefill_rows(sweep: bool, log) -> list[dict[str, Any]]:
    configs = [dict(intra_block_k=32), dict(block_v=32, num_stages=3), dict(block_v=64, num_stages=2)] if sweep else []
    rows = []
    for shape in PREFILL:
        x = _inputs(**shape)
        theirs = _ms(partial(fla.chunk_gpu, *x, safe_gate=True, lower_bound=G_MIN), f"prefill {shape}", "fla-core")
        default, best, config = _sweep(partial(kernels.chunk, *x, validate=False), configs, f"prefill {shape}", log)
        rows.append(_row("prefill", shape, "fla-core chunk_kda(safe_gate=True, lower_bound=-5)", theirs, default,
                         best, config))  # fmt: skip
        log(f"prefill {shape}: ours {default:.3f} ms (best {best:.3f}), fla {theirs:.3f} ms")
    return rows


def decode_rows(copy_tbps: float, sweep: bool, log) -> list[dict[str, Any]]:
    configs = [dict(block_v=bv, num_warps=w) for bv in (32, 64, 128) for w in (2, 4, 8)] if sweep else []
    rows = []
    for shape in DECODE:
        B, H = shape["B"], shape["H"]
        x = _inputs(B, 1, H)
        pool = torch.randn(B, H, D, D, device="cuda") * 0.1
        slots = torch.arange(B, device="cuda")
        state = pool.clone()
        theirs = _ms(partial(fla.fused_recurrent_gpu, *x, initial_state=state, output_final_state=True),
                     f"decode {shape}", "fla-core")  # fmt: skip
        step = partial(kernels.fused_recurrent, *x, initial_state=pool, state_indices=slots, validate=False)
        default, best, config = _sweep(step, configs, f"decode {shape}", log)
        row = _row("decode", shape, "fla-core fused_recurrent_kda (fp32 state, final state in place)", theirs,
                   default, best, config)  # fmt: skip
        state_bytes = 2 * B * H * D * D * 4
        row.update(
            state_tbps=state_bytes / (best * 1e-3) / 1e12,
            peer_state_tbps=state_bytes / (theirs * 1e-3) / 1e12,
            fraction_of_copy=state_bytes / (best * 1e-3) / 1e12 / copy_tbps,
            default_fraction_of_copy=state_bytes / (default * 1e-3) / 1e12 / copy_tbps,
        )
        rows.append(row)
        log(f"decode {shape}: ours {default:.4f} ms (best {best:.4f}), fla {theirs:.4f} ms")
    return rows


def accuracy_rows(log) -> list[dict[str, Any]]:
    """T = 1024, H = 12 (a shape fla-core has already tuned for): RMS error ratio vs the fp64
    oracle, with the policy's baseline."""
    x = random_inputs(1, 1024, 12, D, D, seed=11, initial_state=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ref, _ = kda.chunkwise(*args)
    base, _ = kda.naive_chunk_baseline(*args, dtype="bf16")
    gpu = [a.to("cuda", torch.float32 if n == "g" else torch.bfloat16) for a, n in zip(args, "qkvgb")]
    runs = {f"k3verify kernel:chunk anchor={a}": (lambda a=a: kernels.chunk(*gpu, anchor=a)[0]) for a in ANCHORS}
    runs["fla-core chunk_kda(safe_gate=True)"] = lambda: fla.chunk_gpu(*gpu, safe_gate=True, lower_bound=G_MIN)[0]
    runs["fla-core chunk_kda(safe_gate=False)"] = lambda: fla.chunk_gpu(*gpu, safe_gate=False)[0]
    runs["k3verify kernel:fused_recurrent"] = lambda: kernels.fused_recurrent(*gpu)[0]
    runs["fla-core fused_recurrent_kda"] = lambda: fla.fused_recurrent_gpu(*gpu)[0]
    base_rms = compare(base, ref, ulp_dtype="bf16").rms_ratio
    rows = []
    for name, run in runs.items():
        rms = compare(run().cpu(), ref, ulp_dtype="bf16").rms_ratio
        rows.append(dict(kind="accuracy", implementation=name, rms_ratio=rms, baseline_rms_ratio=base_rms))
        log(f"accuracy {name}: rms ratio {rms:.3e} (naive chunk bf16 {base_rms:.3e})")
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# KDA kernels on {cell(result['device'])}",
        "",
        f"Copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s. Times: do_bench medians, ms; "
        "ours with validate=False (no input value scans; fla-core scans none).",
        "",
        "| kind | shape | ours (defaults) | ours (best, config) | peer | peer ms | peer / ours (defaults) "
        "| peer / ours (best) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["kind"] in ("accuracy", "split"):
            continue
        shape = ", ".join(f"{k}={r[k]}" for k in ("B", "T", "H") if k in r)
        extra = ""
        if "state_tbps" in r:
            extra = f" ({r['state_tbps']:.2f} TB/s, {100 * r['fraction_of_copy']:.0f}% of copy)"
        lines.append(
            f"| {r['kind']} | {shape} | {r['ours_ms']:.4f} | {r['best_ms']:.4f} {cell(r['best_config'])}{extra} | "
            f"{cell(r['peer'])} | {r['peer_ms']:.4f} | {r['ratio']:.2f}x | {r['ratio_best']:.2f}x |"
        )
    lines += ["", "Prefill time per launch (PyTorch profiler, ms per call):", ""]
    lines += ["| shape | implementation | launches |", "|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "split":
            launches = ", ".join(f"{cell(name)} {ms:.3f}" for name, ms in r["launches"].items())
            lines.append(f"| T={r['T']}, H={r['H']} | {cell(r['implementation'])} | {launches} |")
    lines += ["", "| implementation | RMS ratio vs fp64 | naive chunkwise bf16 |", "|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "accuracy":
            lines.append(f"| {cell(r['implementation'])} | {r['rms_ratio']:.3e} | {r['baseline_rms_ratio']:.3e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = gpu_timing.arguments(__doc__, "default launch configuration only, no sweep")
    parser.add_argument("--split", choices=("ours", "all"), help="only the per-launch time split of prefill")
    parser.add_argument("--tune", action="store_true", help="only each prefill launch's time per launch configuration")
    args = parser.parse_args(argv)
    reason = fla.unavailable_reason(gpu=True) if torch.cuda.is_available() else None
    if reason is not None:
        print(f"{reason}: the peer is missing", file=sys.stderr)
        return 2
    begun = gpu_timing.start(args.out, "the KDA GPU benchmark")
    if begun is None:
        return 2
    out, log = begun
    if args.split or args.tune:
        rows = tune_rows(log) if args.tune else split_rows(log, peers=args.split == "all")
        (out / ("kda_gpu_tune.json" if args.tune else "kda_gpu_split.json")).write_text(json.dumps(rows, indent=2))
        return 0
    copy_tbps = copy_bandwidth()
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    rows = prefill_rows(not args.quick, log) + decode_rows(copy_tbps, not args.quick, log) + accuracy_rows(log)
    rows += split_rows(log, peers=True)
    result = dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, rows=rows, environment=environment())
    write_results(out, "kda_gpu", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block AttnRes kernels on a CUDA device: bandwidth, peers in the same process, and accuracy.

    python benchmarks/attnres_gpu.py --out DIR [--quick]

bf16 stream, K3's block of 24 sublayer queries over its largest stored set (8 blocks), at
d = 7168 and, for the peer that needs a power-of-two width (flash-attn-res, timed in a child
process so that a compile that does not end is a timeout), d = 1024 and 2048 (at 4096 and
8192 its compile and autotune take more than 80 s per shape on an H200):

- one block: phase 1 (logits and fp32 statistics for the 24 queries) and one call's phase 2;
- the 93-layer walk's AttnRes work: phase 1 at each of the 8 block starts over its stored
  blocks, phase 2 for each of the 187 calls (sublayer outputs are given tensors: only AttnRes
  is timed).

Bytes moved are the bytes each kernel must read and write once (stored blocks, statistics,
partial sums, outputs), against the device's copy bandwidth measured in the same run. Peers:
flash-attn-res (its two ops, bf16 phase-1 output) and ``torch.compile`` of our chunkwise form
(:mod:`k3verify.attnres.chunkwise`). Ratios are ``peer time / our time`` (> 1: ours is
faster). Accuracy rows: RMS error ratio of one call against the fp64 definition, beside the plain
bf16 definition's. Writes ``attnres_gpu.json``, ``attnres_gpu.md`` and
``attnres_gpu_benchmark.json`` (pytest-benchmark's shape) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from functools import partial
from typing import Any

import gpu_timing
import torch
from gpu_timing import attempt, cell, copy_bandwidth, launch_split, ms, write_results

from k3verify import attnres
from k3verify.adapters import flash_attn_res
from k3verify.attnres import kernels, samples
from k3verify.attnres.chunkwise import Stats, merge, phase1, stored_logits
from k3verify.attnres.schedule import Schedule
from k3verify.harness.environment import environment
from k3verify.numerics import compare
from k3verify.numerics.ops import RMS_NORM_EPS

QUERIES = 24  # one block of 12 layers: 24 sublayer calls
STORED = 8  # the last block's stored set: the embedding and 7 blocks
WIDTHS = (7168, 1024, 2048)  # K3's, and powers of two flash-attn-res compiles in time
TOKENS = (8192, 32768)


def _block_inputs(T: int, d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    stored = torch.randn(STORED, T, d, generator=gen, device="cuda").bfloat16()
    partial = torch.randn(T, d, generator=gen, device="cuda").bfloat16()
    w = torch.randn(QUERIES, d, generator=gen, device="cuda") * 8 / d**0.5
    gamma = 1 + 0.1 * torch.randn(QUERIES, d, generator=gen, device="cuda")
    return dict(stored=stored, partial=partial, w=w, gamma=gamma)


def _compiled_chunkwise():
    """``torch.compile`` of our chunkwise phase 1 and merge, on the bf16 stream in fp32."""

    def first(stored, w, gamma):
        v = stored.float()
        return phase1(stored_logits(v, w, gamma, RMS_NORM_EPS), v)

    def second(m, Z, N, part, w, gamma):
        p = part.float()
        r = attnres.logits(p[None], w, gamma, RMS_NORM_EPS)[0]
        return merge(Stats(m, Z, N), r, p).bfloat16()

    return torch.compile(first), torch.compile(second)


def _block_runs(x: dict[str, torch.Tensor], compiled: tuple) -> dict[tuple[str, str], Any]:
    """Every implementation's phase 1 and phase 2 on one block's inputs, as callables."""
    stored, part, w, gamma = x["stored"], x["partial"], x["w"], x["gamma"]
    one = kernels.phase1(stored, w, gamma)[0]
    first_c, second_c = compiled
    runs: dict[tuple[str, str], Any] = {
        ("phase1", "k3verify"): partial(kernels.phase1, stored, w, gamma),
        ("phase2", "k3verify"): partial(kernels.phase2, one, part, w[0], gamma[0]),
        ("phase1", "torch.compile chunkwise"): partial(first_c, stored, w, gamma),
        ("phase2", "torch.compile chunkwise"): partial(second_c, one.m, one.Z, one.N, part, w[0], gamma[0]),
    }
    return runs


def _flash_runs(x: dict[str, torch.Tensor]) -> dict[tuple[str, str], Any]:
    """flash-attn-res's two ops on one block's inputs (a width it cannot compile: the error)."""
    stored, part, w, gamma = x["stored"], x["partial"], x["w"], x["gamma"]
    phases = flash_attn_res._Phases()
    state = attempt(partial(phases.first, stored, w, gamma, RMS_NORM_EPS))
    if isinstance(state, str):
        return {("phase1", "flash-attn-res"): state}
    return {("phase1", "flash-attn-res"): partial(phases.first, stored, w, gamma, RMS_NORM_EPS),
            ("phase2", "flash-attn-res"): partial(phases.second, state[0], part, w[0], gamma[0], RMS_NORM_EPS,
                                                  torch.bfloat16)}  # fmt: skip


def flash_child(T: int, d: int) -> int:
    """Time flash-attn-res at one shape and print its rows as JSON (run in a child process, so
    that a compile that does not finish is a timeout, not a hung benchmark)."""
    rows = _time_runs(_flash_runs(_block_inputs(T, d)), T, d, None, lambda msg: None)
    print("FLASH_ROWS " + json.dumps(rows))
    return 0


def _flash_rows(T: int, d: int, timeout_s: float, log) -> list[dict[str, Any]]:
    if flash_attn_res.unavailable_reason() is not None:
        return []
    cmd = [sys.executable, __file__, "--flash-child", str(T), str(d)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"flash-attn-res T={T} d={d}: no result within {timeout_s:g} s")
        return [dict(kind="block", phase="phase1", T=T, d=d, implementation="flash-attn-res",
                     error=f"no result within {timeout_s:g} s (compile and autotune included)")]  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("FLASH_ROWS ")), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return [dict(kind="block", phase="phase1", T=T, d=d, implementation="flash-attn-res", error=tail)]
    rows = json.loads(line.removeprefix("FLASH_ROWS "))
    for r in rows:
        log(f"{r['phase']} flash-attn-res T={T} d={d}: " + (f"{r['ms']:.4f} ms" if "ms" in r else r["error"]))
    return rows


def _time_runs(runs: dict[tuple[str, str], Any], T: int, d: int, copy_tbps: float | None,
               log) -> list[dict[str, Any]]:  # fmt: skip
    """One row per run: its time (and, for ours, bytes moved against the copy bandwidth)."""
    moved = {"phase1": STORED * T * d * 2 + QUERIES * T * d * 4, "phase2": T * d * (2 + 4 + 2)}
    rows = []
    for (phase, name), run in runs.items():
        t = run if isinstance(run, str) else attempt(partial(ms, run, f"attnres {phase} T={T} d={d}", name))
        row = dict(kind="block", phase=phase, T=T, d=d, implementation=name)
        if isinstance(t, str):
            rows.append(row | dict(error=t))
            log(f"{phase} {name} T={T} d={d}: {t}")
            continue
        row["ms"] = t
        if name == "k3verify" and copy_tbps:
            tbps = moved[phase] / (t * 1e-3) / 1e12
            row.update(bytes=moved[phase], tbps=tbps, fraction_of_copy=tbps / copy_tbps)
            if phase == "phase1":
                row["split"] = launch_split(run, repeats=5)
        rows.append(row)
        share = f" ({100 * row['fraction_of_copy']:.0f}% of copy)" if "fraction_of_copy" in row else ""
        log(f"{phase} {name} T={T} d={d}: {t:.4f} ms{share}" + (f" {row['split']}" if "split" in row else ""))
    return rows


def block_rows(copy_tbps: float, tokens: tuple[int, ...], peer_timeout: float | None, log) -> list[dict[str, Any]]:
    """Phase 1 and phase 2 of one block: ours and compiled torch in this process, flash-attn-res
    in a child process per shape (it needs a power-of-two width)."""
    rows = []
    compiled = _compiled_chunkwise()
    for T in tokens:
        for d in WIDTHS:
            rows += _time_runs(_block_runs(_block_inputs(T, d), compiled), T, d, copy_tbps, log)
            torch.cuda.empty_cache()
            if peer_timeout is not None:
                rows += _flash_rows(T, d, peer_timeout, log)
    return _with_ratios(rows)


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = {(r["phase"], r["T"], r["d"]): r["ms"] for r in rows if r.get("implementation") == "k3verify" and "ms" in r}
    for r in rows:
        key = (r.get("phase"), r["T"], r["d"])
        if r.get("implementation") != "k3verify" and "ms" in r and key in ours:
            r["ratio_peer_over_ours"] = r["ms"] / ours[key]
    return rows


def _walk_attnres(schedule: Schedule, blocks: torch.Tensor, part: torch.Tensor, w: torch.Tensor,
                  gamma: torch.Tensor) -> None:  # fmt: skip
    """The AttnRes work of a walk: phase 1 at every block start, phase 2 for every call."""
    B = schedule.block_sublayers
    for start in range(0, schedule.num_calls, B):
        queries = slice(start, min(start + B, schedule.num_calls))
        stats = kernels.phase1(blocks[: start // B + 1], w[queries], gamma[queries])
        for s in range(queries.start, queries.stop):
            kernels.phase2(stats[s - start], None if s == start else part, w[s], gamma[s])


def walk_rows(copy_tbps: float, tokens: tuple[int, ...], log) -> list[dict[str, Any]]:
    """The 93-layer walk's AttnRes work (8 phase-1 launches, 187 phase-2 launches) at d = 7168."""
    schedule, d, rows = Schedule(), 7168, []
    B = schedule.block_sublayers
    for T in tokens:
        gen = torch.Generator(device="cuda").manual_seed(1)
        blocks = torch.randn(STORED, T, d, generator=gen, device="cuda").bfloat16()
        part = torch.randn(T, d, generator=gen, device="cuda").bfloat16()
        w = torch.randn(schedule.num_calls, d, generator=gen, device="cuda") * 8 / d**0.5
        gamma = 1 + 0.1 * torch.randn(schedule.num_calls, d, generator=gen, device="cuda")
        moved = 0
        for start in range(0, schedule.num_calls, B):
            Q = min(B, schedule.num_calls - start)
            moved += (start // B + 1) * T * d * 2 + Q * T * d * 4 + T * d * (4 + 2) + (Q - 1) * T * d * (2 + 4 + 2)
        work = partial(_walk_attnres, schedule, blocks, part, w, gamma)
        t = ms(work, f"attnres walk T={T}", "k3verify")
        tbps = moved / (t * 1e-3) / 1e12
        rows.append(dict(kind="walk", T=T, d=d, implementation="k3verify", ms=t, bytes=moved, tbps=tbps,
                         fraction_of_copy=tbps / copy_tbps, split=launch_split(work, repeats=3)))  # fmt: skip
        log(f"walk T={T}: {t:.3f} ms, {100 * tbps / copy_tbps:.0f}% of copy")
        torch.cuda.empty_cache()
    return rows


def accuracy_rows(log) -> list[dict[str, Any]]:
    """One call over 9 sources (T = 256, d = 1024: a width every peer takes), RMS error ratio vs fp64."""
    rows = []
    for scale in (8.0, 96.0):
        inputs, _ = samples.aggregation_sample(9, 256, 1024, logit_scale=scale, seed=3)
        v, w, g = inputs["sources"], inputs["w"], inputs["gamma"]
        ref = attnres.aggregate(v, w, g)
        base = compare(attnres.naive_baseline(v, w, g, dtype="bf16"), ref, ulp_dtype="bf16").rms_ratio
        gpu = [t.cuda().bfloat16() for t in (v, w, g)]
        runs = {"k3verify kernel:two_phase": partial(kernels.aggregate, *gpu)}
        if flash_attn_res.unavailable_reason() is None:
            runs["flash-attn-res"] = partial(flash_attn_res.aggregate, *gpu)
        for name, run in runs.items():
            rms = compare(run().cpu(), ref, ulp_dtype="bf16").rms_ratio
            rows.append(dict(kind="accuracy", logit_scale=scale, implementation=name, rms_ratio=rms,
                             baseline_rms_ratio=base))  # fmt: skip
            log(f"accuracy scale {scale} {name}: {rms:.3e} (plain bf16 definition {base:.3e})")
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Block AttnRes kernels on {cell(result['device'])}", "",
             f"Copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s. Times: do_bench medians, ms. "
             f"bf16 stream, {QUERIES} queries over {STORED} stored blocks.", "",
             "| kind | phase | T | d | implementation | ms | bytes / time | of copy | peer / ours |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if r["kind"] == "accuracy":
            continue
        if "error" in r:
            lines.append(f"| {r['kind']} | {r.get('phase', '')} | {r['T']} | {r['d']} | {cell(r['implementation'])} | "
                         f"{cell(r['error'])} | | | |")  # fmt: skip
            continue
        tb = f"{r['tbps']:.2f} TB/s" if "tbps" in r else ""
        frac = f"{100 * r['fraction_of_copy']:.0f}%" if "fraction_of_copy" in r else ""
        ratio = gpu_timing.ratio_cell(r)
        lines.append(f"| {r['kind']} | {r.get('phase', 'all')} | {r['T']} | {r['d']} | {cell(r['implementation'])} | "
                     f"{r['ms']:.4f} | {tb} | {frac} | {ratio} |")  # fmt: skip
    lines += ["", "| logit scale | implementation | RMS ratio vs fp64 | plain bf16 definition |", "|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "accuracy":
            lines.append(f"| {r['logit_scale']:g} | {cell(r['implementation'])} | {r['rms_ratio']:.3e} | "
                         f"{r['baseline_rms_ratio']:.3e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = gpu_timing.arguments(__doc__, "T = 8192 only")
    parser.add_argument("--peer-timeout", type=float, default=120.0,
                        help="seconds flash-attn-res may take at one shape, compile included (default 120)")
    parser.add_argument("--no-flash", action="store_true", help="leave flash-attn-res out of the block rows")
    parser.add_argument("--flash-child", nargs=2, type=int, metavar=("T", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flash_child:
        return flash_child(*args.flash_child)
    begun = gpu_timing.start(args.out, "the AttnRes GPU benchmark")
    if begun is None:
        return 2
    out, log = begun
    tokens = TOKENS[:1] if args.quick else TOKENS
    copy_tbps = copy_bandwidth()
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    rows = accuracy_rows(log) + block_rows(copy_tbps, tokens, None if args.no_flash else args.peer_timeout, log)
    rows += walk_rows(copy_tbps, tokens, log)
    result = dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, rows=rows, environment=environment(),
                  flash_attn_res=flash_attn_res.version())  # fmt: skip
    write_results(out, "attnres_gpu", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

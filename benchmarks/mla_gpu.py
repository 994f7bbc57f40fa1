"""Gated MLA kernels on a CUDA device: decode bandwidth and prefill throughput, peers in the same process.

    python benchmarks/mla_gpu.py --out DIR [--quick]

K3's MLA shapes (latent R = 512, rope Dr = 64, q/k head 128 + 64, v head 128, pages of 64):

- decode, one query token per request over a paged cache, bf16 or fp8 e4m3 (per-token scales),
  B = 64 and 256, context 4096 and 32768, 12 (TP-local) and 96 heads: our kernel
  (``kernels.latent_attention``: the split-KV launch and the log-sum-exp merge; the split count
  is the fastest of a few, reported) against the bytes it must move (cache and queries read, the
  fp32 latent output written) over the copy bandwidth measured in the same run; and compiled
  ``flex_attention`` on the same latent MQA (``enable_gqa``) over the cache gathered contiguous,
  which pays no page indirection and reads the values (the latent part) as a second tensor.
  Its default launch asks for more shared memory than a Hopper SM has at these shapes, so a few
  ``kernel_options`` are tried in order and the first that runs is timed; every refusal is
  reported.
- prefill, T = 8192 new tokens with no earlier context, causal, 12 and 96 heads: our kernel
  (``kernels.prefill_attention`` on the expanded operands) against torch SDPA's cuDNN,
  memory-efficient and flash backends on the same operands (``[q^n ; q^p]`` joined into one
  192-wide head); TFLOP/s counts the causal half of ``2 T² (192 + 128) H``.

Ratios are ``peer time / our time`` (> 1: ours is faster). Writes ``mla_gpu.json``,
``mla_gpu.md`` and ``mla_gpu_benchmark.json`` (pytest-benchmark's shape) under ``--out``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import gpu_timing
import torch
import torch.nn.functional as F
from gpu_timing import attempt, cell, copy_bandwidth, ms, write_results

from k3verify.harness.environment import environment
from k3verify.mla import kernels
from k3verify.mla.cache import LatentCache

R, DR, DN, DV, PAGE = 512, 64, 128, 128, 64
SCALE = (DN + DR) ** -0.5
DECODE = [(B, ctx, H) for B in (64, 256) for ctx in (4096, 32768) for H in (12, 96)]
PREFILL = [(8192, 12), (8192, 96)]
SPLITS = (1, 2, 4, 8, 16)
QUANTIZE_PAGES = 4096
FLEX_OPTIONS = ({}, {"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
                {"BLOCK_M": 16, "BLOCK_N": 16, "num_stages": 1, "num_warps": 4})  # fmt: skip


def paged_cache(B: int, ctx: int, storage: str, gen: torch.Generator) -> LatentCache:
    """A full cache of ``ctx`` tokens per request on shuffled pages: bf16 entries, or fp8 e4m3
    codes with per-token scales (amax / 448) when ``storage`` is ``fp8``."""
    pages = B * ctx // PAGE
    entries = torch.randn(pages, PAGE, R + DR, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pages, generator=gen, device="cuda").reshape(B, ctx // PAGE)
    lens = torch.full((B,), ctx, dtype=torch.int64, device="cuda")
    if storage == "bf16":
        return LatentCache(entries, table, lens)
    # A few thousand pages at a time: at B = 256, context 32 768 the fp32 temporaries of the
    # whole pool (19 GB each) did not fit an 80 GB device beside the bf16 pool.
    scales = torch.empty(entries.shape[:-1], device="cuda")
    codes = torch.empty(entries.shape, device="cuda", dtype=torch.float8_e4m3fn)
    for at in range(0, pages, QUANTIZE_PAGES):
        part = entries[at : at + QUANTIZE_PAGES].float()
        scales[at : at + QUANTIZE_PAGES] = part.abs().amax(-1) / 448.0
        codes[at : at + QUANTIZE_PAGES] = (part / scales[at : at + QUANTIZE_PAGES, :, None]).to(torch.float8_e4m3fn)
    return LatentCache(codes, table, lens, scales)


def decode_rows(copy_tbps: float, shapes: list[tuple[int, int, int]], log) -> list[dict[str, Any]]:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, ctx, H in shapes:
        for storage in ("bf16", "fp8"):
            cache = paged_cache(B, ctx, storage, gen)
            q_lat = torch.randn(B, 1, H, R, generator=gen, device="cuda").bfloat16()
            q_pe = torch.randn(B, 1, H, DR, generator=gen, device="cuda").bfloat16()
            per_token = (R + DR) * (1 if storage == "fp8" else 2) + (4 if storage == "fp8" else 0)
            moved = B * ctx * per_token + B * H * (R + DR) * 2 + B * H * R * 4
            # Every split count with every launch shape whose head block the heads need (a block
            # of 32 or 64 at 12 heads only masks rows); the default shape's own time beside the best.
            shapes = [s for s in kernels.DECODE_SHAPES if s.heads == kernels.DECODE_LAUNCH.heads or s.heads // 2 < H]
            timed = {}
            for splits in SPLITS:
                for shape in shapes:
                    run = partial(kernels.latent_attention, q_lat, q_pe, cache, scale=SCALE, num_splits=splits,
                                  launch=shape)
                    timed[splits, shape] = (ms(run), run)
            (splits, shape), (_, run) = min(timed.items(), key=lambda kv: kv[1][0])
            default = kernels.decode_launch(H, cache.quantized)
            t = ms(run, f"mla decode B={B} ctx={ctx} H={H} {storage}", "k3verify")
            tbps = moved / (t * 1e-3) / 1e12
            row = dict(kind="decode", B=B, context=ctx, heads=H, cache=storage, implementation="k3verify", ms=t,
                       num_splits=splits, launch=str(shape), bytes=moved, tbps=tbps, fraction_of_copy=tbps / copy_tbps,
                       default_launch_ms=min(timed[n, default][0] for n in SPLITS if (n, default) in timed),
                       shapes={f"{s} splits {n}": round(v[0], 5) for (n, s), v in timed.items()})  # fmt: skip
            rows.append(row)
            log(f"decode B={B} ctx={ctx} H={H} {storage}: {t:.4f} ms, {100 * tbps / copy_tbps:.0f}% of copy "
                f"(splits {splits}, {shape}; the default shape at its best split {row['default_launch_ms']:.4f} ms)")
            if storage == "bf16":
                rows.append(_flex_row(flex, cache, q_lat, q_pe, row, log))
            del cache
            torch.cuda.empty_cache()
    return rows


def _flex_row(flex, cache: LatentCache, q_lat: torch.Tensor, q_pe: torch.Tensor, ours: dict[str, Any],
              log) -> dict[str, Any]:  # fmt: skip
    """Compiled flex_attention on the same latent MQA over the cache gathered contiguous."""
    B, _, H, _ = q_lat.shape
    keys = cache.pool[cache.block_table].reshape(B, 1, -1, R + DR)  # [B, 1, ctx, R + Dr]
    values = keys[..., :R].contiguous()
    q = torch.cat([q_lat, q_pe], -1).transpose(1, 2).contiguous()  # [B, H, 1, R + Dr]
    row = {k: ours[k] for k in ("kind", "B", "context", "heads", "cache")} | dict(implementation="flex_attention")
    refused = []
    for options in FLEX_OPTIONS:
        run = partial(flex, q, keys, values, scale=SCALE, enable_gqa=True, kernel_options=options or None)
        first = attempt(run)
        if isinstance(first, str):
            refused.append(f"{options or 'default'}: {first}")
            continue
        t = ms(run, f"mla decode B={B} ctx={ours['context']} H={H} bf16", "flex_attention")
        row.update(ms=t, kernel_options=options, ratio_peer_over_ours=t / ours["ms"], refused=refused)
        log(f"  flex_attention {options or 'default'}: {t:.4f} ms ({t / ours['ms']:.2f}x ours)")
        return row
    log(f"  flex_attention: no configuration runs: {refused}")
    return row | dict(error="; ".join(refused))


def prefill_rows(shapes: list[tuple[int, int]], log) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION}  # fmt: skip
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for T, H in shapes:
        def rand(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

        q_n, q_p, k_n, v = rand(1, H, T, DN), rand(1, H, T, DR), rand(1, H, T, DN), rand(1, H, T, DV)
        k_p = rand(1, T, DR)
        starts = torch.zeros(1, dtype=torch.int64, device="cuda")
        flops = H * T * T * (DN + DR + DV)  # causal half of 2 T^2 (qk + v) per head
        ours = ms(partial(kernels.prefill_attention, q_n, q_p, k_n, k_p, v, starts, scale=SCALE),
                  f"mla prefill T={T} H={H}", "k3verify")  # fmt: skip
        rows.append(dict(kind="prefill", T=T, heads=H, implementation="k3verify", ms=ours,
                         tflops=flops / (ours * 1e-3) / 1e12))  # fmt: skip
        log(f"prefill T={T} H={H}: {ours:.4f} ms, {flops / (ours * 1e-3) / 1e12:.0f} TFLOP/s")
        q = torch.cat([q_n, q_p], -1)
        k = torch.cat([k_n, k_p[:, None].expand(-1, H, -1, -1)], -1)
        for name, backend in backends.items():
            def run(backend=backend, q=q, k=k, v=v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)

            first = attempt(run)
            row = dict(kind="prefill", T=T, heads=H, implementation=f"sdpa {name}")
            if isinstance(first, str):
                rows.append(row | dict(error=first))
                log(f"  sdpa {name}: {first}")
                continue
            t = ms(run, f"mla prefill T={T} H={H}", f"sdpa {name}")
            rows.append(row | dict(ms=t, tflops=flops / (t * 1e-3) / 1e12, ratio_peer_over_ours=t / ours))
            log(f"  sdpa {name}: {t:.4f} ms ({t / ours:.2f}x ours)")
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Gated MLA kernels on {cell(result['device'])}", "",
             f"Copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s. Times: do_bench medians, ms.", "",
             "| B | context | heads | cache | implementation | ms | of copy | peer / ours | note |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if r["kind"] != "decode":
            continue
        frac = f"{100 * r['fraction_of_copy']:.0f}%" if "fraction_of_copy" in r else ""
        ratio = gpu_timing.ratio_cell(r)
        if "num_splits" in r:  # ours; a peer's row names its options or its error
            # rows from before the launch shapes name their head block only
            shape = r.get("launch") or f"{r.get('heads_per_program', 16)} heads a program"
            note = f"splits {r['num_splits']}, {cell(shape)}"
            if "default_launch_ms" in r:
                note += f"; the default shape {r['default_launch_ms']:.4f} ms"
        else:
            note = cell(r.get("error", "") or f"kernel_options {r.get('kernel_options') or 'default'}")
        t = f"{r['ms']:.4f}" if "ms" in r else "-"
        lines.append(f"| {r['B']} | {r['context']} | {r['heads']} | {r['cache']} | {cell(r['implementation'])} | {t} | "
                     f"{frac} | {ratio} | {note} |")  # fmt: skip
    lines += ["", "| T | heads | implementation | ms | TFLOP/s | peer / ours |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["kind"] == "prefill":
            if "error" in r:
                lines.append(f"| {r['T']} | {r['heads']} | {cell(r['implementation'])} | {cell(r['error'])} | | |")
                continue
            ratio = gpu_timing.ratio_cell(r)
            lines.append(f"| {r['T']} | {r['heads']} | {cell(r['implementation'])} | {r['ms']:.4f} | "
                         f"{r['tflops']:.0f} | {ratio} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = gpu_timing.arguments(__doc__, "decode at B = 64 only")
    args = parser.parse_args(argv)
    begun = gpu_timing.start(args.out, "the MLA GPU benchmark")
    if begun is None:
        return 2
    out, log = begun
    copy_tbps = copy_bandwidth()
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    shapes = [s for s in DECODE if s[0] == 64] if args.quick else DECODE
    rows = decode_rows(copy_tbps, shapes, log) + prefill_rows(PREFILL, log)
    result = dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, rows=rows, environment=environment())
    write_results(out, "mla_gpu", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

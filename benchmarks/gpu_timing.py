"""What every GPU benchmark here times with: ``triton.testing.do_bench`` medians (ms), the
device's copy bandwidth measured in the same process, and the per-launch device time split.
Every timing's repetitions are kept in :data:`SAMPLES` for the pytest-benchmark-shaped JSON
(:mod:`benchmark_json`)."""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

SAMPLES: list[dict[str, Any]] = []


def ms(fn, group: str | None = None, name: str | None = None, **params: Any) -> float:
    """Median of ``do_bench``'s repetitions (ms); with a ``group`` and ``name`` the repetitions
    are kept for the pytest-benchmark JSON."""
    times = [float(t) for t in do_bench(fn, warmup=25, rep=100, return_mode="all")]
    if group is not None:
        import benchmark_json  # pytest-benchmark is needed for timings only, not to read options

        SAMPLES.append(benchmark_json.entry(group, name or "run", times, params))
    return float(statistics.median(times))


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read plus written per second (TB/s)."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src), "copy", "torch copy_ 2 GiB")
    return 2 * src.numel() * 4 / (t * 1e-3) / 1e12


def launch_split(fn, repeats: int = 20) -> dict[str, float]:
    """Device time per call of each kernel ``fn`` launches (ms), from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    split: dict[str, float] = {}
    for event in prof.key_averages():
        total_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if total_us:
            split[event.key[:60]] = total_us / repeats / 1e3
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


def option(item: str) -> tuple[str, Any]:
    """``key=value`` of an experiment's ``--variants`` as ``(key, value)``: a Python literal, else
    the word itself (an eviction policy, ``vector``); a bare ``key`` means ``True``."""
    key, sep, value = item.partition("=")
    if not sep:
        return key, True
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def with_defaults(defaults: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """An experiment's ``defaults`` overridden by ``kw``; unknown keys raise ``KeyError`` naming
    them and the known ones."""
    unknown = sorted(set(kw) - set(defaults))
    if unknown:
        raise KeyError(f"unknown options {unknown}; known: {sorted(defaults)}")
    return defaults | kw


def variant_options(text: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """``key=value,...`` (:func:`option` each) as an experiment's overrides of ``defaults``
    (``KeyError`` for a key that is not one of them)."""
    kw = dict(option(item) for item in filter(None, text.split(",")))
    with_defaults(defaults, kw)
    return kw


def named_variant(text: str, named: dict[str, dict[str, Any]], defaults: dict[str, Any]) -> dict[str, Any]:
    """A variant from ``--variants``: a name in ``named`` followed by ``,key=value`` overrides
    (:func:`variant_options`), or the overrides alone (``KeyError`` for a key that is not an
    option)."""
    name, _, rest = text.partition(",")
    if name in named:
        return named[name] | variant_options(rest, defaults)
    return variant_options(text, defaults)


def named_experiment(doc: str, named: dict[str, dict[str, Any]], defaults: dict[str, Any],
                     usage: Callable[[dict[str, Any]], str], argv: list[str] | None,
                     ) -> tuple[argparse.Namespace, dict[str, dict[str, Any]]] | None:  # fmt: skip
    """The command line of an experiment with named variants: :func:`experiment_arguments`
    (default: every name) and ``--compile``, which prints each variant's ``usage`` (registers
    and shared memory, no GPU) and returns ``None``; else the arguments and the chosen variants
    (:func:`chosen_variants`)."""
    parser = experiment_arguments(doc, list(named))
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 and print resources; no GPU")
    args = parser.parse_args(argv)
    chosen = chosen_variants(parser, args.variants, defaults, named)
    if not args.compile:
        return args, chosen
    import triton

    print(f"Triton {triton.__version__}, sm_90, d = 7168")
    for text, kw in chosen.items():
        print(f"{text:20s} {usage(kw)}", flush=True)
    return None


def experiment_arguments(doc: str, variants: list[str]) -> argparse.ArgumentParser:
    """An AttnRes phase-1 experiment's parser: its docstring's first line, ``--out``,
    ``--variants`` (default ``variants``) and ``--tokens``; the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default="reports/latest/bench", help="output folder")
    parser.add_argument("--variants", nargs="+", default=variants, help="key=value,... over the options")
    parser.add_argument("--tokens", type=int, default=8192)
    return parser


def chosen_variants(parser: argparse.ArgumentParser, texts: list[str], defaults: dict[str, Any],
                    named: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each ``--variants`` text with its overrides of ``defaults`` (after a name in ``named``,
    :func:`named_variant`); a bad one ends the program through ``parser.error``, naming it."""
    try:
        return {text: named_variant(text, named or {}, defaults) for text in texts}
    except (KeyError, ValueError, SyntaxError) as exc:
        names = f" (variants: {', '.join(named)})" if named else ""
        parser.error(f"{exc}{names}")


def agreement(got: Any, ref: Any) -> dict[str, float]:
    """How far phase-1 statistics ``got`` are from ``ref`` (both ``Stats``): the largest
    absolute difference in ``m``, relative in ``Z``, and in ``N`` relative to ``ref``'s largest."""
    return dict(m=(got.m - ref.m).abs().max().item(), Z=((got.Z - ref.Z).abs() / ref.Z).max().item(),
                N=((got.N - ref.N).abs().max() / ref.N.abs().max()).item())  # fmt: skip


def variant_row(name: str, run: Callable[[], Any], ref: Any, moved: float, copy_tbps: float, group: str,
                log: Callable[[str], None], T: int, **fields: Any) -> dict[str, Any]:
    """One AttnRes phase-1 variant's row: ``run()`` (returning its ``Stats``) called twice, its
    :func:`agreement` with ``ref`` and whether the second call gave the same bits, then timed
    (``moved`` bytes against ``copy_tbps``); ``fields`` added to the row. A variant that does
    not compile or run is a result: its row holds the error."""
    try:
        got = run()
        torch.cuda.synchronize()
        again = run()
        torch.cuda.synchronize()
    except Exception as exc:  # a variant that does not compile or run is a result; go on
        log(f"{name}: {type(exc).__name__}: {exc}"[:300])
        return dict(variant=name, **fields, error=f"{type(exc).__name__}: {exc}"[:300])
    agree = agreement(got, ref)
    same = all(torch.equal(getattr(got, f), getattr(again, f)) for f in ("m", "Z", "N"))
    t = ms(run, group, name, T=T)
    frac = moved / (t * 1e-3) / 1e12 / copy_tbps
    log(f"{name}: {t:.4f} ms, {100 * frac:.1f}% of copy; max |dm| {agree['m']:.1e}, dZ {agree['Z']:.1e}, "
        f"dN {agree['N']:.1e}; same bits on a second call: {same}")  # fmt: skip
    return dict(variant=name, **fields, ms=t, fraction_of_copy=frac, agreement=agree, repeatable=same)


def variant_table(rows: list[dict[str, Any]], options: bool) -> list[str]:
    """Markdown rows of an experiment's variants (``variant``, ``ms``, ``fraction_of_copy``,
    ``agreement`` as :func:`agreement`, or ``error``), with an options column if ``options``."""
    head = "| variant | " + ("options | " if options else "")
    lines = [head + "ms | of copy | max abs dm | max rel dZ | max rel dN |",
             "|---|" + ("---|" if options else "") + "---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        first = f"| {r['variant']} | " + (f"{r.get('options', {})} | " if options else "")
        if "error" in r:
            lines.append(first + f"{r['error']} | | | | |")
            continue
        a = r.get("agreement", dict(m=0.0, Z=0.0, N=0.0))
        lines.append(first + f"{r['ms']:.4f} | {100 * r['fraction_of_copy']:.1f}% | {a['m']:.1e} | {a['Z']:.1e} | "
                     f"{a['N']:.1e} |")  # fmt: skip
    return lines


def write_variants(out: Path, stem: str, title: str, T: int, d: int, copy_tbps: float,
                   rows: list[dict[str, Any]], options: bool) -> None:  # fmt: skip
    """An AttnRes phase-1 experiment's results (:func:`variant_table` rows) as :func:`write_results`."""
    from k3verify.harness.environment import environment

    lines = [f"# {title}", "", f"T = {T}, d = {d}, 24 queries over 8 stored blocks, bf16; copy {copy_tbps:.2f} TB/s; "
             "do_bench medians.", "", *variant_table(rows, options)]  # fmt: skip
    result = dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, rows=rows, environment=environment())
    write_results(out, stem, result, "\n".join(lines) + "\n")


def write_results(out: Path, stem: str, result: dict[str, Any], markdown: str) -> None:
    """``<stem>.json`` (the result), ``<stem>_benchmark.json`` (every timing's repetitions in
    pytest-benchmark's shape) and ``<stem>.md`` under ``out``; the Markdown is printed too."""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))
    env = result["environment"]
    import benchmark_json

    bench = benchmark_json.document(SAMPLES, device=result["device"], commit=env.get("git_commit"),
                                    dirty=env.get("git_dirty"))  # fmt: skip
    (out / f"{stem}_benchmark.json").write_text(json.dumps(bench, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def attempt(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the error it raised as one line (a peer that cannot run or compile is a
    result to report, not a crash)."""
    try:
        return fn()
    except Exception as exc:  # reported, not hidden
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"


def start(out: str, what: str) -> tuple[Path, Callable[[str], None]] | None:
    """The output folder (created) and a logger stamping seconds since now; ``None``, with the
    reason on stderr, where there is no CUDA device for ``what``."""
    if not torch.cuda.is_available():
        print(f"no CUDA device: {what} needs one", file=sys.stderr)
        return None
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f} s] {msg}", flush=True)

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder, log


def arguments(doc: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first line, ``--out`` and ``--quick`` (``quick``
    says what it keeps); the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default="reports/latest/bench", help="output folder")
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def ratio_cell(row: dict[str, Any]) -> str:
    """A row's ``peer / ours`` ratio as a table cell (empty for our own rows)."""
    return f"{row['ratio_peer_over_ours']:.2f}x" if "ratio_peer_over_ours" in row else ""

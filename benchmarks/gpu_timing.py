"""What every GPU benchmark here times with: ``triton.testing.do_bench`` medians (ms), the
device's copy bandwidth measured in the same process, and the per-launch device time split.
Every timing's repetitions are kept in :data:`SAMPLES` for the pytest-benchmark-shaped JSON
(:mod:`benchmark_json`)."""

from __future__ import annotations

import argparse
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


CALL = "k3verify.call"


def idle_gaps(fn, top: int = 8) -> dict[str, Any]:
    """Where the device waits on the host in one call of ``fn`` (under the PyTorch profiler, host
    and device on one clock, the call inside a :data:`CALL` range): :func:`gap_report` of
    :func:`spans` of the profiler's events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # a first call for the profiler's own start: its buffer requests held the first kernels
        # of the call it recorded 2.7-3.4 ms on an H100
        fn()
        torch.cuda.synchronize()
        with record_function(CALL):
            fn()
        torch.cuda.synchronize()
    device, host = spans(prof.events())
    if not device:
        raise RuntimeError("the profiler recorded no device activity")
    return gap_report(device, host, top)


def spans(events) -> tuple[list[tuple[float, float]], list[tuple[str, float, float]]]:
    """The device's work and the host's ranges of one profiled call, as :func:`gap_report` takes
    them, from the profiler's ``events`` (objects with ``name``, ``device_type``,
    ``is_user_annotation`` and ``time_range``): device intervals are kernels and copies from the
    :data:`CALL` range's start on, not the device-side copies of ``record_function`` ranges, which
    span the gaps between the kernels they enclose; host ranges are those inside the :data:`CALL`
    range, which is not one of them (what ran before it, such as a warm-up call, is not the
    call's)."""
    from torch.autograd import DeviceType

    call = [e.time_range for e in events if e.device_type == DeviceType.CPU and e.name == CALL]
    if len(call) != 1:
        raise ValueError(f"expected one {CALL!r} range among the events, found {len(call)}")
    start, end = call[0].start, call[0].end
    device, host = [], []
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation and span[0] >= start:
            device.append(span)
        # the closing synchronize is the profiler's wait, not the call's: it would name every gap
        # at the end of the call
        elif (e.device_type == DeviceType.CPU and e.name not in (CALL, "cudaDeviceSynchronize")
              and start <= span[0] <= end):  # fmt: skip
            host.append((e.name, *span))
    return device, host


def gap_report(device: list[tuple[float, float]], host: list[tuple[str, float, float]],
               top: int = 8) -> dict[str, Any]:  # fmt: skip
    """Device busy and idle time of one call (µs in, ms out). ``device``: ``(start, end)`` of each
    kernel or copy; ``host``: ``(name, start, end)`` of each host range. The call spans from the
    first host range or device interval to the last device interval's end; the gaps are that
    span less the union of the device intervals. Each of the ``top`` longest gaps is named by
    the innermost host range that covers at least half of it (``(python)``: none does)."""
    busy: list[list[float]] = []
    for start, end in sorted(device):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    first = min([busy[0][0], *(start for _, start, _ in host)])
    last = busy[-1][1]
    edges = [first] + [x for interval in busy for x in interval] + [last]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]

    def named(a: float, b: float) -> str:
        covering = [(end - start, name) for name, start, end in host if 2 * (min(end, b) - max(start, a)) >= b - a]
        return min(covering)[1] if covering else "(python)"

    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return dict(span_ms=(last - first) / 1e3, busy_ms=sum(b - a for a, b in busy) / 1e3,
                idle_ms=sum(b - a for a, b in gaps) / 1e3,
                gaps=[dict(at_ms=(a - first) / 1e3, ms=(b - a) / 1e3, host=named(a, b)) for a, b in longest])


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


def cell(value: Any) -> str:
    """Free text for a Markdown table cell or heading, escaped (a device name, an implementation,
    an error another library raised, a kernel name from the profiler: none may end a row or add
    markup)."""
    from k3verify.harness.text import md_text

    return md_text(value)


def ratio_cell(row: dict[str, Any]) -> str:
    """A row's ``peer / ours`` ratio as a table cell (empty for our own rows)."""
    return f"{row['ratio_peer_over_ours']:.2f}x" if "ratio_peer_over_ours" in row else ""

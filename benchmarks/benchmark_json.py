"""Timings from outside pytest (the GPU benchmarks' ``do_bench`` samples) written in
pytest-benchmark's JSON shape, so ``pytest-benchmark compare`` reads CPU and GPU runs alike.

    doc = document([entry("prefill B=1 T=8192 H=96", "ours", times_ms, shape, peer="fla-core")])
"""

from __future__ import annotations

import datetime
import platform
from typing import Any

from pytest_benchmark import __version__ as PYTEST_BENCHMARK_VERSION
from pytest_benchmark.stats import Stats


def entry(group: str, name: str, times_ms: list[float], params: dict[str, Any] | None = None,
          **extra_info: Any) -> dict[str, Any]:  # fmt: skip
    """One benchmark: ``times_ms`` are the repetitions (milliseconds, as ``do_bench`` gives
    them); stats are in seconds like pytest-benchmark's own."""
    if not times_ms:
        raise ValueError(f"{group} / {name}: no timings")
    stats = Stats()
    for t in times_ms:
        stats.update(t / 1e3)
    params = dict(params or {})
    param = "-".join(f"{k}={v}" for k, v in params.items())
    return {
        "group": group,
        "name": f"{name}[{param}]" if param else name,
        "fullname": f"benchmarks/kda_gpu.py::{group}::{name}",
        "params": params,
        "param": param,
        "extra_info": extra_info,
        "options": {"timer": "triton.testing.do_bench", "rounds": len(times_ms)},
        # One call per repetition: do_bench times each call on its own.
        "stats": {**stats.as_dict(), "data": [t / 1e3 for t in times_ms], "iterations": 1},
    }


def document(benchmarks: list[dict[str, Any]], *, device: str, commit: str | None = None,
             dirty: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole file, as pytest-benchmark's ``--benchmark-json`` writes it."""
    return {
        "machine_info": {
            "node": platform.node(),
            "machine": platform.machine(),
            "system": platform.system(),
            "python_version": platform.python_version(),
            "device": device,
        },
        "commit_info": {"id": commit, "dirty": dirty},
        "benchmarks": benchmarks,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": PYTEST_BENCHMARK_VERSION,
    }

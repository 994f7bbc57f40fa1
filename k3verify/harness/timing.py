"""Speed beside the verdict: ``k3verify run --time`` times each kernel row's run on its case.

What is timed is the row's ``run(case)`` as the verdict saw it: the cast of the case's fp64
inputs to the row's dtype and the kernel, on the verification case's (small) shapes. The figures
say how a kernel compares with its registered peer on the same call, in the same process; they
are not the production-shape benchmarks of ``benchmarks/`` and never part of a verdict.

- On a CUDA device: ``triton.testing.do_bench`` (it synchronises and flushes the L2 cache between
  calls), the median of its repetitions (at least :data:`MIN_REPEATS`, for a long call too).
- Elsewhere: wall time around each call, the median of at least :data:`MIN_REPEATS` calls within
  :data:`CPU_BUDGET_S`. On a CPU our Triton kernels run in Triton's interpreter, so these times
  measure the interpreter: the report labels them ``cpu``.

A plugin's row is timed in the plugin's own worker process (its run never enters the harness);
its time is what that process reports, which is why times stay out of every verdict.

Timed are the kernel rows (form ``kernel`` or ``kernel:*``) and every row a timed kernel names
as its peer, whatever its form. A row's ``time`` is ``{"median_s", "repeats", "clock", "peer"?,
"ratio"?, "peer_note"?}`` (``{"error"}`` when timing raised): ``ratio`` is the row's median over
its peer's (above 1: slower than the peer), the peer being the row of the same module, case and
dtype that the implementation names (:class:`Peer`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .contract import Case, Implementation, Peer
from .guard import case_for

# CPU clock: at least this many timed calls, more while the budget lasts.
MIN_REPEATS, MAX_REPEATS, CPU_BUDGET_S = 3, 50, 1.0
# do_bench's warm-up and measuring windows (ms), as benchmarks/gpu_timing.py uses them.
CUDA_WARMUP_MS, CUDA_REP_MS = 25, 100
TIMED_FORM = "kernel"


def timed(impl: Implementation) -> bool:
    """Whether ``--time`` times this implementation's rows: its form is a kernel's."""
    return impl.form == TIMED_FORM or impl.form.startswith(TIMED_FORM + ":")


def named_peers(impls: list[Implementation]) -> list[tuple[str, str, tuple[str, ...], dict[str, Any]]]:
    """``(module, dtype, cases, peer)`` of every timed implementation that names a peer (the peer
    as plain values): the rows its peer may be."""
    return [(impl.module, impl.dtype, tuple(impl.cases), _plain(impl.peer)) for impl in impls
            if impl.peer is not None and timed(impl)]


def is_peer(row: dict[str, Any], peers: list[tuple[str, str, tuple[str, ...], dict[str, Any]]]) -> bool:
    """Whether some timed implementation names ``row`` (a row header) as its peer, on the row's
    module, dtype and case: it is timed too, whatever its form."""
    return any(_is_peer_row(row, *named) for named in peers)


def _plain(peer: Peer) -> dict[str, Any]:
    return {"implementation": peer.implementation, "form": peer.form, "params": dict(peer.params)}


def clock() -> str:
    """``cuda`` where a CUDA device times the calls, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def measure(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"median_s", "repeats", "clock"}`` of ``fn()`` (see the module's docstring)."""
    if clock() == "cuda":
        from triton.testing import do_bench

        # do_bench repeats as often as its window holds calls, once for a call longer than the
        # window: the window is stretched to hold MIN_REPEATS calls of the length one call takes.
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        window = max(CUDA_REP_MS, 1.5 * MIN_REPEATS * (time.perf_counter() - start) * 1e3)
        times_ms = [float(t) for t in do_bench(fn, warmup=CUDA_WARMUP_MS, rep=window, return_mode="all")]
        return {"median_s": statistics.median(times_ms) / 1e3, "repeats": len(times_ms), "clock": "cuda"}
    # No warm-up call: the row's verdict has just run the same call (caches, the interpreter's trace).
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_REPEATS or (len(times) < MAX_REPEATS and time.perf_counter() - start < CPU_BUDGET_S):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "repeats": len(times), "clock": "cpu"}


def time_row(impl: Implementation, case: Case) -> dict[str, Any]:
    """The row's ``time``: the implementation's own timer (a plugin's, in its worker) or
    :func:`measure` of its run on a copy of ``case``; the peer it names, unresolved."""
    if impl.time is not None:
        result = checked(impl.time(case), impl.label)
    else:
        given = case_for(impl, case)
        result = measure(lambda: impl.run(given))
    if impl.peer is not None:
        result["peer_of"] = _plain(impl.peer)
    return result


def checked(value: Any, label: str) -> dict[str, Any]:
    """A timing another process reported, as plain numbers; ``ValueError`` naming ``label`` unless
    it has a finite, positive ``median_s``, a positive integer ``repeats`` and a known ``clock``."""
    if not isinstance(value, dict):
        raise ValueError(f"the timing of {label} is not a record")
    median, repeats, where = value.get("median_s"), value.get("repeats"), value.get("clock")
    if not (isinstance(median, float) and math.isfinite(median) and median > 0):
        raise ValueError(f"the timing of {label} has no finite positive median")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 0) or where not in ("cpu", "cuda"):
        raise ValueError(f"the timing of {label} has no repeat count or clock")
    return {"median_s": median, "repeats": repeats, "clock": where}


def first_line(text: Any, limit: int = 200) -> str:
    """The first line of a reason, at most ``limit`` characters (a compiler's error spans many)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _is_peer_row(row: dict[str, Any], module: str, dtype: str, cases: tuple[str, ...], peer: dict[str, Any]) -> bool:
    """``row`` is the ``peer`` that a timed row of ``module`` in ``dtype`` on one of ``cases``
    names: the same module, dtype and case, and :func:`_matches`."""
    return (row["module"], row["dtype"]) == (module, dtype) and row["case"] in cases and _matches(row, peer)


def _matches(row: dict[str, Any], peer: dict[str, Any]) -> bool:
    """``row`` is the peer's: its implementation is the peer's name (any version after it) and its
    form and the peer's parameters agree."""
    name = str(row.get("implementation", ""))
    named = name == peer["implementation"] or name.startswith(peer["implementation"] + " ")
    params = row.get("params") or {}
    return named and row.get("form") == peer["form"] and all(params.get(k) == v for k, v in peer["params"].items())


def with_peer_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every timed row that names a peer gets ``peer`` (the peer row's heading) and ``ratio``
    (its median over the peer's), or ``peer_note`` saying why not (the peer did not run here,
    or was not timed). Rows are changed in place and returned."""
    from .report import row_heading

    for row in rows:
        spec = (row.get("time") or {}).pop("peer_of", None)
        if spec is None:
            continue
        same = [r for r in rows if r is not row and _is_peer_row(r, row["module"], row["dtype"], (row["case"],), spec)]
        peer = next((r for r in same if (r.get("time") or {}).get("median_s")), None)
        if peer is None:
            why = "not timed" if same else "not in this run"
            reason = next((first_line(r["reason"]) for r in same if r.get("reason")), None)
            row["time"]["peer_note"] = (f"peer {spec['implementation']} {spec['form']} {why}"
                                        + (f": {reason}" if reason else ""))
            continue
        row["time"]["peer"] = row_heading(peer)
        row["time"]["ratio"] = row["time"]["median_s"] / peer["time"]["median_s"]
    return rows


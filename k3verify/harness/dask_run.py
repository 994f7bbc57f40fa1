"""The rows of ``k3verify run`` on a Dask cluster (``k3verify run --engine dask``).

One row is one task: a planned (entry, implementation, case name) of
:func:`~k3verify.harness.runner.plan`. The client plans the rows, the workers compute them with
the local engine's own function (:func:`~k3verify.harness.runner.planned_row`) and the client
puts them back in the plan's order, so the rows equal the local engine's row for row (the
seconds an implementation ran, ``wall_s``, aside) whatever order they finish in. What a run does
before and after its rows (the oracle's golden check, the report, its compare) stays in the
client.

A worker finds a row's implementation by its identity among the entry's implementations and the
plugins' orphans, so a plugin's implementation runs there as it runs locally: in a plugin
process of the worker's own (:mod:`k3verify.harness.sandbox`), under the run's ``--timeout``.
The plugin must be installed on every worker; a worker without it fails the row and says so.
A worker builds a module's cases once per seed and keeps them for its later rows.

Faults, as for the map's cells (:func:`~k3verify.harness.dask_engine.run_tasks`): a row whose
worker dies ``retries + 1`` times, or that runs past ``row_timeout`` seconds, is a failed row
whose ``reason`` says so; the run goes on.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..numerics import FAIL
from .contract import Case, Implementation, identity
from .dask_engine import (
    DEFAULT_RETRIES,
    StatusCallback,
    SweepStatus,
    entry_ref,
    kept_case,
    run_tasks,
    running_task,
    worker_entry,
    worker_implementation,
)
from .registry import ModuleEntry
from .runner import planned_row, reason_row

Planned = list[tuple[ModuleEntry, Implementation, str]]


@dataclass(frozen=True)
class RowJob:
    """What a worker needs for one row: its place in the plan (``index``), the entry (by name, or
    pickled by value in ``entry_blob``; ``token`` names it in the worker's caches), the
    implementation's identity, the case's name, the seed of the cases, the plugins' per-call
    timeout in seconds, and the submission's name (``attempt``)."""

    index: int
    module: str
    entry_blob: bytes | None
    token: str
    implementation: tuple[str, ...]
    case: str
    seed: int
    plugin_timeout: float
    attempt: str


def run_row(job: RowJob) -> dict[str, Any]:
    """Compute one row on a worker: ``{"row": the row}``, as the local engine makes it."""
    from . import registry, sandbox

    # As for a map's cell, the clock starts once the entry is loaded (a fresh worker imports the
    # module entries first); the implementations are listed inside it, a plugin's start with them.
    entry = worker_entry(job.module, job.entry_blob, job.token)
    with running_task(job.attempt):
        sandbox.set_timeout(job.plugin_timeout)
        impl = worker_implementation(
            f"run:{job.token}", lambda: [*entry.implementations(), *registry.orphan_implementations()],
            job.implementation)

        def cases() -> dict[str, Case]:
            return kept_case(("run", job.token, job.seed), lambda: entry.make_cases(job.seed))[0]

        row, _ = planned_row(entry, impl, job.case, cases)
        return {"row": row}


def run_rows(planned: Planned, client: Any, *, seed: int = 0, retries: int = DEFAULT_RETRIES,
             row_timeout: float | None = None, plugin_timeout: float | None = None,
             status: StatusCallback = lambda s: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of ``planned`` (:func:`~k3verify.harness.runner.plan`'s list), computed on
    ``client``'s cluster, in its order, and what the engine records of the run: the workers,
    retries, timeout and the counts of rows computed, failed and retried. ``plugin_timeout``:
    the plugins' per-call timeout on the workers (``None``: this process's). ``status`` as for
    :func:`~k3verify.harness.dask_engine.run_tasks`."""
    from . import sandbox

    refs: dict[int, tuple[bytes | None, str]] = {}
    for entry, _, _ in planned:
        if id(entry) not in refs:  # by identity, as the local run builds cases
            refs[id(entry)] = entry_ref(entry)
    limit = sandbox.timeout() if plugin_timeout is None else plugin_timeout
    rows: dict[int, dict[str, Any]] = {}
    st = SweepStatus(total=len(planned), unit="row")

    def job(index: int, attempt: str) -> RowJob:
        entry, impl, case = planned[index]
        blob, token = refs[id(entry)]
        return RowJob(index, entry.name, blob, token, identity(impl), case, seed, limit, attempt)

    def computed(task: _Index, result: dict[str, Any]) -> None:
        rows[task.index] = result["row"]

    def failed(task: _Index, reason: str) -> None:
        entry, impl, case = planned[task.index]
        rows[task.index] = reason_row(entry, impl, case, FAIL, reason)

    # A fresh task group per run: Dask hands back a result it still holds under the same key.
    run_tasks(client, [_Index(i) for i in range(len(planned))], lambda task, attempt: job(task.index, attempt),
              run_row, group=f"k3verify-row-{uuid.uuid4().hex[:12]}", name="run", retries=retries,
              timeout=row_timeout, st=st, computed=computed, failed=failed, status=status)
    missing = [i for i in range(len(planned)) if i not in rows]
    if missing:
        raise RuntimeError(f"the Dask run ended without {len(missing)} rows (first: {missing[0]})")
    engine = {"name": "dask", "workers": len(client.nthreads()), "retries": retries, "row_timeout_s": row_timeout,
              "rows": len(planned), "computed": st.computed, "failed": st.failed, "retried": st.retried}
    return [rows[i] for i in range(len(planned))], engine


@dataclass(frozen=True)
class _Index:
    """A row's task for :func:`~k3verify.harness.dask_engine.run_tasks`: its place in the plan."""

    index: int


"""The overflow-map sweep on a Dask cluster (``k3verify overflow-map --engine dask``).

One cell is one task: a map point with one swept form, or with one registered implementation.
The client plans the cells in the local engine's order (:func:`plan`), hands them to the
cluster a few per worker thread at a time and puts the results back in that order, so the map equals the local
engine's cell for cell whatever order the cells finish in; the frontier, the module's record
and the studies are then made in the client exactly as the local engine makes them
(:func:`~k3verify.harness.overflow_map.finish_map`).

A worker builds a point's case and its fp64 reference once and keeps the last few
(:data:`CASES_KEPT`), keyed by the entry, the point and the seed, so the cells of one point
that land on one worker share them. A registered module travels to the workers by name (each
worker imports k3verify and finds it, and the installed plugins, itself); any other entry (one
a test or a user built with ``dataclasses.replace``) travels pickled by value.

Faults: a cell whose worker process dies (a segfault, ``os.abort()``, the OOM killer) is
submitted again, on whatever worker is left or restarted, until its worker has died
``retries + 1`` times; then it is a failed cell whose ``error`` says so. A cell that runs past
``cell_timeout`` seconds is a failed cell too, and its worker is restarted so the hang does not
hold a slot of the pool. The scheduler counts a death against every cell the dead worker held,
so a worker is given one cell at a time: the LocalCluster's scheduler queues the cells
(``worker-saturation`` 1.0) and the client keeps only a few per thread out (none waiting where
cells ask for a GPU, which the scheduler does not queue). On an existing cluster whose
scheduler gives a worker more than one (its ``worker-saturation`` above 1.0), a cell waiting
on a worker that dies counts that death too.

Resume: every finished cell is appended, as one JSON line keyed by a hash of the cell's task,
the seed, the quick flag and the code's version (commit and source digest), to a partial file
(the command line uses ``<out>/.partial/<module>.jsonl``); a sweep started again with the same
arguments takes the cells it finds there and computes only the others. Failed cells are not
kept: a rerun tries them again.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import identity
from .files import UsageError
from .map_files import sound_cell
from .overflow_map import (
    MapDefinition,
    MapOptions,
    MapResult,
    _registered_cell,
    finish_map,
    form_base,
    form_cell,
    map_implementations,
    measured_cell,
    registered_at,
    registered_base,
    run_studies,
)
from .partial import append_piece, as_json, open_sink, piece_key, read_partial

INSTALL_HINT = "pip install 'k3verify[dask]'"
DEFAULT_RETRIES = 2
CASES_KEPT = 8  # points whose case and reference a worker keeps: the cells of a point arrive together
# Cells out per worker thread: the scheduler holds all but one of them in its queue (the cells
# of a large task group are root-ish, and worker-saturation 1.0 gives a worker one at a time),
# so a worker starts its next cell without waiting for the client. Cells that ask for a GPU are
# never queued there; they go out one per thread.
QUEUED_PER_THREAD = 4
POLL_S = 0.5  # how often the client looks for cells past their timeout
NO_WORKERS_S = 300.0  # a cluster with no worker for this long ends the sweep
log = logging.getLogger("k3verify.dask")


def require_dask() -> Any:
    """The ``distributed`` package; ``UsageError`` naming the extra to install when it is missing."""
    try:
        import dask  # noqa: F401
        import distributed
    except ImportError as exc:
        raise UsageError(f"--engine dask needs dask and distributed ({exc.name} is not installed): "
                         f"{INSTALL_HINT}") from None
    return distributed


@dataclass(frozen=True)
class DaskOptions:
    """Where the tasks (map cells, run rows) run: an existing cluster (``scheduler``, its address)
    or a LocalCluster of ``workers`` single-threaded worker processes (default: one per core);
    how often a task whose worker died is submitted again (``retries``) and after how many
    seconds a running task is failed (``task_timeout``, ``None``: never)."""

    scheduler: str | None = None
    workers: int | None = None
    retries: int = DEFAULT_RETRIES
    task_timeout: float | None = None


@dataclass(frozen=True)
class CellTask:
    """One cell to compute: its place in the map's cell order (``index``), its point, and either
    the index of a swept form in ``forms(options)`` or the identity of a registered
    implementation. ``base`` holds the cell's sweep keys (a failed cell is made of them) and
    ``key`` the hash a partial file stores the finished cell under."""

    index: int
    point_index: int
    point: dict[str, Any]
    form: int | None
    implementation: tuple[str, ...] | None
    base: dict[str, Any]
    key: str


@dataclass
class SweepStatus:
    """Where a Dask sweep stands: tasks done (computed now, found in the partial file, or failed),
    failed, submitted again after their worker died, and the time since it began; ``unit`` names
    a task (``cell``, ``row``)."""

    total: int
    unit: str = "cell"
    done: int = 0
    failed: int = 0
    retried: int = 0
    resumed: int = 0
    computed: int = 0
    elapsed_s: float = 0.0
    # (task index, reason) of every failed cell, in the order they failed.
    failures: list[tuple[int, str]] = field(default_factory=list)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate tasks were finished in this run; ``None`` before the first."""
        fresh = self.done - self.resumed
        if fresh <= 0:
            return None
        return (self.total - self.done) * self.elapsed_s / fresh

    def text(self) -> str:
        """One line: ``12 failed, 3 retried, 40 resumed, ETA 1:05`` (the counts that are not zero)."""
        parts = [f"{n} {what}" for n, what in ((self.failed, "failed"), (self.retried, "retried"),
                                               (self.resumed, "resumed")) if n]
        eta = self.eta_s
        if eta is not None and self.done < self.total:
            parts.append(f"ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        return ", ".join(parts)


StatusCallback = Callable[[SweepStatus], None]


# --- planning (client) -----------------------------------------------------------------------


def plan(entry: Any, options: MapOptions, commit: str | None) -> list[CellTask]:
    """Every cell of ``entry``'s map in the local engine's order: at each point its swept forms,
    then the registered implementations that run there. ``commit`` (the code's) enters each
    cell's key, so a partial file from other code is never taken."""
    d: MapDefinition = entry.overflow_map
    forms = d.forms(options)
    impls = map_implementations(entry)
    tasks: list[CellTask] = []
    for p, point in enumerate(d.points(options)):
        work: list[tuple[int | None, tuple[str, ...] | None, dict[str, Any]]] = [
            (i, None, form_base(entry, f, point)) for i, f in enumerate(forms)]
        work += [(None, identity(impl), registered_base(entry, impl, point, d))
                 for impl in registered_at(d, impls, point)]
        for form, impl, base in work:
            index = len(tasks)
            what = {"module": entry.name, "index": index, "point": point, "form": form, "implementation": impl,
                    "base": base, "seed": options.seed, "quick": options.quick,
                    "x_values": None if options.x_values is None else list(options.x_values), "commit": commit}
            key = piece_key(what)
            tasks.append(CellTask(index, p, point, form, impl, base, key))
    return tasks


def failed_cell(task: CellTask, reason: str) -> dict[str, Any]:
    """The cell of a task that gave no result: its sweep keys, not finite, no metrics, and the
    reason in ``error``. Its prediction is unknown, so it counts as a disagreement."""
    return task.base | {"finite": False, "predicted_finite": True, "rms_ratio": None, "max_abs": None,
                        "nonfinite": None, "error": reason}


# --- the worker side -------------------------------------------------------------------------


@dataclass(frozen=True)
class CellJob:
    """What a worker needs for one cell: the entry (by name, or pickled by value in
    ``entry_blob``; ``token`` names it in the worker's caches), the map options and the task.
    ``attempt`` names this submission (the worker's list of running cells shows it)."""

    module: str
    entry_blob: bytes | None
    token: str
    options: MapOptions
    task: CellTask
    attempt: str


@dataclass
class _WorkerState:
    """A worker process's caches (one sweep's entries, forms and recent cases) and the cells it
    is running, with their start times (read by :func:`running_cells`)."""

    entries: dict[str, Any] = field(default_factory=dict)
    forms: dict[tuple[str, MapOptions], list[Any]] = field(default_factory=dict)
    impls: dict[str, dict[tuple[str, ...], Any]] = field(default_factory=dict)  # by a caller's key
    cases: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    running: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _WorkerState()


def entry_ref(entry: Any) -> tuple[bytes | None, str]:
    """How ``entry`` travels to the workers: ``(None, "registry:<name>")`` for a registered module
    (each worker finds it itself), else ``(its cloudpickle, a digest of it)``; the second item
    names it in the workers' caches."""
    from . import registry

    try:
        registered = registry.get(entry.name) is entry
    except registry.UnknownModuleError:
        registered = False
    if registered:
        return None, f"registry:{entry.name}"
    import cloudpickle

    blob = cloudpickle.dumps(entry)
    return blob, hashlib.sha256(blob).hexdigest()[:16]


def worker_entry(module: str, blob: bytes | None, token: str) -> Any:
    """On a worker: the entry :func:`entry_ref` sent (``module`` its name), loaded once per token."""
    if token not in _STATE.entries:
        if blob is None:
            from . import registry

            _STATE.entries[token] = registry.get(module)
        else:
            import cloudpickle

            _STATE.entries[token] = cloudpickle.loads(blob)
    return _STATE.entries[token]


@contextlib.contextmanager
def running_task(attempt: str) -> Iterator[Callable[[], float]]:
    """On a worker: the block runs task ``attempt``, listed in :func:`running_cells` (which the
    client's timeout reads) until it ends; yields the seconds since it began."""
    with _STATE.lock:
        _STATE.running[attempt] = began = time.monotonic()
    try:
        yield lambda: time.monotonic() - began
    finally:
        with _STATE.lock:
            _STATE.running.pop(attempt, None)


def kept_case(key: tuple[Any, ...], build: Callable[[], Any]) -> tuple[Any, bool]:
    """On a worker: what ``build()`` makes for ``key`` (a point's case and reference, a module's
    cases), from the worker's cache of the last :data:`CASES_KEPT` when there, and whether this
    call built it."""
    with _STATE.lock:  # a worker of several threads runs tasks side by side
        kept = _STATE.cases.get(key)
        if kept is not None:
            _STATE.cases.move_to_end(key)
    if kept is not None:
        return kept, False
    kept = build()
    with _STATE.lock:
        _STATE.cases[key] = kept
        while len(_STATE.cases) > CASES_KEPT:
            _STATE.cases.popitem(last=False)
    return kept, True


def worker_implementation(key: str, impls: Callable[[], list[Any]], wanted: tuple[str, ...]) -> Any:
    """On a worker: the implementation of identity ``wanted`` among ``impls()`` (listed once per
    ``key``, plugins included); ``LookupError`` when this worker has none of that identity."""
    if key not in _STATE.impls:
        _STATE.impls[key] = {identity(i): i for i in impls()}
    impl = _STATE.impls[key].get(wanted)
    if impl is None:
        raise LookupError(f"{' '.join(wanted)} is not registered on this worker (is its plugin installed there?)")
    return impl


def run_cell(job: CellJob) -> dict[str, Any]:
    """Compute one cell on a worker: ``{"cell": the cell, "built_case": whether this call built
    the point's case, "seconds": how long it took}``. The point's case and fp64 reference come
    from the worker's cache when an earlier cell of the point ran here."""
    # The cell's clock starts once the entry is loaded (a fresh worker imports the module
    # entries first): the timeout is the cell's, case and reference included.
    entry = worker_entry(job.module, job.entry_blob, job.token)
    with running_task(job.attempt) as seconds:
        d: MapDefinition = entry.overflow_map
        task = job.task
        where = (job.token, job.options.seed, task.point_index, json.dumps(task.point, sort_keys=True, default=str))

        def build() -> tuple[Any, Any]:
            case = d.make_case(task.point, job.options.seed)
            return case, d.reference(case)

        (case, ref), built = kept_case(where, build)
        if task.form is not None:
            if (job.token, job.options) not in _STATE.forms:
                _STATE.forms[(job.token, job.options)] = d.forms(job.options)
            cell = form_cell(entry, _STATE.forms[(job.token, job.options)][task.form], case, task.point, ref)
        else:
            impl = worker_implementation(job.token, lambda: map_implementations(entry), task.implementation or ())
            cell = _registered_cell(entry, impl, case, task.point, ref, d, measured_cell)
        return {"cell": cell, "built_case": built, "seconds": seconds()}


def running_cells() -> dict[str, float]:
    """The cells this worker is running: attempt key -> seconds since it began (``Client.run``
    calls this on the worker's event loop, beside the thread the cell runs in)."""
    now = time.monotonic()
    with _STATE.lock:
        return {key: now - began for key, began in _STATE.running.items()}


async def exit_worker() -> None:
    """End this worker's process now, whatever its threads are doing (a hung cell's worker).
    A coroutine: ``Client.run`` sends one without waiting for its answer, which never comes."""
    os._exit(70)


def _allowed_failures(dask_scheduler: Any) -> int:
    return int(dask_scheduler.allowed_failures)


try:  # the plugin's base class; without dask the engine is refused before it is needed (require_dask)
    from distributed import WorkerPlugin as _WorkerPlugin
except ImportError:
    _WorkerPlugin = object  # type: ignore[assignment,misc]


class OneDevice(_WorkerPlugin):  # type: ignore[misc,valid-type]
    """A worker plugin that gives each worker of a LocalCluster on a CUDA machine its own device
    (worker ``n`` takes device ``n mod count``); tasks then ask for the ``GPU`` resource, one each."""

    name = "k3verify-one-device"

    def setup(self, worker: Any) -> None:
        import torch

        if torch.cuda.is_available() and isinstance(worker.name, int):
            torch.cuda.set_device(worker.name % torch.cuda.device_count())


class NoInterrupt(_WorkerPlugin):  # type: ignore[misc,valid-type]
    """A worker plugin that makes the worker processes of a LocalCluster ignore SIGINT. They
    share the terminal's process group, so Ctrl-C reached each of them and each printed its own
    KeyboardInterrupt traceback; the client alone ends the sweep (its cells kept for the resume)
    and closing the cluster stops the workers."""

    name = "k3verify-no-interrupt"

    def setup(self, worker: Any) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def revive(client: Any) -> int:
    """Start again the workers of a LocalCluster made in this process whose nanny gave up;
    return how many. A nanny restarts a worker process that dies, but not one that dies while
    it starts (a cell that crashes at once, sent to the fresh worker the moment it registers:
    a wider window on a loaded machine): the nanny closes, and 15 s later the cluster drops it
    without starting another. A cluster this process did not start (``--scheduler``) is left
    to whoever runs it."""
    cluster = getattr(client, "cluster", None)
    workers, spec = getattr(cluster, "workers", None), getattr(cluster, "worker_spec", None)
    if not isinstance(workers, dict) or not isinstance(spec, dict):
        return 0
    from distributed.core import Status

    ended = (Status.closing, Status.closed, Status.failed)
    closed = [n for n, w in list(workers.items()) if getattr(w, "status", None) in ended]
    missing = [name for name in spec if name not in workers or name in closed]
    if missing:
        log.info("starting again the workers whose nanny gave up: %s", missing)

        def forget() -> None:  # on the cluster's own loop, which reads its workers there
            for name in closed:
                workers.pop(name, None)

        cluster.loop.add_callback(forget)
        cluster.scale(len(spec))  # then, on that loop, a nanny for every spec without one
    return len(missing)


# --- the client ------------------------------------------------------------------------------


@contextlib.contextmanager
def dask_client(options: DaskOptions) -> Iterator[Any]:
    """A Dask client of the cluster ``options`` name: the scheduler at ``options.scheduler``, or a
    LocalCluster of ``options.workers`` single-threaded worker processes started for the block
    (on a CUDA machine each worker declares one ``GPU`` and is pinned to a device of its own)."""
    distributed = require_dask()
    import dask

    if options.scheduler is not None:
        with distributed.Client(options.scheduler) as client:
            yield client
        return
    import torch

    cuda = torch.cuda.is_available()
    workers = options.workers or os.cpu_count() or 1
    # The scheduler fails a cell only through the sweep's own count (run_sweep): it reports
    # every worker death at once, and one cell at a time per worker thread is sent.
    settings = {"distributed.scheduler.allowed-failures": 0, "distributed.scheduler.worker-saturation": 1.0}
    with dask.config.set(settings), distributed.LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
        resources={"GPU": 1} if cuda else None, silence_logs=logging.CRITICAL,
    ) as cluster, distributed.Client(cluster) as client:
        client.register_plugin(NoInterrupt())
        if cuda:
            client.register_plugin(OneDevice())
        yield client


def run_sweep(entry: Any, options: MapOptions, client: Any, *, retries: int = DEFAULT_RETRIES,
              cell_timeout: float | None = None, partial: Path | None = None, commit: str | None = None,
              status: StatusCallback = lambda s: None, doing: Callable[[str], None] = lambda text: None) -> MapResult:
    """``entry``'s overflow map with every cell computed on ``client``'s cluster (see the module
    docstring). ``partial`` is the resume file (``None``: no resume); ``status`` is called after
    every finished cell; an exception it raises (an interrupt) ends the sweep, the cells finished
    so far kept in ``partial``. The module's studies run here after the cells, ``doing`` naming
    each as it starts (one can take minutes with no cell ending). ``meta["engine"]`` records the
    cluster, the counts and how many times the workers built a point's case, and the seconds the
    workers spent in the cells (case and reference builds included)."""
    tasks = plan(entry, options, commit)
    blob, token = entry_ref(entry)
    cells: dict[int, dict[str, Any]] = read_partial(partial, {t.key: t.index for t in tasks}, sound_cell)
    st = SweepStatus(total=len(tasks), done=len(cells), resumed=len(cells))
    measured = {"builds": 0, "cell_s": 0.0}
    workers = len(client.nthreads())
    sink = open_sink(partial)
    log.info("%s overflow map: %d cells, %d found in %s", entry.name, len(tasks), len(cells), partial)

    def computed(task: CellTask, result: dict[str, Any]) -> None:
        measured["builds"] += bool(result["built_case"])
        measured["cell_s"] += result["seconds"]
        cells[task.index] = as_json(result["cell"])
        append_piece(sink, task.key, task.index, cells[task.index])

    def failed(task: CellTask, reason: str) -> None:
        cells[task.index] = as_json(failed_cell(task, reason))

    try:
        run_tasks(client, [t for t in tasks if t.index not in cells],
                  lambda task, attempt: CellJob(entry.name, blob, token, options, task, attempt), run_cell,
                  group=f"k3verify-cell-{entry.name}-{token}", name=entry.name, retries=retries,
                  timeout=cell_timeout, st=st, computed=computed, failed=failed, status=status)
    finally:
        if sink is not None:
            sink.close()

    missing = [t.index for t in tasks if t.index not in cells]
    if missing:
        raise RuntimeError(f"the Dask sweep ended without {len(missing)} cells (first: {missing[0]})")
    curves = run_studies(entry, options, doing=doing)
    result = finish_map(entry, options, [cells[t.index] for t in tasks], curves)
    result.meta["engine"] = {"name": "dask", "workers": workers, "retries": retries,
                             "cell_timeout_s": cell_timeout, "cells": len(tasks), "computed": st.computed,
                             "resumed": st.resumed, "failed": st.failed, "retried": st.retried,
                             "case_builds": measured["builds"], "cell_s": round(measured["cell_s"], 2)}
    return result


def task_resources(client: Any) -> dict[str, int] | None:
    """What one task asks of a worker on ``client``'s cluster: one ``GPU`` where the workers
    declare GPUs (as :func:`dask_client` starts them on a CUDA machine), else nothing."""
    workers = client.scheduler_info()["workers"].values()
    return {"GPU": 1} if any("GPU" in w.get("resources", {}) for w in workers) else None


def run_tasks(client: Any, tasks: Sequence[Any], job: Callable[[Any, str], Any], fn: Callable[[Any], Any], *,
              group: str, name: str, retries: int, timeout: float | None, st: SweepStatus,
              computed: Callable[[Any, Any], None], failed: Callable[[Any, str], None],
              status: StatusCallback = lambda s: None) -> None:
    """Run ``fn(job(task, attempt))`` on ``client``'s cluster for every task of ``tasks`` (each
    has an ``index``, unique among them), one Dask task per submission, ``attempt`` naming it;
    ``computed(task, result)`` gets what it returned, ``failed(task, reason)`` a task that raised,
    whose worker died ``retries + 1`` times, or that ran past ``timeout`` seconds (its worker is
    then restarted). ``st`` counts them (``st.unit`` names a task in the reasons); ``status(st)``
    is called at the start and after every finished task, and an exception it raises ends the
    run, the tasks still out cancelled. ``group`` names the run's Dask task group and ``name``
    the run in the log."""
    distributed = require_dask()
    unit = st.unit
    try:
        allowed = int(client.run_on_scheduler(_allowed_failures))
    except Exception:  # a scheduler that refuses run_on_scheduler: assume Dask's default
        allowed = 3
    resources = task_resources(client)

    pending = collections.deque(tasks)
    deaths: dict[int, int] = collections.Counter()
    running: dict[Any, Any] = {}
    attempts: dict[str, Any] = {}  # attempt key -> future
    submitted = 0
    began = time.perf_counter()
    last_poll, slots, slots_at, no_workers_since = began, 0, -math.inf, None

    def finish(task: Any, result: Any = None, reason: str | None = None) -> None:
        st.done += 1
        if reason is not None:
            failed(task, reason)
            st.failed += 1
            st.failures.append((task.index, reason))
            log.info("%s %s %d failed: %s", name, unit, task.index, reason)
        else:
            computed(task, result)
            st.computed += 1
        st.elapsed_s = time.perf_counter() - began
        status(st)

    try:
        status(st)
        while pending or running:
            now = time.perf_counter()
            if now - slots_at > 1.0:  # the cluster's threads, as workers die and come back
                revive(client)
                slots, slots_at = sum(client.nthreads().values()), now
                no_workers_since = (no_workers_since or now) if slots == 0 else None
                if no_workers_since is not None and now - no_workers_since > NO_WORKERS_S:
                    raise RuntimeError(f"the Dask cluster has had no worker for {NO_WORKERS_S:g} s")
            while pending and len(running) < slots * (1 if resources else QUEUED_PER_THREAD):
                task = pending.popleft()
                submitted += 1
                attempt = f"{group}-{submitted}"
                # One task group per run (the key's first item names it), so that the scheduler
                # queues the tasks and sends a worker its next one only when it is free.
                future = client.submit(fn, job(task, attempt), key=(group, task.index, submitted), pure=False,
                                       resources=resources)
                running[future], attempts[attempt] = task, future
            if not running:
                time.sleep(0.1)
                continue
            try:
                done, _ = distributed.wait(list(running), timeout=POLL_S, return_when="FIRST_COMPLETED")
            except distributed.TimeoutError:
                done = set()
            for future in done:
                task = running.pop(future)
                attempts.pop(f"{group}-{future.key[2]}", None)
                if future.status == "finished":
                    finish(task, future.result())
                    continue
                exc = future.exception() if future.status == "error" else None
                future.release()
                if exc is None or isinstance(exc, distributed.KilledWorker):
                    # A worker died under it (or the cluster lost it): each KilledWorker stands for
                    # allowed + 1 deaths, as the scheduler counts them.
                    deaths[task.index] += 0 if exc is None else allowed + 1
                    if deaths[task.index] > retries:
                        finish(task, reason=f"worker died {deaths[task.index]} times running this {unit}")
                    else:
                        st.retried += 1
                        log.info("%s %s %d: its worker died; submitted again", name, unit, task.index)
                        pending.appendleft(task)
                else:
                    finish(task, reason=f"{type(exc).__name__}: {exc}")
            if timeout is not None and time.perf_counter() - last_poll >= POLL_S:
                last_poll = time.perf_counter()
                _stop_overdue(client, running, attempts, timeout, unit, finish)
    finally:
        if running:
            with contextlib.suppress(Exception):  # a client already cut off: the original error matters
                client.cancel(list(running))


def _stop_overdue(client: Any, running: dict[Any, Any], attempts: dict[str, Any], timeout: float, unit: str,
                  finish: Callable[..., None]) -> None:
    """Fail every running task that is past ``timeout`` and restart the worker running it (its
    thread cannot be stopped from outside; a fresh process frees the slot)."""
    try:
        seen = client.run(running_cells, on_error="ignore")
    except Exception:  # a worker going away mid-call: look again at the next poll
        return
    overdue: list[str] = []
    for address, keys in seen.items():
        if not isinstance(keys, dict):
            continue
        for key, elapsed in keys.items():
            future = attempts.get(key)
            if future is None or elapsed <= timeout:
                continue
            task = running.pop(future)
            attempts.pop(key)
            future.cancel()
            finish(task, reason=f"ran past the {unit} timeout of {timeout:g} s")
            overdue.append(address)
    if overdue:
        # The process ends at once (a graceful close would wait for the hung thread); its nanny
        # starts a fresh one.
        client.run(exit_worker, workers=sorted(set(overdue)), wait=False)


def sweep_map_dask(entry: Any, options: MapOptions, dask_options: DaskOptions, *, client: Any = None,
                   partial: Path | None = None, status: StatusCallback = lambda s: None) -> MapResult:
    """:func:`run_sweep` on ``client``, or on a client of the cluster ``dask_options`` name,
    opened for this map; the code's version (its commit and a digest of its source) comes from
    :func:`~k3verify.harness.environment.code_version`."""
    from .environment import code_version

    commit = code_version()
    kwargs = dict(retries=dask_options.retries, cell_timeout=dask_options.task_timeout, partial=partial,
                  commit=commit, status=status)
    if client is not None:
        return run_sweep(entry, options, client, **kwargs)
    with dask_client(dask_options) as opened:
        return run_sweep(entry, options, opened, **kwargs)

"""Tensor parallelism on a real process group: run a function on ``N`` ranks of
``torch.distributed`` (gloo on the CPU, NCCL on CUDA) and collect what each rank returns.

    results = run_ranks("k3verify.moe.sharded:rank_forward", 8, payload)

Each rank is a fresh process, forked from a server that has imported torch once, that joins
the group through a rendezvous file, runs ``target(rank, world_size, payload)`` with one CPU
thread (eight ranks on a two-core machine must not each start a thread pool) and sends back
its result. A rank that raises, dies or
hangs ends the call with :class:`RankFailure` naming the rank, within ``timeout_s`` plus one
polling interval, and every other rank is stopped: a collective whose peer is gone would
otherwise wait for ever.
"""

from __future__ import annotations

import datetime
import importlib
import io
import queue as queues
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..numerics import relative_max_error

POLL_S = 0.5


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish; the message names it."""


def run_ranks(target: str, world_size: int, payload: Any, *, backend: str = "gloo",
              timeout_s: float = 120.0) -> list[Any]:  # fmt: skip
    """``target`` (``"package.module:function"``) on ``world_size`` ranks; the results by rank.

    ``payload`` is pickled to every rank; a rank returns tensors, or dicts and lists of them
    (read back as data, never as code). ``backend`` is ``gloo`` or ``nccl`` (rank ``r`` on GPU
    ``r``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    resolve_target(target)  # a bad name fails here, not in eight processes
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="k3verify-tp-") as tmp:
        results: queues.Queue = ctx.Queue()
        init = (Path(tmp) / "rendezvous").as_uri()
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(rank, world_size, backend, init, target, payload, results, timeout_s))
                 for rank in range(world_size)]  # fmt: skip
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)


def _context() -> Any:
    """Where ranks come from: a fork server that imported torch and this module once, so a rank
    starts in milliseconds instead of importing torch again (eight ranks on two cores spent most
    of a ``--tp 8`` run importing). The server never touches CUDA, so NCCL ranks may use it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def run_calls(target: str, world_size: int, payloads: list[Any], **options: Any) -> list[list[Any]]:
    """``target`` on every payload in one launch (starting ranks costs seconds): for each
    payload, the results by rank. ``options`` as :func:`run_ranks`."""
    per_rank = run_ranks("k3verify.harness.tp:_each", world_size, (target, list(payloads)), **options)
    return [[ranks[i] for ranks in per_rank] for i in range(len(payloads))]


def _each(rank: int, world_size: int, job: tuple[str, list[Any]]) -> list[Any]:
    target, payloads = job
    fn = resolve_target(target)
    return [fn(rank, world_size, payload) for payload in payloads]


def _collect(procs: list, results: queues.Queue, timeout_s: float) -> list[Any]:
    """Wait for one answer per rank; raise on the first raise, death or timeout."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:  # what arrives after the deadline is late, however soon after
                raise queues.Empty
            rank, ok, value = results.get(timeout=min(POLL_S, remaining))
        except queues.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                rank, code = dead[0]
                raise RankFailure(f"rank {rank} of {len(procs)} died (exit code {code}) before returning") from None
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in got]
                raise RankFailure(f"ranks {missing} of {len(procs)} did not finish within {timeout_s:g} s") from None
            continue
        if not ok:
            raise RankFailure(_root_cause(procs, got, rank, value))
        got[rank] = torch.load(io.BytesIO(value), weights_only=True)
    return [got[r] for r in range(len(procs))]


def _root_cause(procs: list, got: dict[int, Any], rank: int, error: str) -> str:
    """Why a rank raised: a peer that died makes the others' collectives fail, so the dead
    peer (if any, within a second) is named first."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
        if dead:
            peer, code = dead[0]
            last = error.strip().splitlines()[-1]
            return (f"rank {peer} of {len(procs)} died (exit code {code}); rank {rank} then failed in a "
                    f"collective: {last}")  # fmt: skip
        time.sleep(0.05)
    return f"rank {rank} of {len(procs)} raised:\n{error}"


def disagreement(results: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]],
                 limit: float) -> str | None:  # fmt: skip
    """The first rank and tensor whose normwise relative max error against ``expected`` (the
    unsharded computation's share of that rank) exceeds ``limit``; ``None`` when all agree."""
    for rank, (got, want) in enumerate(zip(results, expected)):
        for name, ref in want.items():
            err = relative_max_error(got[name], ref)
            if not err <= limit:
                return f"rank {rank}: {name!r} is {err:.3e} away from the unsharded computation (limit {limit:.0e})"
    return None


def resolve_target(target: str) -> Any:
    """The function ``"k3verify.module:function"`` names (only k3verify functions run in a rank)."""
    module, _, name = target.partition(":")
    if not module.startswith("k3verify.") or not name:
        raise ValueError(f"target must name a k3verify function as 'k3verify.module:function', got {target!r}")
    return getattr(importlib.import_module(module), name)


def _rank_main(rank: int, world_size: int, backend: str, init: str, target: str, payload: Any,
               results: queues.Queue, timeout_s: float) -> None:  # fmt: skip
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        value = resolve_target(target)(rank, world_size, payload)
        # As bytes: a tensor sent as shared memory dies with this process, which may exit
        # before the parent has read it.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # everything a rank hits goes back to the parent, named
        results.put((rank, False, traceback.format_exc(limit=6)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

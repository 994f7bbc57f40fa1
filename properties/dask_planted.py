"""Module entries for the Dask engine's tests: a registered map cut to its first points, with
planted swept forms that misbehave at one point (abort their process, kill it once, hang); and
a registered module with planted implementations whose one row misbehaves the same way.

A planted form is one of the module's own forms under another implementation name (so its
cells are a frontier group of their own and leave the module's cells as they are); at every
point but its target it computes exactly what that form computes. The entries travel to Dask
workers pickled by value, this module with them (``cloudpickle.register_pickle_by_value``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3verify.harness.overflow_map import MapOptions, SweptForm

POINT_KEY = "planted point"  # where a planted case records the point it was made at


def _abort(case: Any) -> None:
    """Abort this process (SIGABRT), as a C library's failed assertion does; no core file."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _hang(case: Any) -> None:
    """Sleep far past any test's cell timeout, as a deadlocked kernel does."""
    time.sleep(600)


def _die_once(marker: str, case: Any) -> None:
    """Kill this process (SIGKILL, as the OOM killer does) the first time only: ``marker``, a file
    every worker sees, says it happened."""
    path = Path(marker)
    if not path.exists():
        path.touch()
        os.kill(os.getpid(), signal.SIGKILL)


BEHAVIOURS: dict[str, Callable[..., None]] = {"abort": _abort, "hang": _hang}


def die_once(marker: Path) -> Callable[[Any], None]:
    """A behaviour that kills its worker the first time it runs (``marker`` records it)."""
    return functools.partial(_die_once, str(marker))


def _planted_run(misbehave: Callable[[Any], None], target: dict[str, Any], form: SweptForm,
                 case: Any) -> tuple[Any, list[str]]:
    if case.cache.get(POINT_KEY) == target:
        misbehave(case)
    return form.run(case)


def _points(original: Callable[[MapOptions], list[dict[str, Any]]], n: int, options: MapOptions) -> list[dict]:
    return original(options)[:n]


def _make_case(original: Callable[[dict[str, Any], int], Any], point: dict[str, Any], seed: int) -> Any:
    case = original(point, seed)
    case.cache[POINT_KEY] = dict(point)
    return case


def _forms(original: Callable[[MapOptions], list[SweptForm]], points: Callable[[MapOptions], list[dict]],
           plants: dict[str, tuple[Callable[[Any], None], int]], options: MapOptions) -> list[SweptForm]:
    forms = original(options)
    planted = []
    for name, (misbehave, at) in plants.items():
        target = points(options)[at]
        planted.append(dataclasses.replace(forms[0], implementation=f"planted {name}",
                                           run=functools.partial(_planted_run, misbehave, target, forms[0])))
    return [*forms, *planted]


def planted_entry(entry: Any, points: int, plants: dict[str, tuple[Callable[[Any], None], int]] | None = None) -> Any:
    """``entry`` whose map has its first ``points`` points only, plus one planted form per item of
    ``plants`` (name -> (what it does at its target, the index of its target point)); with no
    plants, the map those forms are compared with."""
    d = entry.overflow_map
    cut = functools.partial(_points, d.points, points)
    forms = functools.partial(_forms, d.forms, cut, dict(plants or {}))
    make_case = functools.partial(_make_case, d.make_case)
    return dataclasses.replace(entry, overflow_map=dataclasses.replace(d, points=cut, forms=forms,
                                                                       make_case=make_case))


def _slow_study(name: str, seed: int, quick: bool) -> dict[str, Any]:
    """A study that returns once this process's captured stderr shows a "still running" line
    naming it (20 s at most): how long a study compiling kernels takes, with no cell ending."""
    end = time.perf_counter() + 20
    while time.perf_counter() < end and not any(
            line.endswith(f"still running: study {name}") for line in sys.stderr.getvalue().splitlines()):
        time.sleep(0.05)
    return {"title": "slow", "layers": [1], "error_x": [0.0], "metric": "rms_ratio"}


def slow_study_entry(entry: Any, points: int, name: str) -> Any:
    """``entry`` cut to its first ``points`` points, with one study ``name`` only, one that runs
    until the log says it is still running (:func:`_slow_study`)."""
    return dataclasses.replace(planted_entry(entry, points), studies={name: functools.partial(_slow_study, name)})


def _planted_row_run(misbehave: Callable[[Any], None], run: Callable[[Any], Any], case: Any) -> Any:
    misbehave(case)
    return run(case)


def _implementations(original: Callable[[], list[Any]], plants: dict[str, Callable[[Any], None]]) -> list[Any]:
    impls = original()
    model = next(i for i in impls if i.unavailable() is None)
    planted = [dataclasses.replace(model, implementation=f"planted {name}", cases=model.cases[:1],
                                   run=functools.partial(_planted_row_run, misbehave, model.run))
               for name, misbehave in plants.items()]
    return [*impls, *planted]


def planted_rows_entry(entry: Any, plants: dict[str, Callable[[Any], None]]) -> Any:
    """``entry`` with one planted implementation per item of ``plants`` (name -> what it does
    before it runs): a copy of the entry's first available implementation, named
    ``planted <name>``, on that implementation's first case only, so one row each."""
    return dataclasses.replace(entry, own_implementations=functools.partial(_implementations,
                                                                            entry.own_implementations, plants))

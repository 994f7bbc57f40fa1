"""Overflow maps: sweep a module's precision parameters and record where outputs overflow.

A module entry's ``overflow_map(options, progress)`` returns a :class:`MapResult`: one dict
per cell carrying at least ``module, dtype, tile, finite, predicted_finite, rms_ratio`` (plus
its own sweep keys, e.g. KDA's ``g_min`` and ``anchor``) and a :class:`MapSpec` saying how to
draw it. This module checks the cells, scores prediction against observation and writes the
JSON and PNG heatmaps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .files import UsageError, read_json, require_keys, staged_folder

REQUIRED_CELL_KEYS = ("module", "dtype", "tile", "finite", "predicted_finite", "rms_ratio")
MAP_SCHEMA_VERSION = 1

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class MapOptions:
    """What to sweep; ``quick`` asks a module for a coarse grid (tests, smoke runs)."""

    quick: bool = False
    seed: int = 0
    x_values: Sequence[float] | None = None  # override the module's primary sweep axis


@dataclass(frozen=True)
class MapSpec:
    """How to draw a map: one figure per value of ``figure``, a panel per (row, col) pair.

    Inside a panel, ``x`` runs along the horizontal axis and ``y`` down the rows; colour is
    ``log10(rms_ratio)`` for finite cells and a fixed mark for overflow. The analytic frontier
    is the boundary of ``predicted_finite``.
    """

    x: str
    y: str
    panel_row: str
    panel_col: str
    figure: str
    x_label: str
    y_label: str
    title: str
    frontier_key: str = "predicted_finite"
    x_descending: bool = False  # draw the largest x first (KDA: g_min from -0.5 down to -20)


@dataclass
class MapResult:
    """Cells plus drawing spec and free-form metadata (grids, inputs, agreement counts)."""

    module: str
    cells: list[dict[str, Any]]
    spec: MapSpec
    meta: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Every cell carries the required keys; raise naming the first that does not."""
        for i, cell in enumerate(self.cells):
            missing = [k for k in REQUIRED_CELL_KEYS if k not in cell]
            if missing:
                raise ValueError(f"cell {i} of the {self.module} map lacks {missing}")


def agreement(
    cells: Sequence[dict[str, Any]], *, only: Callable[[dict[str, Any]], bool] = lambda c: True
) -> dict[str, int]:
    """Counts of prediction vs observation, split by whether the cell touches the frontier.

    A cell is ``frontier_adjacent`` when the module marks it so (a neighbour on the sweep grid
    has the other prediction); disagreement is only excused there.
    """
    counts = {"cells": 0, "agree": 0, "disagree_adjacent": 0, "disagree_away": 0}
    for c in cells:
        if not only(c):
            continue
        counts["cells"] += 1
        if bool(c["finite"]) == bool(c["predicted_finite"]):
            counts["agree"] += 1
        elif c.get("frontier_adjacent", False):
            counts["disagree_adjacent"] += 1
        else:
            counts["disagree_away"] += 1
    return counts


def mark_frontier(cells: Sequence[dict[str, Any]], axes: dict[str, Sequence[Any]], fixed: Sequence[str]) -> None:
    """Set ``frontier_adjacent`` on every cell: a neighbour one grid step along any of ``axes``
    (with the ``fixed`` keys and the other axes equal) has the other ``predicted_finite``.

    ``axes`` maps each swept key to its values in grid order.
    """
    index = {key: {v: i for i, v in enumerate(values)} for key, values in axes.items()}
    by_position: dict[tuple, dict[str, Any]] = {}
    for c in cells:
        by_position[(*(c[k] for k in fixed), *(index[k][c[k]] for k in axes))] = c
    n_fixed = len(fixed)
    for position, c in by_position.items():
        group, grid = position[:n_fixed], list(position[n_fixed:])
        adjacent = False
        for axis in range(len(grid)):
            for step in (-1, 1):
                moved = grid.copy()
                moved[axis] += step
                n = by_position.get((*group, *moved))
                adjacent |= n is not None and n["predicted_finite"] != c["predicted_finite"]
        c["frontier_adjacent"] = adjacent


def write_map(result: MapResult, out_dir: Path, environment: dict[str, Any]) -> list[Path]:
    """Write ``<module>_overflow_map.json``, one PNG per figure value and every curve the
    module put in ``meta["curves"]`` (file name -> JSON document, e.g. AttnRes's error against
    depth) next to them; return the paths."""
    from .plots import draw_map
    from .report import json_safe

    result.check()
    doc = {
        "schema_version": MAP_SCHEMA_VERSION,
        "module": result.module,
        "environment": environment,
        "spec": asdict(result.spec),
        "meta": result.meta,
        "cells": result.cells,
    }
    texts = {f"{result.module}_overflow_map.json": doc} | dict(result.meta.get("curves", {}))
    prefix = f"{result.module}_overflow_map"
    # This module's map files are replaced as a set; other modules' maps in the folder stay.
    with staged_folder(out_dir, carry=lambda name: not name.startswith(prefix) and name not in texts) as stage:
        for name, content in texts.items():
            (stage / name).write_text(json.dumps(json_safe(content), indent=1, allow_nan=False) + "\n")
        images = [out_dir / p.name for p in draw_map(result, stage)]
    return [*(out_dir / name for name in texts), *images]


def load_map(path: Path) -> dict[str, Any]:
    """An overflow-map document (``<module>_overflow_map.json``); ``UsageError`` naming the path
    unless it has a module, a spec naming its axes and at least one cell."""
    doc = require_keys(read_json(path, what="overflow map"), {"module": str, "spec": dict, "cells": list}, path,
                       "overflow map")
    if not doc["cells"]:
        raise UsageError(f"{path}: overflow map has no cells")
    axes = [doc["spec"].get(k) for k in ("figure", "panel_row", "panel_col", "x", "y")]
    if not all(isinstance(a, str) for a in axes):
        raise UsageError(f"{path}: overflow map spec does not name its figure, panel and x/y axes")
    for i, cell in enumerate(doc["cells"]):
        require_keys(cell, {"finite": (bool, int), "predicted_finite": (bool, int)}, path, f"map cell {i}")
    return doc

"""PNG heatmaps of overflow maps, drawn from a :class:`MapSpec` so any module can use them.

Colour is ``log10(rms_ratio)`` against the fp64 oracle; overflowed cells are red; the analytic
frontier (boundary of ``predicted_finite``) is a black line; cells where prediction and
observation disagree carry a white cross.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: CI machines and GPU hosts have no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from .overflow_map import MapResult


def _ordered(values: list[Any]) -> list[Any]:
    """Unique values in first-seen order (keeps the module's intended axis order)."""
    return list(dict.fromkeys(values))


def _edges(xs: list[float]) -> np.ndarray:
    """Cell edges for sorted centres ``xs`` (midpoints, half a step beyond the ends)."""
    x = np.asarray(xs, dtype=float)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    return np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])


def draw_map(result: MapResult, out_dir: Path) -> list[Path]:
    """One PNG per value of ``spec.figure``; returns the written paths."""
    spec = result.spec
    paths = []
    for fig_value in _ordered([c[spec.figure] for c in result.cells]):
        cells = [c for c in result.cells if c[spec.figure] == fig_value]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(fig_value)).strip("_")
        path = out_dir / f"{result.module}_overflow_map_{spec.figure}-{slug}.png"
        _draw_figure(cells, result, f"{spec.title}\n{spec.figure} = {fig_value}", path)
        paths.append(path)
    return paths


def _draw_figure(cells: list[dict[str, Any]], result: MapResult, title: str, path: Path) -> None:
    spec = result.spec
    rows = _ordered([c[spec.panel_row] for c in cells])
    cols = _ordered([c[spec.panel_col] for c in cells])
    xs = sorted(_ordered([c[spec.x] for c in cells]), reverse=spec.x_descending)
    ys = sorted(_ordered([c[spec.y] for c in cells]))
    fig, axes = plt.subplots(
        len(rows), len(cols), figsize=(4.2 * len(cols), 2.4 * len(rows) + 1), squeeze=False, sharex=True, sharey=True
    )
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="none")
    overflow_cmap = ListedColormap(["#d62728"])
    finite_errs = [
        c["rms_ratio"]
        for c in cells
        if c["finite"] and c["rms_ratio"] is not None and math.isfinite(c["rms_ratio"]) and c["rms_ratio"] > 0
    ]
    vmin = math.log10(min(finite_errs)) if finite_errs else -8
    vmax = math.log10(max(finite_errs)) if finite_errs else 0
    numeric_x = all(isinstance(x, (int, float)) for x in xs)
    x_pos = xs if numeric_x else list(range(len(xs)))
    x_edges = _edges(x_pos)
    y_edges = np.arange(len(ys) + 1) - 0.5
    image = None
    for i, rv in enumerate(rows):
        for j, cv in enumerate(cols):
            ax = axes[i][j]
            grid = {(c[spec.x], c[spec.y]): c for c in cells if c[spec.panel_row] == rv and c[spec.panel_col] == cv}
            err = np.full((len(ys), len(xs)), np.nan)
            over = np.full((len(ys), len(xs)), np.nan)
            pred = np.zeros((len(ys), len(xs)), dtype=bool)
            for (x, y), c in grid.items():
                a, b = ys.index(y), xs.index(x)
                pred[a, b] = bool(c[spec.frontier_key])
                if c["finite"] and c["rms_ratio"] is not None and math.isfinite(c["rms_ratio"]):
                    err[a, b] = math.log10(max(c["rms_ratio"], 10.0**vmin))
                else:
                    over[a, b] = 1
                if bool(c["finite"]) != bool(c[spec.frontier_key]):
                    ax.plot(x_pos[b], a, marker="x", color="white", markersize=4, mew=1)
            image = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(err), cmap=cmap, vmin=vmin, vmax=vmax)
            ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(over), cmap=overflow_cmap, vmin=0, vmax=1)
            _draw_frontier(ax, pred, x_edges)
            ax.set_title(f"{spec.panel_row}={rv}, {spec.panel_col}={cv}", fontsize=9)
            ax.set_yticks(range(len(ys)), [str(y) for y in ys])
            if not numeric_x:
                ax.set_xticks(x_pos, [str(x) for x in xs], rotation=45, fontsize=7)
            if i == len(rows) - 1:
                ax.set_xlabel(spec.x_label)
            if j == 0:
                ax.set_ylabel(spec.y_label)
            if numeric_x:
                ax.set_xlim(x_edges[0], x_edges[-1])  # keeps a descending axis descending
    fig.suptitle(
        title + "\nred: overflow (inf/NaN)   black line: analytic frontier   x: prediction missed", fontsize=10
    )
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="log10 rms_ratio vs fp64 oracle")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _draw_frontier(ax: Any, pred: np.ndarray, x_edges: np.ndarray) -> None:
    """Black segments along every edge between cells of different ``predicted_finite``."""
    n_y, n_x = pred.shape
    for a in range(n_y):
        for b in range(n_x - 1):
            if pred[a, b] != pred[a, b + 1]:
                ax.plot([x_edges[b + 1]] * 2, [a - 0.5, a + 0.5], color="black", lw=1.6)
    for a in range(n_y - 1):
        for b in range(n_x):
            if pred[a, b] != pred[a + 1, b]:
                ax.plot([x_edges[b], x_edges[b + 1]], [a + 0.5] * 2, color="black", lw=1.6)

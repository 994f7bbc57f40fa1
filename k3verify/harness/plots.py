"""Figures: overflow-map heatmaps (PNG files) and the report's figures (PNG bytes).

Overflow maps are drawn from a :class:`MapSpec` so any module can use them. Colour is
``log10(rms_ratio)`` against the fp64 oracle; overflowed cells are red; the analytic frontier
(boundary of ``predicted_finite``) is a black line; cells where prediction and observation
disagree carry a white cross.

The report's figures (error against position, ULP histograms, error against depth, other
curves) are built from report rows and curve files and returned as figures for
:func:`png_bytes`; ``report.html`` embeds them.

Rows, maps and curve files are untrusted input: every text drawn goes through
:func:`k3verify.harness.text.plot_text` (no mathtext, nothing invisible), every number is
checked before it is drawn, and a PNG read from disk is decoded only within a pixel bound
(:func:`compact_png`).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import re
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: CI machines and GPU hosts have no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.ticker import MaxNLocator
from PIL import Image

from .overflow_map import MapResult
from .text import PLOT_TEXT_LIMIT, plot_text

# A map figure is about 1 500 x 1 000 pixels; a PNG from disk above this is not decoded.
MAX_PIXELS = 40_000_000
# Figures drawn from a report: at most this many panels (cases) or lines (histogram rows), so
# that no figure outgrows what matplotlib can save.
MAX_PANELS, MAX_LINES = 40, 300
# Lines one panel of the position figure draws at most (rows and baselines), so each is told apart.
LINES_PER_AXES = 6
# What PIL raises for bytes that are not a PNG it can decode (truncated, corrupt, a bomb).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError)


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
        # File names from a map's own names: never a path separator, whatever the map says.
        module, figure, slug = (_slug(v) for v in (result.module, spec.figure, fig_value))
        path = out_dir / f"{module}_overflow_map_{figure}-{slug}.png"
        _draw_figure(cells, result, f"{plot_text(spec.title)}\n{plot_text(f'{spec.figure} = {fig_value}')}", path)
        paths.append(path)
    return paths


def _slug(value: Any, limit: int = 64) -> str:
    """``value`` as a file-name part: runs of anything but ``A-Za-z0-9._-`` as one ``_``; a longer
    one than ``limit`` is cut and told apart by a hash of the whole (a file name has 255 bytes)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(value)).strip("_")
    if len(slug) <= limit:
        return slug
    return f"{slug[:limit]}-{hashlib.sha256(str(value).encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


def _draw_figure(cells: list[dict[str, Any]], result: MapResult, title: str, path: Path) -> None:
    """One figure of a map into ``path``; ``title`` is drawn as given (its parts escaped by the caller)."""
    spec = result.spec
    rows = _ordered([c[spec.panel_row] for c in cells])
    cols = _ordered([c[spec.panel_col] for c in cells])
    xs = sorted(_ordered([c[spec.x] for c in cells]), reverse=spec.x_descending)
    ys = sorted(_ordered([c[spec.y] for c in cells]))
    # Constrained layout keeps the three-line title clear of the panel titles in one-row maps.
    fig, axes = plt.subplots(
        len(rows), len(cols), figsize=(4.2 * len(cols), 2.4 * len(rows) + 1.2), squeeze=False, sharex=True,
        sharey=True, layout="constrained",
    )  # fmt: skip
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
    x_at, y_at = {x: b for b, x in enumerate(xs)}, {y: a for a, y in enumerate(ys)}
    image = None
    for i, rv in enumerate(rows):
        for j, cv in enumerate(cols):
            ax = axes[i][j]
            grid = {(c[spec.x], c[spec.y]): c for c in cells if c[spec.panel_row] == rv and c[spec.panel_col] == cv}
            err = np.full((len(ys), len(xs)), np.nan)
            over = np.full((len(ys), len(xs)), np.nan)
            pred = np.zeros((len(ys), len(xs)), dtype=bool)
            missed: list[tuple[Any, int]] = []
            for (x, y), c in grid.items():
                a, b = y_at[y], x_at[x]
                pred[a, b] = bool(c[spec.frontier_key])
                if c["finite"] and c["rms_ratio"] is not None and math.isfinite(c["rms_ratio"]):
                    err[a, b] = math.log10(max(c["rms_ratio"], 10.0**vmin))
                else:
                    over[a, b] = 1
                if bool(c["finite"]) != bool(c[spec.frontier_key]):
                    missed.append((x_pos[b], a))
            if missed:  # one artist for all: a map is untrusted, and one per cell took minutes
                ax.plot(*zip(*missed), linestyle="none", marker="x", color="white", markersize=4, mew=1)
            image = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(err), cmap=cmap, vmin=vmin, vmax=vmax)
            ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(over), cmap=overflow_cmap, vmin=0, vmax=1)
            _draw_frontier(ax, pred, x_edges)
            _draw_operating_point(ax, dict(spec.operating_point), spec, xs, ys, x_pos)
            ax.set_title(plot_text(f"{spec.panel_row}={rv}, {spec.panel_col}={cv}"), fontsize=9)
            ax.set_yticks(range(len(ys)), [plot_text(y) for y in ys])
            if not numeric_x:
                ax.set_xticks(x_pos, [plot_text(x) for x in xs], rotation=45, fontsize=7)
            if i == len(rows) - 1:
                ax.set_xlabel(plot_text(spec.x_label))
            if j == 0:
                ax.set_ylabel(plot_text(spec.y_label))
            if numeric_x:
                ax.set_xlim(x_edges[0], x_edges[-1])  # keeps a descending axis descending
    marked = f"   magenta: {plot_text(spec.operating_label)}" if spec.operating_point else ""
    legend = f"red: overflow (inf/NaN)   black line: analytic frontier   x: prediction missed{marked}"
    fig.suptitle(f"{title}\n{legend}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="log10 rms_ratio vs fp64 oracle")
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def _draw_operating_point(ax: Any, point: dict[str, Any], spec: Any, xs: list[Any], ys: list[Any],
                          x_pos: list[Any]) -> None:
    """K3's operating point: a star where both of the panel's axes are given, else a line along
    the one that is. Nothing for an axis value the map does not span."""
    x = y = None
    if spec.x in point:
        value = point[spec.x]
        if value in xs:
            x = x_pos[xs.index(value)]
        elif _number(value) and all(_number(v) for v in xs) and min(xs) <= value <= max(xs):
            x = value
    if spec.y in point and point[spec.y] in ys:
        y = ys.index(point[spec.y])
    style = dict(color="magenta", lw=1.4, ls="--")
    if x is not None and y is not None:
        ax.plot(x, y, marker="*", color="magenta", markersize=13, markeredgecolor="white", mew=0.8)
    elif x is not None:
        ax.axvline(x, **style)
    elif y is not None:
        ax.axhline(y, **style)


def _draw_frontier(ax: Any, pred: np.ndarray, x_edges: np.ndarray) -> None:
    """Black segments along every edge between cells of different ``predicted_finite``, drawn as
    one collection (a checkerboard of a map has an edge at every cell)."""
    segments = [[(x_edges[b + 1], a - 0.5), (x_edges[b + 1], a + 0.5)]
                for a, b in zip(*np.nonzero(pred[:, :-1] != pred[:, 1:]))]
    segments += [[(x_edges[b], a + 0.5), (x_edges[b + 1], a + 0.5)]
                 for a, b in zip(*np.nonzero(pred[:-1, :] != pred[1:, :]))]
    if segments:
        ax.add_collection(LineCollection(segments, colors="black", linewidths=1.6))


# --- report figures (embedded in report.html) ---------------------------------------------


def png_bytes(fig: Any) -> bytes:
    """The figure as PNG bytes (256-colour, see :func:`compact_png`) at 100 dpi; closes it.

    Every report figure uses constrained layout, which already fits its artists inside the
    canvas, so the figure is drawn once and its pixels quantized directly: a tight bounding box
    would draw it a second time and a full-colour PNG would be encoded only to be decoded again
    (together about half the time of a report page's figures).
    """
    try:
        fig.set_dpi(100)
        fig.canvas.draw()
        pixels = np.asarray(fig.canvas.buffer_rgba())
        height, width = pixels.shape[:2]
        if width * height > MAX_PIXELS:
            raise ValueError(f"a figure of {width} x {height} pixels, more than the {MAX_PIXELS} allowed")
        image = Image.fromarray(np.ascontiguousarray(pixels[..., :3]))  # RGBA -> RGB, uint8
    finally:
        plt.close(fig)
    return _palette_png(image)


def compact_png(png: bytes) -> bytes:
    """``png`` reduced to a 256-colour palette, for embedding in a page; ``ValueError`` saying
    why for bytes that are not a PNG of at most :data:`MAX_PIXELS` pixels that decodes.

    Anti-aliased lines make full-colour PNGs of line plots 3-4x larger than their palette
    versions (measured: 363 kB -> 107 kB for the KDA position figure), and a committed
    baseline page embeds a dozen figures. Colourmaps with 256 entries survive unchanged. The
    page embeds this new encoding, never the bytes it was given.
    """
    try:
        # The size comes from the header, before anything is decompressed (PIL's own, larger,
        # bound warns below twice its limit: ours is the one that counts).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            source = Image.open(io.BytesIO(png), formats=["PNG"])
        with source:
            width, height = source.size
            too_large = width * height > MAX_PIXELS
            image = None if too_large else source.convert("RGB")
    except Image.DecompressionBombError:
        too_large, width, height = True, "?", "?"
    except _DECODE_ERRORS as exc:
        raise ValueError(f"not a PNG that decodes ({type(exc).__name__})") from None
    if too_large:
        raise ValueError(f"a PNG of {width} x {height} pixels, more than the {MAX_PIXELS} allowed")
    return _palette_png(image)


def _palette_png(image: Image.Image) -> bytes:
    """An RGB ``image`` as an optimised PNG of at most 256 colours (no dithering)."""
    buf = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
        buf, format="PNG", optimize=True
    )
    return buf.getvalue()


def row_label(row: dict[str, Any], *, every_param: bool = False) -> str:
    """``implementation form dtype params`` of a report row, for legends and axis ticks
    (``chunk_size`` left out unless ``every_param``: it does not change a position curve); plain
    text, for :func:`plot_text`."""
    params = " ".join(f"{k}={v}" for k, v in (row.get("params") or {}).items() if every_param or k != "chunk_size")
    impl = "" if row["implementation"] == "k3verify" else f"{row['implementation']} "
    return f"{impl}{row['form']} {row['dtype']}{' ' + params if params else ''}"


def _positive(values: list[Any]) -> np.ndarray:
    """Floats with missing, non-numeric or non-positive entries as NaN (log axes cannot draw them)."""
    out = np.array([float(v) if _number(v) else np.nan for v in values], dtype=float)
    out[~(out > 0)] = np.nan
    return out


def position_figure(rows: list[dict[str, Any]], title: str) -> Any | None:
    """Error against token position as small multiples: one panel per case and dtype (split
    further so that no panel draws more than :data:`LINES_PER_AXES` lines), one line per row, the
    same-dtype baselines dashed.

    Uses each row's ``error_by_position`` (RMS ratio at every position); rows computed in
    fp64 and cases with a single position are left out. ``None`` when nothing is left.
    """
    panels = _position_panels(rows)
    if not panels:
        return None
    if len(panels) > MAX_PANELS:  # a figure has a size limit; a report may have any number of cases
        title += f" (the first {MAX_PANELS} of {len(panels)} panels)"
        panels = panels[:MAX_PANELS]
    ncols = min(2 if len(panels) <= 6 else 3, len(panels))  # many panels: three across, to keep the page short
    nrows = math.ceil(len(panels) / ncols)
    width = 6.4 if ncols < 3 else 5.0
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 3.9 * nrows), squeeze=False, layout="constrained")
    colors = matplotlib.colormaps["tab10"].colors
    dark = matplotlib.colormaps["Dark2"].colors
    dashes = ("--", ":", "-.", (0, (5, 1, 1, 1)))
    for ax, (name, panel_rows, baselines) in zip(axes.flat, panels):
        labels = [row_label(r) for r in panel_rows]
        if len(set(labels)) < len(labels):  # rows told apart only by chunk_size: name every parameter
            labels = [row_label(r, every_param=True) for r in panel_rows]
        for i, (r, label) in enumerate(zip(panel_rows, labels)):
            ax.plot(_positive(r["error_by_position"]), color=colors[i % len(colors)], lw=1.2, label=plot_text(label))
        # Baselines: dark colours and dashes of their own, so each is told apart from the rows
        # and from the other baselines.
        for j, (label, series) in enumerate(baselines.items()):
            ax.plot(_positive(series), color=dark[j % len(dark)], lw=1.0, ls=dashes[j % 4], label=label)
        ax.set_yscale("log")
        ax.set_title(plot_text(name), fontsize=10)
        ax.set_xlabel("token position t", fontsize=8)
        ax.set_ylabel("rms(o_t − ref_t) / rms(ref_t)", fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    fig.suptitle(plot_text(title), fontsize=11)
    return fig


def _position_panels(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], dict[str, list[Any]]]]:
    """``(title, rows, {baseline label: series})`` per panel of :func:`position_figure`: the rows
    of one case and dtype, at most :data:`LINES_PER_AXES` lines with their baselines."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["dtype"] != "fp64" and isinstance(r.get("error_by_position"), list) and len(r["error_by_position"]) > 1:
            groups.setdefault((str(r["case"]), str(r["dtype"])), []).append(r)
    panels = []
    for (case, dtype), group in groups.items():
        # Baselines are drawn in every panel of their group; rows share what is left.
        per_panel = max(LINES_PER_AXES - len(_baselines(group)), 2)
        chunks = [group[i:i + per_panel] for i in range(0, len(group), per_panel)]
        for k, chunk in enumerate(chunks):
            part = f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            panels.append((f"case {case} · {dtype}{part}", chunk, _baselines(chunk)))
    return panels


def _baselines(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The distinct same-dtype baselines of ``rows``: ``{label: error by position}``."""
    out: dict[str, list[Any]] = {}
    for r in rows:
        if isinstance(r.get("baseline_error_by_position"), list) and r["baseline_error_by_position"]:
            out.setdefault(plot_text(f"baseline {r.get('baseline_form', '')} {r['dtype']}"),
                           r["baseline_error_by_position"])
    return out


def ulp_figure(rows: list[dict[str, Any]], title: str) -> Any | None:
    """ULP histograms as a heatmap: one line per row, one column per ULP band, colour = share
    of the outputs in that band (log scale). ``None`` when no row carries a histogram."""
    rows = [r for r in rows if _histogram_edges(r.get("ulp_histogram"))]
    if rows:  # one band layout per figure: the first row's
        edges = rows[0]["ulp_histogram"]["edges"]
        rows = [r for r in rows if r["ulp_histogram"]["edges"] == edges]
    if not rows:
        return None
    if len(rows) > MAX_LINES:
        title += f" (the first {MAX_LINES} of {len(rows)} rows)"
        rows = rows[:MAX_LINES]
    counts = np.array([[float(c) for c in r["ulp_histogram"]["counts"]] for r in rows], dtype=float)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(11, 0.22 * len(rows) + 1.6), layout="constrained")
    image = ax.imshow(
        np.ma.masked_equal(share, 0), aspect="auto", cmap="magma_r", norm=LogNorm(1e-4, 1)
    )
    labels = [plot_text(f"{row_label(r, every_param=True)} | {r['case']} | {r.get('output', '-')}") for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("row | case | output")
    names = ["0", *(_ulp_tick(e) for e in edges[1:-1])]
    ax.set_xticks(np.arange(len(names)) - 0.5, names, fontsize=7, rotation=90)
    ax.set_xlabel("|error| in ULPs of the row's dtype (band lower edge)")
    ax.set_title(plot_text(title), fontsize=11)
    fig.colorbar(image, ax=ax, label="share of outputs", shrink=0.8)
    return fig


def _histogram_edges(hist: Any) -> bool:
    """``hist`` is a ULP histogram the figure can draw: ``edges`` from 0 through positive numbers
    (the last may be ``null``: infinity) and one non-negative count per band."""
    if not (isinstance(hist, dict) and isinstance(hist.get("edges"), list) and isinstance(hist.get("counts"), list)):
        return False
    edges, counts = hist["edges"], hist["counts"]
    inner = edges[1:-1]
    return (len(edges) >= 2 and len(counts) == len(edges) - 1 and all(_number(e) and 1e-300 < e < 1e300 for e in inner)
            and all(_number(c) and c >= 0 for c in counts))


def _ulp_tick(edge: float) -> str:
    if edge < 1:
        return f"1/{round(1 / edge)}"
    return f"{edge:g}" if edge < 10_000 else f"2^{round(math.log2(edge))}"


def depth_figure(doc: dict[str, Any], title: str) -> Any:
    """Error against depth from ``{"layers", "sublayer", "error_bf16", "error_fp32", "metric"}``.

    Every ``error_*`` list as long as ``layers`` is a curve (``error_bf16_naive`` too).
    ``sublayer`` is either one label for the whole curve or one label per point (then each
    label gets its own marker).
    """
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers or not all(_number(x) for x in layers):
        raise ValueError("'layers' is not a list of numbers")
    layers = [float(x) for x in layers]
    sub = doc.get("sublayer")
    per_point = isinstance(sub, list) and len(sub) == len(layers)
    if per_point:
        sub = [plot_text(s) for s in sub]
    curves = [k for k, v in doc.items() if k.startswith("error_") and isinstance(v, list) and len(v) == len(layers)]
    if not curves:
        raise ValueError(f"no error_* list of {len(layers)} values")
    fig, ax = plt.subplots(figsize=(11, 3.6), layout="constrained")
    markers = dict(zip(dict.fromkeys(sub), "os^Dv")) if per_point else {}
    for key, color in zip(curves, matplotlib.colormaps["tab10"].colors):
        y = _positive(list(doc[key]))
        ax.plot(layers, y, color=color, lw=1.0, label=plot_text(key.removeprefix("error_")))
        for kind, marker in markers.items():
            idx = [i for i, s in enumerate(sub) if s == kind]
            ax.scatter([layers[i] for i in idx], y[idx], color=color, marker=marker, s=12)
    for kind, marker in markers.items():  # one legend entry per sublayer kind, in grey
        ax.scatter([], [], color="grey", marker=marker, s=12, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(plot_text(doc.get("metric", "error")))
    ax.set_title(plot_text(title + ("" if per_point or sub is None else f" ({sub})")), fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def _words(key: str) -> str:
    """A JSON key as a label: ``bf16_vs_fp32.changed_pairs`` -> ``bf16 vs fp32: changed pairs``."""
    return plot_text(key.replace(".", ": ").replace("_", " "))


def _number(x: Any) -> bool:
    """A number that converts to a finite float (not a bool, not an integer beyond float range)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -1e308 <= x <= 1e308


def _flat(record: dict[str, Any], prefix: str = "", depth: int = 8) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (records nested deeper than ``depth`` are left out)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            if depth > 1:
                out |= _flat(v, f"{prefix}{k}.", depth - 1)
        else:
            out[f"{prefix}{k}"] = v
    return out


def series_figure(doc: dict[str, Any], title: str) -> Any | None:
    """Numeric series of a curve file whose exact keys the report does not know (MoE routing
    flips), drawn against the first one.

    The series are the top-level numeric lists of the most common length, or, when ``doc``
    holds a list of records (``{"by_scale": [{"log2_input_scale": 0, "bf16_vs_fp32":
    {"changed_pairs": ...}}, ...]}``), the records' numeric fields (nested keys joined with
    dots). ``None`` when fewer than two series are found.
    """
    series = {k: v for k, v in doc.items() if isinstance(v, list) and v and all(_number(x) for x in v)}
    records = next((v for v in doc.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)), None)
    if len(series) < 2 and records:
        flat = [_flat(r) for r in records]
        series = {k: [f.get(k) for f in flat] for k in flat[0] if all(_number(f.get(k)) for f in flat)}
    if len(series) < 2:
        return None
    lengths = [len(v) for v in series.values()]
    common = max(set(lengths), key=lengths.count)
    series = {k: v for k, v in series.items() if len(v) == common}
    if len(series) < 2:
        return None
    series = {k: [float(x) for x in v] for k, v in series.items()}
    (x_key, xs), *ys = series.items()
    fig, ax = plt.subplots(figsize=(10, 3.6), layout="constrained")
    for key, values in ys:
        ax.plot(xs, values, lw=1.2, marker=".", label=_words(key))
    ax.set_xlabel(_words(x_key))
    shares = all(0 <= v <= 1 for _, values in ys for v in values)
    ax.set_ylabel(plot_text(doc.get("y_label") or ("fraction" if shares else "value")))
    ax.set_title(plot_text(title), fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


# --- the decoder walk (decoder_walk.json) ---------------------------------------------------

# Plans one depth-drift figure draws, points per curve, and AttnRes blocks marked at most.
MAX_WALK_LINES, MAX_WALK_POINTS, MAX_WALK_BOUNDARIES = 8, 8192, 64
# Positions further from 0 are not drawn where they are (the index is): an axis of 1e300 does not draw.
MAX_POSITION = 1e9
# Errors a log axis draws (beyond them its margins and ticks overflow); the tables show any value.
WALK_RANGE = (1e-200, 1e200)


def _walk_errors(values: list[Any]) -> np.ndarray:
    """An error curve for a log axis: NaN where a value is missing, not a number or outside
    :data:`WALK_RANGE`."""
    y = _positive(values)
    y[~((y >= WALK_RANGE[0]) & (y <= WALK_RANGE[1]))] = np.nan
    return y


def _integer(value: Any, low: int, high: int) -> int | None:
    """``value`` as an integer in [low, high], or ``None``."""
    return int(value) if _number(value) and low <= value <= high and value == int(value) else None


def _legend_label(value: Any, limit: int = PLOT_TEXT_LIMIT) -> str:
    """A label from a file for a legend entry: ``plot_text``, and never one matplotlib hides
    (empty, or starting with an underscore)."""
    text = plot_text(value, limit)
    return f" {text}" if text.startswith("_") else text or "(no name)"


def walk_depth_figure(drift: dict[str, Any], title: str) -> Any | None:
    """The depth-drift curves of ``decoder_walk.json``: the residual stream's error after each
    sublayer call, one line per plan (the first :data:`MAX_WALK_LINES`), a marker per sublayer
    module, dotted lines at the AttnRes block boundaries (every ``block_sublayers`` calls),
    log y axis. ``None`` without a curve; ``ValueError`` when no curve has a positive number."""
    curves = drift.get("curves") if isinstance(drift.get("curves"), dict) else {}
    lines = [(label, values[:MAX_WALK_POINTS]) for label, values in curves.items()
             if isinstance(values, list) and values]
    if not lines:
        return None
    if len(lines) > MAX_WALK_LINES:
        title += f" (the first {MAX_WALK_LINES} of {len(lines)} plans)"
        lines = lines[:MAX_WALK_LINES]
    if max(len(curves[label]) for label, _ in lines) > MAX_WALK_POINTS:
        title += f" (the first {MAX_WALK_POINTS} sublayer calls)"
    series = [(label, _walk_errors(values)) for label, values in lines]
    if not any(np.isfinite(y).any() for _, y in series):
        raise ValueError(f"no curve holds a number in [{WALK_RANGE[0]:g}, {WALK_RANGE[1]:g}] to draw on a log axis")
    n = max(len(y) for _, y in series)
    modules = drift.get("sublayers")
    modules = [_legend_label(m, 24) for m in modules[:n]] if isinstance(modules, list) and len(modules) >= n else None
    kinds = dict(zip(dict.fromkeys(modules), "os^Dv")) if modules and len(set(modules)) <= 5 else {}
    fig, ax = plt.subplots(figsize=(11, 3.8), layout="constrained")
    for (label, y), color in zip(series, matplotlib.colormaps["tab10"].colors):
        x = np.arange(len(y))
        ax.plot(x, y, color=color, lw=1.1, label=_legend_label(label, 60))  # the legend stays beside the axes
        for kind, marker in kinds.items():
            idx = [i for i in range(len(y)) if modules[i] == kind]
            ax.scatter(x[idx], y[idx], color=color, marker=marker, s=9)
    for kind, marker in kinds.items():  # one legend entry per sublayer module, in grey
        ax.scatter([], [], color="grey", marker=marker, s=9, label=kind)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    block = _integer(drift.get("block_sublayers"), 1, 10**9)
    if block is not None and n / block <= MAX_WALK_BOUNDARIES:
        for k, start in enumerate(range(0, n, block)):
            if start:
                ax.axvline(start - 0.5, color="grey", ls=":", lw=0.9)
            if n / block <= 16:  # room to name each block
                ax.text(start + min(block, n - start) / 2 - 0.5, 1.01, f"block {k + 1}", fontsize=7, ha="center",
                        va="bottom", color="grey", transform=ax.get_xaxis_transform())
        if 1 < n / block <= 16:  # ticks at the block starts
            ax.set_xticks(range(0, n, block))
    ax.set_yscale("log")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("sublayer call (dotted: AttnRes block boundaries)")
    ax.set_ylabel("rms(h − h_fp64) / rms(h_fp64)", fontsize=8)
    ax.set_title(plot_text(title), fontsize=11, pad=14)
    ax.grid(True, which="major", axis="y", alpha=0.3)  # the block boundaries are the vertical guides
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def walk_decode_figure(steps: dict[str, Any], title: str) -> Any | None:
    """The decode-step curves of ``decoder_walk.json``: each token position's error, served
    (prefill, then one decode step per token) and baseline (the naive same-dtype definition),
    the decode steps shaded and marked, log y axis. ``None`` without a curve; ``ValueError``
    when no curve has a positive number."""
    curves = [(key, steps[key]) for key in ("served", "baseline") if isinstance(steps.get(key), list) and steps[key]]
    if not curves:
        return None
    n = max(len(v) for _, v in curves)
    if n > MAX_WALK_POINTS:
        title += f" (the first {MAX_WALK_POINTS} of {n} positions)"
        n = MAX_WALK_POINTS
    positions = steps.get("positions")
    # Positions where they are numbers in step with the curve (one per value, increasing), else the index.
    usable = isinstance(positions, list) and len(positions) >= n and all(
        _number(p) and abs(p) <= MAX_POSITION for p in positions[:n]) and all(
        a < b for a, b in itertools.pairwise(positions[:n]))
    x_all = np.asarray(positions[:n] if usable else range(n), dtype=float)
    series = [(key, _walk_errors(values[:n])) for key, values in curves]
    if not any(np.isfinite(y).any() for _, y in series):
        raise ValueError(f"no curve holds a number in [{WALK_RANGE[0]:g}, {WALK_RANGE[1]:g}] to draw on a log axis")
    prompt = steps.get("prompt")
    first = int(np.searchsorted(x_all, prompt)) if _number(prompt) and abs(prompt) <= MAX_POSITION else n
    fig, ax = plt.subplots(figsize=(11, 3.6), layout="constrained")
    if first < n:
        ax.axvspan(x_all[first] - 0.5, x_all[-1] + 0.5, color="#efe6f7", zorder=0, label="decode steps")
    styles = {"served": dict(color="#1f77b4", ls="-", label="served: prefill, then decode steps"),
              "baseline": dict(color="#555555", ls="--", label="baseline: naive same-dtype definition")}
    for key, y in series:
        style = styles[key]
        x = x_all[: len(y)]
        ax.plot(x, y, color=style["color"], ls=style["ls"], lw=1.1, label=style["label"])
        ax.scatter(x[:first], y[:first], color=style["color"], marker=".", s=10)
        ax.scatter(x[first:], y[first:], color=style["color"], marker="D", s=18)
    ax.scatter([], [], color="grey", marker=".", s=10, label="prompt position (prefill)")
    ax.scatter([], [], color="grey", marker="D", s=18, label="decode step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("rms(o_t − ref_t) / rms(ref_t)", fontsize=8)
    ax.set_title(plot_text(title), fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig

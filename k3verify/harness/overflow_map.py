"""Overflow maps: sweep a module's precision parameters and record where outputs overflow.

A module entry's ``overflow_map(options, progress)`` returns a :class:`MapResult`: one dict
per cell carrying at least ``module, dtype, tile, finite, predicted_finite, rms_ratio`` (plus
its own sweep keys, e.g. KDA's ``g_min`` and ``anchor``) and a :class:`MapSpec` saying how to
draw it. This module checks the cells, scores prediction against observation and writes the
JSON and PNG heatmaps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

from ..numerics import compare
from .guard import run_isolated
from .registry import as_outputs

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
    # K3's operating point on the map's axes ({axis key: value}), drawn in every panel: a star
    # where both axes are given, a line where one is; and what it is, for the legend.
    operating_point: tuple[tuple[str, Any], ...] = ()
    operating_label: str = "K3"


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
    # Several cells can share a position (two registered kernels of one name and dtype that differ
    # only in a parameter, such as a split count): each is judged against every neighbour there.
    by_position: dict[tuple, list[dict[str, Any]]] = {}
    for c in cells:
        by_position.setdefault((*(c[k] for k in fixed), *(index[k][c[k]] for k in axes)), []).append(c)
    n_fixed = len(fixed)
    for position, here in by_position.items():
        group, grid = position[:n_fixed], list(position[n_fixed:])
        neighbours = []
        for axis in range(len(grid)):
            for step in (-1, 1):
                moved = grid.copy()
                moved[axis] += step
                neighbours += by_position.get((*group, *moved), [])
        for c in here:
            c["frontier_adjacent"] = any(n["predicted_finite"] != c["predicted_finite"] for n in neighbours)


# --- the sweep engine ----------------------------------------------------------------------


@dataclass(frozen=True)
class SweptForm:
    """One of a module's own forms at one point of its parameter grid (the map's rows).

    ``params`` become cell keys (e.g. ``dtype``, ``tile``, ``anchor``); ``run(case)`` returns the
    primary output and the overflow lines (operand, tile, magnitude; empty when none);
    ``predict(case)`` is the module's analytic prediction (an ``OverflowPrediction``).
    """

    implementation: str
    params: Mapping[str, Any]
    dtype: str
    run: Callable[[Any], tuple[Any, list[str]]]
    predict: Callable[[Any], Any]
    # Extra cell keys that need the observed output (e.g. a baseline rule's verdict in the cell):
    # judge(case, output, reference) -> dict.
    judge: Callable[[Any, Any, Any], dict[str, Any]] | None = None


@dataclass(frozen=True)
class MapDefinition:
    """A module's overflow map, declared: the engine (:func:`sweep_map`) does the sweeping.

    ``points(options)`` lists the input points (their keys become cell keys, e.g. ``input`` and
    ``g_min``); ``make_case(point, seed)`` builds the case at a point; ``reference(case)`` is
    the fp64 primary output the cells are compared with; ``forms(options)`` the module's own
    forms over their parameter grid. Every registered implementation with ``in_map`` (kernels,
    third-party adapters, plugins) is also run at every point ``registered_on`` accepts, its cell
    keyed by ``registered_keys(impl)`` and predicted by its own ``predict``. ``frontier_axes``
    (cell key -> grid order) and ``fixed`` say which cells are neighbours for the frontier
    excuse; ``meta(cells, options)`` adds what the JSON should record beyond the cells.
    """

    points: Callable[[MapOptions], list[dict[str, Any]]]
    make_case: Callable[[dict[str, Any], int], Any]
    reference: Callable[[Any], Any]
    forms: Callable[[MapOptions], list[SweptForm]]
    spec: MapSpec
    frontier_axes: Callable[[list[dict[str, Any]]], dict[str, list[Any]]]
    fixed: tuple[str, ...]
    meta: Callable[[list[dict[str, Any]], MapOptions], dict[str, Any]] = lambda cells, options: {}
    registered_on: Callable[[dict[str, Any]], bool] = lambda point: True
    registered_keys: Callable[[Any], dict[str, Any]] | None = None



def backward_map(forward: MapDefinition, *, title: str, make_case: Callable[[dict[str, Any], int], Any],
                 reference: Callable[[Any], Any], forms: Callable[[MapOptions], list[SweptForm]],
                 meta: Callable[[list[dict[str, Any]], MapOptions], dict[str, Any]],
                 points: Callable[[MapOptions], list[dict[str, Any]]] | None = None,
                 fixed: tuple[str, ...] | None = None, **spec_changes: Any) -> MapDefinition:
    """A backward pass's map on its forward's grid: the forward's points (or ``points``), panels
    (changed by ``spec_changes``), neighbours and fixed keys (or ``fixed``), with the backward's
    own cases, forms, reference and record. No registered kernel runs in it (none has a backward
    there yet)."""
    return MapDefinition(points=points or forward.points, make_case=make_case, reference=reference, forms=forms,
                         spec=replace(forward.spec, title=title, **spec_changes), frontier_axes=forward.frontier_axes,
                         fixed=forward.fixed if fixed is None else fixed, meta=meta,
                         registered_on=lambda point: False)


def flat(outputs: Mapping[str, Any], names: Sequence[str]) -> Any:
    """The outputs ``names`` flattened into one vector (a map cell's finiteness and error over
    every gradient of a backward)."""
    import torch

    return torch.cat([outputs[n].reshape(-1) for n in names])


def sweep(
    points: Sequence[dict[str, Any]],
    make_case: Callable[[dict[str, Any]], Any],
    cells_at: Callable[[Any, dict[str, Any]], list[dict[str, Any]]],
    progress: Progress = lambda done, total: None,
) -> list[dict[str, Any]]:
    """The one sweep loop: build each point's case once, collect the cells at it, report progress."""
    cells: list[dict[str, Any]] = []
    for i, point in enumerate(points):
        cells += cells_at(make_case(point), point)
        progress(i + 1, len(points))
    return cells


def measured_cell(base: dict[str, Any], out: Any, lines: list[str], ref: Any, dtype: str,
                  prediction: Any) -> dict[str, Any]:
    """A cell from an output and its fp64 reference: ``base`` (the cell's sweep keys), the
    prediction's details, finiteness and the error metrics in ``dtype``; ``lines`` name the
    overflowing operand when the output is not finite."""
    m = compare(out, ref, ulp_dtype=dtype)
    details = {k: v for k, v in asdict(prediction).items() if k not in ("finite", "reasons")} \
        if prediction is not None and is_dataclass(prediction) else {}
    if prediction is not None:
        why = prediction.explanation
        details["explanation"] = why() if callable(why) else why
    made = base | details | {
        "finite": m.nonfinite == 0,
        "predicted_finite": True if prediction is None else bool(prediction.finite),
        "rms_ratio": m.rms_ratio,
        "max_abs": m.max_abs,
        "nonfinite": m.nonfinite,
    }
    if m.nonfinite:
        made["overflow"] = lines[0] if lines else "non-finite output with no operand overflow"
    return made


def form_base(entry: Any, form: SweptForm, point: dict[str, Any]) -> dict[str, Any]:
    """The sweep keys of a swept form's cell at ``point``."""
    return {"module": entry.name, "implementation": form.implementation, **point, **form.params}


def form_cell(entry: Any, form: SweptForm, case: Any, point: dict[str, Any], ref: Any) -> dict[str, Any]:
    """One swept form's cell at ``point``, whose case is ``case`` and fp64 reference ``ref``."""
    o, lines = form.run(case)
    made = measured_cell(form_base(entry, form, point), o, lines, ref, form.dtype, form.predict(case))
    return made | (form.judge(case, o, ref) if form.judge is not None else {})


def map_implementations(entry: Any) -> list[Any]:
    """The registered implementations that join ``entry``'s map (``in_map`` and available here)."""
    return [i for i in entry.implementations() if i.in_map and i.unavailable() is None]


def registered_at(d: MapDefinition, impls: Sequence[Any], point: dict[str, Any]) -> list[Any]:
    """Those of ``impls`` that run at ``point``, in their order."""
    if not d.registered_on(point):
        return []
    return [impl for impl in impls if impl.map_points is None or impl.map_points(point)]


def sweep_map(entry: Any, options: MapOptions, progress: Progress = lambda done, total: None,
              doing: Callable[[str], None] = lambda text: None) -> MapResult:  # fmt: skip
    """The overflow map of a registry entry: its own forms and every registered implementation
    with ``in_map`` swept over the entry's map points, each cell with its analytic prediction.
    ``progress(done, total)`` counts the points and then the module's studies, from ``0`` of the
    whole before the first point (a first point that compiles kernels takes minutes on a fresh
    device); ``doing`` names each study as it starts."""
    d: MapDefinition = entry.overflow_map
    forms = d.forms(options)
    impls = map_implementations(entry)
    points = d.points(options)
    total = len(points) + len(entry.studies)

    def cells_at(case: Any, point: dict[str, Any]) -> list[dict[str, Any]]:
        ref = d.reference(case)
        out = [form_cell(entry, f, case, point, ref) for f in forms]
        out += [_registered_cell(entry, impl, case, point, ref, d, measured_cell)
                for impl in registered_at(d, impls, point)]
        return out

    progress(0, total)
    cells = sweep(points, lambda p: d.make_case(p, options.seed), cells_at, lambda done, _: progress(done, total))
    curves = run_studies(entry, options, lambda done: progress(len(points) + done, total), doing)
    return finish_map(entry, options, cells, curves)


def run_studies(entry: Any, options: MapOptions, done: Callable[[int], None] = lambda n: None,
                doing: Callable[[str], None] = lambda text: None) -> dict[str, Any]:  # fmt: skip
    """The module's studies (curves that belong beside its map), one after another: ``doing``
    names each as it starts, ``done`` counts those finished. A study that runs kernels builds
    them first (AttnRes's depth drift: two minutes on a fresh GPU, with no cell ending)."""
    curves: dict[str, Any] = {}
    for n, (name, study) in enumerate(entry.studies.items()):
        doing(f"study {name}")
        curves[name] = study(options.seed, options.quick)
        done(n + 1)
    return curves


def finish_map(entry: Any, options: MapOptions, cells: list[dict[str, Any]],
               curves: dict[str, Any] | None = None) -> MapResult:
    """The map of ``cells`` (in sweep order): frontier neighbours marked, the module's record and
    agreement counts in ``meta``, and its studies' curves (:func:`run_studies` unless ``curves``
    gives them)."""
    d: MapDefinition = entry.overflow_map
    mark_frontier(cells, d.frontier_axes(cells), fixed=d.fixed)
    for c in cells:  # a check within its own rounding band (the prediction says so) is at the frontier too
        c["frontier_adjacent"] = c["frontier_adjacent"] or bool(c.get("near_frontier", False))
    meta = d.meta(cells, options)
    meta["agreement"] = {"all": agreement(cells), **meta.get("agreement", {})}
    meta["curves"] = curves if curves is not None else run_studies(entry, options)
    return MapResult(entry.name, cells, d.spec, meta)


def registered_base(entry: Any, impl: Any, point: dict[str, Any], d: MapDefinition) -> dict[str, Any]:
    """The sweep keys of a registered implementation's cell: the point's keys, its own identity in
    the panel keys."""
    params = " ".join(f"{k}={v}" for k, v in impl.params.items())
    keys = d.registered_keys(impl) if d.registered_keys else {}
    spec = d.spec
    # The implementation's identity labels the panels whose keys the point does not set (a point's own
    # axes, such as MLA's context, stay as they are: they place the cell on the grid).
    labels = {spec.figure: f"{point.get(spec.figure, '')}, {impl.implementation} {impl.form}".strip(", "),
              spec.panel_row: impl.dtype, spec.panel_col: params or impl.form}
    return {"module": entry.name, **{k: v for k, v in labels.items() if k not in point or k == spec.figure},
            **{k: v for k, v in point.items() if k != spec.figure}, "implementation": f"{impl.implementation} "
            f"{impl.form}", "source": impl.source} | keys


def _registered_cell(entry: Any, impl: Any, case: Any, point: dict[str, Any], ref: Any, d: MapDefinition,
                     cell: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """A registered implementation's cell at ``point`` (keys from :func:`registered_base`)."""
    base = registered_base(entry, impl, point, d)
    try:
        prediction = impl.predict(case) if impl.predict is not None else None
    except Exception as exc:  # a prediction that raises is a cell that says so, not a crashed map
        return base | {"finite": False, "predicted_finite": True, "rms_ratio": None, "max_abs": None,
                       "nonfinite": None, "overflow": f"its predict() raised {type(exc).__name__}: {exc}"}
    try:
        out = as_outputs(run_isolated(impl, case), entry.outputs, impl.label)[entry.primary]
    except Exception as exc:  # a crashing implementation is a cell that says so, not a crashed map
        # It agrees with its prediction only where that predicts a non-finite result (an input
        # that overflows the dtype it is cast to, which a kernel's validation refuses by name).
        why = getattr(prediction, "explanation", None)
        return base | {"finite": False, "predicted_finite": True if prediction is None else bool(prediction.finite),
                       "rms_ratio": None, "max_abs": None, "nonfinite": None,
                       "overflow": f"{type(exc).__name__}: {exc}",
                       **({"explanation": why() if callable(why) else why} if why is not None else {})}
    try:
        lines = impl.explain(case) if impl.explain is not None and not bool(out.isfinite().all()) else []
    except Exception as exc:  # the cell keeps its values; the explanation says it could not be made
        lines = [f"its explain() raised {type(exc).__name__}: {exc}"]
    return cell(base, out.detach().cpu(), lines, ref, impl.dtype, prediction)

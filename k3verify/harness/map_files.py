"""An overflow map on disk: ``<module>_overflow_map.json``, its PNG heatmaps and the module's
studies beside them, written as a set; the map JSON read back, checked; and the maps folder a
report page shows, read as untrusted input.

A maps folder may come from a pull request (``reports/baseline/maps`` of a checkout), so
:class:`MapsFolder` reads it the way :func:`k3verify.harness.files.read_confined` reads goldens:
the folder itself and every file are opened without following symlinks, only regular files
are read, each up to a bound checked before reading, and a FIFO or device is refused without
blocking. Which files are read at all is decided by their names (:func:`maps_entries`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from .files import MAX_JSON_BYTES, UsageError, json_safe, parse_json, read_json, require_keys, staged_folder
from .overflow_map import MAP_SCHEMA_VERSION, MapResult, MapSpec

MAP_SUMMARY = "summary.json"
MAP_JSON = re.compile(r"^(?P<module>[A-Za-z0-9][A-Za-z0-9_.-]*?)_overflow_map\.json$")
MAP_PNG = re.compile(r"^(?P<module>[A-Za-z0-9][A-Za-z0-9_.-]*?)_overflow_map_[A-Za-z0-9_.-]+\.png$")
MAX_MAP_BYTES = MAX_JSON_BYTES  # a full KDA map is 13 MB
MAX_STUDY_BYTES = 4 * 1024 * 1024  # the committed studies are 12 and 22 kB
MAX_PNG_BYTES = 16 * 1024 * 1024  # a map figure is 50-130 kB
# What a map drawn from its JSON may span (the full KDA map: 2 figures x 23 520 grid cells in all).
MAX_FIGURES, MAX_PANELS, MAX_AXIS_VALUES, MAX_GRID = 32, 64, 512, 200_000
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def write_map(result: MapResult, out_dir: Path, environment: dict[str, Any]) -> list[Path]:
    """Write ``<module>_overflow_map.json``, one PNG per figure value and every curve the
    module put in ``meta["curves"]`` (file name -> JSON document, e.g. AttnRes's error against
    depth) next to them; return the paths."""
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
        from .plots import draw_map  # matplotlib: imported when a map is drawn, not at every start

        images = [out_dir / p.name for p in draw_map(result, stage)]
    return [*(out_dir / name for name in texts), *images]


def load_map(path: Path) -> dict[str, Any]:
    """An overflow-map document (``<module>_overflow_map.json``); ``UsageError`` naming the path
    unless it has a module, a spec naming its axes and at least one cell."""
    return check_map(read_json(path, what="overflow map"), path)


def check_map(doc: Any, path: Path | str) -> dict[str, Any]:
    """``doc`` if it is an overflow-map document as :func:`load_map` requires; ``UsageError``
    naming ``path`` and the field otherwise."""
    doc = require_keys(doc, {"module": str, "spec": dict, "cells": list}, path, "overflow map")
    if not doc["cells"]:
        raise UsageError(f"{path}: overflow map has no cells")
    axes = [doc["spec"].get(k) for k in ("figure", "panel_row", "panel_col", "x", "y")]
    if not all(isinstance(a, str) for a in axes):
        raise UsageError(f"{path}: overflow map spec does not name its figure, panel and x/y axes")
    for i, cell in enumerate(doc["cells"]):
        require_keys(cell, {"finite": (bool, int), "predicted_finite": (bool, int)}, path, f"map cell {i}")
    return doc


# --- a map drawn from its JSON ------------------------------------------------------------------

_SPEC_TEXT = ("x", "y", "panel_row", "panel_col", "figure", "x_label", "y_label", "title")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _number(value: Any) -> bool:
    """A finite number within float range (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e308 <= value <= 1e308


def sound_cell(cell: dict[str, Any]) -> bool:
    """Whether a cell read back from a partial file has the types a map's cells have: ``finite``
    and ``predicted_finite`` (where given) true or false, ``rms_ratio`` a finite number or
    ``None``."""
    ratio = cell.get("rms_ratio")
    return (isinstance(cell.get("finite"), bool) and isinstance(cell.get("predicted_finite", False), bool)
            and (ratio is None or _number(ratio)))


def _scalar(value: Any) -> bool:
    """A value a map axis may take: text, a bool or a number."""
    return isinstance(value, (str, bool)) or _number(value)


def _check_spec(spec: dict[str, Any], path: Path | str) -> MapSpec:
    """The drawing spec of a map document; ``UsageError`` naming the key that is not usable."""
    unknown = sorted(set(spec) - {f.name for f in fields(MapSpec)})
    if unknown:
        raise UsageError(f"{path}: overflow map spec has unknown key {str(unknown[0])[:40]!r}")
    for key in (*_SPEC_TEXT, "frontier_key", "operating_label"):
        if key in spec and not isinstance(spec[key], str):
            raise UsageError(f"{path}: overflow map spec's {key!r} is not text")
    missing = [k for k in _SPEC_TEXT if k not in spec]
    if missing:
        raise UsageError(f"{path}: overflow map spec has no {missing[0]!r}")
    if not isinstance(spec.get("x_descending", False), bool):
        raise UsageError(f"{path}: overflow map spec's 'x_descending' is not true or false")
    point = spec.get("operating_point", [])
    if not (isinstance(point, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                            and _scalar(p[1]) for p in point)):
        raise UsageError(f"{path}: overflow map spec's 'operating_point' is not a list of [axis, value] pairs")
    return MapSpec(**(spec | {"operating_point": tuple(map(tuple, point))}))


def drawable_map(doc: dict[str, Any], path: Path | str) -> MapResult:
    """A checked map document (:func:`check_map`) as a :class:`MapResult` that
    :func:`k3verify.harness.plots.draw_map` can draw; ``UsageError`` naming ``path`` and the field
    for anything it could not: a module that is not a plain name, a spec key it does not know or
    of another type, a cell without an axis value, text mixed with numbers on one axis, an
    ``rms_ratio`` that is no number, or more figures, panels or grid cells than a page holds."""
    if not _NAME.match(doc["module"]):
        raise UsageError(f"{path}: overflow map's module {doc['module'][:40]!r} is not a plain name")
    spec = _check_spec(doc["spec"], path)
    axes = [spec.figure, spec.panel_row, spec.panel_col, spec.x, spec.y]
    cells = []
    for i, cell in enumerate(doc["cells"]):
        for key in (*axes, spec.frontier_key):
            if not _scalar(cell.get(key)):
                raise UsageError(f"{path}: map cell {i} has no usable {key[:40]!r}")
        ratio = cell.get("rms_ratio")
        if ratio is not None and not _number(ratio):
            raise UsageError(f"{path}: map cell {i}'s 'rms_ratio' is not a number")
        cells.append(cell | {"rms_ratio": ratio})
    counts = []
    for key, limit in zip(axes, (MAX_FIGURES, MAX_PANELS, MAX_PANELS, MAX_AXIS_VALUES, MAX_AXIS_VALUES)):
        values = {c[key] for c in cells}
        if len(values) > limit:
            raise UsageError(f"{path}: overflow map has {len(values)} values of {key[:40]!r}, more than {limit}")
        if len({isinstance(v, str) for v in values}) > 1:
            raise UsageError(f"{path}: overflow map mixes text and numbers on its {key[:40]!r} axis")
        counts.append(len(values))
    # Drawing walks every grid cell of every panel of every figure, however few cells are filled.
    grid = math.prod(counts)
    if grid > MAX_GRID:
        raise UsageError(f"{path}: overflow map spans {grid} grid cells, more than {MAX_GRID}")
    meta = doc.get("meta")
    return MapResult(doc["module"], cells, spec, meta if isinstance(meta, dict) else {})


# --- the maps folder a page shows ---------------------------------------------------------------


def _lexists_through(path: Path, what: str) -> bool:
    """Whether ``path`` exists, refusing a symlink on the way: every component of a relative
    path (it names something inside the checkout, which a pull request may have made a link),
    the last one of an absolute path (the machine's own folders above it may be links)."""
    parts = path.parts
    start = len(parts) - 1 if path.is_absolute() else 0
    for i in range(start, len(parts)):
        here = Path(*parts[: i + 1])
        try:
            info = os.lstat(here)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise UsageError(f"{path}: {what} cannot be read: {exc.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            raise UsageError(f"{path}: {what}: {here} is a symlink; give the folder itself")
    return True


def check_maps_folder(path: Path, what: str = "maps folder") -> Path:
    """``path`` if it is a folder that :class:`MapsFolder` will read; ``UsageError`` naming it
    when it is missing, not a folder, or reached through a symlink."""
    if not _lexists_through(path, what):
        raise UsageError(f"{path}: {what} does not exist (give an empty folder for a page without maps)")
    if not path.is_dir():
        raise UsageError(f"{path}: {what} is not a folder")
    with MapsFolder(path, what) as folder:
        folder.names()
    return path


def default_maps_folder(candidates: tuple[Path, ...], what: str = "maps folder") -> Path | None:
    """The first of ``candidates`` that is a non-empty folder (``None`` if none is); a candidate
    reached through a symlink is a ``UsageError``, not skipped."""
    for path in candidates:
        if _lexists_through(path, what) and path.is_dir():
            with MapsFolder(path, what) as folder:
                if folder.names():
                    return path
    return None


class MapsFolder:
    """A folder opened once, without following a symlink, whose files are read by name (each
    opened relative to it, so the folder cannot be swapped for another while it is read)."""

    def __init__(self, path: Path, what: str = "maps folder"):
        self.path, self.what = path, what
        try:
            self.fd = os.open(path, _OPEN_FLAGS | os.O_DIRECTORY)
        except OSError as exc:
            reason = "is a symlink or not a folder" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
            raise UsageError(f"{path}: {what} {reason}") from None

    def __enter__(self) -> MapsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def names(self) -> list[str]:
        """The folder's entries, sorted."""
        try:
            return sorted(os.listdir(self.fd))
        except OSError as exc:
            raise UsageError(f"{self.path}: {self.what} cannot be listed: {exc.strerror}") from None

    def read(self, name: str, max_bytes: int, what: str) -> bytes:
        """The bytes of the regular file ``name`` in the folder; ``UsageError`` naming it for a
        symlink, a FIFO, a device or a folder, or a file over ``max_bytes`` (checked before reading)."""
        path = self.path / name
        if "/" in name or name in (".", ".."):
            raise UsageError(f"{path}: {what} is not a plain name in {self.path}")
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_NONBLOCK, dir_fd=self.fd)  # a FIFO must not block the open
        except OSError as exc:
            reason = "is a symlink; only regular files in the folder are read" if exc.errno == errno.ELOOP else (
                f"cannot be read: {exc.strerror}")
            raise UsageError(f"{path}: {what} {reason}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UsageError(f"{path}: {what} is not a regular file")
            if info.st_size > max_bytes:
                raise UsageError(f"{path}: {what} has {info.st_size} bytes, more than the {max_bytes} allowed")
            chunks, size = [], 0
            while size <= max_bytes:  # a read may return less than asked
                chunk = os.read(fd, max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise UsageError(f"{path}: {what} is larger than the {max_bytes} bytes allowed")
        return data

    def read_json(self, name: str, max_bytes: int, what: str) -> Any:
        """The JSON document in ``name`` (strict JSON, bounded); ``UsageError`` naming it otherwise."""
        return parse_json(self.read(name, max_bytes, what), self.path / name, what)


def maps_entries(names: list[str], studies: set[str]) -> dict[str, list[str]]:
    """Which of a maps folder's ``names`` a page reads, by kind: ``png`` (map heatmaps,
    ``<module>_overflow_map_<figure>.png``), ``map`` (``<module>_overflow_map.json``),
    ``summary`` (``summary.json``) and ``study`` (the names registered modules declare). Any
    other file is never opened."""
    out: dict[str, list[str]] = {"png": [], "map": [], "summary": [], "study": []}
    for name in names:
        kind = ("png" if MAP_PNG.match(name) else "map" if MAP_JSON.match(name) else
                "summary" if name == MAP_SUMMARY else "study" if name in studies else None)
        if kind:
            out[kind].append(name)
    return out

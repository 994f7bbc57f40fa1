"""An overflow map on disk: ``<module>_overflow_map.json``, its PNG heatmaps and the module's
studies beside them, written as a set; and the map JSON read back, checked."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .files import UsageError, json_safe, read_json, require_keys, staged_folder
from .overflow_map import MAP_SCHEMA_VERSION, MapResult
from .plots import draw_map


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

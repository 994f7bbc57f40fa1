"""The GPU sessions' table (``GPU_MODULES`` in ``noxfile.py``): every default module has a GPU
session, whose test files exist and whose committed GPU report loads. Rule: structural (the
sessions themselves need a CUDA device; docs/gpu.md records their runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

from k3verify.harness import registry, report

ROOT = Path(__file__).resolve().parents[1]


def _gpu_modules() -> dict[str, tuple[tuple[str, ...], str]]:
    """The table as written in noxfile.py (read, not imported: nox need not be installed here)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "GPU_MODULES":
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py defines no GPU_MODULES table")


def _with_kernels() -> set[str]:
    """The default modules that register a kernel row (a form ``kernel:...``): what a GPU runs."""
    return {name for name in registry.module_names()
            if any(impl.form.startswith("kernel:") for impl in registry.get(name).implementations())}


def test_every_module_has_a_gpu_session() -> None:
    """Every default module with kernel rows has a GPU session."""
    table = _gpu_modules()
    assert set(table) == _with_kernels(), "a module with kernels but no GPU session, or a session too many"
    for module, (tests, baseline) in table.items():
        assert tests and all((ROOT / t).is_file() for t in tests), (module, tests)
        doc = report.load(ROOT / baseline)
        assert doc["config"]["modules"] == [module], (module, baseline, doc["config"]["modules"])

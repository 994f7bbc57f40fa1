"""The GPU sessions' table (``GPU_MODULES`` in ``noxfile.py``): every default module has a GPU
session, whose test files exist and whose committed GPU report loads. Rule: structural (the
sessions themselves need a CUDA device; docs/gpu.md records their runs).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest

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


class _CommandFailed(Exception):
    """The stand-in for ``nox.command.CommandFailed``: what a failing ``session.run`` raises."""


class _SessionQuit(Exception):
    """What the stand-in session's ``error`` raises (nox's ends the session)."""


class _Session:
    """A nox session that records each command instead of running it; the pytest command of the
    modules in ``failing`` fails as a red GPU test run would."""

    def __init__(self, out: Path, failing: set[str], table: dict[str, tuple[tuple[str, ...], str]]) -> None:
        self.posargs = [str(out)]
        self.commands: list[tuple[str, ...]] = []
        self.failing_tests = {t for m in failing for t in table[m][0]}

    def run(self, *args: str, **_: object) -> None:
        self.commands.append(args)
        if "pytest" in args and self.failing_tests & set(args):
            raise _CommandFailed()

    def log(self, *_: object) -> None:
        pass

    def error(self, message: str) -> None:
        raise _SessionQuit(message)


def _noxfile(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``noxfile.py`` loaded over a stand-in ``nox`` (nox need not be installed here)."""
    command = types.ModuleType("nox.command")
    command.CommandFailed = _CommandFailed
    nox = types.ModuleType("nox")
    nox.options = types.SimpleNamespace()
    nox.session = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda f: f)
    nox.command = command
    monkeypatch.setitem(sys.modules, "nox", nox)
    monkeypatch.setitem(sys.modules, "nox.command", command)
    spec = importlib.util.spec_from_file_location("k3verify_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("failing", [set(), {"mla"}, {"kda", "attnres_backward"}], ids=["none", "one", "two"])
def test_a_failing_module_ends_its_own_steps_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: set[str]
) -> None:
    """Rule: structural. ``nox -s gpu`` runs every module's tests even when one module fails (one
    device run shows every module's state), skips only the failed module's map, run and compare,
    and then fails naming each failed module; with none failing it runs everything and passes."""
    noxfile = _noxfile(monkeypatch)
    table = noxfile.GPU_MODULES
    session = _Session(tmp_path, failing, table)
    if failing:
        with pytest.raises(_SessionQuit) as quit:
            noxfile.gpu(session)
        named = str(quit.value).removeprefix("failed: ").split(" of ")[0].split(", ")
        assert set(named) == failing and f"of {len(table)} GPU sessions" in str(quit.value)
    else:
        noxfile.gpu(session)
    tested = [m for m, (tests, _) in table.items() for c in session.commands if "pytest" in c and tests[0] in c]
    assert tested == list(table), "a module's tests did not run"
    compared = [c[c.index("compare") + 1] for c in session.commands if "compare" in c]
    assert compared == [table[m][1] for m in table if m not in failing]

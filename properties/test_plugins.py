"""Kernels from anywhere: a plugin package installed beside k3verify (``examples/`` holds one:
``torch.compile`` of the KDA chunkwise form) appears in ``k3verify list``, in ``k3verify run``
rows, in the module's overflow map and in ``golden verify``, judged like our own forms, with no
edit to k3verify; a broken plugin becomes ``unavailable`` rows with its reason and changes no
other row or the exit status.

Rules: the example's rows by the baseline rule (fp32, chunkwise family); the rest structural.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from plugin_site import install_plugin

from k3verify.harness import golden, registry
from k3verify.harness.overflow_map import MapOptions, sweep_map
from k3verify.numerics import PASS

# The harness around the rows is under test, not the kernels: Triton's interpreter off
# (conftest ``without_interpreter``).
pytestmark = pytest.mark.usefixtures("without_interpreter")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "k3verify-compile-plugin"
NAME = "torch.compile[eager]"

# Three broken plugins, installed by hand as dist-info folders: one whose module fails to import,
# one that names a module k3verify does not have, one whose entry point raises.
BROKEN = {
    "brokenimport": ("kda", "raise ImportError('a missing dependency')", "implementations"),
    "wrongmodule": ("kdaa", """
        from k3verify.harness.registry import implementation
        from k3verify import kda
        def implementations():
            return [implementation("kdaa", kda.chunkwise, name="lost", dtype="fp32")]
    """, "implementations"),
    "raising": ("mla", "def implementations():\n    raise RuntimeError('cannot register today')", "implementations"),
}


def _install_broken(site: Path) -> None:
    for name, (group_name, source, attr) in BROKEN.items():
        install_plugin(site, dist=name, module=name, source=source, extends=group_name, attr=attr)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site folder with the example plugin built and installed by pip, and the broken ones."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), str(EXAMPLE)], check=True)
    _install_broken(target)
    return target


def _env(site: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), K3V_EXAMPLE_COMPILE_BACKEND="eager")


def _k3verify(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3verify", *args], capture_output=True, text=True, env=_env(site),
                          cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def plugged(site: Path) -> Any:
    """The plugins discovered in this process (the site on sys.path), forgotten after this
    file's tests. Shared by them: each discovery starts the plugins' worker processes (about
    4 s of a CPU each), and the tests only read what was discovered."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        patch.setenv("K3V_EXAMPLE_COMPILE_BACKEND", "eager")
        registry.reload_plugins()
        yield registry
    registry.reload_plugins()


def test_list_shows_where_each_implementation_comes_from(site: Path) -> None:
    done = _k3verify(site, "list", "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    (mine,) = [i for i in listed if i["implementation"] == NAME]
    assert mine["source"] == "k3verify-compile-plugin 0.1.0 (plugin)" and mine["available"]
    for name in BROKEN:  # every broken plugin is listed, unavailable, with its reason
        (broken,) = [i for i in listed if i["source"].startswith(f"{name} 0.1")]
        assert not broken["available"] and broken["reason"]


def test_run_judges_the_plugin_and_reports_broken_ones(site: Path, tmp_path: Path) -> None:
    # Only the plugins' rows: the built-in rows are judged by every other run test.
    names = ",".join([NAME, "brokenimport 0.1 (plugin)", "raising 0.1 (plugin)"])
    done = _k3verify(site, "run", "--modules", "kda,mla", "--out", str(tmp_path / "out"), "--maps", str(tmp_path),
                     "--implementations", names)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["rows"]
    (mine,) = [r for r in rows if r["implementation"] == NAME]
    assert mine["status"] == PASS and mine["source"] == "k3verify-compile-plugin 0.1.0 (plugin)"
    assert set(mine["outputs"]) == {"o", "final_state"} and all(o["status"] == PASS for o in mine["outputs"].values())
    broken = {r["source"].split()[0]: r for r in rows if r["status"] == "unavailable" and "plugin" in r["source"]}
    assert "a missing dependency" in broken["brokenimport"]["reason"]
    assert "cannot register today" in broken["raising"]["reason"]
    assert not [r for r in rows if r["status"] == "fail"]


def test_an_unknown_module_is_an_unavailable_row_with_its_reason(plugged: Any) -> None:
    (lost,) = [i for i in plugged.orphan_implementations() if i.implementation == "lost"]
    reason = lost.unavailable()
    assert reason and "'kdaa'" in reason and "not registered" in reason


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # the NaN-poison wrappers
def test_the_plugin_is_in_its_module_map(plugged: Any) -> None:
    result = sweep_map(plugged.get("kda"), MapOptions(quick=True, x_values=[-1.0, -6.0]))
    cells = [c for c in result.cells if NAME in c["implementation"]]
    assert len(cells) == 2 and all(c["finite"] and c["predicted_finite"] for c in cells)
    assert all(c["source"].startswith("k3verify-compile-plugin") for c in cells)


def test_the_plugin_is_judged_on_the_goldens(plugged: Any) -> None:
    rows = golden.verify_rows(ROOT / "golden", modules=["kda"])
    mine = [r for r in rows if r["implementation"] == NAME]
    assert mine and all(r["status"] == PASS for r in mine)
    assert {r["golden"] for r in mine} == {"kda/default.small.safetensors", "kda/default.production.safetensors"}

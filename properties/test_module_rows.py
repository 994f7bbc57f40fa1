"""Every registered module's rows through the runner, the part of the module contract
(``test_module_contract.py``) that runs each module whole; a file of its own so that the two
halves run side by side under ``--dist loadfile``. A new module is collected here with no edit,
the toy module of ``properties/data/toy_module.py`` included.

Rules: each row's own (``fp64-agreement`` or ``baseline``; a predicted overflow is
``expected-nonfinite``), from ``numerics.policy``.

``nox -s tests`` verifies the default run's modules once: its ``k3verify run`` computes their
rows, and this file then judges that run's report (``K3V_MODULE_ROWS=<report.json>``); its first
pytest pass (``K3V_MODULE_ROWS=opt-in``) runs the opt-in modules' rows here. Without the variable
every module's rows are computed here. The report's own completeness (schema, environment,
summary, KDA's forms) is judged on the same report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from registry_contract import ROW_FACTS, passing_rows

from k3verify.cli import main
from k3verify.harness import registry
from k3verify.numerics import EXPECTED_NONFINITE, FAIL, PASS

MODULES = registry.module_names(opt_in=True)
IN_THE_RUN = set(registry.module_names())  # what `k3verify run` verifies without --modules
SPLIT = os.environ.get("K3V_MODULE_ROWS")  # unset, "opt-in", or the path of the run's report.json


def _source(module: str) -> Path | None:
    """Where ``module``'s rows come from in this pass (``None``: computed here); skips a module
    the other pass of ``nox -s tests`` judges, saying which."""
    if SPLIT is None:
        return None
    if SPLIT == "opt-in":
        if module in IN_THE_RUN:
            pytest.skip(f"{module}: judged on the report of nox -s tests' k3verify run, after it")
        return None
    if module not in IN_THE_RUN:
        pytest.skip(f"{module}: opt-in, judged in nox -s tests' first pytest pass")
    return Path(SPLIT)


@pytest.mark.parametrize("module", MODULES)
def test_every_registered_row_passes(module: str) -> None:
    """Runner verdicts on the module's built-in cases under each row's rule (``fp64-agreement``
    or ``baseline``; a predicted overflow is ``expected-nonfinite``): no row fails, fp64 rows
    within 1e-10, every row a declared ``Row``; then what the module's rows show
    (``registry_contract.ROW_FACTS``, when it has an entry)."""
    rows = passing_rows(module, _source(module))
    assert rows, f"{module} registers no row"
    ROW_FACTS.get(module, lambda rows: None)(rows)


@pytest.fixture(scope="module")
def kda_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """A run's report with KDA in it and its markdown: ``nox -s tests``' own run when this pass
    judges it (the same files; KDA's rows computed once), else ``k3verify run --modules kda``
    here (which must exit 0)."""
    source = _source("kda")
    if source is None:
        out = tmp_path_factory.mktemp("report")
        assert main(["run", "--modules", "kda", "--out", str(out)]) == 0
        source = out / "report.json"
    return json.loads(source.read_text()), (source.parent / "report.md").read_text()


def test_the_report_is_complete(kda_report: tuple[dict[str, Any], str]) -> None:
    """Rule: structural. Schema, environment, a summary that counts every row, no failed row."""
    doc, md = kda_report
    assert doc["schema_version"] == 2
    for key in ("python", "torch", "device", "git_commit", "k3verify"):
        assert key in doc["environment"]
    assert doc["summary"]["fail"] == 0, [r for r in doc["rows"] if r["status"] == FAIL]
    assert doc["summary"]["rows"] == len(doc["rows"])
    assert "| module |" in md


def test_kda_rows_cover_every_form(kda_report: tuple[dict[str, Any], str]) -> None:
    """Rule: structural; KDA's fp16 rows by the frontier (predicted and observed overflow)."""
    doc, _ = kda_report
    rows = [r for r in doc["rows"] if r["module"] == "kda" and r["implementation"] == "k3verify"]
    seen = {(r["form"], r["dtype"]) for r in rows if r["status"] == PASS}
    for needed in [("recurrent", "fp32"), ("chunkwise", "fp64"), ("tiled", "bf16"), ("tiled", "fp16")]:
        assert needed in seen, needed
    for r in rows:
        if r["status"] == "unavailable":  # e.g. bf16 kernels where only Triton's interpreter runs
            assert r["reason"], r
            continue
        for key in ("module", "form", "metrics", "verdict", "margin", "params", "rule"):
            assert key in r, (key, r)
    # K3's bound is past fp16's frontier with matmul diagonals: predicted and observed overflow.
    fp16 = [r for r in rows if r["form"] == "tiled" and r["dtype"] == "fp16" and "diagonal" not in r["params"]]
    assert fp16 and all(r["status"] == EXPECTED_NONFINITE and r["overflow"] for r in fp16)

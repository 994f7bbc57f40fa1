"""Every registered module's rows through the runner, the part of the module contract
(``test_module_contract.py``) that runs each module whole; a file of its own so that the two
halves run side by side under ``--dist loadfile``. A new module is collected here with no edit,
the toy module of ``properties/data/toy_module.py`` included.

Rules: each row's own (``fp64-agreement`` or ``baseline``; a predicted overflow is
``expected-nonfinite``), from ``numerics.policy``.

``nox -s tests`` verifies the default run's modules once: its ``k3verify run`` computes their
rows, and this file then judges that run's report (``K3V_MODULE_ROWS=<report.json>``); its first
pytest pass (``K3V_MODULE_ROWS=opt-in``) runs the opt-in modules' rows here. Without the variable
every module's rows are computed here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from registry_contract import ROW_FACTS, passing_rows

from k3verify.harness import registry

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

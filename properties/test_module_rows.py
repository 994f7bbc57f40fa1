"""Every registered module's rows through the runner, the part of the module contract
(``test_module_contract.py``) that runs each module whole; a file of its own so that the two
halves run side by side under ``--dist loadfile``. A new module is collected here with no edit,
the toy module of ``properties/data/toy_module.py`` included.

Rules: each row's own (``fp64-agreement`` or ``baseline``; a predicted overflow is
``expected-nonfinite``), from ``numerics.policy``.
"""

from __future__ import annotations

import pytest
from registry_contract import ROW_FACTS, passing_rows

from k3verify.harness import registry

MODULES = registry.module_names(opt_in=True)


@pytest.mark.parametrize("module", MODULES)
def test_every_registered_row_passes(module: str) -> None:
    """Runner verdicts on the module's built-in cases under each row's rule (``fp64-agreement``
    or ``baseline``; a predicted overflow is ``expected-nonfinite``): no row fails, fp64 rows
    within 1e-10, every row a declared ``Row``; then what the module's rows show
    (``registry_contract.ROW_FACTS``, when it has an entry)."""
    rows = passing_rows(module)
    assert rows, f"{module} registers no row"
    ROW_FACTS.get(module, lambda rows: None)(rows)

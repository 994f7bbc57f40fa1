"""Golden checks regenerate every case of the manifest's seed; tests that check many edited
copies of one golden set memoise that regeneration (it is deterministic, and the cases cache
today's oracle)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from k3verify.harness import registry


@contextlib.contextmanager
def memoised_golden_cases() -> Iterator[None]:
    """While the block runs, ``ModuleEntry.cases_for_goldens`` returns one set of cases per
    (module, seed)."""
    real = registry.ModuleEntry.cases_for_goldens
    memo: dict[tuple[str, int], Any] = {}

    def cached(entry: registry.ModuleEntry, seed: int) -> Any:
        if (entry.name, seed) not in memo:
            memo[entry.name, seed] = real(entry, seed)
        return memo[entry.name, seed]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry.ModuleEntry, "cases_for_goldens", cached)
        yield

"""k3verify's pytest plugin (registered through the ``pytest11`` entry point when k3verify is
installed): a fixture for judging kernels against the fp64 oracle in any test suite.

    def test_my_kernel(k3verify_oracle):
        k3verify_oracle.assert_matches(my_kda, module="kda", dtype=torch.bfloat16)

Nothing heavy is imported until a test asks for the fixture, so an installed k3verify costs
other projects' test sessions nothing.
"""

from __future__ import annotations

from typing import Any

import pytest


class Oracle:
    """What the ``k3verify_oracle`` fixture hands a test: the functions of :mod:`k3verify.testing`."""

    def assert_matches(self, fn: Any, module: str, dtype: Any = None, cases: Any = None, **kw: Any) -> list[dict]:
        """:func:`k3verify.testing.assert_matches_oracle` (``dtype`` defaults to bf16)."""
        __tracebackhide__ = True
        import torch

        from .testing import assert_matches_oracle

        return assert_matches_oracle(fn, module, torch.bfloat16 if dtype is None else dtype, cases, **kw)

    def cases(self, module: str, names: Any = None, *, seed: int = 0) -> list[Any]:
        """:func:`k3verify.testing.cases`."""
        from .testing import cases

        return cases(module, names, seed=seed)

    def strategy(self, module: str) -> Any:
        """:func:`k3verify.testing.strategy`."""
        from .testing import strategy

        return strategy(module)


@pytest.fixture
def k3verify_oracle() -> Oracle:
    """Judge a kernel against k3verify's fp64 oracle: ``k3verify_oracle.assert_matches(fn, module=...)``."""
    return Oracle()

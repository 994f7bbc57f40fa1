"""A sixth, toy module for the module contract (``properties/test_module_contract.py``): a pytest
plugin (``-p toy_module``) that registers it before collection, so the contract's tests run on
it with no edit to any test file. ``K3V_TOY_BROKEN=1`` registers it with its oracle in fp32,
the class of bug the contract exists to catch.

The toy computes ``y = Σ_i softmax(x w)_i x_i`` over the rows of ``x:[n, d]``.
"""

from __future__ import annotations

import os

import torch

from k3verify.harness import registry
from k3verify.harness.registry import Case, Implementation, ModuleEntry
from k3verify.numerics import resolve_dtype, rule_for


def mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[n, d], [d] -> [d]``: the rows of ``x`` weighted by the softmax of their logits, in
    ``x``'s dtype with the softmax in fp32 at least (fp64 stays fp64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    p = torch.softmax((x.to(compute) @ w.to(compute)), dim=0)
    return (p[:, None] * x.to(compute)).sum(0).to(x.dtype)


def _cases(seed: int) -> dict[str, Case]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(32, generator=gen, dtype=torch.float64) / 32**0.5
    return {"default": Case("default", {"x": x, "w": w})}


def _oracle(case: Case) -> dict[str, torch.Tensor]:
    x = case.inputs["x"].float() if os.environ.get("K3V_TOY_BROKEN") else case.inputs["x"]
    return {"out": mix(x, case.inputs["w"].to(x.dtype))}


def _call(fn, case: Case, dtype, **options) -> dict[str, torch.Tensor]:
    dt = resolve_dtype(dtype)
    return {"out": fn(case.inputs["x"].to(dt), case.inputs["w"].to(dt), **options)}


def _baseline(case: Case, dtype: str, family: str) -> dict[str, torch.Tensor]:
    return _call(mix, case, dtype)


def _implementations() -> list[Implementation]:
    return [Implementation(module="toy", implementation="k3verify", form="recurrent", dtype=d, params={},
                           rule=rule_for(d), run=lambda case, d=d: _call(mix, case, d))
            for d in ("fp64", "fp32", "bf16")]


def pytest_configure(config) -> None:
    registry.module_names()  # the built-in entries first, in their order
    registry.register(ModuleEntry(name="toy", title="toy softmax mix", make_cases=_cases, oracle=_oracle,
                                  baseline=_baseline, own_implementations=_implementations, call=_call))

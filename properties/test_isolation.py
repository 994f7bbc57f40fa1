"""Inputs written in place are a failed verdict naming the input, in every module and dtype, and
they reach no other implementation.

Each module's correct form is wrapped so that it computes its outputs first and then changes one
element of one argument: the outputs are right, so only the mutation check can fail the call.
At fp64 the kernel receives the case's tensors without a cast (the path on which a mutation used
to corrupt the next implementation's inputs); at bf16 it receives cast copies, which only the
check inside the module's adapter sees. After every mutant the unwrapped form passes on the same
case object, and the case's inputs are bit for bit what they were.

Rules: structural (the failure and the name it gives); the control by the module's own rule
(fp64-agreement at fp64, the baseline rule at bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from k3verify import attnres, kda, mla, moe
from k3verify.harness import registry, runner
from k3verify.harness.registry import BUILTIN_SOURCE
from k3verify.numerics import FAIL, PASS, named_tensors
from k3verify.testing import assert_matches_oracle, cases

# module: (correct form, the case it runs, the names the adapter gives its positional arguments)
FORMS: dict[str, tuple[Callable[..., Any], str, tuple[str, ...]]] = {
    "kda": (kda.chunkwise, "default", ("q", "k", "v", "g", "beta")),
    "mla": (mla.recurrent, "default", ("q_nope", "q_pe", "cache", "w_uk", "w_uv")),
    "attnres": (attnres.AGGREGATIONS["recurrent"], "sources", ("sources", "w", "gamma")),
    "moe": (moe.recurrent, "default", ("x", "weights", "config")),
}
WRITABLE = {"mla": {"cache"}}  # a paged cache is written by contract


def _poke(t: torch.Tensor) -> None:
    """Change one element of ``t`` in place."""
    if t.dtype == torch.bool:
        t.logical_not_()
    else:  # the first element, whatever the strides (a case's tensor may be a slice)
        t[(0,) * t.dim()].add_(1)


def _targets() -> list[tuple[str, int, str]]:
    return [(module, i, name) for module, (_, _, names) in FORMS.items() for i, name in enumerate(names)
            if name not in WRITABLE.get(module, ()) and not (module == "moe" and name == "config")]


def _snapshot(case: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in named_tensors(case.inputs, "inputs")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, a NaN equal to a NaN (MLA's dead cache slots hold NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all()
                                                              if a.is_floating_point() else torch.equal(a, b))


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
@pytest.mark.parametrize(("module", "index", "name"), _targets(), ids=lambda v: str(v))
def test_a_written_input_fails_naming_it_and_the_next_form_passes(module: str, index: int, name: str,
                                                                  dtype: str) -> None:
    correct, case_name, _ = FORMS[module]
    (case,) = cases(module, [case_name])
    before = _snapshot(case)
    poked: list[str] = []

    def writes(*args: Any, **kwargs: Any) -> Any:
        out = correct(*args, **kwargs)
        path, tensor = next(named_tensors(args[index], name))
        _poke(tensor)
        poked.append(path)
        return out

    with pytest.raises(AssertionError, match="modified its input") as info:
        assert_matches_oracle(writes, module, dtype, cases=[case])
    assert poked and f"modified its input {poked[0]} in place (1 of" in str(info.value), str(info.value)
    assert all(_same(t, now) for (_, t), (_, now) in zip(before, _snapshot(case), strict=True))
    assert_matches_oracle(correct, module, dtype, cases=[case])


def test_a_run_that_writes_into_its_case_fails_and_the_next_row_passes() -> None:
    """An implementation whose ``run`` reaches past the module's adapter into the case it was
    given (a registered plugin's ``run`` may): its row fails naming the input, and the row after
    it, on the same case object, sees the original inputs."""
    entry = registry.get("kda")
    (case,) = cases("kda", ["default"])
    control = next(i for i in entry.implementations() if i.form == "chunkwise" and i.dtype == "fp64")

    def run(given: Any) -> Any:
        out = control.run(given)
        given.inputs["v"][0, 1].mul_(-1)
        return out

    for source in ("a plugin", BUILTIN_SOURCE):  # our own forms get a copy too
        writer = dataclasses.replace(control, implementation="writer", run=run, source=source)
        row = runner.verify(entry, writer, case)
        assert row["status"] == FAIL and "InputMutated: modified its input v in place" in row["reason"], row
        assert runner.verify(entry, control, case)["status"] == PASS

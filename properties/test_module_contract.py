"""The contract every registered module meets, checked over each one (the built-in four, the
opt-in layers, and any entry registered before collection: ``properties/data/toy_module.py``
shows a new module getting these tests with no edit here). Every module's rows through the
runner are the contract's other half, in ``test_module_rows.py``.

Rules: structural (names, dtypes, rules, determinism on one host), and fp64-agreement for the
fp64 forms against the module's oracle (``numerics.policy``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3verify.harness import registry, runner
from k3verify.harness.registry import as_outputs
from k3verify.numerics import PASS, named_tensors, rule_for

ROOT = Path(__file__).resolve().parents[1]
# The contract's other half: every module's rows, in a file of its own (it runs each module whole).
ROWS = Path(__file__).with_name("test_module_rows.py")
MODULES = registry.module_names(opt_in=True)


@pytest.fixture(scope="module")
def made() -> dict[str, dict]:
    """Each module's built-in cases (seed 0), made once."""
    return {m: registry.get(m).make_cases(0) for m in MODULES}


@pytest.mark.parametrize("module", MODULES)
def test_cases_are_fp64_on_the_cpu_and_reproducible(module: str, made: dict) -> None:
    cases = made[module]
    assert cases, f"{module} makes no case"
    again = registry.get(module).make_cases(0)
    assert list(again) == list(cases)
    for name, case in cases.items():
        assert case.name == name
        tensors = dict(named_tensors(case.inputs, "inputs"))
        assert tensors, f"{module}/{name} has no tensor input"
        for key, t in tensors.items():
            if t.is_floating_point():
                assert t.dtype == torch.float64 and t.device.type == "cpu", f"{module}/{name} {key}: {t.dtype}"
            other = dict(named_tensors(again[name].inputs, "inputs"))[key]
            same = (t == other) | (t.isnan() & other.isnan()) if t.is_floating_point() else t == other
            assert bool(same.all()), f"{module}/{name} {key} moved"  # dead cache slots hold NaN on purpose


@pytest.mark.parametrize("module", MODULES)
def test_the_oracle_names_its_outputs_in_fp64(module: str, made: dict) -> None:
    entry = registry.get(module)
    case = next(iter(made[module].values()))
    out = as_outputs(entry.oracle(case), entry.outputs, f"the {module} oracle")
    assert set(out) <= set(entry.outputs) and entry.primary in out
    for name, t in out.items():
        if t.is_floating_point():
            assert t.dtype == torch.float64, f"the {module} oracle's {name} is {t.dtype}: fp64 must stay fp64"


def test_the_entry_computes_each_oracle_and_baseline_once_per_case() -> None:
    """Structural: the memo is the entry's, for any module's functions (none writes its own)."""
    calls: list[tuple] = []

    def oracle(case: registry.Case) -> dict:
        calls.append(("oracle",))
        return {"out": torch.zeros(1, dtype=torch.float64)}

    def baseline(case: registry.Case, dtype: str, family: str = "recurrent") -> dict:
        calls.append(("baseline", dtype, family))
        return {"out": torch.zeros(1)}

    entry = registry.ModuleEntry(name="memo-probe", title="", make_cases=lambda seed: {}, oracle=oracle,
                                 baseline=baseline, own_implementations=list)
    case, other = registry.Case("a", {}), registry.Case("b", {})
    assert entry.oracle(case) is entry.oracle(case)
    entry.baseline(case, "bf16", "recurrent"), entry.baseline(case, "bf16", "recurrent")
    entry.baseline(case, "fp16", "recurrent"), entry.baseline(case, "bf16", "chunkwise")
    entry.oracle(other)
    assert calls == [("oracle",), ("baseline", "bf16", "recurrent"), ("baseline", "fp16", "recurrent"),
                     ("baseline", "bf16", "chunkwise"), ("oracle",)]
    # A copy of the entry (dataclasses.replace) keeps one memo, not two layers of it.
    again = dataclasses.replace(entry, title="again")
    assert again.oracle is entry.oracle


@pytest.mark.parametrize("module", MODULES)
def test_implementations_name_their_module_rule_cases_and_baseline(module: str, made: dict) -> None:
    entry = registry.get(module)
    impls = entry.own_implementations()
    assert impls, f"{module} registers no implementation"
    labels = [impl.label for impl in impls]
    assert len(set(labels)) == len(labels), "an implementation registered twice"
    for impl in impls:
        assert impl.module == module, impl.label
        assert impl.rule == rule_for(impl.dtype), f"{impl.label}: rule {impl.rule}, policy says {rule_for(impl.dtype)}"
        # A family may carry a variant after "/" (MoE's fp8 scalings: "recurrent/per_row").
        assert impl.baseline.split("/")[0] in entry.baseline_families, (impl.label, impl.baseline)
        # A case a row asks for is one the module makes (cases only a CUDA machine makes aside).
        asked = set(impl.cases) - set(made[module])
        assert not asked or (not torch.cuda.is_available() and all("k3" in c for c in asked)), (impl.label, asked)


@pytest.mark.parametrize("module", MODULES)
def test_the_fp64_forms_agree_with_the_oracle(module: str, made: dict) -> None:
    """Rule: fp64-agreement, each fp64 form on the first case it runs on."""
    entry = registry.get(module)
    fp64 = [impl for impl in entry.own_implementations() if impl.dtype == "fp64" and not impl.unavailable()
            and not impl.form.startswith("kernel")]
    assert fp64, f"{module} has no fp64 form"
    for impl in fp64:
        case = next(c for c in impl.cases if c in made[module])
        row = runner.verify(entry, impl, made[module][case])
        assert row["status"] == PASS, (impl.label, case, row.get("reason") or row["verdict"]["reason"])


def _contract(*env: tuple[str, str]) -> subprocess.CompletedProcess:
    # The toy's rows are computed in its own run (a split of nox -s tests would skip them).
    inherited = {k: v for k, v in os.environ.items() if k != "K3V_MODULE_ROWS"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", __file__, str(ROWS), "-p", "toy_module", "-q", "-p", "no:cacheprovider",
         "-k", "toy", "-p", "no:xdist"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=dict(inherited, PYTHONPATH=os.pathsep.join([str(ROOT / "properties" / "data"), str(ROOT)]), **dict(env)),
    )  # fmt: skip


@pytest.mark.skipif("toy" in MODULES, reason="this run is the toy's own")
def test_a_new_module_gets_the_contract_with_no_edit() -> None:
    """The toy module, registered by a pytest plugin, is collected by every contract test; with
    its oracle computed in fp32 (a planted bug) the contract fails it and names the module."""
    done = _contract()
    assert done.returncode == 0, done.stdout[-2000:]
    tests = [n for n, f in globals().items() if n.startswith("test_") and "module" in f.__code__.co_varnames]
    assert f"{len(tests) + 1} passed" in done.stdout, done.stdout[-1000:]  # + the rows test of ROWS
    broken = _contract(("K3V_TOY_BROKEN", "1"))
    assert broken.returncode == 1, broken.stdout[-2000:]
    assert "the toy oracle's out is torch.float32: fp64 must stay fp64" in broken.stdout, broken.stdout[-2000:]

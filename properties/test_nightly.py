"""The worst-case search (``nox -s nightly``) and the checks of its machinery that CI runs.

The search itself is marked ``nightly``: one test per registered module, each with an even
share of the time budget, writing its maxima and replay commands to ``nightly.json``. The
other tests run a few examples under the ``ci`` profile. Every ratio is ``err / limit`` of the
row's own policy rule (``baseline``: rms_ratio against 2 x baseline + floor; ``fp64-agreement``:
rel_max against 1e-10), so a ratio above 1 is exactly a failed verdict.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import worst_case
from hypothesis import settings
from quick_forms import without_kernels

from k3verify.harness import registry
from k3verify.harness.environment import environment
from k3verify.harness.files import json_safe

NIGHTLY_SCHEMA = 1


def write_nightly(path: Path, module: str, result: dict[str, Any], *, budget_s: float, run_seed: int) -> None:
    """Merge one module's search result into ``path`` (other modules' entries are kept)."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    if doc.get("schema_version") != NIGHTLY_SCHEMA:
        doc = {"schema_version": NIGHTLY_SCHEMA, "modules": {}}
    doc.update(
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        profile=settings.get_current_profile_name(),
        budget_s=budget_s,
        hypothesis_seed=run_seed,
        environment=environment(),
    )
    doc["modules"][module] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=1) + "\n")


@pytest.fixture(scope="session")
def remote_searches(request: pytest.FixtureRequest, nightly_budget_s: float,
                    nightly_seed: int) -> Iterator[dict[str, Any] | None]:
    """With ``--nightly-engine dask``: every module's search submitted at once, one Dask task each
    (the futures by module), for the session; ``None`` on the local engine. The modules share the
    budget as on the local engine, but side by side: each gets the budget times the workers over
    the modules (at most the whole budget), so the search's wall time stays about the budget."""
    if request.config.getoption("--nightly-engine") != "dask":
        yield None
        return
    from k3verify.harness import dask_engine

    options = dask_engine.DaskOptions(scheduler=request.config.getoption("--nightly-scheduler"),
                                      workers=request.config.getoption("--nightly-workers"))
    modules = registry.module_names()
    with dask_engine.dask_client(options) as client:
        workers = max(1, len(client.nthreads()))
        share = nightly_budget_s * min(workers, len(modules)) / len(modules)
        yield worst_case.submit_searches(client, modules, budget_s=share, run_seed=nightly_seed,
                                         profile=settings.default)


@pytest.mark.nightly
@pytest.mark.parametrize("module", registry.module_names())
def test_worst_case_search(module: str, nightly_budget_s: float, nightly_out: Path, nightly_seed: int,
                           remote_searches: dict[str, Any] | None) -> None:
    """Climb toward the module's largest err/limit; every verdict on the way must pass."""
    error = None
    try:
        if remote_searches is None:
            share = nightly_budget_s / len(registry.module_names())
            result = worst_case.search(module, budget_s=share, run_seed=nightly_seed)
        else:
            outcome = remote_searches[module].result()
            result, error = outcome["result"], outcome["error"]
    except Exception as exc:
        result = getattr(exc, "search_result", {})
        raise
    finally:
        worst_case.RESULTS[module] = result
        write_nightly(nightly_out, module, result, budget_s=nightly_budget_s, run_seed=nightly_seed)
    assert error is None, error
    assert result["examples"] > 0


# --- the machinery, under the ci profile --------------------------------------------------


def test_search_maxima_replay_exactly() -> None:
    """The recorded worst example replays to the same ratio, and no ratio exceeds 1 (every row
    passed its rule on the drawn examples: the search found no failure)."""
    result = worst_case.search("kda", budget_s=60, run_seed=0, max_examples=3)
    assert result["examples"] == 3 and not result["failures"]
    assert all(0 <= e["ratio"] <= 1 for e in result["per_implementation"].values())
    worst = result["worst"]
    replayed = worst_case.replay("kda", worst["params"])
    # Bitwise: the replay runs the same computation on the same shapes in this process.
    assert replayed[worst["implementation"]] == worst["ratio"]
    assert worst["replay"].startswith("python properties/worst_case.py kda '")
    assert json.loads(worst["replay"].split(" ", 3)[3].strip("'")) == worst["params"]


def test_budget_stops_new_work() -> None:
    """With no time left after the first example, the remaining draws do nothing."""
    result = worst_case.search("mla", budget_s=0.0, run_seed=0, max_examples=6)
    assert result["examples"] == 1


def test_a_module_without_a_search_space_is_searched_over_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(worst_case.SPACES, "mla")
    without_kernels(monkeypatch, "mla")  # the search's fallback is what is tested
    assert worst_case.space_for("mla") is worst_case.SEED_SPACE
    result = worst_case.search("mla", budget_s=0.0, run_seed=0, max_examples=2)
    assert result["examples"] == 1
    cases = {e["case"] for e in result["per_implementation"].values()}
    assert cases <= set(registry.get("mla").make_cases(0)) and "default" in cases


def test_a_broken_implementation_fails_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 tiled form that returns zeros has rms_ratio 1, far above its baseline-rule limit."""
    entry = registry.get("kda")
    good = next(i for i in entry.implementations() if i.form == "tiled" and i.dtype == "bf16")
    broken = dataclasses.replace(good, run=lambda case: {k: torch.zeros_like(v).to(torch.bfloat16)
                                                         for k, v in entry.oracle(case).items()})
    monkeypatch.setitem(registry._REGISTRY, "kda", dataclasses.replace(entry, own_implementations=lambda: [broken]))
    with pytest.raises(AssertionError, match="rms_ratio") as info:
        worst_case.search("kda", budget_s=60, run_seed=0, max_examples=2)
    partial = info.value.search_result
    assert partial["failures"] and partial["worst"]["ratio"] > 1


def test_nightly_file_merges_modules(tmp_path: Path) -> None:
    path = tmp_path / "nightly.json"
    write_nightly(path, "kda", {"examples": 1, "worst": {"ratio": 0.5}}, budget_s=10, run_seed=7)
    write_nightly(path, "mla", {"examples": 2, "worst": {"ratio": math.inf}}, budget_s=10, run_seed=7)
    doc = json.loads(path.read_text())
    assert set(doc["modules"]) == {"kda", "mla"} and doc["hypothesis_seed"] == 7
    assert doc["modules"]["mla"]["worst"]["ratio"] is None  # JSON has no inf

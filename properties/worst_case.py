"""Worst-case search: Hypothesis climbs toward each module's largest error ratio.

For every registered module, examples are drawn from a *search space* (parameters ->
cases); every available implementation that runs on a drawn case is judged by the runner
under its policy rule, and ``hypothesis.target`` is fed its error ratio ``err / limit`` (1 =
at the limit of its rule). Implementations whose overflow is predicted and observed
(``expected-nonfinite``) have no ratio. A failed verdict fails the search, as any property.

KDA and MLA have search spaces over sizes, gate bounds, page layouts and query scales; any
other module is searched over the seed of its own ``make_cases``, so a new module is covered
the day it is registered. The search stops drawing new work when its time budget is spent.
The baseline rule compares error statistics, so, as in the property tests, drawn problems
have at least 1024 outputs (KDA: 64+ tokens, 16 value channels) or 128 (MLA): on a handful
of outputs one ill-conditioned dot product decides the ratio.

Replay one example (it prints every implementation's ratio on it)::

    python properties/worst_case.py MODULE 'PARAMS_JSON'
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import given, seed, settings, target
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # the replay command runs this file directly

from k3verify.harness import registry, runner
from k3verify.harness.registry import Case, Implementation, ModuleEntry
from k3verify.kda.samples import make_problem as kda_problem
from k3verify.mla.samples import make_problem as mla_problem
from k3verify.numerics import EXPECTED_NONFINITE, FAIL

REPLAY = "python properties/worst_case.py {module} '{params}'"
RESULTS: dict[str, dict[str, Any]] = {}  # module -> search() result, for the terminal summary


@dataclass(frozen=True)
class SearchSpace:
    """Parameters Hypothesis draws (JSON-ready values) and how they become named cases."""

    params: st.SearchStrategy[dict[str, Any]]
    cases: Callable[[ModuleEntry, dict[str, Any]], dict[str, Case]]


def _kda_cases(entry: ModuleEntry, p: dict[str, Any]) -> dict[str, Case]:
    # Random gates are the ``default`` case kind; saturated (random or one-hot q/k) ``saturated``.
    problem = kda_problem(p["B"], p["T"], p["H"], p["K"], p["V"], g_min=p["g_min"], seed=p["seed"],
                          kind=p["kind"], initial_state=p["initial_state"])
    name = "default" if p["kind"] == "random" else "saturated"
    return {name: Case(name, dict(problem.inputs), dict(p))}


def _mla_cases(entry: ModuleEntry, p: dict[str, Any]) -> dict[str, Case]:
    # Unscaled queries are ``default`` (``decode`` with one new token); scaled ones ``hot``.
    problem = mla_problem(tuple(p["contexts"]), p["T"], H=p["H"], Dr=p["Dr"], page_size=p["page_size"],
                          seed=p["seed"], q_scale=2.0 ** p["log2_q_scale"])
    name = "hot" if p["log2_q_scale"] > 0 else ("decode" if p["T"] == 1 else "default")
    inputs = dict(q_nope=problem.q_nope, q_pe=problem.q_pe, cache=problem.cache, w_uk=problem.w_uk, w_uv=problem.w_uv)
    return {name: Case(name, inputs, dict(p))}


def _seed_cases(entry: ModuleEntry, p: dict[str, Any]) -> dict[str, Case]:
    return entry.make_cases(p["seed"])


_rounded = st.floats(-5.5, -0.5).map(lambda x: round(x, 2))
SPACES: dict[str, SearchSpace] = {
    "kda": SearchSpace(
        st.fixed_dictionaries({
            "B": st.integers(1, 2), "T": st.integers(64, 160), "H": st.integers(1, 2),
            "K": st.sampled_from((16, 32)), "V": st.just(16), "g_min": _rounded,
            "kind": st.sampled_from(("random", "saturated", "worst")), "seed": st.integers(0, 2**16),
            "initial_state": st.booleans(),
        }),
        _kda_cases,
    ),
    "mla": SearchSpace(
        st.fixed_dictionaries({
            "contexts": st.lists(st.integers(0, 48), min_size=1, max_size=4),
            "T": st.one_of(st.just(1), st.integers(8, 16)), "H": st.integers(1, 4), "Dr": st.sampled_from((4, 8)),
            "page_size": st.sampled_from((1, 4, 16)),
            "log2_q_scale": st.one_of(st.just(0.0), st.floats(0.5, 5.5).map(lambda x: round(x, 2))),
            "seed": st.integers(0, 2**16),
        }).filter(lambda p: len(p["contexts"]) * p["T"] * p["H"] * 2 * p["Dr"] >= 128),  # outputs B T H Dv
        _mla_cases,
    ),
}
SEED_SPACE = SearchSpace(st.fixed_dictionaries({"seed": st.integers(0, 2**31 - 1)}), _seed_cases)


def space_for(module: str) -> SearchSpace:
    """The module's search space; a search over ``make_cases``' seed when it has none."""
    return SPACES.get(module, SEED_SPACE)


def ratio_of(row: dict[str, Any]) -> float | None:
    """``err / limit`` of a judged row (inf when the limit is not finite); ``None`` when there is
    nothing to climb (unavailable, or an overflow that was predicted and observed)."""
    if row["status"] in (runner.UNAVAILABLE, EXPECTED_NONFINITE) or "verdict" not in row:
        return None
    err, limit = row["verdict"]["err"], row["verdict"]["limit"]
    if not (isinstance(limit, float) and math.isfinite(limit) and limit > 0) or not math.isfinite(err):
        return math.inf
    return err / limit


def evaluate(entry: ModuleEntry, impls: list[Implementation], cases: dict[str, Case]) -> list[dict[str, Any]]:
    """Rows of every implementation on every drawn case it runs on."""
    return [runner.verify(entry, impl, case) for name, case in cases.items() for impl in impls if name in impl.cases]


def replay(module: str, params: dict[str, Any]) -> dict[str, float | None]:
    """``{implementation label (case): ratio}`` on the example ``params`` of ``module``."""
    entry = registry.get(module)
    impls = [i for i in entry.implementations() if i.unavailable() is None]
    cases = space_for(module).cases(entry, params)
    rows = evaluate(entry, impls, cases)
    return {_label(r, impls): ratio_of(r) for r in rows}


def _label(row: dict[str, Any], impls: list[Implementation]) -> str:
    params = " ".join(f"{k}={v}" for k, v in row["params"].items())
    return f"{row['module']}/{row['implementation']}:{row['form']}[{row['dtype']}{' ' + params if params else ''}]" \
           f" ({row['case']})"


def search(module: str, *, budget_s: float, run_seed: int, max_examples: int | None = None,
           profile: settings | None = None) -> dict[str, Any]:
    """Climb toward ``module``'s largest error ratio for ``budget_s`` seconds of work.

    Returns ``{"examples", "wall_s", "budget_s", "hypothesis_seed", "failures", "worst",
    "per_implementation": {label: {"ratio", "err", "limit", "metric", "status", "params",
    "replay"}}}``; ``worst`` is the entry with the largest ratio. The Hypothesis settings are
    ``profile``'s (default: the loaded profile's), with ``max_examples`` overridden when given.
    Raises the first failure (after shrinking), with the partial result attached as
    ``exc.search_result``.
    """
    entry = registry.get(module)
    impls = [i for i in entry.implementations() if i.unavailable() is None]
    space = space_for(module)
    best: dict[str, dict[str, Any]] = {}
    state = {"examples": 0, "deadline": None, "failures": []}
    start = time.monotonic()

    def probe(params: dict[str, Any]) -> None:
        now = time.monotonic()
        state["deadline"] = state["deadline"] or now + budget_s
        if now > state["deadline"] and not state["failures"]:
            # Budget spent: the remaining draws are no-ops. Once a failure is found every draw
            # runs, so that shrinking sees the same outcome for the same example.
            return
        state["examples"] += 1
        rows = evaluate(entry, impls, space.cases(entry, params))
        failed = []
        for row in rows:
            ratio = ratio_of(row)
            if ratio is None:
                continue
            label = _label(row, impls)
            if math.isfinite(ratio):
                target(ratio, label=label)
            if ratio > best.get(label, {}).get("ratio", -1.0):
                v = row["verdict"]
                best[label] = {
                    "ratio": ratio, "err": v["err"], "limit": v["limit"], "metric": v["metric"],
                    "status": row["status"], "case": row["case"], "params": params,
                    "replay": REPLAY.format(module=module, params=json.dumps(params, sort_keys=True)),
                }
            if row["status"] == FAIL:
                failed.append(f"{label}: {row.get('reason') or row['verdict']['reason']}")
        if failed:
            state["failures"].append({"params": params, "failed": failed})
        assert not failed, f"{module} {params}: " + "; ".join(failed)

    overrides = {} if max_examples is None else {"max_examples": max_examples}
    run = seed(run_seed)(settings(profile or settings.default, database=None, **overrides)(given(space.params)(probe)))
    result: dict[str, Any] = {}
    try:
        run()
    except Exception as exc:
        exc.search_result = result  # type: ignore[attr-defined]
        raise
    finally:
        worst = max(best.items(), key=lambda kv: kv[1]["ratio"], default=None)
        result.update(
            examples=state["examples"],
            wall_s=round(time.monotonic() - start, 1),
            budget_s=budget_s,
            hypothesis_seed=run_seed,
            failures=state["failures"],
            worst={"implementation": worst[0], **worst[1]} if worst else None,
            per_implementation=dict(sorted(best.items(), key=lambda kv: -kv[1]["ratio"])),
        )
    return result


def search_or_error(module: str, *, budget_s: float, run_seed: int, profile: settings,
                    max_examples: int | None = None) -> dict[str, Any]:
    """:func:`search` as a Dask task runs it: ``{"result", "error"}``, ``error`` ``None`` or the
    failure as one line of text (an exception's attached partial result would not survive the
    trip back to the client). ``profile``: the client's Hypothesis settings (a worker has loaded
    no profile of its own)."""
    try:
        return {"result": search(module, budget_s=budget_s, run_seed=run_seed, max_examples=max_examples,
                                 profile=profile), "error": None}
    except Exception as exc:
        return {"result": getattr(exc, "search_result", {}), "error": f"{type(exc).__name__}: {exc}"}


def submit_searches(client: Any, modules: list[str], *, budget_s: float, run_seed: int, profile: settings,
                    max_examples: int | None = None) -> dict[str, Any]:
    """One Dask task per module on ``client``'s cluster, each :func:`search_or_error` with its own
    ``budget_s``: the futures by module. On a cluster of GPU workers (resource ``GPU``, as
    ``k3verify.harness.dask_engine`` starts them on a CUDA machine) each search holds one device.
    This file travels to the workers by value (they need k3verify and Hypothesis installed,
    not this checkout's ``properties`` folder)."""
    import cloudpickle

    from k3verify.harness.dask_engine import task_resources

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    resources = task_resources(client)
    return {
        module: client.submit(search_or_error, module, budget_s=budget_s, run_seed=run_seed, profile=profile,
                              max_examples=max_examples, key=f"worst-case-search-{module}-{run_seed}", pure=False,
                              resources=resources)
        for module in modules
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for label, ratio in replay(sys.argv[1], json.loads(sys.argv[2])).items():
        print(f"{'-' if ratio is None else f'{ratio:.4f}':>8}  {label}")

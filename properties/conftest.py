"""Hypothesis profiles shared by every property test.

``ci`` (the default) is derandomised with bounded examples so CI is reproducible;
``thorough`` explores more; ``nightly`` also climbs toward the largest error through
``hypothesis.target``; ``gpu`` is ``thorough`` without deadlines for device runs.
Choose with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``.
Every failure prints its reproduction blob (``print_blob=True``).

The worst-case search (``-m nightly``, ``properties/test_nightly.py``) takes its time budget
from ``--nightly-budget`` or ``K3V_NIGHTLY_BUDGET_S`` (seconds for all modules together,
split evenly), its Hypothesis seed from ``K3V_NIGHTLY_SEED`` (random when unset) and writes
its maxima to ``--nightly-out`` or ``K3V_NIGHTLY_OUT`` (default ``reports/latest/nightly.json``);
the terminal summary prints each module's worst case with its replay command.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# The interpreter is chosen before any test module imports Triton: those that import the GPU
# benchmarks' helpers (triton.testing) would otherwise, collected first, leave every interpreted
# kernel unavailable (k3verify.triton_support.LANGUAGE_BEFORE_INTERPRETER).
import k3verify.triton_support  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("ci", derandomize=True, max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
# The worst-case search spends at most half of max_examples on target() optimisation passes
# interleaved with generation (Hypothesis does so from 1000 examples up); its time budget,
# not this count, usually ends a nightly run.
settings.register_profile(
    "nightly",
    max_examples=2000,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    **_COMMON,
)
# The GPU session users run in CI is derandomised like ``ci``: the same examples on every
# device, so a red run is a change in the code or the device, never a new draw. Exploring
# draws fresh examples (nightly on a GPU).
settings.register_profile("gpu", derandomize=True, max_examples=100, **_COMMON)
settings.register_profile("gpu-explore", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist every worker would start one intra-op thread per core for the CPU-side
# oracles: the cores shared out instead of oversubscribed (8 workers x 16 threads on 16 cores).
# The share goes to the commands a test starts too (k3verify run, golden generate: a new process
# reads OMP_NUM_THREADS): with two threads each on two cores busy with the other worker, torch's
# spinning threads made `k3verify run --modules moe_backward` take 17 s instead of 1.4 s.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

NIGHTLY_BUDGET_S = 1800.0
NIGHTLY_OUT = "reports/latest/nightly.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("k3verify nightly search")
    group.addoption("--nightly-budget", type=float, default=None,
                    help=f"seconds for the worst-case search, all modules together (env K3V_NIGHTLY_BUDGET_S; "
                         f"default {NIGHTLY_BUDGET_S:g})")
    group.addoption("--nightly-out", default=None,
                    help=f"where the search writes its maxima (env K3V_NIGHTLY_OUT; default {NIGHTLY_OUT})")
    group.addoption("--nightly-engine", choices=("local", "dask"), default="local",
                    help="local: one module after the other in this process (default); dask: one task per module "
                         "on a Dask cluster, all at once, each with the budget's share of its worker")
    group.addoption("--nightly-scheduler", default=None, metavar="ADDRESS",
                    help="with --nightly-engine dask: the scheduler of an existing cluster")
    group.addoption("--nightly-workers", type=int, default=None, metavar="N",
                    help="with --nightly-engine dask: a LocalCluster of N workers (default: one per core)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nightly: the budgeted worst-case search (nox -s nightly); not run in CI")
    engine = config.getoption("--nightly-engine")
    scheduler, workers = config.getoption("--nightly-scheduler"), config.getoption("--nightly-workers")
    if engine != "dask" and (scheduler is not None or workers is not None):
        raise pytest.UsageError("--nightly-scheduler and --nightly-workers: only with --nightly-engine dask")
    if scheduler is not None and workers is not None:
        raise pytest.UsageError("--nightly-scheduler or --nightly-workers, not both")
    if workers is not None and workers < 1:
        raise pytest.UsageError(f"--nightly-workers: at least 1, not {workers}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The search runs for its whole budget, so it runs only when asked for by marker.
    if "nightly" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the budgeted worst-case search: run it with -m nightly (nox -s nightly)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def without_interpreter() -> Iterator[None]:
    """Triton's CPU interpreter switched off (``TRITON_INTERPRET=0``, for this process and those
    it starts), for the tests of the harness around the rows (reports, plugins, fuzzed goldens)
    that use ``k3verify run`` or ``golden verify`` as a vehicle: on a CPU every kernel row is then
    an unavailable row with its reason, as on a machine without Triton. The interpreter's rows
    took 20.9 of an MLA run's 21.1 s and judge nothing these tests look at; the kernel tests, the
    CI run and ``golden verify`` judge them. Measured CPU time of test_report, test_plugins,
    test_fuzz and test_report_browser (one process each): 48.9, 60.0, 34.7, 17.8 s with the
    interpreter, 43.5, 49.2, 30.0, 14.9 s without. On a CUDA device the kernels run as usual."""
    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            _import_kernel_modules()
            patch.setenv("TRITON_INTERPRET", "0")
        yield


def _import_kernel_modules() -> None:
    """Import every k3verify module that defines Triton kernels. Triton decides when a kernel
    is decorated whether it runs in the interpreter: a kernel module first imported while
    :func:`without_interpreter` holds would stay compiled, for a device this machine lacks,
    for the rest of the process (the next file's kernel tests then failed with "0 active drivers")."""
    package = ROOT / "k3verify"
    for source in sorted(package.rglob("*.py")):
        if "@triton.jit" in source.read_text(encoding="utf-8"):
            importlib.import_module(".".join(source.relative_to(ROOT).with_suffix("").parts))


@pytest.fixture(scope="session")
def nightly_budget_s(request: pytest.FixtureRequest) -> float:
    """Seconds for the whole worst-case search."""
    value = request.config.getoption("--nightly-budget")
    return float(value if value is not None else os.environ.get("K3V_NIGHTLY_BUDGET_S", NIGHTLY_BUDGET_S))


@pytest.fixture(scope="session")
def nightly_out(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.getoption("--nightly-out") or os.environ.get("K3V_NIGHTLY_OUT", NIGHTLY_OUT))


@pytest.fixture(scope="session")
def nightly_seed() -> int:
    """One Hypothesis seed for the whole search, recorded so that a run can be repeated."""
    return int(os.environ.get("K3V_NIGHTLY_SEED", random.SystemRandom().randrange(2**32)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    worst_case = sys.modules.get("worst_case")
    results = getattr(worst_case, "RESULTS", None)
    if not results:
        return
    terminalreporter.section("worst-case search: largest err/limit per module")
    for module, r in results.items():
        w = r.get("worst")
        if w is None:
            terminalreporter.line(f"{module}: no judged example in {r['examples']} examples")
            continue
        terminalreporter.line(
            f"{module}: {w['ratio']:.4f} = {w['metric']} {w['err']:.3e} / limit {w['limit']:.3e}  "
            f"{w['implementation']}  ({r['examples']} examples, {r['wall_s']:.0f} s, hypothesis seed "
            f"{r['hypothesis_seed']})"
        )
        terminalreporter.line(f"    replay: {w['replay']}")


# --- NaN-poisoned memory ---------------------------------------------------------------------

_EMPTY = {"empty": torch.empty, "empty_like": torch.empty_like, "empty_strided": torch.empty_strided}
_NEW_EMPTY = torch.Tensor.new_empty


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh allocation with NaN (integers with their largest value): whatever reads a
    slot nobody wrote then shows it, instead of the zeros or old data memory happens to hold."""
    if t.device.type == "meta" or not t.numel():
        return t
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(torch.iinfo(t.dtype).max)
    return t


def _from_k3verify(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("k3verify")


@pytest.fixture(autouse=True)
def nan_poisoned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.empty*`` / ``Tensor.new_empty`` that k3verify's own code calls (kernels'
    outputs and scratch buffers, forms' work tensors), on the CPU or a CUDA device, comes back
    filled with NaN, so a kernel or form that reads memory it never wrote fails its test."""

    def wrap(original):
        def poisoned(*args, **kwargs):
            t = original(*args, **kwargs)
            return _poison(t) if _from_k3verify() else t

        return poisoned

    for name, original in _EMPTY.items():
        monkeypatch.setattr(torch, name, wrap(original))

    def new_empty(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        t = _NEW_EMPTY(self, *args, **kwargs)
        return _poison(t) if _from_k3verify() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)

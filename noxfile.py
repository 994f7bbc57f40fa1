"""Every workflow as a nox session. CI runs ``nox -s tests``.

Installs go through ``constraints.txt`` so that torch resolves to the pinned CPU build and
every run uses the same versions. ``session.posargs`` go to the underlying tool.
"""

from __future__ import annotations

import sys

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str) -> None:
    session.install(*CONSTRAINTS, "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Property tests with the derandomised ``ci`` Hypothesis profile, fla-core installed."""
    _install(session, "test,fla")
    session.run("pytest", "-m", "not slow", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def thorough(session: nox.Session) -> None:
    """Every test, slow ones included, with more Hypothesis examples."""
    _install(session, "test,fla")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "thorough"})


@nox.session
def nightly(session: nox.Session) -> None:
    """Long exploration; targets climb toward the largest error."""
    _install(session, "test,fla")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "nightly"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (pytest-benchmark); prints each speed ratio against its named peer."""
    _install(session, "test,fla")
    session.run(
        "pytest", "benchmarks", "--benchmark-enable", "--benchmark-only", "-p", "no:cacheprovider", *session.posargs
    )


@nox.session
def report(session: nox.Session) -> None:
    """The main job: ``k3verify run`` on the built-in default (report under reports/latest/)."""
    _install(session, "fla")
    session.run("k3verify", "run", *session.posargs)


@nox.session(name="overflow-map")
def overflow_map(session: nox.Session) -> None:
    """Full overflow maps of every module that has one (JSON + PNG under reports/maps/)."""
    _install(session, "fla")
    modules = session.posargs or ["kda", "mla"]
    for module in modules:
        session.run("k3verify", "overflow-map", "--module", module)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA machine, in the Python already there (GPU machines have no network, so nothing
    is installed; fla-core comes as a wheel on PYTHONPATH): the GPU property tests, the KDA
    overflow map with the kernel cells (ours and fla-core's) and ``k3verify run --modules kda``.
    Output under ``reports/latest/gpu`` or the folder given as posarg."""
    out = session.posargs[0] if session.posargs else "reports/latest/gpu"
    python = sys.executable
    tests = ("properties/test_kda_kernels.py", "properties/test_kda_gpu.py")
    session.run(python, "-m", "pytest", *tests, "-q", "-rs", env={"HYPOTHESIS_PROFILE": "gpu"})
    session.run(python, "-m", "k3verify", "overflow-map", "--module", "kda", "--quick", "--out", f"{out}/maps")
    session.run(python, "-m", "k3verify", "run", "--modules", "kda", "--out", out)


@nox.session(name="gpu-bench", venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """On a CUDA machine: the KDA kernels against fla-core (do_bench), speed ratios and accuracy."""
    out = session.posargs[0] if session.posargs else "reports/latest/gpu"
    session.run(sys.executable, "benchmarks/kda_gpu.py", "--out", out)

"""Every workflow as a nox session. CI runs ``nox -s tests``: the property tests, the golden
tensors, and a fresh ``k3verify run`` compared against the committed CPU baseline.

Installs go through ``constraints.txt`` so that torch resolves to the pinned CPU build and
every run uses the same versions. ``session.posargs`` go to the underlying tool.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import IO

import nox
import nox.command

nox.options.sessions = ["tests"]
# uv where it is installed (.ci/run installs it), else venv and pip: the tests session's install
# took 59 s with pip and 6 s with uv on CI's two cores (:func:`_install` says what uv is told).
nox.options.default_venv_backend = "uv|venv"

CONSTRAINTS = ("-c", "constraints.txt")
BASELINE = "reports/baseline/cpu"
TP_BASELINE = "reports/baseline/cpu-tp8"
# Every module's GPU session, from one table: its kernel tests, and the committed report its run is
# compared with, every module's run of one ``nox -s gpu`` on a freshly started H100
# (reports/baseline/gpu-h100/README.md). ``nox -s gpu`` runs them all, ``nox -s gpu-<module>`` one.
GPU_MODULES: dict[str, tuple[tuple[str, ...], str]] = {
    "kda": (("properties/test_kda_kernels.py", "properties/test_kda_gpu.py"), "reports/baseline/gpu-h100/run/kda"),
    "mla": (("properties/test_mla_kernels.py", "properties/test_mla_adapters.py"), "reports/baseline/gpu-h100/run/mla"),
    "attnres": (("properties/test_attnres_kernels.py",), "reports/baseline/gpu-h100/run/attnres"),
    "moe": (("properties/test_moe_kernels.py", "properties/test_moe_adapters.py"), "reports/baseline/gpu-h100/run/moe"),
    "mla_backward": (("properties/test_mla_backward.py",), "reports/baseline/gpu-h100/run/mla_backward"),
    "kda_backward": (("properties/test_kda_backward.py", "properties/test_kda_tiled_backward.py"),
                     "reports/baseline/gpu-h100/run/kda_backward"),
    "moe_backward": (("properties/test_moe_backward.py",), "reports/baseline/gpu-h100/run/moe_backward"),
    "attnres_backward": (("properties/test_attnres_backward.py",), "reports/baseline/gpu-h100/run/attnres_backward"),
}  # fmt: skip
# Modules of that table whose session skips the map step: no map, or one without kernel cells
# (kda_backward's, moe_backward's and attnres_backward's are our tiled forms' only, which the CPU
# draws alike).
WITHOUT_MAP = ("mla_backward", "kda_backward", "moe_backward", "attnres_backward")
LATEST = "reports/latest"
# The sharded run's report: a folder of its own, written while the run still writes LATEST.
LATEST_TP = "reports/latest-tp8"


def _install(session: nox.Session, extras: str) -> None:
    """The project (editable) with ``extras``, through the constraints, its sources compiled."""
    _install_packages(session, extras)
    # The editable project's own sources, compiled once for every process the session starts
    # (with PYTHONDONTWRITEBYTECODE set, each would compile them again).
    session.run_install("python", "-m", "compileall", "-q", "k3verify", "properties", silent=True)


def _install_packages(session: nox.Session, extras: str) -> None:
    args = (*CONSTRAINTS, "-e", f".[{extras}]")
    if session.venv_backend != "uv":
        session.install(*args)
        return
    # uv does not read pip's configuration, where a machine keeps its local wheels and indexes
    # (the CPU build of torch among them): it is told them, and picks as pip does, the best
    # version over every source. pip comes too: test_plugins builds the example plugin with the
    # environment's own pip. A plan that would install a CUDA build of torch (no "+cpu" version,
    # or nvidia-* packages) is installed by pip instead, as without uv.
    # --compile-bytecode: uv leaves sources uncompiled (pip compiles them), and where
    # PYTHONDONTWRITEBYTECODE is set (CI's machines) no process caches what it compiles, so every
    # process the tests start compiled torch again: `import k3verify.cli` took 5.4 s instead of 2.5.
    args = (*_pip_sources(), "--index-strategy", "unsafe-best-match", "--compile-bytecode", *args, "pip")
    plan = session.run_install("uv", "pip", "install", "--dry-run", *args, silent=True, stderr=subprocess.STDOUT)
    cuda = [line.strip() for line in str(plan).splitlines()
            if re.match(r"\s*\+ (torch==(?!.*\+cpu)|nvidia-)", line)]
    if not cuda:
        session.install(*args)
        return
    session.log(f"uv would install {', '.join(cuda)}: pip installs instead")
    session.run_install("python", "-m", "ensurepip", silent=True)
    session.run_install("python", "-m", "pip", "install", *CONSTRAINTS, "-e", f".[{extras}]", silent=True)


def _pip_sources() -> list[str]:
    """pip's indexes, local wheel folders and constraint files (``pip config list``: its
    configuration files and PIP_* variables) as uv's options."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          check=False)
    options = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
               "constraint": "--constraint"}
    sources: list[str] = []
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        option = options.get(key.rpartition(".")[2])
        for item in shlex.split(value)[0].split() if option and value else ():
            if item not in sources:
                sources += [option, item]
    return sources


@nox.session
def tests(session: nox.Session) -> None:
    """Property tests with the derandomised ``ci`` Hypothesis profile, fla-core and dask (the
    overflow map's Dask engine) installed; then
    ``k3verify golden verify``, a fresh run compared against the committed baseline, and the
    modules sharded over 8 gloo ranks (``k3verify run --tp 8``) compared against theirs. The rows
    of the run's modules are computed once, by that run: ``properties/test_module_rows.py`` judges
    them on its report afterwards (and the opt-in modules' rows in the first pass)."""
    _install(session, "test,fla,dask")
    if _install_only(session):  # the background commands below are not session.run's, which skips itself
        return
    # One worker per core (pytest-xdist; the conftest gives each its share of torch's threads);
    # the 20 slowest tests in every log, where the suite's time on CI's two cores is watched.
    session.run("pytest", "-m", "not slow and not nightly and not dask_cluster", "-n", "auto", "--dist", "loadfile",
                "--durations=20", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci", "K3V_MODULE_ROWS": "opt-in"})
    # ``golden verify`` and the runs each keep about one core busy (small tensors, Python-bound,
    # one intra-op thread each). The run, the longest (measured 55-62 s of rows, the verify 37 s,
    # the sharded run 4 s), starts first, beside the Dask engine's tests, which leave the two
    # cores about 40 % idle (58 CPU-s in 46 s; the run beside them ends about 20 s after them);
    # the verify follows the Dask tests, and the sharded run takes the run's core when it ends.
    # Each one's output is printed when it ends; the run's rows are judged after it (its compare,
    # then test_module_rows.py on its report). A run whose verdicts fail exits 1: the compare
    # names what got worse and decides; one that could not complete exits 3, which stops the
    # session.
    one_thread = {"OMP_NUM_THREADS": "1"}
    _fresh(LATEST)
    golden = run = None
    try:
        # --no-figures: the session reads the report's verdicts, not its pictures (drawing them was
        # 25 of the run's 90 s here); `k3verify report render reports/latest` draws them.
        run = _beside(session, one_thread, "k3verify", "run", "--out", LATEST, "--no-figures")
        # The Dask engine's tests start worker processes of their own and plant crashes and hangs
        # in them: beside two busy xdist workers, a worker that died took a finished cell's result
        # with it and was not replaced in time (seen in CI), so they run after the pass, with one
        # intra-op thread as under xdist (their local rows must equal the workers' bit for bit).
        if not session.posargs:
            session.run("pytest", "-m", "dask_cluster and not slow and not nightly", "-p", "no:cacheprovider", "-q",
                        "properties/test_dask_engine.py", env={"HYPOTHESIS_PROFILE": "ci", "OMP_NUM_THREADS": "1"})
        golden = _beside(session, one_thread, "k3verify", "golden", "verify")
        _joined(session, *run, ok=(0, 1))
        run = None
        _run_and_compare(session, TP_BASELINE, LATEST_TP, "--tp", "8", "--tp-backend", "gloo", "--quiet",
                         env=one_thread)
        _joined(session, *golden)
        golden = None
        session.run("k3verify", "report", "compare", BASELINE, LATEST)
        session.run("pytest", "properties/test_module_rows.py", "-p", "no:cacheprovider", "-q", "-rs",
                    env={"K3V_MODULE_ROWS": f"{LATEST}/report.json"})
    finally:
        for proc in (golden, run):
            if proc is not None:
                _joined(session, *proc, ok=None)


def _install_only(session: nox.Session) -> bool:
    """Whether nox runs with ``--install-only``: ``session.run`` then runs nothing and returns None."""
    return session.run("python", "-c", "", silent=True) is None


def _beside(session: nox.Session, env: dict[str, str], command: str, *args: str
            ) -> tuple[subprocess.Popen, IO[bytes], str]:
    """Start ``command`` (an executable of the session's environment) in the background with
    ``env`` added, its output kept in a temporary file; :func:`_joined` waits for it."""
    label = " ".join((command, *args))
    session.log(f"{label} (in the background; its output follows when it ends)")
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([os.path.join(session.bin, command), *args], stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ | env)
    return proc, log, label


def _joined(session: nox.Session, proc: subprocess.Popen, log: IO[bytes], label: str,
            ok: tuple[int, ...] | None = (0,)) -> None:
    """Wait for a :func:`_beside` command, print its output and fail the session if its exit
    status is not in ``ok`` (``None``: a session already failing, which only ends it: the
    command is stopped, its output printed)."""
    if ok is None and proc.poll() is None:
        proc.terminate()
    code = proc.wait()
    log.seek(0)
    session.log(f"{label} ended (exit {code}):")
    sys.stdout.write(log.read().decode(errors="replace"))
    sys.stdout.flush()
    log.close()
    if ok is not None and code not in ok:
        session.error(f"{label} failed (exit {code})")


def _run_and_compare(session: nox.Session, baseline: str = BASELINE, out: str = LATEST, *args: str,
                     env: dict[str, str] | None = None) -> None:
    # A failed verdict also shows as a flipped row in the compare, which prints what got worse
    # and decides the exit status, so the run itself may exit 1 here; a run that could not
    # complete exits 3, which stops the session. The folder goes first: the compare can only
    # read the report this run wrote, never one a reused checkout kept from an earlier run.
    _fresh(out)
    session.run("k3verify", "run", "--out", out, *args, success_codes=[0, 1], env=env)
    session.run("k3verify", "report", "compare", baseline, out)


def _fresh(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


@nox.session
def thorough(session: nox.Session) -> None:
    """Every test, slow ones included, with more Hypothesis examples."""
    _install(session, "test,fla")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "thorough"})


@nox.session
def nightly(session: nox.Session) -> None:
    """Worst-case search: profile ``nightly``, ``hypothesis.target`` climbs toward each module's
    largest err/limit within the time budget (``-- --nightly-budget SECONDS``, default 1800 for
    all modules); the maxima and replay commands go to reports/latest/nightly.json and into a
    fresh report there. ``-- --nightly-engine dask --nightly-workers N`` (or
    ``--nightly-scheduler ADDRESS``) searches the modules side by side on a Dask cluster."""
    _install(session, "test,fla,dask")
    _fresh(LATEST)
    session.run("k3verify", "run", "--out", LATEST, success_codes=[0, 1])
    try:
        session.run(
            "pytest", "properties/test_nightly.py", "-m", "nightly", "-p", "no:cacheprovider", *session.posargs,
            env={"HYPOTHESIS_PROFILE": "nightly", "K3V_NIGHTLY_OUT": f"{LATEST}/nightly.json"},
        )
    finally:
        session.run("k3verify", "report", "render", LATEST)


@nox.session
def golden(session: nox.Session) -> None:
    """``k3verify golden verify`` (hashes, then every implementation against the goldens);
    ``nox -s golden -- generate`` regenerates them, then verifies."""
    _install(session, "fla")
    args = session.posargs or ["verify"]
    session.run("k3verify", "golden", *args)
    if args[0] == "generate":
        session.run("k3verify", "golden", "verify")


@nox.session
def compare(session: nox.Session) -> None:
    """A fresh ``k3verify run`` compared against the committed CPU baseline (exit 1 on a regression)."""
    _install(session, "fla")
    _run_and_compare(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (pytest-benchmark); prints each speed ratio against its named peer, saves the
    run under .benchmarks/ and compares it with the newest saved run there, if any
    (pytest-benchmark keeps one folder per OS and Python version). The comparison is information,
    never a failure: times taken under another load or on another host are not a verdict."""
    _install(session, "test,fla")
    compare = ["--benchmark-compare"] if _saved_benchmarks() else []
    session.run(
        "pytest", "benchmarks", "--benchmark-enable", "--benchmark-only", "--benchmark-autosave",
        "--benchmark-columns=min,median,iqr,max,rounds", *compare, "-p", "no:cacheprovider", *session.posargs,
    )  # fmt: skip


def _saved_benchmarks() -> bool:
    from pathlib import Path

    return any(Path(".benchmarks").glob("*/*.json"))


@nox.session
def report(session: nox.Session) -> None:
    """The main job: ``k3verify run`` on the built-in default (report.json/.md/.html under
    reports/latest/). ``nox -s report -- --out reports/baseline/cpu`` regenerates the baseline."""
    _install(session, "fla")
    session.run("k3verify", "run", *session.posargs)


@nox.session(name="overflow-map")
def overflow_map(session: nox.Session) -> None:
    """Full overflow maps (JSON, PNGs and studies under reports/maps/) of every module that has one,
    or of the modules given: ``nox -s overflow-map -- kda,mla``."""
    _install(session, "fla")
    session.run("k3verify", "overflow-map", "--module", ",".join(session.posargs) or "all")


# The Triton that the GPU machines' torch (2.11) brings. A kernel that compiled with the pinned
# Triton only (3.9) failed there: every MLA decode launch, at 11bf1dc.
DEVICE_TRITON = "3.6.0"


@nox.session(name="kernel-compile")
def kernel_compile(session: nox.Session) -> None:
    """Every module's GPU launches compiled for sm_90 without a GPU, with the GPU machines' Triton
    (``DEVICE_TRITON``; ``K3VERIFY_DEVICE_TRITON`` names another): registers, spills and shared
    memory of each (benchmarks/kernel_compile.py; posargs go to it, e.g. ``--arch 100``). Fails
    when a launch does not compile: run it before taking kernels to a GPU machine."""
    _install(session, "test")
    version = os.environ.get("K3VERIFY_DEVICE_TRITON", DEVICE_TRITON)
    sources = _pip_sources() if session.venv_backend == "uv" else []
    session.install(*sources, f"triton=={version}")
    for module in ("attnres", "kda", "mla", "moe"):
        session.run("python", "benchmarks/kernel_compile.py", "--module", module, *session.posargs)


def _gpu_out(session: nox.Session) -> str:
    return session.posargs[0] if session.posargs else "reports/latest/gpu"


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA machine, in the Python already there (GPU machines have no network, so nothing
    is installed; fla-core and flash-attn-res come as wheels on PYTHONPATH): every module's GPU
    session of :data:`GPU_MODULES` in turn (:func:`_gpu_module`). Output under
    ``reports/latest/gpu/<module>`` or ``<posarg>/<module>``. A module whose step fails ends
    its own steps, not the others' (device time is scarce: one run shows every module's state);
    the session then fails naming each module that failed."""
    failed = []
    for module in GPU_MODULES:
        try:
            _gpu_module(session, module, f"{_gpu_out(session)}/{module}")
        except nox.command.CommandFailed:
            failed.append(module)
            session.log(f"the {module} session failed (its log is above); the next module runs")
    if failed:
        session.error(f"failed: {', '.join(failed)} of {len(GPU_MODULES)} GPU sessions "
                      f"(`nox -s gpu-<module>` runs one again)")


def _gpu_session(module: str) -> None:
    """Register ``gpu-<module>``: that module's part of ``nox -s gpu`` alone."""

    @nox.session(name=f"gpu-{module}", venv_backend="none")
    def one(session: nox.Session) -> None:
        _gpu_module(session, module, f"{_gpu_out(session)}/{module}")

    one.__doc__ = f"On a CUDA machine: the {module} part of ``nox -s gpu`` alone."


for _module in GPU_MODULES:
    _gpu_session(_module)


def _gpu_module(session: nox.Session, module: str, out: str) -> None:
    """A module's GPU tests (profile ``gpu``, or ``gpu-explore`` for a nightly search; a line per
    test as it ends, since on a fresh device the run is long), its quick overflow map with the
    kernel cells, ``k3verify run --modules <module>`` drawing that map, and the compare of that
    run against the module's committed GPU report, which decides: a row that fails there
    (flash-attn-res cannot compile K3's width d = 7168) is a result the baseline holds, so the
    run's own exit status of 1 is not the session's verdict."""
    tests, baseline = GPU_MODULES[module]
    python = sys.executable
    maps = f"{out}/maps"
    # Autotuned peers (fla-core) keep their choices on disk (Triton's cache): the map and the
    # run, each a new process, reuse what the tests tuned instead of tuning the same shapes again.
    env = {"TRITON_CACHE_AUTOTUNING": "1"}
    profile = os.environ.get("HYPOTHESIS_PROFILE", "gpu")
    session.run(python, "-m", "pytest", *tests, "-v", "-rs", "--durations=15", *_gpu_workers(session),
                env=env | {"HYPOTHESIS_PROFILE": profile})  # fmt: skip
    if module in WITHOUT_MAP:
        os.makedirs(maps, exist_ok=True)  # the run's page shows no map
    else:
        session.run(python, "-m", "k3verify", "overflow-map", "--module", module, "--quick", "--out", maps, env=env)
    session.run(python, "-m", "k3verify", "run", "--modules", module, "--out", out, "--maps", maps, env=env,
                success_codes=[0, 1])  # fmt: skip
    session.run(python, "-m", "k3verify", "report", "compare", baseline, out)


def _gpu_workers(session: nox.Session) -> tuple[str, ...]:
    """pytest-xdist's worker count for the GPU tests when it is importable (a wheel on
    PYTHONPATH, as fla-core): on a fresh device Triton builds every kernel specialisation the
    first time it is launched, on one CPU core, and workers spread those builds over the
    host's cores. The derandomised ``gpu`` profile draws the same examples in any worker."""
    if importlib.util.find_spec("xdist") is None:
        session.log("pytest-xdist is not importable: the GPU tests run in one process")
        return ()
    workers = os.environ.get("K3VERIFY_GPU_WORKERS", str(min(8, max(1, (os.cpu_count() or 2) // 2))))
    # loadgroup: tests marked xdist_group share a worker (fla-core's autotuning, once).
    return ("-n", workers, "--dist", "loadgroup")


@nox.session(name="gpu-tp", venv_backend="none")
def gpu_tp(session: nox.Session) -> None:
    """On a machine with two CUDA devices: every module sharded over 2 NCCL ranks, at small and
    at K3 widths (``k3verify run --tp 2``). Output under ``reports/latest/gpu-tp`` or the posarg."""
    out = session.posargs[0] if session.posargs else "reports/latest/gpu-tp"
    for size in ("small", "k3"):
        session.run(sys.executable, "-m", "k3verify", "run", "--tp", "2", "--tp-backend", "nccl", "--tp-size", size,
                    "--out", f"{out}/{size}")  # fmt: skip


# What a GPU machine without network lacks for the GPU sessions (its image has torch, triton,
# pytest, hypothesis and pytest-xdist): the peers under test, and nox with what nox needs.
GPU_WHEELS = ("fla-core", "flash-attn-res", "nox", "argcomplete", "colorlog", "dependency-groups", "virtualenv",
              "distlib", "platformdirs", "python-discovery", "packaging", "filelock")  # fmt: skip


@nox.session(name="gpu-wheels", venv_backend="none")
def gpu_wheels(session: nox.Session) -> None:
    """On a machine with network: download (not install) the wheels a GPU machine without network
    needs for the GPU sessions, for CPython ``K3VERIFY_GPU_PYTHON`` (default 3.12) on x86-64 Linux,
    into the folder given (default ``.gpu-wheels``), pinned as ``constraints.txt`` pins them. There:
    ``pip install --no-index --no-deps --target /tmp/site DIR/*.whl`` and
    ``PYTHONPATH=/tmp/site:$PWD`` (docs/gpu.md)."""
    out = session.posargs[0] if session.posargs else ".gpu-wheels"
    python = os.environ.get("K3VERIFY_GPU_PYTHON", "3.12")
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    session.run(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation=cp",
                f"--python-version={python}", *platforms, "--dest", out, *CONSTRAINTS, *GPU_WHEELS)  # fmt: skip


@nox.session(name="gpu-bench", venv_backend="none")
def gpu_bench(session: nox.Session) -> None:
    """On a CUDA machine: the KDA kernels against fla-core, the AttnRes kernels against
    flash-attn-res and torch.compile, the MLA kernels against flex_attention and torch SDPA, and
    the MoE expert kernels against torch._grouped_mm (do_bench), speed ratios, bandwidth and
    accuracy. ``nox -s gpu-bench -- OUT --quick`` runs each benchmark's ``--quick`` form (fewer
    shapes, no launch sweeps), for CI-style use."""
    folders = [a for a in session.posargs if not a.startswith("-")]
    flags = [a for a in session.posargs if a.startswith("-")]
    if len(folders) > 1 or any(f != "--quick" for f in flags):
        session.error(f"gpu-bench takes an output folder and --quick, got {' '.join(session.posargs)}")
    out = folders[0] if folders else "reports/latest/gpu"
    for bench in ("kda_gpu", "attnres_gpu", "mla_gpu", "moe_gpu"):
        session.run(sys.executable, f"benchmarks/{bench}.py", "--out", out, *flags)

"""The environment a report or map was produced in: versions, device, git commit, and the
math platform: what decides the bits of a CPU computation with the pinned wheels."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_PACKAGES = ("k3verify", "torch", "triton", "numpy", "fla-core", "hypothesis")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


STAMP = ".k3verify-commit"
COMMIT_VARIABLE = "K3VERIFY_GIT_COMMIT"


def _git() -> dict[str, Any]:
    """The commit the code came from, and whether it was edited: ``$K3VERIFY_GIT_COMMIT`` when
    set (a tree copied to another machine may carry a ``.git`` of another commit), else the
    checkout holding this package, else a ``.k3verify-commit`` file at the root (``git rev-parse
    HEAD > .k3verify-commit``). Either names the commit, optionally followed by `` dirty``;
    ``git_commit_source`` says which one answered."""
    root = Path(__file__).resolve().parents[2]
    declared = _declared_commit(os.environ.get(COMMIT_VARIABLE, ""))
    if declared:
        return {**declared, "git_commit_source": "environment"}
    found = _git_checkout(root)
    if found["git_commit"]:
        return {**found, "git_commit_source": "git"}
    stamped = _declared_commit((root / STAMP).read_text(encoding="ascii", errors="replace")) if (
        root / STAMP).is_file() else None  # fmt: skip
    if stamped:
        return {**stamped, "git_commit_source": "stamp"}
    return {**found, "git_commit_source": None}


def code_commit() -> str | None:
    """The commit the code came from as :func:`_git` finds it, ``"<hex>"`` or ``"<hex> dirty"``;
    ``None`` when nothing names it."""
    found = _git()
    if not found["git_commit"]:
        return None
    return f"{found['git_commit']} dirty" if found["git_dirty"] else found["git_commit"]


def code_version() -> str:
    """What keys results that only this code may reuse (a resumed sweep's cells): the commit
    (:func:`code_commit`, ``"unknown"`` when nothing names it) and a digest of every Python file
    of the k3verify package, so a tree with uncommitted edits or without git never reuses what
    other code computed. Installed plugins are not covered: their own versions are the user's."""
    return f"{code_commit() or 'unknown'} src {source_digest(Path(__file__).resolve().parents[1])}"


def source_digest(package: Path) -> str:
    """16 hex digits of SHA-256 over every ``*.py`` file under ``package``, each with its path."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _declared_commit(text: str) -> dict[str, Any] | None:
    """``"<hex commit> [dirty]"`` as the report's fields; ``None`` for anything else."""
    words = text.split()
    if not words or len(words) > 2 or words[1:] not in ([], ["dirty"]):
        return None
    commit = words[0].lower()
    if not 7 <= len(commit) <= 64 or any(c not in "0123456789abcdef" for c in commit):
        return None
    return {"git_commit": commit, "git_dirty": words[1:] == ["dirty"]}


def _git_checkout(root: Path) -> dict[str, Any]:
    """``git rev-parse HEAD`` and ``git status`` in ``root``; ``None`` for both when they fail."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            != ""
        )
        return {"git_commit": commit, "git_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def environment() -> dict[str, Any]:
    """A flat dict of facts that make a number reproducible."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    env.update({name: _version(name) for name in _PACKAGES})
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "cpu"
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    env["math_platform"] = math_platform()
    env.update(_git())
    return env


# Environment variables that change which code path a math library takes on the same CPU.
CODE_PATH_OVERRIDES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")

def _probe() -> None:
    """One MKL and one oneDNN product with verbose output on: each library prints the code path
    it chose (its verbose header) once per process, on the first such call."""
    a = torch.ones(8, 8, dtype=torch.float64)
    b = torch.ones(64, 64, dtype=torch.bfloat16)
    with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
        a @ a
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        b @ b


def _stdout_of_probe() -> str:
    """What the probe prints on file descriptor 1, run in this process (the libraries write there,
    below Python); a fresh interpreter runs it if this process printed the headers already."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            _probe()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    if "MKL_VERBOSE oneMKL" in text or "mkl" not in torch.__config__.show().lower():
        return text
    return subprocess.run(
        [sys.executable, "-c", "from k3verify.harness.environment import _probe; _probe()"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout


def _cpu() -> str:
    """Vendor, family/model/stepping and model name of the CPU (Linux), else ``platform.processor()``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or "unknown"
    ident = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return f"{fields.get('vendor_id', '?')} {ident} {fields.get('model name', '?')}"


@functools.cache
def _library_code_paths() -> dict[str, str]:
    """The code path MKL (BLAS) and oneDNN chose on this machine, as their verbose headers say.

    On x86-64 the same torch wheel gives different bits on an Intel and an AMD CPU with the same
    ATen capability, because MKL dispatches by vendor and ISA (AVX-512 kernels on one, AVX2 or
    generic ones on the other); only the library can say which it picked.
    """
    try:
        out = _stdout_of_probe()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        return {"blas": f"unknown ({type(exc).__name__})", "onednn": "unknown"}
    blas = re.search(r"^MKL_VERBOSE oneMKL .*? for (?:Intel\(R\) 64 architecture )?(.*?), Lnx", out, re.M) or re.search(
        r"^MKL_VERBOSE (.*)$", out, re.M
    )
    isa = re.search(r"^(?:onednn|dnnl)_verbose,.*?isa:(.*)$", out, re.M)
    blas_info = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return {
        "blas": f"mkl: {blas.group(1).strip()}" if blas else (blas_info.group(1) if blas_info else "unknown"),
        "onednn": isa.group(1).strip() if isa else "not used",
    }


def math_platform(threads: int | None = None) -> dict[str, str]:
    """What decides the bits of a CPU computation with the pinned wheels.

    Two runs of the same code on the same inputs are bitwise identical when these records are
    equal: the torch build, the CPU (vendor and model), ATen's vector capability, the code paths
    MKL and oneDNN chose, any environment override of them, and the intra-op thread count
    (reductions split their axis by thread). Where the records differ, results agree only to the
    rounding of their dtype. ``threads`` defaults to torch's current setting.
    """
    record = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": _cpu(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        **_library_code_paths(),
        "threads": str(threads if threads is not None else torch.get_num_threads()),
    }
    overrides = {k: os.environ[k] for k in CODE_PATH_OVERRIDES if k in os.environ}
    if overrides:
        record["overrides"] = " ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return record


def platform_differences(a: dict[str, str] | None, b: dict[str, str] | None) -> list[str]:
    """The fields in which two :func:`math_platform` records differ (``["missing"]`` if either is absent)."""
    if not a or not b:
        return ["missing"]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

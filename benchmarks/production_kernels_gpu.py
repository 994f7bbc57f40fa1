"""The production K3 kernels on a CUDA device: which of TokenSpeed's wheels load under this torch,
and where FlashKDA's forward (and fla-core's ``chunk_kda`` with ``safe_gate``, beside it) stops
being finite as the gate's lower bound falls.

    python benchmarks/production_kernels_gpu.py --out DIR [--symbols FILE] [--kernels flash_kda,fla]
                                                [--step 0.25] [--tol 0.001]

**Loading.** Every wheel's module is imported in a child process (an extension built against
another torch can crash its loader), and its result is recorded: the version, or the error.
``--symbols`` names a JSON file ``{distribution: {"needed": [...], "torch_symbols": [...]}}``
read from wheels that were not carried here (``readelf -d``, ``nm -D --undefined-only``): each
symbol is looked up in this torch's libraries, so a wheel too large to carry still gets a
verdict on whether its extension would link against this torch.

**Frontier.** The worst case of docs/model.md §1.6 at K3's head dims (``B = 1, T = 128, H = 2,
K = V = 128``): every gate at ``g_min``, one-hot ``q``/``k`` rows. FlashKDA computes the gate
itself, so ``lower_bound = g_min`` with saturated logits gives exactly ``g = g_min``; fla-core gets
the gates pre-computed with ``safe_gate=True, lower_bound=g_min``. A coarse scan from -5 down to
-20 (``--step``) finds the first non-finite output (``o`` or the final state); bisection then
narrows the edge to ``--tol``. Beside each measured edge stand the analytic frontiers of the tiled
form's anchors (:func:`k3verify.kda.tiled.predicted_finite`) for 16-row sub-tiles. The same scan
on random gates (``random_inputs``) and each kernel's error against the fp64 oracle at -5 are
recorded too. ``--kernels`` chooses (``flash_kda``, ``fla``; both by default). Writes
``production_kernels.json`` (after each kernel, so a run cut short keeps what it measured) and
prints a summary.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3verify import kda
from k3verify.adapters import fla, flash_kda
from k3verify.kda.samples import random_inputs, saturated_inputs
from k3verify.kda.tiled import predicted_finite

DEVICE = "cuda"  # the kernels' device (a CPU stand-in kernel can be tried with "cpu")

WHEELS = {"tokenspeed-flashkda": "flash_kda", "tokenspeed-deepgemm": "deep_gemm", "tokenspeed-mla": "tokenspeed_mla",
          "tokenspeed-cutedsl-kda": "tokenspeed_cutedsl_kda", "tokenspeed-flashmla": "flash_mla",
          "tokenspeed-fa3": "flash_attn_interface", "fla-core": "fla"}  # fmt: skip
SHAPE = dict(B=1, T=128, H=2, K=128, V=128)
TORCH_LIBS = ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so", "libc10_cuda.so", "libtorch_cuda.so")


def probe_imports() -> dict[str, Any]:
    """Each wheel's module imported in a child process: ``{distribution: {version, loads, error}}``."""
    out = {}
    for dist, module in WHEELS.items():
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = {"version": None, "loads": None, "error": "not installed here"}
            continue
        code = f"import torch, {module}; print('ok')"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        lines = (r.stderr or r.stdout).strip().splitlines()
        error = None if r.returncode == 0 else (lines[-1] if lines else f"exit {r.returncode}")
        out[dist] = {"version": version, "loads": r.returncode == 0, "error": error}
    return out


def probe_symbols(path: Path) -> dict[str, Any]:
    """Every symbol of ``path``'s wheels looked up in this torch's libraries (and its needed
    libraries by name): ``{distribution: {missing_symbols, missing_libraries}}``."""
    lib_dir = Path(torch.__file__).parent / "lib"
    loaded = []
    for name in TORCH_LIBS:
        try:
            loaded.append(ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL))
        except OSError:
            pass
    out = {}
    for dist, info in json.loads(path.read_text()).items():
        missing = [s for s in info["torch_symbols"] if not any(hasattr(lib, s) for lib in loaded)]
        libs = []
        for needed in info["needed"]:
            if (lib_dir / needed).exists():
                continue
            try:
                ctypes.CDLL(needed)
            except OSError:
                libs.append(needed)
        out[dist] = {"missing_symbols": missing, "missing_libraries": libs, "checked": len(info["torch_symbols"])}
    return out


def _finite(fn: Callable[..., Any], g_min: float, kind: str) -> tuple[bool, str | None]:
    make = saturated_inputs if kind == "worst" else random_inputs
    extra = {"one_hot": True} if kind == "worst" else {"initial_state": False}
    x = make(**SHAPE, g_min=g_min, seed=0, **extra)
    args = [x[n].to(DEVICE, torch.float32 if n == "g" else torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    try:
        o, S = fn(*args, output_final_state=True, lower_bound=g_min)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return bool(torch.isfinite(o).all()) and bool(torch.isfinite(S).all()), None


def frontier(fn: Callable[..., Any], kind: str, step: float, tol: float) -> dict[str, Any]:
    """The coarse scan from -5 to -20 and the bisected edge between the last finite and the first
    non-finite bound; ``monotone`` says whether every bound past the edge was non-finite."""
    grid = [round(-5.0 - i * step, 6) for i in range(int(15 / step) + 1)]
    scan = []
    for g in grid:
        ok, error = _finite(fn, g, kind)
        scan.append({"g_min": g, "finite": ok, **({"error": error} if error else {})})
    first_bad = next((i for i, c in enumerate(scan) if not c["finite"]), None)
    result: dict[str, Any] = {"scan": scan}
    if first_bad is None:
        result["edge"] = None
        return result
    if first_bad == 0:
        result["edge"] = {"finite_at": None, "nonfinite_at": grid[0]}
        return result
    hi, lo = grid[first_bad - 1], grid[first_bad]  # hi finite, lo not
    while hi - lo > tol:
        mid = (hi + lo) / 2
        if _finite(fn, mid, kind)[0]:
            hi = mid
        else:
            lo = mid
    result["edge"] = {"finite_at": round(hi, 6), "nonfinite_at": round(lo, 6)}
    result["monotone"] = all(not c["finite"] for c in scan[first_bad:])
    return result


def predictions(tol: float = 1e-4) -> dict[str, float]:
    """The analytic frontier in g_min (bisected on :func:`predicted_finite`) of each anchor with
    16-row sub-tiles: bf16 operands (our tiled form) and fp32 factors (fla-core's safe_gate)."""
    out = {}
    for anchor in ("tile_start", "tile_middle", "row0_shift"):
        for dtype in ("bf16", "fp32"):
            hi, lo = -0.1, -60.0
            while hi - lo > tol:
                mid = (hi + lo) / 2
                if predicted_finite(mid, tile=16, operand_dtype=dtype, anchor=anchor):
                    hi = mid
                else:
                    lo = mid
            out[f"{anchor}/{dtype}"] = round(hi, 4)
    return out


def _rms_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.detach().cpu().double()
    return float((x - ref).pow(2).sum().sqrt() / ref.pow(2).sum().sqrt())


def accuracy(fn: Callable[..., Any]) -> dict[str, float]:
    """The kernel's RMS ratio against the fp64 oracle on random gates at -5 (K3's default shape,
    T = 200), and the bf16 chunkwise baseline's."""
    x = random_inputs(2, 200, 2, 128, 128, seed=0)
    ref = kda.recurrent(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
                        output_final_state=True)
    base = kda.naive_chunk_baseline(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
                                    output_final_state=True, dtype="bf16")
    args = [x[n].to(DEVICE, torch.float32 if n == "g" else torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    o, S = fn(*args, initial_state=x["initial_state"].to(DEVICE, torch.float32), output_final_state=True,
              lower_bound=-5.0)
    return {"o": _rms_ratio(o, ref[0]), "final_state": _rms_ratio(S, ref[1]),
            "baseline_o": _rms_ratio(base[0], ref[0]), "baseline_final_state": _rms_ratio(base[1], ref[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--symbols", type=Path)
    p.add_argument("--step", type=float, default=0.25)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--kernels", default="flash_kda,fla")
    args = p.parse_args(argv)
    chosen = set(args.kernels.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           "imports": probe_imports(), "predictions": predictions()}  # fmt: skip
    if args.symbols:
        doc["symbols"] = probe_symbols(args.symbols)
    kernels: dict[str, Callable[..., Any]] = {}
    if "flash_kda" in chosen:
        if flash_kda.unavailable_reason() is None:
            kernels["flash_kda"] = flash_kda.chunk
        else:
            doc["flash_kda_unavailable"] = flash_kda.unavailable_reason()
    if "fla" in chosen and fla.unavailable_reason(gpu=True) is None:
        kernels["fla chunk_kda safe_gate"] = lambda *a, **kw: fla.chunk_gpu(*a, safe_gate=True, **kw)
    doc["kernels"] = {}
    path = args.out / "production_kernels.json"
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "kernels"}, indent=1))
    for name, fn in kernels.items():
        start = time.perf_counter()
        entry = {"accuracy": accuracy(fn)}
        for kind in ("worst", "random"):
            entry[kind] = frontier(fn, kind, args.step, args.tol)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        doc["kernels"][name] = entry
        path.write_text(json.dumps(doc, indent=1))
    for name, entry in doc["kernels"].items():
        print(name, "accuracy", entry["accuracy"], "worst edge", entry["worst"]["edge"],
              "monotone", entry["worst"].get("monotone"), "random edge", entry["random"]["edge"],
              "errors", sorted({c["error"] for c in entry["worst"]["scan"] if "error" in c})[:3],
              f"{entry['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

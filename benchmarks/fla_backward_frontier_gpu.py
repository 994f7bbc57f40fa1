"""Where fla-core's ``chunk_kda`` backward stops being finite as the gate's lower bound falls, beside
the tiled backward's prediction for fla's ``safe_gate`` path.

    python benchmarks/fla_backward_frontier_gpu.py --out DIR [--step 0.25] [--tol 0.001]

The worst case of docs/model.md §1.6 at K3's head dims (``B = 1, T = 128, H = 2, K = V = 128``):
every gate at ``g_min``, one-hot ``q``/``k`` rows, with the backward's cotangents
(``kda.samples.cotangents``, ``dht`` at unit scale as the backward map draws it) either as drawn
(``unit``) or scaled by 2^40 (``loud``, the backward map's loud input). A bound is finite when every
gradient of ``sum(o * do) + sum(S_T * dht)`` through fla's kernels (``safe_gate=True``,
``lower_bound = g_min``, fla's own Triton path, autograd) is finite. A coarse scan from -3 down to
-15 (``--step``) finds the first non-finite bound, bisection narrows it to ``--tol``. The
prediction is :func:`k3verify.kda.tiled.predict_backward` on the same inputs for fla's safe_gate
path as the ``kda`` rows model it (fp32 factors, row-0 shift anchor, 16-row sub-tiles, chunk 64),
bisected on the CPU in fp64. Without CUDA only the predictions are written. Writes
``fla_backward_frontier.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from k3verify.adapters import fla
from k3verify.harness.modules.kda_backward import LOUD_SCALE
from k3verify.kda.recurrent import autograd_backward
from k3verify.kda.samples import cotangents, saturated_inputs
from k3verify.kda.tiled import backward_overflow_quantities, predict_backward

SHAPE = dict(B=1, T=128, H=2, K=128, V=128)
FLA_SAFE_GATE = dict(chunk_size=64, tile=16, operand_dtype="fp32", anchor="row0_shift")
UPSTREAM = {"unit": 1.0, "loud": LOUD_SCALE}


def problem(g_min: float, upstream: float) -> dict[str, torch.Tensor]:
    """The worst-case inputs at ``g_min`` with their cotangents times ``upstream`` (fp64)."""
    x = saturated_inputs(**SHAPE, g_min=g_min, seed=0, one_hot=True)
    drawn = cotangents(*SHAPE.values(), seed=0, dht_scale=1.0)
    return {n: x[n] for n in ("q", "k", "v", "g", "beta")} | {n: t * upstream for n, t in drawn.items()}


def kernel_finite(g_min: float, upstream: float) -> bool:
    """Every gradient of fla's ``chunk_kda`` (safe_gate, ``lower_bound = g_min``) finite."""
    x = problem(g_min, upstream)
    args = [x[n].to("cuda", torch.float32 if n == "g" else torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    forward = lambda *a, **kw: fla.chunk_gpu(*a, safe_gate=True, lower_bound=g_min, **kw)  # noqa: E731
    with fla.triton_only():
        grads = autograd_backward(forward, *args, do=x["do"].to("cuda", torch.bfloat16),
                                  dht=x["dht"].to("cuda", torch.float32))
    return all(bool(torch.isfinite(t).all()) for t in grads.values() if t is not None)


def predicted_finite(g_min: float, upstream: float) -> bool:
    """:func:`predict_backward` for fla's safe_gate path on the same inputs."""
    x = problem(g_min, upstream)
    quantities = backward_overflow_quantities(*(x[n] for n in ("q", "k", "v", "g", "beta")), do=x["do"],
                                              dht=x["dht"], chunk_size=FLA_SAFE_GATE["chunk_size"])
    return predict_backward(quantities, **FLA_SAFE_GATE).finite


def edge(finite: Callable[[float], bool], step: float, tol: float) -> dict[str, Any]:
    """The coarse scan from -3 to -15 and the bisected edge between the last finite and the first
    non-finite bound; ``monotone`` says whether every bound past the edge was non-finite."""
    grid = [round(-3.0 - i * step, 6) for i in range(int(12 / step) + 1)]
    scan = [{"g_min": g, "finite": finite(g)} for g in grid]
    first_bad = next((i for i, c in enumerate(scan) if not c["finite"]), None)
    if first_bad is None or first_bad == 0:
        return {"scan": scan, "edge": None if first_bad is None else {"finite_at": None, "nonfinite_at": grid[0]}}
    hi, lo = grid[first_bad - 1], grid[first_bad]
    while hi - lo > tol:
        mid = (hi + lo) / 2
        hi, lo = (mid, lo) if finite(mid) else (hi, mid)
    return {"scan": scan, "edge": {"finite_at": round(hi, 6), "nonfinite_at": round(lo, 6)},
            "monotone": all(not c["finite"] for c in scan[first_bad:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step", type=float, default=0.25)
    p.add_argument("--tol", type=float, default=1e-3)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"shape": SHAPE, "prediction_model": FLA_SAFE_GATE, "fla-core": fla.version(),
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for name, upstream in UPSTREAM.items():
        start = time.perf_counter()
        entry = {"upstream": upstream, "predicted": edge(partial(predicted_finite, upstream=upstream), a.step, a.tol)}
        if torch.cuda.is_available():
            entry["measured"] = edge(partial(kernel_finite, upstream=upstream), a.step, a.tol)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        result[name] = entry
        (a.out / "fla_backward_frontier.json").write_text(json.dumps(result, indent=1))
        print(name, "predicted", entry["predicted"]["edge"], "measured", entry.get("measured", {}).get("edge"),
              f"{entry['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

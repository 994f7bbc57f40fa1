"""Registry entry for KDA: cases, oracle, baseline, implementations and the overflow map."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ... import kda
from ...adapters import fla as fla_adapter
from ...kda import kernels
from ...kda.tiled import (
    DEFAULT_ROW0_SHIFT,
    explain_overflow,
    predicted_finite,
    realized_log_magnitudes,
    tiled_traced,
)
from ...numerics import compare, dtype_name, exp_fits, ln_max
from ..overflow_map import MapOptions, MapResult, MapSpec, agreement, mark_frontier
from ..registry import BASELINE_RULE, FP64_RULE, Case, Implementation, ModuleEntry, Prediction, register

G_MIN = -5.0
CHUNK = 64
TILE = 16
ANCHORS = ("tile_start", "tile_middle", "row0_shift")

# The default case: K3's head dim, chunk, sub-tile and gate bound; T not a multiple of 64 so
# the partial last chunk and partial last tile are always exercised.
DEFAULT_SHAPE = dict(B=2, T=200, H=2, K=128, V=128)
# The interpreter runs a kernel program by program in numpy: keep its cases small.
SMALL_SHAPE = dict(B=2, T=72, H=1, K=32, V=32)
DECODE_SHAPE = dict(B=8, T=1, H=2, K=128, V=128)
INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def random_inputs(
    B: int, T: int, H: int, K: int, V: int, *, g_min: float = G_MIN, seed: int = 0, initial_state: bool = True
) -> dict[str, torch.Tensor]:
    """fp64 inputs drawn as the layer produces them: l2-normalised q/k, K3's bounded gate."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    q, k = kda.l2norm(randn(B, T, H, K)), kda.l2norm(randn(B, T, H, K))
    v = randn(B, T, H, V)
    g = kda.lower_bound_gate(randn(B, T, H, K), torch.zeros(H, dtype=torch.float64), randn(H * K), g_min=g_min)
    beta = torch.sigmoid(randn(B, T, H))
    s0 = 0.1 * randn(B, H, K, V) if initial_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)


def saturated_inputs(
    B: int, T: int, H: int, K: int, V: int, *, g_min: float = G_MIN, seed: int = 0, one_hot: bool = True
) -> dict[str, torch.Tensor]:
    """SPEC §1.6's worst case: every gate exactly ``g_min``.

    With ``one_hot`` the q/k rows are unit basis vectors, so an operand's largest entry is
    exactly its decay factor and the frontier is sharp; otherwise l2-normalised random rows.
    """
    x = random_inputs(B, T, H, K, V, g_min=g_min, seed=seed, initial_state=False)
    if one_hot:
        basis = torch.nn.functional.one_hot(torch.arange(T) % K, K).to(torch.float64)
        x["q"] = basis[None, :, None, :].expand(B, T, H, K).contiguous()
        x["k"] = x["q"].clone()
    x["g"] = torch.full((B, T, H, K), g_min, dtype=torch.float64)
    return x


def make_cases(seed: int = 0) -> dict[str, Case]:
    """``default`` (random, bounded gates, initial state), ``saturated`` (gates at g_min),
    ``small`` (the chunk kernel under Triton's interpreter: a full and a partial chunk) and
    ``decode`` (one token per request on a carried state)."""
    params = dict(DEFAULT_SHAPE, g_min=G_MIN, seed=seed)
    cases = {
        "default": Case("default", random_inputs(**DEFAULT_SHAPE, seed=seed), params),
        "saturated": Case(
            "saturated",
            saturated_inputs(**DEFAULT_SHAPE, seed=seed + 1, one_hot=False),
            dict(params, gates="all at g_min"),
        ),
    }
    for name, shape in (("small", SMALL_SHAPE), ("decode", DECODE_SHAPE)):
        cases[name] = Case(name, random_inputs(**shape, seed=seed + 2), dict(shape, g_min=G_MIN, seed=seed + 2))
    return cases


# Golden cases (``k3verify golden generate``): a small configuration, and a production-shape
# slice (K3's head dims 128/128, one head, one full chunk plus a partial one), each as random
# and as saturated gates, and a decode slice (two requests, one head). The default case above
# (T = 200, two heads) would take 4.7 MB, the decode case's eight states 2 MB.
GOLDEN_SHAPES = {"small": dict(B=1, T=72, H=2, K=16, V=16), "production": dict(B=1, T=80, H=1, K=128, V=128)}
GOLDEN_DECODE_SHAPE = dict(B=2, T=1, H=1, K=128, V=128)


def golden_cases(seed: int = 0) -> dict[str, Case]:
    """``default.<slice>`` and ``saturated.<slice>`` for every slice of :data:`GOLDEN_SHAPES`, and
    ``decode.production``; other case kinds are stored as ``make_cases`` makes them."""
    shape = GOLDEN_DECODE_SHAPE
    cases = {
        "decode.production": Case(
            "decode.production",
            random_inputs(**shape, seed=seed + 2),
            dict(shape, g_min=G_MIN, seed=seed + 2, slice="production"),
        )
    }
    for variant, shape in GOLDEN_SHAPES.items():
        params = dict(shape, g_min=G_MIN, seed=seed, slice=variant)
        cases[f"default.{variant}"] = Case(f"default.{variant}", random_inputs(**shape, seed=seed), params)
        cases[f"saturated.{variant}"] = Case(
            f"saturated.{variant}",
            saturated_inputs(**shape, seed=seed + 1, one_hot=False),
            dict(params, gates="all at g_min"),
        )
    return cases


def _call(form: Callable, case: Case, dtype: torch.dtype, **kw: Any) -> torch.Tensor:
    """Run ``form`` on the case's inputs cast to ``dtype``; return its output."""
    x = {n: (t.to(dtype) if t is not None else None) for n, t in case.inputs.items()}
    o, _ = form(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], **kw)
    return o


def oracle(case: Case) -> torch.Tensor:
    """The recurrent definition in fp64 (cached on the case)."""
    if "oracle" not in case.cache:
        case.cache["oracle"] = _call(kda.recurrent, case, torch.float64)
    return case.cache["oracle"]


BASELINES = {"recurrent": kda.naive_baseline, "chunkwise": partial(kda.naive_chunk_baseline, chunk_size=CHUNK)}


def baseline(case: Case, dtype: str, family: str = "recurrent") -> torch.Tensor:
    """The ``family`` form with every stored tensor in ``dtype`` (cached per dtype and family)."""
    key = f"baseline:{family}:{dtype}"
    if key not in case.cache:
        x = case.inputs
        o, _ = BASELINES[family](
            x["q"], x["k"], x["v"], x["g"], x["beta"], dtype=dtype, initial_state=x["initial_state"]
        )
        case.cache[key] = o
    return case.cache[key]


def _tiled_predict(case: Case, **tiling: Any) -> Prediction:
    x = case.inputs
    if tiling.get("diagonal") == "fp32":
        return Prediction(True, "fp32 diagonal path: no split exponentials")
    exponent, log_operand = realized_log_magnitudes(
        x["q"],
        x["k"],
        x["g"],
        chunk_size=tiling.get("chunk_size", CHUNK),
        tile=tiling["tile"],
        anchor=tiling["anchor"],
        anchor_shift=tiling.get("anchor_shift", DEFAULT_ROW0_SHIFT),
    )
    dt = dtype_name(tiling["operand_dtype"])
    finite = exp_fits(exponent, "fp32") and exp_fits(log_operand, dt)
    why = (
        f"largest diagonal exponent {exponent:.2f} vs ln(max fp32) {ln_max('fp32'):.2f}; "
        f"largest ln|operand| {log_operand:.2f} vs ln(max {dt}) {ln_max(dt):.2f}"
    )
    return Prediction(finite, why)


def _tiled_explain(case: Case, **tiling: Any) -> list[str]:
    x = case.inputs
    events = explain_overflow(
        x["q"].float(),
        x["k"].float(),
        x["v"].float(),
        x["g"].float(),
        x["beta"].float(),
        initial_state=x["initial_state"].float() if x["initial_state"] is not None else None,
        **tiling,
    )
    return [e.describe() for e in events[:3]]


def _tiled(dtype: str, cases: tuple[str, ...] = ("default",), **extra: Any) -> Implementation:
    tiling = dict(chunk_size=CHUNK, tile=TILE, operand_dtype=dtype, anchor="tile_start") | extra
    compute = torch.float64 if dtype == "fp64" else torch.float32
    shown = {k: v for k, v in tiling.items() if k != "operand_dtype"}
    return Implementation(
        module="kda",
        implementation="k3verify",
        form="tiled",
        dtype=dtype,
        params=shown,
        rule=FP64_RULE if dtype == "fp64" else BASELINE_RULE,
        run=lambda case: _call(kda.tiled, case, compute, **tiling),
        predict=None if dtype == "fp64" else partial(_tiled_predict, **tiling),
        explain=partial(_tiled_explain, **tiling),
        cases=cases,
        baseline="chunkwise",
    )


def _reference_form(form: str, dtype: str, **kw: Any) -> Implementation:
    fn = getattr(kda, form)
    torch_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return Implementation(
        module="kda",
        implementation="k3verify",
        form=form,
        dtype=dtype,
        params=kw,
        rule=FP64_RULE if dtype == "fp64" else BASELINE_RULE,
        run=lambda case: _call(fn, case, torch_dtype, **kw),
        baseline=form,
    )


def implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for KDA."""
    impls = [
        _reference_form("chunkwise", "fp64", chunk_size=CHUNK),
        _reference_form("chunkwise", "fp64", chunk_size=16),
        _reference_form("recurrent", "fp32"),
        _reference_form("recurrent", "bf16"),
        _reference_form("chunkwise", "fp32", chunk_size=CHUNK),
        _reference_form("chunkwise", "bf16", chunk_size=CHUNK),
    ]
    impls += [_tiled("fp64", anchor=a) for a in ANCHORS]
    impls += [_tiled("bf16", anchor=a, cases=("default", "saturated")) for a in ANCHORS]
    impls += [
        _tiled("bf16", tile=32, cases=("saturated",)),  # past the frontier: must overflow
        _tiled("fp32"),
        _tiled("fp16"),  # K3's bound is far past fp16's frontier: must overflow
        _tiled("fp16", diagonal="fp32"),
        _tiled("fp8_e4m3"),
        _tiled("fp8_e4m3", diagonal="fp32"),
    ]
    impls += _kernel_implementations()
    impls += _fla_implementations()
    return impls


def _kernel_implementations() -> list[Implementation]:
    """Our Triton kernels: fp32 wherever Triton runs (the interpreter is faithful there), the
    operand dtypes of production on a CUDA device only (SPEC §5)."""

    def make(form: str, fn: Callable, dtype: str, cases: tuple[str, ...], family: str, **kw: Any) -> Implementation:
        predict = partial(_tiled_predict, chunk_size=CHUNK, tile=TILE, operand_dtype=dtype, **kw) if kw else None
        return Implementation(
            module="kda",
            implementation="k3verify",
            form=form,
            dtype=dtype,
            params=kw,
            rule=BASELINE_RULE,
            run=lambda case: _call(fn, case, torch.float64, operand_dtype=dtype, **kw).cpu(),
            predict=predict,
            cases=cases,
            baseline=family,
            unavailable=partial(kernels.unavailable_reason, dtype),
        )

    chunked, decode = ("kernel:chunk", kernels.chunk), ("kernel:fused_recurrent", kernels.fused_recurrent)
    impls = [make(*chunked, "fp32", ("small",), "chunkwise", anchor="tile_start")]
    impls += [make(*chunked, "bf16", ("default", "saturated"), "chunkwise", anchor=a) for a in ANCHORS]
    impls += [make(*decode, dt, ("decode",), "recurrent") for dt in ("fp32", "bf16")]
    return impls


def _fla_implementations() -> list[Implementation]:
    """fla-core's CPU references (fp32 arithmetic) and, on a CUDA machine, its kernels in bf16."""
    name = f"fla-core {fla_adapter.version() or '(missing)'}"

    def make(
        form: str, fn: Callable, dtype: str, *, gpu: bool, family: str, cases=("default",), predict=None, **kw: Any
    ) -> Implementation:
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        return Implementation(
            module="kda",
            implementation=name,
            form=form,
            dtype=dtype,
            params=kw,
            rule=BASELINE_RULE,
            run=lambda case: _call(fn, case, torch_dtype, **kw),
            predict=predict,
            cases=cases,
            baseline=family,
            unavailable=partial(fla_adapter.unavailable_reason, gpu=gpu),
        )

    # chunk_kda(safe_gate=True) anchors its diagonal tiles at row 0 minus 2 per row with
    # 16-row sub-tiles and fp32 factors: our row0_shift frontier with fp32 operands.
    safe_gate = partial(_tiled_predict, chunk_size=CHUNK, tile=TILE, operand_dtype="fp32", anchor="row0_shift")
    # Without safe_gate the diagonal tiles take fla's fp32 per-element path: never overflows.
    per_element = lambda case: Prediction(True, "safe_gate=False: fp32 per-element diagonal tiles")  # noqa: E731
    chunk_kda = [
        make("kernel:chunk_kda", fla_adapter.chunk_gpu, "bf16", gpu=True, family="chunkwise",
             cases=("default", "saturated"), predict=predict, safe_gate=flag, lower_bound=G_MIN)
        for flag, predict in ((True, safe_gate), (False, per_element))
    ]  # fmt: skip
    decode = make("kernel:fused_recurrent_kda", fla_adapter.fused_recurrent_gpu, "bf16", gpu=True,
                  family="recurrent", cases=("default", "decode"))  # fmt: skip
    return [
        make("recurrent", fla_adapter.naive_recurrent, "fp32", gpu=False, family="recurrent"),
        make("chunkwise", fla_adapter.naive_chunk, "fp32", gpu=False, family="chunkwise"),
        *chunk_kda,
        decode,
    ]


# --- overflow map ---------------------------------------------------------------------

MAP_SHAPE = dict(B=1, T=128, H=2, K=32, V=32)
MAP_TILES = (4, 8, 16, 32, 64)
MAP_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp32")
MAP_INPUTS = ("worst", "random")


def g_min_grid(quick: bool) -> list[float]:
    """-0.5 to -20: every 0.1 (196 values), or every 0.5 for a quick map."""
    step = 0.5 if quick else 0.1
    n = round((20 - 0.5) / step)
    return [round(-0.5 - i * step, 4) for i in range(n + 1)]


def overflow_map(options: MapOptions, progress: Callable[[int, int], None] = lambda done, total: None) -> MapResult:
    """Sweep g_min x sub-tile x operand dtype x anchor x input (worst case / random)."""
    grid = list(options.x_values) if options.x_values is not None else g_min_grid(options.quick)
    tiles = (4, 16, 32, 64) if options.quick else MAP_TILES
    combos = list(itertools.product(MAP_INPUTS, MAP_DTYPES, ANCHORS, tiles))
    total, done = len(grid) * len(combos), 0
    cells: list[dict[str, Any]] = []
    for g_min in grid:
        for kind in MAP_INPUTS:
            make = saturated_inputs if kind == "worst" else random_inputs
            x = make(**MAP_SHAPE, g_min=g_min, seed=options.seed)
            x["initial_state"] = None
            ref, _ = kda.chunkwise(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=CHUNK)
            f32 = {n: t.float() for n, t in x.items() if t is not None}
            for dtype, anchor, tile in itertools.product(MAP_DTYPES, ANCHORS, tiles):
                cells.append(_map_cell(kind, g_min, dtype, anchor, tile, x, f32, ref))
                done += 1
                progress(done, total)
    cells += _kernel_cells(grid, options, progress)
    # Adjacent along g_min only: a neighbour in sub-tile size does not excuse a disagreement.
    mark_frontier(
        cells,
        {"g_min": sorted({c["g_min"] for c in cells}, reverse=True)},
        fixed=("implementation", "input", "dtype", "anchor", "tile"),
    )
    result = MapResult(
        "kda",
        cells,
        MapSpec(
            x="g_min",
            y="tile",
            panel_row="dtype",
            panel_col="anchor",
            figure="input",
            x_label="gate lower bound g_min",
            y_label="sub-tile BC",
            title="KDA tiled form: overflow and error vs the fp64 oracle (chunk 64)",
            x_descending=True,
        ),
    )
    worst = agreement(cells, only=lambda c: c["input"] == "worst")
    result.meta = {
        "shape": MAP_SHAPE,
        "chunk_size": CHUNK,
        "g_min": grid,
        "tiles": list(tiles),
        "dtypes": list(MAP_DTYPES),
        "anchors": list(ANCHORS),
        "anchor_shift": DEFAULT_ROW0_SHIFT,
        "inputs": {
            "worst": "every gate = g_min, q/k rows one-hot (largest operand entry = its decay factor)",
            "random": "g = g_min * sigmoid(z + dt_bias), l2-normalised random q/k; prediction uses the realized gates",
        },
        "prediction": "finite iff every diagonal-tile exponent < ln(max fp32) and every ln|operand| < ln(max dtype)",
        "agreement": {"worst": worst, "random": agreement(cells, only=lambda c: c["input"] == "random")},
    }
    return result


def _map_cell(
    kind: str,
    g_min: float,
    dtype: str,
    anchor: str,
    tile: int,
    x: dict[str, torch.Tensor],
    f32: dict[str, torch.Tensor],
    ref: torch.Tensor,
) -> dict[str, Any]:
    tiling = dict(chunk_size=CHUNK, tile=tile, operand_dtype=dtype, anchor=anchor)
    o, events = tiled_traced(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], **tiling)
    m = compare(o, ref, ulp_dtype=dtype)
    bound = predicted_finite(g_min, tile=tile, operand_dtype=dtype, anchor=anchor)
    exponent, log_operand = realized_log_magnitudes(x["q"], x["k"], x["g"], chunk_size=CHUNK, tile=tile, anchor=anchor)
    predicted = exp_fits(exponent, "fp32") and exp_fits(log_operand, dtype)
    cell = {
        "module": "kda",
        "implementation": "k3verify tiled",
        "input": kind,
        "dtype": dtype,
        "tile": tile,
        "g_min": g_min,
        "anchor": anchor,
        "finite": m.nonfinite == 0,
        "predicted_finite": predicted,
        "bound_finite": bound,
        "max_exponent": exponent,
        "max_log_operand": log_operand,
        "rms_ratio": m.rms_ratio,
        "max_abs": m.max_abs,
        "nonfinite": m.nonfinite,
    }
    if m.nonfinite:
        cell["overflow"] = events[0].describe() if events else "non-finite output with no operand overflow"
    return cell


def _kernel_cells(grid: list[float], options: MapOptions, progress: Callable[[int, int], None]) -> list[dict[str, Any]]:
    """GPU kernels on the worst-case input, when a CUDA device is here.

    Our chunk kernel in bf16 at every anchor is predicted by the tiled form's frontier for
    the same anchor. fla-core's ``chunk_kda(safe_gate=True)`` is predicted by our
    ``row0_shift`` frontier with fp32 factors (its diagonal tiles form ``exp`` in fp32 with
    16-row tiles and a shift of 2 per row); ``safe_gate=False`` takes fla's fp32
    per-element path and is predicted finite.
    """
    # (implementation, variant, run, (anchor, dtype the factors are cast to) or None: never overflows)
    runs: list[tuple[str, str, Callable, tuple[str, str] | None]] = []
    if not kernels.interpreted() and kernels.unavailable_reason("bf16") is None:
        for anchor in ANCHORS:
            run = partial(kernels.chunk, operand_dtype=torch.bfloat16, anchor=anchor)
            runs.append(("k3verify kernel:chunk", anchor, run, (anchor, "bf16")))
    if fla_adapter.unavailable_reason(gpu=True) is None:
        name = f"fla-core {fla_adapter.version()} chunk_kda"
        for safe_gate in (True, False):
            run = partial(fla_adapter.chunk_gpu, safe_gate=safe_gate)
            runs.append((name, f"safe_gate={safe_gate}", run, ("row0_shift", "fp32") if safe_gate else None))
    if not runs:
        return []
    device = torch.cuda.get_device_name(0)
    cells = []
    for i, g_min in enumerate(grid):
        x = saturated_inputs(**MAP_SHAPE, g_min=g_min, seed=options.seed)
        ref, _ = kda.chunkwise(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=CHUNK)
        args = [x[n].to(torch.bfloat16) for n in ("q", "k", "v")] + [x["g"].float(), x["beta"].to(torch.bfloat16)]
        for implementation, variant, run, frontier in runs:
            kw = {"lower_bound": g_min} if implementation.startswith("fla") else {}
            o, _ = run(*args, **kw)
            m = compare(o.cpu(), ref, ulp_dtype="bf16")
            predicted = True
            if frontier is not None:
                anchor, factor_dtype = frontier
                exponent, log_operand = realized_log_magnitudes(
                    x["q"], x["k"], x["g"], chunk_size=CHUNK, tile=TILE, anchor=anchor
                )
                predicted = exp_fits(exponent, "fp32") and exp_fits(log_operand, factor_dtype)
            cells.append(
                {
                    "module": "kda",
                    "input": f"worst, {implementation} on {device}",
                    "implementation": implementation,
                    "dtype": "bf16",
                    "tile": TILE,
                    "g_min": g_min,
                    "anchor": variant,
                    "finite": m.nonfinite == 0,
                    "predicted_finite": predicted,
                    "rms_ratio": m.rms_ratio,
                    "max_abs": m.max_abs,
                    "nonfinite": m.nonfinite,
                }
            )
        progress(i + 1, len(grid))
    return cells


register(
    ModuleEntry(
        name="kda",
        title="Kimi Delta Attention",
        make_cases=make_cases,
        oracle=oracle,
        baseline=baseline,
        implementations=implementations,
        overflow_map=overflow_map,
        golden_cases=golden_cases,
        position_axis=1,  # o: [B, T, H, V]
    )
)

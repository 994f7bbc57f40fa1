"""Registry entry for KDA: named outputs ``o`` and ``final_state``, the implementations (ours,
fla-core's) and the overflow map, declared; inputs come from :mod:`k3verify.kda.samples`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import kda
from ...adapters import fla as fla_adapter
from ...adapters import flash_kda, tokenspeed
from ...kda import kernels, samples
from ...kda.inputs import cast_inputs
from ...kda.samples import CHUNK, G_MIN, TILE
from ...kda.tiled import ANCHORS, DEFAULT_ROW0_SHIFT, explain_underflow, tiled_traced
from ...numerics import resolve_dtype, rule_for
from ..guard import checked_call
from ..overflow_map import MapDefinition, MapOptions, MapSpec, SweptForm, agreement
from ..registry import (
    BASELINE_RULE,
    Case,
    ErrorSamples,
    Implementation,
    ModuleEntry,
    Outputs,
    Peer,
    Prediction,
    ShardedForm,
    cases_from,
    listed,
    register,
    unavailable_as,
)
from ..tp_rows import replicated

OUTPUTS = ("o", "final_state")


def call(fn: Callable, case: Case, dtype: torch.dtype, **options: Any) -> Outputs:
    """``fn`` with KDA's form signature on the case's inputs in ``dtype``, the gates in fp32 as a
    kernel takes them (:func:`~k3verify.kda.inputs.cast_inputs`): ``{o, final_state}``."""
    x = cast_inputs(case.inputs, dtype)
    names = ("q", "k", "v", "g", "beta")
    result = checked_call(fn, [x[n] for n in names], names,
                          dict(initial_state=x["initial_state"], output_final_state=True, **options))
    if not isinstance(result, tuple) or len(result) != 2:  # the forms' contract, as fla-core's kernels return it
        kind = f"a tuple of {len(result)}" if isinstance(result, tuple) else f"a {type(result).__name__}"
        raise TypeError(f"a KDA function returns the tuple (o, final_state); this one returned {kind}")
    return {"o": result[0], "final_state": result[1]}


def oracle(case: Case) -> Outputs:
    """The recurrent definition in fp64."""
    return call(kda.recurrent, case, torch.float64)


FAMILIES = ("recurrent", "chunkwise")


def _baseline_form(family: str) -> Callable[..., Any]:
    """The naive form of ``family``: ``recurrent``, ``chunkwise`` (chunk 64) or ``chunkwise/C``."""
    form, _, chunk = family.partition("/")
    if form == "recurrent" and not chunk:
        return kda.naive_baseline
    if form == "chunkwise" and (not chunk or chunk.isdigit()):
        return partial(kda.naive_chunk_baseline, chunk_size=int(chunk) if chunk else CHUNK)
    raise ValueError(f"KDA baseline families are 'recurrent', 'chunkwise' and 'chunkwise/<chunk size>'; "
                     f"got {family!r}")


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The ``family`` form with every stored tensor in ``dtype``."""
    return call(partial(_baseline_form(family), dtype=dtype), case, torch.float64)


def baseline_for(family: str, params: Mapping[str, Any]) -> str:
    """The chunkwise family at the implementation's own chunk size: a chunked form is held to what
    a plain chunked form achieves with the same chunks (the fp32 cancellation in ``G_r - G_c``
    grows with the chunk), so a chunk of 50 is not judged by chunk 64's error."""
    chunk = params.get("chunk_size")
    if family == "chunkwise" and isinstance(chunk, int) and not isinstance(chunk, bool) and chunk != CHUNK:
        return f"chunkwise/{chunk}"
    return family


def _quantities(case: Case) -> kda.OverflowQuantities:
    if "quantities" not in case.cache:
        case.cache["quantities"] = kda.overflow_quantities(**{n: case.inputs[n] for n in ("q", "k", "v", "g", "beta")})
    return case.cache["quantities"]


def _predict(case: Case, **tiling: Any) -> Prediction:
    return Prediction.of(kda.predict(_quantities(case), **tiling))


def _explain(case: Case, **tiling: Any) -> list[str]:
    """The first three operands that overflowed, then the three with the largest share of values
    in the subnormal range."""
    x = case.inputs
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    return (kda.explain_overflow(*args, initial_state=x["initial_state"], **tiling)[:3]
            + explain_underflow(*args, initial_state=x["initial_state"], **tiling)[:3])


def _form(form: str, dtype: str, cases: tuple[str, ...] = ("default",), baseline_family: str | None = None,
          **options: Any) -> Implementation:
    """One of our own forms: ``tiled`` (operands rounded to ``dtype``, inputs fp32, or fp64 for an
    exact run) or a reference form run on inputs in ``dtype``."""
    tiled = form == "tiled"
    if tiled:
        options = dict(chunk_size=CHUNK, tile=TILE, operand_dtype=dtype, anchor="tile_start") | options
    inputs_dtype = (torch.float64 if dtype == "fp64" else torch.float32) if tiled else resolve_dtype(dtype)
    shown = {k: v for k, v in options.items() if k != "operand_dtype"}
    return Implementation(
        module="kda", implementation="k3verify", form=form, dtype=dtype, params=shown,
        rule=rule_for(dtype),
        run=partial(call, getattr(kda, form), dtype=inputs_dtype, **options),
        predict=partial(_predict, **options) if tiled and dtype != "fp64" else None,
        explain=partial(_explain, **options) if tiled else None,
        cases=cases, baseline=baseline_family or ("chunkwise" if tiled else form),
    )


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for KDA."""
    impls = [
        _form("chunkwise", "fp64", chunk_size=CHUNK),
        _form("chunkwise", "fp64", chunk_size=16),
        _form("recurrent", "fp32"),
        _form("recurrent", "bf16"),
        _form("chunkwise", "fp32", chunk_size=CHUNK),
        _form("chunkwise", "bf16", chunk_size=CHUNK),
    ]
    impls += [_form("tiled", "fp64", anchor=a) for a in ANCHORS]
    impls += [_form("tiled", "bf16", ("default", "saturated"), anchor=a) for a in ANCHORS]
    impls += [
        _form("tiled", "bf16", ("saturated",), tile=32),  # past the frontier: must overflow
        _form("tiled", "fp32"),
        _form("tiled", "fp16"),  # K3's bound is far past fp16's frontier: must overflow
        _form("tiled", "fp16", diagonal="fp32"),
        _form("tiled", "fp8_e4m3"),
        _form("tiled", "fp8_e4m3", diagonal="fp32"),
    ]
    return impls + _kernel_implementations() + _fla_implementations() + _production_implementations()


# Whose speed `run --time` sets our bf16 kernels' beside: fla-core's production kernels.
FLA_PEERS = {"kernel:chunk": Peer("fla-core", "kernel:chunk_kda", {"safe_gate": True}),
             "kernel:fused_recurrent": Peer("fla-core", "kernel:fused_recurrent_kda")}


def _kernel_implementations() -> list[Implementation]:
    """Our Triton kernels: fp32 wherever Triton runs (the interpreter is faithful there), the
    operand dtypes of production on a CUDA device only (docs/model.md §5); the bf16 chunk kernels also
    sweep the overflow map, predicted by the tiled form's frontier at their anchor."""

    def make(form: str, fn: Callable, dtype: str, cases: tuple[str, ...], family: str, **kw: Any) -> Implementation:
        tiling = dict(chunk_size=CHUNK, tile=TILE, operand_dtype=dtype, **kw)
        return Implementation(
            module="kda", implementation="k3verify", form=form, dtype=dtype, params=kw, rule=BASELINE_RULE,
            run=lambda case: {n: t.cpu() for n, t in call(fn, case, torch.float64, operand_dtype=dtype, **kw).items()},
            predict=partial(_predict, **tiling) if kw else None, cases=cases, baseline=family,
            is_available=unavailable_as(partial(kernels.unavailable_reason, dtype)),
            in_map=bool(kw) and dtype != "fp32", peer=FLA_PEERS.get(form) if dtype == "bf16" else None,
        )

    chunked, decode = ("kernel:chunk", kernels.chunk), ("kernel:fused_recurrent", kernels.fused_recurrent)
    impls = [make(*chunked, "fp32", ("small",), "chunkwise", anchor="tile_start")]
    impls += [make(*chunked, "bf16", ("default", "saturated"), "chunkwise", anchor=a) for a in ANCHORS]
    impls += [make(*decode, dt, ("decode",), "recurrent") for dt in ("fp32", "bf16")]
    return impls


def _fla_implementations() -> list[Implementation]:
    """fla-core's CPU references (fp32 arithmetic) and, on a CUDA machine, its kernels in bf16 (its
    own Triton kernels: its dispatch to FlashKDA or TileLang is switched off, and the source says so)."""
    name = f"fla-core {fla_adapter.version() or '(missing)'}"

    def make(form: str, fn: Callable, dtype: str, *, gpu: bool, family: str, cases=("default",), predict=None,
             lower_bound: bool = False, **kw: Any) -> Implementation:
        source = f"{name} (adapter" + ("; fla's Triton kernels, backend dispatch off)" if gpu else ")")

        def run(case: Case) -> Outputs:
            # fla's kernels take the gate's lower bound: the bound the case's gates were drawn with.
            bound = {"lower_bound": case.params.get("g_min", G_MIN)} if lower_bound else {}
            return call(fn, case, resolve_dtype(dtype), **kw, **bound)

        return Implementation(
            # lower_bound shows the default cases' bound; a map case passes its own (see run).
            module="kda", implementation=name, form=form, dtype=dtype,
            params=kw | ({"lower_bound": G_MIN} if lower_bound else {}),
            rule=BASELINE_RULE, run=run, predict=predict, cases=cases, baseline=family, source=source,
            is_available=unavailable_as(partial(fla_adapter.unavailable_reason, gpu=gpu)), in_map=gpu and
            form == "kernel:chunk_kda",
        )

    # chunk_kda(safe_gate=True) anchors its diagonal tiles at row 0 minus 2 per row with
    # 16-row sub-tiles and fp32 factors: our row0_shift frontier with fp32 operands.
    safe_gate = partial(_predict, chunk_size=CHUNK, tile=TILE, operand_dtype="fp32", anchor="row0_shift")
    # Without safe_gate the diagonal tiles take fla's fp32 per-element path: never overflows.
    per_element = lambda case: Prediction(True, "safe_gate=False: fp32 per-element diagonal tiles")  # noqa: E731
    chunk_kda = [
        make("kernel:chunk_kda", fla_adapter.chunk_gpu, "bf16", gpu=True, family="chunkwise",
             cases=("default", "saturated"), predict=predict, safe_gate=flag, lower_bound=True)
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


# FlashKDA splits its diagonal tiles at the tile start (the K3 paper's anchor) with 16-row sub-tiles:
# on an H100 its worst-case output is finite at g_min = -5.5449 and not at -5.5459, where this
# prediction puts the edge at -5.5452 (fla-core safe_gate's anchor would put it at -6.915):
# docs/modules/kda.md, "Production kernels".
FLASH_KDA_PREDICTION = dict(chunk_size=CHUNK, tile=TILE, operand_dtype="bf16", anchor="tile_start")


def _production_implementations() -> list[Implementation]:
    """The production kernels serving engines run for K3's prefill, beside fla-core's: FlashKDA
    (``tokenspeed-flashkda``, SM90) in bf16 with the state in fp32, given the bound the case's
    gates were drawn with; and the CuTe-DSL prefill (``tokenspeed-cutedsl-kda``, Blackwell only),
    a row that says why it does not run."""
    name = f"{flash_kda.PACKAGE} {flash_kda.version() or '(missing)'}"

    def run(case: Case) -> Outputs:
        return call(flash_kda.chunk, case, torch.bfloat16, lower_bound=case.params.get("g_min", G_MIN))

    flash = Implementation(
        module="kda", implementation=name, form="kernel:flash_kda", dtype="bf16", params={"lower_bound": G_MIN},
        rule=BASELINE_RULE, run=run, predict=partial(_predict, **FLASH_KDA_PREDICTION),
        cases=("default", "saturated", "decode"), baseline="chunkwise",
        source=f"{name} (adapter: flash_kda.fwd, SM90 CUTLASS; state transposed from [B, H, V, K])",
        is_available=unavailable_as(flash_kda.unavailable_reason),
    )
    blackwell = listed("kda", tokenspeed.WHEELS["tokenspeed-cutedsl-kda"].name, "kernel:cutedsl_kda", "bf16",
                       partial(tokenspeed.unavailable_reason, "tokenspeed-cutedsl-kda"), ("default", "saturated"),
                       params={"lower_bound": G_MIN}, baseline="chunkwise")
    return [flash, blackwell]


# --- overflow map ---------------------------------------------------------------------

MAP_TILES = (4, 8, 16, 32, 64)
MAP_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp32")
MAP_INPUTS = ("worst", "random")


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    grid = list(options.x_values) if options.x_values is not None else samples.g_min_grid(options.quick)
    return [{"input": kind, "g_min": g} for g in grid for kind in MAP_INPUTS]


def _map_case(point: dict[str, Any], seed: int) -> Case:
    inputs, params = samples.map_inputs(point["input"], point["g_min"], seed)
    return Case(point["input"], inputs, params)


def _map_reference(case: Case) -> torch.Tensor:
    """The chunkwise form in fp64 (fp64-agreement with the recurrence, and faster)."""
    return call(partial(kda.chunkwise, chunk_size=CHUNK), case, torch.float64)["o"]


def _traced(case: Case, **tiling: Any) -> tuple[torch.Tensor, list[str]]:
    if "f32" not in case.cache:
        case.cache["f32"] = [case.inputs[n].float() for n in ("q", "k", "v", "g", "beta")]
    o, events = tiled_traced(*case.cache["f32"], **tiling)
    return o, [e.describe() for e in events[:1]]


def _map_forms(options: MapOptions) -> list[SweptForm]:
    tiles = (4, 16, 32, 64) if options.quick else MAP_TILES
    forms = []
    for dtype, anchor, tile in itertools.product(MAP_DTYPES, ANCHORS, tiles):
        tiling = dict(chunk_size=CHUNK, tile=tile, operand_dtype=dtype, anchor=anchor)
        forms.append(SweptForm("k3verify tiled", {"dtype": dtype, "anchor": anchor, "tile": tile}, dtype,
                               run=partial(_traced, **tiling),
                               predict=lambda case, t=tiling: kda.predict(_quantities(case), **t)))
    return forms


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    return {
        "shape": samples.MAP_SHAPE,
        "chunk_size": CHUNK,
        "g_min": sorted({c["g_min"] for c in cells}, reverse=True),
        "tiles": sorted({c["tile"] for c in cells if c["implementation"] == "k3verify tiled"}),
        "dtypes": list(MAP_DTYPES),
        "anchors": list(ANCHORS),
        "anchor_shift": DEFAULT_ROW0_SHIFT,
        "inputs": {
            "worst": "every gate = g_min, q/k rows one-hot (largest operand entry = its decay factor)",
            "random": "g = g_min * sigmoid(z + dt_bias), l2-normalised random q/k; prediction uses the realized gates",
        },
        "prediction": "finite iff every diagonal-tile exponent < ln(max fp32) and every ln|operand| < ln(max dtype)",
        "agreement": {kind: agreement(cells, only=lambda c, k=kind: c["input"].startswith(k)) for kind in MAP_INPUTS},
    }


MAP = MapDefinition(
    points=_map_points,
    make_case=_map_case,
    reference=_map_reference,
    forms=_map_forms,
    spec=MapSpec(
        x="g_min",
        y="tile",
        panel_row="dtype",
        panel_col="anchor",
        figure="input",
        x_label="gate lower bound g_min",
        y_label="sub-tile BC",
        title="KDA tiled form: overflow and error vs the fp64 oracle (chunk 64)",
        x_descending=True,
        operating_point=(("g_min", G_MIN), ("tile", TILE)),
        operating_label=f"K3 (g_min = {G_MIN:g}, gate_lower_bound; sub-tile {TILE})",
    ),
    # Adjacent along g_min only: a neighbour in sub-tile size does not excuse a disagreement.
    frontier_axes=lambda cells: {"g_min": sorted({c["g_min"] for c in cells}, reverse=True)},
    fixed=("implementation", "input", "dtype", "anchor", "tile"),
    meta=_map_meta,
    registered_on=lambda point: point["input"] == "worst",
    registered_keys=lambda impl: {"tile": impl.params.get("tile", TILE)},
)


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """The rows along the value axis for the RMS term, the (batch, head) pairs for the bias, of
    ``o: [B, T, H, V]`` and ``final_state: [B, H, K, V]``. A rounded key or query reaches every
    value channel of its row alike (on one token with saturated gates an fp32 form's whole error
    is one scalar rounding, -2.8e-7 x the output), and the state carries a rounding along every
    later position, so its projection on the output sums coherently over positions: only
    separate sequences and heads project independently (docs/sensitivity.md)."""
    return ErrorSamples(math.prod(shape[:-1]), shape[0] * (shape[2] if output == "o" else shape[1]))


register(
    ModuleEntry(
        name="kda",
        title="Kimi Delta Attention",
        make_cases=lambda seed: cases_from(samples.make_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        baseline_families=FAMILIES,
        baseline_for=baseline_for,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"o": ("b", "t", "h", "v"), "final_state": ("b", "h", "k", "v")},
        call=call,
        overflow_map=MAP,
        golden_cases=lambda seed: cases_from(samples.golden_cases(seed)),
        position_axis=1,  # o: [B, T, H, V]
        strategy=samples.strategy,
        error_samples=_error_samples,
        sharded=ShardedForm(
            "k3verify.kda.sharded", ("y", "final_state"), position_axis=1,
            gather=lambda ranks: {"y": replicated(ranks, "y"),
                                  "final_state": torch.cat([r["recurrent"] for r in ranks], 1)},  # heads in rank order
        ),
    )
)

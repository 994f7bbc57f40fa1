"""Registry entry for KDA's backward pass (rows say ``direction: backward``): the gradients of
``L = sum(o * do) + sum(S_T * dht)`` (``numerics.gradients``) for the cotangents ``do`` and
``dht`` that each case holds beside KDA's inputs, judged against autograd through the fp64
recurrence; same-dtype baselines are autograd through the naive forms, whose stored tensors and
gradients are rounded to the dtype."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ...adapters import fla as fla_adapter
from ...kda import samples
from ...kda.chunkwise import chunkwise as kda_chunkwise
from ...kda.chunkwise import chunkwise_backward, naive_backward_baseline
from ...kda.gate import InKernelGate
from ...kda.inputs import cast_inputs, sequence_bounds, to_chunks
from ...kda.recurrent import autograd_backward, recurrent_backward
from ...kda.samples import CHUNK, TILE
from ...kda.tiled import (
    ANCHORS,
    BackwardOverflowQuantities,
    attribute_backward_error,
    backward_overflow_quantities,
    predict_backward,
    predicted_finite,
    tiled_backward,
    tiled_backward_traced,
)
from ...numerics import compare, dtype_name, ln_max, resolve_dtype, rule_for, storage_for
from ..guard import checked_call, gradients_by_name
from ..overflow_map import MapDefinition, MapOptions, SweptForm, agreement, flat
from ..registry import (
    Case,
    ErrorSamples,
    Implementation,
    ModuleEntry,
    Outputs,
    Prediction,
    cases_from,
    default_error_samples,
    register,
    unavailable_as,
)
from . import kda as kda_entry
from .kda import _baseline_form, baseline_for

OUTPUTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
ARGS = ("q", "k", "v", "g", "beta")
# K3's head dims (default, saturated gates); packed sequences (cu_seqlens); the gate in the kernel.
CASES = ("default", "saturated", "packed", "gate")


def with_cotangents(sample: samples.Sample) -> samples.Sample:
    """A forward sample with its backward's cotangents ``do`` and ``dht`` among the inputs, drawn
    from its seed (:func:`k3verify.kda.samples.cotangents`; ``dht`` per packed sequence)."""
    inputs, params = sample
    B, T, H, K = inputs["q"].shape
    states = None if inputs.get("cu_seqlens") is None else len(inputs["cu_seqlens"]) - 1
    drawn = samples.cotangents(B, T, H, K, inputs["v"].shape[-1], seed=params.get("seed", 0), states=states)
    return dict(inputs) | drawn, dict(params, loss="sum(o*do) + sum(S_T*dht)")


def _cases(seed: int) -> dict[str, samples.Sample]:
    made = samples.make_cases(seed)
    shape = dict(samples.PACKED_SHAPE)
    made["packed"] = (samples.packed_inputs(**shape, seed=seed + 3),
                      dict(shape, lengths=list(samples.PACKED_LENGTHS), g_min=samples.G_MIN, seed=seed + 3))
    made["gate"] = (samples.gated_inputs(1, 80, **shape, seed=seed + 4),
                    dict(shape, B=1, T=80, g_min=samples.G_MIN, seed=seed + 4, gate="in the kernel"))
    return {name: with_cotangents(made[name]) for name in CASES}


def _golden_cases(seed: int) -> dict[str, samples.Sample]:
    return {name: with_cotangents(s) for name, s in samples.golden_cases(seed).items() if name.endswith(".small")}


def arguments(case: Case, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The case's inputs cast to ``dtype`` as the backward forms take them: the positional
    ``q, k, v, g, beta`` and the keywords ``do, dht, initial_state`` (``cu_seqlens``, ``gate``);
    the gate and its parameters in fp32 as a kernel takes them (:func:`~k3verify.kda.inputs.cast_inputs`)."""
    x = cast_inputs(case.inputs, dtype)
    extra = {}
    if x.get("cu_seqlens") is not None:
        extra["cu_seqlens"] = x["cu_seqlens"]
    if x.get("A_log") is not None:
        extra["gate"] = InKernelGate(x["A_log"], x["dt_bias"], case.params.get("g_min", samples.G_MIN))
    return [x[n] for n in ARGS], dict(do=x["do"], dht=x["dht"], initial_state=x["initial_state"], **extra)


def call(fn: Callable, case: Case, dtype: torch.dtype, **options: Any) -> Outputs:
    """``fn`` with the backward forms' signature (``fn(q, k, v, g, beta, *, do, dht,
    initial_state, ...) -> {dq, dk, ...}``) on the case's inputs cast to ``dtype``."""
    args, kwargs = arguments(case, dtype)
    result = checked_call(fn, args, ARGS, kwargs | options)
    return gradients_by_name(result, "a KDA", OUTPUTS)


def oracle(case: Case) -> Outputs:
    """Autograd through the recurrent definition in fp64."""
    return call(recurrent_backward, case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The ``recurrent`` family: autograd through the naive recurrence in ``dtype`` (values and
    gradients rounded where it stores them). The ``chunkwise`` family (``chunkwise/C``: chunk
    ``C``): the hand-written chunkwise backward with every stored tensor in ``dtype``
    (:func:`~k3verify.kda.chunkwise.naive_backward_baseline`), whose ``dg`` cancels as a chunkwise
    kernel's does. The ``chunkwise-autograd`` family: autograd through the naive chunk forward."""
    form, _, chunk = family.partition("/")
    if form not in ("recurrent", "chunkwise", AUTOGRAD_CHUNKWISE) or (chunk and not chunk.isdigit()) or (
            chunk and form == "recurrent"):
        raise ValueError(f"KDA's backward baseline families are 'recurrent', 'chunkwise', "
                         f"'{AUTOGRAD_CHUNKWISE}' and those two with '/<chunk size>'; got {family!r}")
    if form == "chunkwise":
        return call(partial(naive_backward_baseline, dtype=dtype, chunk_size=int(chunk) if chunk else CHUNK),
                    case, torch.float64)
    if form == AUTOGRAD_CHUNKWISE:
        family = "chunkwise" + (f"/{chunk}" if chunk else "")
    # The gate as a plain implementation runs it, in fp32 (gates arrive in fp32), as the chunkwise
    # family's does: in fp64 the sums over tokens that form dA_log and ddt_bias were exact, and a
    # correct fp32 form's ddt_bias measured 1.0-3.1x that baseline's error (seeds 0-24 and 3668).
    return call(partial(autograd_backward, _baseline_form(family), dtype=dtype, gate_dtype=storage_for(dtype)), case,
                torch.float64)


# The baseline family of a chunk form differentiated by autograd (fla-core's naive_chunk_kda):
# autograd through the naive chunk forward, which forms dg as that form does, without the
# chunkwise backward's difference of terms.
AUTOGRAD_CHUNKWISE = "chunkwise-autograd"


def _own(form: str, fn: Callable, dtype: str, **options: Any) -> Implementation:
    return Implementation(
        module="kda_backward", implementation="k3verify", form=form, dtype=dtype, params=options,
        rule=rule_for(dtype), run=partial(call, fn, dtype=resolve_dtype(dtype), **options), cases=CASES,
        baseline="recurrent" if form.startswith("recurrent") else "chunkwise",
    )


def _tiled(dtype: str, **tiling: Any) -> Implementation:
    """The tiled backward at K3's chunk and sub-tile, predicted by the backward's frontier; its
    overflows explained operand by operand."""
    tiling = dict(chunk_size=CHUNK, tile=TILE, **tiling)
    own = _own("tiled", tiled_backward, "fp64", operand_dtype=dtype, **tiling)
    return replace(own, dtype=dtype, params=tiling, rule=rule_for(dtype),
                   predict=partial(_predict, operand_dtype=dtype, **tiling),
                   explain=partial(_explain, operand_dtype=dtype, **tiling))


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies of KDA's backward: the hand-written chunkwise backward in
    fp64 (two chunk sizes), fp32 and on bf16 inputs; the tiled backward in bf16 at each anchor and
    in fp16 (past its frontier at K3's bound, and with fp32 diagonal tiles); autograd through the
    recurrence on fp32 and bf16 inputs; fla-core's pure-torch references under autograd."""
    impls = [
        _own("chunkwise", chunkwise_backward, "fp64", chunk_size=CHUNK),
        _own("chunkwise", chunkwise_backward, "fp64", chunk_size=16),
        _own("chunkwise", chunkwise_backward, "fp32", chunk_size=CHUNK),
        _own("chunkwise", chunkwise_backward, "bf16", chunk_size=CHUNK),
        *(_tiled("bf16", anchor=a) for a in ANCHORS),
        _tiled("fp16", anchor="tile_start"),  # K3's bound is far past fp16's frontier: must overflow
        _tiled("fp16", anchor="tile_start", diagonal="fp32"),
        _own("recurrent (autograd)", recurrent_backward, "fp32"),
        _own("recurrent (autograd)", recurrent_backward, "bf16"),
    ]
    return impls + _fla_implementations() + _fla_kernels()


def overflow_quantities(case: Case, chunk_size: int = CHUNK) -> BackwardOverflowQuantities:
    """The case's :class:`~k3verify.kda.tiled.BackwardOverflowQuantities` (made once per case)."""
    key = f"backward overflow quantities/{chunk_size}"
    if key not in case.cache:
        args, kwargs = arguments(case, torch.float64)
        case.cache[key] = backward_overflow_quantities(*args, **kwargs, chunk_size=chunk_size)
    return case.cache[key]


def _predict(case: Case, **tiling: Any) -> Prediction:
    return Prediction.of(predict_backward(overflow_quantities(case, tiling.get("chunk_size", CHUNK)), **tiling))


def _explain(case: Case, **tiling: Any) -> list[str]:
    """The first three operands or split products that overflowed (computed in fp32); where none
    did, the roundings that hold half or more of a gradient's error against the exact backward
    (:func:`~k3verify.kda.tiled.attribute_backward_error`), the first three."""
    args, kwargs = arguments(case, torch.float32)
    overflowed = [e.describe() for e in tiled_backward_traced(*args, **kwargs, **tiling)[1][:3]]
    if overflowed:
        return overflowed
    exact = call(chunkwise_backward, case, torch.float64, chunk_size=tiling.get("chunk_size", CHUNK))
    return attribute_backward_error(*args, **kwargs, reference=exact, **tiling)[:3]


def _fla_implementations() -> list[Implementation]:
    """fla-core's ``naive_recurrent_kda`` and ``naive_chunk_kda`` (fp32 arithmetic) under autograd;
    the chunk form's gradients are predicted (:func:`masked_decay_prediction`)."""
    name = f"fla-core {fla_adapter.version() or '(missing)'}"
    # The recurrence under autograd takes 2.6 s a case (a graph of T steps of small ops): the
    # default case only; the chunk form's frontier needs the saturated one too.
    forms = (("recurrent (autograd)", fla_adapter.naive_recurrent, "recurrent", None, ("default",), None),
             ("chunkwise (autograd)", fla_adapter.naive_chunk, AUTOGRAD_CHUNKWISE, masked_decay_prediction, CASES,
              partial(own_arithmetic, fla_adapter.naive_chunk, "fla-core's naive_chunk_kda")))
    return [
        Implementation(
            module="kda_backward", implementation=name, form=form, dtype="fp32", params={},
            rule=rule_for("fp32"), run=partial(call, partial(autograd_backward, fn), dtype=torch.float32),
            predict=predict, explain=explain, cases=cases, baseline=family, source=f"{name} (adapter)",
            is_available=unavailable_as(partial(fla_adapter.unavailable_reason, gpu=False)),
        )
        for form, fn, family, predict, cases, explain in forms
    ]


def own_arithmetic(forward: Callable, what: str, case: Case, *, dtype: torch.dtype = torch.float32) -> list[str]:
    """Whether a gradient's error is the arithmetic of a chunk ``forward`` under autograd: its
    error against the oracle beside autograd through our chunkwise forward, the same math, on the
    same inputs in the same ``dtype``; a line for each finite gradient more than twice ours (a
    non-finite one is the prediction's to explain: :func:`masked_decay_prediction`)."""
    if not masked_decay_prediction(case).finite:
        return []  # its overflow, which the row's prediction explains
    ref = oracle(case)
    theirs = call(partial(autograd_backward, forward), case, dtype)
    ours = call(partial(autograd_backward, kda_chunkwise), case, dtype)
    lines = []
    for n, r in ref.items():
        a, b = (float(compare(x[n].to(torch.float64), r, ulp_dtype=dtype).rms_ratio) for x in (theirs, ours))
        if math.isfinite(a) and a > 2 * b:
            lines.append(f"{n}: rms error {a:.3e} through {what}, {b:.3e} through k3verify's chunkwise form in the "
                         f"same {dtype_name(dtype)} on the same inputs: the excess is {what}'s own arithmetic")
    return lines


def _fla_kernels() -> list[Implementation]:
    """fla-core's ``chunk_kda`` on a CUDA device, its own backward through autograd, with and without
    safe_gate, given the lower bound the case's gates were drawn with (K3's -5)."""
    name = f"fla-core {fla_adapter.version() or '(missing)'}"

    def make(flag: bool) -> Implementation:
        def run(case: Case) -> Outputs:
            bound = case.params.get("g_min", samples.G_MIN)
            forward = partial(fla_adapter.chunk_gpu, safe_gate=flag, lower_bound=bound)
            with fla_adapter.triton_only():  # the backward too runs fla's own kernels (no TileLang)
                return call(partial(autograd_backward, forward), case, torch.bfloat16)

        return Implementation(
            module="kda_backward", implementation=name, form="kernel:chunk_kda (autograd)", dtype="bf16",
            params={"safe_gate": flag, "lower_bound": samples.G_MIN}, rule=rule_for("bf16"), run=run,
            cases=("default", "saturated"), baseline="chunkwise",
            source=f"{name} (adapter; fla's Triton kernels, backend dispatch off)",
            is_available=unavailable_as(partial(fla_adapter.unavailable_reason, gpu=True)),
        )

    return [make(True), make(False)]


def masked_decay_prediction(case: Case, chunk_size: int = fla_adapter.NAIVE_CHUNK) -> Prediction:
    """Whether autograd through a chunk form that exponentiates every pair ``exp(G_c - G_r)`` of a
    chunk and masks the pairs with ``c > r`` afterwards (fla-core's ``naive_chunk_kda``) gives
    finite gradients: the masked pairs reach ``exp(G_first - G_last)``; once that passes fp32's
    range they are ``inf``, the forward masks them away, and the backward multiplies the mask's
    zero gradient by them: ``0 * inf = NaN``. Finite iff the largest prefix spread of a chunk,
    ``-sum(g)`` over its tokens after the first, stays below ``ln(max fp32)``."""
    x = case.inputs
    g = x["g"].to(torch.float64)
    if x.get("A_log") is not None:  # the case holds the gate's logits
        g = InKernelGate(x["A_log"], x["dt_bias"], case.params.get("g_min", samples.G_MIN))(g)
    worst, where = 0.0, "no chunk"
    for i, (a, b) in enumerate(sequence_bounds(x.get("cu_seqlens"), g.shape[0], g.shape[1])):
        spread = -to_chunks(g[:, a:b], chunk_size)[..., 1:, :].sum(-2)  # [B, H, N, K]; padding adds 0
        if spread.numel() and float(spread.max()) > worst:
            worst = float(spread.max())
            n = int(spread.amax(dim=(0, 1, 3)).argmax())
            where = f"chunk {n}" + (f" of sequence {i}" if x.get("cu_seqlens") is not None else "")
    limit = ln_max("fp32")
    finite = worst < limit
    return Prediction(finite, f"the masked pairs of {where} reach exp({worst:.1f}), "
                              f"{'within' if finite else 'past'} fp32's ln max {limit:.2f}"
                              + ("" if finite else ": the backward's 0 * inf is NaN"))


# --- overflow map -----------------------------------------------------------------------

# The map's inputs: the forward map's two, and the worst one under a large upstream gradient
# (fla-core's tests/ops/test_gdn2_overflow.py scales the upstream gradient up to find its overflow).
MAP_INPUTS = ("worst", "random", "loud")
LOUD_SCALE = 2.0**40
# Every gradient of a map cell, flattened into one vector (the cell's finiteness and error).
MAP_GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    grid = list(options.x_values) if options.x_values is not None else samples.g_min_grid(options.quick)
    return [{"input": kind, "g_min": g} for g in grid for kind in MAP_INPUTS]


def _map_case(point: dict[str, Any], seed: int) -> Case:
    kind = point["input"]
    inputs, params = samples.map_inputs("worst" if kind == "loud" else kind, point["g_min"], seed)
    shape = samples.MAP_SHAPE
    upstream = LOUD_SCALE if kind == "loud" else 1.0
    # Unit-scale dht: the map measures overflow, where the louder cotangent is the harder input.
    drawn = samples.cotangents(shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], seed=seed, dht_scale=1.0)
    inputs |= {n: t * upstream for n, t in drawn.items()}
    return Case(kind, inputs, dict(params, input=kind, upstream_scale=upstream))


def _map_reference(case: Case) -> torch.Tensor:
    """The gradients of the exact chunkwise backward in fp64 (it agrees with the oracle to 1e-10),
    from the same pass that reads the cell's overflow quantities."""
    return flat(overflow_quantities(case).gradients, MAP_GRADIENTS)


def _map_run(case: Case, **tiling: Any) -> tuple[torch.Tensor, list[str]]:
    args, kwargs = arguments(case, torch.float32)
    grads, events = tiled_backward_traced(*args, **kwargs, **tiling)
    return flat(grads, MAP_GRADIENTS), [e.describe() for e in events[:1]]


def _map_forms(options: MapOptions) -> list[SweptForm]:
    tiles = (4, 16, 32, 64) if options.quick else kda_entry.MAP_TILES
    forms = []
    for dtype, anchor, tile in itertools.product(kda_entry.MAP_DTYPES, ANCHORS, tiles):
        tiling = dict(chunk_size=CHUNK, tile=tile, operand_dtype=dtype, anchor=anchor)
        forms.append(SweptForm("k3verify tiled backward", {"dtype": dtype, "anchor": anchor, "tile": tile}, dtype,
                               run=partial(_map_run, **tiling),
                               predict=lambda case, t=tiling: predict_backward(overflow_quantities(case), **t)))
    return forms


def forward_frontier(dtype: str, anchor: str, tile: int, grid: list[float]) -> float | None:
    """The first ``g_min`` of ``grid`` (from -0.5 down) past the forward's analytic frontier
    (docs/model.md §1.6, unit-magnitude operands), or ``None`` if the whole grid is finite."""
    return next((g for g in grid if not predicted_finite(g, tile=tile, operand_dtype=dtype, anchor=anchor)), None)


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    grid = sorted({c["g_min"] for c in cells}, reverse=True)
    frontier: dict[str, Any] = {}
    for c in cells:
        where = frontier.setdefault(c["dtype"], {}).setdefault(c["anchor"], {}).setdefault(str(c["tile"]), {
            "forward": forward_frontier(c["dtype"], c["anchor"], c["tile"], grid)})
        if not c["predicted_finite"]:
            where[c["input"]] = max(where.get(c["input"], -math.inf), c["g_min"])
    return {
        "shape": samples.MAP_SHAPE,
        "chunk_size": CHUNK,
        "g_min": grid,
        "tiles": sorted({c["tile"] for c in cells}),
        "dtypes": list(kda_entry.MAP_DTYPES),
        "anchors": list(ANCHORS),
        "gradients": list(MAP_GRADIENTS),
        "inputs": {
            "worst": "every gate = g_min, q/k rows one-hot; do, dht standard normal",
            "random": "g = g_min * sigmoid(z + dt_bias), l2-normalised random q/k; do, dht standard normal",
            "loud": f"the worst input with do, dht scaled by 2^{math.log2(LOUD_SCALE):g}",
        },
        "prediction": "finite iff the forward's checks hold, the upstream gradient fits the operand dtype and "
                      "every split diagonal-tile product of the backward fits fp32 (kda.tiled.predict_backward)",
        "frontier": frontier,
        "agreement": {kind: agreement(cells, only=lambda c, k=kind: c["input"] == k) for kind in MAP_INPUTS},
    }


MAP = MapDefinition(
    points=_map_points,
    make_case=_map_case,
    reference=_map_reference,
    forms=_map_forms,
    spec=replace(kda_entry.MAP.spec, title="KDA tiled backward: overflow and error of the gradients vs the "
                                           "fp64 oracle (chunk 64)"),
    frontier_axes=kda_entry.MAP.frontier_axes,
    fixed=kda_entry.MAP.fixed,
    meta=_map_meta,
    registered_on=lambda point: point["input"] == "worst",
)


GRADIENT_AXES = {"dq": ("b", "t", "h", "k"), "dk": ("b", "t", "h", "k"), "dg": ("b", "t", "h", "k"),
                 "dv": ("b", "t", "h", "v"), "dbeta": ("b", "t", "h"), "dh0": ("b", "h", "k", "v"),
                 "dA_log": ("h",), "ddt_bias": ("hk",)}

def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """As the forward's (:mod:`k3verify.harness.modules.kda`): a rounding reaches a gradient through
    the state and the chunk's reverse prefix sum along every position alike, so the RMS term counts
    the rows along the last axis and the bias only the (batch, head) pairs. The gate's parameters
    keep the default."""
    if output in ("dA_log", "ddt_bias"):
        return default_error_samples(shape)
    heads = shape[1] if output == "dh0" else shape[2]
    rows = math.prod(shape) if output == "dbeta" else math.prod(shape[:-1])
    return ErrorSamples(rows, shape[0] * heads)


# The fp32 roundings each of dg's terms q * dq and k * dk carries through a split diagonal tile:
# the two exponentials e^(G - a) and e^(a - G) and the two products that apply them.
TERM_ROUNDINGS = 4


def _term_scale(output: str, case: Case, ref: Mapping[str, torch.Tensor]) -> float | None:
    """``dg`` is the reverse prefix sum of ``q * dq - k * dk`` (and the state's term): the RMS
    of those products, from the oracle's ``dq`` and ``dk``, times ``sqrt(2 * TERM_ROUNDINGS)``
    (the two terms' independent roundings). None for every other gradient."""
    if output != "dg":
        return None
    q, k = case.inputs["q"].to(torch.float64), case.inputs["k"].to(torch.float64)
    terms = torch.cat([(q * ref["dq"]).reshape(-1), (k * ref["dk"]).reshape(-1)])
    return float(terms.pow(2).mean().sqrt()) * math.sqrt(2 * TERM_ROUNDINGS) if terms.numel() else None


register(
    ModuleEntry(
        name="kda_backward",
        title="Kimi Delta Attention, backward",
        direction="backward",
        make_cases=lambda seed: cases_from(_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        baseline_families=("recurrent", "chunkwise", AUTOGRAD_CHUNKWISE),
        baseline_for=baseline_for,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes=GRADIENT_AXES,
        call=call,
        golden_cases=lambda seed: cases_from(_golden_cases(seed)),
        position_axis=1,  # dq: [B, T, H, K]
        from_forward=lambda forward: partial(autograd_backward, forward),
        overflow_map=MAP,
        error_samples=_error_samples,
        strategy=lambda: samples.strategy().map(with_cotangents),
        term_scale=_term_scale,
    )
)

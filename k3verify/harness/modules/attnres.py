"""Registry entry for Block AttnRes: named outputs ``h`` and ``blocks``, the implementations, the
precision map and the depth-drift study, declared; inputs come from :mod:`k3verify.attnres.samples`.

Two kinds of case, and every form is verified on both: aggregations (``sources``, ``hot``: one
AttnRes call over K3's largest source set, output ``h`` only) and 93-layer walks (``walk`` on
K3's blocks, ``walk_full`` on Full AttnRes: outputs ``h``, the final output AttnRes, and
``blocks``, the stored block representations at the end of the walk).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import attnres
from ...adapters import flash_attn_res
from ...attnres import kernels, samples, studies
from ...attnres.samples import LOGIT_SPREAD
from ...numerics import baseline_rule, compare, map_tensors, noise_floor, rule_for
from ..environment import one_thread  # small tensors: a second thread only spins
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
    register,
    unavailable_as,
)
from ..tp_rows import replicated

OUTPUTS = ("h", "blocks")
TILE = 4


def _is_walk(case: Case) -> bool:
    return "embedding" in case.inputs


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """One call's ``h: [T, d]``: every element for the RMS term (the rounded sources err per
    element), its tokens for the bias (a token's channels share its mixing weights and
    normaliser: counted per element, the bf16 tiled form's error on a seeded ``sources`` case
    projected 6.9 noise units onto the output). A walk's ``h`` and ``blocks: [N, T, d]``: the
    tokens for both, since every channel of a token also shares the mixing errors of all the
    layers before it (on ``walk_full`` one token of eight carries most of the error;
    docs/sensitivity.md)."""
    tokens = shape[-2] if len(shape) >= 2 else 1
    if params.get("kind") == "walk":
        return ErrorSamples(tokens, tokens)
    return ErrorSamples(math.prod(shape), math.prod(shape[:-1]))


def _form_args(case: Case) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional arguments of the case's level and, for a walk, its schedule."""
    x = case.inputs
    if _is_walk(case):
        return (x["embedding"], x["weights"], x["sublayers"]), {"schedule": x["schedule"]}
    return (x["sources"], x["w"], x["gamma"]), {}


@one_thread()
def call(fn: Callable, case: Case, dtype: torch.dtype, **options: Any) -> Outputs:
    """``fn`` with the forms' signature at the case's level, on its inputs cast to ``dtype``.

    Aggregation: ``fn(sources, w, gamma, **options) -> h:[T, d]`` gives ``{"h"}``. Walk:
    ``fn(embedding, weights, sublayers, schedule=..., **options)`` returning a
    :class:`~k3verify.attnres.Walk` (anything with ``output:[T, d]`` and ``blocks:[n, T, d]``)
    gives ``{"h": output, "blocks": blocks}``; the sublayers compute in their input's dtype.
    """
    (a, b, c), kw = _form_args(case)
    if _is_walk(case):
        dev = _device(case)
        walk = checked_call(fn, (a.to(dev, dtype), map_tensors(b, lambda t: t.to(dev, dtype)), c),
                            ("embedding", "weights", "sublayers"), kw | options)
        return {"h": walk.output.cpu(), "blocks": walk.blocks.cpu()}
    return {"h": checked_call(fn, (a.to(dtype), b.to(dtype), c.to(dtype)), ("sources", "w", "gamma"), options).cpu()}


def _device(case: Case) -> str:
    """Where a walk runs: the device its params name (the K3-width walk: ``cuda``, as its fp64
    definition keeps all 186 sublayer outputs, 11 GB, and takes minutes on a CPU) when there is
    one, else the CPU."""
    wanted = case.params.get("device", "cpu")
    return wanted if wanted == "cpu" or torch.cuda.is_available() else "cpu"


def _run(case: Case, form: str, **options: Any) -> Outputs:
    """Our ``form`` at the case's level on the fp64 inputs (each form rounds them to its stream)."""
    return call((attnres.WALKS if _is_walk(case) else attnres.AGGREGATIONS)[form], case, torch.float64, **options)


def oracle(case: Case) -> Outputs:
    """The recurrent definition in fp64."""
    return _run(case, "recurrent")


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The plain definition with every stored tensor in ``dtype`` (logits and softmax in fp32, as
    docs/model.md §3 pins them; a walk's blocks are its sums rounded after every addition); one family."""
    if family != "recurrent":
        raise ValueError(f"Block AttnRes has a single baseline family 'recurrent' (the definition), got {family!r}")
    naive = attnres.naive_walk if _is_walk(case) else attnres.naive_baseline
    return call(partial(naive, dtype=dtype), case, torch.float64)


@one_thread()
def _quantities(case: Case, stream_dtype: str) -> attnres.OverflowQuantities | attnres.WalkOverflowQuantities:
    key = f"quantities:{stream_dtype}"
    if key not in case.cache:
        args, kw = _form_args(case)
        case.cache[key] = attnres.overflow_quantities(*args, **kw, stream_dtype=stream_dtype)
    return case.cache[key]


def _predict(case: Case, **options: Any) -> Prediction:
    return Prediction.of(attnres.predict(_quantities(case, options["stream_dtype"]), **options))


@one_thread()
def _explain(case: Case, **options: Any) -> list[str]:
    """The first three tensors that overflowed; for the bf16-logit variant on one call, how far
    its logits move when rounded."""
    args, kw = _form_args(case)
    lines = attnres.explain_overflow(*args, **kw, **options)[:3]
    quantities = _quantities(case, options["stream_dtype"])
    if options.get("logit_dtype") and isinstance(quantities, attnres.OverflowQuantities):
        lines += attnres.explain_logit_rounding(quantities, options["logit_dtype"])
    return lines


def _form(form: str, dtype: str, cases: tuple[str, ...], **extra: Any) -> Implementation:
    """One row: ``form`` with a ``dtype`` stream (inputs rounded once from fp64)."""
    options = dict(stream_dtype=dtype) | extra
    exact = dtype == "fp64"
    return Implementation(
        module="attnres", implementation="k3verify", form=form, dtype=dtype, params=extra,
        rule=rule_for(dtype),
        run=partial(_run, form=form, **options),
        predict=partial(_predict, **options) if form == "tiled" and not exact else None,
        explain=partial(_explain, **options) if form == "tiled" else None,
        cases=cases,
    )


ALL = (*samples.AGGREGATION_CASES, "walk")
EVERY = (*samples.AGGREGATION_CASES, *samples.WALK_CASES)
KERNEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _kernel_run(case: Case, dtype: str, walk: Callable, aggregate: Callable) -> Outputs:
    """Kernels at the case's level, the stream in ``dtype``."""
    return call(walk if _is_walk(case) else aggregate, case, KERNEL_DTYPES[dtype])


def _kernel(dtype: str, cases: tuple[str, ...]) -> Implementation:
    """Our kernels: fp32 wherever Triton runs (the interpreter is faithful there), bf16 on a CUDA
    device only (docs/model.md §5). Held to the plain definition storing ``dtype``, like every form; in the
    precision map, predicted as the tiled form with fp32 logits and max subtraction."""
    return Implementation(
        module="attnres", implementation="k3verify", form="kernel:two_phase", dtype=dtype, params={},
        rule=BASELINE_RULE, run=partial(_kernel_run, dtype=dtype, walk=kernels.walk, aggregate=kernels.aggregate),
        cases=cases, is_available=unavailable_as(partial(kernels.unavailable_reason, dtype)),
        predict=partial(_predict, stream_dtype=dtype, tile=TILE), in_map=True,
        # `run --time` sets the bf16 kernel's speed beside flash-attn-res's two ops
        peer=Peer("flash-attn-res", "kernel:two_phase") if dtype == "bf16" else None,
    )  # fmt: skip


def _flash_attn_res() -> Implementation:
    """flash-attn-res's two Triton ops (bf16 outputs, CUDA only), given ``w ⊙ γ`` as its queries
    and K3's eps (:mod:`k3verify.adapters.flash_attn_res` says what it computes)."""
    name = f"flash-attn-res {flash_attn_res.version() or '(missing)'}"
    return Implementation(
        module="attnres", implementation=name, form="kernel:two_phase", dtype="bf16", params={},
        rule=BASELINE_RULE, run=partial(_kernel_run, dtype="bf16", walk=flash_attn_res.walk,
                                        aggregate=flash_attn_res.aggregate),
        cases=(*ALL, samples.K3_WALK), is_available=unavailable_as(flash_attn_res.unavailable_reason),
        source=f"adapter: {name}", predict=partial(_predict, stream_dtype="bf16", tile=TILE), in_map=True,
        # Its phase 1 has no output for an empty stored set (a softmax over no logits), so the
        # adapter refuses a call without a stored block; K3 never makes one (the embedding is stored).
        map_points=lambda point: point["sources"] >= 2,
    )  # fmt: skip


def _walk_h(walk: Callable, dtype: torch.dtype, embedding: torch.Tensor, weights: attnres.AttnResWeights,
            sublayers: Any, schedule: attnres.Schedule) -> torch.Tensor:  # fmt: skip
    """A kernel walk's every-call ``h`` on fp64 walk inputs cast to ``dtype`` (the depth-drift curve)."""
    return walk(embedding.to(dtype), weights.to(dtype), sublayers, schedule=schedule).h


def _depth_drift(seed: int, quick: bool) -> dict[str, Any]:
    """The depth-drift study with a curve for every kernel that runs here."""
    walks = {}
    for name, walk, dtype, reason in (
        ("kernel_fp32", kernels.walk, torch.float32, kernels.unavailable_reason(torch.float32)),
        ("kernel_bf16", kernels.walk, torch.bfloat16, kernels.unavailable_reason(torch.bfloat16)),
        ("flash_attn_res_bf16", flash_attn_res.walk, torch.bfloat16, flash_attn_res.unavailable_reason()),
    ):
        if reason is None:
            walks[name] = partial(_walk_h, walk, dtype)
    return studies.depth_drift(seed, quick, walks=walks)


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for Block AttnRes."""
    return [
        _form("chunkwise", "fp64", EVERY),
        _form("tiled", "fp64", EVERY, tile=TILE),
        _form("tiled", "fp64", ("sources", "walk"), tile=1),
        _form("recurrent", "fp32", ALL),
        _form("recurrent", "bf16", ALL),
        _form("chunkwise", "fp32", ALL),
        _form("chunkwise", "bf16", ALL),
        _form("tiled", "fp32", ALL, tile=TILE),
        _form("tiled", "bf16", (*ALL, "walk_full"), tile=TILE),
        _form("tiled", "fp16", ALL, tile=TILE),
        # Known bad: logits stored in bf16. Within the baseline allowance at the default logit
        # scale; the precision map and properties/test_attnres_precision.py show it failing the
        # baseline rule at large logits (so it is not run on `hot`).
        _form("tiled", "bf16", ("sources", "walk"), tile=TILE, logit_dtype="bf16"),
        # Known bad: no max subtraction. Fine at small logits; predicted and observed non-finite
        # on `hot` (an expected-nonfinite row, not a failure).
        _form("tiled", "bf16", ALL, tile=TILE, subtract_max=False),
        _kernel("fp32", ALL),
        _kernel("bf16", (*ALL, samples.K3_WALK)),
        _flash_attn_res(),
    ]


# --- precision map ---------------------------------------------------------------------------

MAP_STREAMS = ("bf16", "fp16", "fp32")
MAP_LOGITS = ("fp32", "bf16", "fp16")
MAP_VARIANTS = ("subtract_max", "no_max")
MAP_FORM = "k3verify tiled"


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    scales, counts = samples.map_grid(options.quick)
    if options.x_values is not None:
        scales = list(options.x_values)
    return [{"logit_scale": s, "log2_logit_scale": math.log2(s), "sources": n}
            for s, n in itertools.product(scales, counts)]


@one_thread()
def _map_case(point: dict[str, Any], seed: int) -> Case:
    inputs, params = samples.map_inputs(point["logit_scale"], point["sources"], seed)
    return Case("map", inputs, params)


def _map_reference(case: Case) -> torch.Tensor:
    return oracle(case)["h"]


@one_thread()
def _traced(case: Case, **options: Any) -> tuple[torch.Tensor, list[str]]:
    out, events = attnres.aggregate_tiled_traced(*_form_args(case)[0], **options)
    return out, [e.describe() for e in events[:1]]


def _map_options(stream: str, logit: str, variant: str) -> dict[str, Any]:
    return dict(stream_dtype=stream, logit_dtype=logit, tile=TILE, subtract_max=variant == "subtract_max")


@one_thread()
def _judge(case: Case, out: torch.Tensor, ref: torch.Tensor, *, stream: str) -> dict[str, Any]:
    """The cell under the baseline rule against the plain definition in its stream dtype
    (``baseline_*``): ``out`` and ``ref`` are ``h:[T, d]``, in the stream dtype and fp64."""
    key = f"allowance:{stream}"
    if key not in case.cache:  # one per stream at a point, shared by its logit dtypes and variants
        case.cache[key] = compare(baseline(case, stream)["h"], ref, ulp_dtype=stream), noise_floor(ref, stream)
    base, floor = case.cache[key]
    verdict = baseline_rule(compare(out, ref, ulp_dtype=stream), base, floor)
    return {"baseline_rms_ratio": base.rms_ratio, "baseline_limit": verdict.limit, "baseline_pass": verdict.passed}


def _map_forms(options: MapOptions) -> list[SweptForm]:
    forms = []
    for stream, logit, variant in itertools.product(MAP_STREAMS, MAP_LOGITS, MAP_VARIANTS):
        opts = _map_options(stream, logit, variant)
        params = {"dtype": stream, "stream_dtype": stream, "logit_dtype": logit, "variant": variant, "tile": TILE}
        forms.append(SweptForm(MAP_FORM, params, stream, run=partial(_traced, **opts),
                               predict=lambda case, o=opts: attnres.predict(_quantities(case, o["stream_dtype"]), **o),
                               judge=partial(_judge, stream=stream)))
    return forms


def _baseline_failures(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (stream, logit dtype, variant): finite cells failing the baseline rule, and the smallest
    logit scale at which any does."""
    out = {}
    for stream, logit, variant in itertools.product(MAP_STREAMS, MAP_LOGITS, MAP_VARIANTS):
        group = [c for c in cells if c["implementation"] == MAP_FORM and c["finite"]
                 and (c["stream_dtype"], c["logit_dtype"], c["variant"]) == (stream, logit, variant)]
        failing = [c for c in group if not c["baseline_pass"]]
        out[f"{stream} stream, {logit} logits, {variant}"] = {
            "finite_cells": len(group),
            "failing": len(failing),
            "smallest_failing_logit_scale": min((c["logit_scale"] for c in failing), default=None),
        }
    return out


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    return {
        "shape": samples.MAP_SHAPE,
        "tile": TILE,
        "logit_scales": list(dict.fromkeys(c["logit_scale"] for c in cells)),
        "sources": list(dict.fromkeys(c["sources"] for c in cells)),
        "stream_dtypes": list(MAP_STREAMS),
        "logit_dtypes": {"fp32": "logits and exponentials in fp32 (K3's design)", "bf16": "stored in bf16 (known bad)",
                         "fp16": "stored in fp16"},
        "variants": {"subtract_max": "online softmax with a running max", "no_max": "P = exp(ℓ) (known bad)"},
        "inputs": "controlled_sources: per token one source with logit = scale, the others within "
                  f"min(1.5 scale, {LOGIT_SPREAD}) below; log-normal source RMS; order shuffled",
        "prediction": "finite iff every stored tensor fits its dtype (ln|x| < ln max): inputs in the stream dtype, "
                      "Σv² in fp32, |ℓ| in the logit dtype; without max subtraction also max ℓ < ln max of the logit "
                      "dtype (P = e^ℓ), log-sum-exp and ln Σ e^ℓ|v| < ln max fp32, and every token's max logit above "
                      "ln(min subnormal / 2) of the logit dtype (else Z = 0, 0/0). Exact fp64 magnitudes of the "
                      "cell's stream-rounded inputs; cells within the logit rounding band count as adjacent.",
        "baseline": "finite cells: rms_ratio <= 2 x rms_ratio(plain definition in the stream dtype, fp32 softmax) "
                    "+ noise floor of the stream dtype",
        "agreement": {
            **{v: agreement(cells, only=lambda c, v=v: c["variant"] == v) for v in MAP_VARIANTS},
            **{f"logits {lg}": agreement(cells, only=lambda c, lg=lg: c["logit_dtype"] == lg) for lg in MAP_LOGITS},
        },
        "baseline_failures": _baseline_failures(cells),
    }


MAP = MapDefinition(
    points=_map_points,
    make_case=_map_case,
    reference=_map_reference,
    forms=_map_forms,
    spec=MapSpec(
        x="log2_logit_scale",
        y="sources",
        panel_row="stream_dtype",
        panel_col="logit_dtype",
        figure="variant",
        x_label="log2 logit scale ‖w⊙γ‖·sqrt(d)",
        y_label="number of sources",
        title="Block AttnRes tiled form (tile 4): overflow and error vs the fp64 definition",
        operating_point=(("sources", 9),),
        operating_label="K3 (at most 9 sources: 8 stored blocks and the partial sum)",
    ),
    frontier_axes=lambda cells: {"logit_scale": list(dict.fromkeys(c["logit_scale"] for c in cells)),
                                 "sources": list(dict.fromkeys(c["sources"] for c in cells))},
    fixed=("implementation", "stream_dtype", "logit_dtype", "variant"),
    meta=_map_meta,
    # Registered kernels run beside ours at every point, one panel per parameter set (panel row:
    # their dtype, which is their stream).
    registered_keys=lambda impl: {"dtype": impl.dtype, "tile": impl.params.get("tile", TILE)},
)


register(
    ModuleEntry(
        name="attnres",
        title="Block AttnRes",
        make_cases=lambda seed: cases_from(samples.make_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"h": ("t", "d"), "blocks": ("n", "t", "d")},
        error_samples=_error_samples,
        call=call,
        overflow_map=MAP,
        golden_cases=lambda seed: cases_from(samples.golden_cases(seed)),
        input_types=(attnres.Schedule, attnres.AttnResWeights, attnres.StandInSublayers),
        # One thread, as the map runs: the walk's tensors are tiny, and its last digits then do
        # not depend on the host's thread count.
        studies={studies.DEPTH_DRIFT_FILE: one_thread()(_depth_drift)},
        strategy=samples.strategy,
        sharded=ShardedForm("k3verify.attnres.sharded", ("h",), position_axis=0,
                            gather=lambda ranks: {"h": replicated(ranks, "h")}),
    )
)

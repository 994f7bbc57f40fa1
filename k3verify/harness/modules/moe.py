"""Registry entry for Stable LatentMoE: named outputs ``y`` (the layer output) and ``experts``
(each token's routed expert set), the implementations, the overflow map and the routing-flips
study, declared; inputs come from :mod:`k3verify.moe.samples`.

Routing is discontinuous: a form that picks another expert for a near-tied token is off by O(1)
on that token. Every form routes with the fp32 router of docs/model.md §4 on the layer input as given (operand
rounding never reaches it), so a low-precision row can differ from the fp64 oracle's choices
only where fp32 rounding of the logits crosses a top-k boundary; each case records the smallest
top-k gap of its biased scores and whether fp32 and fp64 choose alike (they do on every built-in
case). ``experts`` makes a changed choice a verdict of its own; what bf16 logits would change is
measured apart (:func:`k3verify.moe.studies.routing_flips`, ``moe_routing_flips.json``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ... import moe
from ...adapters import tokenspeed, torch_grouped_mm
from ...moe import kernels, samples, studies
from ...numerics import compute_dtype, dtype_name, resolve_dtype, rule_for
from ..environment import one_thread
from ..guard import checked_call
from ..overflow_map import MapDefinition, MapOptions, MapSpec, SweptForm, agreement
from ..registry import (
    BASELINE_RULE,
    Case,
    Implementation,
    ModuleEntry,
    Outputs,
    Peer,
    Prediction,
    ShardedForm,
    as_outputs,
    cases_from,
    listed,
    register,
    unavailable_as,
)
from ..tp_rows import replicated

OUTPUTS = ("y", "experts")
TILING = dict(tile_m=16, tile_k=16)
ALL_CASES = ("default", "decode", "skewed", "scaled", "scaled_swiglu")


def expert_sets(indices: torch.Tensor) -> torch.Tensor:
    """Each token's selected experts ``[T, k]`` as int64 sorted ascending, so that two
    implementations choosing the same set in another order agree."""
    return indices.to(torch.int64).sort(-1).values


def call(fn: Callable[..., Any], case: Case, dtype: torch.dtype, *, router_dtype: torch.dtype | None = None,
         kernel_routes: bool = False, **options: Any) -> Outputs:
    """``fn(x, weights, config, *, routing, **options)`` on the case's inputs cast to ``dtype``:
    ``{"y": [T, d], "experts": [T, k] int64}``.

    The routing is made first, by the router of docs/model.md §4 in ``router_dtype`` (default: the forms' rule,
    fp64 for fp64 operands and fp32 otherwise, the operands being ``options["operand_dtype"]``
    when given, else ``dtype``), and passed in, so ``experts`` are the choices ``y`` was computed
    with. A function that returns its own ``experts`` (``(y, experts)`` or a dict) reports those.

    The router reads the case's inputs as given, like the forms and the baseline (operand
    rounding never reaches it): a bf16 call would otherwise route on bf16 router weights, which
    changes a near-tied token's experts (one token of ``default``) where the baseline does not.
    For fp64 and fp32 inputs (every built-in row) this is the routing the form makes itself, bit
    for bit: the router casts to ``router_dtype`` first.

    A case whose inputs hold a ``routing`` (a :class:`~k3verify.moe.Routing`: a decoder walk's
    MoE call, whose choices are pinned to the fp64 run's, docs/decoder.md) passes that one in
    instead: the stack decided which experts each token meets, the function computes them.

    With ``kernel_routes`` the function routes itself (the router GEMM, the balancing bias in the
    selection and the renormalised weights are then its own): it is called without ``routing``
    and must return ``(y, experts)``; its experts are judged by their mismatch with the oracle's.
    """
    given = case.inputs
    x, w, cfg = given["x"].to(dtype), given["weights"].to(dtype), given["config"]
    if kernel_routes:
        result = checked_call(fn, (x, w, cfg), ("x", "weights", "config"), options)
        out = as_outputs(result, OUTPUTS, getattr(fn, "__name__", repr(fn)))
        if "experts" not in out:
            raise TypeError("a MoE function that routes itself (kernel_routes=True) returns (y, experts)")
        return {"y": out["y"], "experts": expert_sets(out["experts"])}
    if router_dtype is None:
        router_dtype = compute_dtype(resolve_dtype(options.get("operand_dtype", dtype)))
    routing = given.get("routing")
    if routing is None:
        routing = moe.routing_for(given["x"], given["weights"], cfg, None, router_dtype)
    result = checked_call(fn, (x, w, cfg), ("x", "weights", "config"), dict(routing=routing, **options),
                          returnable=("routing",))
    out = as_outputs(result, OUTPUTS, getattr(fn, "__name__", repr(fn)))
    return {"y": out["y"], "experts": expert_sets(out.get("experts", routing.indices))}


def oracle(case: Case) -> Outputs:
    """The recurrent definition in fp64, routed in fp64."""
    return call(moe.recurrent, case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The definition with every stored tensor in ``dtype``, routed by its own FP32 router (fp64
    for ``dtype=fp64``).

    ``family`` is ``"recurrent"`` or, for fp8 rows, ``"recurrent/<fp8_scaling>"``: the baseline
    quantises its fp8 operands exactly as the row's kernel does (the same quantiser).
    """
    form, _, scaling = family.partition("/")
    if form != "recurrent":
        raise ValueError(f"MoE baselines are the recurrent definition, got family {family!r}")
    naive = partial(moe.naive_baseline, dtype=dtype, fp8_scaling=scaling or "per_row")
    return call(naive, case, torch.float64, router_dtype=compute_dtype(resolve_dtype(dtype)))


def _inputs(case: Case) -> list[Any]:
    return [case.inputs[n] for n in samples.INPUT_NAMES]


def _quantities(case: Case) -> moe.OverflowQuantities:
    if "quantities" not in case.cache:
        case.cache["quantities"] = moe.overflow_quantities(*_inputs(case))
    return case.cache["quantities"]


def _predict(case: Case, **tiling: Any) -> Prediction:
    return Prediction.of(moe.predict(_quantities(case), **tiling))


def _explain(case: Case, **tiling: Any) -> list[str]:
    return moe.explain_overflow(*_inputs(case), **tiling)[:3]


def _form(form: str, dtype: str, cases: tuple[str, ...] = ALL_CASES, **extra: Any) -> Implementation:
    """One of our own forms: ``tiled`` on fp64 inputs with operands rounded to ``dtype`` (an fp64
    run is the exact tile algebra), or a reference form run on inputs in ``dtype``."""
    tiled = form == "tiled"
    options = dict(TILING, operand_dtype=dtype) | extra if tiled else {}
    scaling = options.get("fp8_scaling", "per_row")
    return Implementation(
        module="moe", implementation="k3verify", form=form, dtype=dtype,
        params={k: v for k, v in options.items() if k != "operand_dtype"},
        rule=rule_for(dtype),
        run=partial(call, getattr(moe, form), dtype=torch.float64 if tiled else resolve_dtype(dtype), **options),
        predict=partial(_predict, **options) if tiled and dtype != "fp64" else None,
        explain=partial(_explain, **options) if tiled else None,
        cases=cases, baseline=f"recurrent/{scaling}" if dtype == "fp8_e4m3" else "recurrent",
    )


def routed_by_kernel(x: torch.Tensor, weights: moe.MoEWeights, config: moe.MoEConfig, *,
                     routing: moe.Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The definition on the router kernel's own choices (the ``routing`` passed in is not
    used): ``(y, experts)``, so both the kernel's expert sets and what they do to ``y`` are judged."""
    r = kernels.route(x, weights.w_router, weights.bias, config)
    r = moe.Routing(r.indices.cpu(), r.weights.cpu())
    return moe.recurrent(x, weights, config, routing=r), r.indices


def _router_kernel() -> Implementation:
    """Our Triton router (fp32, wherever Triton runs), held like the fp32 forms: its expert sets
    by the mismatch rule, ``y`` by the baseline rule."""
    return Implementation(
        module="moe", implementation="k3verify", form="kernel:router", dtype="fp32", params={},
        rule=BASELINE_RULE, run=partial(call, routed_by_kernel, dtype=torch.float32), cases=ALL_CASES,
        is_available=unavailable_as(kernels.unavailable_reason),
    )  # fmt: skip


def _grouped_kernel(dtype: str, cases: tuple[str, ...] = ALL_CASES) -> Implementation:
    """The layer with our grouped expert kernels (SiTU fused into the first): fp32 and fp16
    wherever Triton runs (the interpreter is faithful there), bf16 on a CUDA device; held to the
    plain definition storing the same dtype."""
    return Implementation(
        module="moe", implementation="k3verify", form="kernel:grouped", dtype=dtype, params={},
        rule=BASELINE_RULE, run=partial(call, kernels.grouped, dtype=resolve_dtype(dtype)), cases=cases,
        is_available=unavailable_as(partial(kernels.experts_unavailable_reason, dtype)),
        # `run --time` sets the bf16 kernel's speed beside torch's CUTLASS grouped GEMMs
        peer=Peer("torch _grouped_mm", "kernel:grouped") if dtype == "bf16" else None,
    )  # fmt: skip


def _torch_grouped_mm() -> Implementation:
    """torch's ``_grouped_mm`` (CUTLASS on a GPU) for the expert GEMMs in bf16, SiTU between
    them (:mod:`k3verify.adapters.torch_grouped_mm`)."""
    return Implementation(
        module="moe", implementation="torch _grouped_mm", form="kernel:grouped", dtype="bf16", params={},
        source=f"adapter: torch {torch.__version__}", rule=BASELINE_RULE,
        run=partial(call, torch_grouped_mm.grouped, dtype=torch.bfloat16), cases=ALL_CASES,
        is_available=unavailable_as(torch_grouped_mm.unavailable_reason),
    )  # fmt: skip


def _deep_gemm() -> Implementation:
    """DeepGEMM's grouped bf16 expert GEMMs (``tokenspeed-deepgemm``), the production peer of
    ``kernel:grouped``: a row that says why it does not run (:mod:`k3verify.adapters.tokenspeed`)."""
    return listed("moe", tokenspeed.WHEELS["tokenspeed-deepgemm"].name, "kernel:grouped", "bf16",
                  partial(tokenspeed.unavailable_reason, "tokenspeed-deepgemm"), ALL_CASES)


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies for Stable LatentMoE."""
    return [
        _form("chunkwise", "fp64"),
        _form("tiled", "fp64"),
        _form("tiled", "fp64", ("default", "skewed"), tile_m=1, tile_k=7),  # one-row tiles, a partial last K step
        _form("recurrent", "fp32"),
        _form("chunkwise", "fp32"),
        _form("tiled", "bf16"),
        _form("tiled", "fp16"),  # scaled_swiglu: SwiGLU's hidden passes 65504 — predicted and observed overflow
        _form("tiled", "fp8_e4m3", ("default", "skewed", "scaled", "scaled_swiglu")),
        _form("tiled", "fp8_e4m3", ("default",), fp8_scaling="per_tensor"),
        # A static activation scale of 1: fine at unit inputs; x × 2^8 passes 448 (expected overflow).
        _form("tiled", "fp8_e4m3", ("default", "scaled"), fp8_scaling="static"),
        _router_kernel(),
        _grouped_kernel("fp32"),
        _grouped_kernel("bf16"),
        # fp16: not on scaled_swiglu, whose SwiGLU hidden passes 65504 (the tiled fp16 row
        # predicts and shows that overflow).
        _grouped_kernel("fp16", ("default", "decode", "skewed", "scaled")),
        _torch_grouped_mm(),
        _deep_gemm(),
    ]


# --- overflow map ---------------------------------------------------------------------

# (label, operand dtype, fp8 scaling); the label is the panel row.
MAP_SETTINGS = (
    ("fp16", "fp16", "per_row"),
    ("bf16", "bf16", "per_row"),
    ("fp8_e4m3 static", "fp8_e4m3", "static"),
    ("fp8_e4m3 per_row", "fp8_e4m3", "per_row"),
)
MAP_ACTIVATIONS = ("situ", "swiglu")


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    grid = list(options.x_values) if options.x_values is not None else samples.log2_scale_grid(options.quick)
    return [{"input": kind, "activation": act, "log2_input_scale": e, "input_scale": 2.0**e}
            for kind, e, act in itertools.product(samples.MAP_INPUTS, grid, MAP_ACTIVATIONS)]


def _map_case(point: dict[str, Any], seed: int) -> Case:
    """The point's inputs, routed once by the fp64 oracle's router: every cell uses those choices,
    so its error measures the arithmetic, not a near-tie."""
    # One intra-op thread: tiny tensors, and two threads spin-wait on shared cores (about 8 ms
    # per cell with one thread, 100 ms with two).
    with one_thread():
        inputs, params = samples.map_inputs(point["input"], point["log2_input_scale"], point["activation"], seed)
        case = Case(point["input"], inputs, params)
        routing = moe.routing_for(*_inputs(case), None, torch.float64)
        case.cache["routing"] = routing
        case.cache["quantities"] = moe.overflow_quantities(*_inputs(case), routing=routing)
    return case


def _traced(case: Case, **tiling: Any) -> tuple[torch.Tensor, list[str]]:
    with one_thread():
        y, events = moe.tiled_traced(*_inputs(case), routing=case.cache["routing"], **TILING, **tiling)
    return y, [e.describe() for e in events[:1]]


def _map_forms(options: MapOptions) -> list[SweptForm]:
    forms = []
    for label, dtype, scaling in MAP_SETTINGS:
        tiling = dict(operand_dtype=dtype, fp8_scaling=scaling)
        params = {"setting": label, "dtype": dtype, "fp8_scaling": scaling if dtype.startswith("fp8") else None,
                  "tile": TILING["tile_m"], "tile_k": TILING["tile_k"]}
        output_dtype = dtype_name(moe.FormOptions(operand_dtype=dtype).output_dtype)
        forms.append(SweptForm("k3verify tiled", params, output_dtype, run=partial(_traced, **tiling),
                               predict=lambda case, t=tiling: moe.predict(case.cache["quantities"], **t)))
    return forms


def frontier_summary(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (setting, input, activation): the smallest log2 scale whose output is non-finite
    (observed and predicted) and the smallest with a zeroed routed output (predicted); None if none."""
    out: dict[str, dict[str, Any]] = {}
    for c in sorted(cells, key=lambda c: c["log2_input_scale"]):
        key = f"{c['setting']} | {c['input']} | {c['activation']}"
        entry = out.setdefault(key, {"first_nonfinite": None, "first_predicted_nonfinite": None,
                                     "first_predicted_zeroed": None})
        for field, hit in (("first_nonfinite", not c["finite"]),
                           ("first_predicted_nonfinite", not c["predicted_finite"]),
                           ("first_predicted_zeroed", c.get("predicted_zeroed", False))):
            if hit and entry[field] is None:
                entry[field] = c["log2_input_scale"]
    return out


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(samples.MAP_CONFIG),
        "tokens": samples.MAP_TOKENS,
        "tiling": TILING,
        "log2_input_scale": list(dict.fromkeys(c["log2_input_scale"] for c in cells)),
        "settings": {label: {"operand_dtype": d, "fp8_scaling": s if d.startswith("fp8") else None}
                     for label, d, s in MAP_SETTINGS},
        "inputs": {"gaussian": "x ~ N(0, 1) per entry, times 2^scale",
                   "outlier": f"the same with {samples.OUTLIER_CHANNELS} channels x {samples.OUTLIER_SIZE:g}, "
                              "times 2^scale"},
        "routing": "every cell uses the fp64 oracle's routing at its own scale; bias from Quantile Balancing",
        "prediction": "finite iff every stored tensor fits its dtype (exact fp64 magnitudes): x, z, the hidden "
                      "act(g, u) and the normalised latent in the operand dtype (fp8 static: |x|/scale < 448; "
                      "fp8 dynamic scales cannot overflow), g, u and sums in fp32, expert outputs, u, y_r, y_s, y in "
                      "the output dtype. predicted_zeroed: some token's Σu² overflows fp32, so RMSNorm returns 0.",
        "situ": "|SiTU| <= 100 for every input: the hidden never overflows fp16, bf16 or fp8 e4m3 (448); each "
                "expert output is bounded by 100 max‖W2[:, c]‖₁ (situ_bound, ln units) whatever the input",
        "agreement": {
            **{a: agreement(cells, only=lambda c, a=a: c["activation"] == a) for a in MAP_ACTIVATIONS},
            **{s: agreement(cells, only=lambda c, s=s: c["setting"] == s) for s, _, _ in MAP_SETTINGS},
        },
        "frontier": frontier_summary(cells),
    }


MAP = MapDefinition(
    points=_map_points,
    make_case=_map_case,
    reference=lambda case: case.cache["quantities"].oracle,  # y in fp64 with the same routing
    forms=_map_forms,
    spec=MapSpec(
        x="log2_input_scale",
        y="activation",
        panel_row="setting",
        panel_col="input",
        figure="module",
        x_label="log2 input scale",
        y_label="activation",
        title="Stable LatentMoE tiled form: overflow and error vs the fp64 oracle",
        operating_point=(("log2_input_scale", 0), ("activation", "situ")),
        operating_label="K3 (SiTU at the layer's own input scale)",
    ),
    frontier_axes=lambda cells: {"log2_input_scale": list(dict.fromkeys(c["log2_input_scale"] for c in cells))},
    fixed=("setting", "activation", "input"),
    meta=_map_meta,
    # Registered kernels run on the gaussian input, one panel per parameter set beside ours
    # (panel row: their dtype); they route themselves.
    registered_on=lambda point: point["input"] == "gaussian",
    registered_keys=lambda impl: {"module": "moe", "dtype": impl.dtype,
                                  "tile": impl.params.get("tile_m", TILING["tile_m"])},
)


register(
    ModuleEntry(
        name="moe",
        title="Stable LatentMoE",
        make_cases=lambda seed: cases_from(samples.make_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"y": ("t", "d"), "experts": ("t", "k")},
        call=call,
        overflow_map=MAP,
        position_axis=0,  # y:[T, d]; tokens are independent, so a routing flip shows as one bad position
        input_types=(moe.MoEConfig, moe.MoEWeights, moe.Routing),
        studies={"moe_routing_flips.json": lambda seed, quick: studies.routing_flips(
            seed, exponents=samples.log2_scale_grid(quick=quick),
            tokens=studies.QUICK_FLIP_TOKENS if quick else studies.FLIP_TOKENS)},
        strategy=samples.strategy,
        sharded=ShardedForm("k3verify.moe.sharded", ("y",), position_axis=0,
                            gather=lambda ranks: {"y": replicated(ranks, "y")}),
    )
)

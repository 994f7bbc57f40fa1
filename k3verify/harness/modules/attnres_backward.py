"""Registry entry for Block AttnRes's backward pass on one call (rows say ``direction:
backward``): the gradients of ``L = sum(h * dh)`` with respect to the sources, the pseudo-query
``w`` and the key gain ``γ``, for a cotangent ``dh`` that each case holds, judged against
autograd through the fp64 definition; same-dtype baselines are autograd through the naive
definition, whose stored tensors and gradients are rounded to the dtype."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ...adapters import flash_attn_res
from ...attnres import aggregate, naive_baseline, samples
from ...attnres.chunkwise import GRADIENTS, aggregate_backward
from ...attnres.recurrent import term_sizes
from ...attnres.tiled import (
    BackwardOverflowQuantities,
    aggregate_backward_traced,
    backward_overflow_quantities,
    predict_backward,
)
from ...numerics import resolve_dtype, rule_for
from ...numerics.gradients import vjp
from ..environment import one_thread
from ..guard import checked_call, gradients_by_name
from ..overflow_map import MapOptions, SweptForm, agreement, backward_map, flat
from ..registry import (
    Case,
    ErrorSamples,
    Implementation,
    ModuleEntry,
    Outputs,
    cases_from,
    default_error_samples,
    register,
    unavailable_as,
)
from . import attnres as attnres_entry

OUTPUTS = GRADIENTS
ARGS = ("sources", "w", "gamma")
# K3's largest source set with moderate logits, and with logits past ln(max fp32) (a near
# one-hot softmax over depth: every weight but one underflows).
CASES = ("sources", "hot")


def cotangent(inputs: Mapping[str, Any], seed: int) -> torch.Tensor:
    """``dh:[T, d]`` drawn standard normal in fp64 from the case's seed."""
    gen = torch.Generator().manual_seed(30_011 + seed)
    return torch.randn(*inputs["sources"].shape[1:], generator=gen, dtype=torch.float64)


def with_cotangent(sample: samples.Sample) -> samples.Sample:
    """An aggregation sample (``sources, w, gamma``) with its backward's cotangent ``dh`` among the
    inputs, drawn from its seed."""
    inputs, params = sample
    return dict(inputs, dh=cotangent(inputs, params.get("seed", 0))), dict(params, loss="sum(h*dh)")


def _cases(seed: int) -> dict[str, samples.Sample]:
    made = samples.make_cases(seed)
    return {name: with_cotangent(made[name]) for name in CASES}


# The drawn problems are one call's aggregations (the backward has no walk), of width 2 and up. At
# width 1 RMSNorm leaves a key only its sign: once a token's sources share one, dw and dγ are the
# ε-residue of sums that cancel to 1e-5 to 1e-6 of their terms, and the fp64 oracle itself is off
# by up to 1.6e-10 of the exact value there (docs/sensitivity.md): fp64-agreement cannot judge it.
DRAWN_WIDTHS = (2, 3, 8, 16)


# The goldens hold the two cases at a narrower shape: K3's nine sources over 8 tokens of width 64
# (at the run's width of 256 and 32 tokens the sources and their gradients take 2.5 MB in fp64).
GOLDEN_SHAPE = dict(N=9, T=8, d=64)


def _golden_cases(seed: int) -> dict[str, samples.Sample]:
    made = {name: samples.aggregation_sample(**GOLDEN_SHAPE, logit_scale=scale, seed=seed)
            for name, scale in (("sources", samples.DEFAULT_LOGIT_SCALE), ("hot", samples.HOT_LOGIT_SCALE))}
    return {name: (dict(x, dh=cotangent(x, seed)), dict(params, loss="sum(h*dh)"))
            for name, (x, params) in made.items()}


def call(fn: Callable, case: Case, dtype: torch.dtype, **options: Any) -> Outputs:
    """``fn(sources, w, gamma, *, dh, ...) -> {dsources, dw, dgamma}`` on the case's inputs in ``dtype``."""
    x = case.inputs
    result = checked_call(fn, [x[n].to(dtype) for n in ARGS], ARGS, dict(dh=x["dh"].to(dtype), **options))
    return gradients_by_name(result, "an AttnRes", OUTPUTS)


def autograd_backward(form: Callable[..., torch.Tensor], sources: torch.Tensor, w: torch.Tensor,
                      gamma: torch.Tensor, *, dh: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(h * dh)`` through a differentiable aggregation ``form``."""
    return vjp(lambda sources, w, gamma: {"h": form(sources, w, gamma, **options)},
               dict(sources=sources, w=w, gamma=gamma), {"h": dh})


def oracle(case: Case) -> Outputs:
    """Autograd through the definition in fp64."""
    return call(partial(autograd_backward, aggregate), case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """Autograd through the naive definition in ``dtype`` (one baseline family)."""
    if family != "recurrent":
        raise ValueError(f"Block AttnRes's backward has one baseline family, 'recurrent'; got {family!r}")
    return call(partial(autograd_backward, partial(naive_baseline, dtype=dtype)), case, torch.float64)


def _own(form: str, fn: Callable, dtype: str, run_dtype: str, **options: Any) -> Implementation:
    return Implementation(
        module="attnres_backward", implementation="k3verify", form=form, dtype=dtype, params=options,
        rule=rule_for(dtype), run=partial(call, fn, dtype=resolve_dtype(run_dtype), **options), cases=CASES,
        baseline="recurrent",
    )


def own_implementations() -> list[Implementation]:
    """The hand-written two-phase backward in fp64, fp32 and with a bf16 stream; autograd through
    the definition in fp32; flash-attn-res's backward kernels on a CUDA device."""
    return [
        _own("chunkwise", aggregate_backward, "fp64", "fp64"),
        _own("chunkwise", aggregate_backward, "fp32", "fp32"),
        _own("chunkwise", aggregate_backward, "bf16", "fp64", stream_dtype="bf16"),
        _own("recurrent (autograd)", partial(autograd_backward, aggregate), "fp32", "fp32"),
        _flash_attn_res(),
    ]


def _flash_attn_res() -> Implementation:
    """flash-attn-res's two ops under autograd (each registers its own Triton backward kernel:
    phase 1's over the stored blocks, phase 2's merge), given ``w ⊙ γ`` as its queries in fp32, so
    ``dw`` and ``dγ`` come from its query gradient through that product; bf16 inputs, CUDA only."""
    name = f"flash-attn-res {flash_attn_res.version() or '(missing)'}"
    return Implementation(
        module="attnres_backward", implementation=name, form="kernel:two_phase (autograd)", dtype="bf16",
        params={}, rule=rule_for("bf16"), run=partial(call, partial(autograd_backward, flash_attn_res.aggregate),
                                                      dtype=torch.bfloat16),
        cases=CASES, baseline="recurrent", source=f"adapter: {name}",
        is_available=unavailable_as(flash_attn_res.unavailable_reason),
    )


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """``dw`` and ``dγ`` sum every token's and source's logit gradient ``dℓ`` times a key, and their
    rounding errors are dominated by a few large ``dℓ`` (the softmax weights span orders of
    magnitude): far fewer independent errors than components. Measured over 30 seeds at 9
    sources, 32 tokens, width 256, fp32: the ratio of the ``dγ`` errors of two correct forms (the
    two-phase backward and autograd through the definition; four formulations of the backward
    alike) reached 2.7 to 5.1, past the factor of 32 independent errors (2.45). They are counted
    as the ``N`` sources (9: factor 7.3), and never as more than their ``d`` elements: an RMS over
    ``d`` values compares ``d`` errors however many roundings each sums (at ``d = 1`` and 5 sources
    the fp32 two-phase ``dw`` measured 27x a baseline error of 8.4e-4, where 5 errors allow 22x and
    one allows 6.4e5x).

    ``dsources`` row ``(n, t)`` is ``α dh + (g − v̂ (v̂·g) / d) / r`` with ``g = dℓ (w ⊙ γ)``: the
    roundings of its two scalars ``α`` and ``dℓ`` move the whole row, and rows carry unequal
    shares (the weights span orders of magnitude), so the RMS term counts half its ``N · T`` rows,
    and at least two (each row rounds two scalars of its own); the bias keeps the default, the
    rows; and both are capped by what the errors are worth (``spread``: Kish's number of both forms'
    errors pooled), for a problem whose weight sits on a few rows. One source is the exception: its
    weight is exactly 1 and ``dℓ`` exactly 0, so ``dsources = dh`` holds one rounding per element.

    Measured over 60 drawn problems times 60 seeds (three correct forms, fp32 and bf16: 10,800
    verdicts): every element as an error failed 87 (one source-token row of 16 elements: 3.5x the
    limit), the rows 2 (1.19x), half of them none (0.73x); on 192 drawn cases the effective rows
    ``(Σ E)² / Σ E²`` of the fp32 two-phase form's error energy ``E`` per row were a median 0.43 of
    the rows (5 % under 0.14). On 7,200 more (other problems and seeds) half the rows failed 1
    (1.15x: 10 sources over 3 tokens at logit scale 32, the errors worth 5 of the 15 counted),
    capped by their worth none (0.73x), and a 1 % error in ``dsources`` was still caught at fp32 on
    all but 0.3 % of them. K3's 288 rows keep the factor 2."""
    if output in ("dw", "dgamma"):
        n = min(params["N"], shape[-1])
        return ErrorSamples(n, n)
    default = default_error_samples(shape)
    if shape[0] == 1:
        return default
    rows = max(2, -(-math.prod(shape[:-1]) // 2))
    return ErrorSamples(min(default.rms, rows), default.bias, spread=True)



def _term_sizes(output: str, case: Case, ref: Mapping[str, Any]) -> torch.Tensor | None:
    """``dw`` and ``dγ``'s terms' sizes (:func:`k3verify.attnres.recurrent.term_sizes`, fp64), for
    fp64 agreement; None for ``dsources``."""
    if output not in ("dw", "dgamma"):
        return None
    if "term_sizes" not in case.cache:
        x = case.inputs
        case.cache["term_sizes"] = term_sizes(*(x[n].to(torch.float64) for n in (*ARGS, "dh")))
    return case.cache["term_sizes"][output]


# --- overflow map -----------------------------------------------------------------------

# The forward map's points (logit scale, number of sources) with ``dh`` standard normal times
# 2^upstream (fla-core's overflow tests scale the upstream gradient likewise); the two-phase
# backward with an fp16, bf16 or fp32 stream.
MAP_STREAMS = ("fp16", "bf16", "fp32")
MAP_UPSTREAM = (0, 4, 8, 10, 12, 14, 16)  # log2 of the scale of dh
QUICK_UPSTREAM = (0, 12, 16)


def _map_points(options: MapOptions) -> list[dict[str, Any]]:
    return [dict(point, log2_upstream=u) for point in attnres_entry.MAP.points(options)
            for u in (QUICK_UPSTREAM if options.quick else MAP_UPSTREAM)]


def _map_case(point: dict[str, Any], seed: int) -> Case:
    case = attnres_entry.MAP.make_case(point, seed)
    case.inputs["dh"] = cotangent(case.inputs, seed) * 2.0 ** point["log2_upstream"]
    case.params["log2_upstream"] = point["log2_upstream"]
    return case


def _quantities(case: Case, stream: str) -> BackwardOverflowQuantities:
    key = f"backward:{stream}"
    if key not in case.cache:
        with one_thread():
            case.cache[key] = backward_overflow_quantities(*(case.inputs[n] for n in ARGS), dh=case.inputs["dh"],
                                                           stream_dtype=stream)
    return case.cache[key]


def _map_run(case: Case, stream: str) -> tuple[torch.Tensor, list[str]]:
    with one_thread():
        grads, events = aggregate_backward_traced(*(case.inputs[n] for n in ARGS), dh=case.inputs["dh"],
                                                  stream_dtype=stream)
    return flat(grads, OUTPUTS), [e.describe() for e in events[:1]]


def _map_forms(options: MapOptions) -> list[SweptForm]:
    return [SweptForm("k3verify two-phase backward", {"dtype": stream, "stream_dtype": stream, "logit_dtype": "fp32",
                                                      "variant": "subtract_max", "tile": "-"},
                      stream, run=partial(_map_run, stream=stream),
                      predict=lambda case, s=stream: predict_backward(_quantities(case, s), stream_dtype=s))
            for stream in MAP_STREAMS]


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    return {
        "logit_scales": sorted({c["logit_scale"] for c in cells}),
        "sources": sorted({c["sources"] for c in cells}),
        "log2_upstream": sorted({c["log2_upstream"] for c in cells}),
        "streams": list(MAP_STREAMS),
        "gradients": list(OUTPUTS),
        "upstream": "dh ~ N(0, 1) per entry times 2^log2_upstream",
        "prediction": "finite iff the forward's checks hold (with max subtraction: the backward's weights are "
                      "e^(l - M) / Z') and every tensor the backward stores fits its dtype (exact fp64 magnitudes "
                      "of the inputs as the stream holds them, from one pass): the inputs, h, dh and dsources the "
                      "stream dtype, dw and dgamma fp32 (attnres.tiled.predict_backward)",
        "agreement": {
            **{s: agreement(cells, only=lambda c, s=s: c["stream_dtype"] == s) for s in MAP_STREAMS},
            **{f"dh x 2^{u}": agreement(cells, only=lambda c, u=u: c["log2_upstream"] == u)
               for u in sorted({c["log2_upstream"] for c in cells})},
        },
    }


MAP = backward_map(
    attnres_entry.MAP,
    title="Block AttnRes two-phase backward: overflow and error of the gradients vs the fp64 oracle",
    points=_map_points,
    make_case=_map_case,
    reference=lambda case: flat(_quantities(case, "fp64").gradients, OUTPUTS),
    forms=_map_forms,
    meta=_map_meta,
    fixed=(*attnres_entry.MAP.fixed, "log2_upstream"),
    panel_col="log2_upstream",
)


register(
    ModuleEntry(
        name="attnres_backward",
        title="Block AttnRes, backward (one call)",
        direction="backward",
        make_cases=lambda seed: cases_from(_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        baseline_families=("recurrent",),
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"dsources": ("n", "t", "d"), "dw": ("d",), "dgamma": ("d",)},
        call=call,
        golden_cases=lambda seed: cases_from(_golden_cases(seed)),
        position_axis=1,  # dsources: [N, T, d]
        from_forward=lambda forward: partial(autograd_backward, forward),
        cotangent="dh",
        error_samples=_error_samples,
        overflow_map=MAP,
        term_sizes=_term_sizes,
        strategy=lambda: samples.aggregations(widths=DRAWN_WIDTHS).map(lambda a: with_cotangent(a.sample)),
    )
)

"""Registry entry for Stable LatentMoE's backward pass (rows say ``direction: backward``): the
gradients of ``L = sum(y * dy)`` with respect to ``x`` and every weight but the balancing bias,
for a cotangent ``dy`` that each case holds, judged against autograd through the fp64 definition;
same-dtype baselines are autograd through the naive definition, whose stored tensors and
gradients are rounded to the dtype.

The selection is not differentiable: a backward follows its forward's choices (``indices``,
made by the router in the row's precision, as the forward rows route) and differentiates the
mixture weights through the router. Where the fp32 router could choose other experts than the
fp64 oracle's, the comparison would measure a choice, not arithmetic; those tokens are left out
by the gap rule (:func:`k3verify.moe.router.clear_of_ties`): their cotangent is zero, so they
add nothing to any gradient, in any form. Each case records the fraction left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import moe
from ...adapters import torch_grouped_mm
from ...moe import samples
from ...moe.chunkwise import chunkwise_backward
from ...moe.recurrent import GRADIENTS, autograd_backward, router_term_sizes
from ...moe.router import clear_of_ties
from ...moe.tiled import backward_overflow_quantities, predict_backward, tiled_backward, tiled_backward_traced
from ...numerics import compute_dtype, resolve_dtype, rule_for
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
    product_error_samples,
    register,
    unavailable_as,
)
from . import moe as moe_entry

OUTPUTS = GRADIENTS
# The built-in layer on 64 tokens; one token; every token on the same 4 experts (12 idle: their
# weights' gradients are exactly 0); inputs x 2^8, where SiTU saturates and its derivative
# vanishes (the gradient is ill-conditioned there: both the baseline and the forms lose it alike).
CASES = ("default", "decode", "skewed", "scaled")
TILING = dict(tile_m=16, tile_k=16)
# The router precision the gap rule guards: every row but the fp64 ones routes in fp32.
ROUTER_DTYPE = torch.float32


def cotangent(inputs: Mapping[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy [T, d], judged [T])``: ``dy`` drawn standard normal in fp64 from the case's seed,
    zero on the tokens the gap rule leaves out (``judged`` false)."""
    x = inputs["x"]
    gen = torch.Generator().manual_seed(40_011 + seed)
    dy = torch.randn(*x.shape, generator=gen, dtype=torch.float64)
    judged = clear_of_ties(x, inputs["weights"], inputs["config"], ROUTER_DTYPE)
    return dy * judged[:, None], judged


def with_cotangent(sample: samples.Sample) -> samples.Sample:
    """A forward sample with its backward's cotangent ``dy`` among the inputs, and in its params
    how many tokens the gap rule left out."""
    inputs, params = sample
    dy, judged = cotangent(inputs, params.get("seed", 0))
    T = int(judged.numel())
    left_out = T - int(judged.sum())
    return dict(inputs, dy=dy), dict(params, loss="sum(y*dy)", gap_left_out=left_out,
                                     gap_left_out_fraction=left_out / T if T else 0.0)


def _cases(seed: int) -> dict[str, samples.Sample]:
    made = samples.make_cases(seed)
    return {name: with_cotangent(made[name]) for name in CASES}


def call(fn: Callable, case: Case, dtype: torch.dtype, *, router_dtype: torch.dtype | None = None,
         **options: Any) -> Outputs:
    """``fn(x, weights, config, *, dy, indices, ...) -> {dx, dw_router, ...}`` on the case's inputs
    in ``dtype``; ``indices`` is the forward's selection, made on ``x`` as given by the router in
    ``router_dtype`` (default: the forms' rule, fp64 for fp64 operands and fp32 otherwise, the
    operands being ``options["operand_dtype"]`` when given, else ``dtype``)."""
    given = case.inputs
    router = router_dtype or compute_dtype(resolve_dtype(options.get("operand_dtype", dtype)))
    indices = moe.routing_for(given["x"], given["weights"], given["config"], None, router).indices
    args = (given["x"].to(dtype), given["weights"].to(dtype), given["config"])
    result = checked_call(fn, args, ("x", "weights", "config"), dict(dy=given["dy"].to(dtype), indices=indices,
                                                                      **options))
    return gradients_by_name(result, "a MoE", OUTPUTS)


def oracle(case: Case) -> Outputs:
    """Autograd through the recurrent definition in fp64 (routed in fp64)."""
    return call(partial(autograd_backward, moe.recurrent), case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """Autograd through the naive definition in ``dtype`` (every stored tensor and its gradient
    rounded), its router in fp32 (fp64 for ``dtype=fp64``) on ``x`` held in ``dtype``."""
    if family != "recurrent":
        raise ValueError(f"Stable LatentMoE's backward has one baseline family, 'recurrent'; got {family!r}")
    router = compute_dtype(resolve_dtype(dtype))
    naive = partial(moe.naive_baseline, dtype=dtype)
    return call(partial(autograd_backward, naive, router_dtype=router, input_dtype=dtype), case, torch.float64,
                router_dtype=router)


def _own(form: str, fn: Callable, dtype: str, run_dtype: str, cases: tuple[str, ...] = CASES,
         **options: Any) -> Implementation:
    return Implementation(
        module="moe_backward", implementation="k3verify", form=form, dtype=dtype, params=options,
        rule=rule_for(dtype), run=partial(call, fn, dtype=resolve_dtype(run_dtype), **options), cases=cases,
        baseline="recurrent",
    )


def own_implementations() -> list[Implementation]:
    """The hand-written backward in fp64 and fp32; the tiled backward in fp64 (a partial last K
    step of 7), bf16 and fp16; autograd through the definition in fp32; torch's ``_grouped_mm``
    under autograd (its CPU loop in fp32; CUTLASS's own backward in bf16 on a CUDA device)."""
    return [
        _own("chunkwise", chunkwise_backward, "fp64", "fp64"),
        _own("tiled", tiled_backward, "fp64", "fp64", tile_m=16, tile_k=7, operand_dtype="fp64"),
        _own("chunkwise", chunkwise_backward, "fp32", "fp32"),
        _own("tiled", tiled_backward, "bf16", "fp64", **TILING, operand_dtype="bf16"),
        _own("tiled", tiled_backward, "fp16", "fp64", **TILING, operand_dtype="fp16"),
        _own("recurrent (autograd)", partial(autograd_backward, moe.recurrent), "fp32", "fp32"),
        *(_grouped_mm(dtype) for dtype in ("fp32", "bf16")),
    ]


def _grouped_mm(dtype: str) -> Implementation:
    """torch's ``_grouped_mm`` layer (:mod:`k3verify.adapters.torch_grouped_mm`) under autograd:
    on the CPU its loop of matrix products in fp32, on a CUDA device CUTLASS's grouped GEMMs and
    their backward in bf16 (a ``kernel:`` row, judged in the GPU session)."""
    gpu = dtype == "bf16"
    return Implementation(
        module="moe_backward", implementation="torch _grouped_mm",
        form=f"{'kernel:' if gpu else ''}grouped (autograd)", dtype=dtype, params={},
        source=f"adapter: torch {torch.__version__}", rule=rule_for(dtype),
        run=partial(call, partial(autograd_backward, torch_grouped_mm.grouped), dtype=resolve_dtype(dtype)),
        cases=CASES, baseline="recurrent",
        is_available=unavailable_as(partial(torch_grouped_mm.unavailable_reason, resolve_dtype(dtype))),
    )


# --- overflow map -----------------------------------------------------------------------

# (label, operand dtype): fp8 has no backward here (its gradients take e5m2 and scales of their own).
MAP_SETTINGS = (("fp16", "fp16"), ("bf16", "bf16"))


def _map_case(point: dict[str, Any], seed: int) -> Case:
    """The forward map's inputs at the point, a standard normal ``dy``, and the fp64 oracle's
    selection, which every cell's backward follows (its error measures the arithmetic)."""
    with one_thread():
        inputs, params = samples.map_inputs(point["input"], point["log2_input_scale"], point["activation"], seed)
        x = inputs["x"]
        inputs["dy"] = torch.randn(*x.shape, generator=torch.Generator().manual_seed(40_011 + seed),
                                   dtype=torch.float64)
        indices = moe.routing_for(x, inputs["weights"], inputs["config"], None, torch.float64).indices
        case = Case(point["input"], inputs, params)
        case.cache["indices"] = indices
        case.cache["quantities"] = backward_overflow_quantities(*_map_args(case), dy=inputs["dy"], indices=indices)
    return case


def _map_args(case: Case) -> tuple[Any, ...]:
    return tuple(case.inputs[n] for n in samples.INPUT_NAMES)


def _map_run(case: Case, **tiling: Any) -> tuple[torch.Tensor, list[str]]:
    with one_thread():
        grads, events = tiled_backward_traced(*_map_args(case), dy=case.inputs["dy"], indices=case.cache["indices"],
                                              **TILING, **tiling)
    return flat(grads, OUTPUTS), [e.describe() for e in events[:1]]


def _map_forms(options: MapOptions) -> list[SweptForm]:
    return [SweptForm("k3verify tiled backward", {"setting": label, "dtype": dtype, "tile": TILING["tile_m"],
                                                  "tile_k": TILING["tile_k"]},
                      dtype, run=partial(_map_run, operand_dtype=dtype),
                      predict=lambda case, d=dtype: predict_backward(case.cache["quantities"], operand_dtype=d))
            for label, dtype in MAP_SETTINGS]


def _map_meta(cells: list[dict[str, Any]], options: MapOptions) -> dict[str, Any]:
    forward = moe_entry.MAP.meta(cells, options)
    return {
        **{k: forward[k] for k in ("config", "tokens", "tiling", "log2_input_scale", "inputs", "frontier")},
        "settings": {label: {"operand_dtype": dtype} for label, dtype in MAP_SETTINGS},
        "gradients": list(OUTPUTS),
        "upstream": "dy ~ N(0, 1) per entry, whatever the input scale",
        "routing": "every cell's backward follows the fp64 oracle's selection at its own scale",
        "prediction": "finite iff the forward's checks hold and every tensor the backward stores fits its dtype "
                      "(exact fp64 magnitudes): operands (x, z, H, the normalised latent, dy, du, dE, dG, dU, dz and "
                      "the shared ones) the operand dtype, gradients the output dtype, GEMM accumulators fp32 "
                      "(moe.tiled.predict_backward)",
        "agreement": {
            **{a: agreement(cells, only=lambda c, a=a: c["activation"] == a) for a in moe_entry.MAP_ACTIVATIONS},
            **{label: agreement(cells, only=lambda c, s=label: c["setting"] == s) for label, _ in MAP_SETTINGS},
        },
    }


MAP = backward_map(
    moe_entry.MAP,
    title="Stable LatentMoE tiled backward: overflow and error of the gradients vs the fp64 oracle",
    make_case=_map_case,
    reference=lambda case: flat(case.cache["quantities"].gradients, OUTPUTS),
    forms=_map_forms,
    meta=_map_meta,
)


GRADIENT_AXES = {
    "dx": ("t", "d"), "dw_router": ("d", "e"), "dw_latent_down": ("d", "l"), "dw1": ("e", "l", "h"),
    "dw3": ("e", "l", "h"), "dw2": ("e", "h", "l"), "dlatent_norm": ("l",), "dw_latent_up": ("l", "d"),
    "dshared_w1": ("d", "s"), "dshared_w3": ("d", "s"), "dshared_w2": ("s", "d"),
}

# The gradients downstream of the latent's (every one but the shared expert's and dx, which sums
# the shared expert's too).
LATENT_PATH = ("dw_router", "dw_latent_down", "dw1", "dw3", "dw2", "dlatent_norm", "dw_latent_up")


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """A weight's gradient sums one outer product per contributing row (a judged token; for the
    experts' weights a judged (token, expert) pair), so it holds at most ``rows (n + m)``
    independent errors (:func:`~k3verify.harness.contract.product_error_samples`), fewer than its
    elements on a few tokens, and fewer still where one factor is an input (``x``, ``dy``). The
    router's gradient ``xᵀ dr`` carries only ``dr``'s errors, ``k`` per judged token.

    Every gradient's errors are of unequal scales (``spread``): a token whose latent ``u = Σ p E``
    cancels (``|u|`` 8 times smaller than its terms on a drawn case) has its RMSNorm amplify its
    roundings into every gradient it reaches, and its few values then hold most of the error
    (bf16, 14 tokens, latent width 4: one token held 81 % of ``dx``'s error in the tiled form
    and 18 % in the baseline, its error 4.1 times the baseline's there).

    Those amplified errors enter the backward through one vector per token, the latent's gradient
    ``du`` (``Dl`` wide), which every gradient on the latent's path carries linearly
    (``LATENT_PATH``), so they hold at most ``Dl`` errors per token that counts (``spread_over``:
    Kish's number of the baseline's ``dx`` tokens, ``slice_errors = Dl``). Counted per pair
    instead, two drawn problems of 3 and 5 tokens failed at 2.42 and 2.77 times the baseline's
    error (``dw1``, ``dw_latent_down``; their tokens worth 3 and 2), where the rule allowed 2.21."""
    rows = int(params.get("T", 0)) - int(params.get("gap_left_out", 0))
    pairs = rows * int(params.get("k", 1))
    if output == "dw_router":
        default = default_error_samples(shape)
        samples = ErrorSamples(min(default.rms, pairs), min(default.bias, rows), spread=True)
    elif output in ("dw1", "dw3", "dw2"):
        samples = dataclasses.replace(product_error_samples(pairs, shape), products=True)
    elif output in ("dx", "dlatent_norm"):
        samples = dataclasses.replace(default_error_samples(shape), spread=True)
    else:
        # x (W↓'s and the shared up-projections' left factor) and dy (W↑'s and S2's right factor)
        # are inputs: every form rounds them alike.
        exact = "right" if output in ("dw_latent_up", "dshared_w2") else "left"
        samples = product_error_samples(rows, shape, exact=exact)
    if output in LATENT_PATH and "Dl" in params:
        samples = dataclasses.replace(samples, spread_over=("dx", 0), slice_errors=int(params["Dl"]))
    return samples


def _term_sizes(output: str, case: Case, ref: Mapping[str, Any]) -> torch.Tensor | None:
    """``dw_router``'s terms' sizes (:func:`k3verify.moe.recurrent.router_term_sizes`, fp64, on
    the fp64 router's selection, as the oracle routes), for fp64 agreement; None for the rest.
    Found on a GPU host: at top-1 with ``renorm_eps`` the hand-written backward's ``dw_router``
    differed from autograd's by 5.7e-19 where its largest element is 1.4e-9 (4.1e-10 of it) and
    its terms 4.7: the latent RMSNorm leaves ``dp`` rounding alone."""
    if output != "dw_router":
        return None
    if "router_term_sizes" not in case.cache:
        x = case.inputs
        indices = moe.routing_for(x["x"], x["weights"], x["config"], None, torch.float64).indices
        case.cache["router_term_sizes"] = router_term_sizes(x["x"], x["weights"], x["config"], dy=x["dy"],
                                                            indices=indices)
    return case.cache["router_term_sizes"]


register(
    ModuleEntry(
        name="moe_backward",
        title="Stable LatentMoE, backward",
        direction="backward",
        make_cases=lambda seed: cases_from(_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        baseline_families=("recurrent",),
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes=GRADIENT_AXES,
        call=call,
        position_axis=0,  # dx: [T, d]
        input_types=(moe.MoEConfig, moe.MoEWeights, moe.Routing),
        from_forward=lambda forward: partial(autograd_backward, forward),
        cotangent="dy",
        strategy=lambda: samples.strategy().map(with_cotangent),
        error_samples=_error_samples,
        term_sizes=_term_sizes,
        overflow_map=MAP,
    )
)

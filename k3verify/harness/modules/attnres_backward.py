"""Registry entry for Block AttnRes's backward pass on one call (rows say ``direction:
backward``): the gradients of ``L = sum(h * dh)`` with respect to the sources, the pseudo-query
``w`` and the key gain ``γ``, for a cotangent ``dh`` that each case holds, judged against
autograd through the fp64 definition; same-dtype baselines are autograd through the naive
definition, whose stored tensors and gradients are rounded to the dtype."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ...attnres import aggregate, naive_baseline, samples
from ...attnres.chunkwise import GRADIENTS, aggregate_backward
from ...numerics import resolve_dtype, rule_for
from ...numerics.gradients import vjp
from ..guard import checked_call, gradients_by_name
from ..registry import (
    Case,
    ErrorSamples,
    Implementation,
    ModuleEntry,
    Outputs,
    cases_from,
    default_error_samples,
    register,
)

OUTPUTS = GRADIENTS
ARGS = ("sources", "w", "gamma")
# K3's largest source set with moderate logits, and with logits past ln(max fp32) (a near
# one-hot softmax over depth: every weight but one underflows).
CASES = ("sources", "hot")


def cotangent(inputs: Mapping[str, Any], seed: int) -> torch.Tensor:
    """``dh:[T, d]`` drawn standard normal in fp64 from the case's seed."""
    gen = torch.Generator().manual_seed(30_011 + seed)
    return torch.randn(*inputs["sources"].shape[1:], generator=gen, dtype=torch.float64)


def _cases(seed: int) -> dict[str, samples.Sample]:
    made = samples.make_cases(seed)
    return {name: (dict(made[name][0], dh=cotangent(made[name][0], seed)), dict(made[name][1], loss="sum(h*dh)"))
            for name in CASES}


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
    the definition in fp32."""
    return [
        _own("chunkwise", aggregate_backward, "fp64", "fp64"),
        _own("chunkwise", aggregate_backward, "fp32", "fp32"),
        _own("chunkwise", aggregate_backward, "bf16", "fp64", stream_dtype="bf16"),
        _own("recurrent (autograd)", partial(autograd_backward, aggregate), "fp32", "fp32"),
    ]


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """``dw`` and ``dγ`` sum every token's and source's logit gradient ``dℓ`` times a key, and their
    rounding errors are dominated by a few large ``dℓ`` (the softmax weights span orders of
    magnitude): far fewer independent errors than components. Measured over 30 seeds at 9
    sources, 32 tokens, width 256, fp32: the ratio of the ``dγ`` errors of two correct forms (the
    two-phase backward and autograd through the definition; four formulations of the backward
    alike) reached 2.7 to 5.1, past the factor of 32 independent errors (2.45). They are counted
    as the ``N`` sources (9: factor 7.3). ``dsources`` is the default: every element, rows along ``d``."""
    if output in ("dw", "dgamma"):
        return ErrorSamples(params["N"], params["N"])
    return default_error_samples(shape)


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
    )
)

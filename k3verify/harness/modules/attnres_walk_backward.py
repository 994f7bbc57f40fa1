"""Registry entry for Block AttnRes's backward over the whole depth walk (``attnres_walk_backward``,
rows say ``direction: backward``): the gradients of ``L = sum(h * dh)``, ``h`` the walk's output
after 93 layers (186 stand-in sublayers), with respect to the embedding and every call's
pseudo-query ``w``, key gain ``γ`` and sublayer-input norm gain, flowing back through the stored
block sums and the partial sum. The oracle is autograd through the recurrent walk in fp64; the
same-dtype baseline is autograd through the plain walk with every stored tensor and its gradient
rounded to the dtype (:func:`k3verify.attnres.naive_walk`). A function judged here is
``fn(embedding, weights, sublayers, *, schedule, dh) -> {dembedding, dw, dgamma, dnorm}``; a
differentiable walk (the forward's signature) is differentiated by autograd. Opt-in (4 s of CPU):
``k3verify run --modules attnres_walk_backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import attnres
from ...adapters import flash_attn_res
from ...attnres import samples
from ...attnres.recurrent import walk_term_sizes
from ...numerics import map_tensors, resolve_dtype, rule_for
from ...numerics.gradients import vjp
from ..guard import checked_call, gradients_by_name
from ..registry import Case, ErrorSamples, Implementation, ModuleEntry, Outputs, cases_from, register, unavailable_as

OUTPUTS = ("dembedding", "dw", "dgamma", "dnorm")
# K3's blocks of 12 layers, and Full AttnRes (every sublayer a block: up to 187 sources).
CASES = ("walk", "walk_full")
TILE = 4
# As the one-call backward's draws (attnres_backward.DRAWN_WIDTHS): at width 1 RMSNorm leaves a key
# its sign, and dw, dγ cancel past what fp64 agreement can judge.
DRAWN_WIDTHS = (2, 8, 16)


def cotangent(inputs: Mapping[str, Any], seed: int) -> torch.Tensor:
    """``dh:[T, d]`` drawn standard normal in fp64 from the case's seed."""
    gen = torch.Generator().manual_seed(60_011 + seed)
    return torch.randn(*inputs["embedding"].shape, generator=gen, dtype=torch.float64)


def with_cotangent(sample: samples.Sample) -> samples.Sample:
    """A walk sample with its backward's cotangent ``dh`` among the inputs."""
    inputs, params = sample
    return dict(inputs, dh=cotangent(inputs, params.get("seed", 0))), dict(params, loss="sum(h*dh)")


# The forward walk's width (64) and K3's schedules at logit scale 4, over 64 tokens (16 for Full
# AttnRes, whose fp64 oracle mixes up to 187 explicit sources a call: 6 s over 64 tokens). At the
# forward's 8 tokens and scale 16 a few tokens hold the walk's error and no count of them lets a
# bf16 row tell a lost gradient from its own error (_error_samples).
SHAPES = {"walk": dict(samples.WALK, T=64, logit_scale=4.0), "walk_full": dict(samples.WALK, T=32, logit_scale=4.0)}
SCHEDULES = {"walk": attnres.Schedule(), "walk_full": attnres.Schedule.full()}


def _cases(seed: int) -> dict[str, samples.Sample]:
    return {name: with_cotangent(samples.walk_sample(SCHEDULES[name], **SHAPES[name], seed=seed)) for name in CASES}


def autograd_backward(walk: Callable[..., Any], embedding: torch.Tensor, weights: attnres.AttnResWeights,
                      sublayers: Any, *, schedule: attnres.Schedule, dh: torch.Tensor,
                      **options: Any) -> dict[str, torch.Tensor]:
    """Gradients of ``L = sum(h * dh)`` through a differentiable ``walk`` (the forms' signature,
    returning a :class:`~k3verify.attnres.Walk`), with respect to the embedding and the weights."""

    def loss(embedding: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, norm: torch.Tensor) -> dict:
        out = walk(embedding, attnres.AttnResWeights(w, gamma, norm), sublayers, schedule=schedule, **options)
        return {"h": out.output}

    grads = vjp(loss, dict(embedding=embedding, w=weights.w, gamma=weights.gamma, norm=weights.norm), {"h": dh})
    return {name: grads[name] for name in OUTPUTS}


def call(fn: Callable, case: Case, dtype: torch.dtype | str, **options: Any) -> Outputs:
    """``fn(embedding, weights, sublayers, *, schedule, dh, ...)`` on the case's inputs in ``dtype``
    (the sublayers compute in their input's dtype)."""
    dt = resolve_dtype(dtype)
    x = case.inputs
    args = (x["embedding"].to(dt), map_tensors(x["weights"], lambda t: t.to(dt)), x["sublayers"])
    result = checked_call(fn, args, ("embedding", "weights", "sublayers"),
                          dict(schedule=x["schedule"], dh=x["dh"].to(dt), **options))
    return gradients_by_name(result, "an AttnRes walk", OUTPUTS)


def oracle(case: Case) -> Outputs:
    """Autograd through the recurrent walk in fp64."""
    return call(partial(autograd_backward, attnres.WALKS["recurrent"]), case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """Autograd through the plain walk in ``dtype`` (one family)."""
    if family != "recurrent":
        raise ValueError(f"the AttnRes walk's backward has one baseline family, 'recurrent'; got {family!r}")
    return call(partial(autograd_backward, partial(attnres.naive_walk, dtype=dtype)), case, torch.float64)


def _own(form: str, dtype: str, cases: tuple[str, ...] = CASES, **extra: Any) -> Implementation:
    """Autograd through our ``form`` of the walk with a ``dtype`` stream (inputs rounded once from fp64)."""
    fn = partial(autograd_backward, attnres.WALKS[form], stream_dtype=dtype, **extra)
    return Implementation(
        module="attnres_walk_backward", implementation="k3verify", form=f"{form} (autograd)", dtype=dtype,
        params=extra, rule=rule_for(dtype), run=partial(call, fn, dtype=torch.float64), cases=cases,
    )


def own_implementations() -> list[Implementation]:
    """Autograd through the two-phase walk in fp64, fp32 and bf16 (its stored tensors' gradients
    rounded where they are stored), the recurrent walk in fp32, and the tiled walk (tile 4) in fp64,
    fp32 and bf16; Full AttnRes (187 sources, 2 s a row for the tiled walk) for the two-phase walk
    in fp64 and bf16 only."""
    k3 = ("walk",)
    return [_own("chunkwise", "fp64"), _own("tiled", "fp64", k3, tile=TILE), _own("recurrent", "fp32", k3),
            _own("chunkwise", "fp32", k3), _own("tiled", "fp32", k3, tile=TILE), _own("chunkwise", "bf16"),
            _own("tiled", "bf16", k3, tile=TILE), _flash_attn_res()]


def _flash_attn_res() -> Implementation:
    """flash-attn-res's two ops driving the walk under autograd (their own Triton backward kernels;
    ``w ⊙ γ`` as queries in fp32), a bf16 stream on a CUDA device, on K3's blocks."""
    name = f"flash-attn-res {flash_attn_res.version() or '(missing)'}"
    return Implementation(
        module="attnres_walk_backward", implementation=name, form="kernel:two_phase (autograd)", dtype="bf16",
        params={}, rule=rule_for("bf16"), run=partial(call, partial(autograd_backward, flash_attn_res.walk),
                                                      dtype=torch.bfloat16),
        cases=("walk",), source=f"adapter: {name}", is_available=unavailable_as(flash_attn_res.unavailable_reason),
    )


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """The tokens, as the forward walk's ``h`` (docs/sensitivity.md, "Independent errors"): every
    channel of a token shares the mixing errors of every layer before it, and the gradient flowing
    back down the walk carries them to every earlier call's ``dw``, ``dγ`` and norm gain alike.
    Counted per call, Full AttnRes's 187 calls made the tiled fp32 walk's ``dw`` fail the bias term
    (6.9e-6 against 5.9e-6) where its RMS error was 0.59 of its limit.

    Capped by what the tokens' errors are worth (``spread_over``: Kish's number of the embedding
    gradient's tokens, pooled over the form and the baseline): 93 layers amplify some tokens'
    roundings far more than others', and a few tokens hold the error. Measured on K3's walk over
    16 and 64 tokens (seeds 0, 3, 24): 0.6 to 13 tokens' worth in fp32 and bf16; counting all 16,
    the two-phase fp32 walk's ``dw`` failed at 6.9 times the baseline's error at seed 24, where one
    token held it (worth 0.55)."""
    tokens = int(params.get("T", shape[0]))
    return ErrorSamples(tokens, tokens, spread_over=("dembedding", 0))


def _term_sizes(output: str, case: Case, ref: Mapping[str, Any]) -> torch.Tensor | None:
    """Every call's ``dw`` and ``dγ`` terms' sizes (:func:`k3verify.attnres.recurrent.walk_term_sizes`,
    one fp64 walk and backward per case), for fp64 agreement: at a saturated softmax a call's
    ``Σ dℓ k`` cancels to ``e^(-Δℓ)`` of its terms (drawn walks at logit scale 13 and up: 3.7e-8 to
    6.9e-8 of ``max|dw|``, 1e-16 of the terms). None for ``dembedding`` and ``dnorm``."""
    if output not in ("dw", "dgamma"):
        return None
    if "term_sizes" not in case.cache:
        x = case.inputs
        case.cache["term_sizes"] = walk_term_sizes(x["embedding"], x["weights"], x["sublayers"],
                                                   schedule=x["schedule"], dh=x["dh"])
    return case.cache["term_sizes"][output]


register(
    ModuleEntry(
        name="attnres_walk_backward",
        title="Block AttnRes, backward over the walk",
        direction="backward",
        make_cases=lambda seed: cases_from(_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"dembedding": ("t", "d"), "dw": ("call", "d"), "dgamma": ("call", "d"), "dnorm": ("s", "d")},
        call=call,
        position_axis=0,  # dembedding: [T, d]
        input_types=(attnres.AttnResWeights, attnres.Schedule),
        from_forward=lambda forward: partial(autograd_backward, forward),
        cotangent="dh",
        error_samples=_error_samples,
        term_sizes=_term_sizes,
        strategy=lambda: samples.walks(widths=DRAWN_WIDTHS).map(lambda w: with_cotangent(w.sample)),
        default=False,
    )
)

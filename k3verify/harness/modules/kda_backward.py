"""Registry entry for KDA's backward pass (rows say ``direction: backward``): the gradients of
``L = sum(o * do) + sum(S_T * dht)`` (``numerics.gradients``) for the cotangents ``do`` and
``dht`` that each case holds beside KDA's inputs, judged against autograd through the fp64
recurrence; same-dtype baselines are autograd through the naive forms, whose stored tensors and
gradients are rounded to the dtype."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ...adapters import fla as fla_adapter
from ...kda import samples
from ...kda.chunkwise import chunkwise_backward
from ...kda.gate import InKernelGate
from ...kda.inputs import sequence_bounds, to_chunks
from ...kda.recurrent import autograd_backward, recurrent_backward
from ...kda.samples import CHUNK
from ...numerics import ln_max, resolve_dtype, rule_for
from ..guard import checked_call
from ..registry import Case, Implementation, ModuleEntry, Outputs, Prediction, cases_from, register, unavailable_as
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


def call(fn: Callable, case: Case, dtype: torch.dtype, **options: Any) -> Outputs:
    """``fn`` with the backward forms' signature (``fn(q, k, v, g, beta, *, do, dht,
    initial_state, ...) -> {dq, dk, ...}``) on the case's inputs cast to ``dtype``."""
    x = {n: (t.to(dtype) if t is not None and t.is_floating_point() else t) for n, t in case.inputs.items()}
    extra = {}
    if x.get("cu_seqlens") is not None:
        extra["cu_seqlens"] = x["cu_seqlens"]
    if x.get("A_log") is not None:
        extra["gate"] = InKernelGate(x["A_log"], x["dt_bias"], case.params.get("g_min", samples.G_MIN))
    result = checked_call(fn, [x[n] for n in ARGS], ARGS,
                          dict(do=x["do"], dht=x["dht"], initial_state=x["initial_state"], **extra, **options))
    if not isinstance(result, Mapping):
        raise TypeError(f"a KDA backward returns its gradients by name ({', '.join(OUTPUTS)}); "
                        f"this one returned a {type(result).__name__}")
    return dict(result)


def oracle(case: Case) -> Outputs:
    """Autograd through the recurrent definition in fp64."""
    return call(recurrent_backward, case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """Autograd through the ``family`` naive form in ``dtype`` (values and gradients rounded where
    it stores them)."""
    return call(partial(autograd_backward, _baseline_form(family), dtype=dtype), case, torch.float64)


def _own(form: str, fn: Callable, dtype: str, **options: Any) -> Implementation:
    return Implementation(
        module="kda_backward", implementation="k3verify", form=form, dtype=dtype, params=options,
        rule=rule_for(dtype), run=partial(call, fn, dtype=resolve_dtype(dtype), **options), cases=CASES,
        baseline="chunkwise" if form == "chunkwise" else "recurrent",
    )


def own_implementations() -> list[Implementation]:
    """What ``k3verify run`` verifies of KDA's backward: the hand-written chunkwise backward in
    fp64 (two chunk sizes), fp32 and on bf16 inputs; autograd through the recurrence on fp32 and
    bf16 inputs; fla-core's pure-torch references under autograd."""
    impls = [
        _own("chunkwise", chunkwise_backward, "fp64", chunk_size=CHUNK),
        _own("chunkwise", chunkwise_backward, "fp64", chunk_size=16),
        _own("chunkwise", chunkwise_backward, "fp32", chunk_size=CHUNK),
        _own("chunkwise", chunkwise_backward, "bf16", chunk_size=CHUNK),
        _own("recurrent (autograd)", recurrent_backward, "fp32"),
        _own("recurrent (autograd)", recurrent_backward, "bf16"),
    ]
    return impls + _fla_implementations()


def _fla_implementations() -> list[Implementation]:
    """fla-core's ``naive_recurrent_kda`` and ``naive_chunk_kda`` (fp32 arithmetic) under autograd;
    the chunk form's gradients are predicted (:func:`masked_decay_prediction`)."""
    name = f"fla-core {fla_adapter.version() or '(missing)'}"
    # The recurrence under autograd takes 2.6 s a case (a graph of T steps of small ops): the
    # default case only; the chunk form's frontier needs the saturated one too.
    forms = (("recurrent (autograd)", fla_adapter.naive_recurrent, "recurrent", None, ("default",)),
             ("chunkwise (autograd)", fla_adapter.naive_chunk, "chunkwise", masked_decay_prediction, CASES))
    return [
        Implementation(
            module="kda_backward", implementation=name, form=form, dtype="fp32", params={},
            rule=rule_for("fp32"), run=partial(call, partial(autograd_backward, fn), dtype=torch.float32),
            predict=predict, cases=cases, baseline=family, source=f"{name} (adapter)",
            is_available=unavailable_as(partial(fla_adapter.unavailable_reason, gpu=False)),
        )
        for form, fn, family, predict, cases in forms
    ]


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


GRADIENT_AXES = {"dq": ("b", "t", "h", "k"), "dk": ("b", "t", "h", "k"), "dg": ("b", "t", "h", "k"),
                 "dv": ("b", "t", "h", "v"), "dbeta": ("b", "t", "h"), "dh0": ("b", "h", "k", "v"),
                 "dA_log": ("h",), "ddt_bias": ("hk",)}

register(
    ModuleEntry(
        name="kda_backward",
        title="Kimi Delta Attention, backward",
        direction="backward",
        make_cases=lambda seed: cases_from(_cases(seed)),
        oracle=oracle,
        baseline=baseline,
        baseline_families=("recurrent", "chunkwise"),
        baseline_for=baseline_for,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes=GRADIENT_AXES,
        call=call,
        golden_cases=lambda seed: cases_from(_golden_cases(seed)),
        position_axis=1,  # dq: [B, T, H, K]
        from_forward=lambda forward: partial(autograd_backward, forward),
    )
)

"""Registry entry for the whole KDA layer (``kda_layer``): what a kernel that takes the layer's
input sees, the raw gate included, with the conv cache and the recurrent state carried between
calls and packed batches of requests (``cu_seqlens``) with one-token requests among them.

Named outputs ``y:[B, T, d]``, ``conv:[B, 3hK, W-1]`` and ``recurrent:[B, h, K, K]`` (the state
a request carries to its next call). A function judged here has the signature
``fn(x, weights, state, *, config, cu_seqlens=None) -> (y, state)`` with
:class:`~k3verify.kda.layer.KDAWeights` and :class:`~k3verify.kda.layer.KDAState`; for a packed
case ``x`` is ``[1, sum T_i, d]``, ``cu_seqlens`` the request bounds and ``state`` one entry per
request. The entry is opt-in: ``k3verify run --modules kda_layer`` (docs/modules/kda.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import kda
from ...kda.layer import KDAConfig, KDALayer, KDAState, KDAWeights, init_weights
from ...numerics import map_tensors, resolve_dtype, rule_for
from ..guard import checked_call
from ..registry import Case, ErrorSamples, Implementation, ModuleEntry, Outputs, register
from .kda import _baseline_form

OUTPUTS = ("y", "conv", "recurrent")
CONFIG = KDAConfig.small()


def layer(x: torch.Tensor, weights: KDAWeights, state: KDAState, *, config: KDAConfig,
          cu_seqlens: torch.Tensor | None = None, core: Callable | None = None) -> tuple[torch.Tensor, KDAState]:
    """Our layer with the signature judged here: ``core`` is the KDA form in the middle (the
    chunkwise form by default)."""
    one = KDALayer(config, weights)
    if cu_seqlens is None:
        return one.prefill(x, state, core=core)
    return one.prefill_packed(x, state, cu_seqlens, core=core)


def call(fn: Callable, case: Case, dtype: torch.dtype | str, **options: Any) -> Outputs:
    """``fn`` on the case's input, weights and carried state in ``dtype``: ``{y, conv, recurrent}``."""
    dt = resolve_dtype(dtype)
    given = case.inputs
    x, weights, state = (map_tensors(given[n], lambda t: t.to(dt)) for n in ("x", "weights", "state"))
    kwargs = dict(config=given["config"], cu_seqlens=given["cu_seqlens"], **options)
    result = checked_call(fn, (x, weights, state), ("x", "weights", "state"), kwargs)
    if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[1], KDAState):
        raise TypeError("a KDA layer function returns (y, KDAState(conv, recurrent))")
    y, new = result
    return {"y": y, "conv": new.conv, "recurrent": new.recurrent}


def oracle(case: Case) -> Outputs:
    """The layer with the recurrent definition in fp64."""
    return call(partial(layer, core=kda.recurrent), case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The layer with every stored tensor in ``dtype`` (each torch operation computes in fp32 and
    stores in ``dtype``) around KDA's naive ``family`` form (``recurrent`` or ``chunkwise``) in
    ``dtype``."""
    naive = _baseline_form(family)

    def core(q, k, v, g, beta, **kw):  # the naive form reads fp64 and rounds what it stores
        out, state = naive(*(t.double() for t in (q, k, v, g, beta)), dtype=dtype,
                           **{n: t.double() if isinstance(t, torch.Tensor) else t for n, t in kw.items()})
        return out.to(q.dtype), state.to(q.dtype)

    return call(partial(layer, core=core), case, dtype)


def _case(name: str, lengths: list[int], *, packed: bool, history: int, seed: int) -> Case:
    """Requests of ``lengths`` tokens, each after ``history`` earlier tokens that the fp64 layer
    turned into the carried state (0: a zero state); packed into one row when ``packed``."""
    gen = torch.Generator().manual_seed(seed)
    weights = init_weights(CONFIG, seed=seed)
    one = KDALayer(CONFIG, weights)
    n = len(lengths)
    state = one.empty_state(n)
    if history:
        earlier = torch.randn(n, history, CONFIG.hidden, generator=gen, dtype=torch.float64)
        _, state = one.prefill(earlier, state, core=kda.recurrent)
    if packed:
        x = torch.randn(1, sum(lengths), CONFIG.hidden, generator=gen, dtype=torch.float64)
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    else:
        x = torch.randn(n, lengths[0], CONFIG.hidden, generator=gen, dtype=torch.float64)
        bounds = None
    params = dict(lengths=lengths, packed=packed, history=history, seed=seed, sequences=n, heads=CONFIG.heads)
    inputs = dict(x=x, weights=weights, state=state, config=CONFIG, cu_seqlens=bounds)
    return Case(name, inputs, params)


def make_cases(seed: int) -> dict[str, Case]:
    """``prefill`` (two requests of 70 tokens from a zero state), ``carried`` (a second chunk of
    41 tokens after 23, conv cache and state carried: chunked prefill), ``decode`` (one token
    after 30) and ``packed`` (four requests of 1, 37, 1 and 26 tokens in one row, after 9)."""
    return {
        "prefill": _case("prefill", [70, 70], packed=False, history=0, seed=seed),
        "carried": _case("carried", [41, 41], packed=False, history=23, seed=seed + 1),
        "decode": _case("decode", [1, 1], packed=False, history=30, seed=seed + 2),
        "packed": _case("packed", [1, 37, 1, 26], packed=True, history=9, seed=seed + 3),
    }


CASES = ("prefill", "carried", "decode", "packed")


def strategy() -> Any:
    """A Hypothesis strategy of layer samples ``(inputs, params)``: one to four requests of 1 to
    80 tokens (one-token requests often), packed into one row with ``cu_seqlens`` or (at equal
    lengths) batched, after 0 to 40 tokens of carried state; shrinks toward one request of one
    token from a zero state (for users' property tests; needs ``hypothesis``)."""
    from hypothesis import strategies as st

    length = st.one_of(st.just(1), st.integers(1, 80))

    @st.composite
    def draw(d: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        packed = d(st.booleans())
        n = d(st.integers(1, 4))
        lengths = d(st.lists(length, min_size=n, max_size=n)) if packed else [d(length)] * n
        case = _case("drawn", lengths, packed=packed, history=d(st.integers(0, 40)), seed=d(st.integers(0, 2**16)))
        return case.inputs, case.params

    return draw()


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """``y``: a token's row mixes its heads through ``W_o``, and each head's row may err by one
    scalar (KDA's ``o``), so the RMS has tokens x heads independent errors; the bias has the
    requests (the state carries a rounding along the request). ``conv``: every element (rounded
    projections of single tokens). ``recurrent``: its rows along the value axis and the (request,
    head) pairs, as for KDA's ``final_state``."""
    if output == "y":
        return ErrorSamples(math.prod(shape[:-1]) * int(params["heads"]), int(params["sequences"]))
    if output == "conv":
        return ErrorSamples(math.prod(shape), math.prod(shape))
    return ErrorSamples(math.prod(shape[:-1]), shape[0] * shape[1])


def _own(dtype: str, core: str) -> Implementation:
    run_core = {"chunkwise": None, "recurrent": kda.recurrent}[core]
    return Implementation(
        module="kda_layer", implementation="k3verify", form=f"layer/{core}", dtype=dtype, params={},
        rule=rule_for(dtype),
        run=lambda case, d=dtype, c=run_core: call(partial(layer, core=c), case, d),
        cases=CASES, baseline=core,
    )


def own_implementations() -> list[Implementation]:
    """The layer around the chunkwise form in fp64, fp32 and bf16, and around the recurrent form
    in bf16 (what a decode kernel runs)."""
    return [_own("fp64", "chunkwise"), _own("fp32", "chunkwise"), _own("bf16", "chunkwise"),
            _own("bf16", "recurrent")]


register(
    ModuleEntry(
        name="kda_layer",
        title="Kimi Delta Attention, whole layer",
        make_cases=make_cases,
        oracle=oracle,
        baseline=baseline,
        baseline_families=("recurrent", "chunkwise"),
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"y": ("b", "t", "d"), "conv": ("b", "c", "w"), "recurrent": ("b", "h", "k", "v")},
        call=call,
        position_axis=1,  # y: [B, T, d]
        input_types=(KDAWeights, KDAState, KDAConfig),
        error_samples=_error_samples,
        strategy=strategy,
        default=False,
    )
)

"""Registry entry for the whole Gated MLA layer (``mla_layer``): what a kernel that takes the
layer's input sees, the output gate from the input, ``o_proj`` and the paged latent cache
included, for prefill from an empty cache, chunked prefill after earlier context and decode.

Named outputs ``y:[B, T, d]`` and ``cache:[B, Lmax, R + Dr]`` (the cache's live contents after
the call: the earlier context and the ``T`` new entries). A function judged here has the
signature ``fn(x, weights, cache, *, config) -> (y, cache)`` with
:class:`~k3verify.mla.layer.MLAWeights` and a paged :class:`~k3verify.mla.LatentCache` (which it
may write into and return). The entry is opt-in: ``k3verify run --modules mla_layer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ... import mla
from ...mla import layer as mla_layer
from ...mla.samples import PAGE_SIZE
from ...numerics import map_tensors, resolve_dtype, rule_for
from ..guard import checked_call
from ..registry import Case, ErrorSamples, Implementation, ModuleEntry, Outputs, register

OUTPUTS = ("y", "cache")
CONFIG = mla_layer.MLAConfig.small()


def layer(x: torch.Tensor, weights: mla_layer.MLAWeights, cache: mla.LatentCache, *, config: mla_layer.MLAConfig,
          form: Callable = mla.recurrent, **options: Any) -> tuple[torch.Tensor, mla.LatentCache]:
    """Our layer with the signature judged here, attention by ``form`` (and its ``options``)."""
    out = mla_layer.forward(x, weights, config, cache, form=form, **options)
    return out.y, out.cache


def call(fn: Callable, case: Case, dtype: torch.dtype | str, **options: Any) -> Outputs:
    """``fn`` on the case's input, weights and cache in ``dtype``: ``{y, cache}``."""
    dt = resolve_dtype(dtype)
    given = case.inputs
    x, weights = (map_tensors(given[n], lambda t: t.to(dt)) for n in ("x", "weights"))
    cache = given["cache"].to(dt).clone()
    result = checked_call(fn, (x, weights, cache), ("x", "weights", "cache"), dict(config=given["config"], **options),
                          writable=("cache",))
    y, new = result if isinstance(result, tuple) else (result, cache)
    if not isinstance(new, mla.LatentCache):
        raise TypeError("an MLA layer function returns y or (y, LatentCache)")
    return {"y": y, "cache": mla.live_entries(new)}


def oracle(case: Case) -> Outputs:
    """The layer around the expanded definition in fp64."""
    return call(partial(layer, form=mla.expanded), case, torch.float64)


def baseline(case: Case, dtype: str, family: str = "recurrent") -> Outputs:
    """The layer with every stored tensor in ``dtype`` (each torch operation computes in fp32 and
    stores in ``dtype``) around the recurrent form on those tensors."""
    return call(partial(layer, form=mla.recurrent), case, dtype)


def _case(name: str, lengths: list[int], T: int, seed: int) -> Case:
    """``T`` new tokens per request after ``lengths[b]`` tokens of context that the fp64 layer
    wrote into a paged cache (shuffled pages, NaN in dead slots)."""
    weights = mla_layer.init_weights(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B = len(lengths)
    earlier = torch.randn(B, max(max(lengths), 1), CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    context = mla_layer.project_latent(earlier, weights, CONFIG)
    cache = mla.build(context, lengths, PAGE_SIZE, generator=gen, spare_pages=2, capacity=max(lengths) + T)
    x = torch.randn(B, T, CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    params = dict(lengths=lengths, T=T, seed=seed, heads=CONFIG.num_heads)
    return Case(name, dict(x=x, weights=weights, cache=cache, config=CONFIG), params)


def make_cases(seed: int) -> dict[str, Case]:
    """``prefill`` (12 tokens per request into an empty cache), ``chunked`` (9 tokens after 20 and
    33 of context) and ``decode`` (one token after 30 and 47)."""
    return {
        "prefill": _case("prefill", [0, 0], 12, seed),
        "chunked": _case("chunked", [20, 33], 9, seed + 1),
        "decode": _case("decode", [30, 47], 1, seed + 2),
    }


CASES = ("prefill", "chunked", "decode")


def strategy() -> Any:
    """A Hypothesis strategy of layer samples ``(inputs, params)``: one to three requests, each
    after 0 to 60 tokens of context (requests of different lengths share the batch), 1 to 16 new
    tokens; shrinks toward one request decoding after no context (for users' property tests;
    needs ``hypothesis``)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        n = d(st.integers(1, 3))
        lengths = d(st.lists(st.integers(0, 60), min_size=n, max_size=n))
        case = _case("drawn", lengths, d(st.integers(1, 16)), d(st.integers(0, 2**16)))
        return case.inputs, case.params

    return draw()


def _error_samples(output: str, shape: tuple[int, ...], params: Mapping[str, Any]) -> ErrorSamples:
    """Every element of ``y`` (``o_proj`` mixes each head's error into every channel with other
    weights) and of the cache (single tokens' rounded latents)."""
    n = math.prod(shape)
    return ErrorSamples(n, n)


def _own(dtype: str, form: str, **options: Any) -> Implementation:
    fn = partial(layer, form=getattr(mla, form), **options)
    return Implementation(
        module="mla_layer", implementation="k3verify", form=f"layer/{form}", dtype=dtype, params=dict(options),
        rule=rule_for(dtype),
        run=lambda case, d=dtype: call(fn, case, d), cases=CASES,
    )


def own_implementations() -> list[Implementation]:
    """The layer around the recurrent form in fp64, fp32 and bf16, and around the chunkwise form
    (query chunks of 8) in bf16."""
    return [_own("fp64", "recurrent"), _own("fp32", "recurrent"), _own("bf16", "recurrent"),
            _own("bf16", "chunkwise", chunk_size=8)]


register(
    ModuleEntry(
        name="mla_layer",
        title="Gated MLA, whole layer",
        make_cases=make_cases,
        oracle=oracle,
        baseline=baseline,
        own_implementations=own_implementations,
        outputs=OUTPUTS,
        output_axes={"y": ("b", "t", "d"), "cache": ("b", "l", "w")},
        call=call,
        position_axis=1,  # y: [B, T, d]
        input_types=(mla_layer.MLAWeights, mla_layer.MLAConfig, mla.LatentCache),
        error_samples=_error_samples,
        strategy=strategy,
        default=False,
    )
)

"""The project's own mutant suite: does the verdict see what real bugs do?

Each :class:`Mutant` is a correct form of a module with one bug of a class seen in public kernel
reports planted in it (a state read transposed, a chunk's carry dropped, a softmax scale off by
1 %, a mask off by one, a norm's gamma dropped, the balancing bias in the mixture weights, an
input written in place, ...). Each goes through the testing API, the path a user's kernel takes
(:func:`k3verify.testing.assert_matches_oracle`), at fp32 and bf16. A mutant is *caught* when
that raises, and the first line of the failure names the statistic that caught it.

Each mutant states where it must be caught. A dtype it is not expected to be caught at carries
the reason: an error below that dtype's rounding noise, which the global RMS cannot see. The
suite fails when a mutant is missed where it must be caught, when it is caught where it is
declared invisible (its declaration is then out of date), and when a correct form (the
controls) fails.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import attnres, kda, mla, moe
from ..adapters import fla as fla_adapter
from ..attnres import samples as attnres_samples
from ..attnres.chunkwise import _ChunkwiseMixer, aggregate_backward, two_phase_backward
from ..attnres.inputs import Options as AttnResOptions
from ..attnres.layer import walk as attnres_walk
from ..kda import samples as kda_samples
from ..kda.chunkwise import chunkwise_backward
from ..mla import layer as mla_layer
from ..mla.chunkwise import attention_backward, backward_operands
from ..mla.chunkwise import chunkwise_backward as mla_chunkwise_backward
from ..moe.chunkwise import chunkwise_backward as moe_chunkwise_backward
from ..moe.inputs import Routing
from ..moe.recurrent import autograd_backward as moe_autograd_backward
from ..moe.router import route
from ..moe.situ import activation_backward
from ..numerics import compute_dtype
from .files import UsageError
from .text import md_text

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``fn`` has the module forms' signature; ``hidden`` maps a dtype at which
    the bug is not expected to be caught to the reason; ``source`` names the bug class."""

    name: str
    module: str
    fn: Callable[..., Any]
    source: str
    case: str = "default"
    baseline: str = "recurrent"
    hidden: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What the testing API made of one mutant (or control) at one dtype."""

    name: str
    module: str
    dtype: str
    caught: bool
    by: str  # the first line of the failure, or ""
    expected: bool  # whether it must be caught (controls: must not)
    control: bool = False
    hidden: str = ""  # why it is not expected to be caught at this dtype (the mutant's declaration)

    @property
    def ok(self) -> bool:
        return self.caught == self.expected


# --- the correct forms the mutants start from ------------------------------------------------

CONTROLS: dict[str, tuple[Callable[..., Any], str, str]] = {
    # module: (correct form, case, baseline family)
    "kda": (kda.chunkwise, "default", "chunkwise"),
    "kda_backward": (chunkwise_backward, "default", "chunkwise"),
    "mla": (mla.recurrent, "default", "recurrent"),
    "mla_backward": (mla_chunkwise_backward, "default", "lse"),
    "attnres": (attnres.AGGREGATIONS["recurrent"], "sources", "recurrent"),
    "attnres_backward": (aggregate_backward, "sources", "recurrent"),
    "moe": (moe.recurrent, "default", "recurrent"),
    "moe_backward": (moe_chunkwise_backward, "default", "recurrent"),
}


def _kda(change: Callable[..., Any]) -> Callable[..., Any]:
    """``kda.chunkwise`` with ``change(args, kwargs) -> (args, kwargs, post)`` applied."""

    def fn(q, k, v, g, beta, **kw):
        args, kw, post = change([q, k, v, g, beta], dict(kw))
        return post(kda.chunkwise(*args, **kw))

    return fn


def _outputs(o_change: Callable[[torch.Tensor], torch.Tensor] = lambda o: o,
             s_change: Callable[[torch.Tensor], torch.Tensor] = lambda s: s) -> Callable[[Any], Any]:
    return lambda result: (o_change(result[0]), s_change(result[1]))


def _keep(args: list, kw: dict, post: Callable[[Any], Any] | None = None) -> tuple[list, dict, Callable[[Any], Any]]:
    return args, kw, post or _outputs()


def _with_state(transform: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def change(args: list, kw: dict) -> tuple[list, dict, Callable[[Any], Any]]:
        s0 = kw.get("initial_state")
        kw["initial_state"] = None if s0 is None else transform(s0)
        return _keep(args, kw)

    return change


def _chunk_carry_dropped(q, k, v, g, beta, **kw):
    """Each 64-token chunk starts from the initial state instead of the previous chunk's."""
    T, outs, state = q.shape[1], [], kw.pop("initial_state", None)
    kw.pop("output_final_state", None)
    last = state
    for t0 in range(0, T, 64):
        sl = slice(t0, t0 + 64)
        o, last = kda.chunkwise(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                                output_final_state=True, **kw)
        outs.append(o)
    return torch.cat(outs, 1), last


def _shift_positions(o: torch.Tensor) -> torch.Tensor:
    """Every output one position late (an off-by-one in the output index): ``o[:, t] <- o[:, t-1]``."""
    out = o.clone()
    out[:, 1:] = o[:, :-1]
    return out


def _at(index: tuple, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(o: torch.Tensor) -> torch.Tensor:
        out = o.clone()
        out[index] = value
        return out

    return change


def _scale_at(index: tuple, factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(o: torch.Tensor) -> torch.Tensor:
        out = o.clone()
        out[index] = out[index] * factor
        return out

    return change


def _writes_input(i: int) -> Callable[..., Any]:
    def change(args: list, kw: dict) -> tuple[list, dict, Callable[[Any], Any]]:
        def post(result: Any) -> Any:
            args[i][(0,) * args[i].dim()] += 1
            return result

        return args, kw, post

    return change


def _kda_o(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """``kda.chunkwise`` with ``change`` applied to its output ``o``."""
    return _kda(lambda a, kw: _keep(a, kw, _outputs(o_change=change)))


def _kda_mutants() -> list[Mutant]:
    m = [
        Mutant("state read transposed", "kda", _kda(_with_state(lambda s: s.transpose(-1, -2))),
               "state layout [K, V] read as [V, K] (fla-core varlen state, K = V hides it)"),
        Mutant("initial state ignored", "kda", _kda(_with_state(lambda s: torch.zeros_like(s))),
               "prefill from a cache: the initial state dropped"),
        Mutant("chunk carry dropped", "kda", _chunk_carry_dropped,
               "each chunk restarts from the initial state (inter-chunk recurrence lost)"),
        Mutant("final state not decayed by the last chunk", "kda",
               _kda(lambda a, kw: _keep(a, kw, _outputs(s_change=lambda s: s * 1.01))),
               "final state 1 % off (a missing or doubled decay factor on the carried state)"),
        Mutant("beta ignored", "kda", _kda(lambda a, kw: _keep([*a[:4], torch.ones_like(a[4])], kw)),
               "the delta rule's write strength beta taken as 1"),
        Mutant("gate applied twice", "kda", _kda(lambda a, kw: _keep([*a[:3], a[3] * 2, a[4]], kw)),
               "the log-decay added twice (double activation of the gate)"),
        Mutant("output one position late", "kda", _kda_o(_shift_positions),
               "off-by-one in the output position (a mask or index shifted)"),
        Mutant("last token's output lost", "kda", _kda_o(_at((slice(None), -1), 0.0)),
               "the final, partial chunk's last row not stored"),
        Mutant("NaN at one position", "kda", _kda_o(_at((0, 5, 0, 0), math.nan)),
               "uninitialised memory read in one tile (0 * inf, dead slot)"),
        Mutant("one head 1 % off", "kda", _kda_o(_scale_at((slice(None), slice(None), 0), 1.01)),
               "a per-head scale applied to one head only",
               hidden={"bf16": "rms 7.1e-3 (one head of two, 1 %) under bf16's limit 1.0e-2, and KDA's bias is "
                               "judged over its 2 (batch, head) pairs only, where 2 errors allow any projection"}),
        Mutant("q written in place", "kda", _kda(_writes_input(0)), "an in-place l2norm of the caller's q"),
    ]
    return [dataclasses.replace(x, baseline="chunkwise") for x in m]


# --- KDA's backward ------------------------------------------------------------------------------

BACKWARD_CHUNK = 64


def _kda_grads(change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Callable[..., Any]:
    """``chunkwise_backward`` (chunk 64) with ``change`` applied to its gradients."""

    def fn(q, k, v, g, beta, *, do, **kw):  # ``do`` named: the testing API takes fn as a backward
        return change(chunkwise_backward(q, k, v, g, beta, do=do, chunk_size=BACKWARD_CHUNK, **kw))

    return fn


def _prefix_gradient_kept(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dg`` left as the gradient of the chunk prefix ``G``: the reverse cumulative sum undone."""
    dg = grads["dg"]
    nxt = torch.cat([dg[:, 1:], torch.zeros_like(dg[:, :1])], 1)
    last = (torch.arange(dg.shape[1]) % BACKWARD_CHUNK == BACKWARD_CHUNK - 1)[None, :, None, None]
    return grads | {"dg": torch.where(last, dg, dg - nxt)}


def _state_gradient_dropped(q, k, v, g, beta, *, do, dht=None, initial_state=None, **kw):
    """The state gradient not carried back across the first chunk boundary: the first chunk's
    backward starts from a zero ``dS``."""
    C = BACKWARD_CHUNK
    _, S = kda.chunkwise(q[:, :C], k[:, :C], v[:, :C], g[:, :C], beta[:, :C], initial_state=initial_state,
                         output_final_state=True, chunk_size=C)
    late = chunkwise_backward(q[:, C:], k[:, C:], v[:, C:], g[:, C:], beta[:, C:], do=do[:, C:], dht=dht,
                              initial_state=S.to(q.dtype), chunk_size=C, **kw)
    early = chunkwise_backward(q[:, :C], k[:, :C], v[:, :C], g[:, :C], beta[:, :C], do=do[:, :C],
                               initial_state=initial_state, chunk_size=C, **kw)
    joined = {n: torch.cat([early[n], late[n]], 1) for n in ("dq", "dk", "dv", "dg", "dbeta")}
    return joined | ({"dh0": early["dh0"]} if "dh0" in early else {})


def _kda_backward_mutants() -> list[Mutant]:
    m = [
        Mutant("dg without the reverse cumulative sum", "kda_backward", _kda_grads(_prefix_gradient_kept),
               "the gate's gradient left as its chunk prefix's (the reverse cumsum over the chunk dropped)"),
        Mutant("dh0 dropped", "kda_backward", _kda_grads(lambda d: d | {"dh0": torch.zeros_like(d["dh0"])}),
               "the initial state's gradient not returned"),
        Mutant("dbeta with the wrong sign", "kda_backward", _kda_grads(lambda d: d | {"dbeta": -d["dbeta"]}),
               "the write strength's gradient negated"),
        Mutant("state gradient not carried across a chunk boundary", "kda_backward", _state_gradient_dropped,
               "the inter-chunk state gradient dS lost at the first boundary"),
        Mutant("1 % error in dv only", "kda_backward", _kda_grads(lambda d: d | {"dv": 1.01 * d["dv"]}),
               "the value gradient 1 % off"),
    ]
    return [dataclasses.replace(x, baseline="chunkwise") for x in m]


# --- MLA ---------------------------------------------------------------------------------------


def _mla(change_scale: Callable[[float, int], float] | None = None,
         post: Callable[[torch.Tensor], torch.Tensor] = lambda o: o,
         pre: Callable[[list], list] = lambda a: a) -> Callable[..., Any]:
    def fn(q_nope, q_pe, cache, w_uk, w_uv, scale=None, **kw):
        args = pre([q_nope, q_pe, cache, w_uk, w_uv])
        head_dim = q_nope.shape[-1] + q_pe.shape[-1]
        s = scale if scale is not None else head_dim ** -0.5
        if change_scale is not None:
            s = change_scale(s, head_dim)
        return post(mla.recurrent(*args, scale=s, **kw))

    return fn


def _mla_context_short(q_nope, q_pe, cache, w_uk, w_uv, **kw):
    """Each request sees one cached token fewer (a length or mask off by one)."""
    short = dataclasses.replace(cache, seq_lens=(cache.seq_lens - 1).clamp(min=1))
    return mla.recurrent(q_nope, q_pe, short, w_uk, w_uv, **kw)


def _mla_mutants() -> list[Mutant]:
    return [
        Mutant("softmax scale 1 % off", "mla", _mla(lambda s, d: s * 1.01),
               "softmax scale from a wrong head-dimension constant, 1 % off"),
        Mutant("softmax scale from 576", "mla", _mla(lambda s, d: 576 ** -0.5),
               "scale 1/sqrt(576) (the latent width plus rope) in place of 1/sqrt(qk head dim)"),
        Mutant("no softmax scale", "mla", _mla(lambda s, d: 1.0), "the scale dropped"),
        Mutant("one cached token fewer", "mla", _mla_context_short, "sequence length or causal mask off by one",
               case="decode"),
        Mutant("rope part dropped", "mla", _mla(pre=lambda a: [a[0], torch.zeros_like(a[1]), *a[2:]]),
               "q_pe not applied (the decoupled rope scores lost)"),
        Mutant("one head 1 % off", "mla", _mla(post=_scale_at((slice(None), slice(None), 0), 1.01)),
               "a per-head output scale on one head"),
        Mutant("NaN in one request", "mla", _mla(post=_at((0, 0, 0, 0), math.nan)),
               "a dead cache slot's NaN reaching the output (0 x NaN)"),
        Mutant("q_nope written in place", "mla", _mla(post=lambda o: o, pre=lambda a: _poke_then(a, 0)),
               "an in-place absorption of w_uk into the caller's q_nope"),
    ]


def _mla_backward(*, output: Callable[[str, torch.Tensor], torch.Tensor] = lambda n, t: t,
                  cast: Callable[[str, torch.Tensor], torch.Tensor] = lambda n, t: t,
                  dims_change: Callable[[Any], Any] = lambda d: d) -> Callable[..., Any]:
    """MLA's hand-written backward (key tile 16) with its hooks or its sizes changed."""

    def fn(q_nope, q_pe, cache, w_uk, w_uv, *, do, scale=None, **kw):
        x, scale, dims = backward_operands(q_nope, q_pe, cache, w_uk, w_uv, do, scale)
        return attention_backward(*x, scale, dims_change(dims), key_tile=16, cast=cast, output=output)

    return fn


def _mla_backward_mutants() -> list[Mutant]:
    m = [
        Mutant("delta dropped", "mla_backward",
               _mla_backward(output=lambda n, t: torch.zeros_like(t) if n == "output o" else t),
               "dS = P o dP with rowsum(dO o O) left out (the softmax's own gradient lost)"),
        Mutant("causal mask dropped in the backward", "mla_backward",
               _mla_backward(dims_change=lambda d: dataclasses.replace(d, lengths=tuple(n + 10**6 for n in d.lengths))),
               "the backward recomputes P over every cached key, future ones included"),
        Mutant("value gradient kept off the latent", "mla_backward",
               _mla_backward(cast=lambda n, t: torch.zeros_like(t) if n == "value gradient" else t),
               "dV not carried through W_UV to the latent entries and W_UV's gradient"),
    ]
    return [dataclasses.replace(x, baseline="lse") for x in m]


def _poke_then(args: list, i: int) -> list:
    args[i].mul_(1.0 + 2.0**-6)
    return args


# --- Block AttnRes -------------------------------------------------------------------------------


def _attnres_backward(change: Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor],
                                       dict[str, torch.Tensor]]) -> Callable[..., Any]:
    """The two-phase backward with ``change(grads, v, w, gamma)`` applied to its gradients (fp64
    or fp32 stream, as given)."""

    def fn(sources, w, gamma, *, dh, **kw):
        return change(aggregate_backward(sources, w, gamma, dh=dh, **kw), sources, w, gamma)

    return fn


def _delta_dropped(sources, w, gamma, *, dh, eps: float = 1e-5, **kw):
    """dℓ = α ∘ dα: the two-phase backward with ``δ`` read from an ``h`` that is all zeros."""
    dtype = compute_dtype(sources.dtype)
    x = (t.to(dtype) for t in (sources, w, gamma, dh))
    return two_phase_backward(*x, eps, cast=lambda n, t: torch.zeros_like(t) if n == "output h" else t,
                              delta="output")


def _attnres_backward_mutants() -> list[Mutant]:
    return [
        Mutant("delta dropped", "attnres_backward", _delta_dropped,
               "dℓ = α ∘ dα: the softmax's own gradient without its − α δ term", case="sources"),
        Mutant("dgamma with the wrong sign", "attnres_backward",
               _attnres_backward(lambda d, v, w, g: d | {"dgamma": -d["dgamma"]}), "the key gain's gradient negated",
               case="sources"),
    ]


def _attnres(change: Callable[[list], list] | None = None, post: Callable[[torch.Tensor], torch.Tensor] = lambda h: h,
             **options: Any) -> Callable[..., Any]:
    def fn(sources, w, gamma, **kw):
        args = [sources, w, gamma] if change is None else change([sources, w, gamma])
        return post(attnres.AGGREGATIONS["recurrent"](*args, **(kw | options)))

    return fn


def _attnres_mutants() -> list[Mutant]:
    made = [
        Mutant("gamma dropped", "attnres", _attnres(lambda a: [a[0], a[1], torch.ones_like(a[2])]),
               "the key norm's gamma not applied"),
        Mutant("pseudo-query negated", "attnres", _attnres(lambda a: [a[0], -a[1], a[2]]),
               "the pseudo-query's sign (w stored transposed or negated)"),
        Mutant("newest source dropped", "attnres", _attnres(lambda a: [a[0][:-1], a[1], a[2]]),
               "block sums not reset: the current block's partial sum left out"),
        Mutant("first source dropped", "attnres", _attnres(lambda a: [a[0][1:], a[1], a[2]]),
               "the embedding left out of the sources"),
        Mutant("uniform mixing", "attnres", _attnres(lambda a: [a[0], torch.zeros_like(a[1]), a[2]]),
               "the logits lost (zero queries): a plain average of the sources"),
        Mutant("one position 2 % off", "attnres", _attnres(post=_scale_at((3,), 1.02)),
               "one token's mixture scaled",
               hidden={"bf16": "rms 3.0e-3 (one position of 32, 2 %) under bf16's limit 5.4e-3, and its bias 4.7e-4 "
                               "under the noise of 32 tokens (about 2.7e-3): needs a per-position statistic"}),
        Mutant("sources written in place", "attnres", _attnres(lambda a: [_poke_then(a, 0)[0], a[1], a[2]]),
               "an in-place RMSNorm of the caller's stored blocks"),
    ]
    return [dataclasses.replace(m, case="sources") for m in made]


# --- Stable LatentMoE ------------------------------------------------------------------------------


def _routed(routing_change: Callable[[Any, Any, Any, Routing], Routing] | None = None,
            config_change: Mapping[str, Any] | None = None,
            weights_change: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    def fn(x, weights, config, *, routing, **kw):
        cfg = dataclasses.replace(config, **config_change) if config_change else config
        w = weights_change(weights) if weights_change else weights
        r = routing if routing_change is None else routing_change(x, weights, config, routing)
        y = moe.recurrent(x, w, cfg, routing=r, **kw)
        return (y, r.indices.clone()) if routing_change is not None else y

    return fn


def _scores(x: Any, weights: Any, config: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The router's unbiased scores ``σ(logits)`` in ``dtype`` (its own router, :func:`route`)."""
    return route(x.to(dtype), weights.w_router.to(dtype), weights.bias.to(dtype), config).scores


def _biased_weights(x: Any, weights: Any, config: Any, routing: Routing) -> Routing:
    """Mixture weights from the biased scores (the balancing bias belongs to selection only)."""
    biased = torch.gather(_scores(x, weights, config) + weights.bias.double(), -1, routing.indices)
    p = biased / biased.sum(-1, keepdim=True) * config.routed_scaling_factor
    return Routing(routing.indices, p.to(routing.weights.dtype), None)


def _bf16_router(x: Any, weights: Any, config: Any, routing: Routing) -> Routing:
    """Router logits rounded to bf16 before selection and weights."""
    cfg = dataclasses.replace(config, logits_dtype="bf16")
    r = route(x.float(), weights.w_router.float(), weights.bias.float(), cfg)
    return Routing(r.indices, r.weights.to(routing.weights.dtype), None)


def _unnormalised(x: Any, weights: Any, config: Any, routing: Routing) -> Routing:
    """Mixture weights not renormalised over the selected experts."""
    s = torch.gather(_scores(x, weights, config), -1, routing.indices)
    return Routing(routing.indices, s.to(routing.weights.dtype), None)


def _one_expert_fewer(x: Any, weights: Any, config: Any, routing: Routing) -> Routing:
    """top-(k-1): the last selected expert's weight dropped, the others renormalised."""
    p = routing.weights.clone()
    p[:, -1] = 0
    return Routing(routing.indices, p / p.sum(-1, keepdim=True) * config.routed_scaling_factor, None)


def _moe_mutants() -> list[Mutant]:
    return [
        Mutant("balancing bias in the mixture weights", "moe", _routed(_biased_weights),
               "e_score_correction_bias added to the weights, not only to the selection"),
        Mutant("router logits in bf16", "moe", _routed(_bf16_router), "a router GEMM writing bf16 logits"),
        Mutant("mixture weights not renormalised", "moe", _routed(_unnormalised), "p = s_I without the sum",
               hidden={"bf16": "the latent RMSNorm after the mixture cancels a per-token scale of the weights: "
                               "rms 2.2e-6 at fp32, far under bf16's limit 1.6e-2"}),
        Mutant("one expert fewer", "moe", _routed(_one_expert_fewer), "top-k read as top-(k-1)"),
        Mutant("SiTU unbounded", "moe", _routed(config_change={"activation": "swiglu"}),
               "SwiGLU in place of SiTU (its bound beta lost)"),
        Mutant("latent norm gamma dropped", "moe",
               _routed(weights_change=lambda w: dataclasses.replace(w, latent_norm=torch.ones_like(w.latent_norm))),
               "the aggregated latent's RMSNorm gamma not applied"),
        Mutant("shared expert dropped", "moe",
               _routed(weights_change=lambda w: dataclasses.replace(w, shared_w2=torch.zeros_like(w.shared_w2))),
               "the shared MLP's output not added"),
        Mutant("x written in place", "moe", lambda x, w, c, **kw: moe.recurrent(_poke_then([x], 0)[0], w, c, **kw),
               "an in-place RMSNorm of the caller's hidden state"),
    ]


# --- Stable LatentMoE's backward ------------------------------------------------------------------


def _moe_backward(change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda d: d,
                  **pieces: Callable[..., Any]) -> Callable[..., Any]:
    """The hand-written backward with ``pieces`` of :func:`~k3verify.moe.chunkwise.backward_pass`
    replaced and ``change`` applied to its gradients."""

    def fn(x, weights, config, *, dy, indices, **kw):  # ``dy`` named: the testing API takes fn as a backward
        return change(moe_chunkwise_backward(x, weights, config, dy=dy, indices=indices, **kw, **pieces))

    return fn


def _gate_derivative_without_sigmoid_term(g, u, dh, name, *, beta1, beta2):
    """SiTU's gate differentiated as if ``σ(g)`` were a constant: ``a'(g) = sech²(g/β1) σ(g)``."""
    dg, du = activation_backward(g, u, dh, name, beta1=beta1, beta2=beta2)
    tg, sg = torch.tanh(g / beta1), torch.sigmoid(g)
    return dg - dh * beta1 * tg * sg * (1 - sg) * (beta2 * torch.tanh(u / beta2)), du


def _detached_mixture(x, weights, config, *, dy, indices, **kw):
    """Autograd through the definition with the mixture weights detached from the router."""

    def form(x, w, c, *, routing, **options):
        return moe.recurrent(x, w, c, routing=Routing(routing.indices, routing.weights.detach()), **options)

    return moe_autograd_backward(form, x, weights, config, dy=dy, indices=indices, **kw)


def _moe_backward_mutants() -> list[Mutant]:
    return [
        Mutant("mixture weights detached from the router", "moe_backward", _detached_mixture,
               "p = ρ s / Σ s treated as a constant: no gradient reaches the router"),
        Mutant("SiTU gate derivative without its sigmoid term", "moe_backward",
               _moe_backward(act_grad=_gate_derivative_without_sigmoid_term),
               "d/dg [β1 tanh(g/β1) σ(g)] without the σ'(g) product-rule term"),
        Mutant("RMSNorm gradient without its projection", "moe_backward",
               _moe_backward(norm_grad=lambda n, rstd, dn: rstd * dn), "du = rstd dn: the latent's norm held constant"),
        Mutant("expert weight gradients credited to the next expert", "moe_backward",
               _moe_backward(lambda d: d | {n: d[n].roll(1, 0) for n in ("dw1", "dw3", "dw2")}),
               "a grouped GEMM's group offsets shifted by one expert"),
    ]


# --- Gated MLA's layer backward ---------------------------------------------------------------


def _mla_layer_detached(*names: str) -> Callable[..., Any]:
    """The layer around the recurrent form (a differentiable forward: the testing API takes its
    autograd gradients) with the intermediates ``names`` detached from the graph."""

    def fn(x, weights, cache, *, config):
        out = mla_layer.forward(x, weights, config, cache, form=mla.recurrent,
                                tap=lambda name, t: t.detach() if name in names else t)
        return out.y, out.cache

    return fn


CONTROLS["mla_layer_backward"] = (_mla_layer_detached(), "prefill", "recurrent")


def _mla_layer_backward_mutants() -> list[Mutant]:
    return [
        Mutant("new latents detached at the cache write", "mla_layer_backward", _mla_layer_detached("entries"),
               "the new tokens' latents written to the cache outside the graph (an inference cache write reused "
               "for training): W_DKV and its norm get no gradient", case="prefill"),
        Mutant("output gate held constant", "mla_layer_backward", _mla_layer_detached("gate"),
               "σ(x W_G) treated as a constant: W_G gets no gradient, x misses the gate's term", case="prefill"),
    ]


# --- Block AttnRes's backward over the walk ---------------------------------------------------


class _BlocksOutsideTheGraph(_ChunkwiseMixer):
    """The two-phase walk's stream with every completed block stored detached."""

    def push(self, s: int, y: torch.Tensor) -> None:
        stored = len(self.blocks)
        super().push(s, y)
        if len(self.blocks) > stored:
            self.blocks[-1] = self.blocks[-1].detach()


def _walk_blocks_detached(embedding, weights, sublayers, *, schedule=None, **options):
    """The two-phase walk, its completed blocks stored outside the graph."""
    return attnres_walk(embedding, weights, sublayers, schedule or attnres.Schedule(), AttnResOptions(**options),
                        _BlocksOutsideTheGraph)


def _walk_pseudo_queries_frozen(embedding, weights, sublayers, **options):
    """The two-phase walk with the pseudo-queries outside the graph."""
    frozen = attnres.AttnResWeights(weights.w.detach(), weights.gamma, weights.norm)
    return attnres.chunkwise(embedding, frozen, sublayers, **options)


CONTROLS["attnres_walk_backward"] = (attnres.chunkwise, "walk", "recurrent")


def _attnres_walk_backward_mutants() -> list[Mutant]:
    return [
        Mutant("completed blocks stored outside the graph", "attnres_walk_backward", _walk_blocks_detached,
               "an inference block cache reused for training: a later call's mixing of block b sends no gradient "
               "into b's sublayers, their norm gains or the embedding through them", case="walk"),
        Mutant("pseudo-queries outside the graph", "attnres_walk_backward", _walk_pseudo_queries_frozen,
               "w registered as a buffer (zero-initialised in the AttnRes paper, easily mistaken for one): "
               "it gets no gradient", case="walk"),
    ]


def mutants(modules: list[str] | None = None) -> list[Mutant]:
    """Every mutant of the ``modules`` (all by default)."""
    made = [*_kda_mutants(), *_kda_backward_mutants(), *_mla_mutants(), *_mla_backward_mutants(),
            *_attnres_mutants(), *_attnres_backward_mutants(), *_moe_mutants(), *_moe_backward_mutants(),
            *_mla_layer_backward_mutants(), *_attnres_walk_backward_mutants()]
    return [m for m in made if modules is None or m.module in modules]


def mutant(module: str, name: str) -> Mutant:
    """The mutant of ``module`` called ``name`` (``KeyError`` naming the known ones)."""
    found = {m.name: m for m in mutants([module])}
    if name not in found:
        raise KeyError(f"no {module} mutant {name!r}; the {module} mutants are {sorted(found)}")
    return found[name]


# What judges a function as users' tests do: ``k3verify.testing.assert_matches_oracle``, passed in
# by the caller (the testing API stands above the harness).
Check = Callable[..., None]


def _judge(check: Check, fn: Callable[..., Any], module: str, dtype: str, case: Any,
           baseline: str) -> tuple[bool, str]:
    """Whether ``check`` fails ``fn`` on ``case`` (a made case) at ``dtype``, and its first reason line."""
    try:
        check(fn, module, dtype, cases=[case], baseline=baseline, timeout=None)
    except AssertionError as exc:
        lines = str(exc).splitlines()
        return True, lines[1] if len(lines) > 1 else lines[0]
    return False, ""


def run(check: Check, modules: list[str] | None = None) -> Iterator[Outcome]:
    """The controls, then every mutant, at every dtype of :data:`DTYPES`, each judged by ``check``
    (``k3verify.testing.assert_matches_oracle``)."""
    made: dict[str, dict[str, Any]] = {}

    def case(module: str, name: str) -> Any:
        # One set of cases per module: its oracle and baselines are computed once (each case
        # memoizes them) for every control and mutant; each call still gets its own inputs.
        if module not in made:
            from .registry import get

            made[module] = get(module).make_cases(0)
        return made[module][name]

    for module, (fn, name, baseline) in CONTROLS.items():
        if modules is None or module in modules:
            for dtype in DTYPES:
                caught, by = _judge(check, fn, module, dtype, case(module, name), baseline)
                yield Outcome(f"{module} correct form", module, dtype, caught, by, expected=False, control=True)
    for m in mutants(modules):
        for dtype in DTYPES:
            caught, by = _judge(check, m.fn, m.module, dtype, case(m.module, m.case), m.baseline)
            yield Outcome(m.name, m.module, dtype, caught, by, expected=dtype not in m.hidden,
                          hidden=m.hidden.get(dtype, ""))


@dataclass(frozen=True)
class Finding:
    """A real precision loss the sweep found in one of our forms, pinned on the drawn case that
    showed it first (``params``; ``make`` rebuilds its inputs). The sweep reports a failure of
    that form as this finding, not as a false alarm, only when the row's own ``explanation``
    names the ``mechanism``: the same loss, wherever it shows."""

    module: str
    label: str
    params: Mapping[str, Any]
    why: str
    make: Callable[[], dict[str, Any]]
    mechanism: str

    def case(self) -> Any:
        """The pinned case, rebuilt (no draw needed)."""
        from .registry import Case

        return Case("finding", self.make(), dict(self.params))


def _saturated_kda(label: str, why: str, mechanism: str, **shape: Any) -> Finding:
    """A KDA finding on a case with every gate at its bound, its params and inputs from ``shape``."""
    return Finding("kda", label, {**shape, "gates": "all at g_min"}, why,
                   lambda: kda_samples.saturated_inputs(**shape, one_hot=False), mechanism)


def _kda_backward(label: str, why: str, mechanism: str, **problem: Any) -> Finding:
    """A finding of KDA's backward on a problem built by ``kda.samples.make_problem`` (with its
    cotangents, as the backward's strategy draws them)."""
    B, T, H, K, V = (problem.pop(n) for n in ("B", "T", "H", "K", "V"))

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        from .modules.kda_backward import with_cotangents

        return with_cotangents(kda_samples.make_problem(B, T, H, K, V, **problem).sample)

    params = dict(B=B, T=T, H=H, K=K, V=V, g_min=problem["g_min"], seed=problem["seed"], gates=problem["kind"],
                  initial_state=problem["initial_state"])
    return Finding("kda_backward", label, params, why, lambda: make()[0], mechanism)


FINDINGS: tuple[Finding, ...] = (
    _saturated_kda("kda/k3verify:tiled[bf16 chunk_size=64 tile=32 anchor=tile_start]",
                   "a 32-token tile at g_min -2.77 spans e^-86: the anchored queries and keys of the diagonal "
                   "tile fall below bf16's smallest normal (5 % of them) while their partners are e^+86 large",
                   "diagonal q operand fell below bf16's smallest normal",
                   B=1, T=127, H=1, K=32, V=32, g_min=-2.77, seed=1),
    _saturated_kda("kda/k3verify:tiled[fp16 chunk_size=64 tile=16 anchor=tile_start]",
                   "a 16-token tile at g_min -0.72 spans e^-10.8, under fp16's smallest normal e^-9.7: 36 % of "
                   "the diagonal tile's anchored operands are subnormal",
                   "diagonal q operand fell below fp16's smallest normal",
                   B=2, T=32, H=1, K=16, V=32, g_min=-0.72, seed=53),
    _kda_backward(f"kda_backward/fla-core {fla_adapter.version() or '(missing)'}:chunkwise (autograd)[fp32]",
                  "fla-core's naive_chunk_kda under autograd in fp32: dg 3.4x and 2.3x autograd through the naive "
                  "chunk forward on 2 of 64 drawn cases (gate bound -0.33, weak decay), more than twice autograd "
                  "through our chunkwise forward on the same fp32 inputs; its other gradients pass",
                  "the excess is fla-core's naive_chunk_kda's own arithmetic",
                  B=1, T=134, H=1, K=16, V=16, g_min=-0.33, seed=99, kind="random", initial_state=False),
    Finding("attnres", "attnres/k3verify:tiled[bf16 tile=4 logit_dtype=bf16]",
            {"N": 4, "T": 1, "d": 16, "kind": "aggregation", "logit_scale": 19.408391593382618,
             "logit_spread": 4.0, "seed": 4},
            "the known-bad variant that stores logits in bf16: at |logit| 19.4 a rounding moves a mixing "
            "weight by up to 6.5 %",
            lambda: attnres_samples.aggregation_sample(4, 1, 16, logit_scale=19.408391593382618, seed=4)[0],
            "logits stored in bf16"),
)


@dataclass(frozen=True)
class Sweep:
    """The false-alarm sweep of one module: every verdict its correct implementations got on its
    built-in cases and on drawn ones, the rows that failed (``(label, case, reason)``), and the
    failures that are pinned :data:`FINDINGS` (real losses, not false alarms)."""

    module: str
    verdicts: int
    drawn: int
    failures: tuple[tuple[str, str, str], ...]
    unavailable: int = 0
    findings: tuple[tuple[str, str, str], ...] = ()


def drawn_cases(module: str, n: int, seed: int = 0) -> list[Any]:
    """``n`` cases drawn from ``module``'s strategy with Hypothesis's random seeded by ``seed``,
    named ``drawn<i>`` (none for a module without a strategy: the whole layers); cases that need
    a CUDA device are left out on a machine without one."""
    if n <= 0:
        return []
    _import_package()
    try:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as seeded
    except ModuleNotFoundError as exc:
        raise UsageError("drawing cases needs Hypothesis, which the test extra installs: "
                         "pip install 'k3verify[test]'") from exc

    from .registry import Case, get

    entry = get(module)
    if entry.strategy is None:  # a module without a strategy is swept on its built-in cases
        return []
    got: list[tuple[dict[str, Any], dict[str, Any]]] = []

    @seeded(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(sample=entry.strategy())
    def draw(sample: tuple[dict[str, Any], dict[str, Any]]) -> None:
        got.append(sample)

    draw()
    cases = [Case(f"drawn{i}", inputs, dict(params)) for i, (inputs, params) in enumerate(got[:n])]
    return [c for c in cases if c.params.get("device") != "cuda" or torch.cuda.is_available()]


def _import_package() -> None:
    """Import every k3verify module that imports here. Hypothesis mixes literal constants of the
    local modules loaded at draw time into its draws, so a draw made after a run has loaded more
    of k3verify would differ; with all of them loaded first, a seed draws the same cases in every
    process that loads no other local code."""
    import importlib
    import pkgutil

    from .. import __path__ as root

    for info in pkgutil.walk_packages(root, "k3verify."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: that module's constants stay out
            continue


def sweep(module: str, drawn: int, *, seed: int = 0, kernels: bool = True,
          progress: Callable[[str], None] | None = None) -> Sweep:
    """Every own implementation of ``module`` (without its kernels unless ``kernels``) on each
    built-in case it runs on, then on ``drawn`` drawn cases, through :func:`runner.verify`: a
    correct implementation must never fail. Unavailable rows are counted apart."""
    from . import runner
    from .registry import get

    entry = get(module)
    impls = [i for i in entry.own_implementations() if kernels or not i.form.startswith("kernel")]
    built_in = entry.make_cases(seed)
    pairs = [(i, built_in[c]) for i in impls for c in i.cases if c in built_in]
    pairs += [(i, c) for c in drawn_cases(module, drawn, seed) for i in impls]
    failures, findings, verdicts, unavailable = [], [], 0, 0
    pinned = {f.label: f for f in FINDINGS if f.module == module}
    for j, (impl, case) in enumerate(pairs, 1):
        row = runner.verify(entry, impl, case)
        if row["status"] == runner.UNAVAILABLE:
            unavailable += 1
        else:
            verdicts += 1
            if row["status"] == runner.FAIL:
                found = pinned.get(impl.label)
                known = found is not None and any(found.mechanism in line for line in row.get("explanation", []))
                (findings if known else failures).append((impl.label, f"{case.name} {case.params}", _row_reason(row)))
        if progress is not None and (j % 25 == 0 or j == len(pairs)):
            progress(f"sweep {module}: {j}/{len(pairs)} rows, {len(failures)} failed")
    drawn = drawn if entry.strategy is not None else 0
    return Sweep(module, verdicts, drawn, tuple(failures), unavailable, tuple(findings))


def _row_reason(row: dict[str, Any]) -> str:
    """A failed row's reason: the binding output and its rule's sentence, or why it crashed."""
    if "verdict" in row:
        return f"{row.get('output')!r}: {row['verdict']['reason']}"
    return str(row.get("reason"))


def markdown(outcomes: list[Outcome]) -> str:
    """The detection table: one row per mutant, a column per dtype with the verdict and what
    caught it (or why it cannot be caught there); the controls first."""
    by_name: dict[tuple[str, str], dict[str, Outcome]] = {}
    for o in outcomes:
        by_name.setdefault((o.module, o.name), {})[o.dtype] = o
    lines = ["| module | mutant | " + " | ".join(DTYPES) + " |", "|---|---|" + "---|" * len(DTYPES)]
    for (module, name), per in by_name.items():
        cells = []
        for d in DTYPES:
            o = per.get(d)
            if o is None:
                cells.append("")
                continue
            if o.control:
                cells.append("pass" if not o.caught else f"**fail**: {md_text(o.by)}")
                continue
            what = _statistic(o.by) if o.caught else md_text(o.hidden)
            mark = "" if o.ok else " **(not as declared)**"
            cells.append(f"{'caught' if o.caught else 'missed'}{mark}: {what}")
        lines.append(f"| {md_text(module)} | {md_text(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _statistic(reason: str) -> str:
    """What caught a mutant, from its failure line: the output and rule, or the exception."""
    head = reason.split(": rule ", 1)
    if len(head) == 2:
        output = head[0].split("output ", 1)[-1]
        return md_text(f"{output} {head[1].split(' (err')[0]}")
    return md_text(reason.split(": ", 1)[-1].split(" (", 1)[0])

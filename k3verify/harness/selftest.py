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
from ..moe.inputs import Routing
from ..moe.router import route
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
    "mla": (mla.recurrent, "default", "recurrent"),
    "attnres": (attnres.AGGREGATIONS["recurrent"], "sources", "recurrent"),
    "moe": (moe.recurrent, "default", "recurrent"),
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
               hidden={"bf16": "rms 7.1e-3 (one head of two, 1 %) under bf16's limit 1.0e-2: diluted in the global "
                               "RMS; needs a per-head statistic"}),
        Mutant("q written in place", "kda", _kda(_writes_input(0)), "an in-place l2norm of the caller's q"),
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
               "softmax scale from a wrong head-dimension constant, 1 % off",
               hidden={"bf16": "rms 7.3e-3 under bf16's limit 1.17e-2; coherent with the output, so a bias "
                               "statistic would see it (docs/sensitivity.md)"}),
        Mutant("softmax scale from 576", "mla", _mla(lambda s, d: 576 ** -0.5),
               "scale 1/sqrt(576) (the latent width plus rope) in place of 1/sqrt(qk head dim)"),
        Mutant("no softmax scale", "mla", _mla(lambda s, d: 1.0), "the scale dropped"),
        Mutant("one cached token fewer", "mla", _mla_context_short, "sequence length or causal mask off by one",
               case="decode"),
        Mutant("rope part dropped", "mla", _mla(pre=lambda a: [a[0], torch.zeros_like(a[1]), *a[2:]]),
               "q_pe not applied (the decoupled rope scores lost)"),
        Mutant("one head 1 % off", "mla", _mla(post=_scale_at((slice(None), slice(None), 0), 1.01)),
               "a per-head output scale on one head",
               hidden={"bf16": "rms 5.5e-3 (one head of four, 1 %) under bf16's limit 1.17e-2; needs a per-head "
                               "statistic"}),
        Mutant("NaN in one request", "mla", _mla(post=_at((0, 0, 0, 0), math.nan)),
               "a dead cache slot's NaN reaching the output (0 x NaN)"),
        Mutant("q_nope written in place", "mla", _mla(post=lambda o: o, pre=lambda a: _poke_then(a, 0)),
               "an in-place absorption of w_uk into the caller's q_nope"),
    ]


def _poke_then(args: list, i: int) -> list:
    args[i].mul_(1.0 + 2.0**-6)
    return args


# --- Block AttnRes -------------------------------------------------------------------------------


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
               hidden={"bf16": "rms 3.0e-3 (one position, 2 %) under bf16's limit 5.4e-3; needs a per-position "
                               "statistic"}),
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


def mutants(modules: list[str] | None = None) -> list[Mutant]:
    """Every mutant of the ``modules`` (all four by default)."""
    made = [*_kda_mutants(), *_mla_mutants(), *_attnres_mutants(), *_moe_mutants()]
    return [m for m in made if modules is None or m.module in modules]


def _judge(fn: Callable[..., Any], module: str, dtype: str, case: str, baseline: str) -> tuple[bool, str]:
    """Whether the testing API fails ``fn`` on ``case`` at ``dtype``, and its first reason line."""
    from ..testing import assert_matches_oracle

    try:
        assert_matches_oracle(fn, module, dtype, cases=[case], baseline=baseline, timeout=None)
    except AssertionError as exc:
        lines = str(exc).splitlines()
        return True, lines[1] if len(lines) > 1 else lines[0]
    return False, ""


def run(modules: list[str] | None = None) -> Iterator[Outcome]:
    """The controls, then every mutant, at every dtype of :data:`DTYPES`."""
    for module, (fn, case, baseline) in CONTROLS.items():
        if modules is None or module in modules:
            for dtype in DTYPES:
                caught, by = _judge(fn, module, dtype, case, baseline)
                yield Outcome(f"{module} correct form", module, dtype, caught, by, expected=False, control=True)
    for m in mutants(modules):
        for dtype in DTYPES:
            caught, by = _judge(m.fn, m.module, dtype, m.case, m.baseline)
            yield Outcome(m.name, m.module, dtype, caught, by, expected=dtype not in m.hidden,
                          hidden=m.hidden.get(dtype, ""))


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

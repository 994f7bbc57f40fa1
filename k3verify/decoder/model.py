"""The K3 stack composed from the module layers, with per-request serving state (docs/decoder.md).

One call of :meth:`Decoder.step` advances a batch of requests by their new tokens:

    x_0 = the new tokens' embeddings, packed [N, d] (request i at cu_seqlens[i]:cu_seqlens[i+1])
    for every sublayer call s (attention side of layer l at 2l, MLP side at 2l + 1):
        x = RMSNorm(AttnRes_s(depth sources))               (per token: the walk of k3verify.attnres)
        y = f_s(x)                                           (KDA / MLA per request with its state;
                                                              dense MLP / MoE per token)
    out = AttnRes_output(depth sources)                      (no norm)

The state a request carries between calls is KDA's conv history and recurrent state and MLA's
paged latent cache, per layer (:class:`ServingState`); AttnRes and the MoE keep nothing across
tokens. Which form each module runs, in which dtype, is a :class:`Plan`: the fp64 definitions,
the fp64 chunkwise forms, the tiled low-precision forms, the same-dtype naive baselines, or any
callable with the module forms' signature (a kernel, a registered implementation).

A batch is computed the way a serving engine batches it: requests with one new token and some
history go through one batched decode call per layer (KDA's recurrent step, MLA over the paged
cache); every other request is a prefill of its own. Each request alone is the definition the
batch must equal (:mod:`k3verify.decoder.scenarios`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from .. import attnres, kda, mla, moe
from ..attnres.inputs import Options
from ..attnres.recurrent import _NaiveMixer
from ..kda.layer import KDALayer, KDAState
from ..mla import layer as mla_layer
from ..mla.cache import LatentCache, allocate
from ..moe.inputs import MoEWeights, Routing
from ..moe.layer import forward as moe_forward
from ..moe.layer import glu
from ..moe.router import mixture, route
from ..numerics import compute_dtype, resolve_dtype
from .config import ATTNRES, DENSE, KDA, MLA, MOE, DecoderConfig
from .weights import DecoderWeights, init_weights

Tap = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Form:
    """How one module type runs: ``label`` for reports; ``dtype`` its weights and activations
    (projections compute in it, as torch does: fp32 arithmetic, results rounded); ``fn`` the
    module's core form (KDA: ``fn(q, k, v, g, beta, *, initial_state, output_final_state)``; MLA:
    ``fn(q_nope, q_pe, cache, w_uk, w_uv, *, scale)``; MoE: ``fn(x, weights, config)``; unused for
    the dense MLP) with ``options``; ``decode`` the one-token path of KDA (the recurrent step if
    ``None``) and of MLA (``fn`` if ``None``): a decode kernel. ``tap(sublayer, y)`` sees the
    sublayer's output and returns what the stack goes on with (a probe, or a planted bug)."""

    label: str
    dtype: torch.dtype = torch.float64
    fn: Callable[..., Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    decode: Callable[..., Any] | None = None
    tap: Tap | None = None
    # KDA's carried state as the core takes it: in the activations' dtype (the forms' contract)
    # or in fp32 (kernels keep their state in fp32).
    fp32_state: bool = False

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs, **self.options)


@dataclass(frozen=True)
class AttnResForm:
    """How the depth mixing runs: ``mixer`` is a walk form of :data:`k3verify.attnres.MIXERS`
    (``recurrent``, ``chunkwise``, ``tiled``) or ``naive`` (the same-dtype baseline);
    ``stream_dtype`` holds the stored blocks and the partial sum (bf16 in deployment)."""

    label: str
    mixer: str = "recurrent"
    stream_dtype: torch.dtype = torch.float64
    options: Mapping[str, Any] = field(default_factory=dict)

    def make(self) -> Callable[..., Any]:
        if self.mixer == "kernels":  # our Triton kernels: phase 1 per block, phase 2 per call
            from ..attnres.kernels import _Ours, _TwoPhaseMixer

            return partial(_TwoPhaseMixer, phases=_Ours())
        return _NaiveMixer if self.mixer == "naive" else attnres.MIXERS[self.mixer]


@dataclass(frozen=True)
class Plan:
    """Which form every sublayer runs. ``forms`` by module type (``kda``, ``mla``, ``dense``,
    ``moe``); ``overrides[(layer, module)]`` replaces one layer's; ``kv_storage`` makes every MLA
    cache hold fp8 codes (``"fp8_e4m3"``) instead of the MLA form's dtype."""

    label: str
    forms: Mapping[str, Form]
    attnres: AttnResForm
    kv_storage: str | None = None
    overrides: Mapping[tuple[int, str], Form] = field(default_factory=dict)

    def form(self, layer: int, module: str) -> Form:
        return self.overrides.get((layer, module)) or self.forms[module]

    def with_forms(self, label: str, **forms: Form) -> Plan:
        """This plan with the named module types' forms replaced."""
        return replace(self, label=label, forms={**self.forms, **forms})


def fp64_plan(kind: str = "recurrent") -> Plan:
    """Every module in fp64: its definition (``recurrent``) or its chunkwise form (``chunkwise``:
    KDA chunkwise, MLA chunkwise, MoE chunkwise, AttnRes two-phase)."""
    if kind not in ("recurrent", "chunkwise"):
        raise ValueError(f"an fp64 plan is 'recurrent' or 'chunkwise', not {kind!r}")
    forms = {
        KDA: Form(f"kda {kind} fp64", fn=getattr(kda, kind)),
        MLA: Form(f"mla {kind} fp64", fn=getattr(mla, kind)),
        DENSE: Form("dense fp64"),
        MOE: Form(f"moe {kind} fp64", fn=getattr(moe, kind)),
    }
    return Plan(f"fp64 {kind}", forms, AttnResForm(f"attnres {kind} fp64", kind))


def tiled_plan(dtype: str = "bf16") -> Plan:
    """What tensor-core kernels do: every module's tiled form with ``dtype`` operands and fp32
    accumulation, activations and weights in ``dtype``, AttnRes's tiled online softmax over a
    ``dtype`` stream; KDA's state and gates in fp32."""
    dt = resolve_dtype(dtype)
    forms = {
        KDA: Form(f"kda tiled {dtype}", dt, kda.tiled, {"operand_dtype": dt}),
        MLA: Form(f"mla tiled {dtype}", dt, mla.tiled, {"operand_dtype": dt}),
        DENSE: Form(f"dense {dtype}", dt),
        MOE: Form(f"moe tiled {dtype}", dt, moe.tiled, {"operand_dtype": dt}),
    }
    return Plan(f"tiled {dtype}", forms, AttnResForm(f"attnres tiled {dtype}", "tiled", dt))


def naive_plan(dtype: str = "bf16") -> Plan:
    """The same-dtype baseline of the policy: every module's naive form in ``dtype`` (every
    stored tensor rounded, each operation in fp32), a ``dtype`` stream mixed naively."""
    dt = resolve_dtype(dtype)
    forms = {
        KDA: Form(f"kda naive {dtype}", dt, partial(kda.naive_baseline, dtype=dt)),
        MLA: Form(f"mla naive {dtype}", dt, partial(mla.naive_baseline, dtype=dt)),
        DENSE: Form(f"dense {dtype}", dt),
        MOE: Form(f"moe naive {dtype}", dt, partial(moe.naive_baseline, dtype=dt)),
    }
    return Plan(f"naive {dtype}", forms, AttnResForm(f"attnres naive {dtype}", "naive", dt))


def kernel_plan(dtype: str = "bf16") -> Plan:
    """Our Triton kernels for every module: KDA's chunk kernel for prefill and its fused
    recurrent kernel for decode (fp32 state), MLA's expanded prefill and absorbed decode over the
    paged cache, MoE's grouped expert kernels, AttnRes's two-phase kernels over a ``dtype`` stream
    (bf16 or fp16 on a GPU; fp32 in Triton's CPU interpreter)."""
    from ..kda import kernels as kda_kernels
    from ..mla import kernels as mla_kernels
    from ..moe import kernels as moe_kernels

    dt = resolve_dtype(dtype)
    forms = {
        KDA: Form(f"kda kernels {dtype}", dt, kda_kernels.chunk, {"operand_dtype": dt},
                  decode=partial(kda_kernels.fused_recurrent, operand_dtype=dt), fp32_state=True),
        MLA: Form(f"mla kernels {dtype}", dt, mla_kernels.prefill, decode=mla_kernels.decode),
        DENSE: Form(f"dense {dtype}", dt),
        MOE: Form(f"moe kernels {dtype}", dt, moe_kernels.grouped),
    }
    return Plan(f"kernels {dtype}", forms, AttnResForm(f"attnres kernels {dtype}", "kernels", dt))


def only(module: str, low: Plan, base: Plan, *, layer: int | None = None) -> Plan:
    """``base`` with one module type (every layer of it, or only ``layer``) in ``low``'s form:
    the attribution runs of :mod:`k3verify.decoder.walks`. ``module`` may be ``"attnres"``."""
    where = "" if layer is None else f" at layer {layer}"
    label = f"{base.label}, {module}{where} as {low.label}"
    if module == ATTNRES:
        if layer is not None:
            raise ValueError("the depth mixing runs as one walk: attnres takes no layer")
        return replace(base, label=label, attnres=low.attnres)
    # The latent cache's storage belongs to MLA: it comes with MLA's form.
    kv = low.kv_storage if module == MLA else base.kv_storage
    if layer is None:
        return replace(base.with_forms(label, **{module: low.forms[module]}), kv_storage=kv)
    if kv != base.kv_storage:
        raise ValueError("the latent cache's storage is one per plan: an fp8 cache takes every MLA layer")
    return replace(base, label=label, overrides={**base.overrides, (layer, module): low.forms[module]})


@dataclass
class ServingState:
    """What a batch of requests carries between steps: ``lengths[i]`` tokens seen by request
    ``i``; per KDA layer a :class:`~k3verify.kda.layer.KDAState` of batch ``B``; per MLA layer a
    paged :class:`~k3verify.mla.LatentCache` of batch ``B`` (one pool per layer)."""

    lengths: list[int]
    kda: dict[int, KDAState]
    mla: dict[int, LatentCache]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def copy(self) -> ServingState:
        """A copy sharing no mutable container (tensors are never written in place)."""
        return ServingState(list(self.lengths), dict(self.kda), dict(self.mla))

    def select(self, rows: Sequence[int]) -> ServingState:
        """The state of requests ``rows`` (in that order); MLA caches keep their pools."""
        idx = torch.as_tensor(list(rows), dtype=torch.int64)
        return ServingState(
            [self.lengths[i] for i in rows],
            {l: KDAState(s.conv[idx], s.recurrent[idx]) for l, s in self.kda.items()},
            {l: replace(c, block_table=c.block_table[idx], seq_lens=c.seq_lens[idx]) for l, c in self.mla.items()},
        )


@dataclass
class Decoder:
    """The stack: configuration, weights (made from ``config`` when not given) and the device
    every tensor of a step lives on (tokens, weights, states and caches are moved there)."""

    config: DecoderConfig
    weights: DecoderWeights | None = None
    device: torch.device | str = "cpu"
    # Told, before every sublayer call, which one runs and in which form (``"kernels bf16:
    # sublayer 95/186 (kda, ...)"``): a long walk's progress says where it is.
    doing: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.weights is None:
            self.weights = init_weights(self.config)

    # --- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int, plan: Plan, *, page_order: str = "shuffled",
                  seed: int = 0) -> ServingState:
        """Empty state for ``batch`` requests of up to ``capacity`` tokens: zero KDA states (fp32 for a
        low-precision KDA form, as kernels keep them), NaN-poisoned MLA pages placed by ``page_order``
        (``"in_order"``, ``"shuffled"`` from ``seed``)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        kda_states, caches = {}, {}
        for layer in range(cfg.num_layers):
            module = cfg.token_mixer(layer)
            form = plan.form(layer, module)
            if module == KDA:
                empty = self._kda_layer(layer, form).empty_state(batch, form.dtype, self.device)
                kda_states[layer] = KDAState(empty.conv, empty.recurrent.to(compute_dtype(form.dtype)))
            else:
                caches[layer] = allocate(batch, capacity, cfg.page_size, cfg.mla.cache_width, dtype=form.dtype,
                                         page_order=page_order, spare_pages=2, generator=gen,
                                         storage=plan.kv_storage, device=self.device)
        return ServingState([0] * batch, kda_states, caches)

    # --- one step ----------------------------------------------------------------------------
    def step(self, tokens: Sequence[torch.Tensor], state: ServingState, plan: Plan, *,
             observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
             routes: Mapping[int, torch.Tensor] | None = None,
             ) -> tuple[list[torch.Tensor], ServingState]:
        """Advance every request of ``state`` by its new tokens ``tokens[i]:[T_i, d]`` (fp64
        embeddings; ``T_i = 0`` leaves request ``i`` idle in this step). Returns each request's
        final hidden states ``[T_i, d]`` (the output AttnRes, stream dtype) and the new state
        (``state`` is not modified).
        ``observe(s, h, y)`` sees every sublayer call's AttnRes output and sublayer output;
        ``routes`` pins the MoE layers' expert choices (see :class:`Pass`)."""
        run = self.start(tokens, state, plan, routes=routes)
        while not run.done:
            run.advance(observe=observe)
        return run.finish()

    def start(self, tokens: Sequence[torch.Tensor], state: ServingState, plan: Plan, *,
              routes: Mapping[int, torch.Tensor] | None = None) -> Pass:
        """A step that runs one sublayer at a time (:class:`Pass`); deep copies resume from a point."""
        if len(tokens) != state.batch:
            raise ValueError(f"{len(tokens)} token blocks for a state of {state.batch} requests")
        for i, t in enumerate(tokens):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != self.config.hidden:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"tokens[{i}] must be [T, d={self.config.hidden}], got {shape}")
        if not any(int(t.shape[0]) for t in tokens):
            raise ValueError("a step needs at least one new token")
        x0 = torch.cat([t.to(self.device, torch.float64) for t in tokens])
        a = plan.attnres
        opts = Options(stream_dtype=a.stream_dtype, **dict(a.options))
        walk = attnres.DepthWalk(x0, self.weights.attnres_on(self.device), self.config.schedule, opts, a.make())
        bounds = [0, *itertools.accumulate(int(t.shape[0]) for t in tokens)]
        return Pass(self, plan, walk, bounds, state.copy(), routes_in=routes)

    # --- sublayers ---------------------------------------------------------------------------
    def sublayer(self, s: int, x: torch.Tensor, run: Pass) -> torch.Tensor:
        """Sublayer call ``s`` on the packed tokens ``x:[N, d]`` of ``run``; updates its state in
        place (the containers, never the tensors). Returns ``y:[N, d]`` in ``x``'s dtype.

        Tokens whose input is not finite (an overflow, or a broken implementation upstream) are
        not computed: their outputs are NaN, so it shows where it went; a token mixer leaves such a
        request out whole (its state as it was), a channel mixer only those tokens."""
        if self.doing is not None:
            module = self.config.module_of(s)
            self.doing(f"{run.plan.label}: sublayer {s + 1}/{self.config.schedule.num_sublayers} "
                       f"({module}, {run.plan.form(s // 2, module).label})")
        bad = ~torch.isfinite(x).all(-1)
        if bool(bad.any()):
            return self._around_nonfinite(s, x, run, bad)
        return self._sublayer(s, x, run, run.bounds)

    def _around_nonfinite(self, s: int, x: torch.Tensor, run: Pass, bad: torch.Tensor) -> torch.Tensor:
        keep = ~bad
        if s % 2 == 0:  # a token mixer: requests with any bad token sit this sublayer out
            for a, b in itertools.pairwise(run.bounds):
                if bool(bad[a:b].any()):
                    keep[a:b] = False
        sizes = [int(keep[a:b].sum()) for a, b in itertools.pairwise(run.bounds)]
        y = torch.full_like(x, float("nan"))
        if bool(keep.any()):
            y[keep] = self._sublayer(s, x[keep], run, [0, *itertools.accumulate(sizes)])
        return y

    def _sublayer(self, s: int, x: torch.Tensor, run: Pass, bounds: list[int]) -> torch.Tensor:
        cfg = self.config
        state = run.state
        layer = s // 2
        module = cfg.module_of(s)
        form = run.plan.form(layer, module)
        w = self.weights.of(layer, module, form.dtype, self.device)
        xin = x.to(form.dtype)
        if module == DENSE:
            y = glu(xin, w.w1, w.w3, w.w2, cfg.moe)
        elif module == MOE:
            routing = self._routing(layer, xin, w, run)
            y = moe_forward(xin, w, cfg.moe, form=form.fn, routing=routing, **dict(form.options))
        elif module == KDA:
            y = self._kda(layer, form, xin, bounds, state)
        else:
            y = self._mla(layer, form, w, xin, bounds, state)
        y = y.to(x.dtype)
        return y if form.tap is None else form.tap(s, y)

    def _routing(self, layer: int, x: torch.Tensor, w: MoEWeights, run: Pass) -> Routing:
        """The layer's routing: its own router's, or the pinned choices with the weights of its own
        router (``p = ρ s_I / Σ s_I`` in the compute dtype); recorded in ``run.routes_out``."""
        dtype = compute_dtype(x.dtype)
        routing = route(x.to(dtype), w.w_router.to(dtype), w.bias.to(dtype), self.config.moe)
        if run.routes_in is not None and layer in run.routes_in:
            pinned = run.routes_in[layer]
            # Rows of -1: tokens that keep their own choices (see RouteBook.pinned).
            indices = torch.where(pinned[:, :1] < 0, routing.indices, pinned)
            scores, p = mixture(x, w.w_router, indices, self.config.moe, dtype)
            routing = Routing(indices, p, scores)
        run.routes_out[layer] = routing.indices
        return routing

    def _kda_layer(self, layer: int, form: Form) -> KDALayer:
        w = self.weights.of(layer, KDA, form.dtype, self.device)
        gates = compute_dtype(form.dtype)
        return KDALayer(self.config.kda, w, gate_dtype=gates, state_dtype=gates)

    def _kda_core(self, fn: Callable[..., Any], form: Form) -> Callable[..., Any]:
        """The form's core as the layer calls it: outputs back in the activations' dtype."""
        def core(q, k, v, g, beta, *, initial_state, output_final_state):
            # The forms take the state in the activations' dtype, kernels in fp32; between calls
            # it is kept in fp32 either way.
            state = initial_state if form.fp32_state else initial_state.to(q.dtype)
            o, S = fn(q, k, v, g, beta, initial_state=state, output_final_state=output_final_state,
                      **(dict(form.options) if fn is form.fn else {}))
            return o.to(q.dtype), S
        return core

    def _kda(self, layer: int, form: Form, x: torch.Tensor, bounds: list[int], state: ServingState) -> torch.Tensor:
        one = self._kda_layer(layer, form)
        decode, prefill = self.split_batch(bounds, state)
        st = state.kda[layer]
        y = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        rows_of = lambda rows: torch.as_tensor(rows, dtype=torch.int64, device=x.device)  # noqa: E731
        new_conv, new_rec = st.conv.clone(), st.recurrent.clone()
        if decode:
            idx = rows_of(decode)
            xs = torch.stack([x[bounds[i]] for i in decode])[:, None]  # [n, 1, d]
            core = self._kda_core(form.decode or kda.recurrent, form)
            out, new = one.decode(xs, KDAState(st.conv[idx], st.recurrent[idx]), core=core)
            for j, i in enumerate(decode):
                y[bounds[i]] = out[j, 0]
            new_conv[idx], new_rec[idx] = new.conv, new.recurrent.to(new_rec.dtype)
        for i in prefill:
            a, b = bounds[i], bounds[i + 1]
            out, new = self.kda_prefill(one, form, x[None, a:b], KDAState(st.conv[i : i + 1], st.recurrent[i : i + 1]))
            y[a:b] = out[0]
            new_conv[i], new_rec[i] = new.conv[0], new.recurrent[0].to(new_rec.dtype)
        state.kda[layer] = KDAState(new_conv, new_rec)
        return y

    def kda_prefill(self, one: KDALayer, form: Form, x: torch.Tensor, st: KDAState) -> tuple[torch.Tensor, KDAState]:
        """One request's prefill ``x:[1, T, d]`` from its state ``st`` (a separate method: the
        chunk boundary a serving engine crosses)."""
        return one.prefill(x, st, core=self._kda_core(form.fn, form))

    @staticmethod
    def split_batch(bounds: list[int], state: ServingState) -> tuple[list[int], list[int]]:
        """``(decode, prefill)`` request indices: one new token after some history decodes; idle
        requests (no new token) are in neither."""
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        decode = [i for i, n in enumerate(sizes) if n == 1 and state.lengths[i] > 0]
        return decode, [i for i, n in enumerate(sizes) if n and i not in decode]

    def _mla(self, layer: int, form: Form, w: object, x: torch.Tensor, bounds: list[int],
             state: ServingState) -> torch.Tensor:
        cfg = self.config.mla
        decode, prefill = self.split_batch(bounds, state)
        cache = state.mla[layer]
        y = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        groups = ([(decode, form.decode or form.fn)] if decode else []) + [([i], form.fn) for i in prefill]
        for rows, fn in groups:
            idx = torch.as_tensor(rows, dtype=torch.int64, device=cache.seq_lens.device)
            part = replace(cache, block_table=cache.block_table[idx], seq_lens=state.mla[layer].seq_lens[idx])
            if len(rows) > 1:
                xs = torch.stack([x[bounds[i]] for i in rows])[:, None]
            else:
                xs = x[None, bounds[rows[0]] : bounds[rows[0] + 1]]
            out = mla_layer.forward(xs, w, cfg, part, form=fn, **(dict(form.options) if fn is form.fn else {}))
            for j, i in enumerate(rows):
                y[bounds[i] : bounds[i + 1]] = out.y[j].to(x.dtype)
            seq = cache.seq_lens.clone()
            seq[idx] = out.cache.seq_lens
            cache = replace(cache, pool=out.cache.pool, scales=out.cache.scales, seq_lens=seq)
        state.mla[layer] = cache
        return y


@dataclass
class Pass:
    """One step in progress: the depth walk, the state being updated, the packed bounds.
    ``advance()`` runs the next sublayer; ``copy.deepcopy`` keeps a resumable point (the first
    divergence search holds two such points instead of every layer's activations)."""

    decoder: Decoder
    plan: Plan
    walk: attnres.DepthWalk
    bounds: list[int]
    state: ServingState
    # MoE expert choices: ``routes_in[layer]:[N, k]`` pins a layer's (a low-precision walk
    # following the fp64 walk's choices, so that its error is arithmetic, not a flipped top-k);
    # ``routes_out`` records the choices every MoE layer made.
    routes_in: Mapping[int, torch.Tensor] | None = None
    routes_out: dict[int, torch.Tensor] = field(default_factory=dict)
    last: torch.Tensor | None = None  # the latest sublayer output
    evaluations: int = 0

    @property
    def done(self) -> bool:
        return self.walk.done

    @property
    def position(self) -> int:
        """The next sublayer call."""
        return self.walk.position

    def advance(self, *, observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the next sublayer; returns its output ``y:[N, d]`` (compute dtype)."""
        s, x = self.walk.next_input()
        y = self.decoder.sublayer(s, x, self)
        self.walk.push(y)
        self.evaluations += 1
        self.last = y
        if observe is not None:
            observe(s, self.walk.hs[s], y)
        return y

    def run_to(self, position: int) -> None:
        """Advance until ``position`` sublayers have run."""
        while self.walk.position < position:
            self.advance()

    def finish(self) -> tuple[list[torch.Tensor], ServingState]:
        """The outputs per request and the new state (every sublayer must have run)."""
        out = self.walk.result().output
        self.state.lengths = [n + b - a for n, a, b in zip(self.state.lengths, self.bounds, self.bounds[1:])]
        return [out[a:b] for a, b in itertools.pairwise(self.bounds)], self.state

    def snapshot(self) -> Pass:
        """An independent copy to resume from (the decoder and plan are shared)."""
        memo = {id(self.decoder): self.decoder, id(self.plan): self.plan}
        if self.routes_in is not None:
            memo[id(self.routes_in)] = self.routes_in
        return copy.deepcopy(self, memo)

"""Serving scenarios: equivalences the stack must satisfy whichever way a server batches it.

Each scenario computes the same tokens two ways, *served* (the way an engine runs them) and by
*definition*, and returns both outputs, token for token in one order:

- ``prefill_decode``: prefill(T) then k decode steps ≡ prefill(T + k);
- ``chunked_prefill``: a prompt in n chunks, each continuing from the carried state ≡ one-shot;
- ``mixed_batch``: requests of different lengths — some decoding one token after their history,
  some continuing a prefill, some new (one of them a single token) — in one packed step ≡ each
  request alone (outputs and the states they leave);
- ``speculative``: draft k tokens one step each, accept the first a, roll back the rest (KDA
  state and conv history restored, MLA slots released and poisoned), then one more token ≡
  decoding only the accepted tokens and that one;
- ``page_placement``: the same requests with the MLA pages in order and shuffled (bitwise in
  fp64: placement only changes where an entry is read from).

A :class:`RouteBook` records the MoE choices of the definition run in fp64, per request and
token, and pins them in low-precision runs, so that what they are judged on is arithmetic and
not a top-k choice that rounding flipped (the flips are counted apart).
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ..kda.layer import KDAState
from ..mla.cache import live_entries, release
from ..numerics.policy import FAIL, FP64_RULE, PASS, POLICY, Verdict
from ..numerics.validate import require_positive_int
from .model import Decoder, Plan, ServingState, fp64_plan


@dataclass
class RouteBook:
    """MoE expert choices per ``(request, layer)``: ``[positions, k]`` in token order. In
    ``record`` mode a session writes the choices its steps made; otherwise it pins them."""

    record: bool = True
    routes: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def served(self) -> RouteBook:
        """The book a served path uses: this one when pinning; in record mode one that records
        nothing and pins nothing (only the definition's choices are recorded)."""
        return RouteBook(record=False) if self.record else self

    def pinned(self, ids: Sequence[str], starts: Sequence[int], sizes: Sequence[int],
               own: Sequence[bool] = ()) -> dict[int, torch.Tensor] | None:
        """The packed ``[N, k]`` choices of one step (requests ``ids`` from ``starts``), per layer;
        rows of ``-1`` for requests whose ``own`` flag is set (they route themselves: a token the
        definition never saw)."""
        if self.record:
            return None
        layers = sorted({layer for (_, layer) in self.routes})
        own = list(own) or [False] * len(ids)
        out = {}
        for layer in layers:
            parts = []
            for r, a, n, mine in zip(ids, starts, sizes, own):
                if n:
                    known = self.routes[(r, layer)]
                    parts.append(torch.full((n, known.shape[1]), -1, dtype=known.dtype, device=known.device) if mine
                                 else known[a : a + n])
            out[layer] = torch.cat(parts)
        return out

    def write(self, ids: Sequence[str], starts: Sequence[int], sizes: Sequence[int],
              made: Mapping[int, torch.Tensor]) -> None:
        """Store one step's choices (``made[layer]:[N, k]`` packed) at their positions."""
        if not self.record:
            return
        offsets = [0, *itertools.accumulate(sizes)]
        for layer, chosen in made.items():
            for r, a, o, n in zip(ids, starts, offsets, sizes):
                if not n:
                    continue
                old = self.routes.get((r, layer), chosen[:0])
                if old.shape[0] != a:
                    raise ValueError(f"request {r!r}: routes recorded to {old.shape[0]}, step starts at {a}")
                self.routes[(r, layer)] = torch.cat([old, chosen[o : o + n]])


@dataclass
class Session:
    """Requests ``ids`` served by one decoder under one plan: their state, their positions, the
    route book. ``step`` takes the new tokens of each request (``None`` or empty: idle)."""

    decoder: Decoder
    plan: Plan
    ids: list[str]
    capacity: int
    book: RouteBook
    page_order: str = "shuffled"
    seed: int = 0
    state: ServingState = field(init=False)
    evaluations: int = 0
    # The last step's token names per request (``"<id>@<position>"``), for saying where two paths differ.
    last_labels: list[list[str]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.decoder.new_state(len(self.ids), self.capacity, self.plan, page_order=self.page_order,
                                            seed=self.seed)

    def step(self, tokens: Sequence[torch.Tensor | None], *, own: Sequence[bool] = ()) -> list[torch.Tensor]:
        """One step; returns each request's outputs (``[0, d]`` for an idle one). Requests flagged
        in ``own`` route their MoE tokens themselves even when the book pins the others."""
        d = self.decoder.config.hidden
        blocks = [torch.zeros(0, d, dtype=torch.float64) if t is None else t for t in tokens]
        sizes = [int(t.shape[0]) for t in blocks]
        starts = list(self.state.lengths)
        run = self.decoder.start(blocks, self.state, self.plan, routes=self.book.pinned(self.ids, starts, sizes, own))
        while not run.done:
            run.advance()
        out, self.state = run.finish()
        self.evaluations += run.evaluations
        self.last_labels = [[f"{r}@{a + t}" for t in range(n)] for r, a, n in zip(self.ids, starts, sizes)]
        self.book.write(self.ids, starts, sizes, run.routes_out)
        return out

    def rollback(self, snapshots: Sequence[ServingState], accepted: Sequence[int]) -> None:
        """Request ``i`` back to the KDA state and conv history it had before its draft token
        ``accepted[i]`` (``snapshots[j]``: the state before draft step ``j``), its MLA cache cut
        back to that length (released slots poisoned)."""
        keep = [snapshots[a].lengths[i] for i, a in enumerate(accepted)]
        kda = kda_states_at(snapshots, accepted)
        self.state = ServingState(keep, kda, {layer: release(c, keep) for layer, c in self.state.mla.items()})


def kda_states_at(snapshots: Sequence[ServingState], steps: Sequence[int]) -> dict[int, KDAState]:
    """Every KDA layer's state with request ``i``'s row taken from ``snapshots[steps[i]]``."""
    out = {}
    for layer in snapshots[0].kda:
        conv = torch.stack([snapshots[j].kda[layer].conv[i] for i, j in enumerate(steps)])
        rec = torch.stack([snapshots[j].kda[layer].recurrent[i] for i, j in enumerate(steps)])
        out[layer] = KDAState(conv, rec)
    return out


@dataclass(frozen=True)
class Path:
    """One way of computing a scenario's tokens: ``out:[tokens, d]`` (stream dtype) in the
    scenario's token order, the states it leaves as one fp64 vector (:func:`state_vector`),
    ``evaluations`` (sublayer calls it took) and each output row's name (``"<request>@<position>"``)."""

    out: torch.Tensor
    state: torch.Tensor
    evaluations: int
    labels: tuple[str, ...] = ()


def state_vector(state: ServingState, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Every request's carried state as one fp64 vector (KDA conv and recurrent state, MLA live
    entries), requests ``rows`` in that order: what two ways of serving must leave alike."""
    rows = list(range(state.batch)) if rows is None else list(rows)
    parts = []
    for r in rows:
        for layer in sorted(state.kda):
            s = state.kda[layer]
            parts += [s.conv[r].double().flatten(), s.recurrent[r].double().flatten()]
        for layer in sorted(state.mla):
            c = state.mla[layer]
            one = replace(c, block_table=c.block_table[r : r + 1], seq_lens=c.seq_lens[r : r + 1])
            parts.append(live_entries(one).double().flatten())
    return torch.cat(parts)


def embeddings(decoder: Decoder, n: int, *, seed: int) -> torch.Tensor:
    """``n`` token embeddings ``[n, d]`` fp64 of unit RMS (an embedding table's rows)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, decoder.config.hidden, generator=gen, dtype=torch.float64)


PathFn = Callable[[Decoder, Plan, RouteBook, "ScenarioSizes"], Path]


@dataclass(frozen=True)
class Scenario:
    """An equivalence: ``served`` (how an engine runs it) must equal ``definition``; ``detail``
    describes it for ``sizes``; ``bitwise``: equal bit for bit in fp64, not within 1e-10."""

    name: str
    served: PathFn
    definition: PathFn
    detail: Callable[[ScenarioSizes], str]
    bitwise: bool = False


@dataclass(frozen=True)
class ScenarioSizes:
    """Token counts of the scenarios: a ``prompt`` of T tokens, ``decode`` steps and ``chunks`` of
    chunked prefill; ``short`` prompts (histories of the mixed batch, speculative prompts, page
    placement: what matters there is batching, not length); speculative decoding drafts
    ``draft`` tokens for each of ``len(accept)`` requests, which accept ``accept[i]`` of them,
    then decode ``after`` more; the seed."""

    prompt: int = 64
    decode: int = 8
    chunks: int = 4
    short: int = 24
    draft: int = 3
    accept: tuple[int, ...] = (0, 1, 2, 1)
    after: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt", "chunks", "short", "draft"):
            require_positive_int(name, getattr(self, name))
        for name in ("decode", "after"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not self.accept or not all(isinstance(a, int) and 0 <= a < self.draft for a in self.accept):
            raise ValueError(f"accept must be one count in [0, draft={self.draft}) per request; got {self.accept!r}")
        if self.chunks > self.prompt:
            raise ValueError(f"cannot cut a prompt of {self.prompt} tokens into {self.chunks} chunks")


def _steps(decoder: Decoder, plan: Plan, book: RouteBook, ids: list[str], capacity: int,
           steps: Sequence[Sequence[torch.Tensor | None]], *, keep: Sequence[bool] | None = None,
           **kw: object) -> Path:
    """A session of ``ids`` fed ``steps`` (one token block per request each); the outputs of the
    steps ``keep`` marks (all by default), request by request within a step, in step order."""
    s = Session(decoder, plan, ids, capacity, book, **kw)  # type: ignore[arg-type]
    outs, labels = [], []
    for i, tokens in enumerate(steps):
        got = s.step(tokens)
        if keep is None or keep[i]:
            outs += got
            labels += [name for names in s.last_labels for name in names]
    return Path(torch.cat(outs), state_vector(s.state), s.evaluations, tuple(labels))


def _prompt(decoder: Decoder, sizes: ScenarioSizes, n: int, salt: int) -> torch.Tensor:
    return embeddings(decoder, n, seed=sizes.seed + salt)


def _prefill_decode_served(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    T, k = sizes.prompt, sizes.decode
    x = _prompt(decoder, sizes, T + k, 0)
    return _steps(decoder, plan, book.served(), ["r"], T + k, [[x[:T]], *([x[T + i : T + i + 1]] for i in range(k))])


def _prefill_decode_definition(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    T, k = sizes.prompt, sizes.decode
    return _steps(decoder, plan, book, ["r"], T + k, [[_prompt(decoder, sizes, T + k, 0)]])


def _chunked_served(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    x = _prompt(decoder, sizes, sizes.prompt, 1)
    cuts = chunk_bounds(sizes.prompt, sizes.chunks)
    return _steps(decoder, plan, book.served(), ["r"], sizes.prompt, [[x[a:b]] for a, b in itertools.pairwise(cuts)])


def _chunked_definition(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    return _steps(decoder, plan, book, ["r"], sizes.prompt, [[_prompt(decoder, sizes, sizes.prompt, 1)]])


def chunk_bounds(T: int, n: int) -> list[int]:
    """``n`` chunks of ``T`` tokens cut off the even split (and off KDA's 64-token chunks),
    ``[0, c1, …, T]``."""
    if not 1 <= n <= T:
        raise ValueError(f"cannot cut {T} tokens into {n} chunks")
    cuts = {min(T - (n - i), max(i, round(i * T / n) + (1 if i % 2 else -1))) for i in range(1, n)}
    return [0, *sorted(cuts), T]


# The mixed batch, as fractions of ``short``: (history tokens, new tokens) per request; "fresh"
# and "single" are new requests, "single" a one-token prefill; two decode in one batched call.
MIXED = {"continue": (1.0, 0.4), "decode": (0.7, 0), "fresh": (0, 0.55), "single": (0, 0), "decode2": (1.25, 0)}


def mixed_lengths(sizes: ScenarioSizes) -> dict[str, tuple[int, int]]:
    """``(history, new)`` tokens per request of the mixed batch (a new count of 0 in
    :data:`MIXED` is one token)."""
    return {r: (round(h * sizes.short), max(1, round(n * sizes.short))) for r, (h, n) in MIXED.items()}


def _mixed_tokens(decoder: Decoder, sizes: ScenarioSizes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for i, (r, (h, n)) in enumerate(mixed_lengths(sizes).items()):
        x = _prompt(decoder, sizes, h + n, 10 + i)
        out[r] = (x[:h], x[h:])
    return out


def _mixed_served(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    tok = _mixed_tokens(decoder, sizes)
    ids = list(MIXED)
    capacity = max(h + n for h, n in mixed_lengths(sizes).values())
    # Histories in one packed step (requests with none idle), then every request's new tokens in one.
    return _steps(decoder, plan, book.served(), ids, capacity, [[tok[r][0] for r in ids], [tok[r][1] for r in ids]],
                  keep=[False, True])


def _mixed_definition(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    tok = _mixed_tokens(decoder, sizes)
    capacity = max(h + n for h, n in mixed_lengths(sizes).values())
    paths = []
    for r, (h, _) in mixed_lengths(sizes).items():
        steps = ([[tok[r][0]]] if h else []) + [[tok[r][1]]]
        paths.append(_steps(decoder, plan, book, [r], capacity, steps, keep=[False] * (len(steps) - 1) + [True]))
    return Path(torch.cat([p.out for p in paths]), torch.cat([p.state for p in paths]),
                sum(p.evaluations for p in paths), tuple(n for p in paths for n in p.labels))


Rollback = Callable[["Session", list[ServingState], Sequence[int]], None]


def roll_back(session: Session, snapshots: list[ServingState], accepted: Sequence[int]) -> None:
    """Each request back to the state kept before its first rejected draft token."""
    session.rollback(snapshots, accepted)


def _speculative_tokens(decoder: Decoder, sizes: ScenarioSizes
                        ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per request: its prompt (half of ``short``, less 1 per request), its draft tokens, the tokens after."""
    out = []
    for i in range(len(sizes.accept)):
        T = max(1, sizes.short // 2 - i)
        x = _prompt(decoder, sizes, T + sizes.draft + sizes.after, 30 + i)
        out.append((x[:T], x[T : T + sizes.draft], x[T + sizes.draft :]))
    return out


def speculative_served(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes, *,
                       rollback: Rollback = roll_back) -> Path:
    """Requests prefill their prompts, draft ``draft`` tokens one batched step each (the state
    kept before each step), request ``i`` accepts the first ``accept[i]``; ``rollback``; then
    ``after`` batched decode steps. Outputs: each request's accepted tokens, then the steps after."""
    tok = _speculative_tokens(decoder, sizes)
    ids = [f"s{i}" for i in range(len(tok))]
    capacity = max(p.shape[0] for p, _, _ in tok) + sizes.draft + sizes.after
    s = Session(decoder, plan, ids, capacity, book.served())
    s.step([p for p, _, _ in tok])
    snapshots, drafted = [], []
    for j in range(sizes.draft):
        snapshots.append(s.state.copy())
        # A rejected token was never in the definition: it routes itself.
        got = s.step([d[j : j + 1] for _, d, _ in tok], own=[j >= a for a in sizes.accept])
        drafted.append(list(zip(got, s.last_labels)))
    rollback(s, snapshots, list(sizes.accept))
    kept = [drafted[j][i] for i in range(len(tok)) for j in range(sizes.accept[i])]
    for j in range(sizes.after):
        got = s.step([a[j : j + 1] for _, _, a in tok])
        kept += list(zip(got, s.last_labels))
    return Path(torch.cat([o for o, _ in kept]), state_vector(s.state), s.evaluations,
                tuple(n for _, names in kept for n in names))


def _speculative_definition(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
    tok = _speculative_tokens(decoder, sizes)
    ids = [f"s{i}" for i in range(len(tok))]
    capacity = max(p.shape[0] for p, _, _ in tok) + sizes.draft + sizes.after
    s = Session(decoder, plan, ids, capacity, book)
    s.step([p for p, _, _ in tok])
    accepted: list[list[tuple[torch.Tensor, list[str]]]] = [[] for _ in tok]
    for j in range(max(sizes.accept, default=0)):
        got = s.step([d[j : j + 1] if j < a else None for (_, d, _), a in zip(tok, sizes.accept)])
        for i, a in enumerate(sizes.accept):
            if j < a:
                accepted[i].append((got[i], s.last_labels[i]))
    kept = [pair for per in accepted for pair in per]
    for j in range(sizes.after):
        got = s.step([a[j : j + 1] for _, _, a in tok])
        kept += list(zip(got, s.last_labels))
    return Path(torch.cat([o for o, _ in kept]), state_vector(s.state), s.evaluations,
                tuple(n for _, names in kept for n in names))


def _placement(order: str) -> PathFn:
    def path(decoder: Decoder, plan: Plan, book: RouteBook, sizes: ScenarioSizes) -> Path:
        T, k = sizes.short, min(sizes.decode, 3)
        xs = [_prompt(decoder, sizes, T + k, 20 + i) for i in range(2)]
        steps = [[xs[0][:T], xs[1][: T // 2]], [xs[0][T : T + 1], xs[1][T // 2 : T // 2 + k]]]
        pages_book = book if order == "in_order" else book.served()
        return _steps(decoder, plan, pages_book, ["p0", "p1"], T + k, steps, page_order=order, seed=sizes.seed + 5)
    return path


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("prefill_decode", _prefill_decode_served, _prefill_decode_definition,
             lambda z: f"prefill {z.prompt} + {z.decode} decode steps ≡ prefill {z.prompt + z.decode}"),
    Scenario("chunked_prefill", _chunked_served, _chunked_definition,
             lambda z: f"{z.prompt} tokens in chunks {chunk_bounds(z.prompt, z.chunks)} ≡ one-shot"),
    Scenario("mixed_batch", _mixed_served, _mixed_definition,
             lambda z: "one packed step of " + ", ".join(f"{r} ({h} + {n})" for r, (h, n) in mixed_lengths(z).items())
             + " ≡ each alone"),
    Scenario("speculative", speculative_served, _speculative_definition,
             lambda z: f"{len(z.accept)} requests draft {z.draft} tokens, accept {list(z.accept)}, roll back, "
             f"decode {z.after} more ≡ decoding only the accepted tokens and those"),
    Scenario("page_placement", _placement("shuffled"), _placement("in_order"),
             lambda z: "two requests with MLA pages shuffled ≡ in order", bitwise=True),
)}


@dataclass(frozen=True)
class Check:
    """A scenario checked in fp64: verdicts on the outputs (``y``) and the states left
    (``state``), fp64 agreement or bit for bit; ``where``: the first output token beyond the
    rule (``"<request>@<position>"``), ``None`` when all agree; both paths and the route book
    the definition recorded (for pinning low-precision runs)."""

    y: Verdict
    state: Verdict
    where: str | None
    served: Path
    definition: Path
    book: RouteBook

    @property
    def passed(self) -> bool:
        return self.y.passed and self.state.passed


def agreement(out: torch.Tensor, ref: torch.Tensor, *, bitwise: bool = False) -> Verdict:
    """fp64 agreement of ``out`` with ``ref`` (normwise relative max error ≤ 1e-10), or
    bit-for-bit equality (``bitwise``); a shape mismatch fails with its reason."""
    if out.shape != ref.shape:
        return Verdict(FAIL, FP64_RULE, "shape", math.inf, 0.0, -math.inf,
                       f"shapes differ: {list(out.shape)} vs {list(ref.shape)}")
    if bitwise:
        same = bool(torch.equal(out, ref))
        err = 0.0 if same else float((out.double() - ref.double()).abs().nan_to_num(math.inf).max())
        return Verdict(PASS if same else FAIL, FP64_RULE, "bitwise", err, 0.0, 1.0 if same else -math.inf,
                       "bit for bit equal" if same else f"not bit for bit equal: max |difference| {err:.3e}")
    return POLICY[FP64_RULE].judge(out.double(), ref.double()).verdict


def first_beyond(out: torch.Tensor, ref: torch.Tensor, labels: Sequence[str], *, rel: float = 1e-10) -> str | None:
    """The first output row (its label) whose largest difference exceeds ``rel`` of ``max|ref|``
    (or is not finite)."""
    scale = float(ref.double().abs().max()) or 1.0
    diff = (out.double() - ref.double()).abs().reshape(out.shape[0], -1).amax(-1).nan_to_num(math.inf)
    bad = (diff > rel * scale).nonzero()
    if not bad.numel():
        return None
    i = int(bad[0])
    return labels[i] if i < len(labels) else f"row {i}"


def check(scenario: Scenario, decoder: Decoder, sizes: ScenarioSizes, *, served_decoder: Decoder | None = None,
          served_plan: Plan | None = None, rollback: Rollback | None = None) -> Check:
    """``scenario`` in fp64: the definition by ``decoder`` (fp64 chunkwise forms, its MoE choices
    recorded), the served path by ``served_decoder`` / ``served_plan`` / ``rollback`` when given
    (a planted bug; ``rollback`` reaches only a scenario that rolls back), else the same."""
    plan = fp64_plan("chunkwise")
    book = RouteBook()
    definition = scenario.definition(decoder, plan, book, sizes)
    # A rollback only exists where the served path rolls back (speculative decoding).
    rolls_back = rollback is not None and "rollback" in inspect.signature(scenario.served).parameters
    served_fn = partial(scenario.served, rollback=rollback) if rolls_back else scenario.served
    served = served_fn(served_decoder or decoder, served_plan or plan, book, sizes)
    y = agreement(served.out, definition.out, bitwise=scenario.bitwise)
    state = agreement(served.state, definition.state, bitwise=scenario.bitwise)
    where = None
    if not y.passed and served.out.shape == definition.out.shape:
        where = first_beyond(served.out, definition.out, definition.labels, rel=0.0 if scenario.bitwise else 1e-10)
    return Check(y, state, where, served, definition, book)

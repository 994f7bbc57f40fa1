"""The Block AttnRes depth walk: 2L sublayer calls and the output call over the schedule (docs/model.md §0, §3).

For every call ``s`` of :meth:`Schedule.calls` (attention of layer ``l`` at ``2l``, its MLP at
``2l + 1``, the output call last):

    h_s = AttnRes(sources_s; w_s, γ_s)                 (form-specific: one-shot, two-phase, tiled)
    x_s = RMSNorm_{norm_s}(h_s)                        (the sublayer's input norm, eps 1e-5)
    y_s = f_s(x_s)                                     (the sublayer; a stand-in here)

and ``y_s`` joins the depth stream: it starts the partial sum at a block start and is added to
it otherwise (in the stream dtype, as vLLM keeps the prefix in BF16); the sum becomes a stored
block once its block is complete. The output call returns ``h`` without a norm.

Sublayers are any callable ``f(s, x) -> y`` with ``x, y:[T, d]``. :class:`StandInSublayers`
gives cheap deterministic ones (``y = W_out tanh(W_in x)``, seeded) so that the full 93-layer
walk runs in well under a second on a CPU at small ``d``; the AttnRes arithmetic does not depend
on what the sublayers compute.

Weights are laid out per call: ``w, gamma:[2L + 1, d]`` (separate pseudo-query and key gain for
the attention side, the MLP side of every layer and the final output), ``norm:[2L, d]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..numerics import round_to
from ..numerics.ops import rms_norm
from ..numerics.trace import OverflowEvent
from ..numerics.validate import require_finite, require_float, require_shape, require_tensor
from .inputs import Options, Precision, Sublayers, floats_together
from .schedule import BLOCK, EMBEDDING, PARTIAL, Call, Schedule, Source


@dataclass(frozen=True)
class AttnResWeights:
    """AttnRes parameters of a whole model, one row per call.

    ``w:[2L + 1, d]`` pseudo-queries, ``gamma:[2L + 1, d]`` key-norm gains (row ``2l``: attention
    side of layer ``l``; ``2l + 1``: MLP side; ``2L``: the final output AttnRes), ``norm:[2L, d]``
    the input RMSNorm gains of the sublayers.
    """

    w: torch.Tensor
    gamma: torch.Tensor
    norm: torch.Tensor

    def to(self, dtype: torch.dtype) -> AttnResWeights:
        return AttnResWeights(self.w.to(dtype), self.gamma.to(dtype), self.norm.to(dtype))


def init_weights(
    schedule: Schedule,
    d: int,
    *,
    logit_scale: float = 16.0,
    seed: int = 0,
    representable: str | None = "bf16",
) -> AttnResWeights:
    """Random fp64 weights with ``‖w_s ⊙ γ_s‖ · sqrt(d) = logit_scale`` for every call.

    ``logit_scale`` bounds every logit (Cauchy–Schwarz: ``|wᵀ RMSNorm_γ(v)| ≤ ‖w⊙γ‖ ‖v̂‖`` and
    ``‖v̂‖ ≤ sqrt(d)``). Gains are ``1 + 0.1 N(0, 1)``. With ``representable`` every value is
    rounded to that dtype, so the same parameters serve every stream precision exactly and a
    low-precision run differs from the oracle only by its own arithmetic.
    """
    gen = torch.Generator().manual_seed(seed)
    C, S = schedule.num_calls, schedule.num_sublayers
    gamma = 1 + 0.1 * torch.randn(C, d, generator=gen, dtype=torch.float64)
    direction = torch.randn(C, d, generator=gen, dtype=torch.float64)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    w = logit_scale * d**-0.5 * direction / gamma
    norm = 1 + 0.1 * torch.randn(S, d, generator=gen, dtype=torch.float64)
    if representable is not None:
        w, gamma, norm = (round_to(t, representable) for t in (w, gamma, norm))
    return AttnResWeights(w, gamma, norm)


@dataclass(frozen=True)
class StandInSublayers:
    """Deterministic stand-in sublayers ``f_s(x) = W_out,s tanh(W_in,s x)`` (``d → hidden → d``).

    ``w_in:[S, d, hidden]``, ``w_out:[S, hidden, d]``. Computes in ``x``'s dtype, on its device. Made by
    :meth:`make`; a plain dataclass of tensors, so a case holding it can be stored as goldens.
    """

    w_in: torch.Tensor
    w_out: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cast", {})  # per-dtype copies, not a field

    @classmethod
    def make(cls, num_sublayers: int, d: int, *, hidden: int | None = None, gain: float = 1.0, seed: int = 0,
             representable: str | None = "bf16") -> StandInSublayers:
        """``W_in ~ N(0, 1/d)``, ``W_out ~ N(0, gain²/hidden)`` (unit-scale outputs for unit-RMS
        inputs), rounded to ``representable`` so every stream precision runs the same sublayers."""
        hidden = hidden or d
        gen = torch.Generator().manual_seed(seed + 7919)
        w_in = torch.randn(num_sublayers, d, hidden, generator=gen, dtype=torch.float64) * d**-0.5
        w_out = torch.randn(num_sublayers, hidden, d, generator=gen, dtype=torch.float64) * gain * hidden**-0.5
        if representable is not None:
            w_in, w_out = round_to(w_in, representable), round_to(w_out, representable)
        return cls(w_in, w_out)

    def __call__(self, s: int, x: torch.Tensor) -> torch.Tensor:
        cast = self._cast  # type: ignore[attr-defined]
        key = (x.dtype, x.device)
        if key not in cast:
            cast[key] = (self.w_in.to(x.device, x.dtype), self.w_out.to(x.device, x.dtype))
        w_in, w_out = cast[key]
        return torch.tanh(x @ w_in[s]) @ w_out[s]


def check_walk(embedding: torch.Tensor, weights: object, sublayers: object, schedule: object) -> None:
    """Validate a walk: ``embedding:[T, d]``, weights shaped for ``schedule``, callable sublayers."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a k3verify.attnres.Schedule, got {type(schedule).__name__}")
    if not isinstance(weights, AttnResWeights):
        raise TypeError(f"weights must be a k3verify.attnres.AttnResWeights, got {type(weights).__name__}")
    if not callable(sublayers):
        raise TypeError(f"sublayers must be callable as sublayers(index, x), got {type(sublayers).__name__}")
    names = ["embedding", "weights.w", "weights.gamma", "weights.norm"]
    tensors = floats_together(names, [embedding, weights.w, weights.gamma, weights.norm])
    if embedding.dim() != 2:
        raise ValueError(f"embedding has shape {list(embedding.shape)}; expected [T, d]")
    d = embedding.shape[1]
    if d == 0:
        raise ValueError("embedding has width d = 0")
    C, S = schedule.num_calls, schedule.num_sublayers
    require_shape("weights.w", weights.w, (C, d), "calls,d")
    require_shape("weights.gamma", weights.gamma, (C, d), "calls,d")
    require_shape("weights.norm", weights.norm, (S, d), "sublayers,d")
    for n, t in zip(names, tensors):
        require_finite(n, t)


def check_sublayer_output(index: int, y: object, like: torch.Tensor) -> torch.Tensor:
    """A sublayer must return a float tensor shaped like its input, finite wherever its input is
    (a non-finite input, from an overflowing mixture, may propagate; a sublayer that makes NaN
    from finite numbers is a broken sublayer, not a result)."""
    y = require_tensor(f"sublayers({index}, x)", y)
    require_float(f"sublayers({index}, x)", y)
    require_shape(f"sublayers({index}, x)", y, tuple(like.shape), "T,d")
    if bool(torch.isfinite(like).all()):
        require_finite(f"sublayers({index}, x) (its input is finite)", y)
    return y


@dataclass(frozen=True)
class Walk:
    """Result of a depth walk.

    ``output:[T, d]``: the final output AttnRes (no norm), in the stream dtype.
    ``h:[2L + 1, T, d]``: every call's AttnRes output before its sublayer's input norm, in the
    compute dtype (the depth-drift curve is read from it).
    ``sources``: for every call, the sources it mixed, in order (as the form holds them).
    ``blocks:[n, T, d]``: the stored block representations at the end of the walk, in the order
    they were stored (``b_0``, the embedding, first), as the form holds them, in the stream dtype.
    ``events``: the first overflows of stored tensors (when traced).
    """

    output: torch.Tensor
    h: torch.Tensor
    sources: tuple[tuple[Source, ...], ...]
    blocks: torch.Tensor
    events: tuple[OverflowEvent, ...] = ()


class Mixer(Protocol):
    """What a form supplies to the walk: each call's mixture, how outputs join the stream, and
    the stored blocks (values held in the compute dtype)."""

    def mix(self, call: Call) -> tuple[torch.Tensor, tuple[Source, ...]]: ...

    def push(self, s: int, y: torch.Tensor) -> None: ...

    def stored(self) -> list[torch.Tensor]: ...


MixerFactory = Callable[[torch.Tensor, AttnResWeights, Schedule, Precision, Options], Mixer]


def walk(
    embedding: torch.Tensor,
    weights: AttnResWeights,
    sublayers: Sublayers,
    schedule: Schedule,
    opts: Options,
    make_mixer: MixerFactory,
    *,
    trace: bool = False,
) -> Walk:
    """Drive the depth walk with a form's mixer (see the module docstring)."""
    check_walk(embedding, weights, sublayers, schedule)
    stepper = DepthWalk(embedding, weights, schedule, opts, make_mixer, trace=trace, checked=True)
    while not stepper.done:
        s, x = stepper.next_input()
        stepper.push(check_sublayer_output(s, sublayers(s, x), x))
    return stepper.result()


class DepthWalk:
    """The depth walk one sublayer at a time, for callers that own the sublayers' state (a
    decoder carrying caches between calls): ``next_input()`` mixes the next call and returns its
    sublayer's normalised input ``x:[T, d]`` (compute dtype), ``push(y)`` hands the sublayer's
    output back; after the last sublayer the output call is mixed and ``result()`` returns the
    :class:`Walk`. A copy (``copy.deepcopy``) resumes from the same point: the stream is all the
    state a walk has.
    """

    def __init__(self, embedding: torch.Tensor, weights: AttnResWeights, schedule: Schedule, opts: Options,
                 make_mixer: MixerFactory, *, trace: bool = False, checked: bool = False):
        if not checked:
            check_walk(embedding, weights, lambda s, x: x, schedule)
        self.schedule, self.opts = schedule, opts
        self.prec = prec = opts.precision(embedding.dtype, trace=trace)
        e = prec.store("embedding", embedding)
        self.params = AttnResWeights(*(prec.store(f"weights.{n}", getattr(weights, n)) for n in ("w", "gamma", "norm")))
        self.mixer = make_mixer(e, self.params, schedule, prec, opts)
        self.calls = schedule.calls()
        self.hs: list[torch.Tensor] = []
        self.used: list[tuple[Source, ...]] = []
        self.position = 0  # the next sublayer call
        self._pending: int | None = None

    @property
    def done(self) -> bool:
        """True once every sublayer has run (the output call is mixed)."""
        return self.position == self.schedule.num_sublayers and self._pending is None

    def next_input(self) -> tuple[int, torch.Tensor]:
        """``(s, x)``: mix call ``s`` and return its sublayer's input ``RMSNorm(h_s)``."""
        if self._pending is not None or self.position >= self.schedule.num_sublayers:
            raise RuntimeError("push() the pending sublayer's output first" if self._pending is not None
                               else "the walk is complete")
        s = self.position
        h, refs = self.mixer.mix(self.calls[s])
        self.hs.append(h)
        self.used.append(refs)
        self._pending = s
        return s, self.prec.store("sublayer input", rms_norm(h, self.params.norm[s], eps=self.opts.eps))

    def push(self, y: torch.Tensor) -> None:
        """The output of the pending sublayer joins the stream."""
        if self._pending is None:
            raise RuntimeError("no sublayer input is pending")
        self.mixer.push(self._pending, self.prec.store("sublayer output", y.to(self.prec.compute)))
        self._pending = None
        self.position += 1
        if self.position == self.schedule.num_sublayers:
            h, refs = self.mixer.mix(self.calls[-1])
            self.hs.append(h)
            self.used.append(refs)

    def result(self) -> Walk:
        """The finished walk (every call's ``h``, the output, the stored blocks)."""
        if not self.done:
            raise RuntimeError(f"the walk stopped before sublayer {self.position}")
        # Stored blocks already hold stream values, so the cast to the stream dtype is exact.
        blocks = torch.stack(self.mixer.stored()).to(self.prec.stream)
        return Walk(self.prec.output(self.hs[-1]), torch.stack(self.hs), tuple(self.used), blocks,
                    tuple(self.prec.rounder.events))


class DepthStream:
    """The stream as a deployment keeps it: stored blocks ``[b_0 …]`` and one partial sum.

    The partial sum is rounded to the stream dtype after every addition (vLLM keeps it in BF16);
    a completed block is stored as is. Sources are tagged with the sublayer range they sum.
    """

    def __init__(self, embedding: torch.Tensor, schedule: Schedule, prec: Precision):
        self.schedule, self.prec = schedule, prec
        self.blocks: list[torch.Tensor] = [embedding]
        self.block_refs: list[Source] = [Source(EMBEDDING)]
        self.partial: torch.Tensor | None = None
        self.partial_ref: Source | None = None

    def push(self, s: int, y: torch.Tensor) -> None:
        if self.partial is None:
            self.partial, first = y, s
        else:
            self.partial, first = self.prec.store("partial sum", self.partial + y), self.partial_ref.first
        self.partial_ref = Source(PARTIAL, first, s + 1)
        if self.schedule.closes_block(s):
            self.blocks.append(self.partial)
            self.block_refs.append(Source(BLOCK, first, s + 1))
            self.partial = self.partial_ref = None

    def stored(self) -> list[torch.Tensor]:
        """The stored blocks ``[b_0 …]`` so far."""
        return list(self.blocks)

    def sources(self) -> tuple[list[torch.Tensor], tuple[Source, ...]]:
        """Every source of the next call, in order: stored blocks, then the partial sum if any."""
        if self.partial is None:
            return list(self.blocks), tuple(self.block_refs)
        return [*self.blocks, self.partial], (*self.block_refs, self.partial_ref)

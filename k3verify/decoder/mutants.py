"""Planted serving bugs: the classes public K3 serving stacks have shipped, for showing that the
serving scenarios catch them (tests and the selftest). Each names the scenario that must fail.

- :class:`ConvResetAtChunk`: the KDA conv history is reset when a prefill continues from a
  carried state (a chunk boundary) — ``chunked_prefill`` fails.
- :func:`transposed_state`: the chunk kernel reads the carried state as ``[V, K]`` when it is
  stored ``[K, V]``, which only matters when the state is non-zero (vLLM PR 40956: prefill with a
  state wrong, decode right) — ``chunked_prefill`` fails, ``prefill_decode`` passes.
- :class:`LengthOneInMixedBatch`: in a batch that mixes prefills and decodes, one-token requests
  go through the chunk path, which returns NaN for a one-token sequence with a state (vLLM PR
  50649) — ``mixed_batch`` fails.
- :func:`rollback_keeps_one`: a speculative rollback that restores the KDA state one draft token
  too late (keeping a rejected token's update) — ``speculative`` fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kda.layer import KDALayer, KDAState
from .config import KDA
from .model import Decoder, Form, Plan, ServingState
from .scenarios import Session, kda_states_at


class ConvResetAtChunk(Decoder):
    """A prefill that continues from a carried state starts with an empty conv history."""

    def kda_prefill(self, one: KDALayer, form: Form, x: torch.Tensor, st: KDAState) -> tuple[torch.Tensor, KDAState]:
        return super().kda_prefill(one, form, x, KDAState(torch.zeros_like(st.conv), st.recurrent))


def transposed_state(plan: Plan) -> Plan:
    """``plan`` with a KDA core that reads a non-zero initial state transposed."""
    form = plan.forms[KDA]

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
             initial_state: torch.Tensor | None = None, **kw: Any) -> Any:
        if initial_state is not None and bool(initial_state.ne(0).any()):
            initial_state = initial_state.transpose(-1, -2)
        return form.fn(q, k, v, g, beta, initial_state=initial_state, **kw)

    return plan.with_forms(f"{plan.label}, state read transposed", kda=replace(form, fn=core, label=f"{form.label}*"))


class LengthOneInMixedBatch(Decoder):
    """Decoding requests batched with prefills take the chunk path, which returns NaN for a
    one-token sequence that carries a state."""

    def split_batch(self, bounds: list[int], state: ServingState) -> tuple[list[int], list[int]]:
        decode, prefill = super().split_batch(bounds, state)
        return ([], sorted(decode + prefill)) if decode and prefill else (decode, prefill)

    def kda_prefill(self, one: KDALayer, form: Form, x: torch.Tensor, st: KDAState) -> tuple[torch.Tensor, KDAState]:
        y, new = super().kda_prefill(one, form, x, st)
        if x.shape[1] == 1 and bool(st.recurrent.ne(0).any()):
            y = torch.full_like(y, float("nan"))
        return y, new


def rollback_keeps_one(session: Session, snapshots: list[ServingState], accepted: Sequence[int]) -> None:
    """The MLA caches cut back correctly, but each request's KDA state restored from one draft
    step later than it should (the first rejected token's update kept)."""
    session.rollback(snapshots, accepted)
    late = [min(a + 1, len(snapshots) - 1) for a in accepted]
    session.state = ServingState(session.state.lengths, kda_states_at(snapshots, late), session.state.mla)


@dataclass(frozen=True)
class Mutant:
    """A planted serving bug: how to build it and the scenario that must catch it."""

    name: str
    scenario: str
    decoder: type[Decoder] = Decoder
    plan: Callable[[Plan], Plan] | None = None
    rollback: Callable[..., None] | None = None
    description: str = ""


MUTANTS = (
    Mutant("conv history reset at a chunk boundary", "chunked_prefill", decoder=ConvResetAtChunk,
           description="a continuing prefill starts from an empty conv history"),
    Mutant("state read transposed when non-zero", "chunked_prefill", plan=transposed_state,
           description="the chunk core reads the carried [K, V] state as [V, K]"),
    Mutant("length-1 request in a mixed batch", "mixed_batch", decoder=LengthOneInMixedBatch,
           description="one-token requests batched with prefills take the chunk path and come back NaN"),
    Mutant("rollback keeps a rejected token", "speculative", rollback=rollback_keeps_one,
           description="the KDA state is restored one draft token late"),
)

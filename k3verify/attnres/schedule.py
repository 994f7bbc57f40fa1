"""The Block AttnRes depth schedule: which sources every AttnRes call mixes, in which order (docs/model.md §3).

A model of ``L`` layers makes ``2L`` sublayer calls (attention of layer ``l`` is call ``2l``, its
MLP call ``2l + 1``) and one final output call (``2L``). Every call first mixes its depth sources
by AttnRes. Sublayer outputs are grouped into blocks of ``block_sublayers`` consecutive calls
(K3: 12 layers = 24 sublayers). Before call ``s`` of block ``k = s // block_sublayers``:

- the stored sources are the embedding ``b_0`` and the completed blocks ``b_1 … b_k``, where
  ``b_j`` is the sum of the outputs of the sublayers of block ``j - 1``;
- if ``s`` is not the first call of its block, the current partial sum (the outputs of the calls
  of block ``k`` before ``s``) is the last source.

This is vLLM's rule restated: there the prefix ``p`` (embedding at first) becomes ``b_k`` at a
block start and is stored, and the attention side mixes ``B[0:ceil(l/12)] + [p]``; at a block
start ``p`` *is* the newest stored block, so it is listed once. With ``block_sublayers = 1``
every sublayer output is its own source: Full AttnRes.

For K3 (93 layers, 12 per block): 7 full blocks and a 9-layer tail, at most 9 sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..numerics.validate import require_positive_int

EMBEDDING = "embedding"
BLOCK = "block"
PARTIAL = "partial"
ATTENTION, MLP, OUTPUT = "attn", "mlp", "output"


@dataclass(frozen=True)
class Source:
    """One depth source: the embedding, or the sum of sublayer outputs ``first ≤ s < stop``.

    ``kind`` is ``"embedding"`` (``first = stop = 0``), ``"block"`` (a completed block) or
    ``"partial"`` (the running sum of the current block).
    """

    kind: str
    first: int = 0
    stop: int = 0

    def __str__(self) -> str:
        return "b0" if self.kind == EMBEDDING else f"{self.kind}[{self.first}:{self.stop}]"


@dataclass(frozen=True)
class Call:
    """One AttnRes call: its index, 0-indexed layer, side (``attn``/``mlp``/``output``) and sources."""

    index: int
    layer: int
    side: str
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class Schedule:
    """``num_layers`` layers in blocks of ``block_sublayers`` sublayer calls (K3: 93 and 24)."""

    num_layers: int = 93
    block_sublayers: int = 24

    def __post_init__(self) -> None:
        require_positive_int("num_layers", self.num_layers)
        require_positive_int("block_sublayers", self.block_sublayers)

    @classmethod
    def layers(cls, block_size: int = 12, num_layers: int = 93) -> Schedule:
        """Blocks of ``block_size`` layers (the config's ``attn_res_block_size``), 2 sublayers each."""
        require_positive_int("block_size", block_size)
        return cls(num_layers, 2 * block_size)

    @classmethod
    def full(cls, num_layers: int = 93) -> Schedule:
        """Full AttnRes: every sublayer output is its own source (block size 1 sublayer)."""
        return cls(num_layers, 1)

    @property
    def num_sublayers(self) -> int:
        """``2L`` sublayer calls (attention and MLP of every layer)."""
        return 2 * self.num_layers

    @property
    def num_calls(self) -> int:
        """``2L + 1`` AttnRes calls: every sublayer and the final output."""
        return self.num_sublayers + 1

    def block_of(self, s: int) -> int:
        """Index ``k`` of the block call ``s`` belongs to."""
        return s // self.block_sublayers

    def closes_block(self, s: int) -> bool:
        """True if sublayer ``s`` is the last of its block (its output completes a stored block)."""
        return (s + 1) % self.block_sublayers == 0

    def calls(self) -> tuple[Call, ...]:
        """Every call in order with its explicit source list (computed once per schedule)."""
        return _calls(self)

    @property
    def max_sources(self) -> int:
        """The most sources any call mixes (9 for K3)."""
        return max(len(c.sources) for c in self.calls())


@cache
def _calls(schedule: Schedule) -> tuple[Call, ...]:
    B = schedule.block_sublayers
    out = []
    for s in range(schedule.num_calls):
        k, j = divmod(s, B)
        stored = [Source(EMBEDDING)] + [Source(BLOCK, b * B, (b + 1) * B) for b in range(k)]
        partial = [Source(PARTIAL, k * B, s)] if j else []
        side = OUTPUT if s == schedule.num_sublayers else (ATTENTION, MLP)[s % 2]
        out.append(Call(s, min(s // 2, schedule.num_layers - 1), side, tuple(stored + partial)))
    return tuple(out)

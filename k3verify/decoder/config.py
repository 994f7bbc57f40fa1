"""The K3 decoder stack's layout: which module every layer runs, and its sizes (docs/model.md §0).

93 layers; token mixers ``(KDA, KDA, KDA, MLA) × 23`` and one more MLA (0-indexed MLA layers 3,
7, …, 91 and 92: 24 MLA, 69 KDA); channel mixers a dense SiTU MLP at layer 0 and Stable
LatentMoE after it; Block AttnRes before every sublayer (its own weights per call), blocks of 12
layers (8 depth blocks for 93 layers, the embedding as block 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..attnres.schedule import Schedule
from ..kda.layer import KDAConfig
from ..mla.layer import MLAConfig
from ..moe.inputs import MoEConfig
from ..numerics.validate import require_positive_int

KDA, MLA, DENSE, MOE, ATTNRES = "kda", "mla", "dense", "moe", "attnres"
MODULES = (KDA, MLA, DENSE, MOE, ATTNRES)
# The sublayers of a layer, in order: the token mixer (call 2l) and the channel mixer (2l + 1).
TOKEN, CHANNEL = "token", "channel"


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the stack. ``hidden`` is every module's width; ``distinct_layers`` (when set)
    makes a pool of that many weight sets per module type, layer ``l`` using entry ``l mod n``
    (a wide stack that would not fit otherwise; reports say so). ``gate_bias`` is the mean of
    KDA's ``dt_bias``: with ``g = g_min σ(z + dt_bias)`` a bias of 2 puts most decays near the
    −5 bound, as trained K3 layers hold many fast-forgetting channels. ``attnres_logit_scale``
    bounds every AttnRes logit (``‖w ⊙ γ‖ √d``)."""

    hidden: int = 256
    num_layers: int = 93
    block_size: int = 12
    kda: KDAConfig = field(default_factory=lambda: KDAConfig(hidden=256, heads=4, head_dim=32, gate_rank=32))
    mla: MLAConfig = field(default_factory=lambda: MLAConfig(
        hidden_size=256, num_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32))
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(
        hidden_size=256, num_experts=16, top_k=4, latent_size=64, expert_hidden=48))
    dense_hidden: int = 512
    distinct_layers: int | None = None
    gate_bias: float = 2.0
    attnres_logit_scale: float = 8.0
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "num_layers", "block_size", "dense_hidden", "page_size"):
            require_positive_int(name, getattr(self, name))
        if self.distinct_layers is not None:
            require_positive_int("distinct_layers", self.distinct_layers)
        widths = {"kda.hidden": self.kda.hidden, "mla.hidden_size": self.mla.hidden_size,
                  "moe.hidden_size": self.moe.hidden_size}
        wrong = {n: w for n, w in widths.items() if w != self.hidden}
        if wrong:
            raise ValueError(f"every module must have the stack's width {self.hidden}; got {wrong}")

    @classmethod
    def cpu(cls, **changes: object) -> DecoderConfig:
        """All 93 layers at d = 256, 4 heads, 16 experts top 4: a walk in seconds on a CPU."""
        return replace(cls(), **changes)  # type: ignore[arg-type]

    @classmethod
    def wide(cls, *, num_experts: int = 16, distinct_layers: int | None = 4, **changes: object) -> DecoderConfig:
        """K3's widths (d 7168, 96 KDA and MLA heads, latent 3584, expert hidden 3072, shared 6144)
        with ``num_experts`` experts (top ``min(16, num_experts // 2)``) and a pool of
        ``distinct_layers`` weight sets per module type, for a GPU."""
        moe = MoEConfig(num_experts=num_experts, top_k=min(16, max(1, num_experts // 2)))
        base = cls(hidden=7168, kda=KDAConfig(), mla=MLAConfig(), moe=moe, dense_hidden=18432,
                   distinct_layers=distinct_layers, page_size=64)
        return replace(base, **changes)  # type: ignore[arg-type]

    @property
    def schedule(self) -> Schedule:
        """The AttnRes schedule: ``num_layers`` layers in blocks of ``block_size``."""
        return Schedule.layers(self.block_size, self.num_layers)

    def token_mixer(self, layer: int) -> str:
        """``"mla"`` for 0-indexed layers 3, 7, … and the last; ``"kda"`` otherwise."""
        return MLA if (layer + 1) % 4 == 0 or layer == self.num_layers - 1 else KDA

    def channel_mixer(self, layer: int) -> str:
        """``"dense"`` for layer 0, ``"moe"`` after it."""
        return DENSE if layer == 0 else MOE

    def module_of(self, sublayer: int) -> str:
        """The module sublayer call ``s`` runs (``2l``: layer ``l``'s token mixer, ``2l + 1``: its channel mixer)."""
        layer, side = divmod(sublayer, 2)
        return self.token_mixer(layer) if side == 0 else self.channel_mixer(layer)

    def pool_index(self, layer: int) -> int:
        """Which weight set layer ``layer`` uses (itself unless the weights are pooled)."""
        return layer if self.distinct_layers is None else layer % self.distinct_layers

    def counts(self) -> dict[str, int]:
        """Sublayers per module type (K3: 69 KDA, 24 MLA, 1 dense, 92 MoE) and AttnRes calls (187)."""
        out = {m: 0 for m in MODULES}
        for s in range(2 * self.num_layers):
            out[self.module_of(s)] += 1
        out[ATTNRES] = 2 * self.num_layers + 1
        return out

    def describe(self) -> dict[str, object]:
        """Plain data for reports."""
        return {
            "hidden": self.hidden, "num_layers": self.num_layers, "block_size": self.block_size,
            "kda": {"heads": self.kda.heads, "head_dim": self.kda.head_dim, "g_min": self.kda.g_min},
            "mla": {"heads": self.mla.num_heads, "kv_lora_rank": self.mla.kv_lora_rank,
                    "qk_rope_head_dim": self.mla.qk_rope_head_dim, "q_lora_rank": self.mla.q_lora_rank},
            "moe": {"experts": self.moe.num_experts, "top_k": self.moe.top_k, "latent": self.moe.latent_size,
                    "expert_hidden": self.moe.expert_hidden},
            "dense_hidden": self.dense_hidden, "distinct_layers": self.distinct_layers,
            "gate_bias": self.gate_bias, "page_size": self.page_size, "seed": self.seed,
            "sublayers": self.counts(),
        }

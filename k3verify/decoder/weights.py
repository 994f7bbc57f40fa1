"""Random weights for the whole stack, one set per layer (or a pool), made once in fp64.

Every value is rounded to bf16 first, so the same parameters serve an fp64 walk and a bf16
walk exactly: a low-precision walk then differs from the fp64 one by its own arithmetic only.
Scales: fan-in scaled projections (unit-RMS activations for unit-RMS inputs), norm gains near 1,
KDA's ``dt_bias`` centred on :attr:`DecoderConfig.gate_bias` (decays near the −5 bound), AttnRes
logits bounded by :attr:`DecoderConfig.attnres_logit_scale`.
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass, field, fields, replace

import torch

from ..attnres.layer import AttnResWeights
from ..attnres.layer import init_weights as attnres_init
from ..kda.layer import KDAWeights
from ..kda.layer import init_weights as kda_init
from ..mla.layer import MLAWeights
from ..mla.layer import init_weights as mla_init
from ..moe.inputs import MoEWeights
from ..moe.layer import init_weights as moe_init
from ..numerics import round_to
from .config import DENSE, KDA, MLA, MOE, DecoderConfig

REPRESENTABLE = "bf16"


def _representable(obj: object) -> object:
    """A dataclass of tensors with every float tensor rounded to bf16 (kept fp64)."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}  # type: ignore[arg-type]
    return replace(obj, **{n: round_to(t, REPRESENTABLE) for n, t in values.items()  # type: ignore[type-var]
                           if isinstance(t, torch.Tensor) and t.is_floating_point()})


@dataclass(frozen=True)
class DenseWeights:
    """Layer 0's dense SiTU MLP: ``w1, w3:[d, hidden]``, ``w2:[hidden, d]``."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


@dataclass
class DecoderWeights:
    """Weights of every layer: ``layers[l]`` maps the module names of layer ``l`` (its token and
    channel mixer) to their weights (pooled layers share objects); ``attnres`` holds every call's
    pseudo-query, key gain and the sublayers' input norms. Casts to a dtype are made once."""

    config: DecoderConfig
    layers: list[dict[str, object]]
    attnres: AttnResWeights
    _cast: dict = field(default_factory=dict, repr=False)

    def of(self, layer: int, module: str, dtype: torch.dtype = torch.float64,
           device: torch.device | str = "cpu") -> object:
        """The weights of ``module`` at ``layer`` in ``dtype`` on ``device`` (a cached copy; fp64
        on the CPU is the original)."""
        w = self.layers[layer][module]
        device = torch.device(device)
        if dtype == torch.float64 and device.type == "cpu":
            return w
        key = (id(w), dtype, device)
        if key not in self._cast:
            self._cast[key] = replace(w, **{f.name: getattr(w, f.name).to(device, dtype)  # type: ignore[arg-type]
                                            for f in fields(w) if getattr(w, f.name).is_floating_point()})
        return self._cast[key]

    def attnres_on(self, device: torch.device | str) -> AttnResWeights:
        """The AttnRes weights (fp64) on ``device``."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.attnres
        key = ("attnres", device)
        if key not in self._cast:
            self._cast[key] = AttnResWeights(*(t.to(device) for t in (self.attnres.w, self.attnres.gamma,
                                                                       self.attnres.norm)))
        return self._cast[key]


def init_weights(cfg: DecoderConfig) -> DecoderWeights:
    """Deterministic weights for ``cfg`` (from ``cfg.seed``), bf16-representable, fp64."""
    sets = {(module, cfg.pool_index(layer)): None for layer in range(cfg.num_layers)
            for module in (cfg.token_mixer(layer), cfg.channel_mixer(layer))}

    def make(key: tuple[str, int]) -> object:
        module, index = key
        return _make(cfg, module, seed=cfg.seed * 100_003 + 1_009 * index + hash_module(module))

    # Each set has its own seeded generator, so drawing them side by side gives the same values;
    # torch's CPU generator draws on one core, and the wide stack's 1.5e9 values took minutes.
    with concurrent.futures.ThreadPoolExecutor(min(len(sets), os.cpu_count() or 1)) as pool:
        made = dict(zip(sets, pool.map(make, sets), strict=True))
    layers = [{module: made[(module, cfg.pool_index(layer))]
               for module in (cfg.token_mixer(layer), cfg.channel_mixer(layer))} for layer in range(cfg.num_layers)]
    attnres = attnres_init(cfg.schedule, cfg.hidden, logit_scale=cfg.attnres_logit_scale, seed=cfg.seed + 17,
                           representable=REPRESENTABLE)
    return DecoderWeights(cfg, layers, attnres)


def hash_module(module: str) -> int:
    """A small stable number per module name (seeds differ between module types of a layer)."""
    return {KDA: 1, MLA: 2, DENSE: 3, MOE: 4}[module]


def _make(cfg: DecoderConfig, module: str, *, seed: int) -> object:
    if module == KDA:
        w: KDAWeights = kda_init(cfg.kda, seed=seed)
        gen = torch.Generator().manual_seed(seed + 5)
        dt_bias = cfg.gate_bias + torch.randn(w.dt_bias.shape, generator=gen, dtype=torch.float64)
        return _representable(replace(w, dt_bias=dt_bias))
    if module == MLA:
        m: MLAWeights = mla_init(cfg.mla, seed=seed)
        return _representable(m)
    if module == MOE:
        e: MoEWeights = moe_init(cfg.moe, seed=seed)
        return _representable(e)
    gen = torch.Generator().manual_seed(seed)
    d, h = cfg.hidden, cfg.dense_hidden
    return _representable(DenseWeights(
        w1=torch.randn(d, h, generator=gen, dtype=torch.float64) * d**-0.5,
        w3=torch.randn(d, h, generator=gen, dtype=torch.float64) * d**-0.5,
        w2=torch.randn(h, d, generator=gen, dtype=torch.float64) * h**-0.5,
    ))

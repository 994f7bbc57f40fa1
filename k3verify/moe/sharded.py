"""Stable LatentMoE sharded over tensor-parallel ranks, as vLLM shards it (docs/model.md §0: TP = 8).

Every routed expert's hidden dimension is split across the ranks (3072 -> 384 at TP = 8):
rank ``r`` holds columns ``r H/N .. (r+1) H/N`` of ``W1, W3`` and the same rows of ``W2``; the
merged shared expert is split the same way. The router, ``W↓``, ``γ`` and ``W↑`` are
replicated. SiTU acts element by element on the hidden units, so each rank's expert outputs
are exact partial sums of the latent ``u``; the partial latents and the partial shared outputs
are all-reduced, and only then ``RMSNorm_γ(u) W↑`` — the norm of a partial sum is not a partial
sum of norms.

:func:`partials` is one rank's share without communication (also the reference a test holds
each rank to); :func:`rank_forward` is what a rank runs under
:func:`k3verify.harness.tp.run_ranks`; :func:`unsharded` is the layer on one process;
:func:`make_call` builds the inputs every rank and the parent build alike. Stored results are
rounded to ``dtype`` and computed in fp32 (fp64 for fp64), as :func:`k3verify.moe.naive_baseline`
does unsharded; the all-reduce runs in ``reduce_dtype``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..numerics import all_reduce, resolve_dtype
from ..numerics.ops import rms_norm
from .inputs import MoEConfig, MoEWeights, Routing, check_inputs
from .layer import init_weights
from .recurrent import naive_baseline, recurrent
from .router import routing_for
from .situ import activation

# Wrong placements a test plants to show the checks catch them.
PLANTS = ("norm_before_reduce", "die")


@dataclass(frozen=True)
class ShardedCall:
    """What every rank is given: the full inputs (each rank slices its own share)."""

    x: torch.Tensor
    weights: MoEWeights
    config: MoEConfig
    dtype: str = "fp64"
    reduce_dtype: str = "fp64"
    routing: Routing | None = None
    plant: str | None = None  # one of PLANTS, on every rank (``die``: on the last rank only)


# K3's widths (d, latent, expert and shared hidden) with few experts: 896 of them would not fit
# in fp64 on one host; the expert count is not what sharding splits.
K3_WIDTHS = MoEConfig(num_experts=8, top_k=4)


def make_call(size: str, seed: int, world_size: int) -> ShardedCall:
    """``small`` (the ``default`` case's layer and 64 tokens, biases from Quantile Balancing) or
    ``k3`` (:data:`K3_WIDTHS`, 32 tokens, zero bias), from ``seed``."""
    from . import samples

    if size == "small":
        cfg, w, T = samples.CONFIG, samples.calibrated_weights(samples.CONFIG, seed=seed), samples.TOKENS
    elif size == "k3":
        cfg, T = K3_WIDTHS, 32
        w = init_weights(cfg, seed=seed)
    else:
        raise ValueError(f"size must be 'small' or 'k3', got {size!r}")
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return ShardedCall(x, w, cfg)


def unsharded(call: ShardedCall) -> dict[str, torch.Tensor]:
    """The layer on one process: ``{"y": [T, d]}``, the definition in fp64, else the plain
    implementation storing ``call.dtype``."""
    if call.dtype == "fp64":
        return {"y": recurrent(call.x, call.weights, call.config, routing=call.routing)}
    return {"y": naive_baseline(call.x, call.weights, call.config, dtype=call.dtype, routing=call.routing)}


def shard(weights: MoEWeights, rank: int, world_size: int) -> MoEWeights:
    """Rank ``rank``'s slice of the expert and shared hidden dimensions (both must divide)."""
    H, Hs = weights.w1.shape[-1], weights.shared_w1.shape[-1]
    for name, n in (("expert hidden", H), ("shared hidden", Hs)):
        if n % world_size:
            raise ValueError(f"{name} size {n} does not split over {world_size} ranks")
    e, s = slice(rank * H // world_size, (rank + 1) * H // world_size), slice(
        rank * Hs // world_size, (rank + 1) * Hs // world_size)  # fmt: skip
    return replace(weights, w1=weights.w1[..., e], w3=weights.w3[..., e], w2=weights.w2[:, e],
                   shared_w1=weights.shared_w1[:, s], shared_w3=weights.shared_w3[:, s],
                   shared_w2=weights.shared_w2[s])  # fmt: skip


def partials(call: ShardedCall, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s partial latent ``u:[T, Dl]`` and partial shared output ``y_s:[T, d]``,
    before any communication (fp32; fp64 for fp64)."""
    dims = check_inputs(call.x, call.weights, call.config, call.routing)
    dtype = resolve_dtype(call.dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    cfg = call.config

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).to(acc)

    r = routing_for(call.x, call.weights, cfg, call.routing, acc)  # replicated: every rank routes alike
    w = shard(call.weights, rank, world_size)
    x = rnd(call.x.to(acc))

    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return activation(rnd(g), rnd(u), cfg.activation, beta1=cfg.beta1, beta2=cfg.beta2)

    z = rnd(x @ rnd(w.w_latent_down))
    # Expert by expert (a gather of every pair's weights would hold T k copies of a matrix:
    # gigabytes at K3's widths); each token's k terms are summed in slot order below.
    terms = torch.zeros(dims.T, dims.k, dims.Dl, dtype=acc, device=x.device)
    for e in r.indices.unique().tolist():
        tok, slot = (r.indices == e).nonzero(as_tuple=True)
        h = rnd(act(z[tok] @ rnd(w.w1[e]), z[tok] @ rnd(w.w3[e])))
        terms[tok, slot] = rnd(h @ rnd(w.w2[e])) * r.weights[tok, slot, None]
    u = rnd(terms.sum(1))
    y_s = rnd(rnd(act(x @ rnd(w.shared_w1), x @ rnd(w.shared_w3))) @ rnd(w.shared_w2))
    return {"u": u, "y_s": y_s}


def rank_forward(rank: int, world_size: int, call: ShardedCall) -> dict[str, torch.Tensor]:
    """One rank's forward: its partials, the all-reduces, then ``y = RMSNorm_γ(u) W↑ + y_s``.

    Returns what the rank sent to the all-reduces (``u sent``, ``y_s sent``), what it got
    back (``u``) and its output ``y``: every rank must hold the same ``u`` and ``y``."""
    share = partials(call, rank, world_size)
    acc, cfg = share["u"].dtype, call.config
    dtype = resolve_dtype(call.dtype)
    gamma = call.weights.latent_norm.to(dtype).to(acc)
    sent = share["u"]
    if call.plant == "norm_before_reduce":
        sent = rms_norm(sent, gamma, eps=cfg.rms_norm_eps)
    if call.plant == "die" and rank == world_size - 1:
        os._exit(3)  # a rank lost mid-collective: the others must not wait for ever
    u = all_reduce(sent, call.reduce_dtype).to(dtype).to(acc)
    y_s = all_reduce(share["y_s"], call.reduce_dtype).to(dtype).to(acc)
    normed = u if call.plant == "norm_before_reduce" else rms_norm(u, gamma, eps=cfg.rms_norm_eps)
    w_up = call.weights.w_latent_up.to(dtype).to(acc)
    y = (normed.to(dtype).to(acc) @ w_up).to(dtype).to(acc) + y_s
    return {"u sent": sent, "y_s sent": share["y_s"], "u": u, "y": y.to(dtype).to(acc)}

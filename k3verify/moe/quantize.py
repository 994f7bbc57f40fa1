"""How a low-precision MoE stores tensors: GEMM operands in the operand dtype, results in the output dtype.

bf16 and fp16 operands are plain roundings (:func:`k3verify.numerics.round_to`). fp8 e4m3
operands carry a scale, chosen by ``fp8_scaling`` (:class:`~k3verify.moe.inputs.FormOptions`):

``per_row``
    dynamic: ``scale = amax / 448`` per token row of an activation and per output column of a
    weight (``x @ W`` layout: the amax runs over the contraction axis). Codes never overflow;
    one large entry costs its row's small entries their precision.
``per_tensor``
    dynamic: one ``amax / 448`` per activation tensor and per weight matrix (per expert).
``static``
    activations are divided by the fixed ``fp8_static_scale`` (a calibrated input scale, as in
    checkpoints with ``input_scale``), so a value past ``448 × scale`` overflows; weights are
    quantised offline per output column.

An all-zero row or matrix gets scale 1. The dequantised value ``code × scale`` (computed in
fp32) is what the emulated tensor core multiplies; an overflow turns into NaN (e4m3fn has no
inf), and a non-finite amax makes the whole row NaN, so overflow is never silently saturated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import facts, is_float8
from ..numerics.trace import TracingRounder
from .inputs import FormOptions


@dataclass
class Caster:
    """Rounds what a kernel stores and records overflow events (``rounder.events``) when tracing."""

    opts: FormOptions
    rounder: TracingRounder

    @classmethod
    def make(cls, opts: FormOptions, *, trace: bool = False) -> Caster:
        return cls(opts, TracingRounder(opts.operand_dtype, overflow=opts.overflow, trace=trace))

    def operand(self, name: str, t: torch.Tensor, *, weight: bool = False) -> torch.Tensor:
        """``t`` as a GEMM operand: rounded to the operand dtype (with its fp8 scale), held in the accumulator.

        ``weight``: ``t`` is ``[..., K, N]`` (scaled per output column); otherwise ``[..., rows, K]``.
        """
        acc = self.opts.accumulator
        t = t.to(acc)
        if not is_float8(self.opts.operand_dtype):
            return self.rounder(name, t).to(acc)
        scale = self._scale(t, weight)
        return self.rounder(name, t / scale) * scale

    def output(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` rounded to the output dtype, held in the accumulator dtype."""
        return self.rounder(name, t, self.opts.output_dtype).to(self.opts.accumulator)

    def _scale(self, t: torch.Tensor, weight: bool) -> torch.Tensor:
        scaling = self.opts.fp8_scaling
        if scaling == "static" and not weight:
            return torch.full((), self.opts.fp8_static_scale, dtype=t.dtype)
        if scaling == "per_tensor":
            dims = (-2, -1) if weight else tuple(range(t.dim()))
        else:
            dims = (-2,) if weight else (-1,)
        amax = t.abs().amax(dim=dims, keepdim=True) if t.numel() else torch.ones((), dtype=t.dtype)
        scale = torch.where(amax > 0, amax / facts(self.opts.operand_dtype).max, torch.ones_like(amax))
        return torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))

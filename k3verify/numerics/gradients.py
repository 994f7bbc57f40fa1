"""Gradients of a form through torch.autograd, and the loss every backward is judged on.

A backward is judged on the vector-Jacobian product of a forward: for cotangents ``c_o`` of its
outputs ``o`` (the case holds them, drawn at random), the gradients of
``L = sum_o sum(o * c_o)`` with respect to every input. fla-core's KDA tests use the same loss
(``sum(o * do) + sum(S_T * dS_T)``). Computed on fp64 inputs, this is the gradient oracle: autograd
differentiates the definition exactly, and fp64 stays fp64 throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def grad_name(name: str) -> str:
    """The gradient output's name for input ``name``: ``q -> dq``, ``A_log -> dA_log``."""
    return f"d{name}"


def vjp(
    forward: Callable[..., Mapping[str, torch.Tensor]],
    inputs: Mapping[str, torch.Tensor | None],
    cotangents: Mapping[str, torch.Tensor],
    *,
    wrt: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """``{d<name>: dL/d<name>}`` for ``L = sum_o sum(forward(**inputs)[o] * cotangents[o])``.

    ``inputs`` are passed to ``forward`` by keyword (``None`` as it is); the floating tensors
    named in ``wrt`` (default: every floating tensor) are differentiated. An input the loss does
    not reach gets a zero gradient, not ``None``. Each gradient has its input's shape and dtype.
    """
    names = tuple(n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.is_floating_point())
    names = names if wrt is None else tuple(n for n in wrt if n in names)
    leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in names}
    with torch.enable_grad():
        out = forward(**{**inputs, **leaves})
        missing = [o for o in cotangents if o not in out]
        if missing:
            raise KeyError(f"the forward returned no {', '.join(missing)} (it returned {', '.join(out)})")
        # A forward may compute on another device (an adapter's CUDA kernel): the cotangent follows it.
        loss = sum((out[o] * c.to(out[o].device, out[o].dtype)).sum() for o, c in cotangents.items())
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {grad_name(n): (g if g is not None else torch.zeros_like(leaves[n])).detach()
            for n, g in zip(leaves, grads)}

"""What an implementation may touch: copies of its case's inputs, never the case itself, and no
process-wide torch setting.

A case carries the oracle's outputs in its cache and is shared by every row of a run, so an
implementation that is not k3verify's own receives :func:`sealed` copies (cloned inputs, no
cache). Process-wide torch settings (default dtype, flush-to-zero, TF32, thread count...) change
the results of every later computation, the oracle's included; :func:`torch_state` records them
around each call and :func:`restore` puts back what a call changed, which the caller reports as
that call's failure.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .registry import BUILTIN_SOURCE, Case, Implementation


def sealed(case: Case) -> Case:
    """A copy of ``case`` for an implementation: deep-copied inputs and parameters, empty cache
    (which holds the oracle's and baselines' outputs)."""
    return Case(case.name, copy.deepcopy(case.inputs), copy.deepcopy(case.params))


def case_for(impl: Implementation, case: Case) -> Case:
    """What ``impl`` receives: k3verify's own forms share the case (they read the cached exact
    quantities their predictions need); every other implementation gets a :func:`sealed` copy."""
    return case if impl.source == BUILTIN_SOURCE else sealed(case)


def _denormals_kept(dtype: torch.dtype) -> bool:
    # No getter exists for flush-to-zero; a subnormal times one survives only while it is off.
    tiny = torch.finfo(dtype).smallest_normal / 4
    return bool((torch.tensor(tiny, dtype=dtype) * 1.0).item() != 0.0)


@dataclass(frozen=True)
class Setting:
    """One process-wide torch setting: how to read it and how to put a value back."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], Any]


def _set_attr(obj: Any, attr: str) -> Callable[[Any], None]:
    def write(value: Any) -> None:
        setattr(obj, attr, value)

    return write


def _settings() -> list[Setting]:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    out = [
        Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        Setting("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        Setting("intra-op threads", torch.get_num_threads, torch.set_num_threads),
        Setting("flush denormals", lambda: not _denormals_kept(torch.float32), torch.set_flush_denormal),
        Setting("deterministic algorithms", torch.are_deterministic_algorithms_enabled,
                torch.use_deterministic_algorithms),
        Setting("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        Setting("cuda.matmul.allow_tf32", lambda: matmul.allow_tf32, _set_attr(matmul, "allow_tf32")),
        Setting("cuda.matmul.allow_fp16_reduced_precision_reduction",
                lambda: matmul.allow_fp16_reduced_precision_reduction,
                _set_attr(matmul, "allow_fp16_reduced_precision_reduction")),
        Setting("cuda.matmul.allow_bf16_reduced_precision_reduction",
                lambda: matmul.allow_bf16_reduced_precision_reduction,
                _set_attr(matmul, "allow_bf16_reduced_precision_reduction")),
        Setting("cudnn.allow_tf32", lambda: cudnn.allow_tf32, _set_attr(cudnn, "allow_tf32")),
        Setting("cudnn.enabled", lambda: cudnn.enabled, _set_attr(cudnn, "enabled")),
        Setting("cudnn.deterministic", lambda: cudnn.deterministic, _set_attr(cudnn, "deterministic")),
        Setting("mkldnn.enabled", lambda: torch.backends.mkldnn.enabled,
                _set_attr(torch.backends.mkldnn, "enabled")),
    ]
    if hasattr(torch, "get_default_device"):
        out.append(Setting("default device", lambda: str(torch.get_default_device()), torch.set_default_device))
    return out


SETTINGS = _settings()


def torch_state() -> dict[str, Any]:
    """Every setting of :data:`SETTINGS` by name (a setting that cannot be read here is left out)."""
    state = {}
    for s in SETTINGS:
        try:
            state[s.name] = s.read()
        except Exception:  # a backend this build lacks has nothing to protect
            continue
    return state


def restore(before: dict[str, Any]) -> list[str]:
    """Put back every setting that differs from ``before``; ``"name: was -> now"`` for each."""
    now = torch_state()
    changed = []
    for s in SETTINGS:
        if s.name in before and now.get(s.name) != before[s.name]:
            changed.append(f"{s.name}: {before[s.name]} -> {now.get(s.name)}")
            try:
                s.write(before[s.name])
            except Exception as exc:  # named, so the report says the process is no longer clean
                changed[-1] += f" (could not be restored: {type(exc).__name__})"
    return changed


class StateChanged(RuntimeError):
    """An implementation left a process-wide torch setting changed (it has been put back)."""

    def __init__(self, who: str, changes: list[str]):
        super().__init__(f"{who} changed process-wide torch settings, which change every later result "
                         f"(restored): {'; '.join(changes)}")
        self.changes = changes


def guarded(who: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, then :class:`StateChanged` if it left a process-wide torch setting changed."""
    before = torch_state()
    try:
        result = fn()
    finally:
        changes = restore(before)
    if changes:
        raise StateChanged(who, changes)
    return result
